"""zkl20061823/DRML's layers (b62b9c4; CVPR 2016 "Deep Region and Multi-Label Learning for Facial Action Unit
Detection"): the region layer of prototxt/DRML.prototxt cuts conv1's map into a grid of boxes (Box), runs a
Batch + ReLU + convolution on each, and stitches them back (Splice).  The repository ships the layer sources
(src/caffe/layers/*.cpp, include/caffe/*.hpp) but no caffe.proto: the fields are read by the names the C++ and
the prototxts use (numbers: proto/README.md).

- Box (box_layer.cpp; box_param width, height, xcoord, ycoord): one bottom, one top per box; top t is the
  (height x width) window of the bottom whose corner is row ycoord[t], column xcoord[t], every channel.
  BraveApple/my_caffe's Box (caffeq/layers/box_conv.py, box_param box_height / box_width) keeps the other
  Box layers: this one claims those with DRML's fields or more than one top.
- Splice (splice.cpp; splice_param xcoord, ycoord): the inverse: k bottoms of bottom 0's shape (h, w) into one
  top (N, C, int(h * sqrt(k)), int(w * sqrt(k))) (C++'s int * double truncated), bottom i written at row
  ycoord[i], column xcoord[i], in bottom order (a later box overwrites an earlier one where they overlap);
  what no box covers keeps the zero fill of Caffe's fresh blob.
- Both address image b, channel c as plane b*c + c of the blob (`b*c*H*W + c*H*W`, CPU code; the GPU
  forwards call it), i.e. plane c*(b+1), for the bottom and the top alike.  With one image that is every plane;
  with N > 1 only the planes c*(b+1) (b < N, c < C) are copied, each from the same plane of the bottom, and the
  others keep their zero fill.  caffeq computes just that, from the run-time batch in torch, ONNX (whose dim 0
  may be dynamic) and model.py alike.
- MultiSigmoidCrossEntropyLoss (multi_sigmoid_cross_entropy_loss_layer.cpp / .cu): labels in {-1, 0, 1},
  0 ignored: loss = -sum over the elements with target != 0 of
  x ((target > 0) - (x >= 0)) - log(1 + exp(x - 2 x (x >= 0))), divided by num (bottom 0's first axis).
  Training only.
- MultilabelImageData (image_data_layer_multilabel.cpp): ImageData whose list lines carry
  image_data_param.multilabel_num labels; the label top is (batch_size, multilabel_num, 1, 1).
- Batch (DRML.prototxt's bn1_*, batch_param { use_global_stats }, three param specs): the repository has no
  source for it and no fork found declares a "Batch" type with batch_param, so caffeq reads it, sizes its top
  as its bottom (the net's 3x3 pad-1 convolutions and the Splice after it only fit that) and refuses to run it.
"""
import math

import torch

from .data import ImageData
from .losses import _ScalarLoss
from .registry import (
    AT_LEAST,
    Layer,
    LayerError,
    ReadOnlyLayer,
    claim_layers,
    count,
    legacy_nchw,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)
from .shape_ops import as_4d

FORK = "zkl20061823/DRML"


def drml_planes(n: int, c: int, device=None):
    """(n, c, 1, 1) bool: the planes DRML's Box and Splice copy, c*(b+1) for b < n, c < C (all when n == 1)."""
    k = torch.arange(n * c, device=device)
    keep = torch.zeros(n * c, dtype=torch.bool, device=device)
    for b in range(n):
        keep |= (k % (b + 1) == 0) & (k // (b + 1) < c)
    return keep.reshape(n, c, 1, 1)


def drml_box(x, corners: list, height: int, width: int):
    """DRML's Box: for each (row, column) corner the (height x width) window of every plane it copies."""
    x = as_4d(x)
    n, c = x.shape[0], x.shape[1]
    keep = drml_planes(n, c, x.device) if n > 1 else None
    tops = []
    for v, w in corners:
        t = x[:, :, v:v + height, w:w + width]
        tops.append(t if keep is None else torch.where(keep, t, torch.zeros_like(t)))
    return tuple(tops)


def drml_splice(bottoms: list, corners: list, top_h: int, top_w: int):
    """DRML's Splice: each bottom written at its (row, column) corner of a zeroed top, in order."""
    first = as_4d(bottoms[0])
    n, c, h, w = first.shape
    out = first.new_zeros(n, c, top_h, top_w)
    for x, (v, u) in zip(bottoms, corners):
        out[:, :, v:v + h, u:u + w] = x.reshape(n, c, h, w)
    if n > 1:
        out = torch.where(drml_planes(n, c, out.device), out, torch.zeros_like(out))
    return out


TORCH_PLANES = torch_sources(drml_planes)
TORCH_BOX = torch_sources(as_4d, drml_box)
TORCH_SPLICE = torch_sources(as_4d, drml_splice)


def _corners(p, n, field, what):
    xs, ys = [int(v) for v in p.xcoord], [int(v) for v in p.ycoord]
    if len(xs) < n or len(ys) < n:
        raise LayerError(f"{field}: {what} needs an xcoord and a ycoord for each of its {n} boxes, got "
                         f"{len(xs)} xcoord and {len(ys)} ycoord")
    return [(ys[i], xs[i]) for i in range(n)]


def _onnx_planes(ctx, x, c):
    """drml_planes in ONNX from x's run-time batch (the export's dim 0 may be dynamic): plane k of the
    (N, C) planes is copied when some d in 1..N divides k with k / d < C."""
    scalar = ctx.i64([])
    n = ctx.op("Slice", [ctx.op("Shape", [x], "shape"), ctx.i64([0]), ctx.i64([1])], "n")
    total = ctx.op("Reshape", [ctx.op("Mul", [n, ctx.i64([c])], "planes"), scalar], "planes_scalar")
    k = ctx.op("Reshape", [ctx.op("Range", [ctx.i64(0), total, ctx.i64(1)], "k"), ctx.i64([-1, 1])], "k_col")
    top = ctx.op("Reshape", [ctx.op("Add", [n, ctx.i64([1])], "n1"), scalar], "n1_scalar")
    d = ctx.op("Reshape", [ctx.op("Range", [ctx.i64(1), top, ctx.i64(1)], "d"), ctx.i64([1, -1])], "d_row")
    divides = ctx.op("Equal", [ctx.op("Mod", [k, d], "mod"), ctx.i64(0)], "divides")
    fits = ctx.op("Less", [ctx.op("Div", [k, d], "quotient"), ctx.i64(c)], "fits")
    hits = ctx.op("ReduceSum", [ctx.op("Cast", [ctx.op("And", [divides, fits], "hit")], "hit_count", to=7),
                                ctx.i64([1])], "hits", keepdims=0)
    return ctx.op("Reshape", [ctx.op("Greater", [hits, ctx.i64(0)], "copied"), ctx.i64([-1, c, 1, 1])], "keep")


def _is_drml_box(lp):
    p = lp.box_param
    return p.HasField("width") or p.HasField("height") or len(p.xcoord) > 0 or len(p.ycoord) > 0 or len(lp.top) > 1


@claim_layers("Box", _is_drml_box)
class DrmlBox(Layer):
    def parse(self, lp):
        what = f"Box ({FORK}'s, box_param width / height / xcoord / ycoord)"
        need_blobs(lp, what, 1, range(1, AT_LEAST), in_place=False)   # num_ = top.size(): one box is fine
        p = lp.box_param
        if p.HasField("box_height") or p.HasField("box_width") or p.HasField("convolution_param"):
            raise LayerError("box_param: box_height / box_width / convolution_param (BraveApple/my_caffe's Box) do "
                             f"not combine with width / height / xcoord / ycoord ({FORK}'s Box)")
        h = positive_field(p.height, "box_param.height")
        w = positive_field(p.width, "box_param.width")
        return {"name": lp.name, "height": h, "width": w,
                "corners": _corners(p, len(lp.top), "box_param", f"{FORK}'s Box")}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "Box")
        for v, u in attrs["corners"]:
            if v + attrs["height"] > h or u + attrs["width"] > w:
                raise LayerError(f"box_param: the {attrs['height']} x {attrs['width']} box at row {v}, column {u} "
                                 f"leaves the {h} x {w} bottom (the fork's copy would run into the next rows)")
        return [(n, c, attrs["height"], attrs["width"])] * len(attrs["corners"])

    def forward(self, attrs, params, x):
        boxes = drml_box(x, attrs["corners"], attrs["height"], attrs["width"])
        return boxes if len(boxes) > 1 else boxes[0]   # one top: a tensor, as every spec's single top

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        nchw = legacy_nchw(ctx.shape(x), "Box")
        c = nchw[1]
        if len(ctx.shape(x)) != 4:
            x = ctx.op("Reshape", [x, ctx.i64([-1] + list(nchw[1:]))], "nchw")
        keep = _onnx_planes(ctx, x, c)
        for i, ((v, u), out) in enumerate(zip(a["corners"], node.outputs)):
            window = [ctx.i64([v, u]), ctx.i64([v + a["height"], u + a["width"]]), ctx.i64([2, 3])]
            t = ctx.op("Slice", [x] + window, f"box{i}")
            ctx.add_node("Where", [keep, t, ctx.f32(0.0)], [out], name=f"{node.name}/box{i}")

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(TORCH_PLANES)
        t = emit.tmp("boxes")
        emit.stmt(f"{t} = {emit.helper(TORCH_BOX)}({emit.inputs[0]}, {a['corners']!r}, {a['height']}, {a['width']})")
        tops = [f"{t}[{i}]" for i in range(len(a["corners"]))]
        return tops if len(tops) > 1 else tops[0]


@register_layer("Splice")
class Splice(Layer):
    def parse(self, lp):
        need_blobs(lp, f"Splice ({FORK}'s)", range(1, AT_LEAST), 1, in_place=False)
        return {"name": lp.name, "corners": _corners(lp.splice_param, len(lp.bottom), "splice_param", "Splice")}

    def infer(self, attrs, in_shapes):
        first = legacy_nchw(in_shapes[0], "Splice")
        for i, s in enumerate(in_shapes[1:], 1):
            if legacy_nchw(s, "Splice") != first:
                raise LayerError(f"Splice reads every bottom with bottom 0's shape {list(in_shapes[0])}; bottom {i} "
                                 f"is {list(s)}")
        n, c, h, w = first
        k = len(in_shapes)
        top_h, top_w = int(h * math.sqrt(k)), int(w * math.sqrt(k))   # C++: int * double, truncated
        for v, u in attrs["corners"]:
            if v + h > top_h or u + w > top_w:
                raise LayerError(f"splice_param: the {h} x {w} bottom at row {v}, column {u} leaves the "
                                 f"{top_h} x {top_w} top (int({h} * sqrt({k})) x int({w} * sqrt({k})); the fork's "
                                 f"copy would run into the next rows)")
        attrs["_top_hw"] = (top_h, top_w)
        return [(n, c, top_h, top_w)]

    def forward(self, attrs, params, *bottoms):
        return drml_splice(list(bottoms), attrs["corners"], *attrs["_top_hw"])

    def onnx(self, ctx, node):
        a = node.attrs
        _, c, h, w = legacy_nchw(ctx.shape(node.inputs[0]), "Splice")
        top_h, top_w = a["_top_hw"]
        acc = None
        for i, (x, (v, u)) in enumerate(zip(node.inputs, a["corners"])):
            if len(ctx.shape(x)) != 4:
                x = ctx.op("Reshape", [x, ctx.i64([-1, c, h, w])], f"nchw{i}")
            pads = ctx.i64([0, 0, v, u, 0, 0, top_h - v - h, top_w - u - w])
            padded = ctx.op("Pad", [x, pads], f"pad{i}")
            if acc is None:
                acc = padded
                continue
            region = torch.zeros(1, 1, top_h, top_w, dtype=torch.bool)
            region[:, :, v:v + h, u:u + w] = True
            acc = ctx.op("Where", [ctx.const(region.numpy(), "region"), padded, acc], f"put{i}")
        ctx.add_node("Where", [_onnx_planes(ctx, node.inputs[0], c), acc, ctx.f32(0.0)], [node.outputs[0]],
                     name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_PLANES)
        top_h, top_w = node.attrs["_top_hw"]
        return (f"{emit.helper(TORCH_SPLICE)}([{', '.join(emit.inputs)}], {node.attrs['corners']!r}, "
                f"{top_h}, {top_w})")


@register_layer("Batch")
class DrmlBatch(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, f"Batch ({FORK}'s DRML.prototxt)", 1, 1)
        return {"name": lp.name, "use_global_stats": bool(lp.batch_param.use_global_stats)}

    def why_not_run(self, attrs):
        return (f"{FORK} ships no source for its Batch layer (batch_param use_global_stats, three blobs) and no "
                "fork found declares it; caffeq sizes its top as its bottom but cannot compute it")


@register_layer("MultiSigmoidCrossEntropyLoss")
class MultiSigmoidCrossEntropyLoss(_ScalarLoss):
    def check_shapes(self, in_shapes):
        if count(in_shapes[0]) != count(in_shapes[1]):
            raise LayerError(f"MultiSigmoidCrossEntropyLoss inputs must have the same count, got "
                             f"{list(in_shapes[0])} and {list(in_shapes[1])}")

    def loss(self, attrs, x, target):
        t = target.reshape(x.shape)
        pos = (x >= 0).to(x.dtype)
        # the fork's log(1 + exp(.)), not log1p
        per = x * ((t > 0).to(x.dtype) - pos) - torch.log(1 + torch.exp(x - 2 * x * pos))
        total = -torch.where(t != 0, per, torch.zeros_like(per)).sum()
        return total / (x.shape[0] if x.dim() else 1)


@register_layer("MultilabelImageData")
class MultilabelImageData(ImageData):
    recase_other_spellings = False   # happynear/caffe-windows' MultiLabelImageData is another layer

    def parse(self, lp):
        need_blobs(lp, f"MultilabelImageData ({FORK}'s: tops data[, label])", 0, (1, 2))
        attrs = super().parse(lp)
        if len(lp.top) > 1:
            attrs["label_size"] = positive_field(lp.image_data_param.multilabel_num, "image_data_param.multilabel_num")
        return attrs


__all__ = ["DrmlBatch", "DrmlBox", "MultiSigmoidCrossEntropyLoss", "MultilabelImageData", "Splice"]
