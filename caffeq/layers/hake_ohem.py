"""ROIPairPooling (HAKE-Action) and ROIAlignHalf / ProposalCluster (cgangEE/ohem).

- ROIPairPooling, DirtyHarryLYL/HAKE-Action 8122693 (branch Image-level-HAKE-Action:
  src/caffe/layers/roipair_pooling_layer.cpp / .cu, include/caffe/layers/roipair_pooling.hpp,
  src/caffe/proto/caffe.proto roipair_pooling_param = 218): bottoms (data (N, C, H, W), rois1 (R, 5),
  rois2 (R, 5)), top (R, C, pooled_h, pooled_w).  Both rois' corners are round(v * spatial_scale)
  (float32 product, C's round: half away from zero); the pooled box is their union, max(end - start + 1,
  1) wide, split into Fast R-CNN's bins (floor(p * bin), ceil((p + 1) * bin), offset by the union's start
  and clipped to the map).  A cell counts only when it lies strictly inside roi1 or strictly inside roi2
  (x1 < w < x2 and y1 < h < y2: the boxes' own border cells do not count); the output is the max over the
  bin's counted cells, starting from 0 (the GPU kernel: negative values and empty bins give 0).  The map
  is image int(rois1[n][0]) (rois2's batch column is not read).  The fork's CPU Forward compares each cell
  with the top's -FLT_MAX fill instead of the running max and so keeps the last counted cell: caffeq
  computes the GPU kernel's max, which is what the fork's nets run (a note says so).  ONNX: the same
  bins and interiors as row x column masks, the maxima in a Scan over the rois (onnx_roipair_pool).
- ROIAlignHalf, cgangEE/ohem b7552ce (caffe-fast-rcnn/src/caffe/layers/roi_align_half_layer.cu; its CPU
  Forward is LOG(FATAL)): reads roi_pooling_param (pooled_h, pooled_w, spatial_scale).  Each roi's y2 is
  replaced by (y1 + y2) / 2 (float32): the upper half of the box; then it is the fork's ROIAlign
  (roi_align_layer.cu): corners v * spatial_scale (float32, not rounded), the roi max(x2 - x1, 1) wide (no
  + 1), bin = size / pooled; bin p spans [p * bin + start, (p + 1) * bin + start], both ends clipped to
  [0, H] (W for x), an empty bin gives 0.  Samples at h = hstart, hstart + 1, ... (float32 steps) while
  h < hend, every (h, w) pair (the same points as py-RFCN-priv's ROIAlign: rfcn_priv_axis is reused); a
  sample whose ceil is the map's size H (W) is moved to H - 1 (W - 1).  h1 = int(h), h2 = ceil(h) (and w1,
  w2); where h1 == h2 the row weights are 1 and 0, else h2 - h and h - h1; value = q11 a b + q12 a c +
  q21 d b + q22 d c in that order (the kernel's special cases give the same numbers).  The output is the max
  over the samples (from -FLT_MAX), top (R, C, pooled_h, pooled_w).  py-RFCN-priv's kernel differs in
  the roi size (+ 1), its weights (an integer coordinate counts twice) and its border (cells off the map
  read as 0).  The fork's own ROIAlign layers set roi_pooling_param as zhaoweicai's (cascade_rcnn.py, a
  (pooled + 1) grid) do: in a net with ROIAlignHalf or ProposalCluster (only this fork has them) they are
  marked with caffeq's roi_pooling_param.ohem_roi_align when read (a ForkReading rewrite, with a note) and
  computed as the fork's ROIAlign (OhemROIAlign, the same function without the half).  A net of the fork
  with neither layer (its full1_DRoiAlignX_kp train net) is read as zhaoweicai's unless the file sets
  `ohem_roi_align: true` in those layers' roi_pooling_param.
- ProposalCluster, cgangEE/ohem b7552ce (proposal_cluster_layer.cpp / .cu): PVANet's Proposal
  (pva_proposal.py: the fork's proposal_layer.cu and util/nms.cpp / .cu are sanghoon/caffe 6068dd0's but for
  comments, its proposal_layer.cpp adds an exit to the CPU Forward, and proposal_cluster_layer.cpp / .cu
  differ from them only in generate_anchors and its call) except the anchors: proposal_param.scale holds
  (width, height) pairs, one anchor per pair (an odd last value is not read), each centred on
  (base_size - 1) / 2 with half sides 0.5 * (side - 1), in float32; ratio is not read.  Bottoms and tops as PVANet's: rois (R, 5), scores (R,), one image; im_info's first 4 values
  [img_H, img_W, scale_H, scale_W] are read.

proto: HAKE-Action's ROIPairPoolingParameter (pooled_h = 1, pooled_w = 2, spatial_scale = 3) at its own
number 218; the ohem fork adds no field (ROIAlignHalf reads roi_pooling_param, ProposalCluster
proposal_param); roi_pooling_param.ohem_roi_align = 60004 is caffeq's own marker (see above).  The torch functions below serve `forward` and are copied into model.py
(inspect.getsource).
"""
import math

import numpy as np
import torch
from onnx import TensorProto

from .c_numerics import c_round, onnx_c_round
from .pva_proposal import PVAProposalLayer
from .registry import ForkReading, LayerError, claim_layers, need_blobs, register_layer, torch_sources
from .roi_align_forks import TORCH_ROI_ALIGN_COMMON, rfcn_priv_axis, roi_align_batch, roi_align_corners
from .roi_bins_onnx import (
    onnx_axis_bins,
    onnx_batch_column,
    onnx_finish_rois,
    onnx_padded_rows,
    onnx_scan_bin_max,
    onnx_strictly_inside,
)
from .roi_pooling import RoiLayerSpec, _check_roi_shapes, pooled_grid_attrs, roi_rows

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def roipair_bins(start, end, lo, hi, pooled: int, size: int):
    """One axis of HAKE's ROIPairPooling: union box [start, end] (R,) int64, the two rois' interiors
    (lo, hi) = ((R,) low corners of roi1 and roi2, high corners) -> the (R, pooled, size) masks of the
    cells each bin counts for roi1 and for roi2."""
    f32 = torch.float32
    extent = torch.clamp(end - start + 1, min=1).to(f32)
    bin_size = extent / torch.tensor(float(pooled), dtype=f32)
    k = torch.arange(pooled, dtype=f32)[None, :]
    b0 = torch.floor(k * bin_size[:, None]).long() + start[:, None]
    b1 = torch.ceil((k + 1.0) * bin_size[:, None]).long() + start[:, None]
    b0, b1 = b0.clamp(0, size), b1.clamp(0, size)
    pos = torch.arange(size)[None, None, :]
    in_bin = (pos >= b0[:, :, None]) & (pos < b1[:, :, None])
    return [in_bin & (pos > lo[j][:, None, None]) & (pos < hi[j][:, None, None]) for j in range(2)]


def roipair_max_pool(x, rois1, rois2, ph: int, pw: int, spatial_scale: float):
    """HAKE-Action's ROIPairPooling (the GPU kernel) -> (R, C, ph, pw)."""
    f32 = torch.float32
    r1, r2 = roi_rows(rois1, "ROIPairPooling"), roi_rows(rois2, "ROIPairPooling")
    n, c, h, w = x.shape
    if r1.shape[0] != r2.shape[0]:
        raise ValueError(f"ROIPairPooling: the two roi bottoms must have as many rows, got {r1.shape[0]} "
                         f"and {r2.shape[0]}")
    if r1.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    b = roi_align_batch(r1, n, "ROIPairPooling")
    scale = torch.tensor(spatial_scale, dtype=f32)
    c1 = c_round((r1[:, 1:5] * scale).double()).long()   # x1, y1, x2, y2 on the map
    c2 = c_round((r2[:, 1:5] * scale).double()).long()
    start = torch.minimum(c1[:, 0:2], c2[:, 0:2])
    end = torch.maximum(c1[:, 2:4], c2[:, 2:4])
    rows = roipair_bins(start[:, 1], end[:, 1], (c1[:, 1], c2[:, 1]), (c1[:, 3], c2[:, 3]), ph, h)
    cols = roipair_bins(start[:, 0], end[:, 0], (c1[:, 0], c2[:, 0]), (c1[:, 2], c2[:, 2]), pw, w)
    dev = x.device
    xb = x[b.to(dev)]   # (R, C, H, W)
    low = torch.full((), -math.inf, dtype=x.dtype, device=dev)
    best = torch.zeros((r1.shape[0], c, ph, pw), dtype=x.dtype, device=dev)
    for j in range(2):   # the max over a union of two rectangles: each rectangle's, then the larger
        col_max = torch.stack([torch.where(cols[j][:, q].to(dev)[:, None, None, :], xb, low).amax(3)
                               for q in range(pw)], 3)   # (R, C, H, pw)
        rect = torch.stack([torch.where(rows[j][:, p].to(dev)[:, None, :, None], col_max, low).amax(2)
                            for p in range(ph)], 2)      # (R, C, ph, pw)
        best = torch.maximum(best, rect)
    return best


def ohem_align_cells(at, size: int):
    """The ohem ROIAlign kernel's cells of samples `at` (R, pooled) along one axis: (low cell, high cell,
    low weight, high weight), a sample whose ceil is `size` first moved to size - 1."""
    f32 = torch.float32
    at = torch.where(torch.ceil(at) == float(size), torch.tensor(float(size - 1), dtype=f32), at)
    lo, hi = torch.floor(at), torch.ceil(at)
    same = lo == hi
    w_lo = torch.where(same, torch.ones((), dtype=f32), hi - at)
    w_hi = torch.where(same, torch.zeros((), dtype=f32), at - lo)
    # samples past the bin's end (not taken) may lie off the map: clamp their cells to read something
    return lo.long().clamp(0, size - 1), hi.long().clamp(0, size - 1), w_lo, w_hi


def ohem_roi_align(x, rois, ph: int, pw: int, spatial_scale: float, half: bool = False):
    """cgangEE/ohem's ROIAlign (half: ROIAlignHalf, the rois' upper halves) -> (R, C, ph, pw)."""
    f32 = torch.float32
    kind = "ROIAlignHalf" if half else "ROIAlign"
    r = roi_rows(rois, kind)
    n, c, h, w = x.shape
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    b = roi_align_batch(r, n, kind)
    if half:
        r = torch.cat([r[:, 0:4], ((r[:, 2] + r[:, 4]) / 2.0)[:, None]], 1)
    scale = torch.tensor(spatial_scale, dtype=f32)
    start = r[:, 1:3] * scale   # (x, y)
    size = torch.clamp(r[:, 3:5] * scale - start, min=1.0)
    empty_y, ys, taken_y = rfcn_priv_axis(start[:, 1], size[:, 1] / float(ph), ph, h)
    empty_x, xs, taken_x = rfcn_priv_axis(start[:, 0], size[:, 0] / float(pw), pw, w)
    dev, dt = x.device, x.dtype
    zero = torch.zeros((), device=dev, dtype=dt)
    empty = (empty_y[:, :, None] | empty_x[:, None, :])[:, None].to(dev)
    best = torch.where(empty, zero, torch.full((), -3.4028234663852886e38, device=dev, dtype=dt))
    best = best.expand(r.shape[0], c, ph, pw)
    for at_y, ok_y in zip(ys, taken_y):
        y1, y2, wa, wd = ohem_align_cells(at_y, h)
        wa, wd = wa.to(dev, dt)[:, None, :, None], wd.to(dev, dt)[:, None, :, None]
        for at_x, ok_x in zip(xs, taken_x):
            x1, x2, wb, wc = ohem_align_cells(at_x, w)
            wb, wc = wb.to(dev, dt)[:, None, None, :], wc.to(dev, dt)[:, None, None, :]
            val = (roi_align_corners(x, b, y1, x1) * wa * wb + roi_align_corners(x, b, y1, x2) * wa * wc
                   + roi_align_corners(x, b, y2, x1) * wd * wb + roi_align_corners(x, b, y2, x2) * wd * wc)
            taken = (ok_y[:, :, None] & ok_x[:, None, :])[:, None].to(dev)
            best = torch.where(taken & (val > best), val, best)
    return best.contiguous()


TORCH_ROIPAIR = torch_sources(roipair_bins, roipair_max_pool)
TORCH_RFCN_PRIV_AXIS = torch_sources(rfcn_priv_axis)
TORCH_OHEM_ALIGN = torch_sources(ohem_align_cells, ohem_roi_align)

# ---- the specs ---------------------------------------------------------------------------

CPU_NOTE = ("ROIPairPooling: computed as HAKE-Action's GPU kernel (the max of the counted cells, from 0); the fork's "
            "CPU Forward keeps the last counted cell of each bin instead")


@register_layer("ROIPairPooling")
class ROIPairPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(roipair_max_pool), TORCH_ROIPAIR
    roi_helpers = (TORCH_ROI_ALIGN_COMMON,)
    reading_note = CPU_NOTE

    def parse(self, lp):
        need_blobs(lp, "ROIPairPooling", 3, 1, roles="data, rois1, rois2")
        return pooled_grid_attrs(lp.roipair_pooling_param, "roipair_pooling_param")

    def infer(self, attrs, in_shapes):
        s, r1, r2 = in_shapes
        _check_roi_shapes("ROIPairPooling", (s, r1))
        _check_roi_shapes("ROIPairPooling", (s, r2))
        if r1[0] != r2[0]:
            raise LayerError(f"ROIPairPooling: the two roi bottoms must have as many rows, got {list(r1)} and {list(r2)}")
        return [(r1[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"]}

    def macs(self, attrs, in_shapes, out_shapes):
        return 0

    def onnx(self, ctx, node):
        onnx_roipair_pool(ctx, node)


def onnx_roipair_pool(ctx, node):
    """ROIPairPooling in plain ONNX ops (roi_bins_onnx.py): both rois' corners C-rounded (float32 products,
    rounded in double), the union's Fast R-CNN bins as row and column masks, each roi's strict interior
    cut from them (two row x column pieces), and the pieces' maxima from 0 in a Scan over the rois, each
    reading roi1's image.  A batch index outside the batch gives 0 where caffeq's forward raises."""
    a = node.attrs
    x, rois1, rois2 = node.inputs
    n, _, h, w = ctx.shape(x)
    rows1, count = onnx_padded_rows(ctx, rois1, 5)
    rows2, _ = onnx_padded_rows(ctx, rois2, 5)
    batch, inside = onnx_batch_column(ctx, rows1, n)
    scale = ctx.f32(float(np.float32(a["scale"])))

    def cells(rows):   # [x1, y1, x2, y2] of the (R + 1, 5) rows as whole-valued float32 (R + 1, 1) columns
        box = ctx.op("Slice", [rows, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], "box")
        rounded = ctx.op("Cast", [onnx_c_round(ctx, ctx.op("Mul", [box, scale], "scaled"), in_double=True)], "cells",
                         to=TensorProto.FLOAT)
        return [ctx.op("Slice", [rounded, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], "corner") for k in range(4)]
    c1, c2 = cells(rows1), cells(rows2)
    masks = []   # per axis (rows, then columns): [roi1's cells of each bin, roi2's]
    for lo, pooled, extent in ((1, a["ph"], h), (0, a["pw"], w)):
        start = ctx.op("Min", [c1[lo], c2[lo]], "union_lo")
        end = ctx.op("Max", [c1[lo + 2], c2[lo + 2]], "union_hi")
        bins, _, _ = onnx_axis_bins(ctx, start, end, pooled, extent)
        masks.append([ctx.op("And", [bins, onnx_strictly_inside(ctx, c[lo], c[lo + 2], extent)], "counted")
                      for c in (c1, c2)])
    pieces = list(zip(masks[0], masks[1]))
    pooled = onnx_scan_bin_max(ctx, node, x, batch, pieces, a["ph"], a["pw"], 0.0)
    outside = ctx.op("Reshape", [ctx.op("Not", [inside], "b_out"), ctx.i64([-1, 1, 1, 1])], "b_out4")
    onnx_finish_rois(ctx, node, pooled, count, outside)


OHEM_TYPES = ("ROIAlign", "ROIAlignHalf", "ProposalCluster")


def _mark_ohem_roi_align(net):
    """ForkReading rewrite: a net with cgangEE/ohem's ROIAlignHalf or ProposalCluster is that fork's, so its
    ROIAlign layers that set roi_pooling_param are the fork's ROIAlign; mark them (and those layers)."""
    marked = []
    for lp in net.layer:
        if lp.type in OHEM_TYPES and (lp.type != "ROIAlign" or lp.HasField("roi_pooling_param")):
            lp.roi_pooling_param.ohem_roi_align = True
            if lp.type == "ROIAlign":
                marked.append(f"'{lp.name}'")
    if not marked:
        return "cgangEE/ohem net (ROIAlignHalf / ProposalCluster): no ROIAlign layer to read as the fork's"
    return (f"ROIAlign layer(s) {', '.join(marked)} read as cgangEE/ohem's ROIAlign (top pooled_h x pooled_w, the "
            f"max over bilinear samples), since the net has that fork's ROIAlignHalf or ProposalCluster")


def _need_ohem_mark(lp):
    if not lp.roi_pooling_param.ohem_roi_align:
        raise ForkReading(f"{lp.type} is cgangEE/ohem's layer", _mark_ohem_roi_align)


@claim_layers("ROIAlign", lambda lp: lp.HasField("roi_pooling_param") and lp.roi_pooling_param.ohem_roi_align)
class OhemROIAlign(RoiLayerSpec):
    """cgangEE/ohem's ROIAlign (roi_align_layer.cu), on layers marked roi_pooling_param.ohem_roi_align."""
    roi_fn, roi_source = staticmethod(ohem_roi_align), TORCH_OHEM_ALIGN
    roi_helpers = (TORCH_ROI_ALIGN_COMMON, TORCH_RFCN_PRIV_AXIS)
    onnx_refusal = ("cgangEE/ohem's ROIAlign takes the max over bilinear samples one pixel apart, as many as each "
                    "bin spans; ONNX RoiAlign's max mode samples other points")
    half = False

    def parse(self, lp):
        need_blobs(lp, lp.type, 2, 1, roles="data, rois")
        return pooled_grid_attrs(lp.roi_pooling_param, "roi_pooling_param")

    def infer(self, attrs, in_shapes):
        _check_roi_shapes(self.types[0], in_shapes)
        s, r = in_shapes
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], "half": self.half}


@register_layer("ROIAlignHalf")
class ROIAlignHalf(OhemROIAlign):
    onnx_refusal = ("ROIAlignHalf takes the max over bilinear samples one pixel apart, as many as each bin "
                    "spans; ONNX RoiAlign's max mode samples other points")
    half = True

    def parse(self, lp):
        attrs = super().parse(lp)
        _need_ohem_mark(lp)
        return attrs


def cluster_anchors(base_size, sides):
    """ProposalCluster's anchors: one per (width, height) pair of `sides`, in float32 -> (A, 4) float64."""
    f = np.float32
    centre = f(0.5) * (f(base_size) - f(1))
    rows = []
    for j in range(len(sides) // 2):
        hw, hh = f(0.5) * (f(sides[2 * j]) - f(1)), f(0.5) * (f(sides[2 * j + 1]) - f(1))
        rows.append([centre - hw, centre - hh, centre + hw, centre + hh])
    return np.array(rows, f).astype(np.float64).reshape(-1, 4)


@register_layer("ProposalCluster")
class ProposalCluster(PVAProposalLayer):
    """cgangEE/ohem's ProposalCluster (see the module doc)."""

    def settings(self, lp):
        p = lp.proposal_param
        if p.pre_nms_topn < 1:
            raise LayerError("proposal_param.pre_nms_topn must be >= 1 (0 keeps no proposal)")
        if p.base_size <= 0:
            raise LayerError(f"proposal_param.base_size must be positive, got {p.base_size}")
        sides = [float(v) for v in p.scale]
        if len(sides) < 2 or any(not (v > 0 and math.isfinite(v)) for v in sides):
            raise LayerError(f"proposal_param.scale must hold (width, height) pairs of positive numbers for "
                             f"ProposalCluster, got {sides}")
        return {"feat_stride": int(p.feat_stride), "base_size": int(p.base_size), "sides": sides,
                "anchors": cluster_anchors(int(p.base_size), sides).tolist(),
                "pre_nms_top_n": int(p.pre_nms_topn), "post_nms_top_n": int(p.post_nms_topn),
                "nms_thresh": float(p.nms_thresh), "min_size": int(p.min_size), "pva": True}

    def parse(self, lp):
        attrs = super().parse(lp)
        _need_ohem_mark(lp)
        if len(attrs["sides"]) % 2:
            attrs["reading_notes"] = [f"ProposalCluster '{lp.name}': proposal_param.scale has an odd count "
                                      f"({len(attrs['sides'])}); the fork reads pairs and never its last value"]
        return attrs

    @staticmethod
    def cannot_run(attrs, in_shapes):
        prob, deltas, info = (tuple(s) for s in in_shapes)
        a = len(attrs["anchors"])
        if prob[1] != 2 * a or deltas[1] != 4 * a:
            return (f"the net scores {prob[1] // 2} anchors per position and regresses {deltas[1] // 4}, but "
                    f"proposal_param.scale gives {a} (width, height) pairs: the fork's layer would read past "
                    f"its bottoms")
        if math.prod(info) < 4:
            return (f"im_info must hold [height, width, scale_h, scale_w] (the fork's layer reads 4 values), "
                    f"got shape {list(info)}")
        return None
