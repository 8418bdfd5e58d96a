"""dsisds/caffe-SPPNet's SPATIAL_PYRAMID_POOLING (V1 files; upgraded to "SpatialPyramidPooling").

Facts from the fork (831e5d8, spatial_pyramid_pooling_layer.cpp and its float pooling_layer.cpp):
- each `spatial_bin` b is one pyramid level: a Pooling with kernel = stride = H / b and W / b
  computed in float32 (the fork's PoolingParameter kernel/stride/pad are floats), pad 0;
- the pooled count along an axis is the smallest n >= 1 with ceil(n * k) >= H (b when H >= b, fewer
  when b > H); window i covers rows [floor(i * k), min(ceil(i * k + k), H)), so windows overlap
  when k is not whole (5 rows, 2 bins: [0, 3) and [2, 5));
- MAX starts at -FLT_MAX and keeps the first strict maximum; AVE divides by the window's area;
  STOCHASTIC is NOT_IMPLEMENTED on the fork's CPU;
- the method comes from the layer's `pooling_param.pool` (default MAX), not from
  spatial_pyramid_pooling_param.pool, and `scale` is unused;
- each level is flattened (N x C*nh*nw x 1 x 1) and the levels concatenated along channels, so the
  top is N x C*sum(nh*nw) x 1 x 1; a single level skips the split and pools the whole plane, whatever
  its spatial_bin says (N x C x 1 x 1).
The fork's GPU AVE divides by the area before flooring the window start: for a fractional kernel it
differs from its CPU; caffeq follows the CPU.

The torch functions below are copied into the standalone model.py (inspect.getsource).
"""
import numpy as np
import torch
from torch import nn

from .norm import onnx_reduce
from .pooling import AVE, FLT_MAX, MAX
from .registry import Layer, LayerError, register_layer

#: caffeq's limit on one level's bins (the fork has none; b x b cells per channel)
MAX_BINS = 4096


# ---- torch: used by forward and copied into model.py ---------------------------------------

def fork_spp_windows(size: int, bins: int) -> list[list[int]]:
    """[start, end) of each window of one level along an axis of `size`, in the fork's float32
    arithmetic: k = size / bins, start_i = floor(i * k), end_i = min(ceil(i * k + k), size), and as
    many windows as it takes for an end to reach `size`."""
    kernel = torch.tensor(float(size), dtype=torch.float32) / torch.tensor(float(bins), dtype=torch.float32)
    starts = torch.arange(bins + 1, dtype=torch.float32) * kernel
    ends = torch.ceil(starts + kernel)
    count = int((ends < size).sum()) + 1  # ends grow with i: the loop stops at the first end >= size
    lows = torch.floor(starts[:count]).clamp_min(0)
    highs = ends[:count].clamp_max(size)
    return [[int(lo), int(hi)] for lo, hi in zip(lows.tolist(), highs.tolist())]


def fork_spatial_pyramid_pool(x, bins: list[int], average: bool):
    """dsisds/caffe-SPPNet's SpatialPyramidPooling: every level pooled over fork_spp_windows rows
    and columns, flattened, concatenated on channels; the top is N x C*sum(cells) x 1 x 1."""
    h, w = x.shape[2], x.shape[3]
    floor = -65504.0 if x.dtype == torch.float16 else -3.4028234663852886e38
    parts: list[torch.Tensor] = []
    for b in bins:
        rows = fork_spp_windows(h, b)
        cols = fork_spp_windows(w, b)
        if average:
            strip = torch.stack([x[:, :, r[0]:r[1], :].sum(dim=2) for r in rows], dim=2)
            cells = torch.stack([strip[:, :, :, c[0]:c[1]].sum(dim=3) for c in cols], dim=3)
            area = torch.tensor([[float((r[1] - r[0]) * (c[1] - c[0])) for c in cols] for r in rows],
                                dtype=x.dtype, device=x.device)
            cells = cells / area
        else:
            # Caffe's window starts at -FLT_MAX, so an all -inf window gives -FLT_MAX
            strip = torch.stack([x[:, :, r[0]:r[1], :].amax(dim=2) for r in rows], dim=2)
            cells = torch.stack([strip[:, :, :, c[0]:c[1]].amax(dim=3) for c in cols], dim=3)
            cells = cells.clamp_min(floor)
        parts.append(cells.flatten(1))
    return torch.cat(parts, dim=1)[:, :, None, None]


class ForkSpatialPyramidPool(nn.Module):
    """dsisds/caffe-SPPNet's SpatialPyramidPooling (see fork_spatial_pyramid_pool)."""

    def __init__(self, bins: list[int], average: bool):
        super().__init__()
        self.bins, self.average = bins, average

    def forward(self, x):
        return fork_spatial_pyramid_pool(x, self.bins, self.average)

    def extra_repr(self):
        return f"bins={self.bins}, average={self.average}"


# ---- the spec ---------------------------------------------------------------------------------

_METHODS = {MAX: "MAX", AVE: "AVE", 2: "STOCHASTIC"}


@register_layer("SpatialPyramidPooling")
class SpatialPyramidPooling(Layer):
    """dsisds/caffe-SPPNet's pyramid pooling with float kernels (module docstring)."""

    def parse(self, lp):
        p = lp.spatial_pyramid_pooling_param
        bins = [int(b) for b in p.spatial_bin]
        if not bins:
            raise LayerError("spatial_pyramid_pooling_param.spatial_bin: at least one level is required")
        for b in bins:
            if not 1 <= b <= MAX_BINS:
                raise LayerError(f"spatial_pyramid_pooling_param.spatial_bin: {b} must be in 1..{MAX_BINS}")
        pool = int(lp.pooling_param.pool)
        if pool not in (MAX, AVE):
            raise LayerError("pooling_param.pool: the fork pools with MAX or AVE (its CPU STOCHASTIC "
                             "is NOT_IMPLEMENTED)")
        if p.HasField("pool") and int(p.pool) != pool:
            raise LayerError(f"spatial_pyramid_pooling_param.pool: {_METHODS[int(p.pool)]} is ignored by the "
                             f"fork, which pools with pooling_param.pool ({_METHODS[pool]}); set both alike")
        if len(lp.top) != 1:
            raise LayerError(f"takes 1 top, got {len(lp.top)}")
        # one level: the fork pools the whole plane whatever the bin says
        return {"bins": bins if len(bins) > 1 else [1], "average": pool == AVE}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"needs a 4-axis input, got {list(s)}")
        n, c, h, w = s
        if h < 1 or w < 1:
            raise LayerError(f"needs a non-empty plane, got {list(s)}")
        cells = sum(len(fork_spp_windows(h, b)) * len(fork_spp_windows(w, b)) for b in attrs["bins"])
        return [(n, c * cells, 1, 1)]

    def forward(self, attrs, params, x):
        return fork_spatial_pyramid_pool(x, attrs["bins"], attrs["average"])

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        return n * c * h * w * len(attrs["bins"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        h, w = (int(d) for d in ctx.shape(x)[2:])
        average = node.attrs["average"]
        op = "ReduceSum" if average else "ReduceMax"
        parts = []
        for level, b in enumerate(node.attrs["bins"]):
            rows, cols = fork_spp_windows(h, b), fork_spp_windows(w, b)
            hint = f"{node.name}_level{level}"
            strip = _onnx_reduce_windows(ctx, op, x, rows, 2, hint + "_rows")
            cells = _onnx_reduce_windows(ctx, op, strip, cols, 3, hint + "_cells")
            if average:
                area = np.array([[(r[1] - r[0]) * (c[1] - c[0]) for c in cols] for r in rows], np.float32)
                cells = ctx.add_node("Div", [cells, ctx.const(area)], [ctx.tmp(hint + "_ave")])[0]
            else:
                cells = ctx.add_node("Max", [cells, ctx.const(np.array(-FLT_MAX, np.float32))],
                                     [ctx.tmp(hint + "_floor")])[0]
            parts.append(ctx.add_node("Flatten", [cells], [ctx.tmp(hint + "_flat")], axis=1)[0])
        joined = ctx.add_node("Concat", parts, [ctx.tmp(node.name + "_concat")], axis=1)[0] \
            if len(parts) > 1 else parts[0]
        ctx.add_node("Reshape", [joined, ctx.const(np.array([0, -1, 1, 1], np.int64))], [node.outputs[0]],
                     name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(ForkSpatialPyramidPool, list(a["bins"]), a["average"],
                          needs=[fork_spp_windows, fork_spatial_pyramid_pool])
        return f"{m}({emit.inputs[0]})"


def _onnx_reduce_windows(ctx, op, x, windows, axis, hint):
    """One Slice + Reduce (keepdims) per window along `axis`, concatenated on that axis."""
    pieces = []
    for i, (lo, hi) in enumerate(windows):
        cut = ctx.add_node("Slice", [x, ctx.const(np.array([lo], np.int64)), ctx.const(np.array([hi], np.int64)),
                                     ctx.const(np.array([axis], np.int64))], [ctx.tmp(f"{hint}{i}_cut")])[0]
        pieces.append(cut if hi - lo == 1 else onnx_reduce(ctx, op, cut, [axis], True, ctx.tmp(f"{hint}{i}")))
    if len(pieces) == 1:
        return pieces[0]
    return ctx.add_node("Concat", pieces, [ctx.tmp(hint)], axis=axis)[0]
