"""dosovits/caffe-fr-chairs's CropSimple (be35a7a crop_simple_layer.cu; its up-convolutional generator nets,
DeePSiM and their image-reconstruction descendants): the centre crop_height x crop_width window of a 4-axis
bottom, offset (H - crop_height) / 2 and (W - crop_width) / 2 in integers.  crop_param's crop_width and
crop_height are required, 1 to the bottom's size.  The fork computes it on the GPU only (its CPU forward
aborts), with a float index: exact below 2^24 bottom elements, which every published net stays under.
"""
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer


@register_layer("CropSimple")
class CropSimple(Layer):
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

    def forward(self, attrs, params, x):
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


__all__ = ["CropSimple"]
