"""zx12348163/cross_hashing_code's Binary, Weighted and FCWeighted (caffeq/layers/cross_hashing.py) against
formulas written here from its binary_layer.cpp, weighted_layer.cpp and fc_weighted_layer.cpp, in torch,
onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def binary_ref(x):
    """binary_layer.cpp: per sample, 0 where x > (Dtype)1 / D, else 1, D = count / num."""
    n = x.shape[0]
    flat = x.reshape(n, -1)
    level = F(1.0) / F(flat.shape[1])
    out = np.ones_like(flat)
    for i in range(n):
        for j in range(flat.shape[1]):
            if flat[i, j] > level:
                out[i, j] = 0
    return out.reshape(x.shape)


def test_attention_masks_of_the_iapr_nets(tmp_path):
    # the image branch: conv5_4 (N, C, H, W), a softmax over its H x W positions, Binary, Weighted; the text
    # branch: full2 (N, K), a softmax over K, Binary, FCWeighted
    n, c, h, w, k = 3, 5, 2, 4, 8
    text = net('layer { name: "ib" type: "Binary" bottom: "att" top: "imask" }',
               'layer { name: "iw" type: "Weighted" bottom: "x" bottom: "imask" top: "img" }',
               'layer { name: "tb" type: "Binary" bottom: "tatt" top: "tmask" }',
               'layer { name: "tw" type: "FCWeighted" bottom: "t" bottom: "tmask" top: "txt" }',
               inputs={"x": (n, c, h, w), "att": (n, h * w), "t": (n, k), "tatt": (n, k)})
    model = load_from_text(text)
    g = rng(3)
    x = g.standard_normal((n, c, h, w)).astype(F)
    att = g.uniform(0, 0.25, (n, h * w)).astype(F)
    att[0, :3] = F(1.0) / F(h * w)     # exactly the level: kept (the fork drops only what is above it)
    att[1, 2] = np.nan                 # NaN compares false: kept
    t = g.standard_normal((n, k)).astype(F)
    tatt = g.uniform(0, 0.25, (n, k)).astype(F)
    tatt[2, 1:4] = F(1.0) / F(k)
    imask, tmask = binary_ref(att), binary_ref(tatt)
    assert 0 < imask.sum() < imask.size and 0 < tmask.sum() < tmask.size
    assert imask[0, :3].tolist() == [1, 1, 1] and imask[1, 2] == 1
    refs = {"img": x * imask.reshape(n, 1, h, w), "txt": t * tmask}
    for name, ref in refs.items():
        assert model.blob_shapes[name] == ref.shape, name
    check_everywhere(model, {"x": x, "att": att, "t": t, "tatt": tatt}, refs, tmp_path, atol=0, rtol=0)
    masks = load_from_text(net('layer { name: "ib" type: "Binary" bottom: "att" top: "imask" }',
                               'layer { name: "tb" type: "Binary" bottom: "tatt" top: "tmask" }',
                               inputs={"att": (n, h * w), "tatt": (n, k)}))
    check_everywhere(masks, {"att": att, "tatt": tatt}, {"imask": imask, "tmask": tmask}, tmp_path / "m")


@pytest.mark.parametrize("layer, x, mask, message", [
    ("Weighted", (2, 3, 4), (2, 4), "4-axis first bottom"),
    ("Weighted", (2, 3, 2, 2), (2, 5), "must hold 4 values per sample"),
    ("Weighted", (2, 3, 2, 2), (3, 4), "first bottom's num 2"),
    ("FCWeighted", (2, 3, 1, 1), (2, 3), "2-axis first bottom"),
    ("FCWeighted", (2, 6), (2, 3, 1), "must hold 6 values per sample"),
])
def test_mask_products_refuse_what_the_fork_checks_or_misreads(layer, x, mask, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(f'layer {{ name: "w" type: "{layer}" bottom: "x" bottom: "m" top: "o" }}',
                           inputs={"x": x, "m": mask}))
