"""Layers of forks' train nets (tests/fixtures/realworld, sources in SOURCES.md):
D-X-Y/caffe-faster-rcnn's FrcnnRoiData, FrcnnAnchorTarget and FrcnnProposalTarget (read and sized with the
fork's setup shapes, never run); wy1iu/sphereface-plus's InterClass loss (read, training-only, dropped);
SSAW14/LearnableDilationNetwork's Truncation and Duplicate (run, against references from the fork's code);
apsvvfb/caffe_qi's 3-top ImageData (LRCN clip markers)."""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

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


# ---- SSAW14/LearnableDilationNetwork (4838c44): Truncation and Duplicate ---------------------------------

DILATION_TRAIN = REALWORLD / "SSAW14__LearnableDilationNetwork__train.prototxt"


def ref_truncation(x, lo, hi):
    """truncation_layer.cpp: std::min(std::max(x, Dtype(min)), Dtype(max)), element by element."""
    out = np.empty_like(x)
    flat, res = x.reshape(-1), out.reshape(-1)
    for i, v in enumerate(flat):
        low = lo if v < lo else v         # std::max(a, b): (a < b) ? b : a
        res[i] = hi if hi < low else low  # std::min(a, b): (b < a) ? b : a
    return out


def ref_duplicate(x, h, w):
    """duplicate_layer.cu DuplicateForward: out[index] = in[n * channels + c] for every index of the
    (num, channels, h, w) top, c = (index / w / h) % channels, n = index / w / h / channels."""
    n, c = x.shape[0], x.shape[1]
    flat = x.reshape(-1)
    out = np.empty(n * c * h * w, np.float32)
    for index in range(out.size):
        cc = (index // w // h) % c
        nn = index // w // h // c
        out[index] = flat[nn * c + cc]
    return out.reshape(n, c, h, w)


@pytest.mark.parametrize("lo, hi", [(1.0, 4.0), (-0.25, 0.5), (0.75, -0.5)])
def test_truncation_matches_the_forks_formula(tmp_path, lo, hi):
    x = (rng().standard_normal((2, 3, 4, 5)) * 3).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "t" type: "Truncation" bottom: "x" top: "o" '
                               f'truncation_param {{ truncation_min: {lo} truncation_max: {hi} }} }}',
                               inputs={"x": (2, 3, 4, 5)}))
    check_everywhere(model, {"x": x}, {"o": ref_truncation(x, np.float32(lo), np.float32(hi))}, tmp_path)


def test_truncation_defaults_are_0_and_1(tmp_path):
    x = rng(1).standard_normal((3, 2, 5)).astype(np.float32)
    model = load_from_text(net('layer { name: "t" type: "Truncation" bottom: "x" top: "o" }', inputs={"x": (3, 2, 5)}))
    check_everywhere(model, {"x": x}, {"o": ref_truncation(x, 0.0, 1.0)}, tmp_path)


@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (3, 2, 4, 5)])
def test_duplicate_matches_the_forks_gpu_forward(tmp_path, shape):
    """(N, C, 1, 1) spreads each channel over the plane; a larger bottom gives its first N * C values."""
    x = rng(2).standard_normal(shape).astype(np.float32)
    model = load_from_text(net('layer { name: "d" type: "Duplicate" bottom: "x" top: "o" '
                               'duplicate_param { height: 7.9 width: 4 } }', inputs={"x": shape}))
    assert model.blob_shapes["o"] == (shape[0], shape[1], 7, 4)
    check_everywhere(model, {"x": x}, {"o": ref_duplicate(x, 7, 4)}, tmp_path)


def test_duplicate_checks_its_size():
    with pytest.raises(LayerError, match="duplicate_param.height and width must be >= 1"):
        load_from_text(net('layer { name: "d" type: "Duplicate" bottom: "x" top: "o" '
                           'duplicate_param { height: 0.5 width: 4 } }', inputs={"x": (1, 2, 1, 1)}))


def test_learnable_dilation_branch_reads_with_the_forks_shapes():
    """The train net's dilation branch: 1x1 'zero' images through 1x1 convolutions, Truncation to [1, 4],
    Duplicate to 41 x 41; the fork's Convolution with a dilation bottom reads them
    (tests/test_layers_learnable_dilation.py)."""
    text = DILATION_TRAIN.read_text()
    model = load_from_text(text[:text.index("###################### DeepLab")], phase="TRAIN")
    s = model.blob_shapes
    assert s["hole_conv_5_1"] == s["loc_truncation_5_1"] == (10, 512, 1, 1)
    assert s["dilation_5_1"] == s["dilation_5_3"] == (10, 512, 41, 41)
    node = next(n for n in model.graph.nodes if n.name == "loc_truncation_5_2")
    assert (node.attrs["min"], node.attrs["max"]) == (1.0, 4.0)
    assert load(str(DILATION_TRAIN), phase="TRAIN").blob_shapes["conv5_1"] == (10, 512, 41, 41)


# ---- apsvvfb/caffe_qi (88f2478): ImageData's third top, the LRCN clip markers ------------------------------

LRCN_TRAIN = REALWORLD / "apsvvfb__caffe_qi__examples__LRCN_activity_recognition__train_test_lstm_RGB.prototxt"


@pytest.mark.parametrize("phase, stages, batch", [("TRAIN", (), 96), ("TEST", ("test-on-test",), 48)])
def test_lrcn_image_data_gives_clip_markers(phase, stages, batch):
    """image_data_layer.cpp: with 3 tops, clip_markers is reshaped to (batch_size,) like the label; data is
    (batch_size, 3, crop, crop); the LSTM reads them as (16, batch_size / 16) after the net's Reshape."""
    model = load(str(LRCN_TRAIN), phase=phase, stages=stages)
    s = model.blob_shapes
    assert s["data"] == (batch, 3, 227, 227) and s["label"] == (batch,) and s["clip_markers"] == (batch,)
    assert s["reshape-cm"] == (16, batch // 16) and s["lstm1"] == (16, batch // 16, 256)


def test_image_data_clip_markers_follow_the_given_batch():
    text = """layer { name: "d" type: "ImageData" top: "data" top: "label" top: "cm"
      transform_param { crop_size: 5 } image_data_param { source: "none.txt" batch_size: 32 } }"""
    assert load_from_text(text).blob_shapes["cm"] == (32,)
    assert load_from_text(text, input_shapes={"data": (16, 3, 5, 5)}).blob_shapes["cm"] == (16,)
    with pytest.raises(LayerError, match=r"ImageData \(tops data\[, label\[, clip_markers\]\]\) takes"):
        load_from_text(text.replace('top: "cm"', 'top: "cm" top: "extra"'))


def test_lrcn_train_test_inspects(capsys):
    assert inspect_rc(LRCN_TRAIN) == 0
    assert inspect_rc(LRCN_TRAIN, "--phase", "TRAIN") == 0
