"""PriorRBox: the rotatable prior boxes of DRBox (liulei01/DRBox b5c76e0, src/caffe/layers/prior_rbox_layer.cpp;
prior_rbox_param: rotated_angles, prior_widths, prior_heights, regress_size, regress_angle (both false
by default), clip, variance, img_size or img_h/img_w, step or step_h/step_w, offset [0.5]; min_size,
max_size, aspect_ratio and flip are declared but never read).

- parameters per prior: centre x, y, then width and height with regress_size, then the angle with
  regress_angle (2 to 5); priors per cell: len(rotated_angles) x len(prior_widths) (one angle, 0,
  without regress_angle), angle outer; without regress_size there must be one width;
- image size from bottom 1 unless img_h and img_w are both set; steps image / layer size in float32
  unless both set; centre ((w + offset) step_w / image width, (h + offset) step_h / image height);
  widths, heights (fractions of the image) and angles (degrees) are written as given;
- clip clamps every value of the first channel to [0, 1], angles and sizes included (as the fork
  does); variances: one value for all, or one per parameter (exactly that many), default 0.1;
- top (1, 2, H W priors parameters).
"""
import torch
from torch import nn

from ..registry import LayerError, need_blobs, register_layer, torch_sources
from .common import SizeOnlyPriors, legacy_hw, prior_output, prior_steps
from .priorbox import prior_hw_fields


def prior_rbox_tensor(widths: list[float], heights: list[float], angles: list[float], regress_size: bool,
                      regress_angle: bool, variance: list[float], lh: int, lw: int, ih: int, iw: int,
                      step_h: float = 0.0, step_w: float = 0.0, offset: float = 0.5, clip: bool = False):
    """DRBox's PriorRBox top (1, 2, lh lw A P n) in float32 for a lh x lw layer over an ih x iw image."""
    f32 = torch.float32
    sh, sw = prior_steps(step_h, step_w, lh, lw, ih, iw)   # both given, else image size / map size
    off = torch.tensor(offset, dtype=f32)
    shape = (lh, lw, len(angles), len(widths))
    x = ((torch.arange(lw, dtype=f32) + off) * sw / torch.tensor(float(iw), dtype=f32)).view(1, lw, 1, 1)
    y = ((torch.arange(lh, dtype=f32) + off) * sh / torch.tensor(float(ih), dtype=f32)).view(lh, 1, 1, 1)
    columns = [x.expand(shape), y.expand(shape)]
    if regress_size:
        columns.append(torch.tensor(widths, dtype=f32).view(1, 1, 1, -1).expand(shape))
        columns.append(torch.tensor(heights, dtype=f32).view(1, 1, 1, -1).expand(shape))
    if regress_angle:
        columns.append(torch.tensor(angles, dtype=f32).view(1, 1, -1, 1).expand(shape))
    return prior_output(torch.stack(columns, dim=-1).reshape(-1), variance, clip)


class PriorRBox(nn.Module):
    """prior_rbox_tensor from the bottoms' spatial sizes at run time (never their values)."""

    def __init__(self, widths, heights, angles, regress_size, regress_angle, variance, img_h=0, img_w=0,
                 step_h=0.0, step_w=0.0, offset=0.5, clip=False):
        super().__init__()
        self.args = (widths, heights, angles, regress_size, regress_angle, variance)
        self.img_h, self.img_w, self.step_h, self.step_w = img_h, img_w, step_h, step_w
        self.offset, self.clip = offset, clip

    def forward(self, feat, img):
        lh, lw = feat.shape[2], feat.shape[3]
        ih, iw = (self.img_h, self.img_w) if self.img_h and self.img_w else (img.shape[2], img.shape[3])
        out = prior_rbox_tensor(*self.args, lh, lw, ih, iw, self.step_h, self.step_w, self.offset, self.clip)
        return out.to(device=feat.device, dtype=feat.dtype)


# model.py gets the same code that forward runs
TORCH_PRIOR_RBOX = torch_sources(prior_rbox_tensor, PriorRBox)

_ARGS = ("widths", "heights", "angles", "regress_size", "regress_angle", "variance", "img_h", "img_w",
         "step_h", "step_w", "offset", "clip")


@register_layer("PriorRBox")
class PriorRBoxLayer(SizeOnlyPriors):
    torch_module = TORCH_PRIOR_RBOX
    helpers = (prior_steps, prior_output)
    module_args = _ARGS

    def parse(self, lp):
        need_blobs(lp, "PriorRBox", 2, 1, roles="feature map, image")
        p = lp.prior_rbox_param
        widths, heights = [float(v) for v in p.prior_widths], [float(v) for v in p.prior_heights]
        if len(widths) != len(heights):
            raise LayerError(f"prior_rbox_param has {len(widths)} prior_widths and {len(heights)} prior_heights; "
                             f"give one height per width")
        regress_size, regress_angle = bool(p.regress_size), bool(p.regress_angle)
        if not regress_size and len(widths) != 1:
            raise LayerError(f"prior_rbox_param: without regress_size the fork takes exactly one prior width, "
                             f"got {len(widths)}")
        angles = [float(a) for a in p.rotated_angles] if regress_angle else [0.0]
        if not widths or not angles:
            raise LayerError("prior_rbox_param gives no priors (prior_widths, or rotated_angles with regress_angle)")
        params = 2 + 2 * regress_size + regress_angle
        var = [float(v) for v in p.variance]
        if len(var) > 1 and len(var) != params:
            raise LayerError(f"prior_rbox_param.variance needs 1 or {params} values (one per prior parameter), "
                             f"got {len(var)}")
        if any(v <= 0 for v in var):
            raise LayerError(f"prior_rbox_param.variance must be positive, got {var}")
        img_h, img_w = prior_hw_fields(p, "img_size", "img_h", "img_w", int, "prior_rbox_param")
        step_h, step_w = prior_hw_fields(p, "step", "step_h", "step_w", float, "prior_rbox_param")
        return {"widths": widths, "heights": heights, "angles": angles, "regress_size": regress_size,
                "regress_angle": regress_angle, "variance": var or [0.1], "img_h": img_h, "img_w": img_w,
                "step_h": step_h, "step_w": step_w, "offset": float(p.offset), "clip": bool(p.clip)}

    @staticmethod
    def params_per_prior(attrs):
        return 2 + 2 * attrs["regress_size"] + attrs["regress_angle"]

    def infer(self, attrs, in_shapes):
        feat, img = in_shapes
        if len(feat) != 4 or len(img) != 4:
            raise LayerError(f"PriorRBox needs 4-axis bottoms (feature map, image), got {list(feat)} and {list(img)}")
        h, w = legacy_hw(feat)
        n = h * w * len(attrs["angles"]) * len(attrs["widths"]) * self.params_per_prior(attrs)
        if n <= 0:
            raise LayerError(f"feature map {list(feat)} gives no priors")
        return [(1, 2, n)]

    @staticmethod
    def boxes(attrs, feat_shape, img_shape):
        a = attrs
        (lh, lw), (ih, iw) = legacy_hw(feat_shape), legacy_hw(img_shape)
        if a["img_h"] and a["img_w"]:
            ih, iw = a["img_h"], a["img_w"]
        return prior_rbox_tensor(a["widths"], a["heights"], a["angles"], a["regress_size"], a["regress_angle"],
                                 a["variance"], lh, lw, ih, iw, a["step_h"], a["step_w"], a["offset"], a["clip"])
