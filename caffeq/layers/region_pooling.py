"""gidariss/caffe_LocNet (0083b42, region_pooling_layer.cpp/.cu; LocNet and its bounding-box regression
nets): RegionPooling, Fast R-CNN's max pooling over a rectangle with a hole.

rois are (R, 9) = [batch, outer x0, y0, x1, y1, inner x0, y0, x1, y1] in 0-based input pixels (the fork
reads 9 values a row whatever the blob's shape says; (R, 9, 1, 1) as matcaffe feeds them).  Each corner
pair goes to map cells as start = floor(float32((x + 1 + offset) * spatial_scale) + 0.5) and
end = ceil(float32((x + 1 - offset) * spatial_scale) - 0.5); a start past its end makes both their mean,
C's division truncating toward zero.  The outer rectangle is cut into pooled_h x pooled_w bins as Fast
R-CNN's ROIPooling does (float32 bin sizes, floor / ceil, clipped to the map); each bin gives the maximum
of 0 and of its cells that are not strictly inside the inner rectangle (w > its start and < its end, h
likewise), so an empty bin, or one whose cells are all negative, gives 0.  The top is
(R, C, pooled_h, pooled_w); TRAIN and TEST compute the same; no blobs.  torch, model.py and ONNX (the bins
as masks, the hole's cells left out, and a Scan over the rois: roi_bins_onnx.py).
"""
import math

import numpy as np
import torch
from onnx import TensorProto

from .registry import LayerError, need_blobs, register_layer, torch_sources
from .roi_bins_onnx import (
    onnx_axis_bins,
    onnx_batch_column,
    onnx_finish_rois,
    onnx_hole_pieces,
    onnx_padded_rows,
    onnx_scan_bin_max,
    onnx_strictly_inside,
)
from .roi_pooling import TORCH_ROI_COMMON, RoiLayerSpec, bin_mask, pooled_grid_attrs


def region_cells(a, b, scale: float, offset: float):
    """One axis of a rectangle, input pixels a <= b, as map cells [start, end] (the fork's float32
    products, its +-0.5 in double, an inverted range collapsed to its truncated mean)."""
    f32 = torch.float32
    lo = (torch.tensor(a, dtype=f32) + 1 + torch.tensor(offset, dtype=f32)) * torch.tensor(scale, dtype=f32)
    hi = (torch.tensor(b, dtype=f32) + 1 - torch.tensor(offset, dtype=f32)) * torch.tensor(scale, dtype=f32)
    start, end = int(math.floor(float(lo) + 0.5)), int(math.ceil(float(hi) - 0.5))
    if start > end:
        start = end = int((start + end) / 2)
    return start, end


def region_bins(start: int, end: int, pooled: int, size: int):
    """Fast R-CNN's bins of [start, end] on an axis of `size` cells: (starts, ends), clipped to it."""
    f32 = torch.float32
    length = max(end - start + 1, 1)
    step = torch.tensor(float(length), dtype=f32) / torch.tensor(float(pooled), dtype=f32)
    starts = torch.floor(torch.arange(pooled, dtype=f32) * step).long() + start
    ends = torch.ceil(torch.arange(1, pooled + 1, dtype=f32) * step).long() + start
    return starts.clamp(0, size), ends.clamp(0, size)


def region_max_pool(x, rois, ph: int, pw: int, spatial_scale: float, offset: float):
    """RegionPooling -> (R, C, ph, pw)."""
    n, c, h, w = x.shape
    r = rois.detach().float().cpu().reshape(-1)
    if r.numel() % 9:
        raise ValueError(f"RegionPooling: rois must hold 9 values a row, got {list(rois.shape)}")
    r = r.reshape(-1, 9)
    zero = torch.zeros((), device=x.device, dtype=x.dtype)
    outs = []
    for roi in r.tolist():
        b = int(roi[0])
        if not 0 <= b < n:
            raise ValueError(f"RegionPooling: roi batch index {b} is outside the batch of {n}")
        sw, ew = region_cells(roi[1], roi[3], spatial_scale, offset)
        sh, eh = region_cells(roi[2], roi[4], spatial_scale, offset)
        sw_in, ew_in = region_cells(roi[5], roi[7], spatial_scale, offset)
        sh_in, eh_in = region_cells(roi[6], roi[8], spatial_scale, offset)
        hole = ((torch.arange(h) > sh_in) & (torch.arange(h) < eh_in))[:, None] & \
            ((torch.arange(w) > sw_in) & (torch.arange(w) < ew_in))[None, :]
        # the maximum starts from 0: a cell of the hole may as well read 0
        plane = torch.where(hole.to(x.device), zero, x[b]).clamp(min=0)   # (C, H, W)
        hs, he = region_bins(sh, eh, ph, h)
        ws, we = region_bins(sw, ew, pw, w)
        mw = bin_mask(ws, we, w).to(x.device)     # (pw, W)
        mh = bin_mask(hs, he, h).to(x.device)     # (ph, H)
        cols = torch.where(mw[None, None], plane[:, :, None, :], zero).amax(-1)      # (C, H, pw)
        outs.append(torch.where(mh[None, :, :, None], cols[:, None, :, :], zero).amax(2))   # (C, ph, pw)
    if not outs:
        return x.new_zeros((0, c, ph, pw))
    return torch.stack(outs)


TORCH_REGION_POOLING = torch_sources(region_cells, region_bins, region_max_pool)


@register_layer("RegionPooling")
class RegionPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(region_max_pool), TORCH_REGION_POOLING
    roi_helpers = (TORCH_ROI_COMMON,)

    def parse(self, lp):
        need_blobs(lp, "RegionPooling", 2, 1, roles="data, rois")
        p = lp.region_pooling_param
        attrs = pooled_grid_attrs(p, "region_pooling_param")
        if not math.isfinite(p.offset):
            raise LayerError(f"region_pooling_param.offset must be a finite number, got {p.offset}")
        return dict(attrs, offset=float(p.offset))

    def infer(self, attrs, in_shapes):
        s, r = in_shapes
        if len(s) != 4:
            raise LayerError(f"RegionPooling needs a 4-axis input, got {list(s)}")
        if not r or math.prod(r[1:]) != 9:
            raise LayerError(f"RegionPooling: rois must be (R, 9) = [batch, outer x0, y0, x1, y1, inner x0, y0, "
                             f"x1, y1], got {list(r)}")
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"], attrs["scale"], attrs["offset"]), {}

    def onnx(self, ctx, node):
        emit_region_pooling(ctx, node)


def _onnx_region_cells(ctx, rows, lo_column, scale, offset):
    """region_cells of every roi: the (R, 1) float32 start and end cells of rois' columns lo_column and
    lo_column + 2 (float32 products, the +-0.5 in double, an inverted range collapsed to its truncated mean)."""
    op, f64 = ctx.op, TensorProto.DOUBLE

    def column(k):
        return op("Slice", [rows, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], "col")
    step = ctx.f32(float(np.float32(scale)))
    lo = op("Mul", [op("Add", [op("Add", [column(lo_column), ctx.f32(1.0)], "a1"), ctx.f32(offset)], "ao"), step], "lo")
    hi = op("Mul", [op("Sub", [op("Add", [column(lo_column + 2), ctx.f32(1.0)], "b1"), ctx.f32(offset)], "bo"),
                    step], "hi")
    half = ctx.const(np.array(0.5, np.float64))
    start = op("Floor", [op("Add", [op("Cast", [lo], "lod", to=f64), half], "lo5")], "start")
    end = op("Ceil", [op("Sub", [op("Cast", [hi], "hid", to=f64), half], "hi5")], "end")
    mean = op("Div", [op("Add", [start, end], "se"), ctx.const(np.array(2.0, np.float64))], "mean")
    mean = ctx.trunc(mean, "mean_t")
    inverted = op("Greater", [start, end], "inverted")
    return [op("Cast", [op("Where", [inverted, mean, v], "cell")], "cellf", to=TensorProto.FLOAT) for v in (start, end)]


def emit_region_pooling(ctx, node):
    """RegionPooling in ONNX: the outer rectangle's Fast R-CNN bins less the inner rectangle's cells
    (roi_bins_onnx.py), maxima from 0."""
    a = node.attrs
    x, rois = node.inputs
    _, _, h, w = ctx.shape(x)
    rows, count = onnx_padded_rows(ctx, rois, 9)
    batch, inside = onnx_batch_column(ctx, rows, ctx.shape(x)[0])

    def cells(column):
        return _onnx_region_cells(ctx, rows, column, a["scale"], a["offset"])
    mh, _, _ = onnx_axis_bins(ctx, *cells(2), a["ph"], h)
    mw, _, _ = onnx_axis_bins(ctx, *cells(1), a["pw"], w)
    pieces = onnx_hole_pieces(ctx, mh, mw, onnx_strictly_inside(ctx, *cells(6), h),
                              onnx_strictly_inside(ctx, *cells(5), w))
    outside = ctx.op("Reshape", [ctx.op("Not", [inside], "b_out"), ctx.i64([-1, 1, 1, 1])], "b_out4")
    onnx_finish_rois(ctx, node, onnx_scan_bin_max(ctx, node, x, batch, pieces, a["ph"], a["pw"], 0.0), count, outside)
