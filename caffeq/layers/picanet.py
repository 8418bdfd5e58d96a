"""PiCANet's layers (nian-liu/PiCANet 9a08472, the fork under caffe/; Liu et al., CVPR 2018).

AttPooling (att_pooling_layer.cpp Reshape, att_pooling_layer.cu Forward_gpu; the CPU forward is
NOT_IMPLEMENTED).  Bottoms: a feature map x (N, C, H0, W0) and an attention map a (N, K, H1, W1),
K = kernel_size^2; top (N, C, H1, W1).  The forward runs im2col over x (kernel_size, pad, stride,
dilation: rows c * K + ki * kernel_size + kj, zeros outside the map) and then
    GLOBAL: the im2col has one column (a window covering the whole map): top[n, c, p] =
            sum_k col[n, c * K + k] * a[n, k, p] for every position p of the attention map
    LOCAL:  one column per position p = (i, j) of the attention map: top[n, c, p] =
            sum_k col[n, c * K + k, p] * a[n, k, p]
Reshape's checks: GLOBAL needs stride 1 and a square x; kernel_size defaults to W0 (then dilation
must be 1) and the window count (H0 + 2 pad - extent) / stride + 1 must be 1 on both axes
(C++ integer division); LOCAL needs kernel_size and a window count equal to H1 x W1.  Both:
K = channels of the attention map, at most 1024 (one CUDA block per sum).

PwAttend: the fork's mnist examples (lenet_pwatt_train_test.prototxt, lenet_deploy.prototxt;
copied by Mhaiyang/TMM2018_DRFN) use this type with `pw_attend_param { att_mode kernel_size pad }`,
AttPooling's fields; no layer or proto of the snapshot declares it (the earlier name of
AttPooling), so it is read as AttPooling with a note.

ReNetLSTM (renet_lstm_layer.cpp, ReNet of Visin et al. 2015).  Bottom x (N, C, H, W), cut into
patch_height x patch_width patches (H, W divisible): ny = H / ph rows, nx = W / pw columns; a
patch's vector (P = C ph pw) runs channel, then patch row, then patch column.  X_DIR: one LSTM per
patch row, stepping along x; Y_DIR: one per patch column, stepping along y.  Two sweeps share the
layout and have their own weights: dir 0 from step 0 up, dir 1 from the last step down.  Per step,
with xh = [patch, h_{t-1}] (h = 0 and no s_{t-1} terms at a sweep's first step):
    i = sigmoid(W_i xh + W_ic s_{t-1} + b_i)      c = tanh(W_c xh + b_c)
    f = sigmoid(W_f xh + W_fc s_{t-1} + b_f)      s_t = c i + f s_{t-1}
    o = sigmoid(W_o xh + W_oc s_t + b_o)          h_t = o tanh(s_t)
The peephole terms are full D x D matrices, used only with `peephole` (default true).  Top
(N, 2 D, ny, nx): channel dir * D + d holds sweep dir's h at that patch.  Blobs, 11 per sweep
(dir 0's first), all present with or without peepholes: W_i, W_c, W_o, W_f (D, P + D), W_ic,
W_oc, W_fc (D, D), b_i, b_c, b_o, b_f (D).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import Layer, LayerError, four_axes, need_blobs, positive_field, register_layer

#: AttPooling's Reshape: CHECK_LE(K_, 1024) (the forward's CUDA block holds one thread per k)
MAX_ATT_CHANNELS = 1024


def c_div(a: int, b: int) -> int:
    """C++ integer division (truncation toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


# ---- AttPooling / PwAttend --------------------------------------------------------------------

def att_pooling(x, att, kernel: int, pad: int, stride: int, dilation: int, global_mode: bool):
    """PiCANet's AttPooling forward: x (N, C, H0, W0), att (N, k*k, H1, W1) -> (N, C, H1, W1)."""
    n, c, h0, w0 = x.shape
    h1, w1 = att.shape[2], att.shape[3]
    extent = dilation * (kernel - 1) + 1
    out_h, out_w = (1, 1) if global_mode else (h1, w1)
    # the im2col windows read zeros past the padded map (C++ division can leave a partial window)
    extra_h = max(0, (out_h - 1) * stride + extent - (h0 + 2 * pad))
    extra_w = max(0, (out_w - 1) * stride + extent - (w0 + 2 * pad))
    xp = F.pad(x, (pad, pad + extra_w, pad, pad + extra_h))
    col = F.unfold(xp, kernel, dilation=dilation, stride=stride)   # (N, C*K, out_h*out_w)
    kk = kernel * kernel
    if global_mode:
        return torch.matmul(col.reshape(n, c, kk), att.reshape(n, kk, h1 * w1)).reshape(n, c, h1, w1)
    prod = col.reshape(n, c, kk, h1 * w1) * att.reshape(n, 1, kk, h1 * w1)
    return prod.sum(2).reshape(n, c, h1, w1)


@register_layer("AttPooling", "PwAttend")
class AttPooling(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 2, 1, "feature map, attention")
        pw = lp.type == "PwAttend"
        p = lp.pw_attend_param if pw else lp.att_pooling_param
        field = "pw_attend_param" if pw else "att_pooling_param"
        kernel = int(p.kernel_size) if p.HasField("kernel_size") else None
        if kernel is not None and kernel < 1:
            raise LayerError(f"{field}.kernel_size must be >= 1, got {kernel}")
        for name in ("stride", "dilation"):
            if getattr(p, name) < 1:
                raise LayerError(f"{field}.{name} must be >= 1, got {getattr(p, name)}")
        attrs = {"global": p.att_mode == 0, "kernel": kernel, "pad": int(p.pad),
                 "stride": int(p.stride), "dilation": int(p.dilation), "field": field}
        if attrs["global"] and attrs["stride"] != 1:
            raise LayerError(f"{field}: stride must be 1 for global attention, got {attrs['stride']}")
        if attrs["global"] and kernel is None and attrs["dilation"] != 1:
            raise LayerError(f"{field}: dilation must be 1 for global attention without kernel_size")
        if not attrs["global"] and kernel is None:
            raise LayerError(f"{field}: kernel_size must be given for local attention")
        if pw:
            attrs["reading_notes"] = [
                "PwAttend: no layer of nian-liu/PiCANet's caffe declares this type (its mnist examples "
                "use it with AttPooling's fields); read as AttPooling"]
        return attrs

    def _settings(self, attrs, x_shape, att_shape):
        """(kernel, window rows, window columns) after Reshape's checks."""
        n, c, h0, w0 = four_axes(x_shape, "AttPooling", "feature map")
        n1, k_ch, h1, w1 = four_axes(att_shape, "AttPooling", "attention map")
        if n != n1:
            raise LayerError(f"the two bottoms must have the same batch size, got {n} and {n1}")
        kernel, pad, stride, dil = attrs["kernel"], attrs["pad"], attrs["stride"], attrs["dilation"]
        if attrs["global"]:
            if h0 != w0:
                raise LayerError(f"global attention needs a square feature map, got {h0} x {w0}")
            kernel = kernel if kernel is not None else w0
        extent = dil * (kernel - 1) + 1
        out_h = c_div(h0 + 2 * pad - extent, stride) + 1
        out_w = c_div(w0 + 2 * pad - extent, stride) + 1
        want = (1, 1) if attrs["global"] else (h1, w1)
        if (out_h, out_w) != want:
            what = ("a global window must cover the map once" if attrs["global"]
                    else f"the attention map is {h1} x {w1}")
            raise LayerError(f"kernel_size {kernel}, pad {pad}, stride {stride}, dilation {dil} give "
                             f"{out_h} x {out_w} windows on the {h0} x {w0} feature map: {what}")
        if kernel * kernel != k_ch:
            raise LayerError(f"the attention map needs kernel_size^2 = {kernel * kernel} channels, got {k_ch}")
        if k_ch > MAX_ATT_CHANNELS:
            raise LayerError(f"kernel_size^2 = {k_ch} is over the fork's limit of {MAX_ATT_CHANNELS}")
        return kernel, out_h, out_w

    def infer(self, attrs, in_shapes):
        self._settings(attrs, in_shapes[0], in_shapes[1])
        n, c = in_shapes[0][0], in_shapes[0][1]
        return [(n, c, in_shapes[1][2], in_shapes[1][3])]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h1, w1 = out_shapes[0]
        return n * c * in_shapes[1][1] * h1 * w1

    def _args(self, attrs, x_shape, att_shape):
        kernel = self._settings(attrs, x_shape, att_shape)[0]
        return kernel, attrs["pad"], attrs["stride"], attrs["dilation"], attrs["global"]

    def forward(self, attrs, params, x, att):
        return att_pooling(x, att, *self._args(attrs, x.shape, att.shape))

    def pytorch_source(self, node, emit):
        kernel, pad, stride, dil, glob = self._args(node.attrs, emit.in_shape(0), emit.in_shape(1))
        fn = emit.helper(att_pooling)
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {kernel}, {pad}, {stride}, {dil}, {glob})"

    def onnx(self, ctx, node):
        x, att = node.inputs
        x_shape, att_shape = ctx.shape(x), ctx.shape(att)
        kernel, pad, stride, dil, glob = self._args(node.attrs, x_shape, att_shape)
        _, c, h0, w0 = x_shape
        h1, w1 = att_shape[2], att_shape[3]
        kk = kernel * kernel
        name = node.name
        extent = dil * (kernel - 1) + 1
        out_h, out_w = (1, 1) if glob else (h1, w1)
        extra_h = max(0, (out_h - 1) * stride + extent - (h0 + 2 * pad))
        extra_w = max(0, (out_w - 1) * stride + extent - (w0 + 2 * pad))
        xp = x
        if pad or extra_h or extra_w:
            xp = ctx.op("Pad", [x, ctx.i64([0, 0, pad, pad, 0, 0, pad + extra_h, pad + extra_w])], "pad")
        if glob:
            win = ctx.op("Slice", [xp, ctx.i64([0, 0]),
                                   ctx.i64([extent, extent]), ctx.i64([2, 3]), ctx.i64([dil, dil])], "window")
            col = ctx.op("Reshape", [win, ctx.i64([0, c, kk])], "col")
            a = ctx.op("Reshape", [att, ctx.i64([0, kk, h1 * w1])], "att")
            prod = ctx.op("MatMul", [col, a], "prod")
            ctx.add_node("Reshape", [prod, ctx.i64([0, c, h1, w1])], [node.outputs[0]], name=name)
            return
        total = None
        for k in range(kk):
            top, left = (k // kernel) * dil, (k % kernel) * dil
            ends = [top + (h1 - 1) * stride + 1, left + (w1 - 1) * stride + 1]
            shifted = ctx.op("Slice", [xp, ctx.i64([top, left]),
                                       ctx.i64(ends), ctx.i64([2, 3]), ctx.i64([stride, stride])], f"shift{k}")
            a_k = ctx.op("Slice", [att, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], f"att{k}")
            term = ctx.op("Mul", [shifted, a_k], f"term{k}")
            if total is None:
                total = term
            elif k == kk - 1:
                ctx.add_node("Add", [total, term], [node.outputs[0]], name=name)
                return
            else:
                total = ctx.op("Add", [total, term], f"sum{k}")
        ctx.add_node("Identity", [total], [node.outputs[0]], name=name)


# ---- ReNetLSTM --------------------------------------------------------------------------------

RENET_BLOBS = ("W_i", "W_c", "W_o", "W_f", "W_ic", "W_oc", "W_fc", "b_i", "b_c", "b_o", "b_f")


def renet_lstm(x, blobs: list[torch.Tensor], y_dir: bool, patch_h: int, patch_w: int, peephole: bool):
    """PiCANet's ReNetLSTM forward: x (N, C, H, W) and its 22 blobs -> (N, 2 D, H / ph, W / pw)."""
    n, c, h, w = x.shape
    ny, nx = h // patch_h, w // patch_w
    dim = c * patch_h * patch_w
    hd = blobs[0].shape[0]
    patches = x.reshape(n, c, ny, patch_h, nx, patch_w).permute(2, 4, 0, 1, 3, 5).reshape(ny, nx, n, dim)
    seq = patches if y_dir else patches.transpose(0, 1)       # (steps, RNNs, N, P)
    steps, rnns = seq.shape[0], seq.shape[1]
    seq = seq.reshape(steps, rnns * n, dim)
    sweeps = []
    for sweep in range(2):
        w_i, w_c, w_o, w_f, w_ic, w_oc, w_fc, b_i, b_c, b_o, b_f = blobs[11 * sweep:11 * sweep + 11]
        w_all = torch.cat([w_i, w_c, w_o, w_f], 0)             # gates in the fork's order i, c, o, f
        gx = torch.matmul(seq, w_all[:, :dim].t()) + torch.cat([b_i, b_c, b_o, b_f])
        w_h = w_all[:, dim:].t()
        hs: list[torch.Tensor] = []
        hid = torch.zeros(0)
        state = torch.zeros(0)
        order = list(range(steps)) if sweep == 0 else list(range(steps - 1, -1, -1))
        for k, t in enumerate(order):
            g = gx[t] if k == 0 else gx[t] + torch.matmul(hid, w_h)
            gi, gc, go, gf = g[:, :hd], g[:, hd:2 * hd], g[:, 2 * hd:3 * hd], g[:, 3 * hd:]
            if k > 0 and peephole:
                gi = gi + torch.matmul(state, w_ic.t())
                gf = gf + torch.matmul(state, w_fc.t())
            cell = torch.tanh(gc) * torch.sigmoid(gi)
            if k > 0:
                cell = cell + torch.sigmoid(gf) * state
            if peephole:
                go = go + torch.matmul(cell, w_oc.t())
            hid = torch.sigmoid(go) * torch.tanh(cell)
            state = cell
            hs.append(hid)
        if sweep == 1:
            hs = hs[::-1]
        out = torch.stack(hs).reshape(steps, rnns, n, hd)
        sweeps.append(out.permute(2, 3, 0, 1) if y_dir else out.permute(2, 3, 1, 0))
    return torch.cat(sweeps, 1)


class CaffeReNetLSTM(nn.Module):
    """PiCANet's ReNetLSTM (see renet_lstm): its 22 blobs in the fork's order."""

    def __init__(self, shapes, y_dir, patch_h, patch_w, peephole):
        super().__init__()
        self.blobs = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
        self.y_dir, self.patch_h, self.patch_w, self.peephole = y_dir, patch_h, patch_w, peephole

    def forward(self, x):
        return renet_lstm(x, list(self.blobs), self.y_dir, self.patch_h, self.patch_w, self.peephole)


@register_layer("ReNetLSTM")
class ReNetLSTM(Layer):
    bottoms = tops = 1

    def parse(self, lp):
        need_blobs(lp, "ReNetLSTM", 1, 1, "x")
        p = lp.renet_lstm_param
        return {"y_dir": p.direction == 1,
                "num_output": positive_field(p.num_output, "renet_lstm_param.num_output"),
                "patch_h": positive_field(p.patch_height, "renet_lstm_param.patch_height"),
                "patch_w": positive_field(p.patch_width, "renet_lstm_param.patch_width"),
                "peephole": bool(p.peephole)}

    def _grid(self, attrs, shape):
        """(N, C, ny, nx) after Reshape's checks."""
        n, c, h, w = four_axes(shape, "ReNetLSTM")
        ph, pw = attrs["patch_h"], attrs["patch_w"]
        if h % ph or w % pw:
            raise LayerError(f"the bottom's {h} x {w} is not a whole number of {ph} x {pw} patches "
                             f"(patch_height x patch_width)")
        return n, c, h // ph, w // pw

    def infer(self, attrs, in_shapes):
        n, _, ny, nx = self._grid(attrs, in_shapes[0])
        return [(n, 2 * attrs["num_output"], ny, nx)]

    def blob_names_for(self, attrs):
        return tuple(f"{name}_{sweep}" for sweep in ("fwd", "bwd") for name in RENET_BLOBS)

    def weight_axes_for(self, attrs):
        return {11 * sweep + i: 0 for sweep in range(2) for i in range(7)}

    def param_shapes(self, attrs, in_shapes):
        _, c, _, _ = self._grid(attrs, in_shapes[0])
        hd = attrs["num_output"]
        xh = c * attrs["patch_h"] * attrs["patch_w"] + hd
        return ([(hd, xh)] * 4 + [(hd, hd)] * 3 + [(hd,)] * 4) * 2

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, ny, nx = self._grid(attrs, in_shapes[0])
        hd = attrs["num_output"]
        per = 4 * hd * (c * attrs["patch_h"] * attrs["patch_w"] + hd) + (3 * hd * hd if attrs["peephole"] else 0)
        return 2 * n * ny * nx * per

    def forward(self, attrs, params, x):
        return renet_lstm(x, list(params), attrs["y_dir"], attrs["patch_h"], attrs["patch_w"], attrs["peephole"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        shapes = [tuple(s) for s in self.param_shapes(a, [emit.in_shape(0)])]
        m = emit.instance(CaffeReNetLSTM, shapes, a["y_dir"], a["patch_h"], a["patch_w"], a["peephole"],
                          needs=[renet_lstm])
        for i in range(len(shapes)):
            emit.param(f"blobs.{i}", i)
        return f"{m}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        """The two sweeps unrolled over the steps (fixed by the net's shape); N stays dynamic."""
        a = node.attrs
        x = node.inputs[0]
        _, c, ny, nx = self._grid(a, ctx.shape(x))
        ph, pw, hd, y_dir = a["patch_h"], a["patch_w"], a["num_output"], a["y_dir"]
        dim = c * ph * pw
        steps, rnns = (ny, nx) if y_dir else (nx, ny)
        name = node.name

        def cols(t, lo, hi, hint, axis=1):
            return ctx.op("Slice", [t, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([axis])], hint)

        six = ctx.op("Reshape", [x, ctx.i64([-1, c, ny, ph, nx, pw])], "patch6")
        grid = ctx.op("Transpose", [six], "grid", perm=[2, 4, 0, 1, 3, 5])
        seq = ctx.op("Reshape", [grid, ctx.i64([ny, nx, -1, dim])], "grid4")
        if not y_dir:
            seq = ctx.op("Transpose", [seq], "rows", perm=[1, 0, 2, 3])
        seq = ctx.op("Reshape", [seq, ctx.i64([steps, -1, dim])], "seq")
        sweeps = []
        for sweep in range(2):
            base = 11 * sweep
            wt = lambda i: ctx.weight(node, base + i)  # noqa: E731
            w_all = ctx.op("Concat", [wt(0), wt(1), wt(2), wt(3)], f"w{sweep}", axis=0)
            w_x = ctx.op("Transpose", [cols(w_all, 0, dim, f"wx{sweep}_raw")], f"wx{sweep}", perm=[1, 0])
            w_h = ctx.op("Transpose", [cols(w_all, dim, dim + hd, f"wh{sweep}_raw")], f"wh{sweep}", perm=[1, 0])
            bias = ctx.op("Concat", [wt(7), wt(8), wt(9), wt(10)], f"b{sweep}", axis=0)
            gx = ctx.op("Add", [ctx.op("MatMul", [seq, w_x], f"gx{sweep}_raw"), bias], f"gx{sweep}")
            peep = [ctx.op("Transpose", [wt(i)], f"peep{sweep}_{i}", perm=[1, 0]) for i in (4, 5, 6)] \
                if a["peephole"] else None
            order = range(steps) if sweep == 0 else range(steps - 1, -1, -1)
            hs = {}
            hid = state = None
            for k, t in enumerate(order):
                tag = f"{sweep}_{t}"
                g = ctx.op("Gather", [gx, ctx.i64(t)], f"g{tag}_x", axis=0)
                if k:
                    g = ctx.op("Add", [g, ctx.op("MatMul", [hid, w_h], f"g{tag}_h")], f"g{tag}")
                gi, gc, go, gf = (cols(g, j * hd, (j + 1) * hd, f"{'icof'[j]}{tag}_pre") for j in range(4))
                if k and peep:
                    gi = ctx.op("Add", [gi, ctx.op("MatMul", [state, peep[0]], f"i{tag}_peep")], f"i{tag}_sum")
                    gf = ctx.op("Add", [gf, ctx.op("MatMul", [state, peep[2]], f"f{tag}_peep")], f"f{tag}_sum")
                cell = ctx.op("Mul", [ctx.op("Tanh", [gc], f"c{tag}"), ctx.op("Sigmoid", [gi], f"i{tag}")], f"ci{tag}")
                if k:
                    fs = ctx.op("Mul", [ctx.op("Sigmoid", [gf], f"f{tag}"), state], f"fs{tag}")
                    cell = ctx.op("Add", [cell, fs], f"s{tag}")
                if peep:
                    go = ctx.op("Add", [go, ctx.op("MatMul", [cell, peep[1]], f"o{tag}_peep")], f"o{tag}_sum")
                hid = ctx.op("Mul",
                             [ctx.op("Sigmoid", [go], f"o{tag}"), ctx.op("Tanh", [cell], f"tanh_s{tag}")], f"h{tag}")
                state = cell
                hs[t] = ctx.op("Reshape", [hid, ctx.i64([1, -1, hd])], f"h{tag}_3d")
            stacked = hs[0] if steps == 1 else ctx.op("Concat", [hs[t] for t in range(steps)], f"hs{sweep}", axis=0)
            four = ctx.op("Reshape", [stacked, ctx.i64([steps, rnns, -1, hd])], f"hs{sweep}_4d")
            sweeps.append(ctx.op("Transpose", [four], f"out{sweep}", perm=[2, 3, 0, 1] if y_dir else [2, 3, 1, 0]))
        ctx.add_node("Concat", sweeps, [node.outputs[0]], name=name, axis=1)
