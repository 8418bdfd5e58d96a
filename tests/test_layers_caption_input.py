"""fanchenyou/deepdiary's CaptionInput (caffeq/layers/caption_input.py) and its Lstm (T = sequence_len + 1,
lstm_param.hidden_size), against loops written here from caption_input_layer.cpp and the LstmLayer's GPU
forward (lstm_ref), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng
from test_layers_sequence import lstm_ref

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32
CAPTION = ('layer {{ name: "input" type: "CaptionInput" bottom: "img" bottom: "sent" top: "x" caption_input_param {{ '
           'hidden_size: {h} vocabulary_size: {v} image_size: {p} sequence_len: {s} }} }}')
LSTM = 'layer {{ name: "lstm1" type: "Lstm" bottom: "x" top: "h" lstm_param {{ hidden_size: {h} sequence_len: {s} }} }}'


def caption_ref(img, sent, w_e, b_e, w_s):
    """Row t * N + n: We img[n] + be at t = 0, Ws[int(sent[n, t - 1])] after it, 0 for an id below 0."""
    n, steps = img.shape[0], sent.shape[1] + 1
    out = np.zeros((steps * n, w_s.shape[1]))
    for s in range(n):
        out[s] = w_e.astype(np.float64) @ img[s].astype(np.float64) + b_e
        for t in range(1, steps):
            word = int(sent[s, t - 1])          # C's truncation
            if word >= 0:
                out[t * n + s] = w_s[word]
    return out


def test_caption_rows_then_lstm_match_the_loops(tmp_path):
    n, h, v, p, s = 3, 4, 9, 5, 6
    img = rng(70).standard_normal((n, p)).astype(F32)
    sent = (rng(71).integers(-1, v, (n, s)) + 0.7 * (rng(72).random((n, s)) > 0.5)).astype(F32)   # 2.7 -> 2
    sent[0, 0] = -0.5                       # truncates to 0: a real word
    model = load_from_text(net(CAPTION.format(h=h, v=v, p=p, s=s), LSTM.format(h=h, s=s),
                               inputs={"img": img.shape, "sent": sent.shape}), random_weights=True,
                           outputs=["x", "h"])
    assert model.blob_shapes["x"] == model.blob_shapes["h"] == ((s + 1) * n, h)
    w_e, b_e, w_s = (np.asarray(b) for b in node_of(model, "input").blobs)
    assert (w_e.shape, b_e.shape, w_s.shape) == ((h, p), (h,), (v, h))
    rows = caption_ref(img, sent, w_e, b_e, w_s)
    w_x, w_h, b = (np.asarray(b_) for b_ in node_of(model, "lstm1").blobs)
    assert w_x.shape == w_h.shape == (4 * h, h)
    check_everywhere(model, {"img": img, "sent": sent},
                     {"x": rows, "h": lstm_ref(rows.astype(F32), w_x, w_h, b, n=n)}, tmp_path, atol=2e-5, rtol=1e-5)


def test_deepdiary_shapes_and_ids_are_checked():
    with pytest.raises(CaffeqError, match="sequence_len 6"):
        load_from_text(net(CAPTION.format(h=4, v=9, p=5, s=6), inputs={"img": (2, 5), "sent": (2, 5)}))
    with pytest.raises(CaffeqError, match="T = sequence_len \\+ 1 = 7 and H = hidden_size 4"):
        load_from_text(net(LSTM.format(h=4, s=6), inputs={"x": (14, 5)}))
    model = load_from_text(net(CAPTION.format(h=4, v=9, p=5, s=2), inputs={"img": (1, 5), "sent": (1, 2)}),
                           random_weights=True)
    with pytest.raises(CaffeqError, match="past vocabulary_size 9"):
        model.run({"img": np.zeros((1, 5), F32), "sent": np.array([[3, 9]], F32)})
