"""jasonbunk/caffe (3b8bb55): BilateralFilter, RBF, TestOpenCVPreview (caffeq/layers/jasonbunk.py) and its
MultiStageMeanfield's do_softmax (caffeq/layers/crf_rnn.py), against references written here from the fork's
C++: modified_permutohedral.cu (the mxnet permutohedral op: init, splat, blur, normalized slice),
rbf_layer.cpp's rbf_msi_compute_forward, meanfield_iteration.cpp's Forward_cpu.
"""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, node_of, rng
from permutohedral_reference import F32, fork_filter, fork_lattice

from caffeq.errors import CaffeqError, ExportError
from caffeq.model import load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"


# ---- BilateralFilter: the GPU op, point by point ----------------------------------------------------------

def gpu_lattice(pos, stdv):
    """PermutohedralOp_template_GPU's init kernel: pos (P, d) float32, widths stdv (d,) -> (index (P, d+1),
    weight (P, d+1), keys in insertion order, table)."""
    p, d = pos.shape
    scale = [F32(F32(d + 1) * np.sqrt(F32(2.0 / 3.0) / F32((i + 1) * (i + 2)), dtype=F32) / F32(stdv[i]))
             for i in range(d)]
    table, index, weight = {}, np.zeros((p, d + 1), np.int64), np.zeros((p, d + 1), F32)
    for idx in range(p):
        elevated = np.zeros(d + 1, F32)
        sm = F32(0)
        for i in range(d, 0, -1):
            cf = F32(pos[idx, i - 1] * scale[i - 1])
            elevated[i] = F32(sm - F32(i) * cf)
            sm = F32(sm + cf)
        elevated[0] = sm
        greedy = np.zeros(d + 1, np.int64)
        for i in range(d + 1):
            v = F32(elevated[i] * F32(F32(1) / F32(d + 1)))
            up, down = F32(np.ceil(v) * (d + 1)), F32(np.floor(v) * (d + 1))
            greedy[i] = int(up) if F32(up - elevated[i]) < F32(elevated[i] - down) else int(down)
        total = int(greedy.sum()) // (d + 1)
        diff = [F32(elevated[i] - F32(greedy[i])) for i in range(d + 1)]
        rank = [sum(1 for j in range(d + 1) if diff[i] < diff[j] or (diff[i] == diff[j] and i > j))
                for i in range(d + 1)]
        for i in range(d + 1):
            if total > 0:
                if rank[i] >= d + 1 - total:
                    greedy[i] -= d + 1
                    rank[i] += total - (d + 1)
                else:
                    rank[i] += total
            elif total < 0:
                if rank[i] < -total:
                    greedy[i] += d + 1
                    rank[i] += d + 1 + total
                else:
                    rank[i] += total
        bary = np.zeros(d + 2, F32)
        for i in range(d + 1):
            delta = F32(F32(elevated[i] - F32(greedy[i])) * F32(F32(1) / F32(d + 1)))
            bary[d - rank[i]] += delta
            bary[d + 1 - rank[i]] -= delta
        bary[0] = F32(bary[0] + F32(F32(1) + bary[d + 1]))
        for color in range(d + 1):
            key = tuple(int(greedy[i]) + color - (d + 1 if rank[i] > d - color else 0) for i in range(d))
            index[idx, color] = table.setdefault(key, len(table))
            weight[idx, color] = bary[color]
    return index, weight, list(table), table


def gpu_normalized_filter(lattice, data):
    """Filter(normalize=true): data (C, P) and a ones channel splatted, blurred along colours 0..d (a missing
    neighbour adds nothing), sliced as v x (1 / n)."""
    index, weight, keys, table = lattice
    c, p = data.shape
    d = index.shape[1] - 1
    vals = np.zeros((len(keys), c + 1), F32)
    for idx in range(p):
        for color in range(d + 1):
            vals[index[idx, color], :c] += data[:, idx] * weight[idx, color]
            vals[index[idx, color], c] += F32(1) * weight[idx, color]
    for color in range(d + 1):
        new = np.zeros_like(vals)
        for m, key in enumerate(keys):
            up = list(k + 1 for k in key)
            dn = list(k - 1 for k in key)
            if color < d:
                up[color] -= d + 1
                dn[color] += d + 1
            o = vals[m].copy()
            for nb in (table.get(tuple(up)), table.get(tuple(dn))):
                if nb is not None:
                    o = o + F32(0.5) * vals[nb]
            new[m] = o
        vals = new
    out = np.zeros((c, p), F32)
    for idx in range(p):
        n = F32(0)
        v = np.zeros(c, F32)
        for color in range(d + 1):
            n = F32(n + weight[idx, color] * vals[index[idx, color], c])
            v = v + weight[idx, color] * vals[index[idx, color], :c]
        out[:, idx] = v * (F32(1) / n)
    return out


def fork_bilateral(values, feats, stdv_space, stdv_color, positions=True):
    n, c = values.shape[:2]
    sizes = feats.shape[2:]
    p = math.prod(sizes)
    coords = np.stack(np.unravel_index(np.arange(p), sizes), 1).astype(F32) if positions else np.zeros((p, 0), F32)
    tops = []
    for b in range(n):
        pos = np.concatenate([coords, feats[b].reshape(feats.shape[1], p).T], 1).astype(F32)
        widths = [stdv_space] * coords.shape[1] + [stdv_color] * feats.shape[1]
        tops.append(gpu_normalized_filter(gpu_lattice(pos, widths), values[b].reshape(c, p)).reshape(values.shape[1:]))
    return np.stack(tops)


BILATERAL = ('layer {{ name: "bf" type: "BilateralFilter" bottom: "v" bottom: "f" top: "o" '
             'bilateral_filter_param {{ {params} }} }}')


@pytest.mark.parametrize("vshape, fshape, params, positions", [
    ((2, 3, 5, 7), (2, 2, 5, 7), "stdv_space: 2.5 stdv_color: 0.7", True),
    ((2, 2, 9), (2, 3, 9), "stdv_space: 3 stdv_color: 0.5", True),
    ((2, 1, 4, 5), (2, 3, 4, 5), "stdv_space: 1 stdv_color: 0.8 create_spatial_dimension_features: false", False),
])
def test_bilateral_filter_matches_the_gpu_op(vshape, fshape, params, positions, tmp_path):
    model = load_from_text(net(BILATERAL.format(params=params), inputs={"v": vshape, "f": fshape}))
    assert model.graph.tensors["o"].shape == vshape
    r = rng(len(vshape))
    feeds = {"v": r.standard_normal(vshape).astype(F32), "f": r.standard_normal(fshape).astype(F32)}
    a = node_of(model, "bf").attrs
    ref = fork_bilateral(feeds["v"], feeds["f"], a["stdv_space"], a["stdv_color"], positions)
    # the integer positions put points on lattice boundaries: only the fork's scaling and tie rounding agree
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=())


def test_bilateral_filter_rounds_lattice_ties_down(tmp_path):
    # width 0.5 on 2 features: the second scale is exactly 2, so a first feature 0 and a second one an odd
    # multiple of 0.375 put the elevated coordinate -4 f half-way between two 0-coloured coordinates
    # (the fork keeps `down`, strict <; rounding up there is undone by the sum correction, same vertices):
    # points on simplex boundaries, with zero barycentric weights, whose empty vertices the blur still uses
    shape = (2, 2, 3, 5)
    text = BILATERAL.format(params="stdv_space: 1 stdv_color: 0.5 create_spatial_dimension_features: false")
    model = load_from_text(net(text, inputs={"v": shape, "f": shape}))
    r = rng(9)
    feats = np.zeros(shape, F32)
    feats[:, 1] = F32(0.375) * r.choice([-5, -3, -1, 1, 3, 5], shape[:1] + shape[2:]).astype(F32)
    feats[1, :, 2] = r.standard_normal((2, 5)).astype(F32)   # and some points off the boundaries
    feeds = {"v": r.standard_normal(shape).astype(F32), "f": feats}
    ref = fork_bilateral(feeds["v"], feats, 1.0, 0.5, positions=False)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=())


def test_bilateral_filter_refuses_onnx(tmp_path):
    model = load_from_text(net(BILATERAL.format(params="stdv_space: 2"), inputs={"v": (1, 3, 4, 5), "f": (1, 3, 4, 5)}))
    with pytest.raises(ExportError, match="'bf' .BilateralFilter.*mxnet GPU op"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_bilateral_filter_of_a_constant_is_the_constant(tmp_path):
    # normalized: a flat image stays flat whatever the features
    model = load_from_text(net(BILATERAL.format(params="stdv_space: 5 stdv_color: 45"),
                               inputs={"v": (1, 3, 6, 8), "f": (1, 3, 6, 8)}))
    feeds = {"v": np.full((1, 3, 6, 8), 4.0, F32), "f": rng(3).uniform(0, 255, (1, 3, 6, 8)).astype(F32)}
    np.testing.assert_allclose(model.run(feeds)["o"], feeds["v"], rtol=1e-5)


@pytest.mark.parametrize("params, match", [
    ("stdv_color: 3", "stdv_space must be set"),
    ("stdv_space: 0 stdv_color: 3", "must both be > 0"),
])
def test_bilateral_filter_bad_widths(params, match):
    with pytest.raises(CaffeqError, match=match):
        load_from_text(net(BILATERAL.format(params=params), inputs={"v": (1, 3, 4, 5), "f": (1, 3, 4, 5)}))


def test_bilateral_filter_needs_matching_sizes():
    with pytest.raises(CaffeqError, match="share the values' N and spatial sizes"):
        load_from_text(net(BILATERAL.format(params="stdv_space: 1"), inputs={"v": (1, 3, 4, 5), "f": (1, 3, 4, 6)}))


# ---- RBF ------------------------------------------------------------------------------------------------

def fork_rbf(x, scalars, widths, centres, share):
    n, k, h, w = x.shape
    i_out, j_count = scalars.shape
    xs = x.reshape(n, k, h * w)
    top = np.zeros((n, i_out, h * w), F32)
    for m in range(n):
        for s in range(h * w):
            for i in range(i_out):
                total = F32(0)
                for j in range(j_count):
                    beta = widths[i, j]
                    c = centres[j] if share else centres[i, j]
                    dif = F32(0)
                    for kk in range(k):
                        t = F32(xs[m, kk, s] - c[kk])
                        dif = F32(dif + abs(F32(t * t)))
                    total = F32(total + F32(np.exp(F32(F32(-dif * beta) * beta))) * scalars[i, j])
                top[m, i, s] = total
    return top.reshape(n, i_out, h, w)


@pytest.mark.parametrize("share", [True, False])
def test_rbf_matches_the_fork(share, tmp_path):
    text = ('layer { name: "rbf" type: "RBF" bottom: "x" top: "o" rbf_param { num_output: 2 '
            f'centroids_per_output: 3 share_centroids: {str(share).lower()} }} }}')
    model = load_from_text(net(text, inputs={"x": (2, 4, 3, 5)}), random_weights=True)
    assert model.graph.tensors["o"].shape == (2, 2, 3, 5)
    r = rng(7)
    rbf = node_of(model, "rbf")
    rbf.blobs = [r.standard_normal((2, 3)).astype(F32), r.uniform(0.2, 0.8, (2, 3)).astype(F32),
                 r.standard_normal((3, 4) if share else (2, 3, 4)).astype(F32)]
    feeds = {"x": r.standard_normal((2, 4, 3, 5)).astype(F32)}
    check_everywhere(model, feeds, {"o": fork_rbf(feeds["x"], *rbf.blobs, share)}, tmp_path, atol=1e-6, rtol=1e-5)


def test_rbf_needs_outputs():
    text = 'layer { name: "rbf" type: "RBF" bottom: "x" top: "o" rbf_param { centroids_per_output: 3 } }'
    with pytest.raises(CaffeqError, match="rbf_param.num_output must be >= 1"):
        load_from_text(net(text, inputs={"x": (1, 2, 3, 3)}))


# ---- TestOpenCVPreview ----------------------------------------------------------------------------------

def test_opencv_preview_is_an_identity(tmp_path):
    model = load_from_text(net('layer { name: "show" type: "TestOpenCVPreview" bottom: "x" top: "o" }',
                               inputs={"x": (2, 3, 5, 7)}))
    x = rng(1).standard_normal((2, 3, 5, 7)).astype(F32)
    check_everywhere(model, {"x": x}, {"o": x}, tmp_path)


def test_opencv_preview_refuses_in_place():
    with pytest.raises(CaffeqError, match="does not allow in-place"):
        load_from_text(net('layer { name: "show" type: "TestOpenCVPreview" bottom: "x" top: "x" }',
                           inputs={"x": (1, 3, 4, 4)}))


# ---- MultiStageMeanfield's do_softmax ------------------------------------------------------------------

MEANFIELD = ('layer {{ name: "crf" type: "MultiStageMeanfield" bottom: "unary" bottom: "q0" bottom: "img" top: "o" '
             'multi_stage_meanfield_param {{ num_iterations: {it} theta_alpha: 5 theta_beta: 45 theta_gamma: 3 '
             '{extra} }} }}')


def fork_meanfield(unary, q0, img, blobs, iterations, theta_alpha, theta_beta, theta_gamma, do_softmax):
    """MultiStageMeanfieldLayer::Forward_cpu with MeanfieldIteration::Forward_cpu (do_softmax false: the
    softmax top is a copy of its bottom)."""
    n, c, h, w = unary.shape
    p = np.arange(h * w)
    xy = np.stack([p % w, p // w], 1).astype(F32)
    ones = np.ones((1, h * w), F32)
    spatial = fork_lattice(xy / F32(theta_gamma))
    spatial_norm = F32(1) / (fork_filter(spatial, ones)[0] + F32(1e-20))
    ws, wb, mu = (b.reshape(c, c) for b in blobs)
    tops = []
    for b in range(n):
        feats = np.concatenate([xy / F32(theta_alpha), img[b, :3].reshape(3, -1).T / F32(theta_beta)], 1)
        bilateral = fork_lattice(feats.astype(F32))
        bilateral_norm = F32(1) / (fork_filter(bilateral, ones)[0] + F32(1e-20))
        z = q0[b].reshape(c, -1)
        for _ in range(iterations):
            if do_softmax:
                e = np.exp(z - z.max(0))
                prob = e / e.sum(0)
            else:
                prob = z
            message = (ws @ (spatial_norm * fork_filter(spatial, prob))
                       + wb @ (bilateral_norm * fork_filter(bilateral, prob)))
            z = unary[b].reshape(c, -1) - mu @ message
        tops.append(z.reshape(c, h, w))
    return np.stack(tops)


def meanfield_case(extra, it=2):
    shapes = {"unary": (2, 3, 5, 7), "q0": (2, 3, 5, 7), "img": (2, 3, 5, 7)}
    model = load_from_text(net(MEANFIELD.format(it=it, extra=extra), inputs=shapes), random_weights=True)
    r = rng(11)
    crf = node_of(model, "crf")
    crf.blobs = [r.standard_normal((1, 1, 3, 3)).astype(F32) * F32(0.3) for _ in range(3)]
    feeds = {"unary": r.standard_normal(shapes["unary"]).astype(F32),
             "q0": r.standard_normal(shapes["q0"]).astype(F32),
             "img": r.uniform(0, 255, shapes["img"]).astype(F32)}
    return model, crf, feeds


def test_meanfield_without_softmax_matches_the_fork(tmp_path):
    model, crf, feeds = meanfield_case("do_softmax: false", it=3)
    assert crf.attrs["no_softmax"]
    ref = fork_meanfield(feeds["unary"], feeds["q0"], feeds["img"], crf.blobs, 3, 5, 45, 3, False)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-4, rtol=1e-5, opsets=(16, None))


def test_meanfield_do_softmax_true_reads_as_crf_as_rnn(tmp_path):
    # CRF-as-RNN's files (no do_softmax) and do_softmax: true both keep the softmax, with the same numbers
    plain, crf, feeds = meanfield_case("")
    explicit, crf2, _ = meanfield_case("do_softmax: true")
    assert not crf.attrs["no_softmax"] and not crf2.attrs["no_softmax"]
    crf2.blobs = crf.blobs
    ref = fork_meanfield(feeds["unary"], feeds["q0"], feeds["img"], crf.blobs, 2, 5, 45, 3, True)
    check_everywhere(plain, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(16, None))
    np.testing.assert_array_equal(explicit.run(feeds)["o"], plain.run(feeds)["o"])


# ---- the corpus files -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, shape, types", [
    ("AFFINE_TEST__Test", (6, 3, 256, 256), {"RBF": (6, 1, 64, 64)}),
    ("BILATERAL_TEST__Test", (1, 3, 24, 32), {"BilateralFilter": (1, 3, 24, 32),
                                              "TestOpenCVPreview": (1, 3, 24, 32)}),
    ("BILATERAL_TEST__Test_meanfield", (1, 3, 24, 32), {"MultiStageMeanfield": (1, 3, 24, 32)}),
])
def test_corpus_files_read(name, shape, types):
    path = CORPUS / f"jasonbunk__caffe__examples__{name}.prototxt"
    model = load_from_text(path.read_text(), input_shapes={"data_rgb": shape}, random_weights=True)
    for node in model.graph.nodes:
        if node.type in types:
            assert model.graph.tensors[node.outputs[0]].shape == types[node.type]
    if "BILATERAL" in name:
        x = rng(5).uniform(0, 255, shape).astype(F32)
        out = model.run({"data_rgb": x})["testcopy"]
        assert out.shape == shape and np.isfinite(out).all()
