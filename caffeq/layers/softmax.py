"""Softmax along one axis (BVLC Caffe), and peteanderson80/caffe's Softmax with a second bottom of
per-position counts."""

import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, canonical_axis, count, register_layer


def counted_softmax(x, counts, axis: int):
    """peteanderson80/caffe's Softmax with a second bottom: at each (outer, inner) position the softmax of
    the first int(count) entries along `axis` (count read as (outer, 1, inner)), 0 beyond them, as the
    fork's test checks for counts 1 to C.  Its softmax_layer.cpp is not public: here a count above C takes
    every entry and one below 1 gives NaN (0 / 0)."""
    view = [1] * x.dim()
    view[axis] = x.shape[axis]
    index = torch.arange(x.shape[axis], device=x.device).reshape(view)
    shape = list(x.shape)
    shape[axis] = 1
    keep = index < torch.trunc(counts.reshape(shape))
    top = torch.where(keep, x, torch.full_like(x, float("-inf"))).amax(dim=axis, keepdim=True)
    e = torch.where(keep, torch.exp(x - top), torch.zeros_like(x))
    return e / e.sum(dim=axis, keepdim=True)


@register_layer("Softmax")
class Softmax(Layer):
    def parse(self, lp):
        if len(lp.bottom) not in (1, 2):
            raise LayerError(f"Softmax takes one bottom (or peteanderson80/caffe's scores and per-position counts), "
                             f"got {len(lp.bottom)}")
        return {"axis": int(lp.softmax_param.axis), "counted": len(lp.bottom) == 2}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        attrs["_axis"] = canonical_axis(attrs["axis"], len(s), "softmax_param.axis")
        if attrs.get("counted"):
            positions = count(s) // s[attrs["_axis"]] if s[attrs["_axis"]] else 0
            if count(in_shapes[1]) != positions:
                raise LayerError(f"Softmax's counts {list(in_shapes[1])} must hold one value per position outside "
                                 f"the softmax axis ({positions}), as peteanderson80/caffe reads them")
        return [tuple(s)]

    def forward(self, attrs, params, x, counts=None):
        if counts is not None:
            return counted_softmax(x, counts, attrs["_axis"])
        return torch.softmax(x, dim=attrs["_axis"])

    def onnx(self, ctx, node):
        if node.attrs.get("counted"):
            _emit_counted_softmax(ctx, node)
            return
        emit_softmax(ctx, node.inputs[0], node.outputs[0], node.attrs["_axis"],
                     len(ctx.shape(node.inputs[0])), name=node.name)

    def pytorch_source(self, node, emit):
        if node.attrs.get("counted"):
            return f"{emit.helper(counted_softmax)}({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['_axis']})"
        m = emit.module(f"nn.Softmax(dim={node.attrs['_axis']})")  # torch.softmax, as forward
        return f"{m}({emit.inputs[0]})"


def _emit_counted_softmax(ctx, node):
    x, counts = node.inputs
    shape, axis = list(ctx.shape(x)), node.attrs["_axis"]
    view = [1] * len(shape)
    view[axis] = shape[axis]
    index = ctx.const(np.arange(shape[axis], dtype=np.float32).reshape(view))
    shape[axis] = 1
    whole = ctx.trunc(counts, "count_trunc", name=node.name)
    keep = ctx.op("Less", [index, ctx.op("Reshape", [whole, ctx.i64(shape)], "counts")], "keep")
    masked = ctx.op("Where", [keep, x, ctx.f32(float("-inf"))], "masked")
    top = onnx_reduce(ctx, "ReduceMax", masked, [axis], True)
    e = ctx.op("Where", [keep, ctx.op("Exp", [ctx.op("Sub", [x, top], "shift")], "e_all"), ctx.f32(0.0)], "e")
    ctx.add_node("Div", [e, onnx_reduce(ctx, "ReduceSum", e, [axis], True)], [node.outputs[0]])


def emit_softmax(ctx, x, out, axis, rank, name=None):
    """Softmax along one axis; before opset 13 ONNX's Softmax flattened from `axis` on."""
    if ctx.opset >= 13 or axis == rank - 1:
        ctx.add_node("Softmax", [x], [out], name=name, axis=axis)
        return out
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    t = ctx.tmp(f"{x}_t")
    ctx.add_node("Transpose", [x], [t], name=name, perm=perm)
    s = ctx.tmp(f"{x}_softmax")
    ctx.add_node("Softmax", [t], [s], axis=rank - 1)
    ctx.add_node("Transpose", [s], [out], perm=perm)
    return out


__all__ = ["Softmax", "counted_softmax", "emit_softmax"]
