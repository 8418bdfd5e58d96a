"""huangdl007/pedestrian's HSROIPooling (7fba98a / 0141f8c caffe/src/caffe/layers/hsroi_pooling_layer.cu, its GPU
kernel HSROIPoolingForward: "head and shoulders" R-FCN pooling for pedestrians; the fork's CPU forward is not
implemented, or rounds otherwise).

Bottoms: score maps (N, output_dim x 4, H, W) and rois (R, 5) = [batch, x1, y1, x2, y2] in input pixels; top
(R, output_dim, 1, 4).  As R-FCN's PSROIPooling, the corners are C-rounded, the end + 1, then times
spatial_scale in float32, the roi at least 0.1 wide and high.  Part k of output d averages input channel
d x 4 + k over one of four fixed, overlapping boxes (every bound truncated toward zero, then clipped to the map;
an empty box gives 0): 0 the roi, 1 the head (the upper half, the middle half of the width), 2 the left
shoulder (the lower half, the left half), 3 the right shoulder (the lower half, the right half).  Its nets then
average the four parts with a 1 x 4 AVE Pooling.

ONNX: the four boxes' masks for every roi and two Einsums over the data, as PSROIPooling's (roi_bins_onnx.py).
"""
import numpy as np
import torch

from .c_numerics import c_round, onnx_c_round
from .registry import LayerError, need_blobs, register_layer, torch_sources
from .roi_bins_onnx import onnx_finish_rois, onnx_image_onehot, onnx_padded_rows
from .roi_pooling import TORCH_ROI_COMMON, RoiLayerSpec, bin_mask, roi_batch_index, roi_rows

PARTS = 4   # the roi, the head, the left and the right shoulder

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def hs_roi_boxes(r, spatial_scale: float, h: int, w: int):
    """The four part boxes of every roi row (R, 5): hstart, hend, wstart, wend, each (R, 4) int64, clipped."""
    f32 = torch.float32
    s = torch.tensor(spatial_scale, dtype=f32)
    x0, y0 = c_round(r[:, 1].double()).float() * s, c_round(r[:, 2].double()).float() * s
    x1, y1 = (c_round(r[:, 3].double()) + 1).float() * s, (c_round(r[:, 4].double()) + 1).float() * s
    tenth = torch.tensor(0.1, dtype=f32)
    rw, rh = torch.maximum(x1 - x0, tenth), torch.maximum(y1 - y0, tenth)
    half_h, half_w, quarter_w = rh / 2, rw / 2, rw / 4
    hs = torch.stack([y0, y0, y0 + half_h, y0 + half_h], 1)
    he = torch.stack([y1, y1 - half_h, y1, y1], 1)
    ws = torch.stack([x0, x0 + quarter_w, x0, x0 + half_w], 1)
    we = torch.stack([x1, x1 - quarter_w, x1 - half_w, x1], 1)
    # the kernel assigns each bound to an int: truncated toward zero
    return (torch.trunc(hs).long().clamp(0, h), torch.trunc(he).long().clamp(0, h),
            torch.trunc(ws).long().clamp(0, w), torch.trunc(we).long().clamp(0, w))


def hs_roi_avg_pool(x, rois, output_dim: int, spatial_scale: float):
    """HSROIPooling -> (R, output_dim, 1, 4): each part's mean of its own channel over its box, 0 when empty."""
    r = roi_rows(rois, "HSROIPooling")
    n, c, h, w = x.shape
    hs, he, ws, we = hs_roi_boxes(r, spatial_scale, h, w)
    area = ((he - hs).clamp(min=0) * (we - ws).clamp(min=0)).to(x.device, x.dtype)        # (R, 4)
    outs = []
    for i, roi in enumerate(r):
        planes = x[roi_batch_index(roi, n, "HSROIPooling")].reshape(output_dim, 4, h, w)
        mh = bin_mask(hs[i], he[i], h).to(x.device, x.dtype)
        mw = bin_mask(ws[i], we[i], w).to(x.device, x.dtype)
        sums = torch.einsum("dphw,ph,pw->dp", planes, mh, mw)
        outs.append(torch.where(area[i] > 0, sums / area[i].clamp(min=1), torch.zeros_like(sums)))
    if not outs:
        return x.new_zeros((0, output_dim, 1, 4))
    return torch.stack(outs).unsqueeze(2)


TORCH_HSROI_POOLING = torch_sources(hs_roi_boxes, hs_roi_avg_pool)


# ---- ONNX -------------------------------------------------------------------------------

def emit_hs_roi_pool(ctx, node):
    a = node.attrs
    x, rois = node.inputs
    n, c, h, w = ctx.shape(x)
    op, f32 = ctx.op, ctx.f32
    rows, count = onnx_padded_rows(ctx, rois, 5)     # a padding row: onnxruntime's Einsum takes no 0 rois
    batch = op("Cast", [op("Gather", [rows, ctx.i64(0)], "b", axis=1)], "batch", to=7)
    corners = op("Slice", [rows, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], "corners")
    cells = op("Cast", [onnx_c_round(ctx, corners, in_double=True)],
               "rounded", to=1)                                                              # (R, 4)
    plus = ctx.const(np.array([[0, 0, 1, 1]], np.float32))
    scaled = op("Mul", [op("Add", [cells, plus], "ends"), f32(float(np.float32(a["scale"])))], "scaled")

    def col(k):
        return op("Slice", [scaled, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], "c")
    x0, y0, x1, y1 = (col(k) for k in range(4))
    rw = op("Max", [op("Sub", [x1, x0], "rw"), f32(float(np.float32(0.1)))], "rw")
    rh = op("Max", [op("Sub", [y1, y0], "rh"), f32(float(np.float32(0.1)))], "rh")
    half_h, half_w = op("Div", [rh, f32(2.0)], "hh"), op("Div", [rw, f32(2.0)], "hw")
    quarter_w = op("Div", [rw, f32(4.0)], "qw")
    lower, mid_w = op("Add", [y0, half_h], "lower"), op("Add", [x0, half_w], "mid")

    def bounds(values, extent):   # (R, 4): truncated toward zero (the kernel's int), clipped to the map
        v = op("Concat", values, "b", axis=1)
        v = ctx.trunc(v)
        return op("Clip", [v, f32(0.0), f32(float(extent))], "clip")
    hs = bounds([y0, y0, lower, lower], h)
    he = bounds([y1, op("Sub", [y1, half_h], "top_end"), y1, y1], h)
    ws = bounds([x0, op("Add", [x0, quarter_w], "head_l"), x0, mid_w], w)
    we = bounds([x1, op("Sub", [x1, quarter_w], "head_r"), op("Sub", [x1, half_w], "left_r"), x1], w)

    def mask(lo, hi, extent):   # (R, 4, extent) float
        pos = ctx.const(np.arange(extent, dtype=np.float32).reshape(1, 1, extent))
        lo3, hi3 = (op("Unsqueeze", [v, ctx.i64([2])], "b3") for v in (lo, hi))
        inside = op("And", [op("GreaterOrEqual", [pos, lo3], "ge"), op("Less", [pos, hi3], "lt")], "in")
        return op("Cast", [inside], "m", to=1)
    area = op("Mul", [op("Max", [op("Sub", [he, hs], "dh"), f32(0.0)], "ah"),
                      op("Max", [op("Sub", [we, ws], "dw"), f32(0.0)], "aw")], "area")                # (R, 4)
    x5 = op("Reshape", [x, ctx.i64([n, a["dim"], PARTS, h, w])], "x5")
    by_cols = op("Einsum", [x5, mask(ws, we, w)], "cols", equation="ndphw,rpw->rndph")
    sums = op("Einsum", [by_cols, onnx_image_onehot(ctx, x, batch), mask(hs, he, h)], "sums",
              equation="rndph,rn,rph->rdp")
    area3 = op("Unsqueeze", [area, ctx.i64([1])], "area3")                                          # (R, 1, 4)
    mean = op("Div", [sums, op("Max", [area3, f32(1.0)], "divisor")], "mean")
    pooled = op("Unsqueeze", [mean, ctx.i64([2])], "pooled")                                       # (R, D, 1, 4)
    onnx_finish_rois(ctx, node, pooled, count, op("Unsqueeze", [op("LessOrEqual", [area3, f32(0.0)], "empty"),
                                                                 ctx.i64([2])], "empty4"))


# ---- the spec ---------------------------------------------------------------------------

@register_layer("HSROIPooling")
class HSROIPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(hs_roi_avg_pool), TORCH_HSROI_POOLING
    roi_helpers = (TORCH_ROI_COMMON,)

    def parse(self, lp):
        need_blobs(lp, "HSROIPooling", 2, 1, roles="data, rois")
        p = lp.hsroi_pooling_param
        if not p.HasField("output_dim"):
            raise LayerError("hsroi_pooling_param.output_dim is required")
        if p.output_dim <= 0:
            raise LayerError(f"hsroi_pooling_param.output_dim must be > 0, got {p.output_dim}")
        if not np.isfinite(p.spatial_scale):
            raise LayerError(f"hsroi_pooling_param.spatial_scale must be a finite number, got {p.spatial_scale}")
        return {"dim": int(p.output_dim), "scale": float(p.spatial_scale)}

    def infer(self, attrs, in_shapes):
        s, r = in_shapes
        if len(s) != 4 or s[1] != attrs["dim"] * PARTS:
            raise LayerError(f"HSROIPooling needs (N, output_dim x 4 = {attrs['dim'] * PARTS}, H, W) score maps "
                             f"(the fork's CHECK), got {list(s)}")
        if not r or int(np.prod(r[1:])) != 5:
            raise LayerError(f"HSROIPooling: rois must be (R, 5) = [batch, x1, y1, x2, y2], got {list(r)}")
        return [(r[0], attrs["dim"], 1, PARTS)]

    def roi_args(self, attrs):
        return (attrs["dim"], attrs["scale"]), {}

    def onnx(self, ctx, node):
        emit_hs_roi_pool(ctx, node)
