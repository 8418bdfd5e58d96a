"""The remodet fork's (UrwLee/Experience a59d5b9) PriorBox with normalized sizes, its DetOut and its own
DetectionOutput, against references written from its C++ (prior_box_layer.cpp, det_out_layer.cpp,
bbox_func.cpp NmsFastWithVoting, detection_output_layer.cpp, bbox_util.cpp ApplyNMSFastUnit) with
float32 scalars step by step."""
import numpy as np
import pytest
from conftest import model_py_outputs, net, onnx_outputs, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32

# ---- references ------------------------------------------------------------------------------


def ref_priors(widths, heights, variance, lh, lw, ih, iw, clip):
    """prior_box_layer.cpp's pro_width branch, one float at a time."""
    step_x, step_y = F(F(iw) / F(lw)), F(F(ih) / F(lh))
    coords = []
    for h in range(lh):
        for w in range(lw):
            cx, cy = F((w + 0.5) * float(step_x)), F((h + 0.5) * float(step_y))
            for pw, ph in zip(widths, heights):
                nx, ny = F(cx / F(iw)), F(cy / F(ih))
                coords += [F(float(nx) - float(F(pw)) / 2.0), F(float(ny) - float(F(ph)) / 2.0),
                           F(float(nx) + float(F(pw)) / 2.0), F(float(ny) + float(F(ph)) / 2.0)]
    coords = np.array(coords, F)
    if clip:
        coords = np.minimum(np.maximum(coords, F(0)), F(1))
    var = np.tile(np.array(variance, F), len(coords) // len(variance))
    return np.stack([coords, var])[None]


def ref_decode(loc, prior, var, center, ssd_order):
    """DecodeBBox_Center / _Corner (DetOut) and bbox_util DecodeBBox (DetectionOutput) for one prior."""
    if not center:
        return [F(prior[k] + F(var[k] * loc[k])) for k in range(4)]
    pw, ph = F(prior[2] - prior[0]), F(prior[3] - prior[1])
    pcx, pcy = F(F(prior[0] + prior[2]) / F(2)), F(F(prior[1] + prior[3]) / F(2))
    if ssd_order:
        cx, cy = F(F(F(var[0] * loc[0]) * pw) + pcx), F(F(F(var[1] * loc[1]) * ph) + pcy)
        w, h = F(np.exp(F(var[2] * loc[2])) * pw), F(np.exp(F(var[3] * loc[3])) * ph)
    else:
        cx, cy = F(F(F(loc[0] * pw) * var[0]) + pcx), F(F(F(loc[1] * ph) * var[1]) + pcy)
        w, h = F(np.exp(F(loc[2] * var[2])) * pw), F(np.exp(F(loc[3] * var[3])) * ph)
    return [F(float(cx) - float(w) / 2.0), F(float(cy) - float(h) / 2.0),
            F(float(cx) + float(w) / 2.0), F(float(cy) + float(h) / 2.0)]


def ref_iou(a, b, jaccard):
    if not jaccard:   # BoundingBox::compute_iou
        inter = F(max(F(0), F(min(a[2], b[2]) - max(a[0], b[0]))) * max(F(0), F(min(a[3], b[3]) - max(a[1], b[1]))))
        area_a, area_b = F(F(a[2] - a[0]) * F(a[3] - a[1])), F(F(b[2] - b[0]) * F(b[3] - b[1]))
        iou = F(inter / F(F(area_a + area_b) - inter))
        return F(0) if iou < 0 else iou
    # JaccardOverlap(candidate, kept)
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return F(0)
    iw, ih = F(min(a[2], b[2]) - max(a[0], b[0])), F(min(a[3], b[3]) - max(a[1], b[1]))
    if not (iw > 0 and ih > 0):
        return F(0)

    def size(x):
        return F(0) if x[2] < x[0] or x[3] < x[1] else F(F(x[2] - x[0]) * F(x[3] - x[1]))
    inter = F(iw * ih)
    return F(inter / F(F(size(a) + size(b)) - inter))


def ref_vote_nms(boxes, scores, conf, nms, top_k, jaccard, mode="FastVote"):
    """NmsFastWithVoting / ApplyNMSFastUnit (boxes, a list of [4 float32], changed in place), or NmsOri /
    NmsFast without votes."""
    cand = [(s, i) for i, s in enumerate(scores) if s > F(conf)]
    cand.sort(key=lambda t: -t[0])   # stable, as std::stable_sort
    cand = cand[:top_k]
    kept, votes = [], {}
    for _, idx in cand:
        keep = True
        for k in kept:
            o = ref_iou(boxes[idx], boxes[k], jaccard)
            if mode == "FastVote" and o >= F(0.75):
                votes[k].append((list(boxes[idx]), scores[idx]))
            if (o > F(nms)) if mode == "Fast" else (o >= F(nms)):
                keep = False
        if keep:
            kept.append(idx)
            votes[idx] = [(list(boxes[idx]), scores[idx])]
    for k, lst in votes.items():
        if len(lst) == 1:
            continue
        total = F(0)
        for _, s in lst:
            total = F(total + s)
        acc = [F(0)] * 4
        for box, s in lst:
            scale = F(s / total)
            acc = [F(acc[c] + F(box[c] * scale)) for c in range(4)]
        boxes[k] = acc
    return kept


def ref_detections(loc, conf, prior, num_classes, conf_t, nms_t, top_k, size_t=0.0, center=True, alias=0,
                   labels=(), width=7, detection_output=False, mode="FastVote", var_in_target=False):
    n, num_priors = conf.shape[0], prior.shape[2] // 4
    pbox, pvar = prior[0, 0].reshape(-1, 4), prior[0, 1].reshape(-1, 4)
    if var_in_target:   # DecodeBBox without the variances
        pvar = np.ones_like(pvar)
    flat = loc.reshape(-1)
    rows = []
    for i in range(n):
        lo = flat[i * num_priors * 4:(i + 1) * num_priors * 4].reshape(-1, 4)
        boxes = [ref_decode(lo[p], pbox[p], pvar[p], center, detection_output) for p in range(num_priors)]
        sc = conf[i].reshape(num_priors, num_classes)
        for j in ([1] if detection_output else range(1, num_classes)):
            scores = [sc[p, j] for p in range(num_priors)]
            for pid in ref_vote_nms(boxes, scores, conf_t, nms_t, top_k, detection_output, mode):
                b = [min(max(v, F(0)), F(1)) for v in boxes[pid]]
                if not detection_output and F(F(b[2] - b[0]) * F(b[3] - b[1])) < F(size_t):
                    continue
                label = 1 if detection_output else (labels[j - 1] if labels else j - 1 + alias)
                row = [i, label, scores[pid], *b]
                rows.append(row + [pid] if width == 8 else row)
    if not rows:
        return np.full((1, 1, 1, width), -1, F)
    return np.array(rows, F)[None, None]


# ---- PriorBox ----------------------------------------------------------------------------------

def priors_net(params, feat=(1, 2, 3, 5), img=(1, 3, 48, 80)):
    return net(f'layer {{ name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "pb" prior_box_param {{ {params} }} }}',
               inputs={"f": feat, "img": img})


@pytest.mark.parametrize("params, clip, variance", [
    ("pro_width: 0.06 pro_height: 0.12 pro_width: 0.565685424949 pro_height: 0.3 flip: true "
     "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2", False, [0.1, 0.1, 0.2, 0.2]),
    ("pro_width: 0.95 pro_height: 1.0 pro_width: 0.24 pro_height: 0.8 pro_width: 0.4 pro_height: 0.4 clip: true",
     True, [0.1]),
])
def test_normalized_priors_match_the_fork(params, clip, variance, tmp_path):
    model = load_from_text(priors_net(params))
    widths = [float(v) for v in params.split("pro_width: ")[1:] for v in [v.split()[0]]]
    heights = [float(v) for v in params.split("pro_height: ")[1:] for v in [v.split()[0]]]
    ref = ref_priors(widths, heights, variance, 3, 5, 48, 80, clip)
    assert model.blob_shapes["pb"] == (1, 2, 3 * 5 * len(widths) * 4)
    feeds = {"f": np.zeros((1, 2, 3, 5), F), "img": np.zeros((1, 3, 48, 80), F)}
    np.testing.assert_array_equal(model.run(feeds)["pb"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, feeds, tmp_path)["pb"], ref)
    np.testing.assert_array_equal(onnx_outputs(model, feeds, tmp_path)["pb"], ref)
    if clip:
        assert ref.min() == 0 and ref[0, 0].max() == 1
    else:
        assert ref.min() < 0   # the unclipped boxes of the border cells


@pytest.mark.parametrize("params, msg", [
    ("pro_width: 0.1 pro_height: 0.1 min_size: 30", "could not be provided at the same time"),
    ("pro_width: 0.1 pro_width: 0.2 pro_height: 0.1", "in pairs"),
    ("pro_width: 1.5 pro_height: 0.1", r"\(0, 1\]"),
    ("pro_width: 0.1 pro_height: 0.1 step: 8", "no such field"),
    ("pro_width: 0.1 pro_height: 0.1 variance: 0.1 variance: 0.2", "1 or 4"),
])
def test_normalized_priors_refuse_what_the_fork_refuses(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(priors_net(params))


# ---- DetOut and remodet's DetectionOutput -------------------------------------------------------

def detection_inputs(n, num_priors, num_classes, loc_per_prior, seed):
    """Priors on a coarse grid of overlapping boxes, so that NMS suppresses and votes."""
    g = rng(seed)
    corners = []
    for p in range(num_priors):
        cx, cy = 0.15 + 0.1 * (p % 7), 0.2 + 0.12 * (p // 7)
        corners += [cx - 0.12, cy - 0.1, cx + 0.12, cy + 0.1]
    prior = np.stack([np.array(corners, F), np.tile(np.array([0.1, 0.1, 0.2, 0.2], F), num_priors)])[None]
    loc = (g.standard_normal((n, num_priors * loc_per_prior)) * 0.5).astype(F)
    conf = g.uniform(0, 1, (n, num_priors * num_classes)).astype(F)
    return loc, conf, prior


def det_net(kind, params, loc, conf, prior):
    return net(f'layer {{ name: "d" type: "{kind}" bottom: "loc" bottom: "conf" bottom: "prior" top: "d" '
               f'detection_output_param {{ {params} }} }}',
               inputs={"loc": loc.shape, "conf": conf.shape, "prior": prior.shape})


def check_rows(got, ref):
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got[..., :3], ref[..., :3])          # image, label, score
    np.testing.assert_allclose(got[..., 3:], ref[..., 3:], rtol=0, atol=1e-6)   # exp: float vs libm


@pytest.mark.parametrize("n, classes, extra, kwargs", [
    (2, 2, "alias_id: 3", dict(alias=3)),
    (1, 3, "target_labels: 7 target_labels: 4 ndim_detout: 8", dict(labels=(7, 4), width=8)),
    (1, 2, "code_type: CORNER", dict(center=False)),
    (2, 3, "vote_or_not: Ori", dict(mode="Ori")),
    (1, 2, "vote_or_not: Fast alias_id: 1", dict(mode="Fast", alias=1)),
])
def test_detout_matches_the_fork(n, classes, extra, kwargs, tmp_path):
    loc, conf, prior = detection_inputs(n, 35, classes, 4 * (classes - 1), seed=classes + n)
    params = (f"num_classes: {classes} share_location: true background_label_id: 0 code_type: CENTER_SIZE "
              f"conf_threshold: 0.55 nms_threshold: 0.35 size_threshold: 0.01 top_k: 12 {extra}")
    if "CORNER" in extra:
        params = params.replace("code_type: CENTER_SIZE ", "")
    model = load_from_text(det_net("DetOut", params, loc, conf, prior))
    width = kwargs.get("width", 7)
    assert model.blob_shapes["d"] == (1, 1, n * (classes - 1) * 12, width)
    ref = ref_detections(loc, conf, prior, classes, 0.55, 0.35, 12, 0.01, **kwargs)
    assert ref.shape[2] > 1 and (ref[0, 0, :, 0] >= 0).all()
    feeds = {"loc": loc, "conf": conf, "prior": prior}
    check_rows(model.run(feeds)["d"], ref)
    check_rows(model_py_outputs(model, feeds, tmp_path)["d"], ref)
    check_rows(onnx_outputs(model, feeds, tmp_path)["d"], ref)


def test_detout_votes_and_drops_small_boxes(tmp_path):
    # two near-equal priors and a third overlapping both: the kept box moves to the weighted mean
    prior = np.array([[[0.1, 0.1, 0.5, 0.5, 0.11, 0.1, 0.51, 0.5, 0.4, 0.4, 0.42, 0.42],
                       [0.1, 0.1, 0.2, 0.2] * 3]], F)
    loc = np.zeros((1, 12), F)
    conf = np.array([[0.1, 0.9, 0.2, 0.8, 0.3, 0.7]], F)
    params = ("num_classes: 2 conf_threshold: 0.5 nms_threshold: 0.3 size_threshold: 0.01 top_k: 10 "
              "code_type: CENTER_SIZE")
    model = load_from_text(det_net("DetOut", params, loc, conf, prior))
    got = model.run({"loc": loc, "conf": conf, "prior": prior})["d"]
    np.testing.assert_allclose(onnx_outputs(model, {"loc": loc, "conf": conf, "prior": prior}, tmp_path)["d"], got,
                               atol=1e-7)
    s = F(0.9) + F(0.8)
    mean_x0 = F(F(0.1) * F(F(0.9) / s)) + F(F(0.11) * F(F(0.8) / s))
    assert got.shape == (1, 1, 1, 7)   # the third box (area 0.0004) is below size_threshold
    np.testing.assert_allclose(got[0, 0, 0, 3], mean_x0, atol=1e-7)
    np.testing.assert_array_equal(got[0, 0, 0, :3], [0, 0, F(0.9)])
    # a prior of no width under CENTER_SIZE: the fork's CHECK_GT, one clear error
    flat = prior.copy()
    flat[0, 0, 2] = flat[0, 0, 0]
    with pytest.raises(LayerError, match="positive size"):
        model.run({"loc": loc, "conf": conf, "prior": flat})
    # nothing above conf_threshold: one row of -1
    none = load_from_text(det_net("DetOut", params.replace("0.5 nms", "0.95 nms"), loc, conf, prior))
    np.testing.assert_array_equal(none.run({"loc": loc, "conf": conf, "prior": prior})["d"], -np.ones((1, 1, 1, 7)))
    np.testing.assert_array_equal(onnx_outputs(none, {"loc": loc, "conf": conf, "prior": prior}, tmp_path)["d"],
                                  -np.ones((1, 1, 1, 7)))


def test_remodets_detection_output_matches_the_fork(tmp_path):
    loc, conf, prior = detection_inputs(2, 28, 3, 4, seed=9)
    params = ("num_classes: 3 share_location: true background_label_id: 0 code_type: CENTER_SIZE "
              "variance_encoded_in_target: false visual_param { visualize: false display_maxsize: 1000 line_width: 4 "
              "conf_threshold: 0.8 size_threshold: 0.01 color_param { rgb { val: 0 val: 255 val: 0 } } } "
              "conf_threshold: 0.5 nms_threshold: 0.45 size_threshold: 0.5 top_k: 9")
    model = load_from_text(det_net("DetectionOutput", params, loc, conf, prior))
    assert any("read as remodet" in w for w in model.warnings)
    assert model.blob_shapes["d"] == (1, 1, 2 * 9, 7)
    # class 1 only, label 1, size_threshold never applied (0.5 would drop every row)
    ref = ref_detections(loc, conf, prior, 3, 0.5, 0.45, 9, detection_output=True)
    assert ref.shape[2] > 2 and set(ref[0, 0, :, 1]) == {1}
    feeds = {"loc": loc, "conf": conf, "prior": prior}
    check_rows(model.run(feeds)["d"], ref)
    check_rows(model_py_outputs(model, feeds, tmp_path)["d"], ref)
    check_rows(onnx_outputs(model, feeds, tmp_path)["d"], ref)
    # variance_encoded_in_target (which DetOut's CHECK refuses): the loc holds the scaled offsets
    scaled = load_from_text(det_net("DetectionOutput", params.replace("variance_encoded_in_target: false",
                                                                      "variance_encoded_in_target: true"),
                                    loc * 0.1, conf, prior))
    want = ref_detections(loc * 0.1, conf, prior, 3, 0.5, 0.45, 9, detection_output=True, var_in_target=True)
    check_rows(scaled.run({"loc": loc * 0.1, "conf": conf, "prior": prior})["d"], want)
    with pytest.raises(LayerError, match="CORNER_SIZE"):
        load_from_text(det_net("DetectionOutput", params.replace("CENTER_SIZE", "CORNER_SIZE"), loc, conf, prior))


@pytest.mark.parametrize("kind, params, msg", [
    ("DetOut", "num_classes: 2 nms_threshold: 0.3 size_threshold: 0 top_k: 5", "conf_threshold is required"),
    ("DetOut", "num_classes: 2 conf_threshold: 0.5 nms_threshold: 0.3 size_threshold: 0 top_k: 5 "
               "vote_or_not: OriSoft", "soft NMS"),
    ("DetOut", "num_classes: 3 conf_threshold: 0.5 nms_threshold: 0.3 size_threshold: 0 top_k: 5 "
               "target_labels: 1", "target_labels"),
    ("DetOut", "num_classes: 2 background_label_id: 1 conf_threshold: 0.5 nms_threshold: 0.3 size_threshold: 0 "
               "top_k: 5", "background_label_id must be 0"),
    ("DetectionOutput", "num_classes: 2 conf_threshold: 0.5 nms_threshold: 0.3 size_threshold: 0 top_k: 5",
     "visual_param.visualize is required"),
])
def test_remodet_detections_refuse_what_the_fork_refuses(kind, params, msg):
    loc, conf, prior = detection_inputs(1, 7, 2, 4, seed=1)
    with pytest.raises(LayerError, match=msg):
        load_from_text(det_net(kind, params, loc, conf, prior))
