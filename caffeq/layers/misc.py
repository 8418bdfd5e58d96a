"""ArgMax, Reduction, Embed, Parameter, Accuracy and the BVLC loss layers.

Accuracy and the losses exist for training and evaluation: they are marked
`is_training_only` and dropped on export.  A loss top holds the unweighted
loss, as Caffe's top blob does; `attrs["loss_weight"]` (one per top, Caffe's
defaults: 1 for a loss layer's first top) tells a trainer how to weight it.
Labels arrive as floats and are truncated to int, as Caffe's static_cast does.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CaffeqError, DataError
from ..io.caffemodel import read_blobproto
from .norm import legacy_shape, onnx_reduce
from .registry import Layer, LayerError, canonical_axis, count, register_layer

FLT_MIN = 1.1754943508222875e-38
LOG_FLT_MIN = math.log(FLT_MIN)
LOG_THRESHOLD = math.log(1e-20)  # Caffe's kLOG_THRESHOLD in the multinomial/infogain losses

FULL, VALID, BATCH_SIZE, NONE = 0, 1, 2, 3
_NORM_NAMES = {FULL: "FULL", VALID: "VALID", BATCH_SIZE: "BATCH_SIZE", NONE: "NONE"}


def _bottoms(in_shapes, n, type_name):
    ns = (n,) if isinstance(n, int) else tuple(n)
    if len(in_shapes) not in ns:
        want = " or ".join(str(v) for v in ns)
        raise LayerError(f"{type_name} takes {want} bottom(s), got {len(in_shapes)}")


def _checking():
    """Data-dependent checks only run eagerly (not while tracing or compiling)."""
    if torch.jit.is_tracing():
        return False
    compiler = getattr(torch, "compiler", None)
    return not (compiler is not None and compiler.is_compiling())


def _check_labels(labels, valid, num_labels, what):
    if not _checking() or labels.numel() == 0:
        return
    bad = valid & ((labels < 0) | (labels >= num_labels))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise DataError(f"{what}: label {value} is outside [0, {num_labels}) "
                        f"(set ignore_label to skip such labels)")


def _ste(value, clamped):
    """`clamped` in the forward pass, the gradient of `value` backward (Caffe's loss gradients
    ignore the FLT_MIN / kLOG_THRESHOLD clamps of their forward passes)."""
    return value + (clamped - value).detach()


def _loss_weights(lp, n_tops, default_first):
    if len(lp.loss_weight) > n_tops:
        raise LayerError(f"{len(lp.loss_weight)} loss_weight values for {n_tops} top(s)")
    if lp.loss_weight:
        return [float(w) for w in lp.loss_weight] + [0.0] * (n_tops - len(lp.loss_weight))
    return [float(default_first)] + [0.0] * (n_tops - 1) if n_tops else []


def _tops(lp, lo, hi, type_name):
    n = len(lp.top)
    if not lo <= n <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise LayerError(f"{type_name} produces {want} top(s); the prototxt names {n}")
    return n


def _normalization(lp, default, allow_legacy=True):
    """Caffe's loss normalization: `normalization`, else the legacy `normalize` flag, else default."""
    p = lp.loss_param
    if p.HasField("normalization"):
        mode = int(p.normalization)
    elif p.HasField("normalize"):
        if not allow_legacy:
            raise LayerError("loss_param.normalize is deprecated for this layer; use normalization")
        mode = VALID if p.normalize else BATCH_SIZE
    else:
        mode = default
    if mode not in _NORM_NAMES:
        raise LayerError(f"unknown loss_param.normalization {mode}")
    return mode


def _normalizer(mode, outer, inner, valid_count, dtype=torch.float32):
    if mode == FULL:
        n = outer * inner
    elif mode == VALID:
        n = valid_count
    elif mode == BATCH_SIZE:
        n = outer
    else:
        n = 1
    if torch.is_tensor(n):
        return n.to(dtype).clamp_min(1.0)
    return float(max(1, n))  # Caffe: max(1, normalizer) so an all-ignored batch gives 0, not NaN


def _label_attrs(lp, field):
    p = getattr(lp, field)
    return int(p.ignore_label) if p.HasField("ignore_label") else None


def _valid(labels, ignore):
    if ignore is None:
        return torch.ones_like(labels, dtype=torch.bool)
    return labels != ignore


class _TrainingOnly(Layer):
    is_training_only = True


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
    flat = x.reshape(x.shape[0], -1)
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
        if p.top_k < 1:
            raise LayerError(f"argmax_param.top_k must be >= 1, got {p.top_k}")
        return {"out_max_val": bool(p.out_max_val), "top_k": int(p.top_k),
                "axis": int(p.axis) if p.HasField("axis") else None}

    def infer(self, attrs, in_shapes):
        _bottoms(in_shapes, 1, "ArgMax")
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
            n = ctx.shape(x)[axis]
        else:
            flat = ctx.tmp(node.name + "_flat")
            ctx.add_node("Reshape", [x, ctx.const(np.array([0, -1], np.int64))], [flat])
            x, axis = flat, 1
            n = count(ctx.shape(node.inputs[0]), 1)
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
            ctx.add_node("Sub", [ctx.const(np.array(n - 1, np.int64)), fidx], [idx])
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
        emit.helper(inspect.getsource(caffe_topk))
        emit.helper(inspect.getsource(caffe_argmax))
        m = emit.module(f"{emit.helper(inspect.getsource(CaffeArgMax))}({', '.join(args)})")
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
        _bottoms(in_shapes, 1, "Reduction")
        s = tuple(in_shapes[0])
        axis = canonical_axis(attrs["axis"], len(s), "reduction_param.axis")
        attrs["_axis"] = axis
        return [s[:axis]]  # every axis from `axis` on is reduced

    def forward(self, attrs, params, x):
        axis = attrs["_axis"]
        flat = x.reshape(tuple(x.shape[:axis]) + (-1,))
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
            flat = ctx.tmp(node.name + "_flat")
            ctx.add_node("Reshape", [x, ctx.const(np.array([0] * axis + [-1], np.int64))], [flat])
            x = flat
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
                "bias_term": bool(p.bias_term)}

    def infer(self, attrs, in_shapes):
        _bottoms(in_shapes, 1, "Embed")
        return [tuple(in_shapes[0]) + (attrs["num_output"],)]

    def param_shapes(self, attrs, in_shapes):
        shapes = [(attrs["input_dim"], attrs["num_output"])]
        if attrs["bias_term"]:
            shapes.append((attrs["num_output"],))
        return shapes

    def forward(self, attrs, params, x):
        idx = x.long()  # Caffe's static_cast<int>: truncation
        if _checking() and idx.numel():
            k = attrs["input_dim"]
            if bool(((idx < 0) | (idx >= k)).any()):
                bad = idx[(idx < 0) | (idx >= k)][0]
                raise DataError(f"Embed: index {int(bad)} is outside [0, {k}) (input_dim)")
        y = F.embedding(idx, params[0])
        return y + params[1] if attrs["bias_term"] else y

    def onnx(self, ctx, node):
        idx = ctx.tmp(node.name + "_idx")
        ctx.add_node("Cast", [node.inputs[0]], [idx], to=7)  # INT64, truncating like Caffe
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
        y = f"{m}({emit.inputs[0]}.long())"  # Caffe truncates the float indexes
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
        _bottoms(in_shapes, 0, "Parameter")
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


# ---- Accuracy ------------------------------------------------------------------------------

@register_layer("Accuracy")
class Accuracy(_TrainingOnly):
    def parse(self, lp):
        p = lp.accuracy_param
        if p.top_k < 1:
            raise LayerError(f"accuracy_param.top_k must be >= 1, got {p.top_k}")
        n = _tops(lp, 1, 2, "Accuracy")
        return {"top_k": int(p.top_k), "axis": int(p.axis), "ignore_label": _label_attrs(lp, "accuracy_param"),
                "tops": n, "loss_weight": _loss_weights(lp, n, 0.0)}

    def infer(self, attrs, in_shapes):
        _bottoms(in_shapes, 2, "Accuracy")
        s, ls = tuple(in_shapes[0]), tuple(in_shapes[1])
        if count(ls) == 0 or attrs["top_k"] > count(s) // count(ls):
            raise LayerError(f"accuracy_param.top_k {attrs['top_k']} exceeds the number of classes "
                             f"({count(s)} predictions for {count(ls)} labels)")
        axis = canonical_axis(attrs["axis"], len(s), "accuracy_param.axis")
        attrs["_axis"] = axis
        if count(s, 0, axis) * count(s, axis + 1) != count(ls):
            raise LayerError(f"the number of labels must match the predictions: predictions {list(s)} "
                             f"with the label axis {axis} need {count(s, 0, axis) * count(s, axis + 1)} "
                             f"labels, got {list(ls)}")
        shapes = [()]
        if attrs["tops"] > 1:
            shapes.append((s[axis],))
        return shapes

    def forward(self, attrs, params, scores, labels):
        axis = attrs["_axis"]
        c = scores.shape[axis]
        outer = math.prod(scores.shape[:axis])
        x = scores.reshape(outer, c, -1)
        lab = labels.reshape(outer, -1).long()
        valid = _valid(lab, attrs["ignore_label"])
        _check_labels(lab, valid, c, "Accuracy")
        safe = torch.where(valid, lab, torch.zeros_like(lab))
        true = x.gather(1, safe.unsqueeze(1))
        # Caffe counts every class scoring >= the true one, the true class included
        better = (x >= true).sum(dim=1) - 1
        correct = (better < attrs["top_k"]) & valid
        n_valid = valid.sum()
        acc = torch.where(n_valid > 0, correct.sum().to(scores.dtype) / n_valid.clamp_min(1).to(scores.dtype),
                          torch.zeros((), dtype=scores.dtype, device=scores.device))
        if attrs["tops"] == 1:
            return acc
        per_label = torch.zeros(c, dtype=scores.dtype, device=scores.device)
        hits = torch.zeros(c, dtype=scores.dtype, device=scores.device)
        per_label.index_add_(0, safe[valid], torch.ones_like(safe[valid], dtype=scores.dtype))
        hits.index_add_(0, safe[correct], torch.ones_like(safe[correct], dtype=scores.dtype))
        per_class = torch.where(per_label > 0, hits / per_label.clamp_min(1), torch.zeros_like(hits))
        return acc, per_class


# ---- Loss layers -------------------------------------------------------------------------

def _loss_common_infer(in_shapes, n, type_name):
    _bottoms(in_shapes, n, type_name)
    s0, s1 = in_shapes[0], in_shapes[1]
    if not s0 or not s1 or s0[0] != s1[0]:
        raise LayerError(f"{type_name}: the data and label should have the same first dimension, "
                         f"got {list(s0)} and {list(s1)}")


def _softmax_loss_infer(attrs, in_shapes, axis_field, type_name):
    s, ls = tuple(in_shapes[0]), tuple(in_shapes[1])
    axis = canonical_axis(attrs["axis"], len(s), axis_field)
    attrs["_axis"] = axis
    if count(s, 0, axis) * count(s, axis + 1) != count(ls):
        raise LayerError(f"{type_name}: the number of labels must match the predictions: predictions "
                         f"{list(s)} along axis {axis} need {count(s, 0, axis) * count(s, axis + 1)} labels, "
                         f"got {list(ls)}")
    shapes = [()]
    if attrs["tops"] > 1:
        shapes.append(s)
    return shapes[:attrs["tops"]]


def _label_log_probs(attrs, scores, labels, what):
    """(log-softmax reshaped (outer, C, inner), labels (outer, inner) long, valid mask)."""
    axis = attrs["_axis"]
    c = scores.shape[axis]
    outer = math.prod(scores.shape[:axis])
    logp = torch.log_softmax(scores, dim=axis).reshape(outer, c, -1)
    lab = labels.reshape(outer, -1).long()
    valid = _valid(lab, attrs["ignore_label"])
    _check_labels(lab, valid, c, what)
    return logp, lab, valid


def _outputs(attrs, loss, scores):
    if attrs["tops"] == 0:
        return ()
    if attrs["tops"] == 1:
        return loss
    return loss, torch.softmax(scores, dim=attrs["_axis"])


@register_layer("SoftmaxWithLoss")
class SoftmaxWithLoss(_TrainingOnly):
    def parse(self, lp):
        n = _tops(lp, 0, 2, "SoftmaxWithLoss")
        return {"axis": int(lp.softmax_param.axis), "ignore_label": _label_attrs(lp, "loss_param"),
                "normalization": _normalization(lp, VALID), "tops": n,
                "loss_weight": _loss_weights(lp, n, 1.0)}

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, 2, "SoftmaxWithLoss")
        return _softmax_loss_infer(attrs, in_shapes, "softmax_param.axis", "SoftmaxWithLoss")

    def forward(self, attrs, params, scores, labels):
        logp, lab, valid = _label_log_probs(attrs, scores, labels, "SoftmaxWithLoss")
        safe = torch.where(valid, lab, torch.zeros_like(lab))
        picked = logp.gather(1, safe.unsqueeze(1)).squeeze(1)
        picked = _ste(picked, picked.clamp_min(LOG_FLT_MIN))  # Caffe: log(max(prob, FLT_MIN))
        total = -torch.where(valid, picked, torch.zeros_like(picked)).sum()
        norm = _normalizer(attrs["normalization"], lab.shape[0], lab.shape[1], valid.sum(), scores.dtype)
        return _outputs(attrs, total / norm, scores)


@register_layer("InfogainLoss")
class InfogainLoss(_TrainingOnly):
    """Softmax, then -sum_l H[label, l] log(max(prob_l, 1e-20)); H from a 3rd bottom or a
    BlobProto file (infogain_loss_param.source, relative to the working directory as in Caffe)."""

    def parse(self, lp):
        p = lp.infogain_loss_param
        n = _tops(lp, 0, 2, "InfogainLoss")
        attrs = {"axis": int(p.axis), "ignore_label": _label_attrs(lp, "loss_param"),
                 "normalization": _normalization(lp, VALID, allow_legacy=False), "tops": n,
                 "loss_weight": _loss_weights(lp, n, 1.0), "H": None}
        if len(lp.bottom) < 3:
            if not p.HasField("source"):
                raise LayerError("infogain_loss_param.source (the H matrix) is required "
                                 "without a third bottom")
            try:  # Caffe opens the path relative to the working directory
                attrs["H"] = np.asarray(read_blobproto(p.source), np.float32).reshape(-1)
            except CaffeqError as e:
                raise LayerError(f"infogain_loss_param.source: {e}") from None
        return attrs

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, (2, 3), "InfogainLoss")
        shapes = _softmax_loss_infer(attrs, in_shapes, "infogain_loss_param.axis", "InfogainLoss")
        c = in_shapes[0][attrs["_axis"]]
        h_count = count(in_shapes[2]) if len(in_shapes) > 2 else attrs["H"].size
        if h_count != c * c:
            raise LayerError(f"InfogainLoss: H must be {c}x{c}, it has {h_count} values")
        return shapes

    def forward(self, attrs, params, scores, labels, h=None):
        logp, lab, valid = _label_log_probs(attrs, scores, labels, "InfogainLoss")
        c = logp.shape[1]
        if h is None:
            h = torch.from_numpy(attrs["H"]).to(device=scores.device, dtype=scores.dtype)
        h = h.reshape(c, c)
        logp = _ste(logp, logp.clamp_min(LOG_THRESHOLD))
        safe = torch.where(valid, lab, torch.zeros_like(lab))
        rows = h[safe]                                   # (outer, inner, C)
        per = (rows * logp.transpose(1, 2)).sum(dim=-1)  # (outer, inner)
        total = -torch.where(valid, per, torch.zeros_like(per)).sum()
        norm = _normalizer(attrs["normalization"], lab.shape[0], lab.shape[1], valid.sum(), scores.dtype)
        return _outputs(attrs, total / norm, scores)


@register_layer("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLoss(_TrainingOnly):
    def parse(self, lp):
        n = _tops(lp, 0, 1, "SigmoidCrossEntropyLoss")
        # unlike SoftmaxWithLoss, the default here is BATCH_SIZE
        mode = _normalization(lp, BATCH_SIZE)
        return {"ignore_label": _label_attrs(lp, "loss_param"), "normalization": mode, "tops": n,
                "loss_weight": _loss_weights(lp, n, 1.0)}

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, 2, "SigmoidCrossEntropyLoss")
        if count(in_shapes[0]) != count(in_shapes[1]):
            raise LayerError(f"SigmoidCrossEntropyLoss inputs must have the same count, got "
                             f"{list(in_shapes[0])} and {list(in_shapes[1])}")
        return [()] * attrs["tops"]

    def forward(self, attrs, params, x, target):
        t = target.reshape(x.shape)
        pos = (x >= 0).to(x.dtype)
        # Caffe's stable form of -[t log s(x) + (1 - t) log(1 - s(x))]
        per = -(x * (t - pos) - torch.log1p(torch.exp(x - 2 * x * pos)))
        valid = _valid(t.long(), attrs["ignore_label"])
        total = torch.where(valid, per, torch.zeros_like(per)).sum()
        n = x.shape[0]
        norm = _normalizer(attrs["normalization"], n, x.numel() // max(n, 1), valid.sum(), x.dtype)
        return total / norm if attrs["tops"] else ()


@register_layer("EuclideanLoss")
class EuclideanLoss(_TrainingOnly):
    def parse(self, lp):
        n = _tops(lp, 0, 1, "EuclideanLoss")
        return {"tops": n, "loss_weight": _loss_weights(lp, n, 1.0)}

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, 2, "EuclideanLoss")
        if count(in_shapes[0], 1) != count(in_shapes[1], 1):
            raise LayerError(f"EuclideanLoss inputs must have the same dimension, got "
                             f"{list(in_shapes[0])} and {list(in_shapes[1])}")
        return [()] * attrs["tops"]

    def forward(self, attrs, params, a, b):
        d = a - b.reshape(a.shape)
        loss = (d * d).sum() / a.shape[0] / 2
        return loss if attrs["tops"] else ()


@register_layer("HingeLoss")
class HingeLoss(_TrainingOnly):
    L1, L2 = 1, 2

    def parse(self, lp):
        norm = int(lp.hinge_loss_param.norm)
        if norm not in (self.L1, self.L2):
            raise LayerError(f"unknown hinge_loss_param.norm {norm}")
        n = _tops(lp, 0, 1, "HingeLoss")
        return {"norm": norm, "tops": n, "loss_weight": _loss_weights(lp, n, 1.0)}

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, 2, "HingeLoss")
        if count(in_shapes[1]) != in_shapes[0][0]:
            raise LayerError(f"HingeLoss needs one label per item, got labels {list(in_shapes[1])} "
                             f"for predictions {list(in_shapes[0])}")
        return [()] * attrs["tops"]

    def forward(self, attrs, params, x, labels):
        n = x.shape[0]
        flat = x.reshape(n, -1)
        lab = labels.reshape(n).long()
        _check_labels(lab, torch.ones_like(lab, dtype=torch.bool), flat.shape[1], "HingeLoss")
        sign = torch.ones_like(flat).scatter(1, lab.unsqueeze(1), -1.0)  # the true class flips sign
        margin = torch.clamp_min(1 + flat * sign, 0)
        loss = (margin.sum() if attrs["norm"] == self.L1 else (margin * margin).sum()) / n
        return loss if attrs["tops"] else ()


@register_layer("MultinomialLogisticLoss")
class MultinomialLogisticLoss(_TrainingOnly):
    """-mean log(max(prob[label], 1e-20)) over items; the input holds probabilities."""

    def parse(self, lp):
        n = _tops(lp, 0, 1, "MultinomialLogisticLoss")
        return {"tops": n, "loss_weight": _loss_weights(lp, n, 1.0)}

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, 2, "MultinomialLogisticLoss")
        ls = in_shapes[1]
        if len(ls) > 4 or any(d != 1 for d in legacy_shape(ls)[1:]):
            raise LayerError(f"MultinomialLogisticLoss needs labels shaped (N, 1, 1, 1), got {list(ls)}")
        return [()] * attrs["tops"]

    def forward(self, attrs, params, prob, labels):
        n = prob.shape[0]
        flat = prob.reshape(n, -1)
        lab = labels.reshape(n).long()
        _check_labels(lab, torch.ones_like(lab, dtype=torch.bool), flat.shape[1], "MultinomialLogisticLoss")
        p = flat.gather(1, lab.unsqueeze(1)).squeeze(1)
        logp = torch.log(p.clamp_min(1e-20))
        loss = -logp.sum() / n
        return loss if attrs["tops"] else ()


@register_layer("ContrastiveLoss")
class ContrastiveLoss(_TrainingOnly):
    """Pairs (a, b) with similarity y: similar pairs add d^2, dissimilar max(margin - d, 0)^2
    (legacy_version: max(margin - d^2, 0)); the sum is divided by 2N."""

    def parse(self, lp):
        p = lp.contrastive_loss_param
        n = _tops(lp, 0, 1, "ContrastiveLoss")
        return {"margin": float(p.margin), "legacy": bool(p.legacy_version), "tops": n,
                "loss_weight": _loss_weights(lp, n, 1.0)}

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, 3, "ContrastiveLoss")
        a, b, y = in_shapes
        if any(len(s) > 4 for s in in_shapes):
            raise LayerError("ContrastiveLoss inputs have at most 4 axes")
        la, lb, ly = legacy_shape(a), legacy_shape(b), legacy_shape(y)
        if la[1] != lb[1] or la[2:] != (1, 1) or lb[2:] != (1, 1) or ly[1:] != (1, 1, 1):
            raise LayerError(f"ContrastiveLoss needs features (N, C, 1, 1) twice and similarity "
                             f"(N, 1, 1, 1), got {list(a)}, {list(b)}, {list(y)}")
        return [()] * attrs["tops"]

    def forward(self, attrs, params, a, b, y):
        n = a.shape[0]
        d = (a - b).reshape(n, -1)
        dist_sq = (d * d).sum(dim=1)
        similar = y.reshape(n).long() != 0
        m = attrs["margin"]
        if attrs["legacy"]:
            far = torch.clamp_min(m - dist_sq, 0)
        else:
            # the floor keeps the gradient finite where a pair coincides
            far = torch.clamp_min(m - torch.sqrt(dist_sq.clamp_min(1e-30)), 0) ** 2
        loss = torch.where(similar, dist_sq, far).sum() / n / 2
        return loss if attrs["tops"] else ()


__all__ = ["ArgMax", "Reduction", "Embed", "Parameter", "Accuracy", "SoftmaxWithLoss", "InfogainLoss",
           "SigmoidCrossEntropyLoss", "EuclideanLoss", "HingeLoss", "MultinomialLogisticLoss",
           "ContrastiveLoss", "caffe_topk"]
