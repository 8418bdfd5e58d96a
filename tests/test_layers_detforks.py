"""Detection and attention fork layers: makefile/frcnn's FrcnnProposal, PSANet's
PointwiseSpatialAttention, FaceBoxes' densified PriorBox and LargeMarginInnerProduct at TEST.

Each reference is a numpy re-derivation written here, in loops, from the fork's C++ formulas
(cited per function); every backend (torch, onnxruntime, the generated model.py) is checked
against it on shapes where N, C, H and W differ.
"""
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, model_py_outputs, net, onnx_outputs

from caffeq.errors import CaffeqError
from caffeq.layers.frcnn import FRCNN_VOC_CONFIG
from caffeq.model import load_from_text

CORPUS2 = REPO / "tests" / "fixtures" / "realworld"
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


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


def test_frcnn_zf_test_file_reads():
    import caffeq
    model = caffeq.load(str(REALWORLD / "makefile__frcnn__examples__FRCNN__zf__test.prototxt"), random_weights=True)
    assert model.blob_shapes["rois"] == (300, 5, 1, 1) and model.blob_shapes["scores"] == (300, 1, 1, 1)


# ---- PointwiseSpatialAttention --------------------------------------------------------------------

def ref_psa(x, mask, mask_h, mask_w, distribute, softmax, factor):
    """pointwise_spatial_attention_layer.cpp Forward_cpu: the buffer loops, Softmax over axis 1, GEMM."""
    n, c, h, w = x.shape
    hm, wm = (mask_h - 1) // 2, (mask_w - 1) // 2
    buf = np.zeros((n, h * w, h, w), np.float64)
    for b in range(n):
        for y in range(h):
            for z in range(w):
                for hi in range(max(0, hm - y), min(mask_h, h + hm - y)):
                    for wi in range(max(0, wm - z), min(mask_w, w + wm - z)):
                        v = mask[b, hi * mask_w + wi, y, z]
                        p = (hi + y - hm) * w + (wi + z - wm)
                        if distribute:
                            buf[b, y * w + z, (hi + y - hm), (wi + z - wm)] = v
                        else:
                            buf[b, p, y, z] = v
    if softmax:
        e = np.exp(buf - buf.max(axis=1, keepdims=True))
        buf = e / e.sum(axis=1, keepdims=True)
    out = np.einsum("ncp,npq->ncq", x.reshape(n, c, h * w).astype(np.float64), buf.reshape(n, h * w, h * w))
    return (out / factor).reshape(x.shape)


def psa_net(x_shape, mask_shape, param):
    layer = ('layer { name: "psa" type: "PointwiseSpatialAttention" bottom: "x" bottom: "mask" top: "o" '
             f'pointwise_spatial_attention_param {{ {param} }} }}')
    return net(layer, inputs={"x": x_shape, "mask": mask_shape})


@pytest.mark.parametrize("psa_type", ["COLLECT", "DISTRIBUTE"])
@pytest.mark.parametrize("mask_hw, softmax, factor", [(None, True, 1.0), ((3, 5), False, None), ((5, 3), True, None),
                                                      (None, False, 2.5)])
def test_psa_matches_the_fork(psa_type, mask_hw, softmax, factor, tmp_path):
    n, c, h, w = 2, 3, 4, 5
    mask_h, mask_w = mask_hw or (2 * h - 1, 2 * w - 1)
    param = f"psa_type: {psa_type} is_softmax: {str(softmax).lower()}"
    if mask_hw:
        param += f" attention_mask_height: {mask_h} attention_mask_width: {mask_w}"
    if factor is not None:
        param += f" normalization_factor: {factor}"
    model = load_from_text(psa_net((n, c, h, w), (n, mask_h * mask_w, h, w), param))
    r = np.random.default_rng(len(param))
    x = {"x": r.standard_normal((n, c, h, w)).astype(np.float32),
         "mask": r.standard_normal((n, mask_h * mask_w, h, w)).astype(np.float32)}
    want = ref_psa(x["x"], x["mask"], mask_h, mask_w, psa_type == "DISTRIBUTE", softmax,
                   factor if factor is not None else mask_h * mask_w)
    for backend, got in backends(model, x, tmp_path, ("o",)).items():
        np.testing.assert_allclose(got["o"], want, rtol=1e-5, atol=1e-5, err_msg=backend)
    np.testing.assert_allclose(onnx_outputs(model, x, tmp_path, opset=13)["o"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("param, mask_c, msg", [
    ("attention_mask_height: 3", 15, "both attention_mask_height and attention_mask_width"),
    ("attention_mask_height: 4 attention_mask_width: 3", 12, "attention_mask_height must be odd"),
    ("", 20, r"the mask must be shaped \[1, 63, 4, 5\] for x \[1, 3, 4, 5\] and a 7x9 window"),
])
def test_psa_bad_params(param, mask_c, msg):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(psa_net((1, 3, 4, 5), (1, mask_c, 4, 5), param))


@pytest.mark.skipif(not CORPUS2.is_dir(), reason="corpus2 not on this machine")
def test_psanet_ade20k_reads():
    import caffeq
    model = caffeq.load(str(CORPUS2 / "hszhao__PSANet__evaluation__prototxt__ade20k__psanet50_ade20k_465.prototxt"),
                        random_weights=True)
    assert model.blob_shapes["global_feature_COLLECT"] == (1, 512, 30, 30)


# ---- FaceBoxes' PriorBox ----------------------------------------------------------------------------

def ref_faceboxes_priors(min_sizes, lh, lw, ih, iw, step, offset, variance, max_sizes=()):
    """FaceBoxes prior_box_layer.cpp Forward_cpu: float centres, double corners, float out."""
    f = np.float32
    coords = []
    for h in range(lh):
        for w in range(lw):
            cx, cy = f((w + f(offset)) * f(step)), f((h + f(offset)) * f(step))
            for s, mn in enumerate(min_sizes):
                grid = {32: (range(-2, 2), 8), 64: (range(-1, 1), 16)}.get(mn, (range(1), 0))
                for i in grid[0]:
                    for j in grid[0]:
                        x0, y0 = f(cx + f(j * grid[1])), f(cy + f(i * grid[1]))
                        half = (float(mn) - 1) / 2.0
                        coords += [(x0 - half) / iw, (y0 - half) / ih, (x0 + half) / iw, (y0 + half) / ih]
                if max_sizes:
                    half = float(f(np.sqrt(mn * max_sizes[s]))) / 2.0
                    coords += [(cx - half) / iw, (cy - half) / ih, (cx + half) / iw, (cy + half) / ih]
    coords = np.array(coords, np.float64).astype(np.float32)
    var = np.tile(np.array(variance, np.float32), len(coords) // len(variance))
    return np.stack([coords, var]).reshape(1, 2, -1)


def faceboxes_net(img, feats, per_cell, classes=2, max_size=""):
    """Input maps, a 3-min_size PriorBox on f1 and a 1-min_size one on f2, loc/conf sized for `per_cell`."""
    (h1, w1), (h2, w2) = feats
    priors = h1 * w1 * per_cell[0] + h2 * w2 * per_cell[1]
    box = ('layer {{ name: "{n}" type: "PriorBox" bottom: "{b}" bottom: "img" top: "{n}" prior_box_param {{ '
           '{sizes} clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 step: {step} '
           'offset: 0.5 }} }}')
    layers = [box.format(n="p1", b="f1", sizes="min_size: 32 min_size: 64 min_size: 128" + max_size, step=16),
              box.format(n="p2", b="f2", sizes="min_size: 256", step=32),
              'layer { name: "priors" type: "Concat" bottom: "p1" bottom: "p2" top: "priors" concat_param { axis: 2 } }',
              ('layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "priors" top: "det" '
               f'detection_output_param {{ num_classes: {classes} nms_param {{ nms_threshold: 0.3 top_k: 20 }} '
               'keep_top_k: 10 confidence_threshold: 0.5 } }')]
    return net(*layers, inputs={"img": (1, 3, *img), "f1": (1, 4, h1, w1), "f2": (1, 5, h2, w2),
                                "loc": (1, priors * 4), "conf": (1, priors * classes)})


def test_faceboxes_priors_match_the_fork(tmp_path):
    img, feats = (96, 80), ((6, 5), (3, 2))
    model = load_from_text(faceboxes_net(img, feats, (21, 1)), outputs=["p1", "p2", "det"])
    assert any("FaceBoxes'" in w for w in model.warnings)
    r = np.random.default_rng(5)
    x = {k: r.standard_normal(s).astype(np.float32) for k, s in model.inputs.items()}
    want = {"p1": ref_faceboxes_priors([32, 64, 128], *feats[0], *img, 16, 0.5, [0.1, 0.1, 0.2, 0.2]),
            "p2": ref_faceboxes_priors([256], *feats[1], *img, 32, 0.5, [0.1, 0.1, 0.2, 0.2])}
    for backend, got in backends(model, x, tmp_path, ("p1", "p2")).items():
        for top in ("p1", "p2"):
            np.testing.assert_array_equal(got[top], want[top], err_msg=f"{backend} {top}")


def test_ssd_priors_stay_ssd_and_unfitting_nets_still_fail():
    img, feats = (96, 80), ((6, 5), (3, 2))
    model = load_from_text(faceboxes_net(img, feats, (3, 1)))
    assert not any("FaceBoxes'" in w for w in model.warnings)
    assert model.blob_shapes["p1"] == (1, 2, 6 * 5 * 3 * 4)
    with pytest.raises(CaffeqError, match=r"loc \[1, \d+\] does not hold"):
        load_from_text(faceboxes_net(img, feats, (5, 1)))


def test_faceboxes_reading_refuses_boxes_that_overflow_the_count():
    # with max_size the fork still declares 21 + 3 priors and writes 21 + 3: fits
    img, feats = (96, 80), ((4, 3), (2, 2))
    model = load_from_text(faceboxes_net(img, feats, (24, 1), max_size=" max_size: 48 max_size: 96 max_size: 160"))
    assert model.blob_shapes["p1"] == (1, 2, 4 * 3 * 24 * 4)
    # one min_size 32 alone: the fork declares 1 prior per cell and writes 16 (past its top)
    alone = ('layer { name: "p" type: "PriorBox" bottom: "f" bottom: "img" top: "p" prior_box_param { '
             'min_size: 32 faceboxes_priors: true } }')
    with pytest.raises(CaffeqError, match=r"min_size \[32\]: FaceBoxes' PriorBox declares 1 priors per cell "
                                          "but writes 16"):
        load_from_text(net(alone, inputs={"img": (1, 3, 40, 30), "f": (1, 2, 4, 3)}))


def test_faceboxes_deploy_reads():
    import caffeq
    model = caffeq.load(str(REALWORLD / "sfzhang15__FaceBoxes__models__faceboxes__deploy.prototxt"), random_weights=True)
    assert model.blob_shapes["mbox_priorbox"] == (1, 2, 25600)


def ref_sstd_priors(min_sizes, max_sizes, ratios, flip, lh, lw, ih, iw, step, offset, variance):
    """BestSonny/SSTD prior_box_layer.cpp Forward_cpu: float min_size, int max_size, ratios deduplicated
    against the listed ones, each box s * ar wide, then (flip) s * ar high; float centres, double corners."""
    f = np.float32
    listed = [f(1)]
    for ar in ratios:
        if all(abs(f(ar) - r) >= 1e-6 for r in listed):
            listed.append(f(ar))
    coords = []
    for h in range(lh):
        for w in range(lw):
            cx, cy = f((w + f(offset)) * f(step)), f((h + f(offset)) * f(step))
            for k, mn in enumerate(min_sizes):
                mn = f(mn)
                boxes = [(mn, mn)]
                if max_sizes:
                    side = f(np.sqrt(f(mn * f(int(max_sizes[k])))))
                    boxes.append((side, side))
                boxes += [(f(mn * ar), mn) for ar in listed if abs(ar - 1) >= 1e-6]
                if flip:
                    boxes += [(mn, f(mn * ar)) for ar in listed if abs(ar - 1) >= 1e-6]
                x, y = float(cx), float(cy)      # the corners in double
                for bw, bh in boxes:
                    bw, bh = float(bw), float(bh)
                    coords += [(x - bw / 2.0) / iw, (y - bh / 2.0) / ih, (x + bw / 2.0) / iw, (y + bh / 2.0) / ih]
    coords = np.array(coords, np.float64).astype(np.float32)
    var = np.tile(np.array(variance, np.float32), len(coords) // len(variance))
    return np.stack([coords, var]).reshape(1, 2, -1)


@pytest.mark.parametrize("max_size", ["", " max_size: 30 max_size: 44.5"])
def test_sstd_priors_match_the_fork(max_size, tmp_path):
    # SSTD's text nets list 0.5 and 2 (and 3, 4, ...) with flip: 1 + 2 x 3 boxes per min_size where SSD's
    # deduplication gives 1 + 4; only SSTD's count fits the predictions
    img, (lh, lw) = (64, 48), (5, 4)
    sizes = "min_size: 7.68 min_size: 17.92" + max_size
    per_cell = 2 * 7 + (2 if max_size else 0)
    text = net(f'layer {{ name: "p" type: "PriorBox" bottom: "f" bottom: "img" top: "p" prior_box_param {{ {sizes} '
               'aspect_ratio: 0.5 aspect_ratio: 2.0 aspect_ratio: 3.0 flip: true clip: false variance: 0.1 '
               'variance: 0.1 variance: 0.2 variance: 0.2 step: 12 offset: 0.5 } }',
               'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "p" top: "det" '
               'detection_output_param { num_classes: 2 nms_param { nms_threshold: 0.3 top_k: 20 } keep_top_k: 10 '
               'confidence_threshold: 0.5 } }',
               inputs={"img": (1, 3, *img), "f": (1, 4, lh, lw), "loc": (1, lh * lw * per_cell * 4),
                       "conf": (1, lh * lw * per_cell * 2)})
    model = load_from_text(text, outputs=["p", "det"])
    assert any("PriorBox read as SSTD's" in w for w in model.warnings)
    r = np.random.default_rng(6)
    x = {k: r.standard_normal(s).astype(np.float32) for k, s in model.inputs.items()}
    want = ref_sstd_priors([7.68, 17.92], [30, 44.5] if max_size else [], [0.5, 2.0, 3.0], True, lh, lw, *img, 12,
                           0.5, [0.1, 0.1, 0.2, 0.2])
    for backend, got in backends(model, x, tmp_path, ("p",)).items():
        np.testing.assert_array_equal(got["p"], want, err_msg=backend)


def test_bdig_use_default_false_leaves_out_the_square_boxes(tmp_path):
    # 03100076/BDIG's PriorBox: use_default: false skips each min_size's aspect-ratio-1 box and declares
    # (ratios incl. flips) x min_sizes priors; otherwise its code is SSD's, whose priors are checked against Caffe
    def prior_net(extra):
        return net('layer { name: "p" type: "PriorBox" bottom: "f" bottom: "img" top: "p" prior_box_param { '
                   f'min_size: 16 min_size: 24 aspect_ratio: 2 aspect_ratio: 0.5 flip: false step: 8 {extra}}} }}',
                   inputs={"img": (1, 3, 40, 24), "f": (1, 4, 5, 3)})
    ssd = load_from_text(prior_net(""))
    bdig = load_from_text(prior_net("use_default: false "))
    assert bdig.blob_shapes["p"] == (1, 2, 5 * 3 * 2 * 2 * 4) and ssd.blob_shapes["p"] == (1, 2, 5 * 3 * 2 * 3 * 4)
    x = {"img": np.zeros((1, 3, 40, 24), np.float32), "f": np.zeros((1, 4, 5, 3), np.float32)}
    full = ssd.run(x)["p"].reshape(2, 15, 2, 3, 4)   # cells, min sizes, (square, 2, 0.5), corners
    want = full[:, :, :, 1:].reshape(1, 2, -1)
    for backend, got in backends(bdig, x, tmp_path, ("p",)).items():
        np.testing.assert_array_equal(got["p"], want, err_msg=backend)
    for bad in ("max_size: 20 max_size: 30 use_default: false ", "aspect_ratio: 1 use_default: false "):
        with pytest.raises(CaffeqError, match="use_default: false"):
            load_from_text(prior_net(bad))


# ---- LargeMarginInnerProduct ------------------------------------------------------------------------

def lm_net(param, tops=("o", "lam")):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    layer = (f'layer {{ name: "ip" type: "LargeMarginInnerProduct" bottom: "x" bottom: "label" {top_text} '
             f'largemargin_inner_product_param {{ {param} }} }}')
    return net(layer, inputs={"x": (3, 4, 2, 5), "label": (3, 1, 1, 1)})


def test_large_margin_single_matches_the_fork(tmp_path):
    model = load_from_text(lm_net("num_output: 6 type: SINGLE base: 2 gamma: 0.5 power: 2 iteration: 3 "
                                  "lambda_min: 0.01"), random_weights=True)
    assert model.blob_shapes["o"] == (3, 6) and model.blob_shapes["lam"] == (1,)
    r = np.random.default_rng(9)
    x = {"x": r.standard_normal((3, 4, 2, 5)).astype(np.float32), "label": np.zeros((3, 1, 1, 1), np.float32)}
    weight = model.params["ip"][0]
    assert weight.shape == (6, 40)
    want = x["x"].reshape(3, 40).astype(np.float64) @ weight.astype(np.float64).T   # cpp:182, no bias
    lam = max(2 * (1 + 0.5 * 4) ** -2, 0.01)                                       # first forward: iter 4
    for backend, got in backends(model, x, tmp_path, ("o", "lam")).items():
        np.testing.assert_allclose(got["o"], want, rtol=1e-5, atol=1e-5, err_msg=backend)
        np.testing.assert_allclose(got["lam"], [lam], rtol=1e-6, err_msg=backend)


def test_large_margin_training_types_read_and_size_but_do_not_run(tmp_path):
    # liyantett's micro-expression train nets: type DOUBLE sizes as SINGLE; running needs the label's margin
    model = load_from_text(lm_net("num_output: 6 type: QUADRUPLE"), random_weights=True)
    assert model.blob_shapes["o"] == (3, 6) and model.blob_shapes["lam"] == (1,)
    refusal = r"layer 'ip' \(LargeMarginInnerProduct\): largemargin_inner_product_param.type QUADRUPLE mixes"
    feeds = {"x": np.zeros((3, 4, 2, 5), np.float32), "label": np.zeros((3, 1, 1, 1), np.float32)}
    with pytest.raises(CaffeqError, match=refusal):
        model.run(feeds)
    with pytest.raises(CaffeqError, match=refusal):
        model.export_onnx(str(tmp_path / "m.onnx"))
    with pytest.raises(CaffeqError, match=refusal):
        model.export_pytorch(str(tmp_path / "py"))


# ---- SSD_windows_caffe's NO_SQRT PriorBox -------------------------------------------------------

def ref_no_sqrt_priors(min_sizes, ratios, lh, lw, ih, iw, step, offset, variance):
    """dreadlord1984/SSD_windows_caffe prior_box_layer.cpp Forward_cpu built with NO_SQRT: per cell and
    min_size (read as int), the min_size box, then one box per aspect ratio other than 1 (no
    sqrt(min_size * max_size) box); float centres, double corners, float out."""
    f = np.float32
    coords = []
    for h in range(lh):
        for w in range(lw):
            cx, cy = f((w + f(offset)) * f(step)), f((h + f(offset)) * f(step))
            for mn in min_sizes:
                boxes = [(float(int(mn)), float(int(mn)))]
                boxes += [(float(f(int(mn) * f(np.sqrt(f(ar))))), float(f(int(mn) / f(np.sqrt(f(ar))))))
                          for ar in ratios]
                for bw, bh in boxes:
                    coords += [(float(cx) - bw / 2.0) / iw, (float(cy) - bh / 2.0) / ih,
                               (float(cx) + bw / 2.0) / iw, (float(cy) + bh / 2.0) / ih]
    coords = np.array(coords, np.float64).astype(np.float32)
    var = np.tile(np.array(variance, np.float32), len(coords) // len(variance))
    return np.stack([coords, var]).reshape(1, 2, -1)


def no_sqrt_net(per_cell, img=(60, 44), feat=(5, 4)):
    priors = feat[0] * feat[1] * per_cell
    return net('layer { name: "p" type: "PriorBox" bottom: "f" bottom: "img" top: "p" prior_box_param { '
               'min_size: 15 max_size: 25 min_size: 25.5 max_size: 51 aspect_ratio: 0.5 aspect_ratio: 2 flip: false '
               'clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 step: 12 } }',
               'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "p" top: "det" '
               'detection_output_param { num_classes: 2 nms_param { nms_threshold: 0.45 top_k: 20 } keep_top_k: 10 '
               'confidence_threshold: 0.3 } }',
               inputs={"img": (1, 3, *img), "f": (1, 2, *feat), "loc": (1, priors * 4), "conf": (1, priors * 2)})


def test_no_sqrt_priors_are_read_when_the_predictions_need_them(tmp_path):
    # 2 min_size x (1 + 2 ratios) = 6 priors a cell; SSD's own reading has 8 (one sqrt box per max_size)
    model = load_from_text(no_sqrt_net(6), outputs=["p", "det"])
    assert any("NO_SQRT" in w for w in model.warnings)
    r = np.random.default_rng(7)
    x = {k: r.standard_normal(s).astype(np.float32) for k, s in model.inputs.items()}
    want = ref_no_sqrt_priors([15, 25.5], [0.5, 2.0], 5, 4, 60, 44, 12, 0.5, [0.1, 0.1, 0.2, 0.2])
    for backend, got in backends(model, x, tmp_path, ("p",)).items():
        np.testing.assert_array_equal(got["p"], want, err_msg=backend)
    ssd = load_from_text(no_sqrt_net(8))
    assert not any("NO_SQRT" in w for w in ssd.warnings) and ssd.blob_shapes["p"] == (1, 2, 5 * 4 * 8 * 4)
    with pytest.raises(CaffeqError, match=r"loc \[1, \d+\] does not hold"):
        load_from_text(no_sqrt_net(7))
