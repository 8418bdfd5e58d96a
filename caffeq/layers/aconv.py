"""AConvFast: the Active Convolution Unit of jyh2986/Active-Convolution (777d926; src/caffe/proto/caffe.proto
AConvParameter, include/caffe/layers/aconv_fast_layer.hpp, src/caffe/layers/aconv_fast_layer.cpp/.cu).
liyemei/Deformable-active-convolutional (8e8e0ed) carries the same layer (the same .cu and .hpp; its .cpp
differs only in Windows includes) with aconv_param = 156.

A convolution whose kh x kw taps sit at learned, real-valued positions.  One bottom (N, C, H, W), one top
(N, num_output, Ho, Wo).  Blobs, in the fork's order: the weights (num_output, C, kh, kw), the bias
(num_output) or, with bias_term false, a (1, 1, 1, 1) zero blob the forward never reads, then the tap
positions x and y, each (position_group, 1, kh, kw).

The fork's forward (Forward_gpu; its Forward_cpu is empty, so this is the GPU's result):
- pad: with aconv_param.type SQUARE (the default), convolution_param's pad minus kernel // 2 per axis (kernel_h
  / kernel_w and aconv_param's pads are refused); with CIRCLE or RANDOM, aconv_param.pad (or pad_h and pad_w,
  the unset one 0), int32 and possibly negative (convolution_param's pads are refused);
- Ho = (H + 2 pad_h - 1) / stride_h + 1 in C's truncating division (the kernel's extent plays no part);
- output channels are split into position_group groups of num_output / position_group; tap f (row-major in
  kh x kw) of group g sits at (x, y) = (xpos[g, f], ypos[g, f]);
- the tap of output pixel (ho, wo) samples channel c at row ho stride_h - pad_h + y, column wo stride_w - pad_w
  + x: with ix = floor(x), dx = x - ix (likewise iy, dy), the four pixels q11 (iy, ix), q21 (iy, ix + 1),
  q12 (iy + 1, ix), q22 (iy + 1, ix + 1), each 0 where it lies outside the image (zero padding), mixed as
  q11 (1 - dx)(1 - dy) + q21 dx (1 - dy) + q12 (1 - dx) dy + q22 dx dy; a tap on the grid (dx = dy = 0)
  reads q11 alone;
- top[n, g og + o] = sum over taps f and channels c of weight[g og + o, c, f] x sample, plus the bias when
  bias_term.
The fork checks: no dilation field at all, group 1, axis 1, base_radius > 0, num_output divisible by
position_group.  normalize (the position gradient's normalization) only trains.

Positions a caffemodel lacks (random_weights) are made as LayerSetUp makes them: with std = pos_filler_std x
base_radius, both blobs N(0, std) when std > 0 (else 0); then, per group, tap 0 at (0, 0) and tap i >= 1 plus
base_radius (cos, sin)((i - 1) 2 pi / (kh kw - 1) + base_angle), rounded to the nearest integer (nearbyint)
instead when std < 0.

ONNX: the positions are read as constants at export: the image zero-padded once, each of the four corners one
Gather of constant indices, weighted in the fork's order, then the weights as one MatMul per batch.
"""
import math

import numpy as np
import torch
import torch.nn as nn

from ..errors import ExportError
from .registry import Layer, LayerError, four_axes, need_blobs, positive_field, register_layer, spatial_params

_SQUARE = 0


def trunc_div(a: int, b: int) -> int:
    """C's integer division (toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def aconv_out_size(size: int, stride: int, pad: int) -> int:
    """AConvFastLayer::compute_output_shape: (size + 2 pad - 1) / stride + 1, C's division."""
    return trunc_div(size + 2 * pad - 1, stride) + 1


def aconv_sample(x, xpos, ypos, stride: list[int], pad: list[int]):
    """The fork's `interpolated` kernel for every tap at once: (N, C, T, Ho, Wo), T = position_group x kh x kw."""
    n, c, h, w = x.shape
    ho, wo = aconv_out_size(h, stride[0], pad[0]), aconv_out_size(w, stride[1], pad[1])
    px, py = xpos.reshape(-1, 1, 1), ypos.reshape(-1, 1, 1)
    ix, iy = torch.floor(px), torch.floor(py)
    dx, dy = px - ix, py - iy
    taps = px.shape[0]
    row = torch.arange(ho, device=x.device).reshape(1, ho, 1) * stride[0] - pad[0] + iy.long()
    col = torch.arange(wo, device=x.device).reshape(1, 1, wo) * stride[1] - pad[1] + ix.long()
    flat = x.reshape(n, c, h * w)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)

    def corner(r, q):
        inside = (r >= 0) & (r < h) & (q >= 0) & (q < w)
        at = (r.clamp(0, h - 1) * w + q.clamp(0, w - 1)).reshape(-1)
        got = flat.index_select(2, at).reshape(n, c, taps, ho, wo)
        return torch.where(inside, got, zero)

    q11, q21 = corner(row, col), corner(row, col + 1)
    q12, q22 = corner(row + 1, col), corner(row + 1, col + 1)
    val = q11 * (1 - dx) * (1 - dy) + q21 * dx * (1 - dy) + q12 * (1 - dx) * dy + q22 * dx * dy
    return torch.where((dx == 0) & (dy == 0), q11, val)


def aconv_forward(x, weight, bias: torch.Tensor | None, xpos, ypos, stride: list[int], pad: list[int]):
    """AConvFast's Forward_gpu: the sampled taps of each position group through that group's weights."""
    n, c = x.shape[0], x.shape[1]
    cout, _, kh, kw = weight.shape
    groups, taps = xpos.shape[0], kh * kw
    samples = aconv_sample(x, xpos, ypos, stride, pad)
    ho, wo = samples.shape[3], samples.shape[4]
    cols = samples.reshape(n, c, groups, taps, ho * wo).transpose(1, 2).reshape(n, groups, c * taps, ho * wo)
    y = torch.matmul(weight.reshape(groups, cout // groups, c * taps), cols).reshape(n, cout, ho, wo)
    return y if bias is None else y + bias.reshape(1, cout, 1, 1)


class AConv2d(nn.Module):
    """AConvFast with its weights (num_output, C, kh, kw), bias (num_output) and positions (groups, 1, kh, kw)."""

    def __init__(self, in_channels, out_channels, kernel, position_group, stride, pad, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_channels, in_channels, *kernel))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.xpos = nn.Parameter(torch.zeros(position_group, 1, *kernel))
        self.ypos = nn.Parameter(torch.zeros(position_group, 1, *kernel))
        self.stride, self.pad = list(stride), list(pad)

    def forward(self, x):
        return aconv_forward(x, self.weight, self.bias, self.xpos, self.ypos, self.stride, self.pad)


_NEEDS = [trunc_div, aconv_out_size, aconv_sample, aconv_forward]


def initial_positions(kernel, groups, base_radius, base_angle, filler_std, rng):
    """AConvFastLayer::LayerSetUp's positions: (x, y), each (groups, 1, kh, kw) float32."""
    f32 = np.float32
    kh, kw = kernel
    taps = kh * kw
    shape = (groups, 1, kh, kw)
    std = f32(filler_std) * f32(base_radius)
    if std > 0:
        xs = (rng.standard_normal(shape) * std).astype(f32).reshape(groups, taps)
        ys = (rng.standard_normal(shape) * std).astype(f32).reshape(groups, taps)
    else:
        xs, ys = np.zeros((groups, taps), f32), np.zeros((groups, taps), f32)
    xs[:, 0] = ys[:, 0] = 0
    if taps > 1:
        unit = f32(2.0 * math.pi / (taps - 1))
        for i in range(1, taps):
            angle = f32(f32(i - 1) * unit + f32(base_angle))
            cx, sy = f32(base_radius) * np.cos(angle), f32(base_radius) * np.sin(angle)
            if std < 0:
                xs[:, i], ys[:, i] = np.rint(cx), np.rint(sy)
            else:
                xs[:, i] += cx
                ys[:, i] += sy
    return xs.reshape(shape), ys.reshape(shape)


@register_layer("AConvFast")
class AConvFast(Layer):
    blob_names = ("weight", "bias", "xpos", "ypos")
    weight_axes = {0: 0}
    reading_note = ("AConvFast (jyh2986/Active-Convolution) has only a GPU forward (its Forward_cpu is empty): "
                    "caffeq computes the GPU's")

    def parse(self, lp):
        need_blobs(lp, "AConvFast", 1, 1)
        p, a = lp.convolution_param, lp.aconv_param
        if not p.HasField("num_output"):
            raise LayerError("convolution_param.num_output is required")
        num_output = positive_field(p.num_output, "convolution_param.num_output")
        if len(p.dilation):
            raise LayerError("convolution_param.dilation must not be given: AConvFast checks that no dilation is "
                             "set (\"Dilation parameter is not supported\")")
        if p.group != 1:
            raise LayerError(f"convolution_param.group must be 1 for AConvFast (\"Group>1 is not supported yet\"), "
                             f"got {p.group}")
        if p.axis not in (1, -3):
            raise LayerError(f"convolution_param.axis must be 1 for AConvFast, got {p.axis}")
        if not (len(p.kernel_size) or p.HasField("kernel_h") or p.HasField("kernel_w")):
            raise LayerError("convolution_param.kernel_size is required")
        kernel = spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False)
        stride = spatial_params(p, 2, "stride", 1, min_value=1, pair_required=False)
        conv_pad = spatial_params(p, 2, "pad", 0, min_value=0, pair_required=False)
        if a.type == _SQUARE:
            if p.HasField("kernel_h") or p.HasField("kernel_w"):
                raise LayerError("convolution_param.kernel_h/kernel_w are refused with aconv_param.type SQUARE "
                                 "(\"kernel_h/w is not valid for SQUARE type kernel\")")
            if a.HasField("pad") or a.HasField("pad_h") or a.HasField("pad_w"):
                raise LayerError("aconv_param.pad/pad_h/pad_w are refused with aconv_param.type SQUARE: give "
                                 "convolution_param.pad")
            pad = (conv_pad[0] - kernel[0] // 2, conv_pad[1] - kernel[1] // 2)
        else:
            if len(p.pad) or p.HasField("pad_h") or p.HasField("pad_w"):
                raise LayerError("convolution_param.pad/pad_h/pad_w are refused with a non-SQUARE aconv_param.type: "
                                 "give aconv_param.pad")
            pad = (int(a.pad_h), int(a.pad_w)) if a.HasField("pad_h") or a.HasField("pad_w") else (int(a.pad),) * 2
        groups = positive_field(a.position_group, "aconv_param.position_group")
        if num_output % groups:
            raise LayerError(f"convolution_param.num_output {num_output} not divisible by aconv_param.position_group "
                             f"{groups}")
        radius = float(np.float32(a.base_radius))
        if not radius > 0:
            raise LayerError(f"aconv_param.base_radius must be > 0, got {a.base_radius:g}")
        return {"name": lp.name, "num_output": num_output, "bias_term": bool(p.bias_term), "kernel": kernel,
                "stride": stride, "pad": pad, "position_group": groups, "base_radius": radius,
                "base_angle": float(np.float32(a.base_angle)), "pos_filler_std": float(np.float32(a.pos_filler_std))}

    def _geometry(self, attrs, shape):
        n, c, h, w = four_axes(shape, "AConvFast")
        ho, wo = (aconv_out_size(s, st, p) for s, st, p in zip((h, w), attrs["stride"], attrs["pad"]))
        if ho <= 0 or wo <= 0:
            raise LayerError(f"output would be empty: input {list(shape)}, pad {list(attrs['pad'])} (after the "
                             f"kernel's half is taken off), stride {list(attrs['stride'])}")
        return n, c, ho, wo

    def infer(self, attrs, in_shapes):
        n, _, ho, wo = self._geometry(attrs, in_shapes[0])
        return [(n, attrs["num_output"], ho, wo)]

    def param_shapes(self, attrs, in_shapes):
        c = four_axes(in_shapes[0], "AConvFast")[1]
        kh, kw = attrs["kernel"]
        pos = (attrs["position_group"], 1, kh, kw)
        return [(attrs["num_output"], c, kh, kw), (attrs["num_output"],) if attrs["bias_term"] else (1, 1, 1, 1),
                pos, pos]

    def init_params(self, attrs, shapes, rng):
        blobs = super().init_params(attrs, shapes[:1], rng)
        blobs.append(np.zeros(shapes[1], np.float32))
        blobs.extend(initial_positions(attrs["kernel"], attrs["position_group"], attrs["base_radius"],
                                       attrs["base_angle"], attrs["pos_filler_std"], rng))
        return blobs

    def macs(self, attrs, in_shapes, out_shapes):
        n, c = in_shapes[0][:2]
        _, o, ho, wo = out_shapes[0]
        taps = math.prod(attrs["kernel"])
        return n * o * ho * wo * c * taps + 4 * n * c * attrs["position_group"] * taps * ho * wo

    def forward(self, attrs, params, x):
        bias = params[1] if attrs["bias_term"] else None
        return aconv_forward(x, params[0], bias, params[2], params[3], list(attrs["stride"]), list(attrs["pad"]))

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        x = node.inputs[0]
        _, c, h, w = ctx.shape(x)
        cout, ho, wo = ctx.shape(node.outputs[0])[1:]
        if node.blobs is None or len(node.blobs) < 4 or node.blobs[2] is None or node.blobs[3] is None:
            raise ExportError(f"layer '{name}' (AConvFast): the positions (blobs 2 and 3) are not loaded")
        px = np.asarray(node.blobs[2], np.float32).reshape(-1)
        py = np.asarray(node.blobs[3], np.float32).reshape(-1)
        ix, iy = np.floor(px), np.floor(py)
        dx, dy = (px - ix).astype(np.float32), (py - iy).astype(np.float32)
        ix, iy = ix.astype(np.int64), iy.astype(np.int64)
        (sh, sw), (ph, pw) = a["stride"], a["pad"]
        groups, taps = a["position_group"], len(px)
        rows = np.arange(ho)[None, :] * sh - ph + iy[:, None]          # (T, Ho): q11's row
        cols = np.arange(wo)[None, :] * sw - pw + ix[:, None]          # (T, Wo)
        top, left = max(0, -int(rows.min())), max(0, -int(cols.min()))
        bottom, right = max(0, int(rows.max()) + 2 - h), max(0, int(cols.max()) + 2 - w)
        hp, wp = h + top + bottom, w + left + right
        if top or bottom or left or right:
            x = ctx.op("Pad", [x, ctx.i64([0, 0, top, left, 0, 0, bottom, right])], "padded", name=name)
        flat = ctx.op("Reshape", [x, ctx.i64([0, c, hp * wp])], "flat", name=name)

        def corner(dr, dc, wx, wy, hint):
            at = ((rows + dr + top)[:, :, None] * wp + (cols + dc + left)[:, None, :]).reshape(-1)
            got = ctx.op("Gather", [flat, ctx.const(at.astype(np.int64), f"{name}_{hint}_at")], hint, axis=2)
            got = ctx.op("Reshape", [got, ctx.i64([0, c, taps, ho * wo])], hint + "_taps")
            got = ctx.op("Mul", [got, ctx.const(wx.reshape(taps, 1), f"{name}_{hint}_wx")], hint + "_x")
            return ctx.op("Mul", [got, ctx.const(wy.reshape(taps, 1), f"{name}_{hint}_wy")], hint + "_xy")

        one = np.float32(1)
        q11 = corner(0, 0, one - dx, one - dy, "q11")
        val = ctx.op("Add", [q11, corner(0, 1, dx, one - dy, "q21")], "sum2")
        val = ctx.op("Add", [val, corner(1, 0, one - dx, dy, "q12")], "sum3")
        val = ctx.op("Add", [val, corner(1, 1, dx, dy, "q22")], "sum4")
        on_grid = ((dx == 0) & (dy == 0)).reshape(taps, 1)
        if on_grid.any():
            # a tap on the grid reads q11 alone (q11 x 1 x 1 is q11)
            val = ctx.op("Where", [ctx.const(on_grid, f"{name}_on_grid"), q11, val], "samples")
        val = ctx.op("Reshape", [val, ctx.i64([0, c, groups, taps // groups, ho * wo])], "samples_g")
        val = ctx.op("Transpose", [val], "samples_t", perm=[0, 2, 1, 3, 4])
        val = ctx.op("Reshape", [val, ctx.i64([0, groups, c * (taps // groups), ho * wo])], "columns")
        wmat = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([groups, cout // groups, c * (taps // groups)])],
                      "wmat")
        y = ctx.op("MatMul", [wmat, val], "mm")
        if a["bias_term"]:
            y = ctx.op("Reshape", [y, ctx.i64([0, cout, ho * wo])], "mm_flat")
            y = ctx.op("Add", [y, ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([cout, 1])], "bias")], "biased")
        ctx.add_node("Reshape", [y, ctx.i64([0, cout, ho, wo])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(AConv2d, emit.in_shape(0)[1], a["num_output"], list(a["kernel"]), a["position_group"],
                          list(a["stride"]), list(a["pad"]), a["bias_term"], needs=_NEEDS)
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        emit.param("xpos", 2)
        emit.param("ypos", 3)
        return f"{m}({emit.inputs[0]})"
