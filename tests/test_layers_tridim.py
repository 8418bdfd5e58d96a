"""xyyu-callen/caffe-3Dstn (3e81d58): TridimConvolution, TridimPooling, TridimSpatialTransformer, TridimData.
References are numpy loops written from the fork's C++ (vol2col + GEMM, tridim_pooling_layer.cpp's loops, the
TridimSpatialTransformerForwardGPU kernel with LayerSetUp's output grid) on (N, C, D, H, W) with D != H != W."""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

FLT_MAX = float(np.finfo(np.float32).max)
SHAPE = (2, 3, 5, 7, 6)


def net5(layers, **inputs):
    text = "".join(f'layer {{ name: "{n}" type: "Input" top: "{n}" input_param {{ shape {{ '
                   + " ".join(f"dim: {d}" for d in s) + " } } }\n" for n, s in inputs.items())
    return text + layers


# ---- TridimConvolution ------------------------------------------------------------------------------

def tridim_conv_ref(x, w, b, k, stride, pad):
    """vol2col (kernel_d = kernel_size, one stride and pad on every axis) and the GEMM, filter group by group:
    group g's rows of the weight times the whole column buffer (all C channels), then the bias."""
    n, c, d, h, wd = x.shape
    o = w.shape[0]
    od, oh, ow = ((s + 2 * pad - k) // stride + 1 for s in (d, h, wd))
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad), (pad, pad)))
    col = np.zeros((n, c * k * k * k, od, oh, ow))
    for row in range(c * k * k * k):
        wo, ho, lo, ci = row % k, (row // k) % k, (row // k // k) % k, row // k // k // k
        col[:, row] = xp[:, ci, lo:lo + stride * od:stride, ho:ho + stride * oh:stride, wo:wo + stride * ow:stride]
    out = np.einsum("ok,nkdhw->nodhw", w.reshape(o, -1).astype(np.float64), col)
    return out + b.reshape(1, -1, 1, 1, 1)


@pytest.mark.parametrize("k, stride, pad, groups", [(3, 1, 1, 1), (2, 2, 0, 2), (3, 2, 1, 4)])
def test_tridim_convolution(k, stride, pad, groups, tmp_path):
    x = rng(1).standard_normal(SHAPE).astype(np.float32)
    model = load_from_text(net5(
        f'layer {{ name: "c" type: "TridimConvolution" bottom: "x" top: "c" tridim_convolution_param {{ '
        f'num_output: 4 kernel_size: {k} stride: {stride} pad: {pad} filter_group: {groups} }} }}', x=SHAPE),
        random_weights=True)
    node = next(n for n in model.layers if n.name == "c")
    assert node.blobs[0].shape == (4, 3, k, k, k) and node.blobs[1].shape == (1, 1, 1, 1, 4)
    node.blobs = [node.blobs[0], rng(2).standard_normal((1, 1, 1, 1, 4)).astype(np.float32)]
    ref = tridim_conv_ref(x, node.blobs[0], node.blobs[1], k, stride, pad)
    assert model.blob_shapes["c"] == ref.shape
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_tridim_convolution_notes_the_fields_its_cpp_ignores():
    model = load_from_text(net5('layer { name: "c" type: "TridimConvolution" bottom: "x" top: "c" '
                                'tridim_convolution_param { num_output: 2 kernel_size: 3 kernel_d: 1 pad_d: 2 } }',
                                x=SHAPE), random_weights=True)
    assert model.blob_shapes["c"] == (2, 2, 3, 5, 4)   # kernel 3 on every axis, no pad
    assert any("kernel_d, pad_d ignored" in n for n in model.warnings)


def test_tridim_convolution_bad_parameters():
    with pytest.raises(LayerError, match="filter_group 3 must divide num_output 4"):
        load_from_text(net5('layer { name: "c" type: "TridimConvolution" bottom: "x" top: "c" '
                            'tridim_convolution_param { num_output: 4 kernel_size: 3 filter_group: 3 } }', x=SHAPE))
    with pytest.raises(LayerError, match=r"tridim_convolution_param.kernel_size must be >= 1, got 0"):
        load_from_text(net5('layer { name: "c" type: "TridimConvolution" bottom: "x" top: "c" '
                            'tridim_convolution_param { num_output: 4 } }', x=SHAPE))


# ---- TridimPooling ----------------------------------------------------------------------------------

def tridim_pool_ref(x, method, k, s, p):
    """tridim_pooling_layer.cpp Forward_cpu: ceil extents, no dropped window; MAX from -FLT_MAX over the window
    clipped to the input; AVE / SUM sum the clipped window, AVE divides by the window clipped to size + pad."""
    n, c, d, h, w = x.shape
    od, oh, ow = (int(np.ceil((size + 2 * p - k) / s)) + 1 for size in (d, h, w))
    out = np.zeros((n, c, od, oh, ow))
    for pl in range(od):
        for ph in range(oh):
            for pw in range(ow):
                starts = [pl * s - p, ph * s - p, pw * s - p]
                if method == "MAX":
                    ends = [min(st + k, size) for st, size in zip(starts, (d, h, w))]
                    starts = [max(st, 0) for st in starts]
                    win = x[:, :, starts[0]:max(ends[0], starts[0]), starts[1]:max(ends[1], starts[1]),
                            starts[2]:max(ends[2], starts[2])].reshape(n, c, -1)
                    out[:, :, pl, ph, pw] = np.maximum(win.max(axis=2), -FLT_MAX) if win.shape[2] else -FLT_MAX
                    continue
                ends = [min(st + k, size + p) for st, size in zip(starts, (d, h, w))]
                pool_size = np.prod([e - st for st, e in zip(starts, ends)])
                starts = [max(st, 0) for st in starts]
                ends = [min(e, size) for e, size in zip(ends, (d, h, w))]
                total = x[:, :, starts[0]:ends[0], starts[1]:ends[1], starts[2]:ends[2]].astype(np.float64).sum(
                    axis=(2, 3, 4))
                out[:, :, pl, ph, pw] = total / pool_size if method == "AVE" else total
    return out


@pytest.mark.parametrize("method, k, s, p", [("MAX", 2, 2, 0), ("MAX", 1, 3, 0), ("AVE", 3, 2, 1), ("AVE", 2, 2, 0),
                                             ("SUM", 2, 2, 0), ("SUM", 1, 3, 0), ("SUM", 3, 1, 0)])
def test_tridim_pooling(method, k, s, p, tmp_path):
    x = rng(3).standard_normal(SHAPE).astype(np.float32)
    model = load_from_text(net5(
        f'layer {{ name: "p" type: "TridimPooling" bottom: "x" top: "p" tridim_pooling_param {{ pool: {method} '
        f'kernel_size: {k} stride: {s} pad: {p} }} }}', x=SHAPE))
    ref = tridim_pool_ref(x, method, k, s, p)
    assert model.blob_shapes["p"] == ref.shape
    if (method, k, s) == ("MAX", 1, 3):
        assert (ref == -FLT_MAX).any()   # windows past the input's end, which C3D's extents keep
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_tridim_pooling_bad_parameters():
    with pytest.raises(LayerError, match="the fork pads only AVE pooling, got MAX"):
        load_from_text(net5('layer { name: "p" type: "TridimPooling" bottom: "x" top: "p" '
                            'tridim_pooling_param { pool: MAX kernel_size: 2 pad: 1 } }', x=SHAPE))
    with pytest.raises(LayerError, match="STOCHASTIC is not implemented"):
        load_from_text(net5('layer { name: "p" type: "TridimPooling" bottom: "x" top: "p" '
                            'tridim_pooling_param { pool: STOCHASTIC kernel_size: 2 } }', x=SHAPE))


# ---- TridimSpatialTransformer -------------------------------------------------------------------------

def tridim_st_ref(u, theta12, od, oh, ow):
    """LayerSetUp's output grid (written with a stride of 3 into a (P, 4) blob of zeros), the per-item GEMM
    with the 3 x 4 theta, then TridimSpatialTransformerForwardGPU's eight taps at (p + 1) / 3 * size."""
    n, c, d, h, w = u.shape
    p = od * oh * ow
    data = np.zeros(4 * p, np.float32)
    for i in range(p):
        data[3 * i] = (i % oh) * 1.0 / oh * 2 - 1
        data[3 * i + 1] = (i % ow) * 1.0 / ow * 2 - 1
        data[3 * i + 2] = (i % od) * 1.0 / od * 2 - 1
        data[3 * i + 3] = 1
    grid = data.reshape(p, 4).astype(np.float64)
    v = np.zeros((n, c, p))
    for i in range(n):
        coords = grid @ theta12[i].reshape(3, 4).astype(np.float64).T
        for row in range(p):
            pz, px, py = coords[row]
            z, x, y = (pz + 1) / 3 * d, (px + 1) / 3 * h, (py + 1) / 3 * w
            for l in (np.floor(z), np.floor(z + 1)):
                for m in (np.floor(x), np.floor(x) + 1):
                    for nn in (np.floor(y), np.floor(y) + 1):
                        if 0 <= l < d and 0 <= m < h and 0 <= nn < w:
                            weight = (1 - abs(z - l)) * (1 - abs(x - m)) * (1 - abs(y - nn))
                            v[i, :, row] += weight * u[i, :, int(l), int(m), int(nn)]
    return v.reshape(n, c, od, oh, ow)


@pytest.mark.parametrize("params, out", [("", (5, 7, 6)), ("output_D: 4 output_H: 3 output_W: 5", (4, 3, 5))])
def test_tridim_spatial_transformer(params, out, tmp_path):
    u = rng(4).standard_normal(SHAPE).astype(np.float32)
    theta = (np.tile([0.9, 0.1, 0.0, 0.2, -0.1, 0.8, 0.1, 0.3, 0.05, 0.0, 1.1, 0.4], (2, 1))
             + 0.1 * rng(5).standard_normal((2, 12))).astype(np.float32)
    model = load_from_text(net5(
        f'layer {{ name: "st" type: "TridimSpatialTransformer" bottom: "u" bottom: "theta" top: "v" '
        f'tridim_st_param {{ {params} }} }}', u=SHAPE, theta=(2, 12)))
    ref = tridim_st_ref(u, theta, *out)
    assert model.blob_shapes["v"] == (2, 3) + out
    assert np.abs(ref).max() > 0.1
    check_everywhere(model, {"u": u, "theta": theta}, {"v": ref}, tmp_path, atol=2e-5, rtol=1e-5)


def test_tridim_spatial_transformer_fixed_entries(tmp_path):
    """theta_1_1 and theta_3_4 fixed: bottom 1 fills the other 10 entries in row-major order."""
    u = rng(6).standard_normal(SHAPE).astype(np.float32)
    given = (0.5 * rng(7).standard_normal((2, 10))).astype(np.float32)
    model = load_from_text(net5(
        'layer { name: "st" type: "TridimSpatialTransformer" bottom: "u" bottom: "theta" top: "v" '
        'tridim_st_param { theta_1_1: 0.7 theta_3_4: -0.2 output_D: 3 } }', u=SHAPE, theta=(2, 10)))
    full = np.concatenate([np.full((2, 1), 0.7, np.float32), given, np.full((2, 1), -0.2, np.float32)], 1)
    check_everywhere(model, {"u": u, "theta": given}, {"v": tridim_st_ref(u, full, 3, 7, 6)}, tmp_path,
                     atol=2e-5, rtol=1e-5)


def test_tridim_spatial_transformer_bad_theta():
    with pytest.raises(LayerError, match="gives 6 values per item and tridim_st_param fixes 0"):
        load_from_text(net5('layer { name: "st" type: "TridimSpatialTransformer" bottom: "u" bottom: "theta" '
                            'top: "v" }', u=SHAPE, theta=(2, 6)))
    with pytest.raises(LayerError, match='supports "trilinear" only'):
        load_from_text(net5('layer { name: "st" type: "TridimSpatialTransformer" bottom: "u" bottom: "theta" '
                            'top: "v" tridim_st_param { sampler_type: "bilinear" } }', u=SHAPE, theta=(2, 12)))


# ---- TridimData ---------------------------------------------------------------------------------------

def data_net(param, transform="crop_size: 5"):
    return ('layer { name: "data" type: "TridimData" top: "data" top: "label" '
            f'transform_param {{ {transform} mean_value: 128 }} tridim_data_param {{ source: "l.lst" {param} }} }}\n'
            'layer { name: "p" type: "TridimPooling" bottom: "data" top: "p" '
            'tridim_pooling_param { pool: MAX kernel_size: 2 stride: 2 } }')


@pytest.mark.parametrize("param, transform, data, label", [
    ("new_length: 7 new_height: 9 new_width: 11 batch_size: 2", "crop_size: 5", (2, 3, 7, 5, 5), (2,)),
    ("new_length: 4 new_height: 9 new_width: 11 batch_size: 3", "", (3, 3, 4, 9, 11), (3,)),
    ("new_length: 4 new_height: 9 new_width: 11 use_multiple_label: true num_of_labels: 6", "", (1, 3, 4, 9, 11),
     (1, 6)),
])
def test_tridim_data_shapes(param, transform, data, label):
    model = load_from_text(data_net(param, transform))
    assert model.blob_shapes["data"] == data and model.blob_shapes["label"] == label


def test_tridim_data_bad_parameters():
    with pytest.raises(LayerError, match="tridim_data_param.new_length must be >= 1, got 0"):
        load_from_text(data_net("new_height: 9 new_width: 11"))
    with pytest.raises(LayerError, match="crop_size 12 exceeds the 9x11 frames"):
        load_from_text(data_net("new_length: 3 new_height: 9 new_width: 11", "crop_size: 12"))


# ---- the fork's own nets ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, blob, shape", [
    ("examples__tridim_frgc__train_test1.prototxt", "pool2", (1, 8, 42, 25, 25)),
    ("examples__tristnp3d__train.prototxt", "trist_output", (8, 3, 10, 120, 120)),
    ("examples__tridim_frgc__train.prototxt", "data", (1, 3, 90, 120, 120)),
])
def test_corpus_nets_read(name, blob, shape):
    path = REPO / "tests" / "fixtures" / "realworld" / ("xyyu-callen__caffe-3Dstn__" + name)
    assert load(path).blob_shapes[blob] == shape
