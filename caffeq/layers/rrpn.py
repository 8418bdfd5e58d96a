"""RRPN's rotated region proposals (mjq11302010044/RRPN ae64282, Ma et al., "Arbitrary-Oriented Scene
Text Detection via Rotation Proposals"): read and sized, not run.

- `rotation.rproposal_layer.ProposalLayer` (lib/rotation/rproposal_layer.py): py-faster-rcnn's
  proposal layer for rotated boxes.  Bottoms: rpn_cls_prob_reshape (1, 2A, H, W), rpn_bbox_pred
  (1, 5A, H, W) (ctr_x, ctr_y, h, w, angle deltas), im_info.  Its setup shapes rois (1, 6) =
  [0, ctr_x, ctr_y, h, w, angle] and scores (1, 1, 1, 1, 1); forward writes R rows.  Its NMS is
  rotate_polygon_nms (a CUDA kernel computing polygon IoU), and its anchors come from the fork's
  rotation/generate_anchors.py: caffeq does not reproduce them, so the layer reads but does not run.
- `RotateROIPooling` (caffe-fast-rcnn/src/caffe/layers/rotate_roi_pooling_layer.cpp) and
  `RotateROIAlign` (rotate_roi_align_layer.cpp): bottoms data (N, C, H, W), rois (R, 6), im_info;
  top (R, C, pooled_h, pooled_w) as their Reshape gives.  They pool over each rotated roi's
  quadrilateral cells; caffeq does not run them (their rois come only from the rotated proposals).
- xhzdeng/crpn a5aef0f (Deng et al., "Detecting Multi-Oriented Text with Corner-based Region Proposals")
  declares the same two types with `rotate_roi_pooling_param` / `rotate_roi_align_param` and no im_info:
  bottoms data, rois (R, 6) = [batch, x1, y1, x2, y2, angle in degrees] (RotateROIAlign takes an optional
  third, whose first value its GPU forward takes as the spatial scale); top (R, C, pooled_h, pooled_w).
  Its rois come from the fork's corner-based rpn.proposal_layer, which caffeq does not run either.
"""
from .param_str import parse_param_str
from .registry import LayerError, ReadOnlyLayer, need_blobs, register_layer


@register_layer("Python:rotation.rproposal_layer.ProposalLayer")
class RotatedProposal(ReadOnlyLayer):
    data_dependent_shape = True   # (1, 6) until a forward writes its rows

    def parse(self, lp):
        need_blobs(lp, "RRPN's ProposalLayer", 3, (1, 2), "rpn_cls_prob_reshape, rpn_bbox_pred, im_info")
        p = parse_param_str(lp.python_param.param_str)
        if "feat_stride" not in p:   # setup reads layer_params['feat_stride']
            raise LayerError("python_param.param_str: 'feat_stride' is required (e.g. \"'feat_stride': 16\")")
        return {"name": lp.name, "kind": "Python", "with_scores": len(lp.top) == 2}

    def infer(self, attrs, in_shapes):
        return [(1, 6)] + [(1, 1, 1, 1, 1)] * attrs["with_scores"]

    def why_not_run(self, attrs):
        return ("RRPN's rotated proposals (rotation.rproposal_layer) use the fork's rotated anchors and its polygon-IoU GPU NMS "
                "(rotate_polygon_nms), which caffeq does not reproduce; run the net up to rpn_cls_prob_reshape "
                "and rpn_bbox_pred (--outputs)")


@register_layer("RotateROIPooling", "RotateROIAlign")
class RotateROIPooling(ReadOnlyLayer):
    def parse(self, lp):
        what = lp.type
        pooling = what == "RotateROIPooling"
        crpn = lp.HasField("rotate_roi_pooling_param" if pooling else "rotate_roi_align_param")
        if crpn:   # MinBottomBlobs 2, MaxBottomBlobs 2 (pooling) or 3 (align)
            need_blobs(lp, f"CRPN's {what}", 2 if pooling else (2, 3), 1, "data, rois")
            field = "rotate_roi_pooling_param" if pooling else "rotate_roi_align_param"
        else:
            need_blobs(lp, what, 3, 1, "data, rois, im_info")
            field = "rotate_pooling_param" if pooling else "rotate_align_param"
        p = getattr(lp, field)
        for key in ("pooled_h", "pooled_w"):
            if getattr(p, key) < 1:   # LayerSetUp: CHECK_GT(pooled_h, 0)
                raise LayerError(f"{field}.{key} must be > 0, got {getattr(p, key)}")
        return {"name": lp.name, "kind": what, "fork": "CRPN" if crpn else "RRPN", "pooled_h": int(p.pooled_h),
                "pooled_w": int(p.pooled_w), "spatial_scale": float(p.spatial_scale)}

    def infer(self, attrs, in_shapes):
        data, rois = in_shapes[0], in_shapes[1]
        if len(data) != 4:
            raise LayerError(f"{attrs['kind']} needs 4-axis data (N, C, H, W), got {list(data)}")
        return [(rois[0], data[1], attrs["pooled_h"], attrs["pooled_w"])]

    def why_not_run(self, attrs):
        proposals = "corner-based proposals" if attrs["fork"] == "CRPN" else "rotated proposals"
        return (f"caffeq does not run {attrs['fork']}'s rotated ROI pooling (its rois come from {attrs['fork']}'s "
                f"{proposals}, which it does not run either)")
