"""3-D (5-axis) MAX and AVE pooling over explicit windows, shared by N-D Pooling and C3D's Pooling3D.

Both forks describe a window along each spatial axis by kernel k, stride s and a leading pad p:
output i covers [i*s - p, i*s - p + k).  MAX takes the largest cell inside the input (Caffe starts
at -FLT_MAX, so padding never wins and an all -inf window gives -FLT_MAX); AVE sums the cells inside
the input and divides by the window clipped to size + p (padding cells count, the overhang past
size + p does not).  The caller decides the number of outputs per axis (each fork rounds its own way)
and makes sure every window starts inside the input.

- N-D Pooling: VisionLearningGroup/R-C3D caffe3d pooling_layer.cpp (PoolingParameter with repeated
  kernel_size / stride / pad); its N-D forward runs through cuDNN (CUDNN_POOLING_MAX and
  CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING), the same windows as Caffe's 2-D loops.
- C3D v1.0 / v1.1 Pooling3D (pool3d_layer.cpp): pad only on H and W, ceil rounding.

The torch functions are copied into the standalone model.py (inspect.getsource).
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from .registry import Layer

FLT_MAX = 3.4028234663852886e38


def pool_extents(size: int, kernel: int, stride: int, pad: int, out: int):
    """Per output position of one axis: the AVE divisor (the window clipped to size + pad)."""
    sizes = []
    for i in range(out):
        start = i * stride - pad
        sizes.append(min(start + kernel, size + pad) - start)
    return sizes


def _end_pads(sizes, kernel, stride, pad, out):
    """Cells to add past each axis's end so that the last window fits (0 where it already does)."""
    return [max(0, (o - 1) * s + k - p - n) for n, k, s, p, o in zip(sizes, kernel, stride, pad, out)]


def pads_reach_kernel(kernel, front, back):
    """Whether a pad on some axis is not below its kernel.  onnxruntime (1.30 at least) folds a zero Pad
    into the AveragePool after it and then rejects such pads, so the AVE paths sum the windows with
    onnx_window_sums there instead."""
    return any(f >= k or b >= k for k, f, b in zip(kernel, front, back))


def onnx_window_sums(ctx, node, padded, channels, geometry):
    """The sum over each window: a depthwise Conv of ones (kernel_shape, strides, dilations in geometry)."""
    ones = ctx.const(np.ones((channels, 1) + tuple(geometry["kernel_shape"]), np.float32), node.name + "_ones")
    return ctx.add_node("Conv", [padded, ones], [ctx.tmp(node.name + "_sums")], group=channels, **geometry)[0]


def caffe_max_input(x):
    """x with NaN made -inf: Caffe's MAX keeps a cell only when it is greater (`>`), so a NaN never wins,
    where torch's max pooling returns it."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def max_pool3d_windows(x, kernel: list[int], stride: list[int], pad: list[int], out: list[int]):
    """MAX over each window's cells inside the input, NaN never winning; -FLT_MAX where none exceeds it."""
    back = [max(0, (o - 1) * s + k - p - n) for n, k, s, p, o in zip(x.shape[2:], kernel, stride, pad, out)]
    x = F.pad(caffe_max_input(x), [pad[2], back[2], pad[1], back[1], pad[0], back[0]], value=float("-inf"))
    y = F.max_pool3d(x, kernel, stride)[:, :, :out[0], :out[1], :out[2]]
    return y.clamp_min(-3.4028234663852886e38)


def ave_pool3d_windows(x, kernel: list[int], stride: list[int], pad: list[int], out: list[int]):
    """The sum over each window's cells inside the input, divided by the window clipped to size + pad."""
    sizes = [x.shape[2], x.shape[3], x.shape[4]]
    back = [max(0, (o - 1) * s + k - p - n) for n, k, s, p, o in zip(sizes, kernel, stride, pad, out)]
    x = F.pad(x, [pad[2], back[2], pad[1], back[1], pad[0], back[0]])
    sums = F.avg_pool3d(x, kernel, stride, divisor_override=1)[:, :, :out[0], :out[1], :out[2]]
    d = pool_extents(sizes[0], kernel[0], stride[0], pad[0], out[0])
    h = pool_extents(sizes[1], kernel[1], stride[1], pad[1], out[1])
    w = pool_extents(sizes[2], kernel[2], stride[2], pad[2], out[2])
    divisor = torch.tensor(d, dtype=x.dtype, device=x.device)[:, None, None] * \
        torch.tensor(h, dtype=x.dtype, device=x.device)[None, :, None] * \
        torch.tensor(w, dtype=x.dtype, device=x.device)[None, None, :]
    return sums / divisor


def first_empty_axis(sizes, stride, pad, out):
    """The index of the first axis whose last window starts at or past the input's end, else None."""
    for axis, (n, s, p, o) in enumerate(zip(sizes, stride, pad, out)):
        if (o - 1) * s - p >= n:
            return axis
    return None


def onnx_pool3d_windows(ctx, node, is_max, x, y, sizes, kernel, stride, pad, out):
    """Pad (the leading pads and the end cells the last windows need), then MaxPool / AveragePool
    without pads, a Slice where floor rounding gives more windows than `out`, and for AVE one
    constant per output position: window volume / the fork's divisor (or the window sums divided by
    the divisor, where a pad reaches the kernel)."""
    back = _end_pads(sizes, kernel, stride, pad, out)
    pads = np.array([0, 0] + list(pad) + [0, 0] + back, np.int64)
    fill = np.array(-FLT_MAX if is_max else 0.0, np.float32)
    padded = ctx.add_node("Pad", [x, ctx.const(pads, node.name + "_pads"), ctx.const(fill)],
                          [ctx.tmp(node.name + "_padded")], name=node.name)[0]
    geometry = {"kernel_shape": list(kernel), "strides": list(stride)}
    sums = not is_max and pads_reach_kernel(kernel, pad, back)
    if sums:
        pooled = onnx_window_sums(ctx, node, padded, int(ctx.shape(x)[1]), geometry)
    else:
        pooled = ctx.add_node("MaxPool" if is_max else "AveragePool", [padded], [ctx.tmp(node.name + "_pooled")],
                              **geometry)[0]
    full = [(n + p + b - k) // s + 1 for n, k, s, p, b in zip(sizes, kernel, stride, pad, back)]
    if full != list(out):
        consts = [ctx.const(np.array(v, np.int64)) for v in ([0, 0, 0], list(out), [2, 3, 4])]
        pooled = ctx.add_node("Slice", [pooled] + consts, [ctx.tmp(node.name + "_cut")])[0]
    if is_max:
        # a window of -inf cells gives -inf; Caffe keeps its initial -FLT_MAX
        ctx.add_node("Max", [pooled, ctx.const(np.array(-FLT_MAX, np.float32))], [y])
        return
    extents = [np.array(pool_extents(n, k, s, p, o), np.float64)
               for n, k, s, p, o in zip(sizes, kernel, stride, pad, out)]
    divisor = extents[0][:, None, None] * extents[1][None, :, None] * extents[2][None, None, :]
    if sums:
        ctx.add_node("Div", [pooled, ctx.const(divisor.astype(np.float32)[None, None], node.name + "_divisor")], [y])
        return
    factor = (math.prod(kernel) / divisor).astype(np.float32)[None, None]   # AveragePool divided by the volume
    ctx.add_node("Mul", [pooled, ctx.const(factor, node.name + "_factor")], [y])


def pytorch_pool3d_call(emit, is_max, x, kernel, stride, pad, out):
    """model.py: the call of max_pool3d_windows / ave_pool3d_windows (copied in as helpers)."""
    if is_max:
        emit.helper(caffe_max_input)
        fn = emit.helper(max_pool3d_windows)
    else:
        emit.helper(pool_extents)
        fn = emit.helper(ave_pool3d_windows)
    return f"{fn}({x}, {list(kernel)}, {list(stride)}, {list(pad)}, {list(out)})"


POOL_MAX, POOL_AVE = 0, 1   # PoolingParameter.PoolMethod's MAX and AVE, as the 3-D forks' messages number them


class WindowPool3d(Layer):
    """forward, multiply-accumulates, ONNX and model.py of a 3-D MAX/AVE pooling over the windows of
    this module, for a spec whose `windows(attrs)` gives (kernel, stride, pad, out) per axis and whose
    attrs hold `method` (C3D's Pooling3D, video-caffe's NdPooling, caffe_3d_faster_rcnn's Pooling3D)."""

    def windows(self, attrs):
        return attrs["_kernel"], list(attrs["stride"]), list(attrs["pad"]), attrs["_out"]

    def forward(self, attrs, params, x):
        pool = max_pool3d_windows if attrs["method"] == POOL_MAX else ave_pool3d_windows
        return pool(x, *self.windows(attrs))

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(out_shapes[0]) * math.prod(self.windows(attrs)[0])

    def onnx(self, ctx, node):
        onnx_pool3d_windows(ctx, node, node.attrs["method"] == POOL_MAX, node.inputs[0], node.outputs[0],
                            ctx.shape(node.inputs[0])[2:], *self.windows(node.attrs))

    def pytorch_source(self, node, emit):
        return pytorch_pool3d_call(emit, node.attrs["method"] == POOL_MAX, emit.inputs[0], *self.windows(node.attrs))
