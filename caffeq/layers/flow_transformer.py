"""FlowTransformer: MotionNet's warp of an image by an optical flow, as bryanyzhu/Hidden-Two-Stream
(f7f684a; src/caffe/layers/flow_transformer_layer.cpp / .cu, include/caffe/flow_transformer_layer.hpp)
writes it: daerduoCarey's SpatialTransformer sampler with the affine grid replaced by pixel + flow.
No parameters.

Bottom 0 is the image U (N, C, H, W), bottom 1 the flow (N, 2, H, W) in pixels: channel 0 moves along
the columns, channel 1 along the rows.  The fork CHECKs that the flow has the image's H and W and adds
N * 2 * H * W of its values to its (N, 2, H, W) pixel grid, so caffeq asks for exactly that shape.
The top is (N, C, H, W).  Output pixel (s, t) reads the image at

    x = s + flow[n, 1, s, t]      (a row),      y = t + flow[n, 0, s, t]      (a column),

from the taps (m, k) = (floor x, floor y), (floor x + 1, floor y), (floor x, floor y + 1), (floor x + 1,
floor y + 1), added in that order to 0, each weighted (1 - (x - m0)) or (1 - (m1 - x)) times (1 - (y - k0))
or (1 - (k1 - y)) as the kernel writes them, in float32; a tap outside [0, H) x [0, W) adds nothing
(zero padding, no clamping, no normalisation).  The CPU and GPU forwards agree on all of this (the
CPU's max(0, 1 - |x - m|) factors are the same numbers); caffeq follows the GPU kernel
(FlowTransformerForwardGPU) where they part: a NaN coordinate turns into tap index 0 (CUDA's
float-to-int conversion), so the top is NaN wherever such a tap lands inside, where the CPU's x86
conversion would put it outside.  nvcc may contract `V += w * pixel` into a fused multiply-add;
caffeq rounds every product, as the CPU forward does (a last-bit difference at most).  ONNX gathers
the four taps (GatherElements): GridSample's normalised coordinates would not round the same way.
"""
import torch

from .optical_flow import bilinear_taps, pixels_at
from .registry import Layer, LayerError, count, four_axes, need_blobs, register_layer
from .warp_onnx import OnnxImageSampler


def flow_transform(image, flow):
    """The fork's FlowTransformer forward (its GPU kernel): taps at (row + flow 1, column + flow 0)."""
    h, w = image.shape[2], image.shape[3]
    rows = torch.arange(h, dtype=image.dtype, device=image.device).reshape(1, 1, h, 1)
    cols = torch.arange(w, dtype=image.dtype, device=image.device).reshape(1, 1, 1, w)
    x = rows + flow[:, 1:2]    # (N, 1, H, W): rows
    y = cols + flow[:, 0:1]    # columns
    return bilinear_taps(image, x, y, True)


@register_layer("FlowTransformer")
class FlowTransformer(Layer):
    def parse(self, lp):
        # the fork zeroes its top before reading the image: in place it would read zeros
        need_blobs(lp, "FlowTransformer", 2, 1, "image, flow", in_place=False)
        return {}

    def infer(self, attrs, in_shapes):
        image = four_axes(in_shapes[0], "FlowTransformer", "image (bottom 0)")
        flow = four_axes(in_shapes[1], "FlowTransformer", "flow (bottom 1)")
        if flow[0] != image[0] or flow[1] != 2 or flow[2:] != image[2:]:
            raise LayerError(f"FlowTransformer's flow (bottom 1) must be (N, 2, H, W) of the image's N, H and W: "
                             f"image {list(image)}, flow {list(flow)}")
        return [tuple(image)]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * 4

    def forward(self, attrs, params, image, flow):
        return flow_transform(image, flow)

    def onnx(self, ctx, node):
        image, flow = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        y, x = s.plus_pixel_grid(s.channel(flow, 0, "fy", name=node.name), s.channel(flow, 1, "fx"))
        s.cuda_taps(x, y, node.outputs[0])

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        emit.helper(bilinear_taps)
        return f"{emit.helper(flow_transform)}({emit.inputs[0]}, {emit.inputs[1]})"

