"""SpatialWta: t2mhanh/caffe_convLSTM_WTA's spatial winner-take-all (3b257ec, spatial_wta_layer.cpp / .cu).

spatial_wta_param: kernel_size or kernel_h and kernel_w, stride [1] or stride_h and stride_w, global_wta
[false] (one window over the whole H x W; no kernel then, stride 1); pad and engine are never read.
Bottom (N, C, H, W); top the same shape, and an optional second top, the winners' mask (1 there, 0
elsewhere).  The windows start at multiples of the stride, only whole ones (floor((H - kh) / sh) + 1
rows of them; none when the kernel is larger than the map).  Each window keeps its first element of
largest |x| in row-major order, with its sign; every other element is 0, so overlapping windows give
the union of their winners.  A NaN never wins (the fork's `fabs(x) > max` is false for it); a window of
NaN only, where the CPU code writes outside the map, keeps its first element here.  CPU and GPU agree.
The fork's SpatialConvWta has no implementation (Caffe built from it does not know the type).
"""
import numpy as np
import torch

from .registry import Layer, LayerError, need_blobs, register_layer
from .ssd.common import scalar_tensor


def wta_windows(h: int, w: int, kernel: tuple, stride: tuple):
    """(L, kh x kw) int64: the flat H x W index of each whole window's elements, row by row."""
    (kh, kw), (sh, sw) = kernel, stride
    rows, cols = (h - kh) // sh + 1 if h >= kh else 0, (w - kw) // sw + 1 if w >= kw else 0
    ys = (np.arange(rows) * sh)[:, None, None, None] + np.arange(kh)[None, None, :, None]
    xs = (np.arange(cols) * sw)[None, :, None, None] + np.arange(kw)[None, None, None, :]
    return (ys * w + xs).reshape(rows * cols, kh * kw).astype(np.int64)


def spatial_wta(x, windows, mask_top: bool):
    """SpatialWta of (N, C, H, W) x over windows (wta_windows' table): the top, and the mask if asked."""
    n, c, h, w = x.shape
    flat = x.reshape(n * c, h * w)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    if windows.shape[0]:
        size = flat.abs()
        size = torch.where(torch.isnan(size), torch.full_like(size, -1.0), size)   # NaN never wins
        picked = size[:, windows.reshape(-1)].reshape(n * c, windows.shape[0], windows.shape[1])
        first = picked.argmax(dim=2)   # the first of equal maxima
        winners = windows[torch.arange(windows.shape[0], device=x.device), first]   # (N C, L)
        keep.scatter_(1, winners, True)
    top = torch.where(keep, flat, torch.zeros_like(flat)).reshape(x.shape)
    return (top, keep.to(x.dtype).reshape(x.shape)) if mask_top else top


@register_layer("SpatialWta")
class SpatialWta(Layer):
    def parse(self, lp):
        need_blobs(lp, "SpatialWta", 1, (1, 2))
        p = lp.spatial_wta_param
        if p.global_wta:
            if p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w"):
                raise LayerError("spatial_wta_param: global_wta takes no kernel_size / kernel_h / kernel_w")
            kernel = None
        elif p.HasField("kernel_size") and not (p.HasField("kernel_h") or p.HasField("kernel_w")):
            kernel = (int(p.kernel_size),) * 2
        elif p.HasField("kernel_h") and p.HasField("kernel_w") and not p.HasField("kernel_size"):
            kernel = (int(p.kernel_h), int(p.kernel_w))
        else:
            raise LayerError("spatial_wta_param needs kernel_size, or kernel_h and kernel_w (not both forms)")
        if p.HasField("stride_h") != p.HasField("stride_w") or (p.HasField("stride_h") and p.HasField("stride")):
            raise LayerError("spatial_wta_param: stride, or stride_h and stride_w")
        stride = (int(p.stride_h), int(p.stride_w)) if p.HasField("stride_h") else (int(p.stride),) * 2
        if kernel is not None and min(kernel) < 1:
            raise LayerError(f"spatial_wta_param: the kernel must be positive, got {list(kernel)}")
        if min(stride) < 1 or (kernel is None and stride != (1, 1)):
            raise LayerError(f"spatial_wta_param: stride {list(stride)} must be positive (1 with global_wta)")
        return {"kernel": kernel, "stride": stride, "mask": len(lp.top) == 2}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"SpatialWta takes (N, C, H, W), got {list(s)}")
        return [s] * (2 if attrs["mask"] else 1)

    def _windows(self, attrs, shape):
        h, w = shape[2], shape[3]
        return wta_windows(h, w, attrs["kernel"] or (h, w), attrs["stride"])

    def forward(self, attrs, params, x):
        windows = torch.from_numpy(self._windows(attrs, x.shape)).to(x.device)
        return spatial_wta(x, windows, attrs["mask"])

    def onnx(self, ctx, node):
        shape = ctx.shape(node.inputs[0])
        windows = self._windows(node.attrs, shape)
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, shape[2] * shape[3]])], "flat")
        zeros = ctx.op("ConstantOfShape", [ctx.op("Shape", [flat], "fs")], "zeros", value=scalar_tensor(0.0))
        if windows.shape[0]:
            size = ctx.op("Abs", [flat], "abs")
            size = ctx.op("Where", [ctx.op("IsNaN", [size], "nan"), ctx.f32(-1.0), size], "size")
            picked = ctx.op("Gather", [size, ctx.const(windows)], "picked", axis=1)   # (N C, L, K)
            first = ctx.op("ArgMax", [picked], "first", axis=2, keepdims=1, select_last_index=0)
            table = ctx.op("Expand", [ctx.const(windows[None]), ctx.op("Concat", [
                ctx.op("Slice", [ctx.op("Shape", [flat], "fs"), ctx.i64([0]), ctx.i64([1])], "rows"),
                ctx.i64(list(windows.shape))], "ts", axis=0)],
                "table")
            winners = ctx.op("Squeeze", [ctx.op("GatherElements", [table, first], "winner", axis=2), ctx.i64([2])],
                             "winners")
            ones = ctx.op("ConstantOfShape", [ctx.op("Shape", [winners], "ws")], "ones", value=scalar_tensor(1.0))
            mask = ctx.op("ScatterElements", [zeros, winners, ones], "mask", axis=1)
        else:
            mask = zeros
        keep = ctx.op("Greater", [mask, ctx.f32(0.5)], "keep")
        top = ctx.op("Where", [keep, flat, ctx.f32(0.0)], "top")
        ctx.add_node("Reshape", [top, ctx.i64(list(shape))], [node.outputs[0]])
        if node.attrs["mask"]:
            ctx.add_node("Reshape", [mask, ctx.i64(list(shape))], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(spatial_wta)
        windows = self._windows(node.attrs, emit.in_shape(0))
        m = emit.module("torch.nn.Module()")
        emit.init(f"{m}.register_buffer('windows', torch.zeros({windows.shape[0]}, {windows.shape[1]}, "
                  f"dtype=torch.int64))")
        emit.buffer("windows", windows)
        call = f"{fn}({emit.inputs[0]}, {m}.windows, {node.attrs['mask']})"
        if not node.attrs["mask"]:
            return call
        out = emit.tmp("wta")
        emit.stmt(f"{out} = {call}")
        return [f"{out}[0]", f"{out}[1]"]
