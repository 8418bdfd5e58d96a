"""`python cli.py convert` end to end, as users type it: through a subprocess, or in process (main)."""
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
    res = cli_process("convert", "examples/digits/deploy.prototxt", "--to", "binary", "-o", tmp_path / "d.onnx")
    out = ok(res)
    assert "model.caffemodel" in res.stderr and "found beside" in res.stderr   # which weights, on stderr
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


# ---- in process: the new user's trial (each mistake one error line, nothing written) --------------

PREPROCESS = ("--mean-file", DIGITS / "mean.binaryproto", "--scale", "0.00390625")


def _cli(capsys, *args):
    """main(args) in this process -> CompletedProcess-like (returncode, stdout, stderr)."""
    from caffeq.__main__ import main
    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    got = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, got.out, got.err)


def test_budget_reads_the_data_as_sensitivity_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = ("--data", DIGITS / "test_lmdb", *PREPROCESS)
    ok(_cli(capsys, "sensitivity", DIGITS / "deploy.prototxt", "--budget", "1", "--no-cumulative",
            "--workers", "0", "--device", "cpu", "--json", "s.json", *data))
    sens = json.loads((tmp_path / "s.json").read_text())
    assert sens["fp32"] > 0.9             # the preprocessing flags took effect (a raw LMDB scores ~10%)
    res = _cli(capsys, "convert", DIGITS / "deploy.prototxt", "--to", "binary", "--budget", "1",
               "-o", "b.onnx", "--json", "c.json", *data)
    out = ok(res)
    conv = json.loads((tmp_path / "c.json").read_text())
    kept = conv["report"]["kept"]
    assert sorted(kept) == sorted(sens["budget"]["keep"])
    assert conv["report"]["changed"] and not set(conv["report"]["changed"]) & set(kept)
    # labelled by why they are kept: the budget, not a --keep that was never given
    assert set(kept.values()) == {"budget 1 points"}
    assert "(--keep)" not in out and "--keep none" not in out
    assert "fp32 (budget 1 points)" in out


def test_a_budget_keeping_every_layer_says_so_without_suggesting_keep_none():
    model = caffeq.load(DIGITS / "deploy.prototxt", DIGITS / "model.caffemodel")
    layers = ["conv1", "conv2", "ip1", "ip2"]
    report = quantize(model, "binary", keep=layers, keep_reason="budget 0 points").quant_report
    assert report.kept == {n: "budget 0 points" for n in layers} and not report.changed
    assert report.notes == ["every weighted layer was kept fp32 (budget 0 points): nothing was binarized"]
    report = quantize(model, "binary", keep=layers).quant_report
    assert report.notes == ["every weighted layer was kept fp32: --keep names them all"]


def test_calibration_items_of_the_wrong_size_are_explained_as_in_eval(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(_cli(capsys, "convert", DIGITS / "deploy.prototxt", "--to", "int8", "--calibrate",
                               DIGITS / "train_lmdb", "--resize", "10"),
                          "items are 1x10x10 after preprocessing", "input 'data' takes 1x16x16", "--resize")
    assert "no readable items" not in line
    assert os.listdir(tmp_path) == []


def test_a_file_format_given_to_to_points_to_o(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for fmt, ext in (("onnx", ".onnx"), ("caffemodel", ".caffemodel"), ("caffeq", ".caffeq")):
        one_line_error(_cli(capsys, "convert", DIGITS / "deploy.prototxt", "--to", fmt),
                       "file format", "-o's extension", f"-o model{ext}", "--format")
    one_line_error(_cli(capsys, "convert", DIGITS / "deploy.prototxt", "--to", "pytorch"), "--format pytorch")
    one_line_error(_cli(capsys, "convert", DIGITS / "deploy.prototxt", "--to", "bnary"), "did you mean binary?")
    assert os.listdir(tmp_path) == []


def test_conflicting_or_ignored_options_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for args, needles in (
            (("--batch", "2", "--onnx-batch", "3"), ("--batch 2", "--onnx-batch 3", "disagree")),
            (("--batch", "dynamic", "--onnx-batch", "3"), ("--onnx-batch 3",)),
            (("--to", "fp32", "--keep", "conv1"), ("--keep", "--to fp32")),
            (("--keep", "conv1"), ("--keep", "without --to")),
            (("--to", "fp32", "--only", "conv1"), ("--only", "--to fp32")),
            (("--to", "int8", "--exact-batchnorm"), ("--exact-batchnorm", "--format pytorch")),
            (("--to", "int8", "--data", DIGITS / "test_lmdb"), ("--data", "--budget")),
            *(((("--to", "int8", flag, value)), (flag, "--calibrate", "--budget"))
              for flag, value in (("--mean-file", DIGITS / "mean.binaryproto"), ("--mean-value", "128"),
                                  ("--scale", "0.5"), ("--crop-size", "12"), ("--resize", "16x16"),
                                  ("--channel-order", "RGB")))):
        one_line_error(_cli(capsys, "convert", DIGITS / "deploy.prototxt", *args), *needles)
        assert os.listdir(tmp_path) == [], args
    # agreeing values, and --onnx-batch dynamic with --batch (as the help says), still work
    import onnx
    ok(_cli(capsys, "convert", DIGITS / "deploy.prototxt", "--batch", "2", "--onnx-batch", "2", "-o", "a.onnx"))
    assert onnx.load("a.onnx").graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2
    ok(_cli(capsys, "convert", DIGITS / "deploy.prototxt", "--batch", "2", "--onnx-batch", "dynamic",
            "-o", "b.onnx"))


def _finetune_hint(out):
    line = next(ln for ln in out.splitlines() if "recover accuracy with" in ln)
    return line.split("`")[1]


@pytest.mark.slow
def test_the_finetune_hint_runs_as_printed(tmp_path, monkeypatch, capsys):
    import shlex
    monkeypatch.chdir(tmp_path)
    hint = _finetune_hint(ok(_cli(capsys, "convert", DIGITS / "deploy.prototxt", "--to", "binary", "-o", "b.onnx")))
    # the deploy net has no training data: the train_val net beside it has
    assert f"finetune {DIGITS / 'train_val.prototxt'} --weights {DIGITS / 'model.caffemodel'} --to binary" in hint
    words = shlex.split(hint)
    assert words[:2] == ["python", "cli.py"] and "..." not in words
    short = ["--iters", "1", "--limit", "8", "--val-limit", "8", "--bn-batches", "1", "--workers", "0",
             "--no-progress", "-o", "f.onnx"]
    out = ok(_cli(capsys, *words[2:], *short))
    assert "wrote" in out and (tmp_path / "f.onnx").exists()
    # a deploy net alone: placeholders for the data finetune needs
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "deploy.prototxt").write_text((DIGITS / "deploy.prototxt").read_text())
    os.symlink(DIGITS / "model.caffemodel", alone / "deploy.caffemodel")
    hint = _finetune_hint(ok(_cli(capsys, "convert", alone / "deploy.prototxt", "--to", "binary", "--keep", "none",
                                  "-o", "c.onnx")))
    assert hint.endswith("--to binary --keep none --data TRAIN_SRC --val VAL_SRC"), hint
    assert "alone/deploy.prototxt" in hint


def test_found_weights_line_on_stderr_and_warning_grammar(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    res = _cli(capsys, "convert", DIGITS / "deploy.prototxt", "--to", "int8", "-o", "m.caffeq", "--opset", "13")
    out = ok(res)
    assert "found beside" in res.stderr and "found beside" not in out      # as in inspect, run and eval
    assert "caffeq: warning: --opset only applies to .onnx output; ignored for .caffeq" in res.stderr
    res = _cli(capsys, "convert", DIGITS / "deploy.prototxt", "--to", "int8", "-o", "n.caffeq", "--opset", "13",
               "--no-optimize")
    assert "--opset, --no-optimize only apply to .onnx output" in res.stderr
