"""MyCaffe's Temporal Fusion Transformer, its temporal layers (sources and shared conventions: mycaffe_tft.py).
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

from ..io.schema import caffe_pb2
from .mycaffe_tft_ops import (
    TftOnnx,
    emit_tft_blobs,
    init_tft_blobs,
    ip_shapes,
    tft_linear,
    tft_mha_interp,
    tft_reshape_before,
)
from .registry import (
    Layer,
    LayerError,
    ReadOnlyLayer,
    claim_layers,
    count,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)

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
        return ip_shapes(k, hd) * 2 + ip_shapes(k, d) + ip_shapes(d, d)

    def init_params(self, attrs, shapes, rng):
        return init_tft_blobs(shapes, rng)

    def macs(self, attrs, in_shapes, out_shapes):
        n, t, k = in_shapes[0]
        q, hd = out_shapes[0][1], attrs["d"] * attrs["heads"]
        return n * (q * k * hd + t * k * hd + t * k * attrs["d"] + 2 * q * t * hd + q * attrs["d"] ** 2)

    def forward(self, attrs, params, x):
        return list(tft_mha_interp(x, list(params), attrs["hist"], attrs["fut"], attrs["heads"]))

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(torch_sources(tft_linear))
        blobs = emit_tft_blobs(emit, node, [b.shape for b in node.blobs])
        t = emit.tmp("mha")
        emit.stmt(f"{t} = {emit.helper(tft_mha_interp)}({emit.inputs[0]}, {blobs}, {a['hist']}, {a['fut']}, "
                  f"{a['heads']})")
        return [f"{t}[0]", f"{t}[1]", f"{t}[2]"]

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        n, steps, _ = ctx.shape(x)
        b = TftOnnx(ctx, node)
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


__all__ = ["MultiheadAttentionInterp", "MyCaffeLstm", "QuantileTraining", "ReshapeTemporal"]
