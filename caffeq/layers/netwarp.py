"""NetWarp's Warp (raghudeep/netwarp_public 1b84e43: caffe/src/caffe/layers/warp_layer.cpp and .cu,
caffe/include/caffe/layers/warp_layer.hpp, its WarpParameter in caffe/src/caffe/proto/caffe.proto).

The type name "Warp" is PWC-Net's too (optical_flow.py).  A Warp whose warp_param sets NetWarp's `outliers`,
or an empty warp_param block (PWC-Net's and LiteFlowNet's files write none; caffeq's own absolute_coords is a
field of it), is read here; one without warp_param stays PWC-Net's, which samples the same points by the same
rule as NetWarp's default TRUNCATE but adds the two middle bilinear terms in the other order (the last bit may
differ).  Nothing else tells them apart: a text file names the field (the fork's number 9003 only shows in
its binary files, whose layer parameters caffeq does not read the net from), and the fork's own nets set
`outliers: NEAREST` on every Warp.

- Warp (warp_param.outliers TRUNCATE [default] | NEAREST; caffeq declares it as field 2, the fork's 1 being
  caffeq's absolute_coords): bottoms image (N, C, H, W) and flow (N, 2, H, W), top (N, C, H, W).  Flow
  channel 0 moves along the width, channel 1 along the height: the top pixel (h, w) reads the image at
  row r = h + flow[1] and column s = w + flow[0] (float32 sums).  With r0 = floor(r), r1 = ceil(r),
  a = r - floor(r) (and s0, s1, b for the column), the top is
      ((((1 - a)(1 - b)) I(r0, s0) + (a (1 - b)) I(r1, s0)) + ((1 - a) b) I(r0, s1)) + (a b) I(r1, s1)
  summed in that order.  TRUNCATE: 0 where r lies outside [0, H - 1] or s outside [0, W - 1].  NEAREST: a
  row below 0 takes r0 = r1 = 0 and a = r; a row at or past H - 1 takes r0 = r1 = H - 1 and a = r - H
  (the second test after the first); columns likewise with W.  Both neighbours then being one pixel, the
  top is the border pixel's value up to rounding of the weights (which are kept as the fork computes them).
  This follows the CPU loop.  The CUDA kernels compute the same formula, but nvcc may fuse the products and
  sums into FMAs (the last bit), and their threads for the C channels of one pixel share the weight buffers,
  which the NEAREST kernel writes twice (the fraction, then the border weight): a race at the border.  A NaN
  flow reads outside the image on the CPU and gives 0 on the GPU (TRUNCATE): 0 here.
"""
import torch

from .optical_flow import pixels_at
from .registry import Layer, LayerError, claim_layers, four_axes, need_blobs
from .warp_onnx import OnnxImageSampler

TRUNCATE, NEAREST = 0, 1


def netwarp_warp(image, flow, nearest: bool):
    """NetWarp's Warp: image (N, C, H, W) sampled at (row + flow[:, 1], column + flow[:, 0])."""
    h, w = image.shape[2], image.shape[3]
    gy, gx = torch.meshgrid(torch.arange(h, dtype=image.dtype, device=image.device),
                            torch.arange(w, dtype=image.dtype, device=image.device), indexing="ij")
    row = gy + flow[:, 1:2]
    col = gx + flow[:, 0:1]
    r0, c0 = row.floor(), col.floor()
    r1, c1 = row.ceil(), col.ceil()
    a, b = row - r0, col - c0
    zero = torch.zeros_like(row)
    if nearest:
        below, above = row < 0, row >= h - 1
        a = torch.where(above, row - h, torch.where(below, row, a))
        r0 = torch.where(above, zero + (h - 1), torch.where(below, zero, r0))
        r1 = torch.where(above, zero + (h - 1), torch.where(below, zero, r1))
        left, right = col < 0, col >= w - 1
        b = torch.where(right, col - w, torch.where(left, col, b))
        c0 = torch.where(right, zero + (w - 1), torch.where(left, zero, c0))
        c1 = torch.where(right, zero + (w - 1), torch.where(left, zero, c1))
        inside = torch.ones_like(row, dtype=torch.bool)
    else:
        inside = (row >= 0) & (row <= h - 1) & (col >= 0) & (col <= w - 1)
        # read pixel (0, 0) where outside, so every index is valid; those results are replaced by 0
        r0, r1 = torch.where(inside, r0, zero), torch.where(inside, r1, zero)
        c0, c1 = torch.where(inside, c0, zero), torch.where(inside, c1, zero)
    na, nb = 1 - a, 1 - b
    r0, r1, c0, c1 = r0.long(), r1.long(), c0.long(), c1.long()
    warped = (na * nb * pixels_at(image, r0, c0) + a * nb * pixels_at(image, r1, c0)
              + na * b * pixels_at(image, r0, c1) + a * b * pixels_at(image, r1, c1))
    return torch.where(inside, warped, torch.zeros_like(warped))


@claim_layers("Warp", lambda lp: lp.warp_param.HasField("outliers")
              or (lp.HasField("warp_param") and not lp.warp_param.ListFields()))
class NetWarpWarp(Layer):
    def parse(self, lp):
        need_blobs(lp, "Warp", 2, 1, "image, flow")
        p = lp.warp_param
        if p.absolute_coords:
            raise LayerError("warp_param.outliers (NetWarp's Warp, a flow) and absolute_coords (LiteFlowNet's, "
                             "coordinates) cannot both be set")
        return {"nearest": p.outliers == NEAREST}

    def infer(self, attrs, in_shapes):
        image = four_axes(in_shapes[0], "Warp", "image")
        flow = four_axes(in_shapes[1], "Warp", "flow")
        if flow[0] != image[0] or flow[1] != 2 or flow[2:] != image[2:]:
            # the fork CHECKs H and W; its kernels read two flow channels per image of the batch
            raise LayerError(f"NetWarp's Warp needs a flow (N, 2, H, W) of the image's N, H and W: image "
                             f"{list(image)}, flow {list(flow)}")
        return [image]

    def forward(self, attrs, params, image, flow):
        return netwarp_warp(image, flow, attrs["nearest"])

    def onnx(self, ctx, node):
        image, flow = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        op, f32 = s.op, s.f32
        col, row = s.plus_pixel_grid(s.channel(flow, 0, "fx", name=node.name), s.channel(flow, 1, "fy"))
        r0, c0 = op("Floor", [row], "r0"), op("Floor", [col], "c0")
        r1, c1 = op("Ceil", [row], "r1"), op("Ceil", [col], "c1")
        a, b = op("Sub", [row, r0], "a"), op("Sub", [col, c0], "b")
        if node.attrs["nearest"]:
            def border(t, lo, hi, size, frac, hint):
                below = op("Less", [t, f32(0)], hint + "_below")
                above = op("GreaterOrEqual", [t, f32(size - 1)], hint + "_above")
                frac = op("Where", [above, op("Sub", [t, f32(size)], hint + "_past"),
                                    op("Where", [below, t, frac], hint + "_f0")], hint + "_frac")
                lo = op("Where", [above, f32(size - 1), op("Where", [below, f32(0), lo], hint + "_lo0")], hint + "_lo")
                hi = op("Where", [above, f32(size - 1), op("Where", [below, f32(0), hi], hint + "_hi0")], hint + "_hi")
                return lo, hi, frac

            r0, r1, a = border(row, r0, r1, s.h, a, "row")
            c0, c1, b = border(col, c0, c1, s.w, b, "col")
            inside = None
        else:
            inside = s.within(col, row, "inside", False)
            r0, r1 = op("Where", [inside, r0, f32(0)], "r0s"), op("Where", [inside, r1, f32(0)], "r1s")
            c0, c1 = op("Where", [inside, c0, f32(0)], "c0s"), op("Where", [inside, c1, f32(0)], "c1s")
        na, nb = op("Sub", [f32(1), a], "na"), op("Sub", [f32(1), b], "nb")
        total = s.weighted_sum([(r0, c0, na, nb), (r1, c0, a, nb), (r0, c1, na, b), (r1, c1, a, b)])
        if inside is None:
            ctx.add_node("Identity", [total], [node.outputs[0]])
        else:
            ctx.add_node("Where", [inside, total, f32(0)], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        return f"{emit.helper(netwarp_warp)}({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['nearest']})"


__all__ = ["NetWarpWarp", "netwarp_warp"]
