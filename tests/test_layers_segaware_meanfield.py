"""aharley/segaware's NormConvMeanfield (caffeq/layers/segaware_meanfield.py) against loops written here from
norm_conv_meanfield_iteration.cpp, norm_conv_layer.cpp and util/im2dist.cpp, and the worked example of the
fork's arithmetic; torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import assert_close, check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

FAR = float(np.float32(np.finfo(np.float32).max) / np.float32(100))


def norm_conv_ref(p, f, k, pad, d, scale, rc, rb):
    """Per pixel: the taps' distances (0 off-centre-map, FAR at the centre with rc and off the map with rb),
    softmax of -scale x them, then the weighted sum of P's zero-padded taps; float64."""
    n, c, h, w = p.shape
    out = np.zeros_like(p, np.float64)
    for b in range(n):
        for y in range(h):
            for x in range(w):
                cy, cx = y - pad + (k // 2) * d, x - pad + (k // 2) * d
                dist, vals = [], []
                for i in range(k):
                    for j in range(k):
                        qy, qx = y - pad + i * d, x - pad + j * d
                        inside = 0 <= qy < h and 0 <= qx < w
                        if not (0 <= cy < h and 0 <= cx < w):
                            dd = 0.0
                        elif rc and (qy, qx) == (cy, cx):
                            dd = FAR
                        elif inside:
                            dd = float(np.sum(0.5 * (f[b, :, cy, cx].astype(np.float64) - f[b, :, qy, qx]) ** 2))
                        elif rb:
                            dd = FAR
                        else:
                            dd = 0.0
                        dist.append(dd)
                        vals.append(p[b, :, qy, qx] if inside else np.zeros(c))
                a = -scale * np.array(dist)
                e = np.exp(a - a.max())
                wts = e / e.sum()
                out[b, :, y, x] = sum(wt * v for wt, v in zip(wts, vals))
    return out


def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def meanfield_ref(u, q, fb, fs, ws, wb, m, iterations, bil, spa):
    q = q.astype(np.float64)
    for _ in range(iterations):
        p = softmax(q)
        s = norm_conv_ref(p, fs, *spa)
        b = norm_conv_ref(p, fb, *bil)
        msg = np.einsum("ij,njhw->nihw", ws, s) + np.einsum("ij,njhw->nihw", wb, b)
        q = u - np.einsum("ij,njhw->nihw", m, msg)
    return q


def layer(params):
    return (f'layer {{ name: "crf" type: "NormConvMeanfield" bottom: "u" bottom: "q" bottom: "fb" bottom: "fs" '
            f'top: "out" norm_conv_meanfield_param {{ {params} }} }}')


def test_the_worked_example_of_the_forks_arithmetic():
    # spec: C 2, 1 x 3 map, both filters k 3 p 1 d 1 scale 1, default matrices, two iterations
    u = np.array([[[[1, 0, 2]], [[0, 1, 0]]]], np.float32)
    fs = np.array([[[[0, 1, 2]], [[0, 0, 0]]]], np.float32)
    fb = np.array([[[[0, 0, 3]]]], np.float32)
    text = net(layer("num_iterations: 2 kernel_size: 3 kernel_size: 3 pad: 1 pad: 1 dilation: 1 dilation: 1 "
                     "scale: 1 scale: 1"), inputs={"u": u.shape, "q": u.shape, "fb": fb.shape, "fs": fs.shape})
    model = load_from_text(text, random_weights=True)
    got = model.run({"u": u, "q": u, "fb": fb, "fs": fs})["out"]
    want = [[2.03861, 1.15374, 3.03861], [0.96139, 1.84626, 0.96139]]
    np.testing.assert_allclose(got[0, :, 0], want, atol=2e-5)


@pytest.mark.parametrize("params, bil, spa", [
    ("num_iterations: 2 kernel_size: 3 kernel_size: 5 pad: 2 pad: 2 dilation: 2 dilation: 1 scale: 0.7 scale: 1.5",
     (3, 2, 2, 0.7, True, True), (5, 2, 1, 1.5, True, True)),
    ("num_iterations: 3 kernel_size: 3 kernel_size: 3 pad: 1 pad: 1 dilation: 1 dilation: 1 scale: 2 scale: 0.5 "
     "remove_center: false remove_center: true remove_bounds: true remove_bounds: false",
     (3, 1, 1, 2.0, False, True), (3, 1, 1, 0.5, True, False)),
    # the fork's defaults: dilation 0 (every tap the centre) and scale 0 (equal weights)
    ("num_iterations: 2 kernel_size: 3 kernel_size: 1", (3, 0, 0, 0.0, True, True), (1, 0, 0, 0.0, True, True)),
])
def test_norm_conv_meanfield_matches_the_forks_loops(params, bil, spa, tmp_path):
    r = rng(4)
    u = r.standard_normal((2, 3, 5, 6)).astype(np.float32)
    q = r.standard_normal((2, 3, 5, 6)).astype(np.float32)
    fb = r.standard_normal((2, 4, 5, 6)).astype(np.float32)
    fs = r.standard_normal((2, 2, 5, 6)).astype(np.float32)
    model = load_from_text(net(layer(params), inputs={"u": u.shape, "q": q.shape, "fb": fb.shape, "fs": fs.shape}),
                           random_weights=True)
    blobs = [np.asarray(b) for b in node_of(model, "crf").blobs]
    np.testing.assert_array_equal(blobs[2].reshape(3, 3), -np.eye(3))      # Potts, the fork's default
    mats = [r.standard_normal((1, 1, 3, 3)).astype(np.float32) * 0.5 for _ in range(3)]
    node_of(model, "crf").blobs = mats
    iterations = int(params.split()[1])
    ref = meanfield_ref(u, q, fb, fs, *(m.reshape(3, 3).astype(np.float64) for m in mats), iterations, bil, spa)
    check_everywhere(model, {"u": u, "q": q, "fb": fb, "fs": fs}, {"out": ref}, tmp_path, atol=2e-5, rtol=2e-5)
    assert_close(model.run({"u": u, "q": q, "fb": fb, "fs": fs})["out"], ref, 2e-5, 2e-5, "torch")


@pytest.mark.parametrize("params, message", [
    ("kernel_size: 3 kernel_size: 3", "num_iterations is required"),
    ("num_iterations: 1 kernel_size: 3 kernel_size: 3", "at least 2"),
    ("num_iterations: 2 kernel_size: 3", "kernel_size needs two values"),
    ("num_iterations: 2 kernel_size: 3 kernel_size: 3 pad: 1 pad: 0 dilation: 1 dilation: 1", "the spatial filter"),
])
def test_norm_conv_meanfield_refuses_what_the_fork_cannot_run(params, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(layer(params), inputs={"u": (1, 2, 4, 4), "q": (1, 2, 4, 4), "fb": (1, 3, 4, 4),
                                                  "fs": (1, 2, 4, 4)}))
