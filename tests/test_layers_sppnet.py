"""dsisds/caffe-SPPNet's SPATIAL_PYRAMID_POOLING (V1 files). The reference is a numpy loop written
from the fork's spatial_pyramid_pooling_layer.cpp and its float-kernel pooling_layer.cpp (CPU),
in float32 arithmetic as the fork computes kernel, window start and end; shapes where N, C, H, W differ.
"""
import numpy as np
import pytest
from conftest import rng
from test_layers_v1_forks import check_everywhere, v1_net

from caffeq.errors import CaffeqError
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.upgrade import upgrade_net
from caffeq.model import load_from_text


def fork_windows_ref(size, bins):
    """PoolingLayer::SetUp's count loop and Forward_cpu's window bounds, kernel = stride = size / bin."""
    k = np.float32(size) / np.float32(bins)
    out, end = [], 0
    i = 0
    while end < size:
        start = np.float32(np.float32(i) * k)
        end = int(np.ceil(np.float32(start + k)))
        out.append((max(int(np.floor(start)), 0), min(end, size)))
        i += 1
    return out


def spp_ref(x, bins, average):
    n, c, h, w = x.shape
    if len(bins) == 1:
        bins = [1]   # one level: kernel = the whole plane
    flat = []
    for b in bins:
        rows, cols = fork_windows_ref(h, b), fork_windows_ref(w, b)
        level = np.empty((n, c, len(rows), len(cols)), np.float32)
        for i, (r0, r1) in enumerate(rows):
            for j, (c0, c1) in enumerate(cols):
                win = x[:, :, r0:r1, c0:c1]
                if average:
                    level[:, :, i, j] = win.sum(axis=(2, 3)) / ((r1 - r0) * (c1 - c0))
                else:
                    level[:, :, i, j] = np.maximum(win.max(axis=(2, 3)), -np.finfo(np.float32).max)
        flat.append(level.reshape(n, -1))
    return np.concatenate(flat, axis=1).reshape(n, -1, 1, 1)


def spp_layer(bins, pool=None, spp_pool=None):
    lines = "".join(f"spatial_bin: {b} " for b in bins)
    if spp_pool:
        lines += f"pool: {spp_pool} "
    extra = f" pooling_param {{ pool: {pool} }}" if pool else ""
    return (f"layers {{ name: 'spp' type: SPATIAL_PYRAMID_POOLING bottom: 'x' top: 'y'"
            f" spatial_pyramid_pooling_param {{ {lines}}}{extra} }}")


def test_v1_name_upgrades_with_its_param():
    net = parse_prototxt_text(spp_layer([1, 2]))
    upgrade_net(net)
    assert net.layer[0].type == "SpatialPyramidPooling"
    assert list(net.layer[0].spatial_pyramid_pooling_param.spatial_bin) == [1, 2]


def test_windows_of_the_forks_own_test():
    # test_spatial_pyramid_pooling_layer.cpp: 5 x 5, bin 2 -> kernel 2.5, windows [0, 3) and [2, 5)
    assert fork_windows_ref(5, 2) == [(0, 3), (2, 5)]
    from caffeq.layers.sppnet import fork_spp_windows
    for size in range(1, 40):
        for b in (1, 2, 3, 4, 6, 7, 13, 50):
            assert fork_spp_windows(size, b) == [list(t) for t in fork_windows_ref(size, b)], (size, b)


def test_forks_own_forward_expectation(tmp_path):
    # the fork's test input (2 x 3 x 5 x 5, each plane the same) and its expected top for bins 1, 2
    plane = np.array([1, 2, 5, 2, 3, 9, 4, 1, 4, 8, 31, 22, 15, 27, 33, 19, 14, 21, 14, 38,
                      21, 32, 25, 12, 23], np.float32).reshape(5, 5)
    x = np.broadcast_to(plane, (2, 3, 5, 5)).copy()
    model = load_from_text(v1_net(x.shape, spp_layer([1, 2])))
    y = model.run({"x": x})["y"]
    assert y.shape == (2, 15, 1, 1)
    want = [38, 38, 38] + [31, 33, 32, 38] * 3
    np.testing.assert_array_equal(y[:, :, 0, 0], np.array([want, want], np.float32))


@pytest.mark.parametrize("bins, pool, shape", [
    ([1, 2, 3, 6], None, (2, 3, 13, 11)),      # the SPPNet files' pyramid, fractional kernels
    ([1, 2, 4], "AVE", (3, 2, 7, 10)),
    ([4, 5], "MAX", (2, 4, 3, 6)),             # more bins than rows: fewer windows
    ([3], "AVE", (2, 3, 5, 4)),                # one level: the whole plane
])
def test_spp_against_the_forks_loops(bins, pool, shape, tmp_path):
    x = rng(5).standard_normal(shape).astype(np.float32)
    model = load_from_text(v1_net(shape, spp_layer(bins, pool)))
    ref = spp_ref(x, bins, pool == "AVE")
    assert model.graph.tensors["y"].shape == ref.shape
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_all_minus_inf_window_gives_minus_flt_max(tmp_path):
    x = np.full((1, 2, 4, 3), -np.inf, np.float32)
    x[0, 1, 0, 0] = 1.0
    model = load_from_text(v1_net(x.shape, spp_layer([1, 2])))
    check_everywhere(model, {"x": x}, {"y": spp_ref(x, [1, 2], False)}, tmp_path)


@pytest.mark.parametrize("layer, msg", [
    (spp_layer([]), "spatial_bin: at least one level"),
    (spp_layer([2, 0]), "spatial_bin: 0"),
    (spp_layer([1, 100000]), "spatial_bin: 100000"),
    (spp_layer([1, 2], pool="STOCHASTIC"), "pooling_param.pool"),
    (spp_layer([1, 2], spp_pool="AVE"), "spatial_pyramid_pooling_param.pool: AVE is ignored"),
])
def test_bad_params(layer, msg):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(v1_net((2, 3, 5, 4), layer))
