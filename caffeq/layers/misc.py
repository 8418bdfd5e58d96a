"""ArgMax, Reduction, Embed and Parameter (Accuracy and the loss layers are in losses.py)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DataError
from .norm import onnx_reduce
from .registry import Layer, LayerError, canonical_axis, count, positive_field, register_layer


def need_bottom_count(in_shapes, n, type_name):
    ns = (n,) if isinstance(n, int) else tuple(n)
    if len(in_shapes) not in ns:
        want = " or ".join(str(v) for v in ns)
        raise LayerError(f"{type_name} takes {want} bottom(s), got {len(in_shapes)}")


def eager_checks():
    """Data-dependent checks only run eagerly (not while tracing or compiling)."""
    if torch.jit.is_tracing():
        return False
    compiler = getattr(torch, "compiler", None)
    return not (compiler is not None and compiler.is_compiling())


# ---- ArgMax ----------------------------------------------------------------------------

def caffe_topk(x, k: int, dim: int):
    """Top k along dim in Caffe's order (std::partial_sort on (value, index) pairs: equal values
    come highest index first); returns (values, indices)."""
    n = x.shape[dim]
    flipped = x.flip(dim)
    if k == 1:
        # argmax returns the first maximum: in the flipped order that is the highest index
        idx = flipped.argmax(dim=dim, keepdim=True)
    else:
        _, idx = torch.sort(flipped, dim=dim, descending=True, stable=True)
        idx = idx.narrow(dim, 0, k)
    values = flipped.gather(dim, idx)
    return values, (n - 1) - idx


def caffe_argmax(x, top_k: int, axis: int | None, out_max_val: bool, tail: list[int]):
    """Caffe's ArgMax: the top_k indices (as floats), or values with out_max_val, along `axis`;
    without an axis, over each item flattened: (N, 1, top_k, ...) indices, then the values
    in channel 1 with out_max_val (`tail` is the shape after N)."""
    if axis is not None:
        values, idx = caffe_topk(x, top_k, axis)
        return values if out_max_val else idx.to(x.dtype)
    flat = x.flatten(1) if x.dim() > 1 else x.unsqueeze(1)   # a 1-axis bottom too; zero rows too
    values, idx = caffe_topk(flat, top_k, 1)
    out = idx.to(x.dtype)
    if out_max_val:
        out = torch.cat([out, values], dim=1)  # indices in channel 0, values in channel 1
    return out.reshape([x.shape[0]] + tail)


class CaffeArgMax(nn.Module):
    """Caffe's ArgMax (see caffe_argmax)."""

    tail: list[int]  # for torch.jit.script, which cannot type an empty list

    def __init__(self, top_k=1, axis=None, out_max_val=False, tail=()):
        super().__init__()
        self.top_k, self.axis, self.out_max_val, self.tail = top_k, axis, out_max_val, list(tail)

    def forward(self, x):
        return caffe_argmax(x, self.top_k, self.axis, self.out_max_val, self.tail)


@register_layer("ArgMax")
class ArgMax(Layer):
    def parse(self, lp):
        p = lp.argmax_param
        positive_field(p.top_k, "argmax_param.top_k")
        return {"out_max_val": bool(p.out_max_val), "top_k": int(p.top_k),
                "axis": int(p.axis) if p.HasField("axis") else None}

    def infer(self, attrs, in_shapes):
        need_bottom_count(in_shapes, 1, "ArgMax")
        s = tuple(in_shapes[0])
        k = attrs["top_k"]
        if attrs["axis"] is not None:
            axis = canonical_axis(attrs["axis"], len(s), "argmax_param.axis")
            attrs["_axis"] = axis
            if k > s[axis]:
                raise LayerError(f"argmax_param.top_k {k} exceeds the {s[axis]} values along axis {axis}")
            return [s[:axis] + (k,) + s[axis + 1:]]
        if len(s) < 1:
            raise LayerError("ArgMax needs an input with at least one axis")
        if k > count(s, 1):
            raise LayerError(f"argmax_param.top_k {k} exceeds the {count(s, 1)} values per item")
        # Caffe: at least 3 axes, (N, 1 or 2, top_k, 1, ...)
        shape = [1] * max(len(s), 3)
        shape[0] = s[0]
        shape[1] = 2 if attrs["out_max_val"] else 1
        shape[2] = k
        attrs["_out_tail"] = tuple(shape[1:])
        return [tuple(shape)]

    def forward(self, attrs, params, x):
        axis = attrs["_axis"] if attrs["axis"] is not None else None
        return caffe_argmax(x, attrs["top_k"], axis, attrs["out_max_val"], list(attrs.get("_out_tail", ())))

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        k = a["top_k"]
        if a["axis"] is not None:
            axis = a["_axis"]
        else:
            x, axis = ctx.merge_axes(x, 1), 1
        # flip, then TopK (equal values keep the lower index first), then map indices back,
        # giving Caffe's highest-index-first order for ties
        flipped = ctx.tmp(node.name + "_flip")
        ctx.add_node("Slice", [x, ctx.const(np.array([-1], np.int64)),
                               ctx.const(np.array([-(2 ** 63)], np.int64)),
                               ctx.const(np.array([axis], np.int64)),
                               ctx.const(np.array([-1], np.int64))], [flipped])
        values, fidx = ctx.tmp(node.name + "_values"), ctx.tmp(node.name + "_fidx")
        ctx.add_node("TopK", [flipped, ctx.const(np.array([k], np.int64))], [values, fidx],
                     name=node.name, axis=axis, largest=1, sorted=1)
        want_idx = a["axis"] is None or not a["out_max_val"]
        pieces = []
        if want_idx:
            idx = ctx.tmp(node.name + "_idx")
            # the axis's size at run time (a Permute may have moved the batch into it)
            size = ctx.op("Gather", [ctx.op("Shape", [x], "shape"), ctx.i64(axis)], "size", axis=0)
            ctx.add_node("Sub", [ctx.op("Sub", [size, ctx.i64(1)], "last"), fidx], [idx])
            fidx_f = ctx.tmp(node.name + "_idxf")
            ctx.add_node("Cast", [idx], [fidx_f], to=1)  # FLOAT
            pieces.append(fidx_f)
        if a["out_max_val"]:
            pieces.append(values)
        if a["axis"] is not None:
            ctx.add_node("Identity", [pieces[0]], [out])
            return
        joined = pieces[0]
        if len(pieces) > 1:
            joined = ctx.tmp(node.name + "_joined")
            ctx.add_node("Concat", pieces, [joined], axis=1)
        ctx.add_node("Reshape", [joined, ctx.const(np.array((0,) + a["_out_tail"], np.int64))], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [f"top_k={a['top_k']}"]
        if a["axis"] is not None:
            args.append(f"axis={a['_axis']}")
        else:
            args.append(f"tail={emit.lit(tuple(a['_out_tail']))}")
        if a["out_max_val"]:
            args.append("out_max_val=True")
        # model.py gets these very functions, so the export stays bit-identical to forward
        emit.helper(caffe_topk)
        emit.helper(caffe_argmax)
        m = emit.module(f"{emit.helper(CaffeArgMax)}({', '.join(args)})")
        return f"{m}({emit.inputs[0]})"


# ---- Reduction ------------------------------------------------------------------------

SUM, ASUM, SUMSQ, MEAN = 1, 2, 3, 4


@register_layer("Reduction")
class Reduction(Layer):
    def parse(self, lp):
        p = lp.reduction_param
        op = int(p.operation)
        if op not in (SUM, ASUM, SUMSQ, MEAN):
            raise LayerError(f"unknown reduction_param.operation {op}")
        return {"op": op, "axis": int(p.axis), "coeff": float(p.coeff)}

    def infer(self, attrs, in_shapes):
        need_bottom_count(in_shapes, 1, "Reduction")
        s = tuple(in_shapes[0])
        axis = canonical_axis(attrs["axis"], len(s), "reduction_param.axis")
        attrs["_axis"] = axis
        return [s[:axis]]  # every axis from `axis` on is reduced

    def forward(self, attrs, params, x):
        axis = attrs["_axis"]
        flat = x.flatten(axis) if x.dim() > axis else x.unsqueeze(-1)   # flatten: zero rows too, no -1
        op = attrs["op"]
        if op == ASUM:
            flat = flat.abs()
        elif op == SUMSQ:
            flat = flat * flat
        y = flat.sum(dim=-1)
        coeff = attrs["coeff"] / flat.shape[-1] if op == MEAN else attrs["coeff"]
        return y * coeff if coeff != 1 else y

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        axis = a["_axis"]
        if len(ctx.shape(x)) != axis + 1:
            x = ctx.merge_axes(x, axis)
        op = {SUM: "ReduceSum", ASUM: "ReduceL1", SUMSQ: "ReduceSumSquare", MEAN: "ReduceMean"}[a["op"]]
        if a["coeff"] == 1:
            onnx_reduce(ctx, op, x, [axis], 0, out=out)
            return
        red = onnx_reduce(ctx, op, x, [axis], 0)
        ctx.add_node("Mul", [red, ctx.const(np.array(a["coeff"], np.float32))], [out], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x, axis = emit.inputs[0], a["_axis"]
        flat = x
        if len(emit.in_shape(0)) != axis + 1:  # every axis from `axis` on is reduced
            flat = emit.tmp(node.name + "_flat")
            emit.stmt(f"{flat} = {x}.flatten({axis})")
        if a["op"] == ASUM:
            y = f"{flat}.abs().sum(dim=-1)"
        elif a["op"] == SUMSQ:
            y = f"({flat} * {flat}).sum(dim=-1)"
        else:
            y = f"{flat}.sum(dim=-1)"
        if a["op"] == MEAN:  # coeff / count in Python floats, as forward
            return f"{y} * ({emit.lit(a['coeff'], exact=True)} / {flat}.shape[-1])"
        return y if a["coeff"] == 1 else f"{y} * {emit.lit(a['coeff'])}"


# ---- Embed -----------------------------------------------------------------------------

def replace_unit_axis_embeds(names, net):
    """ForkReading rewrite: the net's Embed layers read as peteanderson80/bottom-up-attention's Caffe computes
    them (embed_layer.cpp: a last axis of size 1 is replaced by num_output, not kept), all of them, since the
    net was written for that Caffe (its unrolled decoders have one Embed per step); `names` are the ones
    whose shapes showed it.  Returns the note."""
    changed = []
    for lp in net.layer:
        if lp.type == "Embed":
            lp.embed_param.replace_unit_axis = True
            changed.append(lp.name)
    return (f"Embed layers replace their indexes' last axis of size 1 by num_output, as bottom-up-attention's "
            f"Caffe does (BVLC appends an axis): the only reading the net's shapes fit "
            f"({', '.join(repr(n) for n in names)} showed it; all {len(changed)} Embed layer(s) of the net read so)")


@register_layer("Embed")
class Embed(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: 1}  # input_dim x num_output: output channels on axis 1

    def parse(self, lp):
        p = lp.embed_param
        if p.num_output < 1:
            raise LayerError("embed_param.num_output must be positive")
        if p.input_dim < 1:
            raise LayerError("embed_param.input_dim must be positive")
        return {"num_output": int(p.num_output), "input_dim": int(p.input_dim),
                "bias_term": bool(p.bias_term), "replace_unit_axis": bool(p.replace_unit_axis)}

    def infer(self, attrs, in_shapes):
        need_bottom_count(in_shapes, 1, "Embed")
        s = tuple(in_shapes[0])
        if attrs["replace_unit_axis"] and s and s[-1] == 1:   # bottom-up-attention's Reshape
            attrs["squeeze"] = True
            return [s[:-1] + (attrs["num_output"],)]
        attrs["squeeze"] = False
        return [s + (attrs["num_output"],)]

    def param_shapes(self, attrs, in_shapes):
        shapes = [(attrs["input_dim"], attrs["num_output"])]
        if attrs["bias_term"]:
            shapes.append((attrs["num_output"],))
        return shapes

    #: how errors name the layer and its row count (IndexedInnerProduct reuses this spec)
    what, rows_field = "Embed", "input_dim"

    @staticmethod
    def index_rows(attrs, idx):
        """The indexes as looked up (bottom-up-attention's Embed drops a unit last axis first)."""
        return idx.squeeze(-1) if attrs.get("squeeze") else idx

    def forward(self, attrs, params, x):
        idx = self.index_rows(attrs, x.long())  # Caffe's static_cast<int>: truncation
        if eager_checks() and idx.numel():
            k = attrs["input_dim"]
            if bool(((idx < 0) | (idx >= k)).any()):
                bad = idx[(idx < 0) | (idx >= k)][0]
                raise DataError(f"{self.what}: index {int(bad)} is outside [0, {k}) ({self.rows_field})")
        y = F.embedding(idx, params[0])
        return y + params[1] if attrs["bias_term"] else y

    @staticmethod
    def onnx_index_rows(ctx, node, idx):
        """ONNX of index_rows."""
        if not node.attrs.get("squeeze"):
            return idx
        squeezed = ctx.tmp(node.name + "_idx_squeezed")   # the unit last axis goes before the rows come
        ctx.add_node("Squeeze", [idx, ctx.const(np.array([-1], np.int64))], [squeezed])
        return squeezed

    @staticmethod
    def source_index_rows(node, x):
        """model.py's index_rows of the index tensor x (already .long())."""
        return f"{x}.squeeze(-1)" if node.attrs.get("squeeze") else x

    def onnx(self, ctx, node):
        idx = ctx.tmp(node.name + "_idx")
        ctx.add_node("Cast", [node.inputs[0]], [idx], to=7)  # INT64, truncating like Caffe
        idx = self.onnx_index_rows(ctx, node, idx)
        if not node.attrs["bias_term"]:
            ctx.add_node("Gather", [ctx.weight(node, 0), idx], [node.outputs[0]], name=node.name, axis=0)
            return
        rows = ctx.tmp(node.name + "_rows")
        ctx.add_node("Gather", [ctx.weight(node, 0), idx], [rows], name=node.name, axis=0)
        ctx.add_node("Add", [rows, ctx.weight(node, 1)], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.module(f"nn.Embedding({a['input_dim']}, {a['num_output']})")
        emit.param("weight", 0)
        y = f"{m}({self.source_index_rows(node, emit.inputs[0] + '.long()')})"  # Caffe truncates the float indexes
        if not a["bias_term"]:
            return y
        attr = emit.extra_attr("bias")
        b = emit.module(f"nn.Parameter(torch.zeros({a['num_output']}))", attr=attr)
        emit.param("", 1, attr=attr)
        return f"{y} + {b}"


# ---- Parameter ---------------------------------------------------------------------------

@register_layer("Parameter")
class Parameter(Layer):
    """Outputs its one blob, shaped by parameter_param.shape (no bottoms)."""
    blob_names = ("weight",)

    def parse(self, lp):
        shape = tuple(int(d) for d in lp.parameter_param.shape.dim)
        if any(d < 0 for d in shape):
            raise LayerError(f"parameter_param.shape has a negative dimension {list(shape)}")
        if len(lp.top) != 1:
            raise LayerError(f"Parameter produces exactly 1 top; the prototxt names {len(lp.top)}")
        return {"shape": shape}

    def infer(self, attrs, in_shapes):
        need_bottom_count(in_shapes, 0, "Parameter")
        return [attrs["shape"]]

    def param_shapes(self, attrs, in_shapes):
        return [attrs["shape"]]

    def forward(self, attrs, params):
        return params[0]

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [ctx.weight(node, 0)], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        m = emit.module(f"nn.Parameter(torch.zeros({list(node.attrs['shape'])}))")
        emit.param("", 0)
        return m


__all__ = ["ArgMax", "Embed", "Parameter", "Reduction", "caffe_argmax", "caffe_topk", "eager_checks",
           "need_bottom_count"]
