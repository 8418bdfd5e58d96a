"""whitenightwu/caffe-quant-QNN's fixed-point layers (b4fc9ad, src/caffe/layers/quantization_layer.cpp,
quan_conv_layer.cpp / .cu, quan_inner_product_layer.cpp / .cu).

One fixed point serves all three: from a range [low, high], a bit width b and a strategy, the codes run
over [0, 2^b - 1] when low >= 0, [-(2^b - 1), 0] when high <= 0, else [-2^(b-1), 2^(b-1) - 1]; the scale is
2^k with k = log2(code bound / range bound) for each bound of the range on that side of 0, the smaller
one, taken down (CONSERVATIVE), to the nearest (NEUTRAL, C's round) or up (AGGRESSIVE).  A value becomes
clamp(round_method(x * scale), codes) / scale, round_method being C's round (half away from zero),
floor, ceil or trunc.  The scale is a power of two, so each step is exact in float32.

- Quantization (quantization_param's round_method, round_strategy, bit_width and its two `range`
  values): the fixed point of each activation.  Its CPU forward is read: the GPU one computes the codes
  and never writes the top.
- QuanConvolution / QuanInnerProduct (quan_convolution_param / quan_inner_product_param: BVLC's
  convolution / inner product fields, then round_method [FLOOR], round_strategy [AGGRESSIVE], bit_width
  [4], range_low and range_high [1, 1]): Convolution / InnerProduct on the fixed point of the weights,
  the bias as stored.  The CPU forward floors the weights whatever round_method says (its Weight_Quantization
  overwrites the rounded value with the floor); the GPU forward follows round_method, but the Quantization
  layer's GPU forward never writes its top, so only the CPU runs such a net: the floor is read, with a
  note where round_method says otherwise.  The weights' scale is computed in float there (log2 of the float ratio), which
  can differ from this double computation only where the ratio is a power of two within float rounding.
  `is_runtime` (which the fork also sets where range_low = range_high, the unset defaults included) is
  refused: the CPU forward then sorts the weights in place and convolves with the sorted ones, and the
  GPU forward ignores it.
"""
import copy
import math

import torch

from ..io.schema import caffe_pb2
from .activation import Neuron, scalar
from .conv import Convolution, InnerProduct
from .registry import LayerError, register_layer
from .transformed_weights import TransformedConvolution, TransformedInnerProduct, TransformedWeights

ROUND, FLOOR, CEIL, TRUNC = range(4)
_METHOD_NAMES = ("ROUND", "FLOOR", "CEIL", "TRUNC")
CONSERVATIVE, NEUTRAL, AGGRESSIVE = range(3)


def qnn_codes_and_scale(bit_width, low, high, strategy):
    """(lowest code, highest code, scale) of the fork's analyze_scaling_factor, in doubles."""
    if low >= 0:
        lo, hi = 0.0, 2.0 ** bit_width - 1
    elif high <= 0:
        lo, hi = -(2.0 ** bit_width) + 1, 0.0
    else:
        lo, hi = -(2.0 ** (bit_width - 1)), 2.0 ** (bit_width - 1) - 1
    def exponent_of(code, bound):   # log2(code / bound); -inf where no code lies on that side (1 bit)
        return math.log2(code / bound) if code / bound > 0 else -math.inf
    exponent = min(exponent_of(lo, low) if low < 0 else math.inf, exponent_of(hi, high) if high > 0 else math.inf)
    if not math.isfinite(exponent):
        raise LayerError(f"the range [{low}, {high}] with {bit_width} bit(s) gives the fork no finite scaling "
                         f"factor (a bound of 0 on each side, or no code on one side)")
    # C's round() for NEUTRAL: half away from zero
    k = {CONSERVATIVE: math.floor, AGGRESSIVE: math.ceil,
         NEUTRAL: lambda e: math.floor(abs(e) + 0.5) * (1 if e >= 0 else -1)}[strategy](exponent)
    return lo, hi, 2.0 ** k


def qnn_fixed_point(x, lo: float, hi: float, scale: float, method: int):
    """clamp(method(x * scale), lo, hi) / scale; method 0 is C's round (half away from zero), then floor,
    ceil, trunc.  `scale` is a power of two, so each step is exact in float32."""
    y = x * scale
    if method == 0:
        a = y.abs()
        whole = a.floor()
        y = torch.copysign(whole + (a - whole >= 0.5).to(y.dtype), y)
    elif method == 1:
        y = torch.floor(y)
    elif method == 2:
        y = torch.ceil(y)
    else:
        y = torch.trunc(y)
    return y.clamp(lo, hi) / scale


def onnx_qnn_fixed_point(ctx, x, out, lo, hi, scale, method, name):
    """qnn_fixed_point as ONNX ops (ONNX has no trunc and rounds half to even: both built from Floor)."""
    y = ctx.add_node("Mul", [x, scalar(ctx, scale)], ctx.tmp(name + "_scaled"), name=name)
    if method == FLOOR:
        y = ctx.op("Floor", [y], "floor")
    elif method == CEIL:
        y = ctx.op("Ceil", [y], "ceil")
    else:
        a = ctx.op("Abs", [y], "abs")
        whole = ctx.op("Floor", [a], "whole")
        if method == ROUND:
            up = ctx.op("Cast", [ctx.op("GreaterOrEqual", [ctx.op("Sub", [a, whole], "fraction"),
                                                          scalar(ctx, 0.5)], "half_up")], "up", to=1)
            whole = ctx.op("Add", [whole, up], "rounded")
        # back to y's sign: -0.0 where y is a negative fraction, as C's round and trunc give
        y = ctx.op("Where", [ctx.op("Less", [y, scalar(ctx, 0.0)], "negative"), ctx.op("Neg", [whole], "minus"),
                             whole], "signed")
    clipped = ctx.op("Clip", [y, scalar(ctx, lo), scalar(ctx, hi)], "clipped")
    ctx.add_node("Div", [clipped, scalar(ctx, scale)], [out])


def _fixed_point_attrs(p, what, low, high):
    bit_width = int(p.bit_width)
    if bit_width < 1:
        raise LayerError(f"{what}.bit_width must be > 0, got {bit_width}")
    if bit_width > 62:
        raise LayerError(f"{what}.bit_width {bit_width} is more than a double's codes hold")
    lo, hi, scale = qnn_codes_and_scale(bit_width, float(low), float(high), int(p.round_strategy))
    if not math.isfinite(scale) or scale == 0:
        raise LayerError(f"{what}: the range [{low}, {high}] gives a scaling factor of {scale}")
    return {"lo": lo, "hi": hi, "scale": scale, "method": int(p.round_method)}


@register_layer("Quantization")
class Quantization(Neuron):
    def parse_param(self, lp):
        p = lp.quantization_param
        if len(p.range) != 2:
            raise LayerError(f"quantization_param.range takes 2 values (the fork's CHECK), got {len(p.range)}")
        # LayerSetUp orders the two values (the weighted layers take range_low and range_high as given)
        return _fixed_point_attrs(p, "quantization_param", min(p.range), max(p.range))

    def forward(self, attrs, params, x):
        return qnn_fixed_point(x, attrs["lo"], attrs["hi"], attrs["scale"], attrs["method"])

    def onnx(self, ctx, node):
        a = node.attrs
        onnx_qnn_fixed_point(ctx, node.inputs[0], node.outputs[0], a["lo"], a["hi"], a["scale"], a["method"],
                             node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = ", ".join(emit.lit(v) for v in (a["lo"], a["hi"], a["scale"]))
        return f"{emit.helper(qnn_fixed_point)}({emit.inputs[0]}, {args}, {a['method']})"


def _as_base(lp, field, base_field, base_message, quant_fields):
    """A copy of lp whose base parameter (convolution_param / inner_product_param) holds the fork message's
    BVLC fields (the same numbers), for the base spec's own reading."""
    own = copy.deepcopy(getattr(lp, field))
    for name in quant_fields:
        own.ClearField(name)
    base = copy.deepcopy(lp)
    getattr(base, base_field).CopyFrom(base_message.FromString(own.SerializeToString()))
    return base


_QUANT_FIELDS = ("round_method", "round_strategy", "bit_width", "range_low", "range_high", "is_runtime")


class _QuantizedWeights(TransformedWeights):
    """QuanConvolution and QuanInnerProduct: their base layer on the fixed point of the weights.  Their
    parameter message (own_field) is the base's (base_field) plus the fixed point's fields."""
    own_field = base_field = base_message = None

    def parse(self, lp):
        if lp.HasField(self.base_field):
            raise LayerError(f"{lp.type} reads {self.own_field}, not {self.base_field}")
        base = _as_base(lp, self.own_field, self.base_field, getattr(caffe_pb2, self.base_message), _QUANT_FIELDS)
        try:
            attrs = super().parse(base)
        except LayerError as e:
            raise LayerError(str(e).replace(self.base_field, self.own_field)) from None
        own = getattr(lp, self.own_field)
        if own.is_runtime or own.range_low == own.range_high:
            why = "is_runtime" if own.is_runtime else (f"range_low = range_high = {own.range_low} (unset, both 1) "
                                                        f"sets is_runtime in the fork")
            raise LayerError(f"{self.own_field}: {why}; the fork's CPU forward then sorts the weights in place and "
                             f"computes with the sorted ones, and its GPU forward uses the range as given")
        q = _fixed_point_attrs(own, self.own_field, own.range_low, own.range_high)
        if q["method"] != FLOOR:
            attrs["reading_notes"] = attrs.get("reading_notes", []) + [
                f"{self.own_field}.round_method {_METHOD_NAMES[q['method']]}: the fork's CPU forward floors the "
                f"weights whatever round_method says (its GPU forward follows it, but the nets' Quantization layers "
                f"only run on the CPU): read as FLOOR"]
            q["method"] = FLOOR
        return {**attrs, "weight_fixed_point": q}

    def infer(self, attrs, in_shapes):
        try:
            return super().infer(attrs, in_shapes)
        except LayerError as e:
            raise LayerError(str(e).replace(self.base_field, self.own_field)) from None

    def weight_transform(self, attrs, weight):
        q = attrs["weight_fixed_point"]
        return qnn_fixed_point(weight, q["lo"], q["hi"], q["scale"], q["method"])

    def weight_transform_note(self, attrs):
        return ("QuanConvolution / QuanInnerProduct keep their weights already in the fork's fixed point (it "
                "rounds copies of the float blobs at every forward, to the same values)")


@register_layer("QuanConvolution")
class QuanConvolution(_QuantizedWeights, TransformedConvolution, Convolution):
    own_field, base_field, base_message = "quan_convolution_param", "convolution_param", "ConvolutionParameter"


@register_layer("QuanInnerProduct")
class QuanInnerProduct(_QuantizedWeights, TransformedInnerProduct, InnerProduct):
    own_field, base_field, base_message = "quan_inner_product_param", "inner_product_param", "InnerProductParameter"
