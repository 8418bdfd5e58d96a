"""`caffeq eval` and caffeq.evaluate: Caffe's accuracy on the digits net, robustness, JSON, torchrun."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, REPO

import caffeq
from caffeq.data.plan import parse_resize
from caffeq.errors import CaffeqError, DataError
from caffeq.evaluate import evaluate

cv2 = pytest.importorskip("cv2")
pytest.importorskip("lmdb")

DIGITS = FIXTURES / "digits_meanfile"
CASE = json.loads((DIGITS / "case.json").read_text())
TRAIN_VAL = str(DIGITS / "train_val.prototxt")
DEPLOY = str(DIGITS / "deploy.prototxt")
WEIGHTS = str(DIGITS / "model.caffemodel")
MEAN = str(DIGITS / "mean.binaryproto")
SCALE = 0.00390625          # the train_val's transform_param scale
N_TEST = CASE["test_images"]


def list_entries():
    lines = (DIGITS / "test_list.txt").read_text().split("\n")
    return [(DIGITS / p, int(lab)) for p, lab in (ln.rsplit(" ", 1) for ln in lines if ln.strip())]


def write_list(path, entries):
    path.write_text("".join(f"{p} {lab}\n" for p, lab in entries))
    return str(path)


@pytest.fixture(scope="module")
def lmdb_result():
    # the train_val net as `caffe test` runs it: its TEST Data layer, LMDB, mean file, scale
    return evaluate(TRAIN_VAL, weights=WEIGHTS, targets=("fp32",), workers=2)


def test_train_val_lmdb_matches_caffe_test(lmdb_result):
    r = lmdb_result["results"]["fp32"]
    caffe = CASE["caffe_test"]
    assert r["images"] == N_TEST == 400
    assert lmdb_result["data"]["kind"] == "lmdb" and lmdb_result["data"]["batch_size"] == 100
    assert r["top1"] == caffe["accuracy"]                 # 396 / 400, exactly
    # the net's own Accuracy/SoftmaxWithLoss layers, averaged over batches as `caffe test` does
    assert r["layers"]["accuracy"] == pytest.approx(caffe["accuracy"], abs=1e-7)
    assert r["layers"]["accuracy_top2"] == caffe["accuracy_top2"]
    assert r["layers"]["loss"] == pytest.approx(caffe["loss"], abs=5e-8)   # Caffe prints 6 digits
    assert r["top5"] == 1.0                                # top-2 is already 1.0
    assert lmdb_result["errors"]["count"] == 0 and lmdb_result["labels_out_of_range"]["count"] == 0


def test_png_list_with_deploy_and_flags_gives_the_same_accuracy():
    r = evaluate(DEPLOY, weights=WEIGHTS, data=str(DIGITS / "test_list.txt"),
                 transform={"mean_file": MEAN, "scale": SCALE}, workers=0, batch_size=64)
    assert r["data"]["kind"] == "image_list"
    assert r["results"]["fp32"]["images"] == 400
    assert r["results"]["fp32"]["top1"] == CASE["caffe_test"]["accuracy"]


def test_train_val_with_data_override_needs_no_original_source(tmp_path):
    # a train_val whose LMDB lives elsewhere: --data replaces it, the model still loads
    net = (DIGITS / "train_val.prototxt").read_text().replace('"test_lmdb"', '"/nowhere/test_lmdb"')
    (tmp_path / "train_val.prototxt").write_text(net)
    shutil.copy(MEAN, tmp_path / "mean.binaryproto")
    r = evaluate(str(tmp_path / "train_val.prototxt"), weights=WEIGHTS, data=str(DIGITS / "test_list.txt"))
    assert r["results"]["fp32"]["top1"] == CASE["caffe_test"]["accuracy"]
    assert r["results"]["fp32"]["layers"]["accuracy_top2"] == CASE["caffe_test"]["accuracy_top2"]
    with pytest.raises(DataError, match=r"layer 'data' \(Data\): source '/nowhere/test_lmdb' not found.*pass --data"):
        evaluate(str(tmp_path / "train_val.prototxt"), weights=WEIGHTS, data=None)


def test_train_val_with_imagedata_layer(tmp_path):
    # the same net fed by an ImageData layer: root_folder + path (string concatenation, as Caffe),
    # is_color false, its own batch size and transform_param
    net = (DIGITS / "train_val.prototxt").read_text()
    layer = ('layer { name: "data" type: "ImageData" top: "data" top: "label" include { phase: TEST } '
             f'transform_param {{ scale: {SCALE} mean_file: "{MEAN}" }} '
             f'image_data_param {{ source: "list.txt" root_folder: "{DIGITS}/" batch_size: 50 is_color: false }} }}')
    lines = net.split("\n")
    lines = [layer if ("phase: TEST" in ln and '"Data"' in ln) else ln for ln in lines]
    (tmp_path / "tv.prototxt").write_text("\n".join(lines))
    shutil.copy(DIGITS / "test_list.txt", tmp_path / "list.txt")
    r = evaluate(str(tmp_path / "tv.prototxt"), weights=WEIGHTS)
    assert r["data"]["kind"] == "image_list" and r["data"]["batch_size"] == 50
    assert r["results"]["fp32"]["images"] == 400
    assert r["results"]["fp32"]["top1"] == CASE["caffe_test"]["accuracy"]
    assert r["results"]["fp32"]["layers"]["accuracy_top2"] == CASE["caffe_test"]["accuracy_top2"]


def test_image_folder_and_npz_give_the_same_accuracy(tmp_path, lmdb_result):
    for p, lab in list_entries():
        os.makedirs(tmp_path / "folder" / str(lab), exist_ok=True)
        shutil.copy(p, tmp_path / "folder" / str(lab) / p.name)
    r = evaluate(DEPLOY, weights=WEIGHTS, data=str(tmp_path / "folder"), transform={"mean_file": MEAN, "scale": SCALE})
    assert r["data"]["kind"] == "image_folder"
    assert r["results"]["fp32"]["top1"] == CASE["caffe_test"]["accuracy"]
    imgs = np.stack([cv2.imread(str(p), cv2.IMREAD_GRAYSCALE)[None] for p, _ in list_entries()])
    labels = np.array([lab for _, lab in list_entries()])
    np.savez(tmp_path / "digits.npz", data=imgs, label=labels)
    r = evaluate(DEPLOY, weights=WEIGHTS, data=str(tmp_path / "digits.npz"),
                 transform={"mean_file": MEAN, "scale": SCALE})
    assert r["results"]["fp32"]["top1"] == CASE["caffe_test"]["accuracy"]
    # without labels: no accuracy, but agreement of the other targets with fp32
    np.save(tmp_path / "digits.npy", imgs)
    r = evaluate(DEPLOY, weights=WEIGHTS, data=str(tmp_path / "digits.npy"), targets=("int8",), limit=50,
                 transform={"mean_file": MEAN, "scale": SCALE})
    assert "top1" not in r["results"]["fp32"] and r["results"]["int8"]["images"] == 50
    assert 0.0 <= r["results"]["int8"]["agreement_top1"] <= 1.0


def test_targets_run_on_the_same_batches_and_agree_sanely():
    r = evaluate(TRAIN_VAL, weights=WEIGHTS, targets="fp32,fp16,binary", limit=200, batch_size=50)
    fp32, fp16, binary = (r["results"][t] for t in ("fp32", "fp16", "binary"))
    assert fp32["images"] == fp16["images"] == binary["images"] == 200
    # fp16 weights barely move the scores: same predictions, cosine ~1
    assert fp16["agreement_top1"] == 1.0 and fp16["cosine"] > 0.9999
    assert 0 < fp16["max_abs_diff"] < 0.05 and fp16["mean_abs_diff"] <= fp16["max_abs_diff"]
    assert binary["model_size_bytes"] < fp16["model_size_bytes"] < fp32["model_size_bytes"]
    # fp32 model size: 4 bytes per stored weight value
    import caffeq
    m = caffeq.load(TRAIN_VAL, WEIGHTS)
    assert fp32["model_size_bytes"] == 4 * sum(int(np.size(b)) for bl in m.params.values() for b in bl)


def test_corrupt_and_missing_images_are_counted_not_fatal(tmp_path):
    entries = list_entries()[:30]
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    listed = entries[:10] + [(tmp_path / "corrupt.png", 1)] + entries[10:20] + \
        [(tmp_path / "gone.png", 2)] + entries[20:]
    lst = write_list(tmp_path / "list.txt", listed)
    ok = write_list(tmp_path / "ok.txt", entries)
    kw = {"weights": WEIGHTS, "transform": {"mean_file": MEAN, "scale": SCALE}, "batch_size": 8}
    r = evaluate(DEPLOY, data=lst, workers=2, **kw)
    ref = evaluate(DEPLOY, data=ok, **kw)
    assert r["errors"]["count"] == 2
    assert [e["index"] for e in r["errors"]["items"]] == [10, 21]
    assert "corrupt.png" in r["errors"]["items"][0]["error"] and "gone.png" in r["errors"]["items"][1]["error"]
    assert r["results"]["fp32"]["images"] == 30
    assert r["results"]["fp32"]["top1"] == ref["results"]["fp32"]["top1"]
    with pytest.raises(DataError, match=r"corrupt\.png.*--strict"):
        evaluate(DEPLOY, data=lst, strict=True, **kw)


def test_labels_outside_the_classes_are_reported(tmp_path):
    entries = list_entries()[:12]
    entries[3] = (entries[3][0], 10)
    entries[7] = (entries[7][0], -2)
    lst = write_list(tmp_path / "list.txt", entries)
    r = evaluate(DEPLOY, weights=WEIGHTS, data=lst, transform={"mean_file": MEAN, "scale": SCALE})
    oor = r["labels_out_of_range"]
    assert oor["count"] == 2 and [(o["index"], o["label"]) for o in oor["items"]] == [(3, 10), (7, -2)]
    assert r["results"]["fp32"]["images"] == 10
    # a train_val net (whose Accuracy layer reads labels) skips them the same way
    r = evaluate(TRAIN_VAL, weights=WEIGHTS, data=lst)
    assert r["labels_out_of_range"]["count"] == 2 and r["results"]["fp32"]["images"] == 10


def test_missing_inputs_are_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="data source not found"):
        evaluate(DEPLOY, weights=WEIGHTS, data=str(tmp_path / "nope"))
    with pytest.raises(DataError, match="mean file not found"):
        evaluate(DEPLOY, weights=WEIGHTS, data=str(DIGITS / "test_list.txt"),
                 transform={"mean_file": str(tmp_path / "nope.binaryproto")})
    with pytest.raises(DataError, match="deploy net"):
        evaluate(DEPLOY, weights=WEIGHTS)
    with pytest.raises(DataError, match="takes 1x16x16"):
        evaluate(DEPLOY, weights=WEIGHTS, data=str(DIGITS / "test_list.txt"), transform={"crop_size": 8})
    with pytest.raises(CaffeqError, match="wat"):
        evaluate(DEPLOY, weights=WEIGHTS, data=str(DIGITS / "test_list.txt"), targets="fp32,wat")
    # a missing mean file named by the train_val's transform_param
    net = (DIGITS / "train_val.prototxt").read_text()
    (tmp_path / "tv.prototxt").write_text(net.replace('"test_lmdb"', f'"{DIGITS / "test_lmdb"}"'))
    with pytest.raises(DataError, match="mean.binaryproto: mean file not found"):
        evaluate(str(tmp_path / "tv.prototxt"), weights=WEIGHTS)


def test_shapes_read_from_a_database_leave_it_closed(tmp_path):
    # no mean file and no crop: the Data layer's shape comes from the LMDB's first record
    net = (DIGITS / "train_val.prototxt").read_text().replace('"test_lmdb"', f'"{DIGITS / "test_lmdb"}"')
    (tmp_path / "tv.prototxt").write_text(net.replace(' mean_file: "mean.binaryproto"', ""))
    model = caffeq.load(str(tmp_path / "tv.prototxt"), random_weights=True)
    assert model.inputs["data"][1:] == (1, 16, 16)
    import lmdb
    lmdb.open(str(DIGITS / "test_lmdb"), readonly=True, lock=False).close()   # py-lmdb refuses a 2nd open


def test_parse_resize():
    assert parse_resize("256x320") == (256, 320) and parse_resize("224") == (224, 224)
    with pytest.raises(DataError):
        parse_resize("big")


def run_cli(*args, env=None, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "cli.py"), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600, check=False)


def test_cli_table_and_json_schema(tmp_path):
    out = tmp_path / "r.json"
    p = run_cli("eval", TRAIN_VAL, "--weights", WEIGHTS, "--to", "fp32,binary", "--workers", "1",
                "--json", str(out))
    assert p.returncode == 0, p.stderr
    for word in ("fp32", "binary", "top-1", "agree@1", "images/s", "size", "99.00%"):
        assert word in p.stdout
    assert "img/s" not in p.stderr        # no progress bar in a log: stderr is not a terminal
    r = json.loads(out.read_text())
    fp32, binary = r["results"]["fp32"], r["results"]["binary"]
    assert fp32["top1"] == CASE["caffe_test"]["accuracy"] and fp32["top5"] == 1.0
    assert fp32["images"] == 400 and fp32["images_per_s"] > 0
    for key in ("top1", "top5", "agreement_top1", "cosine", "mean_abs_diff", "max_abs_diff", "images_per_s",
                "model_size_bytes"):
        assert key in binary
    assert 0.0 <= binary["top1"] <= 1.0 and 0.0 <= binary["agreement_top1"] <= 1.0
    assert r["errors"] == {"count": 0, "items": []}


@pytest.mark.slow
def test_cli_deploy_flags_and_errors(tmp_path):
    p = run_cli("eval", DEPLOY, "--weights", WEIGHTS, "--data", str(DIGITS / "test_list.txt"), "--mean-file",
                MEAN, "--scale", str(SCALE), "--limit", "100", "--no-progress", "--json", "-")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["results"]["fp32"]["images"] == 100 and r["data"]["transform"]["scale"] == SCALE
    p = run_cli("eval", DEPLOY, "--weights", WEIGHTS, "--data", str(tmp_path / "none"))
    assert p.returncode == 2 and p.stderr.strip().startswith("caffeq: error:") and "not found" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_torchrun_two_processes_equal_single_process(tmp_path):
    """2 CPU processes on gloo: shards without duplicates, all-reduced sums = one process's numbers."""
    entries = list_entries()[:45]
    (tmp_path / "corrupt.png").write_bytes(b"nope")
    entries.insert(13, (tmp_path / "corrupt.png", 0))
    entries[20] = (entries[20][0], 11)
    lst = write_list(tmp_path / "list.txt", entries)        # 46 items: 44 usable, odd shards
    args = ["eval", TRAIN_VAL, "--weights", WEIGHTS, "--data", lst, "--to", "fp32,binary",
            "--batch-size", "4", "--workers", "1", "--no-progress", "--device", "cpu"]
    single = run_cli(*args, "--json", str(tmp_path / "one.json"))
    assert single.returncode == 0, single.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    dist = subprocess.run(torchrun + [str(REPO / "cli.py"), *args, "--json", str(tmp_path / "two.json")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600, check=False)
    assert dist.returncode == 0, dist.stderr[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert one["images"] == two["images"] == 44
    assert one["errors"] == two["errors"] and one["errors"]["count"] == 1
    assert one["labels_out_of_range"] == two["labels_out_of_range"]
    for t in ("fp32", "binary"):
        a, b = one["results"][t], two["results"][t]
        for key in ("images", "top1", "top5", "agreement_top1"):
            assert a.get(key) == b.get(key), (t, key)
        for key in ("mean_abs_diff", "max_abs_diff", "cosine"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-6), (t, key)
        for name, v in a["layers"].items():
            assert v == pytest.approx(b["layers"][name], rel=1e-6, abs=1e-7), (t, name)


@pytest.mark.cuda
def test_cuda_eval_matches_caffe_and_cpu():
    """On a GPU: uint8 batches in pinned memory, mean/scale on the device, the same accuracy."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = evaluate(TRAIN_VAL, weights=WEIGHTS, targets="fp32,fp16,binary", device="cuda", workers=2)
    cpu = evaluate(TRAIN_VAL, weights=WEIGHTS, targets="fp32,binary", device="cpu", workers=0)
    assert gpu["device"].startswith("cuda")
    assert gpu["results"]["fp32"]["top1"] == CASE["caffe_test"]["accuracy"]
    assert gpu["results"]["fp32"]["layers"]["loss"] == pytest.approx(CASE["caffe_test"]["loss"], abs=1e-6)
    assert gpu["results"]["fp16"]["agreement_top1"] >= 0.99
    assert gpu["results"]["binary"]["top1"] == cpu["results"]["binary"]["top1"]
    assert gpu["results"]["fp32"]["images_per_s"] > 0
