"""flukeskywalker/highway-networks' CuDNNHighway (caffeq/layers/highway.py) against a reference written here
from cudnn_highway_layer.cu: y = relu(conv(x, W_H) + b_H) * T + x * (1 - T), T = sigmoid(conv(x, W_T) + b_T),
in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def highway_ref(x, w_h, w_t, b_h, b_t, pad, tpad, group):
    h = np.maximum(conv_ref(x, w_h, b_h, (1, 1), pad, group), 0)
    t = 1 / (1 + np.exp(-conv_ref(x, w_t, b_t, (1, 1), tpad, group)))
    return h * t + x.astype(np.float64) * (1 - t)


def layer(params):
    return f'layer {{ name: "hw" type: "CuDNNHighway" bottom: "x" top: "y" highway_conv_param {{ {params} }} }}'


@pytest.mark.parametrize("params, pad, tpad, group, blobs", [
    ("num_output: 4 kernel_size: 3 pad: 1 transform_bias_filler { type: 'constant' value: -2 }", (1, 1), (1, 1), 1, 4),
    ("num_output: 4 kernel_h: 3 kernel_w: 1 pad_h: 1 pad_w: 0 group: 2 transform_kernel_size: 5 transform_pad: 2",
     (1, 0), (2, 2), 2, 4),
    ("num_output: 4 kernel_size: 1 bias_term: false", (0, 0), (0, 0), 1, 2),
])
def test_highway_gates_its_convolution_against_the_input(params, pad, tpad, group, blobs, tmp_path):
    x = rng(1).standard_normal((2, 4, 6, 5)).astype(np.float32)
    model = load_from_text(net(layer(params), inputs={"x": x.shape}), random_weights=True)
    r = rng(2)
    shapes = node_of(model, "hw").expected_param_shapes
    assert len(shapes) == blobs and shapes[0][1] == 4 // group
    values = [r.standard_normal(s).astype(np.float32) * 0.5 for s in shapes]
    node_of(model, "hw").blobs = values
    b_h, b_t = (values[2], values[3]) if blobs == 4 else (np.zeros(4, np.float32),) * 2
    ref = highway_ref(x, values[0], values[1], b_h, b_t, pad, tpad, group)
    assert model.blob_shapes["y"] == x.shape
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params, message", [
    ("num_output: 3 kernel_size: 3 pad: 1", "num_output equal to the input channels"),
    ("num_output: 4 kernel_size: 3 pad: 0", "the layer keeps the size"),
    ("num_output: 4 kernel_size: 3 pad: 1 transform_kernel_size: 3 transform_pad: 0", "transform gate's kernel"),
    ("num_output: 4 kernel_size: 3 pad: 1 stride: 2", "stride 1 only"),
    ("num_output: 4 kernel_size: 3 kernel_h: 3 kernel_w: 3 pad: 1", "give the kernel as kernel_size"),
])
def test_highway_refuses_what_the_fork_refuses(params, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(layer(params), inputs={"x": (1, 4, 5, 5)}))
