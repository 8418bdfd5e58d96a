"""daerduoCarey/mycaffe (28f9fe82) MaskTransformer: src/caffe/layers/mask_layer.cpp, mask_layer.cu,
include/caffe/mask_layer.hpp; mask_param.to_compute_dU (MaskTransformerParameter, 1 [true]; mask_param is
140 there, elu_param here: the field is MaskParameter.to_compute_dU = 106 in caffeq's shared mask_param).

Bottoms U (N, C, H, W; exactly 4 axes) and a mask m whose num is N and whose count(1) is H W (the fork's
CHECKs); the top is (N, C, H, W).  Per position, with the mask value v = m[n, h w]:
V = v U where 0 <= v <= 1, U where v > 1, 0 otherwise (v < 0 or NaN).  The GPU kernel does this on every
channel; the CPU forward writes channels 0-2 only (hard-coded), leaving the others 0 for C > 3 and writing
past the sample for C < 3.  Both agree for C = 3 (images, as in the fork's CUB nets); for other channel counts
caffeq runs the GPU kernel and says so in a reading note.  to_compute_dU only trains (read and ignored).
"""
import torch

from .registry import Layer, LayerError, count, four_axes, need_blobs, register_layer


def mask_transform(u, m):
    """The fork's MaskTransformer: m scales U where in [0, 1], passes U above 1, zeroes the rest."""
    m = m.reshape(u.shape[0], 1, u.shape[2], u.shape[3])
    inside = (m >= 0) & (m <= 1)
    return torch.where(inside, u * m, torch.where(m > 1, u, torch.zeros_like(u)))


@register_layer("MaskTransformer")
class MaskTransformer(Layer):
    def parse(self, lp):
        need_blobs(lp, "MaskTransformer", 2, 1, "U, mask")
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "MaskTransformer", "U (bottom 0)")
        m = tuple(in_shapes[1])
        if not m or m[0] != n or count(m, 1) != h * w:
            raise LayerError(f"MaskTransformer's mask {list(m)} must have U's num {n} and count(1) = H W = {h * w} "
                             f"(the fork's CHECKs)")
        if c != 3:
            attrs["reading_notes"] = [
                f"MaskTransformer on {c} channels: the fork's GPU kernel (run here) masks every channel; its CPU "
                f"forward masks channels 0-2 only ({'the others stay 0' if c > 3 else 'and writes past the sample'})"]
        return [(n, c, h, w)]

    def forward(self, attrs, params, u, m):
        return mask_transform(u, m)

    def onnx(self, ctx, node):
        u, m = node.inputs
        _, _, h, w = ctx.shape(u)
        m = ctx.op("Reshape", [m, ctx.i64([0, 1, h, w])], "mask", name=node.name)
        inside = ctx.op("And", [ctx.op("GreaterOrEqual", [m, ctx.f32(0.0)], "nonneg"),
                                ctx.op("LessOrEqual", [m, ctx.f32(1.0)], "at_most_one")], "inside")
        above = ctx.op("Where", [ctx.op("Greater", [m, ctx.f32(1.0)], "above_one"), u, ctx.f32(0.0)], "passed")
        ctx.add_node("Where", [inside, ctx.op("Mul", [u, m], "scaled"), above], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(mask_transform)}({emit.inputs[0]}, {emit.inputs[1]})"


__all__ = ["MaskTransformer", "mask_transform"]
