"""Sequence layers of the text-recognition / text-detection Caffe forks: Reverse, Transpose,
ContinuationIndicator, and CTPN's "Lstm".

- Reverse (tianzhi0549/CTPN's caffe, senlinuc/caffe_ocr; reverse_param axis, default 0):
  the bottom flipped along `axis`.  The fork refuses a negative axis.  A Reverse that sets reshape_param and no
  reverse_param is junhyukoh/caffe-lstm 711ecdab's (ReverseLayer.cpp): the bottom's T = reshape_param.shape.dim(0)
  equal blocks in reverse order (caffe_lstm_windows.py).
- Transpose (same forks; transpose_param dim): top axis i is bottom axis dim[i]; one dim per
  bottom axis.
- ContinuationIndicator (CRNN ports, e.g. yalecyu/crnn.caffe; continuation_indicator_param
  time_step, batch_size): no bottom; a (time_step, batch_size) blob, 0 in the first row and 1
  after it, the `cont` input of BVLC's LSTM.  It never depends on the data.
  jolibrain/caffe (23928c0, continuation_indicator_layer.cpp:9,18-19) has no batch_size: the batch
  is bottom[0]'s size along `axis` (default 0, negative counts from the end, as Blob::shape), read
  at every Reshape.  With batch_size 0 and a bottom, caffeq does the same (the batch follows the
  input in every backend); with batch_size set, the bottom is not read, as in the CRNN ports.
- Convert (Yuliang-Liu/Curve-Text-Detector 2126a66, convert_layer.cu): a bottom (N, D, ..., W) whose
  middle axes are 1 becomes the sequence (W, N, D), top[w, n, d] = bottom[n, d, w]; an optional
  second top is the (W, N) continuation indicator, 0 at w = 0 and 1 after (the GPU kernel; the
  CPU Forward writes it even without that top).
- Lstm (tianzhi0549/CTPN's caffe, Junhyuk Oh's LSTM, also in senlinuc/caffe_ocr; lstm_param
  num_output, clipping_threshold, weight/bias fillers): x (T, N, ...) flattened from axis 2 to
  I values; blobs W_x (4H, I), W_h (4H, H), b (4H) (BVLC's LSTM orders them W_xc, b_c, W_hc);
  gate rows [i f o g]; zero initial state; per step
      gates = (W_x x_t + b) + W_h h_{t-1},  c_t = sigmoid(f) c_{t-1} + sigmoid(i) tanh(g),
      h_t = sigmoid(o) tanh(c_t);  top h (T, N, H).
  clipping_threshold clips gradients only.  The fork's CPU Forward adds sample 0's recurrent term
  W_h h_{t-1}[0] to every sample of the batch (it never advances its pointer); its GPU Forward,
  the one CTPN runs, adds each sample's own.  This follows the GPU kernel.  A second bottom
  (the fork's `clip`) makes the fork carry h and c over from the previous Forward call, which
  a stateless model cannot do: it is refused.
  An Lstm that sets lstm_param.width, gives a third bottom or four `param` blocks is junhyukoh/caffe-lstm
  711ecdab's 2-D Lstm (5 gates, 4 blobs): caffe_lstm_windows.py's GridLstmSpec computes it.

ONNX: Slice with step -1, Transpose, a constant, and the ONNX LSTM op (gates reordered to
[i o f c]).
"""
import math

import numpy as np
import torch
from torch import nn

from ..errors import ExportError
from .caffe_lstm_windows import (
    GRID_LSTM,
    is_grid_lstm,
    reverse_blocks,
    reverse_blocks_onnx,
    reverse_blocks_shape,
    steps_field,
)
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer, torch_sources

# ---- Reverse -------------------------------------------------------------------------------

@register_layer("Reverse")
class Reverse(Layer):
    #: the message holding `axis`, and the top count the fork checks (None: unchecked)
    param_field = "reverse_param"
    top_count = None

    def parse(self, lp):
        need_blobs(lp, self.types[0], 1, self.top_count, in_place=False)
        if lp.type == "Reverse" and lp.HasField("reshape_param") and not lp.HasField(self.param_field):
            return {"blocks": steps_field(lp, "Reverse")}   # junhyukoh/caffe-lstm 711ecdab
        axis = int(getattr(lp, self.param_field).axis)
        if axis < 0:
            raise LayerError(f"{self.param_field}.axis must be >= 0 (the fork takes no negative axis), got {axis}")
        return {"axis": axis}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if "blocks" in attrs:
            return reverse_blocks_shape(attrs["blocks"], s)
        if attrs["axis"] >= len(s):
            raise LayerError(f"{self.param_field}.axis {attrs['axis']} is out of range for a {len(s)}-axis bottom")
        return [s]

    def forward(self, attrs, params, x):
        if "blocks" in attrs:
            return reverse_blocks(x, attrs["blocks"])
        return x.flip(attrs["axis"])

    def onnx(self, ctx, node):
        if "blocks" in node.attrs:
            return reverse_blocks_onnx(ctx, node, node.attrs["blocks"])
        ctx.add_node("Slice", [node.inputs[0], ctx.i64([-1]), ctx.i64([-(2 ** 63)]),
                               ctx.i64([node.attrs["axis"]]), ctx.i64([-1])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        if "blocks" in node.attrs:
            return f"{emit.helper(reverse_blocks)}({emit.inputs[0]}, {node.attrs['blocks']})"
        return f"{emit.inputs[0]}.flip({node.attrs['axis']})"


def inverted_order(x, in_place: bool):
    """chanyn/3Dpose_ssl's InvertedOrder on (M, C) rows: top row M-1-n = bottom row n.  In place the fork's
    loop reads rows it already overwrote: the first half stays and the second half mirrors it."""
    if not in_place:
        return x.flip(0)
    m = x.shape[0]
    return torch.cat([x[:(m + 1) // 2], x[:m // 2].flip(0)])


@register_layer("InvertedOrder")
class InvertedOrder(Layer):
    """chanyn/3Dpose_ssl 5856966 (caffe-3dssl/src/caffe/layers/inverted_order_layer.cpp, CPU only): the rows of a
    2-axis blob in reverse order (its LSTM pose nets' backward direction); with more axes the fork copies one
    value per (n, c) and leaves the rest: refused."""

    def parse(self, lp):
        need_blobs(lp, "InvertedOrder", 1, 1)
        return {"in_place": lp.top[0] == lp.bottom[0]}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if not 1 <= len(s) <= 2:
            raise LayerError(f"InvertedOrder reverses the rows of a (M, C) blob; with {list(s)} the fork copies only "
                             f"the first value of each (n, c) and leaves the rest")
        return [s]

    def forward(self, attrs, params, x):
        return inverted_order(x, attrs["in_place"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        m = ctx.shape(x)[0]
        flip = [ctx.i64([-1]), ctx.i64([-(2 ** 63)]), ctx.i64([0]), ctx.i64([-1])]
        if not node.attrs["in_place"]:
            ctx.add_node("Slice", [x] + flip, [node.outputs[0]], name=node.name)
            return
        head = ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([(m + 1) // 2]), ctx.i64([0])], "head", name=node.name)
        first = ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([m // 2]), ctx.i64([0])], "first")
        mirror = ctx.op("Slice", [first] + flip, "mirror")
        ctx.add_node("Concat", [head, mirror], [node.outputs[0]], axis=0)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(inverted_order)}({emit.inputs[0]}, {node.attrs['in_place']})"


# ---- Transpose -----------------------------------------------------------------------------

@register_layer("Transpose")
class Transpose(Layer):
    param_field = "transpose_param"

    def parse(self, lp):
        need_blobs(lp, lp.type, 1, in_place=False)
        dims = [int(d) for d in getattr(lp, self.param_field).dim]
        if sorted(dims) != list(range(len(dims))):
            raise LayerError(f"{self.param_field}.dim {dims} must list each axis 0 .. {len(dims) - 1} once")
        return {"dims": tuple(dims)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(attrs["dims"]) != len(s):
            raise LayerError(f"{self.param_field} gives {len(attrs['dims'])} dims for a {len(s)}-axis bottom; "
                             f"give one per axis")
        return [tuple(s[d] for d in attrs["dims"])]

    def forward(self, attrs, params, x):
        return x.permute(attrs["dims"])

    def onnx(self, ctx, node):
        ctx.add_node("Transpose", [node.inputs[0]], [node.outputs[0]], name=node.name, perm=list(node.attrs["dims"]))

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]}.permute({list(node.attrs['dims'])})"


@register_layer("DTransform")
class DTransform(Transpose):
    """LPAIS/DenseNet-CTC's DTransform (dtransform_layer.cu, 50612d5): the fork's copy of the CRNN ports'
    Transpose (its header keeps CAFFE_TRANSPOSE_LAYER_HPP_), top axis i = bottom axis dim[i]."""
    param_field = "dtransform_param"


# ---- ContinuationIndicator -------------------------------------------------------------------

def continuation_indicator(time_step: int, batch_size: int):
    """(time_step, batch_size): 0 at t = 0 (a new sequence), 1 after."""
    cont = torch.ones(time_step, batch_size)
    cont[0] = 0.0
    return cont


def continuation_indicator_like(x: torch.Tensor, time_step: int, axis: int):
    """jolibrain's form: (time_step, x.shape[axis]), 0 at t = 0 and 1 after, on x's device."""
    return continuation_indicator(time_step, x.shape[axis]).to(x.device)


class ContinuationIndicatorModule(nn.Module):
    """The ContinuationIndicator layer's constant (time_step, batch_size) blob (0 at t = 0, 1 after),
    kept as a buffer so that it follows the module's device."""

    def __init__(self, time_step: int, batch_size: int):
        super().__init__()
        self.register_buffer("cont", continuation_indicator(time_step, batch_size), persistent=False)

    def forward(self):
        return self.cont


@register_layer("ContinuationIndicator")
class ContinuationIndicator(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, (0, 1))   # the fork's bottom, when given, is never read
        p = lp.continuation_indicator_param
        if "batch_size" not in p.DESCRIPTOR.fields_by_name:
            raise LayerError("this build's caffe.proto has no continuation_indicator_param.batch_size "
                             "(the CRNN forks' field 2)")
        t, b = int(p.time_step), int(p.batch_size)
        if b == 0 and len(lp.bottom) and t > 0:   # jolibrain: the batch is the bottom's size along axis
            return {"time_step": t, "batch_size": None, "axis": int(p.axis)}
        if t <= 0 or b <= 0:
            raise LayerError(f"continuation_indicator_param.time_step and batch_size must be > 0, got {t} and {b}"
                             + ("" if len(lp.bottom) or t <= 0 else
                                " (jolibrain's form, without batch_size, takes the batch from a bottom)"))
        return {"time_step": t, "batch_size": b}

    def infer(self, attrs, in_shapes):
        if attrs["batch_size"] is not None:
            return [(attrs["time_step"], attrs["batch_size"])]
        shape, axis = tuple(in_shapes[0]), attrs["axis"]
        if not -len(shape) <= axis < len(shape):
            raise LayerError(f"continuation_indicator_param.axis {axis} is out of range for a "
                             f"{len(shape)}-axis bottom {list(shape)}")
        if shape[axis] <= 0:   # jolibrain: CHECK_GT(mini_batch_, 0)
            raise LayerError(f"the bottom's size along axis {axis} (the batch) must be > 0, got {shape[axis]}")
        return [(attrs["time_step"], shape[axis])]

    def forward(self, attrs, params, *bottoms):
        if attrs["batch_size"] is None:
            return continuation_indicator_like(bottoms[0], attrs["time_step"], attrs["axis"])
        cont = continuation_indicator(attrs["time_step"], attrs["batch_size"])
        return cont.to(bottoms[0].device) if bottoms else cont

    def onnx(self, ctx, node):
        t = node.attrs["time_step"]
        if node.attrs["batch_size"] is not None:
            arr = continuation_indicator(t, node.attrs["batch_size"]).numpy()
            ctx.add_node("Identity", [ctx.const(arr, node.name + "_cont")], [node.outputs[0]], name=node.name)
            return
        # the batch follows the input's (dynamic) size: a row of zeros, then time_step - 1 rows of ones
        from .ssd.common import scalar_tensor
        batch = ctx.add_node("Gather", [ctx.add_node("Shape", [node.inputs[0]], ctx.tmp("shape")),
                                        ctx.i64([node.attrs["axis"]])], ctx.tmp("batch"), axis=0)
        rows = []
        for count, value in ((1, 0.0), (t - 1, 1.0)):
            if count:
                size = ctx.add_node("Concat", [ctx.i64([count]), batch], ctx.tmp("size"), axis=0)
                rows.append(ctx.add_node("ConstantOfShape", [size], ctx.tmp("rows"), value=scalar_tensor(value)))
        ctx.add_node("Concat", rows, [node.outputs[0]], name=node.name, axis=0)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_CONTINUATION)
        if node.attrs["batch_size"] is None:
            like = emit.helper(TORCH_CONTINUATION_LIKE)
            return f"{like}({emit.inputs[0]}, {node.attrs['time_step']}, {node.attrs['axis']})"
        m = emit.module(f"{emit.helper(TORCH_CONTINUATION_MODULE)}({node.attrs['time_step']}, "
                        f"{node.attrs['batch_size']})")
        return f"{m}()"


TORCH_CONTINUATION = torch_sources(continuation_indicator)
TORCH_CONTINUATION_MODULE = torch_sources(ContinuationIndicatorModule)
TORCH_CONTINUATION_LIKE = torch_sources(continuation_indicator_like)


# ---- Curve-Text-Detector's Convert ---------------------------------------------------------

def convert_to_sequence(x):
    """Curve-Text-Detector's Convert: (N, D, ..., W) with the middle axes 1 -> (W, N, D)."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[-1]).permute(2, 0, 1)


@register_layer("Convert")
class Convert(Layer):
    def parse(self, lp):
        need_blobs(lp, "Convert", 1, (1, 2), roles="data", in_place=False)
        return {"cont": len(lp.top) == 2}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 3 or math.prod(s[2:-1]) != 1:
            # the kernels index N x D x W values: any other axis must be 1
            raise LayerError(f"Convert reads (N, D, ..., W) with every axis between D and W of size 1, got {list(s)}")
        n, d, w = s[0], s[1], s[-1]
        return [(w, n, d)] + ([(w, n)] if attrs["cont"] else [])

    def forward(self, attrs, params, x):
        seq = convert_to_sequence(x)
        if not attrs["cont"]:
            return seq
        return seq, continuation_indicator(seq.shape[0], seq.shape[1]).to(x.device)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        s = ctx.shape(x)
        n, d, w = s[0], s[1], s[-1]
        flat = ctx.add_node("Reshape", [x, ctx.i64([n, d, w])], [ctx.tmp(node.name + "_ndw")], name=node.name)[0]
        ctx.add_node("Transpose", [flat], [node.outputs[0]], perm=[2, 0, 1])
        if node.attrs["cont"]:
            arr = continuation_indicator(w, n).numpy()
            ctx.add_node("Identity", [ctx.const(arr, node.name + "_cont")], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        seq = f"{emit.helper(convert_to_sequence)}({emit.inputs[0]})"
        if not node.attrs["cont"]:
            return seq
        emit.helper(TORCH_CONTINUATION)
        return f"{seq}, continuation_indicator({emit.inputs[0]}.shape[-1], {emit.inputs[0]}.shape[0]).to({emit.inputs[0]}.device)"


# ---- CTPN's Lstm -----------------------------------------------------------------------------

def ctpn_lstm(x, w_x, w_h, b, cont=None):
    """CTPN's Lstm: x (T, N, ...) -> h (T, N, H); gate rows [i f o g], zero initial state,
    gates = (W_x x_t + b) + W_h h_{t-1}.  cont (T, N), the clip bottom, 0 where a sequence
    starts: h_{t-1} and c_{t-1} count times cont, as the fork's GPU kernels multiply them."""
    t, n = x.shape[0], x.shape[1]
    hd = w_h.shape[1]
    gx = torch.matmul(x.reshape(t, n, -1), w_x.t()) + b
    h = gx.new_zeros(n, hd)
    c = h
    outs = []
    for step in range(t):
        recurrent = torch.matmul(h, w_h.t())
        if cont is not None:
            recurrent = cont[step].unsqueeze(1) * recurrent
        gates = gx[step] + recurrent
        i = torch.sigmoid(gates[:, :hd])
        f = torch.sigmoid(gates[:, hd:2 * hd])
        o = torch.sigmoid(gates[:, 2 * hd:3 * hd])
        g = torch.tanh(gates[:, 3 * hd:])
        if cont is not None:
            f = cont[step].unsqueeze(1) * f
        c = f * c + i * g
        h = o * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs) if t > 0 else gx.new_zeros(0, n, hd)


def lstm_layer(x, clip, w_x, w_h, b, flat_batch: int = 0):
    """The Lstm layer around ctpn_lstm.  flat_batch N > 0: junhyukoh/caffe-lstm's layout, x
    (T*N, ...) -> h (T*N, H); else CTPN's (T, N, ...) -> (T, N, H).  The clip bottom's entry
    (t, n) is its flat element t * (count / shape[0]) + n, as the fork's offset(t) reads it."""
    t, n = (x.shape[0] // flat_batch, flat_batch) if flat_batch else (x.shape[0], x.shape[1])
    cont = None
    if clip is not None:
        stride = clip.numel() // clip.shape[0]
        where = torch.arange(t, device=clip.device).unsqueeze(1) * stride + torch.arange(n, device=clip.device)
        cont = clip.reshape(-1)[where].to(x.dtype)
    h = ctpn_lstm(x.reshape(t, n, -1), w_x, w_h, b, cont)
    return h.reshape(t * n, -1) if flat_batch else h


class CtpnLstm(nn.Module):
    """The Lstm layer (see lstm_layer) with its blobs W_x (4H, I), W_h (4H, H), b (4H)."""

    def __init__(self, num_input: int, num_output: int, flat_batch: int = 0):
        super().__init__()
        self.W_x = nn.Parameter(torch.zeros(4 * num_output, num_input))
        self.W_h = nn.Parameter(torch.zeros(4 * num_output, num_output))
        self.b = nn.Parameter(torch.zeros(4 * num_output))
        self.flat_batch = flat_batch

    def forward(self, x, clip=None):
        return lstm_layer(x, clip, self.W_x, self.W_h, self.b, self.flat_batch)


@register_layer("Lstm")
class Lstm(Layer):
    blob_names = ("W_x", "W_h", "b")
    weight_axes = {0: 0, 1: 0}

    # junhyukoh/caffe-lstm 711ecdab's Lstm with lstm_param.width: GRID_LSTM (caffe_lstm_windows.py) does each step
    def blob_names_for(self, attrs):
        return GRID_LSTM.blob_names if attrs.get("width") else self.blob_names

    def weight_axes_for(self, attrs):
        return GRID_LSTM.weight_axes_for(attrs) if attrs.get("width") else super().weight_axes_for(attrs)

    def parse(self, lp):
        if is_grid_lstm(lp):
            return GRID_LSTM.parse(lp)
        need_blobs(lp, lp.type, (1, 2), roles="x, clip")
        p = lp.lstm_param
        # fanchenyou/deepdiary names num_output hidden_size and fixes T = sequence_len + 1
        hidden = p.num_output if p.HasField("num_output") or not p.HasField("hidden_size") else p.hidden_size
        if hidden <= 0:
            raise LayerError("lstm_param.num_output must be positive (hidden_size, as deepdiary names it)")
        if p.clipping_threshold < 0:
            raise LayerError(f"lstm_param.clipping_threshold must be >= 0, got {p.clipping_threshold}")
        # clipping_threshold bounds the gradients only (kept for the Caffe writer via the prototxt)
        attrs = {"num_output": int(hidden), "clipping_threshold": float(p.clipping_threshold),
                 "steps": int(p.sequence_len) + 1 if p.HasField("sequence_len") else None,
                 "clip": len(lp.bottom) == 2, "reading_notes": [],
                 # junhyukoh/caffe-lstm's (T*N, ...) layout, N = batch_size; CTPN's fork takes N from axis 1
                 "batch_size": int(p.batch_size) if p.HasField("batch_size") else None}
        if attrs["batch_size"] is not None:
            positive_field(attrs["batch_size"], "lstm_param.batch_size")
        if attrs["clip"]:
            attrs["reading_notes"].append(
                "the clip bottom carries h and c over from the previous forward in the fork (truncated BPTT); "
                "caffeq starts every forward from zero state, as the fork's first forward does (the same "
                "whenever clip is 0 at t = 0)")
        return attrs

    @staticmethod
    def flat_batch(attrs, in_shape):
        """N of junhyukoh/caffe-lstm's (T*N, ...) layout (batch_size set, T = sequence_len + 1 as deepdiary's,
        or a bottom of < 3 axes), else 0."""
        if attrs.get("steps"):
            return max(in_shape[0] // attrs["steps"], 1) if len(in_shape) else 1
        if attrs["batch_size"] is not None:
            return attrs["batch_size"]
        return 1 if len(in_shape) < 3 else 0

    def _dims(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        flat = self.flat_batch(attrs, s)
        if attrs.get("steps"):
            if len(s) < 1 or s[0] % attrs["steps"] or math.prod(s[1:]) != attrs["num_output"]:
                raise LayerError(f"deepdiary's Lstm takes (T * N, H) rows, T = sequence_len + 1 = {attrs['steps']} "
                                 f"and H = hidden_size {attrs['num_output']}, got {list(s)}")
            return attrs["steps"], s[0] // attrs["steps"], attrs["num_output"], attrs["num_output"]
        if flat:
            if len(s) < 1 or s[0] % flat:
                raise LayerError(f"Lstm's bottom {list(s)}: its first axis must be a multiple of "
                                 f"lstm_param.batch_size {flat} (T * N rows)")
            return s[0] // flat, flat, math.prod(s[1:]), attrs["num_output"]
        return s[0], s[1], math.prod(s[2:]), attrs["num_output"]

    def infer(self, attrs, in_shapes):
        if attrs.get("width"):
            return GRID_LSTM.infer(attrs, in_shapes)
        t, n, _, h = self._dims(attrs, in_shapes)
        if attrs["clip"]:
            clip = tuple(in_shapes[1])
            count = math.prod(clip)
            if not clip or (t - 1) * (count // max(clip[0], 1)) + n > count:
                raise LayerError(f"Lstm's clip bottom {list(clip)} holds too few entries for T = {t} steps of "
                                 f"N = {n} (entry (t, n) is element t * (count / shape[0]) + n)")
        return [(t * n, h)] if self.flat_batch(attrs, in_shapes[0]) else [(t, n, h)]

    def param_shapes(self, attrs, in_shapes):
        if attrs.get("width"):
            return GRID_LSTM.param_shapes(attrs, in_shapes)
        _, _, k, h = self._dims(attrs, in_shapes)
        return [(4 * h, k), (4 * h, h), (4 * h,)]

    def init_params(self, attrs, shapes, rng):
        return [(rng.standard_normal(s) / math.sqrt(s[1])).astype(np.float32) if len(s) == 2
                else np.zeros(s, np.float32) for s in shapes]

    def macs(self, attrs, in_shapes, out_shapes):
        if attrs.get("width"):
            return GRID_LSTM.macs(attrs, in_shapes, out_shapes)
        t, n, k, h = self._dims(attrs, in_shapes)
        return t * n * 4 * h * (k + h)

    def forward(self, attrs, params, x, clip=None, *clip_w):
        if attrs.get("width"):
            return GRID_LSTM.forward(attrs, params, x, clip, *clip_w)
        return lstm_layer(x, clip, *params, flat_batch=self.flat_batch(attrs, x.shape))

    def onnx(self, ctx, node):
        if node.attrs.get("width"):
            return GRID_LSTM.onnx(ctx, node)
        name = node.name
        h = node.attrs["num_output"]
        if node.attrs["clip"]:
            raise ExportError(f"layer '{name}' (Lstm): its clip bottom restarts sequences inside the batch, "
                              f"which ONNX's LSTM cannot do; export a net whose Lstm has one bottom")
        t, n, _, _ = self._dims(node.attrs, [ctx.shape(node.inputs[0])])
        flat = self.flat_batch(node.attrs, ctx.shape(node.inputs[0]))
        # [i f o g] -> ONNX's [i o f c]
        perm = np.concatenate([np.arange(0, h), np.arange(2 * h, 3 * h), np.arange(h, 2 * h),
                               np.arange(3 * h, 4 * h)]).astype(np.int64)

        def onnx_gates(index, hint):
            rows = ctx.op("Gather", [ctx.weight(node, index), ctx.const(perm)], hint + "_iofc", axis=0)
            return ctx.op("Unsqueeze", [rows, ctx.i64([0])], hint)

        x = ctx.op("Reshape", [node.inputs[0], ctx.i64([t, n, -1] if flat else [0, 0, -1])], "x")
        bias = ctx.op("Gather", [ctx.weight(node, 2), ctx.const(perm)], "b_iofc", axis=0)
        bias = ctx.op("Concat", [bias, ctx.const(np.zeros(4 * h, np.float32))], "b_wr", axis=0)
        bias = ctx.op("Unsqueeze", [bias, ctx.i64([0])], "B")
        y = ctx.add_node("LSTM", [x, onnx_gates(0, "W"), onnx_gates(1, "R"), bias], [ctx.tmp(f"{name}_y")],
                         name=name, hidden_size=h)[0]                                 # (T, 1, N, H)
        if flat:
            y = ctx.op("Squeeze", [y, ctx.i64([1])], "y3")
            ctx.add_node("Reshape", [y, ctx.i64([t * n, h])], [node.outputs[0]])
        else:
            ctx.add_node("Squeeze", [y, ctx.i64([1])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        if node.attrs.get("width"):
            return GRID_LSTM.pytorch_source(node, emit)
        _, _, k, h = self._dims(node.attrs, [emit.in_shape(0)])
        flat = self.flat_batch(node.attrs, emit.in_shape(0))
        m = emit.instance(CtpnLstm, k, h, *([flat] if flat else []), needs=[ctpn_lstm, lstm_layer])
        for i, blob in enumerate(self.blob_names):
            emit.param(blob, i)
        return f"{m}({', '.join(emit.inputs)})"

__all__ = ["ContinuationIndicator", "Lstm", "Reverse", "Transpose", "continuation_indicator", "ctpn_lstm"]
