"""MyCaffe (MyCaffe/MyCaffe b8922aa, C#): its dialect of the text format (RUN phase, IMAGEDB, unquoted text values),
its RUN net (ProjectEx.CreateModelForRunning) and the layers its files use at TEST / RUN: the noisy InnerProduct
(InnerProductLayer.cs), Normalization2 (Normalization2Layer.cs), Decode (DecodeLayer.cs) and LstmAttention
(LSTMAttentionLayer.cs with math.cu's lstm_fwd kernels).  References written from those forwards in numpy, compared
in torch, onnxruntime and the generated model.py."""
import os

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.io.prototxt import read_prototxt
from caffeq.model import load, load_from_text

f32 = np.float32
RUN_MARK = 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "lbl" top: "loss" exclude { phase: RUN } }\n'


def _set(model, name, *blobs):
    node_of(model, name).blobs = [np.asarray(b, f32) for b in blobs]


# ---- noisy InnerProduct --------------------------------------------------------------------------------------

def test_noisy_inner_product_uses_weight_and_bias_only(tmp_path):
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 3 '
               'bias_term: True axis: 1 enable_noise: True sigma_init: 0.17 } }', inputs={"x": (2, 5, 3)})
    model = load_from_text(text, random_weights=True)
    assert [tuple(b.shape) for b in node_of(model, "ip").blobs] == [(3, 15), (3,), (3, 15), (3,)]
    r = rng(1)
    w, b = r.standard_normal((3, 15)).astype(f32), r.standard_normal(3).astype(f32)
    sw, sb = r.standard_normal((3, 15)).astype(f32), r.standard_normal(3).astype(f32)
    _set(model, "ip", w, b, sw, sb)
    x = r.standard_normal((2, 5, 3)).astype(f32)
    ref = (x.reshape(2, 15).astype(np.float64) @ w.T + b).astype(f32)   # TEST / RUN: no sigma * eps term
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_noisy_inner_product_initial_sigma():
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 4 '
               'enable_noise: True sigma_init: 0.5 } }', inputs={"x": (2, 9)})
    blobs = node_of(load_from_text(text, random_weights=True), "ip").blobs
    np.testing.assert_allclose(blobs[2], np.full((4, 9), 0.5 / 3, f32))   # sigma_init / sqrt(fan in)
    np.testing.assert_allclose(blobs[3], np.full(4, 0.5 / 2, f32))        # sigma_init / sqrt(num_output)


# ---- Normalization2 ------------------------------------------------------------------------------------------

def _norm_ref(x, scale, across, shared, eps):
    x64 = x.astype(np.float64)
    if across:
        norm = np.sqrt((x64 ** 2).reshape(len(x), -1).sum(1) + eps).reshape(-1, 1, 1, 1)
    else:
        norm = np.sqrt((x64 ** 2).sum(1, keepdims=True) + eps)
    s = scale.reshape(()) if shared else scale.reshape(1, -1, 1, 1)
    return (x64 / norm * s).astype(f32)


@pytest.mark.parametrize("across,shared", [(False, False), (True, True), (False, True)])
def test_normalization2(tmp_path, across, shared):
    text = net(f'layer {{ name: "n" type: "Normalization2" bottom: "x" top: "y" normalization2_param {{ '
               f'across_spatial: {across} channel_shared: {shared} esp: 1E-10 eps: 0.01 '
               f'scale_filler {{ type: "constant" value: 20 }} }} }}', inputs={"x": (2, 3, 5, 4)})
    model = load_from_text(text, random_weights=True)
    r = rng(2)
    scale = r.uniform(1, 3, () if shared else (3,)).astype(f32)
    _set(model, "n", scale)
    x = r.standard_normal((2, 3, 5, 4)).astype(f32)
    check_everywhere(model, {"x": x}, {"y": _norm_ref(x, scale, across, shared, 0.01)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_normalization2_fills_scale_from_filler():
    text = net('layer { name: "n" type: "Normalization2" bottom: "x" top: "y" normalization2_param { '
               'across_spatial: False channel_shared: False scale_filler { type: "constant" value: 20 } } }',
               inputs={"x": (1, 3, 2, 2)})
    np.testing.assert_array_equal(node_of(load_from_text(text, random_weights=True), "n").blobs[0], np.full(3, 20, f32))


# ---- Decode --------------------------------------------------------------------------------------------------

DECODE = ('layer { name: "d" type: "Decode" bottom: "fa" bottom: "lbl" top: "y" decode_param { '
          'centroid_output_iteration: 100 enable_centroid_update: True cache_size: 100 target: CENTROID '
          'pregen_label_count: 5 k: 5 IGNORE } }\n')


def _decode_ref(x, centroids, ignore):
    flat = x.reshape(len(x), -1).astype(np.float64)
    c = centroids.reshape(len(centroids), -1).astype(np.float64)
    d = ((flat[:, None, :] - c[None]) ** 2).sum(2).astype(f32)
    d[:, ignore] = np.finfo(f32).max
    return d.reshape(len(x), len(c), 1, 1)


@pytest.mark.parametrize("ignore", [[], [2]])
def test_decode_centroid_distances(tmp_path, ignore):
    text = net(DECODE.replace("IGNORE", " ".join(f"ignore_labels: {i}" for i in ignore)),
               RUN_MARK.replace('"y"', '"fa"'), inputs={"fa": (3, 2, 3), "lbl": (3,)})
    model = load_from_text(text, random_weights=True)
    assert list(node_of(model, "d").inputs) == ["fa"]   # RUN: the labels bottom is dropped
    r = rng(3)
    centroids = r.standard_normal((5, 6, 1, 1)).astype(f32)
    _set(model, "d", centroids, np.ones((5, 1, 1, 1)), np.zeros((5, 1, 1, 1)))
    x = r.standard_normal((3, 2, 3)).astype(f32)
    feeds = {"fa": x, "lbl": np.zeros(3, f32)}
    check_everywhere(model, feeds, {"y": _decode_ref(x, centroids, ignore)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_decode_refuses_knn_and_unknown_label_count():
    base = net(DECODE.replace("IGNORE", ""), RUN_MARK, inputs={"fa": (3, 6), "lbl": (3,)})
    with pytest.raises(CaffeqError, match="target KNN"):
        load_from_text(base.replace("target: CENTROID", "target: KNN"), random_weights=True)
    with pytest.raises(CaffeqError, match="pregen_label_count must give the label count"):
        load_from_text(base.replace("pregen_label_count: 5", ""), random_weights=True)


# ---- LstmAttention -------------------------------------------------------------------------------------------

def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _lstm_ref(x, clip, wi, wh, b):
    steps, batch = x.shape[:2]
    hidden = wh.shape[1]
    if clip is None:
        clip = np.repeat((np.arange(steps) > 0).astype(np.float64)[:, None], batch, 1)
    clip = clip.reshape(steps, batch).astype(np.float64)
    pre = x.reshape(steps, batch, -1).astype(np.float64) @ wi.T.astype(np.float64) + b
    h, c = np.zeros((batch, hidden)), np.zeros((batch, hidden))
    top = np.zeros((steps, batch, hidden))
    max_t = steps
    if clip.size > 1:   # calculate_maxT
        max_t = int(clip.sum(0).max()) + (1 if clip[0, 0] == 0 else 0)
    for t in range(min(max_t, steps)):
        g = pre[t] + clip[t][:, None] * (h @ wh.T.astype(np.float64))
        i, f, o = _sigmoid(g[:, :hidden]), _sigmoid(g[:, hidden:2 * hidden]), _sigmoid(g[:, 2 * hidden:3 * hidden])
        gg = np.tanh(g[:, 3 * hidden:])
        c = clip[t][:, None] * f * c + i * gg
        h = o * np.tanh(c)
        top[t] = h
    return top.astype(f32)


LSTM = ('layer { name: "l" type: "LstmAttention" BOTTOMS top: "y" lstm_attention_param { num_output: 4 '
        'weight_filler { type: "uniform" min: -0.01 max: 0.01 } bias_filler { type: "constant" value: 0 } } }\n')


@pytest.mark.parametrize("clip", [
    np.array([[0, 0], [1, 1], [1, 0], [1, 1], [1, 1]]),   # a new sequence in item 1 at t = 2
    np.array([[0, 0], [1, 1], [0, 0], [0, 0], [0, 0]]),   # maxT = 2: the last 3 steps never run
    None])                                                # no clip bottom: clip_t = (t > 0)
def test_lstm_attention(tmp_path, clip):
    bottoms = 'bottom: "x" bottom: "clip"' if clip is not None else 'bottom: "x"'
    inputs = {"x": (5, 2, 3, 1)} | ({"clip": (5, 2)} if clip is not None else {})
    model = load_from_text(net(LSTM.replace("BOTTOMS", bottoms), RUN_MARK, inputs=inputs), random_weights=True)
    r = rng(4)
    wi, wh, b = (r.standard_normal(s).astype(f32) * f32(0.7) for s in ((16, 3), (16, 4), (16,)))
    _set(model, "l", wi, wh, b)
    x = r.standard_normal((5, 2, 3, 1)).astype(f32)
    feeds = {"x": x} | ({"clip": clip.astype(f32)} if clip is not None else {})
    check_everywhere(model, feeds, {"y": _lstm_ref(x, clip, wi, wh, b)}, tmp_path, atol=2e-6, rtol=1e-5)


def test_lstm_attention_bad_parameters():
    text = net(LSTM.replace("BOTTOMS", 'bottom: "x" bottom: "clip"'), RUN_MARK, inputs={"x": (5, 2, 3), "clip": (5, 2)})
    with pytest.raises(CaffeqError, match="lstm_attention_param.num_output is required"):
        load_from_text(text.replace("num_output: 4", ""), random_weights=True)
    model = load_from_text(text.replace("num_output: 4", "num_output: 4 enable_attention: True"), random_weights=True)
    with pytest.raises(CaffeqError, match=r"layer 'l' \(LstmAttention\): enable_attention .* not run by caffeq"):
        model.run({"x": np.zeros((5, 2, 3), f32), "clip": np.ones((5, 2), f32)})


# ---- the dialect and the RUN net -----------------------------------------------------------------------------

RUN_NET = r'''name: "TripletNet"
layer { name: "data" type: "Data" top: "data1" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 use_imagedb_mean: True color_order: RGB }
  data_param { source: MNIST.training batch_size: 4 backend: IMAGEDB enable_random_selection: True } }
layer { name: "data" type: "Data" top: "data1" top: "label" include { phase: TEST }
  data_param { source: C:\ProgramData\MyCaffe\mnist.testing batch_size: 4 backend: IMAGEDB } }
layer { name: "seq" type: "DataSequence" bottom: "data1" bottom: "label" top: "data" top: "lbl" exclude { phase: RUN }
  data_sequence_param { cache_size: 64 k: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "fa" freeze_learning: True
  inner_product_param { num_output: 3 bias_term: True } }
layer { name: "only_run" type: "ReLU" bottom: "fa" top: "r" include { phase: RUN } }
layer { name: "acc" type: "AccuracyDecode" bottom: "r" bottom: "lbl" top: "acc" include { phase: TEST } }
'''


def test_run_net_dialect(tmp_path):
    path = tmp_path / "mycaffe.prototxt"
    path.write_text(RUN_NET)
    warnings = []
    parsed = read_prototxt(str(path), warnings=warnings)
    assert parsed.layer[1].data_param.source == r"C:\ProgramData\MyCaffe\mnist.testing"
    assert parsed.layer[0].data_param.source == "MNIST.training"
    assert any("MyCaffe (MyCaffe/MyCaffe, C#) model file" in w for w in warnings)
    model = load(str(path), random_weights=True, input_shapes={"data1": (2, 1, 3, 2)})
    assert [n.name for n in model.layers] == ["data", "ip", "only_run"]
    assert list(node_of(model, "ip").inputs) == ["data1"]   # the first layer's bottom named after the input
    x = rng(5).standard_normal((2, 1, 3, 2)).astype(f32)
    w, b = node_of(model, "ip").blobs
    out = model.run({"data1": x, "label": np.zeros(model.graph.tensors["label"].shape, f32)})
    ref = np.maximum(x.reshape(2, 6).astype(np.float64) @ w.T.astype(np.float64) + b, 0).astype(f32)
    np.testing.assert_allclose(out["r"], ref, atol=1e-6, rtol=1e-6)


def test_other_files_keep_their_reading(tmp_path):
    path = tmp_path / "plain.prototxt"
    path.write_text('layer { name: "d" type: "Data" top: "x" data_param { source: C:\\db batch_size: 2 } }')
    with pytest.raises(CaffeqError):
        read_prototxt(str(path))


# ---- the corpus files ----------------------------------------------------------------------------------------

CORPUS = [("/work/corpus91a/MyCaffe__MyCaffe__MyCaffe.app__Resources__triplet_train_val.prototxt", {"data1": (1, 1, 28, 28)},
           {"decode1": (1, 10, 1, 1)}),
          ("/work/corpus91a/MyCaffe__MyCaffe__MyCaffe.test__test_data__models__rnn__char_rnn__lstm_attention__train_val"
           ".prototxt", None, {"ip1": (75, 128)}),
          ("/work/corpus91d/MyCaffe__MyCaffe__MyCaffe.test__test_data__models__reinforcement__cartpole.noisy.dqn__"
           "train_val.prototxt", None, {"logits": (32, 2)})]


@pytest.mark.parametrize("path,shapes,tops", CORPUS)
def test_corpus_files_run(path, shapes, tops):
    if not os.path.exists(path):
        pytest.skip("corpus file not here")
    model = load(path, random_weights=True, input_shapes=shapes)
    feeds = {name: np.zeros(model.graph.tensors[name].shape, f32) for name in model.inputs}
    out = model.run(feeds)
    for top, shape in tops.items():
        assert out[top].shape == shape and np.isfinite(out[top]).all()
