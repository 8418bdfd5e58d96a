"""Charleen777/caffecode's Transpose (LSTMINPUT, LSTMOUTPUT, GRIDLSTM, GRIDLSTMSUM), LstmUnit and ZerosData
(caffeq/layers/charleen_lstm.py) against loops written here from its transpose_layer.cpp, lstm_unit_layer.cpp
and zeros_data_layer.cpp, on asymmetric shapes, in torch, onnxruntime and model.py; and its corpus nets."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.layers.charleen_lstm import CharleenTranspose
from caffeq.layers.registry import spec_for
from caffeq.model import load_from_text

F = np.float32
REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def transpose_layer(kind, batch=None, height=None, local=None, name="t", bottom="x"):
    extra = "".join(f" {k}: {v}" for k, v in (("batch_size", batch), ("height", height),
                                              ("local_connected_num", local)) if v is not None)
    return (f'layer {{ name: "{name}" type: "Transpose" bottom: "{bottom}" top: "{name}" '
            f'transpose_param {{ transposetype: {kind}{extra} }} }}')


def ref_lstminput(x):
    """top[off + i*C + c] = bottom[off + c*S + i], off = count/num * n."""
    n, c, h, w = x.shape
    s = h * w
    flat, top = x.reshape(-1), np.empty(x.size, F)
    for b in range(n):
        off = x.size // n * b
        for ch in range(c):
            for i in range(s):
                top[off + i * c + ch] = flat[off + ch * s + i]
    return top.reshape(n * s, c)


def ref_lstmoutput(x, batch, height):
    c = x.shape[1]
    width = x.shape[0] // batch // height
    s = height * width
    flat, top = x.reshape(-1), np.empty(x.size, F)
    for b in range(batch):
        off = x.size // batch * b
        for ch in range(c):
            for i in range(s):
                top[off + ch * s + i] = flat[off + i * c + ch]
    return top.reshape(batch, c, height, width)


def offsets(h):
    return [-h - 1, -h, -h + 1, -1, 1, h - 1, h, h + 1]


def ref_gridlstm(x, batch, height):
    m, c = x.shape
    s, e = m // batch, c // 8
    flat, top = x.reshape(-1), np.zeros(x.size, F)
    for b in range(batch):
        off = x.size // batch * b
        for i in range(s):
            for k, d in enumerate(offsets(height)):
                t = i + d
                if 0 < t < s:
                    for ch in range(e):
                        top[off + i * c + k * e + ch] = flat[off + t * c + (8 - k - 1) * e + ch]
    return top.reshape(m, c)


def ref_gridlstmsum(x, height):
    m, c = x.shape
    s, e = m, c // 8
    flat, top = x.reshape(-1), np.zeros(m * e, F)
    for i in range(s):
        for ch in range(e):
            for k, d in enumerate(offsets(height)):
                t = i + d
                if 0 < t < s:
                    top[i * e + ch] += flat[t * c + k * 8 + ch]
    return top.reshape(m, e)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 4, 3, 1)])
def test_lstminput_maps_pixels_to_rows(shape, tmp_path):
    x = rng(1).standard_normal(shape).astype(F)
    model = load_from_text(net(transpose_layer("LSTMINPUT"), inputs={"x": shape}))
    assert model.blob_shapes["t"] == (shape[0] * shape[2] * shape[3], shape[1])
    check_everywhere(model, {"x": x}, {"t": ref_lstminput(x)}, tmp_path)


@pytest.mark.parametrize("bottom, batch, height", [((30, 4), 2, 3), ((35, 3, 1), 1, 7)])
def test_lstmoutput_maps_rows_back_to_maps(bottom, batch, height, tmp_path):
    x = rng(2).standard_normal(bottom).astype(F)
    model = load_from_text(net(transpose_layer("LSTMOUTPUT", batch, height), inputs={"x": bottom}))
    check_everywhere(model, {"x": x}, {"t": ref_lstmoutput(x.reshape(bottom[0], bottom[1]), batch, height)},
                     tmp_path)


def test_lstminput_ignores_batch_size_and_height():
    """LSTMINPUT's Reshape and forward read neither field (the nets leave them at their defaults or set them)."""
    model = load_from_text(net(transpose_layer("LSTMINPUT", 0, 0), inputs={"x": (2, 3, 4, 5)}))
    assert model.blob_shapes["t"] == (40, 3)


def test_lstminput_then_lstmoutput_is_the_identity(tmp_path):
    x = rng(3).standard_normal((1, 6, 3, 5)).astype(F)
    model = load_from_text(net(transpose_layer("LSTMINPUT", name="rows"),
                               transpose_layer("LSTMOUTPUT", 1, 3, bottom="rows"), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"t": x}, tmp_path)


@pytest.mark.parametrize("rows, channels, batch, height", [(15, 16, 1, 5), (24, 19, 2, 4)])
def test_gridlstm_gathers_the_8_neighbours(rows, channels, batch, height, tmp_path):
    x = rng(4).standard_normal((rows, channels)).astype(F)
    ref = ref_gridlstm(x, batch, height)
    e = channels // 8
    assert not ref[0, :4 * e].any() and ref[0, 4 * e:8 * e].all()   # pixel 0: only the +1, h-1, h, h+1 neighbours
    assert not ref[:, 8 * e:].any()                                # channels past 8 * E stay 0
    model = load_from_text(net(transpose_layer("GRIDLSTM", batch, height, 8), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"t": ref}, tmp_path)


def test_gridlstmsum_adds_the_neighbours_blocks(tmp_path):
    x = rng(5).standard_normal((21, 72)).astype(F)
    model = load_from_text(net(transpose_layer("GRIDLSTMSUM", 1, 3), inputs={"x": x.shape}))
    assert model.blob_shapes["t"] == (21, 9)
    check_everywhere(model, {"x": x}, {"t": ref_gridlstmsum(x, 3)}, tmp_path, atol=1e-6, rtol=1e-6)


def test_lstm_cfs_transposes_keep_their_spec():
    model = load_from_text(net('layer { name: "t" type: "Transpose" bottom: "x" top: "t" transpose_param { '
                               'transposetype: CONVTOLSTM shape { dim: 20 dim: 3 } } }', inputs={"x": (1, 3, 4, 5)}))
    assert model.blob_shapes["t"] == (20, 3)
    text = net(transpose_layer("GRIDLSTM", 1, 4), inputs={"x": (8, 8)})
    assert isinstance(spec_for(parse_prototxt_text(text).layer[-1]), CharleenTranspose)


@pytest.mark.parametrize("layer, needle", [
    (transpose_layer("GRIDLSTM", 1, 4, 4), "local_connected_num must be 8"),
    (transpose_layer("GRIDLSTMSUM", 2, 4), "batch_size 2 with GRIDLSTMSUM"),
    (transpose_layer("GRIDLSTM", 4, 4), "not a multiple of transpose_param.batch_size"),
    (transpose_layer("LSTMOUTPUT", 1, 4), "(the fork's CHECK_EQ)"),
])
def test_bad_transposes_are_one_line_errors(layer, needle):
    with pytest.raises(CaffeqError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        load_from_text(net(layer, inputs={"x": (6, 16)}))
    assert "\n" not in str(err.value)


def ref_lstm_unit(x, c_prev, ws, cpu=False):
    """lstm_unit_layer.cu's forward (cpu: lstm_unit_layer.cpp's, whose forget gate reads blob 2)."""
    def sig(v):
        return (1.0 / (1.0 + np.exp(-v.astype(np.float64)))).astype(F)

    def tanh5(v):
        e = np.exp(2 * v)
        return np.where(np.abs(v) < 5, (e - 1) / (e + 1), np.where(v > 0, 1.0, -1.0)).astype(F)

    g = [x @ w.reshape(w.shape[1], w.shape[3]).T for w in ws]
    # lstm_unit_layer.cu: forget_gates = 0 - output_gates (pre-activation) before ForwardCombineGates; g[2] unread
    u, i, f, o = tanh5(g[0]), sig(g[1]), sig(g[2] if cpu else 0 - g[3]), sig(g[3])
    cell = c_prev * f + i * u
    return cell * o, cell


def test_lstm_unit_is_the_forks_cell(tmp_path):
    m, k, n = 7, 5, 3
    x = (rng(6).standard_normal((m, k)) * 3).astype(F)
    x[0] = [5.0, 0.0, 0.0, 0.0, 0.0]   # with the rows below: g_u = 5 and -5, where the fork's tanh is exactly +-1
    c_prev = rng(7).standard_normal((m, n)).astype(F)
    c_prev[0] = 0.0                     # so that cell[0, :2] is i * u with i = sig(20) = 1: tanh(5) is 1 - 9.1e-5
    text = net('layer { name: "u" type: "LstmUnit" bottom: "x" bottom: "c" top: "h" top: "cell" '
               'lstm_unit_param { num_cells: 3 } }', inputs={"x": (m, k), "c": (m, n)})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "u")
    assert [tuple(b.shape) for b in node.blobs] == [(1, n, 1, k)] * 4
    node.blobs[0][0, :2, 0] = [[1.0, 0.0, 0.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0, 0.0]]
    node.blobs[1][0, :2, 0] = [[4.0, 0.0, 0.0, 0.0, 0.0]] * 2
    h, cell = ref_lstm_unit(x, c_prev, node.blobs)
    assert cell[0, :2].tolist() == [1.0, -1.0]
    check_everywhere(model, {"x": x, "c": c_prev}, {"h": h, "cell": cell}, tmp_path, atol=1e-6, rtol=1e-5)


def test_lstm_unit_forget_gate_is_tied_to_the_output_gate(tmp_path):
    """The fork's GPU forward never reads blob 2: any forget-gate weights give the same h and c."""
    m, k, n = 4, 3, 5
    x = rng(9).standard_normal((m, k)).astype(F)
    c_prev = (rng(10).standard_normal((m, n)) * 2).astype(F)
    text = net('layer { name: "u" type: "LstmUnit" bottom: "x" bottom: "c" top: "h" top: "cell" '
               'lstm_unit_param { num_cells: 5 } }', inputs={"x": (m, k), "c": (m, n)})
    model = load_from_text(text, random_weights=True)
    blobs = node_of(model, "u").blobs
    h, cell = ref_lstm_unit(x, c_prev, blobs)
    blobs[2][...] = 4.0   # the CPU forward's sig(g_f) would move with it; the tied gate does not
    assert np.abs(ref_lstm_unit(x, c_prev, blobs, cpu=True)[1] - cell).max() > 0.1
    assert np.array_equal(ref_lstm_unit(x, c_prev, blobs)[1], cell)
    check_everywhere(model, {"x": x, "c": c_prev}, {"h": h, "cell": cell}, tmp_path, atol=1e-6, rtol=1e-5)


def test_lstm_unit_needs_num_cells():
    with pytest.raises(CaffeqError, match="num_cells is required"):
        load_from_text(net('layer { name: "u" type: "LstmUnit" bottom: "x" bottom: "c" top: "h" top: "cell" }',
                           inputs={"x": (2, 3), "c": (2, 3)}))


@pytest.mark.parametrize("dims, shape", [("shape: 6 shape: 4", (6, 4)),
                                         ("shape: 2 shape: 3 shape: 5 shape: 1", (2, 3, 5, 1))])
def test_zeros_data_is_a_zero_blob(dims, shape, tmp_path):
    text = net(f'layer {{ name: "z" type: "ZerosData" top: "z" zeros_data_param {{ {dims} }} }}',
               'layer { name: "s" type: "Eltwise" bottom: "z" bottom: "z" top: "s" }', inputs={"x": (1, 1)})
    model = load_from_text(text)
    assert model.blob_shapes["z"] == shape
    check_everywhere(model, {"x": np.zeros((1, 1), F)}, {"s": np.zeros(shape, F)}, tmp_path)


def test_zeros_data_with_three_dims_is_an_error():
    with pytest.raises(CaffeqError, match="2 or at least 4 values"):
        load_from_text(net('layer { name: "z" type: "ZerosData" top: "z" zeros_data_param { shape: 1 shape: 2 '
                           'shape: 3 } }', inputs={"x": (1, 1)}))


def test_grid_lstm_step_end_to_end(tmp_path):
    """xiaodan.prototxt's step, small: a (1, C, H, W) map to rows, zero seeds, the 8 neighbours, a LstmUnit, back."""
    c, h, w, cells = 3, 4, 5, 2
    s = h * w
    seeds = " ".join('bottom: "seed"' for _ in range(8))
    layers = [
        transpose_layer("LSTMINPUT", name="rows"),
        f'layer {{ name: "z" type: "ZerosData" top: "seed" zeros_data_param {{ shape: {s} shape: {cells} }} }}',
        f'layer {{ name: "cat8" type: "Concat" {seeds} top: "cat8" }}',
        transpose_layer("GRIDLSTM", 1, w, 8, name="nb", bottom="cat8"),
        'layer { name: "all" type: "Concat" bottom: "rows" bottom: "seed" bottom: "nb" top: "all" }',
        f'layer {{ name: "u" type: "LstmUnit" bottom: "all" bottom: "seed" top: "hid" top: "cell" '
        f'lstm_unit_param {{ num_cells: {cells} }} }}',
        transpose_layer("LSTMOUTPUT", 1, h, name="out", bottom="hid"),
    ]
    x = rng(8).standard_normal((1, c, h, w)).astype(F)
    model = load_from_text(net(*layers, inputs={"x": x.shape}), random_weights=True)
    rows = ref_lstminput(x)
    zeros = np.zeros((s, cells), F)
    allx = np.concatenate([rows, zeros, ref_gridlstm(np.zeros((s, 8 * cells), F), 1, w)], axis=1)
    hid, _ = ref_lstm_unit(allx, zeros, node_of(model, "u").blobs)
    check_everywhere(model, {"x": x}, {"out": ref_lstmoutput(hid, 1, h)}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["deeplab_lstm5__test", "fcn_lstm1__train", "vgg5_lstm1__train", "xiaodan"])
def test_corpus_files_read(name):
    path = CORPUS / f"Charleen777__caffecode__prototxt__{name}.prototxt"
    res = subprocess.run([sys.executable, "cli.py", "inspect", str(path), "--input-shape", "data=1,3,256,256"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "multiply-accumulates" in res.stdout
