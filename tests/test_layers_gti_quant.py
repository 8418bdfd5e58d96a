"""Gyrfalcon's QuantConvolution and QuantReLU (jack16888/caffessd 55e1f12): references written as loops
from quant_conv_layer.cpp (quantize_block_data_shift_quant, quantize_block_data_dynamic_fxp: double
arithmetic stored back to float) and quant_relu_layer.cpp Forward_cpu, then Caffe's convolution in float64;
compared in torch, onnxruntime and the generated model.py."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, conv_ref, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

f32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def round_away(v):
    return math.floor(v + 0.5) if v >= 0 else math.ceil(v - 0.5)


def log2_floor(v):
    return math.floor(math.log(v) / math.log(2.0))


def shift_quant_ref(w, b, mode, bw, shift_enable):
    """quantize_block_data_shift_quant, kernel by kernel."""
    o_n, i_n = w.shape[:2]
    k = w[0, 0].size
    bw_bias = {"ONE_BIT": 12, "TWO_BITS": 12, "THREE_BITS": 18, "FIVE_BITS": 16}[mode] if bw == 12 else 20
    abs_max = max(abs(float(v)) for v in w.ravel())
    shift_max = 15 if bw == 8 else 13
    decimal = None
    if shift_enable:
        shift = log2_floor(((1 << (bw - 1)) - 1) / abs_max)
        if b is not None:
            shift = min(shift, log2_floor(((1 << (bw_bias - 1)) - 1) / (max(abs(float(v)) for v in b) + 1e-6)))
        decimal = float(1 << min(max(shift, 0), shift_max))
    out = np.empty_like(w)
    for o in range(o_n):
        for i in range(i_n):
            kern = [float(v) for v in w[o, i].ravel()]
            var = 0.0
            for v in kern:
                var = max(var, abs(v)) if mode == "FIVE_BITS" else var + abs(v)
            if mode != "FIVE_BITS":
                var /= k
            grid = {"ONE_BIT": (var + 1e-6) / 1.0, "TWO_BITS": var, "THREE_BITS": (var + 1e-6) / 4.0,
                    "FIVE_BITS": (var + 1e-6) / 15.0}[mode]
            scalar = math.floor(grid * decimal + 0.5) / decimal if shift_enable else grid
            q = []
            for v in kern:
                if mode == "ONE_BIT":
                    q.append(scalar if v >= 0 else -scalar)
                elif mode == "TWO_BITS":
                    q.append(0.0 if abs(v) < 0.25 * scalar else (scalar if v >= 0 else -scalar))
                elif mode == "THREE_BITS":
                    n = int(abs(v) / grid)
                    n = n if n < 3 else 4
                    q.append(n * scalar if v >= 0 else -(n * scalar))
                else:
                    q.append(round_away(v / grid) * scalar)
            out[o, i] = np.array(q, np.float32).reshape(w[o, i].shape)
    qb = None
    if b is not None:
        qb = np.array([round_away(float(v) * decimal) / decimal for v in b], np.float32) if shift_enable else b
    return out, qb


def dynamic_fxp_ref(w, b, bw, shift_enable):
    steps = (1 << (bw - 1)) - 1
    abs_max = max(abs(float(v)) for v in w.ravel())
    if shift_enable:
        decimal = float(1 << min(max(log2_floor(steps / abs_max), 0), 15 if bw == 8 else 13))
        qw = np.array([round_away(float(v) * decimal) / decimal for v in w.ravel()], np.float32)
        qb = None if b is None else np.array([round_away(float(v) * decimal) / decimal for v in b], np.float32)
    else:
        grid = abs_max / steps
        qw = np.array([round_away(float(v) / grid) * grid for v in w.ravel()], np.float32)
        qb = b
    return qw.reshape(w.shape), qb


def one_layer(type_, shape, params):
    return load_from_text(net(f'layer {{ name: "q" type: "{type_}" bottom: "x" top: "y" {params} }}',
                              inputs={"x": shape}), random_weights=True)


@pytest.mark.parametrize("mode", ["ONE_BIT", "TWO_BITS", "THREE_BITS", "FIVE_BITS", "DYNAMIC_FIXED_POINT"])
@pytest.mark.parametrize("shift_enable", [False, True])
@pytest.mark.parametrize("bias, bw", [(False, 12), (True, 12), (True, 8)])
def test_quant_convolution(mode, shift_enable, bias, bw, tmp_path):
    shape = (2, 3, 7, 6)
    params = (f"convolution_param {{ num_output: 4 kernel_h: 3 kernel_w: 2 pad: 1 stride_h: 1 stride_w: 2 "
              f"{'' if bias else 'bias_term: false'} }} quant_convolution_param {{ coef_precision: {mode} "
              f"bw_params: {bw} shift_enable: {str(shift_enable).lower()} }}")
    model = one_layer("QuantConvolution", shape, params)
    r = rng(21)
    w = (r.standard_normal((4, 3, 3, 2)) * 0.3).astype(np.float32)
    w[0, 0, 0, 0], w[1, 2, 1, 1] = 0.0, -0.0
    w[2, 1] *= 0.01                                  # a kernel whose weights mostly fall under the TWO_BITS cut
    blobs = [w] + ([(r.standard_normal(4) * 2).astype(np.float32)] if bias else [])
    node = node_of(model, "q")
    node.blobs = blobs
    model.clear_cache()
    b = blobs[1] if bias else None
    if mode == "DYNAMIC_FIXED_POINT":
        qw, qb = dynamic_fxp_ref(w, b, bw, shift_enable)
    else:
        qw, qb = shift_quant_ref(w, b, mode, bw, shift_enable)
    x = r.standard_normal(shape).astype(np.float32)
    ref = conv_ref(x, qw, qb, (1, 2), (1, 1))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-6)


def test_floating_point_is_the_plain_convolution(tmp_path):
    shape = (1, 2, 5, 5)
    model = one_layer("QuantConvolution", shape, "convolution_param { num_output: 3 kernel_size: 3 }")
    node = node_of(model, "q")
    w, b = node.blobs
    x = rng(22).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"y": conv_ref(x, w, b, (1, 1), (0, 0))}, tmp_path, atol=2e-5)


@pytest.mark.parametrize("mode", ["ONE_BIT", "DYNAMIC_FIXED_POINT"])
@pytest.mark.parametrize("weight, bias", [(0.0, 1.0), (np.inf, 1.0), (0.5, np.nan), (0.5, np.inf)])
def test_shifts_of_zero_or_infinite_blobs_are_refused(mode, weight, bias):
    # the fork converts floor(log(steps / max)) of an infinite or NaN logarithm to int: undefined behaviour
    model = one_layer("QuantConvolution", (1, 1, 4, 4), "convolution_param { num_output: 1 kernel_size: 3 } "
                      f"quant_convolution_param {{ coef_precision: {mode} shift_enable: true }}")
    node_of(model, "q").blobs = [np.full((1, 1, 3, 3), weight, np.float32), np.full(1, bias, np.float32)]
    model.clear_cache()
    if mode == "DYNAMIC_FIXED_POINT" and np.isfinite(weight) and weight:
        model.run({"x": np.ones((1, 1, 4, 4), np.float32)})          # its shift reads the weights only
        return
    with pytest.raises(LayerError, match="undefined behaviour"):
        model.run({"x": np.ones((1, 1, 4, 4), np.float32)})


def quant_relu_ref(x, alpha, act_bits, enabled, negative_slope=0.0):
    """Forward_cpu: c = (i / dim) % channels / div_factor, then clamp and round as the fork writes it."""
    n, c = x.shape[:2]
    dim = int(np.prod(x.shape[2:]))
    flat = x.ravel()
    alpha = np.asarray(alpha, np.float32).ravel()
    q = (1 << act_bits) - 1
    out = np.empty_like(flat)
    for i, v in enumerate(flat):
        if enabled:
            a = alpha[(i // dim) % c // (c if alpha.size == 1 else 1)]
            d = min(max(v, f32(0)), a) if not np.isnan(v) else v
            t = f32(f32(d * f32(q)) / a)
            out[i] = f32(math.floor(float(t) + 0.5) * float(a) / q) if not np.isnan(t) else np.nan
        else:
            out[i] = f32(max(v, f32(0)) + f32(negative_slope) * min(v, f32(0)))
    return out.reshape(x.shape)


@pytest.mark.parametrize("shared, act_bits", [(True, 5), (False, 5), (True, 10), (False, 3)])
def test_quant_relu(shared, act_bits, tmp_path):
    shape = (2, 3, 4, 5)
    model = one_layer("QuantReLU", shape, f"quant_relu_param {{ channel_shared: {str(shared).lower()} "
                      f"act_bits: {act_bits} quant_enable: true filler {{ type: 'constant' value: 31 }} }}")
    alpha = np.array(6.5, np.float32) if shared else np.array([0.75, 31.0, 3.3], np.float32)
    node_of(model, "q").blobs = [alpha]
    model.clear_cache()
    x = (rng(23).standard_normal(shape) * 4).astype(np.float32)
    x.ravel()[:3] = [0.0, -0.0, 1e30]
    check_everywhere(model, {"x": x}, {"y": quant_relu_ref(x, alpha, act_bits, True)}, tmp_path)


def test_quant_relu_off_is_a_leaky_relu_and_the_filler_starts_alpha(tmp_path):
    shape = (2, 3, 4)
    model = one_layer("QuantReLU", shape, "quant_relu_param { negative_slope: 0.1 filler { type: 'constant' "
                      "value: 0.826 } }")
    assert float(node_of(model, "q").blobs[0]) == pytest.approx(0.826) and node_of(model, "q").blobs[0].shape == ()
    x = rng(24).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"y": quant_relu_ref(x, 1.0, 5, False, 0.1)}, tmp_path)


@pytest.mark.skipif(not CORPUS.exists(), reason="the corpus files are not on this machine")
def test_gti_nets_read():
    deploy = load(CORPUS / "jack16888__caffessd__ssd-7class__release__train__5801_vgglike_activation_bit_mode1_"
                           "deploy.prototxt", random_weights=True)
    node = next(n for n in deploy.layers if n.name == "q_relu5_1")
    assert (node.attrs["act_bits"], float(node.blobs[0])) == (10, 1023.0)
    assert next(n for n in deploy.layers if n.type == "QuantConvolution").attrs["precision"] == "DYNAMIC_FIXED_POINT"
