"""The SpatialTransformer transform types of mikuhatsune/e2e_face's fork (11d506e,
caffe_modification/spatial_transformer_layer.cu: forward_translation, forward_translation_scaling,
forward_projective, forward_grid, forward_similarity, forward_similarity_plus; caffe.proto's st_param
with float theta_1_1 / theta_2_2 defaulting to 1).

The reference is a numpy loop written here from those kernels, in float32, on a 5x7 image read into
a 4x6 output; each case runs in torch, onnxruntime and the generated model.py.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def source(kind, t, h, w, xt, yt, scales):
    """The kernel's read position (column, row) in pixels for target (xt, yt) and one item's theta."""
    if kind == "projective":
        z = F(1) / (xt * t[6] + yt * t[7] + F(1))
        x = xt * t[0] + yt * t[1] + t[2]
        y = xt * t[3] + yt * t[4] + t[5]
        return (x * z + F(1)) * F(w - 1) / F(2), (y * z + F(1)) * F(h - 1) / F(2)
    if kind == "translation":
        x, y = F(scales[0]) * xt + t[0], F(scales[1]) * yt + t[1]
    elif kind == "translation_scaling":
        x, y = xt * t[0] + t[1], yt * t[2] + t[3]
    elif kind == "similarity":
        c, s = F(math.cos(t[0])), F(math.sin(t[0]))
        x = t[1] * (xt * c - yt * s) + t[2]
        y = t[1] * (xt * s + yt * c) + t[3]
    else:
        c, s = F(math.cos(t[0])), F(math.sin(t[0]))
        x = t[1] * xt * c - t[2] * yt * s + t[3]
        y = t[1] * xt * s + t[2] * yt * c + t[4]
    return (x + F(1)) / F(2) * F(w - 1), (y + F(1)) / F(2) * F(h - 1)


def e2e_ref(u, theta, kind, out_h, out_w, scales=(1.0, 1.0)):
    n, c, h, w = u.shape
    v = np.zeros((n, c, out_h, out_w), F)
    clamp = kind in ("translation", "translation_scaling", "projective")
    for i in range(n):
        t = theta[i].reshape(-1).astype(F)
        for oh in range(out_h):
            for ow in range(out_w):
                if kind == "grid":
                    x, y = t[(oh * out_w + ow) * 2], t[(oh * out_w + ow) * 2 + 1]
                else:
                    xt, yt = F(ow) / F(out_w - 1) * F(2) - F(1), F(oh) / F(out_h - 1) * F(2) - F(1)
                    x, y = source(kind, t, h, w, xt, yt, scales)
                if clamp:
                    x, y = min(max(x, F(0)), F(w - 1)), min(max(y, F(0)), F(h - 1))
                for hh in range(max(math.floor(y), 0), min(math.ceil(y), h - 1) + 1):
                    dy = F(1) - F(abs(y - hh))
                    for ww in range(max(math.floor(x), 0), min(math.ceil(x), w - 1) + 1):
                        v[i, :, oh, ow] += u[i, :, hh, ww] * (F(1) - F(abs(x - ww))) * dy
    return v


THETAS = {
    # item 0 reaches past every edge (clamped, or zero taps), item 1 stays inside
    "translation": [[0.9, -1.3], [0.1, 0.2]],
    "translation_scaling": [[1.6, 0.3, 1.2, -0.4], [0.5, -0.1, 0.75, 0.2]],
    "projective": [[1.1, 0.2, 0.3, -0.1, 0.9, -0.2, 0.15, -0.25], [0.8, -0.3, 0.0, 0.25, 1.2, 0.1, -0.1, 0.05]],
    "similarity": [[0.5, 1.4, 0.2, -0.3], [-0.3, 0.7, 0.0, 0.1]],
    "similarity+": [[0.4, 1.3, 0.8, -0.2, 0.3], [-0.7, 0.6, 1.1, 0.1, -0.2]],
}


def e2e_net(kind, theta_shape, param=""):
    return net(f'layer {{ name: "st" type: "SpatialTransformer" bottom: "u" bottom: "theta" top: "v"\n'
               f'  st_param {{ output_H: 4 output_W: 6 transform_type: "{kind}" {param} }} }}',
               inputs={"u": (2, 3, 5, 7), "theta": theta_shape})


@pytest.mark.parametrize("kind", list(THETAS))
def test_each_type_against_the_kernel(kind, tmp_path):
    u = rng(5).standard_normal((2, 3, 5, 7)).astype(F)
    theta = np.array(THETAS[kind], F)
    model = load_from_text(e2e_net(kind, theta.shape))
    assert any("e2e_face fork" in w for w in model.warnings)
    ref = e2e_ref(u, theta, kind, 4, 6)
    check_everywhere(model, {"u": u, "theta": theta}, {"v": ref}, tmp_path, atol=2e-6, rtol=1e-5)


def test_translation_reads_its_fixed_scales(tmp_path):
    u = rng(6).standard_normal((2, 3, 5, 7)).astype(F)
    theta = np.array(THETAS["translation"], F)
    model = load_from_text(e2e_net("translation", theta.shape, "theta_1_1: 0.5 theta_2_2: -0.75"))
    ref = e2e_ref(u, theta, "translation", 4, 6, (0.5, -0.75))
    assert not np.allclose(ref, e2e_ref(u, theta, "translation", 4, 6))
    check_everywhere(model, {"u": u, "theta": theta}, {"v": ref}, tmp_path, atol=2e-6, rtol=1e-5)


def test_the_grid_reads_pixel_positions_with_zero_taps_outside(tmp_path):
    u = rng(7).standard_normal((2, 3, 5, 7)).astype(F)
    grid = rng(8).uniform(-1.5, 7.5, (2, 4 * 6 * 2)).astype(F)
    grid[0, :6] = [0, 0, 6, 4, 2.5, 3]          # exact pixels (one tap) and a half-way column
    model = load_from_text(e2e_net("grid", grid.shape))
    check_everywhere(model, {"u": u, "theta": grid}, {"v": e2e_ref(u, grid, "grid", 4, 6)}, tmp_path,
                     atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind, theta, extra, msg", [
    ("projective", (2, 6), "", r'"projective": theta \(bottom 1, \[2, 6\]\) must be \(2, 8\)'),
    ("grid", (2, 40), "", r'"grid": theta \(bottom 1, \[2, 40\]\) must be \(2, 48\)'),
    ("similarity", (3, 4), "", r"must be \(2, 4\)"),
    ("similarity", (2, 4), "output_W: 1", r"output 4x1; the fork divides by output_H - 1 and output_W - 1"),
])
def test_refuses_what_the_fork_cannot_run(kind, theta, extra, msg):
    text = e2e_net(kind, theta).replace("output_W: 6", extra or "output_W: 6")
    with pytest.raises(LayerError, match=msg):
        load_from_text(text)
