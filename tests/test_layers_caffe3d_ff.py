"""Xiaomi2008/Caffe_3D_FF (745b97b): 3-D Convolution / Pooling (kernel_d, stride_d, pad_d), CONVOLUTION_SK,
POOLING_SK and IMAGE_LABEL_DATA in V1 files.  Blobs are (N, C, H, W, D); the numpy references are loops written
from conv_layer.cpp, conv_sk_layer.cpp (im2col_sk), pooling_layer.cu and pooling_sk_layer.cu."""
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import check_everywhere, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

FLT_MAX = float(np.finfo(np.float32).max)
REPO = pathlib.Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def v1_net(shape, *layers):
    dims = " ".join(f"input_dim: {d}" for d in shape)
    return 'name: "ff"\ninput: "x"\n' + dims + "\n" + "\n".join(layers)


def conv_ref(x, w, b, stride, pad, kstride=(1, 1, 1)):
    """Each output: the sum over C x kh x kw x kd of the zero-padded input at o * s + k * kstride times the filter."""
    n, c, h, wd, d = x.shape
    o, _, kh, kw, kd = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0)) + tuple((p, p) for p in pad))
    ext = [(k - 1) * t + 1 for k, t in zip((kh, kw, kd), kstride)]
    out_shape = [(size + 2 * p - e) // s + 1 for size, p, e, s in zip((h, wd, d), pad, ext, stride)]
    out = np.zeros((n, o) + tuple(out_shape))
    for i in range(out_shape[0]):
        for j in range(out_shape[1]):
            for m in range(out_shape[2]):
                a, bb, cc = i * stride[0], j * stride[1], m * stride[2]
                patch = xp[:, :, a:a + ext[0]:kstride[0], bb:bb + ext[1]:kstride[1], cc:cc + ext[2]:kstride[2]]
                out[:, :, i, j, m] = np.einsum("nchwd,ochwd->no", patch, w) + b.reshape(-1)
    return out


def pool_ref(x, method, kernel, stride, pad):
    """pooling_layer.cu's MaxPoolForward / AvePoolForward with its ceil size and per-axis last-window rule."""
    sizes = x.shape[2:]
    out_shape = []
    for n, k, s, p in zip(sizes, kernel, stride, pad):
        o = int(math.ceil((n + 2 * p - k) / s)) + 1
        if p and (o - 1) * s >= n + p:
            o -= 1
        out_shape.append(o)
    y = np.zeros(x.shape[:2] + tuple(out_shape), np.float64)
    for idx in np.ndindex(*out_shape):
        starts = [i * s - p for i, s, p in zip(idx, stride, pad)]
        if method == "max":
            ends = [min(st + k, n) for st, k, n in zip(starts, kernel, sizes)]
            lo = [max(st, 0) for st in starts]
            win = x[:, :, lo[0]:ends[0], lo[1]:ends[1], lo[2]:ends[2]].astype(np.float64)
            y[(slice(None), slice(None)) + idx] = np.maximum(win.reshape(x.shape[:2] + (-1,)).max(-1), -FLT_MAX) \
                if win.size else -FLT_MAX
        else:
            ends = [min(st + k, n + p) for st, k, n, p in zip(starts, kernel, sizes, pad)]
            pool_size = math.prod(e - st for e, st in zip(ends, starts))
            lo = [max(st, 0) for st in starts]
            hi = [min(e, n) for e, n in zip(ends, sizes)]
            win = x[:, :, lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].astype(np.float64)
            y[(slice(None), slice(None)) + idx] = win.sum(axis=(2, 3, 4)) / pool_size
    return y


def sk_pool_ref(x, kernel, stride, kstride):
    """pooling_sk_layer.cu's MaxPoolForward: start o * s, taps every kstride up to min(start + ext, n)."""
    sizes = x.shape[2:]
    ext = [(k - 1) * t + 1 for k, t in zip(kernel, kstride)]
    out_shape = [int(math.ceil((n - e) / s)) + 1 for n, e, s in zip(sizes, ext, stride)]
    y = np.full(x.shape[:2] + tuple(out_shape), -FLT_MAX, np.float64)
    for idx in np.ndindex(*out_shape):
        st = [i * s for i, s in zip(idx, stride)]
        en = [min(a + e, n) for a, e, n in zip(st, ext, sizes)]
        win = x[:, :, st[0]:en[0]:kstride[0], st[1]:en[1]:kstride[1], st[2]:en[2]:kstride[2]]
        if win.size:
            y[(slice(None), slice(None)) + idx] = np.maximum(win.reshape(x.shape[:2] + (-1,)).max(-1), -FLT_MAX)
    return y


def _set_bias(model, name, seed):
    node = next(n for n in model.layers if n.name == name)
    w, b = node.blobs
    node.blobs = [w, rng(seed).standard_normal(b.shape).astype(np.float32)]
    return node.blobs


@pytest.mark.parametrize("geometry, stride, pad", [
    ("kernel_h: 2 kernel_w: 3 kernel_d: 2", (1, 1, 1), (0, 0, 0)),
    ("kernel_h: 3 kernel_w: 2 kernel_d: 3 stride_h: 2 stride_w: 1 stride_d: 2 pad_h: 1 pad_w: 0 pad_d: 2",
     (2, 1, 2), (1, 0, 2)),
])
def test_convolution_kernel_d(geometry, stride, pad, tmp_path):
    x = rng(1).standard_normal((2, 3, 5, 7, 6)).astype(np.float32)
    text = v1_net(x.shape, "layers { name: 'c' type: CONVOLUTION bottom: 'x' top: 'c'\n"
                           f"  convolution_param {{ num_output: 4 {geometry} }} }}")
    model = load_from_text(text, random_weights=True)
    w, b = _set_bias(model, "c", 2)
    kernel = tuple(int(v) for v in geometry.split()[1:6:2])
    assert w.shape == (4, 3) + kernel
    check_everywhere(model, {"x": x}, {"c": conv_ref(x, w, b, stride, pad)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_convolution_sk_dilates_the_kernel(tmp_path):
    x = rng(3).standard_normal((2, 2, 4, 11, 9)).astype(np.float32)
    text = v1_net(x.shape, "layers { name: 'c' type: CONVOLUTION_SK bottom: 'x' top: 'c'\n"
                           "  convolution_param { num_output: 3 kernel_h: 2 kernel_w: 3 kernel_d: 2\n"
                           "    kstride_h: 1 kstride_w: 3 kstride_d: 2 stride_h: 1 stride_w: 2 stride_d: 1\n"
                           "    num_conv_partition: 7 } }")   # 63 positions in 7 pieces of 9
    model = load_from_text(text, random_weights=True)
    w, b = _set_bias(model, "c", 4)
    ref = conv_ref(x, w, b, (1, 2, 1), (0, 0, 0), kstride=(1, 3, 2))
    assert model.blob_shapes["c"] == ref.shape == (2, 3, 3, 3, 7)
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method, params, kernel, stride, pad", [
    ("max", "pool: MAX kernel_h: 1 kernel_w: 2 kernel_d: 2 stride_h: 1 stride_w: 2 stride_d: 2",
     (1, 2, 2), (1, 2, 2), (0, 0, 0)),
    ("max", "pool: MAX kernel_h: 2 kernel_w: 3 kernel_d: 3 stride_h: 2 stride_w: 2 stride_d: 3 pad_h: 1 pad_w: 0 "
            "pad_d: 2", (2, 3, 3), (2, 2, 3), (1, 0, 2)),
    ("ave", "pool: AVE kernel_h: 2 kernel_w: 3 kernel_d: 3 stride_h: 2 stride_w: 2 stride_d: 3 pad_h: 1 pad_w: 0 "
            "pad_d: 2", (2, 3, 3), (2, 2, 3), (1, 0, 2)),
    ("ave", "pool: AVE kernel_size: 2 stride: 2", (2, 2, 2), (2, 2, 2), (0, 0, 0)),
])
def test_pooling_kernel_d(method, params, kernel, stride, pad, tmp_path):
    x = rng(5).standard_normal((2, 3, 5, 9, 7)).astype(np.float32)
    text = v1_net(x.shape, f"layers {{ name: 'p' type: POOLING bottom: 'x' top: 'p' pooling_param {{ {params} }} }}")
    model = load_from_text(text)
    ref = pool_ref(x, method, kernel, stride, pad)
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_pooling_kernel_d_ignores_kstride(tmp_path):
    """The deploy file's pool2: POOLING (not _SK) with kstride_* pools the dense window at stride 1."""
    x = rng(6).standard_normal((2, 2, 3, 8, 7)).astype(np.float32)
    text = v1_net(x.shape, "layers { name: 'p' type: POOLING bottom: 'x' top: 'p' pooling_param {\n"
                           "  pool: MAX kernel_h: 1 kernel_w: 2 kernel_d: 2 kstride_h: 1 kstride_w: 2 kstride_d: 2 } }")
    model = load_from_text(text)
    check_everywhere(model, {"x": x}, {"p": pool_ref(x, "max", (1, 2, 2), (1, 1, 1), (0, 0, 0))}, tmp_path)


@pytest.mark.parametrize("params, kernel, stride, kstride", [
    ("kernel_h: 1 kernel_w: 2 kernel_d: 2 kstride: 1", (1, 2, 2), (1, 1, 1), (1, 1, 1)),
    ("kernel_h: 2 kernel_w: 2 kernel_d: 3 kstride_h: 1 kstride_w: 4 kstride_d: 2", (2, 2, 3), (1, 1, 1), (1, 4, 2)),
    ("kernel_h: 2 kernel_w: 3 kernel_d: 2 stride_h: 2 stride_w: 3 stride_d: 2 kstride_h: 2 kstride_w: 2 kstride_d: 1",
     (2, 3, 2), (2, 3, 2), (2, 2, 1)),
])
def test_pooling_sk_max(params, kernel, stride, kstride, tmp_path):
    x = rng(7).standard_normal((2, 3, 5, 12, 9)).astype(np.float32)
    x[0, 0, 0, :3, :3] = -np.inf
    text = v1_net(x.shape, "layers { name: 'p' type: POOLING_SK bottom: 'x' top: 'p'\n"
                           f"  pooling_param {{ pool: MAX {params} }} }}")
    model = load_from_text(text)
    ref = sk_pool_ref(x, kernel, stride, kstride)
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path)


def test_image_label_data_shapes():
    text = ("name: 'd'\nlayers { name: 'data' type: IMAGE_LABEL_DATA top: 'data' top: 'label'\n"
            "  image_label_data_param { source: 'db' batch_size: 4 crop_size_h: 5 crop_size_w: 9 crop_size_d: 7\n"
            "    out_label_size: 3 rand_patch_times: 10 background_skip_rate: 250\n"
            "    label_select_param { balance: true num_labels: 40 } } }\n"
            "layers { name: 'c' type: CONVOLUTION bottom: 'data' top: 'c'\n"
            "  convolution_param { num_output: 2 kernel_h: 5 kernel_w: 3 kernel_d: 3 } }")
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["data"] == (4, 1, 5, 9, 7)
    assert model.blob_shapes["label"] == (4, 1, 3, 3, 3)
    assert model.blob_shapes["c"] == (4, 2, 1, 7, 5)
    three = load_from_text(text.replace("top: 'label'", "top: 'label' top: 'one'"), random_weights=True)
    assert three.blob_shapes["one"] == (4, 1, 1, 1, 1)
    with pytest.raises(LayerError, match="exceeds the crop"):
        load_from_text(text.replace("out_label_size: 3", "out_label_size: 6"), random_weights=True)


@pytest.mark.parametrize("layer, params, needle", [
    ("CONVOLUTION_SK", "num_output: 2 kernel_size: 2 pad: 1", "takes no pad"),
    ("CONVOLUTION_SK", "num_output: 2 kernel_h: 2 kernel_w: 2", "kernel_d"),
    ("CONVOLUTION_SK", "num_output: 2 kernel_size: 2 group: 2", "group 1 only"),
    ("POOLING_SK", "pool: AVE kernel_size: 2", "MAX only"),
    ("POOLING", "pool: MAX kernel_h: 2 kernel_w: 2 kernel_d: 2 pad_d: 2", "pad_d 2 must be below kernel_d 2"),
])
def test_bad_parameters(layer, params, needle):
    param = "convolution_param" if "CONV" in layer else "pooling_param"
    text = v1_net((1, 2, 4, 6, 6), f"layers {{ name: 'l' type: {layer} bottom: 'x' top: 'l' {param} {{ {params} }} }}")
    with pytest.raises(LayerError, match=needle) as err:
        load_from_text(text, random_weights=True)
    assert "\n" not in str(err.value)


CORPUS_FILES = ["examples__class_selection_example__test_snems3d_AS2D_2_cpy",
                "examples__class_selection_example__train_snems3d_AS2D",
                "examples__ff_prediction__deploy_snems3d_as2d_2"]


@pytest.mark.parametrize("name", CORPUS_FILES)
def test_corpus_files_read(name):
    path = CORPUS / f"Xiaomi2008__Caffe_3D_FF__{name}.prototxt"
    res = subprocess.run([sys.executable, "cli.py", "inspect", str(path)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "total:" in res.stdout and "parameters" in res.stdout


def test_convolution_sk_partitions_with_a_remainder_need_batch_1():
    """75 output positions in pieces of 18: the fork's last piece leaves N_ at 3, so from item 1 on it computes
    part of the positions only; batch 1 is exact, a larger batch is refused."""
    layer = ("layers { name: 'l' type: CONVOLUTION_SK bottom: 'x' top: 'l' convolution_param { num_output: 2 "
             "kernel_size: 2 num_conv_partition: 4 } }")
    one = load_from_text(v1_net((1, 2, 4, 6, 6), layer), random_weights=True)
    assert one.blob_shapes["l"] == (1, 2, 3, 5, 5)
    with pytest.raises(LayerError, match=r"from the second item of a batch \(or bottom\) on") as err:
        load_from_text(v1_net((2, 2, 4, 6, 6), layer), random_weights=True)
    assert "\n" not in str(err.value)
    # N_ is set once per forward, before the loop over bottoms: a second bottom at batch 1 is refused too
    two = (layer.replace("bottom: 'x' top: 'l'", "bottom: 'x' bottom: 'x2' top: 'l' top: 'l2'"))
    dims = " ".join(f"input_dim: {d}" for d in (1, 2, 4, 6, 6))
    text = f'name: "ff"\ninput: "x"\n{dims}\ninput: "x2"\n{dims}\n{two}'
    with pytest.raises(LayerError, match="or bottom"):
        load_from_text(text, random_weights=True)
