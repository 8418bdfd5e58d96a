"""Convolution, Deconvolution, InnerProduct and the depthwise-convolution forks."""
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ExportError
from .edge_pads import onnx_pads, read_edge_pads, resolve_edge_pads
from .happynear import FORK_EPS, onnx_unit_rows, unit_rows
from .limuhit_cmp import (  # limuhit's trimmed convolution (convolution_param.constrain): a weight mask
    TORCH_TRIMMED_CONV,
    check_constrain,
    onnx_trimmed_weight,
    parse_constrain,
    trimmed_weight,
    zero_trimmed_taps,
)
from .orn import check_arf, conv_orientations, onnx_arf_weight, source_conv_class, torch_arf_weight
from .registry import (
    Layer,
    LayerError,
    canonical_axis,
    claim_layers,
    count,
    need_blobs,
    positive_field,
    register_layer,
    spatial_params,
    torch_sources,
)

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_DECONV = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def parse_conv(lp, depthwise=False):
    p = lp.convolution_param
    if depthwise:
        return _parse_sp2823(lp)
    if not p.HasField("num_output"):
        raise LayerError("convolution_param.num_output is required")
    if p.num_output < 1:   # base_conv_layer.cpp's CHECK_GT(num_output_, 0)
        raise LayerError(f"convolution_param.num_output must be positive, got {p.num_output} (DeepDetect's templates "
                         f"write 0 for the service to set to the number of classes: load the net with a caffemodel "
                         f"that holds this layer's weights, whose shape gives it)")
    attrs = {
        "num_output": int(p.num_output),
        "bias_term": bool(p.bias_term),
        "group": int(p.group),
        "axis": int(p.axis),
        "param": p,  # spatial fields are read once the number of spatial axes is known
        "depthwise": False,
        "orn": conv_orientations(lp),   # MhLiao/RRD's active rotating filters (orn.py), or None
    }
    positive_field(attrs["group"], "convolution_param.group")
    # Cambricon's DeconvolutionLayer reads the fields too but its forward never applies them
    pre, notes = parse_first_conv(p) if lp.type != "Deconvolution" else (None, [])
    if pre is not None:
        attrs["first_conv"] = pre
    if "NNPACK" in p.Engine.keys() and p.engine == p.NNPACK and _nnpack_differs(p):
        notes = [*notes, "convolution_param.engine NNPACK: fengggli/caffe's CPU mode runs a stride-1 convolution "
                         "with a bias through NNPACK, which ignores group and dilation; caffeq computes Caffe's "
                         "convolution (the fork's GPU mode)"]
    if p.mask:
        notes = [*notes, "convolution_param.mask (scott89/caffe, STCT): a random spatial mask of the top applied "
                         "in the TRAIN forward only; the TEST forward caffeq runs is the plain convolution"]
    if notes:
        attrs["reading_notes"] = notes
    return attrs


def _nnpack_differs(p):
    """fengggli/caffe nnpack_convolution_layer.cpp takes the NNPACK path (group and dilation unread) for a
    biased convolution of stride 1; elsewhere it falls back to Caffe's."""
    strides = list(p.stride) + ([p.stride_h, p.stride_w] if p.HasField("stride_h") else [])
    return p.bias_term and all(s == 1 for s in strides) and (p.group > 1 or any(d > 1 for d in p.dilation))


def parse_first_conv(p):
    """Cambricon/caffe's "first conv" (base_conv_layer.cpp SetMean, conv_layer.cpp Forward_cpu,
    commit eadcc46d): with mean_value, std or scale set, every bottom becomes (x - mean[c]) * std
    (else * scale, else unscaled) before the convolution; mean 0 without mean_value.  Returns
    (the {"mean", "mul"} dict or None, reading notes).  The fork also writes the preprocessed values
    back into the bottom blob; caffeq leaves the bottom as it was."""
    if "mean_value" not in p.DESCRIPTOR.fields_by_name:
        return None, []
    if p.same_mode:
        raise LayerError("convolution_param.same_mode (Cambricon's TensorFlow-style SAME padding) is not "
                         "supported")
    if p.HasField("mean_file"):
        raise LayerError("convolution_param.mean_file (Cambricon's first-conv mean image) is not read; give "
                         "the per-channel means as mean_value")
    has_std, has_scale = p.HasField("std"), p.HasField("scale")
    if not (len(p.mean_value) or has_std or has_scale):
        return None, []
    notes = []
    if has_std and has_scale:
        notes.append("convolution_param sets both std and scale: Cambricon's first conv multiplies by std")
    if p.input_format != p.BGR:
        notes.append(f"convolution_param.input_format {p.InputFormat.Name(p.input_format)} only reorders "
                     f"channels on Cambricon's MLU; its CPU forward, followed here, ignores it")
    mul = float(p.std) if has_std else float(p.scale) if has_scale else None
    return {"mean": [float(v) for v in p.mean_value], "mul": mul}, notes


def first_conv_input(x, mean: list[float], mul: float | None, rgb0: bool = False):
    """Cambricon's first-conv preprocessing of an (N, C, H, W) bottom: (x - mean[c]) * mul, the
    mean's first C values (all 0 when it is empty).  rgb0: a 4-channel RGB0 bottom (MLUYUVtoRGB's) whose
    3-channel BGR filters ArrangeWeightRGB turns into [W2, W1, W0, 0]: the same as the first three channels,
    preprocessed, in reverse order through the stored filters."""
    if rgb0:
        x = x[:, :3]
    c = x.shape[1]
    if mean:
        x = x - torch.tensor(mean[:c], dtype=x.dtype, device=x.device).reshape(1, c, 1, 1)
    x = x if mul is None else x * mul
    return x.flip(1) if rgb0 else x


def _check_first_conv(attrs, in_shape):
    pre = attrs.get("first_conv")
    if pre is None:
        return
    if len(in_shape) != 4 or attrs["_axis"] != 1:
        raise LayerError(f"Cambricon's first-conv preprocessing (mean_value / std / scale) needs a 4-D "
                         f"(N, C, H, W) bottom with axis 1, got {list(in_shape)}")
    # MLUYUVtoRGB's RGB0 image into 3-channel filters (Cambricon's ArrangeWeightRGB); mean_value(3) then
    # reads past the field, a value that only meets the zero weights of the 0 channel
    pre.pop("rgb0", None)
    if in_shape[1] == 4 and len(pre["mean"]) == 3 and attrs["group"] == 1:
        pre["rgb0"] = True
    if pre["mean"] and len(pre["mean"]) < in_shape[1] and not pre.get("rgb0"):
        raise LayerError(f"convolution_param.mean_value has {len(pre['mean'])} values for {in_shape[1]} input "
                         f"channels (Cambricon reads one per channel)")


def resolve_geometry(attrs, in_shape):
    """Fill axis, kernel, stride, pad and dilation from attrs["param"] (a ConvolutionParameter) once
    the input rank is known, as BaseConvolutionLayer and Im2colLayer::LayerSetUp read them.
    Returns False when they were already filled for this rank."""
    if "kernel" in attrs and attrs.get("_ndim") == len(in_shape):
        return False
    if attrs.get("depthwise"):
        return _sp2823_geometry(attrs, in_shape)
    p = attrs["param"]
    axis = canonical_axis(attrs["axis"], len(in_shape), "convolution_param.axis")
    nsp = len(in_shape) - axis - 1
    if nsp < 1:
        raise LayerError(f"input shape {list(in_shape)} has no spatial axes after axis {axis}")
    attrs["_axis"] = axis
    attrs["_ndim"] = len(in_shape)
    attrs["kernel"] = spatial_params(p, nsp, "kernel_size", None, min_value=1, pair_required=False) \
        if (p.kernel_size or p.HasField("kernel_h") or p.HasField("kernel_w")) else _missing("kernel_size")
    attrs["stride"] = spatial_params(p, nsp, "stride", 1, min_value=1, pair_required=False)
    attrs["pad"] = spatial_params(p, nsp, "pad", 0, min_value=0, pair_required=False)
    attrs["dilation"] = _conv_dilation(p, nsp, attrs["kernel"])
    holes = _hole_dilation(p, nsp)
    if holes is not None:
        attrs["dilation"] = holes
    # synopsys-caffe pad_type / pad_l/r/t/b (edge_pads.py); None keeps Caffe's symmetric pad
    attrs["edge_pads"] = read_edge_pads(p, nsp, "convolution_param")
    return True


def _conv_dilation(p, nsp, kernel):
    """BVLC's base_conv_layer.cpp takes any dilation, 0 included.  On an axis of kernel 1 dilation 0
    reads the same pixel as dilation 1 (UberNet's ASPP template writes its no-hole branch so); on a wider
    kernel every tap would read one pixel, which caffeq refuses."""
    dilation = spatial_params(p, nsp, "dilation", 1, allow_hw=False, min_value=0)
    if any(d == 0 and k != 1 for d, k in zip(dilation, kernel)):
        raise LayerError(f"convolution_param.dilation 0 with kernel_size {list(kernel)}: Caffe's im2col would read "
                         f"every tap of the window at one pixel; caffeq takes dilation 0 only where the kernel is 1")
    return tuple(1 if d == 0 else d for d in dilation)


def conv_edge_pads(attrs, hw):
    """[left, right, top, bottom] for F.pad when the layer pads per side, else None."""
    return resolve_edge_pads(attrs.get("edge_pads"), hw, attrs["kernel"], attrs["stride"], attrs["dilation"])


def _parse_sp2823(lp):
    """sp2823's ConvolutionDepthwise (BVLC PR #5665, conv_dw_layer.cpp): one k x k filter per input
    channel.  num_output, group and axis are never read: top and weights follow the input channels."""
    need_blobs(lp, "ConvolutionDepthwise", 1, 1)
    p = lp.convolution_param
    return {"num_output": None, "group": None, "axis": 1, "bias_term": bool(p.bias_term),
            "param": p, "depthwise": True}


def _sp2823_pair(p, name, default):
    """(h, w) as conv_dw_layer.cpp's LayerSetUp reads them: name_h and name_w when both are set,
    else the repeated field's first value for both or its first two.  An empty list is read out of
    range there; caffeq takes BVLC's default instead (stride 1, pad 0, dilation 1)."""
    stem = "kernel" if name == "kernel_size" else name
    if name != "dilation" and p.HasField(f"{stem}_h") and p.HasField(f"{stem}_w"):
        values = (int(getattr(p, f"{stem}_h")), int(getattr(p, f"{stem}_w")))
    else:
        rep = [int(v) for v in getattr(p, name)]
        if not rep:
            if default is None:
                raise LayerError(f"convolution_param.{name} is required")
            rep = [default]
        values = (rep[0], rep[0]) if len(rep) == 1 else (rep[0], rep[1])
    return values


def _sp2823_geometry(attrs, in_shape):
    if len(in_shape) != 4:
        raise LayerError(f"ConvolutionDepthwise works on 4-D (N, C, H, W) input, got {list(in_shape)}")
    p = attrs["param"]
    attrs["_axis"], attrs["_ndim"] = 1, 4
    for key, name, default, low in (("kernel", "kernel_size", None, 1), ("stride", "stride", 1, 1),
                                    ("pad", "pad", 0, 0), ("dilation", "dilation", 1, 1)):
        values = _sp2823_pair(p, name, default)
        if min(values) < low:
            raise LayerError(f"convolution_param.{name} must be >= {low}, got {list(values)}")
        attrs[key] = values
    channels = in_shape[1]
    if channels < 1:
        raise LayerError(f"input shape {list(in_shape)} has no channels")
    attrs["num_output"] = attrs["group"] = channels
    return True


def _hole_dilation(p, nsp):
    """The filter's dilation under an older name, the effective kernel being k + (k - 1)(d - 1):
    DeepLab v1's `hole` / `hole_h` + `hole_w` (TheLegendAli/DeepLab-Context conv_layer.cpp),
    ParseNet's `filter_stride` / `filter_stride_h` + `filter_stride_w` (weiliu89/caffe fcn,
    base_conv_layer.cpp) or naibaf7/caffe's `kstride` (one or one per axis) / `kstride_h` + `kstride_w`
    (its 2015 strided-kernel convolution, 677e8440).  None when the layer names none."""
    declared = p.DESCRIPTOR.fields_by_name
    found = None
    for name, owner in (("hole", "DeepLab's"), ("filter_stride", "ParseNet's"), ("kstride", "naibaf7/caffe's")):
        if name not in declared:
            continue
        h, w = f"{name}_h", f"{name}_w"
        repeated = declared[name].is_repeated   # naibaf7's kstride: one per axis
        has_one = len(getattr(p, name)) > 0 if repeated else p.HasField(name)
        has_hw = p.HasField(h) or p.HasField(w)
        if not (has_one or has_hw):
            continue
        if found is not None:
            raise LayerError("give one of DeepLab's hole, ParseNet's filter_stride and naibaf7/caffe's kstride")
        if len(p.dilation):
            raise LayerError(f"give either convolution_param.dilation or {owner} {name}, not both")
        if has_hw and (has_one or not (p.HasField(h) and p.HasField(w))):
            raise LayerError(f"give convolution_param.{name}, or both {h} and {w}")
        if has_one:
            given = [int(v) for v in getattr(p, name)] if repeated else [int(getattr(p, name))]
            values = tuple(given) * nsp if len(given) == 1 else tuple(given)
        else:
            values = (int(getattr(p, h)), int(getattr(p, w)))
        if len(values) != nsp:
            raise LayerError(f"{h}/{w} only work for 2-D data, this input has {nsp} spatial axes")
        if min(values) < 1:
            raise LayerError(f"convolution_param.{name} must be >= 1, got {list(values)}")
        found = values
    return found


def check_groups(attrs, channels):
    """Caffe's group checks: input channels and num_output both divisible by group."""
    if channels % attrs["group"]:
        raise LayerError(f"input channels {channels} not divisible by group {attrs['group']}")
    if attrs["num_output"] % attrs["group"]:
        raise LayerError(f"num_output {attrs['num_output']} not divisible by group {attrs['group']}")


def _resolve_spatial(attrs, in_shape):
    """Geometry, then the convolution's own checks (depthwise group, channels by group)."""
    if not resolve_geometry(attrs, in_shape):
        return
    channels = in_shape[attrs["_axis"]]
    check_groups(attrs, channels)
    if attrs.get("orn"):
        check_arf(attrs, channels)
    _check_first_conv(attrs, in_shape)


def _missing(field):
    raise LayerError(f"convolution_param.{field} is required")


def _conv_nd(x, attrs, weight, bias, transposed):
    axis = attrs["_axis"]
    nsp = len(attrs["kernel"])
    lead = x.shape[:axis]
    if axis != 1:  # merge leading axes into the batch, as Caffe's num = count(0, axis)
        x = x.reshape((-1,) + tuple(x.shape[axis:]))
    if nsp not in _CONV:
        raise LayerError(f"{nsp}-D convolution is not supported by torch")
    pads = conv_edge_pads(attrs, x.shape[-2:])
    if pads is not None:
        # padded here: the convolution itself then runs with pad 0
        return _conv_nd(F.pad(x, pads), dict(attrs, edge_pads=None), weight, bias, transposed)
    if transposed:
        y = _DECONV[nsp](x, weight, bias, stride=attrs["stride"], padding=attrs["pad"],
                         groups=attrs["group"], dilation=attrs["dilation"])
    else:
        y = _CONV[nsp](x, weight, bias, stride=attrs["stride"], padding=attrs["pad"],
                       groups=attrs["group"], dilation=attrs["dilation"])
    if axis != 1:
        y = y.reshape(tuple(lead) + tuple(y.shape[1:]))
    return y


def conv_out_size(size, k, s, p, d):
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def deconv_out_size(size, k, s, p, d):
    return s * (size - 1) + d * (k - 1) + 1 - 2 * p


def _conv_top_shapes(attrs, in_shapes, out_size):
    """Top shapes of (de)convolution; out_size(size, kernel, stride, pad, dilation) gives one spatial extent."""
    s = in_shapes[0]
    _resolve_spatial(attrs, s)
    ax = attrs["_axis"]
    pads = conv_edge_pads(attrs, s[-2:])
    if pads is not None:
        if out_size is deconv_out_size:
            raise LayerError("pad_type / pad_l/r/t/b are read for Convolution only, not Deconvolution")
        l, r, t, b = pads
        s = tuple(s[:-2]) + (s[-2] + t + b, s[-1] + l + r)
        if min(s[-2:]) < 0:
            raise LayerError(f"pad_l/r/t/b crop more than the input {list(in_shapes[0])}")
    spatial = [out_size(n, k, st, p, d) for n, k, st, p, d in
               zip(s[ax + 1:], attrs["kernel"], attrs["stride"], attrs["pad"], attrs["dilation"])]
    if any(v <= 0 for v in spatial):
        raise LayerError(f"output would be empty: input {list(s)}, kernel {list(attrs['kernel'])}")
    # one top per bottom
    return [tuple(s[:ax]) + (attrs["num_output"],) + tuple(spatial)] * len(in_shapes)


def _onnx_conv(ctx, node, op, inputs=None, outputs=None):
    """One ONNX op (Conv or ConvTranspose) per bottom, all with the layer's filters.  inputs /
    outputs replace the node's own: preprocessed bottoms (Cambricon's first conv), or tops that a
    later node finishes (NdConvolution squeezes its extents of 1)."""
    a = node.attrs
    if a["_axis"] != 1:
        raise ExportError(f"layer '{node.name}': convolution over axis {a['_axis']} has no ONNX form here")
    w = onnx_trimmed_weight(ctx, node, ctx.weight(node, 0))
    if a.get("orn"):
        c = ctx.shape(node.inputs[0])[1]
        w = onnx_arf_weight(ctx, node, w, (a["num_output"], c) + tuple(a["kernel"]))
    b = [ctx.weight(node, 1)] if a["bias_term"] else []
    # Caffe applies the same filters to each bottom (one top per bottom)
    pads = conv_edge_pads(a, ctx.shape(node.inputs[0])[-2:])
    pads = list(a["pad"]) * 2 if pads is None else onnx_pads(pads, f"layer '{node.name}'")
    for i, (x, y) in enumerate(zip(inputs or node.inputs, outputs or node.outputs)):
        ctx.add_node(op, [x, w] + b, [y], name=node.name if i == 0 else f"{node.name}_{i}",
                     kernel_shape=list(a["kernel"]), strides=list(a["stride"]), pads=pads,
                     dilations=list(a["dilation"]), group=a["group"])


def _torch_conv_source(node, emit, transposed, inputs=None):
    """nn.Conv{1,2,3}d / nn.ConvTranspose{1,2,3}d: the F.conv* call of _conv_nd, same arguments."""
    a = node.attrs
    inputs = inputs or emit.inputs
    nsp = len(a["kernel"])
    if a["_axis"] != 1:
        raise LayerError(f"convolution over axis {a['_axis']} has no torch.nn module (only axis 1)")
    if nsp not in _CONV:
        raise LayerError(f"{nsp}-D convolution has no torch.nn module")
    channels = 3 if a.get("first_conv", {}).get("rgb0") else emit.in_shape(0)[1]   # Cambricon's RGB0 input
    args = [emit.lit(channels), emit.lit(a["num_output"]),
            f"kernel_size={emit.size_arg(a['kernel'])}"]
    for name, values, default in (("stride", a["stride"], 1), ("padding", a["pad"], 0),
                                  ("dilation", a["dilation"], 1)):
        if any(v != default for v in values):
            args.append(f"{name}={emit.size_arg(values)}")
    if a["group"] != 1:
        args.append(f"groups={a['group']}")
    if not a["bias_term"]:
        args.append("bias=False")
    kind = "ConvTranspose" if transposed else "Conv"
    if a.get("orn"):   # RRD's active rotating filters: nn.Conv2d rotating its weight (orn.py)
        m = emit.module(f"{source_conv_class(emit)}({', '.join(args)}, orientations={a['orn']})")
    elif a.get("constrain"):   # limuhit's trimmed convolution: nn.Conv2d masking its weight (limuhit_cmp.py)
        m = emit.module(f"{emit.helper(TORCH_TRIMMED_CONV)}({', '.join(args)}, constrain={a['constrain']})")
    else:
        m = emit.module(f"nn.{kind}{nsp}d({', '.join(args)})")
    emit.param("weight", 0)
    if a["bias_term"]:
        emit.param("bias", 1)
    pads = conv_edge_pads(a, emit.in_shape(0)[-2:])
    if pads is not None:  # synopsys-caffe per-side padding: F.pad, then the pad-0 module
        emit.uses("F")
        calls = [f"{m}(F.pad({x}, {pads}))" for x in inputs]
        return calls[0] if len(calls) == 1 else calls
    # Caffe runs the same filters over each bottom, one top per bottom
    calls = [f"{m}({x})" for x in inputs]
    return calls[0] if len(calls) == 1 else calls


# yonghenglh6's / eric612's DepthwiseConvolution is a BaseConvolutionLayer with a faster kernel:
# num_output and group are read and checked as for Convolution (depthwise_conv_layer.cpp).
# HoleConvolution (hole_conv_layer.cpp of the forks that keep DeepLab's layer beside Convolution, e.g.
# yangguorun/SegStereo 717f590): the convolution with convolution_param.hole as its dilation
@register_layer("Convolution", "DepthwiseConvolution", "HoleConvolution")
class Convolution(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: 0}
    depthwise = False

    def parse(self, lp):
        return parse_conv(lp, self.depthwise)

    def infer(self, attrs, in_shapes):
        return _conv_top_shapes(attrs, in_shapes, conv_out_size)

    def param_shapes(self, attrs, in_shapes):
        _resolve_spatial(attrs, in_shapes[0])
        c = 3 if attrs.get("first_conv", {}).get("rgb0") else in_shapes[0][attrs["_axis"]]
        shapes = [(attrs["num_output"], c // attrs["group"]) + attrs["kernel"]]
        check_constrain(attrs, shapes[0])
        if attrs["bias_term"]:
            shapes.append((attrs["num_output"],))
        return shapes

    def forward(self, attrs, params, *xs):
        bias = params[1] if attrs["bias_term"] else None
        pre = attrs.get("first_conv")
        if pre is not None:
            xs = [first_conv_input(x, pre["mean"], pre["mul"], pre.get("rgb0", False)) for x in xs]
        weight = torch_arf_weight(params[0], attrs["orn"]) if attrs.get("orn") else trimmed_weight(attrs, params[0])
        ys = [_conv_nd(x, attrs, weight, bias, False) for x in xs]
        return ys[0] if len(ys) == 1 else tuple(ys)

    def macs(self, attrs, in_shapes, out_shapes):
        channels = 3 if attrs.get("first_conv", {}).get("rgb0") else in_shapes[0][attrs["_axis"]]
        k = math.prod(attrs["kernel"]) * channels // attrs["group"]
        return sum(count(o) * k for o in out_shapes)

    def onnx(self, ctx, node):
        pre = node.attrs.get("first_conv")
        inputs = None
        if pre is not None:
            inputs = []
            for i, x in enumerate(node.inputs):
                c = ctx.shape(x)[1]
                if pre.get("rgb0"):
                    x = ctx.add_node("Slice", [x, ctx.i64([0]), ctx.i64([3]), ctx.i64([1])],
                                     [ctx.tmp(f"{node.name}_rgb{i}")])[0]
                    c = 3
                if pre["mean"]:
                    mean = ctx.const(np.array(pre["mean"][:c], np.float32).reshape(1, c, 1, 1))
                    x = ctx.add_node("Sub", [x, mean], [ctx.tmp(f"{node.name}_centred{i}")])[0]
                if pre["mul"] is not None:
                    x = ctx.add_node("Mul", [x, ctx.const(np.array(pre["mul"], np.float32))],
                                     [ctx.tmp(f"{node.name}_scaled{i}")])[0]
                if pre.get("rgb0"):   # RGB into the BGR filters
                    x = ctx.add_node("Gather", [x, ctx.i64([2, 1, 0])], [ctx.tmp(f"{node.name}_bgr{i}")], axis=1)[0]
                inputs.append(x)
        _onnx_conv(ctx, node, "Conv", inputs)

    def pytorch_source(self, node, emit):
        pre = node.attrs.get("first_conv")
        inputs = None
        if pre is not None:
            fn = emit.helper(TORCH_FIRST_CONV)
            rgb0 = ", rgb0=True" if pre.get("rgb0") else ""
            inputs = [f"{fn}({x}, {emit.lit(pre['mean'])}, {emit.lit(pre['mul'])}{rgb0})" for x in emit.inputs]
        return _torch_conv_source(node, emit, transposed=False, inputs=inputs)


TORCH_FIRST_CONV = torch_sources(first_conv_input)


@claim_layers("Convolution", lambda lp: getattr(lp.convolution_param, "constrain", 0) > 0)
class TrimmedConvolution(Convolution):
    """limuhit's trimmed convolution (convolution_param.constrain, caffeq/layers/limuhit_cmp.py): the weight
    masked before the convolution (a spec of its own, so that CPU weight packing leaves it to this forward)."""

    def parse(self, lp):
        return parse_constrain(lp, parse_conv(lp))

    def stored_blobs(self, attrs, arrays, notes):
        return zero_trimmed_taps(attrs, super().stored_blobs(attrs, arrays, notes))

    def init_params(self, attrs, shapes, rng):
        return zero_trimmed_taps(attrs, super().init_params(attrs, shapes, rng))


@register_layer("ConvolutionDepthwise")
class ConvolutionDepthwise(Convolution):
    """sp2823's layer (BVLC PR #5665, shipped by caffe-mobilenet and ShuffleNet forks): 2-D only,
    top (N, C, H', W') whatever num_output and group say, weights (C, 1, kh, kw), bias (C)."""
    depthwise = True


@register_layer("Deconvolution")
class Deconvolution(Layer):
    blob_names = ("weight", "bias")
    # weights are C_in x C_out/group x k...: one output channel is axis 1 within each group
    weight_axes = {0: 1}

    def parse(self, lp):
        return parse_conv(lp)

    def infer(self, attrs, in_shapes):
        return _conv_top_shapes(attrs, in_shapes, deconv_out_size)

    def param_shapes(self, attrs, in_shapes):
        _resolve_spatial(attrs, in_shapes[0])
        c = in_shapes[0][attrs["_axis"]]
        shapes = [(c, attrs["num_output"] // attrs["group"]) + attrs["kernel"]]
        if attrs["bias_term"]:
            shapes.append((attrs["num_output"],))
        return shapes

    def forward(self, attrs, params, *xs):
        bias = params[1] if attrs["bias_term"] else None
        ys = [_conv_nd(x, attrs, params[0], bias, True) for x in xs]
        return ys[0] if len(ys) == 1 else tuple(ys)

    def macs(self, attrs, in_shapes, out_shapes):
        k = math.prod(attrs["kernel"]) * attrs["num_output"] // attrs["group"]
        return count(in_shapes[0]) * k

    def onnx(self, ctx, node):
        _onnx_conv(ctx, node, "ConvTranspose")

    def pytorch_source(self, node, emit):
        # torch's ConvTranspose weight is C_in x C_out/group x k..., Caffe's layout
        return _torch_conv_source(node, emit, transposed=True)


# jolibrain/caffe's SparseInnerProduct (23928c0, sparse_inner_product_layer.cpp) multiplies a CSR batch from
# SparseData by the same (num_output, K) weights and falls back to this dense forward for a dense bottom;
# caffeq's SparseData input is dense
@register_layer("InnerProduct", "SparseInnerProduct")
class InnerProduct(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: lambda attrs: 1 if attrs["transpose"] else 0}

    def parse(self, lp):
        p = lp.inner_product_param
        if not p.HasField("num_output"):
            raise LayerError("inner_product_param.num_output is required (DIGITS writes its output layer without it "
                             "and fills in the number of classes: load the net with its caffemodel, whose weights "
                             "give it)")
        return {"num_output": int(p.num_output), "bias_term": bool(p.bias_term),
                "axis": int(p.axis), "transpose": bool(p.transpose), "normalize": bool(p.normalize)}

    def _k(self, attrs, shape):
        axis = canonical_axis(attrs["axis"], len(shape), "inner_product_param.axis")
        attrs["_axis"] = axis
        return count(shape, axis)

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        self._k(attrs, s)
        return [tuple(s[:attrs["_axis"]]) + (attrs["num_output"],)]

    def param_shapes(self, attrs, in_shapes):
        k = self._k(attrs, in_shapes[0])
        n = attrs["num_output"]
        shapes = [(k, n) if attrs["transpose"] else (n, k)]
        if attrs["bias_term"]:
            shapes.append((n,))
        return shapes

    def forward(self, attrs, params, x):
        axis = attrs["_axis"]
        flat = x.flatten(axis)   # (not a reshape to -1: that fails on the zero rois a proposal layer may give)
        w = params[0]
        if attrs.get("normalize"):   # happynear's fork: unit rows of the stored (N, K) memory
            w = unit_rows(w, attrs["num_output"], FORK_EPS)
        w = w.t() if attrs["transpose"] else w
        return F.linear(flat, w, params[1] if attrs["bias_term"] else None)

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0]) * attrs["num_output"]

    def pytorch_source(self, node, emit):
        a = node.attrs
        axis = a["_axis"]
        k = count(emit.in_shape(0), axis)
        m = emit.module(f"nn.Linear({k}, {a['num_output']}{'' if a['bias_term'] else ', bias=False'})")
        if a["transpose"]:
            # Caffe stores this weight K x N; a parameter laid out that way (a transposed view) makes
            # F.linear run the same matrix product as caffeq, bit for bit
            emit.init(f"{m}.weight = nn.Parameter(torch.empty({k}, {a['num_output']}).t())  "
                      f"# Caffe's transpose: true layout")
            emit.param("weight", emit.blob(0).T, blob=0)
        else:
            emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        x = emit.inputs[0]
        flat = x if len(emit.in_shape(0)) == axis + 1 else f"{x}.flatten({axis})"
        if a.get("normalize"):
            fn = emit.helper(unit_rows)
            w = f"{m}.weight.t()" if a["transpose"] else f"{m}.weight"
            w = f"{fn}({w}, {a['num_output']}, {emit.lit(FORK_EPS)})"
            w = f"{w}.t()" if a["transpose"] else w
            emit.uses("F")
            return f"F.linear({flat}, {w}, {m}.bias)"
        return f"{m}({flat})"

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        axis = a["_axis"]
        rank = len(ctx.shape(x))
        bias = [ctx.weight(node, 1)] if a["bias_term"] else []
        if a.get("normalize"):
            n = a["num_output"]
            k = count(ctx.shape(x), axis)
            stored = [k, n] if a["transpose"] else [n, k]
            w = onnx_unit_rows(ctx, ctx.weight(node, 0), n, stored, node.name)
            if not a["transpose"]:
                w = ctx.add_node("Transpose", [w], ctx.tmp(node.name + "_wT"), perm=[1, 0])
            if rank != axis + 1:
                x = ctx.merge_axes(x, axis, shape=ctx.shape(x))
            mm = node.outputs[0] if not bias else ctx.tmp(node.name + "_mm")
            ctx.add_node("MatMul", [x, w], [mm], name=node.name)
            if bias:
                ctx.add_node("Add", [mm, bias[0]], [node.outputs[0]])
            return
        if axis == 1:
            if rank != 2:
                flat = ctx.tmp(node.name + "_flat")
                ctx.add_node("Flatten", [x], [flat], axis=1)
                x = flat
            # Gemm reads Caffe's N x K weight as stored (transB), so no transposed copy is made
            ctx.add_node("Gemm", [x, ctx.weight(node, 0)] + bias, [node.outputs[0]], name=node.name,
                         transB=0 if a["transpose"] else 1)
            return
        if rank != axis + 1:
            x = ctx.merge_axes(x, axis, shape=ctx.shape(x))
        w = ctx.weight(node, 0, transpose=not a["transpose"])  # MatMul wants K x N
        if bias:
            mm = ctx.tmp(node.name + "_mm")
            ctx.add_node("MatMul", [x, w], [mm], name=node.name)
            ctx.add_node("Add", [mm, bias[0]], [node.outputs[0]])
        else:
            ctx.add_node("MatMul", [x, w], [node.outputs[0]], name=node.name)
