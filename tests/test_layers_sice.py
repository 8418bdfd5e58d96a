"""csjcai/SICE's PixelConv (caffeq/layers/sice.py) against a loop written here from PixelConv_layer.cpp / .cu
(im2col with pad k / 2, times the kernel bottom walked flat, summed over the k^2 taps), and Caffe_Gan's
WSplitData (caffeq/layers/caffe_gan.py, wsplit_data_layer.cpp), in torch, onnxruntime and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def pixel_conv_ref(kernels, data):
    n, c, h, w = data.shape
    k = math.isqrt(kernels.shape[1] // c)
    p = k // 2
    flat = kernels.reshape(-1)            # the fork's weights pointer: k^2 planes of H x W per (n, c) in turn
    out = np.zeros(data.shape, F32)
    for b in range(n):
        for ch in range(c):
            base = (b * c + ch) * k * k * h * w
            for y in range(h):
                for x in range(w):
                    acc = F32(0)
                    for i in range(k):
                        for j in range(k):
                            yy, xx = y - p + i, x - p + j
                            v = data[b, ch, yy, xx] if 0 <= yy < h and 0 <= xx < w else F32(0)
                            acc = F32(acc + F32(flat[base + (i * k + j) * h * w + y * w + x] * v))
                    out[b, ch, y, x] = acc
    return out


def pixel_conv_net(kshape, dshape, params=""):
    return net(f'layer {{ name: "pc" type: "PixelConv" bottom: "k" bottom: "d" top: "y" {params} }}',
               inputs={"k": kshape, "d": dshape})


@pytest.mark.parametrize("kshape, dshape, params", [
    ((2, 18, 5, 7), (2, 2, 5, 7), ""),      # k = 3, C0 = C k^2
    ((2, 25, 3, 4), (2, 1, 3, 4), ""),      # k = 5, a kernel wider than the image
    ((2, 5, 3, 4), (2, 3, 3, 4), ""),       # k = int(sqrt(5 / 3)) = 1: image 1 reads image 0's last channels
    ((3, 20, 3, 5), (2, 2, 3, 5), ""),      # k = 3 from 20 / 2 = 10, kernels walked across bottom 0's images
    ((2, 6, 3, 5), (2, 2, 3, 5), ""),       # k = int(sqrt(3)) = 1, truncated (rounding would give 2)
    ((2, 15, 4, 3), (2, 1, 4, 3), ""),      # k = int(sqrt(15)) = 3 (not 4), 9 of each image's 15 planes a step
    # the backward switches are read and change nothing at TEST
    ((2, 18, 5, 7), (2, 2, 5, 7), "pixelconvolution_param { is_pad: true is_bpk: false is_bpd: false }"),
])
def test_pixel_conv_per_pixel_kernels(kshape, dshape, params, tmp_path):
    r = rng(91)
    kernels = r.standard_normal(kshape).astype(F32)
    data = r.standard_normal(dshape).astype(F32)
    model = load_from_text(pixel_conv_net(kshape, dshape, params))
    assert model.blob_shapes["y"] == dshape
    check_everywhere(model, {"k": kernels, "d": data}, {"y": pixel_conv_ref(kernels, data)}, tmp_path)


def test_sice_model3_tail(tmp_path):
    """Perpixel.prototxt's end: Dtow (MDTOW, psize 4) of the 48-channel RIR to 3 channels, then PixelConv with
    the image: k = 1, so each pixel of the image times its own weight."""
    r = rng(92)
    rir = r.standard_normal((2, 48, 3, 5)).astype(F32)
    data = r.uniform(0, 1, (2, 3, 12, 20)).astype(F32)
    text = net('layer { name: "up" type: "Dtow" bottom: "rir" top: "up" dtow_param { psize: 4 } }',
               'layer { name: "pixel" type: "PixelConv" bottom: "up" bottom: "data" top: "pixel" }',
               inputs={"rir": rir.shape, "data": data.shape})
    model = load_from_text(text, outputs=["pixel"])
    # depth-to-space: up[n, c, 4 h + dy, 4 w + dx] = rir[n, 16 c + 4 dy + dx, h, w]
    up = rir.reshape(2, 3, 4, 4, 3, 5).transpose(0, 1, 4, 2, 5, 3).reshape(2, 3, 12, 20)
    check_everywhere(model, {"rir": rir, "data": data}, {"pixel": up * data}, tmp_path)


@pytest.mark.parametrize("kshape, dshape, params, message", [
    ((1, 8, 3, 3), (1, 2, 3, 3), "", r"k = sqrt\(8 / 2\) = 2 is even"),
    ((1, 9, 3, 3), (1, 1, 3, 3), "pixelconvolution_param { is_pad: false }", "is_pad: false is not supported"),
    ((1, 9, 3, 4), (1, 1, 3, 3), "", "same height and width .* got 3 x 4 and 3 x 3"),
    ((1, 2, 3, 3), (1, 3, 3, 3), "", "at least the data's 3 channels"),
    ((1, 9, 3, 3), (2, 1, 3, 3), "", r"reads 18 kernel planes \(2 x 1 x 3\^2\) from a kernel bottom of 9"),
])
def test_pixel_conv_refusals(kshape, dshape, params, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(pixel_conv_net(kshape, dshape, params))


def test_wsplit_data_shares_the_bottom(tmp_path):
    x = rng(93).standard_normal((2, 3, 5)).astype(F32)
    text = net('layer { name: "sp" type: "WSplitData" bottom: "x" top: "a" top: "b" net_id: 16 '
               'wsplit_param { weight: 0.01 } }', inputs={"x": x.shape})
    model = load_from_text(text, outputs=["a", "b"])
    assert model.blob_shapes["a"] == model.blob_shapes["b"] == (2, 3, 5, 1)   # the legacy 4-axis shape
    x4 = x.reshape(2, 3, 5, 1)
    check_everywhere(model, {"x": x}, {"a": x4, "b": x4}, tmp_path)
    with pytest.raises(LayerError, match="WSplitData takes one bottom and 2 tops, got 1 and 3"):
        load_from_text(net('layer { name: "sp" type: "WSplitData" bottom: "x" top: "a" top: "b" top: "c" }',
                           inputs={"x": x.shape}))
