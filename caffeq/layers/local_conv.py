"""Local, the locally connected layer (BVLC/caffe's local-layer branch 5967fa4, local_layer.cpp; V1
`type: LOCAL` in forks that carry it): a convolution whose every output position has its own filter.

With K = C * kernel^2 (im2col's order: channel, kernel row, kernel column) and P = H_out * W_out:
  y[n, m, p] = sum_k col[n, k, p] * W[m, 0, k, p] + b[0, 0, m, p]
Blobs: weight (num_output, 1, K, P), bias (1, 1, num_output, P) when bias_term.  H_out =
(H + 2 pad - kernel) / stride + 1 (floor), the same for W; square kernel, pad and stride only.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources


def locally_connected(x, weight, bias, kernel: int, stride: int, pad: int, out_h: int, out_w: int):
    """y[n, m, p] = sum_k col[n, k, p] * weight[m, 0, k, p] (+ bias[0, 0, m, p])."""
    cols = F.unfold(x, kernel, padding=pad, stride=stride)               # (N, K, P)
    m = weight.shape[0]
    y = torch.einsum("nkp,mkp->nmp", cols, weight.reshape(m, cols.shape[1], cols.shape[2]))
    if bias is not None:
        y = y + bias.reshape(m, -1)
    return y.reshape(x.shape[0], m, out_h, out_w)


class LocallyConnected(nn.Module):
    """Local with its weight (M, 1, K, P) and optional bias (1, 1, M, P)."""

    def __init__(self, channels, num_output, kernel, stride, pad, out_h, out_w, bias):
        super().__init__()
        self.kernel, self.stride, self.pad, self.out_h, self.out_w = kernel, stride, pad, out_h, out_w
        positions = out_h * out_w
        self.weight = nn.Parameter(torch.zeros(num_output, 1, channels * kernel * kernel, positions))
        self.bias = nn.Parameter(torch.zeros(1, 1, num_output, positions)) if bias else None

    def forward(self, x):
        return locally_connected(x, self.weight, self.bias, self.kernel, self.stride, self.pad,
                                 self.out_h, self.out_w)


TORCH_LOCALLY_CONNECTED = torch_sources(locally_connected, LocallyConnected)


@register_layer("Local")
class Local(Layer):
    def parse(self, lp):
        need_blobs(lp, "Local", 1, 1)
        p = lp.local_param
        if not p.HasField("kernel_size") or p.kernel_size < 1:
            raise LayerError("local_param.kernel_size must be set and >= 1")
        if p.num_output < 1:
            raise LayerError("local_param.num_output must be > 0")
        if p.stride < 1:
            raise LayerError("local_param.stride must be >= 1")
        return {"num_output": int(p.num_output), "kernel": int(p.kernel_size), "stride": int(p.stride),
                "pad": int(p.pad), "bias": bool(p.bias_term)}

    def _geometry(self, attrs, shape):
        if len(shape) != 4:
            raise LayerError(f"Local needs a 4-axis input, got {list(shape)}")
        _, c, h, w = shape
        k, s, pad = attrs["kernel"], attrs["stride"], attrs["pad"]
        if h < k or w < k:   # the branch's LayerSetUp checks the unpadded input
            raise LayerError(f"input {h}x{w} is smaller than the kernel {k}")
        return c, (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1

    def infer(self, attrs, in_shapes):
        _, oh, ow = self._geometry(attrs, in_shapes[0])
        return [(in_shapes[0][0], attrs["num_output"], oh, ow)]

    def param_shapes(self, attrs, in_shapes):
        c, oh, ow = self._geometry(attrs, in_shapes[0])
        m, positions = attrs["num_output"], oh * ow
        weight = (m, 1, c * attrs["kernel"] ** 2, positions)
        return [weight, (1, 1, m, positions)] if attrs["bias"] else [weight]

    def macs(self, attrs, in_shapes, out_shapes):
        c, _, _ = self._geometry(attrs, in_shapes[0])
        return int(np.prod(out_shapes[0])) * c * attrs["kernel"] ** 2

    def forward(self, attrs, params, x):
        _, oh, ow = self._geometry(attrs, tuple(x.shape))
        return locally_connected(x, params[0], params[1] if attrs["bias"] else None, attrs["kernel"],
                                 attrs["stride"], attrs["pad"], oh, ow)

    def onnx(self, ctx, node):
        a, x = node.attrs, node.inputs[0]
        n, c, h, w = (int(d) for d in ctx.shape(x))
        _, oh, ow = self._geometry(a, (n, c, h, w))
        k, m = a["kernel"], a["num_output"]
        depth, positions = c * k * k, oh * ow
        # im2col as a convolution with one-hot kernels: output channel (c, i, j) picks x[c] at (i, j)
        picks = np.eye(depth, dtype=np.float32).reshape(depth, c, k, k)
        cols = ctx.op("Conv", [x, ctx.const(picks)], "cols", kernel_shape=[k, k], strides=[a["stride"]] * 2,
                      pads=[a["pad"]] * 4)
        cols = ctx.op("Reshape", [cols, ctx.i64([n, 1, depth, positions])], "cols_flat")
        weight = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([1, m, depth, positions])], "weight")
        y = ctx.op("ReduceSum", [ctx.op("Mul", [cols, weight], "products"), ctx.i64([2])], "sums", keepdims=0)
        if a["bias"]:
            y = ctx.op("Add", [y, ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([1, m, positions])], "bias")],
                       "biased")
        ctx.add_node("Reshape", [y, ctx.i64([n, m, oh, ow])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        c, oh, ow = self._geometry(a, tuple(emit.in_shape(0)))
        mod = emit.instance(TORCH_LOCALLY_CONNECTED, c, a["num_output"], a["kernel"], a["stride"], a["pad"],
                            oh, ow, a["bias"])
        emit.param("weight", 0)
        if a["bias"]:
            emit.param("bias", 1)
        return f"{mod}({emit.inputs[0]})"
