"""ZJULearning/SplitNet's CornerCrop (bbf30bf, caffe/src/caffe/layers/corner_crop_layer.cpp / .cu,
caffe/include/caffe/layers/corner_crop_layer.hpp; corner_crop_param in caffe/src/caffe/proto/caffe.proto).

One crop_h x crop_w window of a 4-axis bottom per top, placed by corner_crop_param's position list (one
position per top, in order): with offsets oh = (H - crop_h) / 2 and ow = (W - crop_w) / 2,
  center (row oh, column ow), upperleft (0, 0), upperright (0, 2 ow), lowerleft (2 oh, 0),
  lowerright (2 oh, 2 ow).
crop_size sets both sides, else crop_h and crop_w.  The fork CHECKs H > crop_h, W > crop_w (strictly) and
that H - crop_h and W - crop_w are even, so every window fits and each top is a plain slice.  Its CPU and
GPU forwards copy the same elements.  The fork also accepts five tops with no position, but then reads
positions past the list's end; caffeq refuses that.
"""
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer

FORK = "ZJULearning/SplitNet"
#: position -> (row, column) of the window's corner, in units of the half-margins (oh, ow)
CORNERS = {"center": (1, 1), "upperleft": (0, 0), "upperright": (0, 2), "lowerleft": (2, 0), "lowerright": (2, 2)}


@register_layer("CornerCrop")
class CornerCrop(Layer):
    def parse(self, lp):
        p = lp.corner_crop_param
        positions = list(p.position)
        if len(lp.bottom) != 1:
            raise LayerError(f"CornerCrop ({FORK}) takes one bottom, got {len(lp.bottom)}")
        if not positions or len(lp.top) != len(positions):
            raise LayerError(f"corner_crop_param.position must name one position per top: {len(positions)} "
                             f"positions for {len(lp.top)} tops")
        need_blobs(lp, "CornerCrop", 1, len(positions))
        unknown = [s for s in positions if s not in CORNERS]
        if unknown:
            raise LayerError(f"corner_crop_param.position {unknown[0]!r} is not one of {', '.join(CORNERS)}")
        if p.HasField("crop_size"):
            side = (int(p.crop_size), int(p.crop_size))
        else:
            side = (int(p.crop_h), int(p.crop_w))
        if min(side) < 1:
            raise LayerError(f"corner_crop_param: crop_size (or crop_h and crop_w) must be >= 1, got "
                             f"{side[0]} x {side[1]}")
        return {"crop": side, "positions": positions}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "CornerCrop")
        ch, cw = attrs["crop"]
        if not (h > ch and w > cw) or (h - ch) % 2 or (w - cw) % 2:
            raise LayerError(f"corner_crop_param: the {ch} x {cw} crop must be smaller than the bottom's {h} x {w} "
                             f"by an even number of rows and columns (the fork's CHECKs)")
        oh, ow = (h - ch) // 2, (w - cw) // 2
        attrs["_corners"] = [(r * oh, k * ow) for r, k in (CORNERS[s] for s in attrs["positions"])]
        return [(n, c, ch, cw)] * len(attrs["positions"])

    def forward(self, attrs, params, x):
        ch, cw = attrs["crop"]
        return [x[:, :, r:r + ch, k:k + cw] for r, k in attrs["_corners"]]

    def onnx(self, ctx, node):
        ch, cw = node.attrs["crop"]
        for (r, k), out in zip(node.attrs["_corners"], node.outputs):
            ctx.add_node("Slice", [node.inputs[0], ctx.i64([r, k]), ctx.i64([r + ch, k + cw]), ctx.i64([2, 3])],
                         [out], name=node.name)

    def pytorch_source(self, node, emit):
        ch, cw = node.attrs["crop"]
        return [f"{emit.inputs[0]}[:, :, {r}:{r + ch}, {k}:{k + cw}]" for r, k in node.attrs["_corners"]]


__all__ = ["CornerCrop"]
