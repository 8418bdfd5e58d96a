"""BVLC's LSTMUnit on its own: the step that BVLC's LSTM unrolls into, used by nets written as an unrolled
LSTM.  The reference is a loop written from lstm_unit_layer.cpp's Forward_cpu, in float64."""
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
UNROLLED = REALWORLD / "bleedingfight__caffe-env__examples__fashion_mnist__lstm_caffe_model__network.prototxt"

UNIT = 'layer { name: "u" type: "LSTMUnit" bottom: "c_prev" bottom: "gates" bottom: "cont" top: "c" top: "h" }'


def lstm_unit_ref(c_prev, gates, cont):
    """lstm_unit_layer.cpp Forward_cpu: per stream n and unit d, f is 0 where cont is 0, else
    cont * sigmoid; c = f c_prev + i g, h = o tanh(c)."""
    def sigmoid(v):
        return 1.0 / (1.0 + np.exp(-v))

    _, n, d = c_prev.shape
    c = np.zeros((1, n, d))
    h = np.zeros((1, n, d))
    for s in range(n):
        k = float(cont[0, s])
        for j in range(d):
            x = gates[0, s].astype(np.float64)
            i = sigmoid(x[j])
            f = 0.0 if k == 0 else k * sigmoid(x[d + j])
            o = sigmoid(x[2 * d + j])
            g = np.tanh(x[3 * d + j])
            c[0, s, j] = f * float(c_prev[0, s, j]) + i * g
            h[0, s, j] = o * np.tanh(c[0, s, j])
    return c, h


def test_lstm_unit_matches_caffe_formula_everywhere(tmp_path):
    n, d = 3, 5
    model = load_from_text(net(UNIT, inputs={"c_prev": (1, n, d), "gates": (1, n, 4 * d), "cont": (1, n)}))
    r = rng(3)
    feeds = {"c_prev": r.normal(0, 2, (1, n, d)).astype(np.float32),
             "gates": r.normal(0, 2, (1, n, 4 * d)).astype(np.float32),
             # a new sequence, a continued one, and a fractional marker (Caffe multiplies by it)
             "cont": np.array([[0.0, 1.0, 0.5]], np.float32)}
    c, h = lstm_unit_ref(feeds["c_prev"], feeds["gates"], feeds["cont"])
    assert model.graph.tensors["c"].shape == model.graph.tensors["h"].shape == (1, n, d)
    check_everywhere(model, feeds, {"c": c, "h": h}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shapes", [
    {"c_prev": (1, 3, 5), "gates": (1, 3, 16), "cont": (1, 3)},     # gates not 4 D
    {"c_prev": (2, 3, 5), "gates": (2, 3, 20), "cont": (2, 3)},     # more than one time step
    {"c_prev": (1, 3, 5), "gates": (1, 2, 20), "cont": (1, 3)},     # streams differ
    {"c_prev": (1, 3, 5), "gates": (1, 3, 20), "cont": (1, 3, 1)},  # cont of 3 axes
])
def test_lstm_unit_refuses_the_shapes_caffe_checks(shapes):
    with pytest.raises(CaffeqError, match=r"layer 'u' \(LSTMUnit\): LSTMUnit takes c_prev \(1, N, D\)"):
        load_from_text(net(UNIT, inputs=shapes))


def test_hand_unrolled_lstm_equals_bvlc_lstm():
    """A real file's LSTM written out as its unrolled net (InnerProducts sharing W_xc / b_c / W_hc, Scale
    by cont, LSTMUnit) gives what caffeq's LSTM layer gives with the same weights and initial states."""
    unrolled = load(UNROLLED, random_weights=True, seed=4, outputs=["h", "c_T"])
    blobs = {n.name: n.blobs for n in unrolled.graph.nodes if n.blobs}
    w_xc, b_c = blobs["lstm1_x_transform"]
    (w_hc,) = blobs["lstm1_transform_1"]
    lstm = load_from_text(net('layer { name: "l" type: "LSTM" bottom: "x" bottom: "cont" bottom: "h_0" bottom: "c_0" '
                              'top: "h" top: "h_T" top: "c_T" recurrent_param { num_output: 30 expose_hidden: true } }',
                              inputs={"x": (1, 1, 28, 28), "cont": (1, 1), "h_0": (1, 1, 30), "c_0": (1, 1, 30)}))
    node = next(n for n in lstm.graph.nodes if n.name == "l")
    node.blobs = [w_xc, b_c, w_hc]
    r = rng(5)
    for cont in (0.0, 1.0):
        feeds = {"x": r.uniform(0, 1, (1, 1, 28, 28)).astype(np.float32), "cont": np.array([[cont]], np.float32),
                 "h_0": r.normal(0, 1, (1, 1, 30)).astype(np.float32),
                 "c_0": r.normal(0, 1, (1, 1, 30)).astype(np.float32)}
        got = unrolled.run(feeds)
        want = lstm.run(feeds)
        assert_close(got["h"], want["h"], 1e-6, 1e-5, f"h, cont {cont}")
        assert_close(got["c_T"], want["c_T"], 1e-6, 1e-5, f"c_T, cont {cont}")
