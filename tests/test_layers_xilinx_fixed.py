"""Xilinx caffe-xilinx's (Vitis-AI d02dcb6) fixed-point layers and GSTiling against references written here
from quantize.cpp, fixed_neuron_layer.cpp, conv_fixed_layer.cpp, cudnn_conv_bn_fixed_layer.cu and
gs_tiling_layer.cpp, in torch, onnxruntime and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def position_ref(x, bw, method):
    """OVER_FLOW: floor(log2(1 / max(min / (-2^(bw-1) - 0.5), max / (2^(bw-1) - 0.5)))) in float32; DIFF_S: the
    best of that and the next four by the squared error, ties keeping the smaller."""
    step = max(F32(x.min()) / F32(-(2 ** (bw - 1)) - 0.5), F32(x.max()) / F32(2 ** (bw - 1) - 0.5))
    first = int(math.floor(np.log2(F32(1) / F32(step))))
    if method == "OVER_FLOW":
        return first
    errs = [float(((x.astype(np.float64) - fix_ref(x, bw, p)) ** 2).sum()) for p in range(first, first + 5)]
    return first + int(np.argmin(errs))


def fix_ref(x, bw, p):
    """caffe_cpu_fix: round half away from zero at step 2^-p, clamped to [-2^(bw-1), 2^(bw-1) - 1] steps."""
    step = 2.0 ** -p
    t = x.astype(np.float64) / step
    q = np.sign(t) * np.floor(np.abs(t) + 0.5)
    return np.clip(q, -(2 ** (bw - 1)), 2 ** (bw - 1) - 1) * step


def test_fixed_neuron_rounds_half_up_or_truncates_the_data_layers_input(tmp_path):
    # spec: bw 8, p 4 (step 1/16): top_fix and, with follow_data_layer, trunc (no clamp)
    x = np.array([0.15625, -0.15625, -0.21875, 10.0, -9.0], F32).reshape(1, 5, 1, 1)
    for follow, want in (("false", [0.1875, -0.125, -0.1875, 7.9375, -8.0]), ("true", [0.125, -0.125, -0.1875, 10, -9])):
        model = load_from_text(net(f'layer {{ name: "f" type: "FixedNeuron" bottom: "x" top: "y" fixed_param {{ '
                                   f'bit_width: 8 follow_data_layer: {follow} }} }}', inputs={"x": x.shape}))
        node_of(model, "f").blobs = [np.array([4.7], F32)]     # the position, floored
        check_everywhere(model, {"x": x}, {"y": np.array(want, F32).reshape(1, 5, 1, 1)}, tmp_path)


@pytest.mark.parametrize("method", ["OVER_FLOW", "DIFF_S"])
def test_convolution_fixed_quantizes_its_weights_and_bias(method, tmp_path):
    r = rng(23)
    x = r.standard_normal((2, 3, 7, 6)).astype(F32)
    model = load_from_text(net(f'layer {{ name: "c" type: "ConvolutionFixed" bottom: "x" top: "y" convolution_param {{ '
                               f'num_output: 4 kernel_size: 3 pad: 1 stride: 2 }} fixed_param {{ fixed_method: {method} '
                               f'bit_width: 6 }} }}', inputs={"x": x.shape}), random_weights=True)
    w = (r.standard_normal((4, 3, 3, 3)) * 0.3).astype(F32)
    b = (r.standard_normal(4) * 2).astype(F32)
    node_of(model, "c").blobs = [w, b]
    wq, bq = fix_ref(w, 6, position_ref(w, 6, method)), fix_ref(b, 6, position_ref(b, 6, method))
    assert not np.allclose(wq, w)
    check_everywhere(model, {"x": x}, {"y": conv_ref(x, wq, bq, (2, 2), (1, 1))}, tmp_path, atol=1e-5, rtol=1e-5)


def test_inner_product_fixed(tmp_path):
    r = rng(24)
    x = r.standard_normal((3, 10)).astype(F32)
    model = load_from_text(net('layer { name: "ip" type: "InnerProductFixed" bottom: "x" top: "y" inner_product_param { '
                               'num_output: 5 } fixed_param { fixed_method: DIFF_S } }', inputs={"x": x.shape}),
                           random_weights=True)
    w, b = r.standard_normal((5, 10)).astype(F32), r.standard_normal(5).astype(F32)
    node_of(model, "ip").blobs = [w, b]
    ref = x.astype(np.float64) @ fix_ref(w, 8, position_ref(w, 8, "DIFF_S")).T + fix_ref(b, 8, position_ref(b, 8, "DIFF_S"))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_convolution_bn_fixed_folds_then_quantizes(tmp_path):
    # spec example: W [1, 2], gamma 2, beta 1, mean 0.5, var 3 -> W' [37/32, 74/32], b' 108/256 (OVER_FLOW, bw 8)
    x = rng(25).standard_normal((1, 2, 3, 3)).astype(F32)
    model = load_from_text(net('layer { name: "c" type: "ConvolutionBNFixed" bottom: "x" top: "y" convolution_param { '
                               'num_output: 1 kernel_size: 1 bias_term: false } }', inputs={"x": x.shape}),
                           random_weights=True)
    one = np.ones((1, 1, 1, 1), F32)
    node_of(model, "c").blobs = [np.array([1, 2], F32).reshape(1, 2, 1, 1), 2 * one, one, 0.5 * one, 3 * one, one]
    ref = conv_ref(x, np.array([37 / 32, 74 / 32], F32).reshape(1, 2, 1, 1), np.array([108 / 256], F32), (1, 1), (0, 0))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)
    with pytest.raises(LayerError, match="bias_term: false"):
        load_from_text(net('layer { name: "c" type: "ConvolutionBNFixed" bottom: "x" top: "y" convolution_param { '
                           'num_output: 1 kernel_size: 1 } }', inputs={"x": x.shape}))


@pytest.mark.parametrize("reverse", [False, True])
def test_gs_tiling_orders_channels_phase_first(reverse, tmp_path):
    s = 2
    shape = (2, 8, 3, 5) if reverse else (2, 3, 4, 6)
    x = rng(26).standard_normal(shape).astype(F32)
    n, c, h, w = shape
    if reverse:        # out[n, ic % Co, iy s + (ic / Co) / s, ix s + (ic / Co) % s] = in[n, ic, iy, ix]
        co = c // (s * s)
        ref = np.zeros((n, co, h * s, w * s), F32)
        for ic in range(c):
            off = ic // co
            ref[:, ic % co, off // s::s, off % s::s] = x[:, ic]
    else:              # out[n, ((iy % s) s + ix % s) C + ic, iy / s, ix / s] = in[n, ic, iy, ix]
        ref = np.zeros((n, c * s * s, h // s, w // s), F32)
        for iy in range(h):
            for ix in range(w):
                ref[:, ((iy % s) * s + ix % s) * c:((iy % s) * s + ix % s) * c + c, iy // s, ix // s] = x[:, :, iy, ix]
    model = load_from_text(net(f'layer {{ name: "t" type: "GSTiling" bottom: "x" top: "y" gs_tiling_param {{ stride: 2 '
                               f'reverse: {str(reverse).lower()} }} }}', inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)
