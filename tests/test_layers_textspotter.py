"""tonghe90/textspotter's fork layers (aa36bbc; b552331 for e2e_best.pt's types): ReverseAxis and PointBilinear
run against numpy references written from the fork's C++ loops; AttLstm, AffineTransformer and the types without
source are sized and refuse to run in one line."""

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def reverse_ref(x, axis):
    # reverse_cpu: index -> counts[axis] * (n - 2 * ind - 1) + index, counts[axis] = count(axis + 1)
    flat = x.reshape(-1)
    out = np.empty_like(flat)
    n = x.shape[axis]
    inner = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    for index in range(flat.size):
        ind = (index // inner) % n
        out[inner * (n - 2 * ind - 1) + index] = flat[index]
    return out.reshape(x.shape)


@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_reverse_axis(axis, tmp_path):
    x = rng(1).standard_normal((2, 3, 5, 4)).astype(F)
    text = net(f'layer {{ name: "r" type: "ReverseAxis" bottom: "x" top: "o" reverse_axis_param {{ axis: {axis} }} }}',
               inputs={"x": x.shape})
    check_everywhere(load_from_text(text), {"x": x}, {"o": reverse_ref(x, axis)}, tmp_path)


def test_reverse_axis_bad_axis():
    text = net('layer { name: "r" type: "ReverseAxis" bottom: "x" top: "o" reverse_axis_param { axis: 3 } }',
               inputs={"x": (2, 3, 5)})
    with pytest.raises(LayerError, match="reverse_axis_param.axis 3"):
        load_from_text(text)


def bilinear_ref(feat, pts, ids, ratio):
    # PointBilinearLayer::Forward_cpu and bilinear_interpolate, in float32
    n, c, hh_, ww_ = feat.shape
    p = pts.reshape(-1)[: 2 * pts.shape[0]].reshape(-1, 2)
    out = np.zeros((p.shape[0], c, 1, 1), F)
    for k in range(p.shape[0]):
        img = 0 if ids is None else int(ids.reshape(-1)[k])
        for ch in range(c):
            data = feat[img, ch]
            w = F(p[k, 0] * F(ratio))
            h = F(p[k, 1] * F(ratio))
            h = F(0) if h < 0 else h
            w = F(0) if w < 0 else w
            hl, wl = int(h), int(w)
            if hl >= hh_ - 1:
                hh = hl = hh_ - 1
                h = F(hl)
            else:
                hh = hl + 1
            if wl >= ww_ - 1:
                wh = wl = ww_ - 1
                w = F(wl)
            else:
                wh = wl + 1
            lh, lw = F(h - F(hl)), F(w - F(wl))
            rh, rw = F(F(1) - lh), F(F(1) - lw)
            w1, w2, w3, w4 = F(rh * rw), F(rh * lw), F(lh * rw), F(lh * lw)
            v = F(F(w1 * data[hl, wl]) + F(w2 * data[hl, wh]))
            v = F(v + F(w3 * data[hh, wl]))
            out[k, ch, 0, 0] = F(v + F(w4 * data[hh, wh]))
    return out


def _points(r, count, h, w, ratio):
    # inside, beyond each border, on the last row / column, negative
    x = r.uniform(-3, (w + 2) / ratio, count).astype(F)
    y = r.uniform(-3, (h + 2) / ratio, count).astype(F)
    x[0], y[0] = F((w - 1) / ratio), F((h - 1) / ratio)
    return np.stack([x, y], 1).reshape(count, 2, 1, 1)


@pytest.mark.parametrize("with_ids", [False, True])
def test_point_bilinear(with_ids, tmp_path):
    r = rng(2)
    feat = r.standard_normal((2, 3, 7, 5)).astype(F)
    pts = _points(r, 9, 7, 5, 0.25)
    ids = np.array([0, 1, 1, 0, 1, 0, 0, 1, 1], F).reshape(9, 1) if with_ids else None
    inputs = {"f": feat.shape, "p": pts.shape}
    bottoms = 'bottom: "f" bottom: "p"'
    feeds = {"f": feat, "p": pts}
    if with_ids:
        inputs["i"] = ids.shape
        bottoms += ' bottom: "i"'
        feeds["i"] = ids
    text = net(f'layer {{ name: "b" type: "PointBilinear" {bottoms} top: "o" point_bilinear_param {{ ratio: 0.25 }} }}',
               inputs=inputs)
    ref = bilinear_ref(feat, pts, ids, 0.25)
    assert ref.shape == (9, 3, 1, 1)
    check_everywhere(load_from_text(text), feeds, {"o": ref}, tmp_path)


def test_point_bilinear_bad_ratio():
    text = net('layer { name: "b" type: "PointBilinear" bottom: "f" bottom: "p" top: "o" '
               'point_bilinear_param { ratio: 0 } }', inputs={"f": (1, 2, 3, 4), "p": (3, 2, 1, 1)})
    with pytest.raises(LayerError, match="point_bilinear_param.ratio must be > 0"):
        load_from_text(text)


def test_att_lstm_sizes_and_refuses():
    t, n, c, e, d = 5, 2, 7, 3, 4
    text = net('layer { name: "dec" type: "AttLstm" bottom: "x" bottom: "cont" top: "h" top: "att" '
               f'recurrent_param {{ num_output: {d} }} }}', inputs={"x": (t, n, c, e), "cont": (t, n)})
    model = load_from_text(text, random_weights=True)
    assert tuple(model.blob_shapes["h"]) == (t, n, d)
    assert tuple(model.blob_shapes["att"]) == (t, n, e, 1)
    blobs = [tuple(b.shape) for b in model.params["dec"]]
    assert blobs == [(d, d), (d,), (d, c), (d,), (1, d), (4 * d, c), (4 * d,), (4 * d, d)] + [(1, d)] * (t - 1)
    x = np.zeros((t, n, c, e), F)
    with pytest.raises(LayerError, match=r"layer 'dec' \(AttLstm\): .*does not run it"):
        model.run({"x": x, "cont": np.ones((t, n), F)})


def test_affine_transformer_sizes():
    text = net('layer { name: "at" type: "AffineTransformer" bottom: "u" bottom: "th" top: "v" top: "cont" '
               'at_param { output_h: 8 output_w: 37 cont { scale: 2 shift: 1 scale: 2 shift: -1 } } }',
               inputs={"u": (2, 3, 9, 11), "th": (2, 5, 6)})
    model = load_from_text(text)
    assert tuple(model.blob_shapes["v"]) == (10, 3, 8, 37)
    assert tuple(model.blob_shapes["cont"]) == (((37 // 2) + 1) // 2 - 1, 10)


def test_affine_transformer_cont_count():
    text = net('layer { name: "at" type: "AffineTransformer" bottom: "u" bottom: "th" top: "v" top: "cont" '
               'at_param { output_w: 37 } }', inputs={"u": (2, 3, 9, 11), "th": (2, 5, 6)})
    with pytest.raises(LayerError, match="one at_param.cont per top"):
        load_from_text(text)
