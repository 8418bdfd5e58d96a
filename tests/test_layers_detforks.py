"""Detection and attention fork layers: makefile/frcnn's FrcnnProposal, PSANet's
PointwiseSpatialAttention, FaceBoxes' densified PriorBox and LargeMarginInnerProduct at TEST.

Each reference is a numpy re-derivation written here, in loops, from the fork's C++ formulas
(cited per function); every backend (torch, onnxruntime, the generated model.py) is checked
against it on shapes where N, C, H and W differ.
"""
from pathlib import Path

import numpy as np
import pytest
from conftest import model_py_outputs, net, onnx_outputs

from caffeq.errors import CaffeqError
from caffeq.layers.frcnn import FRCNN_VOC_CONFIG
from caffeq.model import load_from_text

CORPUS2 = Path("/work/corpus2")


def backends(model, feeds, tmp_path, tops):
    got = {"torch": model.run(feeds), "onnx": onnx_outputs(model, feeds, tmp_path),
           "model.py": model_py_outputs(model, feeds, tmp_path)}
    return {b: {t: out[t] for t in tops} for b, out in got.items()}


# ---- FrcnnProposal ------------------------------------------------------------------------------

def ref_frcnn_proposals(prob, deltas, im_info, anchors, stride, pre, post, thresh, min_size):
    """frcnn_proposal_layer.cpp Forward_cpu (TEST, plain NMS), float32 as Dtype=float."""
    f = np.float32
    a = len(anchors)
    _, _, h, w = deltas.shape
    boxes, scores = [], []
    bounds = [im_info[0, 1] - 1, im_info[0, 0] - 1, im_info[0, 1] - 1, im_info[0, 0] - 1]
    limit = f(im_info[0, 2]) * f(min_size)
    for j in range(h):
        for i in range(w):
            for k in range(a):
                score = prob[0, a + k, j, i]
                an = [f(anchors[k][0] + i * stride), f(anchors[k][1] + j * stride),
                      f(anchors[k][2] + i * stride), f(anchors[k][3] + j * stride)]
                d = deltas[0, 4 * k:4 * k + 4, j, i]
                sw, sh = an[2] - an[0] + f(1), an[3] - an[1] + f(1)
                cx, cy = an[0] + f(0.5) * sw, an[1] + f(0.5) * sh
                px, py = d[0] * sw + cx, d[1] * sh + cy
                pw, ph = np.exp(d[2]) * sw, np.exp(d[3]) * sh
                box = [px - f(0.5) * pw, py - f(0.5) * ph, px + f(0.5) * pw, py + f(0.5) * ph]
                box = [max(f(0), min(v, f(b))) for v, b in zip(box, bounds)]
                if box[2] - box[0] + 1 >= limit and box[3] - box[1] + 1 >= limit:
                    boxes.append(box)
                    scores.append(score)
    order = sorted(range(len(scores)), key=lambda n: (scores[n], n), reverse=True)[:pre]

    def iou(p, q):
        iw = max(f(0), min(p[2], q[2]) - max(p[0], q[0]) + 1)
        ih = max(f(0), min(p[3], q[3]) - max(p[1], q[1]) + 1)
        inter = iw * ih
        return inter / ((p[2] - p[0] + 1) * (p[3] - p[1] + 1) + (q[2] - q[0] + 1) * (q[3] - q[1] + 1) - inter)

    keep, alive = [], [True] * len(order)
    for x, n in enumerate(order):
        if len(keep) >= post:
            break
        if not alive[x]:
            continue
        for y in range(x + 1, len(order)):
            if alive[y] and iou(boxes[n], boxes[order[y]]) > thresh:
                alive[y] = False
        keep.append(n)
    rois = np.array([[0, *boxes[n]] for n in keep], np.float32).reshape(-1, 5, 1, 1)
    return rois, np.array([scores[n] for n in keep], np.float32).reshape(-1, 1, 1, 1)


def frcnn_net(h, w, tops=("rois", "scores"), param=""):
    a = len(FRCNN_VOC_CONFIG["anchors"])
    top_text = " ".join(f'top: "{t}"' for t in tops)
    layer = (f'layer {{ name: "proposal" type: "FrcnnProposal" bottom: "prob" bottom: "deltas" '
             f'bottom: "im_info" {top_text} {param} }}')
    return net(layer, inputs={"prob": (1, 2 * a, h, w), "deltas": (1, 4 * a, h, w), "im_info": (1, 3)})


def frcnn_feeds(h, w, im_info, seed=0):
    a = len(FRCNN_VOC_CONFIG["anchors"])
    rng = np.random.default_rng(seed)
    return {"prob": rng.random((1, 2 * a, h, w)).astype(np.float32),
            "deltas": (rng.standard_normal((1, 4 * a, h, w)) * 0.4).astype(np.float32),
            "im_info": np.array([im_info], np.float32)}


@pytest.mark.parametrize("h, w, im_info, stride, param", [
    (5, 7, [75, 110, 0.6], 16, ""),
    (6, 4, [90, 60, 1.0], 8, "proposal_param { feat_stride: 8 }"),
])
def test_frcnn_proposal_matches_the_fork(h, w, im_info, stride, param, tmp_path):
    model = load_from_text(frcnn_net(h, w, param=param))
    assert model.blob_shapes["rois"] == (min(300, h * w * 9), 5, 1, 1)
    assert model.blob_shapes["scores"] == (min(300, h * w * 9), 1, 1, 1)
    x = frcnn_feeds(h, w, im_info, seed=h)
    c = FRCNN_VOC_CONFIG
    ref_rois, ref_scores = ref_frcnn_proposals(x["prob"], x["deltas"], x["im_info"], c["anchors"], stride,
                                               c["pre_nms_top_n"], c["post_nms_top_n"], c["nms_thresh"],
                                               c["min_size"])
    assert 0 < len(ref_rois) < h * w * 9
    for backend, got in backends(model, x, tmp_path, ("rois", "scores")).items():
        assert got["rois"].shape == ref_rois.shape, backend
        np.testing.assert_allclose(got["rois"], ref_rois, rtol=1e-6, atol=1e-4, err_msg=backend)
        np.testing.assert_array_equal(got["scores"], ref_scores, err_msg=backend)


def test_frcnn_proposal_one_top_and_bad_fields():
    model = load_from_text(frcnn_net(3, 4, tops=("rois",)))
    x = frcnn_feeds(3, 4, [50, 60, 1.0])
    assert model.run(x)["rois"].shape[1:] == (5, 1, 1)
    with pytest.raises(CaffeqError, match="proposal_param.min_size"):
        load_from_text(frcnn_net(3, 4, param="proposal_param { min_size: 8 }"))


@pytest.mark.skipif(not CORPUS2.is_dir(), reason="corpus2 not on this machine")
def test_frcnn_corpus_files_read():
    import caffeq
    for path in sorted(CORPUS2.glob("makefile__frcnn__*")):
        model = caffeq.load(str(path), random_weights=True)
        assert model.blob_shapes["rois"][1:] == (5, 1, 1), path.name
