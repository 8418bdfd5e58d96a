"""Layer modules: delftrobotics-forks/caffe's type "Module" and the "mnc" module its MNC nets load.

Sources (read at these commits):
- delftrobotics-forks/caffe, branch layer-modules `7350fe04` (merged into dr-release `85fc6baa`):
  src/caffe/proto/caffe.proto (`LayerParameter.module_param = 147`, `ModuleParameter`: module 1 (required),
  type 2, creator_symbol 3, deleter_symbol 4, param_str 5) and src/caffe/layer_factory.cpp
  (GetLayerModule): a "Module" layer opens the shared library named by `module` from Caffe's layer path and
  creates the layer with the symbol `CreateModule_<type>Layer` (or `creator_symbol`), which is handed the
  whole LayerParameter; the layer reads its own parameters from `param_str`.
- fizyr/dr_mnc_layers `4152923` (CMakeLists.txt builds the library "mnc" installed to lib/caffe/layers):
  src/{roi_warping,mask_resize,mask_pooling,roi_pooling,smooth_L1_loss,sigmoid_cross_entropy_loss}_layer
  .cpp/.cu.  Each LayerSetUp parses param_str as YAML (`YAML::Load`), CHECKs that its keys exist and reads
  them with `as<int>()` / `as<Dtype>()`; keys it does not ask for are not read:
  - ROIWarping: pooled_w, pooled_h (int, > 0), spatial_scale.  Its CUDA forward (the CPU one is
    NOT_IMPLEMENTED) is caffe-mnc's first release (7a28ed65): the max over ceil(size / pooled) + 1 bilinear
    samples a side, caffeq's roi_warping_param.design MAX_OF_SAMPLES (caffeq/layers/mnc.py).
  - MaskResize: output_height, output_width (int, > 0); MaskPooling: no parameter.  Both kernels are
    caffe-mnc's (caffeq/layers/mnc.py's MaskResize and MaskPooling).
  - ROIPooling: pooled_w, pooled_h, spatial_scale; Fast R-CNN's kernel (caffeq's ROIPooling).
  - SigmoidCrossEntropyLoss: no parameter; caffe-mnc's loss (2 bottoms: / num; 3: weighted), caffeq's
    SigmoidCrossEntropyLoss with its defaults.
  - SmoothL1Loss: sigma, stored as sigma2 itself (not squared, unlike Fast R-CNN's); caffeq has no
    SmoothL1Loss spec: a loss, it is read and dropped from inference graphs, never run.

caffeq never loads a library: a Module layer whose module is "mnc" and whose type is one of these is read
by caffeq's spec of that type, its parameters taken from param_str into that spec's fields (param_str is
read by caffeq's safe YAML-mapping reader, caffeq/layers/param_str.py: nothing is evaluated).  The module's
layers read nothing else of the LayerParameter but loss_weight: roi_warping_param, roi_pooling_param,
mask_resize_param and loss_param on a Module layer are dropped (caffe-mnc's SigmoidCrossEntropyLoss divides
by num whatever loss_param's normalization or ignore_label say).  Any other module, type or a
creator_symbol is refused with one line.  Values are read as yaml-cpp's convert<> reads a scalar's text
(a stream with no base set, no leading blank): an int key takes an integer in int's range, a quoted one in
C's bases too ('0x0b', '013' octal); an unquoted integer with a leading 0 (octal to yaml-cpp) is refused; a
float key takes a decimal number in float's range.  A missing key is the module's CHECK.
"""
import math
import re

from ..io.schema import caffe_pb2
from . import losses, mnc, roi_pooling
from .param_str import parse_param_str
from .registry import Layer, LayerError, ReadOnlyLayer, claim_layers, legacy_nchw, need_blobs, register_layer

MODULE = "mnc"
SOURCE = "fizyr/dr_mnc_layers"


#: yaml-cpp's as<int> / as<float>: `stream.unsetf(std::ios::dec) >> std::noskipws >> value`, then only
#: trailing blanks: an int in C's bases (0x hex, a leading 0 octal), a float in decimal
_CXX_INT = re.compile(r"([-+]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)[ \t\n]*")
_CXX_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?[ \t\n]*")
#: an unquoted integer with a leading 0 (octal to yaml-cpp, decimal to caffeq's param_str reader)
_LEADING_ZERO = re.compile(r"(?<![\w.])[-+]?0[0-9]+(?![0-9.eE])")
INT32_MAX, FLT_MAX = 2 ** 31 - 1, 3.4028234663852886e38


def _cxx_number(text, kind):
    """A quoted scalar converted as yaml-cpp converts its text; None where the conversion fails."""
    m = (_CXX_INT if kind is int else _CXX_FLOAT).fullmatch(text)
    if not m:
        return None
    if kind is float:
        return float(text)
    digits = m.group(2)
    base = 16 if digits[:2] in ("0x", "0X") else 8 if digits.startswith("0") and len(digits) > 1 else 10
    value = int(digits[2:] if base == 16 else digits, base)
    return -value if m.group(1) == "-" else value


def _value(params, key, kind, type_name):
    """params[key] read as yaml-cpp's as<int>() / as<float>(); LayerError naming the key."""
    where = f"module_param.param_str of the {MODULE} module's {type_name}"
    if key not in params:
        raise LayerError(f"{where}: '{key}' not found as parameter (the module CHECKs it)")
    v = params[key]
    if isinstance(v, str):   # yaml-cpp converts a scalar by its text, quoted or not
        converted = _cxx_number(v, kind)
        v = v if converted is None else converted
    word = "an integer" if kind is int else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise LayerError(f"{where}: '{key}' must be {word} (yaml-cpp's as<{kind.__name__}>), got {params[key]!r}")
    if kind is int and abs(v) > INT32_MAX:   # the stream's int overflows: as<int> throws
        raise LayerError(f"{where}: '{key}' must be {word} in int's range (yaml-cpp's as<int>), got {v}")
    if kind is float and not (math.isfinite(v) and abs(v) <= FLT_MAX):
        raise LayerError(f"{where}: '{key}' must be a finite float number, got {params[key]!r}")
    return kind(v)


def _pooled(field):
    """pooled_w, pooled_h, spatial_scale from param_str into `field` (roi_warping_param, roi_pooling_param)."""
    def fill(lp, params, type_name):
        p = getattr(lp, field)
        for key in ("pooled_w", "pooled_h"):
            value = _value(params, key, int, type_name)
            if value <= 0:
                raise LayerError(f"module_param.param_str: {key} must be > 0, got {value}")
            setattr(p, key, value)
        p.spatial_scale = _value(params, "spatial_scale", float, type_name)
        if field == "roi_warping_param":   # the module's kernel: caffe-mnc 7a28ed65's max over samples
            p.design = caffe_pb2.ROIWarpingParameter.MAX_OF_SAMPLES
    return fill


def _mask_resize(lp, params, type_name):
    p = lp.mask_resize_param
    for key in ("output_height", "output_width"):
        value = _value(params, key, int, type_name)
        if value <= 0:
            raise LayerError(f"module_param.param_str: {key} must be > 0, got {value}")
        setattr(p, key, value)


def _nothing(lp, params, type_name):
    pass


def module_params(lp):
    """(module, type, param_str mapping) of a Module layer; LayerError for what caffeq cannot read."""
    p = lp.module_param
    if not p.module:
        raise LayerError("Module needs module_param.module (the layer module's library name)")
    if p.creator_symbol:
        raise LayerError(f"module_param.creator_symbol '{p.creator_symbol}': caffeq reads layer modules by "
                         f"module and type only (it never loads a library's symbols)")
    if p.module != MODULE or p.type not in MNC_TYPES:
        raise LayerError(f"module_param: module '{p.module}' type '{p.type}' is not a layer module caffeq "
                         f"knows (only module '{MODULE}', {SOURCE}: {', '.join(sorted(MNC_TYPES))})")
    bare = re.sub(r"'[^']*'|\"[^\"]*\"", "''", p.param_str)
    octal = _LEADING_ZERO.search(bare)
    if octal:
        raise LayerError(f"module_param.param_str: {octal.group(0)!r} has a leading 0, which yaml-cpp reads as an "
                         f"octal integer; caffeq does not read such numbers (write it without the 0)")
    return p.module, p.type, parse_param_str(p.param_str, "module_param.param_str")


def _inner_layer(lp):
    """A copy of the Module layer as the layer of its module type, its fields filled from param_str."""
    _module, type_name, params = module_params(lp)
    inner = caffe_pb2.LayerParameter()
    inner.CopyFrom(lp)
    inner.type = type_name
    inner.ClearField("module_param")
    for field in IGNORED_FIELDS:   # the module's layers read only param_str (and loss_weight): not these
        inner.ClearField(field)
    MNC_TYPES[type_name][1](inner, params, type_name)
    return inner


def _is_mnc(type_name):
    return lambda lp: lp.module_param.module == MODULE and lp.module_param.type == type_name \
        and not lp.module_param.creator_symbol


def _dispatch(type_name, spec_cls):
    """The claim of Module layers of the mnc module's `type_name`: `spec_cls` reading the inner layer."""

    @claim_layers("Module", _is_mnc(type_name))
    class ModuleSpec(spec_cls):
        __doc__ = f"A Module layer of the {MODULE} module's {type_name}, read by caffeq's {spec_cls.__name__}."
        types = ("Module",)

        def parse(self, lp):
            return super().parse(_inner_layer(lp))

    ModuleSpec.__name__ = ModuleSpec.__qualname__ = f"MncModule{type_name}"
    return ModuleSpec


class _SmoothL1(ReadOnlyLayer):
    """The mnc module's SmoothL1Loss: read and sized (a scalar), dropped from inference graphs."""

    is_training_only = True

    def parse(self, lp):
        need_blobs(lp, "the mnc module's SmoothL1Loss", (2, 4), (0, 1),
                   "predictions, targets[, inside weights, outside weights]")
        _module, type_name, params = module_params(lp)
        sigma2 = _value(params, "sigma", float, type_name)
        return {"name": lp.name, "kind": "Module SmoothL1Loss", "sigma2": sigma2, "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        # LossLayer's Reshape: the first two share num; the module's: each other bottom has the first's
        # channels, height and width (legacy 4-D accessors)
        dims = [legacy_nchw(s, "the mnc module's SmoothL1Loss") for s in in_shapes]
        if dims[0][0] != dims[1][0] or any(d[1:] != dims[0][1:] for d in dims[1:]):
            raise LayerError(f"the mnc module's SmoothL1Loss: its bottoms must share channels, height and width "
                             f"(and the first two num), got {[list(s) for s in in_shapes]}")
        return [()] * attrs["tops"]

    def why_not_run(self, attrs):
        return ("the mnc module's SmoothL1Loss (sigma2 = sigma as given, not squared) is a loss caffeq has no "
                "spec for; it only trains")


claim_layers("Module", _is_mnc("SmoothL1Loss"))(_SmoothL1)

#: fields of caffeq's specs that a layer of the module never reads (caffe-mnc's SigmoidCrossEntropyLoss divides
#: by num whatever loss_param says; ROIPooling has no pad_ratio, AVE or score; MaskResize no factors)
IGNORED_FIELDS = ("roi_warping_param", "roi_pooling_param", "mask_resize_param", "loss_param")

#: the mnc module's layer types: caffeq's spec that reads it, and how param_str fills that spec's fields
MNC_TYPES = {
    "ROIWarping": (mnc.ROIWarping, _pooled("roi_warping_param")),
    "MaskResize": (mnc.MaskResize, _mask_resize),
    "MaskPooling": (mnc.MaskPooling, _nothing),
    "ROIPooling": (roi_pooling.ROIPooling, _pooled("roi_pooling_param")),
    "SigmoidCrossEntropyLoss": (losses.SigmoidCrossEntropyLoss, _nothing),
    "SmoothL1Loss": (None, None),   # _SmoothL1 reads it
}

for _type, (_cls, _fill) in MNC_TYPES.items():
    if _cls is not None:
        _dispatch(_type, _cls)


@register_layer("Module")
class Module(Layer):
    """A Module layer no claim reads (another module or type, a creator_symbol): refused in one line."""

    def parse(self, lp):
        module_params(lp)   # raises for every layer that reaches this spec
        raise LayerError(f"module_param: module '{lp.module_param.module}' type '{lp.module_param.type}' "
                         f"cannot be read")
