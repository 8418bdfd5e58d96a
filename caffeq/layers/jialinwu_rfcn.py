"""jialinwu17/caffe (29829d1; the Caffe a8039974/py-R-FCN-1's nets were written for), GPU-only layers:

- ResidualROIPooling (residual_roi_pooling_layer.cu; softroi_pooling_param output_dim M, mask_num K, both
  required and > 0): data (N, M K, H, W), channel m K + k, and a mask (N, K, H, W) give (N, M, K, 1),
  top[n, m, k] = sum over (h, w) of data[n, m K + k, h, w] * (1 + mask[n, k, h, w]), divided by H, then
  by W.  No rois, no division by the mask's sum.
- Resize with a roi_pooling_param (resize_layer.cu; one bottom): (N, C, pooled_h, pooled_w) sampled
  bilinearly at (ph H / PH - 0.5, pw W / PW - 0.5) (float32 bin sizes H / PH and W / PW), the row pair
  clamped to [1, H - 1] (hend = ceil(y - 0.5), hstart = hend - 1; u = y - hstart - 0.5), so the
  borders extrapolate linearly; spatial_scale is ignored (the fork sets it to 1).  A side of 1 would
  read outside the map: refused.

jialinwu17/box_cls_reg (be48824, its bundled caffe/ region_pooling_layer.cu), read and sized, not run:
- RegionPooling with four bottoms (features (N, NR F, H, W), seed points (M, 2), offsets (M, R S 2), weights
  (M, R, S, NR); region_pooling_param num_features F, num_regions R, num_samples S, num_rfcn_regions NR):
  top (M, R, S, F), each the weighted sum over the NR groups of one feature pixel at seed + offset, over NR.
  Its only forward is on the GPU and reads unchecked positions; its inputs come from a training Python layer
  that needs ground-truth boxes.  LocNet's two-bottom RegionPooling is region_pooling.py's.
"""
import numpy as np
import torch

from .registry import Layer, LayerError, ReadOnlyLayer, claim_layers, four_axes, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def residual_roi_pool(data, mask, groups: int, masks: int):
    """(N, M K, H, W) data and (N, K, H, W) masks -> (N, M, K, 1): the mean of data * (1 + mask)."""
    n, _, h, w = data.shape
    prod = data.reshape(n, groups, masks, h * w) * (1 + mask.reshape(n, 1, masks, h * w))
    return (prod.sum(-1, keepdim=True) / h) / w


def clamped_bilinear_taps(size: int, out: int):
    """Per output row (or column): the lower and upper source index and the upper one's float32 weight u,
    at ceil(o * size / out - 0.5) clamped to [1, size - 1], as the fork's kernel takes them."""
    f32 = torch.float32
    pos = torch.arange(out, dtype=f32) * (torch.tensor(size, dtype=f32) / torch.tensor(out, dtype=f32))
    upper = torch.clamp(torch.ceil(pos.double() - 0.5), 1, size - 1).long()
    u = pos - (upper - 1).to(f32) - 0.5
    return upper - 1, upper, u


def clamped_bilinear_resize(x, out_h: int, out_w: int):
    """x (N, C, H, W) sampled at the fork's taps: rows and columns blended by (1 - u, u), (1 - v, v)."""
    hs, he, u = (t.to(x.device) for t in clamped_bilinear_taps(x.shape[2], out_h))
    ws, we, v = (t.to(x.device) for t in clamped_bilinear_taps(x.shape[3], out_w))
    u, v = u.to(x.dtype).view(-1, 1), v.to(x.dtype)
    top, bottom = x[:, :, hs], x[:, :, he]
    return ((1 - u) * (1 - v)) * top[..., ws] + ((1 - u) * v) * top[..., we] \
        + (u * (1 - v)) * bottom[..., ws] + (u * v) * bottom[..., we]


class MaskedRoiPooling(Layer):
    """softroi_pooling_param's layers of this fork (ResidualROIPooling here, SOFTROIPooling in
    jialinwu_softroi.py): data (N, M K, H, W) and a mask (N, K, H, W) pooled into (N, M, K, 1)."""

    def parse(self, lp):
        need_blobs(lp, lp.type, 2, 1, roles="data, mask")
        p = lp.softroi_pooling_param
        groups, masks = int(p.output_dim), int(p.mask_num)
        if groups <= 0 or masks <= 0:
            raise LayerError(f"{lp.type} needs softroi_pooling_param output_dim and mask_num, both > 0, "
                             f"got {groups} and {masks}")
        return {"groups": groups, "masks": masks, "kind": lp.type}

    def infer(self, attrs, in_shapes):
        kind = attrs["kind"]
        d = four_axes(in_shapes[0], kind)
        m = four_axes(in_shapes[1], kind, "mask")
        g, k = attrs["groups"], attrs["masks"]
        if d[1] != g * k or m != (d[0], k, d[2], d[3]):
            raise LayerError(f"{kind} reads data of output_dim {g} x mask_num {k} = {g * k} channels and "
                             f"an (N, {k}, H, W) mask of the data's N, H and W; got {list(d)} and {list(m)}")
        return [(d[0], g, k, 1)]


@register_layer("ResidualROIPooling")
class ResidualROIPooling(MaskedRoiPooling):
    def forward(self, attrs, params, data, mask):
        return residual_roi_pool(data, mask, attrs["groups"], attrs["masks"])

    def onnx(self, ctx, node):
        data, mask = node.inputs
        n, _, h, w = ctx.shape(data)
        g, k = node.attrs["groups"], node.attrs["masks"]
        flat = ctx.op("Reshape", [data, ctx.i64([n, g, k, h * w])], "data")
        weight = ctx.op("Add", [ctx.op("Reshape", [mask, ctx.i64([n, 1, k, h * w])], "mask"), ctx.f32(1.0)], "weight")
        total = ctx.op("ReduceSum", [ctx.op("Mul", [flat, weight], "prod"), ctx.i64([3])], "sum", keepdims=1)
        ctx.add_node("Div", [ctx.op("Div", [total, ctx.f32(float(h))], "per_row"), ctx.f32(float(w))],
                     [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(residual_roi_pool)}({', '.join(emit.inputs)}, {a['groups']}, {a['masks']})"


@claim_layers("Resize", lambda lp: lp.HasField("roi_pooling_param") and len(lp.bottom) == 1)
class ClampedBilinearResize(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        p = lp.roi_pooling_param
        if p.pooled_h <= 0 or p.pooled_w <= 0:
            raise LayerError("jialinwu17's Resize needs roi_pooling_param pooled_h and pooled_w > 0, "
                             f"got {p.pooled_h} and {p.pooled_w}")
        return {"out": (int(p.pooled_h), int(p.pooled_w))}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Resize")
        if h < 2 or w < 2:
            raise LayerError(f"jialinwu17's Resize blends two rows and two columns; a {h}x{w} map would make the "
                             "fork read outside it")
        return [(n, c) + attrs["out"]]

    def forward(self, attrs, params, x):
        return clamped_bilinear_resize(x, *attrs["out"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        _, _, h, w = ctx.shape(x)
        (hs, he, u), (ws, we, v) = ([t.numpy() for t in clamped_bilinear_taps(h, node.attrs["out"][0])],
                                    [t.numpy() for t in clamped_bilinear_taps(w, node.attrs["out"][1])])
        rows = {k: ctx.op("Gather", [x, ctx.i64(t)], f"rows_{k}", axis=2) for k, t in (("top", hs), ("bottom", he))}
        u, v = u.reshape(-1, 1), v
        terms = []
        for (rk, ck), wt in ((("top", "s"), (1 - u) * (1 - v)), (("top", "e"), (1 - u) * v),
                             (("bottom", "s"), u * (1 - v)), (("bottom", "e"), u * v)):
            cols = ctx.op("Gather", [rows[rk], ctx.i64(ws if ck == "s" else we)], f"{rk}_{ck}", axis=3)
            terms.append(ctx.op("Mul", [cols, ctx.f32(wt.astype(np.float32))], f"{rk}_{ck}_w"))
        ctx.add_node("Sum", terms, [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(clamped_bilinear_taps)
        oh, ow = node.attrs["out"]
        return f"{emit.helper(clamped_bilinear_resize)}({emit.inputs[0]}, {oh}, {ow})"


@claim_layers("RegionPooling", lambda lp: len(lp.bottom) == 4)
class SeedRegionPooling(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "RegionPooling (box_cls_reg's: features, seed points, offsets, weights)", 4, 1)
        p = lp.region_pooling_param
        sizes = {k: int(getattr(p, k)) for k in ("num_features", "num_regions", "num_samples", "num_rfcn_regions")}
        for k, v in sizes.items():
            if v < 1:
                raise LayerError(f"region_pooling_param.{k} must be >= 1, got {v}")
        return {"name": lp.name, "kind": "RegionPooling", **sizes}

    def infer(self, attrs, in_shapes):
        _, c, _, _ = four_axes(in_shapes[0], "RegionPooling's features")
        f, r, s, nr = (attrs[k] for k in ("num_features", "num_regions", "num_samples", "num_rfcn_regions"))
        if c != f * nr:
            raise LayerError(f"the features have {c} channels; num_features x num_rfcn_regions is {f} x {nr}")
        seeds = in_shapes[1]
        if len(seeds) != 2 or seeds[1] != 2:
            raise LayerError(f"RegionPooling's seed points (bottom 1) must be (M, 2), got {list(seeds)}")
        return [(seeds[0], r, s, f)]

    def why_not_run(self, attrs):
        return ("jialinwu17/box_cls_reg's seed-point pooling, a GPU-only training layer whose positions come from a "
                "ground-truth Python layer and are read unchecked: caffeq reads and sizes it but does not run it")
