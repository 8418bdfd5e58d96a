"""naibaf7/caffe's fused layers (models/inference_optimize, tools/inference-optimize/model_fuse.py):
Convolution with fuse_type FUSED_CONV_RELU / FUSED_CONV_ELTWISE_RELU (the spatial engine's
conv_layer_spatial.cl: y > 0 ? y : y * relu_param.negative_slope after the convolution, plus bottom 1 for
ELTWISE) and LRN with fuse_type FUSED_POOL_MAX (lrn_layer.cu / lrn.cl: ACROSS_CHANNELS LRN, then MAX
pooling from 0 with ceil rounding, the top shaped (pooled W, pooled H)).  References: the plain layers'
outputs (the same weights), then numpy loops of the fused step."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

FLT_MAX = float(np.finfo(np.float32).max)


def conv_text(fuse, bottoms=("x",), extra="", num_output=5, layer_extra=""):
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    return (f'layer {{ name: "c" type: "Convolution" {bottom} top: "y" {layer_extra} convolution_param {{ '
            f'num_output: {num_output} kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_w: 1 fuse_type: {fuse} {extra} }} }}')


def leaky(y, slope):
    return np.where(y > 0, y, y * np.float32(slope)).astype(np.float32)


@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_fused_conv_relu(slope, tmp_path):
    x = rng(1).standard_normal((2, 3, 9, 7)).astype(np.float32)
    extra = f"relu_param {{ negative_slope: {slope} }}" if slope else ""
    fused = load_from_text(net(conv_text("FUSED_CONV_RELU", extra=extra), inputs={"x": x.shape}),
                           random_weights=True)
    plain = load_from_text(net(conv_text("UNFUSED"), inputs={"x": x.shape}))
    node_of(plain, "c").blobs = node_of(fused, "c").blobs
    conv = plain.run({"x": x})["y"]
    assert (conv < 0).any()
    check_everywhere(fused, {"x": x}, {"y": leaky(conv, slope)}, tmp_path, 1e-5, 1e-5)


def test_fused_conv_eltwise_relu(tmp_path):
    x = rng(2).standard_normal((2, 3, 9, 7)).astype(np.float32)
    s = rng(3).standard_normal((2, 5, 4, 8)).astype(np.float32)
    text = conv_text("FUSED_CONV_ELTWISE_RELU", bottoms=("x", "s"), extra="relu_param { negative_slope: 0.25 }")
    fused = load_from_text(net(text, inputs={"x": x.shape, "s": s.shape}), random_weights=True)
    assert fused.blob_shapes["y"] == (2, 5, 4, 8)
    plain = load_from_text(net(conv_text("UNFUSED"), inputs={"x": x.shape}))
    node_of(plain, "c").blobs = node_of(fused, "c").blobs
    ref = leaky(plain.run({"x": x})["y"] + s, 0.25)
    check_everywhere(fused, {"x": x, "s": s}, {"y": ref}, tmp_path, 1e-5, 1e-5)


def lrn_text(pool="kernel_size: 3 stride: 2", region=""):
    return ('layer { name: "n" type: "LRN" bottom: "x" top: "p" lrn_param { local_size: 5 alpha: 0.01 beta: 0.75 '
            f'k: 2 {region} fuse_type: FUSED_POOL_MAX pooling_param {{ pool: MAX {pool} }} }} }}')


def max_pool_ceil(y, k, s):
    n, c, h, w = y.shape
    oh, ow = (math.ceil((v - k) / s) + 1 for v in (h, w))
    out = np.full((n, c, oh, ow), -FLT_MAX, np.float32)
    for i in range(oh):
        for j in range(ow):
            out[:, :, i, j] = np.maximum(out[:, :, i, j], y[:, :, i * s:min(i * s + k, h), j * s:min(j * s + k, w)]
                                         .max(axis=(2, 3)))
    return out


@pytest.mark.parametrize("shape, k, s", [((2, 7, 11, 11), 3, 2), ((1, 6, 9, 12), 3, 2), ((2, 5, 10, 7), 2, 1),
                                         ((1, 4, 13, 9), 4, 3)])
def test_fused_lrn_pool_max(shape, k, s, tmp_path):
    x = rng(4).standard_normal(shape).astype(np.float32)
    fused = load_from_text(net(lrn_text(f"kernel_size: {k} stride: {s}"), inputs={"x": x.shape}))
    plain = load_from_text(net('layer { name: "n" type: "LRN" bottom: "x" top: "p" lrn_param { local_size: 5 '
                               'alpha: 0.01 beta: 0.75 k: 2 } }', inputs={"x": x.shape}))
    pooled = max_pool_ceil(plain.run({"x": x})["p"], k, s)
    # the fork's top: (N, C, pooled W, pooled H) over data laid out (pooled H, pooled W)
    ref = pooled.reshape(pooled.shape[0], pooled.shape[1], pooled.shape[3], pooled.shape[2])
    assert fused.blob_shapes["p"] == ref.shape
    check_everywhere(fused, {"x": x}, {"p": ref}, tmp_path, 1e-5, 1e-5)


def test_unfused_layers_are_the_plain_ones():
    x = rng(6).standard_normal((1, 3, 9, 7)).astype(np.float32)
    text = net(conv_text("UNFUSED"), 'layer { name: "n" type: "LRN" bottom: "y" top: "z" }', inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    assert type(node_of(model, "c").spec).__name__ == "Convolution"
    assert type(node_of(model, "n").spec).__name__ == "LRN"
    assert (model.run({"x": x}, all_blobs=True)["y"] < 0).any()   # no ReLU


def test_a_fused_and_a_plain_lrn_in_one_model_py(tmp_path):
    x = rng(7).standard_normal((1, 6, 9, 9)).astype(np.float32)
    text = net(lrn_text(), 'layer { name: "m" type: "LRN" bottom: "p" top: "q" lrn_param { local_size: 3 } }',
               inputs={"x": x.shape})
    model = load_from_text(text)
    check_everywhere(model, {"x": x}, {"q": model.run({"x": x})["q"]}, tmp_path, 1e-5, 1e-5)


@pytest.mark.parametrize("text, message", [
    (conv_text("FUSED_CONV_MAX_POOLING_RELU"), "none of its engines applies it"),
    (conv_text("FUSED_CONV_ELTWISE_RELU"), "takes 2 bottoms"),
    (conv_text("FUSED_CONV_RELU", extra="relu_param { relu6: true }"), "negative_slope only"),
    (conv_text("FUSED_CONV_ELTWISE_RELU", bottoms=("x", "x2"), extra="eltwise_param { coeff: 1 coeff: 1 }"),
     "no coefficients"),
    (conv_text("FUSED_CONV_ELTWISE_RELU", bottoms=("x", "x2"), layer_extra="eltwise_param { operation: MAX }"),
     "a SUM"),
    (conv_text("FUSED_CONV_ELTWISE_RELU", bottoms=("x", "x2")), "must match"),
    (lrn_text("kernel_size: 3 stride: 1"), "kernel_size = stride \\+ 1"),
    (lrn_text("kernel_size: 3"), "kernel_size and stride"),
    (lrn_text("kernel_size: 3 stride: 2", region="norm_region: WITHIN_CHANNEL"), "ACROSS_CHANNELS"),
    (lrn_text("kernel_size: 3 stride: 2 dilation: 1"), "takes none"),
])
def test_bad_fusions_give_one_clear_line(text, message):
    with pytest.raises(LayerError, match=message) as err:
        load_from_text(net(text, inputs={"x": (1, 3, 9, 7), "x2": (1, 3, 9, 7)}))
    assert "\n" not in str(err.value)


def test_a_batchnorm_after_a_fused_relu_is_not_folded_into_the_convolution():
    from caffeq.transforms import fold_batchnorm
    x = rng(5).standard_normal((1, 3, 9, 7)).astype(np.float32)
    text = net(conv_text("FUSED_CONV_RELU"), 'layer { name: "bn" type: "BatchNorm" bottom: "y" top: "b" }',
               inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    node_of(model, "bn").blobs = [np.full(5, 0.5, np.float32), np.full(5, 2.0, np.float32), np.ones(1, np.float32)]
    folded = fold_batchnorm(model)
    assert len([n for n in folded.layers if n.type != "Input"]) == 2   # a plain convolution takes the BatchNorm
    np.testing.assert_allclose(folded.run({"x": x})["b"], model.run({"x": x})["b"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kstride, dilation", [("kstride: 2", (2, 2)), ("kstride_h: 1 kstride_w: 3", (1, 3))])
def test_naibaf7s_2015_kstride_convolution_is_dilated(kstride, dilation, tmp_path):
    # TuragaLab/PyGreentea's nets (naibaf7/caffe 677e8440): the strided kernel, BVLC's later dilation
    x = np.random.default_rng(16).standard_normal((1, 2, 11, 12)).astype(np.float32)
    model = load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { '
                               f'num_output: 3 kernel_size: 3 pad: 1 {kstride} }} }}', inputs={"x": x.shape}),
                           random_weights=True)
    w, b = (np.asarray(v, np.float32) for v in model.graph.node("c").blobs)
    dh, dw = dilation
    spread = np.zeros((3, 2, 2 * dh + 1, 2 * dw + 1), np.float32)
    spread[:, :, ::dh, ::dw] = w
    ref = conv_ref(x, spread, b, (1, 1), (1, 1))
    assert model.blob_shapes["c"] == ref.shape
    check_everywhere(model, {"x": x}, {"c": ref.astype(np.float32)}, tmp_path, atol=1e-5, rtol=1e-5)
