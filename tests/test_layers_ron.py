"""RON's DetLayer (taokong/RON c62d0ed lib/ron_layer/det_layer.py), run natively: the reference below
follows that forward in numpy, with its generate_anchors (py-faster-rcnn's, base 32, ratios 0.333 ... 3,
scales K and K + 1) and fast_rcnn's bbox_transform_inv, on a 3 x 5 map with 4 classes."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

A = 10   # 5 ratios x 2 scales


def ron_anchors(base, ratios, scales):
    def whctrs(a):
        w, h = a[2] - a[0] + 1, a[3] - a[1] + 1
        return w, h, a[0] + 0.5 * (w - 1), a[1] + 0.5 * (h - 1)

    def mk(ws, hs, x, y):
        return np.stack([x - 0.5 * (ws - 1), y - 0.5 * (hs - 1), x + 0.5 * (ws - 1), y + 0.5 * (hs - 1)], 1)

    w, h, x, y = whctrs(np.array([0, 0, base - 1, base - 1], np.float64))
    ws = np.round(np.sqrt(w * h / np.array(ratios)))
    hs = np.round(ws * np.array(ratios))
    rows = []
    for a in mk(ws, hs, x, y):
        aw, ah, ax, ay = whctrs(a)
        rows.append(mk(aw * np.array(scales, np.float64), ah * np.array(scales, np.float64), ax, ay))
    return np.vstack(rows)


def det_layer_ref(rpn, det, deltas, stride, scale, classes):
    n, _, h, w = rpn.shape
    anchors = ron_anchors(32, [0.333, 0.5, 1, 2, 3], [scale, scale + 1])
    sx, sy = np.meshgrid(np.arange(w) * stride, np.arange(h) * stride)
    shifts = np.vstack((sx.ravel(), sy.ravel(), sx.ravel(), sy.ravel())).T
    all_anchors = (anchors.reshape(1, A, 4) + shifts.reshape(1, -1, 4).transpose(1, 0, 2)).reshape(-1, 4)
    s_rpn = rpn[:, A:].transpose(0, 2, 3, 1).reshape(-1, 1)
    s_det = det[:, 1:].reshape(n, classes - 1, A, h, w).transpose(0, 3, 4, 2, 1).reshape(-1, classes - 1)
    scores = np.hstack((s_rpn, s_det)).reshape(n, -1, classes)
    d = deltas.transpose(0, 2, 3, 1).reshape(-1, 4)
    boxes = np.tile(all_anchors, (n, 1)).astype(np.float32)
    widths, heights = boxes[:, 2] - boxes[:, 0] + 1.0, boxes[:, 3] - boxes[:, 1] + 1.0
    cx, cy = boxes[:, 0] + 0.5 * widths, boxes[:, 1] + 0.5 * heights
    px, py = d[:, 0] * widths + cx, d[:, 1] * heights + cy
    pw, ph = np.exp(d[:, 2]) * widths, np.exp(d[:, 3]) * heights
    out = np.stack([px - 0.5 * pw, py - 0.5 * ph, px + 0.5 * pw, py + 0.5 * ph], 1)
    return out.reshape(n, -1, 4), scores


def ron_net(shapes, param="'stride_scale_numcls': 16,3,4"):
    return net('layer { name: "det" type: "Python" bottom: "rpn" bottom: "cls" bottom: "box" top: "rois" '
               f'top: "scores" python_param {{ module: "ron_layer.det_layer" layer: "DetLayer" param_str: "{param}" }} }}',
               inputs=shapes)


SHAPES = {"rpn": (1, 2 * A, 3, 5), "cls": (1, 4, A * 3, 5), "box": (1, 4 * A, 3, 5)}


def test_boxes_and_scores_as_the_python_layer(tmp_path):
    feeds = {k: rng(i).standard_normal(s).astype(np.float32) * (0.3 if k == "box" else 1) for i, (k, s) in
             enumerate(SHAPES.items())}
    model = load_from_text(ron_net(SHAPES))
    boxes, scores = det_layer_ref(feeds["rpn"], feeds["cls"], feeds["box"], 16, 3, 4)
    assert model.blob_shapes["rois"] == (1, 150, 4) and model.blob_shapes["scores"] == (1, 150, 4)
    check_everywhere(model, feeds, {"rois": boxes, "scores": scores}, tmp_path, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("param, shapes, msg", [
    ("'stride_scale_numcls': 16,3", SHAPES, r"param_str must be \"'stride_scale_numcls': STRIDE,SCALE,CLASSES\""),
    ("'stride_scale_numcls': 16,3,1", SHAPES, r"classes \(with the background\) >= 2"),
    ("'stride_scale_numcls': 16,3,4", dict(SHAPES, rpn=(1, 2 * A + 2, 3, 5)), r"must be \(N, 2 x 10, H, W\)"),
    ("'stride_scale_numcls': 16,3,5", SHAPES, r"past channel 0 must hold \(N, 5 - 1, 10, 3, 5\) values"),
])
def test_refuses_what_the_layer_cannot_reshape(param, shapes, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(ron_net(shapes, param))
