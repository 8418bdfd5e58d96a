"""RefineDet (sfzhang15/RefineDet): DetectionOutput with the ARM's conf (4th bottom) and loc (5th).

The reference is a loop written here from the fork's detection_output_layer.cpp (Forward_cpu) and
bbox_util.cpp (OSGetConfidenceScores, CasRegDecodeBBoxesAll, DecodeBBox, ApplyNMSFast): an anchor
whose arm conf for class 1 is below objectness_score scores 1 for class 0 and 0 for the others;
each image's priors are decoded by its arm loc first, and loc is decoded against those boxes.
"""
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, inputs_text, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
DEPLOY = "871864580__RefineDet__models__VGGNet__VOC0712__refinedet_vgg16_320x320__deploy.prototxt"
f32 = np.float32


def decode(p, v, t, code):
    """bbox_util.cpp DecodeBBox of one box t against the prior p with variances v, in float32."""
    p, v, t = (np.asarray(x, f32) for x in (p, v, t))
    if code == "CORNER":
        return [p[k] + v[k] * t[k] for k in range(4)]
    pw, ph = p[2] - p[0], p[3] - p[1]
    if code == "CORNER_SIZE":
        return [p[0] + v[0] * t[0] * pw, p[1] + v[1] * t[1] * ph, p[2] + v[2] * t[2] * pw,
                p[3] + v[3] * t[3] * ph]
    cx = v[0] * t[0] * pw + (p[0] + p[2]) / f32(2)
    cy = v[1] * t[1] * ph + (p[1] + p[3]) / f32(2)
    w, h = f32(math.exp(v[2] * t[2])) * pw, f32(math.exp(v[3] * t[3])) * ph
    return [cx - w / f32(2), cy - h / f32(2), cx + w / f32(2), cy + h / f32(2)]


def jaccard(a, b):
    def size(x):
        return 0.0 if x[2] < x[0] or x[3] < x[1] else (x[2] - x[0]) * (x[3] - x[1])
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return 0.0
    w, h = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    return w * h / (size(a) + size(b) - w * h)


def refinedet_ref(loc, conf, prior, arm_conf, arm_loc, C, objectness=0.01, background=0, nms=0.45,
                  top_k=-1, keep_top_k=-1, conf_threshold=-np.inf, code="CENTER_SIZE", var_in_target=False):
    """The fork's Forward_cpu as loops (share_location true)."""
    num, P = loc.shape[0], prior.shape[2] // 4
    loc = loc.reshape(num, P, 4)
    conf = conf.reshape(num, P, C)
    pb = prior[0, 0].reshape(P, 4)
    pv = np.ones((P, 4), f32) if var_in_target else prior[0, 1].reshape(P, 4)
    rows = []
    for i in range(num):
        # OSGetConfidenceScores
        scores = np.empty((P, C), f32)
        for p in range(P):
            if arm_conf is not None and arm_conf.reshape(num, P, 2)[i, p, 1] < f32(objectness):
                scores[p] = [1.0 if c == 0 else 0.0 for c in range(C)]
            else:
                scores[p] = conf[i, p]
        # CasRegDecodeBBoxesAll: the priors decoded by the arm loc, then loc against those
        priors = pb if arm_loc is None else [decode(pb[p], pv[p], arm_loc.reshape(num, P, 4)[i, p], code)
                                             for p in range(P)]
        boxes = [decode(priors[p], pv[p], loc[i, p], code) for p in range(P)]
        kept = {}
        for c in range(C):
            if c == background:
                continue
            cand = [p for p in range(P) if scores[p, c] > conf_threshold]
            cand.sort(key=lambda p: -scores[p, c])     # std::stable_sort, descending
            if top_k > -1:
                cand = cand[:top_k]
            keep = []
            for p in cand:
                if all(jaccard(boxes[p], boxes[q]) <= nms for q in keep):
                    keep.append(p)
            kept[c] = [(scores[p, c], p) for p in keep]
        if keep_top_k > -1 and sum(map(len, kept.values())) > keep_top_k:
            pool = sorted(((s, c, p) for c in sorted(kept) for s, p in kept[c]), key=lambda t: -t[0])
            kept = {}
            for s, c, p in pool[:keep_top_k]:
                kept.setdefault(c, []).append((s, p))
        for c in sorted(kept):
            rows += [[i, c, s] + [float(x) for x in boxes[p]] for s, p in kept[c]]
    if not rows:
        rows = [[i] + [-1] * 6 for i in range(num)]
    return np.array(rows, f32).reshape(1, 1, -1, 7)


def refinedet_inputs(seed, n, P, C):
    g = rng(seed)
    centers = np.round(g.uniform(0.2, 0.8, (P, 2)) * 5) / 5      # a coarse grid: NMS has work to do
    wh = g.uniform(0.1, 0.4, (P, 2))
    pbox = np.concatenate([centers - wh / 2, centers + wh / 2], 1)
    var = np.tile([0.1, 0.1, 0.2, 0.2], (P, 1))
    prior = np.stack([pbox.reshape(-1), var.reshape(-1)]).reshape(1, 2, -1).astype(f32)
    logits = g.normal(0, 2, (n, P, C))
    conf = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    arm = g.normal(0, 3, (n, P, 2))
    arm_conf = np.exp(arm) / np.exp(arm).sum(-1, keepdims=True)
    return {"loc": g.normal(0, 1, (n, P * 4)).astype(f32), "conf": conf.reshape(n, -1).astype(f32),
            "prior": prior, "arm_conf": arm_conf.reshape(n, -1).astype(f32),
            "arm_loc": g.normal(0, 0.7, (n, P * 4)).astype(f32)}


def refinedet_text(params, n, P, C, arm=2, **shapes_instead):
    extra = ' bottom: "arm_conf"' + ' bottom: "arm_loc"' * (arm == 2) if arm else ""
    shapes = {"loc": (n, P * 4), "conf": (n, P * C), "prior": (1, 2, P * 4), "arm_conf": (n, P * 2),
              "arm_loc": (n, P * 4)}
    shapes = {**dict(list(shapes.items())[:3 + arm]), **shapes_instead}
    return inputs_text(**shapes) + (
        f'layer {{ name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior"{extra} '
        f'top: "det" detection_output_param {{ num_classes: {C} share_location: true {params} }} }}')


VARIANTS = [
    # the real file's settings, with more anchors filtered
    ("nms_param { nms_threshold: 0.45 top_k: 20 } code_type: CENTER_SIZE keep_top_k: 25 "
     "confidence_threshold: 0.01 objectness_score: 0.3",
     {"nms": 0.45, "top_k": 20, "keep_top_k": 25, "conf_threshold": 0.01, "objectness": 0.3}),
    # objectness_score's default (0.01)
    ("nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE confidence_threshold: 0.02",
     {"nms": 0.45, "conf_threshold": 0.02}),
    # no threshold: the filtered anchors' zero scores go through NMS too, in prior order
    ("nms_param { nms_threshold: 0.5 } code_type: CENTER_SIZE objectness_score: 0.4",
     {"nms": 0.5, "objectness": 0.4}),
    # no background class: filtered anchors score 1 for class 0, which is then a real class
    ("background_label_id: -1 nms_param { nms_threshold: 0.4 top_k: 10 } code_type: CENTER_SIZE "
     "confidence_threshold: 0.05 objectness_score: 0.3",
     {"background": -1, "nms": 0.4, "top_k": 10, "conf_threshold": 0.05, "objectness": 0.3}),
    ("nms_param { nms_threshold: 0.3 } code_type: CORNER confidence_threshold: 0.05 objectness_score: 0.3",
     {"nms": 0.3, "code": "CORNER", "conf_threshold": 0.05, "objectness": 0.3}),
    ("nms_param { nms_threshold: 0.35 } code_type: CORNER_SIZE variance_encoded_in_target: true "
     "keep_top_k: 9 confidence_threshold: 0.05 objectness_score: 0.2",
     {"nms": 0.35, "code": "CORNER_SIZE", "var_in_target": True, "keep_top_k": 9, "conf_threshold": 0.05,
      "objectness": 0.2}),
]


@pytest.mark.parametrize("params, kw", VARIANTS)
def test_refinedet_detection_output_follows_the_fork(params, kw, tmp_path):
    n, P, C = 2, 31, 5
    feeds = refinedet_inputs(7, n, P, C)
    model = load_from_text(refinedet_text(params, n, P, C))
    assert node_of(model, "det").attrs["arm"] == 2
    ref = refinedet_ref(feeds["loc"], feeds["conf"], feeds["prior"], feeds["arm_conf"], feeds["arm_loc"], C, **kw)
    filtered = feeds["arm_conf"].reshape(n, P, 2)[..., 1] < f32(kw.get("objectness", 0.01))
    assert filtered.any() and not filtered.all()
    check_everywhere(model, feeds, {"det": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_the_arm_changes_the_rows():
    """The arm bottoms matter: without them (SSD's 3 bottoms) the same blobs give other rows."""
    n, P, C = 2, 31, 5
    feeds = refinedet_inputs(7, n, P, C)
    params, kw = VARIANTS[0]
    with_arm = load_from_text(refinedet_text(params, n, P, C)).run(feeds)["det"]
    plain = load_from_text(refinedet_text(params, n, P, C, arm=0)).run(
        {k: feeds[k] for k in ("loc", "conf", "prior")})["det"]
    ref = refinedet_ref(feeds["loc"], feeds["conf"], feeds["prior"], None, None, C, **kw)
    np.testing.assert_allclose(plain, ref, rtol=1e-5, atol=1e-5)
    assert with_arm.shape != plain.shape or not np.allclose(with_arm, plain)


def test_arm_conf_alone_filters_without_refining(tmp_path):
    """4 bottoms: OSGetConfidenceScores with the priors as they are (the fork's bottom.size() >= 4)."""
    n, P, C = 2, 31, 5
    feeds = refinedet_inputs(11, n, P, C)
    del feeds["arm_loc"]
    params = ("nms_param { nms_threshold: 0.45 top_k: 15 } code_type: CENTER_SIZE keep_top_k: 20 "
              "confidence_threshold: 0.01 objectness_score: 0.3")
    model = load_from_text(refinedet_text(params, n, P, C, arm=1))
    assert node_of(model, "det").attrs["arm"] == 1
    ref = refinedet_ref(feeds["loc"], feeds["conf"], feeds["prior"], feeds["arm_conf"], None, C, nms=0.45,
                        top_k=15, keep_top_k=20, conf_threshold=0.01, objectness=0.3)
    check_everywhere(model, feeds, {"det": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_an_ssd_fourth_bottom_stays_the_images():
    """SSD's 4th bottom (visualize's images) is not read as arm conf, even when its size is 2P."""
    n, P, C = 2, 31, 5
    images = refinedet_text("code_type: CENTER_SIZE", n, P, C, arm=1, arm_conf=(n, 3, 4, 5))
    assert node_of(load_from_text(images), "det").attrs["arm"] == 0
    shown = refinedet_text("code_type: CENTER_SIZE visualize: true", n, P, C, arm=1)
    assert node_of(load_from_text(shown), "det").attrs["arm"] == 0
    assert node_of(load_from_text(shown.replace(" visualize: true", "")), "det").attrs["arm"] == 1


def test_xilinx_detection_output_refine_is_refinedets(tmp_path):
    """Xilinx's Caffe (Vitis AI tutorials' refinedet_baseline.prototxt) names RefineDet's 5-bottom
    DetectionOutput DetectionOutputRefine; its 4th bottom is always the arm confidences."""
    n, P, C = 2, 31, 5
    feeds = refinedet_inputs(7, n, P, C)
    params, kw = VARIANTS[0]
    model = load_from_text(refinedet_text(params, n, P, C).replace('"DetectionOutput"', '"DetectionOutputRefine"'))
    ref = refinedet_ref(feeds["loc"], feeds["conf"], feeds["prior"], feeds["arm_conf"], feeds["arm_loc"], C, **kw)
    check_everywhere(model, feeds, {"det": ref}, tmp_path, atol=1e-5, rtol=1e-5)
    with pytest.raises(LayerError, match=r"DetectionOutputRefine takes 4 or 5 bottoms"):
        load_from_text(refinedet_text(params, n, P, C, arm=0).replace('"DetectionOutput"', '"DetectionOutputRefine"'))
    with pytest.raises(LayerError, match=r"bottom 3 \[2, 3, 4, 5\] must be the arm confidences"):
        load_from_text(refinedet_text(params, n, P, C, arm=1, arm_conf=(n, 3, 4, 5))
                       .replace('"DetectionOutput"', '"DetectionOutputRefine"'))


def test_refinedet_bad_bottoms():
    n, P, C = 2, 31, 5
    text = refinedet_text("code_type: CENTER_SIZE", n, P, C, loc=(n, P * C * 4))
    with pytest.raises(LayerError, match="share_location: true"):
        load_from_text(text.replace("share_location: true", "share_location: false"))
    with pytest.raises(LayerError, match="arm loc"):
        load_from_text(refinedet_text("code_type: CENTER_SIZE", n, P, C, arm_loc=(n, P * 4 - 4)))
    with pytest.raises(LayerError, match="arm conf"):
        load_from_text(refinedet_text("code_type: CENTER_SIZE", n, P, C, arm_conf=(n, P * 3)))
    with pytest.raises(LayerError, match="takes 3 bottoms"):
        load_from_text(refinedet_text("code_type: CENTER_SIZE", n, P, C).replace(
            'bottom: "arm_loc"', 'bottom: "arm_loc" bottom: "arm_loc"'))


def test_refinedet_deploy_reads():
    """The fork's own VOC deploy file: 5-bottom DetectionOutput with objectness_score."""
    model = load(str(REALWORLD / DEPLOY))
    det = node_of(model, "detection_out")
    assert det.attrs["arm"] == 2
    assert det.attrs["objectness"] == pytest.approx(0.01)
    assert model.blob_shapes["detection_out"] == (1, 1, 500, 7)


# ---- tl_ssd's state scores (julimueller/tl_ssd detection_output_layer.cu) ----------------------

def test_tl_ssd_state_scores_follow_each_rows_prior(tmp_path):
    """do_state_prediction: a 4th bottom (N, P * S) and rows [image, label, score, S states of the
    row's prior, box].  With zero loc every decoded box is its prior's, so the prior of each row
    is found by its box and its states checked against the input."""
    n, P, C, S = 2, 31, 5, 3
    x = refinedet_inputs(11, n, P, C)
    x["loc"] = np.zeros_like(x["loc"])
    x["state"] = rng(12).random((n, P * S)).astype(f32)
    params = "nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE confidence_threshold: 0.05"
    plain = load_from_text(refinedet_text(params, n, P, C, arm=0)).run({k: x[k] for k in ("loc", "conf", "prior")})
    text = refinedet_text(params + " do_state_prediction: true num_states: 3", n, P, C, arm=1,
                          arm_conf=(n, P * S)).replace("arm_conf", "state")
    model = load_from_text(text)
    rows = model.run({k: x[k] for k in ("loc", "conf", "prior", "state")})["det"][0, 0]
    base = plain["det"][0, 0]
    assert model.blob_shapes["det"][3] == 7 + S and len(rows) == len(base) > 3
    np.testing.assert_array_equal(rows[:, :3], base[:, :3])
    np.testing.assert_array_equal(rows[:, 3 + S:], base[:, 3:])
    pbox = x["prior"][0, 0].reshape(P, 4)
    states = x["state"].reshape(n, P, S)
    for row in rows:
        p = int(np.flatnonzero(np.all(np.abs(pbox - row[3 + S:]) < 1e-6, axis=1))[0])
        np.testing.assert_array_equal(row[3:3 + S], states[int(row[0]), p])
    feeds = {k: x[k] for k in ("loc", "conf", "prior", "state")}
    check_everywhere(model, feeds, {"det": rows[None, None]}, tmp_path)
    # no detection: -1 rows 7 + S wide, the image ids at 7 * i as the fork writes them
    none = load_from_text(text.replace("confidence_threshold: 0.05", "confidence_threshold: 1.1"))
    want = np.full(n * (7 + S), -1.0, f32)
    want[np.arange(n) * 7] = np.arange(n)
    check_everywhere(none, feeds, {"det": want.reshape(1, 1, n, 7 + S)}, tmp_path)
    with pytest.raises(LayerError, match="do not hold 2 x 31 priors x num_states 3"):
        load_from_text(text.replace(f"dim: {P * S}", f"dim: {P * S + 1}"))


def test_caffe_refinedets_combined_bottoms_follow_the_fork(tmp_path):
    """chris-512/caffe-refinedet: 3 bottoms, loc = Concat(odm loc, arm loc), conf = Concat(odm conf,
    arm conf); its Forward reads the arm parts at the fixed offsets 25500 and 133875, which are 4P and
    21P of its 320x320 VOC net (6375 priors, 21 classes)."""
    n, P, C = 1, 6375, 21
    feeds = refinedet_inputs(8, n, P, C)
    params = ("nms_param { nms_threshold: 0.45 top_k: 20 } code_type: CENTER_SIZE keep_top_k: 30 "
              "confidence_threshold: 0.3 objectness_score: 0.3")
    combined = {"loc": np.concatenate([feeds["loc"], feeds["arm_loc"]], 1),
                "conf": np.concatenate([feeds["conf"], feeds["arm_conf"]], 1), "prior": feeds["prior"]}
    model = load_from_text(refinedet_text(params, n, P, C, arm=0, loc=(1, 8 * P), conf=(1, (C + 2) * P)))
    assert node_of(model, "det").attrs["combined"]
    ref = refinedet_ref(feeds["loc"], feeds["conf"], feeds["prior"], feeds["arm_conf"], feeds["arm_loc"], C,
                        nms=0.45, top_k=20, keep_top_k=30, conf_threshold=0.3, objectness=0.3)
    assert ref.shape[2] > 5
    check_everywhere(model, combined, {"det": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_combined_bottoms_of_another_size_are_not_taken_for_caffe_refinedets():
    # 8P loc and (C + 2)P conf, but not the fork's offsets: the usual reading and its error
    with pytest.raises(LayerError, match="TextBoxes"):
        load_from_text(refinedet_text("nms_param { nms_threshold: 0.45 }", 1, 31, 5, arm=0, loc=(1, 8 * 31),
                                      conf=(1, 7 * 31)))
    with pytest.raises(LayerError, match="one image"):
        load_from_text(refinedet_text("nms_param { nms_threshold: 0.45 }", 2, 6375, 21, arm=0, loc=(2, 8 * 6375),
                                      conf=(2, 23 * 6375)))
