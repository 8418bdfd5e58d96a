"""The AttentionMask layer family: chwilms/AttentionMask 2e31e2a, harm-matthias-harms/AttentionBox 435b1a2
(AttentionMask's layers, the same files) and chwilms/superpixelRefinement 37a9481 (those layers plus its
superpixel ones).  Files: caffe/src/caffe/layers/argmax_layer_all.cpp, argmax_layer_2.cpp, check_att_layer.cpp
(superpixelRefinement: also .cu), convertIndices.cpp, flagsToIndices_layer.cpp, splitIndices.cpp,
sliding_window_index_layer.cu, sliding_window_index_seg_layer.cu, top_k_old_layer.cu, cut_layer.cu,
scale_flags_layer.cu, spx_pooling_layer.cu, att_spx_pooling_layer.cu (headers in caffe/include/caffe/layers/);
the fields in caffe/src/caffe/proto/caffe.proto.  Where a layer's CPU forward is NOT_IMPLEMENTED or empty
(SlidingWindowIndex, TopKOld), the .cu forward is the one these follow.

Several tops are as long as the bottoms' values say (data_dependent_shape).  Their static shapes are
what the fork's Reshape sets when the net is set up, over blobs that hold zeros then (ArgMaxAll: 1000
indexes, ArgMaxMy: 0, FlagsToIndices: 0, SlidingWindowIndex: 1 window);
a run gives the sizes the fork's Reshape sets from the real values before each forward.

- CheckAtt (obj, nonObj; 4 axes, one shape): copies both; where no obj value is above its nonObj value,
  the first values become 0.51 and 0.49 (superpixelRefinement's reading: attention_mask_spx.CheckAttSpx).
- ArgMaxAll (argmax_param; obj, nonObj): k = the number of obj values above nonObj among the first
  shape(3) values of both, at least 1000 (top_k is not read); then BVLC ArgMax's forward with that k
  (along `axis`, or over each item's values, out_max_val as BVLC's).  Equal values: the higher index first
  (std::partial_sort over (value, index) pairs with greater<>).  ArgMaxMy: the same with k the count itself
  (AttentionBox's; superpixelRefinement's copy, which raises k to 5 at least, is attention_mask_spx.ArgMaxMySpx).
- ConvertIndices (indexes (1, 1, 1, K), scores (1, 1, 1, L)): top 0 (1, 1, 1, L) flags, 1 at the
  indexes (truncated to int); top 1 (K, 1, 1, 1) the scores at the indexes.
- FlagsToIndices ((..., L) flags): the positions of the first L values that equal 1, as (M, 1, 1, 1).
- SplitIndices (flags (1, 1, 1, S), then blobs whose shape(3) sum to S): top i the next shape(3) flags.
- SlidingWindowIndex (sliding_window_param; x (1, C, H, W), flags (1, 1, 1, (H + 1)(W + 1))): the
  window_h x window_w window at every flagged position (flag > 0) of the (H + 1) x (W + 1) grid, zero
  outside the map, in position order: (max(1, sum |flags|), C, window_h, window_w); no flag: one zero
  window.  The stride fields are checked and not used.  Flags are 0 or 1 in these nets (the fork indexes
  windows by running sums of the flags themselves).
- TopKOld (items, scores, k = bottom 2's first dimension): scores per row as FastMask's TopK (its value, or
  the largest of 0 and its columns past the first); the min(k, n) best items in their own order, then zero
  rows up to k: (k, ...).  Top 1 (k, 1, 1, 1): those indexes; rows past the n items are 0 (the fork reads
  its index buffer there).  Equal scores: the lower index first (std::sort is an insertion sort up to 16
  items, so exact there; past 16 its order among equal scores is libstdc++'s introsort's).
superpixelRefinement's own layers (Cut, ScaleFlags, SpxPooling, AttSpxPooling, SlidingWindowIndexSeg, its
CheckAtt) are in attention_mask_spx.py.
NormalizedSigmoidCrossEntropyLoss is a loss: dropped at inference (caffeq/training_layers.py).
No blobs; TRAIN and TEST compute the same.
"""
import math

import numpy as np
import torch

from .fastmask import read_sliding_window
from .registry import (
    Layer,
    LayerError,
    canonical_axis,
    need_blobs,
    register_layer,
    torch_sources,
)

# ---- torch (copied into model.py) ------------------------------------------------

def am_check_att(obj, non_obj, always: bool):
    """CheckAtt's two tops: copies of obj and nonObj whose first values become (1, 0) always, or (0.51, 0.49)
    where no obj value is above its nonObj value."""
    a = obj.reshape(-1).clone()
    b = non_obj.reshape(-1).clone()
    if always:
        a[0] = 1.0
        b[0] = 0.0
    elif not bool((obj > non_obj).any()):
        a[0] = 0.51
        b[0] = 0.49
    return a.reshape(obj.shape), b.reshape(non_obj.shape)


def am_count_above(obj, non_obj):
    """The number of obj values above nonObj among the first shape(3) values of both."""
    n = non_obj.shape[3]
    return int((obj.reshape(-1)[:n] > non_obj.reshape(-1)[:n]).sum())


def am_argmax(x, k: int, axis: int, out_max_val: bool):
    """BVLC ArgMax's forward for k; equal values rank the higher index first.  axis < 0: over each item."""
    if axis >= 0:
        dim = x.shape[axis]
        flipped = x.flip(axis)
        values, at = torch.sort(flipped, dim=axis, descending=True, stable=True)
        values = values.narrow(axis, 0, k)
        index = (dim - 1 - at.narrow(axis, 0, k)).to(x.dtype)
        return values if out_max_val else index
    rows = x.reshape(x.shape[0], -1)
    dim = rows.shape[1]
    values, at = torch.sort(rows.flip(1), dim=1, descending=True, stable=True)
    index = (dim - 1 - at[:, :k]).to(x.dtype)
    shape = [x.shape[0], 1, k] + [1] * (max(x.dim(), 3) - 3)
    if out_max_val:
        shape[1] = 2
        return torch.stack([index, values[:, :k]], 1).reshape(shape)
    return index.reshape(shape)


def am_convert_indices(indexes, scores):
    """ConvertIndices: (1, 1, 1, L) flags set at the indexes, and (K, 1, 1, 1) the scores there."""
    at = indexes.reshape(-1).to(torch.int64)
    flat = scores.reshape(-1)
    flags = torch.zeros_like(flat)
    flags[at] = 1.0
    return flags.reshape(1, 1, 1, -1), flat[at].reshape(-1, 1, 1, 1)


def am_flags_to_indices(flags):
    """The positions of the first shape(3) flags that equal 1, as (M, 1, 1, 1)."""
    first = flags.reshape(-1)[:flags.shape[3]]
    return torch.nonzero(first == 1).reshape(-1, 1, 1, 1).to(flags.dtype)


def am_windows_at(x, flags, wh: int, ww: int, outside: float):
    """The wh x ww windows of x (1, C, H, W) at the flagged (> 0) positions of the (H + 1) x (W + 1) grid,
    `outside` past the map; one window of zeros where none is flagged."""
    _, c, h, w = x.shape
    at = torch.nonzero(flags.reshape(-1) > 0).reshape(-1)
    if at.numel() == 0:
        return x.new_zeros((1, c, wh, ww))
    padded = torch.nn.functional.pad(x[0], [ww // 2, ww // 2, wh // 2, wh // 2], value=outside)
    rows = (at // (w + 1)).reshape(-1, 1, 1) + torch.arange(wh, device=x.device).reshape(1, wh, 1)
    cols = (at % (w + 1)).reshape(-1, 1, 1) + torch.arange(ww, device=x.device).reshape(1, 1, ww)
    return padded[:, rows, cols].permute(1, 0, 2, 3)


def am_top_k_old(items, scores, k: int):
    """TopKOld's tops: (k, ...) the min(k, n) best items in their own order then zeros, and (k, 1, 1, 1) their
    indexes (0 past the n items)."""
    n = items.shape[0]
    rows = scores.reshape(scores.shape[0], -1)
    if rows.shape[1] == 1:
        score = rows[:, 0]
    else:
        score = torch.clamp_min(rows[:, 1:].amax(1), 0)
    order = torch.sort(score[:n], descending=True, stable=True).indices
    kept = min(k, n)
    head = torch.sort(order[:kept]).values
    picked = items.new_zeros((k,) + tuple(items.shape[1:]))
    picked[:kept] = items.index_select(0, head)
    ids = items.new_zeros((k,))
    ids[:min(k, n)] = torch.cat([head, order[kept:]])[:k].to(items.dtype)
    return picked, ids.reshape(k, 1, 1, 1)


TORCH_ATTENTION_MASK = torch_sources(am_check_att, am_count_above, am_argmax, am_convert_indices,
                                     am_flags_to_indices, am_windows_at, am_top_k_old)


def _axes(shape, n, what, role="bottom"):
    if len(shape) < n:
        raise LayerError(f"{what} reads shape({n - 1}) of its {role}, which has {len(shape)} axes {list(shape)}")
    return tuple(int(d) for d in shape)


def _flat_row(shape, what, role):
    """A (1, 1, 1, L) blob's L, as the fork's CHECK_EQs on shape(0..2) want it."""
    shape = _axes(shape, 4, what, role)
    if shape[:3] != (1, 1, 1):
        raise LayerError(f"{what} needs its {role} shaped (1, 1, 1, L) (the fork checks shape(0..2) == 1), "
                         f"got {list(shape)}")
    return shape[3]


# ---- CheckAtt --------------------------------------------------------------------

@register_layer("CheckAtt")
class CheckAtt(Layer):
    always = False

    def parse(self, lp):
        need_blobs(lp, self.types[0], 2, 2, roles="obj, nonObj")
        return {}

    def infer(self, attrs, in_shapes):
        a = _axes(in_shapes[0], 4, "CheckAtt", "first bottom")
        b = _axes(in_shapes[1], 4, "CheckAtt", "second bottom")
        if a[:4] != b[:4]:
            raise LayerError(f"CheckAtt needs bottoms of one shape (the fork checks shape(0..3)), got {list(a)} "
                             f"and {list(b)}")
        return [a[:4], a[:4]]

    def forward(self, attrs, params, obj, non_obj):
        return am_check_att(obj.reshape(obj.shape[:4]), non_obj.reshape(obj.shape[:4]), self.always)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ATTENTION_MASK)
        out = emit.tmp("checked")
        a, b = emit.inputs
        emit.stmt(f"{out} = am_check_att({a}.reshape({a}.shape[:4]), {b}.reshape({a}.shape[:4]), {self.always})")
        return [f"{out}[0]", f"{out}[1]"]

    def onnx(self, ctx, node):
        obj, non_obj = node.inputs
        shape = ctx.shape(node.outputs[0])
        total = math.prod(shape)
        a = ctx.op("Reshape", [obj, ctx.i64([-1])], "obj")
        b = ctx.op("Reshape", [non_obj, ctx.i64([-1])], "non_obj")
        first = np.zeros(total, bool)
        first[0] = True
        at_first = ctx.const(first)
        if self.always:
            pick = at_first
        else:
            above = ctx.op("Cast", [ctx.op("Greater", [a, b], "above")], "above_f", to=1)
            none = ctx.op("Equal", [ctx.op("ReduceMax", [above], "any", keepdims=0), ctx.f32(0.0)], "none")
            pick = ctx.op("And", [at_first, none], "pick")
        fa, fb = (1.0, 0.0) if self.always else (0.51, 0.49)
        ta = ctx.op("Where", [pick, ctx.f32(fa), a], "ta")
        tb = ctx.op("Where", [pick, ctx.f32(fb), b], "tb")
        ctx.add_node("Reshape", [ta, ctx.i64(list(shape))], [node.outputs[0]], name=node.name)
        ctx.add_node("Reshape", [tb, ctx.i64(list(shape))], [node.outputs[1]], name=node.name + "_nonobj")


# ---- ArgMaxAll / ArgMaxMy --------------------------------------------------------

class _CountedArgMax(Layer):
    """ArgMax whose k is counted from the values of two bottoms (see the module docstring)."""

    data_dependent_shape = True
    floor = 0

    def parse(self, lp):
        need_blobs(lp, self.types[0], 2, 1, roles="obj, nonObj")
        p = lp.argmax_param
        if p.top_k < 1:
            raise LayerError(f"argmax_param.top_k must be >= 1, got {p.top_k} (the fork checks it, then "
                             f"counts k itself)")
        return {"axis": int(p.axis) if p.HasField("axis") else None, "out_max_val": bool(p.out_max_val),
                "top_k": int(p.top_k), "name": lp.name}

    def _k(self, count):
        return max(count, self.floor)

    def _dim(self, attrs, shape):
        if attrs["axis"] is None:
            return math.prod(shape[1:])
        return shape[canonical_axis(attrs["axis"], len(shape), "argmax_param.axis")]

    def infer(self, attrs, in_shapes):
        x = tuple(int(d) for d in in_shapes[0])
        what = self.types[0]
        _axes(in_shapes[1], 4, what, "second bottom")
        if math.prod(x) < in_shapes[1][3]:
            raise LayerError(f"{what} compares the first {in_shapes[1][3]} values (the second bottom's shape(3)) "
                             f"of both bottoms; the first holds {math.prod(x)}")
        if attrs["axis"] is not None:
            axis = canonical_axis(attrs["axis"], len(x), "argmax_param.axis")
            attrs["axis_index"] = axis
        elif attrs["top_k"] > math.prod(x[1:]):
            raise LayerError(f"argmax_param.top_k {attrs['top_k']} is more than the {math.prod(x[1:])} values per "
                             f"item (the fork checks it)")
        k = self._k(0)     # set up over zeros: nothing above
        if attrs["axis"] is not None:
            shape = list(x)
            shape[attrs["axis_index"]] = k
            return [tuple(shape)]
        shape = [1] * max(len(x), 3)
        shape[0], shape[2] = x[0], k
        if attrs["out_max_val"]:
            shape[1] = 2
        return [tuple(shape)]

    def cannot_run(self, attrs, in_shapes):
        dim = self._dim(attrs, tuple(in_shapes[0]))
        if self.floor and dim < self.floor:
            return (f"it sorts out the {self.floor} best of {dim} values (k is at least {self.floor}), reading past "
                    f"them; the net needs a larger input")
        return None

    def _axis(self, attrs):
        return attrs["axis_index"] if attrs["axis"] is not None else -1

    def forward(self, attrs, params, x, non_obj):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)], LayerError)
        k = self._k(am_count_above(x, non_obj))
        dim = self._dim(attrs, tuple(x.shape))
        if k > dim:
            raise LayerError(f"{self.types[0]} '{attrs['name']}': {k} values of the first bottom are above the "
                             f"second's, more than the {dim} it sorts (the fork's partial_sort reads past them)")
        return am_argmax(x, k, self._axis(attrs), attrs["out_max_val"])

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ATTENTION_MASK)
        x, b = emit.inputs
        k = f"am_count_above({x}, {b})" if not self.floor else f"max({self.floor}, am_count_above({x}, {b}))"
        return f"am_argmax({x}, {k}, {self._axis(node.attrs)}, {node.attrs['out_max_val']})"

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(node.inputs[0])])
        x, non_obj = node.inputs
        attrs = node.attrs
        xs = ctx.shape(x)
        n = ctx.shape(non_obj)[3]
        lead = ctx.i64([0])
        fa = ctx.op("Slice", [ctx.op("Reshape", [x, ctx.i64([-1])], "xf"), lead, ctx.i64([n])], "xa")
        fb = ctx.op("Slice", [ctx.op("Reshape", [non_obj, ctx.i64([-1])], "bf"), lead, ctx.i64([n])], "xb")
        above = ctx.op("Cast", [ctx.op("Greater", [fa, fb], "gt")], "gt_i", to=7)
        k = ctx.op("ReduceSum", [above, ctx.i64([0])], "count", keepdims=1)
        if self.floor:
            k = ctx.op("Max", [k, ctx.i64([self.floor])], "k")
        if attrs["axis"] is not None:
            axis = attrs["axis_index"]
            data, sort_axis = x, axis
        else:
            data = ctx.op("Reshape", [x, ctx.i64([xs[0], -1])], "rows")
            sort_axis = 1
        dim = ctx.shape(x)[sort_axis] if attrs["axis"] is not None else math.prod(xs[1:])
        rev = ctx.op("Slice", [data, ctx.i64([-1]), ctx.i64([-(2 ** 62)]), ctx.i64([sort_axis]), ctx.i64([-1])],
                     "reversed")
        values, pos = ctx.add_node("TopK", [rev, k], [ctx.tmp(f"{node.name}_values"), ctx.tmp(f"{node.name}_pos")],
                                   axis=sort_axis, largest=1, sorted=1)
        index = ctx.op("Cast", [ctx.op("Sub", [ctx.i64([dim - 1]), pos], "index_i")], "index", to=1)
        if attrs["axis"] is not None:
            ctx.add_node("Identity", [values if attrs["out_max_val"] else index], [node.outputs[0]], name=node.name)
            return
        ones = [1] * (max(len(xs), 3) - 3)
        if attrs["out_max_val"]:
            both = ctx.op("Concat", [ctx.op("Unsqueeze", [index, ctx.i64([1])], "i1"),
                                     ctx.op("Unsqueeze", [values, ctx.i64([1])], "v1")], "both", axis=1)
            ctx.add_node("Reshape", [both, ctx.i64([xs[0], 2, -1] + ones)], [node.outputs[0]], name=node.name)
        else:
            ctx.add_node("Reshape", [index, ctx.i64([xs[0], 1, -1] + ones)], [node.outputs[0]], name=node.name)


@register_layer("ArgMaxAll")
class ArgMaxAll(_CountedArgMax):
    floor = 1000


@register_layer("ArgMaxMy")
class ArgMaxMy(_CountedArgMax):
    floor = 0

    def infer(self, attrs, in_shapes):
        if attrs["axis"] is not None:
            x = tuple(in_shapes[0])
            axis = canonical_axis(attrs["axis"], len(x), "argmax_param.axis")
            if attrs["top_k"] > x[axis]:
                raise LayerError(f"argmax_param.top_k {attrs['top_k']} is more than the {x[axis]} values along axis "
                                 f"{axis} (the fork checks it)")
        return super().infer(attrs, in_shapes)


# ---- ConvertIndices, FlagsToIndices, SplitIndices ------------------------------------

@register_layer("ConvertIndices")
class ConvertIndices(Layer):
    def parse(self, lp):
        need_blobs(lp, "ConvertIndices", 2, 2, roles="indexes, scores")
        return {}

    def infer(self, attrs, in_shapes):
        k = _flat_row(in_shapes[0], "ConvertIndices", "first bottom (the indexes)")
        n = _flat_row(in_shapes[1], "ConvertIndices", "second bottom (the scores)")
        return [(1, 1, 1, n), (k, 1, 1, 1)]

    def forward(self, attrs, params, indexes, scores):
        return am_convert_indices(indexes, scores)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ATTENTION_MASK)
        out = emit.tmp("converted")
        emit.stmt(f"{out} = am_convert_indices({emit.inputs[0]}, {emit.inputs[1]})")
        return [f"{out}[0]", f"{out}[1]"]

    def onnx(self, ctx, node):
        indexes, scores = node.inputs
        at = ctx.op("Cast", [ctx.op("Reshape", [indexes, ctx.i64([-1])], "idx_f")], "idx", to=7)
        flat = ctx.op("Reshape", [scores, ctx.i64([-1])], "scores")
        zeros = ctx.filled(flat, 0.0, "zeros")
        ones = ctx.filled(at, 1.0, "ones")
        flags = ctx.op("ScatterElements", [zeros, at, ones], "flags", axis=0)
        ctx.add_node("Reshape", [flags, ctx.i64([1, 1, 1, -1])], [node.outputs[0]], name=node.name)
        picked = ctx.op("Gather", [flat, at], "picked", axis=0)
        ctx.add_node("Reshape", [picked, ctx.i64([-1, 1, 1, 1])], [node.outputs[1]], name=node.name + "_scores")


@register_layer("FlagsToIndices")
class FlagsToIndices(Layer):
    data_dependent_shape = True

    def parse(self, lp):
        need_blobs(lp, "FlagsToIndices", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        _axes(in_shapes[0], 4, "FlagsToIndices")
        return [(0, 1, 1, 1)]     # set up over zeros: no flag

    def forward(self, attrs, params, flags):
        return am_flags_to_indices(flags)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ATTENTION_MASK)
        return f"am_flags_to_indices({emit.inputs[0]})"

    def onnx(self, ctx, node):
        n = ctx.shape(node.inputs[0])[3]
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "flat")
        first = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([n])], "first")
        at = ctx.op("NonZero", [ctx.op("Equal", [first, ctx.f32(1.0)], "is_one")], "at")
        cast = ctx.op("Cast", [at], "at_f", to=1)
        ctx.add_node("Reshape", [cast, ctx.i64([-1, 1, 1, 1])], [node.outputs[0]], name=node.name)


@register_layer("SplitIndices")
class SplitIndices(Layer):
    def parse(self, lp):
        need_blobs(lp, "SplitIndices", range(2, 1 << 20), None, roles="flags, then one blob per part")
        if len(lp.top) != len(lp.bottom) - 1:
            raise LayerError(f"SplitIndices gives one top per bottom after the first: {len(lp.bottom) - 1} top(s), "
                             f"got {len(lp.top)}")
        return {}

    def infer(self, attrs, in_shapes):
        _flat_row(in_shapes[1], "SplitIndices", "second bottom")
        parts = [_axes(s, 4, "SplitIndices", f"bottom {i + 1}")[3] for i, s in enumerate(in_shapes[1:])]
        total = _flat_row(in_shapes[0], "SplitIndices", "first bottom (the flags)")
        if total != sum(parts):
            raise LayerError(f"SplitIndices: the flags hold {total} values, the other bottoms' shape(3) sum to "
                             f"{sum(parts)} (the fork checks them equal; superpixelRefinement's copy lets 1 flag "
                             f"pass and reads past it)")
        attrs["parts"] = parts
        return [(1, 1, 1, p) for p in parts]

    def forward(self, attrs, params, flags, *rest):
        parts = torch.split(flags.reshape(-1), attrs["parts"])
        return tuple(p.reshape(1, 1, 1, -1) for p in parts)

    def pytorch_source(self, node, emit):
        parts = node.attrs["parts"]
        out = emit.tmp("parts")
        emit.stmt(f"{out} = torch.split({emit.inputs[0]}.reshape(-1), {parts!r})")
        return [f"{out}[{i}].reshape(1, 1, 1, -1)" for i in range(len(parts))]

    def onnx(self, ctx, node):
        start = 0
        for i, (p, out) in enumerate(zip(node.attrs["parts"], node.outputs)):
            ctx.add_node("Slice", [node.inputs[0], ctx.i64([start]), ctx.i64([start + p]), ctx.i64([3])], [out],
                         name=f"{node.name}_{i}")
            start += p


# ---- SlidingWindowIndex(Seg), TopKOld ----------------------------------------------

@register_layer("SlidingWindowIndex")
class SlidingWindowIndex(Layer):
    data_dependent_shape = True
    outside = 0.0

    def parse(self, lp):
        what = self.types[0]
        need_blobs(lp, what, 2, 1, roles="map, flags")
        return read_sliding_window(lp)

    def infer(self, attrs, in_shapes):
        what = self.types[0]
        x = _axes(in_shapes[0], 4, what, "first bottom")
        if x[0] != 1:
            raise LayerError(f"{what} takes a batch of 1 (the fork checks shape(0) == 1), got {list(x)}")
        cells = _flat_row(in_shapes[1], what, "second bottom (the flags)")
        if len(x) != 4:
            raise LayerError(f"{what} reads its first bottom as (1, C, H, W), got {list(x)}")
        if cells != (x[2] + 1) * (x[3] + 1):
            raise LayerError(f"{what}: {cells} flags for the {(x[2] + 1) * (x[3] + 1)} = ({x[2]} + 1)({x[3]} + 1) "
                             f"positions of the map (the fork checks them equal)")
        return [(1, x[1], attrs["wh"], attrs["ww"])]     # set up over zeros: one window

    def forward(self, attrs, params, x, flags):
        return am_windows_at(x, flags, attrs["wh"], attrs["ww"], self.outside)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ATTENTION_MASK)
        a = node.attrs
        return f"am_windows_at({emit.inputs[0]}, {emit.inputs[1]}, {a['wh']}, {a['ww']}, {self.outside!r})"

    @staticmethod
    def _first_dim(ctx, x, hint):
        """x's dim 0 as a 1-element int64 tensor (Shape's start and end need opset 15)."""
        return ctx.op("Slice", [ctx.op("Shape", [x], f"{hint}_shape"), ctx.i64([0]), ctx.i64([1])], hint)

    def onnx(self, ctx, node):
        x, flags = node.inputs
        _, c, h, w = ctx.shape(x)
        wh, ww = node.attrs["wh"], node.attrs["ww"]
        pads = ctx.i64([0, 0, wh // 2, ww // 2, 0, 0, wh // 2, ww // 2])
        padded = ctx.op("Pad", [x, pads, ctx.f32(self.outside)], "padded")
        table = ctx.op("Reshape", [padded, ctx.i64([c, -1])], "table")             # (C, (H + wh)(W + ww))
        flat = ctx.op("Reshape", [flags, ctx.i64([-1])], "flags")
        nz = ctx.op("NonZero", [ctx.op("Greater", [flat, ctx.f32(0.0)], "on")], "nz")
        at = ctx.op("Reshape", [nz, ctx.i64([-1, 1])], "at")                         # (K, 1)
        row = ctx.op("Div", [at, ctx.i64([w + 1])], "row")
        col = ctx.op("Mod", [at, ctx.i64([w + 1])], "col")
        i, j = np.meshgrid(np.arange(wh), np.arange(ww), indexing="ij")
        cell = ctx.const((i * (w + ww) + j).reshape(1, -1).astype(np.int64))
        origin = ctx.op("Add", [ctx.op("Mul", [row, ctx.i64([w + ww])], "row_at"), col], "origin")
        index = ctx.op("Add", [origin, cell], "index")                               # (K, wh ww)
        cells = ctx.op("Gather", [table, index], "cells", axis=1)                    # (C, K, wh ww)
        grid = ctx.op("Transpose", [cells], "grid", perm=[1, 0, 2])
        found = ctx.op("Reshape", [grid, ctx.i64([-1, c, wh, ww])], "found")
        blank = ctx.const(np.zeros((1, c, wh, ww), np.float32))
        both = ctx.op("Concat", [found, blank], "padded_rows", axis=0)
        k = ctx.op("Max", [self._first_dim(ctx, at, "k"), ctx.i64([1])], "rows")
        ctx.add_node("Slice", [both, ctx.i64([0]), k, ctx.i64([0])], [node.outputs[0]], name=node.name)


@register_layer("TopKOld")
class TopKOld(Layer):
    def parse(self, lp):
        need_blobs(lp, "TopKOld", 3, (1, 2), roles="items, scores, k (its first dimension)")
        return {"tops": len(lp.top), "name": lp.name}

    def infer(self, attrs, in_shapes):
        items, scores, ks = (tuple(int(d) for d in s) for s in in_shapes)
        if not items or not scores or not ks:
            raise LayerError("TopKOld's bottoms need at least one axis each")
        k = ks[0]
        attrs["k"] = k
        shapes = [(k,) + items[1:]]
        return shapes + [(k, 1, 1, 1)] if attrs["tops"] == 2 else shapes

    def forward(self, attrs, params, items, scores, ks):
        if scores.shape[0] < items.shape[0]:
            raise LayerError(f"TopKOld: the scores have {scores.shape[0]} rows for {items.shape[0]} items (the "
                             f"fork reads past them)")
        picked, ids = am_top_k_old(items, scores, attrs["k"])
        return (picked, ids) if attrs["tops"] == 2 else picked

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ATTENTION_MASK)
        out = emit.tmp("top_k")
        emit.stmt(f"{out} = am_top_k_old({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['k']})")
        return [f"{out}[0]", f"{out}[1]"] if node.attrs["tops"] == 2 else f"{out}[0]"

    def onnx(self, ctx, node):
        items, scores = node.inputs[:2]
        k = node.attrs["k"]
        item_shape = list(ctx.shape(items)[1:])
        n = SlidingWindowIndex._first_dim(ctx, items, "n")
        rows_width = math.prod(ctx.shape(scores)[1:])
        table = ctx.op("Reshape", [scores, ctx.i64([-1, rows_width])], "rows")
        if rows_width == 1:
            score = ctx.op("Reshape", [table, ctx.i64([-1])], "score")
        else:
            rest = ctx.op("Slice", [table, ctx.i64([1]), ctx.i64([2 ** 62]), ctx.i64([1])], "classes")
            best = ctx.op("ReduceMax", [rest], "best", axes=[1], keepdims=0) if ctx.opset < 18 else \
                ctx.op("ReduceMax", [rest, ctx.i64([1])], "best", keepdims=0)
            score = ctx.op("Max", [best, ctx.f32(0.0)], "score")
        score = ctx.op("Slice", [score, ctx.i64([0]), n], "score_n")
        # ONNX's TopK puts the lower index first among equal values
        _, order = ctx.add_node("TopK", [score, n], [ctx.tmp(f"{node.name}_v"), ctx.tmp(f"{node.name}_o")],
                                axis=0, largest=1, sorted=1)
        kept = ctx.op("Min", [n, ctx.i64([k])], "kept")
        head = ctx.op("Slice", [order, ctx.i64([0]), kept], "head")
        head, _ = ctx.add_node("TopK", [head, kept], [ctx.tmp(f"{node.name}_head"), ctx.tmp(f"{node.name}_hp")],
                               axis=0, largest=0, sorted=1)
        picked = ctx.op("Gather", [items, head], "picked", axis=0)
        blank = ctx.const(np.zeros([k] + item_shape, np.float32))
        both = ctx.op("Concat", [picked, blank], "with_zeros", axis=0)
        ctx.add_node("Slice", [both, ctx.i64([0]), ctx.i64([k]), ctx.i64([0])], [node.outputs[0]], name=node.name)
        if node.attrs["tops"] == 2:
            tail = ctx.op("Slice", [order, kept, ctx.i64([2 ** 62])], "tail")
            ids = ctx.op("Cast", [ctx.op("Concat", [head, tail], "ids_i", axis=0)], "ids", to=1)
            ids = ctx.op("Concat", [ids, ctx.const(np.zeros(k, np.float32))], "ids_zeros", axis=0)
            ids = ctx.op("Slice", [ids, ctx.i64([0]), ctx.i64([k])], "ids_k")
            ctx.add_node("Reshape", [ids, ctx.i64([k, 1, 1, 1])], [node.outputs[1]], name=node.name + "_ids")
