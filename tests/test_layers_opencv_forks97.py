"""Two OpenCV-only readings that its own samples and test data need.

- DetectionOutput with `normalized_bbox: false` (OpenCV's Faster R-CNN samples feed the Proposal's rois
  as pixel priors).  The reference follows opencv/opencv 0052d95 modules/dnn/src/layers/
  detection_output_layer.cpp (GetPriorBBoxes, DecodeBBox, BBoxSize, JaccardOverlap, processDetections_)
  and nms.inl.hpp (NMSFast_): 4 pixel corners per prior, CENTER_SIZE with width / height + 1 and centre
  xmin + width / 2, clip to [0, W - 1] x [0, H - 1] of a 4th bottom, NMS sizes (w + 1)(h + 1), OpenCV's
  defaults (confidence_threshold 0), rows in pixels; written in SSD's row order, as caffeq writes them.
- Accum (lmb-freiburg/flownet2 72664da src/caffe/layers/accum_layer.cpp, the layer OpenCV's
  accum_layer.cpp implements): the bottoms resampled at x = w / (tw - 1) * (bw - 1) bilinearly and
  concatenated along channels; the top size from have_reference, size_divisible_by or top_height/width.
"""
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, check_everywhere, model_py_outputs, net, onnx_outputs, rng
from ssd_reference import apply_keep_top_k

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


# ---- DetectionOutput, normalized_bbox: false ----------------------------------------------------------

def cv_decode(prior, var, t, code, vit, clip):
    b = t if vit else (var * t).astype(F)
    if code == "CORNER":
        out = (prior + b).astype(F)
    else:
        pw, ph = F(F(prior[2] - prior[0]) + F(1)), F(F(prior[3] - prior[1]) + F(1))
        pcx, pcy = F(prior[0] + F(pw * F(0.5))), F(prior[1] + F(ph * F(0.5)))
        cx, cy = F(F(b[0] * pw) + pcx), F(F(b[1] * ph) + pcy)
        w, h = F(np.exp(b[2]) * pw), F(np.exp(b[3]) * ph)
        out = np.array([cx - F(w * F(0.5)), cy - F(h * F(0.5)), cx + F(w * F(0.5)), cy + F(h * F(0.5))], F)
    if clip is not None:
        out = np.maximum(np.minimum(out, np.array(clip * 2, F)), F(0))
    return out


def pixel_size(b):
    if b[2] < b[0] or b[3] < b[1]:
        return F(0)
    return F(F(F(b[2] - b[0]) + F(1)) * F(F(b[3] - b[1]) + F(1)))


def pixel_iou(a, b):
    inter = np.array([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])], F)
    isz = pixel_size(inter)
    if isz <= 0:
        return F(0)
    return F(isz / F(F(pixel_size(a) + pixel_size(b)) - isz))


def opencv_pixel_ref(loc, conf, prior, classes, share, vit, code, nms, top_k, keep_top_k, clip=None,
                     conf_threshold=0.0):
    n, P = loc.shape[0], prior.shape[2] // 4
    flat = prior.reshape(-1)
    boxes = flat[:4 * P].reshape(P, 4)
    var = None if vit else flat[4 * P:8 * P].reshape(P, 4)
    n_loc = 1 if share else classes
    offsets = loc.reshape(n, P, n_loc, 4)
    scores = conf.reshape(n, P, classes)
    targets = classes - 1   # background 0
    rows = []
    for i in range(n):
        dec = {c: np.array([cv_decode(boxes[p], None if vit else var[p], offsets[i, p, c], code, vit, clip)
                            for p in range(P)]) for c in range(n_loc)}
        kept = {}
        for c in range(1, classes):
            s = scores[i, :, c]
            order = sorted((p for p in range(P) if s[p] > F(conf_threshold)), key=lambda p: -s[p])
            order = order[:top_k] if top_k > 0 else order
            b, keep = dec[0 if share else c], []
            for p in order:
                if all(pixel_iou(b[p], b[k]) <= F(nms) for k in keep):
                    keep.append(p)
                    if targets == 1 and len(keep) >= keep_top_k:   # OpenCV's early stop
                        break
            kept[c] = keep
        kept = apply_keep_top_k(kept, scores[i], keep_top_k)
        for c in sorted(kept):
            rows += [[i, c, scores[i, p, c], *dec[0 if share else c][p]] for p in kept[c]]
    return np.array(rows, F)[None, None]


def rois_inputs(n, P, classes, n_loc, vit, seed):
    """Faster R-CNN-like pixel priors (1, 1 or 2, 4P), loc (N, 4 P n_loc), softmax conf (N, P C)."""
    g = rng(seed)
    x0, y0 = g.uniform(0, 500, P), g.uniform(0, 300, P)
    prior = np.stack([x0, y0, x0 + g.uniform(10, 160, P), y0 + g.uniform(10, 120, P)], 1).reshape(1, 1, -1)
    if not vit:
        prior = np.concatenate([prior, np.tile([0.1, 0.1, 0.2, 0.2], P).reshape(1, 1, -1)], 1)
    loc = g.standard_normal((n, P * n_loc * 4)) * 0.3
    z = g.standard_normal((n, P, classes)) * 2
    conf = (np.exp(z) / np.exp(z).sum(2, keepdims=True)).reshape(n, -1)
    return loc.astype(F), conf.astype(F), prior.astype(F)


def cv_det_net(shapes, param):
    bottoms = "".join(f'bottom: "{b}" ' for b in shapes)
    return load_from_text(net(f'layer {{ name: "d" type: "DetectionOutput" {bottoms}top: "o" '
                              f'detection_output_param {{ {param} normalized_bbox: false }} }}', inputs=shapes))


@pytest.mark.parametrize("share, vit, code, classes, keep, top_k", [
    (False, True, "CENTER_SIZE", 4, 12, 0),     # the Faster R-CNN samples' settings
    (True, False, "CENTER_SIZE", 3, 9, 15),
    (False, False, "CORNER", 3, 10, 0),
    (False, True, "CENTER_SIZE", 2, 5, 0),      # one target class: OpenCV stops NMS at keep_top_k
])
def test_opencv_pixel_boxes(share, vit, code, classes, keep, top_k, tmp_path):
    P = 29
    loc, conf, prior = rois_inputs(2, P, classes, 1 if share else classes, vit, seed=7)
    if code == "CORNER":
        loc = (loc * 20).astype(F)
    param = (f"num_classes: {classes} share_location: {str(share).lower()} background_label_id: 0 "
             f"nms_param {{ nms_threshold: 0.3 {f'top_k: {top_k}' if top_k else ''} }} code_type: {code} "
             f"keep_top_k: {keep} variance_encoded_in_target: {str(vit).lower()}")
    ref = opencv_pixel_ref(loc, conf, prior, classes, share, vit, code, 0.3, top_k, keep)
    model = cv_det_net({"loc": loc.shape, "conf": conf.shape, "prior": prior.shape}, param)
    check_everywhere(model, {"loc": loc, "conf": conf, "prior": prior}, {"o": ref}, tmp_path, atol=1e-6,
                     rtol=1e-6)


def test_opencv_pixel_clip_to_the_image(tmp_path):
    classes, P = 3, 31
    loc, conf, prior = rois_inputs(2, P, classes, classes, True, seed=3)
    loc = (loc * 3).astype(F)   # boxes well past the 217 x 153 image
    image = np.zeros((2, 3, 153, 217), F)
    param = ("num_classes: 3 share_location: false background_label_id: 0 nms_param { nms_threshold: 0.45 } "
             "code_type: CENTER_SIZE keep_top_k: 14 variance_encoded_in_target: true clip: true "
             "confidence_threshold: 0.05")
    ref = opencv_pixel_ref(loc, conf, prior, classes, False, True, "CENTER_SIZE", 0.45, 0, 14, clip=[216, 152],
                           conf_threshold=0.05)
    assert ref[..., 3:].max() == 216 and ref[..., 3:].min() == 0
    model = cv_det_net({"loc": loc.shape, "conf": conf.shape, "prior": prior.shape, "img": image.shape}, param)
    check_everywhere(model, {"loc": loc, "conf": conf, "prior": prior, "img": image}, {"o": ref}, tmp_path,
                     atol=1e-6, rtol=1e-6)


def test_opencv_pixel_matches_cv2():
    cv2 = pytest.importorskip("cv2")
    classes, P = 4, 40
    loc, conf, prior = rois_inputs(1, P, classes, classes, True, seed=11)
    text = net('layer { name: "d" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "o" '
               'detection_output_param { num_classes: 4 share_location: false background_label_id: 0 '
               'nms_param { nms_threshold: 0.3 } code_type: CENTER_SIZE keep_top_k: 100 '
               'variance_encoded_in_target: true normalized_bbox: false } }',
               inputs={"loc": loc.shape, "conf": conf.shape, "prior": prior.shape})
    cvnet = cv2.dnn.readNetFromCaffe(bytearray(text.encode()))
    for name, value in (("loc", loc), ("conf", conf), ("prior", prior)):
        cvnet.setInput(value, name)
    theirs = cvnet.forward("d").reshape(-1, 7)
    theirs = theirs[np.any(theirs != 0, axis=1)]
    theirs = theirs[np.lexsort((-theirs[:, 2], theirs[:, 1]))]   # OpenCV sorts by score: SSD's order
    ours = np.asarray(load_from_text(text).run({"loc": loc, "conf": conf, "prior": prior})["o"]).reshape(-1, 7)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_opencv_pixel_nms_below_one_pixel(tmp_path):
    # CORNER with zero offsets: the rows are the priors.  A and B are 0.5 px apart: OpenCV's intersection
    # box has width -0.5 (size 0, IoU 0), both kept; A and C touch (width 0): one shared pixel column,
    # IoU 31 / (341 + 341 - 31) = 0.048 > 0.04, C struck.  torch and model.py compute OpenCV's sizes;
    # ONNX's NonMaxSuppression on (xmin, ymin, xmax + 1, ymax + 1) sees a 0.5 px sliver between A and B
    # (IoU 0.024, under 0.04) as well: the same rows here, while 0.02 strikes B in ONNX only.
    prior = np.array([[[10, 10, 20, 40, 20.5, 10, 30, 40, 20, 10, 30, 40]]], F)
    conf = np.array([[0.1, 0.9, 0.2, 0.8, 0.3, 0.7]], F)
    loc = np.zeros((1, 12), F)
    feeds = {"loc": loc, "conf": conf, "prior": prior}
    for thr, onnx_rows in ((0.04, 2), (0.02, 1)):
        param = (f"num_classes: 2 share_location: true background_label_id: 0 code_type: CORNER keep_top_k: 5 "
                 f"variance_encoded_in_target: true nms_param {{ nms_threshold: {thr} }}")
        ref = opencv_pixel_ref(loc, conf, prior, 2, True, True, "CORNER", thr, 0, 5)
        assert ref.shape == (1, 1, 2, 7) and ref[0, 0, :, 3].tolist() == [10, 20.5]
        model = cv_det_net({k: v.shape for k, v in feeds.items()}, param)
        np.testing.assert_array_equal(model.run(feeds)["o"], ref)
        np.testing.assert_array_equal(model_py_outputs(model, feeds, tmp_path / str(thr))["o"], ref)
        got = onnx_outputs(model, feeds, tmp_path / str(thr))["o"]
        np.testing.assert_array_equal(got, ref[:, :, :onnx_rows])


def test_opencv_pixel_priors_from_a_proposal_refuse_onnx(tmp_path):
    # the Faster R-CNN samples' priors are a Proposal's rois: their count is known only after a run
    text = net('layer { name: "p" type: "Proposal" bottom: "prob" bottom: "bbox" bottom: "info" top: "rois" '
               'proposal_param { feat_stride: 16 base_size: 16 min_size: 16 ratio: 1 scale: 8 '
               'pre_nms_topn: 30 post_nms_topn: 6 nms_thresh: 0.7 } }',
               'layer { name: "r" type: "Reshape" bottom: "rois" top: "pri" reshape_param { shape { dim: 1 dim: 1 '
               'dim: -1 } } }',
               'layer { name: "s" type: "Slice" bottom: "pri" top: "junk" top: "prior" slice_param { axis: 2 '
               'slice_point: 6 } }',
               'layer { name: "d" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "o" '
               'detection_output_param { num_classes: 2 share_location: true background_label_id: 0 '
               'keep_top_k: 5 variance_encoded_in_target: true normalized_bbox: false '
               'nms_param { nms_threshold: 0.3 } } }',
               'layer { name: "k" type: "Silence" bottom: "junk" }',
               inputs={"prob": (1, 2, 5, 7), "bbox": (1, 4, 5, 7), "info": (1, 3), "loc": (1, 24),
                       "conf": (1, 12)})
    model = load_from_text(text)
    with pytest.raises(ExportError, match="count depends on values"):
        model.export_onnx(str(tmp_path / "m.onnx"), optimize=False)


@pytest.mark.parametrize("extra, prior_shape, msg", [
    ("code_type: CORNER_SIZE", (1, 1, 16), "CORNER or CENTER_SIZE"),
    ("", (1, 2, 16), r"\(1, 1, 4 \* num_priors\)"),
    ("clip: true", (1, 1, 16), "needs a 4-D 4th bottom"),
])
def test_opencv_pixel_refusals(extra, prior_shape, msg):
    text = net('layer { name: "d" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "o" '
               'detection_output_param { num_classes: 2 share_location: true keep_top_k: 5 '
               f'variance_encoded_in_target: true normalized_bbox: false {extra} }} }}',
               inputs={"loc": (1, 16), "conf": (1, 8), "prior": prior_shape})
    with pytest.raises(LayerError, match=msg):
        load_from_text(text)


# ---- Accum (flownet2) -----------------------------------------------------------------------------------

def accum_ref(bottoms, th, tw):
    """flownet2's Forward_cpu loop, in float32."""
    parts = []
    for b in bottoms:
        n, c, bh, bw = b.shape
        out = np.zeros((n, c, th, tw), F)
        for y in range(th):
            ypos = F(F(F(y) / F(th - 1)) * F(bh - 1))
            tly = np.floor(ypos)
            ydist = F(ypos - tly)
            for x in range(tw):
                xpos = F(F(F(x) / F(tw - 1)) * F(bw - 1))
                tlx = np.floor(xpos)
                xdist = F(xpos - tlx)
                ty, tx = int(tly), int(tlx)
                ny, nx = min(ty + 1, bh - 1), min(tx + 1, bw - 1)   # the far neighbours weigh 0 at the edge
                tl, tr, bl, br = b[:, :, ty, tx], b[:, :, ty, nx], b[:, :, ny, tx], b[:, :, ny, nx]
                one = F(1)
                s = (F((one - xdist) * (one - ydist)) * tl + F(xdist * ydist) * br).astype(F)
                s = (s + F((one - xdist) * ydist) * bl).astype(F)
                out[:, :, y, x] = (s + F(xdist * F(one - ydist)) * tr).astype(F)
        parts.append(out)
    return np.concatenate(parts, 1)


def accum_net(shapes, param=""):
    bottoms = "".join(f'bottom: "{b}" ' for b in shapes)
    return load_from_text(net(f'layer {{ name: "a" type: "Accum" {bottoms}top: "o" accum_param {{ {param} }} }}',
                              inputs=shapes))


@pytest.mark.parametrize("shapes, param, top", [
    ({"a": (2, 2, 3, 5), "b": (2, 3, 7, 11)}, "", (7, 11)),                      # the largest size
    ({"a": (2, 2, 7, 11), "b": (2, 1, 7, 11)}, "", (7, 11)),                     # same size: sampled anyway
    ({"a": (2, 2, 3, 5), "b": (2, 3, 7, 11)}, "top_height: 9 top_width: 13", (9, 13)),
    ({"a": (2, 2, 3, 5), "b": (2, 3, 7, 11)}, "top_height: 9 top_width: 4", (7, 11)),   # not larger both ways
    ({"a": (2, 2, 3, 5), "b": (2, 3, 7, 11)}, "size_divisible_by: 4", (8, 12)),
    ({"a": (2, 2, 3, 5), "b": (2, 3, 9, 6), "ref": (1, 1, 5, 13)}, "have_reference: true", (5, 13)),
])
def test_accum(shapes, param, top, tmp_path):
    feeds = {k: rng(i).standard_normal(s).astype(F) for i, (k, s) in enumerate(shapes.items())}
    summed = list(feeds.values())[:-1] if "have_reference" in param else list(feeds.values())
    ref = accum_ref(summed, *top)
    model = accum_net(shapes, param)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shapes, param, msg", [
    ({"a": (1, 2, 3, 5)}, "size_divisible_by: 0", "size_divisible_by must be >= 1"),
    ({"a": (1, 2, 1, 5), "b": (1, 2, 1, 3)}, "", "divides by"),
    ({"a": (1, 2, 3, 5)}, "have_reference: true", "at least two bottoms"),
])
def test_accum_refusals(shapes, param, msg):
    with pytest.raises(LayerError, match=msg):
        accum_net(shapes, param)


# ---- OpenCV's files ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, shape", [
    ("Mainvooid__opencv_dnn_samples__faster_rcnn__module_files__faster_rcnn_vgg16.prototxt", "1x1x100x7"),
    ("Mainvooid__opencv_dnn_samples__faster_rcnn__module_files__faster_rcnn_zf.prototxt", "1x1x100x7"),
    ("opencv__opencv__testdata__dnn__layers__accum.prototxt", "1x5x8x12"),
])
def test_opencv_corpus_files_read(name, shape):
    res = subprocess.run([sys.executable, "cli.py", "inspect", str(CORPUS / name)], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert shape in res.stdout
