"""ParseNet's fork (weiliu89/caffe, branch fcn, 36001c2): filter_stride (dilation), pooling by bins,
ParseOutput, against the fork's base_conv_layer.cpp, pooling_layer.cpp and parse_output_layer.cpp, in
torch, onnxruntime and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def test_filter_stride_is_the_dilation(tmp_path):
    x = np.random.default_rng(15).standard_normal((1, 2, 11, 9)).astype(f32)
    model = load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { '
                               'num_output: 3 kernel_size: 3 pad: 2 filter_stride: 2 } }', inputs={"x": x.shape}),
                           random_weights=True)
    node = next(n for n in model.layers if n.name == "c")
    w, b = (np.asarray(v, f32) for v in node.blobs)
    dilated = np.zeros((3, 2, 5, 5), f32)
    dilated[:, :, ::2, ::2] = w
    assert model.blob_shapes["c"] == (1, 3, 11, 9)
    check_everywhere(model, {"x": x}, {"c": conv_ref(x, dilated, b.reshape(-1), (1, 1), (2, 2))}, tmp_path,
                     atol=1e-5, rtol=1e-5)
    with pytest.raises(LayerError, match="one of DeepLab's hole, ParseNet's filter_stride and naibaf7/caffe's kstride"):
        load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { '
                           'num_output: 3 kernel_size: 3 hole: 2 filter_stride: 2 } }', inputs={"x": x.shape}))


def bin_pool_ref(x, bins, ave):
    """pooling_layer.cpp's bin geometry, then BVLC's ceil sizes (one fewer where padded and the last
    window starts in the padding), MAX / AVE (divided by the window clipped to size + pad)."""
    n, c, h, w = x.shape
    geo = []
    for size, b in zip((h, w), bins):
        k = math.ceil(size / b)
        s = 1 if k == size else k
        p = math.floor(((b - 1) * s + k - size) / 2)
        o = math.ceil((size + 2 * p - k) / s) + 1
        if p and (o - 1) * s >= size + p:
            o -= 1
        geo.append((k, s, p, o))
    (kh, sh, ph, oh), (kw, sw, pw, ow) = geo
    y = np.empty((n, c, oh, ow), np.float64)
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * sh - ph, j * sw - pw
            h1, w1 = min(h0 + kh, h + ph), min(w0 + kw, w + pw)
            area = (h1 - h0) * (w1 - w0)
            cells = x[:, :, max(h0, 0):min(h1, h), max(w0, 0):min(w1, w)].astype(np.float64)
            y[:, :, i, j] = cells.sum(axis=(2, 3)) / area if ave else cells.max(axis=(2, 3))
    return y


@pytest.mark.parametrize("param, bins", [("bin_size: 1", (1, 1)), ("bin_h: 2 bin_w: 3", (2, 3)),
                                         ("bin_size: 3", (3, 3))], ids=["global", "h2w3", "three"])
@pytest.mark.parametrize("pool", ["AVE", "MAX"])
def test_pooling_by_bins(param, bins, pool, tmp_path):
    x = np.random.default_rng(16).standard_normal((2, 3, 7, 10)).astype(f32)
    model = load_from_text(net(f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "p" pooling_param {{ '
                               f'pool: {pool} {param} }} }}', inputs={"x": x.shape}))
    ref = bin_pool_ref(x, bins, pool == "AVE")
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-6)
    with pytest.raises(LayerError, match="exceed half of the input"):
        load_from_text(net(f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "p" pooling_param {{ '
                           f'pool: {pool} bin_size: 4 }} }}', inputs={"x": x.shape}))


def test_parse_output_gives_the_first_best_channel(tmp_path):
    g = np.random.default_rng(17)
    x = g.integers(-2, 3, (2, 4, 3, 5)).astype(f32)     # small integers: ties between channels
    model = load_from_text(net('layer { name: "o" type: "ParseOutput" bottom: "x" top: "label" top: "max" }',
                               inputs={"x": x.shape}))
    labels = np.zeros((2, 1, 3, 5), f32)
    best = x[:, 0:1].copy()
    for ch in range(1, 4):                                # the fork's loop: strictly greater moves on
        greater = x[:, ch:ch + 1] > best
        best = np.where(greater, x[:, ch:ch + 1], best)
        labels = np.where(greater, f32(ch), labels)
    check_everywhere(model, {"x": x}, {"label": labels, "max": best}, tmp_path)


def test_a_data_layer_whose_one_top_is_a_label_feeds_scorers_that_are_dropped():
    # FCN / ParseNet read labels with a data layer of their own; ParseEvaluate scores predictions with them
    text = '''
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "label" type: "Data" top: "label" data_param { source: "missing_lmdb" batch_size: 1 } }
layer { name: "score" type: "Convolution" bottom: "data" top: "score" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "pred" type: "ParseOutput" bottom: "score" top: "pred" }
layer { name: "evaluation" type: "ParseEvaluate" bottom: "pred" bottom: "label" top: "evaluation" }
'''
    model = load_from_text(text, unknown_shapes_ok=True)
    assert "evaluation" not in model.blob_shapes and model.blob_shapes["pred"] == (1, 1, 8, 8)
    assert any("'evaluation' (ParseEvaluate) reads the label 'label'" in w for w in model.warnings)


def unpool_ref(x, method, kernel, stride, pad, out):
    """unpooling_layer.cpp: FillMask, then Forward_cpu's FIXED / DIV / REP loops, one plane at a time."""
    n, c, h, w = x.shape
    oh, ow = out
    top = np.zeros((n, c, oh, ow), np.float64)
    count = np.zeros((oh, ow), np.int64)
    if method != "FIXED":
        for y in range(h):
            for xx in range(w):
                y0, x0 = y * stride[0] - pad[0], xx * stride[1] - pad[1]
                y1, x1 = min(y0 + kernel[0], oh), min(x0 + kernel[1], ow)
                count[max(y0, 0):y1, max(x0, 0):x1] += 1
    for i in range(n):
        for ch in range(c):
            for y in range(h):
                for xx in range(w):
                    v = float(x[i, ch, y, xx])
                    y0, x0 = y * stride[0] - pad[0], xx * stride[1] - pad[1]
                    if method == "FIXED":
                        my = min(max((2 * y0 + kernel[0] - 1) // 2, 0), oh - 1)
                        mx = min(max((2 * x0 + kernel[1] - 1) // 2, 0), ow - 1)
                        top[i, ch, my, mx] = v
                        continue
                    y1, x1 = min(y0 + kernel[0], oh + pad[0]), min(x0 + kernel[1], ow + pad[1])
                    area = (y1 - y0) * (x1 - x0)
                    for uy in range(max(y0, 0), min(y1, oh)):
                        for ux in range(max(x0, 0), min(x1, ow)):
                            top[i, ch, uy, ux] += (v / area if method == "DIV" else v) / count[uy, ux]
    return top


@pytest.mark.parametrize("method", ["FIXED", "DIV", "REP"])
@pytest.mark.parametrize("param, kernel, stride, pad", [
    ("out_kernel_size: 3 out_stride: 2", (3, 3), (2, 2), (0, 0)),           # overlapping windows
    ("out_kernel_h: 2 out_kernel_w: 4 out_stride_h: 2 out_stride_w: 3 out_pad_h: 1 out_pad_w: 1",
     (2, 4), (2, 3), (1, 1)),
], ids=["overlap", "padded"])
def test_parsenet_unpooling_with_its_own_window(method, param, kernel, stride, pad, tmp_path):
    x = np.random.default_rng(19).standard_normal((2, 3, 4, 5)).astype(f32)
    model = load_from_text(net(f'layer {{ name: "u" type: "UnPooling" bottom: "x" top: "u" unpooling_param {{ '
                               f'unpool: {method} {param} }} }}', inputs={"x": x.shape}))
    out = [(n - 1) * s - 2 * p + k for n, s, p, k in zip((4, 5), stride, pad, kernel)]
    ref = unpool_ref(x, method, kernel, stride, pad, out)
    assert model.blob_shapes["u"] == ref.shape
    check_everywhere(model, {"x": x}, {"u": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_parsenet_unpooling_to_the_second_bottoms_size_spreads_the_global_feature(tmp_path):
    # ParseNet's global context: a 1x1 pooled feature repeated over the map it is fused with
    g = np.random.default_rng(20)
    x, big = g.standard_normal((2, 3, 1, 1)).astype(f32), g.standard_normal((2, 3, 6, 7)).astype(f32)
    model = load_from_text(net('layer { name: "u" type: "UnPooling" bottom: "x" bottom: "big" top: "u" '
                               'unpooling_param { unpool: REP out_kernel_size: 0 out_stride: 0 } }',
                               inputs={"x": x.shape, "big": big.shape}))
    assert model.blob_shapes["u"] == (2, 3, 6, 7)
    check_everywhere(model, {"x": x, "big": big}, {"u": np.broadcast_to(x, (2, 3, 6, 7)).astype(np.float64)},
                     tmp_path, atol=0, rtol=0)
    # a smaller map, 3x2 to 7x5: kernel 3 and stride 3 rows, pad 1; kernel 3 and stride 3 columns, pad 0
    x2 = g.standard_normal((1, 2, 3, 2)).astype(f32)
    model = load_from_text(net('layer { name: "u" type: "UnPooling" bottom: "x" bottom: "big" top: "u" '
                               'unpooling_param { unpool: DIV out_kernel_size: 0 } }',
                               inputs={"x": x2.shape, "big": (1, 2, 7, 5)}))
    ref = unpool_ref(x2, "DIV", (3, 3), (3, 3), (1, 0), (7, 6))
    assert model.blob_shapes["u"] == (1, 2, 7, 6)
    check_everywhere(model, {"x": x2, "big": np.zeros((1, 2, 7, 5), f32)}, {"u": ref}, tmp_path, atol=1e-6,
                     rtol=1e-5)
