"""flukeskywalker/highway-networks (87d1c8d, cudnn_highway_layer.cpp/.cu; its CIFAR and MNIST highway nets):
CuDNNHighway, a highway layer of convolutions.

y = H * T + x * (1 - T), H = relu(conv(x, W_H) + b_H), T = sigmoid(conv(x, W_T) + b_T), both convolutions
zero-padded, stride 1, grouped as Caffe's.  highway_conv_param gives num_output (which must equal the input
channels), kernel_size or kernel_h / kernel_w, pad or pad_h / pad_w, stride (only 1), group, bias_term and
the gate's transform_kernel_size / transform_pad (default: the main kernel and pad).  The main convolution
must keep H x W; so must the gate's, which the fork does not check before cuDNN fails.  Blobs: W_H, W_T
(num_output, C / group, k, k), then b_H, b_T (num_output,) with bias_term.  TEST and TRAIN compute the same.
The fork has only a GPU forward (its CPU forward leaves the top unwritten), so builds without cuDNN lack the
type.
"""
import math

import torch
import torch.nn.functional as F

from .registry import Layer, LayerError, need_blobs, positive_field, register_layer

PARAM = "highway_conv_param"


def highway(x, w_h, w_t, b_h, b_t, pad: list[int], transform_pad: list[int], groups: int):
    """CuDNNHighway's forward: relu(conv) gated by sigmoid(conv), the rest carried from x."""
    h = torch.relu(F.conv2d(x, w_h, b_h, padding=pad, groups=groups))
    t = torch.sigmoid(F.conv2d(x, w_t, b_t, padding=transform_pad, groups=groups))
    return h * t + x * (1 - t)


def _pair(p, both, h, w, what):
    """(height, width) from `both` or its _h / _w pair (the fork's XOR checks)."""
    if p.HasField(h) or p.HasField(w):
        if p.HasField(both) or not (p.HasField(h) and p.HasField(w)):
            raise LayerError(f"{PARAM}: give {what} as {both}, or as both {h} and {w}")
        return [int(getattr(p, h)), int(getattr(p, w))]
    return [int(getattr(p, both))] * 2


@register_layer("CuDNNHighway")
class CuDNNHighway(Layer):
    def parse(self, lp):
        need_blobs(lp, "CuDNNHighway", 1, 1)
        p = lp.highway_conv_param
        kernel = _pair(p, "kernel_size", "kernel_h", "kernel_w", "the kernel")
        if min(kernel) <= 0:
            raise LayerError(f"{PARAM}: the kernel size must be positive, got {kernel}")
        pad = _pair(p, "pad", "pad_h", "pad_w", "the padding")
        if _pair(p, "stride", "stride_h", "stride_w", "the stride") != [1, 1]:
            raise LayerError(f"{PARAM}: CuDNNHighway takes stride 1 only (the fork's check)")
        tk = int(p.transform_kernel_size) if p.HasField("transform_kernel_size") else None
        if tk is not None and tk <= 0:
            raise LayerError(f"{PARAM}.transform_kernel_size must be positive, got {tk}")
        tp = int(p.transform_pad) if p.HasField("transform_pad") else None
        return {"num_output": positive_field(p.num_output, f"{PARAM}.num_output"), "kernel": kernel, "pad": pad,
                "transform_kernel": [tk, tk] if tk else kernel, "transform_pad": [tp, tp] if tp is not None else pad,
                "group": positive_field(p.group, f"{PARAM}.group"), "bias_term": bool(p.bias_term)}

    def blob_names_for(self, attrs):
        return ("weight", "transform_weight", "bias", "transform_bias") if attrs["bias_term"] else \
            ("weight", "transform_weight")

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"CuDNNHighway takes a 4-axis bottom (the fork's check), got {list(s)}")
        n, c = s[1], attrs["num_output"]
        if n != c or c % attrs["group"]:
            raise LayerError(f"CuDNNHighway needs {PARAM}.num_output equal to the input channels ({n}), "
                             f"divisible by group {attrs['group']}, got {c}")
        for what, k, pad in (("", attrs["kernel"], attrs["pad"]),
                             ("the transform gate's ", attrs["transform_kernel"], attrs["transform_pad"])):
            out = [d + 2 * p - kk + 1 for d, p, kk in zip(s[2:], pad, k)]
            if out != list(s[2:]):
                raise LayerError(f"CuDNNHighway: {what}kernel {k} with pad {pad} turns {list(s[2:])} into {out}; "
                                 f"the layer keeps the size")
        return [s]

    def param_shapes(self, attrs, in_shapes):
        c, g = attrs["num_output"], attrs["group"]
        shapes = [(c, c // g, *attrs["kernel"]), (c, c // g, *attrs["transform_kernel"])]
        return shapes + ([(c,), (c,)] if attrs["bias_term"] else [])

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        per_out = c // attrs["group"] * (math.prod(attrs["kernel"]) + math.prod(attrs["transform_kernel"]))
        return n * c * h * w * per_out

    def forward(self, attrs, params, x):
        b_h, b_t = (params[2], params[3]) if attrs["bias_term"] else (None, None)
        return highway(x, params[0], params[1], b_h, b_t, attrs["pad"], attrs["transform_pad"], attrs["group"])

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]

        def conv(w, b, k, pad, hint):
            ins = [x, ctx.weight(node, w)] + ([ctx.weight(node, b)] if a["bias_term"] else [])
            return ctx.op("Conv", ins, hint, group=a["group"], kernel_shape=k, pads=pad + pad, strides=[1, 1])
        h = ctx.op("Relu", [conv(0, 2, a["kernel"], a["pad"], "cell")], "h")
        t = ctx.op("Sigmoid", [conv(1, 3, a["transform_kernel"], a["transform_pad"], "gate_in")], "t")
        carry = ctx.op("Mul", [x, ctx.op("Sub", [ctx.const(torch.ones(()).numpy()), t], "carry_gate")], "carry")
        ctx.add_node("Add", [ctx.op("Mul", [h, t], "gated"), carry], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.blob_parameters(self.blob_names_for(a))
        biases = f"{m}['bias'], {m}['transform_bias']" if a["bias_term"] else "None, None"
        return (f"{emit.helper(highway)}({emit.inputs[0]}, {m}['weight'], {m}['transform_weight'], {biases}, "
                f"{a['pad']}, {a['transform_pad']}, {a['group']})")
