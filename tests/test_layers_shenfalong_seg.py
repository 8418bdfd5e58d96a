"""shenfalong/styletransfer (cebf7e2) segmentation layers (caffeq/layers/shenfalong_seg.py): numpy references
written from the fork's kernels (func/shortcut_layer.cu, operator/multi_conv_layer.cu, util/math_functions.cu
box_filter_gpu, activation/image_resize_layer.cu, operator/guided_crf_layer.cu), compared in torch, onnxruntime
and model.py."""
import numpy as np
import pytest
import torch
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text


def one(layer, **inputs):
    return load_from_text(net(layer, inputs=inputs), random_weights=True)


# ---- Shortcut ----

def test_shortcut_adds_its_two_bottoms(tmp_path):
    shape = (2, 3, 5, 7)
    model = one('layer { name: "s" type: "Shortcut" bottom: "x" bottom: "y" top: "o" '
                'shortcut_param { scale: 1 dropout_ratio: 0 } }', x=shape, y=shape)
    x, y = rng(1).standard_normal(shape).astype(np.float32), rng(2).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x, "y": y}, {"o": x + y}, tmp_path)


def test_shortcut_refuses_two_shapes():
    with pytest.raises(CaffeqError, match="two bottoms of one shape"):
        one('layer { name: "s" type: "Shortcut" bottom: "x" bottom: "y" top: "o" }', x=(2, 3, 5, 7), y=(2, 3, 5, 6))


# ---- MultiConvolution ----

def multi_conv_ref(x, w, b, multi, num_output, k, stride, pad, dil, group):
    """im2col + per-group gemm into (N, multi^2 O, H', W'), then rearange_multi_conv_forwardkernel's indexing."""
    n, c, h, wd = x.shape
    keff = k + (k - 1) * (dil - 1)
    ho, wo = (h + 2 * pad - keff) // stride + 1, (wd + 2 * pad - keff) // stride + 1
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    outs = multi * multi * num_output
    buf = np.zeros((n, outs, ho, wo))
    cg, og = c // group, outs // group
    for o in range(outs):
        g = o // og
        for i in range(k):
            for j in range(k):
                patch = xp[:, g * cg:(g + 1) * cg, i * dil:i * dil + stride * (ho - 1) + 1:stride,
                           j * dil:j * dil + stride * (wo - 1) + 1:stride]
                buf[:, o] += np.einsum("nchw,c->nhw", patch, w[o, :, i, j].astype(np.float64))
        if b is not None:
            buf[:, o] += b[o]
    flat = buf.reshape(-1)
    height, width = ho * multi, wo * multi
    top = np.zeros(n * num_output * height * width)
    for index in range(top.size):
        nn_ = index // width // height // num_output
        cc = index // width // height % num_output
        hh = index // width % height
        ww = index % width
        m = hh % multi * multi + ww % multi
        in_index = (((nn_ * multi * multi + m) * num_output + cc) * height // multi + hh // multi) * width // multi \
            + ww // multi
        top[index] = flat[in_index]
    return top.reshape(n, num_output, height, width)


@pytest.mark.parametrize("multi, num_output, k, stride, pad, dil, group, bias", [
    (2, 3, 3, 1, 2, 2, 1, True),     # the segmentation net's dilated 3x3 with a bias
    (3, 2, 2, 2, 1, 1, 2, False),    # odd multi, stride and groups, no bias (the fork's default)
])
def test_multi_convolution_spreads_the_channels_over_a_larger_map(tmp_path, multi, num_output, k, stride, pad, dil,
                                                                  group, bias):
    shape = (2, 4, 7, 9)
    bias_line = "bias_term: true" if bias else ""
    model = one(f'layer {{ name: "m" type: "MultiConvolution" bottom: "x" top: "o" convolution_param {{ '
                f'multi: {multi} num_output: {num_output} kernel_size: {k} stride: {stride} pad: {pad} '
                f'filter_stride: {dil} group: {group} {bias_line} }} }}', x=shape)
    node = model.graph.node("m")
    outs = multi * multi * num_output
    assert [tuple(b.shape) for b in node.blobs] == [(outs, 4 // group, k, k)] + ([(outs, 1, 1, 1)] if bias else [])
    if bias:
        node.blobs[1][:] = rng(3).standard_normal((outs, 1, 1, 1)).astype(np.float32)
    x = rng(1).standard_normal(shape).astype(np.float32)
    ref = multi_conv_ref(x, node.blobs[0], node.blobs[1].reshape(-1) if bias else None, multi, num_output, k,
                         stride, pad, dil, group)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_multi_convolution_needs_multi():
    with pytest.raises(CaffeqError, match="convolution_param.multi must be >= 1"):
        one('layer { name: "m" type: "MultiConvolution" bottom: "x" top: "o" '
            'convolution_param { num_output: 2 kernel_size: 1 } }', x=(2, 4, 7, 9))


# ---- BoxFilter ----

def box_filter_ref(x, r):
    """box_filter_x_kernel then box_filter_y_kernel: running float32 sums, over min(2r+1, H) min(2r+1, W)."""
    n, c, h, w = x.shape
    x = x.astype(np.float32)
    mid = np.zeros_like(x)
    for row in np.ndindex(n, c, h):
        s = np.float32(0)
        for j in range(0, min(r, w - 1) + 1):
            s = np.float32(s + x[row][j])
        mid[row][0] = s
        for j in range(1, w - r):
            s = np.float32(s + x[row][j + r])
            if j - r > 0:
                s = np.float32(s - x[row][j - r - 1])
            mid[row][j] = s
        for j in range(max(w - r, 1), w):
            if j - r > 0:
                s = np.float32(s - x[row][j - r - 1])
            mid[row][j] = s
    area = np.float32(min(2 * r + 1, h) * min(2 * r + 1, w))
    out = np.zeros_like(x)
    for a, b, j in np.ndindex(n, c, w):
        col = mid[a, b, :, j]
        s = np.float32(0)
        for i in range(0, min(r, h - 1) + 1):
            s = np.float32(s + col[i])
        out[a, b, 0, j] = s / area
        for i in range(1, h - r):
            s = np.float32(s + col[i + r])
            if i - r > 0:
                s = np.float32(s - col[i - r - 1])
            out[a, b, i, j] = s / area
        for i in range(max(h - r, 1), h):
            if i - r > 0:
                s = np.float32(s - col[i - r - 1])
            out[a, b, i, j] = s / area
    return out


@pytest.mark.parametrize("radius, r", [("2", 2), ("2.7", 2), ("3", 3), ("0", 0)])
def test_box_filter_divides_the_clipped_sum_by_one_area(tmp_path, radius, r):
    shape = (2, 3, 5, 8)      # radius 3: a 7x7 window wider than the 5 rows, area 5 x 7
    model = one(f'layer {{ name: "b" type: "BoxFilter" bottom: "x" top: "o" crf_param {{ radius: {radius} }} }}',
                x=shape)
    x = rng(1).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"o": box_filter_ref(x, r)}, tmp_path, atol=1e-6, rtol=1e-5)


def test_box_filter_refuses_a_negative_radius():
    with pytest.raises(CaffeqError, match="crf_param.radius must be >= 0"):
        one('layer { name: "b" type: "BoxFilter" bottom: "x" top: "o" crf_param { radius: -2 } }', x=(2, 3, 5, 8))


# ---- ImageResize ----

def image_resize_ref(x, r):
    """shenfalong/SegModel's loop: the float image in a CV_32FC3 cv::Mat (ptr<Dtype>), cv::resize INTER_AREA
    (area-fast: r x r blocks, sums of groups of four added to a running float sum, times 1/r^2), read back."""
    n, c, h, w = x.shape
    if r == 1:
        return x.copy()
    ho, wo = h // r, w // r
    out = np.zeros((n, c, ho, wo), np.float32)
    for item, ch, i, j in np.ndindex(n, c, ho, wo):
        vals = [x[item, ch, i * r + a, j * r + b] for a in range(r) for b in range(r)]
        s, k = np.float32(0), 0
        while k + 4 <= len(vals):
            s = np.float32(s + np.float32(np.float32(np.float32(vals[k] + vals[k + 1]) + vals[k + 2]) + vals[k + 3]))
            k += 4
        while k < len(vals):
            s = np.float32(s + vals[k])
            k += 1
        out[item, ch, i, j] = np.float32(s * np.float32(1.0 / (r * r)))
    return out


@pytest.mark.parametrize("ratio, r, shape", [("4", 4, (2, 3, 12, 32)), ("2.5", 2, (2, 3, 6, 10)),
                                              ("3", 3, (2, 3, 9, 6)), ("1", 1, (2, 3, 5, 7))])
def test_image_resize_is_opencvs_area_shrink(tmp_path, ratio, r, shape):
    model = one(f'layer {{ name: "r" type: "ImageResize" bottom: "x" top: "o" interp_param {{ interp_ratio: {ratio} }} '
                f'}}', x=shape)
    x = rng(1).uniform(-300, 600, shape).astype(np.float32)
    x[0, 0, 0, :2] = [1e30, -1e-30]
    check_everywhere(model, {"x": x}, {"o": image_resize_ref(x, r)}, tmp_path, atol=0, rtol=0, opsets=())


@pytest.mark.parametrize("r", [2, 3, 4])
def test_image_resize_reference_is_opencvs(r):
    cv2 = pytest.importorskip("cv2")
    x = (rng(2).standard_normal((1, 3, 4 * r, 5 * r)) * 1e3).astype(np.float32)
    hwc = np.ascontiguousarray(x[0].transpose(1, 2, 0))
    got = cv2.resize(hwc, (5, 4), interpolation=cv2.INTER_AREA).transpose(2, 0, 1)
    np.testing.assert_array_equal(got[None], image_resize_ref(x, r))


def test_image_resize_ratio_one_copies_negative_zeros():
    """cv::resize of an image to its own size copies it (a sum would turn -0 into +0)."""
    from caffeq.layers.shenfalong_seg import area_shrink
    x = np.full((1, 3, 2, 4), -0.0, np.float32)
    assert np.signbit(area_shrink(torch.from_numpy(x), 1).numpy()).all()
    cv2 = pytest.importorskip("cv2")
    assert np.signbit(cv2.resize(x[0].transpose(1, 2, 0), (4, 2), interpolation=cv2.INTER_AREA)).all()


@pytest.mark.parametrize("shape, match", [((2, 3, 12, 30), "not a multiple"), ((2, 3, 13, 32), "not a multiple"),
                                          ((2, 4, 12, 32), "3 channels")])
def test_image_resize_refuses_what_leaves_the_top_unwritten(shape, match):
    with pytest.raises(CaffeqError, match=match):
        one('layer { name: "r" type: "ImageResize" bottom: "x" top: "o" interp_param { interp_ratio: 4 } }', x=shape)


# ---- GuidedCRF ----

def box64(x, r):
    """box_filter_gpu in float64: the clipped window sum over min(2r+1, H) min(2r+1, W)."""
    h, w = x.shape[-2:]
    out = np.zeros_like(x, np.float64)
    for i in range(h):
        for j in range(w):
            out[..., i, j] = x[..., max(0, i - r):i + r + 1, max(0, j - r):j + r + 1].sum(axis=(-2, -1))
    return out / (min(2 * r + 1, h) * min(2 * r + 1, w))


def guided_crf_ref(unary, image, compat, r, max_iter, alpha, eps):
    n, m, h, w = unary.shape
    unary, image = unary.astype(np.float64), image.astype(np.float64)
    weights = compat.reshape(m, m).astype(np.float64)
    mean_i = box64(image, r)
    var = np.zeros((n, 3, 3, h, w))
    for c2 in range(3):
        for c1 in range(3):
            var[:, c2, c1] = box64(image[:, c1] * image[:, c2], r) - mean_i[:, c1] * mean_i[:, c2]
    state = unary.copy()
    for _ in range(max_iter):
        flat = state.reshape(m, -1)                       # softmax_forward_kernel: prob[s * nNodes + node]
        e = np.exp(flat - flat.max(axis=0))
        prob = (e / e.sum(axis=0)).reshape(n, m, h, w)
        for c in range(3):
            var[:, c, c] += eps                           # inv_var_I_eps_kernel_3 adds eps in place
        mean_p = box64(prob, r)
        a = np.zeros((n, m, 3, h, w))
        for item, i, j in np.ndindex(n, h, w):
            inv = np.linalg.inv(var[item, :, :, i, j])
            for s in range(m):
                cov = box64(image[item] * prob[item, s], r)[:, i, j] - mean_i[item, :, i, j] * mean_p[item, s, i, j]
                a[item, s, :, i, j] = inv @ cov
        bb = mean_p - (mean_i[:, None] * a).sum(axis=2)
        q = (image[:, None] * box64(a, r)).sum(axis=2) + box64(bb, r)
        state = unary + alpha * (weights @ q.reshape(m, -1)).reshape(n, m, h, w)
    return state



@pytest.mark.parametrize("n, radius, iters", [(2, 1, 3), (1, 2, 2)])
def test_guided_crf_mean_field_with_the_image_guide(tmp_path, n, radius, iters):
    m, h, w = 4, 5, 7
    model = one(f'layer {{ name: "g" type: "GuidedCRF" bottom: "u" bottom: "i" top: "o" '
                f'crf_param {{ max_iter: {iters} radius: {radius} alpha: -2 eps: 0.5 }} param {{ }} }}',
                u=(n, m, h, w), i=(n, 3, h, w))
    node = model.graph.node("g")
    assert node.blobs[0].shape == (1, 1, m, m)
    np.testing.assert_array_equal(node.blobs[0].reshape(m, m), 1 - np.eye(m))   # the fork's initial blob
    node.blobs[0][:] = rng(3).uniform(-1, 1, (1, 1, m, m)).astype(np.float32)
    u = (rng(1).standard_normal((n, m, h, w)) * 2).astype(np.float32)
    img = rng(2).uniform(0, 2, (n, 3, h, w)).astype(np.float32)
    ref = guided_crf_ref(u, img, node.blobs[0], radius, iters, -2.0, 0.5)
    check_everywhere(model, {"u": u, "i": img}, {"o": ref}, tmp_path, atol=1e-4, rtol=1e-4, opsets=())


def test_guided_crf_needs_a_three_channel_guide():
    with pytest.raises(CaffeqError, match="3 channels"):
        one('layer { name: "g" type: "GuidedCRF" bottom: "u" bottom: "i" top: "o" crf_param { radius: 1 } }',
            u=(2, 4, 5, 7), i=(2, 4, 5, 7))
