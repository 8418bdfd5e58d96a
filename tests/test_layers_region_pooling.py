"""gidariss/caffe_LocNet's RegionPooling (caffeq/layers/region_pooling.py) against a loop written here from
region_pooling_layer.cpp's Forward_cpu (float32 products, C's truncating division, a zero floor), in torch,
model.py and onnxruntime."""
import math

import numpy as np
import pytest
from conftest import backend_outputs, check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32


def cells(a, b, scale, offset):
    lo = float((F32(a) + F32(1) + F32(offset)) * F32(scale))
    hi = float((F32(b) + F32(1) - F32(offset)) * F32(scale))
    s, e = int(math.floor(lo + 0.5)), int(math.ceil(hi - 0.5))
    if s > e:
        s = e = int((s + e) / 2)     # C: toward zero
    return s, e


def region_pool_ref(x, rois, ph, pw, scale, offset):
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F32)
    for i, roi in enumerate(rois):
        b = int(roi[0])
        sw, ew = cells(roi[1], roi[3], scale, offset)
        sh, eh = cells(roi[2], roi[4], scale, offset)
        swi, ewi = cells(roi[5], roi[7], scale, offset)
        shi, ehi = cells(roi[6], roi[8], scale, offset)
        bh = F32(max(eh - sh + 1, 1)) / F32(ph)
        bw = F32(max(ew - sw + 1, 1)) / F32(pw)
        for ch in range(c):
            for p in range(ph):
                hs = min(h, max(0, int(math.floor(F32(p) * bh)) + sh))
                he = min(h, max(0, int(math.ceil(F32(p + 1) * bh)) + sh))
                for q in range(pw):
                    ws = min(w, max(0, int(math.floor(F32(q) * bw)) + sw))
                    we = min(w, max(0, int(math.ceil(F32(q + 1) * bw)) + sw))
                    best = F32(0)
                    for y in range(hs, he):
                        for z in range(ws, we):
                            if not (swi < z < ewi and shi < y < ehi) and x[b, ch, y, z] > best:
                                best = x[b, ch, y, z]
                    out[i, ch, p, q] = best
    return out


LAYER = ('layer {{ name: "rp" type: "RegionPooling" bottom: "x" bottom: "rois" top: "y" region_pooling_param {{ '
         'pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} offset: {offset} }} }}')


def test_the_forks_worked_example_a_ring():
    # spec: a 10 x 10 map X[h][w] = 10h + w, scale 1/16, offset 6, outer [0, 0, 143, 143], inner [40, 40, 103, 103]
    x = (10 * np.arange(10)[:, None] + np.arange(10)[None, :]).astype(F32)[None, None]
    rois = np.array([[0, 0, 0, 143, 143, 40, 40, 103, 103]], F32)
    model = load_from_text(net(LAYER.format(ph=2, pw=2, scale=0.0625, offset=6), inputs={"x": x.shape, "rois": rois.shape}))
    got = model.run({"x": x, "rois": rois})["y"]
    np.testing.assert_array_equal(got[0, 0], [[43, 49], [94, 99]])
    np.testing.assert_array_equal(model.run({"x": -x - 1, "rois": rois})["y"], np.zeros((1, 1, 2, 2), F32))


@pytest.mark.parametrize("ph, pw, offset", [(3, 4, 6), (7, 5, 0.5), (2, 3, 0)])
def test_region_pooling_matches_the_forks_loop(ph, pw, offset, tmp_path):
    r = rng(9)
    x = r.standard_normal((2, 3, 11, 9)).astype(F32)
    rois = []
    for _ in range(7):
        x0, y0 = r.uniform(-40, 120, 2)
        x1, y1 = x0 + r.uniform(-10, 150), y0 + r.uniform(-10, 170)   # some inverted, some past the map
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        iw, ih = r.uniform(0, 80, 2)
        rois.append([r.integers(0, 2), x0, y0, x1, y1, cx - iw / 2, cy - ih / 2, cx + iw / 2, cy + ih / 2])
    rois = np.array(rois, F32).reshape(7, 9, 1, 1)      # matcaffe's (R, 9, 1, 1)
    model = load_from_text(net(LAYER.format(ph=ph, pw=pw, scale=0.0625, offset=offset),
                               inputs={"x": x.shape, "rois": rois.shape}))
    assert model.blob_shapes["y"] == (7, 3, ph, pw)
    ref = region_pool_ref(x, rois.reshape(7, 9), ph, pw, 0.0625, offset)
    # maxima of the inputs: exact in torch, onnxruntime and model.py
    check_everywhere(model, {"x": x, "rois": rois}, {"y": ref}, tmp_path)


def test_region_pooling_with_no_rois(tmp_path):
    model = load_from_text(net(LAYER.format(ph=2, pw=3, scale=0.0625, offset=0), inputs={"x": (1, 2, 5, 5),
                                                                                        "rois": (0, 9)}))
    f = {"x": rng(2).standard_normal((1, 2, 5, 5)).astype(F32), "rois": np.zeros((0, 9), F32)}
    for backend, got in backend_outputs(model, f, tmp_path, top="y").items():
        assert got.shape == (0, 2, 2, 3), backend


def test_region_pooling_refuses_fast_rcnn_rois():
    with pytest.raises(CaffeqError, match=r"rois must be \(R, 9\)"):
        load_from_text(net(LAYER.format(ph=2, pw=2, scale=1, offset=0), inputs={"x": (1, 2, 5, 5), "rois": (3, 5)}))
