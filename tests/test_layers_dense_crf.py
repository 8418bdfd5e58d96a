"""DeepLab v2's DenseCRF (caffeq/layers/dense_crf.py) against a reference written here from the fork's C++
(xmyqsh/deeplab-v2 src/caffe/layers/densecrf_layer.cpp, util/densecrf_pairwise.cpp, util/permutohedral.cpp,
include/caffe/util/densecrf_util.hpp): float32 loops pixel by pixel, the lattice from
permutohedral_reference.py.  CCNN's DenseCRF reads and is refused.
"""
import numpy as np
import pytest
import torch
from conftest import check_everywhere, net, node_of, onnx_outputs, rng
from permutohedral_reference import F32, fork_filter, fork_lattice

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.layers.dense_crf import densecrf_fast_exp
from caffeq.model import load_from_text


def fork_very_fast_exp(x):
    t = F32(0.0001413161)
    for c in (0.0013298820, 0.0083013598, 0.0416573475, 0.1666653019, 0.4999999206, 0.9999999995):
        t = F32(F32(c) - F32(x * t))
    return F32(F32(1) - F32(x * t))


def fork_fast_exp(x):
    """densecrf_util.hpp's scalar fast_exp, line by line."""
    x, less_zero = F32(x), True
    if x < 0:
        less_zero, x = False, F32(-x)
    if x > 20:
        return F32(0)
    mult = 0
    for bound, divisor, count in ((0.69 * 2 * 2 * 2, 8, 3), (0.69 * 2 * 2, 4, 2), (0.69, 2, 1)):
        while float(x) > bound:
            mult += count
            x = F32(x / F32(divisor))
    x = fork_very_fast_exp(x)
    while mult:
        mult -= 1
        x = F32(x * x)
    return F32(F32(1) / x) if less_zero else x


def fork_exp_and_normalize(values):
    """DenseCRFLayer::ExpAndNormalize(out, in, 1.0) of (M, N)."""
    out = np.zeros_like(values)
    for i in range(values.shape[1]):
        b = values[:, i]
        mx = b.max()
        v = [fork_fast_exp(F32(bj - mx)) for bj in b]
        tt = F32(0)
        for vj in v:
            tt = F32(tt + vj)
        out[:, i] = [F32(vj / tt) for vj in v]
    return out


def fork_dense_crf(scores, sizes, image, iterations, spatial, bilateral, probability):
    n, m, hp, wp = scores.shape
    top = np.zeros(scores.shape, F32)
    for b in range(n):
        h, w = int(sizes[b].flat[0]), int(sizes[b].flat[1])
        if hp <= h and wp <= w:
            h, w = hp, wp
        if h * w == 0:   # no pixel: nothing written after the memset
            continue
        im = image[0]   # the fork reads the first image's colours for every n
        terms = []
        for weight, std in spatial:
            terms.append((weight, np.array([[F32(i) / F32(std), F32(j) / F32(std)]
                                            for j in range(h) for i in range(w)], F32)))
        for weight, std, rgb in bilateral:
            terms.append((weight, np.array([[F32(i) / F32(std), F32(j) / F32(std)]
                                            + [F32(im[c, j, i]) / F32(rgb) for c in range(3)]
                                            for j in range(h) for i in range(w)], F32)))
        kernels = []
        for weight, feats in terms:
            lattice = fork_lattice(feats)
            norm = F32(1) / (fork_filter(lattice, np.ones((1, h * w), F32), sse_only=True)[0] + F32(1e-20))
            kernels.append((weight, norm, lattice))
        energy = scores[b, :, :h, :w].reshape(m, -1)    # -unary: the scores
        current = fork_exp_and_normalize(energy)
        for _ in range(iterations):
            nxt = energy.copy()
            for weight, norm, lattice in kernels:
                nxt = nxt + (F32(weight) * norm) * fork_filter(lattice, current, sse_only=True)
            current = fork_exp_and_normalize(nxt)
        out = current if probability else np.log(np.maximum(current, np.finfo(F32).tiny))
        top[b, :, :h, :w] = out.reshape(m, h, w)
    return top


def test_fast_exp_matches_libdensecrfs_bit_for_bit():
    xs = np.concatenate([np.linspace(-25, 25, 2001), [0, -0.0, 0.69, -0.69, 5.52, -5.52, 2.76, -2.76, 20, -20],
                         np.nextafter(F32([5.52, -5.52, 0.69, 20]), F32(0)),
                         np.nextafter(F32([5.52, -5.52, 0.69, 20]), F32(100))]).astype(F32)
    got = densecrf_fast_exp(torch.from_numpy(xs)).numpy()
    np.testing.assert_array_equal(got, np.array([fork_fast_exp(x) for x in xs], F32))
    assert np.abs(got[np.abs(xs) < 20] - np.exp(xs[np.abs(xs) < 20].astype(np.float64))).max() < 1e-3 * np.exp(20)


DENSE_CRF = ('layer {{ name: "crf" type: "DenseCRF" bottom: "scores" bottom: "dims" {image} top: "o" '
             'dense_crf_param {{ max_iter: {it} {terms} }} }}')
BILATERAL = "bi_w: 4 bi_xy_std: 50 bi_rgb_std: 5"


def feeds_for(shapes, sizes, seed):
    r = rng(seed)
    img = r.integers(0, 255, shapes["img"]).astype(F32)
    img[:, :, 1:4, 2:5] = 120
    return {"scores": (r.standard_normal(shapes["scores"]) * 2).astype(F32),
            "dims": np.array(sizes, F32).reshape(shapes["dims"]), "img": img}


@pytest.mark.parametrize("terms, sizes, probability", [
    # DeepLab's test nets: one spatial and one bilateral term, the padded size smaller than the images'
    ("pos_w: 3 pos_xy_std: 3 " + BILATERAL, [[6, 7], [9, 9]], True),
    # a region: only image 0's first 4 x 5 pixels, the log of Q (0 outside)
    ("pos_w: 3 pos_xy_std: 3 " + BILATERAL + " output_probability: false", [[4, 5], [6, 7]], False),
    # two spatial terms, two bilateral ones, and a tall region for image 1
    ("pos_w: 3 pos_xy_std: 3 pos_w: 1 pos_xy_std: 1 " + BILATERAL + " bi_w: 2 bi_xy_std: 20 bi_rgb_std: 13",
     [[6, 7], [6, 3]], True),
])
def test_dense_crf_matches_deeplabs_inference(terms, sizes, probability, tmp_path):
    shapes = {"scores": (2, 3, 6, 7), "dims": (2, 1, 1, 2), "img": (2, 3, 6, 7)}
    model = load_from_text(net(DENSE_CRF.format(image='bottom: "img"', it=3, terms=terms), inputs=shapes))
    assert model.graph.tensors["o"].shape == (2, 3, 6, 7)
    a = node_of(model, "crf").attrs
    feeds = feeds_for(shapes, sizes, 1)
    ref = fork_dense_crf(feeds["scores"], feeds["dims"], feeds["img"], 3, a["spatial"], a["bilateral"], probability)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(16, None))


def test_dense_crf_reads_the_first_images_colours_for_every_image():
    shapes = {"scores": (2, 3, 6, 7), "dims": (2, 1, 1, 2), "img": (2, 3, 6, 7)}
    model = load_from_text(net(DENSE_CRF.format(image='bottom: "img"', it=2, terms=BILATERAL), inputs=shapes))
    feeds = feeds_for(shapes, [[6, 7], [6, 7]], 2)
    first = model.run(feeds)["o"]
    feeds["img"][1] = 255 - feeds["img"][1]
    np.testing.assert_array_equal(model.run(feeds)["o"], first)
    feeds["img"][0] = 255 - feeds["img"][0]
    assert np.abs(model.run(feeds)["o"] - first).max() > 1e-3


def test_dense_crf_leaves_an_empty_region_zero_and_onnx_marks_the_sizes_it_refuses(tmp_path):
    shapes = {"scores": (2, 2, 4, 5), "dims": (2, 2), "img": (2, 3, 4, 5)}
    model = load_from_text(net(DENSE_CRF.format(image='bottom: "img"', it=2, terms=BILATERAL), inputs=shapes))
    feeds = feeds_for(shapes, [[0, 3], [3, 4]], 4)
    a = node_of(model, "crf").attrs
    ref = fork_dense_crf(feeds["scores"], feeds["dims"], feeds["img"], 2, a["spatial"], a["bilateral"], True)
    assert (ref[0] == 0).all() and (ref[1, :, 3:] == 0).all() and (ref[1, :, :3, :4] > 0).all()
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(None,))
    # a size the run refuses (the fork would read outside the scores): the exported graph gives NaN there
    feeds["dims"][0] = [3, 9]
    got = onnx_outputs(model, feeds, tmp_path)["o"]
    assert np.isnan(got[0]).all()
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_dense_crf_refuses_a_size_past_its_scores():
    shapes = {"scores": (1, 2, 4, 5), "dims": (1, 2), "img": (1, 3, 4, 5)}
    model = load_from_text(net(DENSE_CRF.format(image='bottom: "img"', it=2, terms=BILATERAL), inputs=shapes))
    feeds = feeds_for(shapes, [[3, 9]], 3)   # one side within, the other past: the fork reads outside
    with pytest.raises(CaffeqError, match="'crf' .DenseCRF.: image 0's size 3 x 9 leaves the 4 x 5 scores"):
        model.run(feeds)


def test_dense_crf_without_an_image_reads_and_refuses_to_run(tmp_path):
    """DeepLab v2's DenseCRF with two bottoms: top = the scores' (N, C, H, W); the fork's Reshape still
    reads a third bottom, so it cannot run."""
    shapes = {"scores": (2, 5, 6, 7), "dims": (2, 1, 1, 2)}
    model = load_from_text(net(DENSE_CRF.format(image="", it=4, terms="pos_w: 3 pos_xy_std: 3"), inputs=shapes))
    assert model.graph.tensors["o"].shape == (2, 5, 6, 7)
    assert node_of(model, "crf").attrs["iterations"] == 4
    with pytest.raises(CaffeqError, match="'crf' .DenseCRF.: DeepLab's DenseCRF without an image bottom cannot run"):
        model.run({k: np.full(s, 6, F32) for k, s in shapes.items()})
    with pytest.raises(ExportError, match="'crf' .DenseCRF"):
        model.export_onnx(str(tmp_path / "m.onnx"))


CCNN_CRF = ('layer { name: "crf" type: "DenseCRF" bottom: "scores" bottom: "img" top: "o" '
            'densecrf_param { x_gauss: 19 y_gauss: 19 wt_gauss: 15 x_bilateral: 61 y_bilateral: 61 '
            'r_bilateral: 10 g_bilateral: 10 b_bilateral: 10 wt_bilateral: 35 } }')


def test_ccnn_dense_crf_gives_the_label_map_and_refuses_to_run(tmp_path):
    # pathak22/ccnn's fcn_8s deploy: caffe-ccnn's DenseCRF labels each pixel, top (N, 1, H, W)
    shapes = {"scores": (2, 21, 6, 7), "img": (2, 3, 6, 7)}
    model = load_from_text(net(CCNN_CRF, inputs=shapes))
    assert model.graph.tensors["o"].shape == (2, 1, 6, 7)
    assert model.net.layer[-1].densecrf_param.wt_bilateral == 35
    with pytest.raises(CaffeqError, match="'crf' .DenseCRF.*CCNN's fully connected CRF"):
        model.run({k: np.zeros(s, np.float32) for k, s in shapes.items()})
    with pytest.raises(ExportError, match="'crf' .DenseCRF"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    # the fork's Reshape checks: the image's N, H, W, and no more channels than classes (bottoms in order)
    for img in [(2, 3, 6, 8), (2, 22, 6, 7)]:
        with pytest.raises(LayerError, match="takes the scores .N, C, H, W. then the image"):
            load_from_text(net(CCNN_CRF, inputs={"scores": (2, 21, 6, 7), "img": img}))


@pytest.mark.parametrize("image, bilateral, shapes, msg", [
    ('bottom: "img"', BILATERAL, {"dims": (1, 1)}, "holds 1 value"),
    ('bottom: "img"', "", {"img": (1, 3, 4, 4)}, "needs the bilateral terms"),
    ('bottom: "img"', "bi_w: 4 bi_xy_std: 50", {"img": (1, 3, 4, 4)}, "come in threes"),
    ('bottom: "img"', BILATERAL, {"img": (1, 3, 4, 5)}, "image must be"),
    ('bottom: "img"', BILATERAL, {"img": (1, 1, 4, 4)}, "image must be"),
])
def test_dense_crf_checks_as_the_fork_does(image, bilateral, shapes, msg):
    inputs = {"scores": (1, 2, 4, 4), "dims": (1, 1, 1, 2), "img": (1, 3, 4, 4), **shapes}
    if not image:
        inputs.pop("img")
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(DENSE_CRF.format(image=image, it=4, terms="pos_w: 3 pos_xy_std: 3 " + bilateral),
                           inputs=inputs))
