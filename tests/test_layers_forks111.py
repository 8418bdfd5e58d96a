"""Fork items 111: KevinKecc/caffe-spn's SoftProposal, daerduoCarey/mycaffe's MaskTransformer, tiandunc/caffe-windows'
Hotspot, stupiding/face-detection's gated SigmoidCrossEntropyLoss (numpy references written from the forks' C++)."""
import math

import numpy as np
import pytest
import torch
from conftest import REPO, assert_close, check_everywhere, inspect_corpus_file, net, rng
from google.protobuf import text_format

from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.layers.registry import spec_for
from caffeq.model import load_from_text

F = np.float32
CORPUS = str(REPO / "tests" / "fixtures" / "realworld") + "/"


# ---- SoftProposal -------------------------------------------------------------------------------

def _soft_proposal_ref(x, factor, tol, iters):
    n, c, h, w = x.shape
    size = h * w
    out = np.zeros_like(x)
    dist = np.zeros((size, size), F)
    denom = F(-2) * F(factor) * F(factor)
    for u in range(size):
        for v in range(size):
            i, j, p, q = u // w, u % w, v // w, v % w
            dist[u, v] = np.exp(F((i - p) ** 2 + (j - q) ** 2) / denom, dtype=F)
    for b in range(n):
        flat = x[b].reshape(c, size)
        t = np.zeros((size, size), F)
        for u in range(size):
            for v in range(size):
                s = F(0)
                for k in range(c):
                    s = F(s + F(flat[k, u] - flat[k, v]) ** 2)
                t[u, v] = F(np.sqrt(s)) + dist[u, v]
        t = (t / t.sum(axis=0, keepdims=True)).astype(F)
        prop = np.full(size, F(1.0) / F(size), F)
        buf = prop.copy()
        for _ in range(iters):
            buf = (t @ prop - buf).astype(F)
            if np.sqrt(np.sum(buf * buf)) < tol:
                break
            buf = prop + buf
            total = buf.sum()
            if total < 0:
                break
            prop = buf * (F(1.0) / total)
        out[b] = x[b] * prop.reshape(1, h, w)
    return out


@pytest.mark.parametrize("params, factor, iters", [("", 5 * 0.15, 20),
                                                   ("factor: 1.5 tolerance: 0.02 maxiteration: 7.9", 1.5, 7)])
def test_soft_proposal(tmp_path, params, factor, iters):
    x = rng(3).standard_normal((2, 3, 3, 5)).astype(F)
    x[1] = np.abs(x[1]) * 2
    tol = F(0.02) if "tolerance" in params else F(1e-4)
    ref = _soft_proposal_ref(x, F(factor), tol, iters)
    m = load_from_text(net(f'layer {{ name: "sp" type: "SoftProposal" bottom: "x" top: "y" '
                           f'soft_proposal_param {{ {params} }} }}', inputs={"x": (2, 3, 3, 5)}))
    check_everywhere(m, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_soft_proposal_stops_early_per_sample(tmp_path):
    # tolerance 0.01: sample 0 stops at its second step, sample 1 (larger values) runs on
    x = rng(4).standard_normal((2, 2, 3, 5)).astype(F)
    x[1] *= 9
    ref = _soft_proposal_ref(x, F(0.75), F(0.01), 20)
    m = load_from_text(net('layer { name: "sp" type: "SoftProposal" bottom: "x" top: "y" '
                           'soft_proposal_param { tolerance: 0.01 } }', inputs={"x": (2, 2, 3, 5)}))
    check_everywhere(m, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_soft_proposal_no_iterations_is_uniform(tmp_path):
    x = rng(5).standard_normal((2, 2, 3, 5)).astype(F)
    m = load_from_text(net('layer { name: "sp" type: "SoftProposal" bottom: "x" top: "y" '
                           'soft_proposal_param { maxiteration: -1 } }', inputs={"x": (2, 2, 3, 5)}))
    check_everywhere(m, {"x": x}, {"y": x * (F(1) / F(15))}, tmp_path)


def test_soft_proposal_maxiteration_truncates(tmp_path):
    # tolerance 0 never stops: maxiteration 2.7 runs int(2.7) = 2 steps (the fork's float field into an int member)
    x = rng(14).standard_normal((2, 3, 3, 5)).astype(F)
    ref = _soft_proposal_ref(x, F(0.75), F(0), 2)
    assert np.abs(ref - _soft_proposal_ref(x, F(0.75), F(0), 3)).max() > 1e-4
    m = load_from_text(net('layer { name: "sp" type: "SoftProposal" bottom: "x" top: "y" '
                           'soft_proposal_param { tolerance: 0 maxiteration: 2.7 } }', inputs={"x": (2, 3, 3, 5)}))
    check_everywhere(m, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_soft_proposal_refuses_zero_factor():
    with pytest.raises(LayerError, match="factor"):
        load_from_text(net('layer { name: "sp" type: "SoftProposal" bottom: "x" top: "y" '
                           'soft_proposal_param { factor: 0 } }', inputs={"x": (2, 2, 3, 5)}))


# ---- MaskTransformer ------------------------------------------------------------------------------

def _mask_ref(u, m):
    n, c, h, w = u.shape
    mm = m.reshape(n, h * w)
    out = np.zeros_like(u).reshape(n, c, h * w)
    uf = u.reshape(n, c, h * w)
    for i in range(n):
        for j in range(h * w):
            v = mm[i, j]
            for ch in range(c):     # the GPU kernel: every channel (the CPU code: 0-2)
                if 0 <= v <= 1:
                    out[i, ch, j] = v * uf[i, ch, j]
                elif v > 1:
                    out[i, ch, j] = uf[i, ch, j]
    return out.reshape(u.shape)


@pytest.mark.parametrize("channels, mask_shape", [(3, (2, 15)), (4, (2, 1, 3, 5))])
def test_mask_transformer(tmp_path, channels, mask_shape):
    u = rng(6).standard_normal((2, channels, 3, 5)).astype(F)
    m = (rng(7).standard_normal(mask_shape) * 1.2 + 0.5).astype(F)
    m.reshape(-1)[[0, 1, 2, 3]] = [0.0, 1.0, -0.0, np.nan]
    model = load_from_text(net('layer { name: "mt" type: "MaskTransformer" bottom: "u" bottom: "m" top: "v" '
                               'mask_param { to_compute_dU: false } }', inputs={"u": u.shape, "m": mask_shape}))
    check_everywhere(model, {"u": u, "m": m}, {"v": _mask_ref(u, m)}, tmp_path)
    if channels != 3:
        assert "GPU kernel" in " ".join(model.warnings)


def test_mask_transformer_refuses_mask_size():
    with pytest.raises(LayerError, match="count"):
        load_from_text(net('layer { name: "mt" type: "MaskTransformer" bottom: "u" bottom: "m" top: "v" }',
                           inputs={"u": (2, 3, 3, 5), "m": (2, 14)}))


# ---- Hotspot ---------------------------------------------------------------------------------------

def _hotspot_ref(points, h, w, std, dh, dw, mean_removed):
    n = points.shape[0]
    flat = points.reshape(-1)
    c = points.reshape(n, -1).shape[1] if points.ndim == 2 else points.shape[1]
    npt = c // 2
    out = np.zeros((n, npt, h, w), F)
    std = float(F(std))
    for b in range(n):
        for i in range(npt):
            off = 0.5 if mean_removed else 0
            p1 = F((float(F(flat[b * c + 2 * i] / F(dw))) + off) * float(F(w)))
            p2 = F((float(F(flat[b * c + 2 * i + 1] / F(dh))) + off) * float(F(h)))
            for y in range(h):
                for x in range(w):
                    d2 = F(F(F(p1 - F(x)) * F(p1 - F(x))) + F(F(p2 - F(y)) * F(p2 - F(y))))
                    t = F(0.5 / std / std / math.pi * math.exp(-0.5 * float(d2) / std / std))
                    out[b, i, y, x] = t if t > F(1e-4) else 0
    return out


def test_hotspot_size_from_second_bottom(tmp_path):
    pts = (rng(8).uniform(-30, 30, (2, 6))).astype(F)
    pts[0, :2] = [0.0, 0.0]
    ref = _hotspot_ref(pts, 7, 9, 1.3, 30, 40, True)
    m = load_from_text(net('layer { name: "hs" type: "Hotspot" bottom: "p" bottom: "img" top: "hm" '
                           'hotspot_param { data_height: 30 data_width: 40 gaussian_std: 1.3 } }',
                           inputs={"p": (2, 6), "img": (2, 3, 7, 9)}))
    check_everywhere(m, {"p": pts, "img": np.zeros((2, 3, 7, 9), F)}, {"hm": ref}, tmp_path, atol=0, rtol=1e-6)


def test_hotspot_explicit_size_4d_points(tmp_path):
    # (N, 4, 1, 3): the fork reads sample n's points at flat offset n * 4, across the trailing axes
    pts = rng(9).uniform(0, 20, (2, 4, 1, 3)).astype(F)
    ref = _hotspot_ref(pts, 5, 11, 0.8, 20, 20, False)
    m = load_from_text(net('layer { name: "hs" type: "Hotspot" bottom: "p" top: "hm" hotspot_param { '
                           'data_height: 20 data_width: 20 gaussian_std: 0.8 output_height: 5 output_width: 11 '
                           'mean_removed: false } }', inputs={"p": (2, 4, 1, 3)}))
    check_everywhere(m, {"p": pts}, {"hm": ref}, tmp_path, atol=0, rtol=1e-6)


def test_hotspot_exact_float_double_mix(tmp_path):
    # bit for bit: x / data_width in float, + 0.5 and * W in double, the squared distance in float, the Gaussian
    # (with the fork's pi) in double, then float
    pts = rng(15).uniform(0, 97, (2, 40)).astype(F)
    ref = _hotspot_ref(pts, 13, 17, 0.7, 97, 113, True)
    assert (ref > 0).sum() > 100
    m = load_from_text(net('layer { name: "hs" type: "Hotspot" bottom: "p" top: "hm" hotspot_param { '
                           'data_height: 97 data_width: 113 gaussian_std: 0.7 output_height: 13 output_width: 17 } }',
                           inputs={"p": (2, 40)}))
    check_everywhere(m, {"p": pts}, {"hm": ref}, tmp_path)


@pytest.mark.parametrize("params, bottoms, match", [
    ("data_height: 30 data_width: 40", ("p",), "exactly 2 bottoms"),
    ("data_height: 30", ("p", "img"), "data_height and data_width"),
    ("data_height: 30 data_width: 40 gaussian_std: 0", ("p", "img"), "gaussian_std")])
def test_hotspot_refusals(params, bottoms, match):
    text = "".join(f' bottom: "{b}"' for b in bottoms)
    with pytest.raises(LayerError, match=match):
        load_from_text(net(f'layer {{ name: "hs" type: "Hotspot"{text} top: "hm" hotspot_param {{ {params} }} }}',
                           inputs={"p": (2, 6), "img": (2, 3, 7, 9)}))


def test_hotspot_refuses_odd_channels():
    with pytest.raises(LayerError, match="even"):
        load_from_text(net('layer { name: "hs" type: "Hotspot" bottom: "p" top: "hm" hotspot_param { '
                           'data_height: 3 data_width: 4 output_height: 5 output_width: 5 } }', inputs={"p": (2, 5)}))


# ---- gated SigmoidCrossEntropyLoss (stupiding/face-detection) -----------------------------------

def _gated_loss_ref(x, t, gates, thred):
    x, t = x.reshape(-1), t.reshape(-1)
    loss, valid = F(0), 0
    for i in range(x.size):
        pos = F(x[i] >= 0)
        tl = F(x[i] * (t[i] - pos) - np.log(F(1) + np.exp(x[i] - F(2) * x[i] * pos, dtype=F), dtype=F))
        if all(not (g.reshape(-1)[i] < th) for g, th in zip(gates, thred)):
            loss = F(loss - tl)
            valid += 1
    return np.array(F(loss) / F(valid) if valid else np.nan, F)


def test_gated_sigmoid_cross_entropy_loss():
    x = rng(10).standard_normal((2, 1, 3, 5)).astype(F) * 3
    t = (rng(11).uniform(size=(2, 1, 3, 5)) > 0.5).astype(F)
    g1 = rng(12).uniform(size=(2, 15)).astype(F)
    g2 = rng(13).uniform(size=(2, 15)).astype(F)
    g2[0, 0] = np.nan     # a NaN gate passes (NaN < thred is false)
    lp = caffe_pb2.LayerParameter()
    text_format.Parse('name: "l" type: "SigmoidCrossEntropyLoss" bottom: "x" bottom: "t" bottom: "g1" bottom: "g2" '
                      'top: "loss" loss_param { thred: 0.3 thred: 0.45 }', lp)
    spec = spec_for(lp)
    attrs = spec.parse(lp)
    assert spec.infer(attrs, [x.shape, t.shape, g1.shape, g2.shape]) == [()]
    got = spec.forward(attrs, [], *(torch.from_numpy(v) for v in (x, t, g1, g2))).numpy()
    assert_close(got, _gated_loss_ref(x, t, [g1, g2], [F(0.3), F(0.45)]), 1e-6, 1e-6, "gated loss")
    # every element gated out: 0 / 0
    got = spec.forward(attrs, [], *(torch.from_numpy(v) for v in (x, t, np.zeros_like(g1), g2)))
    assert np.isnan(float(got))
    # the fork CHECKs every bottom against the scores' count
    with pytest.raises(LayerError, match="count"):
        spec.infer(attrs, [x.shape, t.shape, (2, 14), g2.shape])


def test_gated_sigmoid_cross_entropy_loss_refuses_missing_gates():
    with pytest.raises(LayerError, match="thred"):
        load_from_text(net('layer { name: "l" type: "SigmoidCrossEntropyLoss" bottom: "x" bottom: "t" bottom: "g1" '
                           'top: "loss" loss_param { thred: 0.3 thred: 0.45 } }',
                           inputs={"x": (2, 1, 3, 5), "t": (2, 1, 3, 5), "g1": (2, 15)}))


# ---- the corpus files -------------------------------------------------------------------------------

@pytest.mark.parametrize("path, args, needle", [
    (CORPUS + "KevinKecc__caffe-spn__examples__testAddLayer__test.prototxt", (), "SoftProposal"),
    (CORPUS + "daerduoCarey__mycaffe__models__CUB_googLeNet_Mask__train_test.prototxt", (), "16x3x224x224"),
    (CORPUS + "tiandunc__caffe-windows__matlab__+caffe__+test__hotspot_pure.prototxt",
     ("--input-shape", "data=2,3,60,60", "--input-shape", "label=2,50"), "2x5x60x60"),
    (CORPUS + "stupiding__face-detection__face_detection_models__48in_models__model.prototxt",
     ("--input-shape", "data=2,3,48,48", "--input-shape", "info=2,5"), "conv6_3,is_face,pred_1,pred_2")])
def test_corpus_files_read(path, args, needle):
    assert needle in inspect_corpus_file(path, *args)
