"""busyboxs/roi_roi's Conadd (c19edb0, caffe/src/caffe/layers/conadd_layer.cpp / .cu,
caffe/include/caffe/layers/conadd_layer.hpp; its empty conadd_param in caffe/src/caffe/proto/caffe.proto).

The sum of one or more bottoms, shaped as the first.  Reshape gives a later bottom whose shape differs from the
first bottom's shape in place, keeping its leading elements: its values are read as its flat (C-order)
buffer cut to the first bottom's element count and reshaped, not cropped per axis (the fork's LeNet adds a
(N, 50, 24, 24) map to a (N, 50, 20, 20) one that way, so samples' elements mix).  The sum is
((0 + b0) + b1) + ... in float32, as the GPU forward (which zeroes the top first) computes; the CPU forward
adds onto the top without zeroing it, which equals this on a net's first pass only, and with fewer
bottoms than axes it indexes bottoms that do not exist.  One bottom: the top shares it.

Bottoms must have as many axes as the first (the fork's CHECK); a bottom with fewer elements than the first
would be grown in place by Reshape and read from a freed buffer: caffeq refuses it.
"""
import math

import torch

from .registry import Layer, LayerError, need_blobs, register_layer

FORK = "busyboxs/roi_roi"


def conadd(first: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """busyboxs/roi_roi's Conadd: the first bottom plus each other one's leading elements in its shape."""
    out = first
    for b in others:
        out = out + b.reshape(-1)[:first.numel()].reshape(first.shape)
    return out


@register_layer("Conadd")
class Conadd(Layer):
    def parse(self, lp):
        need_blobs(lp, f"Conadd ({FORK})", range(1, 1 << 30), 1)
        return {}

    def infer(self, attrs, in_shapes):
        first = tuple(in_shapes[0])
        for i, s in enumerate(in_shapes[1:], 1):
            if len(s) != len(first):
                raise LayerError(f"Conadd: bottom {i} has {len(s)} axes, bottom 0 {len(first)} (the fork's CHECK)")
            if math.prod(s) < math.prod(first):
                raise LayerError(f"Conadd: bottom {i} {list(s)} has fewer elements than bottom 0 {list(first)}; "
                                 "the fork would grow it in place and read a freed buffer")
        attrs["_shape"] = list(first)
        return [first]

    def forward(self, attrs, params, *bottoms):
        return conadd(*bottoms)

    def onnx(self, ctx, node):
        first = node.inputs[0]
        if len(node.inputs) == 1:
            ctx.add_node("Identity", [first], [node.outputs[0]], name=node.name)
            return
        shape = node.attrs["_shape"]
        acc = first
        for i, b in enumerate(node.inputs[1:], 1):
            flat = ctx.add_node("Reshape", [b, ctx.i64([-1])], ctx.tmp(f"{node.name}_flat{i}"))
            cut = ctx.add_node("Slice", [flat, ctx.i64([0]), ctx.i64([math.prod(shape)]), ctx.i64([0])], ctx.tmp(f"{node.name}_cut{i}"))
            part = ctx.add_node("Reshape", [cut, ctx.i64(shape)], ctx.tmp(f"{node.name}_part{i}"))
            last = i == len(node.inputs) - 1
            acc = ctx.add_node("Add", [acc, part], [node.outputs[0]] if last else ctx.tmp(f"{node.name}_sum{i}"))

    def pytorch_source(self, node, emit):
        return f"{emit.helper(conadd)}({', '.join(emit.inputs)})"


__all__ = ["Conadd"]
