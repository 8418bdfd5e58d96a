"""FastMask's layers (voidrank/caffe-fm 2863b2a, sliding_window_layer.cu, tile_product_layer.cu,
top_k_layer.cu; the fork has GPU forwards only, which these follow): SlidingWindow, TileProduct, TopK.

- SlidingWindow (`sliding_window_param`, an even window_h x window_w): bottom (1, C, H, W) zero-padded by
  half the window on each side, and every window at stride 1 (the stride fields are never used), row by
  row: top ((H + 1)(W + 1), C, window_h, window_w).
- TileProduct: x (N, C, H, W) times a map read as (N, 1, H, W), the same over every channel.
- TopK: bottom 0's items (N, ...), bottom 1's scores (N rows: the value when a row has one, else the
  largest of 0 and its columns 1.., the background column left out), and k = bottom 2's first dimension
  (its values are not read).  The k best-scoring items, then put back in their own order: top 0 holds
  them, top 1 (k, 1, 1, 1) their indexes.  Where scores tie at the k-th place the fork's std::sort
  decides; caffeq keeps the lower index, as std::sort does on up to 16 items.
No blobs; TRAIN and TEST compute the same.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources


def sliding_windows(x, wh: int, ww: int):
    """((H + 1)(W + 1), C, wh, ww): every wh x ww window of x (1, C, H, W) zero-padded by wh / 2 and ww / 2."""
    _, c, h, w = x.shape
    padded = F.pad(x, [ww // 2, ww // 2, wh // 2, wh // 2])
    patches = padded.unfold(2, wh, 1).unfold(3, ww, 1)          # (1, C, H + 1, W + 1, wh, ww)
    return patches[0].permute(1, 2, 0, 3, 4).reshape((h + 1) * (w + 1), c, wh, ww)


def top_k_rows(items, scores, k: int):
    """(the k items of the best scores in their own order, their indexes (k, 1, 1, 1) as floats)."""
    n = items.shape[0]
    rows = scores.reshape(scores.shape[0], -1)
    if rows.shape[1] == 1:
        score = rows[:, 0]
    else:   # the background column 0 left out, a running maximum from 0
        score = torch.clamp_min(rows[:, 1:].amax(1), 0)
    order = torch.sort(score[:n], descending=True, stable=True).indices[:k]
    kept = torch.sort(order).values
    return items.index_select(0, kept), kept.to(items.dtype).reshape(k, 1, 1, 1)


TORCH_FASTMASK = torch_sources(sliding_windows, top_k_rows)


def read_sliding_window(lp):
    """{"wh", "ww"}: sliding_window_param's window, with the fork's checks (FastMask's SlidingWindow and the
    AttentionMask forks' SlidingWindowIndex read the same message)."""
    p = lp.sliding_window_param
    if not (p.HasField("window_h") and p.HasField("window_w")):
        raise LayerError("sliding_window_param needs window_h and window_w (required fields in the fork)")
    for field, v in (("window_h", p.window_h), ("window_w", p.window_w)):
        if v <= 0 or v % 2:
            raise LayerError(f"sliding_window_param.{field} must be a positive even number, got {v}")
    for field, v in (("stride_h", p.stride_h), ("stride_w", p.stride_w)):
        if v <= 0:
            raise LayerError(f"sliding_window_param.{field} must be > 0, got {v} (the fork checks it, then "
                             f"slides by 1)")
    return {"wh": int(p.window_h), "ww": int(p.window_w)}


@register_layer("SlidingWindow")
class SlidingWindow(Layer):
    def parse(self, lp):
        need_blobs(lp, "SlidingWindow", 1, 1)
        return read_sliding_window(lp)

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "SlidingWindow")
        if n != 1:
            raise LayerError(f"SlidingWindow takes a batch of 1 (the fork checks it), got {list(in_shapes[0])}")
        return [((h + 1) * (w + 1), c, attrs["wh"], attrs["ww"])]

    def forward(self, attrs, params, x):
        return sliding_windows(x, attrs["wh"], attrs["ww"])

    def pytorch_source(self, node, emit):
        emit.uses("F")
        emit.helper(TORCH_FASTMASK)
        return f"sliding_windows({emit.inputs[0]}, {node.attrs['wh']}, {node.attrs['ww']})"

    def onnx(self, ctx, node):
        _, c, h, w = ctx.shape(node.inputs[0])
        wh, ww = node.attrs["wh"], node.attrs["ww"]
        # a constant gather from the padded map: window (oy, ox), cell (i, j) reads padded (oy + i, ox + j)
        padded_w = w + ww
        oy, ox, i, j = np.meshgrid(np.arange(h + 1), np.arange(w + 1), np.arange(wh), np.arange(ww), indexing="ij")
        index = ((oy + i) * padded_w + (ox + j)).reshape(-1).astype(np.int64)
        pads = ctx.i64([0, 0, wh // 2, ww // 2, 0, 0, wh // 2, ww // 2])
        padded = ctx.op("Pad", [node.inputs[0], pads], "padded")
        flat = ctx.op("Reshape", [padded, ctx.i64([c, -1])], "flat")
        cells = ctx.op("Gather", [flat, ctx.const(index)], "cells", axis=1)          # (C, windows * wh * ww)
        grid = ctx.op("Reshape", [cells, ctx.i64([c, (h + 1) * (w + 1), wh, ww])], "grid")
        ctx.add_node("Transpose", [grid], [node.outputs[0]], name=node.name, perm=[1, 0, 2, 3])


@register_layer("TileProduct")
class TileProduct(Layer):
    def parse(self, lp):
        need_blobs(lp, "TileProduct", 2, 1, roles="features, map")
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "TileProduct")
        m = tuple(in_shapes[1])
        if len(m) < 2 or m[1] != 1:
            raise LayerError(f"TileProduct's second bottom needs 1 channel (the fork checks shape(1) == 1), got {list(m)}")
        if math.prod(m) != n * h * w:
            raise LayerError(f"TileProduct reads its second bottom as (N, 1, H, W) = ({n}, 1, {h}, {w}); it holds "
                             f"{math.prod(m)} values {list(m)}")
        return [(n, c, h, w)]

    def forward(self, attrs, params, x, m):
        n, _, h, w = x.shape
        return x * m.reshape(n, 1, h, w)

    def pytorch_source(self, node, emit):
        n, _, h, w = emit.in_shape(0)
        return f"{emit.inputs[0]} * {emit.inputs[1]}.reshape(-1, 1, {h}, {w})"

    def onnx(self, ctx, node):
        _, _, h, w = ctx.shape(node.inputs[0])
        m = ctx.op("Reshape", [node.inputs[1], ctx.i64([-1, 1, h, w])], "map")
        ctx.add_node("Mul", [node.inputs[0], m], [node.outputs[0]], name=node.name)


@register_layer("TopK")
class TopK(Layer):
    def parse(self, lp):
        need_blobs(lp, "TopK", 3, (1, 2), roles="items, scores, k (its first dimension)")
        return {"tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        items, scores, ks = (tuple(s) for s in in_shapes)
        if not items or not scores or not ks:
            raise LayerError("TopK's bottoms need at least one axis each")
        n, k = items[0], ks[0]
        if scores[0] != n:
            raise LayerError(f"TopK: the scores have {scores[0]} rows for {n} items (the fork reads past one of them)")
        if k > n:
            raise LayerError(f"TopK keeps k = {k} (bottom 2's first dimension) of {n} items; the fork reads past "
                             f"its list there (FastMask reshapes the net to the image first, which gives more windows)")
        attrs["k"] = k
        shapes = [(k,) + items[1:]]
        return shapes + [(k, 1, 1, 1)] if attrs["tops"] == 2 else shapes

    def forward(self, attrs, params, items, scores, ks):
        picked, ids = top_k_rows(items, scores, attrs["k"])
        return (picked, ids) if attrs["tops"] == 2 else picked

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_FASTMASK)
        call = f"top_k_rows({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['k']})"
        if node.attrs["tops"] == 2:
            return [f"{call}[0]", f"{call}[1]"]
        return f"{call}[0]"

    def onnx(self, ctx, node):
        k = node.attrs["k"]
        items, scores = node.inputs[:2]
        rows = ctx.shape(scores)[0]
        table = ctx.op("Reshape", [scores, ctx.i64([rows, -1])], "rows")
        if math.prod(ctx.shape(scores)[1:]) == 1:
            score = ctx.op("Reshape", [table, ctx.i64([-1])], "score")
        else:
            rest = ctx.op("Slice", [table, ctx.i64([1]), ctx.i64([2 ** 62]), ctx.i64([1])], "classes")
            best = ctx.op("ReduceMax", [rest], "best", axes=[1], keepdims=0) if ctx.opset < 18 else \
                ctx.op("ReduceMax", [rest, ctx.i64([1])], "best", keepdims=0)
            score = ctx.op("Max", [best, ctx.f32(0.0)], "score")
        # ONNX's TopK puts the lower index first among equal values
        _, order = ctx.add_node("TopK", [score, ctx.i64([k])], [ctx.tmp(f"{node.name}_v"), ctx.tmp(f"{node.name}_o")],
                                axis=0, largest=1, sorted=1)
        kept, _ = ctx.add_node("TopK", [order, ctx.i64([k])], [ctx.tmp(f"{node.name}_kept"), ctx.tmp(f"{node.name}_p")],
                               axis=0, largest=0, sorted=1)
        ctx.add_node("Gather", [items, kept], [node.outputs[0]], name=node.name, axis=0)
        if node.attrs["tops"] == 2:
            ids = ctx.op("Cast", [kept], "ids", to=1)
            ctx.add_node("Reshape", [ids, ctx.i64([k, 1, 1, 1])], [node.outputs[1]], name=node.name + "_ids")
