"""Layers of the segmentation forks: the two "BN" layers, Unpooling and CropCenter.

- BN, SegNet / ENet's (alexgkendall/caffe-segnet, TimoSaemann/caffe-segnet-cudnn5,
  bn_layer.cpp): blobs scale and shift, each 1 x C x 1 x 1.  bn_mode INFERENCE
  computes x * scale + shift (compute_bn_statistics.py has folded the
  statistics into them).  bn_mode LEARN (the default) normalizes by the
  batch's own statistics in every phase, test included: mean and
  var = E(x^2) - E(x)^2 over N, H, W, y = (x - mean) / sqrt(var + 1e-9) *
  scale + shift; its optional second and third tops are that batch mean and
  variance (1 x C x 1 x 1).
- BN, PSPNet's (hszhao/PSPNet, bn_layer.cpp): blobs slope, bias, mean,
  variance, each 1 x C x 1 x 1.  At TEST, or with frozen: true, y = (x - mean) *
  (variance + eps)^-1/2 * slope + bias with the stored statistics (no moving
  average factor; eps 1e-5).  In training otherwise: the batch's mean and
  biased variance, and running = momentum * running + (1 - momentum) * batch.
  The two share the type name and the bn_param message: fields scale_filler,
  shift_filler, bn_mode say SegNet; slope_filler, bias_filler, momentum, eps,
  frozen, engine say PSPNet; with none, four `param` entries (PSPNet's files
  always list four) say PSPNet, one or two SegNet.  No weight is quantized
  (like BatchNorm, they stay fp32).
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
- CropCenter (jolibrain/caffe, crop_center_layer.cpp): crop_size gives one
  value per axis; each axis loses that many entries at both ends (Caffe wants
  2 * crop + 1 <= size).

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

SEGNET, PSPNET, TSN = "segnet", "pspnet", "tsn"
LEARN, INFERENCE = 0, 1
SEGNET_EPS = 1e-9   # bn_layer.cpp's var_eps_
_SEGNET_FIELDS = ("scale_filler", "shift_filler", "bn_mode")
_PSPNET_FIELDS = ("slope_filler", "bias_filler", "momentum", "eps", "frozen", "engine")
# yjxiong/caffe's (TSN's) BN: its own fields; it shares scale_filler/shift_filler with SegNet and frozen with PSPNet
MYBN_EPS = float(np.float32(1e-7))   # Robert0812/caffe's BNParameter.eps default
_TSN_FIELDS = ("var_eps", "use_history_in_test", "decay", "moving_average", "axis", "multigpu_sync",
               "sync_forward")   # the last: sciencefans/CaffeMex_v2's copy of that BN


# ---- torch: used by forward and copied into model.py ---------------------------------

def segnet_bn(x, scale, shift, learn: bool):
    """SegNet's BN -> (y, batch mean, batch variance); the statistics are empty in INFERENCE mode.
    LEARN: (x - mean) / sqrt(E(x^2) - mean^2 + 1e-9) * scale + shift over the batch, averaged per
    plane then over N as Caffe's two gemv calls; INFERENCE: x * scale + shift."""
    if not learn:
        return x * scale + shift, torch.zeros(0), torch.zeros(0)
    mean = x.mean(dim=(2, 3), keepdim=True).mean(dim=0, keepdim=True)
    square_mean = (x * x).mean(dim=(2, 3), keepdim=True).mean(dim=0, keepdim=True)
    var = square_mean - mean * mean
    y = (x - mean) / torch.sqrt(var + 1e-9)
    return y * scale + shift, mean, var


def pspnet_bn(x, slope, bias, mean, var, eps: float, divide: bool = False):
    """PSPNet's BN with the given statistics: (x - mean) * (var + eps)^-1/2 * slope + bias; divide:
    yjxiong's (TSN's), (x - mean) / (var + eps)^1/2 * scale + shift."""
    if divide:
        return (x - mean) / torch.sqrt(var + eps) * slope + bias
    return (x - mean) * torch.pow(var + eps, -0.5) * slope + bias


def pspnet_batch_stats(x):
    """The batch mean and biased variance PSPNet's BN normalizes with while training."""
    mean = x.mean(dim=(2, 3), keepdim=True).mean(dim=0, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(dim=(2, 3), keepdim=True).mean(dim=0, keepdim=True)
    return mean, var


class SegNetBN(nn.Module):
    """SegNet / ENet's BN layer (see segnet_bn); returns (y, batch mean, batch variance)."""

    def __init__(self, channels: int, learn: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.shift = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.learn = learn

    def forward(self, x):
        return segnet_bn(x, self.scale, self.shift, self.learn)


class PSPNetBN(nn.Module):
    """PSPNet's BN layer: stored statistics in eval mode or when frozen, else the batch's, with the
    running averages updated as running = momentum * running + (1 - momentum) * batch.  A bottom of
    other than four axes runs as (N, C, 1, rest) and its blobs are (1, C), as P3D's BN keeps them."""

    def __init__(self, channels: int, eps: float = 1e-5, momentum: float = 0.9, frozen: bool = False,
                 divide: bool = False, flat_blobs: bool = False):
        super().__init__()
        self.divide = divide
        shape = (1, channels) if flat_blobs else (1, channels, 1, 1)
        self.slope = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape))
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("variance", torch.ones(shape))
        self.eps, self.momentum, self.frozen = eps, momentum, frozen

    def forward(self, x):
        shape = x.shape
        x = x.reshape(shape[0], shape[1], 1, -1) if x.dim() != 4 else x
        slope, bias, running_mean, running_var = (t.reshape(1, -1, 1, 1) for t in
                                                  (self.slope, self.bias, self.mean, self.variance))
        if self.frozen or not self.training:
            return pspnet_bn(x, slope, bias, running_mean, running_var, self.eps, self.divide).reshape(shape)
        mean, var = pspnet_batch_stats(x)
        with torch.no_grad():   # views of the buffers: updated in place
            running_mean.mul_(self.momentum).add_(mean.detach(), alpha=1 - self.momentum)
            running_var.mul_(self.momentum).add_(var.detach(), alpha=1 - self.momentum)
        return pspnet_bn(x, slope, bias, mean, var, self.eps, self.divide).reshape(shape)


TORCH_SEGNET_BN = torch_sources(segnet_bn, SegNetBN)
TORCH_PSPNET_BN = torch_sources(pspnet_bn, pspnet_batch_stats, PSPNetBN)


# ---- BN ------------------------------------------------------------------------------

def _set_fields(p, names):
    """The names among `names` that the schema declares and the layer sets."""
    declared = p.DESCRIPTOR.fields_by_name
    return [n for n in names if n in declared and p.HasField(n)]


@register_layer("BN")
class BN(Layer):
    # PSPNet's blobs 2 and 3 are statistics (SegNet's BN has only blobs 0 and 1)
    buffer_blobs = (2, 3)
    uses_training_flag = True

    def parse(self, lp):
        need_blobs(lp, "BN", 1)
        p = lp.bn_param
        segnet, pspnet = _set_fields(p, _SEGNET_FIELDS), _set_fields(p, _PSPNET_FIELDS)
        tsn = _set_fields(p, _TSN_FIELDS)
        if tsn == ["moving_average"] and not segnet and {"slope_filler", "bias_filler"} & set(pspnet):
            return self._parse_mybn(lp, p)
        if tsn:
            return self._parse_tsn(lp, p, [f for f in segnet + pspnet if f not in ("scale_filler", "shift_filler",
                                                                                 "frozen", "engine")])
        if _set_fields(p, ("icnet",)):
            # synopsys-caffe's bn_layer.cpp: icnet alone picks the variant, the other one's fields unread
            segnet, pspnet = ([], ["icnet"]) if p.icnet else (["icnet"], [])
        if segnet and pspnet:
            raise LayerError(f"bn_param mixes SegNet's fields ({', '.join(segnet)}) with PSPNet's "
                             f"({', '.join(pspnet)})")
        if segnet or pspnet:
            variant = SEGNET if segnet else PSPNET
        elif len(lp.param) == 4:
            variant = PSPNET
        elif len(lp.param) in (1, 2) or len(lp.top) > 1:
            variant = SEGNET
        else:
            raise LayerError("BN is SegNet's (blobs scale, shift) or PSPNet's (slope, bias, mean, variance); "
                             "say which in bn_param: bn_mode (SegNet) or eps / frozen (PSPNet)")
        if variant == SEGNET:
            return self.segnet_attrs(int(p.bn_mode) if "bn_mode" in p.DESCRIPTOR.fields_by_name else LEARN,
                                     len(lp.top), "bn_param.bn_mode", "SegNet's BN")
        if len(lp.top) != 1:
            raise LayerError(f"PSPNet's BN takes one top, got {len(lp.top)}")
        eps = float(p.eps)
        if not eps > 0:
            raise LayerError(f"bn_param.eps must be > 0, got {eps}")
        return {"variant": PSPNET, "eps": eps, "momentum": float(p.momentum), "frozen": bool(p.frozen)}

    @staticmethod
    def segnet_attrs(mode, tops, field, what):
        if mode not in (LEARN, INFERENCE):
            raise LayerError(f"unknown {field} {mode}")
        most = 3 if mode == LEARN else 1   # LEARN may also output the batch mean and variance
        if tops > most:
            raise LayerError(f"{what} in {'LEARN' if mode == LEARN else 'INFERENCE'} mode takes at most {most} "
                             f"top(s), got {tops}")
        return {"variant": SEGNET, "learn": mode == LEARN, "tops": tops}

    @staticmethod
    def _parse_mybn(lp, p):
        """Robert0812/caffe's mybn BN (bn_layer.cpp, 3ae1322; BestiVictory/ILGnet): PSPNet's computation with
        slope_filler, bias_filler, moving_average, momentum and eps (1e-7 unless given); its four blobs
        (slope, bias, mean, variance) are stored (1, C)."""
        if len(lp.top) != 1:
            raise LayerError(f"Robert0812's BN takes one top, got {len(lp.top)}")
        if not p.moving_average:
            raise LayerError("bn_param.moving_average false: Robert0812's BN then normalizes at TEST with whatever "
                             "its buffers last held; not supported")
        eps = float(p.eps) if p.HasField("eps") else MYBN_EPS
        if not eps > 0:
            raise LayerError(f"bn_param.eps must be > 0, got {eps}")
        return {"variant": PSPNET, "eps": eps, "momentum": float(p.momentum), "frozen": False, "flat_blobs": True}

    def stored_blobs(self, attrs, arrays, notes):
        """Robert0812's and P3D's (1, C) blobs as the (1, C, 1, 1) ones PSPNet's BN keeps (P3D's stay (1, C)
        for a 5-axis bottom, as param_shapes says; _rank is set by this build's infer, before weights attach)."""
        flat = bool(arrays) and all(a.ndim == 2 and a.shape[0] == 1 for a in arrays)
        if flat and attrs.get("flat_blobs"):
            return [a.reshape(1, -1, 1, 1) for a in arrays]
        if flat and attrs["variant"] == PSPNET and attrs.get("_rank") in (2, 4):
            # P3D's BN (roundchuan/P3D-CTN 797ac4a bn_layer.cpp) keeps (1, C) blobs for 4-axis bottoms too
            notes.append("BN blobs stored (1, C) (P3D's BN) read as (1, C, 1, 1)")
            return [a.reshape(1, -1, 1, 1) for a in arrays]
        return arrays

    @staticmethod
    def _parse_tsn(lp, p, others):
        """yjxiong/caffe's BN (TSN, SegStereo): PSPNet's blobs and computation, but it divides by the
        deviation, adds var_eps (1e-10), and keeps history = decay * batch + (1 - decay) * history."""
        if others:
            raise LayerError(f"bn_param mixes yjxiong/caffe's BN fields with {', '.join(others)} of another BN")
        if len(lp.top) != 1:
            raise LayerError(f"yjxiong/caffe's BN takes one top, got {len(lp.top)}")
        if p.axis != 1:
            raise LayerError(f"bn_param.axis {p.axis}: only axis 1 (channels) is supported")
        if not p.use_history_in_test:
            raise LayerError("bn_param.use_history_in_test false (the batch's own statistics at TEST) is not "
                             "supported")
        if not p.var_eps >= 0 or not 0 <= p.decay <= 1:
            raise LayerError(f"bn_param.var_eps {p.var_eps} must be >= 0 and decay {p.decay} in [0, 1]")
        return {"variant": TSN, "eps": float(p.var_eps), "momentum": 1.0 - float(p.decay), "frozen": bool(p.frozen)}

    def blob_names_for(self, attrs):
        if attrs["variant"] == SEGNET:
            return ("scale", "shift")
        return ("slope", "bias", "mean", "variance")

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        # P3D's BN (ZhaofanQiu/pseudo-3d-residual-networks, PSPNet's fields) normalizes (N, C, L, H, W)
        # bottoms per channel, as (N, C, 1, L * H * W)
        if len(s) not in (2, 4) and not (len(s) > 4 and attrs["variant"] != SEGNET):
            raise LayerError(f"BN needs an (N, C, H, W) or (N, C) input, got {list(s)}")
        if len(s) == 2 and attrs.get("tops", 1) > 1:
            raise LayerError("BN's batch statistics tops need an (N, C, H, W) input")
        attrs["_rank"] = len(s)   # stored_blobs: P3D's (1, C) blobs of a 4-axis bottom
        stats = (1, s[1], 1, 1)
        return [s] + [stats] * (attrs.get("tops", 1) - 1)

    def param_shapes(self, attrs, in_shapes):
        c = int(in_shapes[0][1])
        if len(in_shapes[0]) > 4:
            return [(1, c)] * 4     # P3D's BN: blobs of shape (1, C)
        return [(1, c, 1, 1)] * (2 if attrs["variant"] == SEGNET else 4)

    def init_params(self, attrs, shapes, rng):
        ones, zeros = np.ones(shapes[0], np.float32), np.zeros(shapes[0], np.float32)
        return [ones, zeros] if attrs["variant"] == SEGNET else [ones, zeros, zeros.copy(), ones.copy()]

    def forward(self, attrs, params, x, training=False):
        if x.dim() == 2:
            # the forks read num/channels/height/width: (N, C) is (N, C, 1, 1)
            return self.forward(attrs, params, x.reshape(x.shape[0], x.shape[1], 1, 1), training).reshape(x.shape)
        if x.dim() > 4:   # P3D: (N, C, 1, rest) with its (1, C) blobs viewed as (1, C, 1, 1) (updated in place)
            flat = [p.reshape(1, -1, 1, 1) for p in params]
            return self.forward(attrs, flat, x.reshape(x.shape[0], x.shape[1], 1, -1), training).reshape(x.shape)
        if attrs["variant"] == SEGNET:
            y, mean, var = segnet_bn(x, params[0], params[1], attrs["learn"])
            return (y, mean, var)[:attrs["tops"]] if attrs["tops"] > 1 else y
        divide = attrs["variant"] == TSN
        if attrs["frozen"] or not training:
            return pspnet_bn(x, params[0], params[1], params[2], params[3], attrs["eps"], divide)
        mean, var = pspnet_batch_stats(x)
        m = attrs["momentum"]
        with torch.no_grad():
            params[2].mul_(m).add_(mean.detach(), alpha=1 - m)
            params[3].mul_(m).add_(var.detach(), alpha=1 - m)
        return pspnet_bn(x, params[0], params[1], mean, var, attrs["eps"], divide)

    def onnx(self, ctx, node):
        x, out = node.inputs[0], node.outputs[0]
        shape = [int(d) for d in ctx.shape(x)]
        if len(shape) != 4:   # (N, C) as (N, C, 1, 1), P3D's (N, C, L, H, W) as (N, C, 1, L H W), and back
            x4 = ctx.add_node("Reshape", [x, ctx.const(np.array([0, shape[1], 1, -1], np.int64))],
                              [ctx.tmp(node.name + "_4d")], name=node.name + "_4d")[0]
            y4 = ctx.tmp(node.name + "_y4d")
            self._onnx_4d(ctx, node, x4, y4)
            ctx.add_node("Reshape", [y4, ctx.const(np.array([0] + shape[1:], np.int64))], [out])
            return
        self._onnx_4d(ctx, node, x, out)

    def _onnx_4d(self, ctx, node, x, out):
        from .norm import onnx_reduce
        a = node.attrs
        blob = [np.asarray(b, np.float32).reshape(1, -1, 1, 1) for b in node.blobs]
        if a["variant"] in (PSPNET, TSN):
            # Caffe's order with the inverse deviation folded: ((x - mean) * inv_std) * slope + bias;
            # yjxiong's divides by the deviation
            centred = ctx.add_node("Sub", [x, ctx.const(blob[2], node.name + "_mean")],
                                   [ctx.tmp(node.name + "_centred")], name=node.name)[0]
            if a["variant"] == TSN:
                std = np.sqrt(blob[3] + np.float32(a["eps"])).astype(np.float32)
                normed = ctx.op("Div", [centred, ctx.const(std, node.name + "_std")], "normed")
            else:
                inv_std = np.power(blob[3] + np.float32(a["eps"]), np.float32(-0.5)).astype(np.float32)
                normed = ctx.add_node("Mul", [centred, ctx.const(inv_std, node.name + "_inv_std")],
                                      [ctx.tmp(node.name + "_normed")])[0]
            scaled = ctx.add_node("Mul", [normed, ctx.const(blob[0], node.name + "_slope")],
                                  [ctx.tmp(node.name + "_scaled")])[0]
            ctx.add_node("Add", [scaled, ctx.const(blob[1], node.name + "_bias")], [out])
            return
        scale, shift = ctx.const(blob[0], node.name + "_scale"), ctx.const(blob[1], node.name + "_shift")
        if not a["learn"]:
            scaled = ctx.add_node("Mul", [x, scale], [ctx.tmp(node.name + "_scaled")], name=node.name)[0]
            ctx.add_node("Add", [scaled, shift], [out])
            return
        # LEARN: the batch's own statistics, plane means first, then over N (as segnet_bn)
        mean = onnx_reduce(ctx, "ReduceMean", onnx_reduce(ctx, "ReduceMean", x, [2, 3], True), [0], True)
        square = ctx.add_node("Mul", [x, x], [ctx.tmp(node.name + "_sq")], name=node.name)[0]
        square_mean = onnx_reduce(ctx, "ReduceMean", onnx_reduce(ctx, "ReduceMean", square, [2, 3], True),
                                  [0], True)
        mean_sq = ctx.add_node("Mul", [mean, mean], [ctx.tmp(node.name + "_mean_sq")])[0]
        var = ctx.add_node("Sub", [square_mean, mean_sq], [ctx.tmp(node.name + "_var")])[0]
        var_eps = ctx.add_node("Add", [var, ctx.const(np.array(SEGNET_EPS, np.float32))],
                               [ctx.tmp(node.name + "_var_eps")])[0]
        std = ctx.add_node("Sqrt", [var_eps], [ctx.tmp(node.name + "_std")])[0]
        centred = ctx.add_node("Sub", [x, mean], [ctx.tmp(node.name + "_centred")])[0]
        normed = ctx.add_node("Div", [centred, std], [ctx.tmp(node.name + "_normed")])[0]
        scaled = ctx.add_node("Mul", [normed, scale], [ctx.tmp(node.name + "_scaled")])[0]
        ctx.add_node("Add", [scaled, shift], [out])
        if len(node.outputs) > 1:
            ctx.add_node("Identity", [mean], [node.outputs[1]])
        if len(node.outputs) > 2:
            ctx.add_node("Identity", [var], [node.outputs[2]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        c = emit.in_shape(0)[1]
        x = emit.inputs[0]
        two_axes = len(emit.in_shape(0)) == 2      # (N, C) runs as (N, C, 1, 1)
        flat_blobs = len(emit.in_shape(0)) > 4     # P3D: PSPNetBN reshapes the bottom itself
        x4 = f"{x}.reshape({x}.shape[0], {c}, 1, 1)" if two_axes else x

        def flat(expr):
            return f"{expr}.reshape({x}.shape[0], {c})" if two_axes else expr
        if a["variant"] in (PSPNET, TSN):
            cls = emit.helper(TORCH_PSPNET_BN)
            args = [str(c)]
            if np.float32(a["eps"]) != np.float32(1e-5):
                args.append(f"eps={emit.lit(a['eps'])}")
            args.append(f"momentum={emit.lit(a['momentum'])}")
            if a["frozen"]:
                args.append("frozen=True")
            if a["variant"] == TSN:
                args.append("divide=True")
            if flat_blobs:
                args.append("flat_blobs=True")
            m = emit.module(f"{cls}({', '.join(args)})")
            for i, name in enumerate(("slope", "bias", "mean", "variance")):
                emit.param(name, i)
            return flat(f"{m}({x4})")
        cls = emit.helper(TORCH_SEGNET_BN)
        m = emit.module(f"{cls}({c}, learn={a['learn']})")
        emit.param("scale", 0)
        emit.param("shift", 1)
        if a["tops"] == 1:
            return flat(f"{m}({x4})[0]")
        result = emit.tmp(node.name + "_bn")
        emit.stmt(f"{result} = {m}({x})")
        return [f"{result}[{i}]" for i in range(a["tops"])]


# ---- Unpooling (DeconvNet) ------------------------------------------------------------

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



@register_layer("BNplus")
class BNplus(BN):
    """ArcherFMY/caffe-sal-ensemble's BNplus (ff8e040 caffe/src/caffe/layers/bnplus_layer.cpp and .cu, last
    changed in 32c339e): SegNet's BN under another name, its mode in bnplus_param.bnplus_mode."""

    def parse(self, lp):
        need_blobs(lp, "BNplus", 1)
        return self.segnet_attrs(int(lp.bnplus_param.bnplus_mode), len(lp.top), "bnplus_param.bnplus_mode",
                                 "BNplus")

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


# ---- CropCenter --------------------------------------------------------------------

@register_layer("CropCenter")
class CropCenter(Layer):
    def parse(self, lp):
        need_blobs(lp, "CropCenter", 1)
        sizes = tuple(int(v) for v in lp.crop_center_param.crop_size)
        return {"crop": sizes}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        crop = attrs["crop"]
        if len(crop) != len(s):
            raise LayerError(f"crop_center_param.crop_size needs one value per axis ({len(s)}), "
                             f"got {len(crop)}")
        for axis, (n, k) in enumerate(zip(s, crop)):
            if 2 * k + 1 > n:
                raise LayerError(f"crop_center_param.crop_size {k} leaves nothing of axis {axis} (size {n})")
        return [tuple(n - 2 * k for n, k in zip(s, crop))]

    def forward(self, attrs, params, x):
        return x[tuple(slice(k, n - k) for n, k in zip(x.shape, attrs["crop"]))]

    def onnx(self, ctx, node):
        x = node.inputs[0]
        shape = ctx.shape(x)
        crop = node.attrs["crop"]
        # axis 0 (the batch) is dynamic in the export: crop it from its end with a negative bound
        ends = [-k if i == 0 else int(n) - k for i, (n, k) in enumerate(zip(shape, crop))]
        if crop[0] == 0:
            ends[0] = np.iinfo(np.int64).max
        ctx.add_node("Slice", [x, ctx.const(np.array(crop, np.int64)), ctx.const(np.array(ends, np.int64)),
                               ctx.const(np.arange(len(crop), dtype=np.int64))], [node.outputs[0]],
                     name=node.name)

    def pytorch_source(self, node, emit):
        crop = node.attrs["crop"]
        parts = [f"{k}:-{k}" if k else ":" for k in crop]
        return f"{emit.inputs[0]}[{', '.join(parts)}]"
