"""zachluo/convlstm_anomaly_detection ConvolutionLSTM and haamoon/caffe SegmentPooling: numpy references
written from the forks' C++ (conv_lstm_layer.cpp + conv_lstm_unit_layer.cu; segment_pooling_layer.cpp
+ tracker_math.cpp tracker_cpu_csr_gemm)."""
import numpy as np
import pytest
from conftest import REPO, check_everywhere, inspect_corpus_file, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _conv(x, w, b, pad):
    # stride 1, square pad: x (N, C, H, W), w (O, C, kh, kw)
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.zeros((n, c, h + 2 * pad, wd + 2 * pad), np.float64)
    xp[:, :, pad:pad + h, pad:pad + wd] = x
    ho, wo = h + 2 * pad - kh + 1, wd + 2 * pad - kw + 1
    out = np.zeros((n, o, ho, wo), np.float64)
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + ho, j:j + wo], w[:, :, i, j])
    if b is not None:
        out += b.reshape(1, -1, 1, 1)
    return out


def conv_lstm_ref(x, cont, w_xc, b_c, w_hc, pad_x, pad_h):
    """The unrolled net: W_xc_x (bias b_c), per step W_hc * (cont_t h) + W_xc_x_t, the GPU unit."""
    t, n = x.shape[:2]
    d = w_hc.shape[1]
    gx = _conv(x.reshape(t * n, *x.shape[2:]), w_xc, b_c, pad_x)
    gx = gx.reshape(t, n, *gx.shape[1:])
    h = np.zeros((n, d) + gx.shape[3:])
    c = np.zeros_like(h)
    outs = []
    for s in range(t):
        ct = cont[s].reshape(n, 1, 1, 1)
        pre = _conv(ct * h, w_hc, None, pad_h) + gx[s]
        i, f, o, g = (pre[:, k * d:(k + 1) * d] for k in range(4))
        c = ct * _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        h = _sigmoid(o) * np.tanh(c)
        outs.append(h)
    return np.stack(outs).astype(np.float32)


def conv_lstm_net(t, n, c_in, h, w, d, kx=3, px=1, kh=3, ph=1, extra=""):
    layer = (f'layer {{ name: "lstm" type: "ConvolutionLSTM" bottom: "x" bottom: "cont" top: "o" '
             f'recurrent_param {{ num_output: {d} {extra} '
             f'wxc_convolution_param {{ kernel_size: {kx} pad: {px} stride: 1 bias_term: false num_output: 7 }} '
             f'whh_convolution_param {{ kernel_size: {kh} pad: {ph} bias_term: true }} }} }}')
    return net(layer, inputs={"x": (t, n, c_in, h, w), "cont": (t, n)})


@pytest.mark.parametrize("kx,px,kh,ph", [(3, 1, 3, 1), (1, 0, 5, 2)])
def test_convolution_lstm_matches_the_unrolled_net(kx, px, kh, ph, tmp_path):
    r = rng(3)
    t, n, c_in, h, w, d = 4, 2, 3, 5, 7, 2
    model = load_from_text(conv_lstm_net(t, n, c_in, h, w, d, kx, px, kh, ph), random_weights=True)
    w_xc = (r.standard_normal((4 * d, c_in, kx, kx)) * 0.4).astype(np.float32)
    b_c = (r.standard_normal(4 * d) * 0.3).astype(np.float32)
    w_hc = (r.standard_normal((4 * d, d, kh, kh)) * 0.4).astype(np.float32)
    node_of(model, "lstm").blobs = [w_xc, b_c, w_hc]
    x = r.standard_normal((t, n, c_in, h, w)).astype(np.float32)
    cont = np.array([[0, 0], [1, 1], [1, 0], [1, 1]], np.float32)
    ref = conv_lstm_ref(x.astype(np.float64), cont, w_xc.astype(np.float64), b_c.astype(np.float64),
                        w_hc.astype(np.float64), px, ph)
    check_everywhere(model, {"x": x, "cont": cont}, {"o": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_convolution_lstm_blob_shapes():
    model = load_from_text(conv_lstm_net(2, 2, 3, 5, 7, 4, 3, 1, 5, 2), random_weights=True)
    shapes = [tuple(b.shape) for b in node_of(model, "lstm").blobs]
    assert shapes == [(16, 3, 3, 3), (16,), (16, 4, 5, 5)]


@pytest.mark.parametrize("extra,msg", [("expose_hidden: true", "expose_hidden"),
                                       ("", "keep H x W")])
def test_convolution_lstm_refusals(extra, msg):
    text = conv_lstm_net(2, 2, 3, 5, 7, 2, extra=extra) if extra else conv_lstm_net(2, 2, 3, 5, 7, 2, 3, 0)
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(text)


def test_convolution_lstm_names_its_own_field_and_source():
    text = conv_lstm_net(2, 2, 3, 5, 7, 2).replace("whh_convolution_param { kernel_size: 3",
                                                    "whh_convolution_param { kernel_h: 3 kernel_w: 3 kernel_size: 3")
    with pytest.raises(CaffeqError, match=r"recurrent_param\.whh_convolution_param: kernel_h is not read by the "
                                          r"fork \(conv_lstm_layer\.cpp sizes h_0"):
        load_from_text(text)


def segment_pooling_ref(feat, vals, inds, ptr, seg, cells):
    """segment_pooling_layer.cpp Forward_cpu: tracker_cpu_csr_gemm(NoTrans, Trans) row by row."""
    lead = seg.shape
    n = seg.size
    ch = feat.shape[-3]
    f = feat.reshape(n, ch, -1)
    vals, inds, ptr = vals.reshape(n, -1), inds.reshape(n, -1), ptr.reshape(n, -1)
    rmax = ptr.shape[1] - 1
    out = np.zeros((n, rmax, ch), np.float32)
    for i in range(n):
        rows = int(seg.reshape(-1)[i] * cells)
        for r in range(rows):
            for p in range(int(ptr[i, r]), int(ptr[i, r + 1])):
                out[i, r] += np.float32(vals[i, p]) * f[i, :, int(inds[i, p])]
    return out.reshape(lead + (rmax // cells, cells * ch))


def seg_inputs(r, lead, ch, h, w, length, cells, nseg_max):
    n = int(np.prod(lead))
    rmax = nseg_max * cells
    vals = r.standard_normal((n, length)).astype(np.float32)
    inds = r.integers(0, h * w, (n, length)).astype(np.float32)
    ptr = np.zeros((n, rmax + 1), np.float32)
    seg = np.zeros(n, np.float32)
    for i in range(n):
        used = r.integers(length // 2, length + 1)
        cuts = np.sort(r.integers(0, used + 1, rmax - 1))
        ptr[i] = np.concatenate([[0], cuts, [used]])
        seg[i] = r.integers(0, nseg_max + 1)
    seg[0] = nseg_max
    seg[1] = 0
    return (r.standard_normal(lead + (ch, h, w)).astype(np.float32), vals.reshape(lead + (length,)),
            inds.reshape(lead + (length,)), ptr.reshape(lead + (rmax + 1,)), seg.reshape(lead))


@pytest.mark.parametrize("lead,cells", [((2,), 3), ((3, 2), 2)])
def test_segment_pooling_sums_csr_rows(lead, cells, tmp_path):
    r = rng(5)
    ch, h, w, length, nseg = 4, 3, 5, 23, 3
    feeds = dict(zip(("f", "d", "i", "p", "s"), seg_inputs(r, lead, ch, h, w, length, cells, nseg)))
    text = net(f'layer {{ name: "sp" type: "SegmentPooling" bottom: "f" bottom: "d" bottom: "i" bottom: "p" '
               f'bottom: "s" top: "o" segment_pooling_param {{ num_spatial_cells: {cells} }} }}',
               inputs={k: v.shape for k, v in feeds.items()})
    model = load_from_text(text)
    ref = segment_pooling_ref(*feeds.values(), cells)
    assert ref.shape == lead + (nseg, cells * ch)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_segment_pooling_absolute_pointers_empty_rows_and_truncated_rows(tmp_path):
    """Row pointers are offsets into the values (ptr[0] need not be 0), a row whose end is before its start
    adds nothing, and seg_num * cells is truncated to int (1.4 * 2 -> 2 live rows, not 3)."""
    r = rng(7)
    ch, h, w, length, cells = 3, 2, 3, 9, 2
    feat = r.standard_normal((2, ch, h, w)).astype(np.float32)
    vals = r.standard_normal((2, length)).astype(np.float32)
    inds = r.integers(0, h * w, (2, length)).astype(np.float32)
    ptr = np.array([[2, 4, 4, 7, 5, 9, 9], [1, 3, 6, 8, 9, 9, 9]], np.float32)
    seg = np.array([3, 1.4], np.float32)
    feeds = {"f": feat, "d": vals, "i": inds, "p": ptr, "s": seg}
    text = net(f'layer {{ name: "sp" type: "SegmentPooling" bottom: "f" bottom: "d" bottom: "i" bottom: "p" '
               f'bottom: "s" top: "o" segment_pooling_param {{ num_spatial_cells: {cells} }} }}',
               inputs={k: v.shape for k, v in feeds.items()})
    ref = segment_pooling_ref(feat, vals, inds, ptr, seg, cells)
    assert ref.shape == (2, 3, cells * ch)
    assert not ref[0, 0, ch:].any() and not ref[0, 1, ch:].any() and ref[0, 1, :ch].any()   # rows 1, 3 empty
    assert ref[1, 0].any() and not ref[1, 1:].any()                                         # 2 live rows
    check_everywhere(load_from_text(text), feeds, {"o": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_segment_pooling_refuses_rows_not_a_multiple_of_cells():
    text = net('layer { name: "sp" type: "SegmentPooling" bottom: "f" bottom: "d" bottom: "i" bottom: "p" '
               'bottom: "s" top: "o" segment_pooling_param { num_spatial_cells: 4 } }',
               inputs={"f": (2, 3, 4, 5), "d": (2, 9), "i": (2, 9), "p": (2, 7), "s": (2,)})
    with pytest.raises(CaffeqError, match="num_spatial_cells"):
        load_from_text(text)


@pytest.mark.parametrize("name,args,needle", [
    ("zachluo__convlstm_anomaly_detection__zstorm_conv_lstm_deconv__deploy.prototxt", (), "ConvolutionLSTM"),
    ("haamoon__caffe__tracker_model__Test_Layers__seg_pooling.prototxt", (), "3x2x1000x3072"),
])
def test_corpus_files_read(name, args, needle):
    assert needle in inspect_corpus_file(CORPUS / name, *args)
