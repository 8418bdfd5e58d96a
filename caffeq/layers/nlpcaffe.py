"""nlpcaffe (Russell Stewart's NLP Caffe, as yang1fan2/nlpcaffe-windows 4431c6f carries it; its language-model
example): Wordvec and its Lstm, the word-by-word recurrence unrolled in the prototxt.

- Wordvec (wordvec_layer.cpp): bottom (N, T, ...) of word ids (num and channels), a table blob
  (1, vocab_size, 1, dimension); top (N, dimension, T, 1): top[n, d, t] = W[(int)(x[n, t] + 0.5), d] (the
  embedding on axis 1, time on axis 2).  An id outside the table is refused (the fork reads past it).
- Lstm (claimed by `lstm_param.num_cells`; lstm_layer.cu): bottoms x (N, K...) and the previous cell state
  (N, num_cells...), four weight blobs (1, num_cells, 1, K): the candidate's, the input gate's, the forget
  gate's and the output gate's, no biases, no peepholes; tops h and c (N, num_cells, 1, 1):
  g = tanh5(x W0^T), i = sigmoid(x W1^T), o = sigmoid(x W3^T), f = sigmoid(-(x W3^T)) = 1 - o,
  c = c_prev f + i g, h = c o (no tanh on c); tanh5 is (e^2v - 1) / (e^2v + 1), clipped to +-1 where
  |v| >= 5.  That is the fork's GPU forward, which its solver trains with (the forget gate tied to the
  output gate, blob 2 never read or trained, from its March 2015 merge 82bbdd3 on: its V2 "Lstm"); its CPU
  forward would read blob 2 instead.  A V1 file's `type: LSTM` with these four blobs comes from before that
  merge (January to March 2015, 7267e1c), whose GPU forward reads the forget gate from blob 2:
  f = sigmoid(x W2^T).
- Lstm as nlpcaffe first wrote it (Russell91/nlpcaffe fd5fb6c, January 2015, V1 files: `type: LSTM`; claimed
  by num_cells with input_bias_filler, which that version CHECKs): eight blobs, each gate's weights
  (1, num_cells, 1, K + 1) and bias (1, num_cells, 1, 1) in the order candidate, input, forget, output gate; a
  weight blob's last column is the gate's peephole weight on the previous cell (never read for the candidate):
  g = tanhE(x W0 + b0), i, f, o = sigmoid(x Wj + bj + pj c_prev), c = c_prev f + i g, h = tanhE(c) o, where
  tanhE is (e^2v - 1) / (e^2v + 1) unclipped (NaN where e^2v overflows a float, v > 44.36, as in the fork).
  That is fd5fb6c's forward (models/rnn's files of that commit); the same eight blobs computed h = c o from
  a2c2124 and clipped tanh from 53ae062 until the biases went in a0b17a5 (a week later).
The flags slice_param.fast_wordvec_slice and concat_param.fast_lstm_concat are faster loops of the same
slice and concat (shape_ops.py checks the first one's CHECKs).
"""
import numpy as np
import torch

from ..errors import DataError
from .registry import (
    Layer,
    LayerError,
    claim_layers,
    legacy_nchw,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def nlp_tanh_unclipped(v):
    """nlpcaffe's first tanh: (e^2v - 1) / (e^2v + 1), NaN where e^2v overflows."""
    e = torch.exp(2 * v)
    return (e - 1) / (e + 1)


def nlp_tanh(v):
    """nlpcaffe's tanh from 53ae062 on: the formula, +-1 where |v| >= 5."""
    return torch.where(v.abs() < 5, nlp_tanh_unclipped(v),
                       torch.where(v > 0, torch.ones_like(v), -torch.ones_like(v)))


def nlp_lstm(x, c_prev, w_in, w_input_gate, w_forget_gate, w_output_gate, forget_tied: bool):
    """nlpcaffe's Lstm step (its GPU forward): -> (h, c), each (N, num_cells, 1, 1); forget_tied: the forget gate
    is sigmoid(0 - the output gate's pre-activation), blob 2 unread (the fork from March 2015 on)."""
    n, cells = x.shape[0], w_in.shape[1]
    rows = x.reshape(n, -1)
    g = nlp_tanh(rows @ w_in.reshape(cells, -1).t())
    i = torch.sigmoid(rows @ w_input_gate.reshape(cells, -1).t())
    out = rows @ w_output_gate.reshape(cells, -1).t()
    o = torch.sigmoid(out)
    f = torch.sigmoid(0 - out) if forget_tied else torch.sigmoid(rows @ w_forget_gate.reshape(cells, -1).t())
    c = c_prev.reshape(n, cells) * f + i * g
    return (c * o).reshape(n, cells, 1, 1), c.reshape(n, cells, 1, 1)


def nlp_wordvec(x, table, steps: int):
    """Wordvec: (N, dimension, T, 1) rows of the (1, vocab, 1, dimension) table at ids (int)(x + 0.5)."""
    n = x.shape[0]
    ids = (x.reshape(-1)[: n * steps] + 0.5).long().reshape(n, steps)
    vocab = table.shape[1]
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"Wordvec: word id {int(ids[(ids < 0) | (ids >= vocab)][0])} is outside [0, {vocab})")
    return table.reshape(vocab, -1)[ids].permute(0, 2, 1).unsqueeze(-1)


def nlp_lstm_peephole(x, c_prev, w_in, b_in, w_i, b_i, w_f, b_f, w_o, b_o):
    """nlpcaffe's first Lstm step: -> (h, c), each (N, num_cells, 1, 1); weights (1, C, 1, K + 1), the last
    column the gate's peephole weight on c_prev; biases (1, C, 1, 1)."""
    n, cells = x.shape[0], w_in.shape[1]
    rows = x.reshape(n, -1)
    c0 = c_prev.reshape(n, cells)

    def pre(w, b, peephole: bool):
        w = w.reshape(cells, -1)
        v = rows @ w[:, :-1].t() + b.reshape(1, cells)
        return v + w[:, -1] * c0 if peephole else v
    g = nlp_tanh_unclipped(pre(w_in, b_in, False))
    i = torch.sigmoid(pre(w_i, b_i, True))
    f = torch.sigmoid(pre(w_f, b_f, True))
    o = torch.sigmoid(pre(w_o, b_o, True))
    c = c0 * f + i * g
    return (nlp_tanh_unclipped(c) * o).reshape(n, cells, 1, 1), c.reshape(n, cells, 1, 1)


def onnx_exp_tanh(ctx, v, hint):
    """(e^2v - 1) / (e^2v + 1), the forks' tanh formula, unclipped."""
    e = ctx.op("Exp", [ctx.op("Mul", [v, ctx.f32(2.0)], "v2")], "e2v")
    return ctx.op("Div", [ctx.op("Sub", [e, ctx.f32(1.0)], "num"), ctx.op("Add", [e, ctx.f32(1.0)], "den")], hint)


TORCH_NLP_LSTM = torch_sources(nlp_tanh_unclipped, nlp_tanh, nlp_lstm)
TORCH_NLP_LSTM_PEEPHOLE = torch_sources(nlp_tanh_unclipped, nlp_lstm_peephole)
TORCH_NLP_WORDVEC = torch_sources(nlp_wordvec)


# ---- the specs ---------------------------------------------------------------------------

@register_layer("Wordvec")
class Wordvec(Layer):
    blob_names = ("table",)

    def parse(self, lp):
        need_blobs(lp, "Wordvec", 1, 1)
        p = lp.wordvec_param
        if not (p.HasField("dimension") and p.HasField("vocab_size")):
            raise LayerError("wordvec_param.dimension and vocab_size are required (the fork's CHECKs)")
        return {"dim": positive_field(p.dimension, "wordvec_param.dimension"),
                "vocab": positive_field(p.vocab_size, "wordvec_param.vocab_size")}

    def infer(self, attrs, in_shapes):
        n, steps, _, _ = legacy_nchw(in_shapes[0], "Wordvec")
        attrs["steps"] = steps
        return [(n, attrs["dim"], steps, 1)]

    def param_shapes(self, attrs, in_shapes):
        return [(1, attrs["vocab"], 1, attrs["dim"])]

    def forward(self, attrs, params, x):
        try:
            return nlp_wordvec(x, params[0], attrs["steps"])
        except ValueError as e:
            raise DataError(str(e)) from None

    def onnx(self, ctx, node):
        a = node.attrs
        n = ctx.shape(node.inputs[0])[0]
        head = ctx.op("Slice", [ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "flat"), ctx.i64([0]),
                                ctx.i64([n * a["steps"]])], "head")
        ids = ctx.op("Cast", [ctx.op("Add", [head, ctx.f32(0.5)], "half")], "ids", to=7)   # truncated, as (int)
        table = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([a["vocab"], a["dim"]])], "table")
        rows = ctx.op("Gather", [table, ctx.op("Reshape", [ids, ctx.i64([n, a["steps"]])], "ids2")], "rows", axis=0)
        ctx.add_node("Unsqueeze", [ctx.op("Transpose", [rows], "by_dim", perm=[0, 2, 1]), ctx.i64([3])],
                     [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        m = emit.module(f"nn.Parameter(torch.zeros(1, {node.attrs['vocab']}, 1, {node.attrs['dim']}))")
        emit.param("", 0, attr=m[len("self."):])
        return f"{emit.helper(TORCH_NLP_WORDVEC)}({emit.inputs[0]}, {m}, {node.attrs['steps']})"


def _nlpcaffe_lstm(lp):
    return lp.lstm_param.HasField("num_cells") and not _first_nlpcaffe_lstm(lp)


def _first_nlpcaffe_lstm(lp):
    """nlpcaffe's first Lstm CHECKs its bias fillers; the later one has none."""
    return lp.lstm_param.HasField("num_cells") and lp.lstm_param.HasField("input_bias_filler")


@claim_layers("LSTM", _nlpcaffe_lstm)   # a V1 file's LSTM (lisa-caffe's has no num_cells)
@claim_layers("Lstm", _nlpcaffe_lstm)
class NlpLstm(Layer):
    types = ("Lstm", "LSTM")
    blob_names = ("input_weight", "input_gate_weight", "forget_gate_weight", "output_gate_weight")

    def parse(self, lp):
        need_blobs(lp, "Lstm (nlpcaffe)", 2, 2, roles="x, c_prev")
        return {"cells": positive_field(lp.lstm_param.num_cells, "lstm_param.num_cells"),
                "forget_tied": lp.type == "Lstm"}   # V2 files: after the March 2015 merge

    def infer(self, attrs, in_shapes):
        x, c = (tuple(s) for s in in_shapes)
        cells = attrs["cells"]
        if not x or int(np.prod(c)) != x[0] * cells:
            raise LayerError(f"nlpcaffe's Lstm reads the previous cell state as (N, num_cells) = "
                             f"({x[0] if x else '?'}, {cells}) values, got {list(c)}")
        return [(x[0], cells, 1, 1)] * 2

    def param_shapes(self, attrs, in_shapes):
        k = int(np.prod(in_shapes[0][1:]))
        return [(1, attrs["cells"], 1, k)] * 4

    def forward(self, attrs, params, x, c_prev):
        return nlp_lstm(x, c_prev, *params, attrs.get("forget_tied", True))

    def onnx(self, ctx, node):
        x, c_prev = node.inputs
        n, cells = ctx.shape(x)[0], node.attrs["cells"]
        rows = ctx.op("Reshape", [x, ctx.i64([n, -1])], "rows")

        def pre(blob):
            w = ctx.op("Reshape", [ctx.weight(node, blob), ctx.i64([cells, -1])], "w")
            return ctx.op("MatMul", [rows, ctx.op("Transpose", [w], "wt", perm=[1, 0])], "pre")
        v = pre(0)
        sign = ctx.op("Where", [ctx.op("Greater", [v, ctx.f32(0.0)], "pos"), ctx.f32(1.0), ctx.f32(-1.0)], "sign")
        g = ctx.op("Where", [ctx.op("Less", [ctx.op("Abs", [v], "abs"), ctx.f32(5.0)], "small"),
                             onnx_exp_tanh(ctx, v, "th"), sign], "g")
        i = ctx.op("Sigmoid", [pre(1)], "i")
        out = pre(3)
        o = ctx.op("Sigmoid", [out], "o")
        if node.attrs.get("forget_tied", True):
            f = ctx.op("Sigmoid", [ctx.op("Sub", [ctx.f32(0.0), out], "neg")], "f")
        else:
            f = ctx.op("Sigmoid", [pre(2)], "f")
        c = ctx.op("Add", [ctx.op("Mul", [ctx.op("Reshape", [c_prev, ctx.i64([n, cells])], "cp"), f], "keep"),
                           ctx.op("Mul", [i, g], "write")], "c")
        shape = ctx.i64([n, cells, 1, 1])
        ctx.add_node("Reshape", [ctx.op("Mul", [c, o], "h"), shape], [node.outputs[0]], name=node.name)
        ctx.add_node("Reshape", [c, shape], [node.outputs[1]])

    def parameter_modules(self, node, emit):
        """One nn.Parameter per blob, named after blob_names; their expressions in order."""
        names = []
        for blob, name in enumerate(self.blob_names):
            attr = emit.extra_attr(name)
            names.append(emit.module(f"nn.Parameter(torch.zeros{tuple(node.blobs[blob].shape)})", attr=attr))
            emit.param("", blob, attr=attr)
        return names

    def pytorch_source(self, node, emit):
        names = self.parameter_modules(node, emit)
        x, c_prev = emit.inputs
        return f"{emit.helper(TORCH_NLP_LSTM)}({x}, {c_prev}, {', '.join(names)}, {node.attrs.get('forget_tied', True)})"


@claim_layers("LSTM", _first_nlpcaffe_lstm)
@claim_layers("Lstm", _first_nlpcaffe_lstm)
class NlpLstmPeephole(NlpLstm):
    types = ("LSTM", "Lstm")
    blob_names = ("input_weight", "input_bias", "input_gate_weight", "input_gate_bias", "forget_gate_weight",
                  "forget_gate_bias", "output_gate_weight", "output_gate_bias")

    def parse(self, lp):
        need_blobs(lp, "Lstm (nlpcaffe's first)", 2, 2, roles="x, c_prev")
        return {"cells": positive_field(lp.lstm_param.num_cells, "lstm_param.num_cells")}

    def param_shapes(self, attrs, in_shapes):
        k, cells = int(np.prod(in_shapes[0][1:])), attrs["cells"]
        return [(1, cells, 1, k + 1), (1, cells, 1, 1)] * 4

    def forward(self, attrs, params, x, c_prev):
        return nlp_lstm_peephole(x, c_prev, *params)

    def onnx(self, ctx, node):
        x, c_prev = node.inputs
        n, cells = ctx.shape(x)[0], node.attrs["cells"]
        rows = ctx.op("Reshape", [x, ctx.i64([n, -1])], "rows")
        c0 = ctx.op("Reshape", [c_prev, ctx.i64([n, cells])], "c0")
        inputs = int(np.prod(ctx.shape(x)[1:]))

        def pre(gate, peephole):
            w = ctx.op("Reshape", [ctx.weight(node, 2 * gate), ctx.i64([cells, -1])], "w")
            weights = ctx.op("Slice", [w, ctx.i64([0]), ctx.i64([inputs]), ctx.i64([1])], "wx")
            v = ctx.op("Add", [ctx.op("MatMul", [rows, ctx.op("Transpose", [weights], "wt", perm=[1, 0])], "xw"),
                               ctx.op("Reshape", [ctx.weight(node, 2 * gate + 1), ctx.i64([1, cells])], "b")], "pre")
            if not peephole:
                return v
            p = ctx.op("Reshape", [ctx.op("Slice", [w, ctx.i64([inputs]), ctx.i64([inputs + 1]), ctx.i64([1])],
                                          "p"), ctx.i64([1, cells])], "peep")
            return ctx.op("Add", [v, ctx.op("Mul", [c0, p], "pc")], "pre_p")
        g = onnx_exp_tanh(ctx, pre(0, False), "g")
        i, f, o = (ctx.op("Sigmoid", [pre(k, True)], name) for k, name in ((1, "i"), (2, "f"), (3, "o")))
        c = ctx.op("Add", [ctx.op("Mul", [c0, f], "keep"), ctx.op("Mul", [i, g], "write")], "c")
        shape = ctx.i64([n, cells, 1, 1])
        ctx.add_node("Reshape", [ctx.op("Mul", [onnx_exp_tanh(ctx, c, "tc"), o], "h"), shape], [node.outputs[0]],
                     name=node.name)
        ctx.add_node("Reshape", [c, shape], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        names = self.parameter_modules(node, emit)
        x, c_prev = emit.inputs
        return f"{emit.helper(TORCH_NLP_LSTM_PEEPHOLE)}({x}, {c_prev}, {', '.join(names)})"
