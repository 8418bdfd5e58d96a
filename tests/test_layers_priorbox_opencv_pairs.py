"""OpenCV's PriorBox with offset_w / offset_h read as (offset_w, offset_h) pairs
(opencv/opencv modules/dnn/src/layers/prior_box_layer.cpp), the form of OpenCV's TextBoxes sample.

The reference follows OpenCV's loops: boxes from the first min_size / max_size and the deduplicated
aspect ratios in float32; cell (h, w), box, pair; centres, half sizes and corners in float32; clip
(true unless set) over everything; then the variances.  Checked in torch, onnxruntime and the
generated model.py at zero tolerance.  The reading is chosen when only it fits the loc predictions."""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, inputs_text, net

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

F32 = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


def ref_boxes(min_size, max_size, ratios, flip):
    """OpenCV's box widths and heights (float32)."""
    mn = F32(min_size)
    ws, hs = [mn], [mn]
    if max_size:
        ws.append(np.sqrt(F32(mn * F32(max_size))))
        hs.append(ws[-1])
    kept = []
    for ar in map(F32, ratios):
        if abs(ar - F32(1)) < F32(1e-6) or any(float(abs(ar - k)) < 1e-6 for k in kept):
            continue
        kept.append(ar)
        if flip:
            kept.append(F32(1.0 / float(ar)))
    for ar in kept:
        s = np.sqrt(ar)
        ws.append(F32(mn * s))
        hs.append(F32(mn / s))
    return ws, hs


def reference(lh, lw, ih, iw, min_size, pairs, variance, max_size=0, ratios=(), flip=True, step=None, clip=True):
    ws, hs = ref_boxes(min_size, max_size, ratios, flip)
    if step:
        sy, sx = F32(step[0]), F32(step[1])
    else:
        sy, sx = F32(ih) / F32(lh), F32(iw) / F32(lw)
    img_w, img_h = F32(iw), F32(ih)
    half = F32(0.5)
    coords = []
    for h in range(lh):
        for w in range(lw):
            for bw, bh in zip(ws, hs):
                for ox, oy in pairs:
                    cx = (F32(w) + F32(ox)) * sx
                    cy = (F32(h) + F32(oy)) * sy
                    coords += [(cx - bw * half) / img_w, (cy - bh * half) / img_h,
                               (cx + bw * half) / img_w, (cy + bh * half) / img_h]
    coords = np.array(coords, F32)
    if clip:
        coords = np.clip(coords, F32(0), F32(1))
    var = np.array(variance, F32)
    return np.stack([coords, np.tile(var, coords.size // var.size)]).reshape(1, 2, -1)


def box_text(params, name="pb", feat="feat"):
    return (f'layer {{ name: "{name}" type: "PriorBox" bottom: "{feat}" bottom: "img" top: "{name}" '
            f'prior_box_param {{ {params} }} }}')


def pairs_net(params, feat=(1, 8, 3, 5), img=(1, 3, 37, 71)):
    return inputs_text(feat=feat, img=img) + box_text(params + " opencv_offset_pairs: true")


@pytest.mark.parametrize("params, kw", [
    # OpenCV's TextBoxes sample form: max_size, ratios without flip, 4 variances, two pairs, clip unset (true)
    ("min_size: 30 max_size: 61.5 aspect_ratio: 2 aspect_ratio: 3 aspect_ratio: 7 flip: false variance: 0.1 "
     "variance: 0.1 variance: 0.2 variance: 0.2 offset_h: 0.5 offset_w: 0.5 offset_h: 1.0 offset_w: 0.5",
     {"min_size": 30, "max_size": 61.5, "ratios": [2, 3, 7], "flip": False, "pairs": [(0.5, 0.5), (0.5, 1.0)],
      "variance": [0.1, 0.1, 0.2, 0.2]}),
    # flip, ratio 1 and a repeat dropped, step_h / step_w, clip false, 1 variance, asymmetric pairs
    ("min_size: 7.3 aspect_ratio: 1 aspect_ratio: 2 aspect_ratio: 0.3 aspect_ratio: 2 flip: true clip: false "
     "variance: 0.15 step_h: 9.5 step_w: 13 offset_w: 0.25 offset_h: 0.0 offset_w: 1.0 offset_h: 0.75",
     {"min_size": 7.3, "ratios": [1, 2, 0.3, 2], "pairs": [(0.25, 0.0), (1.0, 0.75)], "variance": [0.15],
      "step": (9.5, 13.0), "clip": False}),
    # one pair (OpenCV declares and writes one prior per box)
    ("min_size: 11 max_size: 20 aspect_ratio: 3 variance: 0.1 step: 6 offset_w: 0.2 offset_h: 0.9",
     {"min_size": 11, "max_size": 20, "ratios": [3], "pairs": [(0.2, 0.9)], "variance": [0.1], "step": (6, 6)}),
])
def test_opencv_pairs_follow_opencvs_loops(params, kw, tmp_path):
    model = load_from_text(pairs_net(params))
    want = reference(3, 5, 37, 71, **kw)
    assert model.blob_shapes["pb"] == want.shape
    feeds = {"feat": np.zeros((1, 8, 3, 5), F32), "img": np.zeros((1, 3, 37, 71), F32)}
    check_everywhere(model, feeds, {"pb": want}, tmp_path)


@pytest.mark.parametrize("params, msg", [
    ("min_size: 7 offset_w: 0.5 offset_w: 0.5 offset_w: 0.5 offset_h: 0.5 offset_h: 0.5 offset_h: 1",
     "declares 4 priors per box for 3 offset_w/offset_h pairs but writes 3"),
    ("min_size: 7 offset_w: 0.5 offset_w: 0.5 offset_h: 0.5", "2 offset_w and 1 offset_h"),
    ("min_size: 7 offset: 0.5 offset_w: 0.5 offset_h: 0.5", "offset or offset_w/offset_h, not both"),
    ("min_size: 7 max_size: 7 offset_w: 0.5 offset_h: 0.5", "must be greater than min_size"),
    ("offset_w: 0.5 offset_h: 0.5", "min_size is required"),
])
def test_opencv_pairs_refusals(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(pairs_net(params))


# ---- the reading chosen by the loc predictions ----------------------------------------------------

PAIR_PARAMS = ("min_size: 20 max_size: 41 aspect_ratio: 2 aspect_ratio: 3 aspect_ratio: 5 flip: false "
               "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 "
               "offset_h: 0.5 offset_w: 0.5 offset_h: 1.0 offset_w: 0.5")


def detection_net(per_cell, feat=(4, 6), img=(40, 66), classes=2):
    """Image, a feature map, loc / conf convolutions sized for `per_cell` priors, a PriorBox with
    two offset pairs and DetectionOutput."""
    layers = [
        ('layer {{ name: "loc" type: "Convolution" bottom: "feat" top: "loc" convolution_param {{ '
         'num_output: {n} kernel_size: 3 pad: 1 }} }}').format(n=per_cell * 4),
        ('layer {{ name: "conf" type: "Convolution" bottom: "feat" top: "conf" convolution_param {{ '
         'num_output: {n} kernel_size: 3 pad: 1 }} }}').format(n=per_cell * classes),
        'layer { name: "loc_flat" type: "Flatten" bottom: "loc" top: "loc_flat" }',
        'layer { name: "conf_flat" type: "Flatten" bottom: "conf" top: "conf_flat" }',
        box_text(PAIR_PARAMS),
        ('layer { name: "det" type: "DetectionOutput" bottom: "loc_flat" bottom: "conf_flat" bottom: "pb" '
         f'top: "det" detection_output_param {{ num_classes: {classes} share_location: true '
         'nms_param { nms_threshold: 0.45 top_k: 20 } code_type: CENTER_SIZE keep_top_k: 10 '
         'confidence_threshold: 0.01 } }'),
    ]
    return net(*layers, inputs={"img": (1, 3, *img), "feat": (1, 5, *feat)})


def test_loc_predictions_choose_the_opencv_pairs():
    # OpenCV: (min, sqrt(min * max), 3 ratios) x 2 pairs = 10 per cell; tl_ssd's grid: 3 ratios x 2 x 2 = 12
    model = load_from_text(detection_net(10), random_weights=True, outputs=["pb", "det"])
    assert any("PriorBox read as OpenCV's (offset_w/offset_h as pairs" in w and w.endswith(": pb")
               for w in model.warnings)
    want = reference(4, 6, 40, 66, 20, [(0.5, 0.5), (0.5, 1.0)], [0.1, 0.1, 0.2, 0.2], max_size=41,
                     ratios=[2, 3, 5], flip=False)
    r = np.random.default_rng(3)
    got = model.run({"img": np.zeros((1, 3, 40, 66), F32), "feat": r.standard_normal((1, 5, 4, 6)).astype(F32)})
    np.testing.assert_array_equal(got["pb"], want)
    assert got["det"].shape[-1] == 7


def test_grid_fitting_predictions_keep_tl_ssds_grid():
    model = load_from_text(detection_net(12), random_weights=True)
    assert not any("OpenCV's" in w for w in model.warnings)
    assert model.blob_shapes["pb"] == (1, 2, 4 * 6 * 12 * 4)
    with pytest.raises(CaffeqError, match=r"loc \[1, \d+\] does not hold"):
        load_from_text(detection_net(7), random_weights=True)


def test_opencv_textboxes_sample_reads():
    model = load(str(REALWORLD / "Gaukhar1998__python-tasks__textbox.prototxt"))
    assert model.blob_shapes["mbox_priorbox"] == (1, 2, 516080)
    assert model.blob_shapes["detection_out"] == (1, 1, 200, 7)
    assert any("PriorBox read as OpenCV's" in w for w in model.warnings)
