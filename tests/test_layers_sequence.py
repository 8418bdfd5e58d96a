"""Sequence layers of the OCR / text-detection forks: Reverse, Transpose, ContinuationIndicator,
Curve-Text-Detector's Convert, CTPN's Lstm.

References are numpy re-derivations written here as loops from the forks' C++
(tianzhi0549/CTPN's caffe, senlinuc/caffe_ocr, the CRNN ports' ContinuationIndicator); each layer
runs in torch, in onnxruntime (the exported ONNX) and in the generated model.py.
"""

import numpy as np
import pytest
import torch
from conftest import assert_close, backend_outputs, check_everywhere, model_py_outputs, net, onnx_outputs, rng

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

# ---- references -------------------------------------------------------------------------------

def reverse_ref(x, axis):
    """caffe_ocr's ReverseLayer::Forward_cpu: per prefix, copy the blocks below `axis` in reverse order."""
    shape = x.shape
    count = x.size
    copy_amount = 1 if axis + 1 == len(shape) else int(np.prod(shape[axis + 1:]))
    axis_count = int(np.prod(shape[axis:]))
    num_fix = count // axis_count if axis > 0 else 1
    sub_iter_max = shape[axis]
    src = x.reshape(-1)
    top = np.full(count, np.nan, np.float32)
    s = 0
    for fix in range(num_fix):
        target = (fix + 1) * copy_amount * sub_iter_max - copy_amount
        for _ in range(sub_iter_max):
            top[target:target + copy_amount] = src[s:s + copy_amount]
            s += copy_amount
            target -= copy_amount
    return top.reshape(shape)


def reverse_ref_ctpn(x, axis):
    """CTPN's reverse_cpu: index -> index + counts[axis] * (shape[axis] - 2 * ind - 1), ind = the
    index's position along `axis`."""
    counts = [int(np.prod(x.shape[i + 1:])) for i in range(x.ndim)]
    src = x.reshape(-1)
    top = np.full(x.size, np.nan, np.float32)
    for index in range(x.size):
        ind = (index // counts[axis]) % x.shape[axis]
        top[counts[axis] * (x.shape[axis] - 2 * ind - 1) + index] = src[index]
    return top.reshape(x.shape)


def transpose_ref(x, dims):
    """transpose_cpu: from_inds by the bottom's counts, to_index = sum from_inds[dim[i]] * top counts."""
    shape = x.shape
    top_shape = tuple(shape[d] for d in dims)
    from_counts = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    to_counts = [int(np.prod(top_shape[i + 1:])) for i in range(len(shape))]
    src = x.reshape(-1)
    top = np.full(x.size, np.nan, np.float32)
    for index in range(x.size):
        rest, inds = index, []
        for i in range(len(shape)):
            inds.append(rest // from_counts[i])
            rest %= from_counts[i]
        to_index = sum(inds[dims[i]] * to_counts[i] for i in range(len(shape)))
        top[to_index] = src[index]
    return top.reshape(top_shape)


def continuation_ref(time_step, batch_size):
    out = []
    for t in range(time_step):
        for _ in range(batch_size):
            out.append(0.0 if t == 0 else 1.0)
    return np.array(out, np.float32).reshape(time_step, batch_size)


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def lstm_ref(x, w_x, w_h, b, clip=None, n=None):
    """LstmLayer's forward (the GPU kernels: each sample's own recurrent term), float64 loops:
    pre_gate = W_x x + b (+ clip_t W_h h_{t-1}); gates [i f o g]; c = clip_t f c_{t-1} + i g, where
    clip_t[n] is the clip bottom's element offset(t) + n (offset(t) = t * count / num) and, without
    a clip bottom, t > 0.  The state before t = 0 is zero (the fork's first forward).  n: the
    batch of junhyukoh/caffe-lstm's (T*N, ...) layout (the result is then (T*N, H))."""
    flat = n is not None
    t_len, n = (x.shape[0] // n, n) if flat else (x.shape[0], x.shape[1])
    hd = w_h.shape[1]
    xs = x.reshape(t_len, n, -1).astype(np.float64)
    w_x, w_h, b = (a.astype(np.float64) for a in (w_x, w_h, b))
    h = np.zeros((t_len, n, hd))
    c = np.zeros((t_len, n, hd))
    for t in range(t_len):
        for s in range(n):
            if clip is None:
                cont = 1.0 if t > 0 else 0.0
            else:
                cont = float(clip.reshape(-1)[t * (clip.size // clip.shape[0]) + s])
            h_prev = h[t - 1, s] if t > 0 else np.zeros(hd)
            c_prev = c[t - 1, s] if t > 0 else np.zeros(hd)
            pre = w_x @ xs[t, s] + b + cont * (w_h @ h_prev)
            for d in range(hd):
                i = sigmoid(pre[d])
                f = sigmoid(pre[hd + d])
                o = sigmoid(pre[2 * hd + d])
                g = np.tanh(pre[3 * hd + d])
                c[t, s, d] = cont * f * c_prev[d] + i * g
                h[t, s, d] = o * np.tanh(c[t, s, d])
    return h.reshape(t_len * n, hd) if flat else h


# ---- Reverse ------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_reverse_in_every_backend(axis, tmp_path):
    x = rng(1).standard_normal((3, 2, 4, 5)).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "o" type: "Reverse" bottom: "x" top: "o" '
                               f'reverse_param {{ axis: {axis} }} }}', inputs={"x": (2, 2, 4, 5)}))
    want = reverse_ref(x, axis)
    np.testing.assert_array_equal(reverse_ref_ctpn(x, axis), want)   # CTPN's and caffe_ocr's loops agree
    for backend, v in backend_outputs(model, {"x": x}, tmp_path).items():
        np.testing.assert_array_equal(v, want, err_msg=backend)


def test_reverse_default_axis_is_0():
    x = rng(2).standard_normal((3, 2, 4)).astype(np.float32)
    model = load_from_text(net('layer { name: "o" type: "Reverse" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    np.testing.assert_array_equal(model.run({"x": x})["o"], x[::-1])


@pytest.mark.parametrize("params, top, msg", [("axis: -1", "o", "axis must be >= 0"),
                                               ("axis: 3", "o", "out of range"), ("axis: 0", "x", "in-place")])
def test_reverse_bad_params(params, top, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "o" type: "Reverse" bottom: "x" top: "{top}" '
                           f'reverse_param {{ {params} }} }}', inputs={"x": (3, 2, 4)}))


# ---- Transpose ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, field", [("Transpose", "transpose_param"),
                                         ("DTransform", "dtransform_param")])   # LPAIS/DenseNet-CTC's copy
@pytest.mark.parametrize("dims", [(3, 2, 0, 1), (2, 3, 1, 0), (0, 1, 2, 3), (1, 0, 3, 2)])
def test_transpose_in_every_backend(kind, field, dims, tmp_path):
    x = rng(3).standard_normal((3, 2, 4, 5)).astype(np.float32)
    text = net(f'layer {{ name: "o" type: "{kind}" bottom: "x" top: "o" {field} {{ '
               f'{" ".join(f"dim: {d}" for d in dims)} }} }}', inputs={"x": (2, 2, 4, 5)})
    model = load_from_text(text)
    want = transpose_ref(x, dims)
    assert model.blob_shapes["o"] == tuple((2, 2, 4, 5)[d] for d in dims)
    for backend, v in backend_outputs(model, {"x": x}, tmp_path).items():
        np.testing.assert_array_equal(v, want, err_msg=backend)


@pytest.mark.parametrize("dims, msg", [((0, 1, 2), "one per axis"), ((0, 1, 1, 2), "each axis"),
                                       ((0, 1, 2, 4), "each axis"), ((), "one per axis")])
def test_transpose_bad_dims(dims, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "o" type: "Transpose" bottom: "x" top: "o" transpose_param {{ '
                           f'{" ".join(f"dim: {d}" for d in dims)} }} }}', inputs={"x": (3, 2, 4, 5)}))


# ---- ContinuationIndicator ----------------------------------------------------------------------

def _indicator_fields():
    from caffeq.io.schema import caffe_pb2
    message = getattr(caffe_pb2, "ContinuationIndicatorParameter", None)
    return message.DESCRIPTOR.fields_by_name if message is not None else {}


needs_batch_size = pytest.mark.skipif("batch_size" not in _indicator_fields(),
                                      reason="caffe.proto lacks continuation_indicator_param.batch_size "
                                             "(the CRNN forks' field 2, used by every published prototxt)")

INDICATOR = ('layer { name: "indicator" type: "ContinuationIndicator" top: "indicator" '
             'continuation_indicator_param { time_step: %d batch_size: %d } }')


@needs_batch_size
def test_continuation_indicator_in_every_backend(tmp_path):
    """With BVLC's LSTM, as CRNN ports use it: the indicator restarts the sequence at t = 0 only."""
    t, n, k, h = 5, 3, 4, 6
    text = net(INDICATOR % (t, n),
               f'layer {{ name: "o" type: "LSTM" bottom: "x" bottom: "indicator" top: "o" '
               f'recurrent_param {{ num_output: {h} }} }}', inputs={"x": (t, n, k)})
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["indicator"] == (t, n)
    x = rng(4).standard_normal((t, n, k)).astype(np.float32)
    ref_cont = continuation_ref(t, n)
    np.testing.assert_array_equal(model.run({"x": x}, all_blobs=True)["indicator"], ref_cont)
    # the LSTM fed the indicator equals the LSTM fed the reference blob as an input
    fed = load_from_text(net(f'layer {{ name: "o" type: "LSTM" bottom: "x" bottom: "cont" top: "o" '
                             f'recurrent_param {{ num_output: {h} }} }}', inputs={"x": (t, n, k), "cont": (t, n)}),
                         random_weights=True)
    lstm = next(node for node in model.layers if node.name == "o")
    next(node for node in fed.layers if node.name == "o").blobs = lstm.blobs
    want = fed.run({"x": x, "cont": ref_cont})["o"]
    for backend, v in backend_outputs(model, {"x": x}, tmp_path).items():
        assert_close(v, want, 1e-5, 1e-5, f"indicator + LSTM {backend}")


@needs_batch_size
@pytest.mark.parametrize("t, n", [(0, 1), (3, 0)])
def test_continuation_indicator_bad_params(t, n):
    with pytest.raises(LayerError, match="time_step and batch_size must be > 0"):
        load_from_text(INDICATOR % (t, n))


JOLIBRAIN_INDICATOR = ('layer { name: "o" type: "ContinuationIndicator" bottom: "x" top: "o" '
                       'continuation_indicator_param { time_step: %d %s } }')


@pytest.mark.parametrize("axis_text, axis", [("", 0), ("axis: 3", 3), ("axis: -2", 2)])
def test_jolibrain_continuation_indicator_takes_the_batch_from_its_bottom(tmp_path, axis_text, axis):
    """jolibrain/caffe continuation_indicator_layer.cpp: mini_batch = bottom[0]->shape(axis)."""
    shape, t = (2, 3, 5, 7), 4
    model = load_from_text(net(JOLIBRAIN_INDICATOR % (t, axis_text), inputs={"x": shape}))
    want = continuation_ref(t, shape[axis])
    assert model.blob_shapes["o"] == want.shape
    x = rng(1).standard_normal(shape).astype(np.float32)
    for backend, v in backend_outputs(model, {"x": x}, tmp_path).items():
        np.testing.assert_array_equal(v, want, err_msg=backend)


def test_jolibrain_continuation_indicator_follows_the_batch(tmp_path):
    """The batch is read at every Reshape: another batch in torch and in the dynamic-batch ONNX."""
    from conftest import onnx_session
    model = load_from_text(net(JOLIBRAIN_INDICATOR % (3, ""), inputs={"x": (2, 3, 5, 7)}))
    x = rng(2).standard_normal((6, 3, 5, 7)).astype(np.float32)
    np.testing.assert_array_equal(model.reshaped(6).run({"x": x})["o"], continuation_ref(3, 6))
    sess = onnx_session(model, tmp_path / "m.onnx")
    np.testing.assert_array_equal(sess.run(None, {sess.get_inputs()[0].name: x})[0], continuation_ref(3, 6))
    one_step = load_from_text(net(JOLIBRAIN_INDICATOR % (1, ""), inputs={"x": (2, 3, 5, 7)}))
    for backend, v in backend_outputs(one_step, {"x": x[:2]}, tmp_path / "one").items():
        np.testing.assert_array_equal(v, continuation_ref(1, 2), err_msg=backend)


@pytest.mark.parametrize("params, msg", [
    ("axis: 4", "axis 4 is out of range for a 4-axis bottom"),
    ("axis: -5", "axis -5 is out of range"),
])
def test_jolibrain_continuation_indicator_bad_axis(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(JOLIBRAIN_INDICATOR % (3, params), inputs={"x": (2, 3, 5, 7)}))


def test_continuation_indicator_without_batch_size_or_bottom_says_so():
    with pytest.raises(LayerError, match="without batch_size, takes the batch from a bottom"):
        load_from_text('layer { name: "o" type: "ContinuationIndicator" top: "o" '
                       'continuation_indicator_param { time_step: 3 } }')


# ---- CTPN's Lstm -----------------------------------------------------------------------------------

def lstm_model(t, n, in_tail, h, seed, extra_bottom=""):
    text = net(f'layer {{ name: "o" type: "Lstm" bottom: "x" {extra_bottom} top: "o" lstm_param {{ num_output: {h} '
               f'weight_filler {{ type: "gaussian" std: 0.01 }} bias_filler {{ type: "constant" }} '
               f'clipping_threshold: 1 }} }}', inputs={"x": (t, n) + in_tail})
    model = load_from_text(text, random_weights=True)
    node = next(node for node in model.layers if node.name == "o")
    g = rng(seed)
    node.blobs = [g.normal(0, 0.6, b.shape).astype(np.float32) for b in node.blobs]
    return model, node


def convert_ref(x):
    """convert_layer.cu ConvertForward: out[wv*N*D + sv*D + dv] = in[index], index = (sv, dv, wv) of
    the bottom read as N x D x W; ContForward: index < N is 0, the rest 1 (shape W x N)."""
    n, d, w = x.shape[0], x.shape[1], x.shape[-1]
    flat = x.reshape(-1)
    out = np.zeros(w * n * d, np.float32)
    for index in range(n * d * w):
        sv, wv, dv = index // (d * w), index % w, (index % (d * w)) // w
        out[wv * n * d + sv * d + dv] = flat[index]
    cont = np.array([0.0 if i < n else 1.0 for i in range(w * n)], np.float32).reshape(w, n)
    return out.reshape(w, n, d), cont


@pytest.mark.parametrize("shape", [(2, 3, 1, 5), (3, 4, 7)])
def test_curve_text_detectors_convert(shape, tmp_path):
    x = rng(7).standard_normal(shape).astype(np.float32)
    model = load_from_text(net('layer { name: "c" type: "Convert" bottom: "x" top: "seq" top: "cont" }',
                               inputs={"x": shape}))
    seq, cont = convert_ref(x)
    assert model.blob_shapes["seq"] == seq.shape and model.blob_shapes["cont"] == cont.shape
    check_everywhere(model, {"x": x}, {"seq": seq, "cont": cont}, tmp_path)
    one = load_from_text(net('layer { name: "c" type: "Convert" bottom: "x" top: "seq" }', inputs={"x": shape}))
    check_everywhere(one, {"x": x}, {"seq": seq}, tmp_path)


@pytest.mark.parametrize("shape", [(2, 3, 2, 5), (2, 3)])
def test_convert_refuses_what_its_kernels_cannot_index(shape):
    with pytest.raises(LayerError, match="every axis between D and W of size 1"):
        load_from_text(net('layer { name: "c" type: "Convert" bottom: "x" top: "seq" }', inputs={"x": shape}))


def test_ctpn_lstm_in_every_backend(tmp_path):
    t, n, tail, h = 5, 3, (2, 2), 6
    model, node = lstm_model(t, n, tail, h, 5)
    assert [tuple(b.shape) for b in node.blobs] == [(4 * h, 4), (4 * h, h), (4 * h,)]
    assert model.blob_shapes["o"] == (t, n, h)
    x = rng(6).standard_normal((t, n) + tail).astype(np.float32)
    want = lstm_ref(x, *node.blobs)
    for backend, v in backend_outputs(model, {"x": x}, tmp_path).items():
        assert v.shape == want.shape, backend
        assert_close(v, want, 1e-5, 1e-5, f"Lstm {backend}")


def test_ctpn_lstm_samples_do_not_mix():
    """Each sample of the batch runs its own recurrence (the fork's GPU kernels; see sequence.py)."""
    t, n, tail, h = 4, 3, (5,), 4
    model, _ = lstm_model(t, n, tail, h, 7)
    x = rng(8).standard_normal((t, n) + tail).astype(np.float32)
    whole = model.run({"x": x})["o"]
    single, _ = lstm_model(t, 1, tail, h, 7)
    for s in range(n):
        assert_close(single.run({"x": x[:, s:s + 1]})["o"][:, 0], whole[:, s], 1e-6, 1e-6, f"sample {s}")


def test_ctpn_lstm_bad_params():
    with pytest.raises(LayerError, match="clip bottom .4, 1. holds too few entries for T = 4 steps of N = 2"):
        load_from_text(net('layer { name: "o" type: "Lstm" bottom: "x" bottom: "c" top: "o" '
                           'lstm_param { num_output: 3 } }', inputs={"x": (4, 2, 3), "c": (4, 1)}))
    with pytest.raises(LayerError, match="num_output must be positive"):
        load_from_text(net('layer { name: "o" type: "Lstm" bottom: "x" top: "o" }', inputs={"x": (4, 2, 3)}))
    with pytest.raises(LayerError, match="first axis must be a multiple of lstm_param.batch_size 3"):
        load_from_text(net('layer { name: "o" type: "Lstm" bottom: "x" top: "o" lstm_param { num_output: 3 '
                           'batch_size: 3 } }', inputs={"x": (4, 2)}))
    with pytest.raises(LayerError, match="lstm_param.batch_size"):
        load_from_text(net('layer { name: "o" type: "Lstm" bottom: "x" top: "o" lstm_param { num_output: 3 '
                           'batch_size: 0 } }', inputs={"x": (4, 2)}))


def clip_model(x_shape, clip_shape, h, seed, extra=""):
    text = net(f'layer {{ name: "o" type: "Lstm" bottom: "x" bottom: "clip" top: "o" lstm_param {{ num_output: {h} '
               f'{extra} }} }}', inputs={"x": x_shape, "clip": clip_shape})
    model = load_from_text(text, random_weights=True)
    node = next(node for node in model.layers if node.name == "o")
    node.blobs = [rng(seed).normal(0, 0.6, b.shape).astype(np.float32) for b in node.blobs]
    return model, node


def test_lstm_clip_restarts_sequences_in_torch_and_model_py(tmp_path):
    """A clip bottom (junhyukoh/caffe-lstm, CTPN's fork): 0 where a sequence starts, state carried
    where 1; CTPN's (T, N) clip on asymmetric shapes, a restart in mid-batch and a first step of 1
    (which reads the zero state of the fork's first forward)."""
    t, n, h = 5, 3, 4
    model, node = clip_model((t, n, 2, 3), (t, n), h, 11)
    x = rng(12).standard_normal((t, n, 2, 3)).astype(np.float32)
    clip = np.array([[0, 1, 1], [1, 1, 0], [1, 0, 1], [1, 1, 1], [0, 1, 1]], np.float32)
    want = lstm_ref(x, *node.blobs, clip=clip)
    feeds = {"x": x, "clip": clip}
    assert model.blob_shapes["o"] == (t, n, h)
    assert_close(model.run(feeds)["o"], want, 1e-5, 1e-5, "torch")
    assert_close(model_py_outputs(model, feeds, tmp_path)["o"], want, 1e-5, 1e-5, "model.py")
    # a restart really restarts: the clip changes the result, and clip = (t > 0) is the one-bottom layer
    assert np.abs(lstm_ref(x, *node.blobs) - want).max() > 1e-3
    steps = np.repeat((np.arange(t) > 0).astype(np.float32)[:, None], n, 1)
    assert_close(model.run({"x": x, "clip": steps})["o"], lstm_ref(x, *node.blobs), 1e-5, 1e-5, "clip = t > 0")
    with pytest.raises(ExportError, match="'o' .Lstm.: its clip bottom restarts sequences"):
        onnx_outputs(model, feeds, tmp_path)


def test_junhyukoh_flat_layout_with_batch_size_everywhere(tmp_path):
    """junhyukoh/caffe-lstm's layout: x (T*N, I...), N = lstm_param.batch_size, top (T*N, H)."""
    t, n, h = 4, 2, 3
    text = net(f'layer {{ name: "o" type: "Lstm" bottom: "x" top: "o" lstm_param {{ num_output: {h} batch_size: {n} '
               f'}} }}', inputs={"x": (t * n, 5)})
    model = load_from_text(text, random_weights=True)
    node = next(node for node in model.layers if node.name == "o")
    node.blobs = [rng(13).normal(0, 0.6, b.shape).astype(np.float32) for b in node.blobs]
    assert [tuple(b.shape) for b in node.blobs] == [(4 * h, 5), (4 * h, h), (4 * h,)]
    x = rng(14).standard_normal((t * n, 5)).astype(np.float32)
    want = lstm_ref(x, *node.blobs, n=n)
    assert model.blob_shapes["o"] == (t * n, h)
    for backend, v in backend_outputs(model, {"x": x}, tmp_path).items():
        assert v.shape == want.shape, backend
        assert_close(v, want, 1e-5, 1e-5, f"flat Lstm {backend}")


def test_junhyukoh_lstm_sequence_example_runs_with_its_clip(tmp_path):
    """The fork's examples/lstm_sequence net: a (320, 1) series, a (320, 1) clip, N = 1."""
    model, node = clip_model((12, 1), (12, 1), 5, 15, extra="clipping_threshold: 0.1")
    x = rng(16).standard_normal((12, 1)).astype(np.float32)
    clip = np.ones((12, 1), np.float32)
    clip[[0, 7]] = 0
    want = lstm_ref(x, *node.blobs, clip=clip, n=1)
    assert model.blob_shapes["o"] == (12, 5)
    assert_close(model.run({"x": x, "clip": clip})["o"], want, 1e-5, 1e-5, "torch")
    assert_close(model_py_outputs(model, {"x": x, "clip": clip}, tmp_path)["o"], want, 1e-5, 1e-5, "model.py")


# ---- CTPN's recurrent block ---------------------------------------------------------------------------

def test_ctpn_bidirectional_block_in_every_backend(tmp_path):
    """CTPN's deploy.prototxt pattern: Transpose to (W, H, C...), forward Lstm, Reverse + Lstm + Reverse,
    Concat, Transpose back."""
    n, c, hh, ww, h = 2, 3, 4, 5, 4
    layers = [
        'layer { name: "tr" type: "Transpose" bottom: "x" top: "tr" transpose_param { dim: 3 dim: 2 dim: 0 dim: 1 } }',
        'layer { name: "in" type: "Reshape" bottom: "tr" top: "in" reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }',
        f'layer {{ name: "fw" type: "Lstm" bottom: "in" top: "fw" lstm_param {{ num_output: {h} }} }}',
        'layer { name: "r1" type: "Reverse" bottom: "in" top: "r1" reverse_param { axis: 0 } }',
        f'layer {{ name: "bw" type: "Lstm" bottom: "r1" top: "bw0" lstm_param {{ num_output: {h} }} }}',
        'layer { name: "r2" type: "Reverse" bottom: "bw0" top: "bw" reverse_param { axis: 0 } }',
        'layer { name: "cat" type: "Concat" bottom: "fw" bottom: "bw" top: "cat" concat_param { axis: 2 } }',
        'layer { name: "o" type: "Transpose" bottom: "cat" top: "o" transpose_param { dim: 1 dim: 2 dim: 0 } }',
    ]
    model = load_from_text(net(*layers, inputs={"x": (n, c, hh, ww)}), random_weights=True)
    g = rng(9)
    for node in model.layers:
        if node.type == "Lstm":
            node.blobs = [g.normal(0, 0.6, b.shape).astype(np.float32) for b in node.blobs]
    blobs = {node.name: node.blobs for node in model.layers if node.type == "Lstm"}
    x = g.standard_normal((n, c, hh, ww)).astype(np.float32)
    seq = transpose_ref(x, (3, 2, 0, 1)).reshape(ww, hh * n, c)
    fw = lstm_ref(seq, *blobs["fw"])
    bw = reverse_ref(lstm_ref(reverse_ref(seq, 0), *blobs["bw"]).astype(np.float32), 0)
    want = np.transpose(np.concatenate([fw, bw], axis=2), (1, 2, 0))
    for backend, v in backend_outputs(model, {"x": x}, tmp_path).items():
        assert_close(v, want, 1e-5, 1e-5, f"CTPN block {backend}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sequence_layers_on_cuda_match_cpu():
    t, n, h = 4, 3, 5
    layers = ['layer { name: "tr" type: "Transpose" bottom: "x" top: "tr" transpose_param { dim: 0 dim: 2 dim: 1 } }',
              'layer { name: "rv" type: "Reverse" bottom: "tr" top: "rv" reverse_param { axis: 0 } }',
              f'layer {{ name: "o" type: "Lstm" bottom: "rv" top: "o" lstm_param {{ num_output: {h} }} }}']
    model = load_from_text(net(*layers, inputs={"x": (t, 2, n)}), random_weights=True)
    feeds = {"x": rng(10).standard_normal((t, 2, n)).astype(np.float32)}
    cpu = model.run(feeds, all_blobs=True)
    gpu = model.run(feeds, all_blobs=True, device="cuda")
    for k, v in cpu.items():
        assert_close(gpu[k], v, 1e-5, 1e-5, f"cuda {k}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_batch_size
@pytest.mark.xfail(strict=True, reason="a layer without bottoms gets no device from the torch backend: the "
                                       "indicator stays on the CPU while the LSTM runs on CUDA")
def test_continuation_indicator_feeds_an_lstm_on_cuda():
    t, n, h = 4, 3, 5
    text = net(INDICATOR % (t, n), f'layer {{ name: "o" type: "LSTM" bottom: "x" bottom: "indicator" top: "o" '
                                   f'recurrent_param {{ num_output: {h} }} }}', inputs={"x": (t, n, 2)})
    model = load_from_text(text, random_weights=True)
    feeds = {"x": rng(11).standard_normal((t, n, 2)).astype(np.float32)}
    assert_close(model.run(feeds, device="cuda")["o"], model.run(feeds)["o"], 1e-5, 1e-5, "cuda LSTM")


def lisa_lstm_ref(x, flush, w_xc, b_c, w_hc, streams):
    """lisa-caffe-public's LSTM, from lstm_layer.cpp's unrolled net and lstm_unit_layer.cpp, in float64: x and
    flush frame-major (row t * streams + s), h and c start at 0; h' = flush h, gates = W_xc x + b + W_hc h',
    i, f, o = sigmoid, g = tanh (its 2 sigmoid(2 v) - 1), f = 0 where flush is 0."""
    def sig(v):
        return 1.0 / (1.0 + np.exp(-v))
    rows, hd = x.shape[0], w_hc.shape[1]
    xs, fl = x.reshape(rows, -1).astype(np.float64), flush.reshape(rows).astype(np.float64)
    h, c = np.zeros((streams, hd)), np.zeros((streams, hd))
    out = np.zeros((rows, hd))
    for t in range(rows // streams):
        for s in range(streams):
            r = t * streams + s
            hp = fl[r] * h[s]
            gates = w_xc.astype(np.float64) @ xs[r] + b_c + w_hc.astype(np.float64) @ hp
            i, f, o = sig(gates[:hd]), fl[r] * sig(gates[hd:2 * hd]), sig(gates[2 * hd:3 * hd])
            g = 2 * sig(2 * gates[3 * hd:]) - 1
            c[s] = f * c[s] + i * g
            h[s] = o * (2 * sig(2 * c[s]) - 1)
            out[r] = h[s]
    return out.reshape(rows, hd, 1, 1).astype(np.float32)


def test_lisa_caffe_lstm_runs_frame_major_clips(tmp_path):
    # olivernina/lisa-caffe-public's LRCN (V1 `type: LSTM`, lstm_param { hidden_dim buffer_size }): 3 time steps
    # of 2 streams, a new clip starting at step 1 in stream 0
    text = ('layers { name: "x" type: DUMMY_DATA top: "x" top: "flush" dummy_data_param { '
            'shape { dim: 6 dim: 3 dim: 2 dim: 1 } shape { dim: 6 dim: 1 dim: 1 dim: 1 } } }\n'
            'layers { name: "lstm1" type: LSTM bottom: "x" bottom: "flush" top: "h" '
            'lstm_param { hidden_dim: 4 buffer_size: 2 } }')
    model = load_from_text(text, input_shapes={"x": (6, 3, 2, 1), "flush": (6, 1, 1, 1)}, random_weights=True)
    assert model.blob_shapes["h"] == (6, 4, 1, 1)
    assert [b.shape for b in model.graph.node("lstm1").blobs] == [(16, 6), (16,), (16, 4)]
    r = rng(8)
    w_xc, b_c, w_hc = (r.standard_normal(s).astype(np.float32) * 0.5 for s in [(16, 6), (16,), (16, 4)])
    model.graph.node("lstm1").blobs = [w_xc, b_c, w_hc]
    model.clear_cache()
    x = r.standard_normal((6, 3, 2, 1)).astype(np.float32)
    flush = np.array([0, 0, 0, 1, 1, 1], np.float32).reshape(6, 1, 1, 1)
    ref = lisa_lstm_ref(x, flush, w_xc, b_c, w_hc, 2)
    check_everywhere(model, {"x": x, "flush": flush}, {"h": ref}, tmp_path, atol=1e-5, rtol=1e-5)


INDEXED_IP = ('layers {{ name: "x" type: DUMMY_DATA top: "idx" dummy_data_param {{ shape {{ dim: 5 dim: 1 dim: 1 dim: 1 }} }} }}\n'
              'layers {{ name: "embed" type: INNER_PRODUCT bottom: "idx" top: "e" '
              'inner_product_param {{ index_input_dim: 7 num_output: 3 {extra}}} }}')


def test_lisa_caffe_indexed_inner_product_is_an_embedding(tmp_path):
    # lisa-caffe-public's InnerProduct with index_input_dim: one index per row, top row = weight row + bias
    model = load_from_text(INDEXED_IP.format(extra=""), input_shapes={"idx": (5, 1, 1, 1)}, random_weights=True)
    assert model.blob_shapes["e"] == (5, 3)
    assert [b.shape for b in model.graph.node("embed").blobs] == [(7, 3), (3,)]
    r = rng(3)
    w, b = r.standard_normal((7, 3)).astype(np.float32), r.standard_normal(3).astype(np.float32)
    model.graph.node("embed").blobs = [w, b]
    model.clear_cache()
    idx = np.array([0, 6, 2.7, 3, 1], np.float32).reshape(5, 1, 1, 1)   # 2.7 truncates to 2
    check_everywhere(model, {"idx": idx}, {"e": w[[0, 6, 2, 3, 1]] + b}, tmp_path)
    with pytest.raises(CaffeqError, match=r"index 7 is outside \[0, 7\) \(index_input_dim\)"):
        model.run({"idx": np.array([0, 7, 1, 1, 1], np.float32).reshape(5, 1, 1, 1)})
    no_bias = load_from_text(INDEXED_IP.format(extra="bias_term: false "), input_shapes={"idx": (5, 1, 1, 1)},
                             random_weights=True)
    no_bias.graph.node("embed").blobs = [w]
    no_bias.clear_cache()
    check_everywhere(no_bias, {"idx": idx}, {"e": w[[0, 6, 2, 3, 1]]}, tmp_path)
    with pytest.raises(LayerError, match="one index per row"):
        load_from_text(INDEXED_IP.format(extra=""), input_shapes={"idx": (5, 2, 1, 1)})


def test_lisa_caffe_indexed_weights_of_either_commit(tmp_path):
    # LRCN_model (8d19f1d) stores (index_input_dim, num_output), LRCN_video_deploy (c04d2a0) the transpose
    from caffeq.io.schema import caffe_pb2

    r = rng(4)
    w, b = r.standard_normal((7, 3)).astype(np.float32), r.standard_normal(3).astype(np.float32)
    idx = np.array([5, 0, 2, 2, 6], np.float32).reshape(5, 1, 1, 1)
    prototxt = tmp_path / "ip.prototxt"
    prototxt.write_text(INDEXED_IP.format(extra=""))
    for stored in (w, w.T):
        net = caffe_pb2.NetParameter()
        layer = net.layers.add(name="embed", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT)
        for blob in (stored, b):
            proto = layer.blobs.add()
            proto.num, proto.channels = 1, 1
            proto.height, proto.width = (1, blob.shape[0]) if blob.ndim == 1 else blob.shape
            proto.data.extend(blob.ravel().tolist())
        weights = tmp_path / "ip.caffemodel"
        weights.write_bytes(net.SerializeToString())
        model = load(str(prototxt), weights=str(weights), input_shapes={"idx": (5, 1, 1, 1)})
        np.testing.assert_array_equal(model.run({"idx": idx})["e"], w[[5, 0, 2, 2, 6]] + b)
        assert any("LRCN_video_deploy" in n for n in model.warnings) == (stored is not w)


def test_lisa_caffe_v1_reduction_sums_the_whole_blob():
    text = ('layers { name: "x" type: DUMMY_DATA top: "x" dummy_data_param { shape { dim: 2 dim: 3 } } }\n'
            'layers { name: "r" type: REDUCTION bottom: "x" top: "r" reduction_param { operation: ASUM coeff: 2 } }')
    model = load_from_text(text, input_shapes={"x": (2, 3)})
    x = np.array([[1, -2, 3], [-4, 5, 0.5]], np.float32)
    np.testing.assert_allclose(model.run({"x": x})["r"], 2 * 15.5)


def test_lisa_caffe_lstm_reads_the_older_commits_gate_blobs(tmp_path):
    # LRCN_video_deploy (c04d2a0) stores 12 blobs, W_x and b per gate in the order i, f, c, o, then W_h per gate;
    # they are the fused LSTM's rows (i, f, o, g) cut apart
    from caffeq.io.schema import caffe_pb2

    text = ('layers { name: "x" type: DUMMY_DATA top: "x" top: "flush" dummy_data_param { '
            'shape { dim: 6 dim: 3 dim: 2 dim: 1 } shape { dim: 6 dim: 1 dim: 1 dim: 1 } } }\n'
            'layers { name: "lstm1" type: LSTM bottom: "x" bottom: "flush" top: "h" '
            'lstm_param { hidden_dim: 4 buffer_size: 2 } }')
    r = rng(9)
    w_xc, b_c, w_hc = (r.standard_normal(s).astype(np.float32) * 0.5 for s in [(16, 6), (16,), (16, 4)])
    gates = {name: slice(4 * i, 4 * i + 4) for i, name in enumerate("ifog")}
    blobs = []
    for g in "ifgo":   # the stored order: i, f, c (= g), o
        blobs += [w_xc[gates[g]], b_c[gates[g]]]
    blobs += [w_hc[gates[g]] for g in "ifgo"]
    netp = caffe_pb2.NetParameter()
    layer = netp.layers.add(name="lstm1", type=caffe_pb2.V1LayerParameter.LSTM)
    for b in blobs:
        proto = layer.blobs.add()
        proto.num, proto.channels, proto.height = 1, 1, 1 if b.ndim == 1 else b.shape[0]
        proto.width = b.shape[-1]
        proto.data.extend(b.ravel().tolist())
    (tmp_path / "lstm.prototxt").write_text(text)
    (tmp_path / "lstm.caffemodel").write_bytes(netp.SerializeToString())
    shapes = {"x": (6, 3, 2, 1), "flush": (6, 1, 1, 1)}
    model = load(str(tmp_path / "lstm.prototxt"), weights=str(tmp_path / "lstm.caffemodel"), input_shapes=shapes)
    assert any("LRCN_video_deploy" in w for w in model.warnings)
    x = r.standard_normal((6, 3, 2, 1)).astype(np.float32)
    flush = np.array([0, 0, 1, 1, 1, 0], np.float32).reshape(6, 1, 1, 1)
    np.testing.assert_allclose(model.run({"x": x, "flush": flush})["h"], lisa_lstm_ref(x, flush, w_xc, b_c, w_hc, 2),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(LayerError, match="diagonal_cell_gates"):
        load_from_text(text.replace("buffer_size: 2", "buffer_size: 2 diagonal_cell_gates: true"), input_shapes=shapes)
    # 12 blobs that are not the gates' sizes: one clear line, not a reshape traceback
    del layer.blobs[1].data[-1]
    layer.blobs[1].width -= 1
    (tmp_path / "lstm.caffemodel").write_bytes(netp.SerializeToString())
    with pytest.raises(CaffeqError, match="the weights file has 12 blob"):
        load(str(tmp_path / "lstm.prototxt"), weights=str(tmp_path / "lstm.caffemodel"), input_shapes=shapes)


def test_lisa_caffe_lstm_checks_the_streams_and_markers():
    text = ('layer { name: "x" type: "Input" top: "x" top: "flush" input_param { shape { dim: 5 dim: 3 } '
            'shape { dim: 5 dim: 1 } } }\n'
            'layer { name: "lstm1" type: "LSTM" bottom: "x" bottom: "flush" top: "h" '
            'lstm_param { hidden_dim: 4 buffer_size: 2 } }')
    with pytest.raises(LayerError, match="not a whole number of time steps of lstm_param.buffer_size 2"):
        load_from_text(text)


def test_textspotters_lstmnew_is_bvlcs_lstm():
    t, n, k, h = 4, 2, 3, 5
    text = ('layer {{ name: "pred_lstm" type: "{kind}" bottom: "x" bottom: "cont" top: "o" '
            'recurrent_param {{ num_output: 5 weight_filler {{ type: "xavier" }} }} }}')
    shapes = {"x": (t, n, k), "cont": (t, n)}
    new = load_from_text(net(text.format(kind="LSTMNew"), inputs=shapes), random_weights=True)
    old = load_from_text(net(text.format(kind="LSTM"), inputs=shapes), random_weights=True)
    blobs = next(node for node in new.layers if node.name == "pred_lstm").blobs
    assert [tuple(b.shape) for b in blobs] == [(4 * h, k), (4 * h,), (4 * h, h)]
    next(node for node in old.layers if node.name == "pred_lstm").blobs = blobs
    feeds = {"x": rng(30).standard_normal((t, n, k)).astype(np.float32),
             "cont": np.array([[0, 0], [1, 1], [1, 0], [1, 1]], np.float32)}
    np.testing.assert_array_equal(new.run(feeds)["o"], old.run(feeds)["o"])
