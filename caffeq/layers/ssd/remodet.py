"""UrwLee/Experience's remodet fork (remodet_repository_LEE, a59d5b9): its PriorBox with normalized
sizes, its DetOut, and its own DetectionOutput (not SSD's).

- PriorBox with `pro_width` / `pro_height` (prior_box_layer.cpp): one prior per pair, its size given
  as fractions of the image's width and height (each in (0, 1]), in place of min_size (both together
  are the fork's LOG(FATAL)); flip, aspect_ratio and max_size are not read.  The image size comes from
  the second bottom, the step is image / map in float32, the offset 0.5 (the fork has no step, offset
  or img_size fields).  Per cell (row-major) and pair: centre_x = float((w + 0.5) * step_x), then
  xmin = float(centre_x / IW (float32) - pro_width / 2 (double)), likewise y and the max corners;
  `clip` clamps them to [0, 1]; variances as SSD's (1 or 4 values, 0.1 unset).
- DetOut (src/caffe/mask/det_out_layer.cpp, bbox_func.cpp): bottoms loc (N, P * 4 * (C - 1)), conf
  (N, P * C, class scores as given: the nets feed a Sigmoid), priors (1, 2, P * 4); C = num_classes with
  the background.  The loc of image i is read at i * P * 4 (4 numbers a prior, whatever C: the fork is
  consistent only for C = 2 or batch 1).  CENTER_SIZE decodes as cx = l0 * pw * v0 + pcx, w =
  exp(l2 * v2) * pw, corners cx -/+ w / 2 (in double, stored as float); any other code type as corners
  (prior + v * l).  For each image and each class j >= 1, "fast NMS with voting": the scores above
  conf_threshold, stably sorted, cut to top_k, then each candidate is compared with every box kept so
  far (IoU = inter / (A + B - inter), areas without + 1): IoU >= 0.75 puts it in that box's voting list,
  IoU >= nms_threshold drops it; a box kept votes for itself.  Every kept box with more than one vote
  becomes the score-weighted mean of its list (float32, in list order), in the image's decoded boxes
  (later classes see it).  Rows [image, label, score, xmin, ymin, xmax, ymax] (+ the prior's index with
  ndim_detout 8), boxes clipped to [0, 1], those whose clipped area is below size_threshold dropped;
  label = target_labels[j - 1] if given, else j - 1 + alias_id.  None at all: one row of -1.  vote_or_not
  Ori and Fast run plain greedy NMS on the same candidates (suppressed at IoU >= / > nms_threshold);
  its soft NMS types and the ARM mode (5 bottoms) are refused.
- DetectionOutput with remodet's fields (detection_output_layer.cpp, bbox_util.cpp): visual_param is
  required (the fork's CHECK; it only says whether to draw on a 4th bottom, which caffeq never does);
  variance_encoded_in_target reads the loc as the scaled offsets (DetOut's CHECK refuses it).
  Loc is shared (N, P * 4); only class 1's score is read; SSD's decoding (cx = v0 * l0 * pw + pcx) and
  SSD's JaccardOverlap (0 for disjoint boxes, sizes 0 for inverted ones); the same voting NMS (its
  ApplyNMSFastUnit); each kept box clipped, labelled 1; size_threshold is read but never applied.

Shapes: the row count is known only after a run; infer gives the most rows (N x (C - 1) x min(top_k, P)
for DetOut, N x min(top_k, P) for DetectionOutput).  ONNX: remodet_onnx.py (a Scan for the keep
decisions, the votes' weighted means as a MatMul).  The torch functions below serve `forward` and are copied into model.py.
"""
import math

import numpy as np
import torch
from torch import nn

from ..registry import Layer, LayerError, claim_layers, need_blobs, register_layer, torch_sources
from .common import CENTER_SIZE, CORNER_SIZE, SizeOnlyPriors, legacy_hw, prior_output
from .nms import TORCH_SSD_NMS, box_sizes, jaccard_overlaps, nms_candidates

F32 = np.float32

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def remodet_priors(widths: list[float], heights: list[float], variance: list[float], lh: int, lw: int, ih: int,
                   iw: int, clip: bool = False):
    """remodet's PriorBox (1, 2, lh * lw * P * 4) in float32 for normalized sizes (widths, heights: the
    pro_width / pro_height pairs as float32 values)."""
    f32, f64 = torch.float32, torch.float64
    step_x = torch.tensor(float(iw), dtype=f32) / torch.tensor(float(lw), dtype=f32)
    step_y = torch.tensor(float(ih), dtype=f32) / torch.tensor(float(lh), dtype=f32)
    # (w + 0.5) * step in double, the centre kept as float, divided by the image size in float32
    cx = ((torch.arange(lw, dtype=f64) + 0.5) * step_x.double()).float() / torch.tensor(float(iw), dtype=f32)
    cy = ((torch.arange(lh, dtype=f64) + 0.5) * step_y.double()).float() / torch.tensor(float(ih), dtype=f32)
    half_w = torch.tensor(widths, dtype=f32).double() / 2.0
    half_h = torch.tensor(heights, dtype=f32).double() / 2.0
    x = cx.double()[None, :, None]
    y = cy.double()[:, None, None]
    corners = torch.broadcast_tensors(x - half_w, y - half_h, x + half_w, y + half_h)
    coords = torch.stack(corners, dim=-1).to(f32).reshape(-1)
    return prior_output(coords, variance, clip)


class RemodetPriorBox(nn.Module):
    """remodet_priors from the bottoms' spatial sizes at run time (never their values)."""

    def __init__(self, widths, heights, variance, clip=False):
        super().__init__()
        self.widths, self.heights, self.variance, self.clip = widths, heights, variance, clip

    def forward(self, feat, img):
        lh = feat.shape[2] if feat.dim() > 2 else 1
        lw = feat.shape[3] if feat.dim() > 3 else 1
        ih = img.shape[2] if img.dim() > 2 else 1
        iw = img.shape[3] if img.dim() > 3 else 1
        out = remodet_priors(self.widths, self.heights, self.variance, lh, lw, ih, iw, self.clip)
        return out.to(device=feat.device, dtype=feat.dtype)


def remodet_decode(loc, prior, var, center: bool, ssd_order: bool):
    """Each prior's box (P, 4) float32 from its loc (P, 4), prior corners and variances (P, 4): corners
    (prior + v * l) unless center; with center, DetOut's products (l * size * v) or, ssd_order, SSD's
    (v * l * size); the corners cx -/+ w / 2 computed in double."""
    if not center:
        return prior + var * loc
    pw, ph = prior[:, 2] - prior[:, 0], prior[:, 3] - prior[:, 1]
    if bool((pw <= 0).any()) or bool((ph <= 0).any()):
        raise ValueError("remodet decodes CENTER_SIZE against priors of positive size only (its CHECK_GT)")
    pcx, pcy = (prior[:, 0] + prior[:, 2]) / 2, (prior[:, 1] + prior[:, 3]) / 2
    if ssd_order:
        cx, cy = var[:, 0] * loc[:, 0] * pw + pcx, var[:, 1] * loc[:, 1] * ph + pcy
        w, h = torch.exp(var[:, 2] * loc[:, 2]) * pw, torch.exp(var[:, 3] * loc[:, 3]) * ph
    else:
        cx, cy = loc[:, 0] * pw * var[:, 0] + pcx, loc[:, 1] * ph * var[:, 1] + pcy
        w, h = torch.exp(loc[:, 2] * var[:, 2]) * pw, torch.exp(loc[:, 3] * var[:, 3]) * ph
    cx, cy, hw, hh = cx.double(), cy.double(), w.double() / 2.0, h.double() / 2.0
    return torch.stack([cx - hw, cy - hh, cx + hw, cy + hh], 1).float()


def remodet_overlaps(box, others, jaccard: bool):
    """IoU of one box (4,) with each of others (K, 4), float32: DetOut's BoundingBox::compute_iou (areas
    without clamping; a negative IoU is 0), or (jaccard) SSD's JaccardOverlap."""
    if jaccard:
        return jaccard_overlaps(box[None], others, box_sizes(box[None]), box_sizes(others))[0]
    iw = torch.minimum(box[2], others[:, 2]) - torch.maximum(box[0], others[:, 0])
    ih = torch.minimum(box[3], others[:, 3]) - torch.maximum(box[1], others[:, 1])
    inter = iw.clamp(min=0) * ih.clamp(min=0)
    a = (box[2] - box[0]) * (box[3] - box[1])
    b = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    iou = inter / (a + b - inter)
    return torch.where(iou < 0, torch.zeros((), dtype=box.dtype), iou)


def remodet_nms(boxes, scores, conf_threshold: float, nms_threshold: float, top_k: int, jaccard: bool,
             vote: bool = True, strict: bool = False):
    """remodet's NMS with box voting (NmsFastWithVoting / ApplyNMSFastUnit) on one image's boxes (P, 4) and
    one class's scores (P,), float32 on the CPU -> (kept prior indices in order, the boxes with each
    kept box that drew more than one vote replaced by the score-weighted mean of its voters).  Without
    vote, DetOut's plain greedy NMS: NmsOri (suppressed at IoU >= nms_threshold) or, strict, NmsFast
    (suppressed above it)."""
    candidates = nms_candidates(scores, conf_threshold, top_k).tolist()
    kept, votes = [], {}
    for idx in candidates:
        keep = True
        if kept:
            for k, overlap in zip(kept, remodet_overlaps(boxes[idx], boxes[kept], jaccard).tolist()):
                if vote and overlap >= 0.75:
                    votes[k].append(idx)
                if overlap > nms_threshold if strict else overlap >= nms_threshold:
                    keep = False
        if keep:
            kept.append(idx)
            votes[idx] = [idx]
    out = boxes.clone()
    for k, voters in votes.items():
        if len(voters) == 1:
            continue
        total = torch.zeros((), dtype=torch.float32)
        for v in voters:   # float32 sums in list order, as the fork's loops
            total = total + scores[v]
        mean = torch.zeros(4, dtype=torch.float32)
        for v in voters:
            mean = mean + boxes[v] * (scores[v] / total)
        out[k] = mean
    return kept, out


class RemodetDetOut(nn.Module):
    """remodet's DetOut (jaccard False, classes 1..C-1, size_threshold, labels) or its own DetectionOutput
    (jaccard True: class 1 only, SSD's decoding and overlap, label 1): (1, 1, rows, width)."""

    def __init__(self, num_classes, conf_threshold, nms_threshold, top_k, size_threshold=0.0, center=True,
                 alias_id=0, target_labels=(), width=7, detection_output=False, nms="FastVote",
                 variance_in_target=False):
        super().__init__()
        self.variance_in_target = variance_in_target   # remodet's DetectionOutput: the loc holds v x the offset
        self.nms = nms   # FastVote, Ori or Fast (DetOut's vote_or_not)
        self.num_classes, self.conf_threshold, self.nms_threshold = num_classes, conf_threshold, nms_threshold
        self.top_k, self.size_threshold, self.center = top_k, size_threshold, center
        self.alias_id, self.target_labels, self.width = alias_id, list(target_labels), width
        self.detection_output = detection_output

    def forward(self, loc, conf, prior):
        dev, dtype = loc.device, loc.dtype
        loc, conf, prior = (t.detach().float().cpu() for t in (loc, conf, prior))
        n, c = conf.shape[0], self.num_classes
        p = prior.reshape(2, -1, 4)
        num_priors = p.shape[1]
        flat_loc = loc.reshape(-1)
        scores = conf.reshape(n, num_priors, c)
        classes = [1] if self.detection_output else range(1, c)
        rows = []
        for i in range(n):
            # the fork reads image i's loc at i * P * 4, 4 numbers a prior
            variances = torch.ones_like(p[1]) if self.variance_in_target else p[1]   # v = 1 is exact
            boxes = remodet_decode(flat_loc[i * num_priors * 4:(i + 1) * num_priors * 4].reshape(-1, 4), p[0], variances,
                                   self.center, self.detection_output)
            for j in classes:
                kept, boxes = remodet_nms(boxes, scores[i, :, j].contiguous(), self.conf_threshold,
                                       self.nms_threshold, self.top_k, self.detection_output,
                                       vote=self.nms == "FastVote", strict=self.nms == "Fast")
                for prior_id in kept:
                    box = boxes[prior_id].clamp(0.0, 1.0)
                    if not self.detection_output and (box[2] - box[0]) * (box[3] - box[1]) < self.size_threshold:
                        continue
                    if self.detection_output:
                        label = 1
                    else:
                        label = self.target_labels[j - 1] if self.target_labels else j - 1 + self.alias_id
                    row = [float(i), float(label), float(scores[i, prior_id, j])] + box.tolist()
                    rows.append(row + [float(prior_id)] if self.width == 8 else row)
        if not rows:
            return torch.full((1, 1, 1, self.width), -1.0, device=dev, dtype=dtype)
        return torch.tensor(rows, dtype=torch.float32).reshape(1, 1, -1, self.width).to(device=dev, dtype=dtype)


TORCH_REMODET_PRIORS = torch_sources(remodet_priors, RemodetPriorBox)
TORCH_REMODET_DETOUT = torch_sources(remodet_decode, remodet_overlaps, remodet_nms, RemodetDetOut)


# ---- specs ---------------------------------------------------------------------------------------


@claim_layers("PriorBox", lambda lp: bool(len(lp.prior_box_param.pro_width) or len(lp.prior_box_param.pro_height)))
class RemodetPriorBoxLayer(SizeOnlyPriors):
    torch_module = TORCH_REMODET_PRIORS
    helpers = (prior_output,)
    module_args = ("widths", "heights", "variance", "clip")

    def parse(self, lp):
        need_blobs(lp, "PriorBox", 2, roles="feature map, image")
        p = lp.prior_box_param
        if len(p.min_size):
            raise LayerError("prior_box_param: min_size and pro_width could not be provided at the same time "
                             "(remodet's PriorBox)")
        if len(p.pro_width) != len(p.pro_height):
            raise LayerError(f"prior_box_param has {len(p.pro_width)} pro_width and {len(p.pro_height)} pro_height; "
                             f"remodet's PriorBox takes them in pairs")
        sizes = [float(F32(v)) for v in list(p.pro_width) + list(p.pro_height)]
        if any(not 0 < v <= 1 for v in sizes):
            raise LayerError(f"prior_box_param.pro_width / pro_height are fractions of the image, in (0, 1]; got "
                             f"{sizes}")
        for name in ("img_size", "img_h", "img_w", "step", "step_h", "step_w", "offset"):
            if p.HasField(name):
                raise LayerError(f"prior_box_param.{name}: remodet's PriorBox (pro_width / pro_height) has no such "
                                 f"field")
        var = [float(v) for v in p.variance]
        if len(var) not in (0, 1, 4) or any(v <= 0 for v in var):
            raise LayerError(f"prior_box_param.variance needs 1 or 4 positive values, got {var}")
        n = len(p.pro_width)
        # SSD's default clip (false) is remodet's too; caffe.proto here carries OpenCV's (true)
        return {"widths": sizes[:n], "heights": sizes[n:], "variance": var or [0.1],
                "clip": bool(p.clip) if p.HasField("clip") else False}

    def infer(self, attrs, in_shapes):
        h, w = legacy_hw(in_shapes[0])
        if h * w <= 0:
            raise LayerError(f"feature map {list(in_shapes[0])} gives no priors")
        return [(1, 2, h * w * len(attrs["widths"]) * 4)]

    @staticmethod
    def boxes(attrs, feat_shape, img_shape):
        (lh, lw), (ih, iw) = legacy_hw(feat_shape), legacy_hw(img_shape)
        return remodet_priors(attrs["widths"], attrs["heights"], attrs["variance"], lh, lw, ih, iw, attrs["clip"])


def _thresholds(p, kind):
    """The thresholds remodet CHECKs are given: conf, nms and size thresholds and top_k, each >= 0 (top_k > 0)."""
    for name in ("conf_threshold", "nms_threshold", "size_threshold", "top_k"):
        if not p.HasField(name):
            raise LayerError(f"{kind}: detection_output_param.{name} is required (remodet's CHECK)")
    values = {name: float(F32(getattr(p, name))) for name in ("conf_threshold", "nms_threshold", "size_threshold")}
    if any(v < 0 for v in values.values()):
        raise LayerError(f"{kind}: detection_output_param thresholds must be >= 0, got {values}")
    if p.top_k <= 0:
        raise LayerError(f"{kind}: detection_output_param.top_k must be positive, got {p.top_k}")
    return {**values, "top_k": int(p.top_k)}


class _RemodetDetections(Layer):
    #: the row count is known only after a run; infer gives the most rows
    data_dependent_shape = True
    detection_output = False

    def common(self, lp, kind):
        need_blobs(lp, kind, (3, 4) if self.detection_output else 3, 1)
        p = lp.detection_output_param
        if not p.HasField("num_classes"):
            raise LayerError(f"{kind}: detection_output_param.num_classes is required")
        if p.background_label_id != 0:
            raise LayerError(f"{kind}: background_label_id must be 0 (remodet's CHECK), got {p.background_label_id}")
        return {"num_classes": int(p.num_classes), "center": p.code_type == CENTER_SIZE, **_thresholds(p, kind)}

    def check_shapes(self, attrs, in_shapes, loc_per_prior):
        loc, conf, prior = in_shapes[:3]
        if len(prior) < 3 or prior[2] % 4:
            raise LayerError(f"priors must be shaped (1, 2, 4 x priors), got {list(prior)}")
        n_priors, c = prior[2] // 4, attrs["num_classes"]
        if loc[0] != conf[0]:
            raise LayerError(f"loc and conf disagree on the batch: {loc[0]} vs {conf[0]}")
        if math.prod(loc[1:]) != n_priors * loc_per_prior:
            raise LayerError(f"loc {list(loc)} must hold {n_priors} priors x {loc_per_prior} numbers")
        if math.prod(conf[1:]) != n_priors * c:
            raise LayerError(f"conf {list(conf)} must hold {n_priors} priors x {c} class scores")
        return n_priors

    def forward(self, attrs, params, loc, conf, prior, *images):
        try:
            return self.module(attrs)(loc, conf, prior)
        except ValueError as e:   # a prior of no size under CENTER_SIZE: the data's, one clear line
            raise LayerError(f"{self.types[0]}: {e}") from None

    def module(self, attrs):
        return RemodetDetOut(**self.kwargs(attrs))

    @staticmethod
    def kwargs(attrs):
        keys = ("num_classes", "conf_threshold", "nms_threshold", "top_k", "size_threshold", "center", "alias_id",
                "target_labels", "width", "detection_output", "nms", "variance_in_target")
        return {k: attrs[k] for k in keys}

    def onnx(self, ctx, node):
        from .remodet_onnx import emit_remodet_detections  # onnx is imported only to export
        emit_remodet_detections(ctx, node)

    def pytorch_source(self, node, emit):
        args = ", ".join(f"{k}={emit.lit(v)}" for k, v in self.kwargs(node.attrs).items())
        emit.note(f"{node.name} ({node.type}): the number of rows depends on the data (at most "
                  f"{emit.out_shape(0)[2]}); its voting NMS runs eagerly on the CPU, so this layer does not trace "
                  f"or export to a static graph.")
        emit.helper(TORCH_SSD_NMS)   # box_sizes, jaccard_overlaps, nms_candidates
        m = emit.module(f"{emit.helper(TORCH_REMODET_DETOUT)}({args})")
        return f"{m}({', '.join(emit.inputs[:3])})"


@register_layer("DetOut")
class DetOut(_RemodetDetections):
    def parse(self, lp):
        attrs = self.common(lp, "DetOut")
        p = lp.detection_output_param
        c = attrs["num_classes"]
        if c < 2:
            raise LayerError(f"DetOut: num_classes counts the background too, so it must be >= 2, got {c}")
        labels = [int(v) for v in p.target_labels]
        if labels and len(labels) != c - 1:
            raise LayerError(f"DetOut: detection_output_param has {len(labels)} target_labels for num_classes {c}; "
                             f"remodet takes one per class but the background ({c - 1})")
        nms = p.NmsType.Name(p.vote_or_not)
        if nms not in ("FastVote", "Ori", "Fast"):
            raise LayerError(f"DetOut: vote_or_not {nms} (soft NMS) is not supported; caffeq runs FastVote (its "
                             f"default), Ori and Fast")
        if p.ndim_detout not in (7, 8):
            raise LayerError(f"DetOut: ndim_detout must be 7 or 8, got {p.ndim_detout}")
        if p.variance_encoded_in_target:
            raise LayerError("DetOut: variance_encoded_in_target must be false (remodet's CHECK)")
        return {**attrs, "alias_id": int(p.alias_id), "target_labels": labels, "width": int(p.ndim_detout),
                "detection_output": False, "nms": nms, "variance_in_target": False}

    def infer(self, attrs, in_shapes):
        c = attrs["num_classes"]
        n_priors = self.check_shapes(attrs, in_shapes, 4 * (c - 1))
        if c > 2 and in_shapes[0][0] > 1:
            attrs["reading_notes"] = [f"DetOut with {c} classes reads each image's loc at a stride of 4 numbers a "
                                      f"prior (the fork's GetLocPreds), inside the first image's {4 * (c - 1)}: "
                                      f"images after the first get another image's boxes, as in the fork"]
        return [(1, 1, in_shapes[0][0] * (c - 1) * min(attrs["top_k"], n_priors), attrs["width"])]


def _remodet_detection_output(lp):
    """A DetectionOutput that sets remodet's own fields (SSD has none of them)."""
    p = lp.detection_output_param
    return any(p.HasField(f) for f in ("visual_param", "conf_threshold", "size_threshold", "top_k"))


@claim_layers("DetectionOutput", _remodet_detection_output)
class RemodetDetectionOutput(_RemodetDetections):
    detection_output = True

    def parse(self, lp):
        attrs = self.common(lp, "DetectionOutput (remodet)")
        p = lp.detection_output_param
        if not p.HasField("visual_param") or not p.visual_param.HasField("visualize"):
            raise LayerError("DetectionOutput (remodet): detection_output_param.visual_param.visualize is required "
                             "(the fork's CHECK)")
        if p.visual_param.visualize and len(lp.bottom) != 4:
            raise LayerError("DetectionOutput (remodet): visual_param.visualize: true draws on a 4th bottom (the "
                             "images), which this layer lacks")
        if attrs["num_classes"] < 2:
            raise LayerError(f"DetectionOutput (remodet) reads class 1's scores, so num_classes must be >= 2, got "
                             f"{attrs['num_classes']}")
        if p.code_type == CORNER_SIZE:
            raise LayerError("DetectionOutput (remodet): code_type CORNER_SIZE is the fork's LOG(FATAL) (it decodes "
                             "CORNER and CENTER_SIZE)")
        return {**attrs, "alias_id": 0, "target_labels": [], "width": 7, "detection_output": True, "nms": "FastVote",
                "variance_in_target": bool(p.variance_encoded_in_target),
                "reading_notes": ["DetectionOutput read as remodet's (UrwLee/Experience): class 1's scores, "
                                  "NMS with box voting, every row labelled 1; its visual_param is not drawn"]}

    def infer(self, attrs, in_shapes):
        n_priors = self.check_shapes(attrs, in_shapes, 4)
        return [(1, 1, in_shapes[0][0] * min(attrs["top_k"], n_priors), 7)]
