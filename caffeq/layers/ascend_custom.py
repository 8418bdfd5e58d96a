"""Huawei Atlas OMG custom-operator demos: custom_Reduction, custom_Tile, custom_Upsample, custom_Concat,
custom_Exp, custom_Log, custom_Power.

Sources (facts only; every line here is our own):
- huaweiatlas-test/AtkOps 3b01a2c, common/customOp/caffeOp/custom_{Reduction,Tile,Upsample}/:
  plugin/proto/caffe/caffe.proto (the parameter messages), plugin/custom_*_parser.cpp (the fields the
  OMG plugin reads, its shape inference) and operator/custom_*.py (the TBE operator's compute);
- huaweiatlas-test/CustomOperator fbd42b0, caffeOp/custom_{Concat,Exp,Log,Power}/: the same three files.

Each demo caffe.proto puts its message at LayerParameter field 968; here custom_reduction_param keeps 968
and the others are moved (proto/README.md).  OMG holds every blob as 4 axes (a Caffe blob of fewer axes
padded with trailing 1s: InnerProduct's (N, C) is (N, C, 1, 1)); the operators take at most 4 axes.

- custom_Reduction (custom_reduction_param: operation SUM/ASUM/SUMSQ/MEAN [SUM], axis [0], coeff [1]):
  the parser's shape inference turns a negative axis into axis - 2 of the 4-axis blob ("repaired to point
  to the original 2d"), i.e. axis + 2, whatever the blob's own rank; the axes from there on are reduced
  and kept with size 1 (the output has the input's rank; 4 axes out of range are refused).  The operator
  scales before it sums: sum(coeff * x), sum(coeff * |x|), sum(coeff * x * x), or for MEAN
  sum(x * cof) with cof = coeff / count of the reduced axes (in double, used as float32).
  Doubtful: the plugin's TBE build reads axis into a uint32, so its own `axis -= 2` never runs there;
  caffeq follows the shape inference (the output shape the converted model declares).
- custom_Tile (custom_tile_param: axis [1], tiles, unset 0): Caffe's Tile (tf_tile with multiples 1
  except `tiles` on `axis`: the whole block from the axis on, repeated).  The plugin reads axis into a
  uint32, so a negative axis is refused; tiles < 1 is refused as Caffe's Tile does.
- custom_Upsample (custom_upsample_param: scale [1], data_format ["channels_first"]): nearest
  upsampling by the integer scale, top[n, c, h, w] = bottom[n, c, h // scale, w // scale] (darknet's,
  the one-bottom Upsample of vision_forks.py).  The shape inference always gives (N, C, H·scale,
  W·scale); with "channels_last" the operator instead repeats axes 1 and 2 of the same 4-axis memory,
  which the converted model reads as that shape: computed so, a reshape of the (N, C·s, H·s, W) result.
- custom_Concat (custom_concat_param: axis [1]; concat_dim declared but not read by the parser):
  Caffe's Concat along axis (te.lang.cce.concat); axis read into a uint32, so a negative one is refused.
  Doubtful: the plugin's shape inference sums bottom i's dimension i (not its dimension `axis`) into the
  declared top, e.g. 1 + 6 = 7 channels for the demo's (1, 3, 16, 16) and (1, 6, 16, 16); caffeq gives the
  operator's concatenation, 9 channels.
- custom_Exp, custom_Log, custom_Power (custom_{exp,log,power}_param: base [-1] / power [1], scale [1],
  shift [0]): Caffe's Exp, Log and Power (the TBE device APIs DeviceExp, DeviceLog, cc_device_pow with
  the same three parameters; base -1 is e; base <= 0 otherwise is refused as the operators refuse it).
  The Power operator computes exp(power · log(shift + scale · x)) and calls a negative base's result
  meaningless; caffeq gives Caffe's pow there.
"""
from types import SimpleNamespace

import numpy as np

from .activation import Exp, Log, Power, f32
from .misc import ASUM, MEAN, SUM, SUMSQ
from .norm import onnx_reduce
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer
from .shape_ops import Concat, Tile
from .vision_forks import Upsample

#: OMG's blobs: every one held as 4 axes
OM_AXES = 4
OPERATIONS = {SUM: "SUM", ASUM: "ASUM", SUMSQ: "SUMSQ", MEAN: "MEAN"}


def _om_rank(shape, type_name):
    """LayerError for a blob of more axes than OMG's 4."""
    if len(shape) > OM_AXES:
        raise LayerError(f"{type_name}: the Atlas operator takes blobs of at most {OM_AXES} axes, got {list(shape)}")


def _unsigned_axis(axis, field):
    """An axis the plugin reads into a uint32: a negative one is refused."""
    if axis < 0:
        raise LayerError(f"{field} must be >= 0 (the fork's plugin reads it as uint32), got {axis}")
    return axis


# ---- custom_Reduction ------------------------------------------------------------------

def om_reduction_axis(axis):
    """The first reduced axis of the 4-axis OMG blob, as the plugin's shape inference: a negative axis
    is moved 2 further down ("repaired to point to the original 2d"), then counted from the end."""
    a = axis - 2 + OM_AXES if axis < 0 else axis
    if not 0 <= a < OM_AXES:
        raise LayerError(f"custom_reduction_param.axis {axis} out of range: the fork reduces from axis {a} of a "
                         f"{OM_AXES}-axis blob (a negative axis is read as axis - 2)")
    return a


def atlas_reduction(x, first: int, op: int, cof: float):
    """custom_Reduction's operator: the axes from `first` on summed, kept with size 1, after each value
    (its abs for ASUM, its square for SUMSQ) is scaled by cof (op: 1 SUM, 2 ASUM, 3 SUMSQ, 4 MEAN)."""
    if op == 2:
        x = x.abs()
    elif op == 3:
        x = x * x
    if cof != 1:
        x = x * cof
    dims = list(range(first, x.dim()))
    return x.sum(dim=dims, keepdim=True) if dims else x.clone()


@register_layer("custom_Reduction")
class AtlasReduction(Layer):
    def parse(self, lp):
        need_blobs(lp, "custom_Reduction", 1, 1)
        p = lp.custom_reduction_param
        op = int(p.operation)
        if op not in OPERATIONS:
            raise LayerError(f"unknown custom_reduction_param.operation {op}")
        return {"op": op, "axis": int(p.axis), "coeff": f32(p.coeff)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _om_rank(s, "custom_Reduction")
        first = attrs["_axis"] = om_reduction_axis(attrs["axis"])
        size = int(np.prod(s[first:], dtype=np.int64))
        # MEAN: the operator's cof = float(coeff) * size ** -1 in double, multiplied in float32
        attrs["_cof"] = f32(attrs["coeff"] * size ** -1) if attrs["op"] == MEAN and size else attrs["coeff"]
        if attrs["axis"] < 0:
            attrs["reading_notes"] = [
                f"custom_reduction_param.axis {attrs['axis']} read as the fork's plugin does: axis - 2 of the blob "
                f"padded to {OM_AXES} axes, so the axes from {first} on are reduced (kept with size 1)"]
        return [tuple(d if i < first else 1 for i, d in enumerate(s))]

    def forward(self, attrs, params, x):
        return atlas_reduction(x, attrs["_axis"], attrs["op"], attrs["_cof"])

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        if a["op"] == ASUM:
            x = ctx.add_node("Abs", [x], [ctx.tmp(node.name + "_abs")])[0]
        elif a["op"] == SUMSQ:
            x = ctx.add_node("Mul", [x, x], [ctx.tmp(node.name + "_sq")])[0]
        if a["_cof"] != 1:
            x = ctx.add_node("Mul", [x, ctx.const(np.array(a["_cof"], np.float32))], [ctx.tmp(node.name + "_cof")])[0]
        axes = list(range(a["_axis"], len(ctx.shape(node.inputs[0]))))
        if axes:
            onnx_reduce(ctx, "ReduceSum", x, axes, 1, out=out)
        else:
            ctx.add_node("Identity", [x], [out], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(atlas_reduction)
        return f"{fn}({emit.inputs[0]}, {a['_axis']}, {a['op']}, {emit.lit(a['_cof'])})"


# ---- custom_Tile ------------------------------------------------------------------------

@register_layer("custom_Tile")
class AtlasTile(Tile):
    """Caffe's Tile (shape_ops.py), read from custom_tile_param."""

    def parse(self, lp):
        need_blobs(lp, "custom_Tile", 1, 1)
        p = lp.custom_tile_param
        tiles = positive_field(int(p.tiles), "custom_tile_param.tiles")
        return {"axis": _unsigned_axis(int(p.axis), "custom_tile_param.axis"), "tiles": tiles}

    def infer(self, attrs, in_shapes):
        s = list(in_shapes[0])
        _om_rank(s, "custom_Tile")
        if attrs["axis"] >= len(s):
            raise LayerError(f"custom_tile_param.axis {attrs['axis']} out of range for a {len(s)}-axis blob")
        attrs["_axis"] = attrs["axis"]
        s[attrs["axis"]] *= attrs["tiles"]
        return [tuple(s)]


# ---- custom_Upsample --------------------------------------------------------------------

def channels_last_upsample(x, scale: int):
    """custom_Upsample with data_format "channels_last": the 4-axis blob read as (N, H, W, C), axes 1 and 2
    repeated `scale` times each, the result read back as (N, C, H·scale, W·scale), the plugin's shape."""
    n, c, h, w = x.shape
    y = x.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
    return y.reshape(n, c, h * scale, w * scale)


@register_layer("custom_Upsample")
class AtlasUpsample(Upsample):
    """The one-bottom nearest Upsample (vision_forks.py) by custom_upsample_param.scale."""

    def parse(self, lp):
        need_blobs(lp, "custom_Upsample", 1, 1)
        p = lp.custom_upsample_param
        scale = positive_field(int(p.scale), "custom_upsample_param.scale")
        if p.data_format not in ("channels_first", "channels_last"):
            raise LayerError(f"custom_upsample_param.data_format must be channels_first or channels_last, got "
                             f"{p.data_format!r}")
        return {"mask": False, "out": None, "pad_out": (0, 0), "scale": (scale, scale), "value_scale": 1,
                "channels_last": p.data_format == "channels_last"}

    def forward(self, attrs, params, x):
        if attrs["channels_last"]:
            return channels_last_upsample(x, attrs["scale"][0])
        return super().forward(attrs, params, x)

    def onnx(self, ctx, node):
        a = node.attrs
        if not a["channels_last"]:
            super().onnx(ctx, node)
            return
        s = a["scale"][0]
        _n, c, h, w = ctx.shape(node.inputs[0])
        scales = ctx.const(np.array([1, s, s, 1], np.float32))
        empty = "" if ctx.opset >= 13 else ctx.const(np.zeros(0, np.float32))
        up = ctx.add_node("Resize", [node.inputs[0], empty, scales], [ctx.tmp(node.name + "_nhwc")], name=node.name,
                          mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")[0]
        shape = ctx.const(np.array([0, c, h * s, w * s], np.int64))
        ctx.add_node("Reshape", [up, shape], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        if not a["channels_last"]:
            return super().pytorch_source(node, emit)
        return f"{emit.helper(channels_last_upsample)}({emit.inputs[0]}, {a['scale'][0]})"


# ---- custom_Concat ----------------------------------------------------------------------

@register_layer("custom_Concat")
class AtlasConcat(Concat):
    """Caffe's Concat (shape_ops.py) along custom_concat_param.axis."""

    def parse(self, lp):
        if not lp.bottom:
            raise LayerError("custom_Concat needs at least one bottom")
        need_blobs(lp, "custom_Concat", None, 1)
        p = lp.custom_concat_param
        attrs = {"axis": _unsigned_axis(int(p.axis), "custom_concat_param.axis"), "legacy": False}
        if p.HasField("concat_dim"):
            attrs["reading_notes"] = [f"custom_concat_param.concat_dim {p.concat_dim} is not read by the fork's "
                                      f"plugin: the layer joins along axis {attrs['axis']}"]
        return attrs

    def infer(self, attrs, in_shapes):
        for s in in_shapes:
            _om_rank(s, "custom_Concat")
        ndim = max(len(s) for s in in_shapes)
        if attrs["axis"] >= ndim:
            raise LayerError(f"custom_concat_param.axis {attrs['axis']} out of range for a {ndim}-axis blob")
        return super().infer(attrs, in_shapes)


# ---- custom_Exp, custom_Log, custom_Power -----------------------------------------------

class _CustomField:
    """Reads a BVLC neuron spec's parameters from the fork's own message: `field` (custom_exp_param) seen
    as `caffe_field` (exp_param), error messages naming the fork's field."""
    field = caffe_field = None

    def parse_param(self, lp):
        view = SimpleNamespace(**{self.caffe_field: getattr(lp, self.field)})
        try:
            return super().parse_param(view)
        except LayerError as e:
            raise LayerError(str(e).replace(self.caffe_field, self.field)) from None


@register_layer("custom_Exp")
class AtlasExp(_CustomField, Exp):
    """Caffe's Exp: base ^ (shift + scale * x), base -1 meaning e."""
    field, caffe_field = "custom_exp_param", "exp_param"


@register_layer("custom_Log")
class AtlasLog(_CustomField, Log):
    """Caffe's Log: log_base(shift + scale * x), base -1 meaning e."""
    field, caffe_field = "custom_log_param", "log_param"


@register_layer("custom_Power")
class AtlasPower(_CustomField, Power):
    """Caffe's Power: (shift + scale * x) ^ power."""
    field, caffe_field = "custom_power_param", "power_param"

