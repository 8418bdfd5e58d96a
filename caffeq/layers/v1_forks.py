"""Layers of the V1-only forks whose enum names caffeq's V1 upgrade maps to type strings
(caffeq/io/upgrade.py, proto/README.md): DeepLab v1's Padding and MatWrite, DeconvNet's CROP.

- Padding (TheLegendAli/DeepLab-Context padding_layer.cpp, padding_param): pad_beg and pad_end,
  both >= 0 or both <= 0, act on H and W alike: top (N, C, H + pad_beg + pad_end, W + ...),
  top[h, w] = bottom[h - pad_beg, w - pad_beg]; positive values add zeros, negative ones crop
  (DeepLab crops the interpolated scores with -7 / -8).
- MatWrite (DeepLab-Context mat_write_layer.cpp): writes its bottom to .mat files and has no
  top; for inference it is a sink, like Silence.
- CoordMapCrop (HyeonwooNoh/caffe crop_layer.cpp, longjon's FCN CROP): its offsets come from
  the coordinate maps of the whole net, not from parameters; refused with a clear error.
- MultiSoftmax (xiaolonw/caffe-3dnormal_joint_pose 11f5adc multi_softmax_layer.cpp, V1 MULTI_SOFTMAX):
  softmax over the channels at each (n, h, w) of the 4-axis blob (max subtracted, exp, divided by the
  sum), the top (num, channels, height, width); its 2014 Caffe held every blob in 4 axes.
- Cccp (Min Lin's NIN Caffe as s9xie/DSN 065e498 carries it, cccp_layer.cpp; V0 type "cccp", V1 CCCP):
  a grouped 1 x 1 convolution whose num_output counts per group: top (N, group x num_output, H, W);
  weights (group x num_output, C / group) (stored (1, 1, G N, C / G)), bias (G N,) (stored
  (1, 1, 1, G N)); kernel, pad and stride are not read.
"""
import numpy as np
import torch.nn.functional as F

from .common import Silence
from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer
from .segaware import im2col_bottom_conv as grouped_1x1_conv  # NIN's cccp computes the same
from .softmax import Softmax

# ---- Padding -----------------------------------------------------------------------------

@register_layer("Padding")
class Padding(Layer):
    def parse(self, lp):
        need_blobs(lp, "Padding", 1, 1)
        p = lp.padding_param
        beg, end = int(p.pad_beg), int(p.pad_end)
        if not ((beg >= 0 and end >= 0) or (beg <= 0 and end <= 0)):
            raise LayerError(f"padding_param.pad_beg and pad_end must be both >= 0 or both <= 0 "
                             f"(negative values crop), got {beg} and {end}")
        return {"beg": beg, "end": end}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"Padding needs a 4-axis input (N, C, H, W), got {list(s)}")
        grow = attrs["beg"] + attrs["end"]
        if s[2] + grow <= 0 or s[3] + grow <= 0:
            raise LayerError(f"padding_param pad_beg {attrs['beg']} and pad_end {attrs['end']} leave "
                             f"nothing of the {s[2]}x{s[3]} input")
        return [(s[0], s[1], s[2] + grow, s[3] + grow)]

    def forward(self, attrs, params, x):
        b, e = attrs["beg"], attrs["end"]
        return F.pad(x, [b, e, b, e])   # negative amounts crop

    def onnx(self, ctx, node):
        b, e = node.attrs["beg"], node.attrs["end"]
        x, out = node.inputs[0], node.outputs[0]
        if b >= 0 and e >= 0:
            pads = np.array([0, 0, b, b, 0, 0, e, e], np.int64)
            ctx.add_node("Pad", [x, ctx.const(pads, node.name + "_pads")], [out], name=node.name)
            return
        h, w = ctx.shape(x)[2:]
        ctx.add_node("Slice", [x, ctx.const(np.array([-b, -b], np.int64), node.name + "_starts"),
                               ctx.const(np.array([h + e, w + e], np.int64), node.name + "_ends"),
                               ctx.const(np.array([2, 3], np.int64), node.name + "_axes")], [out],
                     name=node.name)

    def pytorch_source(self, node, emit):
        emit.uses("F")
        b, e = node.attrs["beg"], node.attrs["end"]
        return f"F.pad({emit.inputs[0]}, [{b}, {e}, {b}, {e}])"


# ---- MatWrite ------------------------------------------------------------------------------

@register_layer("MatWrite")
class MatWrite(Silence):
    """A sink: DeepLab writes the blob to disk; nothing downstream reads it."""

    def parse(self, lp):
        if len(lp.top):
            raise LayerError(f"MatWrite has no top, got {len(lp.top)}")
        return {}


# ---- DeconvNet / FCN CROP ---------------------------------------------------------------------

@register_layer("CoordMapCrop")
class CoordMapCrop(Layer):
    def parse(self, lp):
        raise LayerError(
            "the V1 CROP layer of DeconvNet / FCN (HyeonwooNoh/caffe crop_layer.cpp) takes its offsets "
            "from the coordinate maps of the layers between its two bottoms, which caffeq does not "
            "compute; replace it with a BVLC Crop layer (layer { type: \"Crop\" crop_param { axis: 2 "
            "offset: K } }) whose offset K is the one the fork computes")


# ---- MultiSoftmax ------------------------------------------------------------------------

@register_layer("MultiSoftmax")
class MultiSoftmax(Softmax):
    """Softmax over axis 1 of the bottom viewed as (num, channels, height, width)."""

    def parse(self, lp):
        need_blobs(lp, "MultiSoftmax", 1, 1)
        return {"axis": 1}

    def infer(self, attrs, in_shapes):
        shape = legacy_nchw(in_shapes[0], "MultiSoftmax")
        attrs["_axis"], attrs["_legacy"] = 1, list(shape)
        return [shape]

    def forward(self, attrs, params, x):
        return super().forward(attrs, params, x.reshape(attrs["_legacy"]))

    def onnx(self, ctx, node):
        shape = ctx.const(np.array(node.attrs["_legacy"], np.int64))
        x = ctx.add_node("Reshape", [node.inputs[0], shape], [ctx.tmp(node.name + "_4d")], name=node.name)[0]
        ctx.add_node("Softmax", [x], [node.outputs[0]], axis=1)

    def pytorch_source(self, node, emit):
        return f"torch.softmax({emit.inputs[0]}.reshape({node.attrs['_legacy']}), 1)"


# ---- NIN's cccp ----------------------------------------------------------------------------

@register_layer("Cccp")
class Cccp(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: 0}

    def parse(self, lp):
        need_blobs(lp, "cccp", 1, 1)
        p = lp.convolution_param
        group = int(p.group)
        if group <= 0 or not p.num_output:
            raise LayerError(f"cccp needs convolution_param.num_output > 0 and group > 0, got {p.num_output} "
                             f"and {group}")
        return {"num_output": int(p.num_output), "group": group, "bias_term": bool(p.bias_term)}

    def blob_names_for(self, attrs):
        return self.blob_names if attrs["bias_term"] else ("weight",)

    def infer(self, attrs, in_shapes):
        s = legacy_nchw(in_shapes[0], "cccp")
        if s[1] % attrs["group"]:
            raise LayerError(f"cccp: {s[1]} input channels do not split into {attrs['group']} groups "
                             f"(the fork's check)")
        attrs["_legacy"] = list(s)
        return [(s[0], attrs["group"] * attrs["num_output"], s[2], s[3])]

    def param_shapes(self, attrs, in_shapes):
        out = attrs["group"] * attrs["num_output"]
        per_group = legacy_nchw(in_shapes[0], "cccp")[1] // attrs["group"]
        return [(out, per_group)] + ([(out,)] if attrs["bias_term"] else [])

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = out_shapes[0]
        return n * c * h * w * (legacy_nchw(in_shapes[0], "cccp")[1] // attrs["group"])

    def forward(self, attrs, params, x):
        return grouped_1x1_conv(x.reshape(attrs["_legacy"]), params[0], params[1] if attrs["bias_term"] else None,
                                attrs["group"])

    def onnx(self, ctx, node):
        a = node.attrs
        x = ctx.op("Reshape", [node.inputs[0], ctx.const(np.array(a["_legacy"], np.int64))], "x4")
        w = ctx.op("Reshape", [ctx.weight(node, 0),
                               ctx.const(np.array([a["group"] * a["num_output"], -1, 1, 1], np.int64))], "w4")
        ins = [x, w] + ([ctx.weight(node, 1)] if a["bias_term"] else [])
        ctx.add_node("Conv", ins, [node.outputs[0]], name=node.name, group=a["group"], kernel_shape=[1, 1])

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.blob_parameters(self.blob_names_for(a))
        bias = f"{m}['bias']" if a["bias_term"] else "None"
        emit.uses("F")
        call = emit.helper(grouped_1x1_conv)
        return f"{call}({emit.inputs[0]}.reshape({a['_legacy']}), {m}['weight'], {bias}, {a['group']})"
