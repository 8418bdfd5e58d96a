"""NeuromorphicProcessorProject/ADaPTION's low-precision layers (37cd1cbb): LPConvolution, LPInnerProduct and
LPAct, read with `lpfp_param` (LowPrecisionFPParameter: bd, ad, round_bias, rounding_scheme; 147 in the fork,
93147 here).  Sources: src/caffe/layers/lp_conv_layer.cpp/.cu, lp_base_conv_layer.cpp, lp_cudnn_conv_layer.cu,
lp_inner_product_layer.cpp/.cu, lp_act_layer.cpp/.cu, src/caffe/util/math_functions.cpp/.cu (caffe_cpu_round_fp,
round_fp_kernel), src/caffe/proto/caffe.proto.  The layers read their geometry from convolution_param and
inner_product_param (the proto's lp_convolution_param, lp_act_param and lp_inner_product_param are never read
by the code, and are not declared here).

The fixed-point format: bd bits before the point (the sign bit among them) and ad after it.  A value v
becomes clamp(r(v * 2^ad) / 2^ad, -M, M) with M = float32(2^(bd-1) - 2^-ad) (the difference taken in double,
then stored as float32), all in float32; std::max(-M, std::min(., M)) takes a NaN to -M.  r is, on the
fork's CPU: round() (halves away from zero) for DETERMINISTIC, and for STOCHASTIC floor(v * 2^ad + u) where
its randomNumber() is rand() / RAND_MAX in integer arithmetic, i.e. u = 0 (floor) but once in RAND_MAX + 1
draws.  Its GPU kernel lacks a `break`: both schemes end in floorf(v * 2^ad + curand_uniform) with curand
seeded from clock(), random at every forward; caffeq computes the CPU forward, the one that can be reproduced.

- LPConvolution, LPInnerProduct: blobs [weight, weight rounded, bias, bias rounded] (2 without a bias).  The
  forward rounds blob 0 into blob 1 and convolves / multiplies with that; the bias is blob 2 as stored, or
  blob 2 rounded (into blob 3) with round_bias.  The stored blobs 1 and 3 are overwritten, so never read.
  Bottoms and tops are not rounded (the nets follow each layer with an LPAct).
- LPAct: its bottom rounded, elementwise.
"""
import numpy as np
import torch

from .c_numerics import c_round, onnx_c_round
from .conv import Convolution, InnerProduct
from .registry import Layer, LayerError, count, need_blobs, register_layer
from .transformed_weights import TransformedConvolution, TransformedInnerProduct, TransformedWeights

SCHEMES = ("DETERMINISTIC", "STOCHASTIC")
READING_NOTE = ("ADaPTION's LP layers run their CPU forward (round() or, for STOCHASTIC, floor(): its "
                "rand() / RAND_MAX is integer division); its GPU kernel rounds stochastically in both schemes "
                "(a missing break), with curand numbers drawn at every forward, which caffeq does not reproduce")


def parse_lpfp(lp):
    """lpfp_param as the fork's layers read it -> {"ad", "bd", "maxval", "floor", "round_bias"}."""
    p = lp.lpfp_param
    bd, ad = int(p.bd), int(p.ad)
    if not 1 <= bd <= 31:
        raise LayerError(f"lpfp_param.bd must be 1 to 31 (the fork shifts 1 << (bd - 1); bd has no default), got {bd}")
    if not 0 <= ad <= 30:
        raise LayerError(f"lpfp_param.ad must be 0 to 30 (the fork shifts 1 << ad in an int), got {ad}")
    if p.rounding_scheme >= len(SCHEMES):
        raise LayerError(f"unknown lpfp_param.rounding_scheme {p.rounding_scheme}")
    maxval = float(np.float32(float(2 ** (bd - 1)) - 1.0 / 2 ** ad))
    return {"bd": bd, "ad": ad, "maxval": maxval, "floor": SCHEMES[p.rounding_scheme] == "STOCHASTIC",
            "round_bias": bool(p.round_bias)}


def lp_round(x, scale: float, maxval: float, floor: bool):
    """caffe_cpu_round_fp: r(x * scale) / scale (r: round() halves away from zero, or floor), clamped to
    [-maxval, maxval] as std::max(-maxval, std::min(., maxval)) (a NaN becomes -maxval)."""
    scaled = x * scale
    r = torch.floor(scaled) if floor else c_round(scaled)
    y = torch.clamp(r / scale, -maxval, maxval)
    return torch.where(torch.isnan(y), torch.full_like(y, -maxval), y)


def _round_args(q):
    return float(2 ** q["ad"]), q["maxval"], q["floor"]


def onnx_lp_round(ctx, x, q, out, name):
    """lp_round as ONNX: Mul, Floor or C's round(), Div, Clip, NaN to -maxval."""
    scale, maxval, floor = _round_args(q)
    s = ctx.const(np.array(scale, np.float32))
    scaled = ctx.add_node("Mul", [x, s], ctx.tmp(f"{name}_lp_scaled"))
    r = ctx.add_node("Floor", [scaled], ctx.tmp(f"{name}_lp_floor")) if floor else \
        onnx_c_round(ctx, scaled)
    y = ctx.add_node("Div", [r, s], ctx.tmp(f"{name}_lp_unscaled"))
    low = ctx.const(np.array(-maxval, np.float32))
    y = ctx.add_node("Clip", [y, low, ctx.const(np.array(maxval, np.float32))], ctx.tmp(f"{name}_lp_sat"))
    nan = ctx.add_node("IsNaN", [y], ctx.tmp(f"{name}_lp_isnan"))
    return ctx.add_node("Where", [nan, low, y], out)


class _LowPrecisionWeights(TransformedWeights):
    """What LPConvolution and LPInnerProduct share over their base spec: the doubled blob list, the weights
    (and with round_bias the bias) rounded at every forward."""

    blob_names = ("weight", "weight_rounded", "bias", "bias_rounded")
    weight_axes = {0: 0, 1: 0}
    reading_note = READING_NOTE

    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs.get("orn") or attrs.get("first_conv") or attrs.get("normalize"):
            raise LayerError(f"{lp.type} reads no other fork's convolution or inner-product fields")
        attrs["lp"] = parse_lpfp(lp)
        return attrs

    def param_shapes(self, attrs, in_shapes):
        shapes = super().param_shapes(attrs, in_shapes)
        return [s for s in shapes for _ in range(2)]   # each blob, then its rounded copy

    def used_blobs(self, attrs, blobs):
        """[weight, bias] as the forward uses them (the bias only with bias_term): blobs 0 and 2 rounded."""
        q = attrs["lp"]
        used = [lp_round(blobs[0], *_round_args(q))]
        if attrs["bias_term"]:
            used.append(lp_round(blobs[2], *_round_args(q)) if q["round_bias"] else blobs[2])
        return used

    def weight_transform_note(self, attrs):
        return ("ADaPTION's LP layers keep their weights already rounded to fixed point (the fork rounds "
                "blob 0 into blob 1 at every forward, to the same values)")


@register_layer("LPConvolution")
class LPConvolution(_LowPrecisionWeights, TransformedConvolution, Convolution):
    """Convolution (convolution_param; LPCuDNN and LPCAFFE engines alike) with the weights rounded to fixed
    point (lp_conv_layer.cpp Forward_cpu)."""


@register_layer("LPInnerProduct")
class LPInnerProduct(_LowPrecisionWeights, TransformedInnerProduct, InnerProduct):
    """InnerProduct (inner_product_param, transpose read) with the weights rounded to fixed point
    (lp_inner_product_layer.cpp Forward_cpu)."""


@register_layer("LPAct")
class LPAct(Layer):
    """The bottom rounded to fixed point (lp_act_layer.cpp Forward_cpu): one bottom, one top."""

    reading_note = READING_NOTE

    def parse(self, lp):
        need_blobs(lp, "LPAct", 1, 1)
        return {"lp": parse_lpfp(lp)}

    def forward(self, attrs, params, x):
        return lp_round(x, *_round_args(attrs["lp"]))

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])

    def onnx(self, ctx, node):
        onnx_lp_round(ctx, node.inputs[0], node.attrs["lp"], node.outputs[0], node.name)

    def pytorch_source(self, node, emit):
        emit.helper(c_round)
        fn = emit.helper(lp_round)
        args = ", ".join(emit.lit(v) for v in _round_args(node.attrs["lp"]))
        return f"{fn}({emit.inputs[0]}, {args})"


__all__ = ["LPAct", "LPConvolution", "LPInnerProduct", "lp_round", "parse_lpfp"]
