"""SSD's PriorBox, with TextBoxes++'s denser_prior_boxes.

- `clip` defaults to false as in SSD since 2016 (caffe.proto here carries
  OpenCV's default, true, so only an explicit `clip` is read).  SSD truncates
  min/max sizes to int.  The output never depends on the batch or on the
  bottoms' values, only on their spatial sizes.
- TextBoxes++ (MhLiao/TextBoxes_plusplus) `denser_prior_boxes: true` follows
  every prior with a copy shifted down by half a cell: its centre y is
  (h + 1) * step_h instead of (h + offset) * step_h, so each cell has twice
  the priors, in the order prior, its shifted copy, next prior, ...
- FaceBoxes (sfzhang15/FaceBoxes b52cc92 prior_box_layer.cpp) densifies small anchors, with no
  field to say so (the net's predictions decide: see faceboxes_priors): a min_size of 32 gives a
  4 x 4 grid of boxes centred at the cell centre + (8j, 8i) px, i (rows) outer, j inner, in
  -2..1; 64 a 2 x 2 grid at + (16j, 16i), i, j in -1..0; any other min_size one box.  These
  min_size boxes span (size - 1) / 2 on each side of their centre (the sqrt(min * max) and
  aspect-ratio boxes keep size / 2).  A layer with exactly 3 min_size declares 21 priors per
  cell (LayerSetUp), others the SSD count; a layer whose boxes would not fill exactly that
  count (Caffe would write past its top or leave it short) is refused.
- synopsys-caffe (977ba36a prior_box_layer.cpp) `tf: true` orders each min_size's priors min,
  the other aspect ratios, then sqrt(min * max), and a min_size (as int) of exactly 60 has its
  first box inset by 0.05 on every side after normalizing; `yx_order: true` writes each box
  as [ymin, xmin, ymax, xmax].
- julimueller/tl_ssd's repeated offset_w / offset_h: a grid of priors per cell (priorbox_offset_grid.py);
  OpenCV reads them as (offset_w, offset_h) pairs instead (priorbox_opencv_pairs.py), when the loc
  predictions fit only that reading (see fork_priors).
- lippman1125/faceboxes_lqy's fixed_size / density / fixed_ratio: FaceBoxes anchors on a density grid
  per cell (priorbox_fixed_size.py).
- 03100076/BDIG (66afadc prior_box_layer.cpp) `use_default: false` drops each min_size's square box,
  keeping the aspect-ratio boxes (its max_size path writes more priors than it declares: refused).
- BestSonny/SSTD (174d452 prior_box_layer.cpp; text detection) draws aspect ratios linearly: per
  min_size s (a float, not truncated), the s x s square, sqrt(s x int(max_size)), then each listed
  ratio a (deduplicated against the listed ones only) as s * a wide by s high, then, with flip, each
  as s wide by s * a high.  Listing 0.5 and 2 thus gives four boxes where SSD's inverse pairs give
  two: such a net's predictions fit only this reading, which fork_priors marks (sstd_priors).
"""
import math

import numpy as np
import torch
from torch import nn

from ..registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from . import priorbox_fixed_size as fixed_size
from . import priorbox_offset_grid as offset_grid
from . import priorbox_opencv_pairs as opencv_pairs
from .common import emit_prior_helpers, legacy_hw, prior_output, prior_run_sizes, prior_steps, proto_field


def prior_hw_fields(p, both, h, w, cast, message="prior_box_param"):
    """(height, width) from a prior message's `h`/`w` pair or its single `both` field; (0, 0) when unset."""
    if p.HasField(h) or p.HasField(w):
        if p.HasField(both):
            raise LayerError(f"{message}: give {both} or {h}/{w}, not both")
        vh, vw = cast(getattr(p, h)), cast(getattr(p, w))
        if vh <= 0 or vw <= 0:
            raise LayerError(f"{message}.{h}/{w} must be positive, got {vh}/{vw}")
        return vh, vw
    if p.HasField(both):
        v = getattr(p, both)
        if v <= 0:
            raise LayerError(f"{message}.{both} must be positive, got {v}")
        return cast(v), cast(v)
    return cast(0), cast(0)


#: FaceBoxes' densified min_size boxes: size -> (grid offsets in px, from LayerSetUp's loops)
FACEBOXES_GRIDS = {32: [-16, -8, 0, 8], 64: [-16, 0]}


def faceboxes_offsets(min_size):
    """FaceBoxes' (dx, dy) centre offsets of one min_size's boxes, row (dy) outer."""
    grid = FACEBOXES_GRIDS.get(min_size, [0])
    return [(dx, dy) for dy in grid for dx in grid]


def prior_sizes(attrs):
    """Box (width, height, shifted) per prior, sizes as float32, in SSD's order: min, sqrt(min*max), other
    ratios; with denser_prior_boxes each followed by its copy shifted down by half a cell.  FaceBoxes'
    min_size boxes are given as size - 1 wide (they span (size - 1) / 2 either side), one per offset."""
    f32 = np.float32
    if attrs.get("sstd"):
        return [(w, h, False) for w, h in sstd_sizes(attrs)]
    sizes = []
    for k, mn in enumerate(attrs["min_sizes"]):
        if attrs.get("faceboxes"):
            sizes += [(f32(mn - 1), f32(mn - 1))] * len(faceboxes_offsets(mn))
        elif not attrs.get("no_square"):   # BDIG's use_default: false leaves it out
            sizes.append((f32(mn), f32(mn)))
        geometric = []
        if attrs["max_sizes"]:
            s = f32(math.sqrt(mn * attrs["max_sizes"][k]))
            geometric = [(s, s)]
        if not attrs.get("tf"):  # synopsys' tf puts it after the aspect ratios
            sizes += geometric
        for ar in attrs["ratios"]:
            if abs(ar - 1.0) < 1e-6:
                continue
            r = math.sqrt(float(f32(ar)))
            sizes.append((f32(mn * r), f32(mn / r)))
        if attrs.get("tf"):
            sizes += geometric
    if attrs.get("denser"):
        return [(w, h, shifted) for w, h in sizes for shifted in (False, True)]
    return [(w, h, False) for w, h in sizes]


def sstd_sizes(attrs):
    """SSTD's (width, height) per prior, float32: square, sqrt(min * int max), ratios wide, then flipped tall."""
    f32 = np.float32
    sizes = []
    for k, mn in enumerate(attrs["min_sizes"]):
        mn = f32(mn)
        sizes.append((mn, mn))
        if attrs["max_sizes"]:
            s = f32(np.sqrt(f32(mn * f32(attrs["max_sizes"][k]))))
            sizes.append((s, s))
        others = [f32(ar) for ar in attrs["ratios"] if abs(ar - 1.0) >= 1e-6]
        sizes += [(f32(mn * ar), mn) for ar in others]
        if attrs["flip"]:
            sizes += [(mn, f32(mn * ar)) for ar in others]
    return sizes


def prior_insets(attrs):
    """Per prior the normalized inset of synopsys' tf reading (0.05 for a min_size 60 box), else None."""
    if not attrs.get("tf"):
        return None
    out = []
    per_size = len(attrs["ratios"]) + (1 if attrs["max_sizes"] else 0)
    for mn in attrs["min_sizes"]:
        out += [0.05 if mn == 60 else 0.0] + [0.0] * (per_size - 1)
    return out if any(out) else None


def prior_offsets(attrs):
    """Per prior (dx, dy) centre offsets in px: FaceBoxes' grids, else None (all at the cell centre)."""
    if not attrs.get("faceboxes"):
        return None
    out = []
    for k, mn in enumerate(attrs["min_sizes"]):
        out += faceboxes_offsets(mn)
        out += [(0, 0)] * (bool(attrs["max_sizes"]) + sum(abs(r - 1.0) >= 1e-6 for r in attrs["ratios"]))
    return out


def prior_box_tensor(widths: list[float], heights: list[float], shifted: list[bool], variance: list[float],
                     lh: int, lw: int, ih: int, iw: int, step_h: float = 0.0, step_w: float = 0.0,
                     offset: float = 0.5, clip: bool = False, dx: list[float] = (), dy: list[float] = (),
                     inset: list[float] = (), yx: bool = False):
    """SSD's PriorBox output (1, 2, H * W * P * 4), float32: for each cell (row-major) and prior the
    corners [xmin, ymin, xmax, ymax] normalized by the image size, then the variances.  widths,
    heights: each prior's box size (float32 values); shifted: priors centred at (h + 1) * step_h
    (TextBoxes++'s denser priors); lh, lw: the feature map's size; ih, iw: the image's; dx, dy: each
    prior's centre offset in px, added in float32 (FaceBoxes' dense anchors), none when empty; inset:
    per prior, added to the normalized min corner and taken off the max one (synopsys' tf); yx: corners
    as [ymin, xmin, ymax, xmax] (synopsys' yx_order)."""
    f32 = torch.float32
    sh, sw = prior_steps(step_h, step_w, lh, lw, ih, iw)
    bw = torch.tensor(widths, dtype=f32).double()
    bh = torch.tensor(heights, dtype=f32).double()
    off = torch.tensor(offset, dtype=f32)
    rows = torch.arange(lh, dtype=f32)
    # cell centres in float32, corners in double, then float32: SSD's float/double mix
    cx = ((torch.arange(lw, dtype=f32) + off) * sw)[None, :, None]
    cy = ((rows + off) * sh)[:, None, None]
    cy_shifted = ((rows + 1.0) * sh)[:, None, None]
    if len(dx):
        cx = cx + torch.tensor(dx, dtype=f32)[None, None, :]
        cy = cy + torch.tensor(dy, dtype=f32)[None, None, :]
        cy_shifted = cy_shifted + torch.tensor(dy, dtype=f32)[None, None, :]
    cx, cy, cy_shifted = cx.double(), cy.double(), cy_shifted.double()
    cy = torch.where(torch.tensor(shifted, dtype=torch.bool)[None, None, :], cy_shifted, cy)
    x0, y0, x1, y1 = (cx - bw / 2.0) / iw, (cy - bh / 2.0) / ih, (cx + bw / 2.0) / iw, (cy + bh / 2.0) / ih
    if len(inset):
        d = torch.tensor(inset, dtype=torch.float64)[None, None, :]
        x0, y0, x1, y1 = x0 + d, y0 + d, x1 - d, y1 - d
    x0, y0, x1, y1 = torch.broadcast_tensors(x0, y0, x1, y1)
    boxes = torch.stack([y0, x0, y1, x1] if yx else [x0, y0, x1, y1], dim=-1)
    coords = boxes.float().reshape(-1)
    return prior_output(coords, variance, clip)


class PriorBox(nn.Module):
    """SSD's PriorBox (prior_box_tensor) from the bottoms' spatial sizes at run time (never their
    values); img_h, img_w, when set, replace the image's size."""

    def __init__(self, widths, heights, shifted, variance, img_h=0, img_w=0, step_h=0.0, step_w=0.0,
                 offset=0.5, clip=False, dx=(), dy=(), inset=(), yx=False):
        super().__init__()
        self.widths, self.heights, self.shifted, self.variance = widths, heights, shifted, variance
        self.img_h, self.img_w, self.step_h, self.step_w = img_h, img_w, step_h, step_w
        self.offset, self.clip, self.dx, self.dy = offset, clip, dx, dy
        self.inset, self.yx = inset, yx

    def forward(self, feat, img):
        lh, lw, ih, iw = prior_run_sizes(feat, img, self.img_h, self.img_w)
        out = prior_box_tensor(self.widths, self.heights, self.shifted, self.variance, lh, lw, ih, iw,
                               self.step_h, self.step_w, self.offset, self.clip, self.dx, self.dy,
                               self.inset, self.yx)
        return out.to(device=feat.device, dtype=feat.dtype)


# model.py gets the same code that forward runs
TORCH_PRIOR_BOX = torch_sources(prior_box_tensor, PriorBox)


def _module_args(attrs):
    sizes = prior_sizes(attrs)
    return ([float(w) for w, _, _ in sizes], [float(h) for _, h, _ in sizes], [s for _, _, s in sizes],
            [float(v) for v in attrs["variance"]])


def _offset_args(attrs):
    """(dx, dy) lists for prior_box_tensor: empty unless FaceBoxes' reading."""
    offsets = prior_offsets(attrs)
    if offsets is None:
        return [], []
    return [float(x) for x, _ in offsets], [float(y) for _, y in offsets]


def prior_boxes(attrs, feat_hw, img_hw):
    """The PriorBox output (1, 2, H*W*num_priors*4) as a float32 array (feat_hw, img_hw: (height, width))."""
    if attrs.get("offset_grid"):
        return offset_grid.priors(attrs, feat_hw, img_hw)
    if attrs.get("opencv_pairs"):
        return opencv_pairs.priors(attrs, feat_hw, img_hw)
    if attrs.get("fixed_size"):
        return fixed_size.priors(attrs, feat_hw, img_hw)
    if attrs["img_h"] and attrs["img_w"]:
        img_hw = (attrs["img_h"], attrs["img_w"])
    widths, heights, shifted, variance = _module_args(attrs)
    return prior_box_tensor(widths, heights, shifted, variance, *feat_hw, *img_hw, attrs["step_h"],
                            attrs["step_w"], attrs["offset"], attrs["clip"], *_offset_args(attrs),
                            prior_insets(attrs) or [], attrs.get("yx", False)).numpy()


def textboxes_priors(net):
    """Read the net's PriorBox layers as TextBoxes' fork does (MhLiao/TextBoxes prior_box_layer.cpp):
    every prior followed by its copy centred half a cell lower, what TextBoxes++ calls
    denser_prior_boxes.  Marks them on `net` (a copy); returns the note to show."""
    changed = [lp.name for lp in net.layer if lp.type == "PriorBox"
               and not lp.prior_box_param.HasField("denser_prior_boxes")]
    for lp in net.layer:
        if lp.name in changed:
            lp.prior_box_param.denser_prior_boxes = True
    return (f"PriorBox read as TextBoxes' (each prior doubled, its copy half a cell lower), as the loc "
            f"predictions require: {', '.join(changed)}")


def _lists_an_inverse_pair(p):
    """SSTD's sign: flip with an aspect ratio and its inverse both listed (SSD would drop the second)."""
    ratios = list(p.aspect_ratio)
    return p.flip and any(abs(a * b - 1.0) < 1e-6 and abs(a - 1.0) >= 1e-6
                          for i, a in enumerate(ratios) for b in ratios[i + 1:])


def fork_priors(net):
    """Read the net's unmarked PriorBox layers as the fork whose precondition each meets: OpenCV's
    offset pairs where offset_w and offset_h come in equal numbers (priorbox_opencv_pairs.py), SSTD's
    where one of the rest lists an aspect ratio and its inverse with flip, and FaceBoxes' (see the module
    doc) when one of them has exactly 3 min_size (the fork's 21-prior rule).  Marks them on `net` (a copy);
    returns the note."""
    boxes = [lp for lp in net.layer if lp.type == "PriorBox" and not lp.prior_box_param.denser_prior_boxes
             and not opencv_pairs.marked(lp.prior_box_param)]
    pairs = [lp for lp in boxes if opencv_pairs.claims(lp.prior_box_param)
             and not (len(lp.prior_box_param.width) or len(lp.prior_box_param.height))]
    rest = [lp for lp in boxes if lp not in pairs]
    notes = []
    for lp in pairs:
        lp.prior_box_param.opencv_offset_pairs = True
    if pairs:
        notes.append(f"PriorBox read as OpenCV's (offset_w/offset_h as pairs of centre offsets, not tl_ssd's "
                     f"grid), as the loc predictions require: {', '.join(lp.name for lp in pairs)}")
    if any(_lists_an_inverse_pair(lp.prior_box_param) for lp in rest):
        for lp in rest:
            lp.prior_box_param.sstd_priors = True
        notes.append(f"PriorBox read as SSTD's (aspect ratios drawn linearly, a ratio and its inverse both "
                     f"kept), as the loc predictions require: {', '.join(lp.name for lp in rest)}")
    elif any(len(lp.prior_box_param.min_size) == 3 for lp in rest):
        for lp in rest:
            lp.prior_box_param.faceboxes_priors = True
        notes.append(f"PriorBox read as FaceBoxes' (21 priors per cell for 3 min_size, dense anchors for min_size "
                     f"32 and 64), as the loc predictions require: {', '.join(lp.name for lp in rest)}")
    elif not pairs and any(len(lp.prior_box_param.max_size) for lp in rest):
        # dreadlord1984/SSD_windows_caffe 3014c48 prior_box_layer.cpp built with NO_SQRT: max_size is
        # checked but gives no sqrt(min_size * max_size) prior
        for lp in rest:
            lp.prior_box_param.no_sqrt_prior = True
        notes.append(f"PriorBox read as SSD_windows_caffe's NO_SQRT build (max_size gives no sqrt(min_size * "
                     f"max_size) prior), as the loc predictions require: {', '.join(lp.name for lp in rest)}")
    # with nothing marked the second build fails as the first
    return "; ".join(notes) or "no PriorBox has FaceBoxes' 3 min_size, OpenCV's offset pairs or a max_size"


@register_layer("PriorBox")
class PriorBoxLayer(Layer):
    def parse(self, lp):
        need_blobs(lp, "PriorBox", 2, roles="feature map, image")
        p = lp.prior_box_param
        if opencv_pairs.marked(p):   # OpenCV's offset pairs (fork_priors marks them)
            return opencv_pairs.parse(p, self._shared(p))
        grid = offset_grid.claims(p)   # tl_ssd's offset grid
        for f in ("width", "height") if grid else ("offset_h", "offset_w", "width", "height"):
            if f in p.DESCRIPTOR.fields_by_name and len(getattr(p, f)):
                raise LayerError(f"prior_box_param.{f} is an OpenCV-only field that caffeq does not support")
        if fixed_size.claims(p):   # faceboxes_lqy's fixed_size anchors
            if grid:
                raise LayerError("prior_box_param: tl_ssd's offset_w/offset_h do not combine with fixed_size")
            return fixed_size.parse(p, self._shared(p))
        if not len(p.min_size):
            raise LayerError("prior_box_param.min_size is required")
        if any(m <= 0 for m in p.min_size):
            raise LayerError(f"prior_box_param.min_size must be positive, got {list(p.min_size)}")
        # SSD keeps the sizes as float but reads them back as int
        min_sizes = [int(m) for m in p.min_size]
        max_sizes, early = [], []
        if len(p.max_size):
            if len(p.max_size) != len(p.min_size):
                raise LayerError(f"prior_box_param has {len(p.max_size)} max_size for "
                                 f"{len(p.min_size)} min_size; give one per min_size")
            for lo, hi in zip(p.min_size, p.max_size):
                if not hi > 0:
                    raise LayerError(f"prior_box_param.max_size must be positive, got {hi}")
                if not hi > lo:
                    # SSD's 2016 development history (copied into lzx1413/CAFFE_SSD and other forks) only
                    # checked max_size > 0; the later CHECK_GT(max_size, min_size) refuses it
                    early.append(f"max_size {hi:g} with min_size {lo:g}")
            max_sizes = [int(m) for m in p.max_size]
            if proto_field(p, "no_sqrt_prior", False):   # fork_priors' NO_SQRT reading: checked, unused
                max_sizes = []
        flip = bool(p.flip)
        sstd = proto_field(p, "sstd_priors", False)
        ratios = [1.0]
        for ar in p.aspect_ratio:
            if ar <= 0:
                raise LayerError(f"prior_box_param.aspect_ratio must be positive, got {ar}")
            if any(abs(ar - r) < 1e-6 for r in ratios):
                continue
            ratios.append(float(ar))
            if flip and not sstd:   # SSTD flips each box itself (sstd_sizes)
                ratios.append(1.0 / float(np.float32(ar)))
        if sstd:
            for other in ("denser_prior_boxes", "faceboxes_priors", "tf", "yx_order"):
                if proto_field(p, other, False):
                    raise LayerError(f"prior_box_param: SSTD's PriorBox does not combine with {other}")
            return {**self._shared(p), "min_sizes": [float(np.float32(m)) for m in p.min_size],
                    "max_sizes": [int(m) for m in p.max_size], "ratios": ratios, "flip": flip, "sstd": True}
        if proto_field(p, "tf", False) and (proto_field(p, "denser_prior_boxes", False)
                                            or proto_field(p, "faceboxes_priors", False)):
            raise LayerError("prior_box_param.tf (synopsys-caffe) does not combine with denser_prior_boxes "
                             "or FaceBoxes' priors")
        if not proto_field(p, "use_default", True):
            # 03100076/BDIG's PriorBox: no square box; it declares len(ratios) x len(min_size) priors, which a
            # listed ratio of 1 (kept, then skipped) or a max_size (a box per ratio) would not fill exactly
            if max_sizes or any(abs(r - 1.0) < 1e-6 for r in p.aspect_ratio) or len(ratios) == 1:
                raise LayerError("prior_box_param.use_default: false (BDIG) takes aspect ratios other than 1 and no "
                                 "max_size (its PriorBox would not fill the priors it declares)")
            for other in ("denser_prior_boxes", "faceboxes_priors", "tf", "yx_order", "sstd_priors"):
                if proto_field(p, other, False):
                    raise LayerError(f"prior_box_param.use_default: false (BDIG) does not combine with {other}")
        attrs = {**self._shared(p), "min_sizes": min_sizes, "max_sizes": max_sizes, "ratios": ratios,
                 "no_square": not proto_field(p, "use_default", True),
                 "denser": bool(proto_field(p, "denser_prior_boxes", False)),
                 "faceboxes": self._faceboxes(p, min_sizes, max_sizes, ratios),
                 "tf": bool(proto_field(p, "tf", False)), "yx": bool(proto_field(p, "yx_order", False))}
        if early:
            attrs["reading_notes"] = [f"prior_box_param {', '.join(early)}: not greater, which SSD's 2016 code "
                                      f"accepted (the sqrt(min_size x max_size) prior as written); later SSD refuses it"]
        return offset_grid.parse(p, attrs) if grid else attrs

    @staticmethod
    def _shared(p):
        """attrs every reading shares: variance, img_h/img_w, step_h/step_w, offset, clip."""
        var = [float(v) for v in p.variance]
        if len(var) > 1 and len(var) != 4:
            raise LayerError(f"prior_box_param.variance needs 1 or 4 values, got {len(var)}")
        if any(v <= 0 for v in var):
            raise LayerError(f"prior_box_param.variance must be positive, got {var}")
        img_h, img_w = prior_hw_fields(p, "img_size", "img_h", "img_w", int)
        step_h, step_w = prior_hw_fields(p, "step", "step_h", "step_w", float)
        # SSD's default clip (false); OpenCV's importer clips when the field is absent
        return {"clip": bool(p.clip) if p.HasField("clip") else False, "variance": var or [0.1],
                "img_h": img_h, "img_w": img_w, "step_h": step_h, "step_w": step_w, "offset": float(p.offset)}

    @staticmethod
    def _faceboxes(p, min_sizes, max_sizes, ratios):
        """FaceBoxes' reading (faceboxes_priors marks it): True, once its box count is checked."""
        if not proto_field(p, "faceboxes_priors", False):
            return False
        if proto_field(p, "denser_prior_boxes", False):
            raise LayerError("prior_box_param: FaceBoxes' priors and denser_prior_boxes do not combine")
        declared = (21 if len(min_sizes) == 3 else len(ratios) * len(min_sizes)) + len(max_sizes)
        written = (sum(len(faceboxes_offsets(m)) for m in min_sizes) + len(max_sizes)
                   + len(min_sizes) * (len(ratios) - 1))
        if declared != written:
            raise LayerError(f"prior_box_param.min_size {min_sizes}: FaceBoxes' PriorBox declares {declared} "
                             f"priors per cell but writes {written}")
        return True

    @staticmethod
    def num_priors(attrs):
        if attrs.get("offset_grid"):
            return offset_grid.num_priors(attrs)
        if attrs.get("opencv_pairs"):
            return opencv_pairs.num_priors(attrs)
        if attrs.get("fixed_size"):
            return fixed_size.num_priors(attrs)
        if attrs.get("faceboxes") or attrs.get("sstd"):
            return len(prior_sizes(attrs))
        if attrs.get("no_square"):
            return (len(attrs["ratios"]) - 1) * len(attrs["min_sizes"])
        n = len(attrs["ratios"]) * len(attrs["min_sizes"]) + len(attrs["max_sizes"])
        return 2 * n if attrs.get("denser") else n

    def infer(self, attrs, in_shapes):
        feat, img = in_shapes
        if len(feat) < 2 or len(img) < 2:
            raise LayerError(f"PriorBox needs spatial bottoms, got {list(feat)} and {list(img)}")
        h, w = legacy_hw(feat)
        n = h * w * self.num_priors(attrs) * 4
        if n <= 0:
            raise LayerError(f"feature map {list(feat)} gives no priors")
        return [(1, 2, n)]

    def forward(self, attrs, params, feat, img):
        arr = prior_boxes(attrs, legacy_hw(feat.shape), legacy_hw(img.shape))
        return torch.from_numpy(arr).to(device=feat.device, dtype=feat.dtype)

    def onnx(self, ctx, node):
        # the output depends only on the (static) spatial sizes, never on the batch
        arr = prior_boxes(node.attrs, legacy_hw(ctx.shape(node.inputs[0])), legacy_hw(ctx.shape(node.inputs[1])))
        ctx.add_node("Identity", [ctx.const(arr, node.name + "_priors")], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        # computed from the bottoms' spatial sizes at run time, as forward (never from their values)
        a = node.attrs
        if a.get("offset_grid"):
            return offset_grid.pytorch_source(node, emit)
        if a.get("opencv_pairs"):
            return opencv_pairs.pytorch_source(node, emit)
        if a.get("fixed_size"):
            return fixed_size.pytorch_source(node, emit)
        widths, heights, shifted, variance = _module_args(a)
        args = [f"widths={emit.lit(widths)}", f"heights={emit.lit(heights)}", f"shifted={emit.lit(shifted)}",
                f"variance={emit.lit(variance)}"]
        if a["img_h"] and a["img_w"]:
            args += [f"img_h={a['img_h']}", f"img_w={a['img_w']}"]
        if a["step_h"] and a["step_w"]:
            args += [f"step_h={emit.lit(a['step_h'])}", f"step_w={emit.lit(a['step_w'])}"]
        args.append(f"offset={emit.lit(a['offset'])}")
        if a["clip"]:
            args.append("clip=True")
        dx, dy = _offset_args(a)
        if dx:
            args += [f"dx={emit.lit(dx)}", f"dy={emit.lit(dy)}"]
        inset = prior_insets(a)
        if inset:
            args.append(f"inset={emit.lit(inset)}")
        if a.get("yx"):
            args.append("yx=True")
        emit_prior_helpers(emit)
        m = emit.module(f"{emit.helper(TORCH_PRIOR_BOX)}({', '.join(args)})")
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"
