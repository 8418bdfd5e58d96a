"""L2 normalizations of the metric-learning forks, each its own layer type.

- Norm (xiaolonw/caffe-video_triplet c39ea1a, norm_layer.cpp): at each (n, h, w),
  y = x / (sqrt(sum_c x^2) + 1e-6); the epsilon is added after the root.
- NormL2 (xialuxi/arcface-caffe 30ba26a, AdaCos/normL2_layer.cpp): each item as one vector,
  y = x * 1 / sqrt(sum of its squares + 1e-7).

Neither has parameters or blobs.  Both read num/channels/height/width, so their top is 4-axis even
for an (N, C) bottom.  (happynear's Normalize is in happynear.py.)
"""
import inspect

import numpy as np
import torch

from .happynear import _legacy_4d, _reduce
from .registry import Layer, count, need_blobs, register_layer

NORM_EPS = 1e-6       # xiaolonw: added to the root
NORM_L2_EPS = 1e-7    # xialuxi: added to the sum of squares


# ---- torch functions (model.py gets the same code) ---------------------------------------

def channel_l2_normalize(x, legacy_shape: list[int], eps: float):
    """xiaolonw's Norm: x / (||x||_channels + eps) at each (n, h, w), 4-axis."""
    x = x.reshape(legacy_shape)
    return x / (torch.sqrt((x * x).sum(dim=1, keepdim=True)) + eps)


def item_l2_normalize(x, legacy_shape: list[int], eps: float):
    """xialuxi's NormL2: each item times 1 / sqrt(sum of its squares + eps), 4-axis."""
    x = x.reshape(legacy_shape)
    squares = (x * x).reshape(x.shape[0], -1).sum(dim=1)
    return x * (1.0 / torch.sqrt(squares + eps)).reshape(-1, 1, 1, 1)


class _L2Norm(Layer):
    type_name = ""

    def parse(self, lp):
        need_blobs(lp, self.type_name, 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        legacy = _legacy_4d(in_shapes[0], self.type_name)
        attrs["_legacy"] = list(legacy)
        return [legacy]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])


@register_layer("Norm")
class Norm(_L2Norm):
    type_name = "Norm"

    def forward(self, attrs, params, x):
        return channel_l2_normalize(x, attrs["_legacy"], NORM_EPS)

    def onnx(self, ctx, node):
        name = node.name
        x = ctx.add_node("Reshape", [node.inputs[0], ctx.const(np.array(node.attrs["_legacy"], np.int64))],
                         [ctx.tmp(name + "_4d")], name=name)[0]
        ss = _reduce(ctx, "ReduceSumSquare", x, [1])
        root = ctx.add_node("Sqrt", [ss], [ctx.tmp(name + "_root")])[0]
        norm = ctx.add_node("Add", [root, ctx.const(np.array(NORM_EPS, np.float32))], [ctx.tmp(name + "_norm")])[0]
        ctx.add_node("Div", [x, norm], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(inspect.getsource(channel_l2_normalize))
        return f"{fn}({emit.inputs[0]}, {node.attrs['_legacy']}, {emit.lit(NORM_EPS)})"


@register_layer("NormL2")
class NormL2(_L2Norm):
    type_name = "NormL2"

    def forward(self, attrs, params, x):
        return item_l2_normalize(x, attrs["_legacy"], NORM_L2_EPS)

    def onnx(self, ctx, node):
        name = node.name
        x = ctx.add_node("Reshape", [node.inputs[0], ctx.const(np.array(node.attrs["_legacy"], np.int64))],
                         [ctx.tmp(name + "_4d")], name=name)[0]
        ss = _reduce(ctx, "ReduceSumSquare", x, [1, 2, 3])
        sse = ctx.add_node("Add", [ss, ctx.const(np.array(NORM_L2_EPS, np.float32))], [ctx.tmp(name + "_sse")])[0]
        root = ctx.add_node("Sqrt", [sse], [ctx.tmp(name + "_root")])[0]
        inv = ctx.add_node("Reciprocal", [root], [ctx.tmp(name + "_inv")])[0]
        ctx.add_node("Mul", [x, inv], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(inspect.getsource(item_l2_normalize))
        return f"{fn}({emit.inputs[0]}, {node.attrs['_legacy']}, {emit.lit(NORM_L2_EPS)})"
