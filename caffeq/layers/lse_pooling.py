"""wang821002/Caffe-Multi-Label's LsePooling (823baf1 lse_pooling_layer.cpp/.cu; its chest X-ray CAM nets):
log-sum-exp pooling, between average (r -> 0) and max (r -> inf) pooling.

lse_pooling_param is BVLC's pooling geometry (kernel, stride, pad; ceil rounding and the padded-last-window
rule) with `global_pooling` true by default, `pool` LSE by default and `r_t`, the sharpness r (no default: the
fork's 0 gives NaN, so caffeq asks for it).  LSE computes, per window,

    y = m + log(sum over the window's in-image cells of exp(r (x - m)) / pool_size) / r

with pool_size the window clipped to the padded extent (padding counts, adds nothing), as both forwards do.
The fork's shift m is a running value (0, then any cell whose |x| exceeds it, signed); caffeq shifts by the
window's maximum (its minimum for a negative r, a soft minimum): the same m on windows of non-negative values
with r > 0 (its nets pool a ReLU), and the same value wherever the fork's exp does not overflow (a window
where it does gives +inf there).
MAX and AVE are BVLC's Pooling (the fork copies its loops); STOCHASTIC, broken in the fork, is refused.
ONNX: global windows (the nets') as reductions; windowed LSE is refused (ONNX has no im2col to take the
per-window shift).
"""
import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ExportError
from ..io.schema import caffe_pb2
from .norm import onnx_reduce
from .pooling import AVE, CEIL, MAX, Pooling, as_pooling_param, caffe_pool_out, caffe_window_sizes, window
from .registry import LayerError, register_layer, torch_sources

_LSE = caffe_pb2.LsePoolingParameter.LSE


def lse_pool2d(x, r: float, kernel: list[int], stride: list[int], pad: list[int], ceil: bool):
    """LsePooling's LSE (see the module docstring): m + log(sum exp(r (x - m)) / pool_size) / r per window, the
    sum over the window's in-image cells, m their maximum (their minimum for a negative r)."""
    size = [x.shape[2], x.shape[3]]
    out = caffe_pool_out(size, kernel, stride, pad, ceil)
    extra = [max(0, (out[i] - 1) * stride[i] + kernel[i] - (size[i] + pad[i])) for i in range(2)]
    pads = [pad[1], extra[1], pad[0], extra[0]]
    n, c = x.shape[0], x.shape[1]
    xp = F.pad(x, pads)
    inside = F.pad(torch.ones((1, 1, size[0], size[1]), dtype=x.dtype, device=x.device), pads)
    full = [(xp.shape[2 + i] - kernel[i]) // stride[i] + 1 for i in range(2)]
    cols = F.unfold(xp.reshape(n * c, 1, xp.shape[2], xp.shape[3]), kernel, stride=stride)
    cols = cols.reshape(n, c, kernel[0] * kernel[1], full[0], full[1])[:, :, :, :out[0], :out[1]]
    valid = F.unfold(inside, kernel, stride=stride).reshape(1, 1, kernel[0] * kernel[1], full[0], full[1])
    valid = valid[:, :, :, :out[0], :out[1]] > 0
    if r > 0:
        m = torch.where(valid, cols, torch.full_like(cols, float("-inf"))).amax(dim=2)
    else:
        m = torch.where(valid, cols, torch.full_like(cols, float("inf"))).amin(dim=2)
    terms = torch.exp(r * (cols - m.unsqueeze(2)))
    total = torch.where(valid, terms, torch.zeros_like(terms)).sum(dim=2)
    return m + torch.log(total / caffe_window_sizes(size, kernel, stride, pad, out, x)) / r


TORCH_LSE_POOL = torch_sources(caffe_pool_out, caffe_window_sizes, lse_pool2d)


@register_layer("LsePooling")
class LsePooling(Pooling):
    def pooling_params(self, lp):
        p = lp.lse_pooling_param
        if p.pool == caffe_pb2.LsePoolingParameter.STOCHASTIC:
            raise LayerError("lse_pooling_param.pool: STOCHASTIC is not implemented in the fork (its CPU forward "
                             "aborts, its GPU one reads an unsized index blob)")
        q = as_pooling_param(p, MAX if p.pool == caffe_pb2.LsePoolingParameter.MAX else AVE)   # LSE: AVE's windows
        q.global_pooling = p.global_pooling   # true unless set: the fork's default
        return q

    def parse(self, lp):
        attrs = super().parse(lp)
        p = lp.lse_pooling_param
        attrs["lse"] = p.pool == _LSE
        if attrs["lse"]:
            if len(lp.top) != 1:
                raise LayerError(f"LsePooling's LSE takes 1 top, got {len(lp.top)}")
            r = float(p.r_t)
            if not np.isfinite(r) or r == 0:
                raise LayerError(f"lse_pooling_param.r_t (the sharpness r) must be set and nonzero, got {r} "
                                 "(the fork's unset 0 gives NaN)")
            attrs["r"] = r
        return attrs

    def _lse_args(self, attrs, h, w):
        k, s, p, _ = window(attrs, h, w)
        return attrs["r"], list(k), list(s), list(p), attrs["round_mode"] == CEIL

    def forward(self, attrs, params, x):
        if not attrs["lse"]:
            return super().forward(attrs, params, x)
        return lse_pool2d(x, *self._lse_args(attrs, x.shape[2], x.shape[3]))

    def onnx(self, ctx, node):
        if not node.attrs["lse"]:
            return super().onnx(ctx, node)
        x = node.inputs[0]
        _, _, h, w = ctx.shape(x)
        r, k, s, p, _ = self._lse_args(node.attrs, h, w)
        if k != [h, w] or any(p):
            raise ExportError(f"layer '{node.name}' (LsePooling): a {k[0]}x{k[1]} LSE window on a {h}x{w} input "
                              "has no ONNX form here (only a window over the whole input)")
        m = onnx_reduce(ctx, "ReduceMax" if r > 0 else "ReduceMin", x, [2, 3], keepdims=True)
        shifted = ctx.op("Mul", [ctx.op("Sub", [x, m], "centred"), ctx.const(np.array(r, np.float32))], "scaled")
        total = onnx_reduce(ctx, "ReduceSum", ctx.op("Exp", [shifted], "exp"), [2, 3], keepdims=True)
        mean = ctx.op("Div", [total, ctx.const(np.array(h * w, np.float32))], "mean")
        lse = ctx.op("Div", [ctx.op("Log", [mean], "log"), ctx.const(np.array(r, np.float32))], "lse")
        ctx.add_node("Add", [m, lse], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        if not node.attrs["lse"]:
            return super().pytorch_source(node, emit)
        fn = emit.helper(TORCH_LSE_POOL)
        r, k, s, p, ceil = self._lse_args(node.attrs, *emit.in_shape(0)[2:])
        return f"{fn}({emit.inputs[0]}, {r!r}, {k}, {s}, {p}, {ceil})"


__all__ = ["LsePooling"]
