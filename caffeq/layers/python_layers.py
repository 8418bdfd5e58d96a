"""Well-known Python layers other than Faster R-CNN's proposals (those live in rcnn.py) and DetectNet's
clustering (detectnet_clustering.py).

caffeq never imports the module a `Python` layer names; these specs implement, natively,
what the known module computes (see registry.spec_for).

- `spatial_dropout.SpatialDropoutLayer` (ENet, TimoSaemann/ENet): its param_str carries a
  `phase` and `p`.  With phase 'TEST' the layer multiplies by 1 / (1 - p) (float32), in every
  phase of the net, as the module does; with phase 'TRAIN' it drops whole channels while
  training and, for inference here, passes the data through (the module would keep dropping
  channels at random, which no inference wants).
- `rpn.proposal_target_layer.ProposalTargetLayer` (py-faster-rcnn, py-R-FCN train nets): samples
  training rois against the ground-truth boxes.  Its shapes are those its setup gives (rois
  (1, 5), labels (1, 1), bbox targets and weights (1, 4 * num_classes)), so a train net can be
  listed and converted up to it; it never runs (a deploy or test net has no such layer).
  nqanh/affordance-net's form takes 5 bottoms and adds mask_targets (1, 244, 244) and rois_pos (1, 5).
  xraydetec/Xdet's FPN form (1119bbe lib/rpn/proposal_target_layer.py) takes rpn_rois, gt_boxes and
  data and gives one rois top per pyramid level 2-5 (1, 5) each, then labels and the three targets.
- `interp.UpsamplingBilinear2d` (jasonlovescoding/YOLOv3-caffe's interp.py): despite its name, a
  nearest-neighbour resize, each image through OpenCV's cv2.resize(..., INTER_NEAREST) to
  int(W * zoom_factor) x int(H * zoom_factor) (param_str {'zoom_factor': z}).  OpenCV's rule: output
  index i reads the source index min(floor(i * (1 / (out / in))), in - 1), in doubles; for an integer
  zoom every pixel repeats zoom times.  The module's setup shapes the top (N, C, W', H') while its
  forward writes (C, H', W'), so it runs only for a square output (H' == W'), and cv2 takes 2 to 512
  channels (one channel loses its axis and the transpose fails): others are refused as the module
  would fail.  ONNX: two Gathers with the index tables as constants.
- `ordinal_decode_layer.OrdinalDecodeLayer` (hufu6371/DORN's depth nets, caffe/pylayer at
  ce9ee7b): the ordinal regression's depth label, (N, 1, H, W) float32, counting the channel pairs
  (2i, 2i + 1), i < C // 2, whose numpy argmax is 1: x[2i + 1] > x[2i], or x[2i + 1] is NaN and
  x[2i] is not (argmax takes the first NaN as the maximum); an odd last channel is left out.
- `maxout_layer.layer.MaxoutLayer` (beacandler/R2CNN 19d2382 src/lib/maxout_layer/layer.py, its
  multi-scale tests): bottoms (pooled rois (R, C, H, W) or (R, C), im_info (1, 2 + S)); the rois come
  as S blocks of R / S, one per test scale (the im_info columns after the second), and the top
  (R / S, C, H, W) is their elementwise maximum, started from zeros (so never below 0).  R must be a
  multiple of S, as the module asserts.
"""

import numpy as np
import torch
import torch.nn.functional as F

from .param_str import param_str_positive_int, parse_param_str
from .registry import Layer, LayerError, ReadOnlyLayer, need_blobs, register_layer, torch_sources


@register_layer("Python:spatial_dropout.SpatialDropoutLayer")
class SpatialDropout(Layer):
    uses_training_flag = True

    def parse(self, lp):
        need_blobs(lp, "SpatialDropoutLayer", 1, 1)
        params = parse_param_str(lp.python_param.param_str)
        phase = str(params.get("phase", "TRAIN")).upper()
        try:
            p = float(params.get("p", 0.5))
        except (TypeError, ValueError):
            raise LayerError(f"python_param.param_str: p must be a number, got {params.get('p')!r}") from None
        if not 0 < p < 1:
            raise LayerError(f"python_param.param_str: p must be between 0 and 1, got {p}")
        if phase not in ("TRAIN", "TEST"):
            raise LayerError(f"python_param.param_str: phase must be 'TRAIN' or 'TEST', got {phase!r}")
        # the module computes scale_ = 1. / (1. - p) in float64 and multiplies float32 data by it
        return {"p": p, "phase": phase, "test_scale": float(np.float32(1.0 / (1.0 - p)))}

    def forward(self, attrs, params, x, training=False):
        if attrs["phase"] == "TEST":
            return x * attrs["test_scale"]
        return F.dropout2d(x, attrs["p"], training=training) if training else x

    def onnx(self, ctx, node):
        if node.attrs["phase"] == "TEST":
            ctx.add_node("Mul", [node.inputs[0], ctx.const(np.array(node.attrs["test_scale"], np.float32))],
                         [node.outputs[0]], name=node.name)
        else:
            ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a["phase"] == "TEST":
            return f"{emit.inputs[0]} * {emit.lit(a['test_scale'])}"
        dropout = emit.module(f"nn.Dropout2d(p={emit.lit(a['p'])})")
        return f"{dropout}({emit.inputs[0]})"


AFFORDANCE_MASK_SIZE = 244   # nqanh/affordance-net lib/fast_rcnn/config.py: __C.TRAIN.MASK_SIZE


@register_layer("Python:rpn.proposal_target_layer.ProposalTargetLayer")
class ProposalTarget(ReadOnlyLayer):
    data_dependent_shape = True     # the sampled rois: (1, 5) until a training forward
    makes_training_targets = True   # labels, bbox targets and weights (and person_search's pid label)

    def parse(self, lp):
        # person_search (ShuangLI59) adds a sixth top: an auxiliary (pid) label per roi, (1, 1);
        # nqanh/affordance-net takes im_info, seg_mask_inds and flipped too and adds mask_targets and rois_pos
        params = parse_param_str(lp.python_param.param_str)
        # insmod-he/py-R-FCN's seg_mask branch takes the image id and adds seg_targets and seg_weights,
        # (1, 2 seg_num + 2) each
        seg_num = params.get("seg_num") if len(lp.top) == 7 and len(lp.bottom) == 3 else None
        # VitoChien/py-mask-rcnn (0aaf997 lib/rpn/proposal_target_layer.py) takes the instance masks and adds
        # mask rois and (1, out_size, out_size) mask targets
        mask_size = params.get("out_size") if len(lp.top) == 7 and len(lp.bottom) == 3 and seg_num is None else None
        if len(lp.top) == 8:
            need_blobs(lp, "ProposalTargetLayer", 3, 8, "rpn_rois, gt_boxes, data")
        elif seg_num is not None:
            if not isinstance(seg_num, int) or isinstance(seg_num, bool) or seg_num < 0:
                raise LayerError(f"python_param.param_str: 'seg_num' must be a non-negative integer, got {seg_num!r}")
        elif mask_size is not None:
            param_str_positive_int(params, "out_size")
        elif len(lp.top) == 7:
            need_blobs(lp, "ProposalTargetLayer", 5, 7, "rpn_rois, gt_boxes, im_info, seg_mask_inds, flipped")
        elif len(lp.top) != 6:
            # forks feed it more (fighting-liu's im_info, tszssong's flags); its five tops stay py-faster-rcnn's
            need_blobs(lp, "ProposalTargetLayer", (2, 3, 4), 5, "rpn_rois, gt_boxes, then a fork's own inputs")
        elif len(lp.bottom) != 2:
            need_blobs(lp, "ProposalTargetLayer", 2, 6, "rpn_rois, gt_boxes")
        classes = param_str_positive_int(params, "num_classes")
        return {"num_classes": classes, "name": lp.name, "aux_label": len(lp.top) == 6,
                "masks": len(lp.top) == 7 and seg_num is None and mask_size is None, "seg_num": seg_num,
                "mask_size": mask_size,
                "levels": 4 if len(lp.top) == 8 else 1}

    def infer(self, attrs, in_shapes):
        targets = (1, 4 * attrs["num_classes"])
        extra = [(1, 1)] * attrs["aux_label"]
        if attrs.get("masks"):   # affordance-net's setup: (1, MASK_SIZE, MASK_SIZE) with its cfg's 244, (1, 5)
            extra = [(1, AFFORDANCE_MASK_SIZE, AFFORDANCE_MASK_SIZE), (1, 5)]
        if attrs.get("seg_num") is not None:
            extra = [(1, 2 * attrs["seg_num"] + 2)] * 2
        if attrs.get("mask_size") is not None:   # mask rois, then the (out_size x out_size) mask targets
            extra = [(1, 5), (1, 1, attrs["mask_size"], attrs["mask_size"])]
        return [(1, 5)] * attrs.get("levels", 1) + [(1, 1), targets, targets, targets] + extra

    def why_not_run(self, attrs):
        return ("it samples training rois against the ground-truth boxes and does not run for inference; use "
                "the net's test or deploy prototxt, where region proposals feed the ROI pooling")


# ---- interp.UpsamplingBilinear2d (YOLOv3-caffe): OpenCV's nearest resize --------------------------

def cv_nearest_index(n_in: int, n_out: int):
    """OpenCV's INTER_NEAREST source index for each of n_out outputs: floor(i * (1 / (n_out / n_in)))
    in doubles (int() floors these non-negative products), at most n_in - 1."""
    step = 1.0 / (n_out / n_in)
    return [min(int(i * step), n_in - 1) for i in range(n_out)]


def cv_nearest_resize(x, h_out: int, w_out: int):
    """cv2.resize(..., INTER_NEAREST) of every plane of x (N, C, H, W) to h_out x w_out."""
    rows = torch.tensor(cv_nearest_index(x.shape[2], h_out), dtype=torch.long, device=x.device)
    cols = torch.tensor(cv_nearest_index(x.shape[3], w_out), dtype=torch.long, device=x.device)
    return x.index_select(2, rows).index_select(3, cols)


# model.py gets these very functions
TORCH_CV_NEAREST = torch_sources(cv_nearest_index, cv_nearest_resize)


def onnx_cv_nearest(ctx, node, x, h, w, ho, wo):
    """cv_nearest_resize of x (N, C, h, w) to node's top (ho x wo) as two Gathers of constant indexes."""
    rows = ctx.add_node("Gather", [x, ctx.const(np.array(cv_nearest_index(h, ho), np.int64))],
                        [ctx.tmp(f"{node.name}_rows")], axis=2)[0]
    ctx.add_node("Gather", [rows, ctx.const(np.array(cv_nearest_index(w, wo), np.int64))],
                 [node.outputs[0]], name=node.name, axis=3)

CV_CN_MAX = 512   # OpenCV's most channels in one Mat element


@register_layer("Python:interp.UpsamplingBilinear2d")
class CVNearestUpsample(Layer):
    def parse(self, lp):
        need_blobs(lp, "interp.UpsamplingBilinear2d", 1, 1)
        params = parse_param_str(lp.python_param.param_str)
        zoom = params.get("zoom_factor")
        if not isinstance(zoom, (int, float)) or isinstance(zoom, bool) or not zoom > 0:
            raise LayerError(f"python_param.param_str: 'zoom_factor' must be a positive number "
                             f"(e.g. '{{\"zoom_factor\": 2}}'), got {zoom!r}")
        unknown = sorted(set(params) - {"zoom_factor"})
        if unknown:
            raise LayerError(f"python_param.param_str: interp.UpsamplingBilinear2d reads only 'zoom_factor', "
                             f"got {unknown}")
        return {"zoom": zoom}

    @staticmethod
    def out_hw(attrs, h, w):
        return int(h * attrs["zoom"]), int(w * attrs["zoom"])   # the module's int(size * zoom_factor)

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"interp.UpsamplingBilinear2d needs a 4-axis input, got {list(s)}")
        ho, wo = self.out_hw(attrs, s[2], s[3])
        if ho < 1 or wo < 1:
            raise LayerError(f"interp.UpsamplingBilinear2d: zoom_factor {attrs['zoom']} leaves a "
                             f"{ho}x{wo} output for a {s[2]}x{s[3]} input")
        if ho != wo:
            raise LayerError(f"interp.UpsamplingBilinear2d shapes its top (N, C, W', H') but writes (C, H', W') "
                             f"into it, so it runs only for a square output; got {ho}x{wo}")
        if not 2 <= s[1] <= CV_CN_MAX:
            raise LayerError(f"interp.UpsamplingBilinear2d resizes with cv2, which takes 2 to {CV_CN_MAX} "
                             f"channels here (one channel loses its axis), got {s[1]}")
        return [(s[0], s[1], ho, wo)]

    def forward(self, attrs, params, x):
        ho, wo = self.out_hw(attrs, x.shape[2], x.shape[3])
        return cv_nearest_resize(x, ho, wo)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        _n, _c, h, w = ctx.shape(x)
        onnx_cv_nearest(ctx, node, x, h, w, *self.out_hw(node.attrs, h, w))

    def pytorch_source(self, node, emit):
        ho, wo = self.out_hw(node.attrs, *emit.in_shape(0)[2:])
        return f"{emit.helper(TORCH_CV_NEAREST)}({emit.inputs[0]}, {ho}, {wo})"


def ordinal_count(x):
    """DORN's decode: per pixel, how many channel pairs (2i, 2i + 1) numpy's argmax sends to 1."""
    pairs = x.shape[1] // 2
    low, high = x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2]
    up = (high > low) | (torch.isnan(high) & ~torch.isnan(low))
    return up.to(x.dtype).sum(dim=1, keepdim=True)


@register_layer("Python:ordinal_decode_layer.OrdinalDecodeLayer")
class OrdinalDecode(Layer):
    def parse(self, lp):
        need_blobs(lp, "OrdinalDecodeLayer", 1, 1, "ordinal scores")
        return {}    # the module reads no param_str

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"OrdinalDecodeLayer reads (N, C, H, W) scores, got {list(s)}")
        return [(s[0], 1, s[2], s[3])]

    def forward(self, attrs, params, x):
        return ordinal_count(x)

    def onnx(self, ctx, node):
        from .norm import onnx_reduce
        x, name = node.inputs[0], node.name
        pairs = ctx.shape(x)[1] // 2

        def channels(start):
            return ctx.add_node("Slice", [x, ctx.const(np.array([start], np.int64)),
                                          ctx.const(np.array([2 * pairs], np.int64)),
                                          ctx.const(np.array([1], np.int64)), ctx.const(np.array([2], np.int64))],
                                ctx.tmp(f"{name}_from{start}"))
        low, high = channels(0), channels(1)
        greater = ctx.add_node("Greater", [high, low], ctx.tmp(name + "_greater"))
        low_nan = ctx.add_node("IsNaN", [low], ctx.tmp(name + "_low_nan"))
        high_nan = ctx.add_node("IsNaN", [high], ctx.tmp(name + "_high_nan"))
        nan_first = ctx.add_node("And", [high_nan, ctx.add_node("Not", [low_nan], ctx.tmp(name + "_low_set"))],
                                 ctx.tmp(name + "_nan_first"))
        up = ctx.add_node("Or", [greater, nan_first], ctx.tmp(name + "_up"))
        ones = ctx.add_node("Cast", [up], ctx.tmp(name + "_ones"), to=1)
        onnx_reduce(ctx, "ReduceSum", ones, [1], True, node.outputs[0])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(torch_sources(ordinal_count))}({emit.inputs[0]})"


def scale_maxout(x, scales: int):
    """R2CNN's MaxoutLayer: the elementwise max of the `scales` row blocks of x and of 0, 4-axis."""
    x = x.reshape(x.shape[0], x.shape[1], -1, 1) if x.dim() == 2 else x
    per = x.shape[0] // scales
    out = torch.zeros_like(x[:per])
    for i in range(scales):
        out = torch.maximum(out, x[i * per:(i + 1) * per])
    return out


@register_layer("Python:maxout_layer.layer.MaxoutLayer")
class ScaleMaxout(Layer):
    data_dependent_shape = True   # as many rows as the rois it pools over, divided by the scales

    def parse(self, lp):
        need_blobs(lp, "maxout_layer.layer.MaxoutLayer", 2, 1, "pooled rois, im_info")
        return {}

    def infer(self, attrs, in_shapes):
        x, info = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) not in (2, 4) or len(info) != 2 or info[1] < 3:
            raise LayerError(f"MaxoutLayer reads pooled rois (R, C[, H, W]) and im_info (1, 2 + scales), got "
                             f"{list(x)} and {list(info)}")
        attrs["scales"] = info[1] - 2
        if x[0] % attrs["scales"]:
            raise LayerError(f"MaxoutLayer: {x[0]} rois do not split into {attrs['scales']} scales (im_info's "
                             f"columns after the second)")
        return [(x[0] // attrs["scales"], x[1]) + (tuple(x[2:]) if len(x) == 4 else (1, 1))]

    def forward(self, attrs, params, x, info):
        if x.shape[0] % attrs["scales"]:
            raise LayerError(f"MaxoutLayer: {x.shape[0]} rois do not split into {attrs['scales']} scales")
        return scale_maxout(x, attrs["scales"])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(scale_maxout)}({emit.inputs[0]}, {node.attrs['scales']})"

    def onnx(self, ctx, node):
        from .norm import onnx_reduce
        x, name, s = node.inputs[0], node.name, node.attrs["scales"]
        shape = ctx.shape(x)
        # rows (S, R / S, C H W), R / S left to the run (a proposal layer's count, possibly 0; the known C H W
        # keeps -1 unambiguous): the max over the first axis, then 0, back to (R / S, C, H, W)
        c, h, w = _rest(shape)
        split = ctx.add_node("Reshape", [x, ctx.i64([s, -1, c * h * w])], [ctx.tmp(name + "_blocks")], name=name)[0]
        best = ctx.op("Max", [onnx_reduce(ctx, "ReduceMax", split, [0], 0), ctx.const(np.array(0.0, np.float32))],
                      "best")
        ctx.add_node("Reshape", [best, ctx.i64([-1, c, h, w])], [node.outputs[0]])


def _rest(shape):
    """The (C, H, W) of pooled rois (R, C, H, W), or (C, 1, 1) of (R, C)."""
    return tuple(shape[1:]) if len(shape) == 4 else (shape[1], 1, 1)
