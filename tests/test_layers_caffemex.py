"""sciencefans/CaffeMex_v2 (9bab8d2; the COCO loss nets): its Normalize (normalize_param.coeff, the GPU
kernel's formula; its float sum's order is not reproduced, hence 1e-6), its BN's sync_forward (read as
TSN's BN) and CenterProjection (read, never run: its forward depends on how often it ran)."""
import numpy as np
import pytest
from conftest import check_everywhere, net, onnx_outputs, rng

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7)])
def test_normalize_with_coeff_scales_each_item(shape, tmp_path):
    x = rng(1).standard_normal(shape).astype(F)
    flat = x.reshape(shape[0], -1)
    norm = (np.sqrt(F(np.sum(flat.astype(np.float64) ** 2, axis=1)).astype(np.float64)) + 1e-6).astype(F)
    want = (flat / norm[:, None] * F(2.5)).reshape((shape + (1, 1))[:4])
    model = load_from_text(net('layer { name: "n" type: "Normalize" bottom: "x" top: "o" '
                               'normalize_param { coeff: 2.5 } }', inputs={"x": shape}))
    assert model.blob_shapes["o"] == want.shape
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, rtol=1e-6)


def test_bn_sync_forward_reads_as_tsn_bn():
    layer = ('layer {{ name: "bn" type: "BN" bottom: "x" top: "o" bn_param {{ moving_average: true decay: 0.99 '
             'var_eps: 1e-5 {} }} }}')
    x = rng(2).standard_normal((2, 3, 4, 5)).astype(F)
    plain = load_from_text(net(layer.format(""), inputs={"x": x.shape}), random_weights=True)
    synced = load_from_text(net(layer.format("sync_forward: false"), inputs={"x": x.shape}), random_weights=True)
    for a, b in zip(plain.layers[-1].blobs, synced.layers[-1].blobs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain.run({"x": x})["o"], synced.run({"x": x})["o"])


@pytest.mark.parametrize("param, weight", [("num_output: 10 bias_term: false scale: 1", [(10, 12)]),
                                           ("num_output: 4 transpose: true", [(12, 4), (4,)])])
def test_center_projection_is_read_not_run(param, weight, tmp_path):
    model = load_from_text(net(f'layer {{ name: "c" type: "CenterProjection" bottom: "x" top: "o" '
                               f'center_projection_param {{ {param} }} }}', inputs={"x": (2, 3, 4)}),
                           random_weights=True)
    assert model.blob_shapes["o"] == (2, weight[0][0] if len(weight) == 1 else weight[0][1])
    assert [b.shape for b in model.layers[-1].blobs] == weight
    with pytest.raises(LayerError, match="depends on how often it ran"):
        model.run({"x": np.zeros((2, 3, 4), F)})
    with pytest.raises(ExportError, match="depends on how often it ran"):
        onnx_outputs(model, {"x": np.zeros((2, 3, 4), F)}, tmp_path)


# ---- BatchPool (batch_pool_layer.cpp Forward_cpu, b934325) ------------------------------------------------

def batch_pool_ref(x, w, pool):
    n = x.shape[0]
    flat = x.reshape(n, -1)
    out = np.zeros(flat.shape[1], F)
    for k in range(flat.shape[1]):
        if w is not None:
            acc = F(0)
            for i in range(n):
                acc = F(acc + F(w.reshape(-1)[i] * flat[i, k]))
            out[k] = acc
        elif pool == "MAX":
            best = F(-3.4028234663852886e38)          # the loop starts from -FLT_MAX and keeps a greater value
            for i in range(n):
                if best < flat[i, k]:
                    best = flat[i, k]
            out[k] = best
        else:
            out[k] = F(flat[:, k].sum(dtype=F) / F(n))
    return out.reshape((1,) + x.shape[1:])


@pytest.mark.parametrize("pool, weighted", [("AVE", True), ("MAX", True), ("AVE", False), ("MAX", False)])
def test_batch_pool(tmp_path, pool, weighted):
    """QAN's set pooling: the weights' sum over the batch (pool ignored), else the batch mean or maximum."""
    g = rng(71)
    x = g.standard_normal((5, 4, 1, 3)).astype(F)
    w = g.uniform(0, 1, (5, 1, 1, 1)).astype(F)
    w /= w.sum()
    bottoms = 'bottom: "x" bottom: "w"' if weighted else 'bottom: "x"'
    layer = f'layer {{ name: "bp" type: "BatchPool" {bottoms} top: "o" batch_pool_param {{ pool: {pool} }} }}'
    inputs = {"x": x.shape, "w": w.shape} if weighted else {"x": x.shape}
    model = load_from_text(net(layer, inputs=inputs))
    assert model.blob_shapes["o"] == (1, 4, 1, 3)
    feeds = {"x": x, "w": w} if weighted else {"x": x}
    check_everywhere(model, feeds, {"o": batch_pool_ref(x, w if weighted else None, pool)}, tmp_path,
                     atol=1e-6, rtol=1e-6)
    with pytest.raises(LayerError, match="one value per item"):
        load_from_text(net(layer, inputs={"x": x.shape, "w": (4, 1)}) if weighted else
                       net('layer { name: "bp" type: "BatchPool" bottom: "x" bottom: "w" top: "o" }',
                           inputs={"x": x.shape, "w": (4, 1)}))


def test_batch_pool_max_skips_nan_and_stops_at_lowest_float(tmp_path):
    x = np.array([[np.nan, -np.inf, 1, np.nan], [0, -np.inf, np.nan, np.nan], [1, -np.inf, 0, np.nan]], F)
    model = load_from_text(net('layer { name: "bp" type: "BatchPool" bottom: "x" top: "o" batch_pool_param { pool: MAX } }',
                               inputs={"x": x.shape}))
    want = batch_pool_ref(x, None, "MAX")
    assert want.tolist() == [[1, F(-3.4028234663852886e38), 1, F(-3.4028234663852886e38)]]
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)
