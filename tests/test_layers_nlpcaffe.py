"""nlpcaffe's Wordvec and Lstm (caffeq/layers/nlpcaffe.py) against loops written here from its wordvec_layer.cpp
and lstm_layer.cu (the GPU forward its solver trains with), in torch, onnxruntime and model.py; a net shaped like
its language-model example's first steps (fast_wordvec_slice, fast_lstm_concat)."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import DataError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def ref_tanh(v):
    out = np.empty_like(v)
    for k, x in np.ndenumerate(v):
        e = np.exp(F(2) * x, dtype=F)
        out[k] = (e - F(1)) / (e + F(1)) if abs(x) < 5 else (F(1) if x > 0 else F(-1))
    return out


def sigmoid(v):
    return (1.0 / (1.0 + np.exp(-v.astype(np.float64)))).astype(F)


def ref_lstm(x, c_prev, blobs):
    n = x.shape[0]
    rows = x.reshape(n, -1).astype(np.float64)
    pre = [rows @ w.reshape(w.shape[1], -1).T.astype(np.float64) for w in blobs]
    g, i, o = ref_tanh(pre[0].astype(F)), sigmoid(pre[1]), sigmoid(pre[3])
    f = sigmoid(-pre[3])                       # the GPU forward: the forget gate is sigmoid(0 - output gate's)
    c = c_prev.reshape(n, -1) * f + i * g
    return (c * o).reshape(n, -1, 1, 1), c.reshape(n, -1, 1, 1)


def lm_net(steps=3, vocab=11, dim=4, cells=5):
    points = " ".join(f"slice_point: {k}" for k in range(1, steps))
    words = " ".join(f'top: "w{t}"' for t in range(steps))
    layers = [f'layer {{ name: "wv" type: "Wordvec" bottom: "ids" top: "wv" wordvec_param {{ dimension: {dim} '
              f'vocab_size: {vocab} weight_filler {{ type: "uniform" min: -1 max: 1 }} }} }}',
              f'layer {{ name: "s" type: "Slice" bottom: "wv" {words} slice_param {{ slice_dim: 2 {points} '
              f'fast_wordvec_slice: true }} }}']
    h, c = "h0", "c0"
    for t in range(steps):
        layers.append(f'layer {{ name: "cat{t}" type: "Concat" bottom: "w{t}" bottom: "{h}" top: "cat{t}" '
                      f'concat_param {{ fast_lstm_concat: true }} }}')
        layers.append(f'layer {{ name: "lstm{t}" type: "Lstm" bottom: "cat{t}" bottom: "{c}" top: "h{t + 1}" '
                      f'top: "c{t + 1}" ' + "".join(f'param {{ name: "p{k}" }} ' for k in range(4)) +
                      f'lstm_param {{ num_cells: {cells} input_weight_filler {{ type: "uniform" min: -0.5 max: 0.5 }} '
                      'input_gate_weight_filler { type: "uniform" } forget_gate_weight_filler { type: "uniform" } '
                      'output_gate_weight_filler { type: "uniform" } } }')
        h, c = f"h{t + 1}", f"c{t + 1}"
    return net(*layers, inputs={"ids": (2, steps, 1, 1), "h0": (2, cells, 1, 1), "c0": (2, cells, 1, 1)})


def test_a_language_model_step_by_step_matches_the_forks_loops(tmp_path):
    steps, cells = 3, 5
    model = load_from_text(lm_net(steps, cells=cells), random_weights=True,
                           outputs=[f"h{steps}", f"c{steps}", "wv"])
    blobs = {n.name: [np.asarray(b, F) for b in n.blobs] for n in model.layers if n.blobs}
    table = blobs["wv"][0]
    assert table.shape == (1, 11, 1, 4) and blobs["lstm0"][0].shape == (1, cells, 1, 4 + cells)
    # ids rounded as (int)(x + 0.5): 2.4 -> 2, 6.5 -> 7
    ids = np.array([[2.4, 6.5, 0], [10, 3.49, 9.6]], F).reshape(2, steps, 1, 1)
    h = (rng(1).standard_normal((2, cells, 1, 1)) * 10).astype(F)    # large enough that tanh5 clips some
    c = rng(2).standard_normal((2, cells, 1, 1)).astype(F)
    words = np.floor(ids.reshape(2, steps) + F(0.5)).astype(int)
    wv = table.reshape(11, 4)[words].transpose(0, 2, 1)[..., None]       # (N, dim, T, 1)
    hs, cs = h, c
    x = np.concatenate([wv[:, :, :1], hs], axis=1).reshape(2, -1)
    assert (np.abs(x @ blobs["lstm0"][0].reshape(cells, -1).T) >= 5).any()   # tanh5's clipped branch is read
    for t in range(steps):
        x = np.concatenate([wv[:, :, t:t + 1], hs], axis=1)
        hs, cs = ref_lstm(x, cs, blobs[f"lstm{t}"])
    f = {"ids": ids, "h0": h, "c0": c}
    check_everywhere(model, f, {"wv": wv, f"h{steps}": hs, f"c{steps}": cs}, tmp_path, atol=2e-6, rtol=2e-6)


def test_the_forget_gate_blob_is_never_read():
    model = load_from_text(lm_net(1), random_weights=True, outputs=["h1", "c1"])
    f = {"ids": np.array([[1], [2]], F).reshape(2, 1, 1, 1), "h0": np.ones((2, 5, 1, 1), F),
         "c0": np.ones((2, 5, 1, 1), F)}
    before = model.run(f)
    lstm = next(n for n in model.layers if n.name == "lstm0")
    lstm.blobs[2] = np.asarray(lstm.blobs[2]) * 0 + 7
    after = model.run(f)
    np.testing.assert_array_equal(before["h1"], after["h1"])


def test_wordvec_refuses_ids_outside_the_table_and_fast_slices_of_height_two():
    model = load_from_text(lm_net(1), random_weights=True, outputs=["h1"])
    f = {"ids": np.array([[1], [11]], F).reshape(2, 1, 1, 1), "h0": np.zeros((2, 5, 1, 1), F),
         "c0": np.zeros((2, 5, 1, 1), F)}
    with pytest.raises(DataError, match=r"word id 11 is outside \[0, 11\)"):
        model.run(f)
    with pytest.raises(LayerError, match="fast_wordvec_slice"):
        load_from_text(net('layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" slice_param { axis: 2 '
                           'slice_point: 2 fast_wordvec_slice: true } }', inputs={"x": (1, 3, 4, 1)}))
    assert math.prod(load_from_text(net('layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" slice_param '
                                        '{ axis: 1 slice_point: 2 fast_wordvec_slice: true } }',
                                        inputs={"x": (1, 3, 4, 1)})).blob_shapes["a"]) == 8
