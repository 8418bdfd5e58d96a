"""Forks' fixed-size crops of a 4-axis bottom: one height x width window, its offsets from the parameters.

- dosovits/caffe-fr-chairs's CropSimple (be35a7a crop_simple_layer.cu; its up-convolutional generator nets,
  DeePSiM and their image-reconstruction descendants): the centre crop_height x crop_width window, offset
  (H - crop_height) / 2 and (W - crop_width) / 2 in integers.  crop_param's crop_width and crop_height are
  required, 1 to the bottom's size.  The fork computes it on the GPU only (its CPU forward aborts), with a
  float index: exact below 2^24 bottom elements, which every published net stays under.
- SSAW14/STD2P's PCrop (01a9b1c manual_crop_layer.cpp/.cu, its FCN-16s RGB-D nets): the pcrop_param h x w
  window whose corner is row x, column y (the proto's "left top point (x, y)" comment notwithstanding, x
  offsets the height axis).  Two bottoms, the second never read (the nets give the same blob twice).  The
  fork checks no bounds and reads past the blob; caffeq refuses a window that does not fit.  Its CPU and
  GPU forwards agree.
"""
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer


class _FixedWindow(Layer):
    """A height x width window at (_top, _left) on axes 2 and 3 of bottom 0; infer sets the offsets."""

    def forward(self, attrs, params, x, *unread):
        top, left = attrs["_top"], attrs["_left"]
        return x[:, :, top:top + attrs["height"], left:left + attrs["width"]]

    def onnx(self, ctx, node):
        a = node.attrs
        starts = [a["_top"], a["_left"]]
        ends = [a["_top"] + a["height"], a["_left"] + a["width"]]
        ctx.add_node("Slice", [node.inputs[0], ctx.i64(starts), ctx.i64(ends), ctx.i64([2, 3])], [node.outputs[0]],
                     name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        return (f"{emit.inputs[0]}[:, :, {a['_top']}:{a['_top'] + a['height']}, "
                f"{a['_left']}:{a['_left'] + a['width']}]")


@register_layer("CropSimple")
class CropSimple(_FixedWindow):
    def parse(self, lp):
        need_blobs(lp, "CropSimple", 1, 1)
        p = lp.crop_param
        for field in ("crop_width", "crop_height"):
            if not lp.HasField("crop_param") or not p.HasField(field):
                raise LayerError(f"CropSimple needs crop_param.{field}")
        return {"height": int(p.crop_height), "width": int(p.crop_width)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "CropSimple")
        if not (0 < attrs["height"] <= h and 0 < attrs["width"] <= w):
            raise LayerError(f"crop_param's crop_height x crop_width ({attrs['height']} x {attrs['width']}) must be "
                             f"1 to the bottom's {h} x {w}")
        attrs["_top"], attrs["_left"] = (h - attrs["height"]) // 2, (w - attrs["width"]) // 2
        return [(n, c, attrs["height"], attrs["width"])]


@register_layer("PCrop")
class PCrop(_FixedWindow):
    def parse(self, lp):
        need_blobs(lp, "PCrop", 2, 1)
        p = lp.pcrop_param
        if p.h < 1 or p.w < 1:
            raise LayerError(f"pcrop_param.h and w (the window's height and width) must be >= 1, got {p.h} and {p.w}")
        return {"height": int(p.h), "width": int(p.w), "_top": int(p.x), "_left": int(p.y)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "PCrop")
        if attrs["_top"] + attrs["height"] > h or attrs["_left"] + attrs["width"] > w:
            raise LayerError(f"pcrop_param's {attrs['height']} x {attrs['width']} window at row x {attrs['_top']}, "
                             f"column y {attrs['_left']} does not fit the bottom's {h} x {w} (the fork would read "
                             "past the blob)")
        return [(n, c, attrs["height"], attrs["width"])]


__all__ = ["CropSimple", "PCrop"]
