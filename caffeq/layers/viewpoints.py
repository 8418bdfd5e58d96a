"""shubhtuls/ViewpointsAndKeypoints' Caffe (external/caffe 1d57050): MASK_OUTPUTS (V1 files; MaskOutputs
here), which keeps each sample's block of mask_outputs_param.kernel_size channels that its label picks:
scores (N, C, H, W) and labels (N values) give (N, K, H, W), top[n] = scores[n, label K : label K + K].  The
fork checks neither the label's range nor that C is a multiple of K: a label outside the blocks is refused
when the net runs.
"""
import torch

from ..errors import DataError
from .registry import Layer, LayerError, count, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def class_block(scores, labels, width: int):
    """Each sample's `width` channels from channel label * width on."""
    n, c = scores.shape[:2]
    blocks = c // width
    picked = labels.reshape(-1)[:n].to(torch.long)
    if bool(((picked < 0) | (picked >= blocks)).any()):
        raise ValueError(f"a label outside the {blocks} blocks of {width} channels")
    grouped = scores.reshape((n, blocks, width) + tuple(scores.shape[2:]))
    return grouped[torch.arange(n, device=scores.device), picked]


@register_layer("MaskOutputs")
class MaskOutputs(Layer):
    def parse(self, lp):
        need_blobs(lp, "MaskOutputs", 2, 1, roles="scores, labels")
        width = int(lp.mask_outputs_param.kernel_size)
        if width < 1:
            raise LayerError("MaskOutputs needs mask_outputs_param.kernel_size >= 1 (the fork has no default)")
        return {"width": width}

    def infer(self, attrs, in_shapes):
        s, labels = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(s) < 2 or s[1] % attrs["width"]:
            raise LayerError(f"MaskOutputs' channels must hold whole blocks of kernel_size {attrs['width']}, "
                             f"got {list(s)}")
        if count(labels) < s[0]:
            raise LayerError(f"MaskOutputs reads one label per sample: {list(labels)} holds fewer than {s[0]}")
        return [(s[0], attrs["width"]) + s[2:]]

    def forward(self, attrs, params, scores, labels):
        try:
            return class_block(scores, labels, attrs["width"])
        except ValueError as e:
            raise DataError(f"MaskOutputs: {e} (the fork would read outside the scores)") from None

    def onnx(self, ctx, node):
        scores, labels = node.inputs
        shape = list(ctx.shape(scores))
        n, width = shape[0], node.attrs["width"]
        grouped = ctx.op("Reshape", [scores, ctx.i64([n, shape[1] // width, width] + shape[2:])], "grouped")
        flat = ctx.op("Reshape", [labels, ctx.i64([-1])], "labels_flat")
        picked = ctx.op("Cast", [ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([n]), ctx.i64([0])], "labels_n")],
                        "picked", to=7)
        # ONNX counts a negative index from the end; the fork's reads fall outside: make them out of range
        blocks = shape[1] // width
        inside = ctx.op("Where", [ctx.op("Less", [picked, ctx.i64(0)], "negative"), ctx.i64(blocks), picked], "inside")
        index = ctx.op("Reshape", [inside, ctx.i64([n, 1] + [1] * (len(shape) - 1))], "index")
        chosen = ctx.op("GatherElements", [grouped, ctx.op("Expand", [index, ctx.i64([n, 1, width] + shape[2:])],
                                                                  "index_full")], "chosen", axis=1)
        ctx.add_node("Reshape", [chosen, ctx.i64([n, width] + shape[2:])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(class_block)}({', '.join(emit.inputs)}, {node.attrs['width']})"
