"""Oriented Response Networks as MhLiao/RRD (83a3332) ships them: `orn_param { orientations: n }` on
Convolution (active rotating filters, ARF), and the layer types Extend and ORPooling.

Read from the fork's own code (src/caffe/layers/base_conv_layer.cpp LayerSetUp,
include/caffe/layers/base_conv_layer.hpp init_indices, conv_layer.cpp/.cu RotateARF,
extend_layer.cpp/.cu, orpooling_layer.cpp/.cu):

- Convolution with n = 4 or 8 orientations (the only counts whose rotation indices the fork builds;
  any other n > 1 makes its Forward read indices it never set, so caffeq refuses it): 2-D, a square
  1x1 or 3x3 kernel, group 1, num_output and the input channels multiples of n.  The weight blob
  keeps Caffe's shape (O*n, I*n, k, k).  Before every forward the fork overwrites output channels
  o*n + r (r = 1..n-1) with the filter of channel o*n rotated by r steps of 360/n degrees: the
  orientation channel of its input moves from c to (c + r) mod n, and each 3x3 tap moves r (n = 8)
  or 2r (n = 4) places clockwise around the centre.  So only channels o*n are read; the others are
  copies (and the fork sums their gradients into the source, which the gather below does too).
  Deconvolution is a BaseConvolutionLayer there as well but never rotates: caffeq reads orn_param on
  Convolution only.
- Extend (n > 1, 4-D): channel c of the bottom becomes channels c*n .. c*n + n-1 of the top.  The
  fork's backward is empty (no gradient reaches the bottom); caffeq's tensors carry one.
- ORPooling (n > 1, 4-D, C a multiple of n): top channel c is the max over bottom channels
  c*n .. c*n + n-1, starting from -999999 and taking a value only when strictly greater, so NaN is
  skipped and a top is never below -999999.

RRD's PriorBox and DetectionOutput are TextBoxes++'s, byte for byte (bbox_util.cpp/.cu,
detection_output_layer.cpp/.cu, prior_box_layer.cpp identical to MhLiao/TextBoxes_plusplus): see
caffeq/layers/ssd.
"""
import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .norm import onnx_reduce
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer

#: orientation counts for which RRD builds its rotation indices
ARF_ORIENTATIONS = (4, 8)
#: ORPooling's starting maximum
OR_POOL_FLOOR = -999999.0


def arf_table(orientations, ksize):
    """Rotation r of an ARF as a gather: row r, entry m is the entry of the unrotated filter
    (orientation channel * k*k + tap, row-major taps) that lands on entry m.  Row 0 is the identity."""
    ring = [0, 1, 2, 5, 8, 7, 6, 3]   # the 3x3 taps around the centre, clockwise from the top left
    step = 8 // orientations
    taps = ksize * ksize
    table = []
    for r in range(orientations):
        row = [0] * (orientations * taps)
        for src in range(orientations * taps):
            channel, tap = divmod(src, taps)
            if taps == 9 and tap != 4:
                tap = ring[(ring.index(tap) + r * step) % 8]
            row[((channel + r) % orientations) * taps + tap] = src
        table.append(row)
    return table


def arf_weight(weight, table):
    """The filters RRD's Convolution runs: from the stored (O*n, I*n, k, k) weight, output channel
    o*n + r is channel o*n rotated r times (table: arf_table(n, k) as a LongTensor)."""
    n, entries = table.shape
    source = weight.reshape(weight.shape[0] // n, n, weight.shape[1] // n, entries)[:, 0]
    return source[:, :, table].transpose(1, 2).reshape(weight.shape)


def or_pool(x, orientations):
    """RRD's ORPooling: the max over each group of `orientations` channels, NaN skipped, at least
    -999999 (the fork's starting value)."""
    n, c, h, w = x.shape
    x = x.reshape(n, c // orientations, orientations, h, w)
    x = x.masked_fill(torch.isnan(x), float("-inf"))
    return x.amax(dim=2).clamp_min(-999999.0)


class ArfConv2d(nn.Conv2d):
    """nn.Conv2d running RRD's active rotating filters (arf_weight) made from its stored weight."""

    def __init__(self, *args, orientations, **kwargs):
        super().__init__(*args, **kwargs)
        table = torch.tensor(arf_table(orientations, self.kernel_size[0]), dtype=torch.long)
        self.register_buffer("arf_index", table, persistent=False)

    def forward(self, x):
        weight = arf_weight(self.weight, self.arf_index)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


# ---- Convolution's orn_param (called from caffeq/layers/conv.py) -------------------------------

def conv_orientations(lp):
    """n when the Convolution `lp` rotates its filters (orn_param.orientations 4 or 8), else None."""
    if lp.type != "Convolution" or not lp.HasField("orn_param"):
        return None
    n = int(lp.orn_param.orientations)
    if n <= 1:
        return None   # the fork rotates only for n > 1
    if n not in ARF_ORIENTATIONS:
        raise LayerError(f"orn_param.orientations {n}: RRD's active rotating filters exist for 4 or 8 "
                         f"orientations only (its Convolution builds rotation indices for no other count)")
    return n


def check_arf(attrs, channels):
    """BaseConvolutionLayer::LayerSetUp's checks for ARFs, once the geometry is known."""
    n, kernel = attrs["orn"], attrs["kernel"]
    if len(kernel) != 2 or kernel[0] != kernel[1] or kernel[0] not in (1, 3):
        raise LayerError(f"orn_param: RRD's active rotating filters need a 2-D 1x1 or 3x3 kernel, "
                         f"got {'x'.join(map(str, kernel))}")
    if attrs["group"] != 1:
        raise LayerError(f"orn_param: RRD's active rotating filters do not take groups (group {attrs['group']})")
    for what, value in (("num_output", attrs["num_output"]), ("input channels", channels)):
        if value % n:
            raise LayerError(f"orn_param: {what} {value} is not a multiple of orientations {n}")


@functools.lru_cache(maxsize=None)
def _arf_index(n, k):
    """arf_table as a tensor, built once per (orientations, kernel size): forward runs every call."""
    return torch.tensor(arf_table(n, k), dtype=torch.long)


def torch_arf_weight(weight, n):
    return arf_weight(weight, _arf_index(n, weight.shape[-1]).to(weight.device))


def onnx_arf_weight(ctx, node, w, shape):
    """ONNX ops turning the stored weight `w` (Caffe shape `shape`) into the rotated filters."""
    n = node.attrs["orn"]
    out_c, in_c, k = shape[0], shape[1], shape[2]
    entries = n * k * k
    name = node.name
    grouped = ctx.add_node("Reshape", [w, ctx.const(np.array([out_c // n, n, in_c // n, entries], np.int64))],
                           ctx.tmp(name + "_arf_groups"))
    source = ctx.add_node("Gather", [grouped, ctx.const(np.array(0, np.int64))], ctx.tmp(name + "_arf_source"),
                          axis=1)
    table = ctx.const(np.array(arf_table(n, k), np.int64), name + "_arf_index")
    rotated = ctx.add_node("Gather", [source, table], ctx.tmp(name + "_arf_rotated"), axis=2)
    ordered = ctx.add_node("Transpose", [rotated], ctx.tmp(name + "_arf_ordered"), perm=[0, 2, 1, 3])
    return ctx.add_node("Reshape", [ordered, ctx.const(np.array(shape, np.int64))], ctx.tmp(name + "_arf_weight"))


def source_conv_class(emit):
    """model.py: the ArfConv2d class (with its helpers); returns its name."""
    emit.helper(arf_table)
    emit.helper(arf_weight)
    return emit.helper(ArfConv2d)


# ---- Extend and ORPooling ------------------------------------------------------------------

def _orientations(lp, what):
    n = int(lp.orn_param.orientations)   # unset: 1, as the fork's default
    if n <= 1:
        raise LayerError(f"{what} needs orn_param.orientations greater than 1, got {n}")
    return n


@register_layer("Extend")
class Extend(Layer):
    """RRD's Extend: each channel repeated `orientations` times in place (channel c -> c*n .. c*n+n-1)."""

    def parse(self, lp):
        # in place, Caffe's Reshape would grow the one blob and lose its data before Forward copies it
        need_blobs(lp, "Extend", 1, 1, in_place=False)
        return {"orientations": _orientations(lp, "Extend")}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        four_axes(s, "Extend")
        return [(s[0], s[1] * attrs["orientations"], s[2], s[3])]

    def forward(self, attrs, params, x):
        return x.repeat_interleave(attrs["orientations"], dim=1)

    def onnx(self, ctx, node):
        c = ctx.shape(node.inputs[0])[1]
        index = ctx.const(np.repeat(np.arange(c, dtype=np.int64), node.attrs["orientations"]),
                          node.name + "_channels")
        ctx.add_node("Gather", [node.inputs[0], index], [node.outputs[0]], name=node.name, axis=1)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]}.repeat_interleave({node.attrs['orientations']}, dim=1)"


@register_layer("ORPooling")
class ORPooling(Layer):
    """RRD's ORPooling: the max over each group of `orientations` consecutive channels (or_pool)."""

    def parse(self, lp):
        need_blobs(lp, "ORPooling", 1, 1)
        return {"orientations": _orientations(lp, "ORPooling")}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        four_axes(s, "ORPooling")
        n = attrs["orientations"]
        if s[1] % n:
            raise LayerError(f"ORPooling: input channels {s[1]} are not a multiple of orientations {n}")
        return [(s[0], s[1] // n, s[2], s[3])]

    def forward(self, attrs, params, x):
        return or_pool(x, attrs["orientations"])

    def onnx(self, ctx, node):
        n = node.attrs["orientations"]
        _, c, h, w = ctx.shape(node.inputs[0])
        name = node.name
        x = ctx.add_node("Reshape", [node.inputs[0], ctx.const(np.array([0, c // n, n, h, w], np.int64))],
                         ctx.tmp(name + "_groups"))
        nan = ctx.add_node("IsNaN", [x], ctx.tmp(name + "_nan"))
        x = ctx.add_node("Where", [nan, ctx.const(np.array(-np.inf, np.float32)), x], ctx.tmp(name + "_clean"))
        top = onnx_reduce(ctx, "ReduceMax", x, [2], False, ctx.tmp(name + "_max"))
        ctx.add_node("Max", [top, ctx.const(np.array(OR_POOL_FLOOR, np.float32))], [node.outputs[0]], name=name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(or_pool)}({emit.inputs[0]}, {node.attrs['orientations']})"
