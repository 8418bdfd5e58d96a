"""YOLO detection outputs from the Caffe conversions of darknet: YoloDetectionOutput,
Yolov3DetectionOutput (and yuqj1991/caffe_train's Yolov3Detection).

- YoloDetectionOutput (eric612/MobileNet-YOLO, YOLO v2): one or two bottoms (N, boxes * (5 +
  classes ...), S, S); per cell (row-major) and box: x = (col + sigmoid) / S, y = (row +
  sigmoid) / S, w = exp * bias_w / S, h = exp * bias_h / S, objectness sigmoid, a softmax
  over the classes; score = objectness * best class probability, kept when >= the threshold.
  The fork reads `side` and `coords` but uses neither (side = the map's width); label_map_file
  only names classes in its log.
- Yolov3DetectionOutput (eric612/MobileNet-YOLO): mask_group_num bottoms (N, boxes * (5 +
  classes), H, W); box n of bottom t uses anchor mask[t * (mask size / mask_group_num) + n];
  x = (col + sigmoid) / W, y = (row + sigmoid) / H, w = exp * bias_w / (W * anchors_scale[t]),
  h likewise; one candidate per class whose sigmoid * objectness is > the threshold.  (The
  fork's correct_yolo_boxes is the identity here: its net size is the map size times the
  scale.  Its GPU Forward steps through images with bottom 0's size, which differs for N > 1;
  the CPU Forward, followed here, does not.)
- yuqj1991/caffe_train's Yolov3Detection (src/caffe/layers/Yolov3DetectionLayer.cpp, CPU only) is that
  layer under another type name, told from Cambricon's Yolov3Detection by its
  yolov3_detection_output_param: it takes each map's side from its width (square maps only) and its
  nms_threshold defaults to 0.4 (its caffe.proto since 1ce87ce; 0.45, eric612's, when the layer came in).

Both detection layers then pool every image's candidates (image ids are not kept: the fork
writes 0 in column 0 of every row), sort them by score, best first (std::sort; ties here keep
the candidates' order), and run one class-agnostic greedy NMS that drops a box whose IoU with a
kept one is >= nms_threshold (IoU from centre/size boxes, in float32, as the fork).  Rows:
[0, label + 1, score, x - w/2, y - h/2, x + w/2, y + h/2], best first, shaped (1, 1, R, 7); with
no detection at all, N rows [i, -1, -1, -1, -1, -1, -1].  R depends on the data: the static
shape reported at load time is the most rows the layer can write.

ONNX: the decoding ops, Compress and
NonMaxSuppression (threshold moved one float32 step down, since ONNX suppresses IoU > t and the
fork IoU >= t).  gaussian_box (Gaussian YOLOv3) is refused.
"""
import math

import numpy as np
import torch

from ..errors import ExportError
from .registry import (
    Layer,
    LayerError,
    claim_layers,
    four_axes,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)
from .ssd.common import emit_detection_top

# ---- detection: decoding, NMS and rows -----------------------------------------------------

def yolo_v2_candidates(x, biases: list[float], num_box: int, num_classes: int, threshold: float):
    """YoloDetectionOutput's candidates of one (N, C, S, S) bottom, in the fork's order (image,
    row, column, box): centre x, y, width, height, class, score, and which are kept (score >=
    threshold)."""
    n, c, h, w = x.shape
    side = w  # the fork: side = width, for both axes
    y = x.reshape(n, num_box, c // num_box, h, w).permute(0, 3, 4, 1, 2)   # (n, row, col, box, entry)
    col = torch.arange(w, device=x.device, dtype=x.dtype).reshape(1, 1, w, 1)
    row = torch.arange(h, device=x.device, dtype=x.dtype).reshape(1, h, 1, 1)
    anchors = torch.tensor(biases[:2 * num_box], device=x.device, dtype=x.dtype).reshape(num_box, 2)
    bx = (col + torch.sigmoid(y[..., 0])) / side
    by = (row + torch.sigmoid(y[..., 1])) / side
    bw = torch.exp(y[..., 2]) * anchors[:, 0] / side
    bh = torch.exp(y[..., 3]) * anchors[:, 1] / side
    obj = torch.sigmoid(y[..., 4])
    best, label = torch.softmax(y[..., 5:5 + num_classes], dim=-1).max(dim=-1)   # first maximum
    score = obj * best
    return [t.reshape(-1) for t in (bx, by, bw, bh, label, score, score >= threshold)]


def yolo_v3_candidates(x, biases: list[float], anchor_ids: list[int], scale: int, num_box: int,
                       num_classes: int, threshold: float):
    """Yolov3DetectionOutput's candidates of one (N, C, H, W) bottom, in the fork's order (image,
    cell, box, class): centre x, y, width, height, class, score, and which are kept (score >
    threshold).  anchor_ids: the anchor (pair of biases) of each box."""
    n, h, w = x.shape[0], x.shape[2], x.shape[3]
    ln = 5 + num_classes
    y = x[:, :num_box * ln].reshape(n, num_box, ln, h, w).permute(0, 3, 4, 1, 2)   # (n, row, col, box, entry)
    col = torch.arange(w, device=x.device, dtype=x.dtype).reshape(1, 1, w, 1)
    row = torch.arange(h, device=x.device, dtype=x.dtype).reshape(1, h, 1, 1)
    pairs = torch.tensor(biases, device=x.device, dtype=x.dtype).reshape(-1, 2)
    anchors = pairs[torch.tensor(anchor_ids, device=x.device)]
    bx = (col + torch.sigmoid(y[..., 0])) / w
    by = (row + torch.sigmoid(y[..., 1])) / h
    bw = torch.exp(y[..., 2]) * anchors[:, 0] / (w * scale)
    bh = torch.exp(y[..., 3]) * anchors[:, 1] / (h * scale)
    score = torch.sigmoid(y[..., 5:]) * torch.sigmoid(y[..., 4:5])
    label = torch.arange(num_classes, device=x.device).expand(score.shape)
    per_class = [t.unsqueeze(-1).expand(score.shape) for t in (bx, by, bw, bh)]
    return [t.reshape(-1) for t in per_class + [label, score, score > threshold]]


def yolo_detection_rows(parts: list[list[torch.Tensor]], num_images: int, nms_threshold: float,
                        clip_iou: bool = False):
    """The kept candidates of every bottom, pooled, sorted by score (best first, ties in order),
    greedy class-agnostic NMS (IoU >= nms_threshold drops a box), as rows (1, 1, R, 7)
    [0, label + 1, score, left, top, right, bottom]; none: num_images rows [i, -1, ...].
    clip_iou: the IoU is that of the boxes clipped to [0, 1] (the rows stay unclipped)."""
    cols = [torch.cat([p[k][p[6]] for p in parts]) for k in range(6)]
    bx, by, bw, bh, label, score = cols
    dev, dt = score.device, score.dtype
    if score.numel() == 0:
        out = torch.full((num_images, 7), -1.0, device=dev, dtype=dt)
        out[:, 0] = torch.arange(num_images, device=dev, dtype=dt)
        return out.reshape(1, 1, num_images, 7)
    # A box that passes for several classes (v3: one candidate per class, side by side) is the same
    # box each time: its first, best candidate strikes out the later copies, or the kept box that
    # strikes it out strikes them out too.  So when every box's IoU with itself reaches the threshold,
    # the greedy loop needs only each box's first candidate: the same kept rows, from far fewer.
    boxes = torch.stack([bx, by, bw, bh], dim=1)
    same_box = torch.cumsum(torch.cat([torch.ones(1, dtype=torch.long, device=dev),
                                       (boxes[1:] != boxes[:-1]).any(dim=1).long()]), 0) - 1
    order = torch.sort(score, descending=True, stable=True)[1]
    bx, by, bw, bh, label, score, same_box = (t[order] for t in (bx, by, bw, bh, label, score, same_box))
    left, right = bx - bw / 2, bx + bw / 2
    top, bottom = by - bh / 2, by + bh / 2
    area = bw * bh
    if clip_iou:   # caffe_opencl's ApplyNms: setNormalizedBBox clips each box to [0, 1] first
        nms_sides = (left.clamp(min=0.0), right.clamp(max=1.0), top.clamp(min=0.0), bottom.clamp(max=1.0))
        area = (nms_sides[1] - nms_sides[0]) * (nms_sides[3] - nms_sides[2])
    else:
        nms_sides = (left, right, top, bottom)

    def iou_after(i, lo, ro, to, bo, ao):
        iw = torch.minimum(ro[i], ro[i + 1:]) - torch.maximum(lo[i], lo[i + 1:])
        ih = torch.minimum(bo[i], bo[i + 1:]) - torch.maximum(to[i], to[i + 1:])
        inter = torch.where((iw < 0) | (ih < 0), torch.zeros_like(iw), iw * ih)
        return inter / (ao[i] + ao[i + 1:] - inter)

    k = score.numel()
    candidates = torch.arange(k, device=dev)
    iw, ih = nms_sides[1] - nms_sides[0], nms_sides[3] - nms_sides[2]   # each box with itself, as iou_after
    inter = torch.where((iw < 0) | (ih < 0), torch.zeros_like(iw), iw * ih)
    self_iou = inter / (area + area - inter)
    if bool((self_iou >= nms_threshold).all()):
        first = torch.full((int(same_box.max()) + 1,), k, device=dev)
        first = first.scatter_reduce(0, same_box, candidates, "amin")
        candidates = candidates[first[same_box] == candidates]
    sides = [t[candidates] for t in (*nms_sides, area)]
    n = candidates.numel()
    alive = torch.ones(n, dtype=torch.bool, device=dev)
    kept = []
    for i in range(n):
        if not bool(alive[i]):
            continue
        kept.append(i)
        if i + 1 < n:
            alive[i + 1:] &= ~(iou_after(i, *sides) >= nms_threshold)
    idx = candidates[torch.tensor(kept, device=dev)]
    rows = torch.stack([torch.zeros_like(score[idx]), label[idx].to(dt) + 1, score[idx],
                        left[idx], top[idx], right[idx], bottom[idx]], dim=1)
    return rows.reshape(1, 1, -1, 7)


TORCH_YOLO_ROWS = torch_sources(yolo_detection_rows)


def _biases(p, field, need):
    b = [float(v) for v in p.biases]
    if len(b) < need:
        raise LayerError(f"{field}.biases has {len(b)} values; the anchors used need {need}")
    return b


def ssd_format_reading(ssd_format, field):
    """MagicSen/source_read 106ebe0 caffe_opencl (src/caffe/layers/yolo_detection_output_layer.cpp and .cu,
    include/caffe/util/bbox_util.hpp; YoloDetectionOutputParameter.ssd_format = 12 in its caffe.proto): the
    same decoding and sort, from bottom 0 alone (bottom 1 is the image its `visualize` draws on), on square maps
    (its Reshape checks width == height), per image, rows [image, label, score, x, y, w, h]; ssd_format adds 1
    to the label and writes x - w / 2, y - h / 2, x + w / 2, y + h / 2 in place of x, y, w, h.  Its ApplyNms
    (IoU >= nms_threshold drops) takes the IoU of the boxes clipped to [0, 1] (setNormalizedBBox,
    JaccardOverlap), where eric612's takes it unclipped; the rows keep the unclipped corners.  It writes no
    row where nothing is detected (caffeq writes its fallback row)."""
    if not ssd_format:
        raise LayerError(f"{field}.ssd_format false (caffe_opencl's centre-size rows [image, label, score, x, y, "
                         f"w, h]) is not supported; ssd_format: true is")
    return {"maps": 1, "clip_iou": True, "reading_notes": [
        "YoloDetectionOutput with ssd_format (MagicSen/source_read caffe_opencl): bottom 0 decoded alone, NMS on "
        "the boxes clipped to [0, 1], rows [0, label + 1, score, xmin, ymin, xmax, ymax] for a batch of 1; where "
        "nothing is detected the fork writes no row, caffeq its [0, -1, -1, -1, -1, -1, -1] row"]}


def _threshold(p, field, name):
    v = float(getattr(p, name))
    if math.isnan(v):
        raise LayerError(f"{field}.{name} is NaN")
    return v


class _YoloDetection(Layer):
    """What both forks' detection outputs share: the counts and thresholds they read, the row bound,
    candidates per bottom pooled into one NMS (yolo_detection_rows)."""

    #: the row count is known only after a run; infer gives the most rows the layer can write
    data_dependent_shape = True
    #: the torch candidate decoder (source copied into model.py)
    torch_candidates = None

    @staticmethod
    def counts_and_thresholds(p, f):
        a = {"num_classes": int(p.num_classes), "num_box": int(p.num_box),
             "confidence_threshold": _threshold(p, f, "confidence_threshold"),
             "nms_threshold": _threshold(p, f, "nms_threshold")}
        if a["num_classes"] < 1 or a["num_box"] < 1:
            raise LayerError(f"{f}.num_classes and num_box must be >= 1, got {a['num_classes']}, {a['num_box']}")
        return a

    def check_bottom(self, attrs, shape):
        """Raise LayerError where one bottom (N, C, H, W) does not fit the parameters."""

    def rows_per_cell(self, attrs):
        raise NotImplementedError

    def infer(self, attrs, in_shapes):
        name = self.types[0]
        rows = 0
        in_shapes = in_shapes[:attrs.get("maps", len(in_shapes))]
        for s in in_shapes:
            four_axes(s, name)
            if attrs.get("clip_iou") and s[2] != s[3]:
                raise LayerError(f"{name} with ssd_format (caffe_opencl) needs a square map (its Reshape checks "
                                 f"width == height), got {s[2]}x{s[3]}")
            self.check_bottom(attrs, s)
            n, _, h, w = s
            if n != in_shapes[0][0]:
                raise LayerError(f"{name}'s bottoms disagree on the batch: {n} vs {in_shapes[0][0]}")
            rows += n * h * w * self.rows_per_cell(attrs)
        return [(1, 1, max(rows, in_shapes[0][0]), 7)]

    def candidates(self, attrs, x, t):
        raise NotImplementedError

    def forward(self, attrs, params, *xs):
        parts = [self.candidates(attrs, x, t) for t, x in enumerate(xs[:attrs.get("maps", len(xs))])]
        return yolo_detection_rows(parts, xs[0].shape[0], attrs["nms_threshold"], attrs.get("clip_iou", False))

    def candidate_args(self, a, t, emit):
        """The model.py arguments of torch_candidates between the bottom and the threshold."""
        raise NotImplementedError

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(self.torch_candidates)
        rows = emit.helper(TORCH_YOLO_ROWS)
        emit.note(f"{node.name} ({self.types[0]}): the number of rows depends on the data")
        parts = ", ".join(f"{fn}({x}, {self.candidate_args(a, t, emit)}, {emit.lit(a['confidence_threshold'])})"
                          for t, x in enumerate(emit.inputs[:a.get("maps", len(emit.inputs))]))
        clip = ", clip_iou=True" if a.get("clip_iou") else ""
        return f"{rows}([{parts}], {emit.inputs[0]}.shape[0], {emit.lit(a['nms_threshold'])}{clip})"

    def onnx(self, ctx, node):
        _emit_yolo_detection(ctx, node, self)


@register_layer("YoloDetectionOutput")
class YoloDetectionOutput(_YoloDetection):
    torch_candidates = torch_sources(yolo_v2_candidates)

    def parse(self, lp):
        need_blobs(lp, lp.type, (1, 2))
        f = "yolo_detection_output_param"
        p = lp.yolo_detection_output_param
        if not p.HasField("num_classes"):
            raise LayerError(f"{f}.num_classes is required")
        a = self.counts_and_thresholds(p, f)
        a["biases"] = _biases(p, f, 2 * a["num_box"])
        if p.HasField("ssd_format"):   # MagicSen/source_read's caffe_opencl (see ssd_format_reading)
            a.update(ssd_format_reading(p.ssd_format, f), name=lp.name)
        return a

    def forward(self, attrs, params, *xs):
        if attrs.get("maps"):
            self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape for x in xs])
        return super().forward(attrs, params, *xs)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(i) for i in range(len(node.inputs))],
                                  ExportError)
        return super().pytorch_source(node, emit)

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError)
        super().onnx(ctx, node)

    def cannot_run(self, attrs, in_shapes):
        if attrs.get("maps") and in_shapes[0][0] > 1:
            return ("caffe_opencl's YoloDetectionOutput (ssd_format) runs NMS per image and writes each image's "
                    "id; caffeq runs it on one image at a time (batch 1)")

    def check_bottom(self, attrs, shape):
        nb, k = attrs["num_box"], attrs["num_classes"]
        _, c, h, w = shape
        if h != w:
            raise LayerError(f"YoloDetectionOutput needs square maps (the fork walks side x side with "
                             f"side = width), got {h}x{w}")
        if c % nb or c // nb < 5 + k:
            raise LayerError(f"YoloDetectionOutput: channels {c} must be num_box {nb} x (at least 5 + "
                             f"num_classes {k}) values")

    def rows_per_cell(self, attrs):
        return attrs["num_box"]

    def candidates(self, attrs, x, t):
        return yolo_v2_candidates(x, attrs["biases"], attrs["num_box"], attrs["num_classes"],
                                  attrs["confidence_threshold"])

    def candidate_args(self, a, t, emit):
        return f"{emit.lit(a['biases'])}, {a['num_box']}, {a['num_classes']}"


@register_layer("Yolov3DetectionOutput")
class Yolov3DetectionOutput(_YoloDetection):
    torch_candidates = torch_sources(yolo_v3_candidates)

    def parse(self, lp):
        f = "yolov3_detection_output_param"
        p = lp.yolov3_detection_output_param
        if not p.HasField("num_classes"):
            raise LayerError(f"{f}.num_classes is required")
        if p.gaussian_box:
            # the fork's CPU Forward reads its objectness from memory it never wrote, and its GPU
            # Forward counts one uncertainty twice: there is no one behaviour to reproduce
            raise LayerError(f"{f}.gaussian_box (Gaussian YOLOv3) is not supported: the fork's CPU and GPU "
                             f"paths disagree")
        groups = int(p.mask_group_num)
        positive_field(groups, f"{f}.mask_group_num")
        if len(lp.bottom) != groups:
            raise LayerError(f"{f}.mask_group_num {groups} must equal the number of bottoms, {len(lp.bottom)}")
        a = self.counts_and_thresholds(p, f)
        mask = [int(m) for m in p.mask]
        per_group = len(mask) // groups
        # box n of bottom t uses mask[n + t * per_group]
        ids = [[t * per_group + n for n in range(a["num_box"])] for t in range(groups)]
        if ids[-1][-1] >= len(mask):
            raise LayerError(f"{f}.mask has {len(mask)} entries; {groups} bottoms x num_box {a['num_box']} "
                             f"read up to entry {ids[-1][-1]}")
        a["anchor_ids"] = [[mask[i] for i in row] for row in ids]
        a["biases"] = _biases(p, f, 2 * (max(max(r) for r in a["anchor_ids"]) + 1))
        scales = [int(s) for s in p.anchors_scale]
        if len(scales) < groups or any(s < 1 for s in scales[:groups]):
            raise LayerError(f"{f}.anchors_scale needs one positive value per bottom ({groups}), got {scales}")
        a["scales"] = scales[:groups]
        return a

    def check_bottom(self, attrs, shape):
        nb, k = attrs["num_box"], attrs["num_classes"]
        c = shape[1]
        if c < nb * (5 + k):
            raise LayerError(f"{self.types[0]}: channels {c} must be num_box x (5 + num_classes) = "
                             f"{nb} x {5 + k}")
        if c > nb * (5 + k):
            # eric612's Forward_cpu checks no channel count: box n reads channels n * len... of each item
            # (an item being count(1) values), so the channels past num_box x len are never read
            attrs.setdefault("reading_notes", []).append(
                f"{self.types[0]} reads the first {nb} x {5 + k} of a bottom's {c} channels, as the fork's "
                f"forward indexes them (it checks no channel count); the rest are unused")

    def rows_per_cell(self, attrs):
        return attrs["num_box"] * attrs["num_classes"]

    def candidates(self, attrs, x, t):
        return yolo_v3_candidates(x, attrs["biases"], attrs["anchor_ids"][t], attrs["scales"][t],
                                  attrs["num_box"], attrs["num_classes"], attrs["confidence_threshold"])

    def candidate_args(self, a, t, emit):
        return (f"{emit.lit(a['biases'])}, {emit.lit(a['anchor_ids'][t])}, {a['scales'][t]}, {a['num_box']}, "
                f"{a['num_classes']}")


@claim_layers("Yolov3Detection", lambda lp: lp.HasField("yolov3_detection_output_param"))
class Yuqj1991Yolov3Detection(Yolov3DetectionOutput):
    """yuqj1991/caffe_train's Yolov3Detection: Yolov3DetectionOutput on square maps, nms_threshold 0.4 by
    default (its caffe.proto's)."""

    def parse(self, lp):
        a = super().parse(lp)
        if not lp.yolov3_detection_output_param.HasField("nms_threshold"):
            a["nms_threshold"] = float(np.float32(0.4))
        return a

    def check_bottom(self, attrs, shape):
        super().check_bottom(attrs, shape)
        if shape[2] != shape[3]:
            raise LayerError(f"yuqj1991's Yolov3Detection needs square maps (it takes the side from the width), "
                             f"got {shape[2]}x{shape[3]}")


# ---- detection as ONNX ops -----------------------------------------------------------------

def _emit_yolo_detection(ctx, node, spec):
    """Candidates decoded per bottom, pooled in the fork's order, filtered (Compress), then one
    class-agnostic NonMaxSuppression on centre/size boxes; rows in NMS's order (best first)."""
    a = node.attrs
    name = node.name
    bx, by, bw, bh, lab, score = emit_yolo_candidates(ctx, node, a, isinstance(spec, Yolov3DetectionOutput))

    nms_box, centred = (bx, by, bw, bh), 1
    if a.get("clip_iou"):   # caffe_opencl: the IoU of the boxes clipped to [0, 1], as corners y1, x1, y2, x2
        hw, hh = ctx.op("Mul", [bw, ctx.f32(0.5)], "nms_hw"), ctx.op("Mul", [bh, ctx.f32(0.5)], "nms_hh")
        nms_box = (ctx.op("Max", [ctx.op("Sub", [by, hh], "nms_t"), ctx.f32(0.0)], "nms_tc"),
                   ctx.op("Max", [ctx.op("Sub", [bx, hw], "nms_l"), ctx.f32(0.0)], "nms_lc"),
                   ctx.op("Min", [ctx.op("Add", [by, hh], "nms_b"), ctx.f32(1.0)], "nms_bc"),
                   ctx.op("Min", [ctx.op("Add", [bx, hw], "nms_r"), ctx.f32(1.0)], "nms_rc"))
        centred = 0
    boxes = ctx.op("Unsqueeze", [ctx.op("Concat", [ctx.op("Unsqueeze", [v, ctx.i64([1])], f"c{i}") for i, v in
                                            enumerate(nms_box)], "boxes2", axis=1), ctx.i64([0])],
                   "boxes")                                                                      # (1, K, 4)
    scores = ctx.op("Reshape", [score, ctx.i64([1, 1, -1])], "scores")
    thr = ctx.nms_threshold(a["nms_threshold"], drops_equal=True)   # the fork drops IoU >= t
    sel = ctx.add_node("NonMaxSuppression", [boxes, scores, ctx.i64([2 ** 31 - 1]), ctx.f32([thr])],
                       [ctx.tmp(f"{name}_sel")], name=name, center_point_box=centred)[0]
    sel_box = ctx.op("Slice", [sel, ctx.i64([2]), ctx.i64([3]), ctx.i64([1])], "sel_box")
    idx = ctx.op("Squeeze", [sel_box, ctx.i64([1])], "idx")
    g = {i: ctx.op("Gather", [v, idx], f"g{i}", axis=0) for i, v in enumerate((bx, by, bw, bh, lab, score))}
    half_w = ctx.op("Mul", [g[2], ctx.f32(0.5)], "half_w")
    half_h = ctx.op("Mul", [g[3], ctx.f32(0.5)], "half_h")
    columns = [ctx.op("Mul", [g[5], ctx.f32(0.0)], "zero"),
               ctx.op("Add", [ctx.op("Cast", [g[4]], "lab_f", to=1), ctx.f32(1.0)], "label"), g[5],
               ctx.op("Sub", [g[0], half_w], "left"), ctx.op("Sub", [g[1], half_h], "top"),
               ctx.op("Add", [g[0], half_w], "right"), ctx.op("Add", [g[1], half_h], "bottom")]
    emit_rows_or_fallback(ctx, node, ctx.op, columns)


def emit_yolo_candidates(ctx, node, a, v3, with_obj=False):
    """The kept candidates of every bottom, flat, in the fork's order: x, y, w, h, label, score
    and, with_obj (v2 only), the objectness (a: num_box, num_classes, biases,
    confidence_threshold, and for v3 anchor_ids, scales)."""

    def entry(y, lo, hi, hint):
        return ctx.op("Slice", [y, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([-1])], hint)

    cols = [[] for _ in range(8)]   # x, y, w, h, label, score, keep, objectness: flat per bottom
    nb, k = a["num_box"], a["num_classes"]
    for t, x in enumerate(node.inputs[:a.get("maps", len(node.inputs))]):
        _, c, h, w = ctx.shape(x)
        per = 5 + k if v3 else c // nb     # v3: the first num_box x (5 + k) channels (check_bottom)
        hint = f"b{t}"
        if v3:
            x = ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([nb * per]), ctx.i64([1])], f"{hint}_used")
        y = ctx.op("Reshape", [x, ctx.i64([0, nb, per, h, w])], f"{hint}_split")
        y = ctx.op("Transpose", [y], f"{hint}_t", perm=[0, 3, 4, 1, 2])           # (n, row, col, box, entry)
        colv = ctx.f32(np.arange(w, dtype=np.float32).reshape(1, 1, w, 1, 1))
        rowv = ctx.f32(np.arange(h, dtype=np.float32).reshape(1, h, 1, 1, 1))
        if v3:
            ids = a["anchor_ids"][t]
            anc = np.array(a["biases"], np.float32).reshape(-1, 2)[ids]
            div_w, div_h = np.float32(w), np.float32(h)
            adiv_w, adiv_h = np.float32(w * a["scales"][t]), np.float32(h * a["scales"][t])
        else:
            anc = np.array(a["biases"][:2 * nb], np.float32).reshape(nb, 2)
            div_w = div_h = adiv_w = adiv_h = np.float32(w)
        bx = ctx.op("Div", [ctx.op("Add", [colv, ctx.op("Sigmoid", [entry(y, 0, 1, f"{hint}_tx")], f"{hint}_sx")],
                                   f"{hint}_cx"), ctx.f32(div_w)], f"{hint}_bx")
        by = ctx.op("Div", [ctx.op("Add", [rowv, ctx.op("Sigmoid", [entry(y, 1, 2, f"{hint}_ty")], f"{hint}_sy")],
                                   f"{hint}_cy"), ctx.f32(div_h)], f"{hint}_by")
        bw = ctx.op("Div", [ctx.op("Mul", [ctx.op("Exp", [entry(y, 2, 3, f"{hint}_tw")], f"{hint}_ew"),
                                           ctx.f32(anc[:, 0].reshape(nb, 1))], f"{hint}_aw"),
                            ctx.f32(adiv_w)], f"{hint}_bw")
        bh = ctx.op("Div", [ctx.op("Mul", [ctx.op("Exp", [entry(y, 3, 4, f"{hint}_th")], f"{hint}_eh"),
                                           ctx.f32(anc[:, 1].reshape(nb, 1))], f"{hint}_ah"),
                            ctx.f32(adiv_h)], f"{hint}_bh")
        obj = ctx.op("Sigmoid", [entry(y, 4, 5, f"{hint}_to")], f"{hint}_obj")
        logits = entry(y, 5, 5 + k, f"{hint}_cls")
        if v3:
            score = ctx.op("Mul", [ctx.op("Sigmoid", [logits], f"{hint}_p"), obj], f"{hint}_score")   # (.., box, k)
            shape = ctx.op("Shape", [score], f"{hint}_shape")
            parts = [ctx.op("Expand", [v, shape], f"{hint}_e{i}") for i, v in enumerate((bx, by, bw, bh))]
            lab = ctx.op("Expand", [ctx.i64(np.arange(k, dtype=np.int64)), shape], f"{hint}_lab")
            keep = ctx.op("Greater", [score, ctx.f32(a["confidence_threshold"])], f"{hint}_keep")
        else:
            prob = ctx.op("Softmax", [logits], f"{hint}_prob", axis=-1)
            if ctx.opset < 18:   # axes: an attribute before opset 18, an input after
                best = ctx.op("ReduceMax", [prob], f"{hint}_best", axes=[-1], keepdims=1)
            else:
                best = ctx.op("ReduceMax", [prob, ctx.i64([-1])], f"{hint}_best", keepdims=1)
            lab = ctx.op("ArgMax", [prob], f"{hint}_lab", axis=-1, keepdims=1)
            score = ctx.op("Mul", [obj, best], f"{hint}_score")
            parts = [bx, by, bw, bh]
            keep = ctx.op("GreaterOrEqual", [score, ctx.f32(a["confidence_threshold"])], f"{hint}_keep")
        for i, v in enumerate(parts + [lab, score, keep] + ([obj] if with_obj else [])):
            cols[i].append(ctx.op("Reshape", [v, ctx.i64([-1])], f"{hint}_flat{i}"))
    keep = cols[6][0] if len(cols[6]) == 1 else ctx.op("Concat", cols[6], "keep", axis=0)
    flat = []
    for i in (0, 1, 2, 3, 4, 5, 7) if with_obj else range(6):
        v = cols[i][0] if len(cols[i]) == 1 else ctx.op("Concat", cols[i], f"all{i}", axis=0)
        flat.append(ctx.op("Compress", [v, keep], f"kept{i}", axis=0))
    return flat


def emit_rows_or_fallback(ctx, node, op, columns):
    """Rows from the 7 (R,) columns, or with no row at all one [i, -1, -1, -1, -1, -1, -1] per image."""
    rows = op("Concat", [op("Unsqueeze", [v, ctx.i64([1])], f"r{i}") for i, v in enumerate(columns)],
              "rows", axis=1)                                                                # (R, 7)
    emit_detection_top(ctx, op, rows, node.inputs[0], node.outputs[0], 7)


__all__ = [
    "YoloDetectionOutput",
    "Yolov3DetectionOutput",
    "yolo_detection_rows",
    "yolo_v2_candidates",
    "yolo_v3_candidates",
]
