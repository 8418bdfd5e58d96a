"""TensorRT plugin stand-ins (bare IPlugin / Yolo layers, a DetectionOutput without parameters):
`inspect` lists the net with the shapes after them unknown, in one note; every command that
would run or export them refuses with one line naming the layer, and writes nothing."""
import json
from pathlib import Path

import numpy as np
import pytest

from caffeq.__main__ import main
from caffeq.errors import CaffeqError
from caffeq.io.schema import caffe_pb2
from caffeq.io.writer import write_caffemodel
from caffeq.model import load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
SSD_IPLUGIN = REALWORLD / "Ghustwb__MobileNet-SSD-TensorRT__model__MobileNetSSD_deploy_iplugin.prototxt"
YOLO_TRT = REALWORLD / "eric612__TensorRT-Yolov3-models__mobilenet-yolov3__mobilenet_yolov3_test.prototxt"

NET = """
input: "x"
input_shape { dim: 1 dim: 3 dim: 8 dim: 6 }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "c_perm" type: "IPlugin" bottom: "c" top: "p" }
layer { name: "relu" type: "ReLU" bottom: "p" top: "r" }
layer { name: "det" type: "DetectionOutput" bottom: "r" bottom: "c" bottom: "x" top: "out" top: "count" }
"""


def run_cli(args, capsys):
    capsys.readouterr()
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_inspect_lists_the_net_with_unknown_shapes_after_the_stand_ins(tmp_path, capsys):
    out = tmp_path / "summary.json"
    rc, err = run_cli(["inspect", str(SSD_IPLUGIN), "--json", str(out)], capsys)
    assert rc == 0, err
    layers = {row["name"]: row for row in json.loads(out.read_text())["layers"]}
    # the backbone before the plugins keeps Caffe's shapes; the plugins' tops and what follows are unknown
    assert layers["conv11_mbox_loc"]["output_shapes"] == {"conv11_mbox_loc": [1, 12, 19, 19]}
    assert layers["conv11_mbox_loc_perm"]["output_shapes"] == {"conv11_mbox_loc_perm": None}
    assert layers["mbox_loc"]["output_shapes"] == {"mbox_loc": None}
    assert layers["detection_out"]["output_shapes"] == {"detection_out": None, "detection_out2": None}
    # eighteen stand-ins read from known shapes: one note for all of them
    notes = [ln for ln in err.splitlines() if "TensorRT plugin stand-in" in ln]
    assert len(notes) == 1 and "'conv11_mbox_loc_perm', 'conv11_mbox_conf_perm', 'conv11_mbox_priorbox' " \
                                "(+15 more) (IPlugin)" in notes[0], err


def test_a_bare_detection_output_is_tensorrts_plugin_but_a_configured_one_stays_ssds(capsys):
    model = load_from_text(NET, unknown_shapes_ok=True)
    assert model.graph.node("det").spec.why_not_run(model.graph.node("det").attrs).startswith(
        "it has no detection_output_param (which Caffe requires)")
    assert model.graph.tensors["r"].shape is None and model.graph.tensors["c"].shape == (1, 4, 8, 6)
    ssd = NET.replace('top: "out" top: "count" }', 'top: "out" detection_output_param { num_classes: 2 } }')
    with pytest.raises(CaffeqError, match="'det' .DetectionOutput."):   # SSD's own checks apply again
        load_from_text(ssd.replace('bottom: "r" ', ""), unknown_shapes_ok=True)


def test_loading_to_run_refuses_in_one_line_naming_the_stand_in():
    with pytest.raises(CaffeqError, match=r"layer 'c_perm' \(IPlugin\): it is a TensorRT plugin stand-in: .*"
                                          r"not in the prototxt; the shapes of its tops"):
        load_from_text(NET, random_weights=True)


def test_convert_and_run_refuse_in_one_line_and_write_nothing(tmp_path, capsys):
    prototxt = tmp_path / "trt.prototxt"
    prototxt.write_text(NET)
    weights = tmp_path / "trt.caffemodel"
    rng = np.random.default_rng(0)
    trained = caffe_pb2.NetParameter()
    trained.layer.add(name="conv", type="Convolution")
    write_caffemodel(trained, {"conv": [rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                                        np.zeros(4, np.float32)]}, str(weights))
    onnx_path = tmp_path / "net.onnx"
    rc, err = run_cli(["convert", str(prototxt), "--weights", str(weights), "-o", str(onnx_path)], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("caffeq: error: ")]
    assert rc == 2 and len(errors) == 1 and "'c_perm' (IPlugin): it is a TensorRT plugin stand-in" in errors[0], err
    assert "Traceback" not in err and not onnx_path.exists()
    feeds = tmp_path / "in.npz"
    np.savez(feeds, x=np.zeros((1, 3, 8, 6), np.float32))
    rc, err = run_cli(["run", str(prototxt), "--weights", str(weights), "-i", str(feeds),
                       "-o", str(tmp_path / "o.npz")], capsys)
    assert rc == 2 and "TensorRT plugin stand-in" in err and not (tmp_path / "o.npz").exists()


def test_the_yolo_stand_in_ends_a_net_whose_backbone_is_sized(tmp_path, capsys):
    out = tmp_path / "summary.json"
    rc, err = run_cli(["inspect", str(YOLO_TRT), "--json", str(out)], capsys)
    assert rc == 0, err
    layers = {row["name"]: row for row in json.loads(out.read_text())["layers"]}
    assert layers["yolo-det"]["type"] == "Yolo" and layers["yolo-det"]["output_shapes"] == {"yolo-det": None}
    assert all(None not in row["output_shapes"].values() for name, row in layers.items() if name != "yolo-det")


KEEP_COUNT = """
input: "loc" input_shape { dim: 2 dim: 16 }
input: "conf" input_shape { dim: 2 dim: 12 }
input: "prior" input_shape { dim: 1 dim: 2 dim: 16 }
layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior"
        top: "detection_out" top: "keep_count"
        detection_output_param { num_classes: 3 nms_param { nms_threshold: 0.45 top_k: 40 } keep_top_k: 25
                                 confidence_threshold: 0.01 } }
"""


def test_detection_output_with_a_keep_count_top_is_tensorrts_nms_plugin():
    # NVIDIA's TensorRT SSD sample (and hy17003/pelee-ssd-TX2): tops detection_out and keep_count
    model = load_from_text(KEEP_COUNT, unknown_shapes_ok=True)
    assert model.blob_shapes["detection_out"] == (2, 1, 25, 7) and model.blob_shapes["keep_count"] == (2, 1, 1, 1)
    with pytest.raises(CaffeqError, match=r"layer 'det' \(DetectionOutput\): its second top, keep_count, makes it "
                                          r"TensorRT's NMS plugin"):
        load_from_text(KEEP_COUNT, random_weights=True).run(
            {"loc": np.zeros((2, 16), np.float32), "conf": np.zeros((2, 12), np.float32),
             "prior": np.zeros((1, 2, 16), np.float32)})
    with pytest.raises(CaffeqError, match="needs detection_output_param.keep_top_k > 0"):
        load_from_text(KEEP_COUNT.replace(" keep_top_k: 25", ""), unknown_shapes_ok=True)
