"""ONNX export: every reference case through onnxruntime, Caffe's pooling rules, refusals, files."""
import math
import os
import re
import shutil

import numpy as np
import pytest
from conftest import (
    FIXTURES,
    Case,
    assert_close,
    caffe_blob_source,
    case_ids,
    check_everywhere,
    model_py_outputs,
    pool_net,
)

import caffeq
from caffeq.errors import ExportError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from caffeq.backends.onnx_backend import DEFAULT_OPSET, export_onnx, format_stats  # noqa: E402  (after the onnxruntime skip)

# Cases ONNX cannot express, with the layers the export must name.  Keep it minimal:
# every case not listed here must export and match.
EXPECTED_REFUSALS = {}

OPSETS = [13, DEFAULT_OPSET]


def session(path):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def run_onnx(model, path, inputs, by_tensor=False):
    """ORT outputs by Caffe blob name (the SSA output names mapped back to their blob)."""
    sess = session(path)
    feed = {}
    for i in sess.get_inputs():
        blob = model.graph.tensors[i.name].blob
        feed[i.name] = np.ascontiguousarray(inputs[blob], np.float32)
    outs = sess.run(None, feed)
    if by_tensor:
        return {o.name: v for o, v in zip(sess.get_outputs(), outs)}
    return {model.graph.tensors[o.name].blob: v for o, v in zip(sess.get_outputs(), outs)}


def assert_rel(got, ref, what, rtol=1e-5):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != torch's {ref.shape}"
    if not ref.size:
        return
    scale = np.abs(ref).max()
    err = np.abs(got - ref).max()
    assert err <= rtol * scale + 1e-30, f"{what}: max |onnx - torch| = {err:.3g} > {rtol} x {scale:.3g}"


def check_file(path):
    """The checker (full_check) and strict shape inference: every tensor gets a shape."""
    onnx.checker.check_model(str(path), full_check=True)
    m = onnx.load(str(path))
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    known = {vi.name for vi in inferred.graph.value_info if vi.type.tensor_type.HasField("shape")}
    known |= {vi.name for vi in m.graph.output}
    for node in m.graph.node:
        for o in node.output:
            assert o in known, f"no inferred shape for {o} ({node.op_type} {node.name})"
    return m, inferred


def assert_declared_shapes(path, got_by_name, batch):
    """Declared output dims hold at run time: fixed ones as written, "N" as the batch."""
    m = onnx.load(str(path), load_external_data=False)
    for vi in m.graph.output:
        actual = got_by_name[vi.name].shape
        dims = vi.type.tensor_type.shape.dim
        assert len(dims) == len(actual), vi.name
        for d, a in zip(dims, actual):
            if d.HasField("dim_value"):
                assert d.dim_value == a, f"{vi.name}: declared {d.dim_value}, got {a}"
            elif d.dim_param == "N":
                assert a == batch, f"{vi.name}: declared N, got {a} at batch {batch}"


def _first_dims(inputs):
    return {k: v.shape[0] for k, v in inputs.items() if v.ndim}


# ---- every reference case -------------------------------------------------------------------

@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("name", case_ids())
def test_reference_case_through_onnxruntime(name, opset, tmp_path):
    case = Case(FIXTURES / name)
    model = case.load()
    out = tmp_path / "model.onnx"
    if name in EXPECTED_REFUSALS:
        with pytest.raises(ExportError) as e:
            export_onnx(model, out, opset=opset)
        assert set(e.value.refused) == EXPECTED_REFUSALS[name]
        for layer in EXPECTED_REFUSALS[name]:
            assert f"'{layer}'" in str(e.value)
        assert not out.exists() and not os.listdir(tmp_path)
        return
    stats = export_onnx(model, out, opset=opset)
    assert stats["opset"] == opset
    m, _ = check_file(out)
    assert m.opset_import[0].version == opset

    for vi in m.graph.input:
        assert vi.name in model.graph.tensors
        assert vi.type.tensor_type.shape.dim[0].dim_param, f"{vi.name}: batch is not symbolic"

    inputs = case.inputs
    got = run_onnx(model, out, inputs)
    first_input = model.graph.tensors[m.graph.input[0].name].blob
    assert_declared_shapes(out, run_onnx(model, out, inputs, by_tensor=True), inputs[first_input].shape[0])
    ref = model.run(inputs, all_blobs=True)
    caffe = case.outputs
    atol, rtol = case.tolerance
    assert got, "no outputs"
    for blob, value in got.items():
        assert_rel(value, ref[blob], f"{name}/{blob}")
        src = blob if blob in caffe else next((k for k in caffe if caffe_blob_source(k, {blob}) == blob), None)
        if src is not None:
            assert_close(value, caffe[src], atol, rtol, f"{name}/{blob} vs Caffe")

    # batch 1 through the same file (dynamic batch)
    firsts = _first_dims(inputs)
    if not firsts or min(firsts.values()) < 2:
        return
    small = {k: v[:1] if v.ndim else v for k, v in inputs.items()}
    try:
        ref1 = model.run(small, all_blobs=True)
    except caffeq.CaffeqError:
        return  # the case's indices need the full batch (BatchReindex-like)
    got1 = run_onnx(model, out, small)
    assert_declared_shapes(out, run_onnx(model, out, small, by_tensor=True), 1)
    for blob, value in got1.items():
        assert_rel(value, ref1[blob], f"{name}/{blob} at batch 1")


# ---- Caffe's pooling, checked against a direct transcription of its loops --------------------

FLT_MIN = np.float32(1.1754943508222875e-38)


def caffe_pool_reference(x, kernel, stride, pad, pool, ceil=True, global_pool=False):
    n, c, h, w = x.shape
    if global_pool:
        kernel, stride, pad = (h, w), (1, 1), (0, 0)
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad

    def out_size(size, k, s, p):
        span = size + 2 * p - k
        o = (-(-span // s) if ceil else span // s) + 1
        if p and (o - 1) * s >= size + p:
            o -= 1
        return o

    oh, ow = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
    y = np.zeros((n, c, oh, ow), np.float64)
    xd = x.astype(np.float64)
    for i in range(oh):
        for j in range(ow):
            if pool == "STOCHASTIC":
                hs, ws = i * sh, j * sw
                he, we = min(hs + kh, h), min(ws + kw, w)
                win = xd[:, :, hs:he, ws:we]
                y[:, :, i, j] = (win * win).sum((2, 3)) / (FLT_MIN + win.sum((2, 3)))
                continue
            hs, ws = i * sh - ph, j * sw - pw
            if pool == "MAX":
                he, we = min(hs + kh, h), min(ws + kw, w)
                hs, ws = max(hs, 0), max(ws, 0)
                win = xd[:, :, hs:he, ws:we]
                # Caffe starts at -FLT_MAX: an empty window, or one of -inf cells, keeps it
                lowest = -np.finfo(np.float32).max
                y[:, :, i, j] = np.maximum(win.max((2, 3)), lowest) if win.size else lowest
            else:
                he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                size = (he - hs) * (we - ws)
                hs, ws = max(hs, 0), max(ws, 0)
                he, we = min(he, h), min(we, w)
                total = xd[:, :, hs:he, ws:we].sum((2, 3)) if he > hs and we > ws else np.zeros((n, c))
                with np.errstate(invalid="ignore", divide="ignore"):
                    y[:, :, i, j] = total / size
    return y


POOL_CONFIGS = [
    # (H, W, kernel, stride, pad, ceil)
    (11, 13, (3, 3), (2, 2), (1, 1), True),
    (7, 7, (3, 3), (2, 2), (0, 0), True),      # ceil adds a clipped last window
    (6, 9, (2, 3), (2, 3), (1, 2), True),      # a last window dropped by Caffe's pad rule
    (5, 5, (3, 3), (3, 3), (2, 2), True),
    (10, 7, (4, 2), (3, 1), (1, 0), True),
    (9, 12, (3, 5), (2, 4), (1, 2), False),    # round_mode FLOOR
    (8, 8, (2, 2), (2, 2), (0, 0), True),
    (13, 5, (5, 3), (4, 2), (2, 1), True),
    (4, 6, (4, 6), (1, 1), (0, 0), True),      # one window covering everything
    (3, 17, (2, 7), (1, 5), (1, 3), True),
    (8, 7, (3, 2), (2, 2), (1, 0), True),      # AVE divisors clipped at H + pad differ per window
    (4, 6, (1, 1), (2, 2), (0, 0), True),      # ceil with stride > kernel: empty last windows
    (5, 11, (1, 2), (3, 4), (0, 0), True),     # ... and an AVE area below 0
]


def _pool_prototxt(shape, kernel, stride, pad, pool, ceil, global_pool=False):
    n, c, h, w = shape
    if global_pool:
        geom = "global_pooling: true"
    else:
        geom = (f"kernel_h: {kernel[0]} kernel_w: {kernel[1]} stride_h: {stride[0]} stride_w: {stride[1]} "
                f"pad_h: {pad[0]} pad_w: {pad[1]}")
    rm = "" if ceil else " round_mode: FLOOR"
    return (f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {n} dim: {c} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "pool" type: "Pooling" bottom: "data" top: "pool" '
            f'pooling_param {{ pool: {pool} {geom}{rm} }} }}\n')


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("pool", ["MAX", "AVE", "STOCHASTIC"])
@pytest.mark.parametrize("cfg", POOL_CONFIGS, ids=lambda c: "x".join(map(str, c[:2])) + f"_k{c[2]}s{c[3]}p{c[4]}")
def test_pooling_matches_caffes_loops(cfg, pool, opset, tmp_path):
    h, w, kernel, stride, pad, ceil = cfg
    rng = np.random.default_rng(h * 100 + w)
    x = rng.standard_normal((3, 2, h, w)).astype(np.float32)
    if pool == "STOCHASTIC":
        x = np.abs(x) + 0.1  # test-time stochastic pooling expects non-negative inputs (after ReLU)
    model = caffeq.model.load_from_text(_pool_prototxt(x.shape, kernel, stride, pad, pool, ceil))
    ref = caffe_pool_reference(x, kernel, stride, pad, pool, ceil)
    out = tmp_path / "pool.onnx"
    export_onnx(model, out, opset=opset)
    check_file(out)
    for xb in (x, x[:1]):
        got = run_onnx(model, out, {"data": xb})["pool"]
        r = ref[:len(xb)]
        assert got.shape == r.shape
        np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, model.run({"data": xb})["pool"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("hw", [(7, 7), (5, 9), (1, 3)])
def test_global_pooling(pool, hw, tmp_path):
    x = np.random.default_rng(1).standard_normal((2, 3) + hw).astype(np.float32)
    model = caffeq.model.load_from_text(_pool_prototxt(x.shape, None, None, None, pool, True, global_pool=True))
    out = tmp_path / "g.onnx"
    export_onnx(model, out)
    m, _ = check_file(out)
    assert [n.op_type for n in m.graph.node] == ["GlobalMaxPool" if pool == "MAX" else "GlobalAveragePool"]
    got = run_onnx(model, out, {"data": x})["pool"]
    np.testing.assert_allclose(got, caffe_pool_reference(x, None, None, None, pool, global_pool=True),
                               rtol=1e-5, atol=1e-6)


def caffe_max_windows(x, kernel, stride, before, out):
    """Caffe's MAX loops over N-D windows: output o of an axis reads the cells of [o*s - before, o*s - before + k)
    inside the input, starting from -FLT_MAX with a strict `>` (BVLC pooling_layer.cpp; synopsys-caffe's and
    R-C3D's the same), so an all -inf window keeps -FLT_MAX and a NaN cell never wins."""
    x = np.where(np.isnan(x), -np.inf, x)
    lowest = np.float32(-np.finfo(np.float32).max)
    y = np.full(x.shape[:2] + tuple(out), lowest, np.float32)
    for o in np.ndindex(*out):
        cells = tuple(slice(max(0, i * s - b), max(0, min(i * s - b + k, n)))
                      for i, k, s, b, n in zip(o, kernel, stride, before, x.shape[2:]))
        win = x[(slice(None), slice(None)) + cells].reshape(x.shape[0], x.shape[1], -1)
        if win.shape[2]:
            y[(slice(None), slice(None)) + o] = np.maximum(win.max(2), lowest)
    return y


# (params, input shape, before pads, the -inf cells: (n, c, rows, cols))
MAX_OF_MINUS_INF = {
    "plain": ("pool: MAX kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 2", (2, 3, 7, 6), (0, 0),
              [(0, 1, slice(0, 2), slice(0, 3)), (1, 2, slice(6, 7), slice(4, 6))]),   # last: a ceil window
    "padded_ceil": ("pool: MAX kernel_size: 3 stride: 2 pad: 1", (2, 2, 8, 5), (1, 1),
                    [(1, 0, slice(0, 2), slice(0, 2)), (0, 1, slice(7, 8), slice(3, 5))]),
    "padded_wide": ("pool: MAX kernel_h: 3 kernel_w: 3 stride_h: 2 stride_w: 3 pad_h: 2 pad_w: 1", (2, 2, 6, 7),
                    (2, 1), [(0, 0, slice(0, 1), slice(0, 2)), (1, 1, slice(4, 6), slice(5, 7))]),
    "floor": ("pool: MAX kernel_size: 2 stride: 2 round_mode: FLOOR", (2, 2, 5, 7), (0, 0),
              [(1, 1, slice(2, 4), slice(4, 6))]),
    "synopsys_edges": ("pool: MAX kernel_size: 3 stride: 2 pad_t: 1 pad_b: 0 pad_l: 2 pad_r: 1", (2, 2, 7, 6),
                       (1, 2), [(0, 1, slice(0, 2), slice(0, 1)), (1, 0, slice(5, 7), slice(3, 6))]),
}


@pytest.mark.parametrize("case", sorted(MAX_OF_MINUS_INF))
def test_max_pooling_of_minus_inf_window_gives_minus_flt_max(case, tmp_path):
    """Caffe's MAX starts each window at -FLT_MAX: an all -inf window gives -FLT_MAX in torch and model.py (torch's
    max pooling alone gives -inf).  The ONNX export keeps a plain MaxPool (see onnx_pooling.py): not checked here."""
    params, shape, before, holes = MAX_OF_MINUS_INF[case]
    model = caffeq.model.load_from_text(pool_net(shape, params))
    x = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    for n, c, rows, cols in holes:
        x[n, c, rows, cols] = -np.inf
    kernel, stride = model.graph.node("p").attrs["kernel"], model.graph.node("p").attrs["stride"]
    ref = caffe_max_windows(x, kernel, stride, before, model.blob_shapes["p"][2:])
    assert (ref == -np.finfo(np.float32).max).sum() >= len(holes)
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, opsets=())


@pytest.mark.parametrize("params,shape", [("pool: MAX global_pooling: true", (2, 3, 5, 7)),
                                          ("pool: MAX kernel_size: 2 stride: 2 pad: 1", (2, 2, 3, 5, 4))])
def test_global_and_3d_max_of_minus_inf_give_minus_flt_max(params, shape, tmp_path):
    """Global MAX (BVLC: the kernel set to H x W; torch and model.py) and N-D MAX (R-C3D's caffe3d, a 5-axis input,
    whose ONNX export floors too) of -inf cells."""
    model = caffeq.model.load_from_text(pool_net(shape, params))
    x = np.random.default_rng(12).standard_normal(shape).astype(np.float32)
    x[0, 1] = -np.inf                                   # a whole plane
    x[1, 0, ..., :1, :1] = -np.inf                      # the first window of the padded N-D pooling
    nsp = len(shape) - 2
    out = model.blob_shapes["p"][2:]
    if "global" in params:
        ref = caffe_max_windows(x, shape[2:], (1,) * nsp, (0,) * nsp, out)
    else:
        ref = caffe_max_windows(x, (2,) * nsp, (2,) * nsp, (1,) * nsp, out)
    assert ref[0, 1].max() == -np.finfo(np.float32).max
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, opsets=() if "global" in params else (13, None))


@pytest.mark.parametrize("case", sorted(MAX_OF_MINUS_INF) + ["global", "nd"])
@pytest.mark.parametrize("exact", [False, True])
def test_max_pooling_never_picks_nan(case, exact, tmp_path):
    """Caffe's `>` never picks a NaN cell (every build: its factory keeps MAX on Caffe's own layer under cuDNN): the
    window's largest other cell wins, a window of NaNs gives -FLT_MAX, in torch (both paths) and model.py.  The
    ONNX export does not (onnxruntime's MaxPool gives NaN): see pooling.py."""
    if case == "global":
        params, shape, before, holes = "pool: MAX global_pooling: true", (2, 3, 5, 7), (0, 0), \
            [(0, 1, slice(None), slice(None)), (1, 2, slice(1, 3), slice(0, 4))]
    elif case == "nd":
        params, shape, before, holes = "pool: MAX kernel_size: 2 stride: 2 pad: 1", (2, 2, 3, 5, 4), (1, 1, 1), \
            [(1, 0, slice(None), slice(0, 1), slice(0, 1)), (0, 1, slice(1, 2), slice(1, 4), slice(None))]
    else:
        params, shape, before, holes = MAX_OF_MINUS_INF[case]
    model = caffeq.model.load_from_text(pool_net(shape, params))
    x = np.random.default_rng(14).standard_normal(shape).astype(np.float32)
    for hole in holes:
        x[hole] = np.nan
    attrs = model.graph.node("p").attrs
    kernel = shape[2:] if case == "global" else attrs["kernel"]
    stride = (1,) * (len(shape) - 2) if case == "global" else attrs["stride"]
    ref = caffe_max_windows(x, kernel, stride, before, model.blob_shapes["p"][2:])
    assert not np.isnan(ref).any() and (ref == -np.finfo(np.float32).max).any()
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, opsets=(), exact=exact)


def test_max_pooling_mask_skips_nan(tmp_path):
    """The argmax mask top: a NaN cell is never the chosen one; a window of NaNs keeps -1 and -FLT_MAX."""
    model = caffeq.model.load_from_text(pool_net((2, 2, 5, 6), "pool: MAX kernel_size: 2 stride: 2", tops=2))
    x = np.random.default_rng(15).standard_normal((2, 2, 5, 6)).astype(np.float32)
    x[0, 0, :2, :2] = np.nan                  # the first window: all NaN
    x[1, 1, 2, 2] = np.nan                    # one cell of window (1, 1)
    x[1, 1, 2:4, 2:4] += np.array([[0, 9], [0, 0]], np.float32)   # its largest other cell: (2, 3)
    values, mask = caffe_max_windows(x, (2, 2), (2, 2), (0, 0), (3, 3)), np.empty((2, 2, 3, 3), np.float32)
    for n, c, i, j in np.ndindex(*mask.shape):
        win = x[n, c, 2 * i:2 * i + 2, 2 * j:2 * j + 2]
        best, where = -np.finfo(np.float32).max, -1
        for r, q in np.ndindex(*win.shape):     # Caffe's loop: row-major, strict `>`
            if win[r, q] > best:
                best, where = win[r, q], (2 * i + r) * 6 + 2 * j + q
        mask[n, c, i, j] = where
    assert mask[0, 0, 0, 0] == -1 and mask[1, 1, 1, 1] == 2 * 6 + 3
    check_everywhere(model, {"x": x}, {"p": values, "mask": mask}, tmp_path, opsets=(), exact=True)


def test_pooling_takes_one_bottom():
    """BVLC's ExactNumBottomBlobs is 1: a second bottom (gnng's per-GPU pairs) is refused, not left out while its
    second top is read as the argmax mask."""
    text = ('layer { name: "data" type: "Input" top: "a" top: "b" input_param { shape { dim: 2 dim: 3 dim: 6 dim: 5 } } }\n'
            'layer { name: "p" type: "Pooling" bottom: "a" bottom: "b" top: "pa" top: "pb" '
            'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n')
    with pytest.raises(caffeq.errors.CaffeqError, match="layer 'p' \\(Pooling\\): Pooling takes 1 bottom, got 2"):
        caffeq.model.load_from_text(text)


def test_one_level_spp_max_of_minus_inf_gives_minus_flt_max(tmp_path):
    """A one-level BVLC SPP is global pooling: a plane of -inf cells gives -FLT_MAX in torch and model.py."""
    x = np.random.default_rng(13).standard_normal((2, 3, 5, 4)).astype(np.float32)
    x[1, 2] = -np.inf
    text = ('layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 4 } } }\n'
            'layer { name: "spp" type: "SPP" bottom: "x" top: "p" spp_param { pyramid_height: 1 pool: MAX } }\n')
    model = caffeq.model.load_from_text(text)
    ref = caffe_max_windows(x, (5, 4), (1, 1), (0, 0), (1, 1)).reshape(2, 3)
    assert ref[1, 2] == -np.finfo(np.float32).max
    check_everywhere(model, {"x": x}, {"p": ref.reshape(model.blob_shapes["p"])}, tmp_path, opsets=())


def test_average_divisor_needs_the_correction_map(tmp_path):
    """A case where Caffe's divisor differs by window: the export multiplies by a constant map."""
    x = np.random.default_rng(2).standard_normal((2, 1, 8, 7)).astype(np.float32)
    model = caffeq.model.load_from_text(_pool_prototxt(x.shape, (3, 2), (2, 2), (1, 0), "AVE", True))
    out = tmp_path / "a.onnx"
    export_onnx(model, out, opset=13)
    m, _ = check_file(out)
    ops = [n.op_type for n in m.graph.node]
    assert "AveragePool" in ops and "Mul" in ops
    got = run_onnx(model, out, {"data": x})["pool"]
    np.testing.assert_allclose(got, caffe_pool_reference(x, (3, 2), (2, 2), (1, 0), "AVE"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("height,pool", [(1, "MAX"), (2, "AVE"), (3, "MAX"), (3, "AVE")])
def test_spp(height, pool, tmp_path):
    x = np.random.default_rng(3).standard_normal((2, 3, 13, 10)).astype(np.float32)
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 13 '
            'dim: 10 } } }\n'
            f'layer {{ name: "spp" type: "SPP" bottom: "data" top: "spp" spp_param {{ pyramid_height: {height} '
            f'pool: {pool} }} }}\n')
    model = caffeq.model.load_from_text(text)
    out = tmp_path / "spp.onnx"
    export_onnx(model, out, opset=13)
    check_file(out)
    got = run_onnx(model, out, {"data": x})["spp"]
    # Caffe's SPP: level l pools into 2^l bins with kernel ceil(H/bins), pad (k*bins - H + 1) // 2
    parts = []
    for level in range(height):
        bins = 2 ** level
        kh, kw = -(-13 // bins), -(-10 // bins)
        ph, pw = (kh * bins - 13 + 1) // 2, (kw * bins - 10 + 1) // 2
        if height == 1:
            parts.append(caffe_pool_reference(x, None, None, None, pool, global_pool=True))
        else:
            parts.append(caffe_pool_reference(x, (kh, kw), (kh, kw), (ph, pw), pool).reshape(2, -1))
    ref = parts[0] if height == 1 else np.concatenate(parts, axis=1)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run_onnx(model, out, {"data": x[:1]})["spp"], ref[:1], rtol=1e-5, atol=1e-6)


def kyu_sz_spp_geometry(size, level, base, fineness, overlap):
    """kyu-sz/caffe spp_layer.cpp GetPoolingParam along one axis: (kernel, stride, pad)."""
    bins = int(fineness ** level) * base
    kernel = math.ceil(size / bins)
    stride = max(1, kernel - int(np.float32(size) * np.float32(overlap)))
    while stride > 0:
        kernel = max(stride, size - (bins - 1) * stride)
        pad = (kernel + stride * (bins - 1) - size + 1) // 2
        if pad < kernel:
            return kernel, stride, pad
        stride -= 1
    raise AssertionError("no stride")


@pytest.mark.parametrize("params, height, size, pool", [
    ("fineness_h: 3 overlap_ratio_h: 0.3 fineness_w: 3 overlap_ratio_w: 0.3", 2, (13, 10), "MAX"),  # WPAL's spp3
    ("fineness_h: 3 overlap_ratio_h: 0.1 fineness_w: 1 overlap_ratio_w: 0.1", 2, (13, 10), "MAX"),  # its spp5
    ("base_bin_h: 2 base_bin_w: 2 fineness_h: 2 fineness_w: 2", 3, (13, 10), "MAX"),
    ("base_bin_h: 2 base_bin_w: 3", 1, (13, 10), "MAX"),                            # one level keeps its map
    # float32(20) * float32(0.35) is 7.0 where float64 gives 6.99999988: the cut is 7
    ("fineness_h: 3 overlap_ratio_h: 0.35 fineness_w: 3 overlap_ratio_w: 0.35", 2, (20, 20), "MAX"),
    ("fineness_h: 3 overlap_ratio_h: 0.3 base_bin_w: 2", 2, (13, 10), "AVE"),
    ("fineness_h: 3 overlap_ratio_h: 1.5 fineness_w: 3 overlap_ratio_w: 0.9", 2, (13, 10), "MAX"),   # stride 1
])
def test_kyu_sz_spp_pyramid(params, height, size, pool, tmp_path):
    x = np.random.default_rng(4).standard_normal((2, 3) + size).astype(np.float32)
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 '
            f'dim: {size[0]} dim: {size[1]} }} }} }}\n'
            f'layer {{ name: "spp" type: "SPP" bottom: "data" top: "spp" spp_param {{ pyramid_height: {height} '
            f'pool: {pool} {params} }} }}\n')
    model = caffeq.model.load_from_text(text)
    fields = dict(kv.split(": ") for kv in re.findall(r"\w+: -?[\d.]+", params))
    get = lambda k, d: float(fields.get(k, d))   # noqa: E731
    parts = []
    for level in range(height):
        kh, sh, ph = kyu_sz_spp_geometry(size[0], level, int(get("base_bin_h", 1)), int(get("fineness_h", 2)),
                                         get("overlap_ratio_h", 0))
        kw, sw, pw = kyu_sz_spp_geometry(size[1], level, int(get("base_bin_w", 1)), int(get("fineness_w", 2)),
                                         get("overlap_ratio_w", 0))
        parts.append(caffe_pool_reference(x, (kh, kw), (sh, sw), (ph, pw), pool))
    ref = parts[0] if height == 1 else np.concatenate([p.reshape(2, -1) for p in parts], axis=1)
    assert model.blob_shapes["spp"] == ref.shape
    np.testing.assert_allclose(model.run({"data": x})["spp"], ref, rtol=1e-6, atol=1e-6)
    out = tmp_path / "spp.onnx"
    export_onnx(model, out, opset=13)
    np.testing.assert_allclose(run_onnx(model, out, {"data": x})["spp"], ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model_py_outputs(model, {"data": x}, tmp_path)["spp"], ref, rtol=1e-6, atol=1e-6)


def test_kyu_sz_spp_refuses_a_level_its_check_refuses():
    # 3 x 2^2 = 12 bins across 10 columns: no stride keeps the padding below the kernel (CHECK_GT(stride_w, 0))
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 13 dim: 10 } } }\n'
            'layer { name: "spp" type: "SPP" bottom: "data" top: "spp" spp_param { pyramid_height: 3 base_bin_w: 3 } }')
    with pytest.raises(caffeq.CaffeqError, match="SPP level 2: no stride keeps the padding below the kernel"):
        caffeq.model.load_from_text(text)


@pytest.mark.parametrize("ratio", ["-0.5", "inf", "nan"])
def test_kyu_sz_spp_refuses_overlap_ratios_off_its_range(ratio):
    # below 0 the fork's windows grow past the map (a -1e8 ratio asks for a 100 GB padded copy)
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 13 dim: 10 } } }\n'
            'layer { name: "spp" type: "SPP" bottom: "data" top: "spp" spp_param { pyramid_height: 2 '
            f'overlap_ratio_h: {ratio} }} }}')
    with pytest.raises(caffeq.CaffeqError, match="spp_param.overlap_ratio_h must be a finite ratio >= 0"):
        caffeq.model.load_from_text(text)


def test_bvlc_spp_refuses_a_level_whose_padding_reaches_its_kernel():
    # level 2 of a 5x5 map: 4 bins, kernel ceil(5 / 4) = 2, pad (2 * 4 - 5 + 1) // 2 = 2; BVLC's Pooling
    # CHECKs pad < kernel
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 5 dim: 5 } } }\n'
            'layer { name: "spp" type: "SPP" bottom: "data" top: "spp" spp_param { pyramid_height: 4 } }')
    with pytest.raises(caffeq.CaffeqError, match=r"SPP level 2 on a 5x5 map pads \[2, 2\] with a \[2, 2\] kernel"):
        caffeq.model.load_from_text(text)


# ---- batch, optimization, names, stats --------------------------------------------------------

def test_fixed_batch(tmp_path):
    case = Case(FIXTURES / "net_lenet")
    model = case.load()
    out = tmp_path / "b.onnx"
    stats = export_onnx(model, out, batch=3)
    assert stats["batch"] == 3
    m, _ = check_file(out)
    for vi in list(m.graph.input) + list(m.graph.output):
        dims = vi.type.tensor_type.shape.dim
        assert dims[0].dim_value == 3 and not dims[0].dim_param
    x = np.random.default_rng(0).standard_normal((3,) + tuple(model.inputs["data"][1:])).astype(np.float32)
    got = run_onnx(model, out, {"data": x})
    ref = model.run({"data": x})
    for k, v in got.items():
        assert_rel(v, ref[k], k)
    with pytest.raises(Exception, match="dimension|shape|Got"):
        run_onnx(model, out, {"data": x[:2]})


def test_dynamic_batch_is_the_default(tmp_path):
    model = Case(FIXTURES / "conv_basic").load()
    out = tmp_path / "d.onnx"
    stats = export_onnx(model, out)
    assert stats["batch"] == "dynamic"
    assert stats["inputs"]["data"][0] == "N" and stats["outputs"]["conv"][0] == "N"
    x = np.random.default_rng(0).standard_normal((5,) + tuple(model.inputs["data"][1:])).astype(np.float32)
    assert_rel(run_onnx(model, out, {"data": x})["conv"], model.run({"data": x})["conv"], "conv")


@pytest.mark.parametrize("name", ["batchnorm_scale", "net_resnet_mini", "net_mobilenet_block",
                                  "digits_meanfile"])
def test_optimization_reduces_nodes_and_keeps_outputs(name, tmp_path):
    if name == "digits_meanfile":
        d = FIXTURES / name
        model = caffeq.load(str(d / "deploy.prototxt"), str(d / "model.caffemodel"))
        inputs = {"data": np.random.default_rng(0).random(model.inputs["data"]).astype(np.float32)}
        caffe, tol = {}, (1e-5, 1e-4)
    else:
        case = Case(FIXTURES / name)
        model = case.load()
        inputs, caffe, tol = case.inputs, case.outputs, case.tolerance
    a, b = tmp_path / "opt.onnx", tmp_path / "raw.onnx"
    s_opt = export_onnx(model, a)
    s_raw = export_onnx(model, b, optimize=False)
    assert s_opt["nodes_after"] < s_opt["nodes_before"]
    assert s_raw["nodes_after"] == s_raw["nodes_before"] == s_opt["nodes_before"]
    assert "BatchNormalization" not in s_opt["op_counts"]
    m_opt, m_raw = onnx.load(str(a)), onnx.load(str(b))
    assert len(m_opt.graph.node) == s_opt["nodes_after"] < len(m_raw.graph.node)
    ref = model.run(inputs)
    got_opt, got_raw = run_onnx(model, a, inputs), run_onnx(model, b, inputs)
    for k in ref:
        assert_rel(got_raw[k], ref[k], f"{k} (not optimized)")
        assert_rel(got_opt[k], ref[k], f"{k} (optimized)", rtol=1e-5)
        if k in caffe:
            assert_close(got_opt[k], caffe[k], *tol, what=f"{k} optimized vs Caffe")


def test_names_and_initializers_follow_caffe(tmp_path):
    model = Case(FIXTURES / "net_lenet").load()
    out = tmp_path / "n.onnx"
    export_onnx(model, out, optimize=False)
    m = onnx.load(str(out))
    inits = {t.name: t for t in m.graph.initializer}
    for layer in model.layers:
        if layer.blobs:
            for i, name in enumerate(layer.spec.blob_names[:len(layer.blobs)]):
                key = f"{layer.name}.{name}"
                assert key in inits, key
                np.testing.assert_array_equal(onnx.numpy_helper.to_array(inits[key]), layer.blobs[i])
    assert [i.name for i in m.graph.input] == list(model.inputs)
    assert [o.name for o in m.graph.output] == model.outputs
    assert {n.name for n in m.graph.node} >= {l.name for l in model.layers if not l.spec.is_data}


def test_stats_are_printable(tmp_path):
    model = Case(FIXTURES / "batchnorm_scale").load()
    stats = export_onnx(model, tmp_path / "s.onnx")
    for key in ("path", "opset", "batch", "nodes_before", "nodes_after", "op_counts", "file_size",
                "inputs", "outputs", "notes", "dropped", "refused"):
        assert key in stats
    assert stats["file_size"] == os.path.getsize(tmp_path / "s.onnx")
    text = format_stats(stats)
    assert f"{stats['nodes_before']} before optimization, {stats['nodes_after']} after" in text


def test_opset_range_is_checked(tmp_path):
    model = Case(FIXTURES / "conv_basic").load()
    for bad in (12, 999, "x"):
        with pytest.raises(ExportError, match="opset"):
            export_onnx(model, tmp_path / "o.onnx", opset=bad)
    with pytest.raises(ExportError, match="batch"):
        export_onnx(model, tmp_path / "o.onnx", batch=0)
    assert not os.listdir(tmp_path)


# ---- train_val nets: their TEST inference graph ---------------------------------------------------

def test_train_val_exports_its_test_inference_graph(tmp_path):
    d = FIXTURES / "digits_meanfile"
    model = caffeq.load(str(d / "train_val.prototxt"), str(d / "model.caffemodel"))
    out = tmp_path / "tv.onnx"
    stats = export_onnx(model, out)
    check_file(out)
    assert list(stats["inputs"]) == ["data"]              # label fed only the loss and accuracy
    assert set(stats["dropped"]) == {n.name for n in model.layers if n.spec.is_training_only}
    assert stats["dropped"] and any("training-only" in n for n in stats["notes"])
    assert any("transform_param" in n for n in stats["notes"])
    m = onnx.load(str(out))
    assert not {n.op_type for n in m.graph.node} & {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}
    x = np.random.default_rng(0).random((4,) + tuple(model.inputs["data"][1:])).astype(np.float32)
    got = run_onnx(model, out, {"data": x})
    ref = model.run({"data": x, "label": np.zeros(4, np.float32)}, all_blobs=True)
    assert list(got) == list(stats["outputs"])
    for k, v in got.items():
        assert_rel(v, ref[k], k)


def test_losses_dropped_scores_become_outputs(tmp_path):
    case = Case(FIXTURES / "accuracy_softmax_loss")
    model = case.load()
    out = tmp_path / "l.onnx"
    stats = export_onnx(model, out)
    assert list(stats["outputs"]) == ["fc"] and list(stats["inputs"]) == ["data"]
    got = run_onnx(model, out, case.inputs)
    atol, rtol = case.tolerance
    assert_close(got["fc"], case.outputs["fc"], atol, rtol, "fc")


# ---- refusals and files ----------------------------------------------------------------------------

class _NoOnnx(caffeq.Layer):
    def forward(self, attrs, params, x):
        return x * 2


class _Refuses(caffeq.Layer):
    def forward(self, attrs, params, x):
        return x + 1

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]])
        raise ExportError(f"layer '{node.name}': refuses on purpose")


caffeq.register_layer("OnnxTestNoEmission", override=True)(_NoOnnx)
caffeq.register_layer("OnnxTestRefuses", override=True)(_Refuses)

REFUSED_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }
layer { name: "a" type: "OnnxTestNoEmission" bottom: "data" top: "a" }
layer { name: "r" type: "ReLU" bottom: "a" top: "r" }
layer { name: "b" type: "OnnxTestRefuses" bottom: "r" top: "b" }
layer { name: "c" type: "OnnxTestNoEmission" bottom: "b" top: "c" }
"""


def test_every_refusal_listed_at_once_and_nothing_written(tmp_path):
    model = caffeq.model.load_from_text(REFUSED_NET)
    out = tmp_path / "refused.onnx"
    with pytest.raises(ExportError) as e:
        export_onnx(model, out)
    assert e.value.refused == ["a", "b", "c"]
    msg = str(e.value)
    assert "3 layer(s) refused" in msg and "refuses on purpose" in msg and "OnnxTestNoEmission" in msg
    assert "\n" not in msg
    assert not os.listdir(tmp_path)


def test_failed_export_keeps_an_existing_file(tmp_path):
    out = tmp_path / "keep.onnx"
    out.write_bytes(b"old")
    with pytest.raises(ExportError):
        export_onnx(caffeq.model.load_from_text(REFUSED_NET), out)
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["keep.onnx"]


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    import caffeq.backends.onnx_backend as ob

    def boom(*a, **k):
        raise ExportError("checker says no")
    monkeypatch.setattr(ob, "check_written", boom)
    with pytest.raises(ExportError, match="checker says no"):
        export_onnx(Case(FIXTURES / "conv_basic").load(), tmp_path / "x.onnx")
    assert not os.listdir(tmp_path)
    with pytest.raises(ExportError):
        export_onnx(Case(FIXTURES / "conv_basic").load(), tmp_path / "x.onnx", external_data=True)
    assert not os.listdir(tmp_path)


def test_refuses_to_overwrite_its_inputs(tmp_path):
    src = FIXTURES / "conv_basic"
    for f in ("model.prototxt", "model.caffemodel"):
        shutil.copy(src / f, tmp_path / f)
    model = caffeq.load(str(tmp_path / "model.prototxt"), str(tmp_path / "model.caffemodel"))
    before = {f: (tmp_path / f).read_bytes() for f in ("model.prototxt", "model.caffemodel")}
    for target in before:
        with pytest.raises(ExportError, match="overwrite an input"):
            export_onnx(model, tmp_path / target)
    assert {f: (tmp_path / f).read_bytes() for f in before} == before
    assert sorted(os.listdir(tmp_path)) == sorted(before)


def test_external_data(tmp_path, monkeypatch):
    case = Case(FIXTURES / "net_lenet")
    model = case.load()
    out = tmp_path / "ext.onnx"
    stats = export_onnx(model, out, external_data=True)
    assert stats["data_file"] == str(out) + ".data"
    assert sorted(os.listdir(tmp_path)) == ["ext.onnx", "ext.onnx.data"]
    assert os.path.getsize(out) < 20000 < os.path.getsize(str(out) + ".data")
    check_file(out)
    got = run_onnx(model, out, case.inputs)
    ref = model.run(case.inputs)
    for k in ref:
        assert_rel(got[k], ref[k], k)
    # "auto" switches to external data past the protobuf limit (lowered here)
    import caffeq.backends.onnx_backend as ob
    monkeypatch.setattr(ob, "_MAX_EMBEDDED", 10000)
    auto = tmp_path / "auto.onnx"
    assert export_onnx(model, auto)["data_file"] == str(auto) + ".data"
    assert_rel(run_onnx(model, auto, case.inputs)["prob"], ref["prob"], "prob")


def test_written_bytes_equal_the_weights(tmp_path):
    """The streamed writer (and its file-to-file copy of mmap'd weights) writes what onnx reads."""
    case = Case(FIXTURES / "net_inception_block")
    model = case.load()
    out = tmp_path / "w.onnx"
    export_onnx(model, out, optimize=False)
    m = onnx.load(str(out))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    n = 0
    for layer in model.layers:
        for i, arr in enumerate(layer.blobs or []):
            key = f"{layer.name}.{layer.spec.blob_names[i]}"
            if key in inits:
                np.testing.assert_array_equal(inits[key], arr)
                n += 1
    assert n >= 4


@pytest.mark.parametrize("scheme", ["fp16", "int8", "binary"])
def test_quantized_models_export(scheme, tmp_path):
    case = Case(FIXTURES / "net_resnet_mini")
    q = caffeq.quantize(case.load(), scheme, keep="none")
    out = tmp_path / "q.onnx"
    export_onnx(q, out)
    check_file(out)
    ref = q.run(case.inputs)
    got = run_onnx(q, out, case.inputs)
    for k in ref:
        assert_rel(got[k], ref[k], f"{scheme}/{k}")


def test_batchnorm_without_global_stats_uses_batch_statistics(tmp_path):
    """use_global_stats: false normalizes by the batch's statistics at test time, in ONNX too."""
    import onnxruntime as ort

    from caffeq.model import load_from_text
    m = load_from_text("""
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 5 dim: 2 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "data" top: "bn" batch_norm_param { use_global_stats: false } }
    """, random_weights=True)
    x = np.random.default_rng(0).standard_normal((4, 3, 5, 2)).astype(np.float32) * 3 + 1
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    ref = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(m.run(x)["bn"], ref, rtol=1e-5, atol=1e-5)
    for optimize in (False, True):
        path = tmp_path / f"bn{optimize}.onnx"
        m.export_onnx(str(path), optimize=optimize)
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"data": x})[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
