"""ROIAlign configured with roi_align_param: the Mask R-CNN / R-FCN Caffe forks' layer.

Three forks declare the same ROIAlignParameter (pooled_h = 1, pooled_w = 2, spatial_scale = 3) and the
same type "ROIAlign", with 2 bottoms (data, rois (R, 5) = [batch, x1, y1, x2, y2] in input pixels) and
a top (R, C, pooled_h, pooled_w), but compute three different things (a fourth, Deeppftracking's, adds
sampling_ratio).  Nothing else in a file tells them apart, so caffeq's own `roi_align_param.fork` says which; unset, the layer is read as PY_MASK_RCNN, with
a note.  (zhaoweicai's cascade-rcnn ROIAlign reads roi_pooling_param instead: caffeq/layers/cascade_rcnn.py;
this spec claims the ROIAlign layers that set roi_align_param.)  In all three the roi corners are
multiplied by spatial_scale in float32, not rounded, and the batch index is the first column truncated
toward zero.

- PY_MASK_RCNN, a8039974/py-mask-rcnn-1 b69f7dd (caffe-mask-rcnn roi_align_layer.cpp / .cu, the same
  arithmetic on CPU and GPU; Detectron's RoIAlign with its sampling_ratio fixed at 2): the roi is
  max(x2 - x1, 1) wide (no + 1), bin = size / pooled; the samples of bin p sit at
  start + p * bin + (i + 0.5) * bin / 2, i = 0, 1 on each axis.  Each is read bilinearly: a sample
  below -1 or above the map's size (H or W) gives 0; otherwise it is raised to 0 if negative, its low
  cell is int(y), and at or past the last row (column) both cells are that row with the sample put on
  it.  w1..w4 = hy*hx, hy*lx, ly*hx, ly*lx; value = w1*v1 + w2*v2 + w3*v3 + w4*v4; the 4 values are summed
  (rows outer) and divided by 4.
- PY_RFCN_PRIV, soeaver/py-RFCN-priv 8d93d39 (caffe-priv roi_align_layer.cu; its CPU Forward is
  NOT_IMPLEMENTED), as Turoad/py-RFCN-priv vendors it: the roi is x2 - x1 + 1 wide (float), bin =
  size / pooled; bin p spans [p * bin + start, (p + 1) * bin + start], both ends clamped to [0, H]
  (W for x); an empty one (end <= start) gives 0.  Samples at h = hstart, hstart + 1, ... (float32
  steps) while h < hend, every (h, w) pair; each reads the cells floor/ceil of h and w that lie in the
  map, weighted (1 - w + floor(w)) or (1 - ceil(w) + w) times (1 - ceil(h) + h) or (1 - h + floor(h))
  (an integer coordinate counts its cell twice, as the kernel does), summed top-left, top-right,
  bottom-left, bottom-right.  The output is the max over the samples (the fork's `val > max`, from
  -FLT_MAX).  Its optional third bottom (a learned spatial_scale) is not supported.
- NNOP, nnop/caffe 023b8b31 (branch roialign, roi_align_layer.cu; mtnet's caffe): the roi is
  max(int(x2 - x1 + 1), 1) wide (truncated), bin = size / pooled; bin ends clamped to [0, H] as above;
  stride = (hend - hstart) / 3; samples at h = hstart + stride, then + max(stride, 0.01) (in double, as
  the GPU kernel; its CPU loop steps in float) while h <= hend - stride + 0.01, so normally 2 x 2 of them,
  an empty bin included (it starts from 0 instead of -FLT_MAX).  Each sample reads cell row hlow =
  clamp(floor(h), 0, H - 1) and row hlow + 1 (likewise columns) with weights h - hlow and w - wleft,
  value = (1-a)(1-b) TL + a(1-b) BL + (1-a)b TR + ab BR; the output is the max over the samples.  Row
  hlow + 1 = H and column W are read as the kernel reads them, from the flat blob: the next row's
  first cell or the next channel's (next image's) first row; past the blob's end, where the fork reads
  undefined memory, caffeq reads 0.  A negative batch index gives a zero output (the GPU kernel).
- DEEPPFTRACKING, LittleCherry11/Deeppftracking 15c439c (src/caffe/layers/roi_align_layer.cu, the GPU forward
  its tracker runs): PY_MASK_RCNN's samples and bilinear reads, but the roi is max(x2 - x1 + 1, 1) wide and
  each bin averages g x g samples, g = sampling_ratio (uint32 there, default 2; the kernel's 0 is Detectron's
  adaptive grid, which caffeq refuses to run).  Only this fork's ROIAlignParameter declares sampling_ratio, so
  a layer that sets it and names no fork is this one.  The fork's own code is loose (its LayerSetUp never
  copies the field into the kernel's sampling_ratio_, its CPU forward is another algorithm, and
  roi_align_layer_backup.cu also defines Forward_gpu): caffeq computes the kernel with the file's field, the
  reading the file's author wrote it for, and says so in a note.

The sample points are computed on the CPU in the forks' float32 (double where they use it), the gathers
on the input's device.  The torch functions below serve `forward` and are copied into model.py
(inspect.getsource).  ONNX: PY_MASK_RCNN is ONNX RoiAlign (avg, sampling_ratio 2, output_half_pixel:
onnxruntime computes Detectron's samples and weights in the same order); DEEPPFTRACKING the same with its
grid, the boxes scaled first and their far corners moved by 1 (spatial_scale 1), so the sides differ from
the kernel's by float32 rounding only; the two max forms are refused.
"""
import math

import torch

from ..errors import ExportError
from ..io.schema import caffe_pb2
from .registry import LayerError, claim_layers, need_blobs, torch_sources
from .roi_pooling import ROIS_WANTED, RoiLayerSpec, _check_roi_shapes, pooled_grid_attrs, roi_rows

FORKS = caffe_pb2.ROIAlignParameter.Fork
MASK_RCNN, RFCN_PRIV, NNOP = FORKS.Value("PY_MASK_RCNN"), FORKS.Value("PY_RFCN_PRIV"), FORKS.Value("NNOP")
DEEPPF = FORKS.Value("DEEPPFTRACKING")

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def roi_align_batch(r, n: int, kind: str, negative_ok: bool = False):
    """The rois' batch indices (C's int conversion: toward zero); ValueError for one outside the batch
    (below 0 too unless negative_ok)."""
    batch = r[:, 0].long()
    bad = (batch >= n) | ((batch < 0) & (not negative_ok))
    if bool(bad.any()):
        raise ValueError(f"{kind}: roi batch index {int(batch[bad][0])} is outside the batch of {n}")
    return batch


def roi_align_corners(x, b, rows, cols):
    """x[b, :, rows, cols] for per-roi rows (R, ph) and columns (R, pw) -> (R, C, ph, pw)."""
    dev = x.device
    return x[b.to(dev)[:, None, None], :, rows.to(dev)[:, :, None], cols.to(dev)[:, None, :]].permute(0, 3, 1, 2)


def mask_rcnn_axis(start, bin_size, pooled: int, size: int, grid: int = 2):
    """py-mask-rcnn's samples along one axis (start, bin_size: (R,) float32) -> per sample (R, pooled, grid):
    outside (value 0), low and high cell, weight of the high cell (l) and of the low one (1 - l).  Detectron's
    RoIAlign (caffe-keypoint-rcnn's) samples the same way with `grid` samples per bin."""
    f32 = torch.float32
    p = torch.arange(pooled, dtype=f32)[None, :, None]
    i = torch.arange(grid, dtype=f32)[None, None, :] + 0.5
    at = (start[:, None, None] + p * bin_size[:, None, None]) + i * bin_size[:, None, None] / float(grid)
    outside = (at < -1.0) | (at > float(size))
    at = torch.where(at <= 0, torch.zeros((), dtype=f32), at)
    low = at.long()
    edge = low >= size - 1
    low = torch.where(edge, torch.full_like(low, size - 1), low)
    high = torch.where(edge, low, low + 1)
    at = torch.where(edge, low.to(f32), at)
    frac = at - low.to(f32)
    return outside, low, high, frac, 1.0 - frac


def mean_of_samples(x, b, start, size, ph: int, pw: int, grid: int):
    """Detectron's bins: per roi (start, size: (R, 2) float32, x then y) the mean of grid x grid bilinear
    samples, summed rows outer as the kernels do -> (R, C, ph, pw)."""
    h, w = x.shape[2], x.shape[3]
    out_y, y0, y1, ly, hy = mask_rcnn_axis(start[:, 1], size[:, 1] / float(ph), ph, h, grid)
    out_x, x0, x1, lx, hx = mask_rcnn_axis(start[:, 0], size[:, 0] / float(pw), pw, w, grid)
    dev, dt = x.device, x.dtype
    zero = torch.zeros((), device=dev, dtype=dt)
    total = None
    for iy in range(grid):
        for ix in range(grid):
            wy0, wy1 = hy[:, :, iy, None], ly[:, :, iy, None]   # (R, ph, 1)
            wx0, wx1 = hx[:, None, :, ix], lx[:, None, :, ix]   # (R, 1, pw)
            weights = [wy0 * wx0, wy0 * wx1, wy1 * wx0, wy1 * wx1]
            rows = [y0[:, :, iy], y0[:, :, iy], y1[:, :, iy], y1[:, :, iy]]
            cols = [x0[:, :, ix], x1[:, :, ix], x0[:, :, ix], x1[:, :, ix]]
            val = None
            for wt, yi, xi in zip(weights, rows, cols):
                term = wt[:, None].to(dev, dt) * roi_align_corners(x, b, yi, xi)
                val = term if val is None else val + term
            outside = (out_y[:, :, iy, None] | out_x[:, None, :, ix])[:, None].to(dev)
            val = torch.where(outside, zero, val)
            total = val if total is None else total + val
    return total / float(grid * grid)


def mask_rcnn_roi_align(x, rois, ph: int, pw: int, spatial_scale: float, grid: int = 2, plus_one: bool = False):
    """a8039974/py-mask-rcnn-1's ROIAlign -> (R, C, ph, pw): the mean of grid x grid (2 x 2) bilinear samples per
    bin; plus_one: LittleCherry11/Deeppftracking's, whose roi sides count x2 - x1 + 1."""
    f32 = torch.float32
    r = roi_rows(rois, "ROIAlign")
    n, c = x.shape[0], x.shape[1]
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    b = roi_align_batch(r, n, "ROIAlign")
    scale = torch.tensor(spatial_scale, dtype=f32)
    start = r[:, 1:3] * scale   # (x, y)
    size = r[:, 3:5] * scale - start
    if plus_one:
        size = size + 1.0
    return mean_of_samples(x, b, start, torch.fmax(size, torch.ones((), dtype=f32)), ph, pw, grid)


def rfcn_priv_axis(start, bin_size, pooled: int, size: int):
    """py-RFCN-priv's bins along one axis, clamped to [0, size] -> (empty (R, pooled), [samples (R, pooled)
    float32 one pixel apart, from the bin's start], [whether each lies before the bin's end])."""
    f32 = torch.float32
    k = torch.arange(pooled, dtype=f32)[None, :]
    zero, limit = torch.zeros((), dtype=f32), torch.tensor(float(size), dtype=f32)
    lo = torch.fmin(torch.fmax(k * bin_size[:, None] + start[:, None], zero), limit)
    hi = torch.fmin(torch.fmax((k + 1.0) * bin_size[:, None] + start[:, None], zero), limit)
    at, points, taken = lo, [], []
    while bool((at < hi).any()):
        points.append(at)
        taken.append(at < hi)
        at = at + 1.0
    return hi <= lo, points, taken


def rfcn_priv_weights(at, size: int):
    """The kernel's cells and weights of samples `at` along one axis: (floor cell, its weight, whether it
    is in the map), (ceil cell, its weight, in the map)."""
    f32 = torch.float32
    lo, hi = torch.floor(at).long(), torch.ceil(at).long()
    w_lo = (1.0 - at) + lo.to(f32)        # 1 - w + x_left (and 1 - h + y_bottom)
    w_hi = (1 - hi).to(f32) + at          # 1 - x_right + w (and 1 - y_top + h)
    return ((lo.clamp(0, size - 1), w_lo, (lo >= 0) & (lo <= size - 1)),
            (hi.clamp(0, size - 1), w_hi, (hi >= 0) & (hi <= size - 1)))


def rfcn_priv_roi_align(x, rois, ph: int, pw: int, spatial_scale: float):
    """soeaver/py-RFCN-priv's ROIAlign -> (R, C, ph, pw): the max over samples one pixel apart."""
    f32 = torch.float32
    r = roi_rows(rois, "ROIAlign")
    n, c, h, w = x.shape
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    b = roi_align_batch(r, n, "ROIAlign")
    scale = torch.tensor(spatial_scale, dtype=f32)
    start = r[:, 1:3] * scale   # (x, y)
    size = (r[:, 3:5] * scale - start) + 1.0
    empty_y, ys, taken_y = rfcn_priv_axis(start[:, 1], size[:, 1] / float(ph), ph, h)
    empty_x, xs, taken_x = rfcn_priv_axis(start[:, 0], size[:, 0] / float(pw), pw, w)
    dev, dt = x.device, x.dtype
    zero = torch.zeros((), device=dev, dtype=dt)
    empty = (empty_y[:, :, None] | empty_x[:, None, :])[:, None].to(dev)
    best = torch.where(empty, zero, torch.full((), -3.4028234663852886e38, device=dev, dtype=dt))
    best = best.expand(r.shape[0], c, ph, pw)
    for at_y, ok_y in zip(ys, taken_y):
        bottom, top = rfcn_priv_weights(at_y, h)    # floor(h): y_bottom, ceil(h): y_top
        for at_x, ok_x in zip(xs, taken_x):
            left, right = rfcn_priv_weights(at_x, w)
            val = None
            for (yi, wy, in_y), (xi, wx, in_x) in ((top, left), (top, right), (bottom, left), (bottom, right)):
                weight = (wx[:, None, :] * wy[:, :, None])[:, None].to(dev, dt)   # (1 - w + x_left) * (1 - y_top + h)
                term = weight * roi_align_corners(x, b, yi, xi)
                inside = (in_y[:, :, None] & in_x[:, None, :])[:, None].to(dev)
                term = torch.where(inside, term, zero)
                val = term if val is None else val + term
            taken = (ok_y[:, :, None] & ok_x[:, None, :])[:, None].to(dev)
            best = torch.where(taken & (val > best), val, best)
    return best.contiguous()


def nnop_axis(start, bin_size, pooled: int, size: int):
    """nnop/caffe's bins along one axis (start, bin_size: (R,) float32) -> (empty (R, pooled), [samples
    (R, pooled) float32], [whether each is taken]); the bound and the steps in double, as the GPU kernel."""
    f32, f64 = torch.float32, torch.float64
    k = torch.arange(pooled, dtype=f32)[None, :]
    zero, limit = torch.zeros((), dtype=f32), torch.tensor(float(size), dtype=f32)
    lo = torch.fmin(torch.fmax(k * bin_size[:, None] + start[:, None], zero), limit)
    hi = torch.fmin(torch.fmax((k + 1.0) * bin_size[:, None] + start[:, None], zero), limit)
    stride = ((hi - lo).to(f64) / 3.0).to(f32)
    bound = (hi - stride).to(f64) + 0.01
    step = stride.to(f64).clamp(min=0.01)
    at, points, taken = lo + stride, [], []
    while bool((at.to(f64) <= bound).any()):
        points.append(at)
        taken.append(at.to(f64) <= bound)
        at = (at.to(f64) + step).to(f32)
    return hi <= lo, points, taken


def nnop_cells(at, size: int):
    """Row (column) hlow = clamp(floor(at), 0, size - 1) of each sample and its weight at - hlow; the
    kernel's other cell is hlow + 1 (possibly size)."""
    low = torch.floor(at).long().clamp(0, size - 1)
    return low, at - low.to(torch.float32)


def nnop_roi_align(x, rois, ph: int, pw: int, spatial_scale: float):
    """nnop/caffe's ROIAlign -> (R, C, ph, pw): the max over 2 x 2 samples at the thirds of each bin."""
    f32 = torch.float32
    r = roi_rows(rois, "ROIAlign")
    n, c, h, w = x.shape
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    b = roi_align_batch(r, n, "ROIAlign", negative_ok=True)
    negative = b < 0
    b = b.clamp(min=0)
    scale = torch.tensor(spatial_scale, dtype=f32)
    start = r[:, 1:3] * scale   # (x, y)
    size = ((r[:, 3:5] * scale - start) + 1.0).long().clamp(min=1).to(f32)   # C's (int): toward zero
    empty_y, ys, taken_y = nnop_axis(start[:, 1], size[:, 1] / float(ph), ph, h)
    empty_x, xs, taken_x = nnop_axis(start[:, 0], size[:, 0] / float(pw), pw, w)
    dev, dt = x.device, x.dtype
    # each (image, channel) plane followed by the values after it in the blob (0 past its end), so that
    # row h and column w read what the kernel's flat index reads
    plane, extent = h * w, h * w + w + 1
    flat = torch.cat([x.reshape(-1), x.new_zeros(extent)])
    planes = flat.unfold(0, extent, plane)[: n * c].reshape(n, c, extent)
    bd = b.to(dev)[:, None, None]
    zero = torch.zeros((), device=dev, dtype=dt)
    empty = (empty_y[:, :, None] | empty_x[:, None, :])[:, None].to(dev)
    best = torch.where(empty, zero, torch.full((), -3.4028234663852886e38, device=dev, dtype=dt))
    best = best.expand(r.shape[0], c, ph, pw)
    for at_y, ok_y in zip(ys, taken_y):
        hlow, alpha = nnop_cells(at_y, h)
        a = alpha[:, None, :, None].to(dev, dt)   # (R, 1, ph, 1)
        for at_x, ok_x in zip(xs, taken_x):
            wleft, beta = nnop_cells(at_x, w)
            bt = beta[:, None, None, :].to(dev, dt)   # (R, 1, 1, pw)

            def cell(dy: int, dx: int):   # (R, C, ph, pw) at flat offset (hlow + dy) * W + wleft + dx
                off = ((hlow + dy) * w)[:, :, None] + (wleft + dx)[:, None, :]
                return planes[bd, :, off.to(dev)].permute(0, 3, 1, 2)

            val = ((1 - a) * (1 - bt) * cell(0, 0) + a * (1 - bt) * cell(1, 0)
                   + (1 - a) * bt * cell(0, 1) + a * bt * cell(1, 1))
            taken = (ok_y[:, :, None] & ok_x[:, None, :])[:, None].to(dev)
            best = torch.where(taken & (val > best), val, best)
    return torch.where(negative.to(dev)[:, None, None, None], zero, best).contiguous()


TORCH_ROI_ALIGN_COMMON = torch_sources(roi_align_batch, roi_align_corners)
TORCH_MASK_RCNN = torch_sources(mask_rcnn_axis, mean_of_samples, mask_rcnn_roi_align)
TORCH_RFCN_PRIV = torch_sources(rfcn_priv_axis, rfcn_priv_weights, rfcn_priv_roi_align)
TORCH_NNOP = torch_sources(nnop_axis, nnop_cells, nnop_roi_align)

FUNCTIONS = {MASK_RCNN: (mask_rcnn_roi_align, TORCH_MASK_RCNN), RFCN_PRIV: (rfcn_priv_roi_align, TORCH_RFCN_PRIV),
             NNOP: (nnop_roi_align, TORCH_NNOP), DEEPPF: (mask_rcnn_roi_align, TORCH_MASK_RCNN)}

# ---- the spec ------------------------------------------------------------------------------

UNSET_FORK_NOTE = ("roi_align_param names no fork: read as a8039974/py-mask-rcnn-1's ROIAlign (the mean of 2 x 2 "
                   "bilinear samples per bin); soeaver/py-RFCN-priv and nnop/caffe declare the same fields but take "
                   "a max over other samples: add `fork: PY_RFCN_PRIV` or `fork: NNOP` to roi_align_param for theirs")
DEEPPF_NOTE = ("roi_align_param sets sampling_ratio, which only LittleCherry11/Deeppftracking's ROIAlign declares: "
               "read as its GPU kernel (the mean of sampling_ratio x sampling_ratio samples per bin, roi sides "
               "x2 - x1 + 1) with the file's sampling_ratio; the fork itself never copies the field into the "
               "kernel's grid (left uninitialized), and its CPU forward computes another ROIAlign")


@claim_layers("ROIAlign", lambda lp: lp.HasField("roi_align_param"))
class ROIAlignForks(RoiLayerSpec):
    roi_helpers = (TORCH_ROI_ALIGN_COMMON,)

    def parse(self, lp):
        need_blobs(lp, "ROIAlign", 2, 1, roles="data, rois")
        if lp.HasField("roi_pooling_param"):
            raise LayerError("ROIAlign sets both roi_align_param (the Mask R-CNN / R-FCN forks' layer) and "
                             "roi_pooling_param (zhaoweicai's cascade-rcnn layer); each fork reads only one of them")
        p = lp.roi_align_param
        fork = int(p.fork)
        if p.HasField("sampling_ratio") and not p.HasField("fork"):
            fork = DEEPPF   # the one ROIAlign whose message declares the field
        attrs = {**pooled_grid_attrs(p, "roi_align_param"), "fork": fork,
                 "reading_notes": [] if p.HasField("fork") else [UNSET_FORK_NOTE]}
        if fork == DEEPPF:
            ratio = p.sampling_ratio
            if not (math.isfinite(ratio) and ratio >= 0 and ratio == int(ratio)):
                raise LayerError(f"roi_align_param.sampling_ratio is an unsigned integer in LittleCherry11/"
                                 f"Deeppftracking's ROIAlign, got {ratio}")
            attrs.update(grid=int(ratio), reading_notes=[DEEPPF_NOTE])
        elif p.HasField("sampling_ratio"):
            # caffe-keypoint-rcnn's RoIAlign (keypoint_rcnn.py) and Deeppftracking's read it; these forks fix theirs
            raise LayerError(f"roi_align_param.sampling_ratio is caffe-keypoint-rcnn's RoIAlign field (and "
                             f"LittleCherry11/Deeppftracking's ROIAlign's, fork: DEEPPFTRACKING); ROIAlign "
                             f"({FORKS.Name(fork)}) samples a fixed grid and never reads it")
        return attrs

    def infer(self, attrs, in_shapes):
        # the three forks' Reshape reads only the rois' count (py-mask-rcnn's alt-opt mask test net
        # declares (1, 4) rois that its script reshapes); the width is checked when the layer runs
        _check_roi_shapes("ROIAlign", in_shapes, rows_only=True)
        s, r = in_shapes
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_function(self, attrs):
        return FUNCTIONS[attrs["fork"]]

    def roi_args(self, attrs):
        if attrs["fork"] == DEEPPF:
            return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], "grid": attrs["grid"],
                                                "plus_one": True}
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"]}

    def cannot_run(self, attrs, in_shapes):
        if attrs["fork"] == DEEPPF and attrs["grid"] == 0:
            return ("roi_align_param.sampling_ratio 0 is Detectron's adaptive grid (ceil(side / pooled) samples "
                    "per roi), which caffeq does not run; give a positive one")
        return None

    def forward(self, attrs, params, x, rois, *more):
        why = self.cannot_run(attrs, None)
        if why:
            raise LayerError(f"ROIAlign: {why}")
        return super().forward(attrs, params, x, rois, *more)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, None, error=ExportError)
        return super().pytorch_source(node, emit)

    def onnx(self, ctx, node):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, None, error=ExportError)
        if a["fork"] not in (MASK_RCNN, DEEPPF):
            raise ExportError(f"layer '{node.name}' (ROIAlign): roi_align_param fork {FORKS.Name(a['fork'])} takes "
                              f"the max over bilinear samples with the fork's own weights and border reads; ONNX "
                              f"RoiAlign's max mode samples other points, so it cannot give the same numbers")
        rois = node.inputs[1]
        if math.prod(ctx.shape(rois)[1:]) != 5:
            raise ExportError(f"layer '{node.name}' (ROIAlign): {ROIS_WANTED}, the net declares "
                              f"{list(ctx.shape(rois))}; give their shape with --input-shape")
        t = lambda hint: ctx.tmp(f"{node.name}_{hint}")
        flat = ctx.add_node("Reshape", [rois, ctx.i64([-1, 5])], t("rois"))
        boxes = ctx.add_node("Slice", [flat, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], t("boxes"))
        scale, grid = a["scale"], 2
        if a["fork"] == DEEPPF:
            # the fork's sides are x2 - x1 + 1: scale the corners here and move the far ones by 1
            scaled = ctx.add_node("Mul", [boxes, ctx.f32(scale)], t("scaled"))
            boxes = ctx.add_node("Add", [scaled, ctx.f32([0, 0, 1, 1])], t("plus_one"))
            scale, grid = 1.0, a["grid"]
        column = ctx.add_node("Slice", [flat, ctx.i64([0]), ctx.i64([1]), ctx.i64([1])], t("batch_column"))
        batch = ctx.add_node("Cast", [ctx.add_node("Reshape", [column, ctx.i64([-1])], t("batch_float"))],
                             t("batch"), to=7)   # int64, truncated toward zero as C's (int)
        # opset 16 added coordinate_transformation_mode (default half_pixel); before it RoiAlign is
        # output_half_pixel, Detectron's (and this fork's) unshifted coordinates
        mode = {"coordinate_transformation_mode": "output_half_pixel"} if ctx.opset >= 16 else {}
        ctx.add_node("RoiAlign", [node.inputs[0], boxes, batch], [node.outputs[0]], name=node.name, mode="avg",
                     output_height=a["ph"], output_width=a["pw"], sampling_ratio=grid, spatial_scale=scale,
                     **mode)
