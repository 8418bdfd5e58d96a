"""pulkitag/caffe's Topography: the reference is a loop written from the fork's imchannel2col (each pixel's
channels as an S x S grid, wrapped with its non-negative modulus, row a k + b of the columns) and the GEMM
with the 1 x k^2 kernel, in float64; compared in torch, onnxruntime and the generated model.py."""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, node_of, rng

from caffeq.layers import LayerError
from caffeq.layers.topography import gaussian_kernel
from caffeq.model import load, load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"


def modulus(a, b):
    """caffe_cpu_modulus: a non-negative remainder, also for a < 0."""
    return (a + b * (-a // b + 1)) % b if a < 0 else a % b


def topography_ref(x, kernel, group):
    n, c, h, w = x.shape
    side = int(round((c // group) ** 0.5))
    k = kernel.shape[-1]
    pad = (k - 1) // 2
    top = np.zeros(x.shape)
    for g in range(group):
        for r in range(side):
            for q in range(side):
                acc = np.zeros((n, h, w))
                for a in range(k):
                    for b in range(k):
                        src = g * side * side + modulus(r - pad + a, side) * side + modulus(q - pad + b, side)
                        acc += float(kernel[0, 0, a, b]) * x[:, src].astype(np.float64)
                top[:, g * side * side + r * side + q] = acc
    return top


def one_layer(shape, params, bottoms=1):
    inputs = "".join(f'input: "x{i}" input_shape {{ {" ".join(f"dim: {d}" for d in shape)} }}\n'
                     for i in range(bottoms))
    names = "".join(f' bottom: "x{i}"' for i in range(bottoms)) + "".join(f' top: "y{i}"' for i in range(bottoms))
    return load_from_text(f'{inputs}layer {{ name: "t" type: "Topography"{names} topography_param {{ {params} }} }}',
                          random_weights=True)


@pytest.mark.parametrize("shape, params", [
    ((2, 9, 3, 4), "kernel_size: 3 gaussian_sd: 0.75"),
    ((1, 8, 2, 5), "kernel_size: 3 group: 2 gaussian_sd: 1.5"),        # S = 2: the 3 x 3 kernel wraps twice
    ((2, 16, 2, 2), "kernel_size: 5 gaussian_sd: 0.5 stride: 1"),
])
def test_topography(shape, params, tmp_path):
    model = one_layer(shape, params)
    kernel = rng(41).standard_normal(node_of(model, "t").blobs[0].shape).astype(np.float32)
    node_of(model, "t").blobs = [kernel]
    model.clear_cache()
    x = rng(42).standard_normal(shape).astype(np.float32)
    group = 2 if "group: 2" in params else 1
    check_everywhere(model, {"x0": x}, {"y0": topography_ref(x, kernel, group)}, tmp_path, atol=1e-5)


def test_each_bottom_makes_its_own_top(tmp_path):
    model = one_layer((1, 4, 2, 3), "kernel_size: 3 gaussian_sd: 0.75", bottoms=2)
    kernel = node_of(model, "t").blobs[0]
    r = rng(43)
    x0, x1 = (r.standard_normal((1, 4, 2, 3)).astype(np.float32) for _ in range(2))
    check_everywhere(model, {"x0": x0, "x1": x1},
                     {"y0": topography_ref(x0, kernel, 1), "y1": topography_ref(x1, kernel, 1)}, tmp_path, atol=1e-5)


def test_the_kernel_starts_as_the_forks_gaussian():
    model = one_layer((1, 9, 1, 1), "kernel_size: 3 gaussian_sd: 0.75")
    np.testing.assert_allclose(node_of(model, "t").blobs[0].ravel(),
                               [0.05089992, 0.12381028, 0.05089992, 0.12381028, 0.30115926, 0.12381028,
                                0.05089992, 0.12381028, 0.05089992], rtol=1e-6)
    np.testing.assert_allclose(gaussian_kernel(3, 0.75).sum(), 1.0, rtol=1e-6)
    # the fork divides by 2 sd^2: a negative sd is the same kernel
    negative = one_layer((1, 9, 1, 1), "kernel_size: 3 gaussian_sd: -0.75")
    np.testing.assert_array_equal(node_of(negative, "t").blobs[0], node_of(model, "t").blobs[0])


def test_smooth_output_false_copies(tmp_path):
    model = one_layer((1, 4, 2, 2), "kernel_size: 3 gaussian_sd: 0.75 smooth_output: false")
    x = rng(44).standard_normal((1, 4, 2, 2)).astype(np.float32)
    check_everywhere(model, {"x0": x}, {"y0": x}, tmp_path)


@pytest.mark.parametrize("shape, params, message", [
    ((1, 8, 2, 2), "kernel_size: 3 gaussian_sd: 0.75", "perfect square"),
    ((1, 9, 2, 2), "kernel_size: 2 gaussian_sd: 0.75", "odd"),
    ((1, 9, 2, 2), "kernel_size: 3", "gaussian_sd must be set"),
])
def test_bad_settings(shape, params, message):
    with pytest.raises(LayerError, match=message):
        one_layer(shape, params)


@pytest.mark.skipif(not CORPUS.exists(), reason="the corpus files are not on this machine")
def test_cifar_topography_net_reads():
    model = load(CORPUS / "pulkitag__caffe__modelFiles__cifar__topography_all__cifar10_full.prototxt",
                 random_weights=True)
    assert model.blob_shapes["top3"] == (1, 64, 4, 4)
