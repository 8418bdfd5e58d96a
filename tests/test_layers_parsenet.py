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
    with pytest.raises(LayerError, match="hole or filter_stride, not both"):
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
