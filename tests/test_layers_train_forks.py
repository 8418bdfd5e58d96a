"""Layers of forks' train nets (tests/fixtures/realworld, sources in SOURCES.md):
D-X-Y/caffe-faster-rcnn's FrcnnRoiData, FrcnnAnchorTarget and FrcnnProposalTarget (read and sized with the
fork's setup shapes, never run); wy1iu/sphereface-plus's InterClass loss (read, training-only, dropped)."""
from pathlib import Path

import numpy as np
import pytest

from caffeq.__main__ import main
from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


# ---- D-X-Y/caffe-faster-rcnn (c9ca246): the train net's data and target layers -------------------------

FRCNN_TRAIN = REALWORLD / "D-X-Y__caffe-faster-rcnn__models__FRCNN__zf__train_val.prototxt"


def test_frcnn_train_val_reads_with_the_forks_setup_shapes():
    """FrcnnRoiData's setup: data (1, 3, 600, 1000) from voc_config.json, im_info (1, 3, 1, 1), gt_boxes
    (1, 5, 1, 1); FrcnnAnchorTarget: (1, 1, 9H, W) and (1, 36, H, W) x 3 from rpn_cls_score's H x W;
    FrcnnProposalTarget: rois (1, 5, 1, 1), labels (1, 1, 1, 1), 4 x 21 targets."""
    model = load(str(FRCNN_TRAIN), phase="TRAIN")
    shapes = model.blob_shapes
    assert shapes["data"] == (1, 3, 600, 1000) and shapes["im_info"] == (1, 3, 1, 1)
    assert shapes["gt_boxes"] == (1, 5, 1, 1)
    h, w = shapes["rpn_cls_score"][2:]
    assert (h, w) == (39, 64)
    assert shapes["rpn_labels"] == (1, 1, 9 * h, w)
    for top in ("rpn_bbox_targets", "rpn_bbox_inside_weights", "rpn_bbox_outside_weights"):
        assert shapes[top] == (1, 36, h, w)
    assert shapes["rois"] == (1, 5, 1, 1) and shapes["labels"] == (1, 1, 1, 1)
    for top in ("bbox_targets", "bbox_inside_weights", "bbox_outside_weights"):
        assert shapes[top] == (1, 84, 1, 1)
    assert shapes["roi_pool_conv5"] == (1, 256, 6, 6)


def inspect_rc(path, *args):
    return main(["inspect", str(path), *args])


def test_frcnn_train_val_inspects_at_test_and_train(capsys):
    """Its only data layer is TRAIN's: inspect (TEST by default) shows the net as TRAIN, with a note."""
    assert inspect_rc(FRCNN_TRAIN) == 0
    assert "showing the net as --phase TRAIN" in capsys.readouterr().err
    assert inspect_rc(FRCNN_TRAIN, "--phase", "TRAIN") == 0


def test_frcnn_test_prototxt_still_reads():
    model = load(str(REALWORLD / "D-X-Y__caffe-faster-rcnn__models__FRCNN__zf_rpn__test.prototxt"))
    assert model.blob_shapes["rois"][1:] == (5, 1, 1)


FRCNN_TARGETS_NET = """
layer { name: "d" type: "Input" top: "score" top: "gt" top: "info"
  input_param { shape { dim: 1 dim: 18 dim: 5 dim: 7 } shape { dim: 3 dim: 5 dim: 1 dim: 1 }
                shape { dim: 1 dim: 3 dim: 1 dim: 1 } } }
layer { name: "anchors" type: "FrcnnAnchorTarget" bottom: "score" bottom: "gt" bottom: "info"
  top: "l" top: "t" top: "iw" top: "ow" }
layer { name: "prop" type: "Input" top: "rpn_rois" input_param { shape { dim: 300 dim: 5 dim: 1 dim: 1 } } }
layer { name: "sample" type: "FrcnnProposalTarget" bottom: "rpn_rois" bottom: "gt"
  top: "rois" top: "labels" top: "bt" top: "bi" top: "bo" }
"""


def test_frcnn_target_layers_size_from_their_bottoms_and_refuse_to_run():
    model = load_from_text(FRCNN_TARGETS_NET, outputs=["l", "t", "rois", "bo"])
    s = model.blob_shapes
    assert s["l"] == (1, 1, 45, 7) and s["t"] == (1, 36, 5, 7) and s["ow"] == (1, 36, 5, 7)
    assert s["rois"] == (1, 5, 1, 1) and s["bo"] == (1, 84, 1, 1)
    feeds = {"score": np.zeros((1, 18, 5, 7), np.float32), "gt": np.zeros((3, 5, 1, 1), np.float32),
             "info": np.array([80, 112, 1], np.float32).reshape(1, 3, 1, 1),
             "rpn_rois": np.zeros((300, 5, 1, 1), np.float32)}
    with pytest.raises(CaffeqError, match=r"layer 'anchors' \(FrcnnAnchorTarget\): it labels anchors"):
        model.run(feeds)


def test_frcnn_target_layers_check_their_blobs():
    with pytest.raises(LayerError, match="FrcnnAnchorTarget takes 3 bottoms"):
        load_from_text(FRCNN_TARGETS_NET.replace('bottom: "gt" bottom: "info"', 'bottom: "gt"'))
    with pytest.raises(LayerError, match="FrcnnProposalTarget takes 2 bottoms .* and 5 tops"):
        load_from_text(FRCNN_TARGETS_NET.replace(' top: "bo" }', ' }'))


def test_frcnn_roi_data_notes_a_config_it_does_not_read():
    net = """layer { name: "d" type: "FrcnnRoiData" top: "data" top: "im_info" top: "gt_boxes"
      window_data_param { source: "list.txt" config: "my.json" } }
    layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 2 kernel_size: 3 } }"""
    model = load_from_text(net)
    assert model.blob_shapes["data"] == (1, 3, 600, 1000)
    assert any("does not read the JSON config 'my.json'" in w for w in model.warnings)
    given = load_from_text(net, input_shapes={"data": (1, 3, 64, 80)})
    assert given.blob_shapes["c"] == (1, 2, 62, 78)


# ---- wy1iu/sphereface-plus (84a0c8b): the InterClass loss ----------------------------------------------

SFPLUS_TRAIN = REALWORLD / "wy1iu__sphereface-plus__train__code__sfplus__m_double_model.prototxt"


def test_sphereface_plus_inter_class_is_read_and_dropped_as_a_loss():
    """InterClassLayer is a LossLayer over the shared classifier weight (fc6_w) and the labels: its
    inter_class_param parses (no unknown-field warning) and the layer is dropped with the other losses."""
    model = load(str(SFPLUS_TRAIN), input_shapes={"data": (2, 3, 112, 96), "label": (2,)})
    assert not any("inter_class_param" in w for w in model.warnings)
    assert any("inter_class_dist_output (InterClass)" in w for w in model.warnings)
    assert "maximize_inter_class_dist" not in model.blob_shapes
    assert model.blob_shapes["fc5"] == (2, 512)
    p = model.net.layer[[lp.name for lp in model.net.layer].index("inter_class_dist_output")].inter_class_param
    assert (p.num_output, p.type, p.iteration, p.alpha_start_iter, p.alpha_start_value) == (10572, 1, 16000, 16001, 6)
    assert p.normalize and p.axis == 1


def test_sphereface_plus_train_net_inspects(capsys):
    assert inspect_rc(SFPLUS_TRAIN, "--input-shape", "data=1,3,112,96") == 0
