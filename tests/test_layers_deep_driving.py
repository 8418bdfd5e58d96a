"""edz504/lstm_dd's layers (caffeq/layers/deep_driving.py) against formulas written here from its C++
(non_para_relu_sigmoid_layer.cpp, non_para_relu_sin_cos_layer.cpp, sigmoid_hist_layer.cpp, data_hist_layer.cpp
and the TORCS data layers' setup), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(F)


@pytest.mark.parametrize("shape, shared", [((2, 3, 4, 5), False), ((3, 7), False), ((2, 4, 3), True)])
def test_non_para_relu_sigmoid_matches_the_forks_formula(shape, shared, tmp_path):
    text = net('layer { name: "a" type: "NonParaReLUSigmoid" bottom: "x" top: "y" '
               f'nprelu_sigmoid_param {{ channel_shared: {str(shared).lower()} }} }}', inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "a")
    assert node.blobs[0].shape == (() if shared else (shape[1],))
    beta = rng(3).standard_normal(node.blobs[0].shape).astype(F)
    node.blobs[0] = beta
    x = rng(4).standard_normal(shape).astype(F)
    # top[i] = max(x_i, 0) + beta[(i / dim) % C] * 1 / (1 + exp(-x_i)), dim = count(2)
    b = beta if shared else beta.reshape((-1,) + (1,) * (len(shape) - 2))
    want = np.maximum(x, 0) + b * sigmoid(x)
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_non_para_relu_sin_cos_and_a_fresh_layer(tmp_path):
    shape = (2, 3, 4)
    model = load_from_text(net('layer { name: "a" type: "NonParaReLUSinCos" bottom: "x" top: "y" }',
                               inputs={"x": shape}), random_weights=True)
    node = next(n for n in model.layers if n.name == "a")
    x = rng(5).standard_normal(shape).astype(F)
    # the fork's constant filler starts both blobs at 0: a ReLU
    np.testing.assert_array_equal(model.run({"x": x})["y"], np.maximum(x, 0))
    s, c = rng(6).standard_normal((2, 3)).astype(F)
    node.blobs = [s, c]
    want = np.maximum(x, 0) + s[:, None] * np.sin(x) + c[:, None] * np.cos(x)
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path, atol=1e-6, rtol=1e-6)
    # a training file's random filler reads (trained weights replace it); without them the layer starts at 0
    drawn = load_from_text(net('layer { name: "a" type: "NonParaReLUSigmoid" bottom: "x" top: "y" '
                               'nprelu_sigmoid_param { filler { type: "gaussian" } } }', inputs={"x": shape}),
                           random_weights=True)
    np.testing.assert_array_equal(drawn.run({"x": x})["y"], np.maximum(x, 0) + np.float32(0) * sigmoid(x))


def test_run_net_frame_one_data_hist_feeds_back_zeros(tmp_path):
    # driving_run_lstm.prototxt's frame: DataLstmTest, the marker reshaped to (T, N), DataHist concatenated
    # to the features along axis 2, SigmoidHist at the end
    text = ('layer { name: "data" type: "DataLstmTest" top: "data" top: "marker" data_lstm_test_param { '
            'sequence_size: 2 mean_file: "mean.binaryproto" } }\n'
            'layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" pooling_param { pool: AVE '
            'global_pooling: true } }\n'
            'layer { name: "rf" type: "Reshape" bottom: "pool" top: "rf" reshape_param { shape { dim: 2 dim: 1 '
            'dim: 3 } } }\n'
            'layer { name: "rm" type: "Reshape" bottom: "marker" top: "rm" reshape_param { shape { dim: 2 '
            'dim: 1 } } }\n'
            'layer { name: "hist" type: "DataHist" bottom: "rm" top: "hist" }\n'
            'layer { name: "cat" type: "Concat" bottom: "rf" bottom: "hist" top: "cat" concat_param { axis: 2 } }\n'
            'layer { name: "fc" type: "InnerProduct" bottom: "cat" top: "fc" inner_product_param { num_output: 14 '
            'axis: 2 } }\n'
            'layer { name: "out" type: "SigmoidHist" bottom: "fc" top: "fc" }')
    model = load_from_text(text, random_weights=True, outputs=["fc", "hist"])
    assert model.inputs == {"data": (2, 3, 210, 280), "marker": (2, 1, 1, 1)}
    assert model.blob_shapes["hist"] == (2, 1, 14) and model.blob_shapes["cat"] == (2, 1, 17)
    x = rng(7).standard_normal((2, 3, 210, 280)).astype(F)
    fc = next(n for n in model.layers if n.name == "fc")
    w, b = (np.asarray(v, np.float64) for v in fc.blobs)
    features = x.astype(np.float64).mean(axis=(2, 3)).reshape(2, 1, 3)
    want = sigmoid(features @ w[:, :3].T + b)          # the hist columns hold zeros at the first frame
    f = {"data": x, "marker": np.ones((2, 1, 1, 1), F)}
    check_everywhere(model, f, {"fc": want, "hist": np.zeros((2, 1, 14), F)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_training_data_layers_give_the_forks_tops():
    text = ('layer { name: "data" type: "DataLstmTrainHist" top: "data" top: "label" top: "hist" top: "marker" '
            'data_lstm_train_hist_param { source: "train" sequence_size: 8 sequence_num: 16 interval: 200 } }\n'
            'layer { name: "s" type: "Silence" bottom: "label" bottom: "hist" bottom: "marker" }\n'
            'layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { pool: MAX kernel_size: 3 '
            'stride: 4 } }')
    model = load_from_text(text)
    assert model.blob_shapes["data"] == (128, 3, 210, 280)
    assert model.blob_shapes["label"] == model.blob_shapes["hist"] == (128, 1, 1, 14)
    assert model.blob_shapes["marker"] == (128, 1, 1, 1)
    with pytest.raises(LayerError, match="data_lstm_train_param.sequence_num must be >= 1, got 0"):
        load_from_text('layer { name: "data" type: "DataLstmTrain" top: "data" top: "label" top: "marker" '
                       'data_lstm_train_param { sequence_size: 20 } }')
