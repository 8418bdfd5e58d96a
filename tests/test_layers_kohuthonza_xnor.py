"""kohuthonza/caffe's XNOR layers: BinaryConvolution as its binary_convolution_param's field names mark it
(99ce5b63's gradient_* and the head 4f68844b's update_weight_diff / scale_weight_diff) and Signum.  The
references are loops written from the fork's Forward_cpu (binary_conv_layer.cpp: alpha = asum / n per
filter, copysign(1, w) at 99ce5b63 and w > 0 ? 1 : -1 at the head, whose top is alpha * (conv + bias);
signum_layer.cpp: copysign(1, x) where its nets were written), then Caffe's convolution in float64, compared in torch,
onnxruntime and the generated model.py."""
import math
import re

import numpy as np
import pytest
import torch
from conftest import REPO, check_everywhere, conv_ref, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.layers.kohuthonza_xnor import kohuthonza_binarize
from caffeq.model import load, load_from_text

f32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def binarize_ref(w, commit):
    """Forward_cpu's binary weights and alphas: per filter o, alpha[o] = (sum of |w| in float32) / n, and
    each weight copysign(1, w) (99ce5b63) or (w > 0 ? 1 : -1) (4f68844b)."""
    rows = np.asarray(w, np.float32).reshape(w.shape[0], -1)
    signs = np.empty_like(rows)
    alphas = np.empty(rows.shape[0], np.float32)
    for o, row in enumerate(rows):
        total = f32(0)
        for v in row:
            total = f32(total + f32(abs(v)))
        alphas[o] = f32(total / f32(row.size))
        for j, v in enumerate(row):
            if commit == "99ce5b63":
                signs[o, j] = np.copysign(f32(1), v)
            else:
                signs[o, j] = 1 if v > 0 else -1
    return signs.reshape(w.shape), alphas


def binary_conv_ref(x, w, b, commit, stride, pad, group):
    signs, alphas = binarize_ref(w, commit)
    if commit == "99ce5b63":
        return conv_ref(x, signs * alphas.reshape(-1, 1, 1, 1), b, stride, pad, group)
    out = conv_ref(x, signs, b, stride, pad, group)
    return out * alphas.astype(np.float64).reshape(1, -1, 1, 1)


def one_layer(type_, shape, params=""):
    return load_from_text(net(f'layer {{ name: "q" type: "{type_}" bottom: "x" top: "y" {params} }}',
                              inputs={"x": shape}), random_weights=True)


@pytest.mark.parametrize("fields, commit", [
    ("gradient_update: true gradient_scale: false", "99ce5b63"),
    ("gradient_update: false", "99ce5b63"),
    ("update_weight_diff: true scale_weight_diff: true", "4f68844b"),
    ("scale_weight_diff: false", "4f68844b"),
])
@pytest.mark.parametrize("bias", [False, True])
def test_binary_convolution_by_commit(fields, commit, bias, tmp_path):
    shape = (2, 4, 7, 6)
    params = ("convolution_param { num_output: 6 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 "
              f"pad_w: 0 group: 2 {'' if bias else 'bias_term: false'} }} binary_convolution_param {{ {fields} }}")
    model = one_layer("BinaryConvolution", shape, params)
    assert node_of(model, "q").attrs["kohuthonza"] == commit
    r = rng(11)
    w = (r.integers(-24, 25, size=(6, 2, 3, 2)) / 16).astype(np.float32)
    w[0, 0, 0, 0], w[1, 1, 2, 1], w[2, 0, 1, 0] = 0.0, -0.0, 0.0    # the signs of zeros differ by commit
    blobs = [w] + ([(r.integers(-24, 25, size=6) / 16).astype(np.float32)] if bias else [])
    node = node_of(model, "q")
    node.blobs = blobs
    model.clear_cache()
    x = r.standard_normal(shape).astype(np.float32)
    ref = binary_conv_ref(x, w, blobs[1] if bias else None, commit, (2, 1), (1, 0), 2)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-6)


def test_the_two_commits_sign_zero_weights_differently():
    w = torch.tensor([[[[0.0]], [[-0.0]], [[0.5]]]])
    assert (kohuthonza_binarize(w, copysign=True).sign().ravel().tolist(),
            kohuthonza_binarize(w, copysign=False).sign().ravel().tolist()) == ([1, -1, 1], [-1, -1, 1])


@pytest.mark.parametrize("fields, message", [
    ("gradient_update: true update_weight_diff: true", "mixes kohuthonza/caffe's gradient_* fields"),
    ("gradient_scale: true use_alpha: true", "mixes kohuthonza/caffe's fields with zhaoweicai/hwgq's"),
])
def test_mixed_fields_are_refused(fields, message):
    with pytest.raises(LayerError, match=re.escape(message)):
        one_layer("BinaryConvolution", (1, 2, 4, 4),
                  f"convolution_param {{ num_output: 2 kernel_size: 3 }} binary_convolution_param {{ {fields} }}")


def test_signum(tmp_path):
    shape = (3, 5, 2)
    model = one_layer("Signum", shape)
    x = rng(12).standard_normal(shape).astype(np.float32)
    x.ravel()[:4] = [0.0, -0.0, np.float32(1e-45), -np.float32(1e-45)]
    ref = np.array([math.copysign(1.0, v) for v in x.ravel()], np.float32).reshape(shape)   # signum_layer.cpp
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.skipif(not CORPUS.exists(), reason="the corpus files are not on this machine")
def test_fork_test_nets_read():
    conv = load(CORPUS / "kohuthonza__caffe__xnor_tests__deploy_binary_convolution_layer.prototxt",
                random_weights=True)
    assert conv.blob_shapes["binary_convolution"] == (1, 64, 5, 5)
    signum = load(CORPUS / "kohuthonza__caffe__xnor_tests__deploy_signum_layer.prototxt", random_weights=True)
    assert signum.blob_shapes["signum"] == (128, 64)
