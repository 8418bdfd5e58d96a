"""Ristretto's quantized layers (pmgysel/caffe 614963c, src/caffe/ristretto/layers/*.cpp/.cu,
include/ristretto/base_ristretto_layer.{hpp,cuh}): ConvolutionRistretto, DeconvolutionRistretto,
FcRistretto and LRNRistretto, read with `quantization_param` (QuantizationParameter).  XmBrain/Quantizer
(75dd74d), a Ristretto-based fork, reuses the names with a quantization_param of its own
(xmbrain_quantization_param here): see parse_xmbrain and caffeq/layers/xmbrain.py.

What a TEST-phase forward computes, as the fork's GPU code does it (Ristretto's tool runs nets on the
GPU, LRNRistretto has no CPU forward at all, and the CPU helpers differ in the ways listed below):

- Convolution, Deconvolution, InnerProduct: every bottom is trimmed (QuantizeLayerInputs), the
  weights and bias are copies of the blobs trimmed (QuantizeWeights, again at every forward: the same
  values each time, so computing them once is the same), the layer's own arithmetic runs on those,
  and every top is trimmed (QuantizeLayerOutputs).  The trimmed inputs are written back into the
  bottom blobs themselves: a later layer that reads such a blob sees them (Layer.bottoms_written_back).
- DYNAMIC_FIXED_POINT (bw, fl): saturate to [-2^(bw-1) * 2^-fl, (2^(bw-1) - 1) * 2^-fl], both bounds
  computed in float32 (so 2^31 - 1 is 2^31 and bw 32, fl 32 bounds the data to +-0.5), divide by
  2^-fl, round half to even (rint), multiply by 2^-fl.  fmin/fmax: NaN becomes the upper bound.
  Inputs use bw_layer_in / fl_layer_in, tops bw_layer_out / fl_layer_out, weights and bias bw_params /
  fl_params.
- MINIFLOAT (mant_bits m, exp_bits e), from the float32 bit fields: a zero or subnormal input, or one
  whose exponent re-biased by 2^(e-1) - 1 falls below 0, becomes +0; one whose re-biased exponent
  exceeds 2^e - 1 saturates to +-(2 - 2^-m) * 2^(2^(e-1)); else the 23-bit mantissa is rounded half to
  even to m bits (a carry moves to the next power of two; inf or NaN in range give +-inf).  Inputs,
  tops, weights and bias alike.
- INTEGER_POWER_OF_2_WEIGHTS (exp_min, exp_max): weights become sign(w) * 2^clamp(rint(log2|w|),
  exp_min, exp_max) (w >= 0 counts as +, 0 gives +2^exp_min); the bias is not trimmed; inputs and tops
  are trimmed to dynamic fixed point with bw_layer_in/out and fl_layer_in/out (32 and 16 by default).
- LRNRistretto (MINIFLOAT only, ACROSS_CHANNELS only): Caffe's LRN with every intermediate trimmed to
  minifloat, rounding NEAREST whatever rounding_scheme says: each input, each square, the running
  channel sum after every add and every subtract (so the sum's order matters), alpha / size times it,
  k plus that, pow(scale, -beta), the input times it.
- rounding_scheme STOCHASTIC rounds with curand numbers seeded from clock() at every forward: read,
  but refused by every backend (caffeq does not draw random roundings).

The fork's CPU code differs: NEAREST rounds half away from zero (round()); Trim2MiniFloat_cpu returns
from the whole loop at the first zero or underflowing value, leaving the rest of the blob untrimmed;
INTEGER_POWER_OF_2_WEIGHTS leaves inputs and tops untrimmed; LRNRistretto aborts.  Its GPU
InnerProduct runs a batch of one through gemv without `transpose` (as BVLC's does); caffeq follows
InnerProduct's `transpose` at every batch size.  Only the TEST phase's forward is modelled (TRAIN
rounds the weights stochastically and leaves activations in float).

SummerLife/caffe_mobilessd (c44db66) adds QuantizationParameter fl_bias_params, bw_bias_params, weight_scale,
data_scale and int8_term: only its CPU forward reads them (see mobilessd_notes); they are read with a note.
"""
import copy
import dataclasses

import numpy as np
import torch

from ..errors import ExportError
from .c_numerics import c_round, onnx_c_round
from .conv import Convolution, Deconvolution, InnerProduct, _onnx_conv, _torch_conv_source
from .elementwise import Scale
from .norm import ACROSS_CHANNELS, LRN
from .registry import Layer, LayerError, count, register_layer

PRECISIONS = ("DYNAMIC_FIXED_POINT", "MINIFLOAT", "INTEGER_POWER_OF_2_WEIGHTS")
ROUNDINGS = ("NEAREST", "STOCHASTIC")


# ---- the trims, in torch (copied into model.py) ---------------------------------------------

def ristretto_fixed_point(x, low: float, high: float, step: float):
    """Ristretto's Trim2FixedPoint (GPU kernel, NEAREST): fmin/fmax saturation to [low, high] (NaN
    becomes high), x / step rounded half to even, times step.  low, high, step are float32 values
    and step a power of two, so each operation is the kernel's float32 one."""
    x = torch.fmax(torch.fmin(x, x.new_tensor(high)), x.new_tensor(low))
    return torch.round(x / step) * step


def ristretto_fixed_point_away(x, low: float, high: float, step: float):
    """Egoist67/quanti_ristretto's Trim2FixedPoint: ristretto_fixed_point with round() (halves away from
    zero) in place of rint."""
    x = torch.fmax(torch.fmin(x, x.new_tensor(high)), x.new_tensor(low))
    return c_round(x / step) * step


def ristretto_minifloat(x, mant_bits: int, exp_bits: int):
    """Ristretto's Trim2MiniFloat_device (NEAREST) on float32 bit fields: see the module docstring."""
    bias = int(2.0 ** (exp_bits - 1) - 1)
    max_exp = int(2.0 ** exp_bits - 1)
    # the saturated value in double, then float32 as the fork's store rounds it (inf past the range)
    saturated = (2.0 - 2.0 ** -mant_bits) * 2.0 ** (max_exp - bias) if max_exp - bias < 1024 else float("inf")
    saturated = float(torch.tensor(saturated, dtype=torch.float64).to(torch.float32))
    bits = x.to(torch.float32).view(torch.int32)
    field = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    exponent = field - 127 + bias
    shift = 23 - mant_bits
    if shift > 0:
        kept = mantissa >> shift
        rest = mantissa & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
        # a carry out of the mantissa adds one to the exponent field, as (mantissa + 2^m) / 2^m does
        # (an inf or NaN field, replaced below, counts as 254 here so that the sum stays in int32)
        magnitude = ((field.clamp(max=254) << 23) + ((kept + up.to(torch.int32)) << shift)).view(torch.float32)
    else:
        magnitude = (bits & 0x7FFFFFFF).view(torch.float32)
    magnitude = torch.where(field == 255, torch.full_like(magnitude, float("inf")), magnitude)
    magnitude = torch.where(exponent > max_exp, torch.full_like(magnitude, saturated), magnitude)
    y = torch.where(bits < 0, -magnitude, magnitude)
    y = torch.where((field == 0) | (exponent < 0), torch.zeros_like(y), y)
    return y.to(x.dtype)


def ristretto_pow2(w, exp_min: int, exp_max: int):
    """Ristretto's Trim2IntegerPowerOf2 (GPU kernel, NEAREST): sign(w) * 2^fmax(fmin(rint(log2|w|),
    exp_max), exp_min), w >= 0 taken as positive (a zero becomes +2^exp_min)."""
    return pow2_of(torch.round(torch.log2(torch.abs(w))), w, exp_min, exp_max)


def ristretto_pow2_away(w, exp_min: int, exp_max: int):
    """Egoist67/quanti_ristretto's Trim2IntegerPowerOf2: the exponent rounded half away from zero."""
    return pow2_of(c_round(torch.log2(torch.abs(w))), w, exp_min, exp_max)


def pow2_of(e, w, exp_min: int, exp_max: int):
    """sign(w) * 2^e with e clamped to [exp_min, exp_max] (fmin/fmax), w >= 0 taken as positive."""
    e = torch.fmax(torch.fmin(e, e.new_tensor(float(exp_max))), e.new_tensor(float(exp_min)))
    return torch.where(w >= 0, torch.exp2(e), -torch.exp2(e))


def ristretto_lrn(x, size: int, alpha_over_size: float, beta: float, k: float, mant_bits: int,
                  exp_bits: int):
    """LRNRistretto's CrossChannelForward_gpu: Caffe's across-channel LRN with every intermediate
    trimmed to minifloat, the channel sum accumulated in order (LRNFillScaleQ, LRNComputeOutputQ)."""
    def fp(t):
        return ristretto_minifloat(t, mant_bits, exp_bits)

    xq = fp(x)
    squares = fp(xq * xq)
    post = size - (size - 1) // 2 - 1
    channels = x.shape[1]
    accum = torch.zeros_like(x[:, 0])
    scale = []
    for head in range(channels + post):
        if head < channels:
            accum = fp(accum + squares[:, head])
        if head >= size:
            accum = fp(accum - squares[:, head - size])
        if head >= post:
            scale.append(fp(k + fp(accum * alpha_over_size)))
    scale = torch.stack(scale, 1)
    return fp(xq * fp(torch.pow(scale, -beta)))


def ristretto_trim(x, how):
    """One trim of the layer's `how`: ("fixed", low, high, step), ("minifloat", m, e) or
    ("pow2", exp_min, exp_max); None leaves x as it is."""
    if how is None:
        return x
    return TORCH_TRIMS[how[0]](x, *how[1:])


TORCH_TRIMS = {"fixed": ristretto_fixed_point, "minifloat": ristretto_minifloat, "pow2": ristretto_pow2,
               "fixed_away": ristretto_fixed_point_away, "pow2_away": ristretto_pow2_away}
# the helpers each trim calls, written into model.py before it
TRIM_NEEDS = {"fixed_away": (c_round,), "pow2": (pow2_of,), "pow2_away": (c_round, pow2_of)}


def trimmed_blobs(blobs, q):
    """The weight and bias blobs (numpy) as the layer's forward uses them, float32."""
    out = []
    for i, b in enumerate(blobs):
        how = q["weights"] if i == 0 else q["bias"]
        t = torch.from_numpy(np.array(b, dtype=np.float32, copy=True))
        out.append(ristretto_trim(t, how).numpy())
    return out


# ---- parameters -----------------------------------------------------------------------------

def _f32(value):
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(value)


def fixed_point_trim(bw, fl, what):
    """("fixed", low, high, step) for a word of bw bits with fl fractional bits, each bound computed
    as the fork's kernel does in float32: (powf(2, bw-1) - 1) * powf(2, -fl), -powf(2, bw-1) * powf(2, -fl)."""
    if not 1 <= bw <= 64:
        raise LayerError(f"quantization_param.bw_{what} must be 1 to 64 bits, got {bw}")
    if not -126 <= fl <= 126:
        raise LayerError(f"quantization_param.fl_{what} must be -126 to 126 (2^-fl a normal float32), got {fl}")
    with np.errstate(over="ignore", under="ignore"):
        top = _f32(np.ldexp(1.0, bw - 1))
        step = _f32(np.ldexp(1.0, -fl))
        high = (top - np.float32(1)) * step
        low = -top * step
    return ("fixed", float(low), float(high), float(step))


def xmbrain_trim(bw, fl, signed, what):
    """XmBrain/Quantizer's Trim2FixedPoint_cpu (75dd74d base_ristretto_layer.cpp) as a ("fixed_away", low,
    high, step) trim: signed [-2^(bw-1), 2^(bw-1) - 1] or unsigned [0, 2^bw - 1] steps of 2^-fl, bounds in
    float32 from its table of powers of two (my_pow: 2^-31 to 2^30), then round() (halves away from zero).
    The fork's std::min/max keep a NaN, which this trim takes to the upper bound."""
    top_exp = bw - 1 if signed else bw
    if not (-31 <= top_exp <= 30 and -31 <= -fl <= 30):
        raise LayerError(f"quantization_param.bw_{what} {bw} and fl_{what} {fl} ({'signed' if signed else 'unsigned'}) "
                         f"reach past the fork's table of powers of two (2^-31 to 2^30), where it asserts")
    top, step = np.float32(2.0 ** top_exp), np.float32(2.0 ** -fl)
    low = -top * step if signed else np.float32(0)
    return ("fixed_away", float(low), float((top - np.float32(1)) * step), float(step))


def parse_xmbrain(lp, weights=True):
    """The trims of XmBrain/Quantizer's layers (its quantization_param, xmbrain_quantization_param here):
    no input trim, top 0 only with bw/fl_layer_data (signed unless is_sign_data is 0), and the weights and
    bias, signed, with bw/fl_params where the layer rounds them."""
    p = lp.xmbrain_quantization_param
    w = xmbrain_trim(int(p.bw_params), int(p.fl_params), True, "params") if weights else None
    return {"precision": "XmBrain", "rounding": "NEAREST", "inputs": None, "first_top_only": True, "weights": w,
            "bias": w, "outputs": xmbrain_trim(int(p.bw_layer_data), int(p.fl_layer_data), p.is_sign_data != 0,
                                               "layer_data")}


def parse_quantization(lp, lrn=False):
    """The layer's trims from quantization_param, read as the fork's constructors read them: each
    precision only its own fields."""
    p = lp.quantization_param
    precision = PRECISIONS[p.precision] if p.precision < len(PRECISIONS) else None
    rounding = ROUNDINGS[p.rounding_scheme] if p.rounding_scheme < len(ROUNDINGS) else None
    if precision is None or rounding is None:
        raise LayerError(f"unknown quantization_param precision {p.precision} / rounding_scheme {p.rounding_scheme}")
    if lrn and precision != "MINIFLOAT":
        raise LayerError(f"LRNRistretto only supports precision MINIFLOAT, got {precision} (the fork aborts)")
    q = {"precision": precision, "rounding": "NEAREST" if lrn else rounding}
    if precision == "MINIFLOAT":
        m, e = int(p.mant_bits), int(p.exp_bits)
        if m > 30 or e > 30:
            raise LayerError(f"quantization_param.mant_bits and exp_bits must be at most 30, got {m} and {e}")
        q["inputs"] = q["outputs"] = q["weights"] = q["bias"] = ("minifloat", m, e)
        return q
    q["inputs"] = fixed_point_trim(int(p.bw_layer_in), int(p.fl_layer_in), "layer_in")
    q["outputs"] = fixed_point_trim(int(p.bw_layer_out), int(p.fl_layer_out), "layer_out")
    if precision == "DYNAMIC_FIXED_POINT":
        q["weights"] = q["bias"] = fixed_point_trim(int(p.bw_params), int(p.fl_params), "params")
    else:
        q["weights"], q["bias"] = ("pow2", int(p.exp_min), int(p.exp_max)), None
    return q


MOBILESSD_FIELDS = ("fl_bias_params", "bw_bias_params", "weight_scale", "data_scale", "int8_term")


def mobilessd_notes(lp):
    """SummerLife/caffe_mobilessd (c44db66, src/caffe/ristretto/layers/base_ristretto_layer.cpp and .cu,
    conv_ristretto_layer.cpp, fc_ristretto_layer.cpp; QuantizationParameter 20-24 of its caffe.proto) adds
    fl_bias_params, bw_bias_params, weight_scale, data_scale and int8_term.  Only its CPU forward reads them, in
    an integer pipeline of its own (data kept as integers, the bias trimmed to bw_bias_params / fl_bias_params
    and shifted by 2^(fl_params + fl_layer_in - fl_bias_params), tops requantized; int8_term scales instead);
    its GPU forward, Ristretto's, which caffeq follows, trims the bias with bw_params / fl_params and reads
    none of them."""
    p = lp.quantization_param
    given = [f for f in MOBILESSD_FIELDS if (len(p.weight_scale) if f == "weight_scale" else p.HasField(f))]
    if not given:
        return []
    return [f"{lp.type} '{lp.name}': quantization_param {', '.join(given)} (SummerLife/caffe_mobilessd) are read "
            f"only by that fork's CPU forward; its GPU forward, which caffeq follows, trims the bias with "
            f"bw_params / fl_params as Ristretto does"]


def _top_trim(q, i):
    """Top i's trim: every top's in pmgysel's Ristretto, top 0's alone in XmBrain/Quantizer's."""
    return None if i and q.get("first_top_only") else q["outputs"]


def _stochastic(attrs):
    q = attrs["ristretto"]
    if q["rounding"] == "STOCHASTIC":
        return ("rounding_scheme STOCHASTIC rounds with random numbers (curand seeded from the clock) at "
                "every forward; caffeq does not reproduce random rounding")
    return None


# ---- ONNX -----------------------------------------------------------------------------------

def onnx_trim(ctx, x, how, out, name):
    """Fixed point as ONNX: Where(IsNaN) for fmin's NaN, Clip, Div, Round (half to even), Mul."""
    if how[0] not in ("fixed", "fixed_away"):
        raise ExportError(f"layer '{name}': Ristretto's {how[0]} trim reads the float's exponent bits, "
                          f"which ONNX cannot read exactly")
    _, low, high, step = how
    hi = ctx.const(np.array(high, np.float32))
    nan = ctx.add_node("IsNaN", [x], ctx.tmp(f"{name}_isnan"))
    x = ctx.add_node("Where", [nan, hi, x], ctx.tmp(f"{name}_nan_high"))
    x = ctx.add_node("Clip", [x, ctx.const(np.array(low, np.float32)), hi], ctx.tmp(f"{name}_sat"))
    s = ctx.const(np.array(step, np.float32))
    x = ctx.add_node("Div", [x, s], ctx.tmp(f"{name}_scaled"))
    x = onnx_c_round(ctx, x) if how[0] == "fixed_away" else \
        ctx.add_node("Round", [x], ctx.tmp(f"{name}_rounded"))
    return ctx.add_node("Mul", [x, s], out)


def _trimmed_node(node):
    """A copy of node whose blobs are the trimmed weights (no compact or shared form: the writers
    then store exactly those values)."""
    q = copy.copy(node)
    q.blobs = trimmed_blobs(node.blobs, node.attrs["ristretto"]) if node.blobs is not None else None
    q.quant, q.shared_from = {}, {}
    return q


def _split_outputs(node):
    """(the tops' tensors, {bottom index: its written-back tensor})."""
    back = node.attrs.get("written_back", [])
    n = len(node.outputs) - len(back)
    return node.outputs[:n], dict(zip(back, node.outputs[n:]))


# ---- model.py ---------------------------------------------------------------------------------

def trim_source(emit, x, how):
    """The model.py expression trimming expression `x`."""
    if how is None:
        return x
    for helper in TRIM_NEEDS.get(how[0], ()):
        emit.helper(helper)
    fn = emit.helper(TORCH_TRIMS[how[0]])
    return f"{fn}({x}, {', '.join(emit.lit(v) for v in how[1:])})"


def source_on_inputs(emit, inputs, emit_source):
    """A base layer's model.py source emitted over other input expressions (the trimmed bottoms)."""
    real = emit.inputs
    emit.inputs = inputs
    try:
        return emit_source()
    finally:
        emit.inputs = real


def _emit_trimmed_inputs(emit, q):
    names = []
    for x in emit.inputs:
        var = emit.tmp("trimmed")
        emit.stmt(f"{var} = {trim_source(emit, x, q['inputs'])}", "Ristretto trims its bottom in place")
        names.append(var)
    return names


# ---- the specs --------------------------------------------------------------------------------

class _Ristretto:
    """What the three weighted Ristretto layers share, over their base layer's spec."""

    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs.get("orn") or attrs.get("first_conv") or attrs.get("normalize"):
            raise LayerError(f"{lp.type} reads no other fork's convolution or inner-product fields")
        if lp.HasField("xmbrain_quantization_param") or lp.type == "InnerProductRistretto":
            # XmBrain/Quantizer 75dd74d: its DeconvolutionRistretto leaves the weights as they are
            attrs["ristretto"] = parse_xmbrain(lp, weights=lp.type != "DeconvolutionRistretto")
        else:
            attrs["ristretto"] = parse_quantization(lp)
            notes = mobilessd_notes(lp)
            if notes:
                attrs.setdefault("reading_notes", []).extend(notes)
        attrs["name"] = lp.name
        attrs["bottom_count"] = len(lp.bottom)
        return attrs

    def bottoms_written_back(self, attrs):
        return range(attrs["bottom_count"]) if attrs["ristretto"]["inputs"] is not None else range(0)

    def cannot_run(self, attrs, in_shapes):
        return _stochastic(attrs)

    def macs(self, attrs, in_shapes, out_shapes):
        tops = len(out_shapes) - len(attrs.get("written_back", ()))   # not the written-back bottoms
        return super().macs(attrs, in_shapes, out_shapes[:tops])

    def forward(self, attrs, params, *xs):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape for x in xs])
        q = attrs["ristretto"]
        xs = [ristretto_trim(x, q["inputs"]) for x in xs]
        params = [ristretto_trim(p, q["weights"] if i == 0 else q["bias"]) for i, p in enumerate(params)]
        ys = super().forward(attrs, params, *xs)
        ys = [ristretto_trim(y, _top_trim(q, i)) for i, y in enumerate(ys if isinstance(ys, tuple) else (ys,))]
        ys += [xs[i] for i in attrs.get("written_back", ())]
        return ys[0] if len(ys) == 1 else tuple(ys)

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError,
                                  node.type)
        q = node.attrs["ristretto"]
        tops, back = _split_outputs(node)
        xs = [x if q["inputs"] is None else
              onnx_trim(ctx, x, q["inputs"], back.get(i) or ctx.tmp(f"{node.name}_in{i}"), node.name)
              for i, x in enumerate(node.inputs)]
        raw = [ctx.tmp(f"{node.name}_raw{i}") for i in range(len(tops))]
        self.onnx_layer(ctx, _trimmed_node(node), xs, raw)
        for i, (r, y) in enumerate(zip(raw, tops)):
            if _top_trim(q, i) is None:
                ctx.add_node("Identity", [r], [y])
            else:
                onnx_trim(ctx, r, q["outputs"], y, node.name)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(i) for i in range(len(node.inputs))],
                                  ExportError, node.type)
        q = node.attrs["ristretto"]
        emit.note("Ristretto layers keep their weights already trimmed (the fork trims copies of the "
                  "blobs at every forward, to the same values)")
        xs = _emit_trimmed_inputs(emit, q)
        real = emit.node
        emit.node = _trimmed_node(node)   # the state dict holds the trimmed weights
        try:
            calls = self.source_layer(node, emit, xs)
        finally:
            emit.node = real
        calls = calls if isinstance(calls, list) else [calls]
        exprs = [trim_source(emit, c, _top_trim(q, i)) for i, c in enumerate(calls)]
        exprs += [xs[i] for i in node.attrs.get("written_back", ())]
        return exprs[0] if len(exprs) == 1 else exprs


@register_layer("ConvolutionRistretto")
class ConvolutionRistretto(_Ristretto, Convolution):
    """Convolution with Ristretto's trims (conv_ristretto_layer.cu)."""

    def onnx_layer(self, ctx, node, inputs, outputs):
        _onnx_conv(ctx, node, "Conv", inputs, outputs)

    def source_layer(self, node, emit, inputs):
        return _torch_conv_source(node, emit, transposed=False, inputs=inputs)


@register_layer("DeconvolutionRistretto")
class DeconvolutionRistretto(_Ristretto, Deconvolution):
    """Deconvolution with Ristretto's trims (deconv_ristretto_layer.cu)."""

    def onnx_layer(self, ctx, node, inputs, outputs):
        _onnx_conv(ctx, node, "ConvTranspose", inputs, outputs)

    def source_layer(self, node, emit, inputs):
        return _torch_conv_source(node, emit, transposed=True, inputs=inputs)


@register_layer("FcRistretto", "InnerProductRistretto")
class FcRistretto(_Ristretto, InnerProduct):
    """InnerProduct with Ristretto's trims (fc_ristretto_layer.cu): one bottom, one top.  InnerProductRistretto
    is XmBrain/Quantizer's name for it (75dd74d; its trims whatever quantization_param the file writes)."""

    def parse(self, lp):
        if len(lp.bottom) != 1 or len(lp.top) != 1:
            raise LayerError(f"{lp.type} takes one bottom and one top, got {len(lp.bottom)} and {len(lp.top)}")
        return super().parse(lp)

    def onnx_layer(self, ctx, node, inputs, outputs):
        a = node.attrs
        x, axis = inputs[0], a["_axis"]
        shape = ctx.shape(node.inputs[0])
        if len(shape) != axis + 1:
            flat = ctx.tmp(node.name + "_flat")
            ctx.add_node("Reshape", [x, ctx.const(np.array(list(shape[:axis]) + [-1], np.int64))], [flat])
            x = flat
        bias = [ctx.weight(node, 1)] if a["bias_term"] else []
        if axis == 1:
            # Gemm reads Caffe's N x K weight as stored (transB)
            ctx.add_node("Gemm", [x, ctx.weight(node, 0)] + bias, [outputs[0]], name=node.name,
                         transB=0 if a["transpose"] else 1)
            return
        w = ctx.weight(node, 0, transpose=not a["transpose"])  # MatMul wants K x N
        mm = ctx.tmp(node.name + "_mm") if bias else outputs[0]
        ctx.add_node("MatMul", [x, w], [mm], name=node.name)
        if bias:
            ctx.add_node("Add", [mm, bias[0]], [outputs[0]])

    def source_layer(self, node, emit, inputs):
        return source_on_inputs(emit, inputs, lambda: InnerProduct.pytorch_source(self, node, emit))


AWAY = {"fixed": "fixed_away", "pow2": "pow2_away"}   # Egoist67's round() in place of rint


@register_layer("ScaleRistretto")
class ScaleRistretto(_Ristretto, Scale):
    """Scale (and its bias) with Ristretto's trims, as Egoist67/quanti_ristretto d3aa2c5 computes it
    (scale_ristretto_layer.cpp/.cu): bottoms trimmed with *_layer_in, the scale and the bias with *_params,
    the top with *_layer_out; fixed point and the power-of-2 exponents round halves away from zero
    (round(), on its CPU and GPU alike); minifloat as Ristretto's GPU.  With the scale from a second bottom
    nothing is trimmed but the bottoms and the top.  The fork's ConvolutionRistretto and FcRistretto round
    the same way, but their names are pmgysel's, whose GPU rounds halves to even, as caffeq reads them."""

    def parse(self, lp):
        attrs = super().parse(lp)
        if not attrs["bias_term"]:
            raise LayerError("ScaleRistretto without its bias (bias_term: false): the fork dereferences a "
                             "missing bias copy and crashes")
        q = attrs["ristretto"]
        for key in ("inputs", "outputs", "weights", "bias"):
            if q[key] is not None:
                q[key] = (AWAY.get(q[key][0], q[key][0]),) + tuple(q[key][1:])
        if attrs["two_bottoms"]:   # the weights are trimmed only for a learned scale; the blob is the bias
            q["weights"] = q["bias"] = None
        elif q["precision"] == "INTEGER_POWER_OF_2_WEIGHTS":
            q["bias"] = None
        return attrs

    def onnx_layer(self, ctx, node, inputs, outputs):
        Scale.onnx(self, ctx, node, inputs, outputs)

    def source_layer(self, node, emit, inputs):
        return source_on_inputs(emit, inputs, lambda: Scale.pytorch_source(self, node, emit))


class TrimsTopZero:
    """XmBrain/Quantizer's stock layers made *Ristretto (75dd74d): the base layer's forward, then top 0
    rounded with its quantization_param's layer_data trim (see parse_xmbrain); nothing else."""

    def parse(self, lp):
        attrs = super().parse(lp)
        attrs["xmbrain"] = parse_xmbrain(lp, weights=False)["outputs"]
        return attrs

    def forward(self, attrs, params, *xs):
        ys = super().forward(attrs, params, *xs)
        if isinstance(ys, tuple):
            return (ristretto_trim(ys[0], attrs["xmbrain"]),) + tuple(ys[1:])
        return ristretto_trim(ys, attrs["xmbrain"])

    def onnx(self, ctx, node):
        raw = ctx.tmp(f"{node.name}_untrimmed")
        super().onnx(ctx, dataclasses.replace(node, outputs=[raw] + list(node.outputs[1:])))
        onnx_trim(ctx, raw, node.attrs["xmbrain"], node.outputs[0], node.name)

    def pytorch_source(self, node, emit):
        out = super().pytorch_source(node, emit)
        if isinstance(out, list):
            return [trim_source(emit, out[0], node.attrs["xmbrain"])] + out[1:]
        return trim_source(emit, out, node.attrs["xmbrain"])


class _XmBrainLRN(TrimsTopZero, LRN):
    """LRNRistretto as XmBrain/Quantizer computes it: LRN, then top 0 in fixed point."""


_XMBRAIN_LRN = _XmBrainLRN()


@register_layer("LRNRistretto")
class LRNRistretto(LRN):
    """LRN with every intermediate trimmed to minifloat (lrn_ristretto_layer.cu; GPU only); with
    XmBrain/Quantizer's quantization_param, LRN and then top 0 in fixed point (_XmBrainLRN)."""

    onnx_refusal = ("LRNRistretto trims its running channel sum to minifloat after every add and "
                    "subtract; ONNX cannot read a float's exponent bits exactly")

    def parse(self, lp):
        if lp.HasField("xmbrain_quantization_param"):
            return dict(_XMBRAIN_LRN.parse(lp), xmbrain_lrn=True)
        attrs = super().parse(lp)
        if attrs["region"] != ACROSS_CHANNELS:
            raise LayerError("LRNRistretto supports norm_region ACROSS_CHANNELS only (the fork aborts on "
                             "WITHIN_CHANNEL)")
        q = parse_quantization(lp, lrn=True)
        attrs["ristretto"] = q
        attrs["mant_bits"], attrs["exp_bits"] = q["inputs"][1:]
        # LRNLayer keeps alpha_ / size_ as one float32 (alpha_over_size in the kernel)
        attrs["alpha_over_size"] = float(np.float32(attrs["alpha"]) / np.float32(attrs["size"]))
        return attrs

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)
        if attrs.get("xmbrain_lrn"):
            return shapes
        post = attrs["size"] - (attrs["size"] - 1) // 2 - 1
        if in_shapes[0][1] < post:
            raise LayerError(f"LRNRistretto with {in_shapes[0][1]} channels and local_size {attrs['size']}: "
                             f"the fork's kernel writes outside its scale buffer (fewer channels than "
                             f"{post})")
        return shapes

    def _args(self, a):
        return (a["size"], a["alpha_over_size"], float(np.float32(a["beta"])), float(np.float32(a["k"])),
                a["mant_bits"], a["exp_bits"])

    def forward(self, attrs, params, x):
        if attrs.get("xmbrain_lrn"):
            return _XMBRAIN_LRN.forward(attrs, params, x)
        return ristretto_lrn(x, *self._args(attrs))

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0]) * 3

    def onnx(self, ctx, node):
        if node.attrs.get("xmbrain_lrn"):
            return _XMBRAIN_LRN.onnx(ctx, node)
        return Layer.onnx(self, ctx, node)   # refuses with onnx_refusal

    def pytorch_source(self, node, emit):
        if node.attrs.get("xmbrain_lrn"):
            return _XMBRAIN_LRN.pytorch_source(node, emit)
        emit.helper(ristretto_minifloat)
        fn = emit.helper(ristretto_lrn)
        args = ", ".join(emit.lit(v) for v in self._args(node.attrs))
        return f"{fn}({emit.inputs[0]}, {args})"
