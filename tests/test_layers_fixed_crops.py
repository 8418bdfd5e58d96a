"""Forks' fixed-size crops, compared in torch, onnxruntime and model.py: dosovits/caffe-fr-chairs's CropSimple
(the DoCrop kernel's index arithmetic written as a loop, x + (W - w) / 2, y + (H - h) / 2 in integers) and
SSAW14/STD2P's PCrop (manual_crop_layer.cpp's row copies: bottom.offset(n, c, x + i, y))."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def crop_ref(x, h, w):
    n, c, height, width = x.shape
    out = np.empty((n, c, h, w), x.dtype)
    for y in range(h):
        for z in range(w):
            out[:, :, y, z] = x[:, :, y + (height - h) // 2, z + (width - w) // 2]
    return out


@pytest.mark.parametrize("shape, h, w", [((2, 3, 9, 8), 5, 4), ((1, 2, 7, 7), 7, 2), ((1, 1, 6, 5), 1, 5)])
def test_crop_simple(shape, h, w, tmp_path):
    model = load_from_text(net(f'layer {{ name: "c" type: "CropSimple" bottom: "x" top: "y" '
                               f'crop_param {{ crop_height: {h} crop_width: {w} }} }}', inputs={"x": shape}))
    x = rng(81).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"y": crop_ref(x, h, w)}, tmp_path)


@pytest.mark.parametrize("params, message", [("crop_height: 3", "needs crop_param.crop_width"),
                                             ("crop_height: 3 crop_width: 9", "must be 1 to the bottom's")])
def test_bad_sizes(params, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(f'layer {{ name: "c" type: "CropSimple" bottom: "x" top: "y" crop_param {{ {params} }} }}',
                           inputs={"x": (1, 1, 4, 4)}))


def pcrop_ref(x, row, col, h, w):
    """Forward_cpu's loop: for each (n, c, i) copy w values from bottom.offset(n, c, row + i, col)."""
    n, c = x.shape[:2]
    out = np.empty((n, c, h, w), x.dtype)
    for a in range(n):
        for b in range(c):
            for i in range(h):
                out[a, b, i] = x[a, b, row + i, col:col + w]
    return out


def pcrop(x, y, h, w, bottoms=('"x"', '"x"')):
    return (f'layer {{ name: "c" type: "PCrop" {" ".join("bottom: " + b for b in bottoms)} top: "y" '
            f'pcrop_param {{ engine: CAFFE x: {x} y: {y} h: {h} w: {w} }} }}')


# STD2P's nets: score-pool4 39 x 48 -> (5, 5, 30, 38); x is the row offset, y the column offset
@pytest.mark.parametrize("shape, row, col, h, w", [((1, 3, 39, 48), 5, 5, 30, 38), ((2, 2, 9, 11), 1, 4, 6, 3),
                                                   ((1, 1, 5, 7), 0, 0, 5, 7)])
def test_pcrop_is_the_window_at_row_x_column_y(shape, row, col, h, w, tmp_path):
    model = load_from_text(net(pcrop(row, col, h, w), inputs={"x": shape}))
    x = rng(82).standard_normal(shape).astype(np.float32)
    assert model.blob_shapes["y"] == (shape[0], shape[1], h, w)
    check_everywhere(model, {"x": x}, {"y": pcrop_ref(x, row, col, h, w)}, tmp_path)


def test_pcrop_never_reads_its_second_bottom(tmp_path):
    model = load_from_text(net(pcrop(1, 2, 3, 4, ('"x"', '"z"')), inputs={"x": (1, 2, 6, 7), "z": (3, 1, 1, 1)}))
    x = rng(83).standard_normal((1, 2, 6, 7)).astype(np.float32)
    check_everywhere(model, {"x": x, "z": np.full((3, 1, 1, 1), np.nan, np.float32)},
                     {"y": pcrop_ref(x, 1, 2, 3, 4)}, tmp_path)


@pytest.mark.parametrize("params, bottoms, message", [
    ((2, 0, 5, 3), ('"x"', '"x"'), "window at row x 2, column y 0 does not fit the bottom's 6 x 6"),
    ((0, 0, 0, 3), ('"x"', '"x"'), "h and w .* must be >= 1"),
    ((0, 0, 2, 2), ('"x"',), "PCrop")])
def test_pcrop_refusals(params, bottoms, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(pcrop(*params, bottoms), inputs={"x": (1, 1, 6, 6)}))
