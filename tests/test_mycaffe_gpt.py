"""MyCaffe's minGPT layers (MyCaffe/MyCaffe b8922aa, C#): LayerNorm (LayerNormLayer.cs), TransformerBlock
(TransformerBlockLayer.cs with CausalSelfAttentionLayer.cs and math.cu's gelu kernels), TokenizedData
(TokenizedDataLayer.cs) and Eltwise's allow_single_batch_input (EltwiseLayer.cs).  References written from the
C# forwards in numpy (float64), compared in torch, onnxruntime and the generated model.py."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

f32 = np.float32
CORPUS = str(REPO / "tests" / "fixtures" / "realworld" / "MyCaffe__MyCaffe__MyCaffe.test__test_data__models__gpt-mini__gpt-mini.prototxt")


# ---- numpy references from the C# -----------------------------------------------------------------------------

def ln_ref(x, eps=1e-10):
    """LayerNormLayer.forward_local: per (n, c) over count(2) (over the channels for 2 axes); no gain or bias."""
    x64 = x.astype(np.float64)
    rows = x64.reshape(len(x), -1) if x.ndim == 2 else x64.reshape(x.shape[0], x.shape[1], -1)
    mu = rows.mean(-1, keepdims=True)
    var = ((rows - mu) ** 2).mean(-1, keepdims=True)
    return ((rows - mu) / np.sqrt(var + eps)).reshape(x.shape)


def act_ref(x, activation):
    if activation == "GELU":   # gelu_fwd_kernel: x * 0.5 (1 + erf(x / sqrt 2))
        return x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    if activation == "GELU_BERT":   # gelu_fwd_kernel_bert: the tanh form
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    if activation == "SILU":
        return x / (1 + np.exp(-x))
    return np.maximum(x, 0)


def csa_ref(x, w_attn, b_attn, w_proj, b_proj, heads):
    """CausalSelfAttentionLayer.forward without the cuDNN path: loops over batch and heads."""
    b, t, c = x.shape
    hs = c // heads
    qkv = x @ w_attn.T + (0 if b_attn is None else b_attn)
    y = np.zeros((b, t, c))
    for n in range(b):
        for h in range(heads):
            q = qkv[n, :, h * hs:(h + 1) * hs]
            k = qkv[n, :, c + h * hs:c + (h + 1) * hs]
            v = qkv[n, :, 2 * c + h * hs:2 * c + (h + 1) * hs]
            att = (q @ k.T) * (1.0 / math.sqrt(hs))
            for i in range(t):
                att[i, i + 1:] = -1e29   # the mask is 0 above the diagonal
            att = np.exp(att - att.max(1, keepdims=True))
            att /= att.sum(1, keepdims=True)
            y[n, :, h * hs:(h + 1) * hs] = att @ v
    return y @ w_proj.T + (0 if b_proj is None else b_proj)


def block_ref(x, blobs, heads, activation):
    blobs = [b.astype(np.float64) for b in blobs]
    if len(blobs) == 8:
        wa, ba, wc, bc, wf, bf, wp, bp = blobs
    else:
        (wa, wc, wf, wp), ba, bc, bf, bp = blobs, None, None, None, None
    x = x.astype(np.float64)
    xb = x + csa_ref(ln_ref(x), wa, ba, wc, bc, heads)
    h = act_ref(ln_ref(xb) @ wf.T + (0 if bf is None else bf), activation)
    return xb + h @ wp.T + (0 if bp is None else bp)


def _blobs(model, name, scale=0.3, seed=3):
    r = rng(seed)
    node = node_of(model, name)
    node.blobs = [(r.standard_normal(b.shape) * scale).astype(f32) for b in node.blobs]
    return node.blobs


# ---- LayerNorm ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,param", [((2, 5, 7), ""), ((2, 3, 4, 5), ""), ((3, 7), ""),
                                         ((2, 5, 7), "layer_norm_param { epsilon: 0.001 }")])
def test_layer_norm(tmp_path, shape, param):
    text = net(f'layer {{ name: "ln" type: "LayerNorm" bottom: "x" top: "y" {param} }}', inputs={"x": shape})
    model = load_from_text(text)
    x = (rng(1).standard_normal(shape) * 3 + 1).astype(f32)
    ref = ln_ref(x, 1e-3 if param else 1e-10).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=1e-5)


def test_layer_norm_passthrough_and_bad_epsilon():
    text = net('layer { name: "ln" type: "LayerNorm" bottom: "x" top: "y" layer_norm_param { enable_passthrough: '
               'True } }', inputs={"x": (2, 3, 4)})
    x = rng(0).standard_normal((2, 3, 4)).astype(f32)
    np.testing.assert_array_equal(load_from_text(text).run({"x": x})["y"], x)
    bad = net('layer { name: "ln" type: "LayerNorm" bottom: "x" top: "y" layer_norm_param { epsilon: -1 } }',
              inputs={"x": (2, 3, 4)})
    with pytest.raises(CaffeqError, match="layer_norm_param.epsilon must be >= 0"):
        load_from_text(bad)


# ---- TransformerBlock -----------------------------------------------------------------------------------------

def _block_text(params, shape=(2, 5, 12)):
    return net(f'layer {{ name: "tfb" type: "TransformerBlock" bottom: "x" top: "y" transformer_block_param {{ '
               f'{params} }} }}', inputs={"x": shape})


@pytest.mark.parametrize("activation", ["RELU", "GELU", "GELU_BERT", "SILU"])
def test_transformer_block(tmp_path, activation):
    text = _block_text(f"layers: 2 heads: 3 embed: 12 block_size: 8 attn_dropout: 0.1 resid_dropout: 0.1 "
                       f"activation: {activation}")
    model = load_from_text(text, random_weights=True)
    blobs = _blobs(model, "tfb")
    assert [tuple(b.shape) for b in blobs] == [(36, 12), (36,), (12, 12), (12,), (48, 12), (48,), (12, 48), (12,)]
    x = rng(4).standard_normal((2, 5, 12)).astype(f32)
    ref = block_ref(x, blobs, 3, activation).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-4, rtol=1e-4)


def test_transformer_block_without_bias_hidden_dim(tmp_path):
    text = _block_text("heads: 2 embed: 6 hidden_dim: 10 bias_term: False", shape=(2, 7, 6))
    model = load_from_text(text, random_weights=True)
    blobs = _blobs(model, "tfb", seed=5)
    assert [tuple(b.shape) for b in blobs] == [(18, 6), (6, 6), (10, 6), (6, 10)]
    x = rng(6).standard_normal((2, 7, 6)).astype(f32)
    check_everywhere(model, {"x": x}, {"y": block_ref(x, blobs, 2, "RELU").astype(f32)}, tmp_path,
                     atol=1e-4, rtol=1e-4)


def test_transformer_block_layer_norm_epsilon(tmp_path):
    # LayerNorm is scale-free but for its epsilon: on inputs of variance ~1e-8 the blocks' 1e-10 shows
    model = load_from_text(_block_text("heads: 3 embed: 12", shape=(2, 5, 12)), random_weights=True)
    blobs = _blobs(model, "tfb", seed=12)
    x = (rng(13).standard_normal((2, 5, 12)) * 1e-4).astype(f32)
    check_everywhere(model, {"x": x}, {"y": block_ref(x, blobs, 3, "RELU").astype(f32)}, tmp_path,
                     atol=1e-4, rtol=1e-4)


def test_transformer_block_mask_value(tmp_path):
    # q . k = -1e6 for every pair (biases only), so the scores are far below any small mask value: only a mask
    # as low as CausalSelfAttentionLayer.cs's -1e29 leaves the positions after i out (y_i = mean of v_0 .. v_i)
    model = load_from_text(_block_text("heads: 2 embed: 6", shape=(2, 5, 6)), random_weights=True)
    blobs = _blobs(model, "tfb", seed=14)
    blobs[0][:] = 0
    blobs[0][12:] = np.eye(6, dtype=f32)           # v = ln1(x)
    blobs[1][:] = 0
    blobs[1][[0, 3]] = 1000.0                      # q, per head (1000, 0, 0)
    blobs[1][[6, 9]] = -1000.0                     # k, per head (-1000, 0, 0)
    x = rng(15).standard_normal((2, 5, 6)).astype(f32)
    ref = block_ref(x, blobs, 2, "RELU")
    v = ln_ref(x)
    causal_mean = np.cumsum(v, axis=1) / np.arange(1, 6)[None, :, None]
    np.testing.assert_allclose(csa_ref(v, *(b.astype(np.float64) for b in blobs[:4]), 2),
                               causal_mean @ blobs[2].T.astype(np.float64) + blobs[3], rtol=1e-9, atol=1e-9)
    check_everywhere(model, {"x": x}, {"y": ref.astype(f32)}, tmp_path, atol=1e-4, rtol=1e-4)


def test_transformer_block_is_causal():
    model = load_from_text(_block_text("heads: 3 embed: 12", shape=(1, 6, 12)), random_weights=True)
    _blobs(model, "tfb")
    x = rng(7).standard_normal((1, 6, 12)).astype(f32)
    later = x.copy()
    later[:, 4:] += 1.0
    a, b = model.run({"x": x})["y"], model.run({"x": later})["y"]
    np.testing.assert_array_equal(a[:, :4], b[:, :4])   # a position sees only those before it
    assert not np.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("params,message", [
    ("heads: 5 embed: 12", "embed 12 must be divisible by heads 5"),
    ("heads: 3 embed: 12 block_type: ENCODER", "block_type ENCODER is not run"),
    ("heads: 3 embed: 12 normaliation: RMS_NORM", "normaliation RMS_NORM"),
])
def test_transformer_block_bad_parameters(params, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(_block_text(params), random_weights=True)


def test_transformer_block_needs_embed_wide_input():
    with pytest.raises(CaffeqError, match=r"needs a \(B, T, 12\) bottom"):
        load_from_text(_block_text("heads: 3 embed: 12", shape=(2, 5, 10)), random_weights=True)


# ---- Eltwise allow_single_batch_input ---------------------------------------------------------------------------

@pytest.mark.parametrize("op,batch,second", [("SUM", 3, (1, 5, 6)), ("PROD", 3, (1, 30)), ("MAX", 1, (1, 30))])
def test_eltwise_single_batch_input(tmp_path, op, batch, second):
    text = net(f'layer {{ name: "e" type: "Eltwise" bottom: "a" bottom: "b" top: "y" eltwise_param {{ operation: {op} '
               f'allow_single_batch_input: True }} }}', inputs={"a": (batch, 5, 6), "b": second})
    model = load_from_text(text)
    r = rng(8)
    a, b = r.standard_normal((batch, 5, 6)).astype(f32), r.standard_normal(second).astype(f32)
    copies = np.broadcast_to(b.reshape(1, 5, 6), (batch, 5, 6))   # channel_copyall: b to every batch item
    ref = {"SUM": a + copies, "PROD": a * copies, "MAX": np.maximum(a, copies)}[op]
    check_everywhere(model, {"a": a, "b": b}, {"y": ref}, tmp_path)


def test_eltwise_single_batch_input_checks():
    text = net('layer { name: "e" type: "Eltwise" bottom: "a" bottom: "b" top: "y" eltwise_param { '
               'allow_single_batch_input: True } }', inputs={"a": (3, 5, 6), "b": (2, 5, 6)})
    with pytest.raises(CaffeqError, match="allow_single_batch_input needs batch 1"):
        load_from_text(text)
    three = net('layer { name: "e" type: "Eltwise" bottom: "a" bottom: "b" bottom: "a" top: "y" eltwise_param { '
                'allow_single_batch_input: True } }', inputs={"a": (3, 5, 6), "b": (1, 5, 6)})
    with pytest.raises(CaffeqError, match="exactly two bottoms"):
        load_from_text(three)
    # MyCaffe's MAX forward reads bottom 1 itself (not its copies): past its end for a batch over 1
    big_max = net('layer { name: "e" type: "Eltwise" bottom: "a" bottom: "b" top: "y" eltwise_param { operation: MAX '
                  'allow_single_batch_input: True } }', inputs={"a": (3, 5, 6), "b": (1, 5, 6)})
    with pytest.raises(CaffeqError, match="MyCaffe's MAX reads bottom 1 past its end"):
        load_from_text(big_max)
    # without the flag the shapes must agree, as before (EltwiseLayer.cs CHECKs them too)
    plain = net('layer { name: "e" type: "Eltwise" bottom: "a" bottom: "b" top: "y" }',
                inputs={"a": (3, 5, 6), "b": (1, 5, 6)})
    with pytest.raises(CaffeqError, match="Eltwise needs equal shapes"):
        load_from_text(plain)


# ---- TokenizedData and a small GPT ------------------------------------------------------------------------------

GPT = '''name: "gpt"
layer { name: "tok" type: "TokenizedData" top: "tokdata" top: "pos" top: "tgt"
        tokenized_data_param { input_type: TEXT_FILE source: "$ProgramData$\\\\input.txt" batch_size: 2 block_size: 7 } }
layer { name: "wte" type: "Embed" bottom: "tokdata" top: "tok_emb" embed_param { num_output: 6 input_dim: 11 bias_term: False } }
layer { name: "wpe" type: "Embed" bottom: "pos" top: "pos_emb" embed_param { num_output: 6 input_dim: 7 bias_term: False } }
layer { name: "sum" type: "Eltwise" bottom: "tok_emb" bottom: "pos_emb" top: "x" eltwise_param { operation: SUM allow_single_batch_input: True } }
layer { name: "drop" type: "Dropout" bottom: "x" top: "x" dropout_param { dropout_ratio: 0.1 } }
layer { name: "tfb" type: "TransformerBlock" bottom: "x" top: "tfb" transformer_block_param { heads: 2 embed: 6 activation: GELU } }
layer { name: "ln" type: "LayerNorm" bottom: "tfb" top: "ln" }
layer { name: "head" type: "InnerProduct" bottom: "ln" top: "logits" inner_product_param { num_output: 11 bias_term: False axis: 2 } }
layer { name: "loss" type: "SoftmaxCrossEntropy2Loss" bottom: "logits" bottom: "tgt" top: "loss" softmax_param { axis: 2 } }
'''


def _gpt_ref(model, ids):
    wte, wpe = (node_of(model, n).blobs[0].astype(np.float64) for n in ("wte", "wpe"))
    steps = ids.shape[1]
    x = wte[ids.astype(int)] + wpe[np.arange(steps)][None]   # positions 0 .. T - 1, copied to every batch item
    y = ln_ref(block_ref(x, node_of(model, "tfb").blobs, 2, "GELU"))
    return (y @ node_of(model, "head").blobs[0].astype(np.float64).T).astype(f32)


def test_tokenized_data_gpt(tmp_path):
    model = load_from_text(GPT, random_weights=True, outputs=["logits"])
    assert model.inputs == {"tokdata": (2, 7)}
    ids = rng(9).integers(0, 11, (2, 7)).astype(f32)
    check_everywhere(model, {"tokdata": ids}, {"logits": _gpt_ref(model, ids)}, tmp_path, atol=1e-4, rtol=1e-4)


def test_tokenized_data_shorter_input_and_targets(tmp_path):
    model = load_from_text(GPT, random_weights=True, outputs=["logits"], input_shapes={"tokdata": (3, 4)})
    ids = rng(10).integers(0, 11, (3, 4)).astype(f32)
    check_everywhere(model, {"tokdata": ids}, {"logits": _gpt_ref(model, ids)}, tmp_path, atol=1e-4, rtol=1e-4)
    full = load_from_text(GPT, random_weights=True)
    assert full.inputs == {"tokdata": (2, 7), "tgt": (2, 7)}
    with pytest.raises(CaffeqError, match="exceed tokenized_data_param.block_size 7"):
        load_from_text(GPT, random_weights=True, outputs=["logits"], input_shapes={"tokdata": (2, 9)})


def test_gpt_mini_corpus_file(tmp_path):
    model = load(CORPUS, random_weights=True, outputs=["logits"], input_shapes={"tokdata": (1, 16)})
    assert model.graph.tensors["logits"].shape == (1, 16, 65)
    assert [n.type for n in model.layers].count("TransformerBlock") == 6
    ids = rng(11).integers(0, 65, (1, 16)).astype(f32)
    out = model.run({"tokdata": ids})["logits"]
    assert out.shape == (1, 16, 65) and np.isfinite(out).all()
