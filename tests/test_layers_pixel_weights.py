"""xueshengke/FNNSR's ElementWiseProduct (caffeq/layers/pixel_weights.py) against a loop written here from
elementwise_product_layer.cpp's Forward_cpu, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32


def product_ref(x, w, b, share):
    """top[n, c, h, w] = fl(fl(x * W[c / share]) + B[c / share]), c / share C's integer division."""
    out = np.empty_like(x)
    for c in range(x.shape[1]):
        y = (x[:, c] * w[0, c // share]).astype(F32)
        out[:, c] = y if b is None else (y + b[0, c // share]).astype(F32)
    return out


def layer(share, bias):
    return (f'layer {{ name: "ElementWiseProduct1" type: "ElementWiseProduct" bottom: "x" top: "y" '
            f'elementwise_product_param {{ bias_term: {str(bias).lower()} share: {share} }} }}')


def test_the_forks_worked_example_shares_consecutive_channels():
    model = load_from_text(net(layer(2, True), inputs={"x": (1, 4, 1, 2)}), random_weights=True)
    node = node_of(model, "ElementWiseProduct1")
    node.blobs = [np.array([[[[2, 3]], [[5, 7]]]], F32), np.array([[[[1, 0]], [[0, 1]]]], F32)]
    model.clear_cache()
    y = model.run({"x": np.ones((1, 4, 1, 2), F32)})["y"][0, :, 0]
    np.testing.assert_array_equal(y, [[3, 3], [3, 3], [5, 8], [5, 8]])     # planes 0, 0, 1, 1: blocked


@pytest.mark.parametrize("channels, share, bias", [(1, 1, False), (4, 4, True), (6, 2, True), (3, 1, True)])
def test_element_wise_product_matches_the_loop(channels, share, bias, tmp_path):
    shape = (2, channels, 7, 5)
    model = load_from_text(net(layer(share, bias), inputs={"x": shape}), random_weights=True)
    node = node_of(model, "ElementWiseProduct1")
    assert [tuple(b.shape) for b in node.blobs] == [(1, channels // share, 7, 5)] * (2 if bias else 1)
    node.blobs = [rng(i).standard_normal(b.shape).astype(F32) for i, b in enumerate(node.blobs)]
    model.clear_cache()
    x = rng(9).standard_normal(shape).astype(F32)
    ref = product_ref(x, node.blobs[0], node.blobs[1] if bias else None, share)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("share, message", [(3, "share 3 must divide the 4 channels"), (0, "share must be >= 1")])
def test_a_share_that_does_not_divide_the_channels_is_refused(share, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(net(layer(share, False), inputs={"x": (1, 4, 3, 3)}))
