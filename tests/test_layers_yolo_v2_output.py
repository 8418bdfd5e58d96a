"""gklz1982/caffe-yolov2's one-bottom DetectionOutput (YOLO v2 decoding, NMS in cell order).

The reference follows the fork's Forward_cpu and util/bbox_util.hpp as loops: the channel-last
swap, get_region_box, class_index_and_score (softmax, first maximum), ApplyNms over the unsorted
candidates with setNormalizedBBox's clipping and JaccardOverlap(normalized=true)."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

BIASES = [0.73, 0.87, 2.42, 2.65]


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def _clipped(b):
    x, y, w, h = b
    return max(x - w / 2, 0.0), max(y - h / 2, 0.0), min(x + w / 2, 1.0), min(y + h / 2, 1.0)


def _size(c):
    return 0.0 if c[2] < c[0] or c[3] < c[1] else (c[2] - c[0]) * (c[3] - c[1])


def _jaccard(a, b):
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        inter = (0.0, 0.0, 0.0, 0.0)
    else:
        inter = (max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    iw, ih = inter[2] - inter[0], inter[3] - inter[1]
    if iw > 0 and ih > 0:
        return iw * ih / (_size(a) + _size(b) - iw * ih)
    return 0.0


def reference(x, num_box, classes, side, threshold, nms):
    _, c, _, _ = x.shape
    size = c // num_box
    swap = x[0].transpose(1, 2, 0).reshape(side * side, num_box, size).astype(np.float64)
    preds = []
    for j in range(side):
        for i in range(side):
            for n in range(num_box):
                e = swap[j * side + i, n]
                box = ((i + _sigmoid(e[0])) / side, (j + _sigmoid(e[1])) / side,
                       math.exp(e[2]) * BIASES[2 * n] / side, math.exp(e[3]) * BIASES[2 * n + 1] / side)
                probs = np.exp(e[5:5 + classes] - e[5:5 + classes].max())
                probs /= probs.sum()
                best = int(np.argmax(probs))
                conf = _sigmoid(e[4]) * probs[best]
                if conf >= threshold:
                    preds.append((box, best, conf))
    if not preds:
        return np.array([[[[0, -1, -1, -1, -1, -1, -1]]]], np.float32)
    dropped = set()
    for i in range(len(preds) - 1):
        if i in dropped:
            continue
        for k in range(i + 1, len(preds)):
            if k not in dropped and _jaccard(_clipped(preds[i][0]), _clipped(preds[k][0])) >= nms:
                dropped.add(k)
    rows = [[0, cls, conf, *box] for k, (box, cls, conf) in enumerate(preds) if k not in dropped]
    return np.array(rows, np.float32).reshape(1, 1, -1, 7)


def layer(threshold=0.2, nms=0.3, side=3, extra=""):
    biases = " ".join(f"biases: {b}" for b in BIASES)
    return (f'layer {{ name: "det" type: "DetectionOutput" bottom: "x" top: "det" detection_output_param {{ '
            f'num_classes: 3 side: {side} num_box: 2 coords: 4 confidence_threshold: {threshold} '
            f'nms_threshold: {nms} {biases} {extra}}} }}')


@pytest.mark.parametrize("threshold, nms, seed", [(0.2, 0.3, 1), (0.05, 0.45, 2), (0.3, 0.6, 3)])
def test_cell_order_detections_match_the_forks_loops(threshold, nms, seed, tmp_path):
    x = (rng(seed).standard_normal((1, 2 * 9, 3, 3)) * 1.5).astype(np.float32)   # 9 = 5 + 3 classes + 1 spare
    model = load_from_text(net(layer(threshold, nms), inputs={"x": x.shape}))
    want = reference(x, 2, 3, 3, threshold, nms)
    assert want.shape[2] > 1      # detections, some suppressed
    check_everywhere(model, {"x": x}, {"det": want}, tmp_path, atol=1e-6, rtol=1e-5)
    assert model.blob_shapes["det"] == (1, 1, 3 * 3 * 2, 7)     # the most rows: every candidate


def test_no_detection_gives_one_minus_one_row(tmp_path):
    x = np.full((1, 18, 3, 3), -8.0, np.float32)
    model = load_from_text(net(layer(0.5), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"det": np.array([[[[0, -1, -1, -1, -1, -1, -1]]]], np.float32)}, tmp_path)


def test_refusals(tmp_path):
    with pytest.raises(LayerError, match="biases has 4 values; 3 boxes need 6"):
        load_from_text(net(layer().replace("num_box: 2", "num_box: 3"), inputs={"x": (1, 27, 3, 3)}))
    with pytest.raises(LayerError, match="channels 14 must be num_box 2 x at least 5 \\+ num_classes 3"):
        load_from_text(net(layer(), inputs={"x": (1, 14, 3, 3)}))
    # Caffe reads a map that is not side x side; its forward indexes cells by side: refused on running
    other = load_from_text(net(layer(side=4), inputs={"x": (1, 18, 3, 3)}))
    with pytest.raises(CaffeqError, match="indexes cells by side 4, but the map is 3x3"):
        other.run({"x": np.zeros((1, 18, 3, 3), np.float32)})
    with pytest.raises(ExportError, match="indexes cells by side 4"):
        other.export_onnx(str(tmp_path / "m.onnx"))
