"""qingyang-jiandao/jiandao-caffe f85daa5 (caffeq/layers/jiandao.py): SpatialTransformerPT (st_pt_layer.cu's
forward kernel), Interp's scale_factor_h / _w (interp_layer.cpp Reshape, util/interp.cpp), LSTMNode with
lstmnode_param (lstm_node_layer.cpp) and AttLSTM (attention_lstm_layer.cpp's unrolled net), against numpy written
from the fork's C++, in torch, onnxruntime and model.py; the jiandao-ocr nets that use them."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import DataError
from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

F = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
PREFIX = "qingyang-jiandao__jiandao-ocr__model-"
ATTENTION = REALWORLD / (PREFIX + "jiandao__deploy-stnpt-segnet-vgg-attention-lstmunit-64x256.prototxt")
UNROLLED = REALWORLD / (PREFIX + "jiandao__deploy-stnpt-fnn-vgg-pro-stnfeature-attention-64x256.prototxt")
CTC_TRAIN = REALWORLD / (PREFIX + "stnpt-fnn__train-stnpt-fnn-lossweight-vgg-64x256.prototxt")


# ---- SpatialTransformerPT ------------------------------------------------------------------------

def cuda_int(v):
    """CUDA's float-to-int conversion: NaN is 0, values past the int range saturate."""
    if math.isnan(v):
        return 0
    return int(min(max(v, -2.0 ** 31), 2.0 ** 31 - 1))


def st_pt_ref(image, theta, out_h, out_w):
    """SpatialTransformerPTForwardGPU over full (N, 9) matrices, one output value at a time, in float32."""
    n, c, h, w = image.shape
    out = np.zeros((n, c, out_h, out_w), F)
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(n):
            t = theta[i].astype(F)
            for s in range(out_h):
                gs = F(s * 1.0 / out_h * 2 - 1)
                for u in range(out_w):
                    gt = F(u * 1.0 / out_w * 2 - 1)
                    a, b, cc = (F(F(t[3 * k] * gs + t[3 * k + 1] * gt) + t[3 * k + 2]) for k in range(3))
                    x = F(F(F(F(a / cc) + F(1)) / F(2)) * F(h))
                    y = F(F(F(F(b / cc) + F(1)) / F(2)) * F(w))
                    fx, fy = np.floor(x), np.floor(y)
                    acc = np.zeros(c, F)
                    for m, k in ((cuda_int(fx), cuda_int(fy)), (cuda_int(fx + 1), cuda_int(fy)),
                                 (cuda_int(fx), cuda_int(fy + 1)), (cuda_int(fx + 1), cuda_int(fy + 1))):
                        if 0 <= m < h and 0 <= k < w:
                            wx = F(1) - abs(F(x - F(m)))      # (1 - (x - m)) or (1 - (m - x)) as each tap writes it
                            wy = F(1) - abs(F(y - F(k)))
                            acc = (acc + F(wx * wy) * image[i, :, m, k]).astype(F)
                    out[i, :, s, u] = acc
    return out


def st_pt_net(image, theta_shape, st_param=""):
    return net(f'layer {{ name: "st" type: "SpatialTransformerPT" bottom: "u" bottom: "theta" top: "v" '
               f'st_param {{ {st_param} }} }}', inputs={"u": image, "theta": theta_shape})


def near_identity(r, n):
    """Perspective matrices near the identity, row 3 tilting the plane a little."""
    t = np.tile(np.eye(3, dtype=F).reshape(1, 9), (n, 1))
    return (t + r.uniform(-0.3, 0.3, (n, 9)) * np.array([1, 1, 1, 1, 1, 1, 0.5, 0.5, 0.2], F)).astype(F)


def test_spatial_transformer_pt_matches_the_kernel_with_its_own_output_size(tmp_path):
    r = rng(1)
    image = r.standard_normal((2, 3, 5, 7)).astype(F)
    theta = near_identity(r, 2)
    model = load_from_text(st_pt_net(image.shape, (2, 9), "output_H: 4 output_W: 6"))
    assert model.blob_shapes["v"] == (2, 3, 4, 6)
    want = st_pt_ref(image, theta, 4, 6)
    assert (want == 0).any() and (want != 0).all(axis=1).mean() > 0.5   # taps inside and some outside the image
    check_everywhere(model, {"u": image, "theta": theta}, {"v": want}, tmp_path, atol=2e-6, rtol=2e-5)


def test_spatial_transformer_pt_fixed_entries_fill_in_order(tmp_path):
    r = rng(2)
    image = r.standard_normal((3, 2, 6, 4)).astype(F)
    full = near_identity(r, 3)
    full[:, 1] = F(0.125)
    full[:, 8] = F(1.0)
    model = load_from_text(st_pt_net(image.shape, (3, 7, 1, 1), "theta_1_2: 0.125 theta_3_3: 1"))
    assert model.blob_shapes["v"] == (3, 2, 6, 4)       # output_H / output_W unset: the image's size
    given = np.delete(full, [1, 8], axis=1).reshape(3, 7, 1, 1)
    check_everywhere(model, {"u": image, "theta": given}, {"v": st_pt_ref(image, full, 6, 4)}, tmp_path,
                     atol=2e-6, rtol=2e-5)


def test_spatial_transformer_pt_on_a_vanishing_denominator(tmp_path):
    # row 3 all zero: x and y are +-inf (no tap inside: 0), except where a = b = 0, which CUDA reads at tap 0: NaN
    image = rng(3).standard_normal((1, 2, 4, 6)).astype(F)
    theta = np.array([[1, 0, 0, 0, 1, 0, 0, 0, 0]], F)
    model = load_from_text(st_pt_net(image.shape, (1, 9)))
    want = st_pt_ref(image, theta, 4, 6)
    assert np.isnan(want[0, :, 2, 3]).all() and np.isnan(want).sum() == 2 and (np.nan_to_num(want) == 0).all()
    check_everywhere(model, {"u": image, "theta": theta}, {"v": want}, tmp_path)


@pytest.mark.parametrize("st_param", ["output_H: 3", "output_W: 5", "output_H: 0 output_W: 5", "output_H: -2 output_W: 0"])
def test_spatial_transformer_pt_keeps_the_image_size_unless_both_output_fields_are_non_zero(st_param, tmp_path):
    # Reshape: init_output_H_ and init_output_W_ both non-zero, else the image's H x W
    r = rng(12)
    image = r.standard_normal((2, 3, 5, 7)).astype(F)
    theta = near_identity(r, 2)
    model = load_from_text(st_pt_net(image.shape, (2, 9), st_param))
    assert model.blob_shapes["v"] == (2, 3, 5, 7)
    check_everywhere(model, {"u": image, "theta": theta}, {"v": st_pt_ref(image, theta, 5, 7)}, tmp_path,
                     atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("to_compute_du", [True, False])
def test_spatial_transformer_pt_to_compute_du_false_stops_the_backward_at_theta(to_compute_du, tmp_path):
    from conftest import load_model_py
    model = load_from_text(st_pt_net((2, 3, 5, 7), (2, 9), f"to_compute_dU: {str(to_compute_du).lower()}"))
    node = node_of(model, "st")
    net_, info = load_model_py(model, tmp_path)
    assert info["inputs"] == ["u", "theta"]
    r = rng(13)
    for run in (lambda u, t: node.spec.forward(node.attrs, [], u, t), net_):
        u = torch.from_numpy(r.standard_normal((2, 3, 5, 7)).astype(F)).requires_grad_()
        theta = torch.from_numpy(near_identity(r, 2)).requires_grad_()
        run(u, theta).sum().backward()
        assert theta.grad.abs().sum() > 0
        assert (u.grad is not None and u.grad.abs().sum() > 0) == to_compute_du


@pytest.mark.parametrize("theta, st_param, words", [
    ((2, 9), "output_H: -2 output_W: 3", "st_param.output_H must be >= 1"),
    ((2, 6), "", "gives 6 values per item and st_param fixes 0 entries"),
    ((2, 8), "theta_1_1: 1 theta_2_2: 1", "gives 8 values per item and st_param fixes 2"),
    ((3, 9), "", "must have the image's 2 items"),
    ((2, 9), 'transform_type: "projective"', 'st_param.transform_type must be "affine"'),
])
def test_spatial_transformer_pt_refuses_what_the_fork_checks(theta, st_param, words):
    with pytest.raises(LayerError, match=words):
        load_from_text(st_pt_net((2, 1, 4, 4), theta, st_param))


# ---- Interp with scale factors -------------------------------------------------------------------

def interp2_ref(x, ho, wo):
    """util/interp.cpp caffe_cpu_interp2 (not packed): align-corners bilinear in float32."""
    n, c, h, w = x.shape
    if (h, w) == (ho, wo):
        return x.copy()
    rh = F(h - 1) / F(ho - 1) if ho > 1 else F(0)
    rw = F(w - 1) / F(wo - 1) if wo > 1 else F(0)
    out = np.zeros((n, c, ho, wo), F)
    for i in range(ho):
        h1r = F(rh * F(i))
        h1 = int(h1r)
        h1p = 1 if h1 < h - 1 else 0
        lh1 = F(h1r - F(h1))
        lh0 = F(1) - lh1
        for j in range(wo):
            w1r = F(rw * F(j))
            w1 = int(w1r)
            w1p = 1 if w1 < w - 1 else 0
            lw1 = F(w1r - F(w1))
            lw0 = F(1) - lw1
            out[:, :, i, j] = lh0 * (lw0 * x[:, :, h1, w1] + lw1 * x[:, :, h1, w1 + w1p]) + \
                lh1 * (lw0 * x[:, :, h1 + h1p, w1] + lw1 * x[:, :, h1 + h1p, w1 + w1p])
    return out


def interp_net(shape, params, ref=None):
    bottoms = 'bottom: "x"' + (' bottom: "ref"' if ref else "")
    inputs = {"x": shape, **({"ref": ref} if ref else {})}
    return net(f'layer {{ name: "i" type: "Interp" {bottoms} top: "o" interp_param {{ {params} }} }}', inputs=inputs)


@pytest.mark.parametrize("shape, params, ref, out", [
    ((2, 3, 9, 13), "scale_factor_h: 1.5 scale_factor_w: 0.75", None, (13, 10)),
    ((1, 2, 16, 5), "scale_factor_h: 0.5 scale_factor_w: 1.0", None, (8, 5)),      # 8.5 truncated: the corpus's
    # 8 x 0.35f + 1 = 3.8 truncated; 10 x 0.7f is 6.99999988 but rounds to 7 in float32: 8 columns, not 7
    ((2, 3, 9, 11), "scale_factor_h: 0.35 scale_factor_w: 0.7", None, (3, 8)),
    ((3, 1, 11, 6), "scale_factor_h: 0.3 scale_factor_w: 2.5 pad_beg: -1 pad_end: -1", None, (3, 8)),
    ((2, 2, 7, 8), "scale_factor_h: 2 scale_factor_w: 2", (1, 1, 4, 5), (13, 15)),   # before bottom 1's size
    ((2, 2, 7, 8), "scale_factor_h: 2 scale_factor_w: 2 height: 3 width: 11", None, (3, 11)),   # height first
    ((2, 2, 7, 8), "scale_factor_h: 2", (1, 1, 4, 5), (4, 5)),    # one factor alone: bottom 1's size
])
def test_interp_scale_factors(shape, params, ref, out, tmp_path):
    x = rng(4).standard_normal(shape).astype(F)
    model = load_from_text(interp_net(shape, params, ref))
    assert model.blob_shapes["o"] == shape[:2] + out
    crop = x[:, :, 1:-1, 1:-1] if "pad_beg" in params else x
    feeds = {"x": x, **({"ref": np.zeros(ref, F)} if ref else {})}
    check_everywhere(model, feeds, {"o": interp2_ref(crop, *out)}, tmp_path, atol=1e-6, rtol=1e-6)


def test_interp_scale_factors_refused_where_the_fork_sizes_nothing():
    with pytest.raises(LayerError, match="only one of interp_param.scale_factor_h / scale_factor_w"):
        load_from_text(interp_net((1, 1, 4, 4), "scale_factor_w: 2"))
    with pytest.raises(LayerError, match="give an output of 0x4 from 4x4"):
        load_from_text(interp_net((1, 1, 4, 4), "scale_factor_h: -0.2 scale_factor_w: 1"))
    with pytest.raises(LayerError, match="and interp_type come from different forks"):
        load_from_text(interp_net((1, 1, 4, 4), 'scale_factor_h: 2 scale_factor_w: 2 interp_type: "bilinear"'))
    with pytest.raises(LayerError, match="and use_blob_size come from different forks"):
        load_from_text(interp_net((1, 1, 4, 4), "scale_factor_h: 2 scale_factor_w: 2 use_blob_size: true", (1, 1, 2, 2)))
    with pytest.raises(LayerError, match=r"interp_param.pad_beg/pad_end must be <= 0 \(the fork only crops\)"):
        load_from_text(interp_net((1, 1, 4, 4), "scale_factor_h: 2 scale_factor_w: 2 pad_beg: 1"))


# ---- LSTMNode with lstmnode_param ----------------------------------------------------------------

def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def lstm_node_ref(x, c_prev, w, b, cont=None):
    """LSTMNodeLayer::Forward_cpu: gates = x W^T + b, rows i, f, o, g; f times the continuation flag."""
    m, n = x.shape[0], w.shape[0] // 4
    g = x.reshape(m, -1).astype(np.float64) @ w.T.astype(np.float64) + (0 if b is None else b)
    i, f, o, cand = sigmoid(g[:, :n]), sigmoid(g[:, n:2 * n]), sigmoid(g[:, 2 * n:3 * n]), np.tanh(g[:, 3 * n:])
    if cont is not None:
        f = f * cont.reshape(m, 1)
    c = f * c_prev.reshape(m, n) + i * cand
    return o * np.tanh(c), c


@pytest.mark.parametrize("bias_term, with_cont", [(True, False), (False, True)])
def test_lstm_node_reads_lstmnode_param(bias_term, with_cont, tmp_path):
    bottoms = 'bottom: "x" bottom: "c0"' + (' bottom: "cont"' if with_cont else "")
    inputs = {"x": (3, 2, 4), "c0": (3, 5), **({"cont": (3,)} if with_cont else {})}
    text = net(f'layer {{ name: "l" type: "LSTMNode" {bottoms} top: "h" top: "c" lstmnode_param {{ num_cells: 5 '
               f'bias_term: {str(bias_term).lower()} forget_gate_bias_filler {{ type: "constant" value: 1 }} }} }}',
               inputs=inputs)
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "l")
    assert [np.shape(b) for b in node.blobs] == [(20, 8), (20,)][:1 + bias_term]
    r = rng(5)
    node.blobs = [r.uniform(-1, 1, np.shape(b)).astype(F) for b in node.blobs]
    x, c0 = r.standard_normal((3, 2, 4)).astype(F), r.standard_normal((3, 5)).astype(F)
    feeds = {"x": x, "c0": c0, **({"cont": np.array([1, 0, 1], F)} if with_cont else {})}
    h, c = lstm_node_ref(x, c0, node.blobs[0], node.blobs[1] if bias_term else None, feeds.get("cont"))
    check_everywhere(model, feeds, {"h": h, "c": c}, tmp_path, atol=2e-6, rtol=2e-6)


def test_lstm_node_checks_its_cell_state():
    text = net('layer { name: "l" type: "LSTMNode" bottom: "x" bottom: "c0" top: "h" top: "c" '
               'lstmnode_param { num_cells: 5 } }', inputs={"x": (3, 4), "c0": (3, 4)})
    with pytest.raises(LayerError, match="previous cell state must hold M x num_cells = 3 x 5 values"):
        load_from_text(text)
    with pytest.raises(LayerError, match="lstmnode_param.num_cells must be >= 1"):
        load_from_text(text.replace("num_cells: 5", "bias_term: false"))


# ---- AttLSTM -------------------------------------------------------------------------------------

def softmax(v):
    e = np.exp(v - v.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def att_lstm_ref(x, y, blobs, train, ties=None):
    """The fork's unrolled net, layer by layer, in float64: xProj, then per step Embed, sProj, Bias / Eltwise,
    TanH, predict_att, Reshape, Softmax, Scale, Permute, Reduction, Concat, LSTMNode, predict (+ Softmax and
    ArgMax at TEST), the outputs joined by the last Concat.  ties: "last" (Caffe's ArgMax: its partial_sort by
    (value, index) pairs) or "first" picks among equal probabilities; None asserts there are none."""
    w_x, embed, w_s, w_a, w_l, b_l, w_p, b_p = (b.astype(np.float64) for b in blobs)
    n, s, c = x.shape[:3]
    cells = w_s.shape[0]
    x_proj = x.reshape(n, s, -1) @ w_x.T
    h, cell = np.zeros((n, cells)), np.zeros((n, cells))
    steps = y.shape[1] if train else s
    ids, outs = y[:, 0].astype(int), []
    for t in range(steps):
        if train:
            ids = y[:, t].astype(int)
        e = np.tanh(x_proj + (h @ w_s.T)[:, None, :])
        alpha = softmax((e @ w_a.T).reshape(n, s))
        scaled = x.reshape(n, s, -1) * alpha[:, :, None]                   # Scale axis 0
        context = scaled.reshape(n, s, c, -1).transpose(0, 2, 1, 3).reshape(n, c, -1).sum(axis=2)   # Permute, Reduction
        h, cell = lstm_node_ref(np.concatenate([context, embed[ids]], axis=1), cell, w_l, b_l)
        out = h @ w_p.T + b_p
        if not train:
            out = softmax(out)
            if ties is None:
                top2 = np.sort(out, axis=1)[:, -2:]
                assert (top2[:, 1] - top2[:, 0] > 1e-4).all()           # no near tie for float32 to flip
            ids = out.shape[1] - 1 - out[:, ::-1].argmax(axis=1) if ties == "last" else out.argmax(axis=1)
        outs.append(out)
    return np.concatenate(outs, axis=1)


def att_net(x, y, tops=1, extra=""):
    top = ' top: "p"' + (' top: "mask"' if tops == 2 else "")
    return net(f'layer {{ name: "dec" type: "AttLSTM" bottom: "x" bottom: "y"{top} recurrent_param {{ num_cells: 4 '
               f'num_output: 7 {extra} weight_filler {{ type: "gaussian" std: 0.01 }} }} }}', inputs={"x": x, "y": y})


def randomized(model, seed, scale=1.5):
    node = node_of(model, "dec")
    r = rng(seed)
    node.blobs = [r.uniform(-scale, scale, np.shape(b)).astype(F) for b in node.blobs]
    return node


def test_att_lstm_at_test_feeds_back_its_argmax(tmp_path):
    model = load_from_text(att_net((1, 6, 5), (1, 1), tops=2), random_weights=True)
    node = randomized(model, 25)
    assert [np.shape(b) for b in node.blobs] == [(4, 5), (7, 4), (4, 4), (1, 4), (16, 9), (16,), (7, 4), (7,)]
    assert model.blob_shapes["p"] == (1, 42) and model.blob_shapes["mask"] == (0,)
    x = rng(7).standard_normal((1, 6, 5)).astype(F)
    y = np.array([[2.7]], F)                       # truncated to 2
    want = att_lstm_ref(x, y, node.blobs, train=False)
    ids = want.reshape(6, 7).argmax(axis=1)
    assert len(set(ids.tolist())) > 2               # the fed-back choice changes
    check_everywhere(model, {"x": x, "y": y}, {"p": want, "mask": np.zeros((0,), F)}, tmp_path, atol=2e-5,
                     rtol=2e-5)


def test_att_lstm_at_train_reads_the_labels_and_sums_trailing_axes(tmp_path):
    model = load_from_text(att_net((3, 5, 2, 3), (3, 4)), random_weights=True, phase="TRAIN")
    node = randomized(model, 8)
    assert [np.shape(b) for b in node.blobs][:1] + [np.shape(node.blobs[4])] == [(4, 6), (16, 6)]
    assert model.blob_shapes["p"] == (3, 28)
    r = rng(9)
    x = r.standard_normal((3, 5, 2, 3)).astype(F)
    y = r.integers(0, 7, (3, 4)).astype(F)
    want = att_lstm_ref(x, y, node.blobs, train=True)
    check_everywhere(model, {"x": x, "y": y}, {"p": want}, tmp_path, atol=2e-5, rtol=2e-5)


def test_att_lstm_at_test_breaks_ties_for_the_highest_class(tmp_path):
    # classes 2 and 5 get the same logit (zero rows of W_p, equal biases), above the others at every step:
    # Caffe's ArgMax feeds back 5, whose embedding differs from 2's
    model = load_from_text(att_net((1, 6, 5), (1, 1)), random_weights=True)
    node = randomized(model, 26)
    w_p, b_p = node.blobs[6] * F(0.2), rng(27).uniform(-0.5, 0.5, 7).astype(F)
    w_p[[2, 5]], b_p[[2, 5]] = 0, 3
    node.blobs = node.blobs[:6] + [w_p, b_p]
    x, y = rng(28).standard_normal((1, 6, 5)).astype(F), np.array([[1]], F)
    want = att_lstm_ref(x, y, node.blobs, train=False, ties="last")
    assert np.abs(want - att_lstm_ref(x, y, node.blobs, train=False, ties="first")).max() > 1e-3
    check_everywhere(model, {"x": x, "y": y}, {"p": want}, tmp_path, atol=2e-5, rtol=2e-5)


def test_att_lstm_reads_its_own_phase_and_never_reads_exposed_hidden_bottoms(tmp_path):
    # a layer's phase: TRAIN wins over the net's TEST (Caffe's Net::Init sets only an unset one)
    text = att_net((3, 5, 2), (3, 4)).replace('type: "AttLSTM"', 'type: "AttLSTM" phase: TRAIN')
    assert load_from_text(text).blob_shapes["p"] == (3, 28)
    # expose_hidden: h_0 and c_0 are bottoms 3 and 4, which the fork's AttRecurrentLayer never shares in
    text = net('layer { name: "dec" type: "AttLSTM" bottom: "x" bottom: "y" bottom: "h0" bottom: "c0" top: "p" '
               'recurrent_param { num_cells: 4 num_output: 7 expose_hidden: true } }',
               inputs={"x": (1, 6, 5), "y": (1, 1), "h0": (1, 4), "c0": (1, 4)})
    model = load_from_text(text, random_weights=True)
    node = randomized(model, 29)
    r = rng(30)
    feeds = {"x": r.standard_normal((1, 6, 5)).astype(F), "y": np.array([[3]], F),
             "h0": r.standard_normal((1, 4)).astype(F), "c0": r.standard_normal((1, 4)).astype(F)}
    check_everywhere(model, feeds, {"p": att_lstm_ref(feeds["x"], feeds["y"], node.blobs, train=False)}, tmp_path,
                     atol=2e-5, rtol=2e-5)
    with pytest.raises(LayerError, match=r"AttLSTM takes 4 or 5 bottoms \(x, y\)"):
        load_from_text(text.replace(' bottom: "c0"', ""))


def test_att_lstm_refuses_what_its_unrolled_net_cannot_run():
    with pytest.raises(LayerError, match=r"AttLSTM at TEST needs N = 1 .* got x \[2, 6, 5\]"):
        load_from_text(att_net((2, 6, 5), (2, 1)))
    with pytest.raises(LayerError, match=r"y \(1, 1\)"):
        load_from_text(att_net((1, 6, 5), (1, 3)))
    with pytest.raises(LayerError, match="needs at least 3 axes"):
        load_from_text(att_net((1, 6), (1, 1)))
    with pytest.raises(LayerError, match="expose_hidden and a second top"):
        load_from_text(att_net((1, 6, 5), (1, 1), tops=2, extra="expose_hidden: true").replace(
            'bottom: "y"', 'bottom: "y" bottom: "x" bottom: "x"'))
    model = load_from_text(att_net((1, 6, 5), (1, 1)), random_weights=True)
    with pytest.raises(DataError, match=r"index 7 of y is outside \[0, 7\)"):
        model.run({"x": np.zeros((1, 6, 5), F), "y": np.array([[7]], F)})
    with pytest.raises(DataError, match=r"index -1 of y is outside \[0, 7\)"):   # torch would read row 6
        model.run({"x": np.zeros((1, 6, 5), F), "y": np.array([[-1]], F)})


# ---- the jiandao-ocr nets ------------------------------------------------------------------------

def test_the_attention_decoder_net_reads_and_runs():
    assert ATTENTION.exists() and UNROLLED.exists() and CTC_TRAIN.exists()
    model = load(str(ATTENTION), random_weights=True)
    shapes = model.blob_shapes
    assert shapes["st/st_output"] == (1, 3, 64, 256) and shapes["interp_iter2_st_seg_output"] == (1, 1, 32, 256)
    assert shapes["predict_concat"] == (1, 32 * 6863) and shapes["mask_concat"] == (0,)
    r = rng(10)
    out = model.run({"data": r.standard_normal((1, 3, 32, 128)).astype(F),
                     "stn_data": r.standard_normal((1, 3, 64, 256)).astype(F),
                     "input_prev": np.array([[5]], F)})     # the file's 6863 is past the table (num_output 6863)
    np.testing.assert_allclose(out["reshape2"].sum(axis=1), 1, atol=1e-5)


def test_the_unrolled_decoder_and_the_ctc_train_net_read():
    unrolled = load(str(UNROLLED))
    assert {"LSTMNode", "SpatialTransformerPT"} <= {n.type for n in unrolled.layers}
    assert [tuple(s) for s in node_of(unrolled, "lstm2").expected_param_shapes] == [(2048, 1024), (2048,)]
    # its theta bias is filled from bias_init_pt.txt, which is not here: the filler is a field caffeq reads, and
    # random weights never open the file
    assert 'file: "bias_init_pt.txt"' in CTC_TRAIN.read_text() and not (REALWORLD / "bias_init_pt.txt").exists()
    shapes = {"data": (2, 3, 64, 256), "label": (2, 48), "seg_data": (2, 1, 64, 256), "loss_weight": (2, 1, 64, 256)}
    train = load(str(CTC_TRAIN), phase="TRAIN", input_shapes=shapes, random_weights=True)
    assert any("dropped 2 training-only layer(s) that inference does not use: ctc_loss (CtcLoss), accuracy "
               "(LabelsequenceAccuracy)" in w for w in train.warnings)
    assert train.blob_shapes["iter2_st/st_output"] == train.blob_shapes["seg_output"] == (2, 1, 64, 256)


@pytest.mark.parametrize("phase", ["TEST", "TRAIN"])
def test_the_layers_keep_their_tensors_on_the_blobs_device(phase):
    # an emulated GPU run (tests/cuda_emulation.py): no tensor made on the CPU meets the device's
    from cuda_emulation import run_on_emulated_cuda
    y = (1, 1) if phase == "TEST" else (1, 3)
    text = net('layer { name: "st" type: "SpatialTransformerPT" bottom: "u" bottom: "theta" top: "v" '
               'st_param { theta_3_3: 1 } }',
               'layer { name: "i" type: "Interp" bottom: "v" top: "w" interp_param { scale_factor_h: 0.5 '
               'scale_factor_w: 1.5 } }',
               'layer { name: "r" type: "Reshape" bottom: "w" top: "x" reshape_param { shape { dim: 1 dim: -1 '
               'dim: 6 } } }',
               'layer { name: "dec" type: "AttLSTM" bottom: "x" bottom: "y" top: "p" top: "mask" recurrent_param { '
               'num_cells: 4 num_output: 7 } }',
               inputs={"u": (1, 2, 6, 4), "theta": (1, 8), "y": y})
    model = load_from_text(text, random_weights=True, phase=phase)
    r = rng(11)
    feeds = {"u": r.standard_normal((1, 2, 6, 4)).astype(F),
             "theta": np.delete(near_identity(r, 1), [8], axis=1), "y": np.full(y, 3, F)}
    ref = model.run(feeds, exact=True)
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, "\n".join(sorted(set(mixes)))
    for blob, want in ref.items():
        np.testing.assert_allclose(out[blob].as_subclass(torch.Tensor).numpy(), want, rtol=1e-5, atol=1e-6)
