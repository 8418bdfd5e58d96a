"""Per-layer sensitivity to binary weights and the budget rule."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import one_error_line

import caffeq
from caffeq.__main__ import main
from caffeq.sensitivity import (
    SensitivityError,
    choose_keep,
    estimated_drop,
    layer_sensitivity,
)

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
TRAIN_VAL = str(DIGITS / "train_val.prototxt")
WEIGHTS = str(DIGITS / "model.caffemodel")

# drops in points of top-1; "d" improves when quantized alone (counts as 0 in the estimate)
TABLE = {"a": 5.0, "b": 0.5, "c": 2.0, "d": -0.3, "e": 1.0}


# ---- the budget rule on a constructed table -----------------------------------------------------

@pytest.mark.parametrize("budget, keep", [
    (100.0, []),               # 8.5 points in all fit
    (8.5, []),
    (8.4, ["a"]),              # 3.5 left
    (4.0, ["a"]),
    (3.4, ["a", "c"]),         # 1.5 left
    (1.5, ["a", "c"]),
    (1.0, ["a", "c", "e"]),    # 0.5 left
    (0.5, ["a", "c", "e"]),
    (0.4, ["a", "c", "e", "b"]),
    (0.0, ["a", "c", "e", "b"]),   # d never needs keeping: its drop counts as 0
])
def test_budget_rule_keeps_the_fewest_most_sensitive_layers(budget, keep):
    assert choose_keep(TABLE, budget) == keep
    assert estimated_drop(TABLE, keep) <= budget + 1e-9
    if keep:   # one layer fewer would not fit
        assert estimated_drop(TABLE, keep[:-1]) > budget


def test_budget_rule_accepts_rows_and_results_and_breaks_ties_in_table_order():
    rows = [{"layer": "x", "drop": 1.0}, {"layer": "y", "drop": 3.0}, {"layer": "z", "drop": 1.0}]
    assert choose_keep(rows, 1.5) == ["y", "x"]
    assert choose_keep({"layers": rows, "metric": "top1"}, 1.0) == ["y", "x"]
    assert choose_keep([("p", 2.0), ("q", 2.0)], 2.0) == ["p"]
    assert estimated_drop(rows) == 5.0


@pytest.mark.parametrize("budget", [-1, float("nan"), "lots", float("inf")])
def test_bad_budget(budget):
    with pytest.raises(SensitivityError, match="--budget"):
        choose_keep(TABLE, budget)


# ---- measured on examples/digits ------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits_table():
    return layer_sensitivity(TRAIN_VAL, weights=WEIGHTS, workers=0)


@pytest.mark.slow
def test_digits_sensitivity_matches_single_layer_evaluations(digits_table):
    t = digits_table
    assert t["metric"] == "top1" and t["images"] == 400
    assert t["fp32"] == pytest.approx(0.99)                 # caffe test
    assert t["all"] == pytest.approx(0.6075)                # every layer binary (Caffe)
    assert t["default"] == pytest.approx(0.8525)            # first/last kept fp32 (Caffe)
    assert t["default_kept"] == ["conv1", "ip2"]
    drops = [r["drop"] for r in t["layers"]]
    assert drops == sorted(drops, reverse=True)
    assert sorted(r["layer"] for r in t["layers"]) == ["conv1", "conv2", "ip1", "ip2"]
    # each row equals an independent evaluation of the model with only that layer binarized
    base = caffeq.load(TRAIN_VAL, WEIGHTS)
    for row in t["layers"]:
        q = caffeq.quantize(base, "binary", only=[row["layer"]])
        top1 = caffeq.evaluate(q, workers=0)["results"]["binary"]["top1"]   # labelled by its precision
        assert row["top1"] == pytest.approx(top1), row["layer"]
        assert row["drop"] == pytest.approx(100 * (0.99 - top1)), row["layer"]
    # the cumulative curve: least sensitive first, ending with every layer binary
    curve = t["cumulative"]
    assert [c["quantized"] for c in curve] == [0, 1, 2, 3, 4]
    assert curve[-1]["layers"] == [r["layer"] for r in reversed(t["layers"])]
    assert curve[0]["top1"] == pytest.approx(0.99) and curve[-1]["top1"] == pytest.approx(0.6075)


def test_digits_budget_choice(digits_table):
    keep = choose_keep(digits_table, 1.0)
    drops = {r["layer"]: r["drop"] for r in digits_table["layers"]}
    assert estimated_drop(digits_table, keep) <= 1.0
    assert keep == [r["layer"] for r in digits_table["layers"]][:len(keep)]
    assert sum(max(d, 0) for n, d in drops.items() if n not in keep[:-1]) > 1.0


def test_unlabeled_data_uses_agreement(tmp_path):
    from caffeq.data import DataTransformer, Preprocess, open_dataset
    ds = open_dataset(str(DIGITS / "test_lmdb"), "lmdb", Preprocess(DataTransformer()))
    x = np.stack([ds[i][1] for i in range(64)]).astype(np.uint8)
    np.save(tmp_path / "x.npy", x)
    t = layer_sensitivity(str(DIGITS / "deploy.prototxt"), str(tmp_path / "x.npy"), weights=WEIGHTS,
                          transform={"mean_file": str(DIGITS / "mean.binaryproto"), "scale": 1 / 256},
                          cumulative=False)
    assert t["metric"] == "agreement_top1" and t["fp32"] == 1.0 and t["images"] == 64
    for r in t["layers"]:
        assert r["drop"] == pytest.approx(100 * (1 - r["agreement_top1"]))
    assert "cumulative" not in t


def test_what_reading_the_weights_said_is_in_the_result(tmp_path):
    """A caffemodel layer whose parameters do not parse (a fork's numbering) is kept with a warning, which the
    result carries (the command prints it)."""
    from caffeq.io.wire import encode_key, encode_varint

    def message_field(number, payload):
        return encode_key(number, 2) + encode_varint(len(payload)) + payload
    weights = tmp_path / "w.caffemodel"
    weights.write_bytes(Path(WEIGHTS).read_bytes()
                        + message_field(100, message_field(1, b"fork_ip") + message_field(100, b"\x07")))
    from caffeq.data import DataTransformer, Preprocess, open_dataset
    ds = open_dataset(str(DIGITS / "test_lmdb"), "lmdb", Preprocess(DataTransformer()))
    np.save(tmp_path / "x.npy", np.stack([ds[i][1] for i in range(8)]).astype(np.uint8))
    t = layer_sensitivity(str(DIGITS / "deploy.prototxt"), str(tmp_path / "x.npy"), weights=str(weights),
                          transform={"mean_file": str(DIGITS / "mean.binaryproto"), "scale": 1 / 256},
                          cumulative=False)
    assert any("layer 'fork_ip': its parameters do not parse" in w for w in t["warnings"])


def test_plot_writes_a_png(digits_table, tmp_path):
    from caffeq.sensitivity import plot_sensitivity
    out = tmp_path / "s.png"
    plot_sensitivity(digits_table, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(digits_table, tmp_path, monkeypatch):
    from caffeq.sensitivity import plot_sensitivity
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SensitivityError, match="matplotlib"):
        plot_sensitivity(digits_table, str(tmp_path / "s.png"))


# ---- the command line ---------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_sensitivity_subprocess(tmp_path):
    out = tmp_path / "s.json"
    cmd = [sys.executable, str(REPO / "cli.py"), "sensitivity", TRAIN_VAL, "--weights", WEIGHTS, "--to", "binary",
           "--data", str(DIGITS / "test_lmdb"), "--budget", "1.0", "--json", str(out), "--no-cumulative",
           "--no-progress"]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert next(row["layer"] for row in r["layers"]) == "conv1"
    assert r["budget"]["keep"] == choose_keep(r, 1.0)
    assert "budget 1 points: keep fp32" in p.stdout


@pytest.mark.parametrize("extra, needle", [
    (["--to", "fp16"], "int8"),
    (["--budget", "-2"], "--budget"),
    (["--plot", "s.jpg"], "PNG"),
    (["--data", "/nonexistent"], "not found"),
    (["--batch-size", "0"], "--batch-size"),
])
def test_cli_bad_inputs(capsys, extra, needle):
    assert needle in one_error_line(capsys, ["sensitivity", TRAIN_VAL, "--weights", WEIGHTS, "--no-progress"]
                                     + extra)


@pytest.mark.slow
def test_convert_budget(capsys, tmp_path, digits_table):
    out = tmp_path / "b.caffemodel"
    rc = main(["convert", TRAIN_VAL, "--weights", WEIGHTS, "--to", "binary", "--budget", "1.0", "-o", str(out)])
    assert rc == 0
    keep = choose_keep(digits_table, 1.0)
    assert f"budget 1 points: keep fp32 {', '.join(keep)}" in capsys.readouterr().out
    base = caffeq.load(TRAIN_VAL, WEIGHTS)
    back = caffeq.load(TRAIN_VAL, str(out))
    for node in back.graph.nodes:
        if node.name in ("conv1", "conv2", "ip1", "ip2"):
            same = np.array_equal(node.blobs[0], base.graph.node(node.name).blobs[0])
            assert same == (node.name in keep), node.name
    assert "--budget" in one_error_line(capsys, ["convert", TRAIN_VAL, "--weights", WEIGHTS, "--to", "binary",
                                                  "--budget", "-1", "-o", str(tmp_path / "c.onnx")])
