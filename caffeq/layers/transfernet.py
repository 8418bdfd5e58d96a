"""maga33/TransferNet's layers (aaa32d7, caffe/src/caffe/layers, as HyeonwooNoh's DecoupledNet Caffe; the
CPU and GPU forwards compute the same):

- Scale with `scale_param { scale_factor }` (scale_layer.cpp): top i = scale_factor * bottom i, for
  each top, no blobs (the fork's Scale has no learned scale; BVLC's Scale reads the other files).
- LinearSum (linear_sum_layer.cpp): x (N, C, ...) and weights (N, 1, ...) of x's other axes ->
  (N, C), each channel's dot product with its sample's weights (a gemv per sample): the attention-
  weighted sum of a feature map.
- FilterSum (filter_sum_layer.cu): x (N, C, H, W) and weights of N x C values (LinearSum's top) ->
  (N, 1, H, W) = sum over c of weights[n, c] * x[n, c]: the map of the attended features.
"""
import numpy as np
import torch

from .registry import AT_LEAST, Layer, LayerError, claim_layers, count, four_axes, need_blobs, register_layer


@claim_layers("Scale", lambda lp: lp.scale_param.HasField("scale_factor"))
class ConstantScale(Layer):
    def parse(self, lp):
        need_blobs(lp, "Scale", range(1, AT_LEAST))
        if not 1 <= len(lp.top) <= len(lp.bottom):
            raise LayerError(f"Scale with scale_param.scale_factor makes one top per bottom (the fork scales "
                             f"bottom i into top i), got {len(lp.bottom)} bottoms and {len(lp.top)} tops")
        # the fork keeps the factor as a float (Dtype) before it multiplies
        return {"factor": float(np.float32(lp.scale_param.scale_factor)), "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        return [tuple(s) for s in in_shapes[:attrs["tops"]]]

    def forward(self, attrs, params, *xs):
        scaled = [x * attrs["factor"] for x in xs[:attrs["tops"]]]
        return scaled[0] if len(scaled) == 1 else scaled

    def onnx(self, ctx, node):
        factor = ctx.f32(node.attrs["factor"])
        for x, top in zip(node.inputs, node.outputs):
            ctx.add_node("Mul", [x, factor], [top], name=node.name)

    def pytorch_source(self, node, emit):
        scaled = [f"{x} * {emit.lit(node.attrs['factor'])}" for x in emit.inputs[:node.attrs["tops"]]]
        return scaled[0] if len(scaled) == 1 else scaled


def linear_sum(x, weights):
    """(N, C, ...) and (N, 1, ...) -> (N, C): each channel's dot product with its sample's weights."""
    return torch.bmm(x.flatten(2), weights.reshape(weights.shape[0], -1, 1)).squeeze(2)


@register_layer("LinearSum")
class LinearSum(Layer):
    bottoms, tops, bottom_roles = 2, 1, "x, weights"

    def infer(self, attrs, in_shapes):
        x, w = (tuple(s) for s in in_shapes)
        # LayerSetUp's checks: the same axes, weights of one channel and x's other dims
        if len(x) < 2 or len(w) != len(x) or w[1] != 1 or w[:1] + w[2:] != x[:1] + x[2:]:
            raise LayerError(f"LinearSum's weights {list(w)} must be x's shape {list(x)} with one channel")
        return [(x[0], x[1])]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])

    def forward(self, attrs, params, x, weights):
        return linear_sum(x, weights)

    def onnx(self, ctx, node):
        x, weights = node.inputs
        channels = ctx.shape(x)[1]
        rows = ctx.add_node("Reshape", [x, ctx.i64([0, channels, -1])], ctx.tmp(node.name + "_rows"),
                            name=node.name)
        column = ctx.add_node("Reshape", [weights, ctx.i64([0, -1, 1])], ctx.tmp(node.name + "_column"))
        dots = ctx.add_node("MatMul", [rows, column], ctx.tmp(node.name + "_dots"))
        ctx.add_node("Reshape", [dots, ctx.i64([0, channels])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(linear_sum)}({emit.inputs[0]}, {emit.inputs[1]})"


def filter_sum(x, weights):
    """x (N, C, H, W) and N x C weights -> (N, 1, H, W), the weighted sum of each sample's channels."""
    return (x * weights.reshape(x.shape[0], x.shape[1], 1, 1)).sum(1, keepdim=True)


@register_layer("FilterSum")
class FilterSum(Layer):
    bottoms, tops, bottom_roles = 2, 1, "x, weights"

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "FilterSum", "x (bottom 0)")
        weights = tuple(in_shapes[1])
        # Reshape checks the channels; the kernel reads weights[n * C + c]
        if len(weights) < 2 or weights[:2] != (n, c) or count(weights) != n * c:
            raise LayerError(f"FilterSum's weights {list(weights)} must hold one value per sample and channel of "
                             f"x {[n, c, h, w]}, as (N, C) or (N, C, 1, 1)")
        return [(n, 1, h, w)]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])

    def forward(self, attrs, params, x, weights):
        return filter_sum(x, weights)

    def onnx(self, ctx, node):
        x, weights = node.inputs
        channels = ctx.shape(x)[1]
        per_channel = ctx.add_node("Reshape", [weights, ctx.i64([0, channels, 1, 1])],
                                   ctx.tmp(node.name + "_weights"), name=node.name)
        weighted = ctx.add_node("Mul", [x, per_channel], ctx.tmp(node.name + "_weighted"))
        ctx.add_node("ReduceSum", [weighted, ctx.i64([1])], [node.outputs[0]], keepdims=1)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(filter_sum)}({emit.inputs[0]}, {emit.inputs[1]})"
