"""peteanderson80/caffe, the Caffe of peteanderson80/Up-Down-Captioner (bottom-up and top-down attention
captioning; layers from Jeff Donahue's and Russell Stewart's recurrent branches; read at 0fc4d3f, efa9a87
and 1d3e827, whose forwards agree): LSTMNode, and the beam-search layers BeamSearchNode and BeamSearch.

- LSTMNode (lstm_node_layer.cpp / .cu; lstm_param num_cells, bias_term [true], eight fillers): one LSTM
  step.  Bottoms x (M, ...), read as (M, K) rows, the previous cell state (M * N values) and optionally a
  continuation flag per row (M values) that multiplies the forget gate; the previous hidden state reaches it
  through a Concat into x.  Blobs W (4N, K) and b (4N), gate blocks i, f, o, g:
  G = x W^T + b, i, f, o = sigmoid, g = tanh, c = f * c_prev + i * g, h = o * tanh(c); tops h, c (M, N).
- BeamSearchNode (one beam step over rows item * beam_size + beam) and BeamSearch (a whole beam search that
  runs an inner one-step net, beam_search_param.net_param, up to sequence_length times in one forward) are
  read and sized, not run: the fork's CPU and GPU forwards pick different beams (ties broken the opposite
  way, allowed_multiple applied on the GPU only, an end token allowed first on the CPU only), and
  BeamSearch leaves the positions after an early stop as the previous call wrote them.
"""
import torch
from torch import nn

from .registry import AT_LEAST, Layer, LayerError, ReadOnlyLayer, count, need_blobs, positive_field, register_layer


def lstm_node(x, c_prev, weight, bias, cont=None):
    """LSTMNode's step (see the module docstring): -> (h, c), each (M, N)."""
    m, n = x.shape[0], weight.shape[0] // 4
    gates = x.reshape(m, -1) @ weight.t()
    if bias is not None:
        gates = gates + bias
    i, f, o = (torch.sigmoid(gates[:, k * n:(k + 1) * n]) for k in range(3))
    if cont is not None:
        f = f * cont.reshape(m, 1)
    g = torch.tanh(gates[:, 3 * n:])
    c = f * c_prev.reshape(m, n) + i * g
    return o * torch.tanh(c), c


class LSTMNodeStep(nn.Module):
    def __init__(self, cells: int, inputs: int, bias_term: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4 * cells, inputs))
        self.bias = nn.Parameter(torch.zeros(4 * cells)) if bias_term else None

    def forward(self, x, c_prev, cont=None):
        return lstm_node(x, c_prev, self.weight, self.bias, cont)


@register_layer("LSTMNode")
class LSTMNode(Layer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "LSTMNode", (2, 3), 2, "x, c_prev (, cont)")
        p = lp.lstm_param
        return {"cells": positive_field(p.num_cells, "lstm_param.num_cells"), "bias_term": bool(p.bias_term)}

    def infer(self, attrs, in_shapes):
        x = tuple(in_shapes[0])
        if not x:
            raise LayerError("LSTMNode needs an input with a batch axis")
        m, n = x[0], attrs["cells"]
        if count(in_shapes[1]) != m * n:
            raise LayerError(f"LSTMNode's previous cell state must hold M x num_cells = {m} x {n} values, got "
                             f"{list(in_shapes[1])}")
        if len(in_shapes) == 3 and count(in_shapes[2]) != m:
            raise LayerError(f"LSTMNode's continuation flags must hold one value per row ({m}), got "
                             f"{list(in_shapes[2])}")
        attrs["inputs"] = count(x) // m if m else 0
        return [(m, n), (m, n)]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        n = attrs["cells"]
        return [(4 * n, attrs["inputs"]), (4 * n,)] if attrs["bias_term"] else [(4 * n, attrs["inputs"])]

    def macs(self, attrs, in_shapes, out_shapes):
        return in_shapes[0][0] * 4 * attrs["cells"] * attrs["inputs"]

    def forward(self, attrs, params, x, c_prev, cont=None):
        bias = params[1] if attrs["bias_term"] else None
        return lstm_node(x, c_prev, params[0], bias, cont)

    def onnx(self, ctx, node):
        a = node.attrs
        x, c_prev = node.inputs[:2]
        m, n = ctx.shape(x)[0], a["cells"]
        rows = ctx.op("Reshape", [x, ctx.i64([m, -1])], "rows", name=node.name)
        gates = ctx.op("MatMul", [rows, ctx.op("Transpose", [ctx.weight(node, 0)], "wt", perm=[1, 0])], "gates")
        if a["bias_term"]:
            gates = ctx.op("Add", [gates, ctx.weight(node, 1)], "biased")

        def block(k, hint):
            return ctx.op("Slice", [gates, ctx.i64([k * n]), ctx.i64([(k + 1) * n]), ctx.i64([1])], hint)
        i, f, o = (ctx.op("Sigmoid", [block(k, h)], h + "_s") for k, h in enumerate(("i", "f", "o")))
        if len(node.inputs) == 3:
            f = ctx.op("Mul", [f, ctx.op("Reshape", [node.inputs[2], ctx.i64([m, 1])], "cont")], "f_cont")
        g = ctx.op("Tanh", [block(3, "g")], "g_t")
        keep = ctx.op("Mul", [f, ctx.op("Reshape", [c_prev, ctx.i64([m, n])], "c_prev")], "keep")
        ctx.add_node("Add", [keep, ctx.op("Mul", [i, g], "write")], [node.outputs[1]])
        ctx.add_node("Mul", [o, ctx.op("Tanh", [node.outputs[1]], "c_t")], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(LSTMNodeStep, a["cells"], a["inputs"], a["bias_term"], needs=(lstm_node,))
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        t = emit.tmp("lstm")
        emit.stmt(f"{t} = {m}({', '.join(emit.inputs)})")
        return [f"{t}[0]", f"{t}[1]"]


WHY_BEAM = ("the fork's CPU and GPU beam searches choose different beams (ties broken the opposite way, "
            "allowed_multiple applied on the GPU only): caffeq reads and sizes it but does not run it")


def _beam_param(lp):
    p = lp.beam_search_param
    return {"name": lp.name, "beam": positive_field(p.beam_size, "beam_search_param.beam_size"),
            "length": int(p.sequence_length)}


@register_layer("BeamSearchNode")
class BeamSearchNode(ReadOnlyLayer):
    def parse(self, lp):
        a = _beam_param(lp)
        b, t = len(lp.bottom), len(lp.top)
        if b < 1 or not (t == b or t == b + 2):
            raise LayerError(f"BeamSearchNode takes as many tops as bottoms (a later step) or two more (the first "
                             f"step), got {b} bottom(s) and {t} top(s)")
        a["first_step"] = t == b + 2
        return a

    def infer(self, attrs, in_shapes):
        for k, s in enumerate(in_shapes):
            if len(s) != 2:
                raise LayerError(f"BeamSearchNode's bottoms are 2-D (the fork checks it), bottom {k} is {list(s)}")
        n = in_shapes[0][0]
        if attrs["first_step"]:
            steps, states = 0, in_shapes[1:]
        else:
            steps, states = in_shapes[1][1], in_shapes[3:]
            if in_shapes[1][0] != n or in_shapes[2][0] != n:
                raise LayerError(f"BeamSearchNode's scores, sequences and log-probabilities disagree on the rows: "
                                 f"{[list(s) for s in in_shapes[:3]]}")
        return [(n, 1), (n, steps + 1), (n, 1)] + [tuple(s) for s in states]

    def why_not_run(self, attrs):
        return WHY_BEAM


@register_layer("BeamSearch")
class BeamSearch(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "BeamSearch", range(1, AT_LEAST), 3, "the inner net's inputs")
        a = _beam_param(lp)
        p = lp.beam_search_param
        if not (p.HasField("net_param") or p.net):
            raise LayerError("beam_search_param needs the one-step net (net_param or net)")
        positive_field(a["length"], "beam_search_param.sequence_length")
        return a

    def infer(self, attrs, in_shapes):
        batch = in_shapes[0][0] if in_shapes[0] else 1
        if any((s[0] if s else 1) != batch for s in in_shapes):
            raise LayerError(f"BeamSearch's bottoms must share their first axis (the fork checks it), got "
                             f"{[list(s) for s in in_shapes]}")
        b, t = attrs["beam"], attrs["length"]
        return [(batch, 1, b, t), (batch, 1, b), (batch, 1, b, t)]

    def why_not_run(self, attrs):
        return WHY_BEAM.replace("it does not run it", "it does not run it (nor its inner net)")

