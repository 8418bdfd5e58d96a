"""Tiny-DSOD's Upsample (upsample_layer.cpp at kanatmg/Tiny-DSOD-plate 0b61451): bottom 1 resized to
bottom 0's height and width with the fork's weights, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def dsod_ref(small, out_h, out_w):
    """Forward_cpu, float32 step by step: b = (i + 1) / ratio - 1.0, (int) casts, the weights' ternaries."""
    n, c, h, w = small.shape
    w_ratio, h_ratio = f32(out_w) / f32(w), f32(out_h) / f32(h)

    def axis(i, ratio, size):
        b = f32(f32(f32(i + 1) / ratio) - f32(1.0))
        t = int(b)                                   # towards zero, as C
        low, high = max(t, 0), min(t + 1, size - 1)
        wl = f32(0.0) if t < 0 else f32(f32(1) - f32(b - f32(t)))
        wh = f32(0.0) if t + 1 > size - 1 else f32(f32(1) - wl)
        return low, high, wl, wh

    top = np.empty((n, c, out_h, out_w), f32)
    for y in range(out_h):
        yl, yh, wyl, wyh = axis(y, h_ratio, h)
        for x in range(out_w):
            xl, xh, wxl, wxh = axis(x, w_ratio, w)
            v = small[:, :, :, :]
            temp = np.zeros((n, c), f32)
            temp = temp + f32(wxl * wyl) * v[:, :, yl, xl]
            temp = temp + f32(wxh * wyl) * v[:, :, yl, xh]
            temp = temp + f32(wxl * wyh) * v[:, :, yh, xl]
            temp = temp + f32(wxh * wyh) * v[:, :, yh, xh]
            top[:, :, y, x] = temp
    return top


@pytest.mark.parametrize("big, small", [((2, 3, 3, 3), (2, 3, 2, 2)), ((1, 2, 10, 19), (1, 4, 5, 7))],
                         ids=["dsod_3_from_2", "odd_ratios"])
def test_tiny_dsod_upsample_resizes_the_second_bottom_to_the_first(big, small, tmp_path):
    g = np.random.default_rng(14)
    a, b = g.standard_normal(big).astype(f32), g.standard_normal(small).astype(f32)
    model = load_from_text(net('layer { name: "u" type: "Upsample" bottom: "a" bottom: "b" top: "u" '
                               'propagate_down: false propagate_down: true }', inputs={"a": big, "b": small}))
    ref = dsod_ref(b[:, :big[1]], big[2], big[3])
    assert model.blob_shapes["u"] == big
    assert any("Tiny-DSOD's Upsample" in w for w in model.warnings)
    check_everywhere(model, {"a": a, "b": b}, {"u": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_an_upsample_param_or_a_larger_second_bottom_keeps_segnets_reading():
    # bottoms of one shape are SegNet's data and mask (its default scale 2), whatever propagate_down says
    same = load_from_text(net('layer { name: "u" type: "Upsample" bottom: "a" bottom: "b" top: "u" }',
                              inputs={"a": (1, 2, 5, 5), "b": (1, 2, 5, 5)}))
    assert same.blob_shapes["u"] == (1, 2, 10, 10)
    with pytest.raises(LayerError, match="must be shaped like the data"):
        load_from_text(net('layer { name: "u" type: "Upsample" bottom: "a" bottom: "b" top: "u" '
                           'upsample_param { scale: 2 } }', inputs={"a": (1, 2, 4, 4), "b": (1, 2, 2, 2)}))
    with pytest.raises(LayerError, match="must be shaped like the data"):
        load_from_text(net('layer { name: "u" type: "Upsample" bottom: "a" bottom: "b" top: "u" }',
                           inputs={"a": (1, 2, 2, 2), "b": (1, 2, 4, 4)}))
