"""SSD's layers (weiliu89/caffe, `ssd` branch): Permute, Normalize, PriorBox, DetectionOutput.

Semantics follow SSD's own code; where OpenCV's importer (the oracle of the
fork_* reference cases) differs, SSD wins and the difference is noted:

- Permute accepts a partial `order` and appends the unlisted axes in order.
- Normalize divides by sqrt(sum x^2 + eps) (over C*H*W, or over C per pixel)
  and multiplies by a learned scale: one value (a 0-axis blob) when
  channel_shared, else one per channel.
- PriorBox's `clip` defaults to false as in SSD since 2016 (caffe.proto here
  carries OpenCV's default, true, so only an explicit `clip` is read).  SSD
  truncates min/max sizes to int.  Its output never depends on the batch.
- DetectionOutput writes, per image, label ascending then score descending,
  exactly as many rows as survive; with no detection at all, one
  [i, -1, -1, -1, -1, -1, -1] row per image.  The static shape reported at load
  time is the most rows it can write (keep_top_k * N), since the real count is
  only known at run time.  save_output_param (writing result files) is ignored.
  ONNX: standard ops (TopK, NonMaxSuppression, NonZero...) give the same rows in
  the same order; only eta < 1 (adaptive NMS) is refused.
"""
import math

import numpy as np
import torch

from ..errors import ExportError
from .registry import Layer, LayerError, register_layer

FLT_MAX = float(np.finfo(np.float32).max)
CORNER, CENTER_SIZE, CORNER_SIZE = 1, 2, 3
_CODE_NAMES = {CORNER: "CORNER", CENTER_SIZE: "CENTER_SIZE", CORNER_SIZE: "CORNER_SIZE"}


def _check_bottoms(lp, n, what):
    if len(lp.bottom) != n:
        raise LayerError(f"{what} takes {n} bottom(s), got {len(lp.bottom)}")


def _reduce_sum_square(ctx, x, axes, out, keepdims=1):
    """ReduceSumSquare with axes as attribute (opset < 18) or input (>= 18)."""
    if ctx.opset >= 18:
        ctx.add_node("ReduceSumSquare", [x, ctx.const(np.array(axes, np.int64))], [out], keepdims=keepdims)
    else:
        ctx.add_node("ReduceSumSquare", [x], [out], axes=list(axes), keepdims=keepdims)
    return out


# ---- Permute ------------------------------------------------------------------

def full_order(order, ndim):
    """SSD's order: the listed axes, then the unlisted ones in their natural order."""
    for o in order:
        if o >= ndim:
            raise LayerError(f"permute_param.order {o} is out of range for a {ndim}-axis input")
    return tuple(order) + tuple(i for i in range(ndim) if i not in order)


@register_layer("Permute")
class Permute(Layer):
    def parse(self, lp):
        _check_bottoms(lp, 1, "Permute")
        order = [int(o) for o in lp.permute_param.order]
        if len(set(order)) != len(order):
            raise LayerError(f"permute_param.order {order} has duplicate axes")
        return {"order": tuple(order)}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        perm = full_order(attrs["order"], len(s))
        return [tuple(s[p] for p in perm)]

    def forward(self, attrs, params, x):
        perm = full_order(attrs["order"], x.dim())
        return x.permute(perm)

    def onnx(self, ctx, node):
        perm = full_order(node.attrs["order"], len(ctx.shape(node.inputs[0])))
        ctx.add_node("Transpose", [node.inputs[0]], [node.outputs[0]], name=node.name, perm=list(perm))

    def pytorch_source(self, node, emit):
        perm = full_order(node.attrs["order"], len(emit.in_shape(0)))
        x = emit.inputs[0]
        return [x] if perm == tuple(range(len(perm))) else f"{x}.permute({list(perm)})"


# ---- Normalize ------------------------------------------------------------------

TORCH_NORMALIZE = """
    class Normalize(nn.Module):
        \"\"\"SSD's Normalize: x / sqrt(sum of x^2 + eps) * weight; the sum runs over C (per pixel) or
        over C, H, W (across_spatial); one weight per channel, or one for all (channel_shared).\"\"\"

        def __init__(self, channels, across_spatial=False, channel_shared=False, eps=1e-10):
            super().__init__()
            self.across_spatial, self.channel_shared, self.eps = across_spatial, channel_shared, eps
            self.weight = nn.Parameter(torch.ones(() if channel_shared else (channels,)))

        def forward(self, x):
            dims = list(range(1, x.dim())) if self.across_spatial else [1]
            norm = torch.sqrt((x * x).sum(dim=dims, keepdim=True) + self.eps)
            y = x / norm
            if self.channel_shared:
                return y * self.weight
            return y * self.weight.reshape([1, -1] + [1] * (x.dim() - 2))
"""


@register_layer("Normalize")
class Normalize(Layer):
    blob_names = ("scale",)

    def parse(self, lp):
        _check_bottoms(lp, 1, "Normalize")
        p = lp.norm_param
        attrs = {"across_spatial": bool(p.across_spatial), "channel_shared": bool(p.channel_shared),
                 "eps": float(p.eps), "fill": 1.0}
        if p.HasField("scale_filler"):
            f = p.scale_filler
            if f.type != "constant":
                raise LayerError(f"norm_param.scale_filler type '{f.type}': only 'constant' is supported "
                                 f"for filling a missing scale blob")
            attrs["fill"] = float(f.value)
        if attrs["eps"] < 0:
            raise LayerError(f"norm_param.eps must be >= 0, got {attrs['eps']}")
        return attrs

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        # SSD reads num/channels/height/width, which exist for 2 to 4 axes only
        if not 2 <= len(s) <= 4:
            raise LayerError(f"Normalize needs a 2- to 4-axis input, got {list(s)}")
        return [tuple(s)]

    def param_shapes(self, attrs, in_shapes):
        # channel_shared: SSD makes a 0-axis blob (one value, no shape)
        return [()] if attrs["channel_shared"] else [(in_shapes[0][1],)]

    def init_params(self, attrs, shapes, rng):
        return [np.full(shapes[0], attrs["fill"], np.float32)]

    def forward(self, attrs, params, x):
        scale = params[0]
        dims = tuple(range(1, x.dim())) if attrs["across_spatial"] else (1,)
        norm = torch.sqrt((x * x).sum(dim=dims, keepdim=True) + attrs["eps"])
        y = x / norm
        if attrs["channel_shared"]:
            return y * scale.reshape(())
        return y * scale.reshape((1, -1) + (1,) * (x.dim() - 2))

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        rank = len(ctx.shape(x))
        axes = list(range(1, rank)) if a["across_spatial"] else [1]
        ss = _reduce_sum_square(ctx, x, axes, ctx.tmp(node.name + "_ss"))
        eps = ctx.const(np.array(a["eps"], np.float32), node.name + "_eps")
        sse = ctx.add_node("Add", [ss, eps], [ctx.tmp(node.name + "_sse")])[0]
        norm = ctx.add_node("Sqrt", [sse], [ctx.tmp(node.name + "_norm")])[0]
        y = ctx.add_node("Div", [x, norm], [ctx.tmp(node.name + "_unit")], name=node.name)[0]
        scale = ctx.weight(node, 0)
        if not a["channel_shared"] and rank > 2:
            shaped = ctx.tmp(node.name + "_scale_c11")
            ctx.add_node("Reshape", [scale, ctx.const(np.array([-1] + [1] * (rank - 2), np.int64))], [shaped])
            scale = shaped
        ctx.add_node("Mul", [y, scale], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [str(emit.in_shape(0)[1])]
        if a["across_spatial"]:
            args.append("across_spatial=True")
        if a["channel_shared"]:
            args.append("channel_shared=True")
        args.append(f"eps={emit.lit(a['eps'])}")
        m = emit.module(f"{emit.helper(TORCH_NORMALIZE)}({', '.join(args)})")
        emit.param("weight", 0)
        return f"{m}({emit.inputs[0]})"


# ---- PriorBox -------------------------------------------------------------------

def _prior_box_hw(p, both, h, w, cast):
    """(height, width) from prior_box_param's `h`/`w` pair or its single `both` field; (0, 0) when unset."""
    if p.HasField(h) or p.HasField(w):
        if p.HasField(both):
            raise LayerError(f"prior_box_param: give {both} or {h}/{w}, not both")
        vh, vw = cast(getattr(p, h)), cast(getattr(p, w))
        if vh <= 0 or vw <= 0:
            raise LayerError(f"prior_box_param.{h}/{w} must be positive, got {vh}/{vw}")
        return vh, vw
    if p.HasField(both):
        v = getattr(p, both)
        if v <= 0:
            raise LayerError(f"prior_box_param.{both} must be positive, got {v}")
        return cast(v), cast(v)
    return cast(0), cast(0)


@register_layer("PriorBox")
class PriorBox(Layer):
    def parse(self, lp):
        _check_bottoms(lp, 2, "PriorBox")
        p = lp.prior_box_param
        for f in ("offset_h", "offset_w", "width", "height"):
            if len(getattr(p, f)):
                raise LayerError(f"prior_box_param.{f} is an OpenCV-only field that caffeq does not support")
        if not len(p.min_size):
            raise LayerError("prior_box_param.min_size is required")
        if any(m <= 0 for m in p.min_size):
            raise LayerError(f"prior_box_param.min_size must be positive, got {list(p.min_size)}")
        # SSD keeps the sizes as float but reads them back as int
        min_sizes = [int(m) for m in p.min_size]
        max_sizes = []
        if len(p.max_size):
            if len(p.max_size) != len(p.min_size):
                raise LayerError(f"prior_box_param has {len(p.max_size)} max_size for "
                                 f"{len(p.min_size)} min_size; give one per min_size")
            for lo, hi in zip(p.min_size, p.max_size):
                if not hi > lo:
                    raise LayerError(f"prior_box_param.max_size {hi} must be greater than min_size {lo}")
            max_sizes = [int(m) for m in p.max_size]
        flip = bool(p.flip)
        ratios = [1.0]
        for ar in p.aspect_ratio:
            if ar <= 0:
                raise LayerError(f"prior_box_param.aspect_ratio must be positive, got {ar}")
            if any(abs(ar - r) < 1e-6 for r in ratios):
                continue
            ratios.append(float(ar))
            if flip:
                ratios.append(1.0 / float(np.float32(ar)))
        var = [float(v) for v in p.variance]
        if len(var) > 1 and len(var) != 4:
            raise LayerError(f"prior_box_param.variance needs 1 or 4 values, got {len(var)}")
        if any(v <= 0 for v in var):
            raise LayerError(f"prior_box_param.variance must be positive, got {var}")
        if not var:
            var = [0.1]
        img_h, img_w = _prior_box_hw(p, "img_size", "img_h", "img_w", int)
        step_h, step_w = _prior_box_hw(p, "step", "step_h", "step_w", float)
        return {"min_sizes": min_sizes, "max_sizes": max_sizes, "ratios": ratios,
                # SSD's default (false); OpenCV's importer clips when the field is absent
                "clip": bool(p.clip) if p.HasField("clip") else False,
                "variance": var, "img_h": img_h, "img_w": img_w,
                "step_h": step_h, "step_w": step_w, "offset": float(p.offset)}

    @staticmethod
    def num_priors(attrs):
        return len(attrs["ratios"]) * len(attrs["min_sizes"]) + len(attrs["max_sizes"])

    def infer(self, attrs, in_shapes):
        feat, img = in_shapes
        if len(feat) < 2 or len(img) < 2:
            raise LayerError(f"PriorBox needs spatial bottoms, got {list(feat)} and {list(img)}")
        h, w = _hw(feat)
        n = h * w * self.num_priors(attrs) * 4
        if n <= 0:
            raise LayerError(f"feature map {list(feat)} gives no priors")
        return [(1, 2, n)]

    def forward(self, attrs, params, feat, img):
        arr = prior_boxes(attrs, _hw(feat.shape), _hw(img.shape))
        return torch.from_numpy(arr).to(device=feat.device, dtype=feat.dtype)

    def onnx(self, ctx, node):
        # the output depends only on the (static) spatial sizes, never on the batch
        arr = prior_boxes(node.attrs, _hw(ctx.shape(node.inputs[0])), _hw(ctx.shape(node.inputs[1])))
        ctx.add_node("Identity", [ctx.const(arr, node.name + "_priors")], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        # computed from the bottoms' spatial sizes at run time, as forward (never from their values)
        a = node.attrs
        sizes = prior_sizes(a)
        args = [f"widths={emit.lit([float(w) for w, _ in sizes])}",
                f"heights={emit.lit([float(h) for _, h in sizes])}",
                f"variance={emit.lit([float(v) for v in a['variance']])}"]
        if a["img_h"] and a["img_w"]:
            args += [f"img_h={a['img_h']}", f"img_w={a['img_w']}"]
        if a["step_h"] and a["step_w"]:
            args += [f"step_h={emit.lit(a['step_h'])}", f"step_w={emit.lit(a['step_w'])}"]
        args.append(f"offset={emit.lit(a['offset'])}")
        if a["clip"]:
            args.append("clip=True")
        m = emit.module(f"{emit.helper(TORCH_PRIOR_BOX)}({', '.join(args)})")
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"


TORCH_PRIOR_BOX = """
    class PriorBox(nn.Module):
        \"\"\"SSD's PriorBox: for each feature-map cell (row-major) and prior, the corners [xmin, ymin,
        xmax, ymax] normalized by the image size, then the variances: (1, 2, H * W * P * 4).  Only the
        spatial sizes of `feat` and `img` (or img_h, img_w) matter, never their values.  widths and
        heights: each prior's box size (float32) in SSD's order.\"\"\"

        def __init__(self, widths, heights, variance, img_h=0, img_w=0, step_h=0.0, step_w=0.0,
                     offset=0.5, clip=False):
            super().__init__()
            self.widths, self.heights, self.variance = widths, heights, variance
            self.img_h, self.img_w, self.step_h, self.step_w = img_h, img_w, step_h, step_w
            self.offset, self.clip = offset, clip

        def forward(self, feat, img):
            f32 = torch.float32
            lh = feat.shape[2] if feat.dim() > 2 else 1
            lw = feat.shape[3] if feat.dim() > 3 else 1
            if self.img_h and self.img_w:
                ih, iw = self.img_h, self.img_w
            else:
                ih = img.shape[2] if img.dim() > 2 else 1
                iw = img.shape[3] if img.dim() > 3 else 1
            if self.step_h and self.step_w:
                sh, sw = torch.tensor(self.step_h, dtype=f32), torch.tensor(self.step_w, dtype=f32)
            else:  # image size / feature-map size in float32, as SSD
                sh = torch.tensor(float(ih), dtype=f32) / torch.tensor(float(lh), dtype=f32)
                sw = torch.tensor(float(iw), dtype=f32) / torch.tensor(float(lw), dtype=f32)
            bw = torch.tensor(self.widths, dtype=f32).double()
            bh = torch.tensor(self.heights, dtype=f32).double()
            off = torch.tensor(self.offset, dtype=f32)
            # cell centers in float32, corners in double, then float32: SSD's float/double mix
            cx = ((torch.arange(lw, dtype=f32) + off) * sw).double()[None, :, None]
            cy = ((torch.arange(lh, dtype=f32) + off) * sh).double()[:, None, None]
            boxes = torch.stack(torch.broadcast_tensors((cx - bw / 2.0) / iw, (cy - bh / 2.0) / ih,
                                                        (cx + bw / 2.0) / iw, (cy + bh / 2.0) / ih), dim=-1)
            coords = boxes.float().reshape(-1)
            if self.clip:
                coords = coords.clamp(0.0, 1.0)
            var = torch.tensor(self.variance, dtype=f32)
            variances = var.repeat(coords.numel() // var.numel())  # one value for all, or 4 per prior
            out = torch.stack([coords, variances]).reshape(1, 2, -1)
            return out.to(device=feat.device, dtype=feat.dtype)
"""


def _hw(shape):
    """Caffe's legacy height()/width(): axes 2 and 3, 1 where the blob has fewer axes."""
    shape = tuple(shape)
    h = shape[2] if len(shape) > 2 else 1
    w = shape[3] if len(shape) > 3 else 1
    return int(h), int(w)


def prior_sizes(attrs):
    """Box (width, height) per prior as float32, in SSD's order: min, sqrt(min*max), other ratios."""
    f32 = np.float32
    sizes = []
    for k, mn in enumerate(attrs["min_sizes"]):
        sizes.append((f32(mn), f32(mn)))
        if attrs["max_sizes"]:
            s = f32(math.sqrt(mn * attrs["max_sizes"][k]))
            sizes.append((s, s))
        for ar in attrs["ratios"]:
            if abs(ar - 1.0) < 1e-6:
                continue
            r = math.sqrt(float(f32(ar)))
            sizes.append((f32(mn * r), f32(mn / r)))
    return sizes


def prior_boxes(attrs, feat_hw, img_hw):
    """SSD's PriorBox output (1, 2, H*W*num_priors*4) as float32, computed as SSD does."""
    f32 = np.float32
    lh, lw = feat_hw
    if attrs["img_h"] and attrs["img_w"]:
        ih, iw = attrs["img_h"], attrs["img_w"]
    else:
        ih, iw = img_hw
    if attrs["step_h"] and attrs["step_w"]:
        sh, sw = f32(attrs["step_h"]), f32(attrs["step_w"])
    else:
        sh, sw = f32(f32(ih) / f32(lh)), f32(f32(iw) / f32(lw))
    sizes = prior_sizes(attrs)
    bw = np.array([s[0] for s in sizes], np.float64)
    bh = np.array([s[1] for s in sizes], np.float64)
    off = f32(attrs["offset"])
    cx = ((np.arange(lw, dtype=f32) + off) * sw).astype(np.float64)   # float, as SSD's center_x
    cy = ((np.arange(lh, dtype=f32) + off) * sh).astype(np.float64)
    cx = cx[None, :, None]
    cy = cy[:, None, None]
    boxes = np.stack(np.broadcast_arrays((cx - bw / 2.0) / iw, (cy - bh / 2.0) / ih,
                                         (cx + bw / 2.0) / iw, (cy + bh / 2.0) / ih), axis=-1)
    coords = boxes.astype(np.float32).reshape(-1)
    if attrs["clip"]:
        coords = np.clip(coords, 0.0, 1.0)
    var = np.array(attrs["variance"], np.float32)
    variances = np.tile(var, coords.size // var.size)   # one value for all, or 4 per prior
    return np.stack([coords, variances]).reshape(1, 2, -1).astype(np.float32)


# ---- DetectionOutput --------------------------------------------------------------

@register_layer("DetectionOutput")
class DetectionOutput(Layer):
    #: the row count is known only after a run; infer gives the most rows (keep_top_k * N)
    data_dependent_shape = True

    def parse(self, lp):
        if len(lp.bottom) != 3:
            raise LayerError(f"DetectionOutput takes 3 bottoms (loc, conf, priors), got {len(lp.bottom)}")
        p = lp.detection_output_param
        if not p.HasField("num_classes"):
            raise LayerError("detection_output_param.num_classes is required")
        nms = p.nms_param
        attrs = {
            "num_classes": int(p.num_classes),
            "share_location": bool(p.share_location),
            "background": int(p.background_label_id),
            "nms_threshold": float(nms.nms_threshold),
            "eta": float(nms.eta),
            "top_k": int(nms.top_k) if nms.HasField("top_k") else -1,
            "code_type": int(p.code_type),
            "variance_in_target": bool(p.variance_encoded_in_target),
            "keep_top_k": int(p.keep_top_k),
            "conf_threshold": float(p.confidence_threshold) if p.HasField("confidence_threshold") else -FLT_MAX,
            "clip": bool(p.clip),  # OpenCV-only field: clip decoded boxes to [0, 1]
        }
        if attrs["num_classes"] < 1:
            raise LayerError("detection_output_param.num_classes must be >= 1")
        if attrs["nms_threshold"] < 0:
            raise LayerError(f"nms_param.nms_threshold must be >= 0, got {attrs['nms_threshold']}")
        if not 0 < attrs["eta"] <= 1:
            raise LayerError(f"nms_param.eta must be in (0, 1], got {attrs['eta']}")
        if attrs["code_type"] not in _CODE_NAMES:
            raise LayerError(f"detection_output_param.code_type {attrs['code_type']} is unknown")
        if p.HasField("normalized_bbox") and not p.normalized_bbox:
            raise LayerError("detection_output_param.normalized_bbox: false (OpenCV-only, pixel boxes) "
                             "is not supported")
        return attrs

    def infer(self, attrs, in_shapes):
        loc, conf, prior = in_shapes
        if len(prior) < 3 or prior[1] != 2 or prior[2] % 4:
            raise LayerError(f"priors must be shaped (1, 2, 4 * num_priors), got {list(prior)}")
        n_priors = prior[2] // 4
        n_loc = 1 if attrs["share_location"] else attrs["num_classes"]
        if len(loc) < 2 or math.prod(loc[1:]) != n_priors * n_loc * 4:
            raise LayerError(f"loc {list(loc)} does not hold {n_priors} priors x {n_loc} x 4 predictions")
        if len(conf) < 2 or math.prod(conf[1:]) != n_priors * attrs["num_classes"]:
            raise LayerError(f"conf {list(conf)} does not hold {n_priors} priors x "
                             f"{attrs['num_classes']} class scores")
        if loc[0] != conf[0]:
            raise LayerError(f"loc and conf disagree on the batch: {loc[0]} vs {conf[0]}")
        return [(1, 1, max_detections(attrs, loc[0], n_priors), 7)]

    def forward(self, attrs, params, loc, conf, prior):
        return detection_output(attrs, loc, conf, prior)

    def onnx(self, ctx, node):
        emit_detection_output(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [str(a["num_classes"])]
        if not a["share_location"]:
            args.append("share_location=False")
        args.append(f"background={a['background']}")
        args.append(f"nms_threshold={emit.lit(a['nms_threshold'])}")
        if a["eta"] != 1:
            args.append(f"eta={emit.lit(a['eta'])}")
        if a["top_k"] > -1:
            args.append(f"top_k={a['top_k']}")
        args.append(f"code_type={emit.lit(_CODE_NAMES[a['code_type']])}")
        if a["variance_in_target"]:
            args.append("variance_in_target=True")
        if a["keep_top_k"] > -1:
            args.append(f"keep_top_k={a['keep_top_k']}")
        if a["conf_threshold"] > -FLT_MAX:
            args.append(f"conf_threshold={emit.lit(a['conf_threshold'])}")
        if a["clip"]:
            args.append("clip=True")
        emit.note(f"{node.name} (DetectionOutput): the number of rows depends on the data (at most "
                  f"{emit.out_shape(0)[2]} at the prototxt's batch size); NMS runs eagerly on the CPU "
                  f"(ssd_nms), so this layer does not trace or export to a static graph.")
        m = emit.module(f"{emit.helper(TORCH_DETECTION_OUTPUT)}({', '.join(args)})")
        return f"{m}({', '.join(emit.inputs)})"


def max_detections(attrs, num, n_priors):
    """Rows DetectionOutput can write at most (the static shape; the real count is data dependent)."""
    if attrs["keep_top_k"] > -1:
        return attrs["keep_top_k"] * num
    classes = attrs["num_classes"] - (0 <= attrs["background"] < attrs["num_classes"])
    per_class = n_priors if attrs["top_k"] < 0 else min(attrs["top_k"], n_priors)
    return max(1, num * classes * per_class)


def decode_boxes(attrs, loc, pbox, pvar):
    """SSD's DecodeBBox.  loc (..., P, 4), pbox/pvar (P, 4) -> corners (..., P, 4)."""
    if attrs["variance_in_target"]:
        pvar = torch.ones_like(pvar)
    code = attrs["code_type"]
    if code == CORNER:
        return pbox + pvar * loc
    pw = pbox[:, 2] - pbox[:, 0]
    ph = pbox[:, 3] - pbox[:, 1]
    if code == CORNER_SIZE:
        size = torch.stack([pw, ph, pw, ph], dim=-1)
        return pbox + pvar * loc * size
    pcx = (pbox[:, 0] + pbox[:, 2]) / 2
    pcy = (pbox[:, 1] + pbox[:, 3]) / 2
    cx = pvar[:, 0] * loc[..., 0] * pw + pcx
    cy = pvar[:, 1] * loc[..., 1] * ph + pcy
    w = torch.exp(pvar[:, 2] * loc[..., 2]) * pw
    h = torch.exp(pvar[:, 3] * loc[..., 3]) * ph
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def box_sizes(b):
    """SSD's BBoxSize (normalized): 0 for a box with xmax < xmin or ymax < ymin."""
    w = b[..., 2] - b[..., 0]
    h = b[..., 3] - b[..., 1]
    return np.where((w < 0) | (h < 0), np.float32(0), w * h).astype(np.float32)


def overlaps(a, b, size_a, size_b):
    """SSD's JaccardOverlap (float32, normalized boxes) of boxes a (M, 4) against b (K, 4) -> (M, K).

    Disjoint boxes (and flipped ones, which SSD gives size 0) have a non-positive
    intersection width or height, so clamping those at 0 gives SSD's 0.
    """
    a = np.ascontiguousarray(a.T)
    b = np.ascontiguousarray(b.T)
    iw = np.minimum.outer(a[2], b[2])
    iw -= np.maximum.outer(a[0], b[0])
    ih = np.minimum.outer(a[3], b[3])
    ih -= np.maximum.outer(a[1], b[1])
    np.maximum(iw, 0, out=iw)
    np.maximum(ih, 0, out=ih)
    inter = np.multiply(iw, ih, out=iw)
    union = np.add.outer(size_a, size_b)
    union -= inter
    out = np.zeros_like(inter)
    np.divide(inter, union, out=out, where=inter > 0)
    return out


_FULL_IOU_MAX = 2048   # candidates up to which the whole IoU matrix is computed at once


def nms_fast(boxes, scores, score_threshold, nms_threshold, eta, top_k):
    """SSD's ApplyNMSFast: indices kept, in score-descending order."""
    cand = np.flatnonzero(scores > score_threshold)
    if cand.size == 0:
        return []
    order = cand[np.argsort(-scores[cand], kind="stable")]
    if top_k > -1:
        order = order[:top_k]
    b = boxes[order]
    sizes = box_sizes(b)
    k = len(order)
    full = overlaps(b, b, sizes, sizes) if k <= _FULL_IOU_MAX else None
    # candidate j is kept when its IoU with every kept box is <= the threshold in force when j
    # is examined; a running max of IoU against kept boxes gives that exactly, with eta too
    worst = np.zeros(k, np.float32)
    thr = np.float32(nms_threshold)
    kept = []
    for j in range(k):
        if worst[j] > thr:
            continue
        kept.append(int(order[j]))
        if j + 1 < k:
            row = full[j, j + 1:] if full is not None else \
                overlaps(b[j:j + 1], b[j + 1:], sizes[j:j + 1], sizes[j + 1:])[0]
            np.maximum(worst[j + 1:], row, out=worst[j + 1:])
        if eta < 1 and thr > 0.5:
            thr = np.float32(thr * np.float32(eta))
    return kept


def detection_output(attrs, loc, conf, prior):
    num = loc.shape[0]
    n_priors = prior.shape[-1] // 4
    n_cls = attrs["num_classes"]
    n_loc = 1 if attrs["share_location"] else n_cls
    bg = attrs["background"]
    loc = loc.reshape(num, n_priors, n_loc, 4)
    conf = conf.reshape(num, n_priors, n_cls)
    pri = prior.reshape(-1, 2, n_priors * 4)[0]   # every image shares the first item's priors
    pbox, pvar = pri[0].reshape(n_priors, 4), pri[1].reshape(n_priors, 4)
    decoded = decode_boxes(attrs, loc.transpose(1, 2), pbox, pvar)   # (N, L, P, 4)
    if attrs["clip"]:
        decoded = decoded.clamp(0.0, 1.0)
    boxes_np = decoded.detach().float().cpu().numpy()
    scores_np = conf.detach().float().cpu().numpy()

    picks = []   # (image, label, prior) in SSD's output order
    for i in range(num):
        per_label = {}
        for c in range(n_cls):
            if c == bg:
                continue
            scores = scores_np[i, :, c]
            boxes = boxes_np[i, 0 if attrs["share_location"] else c]
            per_label[c] = nms_fast(boxes, scores, attrs["conf_threshold"], attrs["nms_threshold"],
                                    attrs["eta"], attrs["top_k"])
        total = sum(len(v) for v in per_label.values())
        if attrs["keep_top_k"] > -1 and total > attrs["keep_top_k"]:
            pool = [(scores_np[i, idx, c], c, idx) for c in sorted(per_label) for idx in per_label[c]]
            pool.sort(key=lambda t: -t[0])   # stable, as Python's sort is
            per_label = {}
            for _, c, idx in pool[:attrs["keep_top_k"]]:
                per_label.setdefault(c, []).append(idx)
        for c in sorted(per_label):
            picks.extend((i, c, idx) for idx in per_label[c])

    dev, dt = loc.device, loc.dtype
    if not picks:
        out = torch.full((num, 7), -1.0, device=dev, dtype=dt)
        out[:, 0] = torch.arange(num, device=dev, dtype=dt)
        return out.reshape(1, 1, num, 7)
    img = torch.tensor([p[0] for p in picks], device=dev)
    lab = torch.tensor([p[1] for p in picks], device=dev)
    idx = torch.tensor([p[2] for p in picks], device=dev)
    lslot = torch.zeros_like(lab) if attrs["share_location"] else lab
    score = conf[img, idx, lab]
    box = decoded[img, lslot, idx]
    out = torch.cat([img.to(dt)[:, None], lab.to(dt)[:, None], score[:, None].to(dt), box.to(dt)], dim=1)
    return out.reshape(1, 1, -1, 7)


# ---- DetectionOutput as standalone PyTorch source -------------------------------------------
# the same torch calls as decode_boxes/detection_output, and nms_fast's float32 arithmetic in torch

TORCH_DETECTION_OUTPUT = """
    def box_sizes(b):
        \"\"\"SSD's BBoxSize of normalized boxes (..., 4): 0 for a box with xmax < xmin or ymax < ymin.\"\"\"
        w = b[..., 2] - b[..., 0]
        h = b[..., 3] - b[..., 1]
        return torch.where((w < 0) | (h < 0), torch.zeros_like(w), w * h)


    def jaccard_overlaps(a, b, size_a, size_b):
        \"\"\"SSD's JaccardOverlap of boxes a (M, 4) against b (K, 4) -> (M, K), float32.  Disjoint (and
        flipped) boxes have a non-positive intersection width or height: IoU 0.\"\"\"
        iw = torch.minimum(a[:, None, 2], b[None, :, 2]) - torch.maximum(a[:, None, 0], b[None, :, 0])
        ih = torch.minimum(a[:, None, 3], b[None, :, 3]) - torch.maximum(a[:, None, 1], b[None, :, 1])
        inter = torch.clamp(iw, min=0) * torch.clamp(ih, min=0)
        union = size_a[:, None] + size_b[None, :] - inter
        return torch.where(inter > 0, inter / union, torch.zeros_like(inter))


    def ssd_nms(boxes, scores, score_threshold: float, nms_threshold: float, eta: float = 1.0,
                top_k: int = -1):
        \"\"\"SSD's ApplyNMSFast for one class: boxes (P, 4), scores (P,) -> the indices kept, best first.

        The candidates score above score_threshold, best first (ties: lower index first), at most
        top_k of them (-1: all).  A candidate is kept when its IoU with every box kept before it is
        <= the threshold in force; with eta < 1 the threshold shrinks by eta after each kept box
        while it is above 0.5.\"\"\"
        f32 = torch.float32
        cand = torch.nonzero(scores > torch.tensor(score_threshold, dtype=f32)).flatten()
        if cand.numel() == 0:
            return []
        order = cand[torch.sort(-scores[cand], stable=True)[1]]
        if top_k > -1:
            order = order[:top_k]
        b = boxes[order]
        sizes = box_sizes(b)
        k = order.numel()
        full = jaccard_overlaps(b, b, sizes, sizes) if k <= 2048 else None
        worst = torch.zeros(k, dtype=f32)  # each candidate's largest IoU with a kept box so far
        thr = torch.tensor(nms_threshold, dtype=f32)
        kept = []
        for j in range(k):
            if worst[j] > thr:
                continue
            kept.append(int(order[j]))
            if j + 1 < k:
                if full is not None:
                    row = full[j, j + 1:]
                else:
                    row = jaccard_overlaps(b[j:j + 1], b[j + 1:], sizes[j:j + 1], sizes[j + 1:])[0]
                worst[j + 1:] = torch.maximum(worst[j + 1:], row)
            if eta < 1 and thr > 0.5:
                thr = thr * torch.tensor(eta, dtype=f32)
        return kept


    class DetectionOutput(nn.Module):
        \"\"\"SSD's DetectionOutput: loc decoded against the priors (code_type), NMS per class (ssd_nms),
        the keep_top_k best per image, as rows [image, label, score, xmin, ymin, xmax, ymax] shaped
        (1, 1, R, 7): per image, label ascending, then score descending.  With no detection at all,
        one [i, -1, -1, -1, -1, -1, -1] row per image.  R depends on the data.\"\"\"

        def __init__(self, num_classes, share_location=True, background=0, nms_threshold=0.3, eta=1.0,
                     top_k=-1, code_type="CORNER", variance_in_target=False, keep_top_k=-1,
                     conf_threshold=-3.4028235e38, clip=False):
            super().__init__()
            self.num_classes, self.share_location, self.background = num_classes, share_location, background
            self.nms_threshold, self.eta, self.top_k = nms_threshold, eta, top_k
            self.code_type, self.variance_in_target = code_type, variance_in_target
            self.keep_top_k, self.conf_threshold, self.clip = keep_top_k, conf_threshold, clip

        def decode(self, loc, pbox, pvar):
            \"\"\"SSD's DecodeBBox: loc (..., P, 4) against the priors pbox, pvar (P, 4) -> corners.\"\"\"
            if self.variance_in_target:
                pvar = torch.ones_like(pvar)
            if self.code_type == "CORNER":
                return pbox + pvar * loc
            pw = pbox[:, 2] - pbox[:, 0]
            ph = pbox[:, 3] - pbox[:, 1]
            if self.code_type == "CORNER_SIZE":
                size = torch.stack([pw, ph, pw, ph], dim=-1)
                return pbox + pvar * loc * size
            pcx = (pbox[:, 0] + pbox[:, 2]) / 2  # CENTER_SIZE
            pcy = (pbox[:, 1] + pbox[:, 3]) / 2
            cx = pvar[:, 0] * loc[..., 0] * pw + pcx
            cy = pvar[:, 1] * loc[..., 1] * ph + pcy
            w = torch.exp(pvar[:, 2] * loc[..., 2]) * pw
            h = torch.exp(pvar[:, 3] * loc[..., 3]) * ph
            return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)

        def forward(self, loc, conf, prior):
            num = loc.shape[0]
            n_priors = prior.shape[-1] // 4
            n_cls = self.num_classes
            n_loc = 1 if self.share_location else n_cls
            loc = loc.reshape(num, n_priors, n_loc, 4)
            conf = conf.reshape(num, n_priors, n_cls)
            pri = prior.reshape(-1, 2, n_priors * 4)[0]  # every image uses the first item's priors
            pbox, pvar = pri[0].reshape(n_priors, 4), pri[1].reshape(n_priors, 4)
            decoded = self.decode(loc.transpose(1, 2), pbox, pvar)  # (N, n_loc, P, 4)
            if self.clip:
                decoded = decoded.clamp(0.0, 1.0)
            boxes_all = decoded.detach().float().cpu()  # NMS runs on the CPU, in float32
            scores_all = conf.detach().float().cpu()
            picks = []  # (image, label, prior) in SSD's output order
            for i in range(num):
                per_label = {}
                for c in range(n_cls):
                    if c == self.background:
                        continue
                    boxes = boxes_all[i, 0 if self.share_location else c]
                    per_label[c] = ssd_nms(boxes, scores_all[i, :, c], self.conf_threshold,
                                           self.nms_threshold, self.eta, self.top_k)
                total = sum(len(v) for v in per_label.values())
                if self.keep_top_k > -1 and total > self.keep_top_k:
                    # the keep_top_k best over all classes; the stable sort keeps ties in label order
                    pool = [(float(scores_all[i, idx, c]), c, idx) for c in sorted(per_label)
                            for idx in per_label[c]]
                    pool.sort(key=lambda t: -t[0])
                    per_label = {}
                    for _, c, idx in pool[:self.keep_top_k]:
                        per_label.setdefault(c, []).append(idx)
                for c in sorted(per_label):
                    picks.extend((i, c, idx) for idx in per_label[c])
            dev, dt = loc.device, loc.dtype
            if not picks:
                out = torch.full((num, 7), -1.0, device=dev, dtype=dt)
                out[:, 0] = torch.arange(num, device=dev, dtype=dt)
                return out.reshape(1, 1, num, 7)
            img = torch.tensor([p[0] for p in picks], device=dev)
            lab = torch.tensor([p[1] for p in picks], device=dev)
            idx = torch.tensor([p[2] for p in picks], device=dev)
            lslot = torch.zeros_like(lab) if self.share_location else lab
            score = conf[img, idx, lab]
            box = decoded[img, lslot, idx]
            out = torch.cat([img.to(dt)[:, None], lab.to(dt)[:, None], score[:, None].to(dt), box.to(dt)], dim=1)
            return out.reshape(1, 1, -1, 7)
"""


# ---- DetectionOutput as ONNX ops ------------------------------------------------------

def emit_detection_output(ctx, node):
    """DetectionOutput from standard ops, giving SSD's rows in SSD's order.

    Per class, TopK keeps SSD's top_k best candidates (ties: lower prior first, as
    SSD's stable sort), NonMaxSuppression runs on them (ORT keeps score > threshold
    and suppresses IoU > threshold, as SSD), keep_top_k is a TopK over each image's
    survivors, and NonZero over the (image, class, rank) mask lists the rows in
    SSD's order.  With no detection the graph returns SSD's one [i, -1, ...] row
    per image.  Only eta < 1 (adaptive NMS) has no ONNX form.
    """
    a = node.attrs
    if a["eta"] < 1:
        raise ExportError(f"layer '{node.name}' (DetectionOutput): nms_param.eta {a['eta']} < 1 "
                          f"(adaptive NMS) has no ONNX form")
    loc_in, conf_in, prior_in = node.inputs
    P = ctx.shape(prior_in)[-1] // 4
    C = a["num_classes"]
    L = 1 if a["share_location"] else C
    cls = [c for c in range(C) if c != a["background"]]
    K = len(cls)
    if K == 0:
        raise ExportError(f"layer '{node.name}' (DetectionOutput): no class besides the background")
    T = P if a["top_k"] < 0 else min(a["top_k"], P)
    name = node.name
    i64 = lambda v: ctx.const(np.array(v, np.int64))
    f32 = lambda v: ctx.const(np.array(v, np.float32))

    def op(op_type, inputs, hint, **kw):
        return ctx.add_node(op_type, inputs, [ctx.tmp(f"{name}_{hint}")], **kw)[0]

    def last(x, k, hint):   # x[..., k:k+1]
        return op("Slice", [x, i64([k]), i64([k + 1]), i64([-1])], hint)

    # priors: boxes and variances (P, 4), from the first item as SSD does
    pr = op("Slice", [prior_in, i64([0]), i64([1]), i64([0])], "prior0")
    pr = op("Reshape", [pr, i64([2, P, 4])], "prior")
    pbox = op("Gather", [pr, i64(0)], "pbox", axis=0)
    pvar = f32(np.ones((P, 4), np.float32)) if a["variance_in_target"] else op("Gather", [pr, i64(1)], "pvar",
                                                                                 axis=0)
    # loc (N, L, P, 4)
    loc = op("Reshape", [loc_in, i64([0, P, L, 4])], "loc")
    loc = op("Transpose", [loc], "loc_t", perm=[0, 2, 1, 3])
    code = a["code_type"]
    if code == CORNER:
        dec = op("Add", [pbox, op("Mul", [pvar, loc], "vl")], "dec")
    else:
        px0, py0, px1, py1 = (last(pbox, k, f"p{k}") for k in range(4))
        pw = op("Sub", [px1, px0], "pw")
        ph = op("Sub", [py1, py0], "ph")
        vl = op("Mul", [pvar, loc], "vl")
        if code == CORNER_SIZE:
            size = op("Concat", [pw, ph, pw, ph], "psize", axis=-1)
            dec = op("Add", [pbox, op("Mul", [vl, size], "vls")], "dec")
        else:
            half = f32(0.5)
            pcx = op("Mul", [op("Add", [px0, px1], "pxs"), half], "pcx")
            pcy = op("Mul", [op("Add", [py0, py1], "pys"), half], "pcy")
            cx = op("Add", [op("Mul", [last(vl, 0, "v0"), pw], "dx"), pcx], "cx")
            cy = op("Add", [op("Mul", [last(vl, 1, "v1"), ph], "dy"), pcy], "cy")
            hw = op("Mul", [op("Mul", [op("Exp", [last(vl, 2, "v2")], "ew"), pw], "w"), half], "hw")
            hh = op("Mul", [op("Mul", [op("Exp", [last(vl, 3, "v3")], "eh"), ph], "h"), half], "hh")
            dec = op("Concat", [op("Sub", [cx, hw], "x0"), op("Sub", [cy, hh], "y0"),
                                op("Add", [cx, hw], "x1"), op("Add", [cy, hh], "y1")], "dec", axis=-1)
    if a["clip"]:
        dec = op("Clip", [dec, f32(0.0), f32(1.0)], "clip")
    # per class boxes (N, K, P, 4) and scores (N, K, P)
    conf = op("Reshape", [conf_in, i64([0, P, C])], "conf")
    conf = op("Transpose", [conf], "conf_t", perm=[0, 2, 1])
    scores = op("Gather", [conf, i64(cls)], "scores", axis=1) if K != C else conf
    if a["share_location"]:
        boxes = op("Expand", [dec, i64([1, K, 1, 1])], "boxes")
    else:
        boxes = op("Gather", [dec, i64(cls)], "boxes", axis=1) if K != C else dec
    # SSD's top_k candidates per class, best first
    vals, idx = ctx.add_node("TopK", [scores, i64([T])], [ctx.tmp(f"{name}_cand"), ctx.tmp(f"{name}_cand_idx")],
                             axis=2, largest=1, sorted=1)
    idx4 = op("Expand", [op("Unsqueeze", [idx, i64([3])], "idx_u"), i64([1, 1, 1, 4])], "idx4")
    cboxes = op("GatherElements", [boxes, idx4], "cand_boxes", axis=2)          # (N, K, T, 4)
    nms_boxes = cboxes
    if code != CENTER_SIZE:
        # SSD gives a flipped box zero size (no overlap); collapse it so NMS agrees
        bx0, by0, bx1, by1 = (last(cboxes, k, f"b{k}") for k in range(4))
        flipped = op("Or", [op("Less", [bx1, bx0], "fx"), op("Less", [by1, by0], "fy")], "flip")
        nms_boxes = op("Concat", [bx0, by0, op("Where", [flipped, bx0, bx1], "cx1"),
                                  op("Where", [flipped, by0, by1], "cy1")], "nms_boxes", axis=-1)
    nb = op("Reshape", [nms_boxes, i64([-1, T, 4])], "nb")
    ns = op("Reshape", [vals, i64([-1, 1, T])], "ns")
    nms_in = [nb, ns, i64([T]), f32([a["nms_threshold"]])]
    if a["conf_threshold"] > -FLT_MAX:
        nms_in.append(f32([a["conf_threshold"]]))
    sel = ctx.add_node("NonMaxSuppression", nms_in, [ctx.tmp(f"{name}_sel")], name=name)[0]   # (S, 3)
    # mask of survivors (N*K, T) -> (N, K, T)
    sel_bt = op("Gather", [sel, i64([0, 2])], "sel_bt", axis=1)
    flat_vals = op("Reshape", [vals, i64([-1, T])], "flat_vals")
    zeros = op("ConstantOfShape", [op("Shape", [flat_vals], "fv_shape")], "zeros", value=_scalar_tensor(0.0))
    ones = op("ConstantOfShape", [op("Slice", [op("Shape", [sel], "sel_shape"), i64([0]), i64([1])], "n_sel")],
              "ones", value=_scalar_tensor(1.0))
    mask = op("ScatterND", [zeros, sel_bt, ones], "mask_flat")
    if a["keep_top_k"] > -1 and a["keep_top_k"] < K * T:
        # keep_top_k best survivors per image
        neg = f32(-FLT_MAX)
        live = op("Where", [op("Cast", [mask], "mask_b", to=9), flat_vals, neg], "live")
        live = op("Reshape", [live, i64([-1, K * T])], "live_img")
        _, kidx = ctx.add_node("TopK", [live, i64([a["keep_top_k"]])],
                               [ctx.tmp(f"{name}_keep"), ctx.tmp(f"{name}_keep_idx")], axis=1, largest=1, sorted=1)
        kz = op("ConstantOfShape", [op("Shape", [live], "live_shape")], "kzeros", value=_scalar_tensor(0.0))
        kones = op("ConstantOfShape", [op("Shape", [kidx], "kidx_shape")], "kones", value=_scalar_tensor(1.0))
        kmask = op("ScatterElements", [kz, kidx, kones], "kmask", axis=1)
        mask = op("Mul", [op("Reshape", [mask, i64([-1, K * T])], "mask_img"), kmask], "mask_kept")
    mask = op("Reshape", [mask, i64([-1, K, T])], "mask")
    rows_idx = op("Transpose", [op("NonZero", [mask], "nz")], "rows_idx", perm=[1, 0])     # (R, 3)
    score = op("Unsqueeze", [op("GatherND", [vals, rows_idx], "score"), i64([1])], "score_c")
    box = op("GatherND", [cboxes, rows_idx], "box")                                          # (R, 4)
    img = op("Cast", [op("Gather", [rows_idx, i64([0])], "img_i", axis=1)], "img", to=1)
    lab_i = op("Gather", [rows_idx, i64([1])], "lab_k", axis=1)
    lab = op("Cast", [op("Gather", [i64(cls), lab_i], "lab_i")], "lab", to=1)
    rows = op("Concat", [img, lab, score, box], "rows", axis=1)                              # (R, 7)
    # no detection at all: one [i, -1, -1, -1, -1, -1, -1] row per image
    n1 = op("Slice", [op("Shape", [loc_in], "loc_shape"), i64([0]), i64([1])], "n")
    nf = op("Cast", [op("Squeeze", [n1, i64([0])], "n_s")], "nf", to=1)
    ids = op("Unsqueeze", [op("Range", [f32(0.0), nf, f32(1.0)], "ids"), i64([1])], "ids_c")
    minus = op("Expand", [f32(np.full((1, 6), -1.0, np.float32)), op("Concat", [n1, i64([6])], "f_shape", axis=0)],
               "minus")
    fallback = op("Concat", [ids, minus], "fallback", axis=1)
    r1 = op("Slice", [op("Shape", [rows], "rows_shape"), i64([0]), i64([1])], "r")
    none = op("Cast", [op("Equal", [r1, i64([0])], "none_b")], "none", to=7)
    end = op("Add", [r1, op("Mul", [none, n1], "n_if_none")], "end")
    both = op("Concat", [rows, fallback], "both", axis=0)
    out2 = op("Slice", [both, i64([0]), end, i64([0])], "out2")
    ctx.add_node("Reshape", [out2, i64([1, 1, -1, 7])], [node.outputs[0]])


def _scalar_tensor(v):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array([v], np.float32))
