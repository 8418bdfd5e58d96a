"""PG-CNN's MultiROIPooling (mysee1989/PG-CNN f3faafd, multi_roi_pooling_layer.cu): one
pooled_h x pooled_w crop of the feature map around each facial landmark, one top per landmark.

rois are (N, top_num, 2) landmark (x, y) in input pixels.  Landmark t of image n starts its crop at
round(x * spatial_scale - pooled_w / 2), round(y * spatial_scale - pooled_h / 2) (float32, C's round,
integer halves of the pooled size); what falls outside the map is 0.  (Where the crop is wider than
the map on both sides the fork's kernel reads on into the next row; that is left at 0 here.)  The
fork has no CPU forward; this follows its GPU kernel.  ONNX has no crop at per-image, data-dependent
positions, so the export refuses the layer.
"""
import math

import torch

from .c_numerics import c_round
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources


def landmark_crops(x, points, ph: int, pw: int, spatial_scale: float, count: int):
    """(count tops) of (N, C, ph, pw): the crop of x around each landmark, 0 outside the map."""
    n, c, h, w = x.shape
    pts = points.detach().reshape(n, count, 2).float().cpu()
    scale = torch.tensor(spatial_scale, dtype=torch.float32)
    starts_w = c_round((pts[..., 0] * scale - float(pw // 2)).double()).long()
    starts_h = c_round((pts[..., 1] * scale - float(ph // 2)).double()).long()
    tops = []
    for t in range(count):
        crops = x.new_zeros((n, c, ph, pw))
        for b in range(n):
            sh, sw = int(starts_h[b, t]), int(starts_w[b, t])
            y0, y1, x0, x1 = max(sh, 0), min(sh + ph, h), max(sw, 0), min(sw + pw, w)
            if y1 > y0 and x1 > x0:
                crops[b, :, y0 - sh:y1 - sh, x0 - sw:x1 - sw] = x[b, :, y0:y1, x0:x1]
        tops.append(crops)
    return tuple(tops)


TORCH_LANDMARK_CROPS = torch_sources(c_round, landmark_crops)


@register_layer("MultiROIPooling")
class MultiROIPooling(Layer):
    onnx_refusal = "ONNX has no crop at per-image positions that the landmark values decide"

    def parse(self, lp):
        p = lp.multi_roi_pooling_param
        if p.pooled_h <= 0 or p.pooled_w <= 0:
            raise LayerError(f"multi_roi_pooling_param.pooled_h and pooled_w must be > 0, got {p.pooled_h} x {p.pooled_w}")
        need_blobs(lp, "MultiROIPooling", 2, int(p.top_num), "data, landmarks")
        return {"ph": int(p.pooled_h), "pw": int(p.pooled_w), "scale": float(p.spatial_scale), "count": int(p.top_num)}

    def infer(self, attrs, in_shapes):
        x, pts = in_shapes
        n, c, _, _ = four_axes(x, "MultiROIPooling")
        k = attrs["count"]
        # the kernel reads landmark t of image n at (n * top_num + t) * 2 and loops over rois' axis 1
        if len(pts) < 2 or pts[0] != n or pts[1] != k or math.prod(pts[2:]) != 2:
            raise LayerError(f"the landmarks must be (N, top_num, 2) = ({n}, {k}, 2), got {list(pts)}")
        return [(n, c, attrs["ph"], attrs["pw"])] * k

    def forward(self, attrs, params, x, points):
        return landmark_crops(x, points, attrs["ph"], attrs["pw"], attrs["scale"], attrs["count"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(TORCH_LANDMARK_CROPS)
        t = emit.tmp("crops")
        emit.stmt(f"{t} = {fn}({emit.inputs[0]}, {emit.inputs[1]}, {a['ph']}, {a['pw']}, "
                  f"{emit.lit(a['scale'])}, {a['count']})")
        return [f"{t}[{i}]" for i in range(a["count"])]
