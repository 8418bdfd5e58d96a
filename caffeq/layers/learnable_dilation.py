"""SSAW14/LearnableDilationNetwork's layers (4838c44, caffe-dynamic-dilation/src/caffe/layers).

- Truncation (truncation_layer.cpp, a NeuronLayer): y = min(max(x, truncation_min), truncation_max),
  the bounds floats (defaults 0 and 1).  With min > max every value becomes max, as that order gives.
- Duplicate (duplicate_layer.cu): top (N, C, int(height), int(width)), N and C those of the bottom at
  setup; top[n, c, h, w] = bottom's flat element n * C + c (the first N * C values of the bottom; for the
  (N, C, 1, 1) maps the network feeds it, each channel's value spread over the plane).  This is the GPU
  forward the network trains and tests with; the fork's CPU forward is an empty function (its loop is
  commented out), which would leave the top's memory as it was (zeros on a fresh net): caffeq computes
  the GPU's values.  height and width are floats in the proto, converted to int (truncation).
"""
import numpy as np
import torch

from .registry import Layer, LayerError, count, need_blobs, register_layer


def truncation(x, lo: float, hi: float):
    return torch.minimum(torch.maximum(x, torch.tensor(lo, dtype=x.dtype, device=x.device)),
                         torch.tensor(hi, dtype=x.dtype, device=x.device))


@register_layer("Truncation")
class Truncation(Layer):
    def parse(self, lp):
        need_blobs(lp, "Truncation", 1, 1)
        p = lp.truncation_param
        return {"min": float(np.float32(p.truncation_min)), "max": float(np.float32(p.truncation_max))}

    def forward(self, attrs, params, x):
        return truncation(x, attrs["min"], attrs["max"])

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        low = ctx.add_node("Max", [node.inputs[0], ctx.const(np.array(a["min"], np.float32), name + "_min")],
                           ctx.tmp(name + "_low"), name=name)
        ctx.add_node("Min", [low, ctx.const(np.array(a["max"], np.float32), name + "_max")], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(truncation)}({emit.inputs[0]}, {emit.lit(a['min'])}, {emit.lit(a['max'])})"


def duplicate(x, h: int, w: int):
    n = x.shape[0] if x.dim() > 0 else 1
    c = x.shape[1] if x.dim() > 1 else 1
    return x.reshape(-1)[:n * c].reshape(n, c, 1, 1).expand(n, c, h, w).contiguous()


def _legacy_nc(shape):
    """Blob::num() and channels(): the first two axes, 1 where the blob has fewer."""
    if len(shape) > 4:
        raise LayerError(f"Duplicate reads num() and channels(), which need a blob of at most 4 axes, "
                         f"got {list(shape)}")
    padded = tuple(shape) + (1,) * (2 - len(shape))
    return int(padded[0]), int(padded[1])


@register_layer("Duplicate")
class Duplicate(Layer):
    def parse(self, lp):
        need_blobs(lp, "Duplicate", 1, 1)
        p = lp.duplicate_param
        h, w = int(np.float32(p.height)), int(np.float32(p.width))   # float -> int, as the layer stores them
        if h < 1 or w < 1:
            raise LayerError(f"duplicate_param.height and width must be >= 1, got {p.height:g} and {p.width:g}")
        return {"height": h, "width": w}

    def infer(self, attrs, in_shapes):
        n, c = _legacy_nc(in_shapes[0])
        if count(in_shapes[0]) < n * c:   # only an empty blob: num() * channels() <= count()
            raise LayerError(f"Duplicate reads num x channels values, more than {list(in_shapes[0])} holds")
        return [(n, c, attrs["height"], attrs["width"])]

    def forward(self, attrs, params, x):
        return duplicate(x, attrs["height"], attrs["width"])

    def onnx(self, ctx, node):
        n, c = _legacy_nc(ctx.shape(node.inputs[0]))
        name = node.name
        flat = ctx.add_node("Reshape", [node.inputs[0], ctx.i64([-1])], ctx.tmp(name + "_flat"), name=name)
        head = ctx.add_node("Slice", [flat, ctx.i64([0]), ctx.i64([n * c]), ctx.i64([0])], ctx.tmp(name + "_head"))
        nc = ctx.add_node("Reshape", [head, ctx.i64([n, c, 1, 1])], ctx.tmp(name + "_nc"))
        ctx.add_node("Expand", [nc, ctx.i64([n, c, node.attrs["height"], node.attrs["width"]])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(duplicate)}({emit.inputs[0]}, {a['height']}, {a['width']})"
