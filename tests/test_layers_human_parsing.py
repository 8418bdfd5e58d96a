"""Engineering-Course/caffe_ssl's MaskCreate (b62e3de mask_create_layer.cpp Forward_cpu): the reference is its
per-pixel partial_sort of (value, class) pairs with std::greater, ties included."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def mask_ref(x):
    n, c, h, w = x.shape
    out = np.zeros((n, 1, h, w), F)
    for i in range(n):
        for y in range(h):
            for z in range(w):
                pairs = sorted(((x[i, k, y, z], k) for k in range(c)), reverse=True)   # std::greater on pairs
                out[i, 0, y, z] = pairs[0][1]
    return out


def test_best_class_with_ties_to_the_highest(tmp_path):
    x = rng(1).integers(0, 3, (2, 5, 3, 4)).astype(F)     # many equal maxima
    model = load_from_text(net('layer { name: "m" type: "MaskCreate" bottom: "x" top: "o" mask_create_param { num_cls: 5 } }',
                               inputs={"x": x.shape}))
    want = mask_ref(x)
    assert len(np.unique(want)) > 2
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)


def test_refuses_another_class_count():
    with pytest.raises(LayerError, match="has 4 channels, mask_create_param.num_cls 20"):
        load_from_text(net('layer { name: "m" type: "MaskCreate" bottom: "x" top: "o" }', inputs={"x": (1, 4, 2, 2)}))


def test_refuses_no_classes():
    with pytest.raises(LayerError, match="num_cls must be >= 1, got 0"):
        load_from_text(net('layer { name: "m" type: "MaskCreate" bottom: "x" top: "o" mask_create_param { num_cls: 0 } }',
                           inputs={"x": (1, 4, 2, 2)}))
