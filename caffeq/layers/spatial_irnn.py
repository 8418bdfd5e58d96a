"""sherylwang/spatial-IRNN (8581318; "Siamese recurrent architecture for visual tracking", Xu et al. 2017):
the spatial IRNN's four sweeps RNNUP, RNNDOWN, RNNLEFT and RNNRIGHT (src/caffe/layers/rnn_{up,down,left,right}
_layer.cpp and .cu, include/caffe/layers/spatial_irnn_layer.hpp; fields in patch.proto).

Each layer has one bottom and one top of the bottom's shape, and one blob W (C, C), C the bottom's channels
(read through num/channels/height/width, so at most 4 axes, 1 past the last).  The sweep runs along axis 0:
the nets permute the map first, (H, C, N, W) for up / down and (W, C, H, N) for left / right, so each
slice is one row or one column of every item.  With x_s the slice s as a (C, rest) matrix:
    h_first = relu(x_first),  h_s = relu(x_s + W h_prev)
(Caffe: the input copied into the top, then gemm(W, previous slice's top) added with beta 1, then ReLU; no
bias, a zero initial state).  RNNDOWN and RNNRIGHT sweep s = 0, 1, ... (prev = s - 1); RNNUP and RNNLEFT
sweep backwards from the last slice (prev = s + 1).  The two pairs run the same code; only the axis the
nets permute into axis 0 differs.  ReLU as the CPU forward, max(x, 0), which keeps a NaN (the GPU kernel
writes 0 for it).  `rnn_*_param.weight_filler` only initializes training; `axis` is never read by the fork.
"""
import numpy as np
import torch
from onnx import TensorProto, helper
from torch import nn

from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def spatial_irnn(x, weight, backwards: bool):
    """The spatial IRNN sweep along axis 0 of x (at most 4 axes): relu(x_s + W h_prev), relu(x) first."""
    steps, channels = x.shape[0], weight.shape[0]
    seq = x.reshape(steps, channels, -1)
    order = range(steps - 1, -1, -1) if backwards else range(steps)
    outs = [seq[0]] * steps
    prev = None
    for s in order:
        h = torch.relu(seq[s] if prev is None else seq[s] + weight @ prev)
        outs[s] = h
        prev = h
    return torch.stack(outs).reshape(x.shape)


class SpatialIRNN(nn.Module):
    """One sweep of sherylwang/spatial-IRNN (spatial_irnn) and its recurrent weights (C, C)."""

    def __init__(self, channels, backwards):
        super().__init__()
        self.backwards = backwards
        self.weight = nn.Parameter(torch.zeros(channels, channels))

    def forward(self, x):
        return spatial_irnn(x, self.weight, self.backwards)


# ---- the specs --------------------------------------------------------------------------------

#: type -> (its parameter field, sweeps backwards along axis 0)
_SWEEPS = {"RNNUP": ("rnn_up_param", True), "RNNDOWN": ("rnn_down_param", False),
           "RNNLEFT": ("rnn_left_param", True), "RNNRIGHT": ("rnn_right_param", False)}


@register_layer(*_SWEEPS)
class SpatialIRNNSweep(Layer):
    blob_names = ("weight",)
    weight_axes = {0: 0}

    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        field, backwards = _SWEEPS[lp.type]
        attrs = {"type": lp.type, "backwards": backwards}
        if lp.HasField(field) and getattr(lp, field).axis != 1:
            attrs["reading_notes"] = [f"{field}.axis {getattr(lp, field).axis} is read and "
                                      f"ignored, as the fork's code ignores it (the sweep always runs along axis 0)"]
        return attrs

    def _channels(self, attrs, shape):
        if not len(shape):
            raise LayerError(f"{attrs['type']} needs a bottom of 1 to 4 axes, got a scalar")
        return legacy_nchw(shape, attrs["type"])[1]

    def infer(self, attrs, in_shapes):
        self._channels(attrs, in_shapes[0])
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        c = self._channels(attrs, in_shapes[0])
        return [(c, c)]

    def macs(self, attrs, in_shapes, out_shapes):
        c = self._channels(attrs, in_shapes[0])
        return (in_shapes[0][0] - 1) * c * int(np.prod(in_shapes[0][1:]))

    def forward(self, attrs, params, x):
        return spatial_irnn(x, params[0], attrs["backwards"])

    def onnx(self, ctx, node):
        name, backwards = node.name, node.attrs["backwards"]
        x = node.inputs[0]
        c = self._channels(node.attrs, ctx.shape(x))
        seq = ctx.op("Reshape", [x, ctx.i64([0, c, -1])], "steps")           # (S, C, rest)
        # the states: h_prev (any slice to start: the first step ignores it), whether a step ran, W passed on;
        # Scan walks the slices backwards for up / left
        h_start = ctx.op("Gather", [seq, ctx.i64(0)], "h_start", axis=0)
        direction = [int(backwards)]
        steps = ctx.tmp(name + "_h_steps")
        ctx.add_node("Scan", [h_start, ctx.const(np.array(False), name + "_not_started"), ctx.weight(node, 0), seq],
                     [ctx.tmp(name + "_h_last"), ctx.tmp(name + "_started"), ctx.tmp(name + "_w_out"), steps],
                     name=name + "_scan", body=_sweep_body(ctx, name), num_scan_inputs=1,
                     scan_input_directions=direction, scan_output_directions=direction)
        ctx.add_node("Reshape", [steps, ctx.i64([0, *ctx.shape(x)[1:]])], [node.outputs[0]], name=name)

    def pytorch_source(self, node, emit):
        m = emit.instance(SpatialIRNN, self._channels(node.attrs, emit.in_shape(0)), node.attrs["backwards"],
                          needs=[spatial_irnn])
        emit.param("weight", 0)
        return f"{m}({emit.inputs[0]})"


def _sweep_body(ctx, name):
    """Scan's step: states (h_prev (C, rest), started, W passed on) and the slice x_s -> h_s = relu(x_s + W h_prev),
    relu(x_s) on the first step (a Where: W h_prev is never added there, not even as a zero)."""
    parts = ("h_prev", "started", "w", "x", "wh", "summed", "pre", "h", "started_next", "w_next", "y")
    names = {part: ctx.tmp(f"{name}_{part}") for part in parts}
    nodes = [helper.make_node("MatMul", [names["w"], names["h_prev"]], [names["wh"]]),
             helper.make_node("Add", [names["x"], names["wh"]], [names["summed"]]),
             helper.make_node("Where", [names["started"], names["summed"], names["x"]], [names["pre"]]),
             helper.make_node("Relu", [names["pre"]], [names["h"]]),
             helper.make_node("Constant", [], [names["started_next"]],
                              value=helper.make_tensor(names["started_next"] + "_value", TensorProto.BOOL, [], [True])),
             helper.make_node("Identity", [names["w"]], [names["w_next"]]),
             helper.make_node("Identity", [names["h"]], [names["y"]])]

    def value(part, kind=TensorProto.FLOAT):
        return helper.make_tensor_value_info(names[part], kind, None)
    return helper.make_graph(nodes, f"{name}_sweep",
                             [value("h_prev"), value("started", TensorProto.BOOL), value("w"), value("x")],
                             [value("h"), value("started_next", TensorProto.BOOL), value("w_next"), value("y")])
