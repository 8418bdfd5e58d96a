"""FlowWarping of AmirooR/caffe_video_segmentation (f991df5; src/caffe/layers/flow_warping_layer.cpp / .cu,
include/caffe/flow_warp_layers.hpp).  No parameters (the fork's caffe.proto adds none for it); the fork has
only a GPU forward (Forward_cpu is NOT_IMPLEMENTED); this is it.

Bottoms (image (N, C, H, W), displacement (N, 2, H, W)); top the image's shape.  The displacement's
channel 0 moves rows, channel 1 columns (the reverse of FlowNet2's FlowWarp, whose channel 0 is x).  Per
output pixel (i, j), in float32: y = d0 + i, x = d1 + j, r = (int) y, c = (int) x -- truncated toward 0, not
floored (a NaN converts to 0, CUDA's float-to-int), ry = y - r, rx = x - c (negative for a coordinate in
(-1, 0), which then extrapolates from row or column 0).  The kernel builds a sparse row of the four taps
    (r, c) (1 - ry)(1 - rx), (r, c + 1) (1 - ry) rx, (r + 1, c) ry (1 - rx), (r + 1, c + 1) ry rx
and cuSPARSE multiplies the image by it: every channel gets the sum of the taps that lie inside the image;
a tap outside adds nothing (zero padding, each tap on its own, so the out-of-image value is 0).
Differences from the other warps here: optical_flow.coords_warp has the same taps, sum order and zero
padding but floors and reads channel 0 as x; this layer swaps the channels and asks it to truncate (in
torch, model.py and the ONNX sampler alike).
Not reproduced: a tap outside the image still occupies a CSR slot with weight 0 at one of the flat pixels
0..3, so where one of those four image values is NaN or inf the fork's 0 * value gives NaN there; caffeq
adds nothing for such a tap.
"""
import torch

from .optical_flow import coords_warp, pixels_at
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer
from .warp_onnx import OnnxImageSampler


def truncated_taps_warp(image, disp):
    """caffe_video_segmentation's FlowWarping (see the module docstring): disp channel 0 = rows."""
    h, w = image.shape[2:]
    gy, gx = torch.meshgrid(torch.arange(h, dtype=image.dtype, device=image.device),
                            torch.arange(w, dtype=image.dtype, device=image.device), indexing="ij")
    return coords_warp(image, torch.cat([disp[:, 1:2] + gx, disp[:, 0:1] + gy], 1), True)


@register_layer("FlowWarping")
class VideoSegFlowWarping(Layer):
    def parse(self, lp):
        need_blobs(lp, "FlowWarping", 2, 1, "image, displacement")
        return {}

    def infer(self, attrs, in_shapes):
        image = four_axes(in_shapes[0], "FlowWarping", "image")
        disp = tuple(in_shapes[1])
        if len(disp) != 4 or disp[0] != image[0] or disp[1] != 2 or disp[2:] != tuple(image[2:]):
            raise LayerError(f"FlowWarping's displacement must be (N, 2, H, W) of the image's N, H and W "
                             f"(the kernel reads 2 H W values per item): image {list(image)}, displacement "
                             f"{list(disp)}")
        return [tuple(image)]

    def forward(self, attrs, params, image, disp):
        return truncated_taps_warp(image, disp)

    def onnx(self, ctx, node):
        image, disp = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        op, f32 = s.op, s.f32
        x, y = s.plus_pixel_grid(s.channel(disp, 1, "dx", name=node.name), s.channel(disp, 0, "dy"))

        def truncated(t, hint):
            """C's (int) cast: toward zero, NaN to 0 (as CUDA converts it)."""
            toward_zero = op("Where", [op("Less", [t, f32(0)], hint + "_neg"), op("Ceil", [t], hint + "_ceil"),
                                       op("Floor", [t], hint + "_floor")], hint + "_trunc")
            return op("Where", [op("IsNaN", [t], hint + "_nan"), f32(0), toward_zero], hint)

        s.coords_warp(x, y, node.outputs[0], cell=truncated)

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        emit.helper(coords_warp)
        return f"{emit.helper(truncated_taps_warp)}({emit.inputs[0]}, {emit.inputs[1]})"
