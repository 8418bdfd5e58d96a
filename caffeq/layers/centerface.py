"""yuqj1991/caffe_train's face detector layers (c7247801): BatchNormScale, CenternetDetectionOutput and
CenterGridOutput, as its C++ computes them (src/caffe/layers/batch_norm_scale_layer.cpp,
detection_centernet_output_layer.cpp, CenterGridDetectionLayer.cpp, src/caffe/util/center_bbox_util.cpp).

BatchNormScale: BatchNorm and Scale in one layer, blobs [mean sum, variance sum, factor, gamma, beta].
With stored statistics (use_global_stats, by default at TEST) s = 1 / factor (0 when factor is 0) and
y = gamma * (x - s mean) / sqrt(s var + eps) + beta.  Its last step scales the *bottom* blob: in place (as
every net of the fork writes it) that blob holds the normalized values; written out of place the layer
gives gamma * x + beta, and so does caffeq (with a warning at load time).

The two detection outputs read detection_output_param (the fork's fields are 50000 + their numbers in
proto/caffe.proto) and write rows [image, label, score, xmin, ymin, xmax, ymax (, 10 landmark values)]
shaped (1, 1, R, 7 or 17); with no detection in the whole batch, one row [i, -1, ...] per image.  Per
image the candidates are sorted by score (best first; ties here keep the fork's loop order), a greedy
class-agnostic NMS keeps a box unless its IoU with a kept one is not <= nms_thresh, the IoU's
intersection counting one pixel more on each side (w + 1, h + 1) but the areas not, and keep_top_k
then keeps the best.
- CenternetDetectionOutput: bottoms loc (N, 4 or 14, H, W) and heatmap (N, num_classes - 1, H, W) (a
  third and fourth are allowed and not read).  A cell is a candidate for class c where its score is
  > confidence_threshold and < 1.  Stride 4 is written in the fork: centre ((w + ox) 4, (h + oy) 4),
  size (exp(tw) 4, exp(th) 4), corners clamped to [0, 4W] x [0, 4H], the area the unclamped size's.
  After NMS the corners are divided by 4W and 4H.  Landmarks (has_lm): clamp((cx + l * box width) * 4),
  in pixels times 4 (the fork multiplies twice), not normalized.
- CenterGridOutput: one bottom per scale, with one bias_scale (anchor) each; the stride of a bottom is
  net_width / its width (a float).  SIGMOID (num_classes 1, 5 channels): score = sigmoid(channel 4),
  corner k = (cell + 0.5 - t_k * anchor / (2 stride)) * stride.  SOFTMAX (num_classes 2, 6 channels, or
  16 with has_lm): score = softmax(channels 4-5, or 14-15)[1], corner k = (cell + 0.5 - t_k * anchor /
  stride) * stride; its landmarks' y values use the column too (the fork's code).  Corners are clamped to
  [0, stride * W] x [0, stride * H]; a cell whose clamped box is empty is skipped, one whose score is
  >= confidence_threshold kept, labelled 1, its area the clamped box's.  Outputs are divided by
  net_width / net_height.  The fork writes the activated scores back into its bottoms: a later layer
  that reads them gets them (Layer.bottoms_written_back).

ONNX: unrolled over the images: Compress, TopK, and the greedy NMS a Scan over the sorted candidates
(one row of IoUs per step), since NonMaxSuppression cannot count the intersection's extra pixel.
"""
import math

import numpy as np
import torch
from torch import nn

from ..errors import ExportError
from .registry import AT_LEAST, Layer, LayerError, four_axes, need_blobs, register_layer
from .ssd.common import emit_detection_top

LANDMARK_VALUES = 10

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def clamp_like_fork(v, high):
    """The fork's GET_VALID_VALUE(v, 0, high): below 0 (or NaN) -> 0, then capped at high."""
    low = torch.where(v >= 0, v, torch.zeros_like(v))
    return torch.where(low < high, low, torch.full_like(low, high))


def pixel_iou_nms(x1, y1, x2, y2, area, score, nms_threshold: float):
    """The indices of the kept candidates, best first: sorted by score (ties in order), a candidate
    stays unless its IoU with a kept one is not <= nms_threshold; intersections count w + 1 by h + 1,
    `area` is each box's own (the fork's hard_nms)."""
    order = torch.sort(score, descending=True, stable=True)[1]
    x1, y1, x2, y2, area = (t[order] for t in (x1, y1, x2, y2, area))
    n = order.numel()
    alive = torch.ones(n, dtype=torch.bool, device=score.device)
    kept = []
    for i in range(n):
        if not bool(alive[i]):
            continue
        kept.append(i)
        iw = torch.minimum(x2[i], x2[i + 1:]) - torch.maximum(x1[i], x1[i + 1:]) + 1
        ih = torch.minimum(y2[i], y2[i + 1:]) - torch.maximum(y1[i], y1[i + 1:]) + 1
        iw = torch.where(iw > 0, iw, torch.zeros_like(iw))
        ih = torch.where(ih > 0, ih, torch.zeros_like(ih))
        inter = iw * ih
        iou = inter / (area[i + 1:] + area[i] - inter)
        alive[i + 1:] &= iou <= nms_threshold
    return order[torch.tensor(kept, dtype=torch.long, device=score.device)]


def center_rows(per_image: list, num_images: int, width: int, dtype, device):
    """The images' row blocks (None: no detection) as the top (1, 1, R, width); none at all: one
    [i, -1, ...] row per image."""
    blocks = [b for b in per_image if b is not None]
    if not blocks:
        out = torch.full((num_images, width), -1.0, dtype=dtype, device=device)
        out[:, 0] = torch.arange(num_images, dtype=dtype, device=device)
        return out.reshape(1, 1, num_images, width)
    return torch.cat(blocks).reshape(1, 1, -1, width)


def centernet_detections(loc, heat, threshold: float, nms_threshold: float, keep_top_k: int, has_lm: bool):
    """CenternetDetectionOutput (see the module docstring): loc (N, 4 or 14, H, W), heat (N, K, H, W)."""
    n, _, h, w = loc.shape
    dt, dev = loc.dtype, loc.device
    rows = []
    for i in range(n):
        s = heat[i]
        cls, hy, wx = torch.nonzero((s > threshold) & (s < 1), as_tuple=True)   # class, row, column order
        if cls.numel() == 0:
            rows.append(None)
            continue
        score = s[cls, hy, wx]
        v = loc[i][:, hy, wx]
        cx, cy = (wx.to(dt) + v[0]) * 4, (hy.to(dt) + v[1]) * 4
        bw, bh = torch.exp(v[2]) * 4, torch.exp(v[3]) * 4
        x1, x2 = clamp_like_fork(cx - bw / 2, 4.0 * w), clamp_like_fork(cx + bw / 2, 4.0 * w)
        y1, y2 = clamp_like_fork(cy - bh / 2, 4.0 * h), clamp_like_fork(cy + bh / 2, 4.0 * h)
        keep = pixel_iou_nms(x1, y1, x2, y2, bw * bh, score, nms_threshold)
        if keep_top_k > 0:
            keep = keep[:keep_top_k]
        span_w, span_h = (torch.tensor(4.0 * d, dtype=dt, device=dev) for d in (w, h))   # divided, not scaled
        cols = [torch.full_like(score[keep], float(i)), cls[keep].to(dt) + 1, score[keep],
                x1[keep] / span_w, y1[keep] / span_h, x2[keep] / span_w, y2[keep] / span_h]
        if has_lm:
            bw_c, bh_c = (x2 - x1)[keep], (y2 - y1)[keep]
            for k in range(10):    # the five landmarks' x, y
                if k % 2 == 0:
                    cols.append(clamp_like_fork((cx[keep] + v[4 + k][keep] * bw_c) * 4, 4.0 * w))
                else:
                    cols.append(clamp_like_fork((cy[keep] + v[4 + k][keep] * bh_c) * 4, 4.0 * h))
        rows.append(torch.stack(cols, dim=1))
    return center_rows(rows, n, 17 if has_lm else 7, dt, dev)


def center_grid_activate(x, softmax: bool, has_lm: bool):
    """The bottom with its score channels activated, as the fork writes it back: sigmoid of channel 4,
    or the softmax of channels 4-5 (14-15 with landmarks), max-subtracted, in float32."""
    first = 14 if has_lm else 4
    if not softmax:
        p = (1.0 / (1.0 + torch.exp(-x[:, 4:5].double()))).to(x.dtype)
        return torch.cat([x[:, :4], p, x[:, 5:]], dim=1)
    logits = x[:, first:first + 2]
    e = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
    p = e / (e[:, 0:1] + e[:, 1:2])
    return torch.cat([x[:, :first], p, x[:, first + 2:]], dim=1)


def center_grid_detections(maps: list, anchors: list[int], softmax: bool, has_lm: bool, threshold: float,
                           nms_threshold: float, keep_top_k: int, net_width: int, net_height: int):
    """CenterGridOutput (see the module docstring) over its bottoms `maps`, activated already
    (center_grid_activate)."""
    n = maps[0].shape[0]
    dt, dev = maps[0].dtype, maps[0].device
    per_image = []
    for i in range(n):
        parts = []
        for x, anchor in zip(maps, anchors):
            h, w = x.shape[2], x.shape[3]
            stride = torch.tensor(net_width, dtype=torch.float32) / w    # float, as the fork divides
            divisor = (stride if softmax else 2 * stride).to(dev)
            col = (torch.arange(w, dtype=torch.float64, device=dev) + 0.5).reshape(1, w)
            row = (torch.arange(h, dtype=torch.float64, device=dev) + 0.5).reshape(h, 1)
            s64 = stride.double()

            def corner(t, cell):   # (cell + 0.5 - t * anchor / divisor) * stride: float32, then double
                return ((cell - (t * anchor / divisor).double()) * s64).to(dt)
            t = x[i]
            x1 = clamp_like_fork(corner(t[0], col), float(stride * w))
            y1 = clamp_like_fork(corner(t[1], row), float(stride * h))
            x2 = clamp_like_fork(corner(t[2], col), float(stride * w))
            y2 = clamp_like_fork(corner(t[3], row), float(stride * h))
            score = t[15] if has_lm else t[5] if softmax else t[4]
            ok = ~((x2 - x1) <= 0) & ~((y2 - y1) <= 0) & (score >= threshold)
            cols = [score[ok], x1[ok], y1[ok], x2[ok], y2[ok]]
            if has_lm:
                for k in range(10):    # the five landmarks' x, y
                    bound = float(stride * w) if k % 2 == 0 else float(stride * h)
                    cols.append(clamp_like_fork(corner(t[4 + k], col), bound)[ok])   # y from the column too
            parts.append(torch.stack(cols, dim=1))
        cand = torch.cat(parts)
        if cand.shape[0] == 0:
            per_image.append(None)
            continue
        score, x1, y1, x2, y2 = (cand[:, k] for k in range(5))
        keep = pixel_iou_nms(x1, y1, x2, y2, (x2 - x1) * (y2 - y1), score, nms_threshold)
        if keep_top_k > 0:
            keep = keep[:keep_top_k]
        kept = cand[keep]
        scale = torch.tensor([net_width, net_height], dtype=dt, device=dev).repeat((kept.shape[1] - 1) // 2)
        per_image.append(torch.cat([torch.full_like(kept[:, :1], float(i)), torch.ones_like(kept[:, :1]),
                                    kept[:, :1], kept[:, 1:] / scale], dim=1))
    return center_rows(per_image, n, 17 if has_lm else 7, dt, dev)


def batch_norm_scale(x, mean, variance, factor, gamma, beta, eps: float, batch_statistics: bool, in_place: bool):
    """BatchNormScale's forward (see the module docstring); statistics along axis 1."""
    view = (1, -1) + (1,) * (x.dim() - 2) if x.dim() > 1 else (-1,)
    if not in_place:
        return x * gamma.reshape(view) + beta.reshape(view)
    if batch_statistics:
        dims = [d for d in range(x.dim()) if d != 1]
        mu = x.mean(dim=dims, keepdim=True)
        var = ((x - mu) ** 2).mean(dim=dims, keepdim=True)
    else:
        f = factor.reshape(())
        s = torch.where(f == 0, torch.zeros_like(f), 1.0 / f)
        mu, var = (mean * s).reshape(view), (variance * s).reshape(view)
    inverse = 1.0 / (var + eps).sqrt()    # the fork scales by 1 / std (caffe_cpu_scale), not a division
    return (x - mu) * inverse * gamma.reshape(view) + beta.reshape(view)


class BatchNormScaleModule(nn.Module):
    def __init__(self, channels: int, eps: float, use_global_stats=None, in_place=True):
        super().__init__()
        self.eps, self.use_global_stats, self.in_place = eps, use_global_stats, in_place
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("variance", torch.zeros(channels))
        self.register_buffer("factor", torch.zeros(1))
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        batch = self.training if self.use_global_stats is None else not self.use_global_stats
        return batch_norm_scale(x, self.mean, self.variance, self.factor, self.gamma, self.beta, self.eps, batch,
                                self.in_place)



# ---- ONNX ------------------------------------------------------------------------------------------


def _onnx_clamp(ctx, v, high):
    low = ctx.op("Where", [ctx.op("GreaterOrEqual", [v, ctx.f32(0.0)], "ge0"), v, ctx.f32(0.0)], "low")
    return ctx.op("Where", [ctx.op("Less", [low, ctx.f32(high)], "lt"), low, ctx.f32(high)], "clamped")


def _onnx_kept(ctx, node, cols, nms_threshold, keep_top_k):
    """cols: [score, x1, y1, x2, y2, area, *more] candidate vectors (M,).  The kept candidates' columns
    [score, x1, ..., *more] (K,), best first: TopK, then the greedy NMS as a Scan over M + 1 steps (a
    last dummy box that suppresses nothing, since onnxruntime refuses a Scan of 0 steps)."""
    from onnx import TensorProto, helper
    m = ctx.op("Shape", [cols[0]], "m")
    best, order = ctx.add_node("TopK", [cols[0], m], [ctx.tmp(f"{node.name}_best"), ctx.tmp(f"{node.name}_order")],
                               axis=0, largest=1, sorted=1)
    s = [best] + [ctx.op("Gather", [c, order], "sorted", axis=0) for c in cols[1:]]
    pad = [ctx.op("Concat", [v, ctx.f32([0.0])], "padded", axis=0) for v in s[1:6]]
    steps = ctx.op("Add", [m, ctx.i64([1])], "steps")
    ids = ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [steps, ctx.i64([0])], "n"), ctx.i64(1)], "ids")
    body = []

    def b(kind, inputs, hint, **kw):
        return ctx.body_op(body, kind, inputs, hint, **kw)
    sup_in, it = ctx.tmp(f"{node.name}_sup_in"), ctx.tmp(f"{node.name}_it")
    one, zero = ctx.body_const(body, np.float32(1.0), "one"), ctx.body_const(body, np.float32(0.0), "zero")
    at = [b("Gather", [v, it], "at", axis=0) for v in pad]        # box `it`: x1, y1, x2, y2, area

    def side(lo, hi, lo_i, hi_i, hint):
        v = b("Add", [b("Sub", [b("Min", [hi, hi_i], hint + "_hi"), b("Max", [lo, lo_i], hint + "_lo")], hint + "_d"),
                      one], hint + "_p1")
        return b("Where", [b("Greater", [v, zero], hint + "_pos"), v, zero], hint)
    inter = b("Mul", [side(pad[0], pad[2], at[0], at[2], "iw"), side(pad[1], pad[3], at[1], at[3], "ih")], "inter")
    iou = b("Div", [inter, b("Sub", [b("Add", [pad[4], at[4]], "areas"), inter], "union")], "iou")
    over = b("Not", [b("LessOrEqual", [iou, ctx.body_const(body, np.float32(nms_threshold), "thr")], "le")], "over")
    alive = b("Not", [b("Gather", [sup_in, it], "dead", axis=0)], "alive")
    hits = b("And", [b("And", [over, b("Greater", [ids, it], "later")], "later_over"), alive], "hits")
    sup_out = b("Or", [sup_in, hits], "sup_out")
    graph = helper.make_graph(body, f"{node.name}_nms_step",
                              [helper.make_tensor_value_info(sup_in, TensorProto.BOOL, [None]),
                               helper.make_tensor_value_info(it, TensorProto.INT64, [])],
                              [helper.make_tensor_value_info(sup_out, TensorProto.BOOL, [None])])
    sup0 = ctx.op("ConstantOfShape", [steps], "sup0", value=helper.make_tensor("f", TensorProto.BOOL, [1], [False]))
    sup = ctx.add_node("Scan", [sup0, ids], [ctx.tmp(f"{node.name}_sup")], body=graph, num_scan_inputs=1)[0]
    kept = ctx.op("Not", [ctx.op("Slice", [sup, ctx.i64([0]), m, ctx.i64([0])], "sup_m")], "kept")
    out = [ctx.op("Compress", [v, kept], "kept_col", axis=0) for v in s[:5] + s[6:]]
    if keep_top_k > 0:
        out = [ctx.op("Slice", [v, ctx.i64([0]), ctx.i64([keep_top_k]), ctx.i64([0])], "top_k") for v in out]
    return out


def _onnx_rows(ctx, cols):
    """Columns (K,) each -> rows (K, len(cols))."""
    return ctx.op("Concat", [ctx.op("Unsqueeze", [c, ctx.i64([1])], "col") for c in cols], "rows", axis=1)


def emit_centernet(ctx, node):
    a = node.attrs
    loc, heat = node.inputs[:2]
    n, lc, h, w = ctx.shape(loc)
    k = ctx.shape(heat)[1]
    blocks = []
    cell_w = np.tile(np.arange(w, dtype=np.float32), h)             # per cell, in (h, w) order
    cell_h = np.repeat(np.arange(h, dtype=np.float32), w)
    for i in range(n):
        v = ctx.op("Reshape", [ctx.op("Gather", [loc, ctx.i64(i)], "loc_i", axis=0), ctx.i64([lc, h * w])], "loc_f")
        ch = [ctx.op("Gather", [v, ctx.i64(j)], "ch", axis=0) for j in range(lc)]
        cx = ctx.op("Mul", [ctx.op("Add", [ctx.f32(cell_w), ch[0]], "cx0"), ctx.f32(4.0)], "cx")
        cy = ctx.op("Mul", [ctx.op("Add", [ctx.f32(cell_h), ch[1]], "cy0"), ctx.f32(4.0)], "cy")
        bw = ctx.op("Mul", [ctx.op("Exp", [ch[2]], "ew"), ctx.f32(4.0)], "bw")
        bh = ctx.op("Mul", [ctx.op("Exp", [ch[3]], "eh"), ctx.f32(4.0)], "bh")
        half_w, half_h = ctx.op("Div", [bw, ctx.f32(2.0)], "hw"), ctx.op("Div", [bh, ctx.f32(2.0)], "hh")
        x1 = _onnx_clamp(ctx, ctx.op("Sub", [cx, half_w], "x1r"), 4.0 * w)
        x2 = _onnx_clamp(ctx, ctx.op("Add", [cx, half_w], "x2r"), 4.0 * w)
        y1 = _onnx_clamp(ctx, ctx.op("Sub", [cy, half_h], "y1r"), 4.0 * h)
        y2 = _onnx_clamp(ctx, ctx.op("Add", [cy, half_h], "y2r"), 4.0 * h)
        per_cell = [x1, y1, x2, y2, ctx.op("Mul", [bw, bh], "area")]
        if a["has_lm"]:
            box_w, box_h = ctx.op("Sub", [x2, x1], "box_w"), ctx.op("Sub", [y2, y1], "box_h")
            for j in range(LANDMARK_VALUES):
                centre, size, bound = (cx, box_w, 4.0 * w) if j % 2 == 0 else (cy, box_h, 4.0 * h)
                raw = ctx.op("Mul", [ctx.op("Add", [centre, ctx.op("Mul", [ch[4 + j], size], "lm_d")], "lm_c"),
                                     ctx.f32(4.0)], "lm4")
                per_cell.append(_onnx_clamp(ctx, raw, bound))
        score = ctx.op("Reshape", [ctx.op("Gather", [heat, ctx.i64(i)], "heat_i", axis=0), ctx.i64([-1])], "score")
        label = ctx.f32(np.repeat(np.arange(1, k + 1, dtype=np.float32), h * w))
        ok = ctx.op("And", [ctx.op("Greater", [score, ctx.f32(a["confidence_threshold"])], "above"),
                            ctx.op("Less", [score, ctx.f32(1.0)], "below1")], "ok")
        tiled = [ctx.op("Tile", [c, ctx.i64([k])], "per_class") for c in per_cell]   # class-major, as (c, h, w)
        cols = [ctx.op("Compress", [c, ok], "cand", axis=0) for c in [score] + tiled + [label]]
        kept = _onnx_kept(ctx, node, cols, a["nms_threshold"], a["keep_top_k"])
        score_k, x1k, y1k, x2k, y2k = kept[:5]
        label_k, marks = kept[-1], kept[5:-1]
        boxes = [ctx.op("Div", [c, ctx.f32(4.0 * d)], "norm") for c, d in ((x1k, w), (y1k, h), (x2k, w), (y2k, h))]
        blocks.append(_onnx_rows(ctx, [ctx.filled(score_k, i, "image"), label_k, score_k, *boxes, *marks]))
    rows = blocks[0] if len(blocks) == 1 else ctx.op("Concat", blocks, "all_rows", axis=0)
    emit_detection_top(ctx, ctx.op, rows, loc, node.outputs[0], 17 if a["has_lm"] else 7)


def _onnx_activated(ctx, x, softmax, has_lm, out=None):
    """center_grid_activate in ONNX: the bottom with its score channels replaced."""
    c = ctx.shape(x)[1]
    first = 14 if has_lm else 4
    if not softmax:
        logit = ctx.op("Cast", [ctx.op("Slice", [x, ctx.i64([4]), ctx.i64([5]), ctx.i64([1])], "logit")], "logit_d",
                       to=11)
        one = ctx.const(np.array(1.0, np.float64))
        p = ctx.op("Div", [one, ctx.op("Add", [one, ctx.op("Exp", [ctx.op("Neg", [logit], "neg")], "e")], "den")], "p")
        scores = ctx.op("Cast", [p], "p_f", to=1)
    else:
        logits = ctx.op("Slice", [x, ctx.i64([first]), ctx.i64([first + 2]), ctx.i64([1])], "logits")
        from .norm import onnx_reduce
        top = onnx_reduce(ctx, "ReduceMax", logits, [1], True)
        e = ctx.op("Exp", [ctx.op("Sub", [logits, top], "shift")], "e")
        e0 = ctx.op("Slice", [e, ctx.i64([0]), ctx.i64([1]), ctx.i64([1])], "e0")
        e1 = ctx.op("Slice", [e, ctx.i64([1]), ctx.i64([2]), ctx.i64([1])], "e1")
        scores = ctx.op("Div", [e, ctx.op("Add", [e0, e1], "sum")], "p")
    parts = [ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([first]), ctx.i64([1])], "head"), scores]
    end = first + (2 if softmax else 1)
    if end < c:
        parts.append(ctx.op("Slice", [x, ctx.i64([end]), ctx.i64([c]), ctx.i64([1])], "tail"))
    if out is None:
        return ctx.op("Concat", parts, "activated", axis=1)
    ctx.add_node("Concat", parts, [out], axis=1)
    return out


def emit_center_grid(ctx, node):
    a = node.attrs
    written = a.get("written_back", [])
    maps = []
    for t, x in enumerate(node.inputs):
        out = node.outputs[1 + written.index(t)] if t in written else None
        maps.append(_onnx_activated(ctx, x, a["softmax"], a["has_lm"], out))
    n = ctx.shape(node.inputs[0])[0]
    blocks = []
    for i in range(n):
        cand = None
        for t, (x, anchor) in enumerate(zip(maps, a["bias_scale"])):
            _, c, h, w = ctx.shape(node.inputs[t])
            stride = np.float32(a["net_width"]) / np.float32(w)
            divisor = stride if a["softmax"] else np.float32(2) * stride
            v = ctx.op("Reshape", [ctx.op("Gather", [x, ctx.i64(i)], "x_i", axis=0), ctx.i64([c, h * w])], "x_f")
            col = np.tile(np.arange(w, dtype=np.float64) + 0.5, h)
            row = np.repeat(np.arange(h, dtype=np.float64) + 0.5, w)

            def corner(j, cell, bound):
                t_anchor = ctx.op("Mul", [ctx.op("Gather", [v, ctx.i64(j)], "t", axis=0), ctx.f32(float(anchor))], "ta")
                shift = ctx.op("Cast", [ctx.op("Div", [t_anchor, ctx.f32(float(divisor))], "ts")], "ts_d", to=11)
                raw = ctx.op("Mul", [ctx.op("Sub", [ctx.const(cell), shift], "c_d"),
                                     ctx.const(np.array(stride, np.float64))], "corner_d")
                return _onnx_clamp(ctx, ctx.op("Cast", [raw], "corner", to=1), bound)
            bw, bh = float(stride * np.float32(w)), float(stride * np.float32(h))
            x1, y1, x2, y2 = corner(0, col, bw), corner(1, row, bh), corner(2, col, bw), corner(3, row, bh)
            score = ctx.op("Gather", [v, ctx.i64(15 if a["has_lm"] else 5 if a["softmax"] else 4)], "score", axis=0)
            dx, dy = ctx.op("Sub", [x2, x1], "dx"), ctx.op("Sub", [y2, y1], "dy")
            ok = ctx.op("And", [ctx.op("And", [ctx.op("Not", [ctx.op("LessOrEqual", [dx, ctx.f32(0.0)], "dx0")], "wide"),
                                               ctx.op("Not", [ctx.op("LessOrEqual", [dy, ctx.f32(0.0)], "dy0")], "high")],
                                        "nonempty"),
                                ctx.op("GreaterOrEqual", [score, ctx.f32(a["confidence_threshold"])], "above")], "ok")
            cols = [score, x1, y1, x2, y2, ctx.op("Mul", [dx, dy], "area")]
            if a["has_lm"]:
                cols += [corner(4 + j, col, bw if j % 2 == 0 else bh) for j in range(LANDMARK_VALUES)]
            cols = [ctx.op("Compress", [c_, ok], "cand", axis=0) for c_ in cols]
            cand = cols if cand is None else [ctx.op("Concat", [p, q], "cands", axis=0) for p, q in zip(cand, cols)]
        kept = _onnx_kept(ctx, node, cand, a["nms_threshold"], a["keep_top_k"])
        scale = [a["net_width"], a["net_height"]]
        values = [ctx.op("Div", [c_, ctx.f32(float(scale[j % 2]))], "norm") for j, c_ in enumerate(kept[1:])]
        blocks.append(_onnx_rows(ctx, [ctx.filled(kept[0], i, "image"),
                                                ctx.filled(kept[0], 1, "label"), kept[0], *values]))
    rows = blocks[0] if len(blocks) == 1 else ctx.op("Concat", blocks, "all_rows", axis=0)
    emit_detection_top(ctx, ctx.op, rows, node.inputs[0], node.outputs[0], 17 if a["has_lm"] else 7)


# ---- specs ----------------------------------------------------------------------------------------


def _thresholds(p):
    a = {"confidence_threshold": float(p.confidence_threshold) if p.HasField("confidence_threshold")
         else -float(np.finfo(np.float32).max),
         "nms_threshold": float(p.nms_thresh), "keep_top_k": int(p.keep_top_k), "has_lm": bool(p.has_lm)}
    for k in ("confidence_threshold", "nms_threshold"):
        if math.isnan(a[k]):
            raise LayerError(f"detection_output_param.{'nms_thresh' if k == 'nms_threshold' else k} is NaN")
    if not p.HasField("num_classes"):
        raise LayerError("detection_output_param.num_classes is required (the fork checks it)")
    return a


def _row_bound(n, candidates_per_image, keep_top_k):
    per_image = min(candidates_per_image, keep_top_k) if keep_top_k > 0 else candidates_per_image
    return max(n * per_image, n)


@register_layer("CenternetDetectionOutput")
class CenternetDetectionOutput(Layer):
    #: the row count is known only after a run; infer gives the most rows the layer can write
    data_dependent_shape = True

    def parse(self, lp):
        need_blobs(lp, "CenternetDetectionOutput", (2, 3, 4), 1, "loc, heatmap (, unread)")
        p = lp.detection_output_param
        a = _thresholds(p)
        a["num_classes"] = int(p.num_classes)
        return a

    def infer(self, attrs, in_shapes):
        loc = four_axes(in_shapes[0], "CenternetDetectionOutput", "loc bottom")
        heat = four_axes(in_shapes[1], "CenternetDetectionOutput", "heatmap bottom")
        need = 14 if attrs["has_lm"] else 4
        if loc[1] != need:
            raise LayerError(f"the loc bottom needs {need} channels (offsets, log sizes"
                             f"{', 10 landmark values' if attrs['has_lm'] else ''}), got {list(loc)}")
        if heat[1] != attrs["num_classes"] - 1:
            raise LayerError(f"the heatmap needs num_classes - 1 = {attrs['num_classes'] - 1} channels, got "
                             f"{list(heat)}")
        if heat[0] != loc[0] or heat[2:] != loc[2:]:
            raise LayerError(f"the heatmap {list(heat)} and the loc bottom {list(loc)} must agree on N, H, W "
                             f"(the fork indexes both with the loc's)")
        rows = _row_bound(loc[0], heat[1] * loc[2] * loc[3], attrs["keep_top_k"])
        return [(1, 1, rows, 17 if attrs["has_lm"] else 7)]

    def _args(self, a):
        return [a["confidence_threshold"], a["nms_threshold"], a["keep_top_k"], a["has_lm"]]

    def forward(self, attrs, params, loc, heat, *unread):
        return centernet_detections(loc, heat, *self._args(attrs))

    def onnx(self, ctx, node):
        emit_centernet(ctx, node)

    def pytorch_source(self, node, emit):
        for fn in (clamp_like_fork, pixel_iou_nms, center_rows, centernet_detections):
            emit.helper(fn)     # one helper each: a net with both detection outputs writes the shared ones once
        emit.note(f"{node.name} (CenternetDetectionOutput): the number of rows depends on the data")
        args = ", ".join(emit.lit(v, exact=True) if isinstance(v, float) else repr(v) for v in self._args(node.attrs))
        return f"centernet_detections({emit.inputs[0]}, {emit.inputs[1]}, {args})"


@register_layer("CenterGridOutput")
class CenterGridOutput(Layer):
    data_dependent_shape = True

    def parse(self, lp):
        need_blobs(lp, "CenterGridOutput", range(3, AT_LEAST), 1, "one map per scale")
        p = lp.detection_output_param
        a = _thresholds(p)
        a["softmax"] = p.class_type == p.SOFTMAX
        want = 2 if a["softmax"] else 1
        if p.num_classes != want:
            raise LayerError(f"detection_output_param.num_classes must be {want} with class_type "
                             f"{'SOFTMAX' if a['softmax'] else 'SIGMOID'}, got {p.num_classes} (the fork checks it)")
        if a["has_lm"] and not a["softmax"]:
            raise LayerError("detection_output_param.has_lm needs class_type: SOFTMAX (the fork's SIGMOID decoder "
                             "checks 5 channels)")
        if len(p.bias_scale) != len(lp.bottom):
            raise LayerError(f"detection_output_param.bias_scale needs one anchor per bottom ({len(lp.bottom)}), "
                             f"got {len(p.bias_scale)}")
        if p.net_width < 1 or p.net_height < 1:
            raise LayerError(f"detection_output_param.net_width and net_height must be >= 1, got {p.net_width}, "
                             f"{p.net_height}")
        a.update(bias_scale=[int(v) for v in p.bias_scale], net_width=int(p.net_width),
                 net_height=int(p.net_height))
        return a

    def channels(self, attrs):
        return 16 if attrs["has_lm"] else 6 if attrs["softmax"] else 5

    def infer(self, attrs, in_shapes):
        c = self.channels(attrs)
        cells = 0
        for t, s in enumerate(in_shapes):
            s = four_axes(s, "CenterGridOutput", f"bottom {t}")
            if s[1] != c or s[0] != in_shapes[0][0]:
                raise LayerError(f"bottom {t} {list(s)}: every map needs N = {in_shapes[0][0]} and {c} channels "
                                 f"(4 box values{', 10 landmark values' if attrs['has_lm'] else ''}, "
                                 f"{'2 class logits' if attrs['softmax'] else '1 logit'})")
            cells += s[2] * s[3]
        rows = _row_bound(in_shapes[0][0], cells, attrs["keep_top_k"])
        return [(1, 1, rows, 17 if attrs["has_lm"] else 7)]

    def bottoms_written_back(self, attrs):
        return tuple(range(len(attrs["bias_scale"])))

    def _args(self, a):
        return [a["bias_scale"], a["softmax"], a["has_lm"], a["confidence_threshold"], a["nms_threshold"],
                a["keep_top_k"], a["net_width"], a["net_height"]]

    def forward(self, attrs, params, *maps):
        maps = [center_grid_activate(x, attrs["softmax"], attrs["has_lm"]) for x in maps]
        rows = center_grid_detections(maps, *self._args(attrs))
        written = attrs.get("written_back")
        return (rows, *(maps[t] for t in written)) if written else rows

    def onnx(self, ctx, node):
        emit_center_grid(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        for fn in (clamp_like_fork, pixel_iou_nms, center_rows, center_grid_activate, center_grid_detections):
            emit.helper(fn)
        emit.note(f"{node.name} (CenterGridOutput): the number of rows depends on the data")
        maps = emit.tmp("activated")
        emit.stmt(f"{maps} = [center_grid_activate(x, {a['softmax']!r}, {a['has_lm']!r}) for x in "
                  f"[{', '.join(emit.inputs)}]]")
        args = ", ".join(emit.lit(v, exact=True) if isinstance(v, float) else repr(v) for v in self._args(a))
        call = f"center_grid_detections({maps}, {args})"
        written = a.get("written_back")
        return [call] + [f"{maps}[{t}]" for t in written] if written else call


@register_layer("BatchNormScale")
class BatchNormScale(Layer):
    blob_names = ("mean", "variance", "factor", "gamma", "beta")
    buffer_blobs = (0, 1, 2)
    uses_training_flag = True

    def parse(self, lp):
        need_blobs(lp, "BatchNormScale", 1, 1)
        p = lp.batch_norm_param
        if not p.eps >= 0:
            raise LayerError(f"batch_norm_param.eps must be >= 0, got {p.eps}")
        in_place = lp.top[0] == lp.bottom[0]
        a = {"use_global_stats": bool(p.use_global_stats) if p.HasField("use_global_stats") else None,
             "eps": float(p.eps), "in_place": in_place}
        if not in_place:
            a["reading_notes"] = ["BatchNormScale out of place: the fork's last step scales its bottom, not the "
                                  "normalized values, so it computes gamma * x + beta (as here); write it in place "
                                  "(top = bottom) for the batch normalization"]
        return a

    def infer(self, attrs, in_shapes):
        x = tuple(in_shapes[0])
        if len(x) < 1:
            raise LayerError("BatchNormScale needs an input with at least one axis")
        attrs["channels"] = 1 if len(x) == 1 else int(x[1])
        return [x]

    def param_shapes(self, attrs, in_shapes):
        c = attrs["channels"]
        return [(c,), (c,), (1,), (c,), (c,)]

    def init_params(self, attrs, shapes, rng):
        c = shapes[0][0]
        return [np.zeros(c, np.float32), np.ones(c, np.float32), np.ones(1, np.float32),
                np.ones(c, np.float32), np.zeros(c, np.float32)]

    @staticmethod
    def batch_statistics(attrs, training):
        g = attrs["use_global_stats"]
        return training if g is None else not g

    def forward(self, attrs, params, x, training=False):
        return batch_norm_scale(x, *params, attrs["eps"], self.batch_statistics(attrs, training), attrs["in_place"])

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        rank = len(ctx.shape(x))
        view = [1, a["channels"]] + [1] * max(rank - 2, 0) if rank >= 2 else [a["channels"]]
        gamma, beta = (np.asarray(node.blobs[k], np.float32).reshape(view) for k in (3, 4))
        if not a["in_place"]:
            scaled = ctx.op("Mul", [x, ctx.const(gamma, node.name + "_gamma")], "scaled")
            ctx.add_node("Add", [scaled, ctx.const(beta, node.name + "_beta")], [node.outputs[0]], name=node.name)
            return
        if self.batch_statistics(a, False):
            raise ExportError(f"layer '{node.name}' (BatchNormScale): use_global_stats: false (batch statistics "
                              f"at test) is not exported; caffeq runs it in torch")
        f = np.float32(np.asarray(node.blobs[2]).reshape(-1)[0])
        s = np.float32(0) if f == 0 else np.float32(1) / f
        mean = (np.asarray(node.blobs[0], np.float32) * s).reshape(view)
        std = np.sqrt((np.asarray(node.blobs[1], np.float32) * s).reshape(view) + np.float32(a["eps"]))
        centred = ctx.op("Sub", [x, ctx.const(mean, node.name + "_mean")], "centred", name=node.name)
        inverse = (np.float32(1) / std.astype(np.float32)).astype(np.float32)
        normed = ctx.op("Mul", [centred, ctx.const(inverse, node.name + "_inv_std")], "normed")
        scaled = ctx.op("Mul", [normed, ctx.const(gamma, node.name + "_gamma")], "scaled")
        ctx.add_node("Add", [scaled, ctx.const(beta, node.name + "_beta")], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(BatchNormScaleModule, a["channels"], a["eps"], a["use_global_stats"], a["in_place"],
                          needs=(batch_norm_scale,))
        for i, name in enumerate(self.blob_names):
            emit.param(name, i)
        return f"{m}({emit.inputs[0]})"
