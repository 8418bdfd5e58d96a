"""Ristretto's quantized layers (pmgysel/caffe 614963c, src/caffe/ristretto/layers/*.cu and
include/ristretto/base_ristretto_layer.cuh): numpy loops written from the fork's GPU kernels
(Trim2FixedPoint_kernel, Trim2MiniFloat_device, Trim2IntegerPowerOf2_kernel, LRNFillScaleQ and
LRNComputeOutputQ) and its TEST-phase Forward_gpu (trim the bottoms in place, trim copies of the
weights, run the layer, trim the tops), in torch, onnxruntime and model.py."""
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from c_reference import c_round
from conftest import check_everywhere, conv_ref, model_py_outputs, net, rng

import caffeq
from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.layers.ristretto import ristretto_fixed_point, ristretto_minifloat, ristretto_pow2
from caffeq.model import load_from_text

f32 = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
MNIST = "jszheng__caffe_learn__caffe__mnist__quantized.prototxt"
MOBILENET_SSD = "jazzseow__caffe__examples__MobileNet-SSD__model_quantized__MNSSD_quantized_test.prototxt"


# ---- the kernels, one value at a time ---------------------------------------------------------

def c_fmin(a, b):
    """CUDA's fmin/fmax: a NaN argument loses to the other."""
    return b if math.isnan(a) else a if math.isnan(b) else min(a, b)


def c_fmax(a, b):
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def fixed_point_ref(x, bw, fl, rounding=np.rint):
    """Trim2FixedPoint_kernel, NEAREST: every step in float32 (Dtype), rint rounding half to even (pmgysel's
    GPU) or another rounding."""
    out = np.empty(x.size, np.float32)
    for i, v in enumerate(np.asarray(x, np.float32).ravel()):
        max_data = (f32(2.0 ** (bw - 1)) - f32(1)) * f32(2.0 ** -fl)
        min_data = -f32(2.0 ** (bw - 1)) * f32(2.0 ** -fl)
        v = f32(c_fmax(c_fmin(float(v), float(max_data)), float(min_data)))
        v = f32(v / f32(2.0 ** -fl))
        v = f32(rounding(v))
        out[i] = f32(v * f32(2.0 ** -fl))
    return out.reshape(np.shape(x))


def minifloat_ref(x, bw_mant, bw_exp):
    """Trim2MiniFloat_device, NEAREST: the float's bit fields, the mantissa rounded in double (rint),
    the value assembled in double from powf terms and stored as float."""
    out = np.empty(x.size, np.float32)
    for i, v in enumerate(np.asarray(x, np.float32).ravel()):
        bias_out = int(2.0 ** (bw_exp - 1) - 1)
        d = struct.unpack("<I", struct.pack("<f", v))[0]
        sign, field, mantisa = d >> 31, (d >> 23) & 0xFF, float(d & 0x7FFFFF)
        exponent = field - 127 + bias_out
        if field == 0 or exponent < 0:
            out[i] = 0
            continue
        max_exp, max_mant = int(2.0 ** bw_exp - 1), int(2.0 ** bw_mant - 1)
        if exponent > max_exp:
            exponent, mantisa = max_exp, float(max_mant)
        else:
            mantisa = float(np.rint(mantisa / float(f32(2.0 ** (23 - bw_mant)))))
        with np.errstate(over="ignore"):
            power = float(f32(2.0 ** (exponent - bias_out)))
            out[i] = f32((-1.0) ** sign * ((mantisa + 2.0 ** bw_mant) / 2.0 ** bw_mant) * power)
    return out.reshape(np.shape(x))


def pow2_ref(w, exp_min, exp_max):
    """Trim2IntegerPowerOf2_kernel, NEAREST: log2f, rint, fminf/fmaxf, sign * powf(2, e)."""
    out = np.empty(w.size, np.float32)
    for i, v in enumerate(np.asarray(w, np.float32).ravel()):
        with np.errstate(divide="ignore", invalid="ignore"):
            e = float(np.rint(np.log2(f32(abs(v)))))
        e = c_fmax(c_fmin(e, float(exp_max)), float(exp_min))
        out[i] = (1 if v >= 0 else -1) * f32(2.0 ** e)
    return out.reshape(np.shape(w))


# ---- the layers' arithmetic, as loops -----------------------------------------------------------

def deconv_ref(x, w, b, stride, pad):
    """Caffe's col2im deconvolution (weights C_in x C_out x kh x kw), float64."""
    n, c, h, wd = x.shape
    _, o, kh, kw = w.shape
    oh, ow = stride[0] * (h - 1) + kh - 2 * pad[0], stride[1] * (wd - 1) + kw - 2 * pad[1]
    full = np.zeros((n, o, stride[0] * (h - 1) + kh, stride[1] * (wd - 1) + kw))
    for y in range(h):
        for z in range(wd):
            contrib = np.einsum("nc,cokl->nokl", x[:, :, y, z].astype(np.float64), w)
            full[:, :, y * stride[0]:y * stride[0] + kh, z * stride[1]:z * stride[1] + kw] += contrib
    out = full[:, :, pad[0]:pad[0] + oh, pad[1]:pad[1] + ow]
    return out + (b.reshape(1, -1, 1, 1) if b is not None else 0)


def lrn_ref(x, size, alpha, beta, k, mant, exp):
    """LRNFillScaleQ then LRNComputeOutputQ, one pixel at a time, float32 arithmetic and every
    intermediate through Trim2MiniFloat_device (NEAREST)."""
    def fp(v):
        return minifloat_ref(np.array([v], np.float32), mant, exp)[0]

    n, c, h, w = x.shape
    alpha_over_size = f32(alpha) / f32(size)
    pre = (size - 1) // 2
    post = size - pre - 1
    scale = np.zeros(x.shape, np.float32)
    for i in range(n):
        for y in range(h):
            for z in range(w):
                col = x[i, :, y, z]
                accum = f32(0)
                head = 0
                while head < post and head < c:
                    q = fp(col[head])
                    accum = fp(f32(accum + fp(q * q)))
                    head += 1
                while head < c:
                    q = fp(col[head])
                    accum = fp(f32(accum + fp(q * q)))
                    if head - size >= 0:
                        q = fp(col[head - size])
                        accum = fp(f32(accum - fp(q * q)))
                    scale[i, head - post, y, z] = fp(f32(f32(k) + fp(f32(accum * alpha_over_size))))
                    head += 1
                while head < c + post:
                    if head - size >= 0:
                        q = fp(col[head - size])
                        accum = fp(f32(accum - fp(q * q)))
                    scale[i, head - post, y, z] = fp(f32(f32(k) + fp(f32(accum * alpha_over_size))))
                    head += 1
    out = np.zeros(x.shape, np.float32)
    for idx in np.ndindex(*x.shape):
        out[idx] = fp(f32(fp(x[idx]) * fp(f32(scale[idx]) ** f32(-beta))))
    return out


# ---- the trims alone ------------------------------------------------------------------------------

def test_fixed_point_bounds_ties_and_nan():
    step = 0.125     # bw 8, fl 3: [-16, 15.875]
    x = np.array([15.875, 15.9375, 100.0, -16.0, -16.0625, -1e9, 0.0625, -0.0625, 0.1875, -0.1875,
                  0.3125, -0.3125, 1.0625, 3 * step, np.inf, -np.inf, np.nan, -0.0, 1e-30], np.float32)
    got = ristretto_fixed_point(torch.from_numpy(x), -16.0, 15.875, step).numpy()
    np.testing.assert_array_equal(got, fixed_point_ref(x, 8, 3))
    # the bounds, NaN as the upper bound, and ties to even (0.3125 / 0.125 = 2.5 -> 2, not CPU round()'s 3)
    np.testing.assert_array_equal(got[[0, 1, 2, 3, 4, 5, 16]], [15.875, 15.875, 15.875, -16, -16, -16, 15.875])
    np.testing.assert_array_equal(got[6:12], [0, 0, 0.25, -0.25, 0.25, -0.25])


@pytest.mark.parametrize("bw, fl", [(8, 3), (4, -2), (16, 13), (32, 32), (32, 27), (1, 0), (6, 0)])
def test_fixed_point_matches_the_kernel(bw, fl):
    from caffeq.layers.ristretto import fixed_point_trim
    x = (rng(3).standard_normal(400) * 2.0 ** (bw - 1 - fl)).astype(np.float32)
    _, low, high, step = fixed_point_trim(bw, fl, "params")
    got = ristretto_fixed_point(torch.from_numpy(x), low, high, step).numpy()
    np.testing.assert_array_equal(got, fixed_point_ref(x, bw, fl))
    if (bw, fl) == (32, 32):   # powf(2, 31) - 1 is 2^31 in float32: the data is bounded to +-0.5
        assert high == 0.5 and low == -0.5


def minifloat_cases():
    return np.array([0.0, -0.0, 1e-40, -1e-45, 2.0 ** -7, 2.0 ** -7 * 0.99, 2.0 ** -8, 1.0625, 1.1875,
                     -1.0625, -1.1875, 1.5, 3.0, 500.0, 511.0, 512.0, 600.0, -1e6, 479.0, 481.0, np.inf,
                     -np.inf, np.nan, 3e38, -3.4e38, 0.1, -0.7], np.float32)


@pytest.mark.parametrize("mant, exp", [(3, 4), (0, 4), (5, 3), (10, 5), (23, 8), (26, 8), (2, 8), (7, 0), (4, 1)])
def test_minifloat_matches_the_device_function(mant, exp):
    x = np.concatenate([minifloat_cases(), (rng(4).standard_normal(300) * 50).astype(np.float32),
                        (rng(5).standard_normal(100) * 1e-3).astype(np.float32)])
    got = ristretto_minifloat(torch.from_numpy(x), mant, exp).numpy()
    np.testing.assert_array_equal(got, minifloat_ref(x, mant, exp))
    np.testing.assert_array_equal(np.signbit(got[:2]), [False, False])   # a zero comes out as +0


def test_minifloat_edges():
    x = minifloat_cases()
    got = dict(zip(x.tolist()[:20], ristretto_minifloat(torch.from_numpy(x), 3, 4).numpy().tolist()[:20]))
    assert got[2.0 ** -7] == 2.0 ** -7 and got[float(f32(2.0 ** -7 * 0.99))] == 0   # exponent below 0
    assert got[1.0625] == 1.0 and got[1.1875] == 1.25   # mantissa ties to even
    assert got[500.0] == 512.0 and got[600.0] == 480.0  # a carry past the largest value; saturation
    zero_m = ristretto_minifloat(torch.tensor([1.5, 2.5, 3.5]), 0, 4).numpy()
    np.testing.assert_array_equal(zero_m, [1.0, 2.0, 4.0])   # mant 0: rint on the fraction alone
    wide = ristretto_minifloat(torch.tensor([np.inf, -np.inf, np.nan, 1e-40]), 23, 8).numpy()
    np.testing.assert_array_equal(wide, [np.inf, -np.inf, np.inf, 0])


def test_pow2_matches_the_kernel():
    w = np.concatenate([np.array([0.0, -0.0, 1.0, -1.0, 0.3, -0.3, 1e-9, -1e-9, 5.0, np.nan,
                                  2 ** -3.5, 2 ** -3.5 * 1.0000001, -(2 ** -5.5), 0.70710677, 0.7071068],
                                 np.float32),
                        (rng(6).standard_normal(300) * 0.2).astype(np.float32)])
    got = ristretto_pow2(torch.from_numpy(w), -8, -1).numpy()
    np.testing.assert_array_equal(got, pow2_ref(w, -8, -1))
    np.testing.assert_array_equal(got[:10], [2 ** -8, 2 ** -8, 0.5, -0.5, 0.25, -0.25, 2 ** -8, -(2 ** -8),
                                             0.5, -0.5])   # 0 -> +2^exp_min; NaN -> -2^exp_max


# ---- the layers ---------------------------------------------------------------------------------

def qparam(**fields):
    return "quantization_param { " + " ".join(f"{k}: {v}" for k, v in fields.items()) + " }"


def one_layer(type_, shape, params, q, top="y"):
    return load_from_text(net(f'layer {{ name: "q" type: "{type_}" bottom: "x" top: "{top}" {params} {q} }}',
                              inputs={"x": shape}), random_weights=True)


def set_blobs(model, name, *blobs):
    node = next(n for n in model.layers if n.name == name)
    node.blobs = [np.asarray(b, np.float32) for b in blobs]
    model.clear_cache()
    return node


def with_edges(x, values):
    flat = x.reshape(-1).copy()
    flat[:len(values)] = values
    return flat.reshape(x.shape)


# bounds and ties of bw 8, fl 3 ([-16, 15.875], step 1/8) planted in the input
EDGES = [15.875, 15.9375, 40.0, -16.0, -16.0625, 0.0625, -0.0625, 0.3125, -0.3125, 0.1875]


@pytest.mark.parametrize("q, fixed", [
    (dict(bw_layer_in=8, fl_layer_in=3, bw_params=6, fl_params=4, bw_layer_out=8, fl_layer_out=2), True),
    (dict(bw_layer_in=6, fl_layer_in=-1, bw_params=5, fl_params=3, bw_layer_out=5, fl_layer_out=-2), True),
    (dict(precision="INTEGER_POWER_OF_2_WEIGHTS", exp_min=-6, exp_max=0, bw_layer_in=8, fl_layer_in=3,
          bw_layer_out=10, fl_layer_out=2), True),
    (dict(precision="INTEGER_POWER_OF_2_WEIGHTS"), True),    # activations: 32-bit words, fl 16
    (dict(precision="MINIFLOAT", mant_bits=3, exp_bits=4), False),
])
def test_convolution_ristretto(q, fixed, tmp_path):
    shape = (2, 4, 7, 6)
    params = "convolution_param { num_output: 6 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 group: 2 }"
    model = one_layer("ConvolutionRistretto", shape, params, qparam(**q))
    r = rng(7)
    if fixed:
        x = with_edges((r.standard_normal(shape) * 6).astype(np.float32), EDGES)
        if "fl_layer_in" not in q:   # 16 fractional bits: inputs on a grid keep the sums exact
            x = np.round(x * 8) / 8
        w = (r.standard_normal((6, 2, 3, 2)) * 0.6).astype(np.float32)
    else:   # inputs with 6 significant bits that minifloat trims to 4: the products stay exact
        x = (r.integers(-64, 64, shape) / 16).astype(np.float32)
        w = (r.integers(-16, 16, (6, 2, 3, 2)) / 8).astype(np.float32)
    b = (r.standard_normal(6) * 2).astype(np.float32)
    set_blobs(model, "q", w, b)
    trim_in, trim_w, trim_b, trim_out = trims(q)
    y = conv_ref(trim_in(x), trim_w(w), trim_b(b), (2, 1), (1, 0), group=2)
    ref = trim_out(y.astype(np.float32))
    if fixed:
        check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)
    else:
        assert np.array_equal(model.run({"x": x})["y"], ref)
        assert np.array_equal(model_py_outputs(model, {"x": x}, tmp_path)["y"], ref)
        with pytest.raises(ExportError, match="minifloat trim reads the float's exponent bits"):
            model.export_onnx(str(tmp_path / "m.onnx"))


def trims(q):
    """(inputs, weights, bias, outputs) reference trims of a quantization_param dict."""
    precision = q.get("precision", "DYNAMIC_FIXED_POINT")
    if precision == "MINIFLOAT":
        m, e = q.get("mant_bits", 23), q.get("exp_bits", 8)
        t = lambda a: minifloat_ref(a, m, e)   # noqa: E731
        return t, t, t, t

    def fixed(name):
        return lambda a: fixed_point_ref(a, q.get(f"bw_{name}", 32), q.get(f"fl_{name}", 16))
    if precision == "DYNAMIC_FIXED_POINT":
        return fixed("layer_in"), fixed("params"), fixed("params"), fixed("layer_out")
    return (fixed("layer_in"), lambda a: pow2_ref(a, q.get("exp_min", -8), q.get("exp_max", -1)),
            lambda a: a, fixed("layer_out"))


@pytest.mark.parametrize("transpose, axis, shape", [(False, 1, (3, 4, 2, 3)), (True, 1, (3, 5)),
                                                     (False, 2, (2, 3, 4, 5))])
def test_fc_ristretto(transpose, axis, shape, tmp_path):
    q = dict(bw_layer_in=8, fl_layer_in=3, bw_params=6, fl_params=4, bw_layer_out=9, fl_layer_out=3)
    k = int(np.prod(shape[axis:]))
    model = one_layer("FcRistretto", shape, f"inner_product_param {{ num_output: 7 axis: {axis} "
                                            f"transpose: {str(transpose).lower()} }}", qparam(**q))
    r = rng(8)
    x = with_edges((r.standard_normal(shape) * 6).astype(np.float32), EDGES)
    w = (r.standard_normal((k, 7) if transpose else (7, k)) * 0.6).astype(np.float32)
    b = (r.standard_normal(7) * 2).astype(np.float32)
    set_blobs(model, "q", w, b)
    trim_in, trim_w, trim_b, trim_out = trims(q)
    wq = trim_w(w).astype(np.float64)
    lead = shape[:axis]
    y = trim_in(x).reshape(int(np.prod(lead)), k).astype(np.float64) @ (wq if transpose else wq.T) + trim_b(b)
    ref = trim_out(y.astype(np.float32)).reshape(lead + (7,))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_fc_ristretto_pow2_keeps_the_bias(tmp_path):
    q = dict(precision="INTEGER_POWER_OF_2_WEIGHTS", exp_min=-4, exp_max=1, bw_layer_in=8, fl_layer_in=3,
             bw_layer_out=12, fl_layer_out=4)
    model = one_layer("FcRistretto", (2, 6), "inner_product_param { num_output: 3 }", qparam(**q))
    r = rng(9)
    x = (r.standard_normal((2, 6)) * 3).astype(np.float32)
    w = (r.standard_normal((3, 6))).astype(np.float32)
    b = np.array([0.3, -1.7, 0.01], np.float32)   # untrimmed: 0.3 is no power of two
    set_blobs(model, "q", w, b)
    trim_in, trim_w, _, trim_out = trims(q)
    y = trim_in(x).astype(np.float64) @ trim_w(w).astype(np.float64).T
    ref = trim_out((y.astype(np.float32) + b).astype(np.float32))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("q", [
    dict(bw_layer_in=8, fl_layer_in=3, bw_params=6, fl_params=4, bw_layer_out=8, fl_layer_out=1),
    dict(precision="INTEGER_POWER_OF_2_WEIGHTS", exp_min=-3, exp_max=1, bw_layer_in=7, fl_layer_in=2,
         bw_layer_out=8, fl_layer_out=1),
])
def test_deconvolution_ristretto(q, tmp_path):
    shape = (2, 3, 4, 5)
    params = "convolution_param { num_output: 4 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 0 }"
    model = one_layer("DeconvolutionRistretto", shape, params, qparam(**q))
    r = rng(10)
    x = with_edges((r.standard_normal(shape) * 6).astype(np.float32), EDGES)
    w = (r.standard_normal((3, 4, 3, 2)) * 0.6).astype(np.float32)
    b = (r.standard_normal(4) * 2).astype(np.float32)
    set_blobs(model, "q", w, b)
    trim_in, trim_w, trim_b, trim_out = trims(q)
    ref = trim_out(deconv_ref(trim_in(x), trim_w(w), trim_b(b), (2, 3), (1, 0)).astype(np.float32))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("shape, size, mant, exp, alpha, beta, k", [
    ((2, 5, 3, 2), 3, 3, 4, 1.0, 0.75, 2.0),
    ((1, 7, 2, 3), 5, 5, 5, 0.3, 0.6, 1.0),
    ((2, 3, 2, 2), 5, 10, 5, 2.0, 0.75, 1.5),     # fewer channels than the window
])
def test_lrn_ristretto(shape, size, mant, exp, alpha, beta, k, tmp_path):
    x = (rng(11).standard_normal(shape) * 2).astype(np.float32)
    params = f"lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} k: {k} }}"
    # rounding_scheme is ignored: LRNRistretto always rounds to nearest
    q = qparam(precision="MINIFLOAT", mant_bits=mant, exp_bits=exp, rounding_scheme="STOCHASTIC")
    model = one_layer("LRNRistretto", shape, params, q)
    ref = lrn_ref(x, size, alpha, beta, k, mant, exp)
    assert np.array_equal(model.run({"x": x})["y"], ref)
    assert np.array_equal(model_py_outputs(model, {"x": x}, tmp_path)["y"], ref)
    with pytest.raises(ExportError, match="running channel sum to minifloat"):
        model.export_onnx(str(tmp_path / "m.onnx"))


# ---- the trimmed bottom, written back ---------------------------------------------------------------

WRITE_BACK = """
layer { name: "before" type: "AbsVal" bottom: "x" top: "before" }
layer { name: "a" type: "ConvolutionRistretto" bottom: "x" top: "a"
  convolution_param { num_output: 2 kernel_h: 1 kernel_w: 2 }
  quantization_param { bw_layer_in: 8 fl_layer_in: 3 bw_params: 8 fl_params: 4 bw_layer_out: 10 fl_layer_out: 3 } }
layer { name: "b" type: "ConvolutionRistretto" bottom: "x" top: "b"
  convolution_param { num_output: 3 kernel_h: 2 kernel_w: 1 }
  quantization_param { bw_layer_in: 5 fl_layer_in: 1 bw_params: 8 fl_params: 4 bw_layer_out: 10 fl_layer_out: 3 } }
layer { name: "drop" type: "Dropout" bottom: "x" top: "xd" }
layer { name: "after" type: "AbsVal" bottom: "xd" top: "after" }
"""


def test_a_later_layer_reads_the_trimmed_bottom(tmp_path):
    """conv_ristretto_layer.cu trims bottom[i]->mutable_gpu_data(): layer b then reads x as a trimmed
    it, and the AbsVal after both reads x trimmed twice; the AbsVal before reads x as fed."""
    shape = (2, 3, 4, 5)
    model = load_from_text(net(WRITE_BACK, inputs={"x": shape}), random_weights=True)
    r = rng(12)
    x = with_edges((r.standard_normal(shape) * 6).astype(np.float32), EDGES)
    wa, ba = (r.standard_normal((2, 3, 1, 2)) * 0.5).astype(np.float32), np.array([0.5, -0.25], np.float32)
    wb, bb = (r.standard_normal((3, 3, 2, 1)) * 0.5).astype(np.float32), np.array([1, 0, -1], np.float32)
    set_blobs(model, "a", wa, ba)
    set_blobs(model, "b", wb, bb)
    assert [len(n.outputs) for n in model.layers if n.name in "ab"] == [2, 2]
    xa = fixed_point_ref(x, 8, 3)
    xb = fixed_point_ref(xa, 5, 1)
    w4 = lambda a: fixed_point_ref(a, 8, 4)   # noqa: E731
    refs = {"before": np.abs(x), "after": np.abs(xb),
            "a": fixed_point_ref(conv_ref(xa, w4(wa), w4(ba), (1, 1), (0, 0)).astype(np.float32), 10, 3),
            "b": fixed_point_ref(conv_ref(xb, w4(wb), w4(bb), (1, 1), (0, 0)).astype(np.float32), 10, 3)}
    assert not np.array_equal(xa, xb)
    check_everywhere(model, {"x": x}, refs, tmp_path)
    ours = model.run({"x": x})   # the optimized module: Dropout removed
    for k, v in refs.items():
        np.testing.assert_array_equal(ours[k], v)


def test_a_written_bottom_nobody_reads_adds_no_output():
    model = load_from_text(net('layer { name: "q" type: "FcRistretto" bottom: "x" top: "y" '
                               'inner_product_param { num_output: 2 } }', inputs={"x": (1, 3)}), random_weights=True)
    node = next(n for n in model.layers if n.name == "q")
    assert len(node.outputs) == 1 and "written_back" not in node.attrs
    assert model.outputs == ["y"]


# ---- what the fork refuses, and STOCHASTIC -----------------------------------------------------------

@pytest.mark.parametrize("type_, params, q, msg", [
    ("LRNRistretto", "lrn_param { local_size: 3 }", "", "only supports precision MINIFLOAT"),
    ("LRNRistretto", "lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL }", 'precision: MINIFLOAT',
     "ACROSS_CHANNELS only"),
    ("ConvolutionRistretto", "convolution_param { num_output: 2 kernel_size: 1 }", "bw_layer_in: 0",
     "bw_layer_in must be 1 to 64 bits"),
    ("FcRistretto", "inner_product_param { num_output: 2 }", "fl_params: 200", "fl_params must be -126 to 126"),
    ("FcRistretto", "inner_product_param { num_output: 2 }", "precision: MINIFLOAT exp_bits: 31",
     "at most 30"),
])
def test_refusals(type_, params, q, msg):
    with pytest.raises(LayerError, match=msg):
        one_layer(type_, (1, 4, 3, 3), params, f"quantization_param {{ {q} }}")


def test_stochastic_rounding_reads_but_does_not_run(tmp_path):
    model = one_layer("ConvolutionRistretto", (1, 2, 3, 3), "convolution_param { num_output: 2 kernel_size: 1 }",
                      qparam(rounding_scheme="STOCHASTIC"))
    assert model.graph.shape("y") == (1, 2, 3, 3)
    with pytest.raises(CaffeqError, match="rounding_scheme STOCHASTIC rounds with random numbers"):
        model.run({"x": np.zeros((1, 2, 3, 3), np.float32)})
    with pytest.raises(ExportError, match="rounding_scheme STOCHASTIC"):
        model.export_onnx(str(tmp_path / "m.onnx"))


# ---- the real files --------------------------------------------------------------------------------

def maxpool2(a):
    n, c, h, w = a.shape
    return a.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def test_real_mnist_runs_as_the_fork(tmp_path):
    """jszheng/caffe_learn's LeNet in dynamic fixed point (4-bit weights, 8-bit activations)."""
    model = caffeq.load(REALWORLD / MNIST, random_weights=True, input_shapes={"data": (2, 1, 28, 28)},
                        outputs=["ip2"])
    x = rng(13).uniform(0, 1, (2, 1, 28, 28)).astype(np.float32)
    blobs = {n.name: n.blobs for n in model.layers if n.blobs}
    fp = fixed_point_ref

    def conv(a, name, q_in, q_w, q_out):
        w, b = blobs[name]
        return fp(conv_ref(fp(a, *q_in), fp(w, *q_w), fp(b, *q_w), (1, 1), (0, 0)).astype(np.float32), *q_out)

    def fc(a, name, q_in, q_w, q_out):
        w, b = blobs[name]
        a = fp(a.reshape(a.shape[0], -1), *q_in).astype(np.float64)
        return fp((a @ fp(w, *q_w).T.astype(np.float64) + fp(b, *q_w)).astype(np.float32), *q_out)

    h = maxpool2(conv(x, "conv1", (8, 8), (4, 3), (8, 6)))
    h = maxpool2(conv(h, "conv2", (8, 6), (4, 5), (8, 3)))
    h = np.maximum(fc(h, "ip1", (8, 4), (4, 6), (8, 4)), 0)
    check_everywhere(model, {"data": x}, {"ip2": fc(h, "ip2", (8, 4), (4, 4), (8, 3))}, tmp_path)


def test_real_mobilenet_ssd_reads_with_its_shared_bottoms_written_back(tmp_path):
    model = caffeq.load(REALWORLD / MOBILENET_SSD, unknown_shapes_ok=True)
    written = {n.name: n.outputs[1:] for n in model.layers if n.attrs.get("written_back")}
    # conv11 feeds conv12/dw, then the heads: each trims it in place for the next
    assert written["conv12/dw"] == ["conv11@conv12/dw"] and written["conv0"] == ["data@conv0"]
    node = next(n for n in model.layers if n.name == "conv0")
    assert node.attrs["ristretto"]["inputs"] == ("fixed", -0.5, 0.5, 2.0 ** -32)   # bw 32, fl 32
    shapes = [model.graph.shape(t) for t in node.inputs + node.outputs]
    assert node.spec.macs(node.attrs, shapes[:1], shapes[1:]) == 32 * 150 * 150 * 27   # the top's only



# ---- Egoist67/quanti_ristretto's ScaleRistretto: round() halves away from zero ---------------------

def fixed_point_away_ref(x, bw, fl):
    """Egoist67's Trim2FixedPoint: as fixed_point_ref, with C's round() (halves away from zero)."""
    return fixed_point_ref(x, bw, fl, rounding=c_round)


def test_the_forks_worked_example_rounds_ties_away_from_zero():
    # spec: bias -0.03125 at fl 4 is -0.5 steps: round() gives -1 (-0.0625), rint would give -0
    assert fixed_point_away_ref(np.array([-0.03125, 0.15625, 9.3, -9.3], np.float32), 8, 4).tolist() == \
        [-0.0625, 0.1875, 7.9375, -8.0]
    model = one_layer("ScaleRistretto", (1, 1, 1, 2), "scale_param { bias_term: true }",
                      qparam(bw_layer_out=8, bw_params=8, fl_layer_out=4, fl_params=4))
    set_blobs(model, "q", [1.53], [-0.03125])
    # x = 0.30001 -> 0.300003051758 (2^-16 grid); 1.5 x - 0.0625 = 0.3875 -> 0.375; 0.125 -> 0.1875 - 0.0625
    y = model.run({"x": np.array([[[[0.30001, 0.125]]]], np.float32)})["y"]
    np.testing.assert_array_equal(y.ravel(), [0.375, 0.125])


@pytest.mark.parametrize("q", [
    dict(bw_layer_out=8, bw_params=8, fl_layer_out=4, fl_params=4),      # the corpus net's form
    dict(bw_layer_in=8, fl_layer_in=3, bw_params=6, fl_params=4, bw_layer_out=8, fl_layer_out=2),
])
def test_scale_ristretto_matches_the_forks_loop(q, tmp_path):
    shape = (2, 5, 3, 4)
    model = one_layer("ScaleRistretto", shape, "scale_param { bias_term: true }", qparam(**q))
    r = rng(12)
    x = with_edges((r.standard_normal(shape) * 6).astype(np.float32), EDGES)
    # scales and biases on the 2^-5 grid land on exact halves of the params' 2^-4 step: ties
    s = (r.integers(-40, 40, 5) / 32).astype(np.float32)
    b = (r.integers(-40, 40, 5) / 32).astype(np.float32)
    set_blobs(model, "q", s, b)
    fixed = {k: (q.get(f"bw_{k}", 32), q.get(f"fl_{k}", 16)) for k in ("layer_in", "params", "layer_out")}
    xq = fixed_point_away_ref(x, *fixed["layer_in"])
    sq, bq = fixed_point_away_ref(s, *fixed["params"]), fixed_point_away_ref(b, *fixed["params"])
    assert not np.array_equal(bq, fixed_point_ref(b, *fixed["params"]))   # the ties are there
    y = (xq * sq[None, :, None, None]).astype(np.float32) + bq[None, :, None, None]
    check_everywhere(model, {"x": x}, {"y": fixed_point_away_ref(y.astype(np.float32), *fixed["layer_out"])},
                     tmp_path)


def test_scale_ristretto_without_a_bias_is_refused():
    with pytest.raises(LayerError, match="bias_term: false"):
        one_layer("ScaleRistretto", (1, 2, 2, 2), "scale_param { bias_term: false }", qparam(bw_params=8))
