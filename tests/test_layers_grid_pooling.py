"""JiajianZeng/caffe-face-attributes' GRIDPooling (caffeq/layers/grid_pooling.py) against a loop written
here from grid_pooling_layer.cpp's Forward_cpu (float32 bin sizes, floor / ceil), in torch, onnxruntime
and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32


def grid_pool_ref(x, ph, pw):
    n, c, h, w = x.shape
    bh, bw = F32(h) / F32(ph), F32(w) / F32(pw)
    out = np.empty((n, c, ph, pw), F32)
    for p in range(ph):
        hs, he = min(h, int(math.floor(F32(p) * bh))), min(h, int(math.ceil(F32(p + 1) * bh)))
        for q in range(pw):
            ws, we = min(w, int(math.floor(F32(q) * bw))), min(w, int(math.ceil(F32(q + 1) * bw)))
            out[:, :, p, q] = x[:, :, hs:he, ws:we].max(axis=(2, 3))
    return out


LAYER = 'layer {{ name: "g" type: "GRIDPooling" bottom: "x" top: "y" {field} {{ pooled_h: {ph} pooled_w: {pw} }} }}'


def test_the_nets_8_by_8_into_6_by_6_overlaps_its_bins():
    x = (10 * np.arange(8)[:, None] + np.arange(8)[None, :]).astype(F32)[None, None]
    model = load_from_text(net(LAYER.format(field="grid_pooling_param", ph=6, pw=6), inputs={"x": x.shape}))
    got = model.run({"x": x})["y"][0, 0]
    # the spec's bins [0,2) [1,3) [2,4) [4,6) [5,7) [6,8): each ends one before its last cell
    last = np.array([1, 2, 3, 5, 6, 7])
    np.testing.assert_array_equal(got, 10 * last[:, None] + last[None, :])


@pytest.mark.parametrize("shape, ph, pw", [((2, 3, 8, 8), 6, 6), ((1, 4, 24, 20), 6, 6), ((2, 2, 62, 5), 14, 3),
                                           ((1, 3, 3, 7), 5, 2)])
def test_grid_pooling_matches_the_forks_loop(shape, ph, pw, tmp_path):
    x = rng(4).standard_normal(shape).astype(F32)
    model = load_from_text(net(LAYER.format(field="grid_pooling_param", ph=ph, pw=pw), inputs={"x": shape}))
    assert model.blob_shapes["y"] == (shape[0], shape[1], ph, pw)
    check_everywhere(model, {"x": x}, {"y": grid_pool_ref(x, ph, pw)}, tmp_path)


def test_float32_bin_edges_differ_from_exact_ones_at_62_rows_into_14():
    # spec: bin 7 starts at row 30 in float32 (7 * 4.428571f = 30.999998), 31 in exact arithmetic
    x = np.zeros((1, 1, 62, 1), F32)
    x[0, 0, 30, 0] = 1.0
    model = load_from_text(net(LAYER.format(field="grid_pooling_param", ph=14, pw=1), inputs={"x": x.shape}))
    assert model.run({"x": x})["y"][0, 0, 7, 0] == 1.0


def test_the_forks_binary_number_reads_as_multi_roi_pooling_param():
    # the fork stores grid_pooling_param at 8266713, which caffeq's schema names multi_roi_pooling_param
    x = rng(5).standard_normal((1, 2, 9, 7)).astype(F32)
    model = load_from_text(net(LAYER.format(field="multi_roi_pooling_param", ph=4, pw=3), inputs={"x": x.shape}))
    np.testing.assert_array_equal(model.run({"x": x})["y"], grid_pool_ref(x, 4, 3))


def test_a_grid_without_its_size_is_refused():
    with pytest.raises(CaffeqError, match="pooled_h and pooled_w must be > 0"):
        load_from_text(net('layer { name: "g" type: "GRIDPooling" bottom: "x" top: "y" grid_pooling_param '
                           '{ pooled_h: 6 } }', inputs={"x": (1, 1, 8, 8)}))
