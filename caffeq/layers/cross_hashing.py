"""zx12348163/cross_hashing_code's attention-mask layers (caffe/src/caffe/layers, 112b65a): none reads a
parameter or holds a blob; the masks are blobs the net computes (a Softmax over positions).

- Binary (binary_layer.cpp): 0 where x > 1 / D, else 1 (so also at 1 / D and for NaN), D = count / num of
  the bottom (its legacy channels x height x width); the threshold is float32 1 / D.  It keeps the
  positions the softmax ranks below uniform.
- Weighted (weighted_layer.cpp): x (N, C, H, W) times a per-sample spatial mask of H x W values
  (mask[n, h * W + w]), the same for every channel.
- FCWeighted (fc_weighted_layer.cpp): x (N, K) times a mask of K values per sample, elementwise.
Its FormatImageData data layer is a graph input (format_image_data_param); its TripletRankLossLabel,
CrossModalLoss and TripleEuclideanMaxLoss only train.
"""
import math

import numpy as np
import torch

from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def below_uniform_mask(x):
    """1 where x is not above float32 1 / D (D = count / num), else 0."""
    d = x[0].numel()
    level = torch.tensor(1.0, dtype=torch.float32) / d
    return torch.where(x > level.to(x.dtype), torch.zeros_like(x), torch.ones_like(x))


def weighted_by_mask(x, mask):
    """x times mask, each sample's mask read as x's shape past the channels (Weighted: H x W) or
    past the batch (FCWeighted: K)."""
    n = x.shape[0]
    shape = (n, 1) + tuple(x.shape[2:]) if x.dim() == 4 else tuple(x.shape)
    return x * mask.reshape(shape)


@register_layer("Binary")
class BinaryMask(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        s = legacy_nchw(in_shapes[0], "Binary")
        if math.prod(s) == 0:
            raise LayerError(f"Binary's samples are empty ({list(in_shapes[0])})")
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x):
        return below_uniform_mask(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        d = math.prod(ctx.shape(x)[1:])
        above = ctx.op("Greater", [x, ctx.f32(np.float32(1.0) / np.float32(d))], "above")
        ctx.add_node("Cast", [ctx.op("Not", [above], "kept")], [node.outputs[0]], name=node.name, to=1)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(below_uniform_mask)}({emit.inputs[0]})"


class _MaskProduct(Layer):
    """x times a per-sample mask of the values past x's channels (Weighted) or batch (FCWeighted)."""

    data_axes = 4    # the axes the fork's CHECK wants on the first bottom
    first_mask_axis = 2

    def parse(self, lp):
        need_blobs(lp, lp.type, 2, 1)
        return {}

    def infer(self, attrs, in_shapes):
        x, mask = (tuple(s) for s in in_shapes)
        name = type(self).__name__
        if len(x) != self.data_axes:
            raise LayerError(f"{name} needs a {self.data_axes}-axis first bottom, got {list(x)}")
        per_sample = math.prod(x[self.first_mask_axis:])
        if not mask or math.prod(mask[1:]) != per_sample:
            raise LayerError(f"{name}'s mask {list(mask)} must hold {per_sample} values per sample "
                             f"(the first bottom is {list(x)})")
        if mask[0] != x[0]:
            raise LayerError(f"{name}'s mask {list(mask)} must have the first bottom's num {x[0]} "
                             f"(the fork reads mask row n for sample n)")
        return [x]

    def forward(self, attrs, params, x, mask):
        return weighted_by_mask(x, mask)

    def onnx(self, ctx, node):
        x, mask = node.inputs
        shape = ctx.shape(x)
        target = (shape[0], 1) + tuple(shape[2:]) if len(shape) == 4 else tuple(shape)
        ctx.add_node("Mul", [x, ctx.op("Reshape", [mask, ctx.i64(list(target))], "mask")], [node.outputs[0]],
                     name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(weighted_by_mask)}({', '.join(emit.inputs)})"


@register_layer("Weighted")
class Weighted(_MaskProduct):
    pass


@register_layer("FCWeighted")
class FCWeighted(_MaskProduct):
    data_axes = 2
    first_mask_axis = 1
