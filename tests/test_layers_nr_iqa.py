"""Adnan1011/NR-IQA-CNN's Caffe (75ece0b): MIN pooling and Dropout's scale_test.

The references are numpy transcriptions of the fork's pooling_layer.cpp MIN loop (windows as MAX's, the
running minimum from FLT_MAX with a strict <, so the first minimum in row-major order gives the mask index)
and dropout_layer.cpp's TEST pass with scale_test (times 1 / scale_, scale_ = 1 / (1 - ratio) in float32).
Every net runs in torch, onnxruntime and model.py, bit for bit.
"""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

FLT_MAX = np.finfo(np.float32).max


def min_pool_ref(x, kernel, stride, pad):
    """The fork's MIN Forward_cpu with Caffe's ceil output size and pad rule: values and mask (h * W + w)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad

    def out_size(size, k, s, p):
        o = -(-(size + 2 * p - k) // s) + 1
        return o - 1 if p and (o - 1) * s >= size + p else o

    oh, ow = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
    values = np.full((n, c, oh, ow), FLT_MAX, np.float32)
    mask = np.full((n, c, oh, ow), -1, np.float32)
    for b in range(n):
        for ch in range(c):
            for i in range(oh):
                for j in range(ow):
                    hs, ws = i * sh - ph, j * sw - pw
                    he, we = min(hs + kh, h), min(ws + kw, w)
                    for y in range(max(hs, 0), he):
                        for xx in range(max(ws, 0), we):
                            if x[b, ch, y, xx] < values[b, ch, i, j]:
                                values[b, ch, i, j] = x[b, ch, y, xx]
                                mask[b, ch, i, j] = y * w + xx
    return values, mask


def pool_text(params, tops=("p",)):
    top = " ".join(f'top: "{t}"' for t in tops)
    return f'layer {{ name: "p" type: "Pooling" bottom: "x" {top} pooling_param {{ pool: MIN {params} }} }}'


@pytest.mark.parametrize("shape, kernel, stride, pad", [
    ((2, 3, 7, 9), (3, 3), (2, 2), (1, 1)),
    ((1, 2, 6, 11), (2, 4), (2, 3), (1, 2)),     # ceil's last window clipped; Caffe's pad rule drops one
    ((1, 2, 5, 4), (5, 4), (1, 1), (0, 0)),      # one window over the whole map (the IQA net's min pooling)
])
def test_min_pooling_and_its_mask_match_the_forks_loop(shape, kernel, stride, pad, tmp_path):
    x = rng(61).standard_normal(shape).astype(np.float32)
    x[0, 0, 1, :2] = x[0, 0, 1, 2]                 # ties: the first minimum in row-major order wins
    params = (f"kernel_h: {kernel[0]} kernel_w: {kernel[1]} stride_h: {stride[0]} stride_w: {stride[1]} "
              f"pad_h: {pad[0]} pad_w: {pad[1]}")
    values, mask = min_pool_ref(x, kernel, stride, pad)
    model = load_from_text(net(pool_text(params), inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"p": values}, tmp_path)
    model = load_from_text(net(pool_text(params, ("p", "m")), inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"p": values, "m": mask}, tmp_path)


def test_global_min_pooling(tmp_path):
    x = rng(62).standard_normal((2, 3, 4, 6)).astype(np.float32)
    model = load_from_text(net(pool_text("global_pooling: true"), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"p": x.min(axis=(2, 3), keepdims=True)}, tmp_path)


def test_min_pooling_is_2d_only():
    with pytest.raises(CaffeqError, match=r"MIN \(NR-IQA's fork\) is 2-D only"):
        load_from_text(net(pool_text("kernel_size: 2"), inputs={"x": (1, 2, 3, 4, 4)}))


def test_dropout_scale_test_multiplies_at_test(tmp_path):
    # dropout_layer.cpp: with scale_test, TEST multiplies by 1 / scale_ (float32), as scale_train: false
    x = rng(63).standard_normal((2, 5)).astype(np.float32)
    text = net('layer { name: "d" type: "Dropout" bottom: "x" top: "d" dropout_param { dropout_ratio: 0.3 '
               'scale_test: true } }', inputs={"x": x.shape})
    scale = np.float32(1.0 / (1.0 - float(np.float32(0.3))))
    check_everywhere(load_from_text(text), {"x": x}, {"d": x * np.float32(1.0 / float(scale))}, tmp_path)
    with pytest.raises(CaffeqError, match="scale_test: true .* is scale_train: false"):
        load_from_text(text.replace("scale_test: true", "scale_test: true scale_train: true"))
