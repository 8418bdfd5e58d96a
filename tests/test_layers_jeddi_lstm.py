"""VisionLearningGroup/JEDDi-Net's (76c2769) LSTMTopic and LSTMController (caffe3d lstm_topic_layer.cpp,
lstm_controller_layer.cpp, recurrent_layer.cpp, lstm_unit_layer.cpp): references written from their unrolled
nets, step by step in float64, on T=3, N=2 and odd feature sizes."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

F = np.float32
T, N, K, KS, KT, H = 3, 2, 5, 7, 3, 3
CORPUS = REPO / "tests" / "fixtures" / "realworld"
STEM = "VisionLearningGroup__JEDDi-Net__experiments__denseCap_jeddiNet_end2end__test__"


def sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def unrolled_ref(kind, x, cont, blobs, xs=None, xt=None, h0=None, c0=None):
    """The fork's unrolled net, one stream and one step at a time:
    W_xc_x_t = W_xc x_t + b_c (x_transform), x_conted_t = cont_t W_xc_x_t (LSTMController only),
    gate_input_t = W_hc (cont_t h_{t-1}) + [x_conted_t | W_xc_x_t] + W_xc_static x_static
    (+ W_xc_topic x_topic, LSTMTopic), then LSTMUnit (i, f, o, g; f = 0 where cont_t = 0)."""
    names = ["W_xc", "b_c"] + (["W_xc_static"] if xs is not None else [])
    names += ["W_xc_topic"] if xt is not None and kind == "LSTMTopic" else []
    w = {name: b.astype(np.float64) for name, b in zip(names + ["W_hc"], blobs, strict=True)}
    t_len, n = cont.shape
    hd = w["W_hc"].shape[1]
    h = np.zeros((n, hd)) if h0 is None else h0.reshape(n, hd).astype(np.float64)
    c = np.zeros((n, hd)) if c0 is None else c0.reshape(n, hd).astype(np.float64)
    out = np.zeros((t_len, n, hd))
    for t in range(t_len):
        for s in range(n):
            ct = float(cont[t, s])
            x_term = w["W_xc"] @ x[t, s].reshape(-1).astype(np.float64) + w["b_c"]
            if kind == "LSTMController":
                x_term = ct * x_term
            pre = w["W_hc"] @ (ct * h[s]) + x_term
            if "W_xc_static" in w:
                pre = pre + w["W_xc_static"] @ xs[s].reshape(-1).astype(np.float64)
            if "W_xc_topic" in w:
                pre = pre + w["W_xc_topic"] @ xt[s].reshape(-1).astype(np.float64)
            i = np.array([sigmoid(v) for v in pre[:hd]])
            f = 0.0 if ct == 0 else ct * np.array([sigmoid(v) for v in pre[hd:2 * hd]])
            o = np.array([sigmoid(v) for v in pre[2 * hd:3 * hd]])
            g = np.tanh(pre[3 * hd:])
            c[s] = f * c[s] + i * g
            h[s] = o * np.tanh(c[s])
            out[t, s] = h[s]
    return out.astype(F), h.astype(F)[None], c.astype(F)[None]


def layer(kind, bottoms, tops=("h",), params=""):
    return (f'layer {{ name: "l" type: "{kind}" ' + " ".join(f'bottom: "{b}"' for b in bottoms) + " "
            + " ".join(f'top: "{t}"' for t in tops) + f" recurrent_param {{ num_output: {H} {params} }} }}")


def feeds_for(seed):
    r = rng(seed)
    cont = np.ones((T, N), F)
    cont[0] = 0
    cont[2, 1] = 0                               # stream 1 starts again at t = 2
    cont[1, 0] = 0.5                             # a non-binary marker: every Scale by cont_t shows
    return {"x": r.standard_normal((T, N, K, 1)).astype(F), "cont": cont,
            "xs": r.standard_normal((N, KS)).astype(F), "xt": r.standard_normal((N, KT, 1)).astype(F),
            "h0": r.uniform(-1, 1, (1, N, H)).astype(F), "c0": r.uniform(-1, 1, (1, N, H)).astype(F)}


def loaded(text, seed):
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "l")
    blobs = [rng(seed + i).uniform(-0.7, 0.7, s).astype(F) for i, s in enumerate(node.expected_param_shapes)]
    node.blobs[:] = blobs
    return model, node, blobs


SHAPES = {"x": (T, N, K, 1), "cont": (T, N), "xs": (N, KS), "xt": (N, KT, 1), "h0": (1, N, H), "c0": (1, N, H)}


@pytest.mark.parametrize("kind", ["LSTMTopic", "LSTMController"])
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_unrolled_steps(kind, extra, tmp_path):
    bottoms = ["x", "cont", "xs", "xt"][:2 + extra]
    model, node, blobs = loaded(net(layer(kind, bottoms), inputs={b: SHAPES[b] for b in bottoms}), 3 * extra)
    topic = extra == 2 and kind == "LSTMTopic"
    want_names = ("W_xc", "b_c") + (("W_xc_static",) if extra else ()) + (("W_xc_topic",) if topic else ()) + ("W_hc",)
    assert node.spec.blob_names_for(node.attrs) == want_names
    want_shapes = [(4 * H, K), (4 * H,)] + ([(4 * H, KS)] if extra else []) + ([(4 * H, KT)] if topic else [])
    assert [tuple(s) for s in node.expected_param_shapes] == want_shapes + [(4 * H, H)]
    f = feeds_for(extra)
    feeds = {b: f[b] for b in bottoms}
    want = unrolled_ref(kind, f["x"], f["cont"], blobs, f["xs"] if extra else None, f["xt"] if extra == 2 else None)
    check_everywhere(model, feeds, {"h": want[0]}, tmp_path, atol=2e-6, rtol=1e-5)


def test_controller_input_term_follows_cont():
    # the controller zeroes W_xc x + b_c where cont is 0; LSTMTopic (BVLC's rule) keeps it
    f = feeds_for(5)
    outs = {}
    for kind in ("LSTMTopic", "LSTMController"):
        model, _, blobs = loaded(net(layer(kind, ["x", "cont"]), inputs={b: SHAPES[b] for b in ("x", "cont")}), 9)
        outs[kind] = model.run({"x": f["x"], "cont": f["cont"]})["h"]
    assert np.abs(outs["LSTMTopic"][0] - outs["LSTMController"][0]).max() > 1e-3
    zero_x = f["x"] * 0                      # with cont 0 at t = 0 the controller's first step sees no input
    model, _, blobs = loaded(net(layer("LSTMController", ["x", "cont"]),
                                 inputs={b: SHAPES[b] for b in ("x", "cont")}), 9)
    np.testing.assert_allclose(model.run({"x": zero_x, "cont": f["cont"]})["h"][0], outs["LSTMController"][0],
                               atol=1e-7)


@pytest.mark.parametrize("kind", ["LSTMTopic", "LSTMController"])
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_expose_hidden_after_the_static_and_topic_inputs(kind, extra, tmp_path):
    # recurrent_layer.cpp: h_0, c_0 are the last two bottoms, after x_static and x_topic when present
    bottoms = ["x", "cont", "xs", "xt"][:2 + extra] + ["h0", "c0"]
    text = net(layer(kind, bottoms, ("h", "hT", "cT"), "expose_hidden: true"),
               inputs={b: SHAPES[b] for b in bottoms})
    model, _, blobs = loaded(text, 20 + extra)
    f = feeds_for(7)
    f["cont"][0] = [1, 0.5]                  # h_0 and c_0 reach the first step (cont_1 h_0, cont_1 f c_0)
    h, h_t, c_t = unrolled_ref(kind, f["x"], f["cont"], blobs, f["xs"] if extra else None,
                               f["xt"] if extra == 2 else None, f["h0"], f["c0"])
    check_everywhere(model, {b: f[b] for b in bottoms}, {"h": h, "hT": h_t, "cT": c_t}, tmp_path,
                     atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("text, msg", [
    (layer("LSTMTopic", ["x", "cont", "xs", "xt", "h0"]),
     r"LSTMTopic takes 2, 3 or 4 bottoms \(x, cont, \[x_static\], \[x_topic\]\) and one top, got 5"),
    (layer("LSTMTopic", ["x", "cont", "xs", "bad"]), r"bottom\[3\] \(x_topic\) must be N x \.\.\. with N = 2"),
    # recurrent_layer.cpp checks a fourth bottom's N for LSTMController too, which then leaves it unused
    (layer("LSTMController", ["x", "cont", "xs", "bad"]), r"bottom\[3\] \(x_topic\) must be N x \.\.\. with N = 2"),
    (layer("LSTMController", ["x", "cont"]).replace(f"num_output: {H}", "num_output: 0"),
     "recurrent_param.num_output must be positive"),
])
def test_bad_layers_are_one_line_errors(text, msg):
    shapes = dict(SHAPES, bad=(N + 1, 4))
    bottoms = [b for b in shapes if f'bottom: "{b}"' in text]
    with pytest.raises(LayerError, match=msg) as e:
        load_from_text(net(text, inputs={b: shapes[b] for b in bottoms}))
    assert "\n" not in str(e.value)


def corpus(name):
    return str(CORPUS / f"{STEM}{name}")


def test_corpus_controller_runs_with_random_weights():
    model = load(corpus("lstm_controller.deploy.prototxt"), random_weights=True)
    node = node_of(model, "lstm_controller")
    assert [tuple(s) for s in node.expected_param_shapes] == [(80, 300), (80,), (80, 4096), (80, 20)]
    r = rng(11)
    feeds = {"cont_sent_controller": np.ones((1, 1), F),
             "embedded_input_sent_pool_controller": r.standard_normal((1, 1, 300)).astype(F),
             "fc6_controller": r.standard_normal((1, 4096)).astype(F)}
    out = model.run(feeds)["lstm_controller_reshape"]
    want = unrolled_ref("LSTMController", feeds["embedded_input_sent_pool_controller"],
                        feeds["cont_sent_controller"], [np.asarray(b) for b in node.blobs],
                        feeds["fc6_controller"])[0]
    np.testing.assert_allclose(out, want.reshape(1, 20), atol=2e-6, rtol=1e-5)


def test_corpus_topic_lstm_runs_with_random_weights():
    model = load(corpus("test_lstm.prototxt"), random_weights=True)
    node = node_of(model, "lstm2_2")
    assert [tuple(s) for s in node.expected_param_shapes] == [(2048, 512), (2048,), (2048, 4096), (2048, 20),
                                                              (2048, 512)]
    r = rng(12)
    feeds = {"cont_sentence": np.zeros((1, 1), F), "input_sentence": np.array([[7]], F),
             "fc6": r.standard_normal((1, 4096)).astype(F), "lstm_controller_gt": r.standard_normal((1, 20)).astype(F)}
    probs = model.run(feeds)["probs"]
    assert probs.shape == (1, 1, 3892)
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-5)
