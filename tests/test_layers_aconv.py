"""AConvFast, the Active Convolution Unit of jyh2986/Active-Convolution (777d926: aconv_fast_layer.cpp/.cu).

The reference is a numpy loop written here from the fork's Forward_gpu: for each position group and tap, its
`interpolated` kernel (the four pixels of the tap's floor, 0 outside the image, mixed bilinearly in float32 in
the kernel's order; a tap on the grid reads its pixel alone), then the 1 x 1 product with that tap's weights,
summed over taps; the bias last.  Every case runs in torch, onnxruntime and the generated model.py.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

import caffeq
from caffeq.io.caffemodel import BlobData
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.writer import write_caffemodel
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def c_div(a, b):
    return int(a / b)     # C's division, toward zero (exact for these small ints)


def fork_interpolated(img, h_off, w_off, sx, sy):
    """The `interpolated` kernel for one pixel of one channel: img (H, W), (h_off, w_off) the tap's origin."""
    height, width = img.shape

    def at(y, x):
        return img[y, x] if 0 <= y < height and 0 <= x < width else F32(0)

    if sx == 0 and sy == 0:
        return at(h_off, w_off)
    ix, iy = math.floor(sx), math.floor(sy)
    dx, dy = F32(sx - F32(ix)), F32(sy - F32(iy))
    if dx == 0 and dy == 0:
        return at(h_off + iy, w_off + ix)
    x1, y1 = w_off + ix, h_off + iy
    q11, q21, q12, q22 = at(y1, x1), at(y1, x1 + 1), at(y1 + 1, x1), at(y1 + 1, x1 + 1)
    one = F32(1)
    return F32(q11 * (one - dx) * (one - dy) + q21 * dx * (one - dy) + q12 * (one - dx) * dy + q22 * dx * dy)


def fork_forward(x, weight, bias, xpos, ypos, stride, pad):
    """Forward_gpu: per group g and tap f, the sampled image through weight[g's outputs, :, f]; plus the bias."""
    n_, c_, height, width = x.shape
    cout, _, kh, kw = weight.shape
    groups, taps = xpos.shape[0], kh * kw
    og = cout // groups
    ho = c_div(height + 2 * pad[0] - 1, stride[0]) + 1
    wo = c_div(width + 2 * pad[1] - 1, stride[1]) + 1
    top = np.zeros((n_, cout, ho, wo), np.float64)
    wflat = weight.reshape(cout, c_, taps).astype(np.float64)
    for g in range(groups):
        for f in range(taps):
            sx, sy = xpos.reshape(groups, taps)[g, f], ypos.reshape(groups, taps)[g, f]
            samp = np.zeros((n_, c_, ho, wo), np.float64)
            for n in range(n_):
                for c in range(c_):
                    for h in range(ho):
                        for w in range(wo):
                            samp[n, c, h, w] = fork_interpolated(x[n, c], h * stride[0] - pad[0],
                                                                 w * stride[1] - pad[1], sx, sy)
            top[:, g * og:(g + 1) * og] += np.einsum("oc,nchw->nohw", wflat[g * og:(g + 1) * og, :, f], samp)
    return top if bias is None else top + bias.reshape(1, cout, 1, 1)


def layer(conv, aconv="", name="a", bottom="x", top="y"):
    return (f'layer {{ name: "{name}" type: "AConvFast" bottom: "{bottom}" top: "{top}" '
            f'aconv_param {{ {aconv} }} convolution_param {{ {conv} }} }}')


CASES = [
    # conv params; aconv params; x shape; top shape; the pad the fork uses; stride
    ("num_output: 4 kernel_size: 3 pad: 1", "position_group: 2 pos_filler_std: -1", (2, 3, 5, 7), (2, 4, 5, 7),
     (0, 0), (1, 1)),
    # pad 0 with a 3 x 3 kernel: the fork's pad is -1; a stride on the rows only
    ("num_output: 3 kernel_size: 3 stride_h: 2 stride_w: 1 bias_term: false", "", (2, 2, 7, 6), (2, 3, 3, 4),
     (-1, -1), (2, 1)),
    # a non-SQUARE type: aconv_param's pads, kernel_h x kernel_w
    ("num_output: 6 kernel_h: 2 kernel_w: 3 stride: 2", "type: CIRCLE pad_h: 1 pad_w: 0 position_group: 3",
     (2, 2, 6, 9), (2, 6, 4, 5), (1, 0), (2, 2)),
    # the ACU's first layer: 1 x 1 (its position stays at the origin when trained; here it moves)
    ("num_output: 5 kernel_size: 1", "type: RANDOM pad: -1", (2, 3, 4, 6), (2, 5, 2, 4), (-1, -1), (1, 1)),
    # SQUARE with convolution_param's pad_h alone (pad_w 0) and a 3 x 1 kernel: each axis loses its own k / 2
    ("num_output: 2 kernel_size: 3 kernel_size: 1 pad_h: 2", "", (2, 2, 5, 6), (2, 2, 7, 6), (1, 0), (1, 1)),
    # pad_w alone: pad_h is 0 (aconv_param.pad no longer counts); Wo = (2 - 2 - 1) / 2 + 1 = 1 in C's truncating
    # division (a floor would make it 0)
    ("num_output: 3 kernel_h: 1 kernel_w: 3 stride: 2", "type: CIRCLE pad: 3 pad_w: -1", (2, 2, 5, 2),
     (2, 3, 3, 1), (0, -1), (2, 2)),
]


@pytest.mark.parametrize("conv, aconv, x_shape, y_shape, pad, stride", CASES)
def test_matches_the_forks_forward(conv, aconv, x_shape, y_shape, pad, stride, tmp_path):
    model = load_from_text(net(layer(conv, aconv), inputs={"x": x_shape}), random_weights=True)
    node = node_of(model, "a")
    assert model.blob_shapes["y"] == y_shape
    assert tuple(node.attrs["pad"]) == pad and tuple(node.attrs["stride"]) == stride
    cout, _, kh, kw = node.blobs[0].shape
    g = node.attrs["position_group"]
    assert node.blobs[2].shape == node.blobs[3].shape == (g, 1, kh, kw)
    # non-integer positions, some whole (one exactly on the grid, one on a grid row only), one far outside
    xpos = (rng(1).standard_normal((g, 1, kh, kw)) * 1.5).astype(F32)
    ypos = (rng(2).standard_normal((g, 1, kh, kw)) * 1.5).astype(F32)
    if xpos.size > 2:
        xpos.reshape(-1)[0], ypos.reshape(-1)[0] = 1.0, -1.0
        ypos.reshape(-1)[1] = 2.0
        xpos.reshape(-1)[-1], ypos.reshape(-1)[-1] = -x_shape[3] - 3.25, 0.5
    if node.attrs["bias_term"]:
        node.blobs[1] = rng(3).standard_normal(cout).astype(F32)
    node.blobs[2], node.blobs[3] = xpos, ypos
    x = rng(4).standard_normal(x_shape).astype(F32)
    bias = node.blobs[1] if node.attrs["bias_term"] else None
    ref = fork_forward(x, node.blobs[0], bias, xpos, ypos, stride, pad)
    assert ref.shape == y_shape
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=1e-5)


def test_a_tap_outside_reads_zero_and_half_a_pixel_mixes_two():
    """One 1 x 1 tap of weight 1: moved by 0.5 it averages two columns, the one outside the image counting 0;
    moved past the image it reads 0."""
    x = rng(5).standard_normal((2, 1, 3, 4)).astype(F32)
    model = load_from_text(net(layer("num_output: 1 kernel_size: 1 bias_term: false"), inputs={"x": x.shape}),
                           random_weights=True)
    node = node_of(model, "a")
    node.blobs[0] = np.ones((1, 1, 1, 1), F32)
    node.blobs[2], node.blobs[3] = np.full((1, 1, 1, 1), 0.5, F32), np.zeros((1, 1, 1, 1), F32)
    right = np.concatenate([(x[..., :-1] + x[..., 1:]) / 2, x[..., -1:] / 2], axis=3)
    np.testing.assert_allclose(model.run({"x": x})["y"], right, atol=1e-6)
    node.blobs[3] = np.full((1, 1, 1, 1), -3.0, F32)
    assert not model.run({"x": x})["y"].any()


def test_a_tap_on_the_grid_reads_its_pixel_alone(tmp_path):
    """A whole-pixel tap (x 1, y 0) reads q11 alone (the fork's dx == 0 && dy == 0 branch): an inf in q21, which
    a bilinear mix would weight 0 (0 x inf: NaN), stays out; the pixel itself still reads inf."""
    x = rng(12).standard_normal((2, 1, 3, 5)).astype(F32)
    x[:, 0, 1, 3] = np.inf
    model = load_from_text(net(layer("num_output: 1 kernel_size: 1 bias_term: false"), inputs={"x": x.shape}),
                           random_weights=True)
    node = node_of(model, "a")
    node.blobs[0] = np.ones((1, 1, 1, 1), F32)
    node.blobs[2], node.blobs[3] = np.ones((1, 1, 1, 1), F32), np.zeros((1, 1, 1, 1), F32)
    ref = fork_forward(x, node.blobs[0], None, node.blobs[2], node.blobs[3], (1, 1), (0, 0))
    assert np.isfinite(ref[:, 0, 1, 1]).all() and np.isinf(ref[:, 0, 1, 2]).all() and not np.isnan(ref).any()
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_random_weights_place_the_taps_as_the_fork():
    model = load_from_text(net(layer("num_output: 4 kernel_size: 3 pad: 1", "pos_filler_std: -1 position_group: 2",
                                     name="r"),
                               layer("num_output: 2 kernel_size: 3 pad: 1", "pos_filler_std: 0 base_radius: 2",
                                     name="e", top="z"),
                               layer("num_output: 2 kernel_size: 3 pad: 1", "", name="d", top="w"),
                               layer("num_output: 2 kernel_size: 3 pad: 1",
                                     "pos_filler_std: -1 base_radius: 2.5 base_angle: 0.7853982", name="b", top="v"),
                               inputs={"x": (1, 2, 5, 5)}), random_weights=True)
    r, e, d, b = (node_of(model, k) for k in "redb")
    # base_angle pi / 4 turns the circle; radius 2.5 rounds half to even (nearbyint: 2.5 -> 2)
    assert np.array_equal(b.blobs[2].reshape(9), [0, 2, 0, -2, -2, -2, 0, 2, 2])
    assert np.array_equal(b.blobs[3].reshape(9), [0, 2, 2, 2, 0, -2, -2, -2, 0])
    # pos_filler_std < 0: the circle rounded (nearbyint), tap 0 at the origin, for each group
    assert np.array_equal(r.blobs[2].reshape(2, 9), np.tile([0, 1, 1, 0, -1, -1, -1, 0, 1], (2, 1)))
    assert np.array_equal(r.blobs[3].reshape(2, 9), np.tile([0, 0, 1, 1, 1, 0, -1, -1, -1], (2, 1)))
    assert r.blobs[1].shape == (4,) and not r.blobs[1].any()
    # pos_filler_std 0: the circle of radius base_radius, unrounded
    angles = np.arange(8) * 2 * np.pi / 8
    np.testing.assert_allclose(e.blobs[2].reshape(9), np.r_[0, 2 * np.cos(angles)], atol=1e-6)
    np.testing.assert_allclose(e.blobs[3].reshape(9), np.r_[0, 2 * np.sin(angles)], atol=1e-6)
    # the default 0.05: the circle plus N(0, 0.05) noise, tap 0 still at the origin
    dxy = np.stack([d.blobs[2].reshape(9) - np.r_[0, np.cos(angles)], d.blobs[3].reshape(9) - np.r_[0, np.sin(angles)]])
    assert dxy[:, 0].tolist() == [0, 0] and 0 < np.abs(dxy[:, 1:]).max() < 0.5


def test_whole_positions_are_a_convolution_with_the_taps_moved(tmp_path):
    """With the rounded circle (pos_filler_std -1), 3 x 3 with pad 1 is a Convolution whose tap at (x, y)
    carries the AConv weight of that position."""
    x = rng(6).standard_normal((2, 3, 6, 5)).astype(F32)
    text = net(layer("num_output: 4 kernel_size: 3 pad: 1 stride: 2", "pos_filler_std: -1"),
               'layer { name: "c" type: "Convolution" bottom: "x" top: "z" '
               'convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 } }', inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    a, c = node_of(model, "a"), node_of(model, "c")
    a.blobs[1] = rng(7).standard_normal(4).astype(F32)
    w = np.zeros_like(c.blobs[0])
    for f, (px, py) in enumerate(zip(a.blobs[2].reshape(-1), a.blobs[3].reshape(-1))):
        w[:, :, int(py) + 1, int(px) + 1] = a.blobs[0].reshape(4, 3, 9)[:, :, f]
    c.blobs = [w, a.blobs[1].copy()]
    out = model.run({"x": x})
    assert out["y"].shape == out["z"].shape == (2, 4, 3, 3)
    np.testing.assert_allclose(out["y"], out["z"], atol=1e-5, rtol=1e-5)
    check_everywhere(model, {"x": x}, {"y": out["z"]}, tmp_path, atol=1e-5, rtol=1e-5)


def test_weights_and_positions_attach_from_a_caffemodel(tmp_path):
    """The ACU's layers: bias_term false stores a (1, 1, 1, 1) zero blob at index 1, then the positions."""
    text = net(layer("num_output: 2 kernel_size: 3 pad: 1 bias_term: false", "position_group: 1"),
               inputs={"x": (1, 2, 4, 5)})
    w = rng(8).standard_normal((2, 2, 3, 3)).astype(F32)
    xp = rng(9).uniform(-2, 2, (1, 1, 3, 3)).astype(F32)
    yp = rng(10).uniform(-2, 2, (1, 1, 3, 3)).astype(F32)
    (tmp_path / "a.prototxt").write_text(text)
    blobs = [BlobData(w), BlobData(np.zeros((1, 1, 1, 1), F32)), BlobData(xp), BlobData(yp)]
    write_caffemodel(parse_prototxt_text(text), {"a": blobs}, tmp_path / "a.caffemodel")
    model = caffeq.load(tmp_path / "a.prototxt", tmp_path / "a.caffemodel")
    node = node_of(model, "a")
    assert np.array_equal(node.blobs[0], w) and np.array_equal(node.blobs[2], xp) and np.array_equal(node.blobs[3], yp)
    x = rng(11).standard_normal((1, 2, 4, 5)).astype(F32)
    ref = fork_forward(x, w, None, xp, yp, (1, 1), (0, 0))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("conv, aconv, msg", [
    ("num_output: 4 kernel_size: 3 group: 2", "", "convolution_param.group must be 1"),
    ("num_output: 4 kernel_size: 3 dilation: 1", "", "convolution_param.dilation must not be given"),
    ("num_output: 4 kernel_size: 3", "position_group: 3", "num_output 4 not divisible by aconv_param.position_group 3"),
    ("num_output: 4 kernel_size: 3", "position_group: 0", "aconv_param.position_group must be >= 1"),
    ("num_output: 4 kernel_size: 3", "pad: 1", "aconv_param.pad/pad_h/pad_w are refused with aconv_param.type SQUARE"),
    ("num_output: 4 kernel_h: 3 kernel_w: 1", "", "kernel_h/kernel_w are refused with aconv_param.type SQUARE"),
    ("num_output: 4 kernel_size: 3 pad: 1", "type: CIRCLE", "convolution_param.pad/pad_h/pad_w are refused"),
    ("num_output: 4 kernel_size: 3", "base_radius: 0", "aconv_param.base_radius must be > 0"),
    ("num_output: 4 kernel_size: 3", "type: CIRCLE pad: -3", "output would be empty"),
    ("kernel_size: 3", "", "convolution_param.num_output is required"),
])
def test_bad_parameters_are_one_line_errors(conv, aconv, msg):
    with pytest.raises(LayerError, match=msg) as err:
        load_from_text(net(layer(conv, aconv), inputs={"x": (1, 2, 5, 5)}), random_weights=True)
    assert "\n" not in str(err.value)
