"""DeepTextSpotter's three-top Region and OnDiskData (caffeq/layers/deep_text_spotter.py) against a loop written
here from MichalBusta/caffe's region_layer.cpp (branch darknet, c3dce16: Forward_cpu, ouputPlaneRegionBoxes,
get_region_box, box_iou) in float32 scalars as its Dtype, in torch, onnxruntime and model.py."""
import math

import numpy as np
import pytest
from conftest import model_py_outputs, net, onnx_outputs, rng

from caffeq.layers import LayerError
from caffeq.layers.deep_text_spotter import dts_anchor_table
from caffeq.model import load_from_text

F = np.float32

# region_layer.cpp LayerSetUp's 14 anchors (w, h in grid cells)
ANCHORS = [0.317539695732, 0.493652380857, 0.66545245494, 0.357112901109, 1.01046388351, 0.512909981333,
           1.3496335045, 0.322306706382, 1.58891134384, 0.581019084508, 1.20785566117, 1.02485042068,
           2.28320153664, 0.813839044484, 2.5279678299, 0.442826767368, 3.01451020961, 1.34187668082,
           3.79487918772, 0.78852430371, 4.7935325462, 3.01837445215, 6.1298771774, 1.41297354615,
           10.4140073713, 2.29083421664, 12.1392691662, 5.06897667207]


def ref_anchor_table(expand_bias):
    """LayerSetUp's loop: `for (i = 0; i < biases.size() / 2; i += 2)` visits pairs 0..6; with expand_bias a pair
    with a side under 0.5 gives 5 anchors at the listed sub-cell offsets, another one at (0, 0); without it, 14
    anchors and zero offsets (the fork pushes only 7 and reads past them: 0 intended)."""
    if not expand_bias:
        return ANCHORS, [0.0] * 28
    anchors, offsets = [], []
    for i in range(0, 14, 2):
        w, h = ANCHORS[i], ANCHORS[i + 1]
        subs = [(0.75, 0.25), (0.25, 0.25), (0.5, 0.5), (0.75, 0.75), (0.75, 0.25)] if F(w) < 0.5 or F(h) < 0.5 \
            else [(0.0, 0.0)]
        for ox, oy in subs:
            anchors += [w, h]
            offsets += [ox, oy]
    return anchors, offsets


def logistic(v):
    return F(1.0 / (1.0 + math.exp(-float(v))))


def ref_softmax(values):
    largest = F(-3.4028234663852886e38)
    for v in values:
        largest = max(largest, v)
    e = [F(math.exp(float(v - largest))) for v in values]
    total = F(0)
    for v in e:
        total = F(total + v)
    return [F(v / total) for v in e]


def ref_iou(a, b):
    def overlap(x1, w1, x2, w2):
        left = max(F(x1 - w1 / F(2)), F(x2 - w2 / F(2)))
        right = min(F(x1 + w1 / F(2)), F(x2 + w2 / F(2)))
        return F(right - left)
    w, h = overlap(a["x"], a["w"], b["x"], b["w"]), overlap(a["y"], a["h"], b["y"], b["h"])
    inter = F(0) if w < 0 or h < 0 else F(w * h)
    union = F(F(F(a["w"] * a["h"]) + F(b["w"] * b["h"])) - inter)
    return F(inter / union)


def ref_region(x, classes, coords, boxes, softmax, nms, expand_bias=False):
    n, h, w, c = x.shape
    size = coords + 1 + classes
    anchors, offsets = ref_anchor_table(expand_bias)
    trans = x.copy().reshape(n, h * w * boxes, size)
    for b in range(n):
        for i in range(h * w * boxes):
            trans[b, i, coords] = logistic(trans[b, i, coords])
            if softmax:
                trans[b, i, coords + 1:] = ref_softmax(trans[b, i, coords + 1:])
    rows = np.zeros((n, 1, 500, 15), F)
    norm = F(math.sqrt(float(F(w * w + h * h))))
    for b in range(n):
        found = []
        for i in range(w * h):
            row, col = i // w, i % w
            for k in range(boxes):
                e = trans[b, i * boxes + k]
                box = {"x": F(F(F(col) + logistic(e[0])) + F(offsets[2 * k])) / F(w),
                       "y": F(F(F(row) + logistic(e[1])) + F(offsets[2 * k + 1])) / F(h),
                       "w": F(F(F(math.exp(float(e[2]))) * F(anchors[2 * k])) / norm),
                       "h": F(F(F(math.exp(float(e[3]))) * F(anchors[2 * k + 1])) / norm),
                       "angle": e[4] if coords > 4 else F(0), "index": (i * boxes + k) * size, "nms": 0}
                scale = e[coords]
                box["iou"] = F(scale * scale)
                if box["iou"] < F(0.01):
                    continue
                best, box["cls"], box["probs"] = F(0), 0, [F(0)] * 6
                for j in range(classes):
                    p = F(scale * e[coords + 1 + j])
                    box["probs"][j] = p
                    if p > best:
                        box["cls"], best = j, p
                found.append(box)
        found.sort(key=lambda q: -q["iou"])
        for i, a in enumerate(found):
            for q in found[i + 1:]:
                same = ref_iou(a, q) >= F(nms) and a["cls"] == q["cls"]
                if q["iou"] > a["iou"]:
                    a["nms"] = 1 if same else a["nms"]
                elif same:
                    q["nms"] = 1
        found.sort(key=lambda q: (q["nms"], -q["iou"]))
        for r, q in enumerate(found[:500]):
            rows[b, 0, r] = [q["x"], q["y"], q["w"], q["h"], q["angle"], q["iou"], q["cls"], q["index"], q["nms"],
                             *q["probs"]]
    return trans.reshape(n, h, w, c), rows


def region_net(params, shape, bottoms=("x",)):
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    inputs = {"x": shape, **({"gt": (1, 1, 32, 32)} if "gt" in bottoms else {})}
    return load_from_text(net(f'layer {{ name: "r" type: "Region" {bottom} top: "loss" top: "boxes" top: "trans" '
                              f'region_param {{ {params} }} }}', inputs=inputs), outputs=["loss", "boxes", "trans"])


def feeds(shape, coords, size, seed, grow=0.0, spread=1.5, obj_shift=1.0):
    x = (rng(seed).standard_normal(shape) * spread).astype(F)
    view = x.reshape(shape[:3] + (-1, size))
    view[..., 2:4] = view[..., 2:4] * F(0.4) + F(grow)     # sizes near the anchors' (or grown): boxes overlap
    view[..., coords] += F(obj_shift)
    return x


@pytest.mark.parametrize("params, classes, coords, boxes, softmax, nms, shape, expand, grow", [
    # tiny.prototxt's settings on a 3 x 4 grid, two images (a second bottom, gt_boxes, unread at test)
    ("classes: 6 coords: 5 boxes_of_each_grid: 14 softmax: true nms_threshold: 0.5", 6, 5, 14, True, 0.5,
     (2, 3, 4, 168), False, 0.0),
    # the two smallest anchors, grown to overlap their neighbours
    ("classes: 3 coords: 4 boxes_of_each_grid: 2 nms_threshold: 0.3", 3, 4, 2, False, 0.3, (1, 5, 3, 16), False, 2.0),
    ("classes: 1 coords: 4 softmax: true expand_bias: true", 1, 4, 19, True, 0.4, (1, 2, 3, 114), True, 0.0),
    # more than 500 candidates: the first 500 rows of the kept-then-flagged order
    ("classes: 2 coords: 5 boxes_of_each_grid: 9 softmax: true nms_threshold: 0.7", 2, 5, 9, True, 0.7,
     (1, 8, 9, 72), False, 0.0),
])
def test_region_matches_the_forks_loops_everywhere(params, classes, coords, boxes, softmax, nms, shape, expand, grow,
                                                   tmp_path):
    bottoms = ("x", "gt") if classes == 6 else ("x",)
    model = region_net(params, shape, bottoms)
    assert model.blob_shapes["boxes"] == (shape[0], 1, 500, 15) and model.blob_shapes["trans"] == shape
    assert any("reads past them for anchors 7 to" in w for w in model.warnings) == (boxes > 7 and not expand)
    x = feeds(shape, coords, coords + 1 + classes, shape[1] + classes, grow)
    trans, rows = ref_region(x, classes, coords, boxes, softmax, nms, expand)
    if shape[1] * shape[2] * boxes > 500:
        assert (rows[..., 5] > 0).sum() == 500                  # more candidates than rows
    else:
        assert rows[..., 8].any()                               # the NMS flags some boxes
    f = {"x": x, **({"gt": np.zeros((1, 1, 32, 32), F)} if "gt" in bottoms else {})}
    for backend, got in (("torch", model.run(f)), ("onnx", onnx_outputs(model, f, tmp_path)),
                         ("model.py", model_py_outputs(model, f, tmp_path))):
        np.testing.assert_array_equal(got["loss"], np.zeros((1, 1, 1, 1), F), err_msg=backend)
        # exp and the softmax's sum may differ in the last bit (the fork's float exp, torch's, onnxruntime's):
        # every value within 2e-6 of its own size; the box index, class and flag columns exact
        np.testing.assert_allclose(got["trans"], trans, rtol=2e-6, atol=2e-6, err_msg=backend)
        np.testing.assert_array_equal(got["boxes"][..., 6:9], rows[..., 6:9], err_msg=backend)
        np.testing.assert_allclose(got["boxes"], rows, rtol=2e-6, atol=2e-6, err_msg=backend)


def test_expand_bias_builds_the_forks_19_anchors():
    assert dts_anchor_table(True) == ref_anchor_table(True)
    anchors, offsets = dts_anchor_table(True)
    # pairs 0, 1, 3 (a side under 0.5) give five anchors each, pairs 2, 4, 5, 6 one: 19
    assert len(anchors) == 38 and anchors[:10] == ANCHORS[:2] * 5 and anchors[32:] == ANCHORS[8:14]
    assert dts_anchor_table(False) == (ANCHORS, [0.0] * 28)


@pytest.mark.parametrize("params, shape, message", [
    ("classes: 7 coords: 4 boxes_of_each_grid: 1", (1, 2, 2, 12), "classes must be 1 to 6"),
    ("classes: 2 coords: 4 boxes_of_each_grid: 15", (1, 2, 2, 105), "boxes_of_each_grid must be 1 to 14"),
    ("classes: 2 coords: 3 boxes_of_each_grid: 1", (1, 2, 2, 6), "coords must be >= 4"),
    ("classes: 2 coords: 4 boxes_of_each_grid: 2", (1, 14, 2, 2), "channel-last"),
])
def test_region_refuses_what_the_fork_cannot_hold(params, shape, message):
    with pytest.raises(LayerError, match=message):
        region_net(params, shape)


def test_tiny_like_net_reads_from_on_disk_data(tmp_path):
    # tiny.prototxt's frame: OnDiskData (its tops shaped by input_param, as Input), a convolution, the
    # Transpose to channel-last, Region with gt_boxes as a second bottom
    text = ('layer { name: "data" type: "OnDiskData" top: "data" top: "gt_boxes" top: "gt_labels" '
            'input_param { shape: { dim: 1 dim: 1 dim: 32 dim: 48 } } data_param { source: "train.txt" } }\n'
            'layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 24 '
            'kernel_size: 3 stride: 16 pad: 1 } }\n'
            'layer { name: "t" type: "Transpose" bottom: "c" top: "t" transpose_param { dim: 0 dim: 2 dim: 3 '
            'dim: 1 } }\n'
            'layer { name: "r" type: "Region" bottom: "t" bottom: "gt_boxes" top: "loss" top: "boxes" top: "trans" '
            'region_param { classes: 6 coords: 5 boxes_of_each_grid: 2 softmax: true nms_threshold: 0.5 } }')
    model = load_from_text(text, random_weights=True, outputs=["boxes"])
    assert model.inputs == {"data": (1, 1, 32, 48), "gt_boxes": (1, 1, 32, 48)}
    assert model.blob_shapes["gt_labels"] == (1, 1, 32, 48)
    assert model.blob_shapes["trans"] == (1, 2, 3, 24)
    x = rng(1).standard_normal((1, 1, 32, 48)).astype(F)
    assert model.run({"data": x, "gt_boxes": np.zeros((1, 1, 32, 48), F)})["boxes"].shape == (1, 1, 500, 15)
