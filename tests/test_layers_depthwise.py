"""The two depthwise-convolution forks, which share a purpose but not a shape rule.

sp2823's ConvolutionDepthwise (BVLC PR #5665, conv_dw_layer.cpp) never reads num_output or group: the
top has the input's channels and each channel has one kh x kw filter, weights (C, 1, kh, kw), bias (C).
yonghenglh6's / eric612's DepthwiseConvolution (depthwise_conv_layer.cpp) is a BaseConvolutionLayer:
num_output and group are read and checked as for Convolution.  References are numpy loops written from
conv_dw_layer.cpp's Forward_cpu, on (N, C, H, W) shapes where every axis differs."""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere as shared_check
from conftest import net, rng

import caffeq
from caffeq.layers import LayerError
from caffeq.model import load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


def check_everywhere(model, feeds, refs, tmp_path, tol=1e-5):
    """torch (every blob), onnxruntime (opset 13 and the default) and model.py against refs."""
    shared_check(model, feeds, refs, tmp_path, tol, tol, all_blobs=True)



def conv_dw_ref(x, w, b, kernel, stride, pad, dilation):
    """conv_dw_layer.cpp Forward_cpu: per channel, sum of weight x input over the taps inside the image."""
    n, c, h, wd = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, pad, dilation
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (wd + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    out = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            for a in range(kh):
                for e in range(kw):
                    hi, wi = -ph + i * sh + a * dh, -pw + j * sw + e * dw
                    if 0 <= hi < h and 0 <= wi < wd:
                        out[:, :, i, j] += w[:, 0, a, e] * x[:, :, hi, wi]
    if b is not None:
        out += b.reshape(1, c, 1, 1)
    return out


def dw_model(conv_param, shape, kind="ConvolutionDepthwise"):
    text = net(f'layer {{ name: "dw" type: "{kind}" bottom: "x" top: "dw" convolution_param {{ {conv_param} }} }}',
               inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "dw")
    if len(node.blobs) == 2:   # a bias that is not zero
        node.blobs = [node.blobs[0], rng(5).standard_normal(node.blobs[1].shape).astype(np.float32)]
    return model, node


@pytest.mark.parametrize("conv_param, geometry", [
    # the prototxt's num_output and group disagree with C = 3: both are ignored
    ("num_output: 16 group: 16 kernel_size: 3 pad: 1 stride: 2", ((3, 3), (2, 2), (1, 1), (1, 1))),
    ("num_output: 5 kernel_size: 3 kernel_size: 2 stride: 1 stride: 2 pad: 2 pad: 0 dilation: 2",
     ((3, 2), (1, 2), (2, 0), (2, 2))),
    ("group: 7 bias_term: false kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 1",
     ((2, 3), (2, 1), (0, 1), (1, 1))),
])
def test_convolution_depthwise_keeps_the_input_channels(conv_param, geometry, tmp_path):
    x = rng(1).standard_normal((2, 3, 9, 8)).astype(np.float32)
    model, node = dw_model(conv_param, x.shape)
    kernel = geometry[0]
    assert node.blobs[0].shape == (3, 1) + kernel
    bias = node.blobs[1] if "bias_term: false" not in conv_param else None
    assert bias is None or bias.shape == (3,)
    ref = conv_dw_ref(x, node.blobs[0], bias, *geometry)
    assert model.blob_shapes["dw"] == ref.shape and ref.shape[1] == 3
    check_everywhere(model, {"x": x}, {"dw": ref}, tmp_path)


def test_convolution_depthwise_reads_only_the_first_two_kernel_sizes():
    # LayerSetUp reads kernel_size(0) and kernel_size(1), whatever follows
    model, node = dw_model("kernel_size: 3 kernel_size: 1 kernel_size: 5", (1, 4, 6, 5))
    assert node.blobs[0].shape == (4, 1, 3, 1) and model.blob_shapes["dw"] == (1, 4, 4, 5)


@pytest.mark.parametrize("conv_param, shape, msg", [
    ("num_output: 3", (2, 3, 9, 8), "convolution_param.kernel_size is required"),
    ("kernel_size: 3 stride: 0", (2, 3, 9, 8), "convolution_param.stride must be >= 1"),
    ("kernel_size: 3", (2, 3, 9, 8, 4), "4-D (N, C, H, W) input"),
    ("kernel_size: 11", (2, 3, 9, 8), "output would be empty"),
])
def test_convolution_depthwise_bad_params(conv_param, shape, msg):
    with pytest.raises(LayerError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        dw_model(conv_param, shape)


def test_convolution_depthwise_takes_one_bottom():
    text = net('layer { name: "dw" type: "ConvolutionDepthwise" bottom: "x" bottom: "y" top: "a" top: "b" '
               'convolution_param { kernel_size: 1 } }', inputs={"x": (1, 2, 3, 3), "y": (1, 2, 3, 3)})
    with pytest.raises(LayerError, match="takes one bottom and one top, got 2 and 2"):
        load_from_text(text, random_weights=True)


def test_depthwise_convolution_is_an_ordinary_grouped_convolution(tmp_path):
    # num_output 6 over group 3: two filters per input channel, weights (6, 1, k, k)
    x = rng(2).standard_normal((2, 3, 7, 10)).astype(np.float32)
    model, node = dw_model("num_output: 6 group: 3 kernel_size: 3 pad: 1", x.shape, kind="DepthwiseConvolution")
    w, b = node.blobs
    assert w.shape == (6, 1, 3, 3) and b.shape == (6,)
    # output channel o reads input channel o // 2: the per-channel reference on a repeated input
    ref = conv_dw_ref(np.repeat(x, 2, axis=1), w, b, (3, 3), (1, 1), (1, 1), (1, 1))
    check_everywhere(model, {"x": x}, {"dw": ref}, tmp_path)


@pytest.mark.parametrize("conv_param, msg", [
    ("num_output: 16 group: 32 kernel_size: 3", "input channels 3 not divisible by group 32"),
    ("num_output: 4 group: 3 kernel_size: 3", "num_output 4 not divisible by group 3"),
    ("group: 3 kernel_size: 3", "convolution_param.num_output is required"),
])
def test_depthwise_convolution_checks_num_output_and_group(conv_param, msg):
    with pytest.raises(LayerError, match=msg):
        dw_model(conv_param, (1, 3, 6, 5), kind="DepthwiseConvolution")


def test_mnasnet_yolov3_reads_with_sp2823s_rule():
    # eric612/MnasNet-caffe: 'conv2_1/dw' says num_output 16 group 16 on conv1's 32 channels
    model = caffeq.load(REALWORLD / "eric612__MnasNet-caffe__yolov3__train_val.prototxt",
                        random_weights=True, unknown_shapes_ok=True)
    node = next(n for n in model.layers if n.name == "conv2_1/dw")
    assert model.blob_shapes["conv1"][1] == 32
    assert node.blobs[0].shape == (32, 1, 3, 3) and len(node.blobs) == 1
    assert model.blob_shapes["conv2_1/dw"] == model.blob_shapes["conv1"]
