"""XmBrain/Quantizer's LSTMRistretto (9b1ef66): BVLC's unrolled LSTM with the per-layer fixed-point formats of its
quantize_file.

The reference transcribes the fork: Trim2FixedPoint_cpu clamps to [-2^(bw-1), 2^(bw-1) - 1] (signed) or
[0, 2^bw - 1] (is_sign_data 0) steps of 2^-fl, then rounds weights with round() (halves away from zero) and data
with floor().  x_transform rounds W_xc and b_c (b_c's fl = bw - ceil(log2 max|b| + 1)) and floors its product;
the two Slices floor their first top only (cont_1, W_xc x_1); each transform_t rounds the shared W_hc again (in
place: step t's weights are step t-1's rounded with step t's format) and floors W_hc h'; each gate_input_t floors
the sum; each unit_t floors c_t after h_t = o * tanh(c_t); h_concat (ConcatRistretto) and the layer itself floor
the h sequence.  Inputs and weights are dyadic, so every product and sum before a sigmoid or tanh is exact.
"""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.layers.ristretto_lstm import bias_trim
from caffeq.model import load, load_from_text


def fmt(bw, fl, signed=True):
    step = 2.0 ** -fl
    top = 2.0 ** (bw - 1 if signed else bw)
    return (-top * step if signed else 0.0), (top - 1) * step, step


def floor_ref(x, f):
    if f is None:
        return x
    low, high, step = f
    return (np.floor(np.clip(x, low, high) / step) * step).astype(np.float32)


def round_ref(x, f):
    if f is None:
        return x
    low, high, step = f
    v = np.clip(x, low, high) / step
    return (np.sign(v) * np.floor(np.abs(v) + 0.5) * step).astype(np.float32)


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def lstm_ref(x, cont, w_xc, b_c, w_hc, q, h=None, c=None, xs=None, w_s=None):
    """The fork's unrolled net in float64; q holds the formats (None: the layer stays in float)."""
    t_len, n = x.shape[:2]
    hd = w_hc.shape[1]
    b_fl = q["b_bw"] - int(np.ceil(np.log2(np.float32(np.abs(b_c).max())) + 1))
    gx = x.reshape(t_len, n, -1) @ round_ref(w_xc, q["x_w"]).T.astype(np.float64) + round_ref(b_c, fmt(q["b_bw"], b_fl))
    gx = floor_ref(gx, q["x_out"])
    static = None
    if xs is not None:
        static = floor_ref(xs.reshape(n, -1) @ round_ref(w_s, q["s_w"]).T.astype(np.float64), q["s_out"])
    h = np.zeros((n, hd)) if h is None else h
    c = np.zeros((n, hd)) if c is None else c
    w = w_hc
    hs = []
    for t in range(t_len):
        ct = floor_ref(cont[t], q["cont"]) if t == 0 else cont[t]
        gt = floor_ref(gx[t], q["x_first"]) if t == 0 else gx[t]
        w = round_ref(w, q["w"][t])
        gates = floor_ref((ct[:, None] * h) @ w.T.astype(np.float64), q["wh"][t]) + gt
        if static is not None:
            gates = gates + static
        gates = floor_ref(gates, q["gate"][t])
        i, f, o, g = np.split(gates, 4, axis=1)
        c = ct[:, None] * sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        c = floor_ref(c, q["cell"][t])
        hs.append(h)
    return floor_ref(floor_ref(np.stack(hs), q["concat"]), q["top"]), h, c


def entry(name, type_, bw_p=8, fl_p=0, bw_d=8, fl_d=0, sign=1):
    return (f'layer {{ name: "{name}" type: "{type_}" quantization_param {{ bw_params: {bw_p} fl_params: {fl_p} '
            f'bw_layer_data: {bw_d} fl_layer_data: {fl_d} is_sign_data: {sign} }} }}\n')


def quantize_file(path, steps, static=False, extra=""):
    """A quantize file as the fork's generator writes it for LSTM "l" (weights' formats change at step 3)."""
    text = entry("l_Input_c0h0", "Input") + entry("l_", "Split") + entry("l_cont_slice", "SliceRistretto", 8, 0, 8, 8, 0)
    text += entry("l_x_transform", "InnerProductRistretto", 6, 4, 8, 3) + entry("l_W_xc_x_slice", "SliceRistretto", 8, 0, 8, 2)
    text += entry("l_h_concat", "ConcatRistretto", 8, 0, 8, 6)
    if static:
        text += entry("l_W_xc_x_static", "InnerProductRistretto", 5, 3, 8, 4) + entry("l_W_xc_x_static_reshape", "Reshape")
    for t in range(1, steps + 1):
        text += entry(f"l_h_conted_{t - 1}", "Scale")
        text += entry(f"l_transform_{t}", "InnerProductRistretto", 8, 5 if t < 3 else 6, 8, 3 + t % 2)
        text += entry(f"l_gate_input_{t}", "EltwiseRistretto", 8, 0, 8, 3)
        text += entry(f"l_unit_{t}", "LSTMUnitRistretto", 8, 0, 8, 4 + t % 3)
    path.write_text(text + extra)
    return path


def formats(steps, static=False):
    return {"cont": fmt(8, 8, False), "x_w": fmt(6, 4), "b_bw": 6, "x_out": fmt(8, 3), "x_first": fmt(8, 2),
            "s_w": fmt(5, 3) if static else None, "s_out": fmt(8, 4) if static else None, "concat": fmt(8, 6),
            "top": fmt(8, 5), "w": [fmt(8, 5 if t < 3 else 6) for t in range(1, steps + 1)],
            "wh": [fmt(8, 3 + t % 2) for t in range(1, steps + 1)], "gate": [fmt(8, 3)] * steps,
            "cell": [fmt(8, 4 + t % 3) for t in range(1, steps + 1)]}


def layer(qfile, bottoms, expose=False):
    return ('layer { name: "l" type: "LSTMRistretto" ' + " ".join(f'bottom: "{b}"' for b in bottoms) + ' top: "y" '
            + ('top: "hT" top: "cT" ' if expose else "") + 'recurrent_param { num_output: 3 '
            + ('expose_hidden: true ' if expose else "") + '} quantization_param { bw_params: 0 fl_params: 0 '
            f'bw_layer_data: 8 fl_layer_data: 5 is_sign_data: 1 quantize_file: "{qfile}" }} }}')


def dyadic(r, shape, scale, spread):
    return (r.integers(-spread, spread, shape) / scale).astype(np.float32)


def test_lstm_ristretto_rounds_every_unrolled_layer_with_its_format(tmp_path):
    t_len, n = 5, 2
    q = quantize_file(tmp_path / "q.prototxt", t_len)
    model = load_from_text(net(layer(q, ["x", "cont"]), inputs={"x": (t_len, n, 3, 2), "cont": (t_len, n)}),
                           random_weights=True)
    r = rng(91)
    x = dyadic(r, (t_len, n, 3, 2), 8, 24)
    cont = np.ones((t_len, n), np.float32)
    cont[3, 1] = 0
    w_xc, b_c, w_hc = dyadic(r, (12, 6), 32, 80), dyadic(r, (12,), 64, 45), dyadic(r, (12, 3), 64, 200)
    node_of(model, "l").blobs = [w_xc, b_c, w_hc]
    model.clear_cache()
    y, _, _ = lstm_ref(x, cont, w_xc, b_c, w_hc, formats(t_len))
    assert not np.array_equal(floor_ref(y, fmt(8, 5)), np.zeros_like(y))
    check_everywhere(model, {"x": x, "cont": cont}, {"y": y.astype(np.float32)}, tmp_path, atol=1e-6, opsets=())


def test_static_input_and_exposed_states(tmp_path):
    t_len, n = 4, 3
    q = quantize_file(tmp_path / "q.prototxt", t_len, static=True)
    shapes = {"x": (t_len, n, 5), "cont": (t_len, n), "s": (n, 2, 2), "h0": (1, n, 3), "c0": (1, n, 3)}
    model = load_from_text(net(layer(q, list(shapes), expose=True), inputs=shapes), random_weights=True)
    r = rng(92)
    x, s = dyadic(r, shapes["x"], 8, 24), dyadic(r, shapes["s"], 8, 24)
    h0, c0 = dyadic(r, shapes["h0"], 16, 12), dyadic(r, shapes["c0"], 16, 20)
    cont = np.array([[0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 1]], np.float32)
    w_xc, b_c, w_s, w_hc = (dyadic(r, (12, 5), 32, 80), dyadic(r, (12,), 16, 40), dyadic(r, (12, 4), 16, 30),
                            dyadic(r, (12, 3), 64, 200))
    node_of(model, "l").blobs = [w_xc, b_c, w_s, w_hc]
    model.clear_cache()
    y, h_t, c_t = lstm_ref(x, cont, w_xc, b_c, w_hc, formats(t_len, True), h0[0], c0[0], s, w_s)
    feeds = {"x": x, "cont": cont, "s": s, "h0": h0, "c0": c0}
    refs = {"y": y.astype(np.float32), "hT": h_t[None].astype(np.float32), "cT": c_t[None].astype(np.float32)}
    check_everywhere(model, feeds, refs, tmp_path, atol=1e-6, opsets=())


def test_the_quantize_file_is_found_next_to_the_prototxt(tmp_path):
    (tmp_path / "qz").mkdir()
    quantize_file(tmp_path / "qz" / "q.prototxt", 2, extra=entry("l_unit_9", "LSTMUnitRistretto"))
    text = net(layer("./qz/q.prototxt", ["x", "cont"]), inputs={"x": (2, 1, 4), "cont": (2, 1)})
    (tmp_path / "net.prototxt").write_text(text)
    model = load(str(tmp_path / "net.prototxt"), random_weights=True)
    y = model.run({"x": np.ones((2, 1, 4), np.float32), "cont": np.ones((2, 1), np.float32)})["y"]
    assert y.shape == (2, 1, 3)


def test_without_its_quantize_file_the_net_reads_but_does_not_run(tmp_path):
    model = load_from_text(net(layer(tmp_path / "none.prototxt", ["x", "cont"]), inputs={"x": (2, 1, 4), "cont": (2, 1)}),
                           random_weights=True)
    with pytest.raises(CaffeqError, match=r"quantize_file '.*none.prototxt' not found \(next to the prototxt or in the "
                                          r"current folder\): the fork reads each unrolled layer's fixed-point format"):
        model.run({"x": np.ones((2, 1, 4), np.float32), "cont": np.ones((2, 1), np.float32)})


def test_onnx_is_refused_in_one_line(tmp_path):
    q = quantize_file(tmp_path / "q.prototxt", 2)
    model = load_from_text(net(layer(q, ["x", "cont"]), inputs={"x": (2, 1, 4), "cont": (2, 1)}), random_weights=True)
    with pytest.raises(CaffeqError, match="LSTMRistretto rounds each unrolled step with its own fixed-point formats"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_a_ristretto_entry_the_fork_has_no_layer_for_is_refused(tmp_path):
    q = tmp_path / "q.prototxt"
    q.write_text(entry("l_h_conted_0", "ScaleRistretto"))
    with pytest.raises(CaffeqError, match=r"quantize_file entry 'l_h_conted_0' \(ScaleRistretto\) makes the unrolled "
                                          r"Scale a ScaleRistretto, a type the fork does not have"):
        load_from_text(net(layer(q, ["x", "cont"]), inputs={"x": (2, 1, 4), "cont": (2, 1)}))


def test_the_bias_format_comes_from_its_largest_magnitude():
    assert bias_trim(np.zeros(3, np.float32), 8) is None
    assert bias_trim(np.array([0.7, -0.2], np.float32), 8) == fmt(8, 7)
    assert bias_trim(np.array([-2.0, 0.5], np.float32), 8) == fmt(8, 6)
