"""YOLO layers from the Caffe conversions of darknet: Reorg and Region (the detection outputs are in
yolo_detection.py).

- Reorg (caffe-yolov2 ports, eric612/MobileNet-YOLO; reorg_param stride, reverse): darknet's
  reorg_cpu, called with the *input's* w, h, c.  Without reverse it is not a plain
  space-to-depth: the fork reads the input buffer as if it were (C/s^2, H*s, W*s) and writes a
  space-to-depth of that into the (C*s^2, H/s, W/s) top, exactly as darknet does.  With
  reverse it is a depth-to-space in DCR order.  C must divide by s^2 (and, without reverse, H and
  W by s): otherwise the fork's loop reads and writes outside its blobs, except that channels
  that do not divide by s^2 (an image under YOLOv5's Focus) are read as Wulingtian/yolov5_caffe's
  Reorg, a plain space-to-depth (caffe_plus.py), with a note.
- Region (lwplw/caffe_yolov2 and the ports behind it; region_param classes, coords,
  boxes_of_each_grid, softmax): the top keeps the bottom's (N, C, H, W) shape but holds the
  channel-last data (N, H, W, boxes, coords + 1 + classes); entry 4 (objectness) goes through the
  logistic and, with softmax, entries 5 .. 5 + classes - 1 through a softmax.  x, y, w, h stay
  raw.  (That fork never reads `softmax` into its flag, an uninitialized bool; every published
  prototxt sets `softmax: true`, which is what is followed here.)
- Region as darknet2caffe writes it (marvis/pytorch-caffe-darknet-convert and its copies:
  region_param anchors as a string, num, softmax, background and darknet's training options):
  darknet's own forward_region_layer, since no Caffe fork runs these files.  The layout is kept;
  per anchor, entries 0 and 1 (x, y) go through the logistic, entry `coords` (objectness) too
  unless background; with softmax the entries from coords + !background to the end get a softmax,
  without it the classes get the logistic.  Unset fields take darknet's defaults (num 1, softmax
  0, classes 20, coords 4).
ONNX: Reorg -> Reshape + SpaceToDepth + Reshape, or DepthToSpace; Region -> Transpose, Slice,
Sigmoid, Softmax, Concat.
"""

import torch

from .caffe_plus import onnx_space_to_depth_crd, space_to_depth_crd
from .registry import (
    Layer,
    LayerError,
    four_axes,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)

# ---- Reorg ------------------------------------------------------------------------------

def darknet_reorg(x, stride: int, reverse: bool):
    """darknet's reorg of an (N, C, H, W) tensor as the Caffe ports call it: without reverse, the
    input read as (C/s^2, H*s, W*s) and space-to-depth'ed into (C*s^2, H/s, W/s) (not a plain
    space-to-depth of the input); with reverse, depth-to-space in DCR order."""
    n, c, h, w = x.shape
    s = stride
    oc = c // (s * s)
    if reverse:
        # top (oc, h*s, w*s)[c2, j*s + dy, i*s + dx] = bottom[(dy*s + dx)*oc + c2, j, i]
        y = x.reshape(n, s, s, oc, h, w).permute(0, 3, 4, 1, 5, 2)
        return y.reshape(n, oc, h * s, w * s)
    # the input read as (oc, h*s, w*s), then top[(dy*s + dx)*oc + c2, j, i] = that[c2, j*s + dy, i*s + dx],
    # the result laid out as (c, h, w) and handed over as (c*s*s, h/s, w/s)
    y = x.reshape(n, oc, h, s, w, s).permute(0, 3, 5, 1, 2, 4)
    return y.reshape(n, c * s * s, h // s, w // s)


@register_layer("Reorg")
class Reorg(Layer):
    def parse(self, lp):
        need_blobs(lp, "Reorg", 1, in_place=False)
        p = lp.reorg_param
        attrs = {"stride": int(p.stride), "reverse": bool(p.reverse), "reading_notes": []}
        if not p.HasField("stride"):
            # MobileNet-YOLO declares no default (a stride of 0 divides by zero there); a file that
            # leaves it out was written for choasup/caffe-yolo9000, whose default is 2
            attrs["stride"] = 2
            attrs["reading_notes"].append("reorg_param sets no stride: 2, caffe-yolo9000's default")
        positive_field(attrs["stride"], "reorg_param.stride")
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        four_axes(s, "Reorg")
        n, c, h, w = s
        st = attrs["stride"]
        attrs["crd"] = not attrs["reverse"] and c % (st * st) != 0
        if c % (st * st) and attrs["reverse"]:
            raise LayerError(f"reorg_param.stride {st}: channels {c} must divide by stride^2 = {st * st}")
        if attrs["reverse"]:
            return [(n, c // (st * st), h * st, w * st)]
        if h % st or w % st:
            raise LayerError(f"reorg_param.stride {st}: height {h} and width {w} must divide by the stride")
        if attrs["crd"]:
            # darknet's reorg divides by c / stride^2 = 0 here; only yolov5_caffe's kernel runs it
            attrs["reading_notes"] = [
                f"channels {c} do not divide by stride^2 = {st * st}, where darknet's reorg cannot run: read "
                f"as Wulingtian/yolov5_caffe's Reorg (YOLOv5's Focus as yolov5_onnx2caffe writes it), a plain "
                f"space-to-depth, top channel c * {st * st} + dy * {st} + dx"]
        return [(n, c * st * st, h // st, w // st)]

    def forward(self, attrs, params, x):
        if attrs["crd"]:
            return space_to_depth_crd(x, attrs["stride"])
        return darknet_reorg(x, attrs["stride"], attrs["reverse"])

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        _, c, h, w = ctx.shape(x)
        s = a["stride"]
        if a["reverse"]:
            ctx.add_node("DepthToSpace", [x], [out], name=node.name, blocksize=s, mode="DCR")
            return
        if a["crd"]:
            onnx_space_to_depth_crd(ctx, node.name, x, out, s)
            return
        read = ctx.add_node("Reshape", [x, ctx.i64([0, c // (s * s), h * s, w * s])],
                            [ctx.tmp(node.name + "_as_read")])[0]
        s2d = ctx.add_node("SpaceToDepth", [read], [ctx.tmp(node.name + "_s2d")], name=node.name, blocksize=s)[0]
        ctx.add_node("Reshape", [s2d, ctx.i64([0, c * s * s, h // s, w // s])], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a["crd"]:
            return f"{emit.helper(space_to_depth_crd)}({emit.inputs[0]}, {a['stride']})"
        fn = emit.helper(TORCH_REORG)
        return f"{fn}({emit.inputs[0]}, {a['stride']}, {emit.lit(a['reverse'])})"


TORCH_REORG = torch_sources(darknet_reorg)


# ---- Region ------------------------------------------------------------------------------

def yolo_region(x, boxes: int, classes: int, softmax: bool):
    """caffe_yolov2's Region: (N, C, H, W) -> the same shape holding (N, H, W, boxes, C / boxes)
    with entry 4 through the logistic and, with softmax, entries 5 .. 5 + classes - 1 through a
    softmax."""
    n, c, h, w = x.shape
    y = x.permute(0, 2, 3, 1).reshape(n, h, w, boxes, c // boxes)
    cls = y[..., 5:5 + classes]
    if softmax:
        cls = torch.softmax(cls, dim=-1)
    y = torch.cat([y[..., :4], torch.sigmoid(y[..., 4:5]), cls, y[..., 5 + classes:]], dim=-1)
    return y.reshape(n, c, h, w)


def darknet_region(x, num: int, coords: int, classes: int, softmax: bool, background: bool):
    """darknet's forward_region_layer on (N, num * (coords + 1 + classes), H, W), layout kept: per
    anchor x, y and (unless background) the objectness through the logistic; with softmax, a
    softmax over the entries from coords + !background on, else the classes through the logistic."""
    n, c, h, w = x.shape
    y = x.reshape(n, num, c // num, h, w)
    pieces = [torch.sigmoid(y[:, :, :2]), y[:, :, 2:coords]]
    if softmax and background:
        pieces.append(torch.softmax(y[:, :, coords:], dim=2))
    else:
        obj = y[:, :, coords:coords + 1]
        pieces.append(obj if background else torch.sigmoid(obj))
        cls = y[:, :, coords + 1:]
        pieces.append(torch.softmax(cls, dim=2) if softmax else torch.sigmoid(cls))
    return torch.cat(pieces, dim=2).reshape(n, c, h, w)


# the fields only darknet2caffe writes: any of them marks darknet's reading of the layer
_DARKNET_REGION_FIELDS = ("anchors", "num", "background", "bias_match", "jitter", "rescore", "object_scale",
                          "noobject_scale", "class_scale", "coord_scale", "absolute", "thresh", "random",
                          "nms_thresh", "tree_thresh", "relative", "box_thresh")


def _darknet_anchors(text):
    """darknet's anchors option, "w0,h0, w1,h1, ...", as floats."""
    values = []
    for item in text.split(","):
        try:
            values.append(float(item))
        except ValueError:
            raise LayerError(f"region_param.anchors: {item.strip()!r} is not a number (expected "
                             f"\"w0,h0, w1,h1, ...\")") from None
    return values


def _parse_darknet_region(p):
    """region_param as darknet2caffe writes it (anchors string, num, darknet's training fields)."""
    if p.HasField("boxes_of_each_grid"):
        raise LayerError("region_param sets both boxes_of_each_grid (caffe_yolov2's Region) and darknet's "
                         "options (anchors, num, ...); a Region is one or the other")
    a = {"flavour": "darknet", "classes": int(p.classes), "coords": int(p.coords), "boxes": int(p.num or 1),
         "softmax": bool(p.softmax), "background": bool(p.background),
         "anchors": _darknet_anchors(p.anchors) if p.HasField("anchors") else []}
    positive_field(a["classes"], "region_param.classes")
    if a["coords"] < 2:
        raise LayerError(f"region_param.coords must be >= 2 (darknet reads x and y first), got {a['coords']}")
    notes = []
    if not p.HasField("softmax"):
        notes.append("region_param sets no softmax: the class scores go through darknet's default, the "
                     "logistic (YOLO v2 cfgs say softmax=1, which some converters leave out)")
    if a["anchors"] and len(a["anchors"]) != 2 * a["boxes"]:
        notes.append(f"region_param.anchors holds {len(a['anchors'])} numbers for num: {a['boxes']} anchors "
                     f"(darknet reads a width and a height per anchor)")
    a["reading_notes"] = notes
    return a


@register_layer("Region")
class Region(Layer):
    def parse(self, lp):
        need_blobs(lp, "Region", 1, in_place=False)
        p = lp.region_param
        if any(p.HasField(f) for f in _DARKNET_REGION_FIELDS):
            return _parse_darknet_region(p)
        a = {"flavour": "caffe_yolov2", "classes": int(p.classes), "coords": int(p.coords),
             "boxes": int(p.boxes_of_each_grid), "softmax": bool(p.softmax)}
        positive_field(a["boxes"], "region_param.boxes_of_each_grid")
        positive_field(a["classes"], "region_param.classes")
        if a["coords"] < 4:
            # the fork reads the objectness at entry 4 and the classes from entry 5, whatever coords says
            raise LayerError(f"region_param.coords must be >= 4 (the layer reads the objectness at entry 4), "
                             f"got {a['coords']}")
        return a

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        four_axes(s, "Region")
        size = attrs["coords"] + attrs["classes"] + 1
        if s[1] != attrs["boxes"] * size:
            boxes = "num" if attrs["flavour"] == "darknet" else "boxes_of_each_grid"
            raise LayerError(f"Region: channels {s[1]} must be {boxes} x (coords + 1 + classes) = "
                             f"{attrs['boxes']} x {size}")
        return [s]

    def forward(self, attrs, params, x):
        if attrs["flavour"] == "darknet":
            return darknet_region(x, attrs["boxes"], attrs["coords"], attrs["classes"], attrs["softmax"],
                                  attrs["background"])
        return yolo_region(x, attrs["boxes"], attrs["classes"], attrs["softmax"])

    def onnx(self, ctx, node):
        if node.attrs["flavour"] == "darknet":
            return self._onnx_darknet(ctx, node)
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        _, c, h, w = ctx.shape(x)
        size = c // a["boxes"]
        name = node.name

        def part(y, lo, hi, hint):
            return ctx.op("Slice", [y, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([-1])], hint)

        t = ctx.op("Transpose", [x], "nhwc", perm=[0, 2, 3, 1], name=name)
        y = ctx.op("Reshape", [t, ctx.i64([0, h, w, a["boxes"], size])], "boxes")
        pieces = [part(y, 0, 4, "xywh"), ctx.op("Sigmoid", [part(y, 4, 5, "obj_raw")], "obj")]
        cls = part(y, 5, 5 + a["classes"], "cls_raw")
        pieces.append(ctx.op("Softmax", [cls], "cls", axis=-1) if a["softmax"] else cls)
        if size > 5 + a["classes"]:
            pieces.append(part(y, 5 + a["classes"], size, "rest"))
        joined = ctx.op("Concat", pieces, "joined", axis=-1)
        ctx.add_node("Reshape", [joined, ctx.i64([0, c, h, w])], [out])

    @staticmethod
    def _onnx_darknet(ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        _, c, h, w = ctx.shape(x)
        num, coords, size = a["boxes"], a["coords"], c // a["boxes"]
        name = node.name

        def part(lo, hi, hint):
            return ctx.op("Slice", [y, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([2])], hint)

        y = ctx.op("Reshape", [x, ctx.i64([0, num, size, h, w])], "anchors", name=name)
        pieces = [ctx.op("Sigmoid", [part(0, 2, "xy_raw")], "xy")]
        if coords > 2:
            pieces.append(part(2, coords, "wh"))
        if a["softmax"] and a["background"]:
            pieces.append(ctx.op("Softmax", [part(coords, size, "cls_raw")], "cls", axis=2))
        else:
            obj = part(coords, coords + 1, "obj_raw")
            pieces.append(obj if a["background"] else ctx.op("Sigmoid", [obj], "obj"))
            cls = part(coords + 1, size, "cls_raw")
            pieces.append(ctx.op("Softmax", [cls], "cls", axis=2) if a["softmax"] else ctx.op("Sigmoid", [cls], "cls"))
        joined = ctx.op("Concat", pieces, "joined", axis=2)
        ctx.add_node("Reshape", [joined, ctx.i64([0, c, h, w])], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a["flavour"] == "darknet":
            return (f"{emit.helper(darknet_region)}({emit.inputs[0]}, {a['boxes']}, {a['coords']}, {a['classes']}, "
                    f"{emit.lit(a['softmax'])}, {emit.lit(a['background'])})")
        fn = emit.helper(TORCH_REGION)
        return f"{fn}({emit.inputs[0]}, {a['boxes']}, {a['classes']}, {emit.lit(a['softmax'])})"


TORCH_REGION = torch_sources(yolo_region)


__all__ = ["Region", "Reorg", "darknet_reorg", "yolo_region"]
