"""yifita/caffe's MergeBatch (de4892f, merge_batch_layer.cpp/.cu; yifita/action.sr_cnn's person and scene score
fusion): despite its name an elementwise merge of its data bottoms, all of one shape, into one top of that shape.

- SUM: the data bottoms added.  MAX: starting from -FLT_MAX, a bottom's value replaces the running one where it
  is greater (strict <, so a NaN never enters).  MEAN: the fork's forward aborts ("Unknown merge operation"),
  refused at load.
- ignore_blob: bottom 0 is a (1, 1, D, B) coefficient blob for the D data bottoms and their batch of B items
  (the fork CHECKs axes 2 and 3 only and reads the first D x B values);
  SUM weighs item j of data bottom i by coefficient (i, j), MAX skips item j of bottom i where that coefficient
  is 0 (an item every bottom skips stays -FLT_MAX).  The fork CHECKs two data bottoms or more there.
"""
import torch

from ..io.schema import caffe_pb2
from .pooling import FLT_MAX
from .registry import AT_LEAST, Layer, LayerError, need_blobs, register_layer, torch_sources

SUM, MEAN = caffe_pb2.MergeBatchParameter.SUM, caffe_pb2.MergeBatchParameter.MEAN


def merge_batch(op: int, coeff, xs: list[torch.Tensor]):
    """MergeBatch's forward over the data bottoms xs, coeff the (1, 1, D, B) coefficients or None."""
    items = xs[0].shape[0]
    weights = None if coeff is None else coeff.reshape(-1)[: len(xs) * items].reshape(len(xs), items)
    if op == 1:   # SUM
        out = torch.zeros_like(xs[0])
        for i, x in enumerate(xs):
            w = 1.0 if weights is None else weights[i].reshape((items,) + (1,) * (x.dim() - 1))
            out = out + w * x
        return out
    out = torch.full_like(xs[0], -3.4028234663852886e38)
    for i, x in enumerate(xs):
        take = out < x
        if weights is not None:
            take = take & (weights[i] != 0).reshape((items,) + (1,) * (x.dim() - 1))
        out = torch.where(take, x, out)
    return out


TORCH_MERGE_BATCH = torch_sources(merge_batch)


@register_layer("MergeBatch")
class MergeBatch(Layer):
    def parse(self, lp):
        p = lp.merge_batch_param
        if p.operation == MEAN:
            raise LayerError("merge_batch_param.operation MEAN: the fork's forward aborts on it (Unknown merge "
                             "operation)")
        weighted = bool(p.ignore_blob)
        need_blobs(lp, "MergeBatch", range(3 if weighted else 1, AT_LEAST), 1,
                   roles="coefficients, data, data, ..." if weighted else "data, ...")
        return {"op": int(p.operation), "weighted": weighted}

    def infer(self, attrs, in_shapes):
        data = [tuple(s) for s in in_shapes[1:]] if attrs["weighted"] else [tuple(s) for s in in_shapes]
        if any(s != data[0] for s in data):
            raise LayerError(f"the data bottoms must all have one shape, got {[list(s) for s in data]}")
        if attrs["weighted"]:
            c = tuple(in_shapes[0])
            if len(c) < 4 or c[2] != len(data) or c[3] != data[0][0]:
                raise LayerError(f"ignore_blob's coefficients must be (1, 1, {len(data)} data bottoms, "
                                 f"{data[0][0] if data[0] else '?'} items), got {list(c)}")
        return [data[0]]

    def forward(self, attrs, params, *bottoms):
        coeff, xs = (bottoms[0], list(bottoms[1:])) if attrs["weighted"] else (None, list(bottoms))
        return merge_batch(attrs["op"], coeff, xs)

    def onnx(self, ctx, node):
        a = node.attrs
        inputs = list(node.inputs)
        coeff, xs = (inputs[0], inputs[1:]) if a["weighted"] else (None, inputs)
        shape = ctx.shape(xs[0])
        per_item = ctx.i64([shape[0]] + [1] * (len(shape) - 1))
        weights = None
        if coeff is not None:
            flat = ctx.op("Reshape", [coeff, ctx.i64([-1])], "flat")
            first = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([len(xs) * shape[0]])], "first")
            weights = ctx.op("Reshape", [first, ctx.i64([len(xs), shape[0]])], "weights")
        out = None if a["op"] == SUM else ctx.filled(xs[0], -FLT_MAX, "lowest")
        for i, x in enumerate(xs):
            w = None
            if weights is not None:
                row = ctx.op("Gather", [weights, ctx.i64(i)], f"w{i}", axis=0)
                w = ctx.op("Reshape", [row, per_item], f"w{i}_items")
            if a["op"] == SUM:
                term = x if w is None else ctx.op("Mul", [w, x], f"weighted{i}")
                out = term if out is None else ctx.op("Add", [out, term], f"sum{i}")
            else:
                take = ctx.op("Less", [out, x], f"greater{i}")
                if w is not None:
                    used = ctx.op("Not", [ctx.op("Equal", [w, ctx.f32(0.0)], f"skip{i}")], f"used{i}")
                    take = ctx.op("And", [take, used], f"take{i}")
                out = ctx.op("Where", [take, x, out], f"max{i}")
        ctx.add_node("Identity", [out], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        ins = emit.inputs
        coeff, xs = (ins[0], ins[1:]) if node.attrs["weighted"] else ("None", ins)
        return f"{emit.helper(TORCH_MERGE_BATCH)}({node.attrs['op']}, {coeff}, [{', '.join(xs)}])"


__all__ = ["MergeBatch"]
