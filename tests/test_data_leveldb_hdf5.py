"""LevelDB (Data layer backend LEVELDB) and HDF5Data sources, down to Caffe's own test accuracy.

The digits case's TEST LMDB is copied record by record into a LevelDB, and its images are
written, preprocessed as Caffe's DataTransformer would ((pixel - mean) * scale, computed here
with numpy), into HDF5 files behind an HDF5Data list: both must give the accuracy that
`caffe test` reported for the LMDB.
"""
import json

import numpy as np
import pytest
from conftest import FIXTURES

from caffeq.data import (
    Hdf5Dataset,
    LeveldbDataset,
    datum_shape,
    detect_kind,
    open_dataset,
)
from caffeq.data.leveldb_source import close_db
from caffeq.errors import DataError
from caffeq.evaluate import evaluate
from caffeq.io.schema import caffe_pb2

plyvel = pytest.importorskip("plyvel")
h5py = pytest.importorskip("h5py")
lmdb = pytest.importorskip("lmdb")
pytest.importorskip("cv2")

DIGITS = FIXTURES / "digits_meanfile"
CASE = json.loads((DIGITS / "case.json").read_text())
WEIGHTS = str(DIGITS / "model.caffemodel")
SCALE = 0.00390625


def lmdb_records():
    env = lmdb.open(str(DIGITS / "test_lmdb"), readonly=True, lock=False)
    with env.begin() as txn:
        records = list(txn.cursor())
    env.close()
    return records


def write_leveldb(path, records):
    db = plyvel.DB(str(path), create_if_missing=True)
    with db.write_batch() as wb:
        for key, value in records:
            wb.put(key, value)
    db.close()
    return str(path)


def datum(values, label):
    d = caffe_pb2.Datum(channels=values.shape[0], height=values.shape[1], width=values.shape[2],
                        data=values.astype(np.uint8).tobytes(), label=label)
    return d.SerializeToString()


def test_leveldb_dataset_reads_records_in_key_order(tmp_path):
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (2, 3, 5)) for _ in range(4)]
    # written out of order: LevelDB (and Caffe's cursor) iterate in key order
    path = write_leveldb(tmp_path / "db", [(b"%08d" % i, datum(imgs[i], 10 + i)) for i in (2, 0, 3, 1)])
    assert detect_kind(path) == "leveldb"
    assert tuple(datum_shape(path, "LEVELDB")) == (2, 3, 5)
    close_db(path)
    ds = open_dataset(path)
    assert isinstance(ds, LeveldbDataset) and len(ds) == 4 and ds.single_process
    for i in range(4):
        index, img, label, err = ds[i]
        assert err is None and index == i and label == 10 + i
        np.testing.assert_array_equal(img, imgs[i])
    assert [item[2] for item in ds.__getitems__([3, 1])] == [13, 11]
    ds.close()
    assert len(open_dataset(path, limit=2)) == 2


def test_leveldb_bad_record_is_one_item_error(tmp_path):
    path = write_leveldb(tmp_path / "db", [(b"a", datum(np.zeros((1, 2, 2)), 1)), (b"b", b"\xff\xfe junk")])
    ds = LeveldbDataset(path)
    assert ds[0][3] is None
    err = ds[1][3]
    assert err.startswith(f"{path}[b]") and "Datum" in err
    ds.close()


def test_not_a_leveldb_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such LevelDB"):
        LeveldbDataset(str(tmp_path / "missing"))


def test_train_val_on_leveldb_matches_caffe_test(tmp_path):
    db = write_leveldb(tmp_path / "test_leveldb", lmdb_records())
    net = (DIGITS / "train_val.prototxt").read_text()
    net = net.replace('source: "test_lmdb" batch_size: 100 backend: LMDB',
                      f'source: "{db}" batch_size: 100 backend: LEVELDB')
    (tmp_path / "train_val.prototxt").write_text(net)
    (tmp_path / "mean.binaryproto").write_bytes((DIGITS / "mean.binaryproto").read_bytes())
    r = evaluate(str(tmp_path / "train_val.prototxt"), weights=WEIGHTS, data=db, workers=2)
    assert r["data"]["kind"] == "leveldb"
    assert any("one process" in n for n in r["notes"])
    fp32 = r["results"]["fp32"]
    assert fp32["images"] == CASE["test_images"]
    assert fp32["top1"] == CASE["caffe_test"]["accuracy"]
    assert fp32["layers"]["accuracy_top2"] == CASE["caffe_test"]["accuracy_top2"]


def mean_image():
    blob = caffe_pb2.BlobProto()
    blob.ParseFromString((DIGITS / "mean.binaryproto").read_bytes())
    return np.asarray(blob.data, np.float32).reshape(blob.channels, blob.height, blob.width)


def preprocessed_digits():
    """The TEST images as Caffe's DataTransformer feeds them: (pixel - mean) * scale."""
    mean = mean_image()
    data, labels = [], []
    for _, raw in lmdb_records():
        d = caffe_pb2.Datum()
        d.ParseFromString(raw)
        img = np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width).astype(np.float32)
        data.append((img - mean) * np.float32(SCALE))
        labels.append(d.label)
    return np.stack(data), np.asarray(labels, np.float32)


def write_h5(path, **arrays):
    with h5py.File(path, "w") as f:
        for name, arr in arrays.items():
            f.create_dataset(name, data=arr)


def test_hdf5data_train_val_matches_caffe_test(tmp_path):
    data, labels = preprocessed_digits()
    # two files, as HDF5Data lists them, with the label as the (N, 1) float Caffe examples use
    write_h5(tmp_path / "part0.h5", data=data[:250], label=labels[:250, None])
    write_h5(tmp_path / "part1.h5", data=data[250:], label=labels[250:, None])
    (tmp_path / "test_h5.txt").write_text("part0.h5\npart1.h5\n")
    net = (DIGITS / "train_val.prototxt").read_text().splitlines()
    net[2] = ('layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST } '
              'hdf5_data_param { source: "test_h5.txt" batch_size: 100 } }')
    (tmp_path / "train_val.prototxt").write_text("\n".join(net))
    r = evaluate(str(tmp_path / "train_val.prototxt"), weights=WEIGHTS, workers=0)
    assert r["data"]["kind"] == "hdf5" and r["data"]["batch_size"] == 100
    fp32 = r["results"]["fp32"]
    assert fp32["images"] == CASE["test_images"]
    assert fp32["top1"] == CASE["caffe_test"]["accuracy"]
    assert fp32["layers"]["accuracy"] == pytest.approx(CASE["caffe_test"]["accuracy"], abs=1e-7)
    assert fp32["layers"]["loss"] == pytest.approx(CASE["caffe_test"]["loss"], abs=5e-8)


def test_hdf5_dataset_items_across_files(tmp_path):
    a = np.arange(3 * 4, dtype=np.float64).reshape(3, 4)
    b = -np.arange(2 * 4, dtype=np.float64).reshape(2, 4)
    write_h5(tmp_path / "a.h5", feat=a, y=np.array([0, 1, 2], np.float32))
    write_h5(tmp_path / "b.h5", feat=b, y=np.array([3, 4], np.float32))
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'a.h5'}\n\n{tmp_path / 'b.h5'}\n")
    assert detect_kind(str(tmp_path / "list.txt")) == "hdf5"
    assert detect_kind(str(tmp_path / "a.h5")) == "hdf5"
    ds = open_dataset(str(tmp_path / "list.txt"), tops=("feat", "y"))
    assert len(ds) == 5 and ds.has_labels
    for i, (want, label) in enumerate([(r, k) for k, r in enumerate(list(a) + list(b))]):
        _, img, lab, err = ds[i]
        assert err is None and lab == label and img.dtype == np.float32
        np.testing.assert_array_equal(img, want)
    assert ds.name(4).endswith("b.h5[1]")
    assert len(Hdf5Dataset(str(tmp_path / "list.txt"), "feat", "y", limit=4)) == 4
    unlabeled = Hdf5Dataset(str(tmp_path / "a.h5"), "feat")     # no "label" dataset
    assert not unlabeled.has_labels and len(unlabeled) == 3


@pytest.mark.parametrize("files, match", [
    ({"a.h5": {"data": np.zeros((2, 3))}, "b.h5": {"data": np.zeros((2, 4))}}, "one shape"),
    ({"a.h5": {"data": np.zeros((2, 3)), "label": np.zeros(3)}}, "has \\[3\\] items"),
    ({"a.h5": {"data": np.zeros((2, 3)), "label": np.zeros((2, 2))}}, "one class label"),
    ({"a.h5": {"pixels": np.zeros((2, 3))}}, "no dataset 'data'"),
])
def test_hdf5_mismatches_are_clear_errors(tmp_path, files, match):
    for name, arrays in files.items():
        write_h5(tmp_path / name, **arrays)
    (tmp_path / "list.txt").write_text("".join(f"{n}\n" for n in files))
    with pytest.raises(DataError, match=match):
        Hdf5Dataset(str(tmp_path / "list.txt"), "data")


def test_hdf5_list_with_missing_file(tmp_path):
    (tmp_path / "list.txt").write_text("nowhere.h5\n")
    with pytest.raises(DataError, match="listed file 'nowhere.h5' not found"):
        Hdf5Dataset(str(tmp_path / "list.txt"))


def test_hdf5data_vector_items_evaluate(tmp_path):
    """hdf5_classification style: N x 4 float features, a partial last batch, no transform."""
    import caffeq
    rng = np.random.default_rng(1)
    x = rng.normal(size=(37, 4)).astype(np.float32)
    y = rng.integers(0, 3, 37)
    write_h5(tmp_path / "test.h5", data=x, label=y.astype(np.float32))
    (tmp_path / "test.txt").write_text("test.h5\n")
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "d" type: "HDF5Data" top: "data" top: "label" include { phase: TEST } '
        'hdf5_data_param { source: "test.txt" batch_size: 10 } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 } }\n'
        'layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }\n')
    model = caffeq.load(str(tmp_path / "net.prototxt"), random_weights=True, seed=3)
    r = evaluate(model, workers=0)
    w, b = (np.asarray(a, np.float64) for a in model.params["ip"])
    want = float(np.mean((x @ w.T + b).argmax(1) == y))
    assert r["data"]["kind"] == "hdf5" and r["results"]["fp32"]["images"] == 37
    assert r["results"]["fp32"]["top1"] == pytest.approx(want, abs=1e-12)


def test_a_blank_hdf5_source_is_no_source(tmp_path, capsys):
    # a train file published with `source: ""`: its data shapes come from --input-shape, as for a
    # missing list, never from opening the prototxt's folder
    from caffeq.__main__ import main
    path = tmp_path / "train.prototxt"
    path.write_text('layer { name: "d" type: "HDF5Data" top: "data" top: "label" '
                    'hdf5_data_param { source: "" batch_size: 4 } }\n'
                    'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
                    'inner_product_param { num_output: 2 } }\n')
    assert main(["inspect", str(path)]) == 0
    assert "HDF5 list '' not found" in capsys.readouterr().err
    assert main(["inspect", str(path), "--input-shape", "data=4,3,5,5", "--input-shape", "label=4"]) == 0
    assert "4x2" in capsys.readouterr().out
