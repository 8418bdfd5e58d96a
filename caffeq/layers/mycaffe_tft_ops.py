"""MyCaffe's Temporal Fusion Transformer: the pieces its layers share (mycaffe_tft.py and
mycaffe_tft_temporal.py): the torch functions that model.py copies, blob shapes and random blobs, and ONNX
emission of the same pieces.  The layers' semantics and sources are in mycaffe_tft.py's docstring."""
import math

import numpy as np
import torch
from torch import nn

from .registry import (
    LayerError,
    count,
)

# ---- torch (copied into model.py: torch and math only) --------------------------------------------------------

def tft_linear(x, w, b, axis):
    """Caffe's InnerProduct: x flattened from `axis`, times w^T (+ b)."""
    y = x.reshape(list(x.shape[:axis]) + [w.shape[1]]).matmul(w.t())
    return y + b if b is not None else y


def tft_layer_norm(x, eps):
    """MyCaffe's LayerNorm (no scale, no shift): over the last axis of a 2-axis blob, else over the axes from 2."""
    dims = [1] if x.dim() == 2 else list(range(2, x.dim()))
    xmu = x - x.to(torch.float64).mean(dim=dims, keepdim=True).to(x.dtype)   # channel_mean sums in double
    var = (xmu * xmu).to(torch.float64).mean(dim=dims, keepdim=True).to(x.dtype)
    return xmu / torch.sqrt(var + eps)


def tft_glu(x, blobs, bias, axis):
    """GLU: fc2(x) * sigmoid(fc1(x)); blobs w1, [b1], w2, [b2]."""
    if bias:
        return tft_linear(x, blobs[2], blobs[3], axis) * torch.sigmoid(tft_linear(x, blobs[0], blobs[1], axis))
    return tft_linear(x, blobs[1], None, axis) * torch.sigmoid(tft_linear(x, blobs[0], None, axis))


def tft_grn(x, context, blobs, skip, elu, axis):
    """MyCaffe's GRN: layer norm (1e-10) of GLU(fc2(act(fc1(x) [+ context W_c^T]))) + residual."""
    i = 0
    residual = x
    if skip:
        residual = tft_linear(x, blobs[0], blobs[1], axis)
        i = 2
    h = tft_linear(x, blobs[i], blobs[i + 1], axis)
    i += 2
    if context is not None:
        h = h + tft_linear(context, blobs[i], None, axis).reshape(h.shape)
        i += 1
    h = torch.where(h > 0, h, torch.exp(h) - 1) if elu else torch.relu(h)
    h = tft_linear(h, blobs[i], blobs[i + 1], axis)
    g = tft_glu(h, blobs[i + 2:i + 6], True, axis)
    return tft_layer_norm(g + residual.reshape(g.shape), 1e-10)


def tft_gate_add_norm(x, residual, blobs, bias, axis, offset, eps):
    """GateAddNorm: layer norm of GLU(x) + residual[:, offset:] (no residual: GLU(x) alone; eps None: no norm)."""
    g = tft_glu(x, blobs, bias, axis)
    if residual is not None:
        if offset > 0:
            residual = residual[:, offset:]
        g = g + residual.reshape(g.shape)
    return g if eps is None else tft_layer_norm(g, eps)


def tft_varselnet(x, context, blobs, n_inputs, n_flat, n_var, flat_skip, var_skip, axis):
    """VarSelNet: (sum_i softmax(s)_i GRN_i(x_i), s = GRN_flat(x[, context]))."""
    sparse = tft_grn(x, context, blobs[:n_flat], flat_skip, True, axis)
    weights = torch.softmax(sparse, dim=axis)
    parts = x.reshape(x.shape[0], n_inputs, -1)
    outs = []
    for i in range(n_inputs):
        at = n_flat + i * n_var
        outs.append(tft_grn(parts[:, i], None, blobs[at:at + n_var], var_skip, True, axis))
    processed = torch.stack(outs, dim=2)
    weighted = processed * weights.reshape(x.shape[0], 1, n_inputs)
    return weighted.to(torch.float64).sum(dim=2).to(x.dtype), sparse   # channel_sum adds in double


def tft_channel_embedding(num, cat, blobs, n_num, n_cat, cat_bias):
    """ChannelEmbedding: each numeric input through its InnerProduct, each categorical column through its Embed."""
    x = num if n_num else cat
    lead = (x.shape[0],) if x.dim() == 2 else (x.shape[0], x.shape[1])
    rows = 1
    for d in lead:
        rows *= d
    parts = []
    k = 0
    if n_num:
        cols = num.reshape(-1, n_num)
        for i in range(n_num):
            parts.append(tft_linear(cols[:, i].reshape(rows, -1), blobs[k], blobs[k + 1], 1))
            k += 2
    if n_cat:
        cols = cat.reshape(-1, n_cat)
        for i in range(n_cat):
            e = blobs[k][cols[:, i].to(torch.int64)]
            k += 1
            if cat_bias:
                e = e + blobs[k]
                k += 1
            parts.append(e)
    return torch.stack(parts, dim=1).reshape(list(lead) + [-1])


def tft_reshape_before(x, context, repeat, temporal):
    """ReshapeTemporal BEFORE: time stacked into the batch; the context repeated over time first (repeat > 0)."""
    top = x.reshape(x.shape[0] * x.shape[1], -1)
    if context is None:
        return top
    c = context.reshape(context.shape[0], -1)
    if repeat > 0:
        c = c.unsqueeze(1).expand(-1, repeat, -1) if temporal else c.unsqueeze(0).expand(repeat, -1, -1)
        return top, c.reshape(c.shape[0] * c.shape[1], -1)
    return top, context.reshape(context.shape[0] * context.shape[1], -1)


def tft_mha_interp(x, blobs, n_hist, n_fut, heads):
    """MultiheadAttentionInterp (self-attention): (ipOut(mean_h out_h), mean_h out_h, mean_h attention_h)."""
    n, steps = x.shape[0], x.shape[1]
    d = blobs[4].shape[0]
    q = tft_linear(x[:, n_hist:] if n_fut > 0 else x, blobs[0], blobs[1], 2)
    k = tft_linear(x, blobs[2], blobs[3], 2)
    v = tft_linear(x, blobs[4], blobs[5], 2)
    q = q.reshape(n, q.shape[1], heads, d).transpose(1, 2)
    k = k.reshape(n, steps, heads, d).transpose(1, 2)
    scores = q.matmul(k.transpose(2, 3)) * (1.0 / math.sqrt(d))
    rows = torch.arange(scores.shape[2], device=x.device).reshape(-1, 1)
    cols = torch.arange(steps, device=x.device).reshape(1, -1)
    masked = (cols - n_hist > rows) if n_fut > 0 else (cols > rows)
    scores = torch.where(masked, torch.full_like(scores, -1e29), scores)
    attn = torch.softmax(scores, dim=-1)
    out = attn.matmul(v.unsqueeze(1))
    mean_out, mean_attn = out[:, 0], attn[:, 0]
    for h in range(1, heads):   # added head by head, then scaled by 1 / heads
        mean_out = mean_out + out[:, h]
        mean_attn = mean_attn + attn[:, h]
    mean_out = mean_out * (1.0 / heads)
    return tft_linear(mean_out, blobs[6], blobs[7], 2), mean_out, mean_attn * (1.0 / heads)


TFT_TORCH = (tft_linear, tft_layer_norm, tft_glu, tft_grn)


class TftBlobs(nn.Module):
    """A MyCaffe TFT layer's blobs in MyCaffe's order, and the function its forward runs."""

    def __init__(self, shapes):
        super().__init__()
        self.blobs = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])


# ---- shapes and blob lists ------------------------------------------------------------------------------------

def ip_shapes(k, o, bias=True):
    return [(o, k), (o,)] if bias else [(o, k)]


def lead_and_width(shape, axis, what):
    if not 0 <= axis < len(shape):
        raise LayerError(f"{what}.axis {axis} is outside the {len(shape)}-axis bottom {list(shape)}")
    return tuple(shape[:axis]), count(shape, axis)


def grn_shapes(k, hidden, out, context_k=None):
    """A GRN's blobs: [skip], fc1, [context], fc2, GLU (fc1, fc2)."""
    shapes = ip_shapes(k, out) if k != out else []
    shapes += ip_shapes(k, hidden)
    if context_k is not None:
        shapes += ip_shapes(context_k, hidden, bias=False)
    return shapes + ip_shapes(hidden, out) + ip_shapes(out, out) * 2


def init_tft_blobs(shapes, rng):
    """Random blobs: weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2) (so that tests see them)."""
    out = []
    for s in shapes:
        scale = 1 / math.sqrt(max(1, count(s, 1))) if len(s) > 1 else 0.1
        out.append((rng.standard_normal(s) * scale).astype(np.float32))
    return out


def emit_tft_blobs(emit, node, shapes):
    m = emit.instance(TftBlobs, [tuple(s) for s in shapes])
    for i in range(len(shapes)):
        emit.param(f"blobs.{i}", i)
    return f"list({m}.blobs)"


# ---- ONNX pieces ----------------------------------------------------------------------------------------------

class TftOnnx:
    """ONNX emission of the pieces above on tensors with static shapes."""

    def __init__(self, ctx, node):
        self.ctx, self.node = ctx, node

    def linear(self, x, shape, wi, bi, axis):
        ctx = self.ctx
        w = ctx.weight(self.node, wi, transpose=True)
        o = int(np.asarray(self.node.blobs[wi]).shape[0])
        flat = ctx.op("Reshape", [x, ctx.i64(list(shape[:axis]) + [count(shape, axis)])], "flat")
        y = ctx.op("MatMul", [flat, w], "mm")
        if bi is not None:
            y = ctx.op("Add", [y, ctx.weight(self.node, bi)], "bias")
        return y, tuple(shape[:axis]) + (o,)

    def layer_norm(self, x, shape, eps):
        ctx = self.ctx
        axes = [1] if len(shape) == 2 else list(range(2, len(shape)))
        size = float(count(shape, axes[0]))
        xmu = ctx.op("Sub", [x, self.mean64(x, axes, size)], "xmu")
        var = self.mean64(ctx.op("Mul", [xmu, xmu], "sq"), axes, size)
        std = ctx.op("Sqrt", [ctx.op("Add", [var, ctx.f32(eps)], "var_eps")], "std")
        return ctx.op("Div", [xmu, std], "norm")

    def mean64(self, x, axes, size):
        """The mean over `axes`, summed in double (channel_mean), as float32."""
        ctx = self.ctx
        total = ctx.op("ReduceSum", [ctx.op("Cast", [x], "x64", to=11), ctx.i64(axes)], "sum64", keepdims=1)
        return ctx.op("Cast", [ctx.op("Div", [total, ctx.const(np.array(size, np.float64))], "mean64")], "mean", to=1)

    def glu(self, x, shape, first, bias, axis):
        step = 2 if bias else 1
        a, _ = self.linear(x, shape, first, first + 1 if bias else None, axis)
        b, out = self.linear(x, shape, first + step, first + step + 1 if bias else None, axis)
        return self.ctx.op("Mul", [b, self.ctx.op("Sigmoid", [a], "sig")], "glu"), out

    def grn(self, x, shape, context, cshape, first, skip, elu, axis):
        ctx = self.ctx
        i = first
        residual = x
        if skip:
            residual, _ = self.linear(x, shape, i, i + 1, axis)
            i += 2
        h, hshape = self.linear(x, shape, i, i + 1, axis)
        i += 2
        if context is not None:
            c, _ = self.linear(context, cshape, i, None, axis)
            h = ctx.op("Add", [h, ctx.op("Reshape", [c, ctx.i64(list(hshape))], "ctx")], "ctx_add")
            i += 1
        if elu:
            h = ctx.op("Where", [ctx.op("Greater", [h, ctx.f32(0.0)], "pos"), h,
                                 ctx.op("Sub", [ctx.op("Exp", [h], "exp"), ctx.f32(1.0)], "expm1")], "elu")
        else:
            h = ctx.op("Relu", [h], "relu")
        h, hshape = self.linear(h, hshape, i, i + 1, axis)
        g, gshape = self.glu(h, hshape, i + 2, True, axis)
        summed = ctx.op("Add", [g, ctx.op("Reshape", [residual, ctx.i64(list(gshape))], "res")], "sum")
        return self.layer_norm(summed, gshape, 1e-10), gshape


__all__ = ["TFT_TORCH", "TftBlobs", "TftOnnx", "emit_tft_blobs", "grn_shapes", "init_tft_blobs", "ip_shapes",
           "lead_and_width", "tft_channel_embedding", "tft_gate_add_norm", "tft_glu", "tft_grn", "tft_layer_norm",
           "tft_linear", "tft_mha_interp", "tft_reshape_before", "tft_varselnet"]
