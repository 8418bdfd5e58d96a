"""The MPI forks' layers (caffeq/layers/mpi_forks.py): Lyp100208/Caffe_action's Gather, ConvolutionData,
InnerProductAll and BNData, lxx1991/caffe_mpi's BNData and 2-bottom Warping, against references written here
from their GPU kernels (gather_layer.cu, bn_data_layer.cu, warping_layer.cu), in torch, onnxruntime and
model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, model_py_outputs, net, node_of, rng

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
COPY = 'layer { name: "copy" type: "Power" bottom: "x" top: "y" }\n'


def test_gather_with_one_process_copies_each_bottom(tmp_path):
    shapes = {"a": (2, 3, 4), "b": (2, 5)}
    model = load_from_text(net('layer { name: "g" type: "Gather" bottom: "a" bottom: "b" top: "ga" top: "gb" }',
                               inputs=shapes))
    r = rng(1)
    feeds = {k: r.standard_normal(s).astype(F32) for k, s in shapes.items()}
    check_everywhere(model, feeds, {"ga": feeds["a"], "gb": feeds["b"]}, tmp_path)
    with pytest.raises(LayerError, match="one top per bottom"):
        load_from_text(net('layer { name: "g" type: "Gather" bottom: "a" bottom: "b" top: "ga" }', inputs=shapes))


def test_convolution_data_and_inner_product_all_are_bvlcs(tmp_path):
    x = rng(2).standard_normal((2, 4, 7, 6)).astype(F32)
    model = load_from_text(net('layer { name: "c" type: "ConvolutionData" bottom: "x" top: "c" convolution_param { '
                               'num_output: 6 kernel_size: 3 stride: 2 pad: 1 group: 2 } }\n'
                               'layer { name: "ip" type: "InnerProductAll" bottom: "c" top: "y" '
                               'inner_product_param { num_output: 3 } }', inputs={"x": x.shape}), random_weights=True)
    w, b = (np.asarray(v) for v in node_of(model, "c").blobs)
    wi, bi = (np.asarray(v) for v in node_of(model, "ip").blobs)
    c = conv_ref(x, w, b, (2, 2), (1, 1), 2)
    check_everywhere(model, {"x": x}, {"y": c.reshape(2, -1) @ wi.T.astype(np.float64) + bi}, tmp_path,
                     atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params, eps", [
    ("scale_filler { type: 'constant' value: 1 } moving_average: true decay: 0.05", 1e-10),   # Lyp100208's
    ("slope_filler { type: 'constant' value: 1 } moving_average: true momentum: 0.95", 1e-5),  # lxx1991's
    ("moving_average: true var_eps: 0.001", 1e-3),
])
def test_bn_data_normalizes_with_the_stored_statistics(params, eps, tmp_path):
    """bn_data_layer.cu with moving_average: ((x - mean) / pow(var + eps, 0.5)) x scale + shift."""
    x = rng(3).standard_normal((2, 3, 4, 5)).astype(F32)
    model = load_from_text(net(COPY + f'layer {{ name: "b" type: "BNData" bottom: "y" top: "y" bn_param {{ {params} }} }}',
                               inputs={"x": x.shape}), random_weights=True)
    r = rng(4)
    scale, shift, mean = (r.standard_normal((1, 3, 1, 1)).astype(F32) for _ in range(3))
    var = r.uniform(0.5, 2, (1, 3, 1, 1)).astype(F32)
    node_of(model, "b").blobs = [scale, shift, mean, var]
    ref = (x.astype(np.float64) - mean) / np.sqrt(var.astype(np.float64) + eps) * scale + shift
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_bn_data_without_moving_average_is_refused():
    with pytest.raises(LayerError, match="batch's own statistics at TEST"):
        load_from_text(net('layer { name: "b" type: "BNData" bottom: "x" top: "y" bn_param { decay: 0.05 } }',
                           inputs={"x": (1, 2, 3, 3)}))


def fork_warping(image, flow):
    """warping_forward, one top element at a time, in float32."""
    n, c, h, w = image.shape
    out = np.zeros_like(image)

    def clamp(k, size):
        return 0 if k < 0 else (size - 1 if k >= size else k)
    for b in range(n):
        for y in range(h):
            for x in range(w):
                dh, dw = F32(flow[b, 1, y, x]), F32(flow[b, 0, y, x])
                th, tw = int(math.floor(F32(F32(y) + dh))), int(math.floor(F32(F32(x) + dw)))
                a0 = F32(1) - F32(F32(y - th) + dh)
                a1 = F32(1) - F32(F32(th + 1 - y) - dh)
                b0 = F32(1) - F32(F32(x - tw) + dw)
                b1 = F32(1) - F32(F32(tw + 1 - x) - dw)
                acc = np.zeros(c, F32)
                for yy, xx, wgt in ((th, tw, a0 * b0), (th + 1, tw, a1 * b0), (th, tw + 1, a0 * b1),
                                    (th + 1, tw + 1, a1 * b1)):
                    acc = acc + image[b, :, clamp(yy, h), clamp(xx, w)] * F32(wgt)
                out[b, :, y, x] = acc
    return out


def test_lxx_warping_samples_bilinearly_with_clamped_corners(tmp_path):
    r = rng(5)
    image = r.standard_normal((2, 3, 5, 7)).astype(F32)
    flow = (r.standard_normal((2, 2, 5, 7)) * 3).astype(F32)   # some points far outside: the border is read
    flow[0, :, 1, 2] = [0.25, -0.5]
    model = load_from_text(net('layer { name: "w" type: "Warping" bottom: "img" bottom: "flow" top: "o" }',
                               inputs={"img": image.shape, "flow": flow.shape}))
    assert node_of(model, "w").spec.__class__.__name__ == "ClampedWarping"
    check_everywhere(model, {"img": image, "flow": flow}, {"o": fork_warping(image, flow)}, tmp_path,
                     atol=1e-5, rtol=1e-5)
    with pytest.raises(LayerError, match="flow .N, 2, H, W."):
        load_from_text(net('layer { name: "w" type: "Warping" bottom: "img" bottom: "flow" top: "o" }',
                           inputs={"img": (1, 3, 5, 7), "flow": (1, 3, 5, 7)}))


def sigmoid32(v):
    return F32(1) / (F32(1) + np.exp(-v, dtype=F32))


def fork_sllstm(x, cont, u_h, b, w_x):
    """sllstm_layer.cu: zero state at t = 0, kept where the marker is > 0, tanh~(v) = 2 sigma(2v) - 1."""
    steps, batch, _ = x.shape
    hidden = u_h.shape[1]
    h, c = np.zeros((batch, hidden), F32), np.zeros((batch, hidden), F32)
    outs = []
    for t in range(steps):
        if t > 0 and cont is not None:
            keep = (cont[t] > 0).astype(F32)[:, None]
            h, c = h * keep, c * keep
        g = x[t] @ w_x.T + b + h @ u_h.T
        i, f, o = (sigmoid32(g[:, k * hidden:(k + 1) * hidden]) for k in range(3))
        cand = F32(2) * sigmoid32(F32(2) * g[:, 3 * hidden:]) - F32(1)
        c = i * cand + f * c
        h = o * (F32(2) * sigmoid32(F32(2) * c) - F32(1))
        outs.append(h)
    return np.stack(outs)


@pytest.mark.parametrize("marked", [True, False])
def test_sllstm_steps(marked, tmp_path):
    steps, batch, inputs, hidden = 5, 3, 4, 6
    shapes = {"x": (steps, batch, inputs)}
    bottoms = 'bottom: "x"'
    if marked:
        shapes["m"] = (steps, batch, 1)
        bottoms += ' bottom: "m"'
    model = load_from_text(net(f'layer {{ name: "l" type: "SLLSTM" {bottoms} top: "h" recurrent_param {{ '
                               f'num_output: {hidden} }} }}', inputs=shapes), random_weights=True)
    assert [tuple(np.shape(b)) for b in node_of(model, "l").blobs] == [(24, 6), (24,), (24, 4)]
    r = rng(9)
    node_of(model, "l").blobs = [(r.standard_normal(s) * 0.5).astype(F32) for s in ((24, 6), (24,), (24, 4))]
    feeds = {"x": r.standard_normal(shapes["x"]).astype(F32)}
    marks = None
    if marked:   # VideoDataRNN's markers: -length at a clip's start, 1 after; a stream restarting at t = 3
        marks = np.array([[-5, -3, -5], [1, 1, 1], [1, 1, 1], [1, -2, 1], [1, 1, 1]], F32)
        feeds["m"] = marks[..., None]
    ref = fork_sllstm(feeds["x"], marks, *node_of(model, "l").blobs)
    check_everywhere(model, feeds, {"h": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def fork_marked_reverse(marks, data):
    """reverse_layer.cu: per stream, each run (-length, then 1s) copied in reverse; from a 0 on, unwritten."""
    out = np.zeros_like(data)
    for j in range(marks.shape[1]):
        t = 0
        while t < marks.shape[0] and marks[t, j] != 0:
            length = int(-marks[t, j])
            run = 1
            while t + run < marks.shape[0] and marks[t + run, j] == 1:
                run += 1
            assert length == run
            out[t:t + run, j] = data[t:t + run, j][::-1]
            t += run
    return out


def test_marked_reverse_flips_each_run(tmp_path):
    marks = np.array([[-4, -2, -3], [1, 1, 1], [1, -2, 1], [1, 1, 0], [-1, 0, 0]], F32)
    data = rng(10).standard_normal((5, 3, 4)).astype(F32)
    model = load_from_text(net('layer { name: "r" type: "Reverse" bottom: "m" bottom: "d" top: "o" }',
                               inputs={"m": marks.shape, "d": data.shape}))
    ours = model.run({"m": marks, "d": data}, exact=True)["o"]
    np.testing.assert_array_equal(ours, fork_marked_reverse(marks, data))
    np.testing.assert_array_equal(model.run({"m": marks, "d": data})["o"], ours)
    np.testing.assert_array_equal(model_py_outputs(model, {"m": marks, "d": data}, tmp_path)["o"], ours)
    with pytest.raises(ExportError, match="runs in the markers' values"):
        model.export_onnx(str(tmp_path / "r.onnx"))
    bad = marks.copy()
    bad[0, 0] = -3   # a run of 4 marked as 3: the fork's CHECK_EQ fails
    with pytest.raises(LayerError, match="layer 'r' .Reverse.: a run's first marker is not minus its length"):
        model.run({"m": bad, "d": data})
