"""MNC (daijifeng001/MNC, "Multi-task Network Cascades"): caffe-mnc's ROIWarping, MaskPooling and MaskResize
(caffeq/layers/mnc.py) and MNC's Python layers (caffeq/layers/mnc_python.py), under both module names.

The references are numpy loops written here from caffe-mnc's CUDA kernels (roi_warping_layer.cu at
7a28ed65 and d8bf82b7, mask_pooling_layer.cu, mask_resize_layer.cu), in float32 scalars as the kernels'
Dtype, and from MNC's lib/pylayer/*.py (stage_bridge_layer.py forward_test with bbox_transform_inv and
clip_boxes; mask_layer.py forward_test).  MNC's ProposalLayer at TEST is py-faster-rcnn's: it is checked
against caffeq's rpn.proposal_layer spec, itself checked against a reference in test_layers_rcnn.py.  The
fork's prototxt files stay out of tests/fixtures: the net-level tests are small nets shaped like its
test.prototxt and train.prototxt.
"""
import math

import numpy as np
import pytest
from c_reference import c_round
from conftest import REPO, assert_close, check_everywhere, model_py_outputs, net, onnx_outputs, rng

from caffeq.errors import CaffeqError, ExportError
from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

F = np.float32
FLT_MAX = F(3.4028234663852886e38)
MODULES = ("pylayer", "multitask_network_cascades.pylayer")
CORPUS = REPO / "tests" / "fixtures" / "realworld"

# ---- references from the kernels -----------------------------------------------------------------


def ref_bilinear(plane, h, w, y, x):
    """caffe-mnc's bilinear_interpolate over every channel of plane (C, H, W); None off the map."""
    if y < -0.5 or y > h - 0.5 or x < -0.5 or x > w - 0.5:
        return None
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


def ref_samples(p, size, pooled, max_of_samples):
    """The kernel's loop `for (fph = ph; fph <= ph + 1; fph += step)` (7a28ed65), or just ph."""
    if not max_of_samples:
        return [F(p)]
    ratio = int(math.ceil(size / F(pooled)))
    step = F(1.0 / ratio) if ratio else F(np.inf)
    out, f = [], F(p)
    while f <= p + 1:
        out.append(f)
        f = F(f + step)
    return out


def ref_roi_warp(x, rois, ph, pw, scale, max_of_samples=False):
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    for r, roi in enumerate(rois):
        plane = x[int(roi[0])]
        sw, sh, ew, eh = (F(c_round(F(v) * F(scale))) for v in roi[1:5])
        rw, rh = max(ew - sw, F(0)), max(eh - sh, F(0))
        bin_h, bin_w = rh / F(ph), rw / F(pw)
        for i in range(ph):
            for j in range(pw):
                best, found = np.full(c, -FLT_MAX, F), np.zeros(c, bool)
                for fy in ref_samples(i, rh, ph, max_of_samples):
                    for fx in ref_samples(j, rw, pw, max_of_samples):
                        val = ref_bilinear(plane, h, w, sh + fy * bin_h, sw + fx * bin_w)
                        if val is None:
                            continue
                        better = val > best
                        best, found = np.where(better, val, best), found | better
                out[r, :, i, j] = np.where(found, best, F(0))
    return out


def ref_mask_resize(x, oh, ow):
    n, c, h, w = x.shape
    out = np.zeros((n, c, oh, ow), F)
    ratio_h, ratio_w = F(h) / F(oh), F(w) / F(ow)
    for k in range(n):
        for i in range(oh):
            for j in range(ow):
                val = ref_bilinear(x[k], h, w, F(i) * ratio_h, F(j) * ratio_w)
                if val is not None:
                    out[k, :, i, j] = val
    return out


def ref_mask_pooling(x, masks):
    n, c, h, w = x.shape
    flat = masks.reshape(-1)
    out = np.zeros_like(x)
    for k in range(n):
        for i in range(h):
            for j in range(w):
                out[k, :, i, j] = x[k, :, i, j] * flat[k * h * w + i * w + j]
    return out


def ref_bbox_transform_inv(boxes, deltas):
    """MNC's transform/bbox_transform.py, as numpy computes it (float32 arrays)."""
    boxes = boxes.astype(deltas.dtype, copy=False)
    widths = boxes[:, 2] - boxes[:, 0] + 1.0
    heights = boxes[:, 3] - boxes[:, 1] + 1.0
    ctr_x = boxes[:, 0] + 0.5 * widths
    ctr_y = boxes[:, 1] + 0.5 * heights
    dx, dy, dw, dh = deltas[:, 0::4], deltas[:, 1::4], deltas[:, 2::4], deltas[:, 3::4]
    pred_ctr_x = dx * widths[:, np.newaxis] + ctr_x[:, np.newaxis]
    pred_ctr_y = dy * heights[:, np.newaxis] + ctr_y[:, np.newaxis]
    pred_w = np.exp(dw) * widths[:, np.newaxis]
    pred_h = np.exp(dh) * heights[:, np.newaxis]
    pred = np.zeros(deltas.shape, dtype=deltas.dtype)
    pred[:, 0::4] = pred_ctr_x - 0.5 * pred_w
    pred[:, 1::4] = pred_ctr_y - 0.5 * pred_h
    pred[:, 2::4] = pred_ctr_x + 0.5 * pred_w
    pred[:, 3::4] = pred_ctr_y + 0.5 * pred_h
    return pred


def ref_stage_bridge(rois, deltas, scores, im_info):
    """stage_bridge_layer.py forward_test."""
    all_rois = ref_bbox_transform_inv(rois[:, 1:5], deltas)
    score_max = scores.argmax(axis=1)
    out = np.zeros((rois.shape[0], 5))
    for i in range(len(score_max)):
        out[i, 1:5] = all_rois[i, 4 * score_max[i]:4 * (score_max[i] + 1)]
    im_shape = im_info[0, :2]
    out[:, 1::4] = np.maximum(np.minimum(out[:, 1::4], im_shape[1] - 1), 0)
    out[:, 2::4] = np.maximum(np.minimum(out[:, 2::4], im_shape[0] - 1), 0)
    out[:, 3::4] = np.maximum(np.minimum(out[:, 3::4], im_shape[1] - 1), 0)
    out[:, 4::4] = np.maximum(np.minimum(out[:, 4::4], im_shape[0] - 1), 0)
    return out.astype(np.float32)


# ---- ROIWarping ---------------------------------------------------------------------------------

X_SHAPE = (2, 3, 7, 11)   # N, C, H, W all different
# rois in input pixels: inside, crossing the top-left, crossing the bottom-right, one pixel (size 0),
# off the map, fractional corners (rounding at .5 away from zero), the whole second image, an inverted
# roi (size 0), a tall thin one, and a large one (several samples a bin in MAX_OF_SAMPLES)
ROIS = np.array([[0, 2, 1, 13, 9], [1, -6, -3, 8, 6], [1, 9, 4, 30, 19], [0, 7, 7, 7, 7],
                 [1, 40, 30, 50, 44], [0, 3, 2.5, 17, 9], [1, 0, 0, 21, 13], [0, 9, 8, 3, 1],
                 [1, 5, 0, 7, 13], [0, -10, -9, 60, 40]], np.float32)


def warp_net(params, rois_shape=(len(ROIS), 5), x_shape=X_SHAPE, bottoms=("x", "rois")):
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    return net(f'layer {{ name: "o" type: "ROIWarping" {bottom} top: "o" roi_warping_param {{ {params} }} }}',
               inputs={"x": x_shape, "rois": rois_shape})


def warp_feeds(seed=0, rois=ROIS):
    return {"x": rng(seed).standard_normal(X_SHAPE).astype(np.float32), "rois": rois}


CASES = [(3, 2, 0.5), (2, 5, 1.0), (4, 3, 0.25)]


@pytest.mark.parametrize("ph, pw, scale", CASES)
def test_roi_warping_one_sample_matches_the_kernel_everywhere(ph, pw, scale, tmp_path):
    model = load_from_text(warp_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} design: ONE_SAMPLE"))
    assert model.blob_shapes["o"] == (len(ROIS), 3, ph, pw)
    f = warp_feeds(ph)
    ref = ref_roi_warp(f["x"], ROIS, ph, pw, scale)
    # the kernel's float32 operations in its order: torch, ONNX and model.py equal to the bit
    check_everywhere(model, f, {"o": ref}, tmp_path)
    assert not ref[4].any()                           # the roi off the map: every sample reads 0
    assert ref[1].any() and ref[2].any()


@pytest.mark.parametrize("ph, pw, scale", CASES)
def test_roi_warping_max_of_samples_matches_the_first_kernel(ph, pw, scale, tmp_path):
    model = load_from_text(warp_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} "
                                    f"design: MAX_OF_SAMPLES"))
    f = warp_feeds(ph + 5)
    ref = ref_roi_warp(f["x"], ROIS, ph, pw, scale, max_of_samples=True)
    # the kernel's float32 operations in its order (onnxruntime's CumSum adds the steps one by one, as its
    # loop does): torch, ONNX and model.py equal to the bit
    check_everywhere(model, f, {"o": ref}, tmp_path)
    one = load_from_text(warp_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale}")).run(f)["o"]
    assert not np.array_equal(one, ref)


def test_roi_warping_max_of_samples_counts_its_float_steps(tmp_path):
    # a roi 3 cells high over 1 bin: ratio 3, step float(1/3); the sums 1/3, 2/3, 1 reach ph + 1 exactly,
    # so 4 rows are sampled (0, 1, 2 and 3, the last one clamped onto row 2 of a 3-row map)
    x = np.zeros((1, 1, 3, 2), np.float32)
    x[0, 0, 2, 0] = 5.0
    model = load_from_text(warp_net("pooled_h: 1 pooled_w: 1 design: MAX_OF_SAMPLES", rois_shape=(1, 5),
                                    x_shape=x.shape))
    rois = np.array([[0, 0, 0, 0, 3]], np.float32)
    got = model.run({"x": x, "rois": rois})["o"]
    np.testing.assert_array_equal(got, ref_roi_warp(x, rois, 1, 1, 1.0, True))
    assert got.reshape(-1)[0] == 5.0
    np.testing.assert_array_equal(onnx_outputs(model, {"x": x, "rois": rois}, tmp_path)["o"], got)
    one = load_from_text(warp_net("pooled_h: 1 pooled_w: 1", rois_shape=(1, 5), x_shape=x.shape))
    assert one.run({"x": x, "rois": rois})["o"].reshape(-1)[0] == 0.0   # row 0 only


def test_roi_warping_unset_design_reads_one_sample_with_a_note():
    model = load_from_text(warp_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5"))
    assert any("roi_warping_param names no design" in n and "design: MAX_OF_SAMPLES" in n for n in model.warnings)
    f = warp_feeds(1)
    np.testing.assert_array_equal(model.run(f)["o"], ref_roi_warp(f["x"], ROIS, 3, 2, 0.5))
    marked = load_from_text(warp_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 design: ONE_SAMPLE"))
    assert not any("names no design" in n for n in marked.warnings)


@pytest.mark.parametrize("design", ["ONE_SAMPLE", "MAX_OF_SAMPLES"])
def test_roi_warping_no_rois_everywhere(design, tmp_path):
    model = load_from_text(warp_net(f"pooled_h: 2 pooled_w: 2 design: {design}", rois_shape=(0, 5)))
    f = {"x": np.zeros(X_SHAPE, np.float32), "rois": np.zeros((0, 5), np.float32)}
    assert onnx_outputs(model, f, tmp_path)["o"].shape == model_py_outputs(model, f, tmp_path)["o"].shape == (0, 3, 2, 2)


def test_roi_warping_empty_rois_and_bad_batch_index():
    model = load_from_text(warp_net("pooled_h: 2 pooled_w: 2 design: MAX_OF_SAMPLES", rois_shape=(1, 5)))
    x = np.zeros(X_SHAPE, np.float32)
    assert model.run({"x": x, "rois": np.zeros((0, 5), np.float32)})["o"].shape == (0, 3, 2, 2)
    with pytest.raises(LayerError, match="batch index 2 is outside the batch of 2"):
        model.run({"x": x, "rois": np.array([[2, 0, 0, 1, 1]], np.float32)})


@pytest.mark.parametrize("params, kw, msg", [
    ("pooled_w: 2", {}, "roi_warping_param.pooled_h and pooled_w must be > 0, got 0 x 2"),
    ("pooled_h: 2 pooled_w: 2 spatial_scale: inf", {}, "spatial_scale must be a finite number"),
    ("pooled_h: 2 pooled_w: 2", {"rois_shape": (6, 4)}, "rois must be"),
    ("pooled_h: 2 pooled_w: 2", {"bottoms": ("x", "rois", "x")}, "ROIWarping takes 2 bottoms (data, rois)"),
])
def test_roi_warping_refuses_bad_params_and_shapes(params, kw, msg):
    with pytest.raises(LayerError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_from_text(warp_net(params, **kw))


def test_the_fields_keep_the_forks_numbers():
    warp = caffe_pb2.ROIWarpingParameter.DESCRIPTOR.fields_by_name
    assert {k: f.number for k, f in warp.items()} == {"pooled_h": 1, "pooled_w": 2, "spatial_scale": 3,
                                                       "design": 20001}
    assert warp["spatial_scale"].default_value == 1.0
    resize = caffe_pb2.MaskResizeParameter.DESCRIPTOR.fields_by_name
    assert {k: f.number for k, f in resize.items()} == {"output_height": 1, "output_width": 2,
                                                         "factor_height": 3, "factor_width": 4}   # + SSTD's
    layer = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert layer["roi_warping_param"].number == 11870 and layer["mask_resize_param"].number == 11890


# ---- MaskResize and MaskPooling -------------------------------------------------------------------

@pytest.mark.parametrize("in_hw, out_hw", [((21, 17), (14, 9)), ((5, 4), (13, 11)), ((6, 9), (6, 10))])
def test_mask_resize_matches_the_kernel_everywhere(in_hw, out_hw, tmp_path):
    shape = (3, 2) + in_hw
    model = load_from_text(net(f'layer {{ name: "o" type: "MaskResize" bottom: "x" top: "o" mask_resize_param {{ '
                               f'output_height: {out_hw[0]} output_width: {out_hw[1]} }} }}', inputs={"x": shape}))
    assert model.blob_shapes["o"] == (3, 2) + out_hw
    x = rng(sum(in_hw)).standard_normal(shape).astype(np.float32)
    ref = ref_mask_resize(x, *out_hw)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)
    if in_hw == (5, 4):   # upsampled more than 2x: the last rows and columns lie past the map and read 0
        assert not ref[:, :, -1, :].any() and not ref[:, :, :, -1].any() and ref[:, :, 0, 0].all()


def test_sstd_mask_resize_sizes_by_its_factors(tmp_path):
    # BestSonny/SSTD deploy: output_height/width 1 and factor_height/width 0.125: int(size * factor) wins
    shape = (2, 1, 40, 27)
    model = load_from_text(net('layer { name: "o" type: "MaskResize" bottom: "x" top: "o" mask_resize_param { '
                               'output_height: 1 output_width: 1 factor_height: 0.125 factor_width: 0.25 } }',
                               inputs={"x": shape}))
    assert model.blob_shapes["o"] == (2, 1, 5, 6)          # int(40 * 0.125), int(27 * 0.25)
    x = rng(4).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"o": ref_mask_resize(x, 5, 6)}, tmp_path)


@pytest.mark.parametrize("mask_shape", [(4, 1, 5, 6), (4, 3, 5, 6)])
def test_mask_pooling_matches_the_kernel_everywhere(mask_shape, tmp_path):
    model = load_from_text(net('layer { name: "o" type: "MaskPooling" bottom: "x" bottom: "m" top: "o" }',
                               inputs={"x": (4, 3, 5, 6), "m": mask_shape}))
    assert model.blob_shapes["o"] == (4, 3, 5, 6)
    f = {"x": rng(2).standard_normal((4, 3, 5, 6)).astype(np.float32),
         "m": rng(3).random(mask_shape).astype(np.float32)}
    # a mask of 3 channels: the kernel reads the first N * H * W values of the blob, as caffeq does
    check_everywhere(model, f, {"o": ref_mask_pooling(f["x"], f["m"])}, tmp_path)


@pytest.mark.parametrize("text, msg", [
    ('layer { name: "o" type: "MaskPooling" bottom: "x" bottom: "m" top: "o" }',
     "feature map height and mask height must be the same"),
    ('layer { name: "o" type: "MaskPooling" bottom: "x" top: "o" }', "MaskPooling takes 2 bottoms"),
    ('layer { name: "o" type: "MaskResize" bottom: "x" top: "o" mask_resize_param { output_height: 3 } }',
     "output_height and output_width must be > 0, got 3 x 0"),
    ('layer { name: "o" type: "MaskResize" bottom: "x" top: "x" mask_resize_param { output_height: 3 '
     'output_width: 3 } }', "does not allow in-place"),
])
def test_mask_layers_refuse_what_the_fork_refuses(text, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(text, inputs={"x": (2, 3, 5, 6), "m": (2, 1, 4, 6)}))


# ---- the Python layers at TEST ------------------------------------------------------------------

def proposal_net(a, h, w, module, tops=("rois",), param_str="{'feat_stride': 16, 'gradient_scale': 1}"):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    return net(f'layer {{ name: "proposal" type: "Python" bottom: "prob" bottom: "deltas" bottom: "im_info" '
               f'{top_text} python_param {{ module: "{module}" layer: "ProposalLayer" '
               f'param_str: "{param_str}" }} }}',
               inputs={"prob": (1, 2 * a, h, w), "deltas": (1, 4 * a, h, w), "im_info": (1, 3)})


def proposal_feeds(a, h, w, im_info, seed=0):
    g = rng(seed)
    return {"prob": g.random((1, 2 * a, h, w)).astype(np.float32),
            "deltas": (g.standard_normal((1, 4 * a, h, w)) * 0.4).astype(np.float32),
            "im_info": np.array([im_info], np.float32)}


@pytest.mark.parametrize("module", MODULES)
def test_proposals_are_py_faster_rcnns_at_test(module, tmp_path):
    a, h, w = 9, 5, 7
    model = load_from_text(proposal_net(a, h, w, f"{module}.proposal_layer"))
    assert model.blob_shapes["rois"] == (300, 5)
    faster = load_from_text(proposal_net(a, h, w, "rpn.proposal_layer", param_str="'feat_stride': 16"))
    f = proposal_feeds(a, h, w, [75, 110, 0.6])
    want = faster.run(f)["rois"]
    assert 0 < len(want) < h * w * a
    np.testing.assert_array_equal(model.run(f)["rois"], want)
    np.testing.assert_array_equal(model_py_outputs(model, f, tmp_path)["rois"], want)
    got = onnx_outputs(model, f, tmp_path)
    np.testing.assert_allclose(next(iter(got.values())), want, rtol=1e-6, atol=1e-4)


def test_the_forks_anchor_keys_and_scores_top():
    a, h, w = 12, 4, 6   # anchor_scales [4, 8, 16, 32] x 3 ratios
    fork = load_from_text(proposal_net(a, h, w, "multitask_network_cascades.pylayer.proposal_layer",
                                       tops=("rois", "rpn_scores"),
                                       param_str="{'feat_stride': 16, 'anchor_scales': [4, 8, 16, 32]}"))
    assert fork.blob_shapes["rpn_scores"] == (288, 1)
    faster = load_from_text(proposal_net(a, h, w, "rpn.proposal_layer", tops=("rois", "scores"),
                                         param_str="{'feat_stride': 16, 'scales': [4, 8, 16, 32]}"))
    f = proposal_feeds(a, h, w, [60, 90, 1.0], seed=4)
    got, want = fork.run(f), faster.run(f)
    np.testing.assert_array_equal(got["rois"], want["rois"])
    np.testing.assert_array_equal(got["rpn_scores"], want["scores"])


def test_mncs_own_module_ignores_the_forks_anchor_keys():
    # MNC's pylayer.proposal_layer makes generate_anchors()'s 9 whatever the param_str says
    text = proposal_net(12, 3, 4, "pylayer.proposal_layer", param_str="{'feat_stride': 16, 'anchor_scales': [4, 8]}")
    model = load_from_text(text)
    with pytest.raises(CaffeqError, match=r"'anchor_scales'\], which MNC's proposal_layer.py does not read"):
        model.run(proposal_feeds(12, 3, 4, [40, 60, 1.0]))
    model = load_from_text(proposal_net(12, 3, 4, "pylayer.proposal_layer"))
    with pytest.raises(CaffeqError, match="scores 12 anchors per position .* makes 9"):
        model.run(proposal_feeds(12, 3, 4, [40, 60, 1.0]))


def bridge_net(module="pylayer", r=6, k=5, deltas=None, info=(1, 3)):
    return net(f'layer {{ name: "bridge" type: "Python" bottom: "rois" bottom: "bbox_pred" bottom: "seg_cls_prob" '
               f'bottom: "im_info" top: "rois_ext" python_param {{ module: "{module}.stage_bridge_layer" '
               f'layer: "StageBridgeLayer" }} }}',
               inputs={"rois": (r, 5), "bbox_pred": deltas or (r, 4 * k), "seg_cls_prob": (r, k), "im_info": info})


def bridge_feeds(r=6, k=5, seed=0):
    g = rng(seed)
    x1, y1 = g.uniform(-5, 60, r), g.uniform(-5, 40, r)
    rois = np.stack([np.zeros(r), x1, y1, x1 + g.uniform(0, 50, r), y1 + g.uniform(0, 30, r)], 1).astype(np.float32)
    scores = g.random((r, k)).astype(np.float32)
    scores[1, 1] = scores[1, 3] = scores[1].max() + 0.5   # a tie: numpy's argmax takes the first
    return {"rois": rois, "bbox_pred": (g.standard_normal((r, 4 * k)) * 0.5).astype(np.float32),
            "seg_cls_prob": scores, "im_info": np.array([[48, 70, 1.5]], np.float32)}


@pytest.mark.parametrize("module", MODULES)
def test_stage_bridge_matches_the_python_layer_everywhere(module, tmp_path):
    model = load_from_text(bridge_net(module))
    assert model.blob_shapes["rois_ext"] == (6, 5)
    f = bridge_feeds()
    ref = ref_stage_bridge(f["rois"], f["bbox_pred"], f["seg_cls_prob"], f["im_info"])
    assert (ref[:, 1:] == 0).any() and (ref[:, 3] == 69).any()   # some corners clipped on both sides
    # np.exp and torch.exp may differ in the last bit (as for the proposals)
    check_everywhere(model, f, {"rois_ext": ref}, tmp_path, atol=1e-4, rtol=1e-6)
    empty = {k: v[:0] if k != "im_info" else v for k, v in f.items()}
    assert model.run(empty)["rois_ext"].shape == (0, 5)


@pytest.mark.parametrize("kw, msg", [
    ({"deltas": (6, 18)}, "bbox_pred must hold 4 deltas for each of seg_cls_prob's 5 classes, got 18"),
    ({"info": (1, 3, 1, 1)}, "indexes its bottoms as 2-D arrays"),
])
def test_stage_bridge_reads_but_refuses_what_the_module_fails_on(kw, msg, tmp_path):
    model = load_from_text(bridge_net(**kw))
    assert model.blob_shapes["rois_ext"] == (6, 5)
    f = bridge_feeds()
    f["bbox_pred"] = np.zeros(model.blob_shapes["bbox_pred"], np.float32)
    f["im_info"] = np.zeros(model.blob_shapes["im_info"], np.float32)
    with pytest.raises(CaffeqError, match=f"layer 'bridge' \\(pylayer.stage_bridge_layer.StageBridgeLayer\\): .*{msg}"):
        model.run(f)
    with pytest.raises(ExportError, match=msg):
        onnx_outputs(model, f, tmp_path)


@pytest.mark.parametrize("module", MODULES)
def test_mask_layer_reshapes_to_mask_size_everywhere(module, tmp_path):
    text = net(f'layer {{ name: "m" type: "Python" bottom: "x" top: "o" python_param {{ module: '
               f'"{module}.mask_layer" layer: "MaskLayer" }} }}', inputs={"x": (7, 441)})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (7, 1, 21, 21)
    x = rng(5).random((7, 441)).astype(np.float32)
    check_everywhere(model, {"x": x}, {"o": x.reshape(7, 1, 21, 21)}, tmp_path)
    bad = load_from_text(text.replace("dim: 441", "dim: 400"))
    with pytest.raises(CaffeqError, match="441 values a row are needed, got \\[7, 400\\]"):
        bad.run({"x": np.zeros((7, 400), np.float32)})


# ---- nets shaped like MNC's ------------------------------------------------------------------------

def tiny_mnc(module="multitask_network_cascades.pylayer", design=""):
    """conv (stride 16) -> RPN -> proposals -> ROIWarping -> mask estimate (21 x 21 sigmoid) -> MaskLayer
    -> MaskResize -> MaskPooling -> box and mask features -> classes, seg classes and boxes ->
    StageBridge -> a second ROIWarping: the shape of MNC's 5-stage test.prototxt, small."""
    warp = f"pooled_w: 4 pooled_h: 4 spatial_scale: 0.0625 {design}"
    return f'''name: "tiny_mnc"
input: "data" input_shape {{ dim: 1 dim: 3 dim: 96 dim: 128 }}
input: "im_info" input_shape {{ dim: 1 dim: 3 }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 6 kernel_size: 16 stride: 16 }} }}
layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "conv" }}
layer {{ name: "rpn_cls_score" type: "Convolution" bottom: "conv" top: "rpn_cls_score"
  convolution_param {{ num_output: 18 kernel_size: 1 }} }}
layer {{ name: "rpn_bbox_pred" type: "Convolution" bottom: "conv" top: "rpn_bbox_pred"
  convolution_param {{ num_output: 36 kernel_size: 1 }} }}
layer {{ bottom: "rpn_cls_score" top: "rpn_cls_score_reshape" name: "rpn_cls_score_reshape" type: "Reshape"
  reshape_param {{ shape {{ dim: 0 dim: 2 dim: -1 dim: 0 }} }} }}
layer {{ name: "rpn_cls_prob" type: "Softmax" bottom: "rpn_cls_score_reshape" top: "rpn_cls_prob" }}
layer {{ name: "rpn_cls_prob_reshape" type: "Reshape" bottom: "rpn_cls_prob" top: "rpn_cls_prob_reshape"
  reshape_param {{ shape {{ dim: 0 dim: 18 dim: -1 dim: 0 }} }} }}
layer {{ name: "proposal" type: "Python" bottom: "rpn_cls_prob_reshape" bottom: "rpn_bbox_pred"
  bottom: "im_info" top: "rois"
  python_param {{ module: "{module}.proposal_layer" layer: "ProposalLayer"
    param_str: "{{'feat_stride': 16, 'gradient_scale': 1}}" }} }}
layer {{ name: "warp" type: "ROIWarping" bottom: "conv" bottom: "rois" top: "warp"
  roi_warping_param {{ {warp} }} }}
layer {{ name: "mask_pred" type: "InnerProduct" bottom: "warp" top: "mask_pred"
  param {{ name: "mask_pred_w" }} param {{ name: "mask_pred_b" }} inner_product_param {{ num_output: 441 }} }}
layer {{ name: "mask_output" type: "Sigmoid" bottom: "mask_pred" top: "mask_output" }}
layer {{ name: "mask_proposal" type: "Python" bottom: "mask_output" top: "mask_proposal"
  python_param {{ module: "{module}.mask_layer" layer: "MaskLayer" }} }}
layer {{ name: "mask_resize" type: "MaskResize" bottom: "mask_proposal" top: "mask_resize"
  mask_resize_param {{ output_height: 4 output_width: 4 }} }}
layer {{ name: "mask_pooling" type: "MaskPooling" bottom: "warp" bottom: "mask_resize" top: "masked" }}
layer {{ name: "fc_box" type: "InnerProduct" bottom: "warp" top: "fc_box" inner_product_param {{ num_output: 8 }} }}
layer {{ name: "fc_mask" type: "InnerProduct" bottom: "masked" top: "fc_mask" inner_product_param {{ num_output: 8 }} }}
layer {{ name: "join" type: "Concat" bottom: "fc_mask" bottom: "fc_box" top: "join" }}
layer {{ name: "cls_score" type: "InnerProduct" bottom: "join" top: "cls_score" inner_product_param {{ num_output: 4 }} }}
layer {{ name: "cls_prob" type: "Softmax" bottom: "cls_score" top: "cls_prob" }}
layer {{ name: "seg_cls_score" type: "InnerProduct" bottom: "join" top: "seg_cls_score"
  inner_product_param {{ num_output: 4 }} }}
layer {{ name: "seg_cls_prob" type: "Softmax" bottom: "seg_cls_score" top: "seg_cls_prob" }}
layer {{ name: "bbox_pred" type: "InnerProduct" bottom: "join" top: "bbox_pred" inner_product_param {{ num_output: 16 }} }}
layer {{ name: "stage_bridge" type: "Python" bottom: "rois" bottom: "bbox_pred" bottom: "seg_cls_prob"
  bottom: "im_info" top: "rois_ext"
  python_param {{ module: "{module}.stage_bridge_layer" layer: "StageBridgeLayer" }} }}
layer {{ name: "warp_ext" type: "ROIWarping" bottom: "conv" bottom: "rois_ext" top: "warp_ext"
  roi_warping_param {{ {warp} }} }}
layer {{ name: "mask_pred_ext" type: "InnerProduct" bottom: "warp_ext" top: "mask_pred_ext"
  param {{ name: "mask_pred_w" }} param {{ name: "mask_pred_b" }} inner_product_param {{ num_output: 441 }} }}
'''


def tiny_feeds(seed=0):
    return {"data": rng(seed).standard_normal((1, 3, 96, 128)).astype(np.float32),
            "im_info": np.array([[96, 128, 1.0]], np.float32)}


def test_a_net_shaped_like_mncs_test_net_reads_and_runs(tmp_path):
    model = load_from_text(tiny_mnc(), random_weights=True)
    # the fork's module names: its ROIWarping is caffe-mnc 7a28ed65's
    assert any("read 2 ROIWarping layer(s) ('warp', ...) as caffe-mnc 7a28ed65's" in n for n in model.warnings)
    assert model.blob_shapes["rois"] == (300, 5) and model.blob_shapes["masked"] == (300, 6, 4, 4)
    assert model.blob_shapes["mask_proposal"] == (300, 1, 21, 21) and model.blob_shapes["rois_ext"] == (300, 5)
    got = model.run(tiny_feeds(), all_blobs=True)
    r = len(got["rois"])
    assert 0 < r <= 48 and got["mask_pred_ext"].shape == (r, 441)
    ref_warp = ref_roi_warp(got["conv"], got["rois"], 4, 4, 0.0625, max_of_samples=True)
    np.testing.assert_array_equal(got["warp"], ref_warp)
    ref_ext = ref_stage_bridge(got["rois"], got["bbox_pred"], got["seg_cls_prob"], tiny_feeds()["im_info"])
    np.testing.assert_allclose(got["rois_ext"], ref_ext, rtol=1e-6, atol=1e-4)
    resized = ref_mask_resize(got["mask_output"].reshape(r, 1, 21, 21), 4, 4)
    np.testing.assert_array_equal(got["masked"], ref_mask_pooling(got["warp"], resized))
    assert_close(model_py_outputs(model, tiny_feeds(), tmp_path)["mask_pred_ext"], got["mask_pred_ext"], 0.0, 0.0)
    assert_close(onnx_outputs(model, tiny_feeds(), tmp_path)["mask_pred_ext"], got["mask_pred_ext"], 1e-4, 1e-5)


def test_mncs_own_test_net_runs_in_onnx_with_its_later_roi_warping(tmp_path):
    model = load_from_text(tiny_mnc("pylayer", design="design: ONE_SAMPLE"), random_weights=True)
    assert not any("ROIWarping" in n for n in model.warnings)
    want = model.run(tiny_feeds(1))
    check_everywhere(model, tiny_feeds(1), want, tmp_path, atol=1e-4, rtol=1e-5, opsets=(None,))


TRAIN_NET = '''name: "tiny_mnc_train"
layer { name: "input-data" type: "Python" top: "data" top: "im_info" top: "gt_boxes" top: "gt_masks"
  top: "mask_info" python_param { module: "MOD.mnc_data_layer" layer: "MNCDataLayer"
  param_str: "{ 'num_classes': 4 }" } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 6 kernel_size: 16 stride: 16 } }
layer { name: "rpn_cls_score" type: "Convolution" bottom: "conv" top: "rpn_cls_score"
  convolution_param { num_output: 18 kernel_size: 1 } }
layer { name: "rpn_bbox_pred" type: "Convolution" bottom: "conv" top: "rpn_bbox_pred"
  convolution_param { num_output: 36 kernel_size: 1 } }
layer { bottom: "rpn_cls_score" top: "rpn_cls_score_reshape" name: "rpn_cls_score_reshape" type: "Reshape"
  reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 0 } } }
layer { name: "rpn_cls_prob" type: "Softmax" bottom: "rpn_cls_score_reshape" top: "rpn_cls_prob" }
layer { name: "rpn_cls_prob_reshape" type: "Reshape" bottom: "rpn_cls_prob" top: "rpn_cls_prob_reshape"
  reshape_param { shape { dim: 0 dim: 18 dim: -1 dim: 0 } } }
layer { name: "proposal" type: "Python" bottom: "rpn_cls_prob_reshape" bottom: "rpn_bbox_pred" bottom: "im_info"
  top: "rpn_rois" top: "rpn_rois_index" python_param { module: "MOD.proposal_layer" layer: "ProposalLayer"
  param_str: "{ 'feat_stride': 16, 'use_clip': 1, 'clip_base': 512 }" } }
layer { name: "roi-data" type: "Python" bottom: "rpn_rois" bottom: "gt_boxes" bottom: "im_info"
  bottom: "gt_masks" bottom: "mask_info" bottom: "rpn_rois_index" top: "rois" top: "labels" top: "bbox_targets"
  top: "bbox_inside_weights" top: "bbox_outside_weights" top: "mask_targets" top: "mask_weight"
  top: "gt_masks_info" top: "fg_inds" top: "bg_inds" python_param { module: "MOD.proposal_target_layer"
  layer: "ProposalTargetLayer" param_str: "{'num_classes': 4, 'bp_all': 1}" } }
layer { name: "rpn-data" type: "Python" bottom: "rpn_cls_score" bottom: "gt_boxes" bottom: "im_info"
  bottom: "fg_inds" bottom: "bg_inds" top: "rpn_labels" top: "rpn_bbox_targets" top: "rpn_bbox_inside_weights"
  top: "rpn_bbox_outside_weights" python_param { module: "MOD.anchor_target_layer" layer: "AnchorTargetLayer"
  param_str: "{'feat_stride': 16}" } }
layer { name: "rpn_loss_cls" type: "SoftmaxWithLoss" bottom: "rpn_cls_score_reshape" bottom: "rpn_labels"
  top: "rpn_cls_loss" loss_param { ignore_label: -1 normalize: true } }
layer { name: "warp" type: "ROIWarping" bottom: "conv" bottom: "rois" top: "warp"
  roi_warping_param { pooled_w: 4 pooled_h: 4 spatial_scale: 0.0625 } }
layer { name: "mask_pred" type: "InnerProduct" bottom: "warp" top: "mask_pred" inner_product_param { num_output: 441 } }
layer { name: "loss_mask" type: "SigmoidCrossEntropyLoss" bottom: "mask_pred" bottom: "mask_targets"
  bottom: "mask_weight" top: "loss_mask" loss_weight: 2 }
layer { name: "mask_output" type: "Sigmoid" bottom: "mask_pred" top: "mask_output" }
layer { name: "mask_proposal" type: "Python" bottom: "mask_output" bottom: "gt_masks" bottom: "gt_masks_info"
  top: "mask_proposal" top: "mask_proposal_label" python_param { module: "MOD.mask_layer" layer: "MaskLayer" } }
layer { name: "mask_resize" type: "MaskResize" bottom: "mask_proposal" top: "mask_resize"
  mask_resize_param { output_height: 4 output_width: 4 } }
layer { name: "mask_pooling" type: "MaskPooling" bottom: "warp" bottom: "mask_resize" top: "masked" }
layer { name: "join" type: "Concat" bottom: "masked" bottom: "warp" top: "join" }
layer { name: "seg_cls_score" type: "InnerProduct" bottom: "join" top: "seg_cls_score"
  inner_product_param { num_output: 4 } }
layer { name: "seg_cls_prob" type: "Softmax" bottom: "seg_cls_score" top: "seg_cls_prob" }
layer { name: "bbox_pred" type: "InnerProduct" bottom: "join" top: "bbox_pred" inner_product_param { num_output: 16 } }
layer { name: "stage_bridge" type: "Python" bottom: "rois" bottom: "bbox_pred" bottom: "seg_cls_prob"
  bottom: "gt_boxes" bottom: "gt_masks" bottom: "im_info" bottom: "mask_info" top: "rois_ext" top: "labels_ext"
  top: "mask_targets_ext" top: "mask_weight_ext" top: "gt_masks_info_ext" top: "bbox_targets_ext"
  top: "bbox_inside_weights_ext" top: "bbox_outside_weights_ext" python_param { module: "MOD.stage_bridge_layer"
  layer: "StageBridgeLayer" param_str: "{ 'feat_stride': 16, 'use_clip': 1, 'clip_base': 512, 'num_classes': 4}" } }
'''


@pytest.mark.parametrize("module", MODULES)
def test_a_net_shaped_like_mncs_train_net_reads_with_setup_shapes(module):
    model = load_from_text(TRAIN_NET.replace("MOD", module), random_weights=True)
    shapes = model.blob_shapes
    assert list(model.inputs) == ["data", "im_info", "gt_boxes", "gt_masks", "mask_info"]
    assert shapes["data"] == (1, 3, 600, 1000) and shapes["gt_masks"] == (1, 21, 21)
    assert shapes["rpn_rois"] == (1, 5) and shapes["rpn_rois_index"] == (1, 1)
    assert shapes["bbox_targets"] == (1, 16) and shapes["mask_weight"] == (1, 1, 21, 21) and shapes["bg_inds"] == (1, 4)
    assert shapes["rpn_labels"] == (1, 1, 9 * 37, 62) and shapes["rpn_bbox_targets"] == (1, 36, 37, 62)
    assert shapes["mask_proposal"] == (1, 1, 21, 21) and shapes["mask_proposal_label"] == (1, 1)
    assert shapes["masked"] == (1, 6, 4, 4) and shapes["rois_ext"] == (1, 5) and shapes["bbox_targets_ext"] == (1, 16)
    with pytest.raises(CaffeqError, match=r"layer 'proposal' \(region proposals\): this is its TRAIN form"):
        model.run({k: np.zeros(shapes[k], np.float32) for k in model.inputs})


def test_train_forms_that_a_setup_refuses():
    text = TRAIN_NET.replace("MOD", "pylayer")
    with pytest.raises(LayerError, match="'num_classes' must be a positive integer"):
        load_from_text(text.replace("{ 'num_classes': 4 }", "{ 'classes': 4 }"))
    with pytest.raises(LayerError, match="'feat_stride' is required"):
        load_from_text(text.replace("'feat_stride': 16, 'use_clip': 1, 'clip_base': 512, 'num_classes'",
                                    "'num_classes'"))
    # wk910930/py-faster-rcnn's copy of the layer reads no use_clip (its mnc_5stage train net sets none)
    unclipped = load_from_text(text.replace("'use_clip': 1, 'clip_base': 512, 'num_classes'", "'num_classes'"))
    assert unclipped.blob_shapes["bbox_targets_ext"] == (1, 16)
    # the fork's early stage_bridge_layer.py read no num_classes: 21
    fork = load_from_text(TRAIN_NET.replace("MOD", "multitask_network_cascades.pylayer")
                          .replace("'clip_base': 512, 'num_classes': 4}", "'clip_base': 512}"))
    assert fork.blob_shapes["bbox_targets_ext"] == (1, 84)
    assert any("sized for 21 classes" in n for n in fork.warnings)


def test_the_forks_proposal_tops():
    fork = "multitask_network_cascades.pylayer.proposal_layer"
    three = load_from_text(proposal_net(9, 3, 4, fork, tops=("rpn_rois", "rpn_scores", "rpn_rois_index"),
                                        param_str="{'feat_stride': 16, 'use_clip': 1}"))
    assert [three.blob_shapes[t] for t in ("rpn_rois", "rpn_scores", "rpn_rois_index")] == [(1, 5), (1, 1), (1, 1)]
    early = load_from_text(proposal_net(9, 3, 4, fork, tops=("rpn_rois", "rpn_rois_index")))
    assert early.blob_shapes["rpn_rois_index"] == (1, 1)
    with pytest.raises(LayerError, match="gives rois, and proposal_index at TRAIN: 1 or 2 tops, got 3"):
        load_from_text(proposal_net(9, 3, 4, "pylayer.proposal_layer", tops=("a", "b", "c")))


def test_sigmoid_cross_entropy_takes_caffe_mncs_weights():
    text = net('layer { name: "l" type: "SigmoidCrossEntropyLoss" bottom: "x" bottom: "t" bottom: "w" top: "l" }',
               inputs={"x": (3, 4), "t": (3, 4), "w": (3, 4)})
    model = load_from_text(text)
    g = rng(9)
    x = g.standard_normal((3, 4)).astype(np.float32)
    t = (g.random((3, 4)) > 0.5).astype(np.float32)
    wt = g.random((3, 4)).astype(np.float32)
    xd, td = x.astype(np.float64), t.astype(np.float64)
    per = -(td * np.log(1 / (1 + np.exp(-xd))) + (1 - td) * np.log(1 - 1 / (1 + np.exp(-xd))))
    np.testing.assert_allclose(model.run({"x": x, "t": t, "w": wt})["l"], (wt * per).sum() / wt.sum(), rtol=1e-5)
    assert model.run({"x": x, "t": t, "w": np.zeros_like(wt)})["l"] == 0
    with pytest.raises(LayerError, match="weights .* must have the inputs' count"):
        load_from_text(text.replace("dim: 3 dim: 4 } } }\nlayer { name: \"l\"", "dim: 3 dim: 5 } } }\nlayer { name: \"l\""))


# ---- the fork's files ---------------------------------------------------------------------------------

@pytest.mark.skipif(not CORPUS.exists(), reason="the prototxt corpus is not on this machine")
def test_the_forks_vgg16_5stage_test_and_resnet50_train_read():
    model = load(str(CORPUS / "delftrobotics-forks__MNC__models__VGG16__mnc_5stage__test.prototxt"))
    assert model.blob_shapes["roi_interpolate_conv5"] == (300, 512, 14, 14)
    assert model.blob_shapes["roi_mask_conv5_ext"] == (300, 512, 14, 14)
    assert model.blob_shapes["seg_cls_prob_ext"] == (300, 21)
    train = load(str(CORPUS / "delftrobotics-forks__MNC__models__ResNet50__mnc_3stage__train.prototxt"))
    assert train.blob_shapes["rpn_labels"] == (1, 1, 9 * 38, 63)
