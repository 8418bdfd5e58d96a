"""The segmentation forks' Unpooling layers (split from segmentation.py).

- Unpooling (DeconvNet, HyeonwooNoh/caffe unpooling_layer.cpp; unpooling_param):
  the output is unpool_size^2 or unpool_h x unpool_w (one form is required),
  pad must be 0.  MAX with a mask bottom puts each value at int(mask) (h * W + w,
  as Pooling's mask top; the last write wins), zeros elsewhere; MAX without a
  mask puts input (i, j) at output (i * stride_h, j * stride_w), clamped into
  the output.  AVE adds x / area over each input's kernel window (the area
  clipped at the output's edge), TILE adds x there; overlapping windows sum.
  (The fork's AVE and TILE never clear their top, so Caffe adds onto the
  previous forward's output from the second pass on; this is the first pass.)
  Without unpool_size / unpool_h / unpool_w the layer is caffe-cedn's
  (jimeiyang/objectContourDetector, same field numbers): the output is
  (size - 1) * stride + kernel - 2 * pad, MAX needs the mask bottom, AVE as
  above (pad 0 only here), value 2 is its unimplemented STOCHASTIC.
- tum-vision/fusenet's Unpooling (unpooling_param output_h / output_w or scale) and mariolew/caffe-unpooling's
  (the geometry in pooling_param): SegNet's mask unpooling, see the classes below.

The torch functions and modules below are also copied into the standalone
model.py (inspect.getsource), so the export computes the same bits.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .registry import Layer, LayerError, claim_layers, need_blobs, register_layer, spatial_params, torch_sources
from .vision_forks import TORCH_SEGNET_UNPOOL, onnx_unpool, segnet_unpool

UNPOOL_MAX, UNPOOL_AVE, UNPOOL_TILE = 0, 1, 2


def unpool_grid(x, stride: list[int], out_h: int, out_w: int):
    """DeconvNet's MAX unpooling without a mask: input (i, j) goes to output (i * stride_h, j * stride_w)
    clamped into the output, as h * out_w + w indices shaped like x (for segnet_unpool)."""
    rows = torch.clamp(torch.arange(x.shape[2], device=x.device) * stride[0], max=out_h - 1)
    cols = torch.clamp(torch.arange(x.shape[3], device=x.device) * stride[1], max=out_w - 1)
    return (rows[:, None] * out_w + cols[None, :]).to(x.dtype).expand(x.shape)


def unpool_window_area(n: int, kernel: int, stride: int, out: int, device: torch.device):
    """Per input row (or column): its window's extent, clipped at the output's edge (>= 1)."""
    starts = torch.arange(n, device=device) * stride
    return torch.clamp(torch.clamp(starts + kernel, max=out) - starts, min=1)


def unpool_spread(x, kernel: list[int], stride: list[int], out_h: int, out_w: int, average: bool):
    """DeconvNet's AVE (average=True: x / window area) or TILE unpooling: each value added over its
    kernel window; the full map ((H - 1) * stride + kernel) is cropped or zero-padded to the output."""
    c, h, w = x.shape[1], x.shape[2], x.shape[3]
    if average:
        area_h = unpool_window_area(h, kernel[0], stride[0], out_h, x.device).to(x.dtype)
        area_w = unpool_window_area(w, kernel[1], stride[1], out_w, x.device).to(x.dtype)
        x = x / (area_h[:, None] * area_w[None, :])
    ones = torch.ones([c, 1, kernel[0], kernel[1]], dtype=x.dtype, device=x.device)
    y = F.conv_transpose2d(x, ones, stride=stride, groups=c)[:, :, :out_h, :out_w]
    return F.pad(y, [0, out_w - y.shape[3], 0, out_h - y.shape[2]])


def unpooled_size(size: int, kernel: int, stride: int, pad: int) -> int:
    """caffe-cedn's Unpooling output, sized like a deconvolution: (size - 1) * stride + kernel - 2 * pad."""
    return (size - 1) * stride + kernel - 2 * pad


def deconvnet_mask(mask, x):
    """The mask as DeconvNet's Unpooling reads it: its loop steps through the mask one plane per data
    plane and checks no shapes, so a mask of more channels gives its first x.numel() values."""
    if mask.shape == x.shape:
        return mask
    return mask.reshape(-1)[: x.numel()].reshape(x.shape)


class DeconvNetUnpool(nn.Module):
    """DeconvNet's Unpooling: MAX with or without a mask bottom, AVE, TILE (see the functions).
    out_h = out_w = 0: caffe-cedn's, sized by unpooled_size with `pad`."""

    def __init__(self, method: int, kernel: list[int], stride: list[int], out_h: int, out_w: int,
                 pad: tuple = (0, 0)):
        super().__init__()
        self.method, self.kernel, self.stride, self.out_h, self.out_w = method, kernel, stride, out_h, out_w
        self.pad = pad

    def forward(self, x, mask: torch.Tensor | None = None):
        out_h, out_w = self.out_h, self.out_w
        if out_h == 0:
            out_h = unpooled_size(x.shape[2], self.kernel[0], self.stride[0], self.pad[0])
            out_w = unpooled_size(x.shape[3], self.kernel[1], self.stride[1], self.pad[1])
        if self.method != 0:
            return unpool_spread(x, self.kernel, self.stride, out_h, out_w, self.method == 1)
        if mask is None:
            mask = unpool_grid(x, self.stride, out_h, out_w)
        return segnet_unpool(x, deconvnet_mask(mask, x), out_h, out_w)


TORCH_DECONVNET_UNPOOL = torch_sources(unpool_grid, unpool_window_area, unpool_spread, unpooled_size, deconvnet_mask,
                                       DeconvNetUnpool)


@register_layer("Unpooling")
class Unpooling(Layer):
    def parse(self, lp):
        need_blobs(lp, "Unpooling", (1, 2), roles="data, max-pooling mask")
        p = lp.unpooling_param
        if any(p.HasField(f) for f in ("output_h", "output_w", "scale")):
            return self._fusenet_attrs(lp, p)
        method = int(p.unpool)
        if method not in (UNPOOL_MAX, UNPOOL_AVE, UNPOOL_TILE):
            raise LayerError(f"unknown unpooling_param.unpool {method}")
        if not (p.HasField("kernel_size") or p.HasField("kernel_h")):
            raise LayerError("unpooling_param.kernel_size (or kernel_h/kernel_w) is required")
        kernel = spatial_params(p, 2, "kernel_size", None, min_value=1)
        stride = spatial_params(p, 2, "stride", 1, min_value=1)
        pad = spatial_params(p, 2, "pad", 0)
        has_hw = p.HasField("unpool_h") or p.HasField("unpool_w")
        if not p.HasField("unpool_size") and not has_hw:
            # caffe-cedn (jimeiyang/objectContourDetector): no output size field; sized like a deconvolution
            if method == UNPOOL_TILE:
                raise LayerError("unpooling_param.unpool 2 without an output size: caffe-cedn's STOCHASTIC, "
                                 "which it does not implement")
            if method == UNPOOL_MAX and len(lp.bottom) != 2:
                raise LayerError("caffe-cedn's MAX unpooling (no unpool_size) needs the max-pooling mask as "
                                 "its second bottom")
            if any(pad) and method == UNPOOL_AVE:
                raise LayerError("caffe-cedn's AVE unpooling with pad is not supported")
            if any(pd >= k for pd, k in zip(pad, kernel)):
                raise LayerError(f"unpooling_param.pad {list(pad)} must be below the kernel {list(kernel)}")
            return {"method": method, "kernel": kernel, "stride": stride, "out": None, "pad": pad,
                    "mask": len(lp.bottom) == 2}
        if any(pad):
            raise LayerError("unpooling_param.pad must be 0 (the fork implements no padding)")
        if p.HasField("unpool_size") and not has_hw:
            out = (int(p.unpool_size),) * 2
        elif p.HasField("unpool_h") and p.HasField("unpool_w") and not p.HasField("unpool_size"):
            out = (int(p.unpool_h), int(p.unpool_w))
        else:
            raise LayerError("unpooling_param needs unpool_size, or unpool_h and unpool_w (not both forms)")
        if min(out) < 1:
            raise LayerError(f"unpooling_param output size must be >= 1, got {list(out)}")
        return {"method": method, "kernel": kernel, "stride": stride, "out": out, "pad": (0, 0),
                "mask": len(lp.bottom) == 2}

    @staticmethod
    def _fusenet_attrs(lp, p):
        """tum-vision/fusenet's Unpooling (1e5cf50 unpooling_layer.cpp / .cu): SegNet's mask unpooling,
        two bottoms, to (output_h, output_w) when both are given, else to the input's size times scale."""
        if len(lp.bottom) != 2:
            raise LayerError("FuseNet's Unpooling (unpooling_param output_h / output_w / scale) takes 2 bottoms "
                             "(data, max-pooling mask)")
        other = [f for f in ("unpool", "kernel_size", "kernel_h", "unpool_size", "unpool_h") if p.HasField(f)]
        if other:
            raise LayerError(f"unpooling_param.{other[0]} is another fork's; FuseNet's Unpooling reads only "
                             f"output_h, output_w and scale")
        if p.HasField("output_h") and p.HasField("output_w"):
            out = (int(p.output_h), int(p.output_w))
            if min(out) < 1:
                raise LayerError(f"unpooling_param.output_h and output_w must be > 0, got {list(out)}")
            return {"method": UNPOOL_MAX, "kernel": (1, 1), "stride": (1, 1), "out": out, "pad": (0, 0),
                    "mask": True}
        if not p.HasField("scale"):
            raise LayerError("FuseNet's Unpooling needs unpooling_param output_h and output_w, or scale")
        scale = int(p.scale)
        if scale < 1:
            raise LayerError(f"unpooling_param.scale must be > 0, got {scale}")
        # (H - 1) * scale + scale = H * scale: the deconvolution-like size with kernel = stride = scale
        return {"method": UNPOOL_MAX, "kernel": (scale, scale), "stride": (scale, scale), "out": None,
                "pad": (0, 0), "mask": True}

    @staticmethod
    def _out(attrs, shape):
        if attrs["out"] is not None:
            return attrs["out"]
        return tuple(unpooled_size(int(n), k, s, pd) for n, k, s, pd in
                     zip(shape[2:], attrs["kernel"], attrs["stride"], attrs["pad"]))

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"Unpooling needs a 4-axis input, got {list(s)}")
        if attrs["mask"] and tuple(in_shapes[1]) != s:
            m = tuple(in_shapes[1])
            # DeconvNet's loop reads a mask of more channels plane by plane (caffe-cedn's checks the shape)
            if attrs["out"] is None or len(m) != 4 or m[2:] != s[2:] or math.prod(m) < math.prod(s):
                raise LayerError(f"the mask {list(m)} must be shaped like the data {list(s)}")
            attrs.setdefault("reading_notes", []).append(
                f"the mask {list(m)} has more channels than the data {list(s)}: read as DeconvNet's Unpooling "
                f"does, its first {math.prod(s)} values, one {s[2]}x{s[3]} plane per data plane")
        return [s[:2] + self._out(attrs, s)]

    def forward(self, attrs, params, x, mask=None):
        oh, ow = self._out(attrs, x.shape)
        if attrs["method"] != UNPOOL_MAX:
            return unpool_spread(x, list(attrs["kernel"]), list(attrs["stride"]), oh, ow,
                                 attrs["method"] == UNPOOL_AVE)
        if mask is None:
            mask = unpool_grid(x, list(attrs["stride"]), oh, ow)
        mask = deconvnet_mask(mask, x)
        idx = mask.to(torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= oh * ow):
            raise LayerError(f"Unpooling mask index out of range for a {oh}x{ow} output")
        return segnet_unpool(x, mask, oh, ow)

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        _, c, h, w = (int(d) for d in ctx.shape(x))
        oh, ow = self._out(a, ctx.shape(x))
        k, s = a["kernel"], a["stride"]
        if a["method"] == UNPOOL_MAX:
            mask = node.inputs[1] if a["mask"] else None
            if mask is not None and tuple(ctx.shape(mask)) != tuple(ctx.shape(x)):   # deconvnet_mask
                flat = ctx.op("Reshape", [mask, ctx.i64([-1])], "mask_flat")
                first = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([math.prod(ctx.shape(x))])], "mask_first")
                mask = ctx.op("Reshape", [first, ctx.i64(list(ctx.shape(x)))], "mask")
            if mask is None:   # the fixed grid of unpool_grid, broadcast to x's shape
                grid = np.ascontiguousarray(unpool_grid(torch.zeros(1, 1, h, w), list(s), oh, ow).numpy())
                shape = ctx.add_node("Shape", [x], [ctx.tmp(node.name + "_shape")])[0]
                mask = ctx.add_node("Expand", [ctx.const(grid, node.name + "_grid"), shape],
                                    [ctx.tmp(node.name + "_grid_x")])[0]
            onnx_unpool(ctx, node.name, x, mask, out, oh, ow)
            return
        if a["method"] == UNPOOL_AVE:
            cpu = torch.device("cpu")
            ah = unpool_window_area(h, k[0], s[0], oh, cpu)
            aw = unpool_window_area(w, k[1], s[1], ow, cpu)
            area = (ah[:, None] * aw[None, :]).numpy().astype(np.float32)
            x = ctx.add_node("Div", [x, ctx.const(area, node.name + "_area")], [ctx.tmp(node.name + "_avg")],
                             name=node.name)[0]
        ones = np.ones((c, 1, k[0], k[1]), np.float32)
        y = ctx.add_node("ConvTranspose", [x, ctx.const(ones, node.name + "_ones")], [ctx.tmp(node.name + "_spread")],
                         name=node.name + "/spread", group=c, kernel_shape=list(k), strides=list(s))[0]
        fh, fw = (h - 1) * s[0] + k[0], (w - 1) * s[1] + k[1]
        if fh > oh or fw > ow:
            y = ctx.add_node("Slice", [y, ctx.const(np.array([0, 0], np.int64)),
                                       ctx.const(np.array([min(fh, oh), min(fw, ow)], np.int64)),
                                       ctx.const(np.array([2, 3], np.int64))], [ctx.tmp(node.name + "_cut")])[0]
        pads = np.array([0, 0, 0, 0, 0, 0, max(0, oh - fh), max(0, ow - fw)], np.int64)
        ctx.add_node("Pad", [y, ctx.const(pads)], [out], mode="constant")

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(TORCH_DECONVNET_UNPOOL, a["method"], list(a["kernel"]), list(a["stride"]),
                          *(a["out"] or (0, 0)), tuple(a["pad"]), needs=[TORCH_SEGNET_UNPOOL])
        return f"{m}({', '.join(emit.inputs)})"


def pooling_unpooled_size(size: int, kernel: int, stride: int, pad: int) -> int:
    """mariolew/caffe-unpooling's output size (unpooling_layer.cpp Reshape): the deconvolution size, then with a
    pad, one less for an even input, then one more if (size - 1) * stride >= out + pad."""
    out = (size - 1) * stride + kernel - 2 * pad
    if pad > 0:
        out -= 1 if size % 2 == 0 else 0
        if (size - 1) * stride >= out + pad:
            out += 1
    return out


def _reads_pooling_param(lp):
    return not lp.HasField("unpooling_param") and lp.HasField("pooling_param")


@claim_layers("Unpooling", _reads_pooling_param)
class PoolingParamUnpooling(Unpooling):
    """mariolew/caffe-unpooling's Unpooling (e24b331 unpooling_layer.cpp; its DeconvNet VGG16): the max-pooling
    geometry in pooling_param, the mask as its second bottom; each value written at its mask index within the
    (top) plane, later ones winning, as the other mask unpoolings."""
    types = ("Unpooling",)

    def parse(self, lp):
        need_blobs(lp, "Unpooling (pooling_param: mariolew/caffe-unpooling)", 2, 1, roles="data, max-pooling mask")
        p = lp.pooling_param
        if p.pool != p.MAX:
            raise LayerError(f"pooling_param.pool {p.PoolMethod.Name(p.pool)}: mariolew/caffe-unpooling implements "
                             f"MAX unpooling only")
        if p.global_pooling:
            raise LayerError("pooling_param.global_pooling in an Unpooling (mariolew/caffe-unpooling) is not supported")
        if not (len(p.kernel_size) or p.HasField("kernel_h")):
            raise LayerError("pooling_param.kernel_size (or kernel_h/kernel_w) is required")
        kernel, pad = spatial_params(p, 2, "kernel_size", None, min_value=1), spatial_params(p, 2, "pad", 0)
        if any(pd >= k for pd, k in zip(pad, kernel)):
            raise LayerError(f"pooling_param.pad {list(pad)} must be below the kernel {list(kernel)} (the fork's "
                             f"CHECK_LT)")
        return {"method": UNPOOL_MAX, "kernel": kernel, "stride": spatial_params(p, 2, "stride", 1, min_value=1),
                "pad": pad, "out": None, "mask": True}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"Unpooling needs a 4-axis input, got {list(s)}")
        attrs["out"] = tuple(pooling_unpooled_size(int(n), k, st, pd) for n, k, st, pd in
                             zip(s[2:], attrs["kernel"], attrs["stride"], attrs["pad"]))
        if min(attrs["out"]) < 1:
            raise LayerError(f"Unpooling output would be {list(attrs['out'])} for the input {list(s)}")
        return super().infer(attrs, in_shapes)
