"""xw-hu/SINet (scale-insensitive vehicle detection, a Faster R-CNN / MS-CNN fork), 0ef178f:
CAROIPooling (src/caffe/layers/caroi_pooling_layer.cpp/.cu), ROISplit (roi_split_layer.cpp) and
ROIFeatureSplit (roi_feature_split_layer.cpp/.cu); fields in src/caffe/proto/caffe.proto.  Its BoxOutput
is MS-CNN's (caffeq/layers/mscnn_proposals.py) without the bbox_reg_param de-normalization.

ROIFeatureSplit has no CPU forward (NOT_IMPLEMENTED), so the fork runs its nets on the GPU only: every
layer here follows the fork's GPU kernels where it has them (ROISplit has only a CPU forward).

CAROIPooling (context-aware RoI pooling; bottoms data (N, C, H, W), rois (R, 5) = [batch, x1, y1, x2, y2]):
- pad = (x2 - x1 + 1) pad_ratio (float32, the same for y); start = C round(fmaf(-(x2 - x1 + 1), pad_ratio, x1)
  spatial_scale), end = C round(fmaf(x2 - x1 + 1, pad_ratio, x2) spatial_scale) (nvcc contracts x1 - pad and
  x2 + pad); start raised to 0; end cut to round(W / spatial_scale) - 1 (the
  image's size, not the map's: in effect no cut); roi_w = max(end - start + 1, 1) (the same for h).
- bin_h = roi_h / pooled_h, bin_w = roi_w / pooled_w (float32).  Both >= 1: Fast R-CNN's max pooling over
  the bins floor(i bin_h) .. ceil((i + 1) bin_h) offset by start and clipped to the map (empty: 0).
- A roi smaller than the grid on some axis is resampled bilinearly (corners aligned) from the roi's cells,
  a cell outside the map reading the nearest edge cell and a tap at or past the roi's last cell reading 0:
  position m of an axis resized from M cells to E maps to ratio = (M - 1) / (E - 1) (float32),
  k = floor(ratio m), fraction fmaf(ratio, m, -k) (nvcc contracts the kernel's ratio * m - k), and two taps
  mix as fmaf(t, hi, fmaf(-lo, t, lo)):
  * bin_h > 1 (and bin_w < 1): only the width is resampled (roi_w cells to pooled_w); each output is the max
    of the resampled column pw over rows floor(ph bin_h) .. ceil((ph + 1) bin_h), those bin limits and
    pw .. pw + 1 clipped to the map's H and W (not the roi's), empty: 0; NaN values are passed by (the
    kernel's v > maxval), a bin of nothing else gives -FLT_MAX;
  * bin_w > 1 (and bin_h < 1): the same with the axes swapped;
  * otherwise (both < 1, or one exactly 1): the roi resampled to pooled_h x pooled_w, width first.
  With pooled_h (or pooled_w) 1 and a 1-cell roi the ratio is 0 / 0: NaN, as in the fork.  fmaf is emulated
  exactly (fma32: float64, rounded to odd where a float64 sum lands on a float32 midpoint).  The small rois
  are computed together, case by case, in chunks of rois of similar depth.
  The fork's CPU forward (cv::resize INTER_LINEAR, half-pixel centres) differs; it never runs these nets.

ROISplit (bottom rois (R, 5+)): area = int(y2 - y1 + 1) * int(x2 - x1 + 1) (float32 sums truncated);
branch 1 (small) when area < split_area1; with branch_num 2 the rest is branch 2 (large); with 3, branch 2
(middle) up to split_area2 inclusive, branch 3 above.  Tops: the count of each branch (branch_num, 1, 1, 1)
(the fork's Reshape gives (2, 1, 1, 1) for branch_num 3 too and writes its third count past the blob's end:
caffeq gives three) and the table (R, 2, 1, 1) = [index within its branch, branch].  In TRAIN the fork jitters
the split areas with Gaussian noise (fluctuation_range_*); at TEST they are fixed.

ROIFeatureSplit (bottoms features (R, C, H, W), counts, table): top k is (max(count_k, 1), C, H, W); each
row r goes to row max(table[r, 0], 0) of top table[r, 1] (1-based; other values: dropped).  A branch with no
roi gets one row the fork never writes (whatever its GPU memory held: zeros on the first forward): zeros here.
How many rows come out depends on the data; ONNX cannot express the pooling's per-roi branches or the split's
sizes, and refuses both; ROISplit exports.
"""
import math

import torch

from .c_numerics import c_round
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from .roi_pooling import (
    TORCH_ROI_COMMON,
    TORCH_ROI_POOLING,
    max_over_bins,
    range_max_bins,
    roi_batch_index,
    roi_rows,
)

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def fma32(a, b, c):
    """CUDA's fmaf(a, b, c) of float32 tensors: one rounding of the exact a b + c.  The product is exact in
    float64 and rounding the float64 sum to float32 is exact too, unless that sum fell on a float32 midpoint
    (or in float32's subnormal range) while the exact value did not: there the float64 sum is rounded to
    odd instead (an even last bit moves one step toward the sum's error, found by TwoSum)."""
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    p = a * b
    s = p + c
    tie = (s.view(torch.int64) & 0x1FFFFFFF) == 0x10000000
    suspect = tie | ((s.abs() < 2.0 ** -125) & (s != 0))
    if bool(suspect.any()):
        ps, cs, ss = p[suspect], c[suspect], s[suspect]
        z = ss - ps
        err = (ps - (ss - z)) + (cs - z)
        move = (err != 0) & torch.isfinite(ss) & ((ss.view(torch.int64) & 1) == 0)
        inf = torch.tensor(float("inf"), dtype=ss.dtype, device=ss.device)
        s = s.clone()
        s[suspect] = torch.where(move, torch.nextafter(ss, torch.where(err > 0, inf, -inf)), ss)
    return s.float()


def caroi_taps(ratio, n: int):
    """The kernel's taps along an axis for positions m = 0 .. n - 1 of each roi (ratio (R,) float32):
    k = floor(ratio m) (the float32 product) and the fraction fmaf(ratio, m, -k), (R, n) each (the float64
    ratio m - k is exact: one rounding); a NaN ratio (0 / 0) gives k 0 and NaN fractions, as CUDA's
    float-to-int conversion does."""
    m = torch.arange(n, dtype=torch.float32)
    k = torch.floor(ratio[:, None] * m[None, :])
    frac = (ratio.double()[:, None] * m.double()[None, :] - k.double()).float()
    return torch.nan_to_num(k, nan=0.0, posinf=2.0 ** 30, neginf=0.0).long(), frac


def caroi_ratio(cells, size: int):
    """(cells - 1) / (size - 1) in float32 per roi, as the kernel's ((float)(M - 1)) / (E - 1)."""
    return (cells - 1).float() / torch.tensor(float(size - 1), dtype=torch.float32)


def caroi_taps_at(x, batch, top, left, rows, cols, iy, ix):
    """(R, C, A, B): the cells (top + iy, left + ix) of each roi's image, (iy (R, A), ix (R, B)), each read at
    the nearest map cell, and 0 where iy >= rows or ix >= cols (past the roi's last cell)."""
    h, w = x.shape[2:]
    dev = x.device
    ok = ((iy < rows[:, None])[:, :, None] & (ix < cols[:, None])[:, None, :]).to(dev)
    hh = (top[:, None] + iy).clamp(0, h - 1).to(dev)
    ww = (left[:, None] + ix).clamp(0, w - 1).to(dev)
    v = x[batch.to(dev)[:, None, None], :, hh[:, :, None], ww[:, None, :]].permute(0, 3, 1, 2).float()
    return torch.where(ok[:, None], v, torch.zeros((), dtype=torch.float32, device=dev))


def caroi_mix(lo, hi, t):
    """The kernel's t hi + (-lo t + lo), both multiply-adds contracted by nvcc to fmaf."""
    return fma32(t, hi, fma32(-lo, t, lo))


def caroi_grid(x, batch, top, left, rows, cols, ph: int, pw: int):
    """Rois smaller than the grid on both axes (or equal on one): resampled to ph x pw -> (R, C, ph, pw)."""
    ky, fy = caroi_taps(caroi_ratio(rows, ph), ph)
    kx, fx = caroi_taps(caroi_ratio(cols, pw), pw)
    dev = x.device
    ax, ay = fx.to(dev)[:, None, None, :], fy.to(dev)[:, None, :, None]

    def tap(dy: int, dx: int):
        return caroi_taps_at(x, batch, top, left, rows, cols, ky + dy, kx + dx)

    return caroi_mix(caroi_mix(tap(0, 0), tap(0, 1), ax), caroi_mix(tap(1, 0), tap(1, 1), ax), ay)


def caroi_tall(x, batch, top, left, rows, cols, bin_h, ph: int, pw: int):
    """Rois taller than the grid but narrower: each map row of the roi resampled across to pw columns,
    then the max over the rows floor(i bin_h) .. ceil((i + 1) bin_h) (from the roi's top, clipped to the
    map's height, not the roi's) of column j (kept while j < the map's width); empty: 0 -> (R, C, ph, pw).
    (Wider-than-tall rois: the same on the transposed map.)"""
    h, w = x.shape[2:]
    dev = x.device
    steps = torch.arange(ph + 1, dtype=torch.float32)
    hs = torch.floor(steps[None, :-1] * bin_h[:, None]).long().clamp(0, h)
    he = torch.ceil(steps[None, 1:] * bin_h[:, None]).long().clamp(0, h)
    depth = max(int(he.max()), 1)
    m = torch.arange(depth)[None, :].expand(rows.shape[0], depth)
    kx, fx = caroi_taps(caroi_ratio(cols, pw), pw)
    values = caroi_mix(caroi_taps_at(x, batch, top, left, rows, cols, m, kx),
                       caroi_taps_at(x, batch, top, left, rows, cols, m, kx + 1), fx.to(dev)[:, None, None, :])
    # the kernel's running max skips NaN (v > maxval) and starts at -FLT_MAX
    values = torch.where(torch.isnan(values), torch.tensor(float("-inf"), device=dev), values)
    out = []
    for i in range(ph):
        inside = ((m >= hs[:, i:i + 1]) & (m < he[:, i:i + 1])).to(dev)
        best = torch.where(inside[:, None, :, None], values, torch.tensor(float("-inf"), device=dev)).amax(2)
        out.append(best.clamp(min=-3.4028234663852886e38))
    out = torch.stack(out, 2)
    empty = (he <= hs)[:, :, None] | (torch.arange(pw) >= w)[None, None, :]
    return torch.where(empty.to(dev)[:, None], torch.zeros((), dtype=torch.float32, device=dev), out)


def caroi_pool(x, rois, ph: int, pw: int, spatial_scale: float, pad_ratio: float = 0.0, budget: int = 1 << 22):
    """SINet's CAROIPooling GPU kernel -> (R, C, ph, pw).  Rois at least as large as the grid are Fast
    R-CNN's max pooling; smaller ones are resampled, `budget` values at a time."""
    f32 = torch.float32
    r = roi_rows(rois, "CAROIPooling")
    n, c, h, w = x.shape
    out = x.new_zeros((r.shape[0], c, ph, pw), dtype=f32)
    if r.shape[0] == 0:
        return out
    batch = torch.trunc(r[:, 0]).long()
    outside = (batch < 0) | (batch >= n)
    if bool(outside.any()):
        roi_batch_index(r[outside][0], n, "CAROIPooling")   # raises, naming the index
    corners = r[:, 1:5]
    size = corners[:, 2:] - corners[:, :2] + 1.0
    ratio = torch.tensor(pad_ratio, dtype=f32).expand_as(size)
    scale = torch.tensor(spatial_scale, dtype=f32)
    # x1 - pad and x2 + pad with pad = size pad_ratio: nvcc contracts both to fmaf
    start = c_round((fma32(-size, ratio, corners[:, :2]) * scale).double()).long().clamp(min=0)   # (x, y)
    end = c_round((fma32(size, ratio, corners[:, 2:]) * scale).double()).long()
    image = c_round((torch.tensor([float(w), float(h)], dtype=f32) / scale).double()).long()
    end = torch.minimum(end, image - 1)
    extent = (end - start + 1).clamp(min=1)
    left, top, cols, rows = start[:, 0], start[:, 1], extent[:, 0], extent[:, 1]
    bin_h = rows.float() / torch.tensor(float(ph), dtype=f32)
    bin_w = cols.float() / torch.tensor(float(pw), dtype=f32)
    small = (bin_h < 1) | (bin_w < 1)
    # rois at least as large as the grid: Fast R-CNN's bins, offset by the roi's start, image by image
    large = (~small).nonzero().reshape(-1)
    if large.numel():
        steps_h, steps_w = torch.arange(ph + 1, dtype=f32), torch.arange(pw + 1, dtype=f32)
        t, lf, bh, bw = top[large, None], left[large, None], bin_h[large, None], bin_w[large, None]
        bh0 = (torch.floor(steps_h[None, :-1] * bh).long() + t).clamp(0, h)
        bh1 = (torch.ceil(steps_h[None, 1:] * bh).long() + t).clamp(0, h)
        bw0 = (torch.floor(steps_w[None, :-1] * bw).long() + lf).clamp(0, w)
        bw1 = (torch.ceil(steps_w[None, 1:] * bw).long() + lf).clamp(0, w)
        for b in torch.unique(batch[large]).tolist():
            picked = (batch[large] == b).nonzero().reshape(-1)
            pooled = range_max_bins(x[b], bh0[picked], bh1[picked], bw0[picked], bw1[picked])
            if pooled is None:
                pooled = torch.stack([max_over_bins(x[b], bh0[i], bh1[i], bw0[i], bw1[i]) for i in picked.tolist()])
            out[large[picked].to(x.device)] = pooled.to(f32)
    # smaller rois: resampled from their cells; the kernel's three cases, a chunk of rois at a time
    xt = x.transpose(2, 3)
    cases = ((bin_h > 1) & small, (bin_w > 1) & small & ~(bin_h > 1), small & (bin_h <= 1) & (bin_w <= 1))
    # the rows (columns) a tall (wide) roi's bins reach: its chunk's values tensor is as deep as its deepest
    depth = torch.stack([torch.ceil(bin_h * ph).clamp(max=h), torch.ceil(bin_w * pw).clamp(max=w),
                         torch.ones_like(bin_h)]).long()
    for case, chosen in enumerate(cases):
        chosen = chosen.nonzero().reshape(-1)
        chosen = chosen[torch.sort(depth[case, chosen], stable=True).indices]
        per_row = c * (pw, ph, ph * pw)[case]
        k = 0
        while k < chosen.numel():   # rois of similar depth together, about `budget` values at a time
            deepest = depth[case, chosen[k:]]   # ascending: a prefix fits
            step = max(int((torch.arange(1, deepest.numel() + 1) * deepest * per_row <= budget).sum()), 1)
            i = chosen[k:k + step]
            k += step
            if case == 0:
                got = caroi_tall(x, batch[i], top[i], left[i], rows[i], cols[i], bin_h[i], ph, pw)
            elif case == 1:
                got = caroi_tall(xt, batch[i], left[i], top[i], cols[i], rows[i], bin_w[i], pw, ph).transpose(2, 3)
            else:
                got = caroi_grid(x, batch[i], top[i], left[i], rows[i], cols[i], ph, pw)
            out[i.to(x.device)] = got
    return out


def sinet_roi_split(rois, branch_num: int, split_area1: int, split_area2: int):
    """SINet's ROISplit at TEST -> (counts (branch_num, 1, 1, 1), table (R, 2, 1, 1))."""
    r = rois.reshape(rois.shape[0], -1).detach().float().cpu()
    if r.shape[0] and r.shape[1] < 5:
        raise ValueError(f"ROISplit: rois must be (R, 5) = [batch, x1, y1, x2, y2], got {list(rois.shape)}")
    height = torch.trunc(r[:, 4] - r[:, 2] + 1.0).long()
    width = torch.trunc(r[:, 3] - r[:, 1] + 1.0).long()
    area = height * width
    branch = torch.where(area < split_area1, 1, 2)
    if branch_num == 3:
        branch = torch.where(area < split_area1, 1, torch.where(area <= split_area2, 2, 3))
    index = torch.zeros_like(branch)
    counts = []
    for k in range(1, branch_num + 1):
        chosen = branch == k
        index = torch.where(chosen, torch.cumsum(chosen.long(), 0) - 1, index)
        counts.append(float(chosen.sum()))
    table = torch.stack([index.float(), branch.float()], 1).reshape(-1, 2, 1, 1)
    return (torch.tensor(counts, dtype=torch.float32).reshape(-1, 1, 1, 1).to(rois.device),
            table.to(rois.device))


def sinet_roi_feature_split(x, counts, table, branch_num: int):
    """SINet's ROIFeatureSplit GPU kernel -> branch_num tops, (max(count, 1), C, H, W) each."""
    n = x.shape[0]
    sizes = counts.reshape(-1).detach().float().cpu()
    t = table.reshape(-1).detach().float().cpu()
    if sizes.numel() < branch_num or t.numel() < 2 * n:
        raise ValueError(f"ROIFeatureSplit: needs {branch_num} counts and 2 table values per row of {n}, "
                         f"got {sizes.numel()} and {t.numel()}")
    t = t[:2 * n].reshape(n, 2)
    rows = torch.where(t[:, 0] < 0, torch.zeros_like(t[:, 0]), t[:, 0]).long()
    tops = []
    for k in range(1, branch_num + 1):
        count = int(sizes[k - 1])
        if count < 0:
            raise ValueError(f"ROIFeatureSplit: branch {k} has a negative count {count}")
        top = x.new_zeros((max(count, 1),) + tuple(x.shape[1:]))
        chosen = (t[:, 1] == k).nonzero().reshape(-1)
        if chosen.numel():
            at = rows[chosen]
            if int(at.max()) >= top.shape[0]:
                raise ValueError(f"ROIFeatureSplit: a row goes to row {int(at.max())} of branch {k}, "
                                 f"which has {top.shape[0]}")
            top[at.to(x.device)] = x[chosen.to(x.device)]
        tops.append(top)
    return tuple(tops)


TORCH_CAROI_POOLING = torch_sources(fma32, caroi_taps, caroi_ratio, caroi_taps_at, caroi_mix, caroi_grid, caroi_tall,
                                    caroi_pool)
TORCH_SINET_ROI_SPLIT = torch_sources(sinet_roi_split)
TORCH_SINET_FEATURE_SPLIT = torch_sources(sinet_roi_feature_split)


def _call(fn, *args):
    try:
        return fn(*args)
    except ValueError as e:   # the user's data (a roi outside the batch, a table that does not fit): one line
        raise LayerError(str(e)) from None


def _branch_num(p, field):
    b = int(p.branch_num)
    if not 1 < b < 4:
        raise LayerError(f"{field}.branch_num must be 2 or 3, got {b}")
    return b


def _tops(emit, call, count):
    if count == 1:
        return f"{call}[0]"
    both = emit.tmp("split")
    emit.stmt(f"{both} = {call}")
    return [f"{both}[{k}]" for k in range(count)]


# ---- the specs ---------------------------------------------------------------------------

@register_layer("CAROIPooling")
class CAROIPooling(Layer):
    onnx_refusal = ("context-aware RoI pooling picks max pooling or bilinear resampling per roi from its size; "
                    "no ONNX form here")

    def parse(self, lp):
        need_blobs(lp, "CAROIPooling", 2, 1, roles="data, rois")
        p = lp.caroi_pooling_param
        if p.pooled_h <= 0 or p.pooled_w <= 0:
            raise LayerError(f"caroi_pooling_param.pooled_h and pooled_w must be > 0, got {p.pooled_h} x {p.pooled_w}")
        if not (math.isfinite(p.spatial_scale) and p.spatial_scale > 0):
            raise LayerError(f"caroi_pooling_param.spatial_scale must be a number > 0, got {p.spatial_scale}")
        if not math.isfinite(p.pad_ratio):
            raise LayerError(f"caroi_pooling_param.pad_ratio must be a finite number, got {p.pad_ratio}")
        return {"ph": int(p.pooled_h), "pw": int(p.pooled_w), "scale": float(p.spatial_scale),
                "pad_ratio": float(p.pad_ratio)}

    def infer(self, attrs, in_shapes):
        s, r = in_shapes
        if len(s) != 4:
            raise LayerError(f"CAROIPooling needs a 4-axis input, got {list(s)}")
        if not r:
            raise LayerError(f"CAROIPooling: rois must be (R, 5) = [batch, x1, y1, x2, y2], got {list(r)}")
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def _args(self, attrs):
        return attrs["ph"], attrs["pw"], attrs["scale"], attrs["pad_ratio"]

    def forward(self, attrs, params, x, rois):
        return _call(caroi_pool, x, rois, *self._args(attrs))

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ROI_COMMON)
        emit.helper(TORCH_ROI_POOLING)
        fn = emit.helper(TORCH_CAROI_POOLING)
        return f"{fn}({', '.join(emit.inputs)}, {', '.join(emit.lit(v) for v in self._args(node.attrs))})"


@register_layer("ROISplit")
class ROISplit(Layer):
    def parse(self, lp):
        need_blobs(lp, "ROISplit", 1, 2, roles="rois")
        p = lp.roi_split_param
        branch_num = _branch_num(p, "roi_split_param")
        attrs = {"branch_num": branch_num, "area1": int(p.split_area1),
                 "area2": int(p.split_area2) if branch_num == 3 else int(p.split_area1)}
        if p.fluctuation_range_large or p.fluctuation_range_small:
            attrs["reading_notes"] = [f"ROISplit '{lp.name}': fluctuation_range_large / _small jitter the split "
                                      f"areas in TRAIN only; at TEST they are split_area as given"]
        return attrs

    def infer(self, attrs, in_shapes):
        r = in_shapes[0]
        if not r:
            raise LayerError(f"ROISplit: rois must be (R, 5) = [batch, x1, y1, x2, y2], got {list(r)}")
        return [(attrs["branch_num"], 1, 1, 1), (r[0], 2, 1, 1)]

    def _args(self, attrs):
        return attrs["branch_num"], attrs["area1"], attrs["area2"]

    def forward(self, attrs, params, rois):
        return _call(sinet_roi_split, rois, *self._args(attrs))

    def onnx(self, ctx, node):
        return onnx_roi_split(ctx, node, *self._args(node.attrs))

    def pytorch_source(self, node, emit):
        fn = emit.helper(TORCH_SINET_ROI_SPLIT)
        call = f"{fn}({emit.inputs[0]}, {', '.join(emit.lit(v) for v in self._args(node.attrs))})"
        return _tops(emit, call, 2)


@register_layer("ROIFeatureSplit")
class ROIFeatureSplit(Layer):
    data_dependent_shape = True   # each top's rows are a count in the second bottom: the rois' count until a run
    onnx_refusal = "its tops' sizes are values of its counts bottom; no ONNX form here"

    def parse(self, lp):
        branch_num = _branch_num(lp.roi_feature_split_param, "roi_feature_split_param")
        need_blobs(lp, "ROIFeatureSplit", 3, branch_num, roles="features, counts, table")
        return {"branch_num": branch_num}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if not s:
            raise LayerError(f"ROIFeatureSplit needs features (R, ...), got {list(s)}")
        return [tuple(s)] * attrs["branch_num"]

    def forward(self, attrs, params, x, counts, table):
        tops = _call(sinet_roi_feature_split, x, counts, table, attrs["branch_num"])
        return tops if attrs["branch_num"] > 1 else tops[0]

    def pytorch_source(self, node, emit):
        fn = emit.helper(TORCH_SINET_FEATURE_SPLIT)
        call = f"{fn}({', '.join(emit.inputs)}, {node.attrs['branch_num']})"
        return _tops(emit, call, node.attrs["branch_num"])


def onnx_roi_split(ctx, node, branch_num, area1, area2):
    """ONNX: ROISplit's counts and table with float32 ops (areas exact below 2^24 cells)."""
    rows = ctx.merge_axes(node.inputs[0], 1, "rows")

    def column(k):
        return ctx.op("Slice", [rows, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], f"col{k}")

    def extent(lo, hi):   # int(hi - lo + 1)
        return ctx.trunc(ctx.op("Add", [ctx.op("Sub", [column(hi), column(lo)], "span"), ctx.f32(1.0)], "span1"))

    area = ctx.op("Mul", [extent(2, 4), extent(1, 3)], "area")
    small = ctx.op("Less", [area, ctx.f32(float(area1))], "small")
    rest = ctx.f32(2.0)
    if branch_num == 3:
        above = ctx.op("Greater", [area, ctx.f32(float(area2))], "above")
        rest = ctx.op("Where", [above, ctx.f32(3.0), ctx.f32(2.0)], "rest")
    branch = ctx.op("Where", [small, ctx.f32(1.0), rest], "branch")
    index, counts = None, []
    for k in range(1, branch_num + 1):
        chosen = ctx.op("Cast", [ctx.op("Equal", [branch, ctx.f32(float(k))], f"is{k}")], f"in{k}", to=1)
        before = ctx.op("CumSum", [chosen, ctx.i64(0)], f"before{k}", exclusive=1)
        here = ctx.op("Mul", [chosen, before], f"index{k}")
        index = here if index is None else ctx.op("Add", [index, here], "index")
        counts.append(ctx.op("ReduceSum", [chosen], f"count{k}", keepdims=1))
    ctx.add_node("Reshape", [ctx.op("Concat", counts, "counts", axis=0), ctx.i64([branch_num, 1, 1, 1])],
                 [node.outputs[0]])
    ctx.add_node("Reshape", [ctx.op("Concat", [index, branch], "table", axis=1), ctx.i64([-1, 2, 1, 1])],
                 [node.outputs[1]])


__all__ = ["CAROIPooling", "ROIFeatureSplit", "ROISplit"]
