"""xw-hu's DSC layers (xw-hu/CF-Caffe 477b79f irnn_layer.cu, eltwise_advance_layer.cu): the references are
the CUDA kernels' loops in numpy float32, one output element at a time, on asymmetric shapes."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def irnn_ref(x, weight):
    """IRNNForward: each output element recomputes its sweep from the edge, s = relu(s * w + x)."""
    n, c, h, w = x.shape
    wl, wu, wr, wd = weight.reshape(4, c)
    tops = [np.zeros_like(x) for _ in range(4)]
    for i in range(n):
        for ch in range(c):
            for y in range(h):
                for z in range(w):
                    for top, wt, cells in ((tops[0], wl, x[i, ch, y, w - 1:z - 1 if z else None:-1]),
                                           (tops[1], wu, x[i, ch, h - 1:y - 1 if y else None:-1, z]),
                                           (tops[2], wr, x[i, ch, y, :z + 1]),
                                           (tops[3], wd, x[i, ch, :y + 1, z])):
                        s = F(0)
                        for v in cells:
                            s = max(F(s * wt[ch] + v), F(0))
                        top[i, ch, y, z] = s
    return tops


def irnn_net(shape, param=""):
    return net(f'layer {{ name: "r" type: "IRNN" bottom: "x" top: "l" top: "u" top: "r" top: "d" {param} }}',
               inputs={"x": shape})


def test_irnn_runs_four_relu_recurrences_from_the_edges(tmp_path):
    shape = (2, 3, 4, 5)
    x = rng(1).standard_normal(shape).astype(F)
    model = load_from_text(irnn_net(shape), random_weights=True)
    node = node_of(model, "r")
    assert node.expected_param_shapes == [(12,)]
    weight = rng(2).uniform(-1.2, 1.2, 12).astype(F)
    node.blobs[0] = weight
    left, up, right, down = irnn_ref(x, weight)
    assert left[0, 0, 0, 0] != right[0, 0, 0, 0]       # the directions differ
    check_everywhere(model, {"x": x}, {"l": left, "u": up, "r": right, "d": down}, tmp_path)


def test_irnn_weights_start_from_initial_value():
    node = node_of(load_from_text(irnn_net((1, 2, 3, 3), "irnn_param { initial_value: 0.5 weight_fixed: false }"),
                                  random_weights=True), "r")
    assert node.blobs[0].tolist() == [0.5] * 8


def test_irnn_refuses_a_tops_count_other_than_four():
    with pytest.raises(LayerError, match=r"IRNN takes one bottom \(x\) and 4 tops, got 1 and 2"):
        load_from_text(net('layer { name: "r" type: "IRNN" bottom: "x" top: "a" top: "b" }',
                           inputs={"x": (1, 2, 3, 3)}))


def eltwise_adv_ref(x, weights):
    """MultiForward: top[index] = x[index] * weights[((n * C + c / r) * H + h) * W + w], r = count ratio."""
    n, c, h, w = x.shape
    flat, r = weights.reshape(-1), x.size // weights.size
    out = np.empty_like(x)
    for i in range(n):
        for ch in range(c):
            for y in range(h):
                for z in range(w):
                    out[i, ch, y, z] = x[i, ch, y, z] * flat[((i * c + ch // r) * h + y) * w + z]
    return out


def eltwise_adv_net(x_shape, w_shape, param="eltwise_param { operation: PROD }"):
    return net(f'layer {{ name: "e" type: "EltwiseAdv" bottom: "x" bottom: "a" top: "o" {param} }}',
               inputs={"x": x_shape, "a": w_shape})


@pytest.mark.parametrize("x_shape, w_shape", [((1, 6, 3, 4), (1, 2, 3, 4)), ((1, 5, 2, 3), (1, 1, 2, 3)),
                                              ((2, 3, 4, 2), (2, 3, 4, 2))])
def test_eltwise_adv_weighs_blocks_of_channels(x_shape, w_shape, tmp_path):
    x = rng(3).standard_normal(x_shape).astype(F)
    a = rng(4).uniform(0, 1, w_shape).astype(F)
    model = load_from_text(eltwise_adv_net(x_shape, w_shape))
    check_everywhere(model, {"x": x, "a": a}, {"o": eltwise_adv_ref(x, a)}, tmp_path)


@pytest.mark.parametrize("x_shape, w_shape, param, msg", [
    ((1, 4, 3, 3), (1, 2, 3, 3), "", "runs only eltwise_param.operation PROD .* got SUM"),
    ((1, 4, 3, 3), (1, 2, 3, 3), "eltwise_param { operation: MAX }", "got MAX"),
    ((1, 4, 3, 3), (1, 3, 3, 3), "eltwise_param { operation: PROD }", r"must be \(N, C / r, H, W\)"),
    ((1, 4, 3, 3), (1, 2, 3, 2), "eltwise_param { operation: PROD }", r"must be \(N, C / r, H, W\)"),
    ((2, 4, 3, 3), (2, 2, 3, 3), "eltwise_param { operation: PROD }", "reads past them for a batch over 1"),
    ((1, 4, 3, 3), (1, 0, 3, 3), "eltwise_param { operation: PROD }", r"must be \(N, C / r, H, W\)"),
])
def test_eltwise_adv_refuses_what_its_kernel_cannot_compute(x_shape, w_shape, param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(eltwise_adv_net(x_shape, w_shape, param))


def test_dsc_context_block(tmp_path):
    """DSC's direction-aware context: IRNN, the four maps concatenated, weighed by a 4-channel attention."""
    text = net('layer { name: "r" type: "IRNN" bottom: "x" top: "l" top: "u" top: "r" top: "d" }',
               'layer { name: "c" type: "Concat" bottom: "l" bottom: "r" bottom: "u" bottom: "d" top: "cat" }',
               'layer { name: "s" type: "Sigmoid" bottom: "att" top: "att_s" }',
               'layer { name: "e" type: "EltwiseAdv" bottom: "cat" bottom: "att_s" top: "o" '
               'eltwise_param { operation: PROD } }', inputs={"x": (1, 2, 5, 3), "att": (1, 4, 5, 3)})
    model = load_from_text(text, random_weights=True)
    weight = rng(5).uniform(0, 1.1, 8).astype(F)
    node_of(model, "r").blobs[0] = weight
    x = rng(6).standard_normal((1, 2, 5, 3)).astype(F)
    att = rng(7).standard_normal((1, 4, 5, 3)).astype(F)
    left, up, right, down = irnn_ref(x, weight)
    ref = eltwise_adv_ref(np.concatenate([left, right, up, down], 1), (1 / (1 + np.exp(-att))).astype(F))
    check_everywhere(model, {"x": x, "att": att}, {"o": ref}, tmp_path, atol=1e-7, rtol=1e-6)
