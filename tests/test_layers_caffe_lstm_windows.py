"""junhyukoh/caffe-lstm 711ecdab's Im2Windows, Permutation, Reverse (reshape_param) and Lstm with lstm_param.width,
against loops written here from its Forward_cpu (Im2Windows.cpp, PermutationLayer.cpp, ReverseLayer.cpp,
lstm_layer.cpp), in torch, onnxruntime and model.py; the existing Reverse and Lstm read as before."""
import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


# ---- references ---------------------------------------------------------------------------------

def ref_im2windows(x, box, wh, ww, labels, reverse):
    """Im2WindowsLayer::Forward_cpu, pixel by pixel."""
    n_, c_, h_, w_ = x.shape
    gh, gw = h_ // wh, w_ // ww
    rows = gh * gw * n_
    top = np.full((rows, c_, wh, ww), np.nan, F)
    lab = np.zeros((rows, labels), F)
    clip = np.full(rows, np.nan, F)
    clip_w = np.full(rows, np.nan, F)
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    wx, wy = w // ww, h // wh
                    if reverse:
                        wx, wy = gw - wx - 1, gh - wy - 1
                    tn = n_ * (gw * wy + wx) + n
                    top[tn, c, h % wh, w % ww] = x[n, c, h, w]
                    if box is None:
                        continue
                    x0, y0 = wx * ww, wy * wh
                    x1, y1 = x0 + ww, y0 + wh
                    label, ymin, xmin, ymax, xmax, oh, ow = (int(v) for v in box[n, :7])
                    iy0, ix0, iy1, ix1 = max(y0, ymin), max(x0, xmin), min(y1, ymax), min(x1, xmax)
                    ratio = F(0) if iy0 >= iy1 or ix0 >= ix1 else F((iy1 - iy0) * (ix1 - ix0)) / F(wh * ww)
                    lab[tn, label] = ratio
                    if x1 <= ow and y1 <= oh:
                        clip[tn], clip_w[tn] = F(wx != 0), F(wy != 0)
                    else:
                        clip[tn], clip_w[tn] = 0, 0
    return top, lab, clip, clip_w


def sigmoid(v):
    return (1.0 / (1.0 + np.exp(-v.astype(np.float64)))).astype(F)


def ref_grid_lstm(x, n_, width, w_i, w_h, b, w_hw, clip=None, clip_w=None):
    """LstmLayer::Forward_cpu (first call: h_0, c_0 and the h_0_w rows zero); gates [i f o g f_w]."""
    t_ = x.shape[0] // n_
    hd = w_h.shape[1]
    pre = (x.reshape(t_ * n_, -1).astype(np.float64) @ w_i.T.astype(np.float64) + b).astype(F).reshape(t_, n_, 5 * hd)
    hs = np.zeros((t_, n_, hd), F)
    cs = np.zeros((t_, n_, hd), F)
    zero = np.zeros((n_, hd), F)
    for t in range(t_):
        h1, c1 = (hs[t - 1], cs[t - 1]) if t > 0 else (zero, zero)
        hw, cw = (hs[t - width], cs[t - width]) if t >= width else (zero, zero)
        to_gate = (h1.astype(np.float64) @ w_h.T).astype(F)
        to_gate_w = (hw.astype(np.float64) @ w_hw.T).astype(F)
        for n in range(n_):
            cont = bool(clip[t + n]) if clip is not None else t % width != 0    # clip + offset(t) = clip + t
            cont_w = bool(clip_w[t + n]) if clip_w is not None else t >= width
            p = pre[t, n].copy()
            if cont:
                p += to_gate[n]
            if cont_w:
                p += to_gate_w[n]
            i, o = sigmoid(p[:hd]), sigmoid(p[2 * hd:3 * hd])
            f = sigmoid(p[hd:2 * hd]) if cont else np.zeros(hd, F)
            g = np.tanh(p[3 * hd:4 * hd])
            fw = sigmoid(p[4 * hd:]) if cont_w else np.zeros(hd, F)
            cs[t, n] = f * c1[n] + i * g + fw * cw[n]
            hs[t, n] = o * np.tanh(cs[t, n])
    return hs.reshape(t_ * n_, hd)


# ---- Im2Windows --------------------------------------------------------------------------------------

def im2windows_net(shape, wh, ww, extra="", box=False, labels=3):
    tops = ' top: "w" top: "lab" top: "clip" top: "clip_w"' if box else ' top: "w"'
    bottoms = ' bottom: "x"' + (' bottom: "box"' if box else "")
    inputs = {"x": shape, **({"box": (shape[0], 7)} if box else {})}
    return net(f'layer {{ name: "iw" type: "Im2Windows"{bottoms}{tops} im2windows_param {{ window_h: {wh} '
               f'window_w: {ww} labels_count: {labels} {extra} }} }}', inputs=inputs)


@pytest.mark.parametrize("reverse", [False, True])
def test_im2windows_tiles(tmp_path, reverse):
    x = rng(1).standard_normal((2, 3, 9, 8)).astype(F)
    model = load_from_text(im2windows_net(x.shape, 3, 2, "reversed: true" if reverse else ""))
    ref = ref_im2windows(x, None, 3, 2, 0, reverse)[0]
    assert ref.shape == (24, 3, 3, 2) and not np.isnan(ref).any()
    check_everywhere(model, {"x": x}, {"w": ref}, tmp_path)


@pytest.mark.parametrize("reverse", [False, True])
def test_im2windows_box_tops(tmp_path, reverse):
    r = rng(2)
    x = r.standard_normal((2, 2, 9, 10)).astype(F)       # a 3 x 5 grid of 3 x 2 windows
    # label, ymin, xmin, ymax, xmax, original height, original width (truncated toward zero, as C's int())
    box = np.array([[2.7, 1.9, -0.6, 7.2, 5.5, 6.9, 8.0, ],
                    [0.0, 0.0, 3.0, 9.0, 9.99, 9.0, 10.0]], F)
    model = load_from_text(im2windows_net(x.shape, 3, 2, "reversed: true" if reverse else "", box=True))
    top, lab, clip, clip_w = ref_im2windows(x, box, 3, 2, 3, reverse)
    assert not np.isnan(clip).any() and set(np.unique(clip)) == {0, 1} and set(np.unique(clip_w)) == {0, 1}
    assert (lab[:, 2] > 0).any() and (lab[:, 0] > 0).any() and (lab[:, 2] % F(1 / 6) != 0).any()
    check_everywhere(model, {"x": x, "box": box}, {"w": top, "lab": lab, "clip": clip, "clip_w": clip_w}, tmp_path)


def test_im2windows_truncates_the_box_toward_zero(tmp_path):
    """C's int(): a label of -0.7 is 0 (floor would give -1, no column); the box is rows 0-3, columns 1-5."""
    x = rng(8).standard_normal((1, 1, 4, 6)).astype(F)     # a 2 x 2 grid of 2 x 3 windows
    box = np.array([[-0.7, 0.5, 1.9, 3.2, 5.8, 4.0, 6.0]], F)
    model = load_from_text(im2windows_net(x.shape, 2, 3, box=True, labels=2))
    top, lab, clip, clip_w = ref_im2windows(x, box, 2, 3, 2, False)
    assert np.allclose(lab[:, 0], [4 / 6, 4 / 6, 2 / 6, 2 / 6]) and not lab[:, 1].any()
    check_everywhere(model, {"x": x, "box": box}, {"w": top, "lab": lab, "clip": clip, "clip_w": clip_w}, tmp_path)


def test_im2windows_bad_params():
    with pytest.raises(CaffeqError, match="im2windows_param.window_w"):
        load_from_text(im2windows_net((1, 1, 6, 6), 3, 0))
    with pytest.raises(CaffeqError, match="multiple of window_h x window_w"):
        load_from_text(im2windows_net((1, 1, 7, 6), 3, 2))
    with pytest.raises(CaffeqError, match="labels_count"):
        load_from_text(im2windows_net((1, 1, 6, 6), 3, 2, box=True, labels=0))


# ---- Permutation and Reverse -------------------------------------------------------------------------

def ref_permutation(x, t_):
    n_ = x.shape[0] // t_
    c_ = x.size // (t_ * n_)
    flat = x.reshape(-1)
    top = np.zeros((n_, c_, t_), F)
    k = 0
    for t in range(t_):
        for n in range(n_):
            for c in range(c_):
                top[n, c, t] = flat[k]
                k += 1
    return top


def reshape_layer(kind, steps, bottom="x", top="y"):
    return (f'layer {{ name: "{top}" type: "{kind}" bottom: "{bottom}" top: "{top}" '
            f'reshape_param {{ shape {{ dim: {steps} }} }} }}')


@pytest.mark.parametrize("shape, steps", [((6, 5, 2), 3), ((7, 3), 2)])
def test_permutation(tmp_path, shape, steps):
    x = rng(3).standard_normal(shape).astype(F)
    model = load_from_text(net(reshape_layer("Permutation", steps), inputs={"x": shape}))
    ref = ref_permutation(x, steps)
    assert ref.shape == ((2, 10, 3) if steps == 3 else (3, 3, 2))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_fork_reverse_blocks(tmp_path):
    x = rng(4).standard_normal((12, 5, 1, 3)).astype(F)
    model = load_from_text(net(reshape_layer("Reverse", 4), inputs={"x": x.shape}))
    ref = np.empty_like(x)
    count = x.size // 4
    for t in range(4):   # caffe_copy of block t to block T - t - 1
        ref.reshape(-1)[(4 - t - 1) * count:(4 - t) * count] = x.reshape(-1)[t * count:(t + 1) * count]
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_reverse_param_still_flips_an_axis(tmp_path):
    x = rng(5).standard_normal((3, 4, 2)).astype(F)
    text = net('layer { name: "y" type: "Reverse" bottom: "x" top: "y" reverse_param { axis: 1 } }',
               inputs={"x": x.shape})
    check_everywhere(load_from_text(text), {"x": x}, {"y": x[:, ::-1].copy()}, tmp_path)


def test_permutation_and_reverse_bad_params():
    with pytest.raises(CaffeqError, match=r"reshape_param.shape.dim\(0\)"):
        load_from_text(net('layer { name: "y" type: "Permutation" bottom: "x" top: "y" }', inputs={"x": (4, 2)}))
    with pytest.raises(CaffeqError, match="at least T"):
        load_from_text(net(reshape_layer("Permutation", 5), inputs={"x": (4, 2)}))
    with pytest.raises(CaffeqError, match="equal blocks"):
        load_from_text(net(reshape_layer("Reverse", 3), inputs={"x": (4, 2)}))


# ---- Lstm with width ----------------------------------------------------------------------------------

def lstm_net(x_shape, hidden, batch, width, clips=0):
    bottoms = ' bottom: "x"' + ''.join(f' bottom: "{c}"' for c in ("clip", "clip_w")[:clips])
    inputs = {"x": x_shape, **{c: (x_shape[0],) for c in ("clip", "clip_w")[:clips]}}
    return net(f'layer {{ name: "l" type: "Lstm"{bottoms} top: "y" lstm_param {{ num_output: {hidden} '
               f'batch_size: {batch} width: {width} clipping_threshold: 0.1 }} }}', inputs=inputs)


def fill(model, r):
    node = node_of(model, "l")
    for k in range(len(node.blobs)):
        node.blobs[k] = r.uniform(-0.8, 0.8, np.shape(node.blobs[k])).astype(F)
    return [np.asarray(b) for b in node.blobs]


def test_grid_lstm_without_clips(tmp_path):
    r = rng(6)
    model = load_from_text(lstm_net((18, 3, 1, 2), 4, 2, 3), random_weights=True)   # T = 9 = 3 rows of 3
    blobs = fill(model, r)
    assert [b.shape for b in blobs] == [(20, 6), (20, 4), (20,), (20, 4)]
    x = r.uniform(-1, 1, (18, 3, 1, 2)).astype(F)
    ref = ref_grid_lstm(x, 2, 3, *blobs)
    assert ref.shape == (18, 4)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("clips", [1, 2])
def test_grid_lstm_with_clip_bottoms(tmp_path, clips):
    r = rng(7)
    model = load_from_text(lstm_net((16, 5), 3, 2, 4, clips), random_weights=True)    # T = 8, width 4
    blobs = fill(model, r)
    x = r.uniform(-1, 1, (16, 5)).astype(F)
    clip = np.array([0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], F)
    clip_w = np.array([0, 0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1], F)
    feeds = {"x": x, "clip": clip, **({"clip_w": clip_w} if clips == 2 else {})}
    ref = ref_grid_lstm(x, 2, 4, *blobs, clip=clip, clip_w=clip_w if clips == 2 else None)
    check_everywhere(model, feeds, {"y": ref}, tmp_path, atol=2e-6, rtol=1e-5)


def test_grid_lstm_bad_params_and_the_other_lstm():
    with pytest.raises(CaffeqError, match="lstm_param.width"):
        load_from_text(lstm_net((12, 3), 4, 2, 4), random_weights=True)      # T = 6 rows
    with pytest.raises(CaffeqError, match="lstm_param.width must be >= 1"):
        load_from_text(lstm_net((12, 3), 4, 2, 0), random_weights=True)
    head = net('layer { name: "l" type: "Lstm" bottom: "x" top: "y" lstm_param { num_output: 4 batch_size: 2 } }',
               inputs={"x": (6, 3)})
    assert [np.shape(b) for b in node_of(load_from_text(head, random_weights=True), "l").blobs] == \
        [(16, 3), (16, 4), (16,)]


# ---- the corpus ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, top, shape", [
    ("junhyukoh__caffe-lstm__deep_pooling_pretrain2.prototxt", "permutation1", (200, 32, 64)),
    ("junhyukoh__caffe-lstm__imagenet_train.prototxt", "lstm", (25, 2048)),
])
def test_corpus_files_read(name, top, shape):
    model = load_from_text((CORPUS / name).read_text())
    assert tuple(model.blob_shapes[top]) == shape
