"""xw-hu/CF-Caffe's non-local block layers (477b79f, src/caffe/layers/matrix_multiplication*_layer.cpp,
matrix_transposition_layer.cu, reshape_advance_layer.cpp), as its Non-local-FPN segmentation net uses them.

- MatrixMultiplication: X (B, M, K) or (M, K) times Y (B, K, N) or (K, N) -> Z (B, M, N), or (M, N) when
  neither has a batch; an operand without one is shared by every item.  MatrixMultiplicationYt takes Y as
  (B, N, K) and multiplies by its transpose; MatrixMultiplicationXt takes X as (B, K, M).  The fork loops
  over max(Bx, By) items and reads past a batched operand with fewer: two different batches are refused.
- MatrixTransposition: (B, M, N) -> (B, N, M) (its forward exists only on the GPU).
- ReshapeAdvance: Reshape whose shape may say -2: that dimension is bottom 1's dimension of the same
  index in the shape list.

MatMul (mozpp/mscnn-master 0b4ac3f, src/caffe/layers/matmul_layer.cpp, its kitti_car non-local nets; the
LRP forks carry it too): each bottom is (B, rows, the rest of its axes flattened as columns); A' = A^T with
matmul_param.transpose_a [false], B' = B^T with transpose_b [true]; top (B, M, N) = A' B' per item.
"""
import torch

from .registry import Layer, LayerError, count, need_blobs, register_layer
from .reshape import Reshape

#: per type: (X transposed, Y transposed)
_TRANSPOSED = {"MatrixMultiplication": (False, False), "MatrixMultiplicationYt": (False, True),
               "MatrixMultiplicationXt": (True, False)}


def batched_matmul(x, y, x_t: bool, y_t: bool):
    """Z = X' Y' with X' = X^T where x_t, Y' = Y^T where y_t, over the last two axes (a 2-axis operand is
    shared by the other's batch)."""
    return torch.matmul(x.transpose(-1, -2) if x_t else x, y.transpose(-1, -2) if y_t else y)


@register_layer(*_TRANSPOSED)
class MatrixMultiplication(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 2, 1, "X, Y")
        x_t, y_t = _TRANSPOSED[lp.type]
        return {"x_t": x_t, "y_t": y_t, "type": lp.type}

    def infer(self, attrs, in_shapes):
        x, y = (tuple(s) for s in in_shapes)
        if len(x) not in (2, 3) or len(y) not in (2, 3):
            raise LayerError(f"{attrs['type']} multiplies (B, rows, cols) or (rows, cols) blobs, got {list(x)} "
                             f"and {list(y)}")
        rx, cx = x[-2:][::-1] if attrs["x_t"] else x[-2:]
        ry, cy = y[-2:][::-1] if attrs["y_t"] else y[-2:]
        if cx != ry:
            raise LayerError(f"{attrs['type']}: X {list(x)} and Y {list(y)} have incompatible dimensions "
                             f"({rx}x{cx} vs. {ry}x{cy})")
        if len(x) == 3 and len(y) == 3 and x[0] != y[0]:
            raise LayerError(f"{attrs['type']}: X's batch {x[0]} and Y's {y[0]} differ (the fork reads past the "
                             f"smaller one)")
        batch = x[:1] if len(x) == 3 else y[:1] if len(y) == 3 else ()
        return [batch + (rx, cy)]

    def macs(self, attrs, in_shapes, out_shapes):
        out = out_shapes[0]
        k = in_shapes[0][-2] if attrs["x_t"] else in_shapes[0][-1]
        batch = out[0] if len(out) == 3 else 1
        return batch * out[-2] * out[-1] * k

    def forward(self, attrs, params, x, y):
        return batched_matmul(x, y, attrs["x_t"], attrs["y_t"])

    def onnx(self, ctx, node):
        x, y = node.inputs
        if node.attrs["x_t"]:
            x = ctx.add_node("Transpose", [x], ctx.tmp(node.name + "_xt"), name=node.name,
                             perm=list(range(len(ctx.shape(x)) - 2)) + [len(ctx.shape(x)) - 1, len(ctx.shape(x)) - 2])
        if node.attrs["y_t"]:
            y = ctx.add_node("Transpose", [y], ctx.tmp(node.name + "_yt"),
                             perm=list(range(len(ctx.shape(y)) - 2)) + [len(ctx.shape(y)) - 1, len(ctx.shape(y)) - 2])
        ctx.add_node("MatMul", [x, y], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(batched_matmul)}({emit.inputs[0]}, {emit.inputs[1]}, {a['x_t']}, {a['y_t']})"


@register_layer("MatrixTransposition")
class MatrixTransposition(Layer):
    bottoms, tops = 1, 1

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 3:   # Reshape's CHECK
            raise LayerError(f"MatrixTransposition takes a (B, M, N) blob, got {list(s)}")
        return [(s[0], s[2], s[1])]

    def forward(self, attrs, params, x):
        return x.transpose(1, 2).contiguous()

    def onnx(self, ctx, node):
        ctx.add_node("Transpose", [node.inputs[0]], [node.outputs[0]], name=node.name, perm=[0, 2, 1])

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]}.transpose(1, 2)"


@register_layer("ReshapeAdvance")
class ReshapeAdvance(Reshape):
    def parse(self, lp):
        need_blobs(lp, "ReshapeAdvance", 2, 1, "x, shape reference")
        dims = [int(d) for d in lp.reshape_param.shape.dim]
        referred = [i for i, d in enumerate(dims) if d == -2]
        plain = type(lp)()
        plain.CopyFrom(lp)
        del plain.reshape_param.shape.dim[:]
        # a referred dim stands as 1 until infer knows bottom 1 (Reshape's own checks see a plain shape)
        plain.reshape_param.shape.dim.extend([1 if d == -2 else d for d in dims])
        attrs = super().parse(plain)
        if attrs.get("legacy_dims") or attrs.get("pixelshuffler", 1) > 1:
            raise LayerError("ReshapeAdvance reads reshape_param.shape only")
        attrs["referred"] = referred
        return attrs

    def infer(self, attrs, in_shapes):
        ref = tuple(in_shapes[1])
        for i in attrs["referred"]:
            if i >= len(ref):
                raise LayerError(f"reshape_param.shape.dim[{i}] is -2, but bottom 1 {list(ref)} has no axis {i}")
            attrs["dims"][i] = int(ref[i])
        return super().infer(attrs, in_shapes[:1])

    def forward(self, attrs, params, x, ref):
        return super().forward(attrs, params, x)


def flat_matmul(a, b, a_t: bool, b_t: bool):
    """MatMul: a and b as (batch, rows, columns), the columns every axis after the second."""
    a = a.reshape(a.shape[0], a.shape[1], -1)
    b = b.reshape(b.shape[0], b.shape[1], -1)
    return batched_matmul(a, b, a_t, b_t)


@register_layer("MatMul")
class MatMul(Layer):
    def parse(self, lp):
        need_blobs(lp, "MatMul", 2, 1, "A, B")
        p = lp.matmul_param
        return {"a_t": bool(p.transpose_a), "b_t": bool(p.transpose_b)}

    def _matrices(self, attrs, in_shapes):
        a, b = (tuple(s) for s in in_shapes)
        if len(a) < 3 or len(b) < 3:   # its Reshape's CHECKs
            raise LayerError(f"MatMul takes bottoms of at least 3 axes (batch, rows, columns...), got {list(a)} "
                             f"and {list(b)}")
        if a[0] != b[0]:
            raise LayerError(f"MatMul: the bottoms' batches differ, {a[0]} and {b[0]}")
        (ar, ac), (br, bc) = (a[1], count(a, 2)), (b[1], count(b, 2))
        m, k = (ac, ar) if attrs["a_t"] else (ar, ac)
        k2, n = (bc, br) if attrs["b_t"] else (br, bc)
        if k != k2:
            raise LayerError(f"MatMul: A {list(a)} as {m}x{k} and B {list(b)} as {k2}x{n} (transpose_a "
                             f"{attrs['a_t']}, transpose_b {attrs['b_t']}) do not multiply")
        return a[0], m, k, n

    def infer(self, attrs, in_shapes):
        batch, m, _, n = self._matrices(attrs, in_shapes)
        return [(batch, m, n)]

    def macs(self, attrs, in_shapes, out_shapes):
        batch, m, k, n = self._matrices(attrs, in_shapes)
        return batch * m * k * n

    def forward(self, attrs, params, a, b):
        return flat_matmul(a, b, attrs["a_t"], attrs["b_t"])

    def onnx(self, ctx, node):
        mats = []
        for name, t in zip(node.inputs, ("a_t", "b_t")):
            m = ctx.op("Reshape", [name, ctx.i64([0, 0, -1])], "matrix", name=node.name if not mats else None)
            mats.append(ctx.op("Transpose", [m], "transposed", perm=[0, 2, 1]) if node.attrs[t] else m)
        ctx.add_node("MatMul", mats, [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(batched_matmul)
        return f"{emit.helper(flat_matmul)}({emit.inputs[0]}, {emit.inputs[1]}, {a['a_t']}, {a['b_t']})"
