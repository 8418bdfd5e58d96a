"""wang821002/Caffe-Multi-Label's LsePooling: the reference is Forward_cpu's loops as written (its running
shift m, the window clipped to the padded extent for pool_size, then to the image for the sum), compared in
torch, onnxruntime (global windows) and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text


def fork_forward(x, pool, r, k, s, p):
    """lse_pooling_layer.cpp's Forward_cpu (LSE, MAX, AVE), with BVLC's ceil shape and padded-last-window rule."""
    n, c, h, w = x.shape
    out = []
    for size, kk, ss, pp in ((h, k[0], s[0], p[0]), (w, k[1], s[1], p[1])):
        o = int(math.ceil((size + 2 * pp - kk) / ss)) + 1
        if (p[0] or p[1]) and (o - 1) * ss >= size + pp:
            o -= 1
        out.append(o)
    y = np.zeros((n, c, out[0], out[1]), np.float32)
    for a in range(n):
        for b in range(c):
            for ph in range(out[0]):
                for pw in range(out[1]):
                    hs, ws = ph * s[0] - p[0], pw * s[1] - p[1]
                    he, we = min(hs + k[0], h + p[0]), min(ws + k[1], w + p[1])
                    pool_size = (he - hs) * (we - ws)
                    cells = x[a, b, max(hs, 0):min(he, h), max(ws, 0):min(we, w)].ravel()
                    if pool == "MAX":
                        y[a, b, ph, pw] = cells.max()
                    elif pool == "AVE":
                        y[a, b, ph, pw] = cells.sum(dtype=np.float32) / pool_size
                    else:
                        m = np.float32(0)
                        for v in cells:          # the fork's shift: any cell whose |x| exceeds it, signed
                            if abs(v) > m:
                                m = v
                        total = np.float32(0)
                        for v in cells:
                            total += np.exp(np.float32(r) * (v - m), dtype=np.float32)
                        y[a, b, ph, pw] = m + (1.0 / r) * math.log(total / pool_size)
    return y


def lse_layer(params, tops=('"y"',)):
    return (f'layer {{ name: "lse" type: "LsePooling" bottom: "x" {" ".join("top: " + t for t in tops)} '
            f'lse_pooling_param {{ {params} }} }}')


def test_the_xray_nets_global_pooling_after_a_relu(tmp_path):
    # deploy_CAM_resnet_Xray_LSE: CAM_conv -> ReLU -> LsePooling { r_t: 12 } (global by default)
    x = np.maximum(rng(90).standard_normal((2, 3, 5, 7)), 0).astype(np.float32) * 2
    model = load_from_text(net(lse_layer("r_t: 12"), inputs={"x": x.shape}))
    assert model.blob_shapes["y"] == (2, 3, 1, 1)
    check_everywhere(model, {"x": x}, {"y": fork_forward(x, "LSE", 12.0, (5, 7), (1, 1), (0, 0))}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_mixed_signs_give_the_forks_value_where_its_shift_does_not_overflow(tmp_path):
    x = (rng(91).standard_normal((1, 2, 4, 6)) * 0.8).astype(np.float32)
    model = load_from_text(net(lse_layer("r_t: 5"), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"y": fork_forward(x, "LSE", 5.0, (4, 6), (1, 1), (0, 0))}, tmp_path,
                     atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params, k, s, p", [
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1", (3, 2), (2, 1), (0, 0)),
    ("kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1)),
    ("kernel_size: 2 stride: 3", (2, 2), (3, 3), (0, 0))])
def test_windowed_lse_in_torch_and_model_py(params, k, s, p, tmp_path):
    x = np.abs(rng(92).standard_normal((2, 2, 7, 8))).astype(np.float32)
    model = load_from_text(net(lse_layer(f"global_pooling: false {params} r_t: 3"), inputs={"x": x.shape}))
    want = fork_forward(x, "LSE", 3.0, k, s, p)
    assert model.blob_shapes["y"] == want.shape
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path, atol=1e-5, rtol=1e-5, opsets=())
    with pytest.raises(CaffeqError, match="LSE window on a 7x8 input has no ONNX form"):
        model.export_onnx(tmp_path / "m.onnx")


def test_a_negative_r_is_a_soft_minimum_with_padding_counted(tmp_path):
    x = (rng(94).standard_normal((1, 2, 5, 6)) * 0.7).astype(np.float32)
    model = load_from_text(net(lse_layer("global_pooling: false kernel_size: 3 stride: 2 pad: 1 r_t: -2"),
                               inputs={"x": x.shape}))
    want = fork_forward(x, "LSE", -2.0, (3, 3), (2, 2), (1, 1))
    assert np.isfinite(want).all()
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path, atol=1e-5, rtol=1e-5, opsets=())
    glob = load_from_text(net(lse_layer("r_t: -3"), inputs={"x": x.shape}))
    check_everywhere(glob, {"x": x}, {"y": fork_forward(x, "LSE", -3.0, (5, 6), (1, 1), (0, 0))}, tmp_path,
                     atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_max_and_ave_are_bvlc_pooling(pool, tmp_path):
    x = rng(93).standard_normal((1, 3, 6, 5)).astype(np.float32)
    model = load_from_text(net(lse_layer(f"pool: {pool} global_pooling: false kernel_size: 3 stride: 2 pad: 1"),
                               inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"y": fork_forward(x, pool, 0, (3, 3), (2, 2), (1, 1))}, tmp_path,
                     atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("params, message", [
    ("", "r_t .* must be set and nonzero"),
    ("pool: STOCHASTIC", "STOCHASTIC is not implemented in the fork")])
def test_refusals(params, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(lse_layer(params), inputs={"x": (1, 1, 4, 4)}))


def test_global_pooling_with_a_kernel_too_reads_as_global_with_a_note():
    # the fork (as BVLC's Pooling) refuses a kernel beside global_pooling; caffeq pools the whole plane, as for
    # Pooling (paddle-mobile's MobileNet deploy), and says so
    x = rng(94).standard_normal((2, 3, 4, 5)).astype(np.float32)
    model = load_from_text(net(lse_layer("global_pooling: true kernel_size: 2 r_t: 1"), inputs={"x": x.shape}))
    assert any("global_pooling with kernel_size too" in w for w in model.warnings)
    np.testing.assert_allclose(model.run({"x": x})["y"], fork_forward(x, "LSE", 1.0, (4, 5), (1, 1), (0, 0)),
                               rtol=1e-5, atol=1e-6)
