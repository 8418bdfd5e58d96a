"""dedoogong/caffe-keypoint-rcnn (a Caffe port of Detectron's keypoint R-CNN), read from 3527a81:
src/caffe/proto/caffe.proto, src/caffe/layers/{pooling_crop_layer, roi_align_layer, generate_proposal_layer,
bbox_transform_layer}.cpp, include/caffe/layers/{generate_proposal_layer, generate_proposals_op_util_boxes}.hpp
and include/caffe2/utils/generate_proposals_op_util_nms.h (no .cu: the GPU runs these CPU forwards).

- PoolingCrop: (N, C, H, W) -> (N, C, H - 1, W - 1), the top-left part (its memcpy of W - 1 per row).
- RoIAlign (roi_align_param; its float sampling_ratio, default 2, read as the C++ int): Detectron's RoIAlign,
  rois (R, 5) = [batch (truncated), x1, y1, x2, y2] times spatial_scale, sides max(x2 - x1, 1), bin = side /
  pooled; sample i of bin p at start + p * bin + (i + 0.5) * bin / g (g = sampling_ratio per side); a sample
  below -1 or above H (W) gives 0, else it is raised to 0, its low cell int(y), at or past the last row
  both cells are that row; the g x g bilinear values are averaged.  The fork CHECKs the float
  sampling_ratio > 0 (0 aborts) and rois 2-axis (R, 5), then passes int(sampling_ratio): a ratio in (0, 1)
  becomes Detectron's adaptive grid, ceil(side / pooled).  caffeq refuses both in forward.
- GenerateProposal (proposal_param, the fork's GenerateProposalsParameter, generate_proposals_param here):
  bottoms scores (N, A, H, W), deltas (N, 4A, H, W), im_info (N, 3) and anchors (A, 4).  Anchors at
  position k = h * W + w are anchor + (w, h, w, h) * (1 / spatial_scale in float), in (k, a) order, as are
  the scores and deltas.  Sorted by score (descending; pre_nms_topn > 0 and below the count keeps that
  many), decoded with weights 1 and the fork's BBOX_XFORM_CLIP_DEFAULT 1.79588001734 (log10(62.5), not
  Detectron's log(1000 / 16)): w = x2 - x1 + 1, ctr = x1 + 0.5 w, dw clipped above, x2 less 1 when
  correct_transform_coords; clipped to [0, int(im_info[1]) - 1] x [0, int(im_info[0]) - 1]; kept when
  w, h >= min_size * im_info[2] (in double, rounded to float for Eigen's comparison) and the centre
  x1 + w / 2 < im_info[1], y1 + h / 2 < im_info[0]; greedy NMS
  (+1 areas, float32 IoU, a box goes when IoU > nms_thresh), at most post_nms_topn (when 0 < it < count).
  tops rois (R, 5) = [0, box] and probs (R, 1).  Batches: the fork's ComputeStartIndex returns 0 outside
  DEBUG, so every image reads image 0's maps, and the tops are reshaped to image 0's count: the output is
  image 0's proposals, whatever N is.  Its Reshape sizes the tops N * 1000 rows; more proposals of image 0
  are written past them and the final Reshape to that count reallocates the tops (zeros): refused.  Equal
  scores: std::sort leaves their order unspecified; caffeq keeps the lower index first.
- BBoxTransform (bboxtransform_param): rois (R, 5) or (R, 4), deltas (R, 4K), im_info (1, 3); boxes / im_info[2],
  decoded per class as above with weights_1..4, clipped to int(im_info[0] / im_info[2] + 0.5) (height) and
  width likewise, times im_info[2] when apply_scale.  The fork writes every image's boxes from row 0, so a
  second image overwrites the first: caffeq refuses im_info with more than one row, and (R, 5) rois whose
  int batch index is not 0 (the fork CHECKs it below im_info's rows).

Tops whose count depends on the data (GenerateProposal) are sized at most pre/post_nms_topn in infer, as the
py-faster-rcnn proposal layers (caffeq/layers/rcnn.py).  The torch functions serve forward and model.py.
"""
import math

import torch

from ..errors import ExportError
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from .roi_align_forks import mask_rcnn_axis
from .roi_pooling import RoiLayerSpec, _check_roi_shapes, pooled_grid_attrs, roi_rows

BBOX_XFORM_CLIP = 1.79588001734


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def kp_roi_align(x, rois, ph: int, pw: int, spatial_scale: float, grid: int):
    """dedoogong/caffe-keypoint-rcnn's RoIAlign -> (R, C, ph, pw): the mean of grid x grid bilinear samples."""
    f32 = torch.float32
    r = rois.reshape(-1, 5).detach().float().cpu()
    n, c, h, w = x.shape
    if r.shape[0] == 0:
        return x.new_zeros((0, c, ph, pw))
    b = r[:, 0].long()
    if bool(((b < 0) | (b >= n)).any()):
        raise ValueError(f"RoIAlign: a roi batch index is outside the batch of {n}")
    scale = torch.tensor(spatial_scale, dtype=f32)
    start = r[:, 1:3] * scale
    size = torch.fmax(r[:, 3:5] * scale - start, torch.ones((), dtype=f32))
    oy, y0, y1, ly, hy = mask_rcnn_axis(start[:, 1], size[:, 1] / float(ph), ph, h, grid)
    ox, x0, x1, lx, hx = mask_rcnn_axis(start[:, 0], size[:, 0] / float(pw), pw, w, grid)
    dev, dt = x.device, x.dtype
    bd = b.to(dev)[:, None, None]
    total = None
    for iy in range(grid):
        for ix in range(grid):
            val = None
            for wy, yi in ((hy[:, :, iy], y0[:, :, iy]), (ly[:, :, iy], y1[:, :, iy])):
                for wx, xi in ((hx[:, :, ix], x0[:, :, ix]), (lx[:, :, ix], x1[:, :, ix])):
                    cell = x[bd, :, yi.to(dev)[:, :, None], xi.to(dev)[:, None, :]].permute(0, 3, 1, 2)
                    term = (wy[:, :, None] * wx[:, None, :])[:, None].to(dev, dt) * cell
                    val = term if val is None else val + term
            outside = (oy[:, :, iy, None] | ox[:, None, :, ix])[:, None].to(dev)
            val = torch.where(outside, torch.zeros((), device=dev, dtype=dt), val)
            total = val if total is None else total + val
    return total / float(grid * grid)


def kp_decode(boxes, deltas, weights: list, clip: float, offset: float):
    """caffe2 bbox_transform_upright in float32: boxes (M, 4), deltas (M, 4) -> (M, 4)."""
    widths = (boxes[:, 2] - boxes[:, 0]) + 1.0
    heights = (boxes[:, 3] - boxes[:, 1]) + 1.0
    ctr_x = boxes[:, 0] + 0.5 * widths
    ctr_y = boxes[:, 1] + 0.5 * heights
    dx = deltas[:, 0] / weights[0]
    dy = deltas[:, 1] / weights[1]
    dw = torch.clamp(deltas[:, 2] / weights[2], max=clip)
    dh = torch.clamp(deltas[:, 3] / weights[3], max=clip)
    px = dx * widths + ctr_x
    py = dy * heights + ctr_y
    pw_ = torch.exp(dw) * widths
    ph_ = torch.exp(dh) * heights
    return torch.stack([px - 0.5 * pw_, py - 0.5 * ph_, px + 0.5 * pw_ - offset, py + 0.5 * ph_ - offset], 1)


def kp_clip(boxes, height: int, width: int):
    """clip_boxes_upright: x to [0, width - 1], y to [0, height - 1] (min first, then max)."""
    xs = torch.clamp(torch.clamp(boxes[:, 0::2], max=float(width - 1)), min=0.0)
    ys = torch.clamp(torch.clamp(boxes[:, 1::2], max=float(height - 1)), min=0.0)
    return torch.stack([xs[:, 0], ys[:, 0], xs[:, 1], ys[:, 1]], 1)


def kp_nms(boxes, order: list, thresh: float, top_n: int):
    """nms_cpu_upright over `order` (indices into boxes, best first): the kept indices."""
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = (x2 - x1 + 1.0) * (y2 - y1 + 1.0)
    rest = torch.tensor(order, dtype=torch.long)
    keep = []
    while rest.numel() > 0:
        if 0 <= top_n <= len(keep):
            break
        i = int(rest[0])
        keep.append(i)
        others = rest[1:]
        w = torch.clamp(torch.minimum(x2[others], x2[i]) - torch.maximum(x1[others], x1[i]) + 1.0, min=0.0)
        h = torch.clamp(torch.minimum(y2[others], y2[i]) - torch.maximum(y1[others], y1[i]) + 1.0, min=0.0)
        inter = w * h
        ovr = inter / (areas[i] + areas[others] - inter)
        rest = others[ovr <= thresh]
    return keep


def kp_generate_proposals(scores, deltas, im_info, anchors, spatial_scale: float, nms_thresh: float,
                          pre_nms_topn: int, min_size: float, post_nms_topn: int, offset: float):
    """GenerateProposal of image 0 -> (rois (R, 5), probs (R, 1))."""
    f32 = torch.float32
    dev = scores.device
    s, d = scores[0].detach().float().cpu(), deltas[0].detach().float().cpu()
    info = im_info.detach().float().cpu().reshape(im_info.shape[0], -1)[0]
    a, h, w = s.shape
    stride = float(torch.tensor(1.0, dtype=f32) / torch.tensor(spatial_scale, dtype=f32))
    sx = torch.arange(w, dtype=f32) * stride
    sy = torch.arange(h, dtype=f32) * stride
    shift = torch.stack([sx[None, :].expand(h, w), sy[:, None].expand(h, w)], -1).reshape(-1, 1, 2).repeat(1, 1, 2)
    all_anchors = (anchors.detach().float().cpu().reshape(1, a, 4) + shift).reshape(-1, 4)
    flat_scores = s.reshape(a, h * w).t().reshape(-1)
    flat_deltas = d.reshape(a, 4, h * w).permute(2, 0, 1).reshape(-1, 4)
    order = torch.sort(-flat_scores, stable=True)[1]
    if 0 < pre_nms_topn < order.numel():
        order = order[:pre_nms_topn]
    props = kp_decode(all_anchors[order], flat_deltas[order], [1.0, 1.0, 1.0, 1.0], 1.79588001734, offset)
    props = kp_clip(props, int(info[0]), int(info[1]))
    sorted_scores = flat_scores[order]
    ws = props[:, 2] - props[:, 0] + 1.0
    hs = props[:, 3] - props[:, 1] + 1.0
    # min_size * im_info[2] in double, compared as the float Eigen's array comparison makes of it
    limit = torch.tensor(min_size * float(info[2]), dtype=torch.float64).to(f32)
    ok = (ws >= limit) & (hs >= limit) & (props[:, 0] + ws / 2.0 < info[1]) & (props[:, 1] + hs / 2.0 < info[0])
    kept = [int(i) for i in torch.nonzero(ok).reshape(-1)]
    top_n = post_nms_topn if 0 < post_nms_topn < len(kept) else -1
    keep = torch.tensor(kp_nms(props, kept, nms_thresh, top_n), dtype=torch.long)
    if keep.numel() > 1000 * scores.shape[0]:
        raise ValueError(f"GenerateProposal: {keep.numel()} proposals, more than the 1000 per image its top holds "
                         f"(the fork writes past it and reallocates it empty); set post_nms_topn to at most "
                         f"{1000 * scores.shape[0]}")
    boxes = props[keep]
    rois = torch.cat([torch.zeros((boxes.shape[0], 1), dtype=f32), boxes], 1)
    return rois.to(dev, scores.dtype), sorted_scores[keep].reshape(-1, 1).to(dev, scores.dtype)


def kp_bbox_transform(rois, deltas, im_info, weights: list, offset: float, apply_scale: bool):
    """BBoxTransform for one image -> (R, 4K)."""
    r = rois.reshape(rois.shape[0], -1)
    if r.shape[1] == 5 and bool((r[:, 0].float().trunc() != 0).any()):
        raise ValueError("BBoxTransform: a roi's batch index is not 0: the fork CHECKs it below im_info's one row "
                         "(and counts only image 0's rois)")
    boxes = r[:, -4:].float()
    info = im_info.reshape(-1).float()
    scale = info[2]
    img_h = int(float(info[0] / scale) + 0.5)
    img_w = int(float(info[1] / scale) + 0.5)
    boxes = boxes / scale
    k = deltas.shape[1] // 4
    outs = []
    for j in range(k):
        box = kp_clip(kp_decode(boxes, deltas[:, 4 * j:4 * j + 4].float(), weights, 1.79588001734, offset),
                      img_h, img_w)
        outs.append(box * scale if apply_scale else box)
    return torch.cat(outs, 1).to(deltas.dtype)


TORCH_KP_ROI_ALIGN = torch_sources(mask_rcnn_axis, kp_roi_align)
TORCH_KP_PROPOSALS = torch_sources(kp_decode, kp_clip, kp_nms, kp_generate_proposals)
TORCH_KP_BBOX = torch_sources(kp_decode, kp_clip, kp_bbox_transform)


# ---- the specs ----------------------------------------------------------------------------


@register_layer("PoolingCrop")
class PoolingCrop(Layer):
    def parse(self, lp):
        need_blobs(lp, "PoolingCrop", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        (s,) = in_shapes
        if len(s) != 4 or s[2] < 2 or s[3] < 2:
            raise LayerError(f"PoolingCrop needs a 4-axis input at least 2 x 2, got {list(s)}")
        return [(s[0], s[1], s[2] - 1, s[3] - 1)]

    def forward(self, attrs, params, x):
        return x[:, :, :-1, :-1]

    def onnx(self, ctx, node):
        s = ctx.shape(node.inputs[0])
        ctx.add_node("Slice", [node.inputs[0], ctx.i64([0, 0]), ctx.i64([s[2] - 1, s[3] - 1]), ctx.i64([2, 3])],
                     [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]}[:, :, :-1, :-1]"


@register_layer("RoIAlign")
class KeypointRoIAlign(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(kp_roi_align), TORCH_KP_ROI_ALIGN

    def parse(self, lp):
        need_blobs(lp, "RoIAlign", 2, 1, roles="data, rois")
        p = lp.roi_align_param
        ratio = p.sampling_ratio
        if not math.isfinite(ratio) or ratio < 0:
            raise LayerError(f"roi_align_param.sampling_ratio must be >= 0, got {ratio}")
        return {**pooled_grid_attrs(p, "roi_align_param"), "grid": int(ratio), "ratio": float(ratio)}

    def infer(self, attrs, in_shapes):
        _check_roi_shapes("RoIAlign", in_shapes)
        s, r = in_shapes
        if len(r) != 2:
            raise LayerError(f"RoIAlign: rois must be 2-axis (R, 5) (the fork CHECKs it), got {list(r)}")
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def forward(self, attrs, params, x, rois):
        if attrs["ratio"] <= 0:
            raise LayerError("RoIAlign: roi_align_param.sampling_ratio 0 (Detectron's adaptive grid) aborts in "
                             "the fork (CHECK_GT(sampling_ratio, 0)); give a positive one")
        if attrs["grid"] <= 0:
            raise LayerError(f"RoIAlign: roi_align_param.sampling_ratio {attrs['ratio']} passes the fork's CHECK "
                             f"but its int is 0: Detectron's adaptive grid, which caffeq does not run")
        roi_rows(rois, "RoIAlign")
        return super().forward(attrs, params, x, rois)

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"], "grid": attrs["grid"]}

    def onnx(self, ctx, node):
        a = node.attrs
        if a["grid"] <= 0:
            raise ExportError(f"layer '{node.name}' (RoIAlign): sampling_ratio {a['ratio']} is 0 as an int (the "
                              f"fork aborts at 0, runs Detectron's adaptive grid below 1)")
        if ctx.opset < 16:
            raise ExportError(f"layer '{node.name}' (RoIAlign): Detectron's unshifted samples need ONNX RoiAlign's "
                              f"output_half_pixel mode (opset 16); export with --opset 16 or later")
        t = lambda hint: ctx.tmp(f"{node.name}_{hint}")
        flat = ctx.add_node("Reshape", [node.inputs[1], ctx.i64([-1, 5])], t("rois"))
        boxes = ctx.add_node("Slice", [flat, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], t("boxes"))
        column = ctx.add_node("Slice", [flat, ctx.i64([0]), ctx.i64([1]), ctx.i64([1])], t("batch_column"))
        batch = ctx.add_node("Cast", [ctx.add_node("Reshape", [column, ctx.i64([-1])], t("batch_float"))],
                             t("batch"), to=7)
        ctx.add_node("RoiAlign", [node.inputs[0], boxes, batch], [node.outputs[0]], name=node.name, mode="avg",
                     output_height=a["ph"], output_width=a["pw"], sampling_ratio=a["grid"],
                     spatial_scale=a["scale"], coordinate_transformation_mode="output_half_pixel")


@register_layer("GenerateProposal")
class GenerateProposal(Layer):
    data_dependent_shape = True
    onnx_refusal = "its proposals' count depends on the data (sort, min-size filter and greedy NMS)"

    def parse(self, lp):
        need_blobs(lp, "GenerateProposal", 4, 2, "scores, bbox_deltas, im_info, anchors")
        p = lp.generate_proposals_param
        if not (math.isfinite(p.spatial_scale) and p.spatial_scale > 0):
            raise LayerError(f"proposal_param.spatial_scale must be > 0, got {p.spatial_scale}")
        if not 0 <= p.nms_thresh <= 1:
            raise LayerError(f"proposal_param.nms_thresh must be in [0, 1], got {p.nms_thresh}")
        if not math.isfinite(p.min_size):
            raise LayerError(f"proposal_param.min_size must be a finite number, got {p.min_size}")
        return {"spatial_scale": float(p.spatial_scale), "nms_thresh": float(p.nms_thresh),
                "pre_nms_topn": int(p.pre_nms_topn), "min_size": float(p.min_size),
                "post_nms_topn": int(p.post_nms_topn), "offset": 1.0 if p.correct_transform_coords else 0.0}

    def infer(self, attrs, in_shapes):
        s, d, info, anc = (list(x) for x in in_shapes)
        if len(s) != 4 or d != [s[0], 4 * s[1], s[2], s[3]]:
            raise LayerError(f"GenerateProposal: scores (N, A, H, W) and bbox_deltas (N, 4A, H, W), got {s} and {d}")
        if len(info) != 2 or info != [s[0], 3] or anc != [s[1], 4]:
            raise LayerError(f"GenerateProposal: im_info must be ({s[0]}, 3) and anchors ({s[1]}, 4), got {info} "
                             f"and {anc}")
        rows = s[1] * s[2] * s[3]
        for key in ("pre_nms_topn", "post_nms_topn"):
            if attrs[key] > 0:
                rows = min(rows, attrs[key])
        return [(rows, 5), (rows, 1)]

    @staticmethod
    def _args(a):
        return [a["spatial_scale"], a["nms_thresh"], a["pre_nms_topn"], a["min_size"], a["post_nms_topn"],
                a["offset"]]

    def forward(self, attrs, params, scores, deltas, im_info, anchors):
        try:
            return kp_generate_proposals(scores, deltas, im_info, anchors, *self._args(attrs))
        except ValueError as e:
            raise LayerError(str(e)) from None

    def pytorch_source(self, node, emit):
        emit.note(f"{node.name} (GenerateProposal): the number of rois depends on the data; NMS runs eagerly.")
        fn = emit.helper(TORCH_KP_PROPOSALS)
        t = emit.tmp("proposals")
        args = ", ".join(list(emit.inputs) + [emit.lit(v, exact=True) for v in self._args(node.attrs)])
        emit.stmt(f"{t} = {fn}({args})")
        return [f"{t}[0]", f"{t}[1]"]


@register_layer("BBoxTransform")
class BBoxTransform(Layer):
    onnx_refusal = "caffeq emits no ONNX for it yet (int() of im_info sizes taken at run time)"

    def parse(self, lp):
        need_blobs(lp, "BBoxTransform", 3, 1, "rois, deltas, im_info")
        p = lp.bboxtransform_param
        weights = [float(p.weights_1), float(p.weights_2), float(p.weights_3), float(p.weights_4)]
        if any(not (math.isfinite(v) and v != 0) for v in weights):
            raise LayerError(f"bboxtransform_param.weights_1..4 must be finite and non-zero, got {weights}")
        return {"weights": weights, "offset": 1.0 if p.correct_transform_coords else 0.0,
                "apply_scale": bool(p.apply_scale)}

    def infer(self, attrs, in_shapes):
        r, d, info = (list(x) for x in in_shapes)
        if len(r) != 2 or r[1] not in (4, 5) or len(d) != 2 or d[0] != r[0] or d[1] % 4:
            raise LayerError(f"BBoxTransform: rois (R, 4 or 5) and deltas (R, 4K), got {r} and {d}")
        if info != [1, 3]:
            raise LayerError(f"BBoxTransform: im_info must be (1, 3) (the fork writes every image's boxes from "
                             f"row 0), got {info}")
        return [tuple(d)]

    def _args(self, a):
        return [a["weights"], a["offset"], a["apply_scale"]]

    def forward(self, attrs, params, rois, deltas, im_info):
        try:
            return kp_bbox_transform(rois, deltas, im_info, *self._args(attrs))
        except ValueError as e:
            raise LayerError(str(e)) from None

    def pytorch_source(self, node, emit):
        fn = emit.helper(TORCH_KP_BBOX)
        args = ", ".join(list(emit.inputs) + [emit.lit(v, exact=True) for v in self._args(node.attrs)])
        return f"{fn}({args})"
