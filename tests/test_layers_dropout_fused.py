"""Miaomz/caffe-opencl's DropoutAndConvolution and DropoutAndInnerProduct: at TEST the fork's forward is its base
layer's (dropout_and_conv_layer.cpp's LibDNN convolution, dropout_and_inner_product_layer.cpp's gemm) on the
same blobs; references in float64 from Caffe's formulas, compared in torch, onnxruntime and model.py."""
import numpy as np
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.model import load_from_text


def test_dropout_and_convolution_is_the_convolution(tmp_path):
    layer = ('layer { name: "c" type: "DropoutAndConvolution" bottom: "x" top: "y" dropout_and_convolution_param { '
             'num_output: 4 kernel_h: 3 kernel_w: 2 stride: 2 pad: 1 group: 2 dropout_ratio: 0.2 dropout_type: 1 '
             'weight_filler { type: "xavier" } } }')
    model = load_from_text(net(layer, inputs={"x": (2, 6, 7, 5)}), random_weights=True)
    w, b = node_of(model, "c").blobs
    assert w.shape == (4, 3, 3, 2)
    x = rng(71).standard_normal((2, 6, 7, 5)).astype(np.float32)
    check_everywhere(model, {"x": x}, {"y": conv_ref(x, w, b, (2, 2), (1, 1), 2)}, tmp_path, atol=2e-5)


def test_dropout_and_inner_product_is_the_inner_product(tmp_path):
    layer = ('layer { name: "f" type: "DropoutAndInnerProduct" bottom: "x" top: "y" dropout_and_inner_product_param { '
             'num_output: 5 dropout_ratio: 0.5 dropout_type: 1 } }')
    model = load_from_text(net(layer, inputs={"x": (3, 2, 2, 2)}), random_weights=True)
    w, b = node_of(model, "f").blobs
    x = rng(72).standard_normal((3, 2, 2, 2)).astype(np.float32)
    ref = x.reshape(3, -1).astype(np.float64) @ w.T.astype(np.float64) + b
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5)


def test_misaka_mpi_fc_and_sync(tmp_path):
    # misaka-10032/caffe examples/mpi/mnist/lenet_train_test.prototxt (trimmed): MpiSync in place, then MpiFc
    layers = ('layer { name: "sync" type: "MpiSync" bottom: "x" top: "x" }\n'
              'layer { name: "ip1" type: "MpiFc" bottom: "x" top: "y" inner_product_param { num_output: 3 } }')
    model = load_from_text(net(layers, inputs={"x": (2, 4, 2, 1)}), random_weights=True)
    w, b = node_of(model, "ip1").blobs
    x = rng(73).standard_normal((2, 4, 2, 1)).astype(np.float32)
    ref = x.reshape(2, -1).astype(np.float64) @ w.T.astype(np.float64) + b
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5)
