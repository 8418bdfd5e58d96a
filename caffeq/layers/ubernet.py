"""jkokkin/UberNet's Caffe (b33344d, caffe-fast-rcnn: py-faster-rcnn's caffe-fast-rcnn with Iasonas
Kokkinos' changes): ROIPooling with roi_pooling_param `is_rich` and `bb_type`, as its GPU kernel computes it
(src/caffe/layers/roi_pooling_layer.cu, ROIPoolForward; the fork's CPU forward ignores both fields, and its
README says the net does not run on the CPU).

- is_rich (any non-zero value): each bin's maximum visits every second row and column, from the bin's own
  clipped start: the cells of an atrous conv5 that runs at stride 8 where the boxes were drawn for 16.
- bb_type (a float field the layer keeps in an int: truncated): Gidaris and Komodakis' region types.
  0 the box; 1 / 2 its left / right half and 3 / 4 its upper / lower half (the centre (x1 + x2) / 2 replaces
  one corner); 5 the box scaled by 0.5 about its centre; 6 / 7 / 8 / 9 the box scaled by 0.8 / 1.0 / 1.5 /
  1.8 with a hole scaled by 0.3 / 0.5 / 0.8 / 1.0, whose cells strictly inside the hole's rounded corners are
  skipped (a bin of only such cells gives -FLT_MAX, as the kernel's running maximum starts there).  Any other
  value pools the box.  Scaled corners are centre -/+ scale x half-size in float32, each product rounded
  (a CUDA build may fuse them into one fma; the fork's nets use 0).
The rest is Fast R-CNN's ROIPooling (roi_pooling.py): C-rounded corners times spatial_scale, float32 bin
sizes, bins clipped to the map, 0 for an empty bin.

ONNX: the bins as masks and a Scan over the rois (roi_bins_onnx.py).
"""
import numpy as np
import torch
from onnx import TensorProto

from .c_numerics import c_round, onnx_c_round
from .registry import LayerError, claim_layers, torch_sources
from .roi_bins_onnx import (
    onnx_axis_bins,
    onnx_batch_column,
    onnx_empty_bins,
    onnx_finish_rois,
    onnx_hole_pieces,
    onnx_padded_rows,
    onnx_scan_bin_max,
    onnx_strictly_inside,
)
from .roi_pooling import (
    TORCH_ROI_POOLING,
    ROIPooling,
    fast_rcnn_bin_values,
    fast_rcnn_bins,
    masked_bin_max,
    roi_batch_index,
    roi_pooling_attrs,
    roi_rows,
)

FLT_MAX = 3.4028234663852886e38


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------

def scaled_corners(r, scale: float):
    """(R, 4) float32 [x1, y1, x2, y2]: each roi row's box scaled by `scale` about its centre, as the
    kernel's float arithmetic (centre and half-size exact, then centre -/+ scale x half-size)."""
    f32 = torch.float32
    x1, y1, x2, y2 = r[:, 1], r[:, 2], r[:, 3], r[:, 4]
    s = torch.tensor(scale, dtype=f32)
    cw, ch = (x1 + x2) / 2, (y1 + y2) / 2
    hw, hh = (x2 - x1) / 2, (y2 - y1) / 2
    return torch.stack([cw - s * hw, ch - s * hh, cw + s * hw, ch + s * hh], 1)


def ubernet_region(bb_type: int):
    """Region type bb_type as (the roi row's column that the centre replaces and the centre's axis (0 x,
    1 y), or None; the pooled box's scale about its centre; the hole's scale, or None)."""
    halves = {1: (3, 0), 2: (1, 0), 3: (4, 1), 4: (2, 1)}         # left, right, upper, lower half
    scaled = {5: (0.5, None), 6: (0.8, 0.3), 7: (1.0, 0.5), 8: (1.5, 0.8), 9: (1.8, 1.0)}
    outer, inner = scaled.get(bb_type, (1.0, None))
    return halves.get(bb_type), outer, inner


def ubernet_regions(r, bb_type: int):
    """The rows (R, 5) whose boxes are pooled for region type bb_type, and the (R, 4) float32 hole corners
    or None."""
    half, outer, inner = ubernet_region(bb_type)
    pooled = r.clone()
    if half is not None:
        column, axis = half
        pooled[:, column] = (r[:, 1 + axis] + r[:, 3 + axis]) / 2
    if outer != 1.0:
        pooled[:, 1:5] = scaled_corners(r, outer)
    return pooled, None if inner is None else scaled_corners(r, inner)


def rich_bin_max(plane, hs, he, ws, we, step: int, hole):
    """One roi's (C, ph, pw) bins as ROIPoolForward visits them: rows hs, hs + step, ... < he and columns
    likewise, minus the cells strictly inside hole [x1, y1, x2, y2] (ints) when given; -FLT_MAX for a bin
    with no cell left, 0 for an empty bin."""
    h, w = plane.shape[1:]
    rows, cols = torch.arange(h), torch.arange(w)
    mh = (rows >= hs[:, None]) & (rows < he[:, None]) & ((rows - hs[:, None]) % step == 0)
    mw = (cols >= ws[:, None]) & (cols < we[:, None]) & ((cols - ws[:, None]) % step == 0)
    if hole is None:
        best = masked_bin_max(plane, mh, mw)
    else:   # the bin less the hole: rows outside it x every column, rows inside it x the columns outside
        x1, y1, x2, y2 = (int(v) for v in hole)
        in_rows, in_cols = (rows > y1) & (rows < y2), (cols > x1) & (cols < x2)
        best = torch.maximum(masked_bin_max(plane, mh & ~in_rows, mw),
                             masked_bin_max(plane, mh & in_rows, mw & ~in_cols))
    return fast_rcnn_bin_values(best, hs, he, ws, we)


def ubernet_roi_pool(x, rois, ph: int, pw: int, spatial_scale: float, bb_type: int = 0, rich: bool = False):
    """UberNet's ROIPooling -> (R, C, ph, pw): Fast R-CNN's bins of each roi's region (ubernet_regions),
    pooled by rich_bin_max (every second cell when rich)."""
    r = roi_rows(rois, "ROIPooling")
    n, c, h, w = x.shape
    pooled, hole = ubernet_regions(r, bb_type)
    hs, he, ws, we = fast_rcnn_bins(pooled, spatial_scale, ph, pw, h, w)
    holes = None
    if hole is not None:
        holes = c_round((hole * torch.tensor(spatial_scale, dtype=torch.float32)).double()).long()
    step = 2 if rich else 1
    outs = [rich_bin_max(x[roi_batch_index(roi, n, "ROIPooling")], hs[i], he[i], ws[i], we[i], step,
                         None if holes is None else holes[i]) for i, roi in enumerate(r)]
    if not outs:
        return x.new_zeros((0, c, ph, pw))
    return torch.stack(outs)


TORCH_UBERNET_ROI = torch_sources(scaled_corners, ubernet_region, ubernet_regions, rich_bin_max, ubernet_roi_pool)


# ---- ONNX -------------------------------------------------------------------------------

def _onnx_corners(ctx, rows, bb_type):
    """(R, 4) float32 corners of the pooled boxes and the hole's (or None), as ubernet_regions."""
    def col(k):
        return ctx.op("Slice", [rows, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], "col")
    x1, y1, x2, y2 = (col(k) for k in range(1, 5))

    def scaled(scale):
        two = ctx.f32(2.0)
        cw = ctx.op("Div", [ctx.op("Add", [x1, x2], "sw"), two], "cw")
        ch = ctx.op("Div", [ctx.op("Add", [y1, y2], "sh"), two], "ch")
        hw = ctx.op("Mul", [ctx.op("Div", [ctx.op("Sub", [x2, x1], "dw"), two], "hw"), ctx.f32(scale)], "shw")
        hh = ctx.op("Mul", [ctx.op("Div", [ctx.op("Sub", [y2, y1], "dh"), two], "hh"), ctx.f32(scale)], "shh")
        return [ctx.op("Sub", [cw, hw], "l"), ctx.op("Sub", [ch, hh], "t"),
                ctx.op("Add", [cw, hw], "r"), ctx.op("Add", [ch, hh], "b")]
    half, outer, inner = ubernet_region(bb_type)
    corners, hole = [x1, y1, x2, y2], None
    if half is not None:
        column, axis = half
        pair = (x1, x2) if axis == 0 else (y1, y2)
        corners[column - 1] = ctx.op("Div", [ctx.op("Add", list(pair), "s"), ctx.f32(2.0)], "centre")
    if outer != 1.0:
        corners = scaled(outer)
    if inner is not None:
        hole = ctx.op("Concat", scaled(inner), "hole", axis=1)
    return ctx.op("Concat", corners, "box", axis=1), hole


def emit_ubernet_roi_pool(ctx, node):
    a = node.attrs
    x, rois = node.inputs
    _, _, h, w = ctx.shape(x)
    ph, pw = a["ph"], a["pw"]
    step = 2 if a["rich"] else 1
    rows, count = onnx_padded_rows(ctx, rois, 5)
    batch, inside = onnx_batch_column(ctx, rows, ctx.shape(x)[0])
    box, hole = _onnx_corners(ctx, rows, a["bb_type"])

    def cells(corners, first):   # the C-rounded map cells of corner columns first and first + 2, (R, 1) each
        scaled = ctx.op("Mul", [corners, ctx.f32(float(np.float32(a["scale"])))], "scaled")
        rounded = ctx.op("Cast", [onnx_c_round(ctx, scaled, in_double=True)], "cells", to=TensorProto.FLOAT)
        return [ctx.op("Slice", [rounded, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], "corner")
                for k in (first, first + 2)]
    mh, hs, he = onnx_axis_bins(ctx, *cells(box, 1), ph, h, step)
    mw, ws, we = onnx_axis_bins(ctx, *cells(box, 0), pw, w, step)
    pieces = [(mh, mw)]
    if hole is not None:
        pieces = onnx_hole_pieces(ctx, mh, mw, onnx_strictly_inside(ctx, *cells(hole, 1), h),
                                  onnx_strictly_inside(ctx, *cells(hole, 0), w))
    pooled = onnx_scan_bin_max(ctx, node, x, batch, pieces, ph, pw, -FLT_MAX)
    outside = ctx.op("Reshape", [ctx.op("Not", [inside], "b_out"), ctx.i64([-1, 1, 1, 1])], "b_out4")
    onnx_finish_rois(ctx, node, pooled, count, onnx_empty_bins(ctx, hs, he, ws, we), outside)


# ---- the spec ---------------------------------------------------------------------------

def _is_ubernet(lp):
    p = lp.roi_pooling_param
    return p.is_rich != 0 or p.bb_type != 0


@claim_layers("ROIPooling", _is_ubernet)
class UberNetROIPooling(ROIPooling):
    """ROIPooling with UberNet's is_rich / bb_type (see the module docstring)."""
    roi_fn, roi_source = staticmethod(ubernet_roi_pool), TORCH_UBERNET_ROI
    roi_helpers = (TORCH_ROI_POOLING,)

    def parse(self, lp):
        attrs = roi_pooling_attrs(lp, "ROIPooling")
        p = lp.roi_pooling_param
        if attrs["pad_ratio"] or p.pool != p.MAX:
            raise LayerError("roi_pooling_param: UberNet's bb_type / is_rich and pad_ratio or pool AVE come from "
                             "different forks and cannot be set together")
        if not -2.0 ** 31 <= p.bb_type < 2.0 ** 31:
            raise LayerError(f"roi_pooling_param.bb_type {p.bb_type} does not fit the fork's int")
        attrs["bb_type"] = int(p.bb_type)   # the layer's int member: truncated
        attrs["rich"] = p.is_rich != 0
        return attrs

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], "bb_type": attrs["bb_type"],
                                            "rich": attrs["rich"]}

    def onnx(self, ctx, node):
        emit_ubernet_roi_pool(ctx, node)
