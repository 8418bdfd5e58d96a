"""Qi-Xian/DeVise's LinearTransform and Similarity (caffeq/layers/devise.py) against the forks' gemms
(linear_transform_layer.cpp, similarity_layer.cpp), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def test_linear_transform_then_similarity_to_the_word_vectors(tmp_path):
    shapes = {"x": (4, 6, 2, 1), "words": (7, 5)}
    model = load_from_text(net('layer { name: "fc9" type: "LinearTransform" bottom: "x" top: "e" '
                               'linear_transform_param { num_output: 5 weight_filler { type: "gaussian" std: 0.01 } } }\n'
                               'layer { name: "f10" type: "Similarity" bottom: "e" bottom: "words" top: "s" }',
                               inputs=shapes), random_weights=True)
    assert model.graph.tensors["e"].shape == (4, 5) and model.graph.tensors["s"].shape == (4, 7)
    w = np.asarray(node_of(model, "fc9").blobs[0])
    assert w.shape == (5, 12)
    r = rng(3)
    feeds = {k: r.standard_normal(s).astype(F32) for k, s in shapes.items()}
    e = feeds["x"].reshape(4, -1).astype(np.float64) @ w.T
    check_everywhere(model, feeds, {"s": e @ feeds["words"].T}, tmp_path, atol=1e-5, rtol=1e-5)


def test_linear_transform_keeps_the_axes_before_axis(tmp_path):
    x = rng(4).standard_normal((2, 3, 4, 5)).astype(F32)
    model = load_from_text(net('layer { name: "t" type: "LinearTransform" bottom: "x" top: "y" '
                               'linear_transform_param { num_output: 6 axis: 2 } }', inputs={"x": x.shape}),
                           random_weights=True)
    w = np.asarray(node_of(model, "t").blobs[0])
    check_everywhere(model, {"x": x}, {"y": x.reshape(2, 3, 20).astype(np.float64) @ w.T}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_similarity_checks_as_the_fork():
    with pytest.raises(LayerError, match="same channels"):
        load_from_text(net('layer { name: "s" type: "Similarity" bottom: "a" bottom: "b" top: "s" }',
                           inputs={"a": (2, 4), "b": (3, 5)}))
