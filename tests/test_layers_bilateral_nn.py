"""MPI-IS/bilateralNN's Permutohedral (caffeq/layers/bilateral_nn.py) and PixelFeature (crfgd.py) against numpy
references written from the fork's permutohedral.cpp, permutohedral_layer.cpp and pixel_feature_layer.cpp."""
import math

import numpy as np
import pytest
from permutohedral_reference import point_simplex

from caffeq.errors import CaffeqError, ExportError
from caffeq.model import load_from_text
from tests.conftest import REPO, assert_close, check_everywhere, cli_process, model_py_outputs, net, ok, rng

CORPUS = str(REPO / "tests" / "fixtures" / "realworld" / "MPI-IS__bilateralNN__bilateralnn_code__examples__tile_segmentation__bnn_")
f32 = np.float32


# ---- numpy reference: bilateralNN's Permutohedral::init, GaussianFilter, PermutohedralReverseCpu ----------

def advance(key, dim, inc):
    d = len(key) - 1
    key = [k - inc for k in key]
    key[dim] += inc * (1 + d)
    return key


def ref_lattice(feat, s, visualize=False):
    """feat (P, d) float32 -> offsets (P, d+1), barycentric (P, d+1), M, blur_neighbors (T-1, M)."""
    p, d = feat.shape
    canonical = [[i if j <= d - i else i - (d + 1) for j in range(d + 1)] for i in range(d + 1)]
    table = {}
    offsets = np.zeros((p, d + 1), np.int64)
    bary_all = np.zeros((p, d + 1), f32)
    for k in range(p):
        # bilateralNN's init: round() halves away from zero, the wrapped weight added in double
        rem0, rank, bary = point_simplex(feat[k], half_away=True, double_first=True)
        if visualize:
            bary = [f32(1)] * (d + 2)
        for r in range(d + 1):
            key = tuple(int(rem0[i] + canonical[r][rank[i]]) for i in range(d))
            offsets[k, r] = table.setdefault(key, len(table))
            bary_all[k, r] = bary[r]
    m = len(table)
    keys = list(table)
    immediate = np.full((d + 1, m), -1, np.int64)
    for i, key in enumerate(keys):
        for dim in range(d + 1):
            nk = advance(list(key) + [0], dim, 1)[:d]
            immediate[dim, i] = table.get(tuple(nk), -1)
    neighbours = []

    def walk(start, dd, has_zero, out):
        if dd <= d:
            walking = start
            for i in range((s + 1) if (dd < d or has_zero) else 1):
                walk(walking, dd + 1, has_zero or i == 0, out)
                if walking >= 0:
                    walking = immediate[dd, walking]
        else:
            out.append(start)
    for i in range(m):
        out = []
        walk(i, 0, False, out)
        neighbours.append(out[1:])
    return offsets, bary_all, m, np.array(neighbours, np.int64).T.reshape(-1, m)


def ref_gauss(d, s):
    """GaussianFilter::build_filter with an exact traversal over keys of d + 1 coordinates."""
    order = []

    def walk(key, dd, has_zero):
        if dd <= d:
            walking = list(key)
            for i in range((s + 1) if (dd < d or has_zero) else 1):
                walk(walking, dd + 1, has_zero or i == 0)
                walking = advance(walking, dd, 1)
        else:
            if tuple(key) not in order:
                order.append(tuple(key))
    walk([0] * (d + 1), 0, False)
    index = {k: i for i, k in enumerate(order)}
    lat = [0.0] * len(order)
    lat[0] = 1.0
    for dd in range(d + 1):
        new = []
        for key in order:
            v = lat[index[key]]
            upk, dnk = advance(list(key), dd, 1), advance(list(key), dd, -1)
            a = lat[index[tuple(upk)]] if tuple(upk) in index else 0.0
            b = lat[index[tuple(dnk)]] if tuple(dnk) in index else 0.0
            new.append(v + (a + b) * 0.5)
        lat = new
    return np.array([f32(v) / f32(lat[0]) for v in lat], f32)


def ref_compute(lat, filt, values, group, skip_blur, in_rng, out_rng):
    """PermutohedralReverseCpu::compute: filt (O, C/g, T), values (C, Pin) -> (O, Pout)."""
    offsets, bary, m, neigh = lat
    c = values.shape[0]
    splat = np.zeros((c, m + 1))
    for i, pt in enumerate(in_rng):
        for j in range(offsets.shape[1]):
            splat[:, offsets[pt, j] + 1] += float(bary[pt, j]) * values[:, i].astype(np.float64)
    if skip_blur:
        blurred = splat[:, 1:]
    else:
        o = filt.shape[0]
        cg, og = c // group, o // group
        blurred = np.zeros((o, m))
        cols = np.concatenate([np.arange(m)[None], neigh], 0) + 1   # (T, M)
        for g in range(group):
            for oo in range(og):
                for cc in range(cg):
                    for t in range(cols.shape[0]):
                        blurred[g * og + oo] += filt[g * og + oo, cc, t] * splat[g * cg + cc, cols[t]]
    out = np.zeros((blurred.shape[0], len(out_rng)))
    for i, pt in enumerate(out_rng):
        for j in range(offsets.shape[1]):
            out[:, i] += float(bary[pt, j]) * blurred[:, offsets[pt, j]]
    return out


def ref_layer(x, fin, fout, weight, bias, s, group, norm_type, offset_type, skip_blur=False, given=None,
              visualize=False):
    """PermutohedralLayer::Forward_cpu; `given`: a producer's per-image (lattice, norm_there, norm_back)."""
    n, c, h, w = x.shape
    d = fin.shape[1]
    p_in, p_out = h * w, fout.shape[2] * fout.shape[3]
    gauss = ref_gauss(d, s)
    filt = weight.reshape(weight.shape[0], weight.shape[1], -1).astype(f32)
    if offset_type == "FULL":
        filt = filt + gauss
    elif offset_type == "DIAG":
        filt = filt.copy()
        for o in range(filt.shape[0]):
            filt[o, o] = filt[o, o] + gauss
    tops, made = [], []
    for b in range(n):
        if given is None:
            pts = np.concatenate([fin[b].reshape(d, -1), fout[b].reshape(d, -1)], 1).T.astype(f32)
            lat = ref_lattice(pts, s, visualize)
            ins, outs = range(p_in), range(p_in, p_in + p_out)
            g1 = gauss.reshape(1, 1, -1)
            if norm_type == "AFTER":
                there = np.ones(p_in, f32)
                back = (1.0 / (ref_compute(lat, g1, np.ones((1, p_in), f32), 1, False, ins, outs)[0] + 1e-20)).astype(f32)
            else:
                there = (1.0 / np.sqrt(ref_compute(lat, g1, np.ones((1, p_in), f32), 1, False, ins, ins)[0]
                                       + 1e-20)).astype(f32)
                back = (1.0 / np.sqrt(ref_compute(lat, g1, np.ones((1, p_out), f32), 1, False, outs, outs)[0]
                                      + 1e-20)).astype(f32)
        else:
            lat, there, back = given[b]
        made.append((lat, there, back))
        y = ref_compute(lat, filt, x[b].reshape(c, -1) * there, group, skip_blur, range(p_in),
                        range(p_in, p_in + p_out)) * back
        if bias is not None:
            y = y + bias.reshape(-1, 1)
        tops.append(y.reshape(-1, fout.shape[2], fout.shape[3]))
    return np.stack(tops).astype(f32), made


# ---- tests ------------------------------------------------------------------------------------------------

def perm_layer(name, bottoms, tops, params):
    b = " ".join(f'bottom: "{v}"' for v in bottoms)
    t = " ".join(f'top: "{v}"' for v in tops)
    return f'layer {{ name: "{name}" type: "Permutohedral" {b} {t} permutohedral_param {{ {params} }} }}'


def grid_features(n, d, h, w, r, step=0.6):
    """Position-like features with some noise, so that the small lattices have neighbouring vertices."""
    yy, xx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    base = [yy * step, xx * step] + [np.zeros((h, w))] * (d - 2)
    f = np.stack(base)[None] + r.uniform(-0.8, 0.8, (n, d, h, w))
    return f.astype(f32)


def run_both(model, feeds, refs, tmp_path, atol, rtol):
    ours = model.run(feeds)
    for k, ref in refs.items():
        assert_close(ours[k], ref, atol, rtol, f"torch {k}")
    got = model_py_outputs(model, feeds, tmp_path)
    for k, ref in refs.items():
        assert_close(got[k], ref, atol, rtol, f"model.py {k}")
    return ours


@pytest.mark.parametrize("s,d,norm,offset", [(1, 3, "SYMMETRIC", "FULL"), (2, 2, "AFTER", "FULL"),
                                               (1, 2, "SYMMETRIC", "NONE")])
def test_permutohedral_against_fork(tmp_path, s, d, norm, offset):
    r = rng(3)
    n, c, h, w, ho, wo, o = 2, 3, 3, 5, 4, 3, 4
    x = r.standard_normal((n, c, h, w)).astype(f32)
    fin, fout = grid_features(n, d, h, w, r), grid_features(n, d, ho, wo, r, step=0.45)
    taps = (s + 1) ** (d + 1) - s ** (d + 1)
    weight = (r.standard_normal((o, c, 1, taps)) * 0.3).astype(f32)
    bias = r.standard_normal((1, 1, 1, o)).astype(f32)
    text = net(perm_layer("p", ["x", "fin", "fout"], ["y"],
                          f"num_output: {o} neighborhood_size: {s} bias_term: true norm_type: {norm} "
                          f"offset_type: {offset}"), inputs={"x": x.shape, "fin": fin.shape, "fout": fout.shape})
    model = load_from_text(text, random_weights=True)
    model.graph.node("p").blobs = [weight, bias]
    ref, _ = ref_layer(x, fin, fout, weight, bias, s, 1, norm, offset)
    run_both(model, {"x": x, "fin": fin, "fout": fout}, {"y": ref}, tmp_path, 2e-5, 2e-5)


def test_permutohedral_lattice_shared_groups_diag(tmp_path):
    """Layer 1 (AFTER, NONE, group 2) gives its lattice; layer 2 (DIAG, SYMMETRIC: unused) reuses the
    lattice and layer 1's normalization, ignoring its own feature bottoms."""
    r = rng(5)
    n, c, h, w, ho, wo, d = 2, 4, 3, 4, 2, 5, 3
    x = r.standard_normal((n, c, h, w)).astype(f32)
    fin, fout = grid_features(n, d, h, w, r), grid_features(n, d, ho, wo, r, step=0.7)
    other = grid_features(n, d, h, w, r) * 3   # layer 2's own features: the fork does not read them
    w1 = (r.standard_normal((6, 2, 1, 15)) * 0.3).astype(f32)
    w2 = (r.standard_normal((2, 2, 1, 15)) * 0.3).astype(f32)
    text = net(perm_layer("p1", ["x", "fin", "fout"], ["y1", "lat"],
                          "num_output: 6 group: 2 neighborhood_size: 1 norm_type: AFTER offset_type: NONE"),
               perm_layer("p2", ["x", "other", "fout", "lat"], ["y2"],
                          "num_output: 2 group: 2 neighborhood_size: 1 offset_type: DIAG repeated_init: false"),
               inputs={"x": x.shape, "fin": fin.shape, "fout": fout.shape, "other": other.shape})
    model = load_from_text(text, random_weights=True)
    model.graph.node("p1").blobs, model.graph.node("p2").blobs = [w1], [w2]
    y1, made = ref_layer(x, fin, fout, w1, None, 1, 2, "AFTER", "NONE")
    y2, _ = ref_layer(x, fin, fout, w2, None, 1, 2, "SYMMETRIC", "DIAG", given=made)
    feeds = {"x": x, "fin": fin, "fout": fout, "other": other}
    run_both(model, feeds, {"y1": y1, "y2": y2}, tmp_path, 2e-5, 2e-5)
    with pytest.raises(ExportError, match="Permutohedral"):
        model.export_onnx(str(tmp_path / "p.onnx"))


@pytest.mark.parametrize("d,s,visualize", [(2, 1, False), (3, 2, False), (5, 1, False), (2, 2, True)])
def test_lattice_matches_fork_exactly(d, s, visualize):
    """Permutohedral::init bit for bit: each point's barycentric weights (the wrap-around weight in double),
    its vertices (the same vertex for the same hash-table entry, whatever the numbering) and each vertex's
    taps in LatticeApproximateTraversal's order, missing vertices included."""
    import torch

    from caffeq.layers.bilateral_nn import bnn_build_lattice
    r = rng(11)
    pts = np.concatenate([grid_features(1, d, 4, 5, r)[0].reshape(d, -1).T,
                          (r.standard_normal((40, d)) * 3).astype(f32)])
    slots, weights, taps = bnn_build_lattice(torch.from_numpy(pts)[None], s, visualize)
    offsets, bary, m, neigh = ref_lattice(pts, s, visualize)
    assert np.array_equal(weights.numpy(), bary)
    ours = slots.numpy().ravel() - 1
    to_fork = np.full(m, -1)
    to_fork[ours] = offsets.ravel()
    assert taps.shape[1] == m and (to_fork >= 0).all() and len(set(to_fork)) == m
    assert np.array_equal(to_fork[ours], offsets.ravel())
    fork_taps = np.concatenate([np.arange(m)[None], neigh])[:, to_fork]   # tap t of our vertex v, as fork ids
    t = taps.numpy() - 1
    assert (fork_taps < 0).any()   # some walks meet missing vertices
    assert np.array_equal(np.where(t >= 0, to_fork[t], -1), fork_taps)


def test_permutohedral_visualize_lattice(tmp_path):
    r = rng(9)
    n, c, h, w, d, o = 2, 2, 3, 4, 2, 3
    x = r.standard_normal((n, c, h, w)).astype(f32)
    fin, fout = grid_features(n, d, h, w, r), grid_features(n, d, 2, 3, r, step=0.9)
    weight = (r.standard_normal((o, c, 1, 7)) * 0.3).astype(f32)
    text = net(perm_layer("p", ["x", "fin", "fout"], ["y"],
                          f"num_output: {o} neighborhood_size: 1 norm_type: AFTER visualize_lattice: true"),
               inputs={"x": x.shape, "fin": fin.shape, "fout": fout.shape})
    model = load_from_text(text, random_weights=True)
    model.graph.node("p").blobs = [weight]
    ref, _ = ref_layer(x, fin, fout, weight, None, 1, 1, "AFTER", "FULL", visualize=True)
    run_both(model, {"x": x, "fin": fin, "fout": fout}, {"y": ref}, tmp_path, 2e-5, 2e-5)


def test_permutohedral_skip_blur(tmp_path):
    r = rng(8)
    n, c, h, w, d = 2, 3, 5, 3, 2
    x = r.standard_normal((n, c, h, w)).astype(f32)
    fin = grid_features(n, d, h, w, r)
    weight = r.standard_normal((c, c, 1, 7)).astype(f32)
    text = net(perm_layer("p", ["x", "f", "f"], ["y"], f"num_output: {c} neighborhood_size: 1 do_skip_blur: true"),
               inputs={"x": x.shape, "f": fin.shape})
    model = load_from_text(text, random_weights=True)
    model.graph.node("p").blobs = [weight]
    ref, _ = ref_layer(x, fin, fin, weight, None, 1, 1, "SYMMETRIC", "FULL", skip_blur=True)
    run_both(model, {"x": x, "f": fin}, {"y": ref}, tmp_path, 2e-5, 2e-5)


def test_gauss_taps_match_fork_traversal():
    from caffeq.layers.bilateral_nn import bnn_gauss_taps
    from caffeq.layers.crfgd import bnn_gauss_filter
    for d, s in ((2, 1), (3, 2), (5, 1)):
        assert np.array_equal(bnn_gauss_taps(d, s).numpy(), ref_gauss(d, s))
    assert np.array_equal(bnn_gauss_taps(5, 1).numpy(), bnn_gauss_filter(5).numpy())


@pytest.mark.parametrize("params,msg", [
    ("num_output: 3 offset_type: DIAG neighborhood_size: 1", "DIAG needs num_output == channels / group"),
    ("num_output: 3 do_skip_blur: true", "do_skip_blur needs num_output == channels"),
    ("num_output: 0", "num_output must be >= 1"),
])
def test_permutohedral_bad_params(params, msg):
    text = net(perm_layer("p", ["x", "f", "f"], ["y"], params), inputs={"x": (1, 2, 3, 4), "f": (1, 2, 3, 4)})
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(text, random_weights=True)


@pytest.mark.parametrize("kind", ["POSITION", "RGB", "POSITION_AND_RGB", "RGB_AND_POSITION"])
def test_pixel_feature_against_fork(tmp_path, kind):
    r = rng(1)
    x = r.standard_normal((2, 3, 5, 7)).astype(f32)
    params = f"type: {kind} pos_scale: 0.37 color_scale: 2.5 offset_h: 0.25 offset_w: -1.5"
    text = net(f'layer {{ name: "f" type: "PixelFeature" bottom: "x" top: "f" pixel_feature_param {{ {params} }} }}',
               inputs={"x": x.shape})
    n, c, h, w = x.shape
    pos = np.zeros((n, 2, h, w), f32)
    for y in range(h):
        for xx in range(w):
            pos[:, 0, y, xx] = f32(f32(0.37) * f32(y)) + f32(0.25)
            pos[:, 1, y, xx] = f32(f32(0.37) * f32(xx)) + f32(-1.5)
    col = (f32(2.5) * x).astype(f32)
    ref = {"POSITION": pos, "RGB": col, "POSITION_AND_RGB": np.concatenate([pos, col], 1),
           "RGB_AND_POSITION": np.concatenate([col, pos], 1)}[kind]
    model = load_from_text(text)
    run_both(model, {"x": x}, {"f": ref}, tmp_path, 0, 0)


@pytest.mark.parametrize("angle,sigma,scale", [(23.5, 0.7, 0.37), (-140.0, 2.0, 1.0), (0.0, 1.0, 0.5)])
def test_pixel_feature_warped_position(tmp_path, angle, sigma, scale):
    """pixel_feature_layer.cpp's WARPED_POSITION, float32 steps; cos and sin of the float angle correctly
    rounded (the fork's std::cos(float) on its platform's libm)."""
    r = rng(4)
    x = r.standard_normal((2, 3, 5, 8)).astype(f32)
    params = f"type: WARPED_POSITION rotation_angle: {angle} rotation_sigma: {sigma} pos_scale: {scale}"
    text = net(f'layer {{ name: "f" type: "PixelFeature" bottom: "x" top: "f" pixel_feature_param {{ {params} }} }}',
               inputs={"x": x.shape})
    n, _, h, w = x.shape
    a = f32(-float(f32(angle)) / 180.0 * math.pi)
    ca, sa = f32(math.cos(float(a))), f32(math.sin(float(a)))
    mid_y, mid_x = f32(h // 2), f32(w // 2)   # 2 and 4: integer halves
    ref = np.zeros((n, 3, h, w), f32)
    for y in range(h):
        sy = f32(f32(y) * f32(scale)) - mid_y
        for xx in range(w):
            sx = f32(f32(xx) * f32(scale)) - mid_x
            ref[:, 0, y, xx] = f32(f32(sa * sx) + f32(ca * sy)) + mid_y
            ref[:, 1, y, xx] = f32(f32(ca * sx) - f32(sa * sy)) + mid_x
            ref[:, 2, y, xx] = a / f32(sigma)
    model = load_from_text(text)
    check_everywhere(model, {"x": x}, {"f": ref}, tmp_path, 0, 0)


def test_corpus_files_read():
    res = cli_process("inspect", CORPUS + "deploy.prototxt", cwd=REPO)
    assert "1000x32x64x64" in ok(res) and "1000x2x64x64" in res.stdout
    res = cli_process("inspect", CORPUS + "train.prototxt", "--input-shape", "data=2,3,9,14", cwd=REPO)
    assert "2x2x9x14" in ok(res)


def test_corpus_deploy_runs_with_random_weights(tmp_path):
    text = open(CORPUS + "deploy.prototxt").read().replace("dim: 1000\n  dim: 3\n  dim: 64\n  dim: 64",
                                                           "dim: 2\n  dim: 3\n  dim: 6\n  dim: 9")
    model = load_from_text(text, random_weights=True)
    x = rng(2).random((2, 3, 6, 9), dtype=f32)
    out = model.run({"data": x}, all_blobs=True)
    assert out["conv_result"].shape == (2, 2, 6, 9) and np.isfinite(out["conv_result"]).all()
    # the lattice blob: PixelFeature's features twice (input, output points), then the AFTER normalization
    feats = np.concatenate([np.broadcast_to(np.arange(6, dtype=f32)[:, None] * f32(0.05), (6, 9))[None],
                            np.broadcast_to(np.arange(9, dtype=f32)[None] * f32(0.05), (6, 9))[None],
                            x[0] * f32(10)]).reshape(5, -1)
    assert np.array_equal(out["lattice"][0, :5, 0], np.concatenate([feats, feats], 1))
    assert np.array_equal(out["lattice"][0, 5, 0, :54], np.ones(54, f32))
