"""GroupNorm as blankWorld/GroupNorm-caffe (3a27dca, group_norm_layer.cu) computes it, the Caffe layer
of Wu & He's Group Normalization that forks copy (group_norm_param group_num [32], eps [1e-5]).

For each item and each of group_num groups of C / group_num consecutive channels, over those
channels and every position: y = (x - mean) / sqrt(var + eps), var the mean of the squared
deviations (biased).  No scale or shift: nets follow it with a Scale layer.  The fork checks that
group_num divides the channels; it has a GPU forward only.
"""
import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, count, register_layer


def group_norm(x, groups: int, eps: float):
    """(x - mean) / sqrt(var + eps) over each item's groups of channels and all their positions."""
    g = x.reshape(x.shape[0], groups, -1)
    centred = g - g.mean(dim=2, keepdim=True)
    var = (centred * centred).mean(dim=2, keepdim=True)
    return (centred / torch.sqrt(var + eps)).reshape(x.shape)


@register_layer("GroupNorm")
class GroupNorm(Layer):
    bottoms = tops = 1

    def parse(self, lp):
        attrs = super().parse(lp)
        p = lp.group_norm_param
        if p.group_num < 1:
            raise LayerError(f"group_norm_param.group_num must be >= 1, got {p.group_num}")
        if not p.eps >= 0:
            raise LayerError(f"group_norm_param.eps must be >= 0, got {p.eps}")
        return dict(attrs, groups=int(p.group_num), eps=float(np.float32(p.eps)))

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2:
            raise LayerError(f"GroupNorm needs (N, C, ...) with channels, got {list(s)}")
        if s[1] % attrs["groups"]:
            raise LayerError(f"group_norm_param.group_num {attrs['groups']} must divide the {s[1]} channels")
        return [s]

    def macs(self, attrs, in_shapes, out_shapes):
        return 4 * count(in_shapes[0])

    def forward(self, attrs, params, x):
        return group_norm(x, attrs["groups"], attrs["eps"])

    def onnx(self, ctx, node):
        name, x = node.name, node.inputs[0]
        shape = list(ctx.shape(x))
        grouped = ctx.add_node("Reshape", [x, ctx.const(np.array([0, node.attrs["groups"], -1], np.int64))],
                               [ctx.tmp(name + "_groups")], name=name)[0]
        mean = onnx_reduce(ctx, "ReduceMean", grouped, [2], True)
        centred = ctx.add_node("Sub", [grouped, mean], [ctx.tmp(name + "_centred")])[0]
        squares = ctx.add_node("Mul", [centred, centred], [ctx.tmp(name + "_sq")])[0]
        var = onnx_reduce(ctx, "ReduceMean", squares, [2], True)
        eps = ctx.const(np.array(node.attrs["eps"], np.float32))
        std = ctx.add_node("Sqrt", [ctx.add_node("Add", [var, eps], [ctx.tmp(name + "_var_eps")])[0]],
                           [ctx.tmp(name + "_std")])[0]
        normed = ctx.add_node("Div", [centred, std], [ctx.tmp(name + "_normed")])[0]
        ctx.add_node("Reshape", [normed, ctx.const(np.array([0] + shape[1:], np.int64))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(group_norm)}({emit.inputs[0]}, {node.attrs['groups']}, {emit.lit(node.attrs['eps'])})"
