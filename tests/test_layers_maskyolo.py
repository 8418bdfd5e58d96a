"""leon-liangwu/MaskYolo_Caffe's RoiGen and Resize (caffe-maskyolo 423094e).

The references follow roi_gen_layer.cpp with box.hpp / box.cpp (get_region_boxes, do_nms_obj,
get_predict_boxes) and resize_layer.cu's kernel as scalar float32 loops."""
import functools
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, repeated, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

F = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"
ANCHORS = ([2.5, 3.2, 2.0], [2.8, 2.2, 3.5])


def roi_gen_layer(classes=0, coords=4, prop_num=40, thresh=0.5, anchors=ANCHORS, net_w=384, net_h=272):
    return (f'layer {{ name: "g" type: "RoiGen" bottom: "x" top: "rois" top: "labels" roi_gen_param {{ '
            f'num_class: {classes} num_coord: {coords} num_object: {len(anchors[0])} prop_num: {prop_num} '
            f'{repeated("anchor_x", anchors[0])} {repeated("anchor_y", anchors[1])} thresh: {thresh} '
            f'net_w: {net_w} net_h: {net_h} }} }}')


def _expf(v):
    return F(math.exp(float(v)))            # glibc's expf: correctly rounded


def _sig(v):
    return F(1.0 / (1.0 + float(_expf(F(-v)))))


def _overlap(c1, s1, c2, s2):
    l1, l2 = F(c1 - s1 / F(2)), F(c2 - s2 / F(2))
    r1, r2 = F(c1 + s1 / F(2)), F(c2 + s2 / F(2))
    return F((r1 if r1 < r2 else r2) - (l1 if l1 > l2 else l2))


def _iou(a, b):
    w, h = _overlap(a[0], a[2], b[0], b[2]), _overlap(a[1], a[3], b[1], b[3])
    inter = F(0) if (w < 0 or h < 0) else F(w * h)
    return F(inter / F(F(F(a[2] * a[3]) + F(b[2] * b[3])) - inter))


def roi_gen_reference(x, classes, prop_num, thresh, anchors=ANCHORS, net_w=384, net_h=272, counts=None):
    n, _c, h, w = x.shape
    a = len(anchors[0])
    found = []
    for b in range(n):
        boxes, probs = [], []
        for k in range(a):                   # index k * h * w + loc, as get_region_boxes fills them
            for loc in range(h * w):
                row, col = loc // w, loc % w
                e = [x[b, 5 * k + i].reshape(-1)[loc] for i in range(5)]
                scale = _sig(e[4])
                probs.append(scale if scale > F(thresh) else F(0))
                boxes.append((F(F(col + _sig(e[0])) / F(w)), F(F(row + _sig(e[1])) / F(h)),
                              F(F(_expf(e[2]) * F(anchors[0][k])) / F(w)),
                              F(F(_expf(e[3]) * F(anchors[1][k])) / F(h))))
        above = sum(p > 0 for p in probs)
        if classes == 0:                     # do_nms_obj: sorted by objectness, best first (stable)
            order = sorted(range(len(probs)), key=lambda i: -probs[i])
            for ii, i in enumerate(order):
                if probs[i] == 0:
                    continue
                for j in order[ii + 1:]:
                    if _iou(boxes[i], boxes[j]) > F(0.4):
                        probs[j] = F(0)
        kept = [i for i in range(len(probs)) if probs[i] > 0]
        if counts is not None:
            counts.append((above, len(kept)))
        for i in kept:
            bx, by, bw, bh = boxes[i]
            x1, y1 = F(bx - bw / F(2)), F(by - bh / F(2))
            x2, y2 = F(bx + bw / F(2)), F(by + bh / F(2))
            found.append([b, F(max(F(0), x1) * F(net_w)), F(max(F(0), y1) * F(net_h)),
                          F(min(F(1), x2) * F(net_w)), F(min(F(1), y2) * F(net_h))])
    rois = np.zeros((prop_num, 5), np.float32)
    labels = np.zeros(prop_num, np.float32)
    found = np.array(found, np.float32).reshape(-1, 5)[:prop_num]
    rois[:len(found)] = found
    labels[:len(found)] = 1
    return rois, labels


@functools.lru_cache
def _map(channels, seed):
    x = rng(seed).standard_normal((2, channels, 5, 7)).astype(np.float32)
    x[:, 2::5] *= 0.4            # sizes near the anchors' so that boxes overlap
    x[:, 3::5] *= 0.4
    return x


@pytest.mark.parametrize("prop_num, thresh, seed", [(60, 0.5, 0), (45, 0.3, 1), (7, 0.5, 2), (100, 0.5, 0)])
def test_roi_gen_matches_the_forks_loops(prop_num, thresh, seed, tmp_path):
    x = _map(15, seed)
    model = load_from_text(net(roi_gen_layer(prop_num=prop_num, thresh=thresh), inputs={"x": x.shape}))
    counts = []
    rois, labels = roi_gen_reference(x, 0, prop_num, thresh, counts=counts)
    assert all(kept < above for above, kept in counts)      # the NMS dropped boxes in both images
    assert model.blob_shapes["rois"] == (prop_num, 5) and model.blob_shapes["labels"] == (prop_num,)
    kept = sum(k for _, k in counts)
    if prop_num > kept:                     # zero rows and labels after the last box
        assert labels[:kept].all() and not labels[kept:].any() and not rois[kept:].any()
    else:
        assert labels.all()
    assert set(rois[labels > 0, 0]) == ({0, 1} if prop_num > counts[0][1] else {0})
    check_everywhere(model, {"x": x}, {"rois": rois, "labels": labels}, tmp_path, opsets=())


def test_roi_gen_with_classes_reads_five_channels_per_anchor_and_skips_nms(tmp_path):
    # num_class 2: 7 channels per anchor, yet entry_index reads channel 5k + e; probs[i][2] is always 0,
    # so do_nms_obj suppresses nothing
    x = _map(21, 3)
    model = load_from_text(net(roi_gen_layer(classes=2, prop_num=80, thresh=0.4), inputs={"x": x.shape}))
    rois, labels = roi_gen_reference(x, 2, 80, 0.4)
    with_nms = roi_gen_reference(x, 0, 80, 0.4)[1]
    assert labels.sum() > with_nms.sum()
    check_everywhere(model, {"x": x}, {"rois": rois, "labels": labels}, tmp_path, opsets=())


def test_roi_gen_ties_objectness_at_thresh_and_iou_at_point_four(tmp_path):
    # objectness sigmoid(0) = 0.5 is not > thresh 0.5; two concentric boxes of IoU exactly 0.4f (box_iou's
    # float32 arithmetic) are not > 0.4, so both stay
    anchors = ([4.0, 2.4], [3.0, 1.9999999])
    x = np.full((1, 10, 3, 4), -6.0, np.float32)
    x[0, [0, 1, 2, 3, 5, 6, 7, 8], 1, 1] = 0.0
    x[0, 4, 1, 1], x[0, 9, 1, 1] = 2.0, 1.0
    x[0, [0, 1, 2, 3, 4], 0, 3] = 0.0
    a, b = (F(1.5 / 4), F(1.5 / 3), F(1), F(1)), (F(1.5 / 4), F(1.5 / 3), F(F(2.4) / F(4)), F(F(1.9999999) / F(3)))
    assert _iou(a, b) == F(0.4)
    layer = roi_gen_layer(prop_num=4, thresh=0.5, anchors=anchors, net_w=64, net_h=48)
    model = load_from_text(net(layer, inputs={"x": x.shape}))
    rois, labels = roi_gen_reference(x, 0, 4, 0.5, anchors=anchors, net_w=64, net_h=48)
    assert labels.tolist() == [1, 1, 0, 0]
    check_everywhere(model, {"x": x}, {"rois": rois, "labels": labels}, tmp_path, opsets=())


def test_roi_gen_refusals(tmp_path):
    with pytest.raises(LayerError, match=r"roi_gen_param needs num_object \(3\) anchor_x and anchor_y values each, "
                                         r"got 3 and 2"):
        load_from_text(net(roi_gen_layer(anchors=(ANCHORS[0], ANCHORS[1][:2])), inputs={"x": (1, 15, 5, 7)}))
    with pytest.raises(LayerError, match=r"RoiGen's bottom has 16 channels; num_object x \(num_class \+ num_coord "
                                         r"\+ 1\) is 15"):
        load_from_text(net(roi_gen_layer(), inputs={"x": (1, 16, 5, 7)}))
    with pytest.raises(LayerError, match=r"roi_gen_param.prop_num must be >= 1, got 0"):
        load_from_text(net(roi_gen_layer(prop_num=0), inputs={"x": (1, 15, 5, 7)}))
    model = load_from_text(net(roi_gen_layer(), inputs={"x": (1, 15, 5, 7)}))
    with pytest.raises(Exception, match="not written as an ONNX Scan"):
        model.export_onnx(str(tmp_path / "m.onnx"))


# ---- Resize ---------------------------------------------------------------------------------

def resize_reference(x, oh, ow):
    n, c, h, w = x.shape
    sh, sw = F(F(h) / F(oh)), F(F(w) / F(ow))
    out = np.zeros((n, c, oh, ow), np.float32)
    for i in range(oh):
        fh = F(F(i) * sh)
        r = int(np.floor(fh))
        fh = F(fh - F(r))
        h0, h1 = abs(F(1) - fh), abs(fh)
        for j in range(ow):
            fw = F(F(j) * sw)
            q = int(np.floor(fw))
            fw = F(fw - F(q))
            w0, w1 = abs(F(1) - fw), abs(fw)
            v = x[:, :, r, q]
            res = F(h0 * w0) * v
            res = res + F(h0 * w1) * v          # the kernel reads src_idx for all four taps
            res = res + F(h1 * w0) * v
            out[:, :, i, j] = res + F(h1 * w1) * v
    return out


def resize_net(params, shape, with_roi_gen=True):
    gen = roi_gen_layer() if with_roi_gen else ""
    return net(gen, f'layer {{ name: "r" type: "Resize" bottom: "y" top: "o" resize_param {{ {params} }} }}',
               inputs={"x": (1, 15, 5, 7), "y": shape})


@pytest.mark.parametrize("params, out", [("is_pyramid_test: true out_height_scale: 1.7 out_width_scale: 1.5",
                                          (8, 10)),
                                         ("height: 4 width: 9", (4, 9)),
                                         ("height: 11 width: 3", (11, 3))])
def test_resize_matches_the_forks_kernel(params, out, tmp_path):
    y = rng(5).standard_normal((2, 3, 5, 7)).astype(np.float32)
    model = load_from_text(resize_net(params, y.shape), outputs=["o"])   # RoiGen only marks the net
    assert next(n for n in model.layers if n.name == "r").type == "MaskYoloResize"
    want = resize_reference(y, *out)
    assert model.blob_shapes["o"] == (2, 3) + out
    check_everywhere(model, {"y": y}, {"o": want}, tmp_path)


def test_resize_without_the_forks_layers_stays_bilinear():
    model = load_from_text(resize_net("height: 4 width: 9", (2, 3, 5, 7), with_roi_gen=False))
    assert next(n for n in model.layers if n.name == "r").type == "Resize"


def test_resize_refusal():
    with pytest.raises(LayerError, match="resize_param.is_pyramid_test needs out_height_scale and out_width_scale"):
        load_from_text(resize_net("is_pyramid_test: true out_height_scale: 2.0", (2, 3, 5, 7)))


# ---- the corpus files -----------------------------------------------------------------------

@pytest.mark.parametrize("name, top, shape", [
    ("mb_body_keypoints__mb_body_keypoints_deploy", "kps_out", (10, 18, 28, 28)),
    ("mb_body_mask__mb_body_mask_deploy", "mask_prob", (10, 2, 28, 28))])
def test_corpus_deploy_nets_run(name, top, shape):
    path = CORPUS / f"leon-liangwu__MaskYolo_Caffe__models_maskyolo__{name}.prototxt"
    model = load(str(path), random_weights=True)
    x = rng(7).standard_normal(model.blob_shapes["data"]).astype(np.float32)
    got = model.run({"data": x})
    assert got[top].shape == shape and np.isfinite(got[top]).all()
    assert got["roi_labels"].shape == (10,)
