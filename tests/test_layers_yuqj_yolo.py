"""yuqj1991/caffe_train's Yolov3Detection (src/caffe/layers/Yolov3DetectionLayer.cpp, its CPU Forward),
told from Cambricon's type of the same name by yolov3_detection_output_param (read as eric612's
Yolov3DetectionOutput, yolo.py).

The reference is a numpy loop written here from the fork's Forward_cpu and ApplyNms, on two bottoms of
different sizes, two boxes each, three classes and a batch of two."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
BIASES = [10, 14, 23, 27, 37, 58, 81, 82, 135, 169, 344, 319]
PARAM = ("yolov3_detection_output_param { num_classes: 3 num_box: 2 confidence_threshold: 0.3 nms_threshold: 0.45 "
         "mask_group_num: 2 " + " ".join(f"biases: {b}" for b in BIASES) + " "
         "mask: 3 mask: 4 mask: 5 mask: 0 mask: 1 mask: 2 anchors_scale: 8 anchors_scale: 16 }")


def sigmoid(v):
    return F(1) / (F(1) + F(math.exp(-float(v))))


def fork_ref(xs, biases, masks, scales, num_box, num_classes, thr, nms):
    per_group = len(masks) // len(xs)
    found = []
    for t, x in enumerate(xs):
        n, _, _, side = x.shape
        span = side * scales[t]
        for b in range(n):
            for s in range(side * side):
                for k in range(num_box):
                    v = x[b].reshape(num_box, 5 + num_classes, side * side)[k, :, s]
                    m = masks[k + t * per_group]
                    px = (s % side + sigmoid(v[0])) / F(side)
                    py = (s // side + sigmoid(v[1])) / F(side)
                    pw = F(math.exp(float(v[2]))) * F(biases[2 * m]) / F(span)
                    ph = F(math.exp(float(v[3]))) * F(biases[2 * m + 1]) / F(span)
                    obj = sigmoid(v[4])
                    for c in range(num_classes):
                        score = sigmoid(v[5 + c]) * obj
                        if score > thr:
                            found.append((score, c, px, py, pw, ph))
    found.sort(key=lambda r: -r[0])   # stable: ties in push order
    dropped = set()
    for i in range(len(found)):
        if i in dropped:
            continue
        for j in range(i + 1, len(found)):
            if j in dropped:
                continue
            a, o = found[i], found[j]
            w = min(a[2] + a[4] / 2, o[2] + o[4] / 2) - max(a[2] - a[4] / 2, o[2] - o[4] / 2)
            h = min(a[3] + a[5] / 2, o[3] + o[5] / 2) - max(a[3] - a[5] / 2, o[3] - o[5] / 2)
            inter = 0 if w < 0 or h < 0 else w * h
            if inter / (a[4] * a[5] + o[4] * o[5] - inter) >= nms:
                dropped.add(j)
    rows = [[0, r[1] + 1, r[0], r[2] - r[4] / 2, r[3] - r[5] / 2, r[2] + r[4] / 2, r[3] + r[5] / 2]
            for i, r in enumerate(found) if i not in dropped]
    if not rows:
        rows = [[i, -1, -1, -1, -1, -1, -1] for i in range(xs[-1].shape[0])]
    return np.array(rows, F).reshape(1, 1, -1, 7)


def yolo_net(param=PARAM, shapes=((2, 16, 4, 4), (2, 16, 2, 2))):
    bottoms = " ".join(f'bottom: "x{i}"' for i in range(len(shapes)))
    return net(f'layer {{ name: "det" type: "Yolov3Detection" {bottoms} top: "det" {param} }}',
               inputs={f"x{i}": s for i, s in enumerate(shapes)})


def test_decodes_pools_and_suppresses_as_the_fork(tmp_path):
    xs = [rng(1).standard_normal((2, 16, 4, 4)).astype(F), rng(2).standard_normal((2, 16, 2, 2)).astype(F)]
    model = load_from_text(yolo_net())
    ref = fork_ref(xs, BIASES, [3, 4, 5, 0, 1, 2], [8, 16], 2, 3, F(0.3), F(0.45))
    assert ref.shape[2] > 5 and ref.shape[2] < 2 * (16 + 4) * 2 * 3     # some kept, some dropped
    check_everywhere(model, {"x0": xs[0], "x1": xs[1]}, {"det": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_nms_threshold_defaults_to_the_forks_04():
    model = load_from_text(yolo_net(PARAM.replace("nms_threshold: 0.45 ", "")))
    assert model.graph.node("det").attrs["nms_threshold"] == pytest.approx(0.4)


def test_no_candidate_gives_one_row_per_image():
    xs = [np.full((2, 16, 4, 4), -8, F), np.full((2, 16, 2, 2), -8, F)]
    got = load_from_text(yolo_net()).run({"x0": xs[0], "x1": xs[1]})["det"]
    np.testing.assert_array_equal(got, [[[[0, -1, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1, -1]]]])


@pytest.mark.parametrize("param, shapes, msg", [
    (PARAM.replace("mask_group_num: 2", "mask_group_num: 3"), None, r"mask_group_num 3 must equal the number of bottoms, 2"),
    (PARAM, ((2, 16, 4, 4), (2, 16, 2, 3)), r"needs square maps \(it takes the side from the width\), got 2x3"),
    (PARAM.replace("num_box: 2", "num_box: 4"), None, r"mask has 6 entries; 2 bottoms x num_box 4 read up to entry 6"),
    (PARAM.replace("num_classes: 3 ", ""), None, r"num_classes is required"),
    (PARAM.replace("mask: 5", "mask: 9"), None, None),   # the third anchor of a group is not read at num_box 2
    (PARAM.replace("mask: 4", "mask: 9"), None, r"biases has 12 values; the anchors used need 20"),
])
def test_refuses_what_the_fork_cannot_run(param, shapes, msg):
    text = yolo_net(param, shapes) if shapes else yolo_net(param)
    if msg is None:
        load_from_text(text)
        return
    with pytest.raises(LayerError, match=msg):
        load_from_text(text)
