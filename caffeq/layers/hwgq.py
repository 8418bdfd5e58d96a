"""zhaoweicai/hwgq (Cai et al., "Deep Learning with Low Precision by Half-wave Gaussian
Quantization", CVPR 2017), commit ebc706b: BinaryConvolution, BinaryInnerProduct and Quant
(src/caffe/layers/binary_conv_layer.{cpp,cu}, cudnn_binary_conv_layer.cu,
binary_inner_product_layer.{cpp,cu}, quant_layer.{cpp,cu}; the parameters in its caffe.proto, read
here as binary_convolution_param, binary_inner_product_param and quant_param).

What a forward computes, TRAIN and TEST alike:

- BinaryConvolution (a BaseConvolutionLayer: convolution_param, its shapes and blobs as
  Convolution's) and BinaryInnerProduct (inner_product_param; blobs as InnerProduct's) binarize
  their stored float weights again at every forward, into a copy: with use_binarization (default
  true) each weight becomes +alpha where w >= 0 (so +0, -0 and the row's zeros count as +) and
  -alpha elsewhere (NaN included), alpha being 1, or with use_alpha (default false) the mean |w| of
  that output channel's row of count / num weights (C / group * k... for a convolution, K for an
  inner product), computed as BLAS gemv does: float32(1 / row length) times the float32 sum of
  |w|.  Without use_binarization the float weights are used as they are.  The bias (bias_term) is
  never binarized.  The layer then runs as Convolution / InnerProduct on those weights.
  BinaryInnerProduct never reads inner_product_param.transpose (its weights are N x K).
- Quant (a NeuronLayer: one bottom, one top, in place allowed), by forward_func:
  "hwgq" (the default): x <= 0 gives the constant -negative_slope (not a slope: the fork stores
  -negative_slope itself; default 0); x > 0 gives centers[j] for the first j with x <= thr[j], the
  thresholds being the midpoints of consecutive centers, float32(0.5 * float32(c[j] + c[j+1])), and
  FLT_MAX after the last center; a value above every threshold (+inf) or NaN keeps the top's 0.
  "sign": +1 where x >= 0, else -1.  "hard_tanh": min(max(x, -1), 1).  "relu": max(x, 0) +
  negative_slope * min(x, 0).  The fork aborts at setup on an empty or non-positive center and at
  forward on another forward_func.  backward_func ("relu" or "hard_tanh") and clip_thr (the gradient
  passes only where x <= clip_thr, or |x| <= clip_thr for hard_tanh; 0 means no clip) shape the
  backward pass only: the "clip" of the example nets' names; `thrs` is declared but never read.

Only the forward is modelled: gradients through torch here are those of the forward written above
(zero through the binarization and the quantizer), not the fork's straight-through backward.
ONNX and model.py hold the binarized weights, computed once at export (the fork computes the same
values from the same blobs at every forward).

A caution that no backend can remove: a binary convolution of quantized activations sums +-alpha
times a few centers, so many of its outputs are 0 in exact arithmetic, and the float sum leaves
them +-1 ulp or 0 depending on its order (gemm, cuDNN, torch and onnxruntime each have their own,
and Model.run's default channels_last module another; run(exact=True) and model.py agree bit for bit).
A following Quant maps x <= 0 and tiny x > 0 to different levels (0 and the first center), so on
random weights a few tenths of a percent of such a Quant's outputs differ between backends (and
between the fork's CPU and GPU runs); everything else agrees to float rounding."""

import numpy as np
import torch

from .conv import Convolution, InnerProduct
from .kohuthonza_xnor import is_kohuthonza, kohuthonza_alpha, kohuthonza_binarize, read_kohuthonza
from .registry import Layer, LayerError, count, need_blobs, register_layer
from .stochastic_quantization import bwn_weights, is_sq_fork, read_sq, refuse_random_sq
from .transformed_weights import TransformedConvolution, TransformedInnerProduct, TransformedWeights

FLT_MAX = float(np.finfo(np.float32).max)
FORWARD_FUNCS = ("hwgq", "sign", "hard_tanh", "relu")


# ---- torch (copied into model.py) -------------------------------------------------------------

def hwgq_binarize(w, use_alpha: bool):
    """The fork's binary weights: each output channel's row (the blob's first axis) as +alpha where
    w >= 0, else -alpha; alpha 1, or with use_alpha float32(1 / row length) * sum |w| of the row."""
    rows = w.reshape(w.shape[0], -1)
    one = rows.new_ones(())
    code = torch.where(rows >= 0, one, -one)
    if use_alpha:
        # torch rounds the Python scalar to the tensor's float32, as gemv's float alpha
        code = code * (rows.abs().sum(1, keepdim=True) * (1.0 / rows.shape[1]))
    return code.reshape(w.shape)


def hwgq_quant(x, thresholds: list[float], centers: list[float], low: float):
    """Quant's "hwgq" forward: centers[j] for the first j with x <= thresholds[j] (0 past them all
    and for NaN), then `low` (-negative_slope) wherever x <= 0."""
    y = torch.zeros_like(x)
    for t, c in zip(reversed(thresholds), reversed(centers)):
        y = torch.where(x <= t, x.new_tensor(c), y)
    return torch.where(x <= 0, x.new_tensor(low), y)


def hwgq_sign(x):
    """Quant's "sign" forward: +1 where x >= 0, else -1 (NaN included)."""
    one = x.new_ones(())
    return torch.where(x >= 0, one, -one)


def hwgq_hard_tanh(x):
    """Quant's "hard_tanh" forward: min(max(x, -1), 1)."""
    return torch.clamp(x, -1.0, 1.0)


def hwgq_relu(x, negative_slope: float):
    """Quant's "relu" forward: x where x > 0, else negative_slope * x."""
    return torch.where(x > 0, x, x * negative_slope)


# ---- the binary weighted layers -----------------------------------------------------------------

def _read_binary_param(lp, field, attrs):
    notes = attrs.setdefault("reading_notes", [])
    base_field = "convolution_param" if field == "binary_convolution_param" else "inner_product_param"
    if is_kohuthonza(lp, field):
        return read_kohuthonza(lp, attrs)
    if not lp.HasField(field) and is_sq_fork(lp, base_field):
        # dongyp13/Stochastic-Quantization's BWN layers (their sq / ratio fields mark them)
        attrs["binarize"] = attrs["use_alpha"] = True
        return read_sq(lp, base_field, attrs)
    if not lp.HasField(field) and lp.HasField("debug_param"):
        # zzqiuzz/caffe-zz's binary-weight layers (debug_param is that fork's): always sign(w) times the
        # output channel's mean |w|, as HWGQ's use_alpha computes it
        if lp.debug_param.xnorno_grad:
            raise LayerError("debug_param.xnorno_grad: caffe-zz then re-centres and clips the stored weights "
                             "at every forward, which caffeq does not reproduce")
        attrs["binarize"] = attrs["use_alpha"] = True
        notes.append("read as caffe-zz's binary-weight layer (its debug_param marks it): weights sign(w) times "
                     "their output channel's mean |w|")
        return attrs
    p = getattr(lp, field)
    if not lp.HasField(field):
        notes.append(f"no {field}: read as zhaoweicai/hwgq's default, weights +-1 (use_alpha false); forks "
                     f"that scale by the channel's mean |w| (XNOR-Net's binary-weight networks) need "
                     f"{field} {{ use_alpha: true }}")
    attrs["binarize"] = bool(p.use_binarization)
    attrs["use_alpha"] = bool(p.use_alpha)
    return attrs


class _Binary(TransformedWeights):
    """What BinaryConvolution and BinaryInnerProduct share over their base layer's spec."""

    def weight_transform(self, attrs, weight):
        if attrs.get("sq_fork"):
            refuse_random_sq(attrs)
            return bwn_weights(weight)
        if attrs.get("kohuthonza"):
            return kohuthonza_binarize(weight, copysign=attrs["kohuthonza"] == "99ce5b63")
        return hwgq_binarize(weight, attrs["use_alpha"]) if attrs["binarize"] else None

    def bias_transform(self, attrs, bias, weight):
        # kohuthonza/caffe's head scales conv + bias by alpha: the bias by alpha here
        if attrs.get("kohuthonza") == "4f68844b":
            return bias * kohuthonza_alpha(weight).reshape(bias.shape)
        return None

    def weight_transform_note(self, attrs):
        if attrs["binarize"]:
            return ("BinaryConvolution / BinaryInnerProduct keep their weights already binarized (the fork "
                    "binarizes copies of the float blobs at every forward, to the same values)")
        return None


@register_layer("BinaryConvolution")
class BinaryConvolution(_Binary, TransformedConvolution, Convolution):
    """Convolution on weights binarized per output channel (binary_conv_layer.cpp)."""

    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs.get("orn") or attrs.get("first_conv"):
            raise LayerError("BinaryConvolution reads no other fork's convolution fields")
        return _read_binary_param(lp, "binary_convolution_param", attrs)

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)
        if attrs.get("edge_pads") is not None:
            raise LayerError("BinaryConvolution pads symmetrically (pad / pad_h / pad_w); it reads no "
                             "pad_type or pad_l/r/t/b")
        return shapes


@register_layer("BinaryInnerProduct")
class BinaryInnerProduct(_Binary, TransformedInnerProduct, InnerProduct):
    """InnerProduct on weights binarized per output row (binary_inner_product_layer.cpp): one bottom,
    one top, weights N x K whatever `transpose` says."""

    def parse(self, lp):
        need_blobs(lp, "BinaryInnerProduct", 1, 1)
        attrs = super().parse(lp)
        if attrs.get("normalize"):
            raise LayerError("BinaryInnerProduct reads no inner_product_param.normalize")
        if attrs["transpose"]:
            if lp.HasField("debug_param") and not lp.HasField("binary_inner_product_param"):
                raise LayerError("caffe-zz's BinaryInnerProduct with inner_product_param.transpose is not supported")
            attrs["reading_notes"] = ["BinaryInnerProduct never reads inner_product_param.transpose: its "
                                      "weights are N x K (the fork sets transpose_ = false)"]
            attrs["transpose"] = False
        return _read_binary_param(lp, "binary_inner_product_param", attrs)


# ---- Quant ----------------------------------------------------------------------------------------

def hwgq_thresholds(centers):
    """The fork's thresholds: float32 midpoints of consecutive centers, then FLT_MAX."""
    c = np.asarray(centers, np.float32)
    with np.errstate(over="ignore"):
        mid = (c[:-1] + c[1:]) * np.float32(0.5)
    return [float(v) for v in mid] + [FLT_MAX]


@register_layer("Quant")
class Quant(Layer):
    """HWGQ's activation quantizer (quant_layer.cpp): see the module docstring."""

    bottoms = tops = 1

    def parse(self, lp):
        super().parse(lp)
        p = lp.quant_param
        func = str(p.forward_func)
        if func not in FORWARD_FUNCS:
            raise LayerError(f"quant_param.forward_func must be one of {', '.join(FORWARD_FUNCS)}, got "
                             f"{func!r} (the fork aborts: Unknown Forward Function)")
        attrs = {"func": func, "negative_slope": float(p.negative_slope)}
        if func == "hwgq":
            centers = [float(v) for v in p.centers]
            if not centers:
                raise LayerError("quant_param.centers is required for forward_func \"hwgq\"")
            if not all(v > 0 for v in centers):
                raise LayerError(f"quant_param.centers must all be > 0, got {centers}")
            attrs["centers"] = centers
            attrs["thresholds"] = hwgq_thresholds(centers)
        return attrs

    def forward(self, attrs, params, x):
        func = attrs["func"]
        if func == "hwgq":
            return hwgq_quant(x, attrs["thresholds"], attrs["centers"], -attrs["negative_slope"])
        if func == "sign":
            return hwgq_sign(x)
        if func == "hard_tanh":
            return hwgq_hard_tanh(x)
        return hwgq_relu(x, attrs["negative_slope"])

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0]) * len(attrs.get("centers", ()))

    def onnx(self, ctx, node):
        a = node.attrs
        x, out, name = node.inputs[0], node.outputs[0], node.name

        func = a["func"]
        if func == "hwgq":
            pairs = list(zip(a["thresholds"], a["centers"]))
            y = ctx.f32(0.0)
            for j, (t, c) in reversed(list(enumerate(pairs))):
                le = ctx.add_node("LessOrEqual", [x, ctx.f32(t)], ctx.tmp(f"{name}_le{j}"))
                y = ctx.add_node("Where", [le, ctx.f32(c), y], ctx.tmp(f"{name}_level{j}"))
            low = ctx.add_node("LessOrEqual", [x, ctx.f32(0.0)], ctx.tmp(f"{name}_nonpositive"))
            ctx.add_node("Where", [low, ctx.f32(-a["negative_slope"]), y], out, name=name)
        elif func == "sign":
            ge = ctx.add_node("GreaterOrEqual", [x, ctx.f32(0.0)], ctx.tmp(f"{name}_ge0"))
            ctx.add_node("Where", [ge, ctx.f32(1.0), ctx.f32(-1.0)], out, name=name)
        elif func == "hard_tanh":
            ctx.add_node("Clip", [x, ctx.f32(-1.0), ctx.f32(1.0)], out, name=name)
        else:
            pos = ctx.add_node("Greater", [x, ctx.f32(0.0)], ctx.tmp(f"{name}_pos"))
            neg = ctx.add_node("Mul", [x, ctx.f32(a["negative_slope"])], ctx.tmp(f"{name}_slope"))
            ctx.add_node("Where", [pos, x, neg], out, name=name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        func = a["func"]
        if func == "hwgq":
            fn = emit.helper(hwgq_quant)
            return (f"{fn}({x}, {emit.lit(a['thresholds'])}, {emit.lit(a['centers'])}, "
                    f"{emit.lit(-a['negative_slope'])})")
        if func == "relu":
            return f"{emit.helper(hwgq_relu)}({x}, {emit.lit(a['negative_slope'])})"
        fn = emit.helper(hwgq_sign if func == "sign" else hwgq_hard_tanh)
        return f"{fn}({x})"
