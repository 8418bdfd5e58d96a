"""tinghuiz/appearance-flow's Remap (b20a0dd, caffe/src/caffe/layers/remap_layer.cpp; no GPU code, so its
GPU forward runs this CPU one): bottoms the image (N, C, H0, W0) and coordinates (N, 2, H1, W1), channel 0
the column x and channel 1 the row y, in pixels; the top (N, C, H1, W1) samples the image bilinearly at
each (x, y), from (floor x, floor y) and the next column and row, a neighbour outside the image counting
0 (LiteFlowNet's coordinate Warp, optical_flow.coords_warp; the fork adds the four products in another
order, which moves only the last bit).
"""
from .optical_flow import coords_warp, pixels_at
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer
from .warp_onnx import OnnxImageSampler


@register_layer("Remap")
class Remap(Layer):
    def parse(self, lp):
        need_blobs(lp, "Remap", 2, 1, "image, coordinates")
        return {}

    def infer(self, attrs, in_shapes):
        image = four_axes(in_shapes[0], "Remap", "image (bottom 0)")
        coords = four_axes(in_shapes[1], "Remap", "coordinates (bottom 1)")
        if coords[0] != image[0] or coords[1] != 2:   # Reshape's CHECKs
            raise LayerError(f"Remap's coordinates {list(coords)} must be (N, 2, H, W) with the image's N = {image[0]}")
        return [(image[0], image[1], coords[2], coords[3])]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = out_shapes[0]
        return n * c * h * w * 4

    def forward(self, attrs, params, image, coords):
        return coords_warp(image, coords)

    def onnx(self, ctx, node):
        image, coords = node.inputs
        size = tuple(ctx.shape(coords)[2:])
        s = OnnxImageSampler(ctx, node.name, image)
        x, y = s.channel(coords, 0, "x", name=node.name), s.channel(coords, 1, "y")
        s.coords_warp(x, y, node.outputs[0], size)

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        return f"{emit.helper(coords_warp)}({emit.inputs[0]}, {emit.inputs[1]})"
