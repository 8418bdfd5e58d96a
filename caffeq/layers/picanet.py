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
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .registry import Layer, LayerError, four_axes, need_blobs, register_layer

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
        i64 = lambda v: ctx.const(np.array(v, np.int64))  # noqa: E731

        def op(op_type, inputs, hint, **kw):
            return ctx.add_node(op_type, inputs, ctx.tmp(f"{name}_{hint}"), **kw)

        extent = dil * (kernel - 1) + 1
        out_h, out_w = (1, 1) if glob else (h1, w1)
        extra_h = max(0, (out_h - 1) * stride + extent - (h0 + 2 * pad))
        extra_w = max(0, (out_w - 1) * stride + extent - (w0 + 2 * pad))
        xp = x
        if pad or extra_h or extra_w:
            xp = op("Pad", [x, i64([0, 0, pad, pad, 0, 0, pad + extra_h, pad + extra_w])], "pad")
        if glob:
            win = op("Slice", [xp, i64([0, 0]), i64([extent, extent]), i64([2, 3]), i64([dil, dil])], "window")
            col = op("Reshape", [win, i64([0, c, kk])], "col")
            a = op("Reshape", [att, i64([0, kk, h1 * w1])], "att")
            prod = op("MatMul", [col, a], "prod")
            ctx.add_node("Reshape", [prod, i64([0, c, h1, w1])], [node.outputs[0]], name=name)
            return
        total = None
        for k in range(kk):
            top, left = (k // kernel) * dil, (k % kernel) * dil
            ends = [top + (h1 - 1) * stride + 1, left + (w1 - 1) * stride + 1]
            shifted = op("Slice", [xp, i64([top, left]), i64(ends), i64([2, 3]), i64([stride, stride])],
                         f"shift{k}")
            a_k = op("Slice", [att, i64([k]), i64([k + 1]), i64([1])], f"att{k}")
            term = op("Mul", [shifted, a_k], f"term{k}")
            if total is None:
                total = term
            elif k == kk - 1:
                ctx.add_node("Add", [total, term], [node.outputs[0]], name=name)
                return
            else:
                total = op("Add", [total, term], f"sum{k}")
        ctx.add_node("Identity", [total], [node.outputs[0]], name=name)
