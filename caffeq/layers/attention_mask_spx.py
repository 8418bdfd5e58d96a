"""chwilms/superpixelRefinement 37a9481's own layers of the AttentionMask family (the shared ones, and the
data-dependent shapes, are described in attention_mask.py).  Files: caffe/src/caffe/layers/check_att_layer.cpp/.cu,
sliding_window_index_seg_layer.cu, cut_layer.cu, scale_flags_layer.cu, spx_pooling_layer.cu,
att_spx_pooling_layer.cu; the fields superpixel_pooling_param (242 there) and scale_flags_param (243) in
caffe/src/caffe/proto/caffe.proto.  Cut, ScaleFlags, SlidingWindowIndexSeg and AttSpxPooling have no CPU forward
(empty or NOT_IMPLEMENTED): these follow the .cu; SpxPooling follows its .cu too (its CPU forward leaves the pixel
counts unwritten).

- CheckAtt in a net with the fork's SpxPooling, AttSpxPooling, ScaleFlags or SlidingWindowIndexSeg layers is
  the fork's (read as CheckAttSpx): copies of obj and nonObj whose first values are always 1 and 0.  ArgMaxMy
  in such a net is the fork's too (read as ArgMaxMySpx, argmax_layer_2.cpp): k is at least 5.  (AttentionMask
  and AttentionBox define none of those four types; the rewrite says so in a note.)
- SlidingWindowIndexSeg: SlidingWindowIndex with -1 outside the map.
- Cut (N, C, H, W) -> (N, C, H - 1, W - 1): cell (h, w) of channel c reads the channel's value h * H + w
  (the .cu steps rows by the height: the top-left crop where H == W; where (H - 2) H + W - 2 >= H W, i.e.
  H >= W + 2, the last channel reads past the blob: refused).
- ScaleFlags (scale_flags_param.scalefactor s; feature (., ., H, W), segmentation (., ., Hs, Ws), flags
  ((H + 1)(W + 1) in shape(3))): flag i at (i // (W + 1), i % (W + 1)) goes to (min(Hs, s r), min(Ws, s c))
  of a zero (1, 1, 1, (Hs + 1)(Ws + 1)); where several land on one place the last one is kept (the .cu races).
- SpxPooling (superpixel_pooling_param, AVE only; x (1, C, Hf, Wf), superpixel map (Hs, Ws)): top 0
  (1, 1, M + 1, C) the mean feature per superpixel id (M the map's largest value, 0 at least, truncated), map
  pixel n = (h, w) of the map read as rows of Ws reading x at (round(h f), round(w f)) (half away from zero)
  clamped to the map, f = Hf / Hs in float; top 1 (1, 1, 1, M + 1) the pixel counts.  Ids are truncated.
- AttSpxPooling (x (N, 1, H, W), per-item superpixel ids (N, 1, H, W), -1 outside; M from the third bottom's
  largest value): (N, 1, 1, M + 1): per item and id, sums from -100, then (sum + 100) / count, -100 where no
  pixel; top 1 the counts.  An id past M lands in the next item's row, as in the .cu.
Both poolings are data-dependent (M + 1 from the values; set up over zeros: 1 superpixel).  Sums run in pixel
order (the .cu adds atomically, in no fixed order).  No blobs; TRAIN and TEST compute the same.
"""
import math

import numpy as np
import torch

from ..io.schema import caffe_pb2
from .attention_mask import ArgMaxMy, CheckAtt, SlidingWindowIndex, _axes
from .registry import Layer, LayerError, need_blobs, net_rewrite, register_layer, torch_sources

#: the fork's own layer types, whose presence marks a superpixelRefinement net
SPX_TYPES = ("SpxPooling", "AttSpxPooling", "ScaleFlags", "SlidingWindowIndexSeg")


def _torch_call(fn, *args):
    """fn(*args), its ValueError (a value the fork cannot take) as a LayerError."""
    try:
        return fn(*args)
    except ValueError as e:
        raise LayerError(str(e)) from None


# ---- torch (copied into model.py) ------------------------------------------------

def am_cut(x):
    """Cut: (N, C, H - 1, W - 1), cell (h, w) of a channel reading the value h * H + w of that channel."""
    n, c, h, w = x.shape
    at = (torch.arange(h - 1, device=x.device).reshape(-1, 1) * h
          + torch.arange(w - 1, device=x.device).reshape(1, -1)).reshape(-1)
    base = (torch.arange(n * c, device=x.device) * (h * w)).reshape(-1, 1)
    return x.reshape(-1)[(base + at).reshape(-1)].reshape(n, c, h - 1, w - 1)


def am_scale_flags(flags, h: int, w: int, hs: int, ws: int, scale: int):
    """ScaleFlags: flag i at (i // (w + 1), i % (w + 1)) placed at (min(hs, scale r), min(ws, scale c)) of a
    zero (1, 1, 1, (hs + 1)(ws + 1)); the last flag that lands on a place is kept."""
    values = flags.reshape(-1)
    i = torch.arange(values.shape[0], device=flags.device)
    dest = (torch.clamp_max((i // (w + 1)) * scale, hs) * (ws + 1)
            + torch.clamp_max((i % (w + 1)) * scale, ws))
    owner = torch.full(((hs + 1) * (ws + 1),), -1, dtype=torch.int64, device=flags.device)
    owner = owner.scatter_reduce(0, dest, i, "amax")                       # the last flag landing on each place
    out = torch.where(owner >= 0, values[torch.clamp_min(owner, 0)], torch.zeros_like(owner, dtype=flags.dtype))
    return out.reshape(1, 1, 1, -1)


def am_spx_pool(x, spx):
    """SpxPooling's tops: (1, 1, M + 1, C) the mean feature per superpixel and (1, 1, 1, M + 1) the pixel counts."""
    _, c, hf, wf = x.shape
    hs, ws = spx.shape[2], spx.shape[3]
    ids = spx.reshape(-1)
    m = int(float(torch.clamp_min(ids.max(), 0)) + 1.0)
    n = torch.arange(ids.shape[0], device=x.device)
    f = torch.tensor(hf, dtype=torch.float32) / torch.tensor(hs, dtype=torch.float32)
    hy = (n // ws).to(torch.float32) * f.to(x.device)
    wx = (n % ws).to(torch.float32) * f.to(x.device)
    hy = torch.floor(hy) + (hy - torch.floor(hy) >= 0.5).to(torch.float32)     # boost::math::round, x >= 0
    wx = torch.floor(wx) + (wx - torch.floor(wx) >= 0.5).to(torch.float32)
    cell = torch.clamp(hy, 0.0, hf - 1.0) * wf + torch.clamp(wx, 0.0, wf - 1.0)
    slot = ids.to(torch.int64)
    if bool((slot < 0).any()):
        raise ValueError("SpxPooling: a negative superpixel id (the fork writes outside its top there)")
    feats = x.reshape(c, hf * wf)[:, cell.to(torch.int64)]                      # (C, pixels)
    sums = x.new_zeros((m, c)).index_add_(0, slot, feats.t())
    counts = x.new_zeros((m,)).index_add_(0, slot, torch.ones_like(ids))
    mean = torch.where(counts.reshape(-1, 1) > 0, sums / torch.clamp_min(counts, 1.0).reshape(-1, 1), sums)
    return mean.reshape(1, 1, m, c), counts.reshape(1, 1, 1, m)


def am_att_spx_pool(x, ids, largest):
    """AttSpxPooling's tops: (N, 1, 1, M + 1) per item and superpixel (sum + 100 - 100) / count, -100 where
    none, and the counts; M is the third bottom's largest value (0 at least)."""
    n = ids.shape[0]
    m = int(float(torch.clamp_min(largest.max(), 0)) + 1.0)
    flat = ids.reshape(-1)
    per_item = flat.shape[0] // n
    keep = flat >= 0
    item = torch.arange(flat.shape[0], device=x.device) // per_item
    slot = (item * m + flat.to(torch.int64))[keep]
    if slot.numel() and int(slot.max()) >= n * m:
        raise ValueError("AttSpxPooling: a superpixel id past the third bottom's largest value in the last item "
                         "(the fork writes outside its top there)")
    sums = torch.full((n * m,), -100.0, dtype=x.dtype, device=x.device)
    sums.index_add_(0, slot, x.reshape(-1)[:flat.shape[0]][keep])
    counts = x.new_zeros((n * m,)).index_add_(0, slot, torch.ones_like(flat[keep]))
    mean = torch.where(counts > 0, (sums + 100.0) / torch.clamp_min(counts, 1.0), sums)
    return mean.reshape(n, 1, 1, m), counts.reshape(n, 1, 1, m)


TORCH_SPX = torch_sources(am_cut, am_scale_flags, am_spx_pool, am_att_spx_pool)


@register_layer("CheckAttSpx")
class CheckAttSpx(CheckAtt):
    always = True
    reading_note = ("CheckAtt in a superpixelRefinement net (chwilms/superpixelRefinement 37a9481, "
                    "check_att_layer.cpp/.cu): its first obj and nonObj values are always set to 1 and 0")


@register_layer("ArgMaxMySpx")
class ArgMaxMySpx(ArgMaxMy):
    floor = 5
    reading_note = ("ArgMaxMy in a superpixelRefinement net (chwilms/superpixelRefinement 37a9481, "
                    "argmax_layer_2.cpp): k, the count of obj values above nonObj, is raised to 5 at least")


#: the fork's readings of the types it shares with AttentionMask
_SPX_READINGS = {"CheckAtt": ("CheckAttSpx", "the first obj / nonObj values always become 1 / 0"),
                 "ArgMaxMy": ("ArgMaxMySpx", "k at least 5")}


@net_rewrite
def superpixel_refinement_readings(net, source=""):
    """In a net with superpixelRefinement's own layers, CheckAtt and ArgMaxMy are that fork's (CheckAttSpx,
    ArgMaxMySpx)."""
    if not any(lp.type in SPX_TYPES for lp in net.layer):
        return []
    found = [t for t in SPX_TYPES if any(lp.type == t for lp in net.layer)]
    notes = []
    for kind, (reading, what) in _SPX_READINGS.items():
        names = [lp.name for lp in net.layer if lp.type == kind]
        for lp in net.layer:
            if lp.type == kind:
                lp.type = reading
        if names:
            where = f"{source}: " if source else ""
            notes.append(f"{where}{len(names)} {kind} layer(s) read as superpixelRefinement's "
                         f"({reading}: {what}; the net has its {', '.join(found)} layers)")
    return notes


@register_layer("SlidingWindowIndexSeg")
class SlidingWindowIndexSeg(SlidingWindowIndex):
    outside = -1.0


# ---- Cut, ScaleFlags -------------------------------------------------------------

@register_layer("Cut")
class Cut(Layer):
    def parse(self, lp):
        need_blobs(lp, "Cut", 1, 1)
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        x = _axes(in_shapes[0], 4, "Cut")
        if len(x) != 4:
            raise LayerError(f"Cut reads a 4-axis bottom (N, C, H, W), got {list(x)}")
        n, c, h, w = x
        if h < 2 or w < 2:
            raise LayerError(f"Cut takes one row and one column off; the bottom is {list(x)}")
        return [(n, c, h - 1, w - 1)]

    def cannot_run(self, attrs, in_shapes):
        n, c, h, w = in_shapes[0]
        if (h - 2) * h + (w - 2) >= h * w:
            return (f"its .cu steps rows by the height ({h}), so the last cells of the last channel read past the "
                    f"bottom ({h} x {w}: more rows than columns)")
        return None

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)], LayerError)
        return am_cut(x)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_SPX)
        return f"am_cut({emit.inputs[0]})"

    def onnx(self, ctx, node):
        n, c, h, w = ctx.shape(node.inputs[0])
        self.refuse_if_cannot_run(node.name, node.attrs, [(n, c, h, w)])
        at = (np.arange(h - 1).reshape(-1, 1) * h + np.arange(w - 1).reshape(1, -1)).reshape(-1)
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([n * c, h * w])], "planes")
        cells = ctx.op("Gather", [flat, ctx.const(at.astype(np.int64))], "cells", axis=1)
        ctx.add_node("Reshape", [cells, ctx.i64([n, c, h - 1, w - 1])], [node.outputs[0]], name=node.name)


@register_layer("ScaleFlags")
class ScaleFlags(Layer):
    def parse(self, lp):
        need_blobs(lp, "ScaleFlags", 3, 1, roles="features, segmentation, flags")
        return {"scale": int(lp.scale_flags_param.scalefactor)}

    def infer(self, attrs, in_shapes):
        f = _axes(in_shapes[0], 4, "ScaleFlags", "first bottom")
        s = _axes(in_shapes[1], 4, "ScaleFlags", "second bottom")
        g = _axes(in_shapes[2], 4, "ScaleFlags", "third bottom (the flags)")
        h, w, hs, ws = f[2], f[3], s[2], s[3]
        if g[3] != (h + 1) * (w + 1):
            raise LayerError(f"ScaleFlags: {g[3]} flags (the third bottom's shape(3)) for the ({h} + 1)({w} + 1) "
                             f"positions of the feature map (the fork checks them equal)")
        attrs["sizes"] = (h, w, hs, ws)
        return [(1, 1, 1, (hs + 1) * (ws + 1))]

    def forward(self, attrs, params, feat, seg, flags):
        return am_scale_flags(flags, *attrs["sizes"], attrs["scale"])

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_SPX)
        h, w, hs, ws = node.attrs["sizes"]
        return f"am_scale_flags({emit.inputs[2]}, {h}, {w}, {hs}, {ws}, {node.attrs['scale']})"

    def onnx(self, ctx, node):
        h, w, hs, ws = node.attrs["sizes"]
        s = node.attrs["scale"]
        total = math.prod(ctx.shape(node.inputs[2]))
        i = np.arange(total)
        dest = np.minimum((i // (w + 1)) * s, hs) * (ws + 1) + np.minimum((i % (w + 1)) * s, ws)
        last = np.zeros(total, bool)           # the last flag landing on each place (clamped rows repeat a row)
        _, from_end = np.unique(dest[::-1], return_index=True)
        last[total - 1 - from_end] = True
        flat = ctx.op("Reshape", [node.inputs[2], ctx.i64([-1])], "flags")
        picked = ctx.op("Gather", [flat, ctx.const(i[last].astype(np.int64))], "picked", axis=0)
        zeros = ctx.const(np.zeros((hs + 1) * (ws + 1), np.float32))
        out = ctx.op("ScatterElements", [zeros, ctx.const(dest[last].astype(np.int64)), picked], "placed", axis=0)
        ctx.add_node("Reshape", [out, ctx.i64([1, 1, 1, -1])], [node.outputs[0]], name=node.name)


# ---- SpxPooling, AttSpxPooling ---------------------------------------------------

def _superpixel_pool_method(lp, what):
    p = lp.superpixel_pooling_param
    if p.pool != caffe_pb2.SuperpixelPoolingParameter.AVE:
        name = caffe_pb2.SuperpixelPoolingParameter.PoolMethod.Name(p.pool)
        raise LayerError(f"{what}: superpixel_pooling_param.pool {name} is NOT_IMPLEMENTED in the fork "
                         f"(AVE only; MAX is the default)")


_SCATTER_ADD = ("sums per superpixel id need ScatterElements with reduction='add', which caffeq does not emit "
                "for this layer")


@register_layer("SpxPooling")
class SpxPooling(Layer):
    data_dependent_shape = True
    onnx_refusal = _SCATTER_ADD

    def parse(self, lp):
        need_blobs(lp, "SpxPooling", 2, 2, roles="features, superpixel map")
        _superpixel_pool_method(lp, "SpxPooling")
        return {}

    def infer(self, attrs, in_shapes):
        x = _axes(in_shapes[0], 4, "SpxPooling", "first bottom")
        s = _axes(in_shapes[1], 4, "SpxPooling", "second bottom")
        if len(x) != 4:
            raise LayerError(f"SpxPooling needs a 4-axis first bottom (the fork checks it), got {list(x)}")
        if x[0] != 1 or s[0] != 1:
            raise LayerError(f"SpxPooling takes batches of 1 (the fork checks num == 1), got {list(x)} and {list(s)}")
        return [(1, 1, 1, x[1]), (1, 1, 1, 1)]     # set up over a zero map: one superpixel

    def forward(self, attrs, params, x, spx):
        return _torch_call(am_spx_pool, x, spx)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_SPX)
        out = emit.tmp("spx")
        emit.stmt(f"{out} = am_spx_pool({emit.inputs[0]}, {emit.inputs[1]})")
        return [f"{out}[0]", f"{out}[1]"]


@register_layer("AttSpxPooling")
class AttSpxPooling(Layer):
    data_dependent_shape = True
    onnx_refusal = _SCATTER_ADD

    def parse(self, lp):
        need_blobs(lp, "AttSpxPooling", 3, 2, roles="attention, superpixel ids, superpixel map")
        _superpixel_pool_method(lp, "AttSpxPooling")
        return {}

    def infer(self, attrs, in_shapes):
        x = _axes(in_shapes[0], 2, "AttSpxPooling", "first bottom")
        s = _axes(in_shapes[1], 4, "AttSpxPooling", "second bottom")
        if len(s) != 4:
            raise LayerError(f"AttSpxPooling needs a 4-axis second bottom (the fork checks it), got {list(s)}")
        if x[0] != s[0] or x[1] != s[1] or s[1] != 1:
            raise LayerError(f"AttSpxPooling needs bottoms 0 and 1 of one num and 1 channel (the fork checks it), "
                             f"got {list(x)} and {list(s)}")
        if math.prod(x) < math.prod(s):
            raise LayerError(f"AttSpxPooling reads {math.prod(s)} values of its first bottom, which holds "
                             f"{math.prod(x)} {list(x)}")
        return [(x[0], 1, 1, 1)] * 2     # set up over a zero map: one superpixel

    def forward(self, attrs, params, x, ids, largest):
        return _torch_call(am_att_spx_pool, x, ids, largest)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_SPX)
        out = emit.tmp("att_spx")
        emit.stmt(f"{out} = am_att_spx_pool({emit.inputs[0]}, {emit.inputs[1]}, {emit.inputs[2]})")
        return [f"{out}[0]", f"{out}[1]"]
