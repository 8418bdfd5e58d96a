"""Xiaomi2008/Caffe_3D_FF (commit 745b97b): 3-D Caffe on 5-axis (N, C, H, W, D) blobs, D innermost.

Sources: src/caffe/proto/caffe.proto, src/caffe/layers/conv_layer.cpp, conv_sk_layer.cpp / .cu,
pooling_layer.cpp / .cu, pooling_sk_layer.cpp / .cu, image_label_data_layer.cpp, include/caffe/blob.hpp.

- Convolution and Pooling with kernel_d / stride_d / pad_d (claimed from BVLC's specs): a 3-D window over the
  axes 2, 3, 4 as (kernel_h, kernel_w, kernel_d).  kernel_size (else kernel_h/w/d), stride (else stride_h/w/d,
  1 each) and pad (else pad_h/w/d, 0 each) as its SetUp reads them.  Convolution: floor((n + 2p - k) / s) + 1,
  weights (num_output, C / group, kh, kw, kd).  Pooling: ceil((n + 2p - k) / s) + 1, one less on an axis whose
  pad is set when its last window starts at or past n + p; MAX from -FLT_MAX over the window clipped to the
  input; AVE as its GPU kernel (the window clipped to n + p divides; its CPU loop clips the start first and
  reuses clipped ends, which differs only with a pad).  kstride is not read by these two layers.
- ConvolutionSK (V1 CONVOLUTION_SK): the kernel dilated by kstride (kstride, else kstride_h/w/d), no pad,
  floor((n - ((k - 1) kstride + 1)) / s) + 1.  num_conv_partition only cuts the im2col buffer into pieces
  (for a batch of more than one item only where the pieces divide the positions: the fork's last piece leaves
  its width for the next items, refused); with group > 1 its partitioned GEMMs mix the groups, so caffeq reads
  group 1 only.  The fork's binary caffemodels number BlobProto's fields otherwise (depth 5, data 6) and its V1
  type numbers clash with BVLC's: its nets are read from their prototxt (weights by the usual shapes).
- PoolingSK (V1 POOLING_SK): MAX over the dilated window (start ph * s, taps every kstride, clipped at the
  input's end), ceil((n - ext) / s) + 1 outputs, no pad.  Its CPU forward has MAX only; its GPU AVE averages
  the dense extended window, which caffeq does not read.
- ImageLabelData (V1 IMAGE_LABEL_DATA, image_label_data_param): 3-D patches (batch, C, crop_h, crop_w, crop_d)
  of Datum records (crop_size for all three), labels (batch, 1, out_label_h, out_label_w, out_label_d) and a
  third top (batch, 1, 1, 1, 1).  C is the records' channel count: 1 is assumed (the fork's EM volumes).
"""
import math

import numpy as np
import torch.nn.functional as F

from .conv import Convolution, check_groups, parse_conv
from .data import DataLayer
from .pooling_nd import POOL_AVE, POOL_MAX, WindowPool3d, first_empty_axis
from .registry import (
    Layer,
    LayerError,
    claim_layers,
    need_blobs,
    needs_input_shape,
    positive_field,
    register_layer,
)

FLT_MAX = 3.4028234663852886e38
_AXES = ("h", "w", "d")


def _has(p, name):
    value = getattr(p, name)
    return len(value) > 0 if not isinstance(value, (int, float)) else p.HasField(name)


def _one(p, name):
    """A field the fork declares as a scalar, repeated in caffeq's message (kernel_size, stride, pad, kstride)."""
    value = getattr(p, name)
    if isinstance(value, (int, float)):
        return int(value)
    if len(value) != 1:
        raise LayerError(f"{name} is given {len(value)} times; Caffe_3D_FF reads one value")
    return int(value[0])


def _triple(p, msg, stem, default, low):
    """(h, w, d) as the fork's plain layers read them: `stem` for all three, else stem_h/_w/_d."""
    name = "kernel_size" if stem == "kernel" else stem
    if _has(p, name):
        values = (_one(p, name),) * 3
    else:
        values = tuple(int(getattr(p, f"{stem}_{a}")) if p.HasField(f"{stem}_{a}") else default for a in _AXES)
    for a, v in zip(_AXES, values):
        if v is None:
            raise LayerError(f"{msg}.{stem}_{a} is required (or {name})")
        if v < low:
            raise LayerError(f"{msg}.{stem}_{a} must be >= {low}, got {v}")
    return values


def _sk_triple(p, msg, stem, default, low):
    """ConvolutionSK / PoolingSK: `stem` or all three of stem_h/_w/_d (their CHECKs), the latter when stem_h is set."""
    name = "kernel_size" if stem == "kernel" else stem
    given = [p.HasField(f"{stem}_{a}") for a in _AXES]
    if any(given) and (_has(p, name) or not all(given)):
        raise LayerError(f"{msg}: give {name} or all of {stem}_h, {stem}_w and {stem}_d")
    if all(given):
        values = tuple(int(getattr(p, f"{stem}_{a}")) for a in _AXES)
    elif _has(p, name):
        values = (_one(p, name),) * 3
    elif default is None:
        raise LayerError(f"{msg}: {name} or {stem}_h, {stem}_w and {stem}_d are required")
    else:
        values = (default,) * 3
    if min(values) < low:
        raise LayerError(f"{msg}.{stem} must be >= {low}, got {list(values)}")
    return values


def _kstride_note(p, msg, layer):
    if _has(p, "kstride") or any(p.HasField(f"kstride_{a}") for a in _AXES):
        return [f"{msg}.kstride*: Caffe_3D_FF's {layer} does not read them (only its _SK layer does)"]
    return []


def _five_axes(shape, what):
    if len(shape) != 5:
        raise LayerError(f"{what} works on 5-axis (N, C, H, W, D) blobs, got {list(shape)}")


# ---- Convolution (kernel_d) and ConvolutionSK ------------------------------------------------------

def _fork_conv_attrs(lp, geometry):
    attrs = parse_conv(lp)
    kernel, stride, pad, dilation = geometry
    attrs.update(kernel=kernel, stride=stride, pad=pad, dilation=dilation, edge_pads=None, _axis=1, _ndim=5)
    return attrs


class _Fork3dConvolution(Convolution):
    def infer(self, attrs, in_shapes):
        for s in in_shapes:
            _five_axes(s, self.types[0])
        check_groups(attrs, in_shapes[0][1])
        return super().infer(attrs, in_shapes)


@claim_layers("Convolution", lambda lp: any(lp.convolution_param.HasField(f) for f in ("kernel_d", "stride_d", "pad_d")))
class Caffe3dConvolution(_Fork3dConvolution):
    """conv_layer.cpp of Caffe_3D_FF: a 3-D convolution over (H, W, D)."""
    types = ("Convolution",)

    def parse(self, lp):
        p, msg = lp.convolution_param, "convolution_param"
        geometry = (_triple(p, msg, "kernel", None, 1), _triple(p, msg, "stride", 1, 1),
                    _triple(p, msg, "pad", 0, 0), (1, 1, 1))
        attrs = _fork_conv_attrs(lp, geometry)
        notes = _kstride_note(p, msg, "Convolution")
        if notes:
            attrs["reading_notes"] = attrs.get("reading_notes", []) + notes
        return attrs


@register_layer("ConvolutionSk")
class ConvolutionSk(_Fork3dConvolution):
    """conv_sk_layer.cpp / .cu: the kernel dilated by kstride, no pad."""

    def parse(self, lp):
        p, msg = lp.convolution_param, "convolution_param"
        kernel = _sk_triple(p, msg, "kernel", None, 1)
        if _sk_triple(p, msg, "pad", 0, 0) != (0, 0, 0):
            raise LayerError("convolution_param.pad: ConvolutionSK takes no pad (pad_h, pad_w and pad_d must be 0)")
        stride = _sk_triple(p, msg, "stride", 1, 1)
        kstride = _sk_triple(p, msg, "kstride", 1, 1)
        attrs = _fork_conv_attrs(lp, (kernel, stride, (0, 0, 0), kstride))
        if attrs["group"] != 1:
            raise LayerError(f"convolution_param.group {attrs['group']}: ConvolutionSK's partitioned forward "
                             f"mixes the groups; caffeq reads group 1 only")
        attrs["partitions"] = positive_field(int(p.num_conv_partition), "convolution_param.num_conv_partition")
        return attrs

    def infer(self, attrs, in_shapes):
        tops = super().infer(attrs, in_shapes)
        volume = math.prod(tops[0][2:])
        if volume < attrs["partitions"]:
            raise LayerError(f"convolution_param.num_conv_partition {attrs['partitions']} exceeds the {volume} output "
                             f"positions; ConvolutionSK divides by zero there")
        piece = volume // attrs["partitions"]
        if (tops[0][0] > 1 or len(in_shapes) > 1) and volume % piece:   # N_ is set once per forward
            # its last partition leaves the member N_ at the remainder for the next items: from item 1 on
            # the fork computes only part of the positions and keeps the rest of the top
            raise LayerError(f"convolution_param.num_conv_partition {attrs['partitions']}: {volume} output positions "
                             f"in pieces of {piece} leave a remainder, and from the second item of a batch (or bottom) on "
                             f"ConvolutionSK computes part of them only (the fork's N_ is not reset); run batch 1, "
                             f"one bottom")
        return tops


# ---- Pooling (kernel_d) and PoolingSK ---------------------------------------------------------------

def _pool_tops(lp, what):
    if len(lp.top) != 1:
        raise LayerError(f"{what}: caffeq reads one top (the argmax mask top is not supported), got {len(lp.top)}")


@claim_layers("Pooling", lambda lp: any(lp.pooling_param.HasField(f) for f in ("kernel_d", "stride_d", "pad_d")))
class Caffe3dPooling(WindowPool3d):
    """pooling_layer.cpp / .cu of Caffe_3D_FF: MAX or AVE over (H, W, D) windows."""
    types = ("Pooling",)

    def parse(self, lp):
        p, msg = lp.pooling_param, "pooling_param"
        need_blobs(lp, "Pooling", 1)
        _pool_tops(lp, "Pooling")
        if p.pool not in (POOL_MAX, POOL_AVE):
            raise LayerError("pooling_param.pool: Caffe_3D_FF's 3-D pooling has MAX and AVE only")
        kernel = _triple(p, msg, "kernel", None, 1)
        stride = _triple(p, msg, "stride", 1, 1)
        pad = _triple(p, msg, "pad", 0, 0)
        for a, k, q in zip(_AXES, kernel, pad):
            if q >= k:
                raise LayerError(f"pooling_param.pad_{a} {q} must be below kernel_{a} {k}")
        notes = _kstride_note(p, msg, "Pooling")
        if p.pool == POOL_AVE and any(pad):
            notes.append("pooling_param: a padded AVE is read as Caffe_3D_FF's GPU kernel; its CPU loop divides "
                         "some windows by another size")
        attrs = {"method": int(p.pool), "kernel": kernel, "stride": stride, "pad": pad}
        if notes:
            attrs["reading_notes"] = notes
        return attrs

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        _five_axes(s, "Pooling with kernel_d")
        out = []
        for n, k, st, q in zip(s[2:], attrs["kernel"], attrs["stride"], attrs["pad"]):
            o = int(math.ceil((n + 2 * q - k) / st)) + 1
            if q and (o - 1) * st >= n + q:
                o -= 1
            out.append(o)
        if min(out) < 1:
            raise LayerError(f"output would be empty for input {list(s)}")
        axis = first_empty_axis(s[2:], attrs["stride"], attrs["pad"], out)
        if axis is not None and attrs["method"] == POOL_AVE:
            raise LayerError(f"the last AVE window of axis {axis + 2} starts past the input; Caffe_3D_FF divides by "
                             f"zero or less there")
        attrs["_out"] = out
        return [tuple(s[:2]) + tuple(out)]

    def windows(self, attrs):
        return list(attrs["kernel"]), list(attrs["stride"]), list(attrs["pad"]), list(attrs["_out"])


def sk_max_pool3d(x, kernel: list[int], stride: list[int], kstride: list[int], out: list[int]):
    """PoolingSK's MAX: windows from o * stride, taps every kstride, cells past the end left out; -FLT_MAX
    where no cell exceeds it."""
    back = []
    for n, k, s, t, o in zip([x.shape[2], x.shape[3], x.shape[4]], kernel, stride, kstride, out):
        back.append(max(0, (o - 1) * s + (k - 1) * t + 1 - n))
    x = F.pad(x, [0, back[2], 0, back[1], 0, back[0]], value=float("-inf"))
    y = F.max_pool3d(x, kernel, stride, dilation=kstride)[:, :, :out[0], :out[1], :out[2]]
    return y.clamp_min(-3.4028234663852886e38)


@register_layer("PoolingSk")
class PoolingSk(Layer):
    """pooling_sk_layer.cpp / .cu: MAX pooling over a kstride-dilated window."""

    def parse(self, lp):
        p, msg = lp.pooling_param, "pooling_param"
        need_blobs(lp, "PoolingSk", 1)
        _pool_tops(lp, "PoolingSK")
        if p.pool != POOL_MAX:
            raise LayerError("pooling_param.pool: caffeq reads PoolingSK's MAX only (its CPU forward has no other; "
                             "its GPU AVE averages the dense extended window)")
        kernel = _sk_triple(p, msg, "kernel", None, 1)
        if _sk_triple(p, msg, "pad", 0, 0) != (0, 0, 0):
            raise LayerError("pooling_param.pad: PoolingSK takes no pad (pad_h, pad_w and pad_d must be 0)")
        return {"kernel": kernel, "stride": _sk_triple(p, msg, "stride", 1, 1),
                "kstride": _sk_triple(p, msg, "kstride", 1, 1)}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        _five_axes(s, "PoolingSK")
        out = [int(math.ceil((n - ((k - 1) * t + 1)) / st)) + 1
               for n, k, st, t in zip(s[2:], attrs["kernel"], attrs["stride"], attrs["kstride"])]
        if min(out) < 1:
            raise LayerError(f"output would be empty for input {list(s)}")
        attrs["_out"] = out
        return [tuple(s[:2]) + tuple(out)]

    def _args(self, attrs):
        return list(attrs["kernel"]), list(attrs["stride"]), list(attrs["kstride"]), list(attrs["_out"])

    def forward(self, attrs, params, x):
        return sk_max_pool3d(x, *self._args(attrs))

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(out_shapes[0]) * math.prod(attrs["kernel"])

    def onnx(self, ctx, node):
        kernel, stride, kstride, out = self._args(node.attrs)
        sizes = ctx.shape(node.inputs[0])[2:]
        back = [max(0, (o - 1) * s + (k - 1) * t + 1 - n) for n, k, s, t, o in zip(sizes, kernel, stride, kstride, out)]
        pads = np.array([0] * 5 + [0, 0] + back, np.int64)
        padded = ctx.add_node("Pad", [node.inputs[0], ctx.const(pads, node.name + "_pads"),
                                      ctx.const(np.array(-FLT_MAX, np.float32))],
                              [ctx.tmp(node.name + "_padded")], name=node.name)[0]
        pooled = ctx.add_node("MaxPool", [padded], [ctx.tmp(node.name + "_pooled")], kernel_shape=kernel,
                              strides=stride, dilations=kstride)[0]
        # an input -inf never wins in Caffe's loop, which starts at -FLT_MAX
        ctx.add_node("Max", [pooled, ctx.const(np.array(-FLT_MAX, np.float32))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(sk_max_pool3d)
        kernel, stride, kstride, out = self._args(node.attrs)
        return f"{fn}({emit.inputs[0]}, {kernel}, {stride}, {kstride}, {out})"


# ---- ImageLabelData ---------------------------------------------------------------------------------

_FORK_DATA_FIELDS = ("source", "scale", "mean_file", "crop_size", "crop_size_h", "crop_size_w", "crop_size_d",
                     "mirror", "rand_patch_times", "out_label_size", "out_label_size_h", "out_label_size_w",
                     "out_label_size_d", "num_memory_datum", "background_class", "background_skip_rate",
                     "label_select_param")


def _is_fork_image_label_data(lp):
    p = lp.image_label_data_param
    return lp.HasField("image_label_data_param") and any(p.HasField(f) for f in _FORK_DATA_FIELDS)


@claim_layers("ImageLabelData", _is_fork_image_label_data)
class Caffe3dImageLabelData(DataLayer):
    """image_label_data_layer.cpp's SetUp: the tops' shapes from image_label_data_param."""
    types = ("ImageLabelData",)

    def parse(self, lp):
        need_blobs(lp, "ImageLabelData", 0, range(1, 4))
        p = lp.image_label_data_param
        if p.HasField("crop_size"):
            crop = (int(p.crop_size),) * 3 if p.crop_size > 0 else None
        else:
            crop = tuple(int(getattr(p, f"crop_size_{a}")) for a in _AXES)
            crop = crop if min(crop) > 0 else None
        if p.HasField("out_label_size"):
            label = (int(p.out_label_size),) * 3
        else:
            label = tuple(int(getattr(p, f"out_label_size_{a}")) for a in _AXES)
        if crop is not None and len(lp.top) > 1 and any(c < q for c, q in zip(crop, label)):
            raise LayerError(f"image_label_data_param: out_label_size {list(label)} exceeds the crop {list(crop)}")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "source": p.source,
                "batch_size": max(1, int(p.batch_size)), "crop": crop, "label": label,
                "mean_file": p.mean_file if p.HasField("mean_file") else None, "scale": float(p.scale),
                "reading_notes": ["image_label_data_param: the records' channel count is not read; 1 is assumed "
                                  "(give --input-shape for another)"]}

    def data_shape(self, attrs):
        if attrs["crop"] is None:
            raise needs_input_shape(attrs, attrs["tops"][0], f"ImageLabelData source '{attrs['source'] or '?'}' is not "
                                    f"read and no crop_size gives the patch", lacking="without its records")
        return (attrs["batch_size"], 1) + attrs["crop"]

    def top_shapes(self, attrs, given):
        data = tuple(given.get(0) or self.data_shape(attrs))
        shapes = [data]
        if attrs["num_tops"] > 1:
            shapes.append(tuple(given.get(1) or (data[0], 1) + attrs["label"]))
        if attrs["num_tops"] > 2:
            shapes.append(tuple(given.get(2) or (data[0], 1, 1, 1, 1)))
        return shapes

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        lines = [f"3-D patches of the Datum records in {attrs['source']!r} (Caffe_3D_FF's ImageLabelData)"]
        if attrs["mean_file"]:
            lines.append(f"minus the mean blob {attrs['mean_file']!r}")
        if attrs["scale"] != 1:
            lines.append(f"times {attrs['scale']}")
        return lines


__all__ = ["Caffe3dConvolution", "Caffe3dImageLabelData", "Caffe3dPooling", "ConvolutionSk", "PoolingSk",
           "sk_max_pool3d"]
