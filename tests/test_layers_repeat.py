"""christopher5106/last_caffe_with_stn's Repeat (037482a repeat_layer.cpp): the item times the (R K, K) blob,
shaped (N, R, item).  A fresh blob is R stacked identities (copies); a trained one is any matrix."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def repeat_net(shape, param="num_repeats: 3"):
    return load_from_text(net(f'layer {{ name: "r" type: "Repeat" bottom: "x" top: "o" repeat_param {{ {param} }} }}',
                              inputs={"x": shape}), random_weights=True)


def test_fresh_blob_copies_the_item(tmp_path):
    x = rng(1).standard_normal((2, 3, 2, 2)).astype(F)
    model = repeat_net(x.shape)
    assert model.layers[-1].blobs[0].shape == (36, 12)
    check_everywhere(model, {"x": x}, {"o": np.stack([x] * 3, 1)}, tmp_path)


def test_trained_blob_multiplies(tmp_path):
    x = rng(2).standard_normal((2, 5)).astype(F)
    model = repeat_net(x.shape, "num_repeats: 2 axis: -1")
    w = rng(3).integers(-3, 4, (10, 5)).astype(F)      # small integers: exact products and sums
    model.layers[-1].blobs = [w]
    check_everywhere(model, {"x": x.round(1)}, {"o": (x.round(1) @ w.T).reshape(2, 2, 5)}, tmp_path, rtol=1e-6)


@pytest.mark.parametrize("shape, param, msg", [((2, 3, 4), "num_repeats: 2 axis: 2", "follows axis 1"),
                                               ((2, 3), "num_repeats: 0", "num_repeats must be >= 1")])
def test_refusals(shape, param, msg):
    with pytest.raises(LayerError, match=msg):
        repeat_net(shape, param)
