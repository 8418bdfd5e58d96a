"""PriorBoxClustered: the prior boxes of OpenVINO's Caffe models (Intel's Open Model Zoo SSD detectors
for Myriad / NCS, such as face-detection-retail-0004), read from `prior_box_param`.

No BVLC or SSD Caffe fork has this layer; OpenVINO defines it.  Its Model Optimizer reads the Caffe
layer (openvinotoolkit/openvino tools/mo/.../front/caffe/priorbox_clustered_ext.py, 3a33e0d: width,
height, clip, variance, img_h, img_w, step, step_h, step_w, offset) with mo_caffe.proto's
PriorBoxParameter, where `clip` defaults to false; its runtime computes (the Inference Engine CPU
extension ext_priorbox_clustered.cpp, b334dcf, and the nGraph reference prior_box_clustered.hpp,
0bfff82, both Apache-2.0; the operation spec PriorBoxClustered-1 says the same):

- layer H x W from the first bottom, the image size from the second unless img_h / img_w (each
  axis on its own) is non-zero;
- step_w = step_w or step, step_h = step_h or step; when both are still 0, image size / layer
  size in float32;
- for each cell (h outer, w inner) and each prior s: centre ((w + offset) * step_w,
  (h + offset) * step_h), corners (centre -/+ width[s] / 2) / image width, (centre -/+
  height[s] / 2) / image height, in float32, clamped to [0, 1] when clip;
- output (1, 2, H * W * P * 4): the corners [xmin, ymin, xmax, ymax], then the variances (none: 0.1;
  one value: repeated 4 times per prior, as the nGraph reference; or 4 values).

img_size, flip, min_size, max_size and aspect_ratio play no part (OpenVINO ignores them); a set
img_size gets a reading note.  OpenCV's dnn does not implement this layer.
"""

import torch
from torch import nn

from ..registry import LayerError, need_blobs, register_layer, torch_sources
from .common import SizeOnlyPriors, prior_output


def prior_box_clustered_tensor(widths: list[float], heights: list[float], variance: list[float], lh: int, lw: int,
                               ih: int, iw: int, step_h: float = 0.0, step_w: float = 0.0, offset: float = 0.5,
                               clip: bool = False):
    """OpenVINO's PriorBoxClustered (1, 2, lh * lw * P * 4) in float32: lh, lw the layer's size, ih, iw the
    image's; each prior s is widths[s] x heights[s] px around its cell's centre."""
    f32 = torch.float32
    if step_h == 0.0 and step_w == 0.0:
        sh = torch.tensor(float(ih), dtype=f32) / torch.tensor(float(lh), dtype=f32)
        sw = torch.tensor(float(iw), dtype=f32) / torch.tensor(float(lw), dtype=f32)
    else:
        sh, sw = torch.tensor(step_h, dtype=f32), torch.tensor(step_w, dtype=f32)
    off = torch.tensor(offset, dtype=f32)
    cx = ((torch.arange(lw, dtype=f32) + off) * sw)[None, :, None]
    cy = ((torch.arange(lh, dtype=f32) + off) * sh)[:, None, None]
    half_w = torch.tensor(widths, dtype=f32) / 2.0
    half_h = torch.tensor(heights, dtype=f32) / 2.0
    fw, fh = torch.tensor(float(iw), dtype=f32), torch.tensor(float(ih), dtype=f32)
    corners = torch.broadcast_tensors((cx - half_w) / fw, (cy - half_h) / fh, (cx + half_w) / fw, (cy + half_h) / fh)
    coords = torch.stack(corners, dim=-1).reshape(-1)
    return prior_output(coords, variance, clip)


class PriorBoxClustered(nn.Module):
    """prior_box_clustered_tensor from the bottoms' spatial sizes at run time (never their values);
    img_h / img_w, where non-zero, replace the image's height / width."""

    def __init__(self, widths, heights, variance, img_h=0, img_w=0, step_h=0.0, step_w=0.0, offset=0.5,
                 clip=False):
        super().__init__()
        self.widths, self.heights, self.variance = widths, heights, variance
        self.img_h, self.img_w, self.step_h, self.step_w = img_h, img_w, step_h, step_w
        self.offset, self.clip = offset, clip

    def forward(self, feat, img):
        ih = self.img_h or img.shape[2]
        iw = self.img_w or img.shape[3]
        out = prior_box_clustered_tensor(self.widths, self.heights, self.variance, feat.shape[2], feat.shape[3],
                                         ih, iw, self.step_h, self.step_w, self.offset, self.clip)
        return out.to(device=feat.device, dtype=feat.dtype)


# model.py gets the same code that forward runs
TORCH_PRIOR_BOX_CLUSTERED = torch_sources(prior_box_clustered_tensor, PriorBoxClustered)

_ARGS = ("widths", "heights", "variance", "img_h", "img_w", "step_h", "step_w", "offset", "clip")


@register_layer("PriorBoxClustered")
class PriorBoxClusteredLayer(SizeOnlyPriors):
    torch_module = TORCH_PRIOR_BOX_CLUSTERED
    helpers = (prior_output,)
    module_args = _ARGS

    def parse(self, lp):
        need_blobs(lp, "PriorBoxClustered", 2, roles="feature map, image")
        p = lp.prior_box_param
        widths, heights = [float(v) for v in p.width], [float(v) for v in p.height]
        if not widths or len(widths) != len(heights):
            raise LayerError(f"prior_box_param needs one height per width (at least one of each), got "
                             f"{len(widths)} width and {len(heights)} height")
        var = [float(v) for v in p.variance]
        if len(var) not in (0, 1, 4):
            raise LayerError(f"prior_box_param.variance needs 1 or 4 values, got {len(var)}")
        step_w = float(p.step_w) or float(p.step)
        step_h = float(p.step_h) or float(p.step)
        notes = []
        if p.HasField("img_size"):
            notes.append("prior_box_param.img_size is ignored, as OpenVINO's PriorBoxClustered does "
                         "(only img_h / img_w replace the image size)")
        return {"widths": widths, "heights": heights, "variance": var or [0.1],
                "img_h": int(p.img_h), "img_w": int(p.img_w), "step_h": step_h, "step_w": step_w,
                "offset": float(p.offset),
                # mo_caffe.proto's default (false); caffe.proto here carries OpenCV's (true)
                "clip": bool(p.clip) if p.HasField("clip") else False, "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        feat, img = in_shapes
        if len(feat) != 4 or len(img) != 4:
            raise LayerError(f"PriorBoxClustered needs 4-axis bottoms (as OpenVINO), got {list(feat)} and {list(img)}")
        n = feat[2] * feat[3] * len(attrs["widths"]) * 4
        if n <= 0:
            raise LayerError(f"feature map {list(feat)} gives no priors")
        return [(1, 2, n)]

    @staticmethod
    def boxes(attrs, feat_shape, img_shape):
        a = attrs
        ih, iw = a["img_h"] or img_shape[2], a["img_w"] or img_shape[3]
        return prior_box_clustered_tensor(a["widths"], a["heights"], a["variance"], feat_shape[2], feat_shape[3],
                                          ih, iw, a["step_h"], a["step_w"], a["offset"], a["clip"])
