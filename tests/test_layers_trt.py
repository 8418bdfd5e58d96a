"""NVCaffe's TRT layer as cathy-kim/RefineDet carries it (caffeq/layers/trt.py): trt_param read with the fork's
fields, the checks of its LayerSetUp and Reshape (src/caffe/layers/trt_layer.cpp), the top left to the user, and
every run refused (caffeq does not run TensorRT, and opens none of the files the layer names)."""
from pathlib import Path

import numpy as np
import pytest
from conftest import model_py_outputs, net, onnx_outputs

from caffeq.__main__ import main
from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
TRT_FILE = "cathy-kim__RefineDet__examples__TensorRT__trt.prototxt"
PARAMS = 'deploy: "d.prototxt" model: "w.caffemodel" deploy_outputs: "prob" calibrator: "t.calibration"'


def trt_net(params=PARAMS, data=(1, 3, 8, 9), labels=(1,)):
    return net(f'layer {{ name: "engine" type: "TRT" bottom: "data" bottom: "label" top: "trt" '
               f'trt_param {{ {params} }} }}', inputs={"data": data, "label": labels})


def test_the_forks_trt_file_reads_with_its_top_unsized(capsys):
    path = str(REALWORLD / TRT_FILE)
    assert main(["inspect", path]) == 0
    captured = capsys.readouterr()
    line = next(ln for ln in captured.out.splitlines() if ln.startswith("TRT "))
    assert "data,label -> trt" in line and line.rstrip().endswith("?")
    assert ("cannot tell the shape of top 'trt' without the TensorRT engine (TRT's top is (1, the dims of output "
            "'prob' of the TensorRT engine built from examples/TensorRT/deploy_trt.prototxt))") in captured.err


def test_the_top_takes_the_shape_the_user_gives(capsys):
    assert main(["inspect", str(REALWORLD / TRT_FILE), "--input-shape", "trt=1,1000,1,1"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("TRT "))
    assert "1x1000x1x1" in line


def test_trt_param_is_read_with_the_forks_fields():
    model = load_from_text(trt_net('trt_mode: FP16 top_k: 5 deploy: "d.prototxt" model: "w.caffemodel" '
                                   'deploy_outputs: "prob" calibrator: "t.calibration"'),
                           input_shapes={"trt": (1, 10, 1, 1)})
    attrs = next(n for n in model.layers if n.name == "engine").attrs
    assert {k: attrs[k] for k in ("mode", "top_k", "deploy", "model", "output", "calibrator")} == {
        "mode": "FP16", "top_k": 5, "deploy": "d.prototxt", "model": "w.caffemodel", "output": "prob",
        "calibrator": "t.calibration"}
    assert model.blob_shapes["trt"] == (1, 10, 1, 1)


def test_every_run_is_refused_naming_tensorrt(tmp_path):
    model = load_from_text(trt_net(), input_shapes={"trt": (1, 10, 1, 1)})
    feeds = {"data": np.zeros((1, 3, 8, 9), F32), "label": np.zeros((1,), F32)}
    words = (r"layer 'engine' \(TRT\): runs a TensorRT engine \(INT8\) built from d.prototxt and w.caffemodel "
             r"\(output 'prob'\); caffeq does not run TensorRT")
    with pytest.raises(CaffeqError, match=words):
        model.run(feeds)
    with pytest.raises(ExportError, match=words):
        onnx_outputs(model, feeds, tmp_path)
    with pytest.raises(ExportError, match=words):
        model_py_outputs(model, feeds, tmp_path)


def test_int8_is_the_default_mode_and_needs_its_calibration_table():
    params = 'deploy: "d.prototxt" model: "w.caffemodel" deploy_outputs: "prob"'
    with pytest.raises(LayerError, match=r"layer 'engine'.*trt_param.calibrator must name the INT8 calibration"):
        load_from_text(trt_net(params))
    model = load_from_text(trt_net(params + " trt_mode: FP32"), input_shapes={"trt": (1, 4)})
    assert next(n for n in model.layers if n.name == "engine").attrs["mode"] == "FP32"


@pytest.mark.parametrize("params, words", [
    ('model: "w.caffemodel" deploy_outputs: "prob" trt_mode: FP32', "trt_param.deploy must name the prototxt"),
    ('deploy: "d.prototxt" deploy_outputs: "prob" trt_mode: FP32', "trt_param.model must name the caffemodel"),
    ('deploy: "d.prototxt" model: "w.caffemodel" trt_mode: FP32', "trt_param.deploy_outputs must name exactly one "
                                                                   "blob .*got 0"),
    ('deploy: "d.prototxt" model: "w.caffemodel" deploy_outputs: "a" deploy_outputs: "b" trt_mode: FP32',
     "trt_param.deploy_outputs must name exactly one blob .*got 2"),
])
def test_bad_trt_params_are_refused(params, words):
    with pytest.raises(LayerError, match=f"layer 'engine'.*{words}"):
        load_from_text(trt_net(params + ' calibrator: "t"'))


def test_top_k_above_the_class_count_is_refused():
    """Reshape's CHECK_LE(top_k, count(data) / count(labels)): 2 x 3 x 2 x 2 data over 2 labels is 12 classes."""
    params = PARAMS + ' trt_mode: FP32 top_k: '
    load_from_text(trt_net(params + "12", data=(2, 3, 2, 2), labels=(2,)), input_shapes={"trt": (1, 12)})
    with pytest.raises(LayerError, match=r"layer 'engine'.*trt_param.top_k 13 must be at most count\(data\) / "
                                         r"count\(labels\) = 24 / 2"):
        load_from_text(trt_net(params + "13", data=(2, 3, 2, 2), labels=(2,)))


def test_top_k_is_checked_when_the_user_gives_the_top():
    """The fork's Reshape CHECK runs whatever the engine gives: a full --input-shape, which spares infer, must not
    skip it."""
    params = PARAMS + ' trt_mode: FP32 top_k: 13'
    with pytest.raises(LayerError, match=r"layer 'engine'.*trt_param.top_k 13 must be at most count\(data\) / "
                                         r"count\(labels\) = 24 / 2"):
        load_from_text(trt_net(params, data=(2, 3, 2, 2), labels=(2,)), input_shapes={"trt": (1, 12)})


def test_an_empty_label_blob_is_refused():
    """count(data) / count(labels) with no labels: the fork divides by zero; caffeq says so."""
    with pytest.raises(LayerError, match=r"layer 'engine'.*trt_param.top_k 1 must be at most count\(data\) / "
                                         r"count\(labels\) = 216 / 0"):
        load_from_text(trt_net(PARAMS, labels=(0,)), input_shapes={"trt": (1, 12)})


def test_trt_takes_data_and_labels():
    text = net('layer { name: "engine" type: "TRT" bottom: "data" top: "trt" trt_param { ' + PARAMS + ' } }',
               inputs={"data": (1, 3, 8, 9)})
    with pytest.raises(LayerError, match=r"TRT takes 2 bottoms \(data, labels\) and one top, got 1 and 1"):
        load_from_text(text)


def test_a_model_to_run_needs_the_tops_shape():
    with pytest.raises(LayerError, match=r"layer 'engine' \(TRT\): cannot tell the shape of top 'trt' without the "
                                         r"TensorRT engine .*give it with --input-shape trt="):
        load_from_text(trt_net())
