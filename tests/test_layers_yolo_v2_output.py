"""gklz1982/caffe-yolov2's one-bottom DetectionOutput (YOLO v2 decoding, NMS in cell order), and
BirdeeChen/caffe_yolo_v2's (6a1e658) form of it: `classes`, and an NMS by objectness duels.

The reference follows the forks' Forward_cpu and util/bbox_util.hpp as loops: the channel-last
swap, get_region_box, class_index_and_score (softmax, first maximum), ApplyNms over the unsorted
candidates with setNormalizedBBox's clipping and JaccardOverlap(normalized=true)."""
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
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


def reference(x, num_box, classes, side, threshold, nms, duel=False, biases=BIASES):
    _, c, _, _ = x.shape
    size = c // num_box
    swap = x[0].transpose(1, 2, 0).reshape(side * side, num_box, size).astype(np.float64)
    preds = []
    for j in range(side):
        for i in range(side):
            for n in range(num_box):
                e = swap[j * side + i, n]
                box = ((i + _sigmoid(e[0])) / side, (j + _sigmoid(e[1])) / side,
                       math.exp(e[2]) * biases[2 * n] / side, math.exp(e[3]) * biases[2 * n + 1] / side)
                probs = np.exp(e[5:5 + classes] - e[5:5 + classes].max())
                probs /= probs.sum()
                best = int(np.argmax(probs))
                conf = _sigmoid(e[4]) * probs[best]
                if conf >= threshold:
                    preds.append((box, best, conf, np.float32(_sigmoid(e[4]))))   # objScore: a float
    if duel:
        return birdee_rows(preds, nms)
    if not preds:
        return np.array([[[[0, -1, -1, -1, -1, -1, -1]]]], np.float32)
    dropped = set()
    for i in range(len(preds) - 1):
        if i in dropped:
            continue
        for k in range(i + 1, len(preds)):
            if k not in dropped and _jaccard(_clipped(preds[i][0]), _clipped(preds[k][0])) >= nms:
                dropped.add(k)
    rows = [[0, cls, conf, *box] for k, (box, cls, conf, _) in enumerate(preds) if k not in dropped]
    return np.array(rows, np.float32).reshape(1, 1, -1, 7)


def birdee_rows(preds, nms):
    """BirdeeChen's ApplyNms: the loser of each overlapping pair (lower objScore; i on a tie) gets
    objScore -1; kept: objScore > 0.  Then its rows, or the one -1 row."""
    obj = [p[3] for p in preds]
    for i in range(len(preds)):
        if obj[i] < 0:
            continue
        for j in range(i + 1, len(preds)):
            if obj[j] < 0:
                continue
            if _jaccard(_clipped(preds[i][0]), _clipped(preds[j][0])) >= nms:
                if obj[i] > obj[j]:
                    obj[j] = -1.0
                else:
                    obj[i] = -1.0
    rows = [[0, cls, conf, *box] for k, (box, cls, conf, _) in enumerate(preds) if obj[k] > 0]
    if not rows:
        return np.array([[[[0, -1, -1, -1, -1, -1, -1]]]], np.float32)
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
    # a cut-down MobileNet-SSD file (antsalan/trial): SSD's DetectionOutput left with one bottom
    ssd = ('layer { name: "det" type: "DetectionOutput" bottom: "x" top: "det" detection_output_param { '
           'num_classes: 3 share_location: true nms_param { nms_threshold: 0.45 } keep_top_k: 20 } }')
    with pytest.raises(LayerError, match="SSD's DetectionOutput \\(it sets nms_param, share_location, keep_top_k\\) "
                                         "takes 3 bottoms \\(loc, conf, priors\\), got 1"):
        load_from_text(net(ssd, inputs={"x": (1, 18, 3, 3)}))
    with pytest.raises(LayerError, match="channels 14 must be num_box 2 x at least 5 \\+ num_classes 3"):
        load_from_text(net(layer(), inputs={"x": (1, 14, 3, 3)}))
    # Caffe reads a map that is not side x side; its forward indexes cells by side: refused on running
    other = load_from_text(net(layer(side=4), inputs={"x": (1, 18, 3, 3)}))
    with pytest.raises(CaffeqError, match="indexes cells by side 4, but the map is 3x3"):
        other.run({"x": np.zeros((1, 18, 3, 3), np.float32)})
    with pytest.raises(ExportError, match="indexes cells by side 4"):
        other.export_onnx(str(tmp_path / "m.onnx"))


# ---- BirdeeChen/caffe_yolo_v2 -------------------------------------------------------------------

def birdee_layer(threshold=0.2, nms=0.3, side=4):
    return layer(threshold, nms, side).replace("num_classes: 3", "classes: 3")


@pytest.mark.parametrize("threshold, nms, seed", [(0.1, 0.3, 1), (0.05, 0.2, 4), (0.2, 0.45, 6)])
def test_objectness_duels_match_birdeechens_loops(threshold, nms, seed, tmp_path):
    # (1, 18, 4, 4): 2 boxes x (5 + 3 classes + 1 spare); the fork takes one side x side map
    x = (rng(seed).standard_normal((1, 18, 4, 4)) * 1.5).astype(np.float32)
    model = load_from_text(net(birdee_layer(threshold, nms), inputs={"x": x.shape}))
    want = reference(x, 2, 3, 4, threshold, nms, duel=True)
    assert want.shape[2] > 1
    # the duels keep other boxes than gklz1982's walk would
    assert not np.array_equal(want, reference(x, 2, 3, 4, threshold, nms))
    check_everywhere(model, {"x": x}, {"det": want}, tmp_path, atol=1e-6, rtol=1e-5)
    assert model.blob_shapes["det"] == (1, 1, 4 * 4 * 2, 7)


def test_a_dropped_box_drops_no_more(tmp_path):
    # box 0 (0.5 x 0.29) of cell (row 0, col 1): A, objectness 0.6; of cell (1, 0): B, 0.7; of cell
    # (1, 2): C, 0.5.  A meets B and C, B and C are apart.  A comes first and loses to B, so C stays
    # (had A gone on with its 0.6 it would drop C; gklz1982's walk keeps A alone).
    x = np.full((1, 18, 3, 3), -9.0, np.float32)
    x[0, 2:4] = 0.0                                   # w, h = exp(0) * bias / side
    x[0, 5] = 3.0                                     # class 0
    for (row, col), ty, obj in [((0, 1), 3.0, 0.6), ((1, 0), -3.0, 0.7), ((1, 2), -3.0, 0.5)]:
        x[0, 0, row, col] = 0.0
        x[0, 1, row, col] = ty
        x[0, 4, row, col] = math.log(obj / (1 - obj))
    biases = [1.5, 0.87, 2.42, 2.65]
    text = birdee_layer(0.3, 0.1, side=3).replace("biases: 0.73 biases: 0.87", "biases: 1.5 biases: 0.87")
    model = load_from_text(net(text, inputs={"x": x.shape}))
    want = reference(x, 2, 3, 3, 0.3, 0.1, duel=True, biases=biases)
    assert want.shape[2] == 2 and list(want[0, 0, :, 2].round(2)) == [0.7, 0.5]
    assert reference(x, 2, 3, 3, 0.3, 0.1, biases=biases).shape[2] == 1
    check_everywhere(model, {"x": x}, {"det": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_objectness_that_rounds_to_zero_is_not_kept(tmp_path):
    # confidence_threshold 0 takes every candidate; an objectness of sigmoid(-200) is 0 in float,
    # and the fork keeps only objScore > 0: no row is left
    x = np.zeros((1, 18, 3, 3), np.float32)
    x[0, 4] = x[0, 13] = -200.0
    model = load_from_text(net(birdee_layer(0.0, 0.45, side=3), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"det": np.array([[[[0, -1, -1, -1, -1, -1, -1]]]], np.float32)}, tmp_path)


def test_no_candidate_in_birdeechens_form(tmp_path):
    x = np.full((1, 18, 3, 3), -8.0, np.float32)
    model = load_from_text(net(birdee_layer(0.5, side=3), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"det": np.array([[[[0, -1, -1, -1, -1, -1, -1]]]], np.float32)}, tmp_path)


def test_classes_and_num_classes_are_one_fork_or_the_other():
    both = birdee_layer().replace("classes: 3", "classes: 3 num_classes: 3")
    with pytest.raises(LayerError, match="both num_classes .* and classes"):
        load_from_text(net(both, inputs={"x": (1, 18, 4, 4)}))
    with pytest.raises(LayerError, match="num_classes \\(BirdeeChen/caffe_yolo_v2: classes\\) is required"):
        load_from_text(net(birdee_layer().replace("classes: 3 ", ""), inputs={"x": (1, 18, 4, 4)}))


def test_birdeechen_files_read():
    deploy = load(str(REALWORLD / "BirdeeChen__caffe_yolo_v2__examples__yolo__yolo-voc-deploy.prototxt"))
    out = next(n for n in deploy.layers if n.name == "Output")
    assert (out.attrs["num_classes"], out.attrs["nms"], out.attrs["conf_threshold"]) == (20, "objectness",
                                                                                         pytest.approx(0.2))
    assert deploy.blob_shapes["Output"] == (1, 1, 13 * 13 * 5, 7)
    assert deploy.blob_shapes["region1"] == (1, 125, 13, 13)
    train = load(str(REALWORLD / "BirdeeChen__caffe_yolo_v2__examples__yolo__yolo-voc-train.prototxt"),
                 phase="TRAIN", input_shapes={"data": (5, 3, 416, 416)})
    assert train.blob_shapes["layer31-conv"] == (5, 125, 13, 13)
    darknet = load(str(REALWORLD / "BirdeeChen__caffe_yolo_v2__darknet__yolo-voc.prototxt"))
    assert darknet.blob_shapes["layer32-region"] == (1, 125, 13, 13)
