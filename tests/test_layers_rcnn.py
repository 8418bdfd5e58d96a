"""Faster R-CNN's region proposals (py-faster-rcnn's rpn.proposal_layer.ProposalLayer and the C++
Proposal type), Python layers resolved by module and class, and the param_str reader.

The reference is a numpy re-derivation written here from py-faster-rcnn's Python source
(generate_anchors.py, bbox_transform.py, proposal_layer.py, the GPU NMS's IoU test), in loops
over boxes, in float32 where the Python layer computes in float32.
"""
import os

import numpy as np
import pytest
import torch
from conftest import REPO, check_everywhere, load_model_py, onnx_run_by_blob, onnx_session

from caffeq.errors import CaffeqError, ExportError, UnsupportedLayerError
from caffeq.layers import LayerError
from caffeq.layers.param_str import parse_param_str
from caffeq.layers.rcnn import generate_anchors
from caffeq.model import load_from_text

# ---- the reference ----------------------------------------------------------------------------

# Shaoqing Ren's MATLAB anchors, quoted in py-faster-rcnn's generate_anchors.py: MATLAB's pixel
# indexes start at 1, so py-faster-rcnn's (0-based) anchors are these minus 1
PUBLISHED_ANCHORS = [[-83, -39, 100, 56], [-175, -87, 192, 104], [-359, -183, 376, 200],
                     [-55, -55, 72, 72], [-119, -119, 136, 136], [-247, -247, 264, 264],
                     [-35, -79, 52, 96], [-79, -167, 96, 184], [-167, -343, 184, 360]]


def ref_anchors(base, ratios, scales):
    """Per ratio (outer) and scale (inner): the base window's area split by the ratio, sides rounded
    half to even, scaled, around the base window's centre (a side of w pixels spans w - 1)."""
    rows = []
    for r in ratios:
        w0 = np.round(np.sqrt(base * base / r))
        h0 = np.round(w0 * r)
        for s in scales:
            w, h = w0 * s, h0 * s
            c = (base - 1) / 2.0
            rows.append([c - (w - 1) / 2, c - (h - 1) / 2, c + (w - 1) / 2, c + (h - 1) / 2])
    return np.array(rows)


def ref_iou(a, b):
    """The GPU NMS's IoU: float32, sizes count both end pixels."""
    f = np.float32
    w = max(f(min(a[2], b[2]) - max(a[0], b[0])) + f(1), f(0))
    h = max(f(min(a[3], b[3]) - max(a[1], b[1])) + f(1), f(0))
    inter = f(w * h)
    sa = f(f(a[2] - a[0] + f(1)) * f(a[3] - a[1] + f(1)))
    sb = f(f(b[2] - b[0] + f(1)) * f(b[3] - b[1] + f(1)))
    return f(inter / f(f(sa + sb) - inter))


def ref_proposals(prob, deltas, im_info, stride, scales=(8, 16, 32), ratios=(0.5, 1, 2), base=16,
                  pre=6000, post=300, thresh=0.7, min_size=16):
    f = np.float32
    anchors = ref_anchors(base, ratios, scales)
    a = len(anchors)
    _, _, height, width = prob.shape
    boxes, scores = [], []
    for y in range(height):           # rows ordered (h, w, a)
        for x in range(width):
            for k in range(a):
                anc = (anchors[k] + [x * stride, y * stride, x * stride, y * stride]).astype(f)
                d = deltas[0, 4 * k:4 * k + 4, y, x]
                aw, ah = f(anc[2] - anc[0] + f(1)), f(anc[3] - anc[1] + f(1))
                acx, acy = f(anc[0] + f(0.5) * aw), f(anc[1] + f(0.5) * ah)
                cx, cy = f(d[0] * aw + acx), f(d[1] * ah + acy)
                w, h = f(np.exp(d[2]) * aw), f(np.exp(d[3]) * ah)
                box = [f(cx - f(0.5) * w), f(cy - f(0.5) * h), f(cx + f(0.5) * w), f(cy + f(0.5) * h)]
                lim = [im_info[0, 1] - f(1), im_info[0, 0] - f(1)]
                box = [max(min(v, lim[i % 2]), f(0)) for i, v in enumerate(box)]
                boxes.append(box)
                scores.append(prob[0, a + k, y, x])
    boxes, scores = np.array(boxes, f), np.array(scores, f)
    limit = f(min_size * im_info[0, 2])
    keep = [i for i, b in enumerate(boxes) if b[2] - b[0] + f(1) >= limit and b[3] - b[1] + f(1) >= limit]
    boxes, scores = boxes[keep], scores[keep]
    order = np.argsort(scores, kind="stable")[::-1]
    if pre > 0:
        order = order[:pre]
    boxes, scores = boxes[order], scores[order]
    kept = []
    for i in range(len(boxes)):
        if all(ref_iou(boxes[j], boxes[i]) <= f(thresh) for j in kept):
            kept.append(i)
    if post > 0:
        kept = kept[:post]
    rois = np.concatenate([np.zeros((len(kept), 1), f), boxes[kept]], axis=1)
    return rois, scores[kept][:, None]


# ---- nets -------------------------------------------------------------------------------------

def proposal_net(a, h, w, layer):
    return (f'layer {{ name: "p" type: "Input" top: "prob" input_param {{ shape {{ dim: 1 dim: {2 * a} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "d" type: "Input" top: "deltas" input_param {{ shape {{ dim: 1 dim: {4 * a} '
            f'dim: {h} dim: {w} }} }} }}\n'
            'layer { name: "i" type: "Input" top: "im_info" input_param { shape { dim: 1 dim: 3 } } }\n'
            + layer)


def python_proposal(param_str, tops=("rois", "scores")):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    return (f'layer {{ name: "proposal" type: "Python" bottom: "prob" bottom: "deltas" bottom: "im_info" '
            f'{top_text} python_param {{ module: "rpn.proposal_layer" layer: "ProposalLayer" '
            f'param_str: "{param_str}" }} }}')


def feeds(a, h, w, im_info, seed=0, spread=0.4):
    rng = np.random.default_rng(seed)
    return {"prob": rng.random((1, 2 * a, h, w)).astype(np.float32),
            "deltas": (rng.standard_normal((1, 4 * a, h, w)) * spread).astype(np.float32),
            "im_info": np.array([im_info], np.float32)}


def check_rows(got_rois, got_scores, ref_rois, ref_scores):
    assert got_rois.shape == ref_rois.shape, (got_rois.shape, ref_rois.shape)
    np.testing.assert_allclose(got_rois, ref_rois, rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(got_scores, ref_scores)


# ---- tests ------------------------------------------------------------------------------------

def test_anchors_match_the_published_table_and_the_reference():
    np.testing.assert_array_equal(generate_anchors(), np.array(PUBLISHED_ANCHORS, np.float64) - 1)
    for base, ratios, scales in ((16, (0.5, 1, 2), (4, 8, 16, 32)), (8, (0.25, 1.5), (2, 3.5))):
        np.testing.assert_array_equal(generate_anchors(base, ratios, scales), ref_anchors(base, ratios, scales))


@pytest.mark.parametrize("h, w, im_info, scales_text, scales", [
    (5, 7, [75, 110, 0.6], "", (8, 16, 32)),
    (6, 4, [90, 60, 1.0], ", 'scales': [4, 8, 16, 32]", (4, 8, 16, 32)),
])
def test_python_proposal_layer_matches_the_reference(h, w, im_info, scales_text, scales):
    a = 3 * len(scales)
    text = proposal_net(a, h, w, python_proposal("{'feat_stride': 16" + scales_text + "}"))
    model = load_from_text(text)
    assert model.blob_shapes["rois"] == (min(300, h * w * a), 5)
    x = feeds(a, h, w, im_info)
    got = model.run(x)
    ref_rois, ref_scores = ref_proposals(x["prob"], x["deltas"], x["im_info"], 16, scales=scales)
    assert 0 < len(ref_rois) < h * w * a   # the size filter and NMS both removed boxes
    check_rows(got["rois"], got["scores"], ref_rois, ref_scores)


def test_other_settings_match_the_reference():
    """base size, ratios, scales, pre/post NMS counts, threshold and min size as parameters."""
    from caffeq.layers.rcnn import rpn_proposals
    a, h, w = 2 * 3, 7, 9
    x = feeds(a, h, w, [60, 70, 1.5], seed=3)
    anchors = torch.from_numpy(generate_anchors(10, (0.5, 2), (2, 5, 9)))
    rois, scores = rpn_proposals(*(torch.from_numpy(x[k]) for k in ("prob", "deltas", "im_info")), anchors,
                                 8, 40, 12, 0.5, 6)
    ref, ref_scores = ref_proposals(x["prob"], x["deltas"], x["im_info"], 8, scales=(2, 5, 9), ratios=(0.5, 2),
                                    base=10, pre=40, post=12, thresh=0.5, min_size=6)
    assert len(ref) == 12
    check_rows(rois.numpy(), scores.numpy(), ref, ref_scores)


def test_cpp_proposal_type_is_not_taken_for_the_python_one():
    """type "Proposal" is PVANet's C++ layer (pva_proposal.py): no py-faster-rcnn default anchors."""
    layer = ('layer { name: "proposal" type: "Proposal" bottom: "prob" bottom: "deltas" bottom: "im_info" '
             'top: "rois" proposal_param { feat_stride: 16 } }')
    with pytest.raises(LayerError, match="proposal_param.ratio must be one or more positive"):
        load_from_text(proposal_net(9, 3, 4, layer))


def test_no_proposal_left_gives_zero_rows():
    a = 9
    model = load_from_text(proposal_net(a, 3, 4, python_proposal("'feat_stride': 16")))
    x = feeds(a, 3, 4, [40, 50, 100.0])   # min_size 16 * 100: every box is too small
    got = model.run(x)
    assert got["rois"].shape == (0, 5) and got["scores"].shape == (0, 1)


@pytest.mark.parametrize("opset", [13, None])
def test_onnx_matches_torch(opset, tmp_path):
    a, h, w = 9, 5, 8
    model = load_from_text(proposal_net(a, h, w, python_proposal("'feat_stride': 16")))
    x = feeds(a, h, w, [70, 120, 0.8], seed=7)
    want = model.run(x)
    sess = onnx_session(model, tmp_path / "p.onnx", opset)
    outs = dict(zip([o.name for o in sess.get_outputs()], onnx_run_by_blob(sess, model, x)))
    by_blob = {model.graph.tensors[n].blob: v for n, v in outs.items()}
    assert by_blob["rois"].shape == want["rois"].shape
    np.testing.assert_allclose(by_blob["rois"], want["rois"], rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(by_blob["scores"], want["scores"])


def test_tied_scores_match_the_reference_in_torch_and_onnx(tmp_path):
    # scores from three values: equal scores go higher index first, as argsort()[::-1], in every backend
    a, h, w = 9, 5, 8
    model = load_from_text(proposal_net(a, h, w, python_proposal("'feat_stride': 16")))
    x = feeds(a, h, w, [70, 120, 0.8], seed=7)
    x["prob"] = (np.round(x["prob"] * 2) / 4 + 0.25).astype(np.float32)
    want = model.run(x)
    ref_rois, ref_scores = ref_proposals(x["prob"], x["deltas"], x["im_info"], 16)
    check_rows(want["rois"], want["scores"], ref_rois, ref_scores)
    sess = onnx_session(model, tmp_path / "tied.onnx", 13)
    outs = dict(zip([o.name for o in sess.get_outputs()], onnx_run_by_blob(sess, model, x)))
    by_blob = {model.graph.tensors[n].blob: v for n, v in outs.items()}
    check_rows(by_blob["rois"], by_blob["scores"], want["rois"], want["scores"])


def test_pytorch_source_matches_forward(tmp_path):
    a, h, w = 9, 4, 6
    model = load_from_text(proposal_net(a, h, w, python_proposal("'feat_stride': 16")))
    net, info = load_model_py(model, tmp_path / "o")
    x = feeds(a, h, w, [60, 90, 1.0], seed=2)
    with torch.no_grad():
        out = net(*[torch.from_numpy(x[b]) for b in info["inputs"]])
    want = model.run(x)
    got = out if isinstance(out, dict) else {info["outputs"][0]: out}
    for blob in ("rois", "scores"):
        assert np.array_equal(got[blob].numpy(), want[blob]), blob


def tiny_faster_rcnn():
    """conv (stride 16) -> RPN (cls score, softmax over the 2 classes, bbox deltas) -> proposals ->
    ROIPooling -> fc -> class scores: the shape of py-faster-rcnn's test.prototxt, small."""
    return '''name: "tiny_faster_rcnn"
input: "data" input_shape { dim: 1 dim: 3 dim: 80 dim: 112 }
input: "im_info" input_shape { dim: 1 dim: 3 }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 8 kernel_size: 16 stride: 16 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "rpn_cls_score" type: "Convolution" bottom: "conv" top: "rpn_cls_score"
  convolution_param { num_output: 18 kernel_size: 1 } }
layer { name: "rpn_bbox_pred" type: "Convolution" bottom: "conv" top: "rpn_bbox_pred"
  convolution_param { num_output: 36 kernel_size: 1 } }
layer { bottom: "rpn_cls_score" top: "rpn_cls_score_reshape" name: "rpn_cls_score_reshape" type: "Reshape"
  reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 0 } } }
layer { name: "rpn_cls_prob" type: "Softmax" bottom: "rpn_cls_score_reshape" top: "rpn_cls_prob" }
layer { name: "rpn_cls_prob_reshape" type: "Reshape" bottom: "rpn_cls_prob" top: "rpn_cls_prob_reshape"
  reshape_param { shape { dim: 0 dim: 18 dim: -1 dim: 0 } } }
layer { name: "proposal" type: "Python" bottom: "rpn_cls_prob_reshape" bottom: "rpn_bbox_pred"
  bottom: "im_info" top: "rois"
  python_param { module: "rpn.proposal_layer" layer: "ProposalLayer" param_str: "'feat_stride': 16" } }
layer { name: "roi_pool" type: "ROIPooling" bottom: "conv" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_w: 2 pooled_h: 2 spatial_scale: 0.0625 } }
layer { name: "cls_score" type: "InnerProduct" bottom: "pool" top: "cls_score"
  inner_product_param { num_output: 4 } }
layer { name: "cls_prob" type: "Softmax" bottom: "cls_score" top: "cls_prob" }
'''


def test_tiny_faster_rcnn_builds_and_runs():
    model = load_from_text(tiny_faster_rcnn(), random_weights=True)
    assert model.blob_shapes["rois"] == (300, 5) and model.blob_shapes["cls_prob"] == (300, 4)
    rng = np.random.default_rng(4)
    x = {"data": rng.standard_normal((1, 3, 80, 112)).astype(np.float32),
         "im_info": np.array([[80, 112, 1.0]], np.float32)}
    got = model.run(x, all_blobs=True)
    ref_rois, _ = ref_proposals(got["rpn_cls_prob_reshape"], got["rpn_bbox_pred"], x["im_info"], 16)
    np.testing.assert_allclose(got["rois"], ref_rois, rtol=1e-6, atol=1e-4)
    assert got["cls_prob"].shape == (len(ref_rois), 4)
    np.testing.assert_allclose(got["cls_prob"].sum(1), 1, rtol=1e-5)


CORPUS = REPO / "tests" / "fixtures" / "realworld" / "rbgirshick__py-faster-rcnn__models__pascal_voc__VGG16__faster_rcnn_end2end__test.prototxt"


@pytest.mark.skipif(not CORPUS.exists(), reason="the prototxt corpus is not on this machine")
def test_py_faster_rcnn_vgg16_test_prototxt_builds():
    from caffeq.model import load
    model = load(str(CORPUS))
    assert model.blob_shapes["rois"] == (300, 5)
    assert model.blob_shapes["cls_prob"] == (300, 21) and model.blob_shapes["bbox_pred"] == (300, 84)


def test_batch_of_two_is_refused():
    a = 9
    model = load_from_text(proposal_net(a, 3, 4, python_proposal("'feat_stride': 16")))
    x = feeds(a, 3, 4, [40, 50, 1.0])
    x = {k: np.concatenate([v, v]) for k, v in x.items()}
    with pytest.raises(CaffeqError, match="one image per batch"):
        model.run(x)


# ---- Python layers and param_str ------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("'feat_stride': 16", {"feat_stride": 16}),
    ("{'feat_stride': 16, 'scales': [8, 16, 32]}", {"feat_stride": 16, "scales": [8, 16, 32]}),
    ("'feat_stride': 16 \n'scales': !!python/tuple [4, 8, 16, 32]", {"feat_stride": 16, "scales": [4, 8, 16, 32]}),
    ("feat_stride: 16\nscales: [2.5,\n 1e1]", {"feat_stride": 16, "scales": [2.5, 10.0]}),
    ('{"phase": "TEST", "p": "0.1", "on": true}', {"phase": "TEST", "p": "0.1", "on": True}),
    ("", {}),
])
def test_param_str_reader(text, want):
    assert parse_param_str(text) == want


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "{'a': !!python/object/apply:os.system ['x']}",
                                  "{'a': 1", "{'a' 1}", "{a: [1, 2}", "{}x", "{'a': {'b': 1}}"])
def test_param_str_reader_refuses_anything_else(text):
    with pytest.raises(LayerError, match="param_str"):
        parse_param_str(text)


@pytest.mark.parametrize("param_str, msg", [("'scales': [8]", "'feat_stride' is required"),
                                            ("'feat_stride': 1.5", "must be an integer"),
                                            ("'feat_stride': 16, 'scales': 8", "list of numbers")])
def test_bad_proposal_params(param_str, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(proposal_net(9, 3, 4, python_proposal(param_str)))


def test_a_forks_own_param_str_keys_read_but_do_not_run(tmp_path):
    """FaceBoxes-in-R-FCN's proposal_layer.py reads 'densification_times' (py-faster-rcnn's ignores
    unknown keys): the net is a fork's, so it reads and its proposals are refused."""
    model = load_from_text(proposal_net(9, 3, 4, python_proposal("'feat_stride': 16, 'densification_times': [4, 2]")))
    with pytest.raises(CaffeqError, match=r"param_str sets \['densification_times'\].*fork's proposal_layer.py"):
        model.run(feeds(9, 3, 4, [48, 64, 1.0]))
    with pytest.raises(ExportError, match="densification_times"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_ratios_in_param_str_are_read_as_the_forks_that_set_them_read_them(tmp_path):
    """py-faster-rcnn's layer ignores 'ratios'; forks that set it (bupt2-213/object_detection_caffe) pass it
    to generate_anchors: 2 ratios x 3 scales make the net's 6 anchors."""
    a, h, w = 6, 5, 6
    text = proposal_net(a, h, w, python_proposal("{'feat_stride': 16, 'ratios': [1, 2], 'scales': [4, 8, 16]}"))
    model = load_from_text(text)
    assert any("'ratios' is read as the forks that set it read it" in n for n in model.warnings)
    x = feeds(a, h, w, [70, 90, 1.0])
    ref_rois, ref_scores = ref_proposals(x["prob"], x["deltas"], x["im_info"], 16, scales=(4, 8, 16), ratios=(1, 2))
    assert 0 < len(ref_rois) < h * w * a
    check_everywhere(model, x, {"rois": ref_rois, "scores": ref_scores}, tmp_path, atol=1e-3, opsets=(None,))
    with pytest.raises(LayerError, match="'ratios' must be a list of numbers"):
        load_from_text(proposal_net(a, h, w, python_proposal("'feat_stride': 16, 'ratios': 2")))


def test_ubernets_unread_phase_and_default_base_size_keep_py_faster_rcnns_proposals():
    """jkokkin/UberNet's proposal_layer.py stores 'phase' without reading it again and leaves 'base_size'
    to generate_anchors' 16: its proposals are py-faster-rcnn's; another base_size stays a fork's."""
    f = feeds(12, 3, 4, [48, 64, 1.0])
    model = load_from_text(proposal_net(12, 3, 4, python_proposal(
        "{'feat_stride': 16,  'base_size': 16,    'phase': TEST, 'scales': !!python/tuple [4, 8, 16, 32]}")))
    out = model.run(f)
    check_rows(out["rois"], out["scores"], *ref_proposals(f["prob"], f["deltas"], f["im_info"], 16, scales=(4, 8, 16, 32)))
    model = load_from_text(proposal_net(9, 3, 4, python_proposal("'feat_stride': 16, 'base_size': 8")))
    with pytest.raises(CaffeqError, match=r"param_str sets \['base_size'\]"):
        model.run(feeds(9, 3, 4, [48, 64, 1.0]))


def test_other_anchor_counts_and_short_im_info_read_but_do_not_run(tmp_path):
    """Caffe's Python ProposalLayer shapes its tops without looking at the bottoms, so a net whose
    fork makes another anchor set (12 here, R-FCN's class-agnostic variants) or whose im_info lacks
    the scale loads in Caffe and fails in forward: caffeq reads it and refuses to run or export it."""
    model = load_from_text(proposal_net(12, 3, 4, python_proposal("'feat_stride': 16")))
    assert model.blob_shapes["rois"] == (3 * 4 * 12, 5)   # at most every anchor of the net
    x = feeds(12, 3, 4, [48, 64, 1.0])
    with pytest.raises(CaffeqError, match="'proposal' .region proposals.: the net scores 12 anchors .* settings make 9"):
        model.run(x)
    with pytest.raises(ExportError, match="scores 12 anchors"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    short = proposal_net(9, 3, 4, python_proposal("'feat_stride': 16")).replace(
        'top: "im_info" input_param { shape { dim: 1 dim: 3 } }', 'top: "im_info" input_param { shape { dim: 1 dim: 2 } }')
    model = load_from_text(short)
    with pytest.raises(CaffeqError, match=r"im_info must hold \[height, width, scale\]"):
        model.run({**feeds(9, 3, 4, [48, 64, 1.0]), "im_info": np.array([[48, 64]], np.float32)})
    # deltas that disagree with the scores are still refused on reading
    with pytest.raises(LayerError, match="rpn_bbox_pred must be"):
        load_from_text(proposal_net(6, 3, 4, python_proposal("'feat_stride': 16")).replace("dim: 24", "dim: 20"))


def test_unknown_python_layer_is_refused_and_nothing_is_imported(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Layer: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    text = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 3 dim: 4 } } }\n'
            'layer { name: "e" type: "Python" bottom: "x" top: "y" python_param { module: "evil" layer: "Layer" } }')
    with pytest.raises(UnsupportedLayerError, match="never imports"):
        load_from_text(text)
    assert not marker.exists() and not os.path.exists(marker)


def test_python_data_layer_asks_for_input_shapes():
    text = ('layer { name: "data" type: "Python" top: "data" top: "label" '
            'python_param { module: "siftflow_layers" layer: "SIFTFlowSegDataLayer" } }')
    with pytest.raises(LayerError, match=r"siftflow_layers.*--input-shape data=N,C,H,W --input-shape label="):
        load_from_text(text)


def test_python_data_layer_takes_the_given_shapes():
    text = ('layer { name: "data" type: "Python" top: "data" top: "label" '
            'python_param { module: "siftflow_layers" layer: "SIFTFlowSegDataLayer" } }\n'
            'layer { name: "relu" type: "ReLU" bottom: "data" top: "out" }')
    model = load_from_text(text, input_shapes={"data": (2, 3, 5, 7), "label": (2, 1, 5, 7)})
    assert model.blob_shapes["out"] == (2, 3, 5, 7)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 7)).astype(np.float32)
    got = model.run({"data": x, "label": np.zeros((2, 1, 5, 7), np.float32)})["out"]
    np.testing.assert_array_equal(got, np.maximum(x, 0))


def test_no_rois_flow_through_roi_pooling_and_inner_product(tmp_path):
    # a proposal layer can leave no roi (py-faster-rcnn filters every box below min_size): Caffe's
    # InnerProduct then makes an empty (0, N) top, and so must every backend
    text = '''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 3 dim: 5 } } }
layer { name: "pool" type: "ROIPooling" bottom: "data" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_h: 2 pooled_w: 2 spatial_scale: 1 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc" inner_product_param { num_output: 4 } }'''
    model = load_from_text(text, random_weights=True)
    feeds = {"data": np.ones((1, 2, 6, 6), np.float32), "rois": np.zeros((0, 5), np.float32)}
    assert model.run(feeds)["fc"].shape == (0, 4)
    check_everywhere(model, feeds, {"fc": np.zeros((0, 4), np.float32)}, tmp_path, exact=True)


@pytest.mark.parametrize("layer", [
    'type: "PSROIPooling" psroi_pooling_param { spatial_scale: 0.5 output_dim: 2 group_size: 3 }',
    'type: "ROIPooling" roi_pooling_param { pooled_h: 3 pooled_w: 3 spatial_scale: 0.5 pool: AVE }',
    'type: "PSROIAlign" psroi_align_param { spatial_scale: 0.5 output_dim: 2 group_size: 3 }',
])
def test_no_rois_through_the_roi_poolings_written_as_einsums(layer, tmp_path):
    # R-FCN's test nets left with no proposal: onnxruntime's Einsum over 0 rois stops the process (SIGFPE), so
    # their ONNX pools a padding roi and cuts it off again
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 18 dim: 6 dim: 6 } } }\n'
            'layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 3 dim: 5 } } }\n'
            f'layer {{ name: "pool" bottom: "data" bottom: "rois" top: "pool" {layer} }}')
    model = load_from_text(text)
    feeds = {"data": np.ones((1, 18, 6, 6), np.float32), "rois": np.zeros((0, 5), np.float32)}
    want = np.zeros((0,) + model.blob_shapes["pool"][1:], np.float32)
    check_everywhere(model, feeds, {"pool": want}, tmp_path, exact=True)
