"""The metric-learning forks' L2 normalizations: xiaolonw's Norm, xialuxi's NormL2, vzhangmeng726's L2Norm,
and the Normalization / NormalizationL2 layers of the face and re-id forks.

References are numpy loops written here from the forks' CPU code (caffe-video_triplet
norm_layer.cpp, arcface-caffe AdaCos/normL2_layer.cpp, caffe_video_face l2norm_layer.cpp); each layer runs in torch, onnxruntime and the
generated model.py.
"""
import numpy as np
import pytest
from conftest import assert_close, model_py_outputs, net, onnx_outputs, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def norm_ref(x):
    """norm_layer.cpp: at each (n, h, w), sum_c x^2 in float, then x / (sqrt(sum) + 1e-6)."""
    x4 = x.reshape(x.shape + (1,) * (4 - x.ndim))
    n, c, h, w = x4.shape
    y = np.zeros(x4.shape, np.float64)
    for i in range(n):
        for a in range(h):
            for b in range(w):
                total = np.float32(0)
                for k in range(c):
                    total = np.float32(total + np.float32(x4[i, k, a, b]) * np.float32(x4[i, k, a, b]))
                d = np.float32(np.sqrt(np.float64(total)) + 1e-6)
                y[i, :, a, b] = x4[i, :, a, b] / np.float64(d)
    return y


def norm_l2_ref(x):
    """normL2_layer.cpp: each item times float(1 / sqrt(sum of squares + 1e-7)), the root in double."""
    x4 = x.reshape(x.shape + (1,) * (4 - x.ndim))
    y = np.zeros(x4.shape, np.float64)
    for i in range(x4.shape[0]):
        total = float(np.sum(np.square(x4[i].astype(np.float32)), dtype=np.float32))
        y[i] = x4[i] * np.float64(np.float32(1.0 / np.sqrt(total + 1e-7)))
    return y


def l2norm_ref(x, eps=1e-8):
    """l2norm_layer.cpp: per item, the sum of squares (gemv), powx 0.5, then + eps; x divided by it."""
    x4 = x.reshape(x.shape + (1,) * (4 - x.ndim))
    y = np.zeros(x4.shape, np.float64)
    for i in range(x4.shape[0]):
        total = sum(float(v) * float(v) for v in x4[i].reshape(-1))
        y[i] = x4[i] / (np.sqrt(total) + eps)
    return y


@pytest.mark.parametrize("kind, ref", [("Norm", norm_ref), ("NormL2", norm_l2_ref), ("L2Norm", l2norm_ref)])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7)])
def test_l2_normalizations_match_the_forks(kind, ref, shape, tmp_path):
    x = rng(4).standard_normal(shape).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "n" type: "{kind}" bottom: "x" top: "o" }}', inputs={"x": shape}))
    want = ref(x)
    assert model.blob_shapes["o"] == want.shape                  # 4-axis, as the forks' Reshape
    for backend, out in (("torch", model.run({"x": x})), ("onnx", onnx_outputs(model, {"x": x}, tmp_path)),
                         ("model.py", model_py_outputs(model, {"x": x}, tmp_path))):
        assert_close(out["o"], want, 1e-6, 1e-5, f"{kind} {backend}")
    # per position (Norm) or per item (NormL2): the unit vectors the name promises
    got = model.run({"x": x})["o"].astype(np.float64)
    axes = (1,) if kind == "Norm" else (1, 2, 3)   # L2Norm, NormL2: per item
    np.testing.assert_allclose(np.sqrt((got ** 2).sum(axis=axes)), 1.0, rtol=1e-5)


def test_l2_normalizations_take_one_bottom():
    with pytest.raises(LayerError, match="Norm takes one bottom and one top"):
        load_from_text(net('layer { name: "n" type: "Norm" bottom: "x" bottom: "x" top: "o" }', inputs={"x": (2, 3)}))


def test_l2norm_reads_its_epsilon_and_refuses_in_place(tmp_path):
    x = (rng(5).standard_normal((2, 3, 2, 2)) * 1e-3).astype(np.float32)   # eps 0.01 shows at this scale
    model = load_from_text(net('layer { name: "n" type: "L2Norm" bottom: "x" top: "o" l2norm_param { eps: 0.01 } }',
                               inputs={"x": x.shape}))
    want = l2norm_ref(x, 0.01)
    for backend, out in (("torch", model.run({"x": x})), ("onnx", onnx_outputs(model, {"x": x}, tmp_path)),
                         ("model.py", model_py_outputs(model, {"x": x}, tmp_path))):
        assert_close(out["o"], want, 1e-6, 1e-5, f"L2Norm {backend}")
    with pytest.raises(LayerError, match="in-place"):
        load_from_text(net('layer { name: "n" type: "L2Norm" bottom: "x" top: "x" }', inputs={"x": (2, 3)}))


def normalization_ref(x, eps):
    """normalization_layer.cu / normalization_l2_layer.cu: per item, asum of the squares (+ eps), then
    each value times pow(that, -0.5); the top keeps the bottom's shape."""
    y = np.zeros(x.shape, np.float64)
    for i in range(x.shape[0]):
        total = sum(float(v) * float(v) for v in x[i].reshape(-1)) + eps
        y[i] = x[i] * total ** -0.5
    return y


@pytest.mark.parametrize("kind, eps", [("Normalization", 0.0), ("NormalizationL2", 1e-10)])
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 4, 5), (2, 3, 5)])
def test_normalization_forks_keep_the_bottoms_shape(kind, eps, shape, tmp_path):
    x = rng(6).standard_normal(shape).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "n" type: "{kind}" bottom: "x" top: "o" }}', inputs={"x": shape}))
    assert model.blob_shapes["o"] == shape                  # ReshapeLike, not 4-axis
    for backend, out in (("torch", model.run({"x": x})), ("onnx", onnx_outputs(model, {"x": x}, tmp_path)),
                         ("model.py", model_py_outputs(model, {"x": x}, tmp_path))):
        assert_close(out["o"], normalization_ref(x, eps), 1e-6, 1e-5, f"{kind} {backend}")



def test_normalization_reads_caffe_triplets_norm_field_and_computes_l2_whatever_it_says(tmp_path):
    # Gomdoree/caffe-triplet's facenet nets: normalization_param { norm: L2 }; the layer never reads it
    x = rng(7).standard_normal((3, 6)).astype(np.float32)
    for norm in ("L2", "L1"):
        model = load_from_text(net(f'layer {{ name: "n" type: "Normalization" bottom: "x" top: "o" '
                                   f'normalization_param {{ norm: {norm} }} }}', inputs={"x": x.shape}))
        assert_close(model.run({"x": x})["o"], normalization_ref(x, 0.0), 1e-6, 1e-5, norm)
        assert any("norm: L1 is not read" in w for w in model.warnings) == (norm == "L1")


def sklearn_normalize_ref(x):
    """norm2layer.py: sklearn's preprocessing.normalize(row, norm='l2') of each item, float32; a zero norm is 1."""
    out = np.zeros((x.shape[0], x.shape[1]), np.float32)
    for i in range(x.shape[0]):
        row = x[i].reshape(-1)
        norm = np.sqrt(np.float32(np.dot(row.astype(np.float64), row.astype(np.float64))))
        out[i] = row / (norm if norm != 0 else np.float32(1))
    return out


@pytest.mark.parametrize("shape", [(3, 5), (2, 4, 1, 1)])
def test_triplet_norm2_python_layer_normalizes_each_item_as_sklearn(shape, tmp_path):
    # JoeFannie/tripletloss deploy.prototxt: fc9 -> Python norm2layer.Norm2Layer -> (N, C)
    layer = ('layer { name: "norm2" type: "Python" bottom: "x" top: "y" '
             'python_param { module: "norm2layer" layer: "Norm2Layer" } }')
    model = load_from_text(net(layer, inputs={"x": shape}))
    x = rng(11).standard_normal(shape).astype(np.float32)
    x[1] = 0.0                                   # an all-zero item stays zeros
    ref = sklearn_normalize_ref(x)
    assert model.blob_shapes["y"] == shape[:2]
    assert_close(model.run({"x": x})["y"], ref, 0, 1e-6, "torch")
    assert_close(onnx_outputs(model, {"x": x}, tmp_path)["y"], ref, 0, 1e-6, "onnx")
    assert_close(model_py_outputs(model, {"x": x}, tmp_path)["y"], ref, 0, 1e-6, "model.py")


def test_triplet_norm2_refuses_a_map_it_cannot_assign():
    layer = ('layer { name: "norm2" type: "Python" bottom: "x" top: "y" '
             'python_param { module: "norm2layer" layer: "Norm2Layer" } }')
    with pytest.raises(LayerError, match="into an \\(N, C\\) top"):
        load_from_text(net(layer, inputs={"x": (2, 3, 2, 2)}))


@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 4, 5)])
def test_simple_normalize_scales_each_item_and_gives_a_4_axis_top(shape, tmp_path):
    """yuqj1991/caffe_train simplenormalize_layer.cpp: x * pow(asum(x^2), -0.5) per item, no epsilon;
    Reshape(num, channels, height, width)."""
    x = rng(8).standard_normal(shape).astype(np.float32)
    model = load_from_text(net('layer { name: "n" type: "SimpleNormalize" bottom: "x" top: "o" }', inputs={"x": shape}))
    four = tuple(shape) + (1,) * (4 - len(shape))
    assert model.blob_shapes["o"] == four
    ref = normalization_ref(x, 0.0).reshape(four)
    for backend, out in (("torch", model.run({"x": x})), ("onnx", onnx_outputs(model, {"x": x}, tmp_path)),
                         ("model.py", model_py_outputs(model, {"x": x}, tmp_path))):
        assert_close(out["o"], ref, 1e-6, 1e-5, f"SimpleNormalize {backend}")
