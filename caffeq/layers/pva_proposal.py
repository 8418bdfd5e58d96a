"""PVANet's C++ `Proposal` layer (proposal_param), run natively.

Read from sanghoon/caffe dev_pvanet 6068dd0 (the caffe-fast-rcnn submodule of
sanghoon/pva-faster-rcnn b0dc7d2): src/caffe/layers/proposal_layer.cpp / .cu and
src/caffe/util/nms.cpp / .cu.  It is py-faster-rcnn's proposal computation (rcnn.py's
rpn_proposals, with its `pva` switches) except where noted:
- anchors (LayerSetUp, generate_anchors): in float32, per ratio the sides
  w = (int)(sqrt(base_size^2 / ratio) + 0.5), h = (int)(w * ratio + 0.5), then per scale the box
  centre (base_size - 1) / 2 +- 0.5 * (side * scale - 1); ratios outer, scales inner;
- bottoms rpn_cls_prob_reshape (1, 2A, H, W) (object scores: channels A..2A-1), rpn_bbox_pred
  (1, 4A, H, W), im_info = [img_H, img_W, scale_H, scale_W] (4 values read); one image only
  (CHECK_EQ(bottom[0]->shape(0), 1));
- proposals in (h, w, anchor) order at (w * feat_stride, h * feat_stride), decoded with +1 pixel
  sizes, clipped to [0, img_W - 1] x [0, img_H - 1]; a box whose clipped width is below
  min_size * scale_W or height below min_size * scale_H is not dropped: its score becomes score * 0;
- sort_box: a partial quicksort of all proposals (sort_box.py reproduces its order of equal scores),
  NMS over the first min(count, pre_nms_topn) (+1 pixel IoU, a box goes when IoU > nms_thresh,
  as both nms_cpu and nms_gpu), at most post_nms_topn kept (0: no limit, as nms_cpu's count check);
- tops: rois (R, 5) = [0, x1, y1, x2, y2] and optionally scores (R,) (1-D, unlike the Python layer).
nms_cpu returns IoU 0 at once for boxes apart by any gap while nms_gpu (and caffeq) compute the
+1 pixel overlap: they differ only for boxes less than a pixel apart, whose IoU stays below 0.5.
ONNX's TopK puts equal scores' lower index first, so the exported graph differs from the fork only
where equal scores (the zeroed small boxes) reach the pre-NMS cut.  A net whose maps score another
anchor count than len(ratio) x len(scale), or whose im_info has fewer than 3 values, loads in Caffe
and fails (or reads past im_info) in forward: caffeq reads it and refuses to run or export it.
luoyetx/mini-caffe's Proposal (58a5007, src/layers/proposal_layer.cpp / .cu: the same anchors, decoding,
sort and NMS) reads im_info = [img_H, img_W, scale], min_size * scale for both sides: an im_info of 3
values is read that way.

32l/rfcn_multiclass_split's Proposal (b52c261, caffe/src/caffe/layers/proposal_layer.cpp / .cu,
caffe/src/caffe/util/nms.cu, caffe/src/caffe/proto/caffe.proto: PVANet's proposal_param fields) is told by an
im_info of 2 values, [img_H, img_W], as its deploy files declare it (Input (1, 2)).  Its GPU Forward reads
only those two: boxes clip to [0, img_W - 1] x [0, img_H - 1] and min_box_H = min_box_W = min_size, unscaled
(its CPU Forward still reads scale_H, scale_W at [2], [3], past a 2-value blob, so the GPU path is the one
defined).  Its generate_anchors differs from PVANet's: per ratio the float32 sides w = sqrt(base_size^2 /
ratio), h = w * ratio, unrounded, then per scale the half sides 0.5 * (int)(side * scale / base_size - 1 + 0.5)
(the quotient in double) around (base_size - 1) / 2, so `scale` is a size in pixels.  Decoding, sort_box,
nms_gpu (+1 pixel IoU > nms_thresh) and the tops are PVANet's.  caffeq runs that form as PVANet's with the
fork's anchors and im_info [img_H, img_W, 1, 1]; its loop over a batch is not read (one image, as PVANet's).
"""
import dataclasses
import math

import numpy as np
import torch

from .rcnn import _ProposalBase, generate_anchors
from .registry import LayerError, register_layer


def rfcn_split_anchors(base_size, ratios, scales):
    """32l/rfcn_multiclass_split's generate_anchors (see the module doc): (A, 4), ratios outer, scales inner."""
    f = np.float32
    centre = f(0.5) * (f(base_size) - f(1))
    area = f(base_size * base_size)
    rows = []
    for ratio in ratios:
        w = f(np.sqrt(area / f(ratio)))
        h = f(w * f(ratio))
        for scale in scales:
            hw, hh = (f(0.5) * f(int(float(f(side * f(scale))) / base_size - 1.0 + 0.5)) for side in (w, h))
            rows.append([centre - hw, centre - hh, centre + hw, centre + hh])
    return np.array(rows, f).astype(np.float64).reshape(-1, 4)


def two_value_info(attrs, info_shape):
    """Whether this Proposal runs as 32l/rfcn_multiclass_split's: an im_info of 2 values (PVANet's own
    layer reads 4 and mini-caffe's 3, so no net of theirs runs with 2)."""
    return "info2_anchors" in attrs and math.prod(info_shape) == 2



@register_layer("Proposal")
class PVAProposalLayer(_ProposalBase):
    """PVANet's Proposal (see the module doc)."""

    anchor_fields = ("proposal_param.base_size", "proposal_param.ratio", "proposal_param.scale")

    @staticmethod
    def make_anchors(base_size, ratios, scales):
        return generate_anchors(base_size, ratios, scales, f32=True)   # PVANet's generate_anchors: float32

    def settings(self, lp):
        p = lp.proposal_param
        if p.pre_nms_topn < 1:
            raise LayerError("proposal_param.pre_nms_topn must be >= 1 (0 keeps no proposal)")
        # _ProposalBase.parse checks base_size, ratios and scales and makes the anchors
        return {"feat_stride": int(p.feat_stride), "base_size": int(p.base_size),
                "ratios": [float(v) for v in p.ratio], "scales": [float(v) for v in p.scale],
                "pre_nms_top_n": int(p.pre_nms_topn), "post_nms_top_n": int(p.post_nms_topn),
                "nms_thresh": float(p.nms_thresh), "min_size": int(p.min_size), "pva": True}

    def parse(self, lp):
        attrs = super().parse(lp)
        if "ratios" in attrs:   # ProposalCluster's own anchors have no 2-value form
            attrs["info2_anchors"] = rfcn_split_anchors(attrs["base_size"], attrs["ratios"], attrs["scales"]).tolist()
        return attrs

    def forward(self, attrs, params, cls_prob, bbox_pred, im_info):
        if two_value_info(attrs, im_info.shape):   # 32l/rfcn_multiclass_split: [img_H, img_W], scales 1
            info = torch.cat([im_info.reshape(-1), torch.ones(2, dtype=im_info.dtype, device=im_info.device)])
            return super().forward({**attrs, "anchors": attrs["info2_anchors"]}, params, cls_prob, bbox_pred, info)
        return super().forward(attrs, params, cls_prob, bbox_pred, im_info)

    def onnx(self, ctx, node):
        if two_value_info(node.attrs, ctx.shape(node.inputs[2])):
            flat = ctx.op("Reshape", [node.inputs[2], ctx.i64([-1])], "info2")
            info = ctx.op("Concat", [flat, ctx.f32([1.0, 1.0])], "info4", axis=0)
            node = dataclasses.replace(node, attrs={**node.attrs, "anchors": node.attrs["info2_anchors"]},
                                       inputs=[*node.inputs[:2], info])
            ctx = ctx.with_shapes({info: (4,)})
        return super().onnx(ctx, node)

    def pytorch_source(self, node, emit):
        if two_value_info(node.attrs, emit.in_shape(2)):
            info = emit.tmp("im_info4")
            emit.stmt(f"{info} = torch.cat([{emit.inputs[2]}.reshape(-1), {emit.inputs[2]}.new_ones(2)])")
            emit.inputs = [*emit.inputs[:2], info]
            node = dataclasses.replace(node, attrs={**node.attrs, "anchors": node.attrs["info2_anchors"]})
        return super().pytorch_source(node, emit)

    @staticmethod
    def cannot_run(attrs, in_shapes):
        prob, deltas, info = (tuple(s) for s in in_shapes)
        a = len(attrs["anchors"])
        if prob[1] != 2 * a or deltas[1] != 4 * a:
            return (f"the net scores {prob[1] // 2} anchors per position and regresses {deltas[1] // 4}, but "
                    f"proposal_param makes {a} ({len(attrs['ratios'])} ratio(s) x {len(attrs['scales'])} "
                    f"scale(s)): PVANet's layer would read past its bottoms")
        if math.prod(info) < 3 and not two_value_info(attrs, info):
            return (f"im_info must hold [height, width, scale_h, scale_w] (PVANet's layer reads 4 values; "
                    f"mini-caffe's [height, width, scale]; 32l/rfcn_multiclass_split's [height, width]), got shape "
                    f"{list(info)}")
        return None
