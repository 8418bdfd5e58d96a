"""JiahaoLi-gdut/CAFFE-DACH (388c826): RandomBlob and ImageStorage (src/caffe/layers/random_blob_layer.cpp,
image_storage_layer.cpp) and its pooling's channel window (src/caffe/layers/pooling_layer.cpp: kernel_c /
stride_c, the MAX and AVE loops and their sizes), in torch, onnxruntime and model.py."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

REPO = Path(__file__).resolve().parent.parent
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
DACH = "JiahaoLi-gdut__CAFFE-DACH__examples__"


def dach_pool_ref(x, pool, kc, kh, kw, sc, sh, sw, pc=0, ph=0, pw=0, ceil=True):
    """ave_pooling_cpu / max_pooling_cpu over (N, C, H, W): windows over channels, height and width, sizes
    floor((n + 2p - k) / s) + 1 (+1 with ceil, a remainder and a window starting before n + p), AVE divided
    by the cells inside the input, MAX from the window's first cell with a strict <."""
    n, c, h, w = x.shape

    def size(m, k, s, p):
        span = max(0, m + 2 * p - k)
        z = span // s + 1
        return z + (1 if ceil and span % s and z * s < m + p else 0)

    cy, hy, wy = size(c, kc, sc, pc), size(h, kh, sh, ph), size(w, kw, sw, pw)
    y = np.zeros((n, cy, hy, wy), np.float64)
    for b in range(n):
        for i in range(cy):
            for j in range(hy):
                for k in range(wy):
                    bc, bh, bw = max(i * sc - pc, 0), max(j * sh - ph, 0), max(k * sw - pw, 0)
                    ec, eh, ew = min(i * sc + kc - pc, c), min(j * sh + kh - ph, h), min(k * sw + kw - pw, w)
                    cells = x[b, bc:ec, bh:eh, bw:ew].astype(np.float64)
                    if pool == "MAX":
                        best = cells.flat[0]
                        for v in cells.flat:
                            if best < v:
                                best = v
                        y[b, i, j, k] = best
                    else:
                        y[b, i, j, k] = cells.sum() / cells.size
    return y.astype(np.float32)


def pool_text(shape, params):
    return net(f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "p" pooling_param {{ {params} }} }}',
               inputs={"x": shape})


# ---- pooling with kernel_c -------------------------------------------------------------------------

@pytest.mark.parametrize("pool,kh,kw,sh,sw", [("MAX", 3, 2, 2, 1), ("MAX", 3, 3, 2, 2), ("AVE", 2, 3, 2, 2)])
def test_dach_pooling_one_channel_window(tmp_path, pool, kh, kw, sh, sw):
    shape = (2, 3, 7, 6)
    x = rng(1).standard_normal(shape).astype(np.float32)
    params = (f"pool: {pool} kernel_c: 1 kernel_h: {kh} kernel_w: {kw} stride_c: 1 stride_h: {sh} "
              f"stride_w: {sw}")
    model = load_from_text(pool_text(shape, params))
    ref = dach_pool_ref(x, pool, 1, kh, kw, 1, sh, sw)
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6 if pool == "AVE" else 0.0)


@pytest.mark.parametrize("params,needle", [
    ("pool: MAX kernel_c: 2 kernel_h: 2 kernel_w: 2 stride_c: 1", "pooling_param.kernel_c 2"),
    ("pool: MAX kernel_c: 1 kernel_h: 2 kernel_w: 2 stride_c: 2", "pooling_param.stride_c 2"),
    ("pool: AVE kernel_c: 1 kernel_h: 3 kernel_w: 3 pad_h: 1 pad_w: 1", "padded AVE"),
    ("pool: STOCHASTIC kernel_c: 1 kernel_h: 2 kernel_w: 2", "MAX and AVE only"),
    # width 5, kernel 1, stride 3: the fork sizes 2 (its last window would start at 6), BVLC 3
    ("pool: MAX kernel_c: 1 kernel_h: 1 kernel_w: 1 stride_h: 3 stride_w: 3", "sizes input [7, 5] to [3, 2]"),
])
def test_dach_pooling_refusals(params, needle):
    with pytest.raises(CaffeqError) as e:
        load_from_text(pool_text((2, 3, 7, 5), params))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_dach_pooling_mask_top_is_refused():
    """The fork's mask counts (c * H + h) * W + w from the item's start (max_pooling_cpu's m), not BVLC's
    h * W + w within the plane: refused rather than given BVLC's numbers."""
    text = pool_text((2, 3, 7, 5), "pool: MAX kernel_c: 1 kernel_h: 2 kernel_w: 2 stride_h: 2 stride_w: 2")
    text = text.replace('top: "p"', 'top: "p" top: "mask"')
    with pytest.raises(CaffeqError, match="argmax mask top"):
        load_from_text(text)


# ---- RandomBlob --------------------------------------------------------------------------------------

def random_blob_text(params, bottom=True):
    b = ' bottom: "x"' if bottom else ""
    layer = f'layer {{ name: "r" type: "RandomBlob"{b} top: "r" random_blob_param {{ {params} }} }}'
    relu = 'layer { name: "a" type: "ReLU" bottom: "r" top: "a" }'
    return net(layer, relu, inputs={"x": (2, 3, 5, 7)})


def test_random_blob_takes_the_bottom_shape_and_is_not_run():
    model = load_from_text(random_blob_text('type: "uniform" min: -1 max: 1'))
    assert model.blob_shapes["r"] == (2, 3, 5, 7) and model.blob_shapes["a"] == (2, 3, 5, 7)
    with pytest.raises(CaffeqError, match="random generator"):
        model.run({"x": np.zeros((2, 3, 5, 7), np.float32)})


def test_random_blob_shape_from_its_param_without_bottom():
    model = load_from_text(random_blob_text("num: 2 channel: 9 height: 1 width: 3", bottom=False))
    assert model.blob_shapes["r"] == (2, 9, 1, 3)


@pytest.mark.parametrize("params,bottom,needle", [
    ('type: "xavier"', True, "random_blob_param.type 'xavier'"),
    ("num: 2 channel: 0 height: 1 width: 1", False, "must all be >= 1"),
])
def test_random_blob_bad_params(params, bottom, needle):
    with pytest.raises(LayerError) as e:
        load_from_text(random_blob_text(params, bottom))
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- ImageStorage ----------------------------------------------------------------------------------

def test_image_storage_writes_nothing_and_keeps_its_bottom(tmp_path):
    shape = (2, 3, 5, 7)
    text = net('layer { name: "t" type: "TanH" bottom: "x" top: "t" }',
               f'layer {{ name: "s" type: "ImageStorage" bottom: "t" '
               f'image_storage_param {{ saveroot: "{tmp_path / "store"}" }} }}', inputs={"x": shape})
    model = load_from_text(text)
    x = rng(2).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"t": np.tanh(x.astype(np.float64)).astype(np.float32)}, tmp_path,
                     atol=1e-6)
    assert not (tmp_path / "store").exists()


def test_image_storage_takes_one_bottom():
    text = net('layer { name: "s" type: "ImageStorage" bottom: "x" bottom: "y" }',
               inputs={"x": (1, 3, 2, 2), "y": (1, 3, 2, 2)})
    with pytest.raises(LayerError, match="ImageStorage takes one bottom"):
        load_from_text(text)


# ---- the corpus files ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,extra", [
    ("_imag_homo__ad2w_latentDA__protos__train_val.prototxt", ["--input-shape", "data=2,3,227,227"]),
])
def test_the_forks_files_read(name, extra):
    path = REALWORLD / (DACH + name)
    res = subprocess.run([sys.executable, str(REPO / "cli.py"), "inspect", str(path), *extra],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "total:" in res.stdout and "Traceback" not in res.stderr
    for field in ("async_command_puller", "kernel_c", "stride_c", "param2top_param", "class_latch_param",
                  "mmd_loss_param"):
        assert f"unknown field '{field}'" not in res.stderr
