"""Yochengliu/MLIC-KD-WSD's WSDDN layers (commit 12e92b5; caffe-MLIC/src/caffe/layers/wsd_roigen_layer.cpp,
wsd_roigen_single_scale_layer.cpp, human_att_data_layer.cpp, include/caffe/common_layers.hpp and
include/caffe/layers/data_layer.hpp; fields in caffe-MLIC/src/caffe/proto/caffe.proto, see proto/README.md).

- WsdRoigen: no proposal search and no fixed grid: it re-lays out proposals that the net is given.  Its one
  bottom (N, 5R[, 1, 1]) holds, per image, R boxes of five values [x1, y1, x2, y2, score] (the deploy net's
  `proposaldata` input, the train nets' label columns after the class labels).  The top is (N x R, 6[, 1, 1])
  (the bottom's shape with axis 0 times R and axis 1 set to 6): row i x R + j = [i, x1, y1, x2, y2, score] of
  box j of image i, the rois the fork's ROIPooling reads with their score (roi_pooling.py: score_scale,
  score_bias).  Only a CPU forward exists (the GPU falls back to it).  Deterministic: run everywhere.
- WsdRoigenSingleScale: the same rows with the four corners mapped to another image size,
  floor(float(single_scale) x v / float(origin_scale)) in the blob's float arithmetic (single_scale [224] and
  origin_scale [672] from roi_pooling_param, as the fork reads them); the batch index and score as above.
- HumanAttData: an image list whose lines are a file and att_num + 5 x bbox_num numbers (the class labels,
  then the boxes with their scores).  Tops: data (batch_size, C, H, W), H x W the transform's crop_size, else
  new_height x new_width (else the first image's size: --input-shape), C = 3 (is_color) or 1, as
  transform_param's force_color / force_gray leave it; label (batch_size, att_num + 5 x bbox_num).  With
  scale_factors (training) each batch is resized by a factor drawn from them, its boxes too; the shape above is
  the one Caffe sets up with.

Where the fork only logs an error (a bottom whose axis 1 is not a multiple of 5 leaves R = 0 and an empty top)
caffeq refuses in one line; a bottom with more than one value per (item, channel) is refused too: the fork
fills only the first 6 x N x R values of its (N x R, 6, H, W) top and leaves the rest as the blob held it.
"""
import math

import numpy as np
import torch

from .data import transform_attrs
from .fork_data import ForkDataLayer, _channels, _crop_or
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer

# ---- torch: forward and model.py (inspect.getsource) ------------------------------------------------------


def wsd_roigen(x, single_scale: int = 0, origin_scale: int = 0):
    """(N, 5R, ...) boxes [x1, y1, x2, y2, score] -> (N x R, 6, ...) rows [item, x1, y1, x2, y2, score];
    with single_scale > 0 the corners become floor(single_scale x v / origin_scale) in x's dtype."""
    n = x.shape[0]
    boxes = x.reshape(n, -1, 5)
    r = boxes.shape[1]
    item = torch.arange(n, dtype=x.dtype, device=x.device).reshape(n, 1, 1).expand(n, r, 1)
    corners = boxes[:, :, :4]
    if single_scale > 0:
        s = torch.tensor(float(single_scale), dtype=x.dtype, device=x.device)
        o = torch.tensor(float(origin_scale), dtype=x.dtype, device=x.device)
        corners = torch.floor(s * corners / o)
    rows = torch.cat([item, corners, boxes[:, :, 4:]], 2)
    return rows.reshape((n * r, 6) + tuple(x.shape[2:]))


# ---- the specs ---------------------------------------------------------------------------------------------


def _roi_count(shape, kind):
    """R of a (N, 5R[, 1, 1]) bottom; one line where the fork would log an error or its top would hold values
    it never writes."""
    if len(shape) < 2:
        raise LayerError(f"{kind} needs a bottom of at least 2 axes (N, 5 x boxes), got {list(shape)}")
    c = shape[1]
    if c <= 0 or c % 5:
        raise LayerError(f"{kind}: the bottom's axis 1 ({c}) must be a positive multiple of 5, "
                         f"[x1, y1, x2, y2, score] per box (the fork logs an error and makes no rois)")
    if math.prod(shape[2:]) != 1:
        raise LayerError(f"{kind}: the bottom {list(shape)} has more than one value per box coordinate; the fork "
                         f"reads item i at offset {c} x i and fills only 6 values per roi of its "
                         f"(N x R, 6{''.join(f', {d}' for d in shape[2:])}) top")
    return c // 5


@register_layer("WsdRoigen", "WsdRoigenSingleScale")
class WsdRoigen(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1, roles="boxes (N, 5 x boxes)")
        attrs = {"type": lp.type, "single_scale": 0, "origin_scale": 0}
        if lp.type == "WsdRoigenSingleScale":
            p = lp.roi_pooling_param
            attrs["single_scale"] = positive_field(p.single_scale, "roi_pooling_param.single_scale")
            attrs["origin_scale"] = positive_field(p.origin_scale, "roi_pooling_param.origin_scale")
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        r = _roi_count(s, attrs["type"])
        return [(s[0] * r, 6) + s[2:]]

    def forward(self, attrs, params, x):
        return wsd_roigen(x, attrs["single_scale"], attrs["origin_scale"])

    def onnx(self, ctx, node):
        a = node.attrs
        shape = tuple(ctx.shape(node.inputs[0]))
        n, r = shape[0], _roi_count(shape, a["type"])
        boxes = ctx.add_node("Reshape", [node.inputs[0], ctx.i64([n, r, 5])], ctx.tmp("boxes"))
        item = ctx.const(np.broadcast_to(np.arange(n, dtype=np.float32).reshape(n, 1, 1), (n, r, 1)).copy())
        corners = ctx.add_node("Slice", [boxes, ctx.i64([0]), ctx.i64([4]), ctx.i64([2])], ctx.tmp("corners"))
        score = ctx.add_node("Slice", [boxes, ctx.i64([4]), ctx.i64([5]), ctx.i64([2])], ctx.tmp("score"))
        if a["single_scale"]:
            scaled = ctx.add_node("Mul", [corners, ctx.f32(float(a["single_scale"]))], ctx.tmp("scaled"))
            ratio = ctx.add_node("Div", [scaled, ctx.f32(float(a["origin_scale"]))], ctx.tmp("ratio"))
            corners = ctx.add_node("Floor", [ratio], ctx.tmp("floored"))
        rows = ctx.add_node("Concat", [item, corners, score], ctx.tmp("rows"), axis=2)
        ctx.add_node("Reshape", [rows, ctx.i64([n * r, 6, *shape[2:]])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(wsd_roigen)}({emit.inputs[0]}, {a['single_scale']}, {a['origin_scale']})"


@register_layer("HumanAttData")
class HumanAttData(ForkDataLayer):
    def parse(self, lp):
        need_blobs(lp, "HumanAttData", 0, 2, roles="")
        p = lp.human_att_data_param
        t = transform_attrs(lp)
        if bool(p.new_height) != bool(p.new_width):
            raise LayerError("human_att_data_param: new_height and new_width must be set together (the fork's CHECK)")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": 2, "transform": t, "source": p.source,
                "batch_size": positive_field(p.batch_size, "human_att_data_param.batch_size"),
                "channels": _channels(t, p.is_color), "hw": _crop_or(t, int(p.new_height), int(p.new_width)),
                "label_dim": int(p.att_num) + 5 * int(p.bbox_num), "att_num": int(p.att_num),
                "bbox_num": int(p.bbox_num), "scale_factors": [float(f) for f in p.scale_factors]}

    def label_shape(self, attrs, data):
        return (data[0], attrs["label_dim"])

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        lines = [f"images of the list {attrs['source'] or '?'!r} (root_folder prefixed), read by OpenCV (BGR)"]
        if attrs["scale_factors"]:
            lines.append("each batch resized by a factor drawn from scale_factors "
                         f"{attrs['scale_factors']} (its boxes too); the top's size changes with it")
        lines += super().preprocessing(attrs)
        lines.append(f"label: {attrs['att_num']} class labels, then {attrs['bbox_num']} boxes "
                     "[x1, y1, x2, y2, score] per image, as the list line gives them")
        return lines
