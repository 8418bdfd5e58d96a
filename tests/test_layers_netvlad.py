"""hyojinie/crn's NetVLAD layers (Netvlad, Intranorm, Spfilter) against loops written from netvlad_layer.cpp,
intranorm_layer.cpp and spfilter_layer.cpp, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def netvlad_ref(a, x, c):
    """Forward_cpu: per image and cluster, residual = features + centre (gemm alpha 1), then the assignment-
    weighted sum over positions, written to top[n, k D + d]."""
    n, k = a.shape[:2]
    d = x.shape[1]
    p = a.shape[2] * a.shape[3]
    out = np.zeros((n, k * d))
    for i in range(n):
        feats = x[i].reshape(d, p).astype(np.float64)
        for j in range(k):
            resid = feats + c[j].astype(np.float64)[:, None]
            for q in range(p):
                out[i, j * d:(j + 1) * d] += a[i, j].reshape(p)[q] * resid[:, q]
    return out.astype(f32)


def intranorm_ref(x, k):
    n = x.shape[0]
    flat = x.reshape(n, -1).astype(np.float64)
    sub = flat.shape[1] // k
    out = np.zeros_like(flat)
    for i in range(n):
        for j in range(k):
            block = flat[i, j * sub:(j + 1) * sub]
            out[i, j * sub:(j + 1) * sub] = block * (np.sum(block * block) + 1e-12) ** -0.5
    return out.reshape(x.shape).astype(f32)


def test_netvlad_and_intranorm_as_crns_deploy_net(tmp_path):
    # crn's deploy: softmax assignment (N, K, H, W), conv features (N, D, H, W) -> Netvlad -> Intranorm
    layers = ('layer { name: "vlad" type: "Netvlad" bottom: "a" bottom: "x" top: "v" '
              'netvlad_param { cluster_num: 3 local_dim: 4 vlad_dim: 12 } }',
              'layer { name: "intra" type: "Intranorm" bottom: "v" top: "n" intranorm_param { cluster_num: 3 } }')
    model = load_from_text(net(*layers, inputs={"a": (2, 3, 5, 6), "x": (2, 4, 5, 6)}), random_weights=True,
                           outputs=["v", "n"])
    assert model.blob_shapes["v"] == (2, 12) and model.blob_shapes["n"] == (2, 12)
    g = np.random.default_rng(9)
    centres = g.standard_normal((3, 4)).astype(f32)
    model.graph.node("vlad").blobs = [centres]
    model.clear_cache()
    a = g.random((2, 3, 5, 6)).astype(f32)
    x = g.standard_normal((2, 4, 5, 6)).astype(f32)
    v = netvlad_ref(a, x, centres)
    check_everywhere(model, {"a": a, "x": x}, {"v": v, "n": intranorm_ref(v, 3)}, tmp_path, atol=1e-4, rtol=1e-5)


def test_spfilter_weighs_every_channel_by_the_selector(tmp_path):
    # crn's rw_net: two maps gated by one (N, 1, H, W) reweighting map
    layer = 'layer { name: "sp" type: "Spfilter" bottom: "p" bottom: "q" bottom: "s" top: "pw" top: "qw" }'
    model = load_from_text(net(layer, inputs={"p": (2, 3, 4, 5), "q": (2, 2, 4, 5), "s": (2, 1, 4, 5)}))
    g = np.random.default_rng(10)
    p, q, s = (g.standard_normal(sh).astype(f32) for sh in [(2, 3, 4, 5), (2, 2, 4, 5), (2, 1, 4, 5)])
    check_everywhere(model, {"p": p, "q": q, "s": s}, {"pw": p * s, "qw": q * s}, tmp_path)


@pytest.mark.parametrize("text, message", [
    ('layer { name: "v" type: "Netvlad" bottom: "a" bottom: "x" top: "v" netvlad_param { cluster_num: 3 local_dim: 4 '
     'vlad_dim: 10 } }', "vlad_dim 10 must be cluster_num x local_dim"),
    ('layer { name: "v" type: "Netvlad" bottom: "a" bottom: "x" top: "v" netvlad_param { cluster_num: 2 local_dim: 4 '
     'vlad_dim: 8 } }', "assignment's 3 channels must be cluster_num 2"),
    ('layer { name: "n" type: "Intranorm" bottom: "x" top: "n" intranorm_param { cluster_num: 3 } }',
     "do not split into cluster_num 3 blocks"),
])
def test_netvlad_layers_refuse_what_the_fork_checks(text, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(text, inputs={"a": (1, 3, 2, 2), "x": (1, 4, 2, 2)}))
