"""lippman1125/faceboxes_lqy's PriorBox (prior_box_layer.cpp, dac418b4): FaceBoxes anchors given by
`fixed_size` (px), each laid `density` x `density` times inside its cell.

prior_box_param fixed_size and density (one per fixed_size) replace min_size / max_size; the box
shapes are either the listed `fixed_ratio`s (not together with aspect_ratio) or SSD's aspect ratios
(1 first, then each aspect_ratio and with flip its inverse).  Per cell (row-major), per fixed_size
s (read as the int fs for the square box and the grid, as a float f for the ratio boxes), per shape,
per grid row r, per grid column c (d = int(density), shift = int(f / d) in float32):
centre x = float32(float32((w + offset) * step_w - fs // 2) + shift / 2 + c * shift), y likewise
with h and r; without fixed_ratio the first shape is the fs x fs square, the others f * sqrt(ar) by
f / sqrt(ar) (float32); with fixed_ratio every shape is f * sqrt(ar) by f / sqrt(ar), 1 included.
Corners (centre -/+ half the box) / image size in double, each clamped to [0, 1] whatever `clip`
says, stored as float32; then `clip`, then the variances (1 value, or 4 per prior; 0.1 unset).

The fork counts its priors per cell as #shapes x #fixed_size plus, per density, #shapes x
(density^2 - 1) (truncated to int), where #shapes is the number of fixed_ratios or of aspect
ratios, and nothing for min_size; a layer whose boxes would not fill exactly that count (two
fixed_ratios, min_size beside fixed_size, a fractional density) writes past its top or leaves it
short, and is refused, as is min_size / max_size / density / fixed_ratio without fixed_size.
"""

import numpy as np
import torch
from torch import nn

from ..registry import LayerError, torch_sources
from .common import emit_prior_helpers, prior_output, prior_run_sizes, prior_steps

F32 = np.float32


def fixed_size_priors(boxes: list[list[float]], variance: list[float], lh: int, lw: int, ih: int, iw: int,
                      step_h: float, step_w: float, offset: float, clip: bool):
    """faceboxes_lqy's PriorBox output (1, 2, H * W * P * 4), float32; boxes: per prior in the fork's
    order [width, height (float32 values), fs // 2 (int), x shift, y shift (px, from fs // 2 off the
    cell centre)]."""
    f32, f64 = torch.float32, torch.float64
    sh, sw = prior_steps(step_h, step_w, lh, lw, ih, iw)
    b = torch.tensor(boxes, dtype=f64)
    half = b[:, 2].to(f32)
    off = torch.tensor(offset, dtype=f32)
    cx = (torch.arange(lw, dtype=f32) + off) * sw
    cy = (torch.arange(lh, dtype=f32) + off) * sh
    # the cell centre less fs // 2 in float32, the grid shift added in double, the centre kept as float32
    px = ((cx[None, :, None] - half).to(f64) + b[:, 3]).to(f32).to(f64)
    py = ((cy[:, None, None] - half).to(f64) + b[:, 4]).to(f32).to(f64)
    bw, bh = b[:, 0], b[:, 1]
    x0 = ((px - bw / 2.0) / iw).clamp(0.0, 1.0)
    y0 = ((py - bh / 2.0) / ih).clamp(0.0, 1.0)
    x1 = ((px + bw / 2.0) / iw).clamp(0.0, 1.0)
    y1 = ((py + bh / 2.0) / ih).clamp(0.0, 1.0)
    x0, y0, x1, y1 = torch.broadcast_tensors(x0, y0, x1, y1)
    coords = torch.stack([x0, y0, x1, y1], dim=-1).to(f32).reshape(-1)
    return prior_output(coords, variance, clip)


class FixedSizePriorBox(nn.Module):
    """fixed_size_priors from the bottoms' spatial sizes at run time (never their values)."""

    def __init__(self, boxes, variance, img_h=0, img_w=0, step_h=0.0, step_w=0.0, offset=0.5, clip=False):
        super().__init__()
        self.boxes, self.variance = boxes, variance
        self.img_h, self.img_w, self.step_h, self.step_w = img_h, img_w, step_h, step_w
        self.offset, self.clip = offset, clip

    def forward(self, feat, img):
        lh, lw, ih, iw = prior_run_sizes(feat, img, self.img_h, self.img_w)
        out = fixed_size_priors(self.boxes, self.variance, lh, lw, ih, iw, self.step_h, self.step_w,
                                self.offset, self.clip)
        return out.to(device=feat.device, dtype=feat.dtype)


TORCH_FIXED_SIZE = torch_sources(fixed_size_priors, FixedSizePriorBox)


def claims(p):
    """The fork's form: any of its three fields set."""
    return bool(len(p.fixed_size) or len(p.fixed_ratio) or len(p.density))


def _ratios(p):
    """SSD's shape list as the fork builds it: 1, then each new aspect_ratio and with flip 1 / ratio."""
    ratios = [F32(1.0)]
    for ar in p.aspect_ratio:
        ar = F32(ar)
        if ar <= 0:
            raise LayerError(f"prior_box_param.aspect_ratio must be positive, got {float(ar)}")
        if any(abs(float(ar) - float(r)) < 1e-6 for r in ratios):
            continue
        ratios.append(ar)
        if p.flip:
            ratios.append(F32(1.0 / float(ar)))
    return ratios


def _grid(fs, d):
    """(fs // 2, [(x shift, y shift)] row-major) of one fixed_size's density grid, as the fork's ints."""
    shift = int(F32(fs) / F32(d))
    return int(fs) // 2, [(shift / 2.0 + c * shift, shift / 2.0 + r * shift) for r in range(d) for c in range(d)]


def parse(p, base):
    """attrs of the fork's reading; base: PriorBox's reading of the shared fields (variance, img,
    step, offset, clip)."""
    if not len(p.fixed_size):
        raise LayerError("prior_box_param: density and fixed_ratio (lippman1125/faceboxes_lqy) need fixed_size")
    if len(p.min_size) or len(p.max_size):
        raise LayerError("prior_box_param: min_size / max_size beside fixed_size: faceboxes_lqy's PriorBox "
                         "leaves them out of its prior count and would write past its top")
    for name in ("denser_prior_boxes", "tf", "yx_order"):
        if getattr(p, name):
            raise LayerError(f"prior_box_param.{name} does not combine with fixed_size")
    sizes = [float(F32(v)) for v in p.fixed_size]
    if any(v <= 0 for v in sizes):
        raise LayerError(f"prior_box_param.fixed_size must be positive, got {sizes}")
    dens = [float(F32(v)) for v in p.density]
    if len(dens) != len(sizes):
        raise LayerError(f"prior_box_param has {len(dens)} density for {len(sizes)} fixed_size; "
                         f"give one per fixed_size (the fork's check)")
    if any(v < 1 for v in dens):
        raise LayerError(f"prior_box_param.density must be at least 1, got {dens}")
    fixed_ratios = [F32(v) for v in p.fixed_ratio]
    if fixed_ratios and len(p.aspect_ratio):
        raise LayerError("prior_box_param: give fixed_ratio or aspect_ratio, not both (the fork's check)")
    if any(r <= 0 for r in fixed_ratios):
        raise LayerError(f"prior_box_param.fixed_ratio must be positive, got {[float(r) for r in fixed_ratios]}")
    ratios = _ratios(p)
    shapes = len(fixed_ratios) or len(ratios)
    declared = len(ratios) * len(sizes)          # LayerSetUp's count (ratios is [1] with fixed_ratio)
    for d in dens:
        declared = int(declared + shapes * (d ** 2 - 1))
    written = sum(shapes * int(d) ** 2 for d in dens)
    if declared != written:
        raise LayerError(f"prior_box_param fixed_size {sizes}, density {dens}: faceboxes_lqy's PriorBox "
                         f"declares {declared} priors per cell but writes {written}")
    boxes = []
    for fs, d in zip(sizes, dens):
        half, grid = _grid(fs, int(d))
        if fixed_ratios:
            shape_wh = [(F32(fs) * np.sqrt(r), F32(fs) / np.sqrt(r)) for r in fixed_ratios]
        else:
            shape_wh = [(F32(int(fs)), F32(int(fs)))] + [
                (F32(fs) * np.sqrt(r), F32(fs) / np.sqrt(r)) for r in ratios if abs(float(r) - 1.0) >= 1e-6]
        for bw, bh in shape_wh:
            boxes += [[float(F32(bw)), float(F32(bh)), float(half), dx, dy] for dx, dy in grid]
    return {**base, "fixed_size": True, "fixed_boxes": boxes}


def num_priors(attrs):
    return len(attrs["fixed_boxes"])


def priors(attrs, feat_hw, img_hw):
    if attrs["img_h"] and attrs["img_w"]:
        img_hw = (attrs["img_h"], attrs["img_w"])
    return fixed_size_priors(attrs["fixed_boxes"], [float(v) for v in attrs["variance"]], *feat_hw, *img_hw,
                             attrs["step_h"], attrs["step_w"], attrs["offset"], attrs["clip"]).numpy()


def pytorch_source(node, emit):
    a = node.attrs
    # the boxes are read as float64 there: their exact values, not float32's shortest form
    args = [emit.lit(a["fixed_boxes"], exact=True), emit.lit([float(v) for v in a["variance"]]),
            f"img_h={a['img_h']}", f"img_w={a['img_w']}", f"step_h={emit.lit(a['step_h'])}", f"step_w={emit.lit(a['step_w'])}",
            f"offset={emit.lit(a['offset'])}", f"clip={emit.lit(a['clip'])}"]
    emit_prior_helpers(emit)
    m = emit.module(f"{emit.helper(TORCH_FIXED_SIZE)}({', '.join(args)})")
    return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"
