"""t2mhanh/caffe_convLSTM_WTA's layers: SpatialWta (caffeq/layers/wta.py) against a loop written here from
spatial_wta_layer.cpp's Forward_cpu, and ConvLSTMReLU (conv_lstm.py) against the ConvLSTM reference with
ConvLSTMReLUUnit's relu; in torch, onnxruntime and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng
from test_layers_video_saliency import conv2d_ref, sigmoid, with_random

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def fork_spatial_wta(x, kernel, stride):
    """Forward_cpu: whole windows at multiples of the stride; each keeps its first largest |x|."""
    n, c, h, w = x.shape
    kh, kw = kernel or (h, w)
    sh, sw = stride
    rows, cols = math.floor((h - kh) / sh) + 1, math.floor((w - kw) / sw) + 1
    top, mask = np.zeros_like(x), np.zeros_like(x)
    for i in range(n):
        for ch in range(c):
            plane = x[i, ch].reshape(-1)
            for wh in range(max(rows, 0)):
                for ww in range(max(cols, 0)):
                    best, best_val = -1, -np.finfo(F32).max
                    for yy in range(wh * sh, min(wh * sh + kh, h)):
                        for xx in range(ww * sw, min(ww * sw + kw, w)):
                            if abs(plane[yy * w + xx]) > best_val:
                                best, best_val = yy * w + xx, abs(plane[yy * w + xx])
                    top[i, ch].reshape(-1)[best] = plane[best]
                    mask[i, ch].reshape(-1)[best] = 1
    return top, mask


def wta_net(params, shape, tops=("o",)):
    return net('layer { name: "wta" type: "SpatialWta" bottom: "x" ' + " ".join(f'top: "{t}"' for t in tops)
               + f" spatial_wta_param {{ {params} }} }}", inputs={"x": shape})


def test_spatial_wta_matches_the_forks_own_test_vectors():
    # test_spatial_wta_layer.cpp: global keeps -7; a 2 x 2 kernel at stride 1 keeps 4 and 7; 3 x 2 gives 0 4 7 4 0
    cases = [("global_wta: true", [[1, 2, 5, 2, 3], [3, 4, -7, 4, 2], [1, 2, 5, 2, 3]],
              [[0, 0, 0, 0, 0], [0, 0, -7, 0, 0], [0, 0, 0, 0, 0]]),
             ("kernel_size: 2", [[1, 2, 5], [3, 4, 7], [1, 4, 6]], [[0, 0, 0], [0, 4, 7], [0, 0, 0]]),
             ("kernel_h: 3 kernel_w: 2", [[1, 2, 5, 2, 3], [3, 4, 7, 4, 2], [1, 2, 5, 2, 3]],
              [[0, 0, 0, 0, 0], [0, 4, 7, 4, 0], [0, 0, 0, 0, 0]])]
    for params, x, expected in cases:
        x = np.array(x, F32)[None, None]
        model = load_from_text(wta_net(params, x.shape))
        np.testing.assert_array_equal(model.run({"x": x})["o"], np.array(expected, F32)[None, None], params)


@pytest.mark.parametrize("params, kernel, stride", [
    ("global_wta: true", None, (1, 1)),
    ("kernel_size: 3 stride: 2", (3, 3), (2, 2)),          # the last column is never covered
    ("kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2", (2, 3), (1, 2)),   # overlapping rows of windows
    ("kernel_size: 9", (9, 9), (1, 1)),                     # larger than the map: no window, all 0
])
def test_spatial_wta_keeps_each_windows_first_largest_magnitude(params, kernel, stride, tmp_path):
    x = rng(4).integers(-5, 6, (2, 3, 5, 8)).astype(F32)   # integers: many ties, first wins
    x[0, 1, 2, 3] = np.nan                                 # never wins
    model = load_from_text(wta_net(params, x.shape, ("o", "m")))
    top, mask = fork_spatial_wta(x, kernel, stride)
    check_everywhere(model, {"x": x}, {"o": top, "m": mask}, tmp_path)


@pytest.mark.parametrize("params, msg", [
    ("global_wta: true kernel_size: 2", "global_wta takes no kernel"),
    ("stride: 2", "needs kernel_size, or kernel_h and kernel_w"),
    ("kernel_size: 2 kernel_h: 2 kernel_w: 2", "not both forms"),
    ("kernel_size: 2 stride_h: 2", "stride, or stride_h and stride_w"),
    ("global_wta: true stride: 2", "1 with global_wta"),
])
def test_spatial_wta_refuses_what_the_fork_checks(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(wta_net(params, (1, 2, 4, 4)))


def relu_lstm_ref(x, cont, h0, c0, w_x, w_h, b_h, peep, conv):
    """ConvLSTMReLUUnit's steps: g = max(pre_g, 0), h = o max(c, 0); peepholes over H x W."""
    hd = h0.shape[2]
    h, c = h0[0].astype(np.float64), c0[0].astype(np.float64)
    outs = []
    for step in range(x.shape[0]):
        ct = cont[step].astype(np.float64)[:, None, None, None]
        pre = conv2d_ref(h * ct, w_h, b_h, *conv)
        if w_x is not None:
            pre = pre + conv2d_ref(x[step], w_x, None, *conv)
        i = sigmoid(pre[:, :hd] + c * peep[0])
        f = ct * sigmoid(pre[:, hd:2 * hd] + c * peep[1])
        o = sigmoid(pre[:, 2 * hd:3 * hd] + c * peep[2])
        c = f * c + i * np.maximum(pre[:, 3 * hd:], 0)
        h = o * np.maximum(c, 0)
        outs.append(h)
    return np.stack(outs), h[None], c[None]


@pytest.mark.parametrize("ignore_x", [False, True])
def test_conv_lstm_relu_steps(ignore_x, tmp_path):
    """The mnist_lstm_relu_AE configuration: expose_hidden, peepholes over H x W; decode1 ignores x."""
    t, n, cin, c, h, w = 3, 2, 1, 4, 5, 6
    body = ('recurrent_param { expose_hidden: true } lstm_debug_param { axis_hadamard: 3 num_axes_hadamard: 2 '
            f'ignore_x: {str(ignore_x).lower()} }} lstm_conv_param {{ num_output: 4 kernel_size: 3 pad: 1 }}')
    shapes = {"x": (t, n, cin, h, w), "cont": (t, n), "h0": (1, n, c, h, w), "c0": (1, n, c, h, w)}
    model = load_from_text(net('layer { name: "lstm" type: "ConvLSTMReLU" bottom: "x" bottom: "cont" bottom: "h0" '
                               f'bottom: "c0" top: "o" top: "hT" top: "cT" {body} }}', inputs=shapes),
                           random_weights=True)
    names = node_of(model, "lstm").spec.blob_names_for(node_of(model, "lstm").attrs)
    assert names[-2:] == ("dummy_h", "dummy_c") and names.count("dummy_c0") == 1
    weights = with_random(model, 40)
    w_x = None if ignore_x else weights.pop(0)
    w_h, b_h, *peep = weights
    r = rng(8)
    feeds = {k: r.standard_normal(s).astype(F32) for k, s in shapes.items()}
    feeds["cont"] = np.array([[0, 1], [1, 0], [1, 1]], F32)
    o, h_t, c_t = relu_lstm_ref(feeds["x"], feeds["cont"], feeds["h0"], feeds["c0"], w_x, w_h, b_h, peep,
                                ((1, 1), (1, 1), (1, 1), 1))
    check_everywhere(model, feeds, {"o": o, "hT": h_t, "cT": c_t}, tmp_path, atol=2e-5, rtol=2e-5)
