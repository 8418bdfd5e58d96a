"""InnerProduct with `index_input_dim`: LRCN's lisa-caffe-public (LRCN_model 8d19f1d and
LRCN_video_deploy c04d2a0, inner_product_layer.cpp / .cu), its word embeddings before Embed existed.

With index_input_dim K > 0 the bottom holds one index per row: its count must equal its first axis
(the fork's CHECK "Indexed inputs must be 1 dimensional", so (M, 1, 1, 1) in its 4-D blobs), each
truncated to int; top row m = the weight's row for index m, plus the bias (bias_term, its default).
No range check there (an index outside [0, K) reads past the weights); caffeq refuses one.  The top
is (M, num_output), as Caffe 1.0 sizes an upgraded V1 InnerProduct.

The weight layout differs between the fork's commits: 8d19f1d keeps it (K, num_output) (Embed's layout,
its CPU path; its GPU kernels still index it as c04d2a0 does), c04d2a0 (num_output, K), a plain
InnerProduct's.  caffeq keeps (K, num_output); a caffemodel blob shaped (num_output, K) (K differing
from num_output) is read as c04d2a0's and transposed, with a note.
"""
import numpy as np

from .misc import Embed
from .registry import LayerError, claim_layers, need_blobs


def _uses_indexes(lp):
    p = lp.inner_product_param
    return "index_input_dim" in p.DESCRIPTOR.fields_by_name and p.index_input_dim > 0


@claim_layers("InnerProduct", _uses_indexes)
class IndexedInnerProduct(Embed):
    what, rows_field = "InnerProduct", "index_input_dim"

    def parse(self, lp):
        need_blobs(lp, "InnerProduct (index_input_dim)", 1, 1)
        p = lp.inner_product_param
        if not p.HasField("num_output") or p.num_output < 1:
            raise LayerError("inner_product_param.num_output is required")
        for name in ("axis", "transpose"):
            if p.HasField(name):
                raise LayerError(f"inner_product_param.{name} does not combine with index_input_dim (lisa-caffe's "
                                 f"indexed InnerProduct reads one index per row)")
        return {"num_output": int(p.num_output), "input_dim": int(p.index_input_dim), "bias_term": bool(p.bias_term)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if not s or int(np.prod(s)) != s[0]:
            raise LayerError(f"InnerProduct with index_input_dim reads one index per row: the bottom must be "
                             f"(M, 1, ...), got {list(s)} (the fork's CHECK: indexed inputs must be 1 dimensional)")
        return [(s[0], attrs["num_output"])]

    def stored_blobs(self, attrs, arrays, notes):
        k, n = attrs["input_dim"], attrs["num_output"]
        if arrays and k != n and arrays[0].size == k * n and tuple(d for d in arrays[0].shape if d != 1) == (n, k):
            notes.append("InnerProduct index_input_dim weights stored (num_output, index_input_dim), as "
                         "lisa-caffe's LRCN_video_deploy (c04d2a0) keeps them: read as (index_input_dim, num_output)")
            return [arrays[0].reshape(n, k).T.copy(), *(a.reshape(-1) for a in arrays[1:])]   # the bias: (N,)
        return arrays

    @staticmethod
    def index_rows(attrs, idx):
        return idx.reshape(-1)

    @staticmethod
    def onnx_index_rows(ctx, node, idx):
        rows = ctx.tmp(node.name + "_idx_rows")
        ctx.add_node("Reshape", [idx, ctx.const(np.array([-1], np.int64))], [rows])
        return rows

    @staticmethod
    def source_index_rows(node, x):
        return f"{x}.reshape(-1)"
