"""christopher5106/last_caffe_with_stn's Repeat (037482a, src/caffe/layers/repeat_layer.cpp / .cu): an item
of K values (axis 1 on) times a learnable (num_repeats K, K) weight blob, initialized as num_repeats stacked
identities, so top (N, num_repeats, the bottom's axes 1...) starts as num_repeats copies of the item.  The
blob trains like any weight (the fork's nets give it no lr_mult 0): the product is computed with the stored
blob.  The fork's top shape follows axis 1 whatever repeat_param.axis says: other axes are refused.
"""
import numpy as np
import torch
from torch import nn

from .registry import Layer, LayerError, canonical_axis, count, need_blobs, register_layer


class RepeatProduct(nn.Module):
    """Repeat: each item flattened, times the (repeats K, K) weight, as (N, repeats, the item's shape)."""

    def __init__(self, repeats: int, k: int):
        super().__init__()
        self.repeats = repeats
        self.weight = nn.Parameter(torch.zeros(repeats * k, k))

    def forward(self, x):
        y = x.flatten(1) @ self.weight.t()   # zero rows too (a reshape to -1 cannot size them)
        return y.reshape([x.shape[0], self.repeats] + list(x.shape[1:]))


@register_layer("Repeat")
class Repeat(Layer):
    blob_names = ("weight",)

    def parse(self, lp):
        need_blobs(lp, "Repeat", 1, 1)
        p = lp.repeat_param
        if p.num_repeats < 1:
            raise LayerError("repeat_param.num_repeats must be >= 1")
        return {"repeats": int(p.num_repeats), "axis": int(p.axis)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2 or canonical_axis(attrs["axis"], len(s), "repeat_param.axis") != 1:
            raise LayerError(f"Repeat's top follows axis 1 (the fork's Reshape): repeat_param.axis {attrs['axis']} "
                             f"on a {list(s)} bottom is not supported")
        return [(s[0], attrs["repeats"]) + s[1:]]

    def param_shapes(self, attrs, in_shapes):
        k = count(in_shapes[0], 1)
        return [(attrs["repeats"] * k, k)]

    def init_params(self, attrs, shapes, rng):
        rows, k = shapes[0]
        return [np.tile(np.eye(k, dtype=np.float32), (rows // k, 1))]   # LayerSetUp's stacked identities

    def macs(self, attrs, in_shapes, out_shapes):
        return in_shapes[0][0] * attrs["repeats"] * count(in_shapes[0], 1) ** 2

    def forward(self, attrs, params, x):
        y = x.flatten(1) @ params[0].t()
        return y.reshape((x.shape[0], attrs["repeats"]) + tuple(x.shape[1:]))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        shape = ctx.shape(x)
        flat = ctx.merge_axes(x, 1, "items", name=node.name)
        y = ctx.op("MatMul", [flat, ctx.weight(node, 0, transpose=True)], "product")
        ctx.add_node("Reshape", [y, ctx.i64([0, node.attrs["repeats"]] + list(shape[1:]))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.instance(RepeatProduct, node.attrs["repeats"], count(emit.in_shape(0), 1))
        emit.param("weight", 0)
        return f"{m}({emit.inputs[0]})"
