"""PVANet's C++ Proposal (sanghoon/caffe dev_pvanet 6068dd0, proposal_layer.cpp / nms.cpp): run
against a reference written from its C++, and the real files that use it."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_everywhere

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.layers.sort_box import pva_sort_order
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
f = np.float32


# ---- the reference, float32 as Dtype = float ----------------------------------------------------

def ref_anchors(base, ratios, scales):
    """generate_anchors(): ROUND(x) = (int)(x + 0.5) on the ratio sides, then the scaled half sides."""
    area, centre = f(base * base), f(0.5) * (f(base) - f(1))
    rows = []
    for r in ratios:
        rw = f(int(f(np.sqrt(area / f(r))) + f(0.5)))
        rh = f(int(f(rw * f(r)) + f(0.5)))
        for s in scales:
            sw, sh = f(0.5) * f(f(rw * f(s)) - f(1)), f(0.5) * f(f(rh * f(s)) - f(1))
            rows.append([centre - sw, centre - sh, centre + sw, centre + sh])
    return np.array(rows, f)


def ref_sort_box(lst, start, end, num_top):
    pivot = lst[start][4]
    left, right = start + 1, end
    while left <= right:
        while left <= end and lst[left][4] >= pivot:
            left += 1
        while right > start and lst[right][4] <= pivot:
            right -= 1
        if left <= right:
            lst[left], lst[right] = lst[right], lst[left]
            left += 1
            right -= 1
    if right > start:
        lst[start], lst[right] = lst[right], lst[start]
    if start < right - 1:
        ref_sort_box(lst, start, right - 1, num_top)
    if right + 1 < num_top and right + 1 < end:
        ref_sort_box(lst, right + 1, end, num_top)


def ref_iou(a, b):   # nms.cu's iou
    w = max(f(0), f(f(min(a[2], b[2]) - max(a[0], b[0])) + f(1)))
    h = max(f(0), f(f(min(a[3], b[3]) - max(a[1], b[1])) + f(1)))
    inter = f(w * h)
    area_a = f(f(a[2] - a[0] + f(1)) * f(a[3] - a[1] + f(1)))
    area_b = f(f(b[2] - b[0] + f(1)) * f(b[3] - b[1] + f(1)))
    return f(inter / f(f(area_a + area_b) - inter))


def ref_proposal(prob, deltas, im_info, stride, anchors, pre, post, thresh, min_size):
    info = list(im_info.reshape(-1))
    if len(info) == 3:   # luoyetx/mini-caffe's port: [img_H, img_W, scale], one scale for both sides
        info.append(info[2])
    img_h, img_w, scale_h, scale_w = (f(v) for v in info[:4])
    return ref_proposal_bounds(prob, deltas, img_h, img_w, f(f(min_size) * scale_h), f(f(min_size) * scale_w),
                               stride, anchors, pre, post, thresh)


def ref_proposal_bounds(prob, deltas, img_h, img_w, min_h, min_w, stride, anchors, pre, post, thresh):
    """Image 0's proposals: boxes clipped to [0, img_w - 1] x [0, img_h - 1], scored 0 below min_h x min_w
    (float32 bounds, as the layer has them once it has read im_info)."""
    a = len(anchors)
    _, _, height, width = prob.shape
    img_h, img_w = f(img_h), f(img_w)
    props = []
    for h in range(height):
        for w in range(width):
            for k in range(a):
                box = [f(w * stride) + anchors[k, 0], f(h * stride) + anchors[k, 1],
                       f(w * stride) + anchors[k, 2], f(h * stride) + anchors[k, 3]]
                dx, dy, dw, dh = deltas[0, 4 * k:4 * k + 4, h, w]
                bw, bh = f(box[2] - box[0]) + f(1), f(box[3] - box[1]) + f(1)
                cx, cy = box[0] + f(0.5) * bw, box[1] + f(0.5) * bh
                px, py = f(dx * bw) + cx, f(dy * bh) + cy
                pw, ph = f(np.exp(dw)) * bw, f(np.exp(dh)) * bh
                box = [px - f(0.5) * pw, py - f(0.5) * ph, px + f(0.5) * pw, py + f(0.5) * ph]
                box = [max(f(0), min(v, (img_w if i % 2 == 0 else img_h) - f(1))) for i, v in enumerate(box)]
                ok = (f(box[2] - box[0]) + f(1) >= min_w) and (f(box[3] - box[1]) + f(1) >= min_h)
                props.append(box + [f(int(ok) * prob[0, a + k, h, w])])
    ref_sort_box(props, 0, len(props) - 1, pre)
    n = min(len(props), pre)
    dead, keep = [False] * n, []
    for i in range(n):   # nms_cpu's loop
        if dead[i]:
            continue
        keep.append(i)
        if len(keep) == post:
            break
        for j in range(i + 1, n):
            if not dead[j] and ref_iou(props[i], props[j]) > f(thresh):
                dead[j] = True
    rois = np.array([[0.0] + props[i][:4] for i in keep], f).reshape(-1, 5)
    return rois, np.array([props[i][4] for i in keep], f)


def pva_net(a, h, w, param, info=4, tops=("rois", "scores")):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    return (f'layer {{ name: "p" type: "Input" top: "prob" input_param {{ shape {{ dim: 1 dim: {2 * a} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "d" type: "Input" top: "deltas" input_param {{ shape {{ dim: 1 dim: {4 * a} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "i" type: "Input" top: "im_info" input_param {{ shape {{ dim: 1 dim: {info} }} }} }}\n'
            f'layer {{ name: "proposal" type: "Proposal" bottom: "prob" bottom: "deltas" bottom: "im_info" '
            f'{top_text} proposal_param {{ {param} }} }}')


def feeds(a, h, w, im_info, seed=0):
    rng = np.random.default_rng(seed)
    return {"prob": rng.random((1, 2 * a, h, w)).astype(f),
            "deltas": (rng.standard_normal((1, 4 * a, h, w)) * 0.6).astype(f),
            "im_info": np.array([im_info], f)}


ODD = ("feat_stride: 8 base_size: 15 min_size: 7 ratio: 0.333 ratio: 1.7 scale: 2 scale: 3.5 "
       "pre_nms_topn: 40 post_nms_topn: 11 nms_thresh: 0.45")


def test_pva_anchors_follow_the_fork():
    """(int)(v + 0.5) on the ratio sides, float32, ratios outer; PVANet's own 7 x 6 table."""
    model = load_from_text(pva_net(4, 2, 3, ODD))
    np.testing.assert_array_equal(np.array(model.graph.node("proposal").attrs["anchors"], f),
                                  ref_anchors(15, [0.333, 1.7], [2, 3.5]))
    ratios, scales = [0.333, 0.5, 0.667, 1.0, 1.5, 2.0, 3.0], [2, 3, 5, 9, 16, 32]
    text = " ".join([f"ratio: {r}" for r in ratios] + [f"scale: {s}" for s in scales])
    model = load_from_text(pva_net(42, 2, 3, text))
    got = np.array(model.graph.node("proposal").attrs["anchors"], f)
    np.testing.assert_array_equal(got, ref_anchors(16, ratios, scales))
    assert got[0].tolist() == [-20.0, -1.0, 35.0, 16.0]   # ratio 0.333: sides 28 x 9, scale 2
    assert model.blob_shapes["rois"] == (42 * 6, 5) and model.blob_shapes["scores"] == (42 * 6,)


@pytest.mark.parametrize("im_info", [[37.6, 51.9, 0.8, 1.3], [48.0, 45.0, 0.5, 0.9, 7.0, 9.0], [37.6, 51.9, 1.3]])
def test_pva_matches_the_reference_everywhere(im_info, tmp_path):
    """Asymmetric maps (A = 4, 3 x 5 cells), scale_h != scale_w, pre/post cuts and NMS at 0.45: torch,
    onnxruntime and model.py.  pre_nms_topn stays above the boxes the size filter zeroes."""
    a, h, w = 4, 3, 5
    model = load_from_text(pva_net(a, h, w, ODD, info=len(im_info)))
    x = feeds(a, h, w, im_info)
    rois, scores = ref_proposal(x["prob"], x["deltas"], x["im_info"], 8, ref_anchors(15, [0.333, 1.7], [2, 3.5]),
                                40, 11, 0.45, 7)
    assert 0 < len(rois) <= 11 and (scores > 0).all()
    check_everywhere(model, x, {"rois": rois, "scores": scores}, tmp_path, atol=1e-4)


def test_pva_small_boxes_stay_with_score_zero_in_the_forks_order(tmp_path):
    """A big min_size zeroes most scores; they stay, in sort_box's order of equal scores (torch and
    model.py; ONNX's TopK orders ties otherwise)."""
    a, h, w = 2, 4, 3
    param = "feat_stride: 16 base_size: 16 min_size: 40 ratio: 1 ratio: 2 scale: 2 pre_nms_topn: 30 nms_thresh: 0.3"
    model = load_from_text(pva_net(a, h, w, param))
    x = feeds(a, h, w, [50.0, 61.0, 1.0, 1.0], seed=4)
    rois, scores = ref_proposal(x["prob"], x["deltas"], x["im_info"], 16, ref_anchors(16, [1, 2], [2]),
                                30, 300, 0.3, 40)
    assert (scores == 0).sum() >= 2
    check_everywhere(model, x, {"rois": rois, "scores": scores}, tmp_path, atol=1e-4, opsets=())


def _ties(rng, kind, n):
    """Scores with many ties: a few levels, mostly zeros (removed boxes), runs sorted either way, NaNs."""
    if kind == "levels":
        return rng.integers(0, 5, n).astype(f) / 4
    if kind == "zeros":
        return np.where(rng.uniform(size=n) < 0.7, 0, rng.uniform(size=n)).astype(f)
    if kind == "descending":
        return np.sort(rng.integers(0, 4, n).astype(f))[::-1].copy()
    if kind == "ascending":
        return np.sort(rng.integers(0, 4, n).astype(f))
    s = rng.integers(0, 3, n).astype(f)
    s[rng.uniform(size=n) < 0.1] = np.nan
    return s


@pytest.mark.parametrize("kind", ["levels", "zeros", "descending", "ascending", "nan"])
@pytest.mark.parametrize("seed", range(4))
def test_pva_sort_order_is_sort_box(seed, kind):
    rng = np.random.default_rng(seed)
    n = 60
    s = _ties(rng, kind, n)
    for top in (1, 2, 7, 31, 60, 100):
        lst = [[0, 0, 0, 0, v, i] for i, v in enumerate(s.tolist())]
        ref_sort_box(lst, 0, len(lst) - 1, top)
        assert pva_sort_order(torch.tensor(s), top).tolist() == [r[5] for r in lst[:min(top, n)]]


def test_pva_sort_order_of_a_long_tail_of_zeros_is_sort_box():
    # fewer positive scores than pre_nms_topn, as when min_size removes most boxes of a large map: the
    # quicksort peels the zeros one pivot at a time (caffeq skips such runs at once, to the same order)
    rng = np.random.default_rng(0)
    s = np.zeros(4000, f)
    s[rng.choice(4000, 300, replace=False)] = rng.uniform(size=300)
    lst = [[0, 0, 0, 0, v, i] for i, v in enumerate(s.tolist())]
    ref_sort_box(lst, 0, len(lst) - 1, 2000)
    assert pva_sort_order(torch.tensor(s), 2000).tolist() == [r[5] for r in lst[:2000]]


@pytest.mark.parametrize("param, msg", [
    ("ratio: 1", "scale must be one or more positive"),
    ("ratio: -1 scale: 2", "ratio must be one or more positive"),
    ("ratio: 1 scale: 2 base_size: 0", "proposal_param.base_size must be positive"),
    ("ratio: 1 scale: 2 pre_nms_topn: 0", "pre_nms_topn must be >= 1"),
])
def test_pva_bad_params(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(pva_net(1, 2, 3, param))


@pytest.mark.parametrize("a, info, msg", [(5, 4, "scores 5 anchors"), (1, 1, "im_info must hold")])
def test_pva_read_but_refused_to_run(a, info, msg, tmp_path):
    model = load_from_text(pva_net(a, 2, 3, "ratio: 1 scale: 2", info=info))
    with pytest.raises(CaffeqError, match=msg):
        model.run(feeds(a, 2, 3, [40, 50, 1, 1][:info]))
    with pytest.raises(ExportError, match=msg):
        model.export_onnx(str(tmp_path / "m.onnx"))


# ---- the real files ------------------------------------------------------------------------------

def test_pva_mobilenet_test_prototxt_reads():
    model = load(str(REALWORLD / "syshensyshen__pva-mobilenet-v2__mobilenet-test.prototxt"))
    assert model.blob_shapes["rois"] == (300, 5) and model.blob_shapes["scores"] == (300,)
    assert len(model.graph.node("proposal").attrs["anchors"]) == 42
    assert model.blob_shapes["rpn_cls_prob_reshape"] == (1, 84, 40, 66)


def test_rfcn_multiclass_split_deploy_reads_but_does_not_run():
    """Its im_info is (1, 2): PVANet's layer reads scale_h and scale_w past it."""
    name = "32l__rfcn_multiclass_split__jobs__upper_face__pz_S_biger_net_pretrain__deploy.prototxt"
    model = load(str(REALWORLD / name))
    assert model.blob_shapes["person_upper_rois"] == (200, 5)
    assert model.blob_shapes["person_face_rpn_score"] == (200,)
    spec = model.graph.node("person_upper_proposal")
    assert len(spec.attrs["anchors"]) == 12 and math.prod(model.blob_shapes["im_info"]) == 2
