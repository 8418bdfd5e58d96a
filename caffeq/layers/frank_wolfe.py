"""sunke123/FW-Net's layers (0c9e59c, fw_caffe: conv_conjugate_norm_layer, holder_pool_layer, sig_scale_layer;
its Frank-Wolfe denoising nets), as their GPU forwards compute them.  Each holds one learned value shared by
every channel (channel_shared, group 1: a 0-axis blob), clamped to [min_p, max_p] where it is a p.

- ConvConjugateNorm: each pixel's channel vector over its l_q norm, q = p / (p - 1):
  y = x / ((sum_c |x_c|^q)^(1/q) + 1e-10).
- HolderPool: y = -d |x|^(1/(p - 1)) x / sqrt(x^2 + 1e-20) (|x| + 1e-10 inside the power).
- SigScale: y = x sigmoid(t), or x (1 - sigmoid(t)) with counterpart.
Per-channel blobs, groups, fc, spatial and exp_p (unused by the nets) are refused.  TRAIN and TEST compute the
same.  torch, ONNX, model.py.
"""
import math

import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources


def exponents(p: float):
    """(q = p / (p - 1), 1 / q, 1 / (p - 1)) as the fork stores them, float32."""
    q = float(np.float32(p / (p - 1.0)))
    return q, float(np.float32(1.0 / q)), float(np.float32(1.0 / (p - 1.0)))


def conjugate_norm(x, q: float, root: float):
    """x over the l_q norm of its channels (axis 1) at each position, 1e-10 after the root (root = 1 / q)."""
    norm = torch.pow(torch.pow(torch.abs(x), q).sum(1, keepdim=True), root)
    return x / (norm + 1e-10)


def holder_map(x, power: float, d: float):
    """-d |x|^power x / sqrt(x^2 + 1e-20), power = 1 / (p - 1)."""
    return -d * torch.pow(torch.abs(x) + 1e-10, power) * x / torch.pow(x * x + 1e-20, 0.5)


def sigmoid_factor(t: float, counterpart: bool):
    """sigmoid(t) (or 1 - sigmoid(t)) computed in double and rounded to float32, as the fork's kernel stores it."""
    r = 1.0 / (1.0 + math.exp(-t))
    return float(np.float32(1.0 - r if counterpart else r))


TORCH_FRANK_WOLFE = torch_sources(conjugate_norm, holder_map)


class _SharedValue(Layer):
    """A layer of one learned scalar, shared by all channels."""
    field = ""
    filler_default = 1.0
    clamps = True

    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        p = getattr(lp, self.field)
        unsupported = [f for f in ("fc", "spatial", "exp_p") if f in p.DESCRIPTOR.fields_by_name and getattr(p, f)]
        if not p.channel_shared or p.group != 1 or unsupported:
            raise LayerError(f"{self.field}: caffeq runs the FW-Net form, one value shared by every channel "
                             f"(channel_shared true, group 1, no fc/spatial/exp_p)")
        attrs = {"type": lp.type}
        if self.clamps:
            attrs["range"] = (float(p.min_p), float(p.max_p))
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if not 2 <= len(s) <= 4:
            raise LayerError(f"{attrs['type']} reads 2 to 4 axes (Caffe's legacy num/channels/height/width), got {list(s)}")
        return [s]

    def param_shapes(self, attrs, in_shapes):
        return [()]

    def init_params(self, attrs, shapes, rng):
        return [np.full((), self.filler_default, np.float32)]

    def value(self, attrs, blob):
        v = float(np.asarray(blob, np.float64).reshape(-1)[0])
        if self.clamps:   # the fork's forward clamps p (and writes it back)
            v = min(max(v, attrs["range"][0]), attrs["range"][1])
        if self.clamps and v == 1.0:
            raise LayerError(f"{attrs['type']}: p = 1 divides by zero in the fork's exponent")
        return v

    def pytorch_source(self, node, emit):
        return self.source(node, emit, self.value(node.attrs, node.blobs[0]))


@register_layer("ConvConjugateNorm")
class ConvConjugateNorm(_SharedValue):
    field, filler_default = "conjugate_norm_param", 1.5

    def forward(self, attrs, params, x):
        q, root, _ = exponents(self.value(attrs, params[0]))
        return conjugate_norm(x, q, root)

    def source(self, node, emit, p):
        emit.helper(TORCH_FRANK_WOLFE)
        q, root, _ = exponents(p)
        return f"conjugate_norm({emit.inputs[0]}, {q!r}, {root!r})"

    def onnx(self, ctx, node):
        q, root, _ = exponents(self.value(node.attrs, node.blobs[0]))
        powered = ctx.op("Pow", [ctx.op("Abs", [node.inputs[0]], "abs"), ctx.f32(q)], "powered")
        total = onnx_reduce(ctx, "ReduceSum", powered, [1], True)
        norm = ctx.op("Add", [ctx.op("Pow", [total, ctx.f32(root)], "root"), ctx.f32(1e-10)], "norm")
        ctx.add_node("Div", [node.inputs[0], norm], [node.outputs[0]], name=node.name)


@register_layer("HolderPool")
class HolderPool(_SharedValue):
    field, filler_default = "holder_pool_param", 1.5

    def parse(self, lp):
        return dict(super().parse(lp), d=float(lp.holder_pool_param.d))

    def forward(self, attrs, params, x):
        return holder_map(x, exponents(self.value(attrs, params[0]))[2], attrs["d"])

    def source(self, node, emit, p):
        emit.helper(TORCH_FRANK_WOLFE)
        return f"holder_map({emit.inputs[0]}, {exponents(p)[2]!r}, {node.attrs['d']!r})"

    def onnx(self, ctx, node):
        q = exponents(self.value(node.attrs, node.blobs[0]))[2]
        x = node.inputs[0]
        power = ctx.op("Pow", [ctx.op("Add", [ctx.op("Abs", [x], "abs"), ctx.f32(1e-10)], "abs_eps"), ctx.f32(q)],
                       "power")
        scaled = ctx.op("Mul", [ctx.op("Mul", [ctx.f32(-node.attrs["d"]), power], "neg_power"), x], "scaled")
        root = ctx.op("Pow", [ctx.op("Add", [ctx.op("Mul", [x, x], "square"), ctx.f32(1e-20)], "square_eps"),
                              ctx.f32(0.5)], "root")
        ctx.add_node("Div", [scaled, root], [node.outputs[0]], name=node.name)


@register_layer("SigScale")
class SigScale(_SharedValue):
    field, filler_default, clamps = "sig_scale_param", 1.0, False

    def parse(self, lp):
        return dict(super().parse(lp), counterpart=bool(lp.sig_scale_param.counterpart))

    def forward(self, attrs, params, x):
        return x * sigmoid_factor(self.value(attrs, params[0]), attrs["counterpart"])

    def source(self, node, emit, t):
        return f"{emit.inputs[0]} * {emit.lit(sigmoid_factor(t, node.attrs['counterpart']))}"

    def onnx(self, ctx, node):
        r = sigmoid_factor(self.value(node.attrs, node.blobs[0]), node.attrs["counterpart"])
        ctx.add_node("Mul", [node.inputs[0], ctx.f32(r)], [node.outputs[0]], name=node.name)
