"""shenyunhang/caffe-wsl's roi score poolings (caffe_wsl.py has the fork's other layers): RoIScorePooling
(78b2f71) and GeneralPooling (77892fa).

- RoIScorePooling (roi_score_pooling_layer.cpp; roi_score_pooling_param pool [MAX], threshold [0], axis [1]):
  bottoms (scores, per-image roi counts).  The scores (at most 4 axes: it reads num() and channels()) are
  pooled along `axis` into one entry per count (the counts' blob size is the image count): the positions
  go to image 0 until as many as its count have passed, then to image 1, ...; an image closes when its
  running count equals its count (a count that is no whole number, or not above 0, never closes it, and every
  later position stays in it).  SUM sums an image's positions; MAX takes their maximum from -FLT_MAX where the image closes,
  -FLT_MAX where it never does; TSUM sums those not below threshold, all of them where it closes with none;
  TAVEMAX averages those not below threshold, or, closing with none, takes the maximum (unclosed: the
  thresholded sum).  TAVEMAX's loop runs its inner index to the outer size instead of the inner one: inner
  positions from there on stay 0, and an outer size above the inner one writes past the top (refused).
  MUL is NOT_IMPLEMENTED in the fork's forward (refused).  The forward's CHECKs (the counts' absolute sum is
  the pooled axis' size, each count > 0, a MAX image found) stop a run as they stop Caffe.
- GeneralPooling (general_pooling_layer.cpp at 77892fa, the last commit before 627f8fe deleted it;
  general_pooling_param, the same fields): one bottom, or (scores, filter) where the filter has the scores'
  num and channels and no more (Reshape's CHECKs).  The top is the scores' shape with `axis` 1 (MUL: (num,
  channels, 1, 1)).  SUM, MAX (from -FLT_MAX) and TAVEMAX (as above, one group) pool along `axis`.  The
  per-class methods ignore `axis`: they read the first num x channels values as (roi, class) and write one
  value per class at the top's start, the rest of the top keeping its fill (-FLT_MAX for FMAX, else 0):
  FMAX the maximum of the rois whose filter is not 0 (all rois where none is), FAVE their mean (all rois'
  where none), FSUM their sum, TSUM the sum of the values not below threshold (all where none), FAVEMAX the
  mean of the filtered values not below threshold, or where there is none the filtered maximum (the maximum
  of all where that is -FLT_MAX).  MUL multiplies scores and filter (a scores blob larger than the filter is
  refused: the fork writes past its top).  FMAX, FAVE, FSUM, FAVEMAX and MUL need the filter (LayerSetUp's
  CHECK).  A top smaller than the class count is refused (the fork writes past it).
Both have only a CPU forward, which the GPU falls back to.  torch, ONNX and model.py.
"""
import math

import numpy as np
import torch
from onnx import TensorProto

from ..errors import ExportError
from .misc import eager_checks
from .norm import onnx_reduce
from .registry import Layer, LayerError, canonical_axis, legacy_nchw, need_blobs, register_layer, torch_sources

FLT_MAX = 3.4028234663852886e38
# the pool methods of GeneralPoolingParameter (RoIScorePoolingParameter keeps the numbers of its five)
FMAX, FAVE, SUM, FSUM, TSUM, FAVEMAX, TAVEMAX, MUL, MAX = 0, 1, 2, 3, 4, 5, 6, 7, 8
_PER_CLASS = (FMAX, FAVE, FSUM, TSUM, FAVEMAX)
_NEEDS_FILTER = (FMAX, FAVE, FSUM, FAVEMAX, MUL)
_NAMES = {FMAX: "FMAX", FAVE: "FAVE", SUM: "SUM", FSUM: "FSUM", TSUM: "TSUM", FAVEMAX: "FAVEMAX",
          TAVEMAX: "TAVEMAX", MUL: "MUL", MAX: "MAX"}


def _size(shape):
    return int(math.prod(int(d) for d in shape))


def _outer_inner(shape, axis):
    return _size(shape[:axis]), _size(shape[axis + 1:])


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def wsl_lowest(x):
    """The forks' -FLT_MAX in x's dtype (fp16's lowest value where it has none)."""
    return max(torch.finfo(x.dtype).min, -3.4028234663852886e38)


def wsl_group_sum(v, member, keep=None):
    """(O, S, K): v (O, J, K) summed over the positions j of each group s (member (S, J) bool), only where keep
    (O, J, K bool) holds."""
    mask = member[None, :, :, None]
    if keep is not None:
        mask = mask & keep[:, None]
    return torch.where(mask, v[:, None], torch.zeros((), dtype=v.dtype, device=v.device)).sum(2)


def wsl_group_max(v, member, keep=None):
    """(O, S, K): the maximum from -FLT_MAX over each group's positions where keep holds (wsl_group_sum's
    arguments); -FLT_MAX for none.  The fork's strict `>` from -FLT_MAX never takes NaN, -inf or -FLT_MAX."""
    low = wsl_lowest(v)
    mask = member[None, :, :, None] & (v > low)[:, None]
    if keep is not None:
        mask = mask & keep[:, None]
    return torch.where(mask, v[:, None], torch.full((), low, dtype=v.dtype, device=v.device)).amax(2)


def wsl_group_pool(v, member, closed, mode: int, threshold: float, width: int):
    """RoIScorePooling's SUM (2), MAX (8), TSUM (4) and TAVEMAX (6) of v (O, J, K) over the groups of positions
    (member (S, J) bool), the groups that close (closed (S,) bool) finishing as the fork's loop does; TAVEMAX
    fills only the inner positions below `width` (0 beyond) -> (O, S, K)."""
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    shut = closed[None, :, None]
    if mode == 2:
        return wsl_group_sum(v, member)
    if mode == 8:
        return torch.where(shut, wsl_group_max(v, member), torch.full((), wsl_lowest(v), dtype=v.dtype,
                                                                      device=v.device))
    keep = ~(v < threshold)
    kept_sum = wsl_group_sum(v, member, keep)
    kept = wsl_group_sum(keep.to(v.dtype), member)
    if mode == 4:
        return torch.where(shut & (kept == 0), wsl_group_sum(v, member), kept_sum)
    done = torch.where(kept == 0, wsl_group_max(v, member), kept_sum / kept)
    out = torch.where(shut, done, kept_sum)
    inner = torch.arange(v.shape[2], device=v.device)[None, None, :]
    return torch.where(inner < width, out, zero)


def wsl_image_groups(counts, channels: int):
    """RoIScorePooling's images over `channels` positions from the roi counts: (member (S, J) bool, closed (S,)
    bool).  A position goes to the first image not closed before it; an image closes once its count of positions
    has passed, which a count that is no whole number, or not above 0, never reaches (nor the images after it)."""
    c = counts.reshape(-1).float()
    valid = torch.cumsum(((c != torch.floor(c)) | (c <= 0)).long(), 0) == 0
    ends = torch.cumsum(c, 0)
    pos = torch.arange(channels, device=c.device, dtype=c.dtype)
    passed = (valid[:, None] & (ends[:, None] <= pos[None, :])).long().sum(0)
    member = passed[None, :] == torch.arange(c.shape[0], device=c.device)[:, None]
    return member, valid & (ends <= channels)


def wsl_roi_score_pool(x, counts, axis: int, mode: int, threshold: float):
    """caffe-wsl's RoIScorePooling of x along `axis` into one entry per image of `counts`."""
    shape = list(x.shape)
    outer, inner = 1, 1
    for d in shape[:axis]:
        outer *= d
    for d in shape[axis + 1:]:
        inner *= d
    member, closed = wsl_image_groups(counts, shape[axis])
    out = wsl_group_pool(x.reshape(outer, shape[axis], inner), member.to(x.device), closed.to(x.device), mode,
                         threshold, outer)
    shape[axis] = member.shape[0]
    return out.reshape(shape)


def wsl_general_pool(x, filt, axis: int, mode: int, threshold: float, rois: int, classes: int, top: list[int]):
    """caffe-wsl's GeneralPooling (77892fa) into the `top` shape; filt: the filter bottom or None."""
    if mode == 7:
        return (x.reshape(-1) * filt.reshape(-1)).reshape(top)
    one = torch.ones((1,), dtype=torch.bool, device=x.device)
    if mode in (2, 6, 8):
        shape = list(x.shape)
        outer, inner = 1, 1
        for d in shape[:axis]:
            outer *= d
        for d in shape[axis + 1:]:
            inner *= d
        member = torch.ones((1, shape[axis]), dtype=torch.bool, device=x.device)
        return wsl_group_pool(x.reshape(outer, shape[axis], inner), member, one, mode, threshold, outer).reshape(top)
    v = x.reshape(-1)[:rois * classes].reshape(1, rois, classes)
    member = torch.ones((1, rois), dtype=torch.bool, device=x.device)
    low = wsl_lowest(x)
    if mode == 4:
        keep = ~(v < threshold)
        out = torch.where(wsl_group_sum(keep.to(v.dtype), member) == 0, wsl_group_sum(v, member),
                          wsl_group_sum(v, member, keep))
    else:
        picked = filt.reshape(-1)[:rois * classes].reshape(1, rois, classes) != 0
        count = wsl_group_sum(picked.to(v.dtype), member)
        if mode == 3:
            out = wsl_group_sum(v, member, picked)
        elif mode == 0:
            out = torch.where(count == 0, wsl_group_max(v, member), wsl_group_max(v, member, picked))
        elif mode == 1:
            out = torch.where(count == 0, wsl_group_sum(v, member) / rois, wsl_group_sum(v, member, picked) / count)
        else:
            keep = picked & ~(v < threshold)
            kept = wsl_group_sum(keep.to(v.dtype), member)
            best = wsl_group_max(v, member, picked)
            fallback = torch.where(best != low, best, wsl_group_max(v, member))
            out = torch.where(kept > 0, wsl_group_sum(v, member, keep) / kept, fallback)
    total = 1
    for d in top:
        total *= d
    rest = torch.full((total - classes,), low if mode == 0 else 0.0, dtype=x.dtype, device=x.device)
    return torch.cat([out.reshape(-1), rest]).reshape(top)


TORCH_WSL_GROUPS = torch_sources(wsl_lowest, wsl_group_sum, wsl_group_max, wsl_group_pool)
TORCH_ROI_SCORE_POOLING = torch_sources(wsl_image_groups, wsl_roi_score_pool)


# ---- ONNX ---------------------------------------------------------------------------------


def _onnx_masks(ctx, member, keep):
    mask = ctx.op("Unsqueeze", [member, ctx.i64([0, 3])], "member4")                    # (1, S, J, 1)
    if keep is not None:
        mask = ctx.op("And", [mask, ctx.op("Unsqueeze", [keep, ctx.i64([1])], "keep4")], "mask")
    return mask


def onnx_group_sum(ctx, v, member, keep=None):
    """wsl_group_sum: v (O, J, K), member (S, J) bool, keep (O, J, K) bool or None -> (O, S, K)."""
    picked = ctx.op("Where", [_onnx_masks(ctx, member, keep), ctx.op("Unsqueeze", [v, ctx.i64([1])], "v4"),
                              ctx.f32(0.0)], "picked")
    return onnx_reduce(ctx, "ReduceSum", picked, [2], False, ctx.tmp(f"{ctx.layer.name}_group_sum"))


def onnx_group_max(ctx, v, member, keep=None):
    """wsl_group_max in ONNX (NaN, -inf and -FLT_MAX never win, as in the fork)."""
    above = ctx.op("Unsqueeze", [ctx.op("Greater", [v, ctx.f32(-FLT_MAX)], "above_lowest"), ctx.i64([1])], "above4")
    mask = ctx.op("And", [_onnx_masks(ctx, member, keep), above], "can_win")
    picked = ctx.op("Where", [mask, ctx.op("Unsqueeze", [v, ctx.i64([1])], "v4"), ctx.f32(-FLT_MAX)], "picked")
    return onnx_reduce(ctx, "ReduceMax", picked, [2], False, ctx.tmp(f"{ctx.layer.name}_group_max"))


def onnx_group_pool(ctx, v, member, closed, mode, threshold, width, inner):
    """wsl_group_pool in ONNX (closed: (S,) bool; inner: v's last size)."""
    if mode == SUM:
        return onnx_group_sum(ctx, v, member)
    shut = ctx.op("Unsqueeze", [closed, ctx.i64([0, 2])], "shut")
    if mode == MAX:
        return ctx.op("Where", [shut, onnx_group_max(ctx, v, member), ctx.f32(-FLT_MAX)], "pooled")
    keep = ctx.op("Not", [ctx.op("Less", [v, ctx.f32(threshold)], "below")], "keep")
    kept_sum = onnx_group_sum(ctx, v, member, keep)
    kept = onnx_group_sum(ctx, ctx.op("Cast", [keep], "keep_f", to=TensorProto.FLOAT), member)
    none = ctx.op("Equal", [kept, ctx.f32(0.0)], "none")
    if mode == TSUM:
        return ctx.op("Where", [ctx.op("And", [shut, none], "fallback"), onnx_group_sum(ctx, v, member), kept_sum],
                      "pooled")
    done = ctx.op("Where", [none, onnx_group_max(ctx, v, member), ctx.op("Div", [kept_sum, kept], "mean")], "done")
    out = ctx.op("Where", [shut, done, kept_sum], "pooled")
    if width >= inner:
        return out
    filled = ctx.const(np.arange(inner).reshape(1, 1, inner) < width)
    return ctx.op("Where", [filled, out, ctx.f32(0.0)], "first_positions")


def onnx_image_groups(ctx, counts, channels):
    """wsl_image_groups in ONNX: (member (S, J) bool, closed (S,) bool)."""
    c = ctx.op("Reshape", [counts, ctx.i64([-1])], "counts")
    fractional = ctx.op("Not", [ctx.op("Equal", [c, ctx.op("Floor", [c], "whole")], "is_whole")], "fractional")
    stuck = ctx.op("Or", [fractional, ctx.op("LessOrEqual", [c, ctx.f32(0.0)], "not_positive")], "stuck")
    stuck = ctx.op("Cast", [stuck], "stuck_i", to=TensorProto.INT64)
    valid = ctx.op("Equal", [ctx.op("CumSum", [stuck, ctx.i64(0)], "broken"), ctx.i64(0)], "valid")
    ends = ctx.op("CumSum", [c, ctx.i64(0)], "ends")
    pos = ctx.const(np.arange(channels, dtype=np.float32).reshape(1, channels))
    behind = ctx.op("And", [ctx.op("Unsqueeze", [valid, ctx.i64([1])], "valid2"),
                            ctx.op("LessOrEqual", [ctx.op("Unsqueeze", [ends, ctx.i64([1])], "ends2"), pos], "le")],
                    "behind")
    passed = onnx_reduce(ctx, "ReduceSum", ctx.op("Cast", [behind], "behind_i", to=TensorProto.INT64), [0], False,
                         ctx.tmp(f"{ctx.layer.name}_passed"))
    count = ctx.op("Slice", [ctx.op("Shape", [c], "shape"), ctx.i64([0]), ctx.i64([1])], "images")
    images = ctx.op("Unsqueeze", [ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [count, ctx.i64([0])], "n"),
                                                   ctx.i64(1)], "image"), ctx.i64([1])], "image2")
    member = ctx.op("Equal", [ctx.op("Unsqueeze", [passed, ctx.i64([0])], "passed2"), images], "member")
    closed = ctx.op("And", [valid, ctx.op("LessOrEqual", [ends, ctx.f32(float(channels))], "in_range")], "closed")
    return member, closed


# ---- the specs ----------------------------------------------------------------------------


def _pool_attrs(lp, p, what):
    return {"name": lp.name, "kind": what, "pool": int(p.pool), "threshold": float(np.float32(p.threshold)),
            "axis": int(p.axis)}


def _tavemax_overrun(attrs, shape, axis):
    outer, inner = _outer_inner(shape, axis)
    if attrs["pool"] == TAVEMAX and outer > inner:
        return (f"pool TAVEMAX runs its inner index to the outer size {outer}, past the inner size {inner}: "
                f"the fork reads and writes past its blobs")


@register_layer("RoIScorePooling")
class RoIScorePooling(Layer):
    def parse(self, lp):
        need_blobs(lp, "RoIScorePooling", 2, 1, "scores, roi counts")
        return _pool_attrs(lp, lp.roi_score_pooling_param, "RoIScorePooling")

    def infer(self, attrs, in_shapes):
        legacy_nchw(in_shapes[0], "RoIScorePooling")
        shape = [int(d) for d in in_shapes[0]]
        axis = canonical_axis(attrs["axis"], len(shape), "roi_score_pooling_param.axis")
        shape[axis] = _size(in_shapes[1])
        return [tuple(shape)]

    def cannot_run(self, attrs, in_shapes):
        if attrs["pool"] == MUL:
            return "pool MUL is NOT_IMPLEMENTED in caffe-wsl's forward"
        return _tavemax_overrun(attrs, in_shapes[0], attrs["axis"] % len(in_shapes[0]))

    def forward(self, attrs, params, x, counts):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape, counts.shape], LayerError)
        axis = attrs["axis"] % x.dim()
        if eager_checks():
            c = counts.reshape(-1).double()
            if float(c.abs().sum()) != x.shape[axis] or bool((c <= 0).any()):
                raise LayerError(f"layer '{attrs['name']}' (RoIScorePooling): the roi counts {c.tolist()[:8]} must "
                                 f"each be above 0 and add up to the pooled axis' {x.shape[axis]} rois (the fork's "
                                 f"CHECKs)")
        out = wsl_roi_score_pool(x, counts, axis, attrs["pool"], attrs["threshold"])
        if attrs["pool"] == MAX and eager_checks():
            _, closed = wsl_image_groups(counts, x.shape[axis])
            unfound = (out == wsl_lowest(out)).movedim(axis, 0).reshape(out.shape[axis], -1).any(1)
            if bool((unfound & closed.to(out.device)).any()):
                raise LayerError(f"layer '{attrs['name']}' (RoIScorePooling): MAX found no value above -FLT_MAX "
                                 f"for an image (the fork's CHECK 'max value not found')")
        return out

    def onnx(self, ctx, node):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(i) for i in node.inputs], ExportError, node.type)
        x, counts = node.inputs
        shape = [int(d) for d in ctx.shape(x)]
        axis = a["axis"] % len(shape)
        outer, inner = _outer_inner(shape, axis)
        member, closed = onnx_image_groups(ctx, counts, shape[axis])
        v = ctx.op("Reshape", [x, ctx.i64([outer, shape[axis], inner])], "grouped")
        out = onnx_group_pool(ctx, v, member, closed, a["pool"], a["threshold"], outer, inner)
        ctx.add_node("Reshape", [out, ctx.i64(list(ctx.shape(node.outputs[0])))], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(0), emit.in_shape(1)], ExportError, node.type)
        emit.helper(TORCH_WSL_GROUPS)
        fn = emit.helper(TORCH_ROI_SCORE_POOLING)
        axis = a["axis"] % len(emit.in_shape(0))
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {axis}, {a['pool']}, {a['threshold']!r})"


@register_layer("GeneralPooling")
class GeneralPooling(Layer):
    def parse(self, lp):
        need_blobs(lp, "GeneralPooling", (1, 2), 1, "scores[, filter]")
        attrs = _pool_attrs(lp, lp.general_pooling_param, "GeneralPooling")
        if attrs["pool"] in _NEEDS_FILTER and len(lp.bottom) != 2:
            raise LayerError(f"GeneralPooling pool {_NAMES[attrs['pool']]} needs two bottoms (scores, filter), got "
                             f"{len(lp.bottom)} (the fork's CHECK)")
        return attrs

    def infer(self, attrs, in_shapes):
        n, c = legacy_nchw(in_shapes[0], "GeneralPooling")[:2]
        if len(in_shapes) == 2:
            fn, fc = legacy_nchw(in_shapes[1], "GeneralPooling")[:2]
            if (fn, fc) != (n, c) or _size(in_shapes[1]) != n * c:
                raise LayerError(f"GeneralPooling's filter needs the scores' num {n} and channels {c} and no more "
                                 f"(the fork's CHECKs), got {list(in_shapes[1])} for scores {list(in_shapes[0])}")
        shape = [int(d) for d in in_shapes[0]]
        axis = canonical_axis(attrs["axis"], len(shape), "general_pooling_param.axis")
        attrs["rois"], attrs["classes"] = int(n), int(c)
        if attrs["pool"] == MUL:
            return [(n, c, 1, 1)]
        shape[axis] = 1
        return [tuple(shape)]

    def cannot_run(self, attrs, in_shapes):
        shape = in_shapes[0]
        n, c = legacy_nchw(shape, "GeneralPooling")[:2]
        axis = attrs["axis"] % len(shape)
        if attrs["pool"] == MUL and _size(shape) > n * c:
            return f"pool MUL multiplies all {_size(shape)} scores into a top of {n * c}: the fork writes past it"
        top = _size(shape) // int(shape[axis]) if shape[axis] else 0
        if attrs["pool"] in _PER_CLASS and c > top:
            return (f"pool {_NAMES[attrs['pool']]} writes one value per class ({c}) at the start of a top of {top}: "
                    f"the fork writes past it")
        return _tavemax_overrun(attrs, shape, axis)

    def _call_args(self, a, top):
        return a["axis"], a["pool"], a["threshold"], a["rois"], a["classes"], list(top)

    def forward(self, attrs, params, x, filt=None):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape], LayerError)
        top = self.infer(attrs, [x.shape] + ([filt.shape] if filt is not None else []))[0]
        out = wsl_general_pool(x, filt, *self._call_args(dict(attrs, axis=attrs["axis"] % x.dim()), top))
        if attrs["pool"] == MAX and eager_checks() and bool((out == wsl_lowest(out)).any()):
            raise LayerError(f"layer '{attrs['name']}' (GeneralPooling): MAX found no value above -FLT_MAX (the fork's "
                             f"CHECK 'max value not found')")
        return out

    def onnx(self, ctx, node):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(node.inputs[0])], ExportError, node.type)
        x = node.inputs[0]
        shape = [int(d) for d in ctx.shape(x)]
        top = [int(d) for d in ctx.shape(node.outputs[0])]
        filt = node.inputs[1] if len(node.inputs) > 1 else None
        if a["pool"] == MUL:
            ctx.add_node("Reshape", [ctx.op("Mul", [ctx.op("Reshape", [x, ctx.i64([-1])], "flat"),
                                                    ctx.op("Reshape", [filt, ctx.i64([-1])], "filter")], "product"),
                                     ctx.i64(top)], [node.outputs[0]], name=node.name)
            return
        if a["pool"] not in _PER_CLASS:
            axis = a["axis"] % len(shape)
            outer, inner = _outer_inner(shape, axis)
            v = ctx.op("Reshape", [x, ctx.i64([outer, shape[axis], inner])], "grouped")
            member, closed = ctx.const(np.ones((1, shape[axis]), bool)), ctx.const(np.ones(1, bool))
            out = onnx_group_pool(ctx, v, member, closed, a["pool"], a["threshold"], outer, inner)
            ctx.add_node("Reshape", [out, ctx.i64(top)], [node.outputs[0]], name=node.name)
            return
        out = _onnx_per_class(ctx, a, x, filt)
        rest = _size(top) - a["classes"]
        fill = ctx.const(np.full(rest, -FLT_MAX if a["pool"] == FMAX else 0.0, np.float32))
        whole = ctx.op("Concat", [ctx.op("Reshape", [out, ctx.i64([-1])], "per_class"), fill], "whole", axis=0)
        ctx.add_node("Reshape", [whole, ctx.i64(top)], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(0)], ExportError, node.type)
        emit.helper(TORCH_WSL_GROUPS)
        fn = emit.helper(wsl_general_pool)
        filt = emit.inputs[1] if len(emit.inputs) > 1 else "None"
        args = self._call_args(dict(a, axis=a["axis"] % len(emit.in_shape(0))), emit.out_shape(0))
        return f"{fn}({emit.inputs[0]}, {filt}, {', '.join(repr(v) for v in args)})"


def _onnx_per_class(ctx, a, x, filt):
    """GeneralPooling's per-class methods in ONNX -> (1, 1, classes)."""
    rois, classes = a["rois"], a["classes"]

    def first_values(t, hint):
        flat = ctx.op("Reshape", [t, ctx.i64([-1])], hint)
        return ctx.op("Reshape", [ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([rois * classes])], hint + "_head"),
                                  ctx.i64([1, rois, classes])], hint + "_rc")
    v = first_values(x, "scores")
    member = ctx.const(np.ones((1, rois), bool))

    def count(mask):
        return onnx_group_sum(ctx, ctx.op("Cast", [mask], "mask_f", to=TensorProto.FLOAT), member)
    below = ctx.op("Less", [v, ctx.f32(a["threshold"])], "below")
    if a["pool"] == TSUM:
        keep = ctx.op("Not", [below], "keep")
        return ctx.op("Where", [ctx.op("Equal", [count(keep), ctx.f32(0.0)], "none"), onnx_group_sum(ctx, v, member),
                                onnx_group_sum(ctx, v, member, keep)], "pooled")
    picked = ctx.op("Not", [ctx.op("Equal", [first_values(filt, "filter"), ctx.f32(0.0)], "zero")], "picked")
    if a["pool"] == FSUM:
        return onnx_group_sum(ctx, v, member, picked)
    none = ctx.op("Equal", [count(picked), ctx.f32(0.0)], "none")
    if a["pool"] == FMAX:
        return ctx.op("Where", [none, onnx_group_max(ctx, v, member), onnx_group_max(ctx, v, member, picked)], "pooled")
    if a["pool"] == FAVE:
        every = ctx.op("Div", [onnx_group_sum(ctx, v, member), ctx.f32(float(rois))], "every")
        mean = ctx.op("Div", [onnx_group_sum(ctx, v, member, picked), count(picked)], "mean")
        return ctx.op("Where", [none, every, mean], "pooled")
    keep = ctx.op("And", [picked, ctx.op("Not", [below], "above")], "keep")
    kept = count(keep)
    best = onnx_group_max(ctx, v, member, picked)
    fallback = ctx.op("Where", [ctx.op("Equal", [best, ctx.f32(-FLT_MAX)], "unfound"), onnx_group_max(ctx, v, member),
                                best], "fallback")
    mean = ctx.op("Div", [onnx_group_sum(ctx, v, member, keep), kept], "mean")
    return ctx.op("Where", [ctx.op("Greater", [kept, ctx.f32(0.0)], "any"), mean, fallback], "pooled")


