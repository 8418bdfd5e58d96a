"""MyCaffe's minGPT layers (MyCaffe/MyCaffe b8922aa, C#): TokenizedData, TransformerBlock, LayerNorm and the loss
its GPT nets train with; Eltwise's allow_single_batch_input is read by caffeq/layers/elementwise.py.

Sources (facts read from the C# and CUDA; no code carried over):
  - MyCaffe.layers.gpt/layers.gpt/TokenizedDataLayer.cs (param.gpt/TokenizedDataParameter.cs): at TRAIN / TEST
    three tops: token ids (batch_size, block_size) (TextInputData's TokenSize is 1: two axes), positions (1,
    block_size) holding 0, 1, ..., block_size - 1 (set once in LayerSetUp), targets like the ids.  At RUN the
    ids are the layer's bottom (its channels at most block_size) and the positions top is reshaped to the ids'
    (N, T) over the LayerSetUp values, so 0 .. T - 1 for the N = 1 its PreProcessInput makes (for N > 1 the rows
    after the first continue the count or are unset; caffeq gives (1, T), broadcast).  caffeq reads the
    ids as the graph input (shape from the parameters or --input-shape) and the targets as a label input; the
    positions top becomes its own layer (TokenizedDataPositions, caffeq's name) computing (1, T) from the ids'
    T, so it is never an input.
  - MyCaffe.layers.gpt/layers.gpt/LayerNormLayer.cs (param.gpt/LayerNormParameter.cs; CudaDnnDLL/Cuda Files/
    layernorm.cu computes the same): no learned gain or bias.  Over count(2) per (n, c) of a blob with more than
    two axes (the last axis of (B, T, C)), over the channels of a 2-axis one: mu = mean x,
    var = mean (x - mu)^2, y = (x - mu) / sqrt(var + epsilon), epsilon 1e-10 unless set.  enable_passthrough
    copies x.
  - MyCaffe.layers.gpt/layers.gpt/TransformerBlockLayer.cs (param.gpt/TransformerBlockParameter.cs) with
    block_type CAUSAL_SELF_ATTENTION: xB = x + attn(ln1(x)); top = xB + proj(act(fc1(ln2(xB)))), ln1 and ln2
    LayerNorms with the default epsilon 1e-10, fc1 an InnerProduct (axis 2) to hidden_dim (0: 4 embed), proj back
    to embed, act ReLU by default (GELU: x * 0.5 (1 + erf(x / sqrt 2)); GELU_BERT: the tanh form
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), CudaDnnDLL/Cuda Files/math.cu gelu_fwd_kernel(_bert);
    SILU: x sigmoid(x)).  Blobs, in order: c_attn weight (3 embed, embed), bias (3 embed), c_proj weight (embed,
    embed), bias (embed), fc1 weight (hidden, embed), bias (hidden), proj weight (embed, hidden), bias (embed)
    (the weights only when bias_term is false).  Dropouts (attn_dropout, resid_dropout) copy at TEST
    (MyCaffe/layers/DropoutLayer.cs).
  - MyCaffe.layers.gpt/layers.gpt/CausalSelfAttentionLayer.cs: q, k, v = the three embed-wide slices of c_attn(x)
    (channel_copy, math.cu), each viewed (B, T, heads, hs) and transposed to (B, heads, T, hs);
    att = (q k^T) * 1 / sqrt(hs); where the causal mask (1 on and below the diagonal, resized to T x T) is 0,
    att = -1e29; softmax over the last axis; y = att v, transposed back to (B, T, embed); top = c_proj(y).
  - MyCaffe/layers/SoftmaxCrossEntropy2LossLayer.cs: a training loss; read and sized, not run.
"""
import math

import numpy as np
import torch

from ..io.schema import caffe_pb2
from .data import DataLayer
from .registry import (
    Layer,
    LayerError,
    ReadOnlyLayer,
    need_blobs,
    needs_input_shape,
    net_rewrite,
    register_layer,
    torch_sources,
)

_MASKED = -1e29   # CausalSelfAttentionLayer.cs m_dfIgnoreVal
_RELU, _GELU, _GELU_BERT, _SILU = 0, 1, 2, 3
_ACTIVATIONS = {_RELU: "RELU", _GELU: "GELU", _GELU_BERT: "GELU_BERT", _SILU: "SILU"}


# ---- torch helpers (model.py copies them) ---------------------------------------------------------------------

def mycaffe_layer_norm(x, eps: float):
    """MyCaffe's LayerNorm: over the channels of a 2-axis blob, else over count(2) per (n, c); no gain, no bias."""
    rows = x.reshape(x.shape[0], -1) if x.dim() == 2 else x.reshape(x.shape[0], x.shape[1], -1)
    mu = rows.mean(dim=-1, keepdim=True)
    xmu = rows - mu
    var = (xmu * xmu).mean(dim=-1, keepdim=True)
    return (xmu / torch.sqrt(var + eps)).reshape(x.shape)


def mycaffe_causal_self_attention(x, w_attn, b_attn, w_proj, b_proj, heads: int):
    """MyCaffe's CausalSelfAttention at TEST / RUN: x (B, T, C) -> (B, T, C)."""
    batch, steps, embed = x.shape[0], x.shape[1], x.shape[2]
    size = embed // heads
    qkv = torch.nn.functional.linear(x, w_attn, b_attn)
    q, k, v = (qkv[:, :, i * embed:(i + 1) * embed].reshape(batch, steps, heads, size).transpose(1, 2)
               for i in range(3))
    att = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(size))
    keep = torch.ones(steps, steps, dtype=torch.bool, device=x.device).tril()
    att = torch.where(keep, att, torch.full_like(att, -1e29))
    att = torch.softmax(att, dim=-1)
    y = torch.matmul(att, v).transpose(1, 2).reshape(batch, steps, embed)
    return torch.nn.functional.linear(y, w_proj, b_proj)


def mycaffe_mlp_activation(x, activation: int):
    """TransformerBlock's MLP activation: 0 ReLU, 1 GELU (erf), 2 GELU_BERT (tanh form), 3 SiLU."""
    if activation == 1:
        return x * (0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))))
    if activation == 2:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))
    if activation == 3:
        return x * torch.sigmoid(x)
    return torch.relu(x)


def mycaffe_transformer_block(x, params: list, heads: int, activation: int):
    """MyCaffe's TransformerBlock (CAUSAL_SELF_ATTENTION, LayerNorm) at TEST / RUN; params: the layer's blobs in
    order, 8 with biases, 4 (the weights) without."""
    if len(params) == 8:
        w_attn, b_attn, w_cproj, b_cproj, w_fc, b_fc, w_proj, b_proj = params
    else:
        w_attn, w_cproj, w_fc, w_proj = params
        b_attn = b_cproj = b_fc = b_proj = None
    xb = x + mycaffe_causal_self_attention(mycaffe_layer_norm(x, 1e-10), w_attn, b_attn, w_cproj, b_cproj, heads)
    hidden = mycaffe_mlp_activation(torch.nn.functional.linear(mycaffe_layer_norm(xb, 1e-10), w_fc, b_fc),
                                    activation)
    return xb + torch.nn.functional.linear(hidden, w_proj, b_proj)


def token_positions(x):
    """TokenizedData's positions top: (1, T) holding 0 .. T - 1 for ids x (B, T, ...)."""
    return torch.arange(x.shape[1], device=x.device).to(x.dtype).reshape(1, x.shape[1])


# ---- ONNX pieces ------------------------------------------------------------------------------------------------

def _onnx_layer_norm(ctx, x, shape, eps, hint):
    from .norm import onnx_reduce
    rows = list(shape[:1]) + [-1] if len(shape) == 2 else list(shape[:2]) + [-1]
    flat = ctx.op("Reshape", [x, ctx.i64(rows)], f"{hint}_rows")
    mu = onnx_reduce(ctx, "ReduceMean", flat, [len(rows) - 1], True)
    xmu = ctx.op("Sub", [flat, mu], f"{hint}_xmu")
    var = onnx_reduce(ctx, "ReduceMean", ctx.op("Mul", [xmu, xmu], f"{hint}_sq"), [len(rows) - 1], True)
    std = ctx.op("Sqrt", [ctx.op("Add", [var, ctx.f32(eps)], f"{hint}_var_eps")], f"{hint}_std")
    y = ctx.op("Div", [xmu, std], f"{hint}_y")
    return ctx.op("Reshape", [y, ctx.i64(list(shape))], hint)


def _onnx_linear(ctx, node, x, w, b, hint):
    y = ctx.op("MatMul", [x, ctx.weight(node, w, transpose=True)], f"{hint}_mm")
    return y if b is None else ctx.op("Add", [y, ctx.weight(node, b)], hint)


def _onnx_activation(ctx, x, activation, hint):
    if activation == _GELU:
        erf = ctx.op("Erf", [ctx.op("Div", [x, ctx.f32(math.sqrt(2.0))], f"{hint}_scaled")], f"{hint}_erf")
        cdf = ctx.op("Mul", [ctx.op("Add", [erf, ctx.f32(1.0)], f"{hint}_1erf"), ctx.f32(0.5)], f"{hint}_cdf")
        return ctx.op("Mul", [x, cdf], hint)
    if activation == _GELU_BERT:
        cube = ctx.op("Mul", [ctx.op("Mul", [x, x], f"{hint}_x2"), x], f"{hint}_x3")
        inner = ctx.op("Add", [x, ctx.op("Mul", [cube, ctx.f32(0.044715)], f"{hint}_c3")], f"{hint}_inner")
        t = ctx.op("Tanh", [ctx.op("Mul", [inner, ctx.f32(math.sqrt(2.0 / math.pi))], f"{hint}_arg")],
                   f"{hint}_tanh")
        return ctx.op("Mul", [ctx.op("Mul", [x, ctx.f32(0.5)], f"{hint}_hx"),
                              ctx.op("Add", [ctx.f32(1.0), t], f"{hint}_1t")], hint)
    if activation == _SILU:
        return ctx.op("Mul", [x, ctx.op("Sigmoid", [x], f"{hint}_sig")], hint)
    return ctx.op("Relu", [x], hint)


# ---- TokenizedData --------------------------------------------------------------------------------------------

@net_rewrite
def split_tokenized_data(net, source=""):
    """Each TokenizedData's positions top (its second) becomes a TokenizedDataPositions layer on its ids."""
    if not any(lp.type == "TokenizedData" and len(lp.top) >= 2 for lp in net.layer):
        return []
    layers, split = [], []
    for lp in net.layer:
        layers.append(lp)
        if lp.type != "TokenizedData" or len(lp.top) < 2:
            continue
        pos = caffe_pb2.LayerParameter(name=f"{lp.name}/positions", type="TokenizedDataPositions",
                                       bottom=[lp.top[0]], top=[lp.top[1]])
        pos.include.extend(lp.include)
        pos.exclude.extend(lp.exclude)
        del lp.top[1]
        layers.append(pos)
        split.append(lp.name)
    del net.layer[:]
    net.layer.extend(layers)
    return [f"{source + ': ' if source else ''}TokenizedData layer(s) {', '.join(map(repr, split))} (MyCaffe): "
            f"the token ids (and targets) are graph inputs; the positions top (0 .. T - 1, T the ids' length) is "
            f"computed from the ids by a TokenizedDataPositions layer"]


@register_layer("TokenizedData")
class TokenizedData(DataLayer):
    """MyCaffe's TokenizedData after split_tokenized_data: token ids (N, T) and, when given, the targets (N, T)."""

    def parse(self, lp):
        need_blobs(lp, "TokenizedData", 0, (1, 2))
        p = lp.tokenized_data_param
        return {"num_tops": len(lp.top), "tops": list(lp.top), "batch_size": int(p.batch_size),
                "block_size": int(p.block_size), "source": p.source,
                "vocabulary": caffe_pb2.TokenizedDataParameter.VocabularyType.Name(p.vocabulary_type)}

    def data_shape(self, attrs):
        if attrs["batch_size"] < 1 or attrs["block_size"] < 1:
            raise needs_input_shape(attrs, attrs["tops"][0], "tokenized_data_param.batch_size and block_size "
                                    "are not both set", lacking="from its parameters")
        return (attrs["batch_size"], attrs["block_size"])

    def top_shapes(self, attrs, given):
        data = tuple(given.get(0) or self.data_shape(attrs))
        if len(data) != 2:
            raise LayerError(f"TokenizedData's ids are (N, T) (one token a position), got {list(data)}")
        if attrs["block_size"] and data[1] > attrs["block_size"]:
            raise LayerError(f"TokenizedData: {data[1]} tokens exceed tokenized_data_param.block_size "
                             f"{attrs['block_size']}")
        shapes = [data]
        if attrs["num_tops"] > 1:
            shapes.append(tuple(given.get(1) or data))
        return shapes

    def preprocessing(self, attrs):
        return [f"token ids (as floats) of the {attrs['vocabulary'].lower()} vocabulary MyCaffe builds from "
                f"{attrs['source']!r}; the targets are the ids shifted by one"]


@register_layer("TokenizedDataPositions")
class TokenizedDataPositions(Layer):
    """TokenizedData's positions top as its own layer (split_tokenized_data): bottom ids (N, T), top (1, T)."""

    def parse(self, lp):
        need_blobs(lp, "TokenizedDataPositions", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2:
            raise LayerError(f"TokenizedDataPositions needs ids (N, T), got {list(s)}")
        return [(1, s[1])]

    def forward(self, attrs, params, x):
        return token_positions(x)

    def onnx(self, ctx, node):
        steps = ctx.shape(node.inputs[0])[1]
        ctx.add_node("Identity", [ctx.const(np.arange(steps, dtype=np.float32).reshape(1, steps))],
                     [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(token_positions)}({emit.inputs[0]})"


# ---- LayerNorm ------------------------------------------------------------------------------------------------

@register_layer("LayerNorm")
class LayerNorm(Layer):
    """MyCaffe's LayerNorm (no learned gain or bias)."""

    def parse(self, lp):
        need_blobs(lp, "LayerNorm", 1, 1)
        p = lp.layer_norm_param
        if p.epsilon < 0:
            raise LayerError(f"layer_norm_param.epsilon must be >= 0, got {p.epsilon}")
        return {"eps": float(p.epsilon), "passthrough": bool(p.enable_passthrough)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2:
            raise LayerError(f"LayerNorm needs at least 2 axes, got {list(s)}")
        return [s]

    def forward(self, attrs, params, x):
        return x if attrs["passthrough"] else mycaffe_layer_norm(x, attrs["eps"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        if node.attrs["passthrough"]:
            ctx.add_node("Identity", [x], [node.outputs[0]], name=node.name)
            return
        y = _onnx_layer_norm(ctx, x, ctx.shape(x), node.attrs["eps"], "ln")
        ctx.add_node("Identity", [y], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        if node.attrs["passthrough"]:
            return emit.inputs[0]
        return f"{emit.helper(mycaffe_layer_norm)}({emit.inputs[0]}, {emit.lit(node.attrs['eps'])})"


# ---- TransformerBlock -----------------------------------------------------------------------------------------

@register_layer("TransformerBlock")
class TransformerBlock(Layer):
    """MyCaffe's TransformerBlock: block_type CAUSAL_SELF_ATTENTION with LayerNorm (minGPT's Block)."""

    def blob_names_for(self, attrs):
        names = ("c_attn_weight", "c_attn_bias", "c_proj_weight", "c_proj_bias", "fc_weight", "fc_bias",
                 "proj_weight", "proj_bias")
        return names if attrs["bias_term"] else names[::2]

    def parse(self, lp):
        need_blobs(lp, "TransformerBlock", 1, 1)
        p = lp.transformer_block_param
        P = caffe_pb2.TransformerBlockParameter
        if p.block_type != P.CAUSAL_SELF_ATTENTION:
            raise LayerError(f"transformer_block_param.block_type {P.BlockType.Name(p.block_type)} is not run by "
                             f"caffeq; CAUSAL_SELF_ATTENTION is")
        if p.normaliation != P.LAYER_NORM:
            raise LayerError("transformer_block_param.normaliation RMS_NORM is not run by caffeq; LAYER_NORM is")
        for field in ("enable_llama_style_head", "enable_rotary_positional_embedding"):
            if getattr(p, field):
                raise LayerError(f"transformer_block_param.{field} is not run by caffeq")
        if p.heads < 1 or p.embed < 1:
            raise LayerError(f"transformer_block_param.heads and embed must be >= 1, got {p.heads} and {p.embed}")
        if p.embed % p.heads:
            raise LayerError(f"transformer_block_param.embed {p.embed} must be divisible by heads {p.heads}")
        return {"heads": int(p.heads), "embed": int(p.embed), "hidden": int(p.hidden_dim or 4 * p.embed),
                "activation": int(p.activation), "bias_term": bool(p.bias_term), "layers": int(p.layers)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 3 or s[2] != attrs["embed"]:
            raise LayerError(f"TransformerBlock needs a (B, T, {attrs['embed']}) bottom "
                             f"(transformer_block_param.embed), got {list(s)}")
        return [s]

    def param_shapes(self, attrs, in_shapes):
        c, h = attrs["embed"], attrs["hidden"]
        weights = [(3 * c, c), (c, c), (h, c), (c, h)]
        if not attrs["bias_term"]:
            return weights
        return [shape for w in weights for shape in (w, (w[0],))]

    def init_params(self, attrs, shapes, rng):
        # the C#'s fillers: gaussian std 0.02, the two residual projections 0.02 / sqrt(2 layers); biases 0
        blobs, weight = [], 0
        for shape in shapes:
            if len(shape) == 1:
                blobs.append(np.zeros(shape, np.float32))
                continue
            std = 0.02 / math.sqrt(2 * max(attrs["layers"], 1)) if weight in (1, 3) else 0.02
            blobs.append((rng.standard_normal(shape) * std).astype(np.float32))
            weight += 1
        return blobs

    def forward(self, attrs, params, x):
        return mycaffe_transformer_block(x, list(params), attrs["heads"], attrs["activation"])

    def macs(self, attrs, in_shapes, out_shapes):
        b, t, c = in_shapes[0]
        return b * t * (3 * c * c + c * c + 2 * c * attrs["hidden"]) + 2 * b * t * t * c

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        batch, steps, embed = ctx.shape(x)
        heads, size = a["heads"], embed // a["heads"]
        idx = list(range(8)) if a["bias_term"] else [0, None, 1, None, 2, None, 3, None]
        n1 = _onnx_layer_norm(ctx, x, (batch, steps, embed), 1e-10, "ln1")
        qkv = _onnx_linear(ctx, node, n1, idx[0], idx[1], "qkv")
        q, k, v = ctx.add_node("Split", [qkv, ctx.i64([embed] * 3)],
                               [ctx.tmp(f"{node.name}_{w}") for w in "qkv"], axis=2)
        heads_view = ctx.i64([batch, steps, heads, size])
        q, k, v = (ctx.op("Transpose", [ctx.op("Reshape", [t, heads_view], f"{w}_heads")], f"{w}_t",
                          perm=[0, 2, 1, 3]) for t, w in ((q, "q"), (k, "k"), (v, "v")))
        kt = ctx.op("Transpose", [k], "kT", perm=[0, 1, 3, 2])
        att = ctx.op("Mul", [ctx.op("MatMul", [q, kt], "qk"), ctx.f32(1.0 / math.sqrt(size))], "att")
        keep = np.tril(np.ones((steps, steps), bool))
        att = ctx.op("Where", [ctx.const(keep), att, ctx.f32(_MASKED)], "att_masked")
        att = ctx.op("Softmax", [att], "att_softmax", axis=-1)
        y = ctx.op("Transpose", [ctx.op("MatMul", [att, v], "av")], "y_t", perm=[0, 2, 1, 3])
        y = ctx.op("Reshape", [y, ctx.i64([batch, steps, embed])], "y")
        xb = ctx.op("Add", [x, _onnx_linear(ctx, node, y, idx[2], idx[3], "c_proj")], "xb")
        n2 = _onnx_layer_norm(ctx, xb, (batch, steps, embed), 1e-10, "ln2")
        hidden = _onnx_activation(ctx, _onnx_linear(ctx, node, n2, idx[4], idx[5], "fc"), a["activation"], "act")
        out = _onnx_linear(ctx, node, hidden, idx[6], idx[7], "proj")
        ctx.add_node("Add", [xb, out], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        n = 8 if node.attrs["bias_term"] else 4
        shapes = [tuple(emit.blob(i).shape) for i in range(n)]
        blobs = emit.module(f"nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in {shapes!r}])")
        for i in range(n):
            emit.param(str(i), i)
        fn = emit.helper(torch_sources(mycaffe_layer_norm, mycaffe_causal_self_attention, mycaffe_mlp_activation,
                                       mycaffe_transformer_block))
        return (f"{fn}({emit.inputs[0]}, list({blobs}), {node.attrs['heads']}, "
                f"{node.attrs['activation']})")


# ---- SoftmaxCrossEntropy2Loss ---------------------------------------------------------------------------------

@register_layer("SoftmaxCrossEntropy2Loss")
class SoftmaxCrossEntropy2Loss(ReadOnlyLayer):
    """MyCaffe's training loss of its GPT nets: sized (a scalar; the per-element losses as a second top), not
    run."""

    is_training_only = True

    def parse(self, lp):
        need_blobs(lp, "SoftmaxCrossEntropy2Loss", 2, (1, 2), "logits, targets")
        return {"name": lp.name, "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        return [()] + [tuple(in_shapes[0])] * (attrs["tops"] - 1)

    def why_not_run(self, attrs):
        return "a MyCaffe training loss, which caffeq reads and sizes but does not compute"
