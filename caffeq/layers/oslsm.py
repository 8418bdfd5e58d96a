"""lzzcd001/OSLSM's Caffe (d5312de; Shaban et al., one-shot semantic segmentation): MatMult and ReshapeLike.

- MatMult (src/caffe/layers/MatMultLayer.cpp / .cu; its CPU Forward is NOT_IMPLEMENTED, the GPU one
  runs): A and B are stacks of matrices in their last two axes (one axis, a diagonal, for an input that
  matmult_param.diagonal_input marks), as many on both sides (the leading axes' counts must agree).
  full x full: C = op(A) op(B) per matrix (transpose_a / transpose_b); diagonal A x full B: each row of
  B times A's value (B not transposed); diagonal x diagonal: the elementwise product.  A full A times a
  diagonal B is the fork's CHECK failure.  C's shape: A's leading axes, then D1 (A's rows), then D3
  (B's columns; not for two diagonals).
- ReshapeLike (reshape_like_layer.cpp): Reshape's reshape_param (shape, axis, num_axes) applied to the
  second bottom's shape (its kept axes and the 0 dims copied from it), the data and the count that a
  -1 dim fits coming from the first bottom.
"""
import math

import torch

from .registry import Layer, LayerError, need_blobs, register_layer
from .reshape import _reshape_plan, _reshape_shape, reshape_attrs
from .shape_ops import onnx_reshape

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def matmult(a, b, a_diag: bool, b_diag: bool, a_t: bool, b_t: bool, out_shape: list[int]):
    """OSLSM's MatMult of a and b (see the module doc) -> out_shape."""
    if a_diag and b_diag:
        return (a.reshape(-1) * b.reshape(-1)).reshape(out_shape)
    if a_diag:   # each row of B scaled by A's diagonal
        d = a.shape[-1]
        rows = b.reshape(-1, d, b.shape[-1])
        return (rows * a.reshape(-1, d, 1)).reshape(out_shape)
    x = a.reshape(-1, a.shape[-2], a.shape[-1])
    y = b.reshape(-1, b.shape[-2], b.shape[-1])
    return torch.matmul(x.transpose(1, 2) if a_t else x, y.transpose(1, 2) if b_t else y).reshape(out_shape)


# ---- specs ---------------------------------------------------------------------------------------


@register_layer("MatMult")
class MatMult(Layer):
    def parse(self, lp):
        need_blobs(lp, "MatMult", 2, 1, "A, B")
        p = lp.matmult_param
        diag = list(p.diagonal_input)
        a_diag, b_diag = bool(diag[:1] and diag[0]), bool(diag[1:2] and diag[1])
        if b_diag and not a_diag:
            raise LayerError("MatMult: a full A times a diagonal B is not supported (the fork's CHECK)")
        if a_diag and not b_diag and p.transpose_b:
            raise LayerError("MatMult: B can not be transposed while A is diagonal (the fork's LOG(FATAL))")
        return {"a_diag": a_diag, "b_diag": b_diag, "a_t": bool(p.transpose_a), "b_t": bool(p.transpose_b)}

    def _sizes(self, attrs, in_shapes):
        """(leading axes, D1, D2, D3) as the fork's Reshape computes them, checked."""
        a, b = (tuple(s) for s in in_shapes)
        if len(a) < (1 if attrs["a_diag"] else 2) or len(b) < (1 if attrs["b_diag"] else 2):
            raise LayerError(f"MatMult: A {list(a)} and B {list(b)} lack the matrix axes")
        if attrs["a_diag"]:
            lead, d1 = a[:-1], a[-1]
            d2 = d1
        else:
            lead, (d1, d2) = a[:-2], (a[-1], a[-2]) if attrs["a_t"] else (a[-2], a[-1])
        if attrs["b_diag"]:
            b_lead, rows, d3 = b[:-1], b[-1], d2
        else:
            b_lead, (rows, d3) = b[:-2], (b[-1], b[-2]) if attrs["b_t"] else (b[-2], b[-1])
        if rows != d2:
            raise LayerError(f"MatMult: the matrices' dimensions do not match: A {list(a)}, B {list(b)}")
        if math.prod(lead) != math.prod(b_lead):
            raise LayerError(f"MatMult: A {list(a)} and B {list(b)} hold different numbers of matrices")
        return lead, d1, d2, d3

    def infer(self, attrs, in_shapes):
        lead, d1, _, d3 = self._sizes(attrs, in_shapes)
        attrs["out_shape"] = list(lead) + [d1] + ([] if attrs["a_diag"] and attrs["b_diag"] else [d3])
        return [tuple(attrs["out_shape"])]

    def macs(self, attrs, in_shapes, out_shapes):
        lead, d1, d2, d3 = self._sizes(attrs, in_shapes)
        if attrs["a_diag"]:   # a row scaling, or an elementwise product of two diagonals
            return math.prod(lead) * d1 * (1 if attrs["b_diag"] else d3)
        return math.prod(lead) * d1 * d2 * d3

    def _args(self, attrs):
        return attrs["a_diag"], attrs["b_diag"], attrs["a_t"], attrs["b_t"], attrs["out_shape"]

    def forward(self, attrs, params, a, b):
        return matmult(a, b, *self._args(attrs))

    def onnx(self, ctx, node):
        a, b = node.inputs
        attrs, out = node.attrs, node.outputs[0]
        shape = [int(d) for d in attrs["out_shape"]]
        if attrs["a_diag"]:
            flat = ctx.op("Reshape", [a, ctx.i64([-1])], "diag") if attrs["b_diag"] else \
                ctx.op("Reshape", [a, ctx.i64([-1, ctx.shape(a)[-1], 1])], "diag")
            other = ctx.op("Reshape", [b, ctx.i64([-1] if attrs["b_diag"] else [-1, *ctx.shape(b)[-2:]])], "other")
            onnx_reshape(ctx, ctx.op("Mul", [other, flat], "product"), shape, out, name=node.name)
            return
        mats = []
        for name, t in ((a, "a_t"), (b, "b_t")):
            m = ctx.op("Reshape", [name, ctx.i64([-1, *ctx.shape(name)[-2:]])], "matrix")
            mats.append(ctx.op("Transpose", [m], "transposed", perm=[0, 2, 1]) if attrs[t] else m)
        onnx_reshape(ctx, ctx.op("MatMul", mats, "product"), shape, out, name=node.name)

    def pytorch_source(self, node, emit):
        args = ", ".join(emit.lit(v) for v in self._args(node.attrs))
        return f"{emit.helper(matmult)}({emit.inputs[0]}, {emit.inputs[1]}, {args})"


@register_layer("ReshapeLike")
class ReshapeLike(Layer):
    def parse(self, lp):
        need_blobs(lp, "ReshapeLike", 2, 1, "data, shape reference")
        if lp.top[0] == lp.bottom[0]:
            raise LayerError("ReshapeLike does not allow in-place computation (the fork's CHECK)")
        return reshape_attrs(lp.reshape_param)

    def infer(self, attrs, in_shapes):
        x, ref = in_shapes
        return [_reshape_shape(attrs, ref, math.prod(x))]

    def forward(self, attrs, params, x, ref):
        return x.reshape(_reshape_shape(attrs, tuple(ref.shape), x.numel()))

    def onnx(self, ctx, node):
        top = _reshape_shape(node.attrs, ctx.shape(node.inputs[1]), math.prod(ctx.shape(node.inputs[0])))
        onnx_reshape(ctx, node.inputs[0], [int(d) for d in top], node.outputs[0], name=node.name)

    def pytorch_source(self, node, emit):
        top = list(emit.out_shape(0))
        if node.attrs["inferred_axis"] >= 0:   # the count decides it at run time, as Caffe
            top[_reshape_plan(node.attrs, len(emit.in_shape(1)))[0] + node.attrs["inferred_axis"]] = -1
        return f"{emit.inputs[0]}.reshape({top})"

