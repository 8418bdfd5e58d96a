"""XmBrain/Quantizer's LSTMRistretto (9b1ef66, the commit after ab07565 "support lstm"): BVLC's LSTM whose unrolled
net takes the fixed-point formats of a second prototxt, the layer's quantization_param.quantize_file.  Sources:
src/caffe/ristretto/layers/lstm_ristretto_layer.cpp, lstm_unit_ristretto_layer.cpp, fc_ristretto_layer.cpp,
slice_ristretto_layer.cpp, eltwise_ristretto_layer.cpp, concat_ristretto_layer.cpp, base_ristretto_layer.cpp,
src/caffe/ristretto/quantization.cpp (my_pow) and src/caffe/layers/lstm_layer.cpp (FillUnrolledNet).

FillUnrolledNet builds BVLC's unrolled LSTM (cont_slice, x_transform, [W_xc_x_static], W_xc_x_slice, per step t:
h_conted_{t-1} (Scale), transform_t (InnerProduct, W_hc), gate_input_t (Eltwise SUM), unit_t (LSTMUnit); an
unnamed Split of c_T and h_concat), then looks up "<layer name>_<unrolled name>" in the quantize file: where that
entry's type contains "Ristretto", the unrolled layer becomes <its type>Ristretto with the entry's bw_params,
fl_params, bw_layer_data, fl_layer_data and is_sign_data (a name not in the file stays in float).  What those
layers compute (Trim2FixedPoint_cpu: clamp to the format's range with std::max(std::min(.)), / 2^-fl, then
round() where it rounds weights and floor() where it rounds data, * 2^-fl, bounds from my_pow's float32 table):

- SliceRistretto (cont_slice, W_xc_x_slice): top 0 only, i.e. the first step's cont and W_xc x_1, floored.
- InnerProductRistretto (x_transform, W_xc_x_static, transform_t): the weights rounded (signed, bw/fl_params)
  in place in the shared blob, so step t's W_hc is step t-1's rounded again with step t's format (caffeq computes
  the first forward); the bias (x_transform's b_c) rounded with bw_params and fl = bw_params - (int)ceil(log2(max
  |b|) + 1), fixed at its first forward (an all-zero bias stays zero); the product's top floored.
- EltwiseRistretto (gate_input_t): the sum, floored.  LSTMUnitRistretto (unit_t): top 0, the cell c_t, floored
  after h_t = o * tanh(c_t) was computed from the unfloored cell; the next step reads the floored c_t.
- ConcatRistretto (h_concat): the whole h sequence floored.  No other type has a Ristretto version in the fork
  (InputRistretto, ScaleRistretto, SplitRistretto, ReshapeRistretto): such an entry is refused.
- LSTMRistretto itself: top 0 (h) floored with its own bw_layer_data / fl_layer_data / is_sign_data.

The quantize file is read next to the prototxt, then in the current folder; without it the fork dies at setup
and caffeq reads the net but refuses to run the layer.  caffeq computes the GPU Caffe layers' float arithmetic
(the Ristretto layers call Forward_gpu) in float32 with torch's matmul.
"""
import os

import numpy as np
import torch

from ..errors import CaffeqError
from ..fs import resolve_source
from ..io.prototxt import parse_prototxt_text
from .c_numerics import c_round
from .recurrent import LSTM
from .registry import Layer, LayerError, register_layer
from .ristretto import ristretto_fixed_point_away, xmbrain_trim

#: unrolled layer (its name less the step) -> the base type the fork gives it
UNROLLED = {"Input_c0h0": "Input", "cont_slice": "Slice", "x_transform": "InnerProduct",
            "W_xc_x_static": "InnerProduct", "W_xc_x_static_reshape": "Reshape", "W_xc_x_slice": "Slice",
            "h_conted": "Scale", "transform": "InnerProduct", "gate_input": "Eltwise", "unit": "LSTMUnit",
            "": "Split", "h_concat": "Concat"}
RISTRETTO_VERSIONS = {"Slice", "InnerProduct", "Eltwise", "LSTMUnit", "Concat"}
MAX_QUANTIZE_FILE_BYTES = 256 << 20


# ---- the torch computation (copied into model.py) -----------------------------------------------

def xmbrain_floor_trim(x, low: float, high: float, step: float):
    """XmBrain/Quantizer's Trim2FixedPoint_cpu with needround 0 (data): std::max(std::min(x, high), low) (a NaN
    stays NaN), / step, floor, * step; low, high and step are float32 values, step a power of two."""
    x = torch.maximum(torch.minimum(x, x.new_tensor(high)), x.new_tensor(low))
    return torch.floor(x / step) * step


def maybe_floor(x, how: tuple | None):
    return x if how is None else xmbrain_floor_trim(x, *how)


def maybe_round(w, how: tuple | None):
    return w if how is None else ristretto_fixed_point_away(w, *how)


def ristretto_lstm_steps(x, cont, h, c, w_xc, b_c, w_hc, x_static: torch.Tensor | None, w_static: torch.Tensor | None,
                         once: list, steps: list):
    """LSTMRistretto's unrolled net: x (T, N, ...), cont (T, N), h and c (N, H) -> (h (T, N, H), h_T, c_T).
    once: the trims of [cont_1, W_xc, b_c, W_xc x, W_xc x_1, W_xc_static, W_xc_static x, h_concat, the top];
    steps: per step [W_hc, W_hc h', the gate sum, c_t]; each (low, high, step) or None (see the module docstring)."""
    t_len, n = x.shape[0], x.shape[1]
    hd = h.shape[1]
    gx = torch.matmul(x.reshape(t_len, n, -1), maybe_round(w_xc, once[1]).t()) + maybe_round(b_c, once[2])
    gx = maybe_floor(gx, once[3])
    static = None
    if x_static is not None and w_static is not None:
        static = torch.matmul(x_static.reshape(n, -1), maybe_round(w_static, once[5]).t())
        static = maybe_floor(static, once[6])
    w = w_hc
    outs = []
    for t in range(t_len):
        ct = maybe_floor(cont[t], once[0]) if t == 0 else cont[t]
        gx_t = maybe_floor(gx[t], once[4]) if t == 0 else gx[t]
        w = maybe_round(w, steps[t][0])
        gates = maybe_floor(torch.matmul(ct.unsqueeze(1) * h, w.t()), steps[t][1]) + gx_t
        if static is not None:
            gates = gates + static
        gates = maybe_floor(gates, steps[t][2])
        i = torch.sigmoid(gates[:, :hd])
        f = ct.unsqueeze(1) * torch.sigmoid(gates[:, hd:2 * hd])
        o = torch.sigmoid(gates[:, 2 * hd:3 * hd])
        g = torch.tanh(gates[:, 3 * hd:])
        c = f * c + i * g
        h = o * torch.tanh(c)
        c = maybe_floor(c, steps[t][3])
        outs.append(h)
    hs = torch.stack(outs) if t_len > 0 else gx.new_zeros(0, n, hd)
    return maybe_floor(maybe_floor(hs, once[7]), once[8]), h, c


# ---- reading the quantize file -------------------------------------------------------------------

def _trim(p, data, what):
    """(low, high, step) of an entry's data format (signed unless is_sign_data is 0) or its weights' (signed)."""
    if data:
        low, high, step = xmbrain_trim(int(p.bw_layer_data), int(p.fl_layer_data), p.is_sign_data != 0,
                                       f"layer_data of {what}")[1:]
    else:
        low, high, step = xmbrain_trim(int(p.bw_params), int(p.fl_params), True, f"params of {what}")[1:]
    return (low, high, step)


def read_quantize_file(path):
    """{layer name: (type, its xmbrain quantization_param)} of the quantize file."""
    size = os.path.getsize(path)
    if size > MAX_QUANTIZE_FILE_BYTES:
        raise LayerError(f"quantize_file {path} is {size} bytes, past the {MAX_QUANTIZE_FILE_BYTES} read")
    with open(path, encoding="utf-8", errors="replace") as f:
        net = parse_prototxt_text(f.read(), path=path, ignore_unknown=True, warnings=[])
    return {lp.name: (lp.type, lp.xmbrain_quantization_param) for lp in net.layer}


def plan_trims(entries, prefix, steps, static):
    """(once, per-step, notes) for an LSTM of `steps` steps named `prefix` from the quantize file's entries."""
    missing = []

    def entry(name, base):
        found = entries.get(f"{prefix}_{name}")
        if found is None:
            missing.append(f"{prefix}_{name}")
            return None
        kind, p = found
        if "Ristretto" not in kind:
            return None
        if base not in RISTRETTO_VERSIONS:
            raise LayerError(f"quantize_file entry '{prefix}_{name}' ({kind}) makes the unrolled {base} a "
                             f"{base}Ristretto, a type the fork does not have")
        return p

    for name in ("Input_c0h0", "") + (("W_xc_x_static_reshape",) if static else ()):
        entry(name, UNROLLED[name])
    cont = entry("cont_slice", "Slice")
    xt = entry("x_transform", "InnerProduct")
    xs = entry("W_xc_x_slice", "Slice")
    st = entry("W_xc_x_static", "InnerProduct") if static else None
    cat = entry("h_concat", "Concat")
    def fmt(p, data, what):
        return None if p is None else _trim(p, data, what)

    once = [fmt(cont, True, "cont_slice"), fmt(xt, False, "x_transform"),
            None if xt is None else ("bias", int(xt.bw_params)), fmt(xt, True, "x_transform"),
            fmt(xs, True, "W_xc_x_slice"), fmt(st, False, "W_xc_x_static"), fmt(st, True, "W_xc_x_static"),
            fmt(cat, True, "h_concat")]
    per_step = []
    for t in range(1, steps + 1):
        entry(f"h_conted_{t - 1}", "Scale")
        w = entry(f"transform_{t}", "InnerProduct")
        s = entry(f"gate_input_{t}", "Eltwise")
        u = entry(f"unit_{t}", "LSTMUnit")
        per_step.append([fmt(w, False, f"transform_{t}"), fmt(w, True, f"transform_{t}"),
                         fmt(s, True, f"gate_input_{t}"), fmt(u, True, f"unit_{t}")])
    notes = []
    if missing:
        notes.append(f"{len(missing)} unrolled layer(s) of LSTMRistretto '{prefix}' have no entry in its quantize_file "
                     f"(e.g. '{missing[0]}'): they stay in float, as the fork leaves them")
    return once, per_step, notes


def bias_trim(bias, bw):
    """x_transform's bias format, as QuantizeWeights_cpu fixes it at the first forward: bw_params bits, fl =
    bw - (int)ceil(log2(max |b|) + 1) in float32; None for an all-zero bias (zeros stay zeros)."""
    top = np.float32(np.max(np.abs(np.asarray(bias, np.float32)))) if np.size(bias) else np.float32(0)
    if not top > 0:
        return None
    fl = bw - int(np.ceil(np.log2(top) + np.float32(1)))
    return xmbrain_trim(bw, fl, True, "params (x_transform's bias, its fl from max |b|)")[1:]


# ---- the spec -----------------------------------------------------------------------------------

@register_layer("LSTMRistretto")
class LSTMRistretto(LSTM):
    """BVLC's LSTM with the fixed-point formats of its quantize_file (see the module docstring)."""

    reads_files = True
    onnx_refusal = ("LSTMRistretto rounds each unrolled step with its own fixed-point formats from the quantize "
                    "file; caffeq emits no ONNX for it")

    def parse(self, lp):
        if lp.HasField("lstm_param") and not lp.HasField("recurrent_param"):
            raise LayerError("LSTMRistretto takes recurrent_param (BVLC's LSTM), not lstm_param")
        attrs = super().parse(lp)
        if attrs.get("forget_bias") or attrs.get("static_first_only"):
            raise LayerError("LSTMRistretto reads no other fork's recurrent_param fields "
                             "(lstm_additional_forget_bias, static_input_only_start)")
        p = lp.xmbrain_quantization_param
        if not p.quantize_file:
            raise LayerError("LSTMRistretto needs quantization_param.quantize_file (the fork reads every unrolled "
                             "layer's format from it and dies without it)")
        attrs.update(name=lp.name, quantize_file=str(p.quantize_file),
                     top_trim=_trim(p, True, "the LSTMRistretto top"))
        return attrs

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)
        path = resolve_source(attrs["quantize_file"], attrs.get("base_dir"))
        if not os.path.isfile(path):
            attrs["_plan"] = None
            return shapes
        once, steps, notes = plan_trims(read_quantize_file(path), attrs["name"], in_shapes[0][0], attrs["static"])
        attrs["_plan"] = (once, steps)
        if notes:
            attrs["reading_notes"] = notes
        return shapes

    def cannot_run(self, attrs, in_shapes):
        if attrs.get("_plan") is None:
            return (f"quantize_file '{attrs['quantize_file']}' not found (next to the prototxt or in the current "
                    f"folder): the fork reads each unrolled layer's fixed-point format from it and dies without it")
        return None

    def _trims(self, attrs, bias):
        once, steps = attrs["_plan"]
        once = list(once)
        if once[2] is not None:
            once[2] = bias_trim(bias, once[2][1])
        return once + [attrs["top_trim"]], steps

    def forward(self, attrs, params, *inputs):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape) for x in inputs], CaffeqError)
        x, cont, xs, states = self._unpack(attrs, inputs)
        if attrs["static"]:
            w_xc, b_c, w_static, w_hc = params
        else:
            (w_xc, b_c, w_hc), w_static = params, None
        once, steps = self._trims(attrs, b_c.detach().cpu().numpy())
        n, hd = x.shape[1], attrs["num_output"]
        if states is not None:
            h, c = states[0].reshape(n, hd), states[1].reshape(n, hd)
        else:
            h = c = x.new_zeros(n, hd)
        hs, h, c = ristretto_lstm_steps(x, cont, h, c, w_xc, b_c, w_hc, xs, w_static, once, steps)
        if attrs["expose_hidden"]:
            return hs, h.unsqueeze(0), c.unsqueeze(0)
        return hs

    def onnx(self, ctx, node):
        return Layer.onnx(self, ctx, node)   # refuses with onnx_refusal (LSTM's Scan has no trims)

    def has_onnx(self):
        return False

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(i) for i in range(len(node.inputs))], CaffeqError)
        names = self.blob_names_for(a)
        once, steps = self._trims(a, node.blobs[1])
        for helper in (c_round, ristretto_fixed_point_away, xmbrain_floor_trim, maybe_floor, maybe_round):
            emit.helper(helper)
        fn = emit.helper(ristretto_lstm_steps)
        weights = {}
        for i, (name, shape) in enumerate(zip(names, node.expected_param_shapes)):
            attr = emit.extra_attr(name)
            weights[name] = emit.module(f"nn.Parameter(torch.zeros({', '.join(map(str, shape))}))", attr=attr)
            emit.param("", i, attr=attr)
        x, cont = emit.inputs[0], emit.inputs[1]
        nxt = 3 if a["static"] else 2
        n, hd = emit.in_shape(0)[1], a["num_output"]
        if a["expose_hidden"]:
            h0, c0 = (f"{v}.reshape({n}, {hd})" for v in emit.inputs[nxt:nxt + 2])
        else:
            h0 = c0 = f"{x}.new_zeros({n}, {hd})"
        static = (emit.inputs[2], weights["W_xc_static"]) if a["static"] else ("None", "None")
        out = emit.tmp("lstm")
        emit.stmt(f"{out} = {fn}({x}, {cont}, {h0}, {c0}, {weights['W_xc']}, {weights['b_c']}, {weights['W_hc']}, "
                  f"{static[0]}, {static[1]}, {emit.lit(once)}, {emit.lit(steps)})")
        if a["expose_hidden"]:
            return [f"{out}[0]", f"{out}[1].unsqueeze(0)", f"{out}[2].unsqueeze(0)"]
        return f"{out}[0]"


__all__ = ["LSTMRistretto", "bias_trim", "plan_trims", "read_quantize_file", "ristretto_lstm_steps",
           "xmbrain_floor_trim"]
