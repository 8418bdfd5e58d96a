"""PSROIAlign: afantideng/R-FCN-PSROIAlign (cd4b283; psroi_align_layer.cu, psori_align_layer.cpp).

R-FCN's position-sensitive pooling with bilinear samples instead of whole cells.  psroi_align_param
(spatial_scale, output_dim, group_size as PSROIPooling; sample_num, default 2).  Top
(R, output_dim, group_size, group_size); the input holds output_dim x group_size^2 channels and bin
(i, j) of output channel c reads input channel (c * group_size + i) * group_size + j.

Per roi [batch, x1, y1, x2, y2] (batch truncated to int; the corners are not rounded), in float32:
start = (x1, y1) x scale, end = (x2 + 1, y2 + 1) x scale, size = max(end - start, 0.1),
bin = size / group_size.  Bin k spans [k * bin + start, (k + 1) * bin + start], both ends clamped to
[0, H - 1] (x: [0, W - 1]); a bin whose ends meet or cross gives 0.  Its samples sit at
clamped start + i * bin / (sample_num + 1), i = 1..sample_num, on each axis; a sample at or past the
clamped end is skipped (adds 0).  Each sample is read bilinearly from its floor cell and the next
one (at the map's last row / column both are that row / column); the sum is divided by
sample_num^2 whatever the count of samples taken.  Taken samples lie in [0, H - 1), so the fork's
out-of-map branch (which would reuse the previous sample's value) never runs.

The sample grid is computed on the CPU in float32, the gathers on the input's device.  The torch
functions below serve `forward` and are copied into model.py (inspect.getsource); both add the samples
in the fork's order.  ONNX has no position-sensitive op and its RoiAlign samples other points, so the
export writes the layer in plain ops (onnx_psroi_align): a sample's bilinear weights split into a row
and a column factor, and so does whether it is taken, so the mean over the sample grid is a sum over
cells weighted by (R, g, H) row and (R, g, W) column weights, two Einsums (to float rounding, not to
the bit: the sums run in another order).
"""
import numpy as np
import torch

from ..errors import ExportError
from .registry import LayerError, register_layer, torch_sources
from .roi_bins_onnx import onnx_finish_rois, onnx_padded_rows, onnx_ps_weighted_sums
from .roi_pooling import (
    ROIS_WANTED,
    RoiLayerSpec,
    ps_roi_attrs,
    ps_roi_shape,
    roi_batch_index,
    roi_rows,
)

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def psroi_align_axis(start, bin_size, group: int, samples: int, size: int):
    """One axis of PSROIAlign's sampling for R rois (start, bin_size: (R,) float32) on a map `size` long:
    empty bins (R, group); for the samples (R, group, samples): taken, low and high cell, their weights."""
    f32 = torch.float32
    k = torch.arange(group, dtype=f32)
    last = float(size - 1)
    lo = (k[None, :] * bin_size[:, None] + start[:, None]).clamp(0.0, last)
    hi = ((k[None, :] + 1.0) * bin_size[:, None] + start[:, None]).clamp(0.0, last)
    step = bin_size / torch.tensor(float(samples + 1), dtype=f32)
    i = torch.arange(1, samples + 1, dtype=f32)
    at = lo[:, :, None] + i[None, None, :] * step[:, None, None]
    taken = at < hi[:, :, None]
    at = at.clamp(0.0, last)   # taken samples already lie in [0, size - 1): this only keeps skipped ones in the map
    low = at.long()
    edge = low >= size - 1     # the fork's last row / column: both cells are it, the weight all on it
    low = torch.where(edge, torch.full_like(low, size - 1), low)
    high = torch.where(edge, low, low + 1)
    frac = at - low.to(f32)
    return lo >= hi, taken, low, high, 1.0 - frac, frac


def ps_roi_align(x, rois, output_dim: int, group_size: int, spatial_scale: float, sample_num: int = 2):
    """afantideng/R-FCN-PSROIAlign's PSROIAlign -> (R, output_dim, group_size, group_size); x has
    output_dim * group_size^2 channels."""
    f32 = torch.float32
    r = roi_rows(rois, "PSROIAlign")
    n, _, h, w = x.shape
    g, dim, s = group_size, output_dim, sample_num
    if r.shape[0] == 0:
        return x.new_zeros((0, dim, g, g))
    batch = torch.tensor([roi_batch_index(roi, n, "PSROIAlign") for roi in r])
    scale = torch.tensor(spatial_scale, dtype=f32)
    start = r[:, 1:3] * scale            # (x, y)
    end = (r[:, 3:5] + 1.0) * scale
    size = torch.maximum(end - start, torch.tensor(0.1, dtype=f32))
    bin_size = size / torch.tensor(float(g), dtype=f32)
    empty_y, taken_y, y0, y1, hy, ly = psroi_align_axis(start[:, 1], bin_size[:, 1], g, s, h)
    empty_x, taken_x, x0, x1, hx, lx = psroi_align_axis(start[:, 0], bin_size[:, 0], g, s, w)
    dev, dt = x.device, x.dtype
    x5 = x.reshape(n, dim, g, g, h, w)
    b = batch.to(dev)[:, None, None]
    p = torch.arange(g, device=dev)[None, :, None]
    q = torch.arange(g, device=dev)[None, None, :]

    def cell(yi, xi):   # (R, dim, g, g): bin (p, q) of each roi at row yi[r, p], column xi[r, q]
        return x5[b, :, p, q, yi.to(dev), xi.to(dev)].permute(0, 3, 1, 2)

    total = torch.zeros((r.shape[0], dim, g, g), device=dev, dtype=dt)
    for i in range(s):
        for j in range(s):
            ya, yb = y0[:, :, i, None], y1[:, :, i, None]    # (R, g, 1)
            xa, xb = x0[:, None, :, j], x1[:, None, :, j]    # (R, 1, g)
            wy0, wy1 = hy[:, :, i, None], ly[:, :, i, None]
            wx0, wx1 = hx[:, None, :, j], lx[:, None, :, j]
            weights = [(wy0 * wx0), (wy0 * wx1), (wy1 * wx0), (wy1 * wx1)]
            cells = [cell(ya, xa), cell(ya, xb), cell(yb, xa), cell(yb, xb)]
            val = None
            for wt, u in zip(weights, cells):
                term = wt[:, None].to(dev, dt) * u
                val = term if val is None else val + term
            taken = (taken_y[:, :, i, None] & taken_x[:, None, :, j])[:, None].to(dev)
            total = total + torch.where(taken, val, torch.zeros((), device=dev, dtype=dt))
    empty = (empty_y[:, :, None] | empty_x[:, None, :])[:, None].to(dev)
    out = total / torch.tensor(float(s * s), device=dev, dtype=dt)
    return torch.where(empty, torch.zeros((), device=dev, dtype=dt), out)


TORCH_PSROI_ALIGN = torch_sources(psroi_align_axis, ps_roi_align)


# ---- ONNX ----------------------------------------------------------------------------------

def onnx_psroi_align_axis(ctx, start, bin_size, group, samples, size):
    """psroi_align_axis in ONNX ops for R rois (start, bin_size: (R, 1) float32): the (R, g, size) weights of
    the cells, summed over the taken samples, and the (R, g) empty bins."""
    f32 = 1
    last = float(size - 1)
    bounds = (ctx.f32(0.0), ctx.f32(last))
    k = ctx.const(np.arange(group, dtype=np.float32).reshape(1, group))
    k1 = ctx.const(np.arange(1, group + 1, dtype=np.float32).reshape(1, group))
    lo = ctx.op("Clip", [ctx.op("Add", [ctx.op("Mul", [k, bin_size], "k"), start], "lo"), *bounds], "lo")
    hi = ctx.op("Clip", [ctx.op("Add", [ctx.op("Mul", [k1, bin_size], "k"), start], "hi"), *bounds], "hi")
    step = ctx.op("Div", [bin_size, ctx.f32(float(samples + 1))], "step")                     # (R, 1)
    i = ctx.const(np.arange(1, samples + 1, dtype=np.float32).reshape(1, 1, samples))
    at = ctx.op("Add", [ctx.op("Unsqueeze", [lo, ctx.i64([2])], "lo"),
                        ctx.op("Mul", [i, ctx.op("Unsqueeze", [step, ctx.i64([2])], "step")], "i")], "at")
    taken = ctx.op("Cast", [ctx.op("Less", [at, ctx.op("Unsqueeze", [hi, ctx.i64([2])], "hi")], "taken")],
                   "taken", to=f32)                                                            # (R, g, s)
    at = ctx.op("Clip", [at, *bounds], "at")
    low = ctx.op("Min", [ctx.op("Floor", [at], "low"), ctx.f32(last)], "low")
    high = ctx.op("Min", [ctx.op("Add", [low, ctx.f32(1.0)], "high"), ctx.f32(last)], "high")
    frac = ctx.op("Sub", [at, low], "frac")
    cells = ctx.const(np.arange(size, dtype=np.float32).reshape(1, 1, 1, size))
    weights = []
    for cell, weight in ((low, ctx.op("Sub", [ctx.f32(1.0), frac], "w_low")), (high, frac)):
        hit = ctx.op("Cast", [ctx.op("Equal", [cells, ctx.op("Unsqueeze", [cell, ctx.i64([3])], "cell")], "hit")],
                     "hit", to=f32)
        weights.append(ctx.op("Mul", [hit, ctx.op("Unsqueeze", [ctx.op("Mul", [weight, taken], "w"), ctx.i64([3])],
                                                                "w")], "weighted"))
    per_cell = ctx.op("ReduceSum", [ctx.op("Add", weights, "both"), ctx.i64([2])], "per_cell", keepdims=0)
    return per_cell, ctx.op("GreaterOrEqual", [lo, hi], "empty")


def onnx_psroi_align(ctx, node, dim, g, scale, samples):
    """PSROIAlign as plain ONNX ops (see the module docstring)."""
    i64 = 7
    x, rois = node.inputs
    _, _, h, w = ctx.shape(x)
    rows, count = onnx_padded_rows(ctx, rois, 5)     # a padding row: onnxruntime's Einsum takes no 0 rois
    batch = ctx.op("Cast", [ctx.op("Gather", [rows, ctx.i64(0)], "batch", axis=1)], "batch", to=i64)
    scale_c = ctx.f32(float(np.float32(scale)))
    start = ctx.op("Mul", [ctx.op("Slice", [rows, ctx.i64([1]), ctx.i64([3]), ctx.i64([1])], "first"), scale_c],
                   "start")                                                                   # (R, 2): x, y
    end = ctx.op("Mul", [ctx.op("Add", [ctx.op("Slice", [rows, ctx.i64([3]), ctx.i64([5]), ctx.i64([1])], "last"),
                                        ctx.f32(1.0)], "last"), scale_c], "end")
    size = ctx.op("Max", [ctx.op("Sub", [end, start], "size"), ctx.f32(float(np.float32(0.1)))], "size")
    bin_size = ctx.op("Div", [size, ctx.f32(float(g))], "bin")
    axes = []
    for axis, extent in ((1, h), (0, w)):   # y then x
        pick = (ctx.i64([axis]), ctx.i64([axis + 1]), ctx.i64([1]))
        axes.append(onnx_psroi_align_axis(ctx, ctx.op("Slice", [start, *pick], "s"),
                                          ctx.op("Slice", [bin_size, *pick], "b"), g, samples, extent))
    (rows_w, empty_y), (cols_w, empty_x) = axes
    sums = onnx_ps_weighted_sums(ctx, x, batch, rows_w, cols_w, dim, g, h, w)
    mean = ctx.op("Div", [sums, ctx.f32(float(samples * samples))], "mean")
    empty = ctx.op("Unsqueeze", [ctx.op("Or", [ctx.op("Unsqueeze", [empty_y, ctx.i64([2])], "ey"),
                                               ctx.op("Unsqueeze", [empty_x, ctx.i64([1])], "ex")], "empty"),
                                 ctx.i64([1])], "empty")
    onnx_finish_rois(ctx, node, mean, count, empty)


# ---- the spec ------------------------------------------------------------------------------

@register_layer("PSROIAlign")
class PSROIAlign(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(ps_roi_align), TORCH_PSROI_ALIGN

    def parse(self, lp):
        attrs = ps_roi_attrs(lp, "PSROIAlign", "psroi_align_param")
        n = lp.psroi_align_param.sample_num
        if n <= 0:   # the fork divides by sample_num^2 after no samples: NaN or 0 everywhere
            raise LayerError(f"psroi_align_param.sample_num must be > 0, got {n}")
        attrs["samples"] = int(n)
        return attrs

    def infer(self, attrs, in_shapes):
        return [ps_roi_shape("PSROIAlign", attrs, in_shapes)]

    def roi_args(self, attrs):
        return (attrs["dim"], attrs["group"]), {"spatial_scale": attrs["scale"], "sample_num": attrs["samples"]}

    def onnx(self, ctx, node):
        import math
        if math.prod(ctx.shape(node.inputs[1])[1:]) != 5:
            raise ExportError(f"layer '{node.name}' (PSROIAlign): {ROIS_WANTED}, the net declares "
                              f"{list(ctx.shape(node.inputs[1]))}; give their shape with --input-shape")
        a = node.attrs
        onnx_psroi_align(ctx, node, a["dim"], a["group"], a["scale"], a["samples"])
