"""jialinwu17/segawareatt's ChannelReduce (e4ef958, caffe/src/caffe/layers/channel_reduce_layer.cpp / .cu,
caffe/include/caffe/layers/channel_reduce_layer.hpp; channel_reduce_param in caffe/src/caffe/proto/caffe.proto).

The bottom's channels (read through num/channels/height/width) fall into num_channels consecutive groups
of C / num_channels; top channel g reduces group g pixel by pixel into (N, num_channels, H, W):
  SUM: 0 + c0 + c1 + ... in channel order, in float32 (CPU and GPU forwards alike);
  MAX (the default): starting from -FLT_MAX, a channel replaces the running value only where it is larger,
  so NaN never wins and an all -inf (or NaN) group gives -FLT_MAX (CPU and GPU alike).
The fork CHECKs num_channels % C != 0 (not the divisor test its message names) and then indexes with
C / num_channels: num_channels must divide C and be smaller than it, else its loops write past the top or
divide by zero; caffeq refuses those.

The same fork's res_att nets also name Pooling3D with pooling3d_param { kernel_width kernel_height
kernel_depth }, but the fork declares neither the message nor the layer (its Caffe refuses those files);
caffeq leaves them unread (see proto/README.md).
"""
import torch

from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer

FORK = "jialinwu17/segawareatt"
SUM, MAX = 0, 1
#: the running maximum's start, -FLT_MAX
LOWEST = -3.4028234663852886e38


def channel_reduce(x: torch.Tensor, groups: int, use_max: bool) -> torch.Tensor:
    """segawareatt's ChannelReduce of an (N, C, H, W) map into (N, groups, H, W), channel by channel."""
    n, c, h, w = x.shape
    parts = x.reshape(n, groups, c // groups, h, w).unbind(2)
    if use_max:
        out = torch.full_like(parts[0], -torch.finfo(torch.float32).max)   # -FLT_MAX
        for p in parts:
            out = torch.where(p > out, p, out)
        return out
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


@register_layer("ChannelReduce")
class ChannelReduce(Layer):
    def parse(self, lp):
        need_blobs(lp, f"ChannelReduce ({FORK})", 1, 1)
        p = lp.channel_reduce_param
        if p.num_channels < 1:
            raise LayerError(f"channel_reduce_param.num_channels must be >= 1, got {p.num_channels}")
        return {"groups": int(p.num_channels), "max": int(p.operation) == MAX}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "ChannelReduce")
        g = attrs["groups"]
        if g >= c or c % g:
            raise LayerError(f"channel_reduce_param.num_channels {g} must divide the bottom's {c} channels and be "
                             "smaller (the fork CHECKs num_channels % channels != 0 and indexes by channels / "
                             "num_channels)")
        attrs["_in"] = (n, c, h, w)
        return [(n, g, h, w)]

    def forward(self, attrs, params, x):
        return channel_reduce(x.reshape(attrs["_in"]), attrs["groups"], attrs["max"])

    def onnx(self, ctx, node):
        n, c, h, w = node.attrs["_in"]
        g = node.attrs["groups"]
        k = c // g
        grouped = ctx.add_node("Reshape", [node.inputs[0], ctx.i64([n, g, k, h, w])], ctx.tmp(node.name + "_g"),
                               name=node.name)
        parts = ctx.add_node("Split", [grouped, ctx.i64([1] * k)], [ctx.tmp(f"{node.name}_c{j}") for j in range(k)],
                             axis=2) if k > 1 else [grouped]
        parts = [ctx.add_node("Squeeze", [p, ctx.i64([2])], ctx.tmp(f"{node.name}_s{j}")) for j, p in enumerate(parts)]
        if node.attrs["max"]:
            acc = ctx.add_node("Expand", [ctx.f32(LOWEST), ctx.i64([n, g, h, w])], ctx.tmp(node.name + "_low"))
            for j, p in enumerate(parts):
                out = [node.outputs[0]] if j == k - 1 else ctx.tmp(f"{node.name}_m{j}")
                more = ctx.add_node("Greater", [p, acc], ctx.tmp(f"{node.name}_gt{j}"))
                acc = ctx.add_node("Where", [more, p, acc], out)
            return
        if k == 1:
            ctx.add_node("Identity", [parts[0]], [node.outputs[0]])
            return
        acc = parts[0]
        for j, p in enumerate(parts[1:], 1):
            out = [node.outputs[0]] if j == k - 1 else ctx.tmp(f"{node.name}_a{j}")
            acc = ctx.add_node("Add", [acc, p], out)

    def pytorch_source(self, node, emit):
        x = f"{emit.inputs[0]}.reshape({tuple(node.attrs['_in'])})"
        return f"{emit.helper(channel_reduce)}({x}, {node.attrs['groups']}, {node.attrs['max']})"


__all__ = ["ChannelReduce"]
