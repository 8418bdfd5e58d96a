"""unsky/FPN's Python layers (Feature Pyramid Networks on py-faster-rcnn), natively.

caffeq never imports the module a `Python` layer names (see registry.spec_for); these specs
compute what unsky/FPN a096edb's lib/rpn modules compute at TEST time.

- `rpn.proposal_layer.ProposalLayer` with 11 bottoms: FPN's own proposal layer under
  py-faster-rcnn's module and class name (rcnn.PythonProposalLayer hands such layers here).
  Bottoms: im_info (1, 3), rpn_bbox_pred for each level (1, 4A, H, W), then the
  rpn_cls_prob_reshape for each level (1, 2A, H, W), levels in the order of param_str's
  'feat_stride' ("'feat_stride': 4,8,16,32,64": YAML reads it as the string "4,8,16,32,64").
  Per level, of stride s: anchors generate_anchors(base_size=s, ratios 0.5, 1, 2, scales
  cfg.FPNRSCALES = 16, 32), A = 6, on an int(im_height / s) x int(im_width / s) grid (the
  maps are cropped to it; a grid larger than the map fails in the module, here a clear
  error); decode, clip to the image, drop boxes under min_size 16 * im_scale as
  py-faster-rcnn.  All levels' boxes then go together: sort by score, keep cfg.TEST
  RPN_PRE_NMS_TOP_N 6000, greedy NMS at 0.7, keep RPN_POST_NMS_TOP_N 1000.  When fewer
  than 1000 are kept the module pads with npr.choice(keep), i.e. random repeats of kept
  rows; caffeq repeats the kept rows in order (keep[i % n]) so that runs are repeatable:
  the same boxes, other duplicates.  With nothing kept the module fails (npr.choice of an
  empty list); here the top has no rows.  Top: rpn_rois (1000, 5) = [0, x1, y1, x2, y2].
  A fork's proposal_layer.py with its own cfg.FPNRATIOS / FPNRSCALES (xraydetec/Xdet 1119bbe: five
  ratios, one scale) scores another number of anchors; its setup looks at no bottom, so the net
  loads in Caffe: caffeq reads it and refuses to run or export it (cannot_run).
- `rpn.as_rois.As_roisLayer`: assigns each roi to a pyramid level
  k = floor(4 + log2(sqrt(w * h) / 224)) clamped to [2, 5], w = x2 - x1 and h = y2 - y1
  (no +1), w * h <= 0 read as 1e-6, in the rois' dtype (float32).  B = cfg.TEST
  .RPN_POST_NMS_TOP_N = 1000.  Tops: rois (4B, 5) and rois/h2 .. rois/h5 (B, 5) each: level
  k's rois, in their input order, then zero rows; rois is the four blocks stacked.  A level
  with more than B rois would overrun its block in the module: refused here.
- `rpn.as_rois_mrcnn.As_rois_MergeRcnnLayer`: the same levels; each level top holds just its
  rois, or 4 zero rows when it has none; rois is the four stacked.  Row counts depend on the
  data (infer gives the most rows: max(R, 4) per level, four times that for rois).

ONNX: As_rois and As_rois_MergeRcnn from standard ops (the levels by comparing the area with the
float32 steps of the log2 pipeline, found once by a binary search; NonZero, Gather, Pad).  FPN's
proposals are refused (their NMS and row repeats could be written, not done yet).
"""
import math
import re

import numpy as np
import torch
from torch import nn

from ..errors import CaffeqError, ExportError
from .rcnn import (
    TORCH_ANCHORS,
    TORCH_PROPOSAL,
    generate_anchors,
    parse_param_str,
    rpn_decode_boxes,
    rpn_nms,
    shifted_anchors,
)
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources

# unsky/FPN lib/fast_rcnn/config.py
FPN_CONFIG = {"pre_nms_top_n": 6000, "post_nms_top_n": 1000, "nms_thresh": 0.7, "min_size": 16}
FPN_RATIOS = (0.5, 1.0, 2.0)     # __C.FPNRATIOS
FPN_SCALES = (16.0, 32.0)        # __C.FPNRSCALES = 2 ** np.arange(4, 6)
LEVEL_BATCH = 1000               # As_rois*: self._batch_rois = cfg.TEST.RPN_POST_NMS_TOP_N
K0, CANONICAL_SIZE, MIN_LEVEL, MAX_LEVEL = 4, 224, 2, 5
EMPTY_LEVEL_ROWS = 4             # As_rois_MergeRcnnLayer: np.zeros((1 * 4, 5)) for an empty level


# ---- torch (also copied into model.py) ------------------------------------------------------

def fpn_level_boxes(cls_prob, bbox_pred, info, anchors, stride: int, min_size: float):
    """One pyramid level of FPN's ProposalLayer: the maps cropped to the image's grid, boxes
    decoded, clipped and filtered.  Returns boxes (P, 4) and scores (P,), rows ordered (h, w, a)."""
    n_anchors = anchors.shape[0]
    height, width = int(float(info[0]) / stride), int(float(info[1]) / stride)
    if height > cls_prob.shape[2] or width > cls_prob.shape[3]:
        raise ValueError(f"im_info's {float(info[0])} x {float(info[1])} image needs a {height} x {width} map at "
                         f"stride {stride}, larger than the given {cls_prob.shape[2]} x {cls_prob.shape[3]}")
    dt = bbox_pred.dtype
    scores = cls_prob[0, n_anchors:, :height, :width].permute(1, 2, 0).reshape(-1)
    deltas = bbox_pred[0, :, :height, :width].permute(1, 2, 0).reshape(-1, 4)
    boxes = shifted_anchors(anchors.to(bbox_pred.device), height, width, stride).to(dt)
    boxes, keep = rpn_decode_boxes(boxes, deltas, info, min_size)
    return boxes[keep], scores[keep]


def fpn_proposals(im_info, bbox_preds, cls_probs, anchors_per_level, strides, pre_nms_top_n: int,
                  post_nms_top_n: int, nms_thresh: float, min_size: float):
    """FPN's ProposalLayer.forward: every level's boxes pooled, sorted best first (ties: higher index
    first), pre_nms_top_n kept, NMS, post_nms_top_n kept and, when fewer, the kept rows repeated in
    order up to post_nms_top_n.  Returns rois (R, 5) = [0, x1, y1, x2, y2]."""
    if bbox_preds[0].shape[0] != 1:
        raise ValueError(f"region proposals take one image per batch, got {bbox_preds[0].shape[0]}")
    info = im_info.reshape(-1).to(bbox_preds[0].dtype)
    boxes, scores = [], []
    for prob, deltas, anchors, stride in zip(cls_probs, bbox_preds, anchors_per_level, strides):
        b, s = fpn_level_boxes(prob, deltas, info, anchors, stride, min_size)
        boxes.append(b)
        scores.append(s)
    proposals, scores = torch.cat(boxes), torch.cat(scores)
    order = torch.sort(scores, stable=True)[1].flip(0)
    if pre_nms_top_n > 0:
        order = order[:pre_nms_top_n]
    proposals = proposals[order]
    kept = rpn_nms(proposals.detach().float().cpu(), nms_thresh, post_nms_top_n)
    if 0 < len(kept) < post_nms_top_n:
        kept = [kept[i % len(kept)] for i in range(post_nms_top_n)]
    proposals = proposals[torch.tensor(kept, dtype=torch.long, device=proposals.device)]
    return torch.cat([torch.zeros_like(proposals[:, :1]), proposals], dim=1)


class FPNProposal(nn.Module):
    """FPN's multi-level region proposals (fpn_proposals); inputs: im_info, the levels' bbox_pred,
    then the levels' cls_prob."""

    def __init__(self, anchors_per_level, strides, pre_nms_top_n=6000, post_nms_top_n=1000, nms_thresh=0.7,
                 min_size=16.0):
        super().__init__()
        self.anchors_per_level, self.strides = anchors_per_level, strides
        self.pre_nms_top_n, self.post_nms_top_n = pre_nms_top_n, post_nms_top_n
        self.nms_thresh, self.min_size = nms_thresh, min_size

    def forward(self, im_info, *maps):
        levels = len(self.strides)
        anchors = [torch.tensor(a, dtype=torch.float64) for a in self.anchors_per_level]
        return fpn_proposals(im_info, maps[:levels], maps[levels:], anchors, self.strides, self.pre_nms_top_n,
                             self.post_nms_top_n, self.nms_thresh, self.min_size)


def fpn_roi_levels(rois):
    """Each roi's pyramid level, as unsky/FPN's As_rois layers: floor(4 + log2(sqrt(w * h) / 224))
    clamped to [2, 5], in the rois' dtype; w * h <= 0 counts as 1e-6."""
    area = (rois[:, 3] - rois[:, 1]) * (rois[:, 4] - rois[:, 2])
    area = torch.where(area <= 0, torch.full_like(area, 1e-6), area)
    level = torch.floor(4 + torch.log2(torch.sqrt(area) / 224))
    return torch.clamp(level, 2, 5).to(torch.long)


def fpn_assign_rois(rois, level_rows: int):
    """As_roisLayer: per level 2..5 a (level_rows, 5) block of its rois in input order, then zeros.
    Returns [all four blocks stacked, level 2, level 3, level 4, level 5]."""
    levels = fpn_roi_levels(rois)
    blocks = []
    for k in range(2, 6):
        picked = rois[levels == k]
        if picked.shape[0] > level_rows:
            raise ValueError(f"{picked.shape[0]} rois fall on pyramid level {k}; As_roisLayer holds at most "
                             f"{level_rows} per level")
        block = torch.zeros((level_rows, rois.shape[1]), dtype=rois.dtype, device=rois.device)
        block[:picked.shape[0]] = picked
        blocks.append(block)
    return [torch.cat(blocks)] + blocks


def fpn_assign_rois_merged(rois, empty_rows: int = 4):
    """As_rois_MergeRcnnLayer: per level 2..5 its rois in input order, or empty_rows zero rows when
    it has none.  Returns [the four stacked, level 2, level 3, level 4, level 5]."""
    levels = fpn_roi_levels(rois)
    blocks = []
    for k in range(2, 6):
        picked = rois[levels == k]
        if picked.shape[0] == 0:
            picked = torch.zeros((empty_rows, rois.shape[1]), dtype=rois.dtype, device=rois.device)
        blocks.append(picked)
    return [torch.cat(blocks)] + blocks


def level_area_thresholds():
    """The smallest float32 areas w * h that fpn_roi_levels puts on levels 3, 4 and 5.  The level is a
    non-decreasing function of the area, so a binary search over the positive float32 bit patterns
    finds each step; comparing the area with these gives the very levels of the float32 log2
    pipeline (ONNX has no log2, and Log / Log(2) rounds otherwise near the steps)."""
    def level_of(bits):
        area = torch.tensor(np.array([bits], np.int32).view(np.float32))
        rois = torch.zeros((1, 5))
        rois[0, 3], rois[0, 4] = area, 1.0
        return int(fpn_roi_levels(rois)[0])

    out = []
    for k in (3, 4, 5):
        lo, hi = 1, 0x7F7FFFFF          # level_of(lo) < k <= level_of(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if level_of(mid) >= k else (mid, hi)
        out.append(float(np.array([hi], np.int32).view(np.float32)[0]))
    return out


def emit_assign_rois(ctx, node, merged):
    """As_rois / As_rois_MergeRcnn from standard ops: the levels by comparing the area with
    level_area_thresholds(), each level's rows by NonZero + Gather, zero rows by Pad."""
    rois = node.inputs[0]
    col = lambda k: ctx.op("Gather", [rois, ctx.i64(k)], f"c{k}", axis=1)
    area = ctx.op("Mul", [ctx.op("Sub", [col(3), col(1)], "w"), ctx.op("Sub", [col(4), col(2)], "h")], "area")
    at_least = [ctx.op("GreaterOrEqual", [area, ctx.const(np.array(t, np.float32))], f"ge{k}")
                for k, t in zip((3, 4, 5), level_area_thresholds())]
    masks = [ctx.op("Not", [at_least[0]], "l2"),
             ctx.op("And", [at_least[0], ctx.op("Not", [at_least[1]], "n4")], "l3"),
             ctx.op("And", [at_least[1], ctx.op("Not", [at_least[2]], "n5")], "l4"),
             at_least[2]]
    blocks = []
    for k, mask in zip(range(2, 6), masks):
        idx = ctx.op("Reshape", [ctx.op("NonZero", [mask], f"nz{k}"), ctx.i64([-1])], f"idx{k}")
        picked = ctx.op("Gather", [rois, idx], f"rows{k}", axis=0)
        count = ctx.op("Shape", [idx], f"n{k}")
        if merged:   # 4 zero rows when the level is empty
            extra = ctx.op("Mul", [ctx.op("Cast", [ctx.op("Equal", [count, ctx.i64([0])], f"empty{k}")], f"e{k}",
                                          to=7), ctx.i64([EMPTY_LEVEL_ROWS])], f"extra{k}")
        else:        # zero rows up to level_rows
            extra = ctx.op("Sub", [ctx.i64([node.attrs["level_rows"]]), count], f"extra{k}")
        pads = ctx.op("Concat", [ctx.i64([0, 0]), extra, ctx.i64([0])], f"pads{k}", axis=0)
        blocks.append(ctx.add_node("Pad", [picked, pads, ctx.const(np.array(0, np.float32))],
                                   [node.outputs[k - 1]], mode="constant")[0])
    ctx.add_node("Concat", blocks, [node.outputs[0]], axis=0)


def emit_fpn_proposals(ctx, node):
    """fpn_proposals from standard ops.  Every level's anchors cover its whole static map; boxes on
    cells outside the image's grid (int(im_info / stride)) or under the size limit score -inf, so
    TopK puts them last and NonMaxSuppression's score threshold leaves them out, which keeps the
    kept boxes' order.  The map-smaller-than-grid error of the torch form has no ONNX counterpart."""
    a = node.attrs
    name = node.name
    info = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "info")
    im_h, im_w, im_scale = (ctx.op("Gather", [info, ctx.i64(k)], h, axis=0)
                            for k, h in ((0, "im_h"), (1, "im_w"), (2, "sc")))
    x_max, y_max = ctx.op("Sub", [im_w, ctx.f32(1.0)], "x_max"), ctx.op("Sub", [im_h, ctx.f32(1.0)], "y_max")
    limit = ctx.op("Mul", [ctx.f32(float(a["min_size"])), im_scale], "limit")
    level_boxes, level_scores, total = [], [], 0

    def clip(v, top, hint):
        return ctx.op("Max", [ctx.op("Min", [v, top], hint + "_min"), ctx.f32(0.0)], hint)

    for level, stride, anchors in zip(a["levels"], a["strides"], a["anchors"]):
        deltas_in, prob_in = node.inputs[1 + level], node.inputs[6 + level]
        _, _, height, width = ctx.shape(prob_in)
        n_anchors = len(anchors)
        total += height * width * n_anchors
        boxes = shifted_anchors(torch.tensor(anchors, dtype=torch.float64), height, width,
                                stride).numpy().astype(np.float32)
        widths = boxes[:, 2] - boxes[:, 0] + np.float32(1.0)
        heights = boxes[:, 3] - boxes[:, 1] + np.float32(1.0)
        ctr_x, ctr_y = boxes[:, 0] + np.float32(0.5) * widths, boxes[:, 1] + np.float32(0.5) * heights
        cell_y = np.repeat(np.arange(height), width * n_anchors).astype(np.float32)
        cell_x = np.tile(np.repeat(np.arange(width), n_anchors), height).astype(np.float32)
        t = f"s{stride}"
        scores = ctx.op("Slice", [prob_in, ctx.i64([n_anchors]), ctx.i64([2 * n_anchors]), ctx.i64([1])], t + "fg")
        scores = ctx.op("Reshape", [ctx.op("Transpose", [scores], t + "fg_t", perm=[0, 2, 3, 1]), ctx.i64([-1])],
                        t + "sc")
        deltas = ctx.op("Reshape", [ctx.op("Transpose", [deltas_in], t + "d_t", perm=[0, 2, 3, 1]), ctx.i64([-1, 4])],
                        t + "d")
        def col(k, h, deltas=deltas, t=t):
            return ctx.op("Gather", [deltas, ctx.i64(k)], t + h, axis=1)

        px = ctx.op("Add", [ctx.op("Mul", [col(0, "dx"), ctx.f32(widths)], t + "mx"), ctx.f32(ctr_x)], t + "px")
        py = ctx.op("Add", [ctx.op("Mul", [col(1, "dy"), ctx.f32(heights)], t + "my"), ctx.f32(ctr_y)], t + "py")
        hw = ctx.op("Mul", [ctx.f32(0.5), ctx.op("Mul", [ctx.op("Exp", [col(2, "dw")], t + "ew"), ctx.f32(widths)],
                                                 t + "pw")], t + "hw")
        hh = ctx.op("Mul", [ctx.f32(0.5), ctx.op("Mul", [ctx.op("Exp", [col(3, "dh")], t + "eh"), ctx.f32(heights)],
                                                 t + "ph")], t + "hh")

        x1 = clip(ctx.op("Sub", [px, hw], t + "x1r"), x_max, t + "x1")
        y1 = clip(ctx.op("Sub", [py, hh], t + "y1r"), y_max, t + "y1")
        x2 = clip(ctx.op("Add", [px, hw], t + "x2r"), x_max, t + "x2")
        y2 = clip(ctx.op("Add", [py, hh], t + "y2r"), y_max, t + "y2")
        ws = ctx.op("Add", [ctx.op("Sub", [x2, x1], t + "ws0"), ctx.f32(1.0)], t + "ws")
        hs = ctx.op("Add", [ctx.op("Sub", [y2, y1], t + "hs0"), ctx.f32(1.0)], t + "hs")
        grid_h = ctx.op("Floor", [ctx.op("Div", [im_h, ctx.f32(float(stride))], t + "gh0")], t + "gh")
        grid_w = ctx.op("Floor", [ctx.op("Div", [im_w, ctx.f32(float(stride))], t + "gw0")], t + "gw")
        inside = ctx.op("And", [ctx.op("Less", [ctx.f32(cell_y), grid_h], t + "in_y"),
                                ctx.op("Less", [ctx.f32(cell_x), grid_w], t + "in_x")], t + "inside")
        big = ctx.op("And", [ctx.op("GreaterOrEqual", [ws, limit], t + "wide"),
                             ctx.op("GreaterOrEqual", [hs, limit], t + "high")], t + "big")
        level_scores.append(ctx.op("Where", [ctx.op("And", [inside, big], t + "live"), scores, ctx.f32(-np.inf)],
                                   t + "score"))
        level_boxes.append(ctx.op("Concat", [ctx.op("Unsqueeze", [v, ctx.i64([1])], t + h) for v, h in
                                             ((x1, "c1"), (y1, "c2"), (x2, "c3"), (y2, "c4"))], t + "corners", axis=1))
    scores = ctx.op("Concat", level_scores, "scores", axis=0)
    corners = ctx.op("Concat", level_boxes, "corners", axis=0)
    k = total if a["pre_nms_top_n"] <= 0 else min(a["pre_nms_top_n"], total)
    vals, idx = ctx.top_k_later_first(scores, k, "top")   # the torch sort: ties, higher index first
    cand = ctx.op("Gather", [corners, idx], "cand", axis=0)
    # ONNX's IoU has no +1: give it [y1, x1, y2 + 1, x2 + 1]
    nms_boxes = ctx.op("Gather", [ctx.op("Add", [cand, ctx.f32([0, 0, 1, 1])], "cand1"), ctx.i64([1, 0, 3, 2])], "yx",
                       axis=1)
    post = a["post_nms_top_n"]
    max_out = k if post <= 0 else min(post, k)
    sel = ctx.add_node("NonMaxSuppression",
                       [ctx.op("Unsqueeze", [nms_boxes, ctx.i64([0])], "nms_b"),
                        ctx.op("Reshape", [vals, ctx.i64([1, 1, -1])], "nms_s"),
                        ctx.i64([max_out]), ctx.f32([ctx.nms_threshold(a["nms_thresh"])]), ctx.f32([-np.finfo(np.float32).max])],
                       [ctx.tmp(f"{name}_sel")], name=name)[0]
    picked = ctx.op("Gather", [sel, ctx.i64(2)], "picked", axis=1)
    if post > 0:   # the kept rows repeated in order up to post (none kept: no rows)
        kept = ctx.op("Shape", [picked], "kept")
        rows = ctx.op("Min", [ctx.i64([post]), ctx.op("Mul", [kept, ctx.i64([post])], "kept_post")], "rows")
        order = ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [rows, ctx.i64([0])], "rows_s"), ctx.i64(1)], "order")
        cycle = ctx.op("Mod", [order, ctx.op("Max", [kept, ctx.i64([1])], "kept1")], "cycle")
        picked = ctx.op("Gather", [picked, cycle], "padded", axis=0)
    chosen = ctx.op("Gather", [cand, picked], "chosen", axis=0)
    zeros = ctx.op("Mul", [ctx.op("Gather", [chosen, ctx.i64([0])], "first", axis=1), ctx.f32(0.0)], "zeros")
    ctx.add_node("Concat", [zeros, chosen], [node.outputs[0]], axis=1)


TORCH_FPN_PROPOSAL = torch_sources(fpn_level_boxes, fpn_proposals, FPNProposal)
TORCH_FPN_ASSIGN = torch_sources(fpn_roi_levels, fpn_assign_rois,
                                                                 fpn_assign_rois_merged)


def read_fpn_param_str(text):
    """FPN's param_str, "'feat_stride': 4,8,16,32,64": in YAML's block style a plain scalar keeps its
    commas, so the value is the string "4,8,16,32,64" (the flow-style reader would split it).  Other
    forms go to param_str.parse_param_str."""
    m = re.fullmatch(r"""\s*(['"]?)feat_stride\1\s*:\s*([^\s'"{}\[\]][^\n'"{}\[\]:]*)""", text)
    if m and "," in m.group(2):
        return {"feat_stride": m.group(2).strip()}
    return parse_param_str(text)


# ---- the specs -------------------------------------------------------------------------------

class FPNProposalSpec(Layer):
    """Not registered by itself: FPN names its layer rpn.proposal_layer.ProposalLayer, as
    py-faster-rcnn, and rcnn.PythonProposalLayer hands the multi-level form (11 bottoms, or a
    comma list of strides) to this spec."""
    data_dependent_shape = True

    @staticmethod
    def claims(lp):
        """True when a rpn.proposal_layer.ProposalLayer is FPN's, not py-faster-rcnn's."""
        if len(lp.bottom) == 11:
            return True
        try:
            stride = read_fpn_param_str(lp.python_param.param_str).get("feat_stride")
        except LayerError:
            return False
        return isinstance(stride, str) and "," in stride

    def parse(self, lp):
        p = read_fpn_param_str(lp.python_param.param_str)
        unknown = sorted(set(p) - {"feat_stride"})
        if unknown:
            raise LayerError(f"python_param.param_str: FPN's ProposalLayer reads only 'feat_stride', got {unknown}")
        text = p.get("feat_stride")
        if text is None:
            raise LayerError("python_param.param_str: 'feat_stride' is required (e.g. \"'feat_stride': 4,8,16,32,64\")")
        try:
            strides = [int(v) for v in str(text).split(",")]
        except ValueError:
            raise LayerError(f"python_param.param_str: 'feat_stride' must be comma-separated integers, "
                             f"got {text!r}") from None
        if len(set(strides)) != len(strides) or any(s <= 0 for s in strides):
            raise LayerError(f"python_param.param_str: 'feat_stride' must be distinct positive integers, got {text!r}")
        # the module looks its maps up by stride: bottoms 1-5 are strides 4..64, 6-10 their scores
        by_stride = {4: 0, 8: 1, 16: 2, 32: 3, 64: 4}
        if any(s not in by_stride for s in strides):
            raise LayerError(f"python_param.param_str: FPN's ProposalLayer knows the strides 4, 8, 16, 32, 64 "
                             f"only, got {text!r}")
        need_blobs(lp, "FPN's ProposalLayer", 11, roles="im_info, 5 rpn_bbox_pred, 5 rpn_cls_prob_reshape")
        if len(lp.top) != 1:
            raise LayerError(f"FPN's ProposalLayer gives 1 top (rois), got {len(lp.top)}")
        anchors = [generate_anchors(s, FPN_RATIOS, FPN_SCALES).tolist() for s in strides]
        return {"pyramid": True, "name": lp.name, "strides": strides, "levels": [by_stride[s] for s in strides],
                "anchors": anchors, **FPN_CONFIG}

    def infer(self, attrs, in_shapes):
        info, maps = in_shapes[0], in_shapes[1:]
        if math.prod(info) < 3:
            raise LayerError(f"im_info must hold [height, width, scale], got shape {list(info)}")
        total = 0
        for level, stride in zip(attrs["levels"], attrs["strides"]):
            # the anchor count is the maps' own here: another one than the spec's loads in Caffe (the
            # Python layer's setup looks at no bottom) and is refused at run time (cannot_run)
            deltas, prob = maps[level], maps[5 + level]
            if len(prob) != 4 or prob[0] != 1 or prob[1] % 2:
                raise LayerError(f"the stride-{stride} rpn_cls_prob_reshape (bottom {6 + level}) must be "
                                 f"(1, 2 x anchors, H, W), got {list(prob)}")
            a = prob[1] // 2
            if tuple(deltas) != (1, 4 * a, prob[2], prob[3]):
                raise LayerError(f"the stride-{stride} rpn_bbox_pred (bottom {1 + level}) must be "
                                 f"(1, {4 * a}, {prob[2]}, {prob[3]}), got {list(deltas)}")
            total += prob[2] * prob[3] * a
        # kept rows are repeated up to post_nms_top_n
        return [(attrs["post_nms_top_n"] if attrs["post_nms_top_n"] > 0 else total, 5)]

    @staticmethod
    def cannot_run(attrs, in_shapes):
        """Why the proposals cannot be computed for these maps, or None: a level scoring another number
        of anchors than unsky/FPN's (a fork's proposal_layer.py with its own cfg.FPNRATIOS and
        FPNRSCALES, such as xraydetec/Xdet's five ratios) loads in Caffe and fails only in forward."""
        maps = in_shapes[1:]
        for level, stride, anchors in zip(attrs["levels"], attrs["strides"], attrs["anchors"]):
            got = maps[5 + level][1] // 2
            if got != len(anchors):
                return (f"the stride-{stride} maps score {got} anchors per position, but unsky/FPN's proposal "
                        f"layer makes {len(anchors)} (cfg.FPNRATIOS {list(FPN_RATIOS)} x FPNRSCALES "
                        f"{list(FPN_SCALES)}): this net comes with a fork's proposal_layer.py and config, "
                        f"whose anchors caffeq does not guess")
        return None

    def _ordered(self, attrs, maps):
        return ([maps[lv] for lv in attrs["levels"]], [maps[5 + lv] for lv in attrs["levels"]])

    def forward(self, attrs, params, im_info, *maps):
        self.refuse_if_cannot_run(attrs["name"], attrs, [im_info.shape] + [m.shape for m in maps],
                                  layer_type="FPN region proposals")
        deltas, probs = self._ordered(attrs, maps)
        anchors = [torch.tensor(a, dtype=torch.float64) for a in attrs["anchors"]]
        try:
            return fpn_proposals(im_info, deltas, probs, anchors, attrs["strides"], attrs["pre_nms_top_n"],
                                 attrs["post_nms_top_n"], attrs["nms_thresh"], attrs["min_size"])
        except ValueError as e:
            raise CaffeqError(f"FPN ProposalLayer: {e}") from None

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError, node.type)
        emit_fpn_proposals(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(i) for i in range(len(emit.inputs))], ExportError, node.type)
        emit.note(f"{node.name} (FPN region proposals): NMS runs eagerly on the CPU, so this layer does not trace; "
                  f"fewer than {a['post_nms_top_n']} kept boxes are repeated in order (the Python layer repeats "
                  f"random ones).")
        emit.helper(TORCH_ANCHORS)
        emit.helper(TORCH_PROPOSAL)
        name = emit.helper(TORCH_FPN_PROPOSAL)
        m = emit.module(f"{name}({emit.lit(a['anchors'], exact=True)}, {a['strides']}, "
                        f"pre_nms_top_n={a['pre_nms_top_n']}, post_nms_top_n={a['post_nms_top_n']}, "
                        f"nms_thresh={emit.lit(a['nms_thresh'], exact=True)}, "
                        f"min_size={emit.lit(float(a['min_size']), exact=True)})")
        inputs = emit.inputs
        ordered = [inputs[1 + lv] for lv in a["levels"]] + [inputs[6 + lv] for lv in a["levels"]]
        return f"{m}({', '.join([inputs[0]] + ordered)})"


FPN_PROPOSAL = FPNProposalSpec()


class _AsRoisBase(Layer):
    merged = False

    def parse(self, lp):
        what = f"{lp.python_param.module}.{lp.python_param.layer}"
        need_blobs(lp, what, 1, roles="rois")
        if len(lp.top) != 5:
            raise LayerError(f"{what} gives 5 tops (rois, then levels 2, 3, 4, 5), got {len(lp.top)}")
        if lp.python_param.param_str.strip():
            # the module reads param_str with yaml.load but uses nothing of it
            parse_param_str(lp.python_param.param_str)
        return {"level_rows": LEVEL_BATCH}

    def _check(self, rois):
        if len(rois) != 2 or rois[1] != 5:
            raise LayerError(f"rois must be (R, 5) = [batch, x1, y1, x2, y2], got {list(rois)}")

    def onnx(self, ctx, node):
        emit_assign_rois(ctx, node, self.merged)


@register_layer("Python:rpn.as_rois.As_roisLayer")
class FPNAssignRois(_AsRoisBase):
    def infer(self, attrs, in_shapes):
        rois = in_shapes[0]
        self._check(rois)
        b = attrs["level_rows"]
        if rois[0] > b:
            raise LayerError(f"As_roisLayer holds at most {b} rois per level (cfg.TEST.RPN_POST_NMS_TOP_N); "
                             f"{rois[0]} rois could overrun a level")
        return [(4 * b, 5)] + [(b, 5)] * 4

    def forward(self, attrs, params, rois):
        try:
            return fpn_assign_rois(rois, attrs["level_rows"])
        except ValueError as e:
            raise CaffeqError(f"As_roisLayer: {e}") from None

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_FPN_ASSIGN)
        t = emit.tmp("levels")
        emit.stmt(f"{t} = fpn_assign_rois({emit.inputs[0]}, {node.attrs['level_rows']})")
        return [f"{t}[{i}]" for i in range(5)]


@register_layer("Python:rpn.as_rois_mrcnn.As_rois_MergeRcnnLayer")
class FPNAssignRoisMerged(_AsRoisBase):
    merged = True
    data_dependent_shape = True

    def infer(self, attrs, in_shapes):
        rois = in_shapes[0]
        self._check(rois)
        r = rois[0]
        # the most rows of each level: all rois, or the dummy rows; rois stacks the four bounds (a
        # looser bound than R + 12, but the sum of its parts, as the ONNX Concat's shape)
        level = max(r, EMPTY_LEVEL_ROWS)
        return [(4 * level, 5)] + [(level, 5)] * 4

    def forward(self, attrs, params, rois):
        return fpn_assign_rois_merged(rois, EMPTY_LEVEL_ROWS)

    def pytorch_source(self, node, emit):
        name = emit.helper(TORCH_FPN_ASSIGN)
        t = emit.tmp("levels")
        emit.stmt(f"{t} = {name}({emit.inputs[0]}, {EMPTY_LEVEL_ROWS})")
        return [f"{t}[{i}]" for i in range(5)]
