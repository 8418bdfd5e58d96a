"""R*CNN's MIL and Sum (gkioxari/RstarCNN, "Contextual Action Recognition with R*CNN"; its Caffe is
gkioxari/caffe-fast-rcnn 7048851, src/caffe/layers/mil_layer.cpp, sum_layer.cpp/.cu, both added in
eb2564a; mil_param in proto/README.md).

- MIL (mil_param { context_per_roi: K }, no default): one bottom of R * K rows, each roi's K context
  boxes in a row, to a (R, C, 1, 1) top, R = num // K (trailing rows left out), C = channels:
  top[i, k] = max over j < K of the bottom's flat element (i * K + j) * C + k.  The fork indexes
  the flat buffer with stride C whatever the bottom's height and width (its nets feed (R * K, C)
  InnerProduct scores), and so does caffeq.  There is no CUDA code: the GPU runs this CPU loop.
  K unset (0) makes Caffe divide by zero: refused here, as a bottom of fewer than K rows is (Caffe
  would give an empty top).
- Sum: the element-wise sum of its bottoms, shaped as bottom 0; Caffe checks that every bottom has
  bottom 0's count, channels, height and width (the legacy accessors: (R, C) and (R, C, 1, 1) may
  be summed, as R*CNN sums cls_score and the MIL top).  Its forward copies bottom 0 into the top and
  adds the others, so a top that is another bottom than the first would be overwritten before it is
  read: refused.

- MIL of the visual-concepts nets (s-gupta/visual-concepts 0e22363; its Caffe is s-gupta/caffe, branch
  mil, d65cdb9, mil_layer.cpp): a layer whose mil_param gives `type` or no context_per_roi.  One bottom
  (N, C, H, W) to a (N, C, 1, 1) top, over each map's H x W in row-major order: MAX the largest value
  (from -FLT_MAX); NOR the noisy-OR, max(1 - prod(1 - x), max x) in float32, the fork aborting on
  values outside [0, 1] (so does caffeq's forward).

Other forks reuse both names: a two-bottom, two-top MIL with mil_param.pool, a five-bottom WSL
MIL; textspotter's and synopsys-caffe's Sum reduce one bottom over an axis (sum_param).  Those
parameters are not in this schema, and a one-bottom Sum (R*CNN's copy, the others' reduction) is
refused as ambiguous.
"""
import numpy as np
import torch

from ..io.schema import caffe_pb2
from .misc import eager_checks
from .norm import onnx_reduce
from .registry import AT_LEAST, Layer, LayerError, legacy_nchw, need_blobs, register_layer


def rstar_mil(x, context_per_roi: int):
    """R*CNN's MIL: the max over each roi's context_per_roi rows of the flat bottom, read with stride
    C (x.shape[1]); num // context_per_roi rois -> (R, C, 1, 1)."""
    c = x.shape[1] if x.dim() > 1 else 1
    rois = x.shape[0] // context_per_roi
    flat = x.reshape(-1)[: rois * context_per_roi * c]
    return flat.reshape(rois, context_per_roi, c).amax(dim=1).reshape(rois, c, 1, 1)


def rstar_sum(*xs):
    """R*CNN's Sum: bottom 0 plus the others, each read in bottom 0's shape."""
    y = xs[0]
    for x in xs[1:]:
        y = y + x.reshape(xs[0].shape)
    return y


def map_mil(x, noisy_or: bool):
    """The visual-concepts MIL: per (n, c) the max, or the noisy-OR max(1 - prod(1 - x), max x), of the map."""
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    best = flat.amax(dim=2)
    if noisy_or:
        best = torch.maximum(1.0 - torch.prod(1.0 - flat, dim=2), best)
    return best.reshape(x.shape[0], x.shape[1], 1, 1)


def _mil_sizes(shape, k):
    """(rois, channels) of a MIL bottom, or a LayerError."""
    num, channels = legacy_nchw(shape, "MIL")[:2]
    if num < k:
        raise LayerError(f"MIL: the bottom's {num} rows are fewer than mil_param.context_per_roi {k} "
                         f"(Caffe would give an empty top), bottom {list(shape)}")
    return num // k, channels


@register_layer("MIL")
class RstarMIL(Layer):
    def parse(self, lp):
        need_blobs(lp, "MIL", 1, 1)
        p = lp.mil_param
        if p.HasField("type") or not p.HasField("context_per_roi"):   # the visual-concepts MIL
            return {"map_mil": True, "noisy_or": p.type == caffe_pb2.MILParameter.NOR}
        k = int(lp.mil_param.context_per_roi)
        if k < 1:
            raise LayerError("MIL needs mil_param.context_per_roi >= 1 (R*CNN's MIL, gkioxari/caffe-fast-rcnn: "
                             f"each roi's context boxes; unset, Caffe divides by zero), got {k}")
        return {"context_per_roi": k}

    def infer(self, attrs, in_shapes):
        if attrs.get("map_mil"):
            n, c = legacy_nchw(in_shapes[0], "MIL")[:2]
            return [(n, c, 1, 1)]
        rois, channels = _mil_sizes(in_shapes[0], attrs["context_per_roi"])
        return [(rois, channels, 1, 1)]

    def forward(self, attrs, params, x):
        if attrs.get("map_mil"):
            x = x.reshape(legacy_nchw(x.shape, "MIL"))
            if attrs["noisy_or"] and eager_checks() and bool(((x < 0) | (x > 1)).any()):
                raise LayerError("MIL NOR: the visual-concepts fork takes probabilities in [0, 1] (it aborts on "
                                 "others); put a Sigmoid before it")
            return map_mil(x, attrs["noisy_or"])
        return rstar_mil(x, attrs["context_per_roi"])

    def onnx(self, ctx, node):
        if node.attrs.get("map_mil"):
            x, name = node.inputs[0], node.name
            n, c, _h, _w = legacy_nchw(ctx.shape(x), "MIL")
            flat = ctx.add_node("Reshape", [x, ctx.i64([0, c, -1])], [ctx.tmp(name + "_maps")], name=name)[0]
            best = onnx_reduce(ctx, "ReduceMax", flat, [2], keepdims=True)
            if node.attrs["noisy_or"]:
                miss = onnx_reduce(ctx, "ReduceProd", ctx.op("Sub", [ctx.f32(1.0), flat], "miss_each"), [2], True)
                best = ctx.op("Max", [ctx.op("Sub", [ctx.f32(1.0), miss], "any"), best], "noisy_or")
            ctx.add_node("Reshape", [best, ctx.i64([0, c, 1, 1])], [node.outputs[0]])
            return
        x, name, k = node.inputs[0], node.name, node.attrs["context_per_roi"]
        shape = ctx.shape(x)
        rois, channels = _mil_sizes(shape, k)
        used = rois * k * channels
        if used != int(np.prod(shape)):     # trailing rows (or a spatial remainder) left out
            flat = ctx.add_node("Reshape", [x, ctx.const(np.array([-1], np.int64))], ctx.tmp(name + "_flat"))
            x = ctx.add_node("Slice", [flat, ctx.const(np.array([0], np.int64)),
                                       ctx.const(np.array([used], np.int64))], ctx.tmp(name + "_used"))
        grouped = ctx.add_node("Reshape", [x, ctx.const(np.array([rois, k, channels], np.int64))],
                               ctx.tmp(name + "_grouped"))
        best = onnx_reduce(ctx, "ReduceMax", grouped, [1], keepdims=False)
        ctx.add_node("Reshape", [best, ctx.const(np.array([rois, channels, 1, 1], np.int64))],
                     [node.outputs[0]], name=name)

    def pytorch_source(self, node, emit):
        if node.attrs.get("map_mil"):
            x4 = f"{emit.inputs[0]}.reshape({list(legacy_nchw(emit.in_shape(0), 'MIL'))})"
            return f"{emit.helper(map_mil)}({x4}, {node.attrs['noisy_or']})"
        return f"{emit.helper(rstar_mil)}({emit.inputs[0]}, {node.attrs['context_per_roi']})"


@register_layer("Sum")
class RstarSum(Layer):
    def parse(self, lp):
        need_blobs(lp, "Sum", range(1, AT_LEAST), 1)
        if len(lp.bottom) == 1:
            raise LayerError("a one-bottom Sum is ambiguous: R*CNN's (gkioxari/caffe-fast-rcnn) copies it, "
                             "textspotter's and synopsys-caffe's sum it over an axis; caffeq reads R*CNN's "
                             "element-wise sum of 2 or more bottoms")
        later = [i for i, b in enumerate(lp.bottom) if i and b == lp.top[0]]
        if later:
            raise LayerError(f"Sum cannot write its top over bottom {later[0]} ('{lp.top[0]}'): Caffe copies "
                             "bottom 0 into the top before adding the others")
        return {}

    def infer(self, attrs, in_shapes):
        first = legacy_nchw(in_shapes[0], "Sum")
        for i, shape in enumerate(in_shapes[1:], 1):
            if legacy_nchw(shape, "Sum") != first:
                raise LayerError(f"Sum's bottoms must have bottom 0's num, channels, height and width: "
                                 f"bottom {i} is {list(shape)}, bottom 0 {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, *xs):
        return rstar_sum(*xs)

    def onnx(self, ctx, node):
        target = ctx.shape(node.inputs[0])
        terms = [node.inputs[0]]
        for i, x in enumerate(node.inputs[1:], 1):
            if tuple(ctx.shape(x)) != tuple(target):
                x = ctx.add_node("Reshape", [x, ctx.const(np.array(target, np.int64))],
                                 ctx.tmp(f"{node.name}_in{i}"))
            terms.append(x)
        ctx.add_node("Sum", terms, [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(rstar_sum)}({', '.join(emit.inputs)})"
