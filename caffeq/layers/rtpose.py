"""CMU-Perceptual-Computing-Lab/caffe_rtpose (a4778bb1; Switch from 182633d): the realtime multi-person pose
demo's layers.

Each follows the fork's CUDA code (the path the demo runs; the CPU code differs as noted).

ImResize (src/caffe/cpm/layers/imresize_layer.cu, `imresize_param`): top (1, C, th, tw), th x tw =
`target_spatial_height` x `target_spatial_width`, or with `factor` != 0 (int)(H * factor) x
(int)(W * factor) (float32 product, truncated).  Image n of the batch is first cropped about its
centre by pad = floor(W / 2 * (1 - start_scale + n * scale_gap)) columns on each side (W / 2 an
integer division, the rest float32; nvcc fuses n * scale_gap + (1 - start_scale)) and likewise rows;
the crop of ow x oh pixels is resized by Keys' cubic (a = -0.5) at the half-pixel position
(x - (tw / ow / 2 - 0.5)) * (ow / tw), whose first tap is (int)(pos + 1e-5) clamped at 0 (so left of
the first pixel the cubic through pixels 0, 0, 1, 2 is evaluated at a negative offset) and whose
other taps are clamped to the crop; the top is the mean over n of the resized crops (the demo feeds
the scales of one image as the batch).  The CPU code (OpenCV's a = -0.75 cubic of every image,
written past a top of one image) is not what the demo runs.

Nms (nms_layer.cu, `nms_param`): top (N, num_parts, max_peaks + 1, 3).  Part map c of image n is the
bottom's flat map n * num_parts + c (the fork's stride; channels past num_parts are not read).  A
peak is an interior pixel (not on the border) whose value is > threshold and > each of its 8
neighbours.  Row 0 holds [number of peaks, 0, 0] (the count is not capped); row k + 1 holds the k-th
peak in raster order while k < max_peaks: [x, y, value at the peak], x and y the means of the
column and row indices over its 7 x 7 window weighted by the positive values at columns 1 .. W - 1
and rows 1 .. W - 1 (the fork bounds the rows by the width too); rows below the map continue into
the first two rows of the next map in memory (zeros after the blob's last map).  Other rows are 0
(a fresh top; the fork leaves earlier results there).  With W not a multiple of 16 the fork's
peak kernel races with a stray write of 0 into row 1's first columns; caffeq keeps such peaks.  The
CPU code (4-neighbour peaks >= threshold, two values per row) is not what the demo runs.

Maximum (src/caffe/layers/maximum_layer.cu): top (N, C, 1, 3) = [x, y, value] of each map's maximum,
found as the kernels do: the running maxima start at float(-1e10) and move only on a larger value
(NaN never wins); ties go to the lowest lane of the 32-lane reductions, i.e. to the smallest
(i % 32, i) of the column (then of the row).  When W < H the row kernel skips the rows whose flat
index (n * C + c) * H + h is >= N * C * W (it bounds them by the width): they count as value 0 at
x = 0, as the fork's fresh scratch blob holds.  (The CPU code starts at the smallest positive float
and takes the first maximum in raster order.)

ONNX expresses all three: ImResize as products with interpolation matrices built in the graph for
the run's batch (the crops depend on n), Nms with Slice/Greater/Pad/Conv/TopK, Maximum with
ArgMax/Gather (rtpose_onnx.py).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ExportError
from .registry import Layer, LayerError, cached_constant, four_axes, need_blobs, positive_field, register_layer
from .rtpose_onnx import emit_imresize, emit_maximum, emit_nms

# ---- torch (model.py copies these) -----------------------------------------------------------


def imresize_size(height: int, width: int, factor: float, target_h: int, target_w: int):
    """ImResize's top height and width: (int)(side * factor) in float32 when factor != 0."""
    if factor != 0:
        f = torch.tensor(factor, dtype=torch.float32)
        return (int(torch.tensor(float(height), dtype=torch.float32) * f),
                int(torch.tensor(float(width), dtype=torch.float32) * f))
    return target_h, target_w


def imresize_pad(num: int, size: int, start_scale: float, scale_gap: float):
    """The crop's pad of images 0 .. num - 1 along a side of `size`: floor(size / 2 * (1 - start_scale
    + n * scale_gap)), float32 with nvcc's fused multiply-add (float32 tensor)."""
    first = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(start_scale, dtype=torch.float32)
    gap = torch.tensor(scale_gap, dtype=torch.float32).to(torch.float64)
    ratio = (torch.arange(num, dtype=torch.float64) * gap + first.to(torch.float64)).to(torch.float32)
    return torch.floor(torch.tensor(float(size // 2), dtype=torch.float32) * ratio)


def imresize_axis(num: int, size: int, target: int, start_scale: float, scale_gap: float):
    """(num, target, size): ImResize's cubic interpolation of image n's centre crop along one axis."""
    f32, f64 = torch.float32, torch.float64
    pad = imresize_pad(num, size, start_scale, scale_gap)
    crop = torch.tensor(float(size), dtype=f32) - 2 * pad
    t = torch.tensor(float(target), dtype=f32)
    offset = (t / crop / 2 - 0.5)[:, None]
    pos = (torch.arange(target, dtype=f32)[None, :] - offset) * (crop / t)[:, None]
    i1 = torch.floor(pos.to(f64) + 1e-5).to(f32).clamp_min(0)
    last = (crop - 1)[:, None]
    i0 = (i1 - 1).clamp_min(0)
    i2 = torch.minimum(i1 + 1, last)
    i3 = torch.minimum(i2 + 1, last)
    d = (pos - i1).to(f64)
    d2 = d * d
    d3 = d2 * d
    weights = (-0.5 * d3 + d2 - 0.5 * d, 1.5 * d3 - 2.5 * d2 + 1, -1.5 * d3 + 2 * d2 + 0.5 * d, 0.5 * d3 - 0.5 * d2)
    cols = torch.arange(size, dtype=f32)
    zero = torch.zeros((), dtype=f64)
    m = torch.zeros(num, target, size, dtype=f64)
    for tap, w in zip((i0, i1, i2, i3), weights):
        m = m + torch.where((tap + pad[:, None])[..., None] == cols, w[..., None], zero)
    return m.to(f32)


def rtpose_imresize(x, mh, mw):
    """The mean over the batch of mh[n] @ x[n] @ mw[n]^T: (1, C, th, tw)."""
    rows = torch.matmul(mh.unsqueeze(1), x)
    return torch.matmul(rows, mw.transpose(1, 2).unsqueeze(1)).mean(0, keepdim=True)


class CaffeImResize(nn.Module):
    """caffe_rtpose's ImResize (GPU): forward(x) -> (1, C, th, tw)."""

    def __init__(self, factor: float, target_h: int, target_w: int, start_scale: float, scale_gap: float):
        super().__init__()
        self.factor, self.target = factor, (target_h, target_w)
        self.start_scale, self.scale_gap = start_scale, scale_gap

    def forward(self, x):
        n, _, h, w = x.shape
        th, tw = imresize_size(h, w, self.factor, *self.target)
        mh = imresize_axis(n, h, th, self.start_scale, self.scale_gap).to(x.device, x.dtype)
        mw = imresize_axis(n, w, tw, self.start_scale, self.scale_gap).to(x.device, x.dtype)
        return rtpose_imresize(x, mh, mw)


def rtpose_nms(x, threshold: float, num_parts: int, max_peaks: int):
    """caffe_rtpose's Nms (GPU): (N, num_parts, max_peaks + 1, 3) peaks, row 0 = [count, 0, 0]."""
    n, c, h, w = x.shape
    if h < 3 or w < 3:
        return x.new_zeros(n, num_parts, max_peaks + 1, 3)
    flat = x.reshape(n * c, h, w)
    maps = n * num_parts
    src = flat[:maps]
    centre = src[:, 1:h - 1, 1:w - 1]
    peak = centre > threshold
    for dy in range(3):
        for dx in range(3):
            if dy != 1 or dx != 1:
                peak = peak & (centre > src[:, dy:dy + h - 2, dx:dx + w - 2])
    peak = F.pad(peak.to(torch.int64), (1, 1, 1, 1))
    count = peak.sum((1, 2)).to(x.dtype)
    below = flat[1:maps + 1, :2]          # the window reads on into the next map's first rows
    if below.shape[0] < maps:
        below = torch.cat([below, x.new_zeros(maps - below.shape[0], 2, w)])
    ext = torch.cat([src, below], 1)
    r = torch.arange(h + 2, device=x.device)
    q = torch.arange(w, device=x.device)
    keep = ((r > 0) & (r < w))[:, None] & (q > 0)[None, :]
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    s = torch.where((ext > 0) & keep, ext, zero)
    stack = torch.stack([s, s * q.to(x.dtype), s * r.to(x.dtype)[:, None]], 1)
    ones = x.new_ones(3, 1, 7, 1)
    box = F.conv2d(F.conv2d(stack, ones, padding=(3, 0), groups=3), ones.transpose(2, 3), padding=(0, 3), groups=3)
    box = box[:, :, :h]
    hw = h * w
    parts = [count[:, None, None] * torch.tensor([1.0, 0.0, 0.0], dtype=x.dtype, device=x.device)]
    k = min(max_peaks, hw)
    if k:
        key = peak.reshape(maps, hw) * (hw - torch.arange(hw, device=x.device))
        top, idx = key.topk(k, 1)
        xs = (box[:, 1] / box[:, 0]).reshape(maps, hw).gather(1, idx)
        ys = (box[:, 2] / box[:, 0]).reshape(maps, hw).gather(1, idx)
        vals = torch.stack([xs, ys, src.reshape(maps, hw).gather(1, idx)], 2)
        parts.append(torch.where((top > 0)[..., None], vals, zero))
        if k < max_peaks:
            parts.append(x.new_zeros(maps, max_peaks - k, 3))
    return torch.cat(parts, 1).reshape(n, num_parts, max_peaks + 1, 3)


def lane_order(size: int, device=None):
    """0 .. size - 1 in the order the fork's 32-lane reductions prefer among equal values."""
    i = torch.arange(size, device=device)
    return i[torch.argsort((i % 32) * size + i)]


def rtpose_maximum(x):
    """caffe_rtpose's Maximum (GPU): (N, C, 1, 3) = [x, y, value] of each map's maximum."""
    n, c, h, w = x.shape
    v = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x).clamp_min(-1e10)
    cols = lane_order(w, x.device)
    vp = v[..., cols]
    j = vp.argmax(3, keepdim=True)
    rv = vp.gather(3, j)
    rx = cols[j].to(x.dtype)
    if w < h:     # the row kernel's bound: rows past N * C * W are never reduced (zeros)
        skipped = torch.arange(n * c * h, device=x.device).reshape(n, c, h, 1) >= n * c * w
        rv = torch.where(skipped, torch.zeros_like(rv), rv)
        rx = torch.where(skipped, torch.zeros_like(rx), rx)
    rows = lane_order(h, x.device)
    rp = rv[:, :, rows]
    jj = rp.argmax(2, keepdim=True)
    return torch.cat([rx[:, :, rows].gather(2, jj), rows[jj].to(x.dtype), rp.gather(2, jj)], 3)


# ---- the specs -------------------------------------------------------------------------------

def _finite(value, field):
    if not math.isfinite(value):
        raise LayerError(f"{field} must be a finite number, got {value}")
    return float(value)


@register_layer("ImResize")
class ImResize(Layer):
    def parse(self, lp):
        need_blobs(lp, "ImResize", 1, 1)
        p = lp.imresize_param
        factor = _finite(p.factor, "imresize_param.factor")
        if factor < 0:
            raise LayerError(f"imresize_param.factor must be >= 0 (0: the target_spatial_ sizes), got {factor:g}")
        attrs = {"factor": factor, "target_h": int(p.target_spatial_height), "target_w": int(p.target_spatial_width),
                 "start_scale": _finite(p.start_scale, "imresize_param.start_scale"),
                 "scale_gap": _finite(p.scale_gap, "imresize_param.scale_gap"), "name": lp.name}
        if factor == 0:
            positive_field(attrs["target_h"], "imresize_param.target_spatial_height (factor 0)")
            positive_field(attrs["target_w"], "imresize_param.target_spatial_width (factor 0)")
        return attrs

    @staticmethod
    def _size(attrs, h, w):
        return imresize_size(h, w, attrs["factor"], attrs["target_h"], attrs["target_w"])

    def infer(self, attrs, in_shapes):
        _, c, h, w = four_axes(in_shapes[0], "ImResize")
        th, tw = self._size(attrs, h, w)
        if th < 1 or tw < 1:
            raise LayerError(f"factor {attrs['factor']:g} makes the {h} x {w} bottom {th} x {tw}: "
                             f"the fork's kernel needs a top of at least 1 x 1")
        return [(1, c, th, tw)]

    @staticmethod
    def cannot_run(attrs, in_shapes):
        n, _, h, w = (int(d) for d in in_shapes[0])
        if n < 1:
            return "the bottom has no image: the top is their mean"
        for side, size in (("height", h), ("width", w)):
            pad = imresize_pad(n, size, attrs["start_scale"], attrs["scale_gap"])
            bad = [i for i, p in enumerate(pad.tolist()) if p < 0 or size - 2 * p < 1]
            if bad:
                i = bad[0]
                return (f"start_scale {attrs['start_scale']:g} and scale_gap {attrs['scale_gap']:g} crop image {i} "
                        f"of the batch by {pad[i].item():g} on each side of its {side} {size}: the fork's kernel "
                        f"reads outside the map unless 0 <= crop pad < {side} / 2")
        return None

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape], LayerError)
        n, _, h, w = x.shape
        th, tw = self._size(attrs, h, w)
        mats = [cached_constant(imresize_axis, n, size, t, attrs["start_scale"], attrs["scale_gap"],
                                device=x.device, dtype=x.dtype) for size, t in ((h, th), (w, tw))]
        return rtpose_imresize(x, *mats)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError)
        a = node.attrs
        m = emit.instance(CaffeImResize, a["factor"], a["target_h"], a["target_w"], a["start_scale"],
                          a["scale_gap"], needs=[imresize_size, imresize_pad, imresize_axis, rtpose_imresize])
        return f"{m}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        shape = ctx.shape(node.inputs[0])
        self.refuse_if_cannot_run(node.name, node.attrs, [shape], ExportError)
        emit_imresize(ctx, node, *self._size(node.attrs, shape[2], shape[3]))

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        _, _, th, tw = out_shapes[0]
        return n * c * th * (h * w + w * tw)


@register_layer("Nms")
class Nms(Layer):
    def parse(self, lp):
        need_blobs(lp, "Nms", 1, 1)
        p = lp.nms_param
        return {"threshold": float(np.float32(p.threshold)),
                "num_parts": positive_field(p.num_parts, "nms_param.num_parts"),
                "max_peaks": int(p.max_peaks), "name": lp.name}

    def infer(self, attrs, in_shapes):
        n, _, _, _ = four_axes(in_shapes[0], "Nms")
        return [(n, attrs["num_parts"], attrs["max_peaks"] + 1, 3)]

    @staticmethod
    def cannot_run(attrs, in_shapes):
        c = int(in_shapes[0][1])
        if attrs["num_parts"] > c:
            return (f"num_parts {attrs['num_parts']} is more than the bottom's {c} channels: the fork reads "
                    f"part maps past the end of the blob")
        return None

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape], LayerError)
        return rtpose_nms(x, attrs["threshold"], attrs["num_parts"], attrs["max_peaks"])

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError)
        a = node.attrs
        return f"{emit.helper(rtpose_nms)}({emit.inputs[0]}, {a['threshold']!r}, {a['num_parts']}, {a['max_peaks']})"

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(node.inputs[0])], ExportError)
        emit_nms(ctx, node)


@register_layer("Maximum")
class Maximum(Layer):
    bottoms = tops = 1

    def infer(self, attrs, in_shapes):
        n, c, _, _ = four_axes(in_shapes[0], "Maximum")
        return [(n, c, 1, 3)]

    def forward(self, attrs, params, x):
        return rtpose_maximum(x)

    def pytorch_source(self, node, emit):
        emit.helper(lane_order)
        return f"{emit.helper(rtpose_maximum)}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        emit_maximum(ctx, node)


@register_layer("Switch")
class Switch(Layer):
    """caffe_rtpose 182633d (switch_layer.cpp and .cu; pose_deploy_linevec_switch.prototxt): the top is shaped
    like bottom 0 and holds the first count(bottom 0) values of the selected bottom, the last one (the demo's
    C++ may select another at run time; nothing in the prototxt does).  One bottom: the top is that bottom.
    Every bottom must have bottom 0's number of axes."""

    def parse(self, lp):
        need_blobs(lp, "Switch", range(1, 1 << 20), 1, roles="inputs...")
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        if any(len(s) != len(in_shapes[0]) for s in in_shapes):
            raise LayerError(f"all bottoms must have the same number of axes (the fork's check), got "
                             f"{[list(s) for s in in_shapes]}")
        return [tuple(in_shapes[0])]

    def cannot_run(self, attrs, in_shapes):
        if math.prod(in_shapes[-1]) < math.prod(in_shapes[0]):
            return (f"the selected (last) bottom {list(in_shapes[-1])} holds fewer values than bottom 0 "
                    f"{list(in_shapes[0])}, whose count the fork copies from it (past its end)")
        return None

    def forward(self, attrs, params, *bottoms):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(b.shape) for b in bottoms])
        return bottoms[-1].reshape(-1)[:bottoms[0].numel()].reshape(bottoms[0].shape)

    def pytorch_source(self, node, emit):
        shapes = [emit.in_shape(i) for i in range(len(node.inputs))]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        return f"{emit.inputs[-1]}.reshape(-1)[:{math.prod(shapes[0])}].reshape({emit.lit(list(shapes[0]))})"

    def onnx(self, ctx, node):
        shapes = [ctx.shape(t) for t in node.inputs]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        flat = ctx.op("Reshape", [node.inputs[-1], ctx.i64([-1])], "flat")
        first = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([math.prod(shapes[0])])], "first")
        ctx.add_node("Reshape", [first, ctx.i64(list(shapes[0]))], [node.outputs[0]], name=node.name)
