"""xueshengke/FNNSR and IFNNSR (14bfccd / 9a4853f, elementwise_product_layer.cpp/.cu; their super-resolution
nets): ElementWiseProduct, a learned weight (and bias) for every pixel.

Blobs (1, C / share, H, W): weight, then bias when bias_term, sized from the bottom when the net is set up
(so a net runs at the size it was trained at).  top[n, c, h, w] = x * W[c // share, h, w] (rounded to
float32) + B[c // share, h, w]: each plane serves `share` consecutive channels.  The top is the bottom's
shape; TRAIN and TEST compute the same.  torch, ONNX, model.py.
"""
import numpy as np
import torch
from torch import nn

from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources


class PixelWeights(nn.Module):
    """x times a (1, C / share, H, W) weight (plus a bias), each plane repeated over `share` channels."""

    def __init__(self, shape, share, bias=True):
        super().__init__()
        self.share = share
        self.weight = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None

    def forward(self, x):
        y = x * self.weight.repeat_interleave(self.share, dim=1)
        return y if self.bias is None else y + self.bias.repeat_interleave(self.share, dim=1)


TORCH_PIXEL_WEIGHTS = torch_sources(PixelWeights)


@register_layer("ElementWiseProduct")
class ElementWiseProduct(Layer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "ElementWiseProduct", 1, 1)
        p = lp.elementwise_product_param
        if p.share < 1:
            raise LayerError(f"elementwise_product_param.share must be >= 1, got {p.share}")
        return {"share": int(p.share), "bias_term": bool(p.bias_term)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "ElementWiseProduct")
        if attrs["share"] > c or c % attrs["share"]:
            raise LayerError(f"elementwise_product_param.share {attrs['share']} must divide the {c} channels "
                             f"(and be at most that many)")
        return [(n, c, h, w)]

    def param_shapes(self, attrs, in_shapes):
        _, c, h, w = in_shapes[0]
        shape = (1, c // attrs["share"], h, w)
        return [shape, shape] if attrs["bias_term"] else [shape]

    def forward(self, attrs, params, x):
        y = x * params[0].repeat_interleave(attrs["share"], dim=1)
        return y + params[1].repeat_interleave(attrs["share"], dim=1) if attrs["bias_term"] else y

    def pytorch_source(self, node, emit):
        shape = list(node.expected_param_shapes[0])
        m = emit.module(f"{emit.helper(TORCH_PIXEL_WEIGHTS)}({shape}, {node.attrs['share']}, "
                        f"bias={node.attrs['bias_term']})")
        emit.param("weight", 0)
        if node.attrs["bias_term"]:
            emit.param("bias", 1)
        return f"{m}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        a = node.attrs
        c = ctx.shape(node.inputs[0])[1]
        planes = ctx.i64(np.arange(c) // a["share"])

        def spread(i, hint):   # the (1, C / share, H, W) blob over the C channels
            return ctx.op("Gather", [ctx.weight(node, i), planes], hint, axis=1)

        if not a["bias_term"]:
            ctx.add_node("Mul", [node.inputs[0], spread(0, "weight")], [node.outputs[0]], name=node.name)
            return
        scaled = ctx.op("Mul", [node.inputs[0], spread(0, "weight")], "scaled")
        ctx.add_node("Add", [scaled, spread(1, "bias")], [node.outputs[0]], name=node.name)
