"""M2PELU (Coldmooon/Code-for-MPELU m2pelu_layer.cpp/.cu) and Shakeout (kgl-prml/shakeout-for-caffe
shakeout_layer.cpp/.cu) as each fork computes it at TEST.

References are float64 numpy loops written here from the forks' code; each layer runs in torch,
onnxruntime and the generated model.py.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng
from test_layers_ristretto import fixed_point_ref

from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

# ---- M2PELU -------------------------------------------------------------------------------------


def m2pelu_ref(x, alpha, beta, shared):
    """m2pelu_layer.cpp Forward_cpu: c = (i / count(2)) % channels / div_factor,
    y = max(x, 0) + alpha[c] * (exp(beta[c] * min(x, 0)) - 1)."""
    flat = x.astype(np.float64).ravel()
    channels = x.shape[1]
    dim = math.prod(x.shape[2:])
    div = channels if shared else 1
    a, b = alpha.astype(np.float64).ravel(), beta.astype(np.float64).ravel()
    y = np.empty_like(flat)
    for i, v in enumerate(flat):
        c = (i // dim) % channels // div
        y[i] = max(v, 0.0) + a[c] * (math.exp(b[c] * min(v, 0.0)) - 1.0)
    return y.reshape(x.shape)


def m2pelu_net(shape, params=""):
    return net(f'layer {{ name: "m" type: "M2PELU" bottom: "x" top: "o" {params} }}', inputs={"x": shape})


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (2, 5), (2, 4, 7)])
def test_m2pelu(shape, shared, tmp_path):
    x = (rng(1).standard_normal(shape) * 3).astype(np.float32)
    params = "m2pelu_param { channel_shared: true }" if shared else ""
    model = load_from_text(m2pelu_net(shape, params), random_weights=True)
    node = node_of(model, "m")
    blob = () if shared else (shape[1],)
    assert node.expected_param_shapes == [blob, blob]
    alpha = rng(2).uniform(0.1, 2.0, blob).astype(np.float32)
    beta = rng(3).uniform(-1.5, 3.0, blob).astype(np.float32)
    node.blobs[0], node.blobs[1] = alpha, beta
    ref = m2pelu_ref(x, alpha, beta, shared)
    # beta changes the negative part: not an ELU with alpha alone
    assert np.abs(ref - np.where(x > 0, x, alpha.reshape((-1,) + (1,) * (x.ndim - 2)) * np.expm1(x)
                                 if not shared else alpha * np.expm1(x))).max() > 1e-2
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_m2pelu_in_place(tmp_path):
    shape = (2, 3, 3, 5)
    x = rng(4).standard_normal(shape).astype(np.float32)
    text = net('layer { name: "m" type: "M2PELU" bottom: "x" top: "x" }'
               'layer { name: "o" type: "Power" bottom: "x" top: "o" }', inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "m")
    alpha, beta = np.array([0.25, 1.0, 2.0], np.float32), np.array([1.0, 0.5, 3.0], np.float32)
    node.blobs[0], node.blobs[1] = alpha, beta
    check_everywhere(model, {"x": x}, {"o": m2pelu_ref(x, alpha, beta, False)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_m2pelu_fillers():
    # the fork's defaults: alpha and beta constant 1
    node = node_of(load_from_text(m2pelu_net((2, 3, 2, 5)), random_weights=True), "m")
    assert np.all(node.blobs[0] == 1) and np.all(node.blobs[1] == 1)
    text = m2pelu_net((2, 3, 2, 5), 'm2pelu_param { alpha_filler { type: "constant" value: 0.25 } '
                                    'beta_filler { type: "uniform" min: 2 max: 3 } }')
    node = node_of(load_from_text(text, random_weights=True), "m")
    assert np.all(node.blobs[0] == np.float32(0.25))
    assert node.blobs[1].min() >= 2 and node.blobs[1].max() <= 3
    # a filler only training uses (the fork's taylor): read with a note, the default value
    text = m2pelu_net((2, 3, 2, 5), 'm2pelu_param { alpha_filler { type: "taylor" alpha: 0.25 beta: 1 } }')
    model = load_from_text(text, random_weights=True)
    assert np.all(node_of(model, "m").blobs[0] == 1)
    assert any("alpha_filler type 'taylor'" in w for w in model.warnings)


def test_taylor_weight_filler_reads_at_test(tmp_path):
    """The fork's "taylor" filler (filler.hpp TaylorFiller) on a Convolution: its alpha and beta are
    FillerParameter fields; the net reads and runs without a warning about them."""
    shape = (2, 3, 7, 6)
    text = net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 4 '
               'kernel_size: 3 weight_filler { type: "taylor" alpha: 0.25 beta: 1 variance_norm: FAN_IN } } }'
               'layer { name: "m" type: "M2PELU" bottom: "c" top: "o" }', inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    assert not any("beta" in w for w in model.warnings)
    x = rng(5).standard_normal(shape).astype(np.float32)
    c = node_of(model, "c")
    m = node_of(model, "m")
    ref = m2pelu_ref(conv_ref(x, c.blobs[0], c.blobs[1], (1, 1), (0, 0)), m.blobs[0], m.blobs[1], False)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_m2pelu_bad():
    with pytest.raises(LayerError, match="at least 2 axes"):
        load_from_text(m2pelu_net((7,)))
    # channels() is Blob's legacy accessor: the fork CHECK-fails past 4 axes
    with pytest.raises(LayerError, match=r"at most 4 axes, got shape \[2, 4, 3, 1, 5\]"):
        load_from_text(m2pelu_net((2, 4, 3, 1, 5)))
    with pytest.raises(LayerError, match="M2PELU takes one bottom and one top, got 2 and 1"):
        load_from_text(net('layer { name: "m" type: "M2PELU" bottom: "x" bottom: "y" top: "o" }',
                           inputs={"x": (2, 3), "y": (2, 3)}))


# ---- Shakeout -----------------------------------------------------------------------------------

def inner_product_ref(x, w, b):
    """inner_product_layer.cpp: top (N, num_output) = bottom (N, K) x W^T + b."""
    flat = x.astype(np.float64).reshape(x.shape[0], -1)
    return flat @ w.astype(np.float64).T + b.astype(np.float64)


def shakeout_layer(operate, params, extra="", ratio=0.5, scale=0.0001):
    """At TEST the fork's Forward is operate_layer_->Forward(bottom, top) on its blobs: neither the
    dropout ratio (no 1 / (1 - ratio)) nor shakeout_scale (no sign(W) term) enter."""
    return (f'layer {{ name: "s" type: "Shakeout" bottom: "x" top: "o" {params} shakeout_param {{ '
            f'dropout_ratio: {ratio} shakeout_scale: {scale} operate_layer_type: "{operate}" }} {extra} }}')


def test_shakeout_inner_product(tmp_path):
    shape = (2, 3, 5, 4)
    x = rng(6).standard_normal(shape).astype(np.float32)
    text = net(shakeout_layer("InnerProduct", 'inner_product_param { num_output: 7 weight_filler { type: "gaussian" '
                              'std: 0.005 } bias_filler { type: "constant" value: 0.1 } }',
                              'param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }'), inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "s")
    # the operate layer's blobs, in its order
    assert node.expected_param_shapes == [(7, 60), (7,)]
    assert model.blob_shapes["o"] == (2, 7)
    w = rng(7).standard_normal((7, 60)).astype(np.float32)
    b = rng(8).standard_normal(7).astype(np.float32)
    node.blobs[0], node.blobs[1] = w, b
    check_everywhere(model, {"x": x}, {"o": inner_product_ref(x, w, b)}, tmp_path, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_shakeout_convolution(bias, tmp_path):
    shape = (2, 3, 7, 6)
    x = rng(9).standard_normal(shape).astype(np.float32)
    conv = f'convolution_param {{ num_output: 5 kernel_h: 3 kernel_w: 2 stride: 2 pad: 1 bias_term: {str(bias).lower()} }}'
    # ratio and scale far from neutral: any TRAIN-time scaling or sign(W) term would show
    model = load_from_text(net(shakeout_layer("Convolution", conv, ratio=0.3, scale=0.7), inputs={"x": shape}),
                           random_weights=True)
    node = node_of(model, "s")
    assert node.expected_param_shapes == [(5, 3, 3, 2)] + ([(5,)] if bias else [])
    w = rng(10).standard_normal((5, 3, 3, 2)).astype(np.float32)
    b = rng(11).standard_normal(5).astype(np.float32) if bias else np.zeros(5, np.float32)
    node.blobs[0] = w
    if bias:
        node.blobs[1] = b
    ref = conv_ref(x, w, b, (2, 2), (1, 1))
    assert ref.shape == (2, 5, 4, 4)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-4, rtol=1e-5)


def test_shakeout_reads_its_caffemodel_blobs(tmp_path):
    """The fork's blobs_ are the operate layer's: a caffemodel stores weight then bias under the Shakeout layer."""
    shape = (2, 5, 3)
    text = net(shakeout_layer("InnerProduct", "inner_product_param { num_output: 4 }"), inputs={"x": shape})
    proto = tmp_path / "s.prototxt"
    proto.write_text(text)
    w = rng(12).standard_normal((4, 15)).astype(np.float32)
    b = rng(13).standard_normal(4).astype(np.float32)
    weights = caffe_pb2.NetParameter()
    layer = weights.layer.add(name="s", type="Shakeout")
    for array in (w, b):
        blob = layer.blobs.add()
        blob.shape.dim.extend(array.shape)
        blob.data.extend(array.ravel().tolist())
    (tmp_path / "s.caffemodel").write_bytes(weights.SerializeToString())
    model = load(str(proto), weights=str(tmp_path / "s.caffemodel"))
    x = rng(14).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"o": inner_product_ref(x, w, b)}, tmp_path, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("param, match", [
    ('shakeout_param { dropout_ratio: 0.5 }', "shakeout_param.operate_layer_type is required"),
    ('shakeout_param { operate_layer_type: "Shakeout" }', "must not be 'Shakeout'"),
    ('shakeout_param { operate_layer_type: "NoSuchLayer" }', "'NoSuchLayer' is not a layer type caffeq knows"),
    ('shakeout_param { operate_layer_type: "InnerProduct" }', "inner_product_param.num_output is required"),
])
def test_shakeout_bad(param, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(net(f'layer {{ name: "s" type: "Shakeout" bottom: "x" top: "o" {param} }}',
                           inputs={"x": (2, 3, 4, 5)}))


def test_shakeout_passes_on_a_written_back_bottom(tmp_path):
    """At TEST the fork hands its own bottom vector to the inner Forward: a ConvolutionRistretto inside
    trims x in place (conv_ristretto_layer.cu), so the AbsVal after it reads x trimmed."""
    shape = (2, 3, 4, 5)
    text = net(shakeout_layer("ConvolutionRistretto", "convolution_param { num_output: 2 kernel_h: 1 kernel_w: 2 }",
                              "quantization_param { bw_layer_in: 8 fl_layer_in: 3 bw_params: 8 fl_params: 4 "
                              "bw_layer_out: 10 fl_layer_out: 3 }")
               + 'layer { name: "after" type: "AbsVal" bottom: "x" top: "after" }', inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "s")
    assert len(node.outputs) == 2 and list(node.attrs["written_back"]) == [0]
    r = rng(15)
    x = (r.standard_normal(shape) * 6).astype(np.float32)
    w = (r.standard_normal((2, 3, 1, 2)) * 0.5).astype(np.float32)
    b = np.array([0.5, -0.25], np.float32)
    node.blobs[0], node.blobs[1] = w, b
    xq = fixed_point_ref(x, 8, 3)
    assert not np.array_equal(xq, x)
    conv = conv_ref(xq, fixed_point_ref(w, 8, 4), fixed_point_ref(b, 8, 4), (1, 1), (0, 0)).astype(np.float32)
    check_everywhere(model, {"x": x}, {"o": fixed_point_ref(conv, 10, 3), "after": np.abs(xq)}, tmp_path)


def test_shakeout_passes_on_the_inner_types_reading_note():
    text = net(shakeout_layer("ConvolutionScaling", "convolution_param { num_output: 2 kernel_size: 1 }"),
               inputs={"x": (2, 3, 4, 5)})
    model = load_from_text(text, random_weights=True)
    assert any("its CPU forward first rescales the bottom" in w for w in model.warnings)
