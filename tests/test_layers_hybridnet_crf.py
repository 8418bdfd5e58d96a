"""stephenyan1231/caffe-hybridnet's DenseCRFMeanfield (caffeq/layers/hybridnet_crf.py) against a reference written
here from the fork's C++ (dense_crf_meanfield_layer.cpp Forward_cpu, compute_*_kernel; modified_permutohedral.cpp
with SSE_PERMUTOHEDRAL off: init_cpu and seqCompute): float32 loops point by point, a dict in insertion order for
its hash table."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_everywhere, model_py_outputs, net, node_of, onnx_outputs, rng
from permutohedral_reference import fork_filter
from permutohedral_reference import fork_lattice as reference_lattice

from caffeq.__main__ import main
from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.layers.hybridnet_crf import hybridnet_filter, hybridnet_lattice, hybridnet_simplex
from caffeq.layers.permutohedral import lattice_simplex, permutohedral_filter, permutohedral_lattice
from caffeq.model import load_from_text

F32 = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


def short(k):
    """The fork's short key: the int wrapped to 16 bits."""
    return (k + 32768) % 65536 - 32768


def fork_point_simplex(f):
    """One point of ModifiedPermutohedral::init_cpu (the sequential build): (rem0, rank, barycentric)."""
    d = len(f)
    inv_std_dev = F32(math.sqrt(float(F32(2.0) / F32(3))) * (d + 1))
    scale = [F32(1.0 / math.sqrt(float(F32((i + 2) * (i + 1)))) * float(inv_std_dev)) for i in range(d)]
    elevated, sm = [F32(0)] * (d + 1), F32(0)
    for j in range(d, 0, -1):
        cf = F32(f[j - 1] * scale[j - 1])
        elevated[j] = F32(sm - F32(j * cf))
        sm = F32(sm + cf)
    elevated[0] = sm
    down, up = F32(F32(1.0) / F32(d + 1)), F32(d + 1)
    rem0, total = [], 0
    for i in range(d + 1):
        v = F32(down * elevated[i])
        if F32(F32(np.ceil(v)) * up - elevated[i]) < F32(elevated[i] - F32(np.floor(v)) * up):
            rd = int(np.ceil(v))
        else:
            rd = int(np.floor(v))
        rem0.append(rd * (d + 1))
        total += rd
    rank = [0] * (d + 1)
    for i in range(d):
        di = F32(elevated[i] - F32(rem0[i]))
        for j in range(i + 1, d + 1):
            if di < F32(elevated[j] - F32(rem0[j])):
                rank[i] += 1
            else:
                rank[j] += 1
    for i in range(d + 1):
        rank[i] += total
        if rank[i] < 0:
            rank[i] += d + 1
            rem0[i] += d + 1
        elif rank[i] > d:
            rank[i] -= d + 1
            rem0[i] -= d + 1
    bary = [F32(0)] * (d + 2)
    for i in range(d + 1):
        v = F32(F32(elevated[i] - F32(rem0[i])) * down)
        bary[d - rank[i]] = F32(bary[d - rank[i]] + v)
        bary[d - rank[i] + 1] = F32(bary[d - rank[i] + 1] - v)
    bary[0] = F32(float(bary[0]) + (1.0 + float(bary[d + 1])))
    return rem0, rank, bary


def fork_lattice(features):
    """init_cpu: (offsets, barycentric weights, neighbours, M), the points as they come (no padding)."""
    return reference_lattice(features, pad_to_blocks=False, simplex=fork_point_simplex)


def fork_seq_filter(lattice, values):
    """seqCompute of values (C, N), reverse and add false."""
    return fork_filter(lattice, values, sequential=True)


def fork_meanfield(unary, q0, image, ws, wb, mu, iterations, theta_alpha, theta_beta, theta_gamma):
    """DenseCRFMeanfieldLayer::Forward_cpu, image by image."""
    n, c, h, w = unary.shape
    pixels = h * w
    p = np.arange(pixels)
    xy = np.stack([p % w, p // w], 1).astype(F32)
    ones = np.ones((1, pixels), F32)
    spatial = fork_lattice(xy / F32(theta_gamma))
    spatial_norm = F32(1) / (fork_seq_filter(spatial, ones)[0] + F32(1e-20))
    flat = image.reshape(-1)
    stride = flat.size // image.shape[0]   # offset(n): n C' H' W', the planes read flat from there
    tops = []
    for b in range(n):
        rgb = flat[b * stride:b * stride + 3 * pixels].reshape(3, pixels).T / F32(theta_beta)
        bilateral = fork_lattice(np.concatenate([xy / F32(theta_alpha), rgb], 1).astype(F32))
        bilateral_norm = F32(1) / (fork_seq_filter(bilateral, ones)[0] + F32(1e-20))
        q = q0[b].reshape(c, pixels)
        for _ in range(iterations):
            e = np.exp(q - q.max(0))
            prob = e / e.sum(0)
            message = F32(ws) * (spatial_norm * fork_seq_filter(spatial, prob))
            message = message + F32(wb) * (bilateral_norm * fork_seq_filter(bilateral, prob))
            q = unary[b].reshape(c, pixels) - mu @ message
        tops.append(q.reshape(c, h, w))
    return np.stack(tops)


# ---- the lattice ---------------------------------------------------------------------------------

def ours(features, values):
    return hybridnet_filter(torch.from_numpy(values), *hybridnet_lattice(torch.from_numpy(features))).numpy()


@pytest.mark.parametrize("d, channels", [(2, 1), (2, 3), (5, 1), (5, 4), (3, 5)])
def test_lattice_filter_matches_the_forks_sequential_build(d, channels):
    """Bit for bit: the same float32 operations in the fork's order (splat, blur, (weight x value) x alpha)."""
    r = rng(d * 10 + channels)
    feats = (r.standard_normal((37, d)) * 2).astype(F32)
    feats[5] = 0                      # ties in the ranks: the later coordinate ranks higher
    feats[9] = feats[3]               # two points on the same vertices
    feats[11, :2] = feats[12, :2]
    values = r.standard_normal((channels, 37)).astype(F32)
    np.testing.assert_array_equal(ours(feats, values), fork_seq_filter(fork_lattice(feats), values))


def test_lattice_has_no_padding_points():
    """7 points near the origin: CRF-RNN's SSE build adds an origin point's vertices, which change the blur;
    the fork's sequential build does not."""
    feats = (rng(6).standard_normal((7, 2)) * 0.6 + 0.8).astype(F32)
    values = rng(1).standard_normal((3, 7)).astype(F32)
    want = fork_seq_filter(fork_lattice(feats), values)
    crf_rnn = permutohedral_filter(torch.from_numpy(values), *permutohedral_lattice(torch.from_numpy(feats))).numpy()
    assert np.abs(crf_rnn - want).max() > 1e-3
    np.testing.assert_array_equal(ours(feats, values), want)


@pytest.mark.parametrize("d, scale", [(2, 4), (3, 8), (5, 2)])
def test_simplex_matches_the_forks_point_by_point(d, scale):
    """Quarter and eighth steps tie in the rounding (e halfway between multiples of d + 1, which the fork's
    comparison sends down: rounding them up lands in the same simplex once the ranks wrap) and in the ranks; weight 0 adds 1.0 + the wrapped weight in double, which CRF-RNN's
    SSE build (lattice_simplex) rounds in float32 for some of these points."""
    f = (rng(d).integers(-12, 13, (300, d)) / scale).astype(F32)
    keys, weights = hybridnet_simplex(torch.from_numpy(f))
    canonical = [[i if j <= d - i else i - (d + 1) for j in range(d + 1)] for i in range(d + 1)]
    for k in range(len(f)):
        rem0, rank, bary = fork_point_simplex(f[k])
        assert keys[k].tolist() == [[short(rem0[i] + canonical[r][rank[i]]) for i in range(d)] for r in range(d + 1)]
        np.testing.assert_array_equal(weights[k].numpy(), np.array(bary[:d + 1], F32))
    assert (weights != lattice_simplex(torch.from_numpy(f))[1]).any()


def test_lattice_on_a_tie_rich_pixel_grid():
    """Pixel coordinates over 4 and over 1 (the spatial kernel of theta_gamma 4 or 1) tie everywhere."""
    for theta in (4, 1):
        p = np.arange(6 * 9)
        xy = (np.stack([p % 9, p // 9], 1).astype(F32) / F32(theta)).astype(F32)
        values = rng(theta).standard_normal((3, 54)).astype(F32)
        np.testing.assert_array_equal(ours(xy, values), fork_seq_filter(fork_lattice(xy), values))


def test_lattice_wraps_keys_as_the_forks_shorts():
    feats = (rng(2).standard_normal((21, 3)) * 4000).astype(F32)
    values = rng(3).standard_normal((3, 21)).astype(F32)
    np.testing.assert_array_equal(ours(feats, values), fork_seq_filter(fork_lattice(feats), values))


# ---- DenseCRFMeanfield ---------------------------------------------------------------------------

LAYER = ('layer {{ name: "crf" type: "DenseCRFMeanfield" bottom: "unary" bottom: "q0" bottom: "img" top: "o" '
         'dense_crf_meanfield_param {{ {params} }} }}')
PARAMS = "num_iterations: {it} theta_alpha: 5 theta_beta: 3 theta_gamma: 4"


def image(r, shape):
    """A test image: integer colours (so pixels tie) with a flat patch."""
    img = r.integers(0, 40, shape).astype(F32)
    img.reshape(shape[0], -1)[:, 3:12] = 17
    return img


def crf_model(unary_shape, img_shape, params, q0_shape=None, random_weights=True):
    shapes = {"unary": unary_shape, "q0": q0_shape or unary_shape, "img": img_shape}
    return load_from_text(net(LAYER.format(params=params), inputs=shapes), random_weights=random_weights)


@pytest.mark.parametrize("classes, it, img_shape", [(3, 4, (2, 4, 5, 7)), (4, 2, (2, 3, 5, 7)),
                                                    (3, 3, (3, 1, 11, 10)), (2, 3, (2, 3, 7, 5))])
def test_meanfield_matches_the_forks_forward(classes, it, img_shape, tmp_path):
    """Images of 4 channels (the fourth unread), of the unary's own shape, one of 3 images of 1 x 11 x 10 (the
    first 105 values of each read flat as 3 planes of 5 x 7) and one 7 x 5 (read as 5 x 7)."""
    unary_shape = (2, classes, 5, 7)
    model = crf_model(unary_shape, img_shape, PARAMS.format(it=it))
    assert model.blob_shapes["o"] == unary_shape
    r = rng(classes + it)
    crf = node_of(model, "crf")
    crf.blobs = [np.full((1, 1, 1, 1), 2.5, F32), np.full((1, 1, 1, 1), 4.0, F32),
                 r.standard_normal((1, 1, classes, classes)).astype(F32)]
    feeds = {"unary": (r.standard_normal(unary_shape) * 2).astype(F32),
             "q0": r.standard_normal(unary_shape).astype(F32), "img": image(r, img_shape)}
    ref = fork_meanfield(feeds["unary"], feeds["q0"], feeds["img"], 2.5, 4.0, crf.blobs[2].reshape(classes, classes),
                         it, 5, 3, 4)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(16, None))


def test_meanfield_starts_from_the_forks_weights(tmp_path):
    """Without a caffemodel the blobs are the fork's start: spatial_filter_weight, bilateral_filter_weight, Potts."""
    model = crf_model((1, 3, 4, 6), (1, 3, 4, 6), "num_iterations: 3 spatial_filter_weight: 1.5 "
                                                  "bilateral_filter_weight: 0.5")
    blobs = node_of(model, "crf").blobs
    assert [b.shape for b in blobs] == [(1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 3, 3)]
    assert blobs[0].item() == 1.5 and blobs[1].item() == 0.5
    np.testing.assert_array_equal(blobs[2].reshape(3, 3), -np.eye(3, dtype=F32))
    r = rng(4)
    feeds = {"unary": r.standard_normal((1, 3, 4, 6)).astype(F32), "q0": r.standard_normal((1, 3, 4, 6)).astype(F32),
             "img": image(r, (1, 3, 4, 6))}
    ref = fork_meanfield(feeds["unary"], feeds["q0"], feeds["img"], 1.5, 0.5, -np.eye(3, dtype=F32), 3, 80, 3, 3)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(16,))


@pytest.mark.parametrize("params, words", [
    ("num_iterations: 1", "dense_crf_meanfield_param.num_iterations must be > 1"),
    ("spatial_filter_weight: -1", "dense_crf_meanfield_param.spatial_filter_weight must be >= 0"),
    ("bilateral_filter_weight: -0.5", "dense_crf_meanfield_param.bilateral_filter_weight must be >= 0"),
    ("spatial_filter_weight: nan", "dense_crf_meanfield_param.spatial_filter_weight must be >= 0 .the fork.s CHECK., got nan"),
    ("num_iterations: 2147483648", "dense_crf_meanfield_param.num_iterations must be > 1 .the fork's CHECK, on an int"),
])
def test_the_forks_setup_checks(params, words):
    with pytest.raises(LayerError, match=words):
        crf_model((1, 2, 3, 4), (1, 3, 3, 4), params)


@pytest.mark.parametrize("unary_shape, q0_shape, words", [
    ((6,), (1, 6), r"unary \(bottom 0\) needs a channel axis"),
    ((1, 6), (6,), r"Q0 \(bottom 1\) needs a channel axis"),
])
def test_unary_and_q0_need_the_softmax_axis(unary_shape, q0_shape, words):
    """LayerSetUp sets up softmaxes (axis 1) on Q0 and on blobs shaped as the unary: CanonicalAxisIndex CHECKs."""
    with pytest.raises(LayerError, match=words):
        crf_model(unary_shape, (1, 3, 2, 3), "num_iterations: 2", q0_shape=q0_shape)


@pytest.mark.parametrize("q0_shape, img_shape", [((2, 3, 24), (4, 1, 4, 6)), ((2, 3, 6, 4), (4, 24)),
                                                 ((2, 3, 2, 3, 4), (2, 5, 6, 4)), ((3, 3, 4, 6), (2, 3, 4, 6))])
def test_meanfield_reads_q0_and_the_image_flat_as_the_fork(q0_shape, img_shape, tmp_path):
    """Q0 of another shape holding (N, C, H W) gives the same softmax over its axis 1, and of a third image one the
    lattices never read; image n's colours are the 3 H W values from its offset(n): planes 0-2 and 1-3 of a
    (4, 1, H, W) image for N = 2 (the last ends at the blob's end), and of (2, 5, 6, 4), 72 values from 0 and
    from 120."""
    unary_shape = (2, 3, 4, 6)
    model = crf_model(unary_shape, img_shape, PARAMS.format(it=3), q0_shape=q0_shape)
    assert model.blob_shapes["o"] == unary_shape
    r = rng(len(img_shape))
    crf = node_of(model, "crf")
    crf.blobs = [np.full((1, 1, 1, 1), 1.5, F32), np.full((1, 1, 1, 1), 3.0, F32),
                 r.standard_normal((1, 1, 3, 3)).astype(F32)]
    feeds = {"unary": (r.standard_normal(unary_shape) * 2).astype(F32), "q0": r.standard_normal(q0_shape).astype(F32),
             "img": image(r, img_shape)}
    q0 = feeds["q0"].reshape(-1)[:math.prod(unary_shape)].reshape(unary_shape)   # Q0's first N images
    ref = fork_meanfield(feeds["unary"], q0, feeds["img"], 1.5, 3.0,
                         crf.blobs[2].reshape(3, 3), 3, 5, 3, 4)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(16,))


def test_three_bottoms():
    text = net('layer { name: "crf" type: "DenseCRFMeanfield" bottom: "u" bottom: "q" top: "o" }',
               inputs={"u": (1, 2, 3, 4), "q": (1, 2, 3, 4)})
    with pytest.raises(LayerError, match=r"DenseCRFMeanfield takes 3 bottoms \(unary, Q0, image\)"):
        load_from_text(text)


@pytest.mark.parametrize("q0_shape, img_shape, words", [
    ((1, 3, 4, 5), (1, 3, 4, 6), "Q0 [1, 3, 4, 5] is not shaped as the unary"),
    (None, (1, 2, 4, 6), "does not hold 3 x 4 x 6 colour values"),
    (None, (0, 3, 4, 6), "for each of the unary's 1 images"),
    ((3, 3, 8), (1, 3, 4, 6), "Q0 [3, 3, 8] is not shaped"),
    ((0, 3, 4, 6), (1, 3, 4, 6), "Q0 [0, 3, 4, 6] is not shaped"),
    ((1, 6, 4, 3), (1, 3, 4, 6), "Q0 [1, 6, 4, 3] is not shaped"),
    (None, (1, 3, 4, 6, 1), "the image [1, 3, 4, 6, 1] at offset"),
])
def test_reads_past_the_bottoms_are_refused(q0_shape, img_shape, words, tmp_path):
    model = crf_model((1, 3, 4, 6), img_shape, "num_iterations: 2", q0_shape=q0_shape)
    assert model.blob_shapes["o"] == (1, 3, 4, 6)
    feeds = {"unary": np.zeros((1, 3, 4, 6), F32), "q0": np.zeros(q0_shape or (1, 3, 4, 6), F32),
             "img": np.zeros(img_shape, F32)}
    match = "layer 'crf' \\(DenseCRFMeanfield\\): .*" + words.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(CaffeqError, match=match):
        model.run(feeds)
    with pytest.raises(ExportError, match=match):
        onnx_outputs(model, feeds, tmp_path, opset=16)
    with pytest.raises(ExportError, match=match):
        model_py_outputs(model, feeds, tmp_path)


def test_the_forks_deploy_file_reads(capsys):
    path = REALWORLD / "stephenyan1231__caffe-hybridnet__examples__voc12_SBD__H_ReNet_densecrf_deploy.prototxt"
    assert main(["inspect", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("inference1"))
    assert "DenseCRFMeanfield" in line and "unary,Q0,data -> inference1" in line and "1x21x400x500" in line


def test_meanfield_stays_on_the_blobs_device():
    """On an emulated GPU (cuda_emulation.py) the lattices' index tensors, constants and lookups follow the blobs."""
    from cuda_emulation import run_on_emulated_cuda
    model = crf_model((2, 3, 4, 5), (2, 4, 4, 5), "num_iterations: 3 theta_alpha: 2 theta_beta: 0.3 theta_gamma: 1")
    r = rng(12)
    feeds = {k: r.uniform(0, 1, s).astype(F32) for k, s in model.inputs.items()}
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, "\n".join(sorted(set(mixes)))
    np.testing.assert_allclose(out.as_subclass(torch.Tensor).numpy(), model.run(feeds, exact=True)["o"], rtol=1e-6,
                               atol=1e-6)
