"""Activation, dropout and selector layers of single forks, each as its fork computes it at TEST.

- ReLUPlus (liuxianming/caffe_feedback 5bd19d1, reluplus_layer.cpp; V1 RELUPLUS): max(x, 0) times a
  gate blob that every ordinary forward resets to 1 (Net::ForwardPrefilled calls Reset first), so
  ReLU.  The fork's feedback mode, which gates it from the top classes down, is a whole-net procedure
  of its own tools (feedback_net.cpp), not part of a forward.
- RReLU (ducha-aiki/caffe `elu` c9b0c54, rrelu_layer.cpp; from happynear/caffe-windows): at TRAIN
  the negative part is divided by a ~ U(lb, ub); at TEST by the fork's `mean_slope` =
  (ub - lb) / (ln|ub| - ln|lb|), the logarithmic mean of lb and ub (1 / E[1/a]), *not* (lb + ub) / 2.
  y = x for x > 0, x / mean_slope otherwise.  No blobs.
- APL (forestagostinelli/Learned-Activation-Functions-Source aa1f97e, apl_layer.cpp): with
  K = count / num (every (c, h, w) position has its own hinges),
  y[n, k] = max(x, 0) + sum_s slope[k, s] * max(offset[k, s] - x, 0), summed in order s = 0, 1, ...
  Two blobs (slope, offset), each shaped (1, 1, sums, K) but indexed k * sums + s, so their memory
  is read here as (K, sums).
- GuidedDropout (Cysu/caffe `domain-guided-dropout` ab98582, guided_dropout_layer.cpp): bottoms x
  and guidance (num, channels, 1, 1).  "deterministic" (at TEST too): keep channel c of sample n
  when guidance[n, c] > guidance_threshold, times channels / kept[n] when kept[n] > 0 (all dropped
  gives zeros).  "stochastic" at TEST copies x.
- yihui-he/caffe-pro's Filter (filter_layer.cpp/.cu, 602b9e3): one top per bottom, each keeping the
  channels whose selector blob entry (C,) is non-zero, in order; the top has filter_param.num_output
  channels and the fork's GPU forward checks that the selector keeps exactly that many.  It shares
  the type name with BVLC's Filter (selector bottom, no parameters): shape_ops.Filter hands a layer
  carrying `filter_param` to `SELECTOR_FILTER` here.
- MinReLU (ALISCIFP/caffe 1d2d3f2, minrelu_layer.cpp/.cu; used by ALISCIFP/bvlc_alexnet_VReLU):
  y = min(x, 0) + positive_slope * max(x, 0) (the CAFFE engine; its GPU kernel's x < 0 ? x : x * slope
  is the same).  The fork's cuDNN engine (engine CUDNN, or DEFAULT in a cuDNN build) runs cuDNN's
  plain ReLU when positive_slope is 0, max(x, 0), the opposite; that slip is not reproduced.
- BReLU (the bilateral ReLU of a DehazeNet-style fork, brelu_layer.cpp/.cu; chaimi2013/FPCNet's deploy
  file): y = min(max(x, minval), maxval), the fork's CPU forward, Truncation's formula.  Its GPU kernel
  computes x < 1 ? (x > 0 ? x : x * minval) : maxval, the same for the bounds 0 and 1 that nets use
  (but a NaN: the CPU keeps it, the kernel gives maxval); other bounds read with a note.
- ScaleTanH (thuml/HashNet 85387b8, scale_tanh_layer.cpp/.cu): y = tanh(scale * x).  The fork's scale
  starts at init_scale and becomes init_scale * (1 + gamma * t)^power at every step_size-th reshape t
  (each forward reshapes), HashNet's continuation while training; a net loaded for inference
  computes with init_scale until its step_size-th forward, which is what caffeq computes (and, the
  scale being positive, the signs that make the hash codes are the same either way).
- GELU (kaveena/caffe-pruning b5cc626, gelu_layer.cpp/.cu; kaveena/nfnet-caffe's NFNet-F0 with NFNet's
  gamma as gelu_param.coeff): the tanh approximation, y = coeff * 0.5 * x * (1 + t) with
  t = tanh(0.7978845608 x + 0.7978845608 * 0.044715 x^3).  The fork's double literals make the argument
  and the product double; t and 1 + t are float, as here (ONNX casts the same way).
- PENLU (xncaffe/caffe_penlu 21023cd, penlu_layer.cpp): blobs alpha, beta, eta, one value per channel
  (one in all with channel_shared); y = pow(max(x, 0), eta) * (x > 0) + alpha * (exp(beta * min(x, 0)) - 1)
  * (x <= 0), the fork's CPU forward, in float32 (so eta < 0 gives NaN at x <= 0, as there).
- Leaky (shishichang/caffe 58d6174, leaky_layer.cpp/.cu; the YOLO deploy files of dongtao123/gitskills):
  y = x for x > 0, else 0.1 * x with the literal a double, so the product is rounded once from double
  (it can differ from float32's 0.1f * x in the last bit; ONNX casts the same way).  The fork CHECKs that the
  layer is not in place; caffeq computes the same either way and reads an in-place one too.
"""
import math

import numpy as np
import torch
from torch import nn

from .activation import ReLU
from .learnable_dilation import Truncation
from .registry import Layer, LayerError, canonical_axis, count, need_blobs, positive_field, register_layer


def _legacy_num_channels(shape, what):
    """num and channels as the fork's Blob::num()/channels() read them (at most 4 axes)."""
    if not 1 <= len(shape) <= 4:
        raise LayerError(f"{what} needs a 1- to 4-axis input (the fork reads num/channels), got {list(shape)}")
    return shape[0], (shape[1] if len(shape) > 1 else 1)


# ---- torch functions (model.py gets the same code) ---------------------------------------

def caffe_pruning_gelu(x, coeff: float):
    """kaveena/caffe-pruning's GELU: the tanh approximation in its double / float steps."""
    x64 = x.double()
    t = torch.tanh(0.7978845608 * x64 + 0.7978845608 * 0.044715 * x64 * x64 * x64).to(x.dtype)
    return (coeff * 0.5 * x64 * (1 + t).double()).to(x.dtype)


def leaky_tenth(x):
    """shishichang/caffe's Leaky: x where x > 0, else 0.1 * x computed in double and rounded once."""
    return torch.where(x > 0, x, (x.double() * 0.1).to(x.dtype))


def rrelu_test(x, mean_slope: float):
    """ducha-aiki's RReLU at TEST: negative inputs divided by the fork's mean slope."""
    return torch.where(x > 0, x, x / mean_slope)


def min_relu(x, positive_slope: float):
    """ALISCIFP's MinReLU: negative inputs kept, positive ones times positive_slope."""
    return torch.clamp_max(x, 0) + positive_slope * torch.clamp_min(x, 0)


def adaptive_piecewise_linear(x, slope, offset, sums: int):
    """APL: max(x, 0) + sum_s slope[k, s] * max(offset[k, s] - x, 0) per position k, s in order."""
    flat = x.flatten(1)   # zero rows too (a reshape to -1 cannot size them)
    slopes, offsets = slope.reshape(-1, sums), offset.reshape(-1, sums)   # memory is k * sums + s
    y = flat.clamp(min=0)
    for s in range(sums):
        y = y + slopes[:, s] * (offsets[:, s] - flat).clamp(min=0)
    return y.reshape(x.shape)


class AdaptivePiecewiseLinear(nn.Module):
    """APL with its slope and offset blobs, (1, 1, sums, K) each."""

    def __init__(self, sums, positions):
        super().__init__()
        self.sums = sums
        self.slope = nn.Parameter(torch.zeros(1, 1, sums, positions))
        self.offset = nn.Parameter(torch.zeros(1, 1, sums, positions))

    def forward(self, x):
        return adaptive_piecewise_linear(x, self.slope, self.offset, self.sums)


def guided_dropout(x, guidance, threshold: float):
    """Deterministic guided dropout: channels whose guidance > threshold, rescaled by C / kept."""
    n = x.shape[0]
    c = x.shape[1] if x.dim() > 1 else 1
    mask = (guidance.reshape(n, c, 1) > threshold).to(x.dtype)
    kept = mask.sum(dim=1, keepdim=True)
    y = x.reshape(n, c, -1) * mask
    return torch.where(kept > 0, y * c / kept, y).reshape(x.shape)


def select_channels(x, selector, num_output: int):
    """yihui-he's Filter: the channels of x whose selector entry is non-zero (there must be num_output)."""
    keep = torch.nonzero(selector.reshape(-1) != 0).flatten()
    if keep.numel() != num_output:
        raise ValueError(f"Filter: the selector keeps {keep.numel()} channels, "
                         f"filter_param.num_output is {num_output}")
    return x.index_select(1, keep)


class ChannelSelector(nn.Module):
    """yihui-he's Filter with its selector blob (C,)."""

    def __init__(self, channels, num_output):
        super().__init__()
        self.num_output = num_output
        self.selector = nn.Parameter(torch.ones(channels))

    def forward(self, x):
        return select_channels(x, self.selector, self.num_output)


# ---- RReLU ---------------------------------------------------------------------------------

@register_layer("RReLU")
class RReLU(Layer):
    #: the LayerParameter field holding lb and ub (happynear's Insanity reads insanity_param)
    param_field = "rrelu_param"

    def parse(self, lp):
        what, field = self.types[0], self.param_field
        need_blobs(lp, what, 1, 1)
        param = getattr(lp, field)
        lb, ub = float(param.lb), float(param.ub)
        if not ub > lb:
            raise LayerError(f"{field}.ub must be > {field}.lb, got lb {lb} and ub {ub}")
        if lb * ub == 0:
            raise LayerError(f"{field}.lb and ub must not be 0, got lb {lb} and ub {ub}")
        spread = math.log(abs(ub)) - math.log(abs(lb))
        if spread == 0:
            raise LayerError(f"{field}.lb {lb} and ub {ub} have the same magnitude: the fork's "
                             f"mean slope (ub - lb) / (ln|ub| - ln|lb|) divides by zero")
        # Caffe keeps mean_slope in float
        return {"lb": lb, "ub": ub, "mean_slope": float(np.float32((ub - lb) / spread))}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) < 2:
            raise LayerError(f"{self.types[0]} needs an input of at least 2 axes, got {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x):
        return rrelu_test(x, attrs["mean_slope"])

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        slope = ctx.const(np.array(node.attrs["mean_slope"], np.float32), name + "_mean_slope")
        pos = ctx.add_node("Greater", [x, ctx.const(np.array(0, np.float32))], ctx.tmp(name + "_pos"), name=name)
        neg = ctx.add_node("Div", [x, slope], ctx.tmp(name + "_neg"))
        ctx.add_node("Where", [pos, x, neg], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(rrelu_test)
        return f"{fn}({emit.inputs[0]}, {emit.lit(node.attrs['mean_slope'])})"


# ---- Leaky ------------------------------------------------------------------------------------

@register_layer("Leaky")
class Leaky(Layer):
    """shishichang/caffe's YOLO Leaky (see the module docstring)."""

    bottoms = tops = 1

    def parse(self, lp):
        need_blobs(lp, "Leaky", 1, 1)
        return {}

    def forward(self, attrs, params, x):
        return leaky_tenth(x)

    def onnx(self, ctx, node):
        from onnx import TensorProto
        x = node.inputs[0]
        x64 = ctx.op("Cast", [x], "x64", name=node.name, to=TensorProto.DOUBLE)
        tenth = ctx.op("Cast", [ctx.op("Mul", [x64, ctx.const(np.array(0.1, np.float64))], "tenth64")], "tenth",
                       to=TensorProto.FLOAT)
        positive = ctx.op("Greater", [x, ctx.f32(0.0)], "positive")
        ctx.add_node("Where", [positive, x, tenth], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(leaky_tenth)}({emit.inputs[0]})"


# ---- MinReLU --------------------------------------------------------------------------------

@register_layer("MinReLU")
class MinReLU(Layer):
    def parse(self, lp):
        need_blobs(lp, "MinReLU", 1, 1)
        attrs = {"positive_slope": float(lp.minrelu_param.positive_slope)}
        if int(lp.minrelu_param.engine) == 2 and attrs["positive_slope"] == 0:
            attrs["reading_notes"] = ["MinReLU engine CUDNN: the fork's cuDNN layer would run a plain ReLU "
                                      "here; read as its CAFFE engine, min(x, 0)"]
        return attrs

    def forward(self, attrs, params, x):
        return min_relu(x, attrs["positive_slope"])

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        zero = ctx.const(np.array(0, np.float32))
        neg = ctx.add_node("Min", [x, zero], ctx.tmp(name + "_neg"), name=name)
        slope = node.attrs["positive_slope"]
        pos = ctx.add_node("Max", [x, zero], ctx.tmp(name + "_pos"))
        pos = ctx.add_node("Mul", [pos, ctx.const(np.array(slope, np.float32), name + "_slope")],
                           ctx.tmp(name + "_scaled"))
        ctx.add_node("Add", [neg, pos], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(min_relu)
        return f"{fn}({emit.inputs[0]}, {emit.lit(node.attrs['positive_slope'])})"


# ---- APL -----------------------------------------------------------------------------------

_FILLERS = ("uniform", "gaussian", "constant")


def _filler(p, field, default):
    if not p.HasField(field):
        return default
    f = getattr(p, field)
    return {"type": f.type, "min": float(f.min), "max": float(f.max), "mean": float(f.mean),
            "std": float(f.std), "value": float(f.value)}


def _fill(filler, shape, rng, field):
    kind = filler["type"]
    if kind == "uniform":
        return rng.uniform(filler["min"], filler["max"], shape).astype(np.float32)
    if kind == "gaussian":
        return (filler["mean"] + filler["std"] * rng.standard_normal(shape)).astype(np.float32)
    if kind == "constant":
        return np.full(shape, filler["value"], np.float32)
    raise LayerError(f"{field} type '{kind}': only {', '.join(_FILLERS)} can fill a missing blob")


@register_layer("APL")
class APL(Layer):
    blob_names = ("slope", "offset")

    def parse(self, lp):
        need_blobs(lp, "APL", 1, 1)
        p = lp.apl_param
        sums = int(p.sums)
        positive_field(sums, "apl_param.sums")
        # the fork's fillers when none is given (apl_layer.cpp LayerSetUp)
        slope = _filler(p, "slope_filler", {"type": "uniform", "min": -0.5 / sums, "max": 0.5 / sums})
        offset = _filler(p, "offset_filler", {"type": "gaussian", "mean": 0.0, "std": 0.5})
        return {"sums": sums, "slope_filler": slope, "offset_filler": offset}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if not 2 <= len(s) <= 4:
            raise LayerError(f"APL needs a 2- to 4-axis input (the fork reads num()), got {list(s)}")
        return [tuple(s)]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        return [(1, 1, attrs["sums"], count(in_shapes[0], 1))] * 2

    def init_params(self, attrs, shapes, rng):
        return [_fill(attrs["slope_filler"], shapes[0], rng, "apl_param.slope_filler"),
                _fill(attrs["offset_filler"], shapes[1], rng, "apl_param.offset_filler")]

    def forward(self, attrs, params, x):
        return adaptive_piecewise_linear(x, params[0], params[1], attrs["sums"])

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0]) * attrs["sums"]

    def onnx(self, ctx, node):
        x, name, sums = node.inputs[0], node.name, node.attrs["sums"]
        grid = ctx.const(np.array([-1, sums], np.int64))
        flat = ctx.merge_axes(x, 1, name=name)
        slopes = ctx.add_node("Reshape", [ctx.weight(node, 0), grid], ctx.tmp(name + "_slopes"))
        offsets = ctx.add_node("Reshape", [ctx.weight(node, 1), grid], ctx.tmp(name + "_offsets"))
        y = ctx.add_node("Relu", [flat], ctx.tmp(name + "_relu"))
        for s in range(sums):
            column = ctx.const(np.array(s, np.int64))
            a = ctx.add_node("Gather", [slopes, column], ctx.tmp(f"{name}_slope{s}"), axis=1)
            b = ctx.add_node("Gather", [offsets, column], ctx.tmp(f"{name}_offset{s}"), axis=1)
            gap = ctx.add_node("Sub", [b, flat], ctx.tmp(f"{name}_gap{s}"))
            hinge = ctx.add_node("Relu", [gap], ctx.tmp(f"{name}_hinge{s}"))
            term = ctx.add_node("Mul", [a, hinge], ctx.tmp(f"{name}_term{s}"))
            y = ctx.add_node("Add", [y, term], ctx.tmp(f"{name}_sum{s}"))
        ctx.add_node("Reshape", [y, ctx.op("Shape", [x], "shape")], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.instance(AdaptivePiecewiseLinear, node.attrs["sums"], count(emit.in_shape(0), 1),
                          needs=[adaptive_piecewise_linear])
        emit.param("slope", 0)
        emit.param("offset", 1)
        return f"{m}({emit.inputs[0]})"


# ---- GuidedDropout ---------------------------------------------------------------------------

@register_layer("GuidedDropout")
class GuidedDropout(Layer):
    def parse(self, lp):
        need_blobs(lp, "GuidedDropout", 2, 1, roles="x, guidance")
        p = lp.guided_dropout_param
        if p.type not in ("deterministic", "stochastic"):
            raise LayerError(f'guided_dropout_param.type must be "deterministic" or "stochastic", got {p.type!r}')
        return {"deterministic": p.type == "deterministic", "threshold": float(p.guidance_threshold)}

    def infer(self, attrs, in_shapes):
        x, g = in_shapes
        n, c = _legacy_num_channels(x, "GuidedDropout")
        if not 1 <= len(g) <= 4 or tuple(g) + (1,) * (4 - len(g)) != (n, c, 1, 1):
            raise LayerError(f"GuidedDropout's guidance {list(g)} must be (num {n}, channels {c}, 1, 1) "
                             f"for the input {list(x)}")
        return [tuple(x)]

    def forward(self, attrs, params, x, guidance):
        if not attrs["deterministic"]:
            return x.clone()          # "stochastic" copies its bottom at TEST
        return guided_dropout(x, guidance, attrs["threshold"])

    def onnx(self, ctx, node):
        x, g = node.inputs
        out, name = node.outputs[0], node.name
        if not node.attrs["deterministic"]:
            ctx.add_node("Identity", [x], [out], name=name)
            return
        from .norm import onnx_reduce
        shape = list(ctx.shape(x))
        n, c = shape[0], (shape[1] if len(shape) > 1 else 1)
        x3 = ctx.add_node("Reshape", [x, ctx.const(np.array([n, c, -1], np.int64))], ctx.tmp(name + "_x3"),
                          name=name)
        g3 = ctx.add_node("Reshape", [g, ctx.const(np.array([n, c, 1], np.int64))], ctx.tmp(name + "_g3"))
        over = ctx.add_node("Greater", [g3, ctx.const(np.array(node.attrs["threshold"], np.float32))],
                            ctx.tmp(name + "_over"))
        mask = ctx.add_node("Cast", [over], ctx.tmp(name + "_mask"), to=1)
        kept = onnx_reduce(ctx, "ReduceSum", mask, [1], True, ctx.tmp(name + "_kept"))
        y = ctx.add_node("Mul", [x3, mask], ctx.tmp(name + "_masked"))
        times_c = ctx.add_node("Mul", [y, ctx.const(np.array(c, np.float32))], ctx.tmp(name + "_times_c"))
        scaled = ctx.add_node("Div", [times_c, kept], ctx.tmp(name + "_scaled"))
        any_kept = ctx.add_node("Greater", [kept, ctx.const(np.array(0, np.float32))], ctx.tmp(name + "_any"))
        picked = ctx.add_node("Where", [any_kept, scaled, y], ctx.tmp(name + "_picked"))
        ctx.add_node("Reshape", [picked, ctx.const(np.array(shape, np.int64))], [out])

    def pytorch_source(self, node, emit):
        x, g = emit.inputs
        if not node.attrs["deterministic"]:
            return f"{x}.clone()"
        fn = emit.helper(guided_dropout)
        return f"{fn}({x}, {g}, {emit.lit(node.attrs['threshold'])})"


# ---- yihui-he's Filter (reached through shape_ops.Filter) ---------------------------------------

class SelectorFilter(Layer):
    """yihui-he/caffe-pro's Filter: one top per bottom, the channels its selector blob keeps."""

    blob_names = ("selector",)

    def parse(self, lp):
        p = lp.filter_param
        if not len(lp.bottom) or len(lp.top) != len(lp.bottom):
            raise LayerError(f"Filter with filter_param (yihui-he/caffe-pro) takes one top per bottom, got "
                             f"{len(lp.bottom)} bottom(s) and {len(lp.top)} top(s)")
        if p.num_output <= 0:
            raise LayerError(f"filter_param.num_output must be > 0 (the channels the selector keeps), "
                             f"got {p.num_output}")
        return {"fork": "yihui-he", "axis": int(p.axis), "num_output": int(p.num_output)}

    def infer(self, attrs, in_shapes):
        channels = None
        for s in in_shapes:
            # the fork's kernel reads shape(1..3) as (C, H, W) whatever the axis: 4-axis only
            if len(s) != 4:
                raise LayerError(f"Filter with filter_param needs 4-axis bottoms, got {list(s)}")
            if canonical_axis(attrs["axis"], 4, "filter_param.axis") != 1:
                raise LayerError(f"filter_param.axis {attrs['axis']}: the fork's forward selects channels "
                                 f"(axis 1) only")
            if channels is not None and s[1] != channels:
                raise LayerError(f"Filter's bottoms must share the selector's {channels} channels, got {list(s)}")
            channels = s[1]
        if attrs["num_output"] > channels:
            raise LayerError(f"filter_param.num_output {attrs['num_output']} exceeds the {channels} channels")
        return [(s[0], attrs["num_output"]) + tuple(s[2:]) for s in in_shapes]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        return [(in_shapes[0][1],)]

    def init_params(self, attrs, shapes, rng):
        # the fork fills ones, which its forward rejects unless num_output is every channel:
        # keep the first num_output channels instead, so a net without weights runs
        sel = np.zeros(shapes[0], np.float32)
        sel[:attrs["num_output"]] = 1
        return [sel]

    def forward(self, attrs, params, *xs):
        try:
            ys = tuple(select_channels(x, params[0], attrs["num_output"]) for x in xs)
        except ValueError as e:
            raise LayerError(str(e)) from None
        return ys[0] if len(ys) == 1 else ys

    def onnx(self, ctx, node):
        cond = ctx.add_node("Cast", [ctx.weight(node, 0)], ctx.tmp(node.name + "_keep"), name=node.name,
                            to=9)   # BOOL: non-zero -> kept, as the fork's `if (*selector)`
        for x, out in zip(node.inputs, node.outputs):
            ctx.add_node("Compress", [x, cond], [out], axis=1)

    def pytorch_source(self, node, emit):
        m = emit.instance(ChannelSelector, emit.in_shape(0)[1], node.attrs["num_output"], needs=[select_channels])
        emit.param("selector", 0)
        return [f"{m}({x})" for x in emit.inputs]


SELECTOR_FILTER = SelectorFilter()
SELECTOR_FILTER.types = ("Filter",)


def is_selector_filter(attrs):
    return attrs.get("fork") == "yihui-he"


__all__ = ["APL", "SELECTOR_FILTER", "AdaptivePiecewiseLinear", "ChannelSelector", "GuidedDropout", "RReLU",
           "adaptive_piecewise_linear", "guided_dropout", "is_selector_filter", "rrelu_test", "select_channels"]


@register_layer("BReLU")
class BReLU(Truncation):
    """Truncation's clamp with brelu_param's bounds (see the module docstring)."""

    def parse(self, lp):
        need_blobs(lp, "BReLU", 1, 1)
        p = lp.brelu_param
        lo, hi = float(np.float32(p.minval)), float(np.float32(p.maxval))
        attrs = {"min": lo, "max": hi}
        if (lo, hi) != (0.0, 1.0):
            attrs["reading_notes"] = [f"BReLU bounds {lo:g}, {hi:g}: computed as the fork's CPU forward, "
                                      f"min(max(x, minval), maxval); its GPU kernel, x < 1 ? (x > 0 ? x : "
                                      f"x * minval) : maxval, differs for bounds other than 0 and 1"]
        return attrs


def scaled_tanh(x, scale: float):
    """HashNet's ScaleTanH forward: tanh(scale * x), the product in float32."""
    return torch.tanh(x * scale)


@register_layer("ScaleTanH")
class ScaleTanH(Layer):
    """tanh(init_scale * x) (see the module docstring)."""

    bottoms = tops = 1

    def parse(self, lp):
        need_blobs(lp, "ScaleTanH", 1, 1)
        p = lp.scale_tanh_param
        attrs = {"scale": float(np.float32(p.init_scale))}
        if p.power != 0 and p.step_size:
            attrs["reading_notes"] = [f"ScaleTanH computes with init_scale {attrs['scale']:g}: the fork raises its "
                                      f"scale every {p.step_size} forwards (HashNet's continuation), from the "
                                      f"{p.step_size}th forward of a loaded net on"]
        return attrs

    def forward(self, attrs, params, x):
        return scaled_tanh(x, attrs["scale"])

    def onnx(self, ctx, node):
        scaled = ctx.add_node("Mul", [node.inputs[0], ctx.const(np.array(node.attrs["scale"], np.float32))],
                              [ctx.tmp(node.name + "_scaled")], name=node.name)[0]
        ctx.add_node("Tanh", [scaled], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(scaled_tanh)}({emit.inputs[0]}, {emit.lit(node.attrs['scale'])})"



@register_layer("GELU")
class GELU(Layer):
    """kaveena/caffe-pruning's GELU (see the module docstring)."""

    bottoms = tops = 1

    def parse(self, lp):
        need_blobs(lp, "GELU", 1, 1)
        return {"coeff": float(np.float32(lp.gelu_param.coeff))}

    def forward(self, attrs, params, x):
        return caffe_pruning_gelu(x, attrs["coeff"])

    def onnx(self, ctx, node):
        from onnx import TensorProto
        x64 = ctx.op("Cast", [node.inputs[0]], "x64", name=node.name, to=TensorProto.DOUBLE)

        def f64(v):
            return ctx.const(np.array(v, np.float64))
        cube = ctx.op("Mul", [ctx.op("Mul", [ctx.op("Mul", [f64(0.7978845608 * 0.044715), x64], "c1"), x64], "c2"),
                              x64], "c3")
        arg = ctx.op("Add", [ctx.op("Mul", [f64(0.7978845608), x64], "lin"), cube], "arg")
        t = ctx.op("Cast", [ctx.op("Tanh", [arg], "tanh64")], "tanh", to=TensorProto.FLOAT)
        one_plus = ctx.op("Cast", [ctx.op("Add", [ctx.f32(1.0), t], "one_plus")], "one_plus64", to=TensorProto.DOUBLE)
        y = ctx.op("Mul", [ctx.op("Mul", [f64(node.attrs["coeff"] * 0.5), x64], "half_x"), one_plus], "y64")
        ctx.add_node("Cast", [y], [node.outputs[0]], to=TensorProto.FLOAT)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(caffe_pruning_gelu)}({emit.inputs[0]}, {emit.lit(node.attrs['coeff'])})"


@register_layer("ReLUPlus")
class ReLUPlus(ReLU):
    """caffe_feedback's RELUPLUS: ReLU in every ordinary forward (see the module docstring)."""


# ---- PENLU ------------------------------------------------------------------------------------


def penlu(x, alpha, beta, eta):
    """PENLU's CPU forward (see the module docstring); the blobs per channel (axis 1) or single values."""
    view = (1, -1) + (1,) * (x.dim() - 2)
    alpha, beta, eta = (v.reshape(view) for v in (alpha, beta, eta))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    positive = torch.pow(torch.maximum(x, zero), eta) * (x > 0)
    negative = alpha * (torch.exp(beta * torch.minimum(x, zero)) - 1) * (x <= 0)
    return positive + negative


class PENLUModule(nn.Module):
    def __init__(self, shape: tuple):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(shape))
        self.beta = nn.Parameter(torch.ones(shape))
        self.eta = nn.Parameter(torch.ones(shape))

    def forward(self, x):
        return penlu(x, self.alpha, self.beta, self.eta)


@register_layer("PENLU")
class PENLU(Layer):
    blob_names = ("alpha", "beta", "eta")

    def parse(self, lp):
        need_blobs(lp, "PENLU", 1, 1)
        p = lp.penlu_param
        one = {"type": "constant", "value": 1.0}
        return {"shared": bool(p.channel_shared),
                "fillers": [_filler(p, f"{k}_filler", one) for k in ("alpha", "beta", "eta")]}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) < 2:
            raise LayerError(f"PENLU needs at least 2 axes (the fork checks it), got {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        return [() if attrs["shared"] else (int(in_shapes[0][1]),)] * 3

    def init_params(self, attrs, shapes, rng):
        return [_fill(f, s, rng, f"penlu_param.{k}_filler")
                for f, s, k in zip(attrs["fillers"], shapes, self.blob_names)]

    def forward(self, attrs, params, x):
        return penlu(x, *params)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        rank = len(ctx.shape(x))
        view = [1, -1] + [1] * (rank - 2)
        alpha, beta, eta = (ctx.op("Reshape", [ctx.weight(node, k), ctx.i64(view)], name)
                            for k, name in enumerate(self.blob_names))
        zero = ctx.f32(0.0)
        above = ctx.op("Cast", [ctx.op("Greater", [x, zero], "above_b", name=node.name)], "above", to=1)
        below = ctx.op("Cast", [ctx.op("LessOrEqual", [x, zero], "below_b")], "below", to=1)
        positive = ctx.op("Mul", [ctx.op("Pow", [ctx.op("Max", [x, zero], "pos"), eta], "power"), above], "positive")
        grown = ctx.op("Sub", [ctx.op("Exp", [ctx.op("Mul", [beta, ctx.op("Min", [x, zero], "neg")], "bx")], "e"),
                               ctx.f32(1.0)], "em1")
        negative = ctx.op("Mul", [ctx.op("Mul", [alpha, grown], "scaled"), below], "negative")
        ctx.add_node("Add", [positive, negative], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        shape = tuple(np.shape(node.blobs[0]))
        m = emit.instance(PENLUModule, shape, needs=[penlu])
        for k, name in enumerate(self.blob_names):
            emit.param(name, k)
        return f"{m}({emit.inputs[0]})"
