"""synopsys-caffe's ICNetSubgraph (caffeq/layers/synopsys_icnet.py) against loops written from the fork's
icnet_subgraph_layer.cpp (LayerSetUp's kernels and strides, Reshape's pooled sizes, Forward_cpu's AVE pooling and
sums) and src/caffe/util/interp.cpp's caffe_cpu_interp2 (unpacked)."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_everywhere, model_py_outputs, net, onnx_outputs, rng

from caffeq.__main__ import main
from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
ICNET_FILE = ("foss-for-synopsys-dwc-arc-processors__synopsys-caffe-models__caffe_models__icnet__caffe_model__"
              "icnet_cityscapes_merge_subgraph.prototxt")
KERNELS = [(33, 65), (17, 33), (13, 25), (8, 15)]
STRIDES = [(33, 65), (16, 32), (10, 20), (5, 10)]


def fork_pooled_size(size, kernel, stride):
    """static_cast<int>(ceil(static_cast<float>(size - kernel) / stride)) + 1"""
    return int(math.ceil(F32(size - kernel) / F32(stride))) + 1


def fork_ave_pool(x, kh, kw, sh, sw):
    """Forward_cpu's pooling loop, pad 0: each window's float sum in row order over its part inside the map,
    divided by that part's size."""
    n, c, h, w = x.shape
    ph, pw = fork_pooled_size(h, kh, sh), fork_pooled_size(w, kw, sw)
    out = np.zeros((n, c, ph, pw), F32)
    for i in range(ph):
        for j in range(pw):
            hs, ws = i * sh, j * sw
            he, we = min(hs + kh, h), min(ws + kw, w)
            acc = np.zeros((n, c), F32)
            for y in range(hs, he):
                for xx in range(ws, we):
                    acc = (acc + x[:, :, y, xx]).astype(F32)
            out[:, :, i, j] = acc / F32((he - hs) * (we - ws))
    return out


def fork_interp2(data, height2, width2):
    """caffe_cpu_interp2<Dtype, false> from (h1, w1) to (height2, width2), no crop."""
    n, c, h1, w1 = data.shape
    if (h1, w1) == (height2, width2):
        return data.copy()
    rh = F32(h1 - 1) / F32(height2 - 1) if height2 > 1 else F32(0)
    rw = F32(w1 - 1) / F32(width2 - 1) if width2 > 1 else F32(0)
    out = np.zeros((n, c, height2, width2), F32)
    for y in range(height2):
        yr = F32(rh * F32(y))
        y0 = int(yr)
        yp = 1 if y0 < h1 - 1 else 0
        ly1 = F32(yr - F32(y0))
        ly0 = F32(1) - ly1
        for x in range(width2):
            xr = F32(rw * F32(x))
            x0 = int(xr)
            xp = 1 if x0 < w1 - 1 else 0
            lx1 = F32(xr - F32(x0))
            lx0 = F32(1) - lx1
            out[:, :, y, x] = (ly0 * (lx0 * data[:, :, y0, x0] + lx1 * data[:, :, y0, x0 + xp])
                               + ly1 * (lx0 * data[:, :, y0 + yp, x0] + lx1 * data[:, :, y0 + yp, x0 + xp]))
    return out


def fork_icnet_subgraph(x, in_place=False):
    """Forward_cpu: the top starts as the bottom; each branch pools the bottom blob (the top itself in place),
    resizes back and is added."""
    top = x.copy()
    h, w = x.shape[2:]
    for (kh, kw), (sh, sw) in zip(KERNELS, STRIDES):
        pooled = fork_ave_pool(top if in_place else x, kh, kw, sh, sw)
        top = (top + fork_interp2(pooled, h, w)).astype(F32)
    return top


def icnet_net(shape, in_place=False):
    if in_place:   # a copy after it names the top "o" in every backend
        return net('layer { name: "s" type: "ICNetSubgraph" bottom: "x" top: "x" }',
                   'layer { name: "copy" type: "Power" bottom: "x" top: "o" }', inputs={"x": shape})
    return net('layer { name: "s" type: "ICNetSubgraph" bottom: "x" top: "o" }', inputs={"x": shape})


@pytest.mark.parametrize("shape", [(2, 3, 33, 65), (3, 2, 19, 41), (2, 5, 4, 6), (4, 3, 70, 9)])
def test_icnet_subgraph_matches_the_forks_loops(shape, tmp_path):
    model = load_from_text(icnet_net(shape))
    assert model.blob_shapes["o"] == shape
    x = rng(sum(shape)).standard_normal(shape).astype(F32)
    check_everywhere(model, {"x": x}, {"o": fork_icnet_subgraph(x)}, tmp_path, atol=3e-6, rtol=3e-6)


def test_icnet_subgraph_in_place_pools_the_running_sum(tmp_path):
    """top == bottom: the fork's pooling reads the blob each earlier branch was added to."""
    shape = (2, 3, 21, 47)
    model = load_from_text(icnet_net(shape, in_place=True))
    x = rng(4).standard_normal(shape).astype(F32)
    want = fork_icnet_subgraph(x, in_place=True)
    assert np.abs(want - fork_icnet_subgraph(x)).max() > 1e-3   # the two readings differ on this input
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=3e-6, rtol=3e-6)


def test_pooled_sizes_are_the_forks():
    """ICNet's 33 x 65 map pools to 1x1, 2x2, 3x3 and 6x6; the sizes are ceil'd, not floored."""
    from caffeq.layers.synopsys_icnet import icnet_geometry, icnet_pooled_size
    for size_h, size_w in [(33, 65), (34, 66), (4, 6), (100, 7)]:
        for b in range(4):
            kh, kw, sh, sw = icnet_geometry(b)
            assert (icnet_pooled_size(size_h, kh, sh), icnet_pooled_size(size_w, kw, sw)) == (
                fork_pooled_size(size_h, KERNELS[b][0], STRIDES[b][0]),
                fork_pooled_size(size_w, KERNELS[b][1], STRIDES[b][1]))
    assert [(icnet_pooled_size(33, *icnet_geometry(b)[0::2]), icnet_pooled_size(65, *icnet_geometry(b)[1::2]))
            for b in range(4)] == [(1, 1), (2, 2), (3, 3), (6, 6)]


def test_the_forks_icnet_file_reads(capsys):
    assert main(["inspect", str(REALWORLD / ICNET_FILE)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("conv5_3_sum "))
    assert "ICNetSubgraph" in line and "conv5_3 -> conv5_3_sum" in line and "1x1024x33x65" in line


def test_bottom_needs_four_axes():
    with pytest.raises(LayerError, match=r"ICNetSubgraph needs a 4-axis bottom \(N, C, H, W\), got \[2, 3, 40\]"):
        load_from_text(icnet_net((2, 3, 40)))


def test_icnet_subgraph_takes_one_bottom():
    text = net('layer { name: "s" type: "ICNetSubgraph" bottom: "x" bottom: "y" top: "o" }',
               inputs={"x": (1, 2, 8, 9), "y": (1, 2, 8, 9)})
    with pytest.raises(LayerError, match="ICNetSubgraph takes one bottom and one top, got 2 and 1"):
        load_from_text(text)


@pytest.mark.parametrize("shape, branch", [((1, 2, 3, 40), 2), ((2, 1, 30, 5), 2), ((1, 1, 1, 1), 1)])
def test_a_map_too_small_for_a_branch_is_sized_but_refused(shape, branch, tmp_path):
    """An empty pooled axis: the fork's interp2 CHECK (height1 > 0 && width1 > 0) fails in forward."""
    model = load_from_text(icnet_net(shape))
    assert model.blob_shapes["o"] == shape   # Reshape accepts it
    feeds = {"x": np.zeros(shape, F32)}
    words = f"layer 's' \\(ICNetSubgraph\\): its pooling branch {branch} .* at least 4 x 6"
    with pytest.raises(CaffeqError, match=words):
        model.run(feeds)
    with pytest.raises(ExportError, match=words):
        onnx_outputs(model, feeds, tmp_path)
    with pytest.raises(ExportError, match=words):
        model_py_outputs(model, feeds, tmp_path)


def test_icnet_subgraph_stays_on_the_blobs_device():
    from cuda_emulation import run_on_emulated_cuda
    model = load_from_text(icnet_net((2, 3, 12, 25)))
    feeds = {"x": rng(8).standard_normal((2, 3, 12, 25)).astype(F32)}
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, "\n".join(sorted(set(mixes)))
    np.testing.assert_allclose(out.as_subclass(torch.Tensor).numpy(), model.run(feeds, exact=True)["o"], rtol=1e-6,
                               atol=1e-6)
