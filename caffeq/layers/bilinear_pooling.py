"""Bilinear pooling nets' layers: SignedSqrt and L2Normalize (gy20073/compact_bilinear_pooling 1b7c58a,
caffe-20160312/src/caffe/layers; ChaojianYu/Hierarchical-Bilinear-Pooling 034e848 ships the same files)
and SumPooling (Hierarchical-Bilinear-Pooling, src/caffe/layers/sum_pooling_layer.cpp / .cu).

- SignedSqrt: x >= 0 ? sqrt(x) : -sqrt(-x) (so -0 gives -0 and NaN stays NaN); not in place.
- L2Normalize: each item (axis 0) times pow(sum of its squares + 1e-7, -0.5), that sum in float32 (cuBLAS
  asum on the GPU, a loop on the CPU: the order of the additions may differ in the last bits), the
  power in double and rounded to float32 before the product.  The top is (num, channels, height, width)
  as Caffe's legacy accessors read the bottom: an (N, C) bottom gives (N, C, 1, 1).  Not in place.
- SumPooling: Caffe's Pooling (the same geometry, MAX, AVE and STOCHASTIC) with a fourth method SUM, the
  sum over each window (the fork allows no padding with it); `sum_pooling_param` holds the
  PoolingParameter fields under their numbers.
"""
import numpy as np
import torch

from ..io.schema import caffe_pb2
from .pooling import AVE, CEIL, TORCH_POOL_FUNCTIONS, TORCH_POOL_MODULE, Pooling, caffe_pool2d, window
from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer

DOUBLE, FLOAT = 11, 1   # onnx.TensorProto
NORM_EPS = float(np.float32(1e-7))   # the fork's Dtype epsilon = 0.0000001
SUM = caffe_pb2.SumPoolingParameter.SUM


def signed_sqrt(x):
    """SignedSqrt: sqrt(x) where x >= 0, else -sqrt(-x), correctly rounded as the fork's sqrt is
    (through double: torch's float32 sqrt on the CPU may be an ulp off)."""
    wide = x.double()
    return torch.where(x >= 0, torch.sqrt(wide), -torch.sqrt(-wide)).to(x.dtype)


def item_l2_normalize(x, legacy_shape: list[int], eps: float):
    """L2Normalize: each item times float32(pow(float32 sum of squares + eps, -0.5)), 4-axis as legacy_shape."""
    squares = (x * x).reshape(x.shape[0], -1).sum(1)
    scale = torch.pow((squares + eps).double(), -0.5).to(x.dtype)
    return (x.reshape(x.shape[0], -1) * scale[:, None]).reshape(legacy_shape)


@register_layer("SignedSqrt")
class SignedSqrt(Layer):
    def parse(self, lp):
        need_blobs(lp, "SignedSqrt", 1, 1, in_place=False)
        return {}

    def forward(self, attrs, params, x):
        return signed_sqrt(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        wide = ctx.op("Cast", [x], "in_double", name=node.name, to=DOUBLE)
        root = ctx.op("Sqrt", [wide], "root")
        negative_root = ctx.op("Neg", [ctx.op("Sqrt", [ctx.op("Neg", [wide], "negated")], "negated_root")], "signed")
        chosen = ctx.op("Where", [ctx.op("GreaterOrEqual", [x, ctx.f32(0.0)], "nonnegative"), root, negative_root],
                        "chosen")
        ctx.add_node("Cast", [chosen], [node.outputs[0]], to=FLOAT)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(signed_sqrt)}({emit.inputs[0]})"


@register_layer("L2Normalize")
class L2Normalize(Layer):
    def parse(self, lp):
        need_blobs(lp, "L2Normalize", 1, 1, in_place=False)
        return {}

    def infer(self, attrs, in_shapes):
        return [legacy_nchw(in_shapes[0], "L2Normalize")]

    def forward(self, attrs, params, x):
        return item_l2_normalize(x, [x.shape[0]] + list(legacy_nchw(x.shape, "L2Normalize")[1:]), NORM_EPS)

    def onnx(self, ctx, node):
        x, out = node.inputs[0], node.outputs[0]
        shape = legacy_nchw(ctx.shape(x), "L2Normalize")
        flat = ctx.op("Flatten", [x], "items", name=node.name, axis=1)
        squares = ctx.op("ReduceSum", [ctx.op("Mul", [flat, flat], "squares"), ctx.i64([1])], "sum_squares",
                         keepdims=1)
        power = ctx.op("Pow", [ctx.op("Cast", [ctx.op("Add", [squares, ctx.f32(NORM_EPS)], "plus_eps")],
                                      "in_double", to=DOUBLE), ctx.const(np.array(-0.5))], "inverse_norm")
        scaled = ctx.op("Mul", [flat, ctx.op("Cast", [power], "scale", to=FLOAT)], "scaled")
        ctx.add_node("Reshape", [scaled, ctx.i64([0] + list(shape[1:]))], [out])

    def pytorch_source(self, node, emit):
        shape = legacy_nchw(emit.in_shape(0), "L2Normalize")
        x = emit.inputs[0]
        return (f"{emit.helper(item_l2_normalize)}({x}, [{x}.shape[0]] + {emit.lit(list(shape[1:]))}, "
                f"{emit.lit(NORM_EPS)})")


@register_layer("SumPooling")
class SumPooling(Pooling):
    def pooling_params(self, lp):
        p = lp.sum_pooling_param
        if p.pool == SUM and (p.pad or p.pad_h or p.pad_w):
            raise LayerError("sum_pooling_param: SUM with padding (the fork's check: padding is implemented only "
                             "for average and max pooling)")
        q = caffe_pb2.PoolingParameter()
        for field in ("pad", "kernel_size", "stride"):
            if p.HasField(field):
                getattr(q, field).append(getattr(p, field))
        for field in ("pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w", "global_pooling"):
            if p.HasField(field):
                setattr(q, field, getattr(p, field))
        q.pool = AVE if p.pool == SUM else int(p.pool)   # SUM: AVE's windows, not divided
        return q

    def parse(self, lp):
        attrs = super().parse(lp)
        attrs["sum"] = lp.sum_pooling_param.pool == SUM
        return attrs

    def _sum_window(self, attrs, h, w):
        k, s, p, _ = window(attrs, h, w)
        return list(k), list(s), list(p), attrs["round_mode"] == CEIL

    def forward(self, attrs, params, x):
        if not attrs["sum"]:
            return super().forward(attrs, params, x)
        return caffe_pool2d(x, "sum", *self._sum_window(attrs, x.shape[2], x.shape[3]))

    def onnx(self, ctx, node):
        if not node.attrs["sum"]:
            return super().onnx(ctx, node)
        x = node.inputs[0]
        _, c, h, w = ctx.shape(x)
        k, s, _, _ = self._sum_window(node.attrs, h, w)
        out = window(node.attrs, h, w)[3]
        extra = [max(0, (o - 1) * st + kk - n) for o, st, kk, n in zip(out, s, k, (h, w))]
        padded = ctx.op("Pad", [x, ctx.i64([0, 0, 0, 0, 0, 0, extra[0], extra[1]])], "padded", name=node.name) \
            if any(extra) else x
        ones = ctx.const(np.ones((c, 1, k[0], k[1]), np.float32), node.name + "_ones")
        sums = ctx.op("Conv", [padded, ones], "sums", group=c, kernel_shape=k, strides=s)
        ctx.add_node("Slice", [sums, ctx.i64([0, 0]), ctx.i64(list(out)), ctx.i64([2, 3])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        if not node.attrs["sum"]:
            return super().pytorch_source(node, emit)
        k, s, p, ceil = self._sum_window(node.attrs, *emit.in_shape(0)[2:])
        m = emit.instance(TORCH_POOL_MODULE, "sum", k, s, p, ceil, needs=[TORCH_POOL_FUNCTIONS])
        return f"{m}({emit.inputs[0]})"
