"""MNC's C++ layers (daijifeng001/caffe-mnc, "Instance-aware Semantic Segmentation via Multi-task Network
Cascades"): ROIWarping, MaskPooling and MaskResize.  The Python layers of MNC's nets are in mnc_python.py.

The fork's CPU forwards are NOT_IMPLEMENTED; what follows is its CUDA code (src/caffe/layers/*.cu).  Its
bilinear read of a map of H rows at a float32 position y (columns likewise): a position below -0.5 or
above H - 0.5 reads nothing; otherwise y is raised to 0 if negative, its low row is int(y), and at or past
the last row both rows are that row with y put on it; ly = y - low, hy = 1 - ly, and the value is
w1 * v1 + w2 * v2 + w3 * v3 + w4 * v4 (left to right) with w1..w4 = hy*hx, hy*lx, ly*hx, ly*lx and v1..v4 the
(low, left), (low, right), (high, left), (high, right) cells.  Everything is float32, operation by
operation as the source writes it (the GPU build may fuse a multiply and an add: a last-bit difference).

- ROIWarping (roi_warping_param: pooled_h, pooled_w, spatial_scale; bottoms data, rois (R, 5) =
  [batch, x1, y1, x2, y2] in input pixels; top (R, C, pooled_h, pooled_w)).  Each corner times spatial_scale
  (float32) is rounded with C's round(); the roi is max(x2 - x1, 0) wide (no + 1), bin = width / pooled_w.
  The batch index is the first column truncated toward zero.  caffe-mnc changed the forward on 2016-10-22
  (37e896eb, kept by d8bf82b7 and its head b7bdfee3), with MNC's nets (e2d820f: pooled 28 then a 2 x 2 max
  Pooling where 14 had been), and nothing in a file tells the two apart, so caffeq's own
  `roi_warping_param.design` says which:
  - ONE_SAMPLE (since 37e896eb; unset reads this, with a note): bin (i, j) is the one bilinear sample at
    (y1 + i * bin_h, x1 + j * bin_w); a sample off the map gives 0.
  - MAX_OF_SAMPLES (7a28ed65, 2016-06-22, the first release; delftrobotics-forks/MNC pinned it until it
    dropped the submodule in 2017-03, so its nets, whose Python modules are 'multitask_network_cascades.*',
    are read so, with a note: io/upgrade.py): per axis r = ceil(size / pooled) (float32 division), step =
    float(1.0 / r) (inf when r = 0); samples at f = i, i + step, i + 2 step, ... (float32 sums) while
    f <= i + 1, at y1 + f * bin_h; bin (i, j) is the max over every pair of samples on the map (the kernel's
    `val > max` from -FLT_MAX), 0 when none is.
  A value that is not above -FLT_MAX (NaN, -inf) counts as none, as in the kernel.
- MaskPooling (no parameter; bottoms features, masks; top shaped like the features): features (N, C, H, W)
  times mask element n * H * W + h * W + w of the flat mask blob, which is the (N, 1, H, W) mask; a mask
  with more channels is read as the kernel reads it (its first N * H * W values).  Caffe's Reshape checks
  that num, height and width agree.
- MaskResize (mask_resize_param: output_height, output_width; one bottom): output (n, c, h, w) is the
  bilinear value at (h * (H / out_h), w * (W / out_w)) (float32 ratio, then the product), 0 past the map
  (when upsampling more than 2x); top (N, C, output_height, output_width).

The axis functions and the ROIWarping sample points run on the CPU in float32, the gathers on the input's
device; model.py copies these very functions.  ONNX: ROIWarping ONE_SAMPLE with elementwise ops and Gather
in the same float32 order, C's round through double; MAX_OF_SAMPLES with every axis's sample positions as
a CumSum of the kernel's float32 steps (as many as the largest roi needs) and a Scan over the sample
pairs keeping the running max.  A roi of an image outside the batch gives 0 in ONNX (torch refuses it).
MaskPooling: Reshape, Slice and Mul; MaskResize: Gather with constant cells and weights.
"""
import math

import numpy as np
import torch
from onnx import TensorProto, helper

from ..errors import ExportError
from ..io.schema import caffe_pb2
from .affordance import _OnnxGraph
from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer, torch_sources
from .roi_align_forks import TORCH_ROI_ALIGN_COMMON, roi_align_batch
from .roi_bins_onnx import onnx_batch_column, onnx_bilinear_reads, onnx_padded_rows
from .roi_pooling import ROIS_WANTED, RoiLayerSpec, _check_roi_shapes, pooled_grid_attrs, roi_rows

DESIGNS = caffe_pb2.ROIWarpingParameter.Design
ONE_SAMPLE, MAX_OF_SAMPLES = DESIGNS.Value("ONE_SAMPLE"), DESIGNS.Value("MAX_OF_SAMPLES")
FLT_MAX = float(np.finfo(np.float32).max)

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def mnc_bilinear_axis(at, size: int):
    """caffe-mnc's bilinear read along one axis of `size` cells at float32 positions `at` -> (on the
    map, low cell, high cell, weight of the high cell), each shaped like `at`."""
    f32 = torch.float32
    zero = torch.zeros((), dtype=f32)
    inside = (at >= -0.5) & (at <= size - 0.5)
    at = torch.where(inside, at, zero)
    at = torch.where(at <= 0, zero, at)
    low = at.long()
    edge = low >= size - 1
    low = torch.where(edge, torch.full_like(low, size - 1), low)
    high = torch.where(edge, low, low + 1)
    at = torch.where(edge, low.to(f32), at)
    return inside, low, high, at - low.to(f32)


def mnc_warp_points(start, size, bin_size, pooled: int, max_of_samples: bool):
    """ROIWarping's sample positions along one axis for (R,) float32 roi starts, sizes and bin sizes ->
    [(positions (R, pooled), taken (R, pooled))], one entry per step of the kernel's loop."""
    f32 = torch.float32
    k = torch.arange(pooled, dtype=f32)[None, :]
    if not max_of_samples:
        at = start[:, None] + k * bin_size[:, None]
        return [(at, torch.ones(at.shape, dtype=torch.bool))]
    ratio = torch.ceil(size / float(pooled))   # int roi_pool_ratio = ceil(size / pooled)
    if not bool(torch.isfinite(ratio).all()) or float(ratio.max()) > 4096:
        raise ValueError(f"ROIWarping (MAX_OF_SAMPLES): a roi takes {float(ratio.max())} samples per bin side; "
                         f"caffeq takes at most 4096 (a roi thousands of bins across, or not finite)")
    step = (1.0 / ratio.to(torch.float64)).to(f32)[:, None]   # 1.0 / (Dtype) ratio: double, stored as float
    at, stop, points = k.expand(start.shape[0], pooled), k + 1.0, []
    while True:
        taken = at <= stop
        if not bool(taken.any()):
            return points
        points.append((start[:, None] + at * bin_size[:, None], taken))
        at = at + step


def mnc_warp_sample(x_t, b, ys, xs, h: int, w: int):
    """The bilinear values at (ys[r, i], xs[r, j]) in image b[r] of x_t (N, H, W, C) -> (on the map
    (R, P, Q, 1), value (R, P, Q, C))."""
    dev, dt = x_t.device, x_t.dtype
    in_y, y0, y1, ly = mnc_bilinear_axis(ys, h)
    in_x, x0, x1, lx = mnc_bilinear_axis(xs, w)
    ly, lx = ly[:, :, None], lx[:, None, :]
    hy, hx = 1.0 - ly, 1.0 - lx
    bb = b.to(dev)[:, None, None]
    val = None
    for wt, yi, xi in ((hy * hx, y0, x0), (hy * lx, y0, x1), (ly * hx, y1, x0), (ly * lx, y1, x1)):
        term = wt[..., None].to(dev, dt) * x_t[bb, yi.to(dev)[:, :, None], xi.to(dev)[:, None, :]]
        val = term if val is None else val + term
    return (in_y[:, :, None] & in_x[:, None, :])[..., None].to(dev), val


def mnc_roi_warp(x, rois, ph: int, pw: int, spatial_scale: float, max_of_samples: bool = False):
    """caffe-mnc's ROIWarping -> (R, C, ph, pw): one bilinear sample at each bin's start, or (7a28ed65's
    design) the max over the samples across each bin."""
    f32 = torch.float32
    r = roi_rows(rois, "ROIWarping")
    n, c, h, w = x.shape
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    b = roi_align_batch(r, n, "ROIWarping")
    scaled = (r[:, 1:5] * torch.tensor(spatial_scale, dtype=f32)).double()
    corners = (torch.sign(scaled) * torch.floor(torch.abs(scaled) + 0.5)).to(f32)   # C's round()
    zero = torch.zeros((), dtype=f32)
    size_x = torch.fmax(corners[:, 2] - corners[:, 0], zero)
    size_y = torch.fmax(corners[:, 3] - corners[:, 1], zero)
    ys = mnc_warp_points(corners[:, 1], size_y, size_y / float(ph), ph, max_of_samples)
    xs = mnc_warp_points(corners[:, 0], size_x, size_x / float(pw), pw, max_of_samples)
    x_t = x.permute(0, 2, 3, 1)
    best = torch.full((r.shape[0], ph, pw, c), -3.4028234663852886e38, device=x.device, dtype=x.dtype)
    found = torch.zeros(best.shape, device=x.device, dtype=torch.bool)
    for at_y, taken_y in ys:
        for at_x, taken_x in xs:
            inside, val = mnc_warp_sample(x_t, b, at_y, at_x, h, w)
            taken = (taken_y[:, :, None] & taken_x[:, None, :])[..., None].to(x.device)
            better = inside & taken & (val > best)
            best = torch.where(better, val, best)
            found = found | better
    out = torch.where(found, best, torch.zeros((), device=x.device, dtype=x.dtype))
    return out.permute(0, 3, 1, 2).contiguous()


def mnc_legacy_4d(x):
    """A blob of fewer than 4 axes as Caffe's num/channels/height/width read it: 1 past its last axis."""
    return x.reshape(tuple(x.shape) + (1,) * (4 - x.dim())) if x.dim() < 4 else x


def mnc_mask_pooling(x, masks):
    """caffe-mnc's MaskPooling: x (N, C, H, W) times element n * H * W + h * W + w of the flat masks."""
    x = mnc_legacy_4d(x)
    n, _c, h, w = x.shape
    return x * masks.reshape(-1)[: n * h * w].reshape(n, 1, h, w)


def mnc_resize_axis(n_in: int, n_out: int):
    """MaskResize's reads along one axis: output k at k * (n_in / n_out), float32 (mnc_bilinear_axis)."""
    f32 = torch.float32
    ratio = torch.tensor(float(n_in), dtype=f32) / torch.tensor(float(n_out), dtype=f32)
    return mnc_bilinear_axis(torch.arange(n_out, dtype=f32) * ratio, n_in)


def mnc_resize_tables(h: int, w: int, out_h: int, out_w: int):
    """MaskResize's constants: (on the map (out_h, out_w), rows low/high, columns low/high, and the four
    weights hy*hx, hy*lx, ly*hx, ly*lx, each (out_h, out_w) float32)."""
    in_y, y0, y1, ly = mnc_resize_axis(h, out_h)
    in_x, x0, x1, lx = mnc_resize_axis(w, out_w)
    ly, lx = ly[:, None], lx[None, :]
    hy, hx = 1.0 - ly, 1.0 - lx
    return (in_y[:, None] & in_x[None, :]), (y0, y1), (x0, x1), (hy * hx, hy * lx, ly * hx, ly * lx)


def mnc_mask_resize(x, out_h: int, out_w: int):
    """caffe-mnc's MaskResize -> (N, C, out_h, out_w)."""
    x = mnc_legacy_4d(x)
    dev, dt = x.device, x.dtype
    inside, rows, cols, weights = mnc_resize_tables(x.shape[2], x.shape[3], out_h, out_w)
    picked = [x.index_select(2, rows[0].to(dev)), x.index_select(2, rows[1].to(dev))]
    val = None
    for wt, (i, j) in zip(weights, ((0, 0), (0, 1), (1, 0), (1, 1))):
        term = wt.to(dev, dt) * picked[i].index_select(3, cols[j].to(dev))
        val = term if val is None else val + term
    return torch.where(inside.to(dev), val, torch.zeros((), device=dev, dtype=dt))


TORCH_MNC_BILINEAR = torch_sources(mnc_bilinear_axis)
TORCH_ROI_WARPING = torch_sources(mnc_warp_points, mnc_warp_sample, mnc_roi_warp)
TORCH_MNC_LEGACY = torch_sources(mnc_legacy_4d)
TORCH_MASK_POOLING = torch_sources(mnc_mask_pooling)
TORCH_MASK_RESIZE = torch_sources(mnc_resize_axis, mnc_resize_tables, mnc_mask_resize)


# ---- the specs ------------------------------------------------------------------------------

UNSET_DESIGN_NOTE = ("roi_warping_param names no design: read as caffe-mnc's ROIWarping since 2016-10-22 (one "
                     "bilinear sample at each bin's start); its first release (7a28ed65, which MNC's nets before "
                     "then and delftrobotics-forks/MNC ran) takes the max over samples across each bin: add "
                     "`design: MAX_OF_SAMPLES` to roi_warping_param for that one")


@register_layer("ROIWarping")
class ROIWarping(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(mnc_roi_warp), TORCH_ROI_WARPING
    roi_helpers = (TORCH_ROI_ALIGN_COMMON, TORCH_MNC_BILINEAR)

    def parse(self, lp):
        need_blobs(lp, "ROIWarping", 2, 1, roles="data, rois", in_place=False)
        p = lp.roi_warping_param
        return {**pooled_grid_attrs(p, "roi_warping_param"), "max_of_samples": p.design == MAX_OF_SAMPLES,
                "reading_notes": [] if p.HasField("design") else [UNSET_DESIGN_NOTE]}

    def infer(self, attrs, in_shapes):
        _check_roi_shapes("ROIWarping", in_shapes)
        s, r = in_shapes
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        extra = {"max_of_samples": True} if attrs["max_of_samples"] else {}
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], **extra}

    def onnx(self, ctx, node):
        a = node.attrs
        x, rois = node.inputs
        if math.prod(ctx.shape(rois)[1:]) != 5:
            raise ExportError(f"layer '{node.name}' (ROIWarping): {ROIS_WANTED}, the net declares "
                              f"{list(ctx.shape(rois))}; give their shape with --input-shape")
        n, c, h, w = ctx.shape(x)
        g = _OnnxGraph(ctx)
        flat, count = onnx_padded_rows(ctx, rois, 5)     # a padding row: the Scan below takes no 0 rois
        batch, in_batch = onnx_batch_column(ctx, flat, n)
        batch = g.op("Unsqueeze", batch, g.i64([1]))   # (R, 1)
        scaled = g.op("Cast", g.op("Mul", g.op("Slice", flat, g.i64([1]), g.i64([5]), g.i64([1])),
                                   g.f32(a["scale"])), to=11)
        half = g.ctx.const(np.array(0.5, np.float64))
        corners = g.op("Cast", g.op("Mul", g.op("Sign", scaled), g.op("Floor", g.op("Add", g.op("Abs", scaled), half))),
                       to=1)   # C's round(), through double
        col = lambda k: g.op("Slice", corners, g.i64([k]), g.i64([k + 1]), g.i64([1]))   # (R, 1)
        x1, y1, x2, y2 = (col(k) for k in range(4))
        table = g.op("Reshape", g.op("Transpose", x, perm=[0, 2, 3, 1]), g.i64([-1, c]))   # (N * H * W, C)
        base = g.op("Unsqueeze", g.op("Mul", batch, g.i64(h * w)), g.i64([2]))   # (R, 1, 1)
        if a["max_of_samples"]:
            out = _onnx_max_of_samples(ctx, g, node, table, base, (x1, y1, x2, y2), (a["ph"], a["pw"], c, h, w))
        else:
            ys = _onnx_bilinear(g, _onnx_starts(g, y1, y2, a["ph"]), h)
            xs = _onnx_bilinear(g, _onnx_starts(g, x1, x2, a["pw"]), w)
            inside, val = onnx_bilinear_reads(g, table, base, ys, xs, w)
            keep = g.op("And", inside, g.op("Greater", val, g.f32(-FLT_MAX)))
            out = g.op("Where", keep, val, g.f32(0.0))
        out = g.op("Where", g.op("Reshape", in_batch, g.i64([-1, 1, 1, 1])), out, g.f32(0.0))
        out = g.op("Slice", out, g.i64([0]), count, g.i64([0]))
        ctx.add_node("Transpose", [out], [node.outputs[0]], name=node.name, perm=[0, 3, 1, 2])


def _onnx_starts(g, start, end, pooled):
    """ONE_SAMPLE's mnc_warp_points for (R, 1) rounded corners: the (R, pooled) bin starts."""
    bin_size = g.op("Div", g.op("Max", g.op("Sub", end, start), g.f32(0.0)), g.f32(float(pooled)))
    return g.op("Add", start, g.op("Mul", g.f32(np.arange(pooled, dtype=np.float32)[None, :]), bin_size))


def _onnx_bilinear(g, at, size):
    """ONNX form of mnc_bilinear_axis at float32 positions `at` -> (on the map (bool), low, high (int64),
    weight of the high cell), each shaped like `at`."""
    inside = g.op("And", g.op("GreaterOrEqual", at, g.f32(-0.5)), g.op("LessOrEqual", at, g.f32(size - 0.5)))
    zero = g.f32(0.0)
    at = g.op("Where", inside, at, zero)
    at = g.op("Where", g.op("LessOrEqual", at, zero), zero, at)
    low = g.op("Cast", at, to=7)
    last = g.i64(size - 1)
    edge = g.op("GreaterOrEqual", low, last)
    low = g.op("Where", edge, last, low)
    high = g.op("Where", edge, low, g.op("Add", low, g.i64(1)))
    low_f = g.op("Cast", low, to=1)
    at = g.op("Where", edge, low_f, at)
    return inside, low, high, g.op("Sub", at, low_f)


class _ScanBody(_OnnxGraph):
    """_OnnxGraph's op and constants appended to a Scan body's node list (constants as Constant nodes)."""

    def __init__(self, ctx, body):
        super().__init__(ctx)
        self.body = body
        self.i64 = lambda v: ctx.body_const(body, np.array(v, np.int64))
        self.f32 = lambda v: ctx.body_const(body, np.array(v, np.float32))

    def op(self, kind, *inputs, **attrs):
        return self.ctx.body_op(self.body, kind, list(inputs), kind.lower(), **attrs)


def _onnx_max_of_samples(ctx, g, node, table, base, corners, dims):
    """MAX_OF_SAMPLES (mnc_warp_points' loop, mnc_warp_sample at every pair of samples, the kernel's running
    max): each axis's S = max ratio + 2 sample positions as a CumSum of k, step, step, ... (the kernel's float32
    sums), then a Scan over the S x S pairs carrying the best values and whether any sample was taken."""
    ph, pw, c, h, w = dims
    x1, y1, x2, y2 = corners
    axes = []
    for start, end, pooled in ((y1, y2, ph), (x1, x2, pw)):
        size = g.op("Max", g.op("Sub", end, start), g.f32(0.0))                                   # (R, 1)
        ratio = g.op("Ceil", g.op("Div", size, g.f32(float(pooled))))
        step = g.op("Cast", g.op("Div", g.ctx.const(np.array(1.0, np.float64)), g.op("Cast", ratio, to=11)), to=1)
        axes.append((start, g.op("Div", size, g.f32(float(pooled))), pooled, ratio, step))
    most = g.op("Max", g.op("ReduceMax", axes[0][3], keepdims=0), g.op("ReduceMax", axes[1][3], keepdims=0))
    # S: ratio + 1 steps reach k + 1, one more for float32 drift, and a margin for the drift of large ratios
    count = g.op("Cast", g.op("Add", g.op("Add", most, g.op("Floor", g.op("Div", most, g.f32(64.0)))), g.f32(2.0)),
                 to=7)
    s_index = g.op("Range", g.i64(0), count, g.i64(1))                                              # (S,)
    first = g.op("Equal", s_index, g.i64(0))
    per_axis = []
    for (start, bin_size, pooled, _ratio, step), extent in zip(axes, (h, w)):
        k = g.f32(np.arange(pooled, dtype=np.float32).reshape(1, pooled, 1))
        steps = g.op("Where", first, k, g.op("Unsqueeze", step, g.i64([2])))                        # (R, pooled, S)
        at = g.op("CumSum", steps, g.i64(2))                                                         # k, k + step, ...
        taken = g.op("LessOrEqual", at, g.op("Add", k, g.f32(1.0)))
        where = g.op("Add", g.op("Unsqueeze", start, g.i64([2])),
                     g.op("Mul", at, g.op("Unsqueeze", bin_size, g.i64([2]))))
        per_axis.append(list(_onnx_bilinear(g, where, extent)) + [taken])
    body = []
    sb = _ScanBody(ctx, body)
    best_in, found_in, pair = (ctx.tmp(f"{node.name}_{k}") for k in ("best_in", "found_in", "pair"))
    sy, sx = sb.op("Div", pair, count), sb.op("Mod", pair, count)
    ys, xs = ([sb.op("Gather", v, at, axis=2) for v in arrays] for arrays, at in ((per_axis[0], sy), (per_axis[1], sx)))
    inside, val = onnx_bilinear_reads(sb, table, base, ys[:4], xs[:4], w)
    both = sb.op("And", sb.op("Unsqueeze", ys[4], sb.i64([2])), sb.op("Unsqueeze", xs[4], sb.i64([1])))
    taken = sb.op("Unsqueeze", both, sb.i64([3]))
    better = sb.op("And", sb.op("And", inside, taken), sb.op("Greater", val, best_in))
    best_out, found_out = sb.op("Where", better, val, best_in), sb.op("Or", found_in, better)
    shape4 = [None, ph, pw, c]
    graph = helper.make_graph(body, f"{node.name}_sample_pair",
                              [helper.make_tensor_value_info(best_in, TensorProto.FLOAT, shape4),
                               helper.make_tensor_value_info(found_in, TensorProto.BOOL, shape4),
                               helper.make_tensor_value_info(pair, TensorProto.INT64, [])],
                              [helper.make_tensor_value_info(best_out, TensorProto.FLOAT, shape4),
                               helper.make_tensor_value_info(found_out, TensorProto.BOOL, shape4)])
    rois = g.op("Slice", g.op("Shape", base), g.i64([0]), g.i64([1]))
    shape = g.op("Concat", rois, g.i64([ph, pw, c]), axis=0)
    best0 = g.op("Expand", g.f32(-FLT_MAX), shape)
    found0 = g.op("Expand", g.ctx.const(np.array(False)), shape)
    pairs = g.op("Range", g.i64(0), g.op("Mul", count, count), g.i64(1))
    best, found = ctx.add_node("Scan", [best0, found0, pairs], [ctx.tmp(f"{node.name}_best"),
                                                               ctx.tmp(f"{node.name}_found")],
                               body=graph, num_scan_inputs=1)
    return g.op("Where", found, best, g.f32(0.0))


def _onnx_legacy_4d(g, name, rank):
    """An input of fewer than 4 axes with Caffe's trailing 1s."""
    return g.op("Unsqueeze", name, g.i64(list(range(rank, 4)))) if rank < 4 else name


@register_layer("MaskPooling")
class MaskPooling(Layer):
    bottoms, tops, bottom_roles = 2, 1, "features, masks"

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "MaskPooling")
        mn, _mc, mh, mw = legacy_nchw(in_shapes[1], "MaskPooling")
        # the fork's Reshape: CHECK_EQ of height, width and num, in that order
        for ours, theirs, what in ((h, mh, "height"), (w, mw, "width"), (n, mn, "num")):
            if ours != theirs:
                raise LayerError(f"MaskPooling: feature map {what} and mask {what} must be the same, "
                                 f"got {list(in_shapes[0])} and {list(in_shapes[1])}")
        return [(n, c, h, w)]

    def forward(self, attrs, params, x, masks):
        return mnc_mask_pooling(x, masks)

    def onnx(self, ctx, node):
        x, masks = node.inputs
        shape = ctx.shape(x)
        _n, _c, h, w = legacy_nchw(shape, "MaskPooling")
        g = _OnnxGraph(ctx)
        x4 = _onnx_legacy_4d(g, x, len(shape))
        rows = g.op("Reshape", masks, g.i64([-1, h * w]))   # the flat masks, H * W values a row
        first = g.op("Slice", rows, g.i64([0]), g.op("Slice", g.op("Shape", x4), g.i64([0]), g.i64([1])), g.i64([0]))
        ctx.add_node("Mul", [x4, g.op("Reshape", first, g.i64([-1, 1, h, w]))], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_MNC_LEGACY)
        return f"{emit.helper(TORCH_MASK_POOLING)}({', '.join(emit.inputs)})"


@register_layer("MaskResize")
class MaskResize(Layer):
    def parse(self, lp):
        need_blobs(lp, "MaskResize", 1, 1, in_place=False)
        p = lp.mask_resize_param
        if p.output_height <= 0 or p.output_width <= 0:
            raise LayerError(f"mask_resize_param.output_height and output_width must be > 0, "
                             f"got {p.output_height} x {p.output_width}")
        # BestSonny/SSTD's copy: a positive factor sizes that axis as int(bottom's size * factor) instead
        return {"out_h": int(p.output_height), "out_w": int(p.output_width),
                "factors": (float(p.factor_height), float(p.factor_width))}

    @staticmethod
    def out_hw(attrs, h, w):
        fh, fw = attrs.get("factors", (0.0, 0.0))
        # the fork's int(height * factor), the product in float
        out_h = int(np.float32(h) * np.float32(fh)) if fh > 0 else attrs["out_h"]
        out_w = int(np.float32(w) * np.float32(fw)) if fw > 0 else attrs["out_w"]
        return out_h, out_w

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "MaskResize")
        out_h, out_w = self.out_hw(attrs, h, w)
        if out_h < 1 or out_w < 1:
            raise LayerError(f"mask_resize_param's factors give a {out_h}x{out_w} top for a {h}x{w} bottom")
        attrs["out_h"], attrs["out_w"] = out_h, out_w   # the sizes the bottom's size gives, for the exporters
        return [(n, c, out_h, out_w)]

    def forward(self, attrs, params, x):
        _n, _c, h, w = legacy_nchw(x.shape, "MaskResize")
        return mnc_mask_resize(x, *self.out_hw(attrs, h, w))

    def onnx(self, ctx, node):
        a = node.attrs
        shape = ctx.shape(node.inputs[0])
        _n, _c, h, w = legacy_nchw(shape, "MaskResize")
        inside, rows, cols, weights = mnc_resize_tables(h, w, a["out_h"], a["out_w"])
        g = _OnnxGraph(ctx)
        x4 = _onnx_legacy_4d(g, node.inputs[0], len(shape))
        picked = [g.op("Gather", x4, g.i64(t.numpy()), axis=2) for t in rows]
        val = None
        for wt, (i, j) in zip(weights, ((0, 0), (0, 1), (1, 0), (1, 1))):
            term = g.op("Mul", g.f32(wt.numpy()), g.op("Gather", picked[i], g.i64(cols[j].numpy()), axis=3))
            val = term if val is None else g.op("Add", val, term)
        ctx.add_node("Where", [g.ctx.const(inside.numpy()), val, g.f32(0.0)], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(TORCH_MNC_BILINEAR)
        emit.helper(TORCH_MNC_LEGACY)
        return f"{emit.helper(TORCH_MASK_RESIZE)}({emit.inputs[0]}, {a['out_h']}, {a['out_w']})"
