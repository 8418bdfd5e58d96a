"""flownet2's Accum (lmb-freiburg/flownet2); the fork's other layers are in optical_flow.py.

- Accum (flownet2 72664da src/caffe/layers/accum_layer.cpp/.cu; accum_param top_height, top_width,
  size_divisible_by, have_reference; OpenCV's modules/dnn/src/layers/accum_layer.cpp implements the
  type after it): the bottoms (all but the last with have_reference) concatenated along channels, each
  resampled to the top's H x W.  Top size: the last bottom's H, W (have_reference); else, with H, W the
  largest bottom height and width, ceil(H / d) d and ceil(W / d) d (float32) when size_divisible_by d
  is set, otherwise top_height, top_width, used only when both exceed H and W (else H, W).  Every
  bottom, even one already of the top's size, is sampled at x = w / (tw - 1) * (bw - 1) (float32),
  likewise y, bilinearly between floor and floor + 1: (1 - dx)(1 - dy) TL + dx dy BR + (1 - dx) dy BL
  + dx (1 - dy) TR, summed in that order in float32 (the fork's far neighbour at the last row or
  column weighs 0).  A top H or W of 1 divides 0 by 0 in the fork: refused, as is size_divisible_by 0.
  OpenCV differs: it copies same-size bottoms, resizes with its Resize layer (bilinear,
  align_corners; rounding-level differences), divides size_divisible_by in integers (so never
  enlarges), and lays out wrongly for batch > 1 (each bottom's block advances by C H W, not N C H W).
"""
import numpy as np
import torch

from .registry import AT_LEAST, Layer, LayerError, legacy_nchw, need_blobs, register_layer


def accum_axis(top: int, size: int, device=None):
    """flownet2 Accum's sampling along one axis: for each top index t, position t / (top - 1) *
    (size - 1) in float32 -> (floor index, the next index within the axis, fraction)."""
    t = torch.arange(top, dtype=torch.float32, device=device)
    pos = t / torch.full_like(t, float(top - 1)) * float(size - 1)
    lo = torch.floor(pos)
    first = lo.long()
    return first, torch.clamp(first + 1, max=size - 1), pos - lo


def accum_resize(x, th: int, tw: int):
    """One bottom (N, C, h, w) sampled bilinearly at Accum's th x tw positions, the fork's float32 sum
    (1 - dx)(1 - dy) TL + dx dy BR + (1 - dx) dy BL + dx (1 - dy) TR."""
    y0, y1, dy = accum_axis(th, x.shape[2], x.device)
    x0, x1, dx = accum_axis(tw, x.shape[3], x.device)
    dy, dx = dy[:, None], dx[None, :]
    top, bottom = x[:, :, y0], x[:, :, y1]
    return ((1 - dx) * (1 - dy) * top[..., x0] + dx * dy * bottom[..., x1]
            + (1 - dx) * dy * bottom[..., x0] + dx * (1 - dy) * top[..., x1])


def accum(bottoms: list, th: int, tw: int):
    """flownet2 Accum: the bottoms, each sampled to th x tw, concatenated along channels."""
    return torch.cat([accum_resize(b, th, tw) for b in bottoms], dim=1)


@register_layer("Accum")
class Accum(Layer):
    def parse(self, lp):
        need_blobs(lp, "Accum", range(1, AT_LEAST), 1)
        p = lp.accum_param
        ref = bool(p.have_reference)
        if ref and len(lp.bottom) < 2:
            raise LayerError("accum_param.have_reference needs at least two bottoms (the last is the reference)")
        divisor = int(p.size_divisible_by) if p.HasField("size_divisible_by") else None
        if divisor == 0:
            raise LayerError("accum_param.size_divisible_by must be >= 1 (the fork divides by it), got 0")
        return {"reference": ref, "divisor": divisor, "size": (int(p.top_height), int(p.top_width))}

    def infer(self, attrs, in_shapes):
        shapes = [legacy_nchw(s, "Accum") for s in in_shapes]
        summed = shapes[:-1] if attrs["reference"] else shapes
        n = shapes[0][0]
        if any(s[0] != n for s in summed):
            raise LayerError(f"Accum: all accumulated bottoms must have the same num, got "
                             f"{[list(s) for s in in_shapes]}")
        channels = sum(s[1] for s in summed)
        if channels < 1:
            raise LayerError("Accum: the accumulated bottoms have no channels")
        if attrs["reference"]:
            th, tw = shapes[-1][2:]
        else:
            mh, mw = max(s[2] for s in shapes), max(s[3] for s in shapes)
            if attrs["divisor"] is not None:
                d = np.float32(attrs["divisor"])
                th, tw = (int(np.ceil(np.float32(m) / d) * d) for m in (mh, mw))
            else:
                th, tw = attrs["size"]
            if not (th > mh and tw > mw):   # a custom size only when larger both ways
                th, tw = mh, mw
        if th == 1 or tw == 1:
            raise LayerError(f"Accum to {th} x {tw}: the fork divides by (top size - 1) = 0")
        return [(n, channels, th, tw)]

    def forward(self, attrs, params, *bottoms):
        th, tw = self.infer(attrs, [b.shape for b in bottoms])[0][2:]
        summed = bottoms[:-1] if attrs["reference"] else bottoms
        return accum([b.reshape(legacy_nchw(b.shape, "Accum")) for b in summed], th, tw)

    def onnx(self, ctx, node):
        th, tw = ctx.shape(node.outputs[0])[2:]
        summed = node.inputs[:-1] if node.attrs["reference"] else node.inputs
        parts = []
        for k, x in enumerate(summed):
            shape = legacy_nchw(ctx.shape(x), "Accum")
            if len(ctx.shape(x)) != 4:
                x = ctx.op("Reshape", [x, ctx.i64(list(shape))], f"b{k}_nchw")
            (y0, y1, dy), (x0, x1, dx) = (tuple(v.numpy() for v in accum_axis(t, s))
                                          for t, s in ((th, shape[2]), (tw, shape[3])))
            dy, dx = dy[:, None], dx[None, :]
            one = np.float32(1)
            # the four weights, multiplied as the fork does, then applied and summed in its order
            weights = [(one - dx) * (one - dy), dx * dy, (one - dx) * dy, dx * (one - dy)]
            rows = {"t": ctx.op("Gather", [x, ctx.i64(y0.tolist())], f"b{k}_top", axis=2),
                    "b": ctx.op("Gather", [x, ctx.i64(y1.tolist())], f"b{k}_bottom", axis=2)}
            total = None
            for j, (row, cols) in enumerate((("t", x0), ("b", x1), ("b", x0), ("t", x1))):
                sample = ctx.op("Gather", [rows[row], ctx.i64(cols.tolist())], f"b{k}_s{j}", axis=3)
                term = ctx.op("Mul", [ctx.const(weights[j].astype(np.float32), f"{node.name}_b{k}_w{j}"), sample],
                              f"b{k}_t{j}")
                total = term if total is None else ctx.op("Add", [total, term], f"b{k}_sum{j}")
            parts.append(total)
        if len(parts) == 1:
            ctx.add_node("Identity", parts, [node.outputs[0]], name=node.name)
        else:
            ctx.add_node("Concat", parts, [node.outputs[0]], name=node.name, axis=1)

    def pytorch_source(self, node, emit):
        th, tw = emit.out_shape()[2:]
        summed = emit.inputs[:-1] if node.attrs["reference"] else emit.inputs
        emit.helper(accum_axis)
        emit.helper(accum_resize)
        # bottoms of fewer axes read as (N, C, H, W) through the legacy accessors
        summed = [x if len(emit.in_shape(k)) == 4 else f"{x}.reshape({legacy_nchw(emit.in_shape(k), 'Accum')})"
                  for k, x in enumerate(summed)]
        return f"{emit.helper(accum)}([{', '.join(summed)}], {th}, {tw})"
