"""CTPN's text proposals: tianzhi0549/CTPN's `layers.text_proposal_layer.ProposalLayer`, natively.

caffeq never imports the module a `Python` layer names (see registry.py); this spec computes what
CTPN's module computes at test time (src/layers/text_proposal_layer.py, src/anchor.py, src/other.py):

- param_str: a YAML mapping with 'feat_stride' (required; the only key the layer reads).
- Bottoms: rpn_cls_prob_reshape (1, 2A, H, W) (the second A channels are the text scores),
  rpn_bbox_pred (1, 2A, H, W) (per anchor: the vertical centre offset dy, then the log height dh),
  im_info whose first row starts [height, width].  One image per batch, as the layer asserts.
- Anchors (AnchorText): A = 10, 16 pixels wide, heights 11, 16, 23, 33, 48, 68, 97, 139, 198, 283,
  centred on the 16 x 16 window (0, 0, 15, 15) and stored in an int32 array.  CTPN runs on Python 2
  (its README), where `h/2` of two ints floors, and the int32 array truncates toward zero: an
  anchor of height h spans y from trunc(7.5 - h // 2) to trunc(7.5 + h // 2), x from 0 to 15
  (odd heights lose a pixel: 11 spans 2..12).  Each cell (y, x) of the H x W map shifts them by
  (x, y) * feat_stride; rows are ordered (y, x, anchor).
- Decoding moves only the vertical coordinates: with the anchor's centre c = (y1 + y2) / 2 and
  height h = y2 - y1 + 1, the box's height is exp(dh) * h and its top dy * h + c - height / 2
  (float32 exp, float64 products and sums, rounded to float32 where the module stores them); the
  bottom is top + height (no -1), x1 and x2 are the anchor's.
- Boxes are clipped to [0, width - 1] x [0, height - 1].  No score threshold, sorting or NMS: those
  run outside the net (TextDetector), so both tops have one row per anchor.
- The same module vendored as a `CTPN` package (tocigm/CMT-Text-Detection's
  CTPN/layers/text_proposal_layer.py: CTPN's file with its imports changed to CTPN.other and
  CTPN.anchor) is the same spec, registered under that module path too.
- Tops: rois (H * W * A, 4) = [x1, y1, x2, y2] (no batch index column) and scores (H * W * A, 1).
  The module's setup shapes them (1, 4) and (1, 1, 1, 1) until the first forward; the shapes here
  are those every forward writes, which follow from the bottoms' shapes alone.

ONNX: the shifted anchors, their centres and heights are constants of the static H, W; the rest is
Slice, Transpose, Reshape, Gather, Exp, Cast (float64 where the module computes in float64), Min,
Max and Concat.
"""
import math

import numpy as np
import torch
from torch import nn

from ..errors import CaffeqError
from .param_str import param_str_positive_int, parse_param_str
from .rcnn import TORCH_ANCHORS, shifted_anchors
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources

# src/anchor.py, AnchorText.basic_anchors
ANCHOR_HEIGHTS = (11, 16, 23, 33, 48, 68, 97, 139, 198, 283)
ANCHOR_WIDTH = 16
BASE_SIZE = 16


def text_anchors(heights=ANCHOR_HEIGHTS, width=ANCHOR_WIDTH, base_size=BASE_SIZE):
    """AnchorText's basic anchors: (A, 4) ints [x1, y1, x2, y2], one per height, around the centre of
    the (0, 0, base-1, base-1) window; half sides floored (Python 2's int division), then truncated
    toward zero (stored in an int32 array)."""
    centre = (base_size - 1) * 0.5
    return [[math.trunc(centre - width // 2), math.trunc(centre - h // 2),
             math.trunc(centre + width // 2), math.trunc(centre + h // 2)] for h in heights]


# ---- the computation (also copied into model.py) ------------------------------------------------

def text_proposals(cls_prob, bbox_pred, im_info, anchors, feat_stride: int):
    """CTPN's ProposalLayer.forward for one image: cls_prob (1, 2A, H, W), bbox_pred (1, 2A, H, W),
    im_info (first row [height, width, ...]), anchors (A, 4).  Returns rois (H * W * A, 4) =
    [x1, y1, x2, y2] clipped to the image, and scores (H * W * A, 1), rows ordered (h, w, a)."""
    n_anchors = anchors.shape[0]
    height, width = cls_prob.shape[2], cls_prob.shape[3]
    dt, dev = bbox_pred.dtype, bbox_pred.device
    scores = cls_prob[0, n_anchors:].permute(1, 2, 0).reshape(-1, 1)
    deltas = bbox_pred[0].permute(1, 2, 0).reshape(-1, 2)
    boxes = shifted_anchors(anchors, height, width, feat_stride).to(dev)   # float64, whole pixels
    centre_y = (boxes[:, 1] + boxes[:, 3]) / 2.0
    anchor_h = boxes[:, 3] - boxes[:, 1] + 1.0
    # exp in the deltas' precision; products and sums in float64, stored at the deltas' precision
    box_h = (torch.exp(deltas[:, 1]).to(torch.float64) * anchor_h).to(dt)
    top = (deltas[:, 0].to(torch.float64) * anchor_h + centre_y - box_h.to(torch.float64) / 2.0).to(dt)
    bottom = top + box_h
    info = im_info.reshape(im_info.shape[0], -1)[0].to(dt)
    zero = torch.zeros((), dtype=dt, device=dev)
    x_max, y_max = info[1] - 1, info[0] - 1
    x1 = torch.maximum(torch.minimum(boxes[:, 0].to(dt), x_max), zero)
    y1 = torch.maximum(torch.minimum(top, y_max), zero)
    x2 = torch.maximum(torch.minimum(boxes[:, 2].to(dt), x_max), zero)
    y2 = torch.maximum(torch.minimum(bottom, y_max), zero)
    return torch.stack([x1, y1, x2, y2], dim=1), scores


class TextProposal(nn.Module):
    """CTPN's text proposal layer (text_proposals) with its anchors: returns (rois, scores)."""

    def __init__(self, anchors, feat_stride):
        super().__init__()
        self.anchors, self.feat_stride = anchors, feat_stride

    def forward(self, cls_prob, bbox_pred, im_info):
        if cls_prob.shape[0] != 1:
            raise ValueError(f"CTPN's text proposals take one image per batch, got {cls_prob.shape[0]}")
        anchors = torch.tensor(self.anchors, dtype=torch.float64)
        return text_proposals(cls_prob, bbox_pred, im_info, anchors, self.feat_stride)


# model.py gets these very functions, so the export runs the same code as forward
TORCH_TEXT_PROPOSAL = torch_sources(text_proposals, TextProposal)


# ---- the spec ---------------------------------------------------------------------------------

@register_layer("Python:layers.text_proposal_layer.ProposalLayer",
                "Python:CTPN.layers.text_proposal_layer.ProposalLayer")
class CTPNProposalLayer(Layer):
    """tianzhi0549/CTPN's layers.text_proposal_layer.ProposalLayer, natively; also under the module path
    CTPN.layers.text_proposal_layer of projects that vendor CTPN's src/ as a CTPN package
    (tocigm/CMT-Text-Detection: the same file, only its imports say CTPN.other and CTPN.anchor)."""

    def parse(self, lp):
        need_blobs(lp, "CTPN's text proposals", 3, roles="rpn_cls_prob_reshape, rpn_bbox_pred, im_info")
        if len(lp.top) != 2:   # its setup shapes top[0] and top[1]
            raise LayerError(f"CTPN's text proposals give 2 tops (rois, scores), got {len(lp.top)}")
        p = parse_param_str(lp.python_param.param_str)
        unknown = sorted(set(p) - {"feat_stride"})
        if unknown:
            raise LayerError(f"python_param.param_str: CTPN's ProposalLayer reads only 'feat_stride', got {unknown}")
        if "feat_stride" not in p:
            raise LayerError("python_param.param_str: 'feat_stride' is required (e.g. \"'feat_stride': 16\")")
        return {"feat_stride": param_str_positive_int(p, "feat_stride"), "anchors": text_anchors()}

    def infer(self, attrs, in_shapes):
        prob, deltas, info = (tuple(s) for s in in_shapes)
        a = len(attrs["anchors"])
        if len(prob) != 4 or prob[1] != 2 * a:
            raise LayerError(f"rpn_cls_prob_reshape must be (1, {2 * a}, H, W) for CTPN's {a} anchors, "
                             f"got {list(prob)}")
        if deltas != (prob[0], 2 * a, prob[2], prob[3]):
            raise LayerError(f"rpn_bbox_pred must be ({prob[0]}, {2 * a}, {prob[2]}, {prob[3]}) (dy, dh per "
                             f"anchor), got {list(deltas)}")
        if len(info) < 2 or info[0] < 1 or math.prod(info[1:]) < 2:
            raise LayerError(f"im_info's first row must hold [height, width], got shape {list(info)}")
        if prob[0] != 1:
            raise LayerError(f"CTPN's text proposals take one image per batch (as its layer asserts), got {prob[0]}")
        rows = prob[2] * prob[3] * a
        return [(rows, 4), (rows, 1)]

    def forward(self, attrs, params, cls_prob, bbox_pred, im_info):
        if cls_prob.shape[0] != 1:
            raise CaffeqError(f"CTPN's text proposals take one image per batch (as its layer asserts), "
                              f"got {cls_prob.shape[0]}")
        anchors = torch.tensor(attrs["anchors"], dtype=torch.float64)
        return text_proposals(cls_prob, bbox_pred, im_info, anchors, attrs["feat_stride"])

    def onnx(self, ctx, node):
        emit_text_proposals(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(TORCH_ANCHORS)
        helper = emit.helper(TORCH_TEXT_PROPOSAL)
        m = emit.module(f"{helper}({emit.lit(a['anchors'])}, {a['feat_stride']})")
        t = emit.tmp("text_proposals")
        emit.stmt(f"{t} = {m}({', '.join(emit.inputs)})")
        return [f"{t}[0]", f"{t}[1]"]


# ---- text proposals as ONNX ops ------------------------------------------------------------------

def emit_text_proposals(ctx, node):
    """text_proposals from standard ops, for the static H, W of the export."""
    from onnx import TensorProto

    a = node.attrs
    prob_in, deltas_in, info_in = node.inputs
    _, _, height, width = ctx.shape(prob_in)
    n_anchors = len(a["anchors"])
    name = node.name
    f64 = lambda v: ctx.const(np.array(v, np.float64))

    def cast(x, to, hint):
        return ctx.op("Cast", [x], hint, to=to)

    boxes = shifted_anchors(torch.tensor(a["anchors"], dtype=torch.float64), height, width,
                            a["feat_stride"]).numpy()
    centre_y = (boxes[:, 1] + boxes[:, 3]) / 2.0
    anchor_h = boxes[:, 3] - boxes[:, 1] + 1.0

    scores = ctx.op("Slice", [prob_in, ctx.i64([n_anchors]), ctx.i64([2 * n_anchors]), ctx.i64([1])], "text")
    scores = ctx.op("Transpose", [scores], "text_t", perm=[0, 2, 3, 1])
    ctx.add_node("Reshape", [scores, ctx.i64([-1, 1])], [node.outputs[1]])
    deltas = ctx.op("Reshape", [ctx.op("Transpose", [deltas_in], "d_t", perm=[0, 2, 3, 1]), ctx.i64([-1, 2])], "deltas")
    dy = ctx.op("Gather", [deltas, ctx.i64(0)], "dy", axis=1)
    dh = ctx.op("Gather", [deltas, ctx.i64(1)], "dh", axis=1)
    box_h = cast(ctx.op("Mul", [cast(ctx.op("Exp", [dh], "exp_dh"), TensorProto.DOUBLE, "exp_dh64"), f64(anchor_h)],
                        "box_h64"), TensorProto.FLOAT, "box_h")
    top = ctx.op("Add", [ctx.op("Mul", [cast(dy, TensorProto.DOUBLE, "dy64"), f64(anchor_h)], "dy_h"), f64(centre_y)],
                 "centre64")
    top = ctx.op("Sub", [top, ctx.op("Div", [cast(box_h, TensorProto.DOUBLE, "box_h_64"), f64(2.0)], "half_h")],
                 "top64")
    top = cast(top, TensorProto.FLOAT, "top")
    bottom = ctx.op("Add", [top, box_h], "bottom")
    info = ctx.op("Gather", [ctx.op("Reshape", [info_in, ctx.i64([0, -1])], "info2"), ctx.i64(0)], "info", axis=0)
    x_max = ctx.op("Sub", [ctx.op("Gather", [info, ctx.i64(1)], "im_w", axis=0), ctx.f32(1.0)], "x_max")
    y_max = ctx.op("Sub", [ctx.op("Gather", [info, ctx.i64(0)], "im_h", axis=0), ctx.f32(1.0)], "y_max")
    zero = ctx.f32(0.0)

    def clip(v, limit, hint):
        return ctx.op("Max", [ctx.op("Min", [v, limit], hint + "_min"), zero], hint)

    corners = [clip(ctx.f32(boxes[:, 0]), x_max, "x1"), clip(top, y_max, "y1"),
               clip(ctx.f32(boxes[:, 2]), x_max, "x2"), clip(bottom, y_max, "y2")]
    columns = [ctx.op("Reshape", [c, ctx.i64([-1, 1])], f"col{k}") for k, c in enumerate(corners)]
    ctx.add_node("Concat", columns, [node.outputs[0]], name=name, axis=1)
