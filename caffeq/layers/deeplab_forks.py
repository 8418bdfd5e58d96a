"""DeepLab v2 fork layers: SpatialProduct (Liang-Chieh Chen's, the attention-to-scale models; as
Kinpzz/deeplab-v2 d90d609 carries it) and that fork's VisualSaliency writer.

SpatialProduct multiplies every channel of an N x C x H x W blob by an N x 1 x H x W map
(spatial_product_layer.cpp: caffe_mul per channel), the attention weight of one scale's scores.
VisualSaliency saves a saliency map as images every few TEST iterations and BinaryPngWrite its bottoms as
binary PNG masks (binary_png_write_layer.cpp, one file per list name); neither has tops: nothing to compute
at inference.
"""
from .common import Sink
from .registry import Layer, LayerError, four_axes, register_layer


def spatial_product(x, weights):
    """x (N, C, H, W) times the (N, 1, H, W) map, every channel alike."""
    return x * weights


@register_layer("SpatialProduct")
class SpatialProduct(Layer):
    bottoms, tops, bottom_roles = 2, 1, "data, one-channel map"

    def infer(self, attrs, in_shapes):
        x, m = in_shapes
        four_axes(x, "SpatialProduct")
        four_axes(m, "SpatialProduct", "map")
        if m[1] != 1:
            raise LayerError(f"the map (bottom 1) must have one channel, got {list(m)}")
        if (m[0], m[2], m[3]) != (x[0], x[2], x[3]):
            raise LayerError(f"the map {list(m)} must match the data {list(x)} in num, height and width")
        return [tuple(x)]

    def forward(self, attrs, params, x, weights):
        return spatial_product(x, weights)

    def onnx(self, ctx, node):
        # ONNX's Mul broadcasts the one-channel map over the channels as torch does
        ctx.add_node("Mul", list(node.inputs), [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(spatial_product)}({emit.inputs[0]}, {emit.inputs[1]})"


@register_layer("VisualSaliency", "BinaryPngWrite")
class VisualSaliency(Sink):
    bottoms, tops = 1, 0
