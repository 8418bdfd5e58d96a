"""whitenightwu/caffe-quant-QNN's fixed point (b4fc9ad quantization_layer.cpp, quan_conv_layer.cpp,
quan_inner_product_layer.cpp): references from the fork's CPU loops, element by element in Python
(C's round, floor, ceil, trunc; std::min / std::max clamps), on asymmetric shapes."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
C_ROUND = {"ROUND": lambda v: math.copysign(math.floor(abs(v) + 0.5), v), "FLOOR": math.floor,
           "CEIL": math.ceil, "TRUNC": math.trunc}


def analyze(bit_width, low, high, strategy):
    """analyze_scaling_factor: the codes' bounds and 2^k."""
    if low >= 0:
        lo, hi = 0.0, 2.0 ** bit_width - 1
    elif high <= 0:
        lo, hi = -(2.0 ** bit_width) + 1, 0.0
    else:
        lo, hi = -(2.0 ** (bit_width - 1)), 2.0 ** (bit_width - 1) - 1
    neg = math.log2(lo / low) if low < 0 else math.inf
    pos = math.log2(hi / high) if high > 0 else math.inf
    e = min(neg, pos)
    k = {"CONSERVATIVE": math.floor(e), "NEUTRAL": C_ROUND["ROUND"](e), "AGGRESSIVE": math.ceil(e)}[strategy]
    return lo, hi, 2.0 ** k


def fixed_point_ref(x, bit_width, low, high, strategy, method):
    lo, hi, scale = analyze(bit_width, low, high, strategy)
    out = np.empty_like(x)
    for i, v in np.ndenumerate(x):
        r = C_ROUND[method](float(F(v * F(scale))))
        out[i] = F(min(max(r, lo), hi) / scale)
    return out


@pytest.mark.parametrize("method", ["ROUND", "FLOOR", "CEIL", "TRUNC"])
@pytest.mark.parametrize("strategy, bits, rng_values", [("AGGRESSIVE", 4, (0.0, 4.499707)),
                                                        ("CONSERVATIVE", 5, (-2.5, 3.1)),
                                                        ("NEUTRAL", 3, (-6.0, 0.0))])
def test_quantization_layer(method, strategy, bits, rng_values, tmp_path):
    ranges = " ".join(f"range: {v}" for v in rng_values[::-1])    # the fork orders the two values
    text = net(f'layer {{ name: "q" type: "Quantization" bottom: "x" top: "o" quantization_param {{ '
               f'round_method: {method} round_strategy: {strategy} bit_width: {bits} {ranges} }} }}',
               inputs={"x": (2, 3, 4, 5)})
    x = (3 * rng(1).standard_normal((2, 3, 4, 5))).astype(F)
    lo, hi, scale = analyze(bits, min(rng_values), max(rng_values), strategy)
    x.flat[:6] = np.array([0.5, -0.5, 1.5, -2.5, 0.49999997, -0.49999997], F) / F(scale)   # ties and near-ties
    ref = fixed_point_ref(x, bits, min(rng_values), max(rng_values), strategy, method)
    assert len(np.unique(ref)) > 3
    check_everywhere(load_from_text(text), {"x": x}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("param, msg", [
    ("bit_width: 4 range: 1", r"range takes 2 values"),
    ("range: 0 range: 2", r"bit_width must be > 0"),
    ("bit_width: 4 range: 0 range: 0", r"no finite scaling factor"),
    ("bit_width: 1 range: -1 range: 2", r"with 1 bit\(s\) gives the fork no finite scaling factor"),
])
def test_quantization_refuses_what_the_fork_checks_or_cannot_scale(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "q" type: "Quantization" bottom: "x" top: "o" quantization_param {{ {param} }} }}',
                           inputs={"x": (1, 2)}))


def test_quan_convolution_and_inner_product_run_on_fixed_point_weights(tmp_path):
    text = net('layer { name: "c" type: "QuanConvolution" bottom: "x" top: "c" quan_convolution_param { '
               'num_output: 4 kernel_size: 3 stride: 2 pad: 1 round_method: ROUND round_strategy: NEUTRAL bit_width: 8 '
               'range_high: 0.927025 range_low: -0.872089 } }',
               'layer { name: "f" type: "QuanInnerProduct" bottom: "c" top: "o" quan_inner_product_param { '
               'num_output: 3 bit_width: 4 range_low: -0.5 range_high: 0.7 } }',
               inputs={"x": (2, 3, 7, 6)})
    model = load_from_text(text, random_weights=True)
    conv, fc = node_of(model, "c"), node_of(model, "f")
    wc, bc = rng(2).uniform(-1.2, 1.2, (4, 3, 3, 3)).astype(F), rng(3).standard_normal(4).astype(F)
    wf, bf = rng(4).uniform(-0.8, 0.8, (3, 4 * 4 * 3)).astype(F), rng(5).standard_normal(3).astype(F)
    conv.blobs[0], conv.blobs[1], fc.blobs[0], fc.blobs[1] = wc, bc, wf, bf
    x = rng(6).standard_normal((2, 3, 7, 6)).astype(F)
    # Weight_Quantization (CPU) overwrites the rounded weight with its floor whatever round_method says
    assert any("round_method ROUND: the fork's CPU forward floors" in w for w in model.warnings)
    qc = fixed_point_ref(wc, 8, -0.872089, 0.927025, "NEUTRAL", "FLOOR")
    qf = fixed_point_ref(wf, 4, -0.5, 0.7, "AGGRESSIVE", "FLOOR")       # the weighted layers' defaults
    c = conv_ref(x, qc, bc, (2, 2), (1, 1))
    ref = (c.reshape(2, -1) @ qf.astype(np.float64).T + bf).astype(F)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("param, msg", [
    ("num_output: 2 kernel_size: 1 is_runtime: true range_low: -1 range_high: 1", "is_runtime"),
    ("num_output: 2 kernel_size: 1", r"range_low = range_high = 1.0 \(unset, both 1\) sets is_runtime"),
    ("kernel_size: 1 range_low: -1 range_high: 1", "quan_convolution_param.num_output is required"),
])
def test_quan_convolution_refusals(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "c" type: "QuanConvolution" bottom: "x" top: "o" '
                           f'quan_convolution_param {{ {param} }} }}', inputs={"x": (1, 2, 3, 3)}))


def test_quan_inner_product_errors_name_its_own_parameter():
    with pytest.raises(LayerError, match=r"quan_inner_product_param\.axis"):
        load_from_text(net('layer { name: "f" type: "QuanInnerProduct" bottom: "x" top: "o" quan_inner_product_param { '
                           'num_output: 2 axis: 5 range_low: -1 range_high: 1 } }', inputs={"x": (2, 3)}))
