"""Layers of Xilinx's (DeePhi's) Caffe for the DNNDK / Vitis AI quantizer: the nets its DECENT tool
takes and writes (YOLOv3 conversions for the DPU, e.g. rulai-hu/DNNDK-YOLOv3).

- DeephiResize (Xilinx caffe-xilinx deephi_resize_layer.cpp; deephi_resize_param: new_height and
  new_width, or scale_h and scale_w (each pair set together), resize_type BILINEAR (0, the default) |
  NEAREST): top (N, C, new_height, new_width), or (N, C, int(H scale_h), int(W scale_w)) in float32.
  Without the DPU emulation the fork copies each plane transposed into an OpenCV float Mat and calls
  cv::resize (INTER_LINEAR or INTER_NEAREST) to the transposed size, so its first (horizontal) pass
  runs along H: OpenCV's taps along each axis, the source coordinate (d + 0.5) / (out / in) - 0.5 in
  doubles rounded to float, clamped to the edges, H combined before W.
"""
import copy

import numpy as np
import torch

from .c_numerics import c_round
from .conv import Convolution, InnerProduct
from .python_layers import TORCH_CV_NEAREST, cv_nearest_resize, onnx_cv_nearest
from .registry import (
    Layer,
    LayerError,
    legacy_depth_space_shape,
    legacy_nchw,
    need_blobs,
    register_layer,
    torch_sources,
)
from .transformed_weights import TransformedConvolution, TransformedInnerProduct, TransformedWeights

_NEAREST = 1   # DeephiResizeParameter.NEAREST


def cv_linear_taps(n_in: int, n_out: int):
    """OpenCV's INTER_LINEAR taps for a float image along one axis: (first source index, second, the
    first's weight, the second's), n_out each; the coordinate in doubles, rounded to float as OpenCV's."""
    scale = 1.0 / (n_out / n_in)
    at = ((torch.arange(n_out, dtype=torch.float64) + 0.5) * scale - 0.5).to(torch.float32)
    first = torch.floor(at)
    frac = at - first
    zero = torch.zeros((), dtype=torch.float32)
    frac = torch.where((first < 0) | (first >= n_in - 1), zero, frac)
    first = first.clamp(0, n_in - 1).long()
    second = (first + 1).clamp(max=n_in - 1)
    return first, second, 1.0 - frac, frac


def cv_linear_axis(x, axis: int, n_out: int):
    """x interpolated along `axis` (2 or 3) to n_out by OpenCV's INTER_LINEAR taps."""
    first, second, w0, w1 = cv_linear_taps(x.shape[axis], n_out)
    shape = [1, 1, 1, 1]
    shape[axis] = n_out
    dev = x.device
    wa, wb = w0.view(shape).to(dev, x.dtype), w1.view(shape).to(dev, x.dtype)
    return x.index_select(axis, first.to(dev)) * wa + x.index_select(axis, second.to(dev)) * wb


def deephi_linear_resize(x, out_h: int, out_w: int):
    """The fork's cv::resize of each transposed plane: the horizontal pass (along H here) first."""
    return cv_linear_axis(cv_linear_axis(x, 2, out_h), 3, out_w)


# model.py gets these very functions
TORCH_CV_LINEAR = torch_sources(cv_linear_taps, cv_linear_axis, deephi_linear_resize)


@register_layer("DeephiResize")
class DeephiResize(Layer):
    def parse(self, lp):
        need_blobs(lp, "DeephiResize", 1, 1)
        p = lp.deephi_resize_param
        if p.HasField("new_height") != p.HasField("new_width"):
            raise LayerError("deephi_resize_param: new_height and new_width should be set at the same time")
        if p.HasField("scale_h") != p.HasField("scale_w"):
            raise LayerError("deephi_resize_param: scale_h and scale_w should be set at the same time")
        if p.HasField("new_height"):
            size = (int(p.new_height), int(p.new_width))
            scale = None
        else:
            size = None
            scale = (float(p.scale_h), float(p.scale_w))
        return {"size": size, "scale": scale, "nearest": p.resize_type == _NEAREST}

    @staticmethod
    def out_hw(attrs, h, w):
        if attrs["size"] is not None:
            return attrs["size"]
        sh, sw = attrs["scale"]
        # the fork's int height_ times its float scale, stored in an int
        return int(np.float32(h) * np.float32(sh)), int(np.float32(w) * np.float32(sw))

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"DeephiResize resizes (N, C, H, W) blobs, got {list(s)}")
        ho, wo = self.out_hw(attrs, s[2], s[3])
        if ho < 1 or wo < 1:
            raise LayerError(f"deephi_resize_param gives a {ho}x{wo} top for a {s[2]}x{s[3]} bottom")
        return [(s[0], s[1], ho, wo)]

    def forward(self, attrs, params, x):
        ho, wo = self.out_hw(attrs, x.shape[2], x.shape[3])
        if attrs["nearest"]:
            return cv_nearest_resize(x, ho, wo)
        return deephi_linear_resize(x, ho, wo)

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        _n, _c, h, w = ctx.shape(x)
        ho, wo = self.out_hw(node.attrs, h, w)
        if node.attrs["nearest"]:
            onnx_cv_nearest(ctx, node, x, h, w, ho, wo)
            return
        along_h = _onnx_linear_axis(ctx, x, 2, h, ho, ctx.tmp(f"{name}_rows"), name)
        _onnx_linear_axis(ctx, along_h, 3, w, wo, node.outputs[0], name)

    def pytorch_source(self, node, emit):
        ho, wo = self.out_hw(node.attrs, *emit.in_shape(0)[2:])
        if node.attrs["nearest"]:
            return f"{emit.helper(TORCH_CV_NEAREST)}({emit.inputs[0]}, {ho}, {wo})"
        return f"{emit.helper(TORCH_CV_LINEAR)}({emit.inputs[0]}, {ho}, {wo})"


def _onnx_linear_axis(ctx, x, axis, n_in, n_out, out, name):
    """Gather both taps along `axis` and mix them with OpenCV's weights; returns the output name."""
    first, second, w0, w1 = (t.numpy() for t in cv_linear_taps(n_in, n_out))
    shape = [1, 1, 1, 1]
    shape[axis] = n_out
    a = ctx.add_node("Gather", [x, ctx.const(np.array(first, np.int64))], [ctx.tmp(f"{name}_a{axis}")],
                     axis=axis)[0]
    b = ctx.add_node("Gather", [x, ctx.const(np.array(second, np.int64))], [ctx.tmp(f"{name}_b{axis}")],
                     axis=axis)[0]
    wa = ctx.add_node("Mul", [a, ctx.const(np.array(w0, np.float32).reshape(shape))], [ctx.tmp(f"{name}_wa{axis}")])[0]
    wb = ctx.add_node("Mul", [b, ctx.const(np.array(w1, np.float32).reshape(shape))], [ctx.tmp(f"{name}_wb{axis}")])[0]
    return ctx.add_node("Add", [wa, wb], [out])[0]


# ---- the DECENT quantizer's fixed-point layers (caffe-xilinx, Vitis-AI d02dcb6) ----------------------

OVER_FLOW, DIFF_S, DIFF_A = 0, 1, 2


def fix_values(x, bit_width: int, position: int):
    """quantize.cpp caffe_cpu_fix: round(x / 2^-p) 2^-p, half away from zero, clamped to bit_width's range."""
    step = 2.0 ** -position
    low, high = -(2.0 ** (bit_width - 1)) * step, (2.0 ** (bit_width - 1)) * step - step
    return torch.clamp(c_round((x / step).double()).to(x.dtype) * step, low, high)   # exact through float64


def fix_position(x, bit_width: int, method: int):
    """The fixed position the fork searches for a blob: OVER_FLOW, the largest p whose range holds the
    blob's extremes (half a step of margin); DIFF_S, the best of p .. p + 4 by the squared error."""
    f32 = np.float32
    values = x.detach().reshape(-1).float().cpu()
    lo, hi = float(values.min()), float(values.max())
    step = max(f32(lo) / f32(-(2.0 ** (bit_width - 1)) - 0.5), f32(hi) / f32(2.0 ** (bit_width - 1) - 0.5))
    if step == 0:
        return 32767
    if np.isnan(step):
        return -32768
    first = int(np.floor(np.log2(f32(1) / f32(step))))
    if method == OVER_FLOW:
        return first
    best, chosen = float("inf"), first
    for position in range(first, first + 5):
        err = float(((values - fix_values(values, bit_width, position)) ** 2).sum())
        if err < best:
            best, chosen = err, position
    return chosen


def fix_neuron(x, position, bit_width: int, follow_data_layer: bool):
    """FixedNeuron at TEST: the position from its blob (floor); the data layer's own truncates toward 0
    unclamped, the others round half toward +infinity and clamp to bit_width's range."""
    p = torch.floor(position.reshape(-1)[0]).item()
    step = 2.0 ** -p
    t = (x / step).double()
    if follow_data_layer:
        return (torch.trunc(t) * step).to(x.dtype)
    low, high = -(2.0 ** (bit_width - 1)) * step, (2.0 ** (bit_width - 1)) * step - step
    return torch.clamp((torch.floor(t + 0.5) * step).to(x.dtype), low, high)


def gs_tiling(x, stride: int, reverse: bool):
    """GSTiling: space-to-depth with channels ordered (dy, dx, c), or (reverse) its inverse."""
    n, c, h, w = x.shape
    s = stride
    if reverse:
        co = c // (s * s)
        return x.reshape(n, s, s, co, h, w).permute(0, 3, 4, 1, 5, 2).reshape(n, co, h * s, w * s)
    return x.reshape(n, c, h // s, s, w // s, s).permute(0, 3, 5, 1, 2, 4).reshape(n, s * s * c, h // s, w // s)


def fixed_attrs(lp):
    p = lp.fixed_param
    if p.bit_width <= 0:
        raise LayerError(f"fixed_param.bit_width must be > 0, got {p.bit_width}")
    return {"fix_enable": bool(p.enable), "fix_method": int(p.fixed_method), "bit_width": int(p.bit_width),
            "follow_data_layer": bool(p.follow_data_layer)}


def _refuse_weight_method(lp, attrs):
    if attrs["fix_method"] not in (OVER_FLOW, DIFF_S):
        raise LayerError(f"{lp.type}: fixed_param.fixed_method must be OVER_FLOW or DIFF_S for weights (the fork "
                         f"aborts on the others)")


class _FixedWeights(TransformedWeights):
    """Weights and bias quantized to bit_width fixed point, each at the position searched from its own values."""

    def weight_transform(self, attrs, weight):
        if not attrs["fix_enable"]:
            return None
        return fix_values(weight, attrs["bit_width"], fix_position(weight, attrs["bit_width"], attrs["fix_method"]))

    def bias_transform(self, attrs, bias, weight):
        return self.weight_transform(attrs, bias)

    def weight_transform_note(self, attrs):
        return ("the fixed-point layers keep their weights and biases already quantized (the fork quantizes copies of "
                "the float blobs at every forward, to the same values)") if attrs["fix_enable"] else None


@register_layer("ConvolutionFixed")
class ConvolutionFixed(_FixedWeights, TransformedConvolution, Convolution):
    """Convolution on its fixed-point weights and bias (conv_fixed_layer.cpp, cudnn_conv_fixed_layer.cu)."""

    def parse(self, lp):
        attrs = {**super().parse(lp), **fixed_attrs(lp)}
        _refuse_weight_method(lp, attrs)
        return attrs


@register_layer("InnerProductFixed")
class InnerProductFixed(_FixedWeights, TransformedInnerProduct, InnerProduct):
    """InnerProduct on its fixed-point weights and bias (inner_product_fixed_layer.cpp)."""

    def parse(self, lp):
        attrs = {**super().parse(lp), **fixed_attrs(lp)}
        _refuse_weight_method(lp, attrs)
        return attrs


@register_layer("ConvolutionBNFixed")
class ConvolutionBNFixed(TransformedConvolution, Convolution):
    """A convolution and its BatchNorm folded (s = gamma / sqrt(var + eps), W s, beta - mean s), then
    quantized as ConvolutionFixed's (cudnn_conv_bn_fixed_layer.cu's TEST forward).  Blobs: W, then the fork's
    BatchNorm's gamma, beta, mean, variance (each (1, O, 1, 1)) and its unused 1-element blob."""
    blob_names = ("weight", "bn_scale", "bn_bias", "bn_mean", "bn_variance", "bn_unused")

    def parse(self, lp):
        attrs = {**super().parse(lp), **fixed_attrs(lp)}
        _refuse_weight_method(lp, attrs)
        if attrs["bias_term"]:
            raise LayerError("ConvolutionBNFixed needs convolution_param.bias_term: false (the fork's check)")
        attrs["bn_eps"] = float(np.float32(lp.batch_norm_param.eps))
        return attrs

    def blob_names_for(self, attrs):
        return self.blob_names

    def param_shapes(self, attrs, in_shapes):
        weight = super().param_shapes(attrs, in_shapes)[0]
        o = attrs["num_output"]
        return [weight] + [(1, o, 1, 1)] * 4 + [(1, 1, 1, 1)]

    def init_params(self, attrs, shapes, rng):
        fan_in = int(np.prod(shapes[0][1:]))
        o = attrs["num_output"]
        return [(rng.standard_normal(shapes[0]) / np.sqrt(fan_in)).astype(np.float32),
                np.ones((1, o, 1, 1), np.float32), np.zeros((1, o, 1, 1), np.float32),
                np.zeros((1, o, 1, 1), np.float32), np.ones((1, o, 1, 1), np.float32), np.ones((1, 1, 1, 1), np.float32)]

    def folded(self, attrs, blobs):
        """(W', b'): the BatchNorm folded into the convolution, then quantized."""
        w, gamma, beta, mean, var = (torch.as_tensor(np.asarray(b, np.float32)) for b in blobs[:5])
        scale = gamma.reshape(-1) / torch.sqrt(var.reshape(-1) + attrs["bn_eps"])
        weight = w * scale.reshape((-1,) + (1,) * (w.dim() - 1))
        bias = beta.reshape(-1) - mean.reshape(-1) * scale
        if attrs["fix_enable"]:
            bw, method = attrs["bit_width"], attrs["fix_method"]
            weight = fix_values(weight, bw, fix_position(weight, bw, method))
            bias = fix_values(bias, bw, fix_position(bias, bw, method))
        return weight, bias

    def forward(self, attrs, params, *xs):
        weight, bias = self.folded(attrs, [p.detach().cpu() for p in params])
        ref = params[0]
        return Convolution.forward(self, dict(attrs, bias_term=True),
                                   [weight.to(ref.device, ref.dtype), bias.to(ref.device, ref.dtype)], *xs)

    def transformed_node(self, node):
        q = copy.copy(node)
        weight, bias = self.folded(node.attrs, node.blobs)
        q.blobs = [weight.numpy(), bias.numpy()]
        q.attrs = dict(node.attrs, bias_term=True)
        q.expected_param_shapes = [tuple(weight.shape), tuple(bias.shape)]
        q.quant, q.shared_from = {}, {}
        return q

    def weight_transform_note(self, attrs):
        return ("ConvolutionBNFixed keeps its BatchNorm folded into the weights and bias, quantized as the fork's "
                "TEST forward computes them")

    def pytorch_source(self, node, emit):
        emit.note(self.weight_transform_note(node.attrs))
        real, folded = emit.node, self.transformed_node(node)
        emit.node = folded   # the state dict holds the folded, quantized weight and bias
        try:
            return self.source_layer(folded, emit)
        finally:
            emit.node = real


@register_layer("FixedNeuron")
class FixedNeuron(Layer):
    """The activations' fixed point at TEST: the position stored in its one blob (see fix_neuron)."""
    blob_names = ("position",)

    def parse(self, lp):
        need_blobs(lp, "FixedNeuron", 1, 1)
        return fixed_attrs(lp)

    def param_shapes(self, attrs, in_shapes):
        return [(1,)]

    def init_params(self, attrs, shapes, rng):
        return [np.zeros((1,), np.float32)]

    def forward(self, attrs, params, x):
        if not attrs["fix_enable"]:
            return x
        return fix_neuron(x, params[0], attrs["bit_width"], attrs["follow_data_layer"])

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        if not a["fix_enable"]:
            ctx.add_node("Identity", [x], [node.outputs[0]], name=node.name)
            return
        p = float(np.floor(np.asarray(node.blobs[0], np.float32).reshape(-1)[0]))
        step = 2.0 ** -p
        t = ctx.op("Cast", [ctx.op("Mul", [x, ctx.f32(1.0 / step)], "scaled", name=node.name)], "wide", to=11)
        if a["follow_data_layer"]:
            whole = ctx.trunc(t)
            ctx.add_node("Mul", [ctx.op("Cast", [whole], "whole", to=1), ctx.f32(step)], [node.outputs[0]])
            return
        whole = ctx.op("Cast", [ctx.op("Floor", [ctx.op("Add", [t, ctx.const(np.array(0.5))], "half")], "floor")],
                       "whole", to=1)
        bw = a["bit_width"]
        low, high = -(2.0 ** (bw - 1)) * step, (2.0 ** (bw - 1)) * step - step
        ctx.add_node("Clip", [ctx.op("Mul", [whole, ctx.f32(step)], "fixed"), ctx.f32(low), ctx.f32(high)],
                     [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        if not a["fix_enable"]:
            return emit.inputs[0]
        m = emit.module("torch.nn.Parameter(torch.zeros(1), requires_grad=False)")
        emit.param("", 0)
        return f"{emit.helper(fix_neuron)}({emit.inputs[0]}, {m}, {a['bit_width']}, {a['follow_data_layer']})"


@register_layer("GSTiling")
class GSTiling(Layer):
    """gs_tiling_layer.cpp: channels ordered (dy, dx, c); the top is 4-axis."""

    def parse(self, lp):
        need_blobs(lp, "GSTiling", 1, 1, in_place=False)
        p = lp.gs_tiling_param
        if p.stride <= 0:
            raise LayerError(f"gs_tiling_param.stride must be > 0 (the fork's check), got {p.stride}")
        return {"stride": int(p.stride), "reverse": bool(p.reverse)}

    def infer(self, attrs, in_shapes):
        attrs["_legacy"] = list(legacy_nchw(in_shapes[0], "GSTiling"))
        return [legacy_depth_space_shape(in_shapes[0], attrs["stride"], attrs["reverse"], "gs_tiling_param.stride")]

    def forward(self, attrs, params, x):
        return gs_tiling(x.reshape(attrs["_legacy"]), attrs["stride"], attrs["reverse"])

    def onnx(self, ctx, node):
        n, c, h, w = node.attrs["_legacy"]
        s = node.attrs["stride"]
        if node.attrs["reverse"]:
            co = c // (s * s)
            six, perm, out = [n, s, s, co, h, w], [0, 3, 4, 1, 5, 2], [n, co, h * s, w * s]
        else:
            six, perm, out = [n, c, h // s, s, w // s, s], [0, 3, 5, 1, 2, 4], [n, s * s * c, h // s, w // s]
        t = ctx.op("Transpose", [ctx.op("Reshape", [node.inputs[0], ctx.i64(six)], "six", name=node.name)], "moved",
                   perm=perm)
        ctx.add_node("Reshape", [t, ctx.i64(out)], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(gs_tiling)}({emit.inputs[0]}.reshape({a['_legacy']}), {a['stride']}, {a['reverse']})"
