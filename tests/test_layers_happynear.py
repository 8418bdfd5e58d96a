"""happynear/caffe-windows (967eedf) layers: Normalize with normalize_param, InnerProduct normalize,
Flip, ChannelScale, InnerDistance.

References are numpy loops written here from the fork's CPU code (normalize_layer.cpp,
inner_product_layer.cpp, flip_layer.cpp, channel_scale_layer.cpp, inner_distance_layer.cpp),
in float64; each layer runs in torch, onnxruntime and the generated model.py.
"""
import numpy as np
import pytest
from conftest import assert_close, model_py_outputs, net, node_of, onnx_outputs, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

EPS = 1e-6   # the fork's CPU eps


def all_backends(model, feeds, tmp_path, tops):
    """{backend: {top: array}} from torch, onnxruntime and model.py."""
    torch_out = model.run(feeds)
    onnx_out = onnx_outputs(model, feeds, tmp_path)
    py_out = model_py_outputs(model, feeds, tmp_path)
    return {name: {t: out[t] for t in tops} for name, out in
            (("torch", torch_out), ("onnx", onnx_out), ("model.py", py_out))}


def check_backends(model, feeds, tmp_path, refs, atol=1e-5, rtol=1e-5):
    for backend, got in all_backends(model, feeds, tmp_path, list(refs)).items():
        for top, ref in refs.items():
            assert got[top].shape == ref.shape, (backend, top, got[top].shape, ref.shape)
            assert_close(got[top], ref, atol, rtol, f"{backend} {top}")


# ---- Normalize (normalize_param) ----------------------------------------------------------

def normalize_ref(x, l1):
    """normalize_layer.cpp Forward_cpu: per (n, h, w) over channels; tops are 4-axis."""
    x4 = x.astype(np.float64).reshape(x.shape + (1,) * (4 - x.ndim))
    n, c, h, w = x4.shape
    y, norm = np.zeros_like(x4), np.zeros((n, 1, h, w))
    for i in range(n):
        for a in range(h):
            for b in range(w):
                s = sum(abs(x4[i, k, a, b]) if l1 else x4[i, k, a, b] ** 2 for k in range(c)) + EPS
                norm[i, 0, a, b] = s if l1 else np.sqrt(s)
                y[i, :, a, b] = x4[i, :, a, b] / norm[i, 0, a, b]
    return y, norm


@pytest.mark.parametrize("kind", ["L2", "L1"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7)])
def test_happynear_normalize(kind, shape, tmp_path):
    x = rng(1).standard_normal(shape).astype(np.float32)
    text = net(f'layer {{ name: "n" type: "Normalize" bottom: "x" top: "o" top: "norm" '
               f'normalize_param {{ normalize_type: "{kind}" }} }}', inputs={"x": shape})
    model = load_from_text(text)
    assert next(n for n in model.layers if n.name == "n").expected_param_shapes is None   # no blobs
    y, norm = normalize_ref(x, kind == "L1")
    assert model.blob_shapes["o"] == y.shape and model.blob_shapes["norm"] == norm.shape
    check_backends(model, {"x": x}, tmp_path, {"o": y, "norm": norm})


def test_happynear_normalize_one_top_and_bad_type(tmp_path):
    x = rng(2).standard_normal((2, 5, 3, 1)).astype(np.float32)
    model = load_from_text(net('layer { name: "n" type: "Normalize" bottom: "x" top: "o" normalize_param {} }',
                               inputs={"x": x.shape}))
    check_backends(model, {"x": x}, tmp_path, {"o": normalize_ref(x, False)[0]})
    with pytest.raises(LayerError, match="normalize_type"):
        load_from_text(net('layer { name: "n" type: "Normalize" bottom: "x" top: "o" '
                           'normalize_param { normalize_type: "L3" } }', inputs={"x": (1, 2, 3, 4)}))


def test_normalize_fork_is_picked_by_message_or_by_the_net():
    ip = 'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "f" inner_product_param { num_output: 4 %s } }'
    bare = 'layer { name: "n" type: "Normalize" bottom: "f" top: "o" }'
    # the net uses happynear's InnerProduct normalize: the bare Normalize is happynear's (no blobs)
    model = load_from_text(net(ip % "normalize: true", bare, inputs={"x": (2, 3)}), random_weights=True)
    assert next(n for n in model.layers if n.name == "n").expected_param_shapes is None
    assert model.blob_shapes["o"] == (2, 4, 1, 1)
    assert any("read as happynear's Normalize" in w for w in model.warnings)
    # nothing tells: SSD's reading (one scale blob), said in a warning
    model = load_from_text(net(ip % "", bare, inputs={"x": (2, 3)}), random_weights=True)
    assert next(n for n in model.layers if n.name == "n").expected_param_shapes == [()]
    assert any("read as SSD's Normalize" in w for w in model.warnings)
    # a second top exists only in happynear's
    model = load_from_text(net('layer { name: "n" type: "Normalize" bottom: "x" top: "o" top: "m" }',
                               inputs={"x": (2, 3, 2, 2)}))
    assert model.blob_shapes["m"] == (2, 1, 2, 2)
    with pytest.raises(LayerError, match="both norm_param"):
        load_from_text(net('layer { name: "n" type: "Normalize" bottom: "x" top: "o" norm_param {} '
                           'normalize_param {} }', inputs={"x": (2, 3, 2, 2)}))


# ---- InnerProduct normalize ---------------------------------------------------------------

@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_inner_product_normalize(transpose, bias, tmp_path):
    x = rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    text = net(f'layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "o" inner_product_param {{ '
               f'num_output: 7 normalize: true transpose: {str(transpose).lower()} '
               f'bias_term: {str(bias).lower()} }} }}', inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "ip")
    w = rng(4).standard_normal(node.expected_param_shapes[0]).astype(np.float32) * 3
    node.blobs[0] = w
    b = None
    if bias:
        b = rng(5).standard_normal(7).astype(np.float32)
        node.blobs[1] = b
    rows = w.astype(np.float64).reshape(7, -1)
    unit = (rows / np.sqrt((rows ** 2).sum(axis=1, keepdims=True) + EPS)).reshape(w.shape)
    mat = unit if transpose else unit.T                     # K x N for the product
    ref = x.astype(np.float64).reshape(2, -1) @ mat
    if bias:
        ref = ref + b
    check_backends(model, {"x": x}, tmp_path, {"o": ref})


# ---- Flip -----------------------------------------------------------------------------------

def flip_ref(x, height, width):
    """flip_layer.cpp: top[n, c, h, w] = bottom[n, c, H-1-h if flip_height, W-1-w if flip_width]."""
    hh, ww = x.shape[2:]
    y = np.empty_like(x)
    for h in range(hh):
        for w in range(ww):
            y[:, :, h, w] = x[:, :, hh - 1 - h if height else h, ww - 1 - w if width else w]
    return y


@pytest.mark.parametrize("params, height, width", [("", False, True), ("flip_param { flip_height: true }", True, True),
                                                   ("flip_param { flip_width: false flip_height: true }", True, False)])
def test_flip(params, height, width, tmp_path):
    x = rng(6).standard_normal((2, 3, 4, 5)).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "f" type: "Flip" bottom: "x" top: "o" {params} }}',
                               inputs={"x": x.shape}))
    check_backends(model, {"x": x}, tmp_path, {"o": flip_ref(x, height, width)}, 0, 0)


# ---- ChannelScale ---------------------------------------------------------------------------

def test_channel_scale(tmp_path):
    x = rng(7).standard_normal((2, 3, 4, 5)).astype(np.float32)
    s = rng(8).standard_normal((2, 4, 5)).astype(np.float32)
    model = load_from_text(net('layer { name: "c" type: "ChannelScale" bottom: "x" bottom: "s" top: "o" }',
                               inputs={"x": x.shape, "s": s.shape}))
    ref = np.empty(x.shape, np.float64)
    for n in range(2):
        for h in range(4):
            for w in range(5):
                ref[n, :, h, w] = x[n, :, h, w].astype(np.float64) * s.reshape(2, -1)[n, h * 5 + w]
    check_backends(model, {"x": x, "s": s}, tmp_path, {"o": ref})
    with pytest.raises(LayerError, match="count 40"):
        load_from_text(net('layer { name: "c" type: "ChannelScale" bottom: "x" bottom: "s" top: "o" }',
                           inputs={"x": x.shape, "s": (2, 3, 4, 5)}))


@pytest.mark.parametrize("value, clamped", [(7.5, 5.0), (-1.0, 0.5), (2.0, 2.0)])
def test_channel_scale_global(value, clamped, tmp_path):
    x = rng(9).standard_normal((3, 2, 4, 5)).astype(np.float32)
    s = np.ones((3, 1, 4, 5), np.float32)
    model = load_from_text(net('layer { name: "c" type: "ChannelScale" bottom: "x" bottom: "s" top: "o" top: "g" '
                               'channel_scale_param { global_scale: true max_global_scale: 5 min_global_scale: 0.5 } }',
                               inputs={"x": x.shape, "s": s.shape}), random_weights=True)
    node = next(n for n in model.layers if n.name == "c")
    np.testing.assert_array_equal(node.blobs[0], [-1.0])   # the fork's initial value
    node.blobs[0] = np.array([value], np.float32)
    check_backends(model, {"x": x, "s": s}, tmp_path,
                   {"o": x.astype(np.float64) * clamped, "g": np.array([clamped])})


# ---- InnerDistance --------------------------------------------------------------------------

def distance_ref(x, w, rows, axis, l1, normalize):
    """inner_distance_layer.cpp Forward_cpu: weight memory as rows (unit rows with normalize)."""
    wr = w.astype(np.float64).reshape(rows, -1).copy()
    if normalize:
        for r in range(rows):
            wr[r] /= np.sqrt((wr[r] ** 2).sum() + EPS)
    flat = x.astype(np.float64).reshape(int(np.prod(x.shape[:axis])), -1)
    out = np.zeros((flat.shape[0], rows))
    for m in range(flat.shape[0]):
        for n in range(rows):
            d = flat[m] - wr[n]
            out[m, n] = np.abs(d).sum() if l1 else (d * d).sum()
    return out.reshape(x.shape[:axis] + (rows,))


@pytest.mark.parametrize("l1", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_inner_distance_with_a_blob(l1, normalize, tmp_path):
    x = rng(10).standard_normal((2, 3, 4, 5)).astype(np.float32)
    kind = "L1" if l1 else "L2"
    model = load_from_text(net(f'layer {{ name: "d" type: "InnerDistance" bottom: "x" top: "o" inner_distance_param {{ '
                               f'num_output: 6 distance_type: "{kind}" normalize: {str(normalize).lower()} }} }}',
                               inputs={"x": x.shape}), random_weights=True)
    node = next(n for n in model.layers if n.name == "d")
    assert node.expected_param_shapes == [(6, 60)]   # no bias blob, bias_term or not
    w = rng(11).standard_normal((6, 60)).astype(np.float32)
    node.blobs[0] = w
    check_backends(model, {"x": x}, tmp_path, {"o": distance_ref(x, w, 6, 1, l1, normalize)}, 1e-4, 1e-5)


def test_inner_distance_weight_from_a_bottom_on_axis_2(tmp_path):
    x = rng(12).standard_normal((2, 3, 4, 5)).astype(np.float32)
    w = rng(13).standard_normal((7, 20, 1, 1)).astype(np.float32)
    model = load_from_text(net('layer { name: "d" type: "InnerDistance" bottom: "x" bottom: "w" top: "o" '
                               'inner_distance_param { axis: 2 } }', inputs={"x": x.shape, "w": w.shape}))
    assert model.blob_shapes["o"] == (2, 3, 7)
    check_backends(model, {"x": x, "w": w}, tmp_path, {"o": distance_ref(x, w, 7, 2, False, False)}, 1e-4, 1e-5)
    with pytest.raises(LayerError, match="7 rows of 20"):
        load_from_text(net('layer { name: "d" type: "InnerDistance" bottom: "x" bottom: "w" top: "o" '
                           'inner_distance_param { axis: 2 } }', inputs={"x": x.shape, "w": (7, 21)}))


def gram_ref(x):
    """gram_layer.cpp: per item, gemm(X, X^T) with alpha = (1 / (float) H W) / (float) C, X = (C, H W)."""
    n, c = x.shape[0], x.shape[1]
    x4 = x.reshape(n, c, -1).astype(np.float64)
    alpha = np.float32(np.float32(1.0) / np.float32(x4.shape[2])) / np.float32(c)
    out = np.zeros((n, c, c, 1), np.float64)
    for i in range(n):
        for a in range(c):
            for b in range(c):
                out[i, a, b, 0] = alpha * sum(x4[i, a, k] * x4[i, b, k] for k in range(x4.shape[2]))
    return out.astype(np.float32)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 4, 3)])
def test_happynear_gram_matrix_of_each_item(shape, tmp_path):
    # DeepVisualization NeuralArt's style nets: Gram of conv features, (N, C, C, 1)
    model = load_from_text(net('layer { name: "g" type: "Gram" bottom: "x" top: "y" }', inputs={"x": shape}))
    x = rng(5).standard_normal(shape).astype(np.float32)
    assert model.blob_shapes["y"] == (shape[0], shape[1], shape[1], 1)
    check_backends(model, {"x": x}, tmp_path, {"y": gram_ref(x)})


@pytest.mark.parametrize("bounds, bias", [("min_value: 0.5", False), ("max_value: 0.25", True),
                                          ("min_value: -0.5 max_value: 0.75", False)])
def test_scale_clamps_its_blob_to_min_and_max_value(bounds, bias, tmp_path):
    """scale_layer.cpp: each forward first clamps scale_data to [min_value, max_value] (NormFace's
    learned cosine scale keeps min_value 0.01); the bias is not clamped."""
    x = rng(11).standard_normal((2, 4, 3, 5)).astype(np.float32)
    text = (f'layer {{ name: "s" type: "Scale" bottom: "x" top: "y" scale_param {{ {bounds} '
            f'bias_term: {str(bias).lower()} }} }}')
    model = load_from_text(net(text, inputs={"x": x.shape}), random_weights=True)
    node = node_of(model, "s")
    r = rng(12)
    blobs = [r.uniform(-1, 1, (4,)).astype(np.float32)] + ([r.standard_normal(4).astype(np.float32)] if bias else [])
    node.blobs = blobs
    lo = float(bounds.split("min_value: ")[1].split()[0]) if "min_value" in bounds else -np.inf
    hi = float(bounds.split("max_value: ")[1].split()[0]) if "max_value" in bounds else np.inf
    s = np.minimum(np.maximum(blobs[0], np.float32(lo)), np.float32(hi))
    ref = x * s[None, :, None, None] + (blobs[1][None, :, None, None] if bias else 0)
    assert not np.allclose(s, blobs[0])     # the bounds bite
    check_backends(model, {"x": x}, tmp_path, {"y": ref})


def test_scale_clamps_a_second_bottom(tmp_path):
    r = rng(13)
    x, f = r.standard_normal((2, 3, 4)).astype(np.float32), r.uniform(-1, 1, (2, 3)).astype(np.float32)
    model = load_from_text(net('layer { name: "s" type: "Scale" bottom: "x" bottom: "f" top: "y" '
                               'scale_param { axis: 0 max_value: 0.1 } }', inputs={"x": x.shape, "f": f.shape}))
    check_backends(model, {"x": x, "f": f}, tmp_path, {"y": x * np.minimum(f, np.float32(0.1))[..., None]})
