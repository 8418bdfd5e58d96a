"""craftGBD/caffe-GBD's ROIMaskPooling (4a34075, roi_mask_pooling_layer.cu; GBD-Net's context regions).

Fast R-CNN's ROIPooling of each roi [batch, x1, y1, x2, y2] first rescaled about its centre, as the
fork's GPU kernel computes it in float32: xc = (x1 + x2) / 2, half = (x2 - x1) x roi_scale / 2 (no + 1),
the box xc -+ half by yc -+ half; half_part 1 to 4 then keeps its left, right, top or bottom half (the
far edge moves to the centre).  Corners go to cells as C's round (half away from zero) of
float32(corner x spatial_scale + spatial_shift); the bins, the maximum and an empty bin's 0 are Fast
R-CNN's (roi_pooling.py).  mask_scale > 0 would leave an inner rectangle out of the maximum, but the
fork's GPU kernel then keeps a masked cell's own value whenever 0 beats the running maximum, so its result
depends on the scan order; no published net sets it, and caffeq refuses it.  The CPU forward reads the rois
as [batch, x1, x2, y1, y2] (a bug: the nets ran on the GPU).  Top (R, C, pooled_h, pooled_w); no blobs.
ONNX: the rescaled corners computed in the graph, then MaxRoiPool (spatial_shift 0 only).
"""
import math

import torch

from ..errors import ExportError
from .c_numerics import c_round
from .registry import LayerError, need_blobs, register_layer, torch_sources
from .roi_pooling import (
    TORCH_ROI_COMMON,
    RoiLayerSpec,
    _check_roi_shapes,
    cell_bins,
    fast_rcnn_bin_values,
    masked_bin_max,
    max_over_bins,
    roi_batch_index,
    roi_rows,
)


def rescaled_roi(roi, roi_scale: float, half_part: int):
    """The fork's float32 box about the roi's centre: [x1, y1, x2, y2]."""
    f32 = torch.float32
    x1, y1, x2, y2 = (roi[k:k + 1].to(f32) for k in range(1, 5))
    scale = torch.tensor(roi_scale, dtype=f32)
    xc, yc = (x1 + x2) / 2, (y1 + y2) / 2
    hw, hh = (x2 - x1) * scale / 2, (y2 - y1) * scale / 2
    box = [xc - hw, yc - hh, xc + hw, yc + hh]
    if half_part in (1, 2, 3, 4):       # left, right, top, bottom half
        box[{1: 2, 2: 0, 3: 3, 4: 1}[half_part]] = xc if half_part <= 2 else yc
    return torch.cat(box)


def roi_mask_max_pool(x, rois, ph: int, pw: int, spatial_scale: float, spatial_shift: float, roi_scale: float,
                      half_part: int):
    """ROIMaskPooling -> (R, C, ph, pw)."""
    r = roi_rows(rois, "ROIMaskPooling")
    n, c, h, w = x.shape
    f32 = torch.float32
    outs = []
    for roi in r:
        b = roi_batch_index(roi, n, "ROIMaskPooling")
        box = rescaled_roi(roi, roi_scale, half_part)
        cells = c_round((box * torch.tensor(spatial_scale, dtype=f32) + torch.tensor(spatial_shift, dtype=f32)).double())
        outs.append(max_over_bins(x[b], *cell_bins(*cells.tolist(), ph, pw, h, w)))
    if not outs:
        return x.new_zeros((0, c, ph, pw))
    return torch.stack(outs)


TORCH_ROI_MASK_POOLING = torch_sources(cell_bins, masked_bin_max, fast_rcnn_bin_values, max_over_bins, rescaled_roi, roi_mask_max_pool)


@register_layer("ROIMaskPooling")
class ROIMaskPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(roi_mask_max_pool), TORCH_ROI_MASK_POOLING
    roi_helpers = (TORCH_ROI_COMMON,)

    def parse(self, lp):
        need_blobs(lp, "ROIMaskPooling", 2, 1, roles="data, rois")
        p = lp.roi_mask_pooling_param
        if p.pooled_h <= 0 or p.pooled_w <= 0:
            raise LayerError(f"roi_mask_pooling_param.pooled_h and pooled_w must be > 0, got {p.pooled_h} x "
                             f"{p.pooled_w}")
        for field in ("spatial_scale", "spatial_shift", "roi_scale"):
            if not math.isfinite(getattr(p, field)):
                raise LayerError(f"roi_mask_pooling_param.{field} must be a finite number")
        if p.mask_scale > 0:
            raise LayerError("roi_mask_pooling_param.mask_scale > 0 is not supported: the fork's GPU kernel keeps a "
                             "masked cell's own value whenever 0 beats the running maximum, so the result depends on "
                             "its scan order")
        return {"ph": int(p.pooled_h), "pw": int(p.pooled_w), "scale": float(p.spatial_scale),
                "shift": float(p.spatial_shift), "roi_scale": float(p.roi_scale), "half_part": int(p.half_part)}

    def infer(self, attrs, in_shapes):
        _check_roi_shapes("ROIMaskPooling", in_shapes)
        s, r = in_shapes
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"], attrs["scale"], attrs["shift"], attrs["roi_scale"], attrs["half_part"]), {}

    def onnx(self, ctx, node):
        a = node.attrs
        if a["shift"]:
            raise ExportError(f"layer '{node.name}' (ROIMaskPooling): ONNX's MaxRoiPool has no spatial_shift")
        rois = ctx.op("Reshape", [node.inputs[1], ctx.i64([-1, 5])], "rois", name=node.name)

        def col(k):
            return ctx.op("Slice", [rois, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], f"c{k}")
        batch, x1, y1, x2, y2 = (col(k) for k in range(5))
        two, scale = ctx.f32(2.0), ctx.f32(a["roi_scale"])
        xc = ctx.op("Div", [ctx.op("Add", [x1, x2], "xs"), two], "xc")
        yc = ctx.op("Div", [ctx.op("Add", [y1, y2], "ys"), two], "yc")
        hw = ctx.op("Div", [ctx.op("Mul", [ctx.op("Sub", [x2, x1], "w"), scale], "ws"), two], "hw")
        hh = ctx.op("Div", [ctx.op("Mul", [ctx.op("Sub", [y2, y1], "h"), scale], "hs"), two], "hh")
        box = [ctx.op("Sub", [xc, hw], "bx1"), ctx.op("Sub", [yc, hh], "by1"),
               ctx.op("Add", [xc, hw], "bx2"), ctx.op("Add", [yc, hh], "by2")]
        if a["half_part"] in (1, 2, 3, 4):
            box[{1: 2, 2: 0, 3: 3, 4: 1}[a["half_part"]]] = xc if a["half_part"] <= 2 else yc
        scaled = ctx.op("Concat", [batch] + box, "scaled_rois", axis=1)
        # onnxruntime's MaxRoiPool rounds the corners and forms the bins as Fast R-CNN does
        ctx.add_node("MaxRoiPool", [node.inputs[0], scaled], [node.outputs[0]],
                     pooled_shape=[a["ph"], a["pw"]], spatial_scale=a["scale"])
