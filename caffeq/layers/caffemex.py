"""sciencefans/CaffeMex_v2's CenterProjection (9bab8d2, src/caffe/layers/center_projection_layer.cpp / .cu;
the COCO loss nets): an InnerProduct (center_projection_param num_output, bias_term, axis, transpose)
whose weight rows are meant to be unit vectors, times `scale`.  Its blobs and top are InnerProduct's.

caffeq reads it (shapes, parameters, conversion of the structure) but does not run it: no forward of
the fork computes a function of its inputs alone.  The GPU forward with more than one row normalizes
the weight rows in the blob itself (w / (|w| + 1e-6), again at every call, so the weights drift), then
multiplies by scale; with one row it multiplies by the weights as they stand, without scale.  The CPU
forward writes its result into its bottom and leaves the top unset.  (Its Normalize, the layer before it
in those nets, runs: happynear.py.)

BatchPool (b934325, src/caffe/layers/batch_pool_layer.cpp, CPU only; Quality Aware Network's set pooling):
features (N, C, H, W) (at most 4 axes) -> (1, C, H, W).  With a second bottom of N weights (any shape, read
flat) the top is sum_n w[n] x[n] whatever batch_pool_param.pool says (the nets normalize the weights first,
with an L1 Normalization); alone, AVE is the batch mean and MAX the batch maximum as the fork's loop takes
it: from -FLT_MAX, a value replacing it only when greater (NaN never does, all -inf gives -FLT_MAX).
STOCHASTIC is not implemented in the fork: refused.
"""
import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, ReadOnlyLayer, canonical_axis, count, need_blobs, register_layer

WHY = ("CenterProjection's forward depends on how often it ran (the fork normalizes its weight blob in place "
       "at every GPU call with more than one row, and skips the normalization and the scale with one row; its "
       "CPU forward writes into its bottom): caffeq reads it but does not run it")


@register_layer("CenterProjection")
class CenterProjection(ReadOnlyLayer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "CenterProjection", 1, 1)
        p = lp.center_projection_param
        if p.num_output < 1:
            raise LayerError("center_projection_param.num_output must be >= 1")
        return {"num_output": int(p.num_output), "bias_term": bool(p.bias_term), "axis": int(p.axis),
                "transpose": bool(p.transpose), "scale": float(np.float32(p.scale)), "name": lp.name}

    def _k(self, attrs, shape):
        axis = canonical_axis(attrs["axis"], len(shape), "center_projection_param.axis")
        return axis, int(np.prod(shape[axis:], dtype=np.int64))

    def infer(self, attrs, in_shapes):
        axis, _ = self._k(attrs, in_shapes[0])
        return [tuple(in_shapes[0][:axis]) + (attrs["num_output"],)]

    def param_shapes(self, attrs, in_shapes):
        _, k = self._k(attrs, in_shapes[0])
        n = attrs["num_output"]
        weight = (k, n) if attrs["transpose"] else (n, k)
        return [weight, (n,)] if attrs["bias_term"] else [weight]

    def macs(self, attrs, in_shapes, out_shapes):
        return int(np.prod(out_shapes[0], dtype=np.int64)) * self._k(attrs, in_shapes[0])[1]

    def why_not_run(self, attrs):
        return WHY


def batch_pool(x, weights, pool: str):
    """BatchPool (see the module docstring): x (N, ...) -> (1, ...); weights None or N values."""
    if weights is not None:
        w = weights.reshape(-1)[: x.shape[0]].reshape((-1,) + (1,) * (x.dim() - 1))
        return (w * x).sum(dim=0, keepdim=True)
    if pool == "MAX":
        lowest = torch.tensor(-3.4028234663852886e38, dtype=x.dtype, device=x.device)   # -FLT_MAX
        return torch.maximum(torch.where(torch.isnan(x), lowest, x).amax(dim=0, keepdim=True), lowest)
    return x.sum(dim=0, keepdim=True) / torch.tensor(float(x.shape[0]), dtype=x.dtype, device=x.device)


@register_layer("BatchPool")
class BatchPool(Layer):
    def parse(self, lp):
        need_blobs(lp, "BatchPool", (1, 2), 1, "features (, weights)")
        p = lp.batch_pool_param
        pool = p.PoolMethod.Name(p.pool)
        if pool == "STOCHASTIC" and len(lp.bottom) == 1:
            raise LayerError("batch_pool_param.pool STOCHASTIC is not implemented in the fork")
        return {"pool": pool}

    def infer(self, attrs, in_shapes):
        x = tuple(in_shapes[0])
        if not 1 <= len(x) <= 4:
            raise LayerError(f"BatchPool reads num/channels/height/width: 1 to 4 axes, got {list(x)}")
        if len(in_shapes) == 2 and count(in_shapes[1]) != x[0]:
            raise LayerError(f"BatchPool's weights {list(in_shapes[1])} must hold one value per item ({x[0]})")
        return [(1,) + x[1:]]

    def forward(self, attrs, params, x, weights=None):
        return batch_pool(x, weights, attrs["pool"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        shape = ctx.shape(x)
        if len(node.inputs) == 2:
            w = ctx.op("Reshape", [node.inputs[1], ctx.i64([shape[0]] + [1] * (len(shape) - 1))], "w", name=node.name)
            onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [w, x], "weighted"), [0], True, out=node.outputs[0])
        elif node.attrs["pool"] == "MAX":
            lowest = ctx.f32(-3.4028234663852886e38)
            finite = ctx.op("Where", [ctx.op("IsNaN", [x], "nan", name=node.name), lowest, x], "no_nan")
            ctx.add_node("Max", [onnx_reduce(ctx, "ReduceMax", finite, [0], True), lowest], [node.outputs[0]])
        else:
            total = onnx_reduce(ctx, "ReduceSum", x, [0], True)
            ctx.add_node("Div", [total, ctx.f32(float(shape[0]))], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        weights = emit.inputs[1] if len(emit.inputs) == 2 else "None"
        return f"{emit.helper(batch_pool)}({emit.inputs[0]}, {weights}, {node.attrs['pool']!r})"
