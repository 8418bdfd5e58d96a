"""zhaoweicai MS-CNN / Cascade R-CNN fork layers: ROIPooling pad_ratio, ROIAlign, DecodeBBox, and the
proposal layers BoxGroupOutput / BoxOutput (read and sized, refused at run time).

References are numpy loops written here from the fork's C++ (roi_pooling_layer.cpp, roi_align_layer.cpp,
decode_bbox_layer.cpp with bbox_util.cpp's DecodeBBoxesWithPrior), in float32 where the fork's float32
rounding decides integer bins.  The fork's licence (UC non-commercial) keeps its prototxt files out of
tests/fixtures/realworld/, so the net-level test is a small prototxt shaped like its deploy files.
"""
import math

import numpy as np
import pytest
from c_reference import c_round
from conftest import assert_close, fast_rcnn_bins, model_py_outputs, net, onnx_outputs, rng

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
X_SHAPE = (2, 3, 7, 9)   # N, C, H, W all different


def padded(roi, pad_ratio):
    """x1, y1, x2, y2 widened by the fork's float32 padding."""
    x1, y1, x2, y2 = (F(v) for v in roi[1:5])
    pad_w = (x2 - x1 + F(1)) * F(pad_ratio)
    pad_h = (y2 - y1 + F(1)) * F(pad_ratio)
    return x1 - pad_w, y1 - pad_h, x2 + pad_w, y2 + pad_h


def ref_roi_pool(x, rois, ph, pw, scale, pad_ratio):
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), np.float32)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        corners = (int(c_round(v * F(scale))) for v in padded(roi, pad_ratio))
        for i, j, hs, he, ws, we in fast_rcnn_bins(*corners, ph, pw, h, w):
            if he > hs and we > ws:
                out[r, :, i, j] = x[b, :, hs:he, ws:we].max(axis=(1, 2))
    return out


def ref_roi_align(x, rois, ph, pw, scale, pad_ratio):
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph + 1, pw + 1), np.float32)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        x1, y1, x2, y2 = (v * F(scale) - F(0.5) for v in padded(roi, pad_ratio))
        rh, rw = y2 - y1, x2 - x1
        if rh <= 0 or rw <= 0:
            continue
        bin_h, bin_w = rh / F(ph), rw / F(pw)
        for i in range(ph + 1):
            for j in range(pw + 1):
                hf = y1 + F(i) * bin_h
                wf = x1 + F(j) * bin_w
                if hf < -0.5 or hf > h - 0.5 or wf < -0.5 or wf > w - 0.5:
                    continue
                h0, w0 = math.floor(hf), math.floor(wf)
                h1, w1 = min(max(h0 + 1, 0), h - 1), min(max(w0 + 1, 0), w - 1)
                h0, w0 = min(max(h0, 0), h - 1), min(max(w0, 0), w - 1)
                lh = F(min(max(hf, F(0)), F(h - 1))) - F(h0)
                lw = F(min(max(wf, F(0)), F(w - 1))) - F(w0)
                hh, hw = F(1) - lh, F(1) - lw
                d = x[b]
                out[r, :, i, j] = (hw * hh * d[:, h0, w0] + lw * hh * d[:, h0, w1]
                                   + hw * lh * d[:, h1, w0] + lw * lh * d[:, h1, w1])
    return out


def ref_decode(deltas, rois, means=(0, 0, 0, 0), stds=(1, 1, 1, 1)):
    """bbox_util.cpp DecodeBBoxesWithPrior in float32 step by step, `pw * exp(bw)` as GCC 4/5 compile it
    (the double exp and product, rounded once)."""
    out = np.zeros((len(rois), 5), np.float32)
    for i, (roi, d) in enumerate(zip(rois, deltas)):
        bx, by, bw, bh = (F(F(d[4 + k] * F(stds[k])) + F(means[k])) for k in range(4))
        pw, ph = F(F(roi[3] - roi[1]) + F(1)), F(F(roi[4] - roi[2]) + F(1))
        cx, cy = F(0.5 * float(F(roi[3] + roi[1]))), F(0.5 * float(F(roi[4] + roi[2])))
        tw, th = F(float(pw) * math.exp(float(bw))), F(float(ph) * math.exp(float(bh)))
        tx, ty = F(F(bx * pw) + cx), F(F(by * ph) + cy)
        tx, ty = F(tx - F(F(tw - F(1)) / F(2))), F(ty - F(F(th - F(1)) / F(2)))
        out[i] = [roi[0], tx, ty, F(F(tx + tw) - F(1)), F(F(ty + th) - F(1))]
    return out


# rois in input pixels (spatial_scale 0.5 below): inside, crossing the border, one pixel wide, outside,
# on the second image, and corners at odd values so that rounding half away from zero matters
ROIS = np.array([[0, 1, 3, 13, 9], [1, 5, 1, 17, 13], [1, -4, -3, 6, 4], [0, 9, 7, 9, 7],
                 [1, 30, 20, 40, 33], [0, 3.5, 2.5, 11, 6]], np.float32)


def layer_net(kind, params, rois_shape=(6, 5), name="o"):
    return net(f'layer {{ name: "{name}" type: "{kind}" bottom: "x" bottom: "rois" top: "{name}" '
               f'roi_pooling_param {{ {params} }} }}', inputs={"x": X_SHAPE, "rois": rois_shape})


def feeds(seed=0):
    return {"x": rng(seed).standard_normal(X_SHAPE).astype(np.float32), "rois": ROIS}


# ---- ROIPooling pad_ratio ----------------------------------------------------------------------

@pytest.mark.parametrize("pad_ratio", [0.25, 0.5, -0.1])
def test_roi_pooling_pad_ratio_matches_the_fork(pad_ratio, tmp_path):
    model = load_from_text(layer_net("ROIPooling", f"pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 pad_ratio: {pad_ratio}"))
    f = feeds()
    ref = ref_roi_pool(f["x"], ROIS, 3, 2, 0.5, pad_ratio)
    np.testing.assert_array_equal(model.run(f)["o"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, f, tmp_path)["o"], ref)
    np.testing.assert_array_equal(onnx_outputs(model, f, tmp_path)["o"], ref)


def test_roi_pooling_pad_ratio_zero_keeps_the_numbers(tmp_path):
    f = feeds(1)
    plain = load_from_text(layer_net("ROIPooling", "pooled_h: 3 pooled_w: 2 spatial_scale: 0.5")).run(f)["o"]
    zero = load_from_text(layer_net("ROIPooling", "pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 pad_ratio: 0"))
    np.testing.assert_array_equal(zero.run(f)["o"], plain)
    np.testing.assert_array_equal(plain, ref_roi_pool(f["x"], ROIS, 3, 2, 0.5, 0.0))
    # the export of a net without pad_ratio stays as before: no padding argument, no extra ONNX nodes
    onnx = pytest.importorskip("onnx")
    m = load_from_text(layer_net("ROIPooling", "pooled_h: 3 pooled_w: 2 spatial_scale: 0.5"))
    np.testing.assert_array_equal(onnx_outputs(m, f, tmp_path)["o"], plain)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "mNone.onnx")).graph.node]
    assert "Concat" not in ops and "MaxRoiPool" in ops
    np.testing.assert_array_equal(model_py_outputs(m, f, tmp_path)["o"], plain)
    assert "RoiLayer(roi_max_pool, 3, 2, spatial_scale=0.5)" in (tmp_path / "py" / "model.py").read_text()


# ---- ROIAlign ----------------------------------------------------------------------------------

@pytest.mark.parametrize("params, ph, pw, scale, pad", [
    ("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5", 3, 2, 0.5, 0.0),
    ("pooled_h: 2 pooled_w: 4 spatial_scale: 0.5 pad_ratio: 0.2", 2, 4, 0.5, 0.2),
    ("pooled_h: 1 pooled_w: 3", 1, 3, 1.0, 0.0),
])
def test_roi_align_matches_the_fork(params, ph, pw, scale, pad, tmp_path):
    model = load_from_text(layer_net("ROIAlign", params))
    assert model.blob_shapes["o"] == (6, 3, ph + 1, pw + 1)   # the fork's grid: pooled + 1 points
    f = feeds(2)
    ref = ref_roi_align(f["x"], ROIS, ph, pw, scale, pad)
    got = model.run(f)["o"]
    assert got.shape == (6, 3, ph + 1, pw + 1)
    assert_close(got, ref, 1e-6, 1e-6, "torch")
    assert_close(model_py_outputs(model, f, tmp_path)["o"], ref, 1e-6, 1e-6, "model.py")
    for opset in (13, None):   # GatherND of the same corners, the same float32 sums: equal to torch's
        np.testing.assert_array_equal(onnx_outputs(model, f, tmp_path, opset)["o"], got)
    assert np.count_nonzero(ref[4]) == 0   # the roi outside the map gives 0


def test_roi_align_keeps_its_gradient_and_numbers_when_one_is_wanted():
    # without a gradient the corners are summed into one reused buffer (out=, in place); with one, fresh
    # tensors: the same float32 sums in the same order, so the same bits
    import torch

    from caffeq.layers.cascade_rcnn import roi_align_grid

    f = feeds(2)
    x = torch.from_numpy(f["x"]).requires_grad_()
    rois = torch.from_numpy(ROIS)
    with torch.no_grad():
        fast = roi_align_grid(x, rois, 3, 2, 0.5)
    graded = roi_align_grid(x, rois, 3, 2, 0.5)
    assert torch.equal(fast, graded.detach())
    graded.sum().backward()
    # each grid point inside the map spreads a weight of 1 over its four corners
    inside = (ref_roi_align(f["x"], ROIS, 3, 2, 0.5, 0.0) != 0).any(1).sum() * 3
    assert x.grad.sum().item() == pytest.approx(float(inside), rel=1e-5)


def test_roi_align_shape_and_refusals(tmp_path):
    model = load_from_text(layer_net("ROIAlign", "pooled_h: 6 pooled_w: 5", rois_shape=(4, 5, 1, 1)))
    assert model.blob_shapes["o"] == (4, 3, 7, 6)
    legacy = {"x": rng(5).standard_normal(X_SHAPE).astype(np.float32), "rois": ROIS[:4].reshape(4, 5, 1, 1)}
    np.testing.assert_array_equal(onnx_outputs(model, legacy, tmp_path)["o"], model.run(legacy)["o"])
    with pytest.raises(LayerError, match="pooled_h"):
        load_from_text(layer_net("ROIAlign", "pooled_w: 2"))
    with pytest.raises(LayerError, match="batch index"):
        load_from_text(layer_net("ROIAlign", "pooled_h: 2 pooled_w: 2", (1, 5))).run(
            {"x": np.zeros(X_SHAPE, np.float32), "rois": np.array([[2, 0, 0, 1, 1]], np.float32)})


# ---- DecodeBBox --------------------------------------------------------------------------------

def decode_net(extra="", rois_shape=(6, 5, 1, 1), deltas_shape=(6, 8)):
    return net(f'layer {{ name: "o" type: "DecodeBBox" bottom: "deltas" bottom: "rois" top: "o" {extra} }}',
               inputs={"deltas": deltas_shape, "rois": rois_shape})


@pytest.mark.parametrize("extra, means, stds", [
    ("", (0, 0, 0, 0), (1, 1, 1, 1)),
    (("bbox_reg_param { bbox_mean: 0.1 bbox_mean: -0.2 bbox_mean: 0 bbox_mean: 0.05 "
     "bbox_std: 0.1 bbox_std: 0.1 bbox_std: 0.2 bbox_std: 0.3 }"), (0.1, -0.2, 0, 0.05), (0.1, 0.1, 0.2, 0.3)),
])
def test_decode_bbox_matches_the_fork(extra, means, stds, tmp_path):
    model = load_from_text(decode_net(extra))
    g = rng(3)
    deltas = (g.standard_normal((6, 8)) * 0.5).astype(np.float32)
    rois = ROIS.reshape(6, 5, 1, 1)
    f = {"deltas": deltas, "rois": rois}
    ref = ref_decode(deltas, ROIS, [float(F(v)) for v in means], [float(F(v)) for v in stds]).reshape(6, 5, 1, 1)
    for backend, got in [("torch", model.run(f)["o"]), ("onnx", onnx_outputs(model, f, tmp_path)["o"]),
                         ("model.py", model_py_outputs(model, f, tmp_path)["o"])]:
        assert got.shape == (6, 5, 1, 1), backend
        np.testing.assert_array_equal(got, ref, err_msg=backend)


@pytest.mark.parametrize("extra, shapes, msg", [
    ("bbox_reg_param { bbox_mean: 0 bbox_std: 1 }", {}, "4 bbox_mean"),
    (("bbox_reg_param { bbox_mean: 0 bbox_mean: 0 bbox_mean: 0 bbox_mean: 0 bbox_std: 1 bbox_std: 0 bbox_std: 1 "
     "bbox_std: 1 }"), {}, "bbox_std must all be > 0"),
    ("", {"deltas_shape": (6, 12)}, "bottom 0 must be"),
    ("", {"rois_shape": (6, 4)}, "bottom 1 must be"),
    ("", {"rois_shape": (5, 5)}, "same number of rows"),
])
def test_decode_bbox_refuses_bad_params_and_shapes(extra, shapes, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(decode_net(extra, **shapes))


def test_decode_bbox_train_screening_is_refused(tmp_path):
    text = net('layer { name: "o" type: "DecodeBBox" bottom: "deltas" bottom: "rois" bottom: "gt" top: "o" }',
               inputs={"deltas": (6, 8), "rois": (6, 5), "gt": (6, 6)})
    model = load_from_text(text)
    with pytest.raises(LayerError, match="TRAIN"):
        model.run({"deltas": np.zeros((6, 8), np.float32), "rois": ROIS, "gt": np.zeros((6, 6), np.float32)})


# ---- BoxGroupOutput / BoxOutput -----------------------------------------------------------------

BOX_GROUP = '''layer { name: "proposals" type: "BoxGroupOutput" bottom: "s1" bottom: "b1" bottom: "s2" bottom: "b2"
  top: "proposals" top: "proposals_score"
  box_group_output_param { fg_thr: 0.01 iou_thr: 0.7 max_nms_num: 100
    box_group_param { stride: 8 field_h: 32 field_w: 32 }
    box_group_param { stride: 16 field_h: 64 field_w: 64 field_h: 96 field_w: 48 } } }'''


def box_group_inputs(b2=(2, 4, 5, 6)):
    return {"s1": (1, 2, 10, 12), "b1": (1, 4, 10, 12), "s2": (2, 2, 5, 6), "b2": b2}


def test_box_group_output_gives_the_forks_placeholder_shapes_and_runs(tmp_path):
    roi = ('layer { name: "pool" type: "ROIAlign" bottom: "s1" bottom: "proposals" top: "pool" '
           'roi_pooling_param { pooled_h: 3 pooled_w: 4 spatial_scale: 0.125 } }')
    model = load_from_text(net(BOX_GROUP, roi, inputs=box_group_inputs()))
    shapes = model.blob_shapes
    assert shapes["proposals"] == (1, 5, 1, 1) and shapes["proposals_score"] == (1, 6, 1, 1)
    assert shapes["pool"] == (1, 2, 4, 5)
    feeds_ = {k: np.zeros(s, np.float32) for k, s in box_group_inputs().items()}
    # every background probability 0: all cells propose (values: test_layers_mscnn_proposals)
    out = model.run(feeds_, all_blobs=True)
    assert out["proposals"].shape[1:] == (5, 1, 1) and out["pool"].shape[0] == out["proposals"].shape[0]
    with pytest.raises(ExportError, match="BoxGroupOutput"):
        model.export_onnx(str(tmp_path / "m.onnx"))


@pytest.mark.parametrize("text, inputs, msg", [
    (BOX_GROUP, box_group_inputs(b2=(2, 5, 5, 6)), "bbox bottom 3"),
    (BOX_GROUP, {**box_group_inputs(), "s2": (3, 2, 5, 6), "b2": (3, 4, 5, 6)}, "groups"),
    (BOX_GROUP.replace('bottom: "s2" bottom: "b2"', ''), box_group_inputs(), "one box_group_param per"),
    (BOX_GROUP.replace("field_h: 96 ", ""), box_group_inputs(), "as many field_h as field_w"),
])
def test_box_group_output_checks_like_the_forks_reshape(text, inputs, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(text, inputs=inputs))


def test_box_output_reads_and_runs():
    text = net('''layer { name: "proposals" type: "BoxOutput" bottom: "a" bottom: "b" top: "proposals"
      box_output_param { fg_thr: -5 field_w: 20 field_w: 40 field_h: 40 field_h: 80 downsample_rate: 8
        downsample_rate: 16 } bbox_reg_param { bbox_mean: 0 bbox_mean: 0 bbox_mean: 0 bbox_mean: 0
        bbox_std: 0.1 bbox_std: 0.1 bbox_std: 0.2 bbox_std: 0.2 } }''', inputs={"a": (1, 6, 8, 10), "b": (1, 6, 4, 5)})
    model = load_from_text(text)
    out = model.run({"a": np.zeros((1, 6, 8, 10), np.float32), "b": np.zeros((1, 6, 4, 5), np.float32)})
    assert out["proposals"].shape[1:] == (5, 1, 1)   # the values: test_layers_mscnn_proposals
    with pytest.raises(LayerError, match="one field_h, field_w and downsample_rate per bottom"):
        load_from_text(text.replace("downsample_rate: 16", ""))


# ---- a net shaped like the fork's deploy files -----------------------------------------------------

CASCADE_LIKE = '''
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 6 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "rpn_cls" type: "Convolution" bottom: "conv" top: "rpn_prob" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "rpn_bbox" type: "Convolution" bottom: "conv" top: "rpn_bbox" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "proposals" type: "BoxGroupOutput" bottom: "rpn_prob" bottom: "rpn_bbox" top: "proposals"
  box_group_output_param { box_group_param { stride: 2 field_h: 16 field_w: 16 } } }
layer { name: "roi_pool" type: "ROIPooling" bottom: "conv" bottom: "proposals" top: "roi_pool"
  roi_pooling_param { pooled_w: 4 pooled_h: 3 spatial_scale: 0.5 pad_ratio: 0.25 } }
layer { name: "roi_grid" type: "ROIAlign" bottom: "conv" bottom: "proposals" top: "roi_grid"
  roi_pooling_param { pooled_w: 3 pooled_h: 2 spatial_scale: 0.5 } }
layer { name: "fc" type: "InnerProduct" bottom: "roi_pool" top: "bbox_pred" inner_product_param { num_output: 8 } }
layer { name: "decode" type: "DecodeBBox" bottom: "bbox_pred" bottom: "proposals" top: "proposals_2nd"
  bbox_reg_param { bbox_mean: 0 bbox_mean: 0 bbox_mean: 0 bbox_mean: 0
    bbox_std: 0.1 bbox_std: 0.1 bbox_std: 0.2 bbox_std: 0.2 } }
'''


def test_a_cascade_like_net_is_inspected(capsys, tmp_path):
    from caffeq.__main__ import main
    path = tmp_path / "cascade.prototxt"
    path.write_text(net(CASCADE_LIKE, inputs={"data": (1, 3, 20, 28)}))
    try:
        rc = main(["inspect", str(path)])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc in (0, None) and "Traceback" not in err, err
    assert "BoxGroupOutput" in out and "DecodeBBox" in out and "ROIAlign" in out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert rows["roi_grid"].split()[-1] == "1x6x3x4"      # ROIAlign: pooled + 1 grid points
    assert rows["roi_pool"].split()[-1] == "1x6x3x4"      # ROIPooling: pooled_h x pooled_w
    assert rows["decode"].split()[-1] == "1x5x1x1"        # DecodeBBox: shaped like its rois
    assert rows["proposals"].split()[-1] == "1x5x1x1"     # BoxGroupOutput's placeholder


def ref_scale_route(rois, low, high, mid):
    """scale_route_layer.cpp: rows with sqrt(BBoxSize) in [low, high); else the closest to mid."""
    chosen, best, best_i = [], np.float32(np.finfo(np.float32).max), -1
    for i, (_, x1, y1, x2, y2) in enumerate(rois.reshape(len(rois), 5)):
        size = np.float32(0) if (x2 < x1 or y2 < y1) else np.float32((x2 - x1 + 1) * (y2 - y1 + 1))
        scale = np.sqrt(size, dtype=np.float32)
        if low <= scale < high:
            chosen.append(i)
        d = abs(np.log2(scale / np.float32(mid)))
        if d < best:
            best, best_i = d, i
    return chosen or [best_i]


@pytest.mark.parametrize("param, low, high, mid", [
    ("high_scale: 112", 0.0, 112.0, 112.0),
    ("low_scale: 112 high_scale: 224", 112.0, 224.0, math.sqrt(112 * 224)),
    ("low_scale: 224", 224.0, float(np.finfo(np.float32).max), 224.0),
    ("low_scale: 900 high_scale: 1000", 900.0, 1000.0, math.sqrt(900 * 1000)),   # none: the closest one
])
def test_scale_route_matches_the_fork(param, low, high, mid, tmp_path):
    text = net(f'layer {{ name: "o" type: "ScaleRoute" bottom: "rois" bottom: "feat" top: "o" top: "f" '
               f'scale_route_param {{ {param} }} }}', inputs={"rois": (7, 5), "feat": (7, 3, 2, 2)})
    model = load_from_text(text)
    rois = np.array([[0, 0, 0, 49, 39], [0, 10, 10, 209, 159], [1, 0, 0, 99, 149], [0, 5, 5, 4, 30],
                     [1, 0, 0, 399, 299], [0, 3, 3, 130, 120], [1, 1, 2, 60, 80]], np.float32)
    feat = rng(4).standard_normal((7, 3, 2, 2)).astype(np.float32)
    rows = ref_scale_route(rois, low, high, mid)
    f = {"rois": rois, "feat": feat}
    for backend, got in [("torch", model.run(f)), ("model.py", model_py_outputs(model, f, tmp_path))]:
        np.testing.assert_array_equal(got["o"], rois[rows], backend)
        np.testing.assert_array_equal(got["f"], feat[rows], backend)
    with pytest.raises(ExportError, match="ScaleRoute"):
        onnx_outputs(model, f, tmp_path)
    with pytest.raises(LayerError, match="low_scale"):
        load_from_text(text.replace(param, "low_scale: 200 high_scale: 100"))


def test_roi_pooling_reads_rois_declared_with_another_width_as_caffe_does(tmp_path):
    # person_search's eval_probe declares rois (1, 4) and reshapes them before forward; Caffe's
    # ROIPooling Reshape reads only their count. Running or exporting them as declared is refused.
    text = net('layer { name: "o" type: "ROIPooling" bottom: "x" bottom: "rois" top: "o" '
               'roi_pooling_param { pooled_h: 2 pooled_w: 3 spatial_scale: 0.5 } }',
               inputs={"x": (1, 3, 8, 10), "rois": (1, 4)})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (1, 3, 2, 3)
    with pytest.raises(LayerError, match=r"rois must be \(R, 5\)"):
        model.run({"x": np.zeros((1, 3, 8, 10), np.float32), "rois": np.zeros((1, 4), np.float32)})
    with pytest.raises(ExportError, match=r"rois must be \(R, 5\).*--input-shape"):
        onnx_outputs(model, {}, tmp_path)
    # given the real shape, it runs as any ROIPooling
    fixed = load_from_text(text, input_shapes={"rois": (2, 5)})
    rois = np.array([[0, 0, 0, 9, 7], [0, 2, 1, 6, 5]], np.float32)
    x = rng(2).standard_normal((1, 3, 8, 10)).astype(np.float32)
    assert_close(fixed.run({"x": x, "rois": rois})["o"], ref_roi_pool(x, rois, 2, 3, 0.5, 0.0), 0, 0, "torch")


@pytest.mark.parametrize("kind", ["ROIPooling", "ROIAlign"])
def test_no_rois_give_an_empty_top(kind):
    # Caffe's Reshape gives (0, C, ph, pw) when a proposal layer keeps no roi
    model = load_from_text(layer_net(kind, "pooled_h: 2 pooled_w: 3 spatial_scale: 0.5"))
    got = model.run({"x": np.zeros((2, 3, 7, 9), np.float32), "rois": np.zeros((0, 5), np.float32)})["o"]
    extra = 1 if kind == "ROIAlign" else 0
    assert got.shape == (0, 3, 2 + extra, 3 + extra)
