"""Sifei Liu's GateRecurrent, the linear recurrent layer of the LRNN / spatial propagation nets
(Liusifei/caffe-lowlevel b8abec0, src/caffe/layers/gaterecurrent_layer.cpp and .cu, last changed in e7cad1a;
zhjwustc/cvpr18_rnn_deblur_matcaffe 3e470fe has the same forward, and gaterecurrent_param at 1017).

Bottoms x (N, C, H, W) and the gate (N, num_output, H, W); top (N, num_output, H, W).  The recurrence runs
along the rows (horizontal: over the columns, left to right, or right to left with reverse) or the
columns (top to bottom, or bottom to top), each position of the other axis its own stream:
    L_t = [b] - (x_t W_x, or x_t without use_wx) + (t > 0: h_{t-1} W_h^T, or h_{t-1} without use_wh)
    h_t = g_t * L_t + restrict_g * (x_t W_x, or x_t)
with b the bias blob under use_bias (else 0), and g scaled by restrict_g first where it is below 1.  So
with restrict_g 1 each step blends the input and the previous step, h_t = (1 - g) x + g h_{t-1}.  Blobs
W_x (1, 1, C, num_output), W_h (1, 1, num_output, num_output) and the bias (1, 1, 1, num_output) are
always there; restrict_w > 0 clamps W_h to [-restrict_w, restrict_w] before each forward (the fork does it
in the blob itself).  `active` is LINEAR in every known net; another is refused, because the CPU forward
reads it from gaterecurrent_param and the GPU forward from spatialrecurrent_param.
"""
import numpy as np
import torch
from onnx import TensorProto, helper
from torch import nn

from .registry import Layer, LayerError, four_axes, need_blobs, register_layer


def gate_recurrence(x, gate, w_x, w_h, bias, horizontal: bool, reverse: bool, use_bias: bool, use_wx: bool,
                    use_wh: bool, restrict_g: float):
    """GateRecurrent's forward -> (N, num_output, H, W); W_h already clamped where restrict_w asks."""
    order = (3, 0, 2, 1) if horizontal else (2, 0, 3, 1)     # (T, N, streams, channels), as disorder_inputdata
    xs, gs = x.permute(order), gate.permute(order)
    if reverse:
        xs, gs = xs.flip(0), gs.flip(0)
    if restrict_g < 1:
        gs = gs * restrict_g
    w_x, w_h = w_x.reshape(w_x.shape[-2], w_x.shape[-1]), w_h.reshape(w_h.shape[-2], w_h.shape[-1])
    outs = []
    for t in range(xs.shape[0]):
        x_in = xs[t] @ w_x if use_wx else xs[t]
        level = bias.reshape(-1) - x_in if use_bias else -x_in
        if t > 0:
            level = level + (outs[-1] @ w_h.t() if use_wh else outs[-1])
        outs.append(gs[t] * level + restrict_g * x_in)
    hs = torch.stack(outs)
    if reverse:
        hs = hs.flip(0)
    return hs.permute((1, 3, 2, 0) if horizontal else (1, 3, 0, 2))


class GateRecurrence(nn.Module):
    """GateRecurrent's blobs and settings (gate_recurrence)."""

    def __init__(self, channels, num_output, settings, restrict_w):
        super().__init__()
        self.settings, self.restrict_w = settings, restrict_w
        self.W_x = nn.Parameter(torch.zeros(1, 1, channels, num_output))
        self.W_h = nn.Parameter(torch.zeros(1, 1, num_output, num_output))
        self.bias = nn.Parameter(torch.zeros(1, 1, 1, num_output))

    def forward(self, x, gate):
        w_h = self.W_h.clamp(-self.restrict_w, self.restrict_w) if self.restrict_w > 0 else self.W_h
        return gate_recurrence(x, gate, self.W_x, w_h, self.bias, *self.settings)


_SETTINGS = ("horizontal", "reverse", "use_bias", "use_wx", "use_wh", "restrict_g")


@register_layer("GateRecurrent")
class GateRecurrent(Layer):
    blob_names = ("W_x", "W_h", "bias")

    def parse(self, lp):
        need_blobs(lp, "GateRecurrent", (1, 2), 1, "x, gate")
        if len(lp.bottom) == 1:
            raise LayerError("GateRecurrent without a gate bottom is not implemented in its fork "
                             "(\"not implement none gate rnn\")")
        p = lp.gaterecurrent_param
        if p.active != p.LINEAR:
            raise LayerError(f"gaterecurrent_param.active {p.Active.Name(p.active)}: the fork's CPU forward reads "
                             f"the activation from gaterecurrent_param and its GPU forward from spatialrecurrent_param, "
                             f"so only LINEAR gives one answer")
        if p.num_output < 1:
            raise LayerError("gaterecurrent_param.num_output must be > 0")
        return {"num_output": int(p.num_output), "horizontal": bool(p.horizontal), "reverse": bool(p.reverse),
                "use_bias": bool(p.use_bias), "use_wx": bool(p.use_wx), "use_wh": bool(p.use_wh),
                "restrict_g": float(np.float32(p.restrict_g)), "restrict_w": float(np.float32(p.restrict_w))}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "GateRecurrent", "x (bottom 0)")
        out = (n, attrs["num_output"], h, w)
        if tuple(in_shapes[1]) != out:    # Reshape's CHECKs
            raise LayerError(f"GateRecurrent's gate must be {list(out)} (x's N, H, W and num_output channels), "
                             f"got {list(in_shapes[1])}")
        if not attrs["use_wx"] and c != attrs["num_output"]:
            raise LayerError(f"GateRecurrent without use_wx needs x's {c} channels to equal num_output "
                             f"{attrs['num_output']}")
        return [out]

    def param_shapes(self, attrs, in_shapes):
        c, k = in_shapes[0][1], attrs["num_output"]
        return [(1, 1, c, k), (1, 1, k, k), (1, 1, 1, k)]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        k = attrs["num_output"]
        return n * h * w * k * ((c if attrs["use_wx"] else 1) + (k if attrs["use_wh"] else 1))

    def _w_h(self, attrs, w_h):
        return w_h.clamp(-attrs["restrict_w"], attrs["restrict_w"]) if attrs["restrict_w"] > 0 else w_h

    def forward(self, attrs, params, x, gate):
        w_x, w_h, bias = params
        return gate_recurrence(x, gate, w_x, self._w_h(attrs, w_h), bias, *(attrs[k] for k in _SETTINGS))

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        x, gate = node.inputs
        c, k = ctx.shape(x)[1], a["num_output"]
        order = [3, 0, 2, 1] if a["horizontal"] else [2, 0, 3, 1]
        # (T, N, streams, channels) sequences; Scan runs them backwards for reverse
        xs = ctx.add_node("Transpose", [x], ctx.tmp(name + "_x_steps"), name=name, perm=order)
        gs = ctx.op("Transpose", [gate], "gate_steps", perm=order)
        if a["restrict_g"] < 1:
            gs = ctx.op("Mul", [gs, ctx.f32(a["restrict_g"])], "gate_scaled")
        x_ins = ctx.op("MatMul", [xs, ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([c, k])], "w_x")], "x_in") \
            if a["use_wx"] else xs
        if a["use_bias"]:
            levels = ctx.op("Sub", [ctx.op("Reshape", [ctx.weight(node, 2), ctx.i64([k])], "bias"), x_ins], "levels")
        else:
            levels = ctx.op("Neg", [x_ins], "levels")
        carried = ctx.op("Mul", [x_ins, ctx.f32(a["restrict_g"])], "carried")
        w_h = ctx.weight(node, 1)
        if a["restrict_w"] > 0:
            w_h = ctx.op("Clip", [w_h, ctx.f32(-a["restrict_w"]), ctx.f32(a["restrict_w"])], "w_h_clipped")
        w_h_t = ctx.op("Transpose", [ctx.op("Reshape", [w_h, ctx.i64([k, k])], "w_h")], "w_h_t", perm=[1, 0])
        zeros = ctx.op("ConstantOfShape", [ctx.op("Shape", [ctx.op("Gather", [levels, ctx.i64(0)], "level0", axis=0)],
                                                  "state_shape")], "h_start", value=np.array([0.0], np.float32))
        direction = [int(a["reverse"])]
        steps = ctx.tmp(name + "_h_steps")
        ctx.add_node("Scan", [zeros, w_h_t, levels, gs, carried],
                     [ctx.tmp(name + "_h_last"), ctx.tmp(name + "_w_h_out"), steps], name=name + "_scan",
                     body=_step_body(ctx, name, a["use_wh"]), num_scan_inputs=3,
                     scan_input_directions=direction * 3, scan_output_directions=direction)
        ctx.add_node("Transpose", [steps], [node.outputs[0]], perm=[1, 3, 2, 0] if a["horizontal"] else [1, 3, 0, 2])

    def pytorch_source(self, node, emit):
        a = node.attrs
        settings = tuple(a[k] for k in _SETTINGS)
        m = emit.instance(GateRecurrence, emit.in_shape(0)[1], a["num_output"], settings, a["restrict_w"],
                          needs=[gate_recurrence])
        for i, blob in enumerate(self.blob_names):
            emit.param(blob, i)
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"


def _step_body(ctx, name, use_wh):
    """Scan's step: states (h_{t-1} (N, streams, K), W_h^T passed on) and the step's level, gate and carried
    input term -> h_t = gate * (level + h_{t-1} W_h^T, or + h_{t-1}) + carried (h_{-1} = 0 adds nothing)."""
    names = {part: ctx.tmp(f"{name}_{part}") for part in
             ("h_prev", "w", "level", "gate", "carried", "h_in", "summed", "gated", "h", "w_next", "y")}
    nodes = []
    if use_wh:
        nodes.append(helper.make_node("MatMul", [names["h_prev"], names["w"]], [names["h_in"]]))
    else:
        nodes.append(helper.make_node("Identity", [names["h_prev"]], [names["h_in"]]))
    nodes += [helper.make_node("Add", [names["level"], names["h_in"]], [names["summed"]]),
              helper.make_node("Mul", [names["gate"], names["summed"]], [names["gated"]]),
              helper.make_node("Add", [names["gated"], names["carried"]], [names["h"]]),
              helper.make_node("Identity", [names["w"]], [names["w_next"]]),
              helper.make_node("Identity", [names["h"]], [names["y"]])]

    def value(part):
        return helper.make_tensor_value_info(names[part], TensorProto.FLOAT, None)
    return helper.make_graph(nodes, f"{name}_step", [value(p) for p in ("h_prev", "w", "level", "gate", "carried")],
                             [value(p) for p in ("h", "w_next", "y")])
