"""SSD's DetectionOutput, with TextBoxes++'s quadrilaterals and rotated boxes.

- Rows per image, label ascending then score descending, exactly as many as
  survive; with no detection at all, one [i, -1, -1, ...] row per image.  The
  static shape reported at load time is the most rows it can write (keep_top_k
  * N), since the real count is only known at run time.  save_output_param
  (writing result files) is ignored.
- A 4th bottom (weiliu89/caffe ssd 4817bf8: MinBottomBlobs 3, MaxBottomBlobs 4) is only read
  when `visualize: true`, to draw the boxes on the images (detection_output_layer.cpp:459-462);
  the top never depends on it, so it is accepted and not read.
- TextBoxes++ (MhLiao/TextBoxes_plusplus) predicts more than 4 numbers per
  prior and location class, told apart by the loc size: 12 (`use_polygon`,
  its default) = the box, then a quadrilateral (x1, y1, ..., x4, y4) as
  offsets from the prior's corners (top-left, top-right, bottom-right,
  bottom-left) scaled by variance[0] (x) or [1] (y) and the prior's size;
  9 = the box, then a rotated box (x1, y1, x2, y2 from the prior's centre, and
  h = exp(variance[3] * t) * prior height).  Rows are then 15 or 12 wide:
  [image, label, score, xmin, ymin, xmax, ymax, the 8 or 5 values].  NMS
  still runs on the axis-aligned boxes, as TextBoxes++ does; it decodes the
  extra values only for CENTER_SIZE without variance_encoded_in_target
  (otherwise they are undefined there, so caffeq refuses).
- RefineDet (sfzhang15/RefineDet detection_output_layer.cpp, bbox_util.cpp OSGetConfidenceScores,
  CasRegDecodeBBoxesAll) adds two bottoms: 4th the ARM's class scores (N, P * 2, after its softmax),
  5th the ARM's loc (N, P * 4).  An anchor whose arm conf for class 1 is below objectness_score
  scores 1 for class 0 and 0 for every other class (class 0, whatever background_label_id says);
  with the 5th bottom each image's priors are first decoded by its arm loc (same code_type,
  variances and variance_encoded_in_target, never clipped), and loc is decoded against those boxes
  (keeping the priors' variances).  A 4th bottom holding N x 2P numbers without `visualize: true`
  is read as RefineDet's; any other is SSD's images.  The arm loc is read shared (the fork reads
  label -1 of it), so share_location must be true with 5 bottoms.
- julimueller/tl_ssd (traffic lights; detection_output_layer.cu, be5ae7f): `do_state_prediction`
  with `num_states` S reads a 4th bottom (N, P * S) of per-prior state scores and writes rows
  [image, label, score, S state scores of the row's prior, xmin, ymin, xmax, ymax], as its GPU
  Forward does (its CPU Forward ignores the states and writes SSD's rows).  With no detection its
  -1 rows keep SSD's stride of 7 for the image ids, as the fork writes them.
- synopsys-caffe's per-level bottoms (`nbottom`, `no_permute`, `ratio_permute`): gathered into
  the three bottoms above by detection_levels.py, then read as here.
- chris-512/caffe-refinedet (191e71b, detection_output_layer.cpp): RefineDet with 3 bottoms, loc =
  Concat(odm loc, arm loc) (N, 8P) and conf = Concat(odm conf, arm conf) (N, (C + 2)P) (its
  refinedet_vgg16_320x320 files).  Its Reshape checks those sizes; Forward reads the odm parts from
  the start of each blob and the arm parts at the fixed offsets 25500 and 133875 (4P and 21P of that
  320x320 VOC net): read as RefineDet's five bottoms where the offsets are 4P and CP, batch 1 (the
  fork reads a second image from the first's arm parts); anything else is refused.
- OpenVINO's DetectionOutput with `normalized: false` (Open Model Zoo's R-FCN
  person-detection-retail-0002 feeds its Proposal's rois as the priors).  The fields come from
  OpenVINO Model Optimizer's mo_caffe.proto (openvinotoolkit/openvino 6dc130d; input_width 13,
  input_height 14, normalized 15), which front/caffe/detection_output_ext.py copies to its op; no
  public Caffe declares them (openvinotoolkit/training_toolbox_caffe 5e543a4 does not).  What they
  do is OpenVINO's reference (src/core/reference/include/openvino/reference/detection_output.hpp):
  each prior is 5 numbers (an item index, then xmin, ymin, xmax, ymax in pixels), P = the priors'
  last axis / 5, read from the first item; the corners are divided by input_width (x) and
  input_height (y) in float32 before SSD's decoding; without variance_encoded_in_target the
  variances are the 4P numbers after the first 5P.  The rows are then SSD's, normalised.  Priors of
  batch > 1 with a batch > 1 (OpenVINO: image i reads item i's priors) are refused.
- OpenCV's DetectionOutput with `normalized_bbox: false` (opencv-caffe.proto field 10; its Faster
  R-CNN samples feed the Proposal's rois, sliced to (1, 1, 4P), as the priors).  What it does is
  opencv/opencv 0052d95 modules/dnn/src/layers/detection_output_layer.cpp (+ nms.inl.hpp): the priors
  are 4 pixel corners each, P = the last axis / 4, from the first 4P numbers (every item uses them),
  with the variances in the next 4P unless variance_encoded_in_target; the priors axis 1 must be
  1 + (not variance_encoded_in_target).  CENTER_SIZE decodes with the prior's width and height + 1
  and its centre xmin + width / 2 (CORNER is unchanged; OpenCV decodes any other code_type, CORNER_SIZE
  too, as CORNER: CORNER_SIZE is refused);
  the rows are in pixels (never divided by an image size).  `clip` clips to [0, W - 1] x [0, H - 1],
  W and H the last two axes of a 4th bottom (required then; only its shape is read).  NMS sizes and
  overlaps count pixels inclusively, (w + 1)(h + 1), a box with xmax < xmin or ymax < ymin being of
  size 0, the intersection (iw + 1)(ih + 1) and 0 where iw or ih < 0: torch and model.py run exactly
  that (nms.py's pixel).  ONNX's NonMaxSuppression runs on (xmin, ymin, xmax + 1, ymax + 1) (a flipped
  box collapsed to size 0): the same except for two boxes less than one pixel apart (OpenCV: no
  overlap; ONNX: a sliver (1 - gap) wide) and the rounding of the + 1.  OpenCV's own defaults hold on this path:
  confidence_threshold unset = 0 (scores must be > 0), top_k <= 0 = all, eta not read (1).  Rows,
  keep_top_k (one target class: OpenCV stops NMS at keep_top_k, the same rows) and per-item handling
  are SSD's; caffeq writes them in SSD's order and count (by image, label, then NMS order), where OpenCV
  sorts each image's rows by score (std::sort: equal scores in no set order), writes the images' rows one
  after another and zero-pads them to keep_top_k x N rows (as on the normalized path); with no row at all
  OpenCV's output is all zeros, caffeq's SSD's [i, -1, ...] row per image.  The priors are the Proposal's
  rois, whose count is known only after a run: torch and model.py take it from the run, the ONNX export
  (which fixes it from the load-time shape) is refused when the priors' shape depends on values.
ONNX: standard ops (TopK, NonMaxSuppression, NonZero...) give the same rows
in the same order; only eta < 1 (adaptive NMS) is refused.
"""
import inspect
import math

import numpy as np
import torch
from torch import nn

from ..registry import ForkReading, Layer, LayerError, register_layer, torch_sources
from .common import CENTER_SIZE, CODE_NAMES, CORNER_SIZE, FLT_MAX, proto_field
from .detection_levels import emit_gather_onnx, gather_levels, level_pieces, level_reading
from .nms import TORCH_SSD_NMS, ssd_nms
from .priorbox import fork_priors, textboxes_priors

#: extra numbers per prior after the box: TextBoxes++'s layouts
EXTRA = {0: "", 5: "rbox", 8: "quad"}


def decode_boxes(loc, pbox, pvar, code_type: str, variance_in_target: bool, pixel: bool = False):
    """SSD's DecodeBBox: loc (..., P, 4) against the priors pbox, pvar (P, 4) -> corners (..., P, 4).
    pixel (OpenCV's normalized_bbox: false): the prior's size counts pixels inclusively (+ 1) and its
    centre is xmin + width / 2."""
    if variance_in_target:
        pvar = torch.ones_like(pvar)
    if code_type == "CORNER":
        return pbox + pvar * loc
    pw = pbox[..., 2] - pbox[..., 0]   # pbox (P, 4), or RefineDet's refined boxes (N, 1, P, 4)
    ph = pbox[..., 3] - pbox[..., 1]
    if code_type == "CORNER_SIZE":
        size = torch.stack([pw, ph, pw, ph], dim=-1)
        return pbox + pvar * loc * size
    if pixel:   # CENTER_SIZE in pixels
        pw, ph = pw + 1, ph + 1
        pcx, pcy = pbox[..., 0] + pw * 0.5, pbox[..., 1] + ph * 0.5
    else:       # CENTER_SIZE
        pcx = (pbox[..., 0] + pbox[..., 2]) / 2
        pcy = (pbox[..., 1] + pbox[..., 3]) / 2
    cx = pvar[:, 0] * loc[..., 0] * pw + pcx
    cy = pvar[:, 1] * loc[..., 1] * ph + pcy
    w = torch.exp(pvar[:, 2] * loc[..., 2]) * pw
    h = torch.exp(pvar[:, 3] * loc[..., 3]) * ph
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def decode_textboxes(extra, pbox, pvar, layout: str):
    """TextBoxes++'s CENTER_SIZE decoding of the numbers after the box (..., P, 8 or 5).
    quad: corner k = the prior's corner k (top-left, top-right, bottom-right, bottom-left) plus
    variance[0] * dx * width, variance[1] * dy * height.  rbox: x1, y1, x2, y2 the same around the
    prior's centre, then h = exp(variance[3] * t) * height."""
    pw = pbox[:, 2] - pbox[:, 0]
    ph = pbox[:, 3] - pbox[:, 1]
    if layout == "quad":
        ax = torch.stack([pbox[:, 0], pbox[:, 2], pbox[:, 2], pbox[:, 0]], dim=-1)
        ay = torch.stack([pbox[:, 1], pbox[:, 1], pbox[:, 3], pbox[:, 3]], dim=-1)
        xs = pvar[:, 0:1] * extra[..., 0::2] * pw[:, None] + ax
        ys = pvar[:, 1:2] * extra[..., 1::2] * ph[:, None] + ay
        return torch.stack([xs, ys], dim=-1).flatten(-2)
    pcx = (pbox[:, 0] + pbox[:, 2]) / 2
    pcy = (pbox[:, 1] + pbox[:, 3]) / 2
    xs = pvar[:, 0:1] * extra[..., 0:4:2] * pw[:, None] + pcx[:, None]
    ys = pvar[:, 1:2] * extra[..., 1:4:2] * ph[:, None] + pcy[:, None]
    h = torch.exp(pvar[:, 3] * extra[..., 4]) * ph
    return torch.cat([torch.stack([xs, ys], dim=-1).flatten(-2), h[..., None]], dim=-1)


def openvino_pixel_priors(prior, width: int, height: int, variance_in_target: bool):
    """OpenVINO's `normalized: false` priors -> SSD's (1, 2, 4P): the first item's P priors of 5 numbers
    (item index, pixel corners), the corners over (width, height); variances from the 4P numbers after
    the first 5P (ones when they are encoded in the target, where they are not read)."""
    flat = prior.reshape(prior.shape[0], -1)[0]
    n = prior.shape[-1] // 5
    scale = torch.tensor([width, height, width, height], dtype=prior.dtype, device=prior.device)
    boxes = flat[:n * 5].reshape(n, 5)[:, 1:] / scale
    var = torch.ones_like(boxes) if variance_in_target else flat[n * 5:n * 9].reshape(n, 4)
    return torch.stack([boxes.reshape(-1), var.reshape(-1)]).reshape(1, 2, n * 4)


class DetectionOutput(nn.Module):
    """SSD's DetectionOutput: loc decoded against the priors (code_type), NMS per class (ssd_nms),
    the keep_top_k best per image, as rows [image, label, score, xmin, ymin, xmax, ymax] shaped
    (1, 1, R, 7): per image, label ascending, then score descending.  With no detection at all,
    one [i, -1, ...] row per image.  R depends on the data.  layout "quad" / "rbox": TextBoxes++'s
    8 / 5 more numbers per prior (decode_textboxes), appended to each row.  RefineDet: arm_conf
    (N, 2P) replaces the scores of anchors whose objectness is below `objectness` by (1, 0, ...);
    arm_loc (N, 4P) refines each image's priors before loc is decoded against them.  cells (width,
    anchors): OpenVINO's DetectionOutputExtended, whose priors are one map's (y, x, anchor): each row
    ends in its prior's anchor, x and y."""

    def __init__(self, num_classes, share_location=True, background=0, nms_threshold=0.3, eta=1.0,
                 top_k=-1, code_type="CORNER", variance_in_target=False, keep_top_k=-1,
                 conf_threshold=-3.4028234663852886e38, clip=False, layout="", objectness=0.01, states=0,
                 cells=None, pixel=False):
        super().__init__()
        self.pixel = pixel   # OpenCV's normalized_bbox: false: priors and rows in pixels
        self.cells = cells
        self.states = states   # tl_ssd: state scores per prior, after the score in each row
        self.num_classes, self.share_location, self.background = num_classes, share_location, background
        self.nms_threshold, self.eta, self.top_k = nms_threshold, eta, top_k
        self.code_type, self.variance_in_target = code_type, variance_in_target
        self.keep_top_k, self.conf_threshold, self.clip = keep_top_k, conf_threshold, clip
        self.layout, self.objectness = layout, objectness

    def forward(self, loc, conf, prior, arm_conf=None, arm_loc=None, state=None, image=None):
        num = loc.shape[0]
        n_priors = prior.shape[-1] // 4
        n_cls = self.num_classes
        n_loc = 1 if self.share_location else n_cls
        width = 4 + {"": 0, "rbox": 5, "quad": 8}[self.layout]
        loc = loc.reshape(num, n_priors, n_loc, width).transpose(1, 2)   # (N, n_loc, P, width)
        conf = conf.reshape(num, n_priors, n_cls)
        pri = prior.reshape(prior.shape[0], -1, n_priors * 4)[0]  # every image uses the first item's priors
        pbox = pri[0].reshape(n_priors, 4)
        # OpenCV's pixel priors carry no variance row with variance_encoded_in_target (never read then)
        pvar = pri[1].reshape(n_priors, 4) if pri.shape[0] > 1 else torch.ones_like(pbox)
        if arm_conf is not None:   # RefineDet: anchors the ARM finds empty score (1, 0, 0, ...)
            empty = arm_conf.reshape(num, n_priors, 2)[:, :, 1:] < self.objectness
            first = torch.arange(n_cls, device=conf.device) == 0
            conf = torch.where(empty, first.to(conf.dtype).expand(num, n_priors, n_cls), conf)
        if arm_loc is not None:    # RefineDet: each image's priors refined by the ARM's loc
            arm = arm_loc.reshape(num, 1, n_priors, 4)
            pbox = decode_boxes(arm, pbox, pvar, self.code_type, self.variance_in_target, self.pixel)
        decoded = decode_boxes(loc[..., :4], pbox, pvar, self.code_type, self.variance_in_target, self.pixel)
        if self.clip and self.pixel:   # OpenCV: [0, W - 1] x [0, H - 1] of the 4th bottom
            w, h = image.shape[-1] - 1, image.shape[-2] - 1
            hi = torch.tensor([w, h, w, h], dtype=decoded.dtype, device=decoded.device)
            decoded = torch.minimum(decoded, hi).clamp(min=0.0)
        elif self.clip:
            decoded = decoded.clamp(0.0, 1.0)
        boxes_all = decoded.detach().float().cpu()  # NMS runs on the CPU, in float32
        scores_all = conf.detach().float().cpu()
        if self.layout:
            decoded = torch.cat([decoded, decode_textboxes(loc[..., 4:], pbox, pvar, self.layout)], dim=-1)
        picks = []  # (image, label, prior) in SSD's output order
        for i in range(num):
            per_label = {}
            for c in range(n_cls):
                if c == self.background:
                    continue
                boxes = boxes_all[i, 0 if self.share_location else c]
                per_label[c] = ssd_nms(boxes, scores_all[i, :, c], self.conf_threshold,
                                       self.nms_threshold, self.eta, self.top_k, self.pixel)
            total = sum(len(v) for v in per_label.values())
            if self.keep_top_k > -1 and total > self.keep_top_k:
                # the keep_top_k best over all classes; the stable sort keeps ties in label order
                pool = [(float(scores_all[i, idx, c]), c, idx) for c in sorted(per_label)
                        for idx in per_label[c]]
                pool.sort(key=lambda t: -t[0])
                per_label = {}
                for _, c, idx in pool[:self.keep_top_k]:
                    per_label.setdefault(c, []).append(idx)
            for c in sorted(per_label):
                picks.extend((i, c, idx) for idx in per_label[c])
        dev, dt = loc.device, loc.dtype
        cols = 3 + self.states + decoded.shape[-1] + (3 if self.cells else 0)
        if not picks:
            out = torch.full((num * cols,), -1.0, device=dev, dtype=dt)
            stride = 7 if self.states else cols   # tl_ssd steps 7 numbers per image id whatever the width
            out[torch.arange(num, device=dev) * stride] = torch.arange(num, device=dev, dtype=dt)
            return out.reshape(1, 1, num, cols)
        img = torch.tensor([p[0] for p in picks], device=dev)
        lab = torch.tensor([p[1] for p in picks], device=dev)
        idx = torch.tensor([p[2] for p in picks], device=dev)
        lslot = torch.zeros_like(lab) if self.share_location else lab
        score = conf[img, idx, lab]
        box = decoded[img, lslot, idx]
        parts = [img.to(dt)[:, None], lab.to(dt)[:, None], score[:, None].to(dt), box.to(dt)]
        if self.states:
            parts.insert(3, state.reshape(num, n_priors, self.states)[img, idx].to(dt))
        if self.cells:
            width, anchors = self.cells
            parts.append(torch.stack([idx % anchors, (idx // anchors) % width, idx // (anchors * width)], 1).to(dt))
        out = torch.cat(parts, dim=1)
        return out.reshape(1, 1, -1, cols)


# model.py gets the same code that forward runs
TORCH_DETECTION_OUTPUT = torch_sources(decode_boxes, decode_textboxes, DetectionOutput)


def max_detections(attrs, num, n_priors):
    """Rows DetectionOutput can write at most (the static shape; the real count is data dependent)."""
    if attrs["keep_top_k"] > -1:
        return attrs["keep_top_k"] * num
    classes = attrs["num_classes"] - (0 <= attrs["background"] < attrs["num_classes"])
    per_class = n_priors if attrs["top_k"] < 0 else min(attrs["top_k"], n_priors)
    return max(1, num * classes * per_class)


def module_kwargs(attrs, layout):
    """DetectionOutput's constructor arguments for a node's attrs."""
    return {"num_classes": attrs["num_classes"], "share_location": attrs["share_location"],
            "background": attrs["background"], "nms_threshold": attrs["nms_threshold"], "eta": attrs["eta"],
            "top_k": attrs["top_k"], "code_type": CODE_NAMES[attrs["code_type"]],
            "variance_in_target": attrs["variance_in_target"], "keep_top_k": attrs["keep_top_k"],
            "conf_threshold": attrs["conf_threshold"], "clip": attrs["clip"], "layout": layout,
            "objectness": attrs["objectness"], "states": attrs.get("states", 0), "cells": attrs.get("cells"),
            "pixel": attrs.get("opencv_pixel", False)}


def loc_layout(attrs, loc_shape, n_priors):
    """"" (SSD), "rbox" or "quad" (TextBoxes++) from the numbers per prior in loc; LayerError if none fits."""
    n_loc = 1 if attrs["share_location"] else attrs["num_classes"]
    per = math.prod(loc_shape[1:]) / (n_priors * n_loc) if len(loc_shape) >= 2 and n_priors else 0
    allowed = {12} if attrs["use_polygon"] is True else {4, 9} if attrs["use_polygon"] is False else {4, 9, 12}
    if per not in allowed:
        want = " or ".join(f"{n_priors} priors x {n_loc} x {k}" for k in sorted(allowed))
        if per / 2 in allowed:   # TextBoxes (v1) always doubles its priors, with no field to say so
            raise ForkReading(f"loc {list(loc_shape)} holds twice the predictions of {want}: the priors "
                              f"of TextBoxes' PriorBox, each doubled", textboxes_priors)
        # FaceBoxes densifies some priors and OpenCV reads offset_w/offset_h as pairs, again with no
        # field: fork_priors tries those readings (when no PriorBox fits one, it changes nothing and
        # this error stands)
        raise ForkReading(f"loc {list(loc_shape)} does not hold {want} predictions", fork_priors)
    layout = EXTRA[int(per) - 4]
    if layout and (attrs["code_type"] != CENTER_SIZE or attrs["variance_in_target"]):
        raise LayerError(f"TextBoxes++'s {layout} predictions are decoded only for code_type CENTER_SIZE "
                         f"without variance_encoded_in_target")
    return layout


def arm_bottoms(attrs, in_shapes, n_priors):
    """How many of the bottoms after the priors are RefineDet's (arm conf, arm loc): 0, 1 or 2.
    A 4th bottom is RefineDet's arm conf when it holds 2 scores per prior and visualize is off
    (SSD reads its 4th bottom, the images, only to draw on them); a 5th is always the arm loc."""
    extra = in_shapes[3:]
    if not extra:
        return 0
    num = in_shapes[0][0]
    arm_conf = extra[0]
    if len(extra) == 1 and (attrs["visualize"] or math.prod(arm_conf) != num * 2 * n_priors):
        return 0   # SSD's images
    if len(arm_conf) < 2 or arm_conf[0] != num or math.prod(arm_conf[1:]) != 2 * n_priors:
        raise LayerError(f"RefineDet's arm conf (4th bottom) {list(arm_conf)} does not hold {num} x "
                         f"{n_priors} priors x 2 scores")
    if attrs["layout"]:
        raise LayerError(f"RefineDet's arm bottoms do not combine with TextBoxes++'s {attrs['layout']} "
                         f"predictions")
    if len(extra) == 1:
        return 1
    arm_loc = extra[1]
    if not attrs["share_location"]:
        raise LayerError("RefineDet's arm loc (5th bottom) needs share_location: true (the fork reads it "
                         "as shared boxes)")
    if len(arm_loc) < 2 or arm_loc[0] != num or math.prod(arm_loc[1:]) != 4 * n_priors:
        raise LayerError(f"RefineDet's arm loc (5th bottom) {list(arm_loc)} does not hold {num} x "
                         f"{n_priors} priors x 4")
    return 2


# chris-512/caffe-refinedet's Forward reads the ARM parts of its combined bottoms at these offsets
COMBINED_ARM_OFFSETS = (25500, 133875)


def _combined_refinedet(attrs, loc, conf, n_priors):
    """Whether 3 bottoms are chris-512/caffe-refinedet's combined RefineDet ones (see the docstring):
    their sizes and the fork's fixed offsets must agree, so TextBoxes' doubled priors (8P loc, 2PC
    conf, the same sizes for 2 classes) are never taken for them."""
    C = attrs["num_classes"]
    if (4 * n_priors, C * n_priors) != COMBINED_ARM_OFFSETS:
        return False
    if not (len(loc) >= 2 and len(conf) >= 2 and math.prod(loc[1:]) == 8 * n_priors
            and math.prod(conf[1:]) == (C + 2) * n_priors):
        return False
    if loc[0] != 1 or not attrs["share_location"]:
        raise LayerError(f"loc {list(loc)} and conf {list(conf)} are caffe-refinedet's combined RefineDet bottoms "
                         f"(odm and arm predictions concatenated), which its DetectionOutput reads for one image "
                         f"with shared loc only (it reads a second image from the first's arm parts)")
    return True


def split_combined_refinedet(loc, conf, prior, num_classes: int):
    """caffe-refinedet's combined bottoms -> (odm loc, odm conf, priors, arm conf, arm loc)."""
    p = prior.shape[-1] // 4
    loc, conf = loc.reshape(loc.shape[0], -1), conf.reshape(conf.shape[0], -1)
    return (loc[:, :4 * p], conf[:, :num_classes * p], prior, conf[:, num_classes * p:(num_classes + 2) * p],
            loc[:, 4 * p:8 * p])


def _onnx_pixel_priors(ctx, node):
    """openvino_pixel_priors in ONNX: the first item's 5P numbers as (P, 5), the corners over (w, h, w, h),
    with the variances (the next 4P numbers, or ones) -> (1, 2, 4P)."""
    (w, h), vit = node.attrs["pixel_priors"], node.attrs["variance_in_target"]
    P = ctx.shape(node.inputs[2])[-1] // 5
    flat = ctx.op("Reshape", [node.inputs[2], ctx.i64([ctx.shape(node.inputs[2])[0], -1])], "pix_prior_flat")
    flat = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([1]), ctx.i64([0])], "pix_prior_item0")
    box = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([5 * P]), ctx.i64([1])], "pix_prior_five")
    box = ctx.op("Reshape", [box, ctx.i64([P, 5])], "pix_prior_rows")
    box = ctx.op("Slice", [box, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], "pix_prior_corners")
    box = ctx.op("Div", [box, ctx.f32(np.array([w, h, w, h], np.float32))], "pix_prior_scaled")
    box = ctx.op("Reshape", [box, ctx.i64([1, 4 * P])], "pix_prior_box")
    if vit:
        var = ctx.f32(np.ones((1, 4 * P), np.float32))
    else:
        var = ctx.op("Slice", [flat, ctx.i64([5 * P]), ctx.i64([9 * P]), ctx.i64([1])], "pix_prior_var")
    both = ctx.op("Concat", [box, var], "pix_prior_both", axis=0)
    return ctx.op("Reshape", [both, ctx.i64([1, 2, 4 * P])], "pix_prior")


@register_layer("DetectionOutput")
class DetectionOutputLayer(Layer):
    #: the row count is known only after a run; infer gives the most rows (keep_top_k * N)
    data_dependent_shape = True

    def parse(self, lp):
        levels = level_reading(lp)   # synopsys-caffe's per-level bottoms, or None
        if levels is None and len(lp.bottom) not in (3, 4, 5):
            raise LayerError(f"DetectionOutput takes 3 bottoms (loc, conf, priors), an optional 4th (SSD: the "
                             f"images, for visualize; RefineDet: arm conf) and RefineDet's 5th (arm loc), "
                             f"got {len(lp.bottom)}")
        p = lp.detection_output_param
        if not p.HasField("num_classes"):
            raise LayerError("detection_output_param.num_classes is required")
        nms = p.nms_param
        if nms.soft_nms:
            raise LayerError("nms_param.soft_nms (jolibrain/caffe's soft NMS) is not supported; caffeq runs SSD's NMS, "
                             "which soft_nms: false selects")
        use_polygon = proto_field(p, "use_polygon")
        attrs = {
            "num_classes": int(p.num_classes),
            "share_location": bool(p.share_location),
            "background": int(p.background_label_id),
            "nms_threshold": float(nms.nms_threshold),
            "eta": float(nms.eta),
            "top_k": int(nms.top_k) if nms.HasField("top_k") else -1,
            "code_type": int(p.code_type),
            "variance_in_target": bool(p.variance_encoded_in_target),
            "keep_top_k": int(p.keep_top_k),
            "conf_threshold": float(p.confidence_threshold) if p.HasField("confidence_threshold") else -FLT_MAX,
            "clip": bool(p.clip),  # OpenCV-only field: clip decoded boxes to [0, 1]
            # TextBoxes++: true = quadrilaterals, false = rotated boxes or SSD's plain boxes, unset: by loc size
            "use_polygon": None if use_polygon is None else bool(use_polygon),
            # RefineDet: anchors whose arm conf (class 1) is below this are scored as background
            "objectness": float(proto_field(p, "objectness_score", 0.01)),
            "visualize": bool(proto_field(p, "visualize", False)),
            # tl_ssd: S state scores per prior from a 4th bottom, copied into each row
            "states": int(p.num_states) if p.do_state_prediction else 0,
        }
        if levels is not None:
            attrs["levels"] = levels
            attrs["states"] = 0
        if attrs["states"] and len(lp.bottom) != 4:
            raise LayerError(f"do_state_prediction (tl_ssd) reads the states from a 4th bottom, got {len(lp.bottom)} "
                             f"bottoms")
        if attrs["num_classes"] < 1:
            raise LayerError("detection_output_param.num_classes must be >= 1")
        if attrs["nms_threshold"] < 0:
            raise LayerError(f"nms_param.nms_threshold must be >= 0, got {attrs['nms_threshold']}")
        if not 0 < attrs["eta"] <= 1:
            raise LayerError(f"nms_param.eta must be in (0, 1], got {attrs['eta']}")
        if attrs["code_type"] not in CODE_NAMES:
            raise LayerError(f"detection_output_param.code_type {attrs['code_type']} is unknown")
        if p.HasField("normalized_bbox") and not p.normalized_bbox:   # OpenCV's priors and rows in pixels
            if not proto_field(p, "normalized", True) or levels is not None or attrs["states"]:
                raise LayerError("detection_output_param.normalized_bbox: false (OpenCV's) does not combine with "
                                 "OpenVINO's normalized: false, per-level bottoms or do_state_prediction")
            if attrs["code_type"] == CORNER_SIZE:
                raise LayerError("detection_output_param.normalized_bbox: false takes code_type CORNER or "
                                 "CENTER_SIZE (OpenCV's CodeType has no CORNER_SIZE)")
            attrs["opencv_pixel"] = True
            # OpenCV's own defaults: confidence_threshold 0, top_k <= 0 keeps all, NMS with eta 1
            if not p.HasField("confidence_threshold"):
                attrs["conf_threshold"] = 0.0
            if attrs["top_k"] <= 0:
                attrs["top_k"] = -1
            if attrs["eta"] != 1.0:
                attrs["reading_notes"] = [f"nms_param.eta {attrs['eta']} is not read by OpenCV's DetectionOutput "
                                          f"(it runs NMS with eta 1)"]
                attrs["eta"] = 1.0
        if not proto_field(p, "normalized", True):   # OpenVINO's priors in pixels
            w, h = int(proto_field(p, "input_width", -1)), int(proto_field(p, "input_height", -1))
            if w <= 0 or h <= 0:
                raise LayerError(f"detection_output_param.normalized: false needs input_width and input_height "
                                 f"> 0 (OpenVINO divides the priors by them), got {w} x {h}")
            if levels is not None:
                raise LayerError("detection_output_param.normalized: false with per-level bottoms is not supported")
            attrs["pixel_priors"] = (w, h)
        return attrs

    def infer(self, attrs, in_shapes):
        if attrs.get("levels"):
            attrs["pieces"], n_priors = level_pieces(attrs, in_shapes)
            attrs["layout"], attrs["arm"] = "", 0
            return [(1, 1, max_detections(attrs, in_shapes[0][0], n_priors), 7)]
        loc, conf, prior = in_shapes[:3]   # a 4th bottom (the images) is only drawn on
        if attrs.get("opencv_pixel"):
            return self._infer_opencv_pixel(attrs, in_shapes)
        if attrs.get("pixel_priors"):      # OpenVINO's: 5 numbers per prior, variances after them
            rows = 1 if attrs["variance_in_target"] else 2
            if len(prior) < 3 or prior[1] < rows or prior[2] % 5:
                raise LayerError(f"priors with normalized: false must be shaped (1, {rows}, 5 * num_priors), "
                                 f"got {list(prior)}")
            if prior[0] > 1 and loc[0] > 1:   # OpenVINO reads item i's priors for image i, SSD the first item's
                raise LayerError(f"priors with normalized: false and a batch of {prior[0]} (OpenVINO gives each "
                                 f"image its own priors) are not supported; got {list(prior)}")
        elif len(prior) < 3 or prior[1] != 2 or prior[2] % 4:
            raise LayerError(f"priors must be shaped (1, 2, 4 * num_priors), got {list(prior)}")
        n_priors = prior[2] // (5 if attrs.get("pixel_priors") else 4)
        attrs["combined"] = len(in_shapes) == 3 and _combined_refinedet(attrs, loc, conf, n_priors)
        if attrs["combined"]:
            attrs["layout"], attrs["arm"] = "", 2
            return [(1, 1, max_detections(attrs, loc[0], n_priors), 7)]
        layout = loc_layout(attrs, loc, n_priors)
        if len(conf) < 2 or math.prod(conf[1:]) != n_priors * attrs["num_classes"]:
            raise LayerError(f"conf {list(conf)} does not hold {n_priors} priors x "
                             f"{attrs['num_classes']} class scores")
        if loc[0] != conf[0]:
            raise LayerError(f"loc and conf disagree on the batch: {loc[0]} vs {conf[0]}")
        attrs["layout"] = layout
        if attrs["states"]:
            state = in_shapes[3]
            if len(state) < 2 or state[0] != loc[0] or math.prod(state[1:]) != n_priors * attrs["states"]:
                raise LayerError(f"tl_ssd's states (4th bottom) {list(state)} do not hold {loc[0]} x {n_priors} "
                                 f"priors x num_states {attrs['states']}")
        attrs["arm"] = 0 if attrs["states"] else arm_bottoms(attrs, in_shapes, n_priors)
        width = 7 + attrs["states"] + {"": 0, "rbox": 5, "quad": 8}[layout]
        return [(1, 1, max_detections(attrs, loc[0], n_priors), width)]

    def _infer_opencv_pixel(self, attrs, in_shapes):
        """OpenCV's normalized_bbox: false: priors (1, 1 + not variance_encoded_in_target, 4P), SSD's loc
        and conf, and with clip a 4-D 4th bottom whose H and W bound the boxes."""
        loc, conf, prior = in_shapes[:3]
        rows = 1 if attrs["variance_in_target"] else 2
        if len(prior) < 3 or prior[1] != rows or prior[2] % 4:
            raise LayerError(f"priors with normalized_bbox: false must be shaped (1, {rows}, 4 * num_priors) "
                             f"(OpenCV's check), got {list(prior)}")
        if attrs["clip"] and (len(in_shapes) < 4 or len(in_shapes[3]) != 4):
            raise LayerError("detection_output_param.clip with normalized_bbox: false needs a 4-D 4th bottom "
                             "(the image, whose height and width bound the boxes)")
        n_priors = prior[2] // 4
        layout = loc_layout(attrs, loc, n_priors)
        if layout:
            raise LayerError(f"TextBoxes++'s {layout} predictions do not combine with normalized_bbox: false")
        if len(conf) < 2 or math.prod(conf[1:]) != n_priors * attrs["num_classes"]:
            raise LayerError(f"conf {list(conf)} does not hold {n_priors} priors x "
                             f"{attrs['num_classes']} class scores")
        if loc[0] != conf[0]:
            raise LayerError(f"loc and conf disagree on the batch: {loc[0]} vs {conf[0]}")
        attrs.update(layout="", arm=0, combined=False)
        return [(1, 1, max_detections(attrs, loc[0], n_priors), 7)]

    def forward(self, attrs, params, loc, *rest):
        conf, prior, *extra = rest
        if attrs.get("opencv_pixel"):
            module = DetectionOutput(**module_kwargs(attrs, ""))
            return module(loc, conf, prior, image=extra[0] if attrs["clip"] else None)
        if attrs.get("pixel_priors"):
            prior = openvino_pixel_priors(prior, *attrs["pixel_priors"], attrs["variance_in_target"])
            rest = (conf, prior, *extra)
        module = DetectionOutput(**module_kwargs(attrs, attrs.get("layout", "")))
        if attrs.get("levels"):
            return module(*gather_levels((loc, *rest), attrs["pieces"]))
        if attrs.get("states"):
            return module(loc, conf, prior, state=extra[0])
        if attrs.get("combined"):
            return module(*split_combined_refinedet(loc, conf, prior, attrs["num_classes"]))
        arm = extra[:attrs.get("arm", 0)]   # RefineDet's arm conf (and arm loc); SSD's images are not read
        return module(loc, conf, prior, *arm)

    def onnx(self, ctx, node):
        from .detection_output_onnx import emit_detection_output
        if node.attrs.get("levels"):
            loc, conf, prior = emit_gather_onnx(ctx, node, node.attrs["pieces"])
            n_priors = sum(math.prod(pc[3]) for pc in node.attrs["pieces"][2]) // 4
            emit_detection_output(ctx, node, inputs=(loc, conf, prior), n_priors=n_priors)
            return
        if node.attrs.get("pixel_priors") or node.attrs.get("opencv_pixel"):
            from ...backends.onnx_backend import values_shaped
            from ...errors import ExportError
            if node.inputs[2] in values_shaped(ctx.graph):   # e.g. a Proposal's rois: fewer rows in a run
                raise ExportError(f"layer '{node.name}' (DetectionOutput): its pixel priors' count depends on "
                                  f"values (a Proposal's rois), but the graph would fix it at "
                                  f"{ctx.shape(node.inputs[2])[-1] // (5 if node.attrs.get('pixel_priors') else 4)}")
        prior, P = node.inputs[2], ctx.shape(node.inputs[2])[-1] // 4
        if node.attrs.get("pixel_priors"):
            prior, P = _onnx_pixel_priors(ctx, node), ctx.shape(node.inputs[2])[-1] // 5
        if node.attrs.get("combined"):
            C = node.attrs["num_classes"]
            loc, conf = node.inputs[:2]

            # (N, everything) first, as split_combined_refinedet reads the blobs
            loc, conf = (ctx.op("Flatten", [x], f"{hint}_flat", axis=1) for x, hint in ((loc, "loc"), (conf, "conf")))

            def part(x, start, end, hint):
                bounds = [ctx.i64([v]) for v in (start, end, 1)]   # starts, ends, axes
                return ctx.op("Slice", [x] + bounds, hint)
            inputs = (part(loc, 0, 4 * P, "odm_loc"), part(conf, 0, C * P, "odm_conf"), prior,
                      part(conf, C * P, (C + 2) * P, "arm_conf"), part(loc, 4 * P, 8 * P, "arm_loc"))
            emit_detection_output(ctx, node, inputs=inputs, n_priors=P)
            return
        emit_detection_output(ctx, node, inputs=(*node.inputs[:2], prior, *node.inputs[3:]), n_priors=P)

    def pytorch_source(self, node, emit):
        defaults = inspect.signature(DetectionOutput.__init__).parameters
        kwargs = module_kwargs(node.attrs, node.attrs["layout"])
        if not node.attrs["arm"]:
            del kwargs["objectness"]   # read only with RefineDet's arm conf
        args = [str(kwargs.pop("num_classes"))]
        for key, value in kwargs.items():
            if key in ("background", "nms_threshold", "code_type") or value != defaults[key].default:
                args.append(f"{key}={emit.lit(value)}")
        emit.note(f"{node.name} (DetectionOutput): the number of rows depends on the data (at most "
                  f"{emit.out_shape(0)[2]} at the prototxt's batch size); NMS runs eagerly on the CPU "
                  f"(ssd_nms), so this layer does not trace or export to a static graph.")
        emit.helper(TORCH_SSD_NMS)
        m = emit.module(f"{emit.helper(TORCH_DETECTION_OUTPUT)}({', '.join(args)})")
        if node.attrs.get("levels"):   # synopsys-caffe: the per-level bottoms gathered first
            pieces = tuple(tuple(tuple(tuple(x) if isinstance(x, list) else x for x in pc) for pc in group)
                           for group in node.attrs["pieces"])
            got = emit.tmp("levels")
            emit.stmt(f"{got} = {emit.helper(gather_levels)}(({', '.join(emit.inputs)},), {emit.lit(pieces)})")
            return f"{m}(*{got})"
        if node.attrs["states"]:
            return f"{m}({', '.join(emit.inputs[:3])}, state={emit.inputs[3]})"
        if node.attrs.get("opencv_pixel") and node.attrs["clip"]:   # the 4th bottom's H and W bound the boxes
            return f"{m}({', '.join(emit.inputs[:3])}, image={emit.inputs[3]})"
        inputs = list(emit.inputs)
        if node.attrs.get("pixel_priors"):   # OpenVINO's priors in pixels, made SSD's first
            w, h = node.attrs["pixel_priors"]
            inputs[2] = emit.tmp("priors")
            emit.stmt(f"{inputs[2]} = {emit.helper(openvino_pixel_priors)}({emit.inputs[2]}, {w}, {h}, "
                      f"{node.attrs['variance_in_target']})")
        if node.attrs.get("combined"):
            split = emit.helper(split_combined_refinedet)
            return f"{m}(*{split}({', '.join(inputs[:3])}, {node.attrs['num_classes']}))"
        return f"{m}({', '.join(inputs[:3 + node.attrs['arm']])})"


@register_layer("DetectionOutputRefine")
class DetectionOutputRefine(DetectionOutputLayer):
    """Xilinx's Caffe (Vitis AI; the copy in 695kede/xilinx-edge-ai's Caffe-Segmentation caffe-master,
    detection_output_refine_layer.cpp): RefineDet's DetectionOutput forward under a type of its own, its
    4th bottom the arm confidences and its 5th the arm locations."""

    def parse(self, lp):
        if len(lp.bottom) not in (4, 5):
            raise LayerError(f"DetectionOutputRefine takes 4 or 5 bottoms (odm loc, odm conf, priors, arm conf"
                             f"[, arm loc]), got {len(lp.bottom)}")
        return super().parse(lp)

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)
        if attrs.get("arm", 0) != len(in_shapes) - 3:
            raise LayerError(f"DetectionOutputRefine: bottom 3 {list(in_shapes[3])} must be the arm confidences, "
                             f"(N, 2 x the priors)")
        return shapes


@register_layer("DetectionOutputExtended")
class DetectionOutputExtended(DetectionOutputLayer):
    """openvinotoolkit/training_toolbox_caffe's DetectionOutputExtended (5e543a4,
    caffe/src/caffe/layers/detection_output_extended_layer.cpp, the person-detection-action-recognition
    nets): SSD's DetectionOutput for two classes over one map's priors, loc (N, H, W, 4 A); rows of 10,
    SSD's 7 then the prior's anchor, x and y cell.  It scores class 1 only (whatever background_label_id
    says) and never clips the boxes."""

    def parse(self, lp):
        if len(lp.bottom) != 3:
            raise LayerError(f"DetectionOutputExtended takes 3 bottoms (loc, conf, priors), got {len(lp.bottom)}")
        attrs = super().parse(lp)
        if attrs["num_classes"] != 2:   # LayerSetUp's CHECK
            raise LayerError(f"DetectionOutputExtended takes num_classes 2, got {attrs['num_classes']}")
        if attrs["background"] != 0:
            attrs["reading_notes"] = [f"DetectionOutputExtended scores class 1 only (its loop starts there): "
                                      f"background_label_id {attrs['background']} is not read"]
        attrs.update(background=0, clip=False)
        return attrs

    def infer(self, attrs, in_shapes):
        loc, prior = in_shapes[0], in_shapes[2]
        if len(loc) != 4 or loc[3] % 4:
            raise LayerError(f"DetectionOutputExtended reads loc as (N, H, W, 4 x anchors), got {list(loc)}")
        shapes = super().infer(attrs, in_shapes)
        h, w, a = loc[1], loc[2], loc[3] // 4
        if h * w * a != prior[2] // 4:
            raise LayerError(f"DetectionOutputExtended: loc {list(loc)} holds {h * w * a} anchors, the priors "
                             f"{prior[2] // 4}")
        attrs["cells"] = (w, a)
        return [shapes[0][:3] + (shapes[0][3] + 3,)]

