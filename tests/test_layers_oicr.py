"""OICR's GlobalSumPooling (caffeq/layers/oicr.py) against global_sum_pooling_layer.cpp's loop (ppengtang/oicr
d079d31 caffe/), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
LAYER = 'layer { name: "global_pool" type: "GlobalSumPooling" bottom: "x" top: "o" }'


def global_sum_ref(x):
    """top[0, k] = bottom[0, k] + bottom[1, k] + ..., added in the fork's order, in float32."""
    flat = x.reshape(x.shape[0], -1)
    top = np.zeros(flat.shape[1], F)
    for k in range(flat.shape[1]):
        for i in range(flat.shape[0]):
            top[k] = F(top[k] + flat[i, k])
    return top.reshape((1,) + x.shape[1:])


@pytest.mark.parametrize("shape", [(2000, 21), (37, 21), (2, 3, 5, 7)])
def test_global_sum_pooling_sums_over_axis_0(shape, tmp_path):
    # OICR: the (R, C) product of its two MIDN softmaxes, summed over the R proposals
    model = load_from_text(net(LAYER, inputs={"x": shape}))
    assert model.blob_shapes["o"] == (1,) + shape[1:]
    x = rng(4).random(shape).astype(F)
    x[-1] *= 1e-7    # small rows last: another order of the sum rounds them differently
    check_everywhere(model, {"x": x}, {"o": global_sum_ref(x)}, tmp_path)
    assert not np.array_equal(global_sum_ref(x[::-1]), global_sum_ref(x)) or shape[0] < 3


def test_global_sum_pooling_needs_two_axes():
    with pytest.raises(LayerError, match="2 or more axes"):
        load_from_text(net(LAYER, inputs={"x": (5,)}))
