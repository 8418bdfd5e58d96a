"""lzzcd001/OSLSM's MatMult and ReshapeLike (MatMultLayer.cu, reshape_like_layer.cpp) against numpy."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def matmult_net(a, b, params=""):
    return net(f'layer {{ name: "mm" type: "MatMult" bottom: "a" bottom: "b" top: "c" matmult_param {{ {params} }} }}',
               inputs={"a": a, "b": b})


@pytest.mark.parametrize("a_shape, b_shape, params, ref", [
    # OSLSM's classifier: (1, 1, 4096) weights times the (1, 4096, 324) tiled features
    ((2, 1, 5), (2, 5, 7), "", lambda a, b: a @ b),
    ((2, 3, 5, 4), (6, 2, 5), "transpose_a: true transpose_b: true",
     lambda a, b: (np.swapaxes(a.reshape(6, 5, 4), 1, 2) @ np.swapaxes(b, 1, 2)).reshape(2, 3, 4, 2)),
    ((3, 4), (3, 4, 6), "diagonal_input: true", lambda a, b: a[:, :, None] * b),
    ((3, 4), (3, 4), "diagonal_input: true diagonal_input: true", lambda a, b: a * b),
])
def test_matmult_matches_the_fork(a_shape, b_shape, params, ref, tmp_path):
    g = rng(5)
    a, b = g.standard_normal(a_shape).astype(np.float32), g.standard_normal(b_shape).astype(np.float32)
    want = ref(a.astype(np.float64), b.astype(np.float64))
    model = load_from_text(matmult_net(a_shape, b_shape, params))
    assert model.blob_shapes["c"] == want.shape
    check_everywhere(model, {"a": a, "b": b}, {"c": want}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("a_shape, b_shape, params, msg", [
    ((2, 3, 5), (2, 4, 7), "", "do not match"),
    ((2, 3, 5), (3, 5, 7), "", "different numbers of matrices"),
    ((3, 4), (3, 4), "diagonal_input: false diagonal_input: true", "full A times a diagonal B"),
    ((3, 4), (3, 6, 4), "diagonal_input: true transpose_b: true", "B can not be transposed"),
])
def test_matmult_refuses_what_the_fork_refuses(a_shape, b_shape, params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(matmult_net(a_shape, b_shape, params))


def test_reshape_like_takes_its_axes_from_the_second_bottom(tmp_path):
    # OSLSM's pred: (1, 1, 324) scores shaped as the (1, 4096, 18, 18) features' map, dims -1 1 0 0
    x = rng(6).standard_normal((2, 1, 6 * 5)).astype(np.float32)
    text = net('layer { name: "r" type: "ReshapeLike" bottom: "x" bottom: "ref" top: "y" '
               'reshape_param { shape { dim: -1 dim: 1 dim: 0 dim: 0 } } }', inputs={"x": x.shape, "ref": (2, 8, 6, 5)})
    model = load_from_text(text)
    assert model.blob_shapes["y"] == (2, 1, 6, 5)
    feeds = {"x": x, "ref": np.zeros((2, 8, 6, 5), np.float32)}
    check_everywhere(model, feeds, {"y": x.reshape(2, 1, 6, 5)}, tmp_path)
    # axis and num_axes replace part of the reference's axes only
    part = load_from_text(net('layer { name: "r" type: "ReshapeLike" bottom: "x" bottom: "ref" top: "y" '
                              'reshape_param { shape { dim: 3 dim: -1 } axis: 1 num_axes: 1 } }',
                              inputs={"x": (2, 12, 5), "ref": (2, 7, 5)}))
    assert part.blob_shapes["y"] == (2, 3, 4, 5)
    with pytest.raises(LayerError, match="num_axes must be >= 0"):
        load_from_text(net('layer { name: "r" type: "ReshapeLike" bottom: "x" bottom: "ref" top: "y" '
                           'reshape_param { shape { dim: -1 } num_axes: -2 } }', inputs={"x": (2, 7), "ref": (2, 7)}))
    with pytest.raises(LayerError, match="not divisible"):
        load_from_text(net('layer { name: "r" type: "ReshapeLike" bottom: "x" bottom: "ref" top: "y" '
                           'reshape_param { shape { dim: -1 dim: 0 } } }', inputs={"x": (2, 7), "ref": (3, 3)}))
