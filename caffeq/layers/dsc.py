"""xw-hu's DSC (direction-aware spatial context, shadow detection and removal) layers, from its Caffe,
xw-hu/CF-Caffe 477b79f (src/caffe/layers/irnn_layer.cu and eltwise_advance_layer.cu, last changed in
e75b9ce).  Both forwards exist only on the GPU (their Forward_cpu is NOT_IMPLEMENTED), so these follow
the CUDA kernels.

IRNN: bottom x (N, C, H, W) and one blob of 4 C recurrent weights, in the order left, up, right, down;
four tops shaped as x, in that order.  Each is a ReLU recurrence along a row or a column that starts
from 0 at an edge:
    right[h, w] = relu(right[h, w - 1] * w_right[c] + x[h, w]), from w = 0;
    left[h, w]  = relu(left[h, w + 1] * w_left[c] + x[h, w]),   from w = W - 1;
    down and up: the same along the column, from the top and from the bottom.
The kernel recomputes each position's sweep from the edge, which gives the same values as one sweep.
nvcc fuses s * w + x into one multiply-add; this rounds twice, so the last bit may differ.

EltwiseAdv, `eltwise_param { operation: PROD }` (the fork's SUM and MAX are NOT_IMPLEMENTED):
top[n, c] = x0[n, c] * x1[n, c // r] with r = count(x0) / count(x1), so one channel of x1 weighs a
block of r channels of x0 (DSC weighs each direction's 512 channels by its attention map).
"""
import numpy as np
import torch
from onnx import TensorProto, helper
from torch import nn

from .elementwise import _OP_NAMES, PROD
from .registry import Layer, LayerError, count, four_axes, need_blobs, register_layer

#: IRNN's tops, in the order of the fork's tops and of its weight blob
DIRECTIONS = ("left", "up", "right", "down")
#: per direction: (the axis its recurrence runs along, whether it starts from the far edge)
SWEEPS = ((3, True), (2, True), (3, False), (2, False))


def relu_sweep(x: torch.Tensor, weight: torch.Tensor, axis: int, backwards: bool):
    """s_i = relu(s_prev * weight + x_i) along `axis` of x, from s = 0 at the first (backwards: the
    last) position; weight (1, C, 1) broadcasts over the rows or columns that one step holds."""
    steps = x.unbind(axis)
    count = len(steps)
    state = torch.zeros_like(steps[0])
    out: list[torch.Tensor] = []
    for k in range(count):
        state = torch.relu(state * weight + steps[count - 1 - k if backwards else k])
        out.append(state)
    if backwards:
        out.reverse()
    return torch.stack(out, axis)


def direction_rnns(x: torch.Tensor, weights: torch.Tensor, sweeps: list[tuple[int, bool]]):
    """DSC's IRNN: x (N, C, H, W) and weights (4 C,) -> one map per (axis, backwards) of `sweeps`."""
    per_direction = weights.reshape(len(sweeps), 1, x.shape[1], 1)
    maps: list[torch.Tensor] = []
    for i, (axis, backwards) in enumerate(sweeps):
        maps.append(relu_sweep(x, per_direction[i], axis, backwards))
    return maps


class DirectionRNNs(nn.Module):
    """DSC's IRNN layer: its recurrent weights (4 C,), one block of C per sweep."""

    def __init__(self, channels, sweeps):
        super().__init__()
        self.sweeps = [tuple(s) for s in sweeps]   # a list: what direction_rnns takes, also scripted
        self.weight = nn.Parameter(torch.ones(len(sweeps) * channels))

    def forward(self, x):
        return direction_rnns(x, self.weight, self.sweeps)


@register_layer("IRNN")
class IRNN(Layer):
    blob_names = ("weight",)

    def parse(self, lp):
        need_blobs(lp, "IRNN", 1, 4, "x")
        return {"initial_value": float(lp.irnn_param.initial_value)}

    def infer(self, attrs, in_shapes):
        shape = four_axes(in_shapes[0], "IRNN")
        return [shape] * 4

    def param_shapes(self, attrs, in_shapes):
        return [(4 * four_axes(in_shapes[0], "IRNN")[1],)]

    def init_params(self, attrs, shapes, rng):
        # LayerSetUp fills the blob with irnn_param.initial_value (a caffemodel's weights replace it)
        return [np.full(shapes[0], attrs["initial_value"], np.float32)]

    def forward(self, attrs, params, x):
        return direction_rnns(x, params[0], SWEEPS)

    def macs(self, attrs, in_shapes, out_shapes):
        return 4 * count(in_shapes[0])

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        channels = ctx.shape(x)[1]
        per_direction = ctx.add_node("Reshape", [ctx.weight(node, 0), ctx.i64([4, 1, channels, 1])],
                                     ctx.tmp(name + "_weights"), name=name)
        shape = ctx.add_node("Shape", [x], ctx.tmp(name + "_shape"))
        for i, (direction, (axis, backwards), top) in enumerate(zip(DIRECTIONS, SWEEPS, node.outputs)):
            weight = ctx.add_node("Gather", [per_direction, ctx.i64(i)], ctx.tmp(f"{name}_{direction}_weight"),
                                  axis=0)
            kept = [a for a in range(4) if a != axis]
            zeros_shape = ctx.add_node("Gather", [shape, ctx.i64(kept)], ctx.tmp(f"{name}_{direction}_state_shape"),
                                       axis=0)
            zeros = ctx.add_node("ConstantOfShape", [zeros_shape], ctx.tmp(f"{name}_{direction}_zeros"),
                                 value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
            body = _sweep_body(ctx, f"{name}_{direction}")
            ctx.add_node("Scan", [zeros, weight, x],
                         [ctx.tmp(f"{name}_{direction}_last"), ctx.tmp(f"{name}_{direction}_weight_out"), top],
                         name=f"{name}_{direction}", body=body, num_scan_inputs=1,
                         scan_input_axes=[axis], scan_input_directions=[int(backwards)],
                         scan_output_axes=[axis], scan_output_directions=[int(backwards)])

    def pytorch_source(self, node, emit):
        emit.helper(relu_sweep)
        m = emit.instance(DirectionRNNs, emit.in_shape(0)[1], SWEEPS, needs=[direction_rnns])
        emit.param("weight", 0)
        out = emit.tmp("directions")
        emit.stmt(f"{out} = {m}({emit.inputs[0]})")
        return [f"{out}[{i}]" for i in range(4)]


def _sweep_body(ctx, hint):
    """Scan's step: states (s, the direction's weights (1, C, 1), passed on unchanged) and the row or
    column x_i -> relu(s * weight + x_i), as the next state and the output at i."""
    state, weight, step = (ctx.tmp(f"{hint}_{part}") for part in ("state", "w", "x"))
    scaled, summed, new_state, weight_out, out = (ctx.tmp(f"{hint}_{part}")
                                                  for part in ("scaled", "sum", "next", "w_next", "y"))
    nodes = [helper.make_node("Mul", [state, weight], [scaled]),
             helper.make_node("Add", [scaled, step], [summed]),
             helper.make_node("Relu", [summed], [new_state]),
             helper.make_node("Identity", [weight], [weight_out]),
             helper.make_node("Identity", [new_state], [out])]

    def value(n):
        return helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
    return helper.make_graph(nodes, f"{hint}_step", [value(state), value(weight), value(step)],
                             [value(new_state), value(weight_out), value(out)])


def channel_block_product(x, weights):
    """EltwiseAdv's PROD: each channel of `weights` (N, C / r, H, W) scales r adjacent channels of x."""
    return x * weights.repeat_interleave(x.shape[1] // weights.shape[1], dim=1)


@register_layer("EltwiseAdv")
class EltwiseAdv(Layer):
    def parse(self, lp):
        need_blobs(lp, "EltwiseAdv", 2, 1, "x, weights")
        p = lp.eltwise_param
        if p.operation != PROD:
            op = _OP_NAMES.get(int(p.operation), str(p.operation))
            raise LayerError(f"EltwiseAdv runs only eltwise_param.operation PROD in its fork (its {op} is "
                             f"NOT_IMPLEMENTED), got {op}")
        if len(p.coeff):
            raise LayerError("EltwiseAdv's PROD takes no eltwise_param.coeff (the fork's LayerSetUp checks)")
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "EltwiseAdv", "x (bottom 0)")
        _, c1, h1, w1 = weights = four_axes(in_shapes[1], "EltwiseAdv", "weights (bottom 1)")
        # the kernel indexes bottom 1 with bottom 0's height and width, and as (N, C / r, H, W)
        if weights[0] != n or (h1, w1) != (h, w) or c1 < 1 or c % c1:
            raise LayerError(f"EltwiseAdv's weights {list(weights)} must be (N, C / r, H, W) for x "
                             f"{[n, c, h, w]}: the fork's kernel indexes them so")
        if n > 1 and c1 != c:
            # its offset for sample n is n * C * H * W into a blob of N * (C / r) * H * W
            raise LayerError(f"EltwiseAdv with weights of {c1} channels for {c} reads past them for a batch "
                             f"over 1 in its fork (it offsets each sample by x's channel count); batch {n}")
        return [(n, c, h, w)]

    def forward(self, attrs, params, x, weights):
        return channel_block_product(x, weights)

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])

    def onnx(self, ctx, node):
        x, weights = node.inputs
        (_, c, h, w), c1 = ctx.shape(x), ctx.shape(weights)[1]
        # (N, C1, 1, H, W) broadcast against x seen as (N, C1, r, H, W)
        blocks = ctx.add_node("Reshape", [x, ctx.i64([0, c1, c // c1, h, w])], ctx.tmp(node.name + "_blocks"),
                              name=node.name)
        scale = ctx.add_node("Unsqueeze", [weights, ctx.i64([2])], ctx.tmp(node.name + "_scale"))
        product = ctx.add_node("Mul", [blocks, scale], ctx.tmp(node.name + "_product"))
        ctx.add_node("Reshape", [product, ctx.i64([0, c, h, w])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(channel_block_product)}({emit.inputs[0]}, {emit.inputs[1]})"
