"""Huawei Ascend's ATC converter (CANN): the Faster R-CNN operators its guide has users write into a
py-faster-rcnn test net, Proposal with Ascend's fields and FSRDetectionOutput, read and sized, not run.

Sources: Ascend/parser fc02ad7 parser/proto/caffe/caffe.proto (ProposalParameter 1-9,
fsrdetectionoutput_param = 222, FSRDetectionOutputParameter 1-4); the CANN operator pages on hiascend.com
(aolapi operatorlist_00141 Proposal, _00121 FSRDetectionOutput, _00134 ROIPooling) and the operator
prototypes of CANN's op library (nn_detect_ops.h: Proposal's outputs; fsrdetectionoutput_ops.cpp and
roipooling_ops.cpp: their infer-shape functions; the TBE kernel proposal_d.py: the rois it allocates).

- Proposal (claimed from PVANet's Proposal, caffeq/layers/pva_proposal.py, when the layer sets Ascend's
  `iou_threshold` or `output_actual_rois_num`; PVANet's `nms_thresh` is no field of Ascend's message, whose
  parser skips it, so a layer with both is noted).  Bottoms cls_prob (N, 2A, H, W), bbox_delta (N, 4A, H, W)
  and im_info; A = len(ratio) x len(scale), Ascend's defaults [0.5, 1, 2] and [8, 16, 32] where the file
  gives none.  Defaults pre_nms_topn 3000, post_nms_topn 304, iou_threshold 0.7 (the operator's limit
  (0, 1]).  Tops: rois (N, 5, R) with columns (batch id, x1, y1, x2, y2), R = post_nms_topn rounded up to a
  multiple of 16 (the kernel's buffer; the guide asks for a multiple of 16), and with
  output_actual_rois_num each image's roi count, int32 (N, 8), the count in column 0.
- FSRDetectionOutput (fsrdetectionoutput_param: num_classes, score_threshold, iou_threshold required;
  batch_rois reserved, the batch is the rois'): bottoms rois (N, 5, R), bbox_delta (total_rois,
  num_classes x 4), score (total_rois, num_classes), then optionally im_info and actual_rois_num (N, 8).
  Tops as its infer-shape function sizes them: actual_bbox_num, int32 (N, num_classes, 8) (the operator
  page writes [batch, num_classes]), and box (N, num_classes, min(R, 1024), 8).
Ascend's ROIPooling reads such (N, 5, R) rois and gives R x N pooled maps (caffeq/layers/roi_pooling.py sizes
that layout).  The chip computes these operators in float16 and documents no exact forward (sort order of
equal scores, its box decoding and clipping), so caffeq reads and sizes them but does not run them.
"""
import math

from .registry import LayerError, ReadOnlyLayer, claim_layers, need_blobs, register_layer

ROI_BLOCK, MAX_BOXES = 16, 1024
DEFAULT_RATIOS, DEFAULT_SCALES = (0.5, 1.0, 2.0), (8.0, 16.0, 32.0)
NOT_RUN = ("Huawei Ascend's {what} operator (float16 on the NPU, its own padded output layout): caffeq reads "
           "and sizes it but does not run it")


def _is_ascend_proposal(lp):
    p = lp.proposal_param
    return p.HasField("iou_threshold") or p.HasField("output_actual_rois_num")


@claim_layers("Proposal", _is_ascend_proposal)
class AscendProposal(ReadOnlyLayer):
    """Ascend's Proposal (see the module doc)."""

    def parse(self, lp):
        p = lp.proposal_param
        with_count = bool(p.output_actual_rois_num)
        if len(lp.top) == 2 and not with_count:
            raise LayerError("Huawei Ascend's Proposal: a second top (actual_rois_num) needs "
                             "proposal_param.output_actual_rois_num: true")
        need_blobs(lp, "Proposal (Huawei Ascend)", 3, 2 if with_count else 1, "cls_prob, bbox_delta, im_info")
        pre = int(p.pre_nms_topn) if p.HasField("pre_nms_topn") else 3000
        post = int(p.post_nms_topn) if p.HasField("post_nms_topn") else 304
        if pre < 1 or post < 1:
            raise LayerError(f"proposal_param.pre_nms_topn and post_nms_topn must be >= 1, got {pre} and {post}")
        if not 0 < p.iou_threshold <= 1:
            raise LayerError(f"proposal_param.iou_threshold must be in (0, 1] (the operator's limit), "
                             f"got {p.iou_threshold:g}")
        if p.min_size <= 0 or p.feat_stride <= 0 or p.base_size <= 0:
            raise LayerError("proposal_param.feat_stride, base_size and min_size must be > 0")
        ratios = tuple(p.ratio) or DEFAULT_RATIOS
        scales = tuple(p.scale) or DEFAULT_SCALES
        if any(not v > 0 for v in ratios + scales):
            raise LayerError(f"proposal_param.ratio and scale must be positive, got {list(ratios)} and {list(scales)}")
        notes = []
        if p.HasField("nms_thresh"):
            notes.append(f"proposal_param.nms_thresh is no field of Ascend's ProposalParameter (its parser skips "
                         f"it): iou_threshold {p.iou_threshold:g} applies")
        if post % ROI_BLOCK:
            notes.append(f"post_nms_topn {post} is not a multiple of {ROI_BLOCK}, as Ascend's guide asks: the "
                         f"operator pads the rois to {-(-post // ROI_BLOCK) * ROI_BLOCK}")
        return {"name": lp.name, "anchors": len(ratios) * len(scales), "pre_nms_topn": pre,
                "post_nms_topn": post, "with_count": with_count, "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        prob, deltas, info = (tuple(s) for s in in_shapes)
        if len(prob) != 4 or len(deltas) != 4:
            raise LayerError(f"cls_prob and bbox_delta must be (N, C, H, W), got {list(prob)} and {list(deltas)}")
        a = attrs["anchors"]
        if prob[1] != 2 * a or deltas[1] != 4 * a or prob[0] != deltas[0] or prob[2:] != deltas[2:]:
            raise LayerError(f"cls_prob {list(prob)} and bbox_delta {list(deltas)} must be (N, 2 x {a}, H, W) and "
                             f"(N, 4 x {a}, H, W) for {a} anchors (ratio x scale)")
        if math.prod(info) < 2:
            raise LayerError(f"im_info must hold the image's height and width, got {list(info)}")
        n, rows = prob[0], -(-attrs["post_nms_topn"] // ROI_BLOCK) * ROI_BLOCK
        return [(n, 5, rows), (n, 8)] if attrs["with_count"] else [(n, 5, rows)]

    def why_not_run(self, attrs):
        return NOT_RUN.format(what="Faster R-CNN proposal")


@register_layer("FSRDetectionOutput")
class FSRDetectionOutput(ReadOnlyLayer):
    """Ascend's Faster R-CNN post-processing (see the module doc)."""

    def parse(self, lp):
        need_blobs(lp, "FSRDetectionOutput", (3, 4, 5), 2, "rois, bbox_delta, score[, im_info, actual_rois_num]")
        p = lp.fsrdetectionoutput_param
        for field in ("num_classes", "score_threshold", "iou_threshold"):
            if not p.HasField(field):
                raise LayerError(f"fsrdetectionoutput_param.{field} is required (Ascend's caffe.proto)")
        if p.num_classes < 1:
            raise LayerError(f"fsrdetectionoutput_param.num_classes must be >= 1 (background included), "
                             f"got {p.num_classes}")
        return {"name": lp.name, "num_classes": int(p.num_classes)}

    def infer(self, attrs, in_shapes):
        rois, deltas, score = (tuple(s) for s in in_shapes[:3])
        k = attrs["num_classes"]
        if len(rois) != 3 or rois[1] != 5:
            raise LayerError(f"rois must be Ascend's Proposal output (N, 5, R), got {list(rois)}")
        if len(score) < 2 or math.prod(score[1:]) != k:
            raise LayerError(f"score {list(score)} must be (total_rois, num_classes = {k})")
        if len(deltas) < 2 or deltas[0] != score[0] or math.prod(deltas[1:]) != 4 * k:
            raise LayerError(f"bbox_delta {list(deltas)} must be (total_rois = {score[0]}, 4 x num_classes = {4 * k})")
        if len(in_shapes) == 5 and tuple(in_shapes[4]) != (rois[0], 8):
            raise LayerError(f"actual_rois_num must be ({rois[0]}, 8), got {list(in_shapes[4])}")
        n = rois[0]
        return [(n, k, 8), (n, k, min(rois[2], MAX_BOXES), 8)]

    def why_not_run(self, attrs):
        return NOT_RUN.format(what="Faster R-CNN post-processing")


__all__ = ["AscendProposal", "FSRDetectionOutput"]
