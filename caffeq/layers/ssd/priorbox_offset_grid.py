"""julimueller/tl_ssd's PriorBox (prior_box_layer.cpp, be5ae7f): priors on a grid of centre offsets
inside each cell, for small traffic lights.

prior_box_param offset_w and offset_h (repeated, in [0, 1]) replace SSD's single `offset`; the
aspect ratios are only those listed (with flip their inverses), with no implicit 1, and a ratio
of 1 is skipped when writing (it would leave its slots unwritten, so it is refused here);
max_size must match min_size in count and is then ignored.  Per cell (row-major), per offset_w,
per offset_h, per min_size (truncated to int), per ratio: centre x = (w + offset_w) * step_w and
y = (h + offset_h) * step_h in float32, box min_size * sqrt(ratio) wide and min_size / sqrt(ratio)
high (double, stored as float), corners normalized by the image size (double, stored as float),
clipped to [0, 1] with `clip`; then the variances (1 value, or 4 per prior).
"""
import math

import numpy as np
import torch
from torch import nn

from ..registry import LayerError, torch_sources
from .common import emit_prior_helpers, prior_output, prior_run_sizes, prior_steps


def offset_grid_priors(sizes: list[list[float]], offsets_w: list[float], offsets_h: list[float],
                       variance: list[float], lh: int, lw: int, ih: int, iw: int, step_h: float, step_w: float,
                       clip: bool):
    """tl_ssd's PriorBox output (1, 2, H * W * P * 4), float32; sizes: per (min_size, ratio) the box
    [width, height] as float32 values, in the fork's order."""
    f32 = torch.float32
    sh, sw = prior_steps(step_h, step_w, lh, lw, ih, iw)
    ox = torch.tensor(offsets_w, dtype=f32)
    oy = torch.tensor(offsets_h, dtype=f32)
    # centres (h, w, offset_w, offset_h) in float32, as the fork's float arithmetic
    cx = (torch.arange(lw, dtype=f32)[None, :, None, None] + ox[None, None, :, None]) * sw
    cy = (torch.arange(lh, dtype=f32)[:, None, None, None] + oy[None, None, None, :]) * sh
    cx, cy = torch.broadcast_tensors(cx, cy)
    wh = torch.tensor(sizes, dtype=f32).double()                  # (S, 2)
    cx, cy = cx.double()[..., None], cy.double()[..., None]
    bw, bh = wh[:, 0], wh[:, 1]
    boxes = torch.stack([(cx - bw / 2.0) / iw, (cy - bh / 2.0) / ih, (cx + bw / 2.0) / iw, (cy + bh / 2.0) / ih],
                        dim=-1)
    coords = boxes.float().reshape(-1)
    return prior_output(coords, variance, clip)


class OffsetGridPriorBox(nn.Module):
    """offset_grid_priors from the bottoms' spatial sizes at run time."""

    def __init__(self, sizes, offsets_w, offsets_h, variance, img_h=0, img_w=0, step_h=0.0, step_w=0.0,
                 clip=False):
        super().__init__()
        self.sizes, self.offsets_w, self.offsets_h, self.variance = sizes, offsets_w, offsets_h, variance
        self.img_h, self.img_w, self.step_h, self.step_w, self.clip = img_h, img_w, step_h, step_w, clip

    def forward(self, feat, img):
        lh, lw, ih, iw = prior_run_sizes(feat, img, self.img_h, self.img_w)
        out = offset_grid_priors(self.sizes, self.offsets_w, self.offsets_h, self.variance, lh, lw, ih, iw,
                                 self.step_h, self.step_w, self.clip)
        return out.to(device=feat.device, dtype=feat.dtype)


TORCH_OFFSET_GRID = torch_sources(offset_grid_priors, OffsetGridPriorBox)


def claims(p):
    """The fork's form: repeated offset_w / offset_h with min_size (OpenCV's explicit width/height
    boxes are another reading, refused by PriorBox)."""
    return bool(len(p.offset_w) or len(p.offset_h)) and not (len(p.width) or len(p.height))


def parse(p, base):
    """attrs of the fork's reading; base: PriorBox's own reading of the shared fields."""
    if not (len(p.offset_w) and len(p.offset_h)):
        raise LayerError("prior_box_param: tl_ssd's offset grid needs both offset_w and offset_h")
    for name in ("offset_w", "offset_h"):
        if any(not 0.0 <= v <= 1.0 for v in getattr(p, name)):
            raise LayerError(f"prior_box_param.{name} must lie in [0, 1] (the fork's check), got {list(getattr(p, name))}")
    ratios = []
    for ar in p.aspect_ratio:
        if any(abs(ar - r) < 1e-6 for r in ratios):
            continue
        ratios.append(float(ar))
        if p.flip:
            ratios.append(float(np.float32(1.0 / float(ar))))
    if not ratios:
        raise LayerError("prior_box_param: tl_ssd's PriorBox has no implicit aspect ratio 1; give aspect_ratio")
    if any(abs(r - 1.0) < 1e-6 for r in ratios):
        raise LayerError("prior_box_param: tl_ssd's PriorBox counts aspect ratio 1 but never writes it (its slots "
                         "stay unwritten); leave 1 out")
    sizes = []
    for mn in base["min_sizes"]:
        for r in ratios:
            s = math.sqrt(float(np.float32(r)))
            sizes.append([float(np.float32(mn * s)), float(np.float32(mn / s))])
    return {**base, "offset_grid": True, "grid_sizes": sizes, "offsets_w": [float(v) for v in p.offset_w],
            "offsets_h": [float(v) for v in p.offset_h]}


def num_priors(attrs):
    return len(attrs["grid_sizes"]) * len(attrs["offsets_w"]) * len(attrs["offsets_h"])


def priors(attrs, feat_hw, img_hw):
    if attrs["img_h"] and attrs["img_w"]:
        img_hw = (attrs["img_h"], attrs["img_w"])
    return offset_grid_priors(attrs["grid_sizes"], attrs["offsets_w"], attrs["offsets_h"],
                              [float(v) for v in attrs["variance"]], *feat_hw, *img_hw, attrs["step_h"],
                              attrs["step_w"], attrs["clip"]).numpy()


def pytorch_source(node, emit):
    a = node.attrs
    args = [emit.lit(a["grid_sizes"]), emit.lit(a["offsets_w"]), emit.lit(a["offsets_h"]),
            emit.lit([float(v) for v in a["variance"]]), f"img_h={a['img_h']}", f"img_w={a['img_w']}",
            f"step_h={emit.lit(a['step_h'])}", f"step_w={emit.lit(a['step_w'])}", f"clip={emit.lit(a['clip'])}"]
    emit_prior_helpers(emit)
    m = emit.module(f"{emit.helper(TORCH_OFFSET_GRID)}({', '.join(args)})")
    return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"
