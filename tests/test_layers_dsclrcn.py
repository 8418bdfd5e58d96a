"""nian-liu/DSCLRCN's spatial-LSTM layers (fbbd35f spatialtransformer_layer.cpp transform_cpu,
srnnformat_layer.cpp format_cpu / unformat_cpu, lstm_layer.cpp + lstm_unit_layer.cpp with
lstm_additional_forget_bias and static_input_only_start): references from those loops, on asymmetric
shapes."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def transform_ref(x, mirror, rotate, undo):
    """transform_cpu: output[top_index] = input[bottom_index], pixel by pixel."""
    n, c, in_h, in_w = x.shape
    if undo and rotate in (1, 3):
        rotate = 4 - rotate
    out_h, out_w = (in_w, in_h) if rotate in (1, 3) else (in_h, in_w)
    out = np.full((n, c, out_h, out_w), np.nan, F)
    for h in range(in_h):
        for w in range(in_w):
            h_idx, w_idx = h, w
            if not undo and mirror:
                w_idx = in_w - 1 - w
            if rotate == 1:
                h_idx, w_idx = w_idx, in_h - 1 - h_idx
            elif rotate == 2:
                h_idx, w_idx = in_h - 1 - h_idx, in_w - 1 - w_idx
            elif rotate == 3:
                h_idx, w_idx = in_w - 1 - w_idx, h_idx
            if undo and mirror:
                w_idx = out_w - 1 - w_idx
            out[:, :, h_idx, w_idx] = x[:, :, h, w]
    return out


ROTATIONS = ["NOROTATE", "ROTATE90", "ROTATE180", "ROTATE270"]


def st_layer(name, bottom, top, mirror, rotate, op):
    return (f'layer {{ name: "{name}" type: "SpatialTransformer" bottom: "{bottom}" top: "{top}" '
            f'spatialtransformer_param {{ mirror: {str(mirror).lower()} rotate: {rotate} operation: {op} }} }}')


@pytest.mark.parametrize("mirror", [True, False])
@pytest.mark.parametrize("rotate", range(4))
def test_mirror_rotate_and_its_inverse(mirror, rotate, tmp_path):
    shape = (2, 3, 4, 5)
    text = net(st_layer("t", "x", "t", mirror, ROTATIONS[rotate], "TRANSFORM"),
               st_layer("u", "t", "u", mirror, ROTATIONS[rotate], "UNTRANSFORM"), inputs={"x": shape})
    model = load_from_text(text, outputs=["t", "u"])
    x = rng(rotate).standard_normal(shape).astype(F)
    moved = transform_ref(x, mirror, rotate, False)
    back = transform_ref(moved, mirror, rotate, True)
    assert not np.isnan(moved).any()
    np.testing.assert_array_equal(back, x)                # UNTRANSFORM undoes TRANSFORM
    check_everywhere(model, {"x": x}, {"t": moved, "u": back}, tmp_path)


def test_other_spatial_transformers_stay_daerduocareys():
    text = net('layer { name: "st" type: "SpatialTransformer" bottom: "x" bottom: "theta" top: "o" '
               'st_param { output_H: 3 output_W: 4 } }', inputs={"x": (1, 2, 5, 6), "theta": (1, 6)})
    assert load_from_text(text).blob_shapes["o"] == (1, 2, 3, 4)


def format_ref(x):
    n, c, h, w = x.shape
    streams, indicator = np.zeros((w, n * h, c), F), np.zeros((w, n * h), F)
    for t in range(w):
        for i in range(n):
            for r in range(h):
                indicator[t, i * h + r] = int(t != 0)
                for ch in range(c):
                    streams[t, i * h + r, ch] = x[i, ch, r, t]
    return streams, indicator


def unformat_ref(streams, h):
    t_len, nh, c = streams.shape
    out = np.zeros((nh // h, c, h, t_len), F)
    for t in range(t_len):
        for i in range(nh // h):
            for r in range(h):
                out[i, :, r, t] = streams[t, i * h + r, :]
    return out


def test_rows_become_streams_and_back(tmp_path):
    shape = (2, 3, 4, 5)
    text = net('layer { name: "f" type: "SRNNFormat" bottom: "x" top: "s" top: "ind" top: "size" '
               'srnnformat_param { operation: FORMAT } }',
               'layer { name: "neg" type: "Power" bottom: "s" top: "s2" power_param { scale: -2 } }',
               'layer { name: "u" type: "SRNNFormat" bottom: "s2" bottom: "size" top: "o" '
               'srnnformat_param { operation: UNFORMAT } }', inputs={"x": shape})
    model = load_from_text(text, outputs=["s", "ind", "size", "o"])
    assert model.blob_shapes["size"] == () and model.blob_shapes["o"] == shape
    x = rng(1).standard_normal(shape).astype(F)
    streams, indicator = format_ref(x)
    refs = {"s": streams, "ind": indicator, "size": np.array(4, F), "o": unformat_ref(F(-2) * streams, 4)}
    check_everywhere(model, {"x": x}, refs, tmp_path)


@pytest.mark.parametrize("inputs, msg", [
    ({"s": (5, 8, 3), "size": ()}, "only a FORMAT layer's third top gives"),
    ({"s": (5, 8, 3, 1), "size": ()}, r"takes \(T, streams, C\) and a scalar"),
])
def test_unformat_needs_a_format_layers_stream_size(inputs, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net('layer { name: "u" type: "SRNNFormat" bottom: "s" bottom: "size" top: "o" '
                           'srnnformat_param { operation: UNFORMAT } }', inputs=inputs))


def test_unformat_refuses_streams_that_are_not_whole_images():
    text = net('layer { name: "f" type: "SRNNFormat" bottom: "x" top: "s" top: "ind" top: "size" }',
               'layer { name: "sl" type: "Slice" bottom: "s" top: "a" top: "b" slice_param { axis: 1 slice_point: 3 } }',
               'layer { name: "u" type: "SRNNFormat" bottom: "a" bottom: "size" top: "o" '
               'srnnformat_param { operation: UNFORMAT } }', inputs={"x": (2, 3, 4, 5)})
    with pytest.raises(LayerError, match="3 streams are not whole images of 4 rows"):
        load_from_text(text)


def sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def lstm_ref(x, cont, x_static, w_xc, b_c, w_s, w_hc, forget_bias, static_first_only):
    """The unrolled net: gate_input_t = W_hc (cont_t h_{t-1}) + W_xc x_t + b_c (+ W_s x_static at t = 0
    only, or every t); LSTMUnit with sigmoid(f + additional_forget_bias), in float64."""
    t_len, n = x.shape[:2]
    hd = w_hc.shape[1]
    h, c = np.zeros((n, hd)), np.zeros((n, hd))
    out = np.zeros((t_len, n, hd))
    static = x_static.reshape(n, -1).astype(np.float64) @ w_s.T.astype(np.float64)
    for t in range(t_len):
        for s in range(n):
            pre = (w_hc.astype(np.float64) @ (cont[t, s] * h[s]) + w_xc.astype(np.float64) @ x[t, s].reshape(-1)
                   + b_c)
            if t == 0 or not static_first_only:
                pre = pre + static[s]
            i, f = [sigmoid(v) for v in pre[:hd]], [sigmoid(v + forget_bias) for v in pre[hd:2 * hd]]
            o, g = [sigmoid(v) for v in pre[2 * hd:3 * hd]], np.tanh(pre[3 * hd:])
            c[s] = cont[t, s] * np.array(f) * c[s] + np.array(i) * g
            h[s] = np.array(o) * np.tanh(c[s])
            out[t, s] = h[s]
    return out.astype(F)


@pytest.mark.parametrize("static_first_only", [True, False])
def test_lstm_forget_bias_and_static_input_at_the_start(static_first_only, tmp_path):
    t_len, n, k, ks, hd = 4, 3, 5, 2, 6
    flag = "static_input_only_start: true" if static_first_only else ""
    text = net(f'layer {{ name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" bottom: "xs" top: "h" '
               f'recurrent_param {{ num_output: {hd} lstm_additional_forget_bias: 1 {flag} }} }}',
               inputs={"x": (t_len, n, k), "cont": (t_len, n), "xs": (n, ks)})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "lstm")
    blobs = [rng(i).uniform(-0.6, 0.6, s).astype(F) for i, s in enumerate(node.expected_param_shapes)]
    node.blobs[:] = blobs
    x = rng(7).standard_normal((t_len, n, k)).astype(F)
    cont = np.ones((t_len, n), F)
    cont[0] = 0
    cont[2, 1] = 0                                     # a stream that starts again
    xs = rng(8).standard_normal((n, ks)).astype(F)
    want = lstm_ref(x, cont, xs, *blobs, 1.0, static_first_only)
    check_everywhere(model, {"x": x, "cont": cont, "xs": xs}, {"h": want}, tmp_path, atol=2e-6, rtol=1e-5)


def test_rnn_static_input_at_the_start_only(tmp_path):
    # rnn_layer.cpp has the same (t == 1 || !static_input_only_start) condition as the LSTM
    t_len, n, k, ks, hd = 4, 2, 3, 2, 5
    text = net(f'layer {{ name: "rnn" type: "RNN" bottom: "x" bottom: "cont" bottom: "xs" top: "o" '
               f'recurrent_param {{ num_output: {hd} static_input_only_start: true }} }}',
               inputs={"x": (t_len, n, k), "cont": (t_len, n), "xs": (n, ks)})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "rnn")
    blobs = [rng(i + 10).uniform(-0.6, 0.6, s).astype(F) for i, s in enumerate(node.expected_param_shapes)]
    node.blobs[:] = blobs
    w_xh, b_h, w_s, w_hh, w_ho, b_o = (b.astype(np.float64) for b in blobs)
    x = rng(20).standard_normal((t_len, n, k)).astype(F)
    cont = np.ones((t_len, n), F)
    cont[0] = 0
    xs = rng(21).standard_normal((n, ks)).astype(F)
    h, want = np.zeros((n, hd)), np.zeros((t_len, n, hd))
    for t in range(t_len):
        pre = (cont[t][:, None] * h) @ w_hh.T + x[t] @ w_xh.T + b_h + (xs @ w_s.T if t == 0 else 0)
        h = np.tanh(pre)
        want[t] = np.tanh(h @ w_ho.T + b_o)
    check_everywhere(model, {"x": x, "cont": cont, "xs": xs}, {"o": want.astype(F)}, tmp_path, atol=2e-6, rtol=1e-5)
