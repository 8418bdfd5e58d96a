"""Pooling and SPP with Caffe's exact window rules.

Caffe (pooling_layer.cpp) rounds the output size up (CEIL, the default) and,
when pad > 0, drops a last window that would start at or beyond H + pad.  AVE
divides by the window clipped to the padded extent (padding cells count, the
ceil overhang does not); MAX ignores padding.  STOCHASTIC at TEST is the
probability-weighted average sum(x^2)/sum(x) over the unpadded window.
"""
import math

import torch
import torch.nn.functional as F

from .registry import Layer, LayerError, register_layer, spatial_params

MAX, AVE, STOCHASTIC = 0, 1, 2
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


def parse_pooling(p):
    attrs = {"pool": int(p.pool), "global": bool(p.global_pooling),
             "round_mode": int(p.round_mode) if hasattr(p, "round_mode") else CEIL}
    if attrs["global"]:
        if p.kernel_size or p.HasField("kernel_h"):
            raise LayerError("with global_pooling, kernel_size must not be set")
        attrs["kernel"] = None
    else:
        if not (p.kernel_size or p.HasField("kernel_h")):
            raise LayerError("pooling_param.kernel_size (or kernel_h/kernel_w) is required")
        attrs["kernel"] = spatial_params(p, 2, "kernel_size", None, min_value=1)
    attrs["stride"] = spatial_params(p, 2, "stride", 1, min_value=1)
    attrs["pad"] = spatial_params(p, 2, "pad", 0, min_value=0)
    if attrs["global"]:
        # Caffe: global pooling forces pad 0 and stride 1
        if any(attrs["pad"]) or any(s != 1 for s in attrs["stride"]):
            raise LayerError("with global_pooling, pad must be 0 and stride 1")
    elif any(pd >= k for pd, k in zip(attrs["pad"], attrs["kernel"])):
        raise LayerError(f"pad {list(attrs['pad'])} must be smaller than kernel {list(attrs['kernel'])}")
    if attrs["pool"] not in (MAX, AVE, STOCHASTIC):
        raise LayerError(f"unknown pool method {attrs['pool']}")
    return attrs


def window(attrs, h, w):
    """(kernel, stride, pad, out) per spatial axis for an input of h x w."""
    if attrs["global"]:
        return (h, w), (1, 1), (0, 0), (1, 1)
    k, s, p = attrs["kernel"], attrs["stride"], attrs["pad"]
    out = tuple(pooled_size(n, kk, ss, pp, attrs["round_mode"], padded=any(p))
                for n, kk, ss, pp in zip((h, w), k, s, p))
    return k, s, p, out


def _ave_divisors(size, k, s, p, out):
    """Caffe's AVE divisor per output position along one axis (window clipped to the padded extent)."""
    return [min(o * s - p + k, size + p) - (o * s - p) for o in range(out)]


def caffe_pool(x, attrs):
    h, w = x.shape[-2], x.shape[-1]
    k, s, p, out = window(attrs, h, w)
    if attrs["global"]:
        if attrs["pool"] == MAX:
            return x.amax(dim=(-2, -1), keepdim=True)
        if attrs["pool"] == AVE:
            return x.sum(dim=(-2, -1), keepdim=True) / float(h * w)
    if any(o <= 0 for o in out):
        raise LayerError(f"pooling of a {h}x{w} input gives an empty output")
    # right/bottom padding so that every kept window fits; negative means the end is unused
    extra = [(o - 1) * st + kk - (n + pp) for o, st, kk, n, pp in zip(out, s, k, (h, w), p)]
    pads = (p[1], max(0, extra[1]), p[0], max(0, extra[0]))
    if attrs["pool"] == MAX:
        xp = F.pad(x, pads, value=float("-inf")) if any(pads) else x
        # Caffe starts every window at -FLT_MAX: a window with no cell (stride > kernel,
        # ceil rounding) keeps that value, and -inf never wins; fp16 has no -FLT_MAX: its lowest
        floor = -FLT_MAX if x.dtype in (torch.float32, torch.float64) else torch.finfo(x.dtype).min
        y = F.max_pool2d(xp, k, s).clamp_min(floor)
    elif attrs["pool"] == AVE:
        xp = F.pad(x, pads) if any(pads) else x
        y = F.avg_pool2d(xp, k, s, divisor_override=1)
        y = y[..., :out[0], :out[1]]
        dh = torch.tensor(_ave_divisors(h, k[0], s[0], p[0], out[0]), dtype=y.dtype, device=y.device)
        dw = torch.tensor(_ave_divisors(w, k[1], s[1], p[1], out[1]), dtype=y.dtype, device=y.device)
        return y / (dh[:, None] * dw[None, :])
    else:  # STOCHASTIC at test: windows start at 0 (Caffe ignores pad here) and clip at the edge
        xr = F.pad(x, (0, max(0, (out[1] - 1) * s[1] + k[1] - w), 0, max(0, (out[0] - 1) * s[0] + k[0] - h)))
        num = F.avg_pool2d(xr * xr, k, s, divisor_override=1)
        den = F.avg_pool2d(xr, k, s, divisor_override=1) + FLT_MIN
        y = num / den
    return y[..., :out[0], :out[1]]


# ---- standalone PyTorch source (caffeq.backends.pytorch_source) ------------------------

# Caffe's pooling for the cases nn.MaxPool2d/nn.AvgPool2d cannot express; the same torch
# calls in the same order as caffe_pool above, so the results are the same bits.
TORCH_POOL_FUNCTION = """
    def caffe_pool2d(x, mode: str, kernel: list[int], stride: list[int], pad: list[int], ceil: bool):
        \"\"\"Caffe's Pooling: out = ceil((H + 2p - k) / s) + 1 (floor with round_mode FLOOR), and with
        any pad a last window starting in the bottom/right padding is dropped. MAX ignores padding,
        AVE divides by the window clipped to the padded input, STOCHASTIC (test) is sum(x^2) / sum(x).\"\"\"
        size = [x.shape[2], x.shape[3]]
        out = [0, 0]
        for i in range(2):
            span = size[i] + 2 * pad[i] - kernel[i]
            out[i] = -(-span // stride[i]) + 1 if ceil else span // stride[i] + 1
            if (pad[0] > 0 or pad[1] > 0) and (out[i] - 1) * stride[i] >= size[i] + pad[i]:
                out[i] -= 1
        if mode == "stochastic":  # windows start at 0 (Caffe ignores pad here) and clip at the edge
            right = max(0, (out[1] - 1) * stride[1] + kernel[1] - size[1])
            bottom = max(0, (out[0] - 1) * stride[0] + kernel[0] - size[0])
            xr = F.pad(x, [0, right, 0, bottom])
            num = F.avg_pool2d(xr * xr, kernel, stride, divisor_override=1)
            den = F.avg_pool2d(xr, kernel, stride, divisor_override=1) + 1.1754943508222875e-38
            return (num / den)[:, :, :out[0], :out[1]]
        extra = [(out[i] - 1) * stride[i] + kernel[i] - (size[i] + pad[i]) for i in range(2)]
        pads = [pad[1], max(0, extra[1]), pad[0], max(0, extra[0])]
        padded = pads != [0, 0, 0, 0]
        if mode == "max":
            xp = F.pad(x, pads, value=float("-inf")) if padded else x
            # Caffe starts every window at -FLT_MAX: an empty window keeps it, -inf never wins
            y = F.max_pool2d(xp, kernel, stride).clamp_min(-3.4028234663852886e38)
            return y[:, :, :out[0], :out[1]]
        xp = F.pad(x, pads) if padded else x
        y = F.avg_pool2d(xp, kernel, stride, divisor_override=1)[:, :, :out[0], :out[1]]
        divisors = []
        for i in range(2):
            starts = torch.arange(out[i], device=x.device) * stride[i] - pad[i]
            ends = torch.clamp(starts + kernel[i], max=size[i] + pad[i])
            divisors.append((ends - starts).to(x.dtype))
        return y / (divisors[0][:, None] * divisors[1][None, :])
"""

TORCH_POOL_MODULE = """
    class CaffePool2d(nn.Module):
        \"\"\"Caffe's Pooling where nn.MaxPool2d / nn.AvgPool2d differ from it (see caffe_pool2d).\"\"\"

        def __init__(self, mode, kernel, stride, pad, ceil=True):
            super().__init__()
            self.mode, self.kernel, self.stride, self.pad, self.ceil = mode, kernel, stride, pad, ceil

        def forward(self, x):
            return caffe_pool2d(x, self.mode, self.kernel, self.stride, self.pad, self.ceil)

        def extra_repr(self):
            return f"{self.mode}, kernel={self.kernel}, stride={self.stride}, pad={self.pad}, ceil={self.ceil}"
"""

TORCH_SPP_MODULE = """
    class SPP(nn.Module):
        \"\"\"Caffe's SPP: level l pools into 2^l x 2^l bins (kernel = stride = ceil(H / bins), padding
        centres the grid), each level flattened, all concatenated; one level is global pooling.\"\"\"

        def __init__(self, levels, mode):
            super().__init__()
            self.levels, self.mode = levels, mode

        def forward(self, x):
            h, w = x.shape[2], x.shape[3]
            if self.levels == 1:
                if self.mode == "max":
                    return x.amax(dim=(-2, -1), keepdim=True)
                return x.sum(dim=(-2, -1), keepdim=True) / float(h * w)
            parts: list[torch.Tensor] = []
            for level in range(self.levels):
                bins = 1 << level  # 2^level (an int, also for TorchScript)
                kh, kw = -(-h // bins), -(-w // bins)
                pad = [(kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2]
                parts.append(caffe_pool2d(x, self.mode, [kh, kw], [kh, kw], pad, True).flatten(1))
            return torch.cat(parts, dim=1)
"""

_TORCH_MODES = {MAX: "max", AVE: "ave", STOCHASTIC: "stochastic"}


def _torch_standard_pool(attrs):
    """True where nn.MaxPool2d / nn.AvgPool2d(ceil_mode, count_include_pad=True) size and
    average windows exactly as Caffe: torch's ceil correction (drop a last window that starts
    at or past H + pad) applies even without any pad, where Caffe's does not (it can only
    trigger with stride > kernel), and torch wants pad <= kernel / 2."""
    if attrs["pool"] not in (MAX, AVE):
        return False
    if any(p > k // 2 for k, p in zip(attrs["kernel"], attrs["pad"])):
        return False
    if attrs["round_mode"] == CEIL and not any(attrs["pad"]) and \
            any(s > k for k, s in zip(attrs["kernel"], attrs["stride"])):
        return False
    return True


@register_layer("Pooling")
class Pooling(Layer):
    def parse(self, lp):
        if len(lp.top) != 1:
            raise LayerError("only one top is supported (the MAX-pooling mask top is not)")
        return parse_pooling(lp.pooling_param)

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"Pooling needs a 4-axis input, got {list(s)}")
        _, _, _, out = window(attrs, s[2], s[3])
        if any(o <= 0 for o in out):
            raise LayerError(f"output would be empty for input {list(s)}")
        return [(s[0], s[1]) + tuple(out)]

    def forward(self, attrs, params, x):
        return caffe_pool(x, attrs)

    def macs(self, attrs, in_shapes, out_shapes):
        s = in_shapes[0]
        k, _, _, _ = window(attrs, s[2], s[3])
        return math.prod(out_shapes[0]) * k[0] * k[1]

    def onnx(self, ctx, node):
        from ..backends.onnx_pooling import emit_pooling
        emit_pooling(ctx, node, node.attrs, node.inputs[0], node.outputs[0])

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        if a["global"] and a["pool"] != STOCHASTIC:
            # the adaptive 1x1 pools reduce like caffe_pool's amax / sum / (H * W)
            kind = "Max" if a["pool"] == MAX else "Avg"
            m = emit.module(f"nn.Adaptive{kind}Pool2d(1)")
            return f"{m}({x})"
        if not a["global"] and _torch_standard_pool(a):
            args = [emit.size_arg(a["kernel"]), f"stride={emit.size_arg(a['stride'])}"]
            if any(a["pad"]):
                args.append(f"padding={emit.size_arg(a['pad'])}")
            if a["round_mode"] == CEIL:
                args.append("ceil_mode=True")
            kind = "MaxPool2d" if a["pool"] == MAX else "AvgPool2d"
            m = emit.module(f"nn.{kind}({', '.join(args)})")
            return f"{m}({x})"
        if a["global"]:
            h, w = emit.in_shape(0)[2:]
            raise LayerError(f"global STOCHASTIC pooling needs the input size ({h}x{w}) at run time; "
                             f"not supported")
        emit.uses("F")
        emit.helper(TORCH_POOL_FUNCTION)
        cls = emit.helper(TORCH_POOL_MODULE)
        m = emit.module(f"{cls}({emit.lit(_TORCH_MODES[a['pool']])}, {emit.lit(list(a['kernel']))}, "
                        f"{emit.lit(list(a['stride']))}, {emit.lit(list(a['pad']))}"
                        f"{'' if a['round_mode'] == CEIL else ', ceil=False'})")
        return f"{m}({x})"


@register_layer("SPP")
class SPP(Layer):
    """Spatial pyramid pooling: level i pools into 2^i x 2^i bins, flattened and concatenated."""

    def parse(self, lp):
        p = lp.spp_param
        if p.pyramid_height < 1:
            raise LayerError("spp_param.pyramid_height must be >= 1")
        if int(p.pool) not in (MAX, AVE):
            raise LayerError("SPP supports MAX and AVE pooling")
        return {"height": int(p.pyramid_height), "pool": int(p.pool)}

    @staticmethod
    def level_attrs(attrs, level, h, w):
        bins = 2 ** level
        kh, kw = int(math.ceil(h / bins)), int(math.ceil(w / bins))
        ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
        return {"pool": attrs["pool"], "global": False, "round_mode": CEIL,
                "kernel": (kh, kw), "stride": (kh, kw), "pad": (ph, pw)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = in_shapes[0]
        if attrs["height"] == 1:
            return [(n, c, 1, 1)]
        total = 0
        for level in range(attrs["height"]):
            la = self.level_attrs(attrs, level, h, w)
            _, _, _, out = window(la, h, w)
            total += out[0] * out[1]
        return [(n, c * total)]

    def forward(self, attrs, params, x):
        h, w = x.shape[-2], x.shape[-1]
        if attrs["height"] == 1:
            return caffe_pool(x, {"pool": attrs["pool"], "global": True, "round_mode": CEIL,
                                  "kernel": None, "stride": (1, 1), "pad": (0, 0)})
        parts = [caffe_pool(x, self.level_attrs(attrs, lv, h, w)).flatten(1) for lv in range(attrs["height"])]
        return torch.cat(parts, dim=1)

    def onnx(self, ctx, node):
        from ..backends.onnx_pooling import emit_spp
        emit_spp(ctx, node, self)

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.uses("F")
        emit.helper(TORCH_POOL_FUNCTION)
        cls = emit.helper(TORCH_SPP_MODULE)
        m = emit.module(f"{cls}({a['height']}, {emit.lit(_TORCH_MODES[a['pool']])})")
        return f"{m}({emit.inputs[0]})"
