"""Faster R-CNN's region proposals, and Python layers in general.

caffeq never imports code named by a model file (see registry.py): a `Python`
layer runs only when its module and class are a well-known one with a native
spec here, registered as "Python:<module>.<layer>".

- `rpn.proposal_layer.ProposalLayer` (py-faster-rcnn, and py-R-FCN, which is
  the same at TEST time): parameters from python_param.param_str, a YAML
  mapping read by param_str.py's parser (only numbers, strings, booleans
  and lists; nothing is evaluated): 'feat_stride' (required) and 'scales'
  (default 8, 16, 32), and 'ratios' (default 0.5, 1, 2), which py-faster-rcnn
  ignores but the many forks that set it pass to generate_anchors (e.g.
  bupt2-213/object_detection_caffe's lib/rpn/proposal_layer.py).  The rest is
  py-faster-rcnn's TEST configuration: RPN_PRE_NMS_TOP_N 6000,
  RPN_POST_NMS_TOP_N 300, RPN_NMS_THRESH 0.7, RPN_MIN_SIZE 16, anchors from
  generate_anchors (base 16).
  Bottoms: rpn_cls_prob_reshape (1, 2A, H, W), rpn_bbox_pred (1, 4A, H, W),
  im_info (1, 3) = [height, width, scale].  Tops: rois (R, 5) = [0, x1, y1, x2,
  y2] and optionally scores (R, 1).  The steps, in float32 as the Python layer:
  decode the deltas against the shifted anchors (sizes with the +1 pixel),
  clip to [0, width-1] x [0, height-1], drop boxes narrower or lower than
  min_size * scale, sort by score (ties: higher index first, as
  argsort()[::-1]), keep pre_nms_top_n, greedy NMS (a box goes when its IoU,
  +1 pixel sizes, with a kept box is > the threshold: py-faster-rcnn's default
  GPU NMS; its CPU fallback uses >=), keep post_nms_top_n.  R depends on the
  data: the static shape is the most rows it can write.  One image per batch,
  as the Python layer asserts.
- `SSH.layers.proposal_layer.ProposalLayer` (mahyarnajibi/SSH, one per detection module): the same
  steps with its param_str's 'feat_stride' (required), 'scales' (default 8, 16, 32), 'ratios'
  (default 0.5, 1, 2) and 'base_size' (default 16), and SSH's TEST configuration
  (SSH/configs/default_config.yml): the best N_DETS_PER_MODULE = 1000 boxes by score, boxes smaller
  than ANCHOR_MIN_SIZE = 0 dropped (none, as clipped sides are >= 1) and no NMS (SSH runs it outside
  the net, over all modules).  When no box is left, rois is the one row [0, 0, 0, 16, 16] and scores
  has no row, as the module writes.
- PVANet's C++ `Proposal` (pva_proposal.py) is this computation with the `pva` switches: float32
  anchors, im_info [height, width, scale_h, scale_w], small boxes kept with score 0, its sort.
- zhanglaplace/faster-rcnn-cplusplus2's C++ `RPN` (frcnn.py) is the same computation with a few
  differences, switched on by `cpp_rpn` here: the size filter on the unclipped sizes, clipping to
  [0, int(width)] x [0, int(height)], and NMS that drops IoU >= the threshold.
- Any other Python layer without bottoms is a data layer ("PythonData"): its
  top shapes must be given by the user (`--input-shape NAME=N,C,H,W`).

ONNX: anchors and their sizes are constants; decoding, clipping and the size
filter are elementwise ops, then TopK, NonMaxSuppression (boxes given as
[y1, x1, y2 + 1, x2 + 1] so that ONNX's IoU is the +1 pixel one) and Gather.  SSH's form keeps
the top-k rows the size filter left (Compress) and pads the empty case with its default roi.
"""
import math

import numpy as np
import torch
from torch import nn

from ..errors import CaffeqError, ExportError
from .param_str import parse_param_str
from .registry import Layer, LayerError, MissingInputShape, need_blobs, register_layer, torch_sources
from .sort_box import pva_sort_order

FLT_MAX = float(np.finfo(np.float32).max)

# py-faster-rcnn's __C.TEST values (lib/fast_rcnn/config.py)
TEST_CONFIG = {"pre_nms_top_n": 6000, "post_nms_top_n": 300, "nms_thresh": 0.7, "min_size": 16}


# ---- anchors ------------------------------------------------------------------------------

def generate_anchors(base_size=16, ratios=(0.5, 1, 2), scales=(8, 16, 32), c_round=False, f32=False):
    """py-faster-rcnn's generate_anchors: (A, 4) float64 [x1, y1, x2, y2], ratios outer, scales inner.

    The (0, 0, base-1, base-1) window is reshaped to each ratio keeping its area (sides rounded half
    to even, as numpy's round; c_round: half away from zero, as C's round), then scaled; every box
    keeps the window's centre, and a box of width w spans w - 1 (pixel sizes count both ends).
    f32 (PVANet's C++ generate_anchors): every step in float32, sides rounded as (int)(v + 0.5f)."""
    cast = np.float32 if f32 else np.float64
    side, one, half = cast(base_size), cast(1), cast(0.5)
    centre = half * (side - one)
    rnd = (lambda v: float(np.sign(v) * np.floor(abs(v) + 0.5))) if c_round else (lambda v: float(np.round(v)))
    if f32:
        rnd = lambda v: float(np.trunc(v + half))   # noqa: E731
    rows = []
    for ratio in ratios:
        w = cast(rnd(np.sqrt(side * side / cast(ratio))))
        h = cast(rnd(w * cast(ratio)))
        for scale in scales:
            hw, hh = half * (w * cast(scale) - one), half * (h * cast(scale) - one)
            rows.append([centre - hw, centre - hh, centre + hw, centre + hh])
    return np.array(rows, cast).astype(np.float64).reshape(-1, 4)


def shifted_anchors(anchors, height: int, width: int, feat_stride: int):
    """Anchors (A, 4) placed on every cell of an H x W map: (H * W * A, 4), rows ordered (h, w, a).
    Integer shifts added in float64, as the Python layer does."""
    sx = torch.arange(width, dtype=torch.float64, device=anchors.device) * feat_stride
    sy = torch.arange(height, dtype=torch.float64, device=anchors.device) * feat_stride
    gx = sx[None, :].expand(height, width)
    gy = sy[:, None].expand(height, width)
    shifts = torch.stack([gx, gy, gx, gy], dim=-1).reshape(-1, 1, 4)
    return (anchors.to(torch.float64)[None] + shifts).reshape(-1, 4)


# ---- the proposal computation (also copied into model.py) ---------------------------------------

def greedy_nms(n: int, overlaps_after, thresh: float, max_keep: int, inclusive: bool = False):
    """Greedy NMS over n candidates sorted best first, as the Caffe forks loop it: a candidate goes when
    its overlap with a kept one is > thresh (inclusive: >= thresh).  overlaps_after(i) gives candidate
    i's float32 overlaps with candidates i+1..n-1.  The kept indices, at most max_keep (<= 0: all)."""
    thr = torch.tensor(thresh, dtype=torch.float32)
    struck, keep = [False] * n, []
    for i in range(n):
        if struck[i]:
            continue
        keep.append(i)
        if (max_keep > 0 and len(keep) >= max_keep) or i + 1 == n:
            break
        overlap = overlaps_after(i)
        for j in torch.nonzero((overlap >= thr) if inclusive else (overlap > thr)).flatten().tolist():
            struck[i + 1 + j] = True
    return keep


def rpn_nms(boxes, thresh: float, max_keep: int, inclusive: bool = False):
    """Greedy NMS over boxes (P, 4) sorted best first by IoU, sizes counting both end pixels (+1)."""
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)

    def iou_after(i):
        width = torch.clamp(torch.minimum(x2[i], x2[i + 1:]) - torch.maximum(x1[i], x1[i + 1:]) + 1, min=0)
        height = torch.clamp(torch.minimum(y2[i], y2[i + 1:]) - torch.maximum(y1[i], y1[i + 1:]) + 1, min=0)
        inter = width * height
        return inter / (areas[i] + areas[i + 1:] - inter)

    return greedy_nms(boxes.shape[0], iou_after, thresh, max_keep, inclusive)


def rpn_decode_centres(anchor_boxes, deltas):
    """py-faster-rcnn's bbox_transform_inv up to the corners: each anchor's centre moves by d * size,
    its size scales by exp(d); sizes count both end pixels.  -> centre x, centre y, width, height."""
    widths = anchor_boxes[:, 2] - anchor_boxes[:, 0] + 1.0
    heights = anchor_boxes[:, 3] - anchor_boxes[:, 1] + 1.0
    ctr_x = anchor_boxes[:, 0] + 0.5 * widths
    ctr_y = anchor_boxes[:, 1] + 0.5 * heights
    return (deltas[:, 0] * widths + ctr_x, deltas[:, 1] * heights + ctr_y,
            torch.exp(deltas[:, 2]) * widths, torch.exp(deltas[:, 3]) * heights)


def rpn_decode_boxes(anchor_boxes, deltas, info, min_size: float, cpp_rpn: bool = False, pva: bool = False):
    """py-faster-rcnn's bbox_transform_inv and clip_boxes: each anchor moved by its deltas and
    clipped to the image of info = [height, width, scale].  Returns the boxes (P, 4) and the
    indices of those at least min_size (at the original image's scale) on both sides.
    cpp_rpn (faster-rcnn-cplusplus2's RPN layer): a box goes when its unclipped width or height is
    below min_size * scale, and the rest clip to [0, int(width)] x [0, int(height)].  pva (PVANet):
    info = [height, width, scale_h, scale_w], the clipped width against min_size * scale_w (luoyetx/mini-caffe's
    port gives [height, width, scale], one scale for both)."""
    dt = anchor_boxes.dtype
    pred_x, pred_y, pred_w, pred_h = rpn_decode_centres(anchor_boxes, deltas)
    zero = torch.zeros((), dtype=dt)
    x_max, y_max = info[1] - 1, info[0] - 1
    if cpp_rpn:
        x_max, y_max = torch.trunc(info[1]), torch.trunc(info[0])
    x1 = torch.maximum(torch.minimum(pred_x - 0.5 * pred_w, x_max), zero)
    y1 = torch.maximum(torch.minimum(pred_y - 0.5 * pred_h, y_max), zero)
    x2 = torch.maximum(torch.minimum(pred_x + 0.5 * pred_w, x_max), zero)
    y2 = torch.maximum(torch.minimum(pred_y + 0.5 * pred_h, y_max), zero)
    limit = torch.tensor(min_size, dtype=dt) * info[2]
    limit_w = torch.tensor(min_size, dtype=dt) * info[3] if pva and info.shape[0] > 3 else limit
    if cpp_rpn:
        keep = torch.nonzero(~((pred_w < limit) | (pred_h < limit))).flatten()
    else:
        keep = torch.nonzero(((x2 - x1 + 1) >= limit_w) & ((y2 - y1 + 1) >= limit)).flatten()
    return torch.stack([x1, y1, x2, y2], dim=1), keep


def rpn_proposals(cls_prob, bbox_pred, im_info, anchors, feat_stride: int, pre_nms_top_n: int,
                  post_nms_top_n: int, nms_thresh: float, min_size: float, apply_nms: bool = True,
                  cpp_rpn: bool = False, pva: bool = False):
    """py-faster-rcnn's ProposalLayer.forward for one image: cls_prob (1, 2A, H, W) (the second A
    channels are the object scores), bbox_pred (1, 4A, H, W), im_info (1, 3) = [height, width,
    scale], anchors (A, 4).  Returns rois (R, 5) = [0, x1, y1, x2, y2] and scores (R, 1).
    apply_nms=False (SSH at TEST): the best pre_nms_top_n boxes, without NMS.  cpp_rpn: the C++
    RPN layer's size filter and clipping (rpn_decode_boxes) and its NMS, which drops IoU >= thresh.
    pva: PVANet's C++ Proposal: small boxes stay with score 0, its sort_box order, scores (R,)."""
    if cls_prob.shape[0] != 1:
        raise ValueError(f"region proposals take one image per batch, got {cls_prob.shape[0]}")
    n_anchors = anchors.shape[0]
    height, width = cls_prob.shape[2], cls_prob.shape[3]
    dt = bbox_pred.dtype
    scores = cls_prob[0, n_anchors:].permute(1, 2, 0).reshape(-1)       # (H * W * A,), order (h, w, a)
    deltas = bbox_pred[0].permute(1, 2, 0).reshape(-1, 4)
    boxes = shifted_anchors(anchors, height, width, feat_stride).to(dt)
    info = im_info.reshape(-1).to(dt)
    proposals, keep = rpn_decode_boxes(boxes, deltas, info, min_size, cpp_rpn, pva)
    if pva:
        scores = scores * torch.zeros_like(scores).index_fill_(0, keep, 1.0)
        order = pva_sort_order(scores, pre_nms_top_n)
    else:
        proposals, scores = proposals[keep], scores[keep]
        order = torch.sort(scores, stable=True)[1].flip(0)   # best first; ties: higher index first
    if pre_nms_top_n > 0:
        order = order[:pre_nms_top_n]
    proposals, scores = proposals[order], scores[order]
    if apply_nms:
        kept = rpn_nms(proposals.detach().float().cpu(), nms_thresh, post_nms_top_n, cpp_rpn)
        kept = torch.tensor(kept, dtype=torch.long, device=proposals.device)
        proposals, scores = proposals[kept], scores[kept]
    rois = torch.cat([torch.zeros_like(proposals[:, :1]), proposals], dim=1)
    return rois, (scores if pva else scores[:, None])


def ssh_empty_rois(rois):
    """SSH's proposal layer writes the one roi [0, 0, 0, 16, 16] when no box is left (scores stay empty)."""
    if rois.shape[0] > 0:
        return rois
    return torch.tensor([[0.0, 0.0, 0.0, 16.0, 16.0]], dtype=rois.dtype, device=rois.device)


class RPNProposal(nn.Module):
    """Faster R-CNN's region proposal layer (rpn_proposals) with its anchors and settings;
    returns rois (R, 5), and scores (R, 1) too when with_scores.  R depends on the data.
    ssh=True: SSH's form (no NMS, the one default roi when none is left).  cpp_rpn=True: the C++ RPN
    layer's form (rpn_proposals' cpp_rpn, on image 0 of the batch).  pva=True: PVANet's Proposal."""

    def __init__(self, anchors, feat_stride, pre_nms_top_n=6000, post_nms_top_n=300, nms_thresh=0.7,
                 min_size=16.0, with_scores=False, ssh=False, cpp_rpn=False, pva=False):
        super().__init__()
        self.anchors = anchors
        self.feat_stride, self.pre_nms_top_n, self.post_nms_top_n = feat_stride, pre_nms_top_n, post_nms_top_n
        self.nms_thresh, self.min_size, self.with_scores, self.ssh = nms_thresh, min_size, with_scores, ssh
        self.cpp_rpn, self.pva = cpp_rpn, pva

    def forward(self, cls_prob, bbox_pred, im_info):
        anchors = torch.tensor(self.anchors, dtype=torch.float64, device=cls_prob.device)
        if self.cpp_rpn:
            cls_prob, bbox_pred, im_info = cls_prob[:1], bbox_pred[:1], im_info[:1]
        rois, scores = rpn_proposals(cls_prob, bbox_pred, im_info, anchors, self.feat_stride,
                                     self.pre_nms_top_n, self.post_nms_top_n, self.nms_thresh, self.min_size,
                                     not self.ssh, self.cpp_rpn, self.pva)
        if self.ssh:
            rois = ssh_empty_rois(rois)
        if self.with_scores:
            return rois, scores
        return rois


# model.py gets these very functions, so the export runs the same code as forward (the anchors
# helper on its own: CTPN's text proposals use it too)
TORCH_ANCHORS = torch_sources(shifted_anchors)
TORCH_PROPOSAL = torch_sources(greedy_nms, rpn_nms, rpn_decode_centres, rpn_decode_boxes, pva_sort_order, rpn_proposals,
                               ssh_empty_rois, RPNProposal)


# ---- the specs --------------------------------------------------------------------------------

class _ProposalBase(Layer):
    #: the row count is known only after a run; infer gives the most rows
    data_dependent_shape = True

    def settings(self, lp):
        """{feat_stride, base_size, ratios, scales, pre_nms_top_n, post_nms_top_n, nms_thresh, min_size},
        or with "anchors" (a list of [x1, y1, x2, y2]) instead of base_size, ratios and scales; parse
        checks these, the same for every form, and makes the anchors with make_anchors"""
        raise NotImplementedError

    #: where the file gives base_size, ratios and scales, as the parse errors name them
    anchor_fields = tuple(f"python_param.param_str '{k}'" for k in ("base_size", "ratios", "scales"))

    @staticmethod
    def make_anchors(base_size, ratios, scales):
        """The (A, 4) anchors of checked settings: py-faster-rcnn's generate_anchors; a C++ port that
        rounds its sides otherwise overrides this."""
        return generate_anchors(base_size, ratios, scales)

    def parse(self, lp):
        # R-C3D's rpn.proposal_layer (same module and class, 2 bottoms) is claimed by rc3d.TwinProposalLayer
        kind = "region proposals" if lp.type == "Python" else lp.type
        need_blobs(lp, kind, 3, (1, 2), "rpn_cls_prob_reshape, rpn_bbox_pred, im_info")
        s = self.settings(lp)
        if s["feat_stride"] <= 0:
            raise LayerError(f"feat_stride must be positive, got {s['feat_stride']}")
        if not 0 <= s["nms_thresh"] <= 1:
            raise LayerError(f"nms_thresh must be in [0, 1], got {s['nms_thresh']}")
        if "anchors" in s:
            return {**s, "with_scores": len(lp.top) == 2, "name": lp.name}
        base_field, ratio_field, scale_field = self.anchor_fields
        if s["base_size"] <= 0:
            raise LayerError(f"{base_field} must be positive, got {s['base_size']}")
        for field, values in ((ratio_field, s["ratios"]), (scale_field, s["scales"])):
            if not values or any(not v > 0 for v in values):
                raise LayerError(f"{field} must be one or more positive numbers, got {values}")
        anchors = self.make_anchors(s["base_size"], s["ratios"], s["scales"])
        return {**s, "anchors": anchors.tolist(), "with_scores": len(lp.top) == 2, "name": lp.name}

    @staticmethod
    def cannot_run(attrs, in_shapes):
        """Why the proposals cannot be computed for these bottoms, or None.  Caffe's Python layer
        reshapes its tops without looking at the bottoms, so such a net loads there (a fork's own
        proposal_layer.py makes another anchor set) and fails only in forward: caffeq reads it too
        and refuses to run or export it with this reason."""
        prob, deltas, info = (tuple(s) for s in in_shapes)
        if attrs.get("foreign_keys"):
            return (f"param_str sets {attrs['foreign_keys']}, which py-faster-rcnn's ProposalLayer does not read "
                    f"(it reads 'feat_stride' and 'scales'): this net comes with a fork's proposal_layer.py, "
                    f"whose proposals caffeq does not guess")
        a = len(attrs["anchors"])
        if prob[1] != 2 * a or deltas[1] != 4 * a:
            return (f"the net scores {prob[1] // 2} anchors per position and regresses {deltas[1] // 4}, but the "
                    f"proposal layer's settings make {a} (py-faster-rcnn's scales {attrs.get('scales')} x ratios "
                    f"{attrs.get('ratios')}): this fork's proposal_layer.py makes its own anchors; give them in "
                    f"param_str 'scales' if they differ only there")
        if math.prod(info) < 3:
            return f"im_info must hold [height, width, scale], got shape {list(info)}"
        return None

    def infer(self, attrs, in_shapes):
        prob, deltas, info = in_shapes
        if len(prob) != 4 or prob[1] % 2:
            raise LayerError(f"rpn_cls_prob_reshape must be (1, 2 x anchors, H, W), got {list(prob)}")
        a = prob[1] // 2
        if len(deltas) != 4 or tuple(deltas) != (prob[0], 4 * a, prob[2], prob[3]):
            raise LayerError(f"rpn_bbox_pred must be ({prob[0]}, {4 * a}, {prob[2]}, {prob[3]}), got {list(deltas)}")
        if prob[0] != 1 and not attrs.get("cpp_rpn"):   # the C++ RPN layer reads image 0 only
            raise LayerError(f"region proposals take one image per batch (as py-faster-rcnn), got {prob[0]}")
        rows = prob[2] * prob[3] * a
        for key in ("pre_nms_top_n", "post_nms_top_n"):
            if attrs[key] > 0:
                rows = min(rows, attrs[key])
        tops = [(max(rows, 1) if attrs.get("ssh") else rows, 5)]
        if attrs["with_scores"]:
            tops.append((rows,) if attrs.get("pva") else (rows, 1))
        return tops

    @staticmethod
    def module_settings(attrs):
        """RPNProposal's arguments for this layer: forward runs that very module, and model.py builds
        it with the same values, so the two cannot drift apart."""
        return {"anchors": attrs["anchors"], "feat_stride": attrs["feat_stride"],
                "pre_nms_top_n": attrs["pre_nms_top_n"], "post_nms_top_n": attrs["post_nms_top_n"],
                "nms_thresh": attrs["nms_thresh"], "min_size": float(attrs["min_size"]),
                "with_scores": attrs["with_scores"], "ssh": attrs.get("ssh", False),
                "cpp_rpn": attrs.get("cpp_rpn", False), "pva": attrs.get("pva", False)}

    def forward(self, attrs, params, cls_prob, bbox_pred, im_info):
        self.refuse_if_cannot_run(attrs["name"], attrs, [cls_prob.shape, bbox_pred.shape, im_info.shape],
                                  layer_type="region proposals")
        if cls_prob.shape[0] != 1 and not attrs.get("cpp_rpn"):   # the C++ RPN layer reads image 0 only
            raise CaffeqError(f"region proposals take one image per batch (as py-faster-rcnn), "
                              f"got {cls_prob.shape[0]}")
        return RPNProposal(**self.module_settings(attrs))(cls_prob, bbox_pred, im_info)

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError, node.type)
        emit_proposals(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(i) for i in range(3)], ExportError, node.type)
        kw = self.module_settings(a)
        args = [emit.lit(kw.pop("anchors"), exact=True), emit.lit(kw.pop("feat_stride"))]
        # the switches only when on, as RPNProposal's defaults are off
        args += [f"{k}={emit.lit(v, exact=True)}" for k, v in kw.items() if v is not False]
        emit.note(f"{node.name} (region proposals): the number of rois depends on the data (at most "
                  f"{emit.out_shape(0)[0]}); NMS runs eagerly on the CPU, so this layer does not trace.")
        emit.helper(TORCH_ANCHORS)
        m = emit.module(f"{emit.helper(TORCH_PROPOSAL)}({', '.join(args)})")
        call = f"{m}({', '.join(emit.inputs)})"
        if not a["with_scores"]:
            return call
        t = emit.tmp("proposals")
        emit.stmt(f"{t} = {call}")
        return [f"{t}[0]", f"{t}[1]"]


_PARAM_STR_KEYS = {"feat_stride", "scales", "ratios"}
# keys a fork's copy of the layer sets without changing the proposals: jkokkin/UberNet b33344d
# lib/rpn/proposal_layer.py stores 'phase' and never reads it again (the config key is the layer's
# phase) and leaves 'base_size' to generate_anchors' default, 16
_UNREAD_KEYS = {"phase": None, "base_size": 16}


@register_layer("Python:rpn.proposal_layer.ProposalLayer")
class PythonProposalLayer(_ProposalBase):
    """py-faster-rcnn's (and py-R-FCN's) rpn.proposal_layer.ProposalLayer, natively.  unsky/FPN's
    multi-level proposal layer has the same module and class name: fpn.FPN_PROPOSAL takes those
    (11 bottoms, or a comma list of strides); their attrs carry "pyramid"."""

    @staticmethod
    def _fpn():
        from .fpn import FPN_PROPOSAL
        return FPN_PROPOSAL

    def parse(self, lp):
        if self._fpn().claims(lp):
            return self._fpn().parse(lp)
        return super().parse(lp)

    def infer(self, attrs, in_shapes):
        if attrs.get("pyramid"):
            return self._fpn().infer(attrs, in_shapes)
        return super().infer(attrs, in_shapes)

    def forward(self, attrs, params, *inputs):
        if attrs.get("pyramid"):
            return self._fpn().forward(attrs, params, *inputs)
        return super().forward(attrs, params, *inputs)

    def onnx(self, ctx, node):
        if node.attrs.get("pyramid"):
            return self._fpn().onnx(ctx, node)
        return super().onnx(ctx, node)

    def pytorch_source(self, node, emit):
        if node.attrs.get("pyramid"):
            return self._fpn().pytorch_source(node, emit)
        return super().pytorch_source(node, emit)

    def settings(self, lp):
        p = parse_param_str(lp.python_param.param_str)
        # keys py-faster-rcnn's layer does not read (FaceBoxes' 'densification_times'): the net comes
        # with a fork's proposal_layer.py; it reads, and cannot_run says why it does not run
        foreign = sorted(k for k in set(p) - _PARAM_STR_KEYS
                         if k not in _UNREAD_KEYS or _UNREAD_KEYS[k] not in (None, p[k]))
        if "feat_stride" not in p:
            raise LayerError("python_param.param_str: 'feat_stride' is required (e.g. \"'feat_stride': 16\")")
        stride = p["feat_stride"]
        if not isinstance(stride, int) or isinstance(stride, bool):
            raise LayerError(f"python_param.param_str: 'feat_stride' must be an integer, got {stride!r}")
        numbers = {}
        for key, default in (("scales", [8, 16, 32]), ("ratios", [0.5, 1, 2])):
            values = p.get(key, default)
            if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in values):
                raise LayerError(f"python_param.param_str: '{key}' must be a list of numbers, got {values!r}")
            numbers[key] = [float(v) for v in values]
        # py-faster-rcnn's layer ignores 'ratios'; the many forks that set it read it as generate_anchors'
        # ratios (layer_params.get('ratios', (0.5, 1, 2)))
        notes = ["param_str's 'ratios' is read as the forks that set it read it, generate_anchors' ratios "
                 "(py-faster-rcnn's own layer ignores it)"] if "ratios" in p else []
        return {"feat_stride": stride, "base_size": 16, **numbers, **TEST_CONFIG, "foreign_keys": foreign,
                "reading_notes": notes}


# mahyarnajibi/SSH's TEST configuration (SSH/configs/default_config.yml); NMS_THRESH is applied outside
SSH_TEST_CONFIG = {"pre_nms_top_n": 1000, "post_nms_top_n": 0, "nms_thresh": 0.3, "min_size": 0}


def _numbers(p, key, default):
    value = p.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise LayerError(f"python_param.param_str: '{key}' must be a list of numbers, got {value!r}")
    return [float(v) for v in value]


@register_layer("Python:SSH.layers.proposal_layer.ProposalLayer")
class SSHProposalLayer(_ProposalBase):
    """mahyarnajibi/SSH's per-module proposals at TEST: py-faster-rcnn's decoding, clipping and sorting,
    the best 1000 boxes, no NMS and no size filter; anchors from the param_str's scales, ratios and
    base_size."""

    def settings(self, lp):
        p = parse_param_str(lp.python_param.param_str)
        unknown = sorted(set(p) - {"feat_stride", "scales", "ratios", "base_size"})
        if unknown:
            raise LayerError(f"python_param.param_str: SSH's ProposalLayer reads only 'feat_stride', 'scales', "
                             f"'ratios' and 'base_size', got {unknown}")
        if "feat_stride" not in p:
            raise LayerError("python_param.param_str: 'feat_stride' is required (e.g. \"'feat_stride': 16\")")
        stride = p["feat_stride"]
        if not isinstance(stride, int) or isinstance(stride, bool):
            raise LayerError(f"python_param.param_str: 'feat_stride' must be an integer, got {stride!r}")
        base = p.get("base_size", 16)
        if not isinstance(base, (int, float)) or isinstance(base, bool):
            raise LayerError(f"python_param.param_str: 'base_size' must be a number, got {base!r}")
        return {"feat_stride": stride, "base_size": base, "ratios": _numbers(p, "ratios", [0.5, 1, 2]),
                "scales": _numbers(p, "scales", [8, 16, 32]), "ssh": True, **SSH_TEST_CONFIG}


@register_layer("PythonData")
class PythonData(Layer):
    """A Python layer without bottoms that caffeq does not know: a data layer (a graph input) whose top
    shapes only the user can give.  The graph builder uses `--input-shape` values before asking this."""
    is_data = True

    def parse(self, lp):
        return {"module": lp.python_param.module, "layer": lp.python_param.layer, "name": lp.name,
                "tops": list(lp.top)}

    def infer(self, attrs, in_shapes):
        tops = " ".join(f"--input-shape {t}=N,C,H,W" for t in attrs["tops"]) or "--input-shape NAME=N,C,H,W"
        raise MissingInputShape(f"layer '{attrs['name']}' is a Python data layer (module '{attrs['module']}', "
                                f"class '{attrs['layer']}') that caffeq does not run; give its top shapes with "
                                f"{tops} (Python: input_shapes={{...}})")


# ---- region proposals as ONNX ops ----------------------------------------------------------------

def onnx_clipped_corners(op, zero, cx, cy, half_w, half_h, x_max, y_max):
    """py-faster-rcnn's bbox_transform_inv + clip_boxes in ONNX: the corners of boxes given by centre
    and half sizes, each clipped to [0, x_max] or [0, y_max] (Min, then Max, as np.maximum(np.minimum))."""
    def clip(v, top, hint):
        return op("Max", [op("Min", [v, top], hint + "_min"), zero], hint)

    return (clip(op("Sub", [cx, half_w], "x1r"), x_max, "x1"), clip(op("Sub", [cy, half_h], "y1r"), y_max, "y1"),
            clip(op("Add", [cx, half_w], "x2r"), x_max, "x2"), clip(op("Add", [cy, half_h], "y2r"), y_max, "y2"))


def emit_proposals(ctx, node):
    """rpn_proposals from standard ops; the anchors and their sizes are constants of the static H, W."""
    a = node.attrs
    cpp, pva = a.get("cpp_rpn", False), a.get("pva", False)
    prob_in, deltas_in, info_in = node.inputs
    batch, _, height, width = ctx.shape(prob_in)
    n_anchors = len(a["anchors"])
    total = height * width * n_anchors
    name = node.name

    def column(x, k, hint):   # x[:, k]
        return ctx.op("Gather", [x, ctx.i64(k)], hint, axis=1)

    boxes = shifted_anchors(torch.tensor(a["anchors"], dtype=torch.float64), height, width,
                            a["feat_stride"]).numpy().astype(np.float32)
    widths = boxes[:, 2] - boxes[:, 0] + np.float32(1.0)
    heights = boxes[:, 3] - boxes[:, 1] + np.float32(1.0)
    ctr_x = boxes[:, 0] + np.float32(0.5) * widths
    ctr_y = boxes[:, 1] + np.float32(0.5) * heights

    if cpp and batch > 1:   # the C++ RPN layer reads image 0 only
        prob_in, deltas_in = (ctx.op("Slice", [v, ctx.i64([0]), ctx.i64([1]), ctx.i64([0])], h) for v, h in
                              ((prob_in, "prob0"), (deltas_in, "deltas0")))
    scores = ctx.op("Slice", [prob_in, ctx.i64([n_anchors]), ctx.i64([2 * n_anchors]), ctx.i64([1])], "fg")
    scores = ctx.op("Reshape", [ctx.op("Transpose", [scores], "fg_t", perm=[0, 2, 3, 1]), ctx.i64([-1])], "scores")
    deltas = ctx.op("Reshape", [ctx.op("Transpose", [deltas_in], "d_t", perm=[0, 2, 3, 1]), ctx.i64([-1, 4])], "deltas")
    pred_x = ctx.op("Add", [ctx.op("Mul", [column(deltas, 0, "dx"), ctx.f32(widths)], "mx"), ctx.f32(ctr_x)], "px")
    pred_y = ctx.op("Add", [ctx.op("Mul", [column(deltas, 1, "dy"), ctx.f32(heights)], "my"), ctx.f32(ctr_y)], "py")
    pred_w = ctx.op("Mul", [ctx.op("Exp", [column(deltas, 2, "dw")], "ew"), ctx.f32(widths)], "pw")
    pred_h = ctx.op("Mul", [ctx.op("Exp", [column(deltas, 3, "dh")], "eh"), ctx.f32(heights)], "ph")
    half_w, half_h = ctx.op("Mul", [ctx.f32(0.5), pred_w], "hw"), ctx.op("Mul", [ctx.f32(0.5), pred_h], "hh")
    info = ctx.op("Reshape", [info_in, ctx.i64([-1])], "info")
    im_h, im_w, im_scale = (ctx.op("Gather", [info, ctx.i64(k)], hint, axis=0) for k, hint in
                            ((0, "im_h"), (1, "im_w"), (2, "im_scale")))
    # PVANet's im_info holds the width's scale apart; the others scale both sides by im_info[2]
    four = pva and math.prod(ctx.shape(info_in)) > 3   # mini-caffe's port: [height, width, scale]
    scale_w = ctx.op("Gather", [info, ctx.i64(3)], "scale_w", axis=0) if four else im_scale
    if cpp:   # [0, int(width)] x [0, int(height)]
        x_max, y_max = (ctx.op("Cast", [ctx.op("Cast", [v, ], f"{h}_i", to=7)], h, to=1) for v, h in
                        ((im_w, "x_max"), (im_h, "y_max")))
    else:
        x_max = ctx.op("Sub", [im_w, ctx.f32(1.0)], "x_max")
        y_max = ctx.op("Sub", [im_h, ctx.f32(1.0)], "y_max")
    x1, y1, x2, y2 = onnx_clipped_corners(ctx.op, ctx.f32(0.0), pred_x, pred_y, half_w, half_h, x_max, y_max)
    limit = ctx.op("Mul", [ctx.f32(float(a["min_size"])), im_scale], "limit")
    if cpp:   # the unclipped sizes, as (w < limit || h < limit): a NaN side is kept
        small = ctx.op("Or",
                       [ctx.op("Less", [pred_w, limit], "narrow"), ctx.op("Less", [pred_h, limit], "low")], "small")
    else:
        ws = ctx.op("Add", [ctx.op("Sub", [x2, x1], "ws0"), ctx.f32(1.0)], "ws")
        hs = ctx.op("Add", [ctx.op("Sub", [y2, y1], "hs0"), ctx.f32(1.0)], "hs")
        # as the Python layer's (ws >= limit) & (hs >= limit): a NaN side is dropped too
        limit_w = ctx.op("Mul", [ctx.f32(float(a["min_size"])), scale_w], "limit_w") if pva else limit
        small = ctx.op("Not", [ctx.op("And", [ctx.op("GreaterOrEqual", [ws, limit_w], "wide"),
                                              ctx.op("GreaterOrEqual", [hs, limit], "high")], "big_enough")], "small")
    # filtered boxes score -inf: NonMaxSuppression's score threshold (-FLT_MAX) then leaves them out
    if pva:   # PVANet keeps them, scored score * 0 (TopK puts equal scores' lower index first)
        live = ctx.op("Mul", [scores, ctx.op("Cast", [ctx.op("Not", [small], "big")], "valid", to=1)], "live")
    else:
        live = ctx.op("Where", [small, ctx.f32(-np.inf), scores], "live")
    k = total if a["pre_nms_top_n"] <= 0 else min(a["pre_nms_top_n"], total)
    if pva:
        vals, idx = ctx.add_node("TopK", [live, ctx.i64([k])], [ctx.tmp(f"{name}_top"), ctx.tmp(f"{name}_top_idx")],
                                 axis=0, largest=1, sorted=1)
    else:   # the torch sort puts equal scores' higher index first
        vals, idx = ctx.top_k_later_first(live, k, "top")
    corners = ctx.op("Concat", [ctx.op("Unsqueeze", [v, ctx.i64([1])], f"{h}_c") for v, h in
                                ((x1, "x1"), (y1, "y1"), (x2, "x2"), (y2, "y2"))], "corners", axis=1)
    cand = ctx.op("Gather", [corners, idx], "cand", axis=0)                                   # (k, 4)
    if a.get("ssh"):
        emit_ssh_rows(ctx, node, ctx.op, small, idx, cand, vals)
        return
    # ONNX's IoU has no +1: give it [y1, x1, y2 + 1, x2 + 1]
    plus = ctx.f32(np.array([0, 0, 1, 1], np.float32))
    nms_boxes = ctx.op("Gather", [ctx.op("Add", [cand, plus], "cand1"), ctx.i64([1, 0, 3, 2])], "yx", axis=1)
    max_out = k if a["post_nms_top_n"] <= 0 else min(a["post_nms_top_n"], k)
    thresh = ctx.nms_threshold(a["nms_thresh"], drops_equal=cpp)   # the C++ RPN layer drops IoU >= t
    sel = ctx.add_node("NonMaxSuppression",
                       [ctx.op("Unsqueeze", [nms_boxes, ctx.i64([0])], "nms_b"),
                        ctx.op("Reshape", [vals, ctx.i64([1, 1, -1])], "nms_s"),
                        ctx.i64([max_out]), ctx.f32([thresh]), ctx.f32([-FLT_MAX])],
                       [ctx.tmp(f"{name}_sel")], name=name)[0]
    picked = ctx.op("Gather", [sel, ctx.i64(2)], "picked", axis=1)                                 # (R,)
    chosen = ctx.op("Gather", [cand, picked], "chosen", axis=0)
    zeros = ctx.op("ConstantOfShape", [ctx.op("Concat", [ctx.op("Shape", [picked], "r"), ctx.i64([1])],
                                              "z_shape", axis=0)], "zeros", value=_scalar_tensor(0.0))
    ctx.add_node("Concat", [zeros, chosen], [node.outputs[0]], axis=1)
    if a["with_scores"] and pva:
        ctx.add_node("Gather", [vals, picked], [node.outputs[1]], axis=0)
    elif a["with_scores"]:
        ctx.add_node("Unsqueeze",
                     [ctx.op("Gather", [vals, picked], "chosen_s", axis=0), ctx.i64([1])], [node.outputs[1]])


def emit_ssh_rows(ctx, node, op, small, idx, cand, vals):
    """SSH: the top-k rows without NMS, less those the size filter dropped (scored -inf, so last);
    the one roi [0, 0, 0, 16, 16] when none is left."""
    live = op("Gather", [op("Not", [small], "big"), idx], "live_k", axis=0)
    chosen = op("Compress", [cand, live], "chosen", axis=0)
    rows = op("Slice", [op("Shape", [chosen], "shape"), ctx.i64([0]), ctx.i64([1])], "rows")
    zeros = op("ConstantOfShape", [op("Concat", [rows, ctx.i64([1])], "z_shape", axis=0)], "zeros",
               value=_scalar_tensor(0.0))
    rois = op("Concat", [op("Concat", [zeros, chosen], "rois_all", axis=1),
                         ctx.const(np.array([[0, 0, 0, 16, 16]], np.float32))], "rois_pad", axis=0)
    ctx.add_node("Slice",
                 [rois, ctx.i64([0]), op("Max", [rows, ctx.i64([1])], "rows1")], [node.outputs[0]], name=node.name)
    if node.attrs["with_scores"]:
        ctx.add_node("Unsqueeze", [op("Compress", [vals, live], "chosen_s", axis=0), ctx.i64([1])], [node.outputs[1]])


def _scalar_tensor(v):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array([v], np.float32))
