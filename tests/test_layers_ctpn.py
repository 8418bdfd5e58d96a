"""CTPN's text proposals (tianzhi0549/CTPN's layers.text_proposal_layer.ProposalLayer), natively.

The reference is a numpy re-derivation written here from CTPN's Python source (src/anchor.py's
AnchorText, src/layers/text_proposal_layer.py, src/other.py's clip_boxes), run as its Python 2
runtime would: anchors built in an int32 array with floored half heights, one box at a time in
loops, float32 where the module stores float32 and float64 where numpy promotes to it.
"""
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_py_outputs, onnx_outputs

import caffeq
from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.layers.ctpn import text_anchors
from caffeq.model import load_from_text

HEIGHTS = [11, 16, 23, 33, 48, 68, 97, 139, 198, 283]
A = len(HEIGHTS)
DEPLOY = Path(__file__).parent / "fixtures" / "realworld" / "tianzhi0549__CTPN__models__deploy.prototxt"

# ---- the reference ----------------------------------------------------------------------------


def ref_basic_anchors():
    """AnchorText.basic_anchors under Python 2: the window (0, 0, 15, 15) resized around its centre
    to 16 x h, written into an int32 array (which truncates), h / 2 an integer division."""
    rows = []
    for h in HEIGHTS:
        anchor = np.array([0, 0, 15, 15], np.int32)
        x_ctr = (anchor[0] + anchor[2]) * 0.5
        y_ctr = (anchor[1] + anchor[3]) * 0.5
        scaled = anchor.copy()
        scaled[0], scaled[2] = x_ctr - 16 // 2, x_ctr + 16 // 2
        scaled[1], scaled[3] = y_ctr - h // 2, y_ctr + h // 2
        rows.append(scaled)
    return np.array(rows, np.int32)


def ref_text_proposals(prob, deltas, im_info, stride):
    f32, f64 = np.float32, np.float64
    basic = ref_basic_anchors()
    _, _, height, width = prob.shape
    rois, scores = [], []
    for y in range(height):           # locate_anchors: y outer, x, then the anchor
        for x in range(width):
            for k in range(A):
                x1, y1, x2, y2 = (int(v) for v in basic[k] + np.array([x, y, x, y]) * stride)
                centre = (y1 + y2) / 2.0
                anchor_h = y2 - y1 + 1.0
                dy, dh = deltas[0, 2 * k, y, x], deltas[0, 2 * k + 1, y, x]
                box_h = f32(f64(np.exp(dh)) * anchor_h)
                top = f32(f64(dy) * anchor_h + centre - f64(box_h) / 2.0)
                bottom = f32(top + box_h)
                im_h, im_w = im_info[0, 0], im_info[0, 1]
                box = [max(min(f32(x1), im_w - f32(1)), f32(0)),   # other.py's threshold: min, then max
                       max(min(top, im_h - f32(1)), f32(0)),
                       max(min(f32(x2), im_w - f32(1)), f32(0)),
                       max(min(bottom, im_h - f32(1)), f32(0))]
                rois.append(box)
                scores.append(prob[0, A + k, y, x])
    return np.array(rois, f32), np.array(scores, f32)[:, None]


# ---- nets -------------------------------------------------------------------------------------

def ctpn_net(h, w, param_str="'feat_stride': 16", tops=("rois", "scores"), prob_c=2 * A, deltas_c=2 * A,
             info=(1, 3), n=1):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    info_dims = " ".join(f"dim: {d}" for d in info)
    return (f'layer {{ name: "p" type: "Input" top: "prob" input_param {{ shape {{ dim: {n} dim: {prob_c} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "d" type: "Input" top: "deltas" input_param {{ shape {{ dim: {n} dim: {deltas_c} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "i" type: "Input" top: "im_info" input_param {{ shape {{ {info_dims} }} }} }}\n'
            f'layer {{ name: "proposal" type: "Python" bottom: "prob" bottom: "deltas" bottom: "im_info" '
            f'{top_text} python_param {{ module: "layers.text_proposal_layer" layer: "ProposalLayer" '
            f'param_str: "{param_str}" }} }}')


def feeds(h, w, im_info, seed=0, spread=0.5):
    rng = np.random.default_rng(seed)
    return {"prob": rng.random((1, 2 * A, h, w)).astype(np.float32),
            "deltas": (rng.standard_normal((1, 2 * A, h, w)) * spread).astype(np.float32),
            "im_info": np.array([im_info], np.float32)}


def check(got_rois, got_scores, ref_rois, ref_scores):
    assert got_rois.shape == ref_rois.shape and got_scores.shape == ref_scores.shape
    np.testing.assert_allclose(got_rois, ref_rois, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got_scores, ref_scores)


# ---- tests ------------------------------------------------------------------------------------

def test_anchors_are_ctpns_under_python_2():
    np.testing.assert_array_equal(np.array(text_anchors()), ref_basic_anchors())
    # floored halves and truncation toward zero keep each anchor within a pixel of its height and
    # of the window's centre, but not exactly (Python 3's true division would give other rows)
    for h, (_, y1, _, y2) in zip(HEIGHTS, text_anchors()):
        assert abs((y2 - y1 + 1) - h) <= 1 and abs((y1 + y2) / 2 - 7.5) <= 1
    assert all(x1 == 0 and x2 == 15 for x1, _, x2, _ in text_anchors())


@pytest.mark.parametrize("h, w, stride, im_info", [
    (5, 7, 16, [70, 100, 1.0]),      # the map covers 80 x 112 pixels: boxes clipped on every side
    (3, 9, 8, [30, 64, 0.5]),
])
def test_matches_the_reference_in_torch_onnxruntime_and_model_py(h, w, stride, im_info, tmp_path):
    model = load_from_text(ctpn_net(h, w, f"'feat_stride': {stride}"))
    assert model.blob_shapes["rois"] == (h * w * A, 4) and model.blob_shapes["scores"] == (h * w * A, 1)
    x = feeds(h, w, im_info, seed=h)
    ref_rois, ref_scores = ref_text_proposals(x["prob"], x["deltas"], x["im_info"], stride)
    assert (ref_rois[:, 1] == 0).any() and (ref_rois[:, 3] == im_info[0] - 1).any()   # clipping took part
    assert (ref_rois[:, 2] == im_info[1] - 1).any() and ((ref_rois[:, 1] > 0) & (ref_rois[:, 3] < im_info[0] - 1)).any()
    for exact in (True, False):
        got = model.run(x, exact=exact)
        check(got["rois"], got["scores"], ref_rois, ref_scores)
    for opset in (13, None):
        got = onnx_outputs(model, x, tmp_path, opset)
        check(got["rois"], got["scores"], ref_rois, ref_scores)
    got = model_py_outputs(model, x, tmp_path)
    check(got["rois"], got["scores"], ref_rois, ref_scores)


def test_im_info_with_two_values_as_ctpns_demo_feeds():
    model = load_from_text(ctpn_net(4, 6, info=(1, 2)))
    x = feeds(4, 6, [50, 90], seed=5)
    got = model.run(x)
    check(got["rois"], got["scores"], *ref_text_proposals(x["prob"], x["deltas"], x["im_info"], 16))


@pytest.mark.parametrize("param_str, msg", [
    ("", "'feat_stride' is required"),
    ("'scales': [8]", "reads only 'feat_stride'"),
    ("'feat_stride': 16, 'anchor_num': 10", "reads only 'feat_stride'"),
    ("'feat_stride': 1.5", "must be a positive integer"),
    ("'feat_stride': 0", "must be a positive integer"),
    ("'feat_stride': true", "must be a positive integer"),
    ("{'feat_stride': 16", "param_str"),
])
def test_bad_param_str_is_refused(param_str, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(ctpn_net(3, 4, param_str))


@pytest.mark.parametrize("kwargs, msg", [
    ({"tops": ("rois",)}, "give 2 tops"),
    ({"prob_c": 18}, "rpn_cls_prob_reshape must be"),
    ({"deltas_c": 40}, "rpn_bbox_pred must be"),
    ({"info": (1, 1)}, "im_info's first row"),
    ({"info": (3,)}, "im_info's first row"),
    ({"n": 2, "info": (2, 3)}, "one image per batch"),
])
def test_bad_shapes_are_refused(kwargs, msg):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(ctpn_net(3, 4, **kwargs))


def test_ctpn_deploy_file_runs_end_to_end(tmp_path):
    """VGG16 conv5 -> im2col -> BLSTM -> fc -> RPN scores and vertical deltas -> text proposals, with
    random weights at a small image; the proposals follow from the net's own score and delta blobs."""
    model = caffeq.load(DEPLOY, random_weights=True, input_shapes={"data": (1, 3, 64, 80)})
    assert model.outputs == ["rois", "scores"]
    assert model.blob_shapes["rois"] == (4 * 5 * A, 4) and model.blob_shapes["scores"] == (4 * 5 * A, 1)
    rng = np.random.default_rng(1)
    x = {"data": (rng.standard_normal((1, 3, 64, 80)) * 50).astype(np.float32),
         "im_info": np.array([[60, 75, 1.0]], np.float32)}
    blobs = model.run(x, all_blobs=True)
    ref_rois, ref_scores = ref_text_proposals(blobs["rpn_cls_prob_reshape"], blobs["rpn_bbox_pred"],
                                              x["im_info"], 16)
    check(blobs["rois"], blobs["scores"], ref_rois, ref_scores)
    want = model.run(x, exact=True)
    for got in (onnx_outputs(model, x, tmp_path), model_py_outputs(model, x, tmp_path)):
        for blob in ("rois", "scores"):
            np.testing.assert_allclose(got[blob], want[blob], rtol=1e-4, atol=1e-4 * np.abs(want[blob]).max())


def test_forward_refuses_a_batch_of_two():
    from caffeq.layers import get_spec
    spec = get_spec("Python:layers.text_proposal_layer.ProposalLayer")
    x = feeds(2, 3, [30, 40])
    with pytest.raises(CaffeqError, match="one image per batch"):
        spec.forward({"feat_stride": 16, "anchors": text_anchors()}, None,
                     *(torch.from_numpy(np.concatenate([x[k], x[k]])) for k in ("prob", "deltas", "im_info")))
