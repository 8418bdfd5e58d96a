"""L2 normalizations of the metric-learning forks, each its own layer type.

- Norm (xiaolonw/caffe-video_triplet c39ea1a, norm_layer.cpp): at each (n, h, w),
  y = x / (sqrt(sum_c x^2) + 1e-6); the epsilon is added after the root.
- NormL2 (xialuxi/arcface-caffe 30ba26a, AdaCos/normL2_layer.cpp): each item as one vector,
  y = x * 1 / sqrt(sum of its squares + 1e-7).
- L2Norm (vzhangmeng726/caffe_video_face b6cd746, l2norm_layer.cpp): each item as one vector,
  y = x / (sqrt(sum of its squares) + l2norm_param.eps [1e-8]); the epsilon is added after the root.

- Normalization (Binbin Xu's, as ZhouYzzz/project 4481109 and Gomdoree/caffe-triplet 0affd64 carry it,
  normalization_layer.cpp/.cu; the latter's normalization_param.norm is never read) and
  NormalizationL2 (Longhui Wei's, liu-xb/GGL 2ea1508, normalization_l2_layer.cu; its CPU forward calls
  the GPU one): each item times pow(sum of its squares [+ 1e-10 for NormalizationL2], -0.5); the top
  keeps the bottom's shape (ReshapeLike).  Without an epsilon an all-zero item divides by zero, as in
  the fork.
- SimpleNormalize (yuqj1991/caffe_train c724780, simplenormalize_layer.cpp/.cu; its face-recognition and
  re-ID nets): each item times pow(sum of its squares, -0.5), no epsilon; the top is 4-axis
  (num, channels, height, width).

- Python:norm2layer.Norm2Layer (the Pinguo triplet-loss code, as JoeFannie/tripletloss 195a6b8
  tripletloss/norm2layer.py carries it; ElaineBao/triplet-loss's nets name it too): top (N, C); each item
  through sklearn's preprocessing.normalize(norm='l2'), x / ||x|| in the blob's float32, an all-zero item
  left as zeros (sklearn divides it by 1).  The module writes each item's C H W values into a row of C:
  caffeq refuses a bottom whose H W is not 1, as numpy does.

None has blobs.  Both read num/channels/height/width, so their top is 4-axis even
for an (N, C) bottom.  (happynear's Normalize is in happynear.py.)
"""
import numpy as np
import torch

from .happynear import _reduce
from .registry import Layer, LayerError, count, legacy_nchw, register_layer

NORM_EPS = 1e-6       # xiaolonw: added to the root
NORM_L2_EPS = 1e-7    # xialuxi: added to the sum of squares


# ---- torch functions (model.py gets the same code) ---------------------------------------

def channel_l2_normalize(x, legacy_shape: list[int], eps: float):
    """xiaolonw's Norm: x / (||x||_channels + eps) at each (n, h, w), 4-axis."""
    x = x.reshape(legacy_shape)
    return x / (torch.sqrt((x * x).sum(dim=1, keepdim=True)) + eps)


def item_l2_normalize_eps_after_root(x, legacy_shape: list[int], eps: float):
    """vzhangmeng726's L2Norm: each item divided by (its L2 norm + eps), 4-axis."""
    x = x.reshape(legacy_shape)
    norms = torch.sqrt((x * x).reshape(x.shape[0], -1).sum(dim=1))
    return x / (norms + eps).reshape(-1, 1, 1, 1)


def item_l2_normalize(x, legacy_shape: list[int], eps: float):
    """xialuxi's NormL2 (and Normalization, NormalizationL2): each item times
    1 / sqrt(sum of its squares + eps), shaped as legacy_shape."""
    x = x.reshape(legacy_shape)
    squares = (x * x).reshape(x.shape[0], -1).sum(dim=1)
    return x * (1.0 / torch.sqrt(squares + eps)).reshape([-1] + [1] * (x.dim() - 1))


def sklearn_l2_rows(x):
    """sklearn's normalize(x.reshape(N, -1), norm='l2'): each row over its L2 norm, a zero norm read as 1."""
    rows = x.reshape(x.shape[0], -1)
    norms = torch.sqrt((rows * rows).sum(dim=1, keepdim=True))
    return rows / torch.where(norms == 0, torch.ones_like(norms), norms)


class _L2Norm(Layer):
    """One bottom made 4-axis and normalized by `fn` with the fork's `eps` (see the module docstring)."""

    fn = None     # staticmethod(the torch function), copied into model.py
    eps = None
    axes = None   # the axes summed over, of the 4-axis blob
    eps_under_root = False
    keep_shape = False   # the top is shaped like the bottom (ReshapeLike), not made 4-axis
    top_as_bottom = False   # computed on the 4-axis blob, the top given back the bottom's shape (a 2-D feature)

    bottoms = tops = 1

    def parse(self, lp):
        return dict(super().parse(lp), eps=self.eps)

    def infer(self, attrs, in_shapes):
        shape = tuple(in_shapes[0]) if self.keep_shape else legacy_nchw(in_shapes[0], self.types[0])
        if self.keep_shape and not shape:
            raise LayerError(f"{self.types[0]} needs a bottom with an item axis, got a scalar")
        attrs["_legacy"] = list(shape)
        return [tuple(in_shapes[0])] if self.top_as_bottom else [shape]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])

    def forward(self, attrs, params, x):
        y = self.fn(x, attrs["_legacy"], attrs["eps"])
        return y.reshape(x.shape) if self.top_as_bottom else y

    def pytorch_source(self, node, emit):
        x = emit.inputs[0]
        call = f"{emit.helper(self.fn)}({x}, {node.attrs['_legacy']}, {emit.lit(node.attrs['eps'])})"
        return f"{call}.reshape({x}.shape)" if self.top_as_bottom else call

    def onnx(self, ctx, node):
        name = node.name

        shape = ctx.const(np.array(node.attrs["_legacy"], np.int64))
        x = ctx.add_node("Reshape", [node.inputs[0], shape], [ctx.tmp(name + "_4d")], name=name)[0]
        axes = list(range(1, len(node.attrs["_legacy"]))) if self.keep_shape else self.axes
        squares = _reduce(ctx, "ReduceSumSquare", x, axes)
        eps = ctx.const(np.array(node.attrs["eps"], np.float32))
        if self.eps_under_root:   # xialuxi: x * 1 / sqrt(sum + eps)
            inv = ctx.op("Reciprocal", [ctx.op("Sqrt", [ctx.op("Add", [squares, eps], "sse")], "root")], "inv")
            ctx.add_node("Mul", [x, inv], [node.outputs[0]])
        else:                     # xiaolonw: x / (sqrt(sum) + eps)
            out = ctx.tmp(name + "_4d_out") if self.top_as_bottom else node.outputs[0]
            ctx.add_node("Div", [x, ctx.op("Add", [ctx.op("Sqrt", [squares], "root"), eps], "norm")], [out])
            if self.top_as_bottom:
                ctx.add_node("Reshape", [out, ctx.i64(list(ctx.shape(node.inputs[0])))], [node.outputs[0]])


@register_layer("Norm")
class Norm(_L2Norm):
    fn = staticmethod(channel_l2_normalize)
    eps = NORM_EPS
    axes = [1]


@register_layer("NormL2")
class NormL2(_L2Norm):
    fn = staticmethod(item_l2_normalize)
    eps = NORM_L2_EPS
    axes = [1, 2, 3]
    eps_under_root = True


@register_layer("L2Norm")
class L2Norm(_L2Norm):
    fn = staticmethod(item_l2_normalize_eps_after_root)
    axes = [1, 2, 3]

    def parse(self, lp):
        if lp.bottom and lp.top and lp.bottom[0] == lp.top[0]:
            raise LayerError("L2Norm does not support in-place operation (the fork's Reshape checks it)")
        return dict(super().parse(lp), eps=float(lp.l2norm_param.eps))


@register_layer("Normalization")
class Normalization(_L2Norm):
    fn = staticmethod(item_l2_normalize)
    eps = 0.0
    eps_under_root = True
    keep_shape = True

    def parse(self, lp):
        attrs = super().parse(lp)
        # Gomdoree/caffe-triplet declares normalization_param { norm: L1 | L2 } for it; the layer never reads it
        if lp.normalization_param.norm == lp.normalization_param.L1:
            attrs["reading_notes"] = ["normalization_param.norm: L1 is not read: the layer divides by the L2 norm "
                                      "(normalization_layer.cpp)"]
        return attrs


@register_layer("NormalizationL2")
class NormalizationL2(Normalization):
    eps = 1e-10


@register_layer("SimpleNormalize")
class SimpleNormalize(_L2Norm):
    fn = staticmethod(item_l2_normalize)
    eps = 0.0
    axes = [1, 2, 3]
    eps_under_root = True



@register_layer("Python:norm2layer.Norm2Layer")
class TripletNorm2(Layer):
    bottoms = tops = 1

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2 or count(s, 1) != s[1]:
            raise LayerError(f"norm2layer.Norm2Layer writes each item of bottom {list(s)} into an (N, C) top: "
                             f"its values past the channels must number 1, as numpy's assignment needs")
        return [(s[0], s[1])]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])

    def forward(self, attrs, params, x):
        return sklearn_l2_rows(x)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(sklearn_l2_rows)}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        rows = ctx.merge_axes(node.inputs[0], 1, "rows", name=node.name)
        norm = ctx.op("Sqrt", [_reduce(ctx, "ReduceSumSquare", rows, [1])], "norm")
        one = ctx.const(np.array(1.0, np.float32))
        zero = ctx.op("Equal", [norm, ctx.const(np.array(0.0, np.float32))], "zero")
        ctx.add_node("Div", [rows, ctx.op("Where", [zero, one, norm], "divisor")], [node.outputs[0]])
