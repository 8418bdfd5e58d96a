"""unsky/FPN's Python layers: the multi-level rpn.proposal_layer.ProposalLayer and the As_rois /
As_rois_MergeRcnn level assignment (caffeq/layers/fpn.py).

The references are numpy re-derivations written here from unsky/FPN a096edb's lib/rpn/
proposal_layer.py, as_rois.py, as_rois_mrcnn.py and lib/fast_rcnn/config.py (loops over rois and
boxes, float32 where the module computes in float32).
"""
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_model_py, onnx_run_by_blob, onnx_session
from test_layers_rcnn import ref_anchors, ref_iou

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

FIXTURES = Path(__file__).parent / "fixtures" / "realworld"
FPN_TEST = FIXTURES / "unsky__FPN__models__pascal_voc__FPN__FP_Net_end2end__test.prototxt"
FPN_MERGE = FIXTURES / "unsky__FPN__models__pascal_voc__FPN__FP_Net_end2end__test_mergercnn.prototxt"
STRIDES = (4, 8, 16, 32, 64)
A = 6   # ratios 0.5, 1, 2 x scales 16, 32


# ---- references -------------------------------------------------------------------------------

def ref_level(roi):
    """k = floor(4 + log2(sqrt(w h) / 224)) clamped to [2, 5], float32, w h <= 0 read as 1e-6."""
    f = np.float32
    s = f(f(roi[3] - roi[1]) * f(roi[4] - roi[2]))
    if s <= 0:
        s = f(1e-6)
    k = np.floor(f(4) + np.log2(f(np.sqrt(s) / f(224))))
    return int(min(max(k, 2), 5))


def ref_as_rois(rois, batch=1000):
    blocks = [np.zeros((batch, 5), np.float32) for _ in range(4)]
    counts = [0] * 4
    for roi in rois:
        k = ref_level(roi) - 2
        blocks[k][counts[k]] = roi
        counts[k] += 1
    return [np.concatenate(blocks)] + blocks


def ref_as_rois_merged(rois):
    levels = [[] for _ in range(4)]
    for roi in rois:
        levels[ref_level(roi) - 2].append(roi)
    blocks = [np.array(lv, np.float32).reshape(-1, 5) if lv else np.zeros((4, 5), np.float32) for lv in levels]
    return [np.concatenate(blocks)] + blocks


def ref_fpn_proposals(im_info, deltas, probs, pre=6000, post=1000, thresh=0.7, min_size=16):
    f = np.float32
    boxes, scores = [], []
    for stride, d, p in zip(STRIDES, deltas, probs):
        anchors = ref_anchors(stride, (0.5, 1, 2), (16, 32))
        hh, ww = int(im_info[0] / stride), int(im_info[1] / stride)
        for y in range(hh):
            for x in range(ww):
                for k in range(A):
                    anc = (anchors[k] + [x * stride, y * stride, x * stride, y * stride]).astype(f)
                    dd = d[0, 4 * k:4 * k + 4, y, x]
                    aw, ah = f(anc[2] - anc[0] + f(1)), f(anc[3] - anc[1] + f(1))
                    cx, cy = f(dd[0] * aw + f(anc[0] + f(0.5) * aw)), f(dd[1] * ah + f(anc[1] + f(0.5) * ah))
                    w, h = f(np.exp(dd[2]) * aw), f(np.exp(dd[3]) * ah)
                    box = [f(cx - f(0.5) * w), f(cy - f(0.5) * h), f(cx + f(0.5) * w), f(cy + f(0.5) * h)]
                    lim = [f(im_info[1] - f(1)), f(im_info[0] - f(1))]
                    box = [max(min(v, lim[i % 2]), f(0)) for i, v in enumerate(box)]
                    if box[2] - box[0] + f(1) >= f(min_size * im_info[2]) and \
                            box[3] - box[1] + f(1) >= f(min_size * im_info[2]):
                        boxes.append(box)
                        scores.append(p[0, A + k, y, x])
    boxes, scores = np.array(boxes, f).reshape(-1, 4), np.array(scores, f)
    order = np.argsort(scores, kind="stable")[::-1][:pre]
    boxes = boxes[order]
    kept = []
    for i in range(len(boxes)):
        if len(kept) < post and all(ref_iou(boxes[j], boxes[i]) <= f(thresh) for j in kept):
            kept.append(i)
    # the module pads with random kept rows; caffeq (documented) repeats them in order
    kept = [kept[i % len(kept)] for i in range(post)] if kept else []
    return np.concatenate([np.zeros((len(kept), 1), f), boxes[kept]], axis=1)


# ---- nets -------------------------------------------------------------------------------------

def input_layer(name, shape):
    dims = " ".join(f"dim: {d}" for d in shape)
    return f'layer {{ name: "{name}_in" type: "Input" top: "{name}" input_param {{ shape {{ {dims} }} }} }}\n'


def as_rois_layer(merged, bottom="rpn_rois"):
    module, cls = ("rpn.as_rois_mrcnn", "As_rois_MergeRcnnLayer") if merged else ("rpn.as_rois", "As_roisLayer")
    return (f'layer {{ name: "as_rois" type: "Python" bottom: "{bottom}" top: "rois" top: "rois/h2" '
            f'top: "rois/h3" top: "rois/h4" top: "rois/h5" python_param {{ module: "{module}" layer: "{cls}" }} }}\n')


def proposal_net(maps, merged=None, param_str="'feat_stride': 4,8,16,32,64"):
    text = input_layer("im_info", (1, 3))
    for s, (h, w) in zip(STRIDES, maps):
        text += input_layer(f"d{s}", (1, 4 * A, h, w)) + input_layer(f"p{s}", (1, 2 * A, h, w))
    bottoms = " ".join(['bottom: "im_info"'] + [f'bottom: "d{s}"' for s in STRIDES] + [f'bottom: "p{s}"' for s in STRIDES])
    text += (f'layer {{ name: "proposal" type: "Python" {bottoms} top: "rpn_rois" python_param {{ '
             f'module: "rpn.proposal_layer" layer: "ProposalLayer" param_str: "{param_str}" }} }}\n')
    if merged is not None:
        text += as_rois_layer(merged)
    return text


def proposal_feeds(maps, im_info, seed=0):
    rng = np.random.default_rng(seed)
    x = {"im_info": np.array([im_info], np.float32)}
    for s, (h, w) in zip(STRIDES, maps):
        x[f"d{s}"] = (rng.standard_normal((1, 4 * A, h, w)) * 0.3).astype(np.float32)
        x[f"p{s}"] = rng.random((1, 2 * A, h, w)).astype(np.float32)
    return x


def random_rois(n, seed):
    rng = np.random.default_rng(seed)
    x1, y1 = rng.uniform(0, 500, n), rng.uniform(0, 400, n)
    w, h = rng.uniform(-5, 900, n) * rng.choice([1.0, 0.3], n), rng.uniform(-5, 700, n)
    rois = np.stack([np.zeros(n), x1, y1, x1 + w, y1 + h], axis=1).astype(np.float32)
    # exact level boundaries (sqrt(w h) = 112, 224, 448) and degenerate boxes
    rois[:5, 3:] = rois[:5, 1:3] + np.array([[112, 112], [224, 224], [448, 448], [0, 50], [-3, 10]], np.float32)
    return rois


# ---- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("n,seed", [(37, 0), (300, 1), (8, 2)])
def test_as_rois_match_the_reference(merged, n, seed):
    rois = random_rois(n, seed)
    model = load_from_text(input_layer("rpn_rois", (n, 5)) + as_rois_layer(merged))
    got = model.run({"rpn_rois": rois})
    want = (ref_as_rois_merged if merged else ref_as_rois)(rois)
    for blob, ref in zip(("rois", "rois/h2", "rois/h3", "rois/h4", "rois/h5"), want):
        np.testing.assert_array_equal(got[blob], ref, err_msg=blob)


def test_as_rois_shapes():
    fixed = load_from_text(input_layer("rpn_rois", (1000, 5)) + as_rois_layer(False))
    assert fixed.blob_shapes["rois"] == (4000, 5) and fixed.blob_shapes["rois/h3"] == (1000, 5)
    merged = load_from_text(input_layer("rpn_rois", (10, 5)) + as_rois_layer(True))
    assert merged.blob_shapes["rois"] == (40, 5) and merged.blob_shapes["rois/h5"] == (10, 5)
    with pytest.raises(CaffeqError, match="at most 1000 rois per level"):
        load_from_text(input_layer("rpn_rois", (1001, 5)) + as_rois_layer(False))
    with pytest.raises(CaffeqError, match=r"\(R, 5\)"):
        load_from_text(input_layer("rpn_rois", (10, 4)) + as_rois_layer(True))


# maps larger than the image's grid (cropped), and a stride-64 level with no cell (40 / 64 < 1)
MAPS = [(11, 15), (6, 8), (3, 4), (2, 2), (1, 1)]


def test_fpn_proposals_match_the_reference():
    model = load_from_text(proposal_net(MAPS))
    assert model.blob_shapes["rpn_rois"] == (1000, 5)
    x = proposal_feeds(MAPS, [40, 57, 0.5], seed=3)
    got = model.run(x)["rpn_rois"]
    ref = ref_fpn_proposals(x["im_info"][0], [x[f"d{s}"] for s in STRIDES], [x[f"p{s}"] for s in STRIDES])
    assert got.shape == ref.shape == (1000, 5)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-4)


def test_fpn_grid_larger_than_the_map_is_refused():
    model = load_from_text(proposal_net(MAPS))
    with pytest.raises(CaffeqError, match="larger than the given"):
        model.run(proposal_feeds(MAPS, [60, 57, 1.0]))


@pytest.mark.parametrize("param_str,msg", [("'feat_stride': 4,8,x", "comma-separated integers"),
                                           ("'feat_stride': 4,8,8,32,64", "distinct"),
                                           ("'feat_stride': 4,8,16,32,128", "strides 4, 8, 16, 32, 64"),
                                           ("{'feat_stride': '4,8,16,32,64', 'scales': 8}", "only 'feat_stride'"),
                                           ("'scales': 8", "only 'feat_stride'")])
def test_bad_fpn_param_str(param_str, msg):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(proposal_net(MAPS, param_str=param_str))


@pytest.mark.parametrize("merged", [False, True])
def test_pytorch_source_matches_forward(merged, tmp_path):
    model = load_from_text(proposal_net(MAPS, merged=merged))
    net, info = load_model_py(model, tmp_path / "o")
    x = proposal_feeds(MAPS, [40, 57, 0.5], seed=5)
    with torch.no_grad():
        out = net(*[torch.from_numpy(x[b]) for b in info["inputs"]])
    want = model.run(x)
    got = out if isinstance(out, dict) else {info["outputs"][0]: out}
    for blob in ("rois", "rois/h2", "rois/h3", "rois/h4", "rois/h5"):
        assert np.array_equal(got[blob].numpy(), want[blob]), blob


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("opset", [13, 21])
def test_fpn_onnx_matches_torch(merged, opset, tmp_path):
    model = load_from_text(proposal_net(MAPS, merged=merged))
    for seed, im_info in ((4, [40, 57, 0.5]), (6, [33, 60, 1.0])):
        x = proposal_feeds(MAPS, im_info, seed=seed)
        want = model.run(x)
        sess = onnx_session(model, tmp_path / f"m{seed}.onnx", opset)
        outs = dict(zip([o.name for o in sess.get_outputs()], onnx_run_by_blob(sess, model, x)))
        by_blob = {model.graph.tensors[n].blob: v for n, v in outs.items()}
        for blob in ("rois", "rois/h2", "rois/h3", "rois/h4", "rois/h5"):
            assert by_blob[blob].shape == want[blob].shape, blob
            np.testing.assert_allclose(by_blob[blob], want[blob], rtol=1e-6, atol=1e-4, err_msg=blob)


def test_fpn_tied_scores_match_everywhere(tmp_path):
    # scores from three values: equal scores go higher index first, as argsort()[::-1], in every backend
    model = load_from_text(proposal_net(MAPS))
    x = proposal_feeds(MAPS, [40, 57, 0.5], seed=7)
    for s in STRIDES:
        x[f"p{s}"] = (np.round(x[f"p{s}"] * 2) / 4 + 0.25).astype(np.float32)
    want = model.run(x)["rpn_rois"]
    ref = ref_fpn_proposals(x["im_info"][0], [x[f"d{s}"] for s in STRIDES], [x[f"p{s}"] for s in STRIDES])
    np.testing.assert_allclose(want, ref, rtol=1e-6, atol=1e-4)
    sess = onnx_session(model, tmp_path / "tied.onnx", 13)
    got = onnx_run_by_blob(sess, model, x)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)


def rois_at_level_steps():
    """Boxes whose float32 area w * h sits on, and one float32 step below, sqrt(w h) = 112, 224, 448
    (where the float32 log2 pipeline rounds), plus random ones and an empty level-4 set."""
    rows = []
    for side in (112.0, 224.0, 448.0):
        area = np.float32(side * side)
        for a in (area, np.nextafter(area, np.float32(0)), np.nextafter(np.nextafter(area, np.float32(0)),
                                                                         np.float32(0))):
            rows.append([0, 3, 5, 3 + a, 6])      # w = a, h = 1
    rois = np.concatenate([np.array(rows, np.float32), random_rois(23, 7)])
    return rois


@pytest.mark.parametrize("merged", [False, True])
def test_as_rois_level_steps_match_the_reference(merged):
    rois = rois_at_level_steps()
    model = load_from_text(input_layer("rpn_rois", rois.shape) + as_rois_layer(merged))
    got = model.run({"rpn_rois": rois})
    want = (ref_as_rois_merged if merged else ref_as_rois)(rois)
    for blob, ref in zip(("rois", "rois/h2", "rois/h3", "rois/h4", "rois/h5"), want):
        np.testing.assert_array_equal(got[blob], ref, err_msg=blob)


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("opset", [13, 21])
def test_as_rois_onnx_matches_torch(merged, opset, tmp_path):
    for rois in (rois_at_level_steps(), random_rois(6, 3)[:2] * np.float32([1, 1, 1, 0, 1])):   # all on level 2
        model = load_from_text(input_layer("rpn_rois", rois.shape) + as_rois_layer(merged))
        want = model.run({"rpn_rois": rois})
        sess = onnx_session(model, tmp_path / f"m{len(rois)}.onnx", opset)
        outs = dict(zip([o.name for o in sess.get_outputs()], onnx_run_by_blob(sess, model, {"rpn_rois": rois})))
        by_blob = {model.graph.tensors[n].blob: v for n, v in outs.items()}
        for blob in ("rois", "rois/h2", "rois/h3", "rois/h4", "rois/h5"):
            np.testing.assert_array_equal(by_blob[blob], want[blob], err_msg=blob)


def test_py_faster_rcnn_proposal_layer_is_still_its_own():
    from test_layers_rcnn import tiny_faster_rcnn
    model = load_from_text(tiny_faster_rcnn(), random_weights=True)
    assert model.blob_shapes["rois"] == (300, 5)
    assert "pyramid" not in model.graph.nodes[[n.name for n in model.graph.nodes].index("proposal")].attrs


@pytest.mark.parametrize("path,rois", [(FPN_TEST, (4000, 5)), (FPN_MERGE, (4000, 5))])
def test_corpus_files_load(path, rois):
    model = load(str(path), random_weights=True)
    assert model.blob_shapes["rpn_rois"] == (1000, 5)
    assert model.blob_shapes["rois"] == rois
    assert model.blob_shapes["rois/h2"] == (1000, 5)


def test_corpus_merge_net_runs_end_to_end():
    model = load(str(FPN_MERGE), random_weights=True, input_shapes={"data": (1, 3, 128, 128)})
    rng = np.random.default_rng(0)
    x = {"data": rng.standard_normal((1, 3, 128, 128)).astype(np.float32),
         "im_info": np.array([[128, 128, 1.0]], np.float32)}
    got = model.run(x, all_blobs=True)
    rpn = got["rpn_rois"]
    assert rpn.shape == (1000, 5)
    want = ref_as_rois_merged(rpn)
    for blob, ref in zip(("rois", "rois/h2", "rois/h3", "rois/h4", "rois/h5"), want):
        np.testing.assert_array_equal(got[blob], ref, err_msg=blob)
    assert got["cls_prob"].shape[0] == want[0].shape[0]
    np.testing.assert_allclose(got["cls_prob"].sum(1), 1, rtol=1e-5)
