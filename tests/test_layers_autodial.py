"""ducksoup/autodial's Dial against its dial_layer.cpp's formulas (stored statistics, and the batch's
with alpha mixing the source and target halves), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def dial_stored_ref(x, mean_sum, var_sum, factor, row, eps):
    f = 0.0 if factor == 0 else 1.0 / np.float64(factor)
    view = (1, -1) + (1,) * (x.ndim - 2)
    mean = (mean_sum[row] * f).reshape(view)
    var = (var_sum[row] * f).reshape(view)
    return (x - mean) / np.sqrt(var + eps)


def dial_batch_ref(x, alpha, split, eps):
    a = min(max(alpha, 0.5), 1.0)
    axes = (0,) + tuple(range(2, x.ndim))
    x = x.astype(np.float64)
    src, tgt = x[:split], x[split:]
    m_s, m_t = src.mean(axes, keepdims=True), tgt.mean(axes, keepdims=True)
    mean_s, mean_t = a * m_s + (1 - a) * m_t, a * m_t + (1 - a) * m_s
    var_s = a * ((src - mean_s) ** 2).mean(axes, keepdims=True) + (1 - a) * ((tgt - mean_s) ** 2).mean(axes, keepdims=True)
    var_t = (1 - a) * ((src - mean_t) ** 2).mean(axes, keepdims=True) + a * ((tgt - mean_t) ** 2).mean(axes, keepdims=True)
    return np.concatenate([(src - mean_s) / np.sqrt(var_s + eps), (tgt - mean_t) / np.sqrt(var_t + eps)])


def dial_net(shape, param=""):
    return net(f'layer {{ name: "d" type: "Dial" bottom: "x" top: "y" dial_param {{ {param} }} }}',
               inputs={"x": shape})


def with_stats(model, g, factor=4.0):
    node = node_of(model, "d")
    c = node.blobs[1].shape[1]
    node.blobs[0] = np.array([0.8], f32)
    node.blobs[1] = g.standard_normal((2, c)).astype(f32)
    node.blobs[2] = g.uniform(0.5, 3, (2, c)).astype(f32)
    node.blobs[3] = np.array([factor], f32)
    model.clear_cache()
    return [np.asarray(b, np.float64) for b in node.blobs]


@pytest.mark.parametrize("shape, param, row", [
    ((3, 5, 4, 2), "", 1),                                  # TARGET by default
    ((3, 5, 4, 2), "test_stats: SOURCE eps: 0.01", 0),
    ((4, 6), "", 1),                                        # after an InnerProduct
])
def test_dial_with_stored_statistics(shape, param, row, tmp_path):
    g = rng(41)
    model = load_from_text(dial_net(shape, param), random_weights=True)
    alpha, mean_sum, var_sum, factor = with_stats(model, g)
    eps = 0.01 if "eps" in param else 1e-5
    x = g.standard_normal(shape).astype(f32)
    ref = dial_stored_ref(x.astype(np.float64), mean_sum, var_sum, factor[0], row, np.float64(f32(eps)))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_dial_with_a_zero_factor_divides_by_sqrt_eps(tmp_path):
    # the fork's fresh blobs (all zero): mean and variance 0, y = x / sqrt(eps)
    g = rng(42)
    model = load_from_text(dial_net((2, 3, 2, 2)), random_weights=True)
    with_stats(model, g, factor=0.0)
    x = g.standard_normal((2, 3, 2, 2)).astype(f32)
    check_everywhere(model, {"x": x}, {"y": x / np.sqrt(np.float64(f32(1e-5)))}, tmp_path, rtol=1e-5)


@pytest.mark.parametrize("shape, param, split", [
    ((5, 3, 4, 2), "use_global_stats: false slice_point: 2", 2),
    ((6, 4), "use_global_stats: false", 3),                  # -1: half the batch
])
def test_dial_with_the_batchs_statistics_mixes_the_domains(shape, param, split, tmp_path):
    g = rng(43)
    model = load_from_text(dial_net(shape, param), random_weights=True)
    with_stats(model, g)
    x = (g.standard_normal(shape) * 2 + 1).astype(f32)
    x[split:] += 3   # a shifted target domain
    ref = dial_batch_ref(x, 0.8, split, np.float64(f32(1e-5)))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-4)
    node_of(model, "d").blobs[0] = np.array([0.2], f32)     # clipped to 0.5 as the fork clips its blob
    model.clear_cache()
    check_everywhere(model, {"x": x}, {"y": dial_batch_ref(x, 0.5, split, np.float64(f32(1e-5)))}, tmp_path,
                     atol=1e-5, rtol=1e-4)


def test_dial_training_updates_the_moving_sums():
    import torch
    g = rng(44)
    model = load_from_text(dial_net((4, 3, 2, 2)), random_weights=True)
    _, mean_sum, var_sum, factor = with_stats(model, g, factor=2.0)
    module = model.to_torch().train()
    x = g.standard_normal((4, 3, 2, 2)).astype(f32)
    out = module(torch.from_numpy(x))
    y = out["y"] if isinstance(out, dict) else out
    np.testing.assert_allclose(y.detach().numpy(), dial_batch_ref(x, 0.8, 2, 1e-5), rtol=1e-4, atol=1e-5)
    # the mixed statistics (rows: source, target), the variance times m / (m - 1), m = 4 * 2 * 2
    a, xs = 0.8, x.astype(np.float64)
    m_s, m_t = xs[:2].mean((0, 2, 3)), xs[2:].mean((0, 2, 3))
    mean_s, mean_t = a * m_s + (1 - a) * m_t, a * m_t + (1 - a) * m_s
    var_s = a * ((xs[:2] - mean_s[:, None, None]) ** 2).mean((0, 2, 3)) \
        + (1 - a) * ((xs[2:] - mean_s[:, None, None]) ** 2).mean((0, 2, 3))
    var_t = (1 - a) * ((xs[:2] - mean_t[:, None, None]) ** 2).mean((0, 2, 3)) \
        + a * ((xs[2:] - mean_t[:, None, None]) ** 2).mean((0, 2, 3))
    state = dict(module.named_buffers())
    np.testing.assert_allclose(state["d.mean_sum"].numpy(), 0.999 * mean_sum + np.stack([mean_s, mean_t]),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["d.variance_sum"].numpy(),
                               0.999 * var_sum + np.stack([var_s, var_t]) * 16 / 15, rtol=1e-5)
    np.testing.assert_allclose(state["d.factor"].numpy(), 0.999 * factor + 1, rtol=1e-6)


def test_dial_refuses_an_empty_domain():
    with pytest.raises(LayerError, match="slice_point 4 for a batch of 4"):
        load_from_text(dial_net((4, 3), "use_global_stats: false slice_point: 4"))
