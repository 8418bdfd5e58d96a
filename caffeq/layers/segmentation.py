"""Layers of the segmentation forks: the two "BN" layers (and BNplus) and CropCenter; their Unpooling
layers are in unpooling.py.

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
- CropCenter (jolibrain/caffe, crop_center_layer.cpp): crop_size gives one
  value per axis; each axis loses that many entries at both ends (Caffe wants
  2 * crop + 1 <= size).

The torch functions and modules below are also copied into the standalone
model.py (inspect.getsource), so the export computes the same bits.
"""

import numpy as np
import torch
from torch import nn

from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources

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


@register_layer("BNplus")
class BNplus(BN):
    """ArcherFMY/caffe-sal-ensemble's BNplus (ff8e040 caffe/src/caffe/layers/bnplus_layer.cpp and .cu, last
    changed in 32c339e): SegNet's BN under another name, its mode in bnplus_param.bnplus_mode."""

    def parse(self, lp):
        need_blobs(lp, "BNplus", 1)
        return self.segnet_attrs(int(lp.bnplus_param.bnplus_mode), len(lp.top), "bnplus_param.bnplus_mode",
                                 "BNplus")


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
