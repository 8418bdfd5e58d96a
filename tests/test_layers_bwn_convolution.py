"""TrellixVulnTeam/ssd_phone_detection's `convolution_param { binary: true }`: its BinaryConv2d (the BWN
decorator in custom_nn/cnnc_util.py) convolves with torch.sign(W) times each output channel's mean |W|.
The reference binarizes in numpy and convolves with conftest's float64 im2col convolution."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text


def bwn_ref(w):
    """numpy: sign(W) (0 at 0) times the output channel's mean |W|."""
    alpha = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1).mean(1)
    return np.sign(w) * alpha.reshape(-1, 1, 1, 1)


def test_binary_convolution_uses_bwn_weights(tmp_path):
    # trimmed from caffe_models/phone_detection_lowrank_binary_deploy_nobn.prototxt: a 3 x 1 kernel, pad (1, 0)
    text = net('layer { name: "conv" type: "Convolution" bottom: "x" top: "o" convolution_param { num_output: 4 '
               'pad_h: 1 pad_w: 0 kernel_h: 3 kernel_w: 1 stride_h: 1 stride_w: 2 binary: true } }',
               inputs={"x": (2, 3, 7, 6)})
    model = load_from_text(text, random_weights=True, seed=2)
    conv = node_of(model, "conv")
    w = np.asarray(conv.blobs[0]).copy()
    w[1, 0, 0, 0] = 0.0        # torch.sign keeps a zero weight at 0
    conv.blobs = [w, np.asarray(conv.blobs[1])]
    x = rng(4).standard_normal((2, 3, 7, 6)).astype(np.float32)
    want = conv_ref(x, bwn_ref(w), np.asarray(conv.blobs[1]), (1, 2), (1, 0))
    assert not np.allclose(want, conv_ref(x, w, np.asarray(conv.blobs[1]), (1, 2), (1, 0)), atol=1e-3)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-5, rtol=1e-5)
    # the fork binarizes at every forward: stored binarized weights (no exact zero) give the same output
    w[1, 0, 0, 0] = 0.5
    bias = np.asarray(conv.blobs[1])
    want = conv_ref(x, bwn_ref(w), bias, (1, 2), (1, 0))
    conv.blobs = [bwn_ref(w).astype(np.float32), bias]
    np.testing.assert_allclose(model.run({"x": x})["o"], want, atol=1e-5, rtol=1e-5)


def test_binary_false_is_a_plain_convolution():
    text = net('layer { name: "conv" type: "Convolution" bottom: "x" top: "o" convolution_param { num_output: 2 '
               'kernel_size: 3 binary: false } }', inputs={"x": (1, 2, 5, 5)})
    model = load_from_text(text, random_weights=True, seed=1)
    conv = node_of(model, "conv")
    x = rng(6).standard_normal((1, 2, 5, 5)).astype(np.float32)
    want = conv_ref(x, np.asarray(conv.blobs[0]), np.asarray(conv.blobs[1]), (1, 1), (0, 0))
    np.testing.assert_allclose(model.run({"x": x})["o"], want, atol=1e-5, rtol=1e-5)


def test_binary_deconvolution_is_refused_in_one_line():
    text = net('layer { name: "up" type: "Deconvolution" bottom: "x" top: "o" convolution_param { num_output: 2 '
               'kernel_size: 2 stride: 2 binary: true } }', inputs={"x": (1, 2, 3, 3)})
    with pytest.raises(CaffeqError, match=r"layer 'up' \(Deconvolution\): convolution_param.binary on a Deconvolution"):
        load_from_text(text, random_weights=True)
