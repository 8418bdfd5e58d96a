"""SubCNN's FeatureExtrapolating and HeatmapGenerating (yuxng/caffe-fast-rcnn fast-rcnn 5393518,
feature_extrapolating_layer.cpp and heatmap_generating_layer.cpp).  The references are their loops:
the scale table in double, each sample's four neighbours weighted in double and added to a float32
sum in the fork's order."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def extrapolate_ref(x, scale_text, bases, per_octave):
    base_scales = [float(v) for v in scale_text.split()][:bases]
    count = (bases - 1) * per_octave + 1
    n, c, h, w = x.shape
    images = n // bases
    out = np.zeros((images * count, c, h, w), F)
    for i in range(count):
        b, j = base_scales[i // per_octave], i % per_octave
        scale = b if j == 0 else b + j * ((base_scales[i // per_octave + 1] - b) / per_octave)
        mapped = int(math.floor(float(F(i) / F(per_octave)) + 0.5))
        factor = scale / base_scales[mapped]
        for image in range(images):
            src = x[image * bases + mapped]
            dst = out[image * count + i]
            if j == 0:
                dst[:] = src
                continue
            for yy in range(h):
                for xx in range(w):
                    xp, yp = xx / factor, yy / factor
                    if not (0 <= xp < w and 0 <= yp < h):
                        continue
                    xi, yi = math.floor(xp), math.floor(yp)
                    ux, uy = xp - xi, yp - yi
                    cx, cy = (ux, 1 - ux), (uy, 1 - uy)
                    val = np.zeros(c, F)
                    for dx in (0, 1):
                        for dy in (0, 1):
                            if 0 <= xi + dx < w and 0 <= yi + dy < h:
                                term = cx[1 - dx] * cy[1 - dy] * src[:, yi + dy, xi + dx].astype(np.float64)
                                val = (val.astype(np.float64) + term).astype(F)
                    dst[:, yy, xx] = val
    return out


@pytest.mark.parametrize("scales, bases, per_octave, n", [("0.25 0.5 1.0 2.0", 4, 5, 8),   # SubCNN's nets
                                                          ("0.6 1.3 1.7", 3, 3, 7)])        # a remainder map
def test_feature_extrapolating(scales, bases, per_octave, n, tmp_path):
    x = rng(1).standard_normal((n, 3, 5, 7)).astype(F)
    model = load_from_text(net(f'layer {{ name: "f" type: "FeatureExtrapolating" bottom: "x" top: "o" '
                               f'feature_extrapolating_param {{ scale_string: "{scales}" num_scale_base: {bases} '
                               f'num_per_octave: {per_octave} }} }}', inputs={"x": x.shape}))
    want = extrapolate_ref(x, scales, bases, per_octave)
    assert model.blob_shapes["o"] == want.shape
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)


@pytest.mark.parametrize("param, msg", [('scale_string: "1 2" num_scale_base: 3', "holds 2 numbers"),
                                        ('num_per_octave: 0', "must be > 0"),
                                        ('scale_string: "0 1" num_scale_base: 2', "must be > 0")])
def test_feature_extrapolating_refusals(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "f" type: "FeatureExtrapolating" bottom: "x" top: "o" '
                           f'feature_extrapolating_param {{ {param} }} }}', inputs={"x": (4, 1, 3, 3)}))


@pytest.mark.parametrize("channels", [4, 1])
def test_heatmap_generating(channels, tmp_path):
    x = (rng(2).standard_normal((2, channels, 3, 5)) * 2).astype(F)
    if channels > 1:
        x[0, 1:, 0, 0] = -3.0          # all below -1: -1
        x[1, 2, 1, 1] = np.nan         # skipped
    want = np.full((2, 1, 3, 5), -1.0, F)
    for i in range(2):
        for yy in range(3):
            for xx in range(5):
                for c in range(1, channels):
                    if x[i, c, yy, xx] > want[i, 0, yy, xx]:
                        want[i, 0, yy, xx] = x[i, c, yy, xx]
    model = load_from_text(net('layer { name: "h" type: "HeatmapGenerating" bottom: "x" top: "o" }',
                               inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)
