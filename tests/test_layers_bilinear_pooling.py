"""The bilinear pooling nets' layers (gy20073/compact_bilinear_pooling 1b7c58a signed_sqrt_layer.cu and
l2_normalize_layer.cu; ChaojianYu/Hierarchical-Bilinear-Pooling 034e848 sum_pooling_layer.cu).  The
references loop as the kernels do; L2Normalize's sum of squares is a reduction whose order the fork's
asum does not fix (compared to 1e-6)."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.layers.bilinear_pooling import compact_bilinear_tables, glibc_rand
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


# ---- CompactBilinear ---------------------------------------------------------------------------------

def compact_bilinear_ref(a, b, tables, d, sum_pool):
    """The closed form of compact_bilinear_layer.cpp: top[n, k] = D sum over channel pairs with
    (h1[c1] + h2[c2]) mod D == k of s1 s2 x1 x2 (summed over positions with sum_pool), in float64."""
    (h1, s1), (h2, s2) = tables
    n, _, h, w = a.shape
    out = np.zeros((n, d, h * w))
    fa, fb = a.reshape(n, a.shape[1], -1).astype(np.float64), b.reshape(n, b.shape[1], -1).astype(np.float64)
    for c1 in range(a.shape[1]):
        for c2 in range(b.shape[1]):
            out[:, (h1[c1] + h2[c2]) % d] += s1[c1] * s2[c2] * fa[:, c1] * fb[:, c2]
    out *= d
    return out.sum(2).reshape(n, d, 1, 1) if sum_pool else out.reshape(n, d, h, w)


def test_compact_bilinear_worked_example_of_the_fork():
    # spec: D 4, two channels, two positions; glibc's rand() after srand(1) gives h1 [3, 2], s1 [1, 1],
    # h2 [1, 3], s2 [-1, -1]
    a = np.array([[1, 2], [3, 4]], np.float32).reshape(1, 2, 1, 2)
    b = np.array([[5, 6], [7, 8]], np.float32).reshape(1, 2, 1, 2)
    text = 'layer { name: "cb" type: "CompactBilinear" bottom: "a" bottom: "b" top: "y" ' \
           'compact_bilinear_param { num_output: 4 SUM } }'
    for pool, want in (("true", [[-68, -212, -92, -156]]), ("false", [[-20, -84, -28, -60], [-48, -128, -64, -96]])):
        model = load_from_text(net(text.replace("SUM", f"sum_pool: {pool}"), inputs={"a": a.shape, "b": b.shape}))
        got = model.run({"a": a, "b": b})["y"]
        np.testing.assert_allclose(got.reshape(4, -1).T, np.array(want, np.float32), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("d, sum_pool, same", [(64, True, True), (50, False, False), (9, True, False)])
def test_compact_bilinear_matches_its_closed_form(d, sum_pool, same, tmp_path):
    r = rng(17)
    a = r.standard_normal((2, 12, 3, 4)).astype(np.float32)
    b = a if same else r.standard_normal((2, 7, 3, 4)).astype(np.float32)
    bottoms = 'bottom: "a" bottom: "a"' if same else 'bottom: "a" bottom: "b"'
    inputs = {"a": a.shape} if same else {"a": a.shape, "b": b.shape}
    model = load_from_text(net(f'layer {{ name: "cb" type: "CompactBilinear" {bottoms} top: "y" '
                               f'compact_bilinear_param {{ num_output: {d} sum_pool: {str(sum_pool).lower()} }} }}',
                               inputs=inputs))
    tables = compact_bilinear_tables([a.shape[1], b.shape[1]], d)
    assert tables[0] != tables[1]          # the stream goes on: the same blob gets two different tables
    ref = compact_bilinear_ref(a, b, tables, d, sum_pool)
    feeds = {"a": a} if same else {"a": a, "b": b}
    check_everywhere(model, feeds, {"y": ref}, tmp_path, atol=2e-3, rtol=1e-4, opsets=(17, None))
    with pytest.raises(CaffeqError, match="opset 17"):
        model.export_onnx(str(tmp_path / "old.onnx"), opset=16)


def test_glibc_rand_is_the_c_librarys():
    # glibc's documented first outputs after srand(1), and the tables of the fork's 512-channel VGG nets
    assert glibc_rand(1, 5) == [1804289383, 846930886, 1681692777, 1714636915, 1957747793]
    (h1, s1), (h2, s2) = compact_bilinear_tables([512, 512], 8192)
    assert h1[:4] == [1383, 966, 6249, 2163] and h2[-4:] == [3939, 2048, 7485, 2438]
    assert (sum(h1), sum(h2), s1.count(1), s2.count(1)) == (2076138, 2147677, 259, 242)


# ---- Bilinear ------------------------------------------------------------------------------------

def bilinear_ref(a, b, kernel=None, stride=None, pad=(0, 0)):
    """bilinear_layer: top[n, i * Cb + j] = sum of a[n, i] * b[n, j] over the map (kernel None) or each window."""
    n, ca, h, w = a.shape
    cb = b.shape[1]
    if kernel is None:
        return np.einsum("nip,njp->nij", a.reshape(n, ca, -1).astype(np.float64),
                         b.reshape(n, cb, -1).astype(np.float64)).reshape(n, ca * cb, 1, 1)
    ap = np.pad(a.astype(np.float64), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    bp = np.pad(b.astype(np.float64), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh, ow = (h + 2 * pad[0] - kernel[0]) // stride[0] + 1, (w + 2 * pad[1] - kernel[1]) // stride[1] + 1
    out = np.zeros((n, ca * cb, oh, ow))
    for y in range(oh):
        for x in range(ow):
            wa = ap[:, :, y * stride[0]:y * stride[0] + kernel[0], x * stride[1]:x * stride[1] + kernel[1]]
            wb = bp[:, :, y * stride[0]:y * stride[0] + kernel[0], x * stride[1]:x * stride[1] + kernel[1]]
            out[:, :, y, x] = np.einsum("nikl,njkl->nij", wa, wb).reshape(n, ca * cb)
    return out


def test_bilinear_worked_example_of_the_fork():
    # spec: x = [[1, 2], [3, 4]] (2 channels, 2 positions) with itself: [5, 11, 11, 25]
    x = np.array([[1, 2], [3, 4]], np.float32).reshape(1, 2, 1, 2)
    model = load_from_text(net('layer { name: "b" type: "Bilinear" bottom: "x" bottom: "x" top: "y" }',
                               inputs={"x": x.shape}))
    np.testing.assert_array_equal(model.run({"x": x})["y"].ravel(), [5, 11, 11, 25])


@pytest.mark.parametrize("conv", [None, "kernel_size: 5 stride: 5", "kernel_h: 3 kernel_w: 2 stride: 2 pad: 1"])
def test_bilinear_sums_outer_products_over_the_map_or_each_window(conv, tmp_path):
    a = rng(40).standard_normal((2, 3, 15, 10)).astype(np.float32)
    b = rng(41).standard_normal((2, 4, 15, 10)).astype(np.float32)
    param = f" convolution_param {{ {conv} }}" if conv else ""
    model = load_from_text(net(f'layer {{ name: "b" type: "Bilinear" bottom: "a" bottom: "b" top: "y"{param} }}',
                               inputs={"a": a.shape, "b": b.shape}))
    if conv is None:
        ref = bilinear_ref(a, b)
    elif conv.startswith("kernel_size"):
        ref = bilinear_ref(a, b, (5, 5), (5, 5))
    else:
        ref = bilinear_ref(a, b, (3, 2), (2, 2), (1, 1))
    assert model.blob_shapes["y"] == ref.shape
    check_everywhere(model, {"a": a, "b": b}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_bilinear_of_other_sizes_is_refused():
    with pytest.raises(CaffeqError, match="one num, height and width"):
        load_from_text(net('layer { name: "b" type: "Bilinear" bottom: "a" bottom: "b" top: "y" }',
                           inputs={"a": (1, 2, 4, 4), "b": (1, 2, 4, 5)}))


# ---- SoftAttention -------------------------------------------------------------------------------

def test_soft_attention_weights_the_positions_by_the_map_and_beta(tmp_path):
    # soft_attention_layer.cu: z[n, c] = sum over s of beta[n] * a[n, c, s] * alpha[n, s]
    a = rng(50).standard_normal((3, 5, 4, 6)).astype(np.float32)
    logits = rng(51).standard_normal((3, 24))
    alpha = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32).reshape(3, 1, 4, 6)
    beta = np.array([[1.0], [0.5], [2.0]], np.float32)
    model = load_from_text(net('layer { name: "att_feature" type: "SoftAttention" bottom: "a" bottom: "alpha" '
                               'bottom: "beta" top: "z" }', inputs={"a": a.shape, "alpha": alpha.shape, "beta": beta.shape}))
    ref = np.einsum("ncs,ns->nc", a.reshape(3, 5, -1).astype(np.float64),
                    alpha.reshape(3, -1).astype(np.float64)) * beta.astype(np.float64)
    assert model.blob_shapes["z"] == (3, 5, 1, 1)
    check_everywhere(model, {"a": a, "alpha": alpha, "beta": beta}, {"z": ref.reshape(3, 5, 1, 1)}, tmp_path,
                     atol=1e-6, rtol=1e-5)


def test_soft_attention_needs_one_beta_per_item():
    with pytest.raises(CaffeqError, match="one beta per item: 3 values"):
        load_from_text(net('layer { name: "s" type: "SoftAttention" bottom: "a" bottom: "alpha" bottom: "beta" '
                           'top: "z" }', inputs={"a": (3, 2, 2, 2), "alpha": (3, 1, 2, 2), "beta": (104, 1)}))
