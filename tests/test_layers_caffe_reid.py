"""zhunzhong07/caffe-reid's PairEuclidean (caffeq/layers/person_reid.py) against its pair_euclidean_layer.cpp
Forward_cpu at 7468850, written here as the fork writes it (the blob's first count / 2 values paired with the
rest, caffe_sub then caffe_mul; the labels compared half against half), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def pair_euclidean_ref(x, labels=None):
    n = x.shape[0]
    legacy = tuple(x.shape) + (1,) * (4 - x.ndim)
    flat = x.reshape(-1)
    half = flat.size // 2
    top = np.empty(half, F)
    for i in range(half):                  # diff_ = A - B; top = diff_ * diff_
        d = F(flat[i] - flat[half + i])
        top[i] = d * d
    tops = [top.reshape((n // 2,) + legacy[1:])]
    if labels is not None:
        lab = labels.reshape(-1)
        tops.append(np.array([F(lab[i] == lab[n // 2 + i]) for i in range(n // 2)], F))
    return tops


def pe_net(x_shape, labels_shape=None):
    if labels_shape is None:
        return net('layer { name: "pe" type: "PairEuclidean" bottom: "x" top: "d" }', inputs={"x": x_shape})
    return net('layer { name: "pe" type: "PairEuclidean" bottom: "x" bottom: "label" top: "d" top: "same" }',
               inputs={"x": x_shape, "label": labels_shape})


@pytest.mark.parametrize("shape", [(4, 3, 2, 5), (6, 7), (2, 5, 3)])
def test_pair_squares_and_label_agreement_follow_the_forks_loop(shape, tmp_path):
    n = shape[0]
    model = load_from_text(pe_net(shape, (n,)))
    x = rng(1).standard_normal(shape).astype(F)
    labels = np.array([3, 1, 4, 3, 2, 4][:n // 2] * 2, F)
    labels[0] = 7                                   # one pair differs, the others agree
    d, same = pair_euclidean_ref(x, labels)
    assert model.blob_shapes["d"] == d.shape and len(d.shape) == 4    # legacy Reshape(num, c, h, w)
    assert model.blob_shapes["same"] == (n // 2,)
    assert same[0] == 0 and same[1:].all()
    check_everywhere(model, {"x": x, "label": labels}, {"d": d, "same": same}, tmp_path)


def test_one_bottom_gives_only_the_squares(tmp_path):
    shape = (2, 4, 3, 1)
    model = load_from_text(pe_net(shape))
    x = rng(2).standard_normal(shape).astype(F)
    check_everywhere(model, {"x": x}, {"d": pair_euclidean_ref(x)[0]}, tmp_path)


@pytest.mark.parametrize("text, msg", [
    (pe_net((3, 2, 2, 2)), "num must be even, got 3"),
    (pe_net((4, 2), (4, 2)), r"labels \(bottom 1\) must hold one value per item \(4\), got \[4, 2\]"),
    (net('layer { name: "pe" type: "PairEuclidean" bottom: "x" top: "d" top: "s" }', inputs={"x": (2, 3)}),
     "as many tops as bottoms"),
])
def test_refusals(text, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(text)
