"""junhyukoh/caffe-lstm at 711ecdab (its "Deep pooling" merge): an image cut into windows, read as a 2-D sequence
by its Lstm, and the sequence layers around it.  Read from src/caffe/layers/Im2Windows.cpp, PermutationLayer.cpp,
ReverseLayer.cpp, lstm_layer.cpp / .cu, include/caffe/common_layers.hpp, vision_layers.hpp and
src/caffe/proto/caffe.proto (Im2WindowsParameter, LSTMParameter.width) of that commit.

- Im2Windows (im2windows_param window_h, window_w, labels_count, reversed): the bottom (N, C, H, W) cut into the
  gh x gw = (H / window_h) x (W / window_w) tiles; top 0 (K N, C, window_h, window_w), K = gh gw, window-major:
  row (gw y + x) N + n is tile (y, x) of image n; `reversed` fills row (y, x) from tile (gh - 1 - y, gw - 1 - x).
  H and W must be multiples of the window (the fork's loop writes past its top otherwise).  A second bottom, the
  ImageData box (N, 7): label, ymin, xmin, ymax, xmax, original height, original width (each truncated to an int,
  as C's int()), gives three more tops, for top row (y, x, n) with the window [y wh, (y+1) wh) x [x ww, (x+1) ww)
  (the row's own place, reversed or not):
    label (K N, labels_count): zero but column `label`, the box's intersection with the window / the window's
      area (float);
    clip (K N,): 1 where x > 0, clip_w (K N,): 1 where y > 0; both 0 where the window reaches past the original
      width or height.
  A label outside [0, labels_count) fails the fork's CHECK (or writes outside its row): caffeq leaves the row 0.
- Permutation (reshape_param.shape.dim(0) = T): (T N, ...) -> (N, C, T), C = count / (T N),
  top[n, c, t] = the bottom's flat element (t N + n) C + c (N = shape(0) / T rounded down, as the fork).
- The fork's Reverse (reshape_param instead of reverse_param; caffeq/layers/sequence.py's Reverse reads it): the
  bottom's T = reshape_param.shape.dim(0) equal blocks in reverse order, shape kept.
- Its Lstm with lstm_param.width W (sequence.py's Lstm reads it here when the file sets width, gives a third
  bottom or four `param` blocks, which the three-blob Lstm cannot load): x (T N, ...) with N = batch_size, I =
  count / (T N); a W-wide grid walked row by row, t = row W + column; blobs W_i (5H, I), W_h (5H, H), b (5H),
  W_hw (5H, H) (Caffe's order); gate rows [i f o g f_w]; per step
      pre = W_i x_t + b + cont W_h h_{t-1} + cont_w W_hw h_{t-W},
      c_t = cont sigmoid(f) c_{t-1} + sigmoid(i) tanh(g) + cont_w sigmoid(f_w) c_{t-W},  h_t = sigmoid(o) tanh(c_t),
  zero states before t = 0 and t = W; top h (T N, H).  cont = (t mod W != 0) and cont_w = (t >= W) without
  bottoms; bottom 1 (clip) and bottom 2 (clip_w), blobs whose num equals their count, give them instead, step t
  of sample n reading element t + n (the fork's offset(t) of a 1-axis blob; t N + n only where N = 1); they scale
  the terms as its GPU kernels do (its CPU Forward tests them as bools: the same for 0/1 markers).  With clip the
  fork starts from the previous Forward's h_T, c_T (truncated BPTT); caffeq starts from zero, as its first
  Forward (the same wherever clip is 0 at t = 0, as Im2Windows gives it).  clipping_threshold bounds gradients.

The same fork's first LSTM, at an earlier commit (b193dfb0 src/caffe/layers/lstm_layer.cpp, .cu,
include/caffe/common_layers.hpp; V1 type LSTM, ONE bottom; recurrent.py's LSTM reads it through the functions at
the end of this module when a one-bottom LSTM sets inner_product_param and no recurrent_param or
hidden_dim): the bottom (T, ...) is one sequence of T = num steps (no batch axis), I values a step; blobs W_i
(1, 4, H, I), W_h (1, 4, H, H) and, with inner_product_param.bias_term (default true), b (1, 1, 4, H),
H = inner_product_param.num_output; gate rows [i f o g]; zero initial h and c; per step
    [i f o g] = W_i x_t + b + W_h h_{t-1},  c_t = sigmoid(f) c_{t-1} + sigmoid(i) tanhE(g),
    h_t = sigmoid(o) tanhE(c_t);  top h (T, H, 1, 1),
tanhE(v) = (e^2v - 1) / (e^2v + 1), the fork's TanHLayer formula (NaN where e^2v overflows, v > 44.36).
lstm_param.clipping_threshold clips gradients only.  The fork's GPU Forward carries h_T, c_T into the next
Forward call (its CPU Forward and PreStartSequence start from zero): caffeq starts every call from zero.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from .registry import Layer, LayerError, four_axes, need_blobs, positive_field, register_layer, torch_sources

# ---- Im2Windows ------------------------------------------------------------------------------


def im2windows(x, window_h: int, window_w: int, reverse: bool):
    """(N, C, H, W) -> (K N, C, window_h, window_w), tile (y, x) of image n at row (gw y + x) N + n."""
    n, c, h, w = x.shape
    gh, gw = h // window_h, w // window_w
    tiles = x.reshape(n, c, gh, window_h, gw, window_w).permute(2, 4, 0, 1, 3, 5)
    if reverse:
        tiles = tiles.flip(0, 1)
    return tiles.reshape(gh * gw * n, c, window_h, window_w)


def window_labels(box, batch: int, grid_h: int, grid_w: int, window_h: int, window_w: int, labels: int):
    """Im2Windows' label (K N, labels), clip (K N,) and clip_w (K N,) tops from the box bottom (N, 7)."""
    rows = torch.trunc(box.reshape(box.shape[0], -1)[:batch, :7])
    label, ymin, xmin, ymax, xmax, height, width = rows.t()
    k = torch.arange(grid_h * grid_w, device=box.device)
    wy = (k // grid_w).unsqueeze(1)
    wx = (k % grid_w).unsqueeze(1)
    y0 = (wy * window_h).to(box.dtype)
    x0 = (wx * window_w).to(box.dtype)
    y1 = y0 + window_h
    x1 = x0 + window_w
    dy = torch.minimum(y1, ymax) - torch.maximum(y0, ymin)
    dx = torch.minimum(x1, xmax) - torch.maximum(x0, xmin)
    zero = torch.zeros((), dtype=box.dtype, device=box.device)
    area = torch.where((dy > 0) & (dx > 0), dy * dx, zero)
    ratio = area / torch.full_like(area, float(window_h * window_w))   # a float division, as the fork's
    columns = torch.arange(labels, device=box.device).to(box.dtype)
    hit = label.reshape(1, -1, 1) == columns
    top_label = torch.where(hit, ratio.unsqueeze(2), zero).reshape(-1, labels)
    fits = (x1 <= width) & (y1 <= height)
    clip = (fits & (wx != 0)).to(box.dtype).reshape(-1)
    clip_w = (fits & (wy != 0)).to(box.dtype).reshape(-1)
    return top_label, clip, clip_w


def im2windows_layer(x, box, window_h: int, window_w: int, reverse: bool, labels: int):
    """The Im2Windows layer: the windows, then (with a box bottom) label, clip and clip_w."""
    windows = im2windows(x, window_h, window_w, reverse)
    if box is None:
        return windows
    grid_h, grid_w = x.shape[2] // window_h, x.shape[3] // window_w
    return (windows,) + window_labels(box, x.shape[0], grid_h, grid_w, window_h, window_w, labels)


TORCH_IM2WINDOWS = torch_sources(im2windows, window_labels, im2windows_layer)


@register_layer("Im2Windows")
class Im2Windows(Layer):
    def parse(self, lp):
        need_blobs(lp, "Im2Windows", (1, 2), (1, 4), "data, box", in_place=False)
        box = len(lp.bottom) == 2
        if len(lp.top) != (4 if box else 1):
            raise LayerError(f"Im2Windows gives {'4 tops (windows, label, clip, clip_w)' if box else '1 top'} "
                             f"with {len(lp.bottom)} bottom{'s' if box else ''}, got {len(lp.top)}")
        p = lp.im2windows_param
        attrs = {"window_h": positive_field(p.window_h, "im2windows_param.window_h"),
                 "window_w": positive_field(p.window_w, "im2windows_param.window_w"),
                 "reversed": bool(p.reversed), "box": box, "labels": int(p.labels_count)}
        if box:
            positive_field(p.labels_count, "im2windows_param.labels_count")
        return attrs

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Im2Windows")
        wh, ww = attrs["window_h"], attrs["window_w"]
        if h % wh or w % ww or h < wh or w < ww:
            raise LayerError(f"Im2Windows: the bottom's {h} x {w} must be a positive multiple of window_h x window_w "
                             f"{wh} x {ww} (the fork writes past its top otherwise)")
        rows = (h // wh) * (w // ww) * n
        tops = [(rows, c, wh, ww)]
        if attrs["box"]:
            box = tuple(in_shapes[1])
            if not box or box[0] < n or math.prod(box) // box[0] < 7:
                raise LayerError(f"Im2Windows reads a box bottom of N = {n} rows of 7 values (ImageData's third top), "
                                 f"got {list(box)}")
            tops += [(rows, attrs["labels"]), (rows,), (rows,)]
        return tops

    def forward(self, attrs, params, x, box=None):
        return im2windows_layer(x, box, attrs["window_h"], attrs["window_w"], attrs["reversed"], attrs["labels"])

    def onnx(self, ctx, node):
        a = node.attrs
        n, c, h, w = ctx.shape(node.inputs[0])
        wh, ww = a["window_h"], a["window_w"]
        gh, gw = h // wh, w // ww
        tiles = ctx.op("Reshape", [node.inputs[0], ctx.i64([n, c, gh, wh, gw, ww])], "tiles", name=node.name)
        tiles = ctx.op("Transpose", [tiles], "grid", perm=[2, 4, 0, 1, 3, 5])
        if a["reversed"]:
            tiles = ctx.op("Slice", [tiles, ctx.i64([-1, -1]), ctx.i64([-(2 ** 62)] * 2), ctx.i64([0, 1]),
                                     ctx.i64([-1, -1])], "flipped")
        ctx.add_node("Reshape", [tiles, ctx.i64([gh * gw * n, c, wh, ww])], [node.outputs[0]])
        if not a["box"]:
            return
        box = node.inputs[1]
        s = ctx.shape(box)
        rows = ctx.op("Reshape", [box, ctx.i64([s[0], -1])], "box_rows")
        rows = ctx.trunc(ctx.op("Slice", [rows, ctx.i64([0, 0]), ctx.i64([n, 7]), ctx.i64([0, 1])], "box7"), "box_int")
        col = [ctx.op("Gather", [rows, ctx.i64(j)], f"box{j}", axis=1) for j in range(7)]   # each (N,)
        k = np.arange(gh * gw)
        wy, wx = (k // gw).reshape(-1, 1), (k % gw).reshape(-1, 1)
        y0, x0 = (wy * wh).astype(np.float32), (wx * ww).astype(np.float32)
        y1, x1 = y0 + wh, x0 + ww
        dy = ctx.op("Sub", [ctx.op("Min", [ctx.const(y1), col[3]], "iy1"),
                            ctx.op("Max", [ctx.const(y0), col[1]], "iy0")], "dy")
        dx = ctx.op("Sub", [ctx.op("Min", [ctx.const(x1), col[4]], "ix1"),
                            ctx.op("Max", [ctx.const(x0), col[2]], "ix0")], "dx")
        zero = ctx.f32(0.0)
        inside = ctx.op("And", [ctx.op("Greater", [dy, zero], "dy_pos"), ctx.op("Greater", [dx, zero], "dx_pos")],
                        "inside")
        area = ctx.op("Where", [inside, ctx.op("Mul", [dy, dx], "inter"), zero], "area")
        ratio = ctx.op("Div", [area, ctx.f32(float(wh * ww))], "ratio")                       # (K, N)
        label = ctx.op("Unsqueeze", [col[0], ctx.i64([0, 2])], "label")                         # (1, N, 1)
        hit = ctx.op("Equal", [label, ctx.const(np.arange(a["labels"], dtype=np.float32))], "hit")
        onehot = ctx.op("Where", [hit, ctx.op("Unsqueeze", [ratio, ctx.i64([2])], "ratio3"), zero], "label_grid")
        ctx.add_node("Reshape", [onehot, ctx.i64([gh * gw * n, a["labels"]])], [node.outputs[1]])
        fits = ctx.op("And", [ctx.op("LessOrEqual", [ctx.const(x1), col[6]], "fits_w"),
                              ctx.op("LessOrEqual", [ctx.const(y1), col[5]], "fits_h")], "fits")
        for out, nonzero in ((node.outputs[2], wx != 0), (node.outputs[3], wy != 0)):
            marks = ctx.op("Cast", [ctx.op("And", [fits, ctx.const(nonzero)], "marks")], "marks_f", to=1)
            ctx.add_node("Reshape", [marks, ctx.i64([-1])], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(TORCH_IM2WINDOWS)
        box = emit.inputs[1] if a["box"] else "None"
        call = (f"im2windows_layer({emit.inputs[0]}, {box}, {a['window_h']}, {a['window_w']}, {a['reversed']}, "
                f"{a['labels']})")
        if not a["box"]:
            return call
        t = emit.tmp("windows")
        emit.stmt(f"{t} = {call}")
        return [f"{t}[{i}]" for i in range(4)]


# ---- Permutation -------------------------------------------------------------------------------


def steps_field(lp, layer_type):
    """T = reshape_param.shape.dim(0), as the fork's Permutation and Reverse read it."""
    dims = lp.reshape_param.shape.dim
    if not len(dims):
        raise LayerError(f"{layer_type} (junhyukoh/caffe-lstm) reads T from reshape_param.shape.dim(0); give it")
    return positive_field(int(dims[0]), "reshape_param.shape.dim(0)")


def permutation(x, steps: int):
    """(T N, ...) -> (N, C, T): top[n, c, t] = flat element (t N + n) C + c."""
    n = x.shape[0] // steps
    c = x.numel() // (steps * n)
    return x.reshape(-1)[:steps * n * c].reshape(steps, n, c).permute(1, 2, 0)


@register_layer("Permutation")
class Permutation(Layer):
    def parse(self, lp):
        need_blobs(lp, "Permutation", 1, 1, in_place=False)
        return {"steps": steps_field(lp, "Permutation")}

    def _ntc(self, attrs, shape):
        t = attrs["steps"]
        if not shape or shape[0] < t:
            raise LayerError(f"Permutation: the bottom {list(shape)} must have at least T = reshape_param.shape.dim(0) "
                             f"= {t} rows (T x N)")
        n = shape[0] // t
        return n, math.prod(shape) // (t * n), t

    def infer(self, attrs, in_shapes):
        return [self._ntc(attrs, tuple(in_shapes[0]))]

    def forward(self, attrs, params, x):
        return permutation(x, attrs["steps"])

    def onnx(self, ctx, node):
        shape = ctx.shape(node.inputs[0])
        n, c, t = self._ntc(node.attrs, shape)
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "flat", name=node.name)
        if t * n * c < math.prod(shape):
            flat = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([t * n * c]), ctx.i64([0])], "read")
        tnc = ctx.op("Reshape", [flat, ctx.i64([t, n, c])], "tnc")
        ctx.add_node("Transpose", [tnc], [node.outputs[0]], perm=[1, 2, 0])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(permutation)}({emit.inputs[0]}, {node.attrs['steps']})"


# ---- the fork's Reverse (sequence.py's Reverse reads reshape_param through these) -------------------


def reverse_blocks(x, steps: int):
    """junhyukoh/caffe-lstm's Reverse: x's T = steps equal blocks in reverse order."""
    return x.reshape(steps, -1).flip(0).reshape(x.shape)


def reverse_blocks_onnx(ctx, node, steps):
    shape = ctx.shape(node.inputs[0])
    blocks = ctx.op("Reshape", [node.inputs[0], ctx.i64([steps, -1])], "blocks", name=node.name)
    flipped = ctx.op("Slice", [blocks, ctx.i64([-1]), ctx.i64([-(2 ** 62)]), ctx.i64([0]), ctx.i64([-1])], "flip")
    ctx.add_node("Reshape", [flipped, ctx.i64(list(shape))], [node.outputs[0]])


def reverse_blocks_shape(steps, shape):
    if math.prod(shape) % steps:
        raise LayerError(f"Reverse (junhyukoh/caffe-lstm): the bottom {list(shape)} does not split into T = "
                         f"reshape_param.shape.dim(0) = {steps} equal blocks (the fork leaves the rest unset)")
    return [tuple(shape)]


# ---- the fork's Lstm with lstm_param.width (sequence.py's Lstm reads it through GridLstmSpec) ------------


def grid_lstm(x, clip, clip_w, w_i, w_h, b, w_hw, batch: int, width: int):
    """junhyukoh/caffe-lstm 711ecdab's Lstm: x (T N, ...) -> h (T N, H) over a width-wide grid; clip, clip_w
    (count,) or None, step t of sample n reading element t + n."""
    steps = x.shape[0] // batch
    hd = w_h.shape[1]
    gx = torch.matmul(x.reshape(steps, batch, -1), w_i.t()) + b
    hs, cs = [], []
    for t in range(steps):
        pre = gx[t]
        cont = cont_w = None
        if t > 0 and (clip is not None or t % width):
            rec = torch.matmul(hs[t - 1], w_h.t())
            if clip is not None:
                cont = clip.reshape(-1)[t:t + batch].unsqueeze(1)
                rec = cont * rec
            pre = pre + rec
        if t >= width:
            rec_w = torch.matmul(hs[t - width], w_hw.t())
            if clip_w is not None:
                cont_w = clip_w.reshape(-1)[t:t + batch].unsqueeze(1)
                rec_w = cont_w * rec_w
            pre = pre + rec_w
        i = torch.sigmoid(pre[:, :hd])
        g = torch.tanh(pre[:, 3 * hd:4 * hd])
        c = i * g
        if t > 0 and (clip is not None or t % width):
            f = torch.sigmoid(pre[:, hd:2 * hd])
            c = (f if cont is None else cont * f) * cs[t - 1] + c
        if t >= width:
            fw = torch.sigmoid(pre[:, 4 * hd:])
            c = c + (fw if cont_w is None else cont_w * fw) * cs[t - width]
        h = torch.sigmoid(pre[:, 2 * hd:3 * hd]) * torch.tanh(c)
        hs.append(h)
        cs.append(c)
    return torch.stack(hs).reshape(steps * batch, hd)


class GridLstm(nn.Module):
    """junhyukoh/caffe-lstm 711ecdab's Lstm (see grid_lstm) with its blobs W_i, W_h, b, W_hw."""

    def __init__(self, num_input: int, num_output: int, batch: int, width: int):
        super().__init__()
        self.W_i = nn.Parameter(torch.zeros(5 * num_output, num_input))
        self.W_h = nn.Parameter(torch.zeros(5 * num_output, num_output))
        self.b = nn.Parameter(torch.zeros(5 * num_output))
        self.W_hw = nn.Parameter(torch.zeros(5 * num_output, num_output))
        self.batch = batch
        self.width = width

    def forward(self, x, clip=None, clip_w=None):
        return grid_lstm(x, clip, clip_w, self.W_i, self.W_h, self.b, self.W_hw, self.batch, self.width)


def is_grid_lstm(lp):
    """The 711ecdab Lstm: lstm_param.width set, a clip_w bottom, or four param blocks (HEAD's has three blobs)."""
    return lp.lstm_param.HasField("width") or len(lp.bottom) == 3 or len(lp.param) == 4


class GridLstmSpec(Layer):
    """What sequence.py's Lstm spec does for the 711ecdab Lstm (not registered on its own)."""
    blob_names = ("W_i", "W_h", "b", "W_hw")
    weight_axes = {0: 0, 1: 0, 3: 0}

    def parse(self, lp):
        need_blobs(lp, "Lstm (junhyukoh/caffe-lstm with lstm_param.width)", (1, 2, 3), 1, "x, clip, clip_w")
        p = lp.lstm_param
        if p.clipping_threshold < 0:
            raise LayerError(f"lstm_param.clipping_threshold must be >= 0, got {p.clipping_threshold}")
        attrs = {"width": positive_field(p.width, "lstm_param.width"),
                 "num_output": positive_field(p.num_output, "lstm_param.num_output"),
                 "batch_size": positive_field(p.batch_size, "lstm_param.batch_size"),   # default 1 there
                 "clips": len(lp.bottom) - 1, "clipping_threshold": float(p.clipping_threshold),
                 "reading_notes": []}
        if attrs["clips"]:
            attrs["reading_notes"].append(
                "Lstm (junhyukoh/caffe-lstm 711ecdab): its clip bottom carries h and c over from the previous forward "
                "in the fork; caffeq starts every forward from zero state, as the fork's first (the same wherever "
                "clip is 0 at t = 0); step t of sample n reads clip element t + n, as the fork's offset(t)")
        return attrs

    def dims(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        n, w = attrs["batch_size"], attrs["width"]
        if not s or s[0] % n or (s[0] // n) % w or not s[0]:
            raise LayerError(f"Lstm's bottom {list(s)}: its first axis must be T x batch_size {n} with T a multiple of "
                             f"lstm_param.width {w}")
        t = s[0] // n
        for k, clip in enumerate(in_shapes[1:]):
            clip = tuple(clip)
            count = math.prod(clip)
            if not clip or clip[0] != count or count < t + n - 1:
                raise LayerError(f"Lstm's {('clip', 'clip_w')[k]} bottom {list(clip)} must be one value per row "
                                 f"(num == count, the fork's CHECK) with at least T + N - 1 = {t + n - 1} values")
        return t, n, math.prod(s[1:]), attrs["num_output"]

    def infer(self, attrs, in_shapes):
        t, n, _, h = self.dims(attrs, in_shapes)
        return [(t * n, h)]

    def param_shapes(self, attrs, in_shapes):
        _, _, k, h = self.dims(attrs, in_shapes)
        return [(5 * h, k), (5 * h, h), (5 * h,), (5 * h, h)]

    def macs(self, attrs, in_shapes, out_shapes):
        t, n, k, h = self.dims(attrs, in_shapes)
        return t * n * 5 * h * (k + 2 * h)

    def forward(self, attrs, params, x, clip=None, clip_w=None):
        w_i, w_h, b, w_hw = params
        return grid_lstm(x, clip, clip_w, w_i, w_h, b, w_hw, attrs["batch_size"], attrs["width"])

    def onnx(self, ctx, node):
        a = node.attrs
        t_steps, n, _, hd = self.dims(a, [ctx.shape(i) for i in node.inputs])
        width = a["width"]
        clips = [ctx.op("Reshape", [c, ctx.i64([-1])], f"clip{k}", name=node.name)
                 for k, c in enumerate(node.inputs[1:])]
        clip, clip_w = (clips + [None, None])[:2]
        rows = ctx.op("Reshape", [node.inputs[0], ctx.i64([t_steps, n, -1])], "rows", name=node.name)
        gx = ctx.op("Add", [ctx.op("MatMul", [rows, ctx.weight(node, 0, transpose=True)], "gx_w"),
                            ctx.weight(node, 2)], "gx")
        w_h, w_hw = ctx.weight(node, 1, transpose=True), ctx.weight(node, 3, transpose=True)

        def gate(pre, k, act, hint):
            part = ctx.op("Slice", [pre, ctx.i64([k * hd]), ctx.i64([(k + 1) * hd]), ctx.i64([1])], hint + "_pre")
            return ctx.op(act, [part], hint)

        def marks(flat, step, hint):
            part = ctx.op("Slice", [flat, ctx.i64([step]), ctx.i64([step + n]), ctx.i64([0])], hint)
            return ctx.op("Unsqueeze", [part, ctx.i64([1])], hint + "_col")

        hs, cs = [], []
        for t in range(t_steps):
            pre = ctx.op("Gather", [gx, ctx.i64(t)], f"pre{t}", axis=0)
            cont = cont_w = None
            left = t > 0 and (clip is not None or t % width)
            if left:
                rec = ctx.op("MatMul", [hs[t - 1], w_h], f"rec{t}")
                if clip is not None:
                    cont = marks(clip, t, f"cont{t}")
                    rec = ctx.op("Mul", [cont, rec], f"rec{t}_c")
                pre = ctx.op("Add", [pre, rec], f"pre{t}_h")
            if t >= width:
                rec = ctx.op("MatMul", [hs[t - width], w_hw], f"recw{t}")
                if clip_w is not None:
                    cont_w = marks(clip_w, t, f"contw{t}")
                    rec = ctx.op("Mul", [cont_w, rec], f"recw{t}_c")
                pre = ctx.op("Add", [pre, rec], f"pre{t}_w")
            c = ctx.op("Mul", [gate(pre, 0, "Sigmoid", f"i{t}"), gate(pre, 3, "Tanh", f"g{t}")], f"ig{t}")
            if left:
                f = gate(pre, 1, "Sigmoid", f"f{t}")
                if cont is not None:
                    f = ctx.op("Mul", [cont, f], f"f{t}_c")
                c = ctx.op("Add", [ctx.op("Mul", [f, cs[t - 1]], f"fc{t}"), c], f"c{t}_h")
            if t >= width:
                fw = gate(pre, 4, "Sigmoid", f"fw{t}")
                if cont_w is not None:
                    fw = ctx.op("Mul", [cont_w, fw], f"fw{t}_c")
                c = ctx.op("Add", [c, ctx.op("Mul", [fw, cs[t - width]], f"fwc{t}")], f"c{t}")
            h = ctx.op("Mul", [gate(pre, 2, "Sigmoid", f"o{t}"), ctx.op("Tanh", [c], f"tanh_c{t}")], f"h{t}")
            hs.append(h)
            cs.append(c)
        ctx.add_node("Concat", hs, [node.outputs[0]], axis=0)                             # (T N, H)

    def pytorch_source(self, node, emit):
        _, n, k, h = self.dims(node.attrs, [emit.in_shape(i) for i in range(len(emit.inputs))])
        m = emit.instance(GridLstm, k, h, n, node.attrs["width"], needs=[grid_lstm])
        for i, blob in enumerate(self.blob_names):
            emit.param(blob, i)
        return f"{m}({', '.join(emit.inputs)})"


# ---- the fork's first LSTM (b193dfb0): one bottom, one sequence (recurrent.py's LSTM dispatches here) -------

def exp_tanh(v):
    """The old TanHLayer's tanh: (e^2v - 1) / (e^2v + 1)."""
    e = torch.exp(2 * v)
    return (e - 1) / (e + 1)


def single_sequence_lstm(x, w_i, w_h, b: torch.Tensor | None = None):
    """junhyukoh/caffe-lstm b193dfb0's LSTM: x (T, ...) one sequence, W_i (1, 4, H, I), W_h (1, 4, H, H),
    b (1, 1, 4, H) or None; zero initial state -> h (T, H, 1, 1)."""
    t, hd = x.shape[0], w_h.shape[2]
    gx = torch.matmul(x.reshape(t, -1), w_i.reshape(4 * hd, -1).t())
    if b is not None:
        gx = gx + b.reshape(1, 4 * hd)
    w_rec = w_h.reshape(4 * hd, hd)
    h = gx.new_zeros(hd)
    c = h
    outs = []
    for step in range(t):
        gates = gx[step] + torch.mv(w_rec, h)
        i = torch.sigmoid(gates[:hd])
        f = torch.sigmoid(gates[hd:2 * hd])
        o = torch.sigmoid(gates[2 * hd:3 * hd])
        c = f * c + i * exp_tanh(gates[3 * hd:])
        h = o * exp_tanh(c)
        outs.append(h)
    return torch.stack(outs).reshape(t, hd, 1, 1)


def _single_sequence(lp):
    """junhyukoh/caffe-lstm b193dfb0's one-bottom LSTM, sized by inner_product_param."""
    return (len(lp.bottom) == 1 and not lp.HasField("recurrent_param") and lp.HasField("inner_product_param")
            and not lp.lstm_param.HasField("hidden_dim"))


def single_sequence_attrs(lp):
    """LSTM's attrs for junhyukoh/caffe-lstm b193dfb0's one-bottom LSTM (_single_sequence(lp) holds)."""
    ip = lp.inner_product_param
    need_blobs(lp, "LSTM (junhyukoh/caffe-lstm's, one sequence)", 1, 1, "data")
    return {"single_sequence": True, "num_output": positive_field(ip.num_output, "inner_product_param.num_output"),
            "bias_term": bool(ip.bias_term), "expose_hidden": False, "static": False,
            "clipping_threshold": float(lp.lstm_param.clipping_threshold),
            "reading_notes": ["LSTM with one bottom read as junhyukoh/caffe-lstm's first LSTM (b193dfb0): the "
                              "bottom is one sequence of num steps, from zero state (the fork's GPU Forward "
                              "carries the last state into its next call; clipping_threshold clips gradients "
                              "only)"]}


def single_sequence_dims(attrs, in_shapes):
    """(T, 1, I, None, H), the dims LSTM's _check gives, of the one-sequence LSTM's bottom (T, ...)."""
    x = tuple(in_shapes[0])
    if not x or x[0] < 1:
        raise LayerError(f"the bottom must hold at least one time step (T x ...), got {list(x)}")
    return x[0], 1, math.prod(x[1:]), None, attrs["num_output"]


def single_sequence_param_shapes(attrs, k, h):
    """W_i (1, 4, H, I), W_h (1, 4, H, H) and, with bias_term, b (1, 1, 4, H)."""
    return [(1, 4, h, k), (1, 4, h, h), (1, 1, 4, h)][:3 if attrs["bias_term"] else 2]


def single_sequence_init(shapes, rng):
    """Random W_i, W_h and the fork's bias: its filler's zeros, then 5 for the forget gate's rows."""
    blobs = [(rng.standard_normal(s) / math.sqrt(s[-1])).astype(np.float32) for s in shapes[:2]]
    if len(shapes) > 2:   # the fork's setup: the bias filler, then 5 for the forget gate's rows
        b = np.zeros(shapes[2], np.float32)
        b[0, 0, 1] = 5
        blobs.append(b)
    return blobs


def _onnx_single_sequence(ctx, node):
    """junhyukoh/caffe-lstm b193dfb0's LSTM unrolled over its T steps (T is the bottom's static num), the fork's
    tanh formula written out."""
    hd, x = node.attrs["num_output"], node.inputs[0]
    t = ctx.shape(x)[0]

    def exp_tanh_onnx(v, hint):
        e = ctx.op("Exp", [ctx.op("Mul", [v, ctx.f32(2.0)], hint + "_2v")], hint + "_e2v")
        return ctx.op("Div", [ctx.op("Sub", [e, ctx.f32(1.0)], hint + "_num"),
                              ctx.op("Add", [e, ctx.f32(1.0)], hint + "_den")], hint)
    w_i = ctx.op("Transpose", [ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([4 * hd, -1])], "wi")], "wi_t",
                 perm=[1, 0])
    w_h = ctx.op("Transpose", [ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([4 * hd, hd])], "wh")], "wh_t",
                 perm=[1, 0])
    gx = ctx.op("MatMul", [ctx.op("Reshape", [x, ctx.i64([t, -1])], "rows"), w_i], "gx")
    if node.attrs["bias_term"]:
        gx = ctx.op("Add", [gx, ctx.op("Reshape", [ctx.weight(node, 2), ctx.i64([1, 4 * hd])], "b")], "gxb")
    h = c = None
    outs = []
    for step in range(t):
        pre = ctx.op("Slice", [gx, ctx.i64([step]), ctx.i64([step + 1]), ctx.i64([0])], f"gx{step}")
        if h is not None:
            pre = ctx.op("Add", [pre, ctx.op("MatMul", [h, w_h], f"hw{step}")], f"pre{step}")

        def part(k, hint, pre=pre, step=step):
            return ctx.op("Slice", [pre, ctx.i64([k * hd]), ctx.i64([(k + 1) * hd]), ctx.i64([1])], f"{hint}{step}")
        i, f, o = (ctx.op("Sigmoid", [part(k, hint + "_pre")], f"{hint}{step}") for k, hint in enumerate("ifo"))
        write = ctx.op("Mul", [i, exp_tanh_onnx(part(3, "g_pre"), f"g{step}")], f"ig{step}")
        c = write if c is None else ctx.op("Add", [ctx.op("Mul", [f, c], f"fc{step}"), write], f"c{step}")
        h = ctx.op("Mul", [o, exp_tanh_onnx(c, f"tc{step}")], f"h{step}")
        outs.append(h)
    hs = ctx.op("Concat", outs, "hs", axis=0) if len(outs) > 1 else outs[0]
    ctx.add_node("Reshape", [hs, ctx.i64([t, hd, 1, 1])], [node.outputs[0]], name=node.name)


GRID_LSTM = GridLstmSpec()

__all__ = ["GRID_LSTM", "Im2Windows", "Permutation", "exp_tanh", "grid_lstm", "im2windows", "is_grid_lstm",
           "permutation", "reverse_blocks", "single_sequence_attrs", "single_sequence_dims", "single_sequence_init",
           "single_sequence_lstm", "single_sequence_param_shapes", "window_labels"]
