"""peteanderson80/caffe (Up-Down-Captioner): LSTMNode and the Softmax with per-position counts against their
forwards written here from lstm_node_layer.cpp and the fork's softmax test (TestForwardWithChannelWidth),
in torch, onnxruntime and model.py; BeamSearchNode / BeamSearch sized and refused.  chanyn/3Dpose_ssl's
InvertedOrder against its loop, out of place and in place."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def lstm_node_ref(x, c_prev, w, b, cont=None):
    m, n = x.shape[0], w.shape[0] // 4
    g = x.reshape(m, -1).astype(np.float64) @ w.T.astype(np.float64) + b
    i, f, o = sigmoid(g[:, :n]), sigmoid(g[:, n:2 * n]), sigmoid(g[:, 2 * n:3 * n])
    if cont is not None:
        f = f * cont.reshape(m, 1)
    c = f * c_prev.reshape(m, n) + i * np.tanh(g[:, 3 * n:])
    return (o * np.tanh(c)).astype(F32), c.astype(F32)


@pytest.mark.parametrize("with_cont", [False, True])
def test_lstm_node(tmp_path, with_cont):
    g = rng(91)
    m, n = 3, 4
    bottoms = 'bottom: "x" bottom: "c_prev"' + (' bottom: "cont"' if with_cont else "")
    layer = f'layer {{ name: "lstm" type: "LSTMNode" {bottoms} top: "h" top: "c" lstm_param {{ num_cells: {n} }} }}'
    inputs = {"x": (m, 2, 3), "c_prev": (m, n)} | ({"cont": (m,)} if with_cont else {})
    model = load_from_text(net(layer, inputs=inputs), random_weights=True)
    w, b = g.standard_normal((4 * n, 6)).astype(F32), g.standard_normal(4 * n).astype(F32)
    node_of(model, "lstm").blobs = [w, b]
    feeds = {"x": g.standard_normal((m, 2, 3)).astype(F32), "c_prev": g.standard_normal((m, n)).astype(F32)}
    if with_cont:
        feeds["cont"] = np.array([1, 0, 1], F32)
    h, c = lstm_node_ref(feeds["x"], feeds["c_prev"], w, b, feeds.get("cont"))
    check_everywhere(model, feeds, {"h": h, "c": c}, tmp_path, atol=1e-6, rtol=1e-5)
    with pytest.raises(LayerError, match="previous cell state must hold"):
        load_from_text(net(layer, inputs=dict(inputs, c_prev=(m, n + 1))))


def counted_softmax_ref(x, counts):
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        k = int(counts.reshape(-1)[r])
        e = np.exp(x[r, :k].astype(np.float64) - x[r, :k].max())
        out[r, :k] = e / e.sum()
    return out


def test_softmax_with_counts(tmp_path):
    """Up-Down's attention over a varying number of boxes: softmax over the first count entries, 0 after."""
    x = rng(92).standard_normal((4, 6)).astype(F32)
    counts = np.array([[6], [1], [3], [4]], F32)
    layer = 'layer { name: "sm" type: "Softmax" bottom: "x" bottom: "n" top: "o" softmax_param { axis: 1 } }'
    model = load_from_text(net(layer, inputs={"x": x.shape, "n": counts.shape}))
    want = counted_softmax_ref(x, counts)
    assert (want[2, 3:] == 0).all() and want[1, 0] == 1
    check_everywhere(model, {"x": x, "n": counts}, {"o": want}, tmp_path, atol=1e-7, rtol=1e-6)
    with pytest.raises(LayerError, match="one value per position"):
        load_from_text(net(layer, inputs={"x": x.shape, "n": (3, 1)}))


def test_beam_search_layers_are_sized_not_run():
    first = ('layer { name: "bs0" type: "BeamSearchNode" bottom: "logp" bottom: "h" top: "score" top: "seq" '
             'top: "next" top: "h1" beam_search_param { beam_size: 2 } }\n'
             'layer { name: "bs1" type: "BeamSearchNode" bottom: "score" bottom: "seq" bottom: "logp" bottom: "h1" '
             'top: "score2" top: "seq2" top: "next2" top: "h2" beam_search_param { beam_size: 2 } }')
    model = load_from_text(net(first, inputs={"logp": (4, 7), "h": (4, 5)}))
    assert [model.blob_shapes[t] for t in ("score", "seq", "next", "h1", "seq2", "h2")] == \
        [(4, 1), (4, 1), (4, 1), (4, 5), (4, 2), (4, 5)]
    with pytest.raises(CaffeqError, match="CPU and GPU beam searches choose different beams"):
        model.run({"logp": np.zeros((4, 7), F32), "h": np.zeros((4, 5), F32)})
    whole = ('layer { name: "beam" type: "BeamSearch" bottom: "feat" top: "caption" top: "logp" top: "logp_seq" '
             'beam_search_param { beam_size: 5 sequence_length: 20 net_param { layer { name: "in" type: "Input" '
             'top: "feat" input_param { shape { dim: 1 dim: 8 } } } } } }')
    model = load_from_text(net(whole, inputs={"feat": (3, 8)}))
    assert [model.blob_shapes[t] for t in ("caption", "logp", "logp_seq")] == [(3, 1, 5, 20), (3, 1, 5), (3, 1, 5, 20)]


@pytest.mark.parametrize("rows, in_place", [(5, False), (5, True), (4, True)])
def test_inverted_order(tmp_path, rows, in_place):
    x = rng(93).standard_normal((rows, 3)).astype(F32)
    top = "x" if in_place else "y"
    text = net(f'layer {{ name: "inv" type: "InvertedOrder" bottom: "x" top: "{top}" }}', inputs={"x": x.shape})
    if in_place:
        text += '\nlayer { name: "copy" type: "Power" bottom: "x" top: "y" }'
    model = load_from_text(text)
    want = x.copy()
    for n in range(rows):           # the fork's loop, reading the top where it is the bottom
        want[rows - 1 - n] = (want if in_place else x)[n]
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path)
    assert math.isclose(float(want[0, 0]), float(x[0, 0] if in_place else x[-1, 0]))
