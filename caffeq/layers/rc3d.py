"""R-C3D (VisionLearningGroup/R-C3D 78da577, Xu et al., "R-C3D: Region Convolutional 3D Network for Temporal
Activity Detection") and the repos built on its caffe3d fork and lib/: VisionLearningGroup/JEDDi-Net 76c2769,
VisionLearningGroup/Text-to-Clip_Retrieval f3c479d, amands97/R-C3D-1 ca37f1e.  Windows ("twins") are
[start, end] in frames; rois are (R, 3) = [batch, start, end].

- ROIPooling with `pooled_l` / `temporal_scale` (caffe3d roi_pooling_layer.cpp/.cu; claimed from Fast
  R-CNN's ROIPooling by those fields): data (N, C, L, H, W) -> (R, C, pooled_l, pooled_h, pooled_w).  start
  and end times temporal_scale (float32), C-rounded, Fast R-CNN's bins over them (float32 bin sizes,
  clipped to L).  Every roi covers rows and columns 0..6 (the kernels fix roi_start_h/w = 0, roi_end_h/w
  = 6; spatial_scale is unused), binned likewise and clipped to H and W.  The max over each bin, 0 for an
  empty one.  ONNX: a MaxRoiPool over the 7 x 7 corner (a constant roi), then one over time.
- `rpn.proposal_layer.ProposalLayer` with 2 bottoms (claimed from py-faster-rcnn's): cls prob and twin
  deltas (1, 2A, L, 1, 1), param_str 'feat_stride' and 'scales' (default 1..63).  Anchors
  (generate_anchors.py): [3.5 - (8s - 1) / 2, 3.5 + (8s - 1) / 2] (float64) shifted by l x feat_stride;
  twin_transform_inv in float32 (lengths + 1 frame), clipped to [0, L x feat_stride - 1], windows shorter
  than RPN_MIN_SIZE dropped, sorted by score (ties: higher index first), RPN_PRE_NMS_TOP_N kept, greedy NMS
  (a window goes when its IoU with a kept one is > RPN_NMS_THRESH: the default GPU NMS), RPN_POST_NMS_TOP_N
  kept; config.py's TEST values 6000, 300, 0.7, 8 (experiments' yml files change some: ActivityNet NMS 0.9
  and min 0, JEDDi-Net and Text-to-Clip min 0 and post 1000 / 100).  rois (R, 3) = [0, start, end], scores
  (R, 1); infer gives the most rows.
- Text-to-Clip's `rpn.caption_layer.CaptionLayer`: cls prob (R, 2), twin pred (R, 4), rois (R, 3), features
  (R, D); each roi moved by class 1's deltas, clipped to [0, 767] (the experiments' TEST.LENGTH 768), the
  best CAPTION_TOP_N = 64 by class-1 score (min length 0) -> rois (N, 3), features (N, D), scores (N,).
- JEDDi-Net's `rpn.GTbox_sorted.ProposalTargetLayer`: rois and features reordered by the rois' end, ascending
  (ties keep their order; numpy's default argsort may not).  `rpn.GTboxes_to_GTrois.ProposalTargetLayer`:
  gt windows (G, K) -> [0, columns 0..K-2].
- Training layers, read and sized as their setup gives (each spec below), never run (they sample or
  read the ground truth): the RoIDataLayers (R-C3D's roi_data_layer.layer with 2 tops, JEDDi-Net and
  Text-to-Clip's roi_data_layer.layer_caption), the twin forms of rpn.anchor_target_layer (3 bottoms)
  and rpn.proposal_target_layer, told from py-faster-rcnn's same-named layers by their tops named
  *twin*, Text-to-Clip's rpn.proposal_target_layer_binary and JEDDi-Net's caption-LSTM feeders.
"""
import math

import numpy as np
import torch
from torch import nn

from ..errors import CaffeqError, ExportError
from .c_numerics import c_round
from .data import DataLayer
from .param_str import param_str_positive_int, parse_param_str
from .rcnn import FLT_MAX, greedy_nms
from .registry import Layer, LayerError, ReadOnlyLayer, claim_layers, need_blobs, register_layer, torch_sources
from .roi_pooling import bin_mask, roi_batch_index, roi_layer_call

# lib/tdcnn/config.py __C.TEST (the same in all four repos)
RC3D_TEST = {"pre_nms_top_n": 6000, "post_nms_top_n": 300, "nms_thresh": 0.7, "min_size": 8.0}
DEFAULT_SCALES = list(range(1, 64))        # proposal_layer.py: layer_params.get('scales', tuple(range(1, 64)))
ANCHOR_TARGET_SCALES = [2, 4, 5, 6, 8, 9, 10, 12, 14, 16]   # anchor_target_layer.py's default
CAPTION_TEST = {"top_n": 64, "min_size": 0, "length": 768}  # Text-to-Clip config.py TEST.CAPTION_*, yml LENGTH

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------------


def rc3d_bins(start: int, end: int, pooled: int, size: int):
    """Fast R-CNN's integer bins over [start, end] (float32 bin sizes), clipped to [0, size]."""
    f32 = torch.float32
    span = torch.tensor(float(max(end - start + 1, 1)), dtype=f32) / torch.tensor(float(pooled), dtype=f32)
    lo = torch.floor(torch.arange(pooled, dtype=f32) * span).long() + start
    hi = torch.ceil(torch.arange(1, pooled + 1, dtype=f32) * span).long() + start
    return lo.clamp(0, size), hi.clamp(0, size)


def rc3d_roi_pool(x, rois, pl: int, ph: int, pw: int, temporal_scale: float):
    """R-C3D's ROIPooling: x (N, C, L, H, W), rois (R, 3) = [batch, start, end] -> (R, C, pl, ph, pw).
    The spatial bins (rows and columns 0..6 for every roi) are pooled once, then each roi's time bins."""
    kind = "ROIPooling (R-C3D)"
    r = rois.flatten(1) if rois.dim() > 1 else rois.reshape(-1, 1)
    if r.shape[1] != 3:
        raise ValueError(f"{kind}: rois must be (R, 3) = [batch, start, end], got {list(rois.shape)}")
    r = r.detach().float().cpu()
    n, c, length, h, w = x.shape
    h, w = min(h, 7), min(w, 7)   # the bins end at row and column 6
    neg = torch.tensor(float("-inf"), device=x.device, dtype=x.dtype)
    zero = torch.zeros((), device=x.device, dtype=x.dtype)
    hs, he = rc3d_bins(0, 6, ph, h)
    ws, we = rc3d_bins(0, 6, pw, w)
    corner = x[:, :, :, :h, :w]
    cols = torch.where(bin_mask(ws, we, w).to(x.device), corner[..., None, :], neg).amax(-1)       # (N, C, L, h, pw)
    planes = torch.where(bin_mask(hs, he, h).to(x.device)[:, :, None], cols[..., None, :, :], neg).amax(-2)
    flat_empty = ((he <= hs)[:, None] | (we <= ws)[None, :]).to(x.device)                          # (ph, pw)
    outs = []
    for roi in r:
        b = roi_batch_index(roi, n, kind)
        start, end = c_round((roi[1:3] * torch.tensor(temporal_scale, dtype=torch.float32)).double()).tolist()
        ls, le = rc3d_bins(int(start), int(end), pl, length)
        l0, l1 = int(ls.min()), min(max(int(le.max()), int(ls.min()) + 1), length)
        if l0 >= l1:   # the whole roi is outside the clip
            outs.append(torch.zeros((c, pl, ph, pw), device=x.device, dtype=x.dtype))
            continue
        ml = bin_mask(ls - l0, le - l0, l1 - l0).to(x.device)                                          # (pl, l)
        bins = torch.where(ml[:, :, None, None], planes[b, :, None, l0:l1], neg).amax(2)               # (C, pl, ph, pw)
        empty = (le <= ls).to(x.device)[:, None, None] | flat_empty[None]
        outs.append(torch.where(empty[None], zero, bins))
    if not outs:
        return x.new_zeros((0, c, pl, ph, pw))
    return torch.stack(outs)


def twin_decode(wins, deltas):
    """twin_transform_inv: windows (P, 2) moved by deltas (P, 2) = [dx, dl]; lengths count both end frames."""
    lengths = wins[:, 1] - wins[:, 0] + 1.0
    ctr = wins[:, 0] + 0.5 * lengths
    pred_ctr = deltas[:, 0] * lengths + ctr
    pred_len = torch.exp(deltas[:, 1]) * lengths
    return pred_ctr - 0.5 * pred_len, pred_ctr + 0.5 * pred_len


def twin_clip(v, video_length: int):
    """clip_wins: max(min(v, video_length - 1), 0)."""
    top = torch.tensor(float(video_length - 1), dtype=v.dtype, device=v.device)
    return torch.maximum(torch.minimum(v, top), torch.zeros((), dtype=v.dtype, device=v.device))


def twin_nms(x1, x2, thresh: float, max_keep: int):
    """The fork's GPU NMS over windows sorted best first: a window goes when its float32 IoU (+1 frame
    lengths) with a kept one is > thresh.  The kept indices, at most max_keep (<= 0: all)."""
    x1, x2 = x1.detach().float().cpu(), x2.detach().float().cpu()
    lengths = x2 - x1 + 1

    def iou_after(i):
        inter = torch.clamp(torch.minimum(x2[i], x2[i + 1:]) - torch.maximum(x1[i], x1[i + 1:]) + 1, min=0)
        return inter / (lengths[i] + lengths[i + 1:] - inter)

    return greedy_nms(x1.shape[0], iou_after, thresh, max_keep)


def twin_proposals(cls_prob, twin_pred, anchors, feat_stride: int, pre_nms_top_n: int, post_nms_top_n: int,
                   nms_thresh: float, min_size: float):
    """R-C3D's ProposalLayer.forward: cls_prob (1, 2A, L, 1, 1) (the second A channels score the
    windows), twin_pred (1, 2A, L, 1, 1), anchors (A, 2).  -> rois (R, 3) = [0, start, end], scores (R, 1)."""
    if cls_prob.shape[0] != 1:
        raise ValueError(f"R-C3D's proposals take one video per batch, got {cls_prob.shape[0]}")
    n_anchors, length = anchors.shape[0], cls_prob.shape[2]
    scores = cls_prob[0, n_anchors:].permute(1, 2, 3, 0).reshape(-1)          # order (l, h, w, a)
    deltas = twin_pred[0].permute(1, 2, 3, 0).reshape(-1, 2)
    shifts = torch.arange(length, dtype=torch.float64) * feat_stride
    wins = (anchors.to(torch.float64)[None] + shifts[:, None, None]).reshape(-1, 2).to(deltas.dtype)
    x1, x2 = twin_decode(wins, deltas)
    x1, x2 = twin_clip(x1, length * feat_stride), twin_clip(x2, length * feat_stride)
    keep = torch.nonzero((x2 - x1 + 1) >= min_size).flatten()
    x1, x2, scores = x1[keep], x2[keep], scores[keep]
    order = torch.sort(scores, stable=True)[1].flip(0)                          # ties: higher index first
    if pre_nms_top_n > 0:
        order = order[:pre_nms_top_n]
    x1, x2, scores = x1[order], x2[order], scores[order]
    kept = torch.tensor(twin_nms(x1, x2, nms_thresh, post_nms_top_n), dtype=torch.long, device=x1.device)
    x1, x2, scores = x1[kept], x2[kept], scores[kept]
    return torch.stack([torch.zeros_like(x1), x1, x2], dim=1), scores[:, None]


class TwinProposal(nn.Module):
    """R-C3D's temporal proposal layer (twin_proposals) with its anchors and settings."""

    def __init__(self, anchors, feat_stride, pre_nms_top_n=6000, post_nms_top_n=300, nms_thresh=0.7,
                 min_size=8.0, with_scores=False):
        super().__init__()
        self.anchors, self.feat_stride, self.with_scores = anchors, feat_stride, with_scores
        self.pre_nms_top_n, self.post_nms_top_n = pre_nms_top_n, post_nms_top_n
        self.nms_thresh, self.min_size = nms_thresh, min_size

    def forward(self, cls_prob, twin_pred):
        rois, scores = twin_proposals(cls_prob, twin_pred, torch.tensor(self.anchors, dtype=torch.float64),
                                      self.feat_stride, self.pre_nms_top_n, self.post_nms_top_n,
                                      self.nms_thresh, self.min_size)
        return (rois, scores) if self.with_scores else rois


def caption_proposals(cls_prob, twin_pred, rois, features, top_n: int, min_size: float, video_length: int):
    """Text-to-Clip's CaptionLayer: each roi moved by class 1's deltas, clipped, windows shorter than
    min_size dropped, the best top_n by class-1 score (one when top_n <= 0).  -> rois (N, 3), features
    (N, ...), scores (N,)."""
    scores = cls_prob[:, 1]
    x1, x2 = twin_decode(rois[:, 1:3], twin_pred[:, 2:4])
    x1, x2 = twin_clip(x1, video_length), twin_clip(x2, video_length)
    keep = torch.nonzero((x2 - x1 + 1) >= min_size).flatten()
    order = torch.sort(scores[keep], stable=True)[1].flip(0)                    # ties: higher index first
    order = keep[order[:top_n] if top_n > 0 else order[:1]]
    x1, x2 = x1[order], x2[order]
    return torch.stack([torch.zeros_like(x1), x1, x2], dim=1), features[order], scores[order]


def sort_by_end(rois, features):
    """JEDDi-Net's GTbox_sorted: rois and features reordered by the rois' end (column 2), ascending."""
    order = torch.sort(rois[:, 2], stable=True)[1]
    return rois[order], features[order]


def gt_windows_to_rois(gt):
    """GTboxes_to_GTrois: gt windows (G, K) = [start, end, ..., label] -> (G, K) = [0, start, end, ...]."""
    return torch.cat([torch.zeros_like(gt[:, :1]), gt[:, :-1]], dim=1)


TORCH_RC3D_ROI_POOL = torch_sources(rc3d_bins, rc3d_roi_pool)
TORCH_TWINS = torch_sources(twin_decode, twin_clip)
TORCH_TWIN_PROPOSAL = torch_sources(greedy_nms, twin_nms, twin_proposals, TwinProposal)


# ---- ONNX helpers ----------------------------------------------------------------------------

class _Ops:
    """The context's node helpers as op(type, inputs, hint, **attrs) -> output name, op.i64 and op.f32
    (OnnxContext.op/i64/f32), with shorthands built on them."""

    def __init__(self, ctx):
        self.ctx, self.i64, self.f32 = ctx, ctx.i64, ctx.f32

    def __call__(self, op_type, inputs, hint, **kw):
        return self.ctx.op(op_type, inputs, hint, **kw)

    def col(self, x, k, hint):   # x[:, k]
        return self("Gather", [x, self.i64(k)], hint, axis=1)

    def zeros_like_rows(self, v, hint):
        """(rows of v, 1) zeros."""
        from onnx import numpy_helper
        rows = self("Slice", [self("Shape", [v], hint + "_s"), self.i64([0]), self.i64([1])], hint + "_n")
        shape = self("Concat", [rows, self.i64([1])], hint + "_shape", axis=0)
        return self("ConstantOfShape", [shape], hint, value=numpy_helper.from_array(np.zeros(1, np.float32)))

    def twin_rows(self, x1, x2, out, hint="rows"):
        """[0, x1, x2] rows from two (N,) vectors, written to `out`."""
        cols = [self("Unsqueeze", [v, self.i64([1])], f"{hint}{k}") for k, v in enumerate((x1, x2))]
        self.ctx.add_node("Concat", [self.zeros_like_rows(x1, hint + "_z")] + cols, [out], axis=1)

    def decode(self, lengths, ctr, dx, dl, video_length):
        """twin_decode + twin_clip; lengths and ctr are constants or tensors."""
        px = self("Add", [self("Mul", [dx, lengths], "mx"), ctr], "px")
        half = self("Mul", [self.f32(0.5), self("Mul", [self("Exp", [dl], "el"), lengths], "pl")], "half")
        top, zero = self.f32(float(video_length - 1)), self.f32(0.0)
        clip = lambda v, h: self("Max", [self("Min", [v, top], h + "_min"), zero], h)   # noqa: E731
        return clip(self("Sub", [px, half], "x1r"), "x1"), clip(self("Add", [px, half], "x2r"), "x2")

    def long_enough(self, x1, x2, min_size):
        return self("GreaterOrEqual", [self("Add", [self("Sub", [x2, x1], "len0"), self.f32(1.0)], "len"),
                                       self.f32(float(min_size))], "long")


# ---- the specs -------------------------------------------------------------------------------

# superxuang/caffe_3d_faster_rcnn also sets pooled_l, with spatial_scale_xy / _z: its own 3-D ROIPooling (frcnn3d.py)
@claim_layers("ROIPooling", lambda lp: any(lp.roi_pooling_param.HasField(f) for f in ("pooled_l", "temporal_scale"))
              and not any(lp.roi_pooling_param.HasField(f) for f in ("spatial_scale_xy", "spatial_scale_z")))
class RC3DRoiPooling(Layer):
    """ROIPooling with R-C3D's pooled_l / temporal_scale: 3-D ROI pooling over (N, C, L, H, W)."""

    def parse(self, lp):
        need_blobs(lp, "ROIPooling (R-C3D)", 2, 1, "data, rois")
        p = lp.roi_pooling_param
        if p.HasField("pad_ratio") or p.HasField("pool"):
            raise LayerError("roi_pooling_param: pooled_l and temporal_scale (R-C3D's 3-D ROIPooling) cannot be set "
                             "with pad_ratio (zhaoweicai's fork) or pool (wk910930/ccnn)")
        for f in ("pooled_l", "pooled_h", "pooled_w"):   # LayerSetUp: CHECK_GT(..., 0)
            if getattr(p, f) <= 0:
                raise LayerError(f"roi_pooling_param.{f} must be > 0 (R-C3D's 3-D ROIPooling), got {getattr(p, f)}")
        if not math.isfinite(p.temporal_scale):
            raise LayerError(f"roi_pooling_param.temporal_scale must be a finite number, got {p.temporal_scale}")
        return {"pl": int(p.pooled_l), "ph": int(p.pooled_h), "pw": int(p.pooled_w),
                "temporal_scale": float(p.temporal_scale), "name": lp.name}

    def infer(self, attrs, in_shapes):
        s, r = in_shapes
        if len(s) != 5:
            raise LayerError(f"ROIPooling with pooled_l (R-C3D) needs a 5-axis input (N, C, L, H, W), got {list(s)}")
        if not r:   # Reshape reads only the rois' count; forward needs (R, 3) rows
            raise LayerError(f"ROIPooling (R-C3D): rois must be (R, 3) = [batch, start, end], got {list(r)}")
        return [(r[0], s[1], attrs["pl"], attrs["ph"], attrs["pw"])]

    def forward(self, attrs, params, x, rois):
        try:
            return rc3d_roi_pool(x, rois, attrs["pl"], attrs["ph"], attrs["pw"], attrs["temporal_scale"])
        except ValueError as e:
            raise LayerError(str(e)) from None

    def pytorch_source(self, node, emit):
        a = node.attrs
        return roi_layer_call(emit, TORCH_RC3D_ROI_POOL, a["pl"], a["ph"], a["pw"], a["temporal_scale"])

    def onnx(self, ctx, node):
        a, op = node.attrs, _Ops(ctx)
        x, rois = node.inputs
        _, c, length, h, w = ctx.shape(x)
        if math.prod(ctx.shape(rois)[1:]) != 3:
            raise ExportError(f"layer '{node.name}' (ROIPooling): rois must be (R, 3) = [batch, start, end], the net "
                              f"declares {list(ctx.shape(rois))}; give their shape with --input-shape")
        ph, pw, pl = a["ph"], a["pw"], a["pl"]
        # the spatial bins: every roi's rows and columns 0..6, one MaxRoiPool over all planes (empty bins: 0)
        planes = op("Reshape", [x, op.i64([1, -1, h, w])], "planes")
        corner = op("MaxRoiPool", [planes, op.f32([[0, 0, 0, 6, 6]])], "corner", pooled_shape=[ph, pw],
                    spatial_scale=1.0)
        cells = op("Reshape", [corner, op.i64([-1, c, length, ph * pw])], "cells")
        series = op("Reshape", [op("Transpose", [cells], "cells_t", perm=[0, 1, 3, 2]),
                                op.i64([-1, c * ph * pw, length, 1])], "series")
        # time: rois [b, start, end] as Fast R-CNN's [b, x1 = 0, y1 = start, x2 = 0, y2 = end]
        flat = op("Reshape", [rois, op.i64([-1, 3])], "rois")
        zeros = op.zeros_like_rows(flat, "zero_x")
        boxes = op("Concat", [op("Slice", [flat, op.i64([0]), op.i64([1]), op.i64([1])], "b"), zeros,
                              op("Slice", [flat, op.i64([1]), op.i64([2]), op.i64([1])], "s"), zeros,
                              op("Slice", [flat, op.i64([2]), op.i64([3]), op.i64([1])], "e")], "boxes", axis=1)
        pooled = op("MaxRoiPool", [series, boxes], "time", pooled_shape=[pl, 1], spatial_scale=a["temporal_scale"])
        grid = op("Reshape", [pooled, op.i64([-1, c, ph, pw, pl])], "grid")
        ctx.add_node("Transpose", [grid], [node.outputs[0]], name=node.name, perm=[0, 1, 4, 2, 3])


def _number_list(p, key, default):
    value = p.get(key, default)
    if not isinstance(value, list) or not value or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value):
        raise LayerError(f"python_param.param_str: '{key}' must be one or more positive numbers, got {value!r}")
    return value


def rc3d_anchors(scales, base_size=8):
    """generate_anchors.py: [0, base_size - 1] scaled by each scale around its centre, float64 (A, 2)."""
    length, ctr = base_size, 0.5 * (base_size - 1)
    return [[ctr - 0.5 * (length * s - 1), ctr + 0.5 * (length * s - 1)] for s in scales]


@claim_layers("Python:rpn.proposal_layer.ProposalLayer", lambda lp: len(lp.bottom) == 2)
class TwinProposalLayer(Layer):
    """R-C3D's temporal rpn.proposal_layer.ProposalLayer (2 bottoms), natively."""
    data_dependent_shape = True

    def parse(self, lp):
        need_blobs(lp, "R-C3D's ProposalLayer", 2, (1, 2), "rpn_cls_prob_reshape, rpn_twin_pred")
        p = parse_param_str(lp.python_param.param_str)
        scales = _number_list(p, "scales", DEFAULT_SCALES)
        return {"name": lp.name, "feat_stride": param_str_positive_int(p, "feat_stride"), "scales": [float(s) for s in scales],
                "anchors": rc3d_anchors(scales), "with_scores": len(lp.top) == 2,
                "foreign_keys": sorted(set(p) - {"feat_stride", "scales"}), **RC3D_TEST}

    def infer(self, attrs, in_shapes):
        prob, deltas = (tuple(s) for s in in_shapes)
        if len(prob) != 5 or prob[1] % 2:
            raise LayerError(f"R-C3D's ProposalLayer: rpn_cls_prob_reshape must be (1, 2 x anchors, L, H, W), "
                             f"got {list(prob)}")
        if deltas != prob:
            raise LayerError(f"R-C3D's ProposalLayer: rpn_twin_pred must be shaped as the scores {list(prob)}, "
                             f"got {list(deltas)}")
        if prob[0] != 1:   # forward asserts one video
            raise LayerError(f"R-C3D's ProposalLayer takes one video per batch, got {prob[0]}")
        rows = math.prod(prob[2:]) * (prob[1] // 2)
        rows = min([rows] + [attrs[k] for k in ("pre_nms_top_n", "post_nms_top_n") if attrs[k] > 0])
        return [(rows, 3)] + [(rows, 1)] * attrs["with_scores"]

    @staticmethod
    def cannot_run(attrs, in_shapes):
        prob = tuple(in_shapes[0])
        if attrs["foreign_keys"]:
            return (f"param_str sets {attrs['foreign_keys']}, which R-C3D's ProposalLayer does not read: this net "
                    f"comes with a fork's proposal_layer.py, whose proposals caffeq does not guess")
        if prob[1] != 2 * len(attrs["anchors"]):
            return (f"the net scores {prob[1] // 2} anchors per position, but param_str 'scales' make "
                    f"{len(attrs['anchors'])}: the Python layer pairs them elementwise and fails")
        if math.prod(prob[3:]) != 1:
            return (f"the scores are {prob[3]} x {prob[4]} per time step: the Python layer pairs L x anchors "
                    f"windows with L x H x W x anchors deltas and fails unless H = W = 1")
        return None

    @staticmethod
    def settings(attrs):   # TwinProposal's arguments: forward and model.py build the same module
        return {k: attrs[k] for k in ("anchors", "feat_stride", *RC3D_TEST, "with_scores")}

    def forward(self, attrs, params, cls_prob, twin_pred):
        self.refuse_if_cannot_run(attrs["name"], attrs, [cls_prob.shape], layer_type="R-C3D proposals")
        try:
            return TwinProposal(**self.settings(attrs))(cls_prob, twin_pred)
        except ValueError as e:   # a batch of more than one video
            raise CaffeqError(f"layer '{attrs['name']}': {e}") from None

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError, "R-C3D proposals")
        kw = self.settings(node.attrs)
        args = [emit.lit(kw.pop("anchors"), exact=True)] + [f"{k}={emit.lit(v, exact=True)}" for k, v in kw.items()]
        emit.helper(TORCH_TWINS)
        m = emit.module(f"{emit.helper(TORCH_TWIN_PROPOSAL)}({', '.join(args)})")
        emit.note(f"{node.name} (R-C3D proposals): the number of rois depends on the data (at most "
                  f"{emit.out_shape(0)[0]}); NMS runs eagerly on the CPU, so this layer does not trace.")
        call = f"{m}({', '.join(emit.inputs)})"
        if not node.attrs["with_scores"]:
            return call
        t = emit.tmp("proposals")
        emit.stmt(f"{t} = {call}")
        return [f"{t}[0]", f"{t}[1]"]

    def onnx(self, ctx, node):
        a, op = node.attrs, _Ops(ctx)
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(node.inputs[0])], ExportError, "R-C3D proposals")
        prob, deltas = node.inputs
        length, n_anchors = ctx.shape(prob)[2], len(a["anchors"])
        total, video = length * n_anchors, length * a["feat_stride"]
        wins = (np.array(a["anchors"], np.float64)[None]
                + (np.arange(length, dtype=np.float64) * a["feat_stride"])[:, None, None]).reshape(-1, 2)
        wins = wins.astype(np.float32)
        lengths = wins[:, 1] - wins[:, 0] + np.float32(1.0)
        ctr = wins[:, 0] + np.float32(0.5) * lengths
        scores = op("Slice", [prob, op.i64([n_anchors]), op.i64([2 * n_anchors]), op.i64([1])], "fg")
        scores = op("Reshape", [op("Transpose", [scores], "fg_t", perm=[0, 2, 3, 4, 1]), op.i64([-1])], "scores")
        d = op("Reshape", [op("Transpose", [deltas], "d_t", perm=[0, 2, 3, 4, 1]), op.i64([-1, 2])], "deltas")
        x1, x2 = op.decode(op.f32(lengths), op.f32(ctr), op.col(d, 0, "dx"), op.col(d, 1, "dl"), video)
        live = op("Where", [op.long_enough(x1, x2, a["min_size"]), scores, op.f32(-np.inf)], "live")
        k = total if a["pre_nms_top_n"] <= 0 else min(a["pre_nms_top_n"], total)
        vals, idx = ctx.top_k_later_first(live, k, "top")   # sort(stable).flip: ties, higher index first
        c1, c2 = op("Gather", [x1, idx], "c1", axis=0), op("Gather", [x2, idx], "c2", axis=0)
        # NonMaxSuppression's boxes [y1, x1, y2, x2] = [0, start, 1, end + 1]: its IoU is the +1 frame one
        zero = op.zeros_like_rows(c1, "nms_z")
        one = op("Add", [zero, op.f32(1.0)], "nms_one")
        unsq = lambda v, h: op("Unsqueeze", [v, op.i64([1])], h)   # noqa: E731
        boxes = op("Concat", [zero, unsq(c1, "b1"), one, unsq(op("Add", [c2, op.f32(1.0)], "c2p"), "b2")], "boxes", axis=1)
        max_out = k if a["post_nms_top_n"] <= 0 else min(a["post_nms_top_n"], k)
        sel = op("NonMaxSuppression", [op("Unsqueeze", [boxes, op.i64([0])], "nms_b"),
                                       op("Reshape", [vals, op.i64([1, 1, -1])], "nms_s"), op.i64([max_out]),
                                       op.f32([op.ctx.nms_threshold(a["nms_thresh"])]), op.f32([-FLT_MAX])], "sel")
        picked = op("Gather", [sel, op.i64(2)], "picked", axis=1)
        op.twin_rows(op("Gather", [c1, picked], "s1", axis=0), op("Gather", [c2, picked], "s2", axis=0),
                     node.outputs[0])
        if a["with_scores"]:
            ctx.add_node("Unsqueeze", [op("Gather", [vals, picked], "kept_s", axis=0), op.i64([1])], [node.outputs[1]])


@register_layer("Python:rpn.caption_layer.CaptionLayer")
class CaptionLayer(Layer):
    """Text-to-Clip's CaptionLayer at TEST: the best 64 rois, moved by class 1's deltas."""
    data_dependent_shape = True

    def parse(self, lp):
        need_blobs(lp, "CaptionLayer", 4, (2, 3), "cls_prob, twin_pred, rois, features")
        return {"name": lp.name, "with_scores": len(lp.top) == 3, **CAPTION_TEST}

    def infer(self, attrs, in_shapes):
        prob, deltas, rois, feats = (tuple(s) for s in in_shapes)
        rows = rois[0] if rois else 0
        n = min(rows, attrs["top_n"]) if attrs["top_n"] > 0 else min(rows, 1)
        return [(n, 3), (n,) + feats[1:]] + [(n,)] * attrs["with_scores"]

    @staticmethod
    def cannot_run(attrs, in_shapes):
        prob, deltas, rois, feats = (tuple(s) for s in in_shapes)
        if len(prob) != 2 or prob[1] < 2 or deltas != (prob[0], 4) or rois != (prob[0], 3) or feats[:1] != prob[:1]:
            return (f"it reads class 1 of (R, 2) scores, (R, 4) twin deltas, (R, 3) rois and R feature rows, got "
                    f"{list(prob)}, {list(deltas)}, {list(rois)} and {list(feats)}")
        return None

    def _args(self, attrs):
        return attrs["top_n"], float(attrs["min_size"]), attrs["length"]

    def forward(self, attrs, params, *bottoms):
        self.refuse_if_cannot_run(attrs["name"], attrs, [b.shape for b in bottoms], layer_type="CaptionLayer")
        out = caption_proposals(*bottoms, *self._args(attrs))
        return out if attrs["with_scores"] else out[:2]

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(i) for i in range(4)], ExportError)
        emit.helper(TORCH_TWINS)
        t = emit.tmp("captions")
        args = ", ".join(emit.inputs + [emit.lit(v, exact=True) for v in self._args(node.attrs)])
        emit.stmt(f"{t} = {emit.helper(caption_proposals)}({args})")
        return [f"{t}[{i}]" for i in range(3 if node.attrs["with_scores"] else 2)]

    def onnx(self, ctx, node):
        a, op = node.attrs, _Ops(ctx)
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(i) for i in node.inputs], ExportError)
        prob, deltas, rois, feats = node.inputs
        w0, w1 = op.col(rois, 1, "w0"), op.col(rois, 2, "w1")
        lengths = op("Add", [op("Sub", [w1, w0], "l0"), op.f32(1.0)], "lengths")
        ctr = op("Add", [w0, op("Mul", [op.f32(0.5), lengths], "hl")], "ctr")
        x1, x2 = op.decode(lengths, ctr, op.col(deltas, 2, "dx"), op.col(deltas, 3, "dl"), a["length"])
        keep = op("Reshape", [op("NonZero", [op.long_enough(x1, x2, a["min_size"])], "nz"), op.i64([-1])], "keep")
        scores = op("Gather", [op.col(prob, 1, "fg"), keep], "kept_s", axis=0)
        k = op("Min", [op("Shape", [scores], "n"), op.i64([a["top_n"] if a["top_n"] > 0 else 1])], "k")
        vals, pos = ctx.top_k_later_first(scores, k, "top")   # the fork's reversed argsort: ties, higher first
        order = op("Gather", [keep, pos], "order", axis=0)
        op.twin_rows(op("Gather", [x1, order], "s1", axis=0), op("Gather", [x2, order], "s2", axis=0), node.outputs[0])
        ctx.add_node("Gather", [feats, order], [node.outputs[1]], axis=0)
        if a["with_scores"]:
            ctx.add_node("Identity", [vals], [node.outputs[2]])


@register_layer("Python:rpn.GTbox_sorted.ProposalTargetLayer")
class SortByEnd(Layer):
    """JEDDi-Net's GTbox_sorted: rois (R, 3) and features (R, ...) reordered by the rois' end."""

    def parse(self, lp):
        need_blobs(lp, "GTbox_sorted", 2, 2, "rois, features")
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        rois, feats = (tuple(s) for s in in_shapes)
        if len(rois) != 2 or rois[1] < 3:
            raise LayerError(f"GTbox_sorted sorts (R, 3) rois by their end (column 2), got {list(rois)}")
        if not feats or feats[0] != rois[0]:
            raise LayerError(f"GTbox_sorted reorders one feature row per roi: {rois[0]} rois, features {list(feats)}")
        return [rois, feats]

    def forward(self, attrs, params, rois, features):
        if features.shape[0] != rois.shape[0]:
            raise LayerError(f"layer '{attrs['name']}' (GTbox_sorted): {rois.shape[0]} rois but "
                             f"{features.shape[0]} feature rows")
        return sort_by_end(rois, features)

    def pytorch_source(self, node, emit):
        t = emit.tmp("sorted")
        emit.stmt(f"{t} = {emit.helper(sort_by_end)}({', '.join(emit.inputs)})")
        return [f"{t}[0]", f"{t}[1]"]

    def onnx(self, ctx, node):
        op = _Ops(ctx)
        rois, feats = node.inputs
        end = op.col(rois, 2, "end")
        _, order = ctx.add_node("TopK", [end, op("Shape", [end], "n")], [ctx.tmp(f"{node.name}_v"),
                                ctx.tmp(f"{node.name}_order")], axis=0, largest=0, sorted=1)   # ties: lower index first
        ctx.add_node("Gather", [rois, order], [node.outputs[0]], axis=0)
        ctx.add_node("Gather", [feats, order], [node.outputs[1]], axis=0)


@register_layer("Python:rpn.GTboxes_to_GTrois.ProposalTargetLayer")
class GTWindowsToRois(Layer):
    """JEDDi-Net / Text-to-Clip's GTboxes_to_GTrois: gt windows [start, end, label] -> rois [0, start, end]."""

    def parse(self, lp):
        need_blobs(lp, "GTboxes_to_GTrois", 1, 1, "gt_boxes")
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        gt = tuple(in_shapes[0])
        if len(gt) != 2 or gt[1] < 2:
            raise LayerError(f"GTboxes_to_GTrois reads (G, K) ground-truth windows [start, end, ..., label], got {list(gt)}")
        return [gt]

    def forward(self, attrs, params, gt):
        return gt_windows_to_rois(gt)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(gt_windows_to_rois)}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        op = _Ops(ctx)
        gt = node.inputs[0]
        head = op("Slice", [gt, op.i64([0]), op.i64([-1]), op.i64([1])], "head")
        ctx.add_node("Concat", [op.zeros_like_rows(gt, "zeros"), head], [node.outputs[0]], axis=1)


# ---- training layers: read and sized by their setup, never run -----------------------------------

def _has_twin_tops(lp):
    return any("twin" in t for t in lp.top)


class _RoIData(DataLayer):
    """The train nets' RoIDataLayer: a graph input shaped as its setup (cfg.TRAIN), `--input-shape` first."""
    shapes = ()

    def parse(self, lp):
        need_blobs(lp, f"RoIDataLayer ({lp.python_param.module})", 0, len(self.shapes),
                   ", ".join(("data", "gt_boxes", "gt_captions")[:len(self.shapes)]))
        return {"name": lp.name, "tops": list(lp.top), "num_tops": len(self.shapes)}

    def top_shapes(self, attrs, given):
        return [tuple(given.get(i) or s) for i, s in enumerate(self.shapes)]

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        return ["R-C3D's video minibatch: 112 x 112 crops of 128 x 171 frames, pixel means [90, 98, 102] (BGR) "
                "subtracted, random flips at TRAIN; gt_boxes rows [start, end, label] in frames"]


def _rc3d_roi_data(lp):
    """R-C3D's (data, gt_boxes): two tops, the second the ground truth (futurecrew/fast-rcnn's RPN
    nets also give two, (data, labels), from an image RoIDataLayer of their own)."""
    return not lp.bottom and len(lp.top) == 2 and lp.top[1].startswith("gt")


@claim_layers("Python:roi_data_layer.layer.RoIDataLayer", _rc3d_roi_data)
class RC3DRoIData(_RoIData):
    # config.py: (VIDEO_BATCH, 3, max(TRAIN.LENGTH), CROP_SIZE, CROP_SIZE) and gt_windows (1, 3)
    shapes = ((1, 3, 512, 112, 112), (1, 3))

    def parse(self, lp):
        return {**super().parse(lp), "reading_notes": [
            "R-C3D's RoIDataLayer: data is (1, 3, 512, 112, 112), lib/tdcnn/config.py's TRAIN.LENGTH; the "
            "ActivityNet and Charades experiments set 768 (--input-shape data=1,3,768,112,112)"]}


@register_layer("Python:roi_data_layer.layer_caption.RoIDataLayer")
class CaptionRoIData(_RoIData):
    # both repos' experiment yml files: TRAIN.LENGTH [768]; JEDDi-Net's MAX_WORDS 30
    shapes = ((1, 3, 768, 112, 112), (1, 3), (1, 3, 30))


class _TrainTargets(ReadOnlyLayer):
    makes_training_targets = True

    def why_not_run(self, attrs):
        return ("it samples or reads the ground truth of R-C3D's training data and does not run for "
                "inference; use the net's test prototxt")


@claim_layers("Python:rpn.anchor_target_layer.AnchorTargetLayer",
              lambda lp: len(lp.bottom) == 3 and _has_twin_tops(lp))
class TwinAnchorTarget(_TrainTargets):
    """R-C3D's AnchorTargetLayer: bottoms rpn_cls_score (1, 2A, L, H, W), gt_boxes, data."""

    def parse(self, lp):
        need_blobs(lp, "R-C3D's AnchorTargetLayer", 3, 4, "rpn_cls_score, gt_boxes, data")
        p = parse_param_str(lp.python_param.param_str)
        param_str_positive_int(p, "feat_stride")
        return {"name": lp.name, "anchors": len(_number_list(p, "scales", ANCHOR_TARGET_SCALES))}

    def infer(self, attrs, in_shapes):
        score = tuple(in_shapes[0])
        if len(score) < 3:
            raise LayerError(f"R-C3D's AnchorTargetLayer reads rpn_cls_score's last three axes (L, H, W), "
                             f"got {list(score)}")
        a, (length, h, w) = attrs["anchors"], score[-3:]
        return [(1, 1, a * length, h, w)] + [(1, 2 * a, length, h, w)] * 3


@claim_layers("Python:rpn.proposal_target_layer.ProposalTargetLayer", _has_twin_tops)
class TwinProposalTarget(_TrainTargets):
    """R-C3D's ProposalTargetLayer (and Text-to-Clip's proposal_target_layer_binary, with gt rois last)."""
    data_dependent_shape = True
    gt_rois = False

    def parse(self, lp):
        tops = 6 if self.gt_rois else 5
        need_blobs(lp, f"{lp.python_param.module}.ProposalTargetLayer", (2, 3), tops,
                   "rpn_rois, gt_boxes (and the loss for 'sample': 'Hard')")
        return {"name": lp.name, "num_classes": param_str_positive_int(parse_param_str(lp.python_param.param_str), "num_classes")}

    def infer(self, attrs, in_shapes):
        targets = (1, 2 * attrs["num_classes"])
        return [(1, 3), (1, 1), targets, targets, targets] + [(1, 3)] * self.gt_rois


@register_layer("Python:rpn.proposal_target_layer_binary.ProposalTargetLayer")
class BinaryProposalTarget(TwinProposalTarget):
    gt_rois = True


@register_layer("Python:rpn.gt_caption_target_layer_hierarchical.CaptionTargetLayer")
class CaptionTarget(_TrainTargets):
    """JEDDi-Net: ground-truth captions (G, 3, MAX_WORDS) -> input, cont, target sentences (MAX_WORDS, 1)
    and the controller's cont (num_cont, 1); MAX_WORDS 30 as its experiment's yml."""

    def parse(self, lp):
        need_blobs(lp, "gt_caption_target_layer_hierarchical", 1, 4, "gt_captions")
        return {"name": lp.name, "num_cont": param_str_positive_int(parse_param_str(lp.python_param.param_str), "num_cont")}

    def infer(self, attrs, in_shapes):
        return [(30, 1)] * 3 + [(attrs["num_cont"], 1)]


class _ControllerGlue(ReadOnlyLayer):
    """JEDDi-Net's pad_controller_layer and get_controller_hidden_layer (2 bottoms): rows padded to, or cut
    at, the ground-truth sentence count; the setup gives `rows` x bottom[0]'s axes 1 and 2."""
    rows = 1

    def parse(self, lp):
        need_blobs(lp, lp.python_param.module, 2, 1, "sentence rows, controller cont")
        return {"name": lp.name, "kind": lp.python_param.module}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 3:
            raise LayerError(f"{attrs['kind']} reads bottom 0's axes 1 and 2, got {list(s)}")
        return [(self.rows, s[1], s[2])]

    def why_not_run(self, attrs):
        return ("it sizes JEDDi-Net's caption controller by the ground-truth sentence count and does not run "
                "for inference; use the net's test prototxt")


@register_layer("Python:rpn.pad_controller_layer.CaptionTargetLayer")
class PadController(_ControllerGlue):
    rows = 29


@register_layer("Python:rpn.get_controller_hidden_layer.CaptionTargetLayer")
class ControllerHidden(_ControllerGlue):
    rows = 1
