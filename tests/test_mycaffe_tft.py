"""MyCaffe (MyCaffe/MyCaffe b8922aa, C#): its Temporal Fusion Transformer layers (MyCaffe.layers.tft/layers.tft/*.cs,
MyCaffe/param.tft/*.cs).  References written in numpy from the C# forwards (GrnLayer, GluLayer, GateAddNormLayer,
VarSelNetLayer, ChannelEmbeddingLayer, ReshapeTemporalLayer, MultiHeadAttentionInterpLayer, LayerNormLayer's
forward_local) and compared in torch, onnxruntime and the generated model.py."""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

f32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"
FILES = [str(CORPUS / f"MyCaffe__MyCaffe__MyCaffe.test__test_data__models__tft__{name}_train_test.prototxt")
         for name in ("Tft_traffic__tft_traffic", "Tft_volatility__tft_volatility")]


def _randomize(model, name, seed):
    """Fresh random blobs (biases too) for layer `name`; returns them as float64 arrays."""
    r = rng(seed)
    node = node_of(model, name)
    node.blobs = [(r.standard_normal(b.shape) * (0.5 if b.ndim > 1 else 0.3)).astype(f32) for b in node.blobs]
    model.clear_cache()
    return [b.astype(np.float64) for b in node.blobs]


# ---- numpy references (the C# forwards) -----------------------------------------------------------------------

def ip(x, w, b, axis):
    y = x.reshape(x.shape[:axis] + (-1,)) @ w.T
    return y + b if b is not None else y


def layer_norm(x, eps):
    axes = (1,) if x.ndim == 2 else tuple(range(2, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    return (x - mu) / np.sqrt(var + eps)


def glu(x, blobs, axis, bias=True):
    w1, b1, w2, b2 = blobs if bias else (blobs[0], None, blobs[1], None)
    return ip(x, w2, b2, axis) * (1 / (1 + np.exp(-ip(x, w1, b1, axis))))


def grn(x, ctx, blobs, in_dim, out_dim, axis, elu=True):
    blobs = list(blobs)
    residual = x
    if in_dim != out_dim:
        residual = ip(x, blobs.pop(0), blobs.pop(0), axis)
    h = ip(x, blobs.pop(0), blobs.pop(0), axis)
    if ctx is not None:
        h = h + ip(ctx, blobs.pop(0), None, axis).reshape(h.shape)
    h = np.where(h > 0, h, np.exp(h) - 1) if elu else np.maximum(h, 0)
    h = ip(h, blobs.pop(0), blobs.pop(0), axis)
    g = glu(h, blobs[:4], axis)
    return layer_norm(g + residual.reshape(g.shape), 1e-10)


def grn_blob_count(in_dim, out_dim, ctx):
    return (2 if in_dim != out_dim else 0) + 2 + (1 if ctx else 0) + 2 + 4


def softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# ---- GRN ------------------------------------------------------------------------------------------------------

def _grn_layer(name, bottoms, in_dim, hidden, out, axis, extra=""):
    bots = " ".join(f'bottom: "{b}"' for b in bottoms)
    return (f'layer {{ name: "{name}" type: "GRN" {bots} top: "y" grn_param {{ input_dim: {in_dim} hidden_dim: {hidden} '
            f'output_dim: {out} axis: {axis} dropout_ratio: 0.05 batch_first: True {extra} }} }}')


def test_grn_elu_residual(tmp_path):
    model = load_from_text(net(_grn_layer("g", ["x"], 5, 4, 5, 1), inputs={"x": (3, 5)}), random_weights=True)
    blobs = _randomize(model, "g", 1)
    assert [b.shape for b in blobs] == [(4, 5), (4,), (5, 4), (5,), (5, 5), (5,), (5, 5), (5,)]
    x = rng(2).standard_normal((3, 5)).astype(f32)
    ref = grn(x.astype(np.float64), None, blobs, 5, 5, 1)
    check_everywhere(model, {"x": x}, {"y": ref.astype(f32)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_grn_skip_context_relu_axis2(tmp_path):
    text = net(_grn_layer("g", ["x", "c"], 4, 5, 6, 2, "context_dim: 7 activation: RELU"),
               inputs={"x": (2, 3, 4), "c": (2, 3, 7)})
    model = load_from_text(text, random_weights=True)
    blobs = _randomize(model, "g", 3)
    assert [b.shape for b in blobs][:5] == [(6, 4), (6,), (5, 4), (5,), (5, 7)]
    r = rng(4)
    x, c = r.standard_normal((2, 3, 4)).astype(f32), r.standard_normal((2, 3, 7)).astype(f32)
    ref = grn(x.astype(np.float64), c.astype(np.float64), blobs, 4, 6, 2, elu=False)
    check_everywhere(model, {"x": x, "c": c}, {"y": ref.astype(f32)}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("param, shape, eps", [("", (2, 3, 1, 1), 0.0),                    # FoodDist: no grn_param
                                               ("grn_param { bias: 0.5 }", (2, 3, 4, 5), 0.5),   # Intel's
                                               ("grn_param { bias: 0.5 dummy_backward: true }", (2, 3, 4, 5), 0.5)])
def test_other_grns_keep_their_reading(param, shape, eps):
    model = load_from_text(net(f'layer {{ name: "g" type: "GRN" bottom: "x" top: "y" {param} }}', inputs={"x": shape}))
    assert type(node_of(model, "g").spec).__name__ != "MyCaffeGRN"
    x = rng(5).standard_normal(shape).astype(f32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).sum(axis=1, keepdims=True) + eps)
    np.testing.assert_allclose(model.run({"x": x})["y"], ref, atol=1e-5, rtol=1e-5)


def test_grn_input_dim_mismatch_is_one_line():
    with pytest.raises(CaffeqError, match="grn_param.input_dim is 6"):
        load_from_text(net(_grn_layer("g", ["x"], 6, 4, 6, 1), inputs={"x": (3, 5)}), random_weights=True)


# ---- GateAddNorm ----------------------------------------------------------------------------------------------

def _gan(bottoms, offset, dim, bias=True, eps="1E-10"):
    bots = " ".join(f'bottom: "{b}"' for b in bottoms)
    return (f'layer {{ name: "g" type: "GateAddNorm" {bots} top: "y" dropout_param {{ dropout_ratio: 0.05 }} '
            f'layer_norm_param {{ epsilon: {eps} enable_cuda_impl: False }} gateaddnorm_param {{ residual_channel_offset: '
            f'{offset} }} glu_param {{ modulation: SIGMOID input_dim: {dim} bias_term: {bias} axis: 2 }} }}')


def test_gate_add_norm_residual_offset(tmp_path):
    model = load_from_text(net(_gan(["x", "r"], 4, 3), inputs={"x": (2, 2, 5), "r": (2, 6, 3)}), random_weights=True)
    blobs = _randomize(model, "g", 6)
    r_ = rng(7)
    x, res = r_.standard_normal((2, 2, 5)).astype(f32), r_.standard_normal((2, 6, 3)).astype(f32)
    # channel_copy of the last of C / (C - offset) = 3 blocks: channels 4 and 5
    ref = layer_norm(glu(x.astype(np.float64), blobs, 2) + res[:, 4:], 1e-10)
    check_everywhere(model, {"x": x, "r": res}, {"y": ref.astype(f32)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_gate_add_norm_passthrough(tmp_path):
    text = net(_gan(["x", "r"], 0, 3).replace("enable_cuda_impl: False", "enable_passthrough: True"),
               inputs={"x": (2, 4, 5), "r": (2, 4, 3)})
    model = load_from_text(text, random_weights=True)
    blobs = _randomize(model, "g", 21)
    r_ = rng(22)
    x, res = r_.standard_normal((2, 4, 5)).astype(f32), r_.standard_normal((2, 4, 3)).astype(f32)
    ref = glu(x.astype(np.float64), blobs, 2) + res      # LayerNormLayer's passthrough copies its bottom
    check_everywhere(model, {"x": x, "r": res}, {"y": ref.astype(f32)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_gate_add_norm_alone_without_bias(tmp_path):
    model = load_from_text(net(_gan(["x"], 0, 4, bias=False, eps="0.01"), inputs={"x": (3, 2, 5)}),
                           random_weights=True)
    blobs = _randomize(model, "g", 8)
    assert [b.shape for b in blobs] == [(4, 5), (4, 5)]
    x = rng(9).standard_normal((3, 2, 5)).astype(f32)
    ref = layer_norm(glu(x.astype(np.float64), blobs, 2, bias=False), 0.01)
    check_everywhere(model, {"x": x}, {"y": ref.astype(f32)}, tmp_path, atol=1e-5, rtol=1e-5)


# ---- VarSelNet ------------------------------------------------------------------------------------------------

def test_varselnet_with_context(tmp_path):
    n_in, d, hidden = 3, 5, 5
    text = net(f'layer {{ name: "v" type: "VarSelNet" bottom: "x" bottom: "c" top: "y" top: "w" varselnet_param {{ '
               f'input_dim: {d} hidden_dim: {hidden} num_inputs: {n_in} context_dim: 6 axis: 1 }} }}',
               inputs={"x": (7, n_in * d), "c": (7, 6)})
    model = load_from_text(text, random_weights=True)
    blobs = _randomize(model, "v", 10)
    r = rng(11)
    x, c = r.standard_normal((7, n_in * d)).astype(f32), r.standard_normal((7, 6)).astype(f32)
    x64 = x.astype(np.float64)
    nf = grn_blob_count(n_in * d, n_in, True)
    nv = grn_blob_count(d, hidden, False)
    sparse = grn(x64, c.astype(np.float64), blobs[:nf], n_in * d, n_in, 1)
    w = softmax(sparse, 1)
    out = sum(w[:, i:i + 1] * grn(x64[:, i * d:(i + 1) * d], None, blobs[nf + i * nv:nf + (i + 1) * nv], d, hidden, 1)
              for i in range(n_in))
    check_everywhere(model, {"x": x, "c": c}, {"y": out.astype(f32), "w": sparse.astype(f32)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_varselnet_input_dim_other_than_hidden_is_refused():
    text = net('layer { name: "v" type: "VarSelNet" bottom: "x" top: "y" varselnet_param { input_dim: 4 hidden_dim: 5 '
               'num_inputs: 2 } }', inputs={"x": (3, 8)})
    with pytest.raises(CaffeqError, match="input_dim 4 != hidden_dim 5"):
        load_from_text(text, random_weights=True)


# ---- ChannelEmbedding -----------------------------------------------------------------------------------------

def _emb(bottoms, n_num, n_cat, cards, state=3, bias=False):
    card = " ".join(f"cardinality: {c}" for c in cards)
    return (f'layer {{ name: "e" type: "ChannelEmbedding" bottom: "{bottoms[0]}" bottom: "{bottoms[1]}" top: "y" '
            f'categorical_trans_param {{ num_input: {n_cat} state_size: {state} {card} bias_term: {bias} }} '
            f'numeric_trans_param {{ num_input: {n_num} state_size: {state} }} }}')


def test_channel_embedding_temporal(tmp_path):
    model = load_from_text(net(_emb(["n", "c"], 2, 2, [4, 7], bias=True), inputs={"n": (2, 5, 2), "c": (2, 5, 2)}),
                           random_weights=True)
    blobs = _randomize(model, "e", 12)
    r = rng(13)
    num = r.standard_normal((2, 5, 2)).astype(f32)
    cat = np.stack([r.integers(0, 4, (2, 5)), r.integers(0, 7, (2, 5))], axis=2).astype(f32)
    parts = [num[..., i:i + 1].reshape(10, 1) @ blobs[2 * i].T + blobs[2 * i + 1] for i in range(2)]
    parts += [blobs[4 + 2 * i][cat[..., i].reshape(10).astype(int)] + blobs[5 + 2 * i] for i in range(2)]
    ref = np.stack(parts, axis=1).reshape(2, 5, 12)
    check_everywhere(model, {"n": num, "c": cat}, {"y": ref.astype(f32)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_channel_embedding_static_categorical_only(tmp_path):
    model = load_from_text(net(_emb(["n", "c"], 0, 1, [9], state=4), inputs={"n": (3, 2), "c": (3, 1)}),
                           random_weights=True)
    blobs = _randomize(model, "e", 14)
    cat = np.array([[8], [0], [5]], f32)
    num = rng(15).standard_normal((3, 2)).astype(f32)   # ignored: numeric num_input 0
    check_everywhere(model, {"n": num, "c": cat}, {"y": blobs[0][[8, 0, 5]].astype(f32)}, tmp_path, atol=1e-6)


def test_channel_embedding_numeric_strided(tmp_path):
    # 2 numeric inputs over 6 values a row: NumericTransformation's channel_copy gives input i the values i, i + 2, ...
    model = load_from_text(net(_emb(["n", "c"], 2, 0, []), inputs={"n": (2, 6), "c": (2, 1)}), random_weights=True)
    blobs = _randomize(model, "e", 23)
    assert [b.shape for b in blobs] == [(3, 3), (3,), (3, 3), (3,)]
    num = rng(24).standard_normal((2, 6)).astype(f32)
    flat = num.reshape(-1)
    parts = [np.array([[flat[(r * 3 + s) * 2 + i] for s in range(3)] for r in range(2)]) @ blobs[2 * i].T
             + blobs[2 * i + 1] for i in range(2)]
    ref = np.stack(parts, axis=1).reshape(2, 6)
    check_everywhere(model, {"n": num, "c": np.zeros((2, 1), f32)}, {"y": ref.astype(f32)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_channel_embedding_state_sizes_must_agree():
    text = net(_emb(["n", "c"], 0, 1, [4]).replace("numeric_trans_param { num_input: 0 state_size: 3",
                                                   "numeric_trans_param { num_input: 0 state_size: 2"),
               inputs={"n": (3, 2), "c": (3, 1)})
    with pytest.raises(CaffeqError, match="state_size 2 and categorical_trans_param.state_size 3 differ"):
        load_from_text(text, random_weights=True)


# ---- ReshapeTemporal ------------------------------------------------------------------------------------------

def test_reshape_temporal_before_grn_after(tmp_path):
    text = net('layer { name: "b" type: "ReshapeTemporal" bottom: "x" bottom: "c" top: "x1" top: "c1" '
               'reshape_temporal_param { mode: BEFORE forced_repeat_count: -1 } }',
               _grn_layer("g", ["x1", "c1"], 4, 3, 4, 1, "context_dim: 5").replace('top: "y"', 'top: "g1"'),
               'layer { name: "a" type: "ReshapeTemporal" bottom: "g1" top: "y" top: "clip" '
               'reshape_temporal_param { mode: AFTER enable_clip_output: True } }',
               inputs={"x": (2, 3, 4), "c": (2, 5)})
    model = load_from_text(text, random_weights=True)
    assert any("shape-only bottom" in w for w in model.warnings)
    blobs = _randomize(model, "g", 16)
    r = rng(17)
    x, c = r.standard_normal((2, 3, 4)).astype(f32), r.standard_normal((2, 5)).astype(f32)
    c1 = np.repeat(c[:, None, :], 3, axis=1).reshape(6, 5)      # replicate_along_time, then stacked
    ref = grn(x.reshape(6, 4).astype(np.float64), c1.astype(np.float64), blobs, 4, 4, 1).reshape(2, 3, 4)
    check_everywhere(model, {"x": x, "c": c}, {"y": ref.astype(f32), "clip": np.ones((2, 3), f32)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_reshape_temporal_forced_repeat(tmp_path):
    text = net('layer { name: "b" type: "ReshapeTemporal" bottom: "x" bottom: "c" top: "x1" top: "c1" '
               'reshape_temporal_param { mode: BEFORE forced_repeat_count: 2 } }',
               inputs={"x": (3, 2, 2, 2), "c": (3, 4)})
    model = load_from_text(text)
    r = rng(18)
    x, c = r.standard_normal((3, 2, 2, 2)).astype(f32), r.standard_normal((3, 4)).astype(f32)
    # forced: (R, N, C) with every r a copy of the context, then R x N rows
    check_everywhere(model, {"x": x, "c": c}, {"x1": x.reshape(6, 4), "c1": np.concatenate([c, c])}, tmp_path)


def test_reshape_temporal_forced_repeat_needs_the_samples():
    text = net('layer { name: "b" type: "ReshapeTemporal" bottom: "x" bottom: "c" top: "x1" top: "c1" '
               'reshape_temporal_param { mode: BEFORE forced_repeat_count: 2 } }',
               inputs={"x": (3, 2, 4), "c": (2, 4)})
    with pytest.raises(CaffeqError, match="needs a \\(3, C\\) context"):
        load_from_text(text)


def test_reshape_temporal_after_chained_before(tmp_path):
    # Setup copies bottom 0's blob parameters over the second BEFORE's own: the AFTER gets the first's N and T
    text = net('layer { name: "b1" type: "ReshapeTemporal" bottom: "x" top: "x1" reshape_temporal_param { mode: BEFORE } }',
               'layer { name: "b2" type: "ReshapeTemporal" bottom: "x1" top: "x2" reshape_temporal_param { mode: BEFORE } }',
               'layer { name: "a" type: "ReshapeTemporal" bottom: "x2" top: "y" reshape_temporal_param { mode: AFTER } }',
               inputs={"x": (2, 3, 5)})
    model = load_from_text(text)
    assert tuple(model.graph.tensors["x2"].shape) == (30, 1)
    x = rng(25).standard_normal((2, 3, 5)).astype(f32)
    check_everywhere(model, {"x": x}, {"y": x}, tmp_path)


def test_reshape_temporal_after_without_before_is_refused():
    text = net('layer { name: "a" type: "ReshapeTemporal" bottom: "x" top: "y" reshape_temporal_param { mode: AFTER } }',
               inputs={"x": (6, 4)})
    with pytest.raises(CaffeqError, match="no ReshapeTemporal BEFORE"):
        load_from_text(text)


# ---- MultiheadAttentionInterp ---------------------------------------------------------------------------------

def test_multihead_attention_interp(tmp_path):
    hist, fut, d, heads, k = 4, 2, 3, 2, 5
    text = net(f'layer {{ name: "m" type: "MultiheadAttentionInterp" bottom: "x" top: "o" top: "ao" top: "as" '
               f'multihead_attention_interp_param {{ enable_self_attention: True num_historical_steps: {hist} '
               f'num_future_steps: {fut} embed_dim: {d} num_heads: {heads} }} }}', inputs={"x": (2, hist + fut, k)})
    model = load_from_text(text, random_weights=True)
    b = _randomize(model, "m", 19)
    assert [x.shape for x in b] == [(6, 5), (6,), (6, 5), (6,), (3, 5), (3,), (3, 3), (3,)]
    x = rng(20).standard_normal((2, hist + fut, k)).astype(f32)
    x64 = x.astype(np.float64)
    q = ip(x64[:, hist:], b[0], b[1], 2).reshape(2, fut, heads, d).transpose(0, 2, 1, 3)
    kk = ip(x64, b[2], b[3], 2).reshape(2, hist + fut, heads, d).transpose(0, 2, 1, 3)
    v = ip(x64, b[4], b[5], 2)
    s = q @ kk.transpose(0, 1, 3, 2) / np.sqrt(d)
    for i in range(fut):
        for j in range(hist + fut):
            if j > hist and j - hist > i:      # generate_mask, then mask_batch to -1e29
                s[:, :, i, j] = -1e29
    a = softmax(s, -1)
    out = (a @ v[:, None]).mean(axis=1)
    refs = {"o": ip(out, b[6], b[7], 2), "ao": out, "as": a.mean(axis=1)}
    check_everywhere(model, {"x": x}, {n: r.astype(f32) for n, r in refs.items()}, tmp_path, atol=1e-5, rtol=1e-5)


def test_multihead_attention_interp_bad_steps():
    text = net('layer { name: "m" type: "MultiheadAttentionInterp" bottom: "x" top: "o" top: "ao" top: "as" '
               'multihead_attention_interp_param { num_historical_steps: 5 num_future_steps: 2 embed_dim: 3 '
               'num_heads: 1 } }', inputs={"x": (2, 7, 3)})
    with pytest.raises(CaffeqError, match="multiple"):
        load_from_text(text, random_weights=True)


# ---- Lstm, DataTemporal, the corpus files ---------------------------------------------------------------------

def test_lstm_is_sized_not_run():
    text = net('layer { name: "l" type: "Lstm" bottom: "x" bottom: "clip" bottom: "h" bottom: "c" top: "y" top: "hy" '
               'top: "cy" recurrent_param { engine: CUDNN num_output: 4 batch_first: True num_layers: 2 '
               'expose_hidden_input: True expose_hidden_output: True } }',
               inputs={"x": (2, 3, 5), "clip": (2, 3), "h": (2, 4), "c": (2, 4)})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "l")
    assert node.blobs[0].shape == (4 * 4 * 5 + 4 * 4 * 4 + 8 * 4 + 4 * 4 * 4 * 2 + 8 * 4, 1, 1)
    assert [tuple(model.graph.tensors[t].shape) for t in node.outputs] == [(2, 3, 4), (2, 2, 4, 1), (2, 2, 4, 1)]
    with pytest.raises(CaffeqError, match="cuDNN"):
        model.run({"x": np.zeros((2, 3, 5), f32), "clip": np.ones((2, 3), f32), "h": np.zeros((2, 4), f32),
                   "c": np.zeros((2, 4), f32)})


def test_data_temporal_shapes():
    text = ('layer { name: "data" type: "DataTemporal" top: "ns" top: "cs" top: "nh" top: "ch" top: "nf" top: "cf" '
            'top: "trg" top: "th" data_temporal_param { batch_size: 3 num_historical_steps: 6 num_future_steps: 2 '
            'source: "x" output_target_historical: True } }\n'
            + _emb(["ns", "cs"], 0, 1, [5]).replace('"e"', '"s"').replace('"y"', '"s1"')
            + _emb(["nh", "ch"], 2, 0, []).replace('"e"', '"h"').replace('"y"', '"h1"')
            + _emb(["nf", "cf"], 1, 1, [3]).replace('"e"', '"f"').replace('"y"', '"f1"'))
    model = load_from_text(text, random_weights=True)
    shapes = {t: tuple(model.graph.tensors[t].shape) for t in ("ns", "cs", "nh", "ch", "nf", "cf", "trg", "th")}
    assert shapes == {"ns": (3, 0), "cs": (3, 1), "nh": (3, 6, 2), "ch": (3, 6, 0), "nf": (3, 2, 1), "cf": (3, 2, 1),
                      "trg": (3, 2, 1), "th": (3, 6, 1)}


@pytest.mark.parametrize("path", FILES)
def test_corpus_tft_reads_up_to_the_lstm(path):
    model = load(path, random_weights=True)
    layers = {n.name: n for n in model.layers}
    assert layers["mh_attn"].type == "MultiheadAttentionInterp" and layers["past_lstm"].type == "Lstm"
    data = layers["data"].attrs
    assert tuple(model.graph.tensors["pred_quant"].shape) == (32, data["fut"], 3)
    part = load(path, random_weights=True, outputs=["lstm_input", "c_seq_hid", "c_enr"])
    feeds = {}
    for name in ("ns", "cs", "nh", "ch", "nf", "cf", "trg", "th"):
        shape = tuple(part.graph.tensors[name].shape)
        feeds[name] = np.zeros(shape, f32) if name in ("cs", "ch", "cf") else rng(1).standard_normal(shape).astype(f32)
    out = part.run(feeds)
    assert out["lstm_input"].shape == (32, data["hist"] + data["fut"], 160)
    assert np.isfinite(out["lstm_input"]).all() and np.isfinite(out["c_enr"]).all()
