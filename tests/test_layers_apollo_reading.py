"""Apollo's traffic-light detector read as Apollo's TensorRT builder runs it (caffeq/layers/apollo.py,
apollo_rcnn_softmax_axis).

Apollo's RTNet drops Caffe's batch axis (TensorRT's implicit batch) and its SoftmaxPlugin normalises axis
softmax_param.axis - 1 of what is left; the RoI head's InnerProduct top is (R, K, 1, 1) there
(IFullyConnectedLayer keeps the axes before the last three, DFMBPSROIAlign's output rows come first), so
`axis: 2` is the class axis K, Caffe's axis 1 of the (R, K) top.  The reference is numpy's softmax over
the classes of each roi, from the InnerProduct written out here.
"""
import os

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32
R, D = 7, 6      # rois (odd), features per roi

CORPUS = str(REPO / "tests" / "fixtures" / "realworld" / ("irh-ca-team-car__apollo_ros2_public__data__perception__"
                                                            "camera__models__traffic_light_detection__deploy.prototxt"))

RCNN = """layer { type: 'RCNNProposal' name: 'rcnn_proposal' bottom: 'cls_score_softmax' bottom: 'bbox_pred'
  bottom: 'rois' bottom: 'im_info' top: 'bboxes'
  bbox_reg_param { bbox_mean: 0 bbox_mean: 0 bbox_mean: 0 bbox_mean: 0
                   bbox_std: 0.1 bbox_std: 0.1 bbox_std: 0.2 bbox_std: 0.2 }
  detection_output_ssd_param { num_class: 3 rpn_proposal_output_score: true regress_agnostic: false
    min_size_h: 2 min_size_w: 2 min_size_mode: HEIGHT_OR_WIDTH threshold_objectness: 0.1
    threshold: 0.1 threshold: 0.1 threshold: 0.1 refine_out_of_map_bbox: true
    nms_param { overlap_ratio: 0.5 top_n: 5 max_candidate_n: 30 } } }"""


def head(axis, rcnn=True):
    layers = ['layer { type: "InnerProduct" name: "cls" bottom: "feat" top: "cls_score" '
              'inner_product_param { num_output: 4 } }',
              'layer { type: "InnerProduct" name: "box" bottom: "feat" top: "bbox_pred" '
              'inner_product_param { num_output: 16 } }',
              f'layer {{ type: "Softmax" name: "cls_score_softmax" bottom: "cls_score" top: "cls_score_softmax" '
              f'softmax_param {{ axis: {axis} }} }}']
    return net(*layers, *([RCNN] if rcnn else []),
               inputs={"feat": (R, D), "rois": (R, 5, 1, 1), "im_info": (1, 6, 1, 1)})


def feeds_for():
    g = rng(3)
    x1 = g.uniform(0, 40, R)
    y1 = g.uniform(0, 30, R)
    rois = np.stack([np.zeros(R), x1, y1, x1 + g.uniform(4, 20, R), y1 + g.uniform(4, 20, R)], 1)
    return {"feat": g.standard_normal((R, D)).astype(F), "rois": rois.reshape(R, 5, 1, 1).astype(F),
            "im_info": np.array([48, 64, 1, 1, 0, 0], F).reshape(1, 6, 1, 1)}


def class_softmax(model, feat):
    w, b = (np.asarray(a, np.float64) for a in model.params["cls"])
    z = feat.astype(np.float64) @ w.T + b
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_rcnn_softmax_axis_2_is_the_class_axis_as_apollo_tensorrt(tmp_path):
    model = load_from_text(head(2), random_weights=True, seed=5)
    assert model.blob_shapes["cls_score_softmax"] == (R, 4)
    assert model.blob_shapes["bboxes"] == (5, 9, 1, 1)
    assert any("'cls_score_softmax'" in w and "axis 1" in w and "TensorRT" in w for w in model.warnings)
    feeds = feeds_for()
    ref = class_softmax(model, feeds["feat"])
    out = model.run(feeds, all_blobs=True)
    np.testing.assert_allclose(out["cls_score_softmax"], ref, atol=1e-6, rtol=1e-6)
    # the proposal reads those probabilities: the same bboxes as the net written with CaffeNet's axis 1
    caffenet = load_from_text(head(1), random_weights=True, seed=5)
    assert not any("TensorRT" in w for w in caffenet.warnings)
    np.testing.assert_array_equal(out["bboxes"], caffenet.run(feeds)["bboxes"])
    check_everywhere(model, feeds, {"bboxes": out["bboxes"]}, tmp_path, atol=1e-5, rtol=1e-6, opsets=(None,))


def test_rcnn_softmax_probabilities_everywhere(tmp_path):
    model = load_from_text(head(2), random_weights=True, seed=9, outputs=["cls_score_softmax"])
    feeds = {"feat": feeds_for()["feat"]}
    check_everywhere(model, feeds, {"cls_score_softmax": class_softmax(model, feeds["feat"])}, tmp_path,
                     atol=1e-6, rtol=1e-6)


def test_other_softmax_axes_keep_bvlc_semantics():
    # no RCNNProposal reads it: BVLC's reading, axis 2 of a 2-axis top is refused as before
    with pytest.raises(CaffeqError, match=r"cls_score_softmax.*axis 2 out of range"):
        load_from_text(head(2, rcnn=False), random_weights=True)
    # a Softmax with axis 2 on a blob no InnerProduct wrote normalises axis 2
    text = net('layer { type: "Softmax" name: "s" bottom: "x" top: "o" softmax_param { axis: 2 } }',
               inputs={"x": (2, 3, 5)})
    model = load_from_text(text)
    x = rng(1).standard_normal((2, 3, 5)).astype(F)
    e = np.exp(x.astype(np.float64) - x.max(axis=2, keepdims=True))
    np.testing.assert_allclose(model.run({"x": x})["o"], e / e.sum(axis=2, keepdims=True), atol=1e-6, rtol=1e-6)
    assert not any("TensorRT" in w for w in model.warnings)


@pytest.mark.skipif(not os.path.exists(CORPUS), reason="Apollo's traffic-light detector file is not here")
@pytest.mark.parametrize("info_shape", [(1, 6, 1, 1), (1, 1, 3, 1)])
def test_apollo_traffic_light_detector_file_reads_and_runs(info_shape):
    from caffeq.model import load
    # (1, 6, 1, 1) as the file declares it; (1, 1, 3, 1) = [width, height, 1] as Apollo's detector feeds it
    model = load(CORPUS, random_weights=True, seed=1, input_shapes={"im_info": info_shape})
    shapes = model.blob_shapes
    assert shapes["rois"] == (300, 5, 1, 1)
    assert shapes["psroi_rois"] == (300, 10, 7, 7)
    assert shapes["cls_score"] == (300, 4)
    assert shapes["cls_score_softmax"] == (300, 4)
    assert shapes["bboxes"] == (5, 9, 1, 1)
    img = rng(0).uniform(0, 255, (1, 256, 256, 3)).astype(F)
    info = np.ones(int(np.prod(info_shape)), F)
    info[:2] = 256
    out = model.run({"img": img, "im_info": info.reshape(info_shape)}, all_blobs=True)
    np.testing.assert_allclose(out["cls_score_softmax"].sum(axis=1), 1, atol=1e-6)
    bboxes = out["bboxes"].reshape(5, 9)
    live = bboxes[:, 0] == 0
    assert ((bboxes[live, 1:5] >= 0) & (bboxes[live, 1:5] <= 255)).all() and (bboxes[~live] == -1).all()
    np.testing.assert_allclose(bboxes[live, 5:].sum(axis=1), 1, atol=1e-5)


def test_rewrite_touches_only_the_rcnn_class_softmax():
    """In a net with an RCNNProposal, a Softmax with axis 2 on a blob no InnerProduct wrote keeps axis 2, and one
    on an InnerProduct top that no RCNNProposal reads is still refused as BVLC refuses it."""
    other = ('layer { type: "Softmax" name: "other" bottom: "x" top: "o" softmax_param { axis: 2 } }')
    text = head(2).replace("layer {", other + "\nlayer {", 1)
    text = 'layer { name: "xin" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 5 } } }\n' + text
    model = load_from_text(text, random_weights=True, seed=5)
    notes = [w for w in model.warnings if "TensorRT" in w]
    assert len(notes) == 1 and "'cls_score_softmax'" in notes[0] and "'other'" not in notes[0]
    x = rng(2).standard_normal((2, 3, 5)).astype(F)
    feeds = {**feeds_for(), "x": x}
    e = np.exp(x.astype(np.float64) - x.max(axis=2, keepdims=True))
    np.testing.assert_allclose(model.run(feeds)["o"], e / e.sum(axis=2, keepdims=True), atol=1e-6, rtol=1e-6)
    side = ('layer { type: "InnerProduct" name: "side" bottom: "feat" top: "side" inner_product_param { num_output: 3 } }'
            '\nlayer { type: "Softmax" name: "side_softmax" bottom: "side" top: "side_p" softmax_param { axis: 2 } }')
    with pytest.raises(CaffeqError, match=r"side_softmax.*axis 2 out of range"):
        load_from_text(head(2) + "\n" + side, random_weights=True)
