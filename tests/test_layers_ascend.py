"""Huawei Ascend's SSDDetectionOutput (caffeq/layers/ssd/ascend.py), read and sized as Ascend's converter shapes
it (CANN's operator: a count top (N, 8) and a boxes top (N, keep_top_k rounded up to 128, 8)), never run; the
settings BestDAHU/Atlas200DK writes in SSD's detection_output_param, which that converter drops."""
import numpy as np
import pytest
from conftest import net

from caffeq.errors import CaffeqError, ExportError
from caffeq.model import load_from_text


def ascend_net(params, priors=96, classes=3, batch=2):
    return net(f'layer {{ name: "det" type: "SSDDetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
               f'top: "out_boxnum" top: "y" {params} }}',
               inputs={"loc": (batch, priors * 4), "conf": (batch, priors * classes), "prior": (1, 2, priors * 4)})


@pytest.mark.parametrize("keep, rows", [(100, 128), (128, 128), (129, 256), (1024, 1024), (-1, 1024)])
def test_the_boxes_top_holds_keep_top_k_rounded_up_to_128_rows(keep, rows):
    model = load_from_text(ascend_net(f"ssddetectionoutput_param {{ num_classes: 3 iou_threshold: 0.45 top_k: 400 "
                                      f"code_type: 2 keep_top_k: {keep} confidence_threshold: 0.01 }}"))
    assert model.blob_shapes["out_boxnum"] == (2, 8) and model.blob_shapes["y"] == (2, rows, 8)
    assert not model.warnings


def test_it_is_read_not_run(tmp_path):
    model = load_from_text(ascend_net("ssddetectionoutput_param { num_classes: 3 keep_top_k: 200 }"))
    feeds = {"loc": np.zeros((2, 384), np.float32), "conf": np.zeros((2, 288), np.float32),
             "prior": np.zeros((1, 2, 384), np.float32)}
    with pytest.raises(CaffeqError, match=r"layer 'det' \(SSDDetectionOutput\): Huawei Ascend's SSD post-processing"):
        model.run(feeds)
    with pytest.raises(ExportError, match="reads and sizes it but does not run it"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()


def test_settings_in_ssds_message_are_noted_as_unread():
    # BestDAHU/Atlas200DK's mssd512_voc.prototxt: iou_threshold and eta, unknown to SSD's message, are skipped
    # with a warning (Ascend's parser drops them); the operator's own defaults shape the tops (keep_top_k -1)
    model = load_from_text(ascend_net("detection_output_param { num_classes: 2 share_location: true "
                                      "background_label_id: 0 iou_threshold: 0.45 top_k: 400 eta: 1.0 "
                                      "variance_encoded_in_target: false code_type: 2 keep_top_k: 100 "
                                      "confidence_threshold: 0.01 }", classes=2))
    assert model.blob_shapes["y"] == (2, 1024, 8)
    text = "\n".join(model.warnings)
    assert "ignored unknown field 'iou_threshold'" in text and "ignored unknown field 'eta'" in text
    assert "Ascend's converter does not read for SSDDetectionOutput" in text
    # in SSD's own DetectionOutput, which caffeq runs, the same unknown field stays an error
    ssd = net('layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "out" '
              'detection_output_param { num_classes: 2 iou_threshold: 0.45 } }',
              inputs={"loc": (2, 384), "conf": (2, 192), "prior": (1, 2, 384)})
    with pytest.raises(CaffeqError, match="unknown field 'iou_threshold'"):
        load_from_text(ssd)


@pytest.mark.parametrize("params, message", [
    ("share_location: false", "share_location must be true"),
    ("eta: 0.5", "eta must be 1"),
    ("keep_top_k: 2000", r"keep_top_k must be in \[1, 1024\] or -1"),
    ("top_k: 0", "top_k must be > 0"),
    ("num_classes: 4", r"conf \[2, 288\] does not hold 96 priors x 4 class scores"),
    ("num_classes: 3 code_type: 4", "code_type must be 1 .CORNER., 2 .CENTER_SIZE. or 3"),
    ("num_classes: 3 background_label_id: 3", r"background_label_id must be \[-1, num_classes - 1 = 2\]"),
    ("num_classes: 3 iou_threshold: 0", r"iou_threshold must be \(0, 1\]"),
])
def test_the_operators_limits_and_shape_checks(params, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(ascend_net(f"ssddetectionoutput_param {{ {params} }}"))
