"""Neuron layers: one bottom, one top of the same shape, applied elementwise.

Each follows the formula of its BVLC Caffe *_layer.cpp (ReLU, PReLU, ELU,
Sigmoid, TanH, AbsVal, Power, Exp, Log, BNLL, Threshold, Clip, Swish) or of
the forks that define them (ReLU6: MobileNet-v2 forks; Mish: YOLOv4 Caffe
conversions; SeLu: the SeLu fork's selu_param).  Scalars derived from parameters (Exp's
inner/outer scale, Log's 1/log(base), Power's power*scale) are computed in
float32 as Caffe does.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from .registry import Layer, LayerError, need_blobs, register_layer

FLOAT = 1  # onnx.TensorProto.FLOAT


# ---- helpers shared with elementwise.py and recurrent.py ----------------------

def f32(v):
    """A Python float rounded to float32, as a Caffe Dtype parameter is."""
    return float(np.float32(v))


def scalar(ctx, value, hint=None):
    """A float32 scalar initializer."""
    return ctx.const(np.array(value, dtype=np.float32), hint)


def onnx_clip(ctx, x, lo, hi, out, name=None):
    """y = max(lo, min(x, hi)) in Caffe's order (lo > hi gives lo everywhere, as Clip does)."""
    if lo is not None and hi is not None and lo > hi:
        mid = ctx.tmp((name or out) + "_min")
        ctx.add_node("Min", [x, scalar(ctx, hi)], [mid], name=name)
        ctx.add_node("Max", [mid, scalar(ctx, lo)], [out])
        return
    if ctx.opset >= 11:
        inputs = [x, scalar(ctx, lo) if lo is not None else ""]
        if hi is not None:
            inputs.append(scalar(ctx, hi))
        ctx.add_node("Clip", inputs, [out], name=name)
    else:
        attrs = {}
        if lo is not None:
            attrs["min"] = float(lo)
        if hi is not None:
            attrs["max"] = float(hi)
        ctx.add_node("Clip", [x], [out], name=name, **attrs)


def onnx_mul_scalar(ctx, x, value, hint):
    out = ctx.tmp(hint)
    ctx.add_node("Mul", [x, scalar(ctx, value)], [out])
    return out


def onnx_add_scalar(ctx, x, value, hint):
    out = ctx.tmp(hint)
    ctx.add_node("Add", [x, scalar(ctx, value)], [out])
    return out


class Neuron(Layer):
    """One bottom, one top shaped like it (Caffe's NeuronLayer)."""

    #: ("elu_param", "alpha"): the layer's one float parameter, read as float32 into attrs["alpha"]
    scalar_param = None

    def parse(self, lp):
        need_blobs(lp, lp.type, 1)
        return self.parse_param(lp)

    def parse_param(self, lp):
        if self.scalar_param is None:
            return {}
        message, field = self.scalar_param
        return {field: f32(getattr(getattr(lp, message), field))}


class _Unary(Neuron):
    """A neuron layer that maps to one torch function and one ONNX op."""
    torch_fn = None
    onnx_op = None

    def forward(self, attrs, params, x):
        return type(self).torch_fn(x)

    def onnx(self, ctx, node):
        ctx.add_node(self.onnx_op, [node.inputs[0]], [node.outputs[0]], name=node.name)

    #: standalone PyTorch source: an nn module ("nn.Sigmoid()") or an expression with {x}
    torch_source = None

    def pytorch_source(self, node, emit):
        src = self.torch_source
        if src is None:
            return None
        if src.startswith("nn."):
            return f"{emit.module(src)}({emit.inputs[0]})"
        return src.format(x=emit.inputs[0])


# ---- ReLU family -----------------------------------------------------------------

def relu_bounds(p):
    """synopsys-caffe's bounds after the slope, in its order: (upper or None, lower or None).
    relu6 caps at 6, a positive maximum caps at maximum, a non-zero minimum floors at minimum;
    caffe-cvpr17's upper_bound, when set, caps at it."""
    upper = None
    if p.relu6:
        upper = 6.0
    if p.maximum > 0:
        upper = f32(p.maximum) if upper is None else min(upper, f32(p.maximum))
    if p.HasField("upper_bound") and p.engine != p.CUDNN:   # the fork's cuDNN ReLU ignores it
        upper = f32(p.upper_bound) if upper is None else min(upper, f32(p.upper_bound))
    lower = f32(p.minimum) if p.minimum != 0 else None
    return upper, lower


@register_layer("ReLU")
class ReLU(Neuron):
    """max(x, 0) + negative_slope * min(x, 0), then synopsys-caffe's optional bounds.

    HyeonwooNoh/caffe (DeconvNet, DecoupledNet; d9e8494 relu_layer.cpp) allows a second top: the
    mask, 1 where the value the loop reads is > 0, else 0.  In place that value is the ReLU's own
    output (the loop writes top_data[i] before it reads bottom_data[i]); DecoupledNet's bp branch
    multiplies by it."""

    def parse(self, lp):
        need_blobs(lp, lp.type, 1, (1, 2))
        attrs = self.parse_param(lp)
        attrs["mask"] = len(lp.top) == 2
        attrs["mask_of_output"] = attrs["mask"] and lp.top[0] == lp.bottom[0]
        return attrs

    def parse_param(self, lp):
        upper, lower = relu_bounds(lp.relu_param)
        return {"negative_slope": f32(lp.relu_param.negative_slope), "upper": upper, "lower": lower}

    def infer(self, attrs, in_shapes):
        return [tuple(in_shapes[0])] * (2 if attrs.get("mask") else 1)

    def forward(self, attrs, params, x):
        slope = attrs["negative_slope"]
        y = F.relu(x) if slope == 0 else x.clamp(min=0) + slope * x.clamp(max=0)
        if attrs.get("upper") is not None:
            y = y.clamp(max=attrs["upper"])
        if attrs.get("lower") is not None:
            y = y.clamp(min=attrs["lower"])
        if attrs.get("mask"):
            return y, ((y if attrs["mask_of_output"] else x) > 0).to(x.dtype)
        return y

    def onnx(self, ctx, node):
        a = node.attrs
        slope = a["negative_slope"]
        bounded = a.get("upper") is not None or a.get("lower") is not None
        out = ctx.tmp(node.name + "_relu") if bounded else node.outputs[0]
        if slope == 0:
            ctx.add_node("Relu", [node.inputs[0]], [out], name=node.name)
        else:
            ctx.add_node("LeakyRelu", [node.inputs[0]], [out], name=node.name, alpha=float(slope))
        if a.get("upper") is not None:
            capped = ctx.tmp(node.name + "_cap") if a.get("lower") is not None else node.outputs[0]
            ctx.add_node("Min", [out, scalar(ctx, a["upper"])], [capped])
            out = capped
        if a.get("lower") is not None:
            ctx.add_node("Max", [out, scalar(ctx, a["lower"])], [node.outputs[0]])
        if a.get("mask"):   # after the ReLU, whose output it may read
            src = node.outputs[0] if a["mask_of_output"] else node.inputs[0]
            positive = ctx.add_node("Greater", [src, scalar(ctx, 0.0)], [ctx.tmp(node.name + "_pos")])[0]
            ctx.add_node("Cast", [positive], [node.outputs[1]], to=1)   # FLOAT

    def pytorch_source(self, node, emit):
        a = node.attrs
        slope = a["negative_slope"]
        # LeakyReLU's "x or slope * x" is the value of clamp(min=0) + slope * clamp(max=0)
        m = emit.module("nn.ReLU()" if slope == 0 else f"nn.LeakyReLU({emit.lit(slope)})")
        y = f"{m}({emit.inputs[0]})"
        if a.get("upper") is not None:
            y = f"{y}.clamp(max={emit.lit(a['upper'])})"
        if a.get("lower") is not None:
            y = f"{y}.clamp(min={emit.lit(a['lower'])})"
        if a.get("mask"):
            src = y if a["mask_of_output"] else emit.inputs[0]
            return f"{y}, ({src} > 0).to({emit.inputs[0]}.dtype)"
        return y


@register_layer("ReLU6")
class ReLU6(Neuron):
    """Fork layer: min(max(x, 0), 6) + negative_slope * min(x, 0).

    The slope comes from relu6_param (rog93's fork) or, when that is absent,
    relu_param (NVCaffe's ReLU6 reads relu_param.negative_slope).  inisis/caffe (brocolli's
    converter) adds relu6_param.threshold and clips the leaky sum instead:
    min(max(x, 0) + negative_slope * min(x, 0), threshold); without a slope both are clamp(x, 0, t).
    """

    def parse_param(self, lp):
        if lp.HasField("relu6_param"):
            slope = lp.relu6_param.negative_slope
        else:
            slope = lp.relu_param.negative_slope
        clipped_sum = lp.HasField("relu6_param") and lp.relu6_param.HasField("threshold")
        top = f32(lp.relu6_param.threshold) if clipped_sum else f32(6.0)
        if top < 0:
            raise LayerError(f"relu6_param.threshold must be >= 0, got {top}")
        return {"negative_slope": f32(slope), "threshold": top, "clip_sum": clipped_sum}

    def forward(self, attrs, params, x):
        slope, top = attrs["negative_slope"], float(attrs.get("threshold", 6.0))
        if slope == 0:
            return x.clamp(min=0, max=top)
        if attrs.get("clip_sum"):
            return (x.clamp(min=0) + slope * x.clamp(max=0)).clamp(max=top)
        return x.clamp(min=0, max=top) + slope * x.clamp(max=0)

    def onnx(self, ctx, node):
        x, out = node.inputs[0], node.outputs[0]
        slope, top = node.attrs["negative_slope"], float(node.attrs.get("threshold", 6.0))
        if slope == 0:
            onnx_clip(ctx, x, 0.0, top, out, name=node.name)
            return
        clip_sum = node.attrs.get("clip_sum")
        clipped = ctx.tmp(node.name + "_clip")
        onnx_clip(ctx, x, 0.0, None if clip_sum else top, clipped, name=node.name)
        neg = ctx.tmp(node.name + "_neg")
        onnx_clip(ctx, x, None, 0.0, neg)
        leaky = onnx_mul_scalar(ctx, neg, slope, node.name + "_leak")
        if not clip_sum:
            ctx.add_node("Add", [clipped, leaky], [out])
            return
        summed = ctx.tmp(node.name + "_sum")
        ctx.add_node("Add", [clipped, leaky], [summed])
        onnx_clip(ctx, summed, None, top, out)

    def pytorch_source(self, node, emit):
        x, slope = emit.inputs[0], node.attrs["negative_slope"]
        top = emit.lit(float(node.attrs.get("threshold", 6.0)))
        if slope == 0:
            return f"{x}.clamp(min=0, max={top})"
        if node.attrs.get("clip_sum"):
            return f"({x}.clamp(min=0) + {emit.lit(slope)} * {x}.clamp(max=0)).clamp(max={top})"
        return f"{x}.clamp(min=0, max={top}) + {emit.lit(slope)} * {x}.clamp(max=0)"


@register_layer("PReLU")
class PReLU(Neuron):
    """max(x, 0) + a_c * min(x, 0) with a learned slope per channel (axis 1) or one shared.

    Caffe stores the shared slope as a 0-axis blob and the per-channel one as (C,).
    """
    blob_names = ("slope",)

    def parse_param(self, lp):
        return {"channel_shared": bool(lp.prelu_param.channel_shared)}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) < 2:
            raise LayerError(f"bottom must have at least 2 axes, got shape {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        if len(in_shapes[0]) < 2:
            raise LayerError(f"bottom must have at least 2 axes, got shape {list(in_shapes[0])}")
        return [()] if attrs["channel_shared"] else [(in_shapes[0][1],)]

    def init_params(self, attrs, shapes, rng):
        return [np.full(shapes[0], 0.25, np.float32)]  # Caffe's default filler

    @staticmethod
    def _slope(w, ndim):
        return w.reshape(w.shape + (1,) * (ndim - 2)) if w.dim() else w

    def forward(self, attrs, params, x):
        return x.clamp(min=0) + self._slope(params[0], x.dim()) * x.clamp(max=0)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        w = ctx.weight(node, 0)
        ndim = len(ctx.shape(x))
        if not node.attrs["channel_shared"] and ndim > 2:
            shaped = ctx.tmp(node.name + "_slope")
            c = node.blobs[0].shape[0] if node.blobs is not None else ctx.shape(x)[1]
            ctx.add_node("Reshape", [w, ctx.const(np.array([c] + [1] * (ndim - 2), np.int64))], [shaped])
            w = shaped
        ctx.add_node("PRelu", [x, w], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        c = 1 if node.attrs["channel_shared"] else emit.in_shape(0)[1]
        m = emit.module(f"nn.PReLU({c})")
        # F.prelu's "x or a * x" is the value of clamp(min=0) + a * clamp(max=0)
        emit.param("weight", emit.blob(0).reshape(c), blob=0)
        return f"{m}({emit.inputs[0]})"


@register_layer("ELU")
class ELU(Neuron):
    """max(x, 0) + alpha * (exp(min(x, 0)) - 1)."""

    scalar_param = ("elu_param", "alpha")

    def forward(self, attrs, params, x):
        return F.elu(x, alpha=attrs["alpha"])

    def onnx(self, ctx, node):
        ctx.add_node("Elu", [node.inputs[0]], [node.outputs[0]], name=node.name,
                     alpha=float(node.attrs["alpha"]))

    def pytorch_source(self, node, emit):
        alpha = node.attrs["alpha"]
        m = emit.module("nn.ELU()" if alpha == 1 else f"nn.ELU(alpha={emit.lit(alpha)})")
        return f"{m}({emit.inputs[0]})"


@register_layer("Sigmoid")
class Sigmoid(_Unary):
    torch_fn = torch.sigmoid
    onnx_op = "Sigmoid"

    torch_source = "nn.Sigmoid()"  # torch.sigmoid


@register_layer("TanH")
class TanH(_Unary):
    torch_fn = torch.tanh
    onnx_op = "Tanh"

    torch_source = "nn.Tanh()"  # torch.tanh


@register_layer("AbsVal")
class AbsVal(_Unary):
    torch_fn = torch.abs
    onnx_op = "Abs"

    torch_source = "torch.abs({x})"


# ---- power, exp, log -------------------------------------------------------------

@register_layer("Power")
class Power(Neuron):
    """(shift + scale * x) ^ power.  When power * scale == 0 the output ignores x:
    1 if power == 0, else shift ^ power (Caffe's special case)."""

    def parse_param(self, lp):
        p = lp.power_param
        power, scale, shift = f32(p.power), f32(p.scale), f32(p.shift)
        attrs = {"power": power, "scale": scale, "shift": shift}
        if f32(power * scale) == 0:
            with np.errstate(all="ignore"):  # NaN/inf here is Caffe's answer too
                value = 1.0 if power == 0 else float(np.power(np.float32(shift), np.float32(power)))
            attrs["constant"] = value
        return attrs

    def forward(self, attrs, params, x):
        if "constant" in attrs:
            return torch.full_like(x, attrs["constant"])
        y = x
        if attrs["scale"] != 1:
            y = y * attrs["scale"]
        if attrs["shift"] != 0:
            y = y + attrs["shift"]
        if attrs["power"] != 1:
            y = torch.pow(y, attrs["power"])
        return y if y is not x else x.clone()

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        if "constant" in a:
            shape = ctx.tmp(node.name + "_shape")
            ctx.add_node("Shape", [x], [shape])
            ctx.add_node("Expand", [scalar(ctx, a["constant"]), shape], [out], name=node.name)
            return
        y = x
        if a["scale"] != 1:
            y = onnx_mul_scalar(ctx, y, a["scale"], node.name + "_scaled")
        if a["shift"] != 0:
            y = onnx_add_scalar(ctx, y, a["shift"], node.name + "_shifted")
        if a["power"] != 1:
            ctx.add_node("Pow", [y, scalar(ctx, a["power"])], [out], name=node.name)
        else:
            ctx.add_node("Identity", [y], [out], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        if "constant" in a:
            return f"torch.full_like({x}, {emit.lit(a['constant'])})"
        y = x
        if a["scale"] != 1:
            y = f"{y} * {emit.lit(a['scale'])}"
        if a["shift"] != 0:  # y - s is y + (-s), bit for bit
            y = f"{y} {'-' if a['shift'] < 0 else '+'} {emit.lit(abs(a['shift']))}"
        if a["power"] != 1:
            y = f"torch.pow({y}, {emit.lit(a['power'])})"
        return [x] if y == x else y


def _base_scale_shift(lp, field):
    """Exp's and Log's (base, scale, shift) as float32 and log(base) (1 for base -1, meaning e);
    LayerError where Caffe CHECK-fails."""
    p = getattr(lp, field)
    base, scale, shift = f32(p.base), f32(p.scale), f32(p.shift)
    if base == -1:
        return base, scale, shift, 1.0
    if not base > 0:
        raise LayerError(f"{field}.base must be strictly positive (or -1 for e), got {base}")
    return base, scale, shift, f32(np.log(np.float32(base)))


def _times(y, factor):
    """y * factor, left as y when factor is 1 (as Caffe skips its scal)."""
    return y if factor == 1 else y * factor


def onnx_op_times(ctx, op, x, out, factor, name):
    """out = op(x) * factor, the Mul left out when factor is 1 (Exp's and Log's outer scale)."""
    if factor == 1:
        ctx.add_node(op, [x], [out], name=name)
        return
    y = ctx.tmp(f"{name}_{op.lower()}")
    ctx.add_node(op, [x], [y], name=name)
    ctx.add_node("Mul", [y, scalar(ctx, factor)], [out])


@register_layer("Exp")
class Exp(Neuron):
    """base ^ (shift + scale * x), computed as Caffe does: outer * exp(inner * x) with
    inner = log(base) * scale and outer = base ^ shift."""

    def parse_param(self, lp):
        base, scale, shift, log_base = _base_scale_shift(lp, "exp_param")
        inner = f32(np.float32(log_base) * np.float32(scale))
        if shift == 0:
            outer = 1.0
        elif base == -1:
            outer = f32(np.exp(np.float32(shift)))
        else:
            outer = f32(np.power(np.float32(base), np.float32(shift)))
        if not math.isfinite(outer):
            raise LayerError(f"exp_param: base^shift = {base}^{shift} overflows float32")
        return {"base": base, "scale": scale, "shift": shift, "inner": inner, "outer": outer}

    def forward(self, attrs, params, x):
        return _times(torch.exp(_times(x, attrs["inner"])), attrs["outer"])

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        if a["inner"] != 1:
            x = onnx_mul_scalar(ctx, x, a["inner"], node.name + "_inner")
        onnx_op_times(ctx, "Exp", x, out, a["outer"], node.name)

    def pytorch_source(self, node, emit):
        a, x = node.attrs, emit.inputs[0]
        arg = x if a["inner"] == 1 else f"{x} * {emit.lit(a['inner'])}"
        y = f"torch.exp({arg})"
        return y if a["outer"] == 1 else f"{y} * {emit.lit(a['outer'])}"


@register_layer("Log")
class Log(Neuron):
    """log_base(shift + scale * x) = ln(shift + scale * x) / ln(base)."""

    def parse_param(self, lp):
        base, scale, shift, log_base = _base_scale_shift(lp, "log_param")
        if log_base == 0:
            raise LayerError(f"log_param.base {base} gives 1/log(base) = inf")
        base_scale = f32(np.float32(1) / np.float32(log_base))
        if not math.isfinite(base_scale):
            raise LayerError(f"log_param.base {base} gives 1/log(base) = {base_scale}")
        return {"base": base, "scale": scale, "shift": shift, "base_scale": base_scale}

    def forward(self, attrs, params, x):
        y = x
        if attrs["scale"] != 1:
            y = y * attrs["scale"]
        if attrs["shift"] != 0:
            y = y + attrs["shift"]
        return _times(torch.log(y), attrs["base_scale"])

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        if a["scale"] != 1:
            x = onnx_mul_scalar(ctx, x, a["scale"], node.name + "_scaled")
        if a["shift"] != 0:
            x = onnx_add_scalar(ctx, x, a["shift"], node.name + "_shifted")
        onnx_op_times(ctx, "Log", x, out, a["base_scale"], node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        y = emit.inputs[0]
        if a["scale"] != 1:
            y = f"{y} * {emit.lit(a['scale'])}"
        if a["shift"] != 0:
            y = f"{y} {'-' if a['shift'] < 0 else '+'} {emit.lit(abs(a['shift']))}"
        y = f"torch.log({y})"
        return y if a["base_scale"] == 1 else f"{y} * {emit.lit(a['base_scale'])}"


# ---- BNLL, Threshold, Clip, Swish -------------------------------------------------

@register_layer("BNLL")
class BNLL(Neuron):
    """log(1 + e^x) in Caffe's stable form: x + log(1 + e^-x) for x > 0, log(1 + e^x) otherwise.

    relu(x) + log1p(exp(-|x|)) is that same expression for every x, and its
    gradient has no inf * 0 from an unused branch.
    """

    def forward(self, attrs, params, x):
        return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))

    def onnx(self, ctx, node):
        ctx.add_node("Softplus", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        x = emit.inputs[0]
        return f"{x}.clamp(min=0) + torch.log1p(torch.exp(-{x}.abs()))"


@register_layer("Threshold")
class Threshold(Neuron):
    """1 where x > threshold, else 0 (Caffe has no gradient for it), or else threshold_param.below_value:
    Bi-Real-net's Caffes give -1 there, which caffeq/io/upgrade.py marks."""

    def parse_param(self, lp):
        p = lp.threshold_param
        return {"threshold": f32(p.threshold), "below": f32(p.below_value)}

    def forward(self, attrs, params, x):
        above = x > attrs["threshold"]
        if not attrs["below"]:
            return above.to(x.dtype)
        return torch.where(above, 1.0, attrs["below"]).to(x.dtype)

    def onnx(self, ctx, node):
        gt = ctx.tmp(node.name + "_gt")
        ctx.add_node("Greater", [node.inputs[0], scalar(ctx, node.attrs["threshold"])], [gt],
                     name=node.name)
        if not node.attrs["below"]:
            ctx.add_node("Cast", [gt], [node.outputs[0]], to=FLOAT)
            return
        ctx.add_node("Where", [gt, scalar(ctx, 1.0), scalar(ctx, node.attrs["below"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        x, below = emit.inputs[0], node.attrs["below"]
        above = f"({x} > {emit.lit(node.attrs['threshold'])})"
        if not below:
            return f"{above}.to({x}.dtype)"
        return f"torch.where({above}, 1.0, {emit.lit(below)}).to({x}.dtype)"


@register_layer("Clip")
class Clip(Neuron):
    """max(min, min(x, max)); both bounds are required fields."""

    def parse_param(self, lp):
        p = lp.clip_param
        missing = [f for f in ("min", "max") if not (lp.HasField("clip_param") and p.HasField(f))]
        if missing:
            raise LayerError(f"clip_param.{' and clip_param.'.join(missing)} required")
        return {"min": f32(p.min), "max": f32(p.max)}

    def forward(self, attrs, params, x):
        # clamp(max) then clamp(min): Caffe's order, which gives min everywhere if min > max
        return x.clamp(max=attrs["max"]).clamp(min=attrs["min"])

    def onnx(self, ctx, node):
        onnx_clip(ctx, node.inputs[0], node.attrs["min"], node.attrs["max"], node.outputs[0],
                  name=node.name)

    def pytorch_source(self, node, emit):
        x, a = emit.inputs[0], node.attrs
        # max first, then min: Caffe's order (min > max gives min everywhere)
        return f"{x}.clamp(max={emit.lit(a['max'])}).clamp(min={emit.lit(a['min'])})"


@register_layer("HTanH")
class HTanH(Clip):
    """ypkang/caffe's hard tanh (ffb2dd9 htanh_layer.cu, the DjiNN and Tonic nets; V1 `type: HTANH`):
    x clamped to [-1, 1], NaN passing through, as its GPU forward.  Its CPU forward leaves the top
    unwritten at exactly -1 and 1 (the top's previous contents); the GPU's 1 and -1 are taken."""

    def parse_param(self, lp):
        return {"min": -1.0, "max": 1.0}


@register_layer("Swish")
class Swish(Neuron):
    """x * sigmoid(beta * x)."""

    scalar_param = ("swish_param", "beta")

    def forward(self, attrs, params, x):
        beta = attrs["beta"]
        return x * torch.sigmoid(x if beta == 1 else x * beta)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        beta = node.attrs["beta"]
        arg = x if beta == 1 else onnx_mul_scalar(ctx, x, beta, node.name + "_beta_x")
        sig = ctx.tmp(node.name + "_sigmoid")
        ctx.add_node("Sigmoid", [arg], [sig], name=node.name)
        ctx.add_node("Mul", [x, sig], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        x, beta = emit.inputs[0], node.attrs["beta"]
        # not nn.SiLU: it computes x / (1 + exp(-x)), which rounds differently
        arg = x if beta == 1 else f"{x} * {emit.lit(beta)}"
        return f"{x} * torch.sigmoid({arg})"


# ---- Mish, SeLu (fork layers) ------------------------------------------------------------

@register_layer("Mish")
class Mish(Neuron):
    """x * tanh(softplus(x)) (the YOLOv4 Caffe conversions' mish_layer.cpp; darknet's softplus
    returns x above 20 and exp(x) below -20, within float32 rounding of log(1 + exp(x)))."""

    def forward(self, attrs, params, x):
        return F.mish(x)   # torch's softplus also returns x above 20

    def onnx(self, ctx, node):
        x, out = node.inputs[0], node.outputs[0]
        if ctx.opset >= 18:
            ctx.add_node("Mish", [x], [out], name=node.name)
            return
        soft = ctx.add_node("Softplus", [x], [ctx.tmp(node.name + "_softplus")], name=node.name)[0]
        tanh = ctx.add_node("Tanh", [soft], [ctx.tmp(node.name + "_tanh")])[0]
        ctx.add_node("Mul", [x, tanh], [out])

    def pytorch_source(self, node, emit):
        return f"{emit.module('nn.Mish()')}({emit.inputs[0]})"   # nn.Mish is F.mish


@register_layer("SeLu")
class SeLu(Neuron):
    """The SeLu fork's selu_layer.cpp: x > 0 ? lambda * x : lambda * alpha * (exp(x) - 1), with
    lambda = 1.050700987 and alpha = 1.67326324 by default (selu_param), lambda * alpha in float32."""

    def parse_param(self, lp):
        lam, alpha = 1.050700987, 1.67326324
        if "selu_param" in lp.DESCRIPTOR.fields_by_name:   # when the schema declares the fork's message
            lam, alpha = getattr(lp.selu_param, "lambda"), lp.selu_param.alpha
        return {"lambda": f32(lam), "alpha": f32(alpha),
                "lambda_alpha": float(np.float32(lam) * np.float32(alpha))}

    def forward(self, attrs, params, x):
        # exp of min(x, 0): the same values where they are used, and no inf (NaN gradient) elsewhere
        return torch.where(x > 0, x * attrs["lambda"], (torch.exp(x.clamp_max(0)) - 1) * attrs["lambda_alpha"])

    def onnx(self, ctx, node):
        x, a = node.inputs[0], node.attrs
        pos = onnx_mul_scalar(ctx, x, a["lambda"], node.name + "_pos")
        ex = ctx.add_node("Exp", [x], [ctx.tmp(node.name + "_exp")], name=node.name)[0]
        em1 = onnx_add_scalar(ctx, ex, -1.0, node.name + "_expm1")
        neg = onnx_mul_scalar(ctx, em1, a["lambda_alpha"], node.name + "_neg")
        above = ctx.add_node("Greater", [x, scalar(ctx, 0.0)], [ctx.tmp(node.name + "_above")])[0]
        ctx.add_node("Where", [above, pos, neg], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        x, a = emit.inputs[0], node.attrs
        return (f"torch.where({x} > 0, {x} * {emit.lit(a['lambda'])}, "
                f"(torch.exp({x}.clamp_max(0)) - 1) * {emit.lit(a['lambda_alpha'])})")
