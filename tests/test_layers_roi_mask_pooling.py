"""craftGBD/caffe-GBD's ROIMaskPooling (caffeq/layers/roi_mask_pooling.py) against a loop written here from
its GPU kernel (roi_mask_pooling_layer.cu: the box rescaled about its centre in float32, C's round, Fast
R-CNN's float32 bins clipped to the map, 0 for an empty bin), in torch, onnxruntime and model.py."""
import math

import numpy as np
import pytest
from c_reference import c_round
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def roi_mask_ref(x, rois, ph, pw, scale, roi_scale, half_part=0):
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F32)
    for i, (b, x1, y1, x2, y2) in enumerate(rois):
        x1, y1, x2, y2 = F32(x1), F32(y1), F32(x2), F32(y2)
        xc, yc = (x1 + x2) / F32(2), (y1 + y2) / F32(2)
        hw, hh = (x2 - x1) * F32(roi_scale) / F32(2), (y2 - y1) * F32(roi_scale) / F32(2)
        xx1, yy1, xx2, yy2 = xc - hw, yc - hh, xc + hw, yc + hh
        if half_part == 1:
            xx2 = xc
        elif half_part == 2:
            xx1 = xc
        elif half_part == 3:
            yy2 = yc
        elif half_part == 4:
            yy1 = yc
        sw, sh, ew, eh = (int(c_round(float(v * F32(scale)))) for v in (xx1, yy1, xx2, yy2))
        bh, bw = F32(max(eh - sh + 1, 1)) / F32(ph), F32(max(ew - sw + 1, 1)) / F32(pw)
        for p in range(ph):
            hs = min(max(int(math.floor(F32(p) * bh)) + sh, 0), h)
            he = min(max(int(math.ceil(F32(p + 1) * bh)) + sh, 0), h)
            for q in range(pw):
                ws = min(max(int(math.floor(F32(q) * bw)) + sw, 0), w)
                we = min(max(int(math.ceil(F32(q + 1) * bw)) + sw, 0), w)
                if he > hs and we > ws:
                    out[i, :, p, q] = x[int(b), :, hs:he, ws:we].max(axis=(1, 2))
    return out


LAYER = ('layer {{ name: "p" type: "ROIMaskPooling" bottom: "x" bottom: "rois" top: "y" roi_mask_pooling_param {{ '
         'pooled_w: {pw} pooled_h: {ph} spatial_scale: 0.0625 roi_scale: {rs} {extra} }} }}')


@pytest.mark.parametrize("roi_scale, half_part", [(0.8, 0), (1.806, 0), (2.667, 0), (1.0, 2), (1.5, 3)])
def test_roi_mask_pooling_matches_the_forks_gpu_kernel(roi_scale, half_part, tmp_path):
    r = rng(19)
    x = r.standard_normal((2, 3, 18, 20)).astype(F32)
    rois = np.array([[0, 100, 60, 300, 220], [1, 0, 0, 319, 287], [0, 250, 10, 310, 40], [1, 40, 200, 60, 280],
                     [0, 120, 76, 280, 204]], F32)
    extra = f"half_part: {half_part}" if half_part else ""
    model = load_from_text(net(LAYER.format(ph=7, pw=5, rs=roi_scale, extra=extra),
                               inputs={"x": x.shape, "rois": rois.shape}))
    assert model.blob_shapes["y"] == (5, 3, 7, 5)
    ref = roi_mask_ref(x, rois, 7, 5, 0.0625, roi_scale, half_part)
    check_everywhere(model, {"x": x, "rois": rois}, {"y": ref}, tmp_path)


def test_the_forks_worked_example_rounds_half_away_from_zero():
    # spec: roi [0, 100, 60, 300, 220], roi_scale 0.8 -> corners 120, 76, 280, 204 -> cells round(7.5) = 8 ...
    x = np.arange(18 * 20, dtype=F32).reshape(1, 1, 18, 20)
    rois = np.array([[0, 100, 60, 300, 220]], F32)
    model = load_from_text(net(LAYER.format(ph=14, pw=14, rs=0.8, extra=""), inputs={"x": x.shape, "rois": rois.shape}))
    got = model.run({"x": x, "rois": rois})["y"][0, 0]
    # bins start at column 8 and row 5: the first bin's maximum is cell (5, 8)
    assert got[0, 0] == 5 * 20 + 8 and got[-1, -1] == 13 * 20 + 18


def test_mask_scale_is_refused():
    with pytest.raises(LayerError, match="mask_scale > 0 is not supported"):
        load_from_text(net(LAYER.format(ph=2, pw=2, rs=1, extra="mask_scale: 0.5"),
                           inputs={"x": (1, 1, 4, 4), "rois": (1, 5)}))
