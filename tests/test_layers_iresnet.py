"""leonzfa/iResNet's NegReLU and RandomCrop against their formulas from the fork's GPU code
(neg_relu_layer.cu, random_crop_layer.cu at 4e5b0b7), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import backend_outputs, check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_neg_relu_keeps_negatives_and_scales_positives(slope, tmp_path):
    model = load_from_text(net(f'layer {{ name: "n" type: "NegReLU" bottom: "x" top: "y" '
                               f'relu_param {{ negative_slope: {slope} }} }}', inputs={"x": (2, 3, 4, 5)}))
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(f32)
    ref = np.where(x < 0, x, x * f32(slope)).astype(f32)     # the kernel: in < 0 ? in : in * slope
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def ref_crop(x, th, tw):
    """crop_copy_gpu with the TEST offsets: int((bW - tW) / 2), int((bH - tH) / 2) in C++."""
    n, c, bh, bw = x.shape
    ow, oh = int((bw - tw) / 2), int((bh - th) / 2)
    out = np.empty((n, c, th, tw), f32)
    for j in range(c):
        for s in range(th):
            for t in range(tw):
                ns, nt = s + oh, t + ow
                inside = 0 <= nt < bw and 0 <= ns < bh
                out[:, j, s, t] = x[:, j, ns, nt] if inside else (np.nan if j == c - 1 else 128)
    return out


@pytest.mark.parametrize("bh, bw, th, tw", [(9, 12, 5, 7), (4, 6, 7, 9), (5, 10, 8, 3), (6, 6, 6, 6),
                                             (3, 4, 12, 13)])
def test_random_crop_at_test_is_the_centre_window_padded_with_128_and_nan(bh, bw, th, tw, tmp_path):
    model = load_from_text(net(f'layer {{ name: "c" type: "RandomCrop" bottom: "x" top: "y" '
                               f'random_crop_param {{ target_height: {th} target_width: {tw} }} }}',
                               inputs={"x": (2, 7, bh, bw)}))
    x = np.random.default_rng(bh * bw).standard_normal((2, 7, bh, bw)).astype(f32)
    assert model.blob_shapes["y"] == (2, 7, th, tw)
    ref = ref_crop(x, th, tw)
    for backend, got in backend_outputs(model, {"x": x}, tmp_path, top="y").items():
        np.testing.assert_array_equal(got, ref, err_msg=backend)    # NaN where the reference has NaN


def test_random_crop_defaults_and_its_channel_check():
    model = load_from_text(net('layer { name: "c" type: "RandomCrop" bottom: "x" top: "y" }',
                               inputs={"x": (1, 7, 200, 400)}))
    assert model.blob_shapes["y"] == (1, 7, 128, 320)
    with pytest.raises(LayerError, match=r"RandomCrop takes \(N, 7, H, W\).*got \[1, 3, 20, 20\]"):
        load_from_text(net('layer { name: "c" type: "RandomCrop" bottom: "x" top: "y" }', inputs={"x": (1, 3, 20, 20)}))
    with pytest.raises(LayerError, match=r"target_height and target_width must be positive, got 0x5"):
        load_from_text(net('layer { name: "c" type: "RandomCrop" bottom: "x" top: "y" random_crop_param { '
                           'target_height: 0 target_width: 5 } }', inputs={"x": (1, 7, 20, 20)}))
