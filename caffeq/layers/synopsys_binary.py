"""synopsys-caffe's TensorFlow elementwise layers Mul, Add, Sub and Div
(foss-for-synopsys-dwc-arc-processors/synopsys-caffe 977ba36a, src/caffe/layers/{mul,add,sub,div}_layer.cpp;
caffe.proto e73a136).  One design, four operations: top = bottom[0] OP operand, the operand bottom[1]
(Sub: bottom[0] - bottom[1], Div: bottom[0] / bottom[1]).

Shapes, as each Reshape computes them:
- either operand scalar (0 axes): the top takes the other's shape (a scalar when both are);
- the same number of axes: every axis equal or 1 (the fork's CHECK), the top the larger;
- different numbers of axes: aligned on the last axis, the extra leading axes the longer one's, each
  shared axis the larger size.  The fork checks nothing there, and its Forward indexes an axis of
  size > 1 with the top's index, reading outside the axis when the two sizes differ and neither is
  1: such pairs are refused.
So the result is numpy's broadcasting wherever the fork stays inside its blobs: torch and ONNX
broadcast the same way.  Forward_cpu: the values are op(a, b) in float32 (the scalar branches add
-b, scale by -1 or divide, which give the same floats).

Mul alone makes a blob: with one bottom the operand is its own blob of mul_param.mul_shape (empty: a
scalar), loaded from the caffemodel; Add, Sub and Div read a blob they never make with one bottom (no
LayerSetUp, no parameter message): the fork fails on load, so caffeq refuses them.  Bottoms past the
second are ignored, as the fork ignores them.  top == bottom[0] is refused (CHECK_NE); top ==
bottom[1] reshapes the operand to the top's shape before Forward reads it, so it is read only when the
operand already has the top's shape.
"""
import torch

from .registry import AT_LEAST, Layer, LayerError, need_blobs, register_layer

#: the operation and model.py's operator of each type
SYNOPSYS_BINARY_OPS = {"Mul": (torch.mul, "*"), "Add": (torch.add, "+"), "Sub": (torch.sub, "-"),
                       "Div": (torch.div, "/")}


def synopsys_binary_shape(a, b, what="Mul"):
    """The fork's top shape for operands of shapes `a` and `b` (Reshape), or a LayerError where the
    fork's CHECK fails or its Forward would read outside an operand."""
    a, b = [int(d) for d in a], [int(d) for d in b]
    if not a or not b:
        return b if not a else a
    n = max(len(a), len(b))
    pa, pb = [None] * (n - len(a)) + a, [None] * (n - len(b)) + b
    top = []
    for i, (da, db) in enumerate(zip(pa, pb)):
        if da is None or db is None:
            top.append(db if da is None else da)
            continue
        if da != db and 1 not in (da, db):
            if len(a) == len(b):
                raise LayerError(f"{what}: bottom shapes {a} and {b} differ at axis {i} ({da} vs {db}); "
                                 f"the fork needs equal sizes or 1")
            raise LayerError(f"{what}: bottom shapes {a} and {b} differ at axis {i} of the top ({da} vs {db}); "
                             f"the fork does not check ranks that differ and would read outside an operand")
        top.append(max(da, db))
    return top


@register_layer("Mul", "Add", "Sub", "Div")
class SynopsysBinary(Layer):
    """bottom[0] OP operand: operand = bottom[1], or (Mul) its blob of mul_param.mul_shape."""
    blob_names = ("operand",)

    def parse(self, lp):
        what = lp.type
        need_blobs(lp, what, range(1, AT_LEAST), 1, in_place=False)
        two = len(lp.bottom) >= 2
        a = {"op": what, "two_bottoms": two, "top_is_operand": two and lp.top[0] == lp.bottom[1]}
        if len(lp.bottom) > 2:
            a["reading_notes"] = [f"{what} '{lp.name}' reads bottoms 0 and 1; the fork ignores the other "
                                  f"{len(lp.bottom) - 2}, so does caffeq"]
        if two:
            return a
        if what != "Mul":
            raise LayerError(f"{what} with one bottom reads a blob the fork's {what} never makes (it has no "
                             f"parameter; the fork fails on load): give it two bottoms")
        shape = [int(d) for d in lp.mul_param.mul_shape]
        if 0 in shape:
            raise LayerError(f"mul_param.mul_shape {shape} makes an empty blob, which the fork's Forward "
                             f"reads outside of")
        a["operand_shape"] = tuple(shape)
        return a

    def infer(self, attrs, in_shapes):
        b = tuple(in_shapes[1]) if attrs["two_bottoms"] else attrs["operand_shape"]
        top = tuple(synopsys_binary_shape(in_shapes[0], b, attrs["op"]))
        if attrs["top_is_operand"] and top != b:
            raise LayerError(f"{attrs['op']} in place on bottom[1] ({list(b)}) reshapes it to the top's "
                             f"{list(top)} before the fork's Forward reads it: use another top")
        return [top]

    def param_shapes(self, attrs, in_shapes):
        return None if attrs["two_bottoms"] else [attrs["operand_shape"]]

    def forward(self, attrs, params, x, *rest):
        b = rest[0] if attrs["two_bottoms"] else params[0]
        self.infer(attrs, [x.shape] + ([b.shape] if attrs["two_bottoms"] else []))
        return SYNOPSYS_BINARY_OPS[attrs["op"]][0](x, b)

    def onnx(self, ctx, node):
        b = node.inputs[1] if node.attrs["two_bottoms"] else ctx.weight(node, 0)
        ctx.add_node(node.attrs["op"], [node.inputs[0], b], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        sym = SYNOPSYS_BINARY_OPS[node.attrs["op"]][1]
        if node.attrs["two_bottoms"]:
            return f"({emit.inputs[0]} {sym} {emit.inputs[1]})"
        m = emit.module(f"nn.Parameter(torch.zeros({list(node.attrs['operand_shape'])}))")
        emit.param("", 0)
        return f"({emit.inputs[0]} {sym} {m})"


__all__ = ["SYNOPSYS_BINARY_OPS", "SynopsysBinary", "synopsys_binary_shape"]
