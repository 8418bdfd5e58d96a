"""zhaoweicai's MS-CNN / Cascade R-CNN fork (zhaoweicai/mscnn 534bcac, zhaoweicai/cascade-rcnn 2252f46).

- ROIAlign (roi_align_layer.cpp): reads roi_pooling_param.  Each roi [batch, x1, y1, x2, y2], widened by
  pad_ratio as in ROIPooling, is scaled and shifted by -0.5 (float32); a (pooled_h + 1) x (pooled_w + 1)
  grid of points start + k * (size / pooled) is sampled bilinearly, one point per output, no averaging.
  So the top is (R, C, pooled_h + 1, pooled_w + 1).  A point outside [-0.5, size - 0.5] gives 0, as does
  every point of a roi whose scaled size is not positive; inside, the point and its neighbours are
  clipped to the map.  ONNX's RoiAlign averages bins and zeroes other borders, so the export writes the
  grid in plain ops (onnx_roi_align_grid: GatherND of the four corners, the same float32 arithmetic).
  A ROIAlign that sets roi_align_param instead is the Mask R-CNN / R-FCN forks' layer
  (caffeq/layers/roi_align_forks.py claims it).
- DecodeBBox (decode_bbox_layer.cpp, bbox_util.cpp DecodeBBoxesWithPrior): bottoms (deltas (R, 8) = the
  background and foreground boxes of a class-agnostic regressor, rois (R, 5)); the foreground deltas,
  de-normalized by bbox_reg_param's std and mean, move each roi as Fast R-CNN does (width x2 - x1 + 1,
  centre (x1 + x2) / 2, the size times the exp of its delta in double, as the fork's GCC 4/5 builds do);
  no clipping.  Top = the rois' shape, with the batch
  column kept.  In TRAIN the fork also drops inverted boxes and, with a third bottom (matched gt boxes),
  boxes whose IoU >= decode_bbox_param.gt_iou_thr: that data-dependent screening is not reproduced.
- BoxGroupOutput (cascade-rcnn) and BoxOutput (mscnn), the region proposals: mscnn_proposals.py.

The torch functions below serve `forward` and are copied into model.py (inspect.getsource).
"""
import math

import numpy as np
import torch
from torch import nn

from ..errors import ExportError
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from .roi_pooling import RoiLayerSpec, _check_roi_shapes, roi_pooling_attrs, roi_rows

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def roi_align_grid(x, rois, ph: int, pw: int, spatial_scale: float, pad_ratio: float = 0.0):
    """The zhaoweicai fork's ROIAlign -> (R, C, ph + 1, pw + 1); grid arithmetic in float32 on the CPU."""
    f32 = torch.float32
    r = roi_rows(rois, "ROIAlign")
    n, c, h, w = x.shape
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph + 1, pw + 1))
    batch = r[:, 0].long()   # C's int conversion: toward zero
    if bool(((batch < 0) | (batch >= n)).any()):
        bad = int(batch[(batch < 0) | (batch >= n)][0])
        raise ValueError(f"ROIAlign: roi batch index {bad} is outside the batch of {n}")
    start, end = r[:, 1:3], r[:, 3:5]   # (x, y)
    if pad_ratio != 0:
        pad = (end - start + 1.0) * torch.tensor(pad_ratio, dtype=f32)
        start, end = start - pad, end + pad
    scale = torch.tensor(spatial_scale, dtype=f32)
    start = start * scale - 0.5
    end = end * scale - 0.5
    size = end - start
    malformed = (size[:, 0] <= 0) | (size[:, 1] <= 0)
    bin_w = size[:, 0] / torch.tensor(float(pw), dtype=f32)
    bin_h = size[:, 1] / torch.tensor(float(ph), dtype=f32)
    ys = start[:, 1:2] + torch.arange(ph + 1, dtype=f32)[None, :] * bin_h[:, None]   # (R, ph + 1)
    xs = start[:, 0:1] + torch.arange(pw + 1, dtype=f32)[None, :] * bin_w[:, None]   # (R, pw + 1)
    inside = (((ys >= -0.5) & (ys <= h - 0.5))[:, :, None] & ((xs >= -0.5) & (xs <= w - 0.5))[:, None, :]
              & ~malformed[:, None, None])   # (R, ph + 1, pw + 1)
    y0 = torch.floor(ys).long()
    x0 = torch.floor(xs).long()
    y1 = (y0 + 1).clamp(0, h - 1)
    x1 = (x0 + 1).clamp(0, w - 1)
    y0, x0 = y0.clamp(0, h - 1), x0.clamp(0, w - 1)
    ly = ys.clamp(0, h - 1) - y0.float()
    lx = xs.clamp(0, w - 1) - x0.float()
    hy, hx = 1 - ly, 1 - lx
    # the fork's weights: w00 = hx*hy (y0, x0), w10 = lx*hy (y0, x1), w01 = hx*ly (y1, x0), w11 = lx*ly
    weights = [hx[:, None, :] * hy[:, :, None], lx[:, None, :] * hy[:, :, None],
               hx[:, None, :] * ly[:, :, None], lx[:, None, :] * ly[:, :, None]]
    corners = [(y0, x0), (y0, x1), (y1, x0), (y1, x1)]
    # channels last, each grid point's C values are one contiguous row to gather; the sums run in
    # place in the fork's order (bit-equal to the unfused form), one gather buffer reused when no
    # gradient is wanted (out= has none): fresh 20 MB buffers cost more than the arithmetic
    pixels = x.permute(0, 2, 3, 1).reshape(n * h * w, c)
    base = (batch * (h * w))[:, None, None]
    reuse = not (torch.is_grad_enabled() and x.requires_grad)
    out = gathered = None
    for wt, (yi, xi) in zip(weights, corners):
        rows = (base + yi[:, :, None] * w + xi[:, None, :]).reshape(-1).to(x.device)
        wt = wt.reshape(-1, 1).to(x.device, x.dtype)
        if out is None:
            out = pixels.index_select(0, rows).mul_(wt)
            continue
        gathered = torch.index_select(pixels, 0, rows, out=gathered) if reuse else pixels.index_select(0, rows)
        out.add_(gathered.mul_(wt))
    out.masked_fill_(~inside.reshape(-1, 1).to(x.device), 0)
    return out.reshape(-1, ph + 1, pw + 1, c).permute(0, 3, 1, 2).contiguous()


def decode_roi_boxes(deltas, rois, means, stds):
    """The fork's DecodeBBox (TEST): rois (R, 5) moved by the foreground deltas deltas[:, 4:8]
    (de-normalized: delta * std + mean) -> [batch, x1, y1, x2, y2], shaped like rois."""
    num = rois.shape[0]
    d = deltas.reshape(num, -1)[:, 4:8]
    p = rois.reshape(num, -1)
    mean = torch.tensor(means, dtype=d.dtype, device=d.device)
    std = torch.tensor(stds, dtype=d.dtype, device=d.device)
    dx, dy, dw, dh = (d * std + mean).unbind(1)
    width = p[:, 3] - p[:, 1] + 1
    height = p[:, 4] - p[:, 2] + 1
    cx = 0.5 * (p[:, 3] + p[:, 1])
    cy = 0.5 * (p[:, 4] + p[:, 2])
    # `pw * exp(bw)` as the fork's GCC 4/5 builds compile it: the double exp, the product in double,
    # rounded once (mscnn_proposals.py says more)
    new_w = (width.double() * torch.exp(dw.double())).to(d.dtype)
    new_h = (height.double() * torch.exp(dh.double())).to(d.dtype)
    x1 = dx * width + cx - (new_w - 1) / 2
    y1 = dy * height + cy - (new_h - 1) / 2
    boxes = torch.stack([p[:, 0], x1, y1, x1 + new_w - 1, y1 + new_h - 1], 1)
    return boxes.reshape(rois.shape)


class DecodeRoiBoxes(nn.Module):
    """The fork's DecodeBBox (see decode_roi_boxes)."""

    def __init__(self, means=(0.0, 0.0, 0.0, 0.0), stds=(1.0, 1.0, 1.0, 1.0)):
        super().__init__()
        self.means, self.stds = list(means), list(stds)

    def forward(self, deltas, rois):
        return decode_roi_boxes(deltas, rois, self.means, self.stds)


def scale_route_rows(rois, low: float, high: float, mid: float):
    """Cascade R-CNN's ScaleRoute: the indices of the rois whose sqrt((x2-x1+1)(y2-y1+1)) lies in
    [low, high) (an inverted box has size 0); when none does, the one closest to `mid` in log2
    scale (the first of equals)."""
    r = rois.reshape(rois.shape[0], -1).detach().float().cpu()
    w, h = r[:, 3] - r[:, 1], r[:, 4] - r[:, 2]
    size = torch.where((w < 0) | (h < 0), torch.zeros_like(w), (w + 1) * (h + 1))
    scale = torch.sqrt(size)
    chosen = torch.nonzero((scale >= low) & (scale < high)).flatten()
    if chosen.numel() == 0 and r.shape[0]:
        chosen = torch.argmin(torch.abs(torch.log2(scale / mid))).reshape(1)
    return chosen.to(rois.device)


class ScaleRoute(nn.Module):
    """scale_route_rows applied to every input: the same rows of each (the rois first)."""

    def __init__(self, low, high, mid):
        super().__init__()
        self.low, self.high, self.mid = low, high, mid

    def forward(self, rois, *others):
        rows = scale_route_rows(rois, self.low, self.high, self.mid)
        return tuple(x[rows] for x in (rois,) + others)


TORCH_ROI_ALIGN = torch_sources(roi_align_grid)
TORCH_DECODE_BBOX = torch_sources(decode_roi_boxes, DecodeRoiBoxes)


# ---- the specs ---------------------------------------------------------------------------

def onnx_roi_align_grid(ctx, node, ph, pw, scale, pad_ratio):
    """roi_align_grid in ONNX ops: the same float32 grid for every roi, the four corners of each point read
    with GatherND from the (N, H, W, C) view of the data, weighted and summed in the same order."""
    i64 = 7
    x, rois = node.inputs
    _, _, h, w = ctx.shape(x)
    rows = ctx.op("Reshape", [rois, ctx.i64([-1, 5])], "rows")
    batch = ctx.op("Cast", [ctx.op("Gather", [rows, ctx.i64(0)], "batch", axis=1)], "batch", to=i64)   # (R,)
    start = ctx.op("Slice", [rows, ctx.i64([1]), ctx.i64([3]), ctx.i64([1])], "start")                # (R, 2)
    end = ctx.op("Slice", [rows, ctx.i64([3]), ctx.i64([5]), ctx.i64([1])], "end")
    if pad_ratio != 0:
        pad = ctx.op("Mul", [ctx.op("Add", [ctx.op("Sub", [end, start], "span"), ctx.f32(1.0)], "span"),
                             ctx.f32(float(np.float32(pad_ratio)))], "pad")
        start, end = ctx.op("Sub", [start, pad], "start"), ctx.op("Add", [end, pad], "end")
    scale_c = ctx.f32(float(np.float32(scale)))
    start = ctx.op("Sub", [ctx.op("Mul", [start, scale_c], "start"), ctx.f32(0.5)], "start")
    end = ctx.op("Sub", [ctx.op("Mul", [end, scale_c], "end"), ctx.f32(0.5)], "end")
    size = ctx.op("Sub", [end, start], "size")
    # a roi whose scaled width or height is not positive gives 0 everywhere
    positive = ctx.op("Greater", [size, ctx.f32(0.0)], "positive")                                           # (R, 2)
    good = ctx.op("And", [ctx.op("Slice", [positive, ctx.i64([0]), ctx.i64([1]), ctx.i64([1])], "wide"),
                          ctx.op("Slice", [positive, ctx.i64([1]), ctx.i64([2]), ctx.i64([1])], "high")], "good")  # (R, 1)
    axes = []
    for col, pooled, extent in ((1, ph, h), (0, pw, w)):   # y then x
        s_ = ctx.op("Slice", [start, ctx.i64([col]), ctx.i64([col + 1]), ctx.i64([1])], "s")              # (R, 1)
        b_ = ctx.op("Div", [ctx.op("Slice", [size, ctx.i64([col]), ctx.i64([col + 1]), ctx.i64([1])], "b"),
                            ctx.f32(float(pooled))], "bin")
        k = ctx.const(np.arange(pooled + 1, dtype=np.float32).reshape(1, pooled + 1))
        at = ctx.op("Add", [s_, ctx.op("Mul", [k, b_], "k")], "at")                                        # (R, K)
        inside = ctx.op("And", [ctx.op("GreaterOrEqual", [at, ctx.f32(-0.5)], "ge"),
                                ctx.op("LessOrEqual", [at, ctx.f32(extent - 0.5)], "le")], "inside")
        low = ctx.op("Floor", [at], "low")
        bounds = (ctx.f32(0.0), ctx.f32(float(extent - 1)))
        high = ctx.op("Clip", [ctx.op("Add", [low, ctx.f32(1.0)], "high"), *bounds], "high")
        low = ctx.op("Clip", [low, *bounds], "low")
        frac = ctx.op("Sub", [ctx.op("Clip", [at, *bounds], "at"), low], "frac")
        axes.append((inside, low, high, ctx.op("Sub", [ctx.f32(1.0), frac], "keep"), frac))
    (in_y, y0, y1, hy, ly), (in_x, x0, x1, hx, lx) = axes
    rows3 = lambda t: ctx.op("Unsqueeze", [t, ctx.i64([2])], "rows")       # (R, P) -> (R, P, 1)
    cols3 = lambda t: ctx.op("Unsqueeze", [t, ctx.i64([1])], "cols")       # (R, Q) -> (R, 1, Q)
    inside = ctx.op("And", [ctx.op("And", [rows3(in_y), cols3(in_x)], "inside"),
                            ctx.op("Unsqueeze", [good, ctx.i64([2])], "good")], "inside")
    weights = [ctx.op("Mul", [cols3(wx), rows3(wy)], "w") for wx, wy in ((hx, hy), (lx, hy), (hx, ly), (lx, ly))]
    grid1 = ctx.op("Concat", [ctx.op("Shape", [weights[0]], "grid"), ctx.i64([1])], "grid1", axis=0)   # R, P, Q, 1
    data = ctx.op("Transpose", [x], "nhwc", perm=[0, 2, 3, 1])

    def index_part(t):   # an int64 (R, P, Q, 1) column of the GatherND index
        return ctx.op("Expand", [ctx.op("Unsqueeze", [ctx.op("Cast", [t], "i", to=i64), ctx.i64([3])], "i"), grid1],
                      "i")

    image = index_part(ctx.op("Unsqueeze", [batch, ctx.i64([1, 2])], "b"))
    rows_at = {t: index_part(rows3(t)) for t in (y0, y1)}
    cols_at = {t: index_part(cols3(t)) for t in (x0, x1)}

    def corner(yi, xi):   # (R, P, Q, C)
        return ctx.op("GatherND", [data, ctx.op("Concat", [image, rows_at[yi], cols_at[xi]], "index", axis=3)],
                      "corner")

    out = None
    for wt, (yi, xi) in zip(weights, ((y0, x0), (y0, x1), (y1, x0), (y1, x1))):
        term = ctx.op("Mul", [ctx.op("Unsqueeze", [wt, ctx.i64([3])], "w"), corner(yi, xi)], "term")
        out = term if out is None else ctx.op("Add", [out, term], "sum")
    kept = ctx.op("Where", [ctx.op("Unsqueeze", [inside, ctx.i64([3])], "inside"), out, ctx.f32(0.0)], "kept")
    ctx.add_node("Transpose", [kept], [node.outputs[0]], name=node.name, perm=[0, 3, 1, 2])


@register_layer("ROIAlign")
class ROIAlign(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(roi_align_grid), TORCH_ROI_ALIGN

    def parse(self, lp):
        if not lp.HasField("roi_pooling_param"):
            raise LayerError("ROIAlign sets neither roi_pooling_param (zhaoweicai's cascade-rcnn layer) nor "
                             "roi_align_param (the Mask R-CNN / R-FCN forks' layer): pooled_h and pooled_w are needed")
        return roi_pooling_attrs(lp, "ROIAlign")

    def infer(self, attrs, in_shapes):
        _check_roi_shapes("ROIAlign", in_shapes)
        s, r = in_shapes
        return [(r[0], s[1], attrs["ph"] + 1, attrs["pw"] + 1)]   # the fork's grid is pooled + 1 points

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], "pad_ratio": attrs["pad_ratio"]}

    def onnx(self, ctx, node):
        a = node.attrs   # infer has checked the rois are 5 wide
        onnx_roi_align_grid(ctx, node, a["ph"], a["pw"], a["scale"], a["pad_ratio"])


def bbox_reg_normalization(lp, where, positive_std=True):
    """bbox_reg_param's (means, stds): both or neither given, 4 each, stds > 0 (the fork's CHECKs; MS-CNN's
    BoxOutput has no check on the stds: positive_std=False)."""
    p = lp.bbox_reg_param
    if len(p.bbox_mean) and len(p.bbox_std):
        if len(p.bbox_mean) != 4 or len(p.bbox_std) != 4:
            raise LayerError(f"{where}: bbox_reg_param needs 4 bbox_mean and 4 bbox_std values, "
                             f"got {len(p.bbox_mean)} and {len(p.bbox_std)}")
        stds = [float(np.float32(v)) for v in p.bbox_std]
        if positive_std and not all(v > 0 for v in stds):
            raise LayerError(f"{where}: bbox_reg_param.bbox_std must all be > 0, got {stds}")
        return [float(np.float32(v)) for v in p.bbox_mean], stds
    return [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]


@register_layer("DecodeBBox")
class DecodeBBox(Layer):
    def parse(self, lp):
        need_blobs(lp, "DecodeBBox", (2, 3), 1, roles="bbox deltas, rois, and in TRAIN the matched gt boxes")
        means, stds = bbox_reg_normalization(lp, "DecodeBBox")
        return {"means": means, "stds": stds, "train_screen": len(lp.bottom) == 3, "name": lp.name}

    def infer(self, attrs, in_shapes):
        deltas, rois = in_shapes[0], in_shapes[1]
        if len(deltas) < 2 or deltas[1] != 8 or math.prod(deltas[2:]) != 1:
            raise LayerError(f"DecodeBBox: bottom 0 must be (R, 8) bbox deltas (background and foreground box), "
                             f"got {list(deltas)}")
        if len(rois) < 2 or rois[1] != 5 or math.prod(rois[2:]) != 1:
            raise LayerError(f"DecodeBBox: bottom 1 must be (R, 5) rois [batch, x1, y1, x2, y2], got {list(rois)}")
        if deltas[0] != rois[0] or (len(in_shapes) == 3 and in_shapes[2][0] != deltas[0]):
            raise LayerError(f"DecodeBBox: the bottoms need the same number of rows, got "
                             f"{[list(s) for s in in_shapes]}")
        return [tuple(rois)]

    def _refuse_train(self, error, name):
        raise error(f"layer '{name}' (DecodeBBox): with a third bottom (matched gt boxes) it is the TRAIN-phase "
                    f"layer, which drops boxes by their data; only the TEST decoding (2 bottoms) runs here")

    def forward(self, attrs, params, deltas, rois, *gt):
        if attrs["train_screen"]:
            self._refuse_train(LayerError, attrs["name"])
        return decode_roi_boxes(deltas, rois, attrs["means"], attrs["stds"])

    def onnx(self, ctx, node):
        a = node.attrs
        if a["train_screen"]:
            self._refuse_train(ExportError, node.name)

        def column(src, lo, hi, hint):
            return ctx.op("Slice", [src, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([1])], hint)

        deltas = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, 8])], "deltas")
        rois = ctx.op("Reshape", [node.inputs[1], ctx.i64([-1, 5])], "rois")
        d = ctx.op("Add", [ctx.op("Mul", [column(deltas, 4, 8, "fg"), ctx.f32(a["stds"])], "scaled"),
                           ctx.f32(a["means"])], "d")
        start, end = column(rois, 1, 3, "start"), column(rois, 3, 5, "end")   # (x, y) pairs
        size = ctx.op("Add", [ctx.op("Sub", [end, start], "diff"), ctx.f32(1.0)], "size")
        centre = ctx.op("Mul", [ctx.f32(0.5), ctx.op("Add", [end, start], "sum")], "centre")
        # size * exp(d) in double, rounded once to float (decode_roi_boxes)
        exp = ctx.op("Exp", [ctx.op("Cast", [column(d, 2, 4, "dwh")], "dwh64", to=11)], "exp")
        new_size = ctx.op("Cast", [ctx.op("Mul", [ctx.op("Cast", [size], "size64", to=11), exp], "new_size64")],
                          "new_size", to=1)
        moved = ctx.op("Add", [ctx.op("Mul", [column(d, 0, 2, "dxy"), size], "shift"), centre], "moved")
        lo = ctx.op("Sub", [moved, ctx.op("Div", [ctx.op("Sub", [new_size, ctx.f32(1.0)], "nm1"), ctx.f32(2.0)],
                                          "half")], "lo")
        hi = ctx.op("Sub", [ctx.op("Add", [lo, new_size], "lo_plus"), ctx.f32(1.0)], "hi")
        boxes = ctx.op("Concat", [column(rois, 0, 1, "batch"), lo, hi], "boxes", axis=1)
        ctx.add_node("Reshape", [boxes, ctx.op("Shape", [node.inputs[1]], "shape")], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a["train_screen"]:
            self._refuse_train(ExportError, node.name)
        m = emit.instance(TORCH_DECODE_BBOX, means=list(a["means"]), stds=list(a["stds"]))
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"


@register_layer("ScaleRoute")
class ScaleRouteLayer(Layer):
    """The rois of one FPN level and the matching rows of the other bottoms (cascade-rcnn's
    scale_route_layer.cpp); R depends on the data."""

    onnx_refusal = ("its fallback (the roi closest to the level's scale when none falls in it) has no ONNX "
                    "form here; export the net up to the proposals (--outputs) or run it in torch")

    data_dependent_shape = True

    def parse(self, lp):
        if not lp.bottom or len(lp.bottom) != len(lp.top):
            raise LayerError(f"ScaleRoute takes as many tops as bottoms (rois first), got {len(lp.bottom)} and "
                             f"{len(lp.top)}")
        p = lp.scale_route_param
        low = float(np.float32(p.low_scale)) if p.HasField("low_scale") else 0.0
        high = float(np.float32(p.high_scale)) if p.HasField("high_scale") else float(np.finfo(np.float32).max)
        if p.HasField("low_scale") and low <= 0:
            raise LayerError(f"scale_route_param.low_scale must be > 0, got {low}")
        if high < low:
            raise LayerError(f"scale_route_param.high_scale {high} is below low_scale {low}")
        if p.HasField("low_scale") and p.HasField("high_scale"):
            mid = float(np.float32(math.sqrt(low * high)))
        else:
            mid = low if p.HasField("low_scale") else (high if p.HasField("high_scale") else 256.0)
        return {"low": low, "high": high, "mid": mid}

    def infer(self, attrs, in_shapes):
        rois = in_shapes[0]
        if len(rois) < 2 or rois[1] != 5:
            raise LayerError(f"ScaleRoute: bottom 0 must be (R, 5) rois, got {list(rois)}")
        if any(not s or s[0] != rois[0] for s in in_shapes):
            raise LayerError(f"ScaleRoute: every bottom needs the rois' {rois[0]} rows, got "
                             f"{[list(s) for s in in_shapes]}")
        return [tuple(s) for s in in_shapes]      # at most every row

    def forward(self, attrs, params, rois, *others):
        rows = scale_route_rows(rois, attrs["low"], attrs["high"], attrs["mid"])
        outs = [x[rows] for x in (rois,) + others]
        return outs if len(outs) > 1 else outs[0]

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(ScaleRoute, a["low"], a["high"], a["mid"], needs=[scale_route_rows])
        routed = emit.tmp("routed")
        emit.stmt(f"{routed} = {m}({', '.join(emit.inputs)})")
        return [f"{routed}[{i}]" for i in range(len(emit.inputs))] if len(emit.inputs) > 1 else f"{routed}[0]"
