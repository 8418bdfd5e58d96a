"""RNN and LSTM with the semantics of BVLC Caffe's unrolled recurrent nets.

Bottoms: x (T x N x ...), cont (T x N), optionally x_static (N x ...), and
with expose_hidden the initial states (1 x N x H each: h0, plus c0 for LSTM).
Tops: the per-step output (T x N x H), and with expose_hidden the final
states (h_T, plus c_T for LSTM).  A third-from-last bottom is x_static only
when there is one bottom more than the minimum, as recurrent_layer.cpp decides.

Per step t (rnn_layer.cpp, lstm_layer.cpp, lstm_unit_layer.cpp):
    h' = cont_t * h_{t-1}                 (cont_t == 0 starts a new sequence)
  RNN:  h_t = tanh(W_hh h' + W_xh x_t + b_h [+ W_xh_static x_static])
        o_t = tanh(W_ho h_t + b_o)        (the top is o)
  LSTM: [i f o g] = W_hc h' + W_xc x_t + b_c [+ W_xc_static x_static]
        c_t = cont_t * sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g)
        h_t = sigmoid(o) * tanh(c_t)      (the top is h)
x is flattened from axis 2, x_static from axis 1.  Without expose_hidden the
initial states are zero (a fresh Caffe net; Caffe would carry h_T into the
next Forward call, which a stateless model cannot).

LRCN's lisa-caffe-public LSTM (LRCN_model 8d19f1d lstm_layer.cpp, lstm_unit_layer.cpp; a layer with
lstm_param { hidden_dim buffer_size } and no recurrent_param, V1 type LSTM) is the same recurrence on
frame-major batches: x (T * N, ...) with N = buffer_size streams, the flush markers (T * N, 1, 1, 1) as
cont, the top (T * N, hidden_dim, 1, 1); blobs W_xc, b_c, W_hc as above.

junhyukoh/caffe-lstm's first LSTM (b193dfb0; V1 type LSTM with one bottom, sized by inner_product_param) is
read by LSTM below through caffe_lstm_windows.py, which holds its computation.

Blobs, in the order Caffe's unrolled net owns them:
  RNN:  W_xh (H, K), b_h (H), [W_xh_static (H, Ks)], W_hh (H, H), W_ho (H, H), b_o (H)
  LSTM: W_xc (4H, K), b_c (4H), [W_xc_static (4H, Ks)], W_hc (4H, H)
"""
from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn

from ..errors import ExportError
from .caffe_lstm_windows import (
    _onnx_single_sequence,
    _single_sequence,
    exp_tanh,
    single_sequence_attrs,
    single_sequence_dims,
    single_sequence_init,
    single_sequence_lstm,
    single_sequence_param_shapes,
)
from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer

FLOAT = 1  # onnx.TensorProto.FLOAT


# ---- the torch computation, shared by forward and the model.py modules ------------------------

def recurrent_input(x, w, b, x_static: torch.Tensor | None, w_static: torch.Tensor | None,
                    static_first_only: bool = False):
    """W x_t + b for every step t at once, plus W_static x_static when there is one: (T, N, G).
    static_first_only (DSCLRCN's static_input_only_start): the static term at the first step only."""
    t, n = x.shape[0], x.shape[1]
    gx = torch.matmul(x.reshape(t, n, -1), w.t()) + b
    if x_static is not None and w_static is not None:
        static = torch.matmul(x_static.reshape(x_static.shape[0], -1), w_static.t())
        gx = torch.cat([gx[:1] + static, gx[1:]]) if static_first_only else gx + static
    return gx


def sequence_and_cont(in_shapes):
    """Caffe's RecurrentLayer checks on bottoms 0 (x: T x N x ...) and 1 (cont: T x N) -> (x shape, T, N)."""
    x, cont = tuple(in_shapes[0]), tuple(in_shapes[1])
    if len(x) < 2:
        raise LayerError(f"bottom[0] must have at least 2 axes (T x N x ...), got {list(x)}")
    t, n = x[0], x[1]
    if cont != (t, n):
        raise LayerError(f"bottom[1] (cont) must be T x N = {[t, n]}, got {list(cont)}")
    return x, t, n


def add_input_weights(module, gate: str, rows: int, num_input: int, num_static: int):
    """The input terms' parameters of a recurrent module: W_x<gate> (rows, num_input), b_<gate> (rows)
    and, with a static input, W_x<gate>_static (rows, num_static) (else registered as None)."""
    module.register_parameter(f"W_x{gate}", nn.Parameter(torch.zeros(rows, num_input)))
    module.register_parameter(f"b_{gate}", nn.Parameter(torch.zeros(rows)))
    static = nn.Parameter(torch.zeros(rows, num_static)) if num_static else None
    module.register_parameter(f"W_x{gate}_static", static)


def rnn_steps(gx, cont, h, w_hh, w_ho, b_o):
    """Caffe's RNN steps from the input terms gx (T, N, H) and h_0 (N, H) -> (o (T, N, H), h_T)."""
    outs = []
    for step in range(gx.shape[0]):
        h = torch.tanh(torch.matmul(cont[step].unsqueeze(1) * h, w_hh.t()) + gx[step])
        outs.append(torch.tanh(torch.matmul(h, w_ho.t()) + b_o))
    o = torch.stack(outs) if gx.shape[0] > 0 else gx.new_zeros(0, h.shape[0], h.shape[1])
    return o, h


def lstm_steps(gx, cont, h, c, w_hc, forget_bias: float = 0.0):
    """Caffe's LSTM steps from the input terms gx (T, N, 4H), h_0 and c_0 (N, H) -> (h (T, N, H),
    h_T, c_T).  forget_bias: DSCLRCN's lstm_additional_forget_bias, added to f before its sigmoid."""
    hd = h.shape[1]
    outs = []
    for step in range(gx.shape[0]):
        ct = cont[step].unsqueeze(1)
        gates = torch.matmul(ct * h, w_hc.t()) + gx[step]
        i = torch.sigmoid(gates[:, :hd])
        f_pre = gates[:, hd:2 * hd] + forget_bias if forget_bias else gates[:, hd:2 * hd]
        f = ct * torch.sigmoid(f_pre)  # lstm_unit_layer.cpp: f = 0 where cont == 0
        o = torch.sigmoid(gates[:, 2 * hd:3 * hd])
        g = torch.tanh(gates[:, 3 * hd:])
        c = f * c + i * g
        h = o * torch.tanh(c)
        outs.append(h)
    hs = torch.stack(outs) if gx.shape[0] > 0 else gx.new_zeros(0, h.shape[0], hd)
    return hs, h, c


class CaffeRNN(nn.Module):
    """Caffe's RNN unrolled over time: x (T, N, ...), cont (T, N) (0 starts a new sequence),
    optional x_static (N, ...) and the initial h0 (1, N, H) (default zeros); per step
    h_t = tanh(W_hh (cont_t * h_{t-1}) + W_xh x_t + b_h [+ W_xh_static x_static]),
    o_t = tanh(W_ho h_t + b_o).  Returns (o (T, N, H), h_T (1, N, H))."""

    def __init__(self, num_input, num_output, num_static=0, static_first_only=False):
        super().__init__()
        h = num_output
        self.num_output = num_output
        self.static_first_only = static_first_only
        add_input_weights(self, "h", h, num_input, num_static)
        self.W_hh = nn.Parameter(torch.zeros(h, h))
        self.W_ho = nn.Parameter(torch.zeros(h, h))
        self.b_o = nn.Parameter(torch.zeros(h))

    def forward(self, x, cont, x_static: torch.Tensor | None = None, h0: torch.Tensor | None = None):
        if self.W_xh_static is not None and x_static is None:
            raise ValueError("this layer has a static input: pass x_static")
        gx = recurrent_input(x, self.W_xh, self.b_h, x_static, self.W_xh_static, self.static_first_only)
        n, hd = x.shape[1], self.num_output
        h = h0.reshape(n, hd) if h0 is not None else gx.new_zeros(n, hd)
        o, h = rnn_steps(gx, cont, h, self.W_hh, self.W_ho, self.b_o)
        return o, h.unsqueeze(0)


class CaffeLSTM(nn.Module):
    """Caffe's LSTM unrolled over time: x (T, N, ...), cont (T, N) (0 starts a new sequence),
    optional x_static (N, ...) and the initial h0, c0 (1, N, H) (default zeros); per step
    [i f o g] = W_hc (cont_t * h_{t-1}) + W_xc x_t + b_c [+ W_xc_static x_static],
    c_t = cont_t * sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g), h_t = sigmoid(o) * tanh(c_t).
    Returns (h (T, N, H), h_T (1, N, H), c_T (1, N, H))."""

    def __init__(self, num_input, num_output, num_static=0, forget_bias=0.0, static_first_only=False):
        super().__init__()
        self.num_output = num_output
        self.forget_bias = forget_bias
        self.static_first_only = static_first_only
        add_input_weights(self, "c", 4 * num_output, num_input, num_static)
        self.W_hc = nn.Parameter(torch.zeros(4 * num_output, num_output))

    def forward(self, x, cont, x_static: torch.Tensor | None = None, h0: torch.Tensor | None = None,
                c0: torch.Tensor | None = None):
        if self.W_xc_static is not None and x_static is None:
            raise ValueError("this layer has a static input: pass x_static")
        gx = recurrent_input(x, self.W_xc, self.b_c, x_static, self.W_xc_static, self.static_first_only)
        n, hd = x.shape[1], self.num_output
        if h0 is not None and c0 is not None:
            h, c = h0.reshape(n, hd), c0.reshape(n, hd)
        else:
            h = gx.new_zeros(n, hd)
            c = h
        hs, h, c = lstm_steps(gx, cont, h, c, self.W_hc, self.forget_bias)
        return hs, h.unsqueeze(0), c.unsqueeze(0)


class Recurrent(Layer):
    gates = 1           # rows of W per hidden unit
    num_states = 1      # h (RNN) or h, c (LSTM)

    def parse(self, lp):
        p = lp.recurrent_param
        if p.num_output <= 0:
            raise LayerError("recurrent_param.num_output must be positive")
        expose = bool(p.expose_hidden)
        low = 2 + (self.num_states if expose else 0)
        need_blobs(lp, lp.type, (low, low + 1))
        static = len(lp.bottom) == low + 1
        # DSCLRCN's fork (RNN and LSTM): the static input at the first step only
        return {"num_output": int(p.num_output), "expose_hidden": expose, "static": static,
                "static_first_only": bool(p.static_input_only_start) and static}

    def _check(self, attrs, in_shapes):
        x, t, n = sequence_and_cont(in_shapes)
        h = attrs["num_output"]
        k = math.prod(x[2:])
        ks = None
        nxt = 2
        if attrs["static"]:
            xs = tuple(in_shapes[2])
            if len(xs) < 1 or xs[0] != n:
                raise LayerError(f"bottom[2] (x_static) must be N x ... with N = {n}, got {list(xs)}")
            ks = math.prod(xs[1:])
            nxt = 3
        if attrs["expose_hidden"]:
            for j in range(self.num_states):
                s = tuple(in_shapes[nxt + j])
                if s != (1, n, h):
                    raise LayerError(f"bottom[{nxt + j}] (initial {'hc'[j]}) must be "
                                     f"{[1, n, h]}, got {list(s)}")
        return t, n, k, ks, h

    def infer(self, attrs, in_shapes):
        t, n, _, _, h = self._check(attrs, in_shapes)
        tops = [(t, n, h)]
        if attrs["expose_hidden"]:
            tops += [(1, n, h)] * self.num_states
        return tops

    def init_params(self, attrs, shapes, rng):
        # Caffe's default filler is constant 0; small random weights make a useful random model
        return [(rng.standard_normal(s) / math.sqrt(s[1])).astype(np.float32) if len(s) == 2
                else np.zeros(s, np.float32) for s in shapes]

    def macs(self, attrs, in_shapes, out_shapes):
        t, n, k, ks, h = self._check(attrs, in_shapes)
        g = self.gates * h
        total = t * n * (k * g + h * g) + (n * ks * g if ks else 0)
        if self.gates == 1:  # RNN's output projection
            total += t * n * h * h
        return total

    # -- helpers for forward ----------------------------------------------------------
    def _unpack(self, attrs, inputs):
        x, cont = inputs[0], inputs[1]
        nxt = 2
        xs = None
        if attrs["static"]:
            xs, nxt = inputs[2], 3
        states = list(inputs[nxt:nxt + self.num_states]) if attrs["expose_hidden"] else None
        return x, cont, xs, states


@register_layer("RNN")
class RNN(Recurrent):
    # names without x_static (with it, Caffe's order inserts W_xh_static at index 2)
    blob_names = ("W_xh", "b_h", "W_hh", "W_ho", "b_o")
    weight_axes = {0: 0, 2: 0, 3: 0}

    def blob_names_for(self, attrs):
        if attrs["static"]:
            return ("W_xh", "b_h", "W_xh_static", "W_hh", "W_ho", "b_o")
        return self.blob_names

    def weight_axes_for(self, attrs):
        return {0: 0, 2: 0, 3: 0, 4: 0} if attrs["static"] else {0: 0, 2: 0, 3: 0}

    def param_shapes(self, attrs, in_shapes):
        _, _, k, ks, h = self._check(attrs, in_shapes)
        shapes = [(h, k), (h,)]
        if attrs["static"]:
            shapes.append((h, ks))
        return shapes + [(h, h), (h, h), (h,)]

    def forward(self, attrs, params, *inputs):
        x, cont, xs, states = self._unpack(attrs, inputs)
        if attrs["static"]:
            w_xh, b_h, w_static, w_hh, w_ho, b_o = params
        else:
            (w_xh, b_h, w_hh, w_ho, b_o), w_static = params, None
        gx = recurrent_input(x, w_xh, b_h, xs, w_static, attrs.get("static_first_only", False))
        n, hdim = x.shape[1], attrs["num_output"]
        h = states[0].reshape(n, hdim) if states is not None else gx.new_zeros(n, hdim)
        o, h = rnn_steps(gx, cont, h, w_hh, w_ho, b_o)
        if attrs["expose_hidden"]:
            return o, h.unsqueeze(0)
        return o

    def onnx(self, ctx, node):
        _onnx_recurrent(ctx, node, lstm=False)

    def pytorch_source(self, node, emit):
        return _recurrent_source(node, emit, CaffeRNN, rnn_steps)


def frame_major_lstm(x, flush, w_xc, b_c, w_hc, streams: int):
    """lisa-caffe-public's LSTM: x (T * streams, ...) and flush (T * streams, ...) frame-major, zero
    initial states -> (T * streams, H, 1, 1)."""
    t = x.shape[0] // streams
    gx = recurrent_input(x.reshape(t, streams, -1), w_xc, b_c, None, None)
    zeros = gx.new_zeros(streams, w_hc.shape[1])
    hs, _, _ = lstm_steps(gx, flush.reshape(t, streams), zeros, zeros, w_hc)
    return hs.reshape(t * streams, -1, 1, 1)


# tonghe90/textspotter aa36bbc names BVLC's LSTM "LSTMNew" (its recurrent_param at 176, clipping_threshold at
# 4 and the flags one later: a binary-file difference only)
@register_layer("LSTM", "LSTMNew")
class LSTM(Recurrent):
    blob_names = ("W_xc", "b_c", "W_hc")
    weight_axes = {0: 0, 2: 0}

    def blob_names_for(self, attrs):
        if attrs.get("single_sequence"):
            return ("W_i", "W_h", "b")[:3 if attrs["bias_term"] else 2]
        return ("W_xc", "b_c", "W_xc_static", "W_hc") if attrs["static"] else self.blob_names

    def weight_axes_for(self, attrs):
        if attrs.get("single_sequence"):
            return {}
        return {0: 0, 2: 0, 3: 0} if attrs["static"] else {0: 0, 2: 0}
    gates = 4
    num_states = 2

    def parse(self, lp):
        if _single_sequence(lp):   # junhyukoh/caffe-lstm b193dfb0
            return single_sequence_attrs(lp)
        if not lp.HasField("lstm_param") or lp.HasField("recurrent_param"):
            attrs = super().parse(lp)
            # DSCLRCN's fork: a constant added to every step's forget-gate pre-activation
            attrs["forget_bias"] = float(np.float32(lp.recurrent_param.lstm_additional_forget_bias))
            return attrs
        p = lp.lstm_param   # lisa-caffe-public's frame-major LSTM
        need_blobs(lp, "LSTM (lisa-caffe's)", 2, 1, "data, flush markers")
        if p.hidden_dim <= 0 or p.buffer_size <= 0:
            raise LayerError(f"lstm_param.hidden_dim and buffer_size must be positive, got {p.hidden_dim} and "
                             f"{p.buffer_size}")
        if p.diagonal_cell_gates:
            raise LayerError("lstm_param.diagonal_cell_gates (lisa-caffe's LRCN_video_deploy peephole terms) is not "
                             "supported; caffeq runs its LSTM without them")
        return {"num_output": int(p.hidden_dim), "streams": int(p.buffer_size), "expose_hidden": False,
                "static": False}

    def stored_blobs(self, attrs, arrays, notes):
        """lisa-caffe's LRCN_video_deploy (c04d2a0) LSTM keeps 12 blobs, one a gate: W_x i, b_i, W_x f, b_f,
        W_x c, b_c, W_x o, b_o, then W_h i, W_h f, W_h c, W_h o; fused here into LRCN_model's (8d19f1d)
        three in the gate order i, f, o, g."""
        if "streams" not in attrs or len(arrays) != 12:
            return arrays
        h = attrs["num_output"]
        x_w, bias, h_w = arrays[0:8:2], arrays[1:8:2], arrays[8:12]
        k = x_w[0].size // h
        if any(w.size != h * k for w in x_w) or any(b.size != h for b in bias) or any(w.size != h * h for w in h_w):
            return arrays   # not the fork's gate blobs: the blob count then refuses them in one line
        order = (0, 1, 3, 2)   # stored i, f, c, o -> i, f, o, g (= c)
        notes.append("LSTM weights stored as lisa-caffe's LRCN_video_deploy (c04d2a0) keeps them, a blob a gate "
                     "in the order i, f, c, o: fused into W_xc, b, W_hc in the order i, f, o, g")
        return [np.concatenate([x_w[i].reshape(h, -1) for i in order]),
                np.concatenate([bias[i].reshape(h) for i in order]),
                np.concatenate([h_w[i].reshape(h, h) for i in order])]

    def _check(self, attrs, in_shapes):
        if attrs.get("single_sequence"):
            return single_sequence_dims(attrs, in_shapes)
        if "streams" not in attrs:
            return super()._check(attrs, in_shapes)
        x, flush, streams = tuple(in_shapes[0]), tuple(in_shapes[1]), attrs["streams"]
        if not x or x[0] % streams or x[0] < streams:
            raise LayerError(f"the bottom's {x[0] if x else 0} items are not a whole number of time steps of "
                             f"lstm_param.buffer_size {streams} streams")
        if legacy_nchw(flush, "the flush markers") != (x[0], 1, 1, 1):
            raise LayerError(f"the flush markers must be ({x[0]}, 1, 1, 1), one per item, got {list(flush)}")
        return x[0] // streams, streams, math.prod(x[1:]), None, attrs["num_output"]

    def infer(self, attrs, in_shapes):
        if attrs.get("single_sequence"):
            t, _, _, _, h = self._check(attrs, in_shapes)
            return [(t, h, 1, 1)]
        if "streams" not in attrs:
            return super().infer(attrs, in_shapes)
        t, n, _, _, h = self._check(attrs, in_shapes)
        return [(t * n, h, 1, 1)]

    def param_shapes(self, attrs, in_shapes):
        _, _, k, ks, h = self._check(attrs, in_shapes)
        if attrs.get("single_sequence"):
            return single_sequence_param_shapes(attrs, k, h)
        shapes = [(4 * h, k), (4 * h,)]
        if attrs["static"]:
            shapes.append((4 * h, ks))
        return shapes + [(4 * h, h)]

    def init_params(self, attrs, shapes, rng):
        if attrs.get("single_sequence"):
            return single_sequence_init(shapes, rng)
        return super().init_params(attrs, shapes, rng)

    def forward(self, attrs, params, *inputs):
        if attrs.get("single_sequence"):
            return single_sequence_lstm(inputs[0], *params)
        if "streams" in attrs:
            return frame_major_lstm(inputs[0], inputs[1], *params, attrs["streams"])
        x, cont, xs, states = self._unpack(attrs, inputs)
        if attrs["static"]:
            w_xc, b_c, w_static, w_hc = params
        else:
            (w_xc, b_c, w_hc), w_static = params, None
        gx = recurrent_input(x, w_xc, b_c, xs, w_static, attrs.get("static_first_only", False))
        n, hd = x.shape[1], attrs["num_output"]
        if states is not None:
            h, c = states[0].reshape(n, hd), states[1].reshape(n, hd)
        else:
            h = c = gx.new_zeros(n, hd)
        hs, h, c = lstm_steps(gx, cont, h, c, w_hc, attrs.get("forget_bias", 0.0))
        if attrs["expose_hidden"]:
            return hs, h.unsqueeze(0), c.unsqueeze(0)
        return hs

    def onnx(self, ctx, node):
        if node.attrs.get("single_sequence"):
            _onnx_single_sequence(ctx, node)
            return
        if "streams" not in node.attrs:
            _onnx_recurrent(ctx, node, lstm=True)
            return
        # lisa-caffe's frame-major batch: (T, N, ...) in, the usual Scan, (T * N, H, 1, 1) out
        n, name = node.attrs["streams"], node.name
        x = ctx.add_node("Reshape", [node.inputs[0], ctx.i64([-1, n, math.prod(ctx.shape(node.inputs[0])[1:])])],
                         [ctx.tmp(name + "_steps")], name=name)[0]
        cont = ctx.add_node("Reshape", [node.inputs[1], ctx.i64([-1, n])], [ctx.tmp(name + "_flush")])[0]
        inner = copy.copy(node)
        inner.inputs, inner.outputs = [x, cont], [ctx.tmp(name + "_h")]
        _onnx_recurrent(ctx, inner, lstm=True)
        ctx.add_node("Reshape", [inner.outputs[0], ctx.i64([-1, node.attrs["num_output"], 1, 1])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        single = node.attrs.get("single_sequence")
        if "streams" not in node.attrs and not single:
            return _recurrent_source(node, emit, CaffeLSTM, lstm_steps)
        if single:
            emit.helper(exp_tanh)
            fn = emit.helper(single_sequence_lstm)
        else:
            emit.helper(recurrent_input)
            emit.helper(lstm_steps)
            fn = emit.helper(frame_major_lstm)
        weights = []
        for i, (name, shape) in enumerate(zip(self.blob_names_for(node.attrs), node.expected_param_shapes)):
            attr = emit.extra_attr(name)
            weights.append(emit.module(f"nn.Parameter(torch.zeros({', '.join(map(str, shape))}))", attr=attr))
            emit.param("", i, attr=attr)
        if single:
            return f"{fn}({emit.inputs[0]}, {', '.join(weights)})"
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {', '.join(weights)}, {node.attrs['streams']})"


# ---- standalone PyTorch source -----------------------------------------------------------

def _recurrent_source(node, emit, module, steps):
    a = node.attrs
    x, cont = emit.inputs[0], emit.inputs[1]
    k = math.prod(emit.in_shape(0)[2:])
    args = [str(k), str(a["num_output"])]
    call = [x, cont]
    nxt = 2
    if a["static"]:
        args.append(f"num_static={math.prod(emit.in_shape(2)[1:])}")
        call.append(emit.inputs[2])
        nxt = 3
    if a.get("forget_bias"):
        args.append(f"forget_bias={emit.lit(a['forget_bias'])}")
    if a.get("static_first_only"):
        args.append("static_first_only=True")
    if a["expose_hidden"]:
        names = ("h0", "c0")[:len(emit.inputs) - nxt]
        call += [f"{name}={v}" for name, v in zip(names, emit.inputs[nxt:])]
    # model.py gets these very functions and classes: the export computes what forward does
    emit.helper(recurrent_input)
    emit.helper(add_input_weights)
    emit.helper(steps)
    m = emit.module(f"{emit.helper(module)}({', '.join(args)})")
    for i, name in enumerate(node.spec.blob_names_for(a)):
        emit.param(name, i)
    # the module returns the sequence and the final states; Caffe's tops are the final states
    # only with expose_hidden
    return f"{m}({', '.join(call)})" + ("" if a["expose_hidden"] else "[0]")


# ---- ONNX: a Scan over the time axis --------------------------------------------------

def onnx_lstm_unit(add, gates, cont, c_prev, suffix, activation="Tanh"):
    """Caffe's LSTMUnit (lstm_unit_layer.cpp) as ONNX nodes, one step: from the pre-activations
    gates = (i, f, o, g), cont_t and c_{t-1}, c_t = cont_t sigmoid(f) c_{t-1} + sigmoid(i) tanh(g)
    and h_t = sigmoid(o) tanh(c_t) (with activation "Relu", ConvLSTMReLU's relu for both tanh).
    Shared by LSTM's Scan body and ConvLSTM's unrolled steps, which place their nodes differently:
    add(op, inputs, hint) makes one node and returns its output name; suffix ends every hint.
    Returns (h_t, c_t)."""
    i = add("Sigmoid", [gates[0]], f"i{suffix}")
    f = add("Mul", [cont, add("Sigmoid", [gates[1]], f"f_raw{suffix}")], f"f{suffix}")   # f = 0 where cont == 0
    o = add("Sigmoid", [gates[2]], f"o{suffix}")
    g = add(activation, [gates[3]], f"g{suffix}")
    c = add("Add", [add("Mul", [f, c_prev], f"fc{suffix}"), add("Mul", [i, g], f"ig{suffix}")], f"c{suffix}")
    h = add("Mul", [o, add(activation, [c], f"act_c{suffix}")], f"h{suffix}")
    return h, c


def _onnx_recurrent(ctx, node, lstm):
    """Emit the recurrence as an ONNX Scan over axis 0, so T and N both stay dynamic.

    Outside the loop: the input transform for all steps at once (MatMul over
    T x N x K) and the static term.  The loop body reads the weights from the
    outer graph.
    """
    try:
        from onnx import helper
    except ImportError as e:  # pragma: no cover - onnx is a dependency of export
        raise ExportError(f"layer '{node.name}': the onnx package is needed: {e}") from None
    if ctx.opset < 9:
        raise ExportError(f"layer '{node.name}' ({node.type}): ONNX export needs opset >= 9 (Scan)")
    a = node.attrs
    hd = a["num_output"]
    g = 4 * hd if lstm else hd
    x, cont = node.inputs[0], node.inputs[1]
    nxt = 2
    if a["static"]:
        xs, nxt = node.inputs[2], 3
    nstates = 2 if lstm else 1
    name = node.name

    def tmp(hint):
        return ctx.tmp(f"{name}_{hint}")

    # gx = x W^T + b (+ x_static W_static^T): T x N x G
    x3 = tmp("x3")
    ctx.add_node("Reshape", [x, ctx.i64([0, 0, -1])], [x3])
    xw = tmp("xw")
    ctx.add_node("MatMul", [x3, ctx.weight(node, 0, transpose=True)], [xw], name=name)
    gx = tmp("gx")
    ctx.add_node("Add", [xw, ctx.weight(node, 1)], [gx])
    widx = 2
    if a["static"]:
        xs2 = tmp("xs2")
        ctx.add_node("Reshape", [xs, ctx.i64([0, -1])], [xs2])
        sw = tmp("static")
        ctx.add_node("MatMul", [xs2, ctx.weight(node, 2, transpose=True)], [sw])
        gx_all = tmp("gx_static")
        if a.get("static_first_only"):   # the static term at the first step only
            first = ctx.add_node("Slice", [gx, ctx.i64([0]), ctx.i64([1]), ctx.i64([0])], tmp("gx_first"))
            rest = ctx.add_node("Slice", [gx, ctx.i64([1]), ctx.i64([2 ** 62]), ctx.i64([0])], tmp("gx_rest"))
            ctx.add_node("Concat", [ctx.add_node("Add", [first, sw], tmp("gx_first_static")), rest], [gx_all], axis=0)
        else:
            ctx.add_node("Add", [gx, sw], [gx_all])
        gx = gx_all
        widx = 3
    w_h = ctx.weight(node, widx, transpose=True)          # H x G
    if not lstm:
        w_o = ctx.weight(node, widx + 1, transpose=True)  # H x H
        b_o = ctx.weight(node, widx + 2)

    # initial states, N x H
    if a["expose_hidden"]:
        init = []
        for j in range(nstates):
            s0 = tmp(f"s{j}_0")
            ctx.add_node("Reshape", [node.inputs[nxt + j], ctx.i64([-1, hd])], [s0])
            init.append(s0)
    else:
        shape = tmp("shape")
        ctx.add_node("Shape", [cont], [shape])
        n = tmp("n")
        ctx.add_node("Gather", [shape, ctx.i64([1])], [n], axis=0)
        nh = tmp("nh")
        ctx.add_node("Concat", [n, ctx.i64([hd])], [nh], axis=0)
        zeros = tmp("zeros")
        ctx.add_node("ConstantOfShape", [nh], [zeros])
        init = [zeros] * nstates

    # the body: states (N x H), scan inputs gx_t (N x G), cont_t (N)
    body_nodes = []

    def bn(op, ins, outs_, **kw):
        body_nodes.append(helper.make_node(op, ins, outs_, **kw))
        return outs_[0]

    def vi(nm, shape):
        return helper.make_tensor_value_info(nm, FLOAT, shape)

    def bconst(v, hint, dtype=7):
        # constants of the body live in the body (no reliance on outer-scope initializers); int64 unless told
        out = tmp(hint)
        body_nodes.append(helper.make_node("Constant", [], [out],
                                           value=helper.make_tensor(out + "_value", dtype, [len(v)], v)
                                           if isinstance(v, list) else
                                           helper.make_tensor(out + "_value", dtype, [], [v])))
        return out

    h_in = tmp("h_prev")
    c_in = tmp("c_prev") if lstm else None
    gx_t = tmp("gx_t")
    cont_t = tmp("cont_t")
    cont_col = bn("Reshape", [cont_t, bconst([-1, 1], "shape_col")], [tmp("cont_col")])
    h_conted = bn("Mul", [cont_col, h_in], [tmp("h_conted")])
    hw = bn("MatMul", [h_conted, w_h], [tmp("hw")])
    pre = bn("Add", [hw, gx_t], [tmp("pre")])
    if lstm:
        g4 = bn("Reshape", [pre, bconst([0, 4, hd], "shape_gates")], [tmp("gates")])
        parts = [bn("Gather", [g4, bconst(k, f"index{k}")], [tmp(f"gate{k}")], axis=1) for k in range(4)]
        if a.get("forget_bias"):
            parts[1] = bn("Add", [parts[1], bconst(a["forget_bias"], "forget_bias", FLOAT)], [tmp("gate1_biased")])
        h_out, c_out = onnx_lstm_unit(lambda op, ins, hint: bn(op, ins, [tmp(hint)]), parts, cont_col, c_in, "_t")
        y_out = tmp("y_t")
        bn("Identity", [h_out], [y_out])
        state_in, state_out = [h_in, c_in], [h_out, c_out]
    else:
        h_out = bn("Tanh", [pre], [tmp("h_t")])
        ho = bn("MatMul", [h_out, w_o], [tmp("ho")])
        ob = bn("Add", [ho, b_o], [tmp("ob")])
        y_out = bn("Tanh", [ob], [tmp("o_t")])
        state_in, state_out = [h_in], [h_out]
    body = helper.make_graph(
        body_nodes, f"{name}_step",
        [vi(s, [None, hd]) for s in state_in] + [vi(gx_t, [None, g]), vi(cont_t, [None])],
        [vi(s, [None, hd]) for s in state_out] + [vi(y_out, [None, hd])])

    finals = [tmp(f"final{j}") for j in range(nstates)]
    ctx.add_node("Scan", init + [gx, cont], finals + [node.outputs[0]], name=f"{name}_scan",
                 body=body, num_scan_inputs=2)
    if a["expose_hidden"]:
        for j in range(nstates):
            ctx.add_node("Reshape", [finals[j], ctx.i64([1, -1, hd])], [node.outputs[1 + j]])


# ---- LSTMUnit: one step on its own ------------------------------------------------------

def lstm_unit(c_prev, gates, cont):
    """BVLC's LSTMUnit (lstm_unit_layer.cpp), one step of N streams: c_{t-1} (1, N, D), the gates'
    pre-activations (1, N, 4D) in the order i, f, o, g, and cont (1, N) -> (c_t, h_t), each (1, N, D).
    f is cont * sigmoid(pre_f) as in LSTM's steps; Caffe sets f = 0 where cont is 0, which differs only when
    pre_f or c_{t-1} is infinite or NaN."""
    i, f, o, g = gates.split(c_prev.shape[2], dim=2)
    c = cont.unsqueeze(2) * torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(g)
    return c, torch.sigmoid(o) * torch.tanh(c)


@register_layer("LSTMUnit")
class LSTMUnit(Layer):
    """The step BVLC's LSTM unrolls into, as a layer of its own (nets written, or dumped from Caffe's
    log, as an unrolled LSTM): bottoms c_{t-1}, the gate pre-activations and cont; tops c_t, h_t."""

    def parse(self, lp):
        need_blobs(lp, "LSTMUnit", 3, 2, "c_prev, gates, cont")
        return {}

    def infer(self, attrs, in_shapes):
        c, gates, cont = (tuple(s) for s in in_shapes)
        # lstm_unit_layer.cpp Reshape's CHECKs
        if len(c) != 3 or len(gates) != 3 or len(cont) != 2 or {c[0], gates[0], cont[0]} != {1} \
                or gates[1] != c[1] or cont[1] != c[1] or gates[2] != 4 * c[2]:
            raise LayerError(f"LSTMUnit takes c_prev (1, N, D), gates (1, N, 4D) and cont (1, N), "
                             f"got {list(c)}, {list(gates)} and {list(cont)}")
        return [c, c]

    def forward(self, attrs, params, c_prev, gates, cont):
        return lstm_unit(c_prev, gates, cont)

    def onnx(self, ctx, node):
        c_prev, gates, cont = node.inputs
        d = ctx.shape(c_prev)[2]
        parts = ctx.add_node("Split", [gates, ctx.i64([d] * 4)], [ctx.tmp(f"{node.name}_gate{k}") for k in range(4)],
                             axis=2)
        cont3 = ctx.op("Unsqueeze", [cont, ctx.i64([2])], "cont")
        h, c = onnx_lstm_unit(lambda op, ins, hint: ctx.op(op, ins, hint), parts, cont3, c_prev, "")
        ctx.add_node("Identity", [c], [node.outputs[0]])
        ctx.add_node("Identity", [h], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(lstm_unit)}({', '.join(emit.inputs)})"
