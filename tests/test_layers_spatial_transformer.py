"""daerduoCarey/SpatialTransformerLayer's SpatialTransformer (cf2a461; 4791d99 st_layer.cpp LayerSetUp and
Reshape, st_layer.cu SpatialTransformerForwardGPU), as rremani/py-faster-rcnn-st and alenaliu/PPR-FCN
vendor it.

The reference is a numpy loop written here from the fork's kernel, in float32 as the fork computes;
each case runs in torch, onnxruntime (opsets 13 and the default) and the generated model.py.
"""
import math

import numpy as np
import pytest
import torch
from conftest import assert_close, check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.layers.spatial_transformer import spatial_transformer
from caffeq.model import load_from_text

F = np.float32


def st_ref(u, full_theta, out_h, out_w):
    """The fork's forward: target (s / out_h * 2 - 1, t / out_w * 2 - 1), source row x = (px + 1) / 2 * H
    and column y = (py + 1) / 2 * W, four taps from (floor x, floor y) in the kernel's order, those
    outside the image skipped."""
    n, c, h, w = u.shape
    v = np.zeros((n, c, out_h, out_w), F)
    for i in range(n):
        th = full_theta[i].astype(F)
        for s in range(out_h):
            gs = F(s * 1.0 / out_h * 2 - 1)
            for t in range(out_w):
                gt = F(t * 1.0 / out_w * 2 - 1)
                px = th[0] * gs + th[1] * gt + th[2]
                py = th[3] * gs + th[4] * gt + th[5]
                x = (px + F(1)) / F(2) * F(h)
                y = (py + F(1)) / F(2) * F(w)
                m0, n0 = math.floor(x), math.floor(y)
                for m, k, wm, wk in ((m0, n0, F(1) - (x - F(m0)), F(1) - (y - F(n0))),
                                     (m0 + 1, n0, F(1) - (F(m0 + 1) - x), F(1) - (y - F(n0))),
                                     (m0, n0 + 1, F(1) - (x - F(m0)), F(1) - (F(n0 + 1) - y)),
                                     (m0 + 1, n0 + 1, F(1) - (F(m0 + 1) - x), F(1) - (F(n0 + 1) - y))):
                    if 0 <= m < h and 0 <= k < w:
                        v[i, :, s, t] += (wm * wk) * u[i, :, m, k]
    return v


def st_net(theta_shape, image_shape=(2, 3, 5, 7), param=""):
    st = f" st_param {{ {param} }}" if param else ""
    return net(f'layer {{ name: "st" type: "SpatialTransformer" bottom: "u" bottom: "theta" top: "v"{st} }}',
               inputs={"u": image_shape, "theta": theta_shape})


THETAS = {
    # zoomed out and shifted: samples left, right and below the image get the zero padding
    "outside": [[1.7, 0.25, 0.45, -0.3, 1.4, -0.6], [0.8, -0.6, -0.9, 0.5, 0.7, 1.1]],
    # a rotation and a shear, some taps exactly on the last row and column
    "rotate": [[0.6, -0.8, 0.1, 0.8, 0.6, -0.2], [1.0, 0.0, 0.0, 0.3, 1.0, 0.0]],
}


@pytest.mark.parametrize("which", sorted(THETAS))
@pytest.mark.parametrize("param, out", [("", (5, 7)),                              # the image's size
                                        ("output_H: 4 output_W: 9", (4, 9)),
                                        ("output_W: 3 to_compute_dU: false", (5, 3))])
def test_matches_the_forks_kernel(which, param, out, tmp_path):
    u = rng(1).standard_normal((2, 3, 5, 7)).astype(F)
    theta = np.array(THETAS[which], F)
    model = load_from_text(st_net((2, 6), param=param))
    assert model.blob_shapes["v"] == (2, 3) + out
    ref = st_ref(u, theta, *out)
    assert np.count_nonzero(ref) < ref.size or which == "rotate"     # "outside" reaches past the image
    check_everywhere(model, {"u": u, "theta": theta}, {"v": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_identity_copies_the_image(tmp_path):
    """The target grid starts at -1 and steps 2 / size, so the identity reads each pixel (up to float32
    rounding of s / size * 2 - 1, which the fork has too), not points between them."""
    u = rng(2).standard_normal((2, 3, 6, 4)).astype(F)
    theta = np.tile(np.array([1, 0, 0, 0, 1, 0], F), (2, 1))
    model = load_from_text(st_net((2, 6), (2, 3, 6, 4)))
    np.testing.assert_allclose(model.run({"u": u, "theta": theta})["v"], u, atol=1e-6)
    # a half-size output of the identity reads every second row and column
    model = load_from_text(st_net((2, 6), (2, 3, 6, 4), "output_H: 3 output_W: 2"))
    check_everywhere(model, {"u": u, "theta": theta}, {"v": u[:, :, ::2, ::2]}, tmp_path, atol=1e-6)


@pytest.mark.parametrize("param, theta_shape, full", [
    # theta_1_2 and theta_2_1 fixed: the four values per item fill t11, t13, t22, t23 in order
    ("theta_1_2: 0 theta_2_1: 0", (2, 4), lambda g: np.stack([g[:, 0], 0 * g[:, 0], g[:, 1], 0 * g[:, 0],
                                                              g[:, 2], g[:, 3]], 1)),
    # the commented-out form of py-faster-rcnn-st: a fixed half-size zoom, the shift learnt
    ("theta_1_1: 0.5 theta_1_2: 0.0 theta_2_1: 0.0 theta_2_2: 0.5", (2, 2, 1, 1),
     lambda g: np.stack([0.5 + 0 * g[:, 0], 0 * g[:, 0], g[:, 0], 0 * g[:, 0], 0.5 + 0 * g[:, 0], g[:, 1]], 1)),
    # a fixed shift of 0.1 (float32 in the fork), theta any shape of 5 values per item
    ("theta_2_3: 0.1", (2, 5), lambda g: np.concatenate([g, np.full((2, 1), F(0.1))], 1)),
])
def test_fixed_entries_leave_fewer_values_in_theta(param, theta_shape, full, tmp_path):
    u = rng(3).standard_normal((2, 3, 5, 7)).astype(F)
    theta = rng(4).uniform(-0.9, 0.9, size=theta_shape).astype(F)
    model = load_from_text(st_net(theta_shape, param=param + " output_H: 6 output_W: 4"))
    ref = st_ref(u, full(theta.reshape(2, -1)).astype(F), 6, 4)
    check_everywhere(model, {"u": u, "theta": theta}, {"v": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_to_compute_du_false_stops_the_backward_at_theta():
    u = torch.randn(2, 3, 5, 7, requires_grad=True)
    theta = torch.tensor(THETAS["rotate"], requires_grad=True)
    spatial_transformer(u, theta, 4, 6, (None,) * 6, False).sum().backward()
    assert u.grad is None and theta.grad.abs().sum() > 0
    spatial_transformer(u, theta, 4, 6, (None,) * 6, True).sum().backward()
    assert u.grad.abs().sum() > 0


@pytest.mark.parametrize("layer, shapes, msg", [
    ('st_param { transform_type: "perspective" }', None,
     r'transform_type "perspective" is neither daerduoCarey\'s "affine" nor one of the e2e_face fork\'s'),
    ('st_param { sampler_type: "nearest" }', None, 'sampler_type "bilinear" only, as the fork, got "nearest"'),
    ("st_param { output_H: 0 }", None, r"st_param.output_H must be >= 1, got 0"),
    ("st_param { theta_1_2: 0 theta_2_1: 0 }", None,
     r"theta \(bottom 1, \[2, 6\]\) gives 6 values per item and st_param fixes 2 entries: together they must "
     r"make the 6"),
    ("", {"u": (2, 3, 5, 7), "theta": (3, 6)}, r"must have the image's 2 items on axis 0"),
    ("", {"u": (2, 4096), "theta": (2, 6)}, r"needs a 4-axis image \(bottom 0\) \(N, C, H, W\), got \[2, 4096\]"),
])
def test_refuses_what_the_fork_refuses(layer, shapes, msg):
    shapes = shapes or {"u": (2, 3, 5, 7), "theta": (2, 6)}
    text = net(f'layer {{ name: "st" type: "SpatialTransformer" bottom: "u" bottom: "theta" top: "v" {layer} }}',
               inputs=shapes)
    with pytest.raises(LayerError, match=msg) as err:
        load_from_text(text)
    assert "\n" not in str(err.value)


def test_needs_an_image_and_a_theta():
    with pytest.raises(LayerError, match=r"SpatialTransformer takes 2 bottoms \(image, theta\) and one top"):
        load_from_text(net('layer { name: "st" type: "SpatialTransformer" bottom: "u" top: "v" }',
                           inputs={"u": (2, 3, 5, 7)}))


# ---- PowerFile: top = bottom + the shift `ifstream >> float` reads from shift_file (working directory) ---

def _power_file_net(shift_file):
    return net(f'layer {{ name: "pf" type: "PowerFile" bottom: "theta" top: "out" '
               f'power_file_param {{ shift_file: "{shift_file}" }} }}', inputs={"theta": (3, 2, 3)})


def test_power_file_adds_the_shift_files_numbers_per_item(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the fork's init files hold the identity crop; `>>` stops at the first token that is not a number,
    # after the number a token starts with, and missing values stay 0
    (tmp_path / "init.txt").write_text("0.5 0 -1e-1\n0 .25 2.5x 7 8\n")
    model = load_from_text(_power_file_net("init.txt"))
    x = rng(50).standard_normal((3, 2, 3)).astype(np.float32)
    shift = np.array([[0.5, 0, -1e-1], [0, 0.25, 2.5]], np.float32)
    check_everywhere(model, {"theta": x}, {"out": x + shift}, tmp_path)
    (tmp_path / "short.txt").write_text("1 2\nnan 4")
    short = np.array([[1, 2, 0], [0, 0, 0]], np.float32)
    assert_close(load_from_text(_power_file_net("short.txt")).run({"theta": x})["out"], x + short, 0, 0, "short")


def test_power_file_without_its_file_adds_zeros_as_the_fork_with_a_note(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = load_from_text(_power_file_net("models/missing.txt"))
    assert any("'models/missing.txt' cannot be opened" in w and "all zeros" in w for w in model.warnings)
    x = rng(51).standard_normal((3, 2, 3)).astype(np.float32)
    assert_close(model.run({"theta": x})["out"], x, 0, 0, "zeros")
