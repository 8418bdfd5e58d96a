"""OpenCV's PriorBox with repeated offset_w / offset_h read as (offset_w, offset_h) PAIRS
(opencv/opencv modules/dnn/src/layers/prior_box_layer.cpp), the form OpenCV's TextBoxes sample
writes: `offset_h: 0.5 offset_w: 0.5 offset_h: 1.0 offset_w: 0.5` is TextBoxes' doubling (each
prior and its copy half a cell lower) spelled out.

No field says which fork a net's offset_w / offset_h follow (julimueller/tl_ssd reads them as a
grid, priorbox_offset_grid.py): the loc predictions decide (priorbox.fork_priors marks the layers
with caffeq's own `opencv_offset_pairs`).

The fork's reading: the boxes are [min_size] + [sqrt(min_size * max_size) with max_size] + per
aspect ratio (deduplicated against 1 and earlier ones, its inverse right after it with flip)
[min_size * sqrt(ar), min_size / sqrt(ar)], all in float32, from the first min_size and max_size
only.  The layer declares boxes * max(1, 2 * (pairs - 1)) priors per cell, which is what it writes
only for 1 or 2 pairs (others are refused).  Per cell (h, w), per box, per pair j: centre
x = (w + offset_w[j]) * step_x, y = (h + offset_h[j]) * step_y in float32 (step_w / step_h or step,
else image size / map size in float32), corners (cx -/+ bw * 0.5) / image width, (cy -/+ bh * 0.5) /
image height in float32; clip (true unless set false, OpenCV's default) clamps all to [0, 1]; then
the variances (1 value, or 4 per prior).  The image size is always the image bottom's (OpenCV reads
no img_size / img_h / img_w).
"""

import numpy as np
import torch
from torch import nn

from ..registry import LayerError, torch_sources
from .common import emit_prior_helpers, prior_output, prior_run_sizes, prior_steps, proto_field

F32 = np.float32


def opencv_pair_priors(widths: list[float], heights: list[float], offsets_w: list[float], offsets_h: list[float],
                       variance: list[float], lh: int, lw: int, ih: int, iw: int, step_h: float, step_w: float,
                       clip: bool):
    """OpenCV's PriorBox output (1, 2, H * W * boxes * pairs * 4), float32, every step in float32."""
    f32 = torch.float32
    sy, sx = prior_steps(step_h, step_w, lh, lw, ih, iw)
    # axes (h, w, box, pair)
    cx = (torch.arange(lw, dtype=f32)[None, :, None, None] + torch.tensor(offsets_w, dtype=f32)) * sx
    cy = (torch.arange(lh, dtype=f32)[:, None, None, None] + torch.tensor(offsets_h, dtype=f32)) * sy
    half_w = torch.tensor(widths, dtype=f32)[:, None] * 0.5
    half_h = torch.tensor(heights, dtype=f32)[:, None] * 0.5
    img_w, img_h = torch.tensor(float(iw), dtype=f32), torch.tensor(float(ih), dtype=f32)
    corners = torch.broadcast_tensors((cx - half_w) / img_w, (cy - half_h) / img_h,
                                      (cx + half_w) / img_w, (cy + half_h) / img_h)
    coords = torch.stack(corners, dim=-1).reshape(-1)
    return prior_output(coords, variance, clip)


class OpenCVPairPriorBox(nn.Module):
    """opencv_pair_priors from the bottoms' spatial sizes at run time."""

    def __init__(self, widths, heights, offsets_w, offsets_h, variance, step_h=0.0, step_w=0.0, clip=True):
        super().__init__()
        self.widths, self.heights, self.offsets_w, self.offsets_h = widths, heights, offsets_w, offsets_h
        self.variance, self.step_h, self.step_w, self.clip = variance, step_h, step_w, clip

    def forward(self, feat, img):
        lh, lw, ih, iw = prior_run_sizes(feat, img, 0, 0)
        out = opencv_pair_priors(self.widths, self.heights, self.offsets_w, self.offsets_h, self.variance,
                                 lh, lw, ih, iw, self.step_h, self.step_w, self.clip)
        return out.to(device=feat.device, dtype=feat.dtype)


TORCH_OPENCV_PAIRS = torch_sources(opencv_pair_priors, OpenCVPairPriorBox)


def claims(p):
    """The layer's offsets can be OpenCV's pairs: offset_w and offset_h given, as many of each."""
    return bool(len(p.offset_w)) and len(p.offset_w) == len(p.offset_h)


def marked(p):
    return bool(proto_field(p, "opencv_offset_pairs", False))


def box_sizes(p):
    """OpenCV's box widths and heights (float32 values), from the first min_size and max_size."""
    if not len(p.min_size):
        raise LayerError("prior_box_param.min_size is required")
    mn = F32(p.min_size[0])
    if not mn > 0:
        raise LayerError(f"prior_box_param.min_size must be positive, got {float(mn)}")
    widths, heights = [mn], [mn]
    if len(p.max_size):
        mx = F32(p.max_size[0])
        if not mx > mn:
            raise LayerError(f"prior_box_param.max_size {float(mx)} must be greater than min_size {float(mn)}")
        widths.append(np.sqrt(F32(mn * mx)))
        heights.append(widths[-1])
    ratios = []
    for ar in p.aspect_ratio:
        ar = F32(ar)
        if not ar > 0:
            raise LayerError(f"prior_box_param.aspect_ratio must be positive, got {float(ar)}")
        if abs(ar - F32(1.0)) < F32(1e-6) or any(float(abs(ar - r)) < 1e-6 for r in ratios):
            continue
        ratios.append(ar)
        if p.flip:
            ratios.append(F32(1.0 / float(ar)))
    for r in ratios:
        s = np.sqrt(r)
        widths.append(F32(mn * s))
        heights.append(F32(mn / s))
    return [float(w) for w in widths], [float(h) for h in heights]


def parse(p, base):
    """attrs of OpenCV's pair reading; base: PriorBox's reading of the shared fields."""
    for other in ("denser_prior_boxes", "faceboxes_priors", "tf", "yx_order"):
        if proto_field(p, other, False):
            raise LayerError(f"prior_box_param: OpenCV's offset_w/offset_h pairs do not combine with {other}")
    if len(p.width) or len(p.height):
        raise LayerError("prior_box_param: OpenCV's explicit width/height boxes are not supported")
    if not claims(p):
        raise LayerError(f"prior_box_param: OpenCV's offsets pair each offset_w with an offset_h, got "
                         f"{len(p.offset_w)} offset_w and {len(p.offset_h)} offset_h")
    pairs = len(p.offset_w)
    if pairs > 2:
        raise LayerError(f"prior_box_param: OpenCV's PriorBox declares {2 * (pairs - 1)} priors per box for "
                         f"{pairs} offset_w/offset_h pairs but writes {pairs}; only 1 or 2 pairs fit")
    if p.HasField("offset"):
        raise LayerError("prior_box_param: OpenCV's PriorBox takes offset or offset_w/offset_h, not both")
    widths, heights = box_sizes(p)
    notes = []
    if base["img_h"] or base["img_w"]:
        notes.append("PriorBox read as OpenCV's: img_size/img_h/img_w ignored (the image bottom's size is used)")
    return {**base, "opencv_pairs": True, "clip": bool(p.clip), "img_h": 0, "img_w": 0,
            "pair_widths": widths, "pair_heights": heights, "offsets_w": [float(F32(v)) for v in p.offset_w],
            "offsets_h": [float(F32(v)) for v in p.offset_h], "reading_notes": notes}


def num_priors(attrs):
    return len(attrs["pair_widths"]) * len(attrs["offsets_w"])


def priors(attrs, feat_hw, img_hw):
    return opencv_pair_priors(attrs["pair_widths"], attrs["pair_heights"], attrs["offsets_w"], attrs["offsets_h"],
                              [float(v) for v in attrs["variance"]], *feat_hw, *img_hw, attrs["step_h"],
                              attrs["step_w"], attrs["clip"]).numpy()


def pytorch_source(node, emit):
    a = node.attrs
    args = [emit.lit(a["pair_widths"]), emit.lit(a["pair_heights"]), emit.lit(a["offsets_w"]),
            emit.lit(a["offsets_h"]), emit.lit([float(v) for v in a["variance"]]),
            f"step_h={emit.lit(a['step_h'])}", f"step_w={emit.lit(a['step_w'])}", f"clip={emit.lit(a['clip'])}"]
    emit_prior_helpers(emit)
    m = emit.module(f"{emit.helper(TORCH_OPENCV_PAIRS)}({', '.join(args)})")
    return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"
