"""Shape layers: Concat, Slice, Flatten, Crop, Tile, BatchReindex, Filter (Reshape and Tiling: reshape.py;
Im2col: im2col.py).

Each follows BVLC Caffe's layer (src/caffe/layers/<name>_layer.cpp).  Top shapes
are computed from the *runtime* bottom shapes in forward, with the same
functions that `infer` uses on Caffe's static shapes, so a model runs at any
batch size.  ONNX emission never writes dim 0 into a shape constant: it uses 0
in Reshape (copy) or Shape/Slice/Concat subgraphs.
"""
import math

import numpy as np
import torch

from .act_forks import SELECTOR_FILTER, is_selector_filter
from .registry import Layer, LayerError, canonical_axis, need_blobs, register_layer

INT64_MAX = np.iinfo(np.int64).max


def i64(values):
    return np.asarray(list(values), dtype=np.int64)


# ---- small ONNX helpers (opset >= 13 input forms; see ctx.opset) ---------------

def _onnx_slice(ctx, x, starts, ends, axes, out=None, name=None):
    """Slice with constant or tensor starts/ends (tensor names are passed through)."""
    out = out or ctx.tmp(x + "_slice")
    s = starts if isinstance(starts, str) else ctx.const(i64(starts))
    e = ends if isinstance(ends, str) else ctx.const(i64(ends))
    ctx.add_node("Slice", [x, s, e, ctx.const(i64(axes))], [out], name=name)
    return out


def onnx_dims(ctx, x, start, end):
    """1-D int64 tensor holding x.shape[start:end] at run time."""
    shape = ctx.tmp(x + "_shape")
    ctx.add_node("Shape", [x], [shape])
    return _onnx_slice(ctx, shape, [start], [end], [0])


def _onnx_shape_from(ctx, x, pieces):
    """Concat of pieces: ("const", [ints]) or ("dim", i) meaning x.shape[i] at run time."""
    merged = []
    for kind, val in pieces:
        if kind == "const" and merged and merged[-1][0] == "const":
            merged[-1] = ("const", merged[-1][1] + list(val))
        else:
            merged.append((kind, list(val) if kind == "const" else val))
    parts = [ctx.const(i64(v)) if k == "const" else onnx_dims(ctx, x, v, v + 1) for k, v in merged]
    if len(parts) == 1:
        return parts[0]
    out = ctx.tmp(x + "_target_shape")
    ctx.add_node("Concat", parts, [out], axis=0)
    return out


def onnx_reshape(ctx, x, spec, out, name=None):
    """Reshape to `spec`: one entry per output axis, an int (ONNX semantics: 0 copies the input
    axis of the same index, -1 infers) or ("dim", i) for input axis i taken at run time."""
    if all(isinstance(v, int) for v in spec):
        target = ctx.const(i64(spec))
    else:
        target = _onnx_shape_from(ctx, x, [("dim", v[1]) if isinstance(v, tuple) else ("const", [v])
                                           for v in spec])
    ctx.add_node("Reshape", [x, target], [out], name=name)
    return out


# ---- blobs joined as Caffe held them before N-D blobs ----------------------------

def legacy_4d_shapes(shapes):
    """The shapes padded to 4 axes, as Caffe held every blob before N-D blobs (early 2015: an
    InnerProduct gave (N, C, 1, 1)), when the bottoms of a join differ in axes only; else None.  The
    nets of that era (DQN's, V1 files) join an InnerProduct's output with a 4-axis data blob."""
    shapes = [tuple(s) for s in shapes]
    if len({len(s) for s in shapes}) < 2 or any(len(s) > 4 for s in shapes):
        return None
    return [s + (1,) * (4 - len(s)) for s in shapes]


def legacy_4d_note(kind, shapes):
    return (f"{kind} joins bottoms of {', '.join(str(list(s)) for s in shapes)} as the 4-axis blobs that "
            f"Caffe before N-D blobs (2015) made of them; its top has 4 axes")


def as_4d(x):
    """x with trailing axes of 1 up to 4 axes (legacy_4d_shapes)."""
    return x.reshape(tuple(x.shape) + (1,) * (4 - x.dim())) if x.dim() < 4 else x


def onnx_as_4d(ctx, x):
    rank = len(ctx.shape(x))
    if rank >= 4:
        return x
    return ctx.op("Reshape", [x, ctx.i64([0] * rank + [1] * (4 - rank))], "as_4d")


# ---- Concat -------------------------------------------------------------------

def _concat_slice_axis(attrs, ndim, kind):
    """The axis of Concat/Slice (kind "concat"/"slice"): the legacy <kind>_dim, or <kind>_param.axis."""
    if attrs["legacy"]:  # concat_dim/slice_dim: no negative indexing
        if attrs["axis"] >= ndim:
            raise LayerError(f"{kind}_dim {attrs['axis']} out of range for a {ndim}-axis blob")
        return attrs["axis"]
    return canonical_axis(attrs["axis"], ndim, f"{kind}_param.axis")


def _axis_attrs(p, legacy, kind):
    """Concat's and Slice's axis, or their V1-era concat_dim / slice_dim (Caffe refuses both):
    {"axis", "legacy"}; the legacy form counts from 0 and allows no negative values."""
    if p.HasField("axis") and p.HasField(legacy):
        raise LayerError(f"{kind}_param: set either axis or {legacy}, not both")
    if p.HasField(legacy):
        return {"axis": int(getattr(p, legacy)), "legacy": True}
    return {"axis": int(p.axis), "legacy": False}


@register_layer("Concat")
class Concat(Layer):
    def parse(self, lp):
        attrs = _axis_attrs(lp.concat_param, "concat_dim", "concat")
        if not lp.bottom:
            raise LayerError("Concat needs at least one bottom")
        if lp.concat_param.per_fla_fuse:
            raise LayerError("concat_param.per_fla_fuse (Intel Caffe's MKL-DNN concat of each bottom flattened in its "
                             "private memory layout, in place of SSD's Permute and Flatten) is not supported: write the "
                             "Permute / Flatten layers")
        return attrs

    def infer(self, attrs, in_shapes):
        padded = legacy_4d_shapes(in_shapes)
        attrs["_as_4d"] = padded is not None
        if padded:
            attrs["reading_notes"] = [legacy_4d_note("Concat", in_shapes)]
            in_shapes = padded
        first = tuple(in_shapes[0])
        axis = attrs["_axis"] = _concat_slice_axis(attrs, len(first), "concat")
        top = list(first)
        for i, s in enumerate(in_shapes[1:], 1):
            if len(s) != len(first):
                raise LayerError(f"bottom {i} has {len(s)} axes, bottom 0 has {len(first)}")
            if any(a != b for j, (a, b) in enumerate(zip(first, s)) if j != axis):
                raise LayerError(f"bottoms must match except along axis {axis}: "
                                 f"{list(first)} vs {list(s)}")
            top[axis] += s[axis]
        return [tuple(top)]

    def forward(self, attrs, params, *xs):
        if len(xs) == 1:
            return xs[0]
        if attrs.get("_as_4d"):
            xs = [as_4d(x) for x in xs]
        return torch.cat(xs, dim=attrs["_axis"])

    def onnx(self, ctx, node):
        if len(node.inputs) == 1:
            ctx.add_node("Identity", node.inputs, node.outputs, name=node.name)
        else:
            ins = [onnx_as_4d(ctx, x) for x in node.inputs] if node.attrs.get("_as_4d") else list(node.inputs)
            ctx.add_node("Concat", ins, node.outputs, name=node.name, axis=node.attrs["_axis"])

    def pytorch_source(self, node, emit):
        if len(emit.inputs) == 1:
            return [emit.inputs[0]]
        xs = emit.inputs
        if node.attrs.get("_as_4d"):
            xs = [f"{emit.helper(as_4d)}({x})" for x in xs]
        return f"torch.cat([{', '.join(xs)}], dim={node.attrs['_axis']})"


# ---- Slice --------------------------------------------------------------------

def _slice_sizes(attrs, size):
    """Sizes of the tops along the slice axis, as SliceLayer::Reshape."""
    tops, points = attrs["tops"], attrs["points"]
    if points:
        if tops > size:
            raise LayerError(f"{tops} tops but the slice axis has only {size} items")
        bounds = [0] + points + [size]
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]  # (pairwise needs 3.10)
        if sizes[-1] < 0:
            raise LayerError(f"slice_point {points[-1]} is beyond the slice axis size {size}")
        return sizes
    if size % tops:
        raise LayerError(f"{tops} tops do not evenly divide the slice axis size {size}")
    return [size // tops] * tops


@register_layer("Slice")
class Slice(Layer):
    def parse(self, lp):
        p = lp.slice_param
        attrs = _axis_attrs(p, "slice_dim", "slice")
        points = [int(v) for v in p.slice_point]
        tops = len(lp.top)
        if tops < 1:
            raise LayerError("Slice needs at least one top")
        if points:
            if len(points) != tops - 1:
                raise LayerError(f"{len(points)} slice_point value(s) for {tops} tops "
                                 f"(need {tops - 1})")
            prev = 0
            for v in points:
                if v <= prev:
                    raise LayerError(f"slice_point values must be strictly increasing and > 0, "
                                     f"got {points}")
                prev = v
        # nlpcaffe's fast_wordvec_slice: the same slices along axis 2 by a faster loop, which CHECKs them
        return {**attrs, "points": points, "tops": tops, "wordvec": bool(p.fast_wordvec_slice)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        axis = attrs["_axis"] = _concat_slice_axis(attrs, len(s), "slice")
        tops = [s[:axis] + (n,) + s[axis + 1:] for n in _slice_sizes(attrs, s[axis])]
        if attrs.get("wordvec") and axis == 2 and (len(s) != 4 or s[3] != 1 or any(t[2] != 1 for t in tops)):
            raise LayerError(f"slice_param.fast_wordvec_slice (nlpcaffe) slices a (N, C, H, 1) bottom into rows of "
                             f"height 1 (the fork's CHECKs), got {list(s)} into {[list(t) for t in tops]}")
        return tops

    def forward(self, attrs, params, x):
        if attrs["tops"] == 1:
            return x
        axis = attrs["_axis"]
        return tuple(torch.split(x, _slice_sizes(attrs, x.shape[axis]), dim=axis))

    def onnx(self, ctx, node):
        a = node.attrs
        x, outs, axis = node.inputs[0], node.outputs, a["_axis"]
        if a["tops"] == 1:
            ctx.add_node("Identity", [x], outs, name=node.name)
            return
        if axis != 0:  # static size along the axis
            sizes = _slice_sizes(a, ctx.shape(x)[axis])
            if ctx.opset >= 13:
                ctx.add_node("Split", [x, ctx.const(i64(sizes))], outs, name=node.name, axis=axis)
            else:
                ctx.add_node("Split", [x], outs, name=node.name, axis=axis, split=sizes)
            return
        # along the batch axis: constant points, or (equal split) bounds from the run-time size
        if a["points"]:
            bounds = [0] + a["points"] + [INT64_MAX]
            for i, out in enumerate(outs):
                _onnx_slice(ctx, x, [bounds[i]], [bounds[i + 1]], [0], out=out,
                            name=node.name if i == 0 else None)
            return
        n = onnx_dims(ctx, x, 0, 1)
        step = ctx.tmp(node.name + "_step")
        ctx.add_node("Div", [n, ctx.const(i64([a["tops"]]))], [step])
        for i, out in enumerate(outs):
            start, end = ctx.tmp(node.name + "_start"), ctx.tmp(node.name + "_end")
            ctx.add_node("Mul", [step, ctx.const(i64([i]))], [start])
            ctx.add_node("Mul", [step, ctx.const(i64([i + 1]))], [end])
            _onnx_slice(ctx, x, start, end, [0], out=out, name=node.name if i == 0 else None)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x, axis = emit.inputs[0], a["_axis"]
        if a["tops"] == 1:
            return [x]
        if axis != 0:
            sizes = emit.lit(_slice_sizes(a, emit.in_shape(0)[axis]))
        elif a["points"]:  # the batch axis: the last piece is whatever is left at run time
            p = a["points"]
            sizes = "[" + ", ".join([str(v) for v in (b - c for b, c in zip(p, [0] + p))] +
                                    [f"{x}.shape[0] - {p[-1]}"]) + "]"
        else:
            sizes = f"{x}.shape[0] // {a['tops']}"
        return f"torch.split({x}, {sizes}, dim={axis})"


# ---- Flatten ------------------------------------------------------------------

def _flatten_axes(attrs, ndim):
    start = canonical_axis(attrs["axis"], ndim, "flatten_param.axis")
    end = canonical_axis(attrs["end_axis"], ndim, "flatten_param.end_axis")
    # Caffe's count(start, end + 1) needs end + 1 >= start; end == start - 1 inserts a 1
    if end + 1 < start:
        raise LayerError(f"flatten_param.end_axis ({attrs['end_axis']} -> {end}) is before "
                         f"axis ({attrs['axis']} -> {start})")
    return start, end


def _flatten_shape(attrs, shape):
    start, end = _flatten_axes(attrs, len(shape))
    return tuple(shape[:start]) + (math.prod(shape[start:end + 1]),) + tuple(shape[end + 1:])


@register_layer("Flatten")
class Flatten(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, in_place=False)
        p = lp.flatten_param
        return {"axis": int(p.axis), "end_axis": int(p.end_axis)}

    def infer(self, attrs, in_shapes):
        return [_flatten_shape(attrs, in_shapes[0])]

    def forward(self, attrs, params, x):
        return x.reshape(_flatten_shape(attrs, tuple(x.shape)))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        shape = ctx.shape(x)
        start, end = _flatten_axes(node.attrs, len(shape))
        if start == 1 and end == len(shape) - 1:
            # ONNX's Flatten: zero rois, and a batch that a Permute moved into the merged axes
            ctx.add_node("Flatten", [x], [node.outputs[0]], name=node.name, axis=1)
            return
        # leading axes copied (0), trailing axes (never dim 0) static; the merged axis static too unless it takes
        # in dim 0 (a -1 cannot be inferred beside a copied 0: the zero rois a proposal layer may give)
        merged = (-1 if start == 0 else math.prod(int(d) for d in shape[start:end + 1])) if end >= start else 1
        spec = [0] * start + [merged] + [int(d) for d in shape[end + 1:]]
        onnx_reshape(ctx, x, spec, node.outputs[0], name=node.name)

    def pytorch_source(self, node, emit):
        x = emit.inputs[0]
        ndim = len(emit.in_shape(0))
        start, end = _flatten_axes(node.attrs, ndim)
        if end + 1 == start:  # Caffe's count over an empty range: a new axis of 1
            return f"{x}.unsqueeze({start})"
        if end == start:
            return [x]
        return f"{x}.flatten({start})" if end == ndim - 1 else f"{x}.flatten({start}, {end})"


# ---- Crop ---------------------------------------------------------------------

def _crop_plan(attrs, shape, ref_shape):
    """(start_axis, offsets per cropped axis); checks bounds as CropLayer::Reshape."""
    ndim = len(shape)
    start = canonical_axis(attrs["axis"], ndim, "crop_param.axis")
    offs = attrs["offsets"]
    if len(offs) > 1 and start + len(offs) != ndim:
        raise LayerError(f"crop_param has {len(offs)} offsets but {ndim - start} axes are cropped "
                         f"(from axis {start} of a {ndim}-axis blob)")
    if len(ref_shape) < ndim:
        raise LayerError(f"the reference bottom {list(ref_shape)} has fewer axes than the "
                         f"cropped one {list(shape)}")
    offsets = [offs[0] if len(offs) == 1 else (offs[i - start] if offs else 0) for i in range(start, ndim)]
    if attrs.get("center_align"):   # superxuang/caffe_3d_faster_rcnn: C's (bottom - reference) / 2
        offsets = [int((shape[i] - ref_shape[i]) / 2) for i in range(start, ndim)]
    for i, off in zip(range(start, ndim), offsets):
        if shape[i] - off < ref_shape[i]:
            raise LayerError(f"crop of axis {i} is out of bounds: size {ref_shape[i]} at offset {off} "
                             f"of an axis of {shape[i]}")
    return start, offsets


def _fixed_size(attrs, shape):
    """GLAD's one-bottom Crop: the reference shape its height / weight give (CropLayer::Reshape:
    axis 2 takes height, every other axis from crop_param.axis on takes weight)."""
    start = canonical_axis(attrs["axis"], len(shape), "crop_param.axis")
    height, weight = attrs["size"]
    return tuple(shape[:start]) + tuple(height if i == 2 else weight for i in range(start, len(shape)))


@register_layer("Crop")
class Crop(Layer):
    def parse(self, lp):
        p = lp.crop_param
        fixed = len(lp.bottom) == 1 and (p.HasField("height") or p.HasField("weight"))
        if not fixed:
            need_blobs(lp, "Crop", 2, roles="data, reference")
        elif min(p.height, p.weight) < 1:
            raise LayerError(f"crop_param: a one-bottom Crop (GLAD's) needs height and weight >= 1, got "
                             f"{p.height} and {p.weight}")
        attrs = {"axis": int(p.axis), "offsets": [int(v) for v in p.offset],
                 "size": (int(p.height), int(p.weight)) if fixed else None}
        if p.center_align:
            if fixed:
                raise LayerError("crop_param: center_align (superxuang/caffe_3d_faster_rcnn) crops to a "
                                 "reference bottom; GLAD's one-bottom height / weight have none")
            attrs["center_align"] = True
        return attrs

    def _ref_shape(self, attrs, shape, ref_shape):
        return _fixed_size(attrs, shape) if attrs.get("size") else ref_shape

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        ref = self._ref_shape(attrs, s, tuple(in_shapes[-1]))
        start, _ = _crop_plan(attrs, s, ref)
        return [s[:start] + ref[start:len(s)]]

    def forward(self, attrs, params, x, ref=None):
        ref_shape = self._ref_shape(attrs, tuple(x.shape), None if ref is None else tuple(ref.shape))
        start, offsets = _crop_plan(attrs, tuple(x.shape), ref_shape)
        for i, off in zip(range(start, x.dim()), offsets):
            if off or x.shape[i] != ref_shape[i]:
                x = x.narrow(i, off, ref_shape[i])
        return x

    def onnx(self, ctx, node):
        x, ref = node.inputs[0], node.inputs[-1]
        shape = tuple(ctx.shape(x))
        ref_shape = self._ref_shape(node.attrs, shape, tuple(ctx.shape(ref)))
        start, offsets = _crop_plan(node.attrs, shape, ref_shape)
        axes = list(range(start, len(shape)))
        if start == 0 and not node.attrs.get("size"):  # dim 0 is cropped to the reference's run-time batch
            dims = onnx_dims(ctx, ref, 0, len(shape))
            ends = ctx.tmp(node.name + "_ends")
            ctx.add_node("Add", [dims, ctx.const(i64(offsets))], [ends])
        else:
            ends = [o + int(ref_shape[i]) for i, o in zip(axes, offsets)]
        _onnx_slice(ctx, x, offsets, ends, axes, out=node.outputs[0], name=node.name)

    def pytorch_source(self, node, emit):
        x = emit.inputs[0]
        if node.attrs.get("size"):   # GLAD's fixed size: static bounds
            ref_shape = _fixed_size(node.attrs, emit.in_shape(0))
            start, offsets = _crop_plan(node.attrs, emit.in_shape(0), ref_shape)
            index = [":"] * start + [f"{off}:{off + ref_shape[i]}"
                                     for i, off in zip(range(start, len(ref_shape)), offsets)]
            return f"{x}[{', '.join(index)}]"
        ref = emit.inputs[1]
        start, offsets = _crop_plan(node.attrs, emit.in_shape(0), emit.in_shape(1))
        if node.attrs.get("center_align"):   # the offsets follow the run's shapes
            index = [":"] * start + [f"({x}.shape[{i}] - {ref}.shape[{i}]) // 2:({x}.shape[{i}] - {ref}.shape[{i}]) "
                                     f"// 2 + {ref}.shape[{i}]" for i in range(start, len(emit.in_shape(0)))]
            return f"{x}[{', '.join(index)}]"
        index = [":"] * start + [f"{off}:{off} + {ref}.shape[{i}]" if off else f":{ref}.shape[{i}]"
                                 for i, off in zip(range(start, len(emit.in_shape(0))), offsets)]
        return f"{x}[{', '.join(index)}]"


# ---- Tile ---------------------------------------------------------------------

@register_layer("Tile")
class Tile(Layer):
    """BVLC's Tile, and the two-bottom Tile of the ms_caffe that PPR-FCN carries (alenaliu/PPR-FCN 1eba551,
    externals/ms_caffe/src/caffe/layers/tile_layer.cpp): its forward tiles by the second bottom's first axis
    (a count of labels or rois known at run time) in place of tile_param.tiles."""

    bottoms, bottom_roles = (1, 2), "data, count"

    def parse(self, lp):
        super().parse(lp)
        p = lp.tile_param
        if not p.HasField("tiles"):
            raise LayerError("tile_param.tiles is required")
        if p.tiles <= 0:
            raise LayerError(f"tile_param.tiles must be positive, got {p.tiles}")
        return {"axis": int(p.axis), "tiles": int(p.tiles)}

    def infer(self, attrs, in_shapes):
        s = list(in_shapes[0])
        axis = attrs["_axis"] = canonical_axis(attrs["axis"], len(s), "tile_param.axis")
        s[axis] *= in_shapes[1][0] if len(in_shapes) > 1 else attrs["tiles"]
        return [tuple(s)]

    def _reps(self, attrs, ndim, tiles):
        reps = [1] * ndim
        reps[attrs["_axis"]] = tiles
        return reps

    def forward(self, attrs, params, x, *count):
        # Caffe copies the whole block from the axis on `tiles` times per outer item: np.tile
        return x.repeat(*self._reps(attrs, x.dim(), count[0].shape[0] if count else attrs["tiles"]))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        ndim, axis = len(ctx.shape(x)), node.attrs["_axis"]
        if len(node.inputs) == 1:
            reps = ctx.const(i64(self._reps(node.attrs, ndim, node.attrs["tiles"])))
        else:   # the count's first axis may be the (dynamic) batch: read it from the graph
            first = ctx.op("Slice", [ctx.op("Shape", [node.inputs[1]], "count_shape"), ctx.i64([0]), ctx.i64([1])],
                           "tiles")
            parts = ([ctx.i64([1] * axis)] if axis else []) + [first]
            parts += [ctx.i64([1] * (ndim - axis - 1))] if axis < ndim - 1 else []
            reps = ctx.op("Concat", parts, "reps", axis=0) if len(parts) > 1 else first
        ctx.add_node("Tile", [x, reps], node.outputs, name=node.name)

    def pytorch_source(self, node, emit):
        ndim = len(emit.in_shape(0))
        if len(emit.inputs) == 1:
            return f"{emit.inputs[0]}.repeat({self._reps(node.attrs, ndim, node.attrs['tiles'])})"
        reps = ", ".join(f"{emit.inputs[1]}.shape[0]" if i == node.attrs["_axis"] else "1" for i in range(ndim))
        return f"{emit.inputs[0]}.repeat({reps})"


# ---- BatchReindex -------------------------------------------------------------

@register_layer("BatchReindex")
class BatchReindex(Layer):
    bottoms, bottom_roles = 2, "data, indices"

    def infer(self, attrs, in_shapes):
        s, idx = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(idx) != 1:
            raise LayerError(f"the index bottom must be 1-D, got shape {list(idx)}")
        return [(idx[0],) + s[1:]]

    def forward(self, attrs, params, x, idx):
        n = x.shape[0]
        if idx.dim() != 1:
            raise LayerError(f"BatchReindex: the index blob must be 1-D, got shape {list(idx.shape)}")
        # Caffe checks the float values, then truncates them to int
        if idx.numel() and bool(((idx < 0) | (idx >= n)).any()):
            bad = idx[(idx < 0) | (idx >= n)][0].item()
            raise LayerError(f"BatchReindex: index {bad} is outside the {n} items of the bottom")
        return x.index_select(0, idx.to(torch.int64))

    def onnx(self, ctx, node):
        x, idx = node.inputs
        ind = ctx.tmp(node.name + "_idx")
        ctx.add_node("Cast", [idx], [ind], to=7)  # INT64; truncation toward zero, like static_cast
        ctx.add_node("Gather", [x, ind], node.outputs, name=node.name, axis=0)

    def pytorch_source(self, node, emit):
        x, idx = emit.inputs
        return f"{x}.index_select(0, {idx}.to(torch.int64))"  # float indexes truncated, as Caffe


# ---- Filter -------------------------------------------------------------------

@register_layer("Filter")
class Filter(Layer):
    """Keeps the items (axis 0) whose selector (last bottom) is non-zero, for every other bottom.

    The number of kept items depends on the selector's *values*, which shape
    inference cannot see.  `infer` returns what Caffe itself gives before any
    data has flowed (FilterLayer::Reshape's first call: the full bottom[0]
    batch, an upper bound); forward and ONNX (Compress) use the real selector,
    so run-time outputs have Caffe's post-forward shape.

    A Filter carrying `filter_param` is yihui-he/caffe-pro's channel selector (one bottom per top,
    a selector blob): every method hands it to act_forks.SELECTOR_FILTER.
    """

    #: dim 0 of the tops depends on the selector's values (static shape = upper bound)
    data_dependent_shape = True

    def parse(self, lp):
        if lp.HasField("filter_param"):
            return SELECTOR_FILTER.parse(lp)
        if len(lp.bottom) < 2:
            hint = (" (yihui-he/caffe-pro's one-bottom Filter needs filter_param { num_output: ... })"
                    if len(lp.bottom) == len(lp.top) == 1 else "")
            raise LayerError(f"Filter needs at least 2 bottoms (blobs to filter, then the selector){hint}")
        if len(lp.top) != len(lp.bottom) - 1:
            raise LayerError(f"Filter needs one top per filtered bottom: {len(lp.bottom) - 1} "
                             f"top(s), got {len(lp.top)}")
        return {}

    def blob_names_for(self, attrs):
        return SELECTOR_FILTER.blob_names if is_selector_filter(attrs) else self.blob_names

    def param_shapes(self, attrs, in_shapes):
        return SELECTOR_FILTER.param_shapes(attrs, in_shapes) if is_selector_filter(attrs) else None

    def init_params(self, attrs, shapes, rng):
        return SELECTOR_FILTER.init_params(attrs, shapes, rng)

    def infer(self, attrs, in_shapes):
        if is_selector_filter(attrs):
            return SELECTOR_FILTER.infer(attrs, in_shapes)
        sel = tuple(in_shapes[-1])
        if not sel:
            raise LayerError("the selector bottom must have at least one axis")
        if any(d != 1 for d in sel[1:]):
            raise LayerError(f"selector dimensions must be 1 except the first, got {list(sel)}")
        for i, s in enumerate(in_shapes[:-1]):
            if not s or s[0] != sel[0]:
                raise LayerError(f"bottom {i} {list(s)} must have the selector's first dimension {sel[0]}")
        # data-dependent: Caffe's setup-time shape (first Reshape uses bottom[0]'s num)
        return [tuple(in_shapes[0][:1]) + tuple(s[1:]) for s in in_shapes[:-1]]

    def forward(self, attrs, params, *inputs):
        if is_selector_filter(attrs):
            return SELECTOR_FILTER.forward(attrs, params, *inputs)
        *xs, sel = inputs
        for x in xs:
            if x.shape[0] != sel.shape[0]:
                raise LayerError(f"Filter: bottom with {x.shape[0]} items but the selector has "
                                 f"{sel.shape[0]}")
        keep = torch.nonzero(sel.reshape(sel.shape[0], -1)[:, 0] != 0).flatten()
        ys = tuple(x.index_select(0, keep) for x in xs)
        return ys[0] if len(ys) == 1 else ys

    def onnx(self, ctx, node):
        if is_selector_filter(node.attrs):
            return SELECTOR_FILTER.onnx(ctx, node)
        *xs, sel = node.inputs
        flat, cond = ctx.tmp(node.name + "_sel"), ctx.tmp(node.name + "_keep")
        ctx.add_node("Reshape", [sel, ctx.const(i64([-1]))], [flat])
        ctx.add_node("Cast", [flat], [cond], to=9)  # BOOL: non-zero -> true, as Caffe's `if (sel)`
        for i, (x, out) in enumerate(zip(xs, node.outputs)):
            ctx.add_node("Compress", [x, cond], [out], name=node.name if i == 0 else None, axis=0)

    def pytorch_source(self, node, emit):
        if is_selector_filter(node.attrs):
            return SELECTOR_FILTER.pytorch_source(node, emit)
        *xs, sel = emit.inputs
        keep = emit.tmp(node.name + "_keep")
        emit.stmt(f"{keep} = torch.nonzero({sel}.reshape({sel}.shape[0], -1)[:, 0] != 0).flatten()",
                  comment="the items whose selector is non-zero")
        return [f"{x}.index_select(0, {keep})" for x in xs]
