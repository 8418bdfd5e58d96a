"""SegmentPooling of haamoon/caffe (4414740; src/caffe/layers/segment_pooling_layer.cpp/.cu,
src/caffe/util/tracker_math.cpp/.cu tracker_cpu_csr_gemm / tracker_gpu_csr_gemm_cusparse,
SegmentPoolingParameter in src/caffe/proto/caffe.proto: segment_pooling_param 147 there, 130147 here).

Bottoms: features F (... x C x H x W), and per instance n of the leading axes (N of them) a CSR matrix P
of max_nrows rows and H*W columns: values (... x L), column indices (... x L), row pointers
(... x max_nrows + 1), all floats cast to int, and seg_num (N values).  With R_n = int(seg_num_n * cells)
(cells = num_spatial_cells) the top (seg_num's shape + [max_nrows / cells, cells * C]) holds

    top[n, s, k * C + c] = sum_{ptr[r] <= p < ptr[r+1]} values[p] * F[n, c, indices[p]],  r = s * cells + k < R_n

and 0 on the rows r >= R_n (top = P F^T, rows of cells x C reshaped per segment).  The row pointers are
offsets into values (not relative to ptr[0]); a row whose end is not past its start is empty.  caffeq
clamps indices into [0, H*W) and pointers into [0, L], and R_n into [0, max_nrows], where the fork
would read out of range or CHECK-fail.  Sums run over a float64 prefix sum (exact to float32 rounding).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from onnx import TensorProto

from .registry import Layer, LayerError, need_blobs, register_layer


def segment_pooling(feat, values, indices, ptr, seg_num, cells: int, top_shape: list[int]):
    """haamoon/caffe SegmentPooling (see the module docstring): P F^T per instance, reshaped."""
    n = seg_num.numel()
    ch, k = feat.shape[-3], feat.shape[-2] * feat.shape[-1]
    length = values.shape[-1]
    rmax = ptr.shape[-1] - 1
    f = feat.reshape(n, ch, k)
    vals = values.reshape(n, 1, length)
    cols = indices.reshape(n, 1, length).to(torch.int64).clamp(0, k - 1).expand(n, ch, length)
    prod = torch.gather(f, 2, cols) * vals
    sums = torch.cumsum(prod.to(torch.float64), dim=2)
    sums = torch.cat([torch.zeros_like(sums[:, :, :1]), sums], dim=2)
    p = ptr.reshape(n, 1, rmax + 1).to(torch.int64).clamp(0, length)
    lo = p[:, :, :rmax]
    hi = p[:, :, 1:]
    rows = (seg_num.reshape(n, 1, 1) * cells).to(torch.int64).clamp(0, rmax)
    keep = (hi > lo) & (torch.arange(rmax, device=feat.device).reshape(1, 1, rmax) < rows)
    got = torch.gather(sums, 2, hi.expand(n, ch, rmax)) - torch.gather(sums, 2, lo.expand(n, ch, rmax))
    got = torch.where(keep, got, torch.zeros_like(got)).to(feat.dtype)
    return got.transpose(1, 2).reshape(top_shape)


@register_layer("SegmentPooling")
class SegmentPooling(Layer):
    def parse(self, lp):
        need_blobs(lp, "SegmentPooling", 5, 1, roles="features, pooling data, indices, row pointers, seg_num")
        cells = int(lp.segment_pooling_param.num_spatial_cells)
        if cells < 1:
            raise LayerError(f"SegmentPooling: segment_pooling_param.num_spatial_cells must be >= 1, got {cells}")
        return {"cells": cells}

    def infer(self, attrs, in_shapes):
        f, d, i, p, s = (tuple(x) for x in in_shapes)
        if len(f) < 3:
            raise LayerError(f"SegmentPooling: bottom[0] must be ... x C x H x W, got {list(f)}")
        n = math.prod(f[:-3])
        for j, b in ((1, d), (2, i), (3, p)):
            if len(b) < 1 or math.prod(b[:-1]) != n:
                raise LayerError(f"SegmentPooling: bottom[{j}] must have {n} instances before its last axis "
                                 f"(bottom[0]'s leading axes), got {list(b)}")
        if math.prod(s) != n:
            raise LayerError(f"SegmentPooling: bottom[4] (seg_num) must hold {n} values, got {list(s)}")
        if i[-1] != d[-1]:
            raise LayerError(f"SegmentPooling: bottom[2] (indices) needs bottom[1]'s last axis {d[-1]}, got {i[-1]}")
        rmax, cells = p[-1] - 1, attrs["cells"]
        if rmax < 0 or rmax % cells:
            raise LayerError(f"SegmentPooling: bottom[3]'s last axis - 1 ({rmax}) must be a multiple of "
                             f"segment_pooling_param.num_spatial_cells {cells}")
        return [s + (rmax // cells, f[-3] * cells)]

    def macs(self, attrs, in_shapes, out_shapes):
        f, d = in_shapes[0], in_shapes[1]
        return math.prod(d) * f[-3]

    def forward(self, attrs, params, feat, values, indices, ptr, seg_num):
        shape = list(attrs["_top"]) if "_top" in attrs else None
        if shape is None:
            shape = list(seg_num.shape) + [(ptr.shape[-1] - 1) // attrs["cells"], feat.shape[-3] * attrs["cells"]]
        return segment_pooling(feat, values, indices, ptr, seg_num, attrs["cells"], shape)

    def pytorch_source(self, node, emit):
        emit.helper(segment_pooling)
        top = list(self.infer(node.attrs, [emit.in_shape(j) for j in range(5)])[0])
        a = ", ".join(emit.inputs)
        return f"segment_pooling({a}, {node.attrs['cells']}, {top})"

    def onnx(self, ctx, node):
        a = node.attrs
        shapes = [tuple(ctx.shape(x)) for x in node.inputs]
        top = list(self.infer(a, shapes)[0])
        f, d, _, p, _ = shapes
        n = math.prod(f[:-3])
        ch, k, length, rmax = f[-3], f[-2] * f[-1], d[-1], p[-1] - 1

        def op(kind, ins, hint, **kw):
            return ctx.op(kind, ins, hint, **kw)

        feat = op("Reshape", [node.inputs[0], ctx.i64([n, ch, k])], "feat")
        vals = op("Reshape", [node.inputs[1], ctx.i64([n, 1, length])], "vals")
        cols = op("Cast", [op("Reshape", [node.inputs[2], ctx.i64([n, 1, length])], "cols_f")], "cols_i",
                  to=TensorProto.INT64)
        cols = op("Clip", [cols, ctx.const(np.array(0, np.int64)), ctx.const(np.array(k - 1, np.int64))], "cols")
        cols = op("Expand", [cols, ctx.i64([n, ch, length])], "cols_all")
        prod = op("Mul", [op("GatherElements", [feat, cols], "picked", axis=2), vals], "prod")
        sums = op("CumSum", [op("Cast", [prod], "prod64", to=TensorProto.DOUBLE), ctx.i64(2)], "cumsum")
        sums = op("Concat", [ctx.const(np.zeros((n, ch, 1), np.float64)), sums], "sums", axis=2)
        pi = op("Cast", [op("Reshape", [node.inputs[3], ctx.i64([n, 1, rmax + 1])], "ptr_f")], "ptr_i",
                to=TensorProto.INT64)
        pi = op("Clip", [pi, ctx.const(np.array(0, np.int64)), ctx.const(np.array(length, np.int64))], "ptr")
        lo = op("Slice", [pi, ctx.i64([0]), ctx.i64([rmax]), ctx.i64([2])], "lo")
        hi = op("Slice", [pi, ctx.i64([1]), ctx.i64([rmax + 1]), ctx.i64([2])], "hi")
        seg = op("Reshape", [node.inputs[4], ctx.i64([n, 1, 1])], "seg")
        rows = op("Cast", [op("Mul", [seg, ctx.const(np.array(a["cells"], np.float32))], "rows_f")], "rows_i",
                  to=TensorProto.INT64)
        rows = op("Clip", [rows, ctx.const(np.array(0, np.int64)), ctx.const(np.array(rmax, np.int64))], "rows")
        keep = op("And", [op("Greater", [hi, lo], "nonempty"),
                          op("Less", [ctx.const(np.arange(rmax, dtype=np.int64).reshape(1, 1, rmax)), rows], "live")],
                  "keep")
        hi_all = op("Expand", [hi, ctx.i64([n, ch, rmax])], "hi_all")
        lo_all = op("Expand", [lo, ctx.i64([n, ch, rmax])], "lo_all")
        got = op("Sub", [op("GatherElements", [sums, hi_all], "s_hi", axis=2),
                         op("GatherElements", [sums, lo_all], "s_lo", axis=2)], "got64")
        got = op("Where", [keep, got, ctx.const(np.zeros(1, np.float64))], "kept")
        got = op("Cast", [got], "got", to=TensorProto.FLOAT)
        got = op("Transpose", [got], "rows_major", perm=[0, 2, 1])
        ctx.add_node("Reshape", [got, ctx.i64(top)], [node.outputs[0]], name=node.name)
