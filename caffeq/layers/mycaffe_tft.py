"""MyCaffe (MyCaffe/MyCaffe b8922aa, C#): its Temporal Fusion Transformer layers at TEST / RUN.

Sources (facts read from the C#; no code carried over): MyCaffe.layers.tft/layers.tft/*.cs, MyCaffe/param.tft/*.cs,
the layers they build (MyCaffe/layers/InnerProductLayer.cs, ELULayer.cs, RecurrentLayer.cs, MyCaffe.layers.gpt/
layers.gpt/LayerNormLayer.cs) and CudaDnnDLL/Cuda Files/math.cu (channel_copy, channel_mulv, channel_sum, mask_batch).
Every inner InnerProduct is Caffe's (y = x flattened from `axis` times W^T (O, K) + b (O)); dropout is the identity
at TEST / RUN.  Inner layer norm (LayerNormLayer.cs forward_local): over the last axis of a 2-axis blob, else over
the axes from 2 on: (x - mean) / sqrt(var + eps), var the mean of the squares, no scale or shift.
  - DataTemporal (DataTemporalLayer.cs, RawFileData / DataNpy.GetShape): a data layer; tops ns (B, static numeric),
    cs (B, static categorical), nh / ch (B, T_hist, F), nf / cf (B, T_fut, F) (not with ignore_future_data),
    trg (B, T_fut, 1), then trgh, tm, msk (B, T_hist, 1) and ids (B, 1, 1, 1) as their output_* flags ask.  The
    feature counts live in the data set's schema: caffeq reads them from the num_input of the ChannelEmbedding
    layers that take the tops (a note says so; 0 where none), or --input-shape.
  - ChannelEmbedding (ChannelEmbeddingLayer.cs, NumericTransformationLayer.cs, CategoricalTransformationLayer.cs):
    bottoms numeric, categorical (a side with num_input 0 is ignored).  Numeric input i: every num_input-th value
    from i, rows of count(from axis 1 or 2) / num_input, through its own InnerProduct (state_size, bias); categorical
    input i: column i as an index into its Embed table (cardinality[i], state_size) (+ bias with bias_term).  Top
    (N[, T], (numeric + categorical inputs) x state_size), numeric blocks first; the two state_size must agree
    (MyCaffe sizes the top with the categorical one and fills it with the numeric one's stride).
  - GRN, MyCaffe's (GrnLayer.cs; chosen over FoodDist's by grn_param's input / hidden / output_dim): residual x (or
    a skip InnerProduct when input_dim != output_dim), h = fc1(x) (+ context(c) without bias, a second bottom), ELU
    (alpha 1, exp(h) - 1) or ReLU, fc2, GLU, then layer norm (eps 1e-10) of GLU + residual.  Blobs: [skip w, b],
    fc1 w, b, [context w], fc2 w, b, GLU's four.
  - GLU (GluLayer.cs, inside GRN and GateAddNorm): fc2(x) * sigmoid(fc1(x)), both input_dim wide.
  - GateAddNorm (GateAddNormLayer.cs): layer norm (layer_norm_param.epsilon) of GLU(x) + residual, the residual
    bottom 1 from channel residual_channel_offset on (channel_copy of the last block), none with one bottom;
    layer_norm_param.enable_passthrough leaves the norm out (LayerNormLayer.forward copies its bottom).
  - VarSelNet (VarSelNetLayer.cs): x (N, num_inputs x input_dim); s = GRN_flat(x[, context]) (num_inputs x
    input_dim -> hidden -> num_inputs), w = softmax(s) over varselnet_param.axis; top 0 = sum_i w_i GRN_i(x_i)
    (input_dim -> hidden -> hidden), top 1 = s (before the softmax, as the C# copies it).  input_dim must equal
    hidden_dim: MyCaffe stacks the GRN_i outputs with input_dim's stride (channel_copy with m_blobGrn1.channels),
    which leaves part of the weighted sum unwritten otherwise.
  - ReshapeTemporal (ReshapeTemporalLayer.cs): BEFORE stacks time into the batch ((N, T, ...) -> (N T, count(2)))
    and repeats a (N, C) context bottom over T (forced_repeat_count < 0: (N, T, C); >= 0: (R, N, C) copies) before
    stacking it the same way (repeat 0: stacked as it is); AFTER reshapes back to (N, T, C) with N and T that
    MyCaffe passes along in blob parameters (Layer.Setup copies bottom i's to top i): caffeq traces them to the
    BEFORE layer's top 0 (through the tops' bottoms of the same index; an earlier BEFORE's reaching that BEFORE's
    bottom 0 win, as Setup copies them last) and gives the AFTER layer that BEFORE layer's input as a third,
    shape-only bottom (a note says so; only ReshapeTemporal AFTER layers, a type only MyCaffe has, are touched).
    Its clip top is all ones.
  - MultiheadAttentionInterp (MultiHeadAttentionInterpLayer.cs), self-attention on x (N, T_hist + T_fut, D): q from
    the last T_fut steps through ipQ (heads x D), k through ipK (heads x D), v through ipV (D, shared by the heads);
    per head softmax(q k^T / sqrt(D), masked to -1e29 where key step - T_hist > query step) v; tops: ipOut(mean over
    heads of the outputs) (N, T_fut, D), that mean (N, T_fut, D), the heads' mean attention (N, T_fut, T).
  - Lstm (RecurrentLayer.cs, engine CUDNN): read and sized (top (N, T, H) with batch_first, hidden and cell
    (num_layers, N, H, 1)); its weights are one cuDNN-packed blob whose layout the cuDNN library decides, so it is
    not run.
  - QuantileLoss / QuantileAccuracy (QuantileLossLayer.cs, QuantileAccuracyLayer.cs): training and evaluation only.
"""
import math

import numpy as np
import torch
from torch import nn

from ..errors import ExportError
from ..io.schema import caffe_pb2
from .registry import (
    Layer,
    LayerError,
    ReadOnlyLayer,
    claim_layers,
    count,
    need_blobs,
    needs_input_shape,
    net_rewrite,
    positive_field,
    register_layer,
    torch_sources,
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


_TORCH = (tft_linear, tft_layer_norm, tft_glu, tft_grn)


class TftBlobs(nn.Module):
    """A MyCaffe TFT layer's blobs in MyCaffe's order, and the function its forward runs."""

    def __init__(self, shapes):
        super().__init__()
        self.blobs = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])


# ---- shapes and blob lists ------------------------------------------------------------------------------------

def _ip_shapes(k, o, bias=True):
    return [(o, k), (o,)] if bias else [(o, k)]


def _lead(shape, axis, what):
    if not 0 <= axis < len(shape):
        raise LayerError(f"{what}.axis {axis} is outside the {len(shape)}-axis bottom {list(shape)}")
    return tuple(shape[:axis]), count(shape, axis)


def _grn_shapes(k, hidden, out, context_k=None):
    """A GRN's blobs: [skip], fc1, [context], fc2, GLU (fc1, fc2)."""
    shapes = _ip_shapes(k, out) if k != out else []
    shapes += _ip_shapes(k, hidden)
    if context_k is not None:
        shapes += _ip_shapes(context_k, hidden, bias=False)
    return shapes + _ip_shapes(hidden, out) + _ip_shapes(out, out) * 2


def _init_tft(shapes, rng):
    """Random blobs: weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2) (so that tests see them)."""
    out = []
    for s in shapes:
        scale = 1 / math.sqrt(max(1, count(s, 1))) if len(s) > 1 else 0.1
        out.append((rng.standard_normal(s) * scale).astype(np.float32))
    return out


def _emit_blobs(emit, node, shapes):
    m = emit.instance(TftBlobs, [tuple(s) for s in shapes])
    for i in range(len(shapes)):
        emit.param(f"blobs.{i}", i)
    return f"list({m}.blobs)"


# ---- ONNX pieces ----------------------------------------------------------------------------------------------

class _Onnx:
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


# ---- DataTemporal ---------------------------------------------------------------------------------------------

_FEATURE_TOPS = ("ns", "cs", "nh", "ch", "nf", "cf")


def _data_temporal_tops(p):
    names = ["ns", "cs", "nh", "ch"] + ([] if p.ignore_future_data else ["nf", "cf"]) + ["trg"]
    names += [n for n, f in (("trgh", p.output_target_historical), ("tm", p.output_time), ("msk", p.output_mask),
                             ("ids", p.output_item_ids)) if f]
    return names


@register_layer("DataTemporal")
class DataTemporal(Layer):
    is_data = True

    def parse(self, lp):
        p = lp.data_temporal_param
        roles = _data_temporal_tops(p)
        need_blobs(lp, "DataTemporal (" + ", ".join(roles) + ")", 0, len(roles))
        attrs = {"name": lp.name, "tops": list(lp.top), "roles": roles, "source": p.source,
                 "batch": positive_field(p.batch_size, "data_temporal_param.batch_size"),
                 "hist": positive_field(p.num_historical_steps, "data_temporal_param.num_historical_steps"),
                 "fut": int(p.num_future_steps), "features": {}}
        for s, role in zip(lp.input_param.shape, roles):   # the feature counts mycaffe_tft_net found
            if role in _FEATURE_TOPS and len(s.dim) and s.dim[-1] >= 0:
                attrs["features"][role] = int(s.dim[-1])
        return attrs

    def infer(self, attrs, in_shapes):
        return self.top_shapes(attrs, {})

    def top_shapes(self, attrs, given):
        b, th, tf = attrs["batch"], attrs["hist"], attrs["fut"]
        lead = {"ns": (b,), "cs": (b,), "nh": (b, th), "ch": (b, th), "nf": (b, tf), "cf": (b, tf)}
        out = []
        for i, role in enumerate(attrs["roles"]):
            if given.get(i) is not None:
                out.append(tuple(given[i]))
            elif role in lead:
                if role not in attrs["features"]:
                    raise needs_input_shape(attrs, attrs["tops"][i], "its feature count lives in the data set's "
                                            "schema and no ChannelEmbedding layer takes it")
                out.append(lead[role] + (attrs["features"][role],))
            elif role == "trg":
                out.append((b, tf, 1))
            elif role == "ids":
                out.append((b, 1, 1, 1))
            else:
                out.append((b, th, 1))
        return out

    def preprocessing(self, attrs):
        return [f"MyCaffe's temporal data set {attrs['source']!r} (numpy files or its SQL database): static, "
                f"historical ({attrs['hist']} steps) and future ({attrs['fut']} steps) numeric and categorical "
                f"values, as its preprocessing scripts wrote them"]


def _producers(net):
    made = {}
    for i, lp in enumerate(net.layer):
        for t in lp.top:
            made.setdefault(t, []).append(i)
    return made


def _feature_counts(net, lp):
    """{role: count} from the ChannelEmbedding layers that take lp's tops."""
    roles = dict(zip(lp.top, _data_temporal_tops(lp.data_temporal_param)))
    found = {}
    for other in net.layer:
        if other.type != "ChannelEmbedding" or len(other.bottom) != 2:
            continue
        for b, n in zip(other.bottom, (other.numeric_trans_param.num_input, other.categorical_trans_param.num_input)):
            if roles.get(b) in _FEATURE_TOPS:
                found.setdefault(roles[b], int(n))
    return found


def _before_source(net, index, blob):
    """The (N, T, ...) bottom of the ReshapeTemporal BEFORE whose blob parameters reach `blob`, read by layer
    `index` (Layer.Setup copies bottom i's parameters to top i), or None."""
    made = _producers(net)
    while True:
        earlier = [i for i in made.get(blob, []) if i < index]
        if not earlier:
            return None
        index = earlier[-1]
        lp = net.layer[index]
        k = list(lp.top).index(blob)
        if lp.type == "ReshapeTemporal" and lp.reshape_temporal_param.mode == caffe_pb2.ReshapeTemporalParameter.BEFORE:
            if k:
                return None
            # Setup sets the parameters, then copies bottom 0's over them: an earlier BEFORE's win
            return _before_source(net, index, lp.bottom[0]) or lp.bottom[0]
        if k >= len(lp.bottom):
            return None
        blob = lp.bottom[k]


@net_rewrite
def mycaffe_tft_net(net, source=""):
    """DataTemporal's feature counts from the ChannelEmbedding layers; ReshapeTemporal AFTER's N and T from its
    BEFORE layer's input, given as a third, shape-only bottom."""
    where = f"{source + ': ' if source else ''}"
    notes = []
    for index, lp in enumerate(net.layer):
        if lp.type == "DataTemporal" and not len(lp.input_param.shape):
            counts = _feature_counts(net, lp)
            for role in _data_temporal_tops(lp.data_temporal_param)[:len(lp.top)]:
                lp.input_param.shape.add(dim=[counts.get(role, -1)] if role in _FEATURE_TOPS else [])
            if counts:
                notes.append(f"{where}layer '{lp.name}' (DataTemporal): the feature counts of its tops read from the "
                             f"ChannelEmbedding layers that take them ({', '.join(f'{r} {n}' for r, n in counts.items())}"
                             f"); MyCaffe reads them from the data set's schema")
        if (lp.type == "ReshapeTemporal" and lp.reshape_temporal_param.mode == caffe_pb2.ReshapeTemporalParameter.AFTER
                and len(lp.bottom) in (1, 2)):
            src = _before_source(net, index, lp.bottom[0])
            if src is None:
                continue
            if len(lp.bottom) == 1:
                lp.bottom.append(lp.bottom[0])
            lp.bottom.append(src)
            notes.append(f"{where}layer '{lp.name}' (ReshapeTemporal AFTER): its num_samples and num_temporal_steps "
                         f"(MyCaffe's blob parameters) taken from '{src}', the input of the BEFORE layer they come "
                         f"from, given to it as a shape-only bottom")
    return list(dict.fromkeys(notes))


# ---- ChannelEmbedding -----------------------------------------------------------------------------------------

@register_layer("ChannelEmbedding")
class ChannelEmbedding(Layer):

    def parse(self, lp):
        need_blobs(lp, "ChannelEmbedding", 2, 1, "numeric, categorical")
        n, c = lp.numeric_trans_param, lp.categorical_trans_param
        attrs = {"name": lp.name, "n_num": int(n.num_input), "n_cat": int(c.num_input), "cards": [int(v) for v in c.cardinality],
                 "bias": bool(c.bias_term), "state": int(c.state_size)}
        if not attrs["n_num"] and not attrs["n_cat"]:
            raise LayerError("ChannelEmbedding: numeric_trans_param.num_input or categorical_trans_param.num_input "
                             "must be > 0")
        if attrs["n_cat"] and len(attrs["cards"]) != attrs["n_cat"]:
            raise LayerError(f"categorical_trans_param gives {len(attrs['cards'])} cardinality values for "
                             f"num_input {attrs['n_cat']}")
        if int(n.state_size) != attrs["state"]:   # the top is sized with the one and filled with the other
            raise LayerError(f"numeric_trans_param.state_size {n.state_size} and categorical_trans_param.state_size "
                             f"{c.state_size} differ (MyCaffe sizes the top with the one, fills it with the other)")
        positive_field(attrs["state"], "categorical_trans_param.state_size")
        if any(v < 1 for v in attrs["cards"]):
            raise LayerError(f"categorical_trans_param.cardinality must be >= 1, got {attrs['cards']}")
        return attrs

    def infer(self, attrs, in_shapes):
        num, cat = in_shapes
        used = [s for s, k in ((num, attrs["n_num"]), (cat, attrs["n_cat"])) if k]
        if len({len(s) for s in used}) > 1 or len({s[:-1] for s in used}) > 1:
            raise LayerError(f"ChannelEmbedding: the numeric {list(num)} and categorical {list(cat)} bottoms must "
                             f"share their leading axes")
        s = used[0]
        if len(s) not in (2, 3):
            raise LayerError(f"ChannelEmbedding takes (N, F) or (N, T, F) bottoms, got {list(s)}")
        if attrs["n_num"] and num[-1] % attrs["n_num"]:
            raise LayerError(f"ChannelEmbedding: the numeric bottom's {num[-1]} values per row do not split into "
                             f"num_input {attrs['n_num']}")
        if attrs["n_cat"] and cat[-1] != attrs["n_cat"]:
            raise LayerError(f"ChannelEmbedding: the categorical bottom has {cat[-1]} columns for num_input "
                             f"{attrs['n_cat']}")
        attrs["_spatial"] = num[-1] // attrs["n_num"] if attrs["n_num"] else 0
        return [tuple(s[:-1]) + ((attrs["n_num"] + attrs["n_cat"]) * attrs["state"],)]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        e = attrs["state"]
        shapes = _ip_shapes(attrs["_spatial"], e) * attrs["n_num"]
        for card in attrs["cards"]:
            shapes += [(card, e)] + ([(e,)] if attrs["bias"] else [])
        return shapes

    def init_params(self, attrs, shapes, rng):
        return _init_tft(shapes, rng)

    def cannot_run(self, attrs, in_shapes):
        if attrs["n_cat"] > 1 and len(in_shapes[1]) == 2:
            return ("a 2-axis categorical bottom with several inputs: MyCaffe's channel_copy reads it with the "
                    "bottom's channels as time steps, across the samples")
        return None

    def forward(self, attrs, params, num, cat):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(num.shape), tuple(cat.shape)], LayerError)
        return tft_channel_embedding(num, cat, list(params), attrs["n_num"], attrs["n_cat"], attrs["bias"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(0), emit.in_shape(1)], ExportError)
        emit.helper(torch_sources(tft_linear))
        blobs = _emit_blobs(emit, node, [b.shape for b in node.blobs])
        return (f"{emit.helper(tft_channel_embedding)}({emit.inputs[0]}, {emit.inputs[1]}, {blobs}, {a['n_num']}, "
                f"{a['n_cat']}, {a['bias']})")

    def onnx(self, ctx, node):
        a = node.attrs
        num, cat = node.inputs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(num), ctx.shape(cat)], ExportError)
        b = _Onnx(ctx, node)
        s = ctx.shape(num) if a["n_num"] else ctx.shape(cat)
        rows = count(s, 0, len(s) - 1)
        parts, k = [], 0
        if a["n_num"]:
            cols = ctx.op("Reshape", [num, ctx.i64([-1, a["n_num"]])], "num_cols")
            for i in range(a["n_num"]):
                col = ctx.op("Gather", [cols, ctx.i64(i)], f"num{i}", axis=1)
                y, _ = b.linear(col, (rows, a["_spatial"]), k, k + 1, 1)
                parts.append(y)
                k += 2
        if a["n_cat"]:
            cols = ctx.op("Reshape", [cat, ctx.i64([-1, a["n_cat"]])], "cat_cols")
            for i in range(a["n_cat"]):
                col = ctx.op("Gather", [cols, ctx.i64(i)], f"cat{i}", axis=1)
                idx = ctx.op("Cast", [ctx.trunc(col)], f"idx{i}", to=7)
                y = ctx.op("Gather", [ctx.weight(node, k), idx], f"emb{i}", axis=0)
                k += 1
                if a["bias"]:
                    y = ctx.op("Add", [y, ctx.weight(node, k)], f"emb_b{i}")
                    k += 1
                parts.append(y)
        stacked = [ctx.op("Unsqueeze", [p, ctx.i64([1])], "unsq") for p in parts]
        cat_all = ctx.op("Concat", stacked, "blocks", axis=1) if len(stacked) > 1 else stacked[0]
        ctx.add_node("Reshape", [cat_all, ctx.i64(list(ctx.shape(node.outputs[0])))], [node.outputs[0]],
                     name=node.name)


# ---- GRN (MyCaffe's) ------------------------------------------------------------------------------------------

_GRN_FIELDS = ("input_dim", "hidden_dim", "output_dim", "context_dim", "activation", "axis", "batch_first",
               "weight_filler", "bias_filler", "dropout_ratio", "enable_noise", "sigma_init")


def _mycaffe_grn(lp):
    """MyCaffe's GRN sets its grn_param's dimensions; FoodDist's (GRN normalization) sets bias only."""
    p = lp.grn_param
    return any(f in p.DESCRIPTOR.fields_by_name and p.HasField(f) for f in _GRN_FIELDS)


@claim_layers("GRN", _mycaffe_grn)
class MyCaffeGRN(Layer):

    def parse(self, lp):
        need_blobs(lp, "GRN (MyCaffe)", (1, 2), 1, "x, context")
        p = lp.grn_param
        attrs = {"in": positive_field(p.input_dim, "grn_param.input_dim"),
                 "hidden": positive_field(p.hidden_dim, "grn_param.hidden_dim"),
                 "out": positive_field(p.output_dim, "grn_param.output_dim"),
                 "axis": int(p.axis), "elu": p.activation == caffe_pb2.GRNParameter.ELU,
                 "context": len(lp.bottom) > 1}
        if p.enable_noise:
            attrs["reading_notes"] = ["grn_param.enable_noise: the noise only trains; TEST / RUN use the weights"]
        return attrs

    def _check(self, attrs, in_shapes):
        x = in_shapes[0]
        axis = attrs["axis"] if attrs["axis"] >= 0 else attrs["axis"] + len(x)
        lead, k = _lead(x, axis, "grn_param")
        if k != attrs["in"]:
            raise LayerError(f"GRN: the bottom {list(x)} has {k} values from axis {axis}, grn_param.input_dim is "
                             f"{attrs['in']}")
        ck = None
        if attrs["context"]:
            c = in_shapes[1]
            clead, ck = _lead(c, axis, "grn_param")
            if count(clead) != count(lead):
                raise LayerError(f"GRN: the context {list(c)} projects to {count(clead)} rows, the input to "
                                 f"{count(lead)}")
        return axis, lead, ck

    def infer(self, attrs, in_shapes):
        axis, lead, _ = self._check(attrs, in_shapes)
        attrs["_axis"] = axis
        return [lead + (attrs["out"],)]

    def param_shapes(self, attrs, in_shapes):
        _, _, ck = self._check(attrs, in_shapes)
        return _grn_shapes(attrs["in"], attrs["hidden"], attrs["out"], ck)

    def init_params(self, attrs, shapes, rng):
        return _init_tft(shapes, rng)

    def forward(self, attrs, params, x, context=None):
        return tft_grn(x, context, list(params), attrs["in"] != attrs["out"], attrs["elu"], attrs["_axis"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(torch_sources(*_TORCH))
        blobs = _emit_blobs(emit, node, [b.shape for b in node.blobs])
        ctx = emit.inputs[1] if a["context"] else "None"
        return f"tft_grn({emit.inputs[0]}, {ctx}, {blobs}, {a['in'] != a['out']}, {a['elu']}, {a['_axis']})"

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        c = node.inputs[1] if a["context"] else None
        y, _ = _Onnx(ctx, node).grn(x, ctx.shape(x), c, ctx.shape(c) if c else None, 0, a["in"] != a["out"],
                                    a["elu"], a["_axis"])
        ctx.add_node("Identity", [y], [node.outputs[0]], name=node.name)


# ---- GateAddNorm ----------------------------------------------------------------------------------------------

@register_layer("GateAddNorm")
class GateAddNorm(Layer):

    def parse(self, lp):
        need_blobs(lp, "GateAddNorm", (1, 2), 1, "x, residual")
        g = lp.glu_param
        if g.modulation != caffe_pb2.GluParameter.SIGMOID:
            raise LayerError("glu_param.modulation: only SIGMOID exists")
        return {"dim": positive_field(g.input_dim, "glu_param.input_dim"), "axis": int(g.axis),
                "bias": bool(g.bias_term), "offset": int(lp.gateaddnorm_param.residual_channel_offset),
                "eps": None if lp.layer_norm_param.enable_passthrough else float(lp.layer_norm_param.epsilon),
                "residual": len(lp.bottom) > 1}

    def infer(self, attrs, in_shapes):
        x = in_shapes[0]
        axis = attrs["axis"] if attrs["axis"] >= 0 else attrs["axis"] + len(x)
        lead, k = _lead(x, axis, "glu_param")
        attrs["_axis"], attrs["_k"] = axis, k
        top = lead + (attrs["dim"],)
        if attrs["residual"]:
            r = in_shapes[1]
            if attrs["offset"] > 0:
                if len(r) < 2 or r[1] <= attrs["offset"] or r[1] % (r[1] - attrs["offset"]):
                    raise LayerError(f"GateAddNorm: gateaddnorm_param.residual_channel_offset {attrs['offset']} must "
                                     f"leave a part of the residual's {r[1] if len(r) > 1 else '?'} channels that "
                                     f"divides them")
                size = r[0] * (r[1] - attrs["offset"]) * count(r, 2)
            else:
                size = count(r)
            if size != count(top):
                raise LayerError(f"GateAddNorm: the residual {list(r)} (from channel {attrs['offset']}) does not match "
                                 f"the gate's {list(top)}")
        return [top]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        return _ip_shapes(attrs["_k"], attrs["dim"], attrs["bias"]) * 2

    def init_params(self, attrs, shapes, rng):
        return _init_tft(shapes, rng)

    def forward(self, attrs, params, x, residual=None):
        return tft_gate_add_norm(x, residual, list(params), attrs["bias"], attrs["_axis"], attrs["offset"],
                                 attrs["eps"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(torch_sources(tft_linear, tft_layer_norm, tft_glu))
        blobs = _emit_blobs(emit, node, [b.shape for b in node.blobs])
        res = emit.inputs[1] if a["residual"] else "None"
        return (f"{emit.helper(tft_gate_add_norm)}({emit.inputs[0]}, {res}, {blobs}, {a['bias']}, {a['_axis']}, "
                f"{a['offset']}, {a['eps']!r})")

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        b = _Onnx(ctx, node)
        g, gshape = b.glu(x, ctx.shape(x), 0, a["bias"], a["_axis"])
        if a["residual"]:
            r = node.inputs[1]
            if a["offset"] > 0:
                rs = ctx.shape(r)
                r = ctx.op("Slice", [r, ctx.i64([a["offset"]]), ctx.i64([rs[1]]), ctx.i64([1])], "res_part")
            g = ctx.op("Add", [g, ctx.op("Reshape", [r, ctx.i64(list(gshape))], "res")], "sum")
        if a["eps"] is not None:
            g = b.layer_norm(g, gshape, a["eps"])
        ctx.add_node("Identity", [g], [node.outputs[0]], name=node.name)


# ---- VarSelNet ------------------------------------------------------------------------------------------------

@register_layer("VarSelNet")
class VarSelNet(Layer):

    def parse(self, lp):
        need_blobs(lp, "VarSelNet", (1, 2), (1, 2), "x, context")
        p = lp.varselnet_param
        attrs = {"in": positive_field(p.input_dim, "varselnet_param.input_dim"),
                 "hidden": positive_field(p.hidden_dim, "varselnet_param.hidden_dim"),
                 "n": positive_field(p.num_inputs, "varselnet_param.num_inputs"), "axis": int(p.axis),
                 "context": len(lp.bottom) > 1, "tops": len(lp.top)}
        if attrs["axis"] != 1:
            raise LayerError(f"varselnet_param.axis {attrs['axis']}: caffeq reads MyCaffe's (N, features) form, axis 1")
        if attrs["in"] != attrs["hidden"]:
            raise LayerError(f"VarSelNet: varselnet_param.input_dim {attrs['in']} != hidden_dim {attrs['hidden']}: "
                             f"MyCaffe stacks the per-input GRN outputs with input_dim's stride and leaves part of "
                             f"the weighted sum unwritten (its nets use input_dim = hidden_dim)")
        return attrs

    def _shapes(self, attrs, in_shapes):
        x = in_shapes[0]
        flat = attrs["n"] * attrs["in"]
        if len(x) != 2 or x[1] != flat:
            raise LayerError(f"VarSelNet needs a (N, num_inputs x input_dim = {flat}) bottom, got {list(x)}")
        ck = None
        if attrs["context"]:
            c = in_shapes[1]
            if len(c) < 2 or c[0] != x[0]:
                raise LayerError(f"VarSelNet: the context {list(c)} must have the bottom's {x[0]} rows")
            ck = count(c, 1)
        attrs["_flat"] = len(_grn_shapes(flat, attrs["hidden"], attrs["n"], ck))
        attrs["_var"] = len(_grn_shapes(attrs["in"], attrs["hidden"], attrs["hidden"]))
        return (_grn_shapes(flat, attrs["hidden"], attrs["n"], ck)
                + _grn_shapes(attrs["in"], attrs["hidden"], attrs["hidden"]) * attrs["n"])

    def infer(self, attrs, in_shapes):
        self._shapes(attrs, in_shapes)
        n = in_shapes[0][0]
        return [(n, attrs["hidden"]), (n, attrs["n"])][:attrs["tops"]]

    def param_shapes(self, attrs, in_shapes):
        return self._shapes(attrs, in_shapes)

    def init_params(self, attrs, shapes, rng):
        return _init_tft(shapes, rng)

    def _args(self, a):
        return (a["n"], a["_flat"], a["_var"], a["n"] * a["in"] != a["n"], a["in"] != a["hidden"], 1)

    def forward(self, attrs, params, x, context=None):
        out = tft_varselnet(x, context, list(params), *self._args(attrs))
        return list(out[:attrs["tops"]]) if attrs["tops"] > 1 else out[0]

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(torch_sources(*_TORCH))
        blobs = _emit_blobs(emit, node, [b.shape for b in node.blobs])
        ctx = emit.inputs[1] if a["context"] else "None"
        call = f"{emit.helper(tft_varselnet)}({emit.inputs[0]}, {ctx}, {blobs}, {', '.join(map(str, self._args(a)))})"
        if a["tops"] == 1:
            return f"{call}[0]"
        t = emit.tmp("vsn")
        emit.stmt(f"{t} = {call}")
        return [f"{t}[0]", f"{t}[1]"]

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        xs = ctx.shape(x)
        n_inputs, n_flat, n_var, flat_skip, var_skip, axis = self._args(a)
        b = _Onnx(ctx, node)
        c = node.inputs[1] if a["context"] else None
        sparse, _ = b.grn(x, xs, c, ctx.shape(c) if c else None, 0, flat_skip, True, axis)
        weights = ctx.op("Softmax", [sparse], "weights", axis=1)
        parts = ctx.op("Reshape", [x, ctx.i64([xs[0], n_inputs, a["in"]])], "parts")
        outs = []
        for i in range(n_inputs):
            xi = ctx.op("Gather", [parts, ctx.i64(i)], f"x{i}", axis=1)
            g, _ = b.grn(xi, (xs[0], a["in"]), None, None, n_flat + i * n_var, var_skip, True, axis)
            outs.append(ctx.op("Unsqueeze", [g, ctx.i64([2])], f"g{i}"))
        processed = ctx.op("Concat", outs, "processed", axis=2) if len(outs) > 1 else outs[0]
        w = ctx.op("Reshape", [weights, ctx.i64([xs[0], 1, n_inputs])], "w")
        weighted = ctx.op("Cast", [ctx.op("Mul", [processed, w], "weighted")], "weighted64", to=11)
        summed = ctx.op("ReduceSum", [weighted, ctx.i64([2])], "sum64", keepdims=0)
        ctx.add_node("Cast", [summed], [node.outputs[0]], name=node.name, to=1)
        if a["tops"] > 1:
            ctx.add_node("Identity", [sparse], [node.outputs[1]], name=node.name + "_sparse")


# ---- ReshapeTemporal ------------------------------------------------------------------------------------------

@register_layer("ReshapeTemporal")
class ReshapeTemporal(Layer):

    def parse(self, lp):
        p = lp.reshape_temporal_param
        before = p.mode == caffe_pb2.ReshapeTemporalParameter.BEFORE
        attrs = {"name": lp.name, "before": before, "clip": bool(p.enable_clip_output),
                 "forced": int(p.forced_repeat_count), "tops": len(lp.top), "bottoms": len(lp.bottom)}
        if before:
            need_blobs(lp, "ReshapeTemporal BEFORE", (1, 2), len(lp.bottom), "x, context")
        else:
            if p.enable_weight_output:
                raise LayerError("reshape_temporal_param.enable_weight_output (AFTER) is not read by caffeq")
            if len(lp.bottom) != 3:
                raise LayerError(f"ReshapeTemporal AFTER: cannot tell the num_samples and num_temporal_steps that "
                                 f"MyCaffe passes along in blob parameters: no ReshapeTemporal BEFORE layer's top "
                                 f"reaches bottom '{lp.bottom[0]}'")
            need_blobs(lp, "ReshapeTemporal AFTER", 3, 1 + attrs["clip"])
        return attrs

    def infer(self, attrs, in_shapes):
        x = in_shapes[0]
        if attrs["before"]:
            if len(x) < 2:
                raise LayerError(f"ReshapeTemporal BEFORE needs a (N, T, ...) bottom, got {list(x)}")
            tops = [(x[0] * x[1], count(x, 2))]
            if attrs["bottoms"] > 1:
                c = in_shapes[1]
                repeat = attrs["forced"] if attrs["forced"] >= 0 else x[1]
                attrs["_repeat"] = repeat
                if len(c) < 2:
                    raise LayerError(f"ReshapeTemporal BEFORE: the context {list(c)} needs two axes at least")
                if repeat > 0:
                    # replicate_along_time sizes its blob (N of the bottom, repeat, context.shape(1)) and copies
                    # count(1) values per sample: a context of other samples or more axes does not fit it
                    if c[0] != x[0] or c[1] != count(c, 1):
                        raise LayerError(f"ReshapeTemporal BEFORE: repeating the context {list(c)} needs a "
                                         f"({x[0]}, C) context (the bottom's {x[0]} samples)")
                    tops.append((c[0] * repeat, count(c, 1)))
                else:
                    tops.append((c[0] * c[1], count(c, 2)))
            return tops
        src = in_shapes[2]
        if len(src) < 2:
            raise LayerError(f"ReshapeTemporal AFTER: the BEFORE layer's input {list(src)} has no time axis")
        n, t = src[0], src[1]
        if count(x) % (n * t):
            raise LayerError(f"ReshapeTemporal AFTER: {count(x)} values do not split into {n} samples x {t} steps")
        return [(n, t, count(x) // (n * t))] + ([(n, t)] if attrs["clip"] else [])

    def forward(self, attrs, params, x, *rest):
        if attrs["before"]:
            if attrs["bottoms"] == 1:
                return tft_reshape_before(x, None, 0, True)
            return list(tft_reshape_before(x, rest[0], attrs["_repeat"], attrs["forced"] < 0))
        n, t = rest[1].shape[0], rest[1].shape[1]
        top = x.reshape(n, t, -1)
        return [top, x.new_ones((n, t))] if attrs["clip"] else top

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        if a["before"]:
            fn = emit.helper(tft_reshape_before)
            if a["bottoms"] == 1:
                return f"{fn}({x}, None, 0, True)"
            t = emit.tmp("rt")
            emit.stmt(f"{t} = {fn}({x}, {emit.inputs[1]}, {a['_repeat']}, {a['forced'] < 0})")
            return [f"{t}[0]", f"{t}[1]"]
        s = emit.out_shape(0)
        src = emit.inputs[2]
        top = f"{x}.reshape({src}.shape[0], {src}.shape[1], {s[2]})"
        if a["clip"]:
            return [top, f"{x}.new_ones(({src}.shape[0], {src}.shape[1]))"]
        return top

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        ctx.add_node("Reshape", [x, ctx.i64(list(ctx.shape(node.outputs[0])))], [node.outputs[0]], name=node.name)
        if a["before"] and a["bottoms"] > 1:
            c = node.inputs[1]
            cs = ctx.shape(c)
            repeat = a["_repeat"]
            if repeat > 0:
                flat = ctx.op("Reshape", [c, ctx.i64([cs[0], count(cs, 1)])], "ctx")
                if a["forced"] < 0:
                    rep = ctx.op("Expand", [ctx.op("Unsqueeze", [flat, ctx.i64([1])], "u"),
                                            ctx.i64([cs[0], repeat, count(cs, 1)])], "rep")
                else:
                    rep = ctx.op("Expand", [ctx.op("Unsqueeze", [flat, ctx.i64([0])], "u"),
                                            ctx.i64([repeat, cs[0], count(cs, 1)])], "rep")
                c = rep
            ctx.add_node("Reshape", [c, ctx.i64(list(ctx.shape(node.outputs[1])))], [node.outputs[1]],
                         name=node.name + "_context")
        elif a["clip"]:
            ctx.add_node("Identity", [ctx.const(np.ones(ctx.shape(node.outputs[1]), np.float32))], [node.outputs[1]],
                         name=node.name + "_clip")


# ---- MultiheadAttentionInterp -----------------------------------------------------------------------------------

@register_layer("MultiheadAttentionInterp")
class MultiheadAttentionInterp(Layer):

    def parse(self, lp):
        p = lp.multihead_attention_interp_param
        if not p.enable_self_attention or len(lp.bottom) != 1:
            raise LayerError("MultiheadAttentionInterp: caffeq reads its self-attention form (one bottom; MyCaffe's "
                             "setup refuses three and checks for one or four)")
        need_blobs(lp, "MultiheadAttentionInterp", 1, 3, "x")
        attrs = {"d": positive_field(p.embed_dim, "multihead_attention_interp_param.embed_dim"),
                 "heads": positive_field(p.num_heads, "multihead_attention_interp_param.num_heads"),
                 "hist": int(p.num_historical_steps), "fut": int(p.num_future_steps)}
        if attrs["fut"] > 0 and (attrs["hist"] < 1 or attrs["hist"] % attrs["fut"]):
            raise LayerError(f"multihead_attention_interp_param.num_historical_steps {attrs['hist']} must be a "
                             f"multiple (>= 1) of num_future_steps {attrs['fut']}")
        if attrs["fut"] == 0 and attrs["hist"] < 1:
            raise LayerError("multihead_attention_interp_param.num_historical_steps must be >= 1")
        return attrs

    def infer(self, attrs, in_shapes):
        x = in_shapes[0]
        steps = attrs["hist"] + attrs["fut"]
        if len(x) != 3 or x[1] != steps:
            raise LayerError(f"MultiheadAttentionInterp needs a (N, num_historical_steps + num_future_steps = {steps}, "
                             f"D) bottom, got {list(x)}")
        q = attrs["fut"] or attrs["hist"]
        return [(x[0], q, attrs["d"]), (x[0], q, attrs["d"]), (x[0], q, steps)]

    def param_shapes(self, attrs, in_shapes):
        k, d, hd = in_shapes[0][2], attrs["d"], attrs["d"] * attrs["heads"]
        return _ip_shapes(k, hd) * 2 + _ip_shapes(k, d) + _ip_shapes(d, d)

    def init_params(self, attrs, shapes, rng):
        return _init_tft(shapes, rng)

    def macs(self, attrs, in_shapes, out_shapes):
        n, t, k = in_shapes[0]
        q, hd = out_shapes[0][1], attrs["d"] * attrs["heads"]
        return n * (q * k * hd + t * k * hd + t * k * attrs["d"] + 2 * q * t * hd + q * attrs["d"] ** 2)

    def forward(self, attrs, params, x):
        return list(tft_mha_interp(x, list(params), attrs["hist"], attrs["fut"], attrs["heads"]))

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(torch_sources(tft_linear))
        blobs = _emit_blobs(emit, node, [b.shape for b in node.blobs])
        t = emit.tmp("mha")
        emit.stmt(f"{t} = {emit.helper(tft_mha_interp)}({emit.inputs[0]}, {blobs}, {a['hist']}, {a['fut']}, "
                  f"{a['heads']})")
        return [f"{t}[0]", f"{t}[1]", f"{t}[2]"]

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        n, steps, _ = ctx.shape(x)
        b = _Onnx(ctx, node)
        d, heads, hist, fut = a["d"], a["heads"], a["hist"], a["fut"]
        nq = fut or hist
        xq = ctx.op("Slice", [x, ctx.i64([hist]), ctx.i64([steps]), ctx.i64([1])], "xq") if fut > 0 else x
        q, _ = b.linear(xq, (n, nq, ctx.shape(x)[2]), 0, 1, 2)
        k, _ = b.linear(x, ctx.shape(x), 2, 3, 2)
        v, _ = b.linear(x, ctx.shape(x), 4, 5, 2)
        q = ctx.op("Transpose", [ctx.op("Reshape", [q, ctx.i64([n, nq, heads, d])], "q4")], "qt", perm=[0, 2, 1, 3])
        k = ctx.op("Transpose", [ctx.op("Reshape", [k, ctx.i64([n, steps, heads, d])], "k4")], "kt", perm=[0, 2, 3, 1])
        scores = ctx.op("Mul", [ctx.op("MatMul", [q, k], "qk"), ctx.f32(1.0 / math.sqrt(d))], "scaled")
        rows = np.arange(nq).reshape(-1, 1)
        cols = np.arange(steps).reshape(1, -1)
        masked = (cols - hist > rows) if fut > 0 else (cols > rows)
        scores = ctx.op("Where", [ctx.const(masked), ctx.f32(-1e29), scores], "masked")
        attn = ctx.op("Softmax", [scores], "attn", axis=-1)
        out = ctx.op("MatMul", [attn, ctx.op("Unsqueeze", [v, ctx.i64([1])], "v4")], "out")
        mean_out = self._head_mean(ctx, out, heads, "mean_out")
        y, _ = b.linear(mean_out, (n, nq, d), 6, 7, 2)
        ctx.add_node("Identity", [y], [node.outputs[0]], name=node.name)
        ctx.add_node("Identity", [mean_out], [node.outputs[1]], name=node.name + "_out")
        ctx.add_node("Identity", [self._head_mean(ctx, attn, heads, "mean_attn")], [node.outputs[2]],
                     name=node.name + "_scores")

    @staticmethod
    def _head_mean(ctx, x, heads, hint):
        total = ctx.op("Gather", [x, ctx.i64(0)], f"{hint}0", axis=1)
        for h in range(1, heads):
            total = ctx.op("Add", [total, ctx.op("Gather", [x, ctx.i64(h)], f"{hint}{h}", axis=1)], f"{hint}_sum")
        return ctx.op("Mul", [total, ctx.f32(1.0 / heads)], hint)


# ---- Lstm (MyCaffe's cuDNN LSTM) ------------------------------------------------------------------------------

def _mycaffe_lstm(lp):
    """MyCaffe's Lstm reads recurrent_param; CTPN's (sequence.py) lstm_param."""
    return lp.HasField("recurrent_param") and not lp.HasField("lstm_param")


@claim_layers("Lstm", _mycaffe_lstm)
class MyCaffeLstm(ReadOnlyLayer):

    def parse(self, lp):
        p = lp.recurrent_param
        need_blobs(lp, "Lstm (MyCaffe)", (2, 4), (1, 3), "x, clip, hidden, cell")
        attrs = {"name": lp.name, "hidden": positive_field(p.num_output, "recurrent_param.num_output"),
                 "layers": positive_field(p.num_layers, "recurrent_param.num_layers"),
                 "batch_first": bool(p.batch_first), "dirs": 2 if p.bidirectional else 1,
                 "cudnn": p.engine == caffe_pb2.RecurrentParameter.CUDNN, "tops": len(lp.top),
                 "kind": "Lstm"}
        if len(lp.top) == 3 and not p.expose_hidden_output:
            raise LayerError("Lstm: three tops need recurrent_param.expose_hidden_output")
        if len(lp.bottom) == 4 and not p.expose_hidden_input:
            raise LayerError("Lstm: four bottoms need recurrent_param.expose_hidden_input")
        return attrs

    def why_not_run(self, attrs):
        if attrs["cudnn"]:
            return ("MyCaffe's cuDNN LSTM keeps its weights in one blob packed in the layout the cuDNN library "
                    "chooses; caffeq reads and sizes it but does not run it")
        return "MyCaffe's Caffe-engine Lstm (an unrolled net) is read and sized but not run by caffeq"

    def infer(self, attrs, in_shapes):
        x = in_shapes[0]
        if len(x) < 3:
            raise LayerError(f"Lstm needs a (N, T, I) or (T, N, I) bottom, got {list(x)}")
        t, n = (x[1], x[0]) if attrs["batch_first"] else (x[0], x[1])
        if count(in_shapes[1]) != t * n:
            raise LayerError(f"Lstm: the clip {list(in_shapes[1])} must hold T x N = {t * n} values")
        attrs["_input"] = count(x, 2)
        h = attrs["hidden"] * attrs["dirs"]
        top = (n, t, h) if attrs["batch_first"] else (t, n, h)
        state = (attrs["layers"], n, attrs["hidden"], attrs["dirs"])
        return [top, state, state][:attrs["tops"]]

    def param_shapes(self, attrs, in_shapes):
        h, dirs = attrs["hidden"], attrs["dirs"]
        total, k = 0, count(in_shapes[0], 2)
        for _ in range(attrs["layers"]):
            total += dirs * (4 * h * k + 4 * h * h + 8 * h)
            k = h * dirs
        return [(total, 1, 1)]


# ---- training only --------------------------------------------------------------------------------------------

@register_layer("QuantileLoss", "QuantileAccuracy")
class QuantileTraining(Layer):
    is_training_only = True

    def infer(self, attrs, in_shapes):
        return [(1,)]

    def forward(self, attrs, params, *bottoms):
        raise LayerError("QuantileLoss / QuantileAccuracy only train and evaluate; caffeq leaves them out")


__all__ = ["ChannelEmbedding", "DataTemporal", "GateAddNorm", "MultiheadAttentionInterp", "MyCaffeGRN",
           "MyCaffeLstm", "QuantileTraining", "ReshapeTemporal", "TftBlobs", "VarSelNet", "mycaffe_tft_net",
           "tft_channel_embedding", "tft_gate_add_norm", "tft_glu", "tft_grn", "tft_layer_norm", "tft_linear",
           "tft_mha_interp", "tft_reshape_before", "tft_varselnet"]
