"""Layers of the optical-flow Caffe forks: lmb-freiburg/flownet2 b92e198 (FlowNet 2), NVlabs/PWC-Net
07df6eb (Caffe/warping_code) and twhui/LiteFlowNet e7d6c43 (which carries flownet2's layers unchanged).
FlowWarp lives in edge_flow_crf_forks.py (its sampling is flow_warp here, shared with PWC-Net's Warp),
flownet2's Accum in flow_accum.py; L1Loss is a loss, dropped from inference graphs (ir.py).

- Correlation (flownet2 correlation_layer.cpp/.cu; correlation_param pad, kernel_size, max_displacement,
  stride_1 [1], stride_2 [1], correlation_type MULTIPLY | SUBTRACT; do_abs is read by no kernel):
  both bottoms are zero-padded by pad on each side; radius r = (kernel_size - 1) / 2, border =
  max_displacement + r, top H/W = ceil((padded H/W - 2 border) / stride_1), top channels (2g + 1)^2 with
  g = max_displacement / stride_2, channel (p + g) (2g + 1) + (o + g) for the displacement
  (dy, dx) = (p, o) stride_2.  top[n, ch, y, x] = sum over the k x k patch whose top-left corner is
  (y stride_1 + max_displacement, x stride_1 + max_displacement) of the padded first bottom and every
  channel of a * b (MULTIPLY) or |a - b| (SUBTRACT), b displaced by (dy, dx), divided by k^2 channels.
- Correlation1D (correlation_layer1d.cpp/.cu, same message plus single_direction): padding along W
  only, top H = ceil((H - 2r) / stride_1), patch rows start at y stride_1; displacements along x only,
  o = -g..g (single_direction 0), 0..g (1), or -(g + 1)..-1 (-1), (g + 1) channels for +-1.  With -1
  the fork's first columns read before the padded row (outside the blob): caffeq sizes that layer
  and refuses to run it.
- FLOWriter, FloatWriter, ImgWriter, PFMWriter (flowriter_layer.cpp...): save their one bottom to a file
  named by writer_param at every forward; no tops, nothing to compute (caffeq writes no such file).
- ChannelNorm (channel_norm_layer.cu): top (N, 1, H, W) = sqrt(sum over channels of x^2).
- Downsample (downsample_layer.cu; downsample_param top_height/top_width, or bottom 1's H and W):
  when the size is unchanged the top is the bottom; otherwise each top pixel (dx, dy) sits at
  (bx, by) = (dx / (tw - 1) (bw - 1), dy / (th - 1) (bh - 1)) (float32) and averages the bottom pixels
  within ceil(scale) of (round(bx), round(by)) with tent weights max(0, 1 - |x - bx| / sx) max(0, 1 -
  |y - by| / sy), s = (b - 1) / (t - 1); NaN samples weigh nothing, and the top is NaN when their
  weight over the kept weight passes 0.5.  A top height or width of 1 divides by zero in the fork:
  refused.
- Warp, PWC-Net's (Caffe/warping_code/warp_layer.cu): bottoms (image, flow); top[n, c, s, t] samples the
  image at (t + fx, s + fy) bilinearly between floor and ceil of each coordinate when the point lies in
  [0, W - 1] x [0, H - 1], else 0.
- Warp, LiteFlowNet's (warp_layer.cu), marked by warp_param.absolute_coords (caffeq's own; set by
  caffeq/io/upgrade.py on a Warp whose coordinates come from a Grid): bottoms (image, coordinates x, y in
  pixels); the four bilinear neighbours each count only where they lie inside the image (zero padding).
- Grid (LiteFlowNet grid_layer.cpp): top (N, 2, H, W) of bottom's N, H, W: channel 0 = x, channel 1 = y.
- NegSquare (negsquare_layer.cu): y = -x^2.
- ExpMax (expmax_layer.cu; expmax_param base [-1 = e], scale [1], shift [0]): y = outer exp(inner (x -
  m)), inner = ln(base) scale, outer = base^shift (1 when shift = 0).  The fork's max kernel runs with
  outer_num = 1: m is the channel maximum of batch item 0 only; the later items subtract the zeros of
  its never-written scale buffer, as reproduced here.
- DataAugmentation, FlowAugmentation, GenerateAugmentationParameters (flownet2 *_augmentation_*.cpp):
  random training augmentation (and, in DataAugmentation, a running mean updated from the images it
  sees, at TEST too).  Read-only: sized as their Reshape sizes them, never run.
- Resample (flownet2 resample_layer.cpp): top (N, C, height, width) or bottom 1's H, W.  Its
  NEAREST/LINEAR/CUBIC antialiasing filters are not reproduced: read-only.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ExportError
from .common import Sink
from .norm import onnx_reduce
from .registry import (
    FunctionLayer,
    Layer,
    LayerError,
    ReadOnlyLayer,
    cached_constant,
    four_axes,
    need_blobs,
    register_layer,
)
from .warp_onnx import OnnxImageSampler

# AugmentationCoeff's field count in flownet2's caffe.proto (6 spatial, 6 chromatic, 22 chromatic-eigen,
# 8 effect): the channels of every augmentation-parameter blob
AUGMENTATION_COEFFS = 42


# ---- torch functions (model.py gets the same code) ---------------------------------------

def flow_correlation(a, b, pad_h: int, pad_w: int, kernel: int, y0: int, x0: int, stride: int,
                     offsets: list, subtract: bool, top_h: int, top_w: int):
    """flownet2's Correlation / Correlation1D: one channel per (dy, dx) of offsets, the k x k x C mean of
    a * b (or |a - b|) with b displaced; patch corners at (y0 + y stride, x0 + x stride) of the padded a."""
    a = F.pad(a, (pad_w, pad_w, pad_h, pad_h))
    b = F.pad(b, (pad_w, pad_w, pad_h, pad_h))
    span_h = (top_h - 1) * stride + kernel
    span_w = (top_w - 1) * stride + kernel
    first = a[:, :, y0:y0 + span_h, x0:x0 + span_w]
    maps = []
    for dy, dx in offsets:
        second = b[:, :, y0 + dy:y0 + dy + span_h, x0 + dx:x0 + dx + span_w]
        cost = (first - second).abs() if subtract else first * second
        maps.append(cost.mean(1, keepdim=True))
    cost = torch.cat(maps, 1)
    if kernel > 1 or stride > 1:
        cost = F.avg_pool2d(cost, kernel, stride)
    return cost


def channel_norm(x):
    """flownet2's ChannelNorm: the L2 norm over channels, (N, 1, H, W)."""
    return x.pow(2).sum(1, keepdim=True).sqrt()


def downsample_matrix(bottom: int, top: int, device: torch.device):
    """(top, bottom) tent weights of flownet2's Downsample along one axis, in float32 as the fork."""
    f32 = torch.float32
    scale = torch.tensor(bottom - 1, dtype=f32) / torch.tensor(top - 1, dtype=f32)
    radius = int(torch.ceil(scale).item())
    centre = torch.arange(top, dtype=f32, device=device) / (top - 1) * (bottom - 1)
    whole = centre.trunc()
    nearest = whole + (centre - whole >= 0.5).to(f32)           # C round(): halves away from zero
    pos = torch.arange(bottom, dtype=f32, device=device)[None, :]
    near = (pos - nearest[:, None]).abs() <= radius
    weight = (1 - (pos - centre[:, None]).abs() / scale.to(device)).clamp(min=0)
    return torch.where(near, weight, torch.zeros_like(weight))


def flow_downsample(x, top_h: int, top_w: int):
    """flownet2's Downsample of x (N, C, H, W) to (top_h, top_w)."""
    h, w = x.shape[2], x.shape[3]
    if (h, w) == (top_h, top_w):
        return x
    return tent_average(x, downsample_matrix(h, top_h, x.device), downsample_matrix(w, top_w, x.device))


def tent_average(x, rows, cols):
    """Downsample's NaN-aware average of x (N, C, H, W) with the tent weights rows (top_h, H) and cols
    (top_w, W) of downsample_matrix."""
    cols = cols.t()
    bad = torch.isnan(x)
    good = (~bad).to(x.dtype)
    value = rows @ (torch.where(bad, torch.zeros_like(x), x) @ cols)
    weight = rows @ (good @ cols)
    nan_weight = rows @ ((1 - good) @ cols)
    return torch.where(nan_weight / weight > 0.5, torch.full_like(value, float("nan")), value / weight)


def pixels_at(image, row, col):
    """image[n, :, row, col] for integer maps row, col (N, 1, h, w) inside the image -> (N, C, h, w)."""
    n, c, h, w = image.shape
    index = (row * w + col).reshape(n, 1, -1).expand(n, c, row.shape[2] * row.shape[3])
    return image.reshape(n, c, h * w).gather(2, index).reshape(n, c, row.shape[2], row.shape[3])


def bilinear_taps(image, x, y, nan_at_zero: bool):
    """daerduoCarey's SpatialTransformer sampler (its GPU kernel), which MotionNet's FlowTransformer
    reuses: for rows x and columns y (N, 1, h, w), the taps (floor x, floor y), (+1, 0), (0, +1),
    (+1, +1) added in that order to 0, each weighted as the kernel writes it; a tap outside the image
    adds nothing.  nan_at_zero: a NaN coordinate reads tap index 0 (CUDA's float-to-int conversion)."""
    h, w = image.shape[2], image.shape[3]
    m0, k0 = x.floor(), y.floor()
    m1, k1 = m0 + 1, k0 + 1
    total = torch.zeros((image.shape[0], image.shape[1], x.shape[2], x.shape[3]), dtype=image.dtype,
                        device=image.device)
    for m, k, wm, wk in ((m0, k0, 1 - (x - m0), 1 - (y - k0)), (m1, k0, 1 - (m1 - x), 1 - (y - k0)),
                         (m0, k1, 1 - (x - m0), 1 - (k1 - y)), (m1, k1, 1 - (m1 - x), 1 - (k1 - y))):
        if nan_at_zero:
            m = torch.where(torch.isnan(m), torch.zeros_like(m), m)
            k = torch.where(torch.isnan(k), torch.zeros_like(k), k)
        inside = (m >= 0) & (m < h) & (k >= 0) & (k < w)
        row = torch.where(inside, m, torch.zeros_like(m)).long()
        col = torch.where(inside, k, torch.zeros_like(k)).long()
        term = wm * wk * pixels_at(image, row, col)
        total = total + torch.where(inside, term, torch.zeros_like(term))
    return total


def flow_warp(image, flow, fill: float, pwc_net: bool):
    """Bilinear samples of image at (x + fx, y + fy), fill where the point is outside: FlowNet2's
    FlowWarp (pwc_net False) and PWC-Net's Warp (pwc_net True, fill 0).  The forks differ in two
    places only, so one function serves both:
    - inside: PWC-Net's [0, W-1] x [0, H-1] (a point past the last pixel centre gets 0) against
      FlowNet2's [0, W) x [0, H) (there it reads the last pixel);
    - the far neighbour: PWC-Net's ceil against FlowNet2's floor + 1 clamped to the last pixel.  They
      differ only where that neighbour's weight is 0, which still shows when its pixel is NaN or inf
      (0 * NaN is NaN)."""
    h, w = image.shape[2], image.shape[3]
    gy, gx = torch.meshgrid(torch.arange(h, dtype=image.dtype, device=image.device),
                            torch.arange(w, dtype=image.dtype, device=image.device), indexing="ij")
    x = gx + flow[:, 0:1]
    y = gy + flow[:, 1:2]
    if pwc_net:
        inside = (x >= 0) & (x <= w - 1) & (y >= 0) & (y <= h - 1)
    else:
        inside = (x >= 0) & (x < w) & (y >= 0) & (y < h)
    # sample at (0, 0) where outside, so every index is valid; those results are replaced
    x = torch.where(inside, x, torch.zeros_like(x))
    y = torch.where(inside, y, torch.zeros_like(y))
    fx, fy = x.floor(), y.floor()
    ax, ay = x - fx, y - fy
    fx, fy = fx.long(), fy.long()
    if pwc_net:
        cx, cy = x.ceil().long(), y.ceil().long()
    else:
        cx, cy = (fx + 1).clamp(max=w - 1), (fy + 1).clamp(max=h - 1)
    warped = ((1 - ax) * (1 - ay) * pixels_at(image, fy, fx) + ax * (1 - ay) * pixels_at(image, fy, cx)
              + (1 - ax) * ay * pixels_at(image, cy, fx) + ax * ay * pixels_at(image, cy, cx))
    return torch.where(inside, warped, torch.full_like(warped, fill))


def coords_warp(image, coords, truncate: bool = False):
    """LiteFlowNet's Warp: bilinear samples at absolute (x, y); neighbours outside the image count 0.  With
    `truncate`, the upper-left neighbour is a C (int) cast's (toward zero, NaN to 0) instead of the floor."""
    n, c, h, w = image.shape
    x, y = coords[:, 0:1], coords[:, 1:2]
    if truncate:
        x0 = torch.where(torch.isnan(x), torch.zeros_like(x), x.trunc())
        y0 = torch.where(torch.isnan(y), torch.zeros_like(y), y.trunc())
    else:
        x0, y0 = x.floor(), y.floor()
    ax, ay = x - x0, y - y0
    total = torch.zeros(n, c, x.shape[2], x.shape[3], dtype=image.dtype, device=image.device)
    for px, py, weight in ((x0, y0, (1 - ax) * (1 - ay)), (x0 + 1, y0, ax * (1 - ay)),
                           (x0, y0 + 1, (1 - ax) * ay), (x0 + 1, y0 + 1, ax * ay)):
        inside = (px >= 0) & (px < w) & (py >= 0) & (py < h)
        col = torch.where(inside, px, torch.zeros_like(px)).long()
        row = torch.where(inside, py, torch.zeros_like(py)).long()
        term = weight * pixels_at(image, row, col)
        total = total + torch.where(inside, term, torch.zeros_like(term))
    return total


def pixel_grid(x):
    """LiteFlowNet's Grid: (N, 2, H, W) holding each pixel's x, then y."""
    n, h, w = x.shape[0], x.shape[2], x.shape[3]
    gy, gx = torch.meshgrid(torch.arange(h, dtype=x.dtype, device=x.device),
                            torch.arange(w, dtype=x.dtype, device=x.device), indexing="ij")
    return torch.stack([gx, gy]).unsqueeze(0).expand(n, 2, h, w)


def neg_square(x):
    return -(x * x)


def exp_max(x, inner: float, outer: float):
    """LiteFlowNet's ExpMax: outer exp(inner (x - m)), m the channel maximum of item 0, 0 for the others."""
    top = x.amax(1, keepdim=True)
    m = torch.cat([top[:1], torch.zeros_like(top[1:])], 0)
    y = x - m
    if inner != 1.0:
        y = y * inner
    y = torch.exp(y)
    if outer != 1.0:
        y = y * outer
    return y


# ---- Correlation and Correlation1D ---------------------------------------------------------

@register_layer("Correlation", "Correlation1D")
class Correlation(Layer):
    def parse(self, lp):
        what = lp.type
        need_blobs(lp, what, 2, 1, "first image, second image")
        p = lp.correlation_param
        if not p.HasField("kernel_size") or not p.HasField("max_displacement"):
            raise LayerError(f"{what} needs correlation_param.kernel_size and max_displacement (the fork's CHECK)")
        if p.kernel_size % 2 == 0:
            raise LayerError(f"{what} needs an odd correlation_param.kernel_size, got {p.kernel_size}")
        if p.stride_1 < 1 or p.stride_2 < 1:
            raise LayerError(f"{what}'s correlation_param.stride_1 and stride_2 must be >= 1, got "
                             f"{p.stride_1} and {p.stride_2}")
        one_d = what == "Correlation1D"
        direction = int(p.single_direction) if one_d else 0
        if direction not in (-1, 0, 1):
            raise LayerError(f"correlation_param.single_direction must be -1 (left), 0 (off) or 1 (right), "
                             f"got {direction}")
        k, md, s2 = int(p.kernel_size), int(p.max_displacement), int(p.stride_2)
        g = md // s2
        if not one_d:
            offsets = [(dy * s2, dx * s2) for dy in range(-g, g + 1) for dx in range(-g, g + 1)]
        elif direction == 0:
            offsets = [(0, dx * s2) for dx in range(-g, g + 1)]
        else:
            first = 0 if direction == 1 else -(g + 1)
            offsets = [(0, (first + i) * s2) for i in range(g + 1)]
        return {"name": lp.name, "type": what, "one_d": one_d, "direction": direction, "pad": int(p.pad),
                "kernel": k, "max_disp": md, "stride1": int(p.stride_1), "offsets": offsets,
                "subtract": p.correlation_type == p.SUBTRACT}

    def infer(self, attrs, in_shapes):
        what = attrs["type"]
        a = four_axes(in_shapes[0], what)
        b = four_axes(in_shapes[1], what)
        if a[1:] != b[1:]:
            raise LayerError(f"{what}'s bottoms must share C, H and W, got {list(a)} and {list(b)}")
        radius = (attrs["kernel"] - 1) // 2
        pad, s1 = attrs["pad"], attrs["stride1"]
        width = math.ceil((a[3] + 2 * pad - 2 * (attrs["max_disp"] + radius)) / s1)
        if attrs["one_d"]:
            height = math.ceil((a[2] - 2 * radius) / s1)
        else:
            height = math.ceil((a[2] + 2 * pad - 2 * (attrs["max_disp"] + radius)) / s1)
        if width < 1 or height < 1:
            raise LayerError(f"{what}: neighbourhood and kernel do not fit in a {a[2]}x{a[3]} bottom padded by "
                             f"{pad} (max_displacement {attrs['max_disp']}, kernel_size {attrs['kernel']})")
        return [(a[0], len(attrs["offsets"]), height, width)]

    def _args(self, attrs, shape):
        pad_h = 0 if attrs["one_d"] else attrs["pad"]
        y0 = 0 if attrs["one_d"] else attrs["max_disp"]
        return (pad_h, attrs["pad"], attrs["kernel"], y0, attrs["max_disp"], attrs["stride1"],
                attrs["offsets"], attrs["subtract"], shape[2], shape[3])

    @staticmethod
    def cannot_run(attrs, in_shapes):
        if attrs["direction"] == -1:
            return ("single_direction -1 makes the fork read before the start of each padded row (outside "
                    "the blob); caffeq sizes this layer but does not run it")
        return None

    def forward(self, attrs, params, a, b):
        self.refuse_if_cannot_run(attrs["name"], attrs, [a.shape, b.shape], LayerError, attrs["type"])
        shape = self.infer(attrs, [a.shape, b.shape])[0]
        return flow_correlation(a, b, *self._args(attrs, shape))

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError, node.type)
        a, b = node.inputs
        name = node.name
        pad_h, pad_w, k, y0, x0, stride, offsets, subtract, top_h, top_w = self._args(
            node.attrs, ctx.shape(node.outputs[0]))
        i64 = np.int64

        if pad_h or pad_w:
            pads = ctx.const(np.array([0, 0, pad_h, pad_w, 0, 0, pad_h, pad_w], i64))
            a = ctx.op("Pad", [a, pads], "pad_a", name=name)
            b = ctx.op("Pad", [b, pads], "pad_b")
        span_h, span_w = (top_h - 1) * stride + k, (top_w - 1) * stride + k
        axes = ctx.const(np.array([2, 3], i64))

        def window(x, dy, dx, hint):
            starts = ctx.const(np.array([y0 + dy, x0 + dx], i64))
            ends = ctx.const(np.array([y0 + dy + span_h, x0 + dx + span_w], i64))
            return ctx.op("Slice", [x, starts, ends, axes], hint)

        first = window(a, 0, 0, "first")
        maps = []
        for i, (dy, dx) in enumerate(offsets):
            second = window(b, dy, dx, f"b{i}")
            cost = (ctx.op("Abs", [ctx.op("Sub", [first, second], f"d{i}")], f"ad{i}") if subtract
                    else ctx.op("Mul", [first, second], f"p{i}"))
            maps.append(onnx_reduce(ctx, "ReduceMean", cost, [1], True, ctx.tmp(f"{name}_m{i}")))
        out = node.outputs[0]
        pooled = k > 1 or stride > 1
        cost = ctx.add_node("Concat", maps, ctx.tmp(name + "_cost") if pooled else out, axis=1)
        if pooled:
            ctx.add_node("AveragePool", [cost], out, kernel_shape=[k, k], strides=[stride, stride])

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0), emit.in_shape(1)], ExportError,
                                  node.type)
        args = self._args(node.attrs, emit.out_shape())
        rest = ", ".join(emit.lit(v) for v in args)
        return f"{emit.helper(flow_correlation)}({emit.inputs[0]}, {emit.inputs[1]}, {rest})"

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = out_shapes[0]
        return n * c * h * w * attrs["kernel"] ** 2 * in_shapes[0][1]


# ---- ChannelNorm ---------------------------------------------------------------------------

class _PerPixelMap(FunctionLayer):
    """A function of an (N, C, H, W) map giving `channels` values per pixel."""

    channels = 1

    def infer(self, attrs, in_shapes):
        n, _, h, w = four_axes(in_shapes[0], self.types[0])
        return [(n, self.channels, h, w)]


@register_layer("ChannelNorm")
class ChannelNorm(_PerPixelMap):
    fn = staticmethod(channel_norm)

    def onnx(self, ctx, node):
        ss = onnx_reduce(ctx, "ReduceSumSquare", node.inputs[0], [1], True, ctx.tmp(node.name + "_ss"))
        ctx.add_node("Sqrt", [ss], [node.outputs[0]], name=node.name)


# ---- Downsample ----------------------------------------------------------------------------

@register_layer("Downsample")
class Downsample(Layer):
    def parse(self, lp):
        need_blobs(lp, "Downsample", (1, 2), 1)
        p = lp.downsample_param
        return {"size": (int(p.top_height), int(p.top_width)), "bottoms": len(lp.bottom)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Downsample")
        if attrs["bottoms"] == 2:
            th, tw = four_axes(in_shapes[1], "Downsample", "second bottom")[2:]
        else:
            th, tw = attrs["size"]
        if th < 1 or tw < 1:
            raise LayerError(f"Downsample needs a top height and width > 0 (downsample_param top_height and "
                             f"top_width, or a second bottom), got {th} x {tw}")
        if (th, tw) != (h, w) and (th == 1 or tw == 1):
            raise LayerError(f"Downsample to {th} x {tw}: the fork divides by (top size - 1) = 0")
        return [(n, c, th, tw)]

    def forward(self, attrs, params, x, *like):
        th, tw = self.infer(attrs, [x.shape] + [t.shape for t in like])[0][2:]
        h, w = x.shape[2], x.shape[3]
        if (h, w) == (th, tw):
            return x
        # flow_downsample's computation (model.py runs that) with the weights made once per size and
        # device; on x's device, as there: CUDA divides by a scalar through its reciprocal
        return tent_average(x, cached_constant(downsample_matrix, h, th, x.device),
                            cached_constant(downsample_matrix, w, tw, x.device))

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        _, _, h, w = ctx.shape(x)
        _, _, th, tw = ctx.shape(node.outputs[0])
        out = node.outputs[0]
        if (h, w) == (th, tw):
            ctx.add_node("Identity", [x], out, name=name)
            return
        rows = downsample_matrix(h, th, torch.device("cpu")).numpy()
        cols = downsample_matrix(w, tw, torch.device("cpu")).t().contiguous().numpy()
        rows_c, cols_c = ctx.const(rows, name + "_rows"), ctx.const(cols, name + "_cols")

        def resize(t, hint):
            return ctx.op("MatMul", [rows_c, ctx.op("MatMul", [t, cols_c], hint + "_w")], hint)

        bad = ctx.op("IsNaN", [x], "isnan", name=name)
        zero, one = ctx.const(np.array(0, np.float32)), ctx.const(np.array(1, np.float32))
        good = ctx.op("Cast", [ctx.op("Not", [bad], "ok")], "good", to=1)
        value = resize(ctx.op("Where", [bad, zero, x], "clean"), "value")
        weight = resize(good, "weight")
        nan_weight = resize(ctx.op("Sub", [one, good], "bad"), "nan_weight")
        many = ctx.op("Greater", [ctx.op("Div", [nan_weight, weight], "nan_share"),
                                  ctx.const(np.array(0.5, np.float32))], "mostly_nan")
        ctx.add_node("Where", [many, ctx.const(np.array(np.nan, np.float32)),
                               ctx.op("Div", [value, weight], "mean")], [out])

    def pytorch_source(self, node, emit):
        th, tw = emit.out_shape()[2:]
        emit.helper(downsample_matrix)
        emit.helper(tent_average)
        return f"{emit.helper(flow_downsample)}({emit.inputs[0]}, {th}, {tw})"


# ---- Warp (PWC-Net's and LiteFlowNet's) ----------------------------------------------------

@register_layer("Warp")
class Warp(Layer):
    def parse(self, lp):
        need_blobs(lp, "Warp", 2, 1, "image, flow or coordinates")
        return {"coords": bool(lp.warp_param.absolute_coords)}

    def infer(self, attrs, in_shapes):
        image = four_axes(in_shapes[0], "Warp", "image")
        second = four_axes(in_shapes[1], "Warp", "second bottom")
        what = "coordinates" if attrs["coords"] else "flow"
        if second[0] != image[0] or second[1] != 2 or second[2:] != image[2:]:
            # PWC-Net's kernel reads the flow at the image's H and W; LiteFlowNet's indexes the
            # coordinates with the image's H and W although its top takes theirs
            raise LayerError(f"Warp's {what} must be (N, 2, H, W) of the image's N, H and W: image "
                             f"{list(image)}, {what} {list(second)}")
        return [image]

    def forward(self, attrs, params, image, second):
        return coords_warp(image, second) if attrs["coords"] else flow_warp(image, second, 0.0, True)

    def onnx(self, ctx, node):
        image, second = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        x, y = s.channel(second, 0, "x", name=node.name), s.channel(second, 1, "y")
        if node.attrs["coords"]:
            s.coords_warp(x, y, node.outputs[0])
            return
        s.flow_warp(x, y, 0.0, True, node.outputs[0])

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        if node.attrs["coords"]:
            return f"{emit.helper(coords_warp)}({emit.inputs[0]}, {emit.inputs[1]})"
        return f"{emit.helper(flow_warp)}({emit.inputs[0]}, {emit.inputs[1]}, 0.0, True)"


# ---- Grid, NegSquare, ExpMax ---------------------------------------------------------------

@register_layer("Grid")
class Grid(_PerPixelMap):
    fn = staticmethod(pixel_grid)
    channels = 2   # (x, y)

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        _, _, h, w = ctx.shape(x)
        gy, gx = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32), indexing="ij")
        grid = ctx.const(np.stack([gx, gy])[None], name + "_grid")
        batch = ctx.add_node("Slice", [ctx.add_node("Shape", [x], ctx.tmp(name + "_shape"), name=name),
                                       ctx.const(np.array([0], np.int64)), ctx.const(np.array([1], np.int64))],
                             ctx.tmp(name + "_n"))
        shape = ctx.add_node("Concat", [batch, ctx.const(np.array([2, h, w], np.int64))], ctx.tmp(name + "_to"),
                             axis=0)
        ctx.add_node("Expand", [grid, shape], [node.outputs[0]])


@register_layer("NegSquare")
class NegSquare(FunctionLayer):
    fn = staticmethod(neg_square)

    def onnx(self, ctx, node):
        sq = ctx.add_node("Mul", [node.inputs[0], node.inputs[0]], ctx.tmp(node.name + "_sq"), name=node.name)
        ctx.add_node("Neg", [sq], [node.outputs[0]])


@register_layer("ExpMax")
class ExpMax(Layer):
    def parse(self, lp):
        need_blobs(lp, "ExpMax", 1, 1)
        p = lp.expmax_param
        base, scale, shift = np.float32(p.base), np.float32(p.scale), np.float32(p.shift)
        if base != -1 and not base > 0:
            raise LayerError(f"expmax_param.base must be > 0 (or -1 for e), got {float(base)}")
        log_base = np.float32(1) if base == -1 else np.log(base)
        outer = np.float32(1) if shift == 0 else (np.power(base, shift) if base != -1 else np.exp(shift))
        return {"inner": float(np.float32(log_base * scale)), "outer": float(np.float32(outer))}

    def infer(self, attrs, in_shapes):
        return [four_axes(in_shapes[0], "ExpMax")]

    def forward(self, attrs, params, x):
        return exp_max(x, attrs["inner"], attrs["outer"])

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        i64 = np.int64

        top = onnx_reduce(ctx, "ReduceMax", x, [1], True, ctx.tmp(name + "_max"))
        first = ctx.op("Slice", [top, ctx.const(np.array([0], i64)), ctx.const(np.array([1], i64)),
                                 ctx.const(np.array([0], i64))], "max0", name=name)
        rest = ctx.op("Slice", [top, ctx.const(np.array([1], i64)), ctx.const(np.array([np.iinfo(i64).max], i64)),
                                ctx.const(np.array([0], i64))], "rest")
        zeros = ctx.op("ConstantOfShape", [ctx.op("Shape", [rest], "rest_shape")], "zeros",
                       value=np.array([0], np.float32))
        m = ctx.op("Concat", [first, zeros], "m", axis=0)
        y = ctx.op("Sub", [x, m], "centred")
        if node.attrs["inner"] != 1.0:
            y = ctx.op("Mul", [y, ctx.const(np.array(node.attrs["inner"], np.float32))], "scaled")
        if node.attrs["outer"] != 1.0:
            y = ctx.op("Exp", [y], "exp")
            ctx.add_node("Mul", [y, ctx.const(np.array(node.attrs["outer"], np.float32))], [node.outputs[0]])
        else:
            ctx.add_node("Exp", [y], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return (f"{emit.helper(exp_max)}({emit.inputs[0]}, {emit.lit(node.attrs['inner'])}, "
                f"{emit.lit(node.attrs['outer'])})")


# ---- read-only: augmentation and Resample ---------------------------------------------------

_AUGMENTATION_WHY = ("flownet2's {type} draws random augmentation parameters while training and keeps "
                     "state across batches; caffeq sizes it but does not run it (read the net's deploy "
                     "prototxt to run the network)")


class _Augmentation(ReadOnlyLayer):
    def why_not_run(self, attrs):
        return _AUGMENTATION_WHY.format(type=self.types[0])


@register_layer("DataAugmentation")
class DataAugmentation(_Augmentation):
    blob_names = ("iteration", "mean", "channel_mean")

    def parse(self, lp):
        need_blobs(lp, "DataAugmentation", (1, 2), (1, 2))
        p = lp.augmentation_param
        crop = (int(p.crop_height), int(p.crop_width)) if p.HasField("crop_width") and p.HasField("crop_height") \
            else None
        return {"name": lp.name, "crop": crop, "tops": len(lp.top), "bottoms": len(lp.bottom),
                "recompute_mean": int(p.recompute_mean)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "DataAugmentation")
        ch, cw = attrs["crop"] or (h, w)
        if cw > w or ch > h:
            raise LayerError(f"DataAugmentation's crop {ch} x {cw} is larger than its {h} x {w} bottom")
        shapes = [(n, c, ch, cw)]
        if attrs["tops"] == 2:
            shapes.append(tuple(in_shapes[1]) if attrs["bottoms"] == 2 else (n, AUGMENTATION_COEFFS, 1, 1))
        return shapes

    def param_shapes(self, attrs, in_shapes):
        if not attrs["recompute_mean"]:
            return [(1, 1, 1, 1)]
        _, c, h, w = in_shapes[0]
        ch, cw = attrs["crop"] or (h, w)
        return [(1, 1, 1, 1), (1, c, ch, cw), (1, c, 1, 1)]


@register_layer("FlowAugmentation")
class FlowAugmentation(_Augmentation):
    def parse(self, lp):
        need_blobs(lp, "FlowAugmentation", 3, 1, "flow, first image's parameters, second image's parameters")
        p = lp.augmentation_param
        return {"name": lp.name, "crop": (int(p.crop_height), int(p.crop_width))}

    def infer(self, attrs, in_shapes):
        n, c, _, _ = four_axes(in_shapes[0], "FlowAugmentation")
        if c != 2:
            raise LayerError(f"FlowAugmentation's flow must have two channels, got {list(in_shapes[0])}")
        return [(n, 2) + attrs["crop"]]


@register_layer("GenerateAugmentationParameters")
class GenerateAugmentationParameters(_Augmentation):
    def parse(self, lp):
        need_blobs(lp, "GenerateAugmentationParameters", (1, 3), 1)
        p = lp.augmentation_param
        if len(lp.bottom) == 1 and not (p.HasField("crop_width") and p.HasField("crop_height")):
            raise LayerError("GenerateAugmentationParameters with one bottom needs augmentation_param.crop_width "
                             "and crop_height")
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        return [(int(in_shapes[0][0]), AUGMENTATION_COEFFS, 1, 1)]


@register_layer("Resample")
class Resample(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "Resample", (1, 2), 1)
        p = lp.resample_param
        return {"name": lp.name, "size": (int(p.height), int(p.width)), "bottoms": len(lp.bottom),
                "kind": f"Resample, {p.ResampleType.Name(p.type)}"}

    def infer(self, attrs, in_shapes):
        n, c, _, _ = four_axes(in_shapes[0], "Resample")
        th, tw = four_axes(in_shapes[1], "Resample", "second bottom")[2:] if attrs["bottoms"] == 2 \
            else attrs["size"]
        if th < 1 or tw < 1:
            raise LayerError(f"Resample needs a top height and width > 0 (resample_param height and width, or "
                             f"a second bottom), got {th} x {tw}")
        return [(n, c, th, tw)]

    def why_not_run(self, attrs):
        return ("flownet2's resampling filters (antialiased triangle / bicubic, nearest) are not reproduced in "
                "caffeq; the net reads and sizes but cannot run or be exported")


@register_layer("FLOWriter", "FloatWriter", "ImgWriter", "PFMWriter")
class FlowNetWriter(Sink):
    """flownet2's writers (flowriter_layer.cpp...): each TEST forward saves its one bottom as a file
    (.flo, float, image, .pfm) under writer_param; no tops, so nothing to compute, and caffeq writes
    no files a model names."""
    bottoms, tops = 1, 0

