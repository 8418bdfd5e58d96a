"""The command line as one program: every mistake is one `caffeq: error:` line with exit status 2 and
no file left behind, an option means the same thing in every command, and the README's examples run
as written.

In-process (caffeq.__main__.main) wherever a subprocess is not needed: each interpreter pays
torch's import time.
"""
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

import caffeq
from caffeq.__main__ import COMMANDS, build_parser, main

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
DEPLOY, TRAIN_VAL, WEIGHTS = DIGITS / "deploy.prototxt", DIGITS / "train_val.prototxt", DIGITS / "model.caffemodel"
CONV = REPO / "tests" / "fixtures" / "caffe" / "conv_basic"
PNG_FLAGS = ["--data", DIGITS / "test_list.txt", "--mean-file", DIGITS / "mean.binaryproto", "--scale", "0.00390625"]


def cli(capsys, *args):
    """main(args) in this process -> (exit status, stdout, stderr); --help/--version exit through SystemExit."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_error(capsys, *args):
    """The command must fail with exit 2 and exactly one `caffeq: error:` line (warnings aside)."""
    rc, out, err = cli(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("caffeq: warning", "weights: "))]
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("caffeq: error: "), err
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


def digits_inputs(path, n=3):
    np.save(path, np.random.default_rng(0).uniform(0, 1, (n, 1, 16, 16)).astype(np.float32))
    return path


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---- output paths: checked before any work ---------------------------------------------------

def test_output_that_is_a_folder_is_one_error_before_any_work(here, capsys, monkeypatch):
    (here / "d").mkdir()
    x = digits_inputs(here / "x.npy")
    # eval used to fail only after the whole evaluation: now nothing is evaluated
    import importlib
    ev = importlib.import_module("caffeq.evaluate")   # (caffeq.evaluate is also the function)

    def no_evaluation(*a, **k):
        raise AssertionError("evaluated before checking --json")
    monkeypatch.setattr(ev, "evaluate", no_evaluation)
    cases = [
        ["run", DEPLOY, "-i", x, "-o", "d"],
        ["upgrade", DEPLOY, "-o", "d"],
        ["inspect", DEPLOY, "--json", "d"],
        ["eval", DEPLOY, *PNG_FLAGS, "--json", "d"],
        ["convert", DEPLOY, "--to", "int8", "-o", "d"],
        ["convert", DEPLOY, "--to", "int8", "-o", "new/"],
        ["sensitivity", TRAIN_VAL, "--json", "d"],
        ["finetune", TRAIN_VAL, "--bn-only", "--json", "d", "-o", "o.onnx"],
    ]
    for args in cases:
        line = one_error(capsys, *args)
        assert "is a folder" in line, (args, line)
    assert sorted(os.listdir(here)) == ["d", "x.npy"]


def test_missing_output_folders_are_created_by_every_command(here, capsys):
    x = digits_inputs(here / "x.npy")
    assert cli(capsys, "run", DEPLOY, "-i", x, "-o", "a/b/out.npz")[0] == 0
    assert cli(capsys, "inspect", DEPLOY, "--json", "c/s.json")[0] == 0
    assert cli(capsys, "upgrade", DEPLOY, "-o", "e/f/new.prototxt")[0] == 0
    assert cli(capsys, "convert", DEPLOY, "--to", "int8", "-o", "g/m.caffeq")[0] == 0
    for p in ("a/b/out.npz", "c/s.json", "e/f/new.prototxt", "g/m.caffeq"):
        assert (here / p).is_file(), p
    assert json.loads((here / "c/s.json").read_text())["totals"]["params"] > 0


def test_failed_command_leaves_no_file_and_no_folder(here, capsys):
    bad = here / "x.npy"
    bad.write_bytes(b"not numpy")
    one_error(capsys, "run", DEPLOY, "-i", bad, "-o", "new/sub/out.npz")
    assert sorted(os.listdir(here)) == ["x.npy"]


def test_output_under_a_file_is_refused(here, capsys):
    (here / "f").write_text("")
    assert "is a file" in one_error(capsys, "inspect", DEPLOY, "--json", "f/s.json")


# ---- one device parser -----------------------------------------------------------------------

@pytest.mark.parametrize("command", [["run", DEPLOY, "-i", "x.npy", "-o", "o.npz"], ["eval", DEPLOY],
                                     ["sensitivity", TRAIN_VAL], ["finetune", TRAIN_VAL]])
def test_device_gpu_is_one_error_suggesting_cuda(here, capsys, command):
    line = one_error(capsys, *command, "--device", "gpu")
    assert "--device" in line and "did you mean cuda?" in line
    assert os.listdir(here) == []


def test_device_values(monkeypatch):
    import argparse

    import torch

    from caffeq.commands.options import device
    assert device("cpu") == "cpu" and device("AUTO") == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(argparse.ArgumentTypeError, match="no CUDA device"):
        device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device("cuda") == "cuda" and device("cuda:1") == "cuda:1"
    with pytest.raises(argparse.ArgumentTypeError, match="2 CUDA device"):
        device("cuda:2")
    with pytest.raises(argparse.ArgumentTypeError, match="cpu, cuda, cuda:N or auto"):
        device("tpu")


def test_cuda_asked_for_and_absent_is_one_error(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device" in one_error(capsys, "eval", DEPLOY, "--device", "cuda")


# ---- values and inputs --------------------------------------------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["eval", DEPLOY, "--batch-size", "0"], "--batch-size"),
    (["run", DEPLOY, "-i", "x.npy", "-o", "o.npz", "--batch-size", "-1"], "--batch-size"),
    (["inspect", DEPLOY, "--batch", "0"], "--batch"),
    (["eval", DEPLOY, "--limit", "0"], "--limit"),
    (["eval", DEPLOY, "--workers", "-2"], "--workers"),
    (["sensitivity", TRAIN_VAL, "--limit", "x"], "--limit"),
    (["finetune", TRAIN_VAL, "--epochs", "-1"], "--epochs"),
    (["finetune", TRAIN_VAL, "--val-limit", "0"], "--val-limit"),
    (["eval", DEPLOY, "--scale", "nan"], "--scale"),
])
def test_counts_must_be_positive(here, capsys, args, flag):
    assert flag in one_error(capsys, *args)


def test_eval_of_an_empty_array_file(here, capsys):
    np.save(here / "empty.npy", np.zeros((0, 1, 16, 16), np.float32))
    assert "no items" in one_error(capsys, "eval", DEPLOY, "--data", here / "empty.npy")


def test_inspect_of_an_empty_prototxt_names_the_file(here, capsys):
    (here / "empty.prototxt").write_text("# nothing here\n")
    assert "empty.prototxt" in one_error(capsys, "inspect", here / "empty.prototxt")


def test_argparse_errors_are_one_line_with_suggestions(capsys):
    line = one_error(capsys, "convert", DEPLOY, "--to", "int4")
    assert "int4" in line and "did you mean int8?" in line
    assert "did you mean eval?" in one_error(capsys, "evl", DEPLOY)
    assert "did you mean --workers?" in one_error(capsys, "eval", DEPLOY, "--wrokers", "2")
    assert "required" in one_error(capsys, "run", DEPLOY)          # -i and -o missing
    assert "did you mean Convolution?" in one_error(capsys, "inspect", _typo_net(capsys))



@pytest.mark.parametrize("args, needles", [
    (["eval", TRAIN_VAL, "--to", "fp16,int4"], ("int4", "did you mean int8?")),
    (["sensitivity", TRAIN_VAL, "--to", "int4"], ("int4", "did you mean int8?")),
    (["finetune", TRAIN_VAL, "--lr", "abc"], ("--lr", "abc")),
    (["finetune", TRAIN_VAL, "--lr", "0"], ("--lr",)),
    (["finetune", TRAIN_VAL, "--optimizer", "rmsprop"], ("--optimizer", "adam")),
    (["finetune", TRAIN_VAL, "--schedule", "linear"], ("--schedule", "cosine")),
    (["finetune", TRAIN_VAL, "--momentum", "-1"], ("--momentum",)),
    (["finetune", TRAIN_VAL, "--bn-only", "--no-bn-reestimate"], ("--bn-only", "--no-bn-reestimate")),
    (["finetune", TRAIN_VAL, "--bn-only", "--epochs", "3"], ("--bn-only", "--epochs")),
    (["inspect", DEPLOY, "--input-shape", "data=2,x,16,16"], ("--input-shape", "'x'")),
    (["inspect", DEPLOY, "--input-shape", "data=1,1,16,16,"], ("--input-shape",)),
    (["eval", TRAIN_VAL, "--outputs", "nosuch"], ("--outputs", "nosuch")),
    (["eval", TRAIN_VAL, "--outputs", "ip1,ip2"], ("--outputs", "one blob")),
    (["inspect", "--json", DEPLOY], ("--json", "put the model before --json")),
    (["convert", DEPLOY, "--json", "out.onnx"], ("--json", "out.onnx")),
])
def test_values_are_checked_before_any_work(here, capsys, args, needles):
    line = one_error(capsys, *args)
    for n in needles:
        assert n in line, (n, line)
    assert os.listdir(here) == []


def test_eval_outputs_names_the_score_blob(capsys):
    # the same option as in every command: here the output that is scored
    base = ["eval", TRAIN_VAL, "--limit", "40", "--no-progress", "--json", "-", "--workers", "0"]
    by_default = json.loads(cli(capsys, *base)[1])
    named = json.loads(cli(capsys, *base, "--outputs", "ip2")[1])
    assert by_default["score_blob"] == named["score_blob"] == "ip2"
    assert by_default["results"]["fp32"]["top1"] == named["results"]["fp32"]["top1"]
    pooled = json.loads(cli(capsys, *base, "--outputs", "ip1")[1])      # not the class scores
    assert pooled["score_blob"] == "ip1"
    assert pooled["results"]["fp32"]["top1"] < named["results"]["fp32"]["top1"]


def test_array_files_that_are_not_arrays(here, capsys):
    (here / "garbage.npy").write_bytes(b"\x00not numpy at all" * 10)
    line = one_error(capsys, "run", DEPLOY, "-i", here / "garbage.npy", "-o", here / "o.npz")
    assert "no .npy header" in line and "pickle" not in line
    (here / "adir").mkdir()
    line = one_error(capsys, "run", DEPLOY, "-i", here / "adir", "-o", here / "o.npz")
    assert "is a folder" in line and "Errno" not in line
    assert sorted(os.listdir(here)) == ["adir", "garbage.npy"]



@pytest.mark.parametrize("args, needles", [
    (["upgrade", ".", "-o", "new.prototxt"], ("is a folder",)),
    (["upgrade", DEPLOY, "-o", "new.caffemodel"], ("-o", "--weights-out")),
    (["upgrade", DEPLOY, "-o", "n.prototxt", "--weights", WEIGHTS, "--weights-out", "w.prototxt"], ("--weights-out",)),
    (["inspect", WEIGHTS], ("holds the weights", "--weights")),
    (["inspect", DEPLOY, "--batch", "4", "--input-shape", "data=2,1,16,16"], ("--batch 4", "disagree")),
    (["run", DEPLOY, "--keep", "conv1", "-i", "x.npy", "-o", "o.npz"], ("--keep", "--to")),
    (["run", DEPLOY, "--batch", "1", "-i", "x.npy", "-o", "o.npz"], ("holds 3 items", "1")),
    (["run", DEPLOY, "--input-shape", "data=5,1,16,16", "-i", "x.npy", "-o", "o.npz"], ("holds 3 items", "5")),
])
def test_conflicting_or_misplaced_arguments(here, capsys, args, needles):
    digits_inputs(here / "x.npy")
    line = one_error(capsys, *args)
    for n in needles:
        assert n in line, (n, line)
    assert os.listdir(here) == ["x.npy"]


def test_upgrade_of_an_empty_prototxt_writes_nothing(here, capsys):
    (here / "empty.prototxt").write_text("")
    assert "no layers" in one_error(capsys, "upgrade", "empty.prototxt", "-o", "new.prototxt")
    assert os.listdir(here) == ["empty.prototxt"]


def test_inspect_without_the_dataset_says_the_parameters_are_unknown(capsys):
    lenet = REPO / "tests/fixtures/realworld/BVLC__caffe__examples__mnist__lenet_train_test.prototxt"
    rc, out, err = cli(capsys, "inspect", lenet)
    assert rc == 0, err
    total = out.strip().splitlines()[-1]
    assert "0 parameters" not in total and "unknown" in total and "--input-shape" in total
    rc, out, err = cli(capsys, "inspect", lenet, "--input-shape", "data=1,1,28,28", "--json", "-")
    assert rc == 0, err
    summary = json.loads(out)
    # LeNet: conv 20x1x5x5+20, conv 50x20x5x5+50, ip 500x800+500, ip 10x500+10
    assert summary["totals"]["params"] == 520 + 25050 + 400500 + 5010
    assert summary["totals"]["layers_with_unknown_params"] == []
    assert "total: 10 layers, 431,080 parameters" in err      # the text report goes to stderr


def test_suggestions_read_both_argparse_choice_formats():
    from caffeq.commands.options import CliParser
    p = CliParser(prog="caffeq convert")
    for message in ("argument --to: invalid choice: 'int4' (choose from 'fp32', 'fp16', 'int8', 'binary')",
                    "argument --to: invalid choice: 'int4' (choose from fp32, fp16, int8, binary)"):
        assert p._suggestion(message) == "; did you mean int8?"


def _typo_net(capsys):
    import tempfile
    folder = tempfile.mkdtemp()
    p = Path(folder) / "typo.prototxt"
    p.write_text('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 4 '
                 'dim: 4 } } }\nlayer { name: "c" type: "Convoluton" bottom: "data" top: "c" }\n')
    return p


def test_version(capsys):
    rc, out, _ = cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"caffeq {caffeq.__version__}"


# ---- weights beside the prototxt ---------------------------------------------------------------

def test_run_eval_inspect_find_the_caffemodel_beside_the_prototxt(here, capsys):
    x = digits_inputs(here / "x.npy")
    rc, out, err = cli(capsys, "run", DEPLOY, "-i", x, "-o", "o.npz")
    assert rc == 0 and "weights: " in err and "model.caffemodel" in err and "found beside" in err
    ref = caffeq.load(DEPLOY, WEIGHTS).run(np.load(x))["prob"]
    np.testing.assert_array_equal(np.load("o.npz")["prob"], ref)
    rc, out, err = cli(capsys, "inspect", DEPLOY, "--json")
    assert rc == 0 and all(L["weights_loaded"] in (True, None) for L in json.loads(out)["layers"])
    assert "found beside" in err
    rc, out, err = cli(capsys, "eval", DEPLOY, *PNG_FLAGS, "--limit", "8", "--workers", "0")
    assert rc == 0 and "found beside" in err and "fp32" in out


def test_no_caffemodel_anywhere_asks_for_weights_not_a_python_argument(here, capsys):
    shutil.copy(CONV / "model.prototxt", here / "deploy.prototxt")
    np.save(here / "x.npy", np.zeros((2, 3, 11, 13), np.float32))
    for args in (["run", "deploy.prototxt", "-i", "x.npy", "-o", "o.npz"], ["eval", "deploy.prototxt"]):
        line = one_error(capsys, *args)
        assert "--weights" in line and "random_weights" not in line
    rc, out, _ = cli(capsys, "inspect", "deploy.prototxt")     # shapes need no weights
    assert rc == 0 and "conv" in out
    # another net's caffemodel alone in the folder: inspect warns and shows the shapes; run refuses
    shutil.copy(WEIGHTS, here / "other.caffemodel")
    rc, out, err = cli(capsys, "inspect", "deploy.prototxt")
    assert rc == 0 and "conv" in out and "other.caffemodel" in err and "without weights" in err
    assert "other.caffemodel" in one_error(capsys, "run", "deploy.prototxt", "-i", "x.npy", "-o", "o.npz")
    # two caffemodels and none of the prototxt's name: inspect lists the net, run asks which one
    shutil.copy(WEIGHTS, here / "another.caffemodel")
    rc, out, err = cli(capsys, "inspect", "deploy.prototxt")
    assert rc == 0 and "conv" in out and "2 .caffemodel files" in err and "without weights" in err
    line = one_error(capsys, "run", "deploy.prototxt", "-i", "x.npy", "-o", "o.npz")
    assert "another.caffemodel, other.caffemodel" in line and "--weights" in line


# ---- labels by the real precision ----------------------------------------------------------------

def test_quantized_models_are_labelled_by_their_precision(here, capsys):
    model = caffeq.load(DEPLOY, WEIGHTS)
    binary = caffeq.quantize(model, "binary")
    transform = {"mean_file": str(DIGITS / "mean.binaryproto"), "scale": 0.00390625}
    r = caffeq.evaluate(binary, data=str(DIGITS / "test_list.txt"), transform=transform, limit=16, workers=0)
    assert r["targets"] == ["binary"] and list(r["results"]) == ["binary"]
    with pytest.raises(caffeq.CaffeqError, match="already binary"):
        caffeq.evaluate(binary, data=str(DIGITS / "test_list.txt"), transform=transform, limit=4,
                        targets="fp32,int8")
    # the same through the CLI, from a .caffeq file
    assert cli(capsys, "convert", DEPLOY, "--to", "binary", "-o", "b.caffeq")[0] == 0
    rc, out, err = cli(capsys, "eval", "b.caffeq", *PNG_FLAGS, "--limit", "16", "--workers", "0", "--json")
    assert rc == 0, err
    r2 = json.loads(out)
    assert list(r2["results"]) == ["binary"]
    assert r2["results"]["binary"]["top1"] == r["results"]["binary"]["top1"]
    assert re.search(r"^binary\s", err, re.MULTILINE) and not re.search(r"^fp32\s", err, re.MULTILINE)


# ---- written prototxts and .caffeq files find their data -----------------------------------------

def test_written_prototxt_resolves_data_relative_to_its_own_folder(here, capsys):
    shutil.copytree(DIGITS, here / "digits")
    rc, out, err = cli(capsys, "convert", "digits/train_val.prototxt", "--to", "int8", "-o", "out/sub/tv.caffemodel")
    assert rc == 0, err
    text = (here / "out/sub/tv.prototxt").read_text()
    assert re.findall(r'source: "([^"]+)"', text) == ["../../digits/train_lmdb", "../../digits/test_lmdb"]
    assert 'mean_file: "../../digits/mean.binaryproto"' in text
    # from another working folder, eval and inspect read the written pair
    os.chdir(here / "out")
    rc, out, err = cli(capsys, "eval", "sub/tv.prototxt", "--limit", "10", "--workers", "0")
    assert rc == 0 and "10 images" in out, err
    assert cli(capsys, "inspect", "sub/tv.prototxt")[0] == 0
    # the repository's data, seen from the test's folder: absolute paths when only / is in common
    # (they read from anywhere), else relative to the written file (a checkout under /tmp, say)
    rc, out, err = cli(capsys, "convert", TRAIN_VAL, "--to", "int8", "-o", "far.caffemodel")
    assert rc == 0, err
    sources = re.findall(r'source: "([^"]+)"', (here / "out/far.prototxt").read_text())
    want = [str(DIGITS / "train_lmdb"), str(DIGITS / "test_lmdb")]
    if _only_root_in_common(DIGITS, here):
        assert sources == want
    else:
        assert [os.path.normpath(os.path.join(here / "out", s)) for s in sources] == want


def _only_root_in_common(a, b):
    common = os.path.commonpath([os.path.realpath(a), os.path.realpath(b)])
    return os.path.dirname(common) == common


def test_rebase_data_paths_fields(tmp_path):
    from caffeq.io.prototxt import parse_prototxt_text
    from caffeq.io.writer import rebase_data_paths
    (tmp_path / "a" / "imgs").mkdir(parents=True)
    net = parse_prototxt_text(
        'layer { name: "d" type: "ImageData" top: "d" top: "l" transform_param { mean_file: "m.binaryproto" } '
        'image_data_param { source: "list.txt" root_folder: "imgs/" } }\n'
        'layer { name: "h" type: "HDF5Data" top: "x" hdf5_data_param { source: "/abs/h5.txt" } }\n')
    out = rebase_data_paths(net, tmp_path / "a", tmp_path / "b" / "c")
    d, h = out.layer
    assert d.image_data_param.source == "../../a/list.txt"
    assert d.image_data_param.root_folder == "../../a/imgs/"       # still a prefix: the slash stays
    assert d.transform_param.mean_file == "../../a/m.binaryproto"
    assert h.hdf5_data_param.source == "/abs/h5.txt"                 # absolute paths are kept
    assert net.layer[0].image_data_param.source == "list.txt"       # the input net is untouched
    assert rebase_data_paths(net, tmp_path / "a", tmp_path / "a") is net


def test_finetune_output_elsewhere_keeps_its_data(here, capsys):
    rc, _, err = cli(capsys, "finetune", TRAIN_VAL, "--bn-only", "--bn-batches", "1", "--limit", "64",
                     "--val-limit", "20", "--no-progress", "-o", "ft/ft.caffemodel")
    assert rc == 0, err
    rc, out, err = cli(capsys, "eval", "ft/ft.prototxt", "--limit", "10", "--workers", "0")
    assert rc == 0 and "10 images" in out, err


def test_caffeq_file_stores_no_local_path(here, capsys):
    shutil.copytree(DIGITS, here / "digits")
    assert cli(capsys, "convert", "digits/train_val.prototxt", "--to", "binary", "-o", "c/tv.caffeq")[0] == 0
    from caffeq.io.container import read_caffeq
    meta = read_caffeq(str(here / "c/tv.caffeq"))[0]
    assert "source_dir" not in meta and str(here) not in json.dumps(meta)
    assert 'source: "../digits/test_lmdb"' in meta["prototxt"]
    os.chdir(here / "c")
    rc, out, err = cli(capsys, "eval", "tv.caffeq", "--limit", "10", "--workers", "0")
    assert rc == 0 and "binary" in out, err
    # the repository's data: relative to the file when the trees share a folder, else the paths
    # stay as the prototxt wrote them; never a local absolute path
    assert cli(capsys, "convert", TRAIN_VAL, "--to", "binary", "-o", "far.caffeq")[0] == 0
    meta = read_caffeq(str(here / "c/far.caffeq"))[0]
    assert str(REPO) not in json.dumps(meta)
    sources = re.findall(r'source: "([^"]+)"', meta["prototxt"])
    if _only_root_in_common(DIGITS, here):
        assert sources == ["train_lmdb", "test_lmdb"]
    else:
        assert [os.path.normpath(os.path.join(here / "c", s)) for s in sources] == \
            [str(DIGITS / "train_lmdb"), str(DIGITS / "test_lmdb")]


# ---- one meaning per option ---------------------------------------------------------------------

def _actions(name):
    parser, _ = build_parser()
    return {a.dest: a for a in parser.subcommands[name]._actions}


def test_json_takes_an_optional_file_in_every_command_with_results():
    for name in ("inspect", "convert", "eval", "finetune", "sensitivity"):
        a = _actions(name)["json"]
        assert a.nargs == "?" and a.const == "-", name


def test_shared_options_have_one_default():
    from caffeq.commands.options import default_workers
    for name in ("eval", "finetune", "sensitivity"):
        assert _actions(name)["workers"].default == "auto"
    parser, _ = build_parser()
    for name in ("eval", "finetune", "sensitivity"):
        assert parser.parse_args([name, "m.prototxt"]).workers == default_workers()
    for name in COMMANDS:
        acts = _actions(name)
        if "batch" in acts:
            assert "batch dimension of the net's inputs" in acts["batch"].help, name


def test_eval_json_to_stdout_without_a_file_name(capsys):
    rc, out, err = cli(capsys, "eval", DEPLOY, *PNG_FLAGS, "--limit", "8", "--workers", "0", "--json")
    assert rc == 0 and json.loads(out)["results"]["fp32"]["images"] == 8
    assert "top-1" in err          # the table moves to stderr


def test_convert_batch_is_the_input_batch(here, capsys):
    import onnx
    # (--no-optimize: the ONNX optimizer currently drops a fixed batch, a bug of the exporter)
    assert cli(capsys, "convert", DEPLOY, "--batch", "3", "--no-optimize", "-o", "a.onnx")[0] == 0
    assert onnx.load("a.onnx").graph.input[0].type.tensor_type.shape.dim[0].dim_value == 3
    assert cli(capsys, "convert", DEPLOY, "--batch", "3", "--onnx-batch", "dynamic", "-o", "b.onnx")[0] == 0
    assert onnx.load("b.onnx").graph.input[0].type.tensor_type.shape.dim[0].dim_param
    rc, out, err = cli(capsys, "convert", DEPLOY, "--batch", "dynamic", "-o", "c.onnx")   # the old spelling
    assert rc == 0 and "--onnx-batch" in err
    assert onnx.load("c.onnx").graph.input[0].type.tensor_type.shape.dim[0].dim_param
    rc, out, _ = cli(capsys, "inspect", DEPLOY, "--batch", "3", "--json")
    assert json.loads(out)["inputs"]["data"][0] == 3


# ---- progress: a terminal only ------------------------------------------------------------------

def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys):
    rc, _out, err = cli(capsys, "eval", DEPLOY, *PNG_FLAGS, "--limit", "8", "--workers", "0")
    assert rc == 0 and "img/s" not in err and "\r" not in err


def test_progress_bars_on_a_terminal(monkeypatch):
    import io
    import sys

    from caffeq import progress

    class Tty(io.StringIO):
        def isatty(self):
            return True
    fake = Tty()
    monkeypatch.setattr(sys, "stderr", fake)
    assert list(progress.tracked(range(3), "validation")) == [0, 1, 2]
    assert "validation" in fake.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert list(progress.tracked(range(3), "validation")) == [0, 1, 2]     # no terminal: no bar


def test_finetune_shows_batchnorm_and_validation_progress(here, capsys, monkeypatch):
    from caffeq import progress
    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: True)
    rc, _out, err = cli(capsys, "finetune", TRAIN_VAL, "--bn-only", "--bn-batches", "1", "--limit", "64",
                       "--val-limit", "20", "-o", "ft.onnx")
    assert rc == 0, err
    assert "BatchNorm statistics" in err and "validation" in err


def test_inspect_prints_warnings_once(here, capsys):
    p = here / "u.prototxt"
    p.write_text((CONV / "model.prototxt").read_text().replace("kernel_size: 3", "kernel_size: 3 kernal_pad: 1", 1))
    rc, out, err = cli(capsys, "inspect", p, "--weights", CONV / "model.caffemodel", "--ignore-unknown")
    assert rc == 0 and (out + err).count("kernal_pad") == 1


# ---- reports --------------------------------------------------------------------------------------

def test_convert_report_columns_and_units(here, capsys):
    rc, out, _ = cli(capsys, "convert", DEPLOY, "--to", "binary", "-o", "b.onnx")
    assert rc == 0
    total = next(ln for ln in out.splitlines() if ln.startswith("total "))
    assert total.split()[-1] == "-"                 # the error column holds no size ratio
    assert "x smaller" in out and "KB" not in out and "MiB" not in out
    rc, out, _ = cli(capsys, "convert", DEPLOY, "--to", "binary", "-o", "b.caffemodel")
    assert rc == 0 and "x1.00" not in out and "1.00x" not in out and "float32 weights" in out


def test_one_unit_and_count_style(capsys, here):
    rc, out, _ = cli(capsys, "inspect", DEPLOY)
    assert rc == 0 and "38,428 parameters" in out and " kB as fp32" in out
    rc, out, _ = cli(capsys, "convert", DEPLOY, "--format", "pytorch", "-o", "pt/")
    assert rc == 0 and re.search(r"\d{2},\d{3} values", out)
    rc, out, _ = cli(capsys, "eval", DEPLOY, *PNG_FLAGS, "--limit", "8", "--workers", "0", "--to", "fp32,binary")
    assert rc == 0 and " kB" in out and "KB" not in out


# ---- the README's examples, exactly as written --------------------------------------------------

README = (REPO / "README.md").read_text()


def readme_commands():
    """Every `python cli.py ...` command of the README's ```bash blocks (set-up steps aside)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.DOTALL):
        for line in block.replace("\\\n", " ").strip().splitlines():   # continued lines are one command
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("python cli.py "):
                    commands.append(part)
    return commands


SLOW = ("finetune", "sensitivity")     # minutes on 2 cores


def test_readme_has_runnable_examples():
    cmds = readme_commands()
    assert any(" eval " in c and "test_list.txt" in c for c in cmds)   # the PNG-list example
    assert len(cmds) >= 5


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c.split()[2] in SLOW else c
                                     for c in readme_commands()])
def test_readme_example_runs_as_written(command, tmp_path, monkeypatch, capsys):
    # a copy of what the examples read, so that their outputs land in the copy
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command)[2:]
    rc, _out, err = cli(capsys, *argv)
    assert rc == 0, (command, err[-2000:])
    assert "Traceback" not in err


# ---- --input-shape and --outputs (every command that reads a model) -------------------------

MNIST_LIKE = """name: "mnist_like"
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { scale: 0.00390625 } data_param { source: "gone_lmdb" batch_size: 64 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip" type: "InnerProduct" bottom: "conv1" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_inspect_lists_a_train_val_net_without_its_dataset(capsys, here):
    (here / "tv.prototxt").write_text(MNIST_LIKE)
    rc, out, err = cli(capsys, "inspect", "tv.prototxt")
    assert rc == 0 and "inputs data ?, label ?" in out and "--input-shape data=N,C,H,W" in err
    rc, out, err = cli(capsys, "inspect", "tv.prototxt", "--input-shape", "data=2,1,12,12", "--json")
    summary = json.loads(out)
    assert summary["inputs"] == {"data": [2, 1, 12, 12], "label": [2]}
    assert next(L for L in summary["layers"] if L["name"] == "ip")["output_shapes"] == {"ip": [2, 10]}


def test_run_and_convert_need_the_shape_and_take_input_shape(capsys, here):
    (here / "tv.prototxt").write_text(MNIST_LIKE)
    m = caffeq.load(here / "tv.prototxt", input_shapes={"data": (2, 1, 12, 12)}, random_weights=True)
    from caffeq.io.writer import write_model_caffemodel
    write_model_caffemodel(m, here / "tv.caffemodel")
    line = one_error(capsys, "convert", "tv.prototxt", "-o", "m.onnx")
    assert "--input-shape data=N,C,H,W" in line and not (here / "m.onnx").exists()
    assert one_error(capsys, "inspect", "tv.prototxt", "--input-shape", "data=2,a").startswith(
        "caffeq: error: inspect: argument --input-shape: 'data=2,a': dimension 'a' is not an integer")
    rc, out, err = cli(capsys, "convert", "tv.prototxt", "--input-shape", "data=2,1,12,12", "--outputs", "conv1",
                       "-o", "m.onnx")
    assert rc == 0, err
    import onnxruntime as ort
    sess = ort.InferenceSession(str(here / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["conv1"]
    x = np.random.default_rng(1).standard_normal((2, 1, 12, 12)).astype(np.float32)
    want = m.run({"data": x, "label": np.zeros(2, np.float32)}, all_blobs=True)["conv1"]
    np.testing.assert_allclose(sess.run(None, {"data": x})[0], want, rtol=1e-5, atol=1e-5)
    np.save(here / "x.npy", x)
    rc, out, err = cli(capsys, "run", "tv.prototxt", "--input-shape", "data=2,1,12,12", "--outputs", "conv1",
                       "--input", "x.npy", "-o", "out.npz")
    assert rc == 0, err
    with np.load(here / "out.npz") as z:
        assert list(z) == ["conv1"]
        np.testing.assert_allclose(z["conv1"], want, rtol=1e-5, atol=1e-5)


def test_inspect_reads_a_net_whole_only_under_another_phase(capsys, here):
    (here / "train.prototxt").write_text(MNIST_LIKE.replace("phase: TEST", "phase: TRAIN"))
    rc, out, err = cli(capsys, "inspect", "train.prototxt", "--input-shape", "data=2,1,12,12")
    assert rc == 0 and "showing the net as --phase TRAIN" in err and "ip" in out
    # commands that run or export the net do not guess: they name the rule
    with pytest.raises(caffeq.CaffeqError, match=r"only under include \{ phase: TRAIN \}.*--phase/--stage"):
        caffeq.load(here / "train.prototxt", input_shapes={"data": (2, 1, 12, 12)})


LRCN_LIKE = """name: "lrcn"
layer { name: "data" type: "Input" top: "data" top: "label" include { phase: TEST stage: "test-on-train" }
  input_param { shape { dim: 2 dim: 6 } shape { dim: 2 } } }
layer { name: "fc_a" type: "InnerProduct" bottom: "data" top: "h" include { stage: "unfactored" }
  inner_product_param { num_output: 4 } }
layer { name: "fc_b" type: "InnerProduct" bottom: "data" top: "h" include { stage: "factored" }
  inner_product_param { num_output: 3 } }
layer { name: "predict" type: "InnerProduct" bottom: "h" top: "predict" inner_product_param { num_output: 2 } }
layer { name: "silence" type: "Silence" bottom: "label" }
"""


def test_inspect_follows_the_rules_one_after_another(capsys, here):
    # BVLC's LRCN nets: whole only under a stage ("unfactored"), whose data comes only under another
    (here / "lrcn.prototxt").write_text(LRCN_LIKE)
    rc, out, err = cli(capsys, "inspect", "lrcn.prototxt")
    assert rc == 0, err
    assert err.count("caffeq: note:") == 2 and "--stage unfactored --stage test-on-train" in err
    assert "fc_a" in out and "fc_b" not in out        # the first layer that makes h names its stage
