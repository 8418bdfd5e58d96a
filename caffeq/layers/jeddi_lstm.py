"""VisionLearningGroup/JEDDi-Net's (76c2769) caption LSTMs of its caffe3d fork: LSTMController and LSTMTopic.
Sources: caffe3d/src/caffe/layers/lstm_controller_layer.cpp, lstm_topic_layer.cpp, recurrent_layer.cpp,
lstm_unit_layer.cpp, caffe3d/include/caffe/layers/lstm_layer.hpp, recurrent_layer.hpp and
caffe3d/src/caffe/proto/caffe.proto (RecurrentParameter).

Both are BVLC's unrolled LSTM (caffeq/layers/recurrent.py) with the fork's RecurrentLayer, which takes up to two
optional bottoms after x (T x N x ...) and cont (T x N): x_static (N x ...) when there are more than
2 (+2 with expose_hidden) bottoms and x_topic (N x ...) when there are more than 3 (+2); with expose_hidden the
initial h_0, c_0 (1 x N x H) follow them, and the tops are h (T x N x H), h_T, c_T.  Per step t (gates in the
order i, f, o, g; LSTMUnit: c_t = cont_t sigmoid(f) c_{t-1} + sigmoid(i) tanh(g), h_t = sigmoid(o) tanh(c_t)):

- LSTMTopic:      gates = W_hc (cont_t h_{t-1}) + (W_xc x_t + b_c) [+ W_xc_static x_static] [+ W_xc_topic x_topic]
- LSTMController: gates = W_hc (cont_t h_{t-1}) + cont_t (W_xc x_t + b_c) [+ W_xc_static x_static]
  (its "x_conted_t" Scale: the input term, bias included, is zeroed where a sequence starts; the static term
  is not).  The controller's unrolled net never reads x_topic: a fourth bottom is checked (N rows) and unused.

x is flattened from axis 2, x_static and x_topic from axis 1.  Blobs, in the order the unrolled net owns them:
W_xc (4H, K), b_c (4H), [W_xc_static (4H, Ks)], [W_xc_topic (4H, Kt)] (LSTMTopic only), W_hc (4H, H).
Without expose_hidden the initial states are zero (a fresh net: Caffe copies h_T, c_T into h_0, c_0 before
each Forward, which a stateless model cannot).  The fork's RecurrentParameter.operation (6, LSTMActOp) is read
and ignored, as the fork's lstm_layer.cpp comments its switch out and these two layers never read it.
"""
import math

import torch

from .recurrent import Recurrent, lstm_steps, onnx_lstm_unit, recurrent_input, sequence_and_cont
from .registry import LayerError, need_blobs, register_layer

# ---- the torch computation (copied into model.py) ------------------------------------------------

def jeddi_lstm(x, cont, h, c, w_xc, b_c, w_hc, x_static: torch.Tensor | None, w_static: torch.Tensor | None,
               x_topic: torch.Tensor | None, w_topic: torch.Tensor | None, cont_scales_input: bool):
    """JEDDi-Net's LSTMTopic (cont_scales_input False) or LSTMController (True): x (T, N, ...), cont (T, N),
    h and c (N, H) -> (h (T, N, H), h_T (N, H), c_T (N, H))."""
    gx = recurrent_input(x, w_xc, b_c, None, None)
    if cont_scales_input:
        gx = gx * cont.unsqueeze(2)
    n = x.shape[1]
    if x_static is not None and w_static is not None:
        gx = gx + torch.matmul(x_static.reshape(n, -1), w_static.t())
    if x_topic is not None and w_topic is not None:
        gx = gx + torch.matmul(x_topic.reshape(n, -1), w_topic.t())
    return lstm_steps(gx, cont, h, c, w_hc)


# ---- the specs ----------------------------------------------------------------------------------

class JeddiLSTM(Recurrent):
    gates = 4
    num_states = 2
    #: LSTMController scales W_xc x_t + b_c by cont_t and has no topic weights
    controller = False

    def parse(self, lp):
        p = lp.recurrent_param
        if p.num_output <= 0:
            raise LayerError("recurrent_param.num_output must be positive")
        expose = bool(p.expose_hidden)
        low = 2 + (2 if expose else 0)
        need_blobs(lp, lp.type, (low, low + 1, low + 2), 3 if expose else 1,
                   "x, cont, [x_static], [x_topic]" + (", h_0, c_0" if expose else ""))
        extra = len(lp.bottom) - low
        return {"num_output": int(p.num_output), "expose_hidden": expose, "static": extra >= 1,
                "topic": extra >= 2}

    def _check(self, attrs, in_shapes):
        x, t, n = sequence_and_cont(in_shapes)
        h = attrs["num_output"]
        extra = []
        for i, (flag, what) in enumerate((("static", "x_static"), ("topic", "x_topic"))):
            if not attrs[flag]:
                extra.append(None)
                continue
            s = tuple(in_shapes[2 + i])
            if len(s) < 1 or s[0] != n:
                raise LayerError(f"bottom[{2 + i}] ({what}) must be N x ... with N = {n}, got {list(s)}")
            extra.append(math.prod(s[1:]))
        if attrs["expose_hidden"]:
            nxt = self._states_at(attrs)
            for j in range(2):
                s = tuple(in_shapes[nxt + j])
                if s != (1, n, h):
                    raise LayerError(f"bottom[{nxt + j}] (initial {'hc'[j]}) must be {[1, n, h]}, got {list(s)}")
        return t, n, math.prod(x[2:]), extra[0], extra[1], h

    def _states_at(self, attrs):
        return 2 + attrs["static"] + attrs["topic"]

    def infer(self, attrs, in_shapes):
        t, n, _, _, _, h = self._check(attrs, in_shapes)
        return [(t, n, h)] + ([(1, n, h)] * 2 if attrs["expose_hidden"] else [])

    def _uses_topic(self, attrs):
        return attrs["topic"] and not self.controller

    def blob_names_for(self, attrs):
        return (("W_xc", "b_c") + (("W_xc_static",) if attrs["static"] else ())
                + (("W_xc_topic",) if self._uses_topic(attrs) else ()) + ("W_hc",))

    def weight_axes_for(self, attrs):
        return {i: 0 for i, name in enumerate(self.blob_names_for(attrs)) if name != "b_c"}

    def param_shapes(self, attrs, in_shapes):
        _, _, k, ks, kt, h = self._check(attrs, in_shapes)
        shapes = [(4 * h, k), (4 * h,)]
        if attrs["static"]:
            shapes.append((4 * h, ks))
        if self._uses_topic(attrs):
            shapes.append((4 * h, kt))
        return shapes + [(4 * h, h)]

    def macs(self, attrs, in_shapes, out_shapes):
        t, n, k, ks, kt, h = self._check(attrs, in_shapes)
        total = t * n * (k + h) * 4 * h + (n * ks * 4 * h if ks else 0)
        return total + (n * kt * 4 * h if kt and self._uses_topic(attrs) else 0)

    def _split(self, attrs, params):
        """(W_xc, b_c, W_xc_static or None, W_xc_topic or None, W_hc) from the blobs."""
        named = dict(zip(self.blob_names_for(attrs), params))
        return (named["W_xc"], named["b_c"], named.get("W_xc_static"), named.get("W_xc_topic"), named["W_hc"])

    def forward(self, attrs, params, *inputs):
        x, cont = inputs[0], inputs[1]
        xs = inputs[2] if attrs["static"] else None
        xt = inputs[3] if self._uses_topic(attrs) else None
        w_xc, b_c, w_s, w_t, w_hc = self._split(attrs, params)
        n, hd = x.shape[1], attrs["num_output"]
        if attrs["expose_hidden"]:
            nxt = self._states_at(attrs)
            h, c = inputs[nxt].reshape(n, hd), inputs[nxt + 1].reshape(n, hd)
        else:
            h = c = x.new_zeros(n, hd)
        hs, h, c = jeddi_lstm(x, cont, h, c, w_xc, b_c, w_hc, xs, w_s, xt, w_t, self.controller)
        if attrs["expose_hidden"]:
            return hs, h.unsqueeze(0), c.unsqueeze(0)
        return hs

    def onnx(self, ctx, node):
        _onnx_unrolled(ctx, node, self)

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(recurrent_input)
        emit.helper(lstm_steps)
        fn = emit.helper(jeddi_lstm)
        weights = {}
        for i, (name, shape) in enumerate(zip(self.blob_names_for(a), node.expected_param_shapes)):
            attr = emit.extra_attr(name)
            weights[name] = emit.module(f"nn.Parameter(torch.zeros({', '.join(map(str, shape))}))", attr=attr)
            emit.param("", i, attr=attr)
        x, cont = emit.inputs[0], emit.inputs[1]
        n, hd = emit.in_shape(0)[1], a["num_output"]
        if a["expose_hidden"]:
            nxt = self._states_at(a)
            h0, c0 = (f"{v}.reshape({n}, {hd})" for v in emit.inputs[nxt:nxt + 2])
        else:
            h0 = c0 = f"{x}.new_zeros({n}, {hd})"
        static = (emit.inputs[2], weights["W_xc_static"]) if a["static"] else ("None", "None")
        topic = (emit.inputs[3], weights["W_xc_topic"]) if self._uses_topic(a) else ("None", "None")
        out = emit.tmp("lstm")
        emit.stmt(f"{out} = {fn}({x}, {cont}, {h0}, {c0}, {weights['W_xc']}, {weights['b_c']}, {weights['W_hc']}, "
                  f"{static[0]}, {static[1]}, {topic[0]}, {topic[1]}, {self.controller})")
        if a["expose_hidden"]:
            return [f"{out}[0]", f"{out}[1].unsqueeze(0)", f"{out}[2].unsqueeze(0)"]
        return f"{out}[0]"


@register_layer("LSTMTopic")
class LSTMTopic(JeddiLSTM):
    """lstm_topic_layer.cpp: BVLC's LSTM plus W_xc_topic x_topic in every step's gate sum."""


@register_layer("LSTMController")
class LSTMController(JeddiLSTM):
    """lstm_controller_layer.cpp: BVLC's LSTM whose input term W_xc x_t + b_c is scaled by cont_t."""
    controller = True


# ---- ONNX: the steps unrolled (T is fixed by the net) -----------------------------------------

def _onnx_unrolled(ctx, node, spec):
    a = node.attrs
    name = node.name
    x, cont = node.inputs[0], node.inputs[1]
    t_len = ctx.shape(x)[0]
    hd = a["num_output"]
    index = {blob: i for i, blob in enumerate(spec.blob_names_for(a))}

    def tmp(hint):
        return ctx.tmp(f"{name}_{hint}")

    # the input terms of every step at once: (T, N, 4H)
    x3 = ctx.add_node("Reshape", [x, ctx.i64([0, 0, -1])], tmp("x3"))
    xw = ctx.add_node("MatMul", [x3, ctx.weight(node, index["W_xc"], transpose=True)], tmp("xw"), name=name)
    gx = ctx.add_node("Add", [xw, ctx.weight(node, index["b_c"])], tmp("gx"))
    if spec.controller:   # x_conted_t = cont_t * (W_xc x_t + b_c)
        cont3 = ctx.add_node("Reshape", [cont, ctx.i64([0, 0, 1])], tmp("cont3"))
        gx = ctx.add_node("Mul", [gx, cont3], tmp("x_conted"))
    for bottom, blob in ((2, "W_xc_static"), (3, "W_xc_topic")):
        if blob in index:
            flat = ctx.add_node("Reshape", [node.inputs[bottom], ctx.i64([0, -1])], tmp(f"{blob}_in"))
            term = ctx.add_node("MatMul", [flat, ctx.weight(node, index[blob], transpose=True)], tmp(blob))
            gx = ctx.add_node("Add", [gx, term], tmp(f"gx_{blob}"))
    w_hc = ctx.weight(node, index["W_hc"], transpose=True)
    if a["expose_hidden"]:
        nxt = spec._states_at(a)
        h = ctx.add_node("Reshape", [node.inputs[nxt], ctx.i64([-1, hd])], tmp("h0"))
        c = ctx.add_node("Reshape", [node.inputs[nxt + 1], ctx.i64([-1, hd])], tmp("c0"))
    else:
        shape = ctx.add_node("Shape", [cont], tmp("shape"))
        n = ctx.add_node("Gather", [shape, ctx.i64([1])], tmp("n"), axis=0)
        dims = ctx.add_node("Concat", [n, ctx.i64([hd])], tmp("dims"), axis=0)
        h = c = ctx.add_node("ConstantOfShape", [dims], tmp("zeros"))
    outs = []
    for step in range(t_len):
        s = ctx.i64(step)
        ct = ctx.add_node("Gather", [cont, s], tmp(f"cont{step}"), axis=0)
        ct = ctx.add_node("Reshape", [ct, ctx.i64([-1, 1])], tmp(f"cont{step}_col"))
        hc = ctx.add_node("Mul", [ct, h], tmp(f"h_conted{step}"))
        hw = ctx.add_node("MatMul", [hc, w_hc], tmp(f"W_hc_h{step}"))
        gxt = ctx.add_node("Gather", [gx, s], tmp(f"gx{step}"), axis=0)
        pre = ctx.add_node("Add", [hw, gxt], tmp(f"gate_input{step}"))
        g3 = ctx.add_node("Reshape", [pre, ctx.i64([-1, 4, hd])], tmp(f"gates{step}"))
        parts = [ctx.add_node("Gather", [g3, ctx.i64(k)], tmp(f"gate{step}_{k}"), axis=1) for k in range(4)]
        h, c = onnx_lstm_unit(lambda op, ins, hint: ctx.add_node(op, ins, tmp(hint)), parts, ct, c, str(step))
        outs.append(ctx.add_node("Reshape", [h, ctx.i64([1, -1, hd])], tmp(f"h{step}_3d")))
    if len(outs) == 1:
        ctx.add_node("Identity", outs, [node.outputs[0]])
    else:
        ctx.add_node("Concat", outs, [node.outputs[0]], axis=0)
    if a["expose_hidden"]:
        for out, st in zip(node.outputs[1:], (h, c)):
            ctx.add_node("Reshape", [st, ctx.i64([1, -1, hd])], [out])


__all__ = ["LSTMController", "LSTMTopic", "jeddi_lstm"]
