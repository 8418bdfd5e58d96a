"""DeformableConvolution as yyangmei/SAR_plane (cbb626f) and xraydetec/Xdet (1119bbe) implement it
(deformable_conv_layer.cu, deformable_im2col.cu deformable_im2col_gpu_kernel).

The reference is a numpy loop written here from the fork's kernel, one column entry at a time: the
offsets indexed as the kernel indexes each image's blob, the tap read relative to (h_in, w_in) with the
kernel's clamping, float32 arithmetic where the kernel's is float; then Caffe's grouped GEMM.  Every case
runs in torch, onnxruntime (opset 13: GatherElements; the default: DeformConv) and the generated model.py.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

import caffeq
from caffeq.errors import ExportError
from caffeq.io.caffemodel import BlobData
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.writer import write_caffemodel
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def fork_bilinear(img, h_in, w_in, h, w, height, width):
    """deformable_im2col_bilinear on the image seen from (h_in, w_in): height, width = H - h_in, W - w_in."""
    h_low, w_low = math.floor(h), math.floor(w)
    if h_low >= height - 1:
        h_low = h_high = height - 1
        h = F32(h_low)
    else:
        h_high = h_low + 1
    if w_low >= width - 1:
        w_low = w_high = width - 1
        w = F32(w_low)
    else:
        w_high = w_low + 1
    lh, lw = F32(h - F32(h_low)), F32(w - F32(w_low))
    hh, hw = F32(1) - lh, F32(1) - lw
    rows, cols = (h_in + h_low, h_in + h_high), (w_in + w_low, w_in + w_high)
    assert min(rows + cols) >= 0
    v1, v2 = img[rows[0], cols[0]], img[rows[0], cols[1]]
    v3, v4 = img[rows[1], cols[0]], img[rows[1], cols[1]]
    return F32(hh * hw * v1 + hh * lw * v2 + lh * hw * v3 + lh * lw * v4)


def fork_columns(x, off, kernel, stride, pad, dil, dg):
    """deformable_im2col_gpu_kernel per image: (N, C * kh * kw, Ho, Wo)."""
    n_, c_, height, width = x.shape
    kh, kw = kernel
    ho_ = (height + 2 * pad[0] - (dil[0] * (kh - 1) + 1)) // stride[0] + 1
    wo_ = (width + 2 * pad[1] - (dil[1] * (kw - 1) + 1)) // stride[1] + 1
    per_group = c_ // dg
    cols = np.zeros((n_, c_ * kh * kw, ho_, wo_), np.float64)
    for n in range(n_):
        flat = off[n].reshape(-1)       # offset + n * input_offset_dim_, indexed with Ho, Wo
        for c in range(c_):
            base = (c // per_group) * 2 * kh * kw * ho_ * wo_
            for ho in range(ho_):
                for wo in range(wo_):
                    h_in, w_in = ho * stride[0] - pad[0], wo * stride[1] - pad[1]
                    for i in range(kh):
                        for j in range(kw):
                            dy = flat[base + ((2 * (i * kw + j)) * ho_ + ho) * wo_ + wo]
                            dx = flat[base + ((2 * (i * kw + j) + 1) * ho_ + ho) * wo_ + wo]
                            h_im = F32(h_in + i * dil[0]) + dy
                            w_im = F32(w_in + j * dil[1]) + dx
                            val = 0.0
                            if 0 <= h_im < height and 0 <= w_im < width:
                                val = fork_bilinear(x[n, c], h_in, w_in, F32(i * dil[0]) + dy, F32(j * dil[1]) + dx,
                                                    height - h_in, width - w_in)
                            cols[n, (c * kh + i) * kw + j, ho, wo] = val
    return cols


def fork_forward(x, off, weight, bias, stride, pad, dil, group, dg):
    cout, cin_g, kh, kw = weight.shape
    cols = fork_columns(x, off, (kh, kw), stride, pad, dil, dg)
    n, _, ho, wo = cols.shape
    cols = cols.reshape(n, group, cin_g * kh * kw, ho * wo)
    wmat = weight.astype(np.float64).reshape(group, cout // group, cin_g * kh * kw)
    y = np.einsum("gok,ngkl->ngol", wmat, cols).reshape(n, cout, ho, wo)
    return y if bias is None else y + bias.reshape(1, cout, 1, 1)


def layer(param, bottoms=("x", "o"), top="y", name="d"):
    b = " ".join(f'bottom: "{t}"' for t in bottoms)
    return (f'layer {{ name: "{name}" type: "DeformableConvolution" {b} top: "{top}" '
            f'deformable_convolution_param {{ {param} }} }}')


def deform_model(param, x_shape, off_shape, seed=0):
    model = load_from_text(net(layer(param), inputs={"x": x_shape, "o": off_shape}), random_weights=True)
    node = node_of(model, "d")
    if len(node.blobs) == 2:   # a bias that is not zero
        node.blobs = [node.blobs[0], rng(seed).standard_normal(node.blobs[1].shape).astype(F32)]
    return model, node


CASES = [
    # param; data (N, C, H, W); top; kernel; deformable_group; the offsets' spread (pixels)
    ("kernel_size: 3 pad: 1 num_output: 4 group: 2 deformable_group: 3", (2, 6, 5, 7), (2, 4, 5, 7), (3, 3), 3, 2.0),
    ("kernel_size: 3 pad: 2 dilation: 2 num_output: 6 group: 3 deformable_group: 2", (2, 6, 6, 4), (2, 6, 6, 4),
     (3, 3), 2, 1.5),
    # stride and a kernel_h x kernel_w: the output is smaller than the offsets, read from their start
    ("kernel_h: 3 kernel_w: 2 stride: 2 pad_h: 1 pad_w: 0 num_output: 4 group: 2 deformable_group: 2 "
     "bias_term: false", (2, 4, 7, 5), (2, 4, 4, 2), (3, 2), 2, 2.5),
    # deformable_group left out: the forks' default is 4
    ("kernel_size: 2 stride_h: 1 stride_w: 2 dilation: 3 pad: 1 num_output: 3", (2, 8, 6, 9), (2, 3, 5, 4),
     (2, 2), 4, 3.0),
]


@pytest.mark.parametrize("param, x_shape, y_shape, kernel, dg, spread", CASES)
def test_matches_the_forks_kernel(param, x_shape, y_shape, kernel, dg, spread, tmp_path):
    off_shape = (x_shape[0], 2 * kernel[0] * kernel[1] * dg) + x_shape[2:]
    model, node = deform_model(param, x_shape, off_shape)
    assert model.blob_shapes["y"] == y_shape
    x = rng(1).standard_normal(x_shape).astype(F32)
    off = (rng(2).standard_normal(off_shape) * spread).astype(F32)
    off.reshape(-1)[::7] = np.round(off.reshape(-1)[::7])     # whole-pixel offsets: taps on the edges
    a = node.attrs
    bias = node.blobs[1] if a["bias_term"] else None
    ref = fork_forward(x, off, node.blobs[0], bias, a["stride"], a["pad"], a["dilation"], a["group"], dg)
    check_everywhere(model, {"x": x, "o": off}, {"y": ref}, tmp_path, atol=2e-5, rtol=1e-5)


def test_edges_read_zero_outside_and_the_last_row_inside(tmp_path):
    """A 1 x 1 filter of weight 1 moved half a pixel: a tap in (-1, 0) reads 0 (zero-padded bilinear
    would give half of row 0), one in (H - 1, H) reads row H - 1 whole (zero-padded: half of it)."""
    x = rng(3).standard_normal((2, 1, 4, 5)).astype(F32)
    model, node = deform_model("kernel_size: 1 num_output: 1 bias_term: false deformable_group: 1",
                               x.shape, (2, 2, 4, 5))
    node.blobs = [np.ones((1, 1, 1, 1), F32)]
    up, down = np.zeros((2, 2, 4, 5), F32), np.zeros((2, 2, 4, 5), F32)
    up[:, 0], down[:, 0] = -0.5, 0.5
    ref_up = np.concatenate([np.zeros_like(x[:, :, :1]), (x[:, :, 1:] + x[:, :, :-1]) / 2], axis=2)
    ref_down = np.concatenate([(x[:, :, 1:] + x[:, :, :-1]) / 2, x[:, :, -1:]], axis=2)
    for off, ref in ((up, ref_up), (down, ref_down)):
        assert np.allclose(fork_forward(x, off, node.blobs[0], None, (1, 1), (0, 0), (1, 1), 1, 1), ref)
        check_everywhere(model, {"x": x, "o": off}, {"y": ref}, tmp_path, atol=1e-6)


@pytest.mark.parametrize("param", [
    "kernel_size: 3 pad: 1 group: 2 deformable_group: 2",
    "kernel_size: 3 stride: 2 pad: 2 dilation: 2 group: 1 deformable_group: 4",
])
def test_zero_offsets_are_a_plain_convolution(param, tmp_path):
    x = rng(4).standard_normal((2, 4, 6, 7)).astype(F32)
    dg = int(param.split("deformable_group: ")[1].split()[0])
    conv = param.split(" deformable_group")[0]
    text = net(layer(f"num_output: 6 {param}"),
               f'layer {{ name: "c" type: "Convolution" bottom: "x" top: "z" convolution_param {{ num_output: 6 {conv} }} }}',
               inputs={"x": x.shape, "o": (2, 18 * dg, 6, 7)})
    model = load_from_text(text, random_weights=True)
    d, c = node_of(model, "d"), node_of(model, "c")
    d.blobs = [d.blobs[0], rng(5).standard_normal(6).astype(F32)]
    c.blobs = [b.copy() for b in d.blobs]
    feeds = {"x": x, "o": np.zeros((2, 18 * dg, 6, 7), F32)}
    out = model.run(feeds)
    assert out["y"].shape == out["z"].shape
    np.testing.assert_allclose(out["y"], out["z"], atol=1e-5, rtol=1e-5)
    check_everywhere(model, feeds, {"y": out["z"], "z": out["z"]}, tmp_path, atol=1e-5, rtol=1e-5)


def test_weights_attach_from_a_caffemodel(tmp_path):
    text = net(layer("num_output: 4 kernel_size: 3 pad: 1 group: 2 deformable_group: 1"),
               inputs={"x": (1, 2, 5, 6), "o": (1, 18, 5, 6)})
    w = rng(6).standard_normal((4, 1, 3, 3)).astype(F32)
    b = rng(7).standard_normal(4).astype(F32)
    (tmp_path / "d.prototxt").write_text(text)
    write_caffemodel(parse_prototxt_text(text), {"d": [BlobData(w), BlobData(b)]}, tmp_path / "d.caffemodel")
    model = caffeq.load(tmp_path / "d.prototxt", tmp_path / "d.caffemodel")
    node = node_of(model, "d")
    assert np.array_equal(node.blobs[0], w) and np.array_equal(node.blobs[1], b)
    x = rng(8).standard_normal((1, 2, 5, 6)).astype(F32)
    off = rng(9).standard_normal((1, 18, 5, 6)).astype(F32)
    ref = fork_forward(x, off, w, b, (1, 1), (1, 1), (1, 1), 2, 1)
    np.testing.assert_allclose(model.run({"x": x, "o": off})["y"], ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("param, x_shape, off_shape, msg", [
    ("num_output: 4 kernel_size: 3", (1, 6, 5, 5), (1, 72, 5, 5), "input channels 6 not divisible by deformable_group 4"),
    ("num_output: 4 kernel_size: 3 deformable_group: 2", (1, 4, 5, 5), (1, 18, 5, 5),
     r"offsets \(bottom 1\) need 2 x kernel_h x kernel_w x deformable_group = 2 x 3 x 3 x 2 = 36 channels, got 18"),
    # Xdet's examples/mnist/lenet_train_test.prototxt: its offsets come from an unpadded 3 x 3 convolution
    ("num_output: 4 kernel_size: 3 pad: 2 dilation: 2", (1, 8, 8, 8), (1, 72, 4, 4),
     "offsets .* must have the data's height and width 8 x 8, as the forks check, got 4 x 4"),
    ("num_output: 4 kernel_size: 3 deformable_group: 1", (2, 4, 5, 5), (1, 18, 5, 5), "must have the data's batch 2"),
    ("num_output: 3 kernel_size: 3 group: 2 deformable_group: 1", (1, 4, 5, 5), (1, 18, 5, 5),
     "num_output 3 not divisible by group 2"),
    ("num_output: 4 kernel_size: 3 deformable_group: 1 axis: 2", (1, 4, 5, 5), (1, 18, 5, 5), "axis must be 1"),
    ("num_output: 4", (1, 4, 5, 5), (1, 18, 5, 5), "kernel_size is required"),
    ("kernel_size: 3", (1, 4, 5, 5), (1, 18, 5, 5), "num_output is required"),
    ("num_output: 4 kernel_size: 3 deformable_group: 0", (1, 4, 5, 5), (1, 18, 5, 5), "deformable_group must be >= 1"),
    ("num_output: 4 kernel_size: 3 stride_h: 2", (1, 4, 5, 5), (1, 72, 5, 5), r"stride_w must be >= 1, got 0 \(not set\)"),
    ("num_output: 4 kernel_h: 3", (1, 4, 5, 5), (1, 72, 5, 5), "kernel_w must be >= 1"),
    ("num_output: 4 kernel_size: 9 deformable_group: 1", (1, 4, 5, 5), (1, 162, 5, 5), "output would be empty"),
])
def test_refuses_what_the_fork_refuses(param, x_shape, off_shape, msg):
    with pytest.raises(LayerError, match=msg) as e:
        load_from_text(net(layer(param), inputs={"x": x_shape, "o": off_shape}))
    assert "\n" not in str(e.value)


def test_blob_counts():
    with pytest.raises(LayerError, match=r"takes 2 bottoms \(data, offsets\) and one top, got 1 and 1"):
        load_from_text(net(layer("num_output: 4 kernel_size: 3", bottoms=("x",)), inputs={"x": (1, 4, 5, 5)}))


def test_output_larger_than_the_offsets_is_read_but_not_run(tmp_path):
    """pad 1 around a 1 x 1 filter: 7 x 9 outputs, 5 x 7 offsets; the kernel would read past them."""
    model, _ = deform_model("num_output: 2 kernel_size: 1 pad: 1 deformable_group: 1", (1, 3, 5, 7), (1, 2, 5, 7))
    assert model.blob_shapes["y"] == (1, 2, 7, 9)
    feeds = {"x": np.zeros((1, 3, 5, 7), F32), "o": np.zeros((1, 2, 5, 7), F32)}
    with pytest.raises(LayerError, match="layer 'd' .*would read past each image's offsets"):
        model.run(feeds)
    with pytest.raises(ExportError, match="would read past"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_a_smaller_output_is_noted():
    model, _ = deform_model("num_output: 2 kernel_size: 3 stride: 2 deformable_group: 1", (1, 3, 7, 9), (1, 18, 7, 9))
    assert any("reads the first 18 x 3 x 4 values of its offsets, as 18 planes of 3 x 4" in n for n in model.warnings)


# ---- ModulatedDeformableConvolution (DCNv2, zhanglonghao1992/Deformable-ConvNets-v1-v2-caffe) ----------------

def dcnv2_bilinear(img, hy, wx, height, width):
    """modulated_deformable_im2col.cu's dmcn_im2col_bilinear: each neighbour read only inside the image."""
    h_low, w_low = math.floor(hy), math.floor(wx)
    h_high, w_high = h_low + 1, w_low + 1
    lh, lw = hy - h_low, wx - w_low
    hh, hw = 1 - lh, 1 - lw
    v1 = img[h_low, w_low] if h_low >= 0 and w_low >= 0 else 0.0
    v2 = img[h_low, w_high] if h_low >= 0 and w_high <= width - 1 else 0.0
    v3 = img[h_high, w_low] if h_high <= height - 1 and w_low >= 0 else 0.0
    v4 = img[h_high, w_high] if h_high <= height - 1 and w_high <= width - 1 else 0.0
    return hh * hw * v1 + hh * lw * v2 + lh * hw * v3 + lh * lw * v4


def dcnv2_forward(x, off, mask, weight, bias, stride, pad, dil, group, dg):
    """The fork's kernel: offsets and mask read as planes of Ho x Wo from each image's start; a tap reads 0 unless
    -1 < y < H and -1 < x < W; the sample times the mask; then the grouped GEMM."""
    n, c, h, w = x.shape
    cout, cin_g, kh, kw = weight.shape
    ho = (h + 2 * pad[0] - (dil[0] * (kh - 1) + 1)) // stride[0] + 1
    wo = (w + 2 * pad[1] - (dil[1] * (kw - 1) + 1)) // stride[1] + 1
    taps = kh * kw
    o = off.reshape(n, -1)[:, :dg * 2 * taps * ho * wo].reshape(n, dg, 2 * taps, ho, wo).astype(np.float64)
    m = mask.reshape(n, -1)[:, :dg * taps * ho * wo].reshape(n, dg, taps, ho, wo).astype(np.float64)
    cols = np.zeros((n, c * taps, ho, wo))
    for b in range(n):
        for ch in range(c):
            g = ch // (c // dg)
            for i in range(kh):
                for j in range(kw):
                    t = i * kw + j
                    for y in range(ho):
                        for z in range(wo):
                            hy = y * stride[0] - pad[0] + i * dil[0] + o[b, g, 2 * t, y, z]
                            wx = z * stride[1] - pad[1] + j * dil[1] + o[b, g, 2 * t + 1, y, z]
                            val = 0.0
                            if -1 < hy < h and -1 < wx < w:
                                val = dcnv2_bilinear(x[b, ch].astype(np.float64), hy, wx, h, w)
                            cols[b, ch * taps + t, y, z] = val * m[b, g, t, y, z]
    cols = cols.reshape(n, group, cin_g * taps, ho * wo)
    wmat = weight.astype(np.float64).reshape(group, cout // group, cin_g * taps)
    out = np.einsum("gok,ngkl->ngol", wmat, cols).reshape(n, cout, ho, wo)
    return out if bias is None else out + bias.reshape(1, cout, 1, 1)


@pytest.mark.parametrize("param, x_shape, kernel, dg", [
    ("kernel_size: 3 pad: 1 num_output: 4 group: 2 deformable_group: 2", (2, 4, 5, 7), (3, 3), 2),
    # stride: the output is smaller than the offsets and mask, both read from their start; deformable_group 1
    ("kernel_h: 3 kernel_w: 2 stride: 2 pad_h: 1 pad_w: 0 num_output: 3 bias_term: false", (1, 2, 7, 5), (3, 2), 1),
])
def test_modulated_deformable_matches_the_forks_kernel(param, x_shape, kernel, dg, tmp_path):
    taps = kernel[0] * kernel[1]
    off_shape, mask_shape = (x_shape[0], 2 * taps * dg) + x_shape[2:], (x_shape[0], taps * dg) + x_shape[2:]
    text = net(layer(param, bottoms=("x", "o", "m")).replace('"DeformableConvolution"', '"ModulatedDeformableConvolution"')
               .replace("deformable_convolution_param", "modulated_deformable_convolution_param"),
               inputs={"x": x_shape, "o": off_shape, "m": mask_shape})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "d")
    if len(node.blobs) == 2:
        node.blobs = [node.blobs[0], rng(3).standard_normal(node.blobs[1].shape).astype(F32)]
    x = rng(1).standard_normal(x_shape).astype(F32)
    off = (rng(2).standard_normal(off_shape) * 2.0).astype(F32)
    off.reshape(-1)[::5] = np.round(off.reshape(-1)[::5])     # whole pixels: taps on the edges and at -1
    mask = rng(4).random(mask_shape).astype(F32)
    a = node.attrs
    bias = node.blobs[1] if a["bias_term"] else None
    ref = dcnv2_forward(x, off, mask, node.blobs[0], bias, a["stride"], a["pad"], a["dilation"], a["group"], dg)
    check_everywhere(model, {"x": x, "o": off, "m": mask}, {"y": ref.astype(F32)}, tmp_path, atol=2e-5, rtol=1e-5,
                     opsets=(None,))
    with pytest.raises(ExportError, match="DeformConv from opset 19"):
        model.export_onnx(str(tmp_path / "old.onnx"), opset=13)
