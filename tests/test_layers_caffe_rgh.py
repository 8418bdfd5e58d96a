"""Sundrops/caffe-rgh 9817946: Interpolation (interpolation_layer.cpp inflate_forward / .cu InflateForwardGPU),
Conf (conf_layer.cpp Forward_cpu) and MASK (mask.cpp Forward_cpu), against loops written from the C++."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, inspect_corpus_file, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
CORPUS = str(REPO / "tests" / "fixtures" / "realworld" / "Sundrops__caffe-rgh__examples__train_our_dataset__train_bignet__")


def interpolation_ref(x, ho, wo):
    n, c, h, w = x.shape
    fh, fw = F((ho - 1.0) / (h - 1.0)), F((wo - 1.0) / (w - 1.0))
    out = np.zeros((n, c, ho, wo), F)
    for yt in range(ho):
        ys = F(F(yt) / fh)
        for xt in range(wo):
            xs = F(F(xt) / fw)
            acc = np.zeros((n, c), F)
            rn = max(math.floor(F(ys - F(1))) + 1, 0)
            while rn < min(F(ys + F(1)), h):
                m = max(math.floor(F(xs - F(1))) + 1, 0)
                while m < min(F(xs + F(1)), w):
                    wx = F(F(1) - abs(F(xs - F(m))))
                    wy = F(F(1) - abs(F(ys - F(rn))))
                    acc = acc + x[:, :, rn, m] * wx * wy
                    m += 1
                rn += 1
            out[:, :, yt, xt] = acc
    return out


def interpolation_net(x_shape, ref_shape):
    return net('layer { name: "i" type: "Interpolation" bottom: "x" bottom: "ref" top: "o" }',
               inputs={"x": x_shape, "ref": ref_shape})


@pytest.mark.parametrize("x_hw, ref_hw", [((5, 7), (17, 26)), ((9, 6), (4, 11)), ((6, 11), (6, 11)), ((3, 2), (37, 19))])
def test_interpolation(x_hw, ref_hw, tmp_path):
    x = rng(1).standard_normal((2, 3) + x_hw).astype(F)
    ref = np.zeros((1, 1) + ref_hw, F)
    model = load_from_text(interpolation_net(x.shape, ref.shape))
    assert model.blob_shapes["o"] == (2, 3) + ref_hw
    want = interpolation_ref(x, *ref_hw)
    check_everywhere(model, {"x": x, "ref": ref}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_interpolation_corners_are_the_source_corners(tmp_path):
    x = rng(2).standard_normal((2, 2, 7, 5)).astype(F)
    model = load_from_text(interpolation_net(x.shape, (2, 1, 19, 13)))
    out = model.run({"x": x, "ref": np.zeros((2, 1, 19, 13), F)})["o"]
    np.testing.assert_allclose(out[:, :, ::3, ::3], x, atol=1e-6)


@pytest.mark.parametrize("x_hw, ref_hw, word", [((1, 5), (4, 9), "height"), ((5, 5), (80, 9), "height"),
                                                 ((30, 21), (7, 2), "width"), ((2, 5), (20, 9), "height"),
                                                 ((5, 12), (9, 2), "width")])
def test_interpolation_factor_bounds(x_hw, ref_hw, word):
    with pytest.raises(LayerError, match=f"Interpolation's {word} factor"):
        load_from_text(interpolation_net((1, 1) + x_hw, (1, 1) + ref_hw))


def test_interpolation_factor_bounds_are_inclusive():
    """Reshape's CHECK_LE(factor, 18) and CHECK_GE(factor, 0.1f): 17 / 1 = 18 and 1 / 10 = float32(0.1) pass."""
    model = load_from_text(interpolation_net((1, 2, 2, 11), (1, 1, 19, 2)))
    assert model.blob_shapes["o"] == (1, 2, 19, 2)


@pytest.mark.parametrize("x_hw, ref_hw", [((8, 12), (20, 14)), ((5, 7), (17, 26))])
def test_interpolation_is_the_forks_float32_arithmetic(x_hw, ref_hw):
    """Bit for bit in torch: the source coordinate y / factor as a float32 division, and (8 -> 20, 12 -> 14)
    last rows and columns whose float32 coordinate lands just past the data's last index (one tap there)."""
    x = rng(11).standard_normal((2, 3) + x_hw).astype(F)
    ref = np.zeros((1, 1) + ref_hw, F)
    out = load_from_text(interpolation_net(x.shape, ref.shape)).run({"x": x, "ref": ref})["o"]
    np.testing.assert_array_equal(out, interpolation_ref(x, *ref_hw))


def conf_ref(a, b, ch):
    n, c, h, w = a.shape
    dim = h * w
    out = np.zeros((n, ch, h, w), F)
    for i in range(n):
        d = np.zeros(dim, F)
        for k in range(3):
            d = d + np.abs(a[i, k].ravel() - b[i, k].ravel())
        aw = a[i].reshape(3, dim)
        valid = (aw[0] != 0) | (aw[1] != 0) | (aw[2] != 0)
        total = np.cumsum(np.where(valid, d, F(0)), dtype=F)[-1]   # the fork's float32 loop
        reg = F(float(total) * 2.0 / int(valid.sum()))
        y = np.exp(d * F(-1.0 / float(reg)))
        y[~valid] = 0
        out[i] = y.reshape(1, h, w)
    return out


@pytest.mark.parametrize("param, ch", [("", 13), ("conf_channels_param { conf_ch: 2 }", 2)])
def test_conf(param, ch, tmp_path):
    r = rng(3)
    a = r.uniform(-4, 4, (2, 3, 7, 10)).astype(F)
    a[:, :, :2, :3] = 0                     # warped pixels outside the image: conf 0, not counted
    a[0, 1, 5, 5] = 0                       # one channel 0 only: still valid
    b = r.uniform(-4, 4, a.shape).astype(F)
    model = load_from_text(net(f'layer {{ name: "c" type: "Conf" bottom: "a" bottom: "b" top: "o" {param} }}',
                               inputs={"a": a.shape, "b": b.shape}))
    assert model.blob_shapes["o"] == (2, ch, 7, 10)
    want = conf_ref(a, b, ch)
    assert (want[:, :, :2, :3] == 0).all() and (want[0, :, 5, 5] > 0).all()
    check_everywhere(model, {"a": a, "b": b}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_conf_item_without_valid_pixels_is_zero(tmp_path):
    a = rng(4).uniform(-1, 1, (2, 3, 5, 6)).astype(F)
    a[1] = 0
    b = rng(5).uniform(-1, 1, a.shape).astype(F)
    model = load_from_text(net('layer { name: "c" type: "Conf" bottom: "a" bottom: "b" top: "o" '
                               'conf_channels_param { conf_ch: 3 } }', inputs={"a": a.shape, "b": b.shape}))
    want = conf_ref(a[:1], b[:1], 3)
    check_everywhere(model, {"a": a, "b": b}, {"o": np.concatenate([want, np.zeros_like(want)])}, tmp_path,
                     atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layer, shapes, match", [
    ('layer { name: "c" type: "Conf" bottom: "a" bottom: "b" top: "o" conf_channels_param { conf_ch: 0 } }',
     ((1, 3, 4, 5), (1, 3, 4, 5)), "conf_channels_param.conf_ch"),
    ('layer { name: "c" type: "Conf" bottom: "a" bottom: "b" top: "o" }', ((1, 4, 4, 5), (1, 4, 4, 5)), "Conf needs"),
    ('layer { name: "c" type: "Conf" bottom: "a" bottom: "b" top: "a" }', ((1, 3, 4, 5), (1, 3, 4, 5)), "in-place"),
    ('layer { name: "m" type: "MASK" bottom: "a" top: "o" }', ((1, 1, 4, 5), (1, 1, 1, 1)), "mask_param.background"),
])
def test_refusals(layer, shapes, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(net(layer, inputs={"a": shapes[0], "b": shapes[1]}))


def test_mask(tmp_path):
    x = rng(6).integers(0, 6, (2, 1, 5, 8)).astype(F)
    x[0, 0, 0, 0] = 2.5
    model = load_from_text(net('layer { name: "m" type: "MASK" bottom: "x" top: "o" mask_param { background: 0 '
                               'background: 3 } }', inputs={"x": x.shape}))
    want = np.ones_like(x)
    for i in np.ndindex(x.shape):
        for bg in (0, 3):
            if x[i] == F(bg):
                want[i] = 0
                break
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)


@pytest.mark.parametrize("name", ["train_bignet.prototxt", "train_flow_flyingchairs.prototxt"])
def test_corpus_files_read(name):
    shape = "1,3,241,377"
    out = inspect_corpus_file(CORPUS + name, "--input-shape", f"img_t*={shape}", "--input-shape", f"img_t-={shape}",
                              "--input-shape", f"img_t+={shape}", "--input-shape", "parsing=1,1,241,377")
    assert "Interpolation" in out and "1x13x241x377" in out and "2x2x241x377" in out
