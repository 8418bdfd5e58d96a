"""shenyunhang/caffe-wsl (78b2f71; the Caffe that shenyunhang/CSC's weakly supervised detectors train in):
src/caffe/layers/*_layer.cpp / .cu, include/caffe/layers/*.hpp, src/caffe/proto/caffe.proto.

- PolarConstraint (polar_constraint_layer.cu; polar_constraint_param.polar [false]): bottoms (scores, weights)
  with equal shape(0), shape(1) and count (LayerSetUp's CHECKs); the top is shaped like the scores.  The
  weights are read flat: polar keeps w where w >= 0 (not w < 0), else 0; otherwise w where w <= 0, else 0,
  times -1.  top = weight * score.
- RoIScorePooling and GeneralPooling (77892fa; the roi scores pooled per image): caffe_wsl_pooling.py.
- LoopROIPooling (loop_roi_pooling_layer.cu; loop_roi_pooling_param pooled_h, pooled_w > 0, spatial_scale
  [1]): bottoms (data, rois of 9 values a row: batch, outer x1, y1, x2, y2, inner x1, y1, x2, y2).  Fast
  R-CNN's ROIPooling bins of the outer box (corners C-rounded from the float32 products with spatial_scale);
  each bin gives the maximum of 0 and of its cells not strictly inside the inner box (likewise rounded), so
  an empty bin, or one of negative cells only, gives 0.  The top is (R, C, pooled_h, pooled_w).
- MIL (mil_layer.cpp / .cu with cpg_layer and repartition_layer .cpp / .cu; cpg_param): the layer that holds a
  cpg_param (caffeq's other MIL, R*CNN's, has one bottom).  Bottoms (labels, predictions, rois, roi scores):
  with 3 or 5 its setup indexes past the bottoms it has (refused).  Tops: the roi selection (R, classes),
  and with 3 tops a copy of the labels and zeros shaped like them (2 tops leave the second unshaped:
  refused).  The fork fills these tops only at net setup (MIL::Reshape hands Repartition its bottoms as its
  tops), so its copy is of the labels blob before any data (zeros) and never refreshed; caffeq copies the
  labels it is fed, as Repartition::Reshape means to.  Reshape's CHECKs: labels of one image (num 1) whose
  count is its channels (the classes); the predictions' shape(0) 1, shape(1) the classes, count the classes.
  mode CRF stops in Reshape, is_order needs 3 tops and the mode PRED (refused).  With is_cpg false the
  selection is all 1.  With is_cpg true the forward back-propagates each confident class's score through the
  net to cpg_blob_name and scores the rois by the gradient map: caffeq reads and sizes it but does not run
  it, except where max_num_im_cpg is 0, which switches that off before the first image: the selection is
  then 1 at TRAIN and, at TEST, 1 for the classes whose label exceeds 1e-5, else 0.  caffeq does not check
  that the named blobs exist.  The CSC nets written for the older 77892fa (its OPG layer) name
  start_layer_name, end_layer_name and opg_blob_name instead of predict_blob_name and cpg_blob_name; it has
  no max_num_im_cpg.
- Statistics (statistics_layer.cpp): five bottoms, no top; it only logs counts at TRAIN (LOG(FATAL) at
  TEST): read as a sink that only trains.
- CrossEntropyLoss has no spec: a loss, dropped from inference graphs (training_layers.py); its
  cross_entropy_loss_param is read.
PolarConstraint, LoopROIPooling and MIL have only a GPU forward (their Forward_cpu is NOT_IMPLEMENTED);
Statistics only a CPU one, which the GPU falls back to.
torch, ONNX and model.py.
"""
import math

import numpy as np
import torch
from onnx import TensorProto, numpy_helper

from ..errors import ExportError
from ..io.schema import caffe_pb2
from .c_numerics import c_round, onnx_c_round
from .common import Sink
from .registry import (
    Layer,
    LayerError,
    claim_layers,
    legacy_nchw,
    need_blobs,
    register_layer,
    torch_sources,
)
from .roi_bins_onnx import (
    onnx_axis_bins,
    onnx_batch_column,
    onnx_finish_rois,
    onnx_hole_pieces,
    onnx_padded_rows,
    onnx_scan_bin_max,
    onnx_strictly_inside,
)
from .roi_pooling import (
    TORCH_ROI_POOLING,
    RoiLayerSpec,
    fast_rcnn_bins,
    max_over_bins,
    pooled_grid_attrs,
    range_max_bins,
    roi_batch_index,
)


def _phase(lp):
    return caffe_pb2.Phase.Name(lp.phase) if lp.HasField("phase") else None


def _size(shape):
    return int(math.prod(int(d) for d in shape))


def wsl_polar_constraint(x, weights, polar: bool):
    """caffe-wsl's PolarConstraint: the weights' positive part (polar) or negated negative part, times x."""
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    if polar:
        w = torch.where(weights < 0, zero, weights)
    else:
        w = torch.where(weights > 0, zero, weights) * -1.0
    return w.reshape(x.shape) * x


def loop_roi_max_pool(x, rois, ph: int, pw: int, spatial_scale: float):
    """caffe-wsl's LoopROIPooling -> (R, C, ph, pw): each Fast R-CNN bin of the outer box, less the cells strictly
    inside the inner box, as the union of four bands (above, below, left of and right of the hole), maxima
    from 0."""
    n, c, h, w = x.shape
    r = rois.detach().float().cpu().reshape(-1, 9)
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    batch = torch.trunc(r[:, 0]).long()
    outside = (batch < 0) | (batch >= n)
    if bool(outside.any()):
        roi_batch_index(r[outside][0], n, "LoopROIPooling")   # raises, naming the index
    hs, he, ws, we = fast_rcnn_bins(r[:, :5], spatial_scale, ph, pw, h, w)
    inner = c_round((r[:, 5:9] * torch.tensor(spatial_scale, dtype=torch.float32)).double()).long()
    left, top, right, bottom = (v[:, None] for v in inner.unbind(1))
    bands = [(hs, torch.minimum(he, top + 1), ws, we), (torch.maximum(hs, bottom), he, ws, we),
             (hs, he, ws, torch.minimum(we, left + 1)), (hs, he, torch.maximum(ws, right), we)]
    # the maximum starts at 0: negative cells (and NaN, which never wins) may as well read 0
    positive = torch.where(x > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    out = x.new_zeros((r.shape[0], c, ph, pw))
    for b in torch.unique(batch).tolist():
        picked = (batch == b).nonzero().reshape(-1)
        best = None
        for band in bands:
            part = range_max_bins(positive[b], *(v[picked] for v in band))
            if part is None:   # a table too large, or a gradient wanted: roi by roi
                part = torch.stack([max_over_bins(positive[b], *(v[i] for v in band)) for i in picked.tolist()])
            best = part if best is None else torch.maximum(best, part)
        out[picked.to(x.device)] = best
    return out


def wsl_mil_selection(labels, rois, classes: int, by_label: bool):
    """The MIL's roi selection (R, classes): all 1, or (by_label) 1 for the classes whose label exceeds 1e-5."""
    count = rois.shape[0] if rois.dim() else 1
    if not by_label:
        return torch.ones((count, classes), dtype=labels.dtype, device=labels.device)
    chosen = (labels.reshape(1, classes) > 1e-5).to(labels.dtype)
    return chosen.expand(count, classes).contiguous()


TORCH_LOOP_ROI_POOLING = torch_sources(loop_roi_max_pool)


# ---- the specs ----------------------------------------------------------------------------


@register_layer("PolarConstraint")
class PolarConstraint(Layer):
    reading_note = ("PolarConstraint: computed as caffe-wsl's GPU forward (polar_constraint_layer.cu); its CPU "
                    "forward is not implemented")

    def parse(self, lp):
        need_blobs(lp, "PolarConstraint", 2, 1, "scores, weights")
        return {"polar": bool(lp.polar_constraint_param.polar)}

    def infer(self, attrs, in_shapes):
        a, b = (tuple(int(d) for d in s) for s in in_shapes)
        if len(a) < 2 or len(b) < 2 or a[:2] != b[:2] or _size(a) != _size(b):
            raise LayerError(f"PolarConstraint's bottoms need the same shape(0), shape(1) and count (the fork's "
                             f"CHECKs), got {list(a)} and {list(b)}")
        return [a]

    def forward(self, attrs, params, x, weights):
        return wsl_polar_constraint(x, weights, attrs["polar"])

    def onnx(self, ctx, node):
        x, s = node.inputs
        zero = ctx.f32(0.0)
        if node.attrs["polar"]:
            w = ctx.op("Where", [ctx.op("Less", [s, zero], "negative"), zero, s], "weight")
        else:
            w = ctx.op("Neg", [ctx.op("Where", [ctx.op("Greater", [s, zero], "positive"), zero, s], "kept")], "weight")
        w = ctx.op("Reshape", [w, ctx.i64(list(ctx.shape(x)))], "weight_shaped")
        ctx.add_node("Mul", [w, x], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(wsl_polar_constraint)}({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['polar']})"


@register_layer("LoopROIPooling")
class LoopROIPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(loop_roi_max_pool), TORCH_LOOP_ROI_POOLING
    roi_helpers = (TORCH_ROI_POOLING,)
    reading_note = ("LoopROIPooling: computed as caffe-wsl's GPU kernel (loop_roi_pooling_layer.cu); its CPU forward "
                    "is not implemented")

    def parse(self, lp):
        need_blobs(lp, "LoopROIPooling", 2, 1, "data, rois")
        return pooled_grid_attrs(lp.loop_roi_pooling_param, "loop_roi_pooling_param")

    def infer(self, attrs, in_shapes):
        s, r = in_shapes
        if len(s) != 4:
            raise LayerError(f"LoopROIPooling needs a 4-axis input, got {list(s)}")
        if not r or _size(r[1:]) != 9:
            raise LayerError(f"LoopROIPooling: rois must be (R, 9) = [batch, outer x1, y1, x2, y2, inner x1, y1, x2, "
                             f"y2] (the fork reads 9 values a row), got {list(r)}")
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"], attrs["scale"]), {}

    def onnx(self, ctx, node):
        a = node.attrs
        x, rois = node.inputs
        n, _, h, w = ctx.shape(x)
        rows, count = onnx_padded_rows(ctx, rois, 9)
        batch, inside = onnx_batch_column(ctx, rows, n)
        scaled = ctx.op("Mul", [ctx.op("Slice", [rows, ctx.i64([1]), ctx.i64([9]), ctx.i64([1])], "corners"),
                                ctx.f32(float(np.float32(a["scale"])))], "scaled")
        cells = ctx.op("Cast", [onnx_c_round(ctx, scaled, in_double=True)], "cells", to=TensorProto.FLOAT)

        def column(k):
            return ctx.op("Slice", [cells, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], "cell")
        mh, _, _ = onnx_axis_bins(ctx, column(1), column(3), a["ph"], h)
        mw, _, _ = onnx_axis_bins(ctx, column(0), column(2), a["pw"], w)
        pieces = onnx_hole_pieces(ctx, mh, mw, onnx_strictly_inside(ctx, column(5), column(7), h),
                                  onnx_strictly_inside(ctx, column(4), column(6), w))
        # negative cells (and NaN, which never wins in the fork) read 0, where the maximum starts
        positive = ctx.op("Where", [ctx.op("Greater", [x, ctx.f32(0.0)], "is_positive"), x, ctx.f32(0.0)], "positive")
        pooled = onnx_scan_bin_max(ctx.with_shapes({positive: ctx.shape(x)}), node, positive, batch, pieces,
                                   a["ph"], a["pw"], 0.0)
        outside = ctx.op("Reshape", [ctx.op("Not", [inside], "b_out"), ctx.i64([-1, 1, 1, 1])], "b_out4")
        onnx_finish_rois(ctx, node, pooled, count, outside)


def _is_wsl_mil(lp):
    return lp.HasField("cpg_param") or len(lp.bottom) >= 3


@claim_layers("MIL", _is_wsl_mil)
class WslMIL(Layer):
    reading_note = ("MIL (caffe-wsl): computed as the fork's GPU forward (mil_layer.cu); its CPU forward is not "
                    "implemented")

    def parse(self, lp):
        if len(lp.bottom) in (3, 5):
            raise LayerError(f"caffe-wsl's MIL takes 4 bottoms (labels, predictions, rois, roi scores): with "
                             f"{len(lp.bottom)} its setup reads past the bottoms it has")
        if len(lp.bottom) == 4 and len(lp.top) == 2:
            raise LayerError("caffe-wsl's MIL takes 1 or 3 tops: with 2 it never shapes the second")
        need_blobs(lp, "MIL", 4, (1, 3), "labels, predictions, rois, roi scores")
        p = lp.cpg_param
        older = p.HasField("start_layer_name") or p.HasField("end_layer_name") or len(p.opg_blob_name) > 0
        if older:   # 77892fa's OPG fields
            if p.HasField("predict_blob_name") or p.cpg_blob_name or p.HasField("max_num_im_cpg"):
                raise LayerError("cpg_param mixes caffe-wsl 77892fa's start_layer_name / end_layer_name / "
                                 "opg_blob_name with 78b2f71's predict_blob_name / cpg_blob_name / max_num_im_cpg")
            if not (p.HasField("start_layer_name") and p.HasField("end_layer_name")):
                raise LayerError("caffe-wsl 77892fa's MIL needs cpg_param.start_layer_name and end_layer_name "
                                 "(required in its proto)")
        elif not p.HasField("predict_blob_name"):
            raise LayerError("caffe-wsl's MIL needs cpg_param.predict_blob_name (required in its proto; 77892fa's "
                             "start_layer_name and end_layer_name instead)")
        if not (p.opg_blob_name if older else p.cpg_blob_name):
            field = "opg_blob_name" if older else "cpg_blob_name"
            raise LayerError(f"caffe-wsl's MIL needs a cpg_param.{field} (its setup takes the first one's blob as "
                             f"the image)")
        mode = caffe_pb2.CPGParameter.Mode.Name(p.mode)
        if mode == "CRF":
            raise LayerError("cpg_param.mode CRF: caffe-wsl's Repartition stops in Reshape ('Not yet.')")
        if p.is_order and (mode == "CPG_POOLING" or len(lp.top) != 3):
            raise LayerError("cpg_param.is_order needs mode PRED and 3 tops (the fork's CHECKs)")
        return {"name": lp.name, "is_cpg": bool(p.is_cpg), "max_num_im_cpg": int(p.max_num_im_cpg),
                "tops": len(lp.top), "phase": _phase(lp)}

    def infer(self, attrs, in_shapes):
        labels, predict, rois = (tuple(int(d) for d in s) for s in in_shapes[:3])
        num, classes = legacy_nchw(labels, "MIL")[:2]
        if num != 1 or _size(labels) != classes:
            raise LayerError(f"caffe-wsl's MIL needs labels of one image, (1, classes) (the fork's CHECKs), got "
                             f"{list(labels)}")
        if len(predict) < 2 or predict[:2] != (1, classes) or _size(predict) != classes:
            raise LayerError(f"caffe-wsl's MIL needs predictions shaped (1, {classes}) like the labels (the fork's "
                             f"CHECKs), got {list(predict)}")
        selection = (legacy_nchw(rois, "MIL")[0], classes)
        return [selection, labels, labels][:attrs["tops"]]

    def cannot_run(self, attrs, in_shapes):
        if attrs["is_cpg"] and attrs["max_num_im_cpg"] != 0:
            return ("with cpg_param.is_cpg the fork back-propagates each confident class's score through the net "
                    "to the image blob (cpg_blob_name, opg_blob_name) and scores the rois by that gradient map; "
                    "caffeq runs forward only")

    def _by_label(self, attrs):
        return attrs["is_cpg"] and attrs["phase"] == "TEST"

    def forward(self, attrs, params, labels, predict, rois, scores):
        self.refuse_if_cannot_run(attrs["name"], attrs, [t.shape for t in (labels, predict, rois, scores)], LayerError)
        classes = labels.numel()
        selection = wsl_mil_selection(labels, rois, classes, self._by_label(attrs))
        if attrs["tops"] == 1:
            return selection
        return selection, labels.clone(), torch.zeros_like(labels)

    def onnx(self, ctx, node):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(i) for i in node.inputs], ExportError, node.type)
        labels, _, rois, _ = node.inputs
        classes = _size(ctx.shape(labels))
        count = ctx.op("Slice", [ctx.op("Shape", [rois], "rois_shape"), ctx.i64([0]), ctx.i64([1])], "count")
        size = ctx.op("Concat", [count, ctx.i64([classes])], "size", axis=0)
        if self._by_label(a):
            chosen = ctx.op("Cast", [ctx.op("Greater", [ctx.op("Reshape", [labels, ctx.i64([1, classes])], "row"),
                                                        ctx.f32(1e-5)], "labelled")], "chosen", to=TensorProto.FLOAT)
            ctx.add_node("Expand", [chosen, size], [node.outputs[0]], name=node.name)
        else:
            ctx.add_node("ConstantOfShape", [size], [node.outputs[0]], name=node.name,
                         value=numpy_helper.from_array(np.array([1.0], np.float32)))
        if a["tops"] == 3:
            ctx.add_node("Identity", [labels], [node.outputs[1]], name=f"{node.name}/labels")
            ctx.add_node("Identity", [ctx.filled(labels, 0.0, "zeros")], [node.outputs[2]], name=f"{node.name}/zeros")

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(i) for i in range(4)], ExportError, node.type)
        classes = _size(emit.in_shape(0))
        call = f"{emit.helper(wsl_mil_selection)}({emit.inputs[0]}, {emit.inputs[2]}, {classes}, {self._by_label(a)})"
        if a["tops"] == 1:
            return call
        return [call, f"{emit.inputs[0]}.clone()", f"torch.zeros_like({emit.inputs[0]})"]


@register_layer("Statistics")
class WslStatistics(Sink):
    is_training_only = True
    reading_note = ("Statistics (caffe-wsl) only logs per-class counts at TRAIN and stops the net at TEST; caffeq "
                    "computes nothing for it, and exports leave it out")

    def parse(self, lp):
        need_blobs(lp, "Statistics", 5, 0, "labels, predictions, positive predictions, negative predictions, "
                                           "roi selection")
        return {"name": lp.name, "phase": _phase(lp)}

    def cannot_run(self, attrs, in_shapes):
        if attrs["phase"] == "TEST":
            return "caffe-wsl's Statistics stops the net at TEST (LOG(FATAL) 'Undone.')"
        if legacy_nchw(in_shapes[0], "Statistics")[0] != 1:
            return f"caffe-wsl's Statistics takes labels of one image (its CHECK), got {list(in_shapes[0])}"

    def forward(self, attrs, params, *inputs):
        self.refuse_if_cannot_run(attrs["name"], attrs, [t.shape for t in inputs], LayerError)
        return ()
