"""Baidu Apollo's perception layers: RPNProposalSSD, RCNNProposal and DFMBPSROIAlign.

Apollo's traffic-light detector (and its other Faster R-CNN style nets) end in these three types.
The semantics are those of Apollo's TensorRT plugins, modules/perception/inference/tensorrt/plugins/
(rpn_proposal_ssd_plugin, rcnn_proposal_plugin, dfmb_psroi_align_plugin, kernels.cu, nms_cuda.cu);
the parameters are the messages of the Caffe those nets were trained with (gengqx/caffe 1cd66ba
"add caffe layers for apollo": detection_output_ssd_param, bbox_reg_param, dfmb_psroi_pooling_param).

- RPNProposalSSD (bottoms rpn_cls_prob_reshape (1, 2A, H, W), rpn_bbox_pred (1, 4A, H, W),
  im_info (1, 6, 1, 1) = [height, width, ...]): anchors of gen_anchor_param's anchor_width /
  anchor_height centred on (w * heat_map_a, h * heat_map_a), rows ordered (h, w, a); the deltas
  (channel a * 4 + k) times bbox_std plus bbox_mean; decoded with the +1 pixel sizes; clipped to
  [0, int(width) - 1] x [0, int(height) - 1] when refine_out_of_map_bbox; kept when the object score
  (channel A + a) is > threshold_objectness and the box passes min_size_mode (HEIGHT_AND_WIDTH: both
  sides at least min_size_h / min_size_w; HEIGHT_OR_WIDTH: one of them); sorted by score, the best
  nms_param.max_candidate_n, greedy NMS (IoU > overlap_ratio drops, +1 pixel sizes), the first
  top_n.  Top rois (top_n, 5, 1, 1) = [0, x1, y1, x2, y2], the rows after the kept ones all -1, as
  the plugin fills its fixed output (getOutputDimensions: top_n rows).
- RCNNProposal (bottoms cls_score_softmax (R, C + 1), bbox_pred (R, 4 (C + 1)), rois (R, 5),
  im_info): the rows of the rois whose image index is 0 (the first that many rows, as the plugin
  reads them); each class's deltas normalized and decoded against its roi, clipped to
  [0, width - 1] x [0, height - 1] (im_info not truncated here); a roi goes when 1 - background
  probability < threshold_objectness; its class is the first c with the largest prob - threshold[c],
  and it goes when that is < 0; then probability > 0 and min_size_mode, sort, max_candidate_n, NMS,
  top_n.  Top bboxes (top_n, 5 [+ C + 1], 1, 1) = [0, x1, y1, x2, y2 (, every class probability when
  rpn_proposal_output_score)], the rest -1.  The plugin hard-codes C + 1 = 4 (the traffic-light net);
  here C comes from num_class.  regress_agnostic is ignored, as by the plugin (a TODO there).
- DFMBPSROIAlign (bottoms features (N, output_dim * group_height * group_width, H, W), rois (R, 5)
  [, trans (R, 2 K, part_height, part_width)]): for each roi and output bin, the roi padded by
  pad_ratio of its +1 size and mapped by (v - heat_map_b) / heat_map_a; bins of at least 0.1; the
  bin's start moved by trans * trans_std * roi size and truncated to an integer; sample_per_part^2
  bilinear samples at the sub-bin centres from that start (a sample at <= -1 or >= the map's size
  is skipped, corners outside read 0), averaged over the samples taken (0 when none), from channel
  (ctop * group_height + gh) * group_width + gw.  A roi whose image index is not in the batch gives
  zeros.  With a trans bottom, K classes share output_dim (channels_each_class = output_dim / K),
  as the Caffe layer counts them (the plugin's num_classes_ reads another axis).

Batches: the plugins' outputs are for one image (batch size hard-coded to 1 there), so the two
proposal layers take one image per batch.  Ties in the score sort keep the anchors' (rois') order;
the plugins' atomicAdd gathers leave that order unspecified.  ONNX: apollo_onnx.py (the proposals through TopK and
NonMaxSuppression, whose IoU gets the +1 pixel sizes from boxes given as [y1, x1, y2 + 1, x2 + 1]).

Softmax axes as Apollo's TensorRT builder counts them (apollo_rcnn_softmax_axis, a net_rewrite): Apollo's
RTNet (ApolloAuto/apollo d444b00 modules/perception/common/inference/tensorrt/rt_net.cc) builds with
TensorRT's implicit batch, so every tensor lacks Caffe's batch axis, and its SoftmaxPlugin
(ffa0765 .../tensorrt/plugins/softmax_plugin.h) normalises over axis softmax_param.axis - 1 of those dims.
The RoI head's tensors keep the rois on their first non-batch axis: DFMBPSROIAlignPlugin's output is
Dims4(rows of rois, output_dim, pooled_height, pooled_width) (aa1e025 dfmb_psroi_align_plugin.h), and
addInnerproductLayer's IFullyConnectedLayer keeps every axis before the last three, giving (R, K, 1, 1).
So the traffic-light detector's cls_score_softmax (axis: 2, "if use CaffeNet, change to 1") normalises
the K class scores of each roi, which is Caffe's axis 1 of the (R, K) InnerProduct top caffeq (and
Apollo's CaffeNet) computes; in BVLC Caffe axis 2 is out of range there.  A Softmax whose axis is 2,
whose bottom an InnerProduct (axis 1) writes and whose top an RCNNProposal reads is read with axis 1,
with a note; no other Softmax changes.
"""
import numpy as np
import torch
from torch import nn

from .apollo_onnx import emit_dfmb_psroi_align, emit_rcnn_proposal, emit_rpn_proposal_ssd
from .registry import Layer, LayerError, need_blobs, net_rewrite, register_layer, torch_sources

HEIGHT_AND_WIDTH, HEIGHT_OR_WIDTH = 0, 1


# ---- the computation (also copied into model.py) ---------------------------------------------------

def apollo_decode(boxes, deltas):
    """kernels.cu bbox_transform_inv_kernel: boxes (P, 4) [x1, y1, x2, y2], deltas (P, K, 4) ->
    (P, K, 4); sizes count both end pixels, centres at x1 + 0.5 (w - 1)."""
    w = (boxes[:, 2] - boxes[:, 0] + 1)[:, None]
    h = (boxes[:, 3] - boxes[:, 1] + 1)[:, None]
    cx = boxes[:, 0:1] + 0.5 * (w - 1)
    cy = boxes[:, 1:2] + 0.5 * (h - 1)
    px = deltas[..., 0] * w + cx
    py = deltas[..., 1] * h + cy
    pw = torch.exp(deltas[..., 2]) * w
    ph = torch.exp(deltas[..., 3]) * h
    return torch.stack([px - 0.5 * (pw - 1), py - 0.5 * (ph - 1), px + 0.5 * (pw - 1), py + 0.5 * (ph - 1)], dim=-1)


def apollo_clip(boxes, height, width):
    """kernels.cu clip_boxes_kernel: x to [0, width - 1], y to [0, height - 1] (a NaN stays)."""
    zero = torch.zeros((), dtype=boxes.dtype, device=boxes.device)
    out = []
    for k in range(4):
        v = boxes[..., k]
        top = (width if k % 2 == 0 else height) - 1
        out.append(torch.where(v < 0, zero, torch.where(v > top, top.to(v.dtype), v)))
    return torch.stack(out, dim=-1)


def apollo_size_ok(boxes, mode: int, min_h: float, min_w: float):
    """kernels.cu filter_boxes_kernel's size test: mode 0 drops a box lower than min_h or narrower than
    min_w, mode 1 one lower and narrower; sizes with the +1 pixel."""
    w = boxes[:, 2] - boxes[:, 0] + 1
    h = boxes[:, 3] - boxes[:, 1] + 1
    if mode == 0:
        return ~((h < min_h) | (w < min_w))
    return ~((h < min_h) & (w < min_w))


def apollo_nms(boxes, thresh: float, top_n: int):
    """nms_cuda.cu NmsForward: boxes (P, 4) best first; a box goes when its IoU (+1 pixel sizes) with
    a kept box is > thresh.  Returns the first top_n kept indices."""
    boxes = boxes.detach().float().cpu()
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    area = (x2 - x1 + 1) * (y2 - y1 + 1)
    thr = torch.tensor(thresh, dtype=torch.float32)
    gone = torch.zeros(boxes.shape[0], dtype=torch.bool)
    keep = []
    for i in range(boxes.shape[0]):
        if bool(gone[i]):
            continue
        keep.append(i)
        if len(keep) >= top_n:
            break
        iw = torch.clamp(torch.minimum(x2[i], x2) - torch.maximum(x1[i], x1) + 1, min=0)
        ih = torch.clamp(torch.minimum(y2[i], y2) - torch.maximum(y1[i], y1) + 1, min=0)
        inter = iw * ih
        later = torch.arange(boxes.shape[0]) > i
        gone |= later & (inter / (area[i] + area - inter) > thr)
    return keep


def apollo_rows(boxes, extra, keep_idx, top_n: int):
    """The plugins' fixed output: rows [0, x1, y1, x2, y2 (, extra)] of the kept boxes, then rows of
    -1 up to top_n; shaped (top_n, columns, 1, 1)."""
    cols = 5 + (0 if extra is None else extra.shape[1])
    out = torch.full((top_n, cols), -1.0, dtype=boxes.dtype, device=boxes.device)
    k = len(keep_idx)
    if k:
        idx = torch.tensor(keep_idx, dtype=torch.long, device=boxes.device)
        out[:k, 0] = 0
        out[:k, 1:5] = boxes[idx]
        if extra is not None:
            out[:k, 5:] = extra[idx]
    return out.reshape(top_n, cols, 1, 1)


class ApolloRPNProposalSSD(nn.Module):
    """Apollo's RPNProposalSSD plugin for one image: -> rois (top_n, 5, 1, 1), unused rows -1."""

    def __init__(self, anchor_widths, anchor_heights, stride, bbox_mean, bbox_std, min_size_mode, min_size_h,
                 min_size_w, threshold_objectness, refine, max_candidate_n, overlap_ratio, top_n):
        super().__init__()
        self.anchor_widths, self.anchor_heights, self.stride = anchor_widths, anchor_heights, stride
        self.bbox_mean, self.bbox_std = bbox_mean, bbox_std
        self.min_size_mode, self.min_size_h, self.min_size_w = min_size_mode, min_size_h, min_size_w
        self.threshold_objectness, self.refine = threshold_objectness, refine
        self.max_candidate_n, self.overlap_ratio, self.top_n = max_candidate_n, overlap_ratio, top_n

    def anchors(self, height: int, width: int):
        """generate_anchors_kernel: (H * W * A, 4), the centre w * stride in float32, the half sizes
        0.5 * (size - 1) added in double and stored as float32."""
        f32 = torch.float32
        aw = torch.tensor(self.anchor_widths, dtype=f32)
        ah = torch.tensor(self.anchor_heights, dtype=f32)
        stride = torch.tensor(self.stride, dtype=f32)
        cx = (torch.arange(width, dtype=f32) * stride)[None, :, None].double()
        cy = (torch.arange(height, dtype=f32) * stride)[:, None, None].double()
        hw = (0.5 * (aw - 1).double())[None, None, :]
        hh = (0.5 * (ah - 1).double())[None, None, :]
        shape = (height, width, len(self.anchor_widths))
        corners = [(cx - hw).expand(shape), (cy - hh).expand(shape), (cx + hw).expand(shape), (cy + hh).expand(shape)]
        return torch.stack(corners, dim=-1).reshape(-1, 4).to(f32)

    def forward(self, prob, deltas, im_info):
        a = len(self.anchor_widths)
        height, width = prob.shape[2], prob.shape[3]
        dt = prob.dtype
        scores = prob[0, a:2 * a].permute(1, 2, 0).reshape(-1)
        d = deltas[0].reshape(a, 4, height, width).permute(2, 3, 0, 1).reshape(-1, 4)
        d = d * torch.tensor(self.bbox_std, dtype=dt) + torch.tensor(self.bbox_mean, dtype=dt)
        anchors = self.anchors(height, width).to(device=prob.device, dtype=dt)
        boxes = apollo_decode(anchors, d[:, None, :])[:, 0]
        info = im_info.reshape(-1).to(dt)
        if self.refine:
            boxes = apollo_clip(boxes, torch.trunc(info[0]), torch.trunc(info[1]))
        keep = (scores > self.threshold_objectness) & apollo_size_ok(boxes, self.min_size_mode, self.min_size_h,
                                                                      self.min_size_w)
        boxes, scores = boxes[keep], scores[keep]
        order = torch.sort(scores, descending=True, stable=True)[1][:self.max_candidate_n]
        boxes = boxes[order]
        return apollo_rows(boxes, None, apollo_nms(boxes, self.overlap_ratio, self.top_n), self.top_n)


class ApolloRCNNProposal(nn.Module):
    """Apollo's RCNNProposal plugin for one image: -> bboxes (top_n, 5 [+ C + 1], 1, 1), unused rows -1."""

    def __init__(self, num_class, bbox_mean, bbox_std, min_size_mode, min_size_h, min_size_w, threshold_objectness,
                 thresholds, refine, output_score, max_candidate_n, overlap_ratio, top_n):
        super().__init__()
        self.num_class, self.bbox_mean, self.bbox_std = num_class, bbox_mean, bbox_std
        self.min_size_mode, self.min_size_h, self.min_size_w = min_size_mode, min_size_h, min_size_w
        self.threshold_objectness, self.thresholds = threshold_objectness, thresholds
        self.refine, self.output_score = refine, output_score
        self.max_candidate_n, self.overlap_ratio, self.top_n = max_candidate_n, overlap_ratio, top_n

    def forward(self, cls_prob, bbox_pred, rois, im_info):
        k = self.num_class + 1
        r = rois.shape[0]
        dt = cls_prob.dtype
        rois = rois.reshape(r, -1).to(dt)
        probs = cls_prob.reshape(r, k)
        d = bbox_pred.reshape(r, k, 4) * torch.tensor(self.bbox_std, dtype=dt) + torch.tensor(self.bbox_mean, dtype=dt)
        boxes = apollo_decode(rois[:, 1:5], d)
        info = im_info.reshape(-1).to(dt)
        if self.refine:
            boxes = apollo_clip(boxes, info[0], info[1])
        # get_rois_nums_kernel counts image 0's rois; the plugin reads that many rows from the first
        n = int((torch.trunc(rois[:, 0]) == 0).sum())
        probs, boxes = probs[:n], boxes[:n]
        margin = probs[:, 1:] - torch.tensor(self.thresholds, dtype=dt)
        best, cls = torch.max(margin, dim=1)   # the first class of the largest margin
        keep = ~((1.0 - probs[:, 0]) < self.threshold_objectness) & ~(best < 0)
        picked = boxes[torch.arange(n, device=boxes.device), cls + 1]
        score = probs[torch.arange(n, device=boxes.device), cls + 1]
        picked, score, probs = picked[keep], score[keep], probs[keep]
        keep = (score > 0.0) & apollo_size_ok(picked, self.min_size_mode, self.min_size_h, self.min_size_w)
        picked, score, probs = picked[keep], score[keep], probs[keep]
        order = torch.sort(score, descending=True, stable=True)[1][:self.max_candidate_n]
        picked, probs = picked[order], probs[order]
        kept = apollo_nms(picked, self.overlap_ratio, self.top_n)
        return apollo_rows(picked, probs if self.output_score else None, kept, self.top_n)


def dfmb_psroi_align(x, rois, trans, heat_map_a: float, heat_map_b: float, pad_ratio: float, output_dim: int,
                     group_height: int, group_width: int, pooled_height: int, pooled_width: int,
                     sample_per_part: int, trans_std: float, part_height: int, part_width: int):
    """DFMBPSROIAlignForward: -> (R, output_dim, pooled_height, pooled_width).  trans is None or
    (R', 2 K, part_height, part_width), R' >= R."""
    f32, f64 = torch.float32, torch.float64
    n, channels, height, width = x.shape
    r = rois.shape[0]
    dev = x.device
    rois = rois.reshape(r, -1)[:, :5].to(f32)
    b = torch.trunc(rois[:, 0]).long()
    live = (b >= 0) & (b < n)
    pad_w = (rois[:, 3] - rois[:, 1] + 1) * pad_ratio
    pad_h = (rois[:, 4] - rois[:, 2] + 1) * pad_ratio
    start_w = (rois[:, 1] - pad_w - heat_map_b) / heat_map_a
    start_h = (rois[:, 2] - pad_h - heat_map_b) / heat_map_a
    end_w = (rois[:, 3] + pad_w - heat_map_b) / heat_map_a
    end_h = (rois[:, 4] + pad_h - heat_map_b) / heat_map_a
    tenth = torch.tensor(0.1, dtype=f32)
    roi_h = torch.maximum(end_h - start_h, tenth)
    roi_w = torch.maximum(end_w - start_w, tenth)
    bin_h, bin_w = roi_h / pooled_height, roi_w / pooled_width
    sub_h, sub_w = bin_h / sample_per_part, bin_w / sample_per_part
    ph = torch.arange(pooled_height, dtype=f32, device=dev)
    pw = torch.arange(pooled_width, dtype=f32, device=dev)
    ctop = torch.arange(output_dim, device=dev)
    if trans is None:
        trans_x = torch.zeros((r, 1, 1, 1), dtype=f32, device=dev)
        trans_y = trans_x
    else:
        classes = trans.shape[1] // 2
        per_class = output_dim // classes
        part_h = torch.trunc(ph / pooled_height * part_height).long()
        part_w = torch.trunc(pw / pooled_width * part_width).long()
        cls = ctop // per_class
        t = trans[:r].to(f32)
        trans_x = t[:, (cls * 2)[:, None, None], part_h[None, :, None], part_w[None, None, :]] * trans_std
        trans_y = t[:, (cls * 2 + 1)[:, None, None], part_h[None, :, None], part_w[None, None, :]] * trans_std
    col = lambda v: v[:, None, None, None]   # noqa: E731  (R,) -> (R, 1, 1, 1)
    hstart = torch.trunc(ph[None, None, :, None] * col(bin_h) + col(start_h) + trans_y * col(roi_h))
    wstart = torch.trunc(pw[None, None, None, :] * col(bin_w) + col(start_w) + trans_x * col(roi_w))
    shape = (r, output_dim, pooled_height, pooled_width)
    hstart, wstart = hstart.expand(shape), wstart.expand(shape)
    off = torch.arange(sample_per_part, dtype=f64, device=dev) + 0.5
    # (R, D, PH, PW, S, 1) and (R, D, PH, PW, 1, S): the start plus (i + 0.5) * sub-bin, in double
    hs = (hstart.double()[..., None, None] + off[:, None] * sub_h.double()[:, None, None, None, None, None]).to(f32)
    ws = (wstart.double()[..., None, None] + off[None, :] * sub_w.double()[:, None, None, None, None, None]).to(f32)
    hs, ws = torch.broadcast_tensors(hs, ws)
    inside = ~((ws <= -1) | (ws >= width) | (hs <= -1) | (hs >= height))
    gh = torch.clamp(torch.floor(ph * group_height / pooled_height).long(), 0, group_height - 1)
    gw = torch.clamp(torch.floor(pw * group_width / pooled_width).long(), 0, group_width - 1)
    chan = (ctop[:, None, None] * group_height + gh[None, :, None]) * group_width + gw[None, None, :]
    base = (b.clamp(0, n - 1)[:, None, None, None] * channels + chan[None]) * height * width
    base = base[..., None, None]
    flat = x.reshape(-1).to(f32)
    x1, y1 = torch.floor(ws), torch.floor(hs)
    x2, y2 = torch.ceil(ws), torch.ceil(hs)
    dx, dy = ws - x1, hs - y1

    def corner(xc, yc):
        ok = (xc >= 0) & (xc < width) & (yc >= 0) & (yc < height)
        idx = base + (yc.clamp(0, height - 1) * width + xc.clamp(0, width - 1)).long()
        return torch.where(ok, flat[idx], torch.zeros((), dtype=f32, device=dev))

    value = ((1 - dx) * (1 - dy) * corner(x1, y1) + (1 - dx) * dy * corner(x1, y2)
             + dx * (1 - dy) * corner(x2, y1) + dx * dy * corner(x2, y2))
    value = torch.where(inside, value, torch.zeros((), dtype=f32, device=dev))
    total = value.sum(dim=(-1, -2))
    count = inside.sum(dim=(-1, -2))
    out = torch.where(count == 0, torch.zeros((), dtype=f32, device=dev), total / count.clamp(min=1))
    out = torch.where(col(live), out, torch.zeros((), dtype=f32, device=dev))
    return out.to(x.dtype)


class ApolloDFMBPSROIAlign(nn.Module):
    def __init__(self, **settings):
        super().__init__()
        self.settings = settings

    def forward(self, x, rois, trans=None):
        return dfmb_psroi_align(x, rois, trans, **self.settings)


# model.py gets these very functions and classes (the box helpers once, each module class apart)
TORCH_BOXES = torch_sources(apollo_decode, apollo_clip, apollo_size_ok, apollo_nms, apollo_rows)


# ---- reading the parameters -----------------------------------------------------------------------

def _bbox_reg(lp):
    p = lp.bbox_reg_param
    if not lp.HasField("bbox_reg_param") or len(p.bbox_mean) != 4 or len(p.bbox_std) != 4:
        raise LayerError(f"{lp.type} needs bbox_reg_param with 4 bbox_mean and 4 bbox_std values, got "
                         f"{len(p.bbox_mean)} and {len(p.bbox_std)}")
    return [float(v) for v in p.bbox_mean], [float(v) for v in p.bbox_std]


def _ssd_common(lp):
    """The fields both proposal plugins read from detection_output_ssd_param and bbox_reg_param."""
    if not lp.HasField("detection_output_ssd_param"):
        raise LayerError(f"{lp.type} needs detection_output_ssd_param (with nms_param)")
    p = lp.detection_output_ssd_param
    nms = p.nms_param
    for field in ("overlap_ratio", "top_n", "max_candidate_n"):
        if not len(getattr(nms, field)):
            raise LayerError(f"detection_output_ssd_param.nms_param.{field} is required (the plugin reads its first value)")
    overlap, top_n, cands = float(nms.overlap_ratio[0]), int(nms.top_n[0]), int(nms.max_candidate_n[0])
    if not 0 <= overlap <= 1:
        raise LayerError(f"detection_output_ssd_param.nms_param.overlap_ratio must be in [0, 1], got {overlap}")
    if top_n < 1 or cands < 1:
        raise LayerError(f"detection_output_ssd_param.nms_param.top_n and max_candidate_n must be >= 1, got "
                         f"{top_n} and {cands}")
    for field in ("min_size_h", "min_size_w", "threshold_objectness"):
        if not np.isfinite(getattr(p, field)):
            raise LayerError(f"detection_output_ssd_param.{field} must be a finite number, got {getattr(p, field)}")
    mean, std = _bbox_reg(lp)
    notes = []
    if any(nms.use_soft_nms) or any(nms.voting):
        notes.append("nms_param use_soft_nms / voting are set; Apollo's plugin "
                     "runs plain NMS and so does caffeq")
    return {"bbox_mean": mean, "bbox_std": std, "min_size_mode": int(p.min_size_mode),
            "min_size_h": float(p.min_size_h), "min_size_w": float(p.min_size_w),
            "threshold_objectness": float(p.threshold_objectness), "refine": bool(p.refine_out_of_map_bbox),
            "max_candidate_n": cands, "overlap_ratio": overlap, "top_n": top_n, "reading_notes": notes}


def _one_image(kind, shape):
    if shape[0] != 1:
        raise LayerError(f"{kind} takes one image per batch (Apollo's plugin hard-codes batch size 1), got {shape[0]}")


def _im_info(kind, shape):
    if int(np.prod(shape[1:])) < 2:
        raise LayerError(f"{kind}: im_info must hold [height, width, ...] (Apollo's is (1, 6, 1, 1)), got {list(shape)}")


class _ApolloSpec(Layer):
    def forward(self, attrs, params, *inputs):
        return self.module(attrs)(*inputs)

    #: the model.py helpers the module class needs, written before it
    needs = (TORCH_BOXES,)

    def pytorch_source(self, node, emit):
        for helper in self.needs:
            emit.helper(helper)
        m = emit.module(f"{emit.helper(self.module_class)}({self.module_args(node.attrs, emit)})")
        return f"{m}({', '.join(emit.inputs)})"

    def module_args(self, attrs, emit):
        return ", ".join(f"{k}={emit.lit(v, exact=True)}" for k, v in self.settings(attrs).items())

    def module(self, attrs):
        return self.module_class(**self.settings(attrs))


@register_layer("RPNProposalSSD")
class RPNProposalSSD(_ApolloSpec):
    module_class = ApolloRPNProposalSSD

    def onnx(self, ctx, node):
        height, width = ctx.shape(node.inputs[0])[2:4]
        emit_rpn_proposal_ssd(ctx, node, self.module(node.attrs).anchors(height, width).numpy())

    def parse(self, lp):
        need_blobs(lp, "RPNProposalSSD", 3, 1, "rpn_cls_prob_reshape, rpn_bbox_pred, im_info")
        attrs = _ssd_common(lp)
        p = lp.detection_output_ssd_param
        if len(p.heat_map_a) != 1 or not p.heat_map_a[0] > 0:
            raise LayerError(f"detection_output_ssd_param.heat_map_a must be one positive stride, got {list(p.heat_map_a)}")
        g = p.gen_anchor_param
        if not len(g.anchor_width) or len(g.anchor_width) != len(g.anchor_height):
            raise LayerError(f"detection_output_ssd_param.gen_anchor_param needs anchor_width and anchor_height in "
                             f"pairs (the plugin reads only these), got {len(g.anchor_width)} and {len(g.anchor_height)}")
        if any(v <= 0 for v in list(g.anchor_width) + list(g.anchor_height)):
            raise LayerError("detection_output_ssd_param.gen_anchor_param anchor sizes must be positive")
        if any(v != 0 for v in p.heat_map_b):
            attrs["reading_notes"].append("heat_map_b is set; Apollo's plugin "
                                          "centres its anchors at w * heat_map_a (offset 0) and so does caffeq")
        return {**attrs, "stride": float(p.heat_map_a[0]), "anchor_widths": [float(v) for v in g.anchor_width],
                "anchor_heights": [float(v) for v in g.anchor_height]}

    def infer(self, attrs, in_shapes):
        prob, deltas, info = (tuple(s) for s in in_shapes)
        a = len(attrs["anchor_widths"])
        if len(prob) != 4 or prob[1] != 2 * a:
            raise LayerError(f"RPNProposalSSD: rpn_cls_prob_reshape must be (1, {2 * a}, H, W) for {a} anchors, "
                             f"got {list(prob)}")
        if deltas != (prob[0], 4 * a, prob[2], prob[3]):
            raise LayerError(f"RPNProposalSSD: rpn_bbox_pred must be ({prob[0]}, {4 * a}, {prob[2]}, {prob[3]}), "
                             f"got {list(deltas)}")
        _one_image("RPNProposalSSD", prob)
        _im_info("RPNProposalSSD", info)
        return [(attrs["top_n"], 5, 1, 1)]

    @staticmethod
    def settings(attrs):
        keys = ("anchor_widths", "anchor_heights", "stride", "bbox_mean", "bbox_std", "min_size_mode", "min_size_h",
                "min_size_w", "threshold_objectness", "refine", "max_candidate_n", "overlap_ratio", "top_n")
        return {k: attrs[k] for k in keys}


@register_layer("RCNNProposal")
class RCNNProposal(_ApolloSpec):
    module_class = ApolloRCNNProposal

    def onnx(self, ctx, node):
        emit_rcnn_proposal(ctx, node)

    def parse(self, lp):
        need_blobs(lp, "RCNNProposal", 4, 1, "cls_score_softmax, bbox_pred, rois, im_info")
        attrs = _ssd_common(lp)
        p = lp.detection_output_ssd_param
        if p.num_class < 1:
            raise LayerError(f"detection_output_ssd_param.num_class must be >= 1, got {p.num_class}")
        if len(p.threshold) < p.num_class:
            raise LayerError(f"detection_output_ssd_param.threshold needs one value per class ({p.num_class}), "
                             f"got {len(p.threshold)}")
        if p.regress_agnostic:
            attrs["reading_notes"].append("regress_agnostic is true (its default); "
                                          "Apollo's plugin regresses each class's box all the same, as caffeq does")
        return {**attrs, "num_class": int(p.num_class), "thresholds": [float(v) for v in p.threshold[:p.num_class]],
                "output_score": bool(p.rpn_proposal_output_score)}

    def infer(self, attrs, in_shapes):
        prob, deltas, rois, info = (tuple(s) for s in in_shapes)
        k = attrs["num_class"] + 1
        r = rois[0] if rois else 0
        if len(rois) < 2 or int(np.prod(rois[1:])) != 5:
            raise LayerError(f"RCNNProposal: rois must be (R, 5), got {list(rois)}")
        if prob[0] != r or int(np.prod(prob[1:])) != k:
            raise LayerError(f"RCNNProposal: cls_score_softmax must be ({r}, {k}) for num_class {k - 1}, got {list(prob)}")
        if deltas[0] != r or int(np.prod(deltas[1:])) != 4 * k:
            raise LayerError(f"RCNNProposal: bbox_pred must be ({r}, {4 * k}) for num_class {k - 1}, got {list(deltas)}")
        _one_image("RCNNProposal", info)
        _im_info("RCNNProposal", info)
        return [(attrs["top_n"], 5 + (k if attrs["output_score"] else 0), 1, 1)]

    @staticmethod
    def settings(attrs):
        keys = ("num_class", "bbox_mean", "bbox_std", "min_size_mode", "min_size_h", "min_size_w",
                "threshold_objectness", "thresholds", "refine", "max_candidate_n", "overlap_ratio", "top_n")
        return {**{k: attrs[k] for k in keys}, "output_score": attrs["output_score"]}


@register_layer("DFMBPSROIAlign")
class DFMBPSROIAlign(_ApolloSpec):
    module_class, needs = ApolloDFMBPSROIAlign, (dfmb_psroi_align,)

    def onnx(self, ctx, node):
        emit_dfmb_psroi_align(ctx, node)

    def parse(self, lp):
        need_blobs(lp, "DFMBPSROIAlign", (2, 3), 1, "features, rois[, trans]")
        if not lp.HasField("dfmb_psroi_pooling_param"):
            raise LayerError("DFMBPSROIAlign needs dfmb_psroi_pooling_param (heat_map_a and output_dim are required)")
        p = lp.dfmb_psroi_pooling_param
        for field in ("heat_map_a", "output_dim"):
            if not p.HasField(field):
                raise LayerError(f"dfmb_psroi_pooling_param.{field} is required")
        if not p.heat_map_a > 0 or not p.heat_map_b >= 0 or not p.pad_ratio >= 0:
            raise LayerError(f"dfmb_psroi_pooling_param: heat_map_a must be > 0, heat_map_b and pad_ratio >= 0, got "
                             f"{p.heat_map_a}, {p.heat_map_b} and {p.pad_ratio}")
        if not np.isfinite(p.trans_std):
            raise LayerError(f"dfmb_psroi_pooling_param.trans_std must be a finite number, got {p.trans_std}")
        for field in ("output_dim", "sample_per_part", "group_height", "group_width", "pooled_height", "pooled_width",
                      "part_height", "part_width"):
            if getattr(p, field) < 1:
                raise LayerError(f"dfmb_psroi_pooling_param.{field} must be > 0, got {getattr(p, field)}")
        return {"heat_map_a": float(p.heat_map_a), "heat_map_b": float(p.heat_map_b), "pad_ratio": float(p.pad_ratio),
                "output_dim": int(p.output_dim), "group_height": int(p.group_height),
                "group_width": int(p.group_width), "pooled_height": int(p.pooled_height),
                "pooled_width": int(p.pooled_width), "sample_per_part": int(p.sample_per_part),
                "trans_std": float(p.trans_std), "part_height": int(p.part_height), "part_width": int(p.part_width)}

    def infer(self, attrs, in_shapes):
        x, rois = tuple(in_shapes[0]), tuple(in_shapes[1])
        want = attrs["output_dim"] * attrs["group_height"] * attrs["group_width"]
        if len(x) != 4 or x[1] != want:
            raise LayerError(f"DFMBPSROIAlign: features must be (N, {want}, H, W) (output_dim x group_height x "
                             f"group_width), got {list(x)}")
        if len(rois) < 2 or rois[1] != 5:
            raise LayerError(f"DFMBPSROIAlign: rois must be (R, 5), got {list(rois)}")
        if len(in_shapes) == 3:
            t = tuple(in_shapes[2])
            if len(t) != 4 or t[1] % 2 or t[1] == 0 or attrs["output_dim"] % (t[1] // 2) or t[0] < rois[0]:
                raise LayerError(f"DFMBPSROIAlign: trans must be (>= {rois[0]}, 2 x classes, part_height, part_width) "
                                 f"with output_dim {attrs['output_dim']} a multiple of the classes, got {list(t)}")
            if (t[2], t[3]) != (attrs["part_height"], attrs["part_width"]):
                raise LayerError(f"DFMBPSROIAlign: trans is {t[2]} x {t[3]}, but part_height x part_width is "
                                 f"{attrs['part_height']} x {attrs['part_width']}")
        return [(rois[0], attrs["output_dim"], attrs["pooled_height"], attrs["pooled_width"])]

    @staticmethod
    def settings(attrs):
        keys = ("heat_map_a", "heat_map_b", "pad_ratio", "output_dim", "group_height", "group_width",
                "pooled_height", "pooled_width", "sample_per_part", "trans_std", "part_height", "part_width")
        return {k: attrs[k] for k in keys}



# ---- Apollo's TensorRT axis for the RoI head's Softmax ------------------------------------------------

@net_rewrite
def apollo_rcnn_softmax_axis(net, source=""):
    """A Softmax with axis 2 on an InnerProduct's (R, K) top that an RCNNProposal reads: axis 1 (see the
    module docstring: Apollo's SoftmaxPlugin takes axis - 1 of the implicit-batch dims (R, K, 1, 1))."""
    if not any(lp.type == "RCNNProposal" for lp in net.layer):
        return []
    proposal_inputs = {lp.bottom[0] for lp in net.layer if lp.type == "RCNNProposal" and len(lp.bottom)}
    writer = {}   # blob -> the layer that last wrote it, so far
    changed = []
    for lp in net.layer:
        if (lp.type == "Softmax" and len(lp.bottom) == 1 and len(lp.top) == 1 and lp.top[0] in proposal_inputs
                and lp.softmax_param.axis == 2):
            ip = writer.get(lp.bottom[0])
            if ip is not None and ip.type == "InnerProduct" and ip.inner_product_param.axis == 1:
                lp.softmax_param.axis = 1
                changed.append(lp.name)
        for top in lp.top:
            writer[top] = lp
    if not changed:
        return []
    return [f"{source + ': ' if source else ''}Softmax layer(s) {', '.join(map(repr, changed))} (axis 2 on an "
            f"InnerProduct's (rois, classes) top, read by RCNNProposal) read with axis 1, the class axis: Apollo's "
            f"TensorRT SoftmaxPlugin normalises axis - 1 of the implicit-batch dims (rois, classes, 1, 1), as the "
            f"file's comment says (axis 1 for CaffeNet)"]
