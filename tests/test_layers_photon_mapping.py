"""bacTlink/caffe_illu's PhotonMapping (caffeq/layers/photon_mapping.py) against photon_mapping_layer.cpp's loop
written here (double accumulation, std::max / std::min), on asymmetric shapes, in torch, onnxruntime and
model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def ref_photon_mapping(dis, flux):
    n, p, h, w = dis.shape
    top = np.zeros((n, 1, h, w), F)
    for i in range(n):
        for y in range(h):
            for x in range(w):
                m, f = 0.0, 0.0
                for k in range(p):
                    d = float(dis[i, k, y, x])
                    m = m if not d > m else d          # std::max(m, d): a NaN never replaces m
                    f += float(flux[i, k, y, x])
                t = F(f / (m * math.pi)) if m > 1e-100 else F(0)
                top[i, 0, y, x] = t if not F(1) < t else F(1)   # std::min(t, 1): NaN kept
    return top


def test_photon_mapping_is_the_forks_estimate(tmp_path):
    shape = (2, 5, 3, 4)
    r = rng(9)
    dis = np.abs(r.standard_normal(shape)).astype(F) * 3
    flux = r.uniform(-0.5, 2, shape).astype(F)
    dis[0, :, 0, 0] = -1.0            # no positive distance: 0
    dis[1, 2, 1, 1] = np.nan          # a NaN distance is skipped
    flux[1, 3, 2, 3] = np.nan         # a NaN flux gives NaN
    dis[0, :, 2, 2] = 1e-3            # a tiny neighbourhood: clamped to 1
    flux[0, :, 1, 2] = -5.0           # negative flux: no lower clamp
    ref = ref_photon_mapping(dis, flux)
    assert ref[0, 0, 0, 0] == 0 and ref[0, 0, 2, 2] == 1 and ref[0, 0, 1, 2] < 0 and np.isnan(ref[1, 0, 2, 3])
    model = load_from_text(net('layer { name: "pm" type: "PhotonMapping" bottom: "dis" bottom: "flux" top: "pm" }',
                               inputs={"dis": shape, "flux": shape}))
    check_everywhere(model, {"dis": dis, "flux": flux}, {"pm": ref}, tmp_path)


def test_photon_mapping_needs_two_bottoms_of_one_shape():
    with pytest.raises(CaffeqError, match=r"two \(N, P, H, W\) bottoms of one shape .* got \[2, 5, 3, 4\] and "
                                          r"\[2, 4, 3, 4\]"):
        load_from_text(net('layer { name: "pm" type: "PhotonMapping" bottom: "a" bottom: "b" top: "pm" }',
                           inputs={"a": (2, 5, 3, 4), "b": (2, 4, 3, 4)}))
