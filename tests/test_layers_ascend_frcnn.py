"""Huawei Ascend's Faster R-CNN operators (caffeq/layers/ascend_frcnn.py): Proposal with Ascend's fields and
FSRDetectionOutput, read and sized as Ascend's converter shapes them (rois (N, 5, post_nms_topn rounded up to
16), the counts (N, 8), boxes (N, num_classes, min(R, 1024), 8)), never run; ROIPooling sized from such rois;
PVANet's Proposal untouched where no Ascend field is set."""

import numpy as np
import pytest
from conftest import REPO, net
from google.protobuf import text_format

from caffeq.errors import CaffeqError, ExportError
from caffeq.io.schema import caffe_pb2
from caffeq.layers.ascend_frcnn import AscendProposal
from caffeq.layers.pva_proposal import PVAProposalLayer
from caffeq.layers.registry import spec_for
from caffeq.model import load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld" / ("Ascend__samples__objectdetection_dynamic_image_size__for_atlas300_1.7x.0.0_c++__"
                                                 "objectdetection_dynamic_image_size__faster_rcnn.prototxt")

PROPOSAL = ('layer {{ name: "proposal" type: "Proposal" bottom: "prob" bottom: "deltas" bottom: "im_info" '
            'top: "rois" {tops} proposal_param {{ feat_stride: 16 base_size: 16 min_size: 16 {params} }} }}')


def frcnn_net(params="pre_nms_topn: 3000 post_nms_topn: 304 iou_threshold: 0.7 output_actual_rois_num: true",
              tops='top: "actual_rois_num"', batch=2, anchors=9, h=5, w=7, detect=True, classes=3):
    """The Ascend sample's structure, small: the RPN maps as inputs, Proposal, ROIPooling, two InnerProducts,
    Softmax and FSRDetectionOutput (bottoms in the sample's order)."""
    layers = [PROPOSAL.format(tops=tops, params=params),
              'layer { name: "pool" type: "ROIPooling" bottom: "feat" bottom: "rois" top: "pool5" '
              'roi_pooling_param { pooled_w: 3 pooled_h: 2 spatial_scale: 0.0625 } }',
              f'layer {{ name: "cls" type: "InnerProduct" bottom: "pool5" top: "cls_score" '
              f'inner_product_param {{ num_output: {classes} }} }}',
              f'layer {{ name: "bbox" type: "InnerProduct" bottom: "pool5" top: "bbox_pred" '
              f'inner_product_param {{ num_output: {4 * classes} }} }}',
              'layer { name: "cls_prob" type: "Softmax" bottom: "cls_score" top: "cls_prob" }']
    if detect:
        layers.append(f'layer {{ name: "det" type: "FSRDetectionOutput" bottom: "rois" bottom: "bbox_pred" '
                      f'bottom: "cls_prob" bottom: "im_info" bottom: "actual_rois_num" top: "actual_bbox_num" '
                      f'top: "box" fsrdetectionoutput_param {{ num_classes: {classes} score_threshold: 0.5 '
                      f'iou_threshold: 0.7 batch_rois: 1 }} }}')
    return net(*layers, inputs={"prob": (batch, 2 * anchors, h, w), "deltas": (batch, 4 * anchors, h, w),
                                "im_info": (batch, 3), "feat": (batch, 6, h, w)})


def layer(text):
    """The LayerParameter of one `layer { ... }` text, or of a LayerParameter's own fields."""
    if text.startswith("layer"):
        return text_format.Parse(text, caffe_pb2.NetParameter()).layer[0]
    return text_format.Parse(text, caffe_pb2.LayerParameter())


def test_ascends_proposal_fields_are_read():
    lp = layer(PROPOSAL.format(tops='top: "n"', params="pre_nms_topn: 1000 post_nms_topn: 64 iou_threshold: 0.6 "
                                                       "output_actual_rois_num: true"))
    p = lp.proposal_param
    assert (p.pre_nms_topn, p.post_nms_topn, p.output_actual_rois_num) == (1000, 64, True)
    assert p.iou_threshold == pytest.approx(0.6)
    attrs = AscendProposal().parse(lp)
    assert (attrs["pre_nms_topn"], attrs["post_nms_topn"], attrs["anchors"], attrs["with_count"]) == (1000, 64, 9, True)
    d = layer('fsrdetectionoutput_param { num_classes: 21 score_threshold: 0.5 iou_threshold: 0.7 }')
    f = d.fsrdetectionoutput_param
    assert (f.num_classes, f.batch_rois) == (21, 1) and f.score_threshold == pytest.approx(0.5)


def test_the_sample_net_is_sized_as_ascends_converter_sizes_it():
    model = load_from_text(frcnn_net(), random_weights=True)
    s = model.blob_shapes
    assert s["rois"] == (2, 5, 304) and s["actual_rois_num"] == (2, 8)
    assert s["pool5"] == (608, 6, 2, 3)           # Ascend's ROIPooling: R x N pooled maps
    assert s["cls_prob"] == (608, 3) and s["bbox_pred"] == (608, 12)
    assert s["actual_bbox_num"] == (2, 3, 8) and s["box"] == (2, 3, 304, 8)
    assert not model.warnings


@pytest.mark.parametrize("params, rows, noted", [
    ("iou_threshold: 0.7", 304, False),                        # Ascend's default post_nms_topn 304
    ("post_nms_topn: 300 iou_threshold: 0.7", 304, True),      # padded to a multiple of 16, noted
    ("post_nms_topn: 16 output_actual_rois_num: false", 16, False),
    ("post_nms_topn: 2000 iou_threshold: 0.5", 2000, False),
])
def test_the_rois_hold_post_nms_topn_rounded_up_to_16(params, rows, noted):
    model = load_from_text(frcnn_net(params=params, tops="", batch=1, detect=False), random_weights=True)
    assert model.blob_shapes["rois"] == (1, 5, rows) and model.blob_shapes["pool5"] == (rows, 6, 2, 3)
    assert any("not a multiple of 16" in w for w in model.warnings) == noted


def test_the_box_top_holds_at_most_1024_rows():
    model = load_from_text(frcnn_net(params="post_nms_topn: 2000 iou_threshold: 0.5 output_actual_rois_num: true",
                                     batch=1), random_weights=True)
    assert model.blob_shapes["box"] == (1, 3, 1024, 8)


def test_pvanets_proposal_without_ascends_fields_stays_pvanets():
    pva = layer(PROPOSAL.format(tops='top: "scores"', params="ratio: 0.5 ratio: 1 scale: 8 pre_nms_topn: 100 "
                                                             "post_nms_topn: 50 nms_thresh: 0.6"))
    assert isinstance(spec_for(pva), PVAProposalLayer)
    ascend = layer(PROPOSAL.format(tops="", params="iou_threshold: 0.6"))
    assert isinstance(spec_for(ascend), AscendProposal)
    model = load_from_text(net(PROPOSAL.format(tops="", params="ratio: 0.5 ratio: 1 scale: 8 post_nms_topn: 50"),
                               inputs={"prob": (1, 4, 5, 7), "deltas": (1, 8, 5, 7), "im_info": (1, 4)}))
    assert model.blob_shapes["rois"] == (50, 5)     # PVANet's rows, its default nms_thresh read


def test_pvanets_nms_thresh_beside_ascends_fields_is_noted():
    model = load_from_text(frcnn_net(params="nms_thresh: 0.5 iou_threshold: 0.7 output_actual_rois_num: true"),
                           random_weights=True)
    assert any("nms_thresh is no field of Ascend's ProposalParameter" in w for w in model.warnings)


def test_they_are_read_not_run(tmp_path):
    model = load_from_text(frcnn_net(batch=1), random_weights=True)
    feeds = {"prob": np.zeros((1, 18, 5, 7), np.float32), "deltas": np.zeros((1, 36, 5, 7), np.float32),
             "im_info": np.array([[80, 112, 1]], np.float32), "feat": np.zeros((1, 6, 5, 7), np.float32)}
    with pytest.raises(CaffeqError, match=r"layer 'proposal' \(Proposal\): Huawei Ascend's Faster R-CNN proposal"):
        model.run(feeds)
    with pytest.raises(ExportError, match="reads and sizes it but does not run it"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()
    det = load_from_text(net('layer { name: "det" type: "FSRDetectionOutput" bottom: "rois" bottom: "d" bottom: "s" '
                             'top: "n" top: "box" fsrdetectionoutput_param { num_classes: 2 score_threshold: 0.5 '
                             'iou_threshold: 0.7 } }', inputs={"rois": (1, 5, 16), "d": (16, 8), "s": (16, 2)}))
    assert det.blob_shapes["box"] == (1, 2, 16, 8)
    with pytest.raises(CaffeqError, match=r"layer 'det' \(FSRDetectionOutput\): Huawei Ascend's Faster R-CNN "
                                          r"post-processing operator"):
        det.run({"rois": np.zeros((1, 5, 16), np.float32), "d": np.zeros((16, 8), np.float32),
                 "s": np.zeros((16, 2), np.float32)})


@pytest.mark.parametrize("kwargs, message", [
    ({"params": "iou_threshold: 0 output_actual_rois_num: true"}, r"iou_threshold must be in \(0, 1\]"),
    ({"params": "output_actual_rois_num: true post_nms_topn: 0"}, "post_nms_topn must be >= 1"),
    ({"params": "iou_threshold: 0.7"}, r"a second top \(actual_rois_num\) needs proposal_param.output_actual_rois"),
    ({"anchors": 6}, r"must be \(N, 2 x 9, H, W\) and \(N, 4 x 9, H, W\) for 9 anchors"),
    ({"classes": 4, "detect": True}, None),
])
def test_bad_proposal_settings_are_one_line_errors(kwargs, message):
    if message is None:     # a consistent net of 4 classes reads
        assert load_from_text(frcnn_net(**kwargs), random_weights=True).blob_shapes["box"] == (2, 4, 304, 8)
        return
    with pytest.raises(CaffeqError, match=message):
        load_from_text(frcnn_net(**kwargs), random_weights=True)


@pytest.mark.parametrize("params, message", [
    ("score_threshold: 0.5 iou_threshold: 0.7", "fsrdetectionoutput_param.num_classes is required"),
    ("num_classes: 3 iou_threshold: 0.7", "fsrdetectionoutput_param.score_threshold is required"),
    ("num_classes: 4 score_threshold: 0.5 iou_threshold: 0.7", r"score \[608, 3\] must be \(total_rois, num_classes"),
])
def test_bad_detection_settings_are_one_line_errors(params, message):
    text = frcnn_net().replace("num_classes: 3 score_threshold: 0.5 iou_threshold: 0.7 batch_rois: 1", params)
    with pytest.raises(CaffeqError, match=message):
        load_from_text(text, random_weights=True)
    rows = net('layer { name: "det" type: "FSRDetectionOutput" bottom: "rois" bottom: "d" bottom: "s" top: "n" '
               'top: "box" fsrdetectionoutput_param { num_classes: 2 score_threshold: 0.5 iou_threshold: 0.7 } }',
               inputs={"rois": (16, 5), "d": (16, 8), "s": (16, 2)})
    with pytest.raises(CaffeqError, match=r"rois must be Ascend's Proposal output \(N, 5, R\)"):
        load_from_text(rows)


def test_the_ascend_sample_reads():
    model = load_from_text(CORPUS.read_text(), random_weights=True)
    s = model.blob_shapes
    assert s["rois"] == (1, 5, 304) and s["pool5"] == (304, 512, 7, 7)
    assert s["actual_bbox_num1"] == (1, 21, 8) and s["box1"] == (1, 21, 304, 8)


def test_roipooling_sizes_ascends_rois_and_refuses_to_run_them():
    model = load_from_text(net('layer { name: "pool" type: "ROIPooling" bottom: "feat" bottom: "rois" top: "p" '
                               'roi_pooling_param { pooled_w: 3 pooled_h: 2 spatial_scale: 0.0625 } }',
                               inputs={"feat": (2, 6, 5, 7), "rois": (2, 5, 32)}))
    assert model.blob_shapes["p"] == (64, 6, 2, 3)
    with pytest.raises(CaffeqError, match=r"rois must be \(R, 5\)"):
        model.run({"feat": np.zeros((2, 6, 5, 7), np.float32), "rois": np.zeros((2, 5, 32), np.float32)})
