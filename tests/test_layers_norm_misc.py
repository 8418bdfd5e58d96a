"""BatchNorm, LRN, MVN, Softmax, ArgMax, Reduction, Embed, Parameter, Accuracy and the loss layers:
parameter variants the reference cases leave out, against independent numpy formulas."""
import math
import os

import numpy as np
import pytest
import torch
from conftest import check_everywhere, inputs_text

from caffeq.errors import DataError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

FLT_MIN = np.float32(1.1754943508222875e-38)
RNG = np.random.default_rng(1234)


def net(inputs, layers):
    """A prototxt with one Input layer per (name, shape) and the given layer lines."""
    return 'name: "t"\n' + inputs_text(**dict(inputs)) + "\n".join(layers) + "\n"


def build(inputs, layers, blobs=None):
    model = load_from_text(net(inputs, layers), random_weights=True)
    for name, arrays in (blobs or {}).items():
        node = model.graph.node(name)
        node.blobs = [np.asarray(a, np.float32) for a in arrays]
    return model


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _type_of(layer_text):
    return layer_text.split('type: "')[1].split('"')[0]


def close(ours, ref, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(ours, np.float64), np.asarray(ref, np.float64), rtol=rtol, atol=atol)


# ---- BatchNorm --------------------------------------------------------------------------------

def bn_ref(x, mean, var, eps):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)


@pytest.mark.parametrize("factor", [999.98, 1.0, 0.0])
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_batchnorm_global_stats_divide_by_the_factor(factor, eps):
    n, c, h, w = 3, 4, 5, 6
    mean = randn(c) * factor
    var = (RNG.uniform(0.5, 2.0, c) * factor).astype(np.float32)
    model = build([("x", (n, c, h, w))],
                  [f'layer {{ name: "bn" type: "BatchNorm" bottom: "x" top: "y" batch_norm_param {{ eps: {eps} }} }}'],
                  {"bn": [mean, var, [factor]]})
    x = randn(n, c, h, w)
    got = model.run(x)["y"]
    s = 0.0 if factor == 0 else 1.0 / np.float64(factor)   # factor 0 means statistics 0
    close(got, bn_ref(x.astype(np.float64), mean * s, var * s, eps), rtol=2e-5, atol=2e-5)


def test_ctensmeyers_batchnorm2_is_bvlcs_batchnorm():
    # ctensmeyer/caffe's BatchNorm2: BVLC's three blobs and global-statistics forward under another name
    n, c = 2, 3
    mean, var = randn(c) * 10, (RNG.uniform(0.5, 2.0, c) * 10).astype(np.float32)
    model = build([("x", (n, c, 4, 5))], ['layer { name: "bn" type: "BatchNorm2" bottom: "x" top: "x" }'],
                  {"bn": [mean, var, [10.0]]})
    x = randn(n, c, 4, 5)
    close(model.run(x)["x"], bn_ref(x.astype(np.float64), mean / 10.0, var / 10.0, 1e-5), rtol=2e-5, atol=2e-5)


def test_batchnorm_two_axis_input():
    mean, var = randn(5), RNG.uniform(0.5, 2, 5).astype(np.float32)
    model = build([("x", (4, 5))], ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" }'],
                  {"bn": [mean * 2, var * 2, [2.0]]})
    x = randn(4, 5)
    close(model.run(x)["x"], bn_ref(x.astype(np.float64), mean, var, 1e-5), rtol=1e-5, atol=1e-5)


def test_batchnorm_explicit_batch_statistics_at_test():
    # use_global_stats: false at TEST: the batch's own mean and biased variance, no update
    n, c, h, w = 2, 3, 4, 5
    blobs = [randn(c), np.ones(c, np.float32), np.ones(1, np.float32)]
    model = build([("x", (n, c, h, w))],
                  ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                   'batch_norm_param { use_global_stats: false eps: 0.001 } }'], {"bn": blobs})
    x = randn(n, c, h, w) * 3 + 1
    xd = x.astype(np.float64)
    m = xd.mean(axis=(0, 2, 3))
    v = xd.var(axis=(0, 2, 3))
    close(model.run(x)["y"], bn_ref(xd, m, v, 1e-3), rtol=1e-5, atol=1e-5)
    assert np.array_equal(model.graph.node("bn").blobs[0], blobs[0])


@pytest.mark.parametrize("layer_phase", ["TRAIN", "PREDICT"])
def test_batchnorm_with_its_own_phase_uses_batch_statistics_in_a_test_net(layer_phase, tmp_path):
    # Caffe's Net::Init keeps a layer's own `phase` and BatchNorm's default (use_global_stats_ = phase == TEST)
    # follows it: Vitis AI's deploy files (phase: TRAIN) and caffe_nd's (phase: PREDICT) normalize each batch by
    # its own statistics; use_global_stats, when given, still decides
    n, c, h, w = 2, 3, 4, 5
    blobs = [randn(c) * 5, np.full(c, 4.0, np.float32), np.ones(1, np.float32)]
    model = build([("x", (n, c, h, w))],
                  [f'layer {{ name: "bn" type: "BatchNorm" bottom: "x" top: "y" phase: {layer_phase} }}'],
                  {"bn": blobs})
    x = randn(n, c, h, w) * 3 + 1
    xd = x.astype(np.float64)
    ref = bn_ref(xd, xd.mean(axis=(0, 2, 3)), xd.var(axis=(0, 2, 3)), 1e-5)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-5)
    assert any(f"phase: {layer_phase} on the layer" in note for note in model.warnings)
    stored = build([("x", (n, c, h, w))],
                   [f'layer {{ name: "bn" type: "BatchNorm" bottom: "x" top: "y" phase: {layer_phase} '
                    'batch_norm_param { use_global_stats: true } }'], {"bn": blobs})
    close(stored.run(x)["y"], bn_ref(xd, blobs[0], blobs[1], 1e-5), rtol=2e-5, atol=2e-5)
    assert not stored.warnings
    test_phase = build([("x", (n, c, h, w))], ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" phase: TEST }'],
                       {"bn": blobs})
    close(test_phase.run(x)["y"], bn_ref(xd, blobs[0], blobs[1], 1e-5), rtol=2e-5, atol=2e-5)


def test_batchnorm_training_updates_running_blobs_as_caffe():
    n, c, h, w = 3, 4, 5, 2
    maf = 0.9
    mean0, var0, f0 = randn(c), RNG.uniform(1, 2, c).astype(np.float32), np.float32(7.0)
    model = build([("x", (n, c, h, w))],
                  [f'layer {{ name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                   f'batch_norm_param {{ moving_average_fraction: {maf} }} }}'],
                  {"bn": [mean0, var0, [f0]]})
    gm = model.to_torch()
    gm.train()
    xs = [randn(n, c, h, w) * 2 + 0.5 for _ in range(2)]
    mean, var, f = mean0.astype(np.float64), var0.astype(np.float64), np.float64(f0)
    m = n * h * w
    for x in xs:
        xt = torch.from_numpy(x).requires_grad_(True)
        y = gm(xt)
        xd = x.astype(np.float64)
        bm, bv = xd.mean(axis=(0, 2, 3)), xd.var(axis=(0, 2, 3))
        close(y.detach().numpy(), bn_ref(xd, bm, bv, 1e-5), rtol=1e-5, atol=1e-5)
        # Caffe: blob = blob * maf + batch value; variance with the m/(m-1) correction; factor * maf + 1
        mean = mean * maf + bm
        var = var * maf + bv * m / (m - 1)
        f = f * maf + 1
        y.sum().backward()  # the gradient flows through the batch statistics
        assert xt.grad is not None and np.isfinite(xt.grad.numpy()).all()
        close(xt.grad.numpy(), np.zeros_like(x), atol=1e-4)  # d(sum of normalized)/dx = 0
    bn = gm.bn
    close(bn.mean.numpy(), mean, rtol=1e-5, atol=1e-5)
    close(bn.variance.numpy(), var, rtol=1e-5, atol=1e-5)
    close(bn.factor.numpy(), [f], rtol=1e-6)
    assert not bn.mean.requires_grad
    # back in eval mode, the updated blobs are the statistics
    gm.eval()
    with torch.no_grad():
        y = gm(torch.from_numpy(xs[0])).numpy()
    close(y, bn_ref(xs[0].astype(np.float64), mean / f, var / f, 1e-5), rtol=1e-5, atol=1e-5)


def test_batchnorm_global_stats_true_stays_global_in_training():
    c = 3
    blobs = [randn(c), np.full(c, 4.0, np.float32), np.ones(1, np.float32)]
    model = build([("x", (2, c, 3, 3))],
                  ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                   'batch_norm_param { use_global_stats: true } }'], {"bn": blobs})
    gm = model.to_torch()
    gm.train()
    x = randn(2, c, 3, 3)
    close(gm(torch.from_numpy(x)).detach().numpy(), bn_ref(x.astype(np.float64), blobs[0], blobs[1], 1e-5),
          rtol=1e-5, atol=1e-5)
    assert np.array_equal(gm.bn.mean.numpy(), blobs[0])


def test_batchnorm_nvcaffe_scale_bias_has_five_blobs():
    c = 3
    mean, var = randn(c), RNG.uniform(0.5, 2, c).astype(np.float32)
    scale, bias = randn(c), randn(c)
    model = build([("x", (2, c, 4, 5))],
                  ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                   'batch_norm_param { scale_bias: true eps: 1e-7 } }'],
                  {"bn": [mean, var, [1.0], scale, bias]})
    assert model.graph.node("bn").expected_param_shapes == [(c,), (c,), (1,), (c,), (c,)]
    x = randn(2, c, 4, 5)
    # NVCaffe clamps eps to >= 1e-5 and uses the mean/variance blobs as they are
    ref = bn_ref(x.astype(np.float64), mean, var, 1e-5) * scale.reshape(1, -1, 1, 1) + bias.reshape(1, -1, 1, 1)
    close(model.run(x)["y"], ref, rtol=1e-5, atol=1e-5)


def test_batchnorm_random_init_is_identity_statistics():
    model = load_from_text(net([("x", (2, 3, 4, 4))],
                               ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" }']),
                           random_weights=True)
    mean, var, f = model.graph.node("bn").blobs
    assert (mean == 0).all() and (var == 1).all() and f[0] == 1


# ---- LRN ----------------------------------------------------------------------------------------

def lrn_across_ref(x, n, alpha, beta, k):
    x = x.astype(np.float64)
    c = x.shape[1]
    pad = (n - 1) // 2
    y = np.empty_like(x)
    for ch in range(c):
        lo, hi = max(0, ch - pad), min(c, ch + pad + 1)
        s = (x[:, lo:hi] ** 2).sum(axis=1)
        y[:, ch] = x[:, ch] * (k + alpha / n * s) ** -beta
    return y


def lrn_within_ref(x, n, alpha, beta):
    x = x.astype(np.float64)
    _, _, h, w = x.shape
    pad = (n - 1) // 2
    y = np.empty_like(x)
    for i in range(h):
        for j in range(w):
            win = x[:, :, max(0, i - pad):min(h, i + pad + 1), max(0, j - pad):min(w, j + pad + 1)]
            avg = (win ** 2).sum(axis=(2, 3)) / (n * n)  # padding counts in the divisor
            y[:, :, i, j] = x[:, :, i, j] * (1 + alpha * avg) ** -beta
    return y


@pytest.mark.parametrize("n,alpha,beta,k", [(3, 0.3, 0.75, 2.5), (5, 1e-2, 0.6, 0.5), (1, 2.0, 1.0, 1.0),
                                            (9, 0.7, 0.5, 1.5)])
def test_lrn_across_channels(n, alpha, beta, k):
    x = randn(2, 7, 5, 3) * 2
    model = build([("x", x.shape)], [f'layer {{ name: "lrn" type: "LRN" bottom: "x" top: "y" lrn_param {{ '
                                     f'local_size: {n} alpha: {alpha} beta: {beta} k: {k} }} }}'])
    close(model.run(x)["y"], lrn_across_ref(x, n, alpha, beta, k), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,alpha,beta", [(3, 0.9, 0.6), (5, 2.0, 0.75)])
def test_lrn_within_channel_ignores_k(n, alpha, beta):
    x = randn(3, 2, 6, 4) * 2  # the 5x5 window is wider than the 4 columns
    model = build([("x", x.shape)], [f'layer {{ name: "lrn" type: "LRN" bottom: "x" top: "y" lrn_param {{ '
                                     f'local_size: {n} alpha: {alpha} beta: {beta} k: 7 '
                                     f'norm_region: WITHIN_CHANNEL }} }}'])
    close(model.run(x)["y"], lrn_within_ref(x, n, alpha, beta), rtol=1e-5, atol=1e-6)


# ---- MVN ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variance,across", [(True, False), (False, False), (False, True), (True, True)])
def test_mvn_variants(variance, across):
    x = randn(2, 3, 4, 5) * 3 + 2
    eps = 0.05
    model = build([("x", x.shape)], [f'layer {{ name: "mvn" type: "MVN" bottom: "x" top: "y" mvn_param {{ '
                                     f'normalize_variance: {str(variance).lower()} '
                                     f'across_channels: {str(across).lower()} eps: {eps} }} }}'])
    xd = x.astype(np.float64)
    axes = (1, 2, 3) if across else (2, 3)
    ref = xd - xd.mean(axis=axes, keepdims=True)
    if variance:
        ref = ref / (np.sqrt((ref ** 2).mean(axis=axes, keepdims=True)) + eps)  # eps on the std
    close(model.run(x)["y"], ref, rtol=1e-5, atol=1e-5)


def test_mvn_top_has_caffes_legacy_four_axes():
    x = randn(3, 6)
    model = build([("x", x.shape)], ['layer { name: "mvn" type: "MVN" bottom: "x" top: "y" }'])
    assert model.blob_shapes["y"] == (3, 6, 1, 1)
    y = model.run(x)["y"]
    assert y.shape == (3, 6, 1, 1)
    close(y, np.zeros((3, 6, 1, 1)), atol=1e-6)  # one value per (item, channel): centred to 0
    model = build([("x", x.shape)], ['layer { name: "mvn" type: "MVN" bottom: "x" top: "y" '
                                     'mvn_param { across_channels: true } }'])
    xd = x.astype(np.float64)
    ref = (xd - xd.mean(1, keepdims=True)) / (xd.std(1, keepdims=True) + 1e-9)
    close(model.run(x)["y"], ref.reshape(3, 6, 1, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, axis, variance", [((2, 3, 4, 5, 2), 2, True), ((2, 3, 4, 5, 2), 1, False),
                                                   ((3, 4, 5), 3, True)])
def test_mvn_nd_normalizes_from_its_axis_and_keeps_the_shape(shape, axis, variance, tmp_path):
    # antran89/my-very-deep-caffe's MVN_ND (two-stream-fcan's attention maps over 5-axis C3D blobs)
    x = randn(*shape) * 3 + 2
    model = build([("x", shape)], [f'layer {{ name: "mvn" type: "MVN_ND" bottom: "x" top: "y" mvn_param {{ '
                                   f'axis: {axis} normalize_variance: {str(variance).lower()} eps: 0.05 }} }}'])
    assert model.blob_shapes["y"] == shape
    xd = x.astype(np.float64)
    axes = tuple(range(axis, len(shape)))
    ref = xd - xd.mean(axis=axes, keepdims=True) if axes else np.zeros_like(xd)
    if variance and axes:
        ref = ref / (np.sqrt((ref ** 2).mean(axis=axes, keepdims=True)) + 0.05)
    check_everywhere(model, {"x": x}, {"y": ref.astype(np.float32)}, tmp_path, atol=1e-5, rtol=1e-5)


# ---- Softmax --------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-1, 0, 2])
def test_softmax_axis(axis):
    x = randn(2, 3, 5) * 4
    model = build([("x", x.shape)], [f'layer {{ name: "sm" type: "Softmax" bottom: "x" top: "y" '
                                     f'softmax_param {{ axis: {axis} }} }}'])
    xd = x.astype(np.float64)
    e = np.exp(xd - xd.max(axis=axis, keepdims=True))
    close(model.run(x)["y"], e / e.sum(axis=axis, keepdims=True), rtol=1e-5, atol=1e-7)


# ---- ArgMax ---------------------------------------------------------------------------------------

def caffe_topk_ref(values, k):
    """std::partial_sort with std::greater over (value, index) pairs."""
    pairs = sorted(((float(v), j) for j, v in enumerate(values)), reverse=True)[:k]
    return [j for _, j in pairs], [v for v, _ in pairs]


def test_argmax_ties_take_the_highest_index_first():
    x = RNG.integers(0, 3, size=(3, 2, 4, 3)).astype(np.float32)  # many ties
    for k, with_val in [(1, False), (4, False), (5, True), (24, True)]:
        model = build([("x", x.shape)], [f'layer {{ name: "am" type: "ArgMax" bottom: "x" top: "y" '
                                         f'argmax_param {{ top_k: {k} out_max_val: {str(with_val).lower()} }} }}'])
        y = model.run(x)["y"]
        assert y.shape == (3, 2 if with_val else 1, k, 1)
        for i in range(3):
            idx, vals = caffe_topk_ref(x[i].reshape(-1), k)
            assert y[i, 0, :, 0].tolist() == idx
            if with_val:
                assert y[i, 1, :, 0].tolist() == vals


@pytest.mark.parametrize("axis", [1, 2, -1])
def test_argmax_along_axis_with_ties(axis):
    x = RNG.integers(0, 2, size=(2, 5, 4, 3)).astype(np.float32)
    k = 2
    for with_val in (False, True):
        model = build([("x", x.shape)], [f'layer {{ name: "am" type: "ArgMax" bottom: "x" top: "y" '
                                         f'argmax_param {{ top_k: {k} axis: {axis} '
                                         f'out_max_val: {str(with_val).lower()} }} }}'])
        y = model.run(x)["y"]
        ax = axis % 4
        xm = np.moveaxis(x, ax, -1)
        ym = np.moveaxis(y, ax, -1)
        for pos in np.ndindex(*xm.shape[:-1]):
            idx, vals = caffe_topk_ref(xm[pos], k)
            assert ym[pos].tolist() == (vals if with_val else idx)


def test_argmax_two_axis_input_gets_three_axes():
    x = randn(4, 7)
    model = build([("x", x.shape)], ['layer { name: "am" type: "ArgMax" bottom: "x" top: "y" }'])
    y = model.run(x)["y"]
    assert y.shape == (4, 1, 1)
    assert y[:, 0, 0].tolist() == x.argmax(1).tolist()


# ---- Reduction ------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("axis", [0, 1, 3])
def test_reduction_ops(op, axis):
    x = randn(2, 3, 4, 5)
    coeff = -1.5
    model = build([("x", x.shape)], [f'layer {{ name: "r" type: "Reduction" bottom: "x" top: "y" '
                                     f'reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }} }}'])
    flat = x.astype(np.float64).reshape(x.shape[:axis] + (-1,))
    f = {"SUM": flat, "ASUM": np.abs(flat), "SUMSQ": flat ** 2, "MEAN": flat / flat.shape[-1]}[op]
    ref = f.sum(-1) * coeff
    y = model.run(x)["y"]
    assert y.shape == x.shape[:axis]
    close(y, ref, rtol=1e-5, atol=1e-5)


# ---- Embed and Parameter --------------------------------------------------------------------------

def test_embed_without_bias_and_truncated_indices():
    w = randn(10, 4)
    model = build([("ids", (2, 3))], ['layer { name: "emb" type: "Embed" bottom: "ids" top: "y" embed_param { '
                                      'num_output: 4 input_dim: 10 bias_term: false } }'], {"emb": [w]})
    ids = np.array([[0, 9, 3], [3.7, 5, 1]], np.float32)  # Caffe's static_cast<int> truncates 3.7 to 3
    y = model.run(ids)["y"]
    close(y, w[ids.astype(np.int64)], rtol=0, atol=0)
    assert y.shape == (2, 3, 4)


def test_embed_of_a_unit_last_axis_reads_as_bottom_up_attention_where_the_net_needs_it(tmp_path):
    # peteanderson80/bottom-up-attention's test nets: ArgMax (axis 1) gives (R, 1), its Embed gives (R, E)
    # (a last axis of 1 replaced), which the Concat with fc7 (R, F) needs; BVLC's (R, 1, E) does not fit
    from conftest import check_everywhere
    w, b = randn(6, 3), randn(3)
    layers = ['layer { name: "am" type: "ArgMax" bottom: "score" top: "cls" argmax_param { axis: 1 } }',
              'layer { name: "emb" type: "Embed" bottom: "cls" top: "e" embed_param { num_output: 3 input_dim: 6 } }',
              'layer { name: "cat" type: "Concat" bottom: "fc7" bottom: "e" top: "y" }']
    model = build([("score", (4, 6)), ("fc7", (4, 5))], layers, {"emb": [w, b]})
    assert model.blob_shapes["e"] == (4, 3) and model.blob_shapes["y"] == (4, 8)
    assert any("Embed layers replace their indexes' last axis of size 1 by num_output, as bottom-up-attention's "
               "Caffe does" in note and "'emb' showed it" in note for note in model.warnings)
    score, fc7 = randn(4, 6), randn(4, 5)
    ref = np.concatenate([fc7, w[score.argmax(1)] + b], axis=1)
    check_everywhere(model, {"score": score, "fc7": fc7}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)
    # an unrolled decoder (Up-Down-Captioner's, one Embed per step): every Embed of the net reads the fork's way
    steps = layers + ['layer { name: "emb2" type: "Embed" bottom: "cls" top: "e2" embed_param { num_output: 3 '
                      'input_dim: 6 } }', 'layer { name: "cat2" type: "Concat" bottom: "y" bottom: "e2" top: "y2" }']
    unrolled = build([("score", (4, 6)), ("fc7", (4, 5))], steps, {"emb": [w, b], "emb2": [w, b]})
    assert unrolled.blob_shapes["y2"] == (4, 11)
    # the BVLC reading stays wherever the net fits it
    bvlc = build([("score", (4, 6))], layers[:2])
    assert bvlc.blob_shapes["e"] == (4, 1, 3) and not any("bottom-up" in note for note in bvlc.warnings)


def test_embed_index_out_of_range_is_a_data_error():
    model = build([("ids", (1, 2))], ['layer { name: "emb" type: "Embed" bottom: "ids" top: "y" embed_param { '
                                      'num_output: 2 input_dim: 4 } }'])
    with pytest.raises(DataError, match="outside"):
        model.run(np.array([[1, 4]], np.float32))


def test_parameter_outputs_its_blob_and_learns():
    p = randn(2, 3)
    model = build([], ['layer { name: "p" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: 3 } } }'],
                  {"p": [p]})
    gm = model.to_torch()
    out = gm()
    close(out.detach().numpy(), p, rtol=0, atol=0)
    (out * 2).sum().backward()
    close(gm.p.weight.grad.numpy(), np.full((2, 3), 2.0))


# ---- Accuracy ------------------------------------------------------------------------------------------

def accuracy_ref(scores, labels, top_k, ignore=None, axis=1):
    s = np.moveaxis(scores, axis, -1).reshape(-1, scores.shape[axis])
    lab = labels.reshape(-1).astype(np.int64)
    c = scores.shape[axis]
    hits, total = 0, 0
    per_hit, per_total = np.zeros(c), np.zeros(c)
    for row, label in zip(s, lab):
        if ignore is not None and label == ignore:
            continue
        better = int((row >= row[label]).sum()) - 1  # ties count as better, as in accuracy_layer.cpp
        total += 1
        per_total[label] += 1
        if better < top_k:
            hits += 1
            per_hit[label] += 1
    acc = hits / total if total else 0.0
    per = np.where(per_total > 0, per_hit / np.maximum(per_total, 1), 0)
    return acc, per


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_accuracy_with_ignore_label_ties_and_per_class_top(top_k):
    n, c = 40, 5
    scores = RNG.integers(0, 3, size=(n, c)).astype(np.float32)  # ties on purpose
    labels = RNG.integers(0, c, size=n).astype(np.float32)
    labels[::7] = 255
    model = build([("s", (n, c)), ("l", (n,))],
                  [f'layer {{ name: "acc" type: "Accuracy" bottom: "s" bottom: "l" top: "a" top: "per" '
                   f'accuracy_param {{ top_k: {top_k} ignore_label: 255 }} }}'])
    out = model.run({"s": scores, "l": labels})
    acc, per = accuracy_ref(scores, labels, top_k, ignore=255)
    assert out["a"].shape == () and out["per"].shape == (c,)
    close(out["a"], acc, rtol=1e-6)
    close(out["per"], per, rtol=1e-6)


def test_accuracy_per_pixel_along_axis_1():
    scores = randn(2, 4, 3, 5)
    labels = RNG.integers(0, 4, size=(2, 1, 3, 5)).astype(np.float32)
    model = build([("s", scores.shape), ("l", labels.shape)],
                  ['layer { name: "acc" type: "Accuracy" bottom: "s" bottom: "l" top: "a" }'])
    acc, _ = accuracy_ref(scores, np.moveaxis(labels, 1, -1), 1)
    close(model.run({"s": scores, "l": labels})["a"], acc, rtol=1e-6)


def test_accuracy_all_ignored_is_zero():
    model = build([("s", (3, 2)), ("l", (3,))],
                  ['layer { name: "acc" type: "Accuracy" bottom: "s" bottom: "l" top: "a" '
                   'accuracy_param { ignore_label: -1 } }'])
    assert float(model.run({"s": randn(3, 2), "l": np.full(3, -1, np.float32)})["a"]) == 0.0


# ---- SoftmaxWithLoss and the other losses -----------------------------------------------------------

def softmax_np(x, axis):
    x = x.astype(np.float32)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_loss_ref(scores, labels, mode, ignore=None):
    prob = np.moveaxis(softmax_np(scores, 1), 1, -1)
    outer, inner = scores.shape[0], int(np.prod(scores.shape[2:]))
    prob = prob.reshape(outer, inner, -1)
    lab = labels.reshape(outer, inner).astype(np.int64)
    loss, valid = 0.0, 0
    for i in range(outer):
        for j in range(inner):
            if ignore is not None and lab[i, j] == ignore:
                continue
            loss -= np.log(max(prob[i, j, lab[i, j]], FLT_MIN))
            valid += 1
    norm = {"FULL": outer * inner, "VALID": valid, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return loss / max(1, norm)


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE", "legacy_true", "legacy_false"])
def test_softmax_loss_normalization_modes(mode):
    scores = randn(3, 4, 2, 5) * 2
    labels = RNG.integers(0, 4, size=(3, 1, 2, 5)).astype(np.float32)
    labels[0, 0, 1, :3] = 7
    if mode.startswith("legacy"):
        loss_param = f"normalize: {mode.split('_')[1]}"
        ref_mode = "VALID" if mode == "legacy_true" else "BATCH_SIZE"
    else:
        loss_param, ref_mode = f"normalization: {mode}", mode
    model = build([("s", scores.shape), ("l", labels.shape)],
                  [f'layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" top: "prob" '
                   f'loss_param {{ ignore_label: 7 {loss_param} }} }}'])
    out = model.run({"s": scores, "l": labels})
    close(out["loss"], softmax_loss_ref(scores, labels, ref_mode, ignore=7), rtol=1e-5)
    close(out["prob"], softmax_np(scores, 1), rtol=1e-5, atol=1e-7)


def test_rfcn_softmax_loss_third_top_is_each_positions_loss():
    # daijifeng001/caffe-rfcn: top[2] shaped like the labels, -log(max(prob, FLT_MIN)), 0 where ignored
    scores = randn(3, 4, 2, 5) * 2
    labels = RNG.integers(0, 4, size=(3, 1, 2, 5)).astype(np.float32)
    labels[1, 0, 0, :2] = 7
    model = build([("s", scores.shape), ("l", labels.shape)],
                  ['layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" top: "prob" '
                   'top: "each" loss_weight: 0 loss_weight: 0 loss_weight: 0 loss_param { ignore_label: 7 } }'])
    assert model.blob_shapes["each"] == labels.shape
    out = model.run({"s": scores, "l": labels})
    prob = softmax_np(scores, 1)
    want = np.zeros(labels.shape, np.float64)
    for i, _, h, w in np.ndindex(*labels.shape):
        if labels[i, 0, h, w] != 7:
            want[i, 0, h, w] = -np.log(max(prob[i, int(labels[i, 0, h, w]), h, w], FLT_MIN))
    close(out["each"], want, rtol=1e-5, atol=1e-6)
    close(out["loss"], softmax_loss_ref(scores, labels, "VALID", ignore=7), rtol=1e-5)


@pytest.mark.parametrize("normalize, zero_weights", [("true", False), ("false", False), ("true", True)])
def test_weighted_softmax_loss_of_faster_rcnn_matlab_caffe(normalize, zero_weights):
    # ShaoqingRen/caffe faster-R-CNN: bottom 2 weighs each position (SDS-RCNN's labels_weights); normalize
    # divides by the weights' sum (0 when it is 0), else by the outer count
    scores = randn(3, 4, 2, 5) * 2
    labels = RNG.integers(0, 4, size=(3, 1, 2, 5)).astype(np.float32)
    labels[2, 0, 1, :2] = 7
    weights = np.zeros(labels.shape, np.float32) if zero_weights else RNG.random(labels.shape).astype(np.float32)
    model = build([("s", scores.shape), ("l", labels.shape), ("w", labels.shape)],
                  ['layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" bottom: "w" top: "loss" '
                   f'loss_param {{ ignore_label: 7 normalize: {normalize} }} }}'])
    prob = softmax_np(scores, 1)
    total, wsum = 0.0, 0.0
    for i, _, h, w in np.ndindex(*labels.shape):
        if labels[i, 0, h, w] == 7:
            continue
        total -= weights[i, 0, h, w] * np.log(max(prob[i, int(labels[i, 0, h, w]), h, w], FLT_MIN))
        wsum += weights[i, 0, h, w]
    want = (0.0 if wsum == 0 else total / wsum) if normalize == "true" else total / 3
    close(model.run({"s": scores, "l": labels, "w": weights})["loss"], want, rtol=1e-5, atol=1e-7)


def test_weighted_softmax_loss_needs_weights_shaped_as_the_labels():
    with pytest.raises(LayerError, match="weights .bottom 2. must be shaped as the labels"):
        build([("s", (3, 4)), ("l", (3,)), ("w", (4,))],
              ['layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" bottom: "w" top: "loss" }'])


def test_softmax_loss_clamps_like_caffe_and_backpropagates_prob_minus_one():
    scores = np.array([[0.0, 100.0, 0.0], [1.0, 2.0, 3.0]], np.float32)
    labels = np.array([0, 2], np.float32)
    model = build([("s", (2, 3)), ("l", (2,))],
                  ['layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" '
                   'loss_weight: 2 }'])
    assert model.graph.node("loss").attrs["loss_weight"] == [2.0]
    gm = model.to_torch()
    s = torch.from_numpy(scores).requires_grad_(True)
    loss = gm(s, torch.from_numpy(labels))
    # prob of the first item's label underflows float32: Caffe takes log(FLT_MIN)
    ref = softmax_loss_ref(scores, labels, "VALID")
    close(loss.detach().numpy(), ref, rtol=1e-6)
    assert abs(loss.item() - (-math.log(FLT_MIN) + -math.log(softmax_np(scores, 1)[1, 2])) / 2) < 1e-4
    loss.backward()
    grad = softmax_np(scores, 1)
    grad[[0, 1], [0, 2]] -= 1
    close(s.grad.numpy(), grad / 2, rtol=1e-5, atol=1e-7)


def test_sigmoid_cross_entropy_loss():
    x = randn(4, 3, 2) * 3
    t = RNG.integers(0, 2, size=(4, 6)).astype(np.float32)
    t[1, 2] = -1
    xd, td = x.reshape(4, 6).astype(np.float64), t.astype(np.float64)
    per = -(td * np.log(1 / (1 + np.exp(-xd))) + (1 - td) * np.log(1 - 1 / (1 + np.exp(-xd))))
    valid = td != -1
    for extra, norm in [("", 4), ("loss_param { ignore_label: -1 normalization: VALID }", valid.sum())]:
        model = build([("x", x.shape), ("t", t.shape)],
                      [f'layer {{ name: "l" type: "SigmoidCrossEntropyLoss" bottom: "x" bottom: "t" top: "l" '
                       f'{extra} }}'])
        total = per[valid].sum() if extra else per.sum()
        close(model.run({"x": x, "t": t})["l"], total / norm, rtol=1e-5)


def test_euclidean_hinge_multinomial_losses():
    a, b = randn(5, 3), randn(5, 3, 1, 1)
    model = build([("a", a.shape), ("b", b.shape)],
                  ['layer { name: "l" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "l" }'])
    close(model.run({"a": a, "b": b})["l"], ((a - b.reshape(5, 3)) ** 2).sum() / 5 / 2, rtol=1e-5)

    x, lab = randn(6, 4), RNG.integers(0, 4, size=6).astype(np.float32)
    sign = np.ones((6, 4))
    sign[np.arange(6), lab.astype(int)] = -1
    margin = np.maximum(0, 1 + x * sign)
    for norm, ref in [("L1", margin.sum() / 6), ("L2", (margin ** 2).sum() / 6)]:
        model = build([("x", x.shape), ("y", lab.shape)],
                      [f'layer {{ name: "l" type: "HingeLoss" bottom: "x" bottom: "y" top: "l" '
                       f'hinge_loss_param {{ norm: {norm} }} }}'])
        close(model.run({"x": x, "y": lab})["l"], ref, rtol=1e-5)

    p = softmax_np(randn(6, 4), 1)
    p[0, int(lab[0])] = 0  # clamped at 1e-20
    model = build([("p", p.shape), ("y", lab.shape)],
                  ['layer { name: "l" type: "MultinomialLogisticLoss" bottom: "p" bottom: "y" top: "l" }'])
    ref = -np.log(np.maximum(p[np.arange(6), lab.astype(int)].astype(np.float64), 1e-20)).sum() / 6
    close(model.run({"p": p, "y": lab})["l"], ref, rtol=1e-5)


def test_infogain_loss_with_h_bottom():
    x, lab = randn(3, 4, 2), RNG.integers(0, 4, size=(3, 2)).astype(np.float32)
    h = RNG.uniform(0, 1, size=(4, 4)).astype(np.float32)
    model = build([("x", x.shape), ("y", lab.shape), ("h", (1, 1, 4, 4))],
                  ['layer { name: "l" type: "InfogainLoss" bottom: "x" bottom: "y" bottom: "h" top: "l" }'])
    prob = softmax_np(x, 1).astype(np.float64)
    loss = 0.0
    for i in range(3):
        for j in range(2):
            label = int(lab[i, j])
            loss -= (h[label] * np.log(np.maximum(prob[i, :, j], 1e-20))).sum()
    close(model.run({"x": x, "y": lab, "h": h.reshape(1, 1, 4, 4)})["l"], loss / 6, rtol=1e-5)


def test_infogain_loss_reads_h_from_its_source_and_reads_the_net_without_it(tmp_path, monkeypatch):
    """infogain_loss_param.source: a BlobProto opened from the working directory, as Caffe does; a train
    net whose H file is not here still reads (the loss is training only), and the loss then says why it
    cannot be computed."""
    from caffeq.io.writer import write_blobproto
    x, lab = randn(3, 4), RNG.integers(0, 4, size=(3,)).astype(np.float32)
    h = RNG.uniform(0, 1, size=(4, 4)).astype(np.float32)
    monkeypatch.chdir(tmp_path)
    layer = ('layer { name: "l" type: "InfogainLoss" bottom: "x" bottom: "y" top: "l" '
             'infogain_loss_param { source: "h.binaryproto" } }')
    missing = build([("x", x.shape), ("y", lab.shape)], [layer])
    assert any("its H matrix infogain_loss_param.source 'h.binaryproto' is not here" in w for w in missing.warnings)
    with pytest.raises(LayerError, match=r"layer 'l' \(InfogainLoss\): its H matrix .*'h.binaryproto' is not here"):
        missing.run({"x": x, "y": lab})
    write_blobproto(h.reshape(1, 1, 4, 4), str(tmp_path / "h.binaryproto"))
    prob = softmax_np(x, 1).astype(np.float64)
    ref = -sum((h[int(lab[i])] * np.log(prob[i])).sum() for i in range(3)) / 3
    close(build([("x", x.shape), ("y", lab.shape)], [layer]).run({"x": x, "y": lab})["l"], ref, rtol=1e-5)


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_loss(legacy):
    a, b = randn(6, 3), randn(6, 3)
    y = np.array([1, 0, 1, 0, 0, 1], np.float32)
    margin = 2.0
    model = build([("a", a.shape), ("b", b.shape), ("y", y.shape)],
                  [f'layer {{ name: "l" type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "y" top: "l" '
                   f'contrastive_loss_param {{ margin: {margin} legacy_version: {str(legacy).lower()} }} }}'])
    d2 = ((a.astype(np.float64) - b) ** 2).sum(1)
    far = np.maximum(margin - d2, 0) if legacy else np.maximum(margin - np.sqrt(d2), 0) ** 2
    ref = np.where(y == 1, d2, far).sum() / 6 / 2
    close(model.run({"a": a, "b": b, "y": y})["l"], ref, rtol=1e-5)


def test_training_only_flags():
    from caffeq.layers import get_spec
    for t in ("Accuracy", "SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss", "HingeLoss",
              "MultinomialLogisticLoss", "InfogainLoss", "ContrastiveLoss"):
        assert get_spec(t).is_training_only, t
    for t in ("BatchNorm", "LRN", "MVN", "Softmax", "ArgMax", "Reduction", "Embed", "Parameter"):
        assert not get_spec(t).is_training_only, t


# ---- bad parameters --------------------------------------------------------------------------------

BAD = [
    ([("x", (1, 3, 4, 4))], 'layer { name: "bad" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 4 } }',
     "local_size"),
    ([("x", (1, 3, 4))], 'layer { name: "bad" type: "LRN" bottom: "x" top: "y" }', "4-axis"),
    ([("x", (1, 3, 4, 4))], 'layer { name: "bad" type: "ArgMax" bottom: "x" top: "y" argmax_param { top_k: 49 } }',
     "top_k"),
    ([("x", (1, 3, 4, 4))], 'layer { name: "bad" type: "ArgMax" bottom: "x" top: "y" '
     'argmax_param { top_k: 4 axis: 1 } }', "top_k"),
    ([("x", (1, 3, 4, 4))], 'layer { name: "bad" type: "ArgMax" bottom: "x" top: "y" argmax_param { axis: 4 } }',
     "axis"),
    ([("x", (1, 3))], 'layer { name: "bad" type: "Reduction" bottom: "x" top: "y" reduction_param { axis: 2 } }',
     "axis"),
    ([("x", (1, 3))], 'layer { name: "bad" type: "Softmax" bottom: "x" top: "y" softmax_param { axis: -3 } }',
     "axis"),
    ([("x", (2, 3))], 'layer { name: "bad" type: "Embed" bottom: "x" top: "y" embed_param { num_output: 3 } }',
     "input_dim"),
    ([("x", (1, 2, 3, 4, 5))], 'layer { name: "bad" type: "MVN" bottom: "x" top: "y" }', "4 axes"),
    ([("x", (1, 2, 3, 3))], 'layer { name: "bad" type: "BatchNorm" bottom: "x" top: "y" '
     'batch_norm_param { eps: -1 } }', "eps"),
    ([("s", (4, 3)), ("l", (4,))], 'layer { name: "bad" type: "Accuracy" bottom: "s" bottom: "l" top: "a" '
     'accuracy_param { top_k: 4 } }', "top_k"),
    ([("s", (4, 3)), ("l", (5,))], 'layer { name: "bad" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "a" }',
     "first dimension"),
    ([("s", (4, 3, 2)), ("l", (4, 3))], 'layer { name: "bad" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" '
     'top: "a" }', "labels"),
    ([("s", (4, 3)), ("l", (4,))], 'layer { name: "bad" type: "InfogainLoss" bottom: "s" bottom: "l" top: "a" }',
     "source"),
    ([("s", (4, 3)), ("l", (4,))], 'layer { name: "bad" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "a" '
     'top: "b" top: "c" top: "d" }', "top"),   # R-FCN's fork has a third top; nobody a fourth
    ([("s", (4, 3)), ("l", (4, 3))], 'layer { name: "bad" type: "EuclideanLoss" bottom: "s" top: "a" }', "bottom"),
    ([], 'layer { name: "bad" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: -1 } } }',
     "negative"),
]


@pytest.mark.parametrize("inputs,layer,needle", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_parameters_raise_layer_error(inputs, layer, needle):
    with pytest.raises(LayerError) as info:
        load_from_text(net(inputs, [layer]), random_weights=True)
    msg = str(info.value)
    assert "layer 'bad'" in msg and needle in msg, msg
    assert "\n" not in msg


def test_label_out_of_range_is_a_data_error():
    model = build([("s", (2, 3)), ("l", (2,))],
                  ['layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" }'])
    with pytest.raises(DataError, match="label 3"):
        model.run({"s": randn(2, 3), "l": np.array([0, 3], np.float32)})


# ---- gradients ----------------------------------------------------------------------------------------

GRAD_NETS = [
    ([("x", (2, 5, 3, 4))], 'layer { name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 3 '
     'alpha: 0.5 k: 2 } }'),
    ([("x", (2, 3, 5, 4))], 'layer { name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 3 '
     'alpha: 0.5 norm_region: WITHIN_CHANNEL } }'),
    ([("x", (2, 3, 4, 5))], 'layer { name: "l" type: "MVN" bottom: "x" top: "y" mvn_param { eps: 0.01 } }'),
    ([("x", (2, 3, 4))], 'layer { name: "l" type: "Softmax" bottom: "x" top: "y" softmax_param { axis: 2 } }'),
    ([("x", (2, 3, 4))], 'layer { name: "l" type: "Reduction" bottom: "x" top: "y" '
     'reduction_param { operation: SUMSQ axis: 1 coeff: 0.5 } }'),
    ([("x", (2, 3, 4))], 'layer { name: "l" type: "Reduction" bottom: "x" top: "y" '
     'reduction_param { operation: MEAN axis: 0 } }'),
    ([("x", (2, 3, 4, 2))], 'layer { name: "l" type: "BatchNorm" bottom: "x" top: "y" }'),
    ([("x", (4, 3)), ("t", (4, 3))], 'layer { name: "l" type: "EuclideanLoss" bottom: "x" bottom: "t" top: "y" }'),
    ([("x", (4, 3)), ("t", (4, 3))], 'layer { name: "l" type: "SigmoidCrossEntropyLoss" bottom: "x" bottom: "t" '
     'top: "y" }'),
]


@pytest.mark.parametrize("inputs,layer", GRAD_NETS, ids=[f"{i}-{_type_of(g[1])}" for i, g in enumerate(GRAD_NETS)])
def test_gradients_match_finite_differences(inputs, layer):
    model = build(inputs, [layer])
    gm = model.to_torch(dtype=torch.float64)
    feeds = [torch.from_numpy(RNG.standard_normal(shape) + (0.5 if name == "t" else 0)).requires_grad_(name == "x")
             for name, shape in inputs]
    if len(feeds) > 1:
        feeds[1] = (feeds[1] > 0.5).to(torch.float64)
    assert torch.autograd.gradcheck(lambda x: gm(x, *feeds[1:]), (feeds[0],), eps=1e-6, atol=1e-5)


def test_gradients_reach_embed_weights_and_softmax_loss_scores():
    model = build([("ids", (3,)), ("l", (3,))],
                  ['layer { name: "emb" type: "Embed" bottom: "ids" top: "e" '
                   'embed_param { num_output: 4 input_dim: 5 } }',
                   'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "e" bottom: "l" top: "loss" }'])
    gm = model.to_torch()
    loss = gm(torch.tensor([1.0, 1.0, 4.0]), torch.tensor([0.0, 3.0, 2.0]))
    loss.backward()
    g = gm.emb.weight.grad.numpy()
    assert np.abs(g[[1, 4]]).sum() > 0 and (g[[0, 2, 3]] == 0).all()
    assert np.abs(gm.emb.bias.grad.numpy()).sum() > 0


# ---- ONNX: onnxruntime agrees with torch ---------------------------------------------------------------

ONNX_NETS = [
    ([("x", (3, 4, 5, 6))], ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" '
                             'batch_norm_param { eps: 0.01 } }'], {"bn": [RNG.standard_normal(4), [1, 2, 3, 4], [0]]}),
    ([("x", (3, 4, 5, 6))], ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" }'],
     {"bn": [RNG.standard_normal(4) * 9, [9, 18, 27, 36], [9]]}),
    ([("x", (2, 4))], ['layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" batch_norm_param { '
                       'scale_bias: true } }'],
     {"bn": [RNG.standard_normal(4), [1, 2, 3, 4], [1], RNG.standard_normal(4), RNG.standard_normal(4)]}),
    ([("x", (2, 7, 5, 3))], ['layer { name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 3 '
                             'alpha: 0.4 beta: 0.7 k: 2.5 } }'], None),
    ([("x", (2, 3, 6, 5))], ['layer { name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 5 '
                             'alpha: 0.4 beta: 0.7 norm_region: WITHIN_CHANNEL } }'], None),
    ([("x", (2, 6))], ['layer { name: "m" type: "MVN" bottom: "x" top: "y" mvn_param { across_channels: true } }'],
     None),
    ([("x", (2, 3, 4, 5))], ['layer { name: "m" type: "MVN" bottom: "x" top: "y" mvn_param { '
                             'normalize_variance: false } }'], None),
    ([("x", (2, 3, 5))], ['layer { name: "s" type: "Softmax" bottom: "x" top: "y" softmax_param { axis: 1 } }'],
     None),
    ([("x", (2, 3, 4, 2))], ['layer { name: "a" type: "ArgMax" bottom: "x" top: "y" argmax_param { top_k: 5 '
                             'out_max_val: true } }'], None),
    ([("x", (2, 3, 4, 2))], ['layer { name: "a" type: "ArgMax" bottom: "x" top: "y" argmax_param { top_k: 2 '
                             'axis: 1 } }'], None),
    ([("x", (2, 3, 4, 2))], ['layer { name: "a" type: "ArgMax" bottom: "x" top: "y" argmax_param { top_k: 3 '
                             'axis: -2 out_max_val: true } }'], None),
    ([("x", (2, 3, 4))], ['layer { name: "r" type: "Reduction" bottom: "x" top: "y" reduction_param { '
                          'operation: MEAN axis: 0 coeff: 3 } }'], None),
    ([("x", (2, 3, 4))], ['layer { name: "r" type: "Reduction" bottom: "x" top: "y" reduction_param { '
                          'operation: ASUM axis: 2 } }'], None),
    ([("x", (2, 3))], ['layer { name: "e" type: "Embed" bottom: "x" top: "y" embed_param { num_output: 4 '
                       'input_dim: 6 bias_term: false } }'], None),
]


def _feed(shape, type_text, batch):
    shape = (batch,) + tuple(shape[1:])
    if "Embed" in type_text:
        return RNG.integers(0, 6, size=shape).astype(np.float32)
    if "ArgMax" in type_text:
        return RNG.integers(0, 3, size=shape).astype(np.float32)  # ties
    return (RNG.standard_normal(shape) * 2).astype(np.float32)


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("inputs,layers,blobs", ONNX_NETS,
                         ids=[f"{i}-{_type_of(n[1][0])}" for i, n in enumerate(ONNX_NETS)])
def test_onnx_matches_torch(tmp_path, inputs, layers, blobs, opset):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("caffeq.backends.onnx_backend")
    model = build(inputs, layers, blobs)
    path = os.path.join(tmp_path, "m.onnx")
    model.export_onnx(path, opset=opset, optimize=False)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name, shape = inputs[0]
    for batch in (1, shape[0]):
        x = _feed(shape, layers[0], batch)
        ref = model.run({name: x})
        got = sess.run(None, {name: x})
        for out, value in zip(sess.get_outputs(), got):
            r = ref[model.graph.tensors[out.name].blob]
            assert value.shape == r.shape, out.name
            bound = 1e-5 * max(np.abs(r).max(), 1e-30)
            assert np.abs(value - r).max() <= bound, (out.name, np.abs(value - r).max(), bound)


def test_a_loss_without_tops_takes_one_loss_weight_as_caffes_anonymous_top_does():
    # LossLayer::AutoTopBlobs: Caffe gives a loss that names no top an anonymous one, which one
    # loss_weight may weigh (3-D U-Net train nets write `loss_weight: 0.5` on top-less losses)
    layer = 'layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" {} }}'
    model = build([("s", (2, 3)), ("l", (2,))], [layer.format("loss_weight: 0.5")])
    assert model.graph.node("loss").attrs["tops"] == 0
    with pytest.raises(LayerError, match="2 loss_weight values for 0 top"):
        build([("s", (2, 3)), ("l", (2,))], [layer.format("loss_weight: 0.5 loss_weight: 1")])


def test_naibaf7s_weighted_euclidean_loss():
    # naibaf7/caffe (PyGreentea's anisonet_euclid): a third bottom scales each difference; / count / 2
    a, b = randn(2, 3, 4), randn(2, 3, 4)
    w = RNG.random((2, 3, 4)).astype(np.float32)
    model = build([("a", a.shape), ("b", b.shape), ("w", w.shape)],
                  ['layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" bottom: "w" top: "loss" }'])
    d = (a.astype(np.float64) - b) * w
    close(model.run({"a": a, "b": b, "w": w})["loss"], (d * d).sum() / d.size / 2, rtol=1e-5)
    with pytest.raises(LayerError, match="one value per element"):
        build([("a", a.shape), ("b", b.shape), ("w", (2, 3))],
              ['layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" bottom: "w" top: "loss" }'])


@pytest.mark.parametrize("with_unused", [True, False])
def test_batchnorm_reads_xilinx_caffe_blobs_in_their_order(with_unused, tmp_path):
    """caffe-xilinx batch_norm_layer.cpp stores [scale, bias, mean, variance, 1 value] (the last may be left out
    of a caffemodel); at TEST y = (x - mean) (variance + eps)^-0.5 scale + bias, NVCaffe's scale_bias form."""
    from caffeq.io.prototxt import parse_prototxt_text
    from caffeq.io.writer import write_caffemodel
    from caffeq.model import load
    text = (inputs_text(x=(2, 3, 4, 5)) + 'layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
            'batch_norm_param { scale_filler { type: "constant" value: 1 } bias_filler { type: "constant" value: 0 } } }')
    r = np.random.default_rng(3)
    gamma, beta, mean = (r.standard_normal(3).astype(np.float32) for _ in range(3))
    var = r.uniform(0.5, 2, 3).astype(np.float32)
    blobs = [gamma, beta, mean, var] + ([np.array([1.0], np.float32)] if with_unused else [])
    (tmp_path / "n.prototxt").write_text(text)
    write_caffemodel(parse_prototxt_text(text), {"bn": blobs}, tmp_path / "n.caffemodel")
    model = load(str(tmp_path / "n.prototxt"), weights=str(tmp_path / "n.caffemodel"))
    assert any("Xilinx's caffe-xilinx" in w for w in model.warnings)
    x = r.standard_normal((2, 3, 4, 5)).astype(np.float32)
    c = (slice(None), None, None)
    ref = (x - mean[c]) / np.sqrt(var[c].astype(np.float64) + 1e-5) * gamma[c] + beta[c]
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)
