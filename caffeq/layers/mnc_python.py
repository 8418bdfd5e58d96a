"""MNC's Python layers (daijifeng001/MNC e6be483 lib/pylayer/*.py), natively, under both module names:
'pylayer.X' (MNC) and 'multitask_network_cascades.pylayer.X' (delftrobotics-forks/MNC, which moved the
package; its layers compute the same at TEST).  caffeq never imports them (registry.spec_for).  The C++
layers these nets use (ROIWarping, MaskPooling, MaskResize) are in mnc.py.

The Python layers read `self.phase`; caffeq builds a net in one phase and tells the forms apart by their
bottoms and tops, as the nets write them.  cfg values are lib/mnc_config.py's (every MNC config file
keeps MASK_SIZE 21 and the TEST values).

At TEST (run natively, torch, ONNX and model.py):
- ProposalLayer (bottoms rpn_cls_prob_reshape, rpn_bbox_pred, im_info; top rois): py-faster-rcnn's
  proposals (rcnn.py's rpn_proposals, the same code), with cfg.TEST's RPN_PRE_NMS_TOP_N 6000,
  RPN_POST_NMS_TOP_N 300, RPN_NMS_THRESH 0.7 and RPN_MIN_SIZE 16, generate_anchors()'s 9 anchors and the
  GPU NMS (IoU > thresh goes).  param_str: 'feat_stride' (required); 'use_clip' and 'clip_base' only clip
  gradients; MNC's own test nets also pass 'gradient_scale', which no code reads.  The fork reads
  'anchor_ratios' and 'anchor_scales' too, and from 2017-03-30 (c0b73fa) writes the proposals' scores to a
  second top (rpn_scores, (R, 1)) in every phase.
- StageBridgeLayer (bottoms rois (R, 5), bbox_pred (R, 4K), seg_cls_prob (R, K), im_info; top (R, 5)):
  each roi moved by the deltas of its best seg_cls_prob class (numpy's argmax: the first on ties)
  with bbox_transform_inv (sizes + 1, float32), clipped to [0, width - 1] x [0, height - 1] of
  im_info's first row; column 0 is 0.  The module fails on bottoms that are not 2-D arrays of R rows
  (or too few deltas for the classes): such a net reads and refuses to run.
- MaskLayer (bottom mask_output (R, 441); top (R, 1, 21, 21)): the rows reshaped to MASK_SIZE squares.

At TRAIN (read and sized with the shapes their setup gives, never run: they sample against the ground
truth, or feed what does):
- MNCDataLayer: a graph input, data (1, 3, 600, 1000), im_info (1, 3), gt_boxes (1, 4), and with masks
  gt_masks (1, 21, 21), mask_info (1, 3).
- ProposalLayer with proposal_index (MNC: 2 tops; the fork: rois, rpn_scores, proposal_index, or before
  2017-03-30 two tops, the second named as an index): (1, 5) and (1, 1) each.
- ProposalTargetLayer: rois (1, 5), labels (1, 1), bbox targets and weights (1, 4 * num_classes), with
  masks mask_targets and mask_weight (1, 1, 21, 21) and gt_masks_info (1, 4), with MIX_INDEX fg_inds
  and bg_inds (1, 4): 5, 8 or 10 tops.
- AnchorTargetLayer: labels (1, 1, 9H, W), bbox targets and weights (1, 36, H, W).
- StageBridgeLayer with 7 bottoms and 8 tops, MaskLayer with 3 bottoms and 2 tops.
"""
import math

import numpy as np
import torch

from ..errors import ExportError
from .affordance import _OnnxGraph
from .data import DataLayer
from .param_str import param_str_positive_int, parse_param_str
from .rcnn import TEST_CONFIG, _numbers, _ProposalBase, _scalar_tensor
from .registry import Layer, LayerError, ReadOnlyLayer, need_blobs, register_layer, torch_sources

MODULES = ("pylayer", "multitask_network_cascades.pylayer")
FORK_PREFIX = "multitask_network_cascades."
MASK_SIZE = 21                       # cfg.MASK_SIZE
TRAIN_DATA = (1, 3, 600, 1000)       # cfg.TRAIN.IMS_PER_BATCH, 3, max(cfg.TRAIN.SCALES), cfg.TRAIN.MAX_SIZE
MNC_ANCHORS = 9                      # generate_anchors(): 3 ratios x 3 scales


def _keys(module_class):
    return tuple(f"Python:{m}.{module_class}" for m in MODULES)


def _is_fork(lp):
    return lp.python_param.module.startswith(FORK_PREFIX)


def _kind(lp):
    return f"{lp.python_param.module}.{lp.python_param.layer}"


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def mnc_stage_bridge(rois, deltas, scores, im_info):
    """MNC's StageBridgeLayer at TEST -> (R, 5) = [0, x1, y1, x2, y2]: each roi moved by the deltas of its
    best-scored class (the first on ties), clipped to the image of im_info's first row."""
    r = rois.shape[0]
    best = scores.argmax(dim=1)
    d = deltas.reshape(r, deltas.shape[1] // 4, 4)[torch.arange(r, device=deltas.device), best]   # (R, 4)
    boxes = rois[:, 1:5].to(deltas.dtype)
    widths = boxes[:, 2] - boxes[:, 0] + 1.0
    heights = boxes[:, 3] - boxes[:, 1] + 1.0
    ctr_x = boxes[:, 0] + 0.5 * widths
    ctr_y = boxes[:, 1] + 0.5 * heights
    cx, cy = d[:, 0] * widths + ctr_x, d[:, 1] * heights + ctr_y
    w, h = torch.exp(d[:, 2]) * widths, torch.exp(d[:, 3]) * heights
    info = im_info[0].to(deltas.dtype)
    zero = torch.zeros((), dtype=deltas.dtype, device=deltas.device)
    x_max, y_max = info[1] - 1, info[0] - 1
    corners = [torch.maximum(torch.minimum(cx - 0.5 * w, x_max), zero),
               torch.maximum(torch.minimum(cy - 0.5 * h, y_max), zero),
               torch.maximum(torch.minimum(cx + 0.5 * w, x_max), zero),
               torch.maximum(torch.minimum(cy + 0.5 * h, y_max), zero)]
    return torch.stack([torch.zeros_like(corners[0])] + corners, dim=1)


TORCH_STAGE_BRIDGE = torch_sources(mnc_stage_bridge)


# ---- ProposalLayer --------------------------------------------------------------------------

PROPOSAL_KEYS = ("feat_stride", "use_clip", "clip_base", "gradient_scale")
FORK_ANCHOR_KEYS = ("anchor_ratios", "anchor_scales")


@register_layer(*_keys("proposal_layer.ProposalLayer"))
class MNCProposalLayer(_ProposalBase):
    anchor_fields = ("the base size (16)", "python_param.param_str 'anchor_ratios'",
                     "python_param.param_str 'anchor_scales'")

    @staticmethod
    def train_tops(lp):
        """The names of the TRAIN form's tops, or None for the TEST form."""
        tops = len(lp.top)
        if _is_fork(lp):
            if tops == 3:
                return ["rois", "rpn_scores", "proposal_index"]
            if tops == 2 and "index" in lp.top[1].lower():   # before c0b73fa: TRAIN's proposal_index
                return ["rois", "proposal_index"]
            return None
        if tops == 3:
            raise LayerError("MNC's ProposalLayer gives rois, and proposal_index at TRAIN: 1 or 2 tops, got 3")
        return ["rois", "proposal_index"] if tops == 2 else None

    def parse(self, lp):
        need_blobs(lp, "MNC's ProposalLayer", 3, (1, 2, 3), "rpn_cls_prob_reshape, rpn_bbox_pred, im_info")
        train = self.train_tops(lp)
        if train:
            self.settings(lp)   # the keys its setup reads
            return {"name": lp.name, "train_form": train}
        return super().parse(lp)

    def settings(self, lp):
        fork = _is_fork(lp)
        p = parse_param_str(lp.python_param.param_str)
        known = PROPOSAL_KEYS + (FORK_ANCHOR_KEYS if fork else ())
        if "feat_stride" not in p:
            raise LayerError("python_param.param_str: 'feat_stride' is required (e.g. \"'feat_stride': 16\")")
        stride = p["feat_stride"]
        if not isinstance(stride, int) or isinstance(stride, bool):
            raise LayerError(f"python_param.param_str: 'feat_stride' must be an integer, got {stride!r}")
        ratios, scales = [0.5, 1.0, 2.0], [8.0, 16.0, 32.0]
        if fork:
            ratios, scales = _numbers(p, "anchor_ratios", ratios), _numbers(p, "anchor_scales", scales)
        return {"feat_stride": stride, "base_size": 16, "ratios": ratios, "scales": scales, **TEST_CONFIG,
                "fork": fork, "known_keys": list(known), "foreign_keys": sorted(set(p) - set(known))}

    def infer(self, attrs, in_shapes):
        if attrs.get("train_form"):
            return [(1, 5)] + [(1, 1)] * (len(attrs["train_form"]) - 1)
        return super().infer(attrs, in_shapes)

    def cannot_run(self, attrs, in_shapes):
        if attrs.get("train_form"):
            return (f"this is its TRAIN form (tops {', '.join(attrs['train_form'])}): proposal_index marks the "
                    f"kept proposals for MNC's anchor-target layer, which trains the RPN, with cfg.TRAIN's "
                    f"12000 / 2000 boxes; caffeq runs the TEST form (top rois): use the net's test prototxt")
        if attrs["foreign_keys"]:
            return (f"param_str sets {attrs['foreign_keys']}, which MNC's proposal_layer.py does not read (it reads "
                    f"{', '.join(attrs['known_keys'])}): this net comes with another proposal_layer.py, whose "
                    f"proposals caffeq does not guess")
        prob, deltas, info = (tuple(s) for s in in_shapes)
        a = len(attrs["anchors"])
        if prob[1] != 2 * a or deltas[1] != 4 * a:
            how = ("param_str 'anchor_scales' and 'anchor_ratios' set them" if attrs["fork"]
                   else "MNC's module always makes generate_anchors()'s 9")
            return (f"the net scores {prob[1] // 2} anchors per position and regresses {deltas[1] // 4}, but the "
                    f"proposal layer makes {a} (scales {attrs['scales']} x ratios {attrs['ratios']}; {how})")
        if math.prod(info) < 3:
            return f"im_info must hold [height, width, scale], got shape {list(info)}"
        return None


# ---- StageBridgeLayer -------------------------------------------------------------------------

TRAIN_SAMPLER_WHY = ("this is its TRAIN form, which samples rois and their targets against the ground truth; it "
                     "does not run for inference: use the net's test prototxt")


@register_layer(*_keys("stage_bridge_layer.StageBridgeLayer"))
class MNCStageBridge(Layer):
    makes_training_targets = True   # the TRAIN form's labels and targets (the TEST form has one top)

    def parse(self, lp):
        counts = (len(lp.bottom), len(lp.top))
        if counts == (4, 1):
            return {"name": lp.name, "kind": _kind(lp), "train": False}
        if counts != (7, 8):
            raise LayerError(f"MNC's StageBridgeLayer takes 4 bottoms (rois, bbox_pred, seg_cls_prob, im_info) and "
                             f"one top at TEST, or 7 bottoms (rois, bbox_pred, seg_cls_prob, gt_boxes, gt_masks, "
                             f"im_info, mask_info) and 8 tops at TRAIN; got {counts[0]} and {counts[1]}")
        p = parse_param_str(lp.python_param.param_str)
        # MNC's setup also reads 'use_clip' (gradient clipping); wk910930/py-faster-rcnn's copy (seg-wk 6e71312)
        # reads only feat_stride and num_classes
        if "feat_stride" not in p:
            raise LayerError("python_param.param_str: 'feat_stride' is required (MNC's StageBridgeLayer reads it "
                             "in setup at TRAIN)")
        notes = []
        if "num_classes" not in p and _is_fork(lp):
            # delftrobotics-forks/MNC before 2951744 (2017-04-07) sized the targets for 21 classes
            p["num_classes"] = 21
            notes.append("python_param.param_str sets no 'num_classes': sized for 21 classes, as the "
                         "delftrobotics-forks/MNC stage_bridge_layer.py that reads none")
        classes = param_str_positive_int(p, "num_classes", "MNC's StageBridgeLayer")
        return {"name": lp.name, "kind": _kind(lp), "train": True, "num_classes": classes, "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        if attrs["train"]:
            mask, targets = (1, 1, MASK_SIZE, MASK_SIZE), (1, 4 * attrs["num_classes"])
            return [(1, 5), (1, 1), mask, mask, (1, 4), targets, targets, targets]
        return [(in_shapes[0][0], 5)]

    def cannot_run(self, attrs, in_shapes):
        if attrs["train"]:
            return TRAIN_SAMPLER_WHY
        rois, deltas, scores, info = (tuple(s) for s in in_shapes)
        if any(len(s) != 2 for s in (rois, deltas, scores, info)):
            return (f"MNC's StageBridgeLayer indexes its bottoms as 2-D arrays (rois (R, 5), bbox_pred (R, 4K), "
                    f"seg_cls_prob (R, K), im_info (1, 3)), got {[list(s) for s in in_shapes]}")
        if not rois[0] == deltas[0] == scores[0]:
            return f"rois, bbox_pred and seg_cls_prob must have one row per roi, got {rois[0]}, {deltas[0]} and {scores[0]}"
        if rois[1] < 5 or info[0] < 1 or info[1] < 2:
            return f"rois must be (R, 5) and im_info [height, width, ...], got {list(rois)} and {list(info)}"
        if deltas[1] % 4 or deltas[1] // 4 < scores[1]:
            return (f"bbox_pred must hold 4 deltas for each of seg_cls_prob's {scores[1]} classes, "
                    f"got {deltas[1]} values a row")
        return None

    def forward(self, attrs, params, *bottoms):
        self.refuse_if_cannot_run(attrs["name"], attrs, [b.shape for b in bottoms], layer_type=attrs["kind"])
        return mnc_stage_bridge(*bottoms)

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError,
                                  node.attrs["kind"])
        rois, deltas, scores, info = node.inputs
        g = _OnnxGraph(ctx)
        f32 = g.f32
        best = g.op("Unsqueeze", g.op("ArgMax", scores, axis=1, keepdims=1), g.i64([2]))   # (R, 1, 1), the first max
        grouped = g.op("Reshape", deltas, g.i64([-1, ctx.shape(deltas)[1] // 4, 4]))
        picked = g.op("Reshape", g.op("GatherElements", grouped, g.op("Expand", best, g.i64([1, 1, 4])), axis=1),
                      g.i64([-1, 4]))
        col = lambda t, k: g.op("Slice", t, g.i64([k]), g.i64([k + 1]), g.i64([1]))   # (R, 1)
        bx1, by1, bx2, by2 = (col(rois, k) for k in range(1, 5))
        dx, dy, dw, dh = (col(picked, k) for k in range(4))
        widths = g.op("Add", g.op("Sub", bx2, bx1), f32(1.0))
        heights = g.op("Add", g.op("Sub", by2, by1), f32(1.0))
        ctr_x = g.op("Add", bx1, g.op("Mul", f32(0.5), widths))
        ctr_y = g.op("Add", by1, g.op("Mul", f32(0.5), heights))
        cx, cy = g.op("Add", g.op("Mul", dx, widths), ctr_x), g.op("Add", g.op("Mul", dy, heights), ctr_y)
        half_w = g.op("Mul", f32(0.5), g.op("Mul", g.op("Exp", dw), widths))
        half_h = g.op("Mul", f32(0.5), g.op("Mul", g.op("Exp", dh), heights))
        first = g.op("Reshape", g.op("Slice", info, g.i64([0]), g.i64([1]), g.i64([0])), g.i64([-1]))
        y_max = g.op("Sub", g.op("Slice", first, g.i64([0]), g.i64([1]), g.i64([0])), f32(1.0))
        x_max = g.op("Sub", g.op("Slice", first, g.i64([1]), g.i64([2]), g.i64([0])), f32(1.0))
        clip = lambda v, top: g.op("Max", g.op("Min", v, top), f32(0.0))
        corners = [clip(g.op("Sub", cx, half_w), x_max), clip(g.op("Sub", cy, half_h), y_max),
                   clip(g.op("Add", cx, half_w), x_max), clip(g.op("Add", cy, half_h), y_max)]
        rows = g.op("Slice", g.op("Shape", rois), g.i64([0]), g.i64([1]), g.i64([0]))
        zeros = g.op("ConstantOfShape", g.op("Concat", rows, g.i64([1]), axis=0), value=_scalar_tensor(0.0))
        ctx.add_node("Concat", [zeros] + corners, [node.outputs[0]], name=node.name, axis=1)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(i) for i in range(len(node.inputs))], ExportError,
                                  a["kind"])
        return f"{emit.helper(TORCH_STAGE_BRIDGE)}({', '.join(emit.inputs)})"


# ---- MaskLayer ---------------------------------------------------------------------------------

@register_layer(*_keys("mask_layer.MaskLayer"))
class MNCMaskLayer(Layer):
    makes_training_targets = True   # the TRAIN form's mask_proposal_label

    def parse(self, lp):
        counts = (len(lp.bottom), len(lp.top))
        if counts not in ((1, 1), (3, 2)):
            raise LayerError(f"MNC's MaskLayer takes one bottom (mask_output) and one top at TEST, or 3 bottoms "
                             f"(mask_output, gt_masks, gt_masks_info) and 2 tops at TRAIN; got {counts[0]} and "
                             f"{counts[1]}")
        return {"name": lp.name, "kind": _kind(lp), "train": counts == (3, 2)}

    def infer(self, attrs, in_shapes):
        if attrs["train"]:
            return [(1, 1, MASK_SIZE, MASK_SIZE), (1, 1)]
        return [(in_shapes[0][0], 1, MASK_SIZE, MASK_SIZE)]

    def cannot_run(self, attrs, in_shapes):
        if attrs["train"]:
            return ("this is its TRAIN form, which labels each predicted mask by its overlap with the ground-truth "
                    "mask; it does not run for inference: use the net's test prototxt")
        s = tuple(in_shapes[0])
        if not s or math.prod(s) != s[0] * MASK_SIZE * MASK_SIZE:
            return (f"MNC's MaskLayer reshapes each row of mask_output to 1 x {MASK_SIZE} x {MASK_SIZE} "
                    f"(cfg.MASK_SIZE): {MASK_SIZE * MASK_SIZE} values a row are needed, got {list(s)}")
        return None

    def forward(self, attrs, params, *bottoms):
        self.refuse_if_cannot_run(attrs["name"], attrs, [b.shape for b in bottoms], layer_type=attrs["kind"])
        x = bottoms[0]
        return x.reshape(x.shape[0], 1, MASK_SIZE, MASK_SIZE)

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError,
                                  node.attrs["kind"])
        shape = ctx.const(np.array([-1, 1, MASK_SIZE, MASK_SIZE], np.int64))   # its rows: MASK_SIZE² values each
        ctx.add_node("Reshape", [node.inputs[0], shape], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(i) for i in range(len(node.inputs))], ExportError,
                                  a["kind"])
        x = emit.inputs[0]
        return f"{x}.reshape({x}.shape[0], 1, {MASK_SIZE}, {MASK_SIZE})"


# ---- TRAIN: the data layer and the target samplers ---------------------------------------------

@register_layer(*_keys("mnc_data_layer.MNCDataLayer"))
class MNCData(DataLayer):
    """MNC's training data: a graph input with its setup's shapes (one image a batch)."""

    def parse(self, lp):
        need_blobs(lp, "MNCDataLayer (tops data, im_info, gt_boxes[, gt_masks, mask_info])", 0, (3, 5))
        classes = param_str_positive_int(parse_param_str(lp.python_param.param_str), "num_classes", "MNCDataLayer")
        return {"num_tops": len(lp.top), "tops": list(lp.top), "num_classes": classes}

    def top_shapes(self, attrs, given):
        shapes = [TRAIN_DATA, (1, 3), (1, 4), (1, MASK_SIZE, MASK_SIZE), (1, 3)][: attrs["num_tops"]]
        return [tuple(given.get(i) or shape) for i, shape in enumerate(shapes)]

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        return ["MNC's MNCDataLayer: the image (BGR) less the pixel means [102.9801, 115.9465, 122.7717], scaled "
                "(cv2 INTER_LINEAR) so that its shorter side is 600 and its longer at most 1000, flipped images "
                "added at TRAIN; im_info = [height, width, scale], gt_boxes rows [x1, y1, x2, y2, label], "
                "gt_masks zero-padded to the largest mask, mask_info rows [height, width]"]


@register_layer(*_keys("proposal_target_layer.ProposalTargetLayer"))
class MNCProposalTarget(ReadOnlyLayer):
    data_dependent_shape = True     # the sampled rois: (1, 5) until a training forward
    makes_training_targets = True

    def parse(self, lp):
        need_blobs(lp, "MNC's ProposalTargetLayer", range(2, 7), (5, 8, 10),
                   "rpn_rois, gt_boxes, im_info[, gt_masks, mask_info[, rpn_rois_index]]")
        classes = param_str_positive_int(parse_param_str(lp.python_param.param_str), "num_classes", "ProposalTargetLayer")
        return {"name": lp.name, "kind": _kind(lp), "num_classes": classes, "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        targets = (1, 4 * attrs["num_classes"])
        shapes = [(1, 5), (1, 1), targets, targets, targets]
        if attrs["tops"] >= 8:   # cfg.MNC_MODE: mask targets and weights, gt_masks_info
            shapes += [(1, 1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE), (1, 4)]
        if attrs["tops"] == 10:  # cfg.TRAIN.MIX_INDEX: fg_inds, bg_inds
            shapes += [(1, 4), (1, 4)]
        return shapes

    def why_not_run(self, attrs):
        return ("it samples training rois and their mask targets against the ground truth and does not run for "
                "inference; use the net's test prototxt, where the proposals feed ROIWarping")


@register_layer(*_keys("anchor_target_layer.AnchorTargetLayer"))
class MNCAnchorTarget(ReadOnlyLayer):
    makes_training_targets = True

    def parse(self, lp):
        need_blobs(lp, "MNC's AnchorTargetLayer", range(3, 6), 4,
                   "rpn_cls_score, gt_boxes, im_info[, fg_inds, bg_inds]")
        p = parse_param_str(lp.python_param.param_str)
        if not isinstance(p.get("feat_stride"), int) or isinstance(p.get("feat_stride"), bool):
            raise LayerError(f"python_param.param_str: 'feat_stride' must be an integer (MNC's AnchorTargetLayer "
                             f"reads it in setup), got {p.get('feat_stride')!r}")
        return {"name": lp.name, "kind": _kind(lp)}

    def infer(self, attrs, in_shapes):
        score = tuple(in_shapes[0])
        if len(score) < 2:
            raise LayerError(f"MNC's AnchorTargetLayer reads rpn_cls_score's last two axes (H, W), got {list(score)}")
        h, w = score[-2:]
        return [(1, 1, MNC_ANCHORS * h, w)] + [(1, 4 * MNC_ANCHORS, h, w)] * 3

    def why_not_run(self, attrs):
        return ("it labels anchors against the ground-truth boxes for RPN training and does not run for "
                "inference; use the net's test prototxt")

