"""nqanh/affordance-net's ROIAlignment: one bilinear sample at the centre of each clamped bin.

The reference is a numpy loop written here from the fork's roi_alignment_layer.cpp (Forward_cpu), in
float32 as the fork computes.  The fork's licence is not checked here, so its prototxt files stay out
of tests/fixtures/realworld/; the net-level test is a small prototxt shaped like its test.prototxt.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, net, onnx_outputs, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
X_SHAPE = (2, 3, 7, 9)   # N, C, H, W all different

# rois in input pixels (spatial_scale 0.5 below): inside, crossing the border, negative corners, one
# pixel, beyond the map's bottom right (clamped to the last row / column), on the second image,
# fractional corners, and an inverted roi (its size becomes 1)
ROIS = np.array([[0, 1, 3, 13, 9], [1, 5, 1, 17, 13], [1, -4, -3, 6, 4], [0, 9, 7, 9, 7],
                 [1, 30, 20, 40, 33], [0, 3.5, 2.5, 11.3, 6.7], [1, 8, 6, 2, 1]], np.float32)


def ref_roi_alignment(x, rois, ph, pw, scale):
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), np.float32)
    clamp = lambda v, size: np.fmin(np.fmax(v, F(0)), F(size - 1))
    for r, roi in enumerate(rois):
        d = x[int(roi[0])]
        x1, y1, x2, y2 = (F(v) * F(scale) for v in roi[1:5])
        bin_h = np.fmax(y2 - y1 + F(1), F(1)) / F(ph)
        bin_w = np.fmax(x2 - x1 + F(1), F(1)) / F(pw)
        for i in range(ph):
            hs, he = clamp(F(i) * bin_h + y1, h), clamp(F(i + 1) * bin_h + y1, h)
            for j in range(pw):
                ws, we = clamp(F(j) * bin_w + x1, w), clamp(F(j + 1) * bin_w + x1, w)
                if he < hs or we < ws:
                    continue
                cy, cx = (hs + he) / F(2), (ws + we) / F(2)
                top, bottom = min(max(math.floor(cy), 0), h - 1), min(max(math.ceil(cy), 0), h - 1)
                left, right = min(max(math.floor(cx), 0), w - 1), min(max(math.ceil(cx), 0), w - 1)
                wy, wx = cy - F(top), cx - F(left)
                out[r, :, i, j] = (d[:, top, left] * (F(1) - wy) * (F(1) - wx)
                                   + d[:, top, right] * (F(1) - wy) * wx
                                   + d[:, bottom, left] * wy * (F(1) - wx)
                                   + d[:, bottom, right] * wy * wx)
    return out


def alignment_net(params, rois_shape=(7, 5)):
    return net(f'layer {{ name: "o" type: "ROIAlignment" bottom: "x" bottom: "rois" top: "o" '
               f'roi_alignment_param {{ {params} }} }}', inputs={"x": X_SHAPE, "rois": rois_shape})


def feeds(seed=0):
    return {"x": rng(seed).standard_normal(X_SHAPE).astype(np.float32), "rois": ROIS}


@pytest.mark.parametrize("params, ph, pw, scale", [
    ("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5", 3, 2, 0.5),
    ("pooled_w: 5 pooled_h: 4 spatial_scale: 0.0625", 4, 5, 0.0625),
    ("pooled_h: 1 pooled_w: 3", 1, 3, 1.0),
])
def test_roi_alignment_matches_the_fork(params, ph, pw, scale, tmp_path):
    model = load_from_text(alignment_net(params))
    assert model.blob_shapes["o"] == (7, 3, ph, pw)
    f = feeds(ph)
    ref = ref_roi_alignment(f["x"], ROIS, ph, pw, scale)
    got = model.run(f)["o"]
    assert got.shape == (7, 3, ph, pw)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(model_py_outputs(model, f, tmp_path)["o"], ref)
    np.testing.assert_array_equal(onnx_outputs(model, f, tmp_path)["o"], ref)
    assert "RoiLayer(roi_alignment, " in (tmp_path / "py" / "model.py").read_text()


def test_roi_alignment_4d_rois_and_the_samples_are_not_max_pooling(tmp_path):
    model = load_from_text(alignment_net("pooled_h: 2 pooled_w: 2 spatial_scale: 0.5", rois_shape=(7, 5, 1, 1)))
    f = {"x": feeds(3)["x"], "rois": ROIS.reshape(7, 5, 1, 1)}
    ref = ref_roi_alignment(f["x"], ROIS, 2, 2, 0.5)
    np.testing.assert_array_equal(model.run(f)["o"], ref)
    np.testing.assert_array_equal(onnx_outputs(model, f, tmp_path)["o"], ref)
    # a roi beyond the map samples its last row and column, not zero as ROIPooling gives
    np.testing.assert_array_equal(ref[4, :, 0, 0], f["x"][1, :, 6, 8])


def test_roi_alignment_refusals(tmp_path):
    with pytest.raises(LayerError, match="pooled_h"):
        load_from_text(alignment_net("pooled_w: 2"))
    with pytest.raises(LayerError, match="rois"):
        load_from_text(alignment_net("pooled_h: 2 pooled_w: 2", rois_shape=(7, 4)))
    with pytest.raises(LayerError, match="batch index"):
        load_from_text(alignment_net("pooled_h: 2 pooled_w: 2", (1, 5))).run(
            {"x": np.zeros(X_SHAPE, np.float32), "rois": np.array([[2, 0, 0, 1, 1]], np.float32)})


AFFORDANCE_TRAIN = """
layer { name: "in" type: "Input" top: "data" top: "im_info" top: "gt_boxes" top: "seg_mask_inds" top: "flipped"
  top: "rpn_rois"
  input_param { shape { dim: 1 dim: 3 dim: 12 dim: 16 } shape { dim: 1 dim: 3 } shape { dim: 4 dim: 5 }
    shape { dim: 1 dim: 2 } shape { dim: 1 dim: 1 } shape { dim: 30 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "roi-data" type: "Python" bottom: "rpn_rois" bottom: "gt_boxes" bottom: "im_info"
  bottom: "seg_mask_inds" bottom: "flipped" top: "rois" top: "labels" top: "bbox_targets"
  top: "bbox_inside_weights" top: "bbox_outside_weights" top: "mask_targets" top: "rois_pos"
  python_param { module: "rpn.proposal_target_layer" layer: "ProposalTargetLayer" param_str: "'num_classes': 11" } }
layer { name: "pool5" type: "ROIAlignment" bottom: "conv" bottom: "rois" top: "pool5"
  roi_alignment_param { pooled_w: 7 pooled_h: 7 spatial_scale: 0.0625 } }
layer { name: "pool5_2" type: "ROIAlignment" bottom: "conv" bottom: "rois_pos" top: "pool5_2"
  roi_alignment_param { pooled_w: 7 pooled_h: 7 spatial_scale: 0.0625 } }
"""


def test_affordance_net_proposal_targets_read_with_their_mask_tops():
    # affordance-net's ProposalTargetLayer.setup: the py-faster-rcnn tops, then mask_targets
    # (1, MASK_SIZE, MASK_SIZE) with its config's MASK_SIZE 244 and rois_pos (1, 5)
    shapes = load_from_text(AFFORDANCE_TRAIN, random_weights=True).blob_shapes
    assert shapes["bbox_targets"] == (1, 44)
    assert shapes["mask_targets"] == (1, 244, 244) and shapes["rois_pos"] == (1, 5)
    assert shapes["pool5"] == shapes["pool5_2"] == (1, 8, 7, 7)
    with pytest.raises(LayerError, match="5 bottoms"):
        load_from_text(AFFORDANCE_TRAIN.replace('bottom: "flipped" top', 'top'))


# ---- GradientScaler / GradientSilent (ivalab/affordanceNet_DA) -----------------------------------

GRADIENT_NET = ('layer {{ name: "g" type: "{kind}" bottom: "x" {extra} top: "y" {param} }}\n'
                'layer {{ name: "s" type: "Scale" bottom: "y" top: "z" scale_param {{ bias_term: false }} }}')


@pytest.mark.parametrize("kind, param, flag, want_scale", [
    ("GradientScaler", "gradient_scaler_param { scale_factor: -0.1 }", None, -0.1),
    ("GradientScaler", "", None, 0.0),                    # the fork's default scale_factor
    # ddtm/caffe's RevGrad schedule at max_iter: 2 h / (1 + e^-alpha) - h + lower_bound, reversed
    ("GradientScaler", "gradient_scaler_param { lower_bound: 0.0 upper_bound: 1.0 alpha: 10.0 max_iter: 10000 }",
     None, -(2 / (1 + np.exp(-10.0)) - 1)),
    ("GradientScaler", "gradient_scaler_param { lower_bound: 0.2 upper_bound: 0.5 alpha: 2 }",
     None, -(0.6 / (1 + np.exp(-2.0)) - 0.3 + 0.2)),
    ("GradientSilent", "", None, 0.0),
    ("GradientSilent", "", 1.0, 1.0),                     # need_backprop set: the gradient passes
    ("GradientSilent", "", 0.0, 0.0)])
def test_gradient_layers_pass_data_and_scale_gradients(kind, param, flag, want_scale, tmp_path):
    import torch
    inputs = {"x": (2, 3, 4, 5)}
    extra = ""
    if flag is not None:
        inputs["flag"] = (1,)
        extra = 'bottom: "flag"'
    model = load_from_text(net(GRADIENT_NET.format(kind=kind, extra=extra, param=param), inputs=inputs),
                           random_weights=True)
    x = rng(30).standard_normal((2, 3, 4, 5)).astype(np.float32)
    feeds = {"x": x} if flag is None else {"x": x, "flag": np.array([flag], np.float32)}
    w = np.asarray(model.graph.nodes[-1].blobs[0]).reshape(1, 3, 1, 1)
    np.testing.assert_array_equal(model.run(feeds, all_blobs=True)["y"], x)
    check_everywhere(model, feeds, {"z": x * w}, tmp_path, rtol=1e-6)
    module = model.to_torch()
    xt = torch.from_numpy(x).requires_grad_(True)
    args = [xt] + ([torch.tensor([flag])] if flag is not None else [])
    out = module(*args)
    z = out["z"] if isinstance(out, dict) else out
    z.sum().backward()
    torch.testing.assert_close(xt.grad, torch.from_numpy(np.float32(want_scale) * w).expand_as(xt.grad), rtol=1e-6, atol=0)


@pytest.mark.parametrize("param, msg", [
    ("scale_factor: -1 upper_bound: 1", "mixes affordanceNet_DA's scale_factor"),
    ("lower_bound: 2 upper_bound: 1", "lower_bound <= upper_bound"),
    ("max_iter: 0.5", "max_iter >= 1"),
])
def test_gradient_scaler_schedule_refusals(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(GRADIENT_NET.format(kind="GradientScaler", extra="",
                                               param=f"gradient_scaler_param {{ {param} }}"), inputs={"x": (1, 2, 3, 3)}))


def test_gradient_scaler_takes_one_bottom():
    with pytest.raises(LayerError, match="takes one bottom, got 2"):
        load_from_text(net(GRADIENT_NET.format(kind="GradientScaler", extra='bottom: "x"', param=""),
                           inputs={"x": (1, 2, 3, 3)}))
