"""Eltwise SUM with the LRCN branch's coeff_blob (its eltwise_layer.cpp: num = coeffs.count / K,
dim = x.count / num, top[j-th block of dim] += coeff[i] * coeffs[i * num + j] * x_i), in torch,
onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def coeff_blob_ref(xs, coeffs, coeff):
    k = len(xs)
    num = coeffs.size // k
    top = np.zeros(xs[0].size, np.float64)
    flat_c = coeffs.reshape(-1)
    for i, x in enumerate(xs):
        dim = x.size // num
        flat = x.reshape(-1)
        for j in range(num):
            factor = f32(f32(coeff[i]) * flat_c[i * num + j])      # coeffs_[i] * coeff_data[...] in float
            top[j * dim:(j + 1) * dim] += factor * flat[j * dim:(j + 1) * dim].astype(np.float64)
    return top.reshape(xs[0].shape)


@pytest.mark.parametrize("coeff_shape, coeff", [((1, 4), ""), ((2, 4, 3), "coeff: 0.5 coeff: -2")],
                         ids=["s2vt_gate", "two_inputs_coeffs"])
def test_eltwise_coeff_blob_scales_each_leading_position(coeff_shape, coeff, tmp_path):
    # densecap's s2vt example: fc7 (T x N x 4096 there) times a per-step 0/1 padding gate
    g = np.random.default_rng(13)
    k = coeff_shape[0]
    xs = [g.standard_normal((4, 3, 5)).astype(f32) for _ in range(k)]
    c = g.standard_normal(coeff_shape).astype(f32)
    names = [f"x{i}" for i in range(k)]
    bottoms = " ".join(f'bottom: "{n}"' for n in names)
    text = net(f'layer {{ name: "e" type: "Eltwise" {bottoms} bottom: "c" top: "y" '
               f'eltwise_param {{ operation: SUM coeff_blob: true {coeff} }} }}',
               inputs={**{n: x.shape for n, x in zip(names, xs)}, "c": coeff_shape})
    model = load_from_text(text)
    values = [float(v) for v in coeff.split()[1::2]] or [1.0] * k
    ref = coeff_blob_ref(xs, c, values)
    assert model.blob_shapes["y"] == (4, 3, 5)
    check_everywhere(model, {**dict(zip(names, xs)), "c": c}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("param, coeff_shape, msg", [
    ("operation: PROD coeff_blob: true", (1, 4), "needs operation SUM"),
    ("coeff_blob: true", (2, 4), r"must be \(1, then the leading axes"),
    ("coeff_blob: true", (1, 3), r"must be \(1, then the leading axes"),
    ("coeff_blob: true coeff: 1 coeff: 2", (1, 4), "2 values for 1 bottoms"),
])
def test_eltwise_coeff_blob_refusals(param, coeff_shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "e" type: "Eltwise" bottom: "x" bottom: "c" top: "y" '
                           f'eltwise_param {{ {param} }} }}', inputs={"x": (4, 3, 5), "c": coeff_shape}))
