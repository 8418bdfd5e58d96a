"""chenzhenhua986/CAFFE-CapsNet's capsule layers (caffeq/layers/capsnet.py) against loops written here from its GPU
kernels (and Squash's and CapsuleMask's CPU code, the only ones), in torch, onnxruntime and model.py."""

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32
NET = [
    'layer { name: "reshape" type: "CapsuleReshape" bottom: "x" top: "caps" capsule_reshape_param { capsule_dim: 4 } }',
    'layer { name: "squash1" type: "Squash" bottom: "caps" top: "sq1" squash_param { capsule_dim: 4 } }',
    'layer { name: "cap_transform" type: "CapsuleTransform" bottom: "sq1" top: "u" capsule_transform_param { '
    'input_capsule_dim: 4 output_capsule_dim: 3 output_capsule_num: 5 bias_filler { type: "gaussian" std: 0.1 } } }',
    'layer { name: "cap_routing" type: "CapsuleRouting" bottom: "u" top: "v" capsule_routing_param { '
    'input_capsule_num: 24 output_capsule_dim: 3 output_capsule_num: 5 } }',
    'layer { name: "squash3" type: "Squash" bottom: "v" top: "sq3" squash_param { capsule_dim: 3 } }',
    'layer { name: "cap_len" type: "CapsuleLen" bottom: "sq3" top: "len" capsule_len_param { num_class: 5 } }',
    'layer { name: "mask" type: "CapsuleMask" bottom: "v" top: "masked" capsule_mask_param { class_num: 5 } }',
]


def squash_ref(s):
    """squash_layer.cpp: s (1 - e^-r) / r, r = sqrt(float32 sum of squares + 1e-7 + 1e-7)."""
    q = (s.astype(F32) ** 2).sum(-1, keepdims=True, dtype=F32) + F32(1e-7)
    r = np.sqrt(q.astype(np.float64) + 1e-7)
    return s * ((1 - np.exp(-r)) / r).astype(F32)


def test_squash_worked_example():
    model = load_from_text(net(NET[1].replace('"caps"', '"x"').replace("capsule_dim: 4", "capsule_dim: 2"),
                               inputs={"x": (1, 2)}))
    got = model.run({"x": np.array([[3, 4]], F32)})["sq1"]
    np.testing.assert_allclose(got, [[0.5959573, 0.7946097]], rtol=1e-6)     # Sabour's would be (0.5769, 0.7692)


def test_capsule_layers_match_the_kernels(tmp_path):
    x = rng(90).standard_normal((2, 8, 3, 4)).astype(F32)           # C 8 = 2 groups of 4, 12 positions: 24 capsules
    model = load_from_text(net(*NET, inputs={"x": x.shape}), random_weights=True,
                           outputs=["caps", "sq1", "u", "v", "sq3", "len", "masked"])
    w_t, b_t = (np.asarray(b) for b in node_of(model, "cap_transform").blobs)
    w_r = np.asarray(node_of(model, "cap_routing").blobs[0])
    assert w_t.shape == (24, 4, 15) and b_t.shape == (360,) and w_r.shape == (5, 24)
    caps = np.empty((2, 24, 4), F32)
    for b in range(2):                       # top[b, g P + p, k] = x[b, g d + k, p]
        for g in range(2):
            for p in range(12):
                for k in range(4):
                    caps[b, g * 12 + p, k] = x[b, g * 4 + k, p // 4, p % 4]
    sq1 = squash_ref(caps)
    u = np.einsum("bjk,jko->bjo", sq1.astype(np.float64), w_t) + b_t.reshape(24, 15)
    v = np.einsum("ij,bjie->bie", w_r.astype(np.float64), u.reshape(2, 24, 5, 3))
    sq3 = squash_ref(v.astype(F32))
    lengths = (sq3.astype(np.float64) ** 2).sum(-1)               # the GPU's sum of squares, no root
    masked = np.zeros_like(v)
    masked[:, -1] = v[:, -1]                                       # the last capsule always wins
    check_everywhere(model, {"x": x}, {"caps": caps, "sq1": sq1, "u": u, "v": v, "sq3": sq3, "len": lengths,
                                       "masked": masked}, tmp_path, atol=2e-5, rtol=1e-4)


def test_capsule_sizes_are_checked():
    with pytest.raises(CaffeqError, match="capsule_dim 3 must divide"):
        load_from_text(net(NET[0].replace("capsule_dim: 4", "capsule_dim: 3"), inputs={"x": (1, 8, 2, 2)}))
    with pytest.raises(CaffeqError, match="input_capsule_num 24"):
        load_from_text(net(NET[3].replace('"u"', '"x"', 1), inputs={"x": (1, 20, 15)}))


def routing_ref(x, w, bias, n_out, d_out):
    """cap_layer.cu's first call: three rounds of softmax over the output capsules (logits from 0), the weighted
    sum s, Sabour's squash v = s q / (1 + q) / sqrt(q + 1e-7), logits += v . u; the last s plus the bias."""
    m, n_in = x.shape[0], w.shape[0]
    u = np.einsum("bjk,jko->bjo", x.reshape(m, n_in, -1).astype(np.float64), w).reshape(m, n_in, n_out, d_out)
    logits = np.zeros((m, n_out, n_in))
    for _ in range(3):
        c = np.exp(logits - logits.max(1, keepdims=True))
        c /= c.sum(1, keepdims=True)
        s = np.einsum("bij,bjie->bie", c, u)
        q = (s * s).sum(-1, keepdims=True)
        v = s * q / (1 + q) / np.sqrt(q + 1e-7)
        logits += np.einsum("bie,bjie->bij", v, u)
    return s + bias.reshape(n_out, d_out)


def test_cap_routes_by_agreement_from_zero_logits(tmp_path):
    x = rng(91).standard_normal((2, 6, 4)).astype(F32)
    model = load_from_text(net('layer { name: "capsule" type: "Cap" bottom: "x" top: "v" cap_param { '
                               'input_capsule_dim: 4 output_capsule_dim: 3 output_capsule_num: 5 routing_num: 3 '
                               'bias_filler { type: "gaussian" std: 0.5 } } }', inputs={"x": x.shape}),
                           random_weights=True)
    w, b = (np.asarray(v) for v in node_of(model, "capsule").blobs)
    assert w.shape == (6, 4, 15) and b.shape == (15,)
    check_everywhere(model, {"x": x}, {"v": routing_ref(x, w, b, 5, 3)}, tmp_path, atol=2e-5, rtol=1e-4)


def test_capsule_relu_zeroes_long_capsules_in_place(tmp_path):
    x = (rng(92).standard_normal((2, 4, 3)) * 0.6).astype(F32)
    model = load_from_text(net('layer { name: "squash2" type: "Power" bottom: "x" top: "squash2" }',
                               'layer { name: "cap_relu1" type: "CapsuleRelu" bottom: "squash2" top: "squash2" '
                               'capsule_relu_param { dim: 3 thre: 0.99 } }', inputs={"x": x.shape}))
    length = np.sqrt((x.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-7)
    ref = np.where(length > F32(0.99), 0, x)
    assert 0 < (length > 0.99).sum() < 8
    check_everywhere(model, {"x": x}, {"squash2": ref}, tmp_path)
    with pytest.raises(CaffeqError, match="in place only"):
        load_from_text(net('layer { name: "r" type: "CapsuleRelu" bottom: "x" top: "y" capsule_relu_param { dim: 3 '
                           'thre: 0.9 } }', inputs={"x": x.shape}))
