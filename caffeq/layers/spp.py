"""Spatial pyramid pooling (BVLC's SPP): level i pools into 2^i x 2^i bins on a centred grid (the last level's
windows may pad), each flattened, all concatenated; one level is global pooling.  kyu-sz/caffe (570b4e1
spp_layer.cpp; the Caffe of kyu-sz/WPAL-network) adds base_bin_h/_w, fineness_h/_w and overlap_ratio_h/_w:
base_bin * fineness^level bins a side on spp_axis_geometry's overlapping grid, and a single level keeps its
pooled map.  Every level is Caffe's Pooling (pooling.py) with CEIL rounding.
"""
import math

import numpy as np
import torch
from torch import nn

from .pooling import (
    _TORCH_MODES,
    AVE,
    CEIL,
    MAX,
    TORCH_POOL_FUNCTIONS,
    caffe_max_floor,
    caffe_max_input,
    caffe_pool,
    caffe_pool2d,
    window,
)
from .registry import Layer, LayerError, positive_field, register_layer, torch_sources


def spp_axis_geometry(size: int, bins: int, overlap: float) -> list[int]:
    """kyu-sz/caffe's [kernel, stride, pad] along one axis: the stride shortened by int(size * overlap) (a
    float32 product), then by one more while the padding would reach the kernel (0 when none is left)."""
    kernel = -(-size // bins)
    cut = int(torch.tensor(float(size), dtype=torch.float32) * overlap)
    stride = max(1, kernel - cut)
    pad = 0
    while stride > 0:
        kernel = max(stride, size - (bins - 1) * stride)
        pad = (kernel + stride * (bins - 1) - size + 1) // 2
        if pad < kernel:
            break
        stride -= 1
    return [kernel, stride, pad]


def spp_level_geometry(h: int, w: int, level: int, pyramid: tuple[int, int, int, int, float, float] | None = None):
    """(kernel, stride, pad) of SPP level `level` on an h x w map.  BVLC: 2^level bins a side, kernel =
    stride = ceil(size / bins), the padding centring the grid.  pyramid = (base_bin_h, base_bin_w,
    fineness_h, fineness_w, overlap_ratio_h, overlap_ratio_w): kyu-sz/caffe's (WPAL-network) bins,
    base_bin * fineness^level a side, on spp_axis_geometry's grid."""
    if pyramid is None:
        bins = 1 << level
        kh, kw = -(-h // bins), -(-w // bins)
        return [kh, kw], [kh, kw], [(kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2]
    base_h, base_w, fine_h, fine_w, over_h, over_w = pyramid
    gh = spp_axis_geometry(h, int(fine_h ** level) * base_h, over_h)
    gw = spp_axis_geometry(w, int(fine_w ** level) * base_w, over_w)
    return [gh[0], gw[0]], [gh[1], gw[1]], [gh[2], gw[2]]


class SpatialPyramidPool(nn.Module):
    """Caffe's SPP: each level pooled on spp_level_geometry's grid, flattened, all concatenated; one BVLC
    level is global pooling (one kyu-sz level keeps its pooled map)."""

    def __init__(self, levels: int, mode: str, pyramid: tuple[int, int, int, int, float, float] | None = None):
        super().__init__()
        self.levels, self.mode, self.pyramid = levels, mode, pyramid

    def forward(self, x):
        h, w = x.shape[2], x.shape[3]
        if self.levels == 1 and self.pyramid is None:
            if self.mode == "max":
                return caffe_max_floor(caffe_max_input(x).amax(dim=(-2, -1), keepdim=True))
            return x.sum(dim=(-2, -1), keepdim=True) / float(h * w)
        parts: list[torch.Tensor] = []
        for level in range(self.levels):
            kernel, stride, pad = spp_level_geometry(h, w, level, self.pyramid)
            parts.append(caffe_pool2d(x, self.mode, kernel, stride, pad, True))
        if self.levels == 1:
            return parts[0]
        return torch.cat([p.flatten(1) for p in parts], dim=1)


TORCH_SPP_MODULE = torch_sources(caffe_max_floor, caffe_max_input, spp_axis_geometry, spp_level_geometry, SpatialPyramidPool)


@register_layer("SPP")
class SPP(Layer):
    """Spatial pyramid pooling: level i pools into 2^i x 2^i bins, flattened and concatenated.
    kyu-sz/caffe (570b4e1, src/caffe/layers/spp_layer.cpp; the Caffe of kyu-sz/WPAL-network) adds
    base_bin_h/_w, fineness_h/_w and overlap_ratio_h/_w: set, they give spp_level_geometry's grid."""

    _PYRAMID_FIELDS = ("base_bin_h", "base_bin_w", "fineness_h", "fineness_w", "overlap_ratio_h", "overlap_ratio_w")

    def parse(self, lp):
        p = lp.spp_param
        if p.pyramid_height < 1:
            raise LayerError("spp_param.pyramid_height must be >= 1")
        if int(p.pool) not in (MAX, AVE):
            raise LayerError("SPP supports MAX and AVE pooling")
        pyramid = None
        if any(p.HasField(f) for f in self._PYRAMID_FIELDS):
            for f in self._PYRAMID_FIELDS[:4]:
                positive_field(getattr(p, f), f"spp_param.{f}")
            for f in self._PYRAMID_FIELDS[4:]:
                if not 0 <= getattr(p, f) < math.inf:   # below 0 the fork's windows grow past the map
                    raise LayerError(f"spp_param.{f} must be a finite ratio >= 0, got {getattr(p, f)}")
            pyramid = (int(p.base_bin_h), int(p.base_bin_w), int(p.fineness_h), int(p.fineness_w),
                       float(np.float32(p.overlap_ratio_h)), float(np.float32(p.overlap_ratio_w)))
        return {"height": int(p.pyramid_height), "pool": int(p.pool), "pyramid": pyramid}

    @staticmethod
    def level_attrs(attrs, level, h, w):
        kernel, stride, pad = spp_level_geometry(h, w, level, attrs.get("pyramid"))
        return {"pool": attrs["pool"], "global": False, "round_mode": CEIL,
                "kernel": tuple(kernel), "stride": tuple(stride), "pad": tuple(pad)}

    def _levels(self, attrs, h, w):
        levels = [self.level_attrs(attrs, lv, h, w) for lv in range(attrs["height"])]
        for lv, la in enumerate(levels):
            if la["stride"][0] < 1 or la["stride"][1] < 1:   # kyu-sz's CHECK_GT(stride, 0)
                raise LayerError(f"SPP level {lv}: no stride keeps the padding below the kernel on a {h}x{w} map")
            if any(p >= k for p, k in zip(la["pad"], la["kernel"])):   # the level's Pooling: CHECK_LT(pad, kernel)
                raise LayerError(f"SPP level {lv} on a {h}x{w} map pads {list(la['pad'])} with a {list(la['kernel'])} "
                                 f"kernel; Caffe's Pooling needs the padding below the kernel")
        return levels

    def infer(self, attrs, in_shapes):
        n, c, h, w = in_shapes[0]
        if attrs["height"] == 1 and attrs.get("pyramid") is None:
            return [(n, c, 1, 1)]
        outs = [window(la, h, w)[3] for la in self._levels(attrs, h, w)]
        if attrs["height"] == 1:   # kyu-sz's single level keeps its pooled map
            return [(n, c) + tuple(outs[0])]
        return [(n, c * sum(o[0] * o[1] for o in outs))]

    def forward(self, attrs, params, x):
        h, w = x.shape[-2], x.shape[-1]
        if attrs["height"] == 1 and attrs.get("pyramid") is None:
            return caffe_pool(x, {"pool": attrs["pool"], "global": True, "round_mode": CEIL,
                                  "kernel": None, "stride": (1, 1), "pad": (0, 0)})
        parts = [caffe_pool(x, la) for la in self._levels(attrs, h, w)]
        if attrs["height"] == 1:
            return parts[0]
        return torch.cat([p.flatten(1) for p in parts], dim=1)

    def onnx(self, ctx, node):
        from ..backends.onnx_pooling import emit_spp
        emit_spp(ctx, node, self)

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(TORCH_SPP_MODULE, a["height"], _TORCH_MODES[a["pool"]], a.get("pyramid"),
                          needs=[TORCH_POOL_FUNCTIONS])
        return f"{m}({emit.inputs[0]})"
