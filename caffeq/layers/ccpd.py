"""yuqj1991/caffe_train's licence-plate reading (c7247801, detection_ccpd_output_layer.cpp).

DetectionCcpdOutput: seven bottoms, the class scores of a plate's characters (the province's Chinese
character, a Latin letter, then five letters or digits), and `lp_det_param` num_chinese, num_english,
num_letter.  Top (1, 1, N, 7), N the first bottom's num: row i holds, for each head, the index of
its best score among the num_k values that start at i * num_k in the bottom's memory (the fork's
pointer walk, whatever the bottom's own shape), as a float.  The fork's loop starts from a best
score of 0 and keeps the first strictly greater value, so a head whose scores are all <= 0 gives 0,
ties keep the lower index and NaN is never taken.
"""
import math

import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, need_blobs, register_layer

HEADS = ("chinese", "english", "letter", "letter", "letter", "letter", "letter")


def plate_characters(heads: list[torch.Tensor], sizes: list[int]):
    """The seven heads' best indices per image -> (1, 1, N, 7) (see the module docstring)."""
    num = heads[0].shape[0]
    picks = []
    for x, n in zip(heads, sizes):
        v = x.reshape(-1)[:num * n].reshape(num, n)
        v = torch.where(torch.isnan(v), torch.full_like(v, float("-inf")), v)
        best = torch.argmax(v, dim=1)     # the first of equal maxima
        positive = v.max(dim=1).values > 0
        picks.append(torch.where(positive, best, torch.zeros_like(best)).to(x.dtype))
    return torch.stack(picks, dim=1).reshape(1, 1, num, 7)


@register_layer("DetectionCcpdOutput")
class DetectionCcpdOutput(Layer):
    def parse(self, lp):
        need_blobs(lp, "DetectionCcpdOutput", 7, 1)
        p = lp.lp_det_param
        sizes = {}
        for field in ("num_chinese", "num_english", "num_letter"):
            if not p.HasField(field):
                raise LayerError(f"lp_det_param.{field} is required (the fork checks it)")
            if getattr(p, field) < 1:
                raise LayerError(f"lp_det_param.{field} must be >= 1, got {getattr(p, field)}")
            sizes[field] = int(getattr(p, field))
        return {"sizes": [sizes[f"num_{h}"] for h in HEADS]}

    def infer(self, attrs, in_shapes):
        num = in_shapes[0][0] if in_shapes[0] else 1
        for k, (shape, n) in enumerate(zip(in_shapes, attrs["sizes"])):
            if (shape[0] if shape else 1) != num:
                raise LayerError(f"bottom {k} {list(shape)} has another num than bottom 0's {num} (the fork checks "
                                 f"they agree)")
            if math.prod(shape) < num * n:
                raise LayerError(f"bottom {k} {list(shape)} holds fewer than {num} x {n} scores ({HEADS[k]} head): "
                                 f"the fork would read past its end")
        return [(1, 1, num, 7)]

    def forward(self, attrs, params, *heads):
        return plate_characters(list(heads), attrs["sizes"])

    def onnx(self, ctx, node):
        num = ctx.shape(node.inputs[0])[0]
        picks = []
        for k, (x, n) in enumerate(zip(node.inputs, node.attrs["sizes"])):
            flat = ctx.op("Reshape", [x, ctx.i64([-1])], f"flat{k}")
            v = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([num * n]), ctx.i64([0])], f"first{k}")
            v = ctx.op("Reshape", [v, ctx.i64([num, n])], f"scores{k}")
            v = ctx.op("Where", [ctx.op("IsNaN", [v], f"nan{k}"), ctx.f32(-np.inf), v], f"clean{k}")
            best = ctx.op("ArgMax", [v], f"best{k}", axis=1, keepdims=1, select_last_index=0)
            top = onnx_reduce(ctx, "ReduceMax", v, [1], True)
            positive = ctx.op("Greater", [top, ctx.f32(0.0)], f"positive{k}")
            best = ctx.op("Cast", [best], f"bestf{k}", to=1)
            picks.append(ctx.op("Where", [positive, best, ctx.f32(0.0)], f"pick{k}"))
        rows = ctx.op("Concat", picks, "rows", axis=1)
        ctx.add_node("Reshape", [rows, ctx.i64([1, 1, num, 7])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(plate_characters)}([{', '.join(emit.inputs)}], {emit.lit(node.attrs['sizes'])})"
