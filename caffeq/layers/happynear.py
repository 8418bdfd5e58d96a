"""happynear/caffe-windows (967eedf) layers used by NormFace and AM-Softmax nets.

- Normalize with `normalize_param` (registered by SSD's Normalize spec, which hands a layer
  over here when it carries that message; see `normalize_fork`): per (n, h, w),
  norm = sqrt(sum_c x^2 + 1e-6) ("L2") or sum_c |x| + 1e-6 ("L1"), y = x / norm; no blobs;
  an optional second top is the norm, (N, 1, H, W).  The fork reads num/channels/height/width,
  so the tops are 4-axis even for a (N, C) bottom (normalize_layer.cpp:24-35).
- InnerProduct `normalize: true` (conv.py): each weight row scaled to unit L2 first (`unit_rows`).
- Flip: mirrors W (flip_width, default) and/or H (flip_height).
- ChannelScale: y[n, c, s] = x[n, c, s] * scale[n, s] (2 bottoms), or x times one clamped blob
  value (global_scale).
- InnerDistance: top[m, n] = sum_k (x[m, k] - w[n, k])^2 ("L2", not square-rooted) or
  sum_k |x - w| ("L1"); weight from a blob or from bottom[1]; no bias.

- Gram (happynear/caffe-windows 9302198 gram_layer.cpp; DeepVisualization's NeuralArt style nets): each
  item's channels as rows of X (C x H W), top (N, C, C, 1) = X X^T times (1 / (float) H W) / (float) C.

The eps values are the fork's CPU code's (1e-6); its GPU kernels use 1e-12 for L2.

- Normalize with normalize_param.coeff is sciencefans/CaffeMex_v2's (9bab8d2 normalize_layer.cu, the GPU
  forward its MATLAB nets run; COCO loss): each item (axis 0) over all its values, y = x / (sqrt(sum of
  squares) + 1e-6) * coeff, the + 1e-6 in double (the kernel's float sum order is not reproduced: the
  last bits may differ); one top, (num, channels, height, width) as for happynear's.
"""

import numpy as np
import torch
from torch import nn

from .registry import (
    ForkReading,
    Layer,
    LayerError,
    canonical_axis,
    count,
    legacy_nchw,
    need_blobs,
    register_layer,
)

FORK_EPS = 1e-6


# ---- torch functions (model.py gets the same code) ---------------------------------------

def channel_normalize(x, legacy_shape: list[int], l1: bool, eps: float):
    """happynear's Normalize: (x / norm, norm) with norm over channels at each (n, h, w), both 4-axis."""
    x = x.reshape(legacy_shape)
    if l1:
        norm = x.abs().sum(dim=1, keepdim=True) + eps
    else:
        norm = torch.sqrt((x * x).sum(dim=1, keepdim=True) + eps)
    return x / norm, norm


def item_normalize(x, legacy_shape: list[int], coeff: float):
    """CaffeMex's Normalize: each item over all its values, x / float32(sqrt(sum of squares) + 1e-6) * coeff."""
    flat = x.reshape(x.shape[0], -1)
    norm = (torch.sqrt((flat * flat).sum(1).double()) + 1e-6).to(x.dtype)
    return (flat / norm[:, None] * coeff).reshape(legacy_shape)


def unit_rows(weight, rows: int, eps: float):
    """The weight's memory read as `rows` rows, each divided by sqrt(sum of squares + eps)."""
    w = weight.reshape(rows, -1)
    return (w / torch.sqrt((w * w).sum(dim=1, keepdim=True) + eps)).reshape(weight.shape)


def flip_hw(x, flip_height: bool, flip_width: bool):
    """happynear's Flip: reverse axis 3 (W) and/or axis 2 (H) where the input has them."""
    dims = [d for d, on in ((2, flip_height), (3, flip_width)) if on and x.dim() > d]
    return x.flip(dims) if dims else x


def channel_scale(x, scale):
    """happynear's ChannelScale: every channel of x[n, :, s] times scale's value n*S + s."""
    n, c = x.shape[0], x.shape[1]
    return (x.reshape(n, c, -1) * scale.reshape(n, 1, -1)).reshape(x.shape)


def inner_distance(x, weight, axis: int, rows: int, l1: bool):
    """happynear's InnerDistance: (..., rows) distances of x flattened from `axis` to each weight row."""
    flat = x.reshape(tuple(x.shape[:axis]) + (1, -1))
    diff = flat - weight.reshape(rows, -1)
    return diff.abs().sum(dim=-1) if l1 else (diff * diff).sum(dim=-1)


class InnerDistance(nn.Module):
    """InnerDistance with its (rows, K) weight blob (normalized to unit rows at each call when asked)."""

    def __init__(self, rows, k, axis=1, l1=False, normalize=False):
        super().__init__()
        self.rows, self.axis, self.l1, self.normalize = rows, axis, l1, normalize
        self.weight = nn.Parameter(torch.zeros(rows, k))

    def forward(self, x):
        w = unit_rows(self.weight, self.rows, 1e-6) if self.normalize else self.weight
        return inner_distance(x, w, self.axis, self.rows, self.l1)


# ---- ONNX helpers -------------------------------------------------------------------------

def _reduce(ctx, op, x, axes, out=None):
    from .norm import onnx_reduce
    return onnx_reduce(ctx, op, x, axes, True, out)


def onnx_unit_rows(ctx, w, rows, shape, name):
    """ONNX for unit_rows on the tensor `w` of static `shape`."""
    grid = ctx.add_node("Reshape", [w, ctx.const(np.array([rows, -1], np.int64))], ctx.tmp(name + "_rows"))
    ss = _reduce(ctx, "ReduceSumSquare", grid, [1])
    sse = ctx.add_node("Add", [ss, ctx.const(np.array(FORK_EPS, np.float32))], ctx.tmp(name + "_sse"))
    norm = ctx.add_node("Sqrt", [sse], ctx.tmp(name + "_norm"))
    unit = ctx.add_node("Div", [grid, norm], ctx.tmp(name + "_unit"))
    return ctx.add_node("Reshape", [unit, ctx.const(np.array(shape, np.int64))], ctx.tmp(name + "_normed"))


# ---- Normalize (happynear's) ---------------------------------------------------------------

HAPPYNEAR_MARKS = ("normalize_param", "flip_param", "channel_scale_param", "inner_distance_param")
HAPPYNEAR_TYPES = ("Flip", "ChannelScale", "InnerDistance")


def _uses_happynear(lp):
    marks = [f for f in HAPPYNEAR_MARKS if lp.HasField(f)]
    if lp.type == "InnerProduct" and lp.inner_product_param.normalize:
        marks.append("inner_product_param.normalize")
    if lp.type in HAPPYNEAR_TYPES:
        marks.append(f"type {lp.type}")
    return marks


def _pick_bare_normalize(net):
    """ForkReading rewrite: give every Normalize without a parameter message the fork the rest of
    the net is written for (happynear's marks, or SSD's norm_param); SSD when nothing tells."""
    layers = list(net.layer)
    bare = [lp for lp in layers if lp.type == "Normalize"
            and not lp.HasField("norm_param") and not lp.HasField("normalize_param")]
    happynear = sorted({m for lp in layers for m in _uses_happynear(lp)})
    ssd = any(lp.HasField("norm_param") for lp in layers)
    names = ", ".join(f"'{lp.name}'" for lp in bare)
    if happynear and ssd:
        raise LayerError(f"Normalize layer(s) {names} carry no parameter message and the net uses both SSD's "
                         f"norm_param and happynear's fields ({', '.join(happynear)}): add norm_param {{}} "
                         f"(SSD, one scale blob) or normalize_param {{}} (happynear, no blobs)")
    for lp in bare:
        (lp.normalize_param if happynear else lp.norm_param).SetInParent()
    if happynear:
        return (f"Normalize layer(s) {names} have no parameter message: read as happynear's Normalize "
                f"(no blobs) because the net uses that fork's {', '.join(happynear)}")
    return (f"Normalize layer(s) {names} have no parameter message: read as SSD's Normalize (norm_param "
            f"defaults, one scale blob); add normalize_param {{}} for happynear's (no blobs)")


def normalize_fork(lp):
    """'happynear' or 'ssd' for a Normalize layer: by its parameter message, then by what only one
    fork allows (a second top: happynear; param specs for a blob: SSD); otherwise the net decides
    (ForkReading)."""
    ssd, happy = lp.HasField("norm_param"), lp.HasField("normalize_param")
    if ssd and happy:
        raise LayerError("Normalize carries both norm_param (SSD) and normalize_param (happynear); keep one")
    if ssd or happy:
        return "ssd" if ssd else "happynear"
    if len(lp.top) == 2:
        return "happynear"
    if len(lp.param):
        return "ssd"
    raise ForkReading("Normalize without norm_param or normalize_param", _pick_bare_normalize)


class HappynearNormalize(Layer):
    """happynear's Normalize; SSD's Normalize spec (ssd/permute_normalize.py) delegates to it."""

    def parse(self, lp):
        need_blobs(lp, "Normalize (happynear)", 1, (1, 2))
        if lp.normalize_param.HasField("coeff"):   # CaffeMex_v2's
            need_blobs(lp, "Normalize (CaffeMex_v2, normalize_param.coeff)", 1, 1)
            return {"fork": "happynear", "coeff": float(np.float32(lp.normalize_param.coeff)), "tops": 1}
        kind = lp.normalize_param.normalize_type
        if kind not in ("L2", "L1"):
            raise LayerError(f"normalize_param.normalize_type must be \"L2\" or \"L1\", got {kind!r}")
        return {"fork": "happynear", "l1": kind == "L1", "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "Normalize (happynear)")
        attrs["_legacy"] = [n, c, h, w]
        return [(n, c, h, w), (n, 1, h, w)][:attrs["tops"]]

    def forward(self, attrs, params, x):
        if "coeff" in attrs:
            return item_normalize(x, attrs["_legacy"], attrs["coeff"])
        y, norm = channel_normalize(x, attrs["_legacy"], attrs["l1"], FORK_EPS)
        return (y, norm) if attrs["tops"] == 2 else y

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0])

    def onnx(self, ctx, node):
        a = node.attrs
        name = node.name
        if "coeff" in a:
            flat = ctx.op("Flatten", [node.inputs[0]], "items", name=name, axis=1)
            ss = ctx.op("Cast", [_reduce(ctx, "ReduceSumSquare", flat, [1])], "squares_double", to=11)
            norm = ctx.op("Cast", [ctx.op("Add", [ctx.op("Sqrt", [ss], "root"), ctx.const(np.array(1e-6))],
                                          "plus_eps")], "norm", to=1)
            scaled = ctx.op("Mul", [ctx.op("Div", [flat, norm], "unit"), ctx.f32(a["coeff"])], "scaled")
            ctx.add_node("Reshape", [scaled, ctx.i64(list(a["_legacy"]))], [node.outputs[0]])
            return
        x = ctx.add_node("Reshape", [node.inputs[0], ctx.const(np.array(a["_legacy"], np.int64))],
                         ctx.tmp(name + "_4d"), name=name)
        eps = ctx.const(np.array(FORK_EPS, np.float32))
        norm_out = node.outputs[1] if a["tops"] == 2 else ctx.tmp(name + "_norm")
        if a["l1"]:
            total = _reduce(ctx, "ReduceL1", x, [1])
            ctx.add_node("Add", [total, eps], [norm_out])
        else:
            ss = _reduce(ctx, "ReduceSumSquare", x, [1])
            sse = ctx.add_node("Add", [ss, eps], ctx.tmp(name + "_sse"))
            ctx.add_node("Sqrt", [sse], [norm_out])
        ctx.add_node("Div", [x, norm_out], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        if "coeff" in a:
            return f"{emit.helper(item_normalize)}({emit.inputs[0]}, {list(a['_legacy'])}, {emit.lit(a['coeff'])})"
        fn = emit.helper(channel_normalize)
        call = f"{fn}({emit.inputs[0]}, {list(a['_legacy'])}, {a['l1']}, {emit.lit(FORK_EPS)})"
        return [f"{call}[0]", f"{call}[1]"] if a["tops"] == 2 else f"{call}[0]"


HAPPYNEAR_NORMALIZE = HappynearNormalize()


# ---- Flip ------------------------------------------------------------------------------------

@register_layer("Flip")
class Flip(Layer):
    def parse(self, lp):
        need_blobs(lp, "Flip", 1, 1)
        p = lp.flip_param
        return {"flip_height": bool(p.flip_height), "flip_width": bool(p.flip_width)}

    def infer(self, attrs, in_shapes):
        legacy_nchw(in_shapes[0], "Flip")
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x):
        return flip_hw(x, attrs["flip_height"], attrs["flip_width"])

    def onnx(self, ctx, node):
        a = node.attrs
        rank = len(ctx.shape(node.inputs[0]))
        axes = [d for d, on in ((2, a["flip_height"]), (3, a["flip_width"])) if on and rank > d]
        if not axes:
            ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)
            return
        # a step of -1 from the last element to before the first reverses each axis
        big = np.iinfo(np.int64).max
        ctx.add_node("Slice", [node.inputs[0], ctx.const(np.full(len(axes), -1, np.int64)),
                               ctx.const(np.full(len(axes), -big, np.int64)),
                               ctx.const(np.array(axes, np.int64)),
                               ctx.const(np.full(len(axes), -1, np.int64))],
                     [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(flip_hw)
        return f"{fn}({emit.inputs[0]}, {a['flip_height']}, {a['flip_width']})"


# ---- ChannelScale ----------------------------------------------------------------------------

@register_layer("ChannelScale")
class ChannelScale(Layer):
    blob_names = ("global_scale",)

    def parse(self, lp):
        need_blobs(lp, "ChannelScale", 2, roles="x, scale")
        p = lp.channel_scale_param
        glob = bool(p.global_scale)
        if len(lp.top) not in ((1, 2) if glob else (1,)):
            raise LayerError(f"ChannelScale takes {'1 or 2 tops' if glob else '1 top without global_scale'}, "
                             f"got {len(lp.top)}")
        lo, hi = float(p.min_global_scale), float(p.max_global_scale)
        if glob and lo > hi:
            raise LayerError(f"channel_scale_param.min_global_scale {lo} > max_global_scale {hi}")
        return {"do_forward": bool(p.do_forward), "global_scale": glob, "min": lo, "max": hi,
                "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        x, s = in_shapes
        n, _, h, w = legacy_nchw(x, "ChannelScale")
        if not s or s[0] != n or count(s) != n * h * w:
            raise LayerError(f"ChannelScale's scale bottom {list(s)} must have num {n} and "
                             f"count {n * h * w} (x {list(x)} without its channels)")
        return [tuple(x), (1,)][:attrs["tops"]]

    def param_shapes(self, attrs, in_shapes):
        return [(1,)] if attrs["global_scale"] else None

    def init_params(self, attrs, shapes, rng):
        return [np.full((1,), -1.0, np.float32)]   # the fork's initial value (clamped at forward)

    def _scale(self, attrs, params):
        return params[0].clamp(max=attrs["max"]).clamp(min=attrs["min"])

    def forward(self, attrs, params, x, scale):
        if not attrs["do_forward"]:
            return x.clone()
        if not attrs["global_scale"]:
            return channel_scale(x, scale)
        g = self._scale(attrs, params)
        return (x * g, g) if attrs["tops"] == 2 else x * g

    def onnx(self, ctx, node):
        a = node.attrs
        x, s = node.inputs
        out = node.outputs[0]
        if not a["do_forward"]:
            ctx.add_node("Identity", [x], [out], name=node.name)
            return
        if a["global_scale"]:
            lo = ctx.add_node("Min", [ctx.weight(node, 0), ctx.const(np.array([a["max"]], np.float32))],
                              ctx.tmp(node.name + "_capped"), name=node.name)
            g = node.outputs[1] if a["tops"] == 2 else ctx.tmp(node.name + "_scale")
            ctx.add_node("Max", [lo, ctx.const(np.array([a["min"]], np.float32))], [g])
            ctx.add_node("Mul", [x, g], [out])
            return
        shape = list(ctx.shape(x))
        grid = ctx.add_node("Reshape", [x, ctx.const(np.array(shape[:2] + [-1], np.int64))],
                            ctx.tmp(node.name + "_grid"), name=node.name)
        per = ctx.add_node("Reshape", [s, ctx.const(np.array([shape[0], 1, -1], np.int64))],
                           ctx.tmp(node.name + "_per"))
        prod = ctx.add_node("Mul", [grid, per], ctx.tmp(node.name + "_prod"))
        ctx.add_node("Reshape", [prod, ctx.const(np.array(shape, np.int64))], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        x, s = emit.inputs
        if not a["do_forward"]:
            return f"{x}.clone()"
        if not a["global_scale"]:
            return f"{emit.helper(channel_scale)}({x}, {s})"
        m = emit.module("nn.Parameter(torch.zeros(1))")
        emit.param("", 0)
        g = emit.tmp("scale")
        emit.stmt(f"{g} = {m}.clamp(max={emit.lit(a['max'])}).clamp(min={emit.lit(a['min'])})")
        return [f"{x} * {g}", g] if a["tops"] == 2 else f"{x} * {g}"


# ---- InnerDistance ---------------------------------------------------------------------------

@register_layer("InnerDistance")
class InnerDistanceLayer(Layer):
    blob_names = ("weight",)
    weight_axes = {0: 0}

    def parse(self, lp):
        p = lp.inner_distance_param
        if not 1 <= len(lp.bottom) <= 3 or len(lp.top) != 1:
            raise LayerError(f"InnerDistance takes 1 to 3 bottoms and one top, got {len(lp.bottom)} "
                             f"and {len(lp.top)}")
        if p.distance_type not in ("L2", "L1"):
            raise LayerError(f"inner_distance_param.distance_type must be \"L2\" or \"L1\", "
                             f"got {p.distance_type!r}")
        if len(lp.bottom) == 1 and not p.HasField("num_output"):
            raise LayerError("inner_distance_param.num_output is required with one bottom")
        if p.update_center_only and len(lp.bottom) == 2:
            raise LayerError("inner_distance_param.update_center_only with 2 bottoms: the fork makes a "
                             "weight blob that its forward never reads; not supported")
        return {"num_output": int(p.num_output), "axis": int(p.axis), "l1": p.distance_type == "L1",
                "normalize": bool(p.normalize), "blob": len(lp.bottom) == 1}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        axis = canonical_axis(attrs["axis"], len(s), "inner_distance_param.axis")
        attrs["_axis"], attrs["_k"] = axis, count(s, axis)
        if attrs["blob"]:
            rows = attrs["num_output"]
        else:
            w = in_shapes[1]
            rows = w[0] if w else 1
            if count(w) != rows * attrs["_k"]:
                raise LayerError(f"InnerDistance's weight bottom {list(w)} must hold {rows} rows of "
                                 f"{attrs['_k']} (the input's size from axis {axis})")
        attrs["_rows"] = rows
        return [tuple(s[:axis]) + (rows,)]

    def param_shapes(self, attrs, in_shapes):
        # transpose only changes the blob's shape: the fork's forward reads it as rows either way
        self.infer(attrs, in_shapes)
        return [(attrs["_rows"], attrs["_k"])] if attrs["blob"] else None

    def forward(self, attrs, params, x, *weight):
        if attrs["blob"]:
            w = unit_rows(params[0], attrs["_rows"], FORK_EPS) if attrs["normalize"] else params[0]
        else:
            w = weight[0]
        return inner_distance(x, w, attrs["_axis"], attrs["_rows"], attrs["l1"])

    def macs(self, attrs, in_shapes, out_shapes):
        return count(in_shapes[0]) * attrs["_rows"]

    def onnx(self, ctx, node):
        a = node.attrs
        name, axis, rows = node.name, a["_axis"], a["_rows"]
        x = node.inputs[0]
        flat = ctx.add_node("Reshape", [x, ctx.const(np.array([0] * axis + [1, -1], np.int64))],
                            ctx.tmp(name + "_flat"), name=name)
        if a["blob"]:
            w = ctx.weight(node, 0)
            if a["normalize"]:
                w = onnx_unit_rows(ctx, w, rows, [rows, a["_k"]], name)
        else:
            w = ctx.add_node("Reshape", [node.inputs[1], ctx.const(np.array([rows, -1], np.int64))],
                             ctx.tmp(name + "_w"))
        diff = ctx.add_node("Sub", [flat, w], ctx.tmp(name + "_diff"))
        op = "ReduceL1" if a["l1"] else "ReduceSumSquare"
        summed = _reduce(ctx, op, diff, [axis + 1])
        ctx.add_node("Reshape", [summed, ctx.const(np.array([0] * axis + [rows], np.int64))],
                     [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(inner_distance)
        if not a["blob"]:
            return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {a['_axis']}, {a['_rows']}, {a['l1']})"
        m = emit.instance(InnerDistance, a["_rows"], a["_k"], needs=[unit_rows], axis=a["_axis"], l1=a["l1"],
                          normalize=a["normalize"])
        emit.param("weight", 0)
        return f"{m}({emit.inputs[0]})"


__all__ = ["HAPPYNEAR_NORMALIZE", "ChannelScale", "Flip", "InnerDistanceLayer", "channel_normalize",
           "channel_scale", "flip_hw", "inner_distance", "item_normalize", "normalize_fork", "onnx_unit_rows",
           "unit_rows"]


def gram_matrix(x, scale: float):
    """happynear's Gram: per item, X X^T times `scale` for X its (C, H W) channels -> (N, C, C, 1)."""
    rows = x.reshape(x.shape[0], x.shape[1], -1)
    return (torch.matmul(rows, rows.transpose(1, 2)) * scale).unsqueeze(-1)


@register_layer("Gram")
class Gram(Layer):
    bottoms = tops = 1

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "Gram")
        # the fork's alpha: 1 / (Dtype) spatial_dim / (Dtype) channel in float
        attrs["scale"] = float(np.float32(np.float32(1.0) / np.float32(h * w)) / np.float32(c))
        return [(n, c, c, 1)]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "Gram")
        return n * c * c * h * w

    def forward(self, attrs, params, x):
        return gram_matrix(x.reshape(legacy_nchw(x.shape, "Gram")), attrs["scale"])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(gram_matrix)}({emit.inputs[0]}, {emit.lit(node.attrs['scale'])})"

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        _, c, h, w = legacy_nchw(ctx.shape(x), "Gram")
        rows = ctx.add_node("Reshape", [x, ctx.const(np.array([0, c, h * w], np.int64))], [ctx.tmp(name + "_rows")],
                            name=name)[0]
        cols = ctx.op("Transpose", [rows], "cols", perm=[0, 2, 1])
        gram = ctx.op("MatMul", [rows, cols], "gram")
        scaled = ctx.op("Mul", [gram, ctx.const(np.array(node.attrs["scale"], np.float32))], "scaled")
        ctx.add_node("Reshape", [scaled, ctx.const(np.array([0, c, c, 1], np.int64))], [node.outputs[0]])
