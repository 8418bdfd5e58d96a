"""maunzzz/caffe-crfgd (c0cbacb; Larsson et al., "Revisiting deep structured models for pixel-level
labeling with gradient-based inference"): its CRF layers, run as gradient steps over class
probabilities, and the per-pixel features they read.

- PixelFeature (pixel_feature_layer.cpp, Max Planck bilateralNN's): (N, C, H, W) -> position and colour
  features.  POSITION_AND_RGB: [pos_scale y + offset_h, pos_scale x + offset_w, color_scale x_c...]
  (N, 2 + C, H, W); RGB_AND_POSITION: the colours first; RGB: color_scale x; POSITION: the two
  position channels.  The random and warped types draw random numbers and are refused.
- CrfFilterbankEd (crf_filterbank_ed.cpp): bottoms Q0 (N, C, H, W) class probabilities and per-pixel
  filter weights (N, F, H, W); blobs the unary weight w (1, 1, 1, 1) and the filters (C, C F, k, k),
  whose memory is a bias-free k x k convolution with C F outputs, output c F + f (pad (k - 1) / 2).
  U = -w log(Q0 + log_eps); X = Q0; int(num_iterations) times: R = conv(X), D_c = sum_f feat_f R_{cF+f},
  G = D + U (U alone with skip_pw_term), t = sqrt(2 ln C / (it + 1)) / step_size_factor (double, then
  float), X = X exp(-t G) / sum_c X exp(-t G) (the exponent less its per-pixel maximum first, which
  changes nothing).  The top: X, (N, C, H, W) probabilities.
- CrfEd (crf_ed_layer.cpp) and CrfGrad (crf_grad_layer.cpp) add a learned filter over a permutohedral
  lattice of the features (bilateralNN's 63-tap lattice convolution, blob (C, C, 1, 2^(d+1) - 1)),
  which caffeq does not implement: they are read, checked and sized (top = Q0's shape; the energy top
  (N, 1, 1, T) with calculate_energy), and refused when run or exported.
The torch functions below serve `forward` and are copied into model.py.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .norm import onnx_reduce
from .registry import Layer, LayerError, ReadOnlyLayer, need_blobs, register_layer, torch_sources

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def pixel_features(x, kind: str, pos_scale: float, color_scale: float, offset_h: float, offset_w: float):
    """PixelFeature's top for kind POSITION_AND_RGB, RGB_AND_POSITION, RGB or POSITION (float32 steps)."""
    n, _, h, w = x.shape
    f32 = torch.float32
    scale = torch.tensor(pos_scale, dtype=f32)
    rows = (torch.arange(h, dtype=f32) * scale + torch.tensor(offset_h, dtype=f32)).to(x.device, x.dtype)
    cols = (torch.arange(w, dtype=f32) * scale + torch.tensor(offset_w, dtype=f32)).to(x.device, x.dtype)
    position = torch.stack([rows[:, None].expand(h, w), cols[None, :].expand(h, w)])[None].expand(n, 2, h, w)
    if kind == "POSITION":
        return position.contiguous()
    colour = x * torch.tensor(color_scale, dtype=x.dtype, device=x.device)
    if kind == "RGB":
        return colour
    parts = [position, colour] if kind == "POSITION_AND_RGB" else [colour, position]
    return torch.cat(parts, 1)


def entropic_step(x, g, step: float):
    """One exponentiated-gradient step of crfgd's EntropyDescentLayer: x exp(-step g), renormalized
    over the channels (the exponent less its per-pixel maximum first)."""
    e = g * torch.tensor(-step, dtype=g.dtype, device=g.device)
    e = torch.exp(e - e.amax(1, keepdim=True)) * x
    return e / e.sum(1, keepdim=True)


def crf_filterbank_ed(q, feats, unary_weight, filters, iterations: int, step_size_factor: float, log_eps: float,
                      skip_pw: bool = False):
    """CrfFilterbankEd's top: entropic descent from q (N, C, H, W) over a per-pixel weighted filter bank."""
    n, c, h, w = q.shape
    f = feats.shape[1]
    k = filters.shape[-1]
    bank = filters.reshape(c * f, c, k, k)   # the blob's memory read as the convolution's
    unary = -unary_weight.reshape(()) * torch.log(q + log_eps)
    x = q
    for it in range(iterations):
        g = unary
        if not skip_pw:
            response = F.conv2d(x, bank, padding=(k - 1) // 2).reshape(n, c, f, h, w)
            g = (response * feats[:, None]).sum(2) + unary
        x = entropic_step(x, g, float(torch.tensor(math.sqrt(2.0 * math.log(c) / (it + 1)) / step_size_factor,
                                                   dtype=torch.float32)))
    return x


class CrfFilterbankEd(nn.Module):
    """crf_filterbank_ed with its two blobs as parameters."""

    def __init__(self, classes, filters_per_class, kernel_size, iterations, step_size_factor, log_eps,
                 skip_pw=False):
        super().__init__()
        self.unary_weight = nn.Parameter(torch.zeros(1, 1, 1, 1))
        self.filters = nn.Parameter(torch.zeros(classes, classes * filters_per_class, kernel_size, kernel_size))
        self.iterations, self.step_size_factor, self.log_eps = iterations, step_size_factor, log_eps
        self.skip_pw = skip_pw

    def forward(self, q, feats):
        return crf_filterbank_ed(q, feats, self.unary_weight, self.filters, self.iterations, self.step_size_factor,
                                 self.log_eps, self.skip_pw)


TORCH_CRF_FILTERBANK_ED = torch_sources(entropic_step, crf_filterbank_ed, CrfFilterbankEd)


# ---- specs ---------------------------------------------------------------------------------------


@register_layer("PixelFeature")
class PixelFeature(Layer):
    RUNS = ("POSITION", "POSITION_AND_RGB", "RGB_AND_POSITION", "RGB")

    def parse(self, lp):
        need_blobs(lp, "PixelFeature", 1, 1)
        p = lp.pixel_feature_param
        kind = p.Feature.Name(p.type)
        if kind not in self.RUNS:
            raise LayerError(f"pixel_feature_param.type {kind} draws random positions; caffeq runs "
                             f"{', '.join(self.RUNS)}")
        return {"kind": kind, "pos_scale": float(p.pos_scale), "color_scale": float(p.color_scale),
                "offset_h": float(p.offset_h), "offset_w": float(p.offset_w)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"PixelFeature needs an (N, C, H, W) bottom, got {list(s)}")
        channels = {"POSITION": 2, "RGB": s[1]}.get(attrs["kind"], 2 + s[1])
        return [(s[0], channels, s[2], s[3])]

    def _args(self, attrs):
        return (attrs["kind"], attrs["pos_scale"], attrs["color_scale"], attrs["offset_h"], attrs["offset_w"])

    def forward(self, attrs, params, x):
        return pixel_features(x, *self._args(attrs))

    def pytorch_source(self, node, emit):
        args = ", ".join(emit.lit(v) for v in self._args(node.attrs))
        return f"{emit.helper(pixel_features)}({emit.inputs[0]}, {args})"

    def onnx(self, ctx, node):
        # the position channels are constants of the exported size; the colours a Mul
        a = node.attrs
        n, c, h, w = ctx.shape(node.inputs[0])
        zeros = torch.zeros((n, c, h, w))
        position = pixel_features(zeros, "POSITION", a["pos_scale"], 1.0, a["offset_h"], a["offset_w"]).numpy()
        if a["kind"] == "POSITION":
            ctx.add_node("Identity", [ctx.const(position, node.name + "_position")], [node.outputs[0]], name=node.name)
            return
        colour = ctx.op("Mul", [node.inputs[0], ctx.f32(a["color_scale"])], "colour")
        if a["kind"] == "RGB":
            ctx.add_node("Identity", [colour], [node.outputs[0]], name=node.name)
            return
        pos = ctx.const(position, node.name + "_position")
        parts = [pos, colour] if a["kind"] == "POSITION_AND_RGB" else [colour, pos]
        ctx.add_node("Concat", parts, [node.outputs[0]], name=node.name, axis=1)


def _crf_shapes(kind, in_shapes, classes=None):
    """Q0 (N, C, H, W) and the per-pixel second bottom (N, d, H, W) of a crfgd CRF layer."""
    q, feats = (tuple(s) for s in in_shapes[:2])
    if len(q) != 4 or len(feats) != 4 or q[0] != feats[0] or q[2:] != feats[2:]:
        raise LayerError(f"{kind}: bottoms must be (N, C, H, W) probabilities and (N, d, H, W) per-pixel "
                         f"features of the same N, H, W, got {list(q)} and {list(feats)}")
    if classes is not None and classes != q[1]:
        raise LayerError(f"{kind}: num_classes {classes} but the probabilities have {q[1]} channels")
    return q, feats


def _iterations(value, field):
    if value < 1:
        raise LayerError(f"{field} must be >= 1, got {value}")
    return int(value)   # the fork stores the float into an int


@register_layer("CrfFilterbankEd")
class CrfFilterbankEdLayer(Layer):
    blob_names = ("unary_weight", "filters")

    def parse(self, lp):
        need_blobs(lp, "CrfFilterbankEd", 2, 1, "probabilities, per-pixel filter weights")
        p = lp.crffilterbanked_param
        if p.kernel_size % 2 == 0:
            raise LayerError(f"crffilterbanked_param.kernel_size must be odd (padding (k - 1) / 2 keeps the size), "
                             f"got {p.kernel_size}")
        if p.step_size_factor == 0:
            raise LayerError("crffilterbanked_param.step_size_factor must not be 0")
        return {"iterations": _iterations(p.num_iterations, "crffilterbanked_param.num_iterations"),
                "kernel_size": int(p.kernel_size), "step_size_factor": float(p.step_size_factor),
                "log_eps": float(p.log_eps), "skip_pw": bool(p.skip_pw_term)}

    def infer(self, attrs, in_shapes):
        q, feats = _crf_shapes("CrfFilterbankEd", in_shapes)
        attrs["classes"], attrs["filters_per_class"] = q[1], feats[1]
        return [q]

    def param_shapes(self, attrs, in_shapes):
        c, f, k = attrs["classes"], attrs["filters_per_class"], attrs["kernel_size"]
        return [(1, 1, 1, 1), (c, c * f, k, k)]

    def forward(self, attrs, params, q, feats):
        return crf_filterbank_ed(q, feats, params[0], params[1], attrs["iterations"], attrs["step_size_factor"],
                                 attrs["log_eps"], attrs["skip_pw"])

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        return attrs["iterations"] * n * h * w * c * c * attrs["filters_per_class"] * attrs["kernel_size"] ** 2

    def onnx(self, ctx, node):
        # the iterations unrolled: Conv, the per-pixel weighted sum, the entropic step, as forward
        a = node.attrs
        q, feats = node.inputs
        n, c, h, w = ctx.shape(q)
        f, k = a["filters_per_class"], a["kernel_size"]
        bank = ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([c * f, c, k, k])], "bank")
        weight = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([])], "unary_weight")
        logs = ctx.op("Log", [ctx.op("Add", [q, ctx.f32(a["log_eps"])], "q_eps")], "log_q")
        unary = ctx.op("Neg", [ctx.op("Mul", [weight, logs], "wlog")], "unary")
        feats5 = ctx.op("Unsqueeze", [feats, ctx.i64([1])], "feats5")
        x = q
        for it in range(a["iterations"]):
            g = unary
            if not a["skip_pw"]:
                pad = (k - 1) // 2
                response = ctx.op("Conv", [x, bank], f"conv{it}", pads=[pad] * 4, kernel_shape=[k, k])
                response = ctx.op("Reshape", [response, ctx.i64([n, c, f, h, w])], f"response{it}")
                pairwise = onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [response, feats5], f"weighted{it}"), [2], False)
                g = ctx.op("Add", [pairwise, unary], f"g{it}")
            step = float(np.float32(math.sqrt(2.0 * math.log(c) / (it + 1)) / a["step_size_factor"]))
            e = ctx.op("Mul", [g, ctx.f32(-step)], f"e{it}")
            e = ctx.op("Sub", [e, onnx_reduce(ctx, "ReduceMax", e, [1], True)], f"eshift{it}")
            e = ctx.op("Mul", [ctx.op("Exp", [e], f"exp{it}"), x], f"ex{it}")
            total = onnx_reduce(ctx, "ReduceSum", e, [1], True)
            last = it == a["iterations"] - 1
            if last:
                ctx.add_node("Div", [e, total], [node.outputs[0]], name=node.name)
            else:
                x = ctx.op("Div", [e, total], f"x{it + 1}")

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [a["classes"], a["filters_per_class"], a["kernel_size"], a["iterations"],
                emit.lit(a["step_size_factor"]), emit.lit(a["log_eps"])]
        if a["skip_pw"]:
            args.append("skip_pw=True")
        m = emit.module(f"{emit.helper(TORCH_CRF_FILTERBANK_ED)}({', '.join(str(v) for v in args)})")
        emit.param("unary_weight", 0)
        emit.param("filters", 1)
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"


class _LatticeCrf(ReadOnlyLayer):
    """CrfEd and CrfGrad: read, checked and sized; their lattice filter is not implemented."""
    blob_names = ("unary_weight", "spatial_filter", "lattice_filter")
    field = ""

    def parse(self, lp):
        kind = self.types[0]
        need_blobs(lp, kind, 2, (1, 2), "probabilities, lattice features")
        p = getattr(lp, self.field)
        if p.kernel_size % 2 == 0:
            raise LayerError(f"{self.field}.kernel_size must be odd, got {p.kernel_size}")
        if len(lp.top) == 2 and not p.calculate_energy:
            raise LayerError(f"{kind}: a second top (the energies) needs {self.field}.calculate_energy: true")
        return {"name": lp.name, "classes": int(p.num_classes), "kernel_size": int(p.kernel_size),
                "iterations": _iterations(p.num_iterations, f"{self.field}.num_iterations"), "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        q, feats = _crf_shapes(self.types[0], in_shapes, attrs["classes"])
        attrs["feature_dims"] = feats[1]
        shapes = [q]
        if attrs["tops"] == 2:
            shapes.append((q[0], 1, 1, attrs["iterations"]))
        return shapes

    def param_shapes(self, attrs, in_shapes):
        c, k = attrs["classes"], attrs["kernel_size"]
        return [(1, 1, 1, 1), (c, c, k, k), (c, c, 1, 2 ** (attrs["feature_dims"] + 1) - 1)]

    def why_not_run(self, attrs):
        return ("its learned filter over a permutohedral lattice of the features (Max Planck bilateralNN's "
                "lattice convolution, neighbourhood 1) is not implemented in caffeq")


@register_layer("CrfEd")
class CrfEd(_LatticeCrf):
    field = "crfed_param"


@register_layer("CrfGrad")
class CrfGrad(_LatticeCrf):
    field = "crfgrad_param"
