"""Well-known Python layers run natively: AffordanceNet's PredToProposalLayer, YOLOv3-caffe's
interp.UpsamplingBilinear2d, SSH's proposal layer and CTPN's text proposals under CMT's module path.

Each reference is numpy written here from the module's Python source (nqanh/affordance-net
lib/rpn/pred_to_proposal_layer.py with lib/fast_rcnn's bbox_transform_inv, clip_boxes and GPU NMS;
jasonlovescoding/YOLOv3-caffe interp.py, i.e. cv2.resize INTER_NEAREST; mahyarnajibi/SSH
SSH/layers/proposal_layer.py at TEST), one box at a time in float32 as the modules store it.
"""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net

import caffeq
from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
f32 = np.float32


def ref_iou(a, b):
    """The GPU NMS's IoU (nms_kernel.cu devIoU): float32, sizes count both end pixels."""
    w = max(f32(min(a[2], b[2]) - max(a[0], b[0])) + f32(1), f32(0))
    h = max(f32(min(a[3], b[3]) - max(a[1], b[1])) + f32(1), f32(0))
    inter = f32(w * h)
    sa = f32(f32(a[2] - a[0] + f32(1)) * f32(a[3] - a[1] + f32(1)))
    sb = f32(f32(b[2] - b[0] + f32(1)) * f32(b[3] - b[1] + f32(1)))
    return f32(inter / f32(f32(sa + sb) - inter))


def ref_nms(dets, thresh):
    """gpu_nms: sort by score (argsort()[::-1]), keep a box unless its IoU with a kept one is > thresh."""
    order = np.argsort(dets[:, 4], kind="stable")[::-1]
    kept = []
    for i in order:
        if all(ref_iou(dets[j], dets[i]) <= f32(thresh) for j in kept):
            kept.append(i)
    return kept


# ---- PredToProposalLayer ------------------------------------------------------------------------

def ref_pred_to_proposal(rois, deltas, scores, im_info, thresh, max_per_image, nms=0.3):
    im_scale = im_info[0][2]
    boxes0 = rois[:, 1:5] / im_scale
    k = scores.shape[1]
    limit_x = f32(im_info[0][1] / im_scale) - f32(1)
    limit_y = f32(im_info[0][0] / im_scale) - f32(1)
    boxes = np.zeros(deltas.shape, f32)
    for r, (x1, y1, x2, y2) in enumerate(boxes0):
        w, h = f32(x2 - x1 + f32(1)), f32(y2 - y1 + f32(1))
        cx, cy = f32(x1 + f32(0.5) * w), f32(y1 + f32(0.5) * h)
        for j in range(k):
            dx, dy, dw, dh = deltas[r, 4 * j:4 * j + 4]
            px, py = f32(dx * w + cx), f32(dy * h + cy)
            pw, ph = f32(np.exp(dw) * w), f32(np.exp(dh) * h)
            box = [f32(px - f32(0.5) * pw), f32(py - f32(0.5) * ph), f32(px + f32(0.5) * pw), f32(py + f32(0.5) * ph)]
            lim = [limit_x, limit_y, limit_x, limit_y]
            boxes[r, 4 * j:4 * j + 4] = [max(min(v, m), f32(0)) for v, m in zip(box, lim)]
    per_class = {}
    for j in range(1, k):
        inds = np.where(scores[:, j] > thresh)[0]
        dets = np.hstack((boxes[inds, 4 * j:4 * j + 4], scores[inds, j][:, None])).astype(f32)
        per_class[j] = dets[ref_nms(dets, nms)] if len(dets) else dets
    if max_per_image > 0:
        image_scores = np.hstack([per_class[j][:, -1] for j in range(1, k)])
        if len(image_scores) > max_per_image:
            cut = np.sort(image_scores)[-max_per_image]
            per_class = {j: d[d[:, -1] >= cut] for j, d in per_class.items()}
    n = max(sum(len(d) for d in per_class.values()), 1)
    for_mask, final = np.zeros((n, 5), f32), np.zeros((n, 5), f32)
    score, ind = -np.ones((n, 1), f32), -np.ones((n, 1), f32)
    count = 0
    for j in range(1, k):
        c = len(per_class[j])
        if c:
            for_mask[count:count + c, 1:5] = per_class[j][:, :4] * im_scale
            final[count:count + c, 1:5] = per_class[j][:, :4]
            score[count:count + c, 0] = per_class[j][:, 4]
            ind[count:count + c, 0] = j
            count += c
    return {"rois_for_mask": for_mask, "rois_class_score": score, "rois_class_ind": ind, "rois_final": final}


def pred_to_proposal_net(r, k, param_str="'max_per_image': 100 \\n'thresh': 0.05", extra=""):
    layer = ('layer { name: "p2p" type: "Python" bottom: "rois" bottom: "bbox_pred" bottom: "cls_prob" '
             'bottom: "im_info" top: "rois_for_mask" top: "rois_class_score" top: "rois_class_ind" '
             'top: "rois_final" python_param { module: "rpn.pred_to_proposal_layer" '
             f'layer: "PredToProposalLayer" param_str: "{param_str}" }} }}')
    return net(layer, extra, inputs={"rois": (r, 5), "bbox_pred": (r, 4 * k), "cls_prob": (r, k), "im_info": (1, 3)})


def detections(r, k, im_info, seed=0):
    """rois crowded on a few places (so NMS has work), small deltas, scores spread around the thresholds."""
    g = np.random.default_rng(seed)
    centres = g.uniform(10, [im_info[1], im_info[0]], (3, 2))
    c = centres[g.integers(0, 3, r)] + g.normal(0, 4, (r, 2))
    half = g.uniform(8, 40, (r, 2))
    rois = np.hstack([np.zeros((r, 1)), c - half, c + half]).astype(f32)
    deltas = (g.standard_normal((r, 4 * k)) * 0.15).astype(f32)
    deltas[0, 4:8] = [0, 0, 3, 3]   # a box far larger than the image: clipped on every side
    prob = g.random((r, k)).astype(f32)
    return {"rois": rois, "bbox_pred": deltas, "cls_prob": prob, "im_info": np.array([im_info], f32)}


@pytest.mark.parametrize("r, k, im_info, param_str, thresh, cap", [
    (13, 4, [90, 130, 1.6], "'max_per_image': 100 \\n'thresh': 0.05", 0.05, 100),   # the files' settings
    (17, 3, [70, 110, 0.8], "'max_per_image': 5 \\n'thresh': 0.3", 0.3, 5),         # the cut takes part
    (11, 5, [60, 60, 1.0], "{'max_per_image': 0, 'thresh': 0.5}", 0.5, 0),         # no cut
])
def test_pred_to_proposal_matches_the_reference(r, k, im_info, param_str, thresh, cap, tmp_path):
    model = load_from_text(pred_to_proposal_net(r, k, param_str))
    rows = max(min(r * (k - 1), cap) if cap else r * (k - 1), 1)
    assert model.blob_shapes["rois_for_mask"] == (rows, 5) and model.blob_shapes["rois_class_ind"] == (rows, 1)
    x = detections(r, k, im_info, seed=r)
    x["cls_prob"][1, 1] = f32(thresh)                      # exactly at thresh: not taken (> thresh)
    x["cls_prob"][2, 1] = np.nextafter(f32(thresh), f32(1))
    x["cls_prob"][0, 1] = 0.99                             # the box larger than the image stays
    ref = ref_pred_to_proposal(x["rois"], x["bbox_pred"], x["cls_prob"], x["im_info"], thresh, cap)
    n = len(ref["rois_final"])
    taken = (x["cls_prob"][:, 1:] > thresh).sum()
    assert 1 < n < taken   # NMS (and the cut) dropped some
    if cap:
        assert n <= cap
    assert (ref["rois_final"][:, 1] == 0).any()            # clipping took part
    check_everywhere(model, x, ref, tmp_path, atol=1e-4, rtol=1e-6)


def test_pred_to_proposal_ties_at_the_cut_all_stay(tmp_path):
    model = load_from_text(pred_to_proposal_net(6, 3, "'max_per_image': 2 \\n'thresh': 0.1"))
    x = detections(6, 3, [200, 200, 1.0], seed=3)
    x["rois"] = np.array([[0, 10 + 40 * i, 10, 40 + 40 * i, 40] for i in range(6)], f32)   # apart: no NMS
    x["cls_prob"][:] = 0.05
    x["cls_prob"][[0, 3, 5], 1] = [0.9, 0.7, 0.4]
    x["cls_prob"][[1, 4], 2] = [0.7, 0.2]                  # 0.7 twice: the 2nd best score, tied
    ref = ref_pred_to_proposal(x["rois"], x["bbox_pred"], x["cls_prob"], x["im_info"], 0.1, 2)
    np.testing.assert_array_equal(ref["rois_class_ind"][:, 0], [1, 1, 2])
    check_everywhere(model, x, ref, tmp_path, atol=1e-4, rtol=1e-6)


def test_pred_to_proposal_tied_scores_rank_the_higher_index_first_everywhere(tmp_path):
    # scores from three values: within a class the module's argsort()[::-1] takes equal scores higher
    # index first, which decides what NMS keeps; ONNX's NonMaxSuppression alone would take the lower one
    r, k = 17, 3
    model = load_from_text(pred_to_proposal_net(r, k, "'max_per_image': 0 \\n'thresh': 0.05"))
    x = detections(r, k, [70, 110, 0.8], seed=r)
    x["cls_prob"] = (np.round(x["cls_prob"] * 2) / 4 + 0.25).astype(f32)
    ref = ref_pred_to_proposal(x["rois"], x["bbox_pred"], x["cls_prob"], x["im_info"], 0.05, 0)
    check_everywhere(model, x, ref, tmp_path, atol=1e-4, rtol=1e-6)


def test_pred_to_proposal_with_nothing_above_thresh_writes_one_default_row(tmp_path):
    model = load_from_text(pred_to_proposal_net(5, 3, "'max_per_image': 100 \\n'thresh': 0.5"))
    x = detections(5, 3, [80, 90, 1.0])
    x["cls_prob"][:, 1:] = 0.5
    ref = {"rois_for_mask": np.zeros((1, 5), f32), "rois_class_score": -np.ones((1, 1), f32),
           "rois_class_ind": -np.ones((1, 1), f32), "rois_final": np.zeros((1, 5), f32)}
    check_everywhere(model, x, ref, tmp_path)


def test_pred_to_proposal_feeds_roi_alignment(tmp_path):
    """The mask branch's start: the detections' rois pool a feature map (data-dependent rows)."""
    align = ('layer { name: "align" type: "ROIAlignment" bottom: "feat" bottom: "rois_for_mask" top: "pooled" '
             'roi_alignment_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.0625 } }')
    text = pred_to_proposal_net(9, 3, "'max_per_image': 4 \\n'thresh': 0.2", align)
    model = load_from_text(net(text, inputs={"feat": (1, 2, 7, 9)}))
    x = detections(9, 3, [100, 140, 1.0], seed=5)
    x["feat"] = np.random.default_rng(1).standard_normal((1, 2, 7, 9)).astype(f32)
    got = model.run(x)
    ref = ref_pred_to_proposal(x["rois"], x["bbox_pred"], x["cls_prob"], x["im_info"], 0.2, 4)
    assert got["pooled"].shape == (len(ref["rois_for_mask"]), 2, 3, 2)
    assert len(ref["rois_final"]) > 1
    check_everywhere(model, x, {"pooled": got["pooled"], "rois_final": ref["rois_final"],
                                "rois_class_ind": ref["rois_class_ind"]}, tmp_path, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("param_str, msg", [
    ("'thresh': 0.05", "'max_per_image' is required"),
    ("'max_per_image': 100", "'thresh' is required"),
    ("'max_per_image': 1.5 \\n'thresh': 0.05", "must be an integer"),
    ("'max_per_image': 100 \\n'thresh': 0.05 \\n'nms': 0.4", "reads only"),
])
def test_pred_to_proposal_bad_param_str(param_str, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(pred_to_proposal_net(4, 3, param_str))


def test_pred_to_proposal_bad_shapes():
    text = pred_to_proposal_net(4, 3).replace("dim: 4 dim: 12", "dim: 4 dim: 8")
    with pytest.raises(LayerError, match=r"bbox_pred must be \(4, 12\)"):
        load_from_text(text)
    with pytest.raises(LayerError, match="K >= 2"):
        load_from_text(pred_to_proposal_net(4, 1))


# ---- interp.UpsamplingBilinear2d -----------------------------------------------------------------

def upsample_net(c, h, w, param_str='{\\"zoom_factor\\":2}', n=2):
    layer = ('layer { name: "up" type: "Python" bottom: "x" top: "y" python_param { module: "interp" '
             f'layer: "UpsamplingBilinear2d" param_str: "{param_str}" }} }}')
    return net(layer, inputs={"x": (n, c, h, w)})


def ref_cv_nearest(x, zoom):
    """interp.py: per image, cv2.resize of the (H, W, C) array to (int(W * zoom), int(H * zoom)), nearest;
    OpenCV's rule written out: source index floor(i * (1 / (out / in))) capped at in - 1."""
    n, c, h, w = x.shape
    ho, wo = int(h * zoom), int(w * zoom)
    rows = [min(int(np.floor(i * (1.0 / (ho / h)))), h - 1) for i in range(ho)]
    cols = [min(int(np.floor(i * (1.0 / (wo / w)))), w - 1) for i in range(wo)]
    return x[:, :, rows][:, :, :, cols]


@pytest.mark.parametrize("c, h, w, zoom", [(3, 5, 5, 2), (4, 6, 6, 1.5), (5, 7, 7, 2.3), (2, 9, 9, 0.5)])
def test_upsampling_is_opencv_nearest(c, h, w, zoom, tmp_path):
    model = load_from_text(upsample_net(c, h, w, f'{{\\"zoom_factor\\": {zoom}}}'))
    x = {"x": np.random.default_rng(c).standard_normal((2, c, h, w)).astype(f32)}
    ref = ref_cv_nearest(x["x"], zoom)
    assert model.blob_shapes["y"] == ref.shape
    cv2 = pytest.importorskip("cv2")
    size = (int(w * zoom), int(h * zoom))
    by_cv2 = np.stack([cv2.resize(img.transpose(1, 2, 0), size, interpolation=cv2.INTER_NEAREST).transpose(2, 0, 1)
                       for img in x["x"]])
    np.testing.assert_array_equal(by_cv2, ref)
    check_everywhere(model, x, {"y": ref}, tmp_path)


@pytest.mark.parametrize("shape, param_str, msg", [
    ((3, 4, 6), '{\\"zoom_factor\\":2}', "only for a square output"),
    ((1, 4, 4), '{\\"zoom_factor\\":2}', "2 to 512 channels"),
    ((3, 4, 4), '{\\"zoom\\":2}', "'zoom_factor' must be a positive number"),
    ((3, 4, 4), '{\\"zoom_factor\\":0.1}', "leaves a 0x0 output"),
])
def test_upsampling_refuses_what_the_module_cannot_run(shape, param_str, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(upsample_net(*shape, param_str=param_str))


# ---- DORN's ordinal_decode_layer.OrdinalDecodeLayer ---------------------------------------------

def ordinal_net(c, h, w, n=2):
    layer = ('layer { type: "Python" name: "decode_ord" top: "decode_ord" bottom: "x" python_param { '
             'module: "ordinal_decode_layer" layer: "OrdinalDecodeLayer" } }')
    return net(layer, inputs={"x": (n, c, h, w)})


def ref_ordinal_decode(x):
    """The module's forward: the sum over pairs i < C // 2 of np.argmax over channels (2i, 2i + 1)."""
    n, c, h, w = x.shape
    out = np.zeros((n, 1, h, w), np.float32)
    for i in range(c // 2):
        out = out + np.argmax(x[:, 2 * i:2 * i + 2], axis=1)[:, None]
    return out.astype(np.float32)


@pytest.mark.parametrize("c, h, w", [(8, 3, 5), (7, 4, 3), (2, 1, 6), (1, 2, 2)])
def test_ordinal_decode_counts_pairs_as_numpy_argmax(c, h, w, tmp_path):
    model = load_from_text(ordinal_net(c, h, w))
    rng = np.random.default_rng(c)
    x = rng.standard_normal((2, c, h, w)).astype(f32)
    if c >= 2:
        x[0, 1] = x[0, 0]                          # a tie: argmax keeps the first
    if c >= 4:
        x[1, 2, 0, 0], x[1, 3, 0, 1] = np.nan, np.nan   # NaN is argmax's maximum
        x[1, 2, 0, 2] = x[1, 3, 0, 2] = np.nan
    ref = ref_ordinal_decode(x)
    assert model.blob_shapes["decode_ord"] == (2, 1, h, w)
    check_everywhere(model, {"x": x}, {"decode_ord": ref}, tmp_path)


def test_ordinal_decode_needs_4_axes():
    with pytest.raises(LayerError, match=r"OrdinalDecodeLayer reads \(N, C, H, W\) scores, got \[2, 6\]"):
        load_from_text(net('layer { type: "Python" name: "d" top: "d" bottom: "x" python_param { '
                           'module: "ordinal_decode_layer" layer: "OrdinalDecodeLayer" } }', inputs={"x": (2, 6)}))


# ---- SSH's proposal layer ------------------------------------------------------------------------

def ssh_anchors(base, ratios, scales):
    rows = []
    for r in ratios:   # generate_anchors: ratios outer, scales inner; sides rounded half to even
        w0 = np.round(np.sqrt(base * base / r))
        h0 = np.round(w0 * r)
        for s in scales:
            w, h, c = w0 * s, h0 * s, (base - 1) / 2.0
            rows.append([c - (w - 1) / 2, c - (h - 1) / 2, c + (w - 1) / 2, c + (h - 1) / 2])
    return np.array(rows)


def ref_ssh(prob, deltas, im_info, stride, scales, ratios=(0.5, 1, 2), base=16, pre=1000):
    """SSH's ProposalLayer.forward at TEST: decode, clip, no size filter (ANCHOR_MIN_SIZE 0), sort, keep
    the best N_DETS_PER_MODULE, no NMS; [[0, 0, 0, 16, 16]] when nothing is left."""
    anchors = ssh_anchors(base, ratios, scales)
    a = len(anchors)
    _, _, height, width = prob.shape
    boxes, scores = [], []
    for y in range(height):
        for x in range(width):
            for k in range(a):
                anc = (anchors[k] + [x * stride, y * stride, x * stride, y * stride]).astype(f32)
                d = deltas[0, 4 * k:4 * k + 4, y, x]
                aw, ah = f32(anc[2] - anc[0] + f32(1)), f32(anc[3] - anc[1] + f32(1))
                cx, cy = f32(d[0] * aw + f32(anc[0] + f32(0.5) * aw)), f32(d[1] * ah + f32(anc[1] + f32(0.5) * ah))
                w, h = f32(np.exp(d[2]) * aw), f32(np.exp(d[3]) * ah)
                box = [f32(cx - f32(0.5) * w), f32(cy - f32(0.5) * h), f32(cx + f32(0.5) * w), f32(cy + f32(0.5) * h)]
                lim = [im_info[0, 1] - f32(1), im_info[0, 0] - f32(1)]
                boxes.append([max(min(v, lim[i % 2]), f32(0)) for i, v in enumerate(box)])
                scores.append(prob[0, a + k, y, x])
    boxes, scores = np.array(boxes, f32), np.array(scores, f32)
    keep = [i for i, b in enumerate(boxes) if b[2] - b[0] + 1 >= 0 and b[3] - b[1] + 1 >= 0]
    boxes, scores = boxes[keep], scores[keep]
    order = np.argsort(scores, kind="stable")[::-1][:pre]
    boxes, scores = boxes[order], scores[order]
    if not len(boxes):
        return np.array([[0, 0, 0, 16, 16]], f32), scores[:, None]
    return np.hstack([np.zeros((len(boxes), 1), f32), boxes]), scores[:, None]


def ssh_net(a, h, w, param_str):
    layer = ('layer { name: "m1@ssh_proposal" type: "Python" bottom: "prob" bottom: "deltas" bottom: "im_info" '
             'top: "boxes" top: "scores" python_param { module: "SSH.layers.proposal_layer" layer: "ProposalLayer" '
             f'param_str: "{param_str}" }} }}')
    return net(layer, inputs={"prob": (1, 2 * a, h, w), "deltas": (1, 4 * a, h, w), "im_info": (1, 3)})


def ssh_feeds(a, h, w, im_info, seed=0):
    g = np.random.default_rng(seed)
    return {"prob": g.random((1, 2 * a, h, w)).astype(f32),
            "deltas": (g.standard_normal((1, 4 * a, h, w)) * 0.4).astype(f32),
            "im_info": np.array([im_info], f32)}


@pytest.mark.parametrize("h, w, param_str, kw", [
    (5, 7, "{'feat_stride': 8,'scales': [1,2], 'ratios':[1,]}", {"stride": 8, "scales": (1, 2), "ratios": (1,)}),
    (23, 25, "{'feat_stride': 16,'scales': [4,8], 'ratios':[1,]}", {"stride": 16, "scales": (4, 8), "ratios": (1,)}),
    (4, 6, "{'feat_stride': 16, 'base_size': 8}", {"stride": 16, "scales": (8, 16, 32), "base": 8}),
])
def test_ssh_proposals_match_the_reference(h, w, param_str, kw, tmp_path):
    a = len(kw.get("ratios", (0.5, 1, 2))) * len(kw["scales"])
    model = load_from_text(ssh_net(a, h, w, param_str))
    assert model.blob_shapes["boxes"] == (min(h * w * a, 1000), 5)
    x = ssh_feeds(a, h, w, [h * kw["stride"] - 5, w * kw["stride"] - 9, 1.3], seed=h)
    ref_boxes, ref_scores = ref_ssh(x["prob"], x["deltas"], x["im_info"], **kw)
    assert len(ref_boxes) == min(h * w * a, 1000)   # no NMS: only the 1000 cut (23 x 25 x 2 = 1150)
    check_everywhere(model, x, {"boxes": ref_boxes, "scores": ref_scores}, tmp_path, atol=1e-4, rtol=1e-6)


def test_ssh_with_no_box_left_writes_its_default_roi(tmp_path):
    model = load_from_text(ssh_net(2, 3, 4, "{'feat_stride': 8,'scales': [1,2], 'ratios':[1,]}"))
    x = ssh_feeds(2, 3, 4, [30, 40, 1.0])
    x["deltas"][:] = np.nan   # every side NaN: the size filter (>= 0) drops them all
    ref = {"boxes": np.array([[0, 0, 0, 16, 16]], f32), "scores": np.zeros((0, 1), f32)}
    check_everywhere(model, x, ref, tmp_path)


def test_ssh_param_str_is_checked(tmp_path):
    with pytest.raises(LayerError, match="'feat_stride' is required"):
        load_from_text(ssh_net(2, 3, 4, "{'scales': [1,2], 'ratios':[1,]}"))
    with pytest.raises(LayerError, match="reads only"):
        load_from_text(ssh_net(2, 3, 4, "{'feat_stride': 8, 'pre_nms_topN': 10}"))
    model = load_from_text(ssh_net(2, 3, 4, "{'feat_stride': 8}"))   # 9 default anchors, 2 given: reads
    with pytest.raises(ExportError, match="the net scores 2 anchors per position"):
        model.export_onnx(str(tmp_path / "m.onnx"))


# ---- CTPN's text proposals under CMT-Text-Detection's module path --------------------------------

def test_ctpn_module_vendored_as_a_package_is_the_same_layer():
    from caffeq.layers import get_spec
    assert get_spec("Python:CTPN.layers.text_proposal_layer.ProposalLayer") is \
        get_spec("Python:layers.text_proposal_layer.ProposalLayer")
    a, h, w = 10, 3, 5
    layer = ('layer {{ name: "proposal" type: "Python" bottom: "prob" bottom: "deltas" bottom: "im_info" '
             'top: "rois" top: "scores" python_param {{ module: "{}" layer: "ProposalLayer" '
             'param_str: "\'feat_stride\': 16" }} }}')
    g = np.random.default_rng(0)
    x = {"prob": g.random((1, 2 * a, h, w)).astype(f32), "deltas": (g.standard_normal((1, 2 * a, h, w)) * 0.3).astype(f32),
         "im_info": np.array([[40, 70, 1.0]], f32)}
    outs = [load_from_text(net(layer.format(m), inputs={"prob": (1, 2 * a, h, w), "deltas": (1, 2 * a, h, w),
                                                         "im_info": (1, 3)})).run(x)
            for m in ("layers.text_proposal_layer", "CTPN.layers.text_proposal_layer")]
    for blob in ("rois", "scores"):
        np.testing.assert_array_equal(outs[0][blob], outs[1][blob])


# ---- the real files ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, layer, shapes", [
    ("nqanh__affordance-net__models__pascal_voc__VGG16__faster_rcnn_end2end__test.prototxt", "pred_2_proposal",
     [(100, 5), (100, 1), (100, 1), (100, 5)]),
    ("MartinPlantinga__TomatoNet__models__tomato_db__VGG16__mask_rcnn_end2end__test.prototxt", "pred_2_proposal",
     [(100, 5), (100, 1), (100, 1), (100, 5)]),
    ("jasonlovescoding__YOLOv3-caffe__model__yolov3.prototxt", "Interp202", [(1, 256, 26, 26)]),
    ("mahyarnajibi__SSH__SSH__models__test_ssh.prototxt", "m1@ssh_proposal", [(1000, 5), (1000, 1)]),
    ("tocigm__CMT-Text-Detection__models__deploy.prototxt", "proposal", None),
])
def test_real_files_read(name, layer, shapes):
    model = caffeq.load(REALWORLD / name)
    node = next(n for n in model.layers if n.name == layer)
    if shapes is not None:
        assert [model.graph.tensors[t].shape for t in node.outputs] == shapes


def maxout_ref(x, scales):
    """R2CNN's maxout_layer/layer.py: np.maximum over the scales' row blocks, starting from zeros."""
    x4 = x.reshape(x.shape[0], x.shape[1], 1, 1) if x.ndim == 2 else x
    per = x4.shape[0] // scales
    out = np.zeros((per,) + x4.shape[1:], x4.dtype)
    for i in range(scales):
        out = np.maximum(out, x4[per * i: per * (i + 1)])
    return out


@pytest.mark.parametrize("rois, info", [((6, 3, 2, 2), (1, 4)), ((4, 5), (1, 3)), ((9, 2, 3, 1), (1, 5))])
def test_r2cnn_maxout_takes_each_rois_best_scale(rois, info, tmp_path):
    layer = ('layer { name: "mo" type: "Python" bottom: "x" bottom: "im_info" top: "y" '
             'python_param { module: "maxout_layer.layer" layer: "MaxoutLayer" } }')
    model = load_from_text(net(layer, inputs={"x": rois, "im_info": info}))
    scales = info[1] - 2
    x = np.random.default_rng(3).standard_normal(rois).astype(np.float32)
    feeds = {"x": x, "im_info": np.ones(info, np.float32)}
    ref = maxout_ref(x, scales)
    assert model.blob_shapes["y"] == ref.shape
    check_everywhere(model, feeds, {"y": ref}, tmp_path)


def test_r2cnn_maxout_needs_whole_blocks_of_rois():
    layer = ('layer { name: "mo" type: "Python" bottom: "x" bottom: "im_info" top: "y" '
             'python_param { module: "maxout_layer.layer" layer: "MaxoutLayer" } }')
    with pytest.raises(LayerError, match="5 rois do not split into 2 scales"):
        load_from_text(net(layer, inputs={"x": (5, 3, 2, 2), "im_info": (1, 4)}))
