"""zhujiagang/caffe-tpp-net a4a3fd2: TPP (tpp_layer.cpp: a Split, one Caffe Pooling per level along H, Flatten,
Concat), against Caffe's pooling loops (pooling_layer.cpp Forward_cpu) written out; and zhujiagang/DTPP's nets."""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, onnx_outputs, rng

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


def caffe_pool_h(x, kernel, pad, ave):
    """Caffe's Pooling with kernel_h = stride_h = kernel, pad_h = pad, a 1-wide window along W."""
    n, c, h, w = x.shape
    out_h = math.ceil((h + 2 * pad - kernel) / kernel) + 1
    if pad and (out_h - 1) * kernel >= h + pad:
        out_h -= 1
    out = np.zeros((n, c, out_h, w), F)
    for p in range(out_h):
        start = p * kernel - pad
        if ave:
            end = min(start + kernel, h + pad)
            size = end - start
            rows = x[:, :, max(start, 0):min(end, h)]
            out[:, :, p] = np.cumsum(rows, axis=2, dtype=F)[:, :, -1] / F(size)
        else:
            rows = x[:, :, max(start, 0):min(start + kernel, h)]
            out[:, :, p] = np.maximum(rows.max(axis=2), -np.finfo(F).max)
    return out


def tpp_ref(x, levels, ave):
    h = x.shape[2]
    parts = []
    for level in range(levels):
        bins = 2 ** level
        kernel = math.ceil(h / bins)
        pad = (kernel * bins - h + 1) // 2
        parts.append(caffe_pool_h(x, kernel, pad, ave).reshape(x.shape[0], -1))
    return np.concatenate(parts, axis=1)


def tpp_net(shape, pool, height):
    return net(f'layer {{ name: "t" type: "TPP" bottom: "x" top: "o" tpp_param {{ pool: {pool} '
               f'pyramid_height: {height} }} }}', inputs={"x": shape})


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("shape, height", [((2, 3, 25, 4), 3), ((3, 2, 7, 5), 3), ((2, 4, 9, 1), 2), ((1, 2, 6, 3), 1)])
def test_tpp(pool, shape, height, tmp_path):
    x = rng(1).standard_normal(shape).astype(F)
    model = load_from_text(tpp_net(shape, pool, height))
    want = tpp_ref(x, height, pool == "AVE")
    assert model.blob_shapes["o"] == want.shape
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_tpp_sizes_dtpp_pyramid():
    """DTPP's 25 snippets of 1024 features, levels of 1, 2 and 4 bins: 7 x 1024 = 7168 values."""
    model = load_from_text(tpp_net((1, 1024, 25, 1), "MAX", 3))
    assert model.blob_shapes["o"] == (1, 7168)


@pytest.mark.parametrize("shape, pool, height, match", [
    ((1, 2, 8, 3), "MAX", 0, "tpp_param.pyramid_height must be >= 1"),
    ((1, 2, 5, 3), "MAX", 3, "level 2 pools H = 5 into 4 bins with kernel_h 2 and pad_h 2"),
    ((1, 2, 3, 3), "AVE", 3, "level 2 pools H = 3 into 4 bins"),
    ((1, 2, 7, 3), "STOCHASTIC", 2, "pads only MAX and AVE"),
    ((2, 8, 3), "MAX", 2, "TPP needs a 4-axis"),
])
def test_tpp_refusals(shape, pool, height, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(tpp_net(shape, pool, height))


def test_tpp_stochastic_is_read_but_not_run(tmp_path):
    model = load_from_text(tpp_net((1, 2, 8, 3), "STOCHASTIC", 2))
    assert model.blob_shapes["o"] == (1, 2 * 3 * 3)
    x = np.ones((1, 2, 8, 3), F)
    with pytest.raises(LayerError, match="sample at random even at TEST"):
        model.run({"x": x})
    with pytest.raises(ExportError, match="sample at random"):
        onnx_outputs(model, {"x": x}, tmp_path)


def test_dtpp_deploy_file_reads():
    path = REALWORLD / "zhujiagang__DTPP__models__hmdb51__rgb_tpp_delete_dropout_deploy.prototxt"
    res = subprocess.run([sys.executable, str(REPO / "cli.py"), "inspect", str(path)], capture_output=True, text=True,
                         cwd=REPO)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    row = next(line.split() for line in res.stdout.splitlines() if line.startswith("temporal_pyramid_pooling"))
    assert row[1:] == ["TPP", "max_reshape_perm", "->", "pyramid", "1x7168"]


def test_tpp_keeps_its_tensors_on_the_inputs_device():
    from cuda_emulation import run_on_emulated_cuda
    model = load_from_text(tpp_net((2, 3, 7, 4), "AVE", 3))
    x = rng(2).standard_normal((2, 3, 7, 4)).astype(F)
    out, mixes = run_on_emulated_cuda(model, {"x": x})
    assert not mixes, mixes
    np.testing.assert_array_equal(out.cpu().numpy(), model.run({"x": x})["o"])
