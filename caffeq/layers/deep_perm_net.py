"""rfsantacruz/deep-perm-net d3dccc3 (DeepPermNet, CVPR 2017): PermMatrix and SinkhornNorm
(caffe-perm/src/caffe/layers/perm_matrix_layer.{cpp,cu}, sinkhorn_norm_layer.{cpp,cu}, their headers in
caffe-perm/include/caffe/layers/, caffe-perm/src/caffe/util/math_functions.cu's caffe_gpu_dgemm; fields from
caffe-perm/src/caffe/proto/caffe.proto).  Both layers have only a GPU forward (Forward_cpu is NOT_IMPLEMENTED).

- SinkhornNorm: one step of Sinkhorn normalization.  The bottom must have two axes (N, num_rows * num_cols)
  (Reshape's checks); each item is read as a row-major num_rows x num_cols matrix M and the top keeps the
  bottom's shape.  Row step (is_row_step, default): y = M + lambda, each row times 1 / (its sum); column step:
  y = M + lambda, each column times 1 / (its sum).  The sums are cuBLAS gemv's against ones, the reciprocal
  caffe_gpu_powx(s, -1), the scaling cublas dgmm.  The column step transposes each item with an index map that
  is a transpose only for a square matrix (Trans_Tensor_kernel reads c * num_cols + r): caffeq refuses a column
  step with num_rows != num_cols, where the fork mixes entries (or reads past the blob).

- PermMatrix: a sampler, not a computation of the net.  Its bottoms are the image batch (N, 3, S, S) and a
  label blob; its tops grid_size^2 patches (N, 3, patch_size, patch_size) and the permutation matrix
  (N, grid_size^4), entry i * grid_size^2 + perm[i] set to 1.  Patch k is cut from grid cell perm[k] (row
  perm[k] / grid_size, column perm[k] % grid_size, cells floor(S / grid_size) wide) at an offset drawn by curand
  in [0, cell - patch_size] on each axis, the generators seeded with time(NULL); with do_shuffle (the default,
  set by none of the repository's nets) perm is drawn at every forward, TEST included (shuffle with Caffe's RNG,
  or a row of perm_subset_file).  So no forward of the layer can be reproduced: caffeq reads it as a data layer
  (`is_data`, its bottoms not read, `bottoms_ignored_at_inference`) whose tops -- the patches, already cut and
  permuted, and the permutation matrix -- are the net's inputs.  The test nets read only the patches; the
  permutation matrix is the train nets' loss target.
"""
import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, four_axes, need_blobs, positive_field, register_layer

# ---- torch function (model.py gets the same code) ------------------------------------------

def sinkhorn_norm_step(x, rows: int, cols: int, lam: float, row_step: bool):
    """DeepPermNet's SinkhornNorm: each item a rows x cols matrix plus lam, each row (row_step) or column
    times the reciprocal of its sum; the top shaped as the bottom."""
    y = x.reshape(x.shape[0], rows, cols) + lam
    sums = y.sum(dim=2 if row_step else 1, keepdim=True)
    return (y * torch.reciprocal(sums)).reshape(x.shape)


@register_layer("SinkhornNorm")
class SinkhornNorm(Layer):
    bottoms = tops = 1

    def parse(self, lp):
        super().parse(lp)
        p = lp.sinkhorn_norm_param
        return {"rows": positive_field(p.num_rows, "sinkhorn_norm_param.num_rows"),
                "cols": positive_field(p.num_cols, "sinkhorn_norm_param.num_cols"),
                "lam": float(getattr(p, "lambda")), "row_step": bool(p.is_row_step)}

    def infer(self, attrs, in_shapes):
        shape = tuple(int(d) for d in in_shapes[0])
        rows, cols = attrs["rows"], attrs["cols"]
        if len(shape) != 2:
            raise LayerError(f"SinkhornNorm needs a 2-axis bottom (batch, linearized matrix), got {list(shape)}")
        if shape[1] != rows * cols:
            raise LayerError(f"SinkhornNorm: the bottom's {shape[1]} values per item are not sinkhorn_norm_param"
                             f".num_rows * num_cols = {rows} * {cols} (the fork's Reshape CHECK fails too)")
        if not attrs["row_step"] and rows != cols:
            raise LayerError(f"SinkhornNorm: the column step (is_row_step: false) needs num_rows == num_cols, got "
                             f"{rows} x {cols} (the fork's transpose is one only for a square matrix)")
        return [shape]

    def macs(self, attrs, in_shapes, out_shapes):
        return 2 * int(np.prod(in_shapes[0]))

    def forward(self, attrs, params, x):
        return sinkhorn_norm_step(x, attrs["rows"], attrs["cols"], attrs["lam"], attrs["row_step"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return (f"{emit.helper(sinkhorn_norm_step)}({emit.inputs[0]}, {a['rows']}, {a['cols']}, "
                f"{emit.lit(a['lam'])}, {a['row_step']})")

    def onnx(self, ctx, node):
        a = node.attrs
        rows, cols = a["rows"], a["cols"]
        grid = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, rows, cols])], "matrix")
        y = ctx.op("Add", [grid, ctx.const(np.array(a["lam"], np.float32))], "plus_lambda")
        sums = onnx_reduce(ctx, "ReduceSum", y, [2 if a["row_step"] else 1], True)
        scaled = ctx.op("Mul", [y, ctx.op("Reciprocal", [sums], "inv")], "scaled")
        ctx.add_node("Reshape", [scaled, ctx.i64([-1, rows * cols])], [node.outputs[0]])


@register_layer("PermMatrix")
class PermMatrix(Layer):
    """The patch sampler (see the module docstring): a data layer whose tops are the net's inputs."""
    is_data = True
    bottoms_ignored_at_inference = True
    reading_note = ("PermMatrix cuts its patches at random offsets (curand seeded with time(NULL)) and, with "
                    "do_shuffle, permutes them at random at every forward, TEST included: its tops (the permuted "
                    "patches and the permutation matrix) are the net's inputs (N: 1 unless --batch or "
                    "--input-shape sets it)")

    def parse(self, lp):
        p = lp.perm_matrix_param
        grid = positive_field(p.grid_size, "perm_matrix_param.grid_size")
        need_blobs(lp, "PermMatrix", (0, 2), grid * grid + 1, "data, labels")
        patch = positive_field(p.patch_size, "perm_matrix_param.patch_size")
        if p.perm_subset_size > 0 and not p.perm_subset_file:
            raise LayerError("PermMatrix: perm_matrix_param.perm_subset_size is set without a perm_subset_file")
        return {"name": lp.name, "grid": grid, "patch": patch, "tops": list(lp.top),
                "do_shuffle": bool(p.do_shuffle)}

    def _shapes(self, attrs, n):
        g, p = attrs["grid"], attrs["patch"]
        return [(n, 3, p, p)] * (g * g) + [(n, g ** 4)]

    def infer(self, attrs, in_shapes):
        if not in_shapes:
            return self._shapes(attrs, 1)
        n, c, h, w = four_axes(in_shapes[0], "PermMatrix", "data bottom")
        if c != 3:
            raise LayerError(f"PermMatrix needs a 3-channel (BGR) image, got {c} channels")
        if h != w:
            raise LayerError(f"PermMatrix needs a square image, got {h} x {w}")
        if h < attrs["grid"] * attrs["patch"]:
            raise LayerError(f"PermMatrix: the image side {h} is below perm_matrix_param.grid_size * patch_size "
                             f"= {attrs['grid'] * attrs['patch']}")
        if not in_shapes[1] or int(in_shapes[1][0]) != n:
            raise LayerError(f"PermMatrix: the labels bottom {list(in_shapes[1])} has not the data's batch {n}")
        return self._shapes(attrs, n)

    def top_shapes(self, attrs, given):
        if not given:
            return None
        n = int(next(iter(given.values()))[0])
        shapes = self._shapes(attrs, n)
        for i, s in given.items():
            if tuple(int(d) for d in s) != shapes[i]:
                raise LayerError(f"PermMatrix: top '{attrs['tops'][i]}' is {list(shapes[i])} (batch {n}), "
                                 f"not {list(s)}")
        return shapes
