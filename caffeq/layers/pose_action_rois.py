"""zimenglan-sysu-512/pose_action_caffe's action (R*CNN) and zhu.face layers (caffe/src/caffe/layers/*,
commit d397a23; caffe.proto last changed in 0694ddd; fields in proto/README.md).

- CrossBlobsSum (cross_blobs_sum_layer.cpp/.cu): the element-wise sum of its bottoms, which must all
  have one shape.
- ExtractPrimary (extract_primary_layer.cpp/.cu): the batch holds, per image, one primary region
  followed by its secondary regions; with extract_primary_param.ims_per_batch = I the tops are the
  I primary rows and the others, in order.  When N == I the fork shapes the second top (1, C, H, W)
  to let the net set up, and its forward then fails its size check: read, not run.  With a second
  bottom I = N / (bottom[1]'s first value + 1), a value the file cannot tell: --input-shape gives
  the tops.
- SecondaryRegionsOpScores (secondary_regions_op_scores_layer.cpp/.cu): the N rows fall into
  N / R groups of R secondary regions (R = n_secondary_regions, or bottom[1]'s first value, its
  item count when that is 0, less one with has_scene_branch); per group MAX (first maximum; tops
  1 and 2: the winning row and its flat offset in the bottom), SUM or AVE (the sum times float(1/R)).
- CropPatchFromMaxFeaturePosition and ResizeWithMap (zhu.face): read and sized, not run: where
  they crop or resample comes from util_coords' GetMapBetweenFeatureMap, which walks the net from
  bottom[1] and bottom[0] back to their common blob composing each layer's coord_map (and, past a
  CropPatch layer, the crop offsets of the current batch); caffeq does not walk the net that way.
"""
import numpy as np
import torch

from ..errors import ExportError
from .registry import (
    AT_LEAST,
    Layer,
    LayerError,
    MissingInputShape,
    ReadOnlyLayer,
    legacy_nchw,
    need_blobs,
    register_layer,
)

_NOT_WALKED = ("its crop / resampling map comes from util_coords' GetMapBetweenFeatureMap, a walk of "
               "the net's coord_maps (and the previous crop layer's per-batch offsets) from bottom[0] "
               "and bottom[1] to their common blob; caffeq does not reproduce that walk")


# ---- torch functions (model.py copies them) -------------------------------------------------

def cross_blobs_sum(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


def extract_primary(x, ims_per_batch):
    """Row 0 of each image's group is its primary region, the rest its secondary regions."""
    n = x.shape[0]
    g = x.reshape(ims_per_batch, n // ims_per_batch, *x.shape[1:])
    return g[:, 0], g[:, 1:].reshape(n - ims_per_batch, *x.shape[1:])


def secondary_regions_count(x, blob, fixed, scene):
    """R: `fixed` (> 0) or the blob's first value (its item count when 0), less one with the scene branch."""
    if fixed > 0:
        r = fixed
    else:
        r = int(blob.reshape(-1)[0].item())
        r = r if r != 0 else blob.shape[0]
    r = r - 1 if scene else r
    if r <= 0 or x.shape[0] % r:
        raise ValueError(f"SecondaryRegionsOpScores: {x.shape[0]} rows do not split into groups of {r} "
                         f"secondary regions")
    return r


def secondary_regions_op(x, r, op):
    """op 0 MAX (value, winning row, flat offset), 1 SUM, 2 AVE over groups of r rows."""
    n = x.shape[0]
    g = x.reshape(n // r, r, -1)
    shape = (n // r,) + tuple(x.shape[1:])
    if op == 1:
        return g.sum(1).reshape(shape), None, None
    if op == 2:
        return (g.sum(1) * (torch.ones((), dtype=torch.float32) / r).to(x.dtype)).reshape(shape), None, None
    best = g.max(1).values
    pos = torch.arange(r, device=x.device).view(1, r, 1).expand_as(g)
    first = torch.where(g == best.unsqueeze(1), pos, torch.full_like(pos, r)).min(1).values
    row = first + torch.arange(n // r, device=x.device).view(-1, 1) * r
    offset = row * g.shape[2] + torch.arange(g.shape[2], device=x.device).view(1, -1)
    return best.reshape(shape), row.to(x.dtype).reshape(shape), offset.to(x.dtype).reshape(shape)


# ---- CrossBlobsSum ----------------------------------------------------------------------------

@register_layer("CrossBlobsSum")
class CrossBlobsSum(Layer):
    def parse(self, lp):
        need_blobs(lp, "CrossBlobsSum", range(1, AT_LEAST), 1)
        return {}

    def infer(self, attrs, in_shapes):
        s = tuple(legacy_nchw(in_shapes[0], "CrossBlobsSum"))
        for o in in_shapes[1:]:
            if tuple(legacy_nchw(o, "CrossBlobsSum")) != s:
                raise LayerError(f"CrossBlobsSum's bottoms must share one shape, got "
                                 f"{[list(t) for t in in_shapes]}")
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, *xs):
        return cross_blobs_sum(*xs)

    def onnx(self, ctx, node):
        ctx.add_node("Sum", list(node.inputs), [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(cross_blobs_sum)}({', '.join(emit.inputs)})"


# ---- ExtractPrimary ---------------------------------------------------------------------------

@register_layer("ExtractPrimary")
class ExtractPrimary(Layer):
    data_dependent_shape = True   # with a second bottom
    shape_from_user = True

    def parse(self, lp):
        need_blobs(lp, "ExtractPrimary", (1, 2), 2, roles="regions[, secondary-region count]")
        ipb = None
        if len(lp.bottom) == 1:
            p = lp.extract_primary_param
            if not lp.HasField("extract_primary_param") or not p.HasField("ims_per_batch") or p.ims_per_batch <= 0:
                raise LayerError("ExtractPrimary with one bottom needs extract_primary_param.ims_per_batch > 0")
            ipb = int(p.ims_per_batch)
        return {"name": lp.name, "ipb": ipb, "tops": list(lp.top)}

    def infer(self, attrs, in_shapes):
        s = tuple(legacy_nchw(in_shapes[0], "ExtractPrimary"))
        ipb = attrs["ipb"]
        if ipb is None:
            raise MissingInputShape(f"how many rows are primary comes from the values of the second bottom "
                                    f"(N / (its first value + 1)); give the tops with --input-shape "
                                    f"{attrs['tops'][0]}=I,{','.join(map(str, s[1:]))} and "
                                    f"{attrs['tops'][1]}=...")
        if ipb > s[0] or s[0] % ipb:
            raise LayerError(f"extract_primary_param.ims_per_batch {ipb} must divide the {s[0]} rows")
        return [(ipb,) + s[1:], (max(1, s[0] - ipb),) + s[1:]]

    def top_shapes(self, attrs, given):
        return None

    def cannot_run(self, attrs, in_shapes):
        if attrs["ipb"] is None:
            return "the primary rows come from the values of the second bottom; caffeq runs the " \
                   "extract_primary_param.ims_per_batch form only"
        if in_shapes[0][0] == attrs["ipb"]:
            return (f"with {attrs['ipb']} rows for ims_per_batch {attrs['ipb']} there are no secondary "
                    f"regions; the fork's forward fails its size check")
        return None

    def forward(self, attrs, params, x, count=None):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)], LayerError, "ExtractPrimary")
        return extract_primary(x, attrs["ipb"])

    def onnx(self, ctx, node):
        shape = ctx.shape(node.inputs[0])
        self.refuse_if_cannot_run(node.name, node.attrs, [shape], ExportError, "ExtractPrimary")
        ipb, n, rest = node.attrs["ipb"], shape[0], list(shape[1:])
        i64 = lambda *v: ctx.const(np.array(v, np.int64))   # noqa: E731
        g = ctx.add_node("Reshape", [node.inputs[0], i64(ipb, n // ipb, -1)], ctx.tmp("groups"))
        first = ctx.add_node("Slice", [g, i64(0), i64(1), i64(1)], ctx.tmp("primary"))
        others = ctx.add_node("Slice", [g, i64(1), i64(n // ipb), i64(1)], ctx.tmp("secondary"))
        ctx.add_node("Reshape", [first, i64(ipb, *rest)], [node.outputs[0]], name=node.name)
        ctx.add_node("Reshape", [others, i64(n - ipb, *rest)], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError, "ExtractPrimary")
        call = f"{emit.helper(extract_primary)}({emit.inputs[0]}, {node.attrs['ipb']})"
        return [f"{call}[0]", f"{call}[1]"]


# ---- SecondaryRegionsOpScores -----------------------------------------------------------------

@register_layer("SecondaryRegionsOpScores")
class SecondaryRegionsOpScores(Layer):
    data_dependent_shape = True   # with a second bottom
    shape_from_user = True
    onnx_refusal = "the group size R is a value of the second bottom (or the MAX indices), not a fixed shape"

    def parse(self, lp):
        need_blobs(lp, "SecondaryRegionsOpScores", (1, 2), (1, 2, 3), roles="scores[, secondary-region count]")
        if not lp.HasField("secondary_regions_op_scores_param"):
            raise LayerError("SecondaryRegionsOpScores needs secondary_regions_op_scores_param")
        p = lp.secondary_regions_op_scores_param
        fixed = 0
        if len(lp.bottom) == 1:
            if not p.HasField("n_secondary_regions") or p.n_secondary_regions <= 0:
                raise LayerError("SecondaryRegionsOpScores with one bottom needs "
                                 "secondary_regions_op_scores_param.n_secondary_regions > 0")
            fixed = int(p.n_secondary_regions)
        op = int(p.op_scores)
        if op != 0 and len(lp.top) > 1:
            raise LayerError("SecondaryRegionsOpScores' second and third tops (indices) exist for op_scores: MAX only")
        return {"name": lp.name, "fixed": fixed, "scene": bool(p.has_scene_branch), "op": op,
                "tops": list(lp.top)}

    def infer(self, attrs, in_shapes):
        s = tuple(legacy_nchw(in_shapes[0], "SecondaryRegionsOpScores"))
        if not attrs["fixed"]:
            raise MissingInputShape(f"the group size is the second bottom's first value; give the tops "
                                    f"with --input-shape {attrs['tops'][0]}=N/R,{','.join(map(str, s[1:]))}")
        r = attrs["fixed"] - (1 if attrs["scene"] else 0)
        if r <= 0 or r > s[0] or s[0] % r:
            raise LayerError(f"{s[0]} rows do not split into groups of {r} secondary regions")
        return [(s[0] // r,) + s[1:]] * len(attrs["tops"])

    def top_shapes(self, attrs, given):
        return None

    def forward(self, attrs, params, x, count=None):
        try:
            r = secondary_regions_count(x, count, attrs["fixed"], attrs["scene"])
        except ValueError as e:
            raise LayerError(f"layer '{attrs['name']}': {e}") from None
        out = secondary_regions_op(x, r, attrs["op"])
        return out[0] if len(attrs["tops"]) == 1 else out[:len(attrs["tops"])]

    def pytorch_source(self, node, emit):
        count = emit.inputs[1] if len(emit.inputs) == 2 else "None"
        r = (f"{emit.helper(secondary_regions_count)}({emit.inputs[0]}, {count}, {node.attrs['fixed']}, "
             f"{node.attrs['scene']})")
        call = f"{emit.helper(secondary_regions_op)}({emit.inputs[0]}, {r}, {node.attrs['op']})"
        k = len(node.attrs["tops"])
        return f"{call}[0]" if k == 1 else [f"{call}[{i}]" for i in range(k)]


# ---- zhu.face: CropPatchFromMaxFeaturePosition, ResizeWithMap (read only) -----------------------

def _check_like_first(in_shapes, what):
    s0 = legacy_nchw(in_shapes[0], what)
    if legacy_nchw(in_shapes[1], what)[0] != s0[0]:
        raise LayerError(f"{what}: bottom[1] has {in_shapes[1][0]} items, bottom[0] {s0[0]}")
    for i, s in enumerate(in_shapes[2:], 2):
        t = legacy_nchw(s, what)
        if t[0] != s0[0] or t[2:] != s0[2:]:
            raise LayerError(f"{what}: bottom[{i}] {list(s)} must have bottom[0]'s N, H and W {list(s0)}")
    return s0


@register_layer("CropPatchFromMaxFeaturePosition")
class CropPatchFromMaxFeaturePosition(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "CropPatchFromMaxFeaturePosition", range(3, AT_LEAST), None,
                   roles="reference map, score maps, maps to crop...")
        if len(lp.top) != len(lp.bottom) - 2:
            raise LayerError(f"CropPatchFromMaxFeaturePosition has one top per bottom after the second: "
                             f"{len(lp.bottom) - 2}, got {len(lp.top)}")
        if not lp.HasField("crop_patch_from_max_feature_position_param"):
            raise LayerError("CropPatchFromMaxFeaturePosition needs crop_patch_from_max_feature_position_param "
                             "(the fork CHECKs it is present, even for the default crop_factor)")
        p = lp.crop_patch_from_max_feature_position_param
        match = [i < len(p.match_channel) and bool(p.match_channel[i]) for i in range(len(lp.top))]
        return {"name": lp.name, "factor": float(p.crop_factor), "match": match}

    def why_not_run(self, attrs):
        return _NOT_WALKED

    def infer(self, attrs, in_shapes):
        s0 = _check_like_first(in_shapes, "CropPatchFromMaxFeaturePosition")
        c1 = legacy_nchw(in_shapes[1], "CropPatchFromMaxFeaturePosition")[1]
        f = np.float32(attrs["factor"])
        h, w = max(1, int(np.floor(np.float32(s0[2]) * f))), max(1, int(np.floor(np.float32(s0[3]) * f)))
        tops = []
        for i, s in enumerate(in_shapes[2:]):
            c = s[1]
            if attrs["match"][i] and c != c1:
                raise LayerError(f"match_channel: bottom[{i + 2}] has {c} channels, bottom[1] {c1}")
            tops.append((s0[0], c if attrs["match"][i] else c * c1, h, w))
        return tops


@register_layer("ResizeWithMap")
class ResizeWithMap(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "ResizeWithMap", range(3, AT_LEAST), None, roles="source map, target map, maps to resize...")
        if len(lp.top) != len(lp.bottom) - 2:
            raise LayerError(f"ResizeWithMap has one top per bottom after the second: {len(lp.bottom) - 2}, "
                             f"got {len(lp.top)}")
        return {"name": lp.name}

    def why_not_run(self, attrs):
        return _NOT_WALKED

    def infer(self, attrs, in_shapes):
        _check_like_first(in_shapes, "ResizeWithMap")
        s1 = legacy_nchw(in_shapes[1], "ResizeWithMap")
        return [(s[0], s[1], s1[2], s1[3]) for s in in_shapes[2:]]
