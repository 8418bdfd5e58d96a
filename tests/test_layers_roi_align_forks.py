"""ROIAlign with roi_align_param: the three forks that declare it (caffeq/layers/roi_align_forks.py).

The references are numpy loops written here from each fork's kernel, in float32 scalars as the
kernels' Dtype (double where the kernel computes in double):
- PY_MASK_RCNN: a8039974/py-mask-rcnn-1 b69f7dd caffe-mask-rcnn roi_align_layer.cu ROIAlignForward and
  bilinear_interpolate (its CPU loop computes the same);
- PY_RFCN_PRIV: soeaver/py-RFCN-priv 8d93d39 caffe-priv roi_align_layer.cu ROIAlignForward (no CPU form);
- NNOP: nnop/caffe 023b8b31 roi_align_layer.cu ROIAlignForward, reading the flat blob as the kernel does.
"""
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, check_everywhere, model_py_outputs, net, onnx_outputs, rng

import caffeq
from caffeq.errors import ExportError
from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
FLT_MAX = F(3.4028234663852886e38)
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


# ---- references ------------------------------------------------------------------------------

def mask_rcnn_bilinear(plane, h, w, y, x):
    """bilinear_interpolate over every channel of plane (C, H, W)."""
    if y < -1.0 or y > h or x < -1.0 or x > w:
        return np.zeros(plane.shape[0], F)
    y = F(0) if y <= 0 else y
    x = F(0) if x <= 0 else x
    y_low, x_low = int(y), int(x)
    if y_low >= h - 1:
        y_high = y_low = h - 1
        y = F(y_low)
    else:
        y_high = y_low + 1
    if x_low >= w - 1:
        x_high = x_low = w - 1
        x = F(x_low)
    else:
        x_high = x_low + 1
    ly, lx = y - F(y_low), x - F(x_low)
    hy, hx = F(1) - ly, F(1) - lx
    w1, w2, w3, w4 = hy * hx, hy * lx, ly * hx, ly * lx
    return (w1 * plane[:, y_low, x_low] + w2 * plane[:, y_low, x_high] + w3 * plane[:, y_high, x_low]
            + w4 * plane[:, y_high, x_high])


def ref_mask_rcnn(x, rois, ph, pw, scale):
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        sw, sh, ew, eh = (F(v) * F(scale) for v in roi[1:5])
        bin_h = max(eh - sh, F(1)) / F(ph)
        bin_w = max(ew - sw, F(1)) / F(pw)
        for i in range(ph):
            for j in range(pw):
                total = np.zeros(c, F)
                for iy in range(2):
                    y = sh + F(i) * bin_h + F(iy + 0.5) * bin_h / F(2)
                    for ix in range(2):
                        xx = sw + F(j) * bin_w + F(ix + 0.5) * bin_w / F(2)
                        total = total + mask_rcnn_bilinear(x[b], h, w, y, xx)
                out[r, :, i, j] = total / F(4)
    return out


def ref_rfcn_priv(x, rois, ph, pw, scale):
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    for r, roi in enumerate(rois):
        plane = x[int(roi[0])]
        sw, sh, ew, eh = (F(v) * F(scale) for v in roi[1:5])
        bin_h = (eh - sh + F(1)) / F(ph)
        bin_w = (ew - sw + F(1)) / F(pw)
        for i in range(ph):
            for j in range(pw):
                hs = min(max(F(i) * bin_h + sh, F(0)), F(h))
                he = min(max(F(i + 1) * bin_h + sh, F(0)), F(h))
                ws = min(max(F(j) * bin_w + sw, F(0)), F(w))
                we = min(max(F(j + 1) * bin_w + sw, F(0)), F(w))
                best = np.full(c, F(0) if (he <= hs or we <= ws) else -FLT_MAX, F)
                hh = hs
                while hh < he:
                    ww = ws
                    while ww < we:
                        xl, xr, yb, yt = (int(math.floor(ww)), int(math.ceil(ww)), int(math.floor(hh)),
                                          int(math.ceil(hh)))
                        val = np.zeros(c, F)
                        for yi, xi, wx, wy in ((yt, xl, F(1) - ww + F(xl), F(1 - yt) + hh),
                                               (yt, xr, F(1 - xr) + ww, F(1 - yt) + hh),
                                               (yb, xl, F(1) - ww + F(xl), F(1) - hh + F(yb)),
                                               (yb, xr, F(1 - xr) + ww, F(1) - hh + F(yb))):
                            if 0 <= xi <= w - 1 and 0 <= yi <= h - 1:
                                val = val + wx * wy * plane[:, yi, xi]
                        best = np.where(val > best, val, best)
                        ww = ww + F(1)
                    hh = hh + F(1)
                out[r, :, i, j] = best
    return out


def ref_nnop(x, rois, ph, pw, scale):
    n, c, h, w = x.shape
    flat = np.concatenate([x.reshape(-1), np.zeros(h * w + w + 1, F)])   # past the blob: 0
    out = np.zeros((len(rois), c, ph, pw), F)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        if b < 0:
            continue   # the GPU kernel writes 0
        sw, sh, ew, eh = (F(v) * F(scale) for v in roi[1:5])
        roi_w = max(int(ew - sw + F(1)), 1)
        roi_h = max(int(eh - sh + F(1)), 1)
        bin_h, bin_w = F(roi_h) / F(ph), F(roi_w) / F(pw)
        base = (b * c + np.arange(c)) * h * w
        for i in range(ph):
            for j in range(pw):
                hs = min(max(F(i * bin_h) + sh, F(0)), F(h))
                he = min(max(F((i + 1) * bin_h) + sh, F(0)), F(h))
                ws = min(max(F(j * bin_w) + sw, F(0)), F(w))
                we = min(max(F((j + 1) * bin_w) + sw, F(0)), F(w))
                best = np.full(c, F(0) if (he <= hs or we <= ws) else -FLT_MAX, F)
                h_stride = F(float(he - hs) / 3.0)
                w_stride = F(float(we - ws) / 3.0)
                hh = hs + h_stride
                while float(hh) <= float(he - h_stride) + 0.01:
                    ww = ws + w_stride
                    while float(ww) <= float(we - w_stride) + 0.01:
                        hlow = min(max(int(math.floor(hh)), 0), h - 1)
                        wleft = min(max(int(math.floor(ww)), 0), w - 1)
                        hhigh, wright = hlow + 1, wleft + 1
                        alpha = (hh - F(hlow)) / F(hhigh - hlow)
                        beta = (ww - F(wleft)) / F(wright - wleft)
                        tl, tr = flat[base + hlow * w + wleft], flat[base + hlow * w + wright]
                        bl, br = flat[base + hhigh * w + wleft], flat[base + hhigh * w + wright]
                        val = ((F(1) - alpha) * (F(1) - beta) * tl + alpha * (F(1) - beta) * bl
                               + (F(1) - alpha) * beta * tr + alpha * beta * br)
                        best = np.where(val > best, val, best)
                        ww = F(float(ww) + max(float(w_stride), 0.01))
                    hh = F(float(hh) + max(float(h_stride), 0.01))
                out[r, :, i, j] = best
    return out


REFS = {"PY_MASK_RCNN": ref_mask_rcnn, "PY_RFCN_PRIV": ref_rfcn_priv, "NNOP": ref_nnop}

X_SHAPE = (2, 3, 7, 11)   # N, C, H, W all different
# rois in input pixels: inside, crossing the top-left, crossing the bottom-right, one pixel, outside
# the map, fractional corners, the whole map (to its last row and column) on the second image, and a
# roi on integer map coordinates (PY_RFCN_PRIV's samples land on cells)
ROIS = np.array([[0, 2, 1, 13, 9], [1, -6, -3, 8, 6], [1, 9, 4, 30, 19], [0, 7, 7, 7, 7],
                 [1, 40, 30, 50, 44], [0, 3.5, 2.25, 17.75, 8.5], [1, 0, 0, 21, 13], [0, 4, 2, 9, 11]], np.float32)


def align_net(params, rois_shape=(len(ROIS), 5), x_shape=X_SHAPE, bottoms=("x", "rois")):
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    return net(f'layer {{ name: "o" type: "ROIAlign" {bottom} top: "o" roi_align_param {{ {params} }} }}',
               inputs={"x": x_shape, "rois": rois_shape})


def feeds(seed=0, rois=ROIS):
    return {"x": rng(seed).standard_normal(X_SHAPE).astype(np.float32), "rois": rois}


# ---- each fork against its kernel ---------------------------------------------------------------

CASES = [(3, 2, 0.5), (2, 4, 1.0), (4, 3, 0.25)]


@pytest.mark.parametrize("ph, pw, scale", CASES)
def test_mask_rcnn_matches_the_fork_everywhere(ph, pw, scale, tmp_path):
    model = load_from_text(align_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} fork: PY_MASK_RCNN"))
    assert model.blob_shapes["o"] == (len(ROIS), 3, ph, pw)
    f = feeds(ph)
    ref = ref_mask_rcnn(f["x"], ROIS, ph, pw, scale)
    # torch and model.py: the kernel's float32 operations in its order, equal to the bit
    assert_close(model.run(f)["o"], ref, 0.0, 0.0, "torch")
    assert_close(model_py_outputs(model, f, tmp_path)["o"], ref, 0.0, 0.0, "model.py")
    # ONNX RoiAlign (avg, sampling_ratio 2, output_half_pixel), before and after opset 16's attribute
    check_everywhere(model, f, {"o": ref}, tmp_path, atol=1e-6, rtol=1e-6, opsets=(13, 16, None))
    if scale == 0.5:
        assert np.count_nonzero(ref[4]) == 0            # the roi outside the map: every sample reads 0
        assert np.count_nonzero(ref[1]) and np.count_nonzero(ref[2])


@pytest.mark.parametrize("fork", ["PY_RFCN_PRIV", "NNOP"])
@pytest.mark.parametrize("ph, pw, scale", CASES)
def test_max_forks_match_their_kernels(fork, ph, pw, scale, tmp_path):
    model = load_from_text(align_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} fork: {fork}"))
    assert model.blob_shapes["o"] == (len(ROIS), 3, ph, pw)
    f = feeds(ph + 7)
    ref = REFS[fork](f["x"], ROIS, ph, pw, scale)
    assert_close(model.run(f)["o"], ref, 0.0, 0.0, f"torch {fork}")
    assert_close(model_py_outputs(model, f, tmp_path)["o"], ref, 0.0, 0.0, f"model.py {fork}")
    with pytest.raises(ExportError, match=f"ROIAlign.*fork {fork}"):
        onnx_outputs(model, f, tmp_path)


def test_the_three_forks_differ_on_the_same_file():
    f = feeds(3)
    outs = {}
    for fork in REFS:
        outs[fork] = load_from_text(align_net(f"pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 fork: {fork}")).run(f)["o"]
    assert not np.allclose(outs["PY_MASK_RCNN"], outs["PY_RFCN_PRIV"])
    assert not np.allclose(outs["PY_MASK_RCNN"], outs["NNOP"])
    assert not np.allclose(outs["PY_RFCN_PRIV"], outs["NNOP"])


def test_unset_fork_reads_as_mask_rcnn_with_a_note(tmp_path):
    text = align_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5")
    model = load_from_text(text)
    assert any("roi_align_param names no fork" in n and "fork: PY_RFCN_PRIV" in n for n in model.warnings)
    f = feeds(1)
    np.testing.assert_array_equal(model.run(f)["o"], ref_mask_rcnn(f["x"], ROIS, 3, 2, 0.5))
    marked = load_from_text(align_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 fork: PY_MASK_RCNN"))
    assert not any("names no fork" in n for n in marked.warnings)


def test_rfcn_priv_integer_samples_count_their_cell_twice():
    # a constant map of 1: a sample on integer coordinates (h, w) gets all four weights 1
    x = np.ones((1, 1, 5, 6), np.float32)
    model = load_from_text(align_net("pooled_h: 1 pooled_w: 1 spatial_scale: 1 fork: PY_RFCN_PRIV",
                                     rois_shape=(2, 5), x_shape=x.shape))
    rois = np.array([[0, 1, 1, 2, 2], [0, 1.5, 1, 1.5, 1]], np.float32)
    got = model.run({"x": x, "rois": rois})["o"]
    # roi 0: samples (1, 1), (1, 2), (2, 1), (2, 2) all on cells: 4; roi 1: w = 1.5 on a row: 2
    np.testing.assert_array_equal(got.reshape(-1), [4.0, 2.0])
    np.testing.assert_array_equal(got, ref_rfcn_priv(x, rois, 1, 1, 1.0))


def test_nnop_reads_past_the_last_row_as_the_kernel():
    # one 2 x 3 map per channel; a roi over the whole map: the bottom samples read row 2, which in the
    # flat blob is the next channel's first row (and past the last channel, 0 here)
    x = np.arange(2 * 2 * 3, dtype=np.float32).reshape(1, 2, 2, 3)
    model = load_from_text(align_net("pooled_h: 1 pooled_w: 1 spatial_scale: 1 fork: NNOP",
                                     rois_shape=(2, 5), x_shape=x.shape))
    rois = np.array([[0, 0, 0, 2, 1], [-1, 0, 0, 2, 1]], np.float32)
    got = model.run({"x": x, "rois": rois})["o"]
    np.testing.assert_array_equal(got, ref_nnop(x, rois, 1, 1, 1.0))
    # rows 2/3 and 4/3 (stride 2/3), columns 1 and 2 (stride 1); channel 0's max is the sample (4/3, 2):
    # 2/3 of row 1's 5 and 1/3 of "row 2", the next channel's first row (8)
    assert got[0, 0, 0, 0] == pytest.approx(5 * (2 / 3) + 8 * (1 / 3), rel=1e-6)
    # negated, channel 1's max is the sample (4/3, 1): 2/3 of its -10 and 1/3 of what lies past the
    # blob, where the fork reads undefined memory and caffeq 0
    neg = model.run({"x": -x, "rois": rois})["o"]
    np.testing.assert_array_equal(neg, ref_nnop(-x, rois, 1, 1, 1.0))
    assert neg[0, 1, 0, 0] == pytest.approx(-10 * (2 / 3), rel=1e-6)
    assert not got[1].any()   # a negative batch index gives 0 (the GPU kernel)


@pytest.mark.parametrize("fork", list(REFS))
def test_empty_rois_and_bad_batch_index(fork):
    model = load_from_text(align_net(f"pooled_h: 2 pooled_w: 2 fork: {fork}", rois_shape=(1, 5)))
    x = np.zeros(X_SHAPE, np.float32)
    assert model.run({"x": x, "rois": np.zeros((0, 5), np.float32)})["o"].shape == (0, 3, 2, 2)
    with pytest.raises(LayerError, match="batch index 2 is outside the batch of 2"):
        model.run({"x": x, "rois": np.array([[2, 0, 0, 1, 1]], np.float32)})


@pytest.mark.parametrize("params, kw, msg", [
    ("pooled_w: 2", {}, "roi_align_param.pooled_h and pooled_w must be > 0, got 0 x 2"),
    ("pooled_h: 2 pooled_w: 2 spatial_scale: inf", {}, "spatial_scale must be a finite number"),
    ("pooled_h: 2 pooled_w: 2", {"bottoms": ("x", "rois", "x")}, "ROIAlign takes 2 bottoms (data, rois)"),
])
def test_refuses_bad_params_and_shapes(params, kw, msg):
    with pytest.raises(LayerError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_from_text(align_net(params, **kw))


def test_reads_rois_declared_with_another_width_as_the_forks_do(tmp_path):
    # the forks' Reshape reads only the rois' count: VitoChien/py-mask-rcnn's alt-opt mask test net
    # declares (1, 4) rois that its script reshapes; running or exporting them as declared is refused
    model = load_from_text(align_net("pooled_h: 2 pooled_w: 2", rois_shape=(6, 4)))
    assert model.blob_shapes["o"] == (6, 3, 2, 2)
    with pytest.raises(LayerError, match=r"rois must be \(R, 5\)"):
        model.run({"x": np.zeros(X_SHAPE, np.float32), "rois": np.zeros((6, 4), np.float32)})
    with pytest.raises(ExportError, match=r"rois must be \(R, 5\).*--input-shape"):
        onnx_outputs(model, {}, tmp_path)


def test_refuses_both_parameter_messages():
    text = align_net("pooled_h: 2 pooled_w: 2").replace("roi_align_param", "roi_pooling_param { pooled_h: 2 "
                                                          "pooled_w: 2 } roi_align_param")
    with pytest.raises(LayerError, match="both roi_align_param .* and roi_pooling_param"):
        load_from_text(text)


def test_cascade_rcnn_roi_align_still_reads_roi_pooling_param():
    text = net('layer { name: "o" type: "ROIAlign" bottom: "x" bottom: "rois" top: "o" '
               'roi_pooling_param { pooled_h: 2 pooled_w: 3 } }', inputs={"x": X_SHAPE, "rois": (4, 5)})
    assert load_from_text(text).blob_shapes["o"] == (4, 3, 3, 4)   # zhaoweicai's pooled + 1 grid


def test_refuses_a_roi_align_without_parameters():
    text = net('layer { name: "o" type: "ROIAlign" bottom: "x" bottom: "rois" top: "o" }',
               inputs={"x": X_SHAPE, "rois": (4, 5)})
    with pytest.raises(LayerError, match="sets neither roi_pooling_param .* nor roi_align_param"):
        load_from_text(text)


def test_roi_align_param_numbers():
    fields = caffe_pb2.ROIAlignParameter.DESCRIPTOR.fields_by_name
    # sampling_ratio is caffe-keypoint-rcnn's (its RoIAlign, keypoint_rcnn.py), with its number and default
    assert {k: f.number for k, f in fields.items()} == {"pooled_h": 1, "pooled_w": 2, "spatial_scale": 3,
                                                         "fork": 20001, "sampling_ratio": 4}
    assert fields["spatial_scale"].default_value == 1.0 and fields["sampling_ratio"].default_value == 2.0


def test_roi_align_forks_refuse_keypoint_rcnns_sampling_ratio():
    # without a fork the field picks Deeppftracking's ROIAlign (test_layers_roi_align_deeppf.py)
    text = ('layer { name: "r" type: "ROIAlign" bottom: "x" bottom: "rois" top: "y" '
            'roi_align_param { pooled_h: 2 pooled_w: 2 sampling_ratio: 3 fork: NNOP } }')
    with pytest.raises(LayerError, match="sampling_ratio is caffe-keypoint-rcnn's RoIAlign field"):
        load_from_text(net(text, inputs={"x": (1, 2, 5, 5), "rois": (1, 5)}))
    assert caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name["roi_align_param"].number == 20005


# ---- the real files -------------------------------------------------------------------------------

def test_py_rfcn_priv_resnet101_8_roialign_test_reads():
    model = caffeq.load(REALWORLD / "Turoad__py-RFCN-priv__models__viva__ResNet-101_8_roialign__test.prototxt")
    assert model.blob_shapes["roi_pool5"] == (300, 1024, 14, 14)
    node = next(n for n in model.layers if n.name == "roi_pool5")
    assert node.attrs["ph"] == node.attrs["pw"] == 14 and node.attrs["scale"] == 0.125
    assert any("'roi_pool5' (ROIAlign): roi_align_param names no fork" in n for n in model.warnings)


def test_py_mask_rcnn_vgg16_train_reads():
    model = caffeq.load(REALWORLD / "a8039974__py-mask-rcnn-1__models__coco__VGG16__end2end__train.prototxt",
                        input_shapes={"data": (1, 3, 224, 320), "im_info": (1, 3), "gt_boxes": (1, 5),
                                      "gt_masks": (1, 1, 224, 320)})
    assert model.blob_shapes["conv5_3"] == (1, 512, 14, 20)
    # its ROIAlign pools the sampled training rois (roi-data), so inference drops it; the file reads
    layer = next(lp for lp in model.net.layer if lp.name == "roi_align")
    p = layer.roi_align_param
    assert (p.pooled_h, p.pooled_w, p.spatial_scale, p.HasField("fork")) == (7, 7, 0.0625, False)
