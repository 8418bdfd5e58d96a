"""nlpcaffe's Wordvec and Lstm (caffeq/layers/nlpcaffe.py) against loops written here from its wordvec_layer.cpp
and lstm_layer.cu (the GPU forward its solver trains with), in torch, onnxruntime and model.py; a net shaped like
its language-model example's first steps (fast_wordvec_slice, fast_lstm_concat)."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

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


# ---- nlpcaffe's first Lstm (Russell91/nlpcaffe fd5fb6c, V1 files) and its nlp Data ---------------------------

def exp_tanh(v):
    """lstm_layer.cpp's tanh template, in float: (e^2v - 1) / (e^2v + 1), NaN where e^2v overflows."""
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(F(2) * v.astype(F), dtype=F)
        return ((e - F(1)) / (e + F(1))).astype(F)


def ref_first_lstm(x, c_prev, blobs):
    """LstmLayer::Forward_cpu of fd5fb6c, its loops: blob 2j the gate's (1, C, 1, K + 1) weights, the last
    column (cid) the peephole weight on the previous cell; blob 2j + 1 its bias."""
    n, k = x.shape[0], int(np.prod(x.shape[1:]))
    cells = blobs[0].shape[1]
    rows, prev = x.reshape(n, k).astype(F), c_prev.reshape(n, cells).astype(F)
    w = [b.reshape(-1).astype(F) for b in blobs]
    h, c = np.zeros((n, cells), F), np.zeros((n, cells), F)
    for s in range(n):
        for i in range(cells):
            cid = (i + 1) * (k + 1) - 1
            pre = [F(w[1][i]), F(w[3][i] + w[2][cid] * prev[s, i]), F(w[5][i] + w[4][cid] * prev[s, i]),
                   F(w[7][i] + w[6][cid] * prev[s, i])]
            for j in range(k):
                wid = j + i * (k + 1)
                for gate in range(4):
                    pre[gate] = F(pre[gate] + w[2 * gate][wid] * rows[s, j])
            g = exp_tanh(np.array(pre[0]))
            ig, fg, og = (F(1) / (F(1) + np.exp(-np.float32(v), dtype=F)) for v in pre[1:])
            c[s, i] = prev[s, i] * fg + g * ig
            h[s, i] = exp_tanh(np.array(c[s, i])) * og
    return h.reshape(n, cells, 1, 1), c.reshape(n, cells, 1, 1)


FIRST_LSTM_V1 = '''name: "rnn"
input: "x" input_dim: 3 input_dim: 4 input_dim: 1 input_dim: 2
input: "c0" input_dim: 3 input_dim: 5 input_dim: 1 input_dim: 1
layers { bottom: "x" bottom: "c0" top: "h" top: "c" name: "lstm" type: LSTM
  lstm_param { num_cells: 5 input_weight_filler { type: "uniform" min: -0.6 max: 0.6 }
    input_bias_filler { type: "constant" value: 0.1 } input_gate_weight_filler { type: "uniform" }
    input_gate_bias_filler { type: "constant" } forget_gate_weight_filler { type: "uniform" }
    forget_gate_bias_filler { type: "constant" } output_gate_weight_filler { type: "uniform" }
    output_gate_bias_filler { type: "constant" } input_gate_cell_weight_filler: 0.5
    forget_gate_cell_weight_filler: 0.25 output_gate_cell_weight_filler: -0.5 } }
'''


def test_the_first_nlpcaffe_lstm_matches_its_forward_cpu_loops(tmp_path):
    model = load_from_text(FIRST_LSTM_V1, random_weights=True)
    node = next(n for n in model.layers if n.name == "lstm")
    assert [tuple(np.shape(b)) for b in node.blobs] == [(1, 5, 1, 9), (1, 5, 1, 1)] * 4
    r = rng(7)
    for b in range(8):    # asymmetric values everywhere, the peephole column included
        node.blobs[b] = r.uniform(-0.8, 0.8, np.shape(node.blobs[b])).astype(F)
    x = r.standard_normal((3, 4, 1, 2)).astype(F)
    c0 = (r.standard_normal((3, 5, 1, 1)) * 2).astype(F)
    h, c = ref_first_lstm(x, c0, [np.asarray(b) for b in node.blobs])
    check_everywhere(model, {"x": x, "c0": c0}, {"h": h, "c": c}, tmp_path, atol=2e-6, rtol=2e-6)
    # the peephole column of the candidate's weights is never read (the fork zeroes it and skips it); the
    # input gate's is
    node.blobs[0] = np.array(node.blobs[0]).copy()
    node.blobs[0][..., -1] = 9.0
    model.clear_cache()
    np.testing.assert_allclose(model.run({"x": x, "c0": c0})["h"], h, atol=2e-6, rtol=2e-6)
    node.blobs[2] = np.array(node.blobs[2]).copy()
    node.blobs[2][..., -1] += 1.0
    model.clear_cache()
    assert np.abs(model.run({"x": x, "c0": c0})["h"] - h).max() > 1e-3


def test_the_first_lstms_tanh_overflows_to_nan_as_in_the_fork():
    # a candidate pre-activation past 44.4 makes e^2v inf and (inf - 1) / (inf + 1) NaN, in the fork's
    # float tanh and here alike; a large negative one gives -1
    model = load_from_text(FIRST_LSTM_V1, random_weights=True)
    node = next(n for n in model.layers if n.name == "lstm")
    for b in range(8):
        node.blobs[b] = np.zeros(np.shape(node.blobs[b]), F)
    node.blobs[1] = np.array([50, -50, 0, 0, 0], F).reshape(1, 5, 1, 1)   # the candidate's bias
    node.blobs[3] = np.full((1, 5, 1, 1), 30, F)                            # the input gate open
    out = model.run({"x": np.zeros((3, 4, 1, 2), F), "c0": np.zeros((3, 5, 1, 1), F)})
    ref_h, ref_c = ref_first_lstm(np.zeros((3, 4, 1, 2), F), np.zeros((3, 5, 1, 1), F),
                                  [np.asarray(b) for b in node.blobs])
    assert np.isnan(ref_c[:, 0]).all() and np.isnan(out["c"][:, 0]).all()
    np.testing.assert_allclose(out["c"][:, 1:], ref_c[:, 1:], atol=1e-6)
    assert (out["c"][:, 1] == -1).all()


def test_a_v1_lstm_without_biases_reads_its_forget_gate_blob(tmp_path):
    # the four-blob Lstm of a V1 file comes from before nlpcaffe's March 2015 merge: its GPU forward (7267e1c
    # lstm_layer.cu ForwardCombineGates) reads the forget gate from blob 2, with tanh5 and h = c o
    text = FIRST_LSTM_V1.split("    input_bias_filler")[0] + " } }\n"
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "lstm")
    assert [tuple(np.shape(b)) for b in node.blobs] == [(1, 5, 1, 8)] * 4
    blobs = [np.asarray(b, F) for b in node.blobs]
    r = rng(9)
    x = (r.standard_normal((3, 4, 1, 2)) * 4).astype(F)
    c0 = r.standard_normal((3, 5, 1, 1)).astype(F)
    rows = x.reshape(3, -1).astype(np.float64)
    pre = [rows @ w.reshape(5, -1).T.astype(np.float64) for w in blobs]
    g, i, f, o = ref_tanh(pre[0].astype(F)), sigmoid(pre[1]), sigmoid(pre[2]), sigmoid(pre[3])
    c = c0.reshape(3, -1) * f + i * g
    check_everywhere(model, {"x": x, "c0": c0}, {"h": (c * o).reshape(3, 5, 1, 1), "c": c.reshape(3, 5, 1, 1)},
                     tmp_path, atol=2e-6, rtol=2e-6)


def test_nlp_data_takes_its_shape_from_input_shape():
    # nlpcaffe's Data with nlp: true one-hot encodes word pairs into (batch_size, pairs x (vocab_size + 1), 1, 1);
    # the pair count lives in the database records, so the shape comes from --input-shape
    from caffeq.errors import CaffeqError
    text = ('layers { name: "data" type: DATA top: "data" data_param { source: "missing_db" batch_size: 4 '
            'backend: LMDB nlp: true vocab_size: 10 } }\n'
            'layers { name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip" inner_product_param { num_output: 2 } }')
    with pytest.raises(CaffeqError, match=r"nlpcaffe's word pairs .* \(batch_size, pairs x 11, 1, 1\).*"
                                          r"--input-shape data="):
        load_from_text(text, random_weights=True)
    model = load_from_text(text, random_weights=True, input_shapes={"data": (4, 33, 1, 1)})
    assert model.blob_shapes["ip"] == (4, 2)
    lines = node_of(model, "data").spec.preprocessing(node_of(model, "data").attrs)
    assert any("one-hot" in line and "11 values" in line for line in lines)
    with pytest.raises(LayerError, match="data_param.nlp needs a vocab_size"):
        load_from_text(text.replace(" vocab_size: 10", ""))


def test_eval_refuses_nlp_records(tmp_path):
    # eval reads image Datums and their labels; nlpcaffe's one-hot word pairs are refused, not misread
    from caffeq.data.plan import data_layer, plan_data
    from caffeq.errors import DataError
    text = ('layers { name: "data" type: DATA top: "data" data_param { source: "pairs_db" batch_size: 4 '
            'backend: LMDB nlp: true vocab_size: 10 } include { phase: TEST } }')
    model = load_from_text(text, input_shapes={"data": (4, 33, 1, 1)})
    with pytest.raises(DataError, match=r"layer 'data' \(Data\): data_param.nlp makes each record nlpcaffe's one-hot"):
        plan_data(data_layer(model), {}, str(tmp_path), data=str(tmp_path))
