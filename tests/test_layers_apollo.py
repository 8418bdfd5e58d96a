"""Baidu Apollo's RPNProposalSSD, RCNNProposal and DFMBPSROIAlign (caffeq/layers/apollo.py).

The references are numpy loops written here from Apollo's TensorRT plugins
(modules/perception/inference/tensorrt/plugins: rpn_proposal_ssd_plugin.cu, rcnn_proposal_plugin.cu,
dfmb_psroi_align_plugin.cu, kernels.cu, nms_cuda.cu), one box / one sample at a time in float32
scalars as the kernels' float, with the kernels' double constants (0.5 * (...), iw + 0.5) in double.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


# ---- references ------------------------------------------------------------------------------------

def ref_decode(box, d):
    w = box[2] - box[0] + F(1)
    h = box[3] - box[1] + F(1)
    cx = F(float(box[0]) + 0.5 * float(w - F(1)))
    cy = F(float(box[1]) + 0.5 * float(h - F(1)))
    px, py = d[0] * w + cx, d[1] * h + cy
    pw, ph = F(np.exp(d[2])) * w, F(np.exp(d[3])) * h
    return [F(float(px) - 0.5 * float(pw - F(1))), F(float(py) - 0.5 * float(ph - F(1))),
            F(float(px) + 0.5 * float(pw - F(1))), F(float(py) + 0.5 * float(ph - F(1)))]


def ref_clip(box, height, width):
    out = []
    for k, v in enumerate(box):
        top = (width if k % 2 == 0 else height) - F(1)
        out.append(F(0) if v < 0 else (top if v > top else v))
    return out


def ref_size_ok(box, mode, min_h, min_w):
    w, h = box[2] - box[0] + F(1), box[3] - box[1] + F(1)
    if mode == 0:
        return not (h < F(min_h) or w < F(min_w))
    return not (h < F(min_h) and w < F(min_w))


def ref_nms(boxes, thresh, top_n):
    keep, gone = [], [False] * len(boxes)
    for i, a in enumerate(boxes):
        if gone[i]:
            continue
        keep.append(i)
        for j in range(i + 1, len(boxes)):
            b = boxes[j]
            iw = max(min(a[2], b[2]) - max(a[0], b[0]) + F(1), F(0))
            ih = max(min(a[3], b[3]) - max(a[1], b[1]) + F(1), F(0))
            inter = iw * ih
            sa = (a[2] - a[0] + F(1)) * (a[3] - a[1] + F(1))
            sb = (b[2] - b[0] + F(1)) * (b[3] - b[1] + F(1))
            if inter / (sa + sb - inter) > F(thresh):
                gone[j] = True
    return keep[:top_n]


def ref_out(rows, top_n, cols):
    out = np.full((top_n, cols), -1, F)
    for i, row in enumerate(rows[:top_n]):
        out[i] = [0, *row]
    return out.reshape(top_n, cols, 1, 1)


def ref_rpn(prob, deltas, info, s):
    a_n = len(s["aw"])
    _n, _c, hh, ww = prob.shape
    height, width = F(int(info.flat[0])), F(int(info.flat[1]))
    cand = []
    for h in range(hh):
        for w in range(ww):
            for a in range(a_n):
                cx, cy = F(w) * F(s["stride"]), F(h) * F(s["stride"])
                half_w, half_h = 0.5 * float(F(s["aw"][a]) - F(1)), 0.5 * float(F(s["ah"][a]) - F(1))
                anchor = [F(float(cx) - half_w), F(float(cy) - half_h), F(float(cx) + half_w), F(float(cy) + half_h)]
                d = [deltas[0, a * 4 + k, h, w] * F(s["std"][k]) + F(s["mean"][k]) for k in range(4)]
                box = ref_decode(anchor, d)
                if s["refine"]:
                    box = ref_clip(box, height, width)
                score = prob[0, a_n + a, h, w]
                if score > F(s["thr"]) and ref_size_ok(box, s["mode"], s["min_h"], s["min_w"]):
                    cand.append((score, box))
    cand = sorted(cand, key=lambda t: -t[0])[:s["cand"]]
    boxes = [b for _, b in cand]
    return ref_out([boxes[i] for i in ref_nms(boxes, s["ov"], s["top"])], s["top"], 5)


def ref_rcnn(prob, bbox, rois, info, s):
    k = s["classes"] + 1
    height, width = F(info.flat[0]), F(info.flat[1])
    n = sum(1 for r in rois.reshape(len(rois), -1) if int(r[0]) == 0)
    cand = []
    for i in range(n):
        p = prob.reshape(len(prob), -1)[i]
        roi = rois.reshape(len(rois), -1)[i, 1:5]
        if F(1) - p[0] < F(s["thr"]):
            continue
        best, cls = -np.finfo(F).max, -1
        for c in range(s["classes"]):
            m = p[c + 1] - F(s["thresholds"][c])
            if m > best:
                best, cls = m, c
        if best < 0:
            continue
        d = [bbox.reshape(len(bbox), -1)[i, (cls + 1) * 4 + j] * F(s["std"][j]) + F(s["mean"][j]) for j in range(4)]
        box = ref_decode(roi, d)
        if s["refine"]:
            box = ref_clip(box, height, width)
        score = p[cls + 1]
        if score > 0 and ref_size_ok(box, s["mode"], s["min_h"], s["min_w"]):
            cand.append((score, box, list(p)))
    cand = sorted(cand, key=lambda t: -t[0])[:s["cand"]]
    keep = ref_nms([b for _, b, _ in cand], s["ov"], s["top"])
    rows = [cand[i][1] + (cand[i][2] if s["score"] else []) for i in keep]
    return ref_out(rows, s["top"], 5 + (k if s["score"] else 0))


def ref_dfmb(x, rois, trans, s):
    n, _c, height, width = x.shape
    dim, gh_n, gw_n, ph_n, pw_n, spp = s["dim"], s["gh"], s["gw"], s["ph"], s["pw"], s["spp"]
    out = np.zeros((len(rois), dim, ph_n, pw_n), F)
    per = dim if trans is None else dim // (trans.shape[1] // 2)
    a, b, pad = F(s["a"]), F(s["b"]), F(s["pad"])
    for r, roi in enumerate(rois.reshape(len(rois), -1).astype(F)):
        bi = int(roi[0])
        if bi < 0 or bi >= n:
            continue
        pad_w, pad_h = (roi[3] - roi[1] + F(1)) * pad, (roi[4] - roi[2] + F(1)) * pad
        sw, sh = (roi[1] - pad_w - b) / a, (roi[2] - pad_h - b) / a
        ew, eh = (roi[3] + pad_w - b) / a, (roi[4] + pad_h - b) / a
        rh, rw = F(max(float(eh - sh), 0.1)), F(max(float(ew - sw), 0.1))
        bh, bw = rh / F(ph_n), rw / F(pw_n)
        sbh, sbw = bh / F(spp), bw / F(spp)
        for ct in range(dim):
            for i in range(ph_n):
                for j in range(pw_n):
                    tx = ty = F(0)
                    if trans is not None:
                        part_h = int(F(i) / F(ph_n) * F(s["part_h"]))
                        part_w = int(F(j) / F(pw_n) * F(s["part_w"]))
                        cls = ct // per
                        tx = trans[r, cls * 2, part_h, part_w] * F(s["tstd"])
                        ty = trans[r, cls * 2 + 1, part_h, part_w] * F(s["tstd"])
                    hstart = int(F(i) * bh + sh + ty * rh)
                    wstart = int(F(j) * bw + sw + tx * rw)
                    gh = min(max(math.floor(F(i) * F(gh_n) / F(ph_n)), 0), gh_n - 1)
                    gw = min(max(math.floor(F(j) * F(gw_n) / F(pw_n)), 0), gw_n - 1)
                    plane = x[bi, (ct * gh_n + gh) * gw_n + gw]
                    total, count = F(0), 0
                    for ih in range(spp):
                        for iw in range(spp):
                            w = F(wstart + (iw + 0.5) * float(sbw))
                            h = F(hstart + (ih + 0.5) * float(sbh))
                            if w <= -1 or w >= width or h <= -1 or h >= height:
                                continue
                            x1, x2, y1, y2 = math.floor(w), math.ceil(w), math.floor(h), math.ceil(h)
                            dx, dy = w - F(x1), h - F(y1)

                            def at(yy, xx):
                                return plane[yy, xx] if 0 <= xx < width and 0 <= yy < height else F(0)

                            total += ((F(1) - dx) * (F(1) - dy) * at(y1, x1) + (F(1) - dx) * dy * at(y2, x1)
                                      + dx * (F(1) - dy) * at(y1, x2) + dx * dy * at(y2, x2))
                            count += 1
                    out[r, ct, i, j] = total / F(count) if count else F(0)
    return out


# ---- nets ------------------------------------------------------------------------------------------

AW, AH = [9.5, 16.0, 27.7], [27.5, 16.0, 9.2]
RPN_SETTINGS = {"aw": AW, "ah": AH, "stride": 8.0, "mean": [0.01, -0.02, 0.05, -0.03], "std": [0.12, 0.09, 0.3, 0.25],
                "mode": 1, "min_h": 7.5, "min_w": 6.5, "thr": 0.3, "refine": True, "cand": 25, "ov": 0.5, "top": 30}


def ssd_param(s, extra=""):
    anchors = " ".join(f"anchor_width: {w} anchor_height: {h}" for w, h in zip(s.get("aw", []), s.get("ah", [])))
    mode = "HEIGHT_OR_WIDTH" if s["mode"] else "HEIGHT_AND_WIDTH"
    return (f'bbox_reg_param {{ {" ".join(f"bbox_mean: {v}" for v in s["mean"])} '
            f'{" ".join(f"bbox_std: {v}" for v in s["std"])} }} '
            f'detection_output_ssd_param {{ {extra} min_size_h: {s["min_h"]} min_size_w: {s["min_w"]} '
            f'min_size_mode: {mode} threshold_objectness: {s["thr"]} '
            f'refine_out_of_map_bbox: {str(s["refine"]).lower()} '
            + (f'heat_map_a: {s["stride"]} gen_anchor_param {{ {anchors} }} ' if "aw" in s else "")
            + f'nms_param {{ overlap_ratio: {s["ov"]} top_n: {s["top"]} max_candidate_n: {s["cand"]} }} }}')


def rpn_layer(s=RPN_SETTINGS, params=None):
    return (f'layer {{ name: "proposal" type: "RPNProposalSSD" bottom: "prob" bottom: "deltas" bottom: "im_info" '
            f'top: "rois" {ssd_param(s) if params is None else params} }}')


def rpn_feeds(h=4, w=5, seed=0):
    g = rng(seed)
    a = len(AW)
    prob = g.random((1, 2 * a, h, w)).astype(F)
    deltas = (g.standard_normal((1, 4 * a, h, w)) * 0.8).astype(F)
    info = np.array([30.7, 37.2, 1, 1, 0, 0], F).reshape(1, 6, 1, 1)
    return {"prob": prob, "deltas": deltas, "im_info": info}


def rpn_net(s=RPN_SETTINGS, h=4, w=5, params=None):
    a = len(AW)
    return net(rpn_layer(s, params), inputs={"prob": (1, 2 * a, h, w), "deltas": (1, 4 * a, h, w),
                                             "im_info": (1, 6, 1, 1)})


@pytest.mark.parametrize("refine, mode", [(True, 1), (False, 0)])
def test_rpn_proposal_ssd_matches_the_plugin(refine, mode, tmp_path):
    s = {**RPN_SETTINGS, "refine": refine, "mode": mode}
    model = load_from_text(rpn_net(s))
    assert model.blob_shapes["rois"] == (30, 5, 1, 1)
    feeds = rpn_feeds()
    ref = ref_rpn(feeds["prob"], feeds["deltas"], feeds["im_info"], s)
    kept = int((ref[:, 0, 0, 0] == 0).sum())
    assert 2 < kept < 25          # NMS and the -1 rows both matter
    check_everywhere(model, feeds, {"rois": ref}, tmp_path, atol=1e-4, rtol=1e-6)


def test_rpn_proposal_ssd_top_n_caps_the_rows(tmp_path):
    s = {**RPN_SETTINGS, "top": 3, "ov": 0.9, "thr": 0.0}
    feeds = rpn_feeds(seed=3)
    ref = ref_rpn(feeds["prob"], feeds["deltas"], feeds["im_info"], s)
    assert (ref[:, 0] == 0).all()
    check_everywhere(load_from_text(rpn_net(s)), feeds, {"rois": ref}, tmp_path, atol=1e-4, rtol=1e-6,
                     opsets=(None,))


def test_rcnn_proposal_with_nothing_left_writes_only_minus_ones(tmp_path):
    s = {**RCNN_SETTINGS, "thresholds": [0.99, 0.99, 0.99]}
    feeds = rcnn_feeds()
    ref = ref_rcnn(feeds["cls"], feeds["bbox"], feeds["rois"], feeds["im_info"], s)
    assert (ref == -1).all()
    check_everywhere(load_from_text(rcnn_net(s)), feeds, {"bboxes": ref}, tmp_path, opsets=(None,))


R, CLASSES = 14, 3
RCNN_SETTINGS = {"classes": CLASSES, "mean": [0.0, 0.01, -0.02, 0.0], "std": [0.1, 0.1, 0.2, 0.2], "mode": 0,
                 "min_h": 5.0, "min_w": 4.0, "thr": 0.3, "thresholds": [0.3, 0.2, 0.4], "refine": True,
                 "score": True, "cand": 8, "ov": 0.4, "top": 10}


def rcnn_net(s=RCNN_SETTINGS, params=None):
    extra = (f'num_class: {s["classes"]} {" ".join(f"threshold: {t}" for t in s["thresholds"])} '
             f'rpn_proposal_output_score: {str(s["score"]).lower()} regress_agnostic: false')
    layer = (f'layer {{ name: "rcnn" type: "RCNNProposal" bottom: "cls" bottom: "bbox" bottom: "rois" '
             f'bottom: "im_info" top: "bboxes" {ssd_param(s, extra) if params is None else params} }}')
    return net(layer, inputs={"cls": (R, CLASSES + 1), "bbox": (R, 4 * (CLASSES + 1)), "rois": (R, 5, 1, 1),
                              "im_info": (1, 6, 1, 1)})


def rcnn_feeds(seed=1):
    g = rng(seed)
    logits = g.standard_normal((R, CLASSES + 1)) * 1.5
    prob = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(F)
    bbox = (g.standard_normal((R, 4 * (CLASSES + 1))) * 0.7).astype(F)
    xy = g.uniform(0, 12, (R, 2))
    wh = g.uniform(4, 14, (R, 2))
    rois = np.concatenate([np.zeros((R, 1)), xy, xy + wh], 1).astype(F)
    rois[-2:] = -1                   # the RPN's unused rows: not image 0's, so not read
    info = np.array([29.5, 33.25, 1, 1, 0, 0], F).reshape(1, 6, 1, 1)
    return {"cls": prob, "bbox": bbox, "rois": rois.reshape(R, 5, 1, 1), "im_info": info}


@pytest.mark.parametrize("score, mode", [(True, 0), (False, 1)])
def test_rcnn_proposal_matches_the_plugin(score, mode, tmp_path):
    s = {**RCNN_SETTINGS, "score": score, "mode": mode}
    model = load_from_text(rcnn_net(s))
    cols = 5 + (CLASSES + 1 if score else 0)
    assert model.blob_shapes["bboxes"] == (10, cols, 1, 1)
    feeds = rcnn_feeds()
    ref = ref_rcnn(feeds["cls"], feeds["bbox"], feeds["rois"], feeds["im_info"], s)
    kept = int((ref[:, 0, 0, 0] == 0).sum())
    assert 1 < kept < 8     # 9 rois pass the filters, 8 candidates, NMS drops one
    check_everywhere(model, feeds, {"bboxes": ref}, tmp_path, atol=1e-4, rtol=1e-6)


DFMB = {"a": 2.0, "b": 0.5, "pad": 0.1, "dim": 2, "gh": 2, "gw": 3, "ph": 3, "pw": 2, "spp": 2, "tstd": 0.1,
        "part_h": 2, "part_w": 3}


def dfmb_net(s=DFMB, trans=False, params=None):
    p = (f'heat_map_a: {s["a"]} heat_map_b: {s["b"]} pad_ratio: {s["pad"]} output_dim: {s["dim"]} '
         f'group_height: {s["gh"]} group_width: {s["gw"]} pooled_height: {s["ph"]} pooled_width: {s["pw"]} '
         f'sample_per_part: {s["spp"]} trans_std: {s["tstd"]} part_height: {s["part_h"]} part_width: {s["part_w"]}')
    layer = ('layer { name: "ps" type: "DFMBPSROIAlign" bottom: "x" bottom: "rois" '
             + ('bottom: "trans" ' if trans else "")
             + f'top: "o" dfmb_psroi_pooling_param {{ {p if params is None else params} }} }}')
    inputs = {"x": (2, s["dim"] * s["gh"] * s["gw"], 6, 7), "rois": (5, 5)}
    if trans:
        inputs["trans"] = (5, 2, s["part_h"], s["part_w"])
    return net(layer, inputs=inputs)


def dfmb_feeds(trans=False, seed=2):
    g = rng(seed)
    x = g.standard_normal((2, DFMB["dim"] * DFMB["gh"] * DFMB["gw"], 6, 7)).astype(F)
    rois = np.array([[0, 1.3, 2.2, 9.7, 8.1], [1, -3.0, 0.4, 5.5, 13.9], [1, 6.0, 3.0, 6.2, 3.1],
                     [-1, -1, -1, -1, -1], [2, 1, 1, 5, 5]], F)
    feeds = {"x": x, "rois": rois}
    if trans:
        feeds["trans"] = (g.standard_normal((5, 2, DFMB["part_h"], DFMB["part_w"])) * 3).astype(F)
    return feeds


@pytest.mark.parametrize("trans", [False, True])
def test_dfmb_psroi_align_matches_the_plugin(trans, tmp_path):
    model = load_from_text(dfmb_net(trans=trans))
    assert model.blob_shapes["o"] == (5, 2, 3, 2)
    feeds = dfmb_feeds(trans)
    ref = ref_dfmb(feeds["x"], feeds["rois"], feeds.get("trans"), DFMB)
    assert (ref[:3] != 0).mean() > 0.7 and not ref[3:].any()   # the rois out of the batch give zeros
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_dfmb_psroi_align_two_classes_of_offsets(tmp_path):
    s = {**DFMB, "dim": 4}
    model = load_from_text(dfmb_net(s, trans=True).replace("dim: 5 dim: 2 dim: 2 dim: 3", "dim: 5 dim: 4 dim: 2 dim: 3"))
    g = rng(5)
    feeds = {"x": g.standard_normal((2, 4 * 6, 6, 7)).astype(F), "rois": dfmb_feeds()["rois"],
             "trans": (g.standard_normal((5, 4, 2, 3)) * 3).astype(F)}
    ref = ref_dfmb(feeds["x"], feeds["rois"], feeds["trans"], s)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(None,))


# ---- parameters and shapes -------------------------------------------------------------------------

def rpn_params(**over):
    s = {**RPN_SETTINGS, **over}
    return ssd_param(s)


@pytest.mark.parametrize("text, msg", [
    (rpn_net(params=rpn_params().replace("bbox_std: 0.25", "")), "4 bbox_mean and 4 bbox_std"),
    (rpn_net(params=rpn_params().replace("heat_map_a: 8.0", "")), "heat_map_a must be one positive"),
    (rpn_net(params=rpn_params().replace("anchor_height: 9.2", "")), "in pairs"),
    (rpn_net(params=rpn_params().replace("top_n: 30", "")), "nms_param.top_n is required"),
    (rpn_net(params=rpn_params(ov=1.5)), "overlap_ratio must be in [0, 1]"),
    (rpn_net(params=rpn_params(cand=0)), "must be >= 1"),
    (rpn_net(params=""), "needs detection_output_ssd_param"),
    (rpn_net(h=4).replace("dim: 1 dim: 6 dim: 4", "dim: 1 dim: 4 dim: 4"), "(1, 6, H, W) for 3 anchors"),
    (rcnn_net().replace("threshold: 0.3", ""), "one value per class (3)"),
    (rcnn_net().replace("dim: 14 dim: 16", "dim: 14 dim: 8"), "bbox_pred must be (14, 16)"),
    (dfmb_net(params="output_dim: 2"), "heat_map_a is required"),
    (dfmb_net(params="heat_map_a: 2 output_dim: 2 sample_per_part: 0"), "sample_per_part must be > 0"),
    (dfmb_net(params="heat_map_a: 0 output_dim: 2"), "heat_map_a must be > 0"),
    (dfmb_net(params="heat_map_a: 1 output_dim: 3 group_height: 2 group_width: 3"), "features must be (N, 18, H, W)"),
    (dfmb_net(trans=True).replace("dim: 5 dim: 2 dim: 2 dim: 3", "dim: 5 dim: 2 dim: 3 dim: 3"),
     "part_height x part_width is 2 x 3"),
])
def test_apollo_layers_refuse_bad_params_and_shapes(text, msg):
    with pytest.raises(LayerError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        load_from_text(text)


def test_apollo_proposals_take_one_image():
    text = rpn_net().replace("dim: 1 dim: 6 dim: 4", "dim: 2 dim: 6 dim: 4").replace(
        "dim: 1 dim: 12 dim: 4", "dim: 2 dim: 12 dim: 4")
    with pytest.raises(LayerError, match="one image per batch"):
        load_from_text(text)


def test_apollo_proto_fields_and_defaults():
    lp = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert lp["detection_output_ssd_param"].number == 24001
    assert lp["dfmb_psroi_pooling_param"].number == 24020
    assert lp["bbox_reg_param"].number == 20150
    d = caffe_pb2.DFMBPSROIPoolingParameter()
    assert (d.trans_std, d.sample_per_part, d.group_height, d.pooled_width, d.part_height) == (F(0.1), 4, 7, 7, 7)
    p = caffe_pb2.DetectionOutputSSDParameter()
    assert (p.num_class, p.min_size_h, p.min_size_mode, p.regress_agnostic, p.bbox_size_add_one) == (1, 2.0, 0, True, True)
    assert caffe_pb2.DetectionOutputSSDParameter.DESCRIPTOR.fields_by_name["min_size_mode"].number == 34
    assert caffe_pb2.NMSSSDParameter.DESCRIPTOR.fields_by_name["max_candidate_n"].number == 5


# ---- a traffic-light detector's head, as Apollo writes it ----------------------------------------

TL_HEAD = """
layer { name: "data" type: "Input" top: "feat" top: "rpn_cls_prob_reshape" top: "rpn_bbox_pred" top: "im_info"
  input_param { shape { dim: 1 dim: 490 dim: 8 dim: 10 } shape { dim: 1 dim: 6 dim: 8 dim: 10 }
                shape { dim: 1 dim: 12 dim: 8 dim: 10 } shape { dim: 1 dim: 6 dim: 1 dim: 1 } } }
layer { type: 'RPNProposalSSD' name: 'proposal' bottom: 'rpn_cls_prob_reshape' bottom: 'rpn_bbox_pred'
  bottom: 'im_info' top: 'rois'
  bbox_reg_param { bbox_mean: 0.000437 bbox_mean: 0.002586 bbox_mean: -0.123953 bbox_mean: -0.081469
                   bbox_std: 0.126770 bbox_std: 0.095741 bbox_std: 0.317300 bbox_std: 0.281042 }
  detection_output_ssd_param { heat_map_a: 8 min_size_h: 6.160560 min_size_w: 6.160560
    min_size_mode: HEIGHT_OR_WIDTH threshold_objectness: 0.200000
    gen_anchor_param { anchor_width: 9.232984 anchor_height: 27.726680 anchor_width: 16.000000
                       anchor_height: 16.000000 anchor_width: 27.712813 anchor_height: 9.237604 }
    refine_out_of_map_bbox: true
    nms_param { overlap_ratio: 0.700000 top_n: 30 max_candidate_n: 300 use_soft_nms: false voting: false
                vote_iou: 0.700000 } } }
layer { type: 'DFMBPSROIAlign' name: 'psroi_rois' bottom: 'feat' bottom: 'rois' top: 'psroi_rois'
  dfmb_psroi_pooling_param { heat_map_a: 8 output_dim: 10 group_height: 7 group_width: 7 pooled_height: 7
                             pooled_width: 7 pad_ratio: 0.000000 sample_per_part: 4 } }
layer { type: "InnerProduct" name: "inner_cls_score_rois" bottom: "psroi_rois" top: "cls_score"
  inner_product_param { num_output: 4 } }
layer { type: "InnerProduct" name: "inner_bbox_pred_rois" bottom: "psroi_rois" top: "bbox_pred"
  inner_product_param { num_output: 16 } }
layer { type: "Softmax" name: "cls_score_softmax" bottom: "cls_score" top: "cls_score_softmax"
  softmax_param { axis: 1 } }
layer { type: 'RCNNProposal' name: 'rcnn_proposal' bottom: 'cls_score_softmax' bottom: 'bbox_pred' bottom: 'rois'
  bottom: 'im_info' top: 'bboxes'
  bbox_reg_param { bbox_mean: 0 bbox_mean: 0 bbox_mean: 0 bbox_mean: 0
                   bbox_std: 0.1 bbox_std: 0.1 bbox_std: 0.2 bbox_std: 0.2 }
  detection_output_ssd_param { num_class: 3 rpn_proposal_output_score: true regress_agnostic: false
    min_size_h: 8.800800 min_size_w: 8.800800 min_size_mode: HEIGHT_OR_WIDTH threshold_objectness: 0.100000
    threshold: 0.1 threshold: 0.1 threshold: 0.1 refine_out_of_map_bbox: true
    nms_param { overlap_ratio: 0.5 top_n: 5 max_candidate_n: 30 use_soft_nms: false voting: false
                vote_iou: 0.6 } } }
"""


def test_apollo_traffic_light_head_reads_and_runs(tmp_path):
    model = load_from_text(TL_HEAD, random_weights=True)
    shapes = model.blob_shapes
    assert shapes["rois"] == (30, 5, 1, 1)
    assert shapes["psroi_rois"] == (30, 10, 7, 7)
    assert shapes["bboxes"] == (5, 9, 1, 1)
    g = rng(7)
    logits = g.standard_normal((1, 6, 8, 10))
    feeds = {"feat": g.standard_normal((1, 490, 8, 10)).astype(F),
             "rpn_cls_prob_reshape": (1 / (1 + np.exp(-logits))).astype(F),
             "rpn_bbox_pred": (g.standard_normal((1, 12, 8, 10)) * 0.3).astype(F),
             "im_info": np.array([64, 80, 1, 1, 0, 0], F).reshape(1, 6, 1, 1)}
    out = model.run(feeds, all_blobs=True)
    check_everywhere(model, feeds, {"bboxes": out["bboxes"]}, tmp_path, atol=1e-4, rtol=1e-5, opsets=(None,))
    rois = out["rois"].reshape(30, 5)
    live = rois[:, 0] == 0
    assert live.any() and (rois[~live] == -1).all() and (rois[live, 3] <= 79).all()
    assert out["bboxes"].shape == (5, 9, 1, 1)
