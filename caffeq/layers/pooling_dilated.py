"""naibaf7/caffe's (the OpenCL "greentea" Caffe) dilated Pooling: PoolingParameter.dilation and axis.

Read from naibaf7/caffe 2996015 (caffe.proto 8f37a14c): pooling_layer.cpp (Reshape), the OpenCL/CUDA
kernels it generates in pooling_layer.cu (MaxPoolForwardSK, AvePoolForwardSK, MaxPoolForwardND) and
LibDNN's pool kernels (libdnn_pool.cpp, the default engine on a GPU).  Along each spatial axis, with
kernel k, stride s, pad p and dilation d:

- the window spans (k - 1) * d + 1 cells; the output size is ceil((size + 2p - span) / s) + 1, and on
  an axis whose own pad is > 0 a last window starting at or past size + p is dropped (per axis, not
  on both axes once either has a pad as BVLC's 2-D layer does); there is no floor rounding;
- output o reads the k taps o * s - p + j * d (j = 0 .. k-1), all axes crossed;
- MAX: the largest tap inside the input, in row-major tap order with a strict `>` from -FLT_MAX (the
  first maximum wins; a window with no tap inside keeps -FLT_MAX);
- AVE: the sum of the taps inside the input divided by the number of taps before size + p on each
  axis, multiplied over the axes (taps in the leading padding count, the overhang does not).

The fork takes no pad < kernel check, so a pad as wide as the window is read as it is; global pooling
sets the kernel to the input's extent and keeps the given stride and pad.  The fork's CPU forward
ignores dilation (it pools k contiguous cells over the dilated output size); caffeq follows its GPU and
LibDNN kernels, the ones the fork was written for, which agree with each other.  Where the dilation is 1
on every axis, every pad is below its kernel and BVLC's sizes agree, pooling.py's own paths run the
layer (they compute the same windows; STOCHASTIC and the argmax mask top stay there); elsewhere those
two are refused.

The torch functions are copied into the standalone model.py (inspect.getsource).
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .pooling_nd import caffe_max_input, onnx_window_sums, pads_reach_kernel
from .registry import LayerError, canonical_axis, spatial_params

MAX, AVE, STOCHASTIC = 0, 1, 2
FLT_MAX = 3.4028234663852886e38


def read_fork_fields(p, attrs):
    """attrs["fork"]: {"dilation": the values as given, "axis"} when the file sets naibaf7's dilation
    or axis, else None.  Checks what needs no input rank."""
    fields = p.DESCRIPTOR.fields_by_name
    given = list(p.dilation) if "dilation" in fields else []
    # its 2015 name (677e8440): kstride, or kstride_h and kstride_w
    kstride = list(p.kstride) if "kstride" in fields else []
    if "kstride_h" in fields and (p.HasField("kstride_h") or p.HasField("kstride_w")):
        if kstride or not (p.HasField("kstride_h") and p.HasField("kstride_w")):
            raise LayerError("give pooling_param.kstride, or both kstride_h and kstride_w")
        kstride = [p.kstride_h, p.kstride_w]
    if kstride and given:
        raise LayerError("give pooling_param.dilation or its old name kstride, not both")
    given = given or kstride
    has_axis = "axis" in fields and p.HasField("axis")
    if not given and not has_axis:
        attrs["fork"] = None
        return
    if any(d < 1 for d in given):
        raise LayerError(f"pooling_param.dilation must be >= 1, got {given}")
    if attrs.get("edge") is not None or attrs["pool"] not in (MAX, AVE, STOCHASTIC):
        raise LayerError("pooling_param: naibaf7/caffe's dilation / axis do not go with synopsys-caffe's "
                         "pad_type, pad_l/r/t/b or AVE_EXC_PAD")
    if attrs["round_mode"] != 0:
        raise LayerError("pooling_param: naibaf7/caffe's dilated pooling always rounds up; round_mode FLOOR / "
                         "ceil_mode false belong to other forks")
    if attrs["pool"] == STOCHASTIC and any(d != 1 for d in given):
        raise LayerError("pooling_param.pool: STOCHASTIC with a dilation above 1 is not supported")
    attrs["fork"] = {"dilation": tuple(int(d) for d in given), "axis": int(p.axis)}


def fork_geometry(attrs, shape):
    """Fill kernel (None for global), stride, pad and dilation per spatial axis as the fork's
    LayerSetUp reads them for an input of `shape`; the channel axis must be 1."""
    p, fork = attrs["param"], attrs["fork"]
    axis = canonical_axis(fork["axis"], len(shape), "pooling_param.axis")
    if axis != 1:
        raise LayerError(f"pooling_param.axis {fork['axis']}: only channels on axis 1 are supported")
    nsp = len(shape) - 2
    if nsp not in (2, 3):
        raise LayerError(f"Pooling needs a 4- or 5-axis input, got {list(shape)}")
    if attrs["global"]:
        if p.kernel_size or p.HasField("kernel_h") or p.HasField("kernel_w"):
            raise LayerError("with global_pooling, kernel_size must not be set")
        attrs["kernel"] = None
    elif not (p.kernel_size or p.HasField("kernel_h")):
        raise LayerError("pooling_param.kernel_size (or kernel_h/kernel_w) is required")
    else:
        attrs["kernel"] = spatial_params(p, nsp, "kernel_size", None, min_value=1)
    attrs["stride"] = spatial_params(p, nsp, "stride", 1, min_value=1)
    attrs["pad"] = spatial_params(p, nsp, "pad", 0, min_value=0)
    given = fork["dilation"]
    if len(given) not in (0, 1, nsp):
        raise LayerError(f"pooling_param.dilation must be given once or {nsp} times, got {len(given)}")
    attrs["dilation"] = tuple(given[i if len(given) == nsp else 0] if given else 1 for i in range(nsp))


def fork_window(attrs, sizes):
    """(kernel, stride, pad, dilation, out) per spatial axis for input extents `sizes`."""
    k = tuple(int(n) for n in sizes) if attrs["kernel"] is None else attrs["kernel"]
    s, p, d = attrs["stride"], attrs["pad"], attrs["dilation"]
    out = fork_pool_out([int(n) for n in sizes], list(k), list(s), list(p), list(d))
    return k, s, p, d, tuple(out)


def needs_fork_path(attrs, sizes):
    """True where the layer must run through this module: a dilation above 1, a pad as wide as the
    kernel, global pooling with a stride or pad, or 2-D sizes on which BVLC's pad rule (pooling.py)
    would drop a window that the fork's per-axis rule keeps."""
    k, s, p, d, out = fork_window(attrs, sizes)
    if any(v != 1 for v in d) or any(pp >= kk for pp, kk in zip(p, k)):
        return True
    if attrs["global"]:
        return any(p) or any(v != 1 for v in s)
    if len(sizes) == 2 and any(p):   # BVLC drops such a window on an unpadded axis too
        return any(pp == 0 and (o - 1) * ss >= int(n) for n, ss, pp, o in zip(sizes, s, p, out))
    return False


def fork_infer(attrs, shape):
    """The top shape, after the fork's checks (a MAX pooling's mask top and STOCHASTIC run through
    pooling.py only where the fork's windows are BVLC's)."""
    fork_geometry(attrs, shape)
    attrs["nd"] = len(shape) == 5
    attrs["fork_path"] = needs_fork_path(attrs, shape[2:])
    k, s, p, d, out = fork_window(attrs, shape[2:])
    for n, ss, pp, o in zip(shape[2:], s, p, out):
        if pp > 0 and (o - 1) * ss >= n + pp:   # the fork's CHECK_LT after its one drop
            raise LayerError(f"pad {list(p)} is so wide that the last window starts in the padding "
                             f"(input {list(shape)}); the fork refuses it")
    if min(out) < 1:
        raise LayerError(f"output would be empty for input {list(shape)} (kernel {list(k)}, dilation {list(d)})")
    if attrs["fork_path"] or attrs["nd"]:
        if attrs["pool"] == STOCHASTIC:
            raise LayerError("pooling_param.pool: STOCHASTIC is supported only for 2-D pooling whose windows are "
                             "BVLC's (dilation 1, pad < kernel)")
        if attrs.get("mask"):
            raise LayerError("the argmax mask top is supported only for 2-D pooling whose windows are BVLC's "
                             "(dilation 1, pad < kernel)")
    if attrs["pool"] == AVE:
        for axis, (n, ss, pp, dd, o) in enumerate(zip(shape[2:], s, p, d, out)):
            if (o - 1) * ss - pp >= n + pp:
                raise LayerError(f"the last AVE window of axis {axis + 2} has no tap before the input's end "
                                 f"(stride {ss}, dilation {dd}); the fork divides by zero there")
    top = tuple(shape[:2]) + out
    return [top, top] if attrs.get("mask") else [top]


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------

def fork_pool_out(size: list[int], kernel: list[int], stride: list[int], pad: list[int], dilation: list[int]):
    """naibaf7/caffe's pooled size per axis: ceil((size + 2p - ((k - 1) * d + 1)) / s) + 1, less a last
    window that starts at or past size + p on an axis with a pad."""
    out: list[int] = []
    for i in range(len(size)):
        span = size[i] + 2 * pad[i] - (kernel[i] - 1) * dilation[i] - 1
        o = -(-span // stride[i]) + 1
        if pad[i] > 0 and (o - 1) * stride[i] >= size[i] + pad[i]:
            o -= 1
        out.append(o)
    return out


def fork_pool_pads(size: list[int], kernel: list[int], stride: list[int], pad: list[int], dilation: list[int],
                   out: list[int]):
    """F.pad's list (last axis first): the leading pad, and after the end the cells the last window's
    taps reach (0 where they stay inside)."""
    pads: list[int] = []
    for i in range(len(size) - 1, -1, -1):
        reach = (out[i] - 1) * stride[i] + (kernel[i] - 1) * dilation[i] + 1
        pads += [pad[i], max(0, reach - pad[i] - size[i])]
    return pads


def fork_pool_divisor(x, size: list[int], kernel: list[int], stride: list[int], pad: list[int],
                      dilation: list[int], out: list[int]):
    """AVE's divisor per output position: the product over the axes of the taps before size + pad."""
    n = len(size)
    divisor = torch.ones([1] * n, dtype=x.dtype, device=x.device)
    for i in range(n):
        room = size[i] + 2 * pad[i] - torch.arange(out[i], device=x.device) * stride[i]
        taps = torch.clamp(torch.div(room + dilation[i] - 1, dilation[i], rounding_mode="floor"), 0, kernel[i])
        shape = [1] * n
        shape[i] = out[i]
        divisor = divisor * taps.to(x.dtype).reshape(shape)
    return divisor


def fork_dilated_pool(x, mode: str, kernel: list[int], stride: list[int], pad: list[int], dilation: list[int]):
    """naibaf7/caffe's MAX / AVE pooling with dilation over the 2 or 3 axes after the channels (see
    fork_pool_out for the size).  MAX keeps -FLT_MAX where no tap lies inside the input; AVE adds the
    taps inside the input in the fork's order and divides by fork_pool_divisor."""
    n = len(kernel)
    size = [int(v) for v in x.shape[2:]]
    out = fork_pool_out(size, kernel, stride, pad, dilation)
    pads = fork_pool_pads(size, kernel, stride, pad, dilation, out)
    if mode == "max":
        xp = F.pad(caffe_max_input(x), pads, value=float("-inf"))
        if n == 2:
            y = F.max_pool2d(xp, kernel, stride, 0, dilation)
        else:
            y = F.max_pool3d(xp, kernel, stride, 0, dilation)
        for i in range(n):
            y = y.narrow(2 + i, 0, out[i])
        floor = -65504.0 if x.dtype == torch.float16 else -3.4028234663852886e38
        return y.clamp_min(floor)
    xp = F.pad(x, pads)
    windows = xp
    for i in range(n):   # windows of span (k - 1) * d + 1 every s cells, then every d-th cell of each
        windows = windows.unfold(2 + i, (kernel[i] - 1) * dilation[i] + 1, stride[i])[..., ::dilation[i]]
    for i in range(n):
        windows = windows.narrow(2 + i, 0, out[i])
    taps = windows.flatten(2 + n)   # row-major over the taps, the fork's loop order
    total = taps[..., 0]
    for t in range(1, taps.shape[-1]):
        total = total + taps[..., t]
    return total / fork_pool_divisor(x, size, kernel, stride, pad, dilation, out)


class ForkDilatedPool(nn.Module):
    """naibaf7/caffe's dilated MAX / AVE pooling (see fork_dilated_pool)."""

    def __init__(self, mode: str, kernel: list[int], stride: list[int], pad: list[int], dilation: list[int]):
        super().__init__()
        self.mode, self.kernel, self.stride, self.pad, self.dilation = mode, kernel, stride, pad, dilation

    def forward(self, x):
        return fork_dilated_pool(x, self.mode, self.kernel, self.stride, self.pad, self.dilation)

    def extra_repr(self):
        return (f"{self.mode}, kernel={self.kernel}, stride={self.stride}, pad={self.pad}, "
                f"dilation={self.dilation}")


def _mode(attrs):
    return "max" if attrs["pool"] == MAX else "ave"


def fork_forward(attrs, x):
    k, s, p, d, _ = fork_window(attrs, x.shape[2:])
    return fork_dilated_pool(x, _mode(attrs), list(k), list(s), list(p), list(d))


def fork_pytorch_source(node, emit):
    k, s, p, d, _ = fork_window(node.attrs, emit.in_shape(0)[2:])
    if node.attrs["global"]:
        emit.note("Global pooling with a stride, pad or dilation uses the prototxt's input size as its window.")
    m = emit.instance(ForkDilatedPool, _mode(node.attrs), list(k), list(s), list(p), list(d),
                      needs=[fork_pool_out, fork_pool_pads, fork_pool_divisor, caffe_max_input, fork_dilated_pool])
    return f"{m}({emit.inputs[0]})"


def fork_onnx(ctx, node):
    """Pad (the leading pads and the cells the last taps reach; -FLT_MAX for MAX, 0 for AVE), then a
    dilated MaxPool, or the tap sums (AveragePool with dilations from opset 19, a depthwise Conv of ones
    below it or where a pad reaches the kernel), a Slice to the fork's size, and for AVE the fork's divisor."""
    a, x, y = node.attrs, node.inputs[0], node.outputs[0]
    shape = ctx.shape(x)
    sizes = [int(v) for v in shape[2:]]
    k, s, p, d, out = fork_window(a, sizes)
    n = len(sizes)
    back = fork_pool_pads(sizes, list(k), list(s), list(p), list(d), list(out))[1::2][::-1]
    is_max = a["pool"] == MAX
    pads = np.array([0, 0] + list(p) + [0, 0] + back, np.int64)
    fill = np.array(-FLT_MAX if is_max else 0.0, np.float32)
    padded = ctx.add_node("Pad", [x, ctx.const(pads, node.name + "_pads"), ctx.const(fill)],
                          [ctx.tmp(node.name + "_padded")], name=node.name)[0]
    geometry = {"kernel_shape": list(k), "strides": list(s), "dilations": list(d)}
    averaged = not is_max and ctx.opset >= 19 and not pads_reach_kernel(k, p, back)
    if is_max:
        pooled = ctx.add_node("MaxPool", [padded], [ctx.tmp(node.name + "_pooled")], **geometry)[0]
    elif averaged:
        pooled = ctx.add_node("AveragePool", [padded], [ctx.tmp(node.name + "_pooled")], **geometry)[0]
    else:
        pooled = onnx_window_sums(ctx, node, padded, int(shape[1]), geometry)
    full = [(sz + pp + b - ((kk - 1) * dd + 1)) // ss + 1 for sz, kk, ss, pp, dd, b in zip(sizes, k, s, p, d, back)]
    if full != list(out):
        consts = [ctx.const(np.array(v, np.int64)) for v in ([0] * n, list(out), list(range(2, 2 + n)))]
        pooled = ctx.add_node("Slice", [pooled] + consts, [ctx.tmp(node.name + "_cut")])[0]
    if is_max:
        # a window of -FLT_MAX pads (or -inf cells) keeps Caffe's initial -FLT_MAX
        ctx.add_node("Max", [pooled, ctx.const(np.array(-FLT_MAX, np.float32))], [y])
        return
    divisor = np.ones([1] * n)
    for i in range(n):
        room = sizes[i] + 2 * p[i] - np.arange(out[i]) * s[i]
        taps = np.clip(-(-room // d[i]), 0, k[i]).astype(np.float64)
        divisor = divisor * taps.reshape([out[i] if j == i else 1 for j in range(n)])
    if averaged:   # AveragePool divided every window by the kernel volume
        factor = (math.prod(k) / divisor).astype(np.float32)[None, None]
        ctx.add_node("Mul", [pooled, ctx.const(factor, node.name + "_factor")], [y])
    else:
        ctx.add_node("Div", [pooled, ctx.const(divisor.astype(np.float32)[None, None], node.name + "_divisor")], [y])


def fork_macs(attrs, in_shape, out_shape):
    k = fork_window(attrs, in_shape[2:])[0]
    return math.prod(out_shape) * math.prod(k)
