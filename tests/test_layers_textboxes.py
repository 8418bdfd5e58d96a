"""TextBoxes++ (MhLiao/TextBoxes_plusplus): PriorBox's denser_prior_boxes and DetectionOutput's
quadrilateral (12 numbers per prior) and rotated-box (9) predictions.

References are loops written here from TextBoxes++'s prior_box_layer.cpp and bbox_util.cpp
(DecodeBBoxPolygon, DecodeBBoxRBox, GetLocPredictions), in float64 then float32.
"""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import inputs_text, load_model_py, onnx_run_by_blob, onnx_session, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text


def has_proto_field(message, field):
    from caffeq.io.schema import caffe_pb2
    return field in getattr(caffe_pb2, message).DESCRIPTOR.fields_by_name


needs_denser = pytest.mark.skipif(not has_proto_field("PriorBoxParameter", "denser_prior_boxes"),
                                  reason="this schema has no denser_prior_boxes yet")


# ---- PriorBox: denser_prior_boxes -------------------------------------------------------------

def denser_priors_ref(lh, lw, ih, iw, min_size, max_size, ratios, step, offset, variance):
    """TextBoxes++'s PriorBox loops: each prior, then its copy centred at (h + 1) * step."""
    f32 = np.float32
    ars = [1.0]
    for ar in ratios:
        ars += [ar, 1.0 / ar]
    sizes = [(min_size, min_size), (math.sqrt(min_size * max_size),) * 2]
    sizes += [(min_size * math.sqrt(f32(ar)), min_size / math.sqrt(f32(ar))) for ar in ars[1:]]
    out = []
    for h in range(lh):
        for w in range(lw):
            cx = float(f32((w + offset) * step))
            cys = [float(f32((h + offset) * step)), float(f32((h + 1.0) * step))]
            for bw, bh in sizes:
                bw, bh = float(f32(bw)), float(f32(bh))
                for cy in cys:
                    out += [(cx - bw / 2) / iw, (cy - bh / 2) / ih, (cx + bw / 2) / iw, (cy + bh / 2) / ih]
    coords = np.array(out, np.float32)
    var = np.tile(np.array(variance, np.float32), coords.size // 4)
    return np.stack([coords, var]).reshape(1, 2, -1)


def denser_model_and_output():
    lh, lw, ih, iw = 3, 5, 40, 72
    text = inputs_text(f=(2, 4, lh, lw), img=(2, 3, ih, iw)) + (
        'layer { name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "pb" prior_box_param { '
        'min_size: 10 max_size: 21 aspect_ratio: 2 aspect_ratio: 3 flip: true clip: false '
        'variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 step: 8 offset: 0.5 '
        'denser_prior_boxes: true } }')
    model = load_from_text(text)
    priors_per_cell = 2 * (1 + 1 + 4)
    assert model.blob_shapes["pb"] == (1, 2, lh * lw * priors_per_cell * 4)
    got = model.run({"f": np.zeros((2, 4, lh, lw), np.float32), "img": np.zeros((2, 3, ih, iw), np.float32)})["pb"]
    want = denser_priors_ref(lh, lw, ih, iw, 10, 21, [2, 3], 8.0, 0.5, [0.1, 0.1, 0.2, 0.2])
    return model, got, want


@needs_denser
def test_denser_prior_boxes_match_the_loops():
    _, got, want = denser_model_and_output()
    np.testing.assert_array_equal(got, want)


@needs_denser
def test_denser_prior_boxes_in_onnx_and_model_py(tmp_path):
    model, want, _ = denser_model_and_output()
    feed = {"f": np.zeros((2, 4, 3, 5), np.float32), "img": np.zeros((2, 3, 40, 72), np.float32)}
    got = onnx_run_by_blob(onnx_session(model, tmp_path / "p.onnx"), model, feed)[0]
    np.testing.assert_array_equal(got, want)
    net, info = load_model_py(model, tmp_path / "o")
    with torch.no_grad():
        out = net(*[torch.from_numpy(feed[b]) for b in info["inputs"]])
    assert np.array_equal(out.numpy(), want)


# ---- DetectionOutput: quadrilaterals and rotated boxes ----------------------------------------------

def textboxes_ref(loc, conf, prior, per, nms=0.45, top_k=-1, keep_top_k=-1, conf_threshold=-np.inf):
    """TextBoxes++'s DetectionOutput (CENTER_SIZE, shared location, background 0, 2 classes) as loops;
    rows [i, label, score, box, then the 8 quad or 5 rbox values]."""
    num, P = loc.shape[0], prior.shape[2] // 4
    loc = loc.reshape(num, P, per).astype(np.float64)
    conf = conf.reshape(num, P, 2).astype(np.float64)
    pb = prior[0, 0].reshape(P, 4).astype(np.float64)
    pv = prior[0, 1].reshape(P, 4).astype(np.float64)

    def decode(p, v, t):
        pw, ph = p[2] - p[0], p[3] - p[1]
        pcx, pcy = (p[0] + p[2]) / 2, (p[1] + p[3]) / 2
        cx, cy = v[0] * t[0] * pw + pcx, v[1] * t[1] * ph + pcy
        w, h = math.exp(v[2] * t[2]) * pw, math.exp(v[3] * t[3]) * ph
        box = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
        if per == 12:   # corners: top-left, top-right, bottom-right, bottom-left of the prior
            corners = [(p[0], p[1]), (p[2], p[1]), (p[2], p[3]), (p[0], p[3])]
            extra = []
            for k, (x0, y0) in enumerate(corners):
                extra += [v[0] * t[4 + 2 * k] * pw + x0, v[1] * t[5 + 2 * k] * ph + y0]
        else:           # rotated box: two points around the centre, then a height
            extra = [v[0] * t[4] * pw + pcx, v[1] * t[5] * ph + pcy, v[0] * t[6] * pw + pcx,
                     v[1] * t[7] * ph + pcy, math.exp(v[3] * t[8]) * ph]
        return box, extra

    def iou(a, b):
        w, h = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
        if w <= 0 or h <= 0:
            return 0.0
        return w * h / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h)

    rows = []
    for i in range(num):
        dec = [decode(pb[p], pv[p], loc[i, p]) for p in range(P)]
        cand = sorted((p for p in range(P) if conf[i, p, 1] > conf_threshold), key=lambda p: -conf[i, p, 1])
        if top_k > -1:
            cand = cand[:top_k]
        keep = []
        for p in cand:
            if all(iou(dec[p][0], dec[q][0]) <= nms for q in keep):
                keep.append(p)
        if keep_top_k > -1:
            keep = keep[:keep_top_k]
        rows += [[i, 1, conf[i, p, 1]] + dec[p][0] + dec[p][1] for p in keep]
    return np.array(rows, np.float32).reshape(1, 1, -1, per + 3)


def textboxes_inputs(seed, n, P, per):
    g = rng(seed)
    centers = np.round(g.uniform(0.2, 0.8, (P, 2)) * 5) / 5   # a coarse grid: NMS has work to do
    wh = g.uniform(0.1, 0.4, (P, 2))
    pbox = np.concatenate([centers - wh / 2, centers + wh / 2], 1)
    var = np.tile([0.1, 0.1, 0.2, 0.2], (P, 1))
    prior = np.stack([pbox.reshape(-1), var.reshape(-1)]).reshape(1, 2, -1).astype(np.float32)
    loc = g.normal(0, 1, (n, P * per)).astype(np.float32)
    logits = g.normal(0, 2, (n, P, 2))
    conf = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).reshape(n, -1).astype(np.float32)
    return {"loc": loc, "conf": conf, "prior": prior}


def textboxes_text(n, P, per, extra=""):
    return inputs_text(loc=(n, P * per), conf=(n, P * 2), prior=(1, 2, P * 4)) + (
        'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "det" '
        'detection_output_param { num_classes: 2 share_location: true background_label_id: 0 '
        f'nms_param {{ nms_threshold: 0.45 top_k: 30 }} code_type: CENTER_SIZE keep_top_k: 12 {extra} }} }}')


@pytest.mark.parametrize("per", [12, 9])
def test_detection_output_quads_and_rboxes_match_the_loops(per):
    n, P = 3, 40
    model = load_from_text(textboxes_text(n, P, per))
    assert model.blob_shapes["det"] == (1, 1, 12 * n, per + 3)
    x = textboxes_inputs(1, n, P, per)
    got = model.run(x)["det"]
    want = textboxes_ref(x["loc"], x["conf"], x["prior"], per, top_k=30, keep_top_k=12)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_use_polygon_true_requires_quads():
    with pytest.raises(LayerError, match="x 12 predictions"):
        load_from_text(textboxes_text(2, 10, 9, "use_polygon: true")
                       if has_proto_field("DetectionOutputParameter", "use_polygon")
                       else textboxes_text(2, 10, 7))


def test_quads_need_center_size():
    text = textboxes_text(2, 10, 12).replace("code_type: CENTER_SIZE", "code_type: CORNER")
    with pytest.raises(LayerError, match="only for code_type CENTER_SIZE"):
        load_from_text(text)


@pytest.mark.parametrize("per, opset", [(12, 13), (9, None)])
def test_onnx_and_model_py_match_forward(per, opset, tmp_path):
    n, P = 2, 30
    model = load_from_text(textboxes_text(n, P, per))
    x = textboxes_inputs(3, n, P, per)
    want = model.run(x)["det"]
    got = onnx_run_by_blob(onnx_session(model, tmp_path / "d.onnx", opset), model, x)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    net, info = load_model_py(model, tmp_path / "o")
    with torch.no_grad():
        out = net(*[torch.from_numpy(x[b]) for b in info["inputs"]])
    assert np.array_equal(out.numpy(), want)


def test_a_fourth_bottom_is_accepted_and_not_read(tmp_path):
    """weiliu89/caffe ssd: DetectionOutput takes 3-4 bottoms; bottom[3] (the images) is only drawn on
    with visualize: true.  The rows match the loops whatever the 4th bottom holds."""
    n, P, per = 2, 30, 12
    text = textboxes_text(n, P, per).replace('bottom: "prior" top: "det"', 'bottom: "prior" bottom: "img" top: "det"')
    text = inputs_text(img=(n, 3, 5, 7)) + text
    model = load_from_text(text)
    x = textboxes_inputs(5, n, P, per)
    want = textboxes_ref(x["loc"], x["conf"], x["prior"], per, top_k=30, keep_top_k=12)
    for fill in (0.0, 1e9):
        x["img"] = np.full((n, 3, 5, 7), fill, np.float32)
        got = model.run(x)["det"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    got = onnx_run_by_blob(onnx_session(model, tmp_path / "d.onnx"), model, x)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    net, info = load_model_py(model, tmp_path / "o")
    with torch.no_grad():
        out = net(*[torch.from_numpy(x[b]) for b in info["inputs"]])
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(LayerError, match="arm conf"):   # RefineDet's 5-bottom form wants 2 scores per prior
        load_from_text(text.replace('bottom: "img"', 'bottom: "img" bottom: "img"'))
    with pytest.raises(LayerError, match="optional 4th"):
        load_from_text(text.replace('bottom: "img"', 'bottom: "img" bottom: "img" bottom: "img"'))


REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


@needs_denser
def test_textboxes_plusplus_deploy_builds():
    model = load(str(REALWORLD / "MhLiao__TextBoxes_plusplus__models__deploy.prototxt"))
    assert model.blob_shapes["detection_out"][3] == 15
    assert model.blob_shapes["detection_out"][2] == 200


# ---- TextBoxes (v1): every PriorBox doubles its priors, and no field says so ---------------------

def textboxes_v1_text(lh, lw, ih, iw, per_cell):
    """PriorBox as TextBoxes' deploy files write it (no denser_prior_boxes), and predictions for
    twice its SSD count of priors."""
    P = lh * lw * per_cell
    return inputs_text(f=(1, 4, lh, lw), img=(1, 3, ih, iw), loc=(1, P * 4), conf=(1, P * 2)) + (
        'layer { name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "pb" prior_box_param { '
        'min_size: 10 max_size: 21 aspect_ratio: 2 aspect_ratio: 3 flip: true clip: false '
        'variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }'
        'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "pb" top: "det" '
        'detection_output_param { num_classes: 2 share_location: true background_label_id: 0 '
        'nms_param { nms_threshold: 0.45 top_k: 30 } code_type: CENTER_SIZE keep_top_k: 12 } }')


@needs_denser
def test_textboxes_v1_priors_are_doubled_as_its_fork_does():
    lh, lw, ih, iw = 3, 5, 48, 80          # step 16 both ways, as TextBoxes computes it (image / map)
    per_cell = 2 * (1 + 1 + 4)             # (min, sqrt(min * max), 2, 1/2, 3, 1/3), each doubled
    model = load_from_text(textboxes_v1_text(lh, lw, ih, iw, per_cell))
    assert any("PriorBox read as TextBoxes'" in w for w in model.warnings)
    assert "denser_prior_boxes" not in str(model.net)      # the net as written, for the writers
    feed = {"f": np.zeros((1, 4, lh, lw), np.float32), "img": np.zeros((1, 3, ih, iw), np.float32),
            **{k: v for k, v in textboxes_inputs(3, 1, lh * lw * per_cell, 4).items() if k != "prior"}}
    got = model.run(feed, all_blobs=True)
    # MhLiao/TextBoxes prior_box_layer.cpp: each prior, then its copy centred at (h + 1) * step_y
    want = denser_priors_ref(lh, lw, ih, iw, 10, 21, [2, 3], 16.0, 0.5, [0.1, 0.1, 0.2, 0.2])
    np.testing.assert_array_equal(got["pb"], want)
    assert got["det"].shape[-1] == 7
    # a rebuild (another batch) reads it the same way
    assert model.reshaped(1).blob_shapes["pb"] == model.blob_shapes["pb"]


def test_textboxes_v1_deploy_builds():
    model = load(str(REALWORLD / "MhLiao__TextBoxes__examples__TextBoxes__deploy.prototxt"))
    assert model.blob_shapes["detection_out"] == (1, 1, 200, 7)
    assert sum("PriorBox read as TextBoxes'" in w for w in model.warnings) == 1


def test_predictions_that_fit_no_reading_are_one_error():
    with pytest.raises(LayerError, match="does not hold"):
        load_from_text(textboxes_text(2, 10, 7))
