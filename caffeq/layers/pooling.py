"""Pooling with Caffe's exact window rules (SPP, its levels' pyramid: spp.py).

Caffe (pooling_layer.cpp) rounds the output size up (CEIL, the default) and,
when pad > 0, drops a last window that would start at or beyond H + pad.  AVE
divides by the window clipped to the padded extent (padding cells count, the
ceil overhang does not); MAX ignores padding.  STOCHASTIC at TEST is the
probability-weighted average sum(x^2)/sum(x) over the unpadded window.

Rounding: BVLC's `round_mode` (CEIL / FLOOR), or the forks' `ceil_mode`
(DenseNet, DPN, ResNeXt, R-FCN, Inception conversions: false = floor, true =
Caffe's ceil; the pad rule above still applies, and never fires with floor).

MAX starts every window at -FLT_MAX and keeps a cell only when it is greater
(BVLC/caffe 9b89154, src/caffe/layers/pooling_layer.cpp Forward_cpu and
pooling_layer.cu MaxPoolForward; global_pooling only sets the kernel to H x W), so
a window whose cells are all -inf gives -FLT_MAX, not -inf: ordinary, padded,
ceil-rounded and global MAX alike.  torch and model.py clamp at -FLT_MAX
(caffe_max_floor; fp16 at its lowest value).  The ONNX export keeps a bare
MaxPool / GlobalMaxPool: a Max after every pool would cost each exported net a
pass and split int8 exports' quantized chains, for inputs (-inf) that trained
nets do not make; there such a window gives -inf (onnxruntime's padded MaxPool
already gives -FLT_MAX).
MAX pooling may have a second top (SegNet and BVLC): the argmax mask, as
floats, holding the index h * W + w of the chosen cell within its input plane.
The first maximum in row-major order wins (Caffe's strict `>`); a window with
no cell above -FLT_MAX keeps -1 (and the value -FLT_MAX).  NaN: Caffe's `>` never
picks a NaN cell (every build: layer_factory.cpp gives MAX to Caffe's own layer even
with cuDNN), so torch and model.py pool caffe_max_input(x), NaN made -inf: a window
of NaNs gives -FLT_MAX and mask -1.  The ONNX export does not (two more nodes per
pool for inputs trained nets do not make): onnxruntime's MaxPool gives NaN there.

synopsys-caffe's pad_type (SAME), pad_l/r/t/b and AVE_EXC_PAD (alias AVE_TF) follow that fork's
own geometry: pooling_edges.py (its MAX also starts at -FLT_MAX with a strict `>`, so the same floor).
naibaf7/caffe's dilation and axis: pooling_dilated.py.

JiahaoLi-gdut/CAFFE-DACH (388c826, src/caffe/layers/pooling_layer.cpp) pools over a channel window too
(kernel_c / stride_c / pad_c, kernel_c required there).  caffeq reads the window of one channel (kernel_c 1,
stride_c 1, pad_c 0: each channel pooled alone) where the fork's other rules give BVLC's numbers: MAX or
unpadded AVE (its AVE divides by the cells inside the input), and per axis its size floor((n + 2p - k) / s)
+ 1, one more with ceil where the division leaves a remainder and that window starts before n + p
(checked in infer).  A wider channel window, STOCHASTIC, a padded AVE, or the mask top (indices counted from
the item's start there): one-line errors.  Its MAX starts each window at its first cell (BVLC: at -FLT_MAX), so
on non-finite inputs it differs from BVLC's, which caffeq follows: an all -inf window gives -inf there, a NaN
first cell NaN.

The torch functions below (caffe_pool_out, caffe_pool2d, caffe_max_pool2d_mask, caffe_max_floor)
and the modules are also copied into the standalone model.py, so the export
computes the same bits.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..io.schema import caffe_pb2
from .edge_pads import SAME, read_edge_pads
from .pooling_dilated import fork_forward, fork_infer, fork_macs, fork_onnx, fork_pytorch_source, read_fork_fields
from .pooling_edges import (
    TORCH_SYNOPSYS_POOL_FUNCTIONS,
    TORCH_SYNOPSYS_POOL_MODULE,
    synopsys_pool2d,
    synopsys_pool_geometry,
)
from .pooling_nd import (
    ave_pool3d_windows,
    caffe_max_input,
    first_empty_axis,
    max_pool3d_windows,
    onnx_pool3d_windows,
    pytorch_pool3d_call,
)
from .registry import Layer, LayerError, register_layer, spatial_params, torch_sources

MAX, AVE, STOCHASTIC = 0, 1, 2
AVE_EXC_PAD = 3  # synopsys-caffe: average over the in-image part of the window
MIN = 10003      # Adnan1011/NR-IQA-CNN's fork (3 there): -(MAX of -x), read as MAX with attrs["negate"]
CEIL, FLOOR = 0, 1
FLT_MIN = 1.1754943508222875e-38
FLT_MAX = 3.4028234663852886e38


def pooled_size(size, k, s, p, round_mode=CEIL, padded=None):
    """Caffe's pooled size along one axis; `padded`: whether the layer has any pad (Caffe
    drops a last window starting in the padding on both axes when pad_h or pad_w is set)."""
    if round_mode == CEIL:
        out = int(math.ceil((size + 2 * p - k) / s)) + 1
    else:
        out = (size + 2 * p - k) // s + 1
    if (p if padded is None else padded) and (out - 1) * s >= size + p:
        out -= 1
    return out


def as_pooling_param(p, pool):
    """A fork's pooling message with BVLC's scalar geometry fields (SumPooling's, LsePooling's) as a
    caffe.PoolingParameter of method `pool`, so Pooling's own reading checks and sizes its windows."""
    q = caffe_pb2.PoolingParameter(pool=pool)
    for field in ("pad", "kernel_size", "stride"):
        if p.HasField(field):
            getattr(q, field).append(getattr(p, field))
    for field in ("pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w", "global_pooling"):
        if p.HasField(field):
            setattr(q, field, getattr(p, field))
    return q


def _round_mode(p):
    """CEIL or FLOOR from round_mode (BVLC), ceil_mode (forks) or cmp_out_shape_floor_as_conv (Apollo); the
    fields given must agree."""
    fields = p.DESCRIPTOR.fields_by_name
    given = []
    if "round_mode" in fields and p.HasField("round_mode"):
        given.append((int(p.round_mode), f"round_mode: {'CEIL' if p.round_mode == CEIL else 'FLOOR'}"))
    if "ceil_mode" in fields and p.HasField("ceil_mode"):
        given.append((CEIL if p.ceil_mode else FLOOR, f"ceil_mode: {str(bool(p.ceil_mode)).lower()}"))
    if "cmp_out_shape_floor_as_conv" in fields and p.HasField("cmp_out_shape_floor_as_conv"):
        floor = p.cmp_out_shape_floor_as_conv
        given.append((FLOOR if floor else CEIL, f"cmp_out_shape_floor_as_conv: {str(bool(floor)).lower()}"))
    differing = [field for mode, field in given if mode != given[0][0]]
    if differing:
        raise LayerError(f"pooling_param.{differing[0]} contradicts {given[0][1]}")
    return given[0][0] if given else CEIL


def parse_pooling(p):
    attrs = {"pool": int(p.pool), "global": bool(p.global_pooling), "round_mode": _round_mode(p), "param": p}
    if attrs["pool"] == MIN:
        # the fork's MIN loops are its MAX loops with < from FLT_MAX: the first minimum, the same windows and mask
        attrs["pool"], attrs["negate"] = MAX, True
    # caffe-recon-dec's methods and fields (caffeq/layers/recon_dec.py): a LOCAL mask counts cells in the window
    recon_dec = {caffe_pb2.PoolingParameter.PoolMethod.Value(m): m for m in ("FIX", "SWITCH", "SOFT_SWITCH", "SUM")}
    if attrs["pool"] in recon_dec:
        raise LayerError(f"pooling_param.pool {recon_dec[attrs['pool']]}: caffe-recon-dec's method is read by its "
                         "Depooling only")
    if attrs["pool"] not in (MAX, AVE, STOCHASTIC, AVE_EXC_PAD):
        raise LayerError(f"unknown pool method {attrs['pool']}")
    fields = p.DESCRIPTOR.fields_by_name
    if ("mask_index_type" in fields and p.mask_index_type != 0) or \
            any(f in fields and p.HasField(f) for f in ("fix", "fix_x", "fix_y")):
        raise LayerError("pooling_param: caffe-recon-dec's mask_index_type / fix fields are read by its Depooling only")
    # synopsys-caffe's pad_type / pad_l/r/t/b (pooling_edges.py); None keeps Caffe's symmetric pad
    attrs["edge"] = read_edge_pads(p, 2, "pooling_param")
    if attrs["edge"] is not None:
        if attrs["global"]:
            raise LayerError("pooling_param: global_pooling with pad_type / pad_l/r/t/b is not supported")
        if attrs["pool"] == STOCHASTIC:
            raise LayerError("pooling_param.pool: STOCHASTIC has no pad_type / pad_l/r/t/b in synopsys-caffe")
    read_fork_fields(p, attrs)   # naibaf7/caffe's dilation / axis: the geometry is read once the rank is known
    _dach_channel_window(p, attrs)
    if attrs.get("negate") and (attrs["edge"] is not None or attrs["fork"] is not None):
        raise LayerError("pooling_param.pool: MIN (NR-IQA's fork) with another fork's pooling fields is not supported")
    if attrs["global"] and (p.kernel_size or p.HasField("kernel_h")):
        # Caffe stops here; paddle-mobile's MobileNet deploy sets both, and the window is the whole plane either way
        attrs["reading_notes"] = ["pooling_param: global_pooling with kernel_size too, which Caffe refuses; caffeq "
                                  "pools the whole plane and ignores the kernel, as OpenCV does"]
    if attrs["pool"] == AVE_EXC_PAD and attrs["global"]:
        attrs["pool"] = AVE   # a global window has no padding: the two averages agree
    attrs["bins"] = _parsenet_bins(p)
    if attrs["bins"] is not None:
        if attrs["edge"] is not None or attrs["fork"] is not None:
            raise LayerError("pooling_param: ParseNet's bins with another fork's pooling fields are not supported")
        attrs["global"], attrs["kernel"] = False, None   # the fork reads bins first; infer sizes the window
        return attrs
    if attrs["fork"] is None and max(len(p.kernel_size), len(p.stride), len(p.pad)) <= 2:
        pooling_geometry(attrs, 2)   # the usual 2-D case is checked at once; N-D once the rank is known
    return attrs


def _dach_channel_window(p, attrs):
    """CAFFE-DACH's kernel_c / stride_c / pad_c: attrs["dach"] where given; only a one-channel window."""
    fields = p.DESCRIPTOR.fields_by_name   # PoolingND's own message shares this parser and lacks them
    given = [f for f in ("kernel_c", "stride_c", "pad_c") if f in fields and p.HasField(f)]
    if not given:
        return
    window_c = {"kernel_c": 1, "stride_c": 1, "pad_c": 0}
    for f in given:
        if getattr(p, f) != window_c[f]:
            raise LayerError(f"pooling_param.{f} {getattr(p, f)}: CAFFE-DACH's pooling across channels is not "
                             f"supported (only kernel_c 1, stride_c 1, pad_c 0)")
    if attrs["pool"] not in (MAX, AVE):
        raise LayerError("pooling_param.pool: CAFFE-DACH's pooling (kernel_c) is read for MAX and AVE only")
    if attrs["edge"] is not None or attrs["fork"] is not None or attrs.get("negate"):
        raise LayerError("pooling_param.kernel_c (CAFFE-DACH) with another fork's pooling fields is not supported")
    attrs["dach"] = True


def dach_pooled_size(size, k, s, p, ceil=True):
    """CAFFE-DACH's pooled size along one axis (pooling_layer.cpp's w_z / w_y)."""
    span = max(0, size + 2 * p - k)
    out = span // s + 1
    if ceil and span % s and out * s < size + p:
        out += 1
    return out


def _check_dach_window(attrs, sizes, out):
    if attrs["pool"] == AVE and not attrs["global"] and any(attrs["pad"]):
        raise LayerError(f"pooling_param: CAFFE-DACH's padded AVE pooling (pad {list(attrs['pad'])}) divides by the "
                         f"cells inside the input; not supported")
    if attrs["global"]:
        return
    ceil = attrs["round_mode"] == CEIL
    fork = tuple(dach_pooled_size(n, k, s, p, ceil) for n, k, s, p in
                 zip(sizes, attrs["kernel"], attrs["stride"], attrs["pad"]))
    if fork != tuple(out):
        raise LayerError(f"pooling_param: CAFFE-DACH's pooling sizes input {list(sizes)} to {list(fork)}, "
                         f"BVLC's to {list(out)}; not supported")


def _parsenet_bins(p):
    """ParseNet's (weiliu89/caffe fcn) bin_size or bin_h + bin_w, else None."""
    if "bin_size" not in p.DESCRIPTOR.fields_by_name:
        return None
    if not (p.HasField("bin_size") or p.HasField("bin_h") or p.HasField("bin_w")):
        return None
    if not p.HasField("bin_size") and not (p.HasField("bin_h") and p.HasField("bin_w")):
        raise LayerError("pooling_param: for non-grid bins both bin_h and bin_w are required")
    bins = (int(p.bin_size),) * 2 if p.HasField("bin_size") else (int(p.bin_h), int(p.bin_w))
    if min(bins) < 1:
        raise LayerError(f"pooling_param: the bin counts {list(bins)} must be > 0")
    return bins


def parsenet_bin_geometry(attrs, h, w):
    """ParseNet's pooling_layer.cpp: from bins per axis and the input's size, kernel = ceil(size / bins),
    stride = kernel (1 where the kernel covers the axis), pad = floor(((bins - 1) stride + kernel - size)
    / 2); the fork checks bins <= size / 2 (integer division)."""
    kernel, stride, pad = [], [], []
    for size, bins, axis in zip((h, w), attrs["bins"], ("height", "width")):
        if bins > size // 2:
            raise LayerError(f"pooling_param: {bins} bins in {axis} exceed half of the input's {size}")
        k = math.ceil(size / bins)
        st = 1 if k == size else k
        kernel.append(k)
        stride.append(st)
        pad.append(math.floor(((bins - 1) * st + k - size) / 2))
    attrs["kernel"], attrs["stride"], attrs["pad"] = tuple(kernel), tuple(stride), tuple(pad)


def pooling_geometry(attrs, nsp):
    """kernel, stride and pad for `nsp` spatial axes, as PoolingLayer::LayerSetUp reads them (BVLC for
    2-D; R-C3D's caffe3d for N-D: each repeated field given once or once per axis)."""
    p = attrs["param"]
    if attrs["global"]:
        attrs["kernel"] = None   # a kernel given too is a reading note (parse_pooling)
    else:
        if not (p.kernel_size or p.HasField("kernel_h")):
            raise LayerError("pooling_param.kernel_size (or kernel_h/kernel_w) is required")
        attrs["kernel"] = spatial_params(p, nsp, "kernel_size", None, min_value=1)
    attrs["stride"] = spatial_params(p, nsp, "stride", 1, min_value=1)
    attrs["pad"] = spatial_params(p, nsp, "pad", 0, min_value=0)
    if attrs["global"]:
        # Caffe: global pooling forces pad 0 and stride 1
        if any(attrs["pad"]) or any(s != 1 for s in attrs["stride"]):
            raise LayerError("with global_pooling, pad must be 0 and stride 1")
    elif any(pd >= k for pd, k in zip(attrs["pad"], attrs["kernel"])):
        raise LayerError(f"pad {list(attrs['pad'])} must be smaller than kernel {list(attrs['kernel'])}")


def is_darknet_kept_size_pool(attrs):
    """A 2-D MAX pooling of stride 1, an even kernel and no pad, or a pad of kernel - 1 (darknet's
    own `padding`, the total over both sides, as hdchenjian/MXNet2Caffe's yolov3-tiny writes it):
    what darknet converters write for darknet's maxpool of that size, which keeps the map's size
    (see darknet_kept_size_pools)."""
    kernel = attrs.get("kernel")
    return (attrs.get("pool") == MAX and not attrs.get("negate") and not attrs.get("global") and attrs.get("edge") is None
            and attrs.get("fork") is None and kernel is not None and len(kernel) == 2
            and kernel[0] == kernel[1] and kernel[0] % 2 == 0 and tuple(attrs["stride"]) == (1, 1)
            and (not any(attrs["pad"]) or tuple(attrs["pad"]) == (kernel[0] - 1,) * 2))


def darknet_kept_size_pools(net):
    """ForkReading rewrite for darknet conversions (yolov3-tiny's size-2 stride-1 maxpool).  The Caffe
    their nets run in (ChenYingpeng/darknet2caffe f6d9ea3, caffe_layers/pooling_layer/pooling_layer.cpp)
    gives a pooling whose kernel exceeds its stride by an odd number one more output per axis, its
    window clipped at the bottom and right edges.  For these stride-1 MAX pools that is exactly
    synopsys-caffe's pad_b / pad_r of 1 (pooling_edges.py: the pad is never read), which the copy's
    layers get here.  Returns the note."""
    marked = []
    for lp in net.layer:
        if lp.type != "Pooling":
            continue
        try:
            attrs = parse_pooling(lp.pooling_param)
        except LayerError:
            continue
        if is_darknet_kept_size_pool(attrs):
            for pad in ("pad", "pad_h", "pad_w"):   # darknet's padding is the fork's pad_b / pad_r
                lp.pooling_param.ClearField(pad)
            lp.pooling_param.pad_b = lp.pooling_param.pad_r = 1
            marked.append(lp.name)
    return (f"the MAX pools {', '.join(repr(n) for n in marked)} (stride 1, even kernel) keep their map's size, "
            f"as in the Caffe that darknet2caffe's nets run in (its pooling_layer.cpp): read with pad_b/pad_r 1, "
            f"the only reading the net's shapes fit")


def window(attrs, h, w):
    """(kernel, stride, pad, out) per spatial axis for an input of h x w."""
    if attrs["global"]:
        return (h, w), (1, 1), (0, 0), (1, 1)
    k, s, p = attrs["kernel"], attrs["stride"], attrs["pad"]
    if is_synopsys(attrs):
        out, _ = synopsys_pool_geometry([h, w], *synopsys_args(attrs)[1:])
        return k, s, p, tuple(out)
    out = tuple(pooled_size(n, kk, ss, pp, attrs["round_mode"], padded=any(p))
                for n, kk, ss, pp in zip((h, w), k, s, p))
    return k, s, p, out


def is_synopsys(attrs):
    """True where the fork's own pooling (pooling_edges.py) applies: per-side / SAME pads or AVE_EXC_PAD."""
    return attrs.get("edge") is not None or attrs["pool"] == AVE_EXC_PAD


def synopsys_args(attrs):
    """(mode, kernel, stride, edges [t, b, l, r], same, ceil) for synopsys_pool2d."""
    edge = attrs.get("edge")
    if edge is None:
        ph, pw = attrs["pad"]
        edges = [ph, ph, pw, pw]
    else:
        edges = [0, 0, 0, 0] if edge == SAME else list(edge)
    return (_TORCH_MODES[attrs["pool"]], list(attrs["kernel"]), list(attrs["stride"]), edges, edge == SAME,
            attrs["round_mode"] == CEIL)


def _ave_divisors(size, k, s, p, out):
    """Caffe's AVE divisor per output position along one axis (window clipped to the padded extent)."""
    return [min(o * s - p + k, size + p) - (o * s - p) for o in range(out)]


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------

def caffe_pool_out(size: list[int], kernel: list[int], stride: list[int], pad: list[int], ceil: bool):
    """Caffe's pooled size [out_h, out_w]: ceil((H + 2p - k) / s) + 1 (floor when not ceil), and with
    any pad a last window starting in the bottom/right padding is dropped, on both axes."""
    out = [0, 0]
    for i in range(2):
        span = size[i] + 2 * pad[i] - kernel[i]
        out[i] = -(-span // stride[i]) + 1 if ceil else span // stride[i] + 1
        if (pad[0] > 0 or pad[1] > 0) and (out[i] - 1) * stride[i] >= size[i] + pad[i]:
            out[i] -= 1
    return out


def caffe_pool2d(x, mode: str, kernel: list[int], stride: list[int], pad: list[int], ceil: bool):
    """Caffe's Pooling (see caffe_pool_out for the size). MAX ignores padding, AVE divides by the
    window clipped to the padded input, STOCHASTIC (test) is sum(x^2) / sum(x); "sum" is the window's
    sum (SumPooling's SUM)."""
    size = [x.shape[2], x.shape[3]]
    out = caffe_pool_out(size, kernel, stride, pad, ceil)
    if mode == "stochastic":  # windows start at 0 (Caffe ignores pad here) and clip at the edge
        right = max(0, (out[1] - 1) * stride[1] + kernel[1] - size[1])
        bottom = max(0, (out[0] - 1) * stride[0] + kernel[0] - size[0])
        xr = F.pad(x, [0, right, 0, bottom])
        num = F.avg_pool2d(xr * xr, kernel, stride, divisor_override=1)
        den = F.avg_pool2d(xr, kernel, stride, divisor_override=1) + 1.1754943508222875e-38
        return (num / den)[:, :, :out[0], :out[1]]
    # right/bottom padding so that every kept window fits; negative means the end is unused
    extra = [(out[i] - 1) * stride[i] + kernel[i] - (size[i] + pad[i]) for i in range(2)]
    pads = [pad[1], max(0, extra[1]), pad[0], max(0, extra[0])]
    padded = pads != [0, 0, 0, 0]
    if mode == "max":
        x = caffe_max_input(x)
        xp = F.pad(x, pads, value=float("-inf")) if padded else x
        # Caffe starts every window at -FLT_MAX: an empty window (stride > kernel, ceil rounding)
        # keeps it, and -inf never wins; fp16 has no -FLT_MAX, its lowest value stands in
        floor = -65504.0 if x.dtype == torch.float16 else -3.4028234663852886e38
        y = F.max_pool2d(xp, kernel, stride).clamp_min(floor)
        return y[:, :, :out[0], :out[1]]
    xp = F.pad(x, pads) if padded else x
    y = F.avg_pool2d(xp, kernel, stride, divisor_override=1)[:, :, :out[0], :out[1]]
    if mode == "sum":
        return y
    return y / caffe_window_sizes(size, kernel, stride, pad, out, x)


def caffe_window_sizes(size: list[int], kernel: list[int], stride: list[int], pad: list[int], out: list[int], x):
    """(out_h, out_w): each window's cell count clipped to the padded extent (padding counts, the ceil
    overhang does not), Caffe's AVE divisor, in x's dtype and device."""
    sizes = []
    for i in range(2):
        starts = torch.arange(out[i], device=x.device) * stride[i] - pad[i]
        ends = torch.clamp(starts + kernel[i], max=size[i] + pad[i])
        sizes.append((ends - starts).to(x.dtype))
    return sizes[0][:, None] * sizes[1][None, :]


def caffe_max_floor(y):
    """y floored at Caffe's initial MAX value -FLT_MAX (fp16, which has no -FLT_MAX: its lowest value), where
    torch's max pooling leaves a window of -inf cells at -inf."""
    return y.clamp_min(-65504.0 if y.dtype == torch.float16 else -3.4028234663852886e38)


def caffe_max_pool2d_mask(x, kernel: list[int], stride: list[int], pad: list[int], ceil: bool):
    """Caffe's MAX pooling and its mask top: per output, h * W + w of the winning input cell in its
    plane (the first maximum in row-major order), as floats; -1 (value -FLT_MAX) where no cell of
    the window exceeds -FLT_MAX."""
    size = [x.shape[2], x.shape[3]]
    out = caffe_pool_out(size, kernel, stride, pad, ceil)
    extra = [(out[i] - 1) * stride[i] + kernel[i] - (size[i] + pad[i]) for i in range(2)]
    pads = [pad[1], max(0, extra[1]), pad[0], max(0, extra[0])]
    xp = F.pad(caffe_max_input(x), pads, value=float("-inf"))
    y, cell = F.max_pool2d(xp, kernel, stride, return_indices=True)
    y, cell = y[:, :, :out[0], :out[1]], cell[:, :, :out[0], :out[1]]
    padded_width = size[1] + pads[0] + pads[1]
    index = (cell // padded_width - pad[0]) * size[1] + cell % padded_width - pad[1]
    floor = -65504.0 if x.dtype == torch.float16 else -3.4028234663852886e38
    found = y > floor
    mask = torch.where(found, index.to(x.dtype), torch.full_like(y, -1.0))
    return y.clamp_min(floor), mask


class CaffePool2d(nn.Module):
    """Caffe's Pooling where nn.MaxPool2d / nn.AvgPool2d differ from it (see caffe_pool2d)."""

    def __init__(self, mode: str, kernel: list[int], stride: list[int], pad: list[int], ceil: bool = True):
        super().__init__()
        self.mode, self.kernel, self.stride, self.pad, self.ceil = mode, kernel, stride, pad, ceil

    def forward(self, x):
        return caffe_pool2d(x, self.mode, self.kernel, self.stride, self.pad, self.ceil)

    def extra_repr(self):
        return f"{self.mode}, kernel={self.kernel}, stride={self.stride}, pad={self.pad}, ceil={self.ceil}"


class CaffeMaxPool2dMask(nn.Module):
    """Caffe's MAX Pooling with two tops: (values, argmax mask), see caffe_max_pool2d_mask."""

    def __init__(self, kernel: list[int], stride: list[int], pad: list[int], ceil: bool = True):
        super().__init__()
        self.kernel, self.stride, self.pad, self.ceil = kernel, stride, pad, ceil

    def forward(self, x):
        return caffe_max_pool2d_mask(x, self.kernel, self.stride, self.pad, self.ceil)

    def extra_repr(self):
        return f"kernel={self.kernel}, stride={self.stride}, pad={self.pad}, ceil={self.ceil}"


# model.py gets the same functions and modules, so the export stays bit-identical to forward
TORCH_POOL_FUNCTIONS = torch_sources(caffe_pool_out, caffe_window_sizes, caffe_max_input, caffe_pool2d,
                                     caffe_max_pool2d_mask)
TORCH_POOL_MODULE = torch_sources(CaffePool2d)
TORCH_MASK_MODULE = torch_sources(CaffeMaxPool2dMask)

_TORCH_MODES = {MAX: "max", AVE: "ave", STOCHASTIC: "stochastic", AVE_EXC_PAD: "ave_exc_pad"}


def caffe_pool(x, attrs, mask=False):
    """Pooling by the parsed attrs; with mask (MAX only) returns (values, argmax mask)."""
    h, w = x.shape[-2], x.shape[-1]
    k, s, p, out = window(attrs, h, w)
    if any(o <= 0 for o in out):
        raise LayerError(f"pooling of a {h}x{w} input gives an empty output")
    ceil = attrs["round_mode"] == CEIL
    if mask:
        return caffe_max_pool2d_mask(x, list(k), list(s), list(p), ceil)
    if is_synopsys(attrs):
        return synopsys_pool2d(x, *synopsys_args(attrs))
    if attrs["global"] and attrs["pool"] == MAX:
        return caffe_max_floor(caffe_max_input(x).amax(dim=(-2, -1), keepdim=True))
    if attrs["global"] and attrs["pool"] == AVE:
        return x.sum(dim=(-2, -1), keepdim=True) / float(h * w)
    if attrs["pool"] == MAX and _torch_standard_pool(attrs):
        # torch's windows are Caffe's here (no empty window) and a maximum is exact: one pass,
        # no padded copy; the floor keeps Caffe's -FLT_MAX for an all -inf window
        return caffe_max_floor(F.max_pool2d(caffe_max_input(x), list(k), list(s), list(p), ceil_mode=ceil))
    return caffe_pool2d(x, _TORCH_MODES[attrs["pool"]], list(k), list(s), list(p), ceil)


def _torch_standard_pool(attrs):
    """True where nn.MaxPool2d / nn.AvgPool2d(ceil_mode, count_include_pad=True) size and
    average windows exactly as Caffe: torch's ceil correction (drop a last window that starts
    at or past H + pad) applies even without any pad, where Caffe's does not (it can only
    trigger with stride > kernel), and torch wants pad <= kernel / 2."""
    if attrs["pool"] not in (MAX, AVE) or attrs.get("edge") is not None:
        return False
    if any(p > k // 2 for k, p in zip(attrs["kernel"], attrs["pad"])):
        return False
    if attrs["round_mode"] == CEIL and not any(attrs["pad"]) and \
            any(s > k for k, s in zip(attrs["kernel"], attrs["stride"])):
        return False
    return True


def window_nd(attrs, sizes):
    """(kernel, stride, pad, out) per spatial axis of N-D pooling.  R-C3D's Reshape rounds each axis as
    BVLC does, but drops a last window starting in the padding only on the axes that have a pad;
    3D-Caffe's PoolingND (attrs["pad_rule_any_axis"]) on every axis once any axis has one, as BVLC's 2-D."""
    if attrs["global"]:
        n = len(sizes)
        return tuple(int(v) for v in sizes), (1,) * n, (0,) * n, (1,) * n
    k, s, p = attrs["kernel"], attrs["stride"], attrs["pad"]
    padded = any(p) if attrs.get("pad_rule_any_axis") else None
    out = tuple(pooled_size(int(n), kk, ss, pp, attrs["round_mode"], padded=padded)
                for n, kk, ss, pp in zip(sizes, k, s, p))
    return k, s, p, out


def _infer_nd(attrs, shape):
    """Top shape of N-D pooling on a 5-axis (N, C, D, H, W) input (R-C3D's caffe3d): its N-D forward is
    cuDNN's MAX / AVE with padding counted, so STOCHASTIC and the mask top (2-D loops) are refused."""
    if attrs["pool"] == STOCHASTIC:
        raise LayerError("pooling_param.pool: N-D pooling (5-axis input) has MAX and AVE only")
    if attrs.get("mask"):
        raise LayerError("the argmax mask top exists for 2-D pooling only, this input has 5 axes")
    pooling_geometry(attrs, 3)
    k, s, p, out = window_nd(attrs, shape[2:])
    if min(out) < 1:
        raise LayerError(f"output would be empty for input {list(shape)}")
    axis = first_empty_axis(shape[2:], s, p, out)
    if axis is not None and attrs["pool"] == AVE:
        raise LayerError(f"the last AVE window of axis {axis + 2} starts past the input (stride {s[axis]} > "
                         f"kernel {k[axis]}); Caffe divides by zero or less there")
    return tuple(shape[:2]) + tuple(out)


@register_layer("Pooling")
class Pooling(Layer):
    param_field = "pooling_param"

    def pooling_params(self, lp):
        """The PoolingParameter-like message this layer reads (SumPooling converts its own)."""
        return getattr(lp, self.param_field)

    def parse(self, lp):
        attrs = parse_pooling(self.pooling_params(lp))
        if len(lp.bottom) > 1:
            # Caffe's ExactNumBottomBlobs is 1: a second bottom would otherwise be silently left out (none: the
            # graph builder's "has no bottom")
            raise LayerError(f"{lp.type} takes 1 bottom, got {len(lp.bottom)}")
        # Caffe: MAX pooling may have a second top, the argmax mask; other methods exactly one
        most = 2 if attrs["pool"] == MAX else 1
        if not 1 <= len(lp.top) <= most:
            raise LayerError(f"{'MAX' if most == 2 else 'AVE and STOCHASTIC'} pooling takes "
                             f"{'1 or 2 tops (values, argmax mask)' if most == 2 else '1 top'}, "
                             f"got {len(lp.top)}")
        attrs["mask"] = len(lp.top) == 2
        p = self.pooling_params(lp)
        if "engine" in p.DESCRIPTOR.fields_by_name and p.engine == getattr(p, "NNPACK", None) \
                and attrs["pool"] == MAX:
            # fengggli/caffe nnpack_pooling_layer.cpp: on a CPU, where NNPACK takes the window, its size
            # rounds up without Caffe's last-window clip; Caffe's GPU mode (and caffeq) is Caffe's pooling
            attrs.setdefault("reading_notes", []).append(
                "pooling_param.engine NNPACK: fengggli/caffe's CPU mode pools some MAX windows with NNPACK, without "
                "Caffe's last-window rule; caffeq pools as Caffe's own Pooling (its GPU mode) does")
        if attrs["mask"] and attrs["edge"] is not None:
            raise LayerError("pooling_param: the argmax mask top with pad_type / pad_l/r/t/b is not supported")
        if attrs["mask"] and attrs.get("dach"):
            # its mask counts (c * H + h) * W + w from the item's start, not h * W + w within the plane
            raise LayerError("pooling_param.kernel_c: CAFFE-DACH's argmax mask top (indices over the whole item) "
                             "is not supported")
        return attrs

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if attrs.get("fork") is not None:
            return fork_infer(attrs, s)
        attrs["nd"] = len(s) == 5
        if attrs.get("bins") is not None and len(s) != 4:
            raise LayerError(f"pooling_param: ParseNet's bins need a 4-axis input, got {list(s)}")
        if attrs["nd"]:
            if attrs.get("dach"):
                raise LayerError("pooling_param.kernel_c: CAFFE-DACH's pooling needs a 4-axis input")
            if attrs.get("negate"):
                raise LayerError("pooling_param.pool: MIN (NR-IQA's fork) is 2-D only (4-axis input)")
            if is_synopsys(attrs):
                raise LayerError("pooling_param: pad_type / pad_l/r/t/b and AVE_EXC_PAD are 2-D only (4-axis input)")
            return [_infer_nd(attrs, s)]
        if len(s) != 4:
            raise LayerError(f"Pooling needs a 4-axis input (or a 5-axis one: R-C3D's N-D pooling), got {list(s)}")
        if attrs.get("bins") is not None:
            parsenet_bin_geometry(attrs, s[2], s[3])
        if attrs.get("kernel", ()) is not None and len(attrs.get("kernel", ())) != 2:
            pooling_geometry(attrs, 2)   # after a 5-axis input, or 3 values given for a 2-D one (the count error)
        _, _, _, out = window(attrs, s[2], s[3])
        if any(o <= 0 for o in out):
            raise LayerError(f"output would be empty for input {list(s)}")
        if attrs.get("dach"):
            _check_dach_window(attrs, s[2:], out)
        top = (s[0], s[1]) + tuple(out)
        return [top, top] if attrs.get("mask") else [top]

    def forward(self, attrs, params, x):
        if attrs.get("fork_path"):
            return fork_forward(attrs, x)
        if attrs.get("nd"):
            k, s, p, out = window_nd(attrs, x.shape[2:])
            pool = max_pool3d_windows if attrs["pool"] == MAX else ave_pool3d_windows
            return pool(x, list(k), list(s), list(p), list(out))
        if attrs.get("negate"):   # MIN
            out = caffe_pool(-x, attrs, mask=attrs.get("mask", False))
            return (-out[0], out[1]) if isinstance(out, tuple) else -out
        return caffe_pool(x, attrs, mask=attrs.get("mask", False))

    def macs(self, attrs, in_shapes, out_shapes):
        s = in_shapes[0]
        if attrs.get("fork_path"):
            return fork_macs(attrs, s, out_shapes[0])
        k = window_nd(attrs, s[2:])[0] if attrs.get("nd") else window(attrs, s[2], s[3])[0]
        return math.prod(out_shapes[0]) * math.prod(k)

    def onnx(self, ctx, node):
        if node.attrs.get("fork_path"):
            fork_onnx(ctx, node)
            return
        if node.attrs.get("nd"):
            sizes = ctx.shape(node.inputs[0])[2:]
            k, s, p, out = window_nd(node.attrs, sizes)
            onnx_pool3d_windows(ctx, node, node.attrs["pool"] == MAX, node.inputs[0], node.outputs[0],
                                sizes, k, s, p, out)
            return
        from ..backends.onnx_pooling import emit_max_pool_mask, emit_pooling
        x, outs = node.inputs[0], list(node.outputs)
        if node.attrs.get("negate"):   # MIN: -(MAX of -x)
            x, outs[0] = ctx.op("Neg", [x], "negated"), ctx.tmp(f"{node.name}_of_negated")
        if node.attrs.get("mask"):
            emit_max_pool_mask(ctx, node, x, outs)
        else:
            emit_pooling(ctx, node, node.attrs, x, outs[0], shape=ctx.shape(node.inputs[0]))
        if node.attrs.get("negate"):
            ctx.add_node("Neg", [outs[0]], [node.outputs[0]], name=f"{node.name}_min")

    def pytorch_source(self, node, emit):
        if not node.attrs.get("negate"):
            return self._pool_source(node, emit, emit.inputs[0])
        out = self._pool_source(node, emit, f"(-{emit.inputs[0]})")   # MIN: -(MAX of -x)
        return [f"(-{out[0]})", out[1]] if isinstance(out, list) else f"(-{out})"

    def _pool_source(self, node, emit, x):
        a = node.attrs
        if a.get("fork_path"):
            return fork_pytorch_source(node, emit)
        if a.get("nd"):
            k, s, p, out = window_nd(a, emit.in_shape(0)[2:])
            return pytorch_pool3d_call(emit, a["pool"] == MAX, x, k, s, p, out)
        k, s, p, _ = window(a, *emit.in_shape(0)[2:])
        floor = {} if a["round_mode"] == CEIL else {"ceil": False}
        if a.get("mask"):
            if a["global"]:
                emit.note("Global MAX pooling with a mask top uses the prototxt's input size as its window.")
            m = emit.instance(TORCH_MASK_MODULE, list(k), list(s), list(p), needs=[TORCH_POOL_FUNCTIONS], **floor)
            both = emit.tmp(node.name + "_pool")
            emit.stmt(f"{both} = {m}({x})")
            return [f"{both}[0]", f"{both}[1]"]
        if is_synopsys(a) and not a["global"]:
            mode, kk, ss, edges, same, ceil = synopsys_args(a)
            m = emit.instance(TORCH_SYNOPSYS_POOL_MODULE, mode, kk, ss, edges, same, ceil,
                              needs=[TORCH_SYNOPSYS_POOL_FUNCTIONS])
            return f"{m}({x})"
        if a["global"] and a["pool"] != STOCHASTIC:
            # the adaptive 1x1 pools reduce like caffe_pool's amax / sum / (H * W); MAX floored at -FLT_MAX
            kind = "Max" if a["pool"] == MAX else "Avg"
            m = emit.module(f"nn.Adaptive{kind}Pool2d(1)")
            return f"{emit.helper(caffe_max_floor)}({m}({emit.helper(caffe_max_input)}({x})))" \
                if a["pool"] == MAX else f"{m}({x})"
        if not a["global"] and _torch_standard_pool(a):
            args = [emit.size_arg(a["kernel"]), f"stride={emit.size_arg(a['stride'])}"]
            if any(a["pad"]):
                args.append(f"padding={emit.size_arg(a['pad'])}")
            if a["round_mode"] == CEIL:
                args.append("ceil_mode=True")
            kind = "MaxPool2d" if a["pool"] == MAX else "AvgPool2d"
            m = emit.module(f"nn.{kind}({', '.join(args)})")
            return f"{emit.helper(caffe_max_floor)}({m}({emit.helper(caffe_max_input)}({x})))" \
                if a["pool"] == MAX else f"{m}({x})"
        if a["global"]:
            h, w = emit.in_shape(0)[2:]
            raise LayerError(f"global STOCHASTIC pooling needs the input size ({h}x{w}) at run time; "
                             f"not supported")
        m = emit.instance(TORCH_POOL_MODULE, _TORCH_MODES[a["pool"]], list(a["kernel"]), list(a["stride"]),
                          list(a["pad"]), needs=[TORCH_POOL_FUNCTIONS], **floor)
        return f"{m}({x})"


@register_layer("PoolingND")
class PoolingND(Pooling):
    """3D-Caffe's PoolingND (pooling_nd_param): BVLC's pooling rules (ceil, the pad rule, AVE divided by
    the window clipped to size + pad) on 2 spatial axes or 3, as the N-D path above computes them."""

    param_field = "pooling_nd_param"

    def parse(self, lp):
        axis = lp.pooling_nd_param.axis
        if axis != 1:
            raise LayerError(f"pooling_nd_param.axis {axis}: only channels on axis 1 are supported")
        return {**super().parse(lp), "pad_rule_any_axis": True}
