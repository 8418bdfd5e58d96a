"""C3D v1.0's 3-D layers (facebookarchive/C3D, C3D-v1.0; V1 files: CONVOLUTION3D, POOLING3D, VIDEO_DATA).

Blobs are 5-D: (N, C, L, H, W), L the frames.  The V1 names map to these types in
caffeq/io/upgrade.py; the parameters sit in the V1 convolution_param / pooling_param /
image_data_param under C3D's own field names (proto/README.md).

- Convolution3D (convolution3d_layer.cpp): kernel (kernel_depth, kernel_size, kernel_size),
  stride (temporal_stride, stride, stride), pad (temporal_pad, pad, pad); each output extent
  (n + 2 pad - k) / stride + 1, rounded down.  Weight (num_output, C, kd, k, k), bias
  (1, 1, 1, 1, num_output).  filter_group only splits the GEMM: every filter sees all of C.
- Deconvolution3D (deconvolution3d_layer.cpp): the transpose of Convolution3D (GEMM then
  col2vol), each output extent (n - 1) stride - 2 pad + k; weight (C, num_output, kd, k, k),
  bias (1, 1, 1, 1, num_output); no filter groups.
- Pooling3D (pool3d_layer.cpp): MAX or AVE over (kernel_depth, kernel_size, kernel_size)
  windows with strides (temporal_stride, stride, stride).  Output extents round up:
  ceil((H + 2 pad - k) / stride) + 1 and ceil((L - kd) / temporal_stride) + 1, and unlike BVLC
  the last window is never dropped.  pad is spatial only and only for AVE.  MAX windows are
  clipped to the input (an empty one gives -FLT_MAX); AVE sums the window clipped to the input
  and divides by its extent clipped to H + pad (W + pad) and to L, so padded cells count.
- VoxelSoftmax (voxel_wise_softmax_layer.cpp, V1 VOXEL_SOFTMAX): a softmax over the channels of each
  voxel of a 5-D blob.  The fork's max over the channels reads its buffer at the bottom's offset, so
  for N > 1 it subtracts another value than the maximum: the same softmax unless exp overflows.
- C3DVideoData (video_data_layer.cpp): a graph input (batch_size, 3, new_length, crop_size,
  crop_size), or new_height x new_width without a crop; its label top is (batch_size, 1, 1, 1, 1).
  ZhaofanQiu/caffe-windows-3dConvNet's mean_value, without a mean_file, is subtracted from every value.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .data import DataLayer
from .pooling_nd import POOL_AVE, POOL_MAX, WindowPool3d, pool_extents
from .registry import Layer, LayerError, count, need_blobs, needs_input_shape, register_layer, torch_sources
from .softmax import Softmax


def _one(values, name):
    """C3D's kernel_size / stride / pad are single values (repeated here for BVLC's N-D form)."""
    values = list(values) if not isinstance(values, int) else [values]
    if len(values) > 1:
        raise LayerError(f"{name} takes one value in C3D's 3-D layers, got {values}")
    return values


def _ceil_div(a, b):
    return -((-a) // b)


# ---- torch: used by forward and copied into model.py -------------------------------------------

class C3DConv3d(nn.Module):
    """C3D's Convolution3D with Caffe's blob shapes: weight (O, C, kd, k, k), bias (1, 1, 1, 1, O);
    transposed: its Deconvolution3D, weight (C, O, kd, k, k)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: list[int], stride: list[int],
                 pad: list[int], bias: bool, transposed: bool = False):
        super().__init__()
        channels = [in_channels, out_channels] if transposed else [out_channels, in_channels]
        self.weight = nn.Parameter(torch.zeros(channels + kernel))
        self.bias = nn.Parameter(torch.zeros(1, 1, 1, 1, out_channels)) if bias else None
        self.stride, self.pad, self.transposed = stride, pad, transposed

    def forward(self, x):
        bias = self.bias.reshape(-1) if self.bias is not None else None
        conv = F.conv_transpose3d if self.transposed else F.conv3d
        return conv(x, self.weight, bias, stride=self.stride, padding=self.pad)


TORCH_C3D_CONV = torch_sources(C3DConv3d)


def _need_5d(shape, what):
    if len(shape) != 5:
        raise LayerError(f"{what} needs a 5-axis input (N, C, L, H, W), got {list(shape)}")


# ---- Convolution3D ----------------------------------------------------------------------------

@register_layer("Convolution3D")
class Convolution3D(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: 0}
    onnx_op = "Conv"

    def parse(self, lp):
        need_blobs(lp, "Convolution3D", 1, 1)
        # C3D v1.1 (V2 files): convolution3d_param; C3D v1.0 (V1 files): its convolution_param
        field = "convolution3d_param" if lp.HasField("convolution3d_param") else "convolution_param"
        p = getattr(lp, field)
        if not p.num_output:
            raise LayerError(f"{field}.num_output must be > 0")
        kernel = _one(p.kernel_size, f"{field}.kernel_size")
        if not kernel or kernel[0] < 1:
            raise LayerError(f"{field}.kernel_size must be given and >= 1")
        if p.kernel_depth < 1:
            raise LayerError(f"{field}.kernel_depth must be given and >= 1, got {p.kernel_depth}")
        stride = _one(p.stride, f"{field}.stride") or [1]
        pad = _one(p.pad, f"{field}.pad") or [0]
        if stride[0] < 1 or p.temporal_stride < 1:
            raise LayerError(f"{field}.stride and temporal_stride must be >= 1, got {stride[0]} "
                             f"and {p.temporal_stride}")
        if p.filter_group < 1 or p.num_output % p.filter_group:
            raise LayerError(f"{field}.filter_group {p.filter_group} must divide num_output "
                             f"{p.num_output}")
        return {"num_output": int(p.num_output), "bias_term": bool(p.bias_term),
                "kernel": [int(p.kernel_depth), kernel[0], kernel[0]],
                "stride": [int(p.temporal_stride), stride[0], stride[0]],
                "pad": [int(p.temporal_pad), pad[0], pad[0]]}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _need_5d(s, "Convolution3D")
        out = [(n + 2 * p - k) // st + 1 for n, k, st, p in zip(s[2:], attrs["kernel"], attrs["stride"], attrs["pad"])]
        if min(out) < 1:
            raise LayerError(f"output would be empty: input {list(s)}, kernel {attrs['kernel']}")
        return [(s[0], attrs["num_output"]) + tuple(out)]

    def param_shapes(self, attrs, in_shapes):
        shapes = [(attrs["num_output"], int(in_shapes[0][1])) + tuple(attrs["kernel"])]
        if attrs["bias_term"]:
            shapes.append((1, 1, 1, 1, attrs["num_output"]))
        return shapes

    def forward(self, attrs, params, x):
        bias = params[1].reshape(-1) if attrs["bias_term"] else None
        return F.conv3d(x, params[0], bias, stride=attrs["stride"], padding=attrs["pad"])

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * in_shapes[0][1] * math.prod(attrs["kernel"])

    def onnx(self, ctx, node):
        a = node.attrs
        inputs = [node.inputs[0], ctx.weight(node, 0)]
        if a["bias_term"]:
            inputs.append(ctx.add_node("Reshape", [ctx.weight(node, 1), ctx.const(np.array([-1], np.int64))],
                                       [ctx.tmp(node.name + "_bias")])[0])
        ctx.add_node(self.onnx_op, inputs, [node.outputs[0]], name=node.name, kernel_shape=a["kernel"],
                     strides=a["stride"], pads=a["pad"] * 2)

    def pytorch_source(self, node, emit):
        return self.emit_module(node, emit)

    @staticmethod
    def emit_module(node, emit, transposed=False):
        a = node.attrs
        cls = emit.helper(TORCH_C3D_CONV)
        m = emit.module(f"{cls}({emit.in_shape(0)[1]}, {a['num_output']}, {a['kernel']}, {a['stride']}, "
                        f"{a['pad']}, bias={a['bias_term']}{', transposed=True' if transposed else ''})")
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        return f"{m}({emit.inputs[0]})"


@register_layer("Deconvolution3D")
class Deconvolution3D(Convolution3D):
    weight_axes = {0: 1}   # (C, num_output, kd, k, k): output channels on axis 1
    onnx_op = "ConvTranspose"

    def parse(self, lp):
        need_blobs(lp, "Deconvolution3D", 1, 1)
        attrs = super().parse(lp)
        if lp.convolution_param.filter_group != 1:
            raise LayerError("Deconvolution3D has no filter groups (convolution_param.filter_group must be 1)")
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _need_5d(s, "Deconvolution3D")
        out = [(n - 1) * st - 2 * p + k for n, k, st, p in zip(s[2:], attrs["kernel"], attrs["stride"], attrs["pad"])]
        if min(out) < 1:
            raise LayerError(f"output would be empty: input {list(s)}, kernel {attrs['kernel']}, pad {attrs['pad']}")
        return [(s[0], attrs["num_output"]) + tuple(out)]

    def param_shapes(self, attrs, in_shapes):
        shapes = super().param_shapes(attrs, in_shapes)
        shapes[0] = (int(in_shapes[0][1]), attrs["num_output"]) + tuple(attrs["kernel"])
        return shapes

    def forward(self, attrs, params, x):
        bias = params[1].reshape(-1) if attrs["bias_term"] else None
        return F.conv_transpose3d(x, params[0], bias, stride=attrs["stride"], padding=attrs["pad"])

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0]) * attrs["num_output"] * math.prod(attrs["kernel"])

    def pytorch_source(self, node, emit):
        return self.emit_module(node, emit, transposed=True)


# ---- Pooling3D ----------------------------------------------------------------------------------

@register_layer("Pooling3D")
class Pooling3D(WindowPool3d):
    def parse(self, lp):
        need_blobs(lp, "Pooling3D", 1, 1)
        # C3D v1.1 (V2 files): pooling3d_param (same enum values); C3D v1.0 (V1 files): pooling_param
        field = "pooling3d_param" if lp.HasField("pooling3d_param") else "pooling_param"
        p = getattr(lp, field)
        method = int(p.pool)
        if method not in (POOL_MAX, POOL_AVE):
            raise LayerError(f"{field}.pool: C3D's Pooling3D has MAX and AVE only (STOCHASTIC is not "
                             "implemented there)")
        if field == "pooling3d_param" and _P3D_FIELDS & {f.name for f, _ in p.ListFields()}:
            return _parse_p3d_pooling(p, method)
        # pooling3d_param declares single values; pooling_param repeats them (N-D Pooling)
        has_kernel = p.HasField("kernel_size") if field == "pooling3d_param" else len(p.kernel_size) > 0
        kernel = int(_one(p.kernel_size, f"{field}.kernel_size")[0]) if has_kernel else 0
        stride = int((_one(p.stride, f"{field}.stride") or [1])[0])
        pad = int((_one(p.pad, f"{field}.pad") or [0])[0])
        if kernel < 1 or p.kernel_depth < 1:
            raise LayerError(f"{field}.kernel_size and kernel_depth must be given and >= 1, got "
                             f"{kernel} and {p.kernel_depth}")
        if stride < 1 or p.temporal_stride < 1:
            raise LayerError(f"{field}.stride and temporal_stride must be >= 1, got {stride} and "
                             f"{p.temporal_stride}")
        if pad and method != POOL_AVE:
            raise LayerError(f"{field}.pad: C3D's Pooling3D pads only AVE pooling")
        return {"method": method, "kernel": [int(p.kernel_depth), kernel, kernel],
                "stride": [int(p.temporal_stride), stride, stride], "pad": pad}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _need_5d(s, "Pooling3D")
        if attrs.get("p3d"):
            return _infer_p3d_pooling(attrs, s)
        pads = (0, attrs["pad"], attrs["pad"])
        out = [_ceil_div(n + 2 * p - k, st) + 1 for n, k, st, p in zip(s[2:], attrs["kernel"], attrs["stride"], pads)]
        if min(out) < 1:
            raise LayerError(f"output would be empty: input {list(s)}, kernel {attrs['kernel']}")
        if attrs["method"] == POOL_AVE:
            for axis, (n, k, st, p, o) in enumerate(zip(s[2:], attrs["kernel"], attrs["stride"], pads, out)):
                if min(pool_extents(n, k, st, p, o)) < 1:
                    raise LayerError(f"the last AVE window of axis {axis + 2} starts past the input (stride "
                                     f"{st} > kernel {k}); C3D divides by zero there")
        attrs["_out"] = out
        return [s[:2] + tuple(out)]
    def windows(self, attrs):
        return attrs.get("_kernel") or attrs["kernel"], attrs["stride"], _c3d_pads(attrs), attrs["_out"]


def _c3d_pads(attrs):
    """C3D pads H and W only (and MAX pooling never: parse refuses it); P3D pads each axis."""
    if attrs.get("p3d"):
        return attrs["_pads"]
    return [0, attrs["pad"], attrs["pad"]]


# P3D's Pooling3D (ZhaofanQiu/pseudo-3d-residual-networks e91f95d, pooling3d_layer.cpp): BVLC's pooling
# over (length, height, width): ceil((n + 2 pad - kernel) / stride) + 1 windows, one fewer where a pad
# would start the last inside the padding; MAX and AVE (divided by the window clipped to size + pad)
_P3D_FIELDS = frozenset({"pad_l", "kernel_l", "stride_l", "pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h",
                         "stride_w", "global_pooling", "engine"})


def _parse_p3d_pooling(p, method):
    if p.global_pooling:
        if p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w"):
            raise LayerError("pooling3d_param: global_pooling takes no kernel size")
        kernel = None
    else:
        if p.HasField("kernel_size") == (p.HasField("kernel_h") and p.HasField("kernel_w")) or \
                not p.HasField("kernel_l"):
            raise LayerError("pooling3d_param: P3D's Pooling3D needs kernel_l and kernel_size (or kernel_h "
                             "and kernel_w, not both)")
        side = [int(p.kernel_size)] * 2 if p.HasField("kernel_size") else [int(p.kernel_h), int(p.kernel_w)]
        kernel = [int(p.kernel_l)] + side
        if min(kernel) < 1:
            raise LayerError(f"pooling3d_param: kernel {kernel} must be >= 1")
    if p.HasField("pad_h") != p.HasField("pad_w") or (p.HasField("pad_h") and p.HasField("pad")):
        raise LayerError("pooling3d_param: pad is pad OR pad_h and pad_w")
    if p.HasField("stride_h") != p.HasField("stride_w") or (p.HasField("stride_h") and p.HasField("stride")):
        raise LayerError("pooling3d_param: stride is stride OR stride_h and stride_w")
    pad = [int(p.pad_l)] + ([int(p.pad_h), int(p.pad_w)] if p.HasField("pad_h") else [int(p.pad)] * 2)
    stride = [int(p.stride_l)] + ([int(p.stride_h), int(p.stride_w)] if p.HasField("stride_h") else [int(p.stride)] * 2)
    if min(stride) < 1:
        raise LayerError(f"pooling3d_param: stride {stride} must be >= 1")
    if kernel is None and (any(pad) or any(st != 1 for st in stride)):
        raise LayerError("pooling3d_param: with global_pooling only pad 0 and stride 1")
    if kernel is not None and any(pd >= k for pd, k in zip(pad, kernel)):
        raise LayerError(f"pooling3d_param: pad {pad} must be below the kernel {kernel}")
    return {"method": method, "p3d": True, "kernel": kernel, "stride": stride, "pad": pad}


def _infer_p3d_pooling(attrs, s):
    kernel = list(attrs["kernel"] or s[2:])
    pads, stride = attrs["pad"], attrs["stride"]
    out = []
    for n, k, st, pd in zip(s[2:], kernel, stride, pads):
        o = _ceil_div(n + 2 * pd - k, st) + 1
        if pd and (o - 1) * st >= n + pd:
            o -= 1
        if o < 1:
            raise LayerError(f"output would be empty: input {list(s)}, kernel {kernel}")
        out.append(o)
    attrs["_kernel"], attrs["_pads"], attrs["_out"] = kernel, list(pads), out
    return [s[:2] + tuple(out)]


# ---- C3D v1.0 VideoData -------------------------------------------------------------------------

#: zhengshou/scnn's C3D (C3D-v1.0 and v1.1 C3D_overlap_loss, video_data_layer.cpp): a third top
SCNN_OVERLAP = ("a third top, each clip's overlap with its ground-truth segment (SCNN's C3D, the fifth column "
                "of its list), shaped like the label")


@register_layer("VoxelSoftmax")
class VoxelSoftmax(Softmax):
    bottoms = tops = 1

    def parse(self, lp):
        need_blobs(lp, "VoxelSoftmax", 1, 1)
        return {"axis": 1}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) != 5:
            raise LayerError(f"VoxelSoftmax takes C3D's 5-D blobs (N, C, L, H, W), got {list(in_shapes[0])}")
        return super().infer(attrs, in_shapes)


@register_layer("C3DVideoData")
class C3DVideoData(DataLayer):
    def parse(self, lp):
        p = lp.image_data_param
        if not 1 <= len(lp.top) <= 3:
            raise LayerError(f"C3D's VideoData takes one or two tops (three in SCNN's C3D), got {len(lp.top)}")
        if p.new_length < 1:
            raise LayerError(f"image_data_param.new_length (frames per clip) must be > 0, got {p.new_length}")
        if bool(p.new_height) != bool(p.new_width):
            raise LayerError("image_data_param.new_height and new_width must be set together")
        crop = int(p.crop_size)
        hw = (crop, crop) if crop else ((int(p.new_height), int(p.new_width)) if p.new_height else None)
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "source": p.source,
                "batch_size": max(1, int(p.batch_size)), "length": int(p.new_length), "hw": hw,
                "crop_size": crop, "mean_file": p.mean_file or None, "mirror": bool(p.mirror),
                "mean_value": p.mean_value if p.HasField("mean_value") and not p.mean_file else None}

    def top_shapes(self, attrs, given):
        data = given.get(0)
        if data is None:
            if attrs["hw"] is None:
                raise needs_input_shape(attrs, attrs["tops"][0], "C3D's VideoData without crop_size or "
                                        "new_height/new_width takes the frames' own size")
            data = (attrs["batch_size"], 3, attrs["length"]) + tuple(attrs["hw"])
        shapes = [tuple(data)]
        for i in range(1, attrs["num_tops"]):   # the label, and SCNN's overlap
            shapes.append(tuple(given.get(i) or (data[0], 1, 1, 1, 1)))
        return shapes

    def preprocessing(self, attrs):
        lines = [f"clips of {attrs['length']} frames, channels x frames x height x width"]
        if attrs["num_tops"] > 2:
            lines.append(SCNN_OVERLAP)
        if attrs["crop_size"]:
            n = attrs["crop_size"]
            lines.append(f"crop {n}x{n}: the centre crop at TEST (a random one at TRAIN)")
        if attrs["mean_file"]:
            lines.append(f"subtract the per-voxel mean volume {attrs['mean_file']!r} (cropped like the data)")
        elif attrs.get("mean_value") is not None:   # ZhaofanQiu/caffe-windows-3dConvNet's field
            lines.append(f"subtract {attrs['mean_value']:g} from every value (image_data_param.mean_value)")
        if attrs["mirror"]:
            lines.append("random horizontal flips at TRAIN (mirror: true)")
        return lines
