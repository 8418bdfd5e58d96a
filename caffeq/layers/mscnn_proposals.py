"""zhaoweicai's region-proposal outputs: MS-CNN's BoxOutput (zhaoweicai/mscnn 534bcac,
src/caffe/layers/box_output_layer.cpp, BoxIOU in util/math_functions.cpp) and Cascade R-CNN's
BoxGroupOutput (zhaoweicai/cascade-rcnn 2252f46, box_group_output_layer.cpp / .cu, util/bbox_util.cpp).
Both run as the forks' CPU forward does, in float32, built with GCC 4 or 5 as in their time: there
`exp` of a float is the C library's double exp, and `field * exp(d)` is rounded to float32 once (GCC 6 and
later call expf and round twice: 1 ulp apart at times).  Cascade R-CNN's GPU forward decodes on the device,
where nvcc fuses multiply-adds, so it may differ from its CPU forward by an ulp (the reading note says so).
How many rois come out depends on the data.

BoxOutput: each bottom j is (N, classes + 4, H, W), classes >= 1 (with one, the score is -FLT_MAX minus it).  Per image, for every bottom and cell
(row-major):
- score = max over classes 1.. of the scores, minus class 0's score.  Cells with score >= fg_thr propose
  a box.
- Its 4 deltas, de-normalized (times bbox_std, then plus bbox_mean, if both are given), are clamped:
  x, y to [-1 / field_xyr, 1 / field_xyr] and w, h to [ln(1 / field_whr), ln(field_whr)].
- They are decoded against the cell's receptive field: x * field_w + (col + 0.5) * downsample_rate,
  w = field_w * exp(w), then x - w / 2.  x is then raised to 0 and w cut to int(W * rate) - x.
- Boxes with w and h >= min_size are kept, sorted by (score, index) descending (std::greater on pairs:
  the later box first among equal scores), cut to max_nms_num, greedy NMS on BoxIOU (x, y, w, h: no +1;
  nms_type IOU, IOMU min area or IOFU first area), cut to max_post_nms_num.
- Rows [image, x, y, x + w, y + h(, score)].

BoxGroupOutput: bottoms are (score, bbox) pairs, one box_group_param each.  A pair holds G receptive-field
groups per image: scores (N * G, C, H, W), whose channel 0 is the background probability, and deltas
(N * G, 4, H, W).
- score = 1 - background.  Cells with score >= fg_thr propose.
- Decoding, per DecodeGroupBBoxes: de-normalized as above, both clamps first, then
  x * field_w[g] + (col + 0.5) * stride, w = field_w[g] * exp(w), x - w / 2, x2 = x + w - 1.
- Boxes are clipped to [0, W * stride] x [0, H * stride] and kept when x2 - x1 + 1 and y2 - y1 + 1 >=
  min_size.
- Ranking is libstdc++'s std::partial_sort on the score alone (heap select, then sort_heap), so equal
  scores come in its heap order (std_partial_sort_order).
- Greedy NMS on JaccardOverlap (inclusive pixels; no overlap when the x-range is empty or the y-range has
  no height), then cut to max_post_nms_num.  Rows [image, x1, y1, x2, y2(, score)].

With no box in the whole batch both give the forks' placeholder row [0, 1, 1, 10, 10] (and a zero
row with score).  ONNX cannot express the data-dependent selection: the export refuses.
"""
import math

import numpy as np
import torch

from .cascade_rcnn import bbox_reg_normalization
from .rcnn import greedy_nms
from .registry import Layer, LayerError, register_layer, torch_sources


def std_partial_sort_order(scores, k: int):
    """The indexes std::partial_sort(first, first + k, last, a.score > b.score) leaves in [0, k), in
    libstdc++'s steps (make_heap of the first k, every later item beating the heap's top replaces it,
    then sort_heap): equal scores come in that heap order."""
    items = list(range(len(scores)))

    def before(a, b):          # the comparator: a goes before b
        return scores[a] > scores[b]

    def push(hole, top, value):
        parent = (hole - 1) // 2
        while hole > top and before(items[parent], value):
            items[hole] = items[parent]
            hole, parent = parent, (parent - 1) // 2
        items[hole] = value

    def adjust(hole, length, value):
        top, child = hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if before(items[child], items[child - 1]):
                child -= 1
            items[hole] = items[child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            items[hole] = items[child - 1]
            hole = child - 1
        push(hole, top, value)

    def pop(length, result):   # the heap [0, length)'s top goes to `result`, whose item re-enters
        value = items[result]
        items[result] = items[0]
        adjust(0, length, value)

    if k >= 2:
        for parent in range((k - 2) // 2, -1, -1):
            adjust(parent, k, items[parent])
    for i in range(k, len(items)):
        if before(items[i], items[0]):
            pop(k, i)
    for last in range(k - 1, 0, -1):
        pop(last, last)
    return items[:k]


def f32_max(a, b):
    """std::max(a, b) on float32: b only when a < b (a NaN `b` is never taken)."""
    return torch.where(a < b, b, a)


def f32_min(a, b):
    """std::min(a, b): b only when b < a."""
    return torch.where(b < a, b, a)


def mscnn_box_iou(a, b, mode: str):
    """MS-CNN's BoxIOU of box a (x, y, w, h) with each row of b, float32."""
    tlx, tly = f32_max(a[0], b[:, 0]), f32_max(a[1], b[:, 1])
    brx, bry = f32_min(a[0] + a[2], b[:, 0] + b[:, 2]), f32_min(a[1] + a[3], b[:, 1] + b[:, 3])
    over = torch.where((tlx >= brx) | (tly >= bry), torch.zeros_like(tlx), (brx - tlx) * (bry - tly))
    area_a, area_b = a[2] * a[3], b[:, 2] * b[:, 3]
    if mode == "IOMU":
        union = f32_min(area_a.expand_as(area_b), area_b)
    elif mode == "IOFU":
        union = area_a.expand_as(area_b)
    else:
        union = area_a + area_b - over
    iou = over / union
    invalid = (a[2] <= 0) | (a[3] <= 0) | (b[:, 2] <= 0) | (b[:, 3] <= 0)
    return torch.where(invalid, torch.zeros_like(iou), iou)


def jaccard_overlap(a, b, mode: str):
    """Cascade R-CNN's JaccardOverlap of box a (x1, y1, x2, y2, inclusive pixels) with each row of b."""
    ixmin, iymin = f32_max(a[0], b[:, 0]), f32_max(a[1], b[:, 1])
    ixmax, iymax = f32_min(a[2], b[:, 2]), f32_min(a[3], b[:, 3])
    inter = (ixmax - ixmin + 1) * (iymax - iymin + 1)
    inter = torch.where((ixmin > ixmax) | (iymin >= iymax), torch.zeros_like(inter), inter)
    area_a = (a[2] - a[0] + 1) * (a[3] - a[1] + 1)
    area_b = (b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)
    if mode == "IOMU":
        union = f32_min(area_a.expand_as(area_b), area_b)
    elif mode == "IOFU":
        union = area_a.expand_as(area_b)
    else:
        union = area_a + area_b - inter
    iou = torch.where(union <= 0, torch.zeros_like(inter), inter / union)
    invalid = (a[2] < a[0]) | (a[3] < a[1]) | (b[:, 2] < b[:, 0]) | (b[:, 3] < b[:, 1])
    return torch.where(invalid, torch.zeros_like(iou), iou)


def decode_receptive_field(d, means, stds, xy_bound: float, wh_bounds, field_w, field_h, cols, rows, stride):
    """Deltas (4, K) float32 decoded against receptive fields (field_w, field_h: (K,)) centred at
    (col + 0.5) * stride: the clamped, de-normalized deltas -> x, y (top left), w, h."""
    f32 = torch.float32
    d = d.to(f32)
    if stds is not None:
        d = d * torch.tensor(stds, dtype=f32)[:, None] + torch.tensor(means, dtype=f32)[:, None]
    lo, hi = torch.tensor(-1.0, dtype=f32) / xy_bound, torch.tensor(1.0, dtype=f32) / xy_bound
    wh_lo, wh_hi = torch.tensor(wh_bounds[0], dtype=f32), torch.tensor(wh_bounds[1], dtype=f32)
    x, y = f32_min(hi, f32_max(lo, d[0])), f32_min(hi, f32_max(lo, d[1]))
    w, h = f32_min(wh_hi, f32_max(wh_lo, d[2])), f32_min(wh_hi, f32_max(wh_lo, d[3]))
    stride = torch.tensor(stride, dtype=f32)
    x = x * field_w + (cols.to(f32) + 0.5) * stride
    y = y * field_h + (rows.to(f32) + 0.5) * stride
    # `field_w * exp(w)` as the forks' GCC 4/5 builds compile it: exp of float is the C library's double
    # exp (math.exp here), the product in double, rounded once to float32
    def libm_exp(v):
        return torch.tensor([math.exp(e) for e in v.double().tolist()], dtype=torch.float64)
    w = (field_w.double() * libm_exp(w)).to(f32)
    h = (field_h.double() * libm_exp(h)).to(f32)
    return x - w / 2, y - h / 2, w, h


def mscnn_box_output(bottoms, settings: dict):
    """MS-CNN's BoxOutput forward: bottoms [(N, classes + 4, H, W)] -> (rois (R, 5, 1, 1), with score
    (R, 6, 1, 1))."""
    s = settings
    f32 = torch.float32
    rows_out = []
    for i in range(bottoms[0].shape[0]):
        boxes, scores = [], []
        for j, x in enumerate(bottoms):
            x = x[i].to(f32).cpu()
            c, height, width = x.shape
            classes = c - 4
            fg = torch.full((height, width), -3.4028234663852886e38, dtype=f32)
            for k in range(1, classes):
                fg = f32_max(fg, x[k])
            fg = (fg - x[0]).flatten()
            cells = torch.nonzero(fg >= torch.tensor(s["fg_thr"], dtype=f32)).flatten()
            rate = s["rates"][j]
            field_w = torch.tensor(s["field_w"][j], dtype=f32).expand(cells.shape[0])
            field_h = torch.tensor(s["field_h"][j], dtype=f32).expand(cells.shape[0])
            bx, by, bw, bh = decode_receptive_field(
                x[classes:].reshape(4, -1)[:, cells], s["means"], s["stds"], s["field_xyr"], s["wh_bounds"],
                field_w, field_h, cells % width, cells // width, rate)
            bx, by = f32_max(bx, torch.zeros_like(bx)), f32_max(by, torch.zeros_like(by))   # NaN stays
            # int(width * rate): the float32 product, truncated
            img_w = torch.tensor(float(int(torch.tensor(float(width)) * torch.tensor(rate))), dtype=f32)
            img_h = torch.tensor(float(int(torch.tensor(float(height)) * torch.tensor(rate))), dtype=f32)
            bw, bh = f32_min(bw, img_w - bx), f32_min(bh, img_h - by)
            min_size = torch.tensor(s["min_size"], dtype=f32)
            keep = (bw >= min_size) & (bh >= min_size)
            boxes.append(torch.stack([bx, by, bw, bh], dim=1)[keep])
            scores.append(fg[cells][keep])
        boxes, scores = torch.cat(boxes), torch.cat(scores)
        if boxes.shape[0] == 0:
            continue
        # std::greater on (score, index) pairs: higher score first, then the higher index
        values = scores.tolist()
        order = sorted(range(len(values)), key=lambda t: (values[t], t), reverse=True)
        if s["max_nms_num"] > 0:
            order = order[:s["max_nms_num"]]
        order = torch.tensor(order, dtype=torch.long)
        boxes, scores = boxes[order], scores[order]
        kept = torch.tensor(greedy_nms(boxes.shape[0], lambda t: mscnn_box_iou(boxes[t], boxes[t + 1:], s["nms_type"]),
                                       s["iou_thr"], s["max_post_nms_num"]), dtype=torch.long)
        b = boxes[kept]
        rows_out.append(torch.stack([torch.full_like(b[:, 0], float(i)), b[:, 0], b[:, 1], b[:, 0] + b[:, 2],
                                     b[:, 1] + b[:, 3], scores[kept]], dim=1))
    return proposal_tops(rows_out, bottoms[0].device)


def proposal_tops(rows, device):
    """The forks' two tops from the per-image rows (R, 6): rois and rois with score, (R, 5 or 6, 1, 1);
    with no row at all, [0, 1, 1, 10, 10] and a zero row."""
    if not rows or sum(r.shape[0] for r in rows) == 0:
        return (torch.tensor([[0.0, 1.0, 1.0, 10.0, 10.0]], device=device).reshape(1, 5, 1, 1),
                torch.zeros(1, 6, 1, 1, device=device))
    out = torch.cat(rows).to(device)
    return out[:, :5].reshape(-1, 5, 1, 1).contiguous(), out.reshape(-1, 6, 1, 1)


def cascade_box_group_output(bottoms, settings: dict):
    """Cascade R-CNN's BoxGroupOutput forward: bottoms [scores (N * G, C, H, W), deltas (N * G, 4, H, W),
    ...] -> (rois (R, 5, 1, 1), with score (R, 6, 1, 1))."""
    s = settings
    f32 = torch.float32
    groups = [len(g[0]) for g in s["groups"]]
    rows_out = []
    for i in range(bottoms[0].shape[0] // groups[0]):
        boxes, scores = [], []
        for j, (field_ws, field_hs, stride) in enumerate(s["groups"]):
            prob, delta = bottoms[2 * j].to(f32).cpu(), bottoms[2 * j + 1].to(f32).cpu()
            height, width = prob.shape[2], prob.shape[3]
            for k in range(groups[j]):
                g = i * groups[j] + k
                fg = (1 - prob[g, 0]).flatten()
                cells = torch.nonzero(fg >= torch.tensor(s["fg_thr"], dtype=f32)).flatten()
                fw = torch.tensor(float(field_ws[k]), dtype=f32).expand(cells.shape[0])
                fh = torch.tensor(float(field_hs[k]), dtype=f32).expand(cells.shape[0])
                x, y, w, h = decode_receptive_field(delta[g].reshape(4, -1)[:, cells], s["means"], s["stds"],
                                                    s["field_xyr"], s["wh_bounds"], fw, fh, cells % width,
                                                    cells // width, stride)
                x2, y2 = x + w - 1, y + h - 1
                img_w = torch.tensor(float(width * stride), dtype=f32)
                img_h = torch.tensor(float(height * stride), dtype=f32)
                zero = torch.zeros_like(x)
                box = torch.stack([f32_max(zero, x), f32_max(zero, y), f32_min(img_w, x2), f32_min(img_h, y2)], 1)
                min_size = torch.tensor(s["min_size"], dtype=f32)
                keep = ((box[:, 2] - box[:, 0] + 1) >= min_size) & ((box[:, 3] - box[:, 1] + 1) >= min_size)
                boxes.append(box[keep])
                scores.append(fg[cells][keep])
        boxes, scores = torch.cat(boxes), torch.cat(scores)
        if boxes.shape[0] == 0:
            continue
        k = boxes.shape[0]
        if 0 < s["max_nms_num"] < k:
            k = s["max_nms_num"]
        order = torch.tensor(std_partial_sort_order(scores.tolist(), k), dtype=torch.long)
        boxes, scores = boxes[order], scores[order]
        kept = torch.tensor(greedy_nms(boxes.shape[0], lambda t: jaccard_overlap(boxes[t], boxes[t + 1:], s["nms_type"]),
                                       s["iou_thr"], s["max_post_nms_num"]), dtype=torch.long)
        b = boxes[kept]
        rows_out.append(torch.cat([torch.full_like(b[:, :1], float(i)), b, scores[kept][:, None]], dim=1))
    return proposal_tops(rows_out, bottoms[0].device)


TORCH_COMMON = (f32_max, f32_min, greedy_nms, decode_receptive_field, proposal_tops)
TORCH_BOX_OUTPUT = torch_sources(*TORCH_COMMON, mscnn_box_iou, mscnn_box_output)
TORCH_BOX_GROUP_OUTPUT = torch_sources(*TORCH_COMMON, std_partial_sort_order, jaccard_overlap,
                                       cascade_box_group_output)


class _ProposalOutput(Layer):
    """What BoxOutput and BoxGroupOutput share: their tops, settings and the way they run."""

    data_dependent_shape = True   # (1, 5) as the forks' Reshape gives, until a run
    onnx_refusal = ("its proposals (a score threshold, a sort and greedy NMS, a data-dependent number of rois) "
                    "have no ONNX form here; export the net up to its score and bbox blobs with --outputs")
    torch_function = None
    torch_sources = None
    reading_note = ("the proposals run as the fork's CPU forward built with GCC 4 or 5 (double exp); a GCC 6 or "
                    "later build, or Cascade R-CNN's GPU forward, may place a box corner an ulp away")

    def _common(self, lp, p, kind):
        if len(lp.top) not in (1, 2):
            raise LayerError(f"{kind} has 1 or 2 tops (rois, rois with score), got {len(lp.top)}")
        # MS-CNN's BoxOutput does not check bbox_std > 0; Cascade R-CNN's BoxGroupOutput does
        means, stds = bbox_reg_normalization(lp, kind, positive_std=kind == "BoxGroupOutput")
        given = len(lp.bbox_reg_param.bbox_mean) > 0
        field_whr, field_xyr = float(np.float32(p.field_whr)), float(np.float32(p.field_xyr))
        if not field_whr > 0 or not field_xyr > 0:
            raise LayerError(f"{kind}: field_whr and field_xyr must be > 0, got {field_whr} and {field_xyr}")
        whr = np.float32(field_whr)
        nms_type = p.nms_type
        return {"kind": kind, "name": lp.name, "tops": len(lp.top),
                "settings": {"fg_thr": float(np.float32(p.fg_thr)), "iou_thr": float(np.float32(p.iou_thr)),
                             "nms_type": nms_type, "field_xyr": field_xyr,
                             # logf(1.f / whr) and logf(whr), correctly rounded
                             "wh_bounds": [float(np.float32(math.log(float(np.float32(1) / whr)))),
                                           float(np.float32(math.log(float(whr))))],
                             "max_nms_num": int(p.max_nms_num), "max_post_nms_num": int(p.max_post_nms_num),
                             "min_size": float(np.float32(p.min_size)),
                             "means": means if given else None, "stds": stds if given else None}}

    def infer(self, attrs, in_shapes):
        return [(1, 5, 1, 1), (1, 6, 1, 1)][:attrs["tops"]]

    def forward(self, attrs, params, *bottoms):
        tops = type(self).torch_function(list(bottoms), attrs["settings"])
        return tops[:attrs["tops"]] if attrs["tops"] > 1 else tops[0]

    def pytorch_source(self, node, emit):
        fn = emit.helper(self.torch_sources)
        settings = "{" + ", ".join(f"{k!r}: {emit.lit(v)}" for k, v in node.attrs["settings"].items()) + "}"
        call = f"{fn}([{', '.join(emit.inputs)}], {settings})"
        if node.attrs["tops"] == 1:
            return f"{call}[0]"
        both = emit.tmp("proposals")
        emit.stmt(f"{both} = {call}")
        return [f"{both}[0]", f"{both}[1]"]


@register_layer("BoxGroupOutput")
class BoxGroupOutput(_ProposalOutput):
    torch_function = staticmethod(cascade_box_group_output)
    torch_sources = TORCH_BOX_GROUP_OUTPUT

    def parse(self, lp):
        p = lp.box_group_output_param
        attrs = self._common(lp, p, "BoxGroupOutput")
        if len(lp.bottom) < 2 or len(lp.bottom) % 2:
            raise LayerError(f"BoxGroupOutput takes (score, bbox) bottom pairs, got {len(lp.bottom)} bottoms")
        if len(p.box_group_param) != len(lp.bottom) // 2:
            raise LayerError(f"box_group_output_param needs one box_group_param per (score, bbox) pair: "
                             f"{len(lp.bottom) // 2} pairs, {len(p.box_group_param)} box_group_param")
        groups = []
        for i, g in enumerate(p.box_group_param):
            if len(g.field_h) != len(g.field_w) or not len(g.field_h):
                raise LayerError(f"box_group_output_param.box_group_param[{i}] needs as many field_h as field_w "
                                 f"(at least one), got {len(g.field_h)} and {len(g.field_w)}")
            groups.append([list(g.field_w), list(g.field_h), int(g.stride)])
        attrs["settings"]["groups"] = groups
        return attrs

    def infer(self, attrs, in_shapes):
        sizes = [len(g[0]) for g in attrs["settings"]["groups"]]
        first = in_shapes[0]
        for i, n_groups in enumerate(sizes):
            score, bbox = in_shapes[2 * i], in_shapes[2 * i + 1]
            if len(score) != 4 or len(bbox) != 4:
                raise LayerError(f"BoxGroupOutput: bottoms {2 * i} and {2 * i + 1} must be 4-axis, "
                                 f"got {list(score)} and {list(bbox)}")
            if score[0] % n_groups or score[0] // n_groups != first[0] // sizes[0]:
                raise LayerError(f"BoxGroupOutput: bottom {2 * i} has {score[0]} rows, not {n_groups} groups "
                                 f"per image of the other pairs")
            if score[1] != first[1]:
                raise LayerError(f"BoxGroupOutput: every score bottom needs {first[1]} channels, "
                                 f"bottom {2 * i} has {score[1]}")
            if bbox[1] != 4 or bbox[0] != score[0] or tuple(bbox[2:]) != tuple(score[2:]):
                raise LayerError(f"BoxGroupOutput: bbox bottom {2 * i + 1} must be ({score[0]}, 4, {score[2]}, "
                                 f"{score[3]}) to match its scores, got {list(bbox)}")
        return super().infer(attrs, in_shapes)


@register_layer("BoxOutput")
class BoxOutput(_ProposalOutput):
    torch_function = staticmethod(mscnn_box_output)
    torch_sources = TORCH_BOX_OUTPUT

    def parse(self, lp):
        p = lp.box_output_param
        attrs = self._common(lp, p, "BoxOutput")
        n = len(lp.bottom)
        if not n or not (len(p.field_h) == len(p.field_w) == len(p.downsample_rate) == n):
            raise LayerError(f"box_output_param needs one field_h, field_w and downsample_rate per bottom: "
                             f"{n} bottoms, got {len(p.field_h)}, {len(p.field_w)} and {len(p.downsample_rate)}")
        attrs["settings"].update(field_w=[float(np.float32(v)) for v in p.field_w],
                                 field_h=[float(np.float32(v)) for v in p.field_h],
                                 rates=[float(np.float32(v)) for v in p.downsample_rate])
        return attrs

    def infer(self, attrs, in_shapes):
        first = in_shapes[0]
        for i, s in enumerate(in_shapes):
            if len(s) != 4 or s[1] < 5 or s[0] != first[0] or s[1] != first[1]:
                raise LayerError(f"BoxOutput: every bottom is (N, classes + 4, H, W) with bottom 0's N and "
                                 f"channels, bottom {i} is {list(s)} (bottom 0 {list(first)})")
        return super().infer(attrs, in_shapes)


__all__ = ["BoxGroupOutput", "BoxOutput", "std_partial_sort_order"]
