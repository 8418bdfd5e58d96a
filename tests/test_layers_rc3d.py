"""R-C3D's family (VisionLearningGroup/R-C3D, JEDDi-Net, Text-to-Clip_Retrieval): the 3-D ROIPooling
(pooled_l, temporal_scale), the temporal rpn.proposal_layer.ProposalLayer, Text-to-Clip's CaptionLayer,
JEDDi-Net's GTbox_sorted and GTboxes_to_GTrois, and the train nets' Python layers (read and sized).

The references are numpy loops written here from the forks' code: caffe3d roi_pooling_layer.cpp (rows and
columns 0..6 for every roi, C's round of the float32 start and end times temporal_scale, Fast R-CNN's
float32 bins), lib/rpn/generate_anchors.py, lib/tdcnn/twin_transform.py, lib/rpn/proposal_layer.py with
config.py's TEST values and the GPU NMS's IoU test, lib/rpn/caption_layer.py, GTbox_sorted.py and
GTboxes_to_GTrois.py.
"""
import math

import numpy as np
import pytest
from c_reference import c_round
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


# ---- references -------------------------------------------------------------------------------

def ref_bins(start, end, pooled, size):
    """roi_pooling_layer.cpp's bins over [start, end] (float32 bin size), clipped to [0, size]."""
    span = f32(max(end - start + 1, 1)) / f32(pooled)
    return [(min(max(math.floor(f32(i) * span) + start, 0), size),
             min(max(math.ceil(f32(i + 1) * span) + start, 0), size)) for i in range(pooled)]


def ref_roi_pool(x, rois, pl, ph, pw, temporal_scale):
    _, c, length, h, w = x.shape
    out = np.zeros((len(rois), c, pl, ph, pw), f32)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        start = int(c_round(float(f32(roi[1]) * f32(temporal_scale))))
        end = int(c_round(float(f32(roi[2]) * f32(temporal_scale))))
        for i, (ls, le) in enumerate(ref_bins(start, end, pl, length)):
            for j, (hs, he) in enumerate(ref_bins(0, 6, ph, h)):        # roi_start_h = 0, roi_end_h = 6
                for k, (ws, we) in enumerate(ref_bins(0, 6, pw, w)):
                    if le > ls and he > hs and we > ws:
                        out[r, :, i, j, k] = x[b, :, ls:le, hs:he, ws:we].max(axis=(1, 2, 3))
    return out


def ref_anchors(scales):
    base = np.array([1, 8]) - 1
    length = base[1] - base[0] + 1
    ctr = base[0] + 0.5 * (length - 1)
    ls = length * np.array(scales)
    return np.stack([ctr - 0.5 * (ls - 1), ctr + 0.5 * (ls - 1)], axis=1)


def ref_decode(win, dx, dl):
    length = f32(win[1] - win[0] + f32(1))
    ctr = f32(win[0] + f32(0.5) * length)
    pc, pl = f32(dx * length + ctr), f32(np.exp(dl) * length)
    return [f32(pc - f32(0.5) * pl), f32(pc + f32(0.5) * pl)]


def ref_iou(a, b):
    """The GPU NMS kernel's devIoU, float32, lengths with both end frames."""
    inter = max(f32(min(a[1], b[1]) - max(a[0], b[0])) + f32(1), f32(0))
    sa, sb = f32(a[1] - a[0] + f32(1)), f32(b[1] - b[0] + f32(1))
    return f32(inter / f32(f32(sa + sb) - inter))


def ref_proposals(prob, deltas, stride, scales, pre=6000, post=300, thresh=0.7, min_size=8):
    anchors = ref_anchors(scales)
    a, length = len(anchors), prob.shape[2]
    top = f32(length * stride - 1)
    wins, scores = [], []
    for t in range(length):                       # rows ordered (l, a)
        for k in range(a):
            anc = (anchors[k] + t * stride).astype(f32)
            win = ref_decode(anc, deltas[0, 2 * k, t, 0, 0], deltas[0, 2 * k + 1, t, 0, 0])
            wins.append([max(min(v, top), f32(0)) for v in win])
            scores.append(prob[0, a + k, t, 0, 0])
    wins, scores = np.array(wins, f32), np.array(scores, f32)
    keep = [i for i, w in enumerate(wins) if w[1] - w[0] + f32(1) >= min_size]
    wins, scores = wins[keep], scores[keep]
    order = np.argsort(scores, kind="stable")[::-1]
    order = order[:pre] if pre > 0 else order
    wins, scores = wins[order], scores[order]
    kept = []
    for i in range(len(wins)):
        if all(ref_iou(wins[j], wins[i]) <= f32(thresh) for j in kept):
            kept.append(i)
    kept = kept[:post] if post > 0 else kept
    return np.concatenate([np.zeros((len(kept), 1), f32), wins[kept]], axis=1), scores[kept][:, None]


# ---- ROIPooling with pooled_l -------------------------------------------------------------------

def roi3d_net(params, x_shape, rois_shape):
    return net(f'layer {{ name: "r" type: "ROIPooling" bottom: "x" bottom: "rois" top: "r" '
               f'roi_pooling_param {{ {params} }} }}', inputs={"x": x_shape, "rois": rois_shape})


ROIS = np.array([
    [0, 3.2, 40.7],      # * 0.125 -> 0.4, 5.09 -> 0, 5
    [1, 20.0, 28.0],     # 2.5 -> 3 (half away from zero), 3.5 -> 4
    [1, -30.0, 9.0],     # starts before the clip
    [0, 50.0, 90.0],     # ends after it
    [0, 44.0, 12.0],     # end before start: one frame long
    [1, 100.0, 120.0],   # wholly after the clip: zeros
], np.float32)


@pytest.mark.parametrize("x_shape, pl, ph, pw", [
    ((2, 3, 9, 8, 6), 3, 2, 4),     # H > 7: rows 7 on are never pooled; W < 7: the last column bin clips
    ((2, 2, 7, 5, 3), 2, 3, 4),     # W = 3: two of the four column bins are empty (0)
    ((2, 4, 6, 7, 7), 1, 4, 4),     # R-C3D's own pooled_l 1, 4 x 4 over a 7 x 7 map
])
def test_roi_pooling_3d_matches_the_fork(x_shape, pl, ph, pw, tmp_path):
    x = rng(1).standard_normal(x_shape).astype(np.float32)
    params = f"pooled_l: {pl} pooled_h: {ph} pooled_w: {pw} spatial_scale: 0.0625 temporal_scale: 0.125"
    model = load_from_text(roi3d_net(params, x_shape, ROIS.shape))
    assert model.blob_shapes["r"] == (len(ROIS), x_shape[1], pl, ph, pw)
    ref = ref_roi_pool(x, ROIS, pl, ph, pw, 0.125)
    check_everywhere(model, {"x": x, "rois": ROIS}, {"r": ref}, tmp_path)


def test_roi_pooling_3d_all_negative_bins_and_no_rois(tmp_path):
    x = -np.abs(rng(2).standard_normal((1, 2, 5, 7, 7))).astype(np.float32) - 1
    rois = np.array([[0, 1, 3], [0, 0, 4]], np.float32)
    model = load_from_text(roi3d_net("pooled_l: 2 pooled_h: 3 pooled_w: 2", x.shape, rois.shape))
    check_everywhere(model, {"x": x, "rois": rois}, {"r": ref_roi_pool(x, rois, 2, 3, 2, 1.0)}, tmp_path)
    assert model.run({"x": x, "rois": np.zeros((0, 3), np.float32)})["r"].shape == (0, 2, 2, 3, 2)


def test_plain_roi_pooling_keeps_its_spec():
    from caffeq.layers.rc3d import RC3DRoiPooling
    from caffeq.layers.roi_pooling import ROIPooling
    two_d = load_from_text(net('layer { name: "r" type: "ROIPooling" bottom: "x" bottom: "rois" top: "r" '
                               'roi_pooling_param { pooled_h: 2 pooled_w: 2 } }', inputs={"x": (1, 2, 5, 6), "rois": (3, 5)}))
    three_d = load_from_text(roi3d_net("pooled_l: 1 pooled_h: 2 pooled_w: 2", (1, 2, 4, 5, 6), (3, 3)))
    assert type(two_d.graph.nodes[-1].spec) is ROIPooling and two_d.blob_shapes["r"] == (3, 2, 2, 2)
    assert type(three_d.graph.nodes[-1].spec) is RC3DRoiPooling


@pytest.mark.parametrize("params, x_shape, msg", [
    ("pooled_h: 2 pooled_w: 2 temporal_scale: 0.5", (1, 2, 4, 5, 6), r"pooled_l must be > 0 \(R-C3D"),
    ("pooled_l: 1 pooled_h: 2 pooled_w: 2", (1, 2, 5, 6), "needs a 5-axis input"),
    ("pooled_l: 1 pooled_h: 2 pooled_w: 2 pad_ratio: 0.1", (1, 2, 4, 5, 6), "cannot be set with pad_ratio"),
])
def test_roi_pooling_3d_bad_params(params, x_shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(roi3d_net(params, x_shape, (3, 3)))


def test_roi_pooling_3d_bad_rois():
    # Reshape reads only the rois' count: (R, 5) rois read, and are refused when the layer runs
    wide = load_from_text(roi3d_net("pooled_l: 1 pooled_h: 2 pooled_w: 2", (1, 2, 4, 5, 6), (1, 5)))
    x = np.zeros((1, 2, 4, 5, 6), np.float32)
    with pytest.raises(LayerError, match=r"rois must be \(R, 3\) = \[batch, start, end\]"):
        wide.run({"x": x, "rois": np.zeros((1, 5), np.float32)})
    model = load_from_text(roi3d_net("pooled_l: 1 pooled_h: 2 pooled_w: 2", (1, 2, 4, 5, 6), (1, 3)))
    with pytest.raises(LayerError, match="roi batch index 2 is outside the batch of 1"):
        model.run({"x": x, "rois": np.array([[2, 0, 1]], np.float32)})


# ---- the temporal proposal layer ---------------------------------------------------------------

def proposal_net(a, length, param_str, tops=("rois", "scores"), hw=(1, 1)):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    shape = (1, 2 * a, length) + hw
    return net(f'layer {{ name: "proposal" type: "Python" bottom: "prob" bottom: "deltas" {top_text} '
               f'python_param {{ module: "rpn.proposal_layer" layer: "ProposalLayer" param_str: "{param_str}" }} }}',
               inputs={"prob": shape, "deltas": shape})


def proposal_feeds(a, length, seed=0, spread=0.5):
    g = rng(seed)
    return {"prob": g.random((1, 2 * a, length, 1, 1)).astype(np.float32),
            "deltas": (g.standard_normal((1, 2 * a, length, 1, 1)) * spread).astype(np.float32)}


def test_anchors_are_generate_anchors():
    from caffeq.layers.rc3d import rc3d_anchors
    assert rc3d_anchors([2, 4]) == [[-4.0, 11.0], [-12.0, 19.0]]
    np.testing.assert_array_equal(rc3d_anchors([1, 2.5, 7, 56]), ref_anchors([1, 2.5, 7, 56]))


@pytest.mark.parametrize("scales, length, stride, seed", [
    ([2, 4, 6], 11, 8, 0),
    ([1, 3, 5, 8], 7, 4, 3),
])
def test_twin_proposals_match_the_fork(scales, length, stride, seed, tmp_path):
    a = len(scales)
    text = proposal_net(a, length, f"'feat_stride': {stride} \\n'scales': !!python/tuple {scales}")
    model = load_from_text(text)
    assert model.blob_shapes["rois"] == (length * a, 3) and model.blob_shapes["scores"] == (length * a, 1)
    x = proposal_feeds(a, length, seed)
    rois, scores = ref_proposals(x["prob"], x["deltas"], stride, scales)
    assert 0 < len(rois) < length * a     # the size filter and NMS both dropped windows
    check_everywhere(model, x, {"rois": rois, "scores": scores}, tmp_path, atol=1e-4, rtol=1e-6)


def test_twin_proposals_with_tied_scores_match_everywhere(tmp_path):
    # scores from three values: the fork's reversed argsort ranks equal scores higher index first, and so
    # must ONNX (TopK alone ranks them lower index first)
    scales, length, stride = [2, 4, 6], 11, 8
    text = proposal_net(3, length, f"'feat_stride': {stride} \\n'scales': !!python/tuple {scales}")
    model = load_from_text(text)
    x = proposal_feeds(3, length, 5)
    x["prob"] = (rng(6).integers(0, 3, x["prob"].shape) / 4).astype(np.float32)
    rois, scores = ref_proposals(x["prob"], x["deltas"], stride, scales)
    check_everywhere(model, x, {"rois": rois, "scores": scores}, tmp_path, atol=1e-4, rtol=1e-6)


def test_twin_proposal_settings_against_the_reference():
    import torch

    from caffeq.layers.rc3d import rc3d_anchors, twin_proposals
    scales, length = [2, 3, 5, 9], 13
    x = proposal_feeds(len(scales), length, seed=5, spread=0.3)
    rois, scores = twin_proposals(torch.from_numpy(x["prob"]), torch.from_numpy(x["deltas"]),
                                  torch.tensor(rc3d_anchors(scales), dtype=torch.float64), 4, 20, 3, 0.5, 12.0)
    ref, ref_scores = ref_proposals(x["prob"], x["deltas"], 4, scales, pre=20, post=3, thresh=0.5, min_size=12)
    everything, _ = ref_proposals(x["prob"], x["deltas"], 4, scales, pre=0, post=0, thresh=0.5, min_size=12)
    assert rois.shape == (3, 3) and len(everything) > 3
    np.testing.assert_allclose(rois.numpy(), ref, rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(scores.numpy(), ref_scores)


def test_default_scales_and_one_top():
    model = load_from_text(proposal_net(63, 5, "'feat_stride': 8", tops=("rois",)))
    assert model.blob_shapes["rois"] == (300, 3)
    x = proposal_feeds(63, 5, seed=1)
    ref, _ = ref_proposals(x["prob"], x["deltas"], 8, list(range(1, 64)))
    np.testing.assert_allclose(model.run(x)["rois"], ref, rtol=1e-6, atol=1e-4)


def test_py_faster_rcnn_proposal_layer_keeps_its_spec():
    from caffeq.layers.rc3d import TwinProposalLayer
    from caffeq.layers.rcnn import PythonProposalLayer
    text = net('layer { name: "p" type: "Python" bottom: "prob" bottom: "deltas" bottom: "im_info" top: "rois" '
               'python_param { module: "rpn.proposal_layer" layer: "ProposalLayer" param_str: "\'feat_stride\': 16" } }',
               inputs={"prob": (1, 18, 3, 4), "deltas": (1, 36, 3, 4), "im_info": (1, 3)})
    assert type(load_from_text(text).graph.nodes[-1].spec) is PythonProposalLayer
    assert type(load_from_text(proposal_net(2, 4, "'feat_stride': 8")).graph.nodes[-1].spec) is TwinProposalLayer


def test_proposals_read_but_do_not_run_where_the_python_layer_fails(tmp_path):
    # 3 scales but 4 anchors scored: the Python layer's arrays do not pair
    model = load_from_text(proposal_net(4, 5, "'feat_stride': 8 \\n'scales': [1, 2, 3]"))
    with pytest.raises(CaffeqError, match="the net scores 4 anchors per position, but param_str 'scales' make 3"):
        model.run(proposal_feeds(4, 5))
    with pytest.raises(CaffeqError, match="the net scores 4 anchors"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    wide = load_from_text(proposal_net(2, 5, "'feat_stride': 8 \\n'scales': [1, 2]", hw=(2, 1)))
    assert wide.blob_shapes["rois"] == (20, 3)
    with pytest.raises(CaffeqError, match="fails unless H = W = 1"):
        wide.run({"prob": np.zeros((1, 4, 5, 2, 1), np.float32), "deltas": np.zeros((1, 4, 5, 2, 1), np.float32)})


@pytest.mark.parametrize("param_str, msg", [
    ("'scales': [1, 2]", "'feat_stride' must be a positive integer"),
    ("'feat_stride': 8 \\n'scales': []", "'scales' must be one or more positive numbers"),
])
def test_bad_proposal_params(param_str, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(proposal_net(2, 4, param_str))


# ---- Text-to-Clip's CaptionLayer, JEDDi-Net's GTbox_sorted and GTboxes_to_GTrois -------------------

def ref_captions(prob, deltas, rois, feats, top_n=64, min_size=0, video=768):
    wins = np.array([[max(min(v, f32(video - 1)), f32(0)) for v in ref_decode(r[1:], d[2], d[3])]
                     for r, d in zip(rois, deltas)], f32)
    keep = [i for i, w in enumerate(wins) if w[1] - w[0] + f32(1) >= min_size]
    order = np.array(keep, int)[np.argsort(prob[keep, 1], kind="stable")[::-1][:top_n]]
    out = np.concatenate([np.zeros((len(order), 1), f32), wins[order]], axis=1)
    return out, feats[order], prob[order, 1]


def caption_net(r, d, tops=("crois", "cfeat", "cscores")):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    return net(f'layer {{ name: "caption" type: "Python" bottom: "prob" bottom: "deltas" bottom: "rois" '
               f'bottom: "feats" {top_text} python_param {{ module: "rpn.caption_layer" layer: "CaptionLayer" }} }}',
               inputs={"prob": (r, 2), "deltas": (r, 4), "rois": (r, 3), "feats": (r, d)})


@pytest.mark.parametrize("r", [70, 9])
def test_caption_layer_matches_the_fork(r, tmp_path):
    g = rng(r)
    p = g.random((r, 1)).astype(np.float32)
    p[[1, 4, 7]] = p[0]   # tied scores: the higher index first, in every backend
    x = {"prob": np.concatenate([1 - p, p], 1), "deltas": (g.standard_normal((r, 4)) * 0.4).astype(np.float32),
         "rois": np.concatenate([np.zeros((r, 1)), np.sort(g.uniform(-20, 800, (r, 2)), 1)], 1).astype(np.float32),
         "feats": g.standard_normal((r, 5)).astype(np.float32)}
    model = load_from_text(caption_net(r, 5))
    n = min(r, 64)
    assert [model.blob_shapes[t] for t in ("crois", "cfeat", "cscores")] == [(n, 3), (n, 5), (n,)]
    rois, feats, scores = ref_captions(x["prob"], x["deltas"], x["rois"], x["feats"])
    check_everywhere(model, x, {"crois": rois, "cfeat": feats, "cscores": scores}, tmp_path, atol=1e-4, rtol=1e-6)


def test_gtbox_sorted_and_gt_windows_to_rois(tmp_path):
    g = rng(7)
    rois = np.concatenate([np.zeros((6, 1)), g.uniform(0, 50, (6, 1)), g.uniform(50, 99, (6, 1))], 1).astype(np.float32)
    rois[4, 2] = rois[1, 2]       # a tie keeps its order
    feats = g.standard_normal((6, 4)).astype(np.float32)
    gt = np.array([[3, 40, 1], [10, 90, 1], [55, 60, 1]], np.float32)
    text = net('layer { name: "sorted" type: "Python" bottom: "rois" bottom: "feats" top: "srois" top: "sfeats" '
               'python_param { module: "rpn.GTbox_sorted" layer: "ProposalTargetLayer" } }',
               'layer { name: "gt" type: "Python" bottom: "gt_boxes" top: "gt_rois" '
               'python_param { module: "rpn.GTboxes_to_GTrois" layer: "ProposalTargetLayer" } }',
               inputs={"rois": rois.shape, "feats": feats.shape, "gt_boxes": gt.shape})
    model = load_from_text(text)
    order = np.argsort(rois[:, 2], kind="stable")
    assert list(order).index(1) < list(order).index(4)
    refs = {"srois": rois[order], "sfeats": feats[order], "gt_rois": np.concatenate([np.zeros((3, 1), f32), gt[:, :2]], 1)}
    check_everywhere(model, {"rois": rois, "feats": feats, "gt_boxes": gt}, refs, tmp_path)


# ---- a net in the shape of R-C3D's test.prototxt ---------------------------------------------------

TINY_DATA = 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 32 dim: 28 dim: 28 } } }'
TINY_TRUNK = '''
layer { name: "conv1a" type: "Convolution" bottom: "data" top: "conv1a"
  convolution_param { num_output: 6 kernel_size: 3 kernel_size: 3 kernel_size: 3 pad: 1 pad: 1 pad: 1 } }
layer { name: "relu1a" type: "ReLU" bottom: "conv1a" top: "conv1a" }
layer { name: "pool1" type: "Pooling" bottom: "conv1a" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 kernel_size: 2 kernel_size: 2 stride: 2 stride: 2 stride: 2 } }
layer { name: "conv5b" type: "Convolution" bottom: "pool1" top: "conv5b"
  convolution_param { num_output: 8 kernel_size: 3 kernel_size: 3 kernel_size: 3 pad: 1 pad: 1 pad: 1 stride: 1 stride: 2 stride: 2 } }
layer { name: "rpn/output_pool" type: "Pooling" bottom: "conv5b" top: "rpn/output_pool"
  pooling_param { pool: MAX kernel_size: 1 kernel_size: 7 kernel_size: 7 } }
layer { name: "rpn_cls_score" type: "Convolution" bottom: "rpn/output_pool" top: "rpn_cls_score"
  convolution_param { num_output: 6 kernel_size: 1 kernel_size: 1 kernel_size: 1 } }
layer { name: "rpn_twin_pred" type: "Convolution" bottom: "rpn/output_pool" top: "rpn_twin_pred"
  convolution_param { num_output: 6 kernel_size: 1 kernel_size: 1 kernel_size: 1 } }
layer { bottom: "rpn_cls_score" top: "rpn_cls_score_reshape" name: "rpn_cls_score_reshape" type: "Reshape"
  reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 0 dim: 0 } } }
layer { name: "rpn_cls_prob" type: "Softmax" bottom: "rpn_cls_score_reshape" top: "rpn_cls_prob" }
layer { name: "rpn_cls_prob_reshape" type: "Reshape" bottom: "rpn_cls_prob" top: "rpn_cls_prob_reshape"
  reshape_param { shape { dim: 0 dim: 6 dim: -1 dim: 0 dim: 0 } } }
layer { name: "proposal" type: "Python" bottom: "rpn_cls_prob_reshape" bottom: "rpn_twin_pred" top: "rpn_rois"
  include { phase: PHASE }
  python_param { module: "rpn.proposal_layer" layer: "ProposalLayer"
    param_str: "'feat_stride': 2 \\n'scales': !!python/tuple [1, 2, 4]" } }
'''
TINY_HEAD = '''
layer { name: "roi_pool5" type: "ROIPooling" bottom: "conv5b" bottom: "ROIS" top: "pool5"
  roi_pooling_param { pooled_w: 4 pooled_h: 4 pooled_l: 1 spatial_scale: 0.0625 temporal_scale: 0.5 } }
layer { name: "fc6" type: "InnerProduct" bottom: "pool5" top: "fc6" inner_product_param { num_output: 10 } }
layer { name: "cls_score" type: "InnerProduct" bottom: "fc6" top: "cls_score" inner_product_param { num_output: 4 } }
layer { name: "twin_pred" type: "InnerProduct" bottom: "fc6" top: "twin_pred" inner_product_param { num_output: 8 } }
'''


def tiny_rc3d():
    """R-C3D's test.prototxt, small: C3D (3-D convolution and pooling) -> RPN over time (1 x 7 x 7 pooling,
    per-step anchors scored and regressed) -> temporal proposals -> 3-D ROIPooling -> fc -> class scores
    and twin deltas."""
    return (TINY_DATA + TINY_TRUNK.replace("PHASE", "TEST") + TINY_HEAD.replace("ROIS", "rpn_rois")
            + 'layer { name: "cls_prob" type: "Softmax" bottom: "cls_score" top: "cls_prob" }\n')


def test_tiny_rc3d_reads_and_runs(tmp_path):
    model = load_from_text(tiny_rc3d(), random_weights=True)
    shapes = model.blob_shapes
    assert shapes["conv5b"] == (1, 8, 16, 7, 7) and shapes["rpn_cls_prob_reshape"] == (1, 6, 16, 1, 1)
    assert shapes["rpn_rois"] == (48, 3) and shapes["pool5"] == (48, 8, 1, 4, 4) and shapes["cls_prob"] == (48, 4)
    x = {"data": rng(4).standard_normal((1, 3, 32, 28, 28)).astype(np.float32)}
    got = model.run(x, all_blobs=True)
    rois, _ = ref_proposals(got["rpn_cls_prob_reshape"], got["rpn_twin_pred"], 2, [1, 2, 4])
    np.testing.assert_allclose(got["rpn_rois"], rois, rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(got["pool5"], ref_roi_pool(got["conv5b"], got["rpn_rois"], 1, 4, 4, 0.5))
    assert got["cls_prob"].shape == (len(rois), 4) and got["twin_pred"].shape == (len(rois), 8)
    check_everywhere(model, x, {k: got[k] for k in ("cls_prob", "twin_pred")}, tmp_path, atol=1e-4, rtol=1e-4,
                     opsets=(None,))


# ---- the train nets' Python layers: their setup shapes ---------------------------------------------

def tiny_rc3d_train():
    """R-C3D's train.prototxt, small: RoIDataLayer, the RPN targets, proposals at TRAIN, sampled rois."""
    data = ('layer { name: "data" type: "Python" top: "data" top: "gt_boxes" python_param { '
            'module: "roi_data_layer.layer" layer: "RoIDataLayer" param_str: "\'num_classes\': 4" } }')
    return data + TINY_TRUNK.replace("PHASE", "TRAIN") + '''
layer { name: "rpn-data" type: "Python" bottom: "rpn_cls_score" bottom: "gt_boxes" bottom: "data"
  top: "rpn_labels" top: "rpn_twin_targets" top: "rpn_twin_inside_weights" top: "rpn_twin_outside_weights"
  python_param { module: "rpn.anchor_target_layer" layer: "AnchorTargetLayer"
    param_str: "'feat_stride': 2 \\n'scales': !!python/tuple [1, 2, 4]" } }
layer { name: "roi-data" type: "Python" bottom: "rpn_rois" bottom: "gt_boxes"
  top: "rois" top: "labels" top: "twin_targets" top: "twin_inside_weights" top: "twin_outside_weights"
  python_param { module: "rpn.proposal_target_layer" layer: "ProposalTargetLayer" param_str: "'num_classes': 4" } }
''' + TINY_HEAD.replace("ROIS", "rois") + \
        'layer { name: "loss_cls" type: "SoftmaxWithLoss" bottom: "cls_score" bottom: "labels" top: "loss_cls" }\n'


def test_r_c3d_train_layers_read_with_their_setup_shapes():
    text = tiny_rc3d_train()
    model = load_from_text(text, phase="TRAIN", input_shapes={"data": (1, 3, 32, 28, 28)})
    s = model.blob_shapes
    assert s["gt_boxes"] == (1, 3) and s["rpn_labels"] == (1, 1, 48, 1, 1) and s["rpn_twin_targets"] == (1, 6, 16, 1, 1)
    assert s["rois"] == (1, 3) and s["labels"] == (1, 1) and s["twin_targets"] == (1, 8) and s["pool5"] == (1, 8, 1, 4, 4)
    assert load_from_text(text, phase="TRAIN").blob_shapes["data"] == (1, 3, 512, 112, 112)   # config.py's
    # futurecrew/fast-rcnn's RPN nets: an image RoIDataLayer of their own with (data, labels), sized by
    # --input-shape as any Python data layer
    image_net = ('layer { name: "data" type: "Python" top: "data" top: "labels" python_param { '
                 'module: "roi_data_layer.layer" layer: "RoIDataLayer" param_str: "num_classes: 1" } }\n'
                 'layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 2 '
                 'kernel_size: 3 } }\n')
    assert load_from_text(image_net, input_shapes={"data": (1, 3, 9, 8), "labels": (1,)}).blob_shapes["c"] == (1, 2, 7, 6)
    assert load_from_text(image_net, unknown_shapes_ok=True).blob_shapes["c"] is None


def test_caption_train_layers_read_with_their_setup_shapes():
    text = net('layer { name: "data" type: "Python" top: "data" top: "gt_boxes" top: "gt_captions" python_param { '
               'module: "roi_data_layer.layer_caption" layer: "RoIDataLayer" param_str: "\'num_classes\': 2" } }',
               'layer { name: "gt" type: "Python" bottom: "gt_boxes" top: "gt_rois" '
               'python_param { module: "rpn.GTboxes_to_GTrois" layer: "ProposalTargetLayer" } }',
               'layer { name: "caption_target" type: "Python" bottom: "gt_captions" top: "input_sentence" '
               'top: "cont_sentence" top: "target_sentence" top: "cont_sent_controller" python_param { '
               'module: "rpn.gt_caption_target_layer_hierarchical" layer: "CaptionTargetLayer" param_str: "\'num_cont\': 29" } }',
               'layer { name: "pad" type: "Python" bottom: "sentences" bottom: "cont_sent_controller" top: "padded" '
               'python_param { module: "rpn.pad_controller_layer" layer: "CaptionTargetLayer" } }',
               'layer { name: "hidden" type: "Python" bottom: "padded" bottom: "cont_sent_controller" top: "kept" '
               'python_param { module: "rpn.get_controller_hidden_layer" layer: "CaptionTargetLayer" } }',
               'layer { name: "roi-data" type: "Python" bottom: "gt_rois" bottom: "gt_boxes" top: "rois" top: "labels" '
               'top: "twin_targets" top: "twin_inside_weights" top: "twin_outside_weights" top: "gt_rois_out" python_param { '
               'module: "rpn.proposal_target_layer_binary" layer: "ProposalTargetLayer" param_str: "\'num_classes\': 2" } }',
               inputs={"sentences": (1, 1, 300)})
    model = load_from_text(text)
    s = model.blob_shapes
    assert (s["data"], s["gt_boxes"], s["gt_captions"]) == ((1, 3, 768, 112, 112), (1, 3), (1, 3, 30))
    assert s["input_sentence"] == (30, 1) and s["cont_sent_controller"] == (29, 1)
    assert s["padded"] == (29, 1, 300) and s["kept"] == (1, 1, 300)
    assert s["rois"] == (1, 3) and s["twin_targets"] == (1, 4) and s["gt_rois_out"] == (1, 3) and s["gt_rois"] == (1, 3)
    with pytest.raises(CaffeqError, match="'caption_target' .*does not run for inference"):
        model.run({"sentences": np.zeros((1, 1, 300), np.float32), "data": np.zeros((1, 3, 768, 112, 112), np.float32),
                   "gt_boxes": np.zeros((1, 3), np.float32), "gt_captions": np.zeros((1, 3, 30), np.float32)})
