"""VisionLearningGroup/Ask_Attend_and_Answer (SMem-VQA, ECCV 2016; `45b1d36`): MatrixProd and WordSum,
the spatial memory network's matrix products (caffe/src/caffe/layers/matrix_prod_layer.cpp / .cu and
word_sum_layer.cpp / .cu, WordSumParameter in caffe/src/caffe/proto/caffe.proto; the CPU and GPU
forwards are the same gemms).

- MatrixProd (two bottoms, no parameters): A (L, K, M) and B (L, M, N) give A[l] B[l], top (L, K, N): A's
  shape with axis 2 set to N.  No bottom is transposed.  When A's first axis is 1, A is (1, L, M) and each
  of its rows goes through its own matrix: top[0, l] = A[0, l] B[l], top (1, L, N) (the fork's
  "1*L*M * L*M*N" case).  Checks as the fork: A's axis 2 equals B's axis 1, and the first axes agree
  (A's axis 1 with B's axis 0 in the second case, which therefore also catches A (1, K, M) with B (1, M, N)
  and K > 1: Caffe aborts there, so does caffeq).  The gemms read the bottoms as 3-axis arrays, so axes
  after the third must be 1.
- WordSum (word_sum_param num_output K, bias_term [true]; weight_filler / bias_filler only fill new
  blobs): bottom X (B, M, N) -> top (B, K, N), top[b] = W X[b] + bias, W (K, M), bias (K * N,) read as a
  K x N matrix (one value per top element of a sample, the same for every sample).  Blobs: weight, then
  bias.  Axes after the third must be 1 here too.

Neither layer has a TEST / TRAIN difference.
"""
import math

import torch

from .registry import Layer, LayerError, need_blobs, positive_field, register_layer


def _three_axes(shape, what):
    """(a, b, c) of a bottom the fork's gemms read as three axes (any later axes must be 1)."""
    s = tuple(shape)
    if len(s) < 3 or math.prod(s[3:]) != 1:
        raise LayerError(f"{what} must have 3 axes (later ones of size 1: the fork's gemms read it as 3), "
                         f"got {list(s)}")
    return s[:3]


def matrix_prod(a, b, k: int, top_shape: list[int]):
    """MatrixProd: a read as (L, k, M) times b (L, M, N), one product per l, reshaped to the top's shape."""
    n_mat, m, n = b.shape[0], b.shape[1], b.shape[2]
    out = torch.matmul(a.reshape(n_mat, k, m), b.reshape(n_mat, m, n))
    return out.reshape(top_shape)


def word_sum(x, weight, bias, k: int, top_shape: list[int]):
    """WordSum: weight (K, M) times each sample's (M, N) matrix, plus the bias read as (K, N)."""
    out = torch.matmul(weight, x.reshape(x.shape[0], x.shape[1], x.shape[2]))
    if bias is not None:
        out = out + bias.reshape(k, -1)
    return out.reshape(top_shape)


@register_layer("MatrixProd")
class MatrixProd(Layer):
    bottoms, tops = 2, 1
    bottom_roles = "A (L, K, M), B (L, M, N)"

    def infer(self, attrs, in_shapes):
        a = _three_axes(in_shapes[0], "MatrixProd's first bottom")
        b = _three_axes(in_shapes[1], "MatrixProd's second bottom")
        if a[2] != b[1]:
            raise LayerError(f"MatrixProd multiplies (K, M) by (M, N) matrices: the first bottom's axis 2 "
                             f"must equal the second's axis 1, got {list(in_shapes[0])} and {list(in_shapes[1])}")
        if a[0] == 1:
            if a[1] != b[0]:
                raise LayerError(f"MatrixProd with a first bottom (1, L, M) multiplies each of its L rows by one "
                                 f"of the second bottom's L matrices: its axis 1 must equal the second's axis 0 "
                                 f"(the fork's check; a batch of 1 with K > 1 fails it too), got "
                                 f"{list(in_shapes[0])} and {list(in_shapes[1])}")
            k = 1
        else:
            if a[0] != b[0]:
                raise LayerError(f"MatrixProd needs bottoms with the same first axis, got {list(in_shapes[0])} "
                                 f"and {list(in_shapes[1])}")
            k = a[1]
        top = list(in_shapes[0])
        top[2] = b[2]
        attrs["_k"], attrs["_top"] = k, top
        return [tuple(top)]

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(out_shapes[0]) * in_shapes[1][1]

    def forward(self, attrs, params, a, b):
        return matrix_prod(a, b, attrs["_k"], attrs["_top"])

    def onnx(self, ctx, node):
        a, b = node.inputs
        ls, m, n = ctx.shape(b)[:3]
        a3 = ctx.op("Reshape", [a, ctx.i64([ls, node.attrs["_k"], m])], "a3")
        b3 = ctx.op("Reshape", [b, ctx.i64([ls, m, n])], "b3")
        prod = ctx.op("MatMul", [a3, b3], "prod")
        ctx.add_node("Reshape", [prod, ctx.i64(node.attrs["_top"])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return (f"{emit.helper(matrix_prod)}({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['_k']}, "
                f"{node.attrs['_top']!r})")


@register_layer("WordSum")
class WordSum(Layer):
    weight_axes = {0: 0}

    def parse(self, lp):
        need_blobs(lp, "WordSum", 1, 1)
        p = lp.word_sum_param
        return {"num_output": positive_field(p.num_output, "word_sum_param.num_output"),
                "bias_term": bool(p.bias_term)}

    def blob_names_for(self, attrs):
        return ("weight", "bias") if attrs["bias_term"] else ("weight",)

    def infer(self, attrs, in_shapes):
        _three_axes(in_shapes[0], "WordSum's bottom")
        top = list(in_shapes[0])
        top[1] = attrs["num_output"]
        attrs["_top"] = top
        return [tuple(top)]

    def param_shapes(self, attrs, in_shapes):
        _, m, n = _three_axes(in_shapes[0], "WordSum's bottom")
        k = attrs["num_output"]
        return [(k, m), (k * n,)] if attrs["bias_term"] else [(k, m)]

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(out_shapes[0]) * in_shapes[0][1]

    def forward(self, attrs, params, x):
        bias = params[1] if attrs["bias_term"] else None
        return word_sum(x, params[0], bias, attrs["num_output"], attrs["_top"])

    def onnx(self, ctx, node):
        a = node.attrs
        b, m, n = ctx.shape(node.inputs[0])[:3]
        x3 = ctx.op("Reshape", [node.inputs[0], ctx.i64([b, m, n])], "x3")
        out = ctx.op("MatMul", [ctx.weight(node, 0), x3], "wx")
        if a["bias_term"]:
            bias = ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([a["num_output"], n])], "bias_kn")
            out = ctx.op("Add", [out, bias], "wx_b")
        ctx.add_node("Reshape", [out, ctx.i64(a["_top"])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.blob_parameters(self.blob_names_for(a))
        bias = f"{m}['bias']" if a["bias_term"] else "None"
        return (f"{emit.helper(word_sum)}({emit.inputs[0]}, {m}['weight'], {bias}, {a['num_output']}, "
                f"{a['_top']!r})")
