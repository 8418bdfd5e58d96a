"""delftrobotics-forks/caffe's "Module" layers of the mnc module (fizyr/dr_mnc_layers 4152923) and
superxuang/caffe_triple-branch_FCN's MHDRoiData and MultiSlicePredict (caffeq/layers/mnc_module.py,
caffeq/layers/triple_branch_fcn.py).

The references are numpy loops written here from dr_mnc_layers' CUDA kernels (roi_warping_layer.cu,
mask_resize_layer.cu, mask_pooling_layer.cu), in float32 scalars as the kernels' Dtype.
"""
import math

import numpy as np
import pytest
from c_reference import c_round
from conftest import REPO, check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

F = np.float32
FLT_MAX = F(3.4028234663852886e38)
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def bilinear(plane, h, w, y, x):
    """bilinear_interpolate of the kernels over every channel of plane (C, H, W); None off the map."""
    if y < -0.5 or y > h - 0.5 or x < -0.5 or x > w - 0.5:
        return None
    y, x = (F(0) if y <= 0 else y), (F(0) if x <= 0 else x)
    y0, x0 = int(y), int(x)
    if y0 >= h - 1:
        y0 = y1 = h - 1
        y = F(y0)
    else:
        y1 = y0 + 1
    if x0 >= w - 1:
        x0 = x1 = w - 1
        x = F(x0)
    else:
        x1 = x0 + 1
    lh, lw = y - F(y0), x - F(x0)
    hh, hw = F(1) - lh, F(1) - lw
    return (hh * hw * plane[:, y0, x0] + hh * lw * plane[:, y0, x1] + lh * hw * plane[:, y1, x0]
            + lh * lw * plane[:, y1, x1])


def ref_roi_warp(x, rois, ph, pw, scale):
    """ROIWarpingForward: per bin the max over fph = ph, ph + step, ... <= ph + 1 (step 1 / ceil(size / pooled))."""
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    for r, roi in enumerate(rois):
        sw, sh, ew, eh = (F(c_round(F(v) * F(scale))) for v in roi[1:5])
        rw, rh = max(ew - sw, F(0)), max(eh - sh, F(0))
        bh, bw = rh / F(ph), rw / F(pw)
        step_h = F(1.0 / math.ceil(rh / F(ph))) if rh > 0 else F(np.inf)
        step_w = F(1.0 / math.ceil(rw / F(pw))) if rw > 0 else F(np.inf)
        for i in range(ph):
            for j in range(pw):
                best, found = np.full(c, -FLT_MAX, F), np.zeros(c, bool)
                fy = F(i)
                while fy <= i + 1:
                    fx = F(j)
                    while fx <= j + 1:
                        val = bilinear(x[int(roi[0])], h, w, sh + fy * bh, sw + fx * bw)
                        if val is not None:
                            better = val > best
                            best, found = np.where(better, val, best), found | better
                        fx = F(fx + step_w)
                    fy = F(fy + step_h)
                out[r, :, i, j] = np.where(found, best, F(0))
    return out


def ref_mask_resize(x, oh, ow):
    n, c, h, w = x.shape
    out = np.zeros((n, c, oh, ow), F)
    rh, rw = F(h) / F(oh), F(w) / F(ow)
    for k in range(n):
        for i in range(oh):
            for j in range(ow):
                val = bilinear(x[k], h, w, F(i) * rh, F(j) * rw)
                out[k, :, i, j] = 0 if val is None else val
    return out


def ref_mask_pooling(x, masks):
    n, _c, h, w = x.shape
    flat = masks.reshape(-1)
    out = np.zeros_like(x)
    for k in range(n):
        for i in range(h):
            for j in range(w):
                out[k, :, i, j] = x[k, :, i, j] * flat[k * h * w + i * w + j]
    return out


def ref_roi_pool(x, rois, ph, pw, scale):
    """Fast R-CNN's ROIPoolForward (dr_mnc_layers' roi_pooling_layer.cu): integer bins of a roi rounded
    to the map, max over each, 0 when a bin is empty."""
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    for r, roi in enumerate(rois):
        sw, sh, ew, eh = (int(c_round(F(v) * F(scale))) for v in roi[1:5])
        rw, rh = max(ew - sw + 1, 1), max(eh - sh + 1, 1)
        bh, bw = F(rh) / F(ph), F(rw) / F(pw)
        for i in range(ph):
            for j in range(pw):
                hs = min(max(int(math.floor(F(i) * bh)) + sh, 0), h)
                he = min(max(int(math.ceil(F(i + 1) * bh)) + sh, 0), h)
                ws = min(max(int(math.floor(F(j) * bw)) + sw, 0), w)
                we = min(max(int(math.ceil(F(j + 1) * bw)) + sw, 0), w)
                if he > hs and we > ws:
                    out[r, :, i, j] = x[int(roi[0]), :, hs:he, ws:we].max(axis=(1, 2))
    return out


def module(name, bottoms, top, type_name, param_str=None, mod="mnc", extra=""):
    b = " ".join(f'bottom: "{x}"' for x in bottoms)
    ps = f' param_str: "{param_str}"' if param_str is not None else ""
    return (f'layer {{ name: "{name}" type: "Module" {b} top: "{top}" '
            f'module_param {{ module: "{mod}" type: "{type_name}"{ps} }} {extra}}}')


X_SHAPE = (2, 3, 7, 11)
ROIS = np.array([[0, 2, 1, 13, 9], [1, -6, -3, 8, 6], [1, 9, 4, 30, 19], [0, 7, 7, 7, 7],
                 [1, 40, 30, 50, 44], [0, 3, 2.5, 17, 9], [0, -10, -9, 60, 40]], F)


@pytest.mark.parametrize("ph, pw, scale", [(3, 2, 0.5), (2, 5, 1.0)])
def test_module_roi_warping_is_the_modules_max_of_samples_kernel(ph, pw, scale, tmp_path):
    text = net(module("o", ["x", "rois"], "o", "ROIWarping",
                      f"{{ 'pooled_w': {pw}, 'pooled_h': {ph}, 'spatial_scale': {scale} }}"),
               inputs={"x": X_SHAPE, "rois": ROIS.shape})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (len(ROIS), 3, ph, pw)
    feeds = {"x": rng(ph).standard_normal(X_SHAPE).astype(F), "rois": ROIS}
    ref = ref_roi_warp(feeds["x"], ROIS, ph, pw, scale)
    assert not ref[4].any() and ref[2].any()
    check_everywhere(model, feeds, {"o": ref}, tmp_path)


def test_module_roi_pooling_is_fast_rcnns_and_ignores_roi_pooling_param(tmp_path):
    # the module reads param_str only: a roi_pooling_param on the layer (pad_ratio, another fork's) changes nothing
    text = net(module("o", ["x", "rois"], "o", "ROIPooling", "{ 'pooled_w': 3, 'pooled_h': 2, 'spatial_scale': 0.5 }",
                      extra="roi_pooling_param { pooled_w: 1 pooled_h: 1 pad_ratio: 0.5 } "),
               inputs={"x": X_SHAPE, "rois": ROIS.shape})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (len(ROIS), 3, 2, 3)
    feeds = {"x": rng(7).standard_normal(X_SHAPE).astype(F), "rois": ROIS}
    ref = ref_roi_pool(feeds["x"], ROIS, 2, 3, 0.5)
    assert not ref[4].any() and ref[0].any()
    check_everywhere(model, feeds, {"o": ref}, tmp_path)


def test_module_roi_warping_ignores_roi_warping_param(tmp_path):
    text = net(module("o", ["x", "rois"], "o", "ROIWarping", "{ 'pooled_w': 2, 'pooled_h': 3, 'spatial_scale': 0.5 }",
                      extra="roi_warping_param { pooled_w: 5 pooled_h: 5 spatial_scale: 1 design: ONE_SAMPLE } "),
               inputs={"x": X_SHAPE, "rois": ROIS.shape})
    feeds = {"x": rng(8).standard_normal(X_SHAPE).astype(F), "rois": ROIS}
    check_everywhere(load_from_text(text), feeds, {"o": ref_roi_warp(feeds["x"], ROIS, 3, 2, 0.5)}, tmp_path)


def test_module_mask_resize_and_mask_pooling(tmp_path):
    masks_shape, feat_shape = (2, 1, 5, 9), (2, 3, 7, 4)
    text = net(module("r", ["m"], "r", "MaskResize", "{ 'output_width': 4, 'output_height': 7 }"),
               module("p", ["f", "r"], "o", "MaskPooling"),
               inputs={"m": masks_shape, "f": feat_shape})
    model = load_from_text(text)
    g = rng(3)
    feeds = {"m": g.random(masks_shape).astype(F), "f": g.standard_normal(feat_shape).astype(F)}
    resized = ref_mask_resize(feeds["m"], 7, 4)
    check_everywhere(model, feeds, {"o": ref_mask_pooling(feeds["f"], resized)}, tmp_path)
    assert np.array_equal(model.run(feeds, all_blobs=True)["r"], resized)


def test_module_upsampling_resize_reads_zero_past_the_map(tmp_path):
    # mask_resize_param (SSTD's factors) is not the module's: ignored
    text = net(module("r", ["m"], "r", "MaskResize", "{'output_width': 13, 'output_height': 11}",
                      extra="mask_resize_param { factor_height: 2 factor_width: 3 } "),
               inputs={"m": (2, 2, 3, 5)})
    feeds = {"m": rng(5).standard_normal((2, 2, 3, 5)).astype(F)}
    ref = ref_mask_resize(feeds["m"], 11, 13)
    check_everywhere(load_from_text(text), feeds, {"r": ref}, tmp_path)


@pytest.mark.parametrize("param_str, needle", [
    ("{ 'pooled_w': 12, 'pooled_h': 12 }", "'spatial_scale' not found"),
    ("{ 'pooled_w': 12.5, 'pooled_h': 12, 'spatial_scale': 1 }", "'pooled_w' must be an integer"),
    ("{ 'pooled_w': 0, 'pooled_h': 12, 'spatial_scale': 1 }", "pooled_w must be > 0"),
    ("__import__('os')", "module_param.param_str: expected"),
    ("{ 'pooled_w': 012, 'pooled_h': 12, 'spatial_scale': 1 }", "'012' has a leading 0"),
    ("{ 'pooled_w': 2147483648, 'pooled_h': 12, 'spatial_scale': 1 }", "'pooled_w' must be an integer in int's"),
    ("{ 'pooled_w': '1_2', 'pooled_h': 12, 'spatial_scale': 1 }", "'pooled_w' must be an integer"),
    ("{ 'pooled_w': ' 12', 'pooled_h': 12, 'spatial_scale': 1 }", "'pooled_w' must be an integer"),
    ("{ 'pooled_w': 12, 'pooled_h': 12, 'spatial_scale': 1e39 }", "'spatial_scale' must be a finite float"),
    ("{ 'pooled_w': 12, 'pooled_h': 12, 'spatial_scale': '0x10' }", "'spatial_scale' must be a number"),
])
def test_module_bad_param_str_is_one_line(param_str, needle):
    text = net(module("o", ["x", "rois"], "o", "ROIWarping", param_str), inputs={"x": X_SHAPE, "rois": (1, 5)})
    with pytest.raises(CaffeqError) as e:
        load_from_text(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("pw, ph", [("'0x0b'", "'013'"), ("'11'", "'+11 '")])
def test_module_quoted_integers_convert_as_yaml_cpp(pw, ph):
    # as<int>: the scalar's text through a stream with no base set (0x hex, a leading 0 octal), blanks after
    text = net(module("o", ["x", "rois"], "o", "ROIWarping", f"{{ 'pooled_w': {pw}, 'pooled_h': {ph}, "
                      f"'spatial_scale': '0.5' }}"), inputs={"x": X_SHAPE, "rois": (3, 5)})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (3, 3, 11, 11)
    assert model.graph.nodes[-1].attrs["scale"] == 0.5


@pytest.mark.parametrize("mod, type_name", [("mnc", "Proposal"), ("other", "ROIWarping")])
def test_unknown_module_or_type_is_refused(mod, type_name):
    text = net(module("o", ["x", "rois"], "o", type_name, "{}", mod=mod), inputs={"x": X_SHAPE, "rois": (1, 5)})
    with pytest.raises(CaffeqError) as e:
        load_from_text(text)
    msg = str(e.value)
    assert f"module '{mod}' type '{type_name}' is not a layer module caffeq knows" in msg and "\n" not in msg


def test_module_losses_only_train():
    x, t = rng(1).standard_normal((2, 8)).astype(F), (rng(2).random((2, 8)) > 0.5).astype(F)
    ce = load_from_text(net(module("ls", ["x", "t"], "ls", "SigmoidCrossEntropyLoss"), inputs={"x": (2, 8), "t": (2, 8)}))
    # the module's 2-bottom loss: -sum(x (t - [x >= 0]) - log(1 + exp(x - 2 x [x >= 0]))) / num
    pos = (x >= 0).astype(F)
    ref = -np.sum(x * (t - pos) - np.log1p(np.exp(x - 2 * x * pos))) / 2
    assert np.allclose(ce.run({"x": x, "t": t})["ls"], ref, rtol=1e-6, atol=0)
    l1 = load_from_text(net(module("l1", ["x", "t", "wi", "wo"], "l1", "SmoothL1Loss", "{ 'sigma': 3 }"),
                            inputs={"x": (2, 8), "t": (2, 8), "wi": (2, 8), "wo": (2, 8)}))
    assert all(n.spec.is_training_only for n in l1.graph.nodes if n.name in ("l1",))
    with pytest.raises(CaffeqError) as e:
        l1.run({"x": x, "t": t, "wi": t, "wo": t})
    assert "SmoothL1Loss (sigma2 = sigma as given" in str(e.value) and "\n" not in str(e.value)


def test_module_sigmoid_loss_ignores_loss_param_and_weighs_with_a_third_bottom():
    """The module's loss never reads loss_param: / num even with normalization VALID, no ignore_label."""
    g = rng(4)
    x, t, w = g.standard_normal((3, 2, 5)).astype(F), (g.random((3, 2, 5)) > 0.5).astype(F), g.random((3, 2, 5))
    pos = (x >= 0).astype(F)
    per = -(x * (t - pos) - np.log1p(np.exp(x - 2 * x * pos)))
    extra = "loss_param { normalization: VALID ignore_label: 1 } "
    ce = load_from_text(net(module("ls", ["x", "t"], "ls", "SigmoidCrossEntropyLoss", extra=extra),
                            inputs={"x": x.shape, "t": t.shape}))
    assert np.allclose(ce.run({"x": x, "t": t})["ls"], per.sum() / 3, rtol=1e-6, atol=0)
    cw = load_from_text(net(module("ls", ["x", "t", "w"], "ls", "SigmoidCrossEntropyLoss", extra=extra),
                            inputs={"x": x.shape, "t": t.shape, "w": w.shape}))
    got = cw.run({"x": x, "t": t, "w": w.astype(F)})["ls"]
    assert np.allclose(got, (w * per).sum() / w.sum(), rtol=1e-5, atol=0)


def test_module_smooth_l1_checks_shapes_as_its_reshape():
    ok = net(module("l1", ["x", "t"], "l1", "SmoothL1Loss", "{ 'sigma': 1 }"), inputs={"x": (2, 8), "t": (2, 8)})
    assert load_from_text(ok).blob_shapes["l1"] == ()
    bad = net(module("l1", ["x", "t"], "l1", "SmoothL1Loss", "{ 'sigma': 1 }"), inputs={"x": (2, 8), "t": (4, 4)})
    with pytest.raises(CaffeqError) as e:   # the same count, other channels: the module's CHECK_EQ fails
        load_from_text(bad)
    assert "must share channels, height and width" in str(e.value) and "\n" not in str(e.value)


# ---- superxuang/caffe_triple-branch_FCN ---------------------------------------------------------------

TRIPLE = """
layer { name: "in" type: "MHDRoiData" top: "data" top: "im_info" top: "la" top: "lc" top: "ls"
  mhd_data_param { source: "list.txt" batch_size: 2 contour_name_list { name: "liver" name: "heart" name: "lung" }
    resample_size_x: 5 resample_size_y: 7 resample_size_z: 9 } }
layer { name: "out" type: "MultiSlicePredict" bottom: "im_info" bottom: "pa" bottom: "pc" bottom: "ps"
  slice_predict_param { source: "list.txt" output_path: "res/" contour_name_list { name: "liver" name: "heart"
    name: "lung" } } }
"""


def test_triple_branch_data_layer_and_multi_slice_predict_are_sized():
    text = ('input: "pa" input_shape { dim: 2 dim: 2 dim: 27 } input: "pc" input_shape { dim: 2 dim: 2 dim: 21 } '
            'input: "ps" input_shape { dim: 2 dim: 2 dim: 15 }\n' + TRIPLE)
    model = load_from_text(text)
    s = model.blob_shapes
    assert s["data"] == (2, 3, 9, 7, 5) and s["im_info"] == (2, 19)
    assert (s["la"], s["lc"], s["ls"]) == ((2, 1, 27), (2, 1, 21), (2, 1, 15))
    with pytest.raises(CaffeqError) as e:
        model.run({"data": np.zeros(s["data"], F), "im_info": np.zeros((2, 19), F), "pa": np.zeros((2, 2, 27), F),
                   "pc": np.zeros((2, 2, 21), F), "ps": np.zeros((2, 2, 15), F),
                   **{k: np.zeros(s[k], F) for k in ("la", "lc", "ls")}})
    assert "text files" in str(e.value)


@pytest.mark.parametrize("axial, needle", [("dim: 2 dim: 2 dim: 28", "axial probabilities must be (N, 2, 3 x size)"),
                                           ("dim: 2 dim: 54", "axial probabilities need 3 axes")])
def test_multi_slice_predict_checks_its_bottoms(axial, needle):
    text = (f'input: "pa" input_shape {{ {axial} }} input: "pc" input_shape {{ dim: 2 dim: 2 dim: 21 }} '
            'input: "ps" input_shape { dim: 2 dim: 2 dim: 15 }\n' + TRIPLE)
    with pytest.raises(CaffeqError) as e:
        load_from_text(text)
    assert needle in str(e.value)


@pytest.mark.parametrize("name, top, shape", [
    ("delftrobotics-forks__MNC__models__ZF__mnc_5stage__test.prototxt", "roi_mask_conv5", (300, 256, 12, 12)),
    ("superxuang__caffe_triple-branch_FCN__models__triple-branch_FCN__net.prototxt", "data", (1, 3, 512, 256, 256))])
def test_corpus_files_read(name, top, shape):
    path = CORPUS / name
    assert load(path).blob_shapes[top] == shape
