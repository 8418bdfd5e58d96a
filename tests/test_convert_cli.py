"""`python cli.py convert` end to end, through a subprocess, as users type it."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import cli_process, ok, one_line_error

import caffeq
from caffeq.quant import quantize

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
CASES = REPO / "tests" / "fixtures" / "caffe"


def _digits_inputs(n=16):
    return np.random.default_rng(0).uniform(-0.5, 0.5, (n, 1, 16, 16)).astype(np.float32)


def test_first_command_without_weights_from_repo_root(tmp_path):
    # exactly what users type first (output redirected so the checkout stays clean)
    out = ok(cli_process("convert", "examples/digits/deploy.prototxt", "--to", "binary", "-o", tmp_path / "d.onnx"))
    assert "model.caffemodel" in out and "found beside" in out            # which weights it used
    assert "changed 2 layer(s): conv2, ip1" in out
    assert "conv1 (first weighted layer)" in out and "ip2 (last weighted layer)" in out
    assert "rel. L2 err" in out and "total" in out                        # the per-layer table
    assert "size:" in out and "smaller" in out                            # sizes and ratio
    assert "before optimization" in out                                   # ONNX node counts
    assert "finetune" in out and "--to binary" in out                     # accuracy recovery hint
    assert (tmp_path / "d.onnx").exists()


def test_default_output_name_in_current_folder(tmp_path):
    ok(cli_process("convert", DIGITS / "deploy.prototxt", "--to", "binary", cwd=tmp_path))
    path = tmp_path / "deploy.binary.onnx"
    assert path.exists() and not [f for f in os.listdir(tmp_path) if f.startswith(".caffeq-")]
    # onnxruntime runs it with the torch module's numbers
    import onnxruntime as ort
    model = caffeq.load(DIGITS / "deploy.prototxt", DIGITS / "model.caffemodel")
    q = quantize(model, "binary")
    x = _digits_inputs()
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = s.run(None, {"data": x})[0]
    ref = q.run(x)["prob"]
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_no_weights_anywhere_is_one_line(tmp_path):
    (tmp_path / "deploy.prototxt").write_text((CASES / "conv_basic" / "model.prototxt").read_text())
    one_line_error(cli_process("convert", tmp_path / "deploy.prototxt", "--to", "binary", cwd=tmp_path),
                   "deploy.prototxt", "--weights")
    assert os.listdir(tmp_path) == ["deploy.prototxt"]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["fp16", "int8", "binary"])
def test_caffeq_and_caffemodel_outputs_round_trip(tmp_path, target):
    x = _digits_inputs()
    np.save(tmp_path / "x.npy", x)
    ok(cli_process("convert", DIGITS / "deploy.prototxt", "--to", target, "--keep", "none", "-o", tmp_path / "m.caffeq"))
    ok(cli_process("convert", DIGITS / "deploy.prototxt", "--to", target, "--keep", "none",
           "-o", tmp_path / "m.caffemodel"))
    assert (tmp_path / "m.prototxt").exists()
    model = caffeq.load(DIGITS / "deploy.prototxt", DIGITS / "model.caffemodel")
    ref = quantize(model, target, keep="none").run(x, exact=True)["prob"]
    a = caffeq.load(str(tmp_path / "m.caffeq")).run(x, exact=True)["prob"]
    # exact: the dequantized float caffemodel folds BatchNorm into its weights by default
    b = caffeq.load(str(tmp_path / "m.prototxt"), str(tmp_path / "m.caffemodel")).run(x, exact=True)["prob"]
    np.testing.assert_array_equal(a, ref)
    np.testing.assert_array_equal(b, ref)


@pytest.mark.slow
def test_run_inspect_and_convert_read_the_container(tmp_path):
    x = _digits_inputs()
    np.save(tmp_path / "x.npy", x)
    ok(cli_process("convert", DIGITS / "deploy.prototxt", "--to", "binary", "-o", tmp_path / "m.caffeq"))
    model = caffeq.load(DIGITS / "deploy.prototxt", DIGITS / "model.caffemodel")
    ref = quantize(model, "binary").run(x)["prob"]
    ok(cli_process("run", tmp_path / "m.caffeq", "-i", tmp_path / "x.npy", "-o", tmp_path / "y.npz"))
    with np.load(tmp_path / "y.npz") as z:
        np.testing.assert_array_equal(z["prob"], ref)
    assert "conv1" in ok(cli_process("inspect", tmp_path / "m.caffeq"))
    # convert keeps the stored precision, or writes float32 with --to fp32
    out = ok(cli_process("convert", tmp_path / "m.caffeq", "-o", tmp_path / "again.onnx"))
    assert "already binary" in out
    ok(cli_process("convert", tmp_path / "m.caffeq", "--to", "fp32", "-o", tmp_path / "f.caffemodel"))
    f = caffeq.load(str(tmp_path / "f.prototxt"), str(tmp_path / "f.caffemodel")).run(x, exact=True)["prob"]
    np.testing.assert_array_equal(f, quantize(model, "binary").run(x, exact=True)["prob"])
    one_line_error(cli_process("convert", tmp_path / "m.caffeq", "--to", "int8", "-o", tmp_path / "x.caffeq"),
                   "already quantized")
    assert not (tmp_path / "x.caffeq").exists()


@pytest.mark.slow
def test_probe_and_json(tmp_path):
    x = _digits_inputs(32)
    np.savez(tmp_path / "probe.npz", data=x)
    res = cli_process("convert", DIGITS / "deploy.prototxt", "--to", "fp16", "-o", tmp_path / "m.onnx",
              "--probe", tmp_path / "probe.npz", "--json", tmp_path / "r.json")
    out = ok(res)
    assert "probe" in out and "top-1 agreement 32/32" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["target"] == "fp16" and r["format"] == "onnx"
    assert r["probe"]["prob"]["top1_agreement"] == 1.0 and r["probe"]["prob"]["rel_error"] < 1e-2
    assert r["onnx"]["nodes_before"] >= r["onnx"]["nodes_after"] > 0
    names = [row["name"] for row in r["report"]["layers"]]
    assert "conv1" in names and r["report"]["totals"]["bytes_after"] < r["report"]["totals"]["bytes_before"]
    assert r["size_after"] == os.path.getsize(tmp_path / "m.onnx")
    # the ONNX file is about half of the fp32 weights
    assert os.path.getsize(tmp_path / "m.onnx") < 0.6 * os.path.getsize(DIGITS / "model.caffemodel")
    # binary: the probe shows how much post-training binarization changes the outputs
    r2 = cli_process("convert", DIGITS / "deploy.prototxt", "--to", "binary", "--keep", "none",
             "-o", tmp_path / "b.onnx", "--probe", tmp_path / "probe.npz", "--json", "-")
    d = json.loads(ok(r2))
    assert d["probe"]["prob"]["rel_error"] > 0.05
    assert "probe" in r2.stderr        # the human-readable lines go to stderr with --json -


def test_onnx_flags(tmp_path):
    import onnx
    ok(cli_process("convert", DIGITS / "deploy.prototxt", "--to", "int8", "-o", tmp_path / "a.onnx",
           "--opset", "13", "--batch", "4", "--no-optimize"))
    m = onnx.load(str(tmp_path / "a.onnx"))
    assert max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 13
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 4
    assert "BatchNormalization" not in [n.op_type for n in m.graph.node]
    assert "DequantizeLinear" in [n.op_type for n in m.graph.node]


def test_bad_flags_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    # in-process (the subprocess tests above cover the same error path end to end)
    from caffeq.__main__ import main
    monkeypatch.chdir(tmp_path)

    def check(*args):
        code = main(["convert", str(DIGITS / "deploy.prototxt"), *map(str, args)])
        err = capsys.readouterr().err
        one_line_error(subprocess.CompletedProcess(args, code, "", err), *needles[args])

    needles = {}
    for args, want in ((("--to", "binary", "--keep", "nope"), ("nope",)),
                       (("--to", "binary", "--only", "relu1"), ("relu1",)),
                       (("--to", "binary", "--keep", "conv1", "--only", "ip1"), ("--only",)),
                       (("-o", "x.txt"), (".txt",)),
                       (("--opset", "9"), ("opset",)),
                       (("--opset", "x"), ("--opset",)),
                       (("--batch", "zero"), ("--batch",)),
                       (("--probe", tmp_path / "missing.npz"), ("missing.npz",)),
                       (("-o", DIGITS / "model.caffemodel"), ("refusing to overwrite",))):
        needles[args] = want
        check(*args)
    assert os.listdir(tmp_path) == []


def test_caffemodel_output_never_replaces_the_input_prototxt(tmp_path):
    (tmp_path / "deploy.prototxt").write_text((DIGITS / "deploy.prototxt").read_text())
    os.symlink(DIGITS / "model.caffemodel", tmp_path / "w.caffemodel")
    before = (tmp_path / "deploy.prototxt").read_text()
    one_line_error(cli_process("convert", "deploy.prototxt", "--weights", "w.caffemodel", "--to", "int8",
                       "-o", "deploy.caffemodel", cwd=tmp_path), "overwrite an input")
    assert (tmp_path / "deploy.prototxt").read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["deploy.prototxt", "w.caffemodel"]


def test_help_says_how_fp16_computes():
    out = ok(cli_process("convert", "--help"))
    flat = " ".join(out.split())
    assert "fp32 with fp16-rounded weights on CPU and in fp16 on CUDA" in flat
