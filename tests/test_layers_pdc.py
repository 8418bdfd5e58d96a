"""ljn114514/PDC-ICCV2017's PointTransformer and LocalFullyConnected (caffeq/layers/pdc.py) against loops
written from point_transformer_layer.cpp and local_fully_connected_layer.cpp, in torch, onnxruntime and
model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def fork_points(points, theta, affine, inverse):
    """Forward_cpu, point by point: float products and sums, the 0.00001 and the division in double."""
    n, c = points.shape
    p = c // 2
    out = np.zeros_like(points)
    for b in range(n):
        t = theta[b]
        for k in range(p):
            x, y = points[b, k], points[b, k + p]
            if not affine and inverse:
                nx, ny = F32(x * t[2]) + t[3], F32(y * t[0]) + t[1]
            elif not affine:
                nx = F32(np.float64(F32(x - t[3])) / (np.float64(t[2]) + 0.00001))
                ny = F32(np.float64(F32(y - t[1])) / (np.float64(t[0]) + 0.00001))
            elif inverse:
                nx = F32(F32(y * t[3]) + F32(x * t[4])) + t[5]
                ny = F32(F32(y * t[0]) + F32(x * t[1])) + t[2]
            else:
                num = F32(F32(F32(x * t[0]) - F32(y * t[3])) - F32(t[0] * t[5])) + F32(t[2] * t[3])
                nx = F32(np.float64(num) / (np.float64(F32(F32(t[0] * t[4]) - F32(t[1] * t[3]))) + 0.00001))
                num = F32(F32(F32(x * t[1]) - F32(y * t[4])) - F32(t[1] * t[5])) + F32(t[2] * t[4])
                ny = F32(np.float64(num) / (np.float64(F32(F32(t[1] * t[3]) - F32(t[0] * t[4]))) + 0.00001))
            out[b, k], out[b, k + p] = nx, ny
    return out


@pytest.mark.parametrize("kind, inverse", [("CROP", True), ("CROP", False), ("AFFINE", True), ("AFFINE", False)])
def test_point_transformer(kind, inverse, tmp_path):
    r = rng(3)
    pts = r.uniform(-1, 1, (2, 10)).astype(F32)
    theta = r.uniform(0.5, 1.5, (2, 6)).astype(F32)
    theta[:, 1] *= 0.2                      # an affine map not too close to singular
    model = load_from_text(net(f'layer {{ name: "t" type: "PointTransformer" bottom: "p" bottom: "th" top: "o" '
                               f'pt_param {{ in_width: 224 in_height: 224 inv_trans: {str(inverse).lower()} '
                               f'transform_type: {kind} }} }}', inputs={"p": pts.shape, "th": theta.shape}))
    assert model.graph.tensors["o"].shape == (2, 10, 1, 1)
    ref = fork_points(pts, theta, kind == "AFFINE", inverse).reshape(2, 10, 1, 1)
    check_everywhere(model, {"p": pts, "th": theta}, {"o": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_point_transformer_needs_its_parameters():
    with pytest.raises(LayerError, match="AFFINE reads 6 parameters"):
        load_from_text(net('layer { name: "t" type: "PointTransformer" bottom: "p" bottom: "th" top: "o" '
                           'pt_param { in_width: 1 in_height: 1 transform_type: AFFINE } }',
                           inputs={"p": (2, 10), "th": (2, 4)}))


@pytest.mark.parametrize("bias", [True, False])
def test_local_fully_connected_has_one_inner_product_per_channel(bias, tmp_path):
    x = rng(4).standard_normal((2, 3, 2, 4)).astype(F32)
    model = load_from_text(net('layer { name: "l" type: "LocalFullyConnected" bottom: "x" top: "y" '
                               f'inner_product_param {{ num_output: 5 bias_term: {str(bias).lower()} }} }}',
                               inputs={"x": x.shape}), random_weights=True)
    blobs = [np.asarray(b) for b in node_of(model, "l").blobs]
    assert blobs[0].shape == (24, 5) and (not bias or blobs[1].shape == (15,))
    if bias:
        blobs[1] = rng(5).standard_normal(15).astype(F32)
        node_of(model, "l").blobs = blobs
    ref = np.zeros((2, 15))
    for m in range(2):
        for c in range(3):
            ref[m, c * 5:(c + 1) * 5] = x[m, c].reshape(-1).astype(np.float64) @ blobs[0][c * 8:(c + 1) * 8]
    if bias:
        ref += blobs[1]
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)
