"""Static int8 (activations calibrated on data): accuracy on the example model, int8 kernels in
onnxruntime, the --keep rules, the calibration sources and the errors."""
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_process, ok, one_line_error

import caffeq
from caffeq.evaluate import evaluate

pytest.importorskip("onnxruntime")

from caffeq.backends.onnx_qdq import kernel_ops, session

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
TRAIN_VAL = str(DIGITS / "train_val.prototxt")
DEPLOY = str(DIGITS / "deploy.prototxt")
WEIGHTS = str(DIGITS / "model.caffemodel")
PREPROCESS = ["--mean-file", DIGITS / "mean.binaryproto", "--scale", "0.00390625"]


def _test_images(n=64):
    """Preprocessed TEST-LMDB images of the example (Caffe's transform, as eval reads them)."""
    from caffeq.quant.static_int8 import calibration_inputs
    model = caffeq.load(TRAIN_VAL, WEIGHTS)
    return calibration_inputs(model, str(DIGITS / "test_lmdb"), n)["data"]


@pytest.fixture(scope="module")
def int8_file(tmp_path_factory):
    """The deploy net converted to static int8, calibrated on the TRAIN LMDB."""
    out = tmp_path_factory.mktemp("int8") / "digits.int8.onnx"
    text = ok(cli_process("convert", DEPLOY, "--to", "int8", "--calibrate", DIGITS / "train_lmdb",
                  "--calibrate-images", 128, *PREPROCESS, "-o", out))
    return out, text


def test_digits_static_int8_keeps_top1_within_half_a_point():
    """Calibrated on the TRAIN LMDB, evaluated on the TEST LMDB beside fp32 (99.00%)."""
    r = evaluate(TRAIN_VAL, weights=WEIGHTS, targets=("fp32", "int8"), calibrate=str(DIGITS / "train_lmdb"),
                 calibrate_images=256)
    fp32, int8 = r["results"]["fp32"], r["results"]["int8"]
    assert fp32["images"] == int8["images"] == 400
    assert fp32["top1"] == pytest.approx(0.99)
    assert abs(int8["top1"] - fp32["top1"]) <= 0.005, (int8["top1"], fp32["top1"])
    assert int8["agreement_top1"] >= 0.99
    assert int8["layers"]["accuracy"] is None          # the training-only layers are not in the file
    assert any("static" in n and "onnxruntime" in n for n in r["notes"])
    assert int8["model_size_bytes"] < fp32["model_size_bytes"] / 3


def test_convolutions_run_on_int8_kernels(int8_file):
    path, text = int8_file
    assert "method" in text and "chosen" in text and "QLinearConv" in text
    x = _test_images(8)
    ops = kernel_ops(path, {"data": x})        # onnxruntime's profiler, after its graph optimizations
    assert ops["conv1"] in ("QLinearConv", "ConvInteger") and ops["conv2"] in ("QLinearConv", "ConvInteger")
    assert ops["ip1"] in ("QGemm", "QLinearMatMul", "MatMulInteger")
    assert ops["prob"] == "Softmax"              # Softmax keeps float inputs
    # weights are stored as per-channel int8
    import onnx
    g = onnx.load(str(path)).graph
    inits = {i.name: i for i in g.initializer}
    w = next(n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("conv2.weight"))
    codes, scale = inits[w.input[0]], inits[w.input[1]]
    assert codes.data_type == onnx.TensorProto.INT8
    assert list(scale.dims) == [codes.dims[0]]   # one scale per output channel


def test_int8_outputs_agree_with_fp32(int8_file):
    path, _ = int8_file
    x = _test_images(64)
    model = caffeq.load(DEPLOY, WEIGHTS)
    ref = model.run({"data": x})["prob"]
    got = session(path).run(None, {"data": x})[0]
    assert (ref.argmax(1) == got.argmax(1)).mean() >= 0.98
    assert np.abs(got - ref).max() < 0.1


def test_kept_layers_stay_float(tmp_path):
    x = _test_images(16)
    np.save(tmp_path / "calib.npy", x)          # an .npy of preprocessed inputs calibrates too
    out = tmp_path / "keep.onnx"
    text = ok(cli_process("convert", DEPLOY, "--to", "int8", "--calibrate", tmp_path / "calib.npy", "--keep", "conv1,ip2",
                  "--calibrate-method", "minmax", "-o", out))
    assert "kept float: conv1, ip2" in text and "minmax" in text
    ops = kernel_ops(out, {"data": x[:2]})
    assert _op_of(ops, "conv1") in ("Conv", "FusedConv", "NhwcFusedConv")
    assert _op_of(ops, "ip2") == "Gemm"
    assert _op_of(ops, "conv2") == "QLinearConv"


def _op_of(ops, layer):
    """The kernel onnxruntime ran for a layer (float convolutions are renamed 'conv1@conv1_nchwc')."""
    import re
    found = [op for name, op in ops.items() if re.match(rf"^{re.escape(layer)}(@.*)?$", name)]
    assert len(found) == 1, (layer, ops)
    return found[0]


def test_bad_requests_are_one_line(tmp_path):
    one_line_error(cli_process("convert", DEPLOY, "--to", "binary", "--calibrate", DIGITS / "train_lmdb",
                       "-o", tmp_path / "b.onnx"), "--to int8")
    one_line_error(cli_process("convert", DEPLOY, "--to", "int8", "--calibrate", tmp_path / "missing",
                       "-o", tmp_path / "b.onnx"), "missing")
    one_line_error(cli_process("convert", DEPLOY, "--to", "int8", "--calibrate", DIGITS / "train_lmdb",
                       "--calibrate-method", "median", "-o", tmp_path / "b.onnx"), "median")
    one_line_error(cli_process("convert", DEPLOY, "--to", "int8", "--calibrate", DIGITS / "train_lmdb",
                       "--keep", "nosuch", "-o", tmp_path / "b.onnx"), "nosuch")
    one_line_error(cli_process("convert", DEPLOY, "--to", "int8", "--calibrate", DIGITS / "train_lmdb",
                       "-o", tmp_path / "b.caffemodel"), ".onnx")
    np.save(tmp_path / "wrong.npy", np.zeros((2, 3, 16, 16), np.float32))
    one_line_error(cli_process("convert", DEPLOY, "--to", "int8", "--calibrate", tmp_path / "wrong.npy",
                       "-o", tmp_path / "b.onnx"), "wrong.npy")
    assert not (tmp_path / "b.onnx").exists() and not (tmp_path / "b.caffemodel").exists()


def test_missing_onnxruntime_is_a_clear_error(monkeypatch):
    from caffeq.backends.onnx_qdq import require_onnxruntime
    from caffeq.quant import QuantizeError
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    monkeypatch.setitem(sys.modules, "onnxruntime.quantization", None)
    with pytest.raises(QuantizeError, match="pip install"):
        require_onnxruntime()
