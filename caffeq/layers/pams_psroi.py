"""ypeiyu/PAMS-FCN's part-aligned PSROIPooling: psroi_pooling_param.divide_type (the PSROIPooling spec in
roi_pooling.py calls into this module when the field is set).

ypeiyu/PAMS-FCN e4c9682 (caffe/src/caffe/layers/psroi_pooling_layer.cu; its Forward_cpu is NOT_IMPLEMENTED,
so this is the GPU kernel), with `divide_type` set (0 or 1): part-aligned bins.  The top is (R, output_dim,
1, group_size) from output_dim x group_size channels, bin p of output channel o averaging channel
o group_size + p.  The bins lie in five parts of the roi (R-FCN's float32 start and size): the head (the top
0.23 of the height, from 0.15 to 0.85 of the width) and the top 0.3, 0.5, 0.7 and all of the roi at full
width, split into columns x rows of 3 x 3, 5 x 4, 5 x 6, 5 x 8, 5 x 12 (divide_type 0: 159 bins) or 3 x 2,
4 x 3, 4 x 5, 4 x 7, 4 x 10 (divide_type 1: 106 bins), numbered part by part, row-major; within a part of
bounds [ps, pe) (float32: pe = ps + share x size), bin (i, j) is [floor(ps + i d), ceil(ps + (i + 1) d))
with d = (pe - ps) / rows (columns alike), clipped to the map; the mean, 0 for an empty bin.  The published
source never reads the field (its caffe.proto has it commented out, its LayerSetUp/Reshape are R-FCN's):
the (R, output_dim, 1, group_size) top and the output_dim x group_size channels come from the kernel's
indexing and the fork's nets (their Slice on axis 3 at the part bounds, their convolutions' num_output).
Refused: another divide_type (the kernel writes nothing) and a group_size above the layout's bins (the
kernel reads an unset part).  The float32 steps are written unfused, as for R-FCN.

The torch functions serve PSROIPooling's forward and are copied into model.py (inspect.getsource), beside
roi_pooling's shared roi helpers (roi_rows, roi_batch_index).  ONNX: plain ops, 0/1 masks of every roi's
bins and two Einsums (onnx_pams_roi_pool), as R-FCN's form in roi_bins_onnx.py.
This module takes roi_pooling's helpers, so roi_pooling imports it where the spec uses it (no import cycle).
"""
import numpy as np
import torch

from .c_numerics import c_round, onnx_c_round
from .registry import LayerError, torch_sources
from .roi_bins_onnx import onnx_bin_mask, onnx_finish_rois, onnx_image_onehot, onnx_padded_rows
from .roi_pooling import _check_roi_shapes, roi_batch_index, roi_rows

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def pams_parts(divide_type: int, group_size: int):
    """ypeiyu/PAMS-FCN's part-aligned layout: per bin (height share, width offset, width share, columns, rows,
    row i, column j) for the first group_size bins; the parts' bins numbered row-major, one part after another."""
    if divide_type == 0:
        parts = [(0.23, 0.15, 0.7, 3, 3), (0.3, 0.0, 1.0, 5, 4), (0.5, 0.0, 1.0, 5, 6), (0.7, 0.0, 1.0, 5, 8),
                 (1.0, 0.0, 1.0, 5, 12)]
    else:
        parts = [(0.23, 0.15, 0.7, 3, 2), (0.3, 0.0, 1.0, 4, 3), (0.5, 0.0, 1.0, 4, 5), (0.7, 0.0, 1.0, 4, 7),
                 (1.0, 0.0, 1.0, 4, 10)]
    return [(share_h, off_w, share_w, cols, rows, k // cols, k % cols)
            for share_h, off_w, share_w, cols, rows in parts for k in range(cols * rows)][:group_size]


def pams_roi_bins(r, spatial_scale: float, divide_type: int, group_size: int, h: int, w: int):
    """ypeiyu/PAMS-FCN's part-aligned bins of the (R, 5) rois (float32, CPU, as its CUDA kernel): hstart, hend,
    wstart, wend (R, group_size), clipped to the h x w map."""
    table = pams_parts(divide_type, group_size)
    f32 = torch.float32
    share_h, off_w, share_w, cols, rows, i, j = (torch.tensor(v, dtype=f32)[None, :] for v in zip(*table))
    scale = torch.tensor(spatial_scale, dtype=f32)
    corners = c_round(r[:, 1:5].double())  # x1, y1, x2, y2
    start = corners[:, :2].float() * scale
    size = torch.maximum((corners[:, 2:] + 1.0).float() * scale - start, torch.tensor(0.1, dtype=f32))
    top = start[:, 1:2].expand(-1, share_h.shape[1])
    bottom = top + size[:, 1:2] * share_h
    left = start[:, 0:1] + size[:, 0:1] * off_w
    right = left + size[:, 0:1] * share_w
    bin_h = (bottom - top) / rows
    bin_w = (right - left) / cols
    hs = torch.floor(top + i * bin_h).long().clamp(0, h)
    he = torch.ceil(top + (i + 1) * bin_h).long().clamp(0, h)
    ws = torch.floor(left + j * bin_w).long().clamp(0, w)
    we = torch.ceil(left + (j + 1) * bin_w).long().clamp(0, w)
    return hs, he, ws, we


def pams_roi_avg_pool(x, rois, output_dim: int, group_size: int, spatial_scale: float, divide_type: int):
    """ypeiyu/PAMS-FCN's PSROIPooling with divide_type -> (R, output_dim, 1, group_size): bin p of output
    channel o is the mean of channel o group_size + p over the roi's p-th part-aligned bin (0 if empty)."""
    kind = "PSROIPooling"
    r = roi_rows(rois, kind)
    n, _, h, w = x.shape
    g = group_size
    if r.shape[0] == 0:
        return x.new_zeros((0, output_dim, 1, g))
    batch = torch.trunc(r[:, 0]).long()
    outside = (batch < 0) | (batch >= n)
    if bool(outside.any()):
        roi_batch_index(r[outside][0], n, kind)   # raises, naming the index
    hs, he, ws, we = pams_roi_bins(r, spatial_scale, divide_type, g, h, w)   # (R, g) each
    mh = ((torch.arange(h) >= hs[..., None]) & (torch.arange(h) < he[..., None])).to(x.device, x.dtype)
    mw = ((torch.arange(w) >= ws[..., None]) & (torch.arange(w) < we[..., None])).to(x.device, x.dtype)
    area = ((he - hs).clamp(min=0) * (we - ws).clamp(min=0))[:, None, :].to(x.device, x.dtype)   # (R, 1, g)
    onehot = (batch[:, None] == torch.arange(n)[None, :]).to(x.device, x.dtype)   # (R, N)
    by_cols = torch.einsum("nophw,rpw->nroph", x.reshape(n, output_dim, g, h, w), mw)
    sums = torch.einsum("nroph,rn,rph->rop", by_cols, onehot, mh)
    return torch.where(area > 0, sums / area.clamp(min=1), torch.zeros_like(sums))[:, :, None, :]


TORCH_PAMS_ROI_POOLING = torch_sources(pams_parts, pams_roi_bins, pams_roi_avg_pool)
PAMS_BINS = {0: 159, 1: 106}   # the bins of divide_type 0 and 1


# ---- PSROIPooling's divide_type branches (roi_pooling.PSROIPooling calls these) -----------

def pams_divide_type(p, group_size: int):
    """psroi_pooling_param.divide_type of `p` (set), checked against the layout and group_size."""
    bins = PAMS_BINS.get(p.divide_type)
    if bins is None:
        raise LayerError(f"psroi_pooling_param.divide_type must be 0 or 1 (PAMS-FCN's kernel writes nothing "
                         f"for another), got {p.divide_type}")
    if group_size > bins:
        raise LayerError(f"psroi_pooling_param.group_size {group_size} exceeds divide_type "
                         f"{p.divide_type}'s {bins} part-aligned bins")
    return int(p.divide_type)


def pams_top_shape(attrs, in_shapes):
    """(R, output_dim, 1, group_size), the input holding output_dim x group_size channels."""
    _check_roi_shapes("PSROIPooling", in_shapes, rows_only=True)
    s, r = in_shapes
    dim, g = attrs["dim"], attrs["group"]
    if s[1] != dim * g:
        raise LayerError(f"input has {s[1]} channels; PAMS-FCN's divide_type needs output_dim {dim} x "
                         f"group_size {g} = {dim * g}")
    return (r[0], dim, 1, g)


# ---- ONNX ----------------------------------------------------------------------------------

def onnx_pams_roi_pool(ctx, node, dim, g, scale, table):
    """ypeiyu/PAMS-FCN's PSROIPooling with divide_type in plain ONNX ops (pams_roi_avg_pool): R-FCN's roi start
    and size (the corners rounded in double as C's round(), the rest float32), then each of the g part-aligned
    bins of `table` (pams_parts: per bin height share, width offset, width share, columns, rows,
    row, column) in the same float32 steps, 0/1 masks, and the sums as two Einsums over the (N, dim, g, H, W)
    view with a one-hot of each roi's image -> (R, dim, 1, g)."""
    x, rois = node.inputs[:2]
    _, _, h, w = ctx.shape(x)
    f32, i64 = 1, 7
    op = ctx.op
    rows, count = onnx_padded_rows(ctx, rois, 5)     # a padding row: onnxruntime's Einsum takes no 0 rois
    batch = op("Cast", [op("Gather", [rows, ctx.i64(0)], "batch", axis=1)], "batch", to=i64)
    rounded = onnx_c_round(ctx, op("Slice", [rows, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], "corners"),
                           in_double=True)
    first = op("Slice", [rounded, ctx.i64([0]), ctx.i64([2]), ctx.i64([1])], "first")
    last = op("Add", [op("Slice", [rounded, ctx.i64([2]), ctx.i64([4]), ctx.i64([1])], "last"),
                      ctx.const(np.array(1.0, np.float64))], "last")
    scale_c = ctx.f32(float(np.float32(scale)))
    start = op("Mul", [op("Cast", [first], "start", to=f32), scale_c], "start")      # (R, 2): x, y
    end = op("Mul", [op("Cast", [last], "end", to=f32), scale_c], "end")
    size = op("Max", [op("Sub", [end, start], "size"), ctx.f32(float(np.float32(0.1)))], "size")
    cols_of = [np.array([t[k] for t in table], np.float32).reshape(1, g) for k in range(7)]
    share_h, off_w, share_w, n_cols, n_rows, i, j = (ctx.const(c) for c in cols_of)
    i1, j1 = (ctx.const(c + np.float32(1)) for c in cols_of[5:7])

    def axis(k, hint):
        return op("Slice", [start, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], hint + "0"), \
            op("Slice", [size, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], hint + "_size")
    top, height = axis(1, "y")
    left0, width = axis(0, "x")
    top = op("Add", [top, ctx.const(np.zeros((1, g), np.float32))], "top")          # (R, g)
    bottom = op("Add", [top, op("Mul", [height, share_h], "part_h")], "bottom")
    left = op("Add", [left0, op("Mul", [width, off_w], "part_x")], "left")
    right = op("Add", [left, op("Mul", [width, share_w], "part_w")], "right")
    masks, spans = [], []
    for lo_edge, hi_edge, parts, k0, k1, extent in ((top, bottom, n_rows, i, i1, h), (left, right, n_cols, j, j1, w)):
        step = op("Div", [op("Sub", [hi_edge, lo_edge], "span"), parts], "bin")
        lo = op("Floor", [op("Add", [lo_edge, op("Mul", [k0, step], "k")], "lo")], "lo")
        hi = op("Ceil", [op("Add", [lo_edge, op("Mul", [k1, step], "k")], "hi")], "hi")
        _, _, mask, span = onnx_bin_mask(ctx, lo, hi, extent)
        masks.append(mask)
        spans.append(span)
    area = op("Unsqueeze", [op("Mul", spans, "area"), ctx.i64([1])], "area")           # (R, 1, g)
    planes = op("Reshape", [x, ctx.i64([0, dim, g, h, w])], "planes")
    by_cols = op("Einsum", [planes, masks[1]], "cols", equation="nophw,rpw->nroph")
    sums = op("Einsum", [by_cols, onnx_image_onehot(ctx, x, batch), masks[0]], "sums", equation="nroph,rn,rph->rop")
    mean = op("Div", [sums, op("Max", [area, ctx.f32(1.0)], "divisor")], "mean")
    kept = op("Where", [op("Greater", [area, ctx.f32(0.0)], "filled"), mean, ctx.f32(0.0)], "kept_mean")
    onnx_finish_rois(ctx, node, op("Unsqueeze", [kept, ctx.i64([2])], "pooled"), count)
