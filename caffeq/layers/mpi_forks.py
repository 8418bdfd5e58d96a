"""Layers of the MPI data-parallel Caffe forks: Lyp100208/Caffe_action (258cc36) and lxx1991/caffe_mpi
(356aa53), both from yjxiong's MPI branch; GPU builds (several CPU forwards are empty).  With one
process, their gathers are copies.

- Gather (gather_layer.cu): MPI_Gather of each bottom along axis 0 to rank 0; with one process every
  top is its bottom.  Several bottoms give as many tops.
- ConvolutionData (conv_data_layer.cu) and InnerProductAll (inner_product_all_layer.cu): BVLC's
  Convolution and InnerProduct (the latter after a gather), differing in their backward only.
- BNData: two forks under one name, told apart by their bn_param fields.
  Lyp100208's (bn_data_layer.cu; var_eps [1e-10], moving_average, decay [0.05]): with moving_average,
  y = ((x - mean) / pow(var + var_eps, 0.5)) x scale + shift with blobs scale, shift, mean, variance
  (1, C, 1, 1); without it the TEST forward uses the batch's statistics (not supported here).
  lxx1991's (eps [1e-5], momentum, slope_filler / bias_filler, moving_average): the same formula with eps;
  its TEST forward aborts in the fork (the base layer's buffers are never set up), so this is the form
  its working training path computes with moving_average and frozen rates.  Both are yjxiong's BN (the
  TSN form in segmentation.py) as far as inference goes.
- Warping, lxx1991's (warping_layer.cu; 2 bottoms, told apart from Garg's 3-bottom Warping): image
  (N, C, H, W) and flow (N, 2, H, W), x then y in pixels; each top pixel samples the image bilinearly at
  (x + fx, y + fy), each of the four corners' indices clamped into the image (so a point outside reads
  the border), the corners added in the order (y0, x0), (y1, x0), (y0, x1), (y1, x1) with the fork's
  float weights (1 - ((h - floor) + dy)) and so on.
"""
import numpy as np
import torch

from .conv import Convolution, InnerProduct
from .optical_flow import pixels_at
from .registry import AT_LEAST, Layer, LayerError, claim_layers, need_blobs, register_layer
from .segmentation import BN, TSN
from .warp_onnx import OnnxImageSampler


@register_layer("Gather")
class MpiGather(Layer):
    def parse(self, lp):
        need_blobs(lp, "Gather", range(1, AT_LEAST), None)
        if len(lp.top) != len(lp.bottom):
            raise LayerError(f"Gather (the MPI forks' gather) takes one top per bottom, got {len(lp.bottom)} "
                             f"bottom(s) and {len(lp.top)} top(s)")
        return {}

    def infer(self, attrs, in_shapes):
        return [tuple(s) for s in in_shapes]

    def forward(self, attrs, params, *xs):
        return xs[0] if len(xs) == 1 else tuple(xs)

    def onnx(self, ctx, node):
        for x, out in zip(node.inputs, node.outputs):
            ctx.add_node("Identity", [x], [out])

    def pytorch_source(self, node, emit):
        return emit.inputs[0] if len(emit.inputs) == 1 else list(emit.inputs)


@register_layer("ConvolutionData")
class ConvolutionData(Convolution):
    """Lyp100208's ConvolutionData: BVLC's Convolution in the forward."""


@register_layer("InnerProductAll")
class InnerProductAll(InnerProduct):
    """Lyp100208's InnerProductAll: BVLC's InnerProduct after a gather (one process: the bottom)."""


_LXX_FIELDS = ("slope_filler", "bias_filler", "momentum", "eps")


@register_layer("BNData")
class BNData(BN):
    def parse(self, lp):
        need_blobs(lp, "BNData", 1, 1)
        p = lp.bn_param
        lxx = any(p.HasField(f) for f in _LXX_FIELDS)
        if not p.moving_average:
            raise LayerError("BNData without bn_param.moving_average uses the batch's own statistics at TEST, "
                             "which caffeq does not support")
        if lxx:   # lxx1991/caffe_mpi: eps, momentum (the kept share of the history)
            eps, momentum = float(p.eps), float(p.momentum)
        else:     # Lyp100208/Caffe_action: var_eps, decay (the new batch's share)
            eps, momentum = float(p.var_eps), 1.0 - float(p.decay)
        if not eps >= 0:
            raise LayerError(f"BNData's epsilon must be >= 0, got {eps}")
        return {"variant": TSN, "eps": eps, "momentum": momentum, "frozen": False}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) > 4:
            raise LayerError(f"BNData reads num, channels, height and width: at most 4 axes, got {list(in_shapes[0])}")
        return super().infer(attrs, in_shapes)


def clamped_flow_warp(image, flow):
    """lxx1991's Warping: bilinear samples at (x + fx, y + fy), each corner index clamped into the image."""
    h, w = image.shape[2], image.shape[3]
    gy, gx = torch.meshgrid(torch.arange(h, dtype=image.dtype, device=image.device),
                            torch.arange(w, dtype=image.dtype, device=image.device), indexing="ij")
    dx, dy = flow[:, 0:1], flow[:, 1:2]
    y0, x0 = torch.floor(gy + dy), torch.floor(gx + dx)
    y0 = torch.where(torch.isnan(y0), torch.zeros_like(y0), y0)
    x0 = torch.where(torch.isnan(x0), torch.zeros_like(x0), x0)
    below, right = 1 - ((gy - y0) + dy), 1 - ((gx - x0) + dx)       # the weights of rows y0, columns x0
    above, left = 1 - ((y0 + 1 - gy) - dy), 1 - ((x0 + 1 - gx) - dx)   # rows y0 + 1, columns x0 + 1
    rows = [r.clamp(0, h - 1).long() for r in (y0, y0 + 1)]
    cols = [c.clamp(0, w - 1).long() for c in (x0, x0 + 1)]
    out = torch.zeros_like(image)
    for r, c, wy, wx in ((0, 0, below, right), (1, 0, above, right), (0, 1, below, left), (1, 1, above, left)):
        out = out + pixels_at(image, rows[r], cols[c]) * (wy * wx)
    return out


@claim_layers("Warping", lambda lp: len(lp.bottom) == 2)
class ClampedWarping(Layer):
    def parse(self, lp):
        need_blobs(lp, "Warping", 2, 1, "image, flow")
        return {}

    def infer(self, attrs, in_shapes):
        image, flow = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(image) != 4 or len(flow) != 4 or flow[1] != 2 or (flow[0],) + flow[2:] != (image[0],) + image[2:]:
            raise LayerError(f"Warping (lxx1991's) takes an image (N, C, H, W) and a flow (N, 2, H, W) of its N, H "
                             f"and W, got {list(image)} and {list(flow)}")
        return [image]

    def forward(self, attrs, params, image, flow):
        return clamped_flow_warp(image, flow)

    def onnx(self, ctx, node):
        image, flow = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        op, f32 = s.op, s.f32
        h, w = s.h, s.w
        gy, gx = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32), indexing="ij")
        gx, gy = ctx.const(gx.reshape(1, 1, h, w)), ctx.const(gy.reshape(1, 1, h, w))
        dx, dy = s.channel(flow, 0, "dx"), s.channel(flow, 1, "dy")

        def floor_of(g, d, hint):
            t = op("Floor", [op("Add", [g, d], hint + "_p")], hint + "_f")
            return op("Where", [op("IsNaN", [t], hint + "_nan"), f32(0), t], hint)
        y0, x0 = floor_of(gy, dy, "y0"), floor_of(gx, dx, "x0")
        y1, x1 = op("Add", [y0, f32(1)], "y1"), op("Add", [x0, f32(1)], "x1")
        below = op("Sub", [f32(1), op("Add", [op("Sub", [gy, y0], "gy0"), dy], "fy")], "below")
        right = op("Sub", [f32(1), op("Add", [op("Sub", [gx, x0], "gx0"), dx], "fx")], "right")
        above = op("Sub", [f32(1), op("Sub", [op("Sub", [y1, gy], "y1g"), dy], "gy1")], "above")
        left = op("Sub", [f32(1), op("Sub", [op("Sub", [x1, gx], "x1g"), dx], "gx1")], "left")

        def clamp(t, top, hint):
            return op("Min", [op("Max", [t, f32(0)], hint + "_lo"), f32(float(top))], hint)
        rows = [clamp(y0, h - 1, "r0"), clamp(y1, h - 1, "r1")]
        cols = [clamp(x0, w - 1, "c0"), clamp(x1, w - 1, "c1")]
        total = None
        for k, (r, c, wy, wx) in enumerate(((0, 0, below, right), (1, 0, above, right), (0, 1, below, left),
                                            (1, 1, above, left))):
            term = op("Mul", [s.pixels(rows[r], cols[c], f"v{k}"), op("Mul", [wy, wx], f"w{k}")], f"t{k}")
            total = term if total is None else op("Add", [total, term], f"s{k}")
        ctx.add_node("Identity", [total], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        return f"{emit.helper(clamped_flow_warp)}({emit.inputs[0]}, {emit.inputs[1]})"
