"""strawberryfg/Senorita-HANDS19-Pose (40d1341, src/network_layers/src/caffe/layers/operations): ReadBlobFromFile,
ReadBlobFromFileIndexing, ScaleVector, AddVectorByConstant, TwoVectorSubtract, IdentityVectorNoGradient and
OutputBlob as caffeq/layers/strawberryfg_ops.py reads them.

The references are numpy written here from the fork's loops: top[t * D + i] = f(bottom[t * D + i]) for t < N,
i < D, N and D the first bottom's first two axes (so a 4-axis bottom gives its first N * D values), in float.
Each runs in torch, onnxruntime and the generated model.py.
"""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"
GROUPNORM = ["strawberryfg__3dhuman-groupnorm__training__d2=8__train_d8_ada_gn.prototxt",
             "strawberryfg__3dhuman-groupnorm__training__d2=32__train_d32_ada_gn_startgn.prototxt"]


def rows_ref(x):
    """The fork's (N, D) rows: the first N * D values of x, N and D its first two axes."""
    n, d = x.shape[0], x.shape[1]
    flat = x.reshape(-1)
    out = np.empty((n, d), np.float32)
    for t in range(n):
        for i in range(d):
            out[t, i] = flat[t * d + i]
    return out


def layer(kind, bottoms, params="", name="o"):
    bottoms = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'layer {{ name: "{name}" type: "{kind}" {bottoms} top: "{name}" {params} }}'


@pytest.mark.parametrize("shape", [(2, 7), (2, 3, 5, 4)])
def test_scale_vector(shape, tmp_path):
    x = rng(1).standard_normal(shape).astype(np.float32)
    factor = np.float32(0.0484375)            # not a power of two: the float product is what counts
    model = load_from_text(net(layer("ScaleVector", ["x"], "scale_vector_param { scale_factor: 0.0484375 }"),
                               inputs={"x": shape}))
    ref = (rows_ref(x).astype(np.float64) * np.float64(factor)).astype(np.float32)   # double product, to float
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def test_scale_vector_default_and_extra_bottom(tmp_path):
    x = rng(2).standard_normal((2, 5)).astype(np.float32)
    y = rng(3).standard_normal((3, 3)).astype(np.float32)
    model = load_from_text(net(layer("ScaleVector", ["x", "y"]), inputs={"x": (2, 5), "y": (3, 3)}))
    ref = (x.astype(np.float64) * np.float64(np.float32(1.8))).astype(np.float32)
    check_everywhere(model, {"x": x, "y": y}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("shape", [(2, 9), (2, 3, 3, 5)])
def test_add_vector_by_constant(shape, tmp_path):
    x = rng(4).standard_normal(shape).astype(np.float32) * 50
    model = load_from_text(net(layer("AddVectorByConstant", ["x"], "add_vector_by_constant_param { add_value: -100.3 }"),
                               inputs={"x": shape}))
    ref = rows_ref(x) + np.float32(-100.3)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("take_abs", [False, True])
def test_two_vector_subtract(take_abs, tmp_path):
    a = rng(5).standard_normal((2, 3, 2, 3)).astype(np.float32)
    b = rng(6).standard_normal((2, 7)).astype(np.float32)          # 14 values; 2 x 3 of them read
    params = f"universal_param {{ take_abs: {str(take_abs).lower()} }}"
    model = load_from_text(net(layer("TwoVectorSubtract", ["a", "b"], params), inputs={"a": (2, 3, 2, 3), "b": (2, 7)}))
    bflat = b.reshape(-1)
    ref = np.empty((2, 3), np.float32)
    for t in range(2):
        for i in range(3):
            v = a.reshape(-1)[t * 3 + i] - bflat[t * 3 + i]
            ref[t, i] = abs(v) if take_abs else v
    check_everywhere(model, {"a": a, "b": b}, {"o": ref}, tmp_path)


def test_two_vector_subtract_same_shape(tmp_path):
    a = rng(7).standard_normal((2, 5)).astype(np.float32)
    b = rng(8).standard_normal((2, 5)).astype(np.float32)
    model = load_from_text(net(layer("TwoVectorSubtract", ["a", "b"]), inputs={"a": (2, 5), "b": (2, 5)}))
    check_everywhere(model, {"a": a, "b": b}, {"o": a - b}, tmp_path)


def test_identity_vector_no_gradient(tmp_path):
    x = rng(9).standard_normal((2, 4, 3)).astype(np.float32)
    model = load_from_text(net(layer("IdentityVectorNoGradient", ["x"]), inputs={"x": (2, 4, 3)}))
    check_everywhere(model, {"x": x}, {"o": rows_ref(x)}, tmp_path)


def test_read_blob_from_file_constant(tmp_path):
    path = tmp_path / "center.txt"
    path.write_text("112.5 -3.25e1\n0.1 7 garbage 9\n")
    text = net(f'layer {{ name: "c" type: "ReadBlobFromFile" top: "c" read_blob_from_file_param {{ '
               f'file_path: "{path}" num_to_read: 3 batch_size: 3 }} }}',
               layer("ScaleVector", ["c"], "scale_vector_param { scale_factor: 0.005 }"), inputs={})
    model = load_from_text(text)
    assert list(model.inputs) == []
    row = np.array([112.5, -32.5, 0.1], np.float64).astype(np.float32)   # fscanf's doubles, stored as float
    ref = (np.tile(row, (3, 1)).astype(np.float64) * np.float64(np.float32(0.005))).astype(np.float32)
    check_everywhere(model, {}, {"o": ref}, tmp_path)


def read_blob_net(path, num, batch, *more):
    return net(f'layer {{ name: "c" type: "ReadBlobFromFile" top: "c" read_blob_from_file_param {{ '
               f'file_path: "{path}" num_to_read: {num} batch_size: {batch} }} }}', *more, inputs={})


def test_read_blob_from_file_missing_is_an_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("1 2 3")
    # the fork's fopen finds the path as written, from the current folder (sub/c.txt is not c.txt),
    # and a Windows drive path is a plain (absent) name here
    for where in ("E:\\\\center_x_224.txt", "c.txt", ""):
        model = load_from_text(read_blob_net(where, 3, 2, layer("AddVectorByConstant", ["c"],
                                                                   "add_vector_by_constant_param { add_value: 1 }")))
        assert list(model.inputs) == ["c"]
        x = rng(10).standard_normal((2, 3)).astype(np.float32)
        check_everywhere(model, {"c": x}, {"o": x + np.float32(1)}, tmp_path)
    assert list(load_from_text(read_blob_net("sub/c.txt", 3, 2)).inputs) == []


def test_read_blob_from_file_reads_as_fscanf(tmp_path):
    # fscanf("%lf") per number: white space skipped, the longest strtod number, the first non-number word
    # ends the reading; hex floats, inf and nan are numbers, "1_0" is 1 then a stop
    path = tmp_path / "f.txt"
    path.write_text("\t0x1.8p1 -2.5e-1+4\n1-2 .5e2 INFINITY 1_0 99")
    model = load_from_text(read_blob_net(path, 8, 3, layer("ScaleVector", ["c"],
                                                            "scale_vector_param { scale_factor: 0.3 }")))
    row = np.array([3.0, -0.25, 4.0, 1.0, -2.0, 50.0, np.inf, 1.0]).astype(np.float32)
    ref = (np.tile(row, (3, 1)).astype(np.float64) * np.float64(np.float32(0.3))).astype(np.float32)
    check_everywhere(model, {}, {"o": ref}, tmp_path)
    with pytest.raises(CaffeqError, match="fscanf reads 8 numbers from it, num_to_read is 9"):
        load_from_text(read_blob_net(path, 9, 3))


def test_read_blob_from_file_rounds_doubles_to_float(tmp_path):
    path = tmp_path / "r.txt"
    path.write_text("0.1000000000000000055511151231257827 16777217 3.4028235e38 1e-46")
    model = load_from_text(read_blob_net(path, 4, 2))
    row = np.array([0.1, 16777217.0, 3.4028235e38, 1e-46], np.float64).astype(np.float32)
    out = model.run({})["c"]
    np.testing.assert_array_equal(out, np.tile(row, (2, 1)))
    assert out[0, 1] == np.float32(16777216.0) and out[0, 3] == 0


@pytest.mark.parametrize("text, needle", [
    ("1 2", "fscanf reads 2 numbers from it, num_to_read is 3"),
    ("1 2 x 3", "fscanf reads 2 numbers"),
    ("1 2,3", "fscanf reads 2 numbers"),
    ("1 2 3e", "differs between C libraries"),
    ("1 0x", "differs between C libraries"),
    ("1 2 -x", "fscanf reads 2 numbers"),      # no number there: every C library's fscanf fails on it
    ("inFin 1 2", "differs between C libraries"),
])
def test_read_blob_from_file_unusable_file_is_an_error(text, needle, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(CaffeqError, match=needle) as e:
        load_from_text(read_blob_net(path, 3, 2))
    assert "\n" not in str(e.value)


def test_read_blob_from_file_special_paths_refused_without_reading(tmp_path):
    import os
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)                      # an open() that blocked would hang the test here
    for where in (fifo, tmp_path, "/dev/zero"):
        with pytest.raises(CaffeqError, match="not a regular file"):
            load_from_text(read_blob_net(where, 3, 2))


def test_read_blob_from_file_large_file(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        f.write("7 -8 9.5 " + "1 " * (1 << 20))            # 2 MiB: its first numbers are in the first MiB
    out = load_from_text(read_blob_net(big, 3, 2)).run({})["c"]
    np.testing.assert_array_equal(out, np.array([[7, -8, 9.5]] * 2, np.float32))
    far = tmp_path / "far.txt"
    with open(far, "w") as f:
        f.write(" " * (1 << 20) + "1 2 3")
    with pytest.raises(CaffeqError, match="not within its first 1048576 bytes"):
        load_from_text(read_blob_net(far, 3, 2))


@pytest.mark.parametrize("params, needle", [
    ("num_to_read: 334", "333"),
    ("num_to_read: 0", "num_to_read must be >= 1"),
    ("batch_size: 0", "batch_size must be >= 1"),
])
def test_read_blob_from_file_bad_fields(params, needle):
    text = net(f'layer {{ name: "c" type: "ReadBlobFromFile" top: "c" read_blob_from_file_param {{ {params} }} }}',
               inputs={})
    with pytest.raises(CaffeqError) as e:
        load_from_text(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_vector_bad_bottoms():
    with pytest.raises(CaffeqError, match="first two axes"):
        load_from_text(net(layer("ScaleVector", ["x"]), inputs={"x": (5,)}))
    with pytest.raises(CaffeqError, match="reads 2 x 6 values of its second bottom"):
        load_from_text(net(layer("TwoVectorSubtract", ["a", "b"]), inputs={"a": (2, 6), "b": (2, 5)}))


def test_read_blob_from_file_indexing_is_sized_not_run():
    text = net(layer("ReadBlobFromFileIndexing", ["i"], 'read_blob_from_file_indexing_param { file_prefix: "/nonexistent/" '
                     "num_to_read: 64 }"), inputs={"i": (3, 1)})
    model = load_from_text(text)
    assert model.graph.tensors[model.graph.outputs[0]].shape == (3, 64)
    with pytest.raises(CaffeqError, match="run-time"):
        model.run({"i": np.zeros((3, 1), np.float32)})


def test_output_blob_is_read_and_writes_nothing(tmp_path):
    text = net(layer("ScaleVector", ["x"], "scale_vector_param { scale_factor: 2 }"),
               'layer { name: "w" type: "OutputBlob" bottom: "o" bottom: "i" output_blob_param { '
               f'save_path: "{tmp_path}/" blob_name: "p" }} }}', inputs={"x": (2, 3), "i": (2, 1)})
    model = load_from_text(text)
    x = rng(11).standard_normal((2, 3)).astype(np.float32)
    out = model.run({"x": x, "i": np.zeros((2, 1), np.float32)}, all_blobs=True)
    np.testing.assert_array_equal(out["o"], x * np.float32(2))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", GROUPNORM)
def test_groupnorm_corpus_names_the_layers_it_lacks(name):
    # 3dhuman-groupnorm comes from a later version of strawberryfg's fork than the one published in
    # c2f-3dhm-human-caffe (caffeq/layers/strawberryfg_3dhuman.py): its numerical-coordinate-regression
    # field and two of its types have no public source.  The read names the field, then (with
    # --ignore-unknown) the types, never dropping the net as training-only
    from caffeq.errors import ParseError, UnsupportedLayerError
    path = CORPUS / name
    with pytest.raises(ParseError, match="deep_human_model_numerical_coordinate_regression_param"):
        load(str(path))
    with pytest.raises(UnsupportedLayerError, match="DeepHumanModelMPIIGenRandIndex") as refused:
        load(str(path), ignore_unknown=True)
    assert "DeepHumanModelNormalizationResponse " in str(refused.value)
    assert "ReadBlobFromFile" not in str(refused.value) and "ScaleVector" not in str(refused.value)
