"""apple35932003/IVS-Caffe (54bb78d): ConvolutionIVS and FcIVS, Ristretto-style dynamic fixed point with the
rounding of every multiply and add (caffe-fast-rcnn/src/caffe/IVS/layers/conv_IVS_layer.cpp, fc_IVS_layer.cpp,
base_IVS_layer.cpp, include/IVS/base_IVS_layer.hpp, src/caffe/util/im2col.cpp im2col_cpu_IVS; the IVS fields of
QuantizationParameter in src/caffe/proto/caffe.proto, quantization_param here).

The fork publishes only a CPU forward for these types (Forward_cpu; its forward_gpu_IVS declarations are commented
out and no .cu exists).  caffeq computes that TEST-phase Forward_cpu.  NOTE: on a GPU build in GPU mode (as the
fork's own solvers run) the layers inherit ConvolutionLayer / InnerProductLayer::Forward_gpu and compute the plain
float layer on the unquantized weights.

The TEST forward (DYNAMIC_FIXED_POINT):
- Trim(bw, fl): TRIM_AT_THRESH saturates with std::max(std::min(x, max), min) (NaN stays NaN), where
  max = (2^(bw-1) - 1) * 2^-fl and min = -2^(bw-1) * 2^-fl are computed in double and stored as float;
  OVERFLOW_SIM instead subtracts P = (max - min) + 1 (float arithmetic) while x > max, then adds it while x < min.
  Then x / 2^-fl, round() (halves away from zero) for NEAREST, times 2^-fl.
- every bottom is trimmed with bw/fl_layer_in, in the bottom blob itself (a later reader sees it);
  weights with bw/fl_params, the bias with bw/fl_bias (default 32 / 16).
- rounding_time LAYER_BY_LAYER: Caffe's float convolution / inner product (gemm, then the bias), top trimmed
  with bw/fl_layer_out.
- EVERY_OPERATION: per sample and output, the products x * w (im2col columns times the filter; input times
  weight) trimmed with bw/fl_multiply; then the K rows are folded: with L rows left, row j += row j + L/2 for
  j < L/2, those L/2 rows trimmed with bw/fl_add, and for odd L row 0 += row L-1 and row 0 trimmed again;
  L = L/2 until 1.  EVERY_OPERATION_SERIAL: row 0 += row k for k = 1..K-1, trimmed after each add.  Then
  the bias is added (float), the whole top trimmed with bw/fl_add (only with a bias), then with
  bw/fl_layer_out.
- analyze_mode only logs running maxima and minima (the top is unchanged): read with a note.

Refused: rounding_scheme STOCHASTIC (rand() at every forward); precision MINIFLOAT and
INTEGER_POWER_OF_2_WEIGHTS (the constructors never set rounding_time for them: the forward switches on an
uninitialized value); rounding_time DLA (the forward aborts); ConvolutionIVS whose first weight is 2610214
(the top then holds four running statistics of earlier forwards and stale data); in the EVERY_OPERATION modes,
a grouped convolution (its intermediate buffer holds one group: the fork reads past it) and FcIVS with
transpose (it reads W[n*K + k + k*N + n], out of bounds).  The fork's FLOOR / CEIL roundings (no rounding at
all) cannot be written here (see proto/README.md).  ONNX: LAYER_BY_LAYER with TRIM_AT_THRESH only.
"""
import copy

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ExportError
from .c_numerics import c_round, onnx_c_round
from .conv import Convolution, InnerProduct, _onnx_conv
from .registry import LayerError, register_layer
from .ristretto import FcRistretto

MAGIC_WEIGHT = 2610214.0
ROUNDING_TIMES = ("LAYER_BY_LAYER", "EVERY_OPERATION", "EVERY_OPERATION_SERIAL")
TRAINING_FIELDS = ("ivs_q_stat", "train_fl_param", "train_fl_io", "ns_ratio_param", "ns_ratio_act",
                   "ivs_ste_param", "ivs_if_deploy")


# ---- torch (copied into model.py) -----------------------------------------------------------------

def ivs_trim(x, t: tuple):
    """Trim2FixedPoint_cpu (NEAREST): t = (low, high, step, period); period 0 saturates (NaN kept, as
    std::min/max), else OVERFLOW_SIM's loops; then c_round(x / step) * step."""
    low, high, step, period = t
    if period:
        for bound, sign in ((high, -1.0), (low, 1.0)):
            while True:
                moved = x + sign * period
                live = ((x > bound) if sign < 0 else (x < bound)) & (moved != x)
                if not bool(live.any()):
                    break
                x = torch.where(live, moved, x)
    else:
        x = torch.clamp(x, low, high)
    return c_round(x / step) * step


def ivs_accumulate(p, add: tuple, serial: bool):
    """Sum p (..., K, S) over K as forward_cpu_IVS (folding) or forward_cpu_IVS_serial, trimming after adds."""
    k = p.shape[-2]
    if serial:
        acc = p[..., 0, :]
        for i in range(1, k):
            acc = ivs_trim(acc + p[..., i, :], add)
        return acc
    rows, left = p, k
    while left != 1:
        half = left // 2
        new = ivs_trim(rows[..., :half, :] + rows[..., half:2 * half, :], add)
        if left % 2:
            first = ivs_trim(new[..., 0, :] + rows[..., left - 1, :], add)
            new = torch.cat([first.unsqueeze(-2), new[..., 1:, :]], -2)
        rows, left = new, half
    return rows[..., 0, :]


def ivs_conv(x, w, b, stride: tuple, pad: tuple, dilation: tuple, group: int, trims: tuple, mode: int):
    """ConvolutionIVS after the input trim: trims = (params, bias, multiply, add, out)."""
    params, bias, mul, add, out = trims
    w = ivs_trim(w, params)
    b = None if b is None else ivs_trim(b, bias)
    if mode == 0:
        return ivs_trim(F.conv2d(x, w, b, stride, pad, dilation, group), out)
    n, o = x.shape[0], w.shape[0]
    kh, kw = w.shape[2], w.shape[3]
    oh = (x.shape[2] + 2 * pad[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
    ow = (x.shape[3] + 2 * pad[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
    cols = F.unfold(x, (kh, kw), dilation=dilation, padding=pad, stride=stride)   # (N, K, L), Caffe's order
    wk = w.reshape(o, -1, 1)
    chunk = max(1, (1 << 24) // max(1, n * cols.shape[1] * cols.shape[2]))
    ys = []
    for c in range(0, o, chunk):
        prods = ivs_trim(cols.unsqueeze(1) * wk[c:c + chunk].unsqueeze(0), mul)
        ys.append(ivs_accumulate(prods, add, mode == 2))
    y = torch.cat(ys, 1).reshape(n, o, oh, ow)
    if b is not None:
        y = ivs_trim(y + b.reshape(1, -1, 1, 1), add)
    return ivs_trim(y, out)


def ivs_fc(x, w, b, axis: int, transpose: bool, trims: tuple, mode: int):
    """FcIVS after the input trim: trims = (params, bias, multiply, add, out)."""
    params, bias, mul, add, out = trims
    w = ivs_trim(w, params)
    b = None if b is None else ivs_trim(b, bias)
    flat = x.flatten(axis)
    if mode == 0:
        return ivs_trim(F.linear(flat, w.t() if transpose else w, b), out)
    lead = flat.shape[:-1]
    rows = flat.reshape(-1, flat.shape[-1])
    prods = ivs_trim(rows.unsqueeze(1) * w.unsqueeze(0), mul)   # (M, N, K)
    y = ivs_accumulate(prods.transpose(1, 2), add, mode == 2).reshape(tuple(lead) + (w.shape[0],))
    if b is not None:
        y = ivs_trim(y + b, add)
    return ivs_trim(y, out)


# ---- parameters -----------------------------------------------------------------------------------

def fixed_trim(p, what):
    """(low, high, step, period) of quantization_param bw_<what> / fl_<what>, as Trim2FixedPoint_cpu."""
    bw, fl = int(getattr(p, "bw_" + what)), int(getattr(p, "fl_" + what))
    if not 1 <= bw <= 64:
        raise LayerError(f"quantization_param.bw_{what} must be 1 to 64 bits, got {bw}")
    if not -126 <= fl <= 126:
        raise LayerError(f"quantization_param.fl_{what} must be -126 to 126 (2^-fl a normal float32), got {fl}")
    high = np.float32((2.0 ** (bw - 1) - 1) * 2.0 ** -fl)
    low = np.float32(-(2.0 ** (bw - 1)) * 2.0 ** -fl)
    period = float(np.float32(np.float32(high - low) + np.float32(1))) if p.overflow_behavior == 0 else 0.0
    return (float(low), float(high), float(np.float32(2.0 ** -fl)), period)


def parse_ivs(lp, attrs):
    p = lp.quantization_param
    if p.precision != 0:
        raise LayerError(f"{lp.type} with quantization_param.precision {p.precision}: the fork's constructor leaves "
                         f"rounding_time unset for it and the forward switches on that uninitialized value")
    if p.rounding_scheme not in (0, 1):
        raise LayerError(f"unknown quantization_param.rounding_scheme {p.rounding_scheme}")
    if p.rounding_time not in (0, 1, 2):
        raise LayerError(f"quantization_param.rounding_time {p.rounding_time} (DLA): the fork's forward aborts "
                         f"(Unknown rounding time mode)")
    for key in ("orn", "first_conv", "normalize", "constrain", "edge_pads"):
        if attrs.get(key):
            raise LayerError(f"{lp.type} reads no other fork's convolution or inner-product fields")
    attrs["ivs"] = {
        "mode": int(p.rounding_time), "stochastic": p.rounding_scheme == 1,
        "inputs": fixed_trim(p, "layer_in"),
        "trims": tuple(fixed_trim(p, w) for w in ("params", "bias", "multiply", "add", "layer_out")),
    }
    notes = []
    if p.analyze_mode:
        notes.append(f"{lp.type} '{lp.name}': quantization_param.analyze_mode only logs the adders' and "
                     f"multipliers' ranges; the top is the same")
    given = [f for f in TRAINING_FIELDS if p.HasField(f)]
    if given:
        notes.append(f"{lp.type} '{lp.name}': quantization_param {', '.join(given)} are read by the fork's "
                     f"constructor and unused by its forward")
    if notes:
        attrs.setdefault("reading_notes", []).extend(notes)
    attrs["name"] = lp.name
    attrs["bottom_count"] = len(lp.bottom)
    return attrs


def _magic(blob):
    return blob is not None and np.asarray(blob).size and float(np.asarray(blob).reshape(-1)[0]) == MAGIC_WEIGHT


# ---- ONNX -----------------------------------------------------------------------------------------

def onnx_ivs_trim(ctx, x, t, out, name):
    """ivs_trim (saturating) as ONNX: Clip with a NaN kept, Div, C's round, Mul."""
    low, high, step, period = t
    if period:
        raise ExportError(f"layer '{name}': overflow_behavior OVERFLOW_SIM wraps in data-dependent loops; no ONNX form")
    clipped = ctx.add_node("Clip", [x, ctx.const(np.array(low, np.float32)), ctx.const(np.array(high, np.float32))],
                           ctx.tmp(f"{name}_clip"))
    x = ctx.add_node("Where", [ctx.add_node("IsNaN", [x], ctx.tmp(f"{name}_isnan")), x, clipped],
                     ctx.tmp(f"{name}_sat"))
    s = ctx.const(np.array(step, np.float32))
    x = onnx_c_round(ctx, ctx.add_node("Div", [x, s], ctx.tmp(f"{name}_scaled")))
    return ctx.add_node("Mul", [x, s], out)


# ---- the specs ------------------------------------------------------------------------------------

class _IVS:
    """What ConvolutionIVS and FcIVS share over their base layer's spec."""

    statistics_switch = False   # ConvolutionIVS only: FcIVSLayer::Forward_cpu has no 2610214 test

    def _switched(self, blob):
        return self.statistics_switch and _magic(blob)

    def bottoms_written_back(self, attrs):
        return range(attrs["bottom_count"])

    def stored_blobs(self, attrs, arrays, notes):
        if arrays and self._switched(arrays[0]):
            raise LayerError(f"{self.types[0]} '{attrs['name']}': first weight {MAGIC_WEIGHT:.0f} makes the fork's "
                             f"top hold running adder / multiplier statistics, not a forward")
        return super().stored_blobs(attrs, arrays, notes)

    def cannot_run(self, attrs, in_shapes):
        q = attrs["ivs"]
        if q["stochastic"]:
            return "rounding_scheme STOCHASTIC rounds with rand() at every forward; caffeq does not draw random roundings"
        return self.ivs_refusal(attrs, in_shapes)

    def macs(self, attrs, in_shapes, out_shapes):
        return super().macs(attrs, in_shapes, out_shapes[:len(out_shapes) - len(attrs.get("written_back", ()))])

    def forward(self, attrs, params, *xs):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape for x in xs])
        if self._switched(params[0].detach().reshape(-1)[:1].numpy()):
            raise LayerError(f"layer '{attrs['name']}': first weight {MAGIC_WEIGHT:.0f} is the fork's statistics "
                             f"switch, not a forward")
        q = attrs["ivs"]
        xs = [ivs_trim(x, q["inputs"]) for x in xs]
        b = params[1] if len(params) > 1 else None
        ys = [self.ivs_call(attrs, x, params[0], b) for x in xs]
        ys += [xs[i] for i in attrs.get("written_back", ())]
        return ys[0] if len(ys) == 1 else tuple(ys)

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError, node.type)
        q = node.attrs["ivs"]
        if q["mode"] != 0:
            raise ExportError(f"layer '{node.name}' ({node.type}): rounding_time {ROUNDING_TIMES[q['mode']]} rounds "
                              f"after every multiply and add; caffeq emits ONNX for LAYER_BY_LAYER only")
        if node.blobs is not None and self._switched(node.blobs[0]):
            raise ExportError(f"layer '{node.name}': first weight {MAGIC_WEIGHT:.0f} is the fork's statistics switch")
        n = len(node.outputs) - len(node.attrs.get("written_back", ()))
        tops, back = node.outputs[:n], dict(zip(node.attrs.get("written_back", ()), node.outputs[n:]))
        xs = [onnx_ivs_trim(ctx, x, q["inputs"], back.get(i) or ctx.tmp(f"{node.name}_in{i}"), node.name)
              for i, x in enumerate(node.inputs)]
        params, bias = q["trims"][:2]
        blobs = None
        if node.blobs is not None:
            blobs = [ivs_trim(torch.from_numpy(np.array(b, np.float32)), params if i == 0 else bias).numpy()
                     for i, b in enumerate(node.blobs)]
        raw = [ctx.tmp(f"{node.name}_raw{i}") for i in range(len(tops))]
        trimmed = copy.copy(node)
        trimmed.blobs, trimmed.quant, trimmed.shared_from = blobs, {}, {}
        self.onnx_layer(ctx, trimmed, xs, raw)
        for r, y in zip(raw, tops):
            onnx_ivs_trim(ctx, r, q["trims"][4], y, node.name)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(i) for i in range(len(node.inputs))],
                                  ExportError, node.type)
        if node.blobs is not None and self._switched(node.blobs[0]):
            raise ExportError(f"layer '{node.name}': first weight {MAGIC_WEIGHT:.0f} is the fork's statistics switch")
        a, q = node.attrs, node.attrs["ivs"]
        emit.helper(c_round)
        trim = emit.helper(ivs_trim)
        emit.helper(ivs_accumulate)
        m = emit.blob_parameters(["weight", "bias"] if a["bias_term"] else ["weight"])
        bias = f"{m}['bias']" if a["bias_term"] else "None"
        xs = []
        for x in emit.inputs:
            var = emit.tmp("trimmed")
            emit.stmt(f"{var} = {trim}({x}, {emit.lit(q['inputs'])})", "IVS trims its bottom in place")
            xs.append(var)
        calls = [self.ivs_source(a, emit, x, f"{m}['weight']", bias) for x in xs]
        calls += [xs[i] for i in a.get("written_back", ())]
        return calls[0] if len(calls) == 1 else calls


@register_layer("ConvolutionIVS")
class ConvolutionIVS(_IVS, Convolution):
    """Convolution with IVS-Caffe's trims and rounding times (conv_IVS_layer.cpp Forward_cpu)."""

    statistics_switch = True

    def parse(self, lp):
        return parse_ivs(lp, super().parse(lp))

    def ivs_refusal(self, attrs, in_shapes):
        if attrs.get("_axis", 1) != 1 or len(in_shapes[0]) != 4:
            return "caffeq reads ConvolutionIVS over 2 spatial axes after axis 1 only"
        if attrs["ivs"]["mode"] and attrs["group"] != 1:
            return ("group > 1 with rounding every operation: the fork's intermediate buffer holds one group and "
                    "it reads past it")
        return None

    def ivs_call(self, a, x, w, b):
        return ivs_conv(x, w, b, tuple(a["stride"]), tuple(a["pad"]), tuple(a["dilation"]), a["group"],
                        a["ivs"]["trims"], a["ivs"]["mode"])

    def ivs_source(self, a, emit, x, w, b):
        fn = emit.helper(ivs_conv)
        return (f"{fn}({x}, {w}, {b}, {emit.lit(tuple(a['stride']))}, {emit.lit(tuple(a['pad']))}, "
                f"{emit.lit(tuple(a['dilation']))}, {a['group']}, {emit.lit(a['ivs']['trims'])}, {a['ivs']['mode']})")

    def onnx_layer(self, ctx, node, inputs, outputs):
        _onnx_conv(ctx, node, "Conv", inputs, outputs)


@register_layer("FcIVS")
class FcIVS(_IVS, InnerProduct):
    """InnerProduct with IVS-Caffe's trims and rounding times (fc_IVS_layer.cpp Forward_cpu): one bottom, one top."""

    def parse(self, lp):
        if len(lp.bottom) != 1 or len(lp.top) != 1:
            raise LayerError(f"FcIVS takes one bottom and one top, got {len(lp.bottom)} and {len(lp.top)}")
        return parse_ivs(lp, super().parse(lp))

    def ivs_refusal(self, attrs, in_shapes):
        if attrs["ivs"]["mode"] and attrs["transpose"]:
            return ("transpose with rounding every operation: the fork reads W[n*K + k + k*N + n], past the "
                    "weights")
        return None

    def ivs_call(self, a, x, w, b):
        return ivs_fc(x, w, b, a["_axis"], a["transpose"], a["ivs"]["trims"], a["ivs"]["mode"])

    def ivs_source(self, a, emit, x, w, b):
        fn = emit.helper(ivs_fc)
        return (f"{fn}({x}, {w}, {b}, {a['_axis']}, {emit.lit(a['transpose'])}, {emit.lit(a['ivs']['trims'])}, "
                f"{a['ivs']['mode']})")

    def onnx_layer(self, ctx, node, inputs, outputs):
        FcRistretto.onnx_layer(self, ctx, node, inputs, outputs)

