"""mitmul/caffe's ssai nets: the Augment layer (augment_layer.cpp: centre crop, binarize, the first bottom's
per-patch mean / deviation normalization) and Simon Safar's 2014 Reshape (num/channels/height/width), against
loops written from the fork's code, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def augment_ref(x, size, binarize, mean_norm, std_norm, subtract=(), divide=()):
    """Forward_cpu per item: the cv::Rect(W/2 - s/2, H/2 - s/2, s, s) patch; threshold; meanStdDev in double,
    then subtract the mean, divide by the deviation, subtract / divide the constants."""
    n, c, h, w = x.shape
    top, left = h // 2 - size // 2, w // 2 - size // 2
    out = x[:, :, top:top + size, left:left + size].copy()
    if binarize:
        out = (out > 0.5).astype(f32)
    for i in range(n):
        for ch in range(c):
            plane = out[i, ch].astype(np.float64)
            mean, std = plane.mean(), np.sqrt(max((plane * plane).mean() - plane.mean() ** 2, 0.0))
            if mean_norm:
                out[i, ch] = out[i, ch] - f32(mean)
            if std_norm:
                out[i, ch] = out[i, ch] * f32(1.0 / std)
            if subtract:
                out[i, ch] = out[i, ch] - f32(subtract[ch])
            if divide:
                out[i, ch] = out[i, ch] * f32(1.0 / divide[ch])
    return out


def test_augment_crops_and_normalizes_the_first_bottom_per_patch(tmp_path):
    # mitmul/ssai Mnih_CNN_Asym_MVN: crop_size 64 of a 64+ input, mean and deviation per patch; a label bottom
    # cropped and binarized alongside
    layer = ('layer { name: "aug" type: "Augment" bottom: "img" bottom: "lab" top: "a" top: "l" augment_param { '
             'crop_size: 6 crop_size: 4 binarize: false binarize: true mean_normalize: true stddev_normalize: true '
             'subtract: 0.5 subtract: -1 subtract: 2 divide: 2 divide: 0.5 divide: 4 } }')
    model = load_from_text(net(layer, inputs={"img": (2, 3, 9, 8), "lab": (2, 1, 7, 9)}))
    assert model.blob_shapes["a"] == (2, 3, 6, 6) and model.blob_shapes["l"] == (2, 1, 4, 4)
    g = np.random.default_rng(12)
    img, lab = (g.standard_normal((2, 3, 9, 8)) * 20 + 5).astype(f32), g.random((2, 1, 7, 9)).astype(f32)
    refs = {"a": augment_ref(img, 6, False, True, True, (0.5, -1, 2), (2, 0.5, 4)),
            "l": augment_ref(lab, 4, True, False, False)}
    check_everywhere(model, {"img": img, "lab": lab}, refs, tmp_path, atol=1e-5, rtol=1e-5)


def test_patch_transformer_is_augment_under_its_ssai_branch_name(tmp_path):
    # deepbasu007/ssai-fcn predict.prototxt: crop 64 of a 64 x 64 input, each patch standardized per channel
    layer = ('layer { name: "pt" type: "PatchTransformer" bottom: "x" top: "y" patch_transformer_param { '
             'rotate: false crop_size: 6 binarize: false mean_normalize: true stddev_normalize: true } }')
    model = load_from_text(net(layer, inputs={"x": (2, 3, 7, 8)}))
    x = (np.random.default_rng(13).standard_normal((2, 3, 7, 8)) * 30 + 100).astype(f32)
    check_everywhere(model, {"x": x}, {"y": augment_ref(x, 6, False, True, True)}, tmp_path, atol=1e-5, rtol=1e-5)
    with pytest.raises(LayerError, match="patch_transformer_param needs one crop_size per bottom"):
        load_from_text(net('layer { name: "pt" type: "PatchTransformer" bottom: "x" top: "y" }',
                           inputs={"x": (1, 3, 6, 6)}))


def test_augment_with_flip_or_rotate_is_sized_and_refused():
    model = load_from_text(net('layer { name: "aug" type: "Augment" bottom: "x" top: "y" augment_param { '
                               'crop_size: 4 flip: true } }', inputs={"x": (1, 3, 6, 6)}))
    assert model.blob_shapes["y"] == (1, 3, 4, 4)
    with pytest.raises(CaffeqError, match="random flip or angle at every forward"):
        model.run({"x": np.zeros((1, 3, 6, 6), f32)})
    with pytest.raises(LayerError, match="crop_size 9 does not fit"):
        load_from_text(net('layer { name: "aug" type: "Augment" bottom: "x" top: "y" augment_param { crop_size: 9 } }',
                           inputs={"x": (1, 3, 6, 6)}))


@pytest.mark.parametrize("params, bottom, top", [
    ("channels: 3 height: 16 width: 16", (2, 768), (2, 3, 16, 16)),       # ssai's fc11 -> the 3-channel map
    ("num: -1 channels: 4", (2, 8, 3, 1), (4, 4, 3, 1)),                  # unset copies (H, W), -1 infers num
])
def test_the_2014_reshape_fields(params, bottom, top, tmp_path):
    model = load_from_text(net(f'layer {{ name: "r" type: "Reshape" bottom: "x" top: "y" reshape_param {{ {params} }} }}',
                               inputs={"x": bottom}))
    assert model.blob_shapes["y"] == top
    x = np.random.default_rng(13).standard_normal(bottom).astype(f32)
    check_everywhere(model, {"x": x}, {"y": x.reshape(top)}, tmp_path)
