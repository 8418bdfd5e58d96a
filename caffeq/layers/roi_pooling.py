"""ROI pooling from the detection forks: ROIPooling (Fast/Faster R-CNN), PSROIPooling (R-FCN),
PSROIContextPooling (alenaliu/PPR-FCN).

rois are (R, 5) = [batch, x1, y1, x2, y2] in input pixels.
- ROIPooling: corners times spatial_scale, rounded with C's round(); integer bins by floor/ceil of
  float32 bin sizes, clipped to the map; the max over each bin; an empty bin gives 0.  The zhaoweicai
  MS-CNN / Cascade R-CNN fork's pad_ratio first widens the roi by pad_ratio x (x2 - x1 + 1) on the left
  and right and pad_ratio x (y2 - y1 + 1) above and below (float32); 0 leaves it as it is.
  wk910930/ccnn's `pool: AVE` averages each bin instead (its GPU kernel: an empty bin gives 0).
  Yochengliu/MLIC-KD-WSD 12e92b5 (caffe-MLIC roi_pooling_layer.cpp/.cu, WSDDN): with score_scale or
  score_bias set, the rois are (R, 6) = [batch, x1, y1, x2, y2, score] and every pooled value (0 for an
  empty bin, -FLT_MAX for a bin of -inf) is multiplied by the float32 score_scale x score + score_bias.
- PSROIPooling: corners C-rounded, then scaled in float32 (the end corner + 1); bin (i, j) of the
  group_size x group_size grid averages channel block (i, j) of each output channel over its cells;
  an empty bin gives 0.
  ypeiyu/PAMS-FCN's `divide_type` (part-aligned bins, a (R, output_dim, 1, group_size) top): pams_psroi.py.
- PSROIContextPooling (alenaliu/PPR-FCN 1eba551, externals/ms_caffe psroi_context_pooling_layer.cu;
  its CPU Forward is NOT_IMPLEMENTED, so this is the GPU kernel): bottoms (data, union rois, object
  rois).  PSROIPooling's bins over each union roi, a bin kept only where its clipped [start, end)
  overlaps the object box (strictly, on both axes), else 0.  The object box is the first row of the
  third bottom for every union roi (the kernel never offsets that pointer; its batch index is not
  read): x1, y1 C-rounded, times spatial_scale in float32, floored; x2 + 1, y2 + 1 likewise, ceiled;
  both clipped to the map.  The PPR-FCN nets feed one relation (one row each) per forward.

The bins are computed on the CPU in the forks' float32 arithmetic, the pooling on the input's device.
The torch functions below serve `forward` and are copied into model.py (inspect.getsource).
ONNX: ROIPooling -> MaxRoiPool (onnxruntime rounds and bins as Fast R-CNN does; checked in the
tests); its AVE form, PSROIPooling and PSROIContextPooling (ONNX has no such ops) -> plain ops: 0/1
masks of every roi's bins and two Einsums (roi_bins_onnx.py: onnx_roi_avg_pool, onnx_ps_roi_pool; the
context form with the object box's overlap mask).
"""
import math

import numpy as np
import torch
from torch import nn

from ..errors import ExportError
from .c_numerics import c_round
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from .roi_bins_onnx import onnx_ps_roi_pool, onnx_roi_avg_pool

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def bin_mask(starts, ends, n: int):
    """(bins, n) bool: position p lies in bin k when starts[k] <= p < ends[k]."""
    pos = torch.arange(n)
    return (pos[None, :] >= starts[:, None]) & (pos[None, :] < ends[:, None])


def bin_means(planes, pattern: str, hs, he, ws, we):
    """The mean of `planes` (..., H, W) over each bin [hs, he) x [ws, we), 0 for an empty bin;
    `pattern` contracts the planes with the (bins, H) row and (bins, W) column masks."""
    h, w = planes.shape[-2:]
    area = ((he - hs).clamp(min=0)[:, None] * (we - ws).clamp(min=0)[None, :]).to(planes.device, planes.dtype)
    mh = bin_mask(hs, he, h).to(planes.device, planes.dtype)
    mw = bin_mask(ws, we, w).to(planes.device, planes.dtype)
    sums = torch.einsum(pattern, planes, mh, mw)
    return torch.where(area > 0, sums / area.clamp(min=1), torch.zeros_like(sums))


def roi_rows(rois, kind: str):
    """rois as (R, 5) float32 rows on the CPU, where the bins are computed."""
    r = rois.flatten(1) if rois.dim() > 1 else rois.reshape(-1, 1)     # flatten: (0, 5) stays (0, 5)
    if r.shape[1] != 5:
        raise ValueError(f"{kind}: rois must be (R, 5) = [batch, x1, y1, x2, y2], got {list(rois.shape)}")
    return r.detach().float().cpu()


def roi_batch_index(roi, n: int, kind: str):
    b = int(roi[0])
    if not 0 <= b < n:
        raise ValueError(f"{kind}: roi batch index {b} is outside the batch of {n}")
    return b


def cell_bins(x1: float, y1: float, x2: float, y2: float, ph: int, pw: int, h: int, w: int):
    """The bins of a roi whose corners are whole map cells (inclusive): float32 bin sizes, floor and ceil,
    clipped to the map."""
    f32 = torch.float32
    rh = max(int(y2 - y1) + 1, 1)
    rw = max(int(x2 - x1) + 1, 1)
    bh = torch.tensor(float(rh), dtype=f32) / torch.tensor(float(ph), dtype=f32)
    bw = torch.tensor(float(rw), dtype=f32) / torch.tensor(float(pw), dtype=f32)
    hs = torch.floor(torch.arange(ph, dtype=f32) * bh).long() + int(y1)
    he = torch.ceil(torch.arange(1, ph + 1, dtype=f32) * bh).long() + int(y1)
    ws = torch.floor(torch.arange(pw, dtype=f32) * bw).long() + int(x1)
    we = torch.ceil(torch.arange(1, pw + 1, dtype=f32) * bw).long() + int(x1)
    return hs.clamp(0, h), he.clamp(0, h), ws.clamp(0, w), we.clamp(0, w)


def fast_rcnn_bins(r, scale: float, ph: int, pw: int, h: int, w: int, pad_ratio: float = 0.0):
    """Fast R-CNN's integer bins of every roi row [batch, x1, y1, x2, y2] of r (R, 5) (float32, CPU): the
    zhaoweicai fork's pad_ratio first moves each side out by pad_ratio x the roi's size (float32), then the
    corners times scale are C-rounded and cell_bins' float32 steps give hstart, hend (R, ph) and wstart,
    wend (R, pw), clipped to the map."""
    f32 = torch.float32
    corners = r[:, 1:5]
    if pad_ratio != 0:
        pad = (corners[:, 2:] - corners[:, :2] + 1.0) * torch.tensor(pad_ratio, dtype=f32)
        corners = torch.cat([corners[:, :2] - pad, corners[:, 2:] + pad], 1)
    x1, y1, x2, y2 = c_round((corners * torch.tensor(scale, dtype=f32)).double()).unbind(1)
    rh = torch.clamp(y2 - y1 + 1, min=1).float()
    rw = torch.clamp(x2 - x1 + 1, min=1).float()
    bh = (rh / torch.tensor(float(ph), dtype=f32))[:, None]
    bw = (rw / torch.tensor(float(pw), dtype=f32))[:, None]
    top, left = y1.long()[:, None], x1.long()[:, None]
    hs = torch.floor(torch.arange(ph, dtype=f32)[None, :] * bh).long() + top
    he = torch.ceil(torch.arange(1, ph + 1, dtype=f32)[None, :] * bh).long() + top
    ws = torch.floor(torch.arange(pw, dtype=f32)[None, :] * bw).long() + left
    we = torch.ceil(torch.arange(1, pw + 1, dtype=f32)[None, :] * bw).long() + left
    return hs.clamp(0, h), he.clamp(0, h), ws.clamp(0, w), we.clamp(0, w)


def floor_log2(n):
    """floor(log2(n)) of an int tensor of values >= 1."""
    k = torch.zeros_like(n)
    j = 1
    while bool((n >= (1 << j)).any()):
        k = k + (n >= (1 << j)).long()
        j += 1
    return k


def range_max_bins(plane, hs, he, ws, we, budget: int = 1 << 26):
    """Each bin's maximum over the (C, H, W) plane, 0 for an empty bin: (R, C, ph, pw) for R rois' bins (hs, he:
    (R, ph); ws, we: (R, pw)).  A table of the maxima over every 2^a x 2^b window answers a bin with four
    overlapping windows (maxima are exact, so the overlap changes nothing).  The table holds at most `budget`
    values: channels go in groups that fit; None where one channel's table would not fit or where a gradient
    is wanted (max_over_bins then pools roi by roi)."""
    c, h, w = plane.shape
    kh, kw = floor_log2((he - hs).clamp(min=1)), floor_log2((we - ws).clamp(min=1))
    levels_h, levels_w = int(kh.max()) + 1, int(kw.max()) + 1
    per_channel = levels_h * levels_w * h * w
    if per_channel > budget or (torch.is_grad_enabled() and plane.requires_grad):
        return None
    if per_channel * c > budget:   # channels are independent: a table for as many at a time as fit
        step = budget // per_channel
        return torch.cat([range_max_bins(plane[i:i + step], hs, he, ws, we, budget) for i in range(0, c, step)],
                         dim=1)
    # channels last: a window's C maxima are one contiguous row of the flat table, gathered with
    # index_select; the maxima are taken in place (fresh buffers of this size cost more than the
    # comparisons), so a caller that wants a gradient pools roi by roi instead
    table = plane.new_empty((levels_h, levels_w, h, w, c))   # [a, b, y, x]: max over [y, y + 2^a) x [x, x + 2^b)
    table[0, 0] = plane.permute(1, 2, 0)
    for a in range(levels_h):
        if a:
            s = min(1 << (a - 1), h)
            torch.maximum(table[a - 1, 0, :h - s], table[a - 1, 0, s:], out=table[a, 0, :h - s])
            table[a, 0, h - s:] = table[a - 1, 0, h - s:]
        for b in range(1, levels_w):
            s = min(1 << (b - 1), w)
            torch.maximum(table[a, b - 1, :, :w - s], table[a, b - 1, :, s:], out=table[a, b, :, :w - s])
            table[a, b, :, w - s:] = table[a, b - 1, :, w - s:]
    table = table.reshape(-1, c)
    dev = plane.device
    level = (kh[:, :, None] * levels_w + kw[:, None, :]) * (h * w)   # (R, ph, pw)
    h0, h1 = hs.clamp(0, h - 1), (he - (1 << kh)).clamp(0, h - 1)
    w0, w1 = ws.clamp(0, w - 1), (we - (1 << kw)).clamp(0, w - 1)
    best = window = None
    for hh, ww in ((h0, w0), (h0, w1), (h1, w0), (h1, w1)):
        rows = (level + hh[:, :, None] * w + ww[:, None, :]).reshape(-1).to(dev)
        if best is None:
            best = table.index_select(0, rows)
        else:
            window = torch.index_select(table, 0, rows, out=window)
            torch.maximum(best, window, out=best)
    # Fast R-CNN's running max starts at -FLT_MAX: a bin of -inf values gives -FLT_MAX
    best.clamp_(min=-3.4028234663852886e38)
    best.masked_fill_(((he <= hs)[:, :, None] | (we <= ws)[:, None, :]).reshape(-1, 1).to(dev), 0)
    return best.reshape(hs.shape[0], hs.shape[1], ws.shape[1], c).permute(0, 3, 1, 2)


def roi_max_pool(x, rois, ph: int, pw: int, spatial_scale: float, pad_ratio: float = 0.0):
    """Fast R-CNN's ROIPooling -> (R, C, ph, pw): the rois of each image at once (range_max_bins)."""
    r = roi_rows(rois, "ROIPooling")
    n, c, h, w = x.shape
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    batch = torch.trunc(r[:, 0]).long()
    outside = (batch < 0) | (batch >= n)
    if bool(outside.any()):
        roi_batch_index(r[outside][0], n, "ROIPooling")   # raises, naming the index
    hs, he, ws, we = fast_rcnn_bins(r, spatial_scale, ph, pw, h, w, pad_ratio)
    out = None
    for b in torch.unique(batch).tolist():
        picked = (batch == b).nonzero().reshape(-1)
        pooled = range_max_bins(x[b], hs[picked], he[picked], ws[picked], we[picked])
        if pooled is None:   # a table too large for the map, or a gradient wanted: roi by roi
            pooled = torch.stack([max_over_bins(x[b], hs[i], he[i], ws[i], we[i]) for i in picked.tolist()])
        if picked.shape[0] == r.shape[0]:   # every roi in this image: no scatter
            return pooled.contiguous()
        if out is None:
            out = x.new_zeros((r.shape[0], c, ph, pw))
        out[picked.to(x.device)] = pooled
    return out


def roi_max_pool_scored(x, rois, ph: int, pw: int, spatial_scale: float, score_scale: float, score_bias: float):
    """Yochengliu/MLIC-KD-WSD's ROIPooling -> (R, C, ph, pw): rois (R, 6) = [batch, x1, y1, x2, y2, score];
    Fast R-CNN's max over the first five columns, times score_scale x score + score_bias (float32)."""
    r = rois.flatten(1) if rois.dim() > 1 else rois.reshape(-1, 1)
    if r.shape[1] != 6:
        raise ValueError(f"ROIPooling: with score_scale / score_bias the rois must be (R, 6) = "
                         f"[batch, x1, y1, x2, y2, score], got {list(rois.shape)}")
    pooled = roi_max_pool(x, r[:, :5], ph, pw, spatial_scale)
    # float32 products as the fork's, on the rois' own device (no copy to the host)
    score = r[:, 5].detach().float()
    factor = score * torch.tensor(score_scale, dtype=torch.float32) + torch.tensor(score_bias, dtype=torch.float32)
    return pooled * factor.to(x.device, x.dtype)[:, None, None, None]


def masked_bin_max(plane, rows, cols):
    """(C, ph, pw): the maximum of the (C, H, W) plane over the cells of rows[p] x cols[q] (rows (ph, H),
    cols (pw, W) bool), -inf where a bin has none; the maxima run over the rows and columns in use only."""
    neg = torch.tensor(float("-inf"), device=plane.device, dtype=plane.dtype)
    used_rows, used_cols = rows.any(0).nonzero().reshape(-1), cols.any(0).nonzero().reshape(-1)
    if used_rows.numel() == 0 or used_cols.numel() == 0:
        return neg.expand(plane.shape[0], rows.shape[0], cols.shape[0]).clone()
    r0, r1 = int(used_rows[0]), int(used_rows[-1]) + 1
    c0, c1 = int(used_cols[0]), int(used_cols[-1]) + 1
    region = plane[:, r0:r1, c0:c1]
    mh, mw = rows[:, r0:r1].to(plane.device), cols[:, c0:c1].to(plane.device)
    by_cols = torch.where(mw[None, None], region[:, :, None, :], neg).amax(-1)     # (C, rh, pw)
    return torch.where(mh[None, :, :, None], by_cols[:, None], neg).amax(2)       # (C, ph, pw)


def fast_rcnn_bin_values(best, hs, he, ws, we):
    """(C, ph, pw) bin maxima as Fast R-CNN's kernel leaves them: its running max starts at -FLT_MAX (a bin of
    -inf values, or of none, gives -FLT_MAX), and an empty bin (end <= start) gives 0."""
    empty = ((he <= hs)[:, None] | (we <= ws)[None, :]).to(best.device)
    return torch.where(empty[None], torch.zeros((), device=best.device, dtype=best.dtype),
                       best.clamp(min=-3.4028234663852886e38))


def max_over_bins(plane, hs, he, ws, we):
    """Each bin's maximum over the (C, H, W) plane, 0 for an empty bin: (C, ph, pw)."""
    h, w = plane.shape[1:]
    return fast_rcnn_bin_values(masked_bin_max(plane, bin_mask(hs, he, h), bin_mask(ws, we, w)), hs, he, ws, we)


def roi_avg_pool(x, rois, ph: int, pw: int, spatial_scale: float):
    """wk910930/ccnn's ROIPooling with pool: AVE -> (R, C, ph, pw): the mean over Fast R-CNN's bins;
    an empty bin gives 0 (the fork's GPU kernel; its CPU loop divides 0 by 0 there)."""
    r = roi_rows(rois, "ROIPooling")
    n, c, h, w = x.shape
    hs, he, ws, we = fast_rcnn_bins(r, spatial_scale, ph, pw, h, w)
    outs = [bin_means(x[roi_batch_index(roi, n, "ROIPooling")], "chw,ph,qw->cpq", hs[i], he[i], ws[i], we[i])
            for i, roi in enumerate(r)]
    if not outs:
        return x.new_zeros((0, c, ph, pw))
    return torch.stack(outs)


def ps_roi_bins(roi, spatial_scale: float, group_size: int, h: int, w: int):
    """R-FCN's position-sensitive bins of a roi [batch, x1, y1, x2, y2] (5,) or of rows of them (R, 5)
    (float32, CPU): hstart, hend, wstart, wend of the group_size x group_size grid, clipped to the h x w
    map, each (group_size,) or (R, group_size)."""
    f32 = torch.float32
    scale = torch.tensor(spatial_scale, dtype=f32)
    corners = c_round(roi[..., 1:5].double())  # x1, y1, x2, y2
    start = corners[..., :2].float() * scale  # (x, y), float32 as R-FCN
    end = (corners[..., 2:] + 1.0).float() * scale
    size = torch.maximum(end - start, torch.tensor(0.1, dtype=f32))
    bin_size = size / torch.tensor(float(group_size), dtype=f32)
    k = torch.arange(group_size, dtype=f32)
    hs = torch.floor(k * bin_size[..., 1:2] + start[..., 1:2]).long().clamp(0, h)
    he = torch.ceil((k + 1) * bin_size[..., 1:2] + start[..., 1:2]).long().clamp(0, h)
    ws = torch.floor(k * bin_size[..., 0:1] + start[..., 0:1]).long().clamp(0, w)
    we = torch.ceil((k + 1) * bin_size[..., 0:1] + start[..., 0:1]).long().clamp(0, w)
    return hs, he, ws, we


def ps_roi_means(x, r, dim: int, g: int, spatial_scale: float, kind: str):
    """R-FCN's bin means of the (R, 5) rows r over x (N, dim * g * g, H, W) -> ((R, dim, g, g), the (R, g)
    bins).  Every roi at once: 0/1 masks of its bins' rows and columns, and the sums as two einsums over
    the (N, dim, g, g, H, W) view, a one-hot of the rois' images picking each roi's (onnx_ps_roi_pool
    writes the same); an empty bin gives 0."""
    n, _, h, w = x.shape
    batch = torch.trunc(r[:, 0]).long()
    outside = (batch < 0) | (batch >= n)
    if bool(outside.any()):
        roi_batch_index(r[outside][0], n, kind)   # raises, naming the index
    hs, he, ws, we = ps_roi_bins(r, spatial_scale, g, h, w)   # (R, g) each
    rows = torch.arange(h)
    cols = torch.arange(w)
    mh = ((rows >= hs[..., None]) & (rows < he[..., None])).to(x.device, x.dtype)   # (R, g, H)
    mw = ((cols >= ws[..., None]) & (cols < we[..., None])).to(x.device, x.dtype)   # (R, g, W)
    area = ((he - hs).clamp(min=0)[:, None, :, None] * (we - ws).clamp(min=0)[:, None, None, :])
    area = area.to(x.device, x.dtype)   # (R, 1, g, g)
    onehot = (batch[:, None] == torch.arange(n)[None, :]).to(x.device, x.dtype)   # (R, N)
    by_cols = torch.einsum("nopqhw,rqw->nropqh", x.reshape(n, dim, g, g, h, w), mw)
    sums = torch.einsum("nropqh,rn,rph->ropq", by_cols, onehot, mh)
    return torch.where(area > 0, sums / area.clamp(min=1), torch.zeros_like(sums)), (hs, he, ws, we)


def ps_roi_avg_pool(x, rois, output_dim: int, group_size: int, spatial_scale: float):
    """R-FCN's PSROIPooling -> (R, output_dim, group_size, group_size); x has
    output_dim * group_size^2 channels."""
    r = roi_rows(rois, "PSROIPooling")
    if r.shape[0] == 0:
        return x.new_zeros((0, output_dim, group_size, group_size))
    return ps_roi_means(x, r, output_dim, group_size, spatial_scale, "PSROIPooling")[0]


def ps_roi_context_pool(x, rois, obj_rois, output_dim: int, group_size: int, spatial_scale: float):
    """alenaliu/PPR-FCN's PSROIContextPooling -> (R, output_dim, group_size, group_size): PSROIPooling
    over each union roi, a bin kept only where it overlaps the object box, the first row of obj_rois
    (for every union roi, as the fork's kernel reads it); the other bins give 0."""
    kind = "PSROIContextPooling"
    r = roi_rows(rois, kind)
    o = roi_rows(obj_rois, kind + " (object boxes)")
    _, _, h, w = x.shape
    g, dim = group_size, output_dim
    if r.shape[0] == 0:
        return x.new_zeros((0, dim, g, g))
    if o.shape[0] == 0:
        raise ValueError(f"{kind}: the object boxes (third bottom) are empty; the fork reads the first one")
    scale = torch.tensor(spatial_scale, dtype=torch.float32)
    corners = c_round(o[0, 1:5].double())  # x1, y1, x2, y2; its batch index is not read
    lo = torch.floor(corners[:2].float() * scale).long()
    hi = torch.ceil((corners[2:] + 1.0).float() * scale).long()
    ox0, ox1 = int(lo[0].clamp(0, w)), int(hi[0].clamp(0, w))
    oy0, oy1 = int(lo[1].clamp(0, h)), int(hi[1].clamp(0, h))
    means, (hs, he, ws, we) = ps_roi_means(x, r, dim, g, spatial_scale, kind)
    keep = ((hs < oy1) & (he > oy0))[:, :, None] & ((ws < ox1) & (we > ox0))[:, None, :]   # (R, g, g)
    return torch.where(keep[:, None].to(x.device), means, torch.zeros((), device=x.device, dtype=x.dtype))


class RoiLayer(nn.Module):
    """A ROI layer in model.py: its function (roi_max_pool, ps_roi_avg_pool, ...) applied to (x, rois)
    (and any further bottoms: PSROIContextPooling's object boxes) with the layer's fixed arguments."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def forward(self, x, rois, *more):
        return self.fn(x, rois, *more, *self.args, **self.kwargs)


# model.py gets the same functions, so the export stays bit-identical to forward
TORCH_ROI_COMMON = torch_sources(c_round, bin_mask, bin_means, roi_rows, roi_batch_index)
# cell_bins for GRIDPooling's model.py, which takes its helpers from here
TORCH_ROI_POOLING = torch_sources(cell_bins, masked_bin_max, fast_rcnn_bin_values, max_over_bins, fast_rcnn_bins, floor_log2, range_max_bins, roi_max_pool)
TORCH_ROI_AVG_POOLING = torch_sources(fast_rcnn_bins, roi_avg_pool)
TORCH_ROI_SCORED_POOLING = torch_sources(roi_max_pool_scored)
TORCH_PSROI_BINS = torch_sources(ps_roi_bins, ps_roi_means)
TORCH_PSROI_POOLING = torch_sources(ps_roi_avg_pool)
TORCH_PSROI_CONTEXT_POOLING = torch_sources(ps_roi_context_pool)


def roi_layer_call(emit, function_source, *args, helpers=(), **kwargs):
    """model.py: a RoiLayer of the function `function_source` defines last, applied to the node's
    bottoms (x, rois, ...); `helpers`: the other sources it calls, each written once in the file."""
    fn = emit.Code(emit.helper(function_source))
    emit.helper(TORCH_ROI_COMMON)
    for source in helpers:
        emit.helper(source)
    m = emit.instance(RoiLayer, fn, *args, **kwargs)
    return f"{m}({', '.join(emit.inputs)})"


# ---- the specs ---------------------------------------------------------------------------

ROIS_WANTED = "rois must be (R, 5) = [batch, x1, y1, x2, y2]"


def _check_roi_shapes(where, in_shapes, rows_only=False):
    """rows_only: Caffe's ROIPoolingLayer::Reshape reads only the rois' count (person_search declares
    (1, 4) rois and reshapes them before each forward); the width is checked when the layer runs."""
    s, r = in_shapes
    if len(s) != 4:
        raise LayerError(f"{where} needs a 4-axis input, got {list(s)}")
    if not r or (not rows_only and math.prod(r[1:]) != 5):
        raise LayerError(f"{where}: {ROIS_WANTED}, got {list(r)}")


class RoiLayerSpec(Layer):
    """A ROI layer computed by the module-level function `roi_fn(x, rois, *args, **kwargs)`; model.py
    gets it from `roi_source` (its source with its helpers) and applies it through RoiLayer."""

    roi_fn = None       # staticmethod(the function)
    roi_source = None
    roi_helpers = ()    # sources the function calls that other layers' functions share (one block each)

    def roi_args(self, attrs):
        """(the positional arguments after x and rois, the keyword ones) for these attrs."""
        raise NotImplementedError

    def roi_function(self, attrs):
        """(the function, its model.py source) for these attrs: roi_fn and roi_source unless a
        parameter picks another."""
        return self.roi_fn, self.roi_source

    def forward(self, attrs, params, x, rois, *more):
        args, kwargs = self.roi_args(attrs)
        fn, _ = self.roi_function(attrs)
        try:
            return fn(x, rois, *more, *args, **kwargs)
        except ValueError as e:   # a roi that does not fit the batch: the user's data, one clear line
            raise LayerError(str(e)) from None

    def pytorch_source(self, node, emit):
        args, kwargs = self.roi_args(node.attrs)
        return roi_layer_call(emit, self.roi_function(node.attrs)[1], *args, helpers=self.roi_helpers, **kwargs)


def pooled_grid_attrs(p, field):
    """{"ph", "pw", "scale"} of a fork's roi parameter message `p` (named `field` in messages):
    pooled_h and pooled_w above 0, a finite spatial_scale."""
    if p.pooled_h <= 0 or p.pooled_w <= 0:
        raise LayerError(f"{field}.pooled_h and pooled_w must be > 0, got {p.pooled_h} x {p.pooled_w}")
    if not math.isfinite(p.spatial_scale):
        raise LayerError(f"{field}.spatial_scale must be a finite number, got {p.spatial_scale}")
    return {"ph": int(p.pooled_h), "pw": int(p.pooled_w), "scale": float(p.spatial_scale)}


def roi_pooling_attrs(lp, kind):
    """roi_pooling_param as ROIPooling and zhaoweicai's ROIAlign read it."""
    need_blobs(lp, kind, 2, roles="data, rois")
    p = lp.roi_pooling_param
    if p.pooled_h <= 0 or p.pooled_w <= 0:
        raise LayerError(f"roi_pooling_param.pooled_h and pooled_w must be > 0, got {p.pooled_h} x {p.pooled_w}")
    if not math.isfinite(p.pad_ratio):
        raise LayerError(f"roi_pooling_param.pad_ratio must be a finite number, got {p.pad_ratio}")
    return {"ph": int(p.pooled_h), "pw": int(p.pooled_w), "scale": float(p.spatial_scale),
            "pad_ratio": float(p.pad_ratio)}


@register_layer("ROIPooling")
class ROIPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(roi_max_pool), TORCH_ROI_POOLING

    def parse(self, lp):
        attrs = roi_pooling_attrs(lp, "ROIPooling")
        attrs["average"] = lp.roi_pooling_param.pool == lp.roi_pooling_param.AVE
        if attrs["average"] and attrs["pad_ratio"]:
            raise LayerError("roi_pooling_param: pool AVE (wk910930/ccnn) and pad_ratio (zhaoweicai's "
                             "fork) come from different forks and cannot be set together")
        p = lp.roi_pooling_param
        if p.HasField("score_scale") or p.HasField("score_bias"):   # MLIC-KD-WSD: (R, 6) rois with a score
            if attrs["average"] or attrs["pad_ratio"]:
                raise LayerError("roi_pooling_param: score_scale / score_bias (Yochengliu/MLIC-KD-WSD) cannot be "
                                 "set with pool AVE or pad_ratio (other forks)")
            if not (math.isfinite(p.score_scale) and math.isfinite(p.score_bias)):
                raise LayerError(f"roi_pooling_param.score_scale and score_bias must be finite numbers, "
                                 f"got {p.score_scale} and {p.score_bias}")
            attrs["score"] = (float(p.score_scale), float(p.score_bias))
        return attrs

    def roi_function(self, attrs):
        if attrs.get("average"):
            return roi_avg_pool, TORCH_ROI_AVG_POOLING
        if attrs.get("score"):
            return roi_max_pool_scored, TORCH_ROI_SCORED_POOLING
        return super().roi_function(attrs)

    def infer(self, attrs, in_shapes):
        _check_roi_shapes("ROIPooling", in_shapes, rows_only=True)
        s, r = in_shapes
        if attrs.get("score") and math.prod(r[1:]) != 6:
            raise LayerError(f"ROIPooling with score_scale / score_bias: rois must be (R, 6) = "
                             f"[batch, x1, y1, x2, y2, score], got {list(r)}")
        if len(r) == 3 and r[1] == 5 and r[2] % 16 == 0 and not attrs.get("score"):
            # Huawei Ascend's (N, 5, R) rois (its Proposal's top, R a multiple of 16): its ROIPooling pools R rois
            # per image of the map (roipooling_ops.cpp's infer: R x N maps); caffeq sizes it, runs refuse
            return [(r[2] * s[0], s[1], attrs["ph"], attrs["pw"])]
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        if attrs.get("score"):
            return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], "score_scale": attrs["score"][0],
                                                "score_bias": attrs["score"][1]}
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], **pad_kwarg(attrs)}

    def pytorch_source(self, node, emit):
        if node.attrs.get("score"):   # roi_max_pool_scored calls roi_max_pool: its block too
            args, kwargs = self.roi_args(node.attrs)
            return roi_layer_call(emit, TORCH_ROI_SCORED_POOLING, *args, helpers=(TORCH_ROI_POOLING,), **kwargs)
        return super().pytorch_source(node, emit)

    def onnx(self, ctx, node):
        a = node.attrs
        rois = node.inputs[1]
        if a.get("score"):
            onnx_scored_roi_pool(ctx, node, a)
            return
        if math.prod(ctx.shape(rois)[1:]) != 5:
            raise ExportError(f"layer '{node.name}' (ROIPooling): {ROIS_WANTED}, the net declares "
                              f"{list(ctx.shape(rois))}; give their shape with --input-shape")
        if a.get("average"):   # ONNX's RoiAlign samples points; the mean over Fast R-CNN's bins in plain ops
            onnx_roi_avg_pool(ctx, node, a["ph"], a["pw"], a["scale"])
            return
        if len(ctx.shape(rois)) != 2:
            flat = ctx.tmp(node.name + "_rois")
            ctx.add_node("Reshape", [rois, ctx.const(np.array([-1, 5], np.int64))], [flat])
            rois = flat
        if a.get("pad_ratio", 0.0):
            rois = onnx_pad_rois(ctx, node.name, rois, a["pad_ratio"])
        # onnxruntime's MaxRoiPool rounds the corners and forms the bins as Fast R-CNN does
        ctx.add_node("MaxRoiPool", [node.inputs[0], rois], [node.outputs[0]], name=node.name,
                     pooled_shape=[a["ph"], a["pw"]], spatial_scale=a["scale"])


def onnx_scored_roi_pool(ctx, node, a):
    """ONNX: MLIC-KD-WSD's ROIPooling: MaxRoiPool over the (R, 6) rois' first five columns, times
    score_scale x score + score_bias per roi."""
    name = node.name
    names = {k: ctx.tmp(f"{name}_{k}") for k in ("rows", "boxes", "score", "scaled", "factor", "factor4", "pooled")}
    ctx.add_node("Reshape", [node.inputs[1], ctx.const(np.array([-1, 6], np.int64))], [names["rows"]])
    ctx.add_node("Slice", [names["rows"], ctx.i64([0]), ctx.i64([5]), ctx.i64([1])], [names["boxes"]])
    ctx.add_node("Slice", [names["rows"], ctx.i64([5]), ctx.i64([6]), ctx.i64([1])], [names["score"]])
    ctx.add_node("Mul", [names["score"], ctx.f32(a["score"][0])], [names["scaled"]])
    ctx.add_node("Add", [names["scaled"], ctx.f32(a["score"][1])], [names["factor"]])
    ctx.add_node("Reshape", [names["factor"], ctx.const(np.array([-1, 1, 1, 1], np.int64))], [names["factor4"]])
    ctx.add_node("MaxRoiPool", [node.inputs[0], names["boxes"]], [names["pooled"]], name=name,
                 pooled_shape=[a["ph"], a["pw"]], spatial_scale=a["scale"])
    ctx.add_node("Mul", [names["pooled"], names["factor4"]], [node.outputs[0]])


def pad_kwarg(attrs):
    """The model.py constructor argument for a non-zero pad_ratio (none keeps older exports as they were)."""
    ratio = attrs.get("pad_ratio", 0.0)
    return {"pad_ratio": ratio} if ratio else {}


def onnx_pad_rois(ctx, name, rois, pad_ratio):
    """ONNX: (R, 5) rois with each side moved out by pad_ratio x the roi's size, in the fork's float32
    order ((x2 - x1 + 1) * ratio, then x1 - pad, x2 + pad)."""
    names = {k: ctx.tmp(f"{name}_{k}") for k in ("batch", "start", "end", "size", "size1", "pad", "lo", "hi", "out")}
    ctx.add_node("Slice", [rois, ctx.i64([0]), ctx.i64([1]), ctx.i64([1])], [names["batch"]])
    ctx.add_node("Slice", [rois, ctx.i64([1]), ctx.i64([3]), ctx.i64([1])], [names["start"]])
    ctx.add_node("Slice", [rois, ctx.i64([3]), ctx.i64([5]), ctx.i64([1])], [names["end"]])
    ctx.add_node("Sub", [names["end"], names["start"]], [names["size"]])
    ctx.add_node("Add", [names["size"], ctx.f32(1.0)], [names["size1"]])
    ctx.add_node("Mul", [names["size1"], ctx.f32(pad_ratio)], [names["pad"]])
    ctx.add_node("Sub", [names["start"], names["pad"]], [names["lo"]])
    ctx.add_node("Add", [names["end"], names["pad"]], [names["hi"]])
    ctx.add_node("Concat", [names["batch"], names["lo"], names["hi"]], [names["out"]], axis=1)
    return names["out"]


def ps_roi_attrs(lp, kind, field, bottoms=2, tops=None, roles="data, rois"):
    """The position-sensitive layers' shared fields (R-FCN's PSROIPooling, PSROIAlign,
    PSROIContextPooling): spatial_scale, output_dim and group_size, all required and the last two > 0."""
    need_blobs(lp, kind, bottoms, tops, roles=roles)
    p = getattr(lp, field)
    for f in ("spatial_scale", "output_dim", "group_size"):
        if not p.HasField(f):
            raise LayerError(f"{field}.{f} is required")
    if p.output_dim <= 0 or p.group_size <= 0:
        raise LayerError(f"{field}.output_dim and group_size must be > 0, "
                         f"got {p.output_dim} and {p.group_size}")
    return {"scale": float(p.spatial_scale), "dim": int(p.output_dim), "group": int(p.group_size)}


def ps_roi_shape(kind, attrs, in_shapes, rows_only=False):
    """(R, output_dim, group_size, group_size), the input holding output_dim x group_size^2 channels.
    rows_only: see _check_roi_shapes."""
    _check_roi_shapes(kind, in_shapes, rows_only)
    s, r = in_shapes
    g = attrs["group"]
    if s[1] != attrs["dim"] * g * g:
        raise LayerError(f"input has {s[1]} channels; output_dim {attrs['dim']} x group_size^2 {g * g} "
                         f"= {attrs['dim'] * g * g} are needed")
    return (r[0], attrs["dim"], g, g)


@register_layer("PSROIPooling")
class PSROIPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(ps_roi_avg_pool), TORCH_PSROI_POOLING
    roi_helpers = (TORCH_PSROI_BINS,)

    def parse(self, lp):
        attrs = ps_roi_attrs(lp, "PSROIPooling", "psroi_pooling_param")
        if lp.psroi_pooling_param.HasField("divide_type"):   # ypeiyu/PAMS-FCN's part-aligned bins
            # pams_psroi takes roi_rows and the shape check from this module: imported where used
            from .pams_psroi import pams_divide_type
            attrs["divide"] = pams_divide_type(lp.psroi_pooling_param, attrs["group"])
        return attrs

    def infer(self, attrs, in_shapes):
        if "divide" in attrs:
            from .pams_psroi import pams_top_shape
            return [pams_top_shape(attrs, in_shapes)]
        # R-FCN's Reshape reads only the rois' count (PPR-FCN's test nets declare (1, 4) rois)
        return [ps_roi_shape("PSROIPooling", attrs, in_shapes, rows_only=True)]

    def roi_function(self, attrs):
        if "divide" in attrs:
            from .pams_psroi import TORCH_PAMS_ROI_POOLING, pams_roi_avg_pool
            return pams_roi_avg_pool, TORCH_PAMS_ROI_POOLING
        return self.roi_fn, self.roi_source

    def roi_args(self, attrs):
        if "divide" in attrs:
            return (attrs["dim"], attrs["group"]), {"spatial_scale": attrs["scale"], "divide_type": attrs["divide"]}
        return (attrs["dim"], attrs["group"]), {"spatial_scale": attrs["scale"]}

    def onnx(self, ctx, node):
        if math.prod(ctx.shape(node.inputs[1])[1:]) != 5:
            raise ExportError(f"layer '{node.name}' (PSROIPooling): {ROIS_WANTED}, the net declares "
                              f"{list(ctx.shape(node.inputs[1]))}; give their shape with --input-shape")
        if "divide" in node.attrs:
            from .pams_psroi import onnx_pams_roi_pool, pams_parts
            onnx_pams_roi_pool(ctx, node, node.attrs["dim"], node.attrs["group"], node.attrs["scale"],
                               pams_parts(node.attrs["divide"], node.attrs["group"]))
            return
        onnx_ps_roi_pool(ctx, node, node.attrs["dim"], node.attrs["group"], node.attrs["scale"])


@register_layer("PSROIContextPooling")
class PSROIContextPooling(RoiLayerSpec):
    """alenaliu/PPR-FCN: (data, union rois, object rois) -> (R, output_dim, group_size, group_size)."""
    roi_fn, roi_source = staticmethod(ps_roi_context_pool), TORCH_PSROI_CONTEXT_POOLING
    roi_helpers = (TORCH_PSROI_BINS,)

    def parse(self, lp):
        if not lp.HasField("psroi_context_pooling_param") and lp.HasField("psroi_pooling_param"):
            raise LayerError("psroi_context_pooling_param is missing: the layer sets psroi_pooling_param, which "
                             "PPR-FCN's PSROIContextPooling does not read (the fork stops at 'output_dim must be > 0')")
        return ps_roi_attrs(lp, "PSROIContextPooling", "psroi_context_pooling_param", bottoms=3, tops=1,
                            roles="data, union rois, object rois")

    def infer(self, attrs, in_shapes):
        top = ps_roi_shape("PSROIContextPooling", attrs, in_shapes[:2])
        obj = in_shapes[2]
        if not obj or math.prod(obj[1:]) != 5:
            raise LayerError(f"PSROIContextPooling: the object boxes (third bottom) must be (R, 5) = "
                             f"[batch, x1, y1, x2, y2], got {list(obj)}")
        if obj[0] == 0 and top[0] > 0:
            raise LayerError("PSROIContextPooling: the object boxes (third bottom) are empty; "
                             "the fork reads the first one for every union roi")
        return [top]

    def roi_args(self, attrs):
        return (attrs["dim"], attrs["group"]), {"spatial_scale": attrs["scale"]}

    def onnx(self, ctx, node):
        onnx_ps_roi_pool(ctx, node, node.attrs["dim"], node.attrs["group"], node.attrs["scale"], keep_object=True)
