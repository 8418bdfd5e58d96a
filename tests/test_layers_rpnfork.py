"""Faster R-CNN variants: zhanglaplace/faster-rcnn-cplusplus2's C++ `RPN` layer (run, against a reference
written from its rpn_layer.cpp), RRPN's rotated proposals and RotateROIPooling (read only), xraydetec/Xdet's
FPN proposals with its own anchor count (read, refused to run) and its FPN ProposalTargetLayer (read)."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from c_reference import c_round
from conftest import check_everywhere

import caffeq.layers
from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.layers.rcnn import rpn_nms
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


# ---- the reference: rpn_layer.cpp (5b6701d), float32 as Dtype = float ------------------------------

def ref_cpp_anchors(base, ratios, scales):
    """generate_anchors(): ratio_enum then scale_enum around the base window's centre, C's round, and
    the int array the layer keeps (truncation)."""
    def mk(w, h, cx, cy):
        return [cx - 0.5 * (w - 1), cy - 0.5 * (h - 1), cx + 0.5 * (w - 1), cy + 0.5 * (h - 1)]

    cx = cy = (base - 1) / 2.0
    rows = []
    for r in ratios:
        ws = int(c_round(math.sqrt(base * base / r)))
        hs = int(c_round(ws * r))
        x1, y1, x2, y2 = mk(ws, hs, cx, cy)
        w, h, ccx, ccy = x2 - x1 + 1, y2 - y1 + 1, (x1 + x2) / 2, (y1 + y2) / 2
        for s in scales:
            rows.append([int(v) for v in mk(w * s, h * s, ccx, ccy)])
    return np.array(rows, np.float32)


def ref_rpn(prob, deltas, im_info, stride, anchors, pre, post, thresh, min_size):
    f = np.float32
    a = len(anchors)
    _, _, height, width = deltas.shape
    src_h, src_w, scale = int(im_info[0, 0]), int(im_info[0, 1]), f(im_info[0, 2])
    local_min = f(f(min_size) * scale)
    boxes, scores = [], []
    for y in range(height):
        for x in range(width):
            for c in range(a):
                anc = anchors[c] + np.array([x * stride, y * stride, x * stride, y * stride], f)
                aw, ah = f(anc[2] - anc[0]) + f(1), f(anc[3] - anc[1]) + f(1)
                acx, acy = f(anc[0] + f(0.5) * aw), f(anc[1] + f(0.5) * ah)
                d = deltas[0, 4 * c:4 * c + 4, y, x]
                px, py = f(f(aw * d[0]) + acx), f(f(ah * d[1]) + acy)
                pw, ph = f(aw * f(np.exp(d[2]))), f(ah * f(np.exp(d[3])))
                if pw < local_min or ph < local_min:
                    continue
                box = [f(px - f(0.5) * pw), f(py - f(0.5) * ph), f(px + f(0.5) * pw), f(py + f(0.5) * ph)]
                box = [min(max(v, f(0)), f(src_w if i % 2 == 0 else src_h)) for i, v in enumerate(box)]
                boxes.append(box)
                scores.append(prob[0, a + c, y, x])
    order = sorted(range(len(scores)), key=lambda i: -scores[i])   # distinct scores here
    if pre > 0:
        order = order[:pre]
    boxes = [boxes[i] for i in order]
    scores = [scores[i] for i in order]
    area = [f(f(b[2] - b[0] + f(1)) * f(b[3] - b[1] + f(1))) for b in boxes]
    alive = list(range(len(boxes)))
    i = 0
    while i < len(alive):      # nms(): erase every later box with IoU >= thresh
        bi = boxes[alive[i]]
        rest = []
        for j in alive[i + 1:]:
            bj = boxes[j]
            w = max(f(0), f(min(bi[2], bj[2]) - max(bi[0], bj[0])) + f(1))
            h = max(f(0), f(min(bi[3], bj[3]) - max(bi[1], bj[1])) + f(1))
            inter = f(w * h)
            if not f(inter / f(f(area[alive[i]] + area[j]) - inter)) >= f(thresh):
                rest.append(j)
        alive = alive[:i + 1] + rest
        i += 1
    if post > 0:
        alive = alive[:post]
    rois = np.array([[0.0] + boxes[k] for k in alive], f).reshape(-1, 5, 1, 1)
    return rois, np.array([scores[k] for k in alive], f).reshape(-1, 1, 1, 1)


def rpn_net(a, h, w, rpn_param, batch=1, tops=("rois", "scores")):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    return (f'layer {{ name: "p" type: "Input" top: "prob" input_param {{ shape {{ dim: {batch} dim: {2 * a} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "d" type: "Input" top: "deltas" input_param {{ shape {{ dim: {batch} dim: {4 * a} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "i" type: "Input" top: "im_info" input_param {{ shape {{ dim: {batch} dim: 3 }} }} }}\n'
            f'layer {{ name: "proposal" type: "RPN" bottom: "prob" bottom: "deltas" bottom: "im_info" {top_text} '
            f'rpn_param {{ {rpn_param} }} }}')


def rpn_feeds(a, h, w, im_info, batch=1, seed=0):
    rng = np.random.default_rng(seed)
    return {"prob": rng.random((batch, 2 * a, h, w)).astype(np.float32),
            "deltas": (rng.standard_normal((batch, 4 * a, h, w)) * 0.5).astype(np.float32),
            "im_info": np.array([im_info] * batch, np.float32)}


ODD = ("feat_stride: 8 basesize: 15 scale: 3 scale: 5 ratio: 0.3 ratio: 1.7 boxminsize: 12 "
       "per_nms_topn: 40; post_nms_topn: 11; nms_thresh: 0.45")


def test_rpn_anchors_follow_the_fork():
    """The prototxt's settings give py-faster-rcnn's table; odd ones show C's round and the int array."""
    model = load_from_text(rpn_net(9, 2, 3, "feat_stride: 16 basesize: 16 scale: 8 scale: 16 scale: 32 "
                                            "ratio: 0.5 ratio: 1 ratio: 2 boxminsize: 16 nms_thresh: 0.3"))
    got = np.array(model.graph.node("proposal").attrs["anchors"])
    np.testing.assert_array_equal(got, ref_cpp_anchors(16, [0.5, 1, 2], [8, 16, 32]))
    assert got[0].tolist() == [-84, -40, 99, 55]
    odd = load_from_text(rpn_net(4, 2, 3, ODD))
    want = ref_cpp_anchors(15, [np.float32(0.3), np.float32(1.7)], [3, 5])
    np.testing.assert_array_equal(np.array(odd.graph.node("proposal").attrs["anchors"]), want)
    assert (want != np.round(want)).sum() == 0 and odd.blob_shapes["rois"] == (11, 5, 1, 1)


@pytest.mark.parametrize("im_info", [[37.6, 51.9, 0.8], [30.0, 45.0, 1.3]])
def test_rpn_matches_the_reference_everywhere(im_info, tmp_path):
    """Asymmetric maps (A = 4 anchors, 3 x 5 cells), a fractional im_info (int() of the sides), the size
    filter on unclipped sizes, pre/post cuts and NMS at 0.45: torch, onnxruntime and model.py."""
    a, h, w = 4, 3, 5
    model = load_from_text(rpn_net(a, h, w, ODD))
    x = rpn_feeds(a, h, w, im_info)
    anchors = ref_cpp_anchors(15, [np.float32(0.3), np.float32(1.7)], [3, 5])
    rois, scores = ref_rpn(x["prob"], x["deltas"], x["im_info"], 8, anchors, 40, 11, np.float32(0.45), 12)
    assert 0 < len(rois) <= 11
    check_everywhere(model, x, {"rois": rois, "scores": scores}, tmp_path, atol=1e-4)


def test_rpn_keeps_every_box_without_cuts_and_reads_image_zero(tmp_path):
    """per/post_nms_topn 0 keep every box; a batch of two proposes for image 0 only, as the layer does."""
    a, h, w = 3, 4, 2
    param = "feat_stride: 16 basesize: 16 scale: 4 scale: 8 scale: 16 ratio: 1 boxminsize: 4 nms_thresh: 0.6"
    model = load_from_text(rpn_net(a, h, w, param, batch=2))
    assert model.blob_shapes["rois"] == (h * w * a, 5, 1, 1)
    x = rpn_feeds(a, h, w, [61.0, 35.0, 1.0], batch=2, seed=3)
    x["im_info"][1] = [5.0, 5.0, 9.0]
    anchors = ref_cpp_anchors(16, [1.0], [4, 8, 16])
    rois, scores = ref_rpn(x["prob"][:1], x["deltas"][:1], x["im_info"][:1], 16, anchors, 0, 0,
                           np.float32(0.6), 4)
    check_everywhere(model, x, {"rois": rois, "scores": scores}, tmp_path, atol=1e-4)


def test_rpn_nms_drops_an_iou_equal_to_the_threshold():
    """py-faster-rcnn's GPU NMS keeps IoU == threshold; the C++ RPN layer's nms() drops it (ovr >= thresh)."""
    boxes = torch.tensor([[0.0, 0.0, 9.0, 9.0], [0.0, 0.0, 9.0, 4.0]])   # IoU 50 / 100
    assert rpn_nms(boxes, 0.5, 0) == [0, 1]
    assert rpn_nms(boxes, 0.5, 0, inclusive=True) == [0]


@pytest.mark.parametrize("param, msg", [
    ("feat_stride: 16 basesize: 16 ratio: 1 nms_thresh: 0.3", "rpn_param.scale must be one or more positive"),
    ("feat_stride: 16 scale: 8 ratio: 1 nms_thresh: 0.3", "rpn_param.basesize must be positive"),
    ("feat_stride: 16 basesize: 16 scale: 8 ratio: -1 nms_thresh: 0.3", "rpn_param.ratio must be one or more positive"),
])
def test_rpn_bad_params(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(rpn_net(1, 2, 3, param))


def test_rpn_other_anchor_counts_read_but_do_not_run(tmp_path):
    model = load_from_text(rpn_net(5, 2, 3, "feat_stride: 16 basesize: 16 scale: 8 ratio: 1 nms_thresh: 0.3"))
    with pytest.raises(CaffeqError, match="scores 5 anchors"):
        model.run(rpn_feeds(5, 2, 3, [40, 50, 1]))
    with pytest.raises(ExportError, match="scores 5 anchors"):
        model.export_onnx(str(tmp_path / "m.onnx"))


# ---- the real files ------------------------------------------------------------------------------

def test_faster_rcnn_cplusplus2_test_prototxt_reads():
    model = load(str(REALWORLD / "zhanglaplace__faster-rcnn-cplusplus2__models__test.prototxt"))
    assert model.blob_shapes["rois"] == (14 * 14 * 9, 5, 1, 1)   # per/post_nms_topn 0: every anchor
    assert model.blob_shapes["pool5"] == (14 * 14 * 9, 512, 7, 7)


def test_rrpn_test_prototxt_reads():
    model = load(str(REALWORLD / "mjq11302010044__RRPN__models__rrpn__VGG16__faster_rcnn_end2end__test.prototxt"))
    assert model.blob_shapes["rois"] == (1, 6)             # setup(): top[0].reshape(1, 6)
    assert model.blob_shapes["pool5"] == (1, 512, 7, 7)    # RotateROIPooling: (R, C, pooled_h, pooled_w)
    assert model.blob_shapes["bbox_pred"] == (1, 10)


def test_rrpn_proposals_read_but_do_not_run(tmp_path):
    a, h, w = 54, 3, 4
    net = rpn_net(a, h, w, "").replace(f"dim: {4 * a}", f"dim: {5 * a}")
    net = net[:net.index('layer { name: "proposal"')] + (
        'layer { name: "proposal" type: "Python" bottom: "prob" bottom: "deltas" bottom: "im_info" top: "rois" '
        'top: "scores" python_param { module: "rotation.rproposal_layer" layer: "ProposalLayer" '
        'param_str: "\'feat_stride\': 16" } }')
    model = load_from_text(net)
    assert model.blob_shapes["rois"] == (1, 6) and model.blob_shapes["scores"] == (1, 1, 1, 1, 1)
    with pytest.raises(ExportError, match=r"layer 'proposal' \(Python\): RRPN's rotated proposals .*rotate_polygon_nms"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    with pytest.raises(LayerError, match="'feat_stride' is required"):
        load_from_text(net.replace("'feat_stride': 16", "'scales': [8]"))


def test_rrpn_layers_check_their_params():
    net = ('layer { name: "d" type: "Input" top: "data" top: "rois" top: "im_info" input_param { '
           'shape { dim: 2 dim: 3 dim: 8 dim: 6 } shape { dim: 5 dim: 6 } shape { dim: 1 dim: 3 } } }\n'
           'layer { name: "r" type: "RotateROIAlign" bottom: "data" bottom: "rois" bottom: "im_info" top: "o" '
           'rotate_align_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 } }')
    model = load_from_text(net)
    assert model.blob_shapes["o"] == (5, 3, 3, 2)
    with pytest.raises(CaffeqError, match=r"layer 'r' \(RotateROIAlign\): caffeq does not run"):
        model.run({"data": np.zeros((2, 3, 8, 6), np.float32), "rois": np.zeros((5, 6), np.float32),
                   "im_info": np.ones((1, 3), np.float32)})
    with pytest.raises(LayerError, match="rotate_align_param.pooled_w must be > 0"):
        load_from_text(net.replace("pooled_w: 2", ""))


def test_crpn_rotated_roi_layers_read_with_their_own_field_and_two_bottoms():
    # xhzdeng/crpn: rotate_roi_pooling_param / rotate_roi_align_param, bottoms data and rois only
    net = ('layer { name: "d" type: "Input" top: "data" top: "rois" input_param { '
           'shape { dim: 2 dim: 3 dim: 8 dim: 6 } shape { dim: 5 dim: 6 } } }\n'
           'layer { name: "r" type: "RotateROIPooling" bottom: "data" bottom: "rois" top: "o" '
           'rotate_roi_pooling_param { pooled_h: 7 pooled_w: 4 spatial_scale: 0.125 } }')
    model = load_from_text(net)
    assert model.blob_shapes["o"] == (5, 3, 7, 4)
    with pytest.raises(CaffeqError, match=r"layer 'r' \(RotateROIPooling\): caffeq does not run CRPN's rotated ROI pooling .*corner-based"):
        model.run({"data": np.zeros((2, 3, 8, 6), np.float32), "rois": np.zeros((5, 6), np.float32)})
    with pytest.raises(LayerError, match=r"CRPN's RotateROIPooling takes 2 bottoms \(data, rois\)"):
        load_from_text(net.replace('bottom: "rois" top: "o"', 'bottom: "rois" bottom: "rois" top: "o"'))
    with pytest.raises(LayerError, match="rotate_roi_pooling_param.pooled_h must be > 0"):
        load_from_text(net.replace("pooled_h: 7", ""))
    align = net.replace("RotateROIPooling", "RotateROIAlign").replace("rotate_roi_pooling", "rotate_roi_align")
    assert load_from_text(align).blob_shapes["o"] == (5, 3, 7, 4)
    three = align.replace('bottom: "rois" top: "o"', 'bottom: "rois" bottom: "rois" top: "o"')
    assert load_from_text(three).blob_shapes["o"] == (5, 3, 7, 4)   # MaxBottomBlobs 3
    with pytest.raises(LayerError, match=r"CRPN's RotateROIAlign takes 2 or 3 bottoms"):
        load_from_text(three.replace('bottom: "rois" top: "o"', 'bottom: "rois" bottom: "rois" top: "o"'))
    # RRPN's field still asks for im_info
    with pytest.raises(LayerError, match=r"RotateROIPooling takes 3 bottoms \(data, rois, im_info\)"):
        load_from_text(net.replace("rotate_roi_pooling_param", "rotate_pooling_param"))


def test_xdet_fpn_test_prototxt_reads_and_refuses_to_run(tmp_path):
    """Xdet's proposal_layer.py makes cfg.FPNRATIOS (5) x FPNRSCALES (1) anchors; its setup looks at no
    bottom, so Caffe loads the net: caffeq reads it and refuses the proposals at run and export."""
    path = str(REALWORLD / "xraydetec__Xdet__models__test.prototxt")
    assert load(path).blob_shapes["rpn_rois"] == (1000, 5)
    model = load(path, random_weights=True, input_shapes={"data": (1, 3, 64, 64)}, outputs=["rpn_rois"])
    x = {"data": np.zeros((1, 3, 64, 64), np.float32), "im_info": np.array([[64, 64, 1.0]], np.float32)}
    why = r"the stride-4 maps score 5 anchors .* makes 6 .*fork's proposal_layer.py"
    with pytest.raises(CaffeqError, match=r"layer 'proposal' \(FPN region proposals\): " + why):
        model.run(x)
    with pytest.raises(ExportError, match=r"layer\(s\) refused: layer 'proposal' \(Python\): " + why):
        model.export_onnx(str(tmp_path / "m.onnx"))
    with pytest.raises(ExportError, match=why):
        model.export_pytorch(str(tmp_path / "py"))


def test_xdet_train_prototxt_reads():
    """Xdet's ProposalTargetLayer (rpn_rois, gt_boxes, data) gives rois per level 2-5, then labels and targets,
    sized as its setup() does."""
    model = load(str(REALWORLD / "xraydetec__Xdet__models__train_phy.prototxt"), unknown_shapes_ok=True)
    node = model.graph.node("roi-data")
    assert node.attrs["levels"] == 4 and node.attrs["num_classes"] == 6
    shapes = [(1, 5)] * 4 + [(1, 1)] + [(1, 24)] * 3
    spec = caffeq.layers.get_spec("Python:rpn.proposal_target_layer.ProposalTargetLayer")
    assert spec.infer(node.attrs, [(300, 5), (2, 5), (1, 3, 64, 64)]) == shapes
