"""shenyunhang/caffe-wsl (78b2f71; GeneralPooling from 77892fa): PolarConstraint (polar_constraint_layer.cu),
RoIScorePooling (roi_score_pooling_layer.cpp Forward_cpu), GeneralPooling (general_pooling_layer.cpp Forward_cpu),
LoopROIPooling (loop_roi_pooling_layer.cu RegionPoolForward), MIL (mil_layer.cu with cpg_layer.cu and
repartition_layer.cpp / .cu) and Statistics, against loops written from the C++; and shenyunhang/CSC's nets."""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, check_everywhere, model_py_outputs, net, onnx_outputs, onnx_session, rng

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
FLT_MAX = F(3.4028234663852886e38)
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
CSC = "shenyunhang__CSC__models__pascal_voc__"
FMAX, FAVE, SUM, FSUM, TSUM, FAVEMAX, TAVEMAX, MUL, MAX = 0, 1, 2, 3, 4, 5, 6, 7, 8
NAMES = {FMAX: "FMAX", FAVE: "FAVE", SUM: "SUM", FSUM: "FSUM", TSUM: "TSUM", FAVEMAX: "FAVEMAX",
         TAVEMAX: "TAVEMAX", MUL: "MUL", MAX: "MAX"}


# ---- PolarConstraint ------------------------------------------------------------------------------

def polar_ref(x, s, polar):
    w = s.reshape(-1).copy()
    for i, v in enumerate(w):
        if polar:
            w[i] = 0 if v < 0 else v
        else:
            w[i] = -(0 if v > 0 else v)
    return (w * x.reshape(-1)).reshape(x.shape)


@pytest.mark.parametrize("polar", [True, False])
def test_polar_constraint(polar, tmp_path):
    r = rng(1)
    x = r.standard_normal((7, 3, 2)).astype(F)
    s = r.uniform(-1, 1, (7, 3, 2, 1)).astype(F)
    s[0, 0, 0, 0] = 0
    layer = (f'layer {{ name: "p" type: "PolarConstraint" bottom: "x" bottom: "s" top: "o" '
             f'polar_constraint_param {{ polar: {str(polar).lower()} }} }}')
    model = load_from_text(net(layer, inputs={"x": x.shape, "s": s.shape}))
    assert model.blob_shapes["o"] == (7, 3, 2)
    check_everywhere(model, {"x": x, "s": s}, {"o": polar_ref(x, s, polar)}, tmp_path)


def test_polar_constraint_shapes_must_agree():
    with pytest.raises(LayerError, match="PolarConstraint's bottoms need the same shape"):
        load_from_text(net('layer { name: "p" type: "PolarConstraint" bottom: "x" bottom: "s" top: "o" }',
                           inputs={"x": (7, 3, 2), "s": (7, 6)}))


# ---- RoIScorePooling ------------------------------------------------------------------------------

def roi_score_ref(x, counts, axis, mode, thr):
    """Forward_cpu's loops (TAVEMAX's inner index running to the outer size, as the fork's)."""
    shape = x.shape
    outer, ch, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    num = counts.reshape(-1).astype(F)
    images = num.size
    flat = x.reshape(-1)
    dim = x.size // outer
    top_shape = list(shape)
    top_shape[axis] = images
    top = np.full(math.prod(top_shape), -FLT_MAX if mode == MAX else 0, F)
    for i in range(outer):
        for k in range(outer if mode == TAVEMAX else inner):
            img, seen, kept, total, best = 0, 0, 0, F(0), -FLT_MAX
            for j in range(ch):
                p = (i * images + img) * inner + k
                v = flat[i * dim + j * inner + k]
                if mode == SUM:
                    top[p] += v
                if mode in (MAX, TAVEMAX) and v > best:
                    best = v
                if mode in (TSUM, TAVEMAX):
                    total += v
                    if not v < thr:
                        top[p] += v
                        kept += 1
                seen += 1
                if seen == num[img]:
                    if mode == MAX:
                        top[p] = best
                    elif mode == TSUM and kept == 0:
                        top[p] = total
                    elif mode == TAVEMAX:
                        top[p] = best if kept == 0 else top[p] / F(kept)
                    img, seen, kept, total, best = img + 1, 0, 0, F(0), -FLT_MAX
    return top.reshape(top_shape)


def roi_score_net(x_shape, n_shape, pool, axis=0, threshold=0.0):
    return net(f'layer {{ name: "p" type: "RoIScorePooling" bottom: "x" bottom: "n" top: "o" roi_score_pooling_param '
               f'{{ pool: {pool} axis: {axis} threshold: {threshold} }} }}', inputs={"x": x_shape, "n": n_shape})


@pytest.mark.parametrize("mode", [SUM, MAX, TSUM, TAVEMAX])
@pytest.mark.parametrize("shape, axis, counts", [
    ((9, 5), 0, [4, 5]),                 # CSC's (rois, classes) scores, two images
    ((2, 7, 3), 1, [3, 1, 3]),           # TAVEMAX fills the first 2 of 3 inner positions only
    ((7, 4), 0, [2.5, 4.5]),             # a count that is no whole number never closes its image
])
def test_roi_score_pooling(mode, shape, axis, counts, tmp_path):
    x = rng(2).standard_normal(shape).astype(F)
    x.reshape(-1)[3] = F(0.25)           # equal to the threshold: kept (not below it)
    n = np.array(counts, F)
    model = load_from_text(roi_score_net(x.shape, n.shape, NAMES[mode], axis, 0.25))
    want = roi_score_ref(x, n, axis, mode, F(0.25))
    assert model.blob_shapes["o"] == want.shape
    check_everywhere(model, {"x": x, "n": n}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("counts", [[1, 5], [2.5, 3.5]])
def test_roi_score_pooling_tsum_where_nothing_passes(counts, tmp_path):
    """A closed image where nothing passes sums all its rois; one that never closes (a count that is no whole
    number) keeps the thresholded sum, 0."""
    x = -np.abs(rng(3).standard_normal((6, 4))).astype(F)
    n = np.array(counts, F)
    model = load_from_text(roi_score_net(x.shape, n.shape, "TSUM", 0, 0.5))
    want = roi_score_ref(x, n, 0, TSUM, F(0.5))
    if counts[0] != int(counts[0]):
        assert not want.any()
    check_everywhere(model, {"x": x, "n": n}, {"o": want}, tmp_path, atol=1e-6)


def test_roi_score_pooling_defaults_and_counts_blob(tmp_path):
    """pool MAX and axis 1 by default; the image count is the counts blob's whole size (here (1, 3))."""
    x = rng(15).standard_normal((2, 7, 3)).astype(F)
    n = np.array([[3, 1, 3]], F)
    model = load_from_text(net('layer { name: "p" type: "RoIScorePooling" bottom: "x" bottom: "n" top: "o" }',
                               inputs={"x": x.shape, "n": n.shape}))
    want = roi_score_ref(x, n, 1, MAX, F(0))
    assert model.blob_shapes["o"] == want.shape == (2, 3, 3)
    check_everywhere(model, {"x": x, "n": n}, {"o": want}, tmp_path)


def test_roi_score_pooling_tavemax_outer_equal_to_inner(tmp_path):
    """TAVEMAX's inner loop runs to the outer size: equal to the inner size, every position is filled."""
    x = rng(16).standard_normal((3, 5, 3)).astype(F)
    n = np.array([2, 3], F)
    model = load_from_text(roi_score_net(x.shape, n.shape, "TAVEMAX", 1, 0.3))
    want = roi_score_ref(x, n, 1, TAVEMAX, F(0.3))
    assert (want != 0).all()
    check_everywhere(model, {"x": x, "n": n}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_roi_score_and_general_maxima_skip_nan_and_minus_inf(tmp_path):
    """The forks' maxima start at -FLT_MAX and take a value only if greater: NaN and -inf never win (a NaN first
    in its group, where onnxruntime's ReduceMax would keep it)."""
    x = rng(17).standard_normal((6, 4)).astype(F)
    x[0, :] = np.nan
    x[3, 0] = -np.inf
    x[4, 2] = np.nan
    n = np.array([2, 4], F)
    model = load_from_text(roi_score_net(x.shape, n.shape, "MAX", 0))
    want = roi_score_ref(x, n, 0, MAX, F(0))
    assert np.isfinite(want).all()
    check_everywhere(model, {"x": x, "n": n}, {"o": want}, tmp_path)
    f = np.ones((6, 4), F)
    f[1:, 1] = 0                                     # class 1: only the NaN roi passes the filter
    for mode in (MAX, FMAX):
        shapes = {"x": x.shape, "f": f.shape} if mode == FMAX else {"x": x.shape}
        feeds = {"x": x, "f": f} if mode == FMAX else {"x": x}
        model = load_from_text(general_net(shapes, NAMES[mode], 0))
        want = general_ref(x, f if mode == FMAX else None, 0, mode, F(0))
        check_everywhere(model, feeds, {"o": want}, tmp_path)


@pytest.mark.parametrize("counts, match", [([3, 3], "add up to"), ([7, 0], "above 0"), ([8, -1], "above 0")])
def test_roi_score_pooling_count_checks(counts, match):
    n = np.array(counts, F)
    model = load_from_text(roi_score_net((7, 4), n.shape, "SUM"))
    with pytest.raises(LayerError, match=match):
        model.run({"x": np.zeros((7, 4), F), "n": n})


@pytest.mark.parametrize("counts", [[3, 0, 4], [3, 5]])
@pytest.mark.parametrize("mode", [SUM, MAX, TSUM])
def test_roi_score_pooling_exports_follow_the_loop_past_a_count_of_0(mode, counts, tmp_path):
    """A count of 0 (or below) never closes its image, as a fractional one, nor does one past the last roi:
    Caffe's CHECKs stop the run (so does caffeq's forward); the exports, which check nothing, give what the loop
    would."""
    x = rng(13).standard_normal((7, 4)).astype(F)
    n = np.array(counts, F)
    model = load_from_text(roi_score_net(x.shape, n.shape, NAMES[mode], 0, 0.0))
    want = roi_score_ref(x, n, 0, mode, F(0))
    with pytest.raises(LayerError, match="must each be above 0 and add up to"):
        model.run({"x": x, "n": n})
    for got in (onnx_outputs(model, {"x": x, "n": n}, tmp_path)["o"], model_py_outputs(model, {"x": x, "n": n},
                                                                                        tmp_path)["o"]):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


def test_roi_score_pooling_max_not_found():
    x = np.full((3, 2), -np.inf, F)
    n = np.array([3], F)
    with pytest.raises(LayerError, match="max value not found"):
        load_from_text(roi_score_net(x.shape, n.shape, "MAX")).run({"x": x, "n": n})


@pytest.mark.parametrize("pool, shape, axis, match", [("MUL", (7, 4), 0, "NOT_IMPLEMENTED"),
                                                      ("TAVEMAX", (5, 2, 3), 2, "past the inner size")])
def test_roi_score_pooling_refusals(pool, shape, axis, match, tmp_path):
    model = load_from_text(roi_score_net(shape, (2,), pool, axis))
    feeds = {"x": np.ones(shape, F), "n": np.array([1, shape[axis] - 1], F)}
    with pytest.raises(LayerError, match=match):
        model.run(feeds)
    with pytest.raises(ExportError, match=match):
        onnx_outputs(model, feeds, tmp_path)


def test_roi_score_pooling_reads_num_and_channels():
    with pytest.raises(LayerError, match="at most 4 axes"):
        load_from_text(roi_score_net((2, 3, 4, 5, 6), (2,), "SUM"))
    with pytest.raises(LayerError, match="roi_score_pooling_param.axis 2 out of range"):
        load_from_text(roi_score_net((7, 4), (2,), "SUM", axis=2))


# ---- GeneralPooling -------------------------------------------------------------------------------

def general_ref(x, f, axis, mode, thr):
    """Forward_cpu's loops."""
    shape = list(x.shape)
    n, c = (shape + [1, 1])[:2]
    top_shape = [n, c, 1, 1] if mode == MUL else shape[:axis] + [1] + shape[axis + 1:]
    if mode == MUL:
        return (x.reshape(-1) * f.reshape(-1)).reshape(top_shape)
    if mode in (SUM, MAX, TAVEMAX):
        return roi_score_ref(x, np.array([shape[axis]], F), axis, mode, thr).reshape(top_shape)
    top = np.full(math.prod(top_shape), -FLT_MAX if mode == FMAX else 0, F)
    flat = x.reshape(-1)
    filt = f.reshape(-1) if f is not None else None
    for cc in range(c):
        vals = [flat[r * c + cc] for r in range(n)]
        picked = [filt[r * c + cc] != 0 for r in range(n)] if filt is not None else [True] * n
        best_all = max([-FLT_MAX] + [v for v in vals if v > -FLT_MAX])
        best_picked = max([-FLT_MAX] + [v for v, p in zip(vals, picked) if p and v > -FLT_MAX])
        acc, size = F(0), 0
        for v, p in zip(vals, picked):
            if mode == FSUM and p or mode == FAVE and p:
                acc += v
                size += 1
            if mode == TSUM and not v < thr or mode == FAVEMAX and p and not v < thr:
                acc += v
                size += 1
        if mode == FMAX:
            top[cc] = best_picked if any(picked) else best_all
        elif mode == FSUM:
            top[cc] = acc
        elif mode == FAVE:
            top[cc] = acc / F(size) if size else np.cumsum(np.array(vals, F), dtype=F)[-1] / F(n)
        elif mode == TSUM:
            top[cc] = acc if size else np.cumsum(np.array(vals, F), dtype=F)[-1]
        else:
            top[cc] = acc / F(size) if size else (best_picked if best_picked != -FLT_MAX else best_all)
    return top.reshape(top_shape)


def general_net(shapes, pool, axis, threshold=0.0):
    bottoms = " ".join(f'bottom: "{b}"' for b in shapes)
    return net(f'layer {{ name: "g" type: "GeneralPooling" {bottoms} top: "o" general_pooling_param '
               f'{{ pool: {pool} axis: {axis} threshold: {threshold} }} }}', inputs=shapes)


@pytest.mark.parametrize("mode, shape, axis", [(SUM, (6, 4), 0), (MAX, (3, 5, 2), 1), (TAVEMAX, (2, 7, 3), 1),
                                               (SUM, (2, 3, 4, 5), -1)])
def test_general_pooling_along_an_axis(mode, shape, axis, tmp_path):
    x = rng(4).standard_normal(shape).astype(F)
    model = load_from_text(general_net({"x": shape}, NAMES[mode], axis, 0.1))
    want = general_ref(x, None, axis % len(shape), mode, F(0.1))
    assert model.blob_shapes["o"] == want.shape
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", [FMAX, FAVE, FSUM, TSUM, FAVEMAX, MUL])
@pytest.mark.parametrize("shape, axis", [((6, 4), 0), ((6, 4, 1, 2), 0), ((3, 2), 1)])
def test_general_pooling_per_class(mode, shape, axis, tmp_path):
    r = rng(5)
    x = r.standard_normal(shape).astype(F)
    f = r.integers(0, 3, shape[:2]).astype(F) - 1     # -1, 0, 1: the filter's zeros leave rois out
    f[:, 0] = 0                                      # a class no roi passes: the fallbacks
    f[1, 1] = 0.5
    shapes = {"x": shape, "f": f.shape}
    if mode == MUL and math.prod(shape) != f.size:
        model = load_from_text(general_net(shapes, "MUL", axis))
        with pytest.raises(LayerError, match="writes past it"):
            model.run({"x": x, "f": f})
        return
    model = load_from_text(general_net(shapes, NAMES[mode], axis, 0.2))
    want = general_ref(x, f, axis, mode, F(0.2))
    assert model.blob_shapes["o"] == want.shape
    check_everywhere(model, {"x": x, "f": f}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_general_pooling_tsum_without_a_filter(tmp_path):
    x = rng(6).standard_normal((5, 3)).astype(F)
    x[:, 2] = -1
    x[:, 1] = -1
    x[3, 1] = 0                                      # equal to the threshold: kept (not below it)
    model = load_from_text(general_net({"x": x.shape}, "TSUM", 0, 0.0))
    check_everywhere(model, {"x": x}, {"o": general_ref(x, None, 0, TSUM, F(0))}, tmp_path, atol=1e-6)


@pytest.mark.parametrize("shapes, pool, axis, match", [
    ({"x": (6, 4)}, "FMAX", 0, "needs two bottoms"),
    ({"x": (6, 4), "f": (6, 3)}, "FSUM", 0, "filter needs the scores' num 6 and channels 4"),
    ({"x": (6, 4), "f": (6, 4, 2)}, "FSUM", 0, "and no more"),
])
def test_general_pooling_refusals(shapes, pool, axis, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(general_net(shapes, pool, axis))


@pytest.mark.parametrize("shape, pool, axis, match", [((3, 5), "FSUM", 1, "writes past it"),
                                                      ((4, 2, 3), "TAVEMAX", 2, "past the inner size")])
def test_general_pooling_overruns_are_refused_at_run(shape, pool, axis, match):
    shapes = {"x": shape, "f": shape[:2]} if pool == "FSUM" else {"x": shape}
    model = load_from_text(general_net(shapes, pool, axis))
    with pytest.raises(LayerError, match=match):
        model.run({k: np.ones(s, F) for k, s in shapes.items()})


# ---- LoopROIPooling -------------------------------------------------------------------------------

def c_round(v):
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))


def loop_roi_ref(x, rois, ph, pw, scale):
    """RegionPoolForward, one bin at a time."""
    _, c, h, w = x.shape
    out = np.zeros((rois.shape[0], c, ph, pw), F)
    for r, roi in enumerate(rois.reshape(-1, 9)):
        b = int(roi[0])
        sw, sh, ew, eh, swi, shi, ewi, ehi = (c_round(F(v) * F(scale)) for v in roi[1:])
        bin_h = F(max(eh - sh + 1, 1)) / F(ph)
        bin_w = F(max(ew - sw + 1, 1)) / F(pw)
        for p in range(ph):
            for q in range(pw):
                hs = min(max(math.floor(F(p) * bin_h) + sh, 0), h)
                he = min(max(math.ceil(F(p + 1) * bin_h) + sh, 0), h)
                ws = min(max(math.floor(F(q) * bin_w) + sw, 0), w)
                we = min(max(math.ceil(F(q + 1) * bin_w) + sw, 0), w)
                best = np.zeros(c, F)
                for hh in range(hs, he):
                    for ww in range(ws, we):
                        if shi < hh < ehi and swi < ww < ewi:
                            continue
                        best = np.where(x[b, :, hh, ww] > best, x[b, :, hh, ww], best)
                out[r, :, p, q] = best
    return out


def test_loop_roi_pooling(tmp_path):
    x = rng(7).standard_normal((2, 3, 9, 11)).astype(F)
    x[1, :, 4, 5] = np.nan                       # inside the hole of roi 1: never read
    rois = np.array([[0, 2, 2, 18, 14, 6, 5, 13, 11],     # outer box with a hole (spatial_scale 0.5)
                     [1, 0, 0, 21, 17, 7, 6, 12, 10],
                     [0, 4, 3, 16, 12, 30, 30, 31, 31],     # the inner box outside: no hole
                     [1, 9, 9, 3, 3, 0, 0, 0, 0],           # malformed: one cell
                     [0, -3, -5, 5.5, 3, 1, -2, 3, 1]], F)  # past the edge; -1.5 and -2.5 round away from 0
    layer = ('layer { name: "l" type: "LoopROIPooling" bottom: "x" bottom: "rois" top: "o" '
             'loop_roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 } }')
    model = load_from_text(net(layer, inputs={"x": x.shape, "rois": rois.shape}))
    assert model.blob_shapes["o"] == (5, 3, 3, 2)
    want = loop_roi_ref(x, rois, 3, 2, 0.5)
    assert not np.isnan(want).any() and (want >= 0).all()
    check_everywhere(model, {"x": x, "rois": rois}, {"o": want}, tmp_path)


def test_loop_roi_pooling_bins_of_one_cell(tmp_path):
    """Bins of one cell each show every cell's reading: the hole's edges (strictly inside is left out), negative
    cells reading 0, and the hole's rows and columns kept apart."""
    x = (rng(14).standard_normal((2, 3, 10, 12)) - 0.5).astype(F)
    x[1, :, 7, 2] = x[1, :, 0, 0] = np.nan           # read (outside the hole): never above the maximum's 0
    rois = np.array([[1, 0, 0, 11, 9, 3, 2, 8, 6],       # hole: rows 3..5, columns 4..7
                     [0, 1, 1, 12, 10, 4, 3, 9, 7]], F)   # one cell down and right: the last row and column empty
    layer = ('layer { name: "l" type: "LoopROIPooling" bottom: "x" bottom: "rois" top: "o" '
             'loop_roi_pooling_param { pooled_h: 10 pooled_w: 12 } }')
    model = load_from_text(net(layer, inputs={"x": x.shape, "rois": rois.shape}))
    want = loop_roi_ref(x, rois, 10, 12, 1.0)
    np.testing.assert_array_equal(want[0, :, 3:6, 4:8], 0)
    np.testing.assert_array_equal(want[0, :, 2, 4:8], np.maximum(x[1, :, 2, 4:8], 0))
    np.testing.assert_array_equal(want[1, :, 9], 0)
    assert not np.isnan(want).any() and (want[0] == 0).any() and (want[0] > 0).any()
    check_everywhere(model, {"x": x, "rois": rois}, {"o": want}, tmp_path)


def test_loop_roi_pooling_roi_by_roi_with_a_gradient():
    """range_max_bins gives way to the roi-by-roi maxima where a gradient is wanted: the same numbers."""
    import torch

    from caffeq.layers.caffe_wsl import loop_roi_max_pool
    x = torch.from_numpy(rng(8).standard_normal((1, 2, 7, 6)).astype(F)).requires_grad_(True)
    rois = torch.tensor([[0, 0, 0, 10, 12, 2, 3, 6, 8], [0, 2, 1, 11, 9, 0, 0, 0, 0]], dtype=torch.float32)
    out = loop_roi_max_pool(x, rois, 2, 3, 0.5)
    out.sum().backward()
    np.testing.assert_array_equal(out.detach().numpy(), loop_roi_ref(x.detach().numpy(), rois.numpy(), 2, 3, 0.5))


@pytest.mark.parametrize("param, rois, match", [
    ("pooled_h: 0 pooled_w: 2", (3, 9), "pooled_h and pooled_w must be > 0"),
    ("pooled_h: 2 pooled_w: 2", (3, 5), "rois must be \\(R, 9\\)"),
])
def test_loop_roi_pooling_refusals(param, rois, match):
    layer = (f'layer {{ name: "l" type: "LoopROIPooling" bottom: "x" bottom: "r" top: "o" '
             f'loop_roi_pooling_param {{ {param} }} }}')
    with pytest.raises(LayerError, match=match):
        load_from_text(net(layer, inputs={"x": (1, 2, 5, 5), "r": rois}))


def test_loop_roi_pooling_batch_index_outside():
    layer = ('layer { name: "l" type: "LoopROIPooling" bottom: "x" bottom: "r" top: "o" '
             'loop_roi_pooling_param { pooled_h: 2 pooled_w: 2 } }')
    model = load_from_text(net(layer, inputs={"x": (1, 2, 5, 5), "r": (1, 9)}))
    with pytest.raises(LayerError, match="batch index 2 is outside the batch of 1"):
        model.run({"x": np.zeros((1, 2, 5, 5), F), "r": np.array([[2, 0, 0, 1, 1, 0, 0, 0, 0]], F)})


# ---- MIL (CPG) and Statistics ---------------------------------------------------------------------

HEAD_CPG = 'predict_blob_name: "cls" cpg_blob_name: "data"'
OLD_CPG = 'start_layer_name: "conv1" end_layer_name: "cls" opg_blob_name: "data"'


def mil_net(cpg, tops=("sel",), bottoms=("labels", "cls", "rois", "scores"), labels=(1, 6), cls=(1, 6)):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    bottom_text = " ".join(f'bottom: "{b}"' for b in bottoms)
    return net(f'layer {{ name: "mil" type: "MIL" {bottom_text} {top_text} cpg_param {{ {cpg} }} }}',
               inputs={"labels": labels, "cls": cls, "rois": (5, 5), "scores": (5, 6)})


def mil_feeds():
    r = rng(9)
    labels = np.array([[0, 1, 0.5, 1e-5, 2e-5, 0]], F)
    return {"labels": labels, "cls": r.uniform(0, 1, (1, 6)).astype(F), "rois": r.uniform(0, 9, (5, 5)).astype(F),
            "scores": r.uniform(0, 1, (5, 6)).astype(F)}


@pytest.mark.parametrize("cpg", [f"is_cpg: false {HEAD_CPG}", f"is_cpg: false mode: PRED {OLD_CPG}"])
def test_mil_without_cpg_selects_every_roi(cpg, tmp_path):
    feeds = mil_feeds()
    model = load_from_text(mil_net(cpg, tops=("sel", "pos", "neg")))
    assert [model.blob_shapes[t] for t in ("sel", "pos", "neg")] == [(5, 6), (1, 6), (1, 6)]
    want = {"sel": np.ones((5, 6), F), "pos": feeds["labels"], "neg": np.zeros((1, 6), F)}
    check_everywhere(model, feeds, want, tmp_path)


@pytest.mark.parametrize("phase, want", [("TEST", [0, 1, 1, 0, 1, 0]), ("TRAIN", [1] * 6)])
def test_mil_cpg_switched_off_before_the_first_image(phase, want, tmp_path):
    """max_num_im_cpg 0: the CPG pass never runs and the Repartition gives its initial filter."""
    model = load_from_text(mil_net(f"is_cpg: true max_num_im_cpg: 0 {HEAD_CPG}"), phase=phase)
    check_everywhere(model, mil_feeds(), {"sel": np.tile(np.array(want, F), (5, 1))}, tmp_path)


def test_mil_label_tops_are_shaped_like_the_labels(tmp_path):
    """Repartition copies the labels (reshaping its top) and shapes the zeros like them, not like the predictions."""
    feeds = mil_feeds()
    feeds["labels"] = feeds["labels"].reshape(1, 6, 1, 1)
    model = load_from_text(mil_net(f"is_cpg: false {HEAD_CPG}", tops=("sel", "pos", "neg"), labels=(1, 6, 1, 1)))
    assert [model.blob_shapes[t] for t in ("sel", "pos", "neg")] == [(5, 6), (1, 6, 1, 1), (1, 6, 1, 1)]
    want = {"sel": np.ones((5, 6), F), "pos": feeds["labels"], "neg": np.zeros((1, 6, 1, 1), F)}
    check_everywhere(model, feeds, want, tmp_path)


def test_mil_with_cpg_is_read_but_not_run(tmp_path):
    model = load_from_text(mil_net(f"is_cpg: true {HEAD_CPG}"))
    assert model.blob_shapes["sel"] == (5, 6)
    with pytest.raises(LayerError, match="back-propagates each confident class's score"):
        model.run(mil_feeds())
    with pytest.raises(ExportError, match="back-propagates"):
        onnx_outputs(model, mil_feeds(), tmp_path)


@pytest.mark.parametrize("kw, match", [
    ({"cpg": HEAD_CPG, "bottoms": ("labels", "cls", "rois")}, "with 3 its setup reads past"),
    ({"cpg": HEAD_CPG, "bottoms": ("labels", "cls", "rois", "scores", "rois")}, "with 5 its setup reads past"),
    ({"cpg": HEAD_CPG, "tops": ("a", "b")}, "with 2 it never shapes the second"),
    ({"cpg": 'cpg_blob_name: "data"'}, "needs cpg_param.predict_blob_name"),
    ({"cpg": 'predict_blob_name: "cls"'}, "needs a cpg_param.cpg_blob_name"),
    ({"cpg": 'start_layer_name: "conv1" opg_blob_name: "data"'}, "start_layer_name and end_layer_name"),
    ({"cpg": f'{OLD_CPG} predict_blob_name: "cls"'}, "mixes caffe-wsl 77892fa"),
    ({"cpg": f"mode: CRF {HEAD_CPG}"}, "Not yet"),
    ({"cpg": f"is_order: true {HEAD_CPG}"}, "is_order needs mode PRED and 3 tops"),
    ({"cpg": HEAD_CPG, "labels": (2, 6)}, "labels of one image"),
    ({"cpg": HEAD_CPG, "labels": (1, 6, 2)}, "labels of one image"),
    ({"cpg": HEAD_CPG, "cls": (1, 6, 2)}, "predictions shaped \\(1, 6\\)"),
    ({"cpg": HEAD_CPG, "cls": (1, 5)}, "predictions shaped \\(1, 6\\)"),
])
def test_mil_refusals(kw, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(mil_net(**kw))


def test_rstar_mil_keeps_its_own_reading():
    model = load_from_text(net('layer { name: "m" type: "MIL" bottom: "x" top: "o" mil_param { context_per_roi: 2 } }',
                               inputs={"x": (6, 3, 1, 1)}))
    assert model.blob_shapes["o"] == (3, 3, 1, 1)


STATISTICS = ('layer { name: "s" type: "Statistics" bottom: "labels" bottom: "cls" bottom: "pos" bottom: "neg" '
              'bottom: "sel" }')


def test_statistics_only_trains(tmp_path):
    text = net('layer { name: "pos" type: "Sigmoid" bottom: "cls" top: "pos" }',
               'layer { name: "neg" type: "TanH" bottom: "cls" top: "neg" }', STATISTICS,
               'layer { name: "out" type: "AbsVal" bottom: "cls" top: "out" }',
               inputs={"labels": (1, 4), "cls": (1, 4), "sel": (3, 4)})
    feeds = {"labels": np.ones((1, 4), F), "cls": rng(10).standard_normal((1, 4)).astype(F),
             "sel": np.ones((3, 4), F)}
    np.testing.assert_array_equal(load_from_text(text, phase="TRAIN").run(feeds)["out"], np.abs(feeds["cls"]))
    test_model = load_from_text(text)
    with pytest.raises(LayerError, match="stops the net at TEST"):
        test_model.run(feeds)
    sess = onnx_session(test_model, tmp_path / "m.onnx")   # exports leave the training-only sink out
    assert [i.name for i in sess.get_inputs()] == ["cls"]
    np.testing.assert_array_equal(sess.run(["out"], {"cls": feeds["cls"]})[0], np.abs(feeds["cls"]))


def test_statistics_takes_labels_of_one_image():
    text = net(STATISTICS, 'layer { name: "out" type: "AbsVal" bottom: "cls" top: "out" }',
               inputs={"labels": (2, 4), "cls": (2, 4), "pos": (2, 4), "neg": (2, 4), "sel": (3, 4)})
    feeds = {k: np.ones(s, F) for k, s in (("labels", (2, 4)), ("cls", (2, 4)), ("pos", (2, 4)), ("neg", (2, 4)),
                                           ("sel", (3, 4)))}
    with pytest.raises(LayerError, match="Statistics takes labels of one image"):
        load_from_text(text, phase="TRAIN").run(feeds)


def test_statistics_takes_five_bottoms():
    with pytest.raises(LayerError, match="Statistics takes 5 bottoms"):
        load_from_text(net('layer { name: "s" type: "Statistics" bottom: "a" bottom: "b" }',
                           inputs={"a": (1, 4), "b": (1, 4)}))


# ---- shenyunhang/CSC's nets -------------------------------------------------------------------------

def inspect(path, *args):
    res = subprocess.run([sys.executable, str(REPO / "cli.py"), "inspect", str(path), *args], capture_output=True,
                         text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "unknown field 'cpg_param'" not in res.stderr
    return res.stdout


def test_csc_train_file_reads():
    out = inspect(REALWORLD / (CSC + "VGG16__csc__train.prototxt"), "--phase", "TRAIN",
                  "--input-shape", "data=1,3,224,224", "--input-shape", "rois=7,5", "--input-shape", "roi_scores=7",
                  "--input-shape", "roi_num=1", "--input-shape", "labels=1,20")
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["cls_score"].split()[1:] == ["RoIScorePooling", "bbox_score,roi_num", "->", "cls_score", "1x20"]
    assert rows["mil"].split()[1] == "MIL" and rows["mil"].endswith("7x20; 1x20; 1x20")
    assert rows["pos_constraint"].split()[1] == "PolarConstraint" and rows["pos_constraint"].endswith("7x20")
    assert rows["statistics"].split()[1] == "Statistics"


@pytest.mark.parametrize("name, row", [
    ("VGG_CNN_M_1024__contextlocnet_x__test.prototxt", ["context_pool_conv5", "LoopROIPooling", "conv5,rois_context",
                                                        "->", "context_pool_conv5", "1x512x6x6"]),
    ("VGG_CNN_F__csc__train.prototxt", ["cls_pos", "GeneralPooling", "score_pos", "->", "cls_pos", "1x20"]),
])
def test_csc_files_read(name, row):
    args = ["--phase", "TRAIN", "--input-shape", "data=1,3,224,224", "--input-shape", "rois=1,5",
            "--input-shape", "roi_scores=1", "--input-shape", "labels=1,20"] if "train" in name else []
    out = inspect(REALWORLD / (CSC + name), *args)
    assert any(line.split() == row for line in out.splitlines()), out


def test_layers_keep_their_tensors_on_the_inputs_device():
    from cuda_emulation import run_on_emulated_cuda
    text = net('layer { name: "p" type: "PolarConstraint" bottom: "s" bottom: "w" top: "p" }',
               'layer { name: "r" type: "RoIScorePooling" bottom: "p" bottom: "n" top: "r" '
               'roi_score_pooling_param { pool: TAVEMAX axis: 0 threshold: 0.1 } }',
               'layer { name: "g" type: "GeneralPooling" bottom: "s" bottom: "w" top: "g" '
               'general_pooling_param { pool: FAVEMAX axis: 0 } }',
               'layer { name: "l" type: "LoopROIPooling" bottom: "x" bottom: "rois" top: "l" '
               'loop_roi_pooling_param { pooled_h: 2 pooled_w: 3 spatial_scale: 0.5 } }',
               f'layer {{ name: "mil" type: "MIL" bottom: "r" bottom: "r" bottom: "rois" bottom: "s" top: "sel" '
               f'cpg_param {{ is_cpg: true max_num_im_cpg: 0 {HEAD_CPG} }} }}',
               inputs={"s": (4, 5), "w": (4, 5), "n": (1,), "x": (1, 2, 6, 7), "rois": (4, 9)})
    model = load_from_text(text)
    r = rng(12)
    feeds = {"s": r.uniform(0, 1, (4, 5)).astype(F), "w": r.uniform(-1, 1, (4, 5)).astype(F), "n": np.array([4], F),
             "x": r.standard_normal((1, 2, 6, 7)).astype(F),
             "rois": np.array([[0, 0, 0, 12, 10, 4, 4, 8, 6]] * 4, F)}
    out, mixes = run_on_emulated_cuda(model, {k: feeds[k] for k in model.inputs})
    assert not mixes, mixes
    want = model.run(feeds)
    for name, got in out.items():
        np.testing.assert_array_equal(got.cpu().numpy(), want[name])
