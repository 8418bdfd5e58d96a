"""makefile/frcnn's FrcnnProposal: Faster R-CNN region proposals as a C++ layer.

makefile/frcnn (8d9b9eb) src/caffe/FRCNN/frcnn_proposal_layer.cpp computes, at TEST, what
py-faster-rcnn's Python ProposalLayer computes (rcnn.py's rpn_proposals, which this spec reuses):
scores from the second half of rpn_cls_prob_reshape's channels, deltas decoded against the anchors
shifted by feat_stride (+1 pixel sizes), boxes clipped to [0, width-1] x [0, height-1], boxes below
min_size * im_info[2] dropped, sorted by score (pair<score, index> with std::greater: ties put the
higher index first), pre-NMS cut, greedy NMS dropping IoU > threshold (+1 pixel sizes), post-NMS cut.
Bottoms: rpn_cls_prob_reshape (1, 2A, H, W), rpn_bbox_pred (1, 4A, H, W), im_info; one image only.
Tops are 4-D: rois (R, 5, 1, 1) = [0, x1, y1, x2, y2] and, optionally, scores (R, 1, 1, 1).

Its settings do not come from the prototxt: FrcnnParam::load_param reads a JSON file named on the
command line (--default_c).  Only `proposal_param.feat_stride` (the fork's field 252, read here by
its name through caffeq's ProposalParameter) can override the config's stride when it is not 0.
The values below are those of the config the fork's own test and demo scripts pass,
examples/FRCNN/config/voc_config.json.  Its anchor list is py-faster-rcnn's generate_anchors()
table except two entries that differ in the file ([-360, -184, 375, 100] where the generator gives
199, and [-56, -56, 71, 72] where it gives 71); they are kept as written, since they are what the
fork computes with.  test_rpn_score_thresh is absent from that file and defaults to 0
(frcnn_param.cpp:185), so it drops no softmax score; test_soft_nms defaults to 0 (plain NMS).

`RPN` (zhanglaplace/faster-rcnn-cplusplus2 5b6701d, rpn_layer.cpp; rpn_param as its README declares,
number 158 there) is another C++ port, with its settings in the prototxt: feat_stride, basesize,
scale, ratio, boxminsize, per_nms_topn, post_nms_topn and nms_thresh (none has a default; a topn
of 0 keeps every box).  It differs from py-faster-rcnn (rcnn.py's cpp_rpn switches):
- anchors as generate_anchors with C's round (half away from zero), then truncated to int;
- a box goes when its unclipped predicted width or height (exp(d) * anchor size) is below
  boxminsize * im_info[2]; the rest are clipped to [0, int(width)] x [0, int(height)] (not - 1);
- NMS drops a box whose IoU with a kept one is >= nms_thresh (+1 pixel sizes);
- it reads image 0 of any batch (im_info's first row), and its tops are 4-D.
Boxes are sorted by score with std::sort, whose order of equal scores is unspecified; caffeq puts
the higher index first, as for py-faster-rcnn.  The fork computes x1 = ctr - 0.5 * w in double
before storing a float; caffeq stays in float32, which rounds the same except for boxes whose
centre and size differ by over 2^29 (none an image has).

D-X-Y/caffe-faster-rcnn (c9ca246, the same FRCNN code) train nets add three layers that read the same
JSON config; caffeq sizes them with voc_config.json's values (see the section at the end):
FrcnnRoiData (a graph input), FrcnnAnchorTarget and FrcnnProposalTarget (training targets, read and
sized with their setup shapes, never run).
"""
import dataclasses

import numpy as np

from ..errors import ExportError
from .data import DataLayer
from .rcnn import _ProposalBase, generate_anchors
from .registry import LayerError, ReadOnlyLayer, need_blobs, register_layer

# examples/FRCNN/config/voc_config.json at makefile/frcnn 8d9b9eb (the TEST keys the layer reads)
FRCNN_VOC_CONFIG = {
    "feat_stride": 16,
    "pre_nms_top_n": 6000,    # test_rpn_pre_nms_top_n
    "post_nms_top_n": 300,    # test_rpn_post_nms_top_n
    "nms_thresh": 0.7,        # test_rpn_nms_thresh
    "min_size": 16,           # test_rpn_min_size
    "anchors": [[-84, -40, 99, 55], [-176, -88, 191, 103], [-360, -184, 375, 100],
                [-56, -56, 71, 72], [-120, -120, 135, 135], [-248, -248, 263, 263],
                [-36, -80, 51, 95], [-80, -168, 95, 183], [-168, -344, 183, 359]],
}


def _as_4d(shape):
    return tuple(shape) + (1,) * (4 - len(shape))


class _FourDProposal(_ProposalBase):
    """py-faster-rcnn's proposals with 4-D tops: rois (R, 5, 1, 1) and scores (R, 1, 1, 1)."""

    def infer(self, attrs, in_shapes):
        return [_as_4d(s) for s in super().infer(attrs, in_shapes)]

    def forward(self, attrs, params, cls_prob, bbox_pred, im_info):
        out = super().forward(attrs, params, cls_prob, bbox_pred, im_info)
        if attrs["with_scores"]:
            return out[0][:, :, None, None], out[1][:, :, None, None]
        return out[:, :, None, None]

    def onnx(self, ctx, node):
        from .rcnn import emit_proposals
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError, node.type)
        flat = [ctx.tmp(f"{node.name}_{k}") for k in range(len(node.outputs))]
        emit_proposals(ctx, dataclasses.replace(node, outputs=flat))
        for two_d, four_d in zip(flat, node.outputs):
            ctx.add_node("Unsqueeze", [two_d, ctx.const(np.array([2, 3], np.int64))], [four_d])

    def pytorch_source(self, node, emit):
        calls = super().pytorch_source(node, emit)
        if isinstance(calls, list):
            return [f"{c}[:, :, None, None]" for c in calls]
        return f"{calls}[:, :, None, None]"


@register_layer("FrcnnProposal")
class FrcnnProposalLayer(_FourDProposal):
    """makefile/frcnn's FrcnnProposal at TEST, with voc_config.json's settings (see the module doc)."""

    def settings(self, lp):
        config = dict(FRCNN_VOC_CONFIG)
        p = lp.proposal_param
        if p.HasField("feat_stride") and p.feat_stride != 0:   # 0: the fork's "take the config's"
            config["feat_stride"] = int(p.feat_stride)
        for field in ("base_size", "min_size", "ratio", "scale", "pre_nms_topn", "post_nms_topn", "nms_thresh"):
            if field in p.DESCRIPTOR.fields_by_name and (len(getattr(p, field)) if field in ("ratio", "scale")
                                                         else p.HasField(field)):
                raise LayerError(f"proposal_param.{field}: makefile/frcnn's FrcnnProposal has only feat_stride "
                                 f"(the rest comes from its JSON config)")
        config["anchors"] = [[float(v) for v in row] for row in config["anchors"]]
        return config


@register_layer("RPN")
class CppRPNLayer(_FourDProposal):
    """zhanglaplace/faster-rcnn-cplusplus2's RPN layer (see the module doc)."""

    anchor_fields = ("rpn_param.basesize", "rpn_param.ratio", "rpn_param.scale")

    @staticmethod
    def make_anchors(base_size, ratios, scales):
        # the layer stores its anchors in an int array: C's round on the sides, then truncation
        return np.trunc(generate_anchors(base_size, ratios, scales, c_round=True))

    def settings(self, lp):
        p = lp.rpn_param
        # _ProposalBase.parse checks basesize, ratio and scale and makes the anchors
        return {"feat_stride": int(p.feat_stride), "base_size": int(p.basesize), "ratios": [float(v) for v in p.ratio],
                "scales": [float(v) for v in p.scale], "pre_nms_top_n": int(p.per_nms_topn),
                "post_nms_top_n": int(p.post_nms_topn), "nms_thresh": float(p.nms_thresh),
                "min_size": int(p.boxminsize), "cpp_rpn": True}


# ---- the fork's train-net layers (D-X-Y/caffe-faster-rcnn c9ca246, = makefile/frcnn) ---------------
#
# FrcnnRoiData reads window_data_param.config (FrcnnParam::load_param) before anything else; the
# two target layers read FrcnnParam's anchors and n_classes from it.  caffeq does not read the JSON
# file: it sizes the tops with the values of the config the fork's train scripts name,
# examples/FRCNN/config/voc_config.json (scales 600, max_size 1000, 9 anchors, n_classes 21), and
# says so in a note when a net names another config.

FRCNN_VOC_CONFIG_PATH = "examples/FRCNN/config/voc_config.json"
FRCNN_VOC_TRAIN_SIZES = {"max_short": 600, "max_long": 1000, "n_classes": 21}


def _config_note(config, what):
    if config.replace("\\", "/").endswith("voc_config.json"):
        return []
    return [f"{what} are those of the fork's {FRCNN_VOC_CONFIG_PATH} (caffeq does not read the JSON "
            f"config {config!r} that the net names)"]


@register_layer("FrcnnRoiData")
class FrcnnRoiData(DataLayer):
    """The fork's training data (frcnn_roi_data_layer.cpp): one image a batch.  Its setup shapes data
    (1, 3, max(scales), max_size), im_info (1, 3, 1, 1) = [height, width, scale] and gt_boxes
    (1, 5, 1, 1), rows [x1, y1, x2, y2, label] (one per box of the image in forward)."""

    def parse(self, lp):
        need_blobs(lp, "FrcnnRoiData (tops data, im_info, gt_boxes)", 0, 3)
        p = lp.window_data_param
        if not p.source:
            raise LayerError("window_data_param.source is required (the fork's roi list)")
        config = p.config if "config" in p.DESCRIPTOR.fields_by_name else ""
        return {"source": p.source, "config": config, "tops": list(lp.top), "num_tops": 3,
                "reading_notes": _config_note(config, "the data size (600 x 1000) and anchors")}

    def top_shapes(self, attrs, given):
        s = FRCNN_VOC_TRAIN_SIZES
        shapes = [(1, 3, s["max_short"], s["max_long"]), (1, 3, 1, 1), (1, 5, 1, 1)]
        return [tuple(given.get(i) or shape) for i, shape in enumerate(shapes)]

    def preprocessing(self, attrs):
        return ["the fork's FrcnnRoiData: the image scaled so that its shorter side is 600 and its longer at "
                "most 1000, pixel means [102.9801, 115.9465, 122.7717] subtracted (BGR), random flips at TRAIN; "
                "im_info = [height, width, scale], gt_boxes rows [x1, y1, x2, y2, label]"]


@register_layer("FrcnnAnchorTarget")
class FrcnnAnchorTarget(ReadOnlyLayer):
    """RPN training targets (frcnn_anchor_target_layer.cpp): labels (1, 1, A * H, W) and bbox targets,
    inside and outside weights (1, 4A, H, W) for the A config anchors at each of rpn_cls_score's H x W
    positions.  Bottoms: rpn_cls_score, gt_boxes, im_info."""

    makes_training_targets = True

    def parse(self, lp):
        need_blobs(lp, "FrcnnAnchorTarget", 3, 4, "rpn_cls_score, gt_boxes, im_info")
        return {"name": lp.name, "anchors": len(FRCNN_VOC_CONFIG["anchors"])}

    def infer(self, attrs, in_shapes):
        score = in_shapes[0]
        if len(score) != 4:
            raise LayerError(f"FrcnnAnchorTarget reads rpn_cls_score's height and width: it must be 4-D "
                             f"(N, C, H, W), got {tuple(score)}")
        a, (h, w) = attrs["anchors"], score[2:]
        return [(1, 1, a * h, w)] + [(1, 4 * a, h, w)] * 3

    def why_not_run(self, attrs):
        return ("it labels anchors against the ground-truth boxes for RPN training and does not run for "
                "inference; use the net's test prototxt")


@register_layer("FrcnnProposalTarget")
class FrcnnProposalTarget(ReadOnlyLayer):
    """Fast R-CNN training rois (frcnn_proposal_target_layer.cpp): samples the proposals and ground-truth
    boxes into rois (R, 5, 1, 1), labels (R, 1, 1, 1) and bbox targets and weights (R, 4 * n_classes, 1, 1);
    R is known only in forward, so the shapes are its setup's (R = 1).  Bottoms: rpn_rois, gt_boxes."""

    data_dependent_shape = True
    makes_training_targets = True

    def parse(self, lp):
        need_blobs(lp, "FrcnnProposalTarget", 2, 5, "rpn_rois, gt_boxes")
        return {"name": lp.name, "num_classes": FRCNN_VOC_TRAIN_SIZES["n_classes"]}

    def infer(self, attrs, in_shapes):
        targets = (1, 4 * attrs["num_classes"], 1, 1)
        return [(1, 5, 1, 1), (1, 1, 1, 1), targets, targets, targets]

    def why_not_run(self, attrs):
        return ("it samples training rois against the ground-truth boxes and does not run for inference; use "
                "the net's test prototxt, where the proposals feed the ROI pooling")
