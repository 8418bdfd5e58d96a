"""The bilinear pooling nets' layers (gy20073/compact_bilinear_pooling 1b7c58a signed_sqrt_layer.cu and
l2_normalize_layer.cu; ChaojianYu/Hierarchical-Bilinear-Pooling 034e848 sum_pooling_layer.cu).  The
references loop as the kernels do; L2Normalize's sum of squares is a reduction whose order the fork's
asum does not fix (compared to 1e-6)."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def test_signed_sqrt_keeps_the_sign_of_zero_and_nan(tmp_path):
    x = rng(1).standard_normal((2, 3, 4, 5)).astype(F) * 4
    x[0, 0, 0, :2] = [0.0, -0.0]
    want = np.where(x >= 0, np.sqrt(np.abs(x)), -np.sqrt(np.abs(x))).astype(F)
    want[0, 0, 0, 1] = -0.0                               # sqrt(-0.0) = -0.0 (x >= 0 holds)
    model = load_from_text(net('layer { name: "s" type: "SignedSqrt" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)
    assert np.signbit(model.run({"x": x})["o"][0, 0, 0, 1])
    x[0, 0, 0, :2] = [np.nan, -np.inf]
    got = model.run({"x": x})["o"][0, 0, 0, :2]
    assert np.isnan(got[0]) and got[1] == -np.inf


def l2_normalize_ref(x):
    n = x.shape[0]
    flat = x.reshape(n, -1)
    out = np.empty_like(flat)
    for i in range(n):
        normsqr = F(np.sum(flat[i].astype(np.float64) ** 2))
        scale = F(math.pow(float(F(normsqr + F(1e-7))), -0.5))
        out[i] = flat[i] * scale
    shape = (x.shape + (1, 1, 1))[:4]
    return out.reshape(shape)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7)])
def test_l2_normalize_per_item(shape, tmp_path):
    x = rng(2).standard_normal(shape).astype(F)
    x[0] = 0                                              # all zero: scaled by 1 / sqrt(1e-7)
    model = load_from_text(net('layer { name: "l" type: "L2Normalize" bottom: "x" top: "o" }', inputs={"x": shape}))
    want = l2_normalize_ref(x)
    assert model.blob_shapes["o"] == want.shape           # (N, C) reads as (N, C, 1, 1)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, rtol=1e-6, atol=1e-7)


def test_in_place_refused():
    for kind in ("L2Normalize", "SignedSqrt"):
        with pytest.raises(LayerError, match="does not allow in-place"):
            load_from_text(net(f'layer {{ name: "l" type: "{kind}" bottom: "x" top: "x" }}', inputs={"x": (1, 2)}))


def sum_pool_ref(x, k, s):
    n, c, h, w = x.shape
    oh, ow = math.ceil((h - k[0]) / s[0]) + 1, math.ceil((w - k[1]) / s[1]) + 1
    out = np.zeros((n, c, oh, ow), F)
    for i in range(oh):
        for j in range(ow):
            acc = np.zeros((n, c), F)
            for y in range(i * s[0], min(i * s[0] + k[0], h)):
                for z in range(j * s[1], min(j * s[1] + k[1], w)):
                    acc = (acc + x[:, :, y, z]).astype(F)
            out[:, :, i, j] = acc
    return out


@pytest.mark.parametrize("param, k, s", [("kernel_h: 3 kernel_w: 2 stride: 2", (3, 2), (2, 2)),   # ceil overhang
                                         ("kernel_size: 7 stride: 1", (7, 7), (1, 1)),
                                         ("global_pooling: true", (7, 9), (1, 1))])        # HBP's 28 x 28 sums
def test_sum_pooling_sums_each_window(param, k, s, tmp_path):
    x = rng(3).integers(-4, 5, (2, 3, 7, 9)).astype(F) / 4    # exact sums: any order agrees
    model = load_from_text(net(f'layer {{ name: "p" type: "SumPooling" bottom: "x" top: "o" '
                               f'sum_pooling_param {{ pool: SUM {param} }} }}', inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": sum_pool_ref(x, k, s)}, tmp_path)


def test_sum_pooling_other_methods_are_caffes_pooling(tmp_path):
    x = rng(4).standard_normal((2, 3, 7, 9)).astype(F)
    for method in ("MAX", "AVE"):
        ours = load_from_text(net(f'layer {{ name: "p" type: "SumPooling" bottom: "x" top: "o" sum_pooling_param '
                                  f'{{ pool: {method} kernel_size: 3 stride: 2 pad: 1 }} }}', inputs={"x": x.shape}))
        bvlc = load_from_text(net(f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "o" pooling_param '
                                  f'{{ pool: {method} kernel_size: 3 stride: 2 pad: 1 }} }}', inputs={"x": x.shape}))
        # AVE's ONNX form divides as AveragePool does: the tolerance of BVLC's own AVE tests
        tol = {"rtol": 1e-5, "atol": 1e-6} if method == "AVE" else {}
        check_everywhere(ours, {"x": x}, {"o": bvlc.run({"x": x})["o"]}, tmp_path, **tol)


def test_sum_pooling_with_padding_is_refused():
    with pytest.raises(LayerError, match="SUM with padding"):
        load_from_text(net('layer { name: "p" type: "SumPooling" bottom: "x" top: "o" sum_pooling_param '
                           '{ pool: SUM kernel_size: 2 pad: 1 } }', inputs={"x": (1, 1, 4, 4)}))
