"""The video saliency forks' ConvLSTM (DengPingFan/DAVSOD mycaffe-convlstm d44e2f3, as PDB-ConvLSTM
and AGS use it).  References are numpy loops written from the fork's unrolled net
(conv_lstm_layer.cpp FillUnrolledNet, conv_lstm_helper.hpp, conv_lstm_unit_layer.cu) on shapes
where T, N, C_in, C, H and W all differ."""
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

import caffeq
from caffeq.layers import LayerError
from caffeq.model import load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


def conv2d_ref(x, w, b, stride, pad, dilation, group):
    """Caffe's convolution of x (N, C, H, W) as loops over output pixels and kernel taps."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh = (h + 2 * pad[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * pad[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    og = o // group
    for g in range(group):
        for i in range(oh):
            for j in range(ow):
                for p in range(kh):
                    for q in range(kw):
                        patch = xp[:, g * cg:(g + 1) * cg, i * stride[0] + p * dilation[0],
                                   j * stride[1] + q * dilation[1]]
                        out[:, g * og:(g + 1) * og, i, j] += patch @ w[g * og:(g + 1) * og, :, p, q].T
    if b is not None:
        out += b.reshape(1, -1, 1, 1)
    return out


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def conv_lstm_ref(x, cont, h0, c0, w_x, w_h, b_h, peep, conv_x, conv_h, peep_axis, peep_axes):
    """The fork's steps: h, c (1, N, C, H, W); peep (w_i, w_f, w_o) scale c_{t-1} from axis
    peep_axis over peep_axes axes (a Scale layer); returns (h per step, all h_t, all c_t)."""
    t = x.shape[0]
    hd = h0.shape[2]
    h, c = h0.astype(np.float64), c0.astype(np.float64)
    hs, cs, outs = [h], [c], []
    for step in range(t):
        ct = cont[step].astype(np.float64)
        conted = h[0] * ct[:, None, None, None]                  # Scale(h_{t-1}, cont_t), axis 0
        pre = conv2d_ref(conted, w_h, b_h, *conv_h)              # hidden->transform (with the bias)
        if w_x is not None:
            pre = pre + conv2d_ref(x[step], w_x, None, *conv_x)  # x->transform (no bias)
        if peep:
            view = (1,) * peep_axis + peep[0].shape + (1,) * (5 - peep_axis - peep_axes)
            had = [c * w.reshape(view) for w in peep] + [np.zeros_like(c)]
            pre = pre + np.concatenate(had, axis=2)[0]           # Concat on axis 2, then Eltwise SUM
        hn = np.zeros_like(h)
        cn = np.zeros_like(c)
        for n in range(x.shape[1]):                              # ConvLSTMUnit, one stream at a time
            for d in np.ndindex(h.shape[2:]):
                ch, yy, xx = d
                i = sigmoid(pre[n, ch, yy, xx])
                f = ct[n] * sigmoid(pre[n, hd + ch, yy, xx])
                o = sigmoid(pre[n, 2 * hd + ch, yy, xx])
                g = np.tanh(pre[n, 3 * hd + ch, yy, xx])
                cn[0, n, ch, yy, xx] = f * c[0, n, ch, yy, xx] + i * g
                hn[0, n, ch, yy, xx] = o * np.tanh(cn[0, n, ch, yy, xx])
        h, c = hn, cn
        hs.append(h)
        cs.append(c)
        outs.append(h[0])
    return np.stack(outs), hs, cs


def lstm_layer(body, bottoms=("x", "cont", "h0", "c0"), tops=("o", "hT", "cT")):
    return ('layer { name: "lstm" type: "ConvLSTM" ' + " ".join(f'bottom: "{b}"' for b in bottoms) + " "
            + " ".join(f'top: "{t}"' for t in tops) + " " + body + " }")


def with_random(model, seed):
    node = node_of(model, "lstm")
    node.blobs = [rng(seed + i).standard_normal(b.shape).astype(np.float32) * 0.5
                  for i, b in enumerate(node.blobs)]
    # the DummyForward layers' (1,) blobs take no part in the numbers
    return [b for name, b in zip(node.spec.blob_names_for(node.attrs), node.blobs) if not name.startswith("dummy")]


def test_conv_lstm_davsod_configuration(tmp_path):
    """expose_hidden with h_0 / c_0 bottoms, a dilated 3x3 kernel (pad 2, dilation 2) and the
    H x W peephole weights of axis_hadamard 3, num_axes_hadamard 2, as DAVSOD's encode2."""
    t, n, cin, c, h, w = 3, 2, 3, 4, 5, 6
    body = ('recurrent_param { expose_hidden: true } lstm_debug_param { axis_hadamard: 3 num_axes_hadamard: 2 } '
            'lstm_conv_param { num_output: 4 kernel_size: 3 pad: 2 dilation: 2 }')
    shapes = {"x": (t, n, cin, h, w), "cont": (t, n), "h0": (1, n, c, h, w), "c0": (1, n, c, h, w)}
    model = load_from_text(net(lstm_layer(body), inputs=shapes), random_weights=True)
    assert model.blob_shapes["o"] == (t, n, c, h, w)
    assert model.blob_shapes["hT"] == model.blob_shapes["cT"] == (1, n, c, h, w)
    node = node_of(model, "lstm")
    # agethen's unrolled net: W_x, the two initial DummyForward blobs, W_h, b_h, the peepholes, the two last
    assert [tuple(b.shape) for b in node.blobs] == [(16, 3, 3, 3), (1,), (1,), (16, 4, 3, 3), (16,), (5, 6),
                                                    (5, 6), (5, 6), (1,), (1,)]
    w_x, w_h, b_h, *peep = with_random(model, 10)
    r = rng(1)
    feeds = {k: r.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    feeds["cont"] = np.array([[0, 0], [1, 0], [1, 1]], np.float32)   # stream 1 restarts at t = 1
    conv = ((1, 1), (2, 2), (2, 2), 1)
    o, hs, cs = conv_lstm_ref(feeds["x"], feeds["cont"], feeds["h0"], feeds["c0"], w_x, w_h, b_h, peep,
                              conv, conv, 3, 2)
    check_everywhere(model, feeds, {"o": o, "hT": hs[-1], "cT": cs[-1]}, tmp_path, atol=2e-5, rtol=2e-5)


def test_conv_lstm_two_blocks_groups_and_per_channel_peepholes(tmp_path):
    """Two lstm_conv_param blocks (type "hidden" first: the input transform takes the second),
    grouped convolutions, no hidden bias, peepholes over C x H x W, zero initial states (no
    expose_hidden) and states exposed by name."""
    t, n, cin, c, h, w = 4, 3, 2, 6, 3, 5
    body = ('lstm_debug_param { axis_hadamard: 2 num_axes_hadamard: 3 expose: "c_t=1" expose: "h_t=T" } '
            'lstm_conv_param { type: "hidden" num_output: 6 kernel_size: 3 pad: 1 group: 2 bias_term: false } '
            'lstm_conv_param { type: "input" num_output: 6 kernel_size: 1 kernel_size: 3 pad: 0 pad: 1 group: 2 }')
    shapes = {"x": (t, n, cin, h, w), "cont": (t, n)}
    model = load_from_text(net(lstm_layer(body, ("x", "cont"), ("o", "c1", "hT")), inputs=shapes),
                           random_weights=True)
    node = node_of(model, "lstm")
    assert node.spec.blob_names_for(node.attrs) == ("W_x", "dummy_c0", "dummy_h0", "W_h", "w_i", "w_f", "w_o",
                                                     "dummy_h", "dummy_c")
    assert [tuple(b.shape) for b in node.blobs] == [(24, 1, 1, 3), (1,), (1,), (24, 3, 3, 3)] + [(c, h, w)] * 3 + \
        [(1,), (1,)]
    w_x, w_h, *peep = with_random(model, 20)
    r = rng(2)
    feeds = {"x": r.standard_normal(shapes["x"]).astype(np.float32),
             "cont": np.array([[0, 0, 0], [1, 1, 0], [1, 0, 1], [1, 1, 1]], np.float32)}
    zeros = np.zeros((1, n, c, h, w), np.float32)
    o, hs, cs = conv_lstm_ref(feeds["x"], feeds["cont"], zeros, zeros, w_x, w_h, None, peep,
                              ((1, 1), (0, 1), (1, 1), 2), ((1, 1), (1, 1), (1, 1), 2), 2, 3)
    check_everywhere(model, feeds, {"o": o, "c1": cs[1], "hT": hs[-1]}, tmp_path, atol=2e-5, rtol=2e-5)


def test_conv_lstm_ignore_x_and_no_hadamard(tmp_path):
    """ignore_x drops the input transform (and its blob), disable_hadamard the peephole blobs."""
    t, n, c, h, w = 2, 3, 2, 4, 3
    body = ('recurrent_param { expose_hidden: true } lstm_debug_param { ignore_x: true disable_hadamard: true } '
            'lstm_conv_param { num_output: 2 kernel_size: 1 }')
    shapes = {"x": (t, n, 5, h, w), "cont": (t, n), "h0": (1, n, c, h, w), "c0": (1, n, c, h, w)}
    model = load_from_text(net(lstm_layer(body), inputs=shapes), random_weights=True)
    node = node_of(model, "lstm")
    assert node.spec.blob_names_for(node.attrs) == ("dummy_c0", "dummy_h0", "W_h", "b_h", "dummy_h", "dummy_c")
    w_h, b_h = with_random(model, 30)
    r = rng(3)
    feeds = {k: r.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    feeds["cont"] = np.ones((t, n), np.float32)
    one = ((1, 1), (0, 0), (1, 1), 1)
    o, hs, cs = conv_lstm_ref(feeds["x"], feeds["cont"], feeds["h0"], feeds["c0"], None, w_h, b_h, [],
                              one, one, 3, 2)
    check_everywhere(model, feeds, {"o": o, "hT": hs[-1], "cT": cs[-1]}, tmp_path, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("body, msg", [
    ("lstm_conv_param { num_output: 4 kernel_size: 3 }", "turns 5 x 6 into 3 x 4"),
    ("lstm_conv_param { num_output: 4 kernel_h: 3 kernel_w: 3 pad: 1 }", "kernel_h is not read"),
    ("lstm_conv_param { num_output: 4 kernel_size: 1 } lstm_conv_param { num_output: 3 kernel_size: 1 }",
     "same num_output"),
    ("lstm_conv_param { num_output: 4 kernel_size: 1 } lstm_debug_param { axis_hadamard: 4 num_axes_hadamard: 2 }",
     "axis_hadamard 4 + num_axes_hadamard 2 > 5"),
    ("lstm_conv_param { num_output: 4 kernel_size: 1 } lstm_debug_param { expose: \"gate_input_1\" }",
     "'h_t=k' and 'c_t=k' only"),
])
def test_conv_lstm_bad_params(body, msg):
    shapes = {"x": (3, 2, 3, 5, 6), "cont": (3, 2)}
    tops = ("o", "e") if "expose" in body else ("o",)
    with pytest.raises(LayerError, match=re.escape(msg)):
        load_from_text(net(lstm_layer(body, ("x", "cont"), tops), inputs=shapes))


def test_conv_lstm_initial_state_shape_is_checked():
    shapes = {"x": (3, 2, 3, 5, 6), "cont": (3, 2), "h0": (1, 2, 4, 5, 6), "c0": (1, 2, 4, 6, 5)}
    body = 'recurrent_param { expose_hidden: true } lstm_conv_param { num_output: 4 kernel_size: 1 }'
    with pytest.raises(LayerError, match=r"bottom\[3\] \(initial c\) must be \[1, 2, 4, 5, 6\]"):
        load_from_text(net(lstm_layer(body), inputs=shapes))


# the ConvLSTM's parameters, its four (1,) DummyForward blobs included (the fork's caffemodel holds them)
@pytest.mark.parametrize("name, shapes, lstm_params", [
    ("DengPingFan__DAVSOD__test.prototxt", {"reshape-cm": (3, 1)}, 84660),
    ("shenjianbing__PDB-ConvLSTM__test.prototxt", {"reshape-cm": (5, 1)}, 84660),
    ("wenguanwang__AGS__model__deploy.prototxt", None, 76560),
])
def test_video_saliency_files_read(name, shapes, lstm_params):
    """The real files: every ConvLSTM is sized (the clip markers come from an HDF5 list that is not
    here, so DAVSOD and PDB-ConvLSTM are given their T x N shape)."""
    model = caffeq.load(str(REALWORLD / name), input_shapes=shapes)
    nodes = [nd for nd in model.layers if nd.type == "ConvLSTM"]
    assert nodes
    for nd in nodes:
        count = sum(int(np.prod(s)) for s in nd.spec.param_shapes(nd.attrs, [model.graph.shape(i) for i in nd.inputs]))
        assert count == lstm_params


# ---- HyperColumns (JiangQH/caffe a86cdfe hypercolumns_layer.cpp) -------------------------------

def hypercolumns_ref(normal, feats, skip):
    """The fork's Forward_cpu at test: every skip-th grid point, its four cases as written."""
    n_, k, hh, ww = normal.shape
    while (hh * ww) % skip:
        skip -= 1
    points = list(range(0, hh * ww, skip))
    rows, normals = [], []
    for n in range(n_):
        for index in points:
            h, w = index // ww, index % ww
            col = []
            for f in feats:
                height, width = f.shape[2], f.shape[3]
                scale = hh // height
                pad = np.float32((scale - 1.0) / 2)
                tw = np.float32((np.float32(w) - pad) / np.float32(scale))
                th = np.float32((np.float32(h) - pad) / np.float32(scale))
                fw, fh = max(int(np.floor(tw)), 0), max(int(np.floor(th)), 0)
                cw, ch = max(int(np.ceil(tw)), 0), max(int(np.ceil(th)), 0)
                cw = cw if cw < width else fw
                ch = ch if ch < height else fh
                a = f[n].astype(np.float64)
                dw, dh = float(tw - fw), float(th - fh)
                if fw == cw and fh == ch:
                    v = a[:, fh, fw]
                elif fh == ch:
                    v = a[:, fh, fw] * (1 - dw) + a[:, fh, fw + 1] * dw
                elif fw == cw:
                    v = a[:, fh, fw] * (1 - dh) + a[:, fh + 1, fw] * dh
                else:
                    v = (a[:, fh, fw] * (1 - dh) + a[:, fh + 1, fw] * dh) * (1 - dw) + \
                        (a[:, fh, fw + 1] * (1 - dh) + a[:, fh + 1, fw + 1] * dh) * dw
                col.append(v)
            rows.append(np.concatenate(col))
            normals.append(normal[n, :, h, w])
    hyper = np.stack(rows)
    return hyper.reshape(hyper.shape[0], hyper.shape[1], 1, 1), np.stack(normals)


def hyper_net(sizes, params, n=2, k=3, hw=(8, 6), tops=("hc", "pt")):
    shapes = {"normal": (n, k) + hw}
    shapes.update({f"f{i}": (n, 2 + i) + s for i, s in enumerate(sizes)})
    layer = ('layer { name: "hyper" type: "HyperColumns" ' + " ".join(f'bottom: "{b}"' for b in shapes)
             + " " + " ".join(f'top: "{t}"' for t in tops) + f" hypercolumns_param {{ {params} }} }}")
    return net(layer, inputs=shapes), shapes


@pytest.mark.parametrize("skip, samples", [(1, 48), (5, 12)])
def test_hypercolumns_test_sampling(tmp_path, skip, samples):
    """A non-square 8 x 6 normal map, maps at scales 1, 2, 4 and 8 (the last a single pixel), and a
    skip_ratio the fork lowers to a divisor of H*W (5 -> 4)."""
    text, shapes = hyper_net([(8, 6), (4, 3), (2, 2), (1, 1)], f"is_train: false skip_ratio: {skip}")
    model = load_from_text(text)
    assert model.blob_shapes["hc"] == (2 * samples, 2 + 3 + 4 + 5, 1, 1)
    assert model.blob_shapes["pt"] == (2 * samples, 3)
    r = rng(5)
    feeds = {k: r.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    hc, pt = hypercolumns_ref(feeds["normal"], [feeds[f"f{i}"] for i in range(4)], skip)
    check_everywhere(model, feeds, {"hc": hc, "pt": pt}, tmp_path, atol=1e-5, rtol=1e-5)


def test_hypercolumns_map_too_small_and_train_refusal(tmp_path):
    text, _ = hyper_net([(3, 3)], "is_train: false")
    with pytest.raises(LayerError, match="too small for scale 2 of the 8 x 6 normal map"):
        load_from_text(text)
    text, shapes = hyper_net([(4, 3)], "sample_num: 7")
    model = load_from_text(text)
    assert model.blob_shapes["hc"] == (14, 2, 1, 1)
    feeds = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    with pytest.raises(LayerError, match="is_train samples random valid points"):
        model.run(feeds)


def test_hypercolumns_file_reads():
    model = caffeq.load(str(REALWORLD / "JiangQH__Hypercolumns-Based-Surface-Normal-Recovery__model__deploy.prototxt"))
    assert model.blob_shapes["hypercolumns"] == (224 * 224, 64 + 128 + 256 + 512 + 512 + 4096, 1, 1)
    assert model.blob_shapes["normal_point"] == (224 * 224, 3)


# ---- BilinearInterpolation and PR (ctensmeyer/caffe 0ded1da bilinear_layer.cpp, 19fcdb2 PR) ----

def bilinear_ref(x, oh, ow):
    """bilinear_layer.cpp Forward_cpu, float32 positions and weights as the fork."""
    n_, c_, ih, iw = x.shape
    hf = np.float32(ih - 1) / np.float32(oh - 1)
    wf = np.float32(iw - 1) / np.float32(ow - 1)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (0, 1), (0, 1)))  # the weight-0 reads past the edge
    out = np.zeros((n_, c_, oh, ow))
    for h in range(oh):
        ho = np.float32(np.float32(h) * hf)
        hl, hc = int(ho), int(np.float32(ho + np.float32(1)))
        for w in range(ow):
            wo = np.float32(np.float32(w) * wf)
            wl, wc = int(wo), int(np.float32(wo + np.float32(1)))
            a00 = np.float32(hc - ho) * np.float32(wc - wo)
            a01 = np.float32(hc - ho) * np.float32(wo - wl)
            a10 = np.float32(ho - hl) * np.float32(wc - wo)
            a11 = np.float32(ho - hl) * np.float32(wo - wl)
            out[:, :, h, w] = (a00 * xp[:, :, hl, wl] + a10 * xp[:, :, hl + 1, wl]
                               + a01 * xp[:, :, hl, wc] + a11 * xp[:, :, hl + 1, wc])
    return out


@pytest.mark.parametrize("src, dst", [((4, 5), (7, 11)), ((9, 6), (4, 3)), ((1, 3), (5, 2))])
def test_bilinear_interpolation(tmp_path, src, dst):
    shapes = {"x": (2, 3) + src, "ref": (1, 1) + dst}
    text = net('layer { name: "up" type: "BilinearInterpolation" bottom: "x" bottom: "ref" top: "up" }',
               inputs=shapes)
    model = load_from_text(text)
    assert model.blob_shapes["up"] == (2, 3) + dst
    r = rng(7)
    feeds = {k: r.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    check_everywhere(model, feeds, {"up": bilinear_ref(feeds["x"], *dst)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_bilinear_interpolation_refuses_a_side_of_one():
    text = net('layer { name: "up" type: "BilinearInterpolation" bottom: "x" bottom: "ref" top: "up" }',
               inputs={"x": (1, 2, 4, 5), "ref": (1, 1, 1, 8)})
    with pytest.raises(LayerError, match="an output side of 1 is not computed"):
        load_from_text(text)


@pytest.mark.parametrize("params, ignore", [("", None), ("precision_recall_param { thresh: 0.3 ignore_label: 2 }", 2)])
def test_pr_metric(params, ignore):
    """precision_recall_layer.cpp: counts of prediction >= thresh against label != 0."""
    text = net('layer { name: "pr" type: "PR" bottom: "p" bottom: "g" top: "precision" top: "recall" '
               f'top: "accuracy" top: "tnr" top: "f" {params} }}', inputs={"p": (2, 1, 3, 4), "g": (2, 1, 3, 4)})
    model = load_from_text(text)
    assert node_of(model, "pr").spec.is_training_only
    r = rng(9)
    p = r.random((2, 1, 3, 4)).astype(np.float32)
    g = r.integers(0, 3, (2, 1, 3, 4)).astype(np.float32)
    got = model.run({"p": p, "g": g})
    thresh = 0.3 if ignore is not None else 0.5
    tp = fp = tn = fn = 0
    for pv, lv in zip(p.ravel(), g.ravel().astype(int)):
        if ignore is not None and lv == ignore:
            continue
        if pv >= thresh:
            tp, fp = (tp + 1, fp) if lv else (tp, fp + 1)
        else:
            tn, fn = (tn + 1, fn) if lv == 0 else (tn, fn + 1)
    prec, rec = tp / (tp + fp), tp / (tp + fn)
    want = {"precision": prec, "recall": rec, "accuracy": (tp + tn) / (tp + fp + tn + fn),
            "tnr": tn / (fp + tn), "f": 2 * prec * rec / (prec + rec)}
    for k, v in want.items():
        assert abs(float(got[k]) - v) < 1e-6, k


@pytest.mark.parametrize("name", ["ctensmeyer__binarization_2017__dibco_model.prototxt",
                                  "ctensmeyer__binarization_2017__train_val.prototxt"])
def test_binarization_files_read(name):
    model = caffeq.load(str(REALWORLD / name), unknown_shapes_ok=True)
    assert sum(nd.type == "BilinearInterpolation" for nd in model.layers) == 3
