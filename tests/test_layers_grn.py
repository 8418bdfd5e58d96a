"""ylongqi/FoodDist's GRN (caffeq/layers/grn.py) against grn_layer.cpp's loop written here, in torch,
onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def grn_ref(x):
    n = x.shape[0]
    flat = x.reshape(n, -1).astype(np.float64)
    out = np.empty_like(flat)
    for i in range(n):
        out[i] = flat[i] / np.sqrt((flat[i] ** 2).sum())
    return out.reshape(x.shape).astype(F)


@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 1, 1)])
def test_grn_normalizes_each_samples_channels(shape, tmp_path):
    # FoodDist's deploy net: fc8 (N, 1000) before its ReLU, so values of both signs
    model = load_from_text(net('layer { name: "l2n" type: "GRN" bottom: "x" top: "o" }', inputs={"x": shape}))
    x = rng(7).standard_normal(shape).astype(F)
    want = grn_ref(x)
    np.testing.assert_allclose(np.sqrt((want.reshape(shape[0], -1) ** 2).sum(1)), 1, rtol=1e-6)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_grn_needs_unit_height_and_width():
    with pytest.raises(LayerError, match="height and width are 1"):
        load_from_text(net('layer { name: "l2n" type: "GRN" bottom: "x" top: "o" }', inputs={"x": (1, 3, 2, 2)}))
