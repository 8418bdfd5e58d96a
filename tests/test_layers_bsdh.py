"""ruixuejianfei/BitScalableDeepHash's V0 nets (its bundled 2013 Caffe): the V0 upgrade of its data layer,
its sigmoid (sigmoid_layer.cpp: 2. / (1. + exp(-sigm * x)) - 1.) and elewise_product (elewise_product.cpp:
top[n][k] = x[n][k] * w[k], the bias never added); references written from those forwards, compared in torch,
onnxruntime and the generated model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32

# prototxt/triplet/triplet_test_query.prototxt, trimmed to its data layer and head
NET = '''layers { layer { name: "data" type: "data" source: "../dataset/mnist/test_800"
    img_files: "../dataset/mnist/test_800.txt" cropsize: 1 cropsize_h: 6 cropsize_w: 5 class_per_iter: 10
    triplet_per_class: 10000 batch_iter: 2 batchsize: 4 mirror: false scale: 0.1 }
  top: "data" top: "l_matrix" }
layers { layer { name: "fc" type: "innerproduct" num_output: 8 } bottom: "data" top: "fc" }
layers { layer { name: "sigmoid" type: "sigmoid" SIGM } bottom: "fc" top: "sigmoid" }
layers { layer { name: "weight_hash" type: "elewise_product" num_output: 8
    weight_filler { type: "constant" value: 1 } } bottom: "sigmoid" top: "weight_hash" }
layers { layer { name: "loss_triplet" type: "euclidean_triplet_loss" loss_threshold: -8.0 laplacian_beta: 0.005 }
  bottom: "weight_hash" bottom: "l_matrix" }
'''


def sigmoid_ref(x, s):
    t = (x * f32(-s)).astype(f32)
    return (2.0 / (1.0 + np.exp(t.astype(np.float64))) - 1.0).astype(f32)


@pytest.mark.parametrize("sigm, slope", [("", 5.0), ("sigm_para: 2.5", 2.5)])
def test_bsdh_net(sigm, slope, tmp_path):
    model = load_from_text(NET.replace("SIGM", sigm), random_weights=True)
    types = {n.name: n.type for n in model.layers}
    assert (types["data"], types["sigmoid"], types["weight_hash"]) == ("BsdhTripletData", "BsdhSigmoid",
                                                                       "ElewiseProduct")
    assert "loss_triplet" not in types                          # the triplet loss only trains
    assert model.inputs == {"data": (4, 3, 6, 5), "l_matrix": (1, 1, 4, 4)}
    r = rng(91)
    weight = r.standard_normal((1, 1, 1, 8)).astype(f32)
    node_of(model, "weight_hash").blobs = [weight, r.standard_normal((1, 1, 1, 8)).astype(f32)]
    model.clear_cache()
    fc_w, fc_b = node_of(model, "fc").blobs
    x = r.standard_normal((4, 3, 6, 5)).astype(f32)
    fc = (x.reshape(4, -1).astype(np.float64) @ fc_w.reshape(8, -1).T + fc_b.ravel()).astype(f32)
    hashed = sigmoid_ref(fc, slope) * weight.reshape(8)        # the bias blob is never added
    got = model.run({"data": x, "l_matrix": np.zeros((1, 1, 4, 4), f32)})
    np.testing.assert_allclose(got["weight_hash"].reshape(4, 8), hashed, atol=1e-5)


def test_bsdh_sigmoid_and_product_everywhere(tmp_path):
    model = load_from_text(NET.replace("SIGM", "sigm_para: 3"), random_weights=True,
                           outputs=["sigmoid", "weight_hash"])
    x = rng(92).standard_normal((4, 3, 6, 5)).astype(f32) * 4
    feeds = {"data": x, "l_matrix": np.zeros((1, 1, 4, 4), f32)}
    fc_w, fc_b = node_of(model, "fc").blobs
    weight = node_of(model, "weight_hash").blobs[0]
    fc = (x.reshape(4, -1).astype(np.float64) @ fc_w.reshape(8, -1).T + fc_b.ravel()).astype(f32)
    sig = sigmoid_ref(fc, 3.0)
    check_everywhere(model, feeds, {"sigmoid": sig, "weight_hash": (sig * weight.reshape(8)).reshape(4, 8, 1, 1)},
                     tmp_path, atol=1e-5)


def test_plain_v0_sigmoid_stays_the_logistic():
    text = ('input: "x" input_dim: 1 input_dim: 2 input_dim: 1 input_dim: 1\n'
            'layers { layer { name: "s" type: "sigmoid" } bottom: "x" top: "y" }')
    assert [n.type for n in load_from_text(text).layers if n.name == "s"] == ["Sigmoid"]


def test_elewise_product_needs_num_output_to_match():
    with pytest.raises(LayerError, match="must equal the bottom's values per item, 8"):
        load_from_text(NET.replace("SIGM", "").replace('type: "elewise_product" num_output: 8',
                                                         'type: "elewise_product" num_output: 6'))


def test_cropsize_zero_takes_the_first_images_size():
    # data_layer.cpp: cropsize is a flag; without it the top is the first image's size, cropsize_h/w unread
    model = load_from_text(NET.replace("SIGM", "").replace("cropsize: 1", "cropsize: 0"), unknown_shapes_ok=True)
    assert model.inputs["data"] is None
    assert any("first image's size" in w for w in model.warnings)


def test_the_forks_conv_has_no_pad():
    text = NET.replace("SIGM", "").replace('layers { layer { name: "fc" type: "innerproduct" num_output: 8 }',
                                           'layers { layer { name: "fc" type: "conv" num_output: 4 kernelsize: 5 '
                                           'pad: 2 }')
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["fc"] == (4, 4, 2, 1)                     # (6 - 5) / 1 + 1: the pad is not read
    assert any("dropped field(s) pad" in w for w in model.warnings)
