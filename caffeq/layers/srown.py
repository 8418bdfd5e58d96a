"""LeYangNwpu/SROWN (47f59d5; caffe-master/src/caffe/layers, include/caffe/layers): its 4-bottom LinearSum and
its two-top TripletImageData.

- LinearSum (linear_sum_layer.cpp; no parameter message): bottoms x (N, C, ...), a foreground weight map, a
  background weight map (both x's shape with one channel) and a class flag (N, 1, ...), all with x's number of
  axes (LayerSetUp's CHECKs; its header's MinBottomBlobs is 2, but setup reads bottom 3, so fewer than four
  cannot load, and bottoms after the fourth are never read).  Top (N, C, 1, 1): per sample i, a gemv of x's
  C x (count from axis 2) rows with the background map where int(flag[i]) == 1 (C's truncation) and
  (i + 1) % 3 == 0, else with the foreground map.  The position rule counts samples over the whole batch,
  not within the data layer's (queries, positives, negatives) blocks.  The fork has only a CPU forward
  (Caffe's GPU mode falls back to it).
- TripletImageData with two tops (triplet_image_data_layer.cpp): wanji/caffe-sl's data layer
  (layers/caffe_sl.py) with a label per list line, its top (3 batch_size, 1, 1, 1), each line's label written
  for its query, positive and negative.
"""
import math

import torch

from .caffe_sl import TripletImageData
from .registry import AT_LEAST, Layer, LayerError, claim_layers, count, need_blobs

ROLES = "x, foreground weights, background weights, class flag"


def srown_linear_sum(x, fore, back, flag):
    """(N, C, ...) features, two (N, 1, ...) maps and (N, 1, ...) flags -> (N, C, 1, 1): each channel's dot
    product with the background map for flag 1 at every third sample, else with the foreground map."""
    n, c = x.shape[0], x.shape[1]
    k = math.prod(x.shape[2:])
    flag = flag.reshape(n)
    third = (torch.arange(1, n + 1, device=x.device) % 3) == 0
    # int(flag) == 1 exactly where 1 <= flag < 2 (NaN fails both)
    use_back = (flag >= 1) & (flag < 2) & third
    weights = torch.where(use_back.reshape(n, 1, 1), back.reshape(n, k, 1), fore.reshape(n, k, 1))
    return torch.bmm(x.reshape(n, c, k), weights).reshape(n, c, 1, 1)


# TransferNet's LinearSum takes exactly 2 bottoms; 3 can only be a short SROWN layer, told so by its parse
@claim_layers("LinearSum", lambda lp: len(lp.bottom) >= 3)
class SrownLinearSum(Layer):
    def parse(self, lp):
        need_blobs(lp, "LinearSum (SROWN's)", range(4, AT_LEAST), 1, ROLES)
        return {}

    def infer(self, attrs, in_shapes):
        x, fore, back, flag = (tuple(int(d) for d in s) for s in in_shapes[:4])
        if len(x) < 2:
            raise LayerError(f"LinearSum (SROWN's) needs x (bottom 0) with a channel axis, got {list(x)}")
        for role, s in (("foreground weights (bottom 1)", fore), ("background weights (bottom 2)", back)):
            if len(s) != len(x) or s[1] != 1 or s[:1] + s[2:] != x[:1] + x[2:]:
                raise LayerError(f"LinearSum (SROWN's) {role} {list(s)} must be x's shape {list(x)} with one "
                                 f"channel (the fork's CHECKs)")
        if len(flag) != len(x) or flag[0] != x[0] or any(d != 1 for d in flag[1:]):
            raise LayerError(f"LinearSum (SROWN's) class flag (bottom 3) {list(flag)} must be one value per sample "
                             f"of x {list(x)}, shaped {[x[0]] + [1] * (len(x) - 1)} (the fork's CHECKs)")
        return [(x[0], x[1], 1, 1)]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])

    def forward(self, attrs, params, x, fore, back, flag, *unread):
        return srown_linear_sum(x, fore, back, flag)

    def onnx(self, ctx, node):
        x, fore, back, flag = node.inputs[:4]
        shape = ctx.shape(x)
        c, k = shape[1], math.prod(shape[2:])
        rows = ctx.op("Reshape", [x, ctx.i64([0, c, k])], "rows", name=node.name)
        fore_column = ctx.op("Reshape", [fore, ctx.i64([0, k, 1])], "fore")
        back_column = ctx.op("Reshape", [back, ctx.i64([0, k, 1])], "back")
        flag = ctx.op("Reshape", [flag, ctx.i64([0, 1, 1])], "flag")
        is_one = ctx.op("And", [ctx.op("Not", [ctx.op("Less", [flag, ctx.f32(1.0)], "below_one")], "from_one"),
                                ctx.op("Less", [flag, ctx.f32(2.0)], "below_two")], "is_one")
        # the sample's position from the batch the graph is run with (dim 0 is symbolic)
        n = ctx.op("Gather", [ctx.op("Shape", [x], "shape"), ctx.i64(0)], "n", axis=0)
        positions = ctx.op("Range", [ctx.i64(1), ctx.op("Add", [n, ctx.i64(1)], "end"), ctx.i64(1)], "positions")
        third = ctx.op("Equal", [ctx.op("Mod", [positions, ctx.i64(3)], "mod"), ctx.i64(0)], "third")
        use_back = ctx.op("And", [is_one, ctx.op("Reshape", [third, ctx.i64([-1, 1, 1])], "third_3d")], "use_back")
        weights = ctx.op("Where", [use_back, back_column, fore_column], "weights")
        sums = ctx.op("MatMul", [rows, weights], "sums")
        ctx.add_node("Reshape", [sums, ctx.i64([0, c, 1, 1])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        x, fore, back, flag = emit.inputs[:4]
        return f"{emit.helper(srown_linear_sum)}({x}, {fore}, {back}, {flag})"


@claim_layers("TripletImageData", lambda lp: len(lp.top) == 2)
class SrownTripletImageData(TripletImageData):
    """caffe-sl's triplet reader with SROWN's label top: one value per image, (3 batch_size, 1, 1, 1)."""

    def label_shape(self, attrs, data):
        return (data[0], 1, 1, 1)


__all__ = ["SrownLinearSum", "SrownTripletImageData", "srown_linear_sum"]
