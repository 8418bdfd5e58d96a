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
Differences from the other warps here: optical_flow.coords_warp has the same taps and zero padding but
floors, reads channel 0 as x and lets NaN fall outside; hence its own sampler below (sharing pixels_at and
the ONNX sampler's pixel reads and bounds).
Not reproduced: a tap outside the image still occupies a CSR slot with weight 0 at one of the flat pixels
0..3, so where one of those four image values is NaN or inf the fork's 0 * value gives NaN there; caffeq
adds nothing for such a tap.
"""
import torch

from .optical_flow import pixels_at
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer
from .warp_onnx import OnnxImageSampler


def truncated_taps_warp(image, disp):
    """caffe_video_segmentation's FlowWarping (see the module docstring): disp channel 0 = rows."""
    n, c, h, w = image.shape
    gy, gx = torch.meshgrid(torch.arange(h, dtype=image.dtype, device=image.device),
                            torch.arange(w, dtype=image.dtype, device=image.device), indexing="ij")
    y = disp[:, 0:1] + gy
    x = disp[:, 1:2] + gx
    r = torch.where(torch.isnan(y), torch.zeros_like(y), y.trunc())
    q = torch.where(torch.isnan(x), torch.zeros_like(x), x.trunc())
    ry, rx = y - r, x - q
    ny, nx = 1 - ry, 1 - rx
    total = torch.zeros((n, c, h, w), dtype=image.dtype, device=image.device)
    for row, col, weight in ((r, q, ny * nx), (r, q + 1, ny * rx), (r + 1, q, ry * nx), (r + 1, q + 1, ry * rx)):
        inside = (row >= 0) & (row < h) & (col >= 0) & (col < w)
        safe_row = torch.where(inside, row, torch.zeros_like(row)).long()
        safe_col = torch.where(inside, col, torch.zeros_like(col)).long()
        term = weight * pixels_at(image, safe_row, safe_col)
        total = total + torch.where(inside, term, torch.zeros_like(term))
    return total


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
            toward_zero = op("Where", [op("Less", [t, f32(0)], hint + "_neg"), op("Ceil", [t], hint + "_ceil"),
                                       op("Floor", [t], hint + "_floor")], hint + "_trunc")
            return op("Where", [op("IsNaN", [t], hint + "_nan"), f32(0), toward_zero], hint)

        r, q = truncated(y, "r"), truncated(x, "c")
        ry, rx = op("Sub", [y, r], "ry"), op("Sub", [x, q], "rx")
        ny, nx = op("Sub", [f32(1), ry], "nry"), op("Sub", [f32(1), rx], "nrx")
        r1, q1 = op("Add", [r, f32(1)], "r1"), op("Add", [q, f32(1)], "c1")
        total = None
        for k, (row, col, wy, wx) in enumerate(((r, q, ny, nx), (r, q1, ny, rx), (r1, q, ry, nx), (r1, q1, ry, rx))):
            inside = s.within(col, row, f"in{k}", True)
            safe_col = op("Where", [inside, col, f32(0)], f"col{k}")
            safe_row = op("Where", [inside, row, f32(0)], f"row{k}")
            term = op("Mul", [op("Mul", [wy, wx], f"w{k}"), s.pixels(safe_row, safe_col, f"v{k}")], f"t{k}")
            term = op("Where", [inside, term, f32(0)], f"k{k}")
            total = term if total is None else op("Add", [total, term], f"s{k}")
        ctx.add_node("Identity", [total], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        return f"{emit.helper(truncated_taps_warp)}({emit.inputs[0]}, {emit.inputs[1]})"
