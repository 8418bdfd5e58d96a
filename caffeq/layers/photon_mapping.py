"""bacTlink/caffe_illu's PhotonMapping (14f713e photon_mapping_layer.cpp; its net estimates illumination by
photon mapping and measures the estimate against a rendering): no parameters and no blobs.

Bottoms: the squared distances (N, P, H, W) of the P nearest photons at each pixel and their flux, of the
same shape.  Top (N, 1, H, W): per pixel, in double, m = max(0, the distances) (a NaN distance is skipped,
as std::max keeps the running maximum) and f = the sum of the fluxes; m * pi > 0 ? f / (m * pi) : 0,
rounded to float, then at most 1 (a NaN stays NaN; nothing clamps from below).
"""
import math

import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, need_blobs, register_layer


def photon_mapping(dis, flux):
    """The fork's per-pixel density estimate min(sum(flux) / (pi * max(0, max(dis))), 1) (0 where that max is
    not > 1e-100), computed in double and rounded to float before the min."""
    d = dis.double()
    m = torch.where(torch.isnan(d), torch.zeros_like(d), d).clamp_min(0.0).amax(dim=1, keepdim=True)
    f = flux.double().sum(dim=1, keepdim=True)
    t = torch.where(m > 1e-100, f / (m * math.pi), torch.zeros_like(f)).to(dis.dtype)
    return torch.where(t > 1.0, torch.ones_like(t), t)


@register_layer("PhotonMapping")
class PhotonMapping(Layer):
    def parse(self, lp):
        need_blobs(lp, "PhotonMapping", 2, 1, roles="squared distances, flux")
        return {}

    def infer(self, attrs, in_shapes):
        dis, flux = (tuple(s) for s in in_shapes)
        if len(dis) != 4 or dis != flux:
            raise LayerError(f"PhotonMapping takes two (N, P, H, W) bottoms of one shape (the fork's CHECKs), "
                             f"got {list(dis)} and {list(flux)}")
        return [(dis[0], 1) + dis[2:]]

    def forward(self, attrs, params, dis, flux):
        return photon_mapping(dis, flux)

    def onnx(self, ctx, node):
        from onnx import TensorProto

        def f64(v):
            return ctx.const(np.array(v, np.float64))
        dis, flux = node.inputs
        d = ctx.op("Cast", [dis], "dis64", name=node.name, to=TensorProto.DOUBLE)
        d = ctx.op("Where", [ctx.op("IsNaN", [d], "nan"), f64(0.0), d], "dis_seen")
        m = onnx_reduce(ctx, "ReduceMax", ctx.op("Max", [d, f64(0.0)], "dis_pos"), [1], True)
        f = onnx_reduce(ctx, "ReduceSum", ctx.op("Cast", [flux], "flux64", to=TensorProto.DOUBLE), [1], True)
        t = ctx.op("Div", [f, ctx.op("Mul", [m, f64(math.pi)], "m_pi")], "t64")
        t = ctx.op("Where", [ctx.op("Greater", [m, f64(1e-100)], "lit"), t, f64(0.0)], "t_lit")
        t = ctx.op("Cast", [t], "t", to=TensorProto.FLOAT)
        ctx.add_node("Where", [ctx.op("Greater", [t, ctx.f32(1.0)], "over"), ctx.f32(1.0), t], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(photon_mapping)}({emit.inputs[0]}, {emit.inputs[1]})"


__all__ = ["PhotonMapping", "photon_mapping"]
