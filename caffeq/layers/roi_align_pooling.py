"""wk910930/caffe-fast-rcnn's ROIAlignPooling (4e6b382, src/caffe/layers/roi_align_pooling_layer.cu; its
Forward_cpu is NOT_IMPLEMENTED), the layer of wk910930/py-faster-rcnn's faster_rcnn_align nets:
roi_align_pooling_param pooled_h, pooled_w, spatial_scale [1], sample_num [1].  Bottoms data (N, C, H, W)
and rois (R, 5) or (R, 5, 1, 1) (Reshape checks); top (R, C, pooled_h, pooled_w).

In float32, as the kernel: the corners times spatial_scale, the roi max(end - start + 1, 1) wide, bin =
size / pooled; bin p spans [p * bin + start, (p + 1) * bin + start], each end clamped to [0, H] (W for x).
Its samples sit at the bin's start + i * bin / (sample_num + 1), i = 1 .. sample_num on each axis; a sample
below -0.5 or at or past the bin's clamped end is skipped.  A sample is read bilinearly after raising
a coordinate below 0.5 to 0 (not below 0: the kernel's own threshold), its low cell int(y), and at or
past the last row (column) both cells that row with the sample put on it; value = w1*v1 + w2*v2 + w3*v3
+ w4*v4 with w1..w4 = hh*hw, hh*lw, lh*hw, lh*lw.  The output is the max over the taken samples (the
kernel's `val > max` from -FLT_MAX), 0 where none is taken.  nvcc may fuse the sample positions'
multiply-adds, which can move a position by its last bit; this computes them with two roundings.

ONNX: the sample_num x sample_num sample positions of every bin in the kernel's float32 order, their bilinear
reads gathered from the channels-last map and the kernel's running max (ONNX RoiAlign's max mode samples other
points); a roi of an image outside the batch gives 0 there, where torch refuses it.
"""
import numpy as np
import torch

from .affordance import _OnnxGraph
from .registry import LayerError, need_blobs, register_layer, torch_sources
from .roi_align_forks import TORCH_ROI_ALIGN_COMMON, roi_align_batch
from .roi_bins_onnx import onnx_batch_column, onnx_bilinear_reads, onnx_finish_rois, onnx_padded_rows
from .roi_pooling import RoiLayerSpec, pooled_grid_attrs, roi_rows

FLT_MAX = 3.4028234663852886e38


def wk_align_axis(start, bin_size, pooled: int, size: int, samples: int):
    """One axis of the bins (start, bin_size: (R,) float32) -> [(sample positions (R, pooled), taken)]."""
    k = torch.arange(pooled, dtype=torch.float32)[None, :]
    zero, limit = torch.zeros((), dtype=torch.float32), torch.tensor(float(size), dtype=torch.float32)
    lo = torch.minimum(torch.maximum(k * bin_size[:, None] + start[:, None], zero), limit)
    hi = torch.minimum(torch.maximum((k + 1.0) * bin_size[:, None] + start[:, None], zero), limit)
    step = bin_size[:, None] / float(samples + 1)
    points = [lo + float(i) * step for i in range(1, samples + 1)]
    return [(p, (p >= -0.5) & (p < hi)) for p in points]


def wk_align_cells(at, size: int):
    """The kernel's bilinear cells of sample positions: (low, high, weight of high)."""
    at = torch.where(at < 0.5, torch.zeros_like(at), at)
    low = at.long()
    last = low >= size - 1
    low = torch.where(last, torch.full_like(low, size - 1), low)
    high = torch.where(last, low, low + 1)
    at = torch.where(last, low.to(at.dtype), at)
    return low, high, at - low.to(at.dtype)


def wk_roi_align_pool(x, rois, ph: int, pw: int, spatial_scale: float, samples: int):
    """wk910930's ROIAlignPooling -> (R, C, ph, pw): the max over samples x samples bilinear reads per bin."""
    r = roi_rows(rois, "ROIAlignPooling")
    n, c, h, w = x.shape
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    b = roi_align_batch(r, n, "ROIAlignPooling").to(x.device)[:, None, None]
    scale = torch.tensor(spatial_scale, dtype=torch.float32)
    start = r[:, 1:3] * scale   # (x, y)
    size = torch.clamp(r[:, 3:5] * scale - start + 1.0, min=1.0)
    ys = wk_align_axis(start[:, 1], size[:, 1] / float(ph), ph, h, samples)
    xs = wk_align_axis(start[:, 0], size[:, 0] / float(pw), pw, w, samples)
    dev, dt = x.device, x.dtype
    best = torch.full((r.shape[0], c, ph, pw), -3.4028234663852886e38, device=dev, dtype=dt)
    updated = torch.zeros((r.shape[0], 1, ph, pw), dtype=torch.bool, device=dev)
    for at_y, ok_y in ys:
        y0, y1, ly = wk_align_cells(at_y, h)
        ly = ly[:, None, :, None].to(dev, dt)
        for at_x, ok_x in xs:
            x0, x1, lx = wk_align_cells(at_x, w)
            lx = lx[:, None, None, :].to(dev, dt)
            hy, hx = 1.0 - ly, 1.0 - lx

            def cell(rows, cols):   # (R, C, ph, pw)
                return x[b, :, rows.to(dev)[:, :, None], cols.to(dev)[:, None, :]].permute(0, 3, 1, 2)

            val = hy * hx * cell(y0, x0) + hy * lx * cell(y0, x1) + ly * hx * cell(y1, x0) + ly * lx * cell(y1, x1)
            taken = (ok_y[:, :, None] & ok_x[:, None, :])[:, None].to(dev)
            best = torch.where(taken & (val > best), val, best)
            updated = updated | taken
    return torch.where(updated, best, torch.zeros((), device=dev, dtype=dt)).contiguous()


TORCH_WK_ROI_ALIGN_POOL = torch_sources(wk_align_axis, wk_align_cells, wk_roi_align_pool)


@register_layer("ROIAlignPooling")
class ROIAlignPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(wk_roi_align_pool), TORCH_WK_ROI_ALIGN_POOL
    roi_helpers = (TORCH_ROI_ALIGN_COMMON,)

    def parse(self, lp):
        need_blobs(lp, "ROIAlignPooling", 2, 1, roles="data, rois")
        p = lp.roi_align_pooling_param
        return {**pooled_grid_attrs(p, "roi_align_pooling_param"), "samples": max(0, int(p.sample_num))}

    def infer(self, attrs, in_shapes):
        x, r = (tuple(s) for s in in_shapes)
        if len(x) != 4:
            raise LayerError(f"ROIAlignPooling needs a 4-axis input, got {list(x)}")
        if len(r) < 2 or r[1] != 5 or any(d != 1 for d in r[2:]):   # its Reshape's two CHECKs
            raise LayerError(f"ROIAlignPooling: rois must be (R, 5) or (R, 5, 1, 1), got {list(r)}")
        return [(r[0], x[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], "samples": attrs["samples"]}

    def onnx(self, ctx, node):
        emit_wk_roi_align_pool(ctx, node)


def _onnx_axis_samples(g, start, bin_size, pooled, size, samples):
    """wk_align_axis and wk_align_cells in ONNX for (R, 1) starts and bin sizes: per sample i, (taken, low, high,
    weight of high), each (R, pooled)."""
    k = g.f32(np.arange(pooled, dtype=np.float32)[None, :])
    k1 = g.f32(np.arange(1, pooled + 1, dtype=np.float32)[None, :])
    zero, limit = g.f32(0.0), g.f32(float(size))
    lo = g.op("Min", g.op("Max", g.op("Add", g.op("Mul", k, bin_size), start), zero), limit)
    hi = g.op("Min", g.op("Max", g.op("Add", g.op("Mul", k1, bin_size), start), zero), limit)
    step = g.op("Div", bin_size, g.f32(float(samples + 1)))
    out = []
    for i in range(1, samples + 1):
        at = g.op("Add", lo, g.op("Mul", g.f32(float(i)), step))
        taken = g.op("And", g.op("GreaterOrEqual", at, g.f32(-0.5)), g.op("Less", at, hi))
        at = g.op("Where", g.op("Less", at, g.f32(0.5)), zero, at)
        low = g.op("Cast", at, to=7)
        last = g.op("GreaterOrEqual", low, g.i64(size - 1))
        low = g.op("Where", last, g.i64(size - 1), low)
        high = g.op("Where", last, low, g.op("Add", low, g.i64(1)))
        low_f = g.op("Cast", low, to=1)
        out.append((taken, low, high, g.op("Sub", g.op("Where", last, low_f, at), low_f)))
    return out


def emit_wk_roi_align_pool(ctx, node):
    """wk_roi_align_pool in ONNX: every sample pair's bilinear reads (onnx_bilinear_reads), the running max from
    -FLT_MAX where taken, 0 for a bin with none; a roi of an image outside the batch gives 0 (torch refuses)."""
    a = node.attrs
    x, rois = node.inputs
    n, c, h, w = ctx.shape(x)
    g = _OnnxGraph(ctx)
    rows, count = onnx_padded_rows(ctx, rois, 5)
    batch, in_batch = onnx_batch_column(ctx, rows, n)
    base = g.op("Unsqueeze", g.op("Mul", batch, g.i64(h * w)), g.i64([1, 2]))                      # (R, 1, 1)
    scale = g.f32(float(np.float32(a["scale"])))
    start = g.op("Mul", g.op("Slice", rows, g.i64([1]), g.i64([3]), g.i64([1])), scale)            # (R, 2): x, y
    end = g.op("Mul", g.op("Slice", rows, g.i64([3]), g.i64([5]), g.i64([1])), scale)
    size = g.op("Max", g.op("Add", g.op("Sub", end, start), g.f32(1.0)), g.f32(1.0))

    def column(v, k):
        return g.op("Slice", v, g.i64([k]), g.i64([k + 1]), g.i64([1]))
    ys = _onnx_axis_samples(g, column(start, 1), g.op("Div", column(size, 1), g.f32(float(a["ph"]))), a["ph"], h,
                            a["samples"])
    xs = _onnx_axis_samples(g, column(start, 0), g.op("Div", column(size, 0), g.f32(float(a["pw"]))), a["pw"], w,
                            a["samples"])
    table = g.op("Reshape", g.op("Transpose", x, perm=[0, 2, 3, 1]), g.i64([-1, c]))             # (N H W, C)
    best = updated = None
    for y in ys:
        for xx in xs:
            taken, val = onnx_bilinear_reads(g, table, base, y, xx, w)
            if best is None:
                floor = g.f32(-FLT_MAX)
                best = g.op("Where", g.op("And", taken, g.op("Greater", val, floor)), val, floor)
                updated = taken
                continue
            best = g.op("Where", g.op("And", taken, g.op("Greater", val, best)), val, best)
            updated = g.op("Or", updated, taken)
    if best is None:   # sample_num 0: no sample, every bin 0
        out = g.op("Expand", g.f32(0.0), g.op("Concat", g.op("Shape", batch), g.i64([a["ph"], a["pw"], c]), axis=0))
    else:
        out = g.op("Where", updated, best, g.f32(0.0))
    out = g.op("Transpose", out, perm=[0, 3, 1, 2])                                                 # (R, C, ph, pw)
    onnx_finish_rois(ctx, node, out, count, g.op("Reshape", g.op("Not", in_batch), g.i64([-1, 1, 1, 1])))
