"""He-Zhenwei/MAF's Caffe (92c84ea caffe-fast-rcnn, built on person_search's; its domain-adaptive Faster
R-CNN training nets): Enlarge and InnerProductCLS.

- Enlarge (enlarge_layer.cu; enlarge_param.scale s, default 2, > 1): space to depth over a 4-axis bottom,
  top (N, C s^2, H // s, W // s) with top[n, c s^2 + dy s + dx, h, w] = bottom[n, c, h s + dy, w s + dx]; the
  last H mod s rows and W mod s columns are never read.  The GPU kernel is followed: the fork's Forward_cpu
  loops on the wrong index and writes a single column.
- InnerProductCLS (inner_product_cls_layer.cpp): InnerProduct (inner_product_param, the same blobs) with a
  second top, a copy of the weight blob as stored, which the fork's training nets feed to a weight loss.
"""
import copy

from .caffe_plus import onnx_space_to_depth_crd, space_to_depth_crd
from .conv import InnerProduct
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer


def maf_enlarge(x, scale: int):
    """Space to depth of the whole s x s blocks (the rest cropped), channel c s^2 + dy s + dx."""
    h, w = x.shape[2] // scale * scale, x.shape[3] // scale * scale
    return space_to_depth_crd(x[:, :, :h, :w], scale)


@register_layer("Enlarge")
class Enlarge(Layer):
    def parse(self, lp):
        need_blobs(lp, "Enlarge", 1, 1)
        scale = int(lp.enlarge_param.scale)
        if scale <= 1:
            raise LayerError(f"enlarge_param.scale must be > 1, got {scale}")
        return {"scale": scale}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Enlarge")
        s = attrs["scale"]
        return [(n, c * s * s, h // s, w // s)]

    def forward(self, attrs, params, x):
        return maf_enlarge(x, attrs["scale"])

    def onnx(self, ctx, node):
        x, s, name = node.inputs[0], node.attrs["scale"], node.name
        n, c, h, w = ctx.shape(x)
        whole = (n, c, h // s * s, w // s * s)
        if whole != (n, c, h, w):
            x = ctx.op("Slice", [x, ctx.i64([0, 0]), ctx.i64(list(whole[2:])), ctx.i64([2, 3])], "whole")
        onnx_space_to_depth_crd(ctx, name, x, node.outputs[0], s, shape=whole)

    def pytorch_source(self, node, emit):
        emit.helper(space_to_depth_crd)
        return f"{emit.helper(maf_enlarge)}({emit.inputs[0]}, {node.attrs['scale']})"


@register_layer("InnerProductCLS")
class InnerProductCLS(InnerProduct):
    """InnerProduct's top, then the weight blob as stored."""

    def parse(self, lp):
        need_blobs(lp, "InnerProductCLS", 1, 2, roles="data; product, weight copy")
        attrs = super().parse(lp)
        if attrs["normalize"]:
            raise LayerError("InnerProductCLS reads no inner_product_param.normalize")
        return attrs

    def infer(self, attrs, in_shapes):
        return super().infer(attrs, in_shapes) + [self.param_shapes(attrs, in_shapes)[0]]

    def forward(self, attrs, params, x):
        return super().forward(attrs, params, x), params[0].clone()

    def onnx(self, ctx, node):
        product = copy.copy(node)
        product.outputs = node.outputs[:1]
        super().onnx(ctx, product)
        ctx.add_node("Identity", [ctx.weight(node, 0)], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        product = super().pytorch_source(node, emit)
        weight = f"self.{emit.attr}.weight"
        return [product, f"{weight}.t().clone()" if node.attrs["transpose"] else f"{weight}.clone()"]


__all__ = ["Enlarge", "InnerProductCLS", "maf_enlarge"]
