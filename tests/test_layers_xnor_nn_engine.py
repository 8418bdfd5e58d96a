"""mistler/xnor_nn's `convolution_param { engine: XNOR_NN }` (external/caffe xnor_nn_conv_layer.cpp and the
library's bcast / reference convolution): alpha[o] * K * (the sum of sign(x) * sign(w) over the taps inside the
bottom), sign from the sign bit, K the window mean of the channel mean of |x|, the bias never added.  The
reference is the library's loops, written in numpy (float64)."""
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, cli_process, net, node_of, one_line_error, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
ALEXNET = REALWORLD / "mistler__xnor_nn__external__caffe__models__xnor_nn_alexnet__train_val.prototxt"
CIFAR10 = REALWORLD / "mistler__xnor_nn__external__caffe__models__xnor_nn_cifar10__train_val.prototxt"


def bit_sign(v):
    return np.where(np.signbit(v), -1.0, 1.0)


def reference_sign(v):
    return np.where(v >= 0, 1.0, -1.0)


def xnor_nn_ref(x, w, stride, pad):
    """The library's forward: per output, alpha * k * the sum over in-bounds taps of sign(x) sign(w); the
    reference path's sign (v >= 0) where num_output is not a multiple of 4, else the bcast path's sign bit."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    sign = reference_sign if o % 4 else bit_sign
    oh, ow = (h + 2 * pad[0] - kh) // stride[0] + 1, (wd + 2 * pad[1] - kw) // stride[1] + 1
    alpha = np.abs(w.astype(np.float64)).reshape(o, -1).mean(1)
    a = np.abs(x.astype(np.float64)).mean(1)
    sx, sw = sign(x), sign(w)
    out = np.zeros((n, o, oh, ow))
    for b, y, z in np.ndindex(n, oh, ow):
        signs, k = np.zeros(o), 0.0
        for i, j in np.ndindex(kh, kw):
            iy, ix = y * stride[0] - pad[0] + i, z * stride[1] - pad[1] + j
            if 0 <= iy < h and 0 <= ix < wd:
                signs += sw[:, :, i, j] @ sx[b, :, iy, ix]
                k += a[b, iy, ix]
        out[b, :, y, z] = alpha * (k / (kh * kw)) * signs
    return out


def xnor_net(params, shape):
    return net(f'layer {{ name: "conv" type: "Convolution" bottom: "x" top: "o" convolution_param {{ {params} '
               f'engine: XNOR_NN }} }}', inputs={"x": shape})


def test_xnor_nn_engine_matches_the_library(tmp_path):
    shape = (2, 3, 7, 6)
    model = load_from_text(xnor_net("num_output: 5 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad: 1", shape),
                           random_weights=True, seed=3)
    conv = node_of(model, "conv")
    w = np.asarray(conv.blobs[0]).copy()
    w[0, 1, 2, 0], w[3, 0, 1, 1] = 0.0, -0.0          # 5 filters: the reference path, +0 and -0 count as +1
    bias = np.linspace(1.0, 3.0, 5).astype(np.float32)   # kept, never added
    conv.blobs = [w, bias]
    x = rng(7).standard_normal(shape).astype(np.float32)
    x[0, 0, 0, :3] = 0.0
    x[1, 2, 4, 1:4] = -0.0
    want = xnor_nn_ref(x, w, (2, 1), (1, 1))
    assert want.shape == (2, 5, 4, 7)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-5, rtol=1e-5)


def test_xnor_nn_engine_two_bottoms_share_the_filters(tmp_path):
    text = net('layer { name: "conv" type: "Convolution" bottom: "x" bottom: "y" top: "o" top: "p" '
               'convolution_param { num_output: 4 kernel_size: 3 stride: 2 bias_term: false engine: XNOR_NN } }',
               inputs={"x": (1, 2, 6, 5), "y": (1, 2, 6, 5)})
    model = load_from_text(text, random_weights=True, seed=5)
    w = np.asarray(node_of(model, "conv").blobs[0])
    x, y = (rng(s).standard_normal((1, 2, 6, 5)).astype(np.float32) for s in (1, 2))
    check_everywhere(model, {"x": x, "y": y}, {"o": xnor_nn_ref(x, w, (2, 2), (0, 0)),
                                               "p": xnor_nn_ref(y, w, (2, 2), (0, 0))}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params, needle", [
    ("num_output: 4 kernel_size: 3 group: 2", "convolution_param.group 2 with engine XNOR_NN"),
    ("num_output: 4 kernel_size: 3 dilation: 2", "convolution_param.dilation [2, 2] with engine XNOR_NN"),
    ("num_output: 4 kernel_size: 3 pad_h: 0 pad_w: 1", "convolution_param pad_h 0 / pad_w 1 with engine XNOR_NN"),
])
def test_what_the_library_cannot_compute_is_refused_when_run(params, needle):
    model = load_from_text(xnor_net(params, (1, 4, 9, 8)), random_weights=True)
    assert model.blob_shapes["o"][1] == 4          # read and sized as Caffe does
    with pytest.raises(CaffeqError, match=r"layer 'conv' \(Convolution\): " + re.escape(needle)):
        model.run({"x": np.ones((1, 4, 9, 8), np.float32)})


def test_pad_h_and_pad_w_apart_run_where_the_row_counts_agree(tmp_path):
    # H 4, kernel_h 3, stride_h 4: pad_h 0 and pad_w 1 both give one row, so the library's count is Caffe's
    shape = (2, 3, 4, 7)
    model = load_from_text(xnor_net("num_output: 6 kernel_h: 3 kernel_w: 2 stride_h: 4 stride_w: 2 pad_h: 0 pad_w: 1",
                                    shape), random_weights=True, seed=9)
    w = np.asarray(node_of(model, "conv").blobs[0])
    x = rng(11).standard_normal(shape).astype(np.float32)
    want = xnor_nn_ref(x, w, (4, 2), (0, 1))
    assert want.shape == (2, 6, 1, 4)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-5, rtol=1e-5)


def test_an_nd_kernel_is_refused_when_run():
    text = net('layer { name: "conv" type: "Convolution" bottom: "x" top: "o" convolution_param { num_output: 4 '
               'kernel_size: 3 kernel_size: 2 kernel_size: 2 engine: XNOR_NN } }', inputs={"x": (1, 2, 5, 6, 7)})
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["o"] == (1, 4, 3, 5, 6)
    with pytest.raises(CaffeqError, match=r"layer 'conv' \(Convolution\): .*over axis 1 only"):
        model.run({"x": np.ones((1, 2, 5, 6, 7), np.float32)})


@pytest.mark.parametrize("params, needle", [
    ("num_output: 2 kernel_size: 3 pad_type: 1", "pad_type / pad_l/r/t/b"),
])
def test_other_forks_fields_on_an_xnor_nn_layer_are_refused_in_one_line(tmp_path, params, needle):
    path = tmp_path / "bad.prototxt"
    path.write_text(xnor_net(params, (1, 2, 5, 5)))
    one_line_error(cli_process("inspect", str(path)), "layer 'conv'", needle)


def test_the_alexnet_net_reads_with_its_bias_note():
    model = load(str(ALEXNET), input_shapes={"data": (2, 3, 227, 227)})
    xnor = [n.name for n in model.layers if type(n.spec).__name__ == "XnorNNConvolution"]
    assert xnor == ["conv1", "conv2", "conv3", "conv4", "conv5"]
    assert model.blob_shapes["conv1"] == (2, 96, 55, 55) and model.blob_shapes["conv5"] == (2, 256, 13, 13)
    assert any("keeps the bias blob but never adds it" in w for w in model.warnings)


def test_the_cifar10_net_runs_its_xnor_layers():
    # the TEST net from conv1 to scale6 through five XNOR_NN convolutions, on random weights
    model = load(str(CIFAR10), random_weights=True, input_shapes={"data": (2, 3, 32, 32)},
                 outputs=["scale1", "conv2"])
    conv2 = node_of(model, "conv2")
    assert type(conv2.spec).__name__ == "XnorNNConvolution"
    x = rng(3).standard_normal((2, 3, 32, 32)).astype(np.float32)
    out = model.run({"data": x}, exact=True)
    want = xnor_nn_ref(out["scale1"], np.asarray(conv2.blobs[0]), (1, 1), (1, 1))
    np.testing.assert_allclose(out["conv2"], want, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("num_output, minus_zero", [(16, -1.0), (6, 1.0), (5, 1.0)])
def test_minus_zero_follows_the_path_the_library_takes(tmp_path, num_output, minus_zero):
    # bcast (sign bits) wherever num_output is a multiple of 16; the reference path (v >= 0) where it is not a
    # multiple of 4.  Channel 0 of x is -0 and the weights all +1, so the sum of signs tells the rule.
    shape = (1, 3, 4, 5)
    model = load_from_text(xnor_net(f"num_output: {num_output} kernel_h: 3 kernel_w: 2 bias_term: false", shape),
                           random_weights=True, seed=1)
    conv = node_of(model, "conv")
    w = np.ones((num_output, 3, 3, 2), np.float32)
    conv.blobs = [w]
    x = np.full(shape, 2.0, np.float32)
    x[0, 0] = -0.0
    want = xnor_nn_ref(x, w, (1, 1), (0, 0))
    # alpha 1, K the mean of (0, 2, 2); 6 taps of channel 0 (sign(-0)) and 12 of +1
    assert want.shape == (1, num_output, 2, 4) and np.allclose(want, 4 / 3 * (6 * minus_zero + 12))
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-5, rtol=1e-6)
