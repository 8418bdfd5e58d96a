"""SubCNN's layers (yuxng/caffe-fast-rcnn, branch fast-rcnn 5393518: src/caffe/layers/
feature_extrapolating_layer.cpp / .cu, heatmap_generating_layer.cpp / .cu; the same on CPU and GPU).

- FeatureExtrapolating (feature_extrapolating_param num_scale_base B, num_per_octave P, scale_string):
  the bottom holds B maps per image (one per base scale, read from scale_string with strtod); the top
  S = (B - 1) P + 1 maps per image, scale i = base[i / P] + (i % P) (base[i / P + 1] - base[i / P]) / P
  (doubles).  A base scale (i % P == 0) copies its map; another samples the map of base roundf(i / P)
  bilinearly at (w / f, h / f), f = scale / that base scale, where that point lies inside the map (else
  0): the four neighbours inside the map, in the order (x, y), (x, y + 1), (x + 1, y), (x + 1, y + 1),
  each weight (1 - ux or ux) (1 - uy or uy) times the value in double, added to a float32 sum.  N / B
  images (a remainder is not read).
- HeatmapGenerating: (N, C, H, W) -> (N, 1, H, W), the largest of channels 1..C-1 where it exceeds -1,
  else -1 (NaN never wins).
"""
import math
import re

import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer

DOUBLE, FLOAT = 11, 1   # onnx.TensorProto


def read_scales(text, count):
    """scale_string's first `count` numbers, as the fork's repeated std::stod reads them."""
    found = re.findall(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)", text)
    if len(found) < count:
        raise LayerError(f"feature_extrapolating_param.scale_string '{text}' holds {len(found)} numbers, "
                         f"num_scale_base is {count}")
    return [float(v) for v in found[:count]]


def scale_pyramid(bases, per_octave):
    """(factor, base map index, copied?) of each output scale, as the fork's Reshape computes them."""
    out = []
    for i in range((len(bases) - 1) * per_octave + 1):
        base, j = bases[i // per_octave], i % per_octave
        scale = base if j == 0 else base + j * ((bases[i // per_octave + 1] - base) / per_octave)
        mapped = int(math.floor(float(np.float32(i) / np.float32(per_octave)) + 0.5))   # roundf
        out.append((scale / bases[mapped], mapped, j == 0))
    return out


def extrapolation_taps(height: int, width: int, factors: list[float], copied: list[bool], device: torch.device):
    """Per output scale and tap (4), each pixel's source index in its H x W map, its double weight and
    whether the tap is read: (S, 4, H W) int64, float64, bool."""
    f64 = torch.float64
    hs = torch.arange(height, dtype=f64, device=device)[:, None].expand(height, width).reshape(-1)
    ws = torch.arange(width, dtype=f64, device=device)[None, :].expand(height, width).reshape(-1)
    pixels = torch.arange(height * width, device=device)
    indices, weights, valids = [], [], []
    for factor, copy in zip(factors, copied):
        if copy:
            off = torch.zeros_like(pixels, dtype=torch.bool)
            indices.append(torch.stack([pixels, pixels, pixels, pixels]))
            weights.append(torch.stack([torch.ones_like(hs)] + [torch.zeros_like(hs)] * 3))
            valids.append(torch.stack([~off, off, off, off]))
            continue
        xp, yp = ws / factor, hs / factor
        inside = (xp >= 0) & (xp < width) & (yp >= 0) & (yp < height)
        xi, yi = torch.floor(xp), torch.floor(yp)
        ux, uy = xp - xi, yp - yi
        tap_index, tap_weight, tap_valid = [], [], []
        for dx in (0, 1):
            for dy in (0, 1):
                x, y = xi + dx, yi + dy
                ok = inside & (x >= 0) & (x < width) & (y >= 0) & (y < height)
                tap_index.append(torch.where(ok, y * width + x, torch.zeros_like(x)).to(torch.int64))
                tap_weight.append((1 - ux if dx == 0 else ux) * (1 - uy if dy == 0 else uy))
                tap_valid.append(ok)
        indices.append(torch.stack(tap_index))
        weights.append(torch.stack(tap_weight))
        valids.append(torch.stack(tap_valid))
    return torch.stack(indices), torch.stack(weights), torch.stack(valids)


def extrapolate_features(x, bases: int, mapping: list[int], factors: list[float], copied: list[bool]):
    """FeatureExtrapolating: (N, C, H, W) -> (N / bases * S, C, H, W), S = len(factors)."""
    n, c, h, w = x.shape
    images, scales = n // bases, len(factors)
    grouped = x[:images * bases].reshape(images, bases, c, h * w)
    base = grouped.index_select(1, torch.tensor(mapping, device=x.device))          # (I, S, C, H W)
    index, weight, valid = extrapolation_taps(h, w, factors, copied, x.device)
    out = torch.zeros_like(base)
    for t in range(4):
        idx = index[:, t][None, :, None, :].expand(images, scales, c, h * w)
        term = weight[:, t][None, :, None, :] * torch.gather(base, 3, idx).double()
        term = torch.where(valid[:, t][None, :, None, :], term, torch.zeros_like(term))
        out = (out.double() + term).to(x.dtype)
    return out.reshape(images * scales, c, h, w)


def heatmap_max(x):
    """HeatmapGenerating: max(-1, channels 1.. of x), NaN skipped -> (N, 1, H, W)."""
    rest = x[:, 1:]
    rest = torch.where(torch.isnan(rest), torch.full_like(rest, -1.0), rest)
    floor = torch.full_like(x[:, :1], -1.0)
    return torch.maximum(floor, rest.amax(1, keepdim=True)) if rest.shape[1] else floor


@register_layer("FeatureExtrapolating")
class FeatureExtrapolating(Layer):
    def parse(self, lp):
        need_blobs(lp, "FeatureExtrapolating", 1, 1)
        p = lp.feature_extrapolating_param
        if p.num_per_octave < 1 or p.num_scale_base < 1:
            raise LayerError("feature_extrapolating_param.num_per_octave and num_scale_base must be > 0")
        bases = read_scales(p.scale_string, int(p.num_scale_base))
        if any(not b > 0 for b in bases):
            raise LayerError(f"feature_extrapolating_param.scale_string's scales must be > 0, got {bases}")
        pyramid = scale_pyramid(bases, int(p.num_per_octave))
        return {"bases": len(bases), "factors": [f for f, _, _ in pyramid], "mapping": [m for _, m, _ in pyramid],
                "copied": [c for _, _, c in pyramid]}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "FeatureExtrapolating")
        return [(n // attrs["bases"] * len(attrs["factors"]), c, h, w)]

    def macs(self, attrs, in_shapes, out_shapes):
        return 4 * int(np.prod(out_shapes[0]))

    def _args(self, a):
        return (a["bases"], a["mapping"], a["factors"], a["copied"])

    def forward(self, attrs, params, x):
        return extrapolate_features(x, *self._args(attrs))

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        _, c, h, w = ctx.shape(x)
        index, weight, valid = (t.numpy() for t in extrapolation_taps(h, w, a["factors"], a["copied"],
                                                                        torch.device("cpu")))
        items = ctx.op("Gather", [ctx.op("Shape", [x], "x_shape", name=node.name), ctx.i64([0])], "items", axis=0)
        whole = ctx.op("Mul", [ctx.op("Div", [items, ctx.i64([a["bases"]])], "images"), ctx.i64([a["bases"]])],
                       "whole")   # a remainder map is not read
        x = ctx.op("Slice", [x, ctx.i64([0]), whole, ctx.i64([0])], "read")
        grouped = ctx.op("Reshape", [x, ctx.i64([-1, a["bases"], c, h * w])], "grouped")
        base = ctx.op("Gather", [grouped, ctx.i64(a["mapping"])], "base_maps", axis=1)
        shape = ctx.op("Shape", [base], "base_shape")
        out = None
        for t in range(4):
            idx = ctx.op("Expand", [ctx.const(index[None, :, t, None, :], f"{node.name}_index{t}"), shape],
                         f"index{t}")
            term = ctx.op("Mul", [ctx.const(weight[None, :, t, None, :], f"{node.name}_weight{t}"),
                                  ctx.op("Cast", [ctx.op("GatherElements", [base, idx], f"tap{t}", axis=3)],
                                         f"tap{t}_double", to=DOUBLE)], f"term{t}")
            term = ctx.op("Where", [ctx.const(valid[None, :, t, None, :], f"{node.name}_valid{t}"), term,
                                    ctx.const(np.array(0.0))], f"read{t}")
            total = term if out is None else ctx.op("Add", [ctx.op("Cast", [out], f"sum{t}_double", to=DOUBLE), term],
                                                    f"sum{t}")
            out = ctx.op("Cast", [total], f"sum{t}_float", to=FLOAT)
        ctx.add_node("Reshape", [out, ctx.i64([-1, c, h, w])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(extrapolation_taps)
        fn = emit.helper(extrapolate_features)
        return f"{fn}({emit.inputs[0]}, {', '.join(emit.lit(v) for v in self._args(node.attrs))})"


@register_layer("HeatmapGenerating")
class HeatmapGenerating(Layer):
    def parse(self, lp):
        need_blobs(lp, "HeatmapGenerating", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        n, _, h, w = four_axes(in_shapes[0], "HeatmapGenerating")
        return [(n, 1, h, w)]

    def forward(self, attrs, params, x):
        return heatmap_max(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        channels = ctx.shape(x)[1]
        floor = ctx.f32(np.full((1, 1, 1, 1), -1.0, np.float32))
        if channels < 2:   # no class channel: -1 everywhere
            ctx.add_node("Expand", [floor, ctx.op("Shape", [x], "map_shape", name=node.name)], [node.outputs[0]])
            return
        rest = ctx.op("Slice", [x, ctx.i64([1]), ctx.i64([channels]), ctx.i64([1])], "classes", name=node.name)
        rest = ctx.op("Where", [ctx.op("IsNaN", [rest], "nan"), floor, rest], "no_nan")
        best = onnx_reduce(ctx, "ReduceMax", rest, [1], True, ctx.tmp(node.name + "_best"))
        ctx.add_node("Max", [floor, best], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(heatmap_max)}({emit.inputs[0]})"
