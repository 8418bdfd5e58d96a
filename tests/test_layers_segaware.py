"""aharley/segaware's Im2dist and Im2parity against loops written from its util/im2dist.cpp and
util/im2parity.cpp (CPU forwards, the same as its CUDA kernels), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32
FAR = f32(np.finfo(f32).max) / f32(100)


def out_size(size, k, p, s, d):
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def fork_windows(x, k, p, s, d):
    """The forks' loop order (item, channel, window offset, output row, column): (item, channel, top index,
    neighbour (row, col), centre (row, col), whether the centre and the neighbour lie in the map)."""
    n, c, h, w = x.shape
    oh, ow = out_size(h, k, p, s, d), out_size(w, k, p, s, d)
    for b in range(n):
        for ci in range(c):
            for i in range(k):
                for j in range(k):
                    for y in range(oh):
                        for z in range(ow):
                            hi, wi = y * s - p + i * d, z * s - p + j * d
                            cy, cx = y * s - p + (k // 2) * d, z * s - p + (k // 2) * d
                            yield (b, ci, (b, i * k + j, y, z), (hi, wi), (cy, cx), 0 <= cy < h and 0 <= cx < w,
                                   0 <= hi < h and 0 <= wi < w)


def top_like(x, k, p, s, d):
    n, _, h, w = x.shape
    return np.zeros((n, k * k, out_size(h, k, p, s, d), out_size(w, k, p, s, d)), f32)


def im2dist_ref(x, k, p, s, d, l2=True, remove_center=False, remove_bounds=False):
    top = top_like(x, k, p, s, d)
    for b, ci, o, here, centre, centre_in, here_in in fork_windows(x, k, p, s, d):
        if not centre_in:
            continue
        if remove_center and here == centre:
            top[o] = FAR
        elif here_in:
            diff = f32(x[(b, ci) + centre] - x[(b, ci) + here])
            term = f32(diff * diff) * f32(0.5) if l2 else abs(diff)
            top[o] = f32(top[o] + term)                       # channel by channel, in float
        elif remove_bounds:
            top[o] = FAR
    return top


def im2parity_ref(x, k, p, s, d, ignore=None):
    top = top_like(x, k, p, s, d)
    for b, ci, o, here, centre, centre_in, here_in in fork_windows(x, k, p, s, d):   # the last channel stays
        if not centre_in:
            top[o] = ignore
            continue
        label_c = int(x[(b, ci) + centre])
        label_h = int(x[(b, ci) + here]) if here_in else 0
        if ignore is not None and ignore in (label_h, label_c):
            top[o] = ignore
        else:
            top[o] = label_h == label_c
    return top


def window_net(kind, shape, conv, extra=""):
    return net(f'layer {{ name: "l" type: "{kind}" bottom: "x" top: "y" convolution_param {{ {conv} }} {extra} }}',
               inputs={"x": shape})


@pytest.mark.parametrize("conv, k, p, s, d, extra, opts", [
    ("kernel_size: 3 pad: 1", 3, 1, 1, 1, "", {}),
    ("kernel_size: 3 pad: 2 dilation: 2", 3, 2, 1, 2, "im2dist_param { norm: L1 }", {"l2": False}),
    ("kernel_size: 3 pad: 3 stride: 2", 3, 3, 2, 1, "im2dist_param { remove_center: true remove_bounds: true }",
     {"remove_center": True, "remove_bounds": True}),
    ("kernel_size: 4", 4, 0, 1, 1, "", {}),
])
def test_im2dist_matches_the_forks_loops(conv, k, p, s, d, extra, opts, tmp_path):
    x = rng(51).standard_normal((2, 5, 6, 7)).astype(f32)
    model = load_from_text(window_net("Im2dist", x.shape, conv, extra))
    ref = im2dist_ref(x, k, p, s, d, **opts)
    assert model.blob_shapes["y"] == ref.shape
    assert model.run({"x": x}, exact=True)["y"].tobytes() == ref.tobytes()    # bit for bit in torch
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("conv, k, p, s, d, ignore", [
    ("kernel_size: 3 pad: 1", 3, 1, 1, 1, 255),
    ("kernel_size: 3 dilation: 2 pad: 2", 3, 2, 1, 2, None),
    ("kernel_size: 5 pad: 3 stride: 2", 5, 3, 2, 1, 255),
])
def test_im2parity_matches_the_forks_loops(conv, k, p, s, d, ignore, tmp_path):
    g = rng(52)
    x = g.integers(0, 3, (2, 2, 6, 7)).astype(f32) + f32(0.25)     # labels read as int (truncated)
    if ignore is not None:
        x[0, 1, 2, 3] = ignore
    extra = f"im2parity_param {{ ignore_label: {ignore} }}" if ignore is not None else ""
    model = load_from_text(window_net("Im2parity", x.shape, conv, extra))
    ref = im2parity_ref(x, k, p, s, d, ignore)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_im2parity_refuses_an_uninitialized_ignore_label():
    with pytest.raises(LayerError, match="uninitialized ignore label; set ignore_label"):
        load_from_text(window_net("Im2parity", (1, 1, 5, 5), "kernel_size: 3 pad: 2"))


# ---- Convolution with bottom_is_im2col (base_conv_layer.cpp: the bottom is the column buffer) ----

def test_convolution_on_an_im2col_bottom_is_the_plain_convolution(tmp_path):
    # Im2col then the bottom_is_im2col Convolution gives what the Convolution gives on the image
    g = rng(53)
    x = g.standard_normal((2, 4, 7, 6)).astype(f32)
    conv = "num_output: 6 kernel_size: 3 pad: 1 group: 2"
    text = net('layer { name: "cols" type: "Im2col" bottom: "x" top: "cols" convolution_param { kernel_size: 3 pad: 1 } }',
               f'layer {{ name: "c" type: "Convolution" bottom: "cols" top: "y" convolution_param {{ {conv} '
               f'bottom_is_im2col: true }} }}',
               f'layer {{ name: "plain" type: "Convolution" bottom: "x" top: "z" convolution_param {{ {conv} }} }}',
               inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["cols"] == (2, 36, 7, 6) and model.blob_shapes["y"] == (2, 6, 7, 6)
    weight, bias = (np.asarray(b) for b in model.params["c"])
    assert weight.shape == (6, 2, 3, 3)
    plain = next(n for n in model.layers if n.name == "plain")
    plain.blobs = [weight.copy(), bias.copy()]
    model.clear_cache()
    z = model.run({"x": x}, exact=True)["z"]
    # each group's gemm over its columns, as the fork's forward_cpu_gemm
    cols = model.run({"x": x}, all_blobs=True)["cols"].astype(np.float64).reshape(2, 2, 18, 42)
    w = weight.astype(np.float64).reshape(2, 3, 18)
    ref = (np.einsum("gok,ngkp->ngop", w, cols).reshape(2, 6, 7, 6) + bias.reshape(1, 6, 1, 1))
    np.testing.assert_allclose(z, ref, rtol=1e-5, atol=1e-5)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_im2col_bottom_convolution_checks_its_columns():
    with pytest.raises(LayerError, match=r"im2col columns \(N, C x 9, H, W\)"):
        load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { '
                           'num_output: 2 kernel_size: 3 bottom_is_im2col: true } }', inputs={"x": (1, 10, 4, 4)}))
