"""NeuromorphicProcessorProject/ADaPTION (37cd1cbb): LPConvolution, LPInnerProduct and LPAct with lpfp_param.

The reference transcribes the fork's caffe_cpu_round_fp (src/caffe/util/math_functions.cpp): v * 2^ad, C round()
(halves away from zero) for DETERMINISTIC or floor for STOCHASTIC (its randomNumber() is rand() / RAND_MAX in
integer arithmetic: 0), divided by 2^ad, clamped to +-float32(2^(bd-1) - 2^-ad).  LPConvolution and LPInnerProduct
keep [weight, weight rounded, bias, bias rounded] and compute with blob 0 rounded and blob 2 (rounded with
round_bias); the stored copies 1 and 3 are overwritten by the forward and never read.  Values sit on dyadic
grids, so every product and sum is exact and each backend must match bit for bit.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text


def lp_ref(v, bd, ad, floor=False):
    t = np.asarray(v, np.float32) * np.float32(2.0 ** ad)        # exact: a power of two
    t = t.astype(np.float64)                                      # floor(|t| + 0.5) exact in double
    r = np.floor(t) if floor else np.sign(t) * np.floor(np.abs(t) + 0.5)
    m = np.float32(2.0 ** (bd - 1) - 2.0 ** -ad)
    return np.clip((r / 2.0 ** ad).astype(np.float32), -m, m)


def lpfp(bd, ad, round_bias=False, stochastic=False):
    return (f"lpfp_param {{ bd: {bd} ad: {ad} round_bias: {str(round_bias).lower()} "
            f"rounding_scheme: {'STOCHASTIC' if stochastic else 'DETERMINISTIC'} }}")


def grid(r, shape, scale, spread):
    """Multiples of 1 / scale in (-spread, spread) / scale: with scale 2^(ad+1), halves of the format's step."""
    return (r.integers(-spread, spread, shape) / scale).astype(np.float32)


@pytest.mark.parametrize("round_bias", [False, True])
def test_lp_convolution_rounds_blob_0_and_with_round_bias_the_bias(round_bias, tmp_path):
    shape = (2, 3, 7, 5)
    text = net('layer { name: "c" type: "LPConvolution" bottom: "x" top: "y" convolution_param { num_output: 4 '
               'kernel_h: 3 kernel_w: 2 pad_h: 1 stride_h: 1 stride_w: 2 } ' + lpfp(3, 3, round_bias) + ' }', inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    r = rng(81)
    x = grid(r, shape, 4, 24)
    w = grid(r, (4, 3, 3, 2), 16, 90)          # halves of 2^-3 and values past M = 4 - 1/8
    b = grid(r, (4,), 16, 90)
    junk = np.full_like(w, 1000.0)               # the stored rounded copies are overwritten by the forward
    node_of(model, "c").blobs = [w, junk, b, np.full_like(b, -1000.0)]
    model.clear_cache()
    bias = lp_ref(b, 3, 3) if round_bias else b
    y = conv_ref(x, lp_ref(w, 3, 3), bias, (1, 2), (1, 0)).astype(np.float32)
    assert not np.array_equal(lp_ref(w, 3, 3), w)
    check_everywhere(model, {"x": x}, {"y": y}, tmp_path)


@pytest.mark.parametrize("transpose", [False, True])
def test_lp_inner_product_stochastic_is_the_cpus_floor(transpose, tmp_path):
    shape = (2, 3, 2, 3)
    text = net('layer { name: "ip" type: "LPInnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 5 '
               f'transpose: {str(transpose).lower()} }} ' + lpfp(2, 4, True, True) + ' }', inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    r = rng(82)
    x = grid(r, shape, 8, 40)
    w = grid(r, (18, 5) if transpose else (5, 18), 64, 200)
    b = grid(r, (5,), 64, 200)
    node_of(model, "ip").blobs = [w, np.zeros_like(w), b, np.zeros_like(b)]
    model.clear_cache()
    wq = lp_ref(w, 2, 4, floor=True).astype(np.float64)
    y = x.reshape(2, 18).astype(np.float64) @ (wq if transpose else wq.T) + lp_ref(b, 2, 4, floor=True)
    check_everywhere(model, {"x": x}, {"y": y.astype(np.float32)}, tmp_path)


def test_lp_inner_product_without_bias_keeps_two_blobs(tmp_path):
    text = net('layer { name: "ip" type: "LPInnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 3 '
               'bias_term: false } ' + lpfp(4, 2) + ' }', inputs={"x": (2, 7)})
    model = load_from_text(text, random_weights=True)
    assert [tuple(b.shape) for b in node_of(model, "ip").blobs] == [(3, 7), (3, 7)]
    r = rng(83)
    x, w = grid(r, (2, 7), 4, 30), grid(r, (3, 7), 8, 90)
    node_of(model, "ip").blobs = [w, np.zeros_like(w)]
    model.clear_cache()
    y = x.astype(np.float64) @ lp_ref(w, 4, 2).astype(np.float64).T
    check_everywhere(model, {"x": x}, {"y": y.astype(np.float32)}, tmp_path)


@pytest.mark.parametrize("bd, ad, stochastic", [(2, 2, False), (3, 13, False), (1, 15, True), (16, 16, False)])
def test_lp_act_rounds_and_saturates(bd, ad, stochastic, tmp_path):
    shape = (2, 3, 5, 4)
    text = net(f'layer {{ name: "a" type: "LPAct" bottom: "x" top: "y" {lpfp(bd, ad, stochastic=stochastic)} }}',
               inputs={"x": shape})
    model = load_from_text(text)
    r = rng(84 + ad)
    step = 2.0 ** -(ad + 2)                      # quarters of the format's step, up to 1.5 times its range
    x = (np.round(r.uniform(-1.5, 1.5, shape) * 2.0 ** (bd - 1) / step) * step).astype(np.float32)
    x.flat[:6] = [2.5 / 2 ** ad, -2.5 / 2 ** ad, 0.5 / 2 ** ad, -0.5 / 2 ** ad, 1e9, -1e9]
    y = lp_ref(x, bd, ad, stochastic)
    if (bd, ad) == (16, 16):   # float32(2^15 - 2^-16) is 2^15
        assert y.flat[4] == 32768.0
    check_everywhere(model, {"x": x}, {"y": y}, tmp_path)


def test_lp_act_takes_nan_to_the_lower_bound():
    model = load_from_text(net(f'layer {{ name: "a" type: "LPAct" bottom: "x" top: "y" {lpfp(3, 2)} }}',
                               inputs={"x": (1, 3)}))
    y = model.run({"x": np.array([[math.nan, math.inf, -math.inf]], np.float32)})["y"]
    np.testing.assert_array_equal(y, [[-3.75, 3.75, -3.75]])


def test_the_gpu_difference_is_noted():
    model = load_from_text(net(f'layer {{ name: "a" type: "LPAct" bottom: "x" top: "y" {lpfp(3, 2)} }}',
                               inputs={"x": (1, 3)}))
    assert any("ADaPTION's LP layers run their CPU forward" in w for w in model.warnings)


@pytest.mark.parametrize("param, message", [
    ("", r"lpfp_param.bd must be 1 to 31 \(the fork shifts 1 << \(bd - 1\); bd has no default\), got 0"),
    (lpfp(8, 31), r"lpfp_param.ad must be 0 to 30 \(the fork shifts 1 << ad in an int\), got 31"),
])
def test_bad_formats_are_refused(param, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(net(f'layer {{ name: "a" type: "LPAct" bottom: "x" top: "y" {param} }}', inputs={"x": (1, 3)}))
