"""maunzzz/caffe-crfgd (c0cbacb): PixelFeature and CrfFilterbankEd against references written from its C++
(pixel_feature_layer.cpp, crf_filterbank_ed.cpp, entropy_descent_layer.cpp), in float64; CrfEd and CrfGrad
with bilateralNN's lattice filter (permutohedral.cpp, permutohedral_layer.cpp) step by step as its C++."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, onnx_outputs, rng
from permutohedral_reference import point_simplex

from caffeq.layers import LayerError
from caffeq.model import load_from_text

# ---- PixelFeature ------------------------------------------------------------------------------


def ref_pixel_features(x, kind, pos_scale, color_scale, offset_h, offset_w):
    n, c, h, w = x.shape
    pos = np.zeros((n, 2, h, w), np.float64)
    pos[:, 0] = (np.arange(h) * pos_scale + offset_h)[:, None]
    pos[:, 1] = (np.arange(w) * pos_scale + offset_w)[None, :]
    colour = color_scale * x.astype(np.float64)
    return {"POSITION": pos, "RGB": colour, "POSITION_AND_RGB": np.concatenate([pos, colour], 1),
            "RGB_AND_POSITION": np.concatenate([colour, pos], 1)}[kind]


@pytest.mark.parametrize("kind", ["POSITION_AND_RGB", "RGB_AND_POSITION", "RGB", "POSITION"])
def test_pixel_features_match_bilateralnn(kind, tmp_path):
    x = rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32) * 50
    text = net(f'layer {{ name: "pf" type: "PixelFeature" bottom: "x" top: "f" pixel_feature_param {{ type: {kind} '
               f'pos_scale: 0.02 color_scale: 0.3 offset_h: 1.5 offset_w: -2 }} }}', inputs={"x": x.shape})
    model = load_from_text(text)
    ref = ref_pixel_features(x, kind, 0.02, 0.3, 1.5, -2.0)
    assert model.blob_shapes["f"] == ref.shape
    check_everywhere(model, {"x": x}, {"f": ref}, tmp_path, atol=1e-5, rtol=1e-6)


def test_pixel_features_refuse_the_random_types():
    with pytest.raises(LayerError, match="RANDOM_POSITION draws random positions"):
        load_from_text(net('layer { name: "pf" type: "PixelFeature" bottom: "x" top: "f" '
                           'pixel_feature_param { type: RANDOM_POSITION } }', inputs={"x": (1, 3, 4, 4)}))


# ---- CrfFilterbankEd ------------------------------------------------------------------------------


def ref_filterbank_ed(q, feats, unary_weight, blob, iterations, step_size_factor, log_eps):
    """crf_filterbank_ed.cpp's Forward in float64: the blob (C, C F, k, k) read as conv weights (C F, C, k, k)."""
    n, c, h, w = q.shape
    f, k = feats.shape[1], blob.shape[-1]
    bank = blob.astype(np.float64).reshape(c * f, c, k, k)
    pad = (k - 1) // 2
    unary = -unary_weight * np.log(q.astype(np.float64) + log_eps)
    x = q.astype(np.float64)
    for it in range(iterations):
        padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        response = np.zeros((n, c * f, h, w))
        for o in range(c * f):
            for i in range(c):
                for a in range(k):
                    for b in range(k):
                        response[:, o] += bank[o, i, a, b] * padded[:, i, a:a + h, b:b + w]
        pairwise = np.zeros((n, c, h, w))
        for cls in range(c):
            for j in range(f):
                pairwise[:, cls] += feats[:, j] * response[:, cls * f + j]
        t = math.sqrt(2 * math.log(c) / (it + 1)) / step_size_factor
        e = np.exp(-t * (pairwise + unary)) * x
        x = e / e.sum(1, keepdims=True)
    return x


def filterbank_net(shape_q, shape_f, params):
    return net(f'layer {{ name: "crf" type: "CrfFilterbankEd" bottom: "q" bottom: "feat" top: "out" '
               f'crffilterbanked_param {{ {params} }} }}', inputs={"q": shape_q, "feat": shape_f})


def test_crf_filterbank_ed_matches_the_fork(tmp_path):
    g = rng(2)
    q = g.uniform(0.05, 1, (2, 3, 5, 7)).astype(np.float32)
    q /= q.sum(1, keepdims=True)
    logits = g.standard_normal((2, 2, 5, 7))
    feats = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32)
    model = load_from_text(filterbank_net(q.shape, feats.shape, "num_iterations: 3.7 step_size_factor: 1.5 "
                                          "log_eps: 0.1 kernel_size: 3 init_filters: true"), random_weights=True)
    assert model.blob_shapes["out"] == (2, 3, 5, 7)
    node = model.graph.node("crf")
    assert [b.shape for b in node.blobs] == [(1, 1, 1, 1), (3, 6, 3, 3)]
    w_u = np.full((1, 1, 1, 1), 0.7, np.float32)
    blob = (g.standard_normal((3, 6, 3, 3)) * 0.5).astype(np.float32)
    node.blobs = [w_u, blob]
    model.clear_cache()
    ref = ref_filterbank_ed(q, feats, 0.7, blob, 3, 1.5, np.float32(0.1))   # num_iterations 3.7 -> 3
    assert np.allclose(ref.sum(1), 1) and not np.allclose(ref, q, atol=1e-2)
    check_everywhere(model, {"q": q, "feat": feats}, {"out": ref}, tmp_path, atol=2e-6, rtol=1e-5)
    # skip_pw_term: the unary term alone
    unary_only = load_from_text(filterbank_net(q.shape, feats.shape, "num_iterations: 2 kernel_size: 3 "
                                               "skip_pw_term: true"), random_weights=True)
    unary_only.graph.node("crf").blobs = [w_u, np.zeros_like(blob)]
    unary_only.clear_cache()
    ref = ref_filterbank_ed(q, feats, 0.7, np.zeros_like(blob), 2, 1.0, np.float32(0.1))
    check_everywhere(unary_only, {"q": q, "feat": feats}, {"out": ref}, tmp_path, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("params, shapes, msg", [
    ("kernel_size: 4", ((1, 3, 5, 5), (1, 2, 5, 5)), "must be odd"),
    ("kernel_size: 3", ((1, 3, 5, 5), (1, 2, 5, 4)), "same N, H, W"),
    ("num_iterations: 0.5", ((1, 3, 5, 5), (1, 2, 5, 5)), "num_iterations must be >= 1"),
])
def test_crf_filterbank_ed_checks(params, shapes, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(filterbank_net(*shapes, params))


# ---- CrfEd / CrfGrad: bilateralNN's lattice filter, step by step as its C++ --------------------------


def ref_lattice(feat, gauss_only=False):
    """Permutohedral::init (float32 scalars, its hash table's insertion order, the in and out copies of the
    points) -> (offsets (P, d + 1) of the in points, barycentric (P, d + 1), blur neighbours (T - 1, M))."""
    d, p = feat.shape
    pts = np.concatenate([feat, feat], 1)   # in points, then the out points (the same features)
    canonical = [[i if j <= d - i else i - (d + 1) for j in range(d + 1)] for i in range(d + 1)]
    table, keys = {}, []
    offsets, bary_all = [], []
    for k in range(2 * p):
        rem0, rank, bary = point_simplex(pts[:, k], half_away=True, double_first=True)
        for r in range(d + 1):
            key = tuple(int(rem0[i]) + canonical[r][rank[i]] for i in range(d))
            if key not in table:
                table[key] = len(keys)
                keys.append(key)
            offsets.append(table[key])
            bary_all.append(bary[r])
    m = len(keys)
    step = [[table.get(tuple(c - 1 + (d + 1 if i == dim else 0) for i, c in enumerate(key)), -1) for key in keys]
            for dim in range(d + 1)]
    neighbours = []

    def walk(start, dim, has_zero, out):   # LatticeApproximateTraversal::walk_approximate
        if dim > d:
            out.append(start)
            return
        walking = start
        for i in range(2 if (dim < d or has_zero) else 1):
            walk(walking, dim + 1, has_zero or i == 0, out)
            if walking >= 0:
                walking = step[dim][walking]
    for v in range(m):
        out = []
        walk(v, 0, False, out)
        neighbours.append(out[1:])   # the first is the vertex itself
    return (np.array(offsets).reshape(2 * p, d + 1)[:p], np.array(bary_all, np.float32).reshape(2 * p, d + 1)[:p],
            np.array(neighbours).T, m)


def ref_compute(values, lattice, filters):
    """PermutohedralReverseCpu::compute: splat (float32, point by point), the taps times the filters (a GEMM,
    float64 here), slice (float32, vertex by vertex)."""
    offsets, bary, neighbours, m = lattice
    c, p = values.shape
    splatted = np.zeros((c, m + 1), np.float32)
    for i in range(p):
        for j in range(offsets.shape[1]):
            splatted[:, offsets[i, j] + 1] += bary[i, j] * values[:, i]
    taps = np.concatenate([np.arange(m)[None], neighbours]) + 1    # (T, M); -1 + 1 = the zero slot
    col = splatted[:, taps]                                         # (C, T, M)
    blurred = np.einsum("oct,ctm->om", filters.astype(np.float64), col.astype(np.float64)).astype(np.float32)
    out = np.zeros((filters.shape[0], p), np.float32)
    for j in range(offsets.shape[1]):
        out += bary[:, j] * blurred[:, offsets[:, j]]
    return out


GAUSS5 = np.array([1.0] + [0.0] * 62)   # filled below from the tap sizes: 1, 17/33, 10/33, 8/33
for _t in range(1, 63):
    GAUSS5[_t] = {1: 17 / 33, 5: 17 / 33, 2: 10 / 33, 4: 10 / 33, 3: 8 / 33}[bin(_t).count("1")]


def ref_lattice_filter(x, feats, filters):
    n, c, h, w = x.shape
    out = []
    for i in range(n):
        lattice = ref_lattice(feats[i].reshape(feats.shape[1], -1))
        norm = 1.0 / np.sqrt(ref_compute(np.ones((1, h * w), np.float32), lattice,
                                         GAUSS5.astype(np.float32)[None, None]).astype(np.float64) + 1e-20)
        y = ref_compute((x[i].reshape(c, -1) * norm).astype(np.float32), lattice, filters.reshape(c, c, -1))
        out.append((y * norm).reshape(c, h, w))
    return np.stack(out)


def ref_conv(x, wt):
    n, c, h, w = x.shape
    k = wt.shape[-1]
    pad = (k - 1) // 2
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    out = np.zeros((n, wt.shape[0], h, w))
    for o in range(wt.shape[0]):
        for i in range(c):
            for a in range(k):
                for b in range(k):
                    out[:, o] += wt[o, i, a, b] * padded[:, i, a:a + h, b:b + w]
    return out


def ref_crf(q, feats, w_u, spatial, lattice, iterations, grad=False, step_size=0.1, leak=0.5, log_eps=0.1):
    c = q.shape[1]
    unary = -w_u * np.log(q.astype(np.float64) + np.float32(log_eps))
    x = q.astype(np.float64)
    energies = []
    for it in range(iterations):
        conv = ref_conv(x, spatial)
        pl = ref_lattice_filter(x.astype(np.float32), feats, lattice).astype(np.float64)
        energies.append((x * (conv + unary + pl)).sum())
        g = conv + pl + unary
        if grad:
            y = x - step_size * g
            ranked = -np.sort(-y, 1)
            t = (ranked.sum(1) - 1) / c
            for ii in range(c - 1, 0, -1):   # the first ii (smallest) where the mean reaches the next value wins
                cand = (ranked[:, :ii].sum(1) - 1) / ii
                t = np.where(cand >= ranked[:, ii], cand, t)
            x = np.where(y - t[:, None] > 0, y - t[:, None], leak * (y - t[:, None]))
        else:
            step = math.sqrt(2 * math.log(c) / (it + 1))
            e = np.exp(-step * g) * x
            x = e / e.sum(1, keepdims=True)
    return x, np.array(energies)


@pytest.mark.parametrize("kind, field, grad", [("CrfEd", "crfed_param", False), ("CrfGrad", "crfgrad_param", True)])
def test_lattice_crfs_match_the_fork(kind, field, grad, tmp_path):
    g = rng(7)
    n, c, h, w = 2, 3, 5, 6
    q = g.uniform(0.05, 1, (n, c, h, w)).astype(np.float32)
    q /= q.sum(1, keepdims=True)
    feats = (g.standard_normal((n, 5, h, w)) * 0.6).astype(np.float32)   # close points: shared vertices
    extra = "leak_factor: 0.5 step_size: 0.1 " if grad else ""
    text = net(f'layer {{ name: "crf" type: "{kind}" bottom: "q" bottom: "feat" top: "out" top: "energy" '
               f'{field} {{ num_iterations: 3 kernel_size: 3 num_classes: 3 calculate_energy: true {extra}}} }}',
               inputs={"q": q.shape, "feat": feats.shape})
    model = load_from_text(text, random_weights=True)
    w_u = np.full((1, 1, 1, 1), 0.6, np.float32)
    spatial = (g.standard_normal((c, c, 3, 3)) * 0.2).astype(np.float32)
    lattice = (g.standard_normal((c, c, 1, 63)) * 0.3).astype(np.float32)
    model.graph.node("crf").blobs = [w_u, spatial, lattice]
    model.clear_cache()
    lat = ref_lattice(feats[0].reshape(5, -1))
    assert lat[3] < h * w * 6 and (lat[2] >= 0).any() and (lat[2] < 0).any()   # shared vertices, some taps missing
    ref, energies = ref_crf(q, feats, 0.6, spatial, lattice, 3, grad=grad)
    if grad:
        assert (ref < 0).any()   # the leaky projection's negative values
    energy_top = np.zeros((n, 1, 1, 3))
    energy_top.reshape(-1)[:3] = energies
    feeds = {"q": q, "feat": feats}
    got = model.run(feeds)
    np.testing.assert_allclose(got["out"], ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got["energy"], energy_top, atol=1e-3, rtol=1e-5)
    from conftest import model_py_outputs
    np.testing.assert_allclose(model_py_outputs(model, feeds, tmp_path)["out"], got["out"], atol=0, rtol=0)
    # ONNX builds the same lattice in the graph (Unique for the vertices, the taps walked through them)
    exported = onnx_outputs(model, feeds, tmp_path)
    np.testing.assert_allclose(exported["out"], got["out"], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(exported["energy"], got["energy"], atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("flags", ["skip_pl_term: true", "skip_pl_term: true skip_conv_term: true",
                                   "skip_conv_term: true"])
def test_crf_ed_skips_its_terms_as_the_fork(flags, tmp_path):
    # crf_ed_layer.cpp: the derivative is conv + PL, with skip_pl_term the conv term alone (copied), with both
    # skips 0 (set), with skip_conv_term PL alone; the unary term is added in every case
    g = rng(8)
    q = g.uniform(0.05, 1, (1, 3, 4, 5)).astype(np.float32)
    q /= q.sum(1, keepdims=True)
    feats = (g.standard_normal((1, 5, 4, 5)) * 0.6).astype(np.float32)
    text = net('layer { name: "crf" type: "CrfEd" bottom: "q" bottom: "feat" top: "out" '
               f'crfed_param {{ num_iterations: 2 kernel_size: 3 num_classes: 3 {flags} }} }}',
               inputs={"q": q.shape, "feat": feats.shape})
    model = load_from_text(text, random_weights=True)
    spatial = (g.standard_normal((3, 3, 3, 3)) * 0.3).astype(np.float32)
    lattice = (g.standard_normal((3, 3, 1, 63)) * 0.3).astype(np.float32)
    model.graph.node("crf").blobs = [np.full((1, 1, 1, 1), 0.6, np.float32), spatial, lattice]
    model.clear_cache()
    unary = -0.6 * np.log(q.astype(np.float64) + np.float32(0.1))
    x = q.astype(np.float64)
    for it in range(2):
        g_it = unary.copy()
        if "skip_conv_term" not in flags:
            g_it += ref_conv(x, spatial)
        if "skip_pl_term" not in flags:
            g_it += ref_lattice_filter(x.astype(np.float32), feats, lattice)
        e = np.exp(-math.sqrt(2 * math.log(3) / (it + 1)) * g_it) * x
        x = e / e.sum(1, keepdims=True)
    np.testing.assert_allclose(model.run({"q": q, "feat": feats})["out"], x, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(onnx_outputs(model, {"q": q, "feat": feats}, tmp_path)["out"], x, atol=2e-5, rtol=1e-4)


def test_lattice_crfs_check_their_shapes():
    text = net('layer { name: "crf" type: "CrfEd" bottom: "q" bottom: "feat" top: "out" '
               'crfed_param { num_iterations: 2 kernel_size: 3 num_classes: 3 } }',
               inputs={"q": (1, 3, 4, 4), "feat": (1, 5, 4, 4)})
    model = load_from_text(text, random_weights=True)
    assert [b.shape for b in model.graph.node("crf").blobs] == [(1, 1, 1, 1), (3, 3, 3, 3), (3, 3, 1, 63)]
    with pytest.raises(LayerError, match="num_classes 4 but the probabilities have 3"):
        load_from_text(text.replace("num_classes: 3", "num_classes: 4"))
    with pytest.raises(LayerError, match="same N, H, W"):
        load_from_text(text.replace('"feat": (1, 5, 4, 4)', "").replace("dim: 5 dim: 4 dim: 4", "dim: 5 dim: 4 dim: 3"))
    with pytest.raises(LayerError, match="calculate_energy: true"):
        load_from_text(text.replace('top: "out"', 'top: "out" top: "e"'))


def test_crfgd_image_label_data_shapes_its_label_slice():
    text = '''layer { name: "data" type: "ImageLabelData" top: "data" top: "label"
  transform_param { mirror: false crop_size: 513 mean_value: 104.008 mean_value: 116.669 mean_value: 122.675 }
  image_label_data_param { image_list_path: "val.txt" label_list_path: "val_labels.txt" batch_size: 1
    shuffle: false padding: REFLECT pad_centre: false label_slice { dim: 257 dim: 257 stride: 2 stride: 2 } }
  include: { phase: TEST } }'''
    shapes = load_from_text(text).blob_shapes
    assert shapes["data"] == (1, 3, 513, 513) and shapes["label"] == (1, 1, 257, 257)
