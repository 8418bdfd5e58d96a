"""Layers that combine blobs elementwise: Eltwise, Scale, Bias and the Axpy fork.

Scale and Bias (BVLC scale_layer.cpp / bias_layer.cpp) multiply or add a
tensor whose shape matches bottom[0]'s axes [axis, axis + k), broadcast over
the axes before and after.  It is either a learned blob (shape from axis and
num_axes, num_axes -1 meaning "to the end") or a second bottom (its own shape
gives k).  A 0-axis factor is a scalar.  Scale with bias_term holds its bias
as the last blob: [scale, bias] with one bottom, [bias] with two.

happynear/caffe-windows (967eedf, scale_layer.cpp/.cu; NormFace's scaled cosine softmax) adds
scale_param min_value / max_value: each forward first clamps the factor (blob or bottom[1]) to them,
in place.  caffeq clamps the factor it multiplies by; a later reader of that bottom[1] sees it unclamped.
"""

import math

import numpy as np
import torch
from torch import nn

from .activation import scalar
from .registry import AT_LEAST, Layer, LayerError, canonical_axis, need_blobs, register_layer
from .shape_ops import as_4d, legacy_4d_note, legacy_4d_shapes, onnx_as_4d

PROD, SUM, MAX = 0, 1, 2
SUBTRACT = 10003   # RojunLin/R-3CNN's (its 3): two bottoms, the first minus the second, coeff unread
_OP_NAMES = {PROD: "PROD", SUM: "SUM", MAX: "MAX", SUBTRACT: "SUBTRACT"}


class CaffeScale(nn.Module):
    """Caffe's Scale layer, x * weight (+ bias), and its Bias layer, x + bias (scale=False); the
    blobs are viewed as `view` so that they line up with x from Caffe's `axis` (trailing axes of 1)."""

    def __init__(self, shape, view, bias=True, scale=True, clamp=(None, None)):
        super().__init__()
        self.view = view
        self.clamp = clamp
        self.weight = nn.Parameter(torch.ones(shape)) if scale else None
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None

    def forward(self, x):
        weight = self.weight
        if weight is not None and self.clamp != (None, None):
            weight = weight.clamp(*self.clamp)
        y = x * weight.reshape(self.view) if weight is not None else x
        if self.bias is not None:
            y = y + self.bias.reshape(self.view)
        return y


def _torch_view(shape, x_ndim, axis):
    """_expand's shape for a factor of `shape` applied to an x_ndim-axis blob from `axis`."""
    shape = tuple(int(d) for d in shape)
    trailing = x_ndim - axis - len(shape)
    return list(shape) + [1] * trailing if shape and trailing else list(shape)


def _torch_bottom_view(name, ndim, x_ndim, axis):
    """A second bottom viewed like _expand does it, at run time (no baked batch)."""
    trailing = x_ndim - axis - ndim
    return f"{name}[..., {', '.join(['None'] * trailing)}]" if ndim and trailing else name


def eltwise_coeff_blob_sum(xs, coeffs, coeff):
    """The LRCN branch's Eltwise SUM with coeff_blob: sum_i (coeff[i] * coeffs[i]) * xs[i], coeffs[i]
    (the data's leading axes) broadcast over the rest, added in order from zero as its axpy loop."""
    y = None
    for i, x in enumerate(xs):
        factor = coeffs[i] * coeff[i] if coeff[i] != 1 else coeffs[i]
        factor = factor.reshape(tuple(factor.shape) + (1,) * (x.dim() - factor.dim()))
        y = x * factor if y is None else y + x * factor
    return y


@register_layer("Eltwise")
class Eltwise(Layer):
    """SUM (with one coefficient per bottom), PROD or MAX over any number (>= 2) of bottoms.  The
    optical-flow forks (lmb-freiburg/flownet2, twhui/LiteFlowNet: MinBottomBlobs 1) also sum a single
    bottom, y = coeff x, which their nets use to scale flows; PROD and MAX there read a second bottom.
    wanglijun1989/caffe-cvpr17's cross_channel PROD multiplies bottom 0 by (N, 1, H, W) bottoms, broadcast
    over the channels (its GPU ProdForward; the fork's CPU forward is not implemented).  RojunLin/R-3CNN's
    SUBTRACT takes two bottoms: the first minus the second.  MyCaffe's allow_single_batch_input (b8922aa,
    MyCaffe/layers/EltwiseLayer.cs): two bottoms, the second of batch 1 and bottom 0's count past the batch,
    copied to every batch item (channel_copyall) before the operation; its MAX forward reads bottom 1 itself
    (not the copies), so MAX runs only at batch 1."""

    def parse(self, lp):
        p = lp.eltwise_param
        op = int(p.operation)
        need_blobs(lp, lp.type, 2 if op == SUBTRACT else range(1 if op == SUM else 2, AT_LEAST))
        if op not in _OP_NAMES:
            raise LayerError(f"eltwise_param.operation {op} is not PROD, SUM, MAX or SUBTRACT")
        coeff = [float(np.float32(c)) for c in p.coeff]
        # the LRCN branch's coeff_blob: the last bottom is not summed but scales the others
        blob = "coeff_blob" in p.DESCRIPTOR.fields_by_name and p.coeff_blob
        if blob and (op != SUM or len(lp.bottom) < 2):
            raise LayerError("eltwise_param.coeff_blob needs operation SUM and a coefficient bottom after the data")
        data = len(lp.bottom) - blob
        if coeff and len(coeff) != data:
            raise LayerError(f"eltwise_param.coeff has {len(coeff)} values for {data} "
                             f"bottoms (give one per bottom, or none)")
        if coeff and op == PROD:
            raise LayerError("eltwise_param.coeff is only allowed for operation SUM")
        if op == SUBTRACT:   # R-3CNN's forward never reads coeff
            coeff = []
        cross = p.cross_channel
        if cross and op != PROD:
            raise LayerError("eltwise_param.cross_channel needs operation PROD (the fork's CHECK)")
        # MyCaffe's allow_single_batch_input: bottom 1 (batch 1) is copied to every batch item of bottom 0
        single = "allow_single_batch_input" in p.DESCRIPTOR.fields_by_name and p.allow_single_batch_input
        if single and len(lp.bottom) != 2:
            raise LayerError("eltwise_param.allow_single_batch_input takes exactly two bottoms (MyCaffe's CHECK)")
        if single and (blob or op == SUBTRACT):
            raise LayerError("eltwise_param.allow_single_batch_input (MyCaffe's) goes with PROD, SUM or MAX, "
                             "not with coeff_blob or SUBTRACT")
        return {"operation": op, "coeff": coeff or [1.0] * data, "coeff_blob": bool(blob), "cross_channel": cross,
                "single_batch": bool(single)}

    def infer(self, attrs, in_shapes):
        first = tuple(in_shapes[0])
        if attrs.get("coeff_blob"):
            coeffs, in_shapes = tuple(in_shapes[-1]), in_shapes[:-1]
            if len(coeffs) < 1 or coeffs[0] != len(in_shapes) or len(coeffs) - 1 > len(first) \
                    or coeffs[1:] != first[:len(coeffs) - 1]:
                raise LayerError(f"the coefficient bottom {list(coeffs)} must be ({len(in_shapes)}, then the "
                                 f"leading axes of the data {list(first)})")
        if attrs.get("cross_channel"):
            # caffe-cvpr17: bottoms after the first are (N, 1, H, W), broadcast over its channels
            for i, s in enumerate(in_shapes[1:], 1):
                if len(first) != 4 or tuple(s) != (first[0], 1) + first[2:]:
                    raise LayerError(f"bottom {i} has shape {list(s)}; cross_channel multiplies bottom 0 "
                                     f"{list(first)} by (N, 1, H, W) bottoms")
            return [first]
        if attrs.get("single_batch"):
            second = tuple(in_shapes[1])
            if not second or second[0] != 1 or math.prod(second) != math.prod(first[1:]):
                raise LayerError(f"bottom 1 has shape {list(second)}; allow_single_batch_input needs batch 1 and "
                                 f"the count of bottom 0 {list(first)} past its batch")
            if attrs["operation"] == MAX and first[0] > 1:
                # MyCaffe's MAX forward reads bottom 1 itself, not the copies made for every batch item
                raise LayerError(f"eltwise_param.allow_single_batch_input with MAX and bottom 0 {list(first)}: "
                                 f"MyCaffe's MAX reads bottom 1 past its end for a batch over 1, not run")
            return [first]
        # R-3CNN's SUBTRACT CHECKs equal shapes (no 4-axis-era leniency)
        padded = None if attrs.get("coeff_blob") or attrs["operation"] == SUBTRACT else legacy_4d_shapes(in_shapes)
        attrs["_as_4d"] = bool(padded) and len(set(padded)) == 1
        if attrs["_as_4d"]:
            attrs["reading_notes"] = [legacy_4d_note("Eltwise", in_shapes)]
            return [padded[0]]
        for i, s in enumerate(in_shapes[1:], 1):
            if tuple(s) != first:
                raise LayerError(f"bottom {i} has shape {list(s)}, bottom 0 has {list(first)}; "
                                 f"Eltwise needs equal shapes")
        return [first]

    def forward(self, attrs, params, *xs):
        op = attrs["operation"]
        if attrs.get("_as_4d"):
            xs = [as_4d(x) for x in xs]
        if attrs.get("coeff_blob"):
            return eltwise_coeff_blob_sum(list(xs[:-1]), xs[-1], attrs["coeff"])
        if attrs.get("single_batch"):
            xs = (xs[0], xs[1].reshape((1,) + tuple(xs[0].shape[1:])))
        if op == SUM:
            y = None
            for c, x in zip(attrs["coeff"], xs):
                term = x if c == 1 else x * c
                y = term if y is None else y + term
            return y
        if op == SUBTRACT:
            return xs[0] - xs[1]
        y = xs[0]
        for x in xs[1:]:
            y = y * x if op == PROD else torch.maximum(y, x)
        return y

    def onnx(self, ctx, node):
        op = node.attrs["operation"]
        ins, out = list(node.inputs), node.outputs[0]
        if node.attrs.get("_as_4d"):
            ins = [onnx_as_4d(ctx, x) for x in ins]
        if node.attrs.get("single_batch"):
            ins[1] = ctx.op("Reshape", [ins[1], ctx.i64([1, *ctx.shape(ins[0])[1:]])], "single_batch")
        if node.attrs.get("coeff_blob"):
            coeffs, ins = ins[-1], ins[:-1]
            lead = list(ctx.shape(coeffs))[1:]
            view = ctx.i64(lead + [1] * (len(ctx.shape(ins[0])) - len(lead)))
            terms = []
            for i, (c, x) in enumerate(zip(node.attrs["coeff"], ins)):
                factor = ctx.op("Reshape", [ctx.op("Gather", [coeffs, ctx.i64(i)], f"coeff{i}", axis=0), view],
                                f"coeff{i}_view")
                if c != 1:
                    factor = ctx.op("Mul", [factor, scalar(ctx, c)], f"coeff{i}_scaled")
                terms.append(ctx.op("Mul", [x, factor], f"term{i}"))
            ctx.add_node("Sum", terms, [out], name=node.name)
            return
        if op == SUM:
            terms = []
            for i, (c, x) in enumerate(zip(node.attrs["coeff"], ins)):
                if c == 1:
                    terms.append(x)
                else:
                    t = ctx.tmp(f"{node.name}_term{i}")
                    ctx.add_node("Mul", [x, scalar(ctx, c)], [t])
                    terms.append(t)
            ctx.add_node("Sum", terms, [out], name=node.name)
        elif op == SUBTRACT:
            ctx.add_node("Sub", ins, [out], name=node.name)
        elif op == PROD:
            y = ins[0]
            for i, x in enumerate(ins[1:], 1):
                nxt = out if i == len(ins) - 1 else ctx.tmp(f"{node.name}_prod{i}")
                ctx.add_node("Mul", [y, x], [nxt], name=node.name if nxt == out else None)
                y = nxt
        else:
            ctx.add_node("Max", ins, [out], name=node.name)

    def pytorch_source(self, node, emit):
        op, xs = node.attrs["operation"], emit.inputs
        if node.attrs.get("_as_4d"):
            xs = [f"{emit.helper(as_4d)}({x})" for x in xs]
        if node.attrs.get("single_batch"):
            xs = [xs[0], f"{xs[1]}.reshape((1,) + tuple({xs[0]}.shape[1:]))"]
        if node.attrs.get("coeff_blob"):
            fn = emit.helper(eltwise_coeff_blob_sum)
            return f"{fn}([{', '.join(xs[:-1])}], {xs[-1]}, {node.attrs['coeff']!r})"
        if op == PROD:
            return " * ".join(xs)
        if op == SUBTRACT:
            return f"{xs[0]} - {xs[1]}"
        if op == MAX:
            y = xs[0]
            for x in xs[1:]:
                y = f"torch.maximum({y}, {x})"
            return y
        # SUM, left to right as forward; x * -c is -(x * c) and y + (-t) is y - t, bit for bit
        y = ""
        for c, x in zip(node.attrs["coeff"], xs):
            mag = abs(c)
            term = x if mag == 1 else f"{x} * {emit.lit(mag)}"
            if not y:
                y = term if c > 0 else (f"-{x}" if mag == 1 else f"{x} * {emit.lit(c)}")
            else:
                y = f"{y} {'+' if c > 0 else '-'} {term}" if c != 0 else f"{y} + {x} * 0.0"
        return y


# ---- Scale and Bias ----------------------------------------------------------------

def _learned_shape(x_shape, axis, num_axes, field):
    """Shape of a learned scale/bias blob (Caffe's LayerSetUp with one bottom)."""
    ndim = len(x_shape)
    axis = canonical_axis(axis, ndim, f"{field}.axis")
    if num_axes < -1:
        raise LayerError(f"{field}.num_axes must be >= 0, or -1 for all axes to the end; got {num_axes}")
    if num_axes == -1:
        return tuple(x_shape[axis:])
    if axis + num_axes > ndim:
        raise LayerError(f"{field}: axis {axis} + num_axes {num_axes} extends past bottom[0]'s "
                         f"{ndim} axes {list(x_shape)}")
    return tuple(x_shape[axis:axis + num_axes])


def _broadcast_axis(x_shape, factor_shape, axis, field, what):
    """Caffe's Reshape check: the factor's dims equal x's dims from `axis`; axis 0 for a scalar."""
    if len(factor_shape) == 0:
        return 0
    ndim = len(x_shape)
    axis = canonical_axis(axis, ndim, f"{field}.axis")
    if axis + len(factor_shape) > ndim:
        raise LayerError(f"{what} shape {list(factor_shape)} extends past bottom[0]'s shape "
                         f"{list(x_shape)} when applied from axis {axis}")
    for i, d in enumerate(factor_shape):
        if x_shape[axis + i] != d:
            raise LayerError(f"{what} shape {list(factor_shape)} does not match bottom[0]'s shape "
                             f"{list(x_shape)} from axis {axis}")
    return axis


def _expand(t, x_dim, axis):
    """View a factor so that it broadcasts against x from `axis` (trailing axes of size 1)."""
    trailing = x_dim - axis - t.dim()
    return t.reshape(tuple(t.shape) + (1,) * trailing) if t.dim() and trailing else t


def _onnx_expand(ctx, node, t, t_ndim, x_ndim, axis, hint):
    """ONNX form of _expand: Reshape with 0s (copy the factor's own dims, no baked batch)."""
    trailing = x_ndim - axis - t_ndim
    if t_ndim == 0 or trailing == 0:
        return t
    out = ctx.tmp(f"{node.name}_{hint}")
    ctx.add_node("Reshape", [t, ctx.const(np.array([0] * t_ndim + [1] * trailing, np.int64))], [out])
    return out


@register_layer("Scale")
class Scale(Layer):
    """top = x * s (+ b), s a learned blob or bottom[1]; see the module docstring."""
    blob_names = ("scale", "bias")

    def blob_names_for(self, attrs):
        return ("bias",) if attrs["two_bottoms"] else self.blob_names

    def parse(self, lp):
        need_blobs(lp, lp.type, (1, 2))
        p = lp.scale_param
        return {"axis": int(p.axis), "num_axes": int(p.num_axes), "bias_term": bool(p.bias_term),
                "two_bottoms": len(lp.bottom) == 2,
                "clamp": (float(p.min_value) if p.HasField("min_value") else None,
                          float(p.max_value) if p.HasField("max_value") else None),
                "filler": _constant_filler(p.filler, 1.0) if p.HasField("filler") else 1.0,
                "bias_filler": _constant_filler(p.bias_filler, 0.0)}

    def _shapes(self, attrs, in_shapes):
        x = tuple(in_shapes[0])
        if attrs["two_bottoms"]:
            scale_shape = tuple(in_shapes[1])
            bias_shape = _learned_shape(x, attrs["axis"], len(scale_shape), "scale_param") \
                if attrs["bias_term"] else None
        else:
            scale_shape = _learned_shape(x, attrs["axis"], attrs["num_axes"], "scale_param")
            bias_shape = scale_shape if attrs["bias_term"] else None
        attrs["_axis"] = _broadcast_axis(x, scale_shape, attrs["axis"], "scale_param", "scale")
        if bias_shape is not None:
            attrs["_bias_axis"] = _broadcast_axis(x, bias_shape, attrs["axis"], "scale_param", "bias")
        return scale_shape, bias_shape

    def infer(self, attrs, in_shapes):
        self._shapes(attrs, in_shapes)
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        scale_shape, bias_shape = self._shapes(attrs, in_shapes)
        shapes = [] if attrs["two_bottoms"] else [scale_shape]
        if bias_shape is not None:
            shapes.append(bias_shape)
        return shapes or None

    def init_params(self, attrs, shapes, rng):
        values = ([] if attrs["two_bottoms"] else [attrs["filler"]]) + \
            ([attrs["bias_filler"]] if attrs["bias_term"] else [])
        return [np.full(s, v, np.float32) for s, v in zip(shapes, values)]

    def forward(self, attrs, params, x, *rest):
        if attrs["two_bottoms"]:
            s, bias = rest[0], (params[0] if attrs["bias_term"] else None)
        else:
            s, bias = params[0], (params[1] if attrs["bias_term"] else None)
        if attrs["clamp"] != (None, None):
            s = s.clamp(*attrs["clamp"])
        y = x * _expand(s, x.dim(), attrs["_axis"])
        if bias is not None:
            y = y + _expand(bias, x.dim(), attrs["_bias_axis"])
        return y

    def onnx(self, ctx, node, inputs=None, outputs=None):
        """inputs / outputs replace the node's own (ScaleRistretto's trimmed bottoms, untrimmed top)."""
        a = node.attrs
        x = (inputs or node.inputs)[0]
        x_ndim = len(ctx.shape(node.inputs[0]))
        out = (outputs or node.outputs)[0]
        if a["two_bottoms"]:
            s = (inputs or node.inputs)[1]
            s_ndim = len(ctx.shape(node.inputs[1]))
            bias_index = 0
        else:
            s = ctx.weight(node, 0)
            s_ndim = len(node.expected_param_shapes[0])
            bias_index = 1
        if a["clamp"] != (None, None):
            clamped = ctx.tmp(node.name + "_clamped")
            bounds = ["" if v is None else ctx.const(np.array(v, np.float32)) for v in a["clamp"]]
            ctx.add_node("Clip", [s] + bounds, [clamped])
            s = clamped
        s = _onnx_expand(ctx, node, s, s_ndim, x_ndim, a["_axis"], "scale")
        if not a["bias_term"]:
            ctx.add_node("Mul", [x, s], [out], name=node.name)
            return
        scaled = ctx.tmp(node.name + "_scaled")
        ctx.add_node("Mul", [x, s], [scaled], name=node.name)
        b = _onnx_expand(ctx, node, ctx.weight(node, bias_index),
                         len(node.expected_param_shapes[bias_index]), x_ndim, a["_bias_axis"], "bias")
        ctx.add_node("Add", [scaled, b], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        ndim = len(emit.in_shape(0))
        if a["two_bottoms"]:
            s = emit.inputs[1]
            if a["clamp"] != (None, None):
                s = f"{s}.clamp({emit.lit(a['clamp'][0])}, {emit.lit(a['clamp'][1])})"
            y = f"{x} * {_torch_bottom_view(s, len(emit.in_shape(1)), ndim, a['_axis'])}"
            if not a["bias_term"]:
                return y
            shape = node.expected_param_shapes[0]
            m = emit.module(f"{emit.helper(CaffeScale)}({list(shape)}, "
                            f"{_torch_view(shape, ndim, a['_bias_axis'])}, scale=False)")
            emit.param("bias", 0)
            return f"{m}({y})"
        shape = node.expected_param_shapes[0]
        bias = "" if a["bias_term"] else ", bias=False"
        if a["clamp"] != (None, None):
            bias += f", clamp=({emit.lit(a['clamp'][0])}, {emit.lit(a['clamp'][1])})"
        m = emit.module(f"{emit.helper(CaffeScale)}({list(shape)}, {_torch_view(shape, ndim, a['_axis'])}{bias})")
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        return f"{m}({x})"


def _constant_filler(filler, default):
    """The value a constant filler sets (the init of random_weights); others give the default."""
    if filler.type == "constant":
        return float(filler.value)
    return default


@register_layer("Bias")
class Bias(Layer):
    """top = x + b, b a learned blob or bottom[1] (broadcast like Scale)."""
    blob_names = ("bias",)

    def parse(self, lp):
        need_blobs(lp, lp.type, (1, 2))
        p = lp.bias_param
        num_axes = int(p.num_axes)
        if p.HasField("channel_shared"):   # hli2020/caffe's Bias: its (C,) blob, or one shared value
            if p.HasField("axis") or p.HasField("num_axes") or len(lp.bottom) == 2:
                raise LayerError("bias_param.channel_shared (hli2020/caffe's one-bottom Bias) and axis, num_axes or a "
                                 "second bottom (BVLC's Bias) come from different forks")
            num_axes = 0 if p.channel_shared else 1
        return {"axis": int(p.axis), "num_axes": num_axes, "two_bottoms": len(lp.bottom) == 2,
                "filler": _constant_filler(p.filler, 0.0)}

    def _shape(self, attrs, in_shapes):
        x = tuple(in_shapes[0])
        if attrs["two_bottoms"]:
            shape = tuple(in_shapes[1])
        else:
            shape = _learned_shape(x, attrs["axis"], attrs["num_axes"], "bias_param")
        attrs["_axis"] = _broadcast_axis(x, shape, attrs["axis"], "bias_param", "bias")
        return shape

    def infer(self, attrs, in_shapes):
        self._shape(attrs, in_shapes)
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        shape = self._shape(attrs, in_shapes)
        return None if attrs["two_bottoms"] else [shape]

    def init_params(self, attrs, shapes, rng):
        return [np.full(shapes[0], attrs["filler"], np.float32)]

    def forward(self, attrs, params, x, *rest):
        b = rest[0] if attrs["two_bottoms"] else params[0]
        return x + _expand(b, x.dim(), attrs["_axis"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        if node.attrs["two_bottoms"]:
            b, b_ndim = node.inputs[1], len(ctx.shape(node.inputs[1]))
        else:
            b, b_ndim = ctx.weight(node, 0), len(node.expected_param_shapes[0])
        b = _onnx_expand(ctx, node, b, b_ndim, len(ctx.shape(x)), node.attrs["_axis"], "bias")
        ctx.add_node("Add", [x, b], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        ndim = len(emit.in_shape(0))
        if a["two_bottoms"]:
            return f"{x} + {_torch_bottom_view(emit.inputs[1], len(emit.in_shape(1)), ndim, a['_axis'])}"
        shape = node.expected_param_shapes[0]
        m = emit.module(f"{emit.helper(CaffeScale)}({list(shape)}, "
                        f"{_torch_view(shape, ndim, a['_axis'])}, scale=False)")
        emit.param("bias", 0)
        return f"{m}({x})"


# ---- Axpy (hujie-frank/SENet) -------------------------------------------------------

@register_layer("Axpy")
class Axpy(Layer):
    """top = a * x + y with a = bottom[0] shaped (N, C) or (N, C, 1, 1), x = bottom[1],
    y = bottom[2] (x and y of equal shape): SENet's fused channel scale + residual sum."""

    bottoms = 3

    def infer(self, attrs, in_shapes):
        a, x, y = (tuple(s) for s in in_shapes)
        if len(x) < 2 or len(a) < 2 or a[:2] != x[:2]:
            raise LayerError(f"bottom[0] {list(a)} must start with bottom[1]'s N x C {list(x[:2])}")
        if len(a) == 4 and a[2:] != (1, 1):
            raise LayerError(f"bottom[0] {list(a)} must be N x C x 1 x 1")
        if any(d != 1 for d in a[2:]):
            raise LayerError(f"bottom[0] {list(a)} must hold one value per (N, C)")
        if x != y:
            raise LayerError(f"bottom[1] {list(x)} and bottom[2] {list(y)} must have equal shapes")
        return [x]

    def forward(self, attrs, params, a, x, y):
        a = a.reshape(tuple(a.shape[:2]) + (1,) * (x.dim() - 2))
        return a * x + y

    def onnx(self, ctx, node):
        a, x, y = node.inputs
        x_ndim = len(ctx.shape(x))
        shaped = ctx.tmp(node.name + "_a")
        ctx.add_node("Reshape", [a, ctx.const(np.array([0, 0] + [1] * (x_ndim - 2), np.int64))], [shaped])
        prod = ctx.tmp(node.name + "_ax")
        ctx.add_node("Mul", [shaped, x], [prod], name=node.name)
        ctx.add_node("Add", [prod, y], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a, x, y = emit.inputs
        ones = ", 1" * (len(emit.in_shape(1)) - 2)
        return f"{a}.reshape([{a}.shape[0], {a}.shape[1]{ones}]) * {x} + {y}"
