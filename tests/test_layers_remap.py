"""tinghuiz/appearance-flow's Remap (b20a0dd remap_layer.cpp Forward_cpu): the reference is that loop in
numpy float32, on a 4 x 6 image read at a 3 x 5 map of coordinates, some outside the image."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def remap_ref(image, coords):
    n, c, h0, w0 = image.shape
    _, _, h1, w1 = coords.shape
    out = np.zeros((n, c, h1, w1), F)

    def value(i, ch, x, y):
        return F(0) if x < 0 or x > w0 - 1 or y < 0 or y > h0 - 1 else image[i, ch, y, x]

    for i in range(n):
        for ch in range(c):
            for h in range(h1):
                for w in range(w1):
                    x, y = coords[i, 0, h, w], coords[i, 1, h, w]
                    x0, y0 = math.floor(x), math.floor(y)
                    wx, wy = F(x - F(x0)), F(y - F(y0))
                    out[i, ch, h, w] = ((F(1) - wx) * (F(1) - wy) * value(i, ch, x0, y0)
                                        + (F(1) - wx) * wy * value(i, ch, x0, y0 + 1)
                                        + wx * (F(1) - wy) * value(i, ch, x0 + 1, y0)
                                        + wx * wy * value(i, ch, x0 + 1, y0 + 1))
    return out


def remap_net(image_shape, coords_shape):
    return net('layer { name: "r" type: "Remap" bottom: "img" bottom: "xy" top: "o" }',
               inputs={"img": image_shape, "xy": coords_shape})


def test_samples_the_image_at_absolute_coordinates(tmp_path):
    image = rng(1).standard_normal((2, 3, 4, 6)).astype(F)
    coords = np.stack([rng(2).uniform(-1.5, 6.5, (2, 3, 5)), rng(3).uniform(-1.5, 4.5, (2, 3, 5))], 1).astype(F)
    coords[0, :, 0, 0] = [2, 1]        # a pixel centre: one neighbour
    model = load_from_text(remap_net(image.shape, coords.shape))
    assert model.blob_shapes["o"] == (2, 3, 3, 5)
    check_everywhere(model, {"img": image, "xy": coords}, {"o": remap_ref(image, coords)}, tmp_path,
                     atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("coords, msg", [((2, 3, 3, 5), r"must be \(N, 2, H, W\)"), ((1, 2, 3, 5), r"image's N = 2")])
def test_refuses_what_the_fork_checks(coords, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(remap_net((2, 3, 4, 6), coords))


def test_transformation_subtracts_the_mean_and_scales(tmp_path):
    # appearance-flow's Transformation without mirror or crop: its affine map is the identity, each read
    # lands on its pixel, so top = scale * (bottom - mean[c]) for each bottom (one mean value: every channel)
    text = net('layer { name: "t" type: "Transformation" bottom: "a" bottom: "b" top: "ta" top: "tb" '
               'transform_param { mean_value: 116.06 mean_value: 113.74 mean_value: 105.49 scale: 0.5 } }',
               'layer { name: "u" type: "Transformation" bottom: "c" top: "tc" transform_param { mean_value: 7.5 } }',
               inputs={"a": (2, 3, 4, 5), "b": (2, 3, 4, 5), "c": (1, 4, 2, 3)})
    a, b = ((255 * rng(k).uniform(size=(2, 3, 4, 5))).astype(F) for k in (1, 2))
    c = (255 * rng(3).uniform(size=(1, 4, 2, 3))).astype(F)
    mean = np.array([116.06, 113.74, 105.49], F).reshape(3, 1, 1)
    want = {"ta": ((a - mean) * F(0.5)).astype(F), "tb": ((b - mean) * F(0.5)).astype(F), "tc": (c - F(7.5)).astype(F)}
    check_everywhere(load_from_text(text), {"a": a, "b": b, "c": c}, want, tmp_path)


@pytest.mark.parametrize("param, msg", [("mirror: true", "mirror makes it flip"), ("crop_size: 3", "random position"),
                                        ("rotate: true", "rotate makes it"), ("min_scale: 0.8", "min_scale makes it"),
                                        ("max_scale: 1.2", "max_scale makes it"),
                                        ("mean_file: 'm.binaryproto'", "does not support transform_param.mean_file"),
                                        ("mean_value: 1 mean_value: 2", "2 mean values for 3 channels")])
def test_transformation_refuses_its_random_and_unsupported_settings(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "t" type: "Transformation" bottom: "a" top: "t" transform_param {{ {param} }} }}',
                           inputs={"a": (1, 3, 4, 5)}))
