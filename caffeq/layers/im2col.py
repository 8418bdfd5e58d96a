"""Im2col (BVLC im2col_layer.cpp): every convolution window's values as channels, so that a
convolution becomes a matrix product (N, C * prod(kernel), *output spatial dims)."""
import math

import numpy as np
import torch.nn.functional as F

from .conv import resolve_geometry
from .registry import Layer, LayerError, register_layer
from .shape_ops import i64, onnx_dims, onnx_reshape

# ---- Im2col -------------------------------------------------------------------

@register_layer("Im2col")
class Im2col(Layer):
    def parse(self, lp):
        return {"param": lp.convolution_param, "axis": int(lp.convolution_param.axis)}

    def _resolve(self, attrs, shape):
        resolve_geometry(attrs, shape)   # Im2colLayer::LayerSetUp reads them as convolutions do

    @staticmethod
    def _out_shape(attrs, shape):
        axis = attrs["_axis"]
        top = list(shape)
        top[axis] = shape[axis] * math.prod(attrs["kernel"])
        for i, (k, s, p, d) in enumerate(zip(attrs["kernel"], attrs["stride"], attrs["pad"],
                                             attrs["dilation"])):
            n = shape[axis + 1 + i]
            top[axis + 1 + i] = (n + 2 * p - (d * (k - 1) + 1)) // s + 1
        return tuple(top)

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        self._resolve(attrs, s)
        top = self._out_shape(attrs, s)
        if any(v <= 0 for v in top[attrs["_axis"] + 1:]):
            raise LayerError(f"output would be empty: bottom {list(s)}, kernel {list(attrs['kernel'])}, "
                             f"pad {list(attrs['pad'])}")
        return [top]

    def forward(self, attrs, params, x):
        axis = attrs["_axis"]
        lead = tuple(x.shape[:axis])
        top = self._out_shape(attrs, tuple(x.shape))
        x = x.reshape((-1,) + tuple(x.shape[axis:]))  # Caffe loops over count(0, axis) items
        k, s, p, d = attrs["kernel"], attrs["stride"], attrs["pad"], attrs["dilation"]
        if len(k) == 2:
            # F.unfold orders columns as channel, kernel row, kernel col: Caffe's im2col order
            cols = F.unfold(x, k, dilation=d, padding=p, stride=s)
        else:
            pads = [v for pd in reversed(p) for v in (pd, pd)]
            x = F.pad(x, pads) if any(p) else x
            for i, (kk, ss, dd) in enumerate(zip(k, s, d)):
                # windows along spatial axis i become a trailing axis; keep every d-th element
                x = x.unfold(2 + i, dd * (kk - 1) + 1, ss)[..., ::dd]
            nsp = len(k)
            # (B, C, O..., K...) -> (B, C, K..., O...)
            perm = [0, 1] + [2 + nsp + i for i in range(nsp)] + [2 + i for i in range(nsp)]
            cols = x.permute(perm)
        return cols.reshape(lead + tuple(top[axis:]))

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        shape = tuple(ctx.shape(x))
        axis, k = a["_axis"], a["kernel"]
        c, kk = int(shape[axis]), math.prod(k)
        # a grouped convolution with one-hot kernels: output channel c*K + j copies input
        # channel c at kernel position j (exact: each output is x*1 plus zeros)
        w = np.zeros((c * kk, 1) + tuple(k), np.float32)
        onehot = np.eye(kk, dtype=np.float32).reshape((kk, 1) + tuple(k))
        for ch in range(c):
            w[ch * kk:(ch + 1) * kk] = onehot
        top = self._out_shape(a, shape)
        src = x
        if axis != 1:
            src = ctx.tmp(node.name + "_merged")
            onnx_reshape(ctx, x, [-1] + [int(v) for v in shape[axis:]], src)
        conv_out = node.outputs[0] if axis == 1 else ctx.tmp(node.name + "_cols")
        ctx.add_node("Conv", [src, ctx.const(w, node.name + "_onehot")], [conv_out], name=node.name,
                     kernel_shape=list(k), strides=list(a["stride"]), pads=list(a["pad"]) * 2,
                     dilations=list(a["dilation"]), group=c)
        if axis != 1:
            lead = onnx_dims(ctx, x, 0, axis)
            target = ctx.tmp(node.name + "_shape")
            ctx.add_node("Concat", [lead, ctx.const(i64(top[axis:]))], [target], axis=0)
            ctx.add_node("Reshape", [conv_out, target], node.outputs)

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a["_axis"] != 1 or len(a["kernel"]) != 2:
            raise LayerError("only 2-D Im2col over axis 1 has PyTorch source here (F.unfold)")
        x = emit.inputs[0]
        top = self._out_shape(a, emit.in_shape(0))
        emit.uses("F")
        return (f"F.unfold({x}, {list(a['kernel'])}, dilation={list(a['dilation'])}, "
                f"padding={list(a['pad'])}, stride={list(a['stride'])})"
                f".reshape([{x}.shape[0], {top[1]}, {top[2]}, {top[3]}])")
