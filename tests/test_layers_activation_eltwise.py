"""Neuron, elementwise and recurrent layers beyond the reference cases.

Every numeric check compares against an independent numpy formula written
from Caffe's layer sources (float64), never against caffeq itself.
"""

import numpy as np
import pytest
import torch
from conftest import check_everywhere, inputs_text

from caffeq.layers import LayerError
from caffeq.model import load_from_text

RTOL = 1e-5


def net(inputs, layers):
    """Prototxt text: one Input layer per (name, shape), then the given layers."""
    return 'name: "t"\n' + inputs_text(**inputs) + layers


def load(inputs, layers, blobs=None):
    """Load a net; `blobs` {layer: [arrays]} replaces the random weights."""
    model = load_from_text(net(inputs, layers), random_weights=True)
    for node in model.layers:
        if blobs and node.name in blobs:
            node.blobs = [np.asarray(b, np.float32) for b in blobs[node.name]]
    return model


def rand(rng, *shape, lo=-3.0, hi=3.0):
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


def close(ours, ref, rtol=RTOL, atol=1e-6):
    ref = np.asarray(ref, np.float64)
    np.testing.assert_allclose(np.asarray(ours, np.float64), ref, rtol=rtol,
                               atol=atol + rtol * np.nanmax(np.abs(ref), initial=0.0))


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


X4 = (2, 3, 5, 7)   # N, C, H, W all different


# ---- neuron layers -----------------------------------------------------------------

NEURON_CASES = [
    # (type, param text, numpy formula)
    ("ReLU", "", lambda x: np.maximum(x, 0)),
    ("ReLU", "relu_param { negative_slope: -0.3 }", lambda x: np.maximum(x, 0) - 0.3 * np.minimum(x, 0)),
    ("ReLU6", "", lambda x: np.clip(x, 0, 6)),
    ("ReLU6", "relu6_param { negative_slope: 0.1 }",
     lambda x: np.minimum(np.maximum(x, 0), 6) + 0.1 * np.minimum(x, 0)),
    # inisis/caffe (brocolli): the threshold clips the leaky sum (relu6_layer.cpp)
    ("ReLU6", "relu6_param { threshold: 2.5 }", lambda x: np.clip(x, 0, 2.5)),
    ("ReLU6", "relu6_param { negative_slope: -0.5 threshold: 0.75 }",
     lambda x: np.minimum(np.maximum(x, 0) - 0.5 * np.minimum(x, 0), 0.75)),
    ("ELU", "", lambda x: np.where(x > 0, x, np.exp(np.minimum(x, 0)) - 1)),
    ("Power", "power_param { power: 0.5 scale: 1.5 shift: -1 }", lambda x: (1.5 * x - 1) ** 0.5),
    ("Power", "power_param { power: 3 scale: -2 }", lambda x: (-2 * x) ** 3),
    ("Power", "power_param { power: -1 shift: 5 }", lambda x: 1.0 / (5 + x)),
    ("Power", "power_param { power: 0 scale: 3 shift: 2 }", lambda x: np.ones_like(x)),
    ("Power", "power_param { power: 2 scale: 0 shift: -3 }", lambda x: np.full_like(x, 9.0)),
    ("Power", "power_param { power: 0.5 scale: 0 shift: -3 }", lambda x: np.full_like(x, np.nan)),
    ("Exp", "", np.exp),
    ("Exp", "exp_param { scale: 0.5 shift: -1 }", lambda x: np.exp(0.5 * x - 1)),
    ("Exp", "exp_param { base: 10 scale: -0.25 shift: 0.5 }", lambda x: 10.0 ** (0.5 - 0.25 * x)),
    ("Log", "log_param { shift: 4 }", lambda x: np.log(4 + x)),
    ("Log", "log_param { base: 2 scale: -1 shift: 3.5 }", lambda x: np.log2(3.5 - x)),
    ("BNLL", "", lambda x: np.logaddexp(0, x)),
    ("Threshold", "", lambda x: (x > 0).astype(np.float64)),
    ("Threshold", "threshold_param { threshold: -0.5 }", lambda x: (x > -0.5).astype(np.float64)),
    ("Clip", "clip_param { min: -1 max: 2.5 }", lambda x: np.clip(x, -1, 2.5)),
    ("Clip", "clip_param { min: 1 max: -1 }", lambda x: np.ones_like(x)),  # Caffe: max(min, min(x, max))
    ("HTanH", "", lambda x: np.clip(x, -1, 1)),      # ypkang/caffe (DjiNN), its GPU forward
    ("Swish", "", lambda x: x * sigmoid(x)),
    ("Swish", "swish_param { beta: -0.75 }", lambda x: x * sigmoid(-0.75 * x)),
    ("Sigmoid", "", sigmoid),
    ("TanH", "", np.tanh),
    ("AbsVal", "", np.abs),
]


def _neuron_model(kind, param, shape=X4):
    return load({"x": shape}, f'layer {{ name: "l" type: "{kind}" bottom: "x" top: "y" {param} }}\n')


@pytest.mark.parametrize("kind,param,formula", NEURON_CASES,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(NEURON_CASES)])
def test_neuron_layers_follow_caffes_formula(kind, param, formula):
    x = rand(np.random.default_rng(1), *X4)
    x[0, 0, 0, :3] = [0.0, -0.5, 2.5]       # exact hits of the thresholds and clip points
    model = _neuron_model(kind, param)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref = formula(x.astype(np.float64))
    close(model.run(x)["y"], ref)


def test_djinn_v1_htanh_reads_as_its_forks_htanh(tmp_path):
    """ypkang/caffe's V1 HTANH upgrades to "HTanH" (not the capitalized "Htanh"); NaN passes through."""
    text = ('name: "pos" input: "data" input_dim: 2 input_dim: 5 input_dim: 1 input_dim: 1\n'
            'layers { name: "h" type: HTANH bottom: "data" top: "h" }\n')
    model = load_from_text(text)
    assert [n.type for n in model.layers] == ["Input", "HTanH"]
    x = np.array([[-3.0, -1.0, 0.25, 1.0, np.nan], [1.5, -0.5, -1.25, 0.0, 7.0]], np.float32).reshape(2, 5, 1, 1)
    check_everywhere(model, {"data": x}, {"h": np.clip(x, -1, 1)}, tmp_path)


def test_neuron_layers_in_place_keep_caffes_blob_name():
    x = rand(np.random.default_rng(2), *X4)
    model = load({"x": X4}, 'layer { name: "a" type: "Swish" bottom: "x" top: "x" }\n'
                            'layer { name: "b" type: "AbsVal" bottom: "x" top: "x" }\n')
    close(model.run(x)["x"], np.abs(x * sigmoid(x.astype(np.float64))))


def test_bnll_is_finite_at_extremes():
    x = np.array([[-100.0, -30.0, 0.0, 30.0, 100.0]], np.float32)
    model = _neuron_model("BNLL", "", shape=(1, 5))
    y = model.run(x)["y"]
    assert np.isfinite(y).all()
    close(y, np.logaddexp(0, x.astype(np.float64)))


def test_relu6_reads_nvcaffe_relu_param_slope():
    x = rand(np.random.default_rng(3), *X4, lo=-9, hi=9)
    model = _neuron_model("ReLU6", "relu_param { negative_slope: 0.2 }")
    close(model.run(x)["y"], np.clip(x, 0, 6) + 0.2 * np.minimum(x, 0))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), X4, (2, 3, 2, 3, 4)])
def test_prelu_slopes_along_axis_1(shape, shared):
    rng = np.random.default_rng(4)
    x = rand(rng, *shape)
    slope = np.float32(0.3) if shared else rand(rng, shape[1], lo=-0.5, hi=0.9)
    param = "prelu_param { channel_shared: true }" if shared else ""
    model = load({"x": shape}, f'layer {{ name: "p" type: "PReLU" bottom: "x" top: "y" {param} }}\n',
                 {"p": [np.asarray(slope)]})
    assert model.layers[1].expected_param_shapes == [() if shared else (shape[1],)]
    a = np.asarray(slope, np.float64).reshape((-1,) + (1,) * (len(shape) - 2)) if not shared else 0.3
    close(model.run(x)["y"], np.where(x > 0, x, a * x))


def test_random_weights_use_caffes_default_fillers():
    model = load({"x": X4},
                 'layer { name: "p" type: "PReLU" bottom: "x" top: "p" }\n'
                 'layer { name: "s" type: "Scale" bottom: "p" top: "s" scale_param { axis: 2 num_axes: 2 bias_term: true } }\n'
                 'layer { name: "b" type: "Bias" bottom: "s" top: "b" bias_param { num_axes: -1 } }\n'
                 'layer { name: "s2" type: "Scale" bottom: "b" top: "s2" scale_param { filler { type: "constant" value: 2 } } }\n')
    blobs = model.params
    np.testing.assert_array_equal(blobs["p"][0], np.full(3, 0.25, np.float32))
    np.testing.assert_array_equal(blobs["s"][0], np.ones((5, 7), np.float32))
    np.testing.assert_array_equal(blobs["s"][1], np.zeros((5, 7), np.float32))
    np.testing.assert_array_equal(blobs["b"][0], np.zeros((3, 5, 7), np.float32))
    np.testing.assert_array_equal(blobs["s2"][0], np.full(3, 2, np.float32))


# ---- Eltwise ------------------------------------------------------------------------

ELTWISE = [
    ("operation: SUM", lambda a, b, c: a + b + c),
    ("operation: SUM coeff: 1 coeff: -1 coeff: 0.5", lambda a, b, c: a - b + 0.5 * c),
    ("operation: PROD", lambda a, b, c: a * b * c),
    ("operation: MAX", lambda a, b, c: np.maximum(np.maximum(a, b), c)),
    ("operation: MAX coeff: 5 coeff: 5 coeff: 5", lambda a, b, c: np.maximum(np.maximum(a, b), c)),
]


@pytest.mark.parametrize("param,formula", ELTWISE)
def test_eltwise_three_inputs(param, formula):
    rng = np.random.default_rng(5)
    a, b, c = (rand(rng, *X4) for _ in range(3))
    model = load({"a": X4, "b": X4, "c": X4},
                 f'layer {{ name: "e" type: "Eltwise" bottom: "a" bottom: "b" bottom: "c" top: "e" '
                 f'eltwise_param {{ {param} }} }}\n')
    close(model.run({"a": a, "b": b, "c": c})["e"], formula(*(v.astype(np.float64) for v in (a, b, c))))


def test_eltwise_default_is_sum_and_accepts_one_blob_twice():
    x = rand(np.random.default_rng(6), *X4)
    model = load({"x": X4}, 'layer { name: "e" type: "Eltwise" bottom: "x" bottom: "x" top: "e" }\n')
    close(model.run(x)["e"], 2.0 * x)


# ---- Scale and Bias ------------------------------------------------------------------

def _bcast(v, axis, ndim):
    v = np.asarray(v, np.float64)
    return v.reshape(v.shape + (1,) * (ndim - axis - v.ndim)) if v.ndim else v


SCALE_LEARNED = [
    # (scale_param text, scale blob shape, axis it starts at)
    ("", (3,), 1),
    ("axis: 0 num_axes: 2", (2, 3), 0),
    ("axis: 1 num_axes: -1", (3, 5, 7), 1),
    ("axis: -1", (7,), 3),
    ("axis: -2 num_axes: 2", (5, 7), 2),
    ("num_axes: 0", (), 0),
    ("axis: 3 num_axes: 0", (), 0),
]


@pytest.mark.parametrize("bias_term", [False, True])
@pytest.mark.parametrize("param,shape,axis", SCALE_LEARNED)
def test_scale_learned_axis_num_axes(param, shape, axis, bias_term):
    rng = np.random.default_rng(7)
    x = rand(rng, *X4)
    s = rand(rng, *shape, lo=0.5, hi=1.5)
    b = rand(rng, *shape)
    bt = "bias_term: true" if bias_term else ""
    model = load({"x": X4}, f'layer {{ name: "s" type: "Scale" bottom: "x" top: "y" scale_param {{ {param} {bt} }} }}\n',
                 {"s": [s, b] if bias_term else [s]})
    assert model.layers[1].expected_param_shapes == [shape] * (2 if bias_term else 1)
    ref = x * _bcast(s, axis, 4) + (_bcast(b, axis, 4) if bias_term else 0)
    close(model.run(x)["y"], ref)


@pytest.mark.parametrize("s_shape,axis", [((3,), 1), ((3, 5), 1), ((2, 3), 0), ((5, 7), -2), ((7,), 3)])
@pytest.mark.parametrize("bias_term", [False, True])
def test_scale_by_second_bottom(s_shape, axis, bias_term):
    rng = np.random.default_rng(8)
    x = rand(rng, *X4)
    s = rand(rng, *s_shape)
    bt = "bias_term: true" if bias_term else ""
    inputs = {"x": X4, "s": s_shape}
    layers = (f'layer {{ name: "sc" type: "Scale" bottom: "x" bottom: "s" top: "y" '
              f'scale_param {{ axis: {axis} {bt} }} }}\n')
    ax = axis % 4
    b = rand(rng, *X4[ax:ax + len(s_shape)])
    model = load(inputs, layers, {"sc": [b]} if bias_term else None)
    expect = [tuple(X4[ax:ax + len(s_shape)])] if bias_term else None
    assert model.layers[-1].expected_param_shapes == expect
    ref = x * _bcast(s, ax, 4) + (_bcast(b, ax, 4) if bias_term else 0)
    close(model.run({"x": x, "s": s})["y"], ref)


def test_scale_by_batch_shaped_bottom_follows_the_run_batch():
    """SE-style Scale with bottom[1] = N x C: must use the batch of the run, not the prototxt's."""
    rng = np.random.default_rng(9)
    x, s = rand(rng, 3, 4, 5, 6), rand(rng, 3, 4)
    model = load({"x": (3, 4, 5, 6), "s": (3, 4)},
                 'layer { name: "sc" type: "Scale" bottom: "x" bottom: "s" top: "y" scale_param { axis: 0 } }\n')
    for n in (3, 1):
        close(model.run({"x": x[:n], "s": s[:n]})["y"], x[:n] * s[:n, :, None, None])


@pytest.mark.parametrize("param,shape,axis", [("", (3,), 1), ("axis: 2 num_axes: -1", (5, 7), 2),
                                               ("num_axes: 0", (), 0), ("axis: 0 num_axes: 4", X4, 0)])
def test_bias_learned_axis_num_axes(param, shape, axis):
    rng = np.random.default_rng(10)
    x, b = rand(rng, *X4), rand(rng, *shape)
    model = load({"x": X4}, f'layer {{ name: "b" type: "Bias" bottom: "x" top: "y" bias_param {{ {param} }} }}\n',
                 {"b": [b]})
    close(model.run(x)["y"], x + _bcast(b, axis, 4))


def test_bias_second_bottom():
    rng = np.random.default_rng(11)
    x, b = rand(rng, *X4), rand(rng, 5, 7)
    model = load({"x": X4, "b": (5, 7)},
                 'layer { name: "bi" type: "Bias" bottom: "x" bottom: "b" top: "y" bias_param { axis: 2 } }\n')
    assert model.layers[-1].expected_param_shapes is None
    close(model.run({"x": x, "b": b})["y"], x + b)


@pytest.mark.parametrize("a_shape", [(2, 3, 1, 1), (2, 3)])
def test_axpy(a_shape):
    rng = np.random.default_rng(12)
    a, x, y = rand(rng, *a_shape), rand(rng, *X4), rand(rng, *X4)
    model = load({"a": a_shape, "x": X4, "y": X4},
                 'layer { name: "ax" type: "Axpy" bottom: "a" bottom: "x" bottom: "y" top: "f" }\n')
    close(model.run({"a": a, "x": x, "y": y})["f"], a.reshape(2, 3, 1, 1) * x.astype(np.float64) + y)


# ---- RNN and LSTM ------------------------------------------------------------------------

def np_lstm(x, cont, w_xc, b_c, w_hc, xs=None, w_s=None, h0=None, c0=None):
    """lstm_layer.cpp + lstm_unit_layer.cpp, in float64."""
    t_, n = x.shape[:2]
    hd = w_hc.shape[1]
    xf = x.reshape(t_, n, -1).astype(np.float64)
    h = np.zeros((n, hd)) if h0 is None else h0.reshape(n, hd).astype(np.float64)
    c = np.zeros((n, hd)) if c0 is None else c0.reshape(n, hd).astype(np.float64)
    hs = []
    for t in range(t_):
        ct = cont[t].astype(np.float64)[:, None]
        z = (ct * h) @ w_hc.T + xf[t] @ w_xc.T + b_c
        if xs is not None:
            z = z + xs.reshape(n, -1) @ w_s.T
        i, f, o, g = (z[:, k * hd:(k + 1) * hd] for k in range(4))
        f = np.where(ct == 0, 0.0, ct * sigmoid(f))
        c = f * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        hs.append(h)
    return np.stack(hs), h[None], c[None]


def np_rnn(x, cont, w_xh, b_h, w_hh, w_ho, b_o, xs=None, w_s=None, h0=None):
    """rnn_layer.cpp, in float64."""
    t_, n = x.shape[:2]
    hd = w_hh.shape[0]
    xf = x.reshape(t_, n, -1).astype(np.float64)
    h = np.zeros((n, hd)) if h0 is None else h0.reshape(n, hd).astype(np.float64)
    os_ = []
    for t in range(t_):
        z = (cont[t].astype(np.float64)[:, None] * h) @ w_hh.T + xf[t] @ w_xh.T + b_h
        if xs is not None:
            z = z + xs.reshape(n, -1) @ w_s.T
        h = np.tanh(z)
        os_.append(np.tanh(h @ w_ho.T + b_o))
    return np.stack(os_), h[None]


T, N, H = 5, 3, 4
XSHAPE = (T, N, 2, 3)      # x has trailing axes that Caffe flattens from axis 2
XSTATIC = (N, 2, 2)


def _cont(rng):
    cont = np.ones((T, N), np.float32)
    cont[0] = 0
    cont[2, 1] = 0          # stream 1 restarts mid-sequence
    cont[3, 2] = 0.5        # non-binary cont scales the state, as Caffe's Scale/LSTMUnit do
    return cont


def _recurrent(kind, static, expose, rng):
    nstates = 2 if kind == "LSTM" else 1
    inputs = {"x": XSHAPE, "cont": (T, N)}
    bottoms = ["x", "cont"]
    if static:
        inputs["xs"] = XSTATIC
        bottoms.append("xs")
    if expose:
        for s in ("h0", "c0")[:nstates]:
            inputs[s] = (1, N, H)
            bottoms.append(s)
    tops = ["y"] + (["hT", "cT"][:nstates] if expose else [])
    layer = (f'layer {{ name: "r" type: "{kind}" ' + " ".join(f'bottom: "{b}"' for b in bottoms) + " "
             + " ".join(f'top: "{t}"' for t in tops)
             + f' recurrent_param {{ num_output: {H} {"expose_hidden: true" if expose else ""} }} }}\n')
    g = 4 * H if kind == "LSTM" else H
    k, ks = 6, 4
    w = {"W_x": rand(rng, g, k, lo=-0.6, hi=0.6), "b": rand(rng, g, lo=-0.5, hi=0.5),
         "W_s": rand(rng, g, ks, lo=-0.6, hi=0.6), "W_h": rand(rng, g, H, lo=-0.6, hi=0.6),
         "W_o": rand(rng, H, H, lo=-0.6, hi=0.6), "b_o": rand(rng, H, lo=-0.5, hi=0.5)}
    blobs = [w["W_x"], w["b"]] + ([w["W_s"]] if static else []) + [w["W_h"]]
    if kind == "RNN":
        blobs += [w["W_o"], w["b_o"]]
    model = load(inputs, layer, {"r": blobs})
    feeds = {"x": rand(rng, *XSHAPE), "cont": _cont(rng)}
    if static:
        feeds["xs"] = rand(rng, *XSTATIC)
    if expose:
        for s in ("h0", "c0")[:nstates]:
            feeds[s] = rand(rng, 1, N, H, lo=-1, hi=1)
    return model, feeds, w


def _reference(kind, feeds, w, static):
    xs = feeds.get("xs") if static else None
    if kind == "LSTM":
        return np_lstm(feeds["x"], feeds["cont"], w["W_x"], w["b"], w["W_h"], xs, w["W_s"],
                       feeds.get("h0"), feeds.get("c0"))
    return np_rnn(feeds["x"], feeds["cont"], w["W_x"], w["b"], w["W_h"], w["W_o"], w["b_o"], xs, w["W_s"],
                  feeds.get("h0"))


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("expose", [False, True])
def test_recurrent_matches_caffes_unrolled_net(kind, static, expose):
    model, feeds, w = _recurrent(kind, static, expose, np.random.default_rng(13))
    g = 4 * H if kind == "LSTM" else H
    shapes = [(g, 6), (g,)] + ([(g, 4)] if static else []) + [(g, H)] + ([(H, H), (H,)] if kind == "RNN" else [])
    assert model.layers[-1].expected_param_shapes == shapes
    out = model.run(feeds, all_blobs=True)
    ref = _reference(kind, feeds, w, static)
    close(out["y"], ref[0])
    assert out["y"].shape == (T, N, H)
    if expose:
        close(out["hT"], ref[1])
        if kind == "LSTM":
            close(out["cT"], ref[2])


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_cont_zero_starts_a_fresh_sequence(kind):
    """With cont[k] == 0 for every stream, steps k.. equal a run on x[k:] alone."""
    model, feeds, _ = _recurrent(kind, False, False, np.random.default_rng(14))
    feeds["cont"][:] = 1
    feeds["cont"][0] = 0
    feeds["cont"][3] = 0
    full = model.run(feeds)["y"]
    tail = model.run({"x": feeds["x"][3:], "cont": feeds["cont"][3:]})["y"]
    close(full[3:], tail)
    assert not np.allclose(full[:3], 0)


def test_recurrent_streams_are_independent():
    model, feeds, _ = _recurrent("LSTM", False, False, np.random.default_rng(15))
    gm = model.to_torch()
    full = gm(*(torch.from_numpy(feeds[k]) for k in ("x", "cont"))).detach().numpy()
    one = gm(torch.from_numpy(feeds["x"][:, 1:2]), torch.from_numpy(feeds["cont"][:, 1:2])).detach().numpy()
    close(one[:, 0], full[:, 1])


# ---- bad parameters ------------------------------------------------------------------------

BAD = [
    ({"a": X4, "b": X4}, ('layer { name: "bad" type: "Eltwise" bottom: "a" bottom: "b" top: "e" '
                          'eltwise_param { coeff: 1 coeff: 2 coeff: 3 } }'), "coeff"),
    ({"a": X4, "b": X4}, ('layer { name: "bad" type: "Eltwise" bottom: "a" bottom: "b" top: "e" '
                          'eltwise_param { operation: PROD coeff: 1 coeff: 2 } }'), "coeff"),
    ({"a": X4, "b": (2, 3, 5, 6)}, 'layer { name: "bad" type: "Eltwise" bottom: "a" bottom: "b" top: "e" }',
     "equal shapes"),
    # one bottom: BVLC refuses every operation; the optical-flow forks sum it (test_layers_optical_flow.py)
    ({"a": X4}, 'layer { name: "bad" type: "Eltwise" bottom: "a" top: "e" eltwise_param { operation: PROD } }',
     "bottom"),
    ({"a": X4}, 'layer { name: "bad" type: "Scale" bottom: "a" top: "e" scale_param { num_axes: -2 } }',
     "num_axes"),
    ({"a": X4}, 'layer { name: "bad" type: "Scale" bottom: "a" top: "e" scale_param { axis: 4 } }', "axis"),
    ({"a": X4}, 'layer { name: "bad" type: "Scale" bottom: "a" top: "e" scale_param { axis: 2 num_axes: 3 } }',
     "extends past"),
    ({"a": X4, "s": (3, 6)}, 'layer { name: "bad" type: "Scale" bottom: "a" bottom: "s" top: "e" }',
     "does not match"),
    ({"a": X4, "s": (3, 5, 7, 1)}, 'layer { name: "bad" type: "Scale" bottom: "a" bottom: "s" top: "e" }',
     "extends past"),
    ({"a": X4}, 'layer { name: "bad" type: "Bias" bottom: "a" top: "e" bias_param { num_axes: -3 } }',
     "num_axes"),
    ({"a": X4, "b": (4,)}, 'layer { name: "bad" type: "Bias" bottom: "a" bottom: "b" top: "e" }',
     "does not match"),
    ({"a": X4}, 'layer { name: "bad" type: "Exp" bottom: "a" top: "e" exp_param { base: 0 } }', "base"),
    ({"a": X4}, 'layer { name: "bad" type: "Exp" bottom: "a" top: "e" exp_param { base: -2 } }', "base"),
    ({"a": X4}, 'layer { name: "bad" type: "Log" bottom: "a" top: "e" log_param { base: 1 } }', "base"),
    ({"a": X4}, 'layer { name: "bad" type: "Log" bottom: "a" top: "e" log_param { base: -0.5 } }', "base"),
    ({"a": X4}, 'layer { name: "bad" type: "Clip" bottom: "a" top: "e" clip_param { min: 0 } }',
     "clip_param.max"),
    ({"a": X4}, 'layer { name: "bad" type: "Clip" bottom: "a" top: "e" }', "clip_param.min"),
    ({"a": (7,)}, 'layer { name: "bad" type: "PReLU" bottom: "a" top: "e" }', "2 axes"),
    ({"a": X4, "b": X4}, 'layer { name: "bad" type: "ReLU" bottom: "a" bottom: "b" top: "e" }', "bottom"),
    ({"x": (T, N, 2), "c": (T, N)}, 'layer { name: "bad" type: "LSTM" bottom: "x" bottom: "c" top: "h" }',
     "num_output"),
    ({"x": (T, N, 2), "c": (T, 2)},
     'layer { name: "bad" type: "LSTM" bottom: "x" bottom: "c" top: "h" recurrent_param { num_output: 3 } }',
     "cont"),
    ({"x": (T, N, 2), "c": (T, N), "h0": (1, N, 3)},
     ('layer { name: "bad" type: "LSTM" bottom: "x" bottom: "c" bottom: "h0" top: "h" top: "hT" '
      'recurrent_param { num_output: 3 expose_hidden: true } }'), "bottom"),
    ({"x": (T, N, 2), "c": (T, N), "h0": (1, N, 4)},
     ('layer { name: "bad" type: "RNN" bottom: "x" bottom: "c" bottom: "h0" top: "h" top: "hT" '
      'recurrent_param { num_output: 3 expose_hidden: true } }'), "initial h"),
    ({"x": (T, N, 2), "c": (T, N), "s": (N + 1, 2)},
     ('layer { name: "bad" type: "RNN" bottom: "x" bottom: "c" bottom: "s" top: "h" '
      'recurrent_param { num_output: 3 } }'), "x_static"),
    ({"x": (T,), "c": (T, N)},
     'layer { name: "bad" type: "RNN" bottom: "x" bottom: "c" top: "h" recurrent_param { num_output: 3 } }',
     "2 axes"),
    ({"a": (2, 3, 2, 1), "x": X4, "y": X4}, ('layer { name: "bad" type: "Axpy" bottom: "a" bottom: "x" '
                                             'bottom: "y" top: "f" }'), "N x C x 1 x 1"),
    ({"a": (2, 3), "x": X4, "y": (2, 3, 5, 6)}, ('layer { name: "bad" type: "Axpy" bottom: "a" bottom: "x" '
                                                 'bottom: "y" top: "f" }'), "equal shapes"),
]


@pytest.mark.parametrize("inputs,layer,needle", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_parameters_raise_layer_error(inputs, layer, needle):
    with pytest.raises(LayerError) as info:
        load(inputs, layer + "\n")
    msg = str(info.value)
    assert "layer 'bad'" in msg and needle in msg, msg
    assert "\n" not in msg


def test_recurrent_top_count_is_checked():
    from caffeq.errors import CaffeqError
    with pytest.raises(CaffeqError, match="tops"):
        load({"x": (T, N, 2), "c": (T, N)},
             'layer { name: "bad" type: "LSTM" bottom: "x" bottom: "c" top: "h" top: "hT" '
             'recurrent_param { num_output: 3 } }\n')


# ---- gradients ---------------------------------------------------------------------------------

def _grads(model, feeds):
    gm = model.to_torch()
    gm.train()
    tensors = [torch.tensor(feeds[k], requires_grad=True) for k in model.inputs]
    out = gm(*tensors)
    outs = out.values() if isinstance(out, dict) else [out]
    loss = sum((o.double() ** 2).sum() for o in outs)
    loss.backward()
    return {k: t.grad for k, t in zip(model.inputs, tensors)}, dict(gm.named_parameters())


DIFFERENTIABLE = [(k, p) for k, p, _ in NEURON_CASES if k != "Threshold" and "scale: 0" not in p
                  and "power: 0 " not in p and "min: 1 max: -1" not in p and "power: 0.5" not in p]


DIFFERENTIABLE += [("PReLU", ""), ("PReLU", "prelu_param { channel_shared: true }")]


@pytest.mark.parametrize("kind,param", DIFFERENTIABLE, ids=[f"{k}-{i}" for i, (k, _) in enumerate(DIFFERENTIABLE)])
def test_neuron_gradients_flow(kind, param):
    x = rand(np.random.default_rng(16), *X4, lo=-2, hi=2)
    if kind == "Log":
        x = np.abs(x) * (-1 if "scale: -1" in param else 1)
    model = _neuron_model(kind, param)
    gx, params = _grads(model, {"x": x})
    assert torch.isfinite(gx["x"]).all() and gx["x"].abs().sum() > 0
    for name, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_eltwise_scale_bias_axpy_gradients_flow():
    rng = np.random.default_rng(17)
    model = load({"a": X4, "b": X4, "s": (3, 5), "w": (2, 3)},
                 'layer { name: "e1" type: "Eltwise" bottom: "a" bottom: "b" top: "e1" eltwise_param { coeff: 2 coeff: -1 } }\n'
                 'layer { name: "e2" type: "Eltwise" bottom: "e1" bottom: "a" top: "e2" eltwise_param { operation: MAX } }\n'
                 'layer { name: "e3" type: "Eltwise" bottom: "e2" bottom: "b" top: "e3" eltwise_param { operation: PROD } }\n'
                 'layer { name: "sc" type: "Scale" bottom: "e3" top: "sc" scale_param { bias_term: true } }\n'
                 'layer { name: "s2" type: "Scale" bottom: "sc" bottom: "s" top: "s2" scale_param { bias_term: true } }\n'
                 'layer { name: "bi" type: "Bias" bottom: "s2" top: "bi" bias_param { axis: 2 num_axes: 2 } }\n'
                 'layer { name: "ax" type: "Axpy" bottom: "w" bottom: "bi" bottom: "a" top: "ax" }\n',
                 {"sc": [rand(rng, 3, lo=0.5, hi=1.5), rand(rng, 3)], "s2": [rand(rng, 3, 5)],
                  "bi": [rand(rng, 5, 7)]})
    feeds = {"a": rand(rng, *X4), "b": rand(rng, *X4), "s": rand(rng, 3, 5), "w": rand(rng, 2, 3)}
    grads, params = _grads(model, feeds)
    for k, g in grads.items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, k
    assert len(params) == 4
    for name, p in params.items():
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_recurrent_gradients_flow(kind):
    model, feeds, _ = _recurrent(kind, True, True, np.random.default_rng(18))
    feeds["cont"][0] = 1    # continue from h0/c0 (cont 0 would zero their gradient, as in Caffe)
    grads, params = _grads(model, feeds)
    for k in ("x", "xs", "h0") + (("c0",) if kind == "LSTM" else ()):
        assert torch.isfinite(grads[k]).all() and grads[k].abs().sum() > 0, k
    assert len(params) == (4 if kind == "LSTM" else 6)
    for name, p in params.items():
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ---- ONNX ------------------------------------------------------------------------------------------

def _onnx_or_skip():
    pytest.importorskip("onnxruntime")
    try:
        import caffeq.backends.onnx_backend  # noqa: F401
    except ImportError:
        pytest.skip("the ONNX backend is not available")


def _ort_run(model, feeds, tmp_path, **kw):
    import onnxruntime as ort
    path = tmp_path / "m.onnx"
    model.export_onnx(str(path), optimize=False, **kw)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    blob = {t: model.graph.tensors[t].blob for t in names}
    return {blob[n]: v for n, v in zip(names, sess.run(None, {k: feeds[k] for k in model.inputs}))}


@pytest.mark.parametrize("kind,param,formula", NEURON_CASES,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(NEURON_CASES)])
def test_onnx_neuron_layers(kind, param, formula, tmp_path):
    _onnx_or_skip()
    x = rand(np.random.default_rng(19), *X4)
    x[0, 0, 0, :3] = [0.0, -0.5, 2.5]
    model = _neuron_model(kind, param)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref = formula(x.astype(np.float64))
    for n in (2, 1):
        close(_ort_run(model, {"x": x[:n]}, tmp_path)["y"], ref[:n])


def test_onnx_prelu_eltwise_scale_bias_axpy(tmp_path):
    _onnx_or_skip()
    rng = np.random.default_rng(20)
    blobs = {"p": [rand(rng, 3, lo=0.1, hi=0.5)], "q": [np.float32(0.2)],
             "sc": [rand(rng, 5, 7, lo=0.5, hi=1.5), rand(rng, 5, 7)], "s0": [np.float32(1.7)],
             "s3": [rand(rng, 4)], "bi": [rand(rng, 3, 5, 7)]}
    model = load({"a": X4, "b": X4, "s": (2, 3), "t": (3, 5)},
                 'layer { name: "p" type: "PReLU" bottom: "a" top: "p" }\n'
                 'layer { name: "q" type: "PReLU" bottom: "b" top: "q" prelu_param { channel_shared: true } }\n'
                 'layer { name: "e1" type: "Eltwise" bottom: "p" bottom: "q" bottom: "a" top: "e1" '
                 'eltwise_param { coeff: 0.5 coeff: -1 coeff: 2 } }\n'
                 'layer { name: "e2" type: "Eltwise" bottom: "e1" bottom: "b" bottom: "a" top: "e2" eltwise_param { operation: MAX } }\n'
                 'layer { name: "e3" type: "Eltwise" bottom: "e2" bottom: "b" bottom: "p" top: "e3" eltwise_param { operation: PROD } }\n'
                 'layer { name: "sc" type: "Scale" bottom: "e3" top: "sc" scale_param { axis: -2 num_axes: 2 bias_term: true } }\n'
                 'layer { name: "s0" type: "Scale" bottom: "sc" top: "s0" scale_param { num_axes: 0 } }\n'
                 'layer { name: "s1" type: "Scale" bottom: "s0" bottom: "s" top: "s1" scale_param { axis: 0 } }\n'
                 'layer { name: "s2" type: "Scale" bottom: "s1" bottom: "t" top: "s2" scale_param { bias_term: true } }\n'
                 'layer { name: "bi" type: "Bias" bottom: "s2" top: "bi" bias_param { num_axes: -1 } }\n'
                 'layer { name: "ax" type: "Axpy" bottom: "s" bottom: "bi" bottom: "a" top: "ax" }\n',
                 dict(blobs, s2=[rand(rng, 3, 5)]))
    feeds = {"a": rand(rng, *X4), "b": rand(rng, *X4), "s": rand(rng, 2, 3), "t": rand(rng, 3, 5)}
    # the numpy chain
    a, b, s, t = (feeds[k].astype(np.float64) for k in ("a", "b", "s", "t"))
    p = np.where(a > 0, a, blobs["p"][0][:, None, None] * a)
    q = np.where(b > 0, b, 0.2 * b)
    e1 = 0.5 * p - q + 2 * a
    e2 = np.maximum(np.maximum(e1, b), a)
    e3 = e2 * b * p
    sc = e3 * blobs["sc"][0] + blobs["sc"][1]
    s0 = sc * np.float64(np.float32(1.7))
    s1 = s0 * s[:, :, None, None]
    s2 = s1 * t[:, :, None] + model.params["s2"][0][:, :, None]
    bi = s2 + blobs["bi"][0]
    ax = s[:, :, None, None] * bi + a
    close(model.run(feeds)["ax"], ax)
    for n in (2, 1):
        got = _ort_run(model, {k: (v if k == "t" else v[:n]) for k, v in feeds.items()}, tmp_path)
        close(got["ax"], ax[:n])


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static,expose", [(False, False), (True, False), (True, True)])
def test_onnx_recurrent_is_dynamic_in_t(kind, static, expose, tmp_path):
    """T is dim 0, the file's dynamic "N"; the backend keeps the other dims static."""
    _onnx_or_skip()
    import onnxruntime as ort
    model, feeds, w = _recurrent(kind, static, expose, np.random.default_rng(21))
    path = tmp_path / "r.onnx"
    model.export_onnx(str(path), optimize=False)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for t_cut, n_cut in ((T, N), (2, N), (1, N)):
        sub = {k: (v[:t_cut, :n_cut] if k in ("x", "cont") else
                   v[:, :n_cut] if k in ("h0", "c0") else v[:n_cut]) for k, v in feeds.items()}
        got = dict(zip(names, sess.run(None, sub)))
        ref = _reference(kind, sub, w, static)
        close(got["y"], ref[0])
        if expose:
            close(got["hT"], ref[1])
            if kind == "LSTM":
                close(got["cT"], ref[2])


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static", [False, True])
def test_int8_quantizes_only_recurrent_weight_matrices(kind, static, tmp_path):
    from caffeq.quant import quantize
    model, feeds, _ = _recurrent(kind, static, False, np.random.default_rng(22))
    q = quantize(model, "int8", keep="none")
    node = q.graph.node("r")
    shapes = node.expected_param_shapes
    assert set(node.quant) <= {i for i, s in enumerate(shapes) if len(s) == 2}
    assert {0, 2} <= set(node.quant)
    for i, s in enumerate(shapes):
        if len(s) == 1:
            np.testing.assert_array_equal(node.blobs[i], model.graph.node("r").blobs[i])
    b = [np.asarray(x, np.float64) for x in node.blobs]
    if kind == "LSTM":
        ref = np_lstm(feeds["x"], feeds["cont"], b[0], b[1], b[-1], feeds.get("xs"), b[2] if static else None)
    else:
        ref = np_rnn(feeds["x"], feeds["cont"], *b[:2], *b[-3:], feeds.get("xs"), b[2] if static else None)
    close(q.run(feeds)["y"], ref[0])
    try:
        import onnxruntime  # noqa: F401

        import caffeq.backends.onnx_backend  # noqa: F401
    except ImportError:
        return
    close(_ort_run(q, feeds, tmp_path)["y"], ref[0])


def test_scale_bias_prelu_parameters_are_not_quantized():
    from caffeq.quant import quantize
    model = load({"x": X4}, 'layer { name: "c" type: "Convolution" bottom: "x" top: "c" '
                            'convolution_param { num_output: 4 kernel_size: 1 } }\n'
                            'layer { name: "p" type: "PReLU" bottom: "c" top: "p" }\n'
                            'layer { name: "s" type: "Scale" bottom: "p" top: "s" scale_param { bias_term: true } }\n'
                            'layer { name: "b" type: "Bias" bottom: "s" top: "b" }\n'
                            'layer { name: "c2" type: "Convolution" bottom: "b" top: "c2" '
                            'convolution_param { num_output: 4 kernel_size: 1 } }\n')
    q = quantize(model, "int8", keep="none")
    for name in ("p", "s", "b"):
        assert not getattr(q.graph.node(name), "quant", None), name
        for a, b in zip(q.graph.node(name).blobs, model.graph.node(name).blobs):
            np.testing.assert_array_equal(a, b)
    assert q.graph.node("c").quant


def test_r3cnns_subtract_is_the_first_bottom_minus_the_second(tmp_path):
    # RojunLin/R-3CNN's R2Net: subtract = resx16_elewise - p_resx16_elewise; eltwise_layer.cpp copies bottom 0
    # and axpys -1 x bottom 1, its coeff never read
    from conftest import check_everywhere, net, rng
    a, b = (rng(s).standard_normal((2, 3, 4, 5)).astype(np.float32) for s in (1, 2))
    model = load_from_text(net('layer { name: "s" type: "Eltwise" bottom: "a" bottom: "b" top: "s" '
                               'eltwise_param { operation: SUBTRACT coeff: 2 coeff: 3 } }',
                               inputs={"a": a.shape, "b": b.shape}))
    check_everywhere(model, {"a": a, "b": b}, {"s": a - b}, tmp_path)
    with pytest.raises(LayerError, match=r"Eltwise takes 2 bottoms"):
        load_from_text(net('layer { name: "s" type: "Eltwise" bottom: "a" bottom: "b" bottom: "a" top: "s" '
                           'eltwise_param { operation: SUBTRACT } }', inputs={"a": a.shape, "b": b.shape}))
