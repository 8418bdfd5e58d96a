"""roundchuan/P3D-CTN (797ac4a, P3D-module/caffe): DeconvTrans, Clip2Img, and its BN, Pooling3D, Normalization
and ROIPooling as caffeq's specs of those names read them.

The references are numpy written here from the fork's C++: the DeconvTrans and Clip2Img loops compute each bottom
value's top index as deconv_trans_layer.cu's and clip2img_layer.cu's kernels do; the others follow bn_layer.cpp,
pooling3d_layer.cpp, normalization_layer.cpp and roi_pooling_layer.cpp.  Each runs in torch, onnxruntime and the
generated model.py.
"""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, fast_rcnn_bins, net, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"


def deconv_trans_ref(x, stride):
    """DeconvTransForward: per bottom index, (w, h, d, c, n) by division, pos = c % f split into (k, j, i),
    out_index = n count(1) + (c / f) count(2) + (d sd + k) count(3) + (h sh + j) count(4) + w sw + i."""
    n, c, d, h, w = x.shape
    sd, sh, sw = stride
    f = sd * sh * sw
    top_shape = (n, c // f, d * sd, h * sh, w * sw)
    cnt = [int(np.prod(top_shape[a:])) for a in range(1, 5)]
    flat, top = x.reshape(-1), np.full(x.size, np.nan, np.float32)
    for index in range(x.size):
        num = index
        ww, num = num % w, num // w
        hh, num = num % h, num // h
        dd, num = num % d, num // d
        cc, num = num % c, num // c
        pos = cc % f
        i, pos = pos % sw, pos // sw
        j, pos = pos % sh, pos // sh
        k = pos % sd
        out = num * cnt[0] + (cc // f) * cnt[1] + (dd * sd + k) * cnt[2] + (hh * sh + j) * cnt[3] + ww * sw + i
        top[out] = flat[index]
    assert not np.isnan(top).any()   # the kernel writes every top value once
    return top.reshape(top_shape)


def clip2img_ref(x):
    """clip2img_forward: bottom (n, c, d, h, w) to top (n D + d) C H W + c H W + h W + w."""
    n, c, d, h, w = x.shape
    flat, top = x.reshape(-1), np.empty(x.size, np.float32)
    for index in range(x.size):
        ww, hh = index % w, index // w % h
        dd, cc, nn = index // w // h % d, index // w // h // d % c, index // w // h // d // c
        top[(nn * d + dd) * c * h * w + cc * h * w + hh * w + ww] = flat[index]
    return top.reshape(n * d, c, h, w)


def deconv_trans_text(strides, bottom="x", top="o"):
    values = " ".join(f"stride: {s}" for s in strides)
    return (f'layer {{ name: "t" type: "DeconvTrans" bottom: "{bottom}" top: "{top}" '
            f'deconv_trans_param {{ {values} }} }}')


CLIP2IMG = 'layer { name: "c" type: "Clip2Img" bottom: "x" top: "o" }'


# ---- DeconvTrans --------------------------------------------------------------------------------------

@pytest.mark.parametrize("stride, shape", [
    ((2, 2, 2), (2, 16, 3, 5, 4)),     # tcnn.prototxt's trans2..trans4
    ((1, 2, 2), (2, 12, 3, 5, 7)),     # its trans1
    ((3, 1, 2), (2, 12, 2, 3, 5)),
])
def test_deconv_trans_moves_each_value_as_the_gpu_kernel(stride, shape, tmp_path):
    x = rng(1).standard_normal(shape).astype(np.float32)
    model = load_from_text(net(deconv_trans_text(stride), inputs={"x": shape}))
    ref = deconv_trans_ref(x, stride)
    assert model.blob_shapes["o"] == ref.shape
    node = next(n for n in model.layers if n.name == "t")
    assert not node.expected_param_shapes   # DeconvTrans owns no blobs
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("layer, shape, message", [
    (deconv_trans_text((2, 2)), (2, 8, 3, 4, 5), "needs 3 values"),
    (deconv_trans_text((2, 0, 2)), (2, 8, 3, 4, 5), "deconv_trans_param.stride must be >= 1"),
    (deconv_trans_text((2, 2, 2)), (2, 12, 3, 4, 5), "not a multiple of deconv_trans_param.stride's product 8"),
    (deconv_trans_text((1, 2, 2)), (2, 8, 4, 5), "needs a 5-axis bottom"),
    (deconv_trans_text((2, 2, 2), top="x"), (2, 8, 3, 4, 5), "in-place"),
])
def test_deconv_trans_refusals(layer, shape, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(layer, inputs={"x": shape}))


# ---- Clip2Img -----------------------------------------------------------------------------------------

def test_clip2img_makes_each_frame_an_image(tmp_path):
    shape = (2, 3, 4, 5, 7)
    x = rng(2).standard_normal(shape).astype(np.float32)
    model = load_from_text(net(CLIP2IMG, inputs={"x": shape}))
    ref = clip2img_ref(x)
    assert model.blob_shapes["o"] == (8, 3, 5, 7)
    np.testing.assert_array_equal(ref[4 + 2], x[1, :, 2])   # image n D + d is frame d of clip n
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def test_clip2img_refusals():
    with pytest.raises(LayerError, match="in-place"):
        load_from_text(net(CLIP2IMG.replace('top: "o"', 'top: "x"'), inputs={"x": (2, 3, 4, 5, 7)}))
    with pytest.raises(LayerError, match="needs a 5-axis bottom"):
        load_from_text(net(CLIP2IMG, inputs={"x": (2, 3, 5, 7)}))


def test_clip2img_then_roi_pooling_as_the_jhmdb_net(tmp_path):
    # train_reg_p3d_resnet_jhmdb.prototxt: Clip2Img's images pooled by Fast R-CNN's ROIPooling (the fork's
    # roi_pooling_layer.cpp: rounded scaled corners, float bins, max, 0 for an empty bin); rois name frames
    shape, scale, (ph, pw) = (2, 3, 3, 9, 11), 0.5, (3, 2)
    x = rng(3).standard_normal(shape).astype(np.float32)
    rois = np.array([[0, 0, 0, 20, 16], [4, 3.2, 2.6, 15, 9], [5, 18, 14, 30, 30], [2, 6, 4, 6, 4]], np.float32)
    text = net(CLIP2IMG.replace('top: "o"', 'top: "img"'),
               'layer { name: "r" type: "ROIPooling" bottom: "img" bottom: "rois" top: "o" '
               f'roi_pooling_param {{ pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} }} }}',
               inputs={"x": shape, "rois": rois.shape})
    model = load_from_text(text)
    images = clip2img_ref(x)
    ref = np.zeros((len(rois), shape[1], ph, pw), np.float32)
    for r, (b, *corners) in enumerate(rois):
        # C's round: halves away from zero (corners >= 0 here)
        x1, y1, x2, y2 = (int(np.floor(np.float32(v) * np.float32(scale) + 0.5)) for v in corners)
        for i, j, hs, he, ws, we in fast_rcnn_bins(x1, y1, x2, y2, ph, pw, shape[3], shape[4]):
            if he > hs and we > ws:
                ref[r, :, i, j] = images[int(b), :, hs:he, ws:we].max(axis=(1, 2))
    check_everywhere(model, {"x": x, "rois": rois}, {"o": ref}, tmp_path)


# ---- the fork's BN, Pooling3D and Normalization under caffeq's specs of those names ------------------

BN_FIELDS = ('bn_param { slope_filler { type: "constant" value: 1 } bias_filler { type: "constant" value: 0 } '
             'frozen: false }')


def bn_text(bottom="x"):
    # the jhmdb net's BN: PSPNet's fields, four param entries
    return (f'layer {{ name: "b" type: "BN" bottom: "{bottom}" top: "b" ' + "param { lr_mult: 0 } " * 4
            + BN_FIELDS + " }")


def bn_ref(x, slope, bias, mean, var, eps=1e-5):
    """bn_layer.cpp at TEST: (x - mean) * (var + eps)^-1/2 * slope + bias, per channel, blobs (1, C)."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    s, b, m, v = (a.astype(np.float64).reshape(shape) for a in (slope, bias, mean, var))
    return (x.astype(np.float64) - m) * (v + np.float32(eps)) ** -0.5 * s + b


@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 7), (2, 3, 5, 7), (2, 3)], ids=["clip", "after_roi_pooling", "items"])
def test_p3d_ctn_bn_reads_its_1_by_c_blobs_for_5_and_4_axis_bottoms(shape, tmp_path):
    from caffeq.io.prototxt import parse_prototxt_text
    from caffeq.io.writer import write_caffemodel
    text = net(bn_text(), inputs={"x": shape})
    g = rng(4)
    blobs = [g.uniform(0.5, 2, (1, 3)), g.standard_normal((1, 3)), g.standard_normal((1, 3)),
             g.uniform(0.1, 3, (1, 3))]
    blobs = [b.astype(np.float32) for b in blobs]
    (tmp_path / "n.prototxt").write_text(text)
    write_caffemodel(parse_prototxt_text(text), {"b": blobs}, tmp_path / "n.caffemodel")
    model = load(str(tmp_path / "n.prototxt"), weights=str(tmp_path / "n.caffemodel"))
    # a 4-axis (or (N, C)) bottom's blobs are (1, C, 1, 1) in caffeq (PSPNet's): the fork's (1, C) ones are read
    # as those; bn_layer.cpp makes them (1, C) whatever the bottom's axes
    assert any("read as (1, C, 1, 1)" in w for w in model.warnings) == (len(shape) in (2, 4))
    x = (rng(5).standard_normal(shape) * 2 + 0.5).astype(np.float32)
    check_everywhere(model, {"x": x}, {"b": bn_ref(x, *blobs)}, tmp_path, atol=1e-5, rtol=1e-5)


def pool3d_ref(x, kernel, stride, ave):
    """pooling3d_layer.cpp without padding: ceil((n - k) / s) + 1 windows per axis, each clipped to the
    input; MAX the largest value, AVE the sum over the clipped window's size."""
    out = [-(-(n - k) // s) + 1 for n, k, s in zip(x.shape[2:], kernel, stride)]
    top = np.zeros(x.shape[:2] + tuple(out), np.float64)
    for pl in range(out[0]):
        for ph in range(out[1]):
            for pw in range(out[2]):
                ls, hs, ws = pl * stride[0], ph * stride[1], pw * stride[2]
                win = x[:, :, ls:ls + kernel[0], hs:hs + kernel[1], ws:ws + kernel[2]].astype(np.float64)
                top[:, :, pl, ph, pw] = win.mean(axis=(2, 3, 4)) if ave else win.max(axis=(2, 3, 4))
    return top


@pytest.mark.parametrize("params, kernel, stride, ave", [
    ("pool: MAX pad: 0 kernel_size: 3 stride: 2 pad_l: 0 kernel_l: 2 stride_l: 2", (2, 3, 3), (2, 2, 2), False),
    ("pool: MAX pad: 0 kernel_size: 1 stride: 1 pad_l: 0 kernel_l: 2 stride_l: 2", (2, 1, 1), (2, 1, 1), False),
    ("pool: AVE kernel_size: 3 stride: 2 kernel_l: 2 stride_l: 2", (2, 3, 3), (2, 2, 2), True),
], ids=["pool1", "3a_pool", "ave"])
def test_p3d_ctn_pooling3d(params, kernel, stride, ave, tmp_path):
    shape = (2, 3, 5, 8, 11)   # odd length: the last temporal window is clipped (ceil)
    x = rng(6).standard_normal(shape).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "p" type: "Pooling3D" bottom: "x" top: "p" '
                               f'pooling3d_param {{ {params} }} }}', inputs={"x": shape}))
    ref = pool3d_ref(x, kernel, stride, ave)
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_p3d_ctn_normalization_values(tmp_path):
    # normalization_layer.cpp: each item times pow(sum of its squares, -0.5).  The fork's top is
    # (N, C H W); caffeq's Normalization keeps the bottom's shape (Binbin Xu's ReshapeLike), the same values
    # in the same order: the reference is given that shape
    shape = (2, 3, 1, 1)   # the jhmdb net's pool5: (R, 2048, 1, 1)
    x = rng(7).standard_normal(shape).astype(np.float32)
    model = load_from_text(net('layer { name: "n" type: "Normalization" bottom: "x" top: "o" }',
                               inputs={"x": shape}))
    items = x.reshape(2, -1).astype(np.float64)
    ref = items * (items ** 2).sum(axis=1, keepdims=True) ** -0.5
    check_everywhere(model, {"x": x}, {"o": ref.reshape(shape)}, tmp_path, atol=1e-6, rtol=1e-6)


# ---- the corpus files ---------------------------------------------------------------------------------

JHMDB_SHAPES = {"data": (1, 3, 16, 300, 400), "tois": (3, 5), "toi2": (3, 5), "targets": (3, 84),
                "masks": (3, 84)}   # its Reshape asks res4's 19 x 25 map: 300 x 400 frames


@pytest.mark.parametrize("name, shapes, blob, expected", [
    ("P3D-module__caffe__python__tcnn", {"data": (2, 3, 16, 112, 112), "label": (2, 1, 16, 112, 112)}, "trans1",
     (2, 64, 16, 112, 112)),
    ("P3D-module__model_kinetics__train_reg_p3d_resnet_jhmdb", JHMDB_SHAPES, "transpose", (16, 64, 150, 200)),
    ("P3D-module__model_kinetics_flow__deploy_p3d_resnet_kinetics_flow", None, "prob", (1, 400)),
    ("2D-module__models__UCF101__ResNet_101__train_1", None, None, None),
])
def test_corpus_files_read(name, shapes, blob, expected):
    path = CORPUS / f"roundchuan__P3D-CTN__{name}.prototxt"
    model = load(str(path), input_shapes=shapes) if shapes else load(str(path), unknown_shapes_ok=True)
    if blob:
        assert model.blob_shapes[blob] == expected
    else:
        assert any(n.type == "ROIPooling" for n in model.layers)
