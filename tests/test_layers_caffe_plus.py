"""jnulzl/caffe_plus's Upsample (f408dae upsample_layer.cpp) and Wulingtian/yolov5_caffe's Reorg
(9c13b6d reorg_layer.cu), the layers Wulingtian/yolov5_onnx2caffe writes for ONNX Resize and YOLOv5's Focus.

References are numpy loops written here from the forks' kernels; each layer runs in torch,
onnxruntime and the generated model.py.
"""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def nearest_ref(x, ho, wo):
    """Forward_cpu_nearest: top (h, w) = bottom (h * H / ho, w * W / wo), integer division."""
    n, c, h, w = x.shape
    y = np.zeros((n, c, ho, wo), np.float32)
    for i in range(ho):
        for j in range(wo):
            y[:, :, i, j] = x[:, :, i * h // ho, j * w // wo]
    return y


def bilinear_ref(x, ho, wo):
    """Forward_cpu_bilinear: float ratios (H - 1) / (ho - 1), truncated taps, the next one clamped."""
    n, c, h, w = x.shape
    f = np.float32
    rh = f(h - 1) / f(ho - 1) if ho > 1 else f(0)
    rw = f(w - 1) / f(wo - 1) if wo > 1 else f(0)
    y = np.zeros((n, c, ho, wo), np.float64)
    for i in range(ho):
        hr = f(rh * f(i))
        h1 = int(hr)
        hp = 1 if h1 < h - 1 else 0
        lh1 = f(hr - f(h1))
        lh0 = f(1) - lh1
        for j in range(wo):
            wr = f(rw * f(j))
            w1 = int(wr)
            wp = 1 if w1 < w - 1 else 0
            lw1 = f(wr - f(w1))
            lw0 = f(1) - lw1
            y[:, :, i, j] = lh0 * (lw0 * x[:, :, h1, w1] + lw1 * x[:, :, h1, w1 + wp]) + \
                lh1 * (lw0 * x[:, :, h1 + hp, w1] + lw1 * x[:, :, h1 + hp, w1 + wp])
    return y


@pytest.mark.parametrize("param, out", [
    ("height_scale: 2 width_scale: 3 mode: NEAREST", (10, 21)),
    ("height: 8 width: 11 mode: NEAREST", (8, 11)),       # not a whole multiple: integer division picks rows
    ("height_scale: 3 width_scale: 2", (15, 14)),          # mode defaults to BILINEAR
    ("height: 9 width: 4 mode: BILINEAR", (9, 4)),         # and bilinear shrinks too
])
def test_upsample_matches_the_forks_kernels(param, out, tmp_path):
    x = rng(1).standard_normal((2, 3, 5, 7)).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "up" type: "Upsample" bottom: "x" top: "y" upsample_param {{ {param} }} }}',
                               inputs={"x": x.shape}))
    assert model.blob_shapes["y"] == (2, 3) + out
    ref = nearest_ref(x, *out) if "NEAREST" in param else bilinear_ref(x, *out)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_upsample_to_a_second_bottoms_size(tmp_path):
    x = rng(2).standard_normal((1, 2, 4, 6)).astype(np.float32)
    ref_blob = np.zeros((1, 5, 7, 13), np.float32)
    model = load_from_text(net('layer { name: "up" type: "Upsample" bottom: "x" bottom: "r" top: "y" '
                               'upsample_param { mode: NEAREST } }', inputs={"x": x.shape, "r": ref_blob.shape}))
    assert model.blob_shapes["y"] == (1, 2, 7, 13)
    check_everywhere(model, {"x": x, "r": ref_blob}, {"y": nearest_ref(x, 7, 13)}, tmp_path)


@pytest.mark.parametrize("param, msg", [
    ("height_scale: 1 width_scale: 2", "must be >= 2"),
    ("height: 8", "two bottoms, or upsample_param height and width, or height_scale and width_scale"),
    ("mode: NEAREST", "two bottoms"),
])
def test_upsample_refuses_what_the_fork_refuses(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "up" type: "Upsample" bottom: "x" top: "y" upsample_param {{ {param} }} }}',
                           inputs={"x": (1, 2, 4, 4)}))


def test_segnet_and_yolo_upsample_are_unchanged():
    # no caffe_plus field: YOLO's scale (nearest repeat) as before
    model = load_from_text(net('layer { name: "up" type: "Upsample" bottom: "x" top: "y" upsample_param { scale: 2 } }',
                               inputs={"x": (1, 2, 3, 4)}))
    x = rng(3).standard_normal((1, 2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"x": x})["y"], x.repeat(2, axis=2).repeat(2, axis=3))


def focus_ref(x, s):
    """reorg_kernel: top[b, oc, y, x] = bottom[b, oc / s^2, y s + (oc % s^2) / s, x s + oc % s]."""
    n, c, h, w = x.shape
    y = np.zeros((n, c * s * s, h // s, w // s), np.float32)
    for oc in range(c * s * s):
        ic, inner = oc // (s * s), oc % (s * s)
        dy, dx = inner // s, inner % s
        for i in range(h // s):
            for j in range(w // s):
                y[:, oc, i, j] = x[:, ic, i * s + dy, j * s + dx]
    return y


@pytest.mark.parametrize("stride, shape", [(2, (2, 3, 6, 8)), (3, (1, 5, 9, 6))])
def test_reorg_of_channels_darknet_cannot_split_is_yolov5_caffes_space_to_depth(stride, shape, tmp_path):
    x = rng(4).standard_normal(shape).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "focus" type: "Reorg" bottom: "x" top: "y" '
                               f'reorg_param {{ stride: {stride} reverse: false }} }}', inputs={"x": shape}))
    assert any("Wulingtian/yolov5_caffe's Reorg" in w for w in model.warnings)
    check_everywhere(model, {"x": x}, {"y": focus_ref(x, stride)}, tmp_path)


def test_reorg_with_divisible_channels_stays_darknets():
    model = load_from_text(net('layer { name: "r" type: "Reorg" bottom: "x" top: "y" reorg_param { stride: 2 } }',
                               inputs={"x": (1, 8, 4, 4)}))
    assert not any("yolov5_caffe" in w for w in model.warnings)
    x = np.arange(128, dtype=np.float32).reshape(1, 8, 4, 4)
    assert not np.array_equal(model.run({"x": x})["y"], focus_ref(x, 2))
    with pytest.raises(LayerError, match="channels 3 must divide by stride"):   # reverse still needs it
        load_from_text(net('layer { name: "r" type: "Reorg" bottom: "x" top: "y" reorg_param { stride: 2 reverse: true } }',
                           inputs={"x": (1, 3, 4, 4)}))
