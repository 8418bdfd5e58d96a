"""TensorRT's RPROI plugin (RPROI_TRT): Faster R-CNN's region proposals fused with ROI max pooling.

TensorRT's sampleFasterRCNN (data/faster-rcnn/faster_rcnn_test_iplugin.prototxt, shipped with every
TensorRT) writes py-faster-rcnn's Python proposal layer and its ROIPooling as one `RPROI` layer, which
TensorRT's Caffe parser builds as the RPROI_TRT plugin (parsers/caffe/caffeParser/caffeParser.cpp,
parseRPROIParam).  Sources read (NVIDIA/TensorRT): the plugin plugin/nvFasterRCNN/nvFasterRCNNPlugin.cpp
and the kernels plugin/common/kernels/{generateAnchors, extractFgScores, bboxDeltas2Proposals,
nmsLayer, roiPooling, proposalsForward, rproiInferenceFused}.cu at a892d222 (2026); the parser and
trtcaffe.proto at c89bc836 (TensorRT 8.6.1, before the Caffe parser was removed).

Bottoms: rpn_cls_prob_reshape (N, 2A, H, W) (channels A..2A-1 are the object scores), rpn_bbox_pred
(N, 4A, H, W), the feature map (N, C, H, W) and im_info (N, ..., 3) = [height, width, scale] per image,
A = anchor_ratio_count x anchor_scale_count.  Parameters: region_proposal_param (feature_stride,
prenms_top, nms_max_out, iou_threshold, min_box_size, the counts and the anchor_ratio / anchor_scale
lists, of which the plugin reads the first `count`) and roi_pooling_param (pooled_h, pooled_w,
spatial_scale: the only three fields TensorRT's message has).

Tops, as the plugin's getOutputDimensions (per image (1, nms_max_out, 4) and (nms_max_out, C, pooled_h,
pooled_w)):
- rois (N, 1, nms_max_out, 4) = [x1, y1, x2, y2] in input pixels, no batch column: image n's rows;
- pool5 (N x nms_max_out, C, pooled_h, pooled_w): image 0's rois first, so that a following
  InnerProduct pools one row per roi (the sample reads its outputs as N x nms_max_out rows).

What is the same as py-faster-rcnn (caffeq/layers/rcnn.py) and reused from there: the anchor sizes
(generate_anchors with C's rounding, base = feature_stride, ratios outer and scales inner), greedy
NMS with the +1 pixel IoU that drops a box whose IoU with a kept box is > iou_threshold (rpn_nms),
and Fast R-CNN's ROI max pooling (roi_pooling.roi_max_pool: corners x spatial_scale C-rounded,
float32 bins, an empty bin 0).  Where TensorRT differs, it is followed:
- the anchor centre on cell (h, w) is (base - 1) / 2 + (w, h) x feature_stride (7.5 for base 16);
  py-faster-rcnn decodes around x1 + width / 2, half a pixel further (8.0);
- proposals are ordered (a, h, w) (py-faster-rcnn: (h, w, a)): the sort is stable, descending, so a
  tie keeps the lower index of this order first (cub's radix sort);
- decoding in float32: centre + d x size, size x exp(d), corners centre -/+ size / 2, each clipped
  as min(max(v, 0), width - 1) (height - 1 for y);
- a box whose clipped width or height (+1) is below min_box_size x im_info[2] is not dropped: its
  score becomes -inf, so it sorts last but still takes part in NMS when it is among the best
  prenms_top (py-faster-rcnn drops it before sorting);
- the best prenms_top boxes go to NMS (prenms_top above A x H x W: all of them; the kernel would read
  past the image), at most nms_max_out are kept, and the rest of the nms_max_out rows are zeros (the
  kernel clears the output first); a zero row pools the feature-map cell (0, 0) into every bin;
- each image's rois pool from its own feature map (the roi's position, not a batch column).
The kernels' __expf and fused multiply-adds are not reproduced bit for bit: caffeq computes exp and
the products in plain float32.  The anchors' sides are rounded from float64 square roots, the
plugin's from float32 ones (they differ only where a side lands within a float32 ulp of .5).  A bin
whose values are all -inf pools -inf here, -FLT_MAX in the kernel (its running max starts there).

ONNX: the same steps for every image of a dynamic batch: TopK (ties: lower index first), then
NonMaxSuppression on [y1, x1, y2 + 1, x2 + 1] (ONNX's IoU has no +1) scored by rank, so that it keeps
TopK's order, the kept rows scattered into zeros (ScatterND), then MaxRoiPool (onnxruntime bins as
Fast R-CNN does) over the rois with their image index.
"""
import math

import numpy as np
import torch
from torch import nn

from .rcnn import TORCH_PROPOSAL, generate_anchors, rpn_nms
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from .roi_pooling import TORCH_ROI_COMMON, TORCH_ROI_POOLING, pooled_grid_attrs, roi_max_pool

#: nmsLaunch: ASSERT_PARAM(preNmsTopN < 64 * blockSize), blockSize 1024
MAX_PRENMS_TOP = 64 * 1024 - 1


def rproi_anchors(ratios, scales, feature_stride):
    """The plugin's anchors (A, 4) = [centre x, centre y, width, height] (generateAnchors_cpu): sides
    as py-faster-rcnn's generate_anchors with base feature_stride, centre (base - 1) / 2."""
    boxes = generate_anchors(feature_stride, ratios, scales, c_round=True)
    rows = [[(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1 + 1, y2 - y1 + 1] for x1, y1, x2, y2 in boxes.tolist()]
    return np.array(rows, np.float32)


# ---- torch: used by forward and copied into model.py ----------------------------------------------

def rproi_proposals(scores, deltas, im_info, anchors, feature_stride: int, pre_nms_top: int,
                    nms_max_out: int, iou_threshold: float, min_box_size: float):
    """The plugin's proposalsInference: -> rois (N, nms_max_out, 4) float32, zero rows after the kept
    ones.  anchors (A, 4) = [centre x, centre y, width, height] float32."""
    n, _, h, w = scores.shape
    a = anchors.shape[0]
    f32 = torch.float32
    dev = scores.device
    anc = anchors.to(dev, f32)
    gx = (torch.arange(w, device=dev) * feature_stride).to(f32)
    gy = (torch.arange(h, device=dev) * feature_stride).to(f32)
    ctr_x = (anc[:, 0, None, None] + gx[None, None, :]).expand(a, h, w).reshape(-1)     # order (a, h, w)
    ctr_y = (anc[:, 1, None, None] + gy[None, :, None]).expand(a, h, w).reshape(-1)
    aw = anc[:, 2, None, None].expand(a, h, w).reshape(-1)
    ah = anc[:, 3, None, None].expand(a, h, w).reshape(-1)
    fg = scores[:, a:].reshape(n, -1).to(f32)
    d = deltas.reshape(n, a, 4, h, w).transpose(1, 2).reshape(n, 4, -1).to(f32)
    info = im_info.reshape(n, -1).to(f32)
    zero = torch.zeros((), device=dev, dtype=f32)
    neg_inf = torch.tensor(float("-inf"), device=dev, dtype=f32)
    total = a * h * w
    rois = []
    for i in range(n):
        cx = ctr_x + d[i, 0] * aw
        cy = ctr_y + d[i, 1] * ah
        bw = torch.exp(d[i, 2]) * aw
        bh = torch.exp(d[i, 3]) * ah
        x_max, y_max = info[i, 1] - 1, info[i, 0] - 1
        x1 = torch.minimum(torch.maximum(cx - bw / 2, zero), x_max)
        y1 = torch.minimum(torch.maximum(cy - bh / 2, zero), y_max)
        x2 = torch.minimum(torch.maximum(cx + bw / 2, zero), x_max)
        y2 = torch.minimum(torch.maximum(cy + bh / 2, zero), y_max)
        limit = min_box_size * info[i, 2]
        small = ((x2 - x1 + 1) < limit) | ((y2 - y1 + 1) < limit)
        live = torch.where(small, neg_inf, fg[i])
        order = torch.sort(live, descending=True, stable=True)[1][:min(pre_nms_top, total)]
        boxes = torch.stack([x1, y1, x2, y2], dim=1)[order]
        kept = rpn_nms(boxes.detach().cpu(), iou_threshold, nms_max_out)
        out = torch.zeros((nms_max_out, 4), device=dev, dtype=f32)
        if kept:
            out[:len(kept)] = boxes[torch.tensor(kept, dtype=torch.long, device=dev)]
        rois.append(out)
    return torch.stack(rois)


def rproi_pool(fmap, rois, pooled_h: int, pooled_w: int, spatial_scale: float):
    """Fast R-CNN's ROI max pooling of rois (N, M, 4), image n's from fmap[n] -> (N x M, C, ph, pw)."""
    n, m = rois.shape[0], rois.shape[1]
    batch = torch.arange(n, dtype=rois.dtype, device=rois.device).repeat_interleave(m)[:, None]
    return roi_max_pool(fmap, torch.cat([batch, rois.reshape(-1, 4)], dim=1), pooled_h, pooled_w, spatial_scale)


class RPROI(nn.Module):
    """TensorRT's RPROI plugin: (scores, deltas, feature map, im_info) -> (rois (N, 1, M, 4),
    pooled (N x M, C, pooled_h, pooled_w)); anchors as rproi_anchors makes them."""

    def __init__(self, anchors, feature_stride, pre_nms_top, nms_max_out, iou_threshold, min_box_size,
                 pooled_h, pooled_w, spatial_scale):
        super().__init__()
        self.anchors = anchors
        self.feature_stride, self.pre_nms_top, self.nms_max_out = feature_stride, pre_nms_top, nms_max_out
        self.iou_threshold, self.min_box_size = iou_threshold, min_box_size
        self.pooled_h, self.pooled_w, self.spatial_scale = pooled_h, pooled_w, spatial_scale

    def forward(self, scores, deltas, fmap, im_info):
        anchors = torch.tensor(self.anchors, dtype=torch.float32)
        rois = rproi_proposals(scores, deltas, im_info, anchors, self.feature_stride, self.pre_nms_top,
                               self.nms_max_out, self.iou_threshold, self.min_box_size)
        pooled = rproi_pool(fmap, rois, self.pooled_h, self.pooled_w, self.spatial_scale)
        return rois.unsqueeze(1), pooled


TORCH_RPROI = torch_sources(rproi_proposals, rproi_pool)


# ---- the spec ------------------------------------------------------------------------------------

_ROI_FIELDS_TRT_LACKS = ("pad_ratio", "pool", "pooled_l", "temporal_scale")


@register_layer("RPROI")
class RPROILayer(Layer):
    def parse(self, lp):
        need_blobs(lp, "RPROI", 4, 2, "rpn_cls_prob_reshape, rpn_bbox_pred, feature map, im_info")
        p = lp.region_proposal_param
        field = "region_proposal_param"
        for f in ("feature_stride", "prenms_top", "nms_max_out", "anchor_ratio_count", "anchor_scale_count"):
            if getattr(p, f) < 1:
                raise LayerError(f"{field}.{f} must be >= 1 (TensorRT's RPROI plugin), got {getattr(p, f)}")
        if p.prenms_top > MAX_PRENMS_TOP:
            raise LayerError(f"{field}.prenms_top must be below {MAX_PRENMS_TOP + 1} (TensorRT's NMS kernel), "
                             f"got {p.prenms_top}")
        notes = []
        lists = {}
        for kind in ("ratio", "scale"):
            values, n = list(getattr(p, f"anchor_{kind}")), getattr(p, f"anchor_{kind}_count")
            if len(values) < n:
                raise LayerError(f"{field}.anchor_{kind}_count is {n} but {len(values)} anchor_{kind} values "
                                 f"are given")
            if len(values) > n:
                notes.append(f"{len(values)} anchor_{kind} values, of which TensorRT reads the first "
                             f"anchor_{kind}_count = {n}")
            values = values[:n]
            if any(not (v > 0 and math.isfinite(v)) for v in values):
                raise LayerError(f"{field}.anchor_{kind} values must be positive, got {values}")
            lists[kind] = [float(v) for v in values]
        for f in ("iou_threshold", "min_box_size"):
            if not math.isfinite(getattr(p, f)):
                raise LayerError(f"{field}.{f} must be a finite number, got {getattr(p, f)}")
        q = lp.roi_pooling_param
        for f in _ROI_FIELDS_TRT_LACKS:
            if q.HasField(f):
                raise LayerError(f"roi_pooling_param.{f} is not a field of TensorRT's ROIPoolingParameter "
                                 f"(pooled_h, pooled_w, spatial_scale), which RPROI reads")
        grid = pooled_grid_attrs(q, "roi_pooling_param")
        anchors = rproi_anchors(lists["ratio"], lists["scale"], int(p.feature_stride))
        attrs = {"name": lp.name, "feature_stride": int(p.feature_stride), "pre_nms_top": int(p.prenms_top),
                 "nms_max_out": int(p.nms_max_out), "iou_threshold": float(p.iou_threshold),
                 "min_box_size": float(p.min_box_size), "ratios": lists["ratio"], "scales": lists["scale"],
                 "anchors": anchors.tolist(), **grid}
        if notes:
            attrs["reading_notes"] = notes
        return attrs

    def infer(self, attrs, in_shapes):
        scores, deltas, fmap, info = (tuple(s) for s in in_shapes)
        a = len(attrs["anchors"])
        if len(fmap) != 4:
            raise LayerError(f"RPROI: the feature map must be (N, C, H, W), got {list(fmap)}")
        n, c, h, w = fmap
        for role, shape, k in (("rpn_cls_prob_reshape", scores, 2), ("rpn_bbox_pred", deltas, 4)):
            if shape != (n, k * a, h, w):
                raise LayerError(f"RPROI: {role} must be ({n}, {k} x {a} anchors, {h}, {w}) to match the "
                                 f"feature map {list(fmap)}, got {list(shape)}")
        if not info or info[0] != n or math.prod(info[1:]) != 3:
            raise LayerError(f"RPROI: im_info must hold [height, width, scale] per image, ({n}, 3) or "
                             f"({n}, 1, 1, 3), got {list(info)}")
        m = attrs["nms_max_out"]
        return [(n, 1, m, 4), (n * m, c, attrs["ph"], attrs["pw"])]

    @staticmethod
    def module_args(attrs):
        return (attrs["anchors"], attrs["feature_stride"], attrs["pre_nms_top"], attrs["nms_max_out"],
                attrs["iou_threshold"], attrs["min_box_size"], attrs["ph"], attrs["pw"], attrs["scale"])

    def forward(self, attrs, params, scores, deltas, fmap, im_info):
        return RPROI(*self.module_args(attrs))(scores, deltas, fmap, im_info)

    def onnx(self, ctx, node):
        emit_rproi(ctx, node)

    def pytorch_source(self, node, emit):
        emit.note(f"{node.name} (RPROI): NMS runs eagerly on the CPU, so this layer does not trace.")
        args = self.module_args(node.attrs)
        m = emit.module(f"{emit.helper(RPROI)}({', '.join(emit.lit(v, exact=True) for v in args)})")
        # the helpers RPROI calls: py-faster-rcnn's block (rpn_nms), Fast R-CNN's ROI pooling, ours
        for source in (TORCH_PROPOSAL, TORCH_ROI_COMMON, TORCH_ROI_POOLING, TORCH_RPROI):
            emit.helper(source)
        t = emit.tmp("rproi")
        emit.stmt(f"{t} = {m}({', '.join(emit.inputs)})")
        return [f"{t}[0]", f"{t}[1]"]


# ---- ONNX ---------------------------------------------------------------------------------------

def emit_rproi(ctx, node):
    """rproi_proposals and rproi_pool from standard ops, for a batch whose size is known only at run time."""
    a = node.attrs
    name = node.name
    scores_in, deltas_in, fmap_in, info_in = node.inputs
    _, _, height, width = ctx.shape(fmap_in)
    anchors = np.array(a["anchors"], np.float32)
    n_anchors = len(anchors)
    total = n_anchors * height * width
    k = min(a["pre_nms_top"], total)
    m = a["nms_max_out"]
    i64 = lambda v: ctx.const(np.array(v, np.int64))     # noqa: E731
    f32 = lambda v: ctx.const(np.array(v, np.float32))   # noqa: E731

    def op(op_type, inputs, hint, **kw):
        return ctx.add_node(op_type, inputs, [ctx.tmp(f"{name}_{hint}")], **kw)[0]

    # the anchors on every cell, order (a, h, w), as rproi_proposals makes them in float32
    gx = (np.arange(width) * a["feature_stride"]).astype(np.float32)
    gy = (np.arange(height) * a["feature_stride"]).astype(np.float32)
    grid = lambda g: np.broadcast_to(g, (n_anchors, height, width)).reshape(-1)   # noqa: E731
    ctr_x = grid(anchors[:, 0, None, None] + gx[None, None, :])
    ctr_y = grid(anchors[:, 1, None, None] + gy[None, :, None])
    aw, ah = grid(anchors[:, 2, None, None]), grid(anchors[:, 3, None, None])

    fg = op("Reshape", [op("Slice", [scores_in, i64([n_anchors]), i64([2 * n_anchors]), i64([1])], "fg4"),
                        i64([0, -1])], "fg")                                                  # (N, R)
    d = op("Reshape", [op("Transpose", [op("Reshape", [deltas_in, i64([0, n_anchors, 4, -1])], "d4")],
                          "d_t", perm=[0, 2, 1, 3]), i64([0, 4, -1])], "d")                   # (N, 4, R)
    dx, dy, dw, dh = (op("Gather", [d, i64(j)], hint, axis=1) for j, hint in enumerate(("dx", "dy", "dw", "dh")))
    info = op("Reshape", [info_in, i64([0, -1])], "info")                                     # (N, 3)
    im_h, im_w, im_scale = (op("Gather", [info, i64([j])], hint, axis=1) for j, hint in
                            enumerate(("im_h", "im_w", "im_scale")))                          # (N, 1)
    cx = op("Add", [f32(ctr_x), op("Mul", [dx, f32(aw)], "dxw")], "cx")
    cy = op("Add", [f32(ctr_y), op("Mul", [dy, f32(ah)], "dyh")], "cy")
    bw = op("Mul", [op("Exp", [dw], "ew"), f32(aw)], "bw")
    bh = op("Mul", [op("Exp", [dh], "eh"), f32(ah)], "bh")
    half_w, half_h = op("Div", [bw, f32(2.0)], "half_w"), op("Div", [bh, f32(2.0)], "half_h")
    x_max, y_max = op("Sub", [im_w, f32(1.0)], "x_max"), op("Sub", [im_h, f32(1.0)], "y_max")

    def clip(v, top, hint):   # fminf(fmaxf(v, 0), top)
        return op("Min", [op("Max", [v, f32(0.0)], hint + "_max"), top], hint)

    x1 = clip(op("Sub", [cx, half_w], "x1r"), x_max, "x1")
    y1 = clip(op("Sub", [cy, half_h], "y1r"), y_max, "y1")
    x2 = clip(op("Add", [cx, half_w], "x2r"), x_max, "x2")
    y2 = clip(op("Add", [cy, half_h], "y2r"), y_max, "y2")
    limit = op("Mul", [f32(a["min_box_size"]), im_scale], "limit")
    small = op("Or", [op("Less", [op("Add", [op("Sub", [x2, x1], "w0"), f32(1.0)], "w1"), limit], "narrow"),
                      op("Less", [op("Add", [op("Sub", [y2, y1], "h0"), f32(1.0)], "h1"), limit], "low")], "small")
    live = op("Where", [small, f32(-np.inf), fg], "live")
    _, idx = ctx.add_node("TopK", [live, i64([k])], [ctx.tmp(f"{name}_top"), ctx.tmp(f"{name}_top_idx")],
                          axis=1, largest=1, sorted=1)                                        # (N, k)
    corners = op("Concat", [op("Unsqueeze", [v, i64([2])], f"{h}_c") for v, h in
                            ((x1, "x1"), (y1, "y1"), (x2, "x2"), (y2, "y2"))], "corners", axis=2)   # (N, R, 4)
    pick = op("Expand", [op("Unsqueeze", [idx, i64([2])], "idx3"), i64([1, 1, 4])], "idx4")
    cand = op("GatherElements", [corners, pick], "cand", axis=1)                               # (N, k, 4)
    # ONNX's IoU has no +1: [y1, x1, y2 + 1, x2 + 1]; scored by rank, so that NMS keeps TopK's order
    nms_boxes = op("Gather", [op("Add", [cand, f32([0, 0, 1, 1])], "cand1"), i64([1, 0, 3, 2])], "yx", axis=2)
    batch = op("Slice", [op("Shape", [idx], "idx_shape"), i64([0]), i64([1])], "batch")           # [N]
    rank = np.arange(k, 0, -1, dtype=np.float32).reshape(1, 1, k)
    nms_scores = op("Expand", [f32(rank), op("Concat", [batch, i64([1, 1])], "rank_shape", axis=0)], "rank")
    sel = ctx.add_node("NonMaxSuppression", [nms_boxes, nms_scores, i64([m]), f32([ctx.nms_threshold(a["iou_threshold"])])],
                       [ctx.tmp(f"{name}_sel")], name=name)[0]                                 # (S, 3)
    image = op("Gather", [sel, i64([0])], "image", axis=1)                                      # (S, 1)
    box = op("Gather", [sel, i64([2])], "box", axis=1)
    chosen = op("GatherND", [cand, op("Concat", [image, box], "image_box", axis=1)], "chosen")   # (S, 4)
    # each kept row's slot: its row minus the rows of the images before its own (rows come image by image)
    flat_image = op("Reshape", [image, i64([-1])], "image_flat")
    before = op("ReduceSum", [op("Cast", [op("Less", [op("Unsqueeze", [flat_image, i64([0])], "img_row"), image],
                                              "earlier"), ], "earlier_i", to=7), i64([1])], "before", keepdims=1)
    rows = op("Unsqueeze", [op("Range", [i64(0), op("Squeeze", [op("Shape", [flat_image], "s_shape"), i64([0])],
                                                    "s"), i64(1)], "row"), i64([1])], "rows")
    slot = op("Sub", [rows, before], "slot")
    zeros = op("ConstantOfShape", [op("Concat", [batch, i64([m, 4])], "rois_shape", axis=0)], "zeros",
               value=_zero_tensor())
    rois = op("ScatterND", [zeros, op("Concat", [image, slot], "where", axis=1), chosen], "rois")   # (N, M, 4)
    ctx.add_node("Unsqueeze", [rois, i64([1])], [node.outputs[0]])
    # pool5: Fast R-CNN's ROI max pooling of each image's rois, with the image index in front
    images = op("Cast", [op("Range", [i64(0), op("Squeeze", [batch, i64([0])], "n"), i64(1)], "images_i")],
                "images", to=1)
    col = op("Reshape", [op("Expand", [op("Unsqueeze", [images, i64([1])], "images2"), i64([1, m])], "image_col0"),
                         i64([-1, 1])], "image_col")
    rois5 = op("Concat", [col, op("Reshape", [rois, i64([-1, 4])], "rois_flat")], "rois5", axis=1)
    ctx.add_node("MaxRoiPool", [fmap_in, rois5], [node.outputs[1]], name=name + "/pool",
                 pooled_shape=[a["ph"], a["pw"]], spatial_scale=a["scale"])


def _zero_tensor():
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array([0.0], np.float32))
