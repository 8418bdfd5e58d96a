"""MhLiao/RRD (83a3332) Oriented Response Networks: Convolution's orn_param (active rotating
filters), Extend and ORPooling.

References are numpy loops written here from the fork's code: init_indices (its literal 1-based
tables, include/caffe/layers/base_conv_layer.hpp), RotateARF_cpu (conv_layer.cpp), ExtendLayer and
ORPoolingLayer Forward_cpu, with a float64 direct convolution; each layer runs in torch,
onnxruntime and the generated model.py on shapes whose N, C, H and W all differ.
"""
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.layers.orn import arf_table, torch_arf_weight
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
RRD_FILE = "MhLiao__RRD__models__ic15__deploy_ic15.prototxt"

# the fork's init_indices tables, as it writes them (1-based; row r = rotation r)
LAYER = {
    4: [1, 2, 3, 4, 2, 3, 4, 1, 3, 4, 1, 2, 4, 1, 2, 3],
    8: [1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4, 5, 6, 7, 8, 1, 3, 4, 5, 6, 7, 8, 1, 2, 4, 5, 6, 7, 8, 1, 2, 3,
        5, 6, 7, 8, 1, 2, 3, 4, 6, 7, 8, 1, 2, 3, 4, 5, 7, 8, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 4, 5, 6, 7],
}
KERNEL = {
    (4, 1): [1, 1, 1, 1],
    (4, 3): [1, 2, 3, 4, 5, 6, 7, 8, 9,
             3, 6, 9, 2, 5, 8, 1, 4, 7,
             9, 8, 7, 6, 5, 4, 3, 2, 1,
             7, 4, 1, 8, 5, 2, 9, 6, 3],
    (8, 1): [1] * 8,
    (8, 3): [1, 2, 3, 4, 5, 6, 7, 8, 9,
             2, 3, 6, 1, 5, 9, 4, 7, 8,
             3, 6, 9, 2, 5, 8, 1, 4, 7,
             6, 9, 8, 3, 5, 7, 2, 1, 4,
             9, 8, 7, 6, 5, 4, 3, 2, 1,
             8, 7, 4, 9, 5, 1, 6, 3, 2,
             7, 4, 1, 8, 5, 2, 9, 6, 3,
             4, 1, 2, 7, 5, 3, 8, 9, 6],
}


def rrd_indices(n, k):
    """init_indices: indices[(i * k*k + j) * n + r] = (layer - 1) * k*k + kernel - 1."""
    kk = k * k
    idx = np.zeros(n * kk * n, np.int64)
    for i in range(n):
        for j in range(kk):
            for r in range(n):
                idx[(i * kk + j) * n + r] = (LAYER[n][r * n + i] - 1) * kk + KERNEL[(n, k)][r * kk + j] - 1
    return idx


def rotate_arf_ref(weight, n):
    """RotateARF_cpu on a copy of the (O*n, I*n, k, k) weight blob."""
    out_c, in_c, k, _ = weight.shape
    w = weight.copy().reshape(-1)
    idx = rrd_indices(n, k)
    n_out, n_in, entries = out_c // n, in_c // n, n * k * k
    for i in range(n_out):
        for j in range(n_in):
            for src in range(entries):
                val = w[i * (n * n_in * entries) + j * entries + src]
                for r in range(1, n):
                    w[i * (n * n_in * entries) + r * (n_in * entries) + j * entries + idx[src * n + r]] = val
    return w.reshape(weight.shape)


def conv_ref(x, w, b, stride, pad, dilation=1):
    """Caffe's 2-D convolution, direct, in float64."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, h, wd = x.shape
    o, _, k, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ext = dilation * (k - 1) + 1
    oh, ow = (h + 2 * pad - ext) // stride + 1, (wd + 2 * pad - ext) // stride + 1
    y = np.zeros((n, o, oh, ow))
    for a in range(k):
        for bb in range(k):
            patch = xp[:, :, a * dilation:a * dilation + stride * (oh - 1) + 1:stride,
                       bb * dilation:bb * dilation + stride * (ow - 1) + 1:stride]
            y += np.einsum("nchw,oc->nohw", patch, w[:, :, a, bb])
    return y + (0 if b is None else b.astype(np.float64)[None, :, None, None])


@pytest.mark.parametrize("n, k", [(4, 1), (4, 3), (8, 1), (8, 3)])
def test_arf_rotation_is_rrds_rotate_arf_bit_for_bit(n, k):
    table = np.array(arf_table(n, k))
    assert (table[0] == np.arange(n * k * k)).all()          # rotation 0 is the stored filter
    w = rng(n + k).standard_normal((3 * n, 2 * n, k, k)).astype(np.float32)
    got = torch_arf_weight(torch.from_numpy(w), n).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, rotate_arf_ref(w, n))


def orn_conv_text(c, n, num_output, conv_param, shape, extra=""):
    return net(f'layer {{ name: "c" type: "Convolution" bottom: "x" top: "o" convolution_param {{ '
               f'num_output: {num_output} {conv_param} }} orn_param {{ orientations: {n} }} }}' + extra,
               inputs={"x": shape})


@pytest.mark.parametrize("n, c, num_output, conv_param, shape, geometry", [
    (4, 12, 8, "kernel_size: 3 pad: 1 stride: 2", (2, 12, 7, 6), (2, 1, 1)),
    (8, 16, 24, "kernel_size: 1", (3, 16, 5, 4), (1, 0, 1)),
    (8, 8, 16, "kernel_size: 3 pad: 2 dilation: 2 bias_term: false", (2, 8, 6, 9), (1, 2, 2)),
])
def test_orn_convolution_everywhere(n, c, num_output, conv_param, shape, geometry, tmp_path):
    model = load_from_text(orn_conv_text(c, n, num_output, conv_param, shape), random_weights=True)
    node = node_of(model, "c")
    k = 1 if "kernel_size: 1" in conv_param else 3
    assert node.expected_param_shapes[0] == (num_output, c, k, k)   # the fork's blob: Caffe's shape
    w = node.blobs[0]
    b = None
    if len(node.blobs) == 2:
        b = rng(3).standard_normal(num_output).astype(np.float32)
        node.blobs = [w, b]
    x = rng(4).standard_normal(shape).astype(np.float32)
    ref = conv_ref(x, rotate_arf_ref(w, n), b, *geometry)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_orn_convolution_is_not_folded_with_batchnorm():
    text = orn_conv_text(8, 4, 8, "kernel_size: 3 pad: 1", (2, 8, 5, 7), extra="""
layer { name: "bn" type: "BatchNorm" bottom: "o" top: "o" }
layer { name: "sc" type: "Scale" bottom: "o" top: "o" scale_param { bias_term: true } }""")
    model = load_from_text(text, random_weights=True)
    bn = node_of(model, "bn")
    bn.blobs = [rng(6).standard_normal(8).astype(np.float32), rng(7).uniform(0.5, 2, 8).astype(np.float32),
                np.ones(1, np.float32)]
    node_of(model, "sc").blobs = [rng(8).uniform(0.5, 2, 8).astype(np.float32),
                                  rng(9).standard_normal(8).astype(np.float32)]
    x = rng(10).standard_normal((2, 8, 5, 7)).astype(np.float32)
    fast, exact = model.run({"x": x})["o"], model.run({"x": x}, exact=True)["o"]
    np.testing.assert_allclose(fast, exact, rtol=1e-5, atol=1e-5)


def test_orn_orientations_one_is_a_plain_convolution():
    model = load_from_text(orn_conv_text(3, 1, 5, "kernel_size: 5", (1, 3, 6, 6)), random_weights=True)
    assert node_of(model, "c").attrs["orn"] is None


@pytest.mark.parametrize("n, c, num_output, conv_param, message", [
    (2, 4, 4, "kernel_size: 3", "4 or 8 orientations"),
    (4, 4, 4, "kernel_size: 5", "1x1 or 3x3 kernel, got 5x5"),
    (4, 4, 4, "kernel_h: 3 kernel_w: 1", "got 3x1"),
    (4, 8, 8, "kernel_size: 3 group: 2", "do not take groups"),
    (4, 8, 6, "kernel_size: 3", "num_output 6 is not a multiple of orientations 4"),
    (8, 12, 8, "kernel_size: 1", "input channels 12 is not a multiple of orientations 8"),
])
def test_orn_convolution_refuses_what_rrd_refuses(n, c, num_output, conv_param, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(orn_conv_text(c, n, num_output, conv_param, (1, c, 6, 5)))


def test_extend_everywhere(tmp_path):
    x = rng(11).standard_normal((2, 3, 4, 5)).astype(np.float32)
    model = load_from_text(net('layer { name: "e" type: "Extend" bottom: "x" top: "o" '
                               'orn_param { orientations: 4 } }', inputs={"x": x.shape}))
    ref = np.zeros((2, 12, 4, 5), np.float32)
    for j in range(3):                           # Forward_cpu: channel j copied to j*n + k
        for k in range(4):
            ref[:, j * 4 + k] = x[:, j]
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def orpool_ref(x, n):
    """Forward_cpu: max_val = -999999, a value taken only when strictly greater."""
    b, c, h, w = x.shape
    out = np.zeros((b, c // n, h, w), np.float32)
    for i in range(b):
        for j in range(c // n):
            for p in range(h):
                for q in range(w):
                    best = np.float32(-999999)
                    for k in range(n):
                        v = x[i, j * n + k, p, q]
                        if v > best:
                            best = v
                    out[i, j, p, q] = best
    return out


def test_orpooling_everywhere(tmp_path):
    x = rng(12).standard_normal((2, 24, 3, 5)).astype(np.float32)
    x[0, 0:8, 1, 2] = -3e6                       # all below the fork's floor: -999999
    x[1, 9, 2, 4] = np.nan                       # skipped, as `val > max_val` is false for NaN
    x[1, 16:24, 0, 0] = np.nan                   # nothing taken: the floor
    model = load_from_text(net('layer { name: "p" type: "ORPooling" bottom: "x" top: "o" '
                               'orn_param { orientations: 8 } }', inputs={"x": x.shape}))
    ref = orpool_ref(x, 8)
    assert ref[0, 0, 1, 2] == -999999 and ref[1, 2, 0, 0] == -999999 and not np.isnan(ref).any()
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("layer, message", [
    ('type: "Extend" bottom: "x" top: "o"', "Extend needs orn_param.orientations greater than 1, got 1"),
    ('type: "ORPooling" bottom: "x" top: "o" orn_param { orientations: 4 }',
     "input channels 6 are not a multiple of orientations 4"),
    ('type: "ORPooling" bottom: "x" top: "o" top: "p" orn_param { orientations: 2 }', "one bottom and one top"),
    ('type: "Extend" bottom: "x" top: "x" orn_param { orientations: 2 }', "does not allow in-place"),
])
def test_extend_and_orpooling_refusals(layer, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(f'layer {{ name: "l" {layer} }}', inputs={"x": (1, 6, 3, 4)}))


def test_rrd_ic15_deploy_reads_with_the_forks_blob_shapes(tmp_path):
    path = tmp_path / RRD_FILE
    shutil.copy(REALWORLD / RRD_FILE, path)
    model = load(str(path))
    shapes = {n.name: n.expected_param_shapes for n in model.layers}
    assert model.blob_shapes["extend"] == (1, 24, 768, 768)
    assert shapes["conv1_1"] == [(64, 24, 3, 3), (64,)]
    assert node_of(model, "conv1_1").attrs["orn"] == 8
    assert node_of(model, "conv4_3_norm_mbox_loc").attrs["orn"] is None     # 3x5, no orn_param
    assert model.blob_shapes["conv4_3_norm_mbox_conf_orpooling"] == (1, 64, 96, 96)
    assert model.blob_shapes["detection_out"] == (1, 1, 200, 15)            # TextBoxes++ quadrilaterals
