"""Cambricon/caffe's Yolov3Detection (src/caffe/layers/yolov3_detection_layer.cpp, commit eadcc46d,
2020-02-12; the CPU Forward, which its MLU op mirrors).

Three bottoms (N, anchor_num * (5 + num_classes), H, W), parameters in `yolov3_param` (the fork's
Yolov3DetectionParameter: num_classes 80, num_box 1024, confidence_threshold 0.5, nms_threshold
0.45, anchor_num 3, biases, im_w 416, im_h 416).  Per bottom i, cell k (row-major) and anchor a
(row r = k * anchor_num + a; entries read channel-last, channel a * (5 + num_classes) + entry):

- stride = int(im_w / sqrt(H * W)) (the fork assumes square maps; used for x and y alike),
- x = stride * (sigmoid(tx) + k % W), y = stride * (sigmoid(ty) + k // W),
- w = exp(tw) * biases[6 i + (2 r) % 6], h = exp(th) * biases[6 i + (2 r + 1) % 6] (pixels),
- objectness and every class through the logistic (1 / (1 + exp(-v))).

The rows of the three bottoms are concatenated (bottom 0 first).  Per image, a row is a candidate
when its objectness > confidence_threshold; its corners are x -+ w / 2, y -+ h / 2 and its score for
class j is objectness * p_j, zeroed unless > confidence_threshold.  (The fork takes that objectness
from image 0's rows whatever the image: `bot_data[i + 4]`, not the image's own; followed here.)
Then, class by class, the candidate list is sorted by that class's score, best first, and a greedy
NMS zeroes the score of every later box whose IoU with a box still scoring is > nms_threshold; IoU
counts pixels inclusively (width = x2 - x1 + 1).  The list keeps each sort's order for the next
class.  std::sort leaves ties in any order; caffeq sorts stably (ties keep the list's order).

The top is (1, N * (7 * num_box + 64), 1, 1), filled with -1: entry 0 holds the number of rows, then
from entry 64 one row of 7 per (image, candidate in the final list order, class scoring >
confidence_threshold): [image, class, score, x1 / im_w, y1 / im_h, x2 / im_w, y2 / im_h].  The fork
writes rows past its top when there are more than fit; caffeq writes those that fit and counts
them.  The fork also rewrites its bottoms in place (decoded values); caffeq leaves them.

ONNX: refused (per-class sequential sorts and a per-class greedy NMS on inclusive-pixel IoU have no
ONNX form; NonMaxSuppression computes another IoU).
"""

import torch

from .registry import Layer, LayerError, need_blobs, positive_field, register_layer, torch_sources


def cambricon_yolov3_decode(xs: list, biases: list[float], num_classes: int, anchor_num: int, im_w: int):
    """Cambricon Yolov3Detection's decoded rows of every bottom, concatenated: (N, R, 5 +
    num_classes) holding x, y, w, h (pixels), objectness, class probabilities."""
    import math
    out = []
    b = torch.tensor(biases, dtype=xs[0].dtype, device=xs[0].device)
    for i, x in enumerate(xs):
        n, c, h, w = x.shape
        hw = h * w
        stride = int(im_w / math.sqrt(hw))
        y = x.reshape(n, c, hw).transpose(1, 2).reshape(n, hw * anchor_num, 5 + num_classes)
        r = torch.arange(hw * anchor_num, device=x.device)
        k = r // anchor_num
        col, row = (k % w).to(x.dtype), (k // w).to(x.dtype)
        aw, ah = b[6 * i + (2 * r) % 6], b[6 * i + (2 * r + 1) % 6]
        act = 1 / (1 + torch.exp(-y))
        bx = stride * (act[..., 0] + col)
        by = stride * (act[..., 1] + row)
        bw = torch.exp(y[..., 2]) * aw
        bh = torch.exp(y[..., 3]) * ah
        out.append(torch.cat([torch.stack([bx, by, bw, bh], dim=-1), act[..., 4:]], dim=-1))
    return torch.cat(out, dim=1)


def cambricon_yolov3_rows(d, num_classes: int, num_box: int, im_w: int, im_h: int, confidence: float,
                          nms_threshold: float):
    """Cambricon Yolov3Detection's top (1, N * (7 * num_box + 64), 1, 1) from the decoded rows d."""
    n = d.shape[0]
    total = n * (7 * num_box + 64)
    top = torch.full((total,), -1.0, dtype=d.dtype, device=d.device)
    capacity = (total - 64) // 7
    written = 0
    for img in range(n):
        idx = torch.nonzero(d[img, :, 4] > confidence).flatten()
        if idx.numel() == 0:
            continue
        c = d[img, idx]
        x1, x2 = c[:, 0] - c[:, 2] / 2, c[:, 0] + c[:, 2] / 2
        y1, y2 = c[:, 1] - c[:, 3] / 2, c[:, 1] + c[:, 3] / 2
        prob = d[0, idx, 4:5] * c[:, 5:5 + num_classes]   # image 0's objectness, as the fork
        score = torch.where(prob > confidence, prob, torch.zeros_like(prob))
        area = (x2 - x1 + 1) * (y2 - y1 + 1)
        perm = torch.arange(idx.numel(), device=d.device)
        for k in range(num_classes):
            perm = perm[torch.sort(score[perm, k], descending=True, stable=True)[1]]
            live = int((score[perm, k] > 0).sum())   # scores are >= 0: the scoring boxes come first
            for pos in range(min(live, perm.numel() - 1)):
                i = perm[pos]
                if score[i, k] == 0:
                    continue
                rest = perm[pos + 1:]
                iw = torch.minimum(x2[i], x2[rest]) - torch.maximum(x1[i], x1[rest]) + 1
                ih = torch.minimum(y2[i], y2[rest]) - torch.maximum(y1[i], y1[rest]) + 1
                inter = torch.where((iw > 0) & (ih > 0), iw * ih, torch.zeros_like(iw))
                iou = inter / (area[i] + area[rest] - inter)
                score[rest[iou > nms_threshold], k] = 0
        hit = score[perm] > confidence                   # (candidate in list order, class)
        at, cls = torch.nonzero(hit, as_tuple=True)      # row-major: list order, then class
        at, cls = at[:capacity - written], cls[:capacity - written]
        i = perm[at]
        rows = torch.stack([torch.full_like(score[i, cls], float(img)), cls.to(d.dtype), score[i, cls],
                            x1[i] / im_w, y1[i] / im_h, x2[i] / im_w, y2[i] / im_h], dim=1)
        top[64 + 7 * written:64 + 7 * (written + rows.shape[0])] = rows.reshape(-1)
        written += rows.shape[0]
    top[0] = written
    return top.reshape(1, total, 1, 1)


TORCH_DECODE = torch_sources(cambricon_yolov3_decode)
TORCH_ROWS = torch_sources(cambricon_yolov3_rows)


@register_layer("Yolov3Detection")
class Yolov3Detection(Layer):
    onnx_refusal = ("Cambricon's Yolov3Detection sorts per class in sequence and runs a greedy per-class NMS "
                    "on inclusive-pixel IoU; ONNX NonMaxSuppression computes another IoU")

    def parse(self, lp):
        need_blobs(lp, "Yolov3Detection", 3, 1, in_place=False)
        f = "yolov3_param"
        p = lp.yolov3_param
        a = {"num_classes": int(p.num_classes), "num_box": int(p.num_box), "anchor_num": int(p.anchor_num),
             "im_w": int(p.im_w), "im_h": int(p.im_h),
             "confidence_threshold": float(p.confidence_threshold), "nms_threshold": float(p.nms_threshold),
             "biases": [float(v) for v in p.biases]}
        for k in ("num_classes", "num_box", "im_w", "im_h"):
            positive_field(a[k], f"{f}.{k}")
        if a["anchor_num"] != 3:
            raise LayerError(f"{f}.anchor_num {a['anchor_num']}: Cambricon's Yolov3Detection reads 3 anchors per "
                             f"bottom whatever it says (biases[6 i + (2 r) % 6]); only 3 is supported")
        if len(a["biases"]) != 2 * 3 * 3:
            raise LayerError(f"{f}.biases has {len(a['biases'])} values; the fork checks for 2 x anchor_num x 3 "
                             f"bottoms = 18")
        return a

    def infer(self, attrs, in_shapes):
        ln = 5 + attrs["num_classes"]
        n = in_shapes[0][0] if in_shapes[0] else 0
        for s in in_shapes:
            if len(s) != 4:
                raise LayerError(f"Yolov3Detection needs 4-axis (N, C, H, W) bottoms, got {list(s)}")
            if s[1] != 3 * ln:
                raise LayerError(f"Yolov3Detection: channels {s[1]} must be anchor_num x (5 + num_classes) = "
                                 f"3 x {ln}")
            if s[0] != n:
                raise LayerError(f"Yolov3Detection's bottoms disagree on the batch: {s[0]} vs {n}")
            if int(attrs["im_w"] / (s[2] * s[3]) ** 0.5) < 1:
                raise LayerError(f"Yolov3Detection: im_w {attrs['im_w']} is smaller than the grid "
                                 f"{s[2]}x{s[3]} (stride 0)")
        return [(1, n * (7 * attrs["num_box"] + 64), 1, 1)]

    def forward(self, attrs, params, *xs):
        a = attrs
        d = cambricon_yolov3_decode(list(xs), a["biases"], a["num_classes"], 3, a["im_w"])
        return cambricon_yolov3_rows(d, a["num_classes"], a["num_box"], a["im_w"], a["im_h"],
                                     a["confidence_threshold"], a["nms_threshold"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        dec, rows = emit.helper(TORCH_DECODE), emit.helper(TORCH_ROWS)
        d = (f"{dec}([{', '.join(emit.inputs)}], {emit.lit(a['biases'])}, {a['num_classes']}, 3, "
             f"{a['im_w']})")
        return (f"{rows}({d}, {a['num_classes']}, {a['num_box']}, {a['im_w']}, {a['im_h']}, "
                f"{emit.lit(a['confidence_threshold'])}, {emit.lit(a['nms_threshold'])})")


__all__ = ["Yolov3Detection", "cambricon_yolov3_decode", "cambricon_yolov3_rows"]
