"""vincentzhang/roi-fcn's ROIConvolution: the reference is the fork's GPU path written as loops
(rois_convert_coordinate's CUDA round, roi_im2col_gpu's one test per output window, the GEMM and the bias
everywhere), compared in torch, onnxruntime and model.py on both tops."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def cuda_round(v):
    return math.copysign(math.floor(abs(v) + 0.5), v)


def reference(x, rois, w, b, stride, pad, scale, masked=True):
    rounded = np.array([[math.trunc(float(r[0]))] + [cuda_round(float(np.float32(c) * np.float32(scale))) for c in r[1:]]
                        for r in rois], np.float32)
    conv = conv_ref(x, w, None, stride, pad)
    out = np.empty_like(conv)
    for y in range(conv.shape[2]):
        for xx in range(conv.shape[3]):
            h_off, w_off = y * stride[0] - pad[0], xx * stride[1] - pad[1]
            valid = any(r[1] <= w_off <= r[3] and r[2] <= h_off <= r[4] for r in rounded) or not masked
            out[:, :, y, xx] = b[None, :] + (conv[:, :, y, xx] if valid else 0)
    return out, rounded


def layer(conv_params, scale):
    return ('layer { name: "fc6" type: "ROIConvolution" bottom: "x" bottom: "rois" top: "fc6" top: "rois_fc6" '
            f'convolution_param {{ {conv_params} is_roi: true }} roi_convolution_param {{ spatial_scale: {scale} }} }}')


# corners at exact halves after scaling (40 / 16 = 2.5, -8 / 16 = -0.5), a roi of another batch index
ROIS = np.array([[0, 40, 8, 88, 56], [1, -8, 64, 30, 120], [0, 150, 0, 170, 10]], np.float32)


@pytest.mark.parametrize("conv_params, stride, pad", [("num_output: 4 kernel_h: 3 kernel_w: 2 stride: 2 pad: 1",
                                                       (2, 2), (1, 1)),
                                                      ("num_output: 3 kernel_size: 3", (1, 1), (0, 0))])
def test_the_convolution_where_a_roi_holds_the_window_else_the_bias(conv_params, stride, pad, tmp_path):
    x = rng(96).standard_normal((1, 3, 9, 11)).astype(np.float32)
    model = load_from_text(net(layer(conv_params, 0.0625), inputs={"x": x.shape, "rois": ROIS.shape}),
                           random_weights=True)
    w, b = (np.asarray(v, np.float32) for v in model.layers[-1].blobs)
    kernel = w.shape[2:]
    want, rounded = reference(x, ROIS, w, b, stride, pad, 0.0625)
    assert rounded[0].tolist() == [0, 3, 1, 6, 4] and rounded[1][1] == -1   # half away from zero
    assert model.blob_shapes["fc6"] == want.shape and kernel in ((3, 2), (3, 3))
    kept = ~np.all(want == b[None, :, None, None], axis=1)
    assert 0 < kept.sum() < kept.size     # some windows masked to the bias, some kept
    check_everywhere(model, {"x": x, "rois": ROIS}, {"fc6": want, "rois_fc6": rounded}, tmp_path,
                     atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("count", [5, 0])
def test_the_roi_count_is_the_run_times(count, tmp_path):
    # loaded with 3 rois, run with as many as a proposal layer gives (none included: every window the bias)
    x = rng(99).standard_normal((1, 2, 6, 7)).astype(np.float32)
    model = load_from_text(net(layer("num_output: 3 kernel_size: 3 pad: 1", 0.25), inputs={"x": x.shape, "rois": (3, 5)}),
                           random_weights=True)
    w, b = (np.asarray(v, np.float32) for v in model.layers[-1].blobs)
    rois = (rng(100).uniform(0, 24, (count, 5)) * [0, 1, 1, 1, 1]).astype(np.float32)
    rois[:, 3:] += rois[:, 1:3]
    want, rounded = reference(x, rois, w, b, (1, 1), (1, 1), 0.25)
    check_everywhere(model, {"x": x, "rois": rois}, {"fc6": want, "rois_fc6": rounded.reshape(count, 5)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_a_1x1_kernel_is_the_forks_plain_convolution(tmp_path):
    x = rng(97).standard_normal((2, 3, 5, 4)).astype(np.float32)
    model = load_from_text(net(layer("num_output: 2 kernel_size: 1", 0.5), inputs={"x": x.shape, "rois": (1, 5)}),
                           random_weights=True)
    w, b = (np.asarray(v, np.float32) for v in model.layers[-1].blobs)
    rois = np.array([[0, 0, 0, 0, 0]], np.float32)
    want, rounded = reference(x, rois, w, b, (1, 1), (0, 0), 0.5, masked=False)
    check_everywhere(model, {"x": x, "rois": rois}, {"fc6": want, "rois_fc6": rounded}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_refusals():
    with pytest.raises(LayerError, match="rois must be \\(R, 5\\)"):
        load_from_text(net(layer("num_output: 2 kernel_size: 3", 1), inputs={"x": (1, 2, 5, 5), "rois": (3, 4)}))
    with pytest.raises(LayerError, match="spatial_scale must be finite"):
        load_from_text(net(layer("num_output: 2 kernel_size: 3", "inf"), inputs={"x": (1, 2, 5, 5), "rois": (3, 5)}))
    with pytest.raises(LayerError, match="takes 2 bottoms"):
        load_from_text(net(layer("num_output: 2 kernel_size: 3", 1).replace(' top: "rois_fc6"', ""),
                           inputs={"x": (1, 2, 5, 5), "rois": (3, 5)}))
