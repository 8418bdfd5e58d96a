"""yuqj1991/caffe_train's Yolov3Detection (src/caffe/layers/Yolov3DetectionLayer.cpp, its CPU Forward; the
GPU forward is a stub that runs it), read with `yolov3_detection_output_param`.  Cambricon's type of the
same name reads `yolov3_param` (cambricon_yolo.py), which tells the two apart.

One bottom per mask group (mask_group_num of them), each (N, num_box * (5 + num_classes), S, S): the
fork takes S from the width and indexes as if the map were square.  Box n of bottom t uses the anchor
m = mask[n + t * len(mask) / mask_group_num].  At cell s (x = s % S, y = s // S), entries read from
channel n * (5 + num_classes) + c:

- x = (x + sigmoid(tx)) / S, y = (y + sigmoid(ty)) / S,
- w = exp(tw) * biases[2 m] / (S * anchors_scale[t]), h = exp(th) * biases[2 m + 1] / (same),
- each class's score sigmoid(class) * sigmoid(objectness) (logistic, not softmax); a candidate per
  class whose score > confidence_threshold, in the order bottom, image, cell, box, class.

Every candidate of every image is pooled, sorted by score, best first (std::sort, unstable: caffeq
keeps ties in candidate order), and a class-agnostic greedy NMS drops each later candidate whose IoU
with a kept one is >= nms_threshold (IoU of the centre-size boxes, in float).  The top is
(1, 1, K, 7): [0, class + 1, score, x - w/2, y - h/2, x + w/2, y + h/2] per kept candidate, unclipped;
the image id is 0 for every row, whichever image it came from.  With none kept: one row per image of
the last bottom, [image, -1, -1, -1, -1, -1, -1].

ONNX: refused (NonMaxSuppression drops at IoU > threshold, the fork at >=; and its sort is unstable).
"""
import torch

from .registry import LayerError, torch_sources


def yuqj_yolov3_candidates(xs: list, biases: list[float], anchors: list[list[int]], scales: list[int],
                           num_box: int, num_classes: int, threshold: float):
    """(score, class, x, y, w, h) rows of every candidate, (R, 6), in the fork's push order."""
    found = []
    for t, x in enumerate(xs):
        n, side = x.shape[0], x.shape[3]
        v = x.reshape(n, num_box, 5 + num_classes, side * side)
        cell = torch.arange(side * side, device=x.device)
        cx, cy = (cell % side).to(x.dtype), torch.div(cell, side, rounding_mode="floor").to(x.dtype)
        m = torch.tensor(anchors[t], device=x.device)
        prior = torch.tensor(biases, dtype=x.dtype, device=x.device).reshape(-1, 2)[m]        # (box, 2)
        span = side * scales[t]
        bx = (cx + torch.sigmoid(v[:, :, 0])) / side
        by = (cy + torch.sigmoid(v[:, :, 1])) / side
        bw = torch.exp(v[:, :, 2]) * prior[:, 0:1] / span
        bh = torch.exp(v[:, :, 3]) * prior[:, 1:2] / span
        score = torch.sigmoid(v[:, :, 5:]) * torch.sigmoid(v[:, :, 4:5])                     # (n, box, C, s)
        score = score.permute(0, 3, 1, 2)                                                   # image, cell, box, class
        box = torch.stack([bx, by, bw, bh], -1).permute(0, 2, 1, 3).unsqueeze(3).expand(-1, -1, -1, num_classes, -1)
        cls = torch.arange(num_classes, device=x.device, dtype=x.dtype).expand_as(score)
        rows = torch.cat([score.unsqueeze(-1), cls.unsqueeze(-1), box], -1).reshape(-1, 6)
        found.append(rows[rows[:, 0] > threshold])
    return torch.cat(found)


def yuqj_yolov3_rows(rows, nms_threshold: float, images: int):
    """The fork's top from its candidates: sorted by score (stable), class-agnostic greedy NMS at
    IoU >= nms_threshold on the centre-size boxes, rows [0, class + 1, score, corners]."""
    rows = rows[torch.sort(rows[:, 0], descending=True, stable=True).indices]
    x, y, w, h = rows[:, 2], rows[:, 3], rows[:, 4], rows[:, 5]
    left, right, top, bottom = x - w / 2, x + w / 2, y - h / 2, y + h / 2
    dropped = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    for i in range(rows.shape[0] - 1):
        if dropped[i]:
            continue
        iw = torch.minimum(right[i], right[i + 1:]) - torch.maximum(left[i], left[i + 1:])
        ih = torch.minimum(bottom[i], bottom[i + 1:]) - torch.maximum(top[i], top[i + 1:])
        inter = torch.where((iw < 0) | (ih < 0), torch.zeros_like(iw), iw * ih)
        iou = inter / (w[i] * h[i] + w[i + 1:] * h[i + 1:] - inter)
        dropped[i + 1:] |= iou >= nms_threshold
    kept = rows[~dropped]
    if kept.shape[0] == 0:
        out = torch.full((images, 7), -1.0, dtype=rows.dtype, device=rows.device)
        out[:, 0] = torch.arange(images, dtype=rows.dtype, device=rows.device)
        return out.reshape(1, 1, images, 7)
    kx, ky, kw, kh = kept[:, 2], kept[:, 3], kept[:, 4], kept[:, 5]
    out = torch.stack([torch.zeros_like(kx), kept[:, 1] + 1, kept[:, 0], kx - kw / 2, ky - kh / 2,
                       kx + kw / 2, ky + kh / 2], 1)
    return out.reshape(1, 1, -1, 7)


TORCH_CANDIDATES = torch_sources(yuqj_yolov3_candidates)
TORCH_ROWS = torch_sources(yuqj_yolov3_rows)


def parse_yuqj(lp):
    """yolov3_detection_output_param as yuqj1991's LayerSetUp reads it (nms_threshold's default is its 0.4)."""
    f = "yolov3_detection_output_param"
    p = lp.yolov3_detection_output_param
    if not p.HasField("num_classes"):
        raise LayerError(f"{f}.num_classes must be given (the fork's LayerSetUp checks it)")
    groups = int(p.mask_group_num)
    if groups != len(lp.bottom):
        raise LayerError(f"{f}.mask_group_num {groups} must equal the number of bottoms, {len(lp.bottom)} (yuqj1991's "
                         f"Yolov3Detection reads one bottom per mask group)")
    masks, boxes = [int(v) for v in p.mask], int(p.num_box)
    per_group = len(masks) // groups
    if boxes < 1 or boxes > per_group or len(p.anchors_scale) < groups:
        raise LayerError(f"{f}: num_box {boxes} must be 1 to len(mask) / mask_group_num = {per_group}, with one "
                         f"anchors_scale per bottom (got {len(p.anchors_scale)})")
    anchors = [masks[t * per_group:t * per_group + boxes] for t in range(groups)]
    if any(2 * m + 1 >= len(p.biases) for group in anchors for m in group):
        raise LayerError(f"{f}.mask names an anchor past the {len(p.biases) // 2} pairs of biases")
    if any(s == 0 for s in p.anchors_scale[:groups]):
        raise LayerError(f"{f}.anchors_scale must be > 0 (the boxes divide by it)")
    return {"fork": "yuqj1991", "num_classes": int(p.num_classes), "num_box": boxes, "anchors": anchors,
            "scales": [int(s) for s in p.anchors_scale[:groups]], "biases": [float(b) for b in p.biases],
            "confidence_threshold": float(p.confidence_threshold),
            "nms_threshold": float(p.nms_threshold) if p.HasField("nms_threshold") else 0.4}


def infer_yuqj(attrs, in_shapes):
    want = attrs["num_box"] * (5 + attrs["num_classes"])
    for s in in_shapes:
        if len(s) != 4 or s[1] != want or s[2] != s[3]:
            raise LayerError(f"yuqj1991's Yolov3Detection needs square (N, num_box x (5 + num_classes) = {want}, S, S) "
                             f"bottoms (it takes S from the width), got {list(s)}")
        if s[0] != in_shapes[0][0]:
            raise LayerError(f"Yolov3Detection's bottoms disagree on the batch: {s[0]} vs {in_shapes[0][0]}")
    return [(1, 1, 1, 7)]   # the rows kept: known only when it runs


def forward_yuqj(attrs, xs):
    a = attrs
    rows = yuqj_yolov3_candidates(list(xs), a["biases"], a["anchors"], a["scales"], a["num_box"], a["num_classes"],
                                  a["confidence_threshold"])
    return yuqj_yolov3_rows(rows, a["nms_threshold"], xs[-1].shape[0])


def source_yuqj(attrs, emit):
    a = attrs
    candidates, kept = emit.helper(TORCH_CANDIDATES), emit.helper(TORCH_ROWS)
    rows = (f"{candidates}([{', '.join(emit.inputs)}], {emit.lit(a['biases'])}, {a['anchors']!r}, {a['scales']!r}, "
            f"{a['num_box']}, {a['num_classes']}, {emit.lit(a['confidence_threshold'])})")
    return f"{kept}({rows}, {emit.lit(a['nms_threshold'])}, {emit.inputs[-1]}.shape[0])"
