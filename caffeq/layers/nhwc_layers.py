"""UrwLee/Experience's channels-last layers: ConvolutionNHWC, ConvolutionDepthwiseNHWC, PoolingNHWC.

Source: UrwLee/Experience a59d5b9, remodet_repository_LEE/src/caffe/nhwc/{base_conv_nhwc_layer.cpp,
conv_nhwc_layer.cpp/.cu, conv_dw_nhwc_layer.cpp/.cu, pooling_nhwc_layer.cpp/.cu}, include/caffe/nhwc/*.hpp and
src/caffe/util/im2col.cpp (im2col_nhwc_cpu); caffe.proto (same folder's src/caffe/proto) adds no field for them:
they read BVLC's convolution_param / pooling_param.

Layout.  The blobs are channels-last in memory *and* in their declared shape: a bottom is (N, H, W, C) and the top
(N, H', W', C').  Nothing converts at the net's input: the fork's own test (test/testToNHWC/models/net_NHWC.prototxt
with src/testPoolingNHWC.cpp) declares the input `1 224 224 3` and fills it with the NCHW data transposed by the
caller.  Layers in between that ignore the layout (ReLU) work on these blobs unchanged.

- ConvolutionNHWC: out[n, i, j, o] = sum over (kh, kw, c) of x[n, i*s_h - p_h + kh*d_h, j*s_w - p_w + kw*d_w, c]
  * W[kh, kw, c, o] + b[o] (zero outside the map), size floor((H + 2p - (d(k - 1) + 1)) / s) + 1.  Weight blob
  (kh, kw, C_in, num_output), bias (num_output).  kernel_size / stride / pad / dilation are read as BVLC's
  BaseConvolutionLayer reads them (one value or one per axis, or the _h / _w pair; stride default 1, pad 0,
  dilation 1).  group must be 1 (the fork points to ConvolutionDepthwiseNHWC); `axis` is not read.  Several
  bottoms (all the same shape) each get a top, with the same filters.
- ConvolutionDepthwiseNHWC: out[n, i, j, c] = sum over (kh, kw) of x[n, i*s_h - p_h + kh, j*s_w - p_w + kw, c]
  * W[kh, kw, 0, c] + b[c]; weight blob (kh, kw, 1, C), bias (C).  num_output, when given, must equal C.  kernel,
  stride and pad each come from the _h and _w pair when both are set, else from kernel_size / stride / pad, which
  the fork then requires (no default stride or pad); dilation must be 1.  Its CPU forward adds the bias to the
  first image of the batch only (the bias GEMM spans one image's H' x W' rows, once); its GPU forward
  (DepthwiseConv2DNHWCBiasForward) to every image, as caffeq does.
- PoolingNHWC: BVLC's Pooling on the (N, H, W, C) blob: MAX or AVE only (STOCHASTIC is the fork's "Unknown
  pooling method"), size ceil((H + 2p - k) / s) + 1 with the last window dropped when it starts in the padding,
  MAX over the in-map cells starting from -FLT_MAX, AVE dividing by the window clipped to H + p; global_pooling
  takes the whole plane.  The fork's PoolingParameter declares pad / kernel_size / stride once (scalars).

caffeq computes each through its NCHW convolution / pooling between two permutes (the same sums); the ONNX
export is Transpose, Conv or the pooling of caffeq/backends/onnx_pooling.py (MAX then floored at -FLT_MAX,
where onnxruntime's MaxPool leaves a window of -inf at -inf), Transpose.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .pooling import (
    AVE,
    CEIL,
    MAX,
    STOCHASTIC,
    TORCH_POOL_FUNCTIONS,
    TORCH_POOL_MODULE,
    caffe_max_input,
    caffe_pool,
    window,
)
from .registry import AT_LEAST, Layer, LayerError, count, need_blobs, register_layer, spatial_params, torch_sources

TO_NCHW, TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]
FLT_MAX = 3.4028234663852886e38
#: the Caffe weight (kh, kw, C_in / 1, C_out) -> torch's (C_out, C_in / 1, kh, kw)
WEIGHT_TO_OIHW = [3, 2, 0, 1]


# ---- torch: used by forward and copied into model.py ------------------------------------------

def conv_nhwc(x, weight, bias, stride: list[int], pad: list[int], dilation: list[int], groups: int):
    """Convolution of an (N, H, W, C) tensor with a (kh, kw, C_in / groups, C_out) weight -> (N, H', W', C_out)."""
    y = F.conv2d(x.permute(0, 3, 1, 2), weight.permute(3, 2, 0, 1), bias, stride, pad, dilation, groups)
    return y.permute(0, 2, 3, 1).contiguous()


class ConvNHWC(nn.Module):
    """ConvolutionNHWC / ConvolutionDepthwiseNHWC with the Caffe blobs as parameters (see conv_nhwc)."""

    def __init__(self, weight_shape, bias, stride, pad, dilation, groups):
        super().__init__()
        self.stride, self.pad, self.dilation, self.groups = stride, pad, dilation, groups
        self.weight = nn.Parameter(torch.zeros(weight_shape))
        self.bias = nn.Parameter(torch.zeros(weight_shape[3])) if bias else None

    def forward(self, x):
        return conv_nhwc(x, self.weight, self.bias, self.stride, self.pad, self.dilation, self.groups)


def global_pool_nhwc(x, is_max: bool):
    """Global MAX (from -FLT_MAX) or AVE (sum / (H * W)) over the H and W axes of an (N, H, W, C) tensor."""
    if is_max:
        return caffe_max_input(x).amax(dim=(1, 2), keepdim=True).clamp_min(-3.4028234663852886e38)
    return x.sum(dim=(1, 2), keepdim=True) / float(x.shape[1] * x.shape[2])


class GlobalPoolNHWC(nn.Module):
    """PoolingNHWC with global_pooling (see global_pool_nhwc)."""

    def __init__(self, is_max: bool):
        super().__init__()
        self.is_max = is_max

    def forward(self, x):
        return global_pool_nhwc(x, self.is_max)


class PoolNHWC(nn.Module):
    """A pooling module of (N, C, H, W) tensors run on an (N, H, W, C) one."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool

    def forward(self, x):
        return self.pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1).contiguous()


TORCH_CONV_NHWC = torch_sources(conv_nhwc, ConvNHWC)
TORCH_POOL_NHWC = torch_sources(PoolNHWC)
TORCH_GLOBAL_POOL_NHWC = torch_sources(caffe_max_input, global_pool_nhwc, GlobalPoolNHWC)


# ---- shared ------------------------------------------------------------------------------------

def _four_axes(what, shape):
    if len(shape) != 4:
        raise LayerError(f"{what} needs a 4-axis (N, H, W, C) bottom, got {list(shape)}")


def _onnx_nhwc(ctx, node, x, y, emit_nchw):
    """Transpose x to NCHW, emit_nchw(x_nchw, y_nchw), Transpose the result into y."""
    xt = ctx.op("Transpose", [x], "nchw", perm=TO_NCHW)
    yt = ctx.tmp(f"{node.name}_nchw_out")
    emit_nchw(xt, yt)
    ctx.add_node("Transpose", [yt], [y], name=f"{node.name}_to_nhwc", perm=TO_NHWC)


class _ConvNHWCBase(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: 3}

    def groups(self, attrs, channels):
        return 1

    def param_shapes(self, attrs, in_shapes):
        c = in_shapes[0][3]
        shapes = [tuple(attrs["kernel"]) + self.weight_io(attrs, c)]
        if attrs["bias_term"]:
            shapes.append((shapes[0][3],))
        return shapes

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _four_axes(self.types[0], s)
        if any(tuple(t) != s for t in in_shapes[1:]):
            raise LayerError(f"{self.types[0]}: all bottoms must have the same shape, "
                             f"got {[list(t) for t in in_shapes]}")
        self.check_channels(attrs, s[3])
        out = [(n + 2 * p - (d * (k - 1) + 1)) // st + 1 for n, k, st, p, d in
               zip(s[1:3], attrs["kernel"], attrs["stride"], attrs["pad"], attrs["dilation"])]
        if min(out) < 1:
            raise LayerError(f"{self.types[0]}: output would be empty: input {list(s)}, kernel {list(attrs['kernel'])}")
        return [(s[0], out[0], out[1], self.weight_io(attrs, s[3])[1])] * len(in_shapes)

    def check_channels(self, attrs, channels):
        pass

    def init_params(self, attrs, shapes, rng):
        """N(0, 1 / fan_in) with fan_in kh * kw * C_in (the blob's first three axes), biases 0."""
        fan_in = max(1, math.prod(shapes[0][:3]))
        blobs = [(rng.standard_normal(shapes[0]) / math.sqrt(fan_in)).astype("float32")]
        return blobs + [np.zeros(s, np.float32) for s in shapes[1:]]

    def forward(self, attrs, params, *xs):
        bias = params[1] if attrs["bias_term"] else None
        g = self.groups(attrs, xs[0].shape[3])
        ys = [conv_nhwc(x, params[0], bias, list(attrs["stride"]), list(attrs["pad"]), list(attrs["dilation"]), g)
              for x in xs]
        return ys[0] if len(ys) == 1 else tuple(ys)

    def macs(self, attrs, in_shapes, out_shapes):
        k = math.prod(attrs["kernel"]) * in_shapes[0][3] // self.groups(attrs, in_shapes[0][3])
        return sum(count(o) * k for o in out_shapes)

    def onnx(self, ctx, node):
        a = node.attrs
        c = ctx.shape(node.inputs[0])[3]
        w = ctx.op("Transpose", [ctx.weight(node, 0)], "weight_oihw", perm=WEIGHT_TO_OIHW)
        b = [ctx.weight(node, 1)] if a["bias_term"] else []
        for x, y in zip(node.inputs, node.outputs):
            _onnx_nhwc(ctx, node, x, y, lambda xt, yt: ctx.add_node(
                "Conv", [xt, w] + b, [yt], name=node.name, kernel_shape=list(a["kernel"]),
                strides=list(a["stride"]), pads=list(a["pad"]) * 2, dilations=list(a["dilation"]),
                group=self.groups(a, c)))

    def pytorch_source(self, node, emit):
        a = node.attrs
        c = emit.in_shape(0)[3]
        shape = tuple(a["kernel"]) + self.weight_io(a, c)
        m = emit.instance(ConvNHWC, list(shape), a["bias_term"], list(a["stride"]), list(a["pad"]),
                          list(a["dilation"]), self.groups(a, c), needs=[TORCH_CONV_NHWC])
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        calls = [f"{m}({x})" for x in emit.inputs]
        return calls[0] if len(calls) == 1 else calls


@register_layer("ConvolutionNHWC")
class ConvolutionNHWC(_ConvNHWCBase):
    """base_conv_nhwc_layer.cpp + conv_nhwc_layer.cpp: im2col over (H, W, C) and one GEMM per image."""

    def parse(self, lp):
        need_blobs(lp, "ConvolutionNHWC", range(1, AT_LEAST), len(lp.bottom))
        p = lp.convolution_param
        if not p.HasField("num_output") or p.num_output < 1:
            raise LayerError(f"convolution_param.num_output must be given and positive (the fork checks it), "
                             f"got {p.num_output if p.HasField('num_output') else 'none'}")
        if p.group != 1:
            raise LayerError(f"convolution_param.group must be 1 in ConvolutionNHWC (the fork refuses grouped "
                             f"convolution: use ConvolutionDepthwiseNHWC), got {p.group}")
        if not (len(p.kernel_size) or p.HasField("kernel_h") or p.HasField("kernel_w")):
            raise LayerError("convolution_param.kernel_size (or kernel_h/kernel_w) is required")
        return {
            "num_output": int(p.num_output), "bias_term": bool(p.bias_term),
            "kernel": spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False),
            "stride": spatial_params(p, 2, "stride", 1, min_value=1, pair_required=False),
            "pad": spatial_params(p, 2, "pad", 0, min_value=0, pair_required=False),
            "dilation": spatial_params(p, 2, "dilation", 1, allow_hw=False, min_value=1),
        }

    def weight_io(self, attrs, channels):
        return (channels, attrs["num_output"])


@register_layer("ConvolutionDepthwiseNHWC")
class ConvolutionDepthwiseNHWC(_ConvNHWCBase):
    """conv_dw_nhwc_layer.cpp/.cu: one filter per channel."""

    reading_note = ("ConvolutionDepthwiseNHWC adds its bias to every image as the fork's GPU forward does "
                    "(its CPU forward adds it to the batch's first image only)")

    def parse(self, lp):
        need_blobs(lp, "ConvolutionDepthwiseNHWC", 1, 1)
        p = lp.convolution_param
        attrs = {"bias_term": bool(p.bias_term),
                 "num_output": int(p.num_output) if p.HasField("num_output") else None}
        for key, field, hw in (("kernel", "kernel_size", "kernel"), ("stride", "stride", "stride"),
                               ("pad", "pad", "pad")):
            if p.HasField(f"{hw}_h") and p.HasField(f"{hw}_w"):
                values = (getattr(p, f"{hw}_h"), getattr(p, f"{hw}_w"))
            else:
                given = list(getattr(p, field))
                if not given:
                    raise LayerError(f"convolution_param.{field} (or {hw}_h and {hw}_w) is required by "
                                     f"ConvolutionDepthwiseNHWC (the fork has no default)")
                values = (given[0], given[0]) if len(given) == 1 else (given[0], given[1])
            low = 0 if key == "pad" else 1
            if min(values) < low:
                raise LayerError(f"convolution_param.{field} must be >= {low}, got {list(values)}")
            attrs[key] = tuple(int(v) for v in values)
        dilation = list(p.dilation)
        if any(d != 1 for d in dilation[:2]):
            raise LayerError(f"convolution_param.dilation must be 1 in ConvolutionDepthwiseNHWC (the fork checks it), "
                             f"got {dilation}")
        attrs["dilation"] = (1, 1)
        return attrs

    def check_channels(self, attrs, channels):
        if attrs["num_output"] is not None and attrs["num_output"] != channels:
            raise LayerError(f"convolution_param.num_output {attrs['num_output']} must equal the bottom's channels "
                             f"{channels} (ConvolutionDepthwiseNHWC keeps each channel apart)")

    def param_shapes(self, attrs, in_shapes):
        self.check_channels(attrs, in_shapes[0][3])
        return super().param_shapes(attrs, in_shapes)

    def weight_io(self, attrs, channels):
        return (1, channels)

    def groups(self, attrs, channels):
        return channels


@register_layer("PoolingNHWC")
class PoolingNHWC(Layer):
    """pooling_nhwc_layer.cpp/.cu: BVLC's Pooling windows over the H and W axes of an (N, H, W, C) blob."""

    def parse(self, lp):
        need_blobs(lp, "PoolingNHWC", 1, 1)
        p = lp.pooling_param
        pool = int(p.pool)
        if pool not in (MAX, AVE):
            name = "STOCHASTIC" if pool == STOCHASTIC else str(pool)
            raise LayerError(f"pooling_param.pool {name}: PoolingNHWC has MAX and AVE only")
        for field in ("kernel_size", "stride", "pad"):
            if len(getattr(p, field)) > 1:
                raise LayerError(f"pooling_param.{field} given {len(getattr(p, field))} times: the fork declares "
                                 f"it once (use {field.replace('_size', '')}_h / _w)")
        attrs = {"pool": pool, "global": bool(p.global_pooling), "round_mode": CEIL, "edge": None}
        has_kernel = bool(p.kernel_size) or p.HasField("kernel_h") or p.HasField("kernel_w")
        if attrs["global"]:
            if has_kernel:
                raise LayerError("pooling_param: with global_pooling the kernel size cannot be given "
                                 "(the fork checks it)")
            attrs["kernel"] = None
        else:
            if bool(p.kernel_size) == (p.HasField("kernel_h") and p.HasField("kernel_w")):
                raise LayerError("pooling_param: give kernel_size, or kernel_h and kernel_w (not both)")
            attrs["kernel"] = spatial_params(p, 2, "kernel_size", None, min_value=1)
        attrs["stride"] = spatial_params(p, 2, "stride", 1, min_value=1)
        attrs["pad"] = spatial_params(p, 2, "pad", 0, min_value=0)
        if attrs["global"] and (any(attrs["pad"]) or attrs["stride"] != (1, 1)):
            raise LayerError("pooling_param: with global_pooling, pad must be 0 and stride 1")
        if not attrs["global"] and any(attrs["pad"]) and any(pd >= k for pd, k in zip(attrs["pad"], attrs["kernel"])):
            raise LayerError(f"pooling_param.pad {list(attrs['pad'])} must be smaller than the kernel "
                             f"{list(attrs['kernel'])}")
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _four_axes("PoolingNHWC", s)
        _, _, _, out = window(attrs, s[1], s[2])
        if min(out) < 1:
            raise LayerError(f"PoolingNHWC: output would be empty for input {list(s)}")
        return [(s[0], out[0], out[1], s[3])]

    def forward(self, attrs, params, x):
        if attrs["global"]:
            return global_pool_nhwc(x, attrs["pool"] == MAX)
        return caffe_pool(x.permute(0, 3, 1, 2), attrs).permute(0, 2, 3, 1).contiguous()

    def macs(self, attrs, in_shapes, out_shapes):
        s = in_shapes[0]
        return count(out_shapes[0]) * math.prod(window(attrs, s[1], s[2])[0])

    def onnx(self, ctx, node):
        from ..backends.onnx_pooling import emit_pooling
        n, h, w, c = ctx.shape(node.inputs[0])

        def emit(xt, yt):
            if node.attrs["pool"] != MAX:
                emit_pooling(ctx, node, node.attrs, xt, yt, shape=(n, c, h, w))
                return
            # the fork starts every MAX window at -FLT_MAX, so a window of -inf gives -FLT_MAX (as forward
            # does); onnxruntime's MaxPool keeps -inf
            pooled = ctx.tmp(f"{node.name}_max")
            emit_pooling(ctx, node, node.attrs, xt, pooled, shape=(n, c, h, w))
            ctx.add_node("Max", [pooled, ctx.f32(-FLT_MAX)], [yt], name=f"{node.name}_from_flt_max")

        _onnx_nhwc(ctx, node, node.inputs[0], node.outputs[0], emit)

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a["global"]:
            m = emit.instance(TORCH_GLOBAL_POOL_NHWC, a["pool"] == MAX)
        else:
            emit.helper(TORCH_POOL_FUNCTIONS)
            mode = "max" if a["pool"] == MAX else "ave"
            inner = (f"{emit.helper(TORCH_POOL_MODULE)}({emit.lit(mode)}, {list(a['kernel'])}, "
                     f"{list(a['stride'])}, {list(a['pad'])})")
            m = emit.module(f"{emit.helper(TORCH_POOL_NHWC)}({inner})")
        return f"{m}({emit.inputs[0]})"
