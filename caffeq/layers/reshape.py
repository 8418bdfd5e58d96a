"""Reshape (BVLC reshape_layer.cpp; synopsys-caffe's pixelshuffler; the 2014 num/channels/height/width fields of
Simon Safar's Reshape, which mitmul/caffe's ssai nets use; Arroosh/optical_flow_prediction's patch Reshape) and
Tiling (the highway-driving fork).

Top shapes come from the runtime bottom shape in forward, with the functions `infer` uses, so a model runs
at any batch size; ONNX emission copies dim 0 (Reshape's 0) rather than writing it (shape_ops.py's helpers).
"""
import math

import torch.nn.functional as F

from .registry import Layer, LayerError, claim_layers, legacy_nchw, need_blobs, register_layer, torch_sources
from .shape_ops import onnx_reshape

# ---- Reshape ------------------------------------------------------------------

def _reshape_plan(attrs, ndim):
    """(start_axis, end_axis) of the replaced range, as ReshapeLayer::Reshape."""
    axis, num_axes = attrs["axis"], attrs["num_axes"]
    start = axis if axis >= 0 else ndim + axis + 1
    if not 0 <= start <= ndim:
        raise LayerError(f"reshape_param.axis {axis} out of range for a {ndim}-axis blob")
    end = ndim if num_axes == -1 else start + num_axes
    if end > ndim:
        raise LayerError(f"reshape_param.axis + num_axes = {end} is beyond the {ndim} axes of the bottom")
    for i in attrs["copy_axes"]:
        if start + i >= ndim:
            raise LayerError(f"reshape_param.shape has 0 at position {i}, but the bottom has no "
                             f"axis {start + i} to copy")
    return start, end


def _reshape_shape(attrs, shape, total=None):
    """Caffe's Reshape of a blob of this shape; total: the count to fit when the data comes from another
    blob than the one whose axes are kept and copied (OSLSM's ReshapeLike)."""
    shape = tuple(int(d) for d in shape)
    start, end = _reshape_plan(attrs, len(shape))
    dims = list(attrs["dims"])
    for i in attrs["copy_axes"]:
        dims[i] = shape[start + i]
    top = list(shape[:start]) + dims + list(shape[end:])
    total = math.prod(shape) if total is None else total
    inferred = attrs["inferred_axis"]
    if inferred >= 0:
        explicit = math.prod(d for j, d in enumerate(dims) if j != inferred)
        explicit *= math.prod(shape[:start]) * math.prod(shape[end:])
        if explicit == 0 or total % explicit:
            what = f"({list(shape)})" if total == math.prod(shape) else f"(the kept axes from {list(shape)})"
            raise LayerError(f"bottom count {total} {what} is not divisible by the product "
                             f"{explicit} of the other dimensions of reshape_param.shape "
                             f"{attrs['dims']}")
        top[start + inferred] = total // explicit
    if math.prod(top) != total:
        raise LayerError(f"reshape_param.shape {attrs['dims']} gives {top} ({math.prod(top)} "
                         f"elements) but the bottom {list(shape)} has {total}")
    return tuple(top)


def _legacy_reshape_shape(dims, shape):
    """The 2014 Reshape's top: (num, channels, height, width), 0 the bottom's (legacy) value, one -1 from the
    count."""
    bottom = tuple(int(d) for d in shape) + (1,) * (4 - len(shape)) if len(shape) <= 4 else None
    if bottom is None:
        raise LayerError(f"the 2014 Reshape reads num/channels/height/width, which need at most 4 axes, got {list(shape)}")
    top = [b if d == 0 else d for d, b in zip(dims, bottom)]
    if top.count(-1) > 1 or any(d < -1 for d in top):
        raise LayerError(f"reshape_param num/channels/height/width {dims}: at most one -1 and no other negatives")
    total, known = math.prod(bottom), math.prod(d for d in top if d != -1)
    if -1 in top:
        if known == 0 or total % known:
            raise LayerError(f"reshape_param {dims}: the bottom's {total} values do not fill the other dimensions")
        top[top.index(-1)] = total // known
    if math.prod(top) != total:
        raise LayerError(f"reshape_param {dims} gives {top} ({math.prod(top)} values) for a bottom of {total}")
    return tuple(top)


def _pixel_shuffle_shape(r, shape, field="reshape_param.pixelshuffler"):
    """synopsys-caffe's pixelshuffler (and the driving fork's Tiling) top: N x C/r^2 x rH x rW of a
    4-axis bottom."""
    if len(shape) != 4:
        raise LayerError(f"{field} needs a 4-axis bottom, got {list(shape)}")
    n, c, h, w = (int(d) for d in shape)
    if c % (r * r):
        raise LayerError(f"{field} {r}: the bottom's {c} channels are not a multiple of {r * r}")
    return (n, c // (r * r), h * r, w * r)


def _onnx_pixel_shuffle(ctx, node, r):
    # ONNX's channel-major (CRD) DepthToSpace is torch's pixel_shuffle and the forks' reorder
    ctx.add_node("DepthToSpace", [node.inputs[0]], [node.outputs[0]], name=node.name, blocksize=r, mode="CRD")


def _source_pixel_shuffle(emit, r):
    emit.uses("F")
    return f"F.pixel_shuffle({emit.inputs[0]}, {r})"


@register_layer("Tiling")
class Tiling(Layer):
    """The highway-driving fork's Tiling (asyncbridge/tsinghua-tencent-100k code/caffe tiling_layer.cpp):
    input channel c*t^2 + i*t + j of pixel (h, w) goes to channel c at (h*t + i, w*t + j), torch's
    pixel_shuffle."""

    bottoms = tops = 1

    def parse(self, lp):
        need_blobs(lp, "Tiling", 1, 1, in_place=False)
        t = int(lp.tiling_param.tile_dim)
        if t <= 0:
            raise LayerError(f"tiling_param.tile_dim must be positive, got {t}")
        return {"tile": t}

    def infer(self, attrs, in_shapes):
        return [_pixel_shuffle_shape(attrs["tile"], in_shapes[0], "tiling_param.tile_dim")]

    def forward(self, attrs, params, x):
        return F.pixel_shuffle(x, attrs["tile"])

    def onnx(self, ctx, node):
        _onnx_pixel_shuffle(ctx, node, node.attrs["tile"])

    def pytorch_source(self, node, emit):
        return _source_pixel_shuffle(emit, node.attrs["tile"])


@register_layer("PixelShuffle")
class PixelShuffle(Tiling):
    """ChaoFan's sub-pixel PixelShuffle (wj1tr0y/gait_extractor c30b9ad, pixel_shuffle_layer.cpp/.cu, as its
    pytorch-to-caffe conversions write it): bottom channel c*r^2 + dy*r + dx of pixel (h, w) goes to channel
    c at (h*r + dy, w*r + dx), torch's pixel_shuffle, r = pixel_shuffle_param.upscale_factor (> 1)."""

    def parse(self, lp):
        need_blobs(lp, "PixelShuffle", 1, 1, in_place=False)
        r = int(lp.pixel_shuffle_param.upscale_factor)
        if r <= 1:   # LayerSetUp's CHECK_GT
            raise LayerError(f"pixel_shuffle_param.upscale_factor must be > 1, got {r}")
        return {"tile": r}

    def infer(self, attrs, in_shapes):
        return [_pixel_shuffle_shape(attrs["tile"], in_shapes[0], "pixel_shuffle_param.upscale_factor")]


@register_layer("Rearrange")
class Rearrange(Tiling):
    """Ding-Liu/caffe-videoSR's Rearrange (fbc3241, rearrange_layer.cpp/.cu), its ESPCN nets' sub-pixel layer:
    rearrange_param.depth [1] output channels, s = sqrt(C / depth) (its LayerSetUp checks that C is a multiple
    of depth and the ratio a perfect square); channel (d*s + i)*s + j of pixel (h, w) goes to channel d at
    (h*s + i, w*s + j), torch's pixel_shuffle."""

    def parse(self, lp):
        need_blobs(lp, "Rearrange", 1, 1, in_place=False)
        depth = int(lp.rearrange_param.depth)
        if depth < 1:
            raise LayerError(f"rearrange_param.depth must be >= 1, got {depth}")
        return {"depth": depth}

    def infer(self, attrs, in_shapes):
        c, depth = int(in_shapes[0][1]) if len(in_shapes[0]) > 1 else 1, attrs["depth"]
        ratio = c // depth
        s = math.isqrt(ratio)
        if c % depth or s * s != ratio:
            raise LayerError(f"Rearrange: the bottom's {c} channels must be rearrange_param.depth {depth} times a "
                             f"perfect square (the upscaling factor squared)")
        attrs["tile"] = s
        return [_pixel_shuffle_shape(s, in_shapes[0], "rearrange_param.depth")]


def reshape_attrs(p):
    """reshape_param's shape, axis and num_axes, checked as ReshapeLayer::LayerSetUp."""
    dims = [int(d) for d in p.shape.dim]
    inferred = [i for i, d in enumerate(dims) if d == -1]
    if len(inferred) > 1:
        raise LayerError(f"reshape_param.shape {dims} has several -1 dims; at most one may be inferred")
    if any(d < -1 for d in dims):
        raise LayerError(f"reshape_param.shape {dims} has a dimension below -1")
    if p.num_axes < -1:
        raise LayerError(f"reshape_param.num_axes must be >= 0, or -1 for all; got {p.num_axes}")
    return {"dims": dims, "axis": int(p.axis), "num_axes": int(p.num_axes),
            "copy_axes": [i for i, d in enumerate(dims) if d == 0], "inferred_axis": inferred[0] if inferred else -1}


@register_layer("Reshape")
class Reshape(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type)
        notes = []
        if lp.top and lp.bottom and lp.top[0] == lp.bottom[0]:
            # BVLC's LayerSetUp check came in 2015; forks from before it (ECO's caffe_3d) reshape in place
            notes.append("reshapes in place, which BVLC Caffe 1.0 refuses and older Caffe forks (ECO's "
                         "caffe_3d) accept: the blob takes the new shape")
        p = lp.reshape_param
        legacy = [p.HasField(f) for f in ("num", "channels", "height", "width")]
        if any(legacy):
            if p.HasField("shape"):
                raise LayerError("reshape_param: give shape, or the 2014 num/channels/height/width, not both")
            return {"legacy_dims": [int(p.num), int(p.channels), int(p.height), int(p.width)],
                    "reading_notes": notes}
        shuffle = int(getattr(p, "pixelshuffler", 1))
        if shuffle < 1:
            raise LayerError(f"reshape_param.pixelshuffler must be >= 1, got {shuffle}")
        return {"pixelshuffler": shuffle, "reading_notes": notes, **reshape_attrs(p)}

    def infer(self, attrs, in_shapes):
        if attrs.get("legacy_dims"):
            return [_legacy_reshape_shape(attrs["legacy_dims"], in_shapes[0])]
        if attrs.get("pixelshuffler", 1) > 1:
            return [_pixel_shuffle_shape(attrs["pixelshuffler"], in_shapes[0])]
        return [_reshape_shape(attrs, in_shapes[0])]

    def forward(self, attrs, params, x):
        if attrs.get("legacy_dims"):
            return x.reshape(_legacy_reshape_shape(attrs["legacy_dims"], tuple(x.shape)))
        if attrs.get("pixelshuffler", 1) > 1:
            # the fork's loop sends channel c*r^2 + i*r + j of (h, w) to channel c at (h*r + i, w*r + j)
            return F.pixel_shuffle(x, attrs["pixelshuffler"])
        return x.reshape(_reshape_shape(attrs, tuple(x.shape)))

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        if a.get("legacy_dims"):
            top = _legacy_reshape_shape(a["legacy_dims"], ctx.shape(x))
            # a copied num follows the run's batch; the rest are the sizes the net was read with
            spec = [0 if a["legacy_dims"][0] == 0 and len(ctx.shape(x)) > 0 else top[0]] + list(top[1:])
            onnx_reshape(ctx, x, spec, node.outputs[0], name=node.name)
            return
        if a.get("pixelshuffler", 1) > 1:
            _onnx_pixel_shuffle(ctx, node, a["pixelshuffler"])
            return
        shape = tuple(ctx.shape(x))
        ndim = len(shape)
        start, end = _reshape_plan(a, ndim)
        _reshape_shape(a, shape)  # same checks as infer
        # where each output axis comes from: ("in", input axis) for copied axes, else its spec value
        src = [("in", i) for i in range(start)]
        src += [("in", start + j) if d == 0 else ("val", d) for j, d in enumerate(a["dims"])]
        src += [("in", i) for i in range(end, ndim)]
        spec = []
        needs_batch = False
        for o, (kind, v) in enumerate(src):
            if kind == "val":
                spec.append(v)             # a constant, or -1 (ONNX infers it the same way)
            elif v == o:
                spec.append(0)             # same index in input and output: ONNX's copy
            elif v != 0:
                spec.append(int(shape[v]))  # a non-batch axis moved to another index: static
            else:
                spec.append(("dim", 0))    # the batch axis moved: take it at run time
                needs_batch = True
        if needs_batch and -1 not in spec:
            # the only run-time dim can be inferred from the count instead
            spec = [-1 if isinstance(v, tuple) else v for v in spec]
        # (in a computed shape, 0 still means "copy the input axis of the same index")
        onnx_reshape(ctx, x, spec, node.outputs[0], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        if a.get("legacy_dims"):
            top = _legacy_reshape_shape(a["legacy_dims"], emit.in_shape(0))
            first = f"{x}.shape[0]" if a["legacy_dims"][0] == 0 else str(top[0])
            return f"{x}.reshape([{', '.join([first] + [str(d) for d in top[1:]])}])"
        if a.get("pixelshuffler", 1) > 1:
            return _source_pixel_shuffle(emit, a["pixelshuffler"])
        ndim = len(emit.in_shape(0))
        start, end = _reshape_plan(a, ndim)
        # axes Caffe copies (outside [start, end), and 0 in the spec) come from x at run time
        dims = [f"{x}.shape[{i}]" for i in range(start)]
        dims += [f"{x}.shape[{start + j}]" if d == 0 else str(d) for j, d in enumerate(a["dims"])]
        dims += [f"{x}.shape[{i}]" for i in range(end, ndim)]
        return f"{x}.reshape([{', '.join(dims)}])"


# ---- Arroosh/optical_flow_prediction's patch Reshape ----------------------------------------

_PATCH_FIELDS = ("new_channel", "new_height", "new_width", "new_patch_width", "new_patch_height")


def spread_patches(x, channels: int, patch_h: int, patch_w: int):
    """The fork's Reshape (reshape_layer.cpp 00ba80e): input channel (nw * ph + nh) * C' + nc at (h, w) goes to
    channel nc at (h * ph + nh, w * pw + nw) -- the patch's width index outermost, "because matlab"."""
    n, _, h, w = x.shape
    grid = x.reshape(n, patch_w, patch_h, channels, h, w)
    return grid.permute(0, 3, 4, 2, 5, 1).reshape(n, channels, h * patch_h, w * patch_w)


@claim_layers("Reshape", lambda lp: any(lp.reshape_param.HasField(f) for f in _PATCH_FIELDS))
class PatchReshape(Layer):
    types = ("Reshape",)

    def parse(self, lp):
        need_blobs(lp, "Reshape (reshape_param new_channel / new_patch_*)", 1, 1, in_place=False)
        p = lp.reshape_param
        other = [f for f in ("shape", "num", "channels", "height", "width", "pixelshuffler") if p.HasField(f)]
        if other:
            raise LayerError(f"reshape_param: Arroosh's new_channel / new_patch_* do not combine with {other[0]}")
        values = {f: int(getattr(p, f)) for f in _PATCH_FIELDS}
        if min(values.values()) < 1:
            raise LayerError(f"reshape_param: new_channel, new_height, new_width, new_patch_width and "
                             f"new_patch_height must all be >= 1, got {list(values.values())}")
        return values

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "Arroosh's Reshape")
        a = attrs
        if a["new_patch_width"] * a["new_patch_height"] * a["new_channel"] != c:
            raise LayerError(f"reshape_param: new_patch_width x new_patch_height x new_channel = "
                             f"{a['new_patch_width'] * a['new_patch_height'] * a['new_channel']} must be the "
                             f"bottom's {c} channels (the fork's CHECK)")
        if (a["new_height"], a["new_width"]) != (h * a["new_patch_height"], w * a["new_patch_width"]):
            raise LayerError(f"reshape_param: new_height x new_width {a['new_height']} x {a['new_width']} must be "
                             f"the bottom's {h} x {w} times the patch (the fork writes overlapping or stray "
                             f"patches otherwise)")
        return [(n, a["new_channel"], a["new_height"], a["new_width"])]

    def _args(self, attrs):
        return attrs["new_channel"], attrs["new_patch_height"], attrs["new_patch_width"]

    def forward(self, attrs, params, x):
        return spread_patches(x.reshape(legacy_nchw(tuple(x.shape), "Arroosh's Reshape")), *self._args(attrs))

    def onnx(self, ctx, node):
        _, _, h, w = legacy_nchw(ctx.shape(node.inputs[0]), "Arroosh's Reshape")
        c, ph, pw = self._args(node.attrs)
        # 0 copies the run's batch (axis 0 keeps its place in both reshapes)
        grid = ctx.op("Reshape", [node.inputs[0], ctx.i64([0, pw, ph, c, h, w])], "grid", name=node.name)
        moved = ctx.op("Transpose", [grid], "moved", perm=[0, 3, 4, 2, 5, 1])
        ctx.add_node("Reshape", [moved, ctx.i64([0, c, h * ph, w * pw])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        _, c, h, w = legacy_nchw(emit.in_shape(0), "Arroosh's Reshape")
        x = emit.inputs[0]
        args = ", ".join(str(v) for v in self._args(node.attrs))
        return f"{emit.helper(TORCH_SPREAD)}({x}.reshape({x}.shape[0], {c}, {h}, {w}), {args})"


TORCH_SPREAD = torch_sources(spread_patches)
