"""Gyrfalcon (GTI) Caffe MDK's quantization layers, as jack16888/caffessd 55e1f12 carries them
(src/caffe/layers/quant_conv_layer.cpp, quant_relu_layer.cpp; quant_convolution_param and quant_relu_param
in its caffe.proto, 300 and 301 there).

- QuantConvolution: a Convolution (convolution_param, BVLC's shapes and blobs) that quantizes copies of its
  float weights and bias at every forward, by quant_convolution_param.coef_precision, in double arithmetic
  stored back to float:
  - FLOATING_POINT (the default): the weights as stored.
  - ONE_BIT, TWO_BITS, THREE_BITS, FIVE_BITS: per 2-D kernel (one output and one input channel), a grid g:
    ONE_BIT mean |w| + 1e-6 and each weight +-g (w >= 0 counts as +); TWO_BITS g = mean |w|, 0 where
    |w| < 0.25 g, else +-g; THREE_BITS g = (mean |w| + 1e-6) / 4, k = int(|w| / g) truncated, 3 and above
    becoming 4, so levels {0, 1, 2, 4} g; FIVE_BITS g = (max |w| + 1e-6) / 15, round(w / g) half away from
    zero.  With shift_enable the level g (not the grid the weights are divided by) is rounded to a multiple
    of 2^-shift, shift = floor(log2((2^(bw_params-1) - 1) / max |W|)), with a bias the smaller of that and
    floor(log2((2^(bw_bias-1) - 1) / (max |b| + 1e-6))) (bw_bias 20; 12, 12, 18, 16 for the four modes
    when bw_params is 12), clamped to [0, 15 if bw_params is 8 else 13], and the bias rounded to that step
    too; without it the bias stays as stored.
  - DYNAMIC_FIXED_POINT: shift_enable rounds weights and bias to multiples of 2^-shift (shift from max |W|
    only, clamped as above); without it the weights are rounded to multiples of max |W| / (2^(bw_params-1)
    - 1) and the bias stays as stored.  Nothing is clipped.
  The fork's log of an all-zero (or infinite, or NaN) blob is undefined behaviour; caffeq refuses such a
  layer where the shift is used.  (Its GPU forward runs a depthwise kernel whenever num_output == group, 1 == 1 included; the CPU
  forward, followed here, does not.)
- QuantReLU: blob 0 is alpha, 0 axes (channel_shared, the default) or (C,).  quant_enable: x clipped to
  [0, alpha] and rounded to one of 2^act_bits - 1 steps, floor(x * q / alpha + 0.5) * alpha / q (the float
  quotient, then double arithmetic stored as float); without it max(x, 0) + negative_slope * min(x, 0).
  At TEST alpha comes from the caffemodel; the filler (a constant; 0.25 without one) only starts it.
"""
import math

import numpy as np
import torch

from .conv import Convolution
from .registry import Layer, LayerError, register_layer
from .transformed_weights import TransformedConvolution

EPSILON = 1e-6
PRECISIONS = ("FLOATING_POINT", "DYNAMIC_FIXED_POINT", "ONE_BIT", "TWO_BITS", "THREE_BITS", "FIVE_BITS")
#: the bias's bit width per mode when bw_params is 12 (20 otherwise)
BIAS_BITS_AT_12 = {"ONE_BIT": 12, "TWO_BITS": 12, "THREE_BITS": 18, "FIVE_BITS": 16}


# ---- weights -------------------------------------------------------------------------------------

def _round_away(v):
    """Half away from zero: floor(v + 0.5) for v >= 0, else ceil(v - 0.5)."""
    return torch.where(v >= 0, torch.floor(v + 0.5), torch.ceil(v - 0.5))


def _shift(steps, largest, layer, blob="weights"):
    """floor(log2(steps / largest)); the fork's int of an infinite or NaN logarithm is undefined behaviour."""
    ratio = steps / largest if largest > 0 else math.inf
    if not (math.isfinite(largest) and 0 < ratio < math.inf):
        raise LayerError(f"layer '{layer}': QuantConvolution's shift of {blob} whose largest magnitude is {largest} "
                         f"is the log of {ratio} in the fork, undefined behaviour")
    return int(math.floor(math.log(ratio) / math.log(2.0)))


def gti_quantize(weight, bias, attrs):
    """(weight, bias) as QuantConvolution's forward uses them (float32 tensors; bias None without one)."""
    mode, bits, shift_on = attrs["precision"], attrs["bw_params"], attrs["shift_enable"]
    w = weight.double()
    b = None if bias is None else bias.double()
    steps = (1 << (bits - 1)) - 1
    shift_max = 15 if bits == 8 else 13
    largest = float(w.abs().max())
    scale = None       # 2^shift, the power-of-two step of shift_enable
    if shift_on:
        shift = _shift(steps, largest, attrs["name"])
        if b is not None and mode != "DYNAMIC_FIXED_POINT":   # the 1/2/3/5-bit modes fit the bias's bits too
            bias_steps = (1 << (BIAS_BITS_AT_12.get(mode, 20) if bits == 12 else 20) - 1) - 1
            shift = min(shift, _shift(bias_steps, float(b.abs().max()) + EPSILON, attrs["name"], "a bias"))
        scale = float(1 << min(max(shift, 0), shift_max))
    q_b = b if scale is None or b is None else _round_away(b * scale) / scale
    if mode == "DYNAMIC_FIXED_POINT":
        if scale is not None:
            q_w = _round_away(w * scale) / scale
        else:
            grid = largest / steps
            q_w = _round_away(w / grid) * grid
        return q_w.float(), None if q_b is None else q_b.float()
    kernels = w.reshape(w.shape[0] * w.shape[1], -1)
    if mode == "FIVE_BITS":
        grid = (kernels.abs().amax(1, keepdim=True) + EPSILON) / 15.0
    else:
        mean = kernels.abs().sum(1, keepdim=True) / kernels.shape[1]
        grid = {"ONE_BIT": mean + EPSILON, "TWO_BITS": mean, "THREE_BITS": (mean + EPSILON) / 4.0}[mode]
    level = grid if scale is None else torch.floor(grid * scale + 0.5) / scale
    sign = torch.where(kernels >= 0, 1.0, -1.0).double()
    if mode == "ONE_BIT":
        q = sign * level
    elif mode == "TWO_BITS":
        q = torch.where(kernels.abs() < 0.25 * level, torch.zeros_like(kernels), sign * level)
    elif mode == "THREE_BITS":
        k = torch.trunc(kernels.abs() / grid)
        q = sign * torch.where(k < 3, k, torch.full_like(k, 4.0)) * level
    else:
        q = _round_away(kernels / grid) * level
    return q.reshape(w.shape).float(), None if q_b is None else q_b.float()


@register_layer("QuantConvolution")
class QuantConvolution(TransformedConvolution, Convolution):
    """Convolution on its GTI-quantized weights and bias (see the module docstring)."""

    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs.get("orn") or attrs.get("first_conv") or attrs.get("edge_pads") is not None:
            raise LayerError("QuantConvolution reads no other fork's convolution fields")
        p = lp.quant_convolution_param
        attrs.update(name=lp.name, precision=PRECISIONS[int(p.coef_precision)], bw_params=int(p.bw_params),
                     shift_enable=bool(p.shift_enable))
        if not 2 <= attrs["bw_params"] <= 31:
            raise LayerError(f"quant_convolution_param.bw_params must be 2 to 31, got {attrs['bw_params']}")
        return attrs

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)
        if attrs["precision"] != "FLOATING_POINT" and len(self.param_shapes(attrs, in_shapes)[0]) != 4:
            raise LayerError("QuantConvolution quantizes 4-axis (2-D) weights only, as the fork reads them")
        return shapes

    def transform_blobs(self, attrs, weight, bias):
        if attrs["precision"] == "FLOATING_POINT":
            return None, None
        return gti_quantize(weight, bias, attrs)

    def weight_transform_note(self, attrs):
        if attrs["precision"] == "FLOATING_POINT":
            return None
        return ("QuantConvolution keeps its weights and bias already quantized (the fork quantizes copies of the "
                "float blobs at every forward, to the same values)")


# ---- QuantReLU (copied into model.py) ------------------------------------------------------------

def gti_quant_relu(x, alpha, act_bits: int):
    """x clipped to [0, alpha] (alpha 0-axis or per channel on axis 1) on 2^act_bits - 1 steps."""
    a = alpha.reshape([1, -1] + [1] * (x.dim() - 2)) if alpha.dim() else alpha
    steps = float((1 << act_bits) - 1)
    clipped = torch.minimum(torch.clamp(x, min=0.0), a)
    ratio = (clipped * steps / a).double()            # float, then double from the + 0.5 on
    return (torch.floor(ratio + 0.5) * a.double() / steps).float()


@register_layer("QuantReLU")
class QuantReLU(Layer):
    blob_names = ("alpha",)
    bottoms = tops = 1

    def parse(self, lp):
        super().parse(lp)
        p = lp.quant_relu_param
        act_bits = int(p.act_bits)
        if not 1 <= act_bits <= 30:
            raise LayerError(f"quant_relu_param.act_bits must be 1 to 30, got {act_bits}")
        start = float(p.filler.value) if p.HasField("filler") and p.filler.type == "constant" else 0.25
        return {"channel_shared": bool(p.channel_shared), "act_bits": act_bits, "enabled": bool(p.quant_enable),
                "negative_slope": float(np.float32(p.negative_slope)), "start": start}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) < 2:
            raise LayerError(f"QuantReLU's bottom needs at least 2 axes, got {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        return [()] if attrs["channel_shared"] else [(in_shapes[0][1],)]

    def init_params(self, attrs, shapes, rng):
        return [np.full(shapes[0], attrs["start"], np.float32)]

    def forward(self, attrs, params, x):
        if attrs["enabled"]:
            return gti_quant_relu(x, params[0], attrs["act_bits"])
        return x.clamp(min=0) + attrs["negative_slope"] * x.clamp(max=0)

    def onnx(self, ctx, node):
        a, x, out, name = node.attrs, node.inputs[0], node.outputs[0], node.name
        if not a["enabled"]:
            pos = ctx.op("Relu", [x], "pos")
            neg = ctx.op("Mul", [ctx.op("Min", [x, ctx.f32(0.0)], "neg_part"), ctx.f32(a["negative_slope"])], "neg")
            ctx.add_node("Add", [pos, neg], [out], name=name)
            return
        alpha = np.asarray(node.blobs[0], np.float32)
        if alpha.ndim:
            alpha = alpha.reshape([1, -1] + [1] * (len(ctx.shape(x)) - 2))
        steps = float((1 << a["act_bits"]) - 1)
        clipped = ctx.op("Min", [ctx.op("Relu", [x], "relu"), ctx.const(alpha)], "clipped")
        ratio = ctx.op("Div", [ctx.op("Mul", [clipped, ctx.f32(steps)], "scaled"), ctx.const(alpha)], "ratio")
        wide = ctx.op("Cast", [ratio], "wide", to=11)                                    # double
        level = ctx.op("Floor", [ctx.op("Add", [wide, ctx.const(np.float64(0.5))], "half")], "level")
        value = ctx.op("Mul", [level, ctx.const(alpha.astype(np.float64))], "value")
        ctx.add_node("Cast", [ctx.op("Div", [value, ctx.const(np.float64(steps))], "step")], [out], name=name,
                     to=1)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        if not a["enabled"]:
            return f"{x}.clamp(min=0) + {emit.lit(a['negative_slope'])} * {x}.clamp(max=0)"
        alpha = emit.module(f"nn.Parameter(torch.zeros({tuple(np.shape(node.blobs[0]))}))")
        emit.param("", 0)
        return f"{emit.helper(gti_quant_relu)}({x}, {alpha}, {a['act_bits']})"


__all__ = ["QuantConvolution", "QuantReLU", "gti_quant_relu", "gti_quantize"]
