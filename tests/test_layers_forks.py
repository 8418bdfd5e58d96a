"""Fork layers beyond the reference cases: SSD (Permute, Normalize, PriorBox,
DetectionOutput), Interp, Upsample, ShuffleChannel, ROIPooling, PSROIPooling.

References are numpy re-derivations written here from the forks' formulas
(loops, float64 where the fork's float32 rounding cannot change the result),
hand-computed examples, and the OpenCV-made reference case fork_ssd_mini.
"""
import math

import numpy as np
import pytest
import torch
from conftest import (
    FIXTURES,
    Case,
    assert_close,
    backend_outputs,
    check_everywhere,
    fast_rcnn_bins,
    net,
    node_of,
    onnx_outputs,
    rng,
)

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text


def run(text, feeds, **kw):
    model = load_from_text(text, **kw)
    return model, model.run(feeds, all_blobs=True)


# ---- Permute ------------------------------------------------------------------------

@pytest.mark.parametrize("order, full", [((0, 2), (0, 2, 1, 3)), ((3,), (3, 0, 1, 2)), ((1, 0), (1, 0, 2, 3)),
                                         ((0, 1, 2, 3), (0, 1, 2, 3)), ((0, 3, 1, 2), (0, 3, 1, 2))])
def test_permute_partial_order_appends_the_other_axes(order, full):
    x = rng().standard_normal((2, 3, 4, 5)).astype(np.float32)
    orders = " ".join(f"order: {o}" for o in order)
    m, got = run(net(f'layer {{ name: "p" type: "Permute" bottom: "x" top: "p" permute_param {{ {orders} }} }}',
                     inputs={"x": x.shape}), {"x": x})
    np.testing.assert_array_equal(got["p"], np.transpose(x, full))
    assert m.blob_shapes["p"] == tuple(x.shape[i] for i in full)


@pytest.mark.parametrize("params, msg", [("order: 0 order: 0", "duplicate"), ("order: 4", "out of range")])
def test_permute_bad_order(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "p" type: "Permute" bottom: "x" top: "p" permute_param {{ {params} }} }}',
                           inputs={"x": (2, 3, 4, 5)}))


# ---- Normalize ------------------------------------------------------------------------

def normalize_ref(x, scale, across_spatial, eps=1e-10):
    x = x.astype(np.float64)
    axes = tuple(range(1, x.ndim)) if across_spatial else (1,)
    y = x / np.sqrt((x ** 2).sum(axis=axes, keepdims=True) + eps)
    s = np.asarray(scale, np.float64)
    return y * (s if s.ndim == 0 else s.reshape((1, -1) + (1,) * (x.ndim - 2)))


@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_normalize_variants(across, shared):
    x = rng(1).standard_normal((2, 4, 3, 5)).astype(np.float32)
    text = net(f'layer {{ name: "n" type: "Normalize" bottom: "x" top: "n" norm_param {{ '
               f'across_spatial: {str(across).lower()} channel_shared: {str(shared).lower()} }} }}',
               inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "n")
    assert node.expected_param_shapes == [() if shared else (4,)]
    np.testing.assert_array_equal(node.blobs[0], np.ones(node.expected_param_shapes[0], np.float32))  # filler 1
    scale = np.float32(2.5) if shared else np.array([0.5, 1.0, 2.0, 3.0], np.float32)
    node.blobs = [np.asarray(scale, np.float32).reshape(node.expected_param_shapes[0])]
    got = model.run({"x": x})["n"]
    assert_close(got, normalize_ref(x, scale, across), 1e-6, 1e-6, "normalize")


def test_normalize_reads_a_zero_axis_scale_blob(tmp_path):
    """channel_shared: SSD saves the scale as a 0-axis blob, which Caffe writes with no shape field."""
    from caffeq.io.schema import caffe_pb2
    np_ = caffe_pb2.NetParameter()
    lp = np_.layer.add()
    lp.name, lp.type = "n", "Normalize"
    lp.blobs.add().data.append(3.0)   # no shape: 0 axes
    (tmp_path / "w.caffemodel").write_bytes(np_.SerializeToString())
    x = rng(2).standard_normal((2, 3, 4, 4)).astype(np.float32)
    text = net('layer { name: "n" type: "Normalize" bottom: "x" top: "n" norm_param { across_spatial: false } }',
               inputs={"x": x.shape})
    _, got = run(text, {"x": x}, weights=str(tmp_path / "w.caffemodel"))
    assert_close(got["n"], normalize_ref(x, np.float32(3.0), False), 1e-6, 1e-6, "normalize shared")


def test_normalize_eps_and_2d_input():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    text = net('layer { name: "n" type: "Normalize" bottom: "x" top: "n" norm_param { eps: 0.0001 } }',
               inputs={"x": x.shape})
    _, got = run(text, {"x": x}, random_weights=True)
    np.testing.assert_allclose(got["n"], [[3 / math.sqrt(25.0001), 4 / math.sqrt(25.0001)], [0, 0]], rtol=1e-6)


def test_normalize_bad_params():
    with pytest.raises(LayerError, match="eps"):
        load_from_text(net('layer { name: "n" type: "Normalize" bottom: "x" top: "n" norm_param { eps: -1 } }',
                           inputs={"x": (1, 2, 3, 3)}))
    with pytest.raises(LayerError, match="2- to 4-axis"):
        load_from_text(net('layer { name: "n" type: "Normalize" bottom: "x" top: "n" }',
                           inputs={"x": (1, 2, 3, 3, 3)}))


# ---- PriorBox -------------------------------------------------------------------------

def priorbox_ref(fh, fw, ih, iw, min_sizes, max_sizes=(), ratios=(), flip=True, clip=False,
                 variance=(0.1,), step=None, offset=0.5, img=None):
    """SSD's PriorBox, re-derived as loops from its formulas (float64, then float32)."""
    ars = [1.0]
    for r in ratios:
        if any(abs(r - a) < 1e-6 for a in ars):
            continue
        ars.append(r)
        if flip:
            ars.append(1.0 / r)
    if img:
        ih, iw = img
    sh, sw = (step, step) if step else (ih / fh, iw / fw)
    out = []
    for h in range(fh):
        for w in range(fw):
            cx, cy = (w + offset) * sw, (h + offset) * sh
            for k, mn in enumerate(min_sizes):
                mn = int(mn)
                shapes = [(mn, mn)]
                if max_sizes:
                    s = math.sqrt(mn * int(max_sizes[k]))
                    shapes.append((s, s))
                shapes += [(mn * math.sqrt(a), mn / math.sqrt(a)) for a in ars if abs(a - 1) >= 1e-6]
                for bw, bh in shapes:
                    out += [(cx - bw / 2) / iw, (cy - bh / 2) / ih, (cx + bw / 2) / iw, (cy + bh / 2) / ih]
    coords = np.array(out)
    if clip:
        coords = np.clip(coords, 0, 1)
    var = np.tile(np.array(variance), len(out) // len(variance))
    return np.stack([coords, var]).reshape(1, 2, -1).astype(np.float32)


PRIORBOX_VARIANTS = [
    # (prior_box_param text, reference kwargs)
    (("min_size: 10 max_size: 20 aspect_ratio: 2 aspect_ratio: 3 flip: true clip: false "
     "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 step: 4"),
     {"min_sizes": [10], "max_sizes": [20], "ratios": [2, 3], "variance": (0.1, 0.1, 0.2, 0.2), "step": 4}),
    ("min_size: 10 aspect_ratio: 2 flip: false clip: true",
     {"min_sizes": [10], "ratios": [2], "flip": False, "clip": True}),
    ("min_size: 8 min_size: 16 aspect_ratio: 2 aspect_ratio: 2 aspect_ratio: 0.5 variance: 0.2",
     {"min_sizes": [8, 16], "ratios": [2, 2, 0.5], "variance": (0.2,)}),
    ("min_size: 6.7 max_size: 12.9 aspect_ratio: 3 offset: 0.25 img_h: 40 img_w: 30 step_h: 5 step_w: 3",
     {"min_sizes": [6.7], "max_sizes": [12.9], "ratios": [3], "offset": 0.25, "img": (40, 30)}),
    ("min_size: 30", {"min_sizes": [30]}),   # SSD's clip default: false (boxes leave [0, 1])
]


@pytest.mark.parametrize("params, kw", PRIORBOX_VARIANTS)
def test_priorbox_against_the_formulas(params, kw):
    fh, fw, ih, iw = 5, 7, 30, 45
    text = net(f'layer {{ name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "pb" '
               f'prior_box_param {{ {params} }} }}', inputs={"f": (2, 3, fh, fw), "img": (2, 3, ih, iw)})
    feeds = {"f": np.zeros((2, 3, fh, fw), np.float32), "img": np.zeros((2, 3, ih, iw), np.float32)}
    model, got = run(text, feeds)
    if "step_h" in params:   # step_h/step_w: separate steps, reference takes one: recompute here
        kw = dict(kw)
        ref = _priorbox_ref_hw(fh, fw, kw.pop("img"), 5.0, 3.0, **kw)
    else:
        ref = priorbox_ref(fh, fw, ih, iw, **kw)
    assert model.blob_shapes["pb"] == ref.shape
    assert_close(got["pb"], ref, 1e-6, 1e-6, "priorbox")
    if "clip: true" not in params and "min_size: 30" in params:
        assert got["pb"][0, 0].min() < 0 and got["pb"][0, 0].max() > 1   # not clipped by default
    # one set of priors whatever the batch
    single = model.run({k: v[:1] for k, v in feeds.items()})["pb"]
    np.testing.assert_array_equal(single, got["pb"])


@pytest.mark.parametrize("max_size", [30, 20])
def test_priorbox_max_size_not_above_min_size_reads_as_ssds_2016_code(max_size):
    # lzx1413/CAFFE_SSD's early VOC0712 test net (weiliu89's 2016 history): min_size 600 max_size 600; that
    # code checked only max_size > 0, the sqrt(min x max) prior as written
    fh, fw, ih, iw = 5, 7, 30, 45
    text = net(f'layer {{ name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "pb" prior_box_param {{ '
               f'min_size: 30 max_size: {max_size} aspect_ratio: 2 }} }}', inputs={"f": (1, 3, fh, fw), "img": (1, 3, ih, iw)})
    model, got = run(text, {"f": np.zeros((1, 3, fh, fw), np.float32), "img": np.zeros((1, 3, ih, iw), np.float32)})
    assert_close(got["pb"], priorbox_ref(fh, fw, ih, iw, [30], [max_size], [2.0]), 1e-6, 1e-6, "priorbox")
    assert any("which SSD's 2016 code accepted" in w for w in model.warnings)


def _priorbox_ref_hw(fh, fw, img, step_h, step_w, min_sizes, max_sizes, ratios, offset):
    ih, iw = img
    ars = [1.0] + [r for a in ratios for r in (a, 1.0 / a)]
    out = []
    for h in range(fh):
        for w in range(fw):
            cx, cy = (w + offset) * step_w, (h + offset) * step_h
            mn, mx = int(min_sizes[0]), int(max_sizes[0])
            s = math.sqrt(mn * mx)
            for bw, bh in [(mn, mn), (s, s)] + [(mn * math.sqrt(a), mn / math.sqrt(a)) for a in ars[1:]]:
                out += [(cx - bw / 2) / iw, (cy - bh / 2) / ih, (cx + bw / 2) / iw, (cy + bh / 2) / ih]
    return np.stack([np.array(out), np.full(len(out), 0.1)]).reshape(1, 2, -1).astype(np.float32)


@pytest.mark.parametrize("params, msg", [
    ("aspect_ratio: 2", "min_size is required"),
    ("min_size: 10 max_size: -5", "max_size must be positive"),
    ("min_size: 10 min_size: 20 max_size: 30", "one per min_size"),
    ("min_size: 10 variance: 0.1 variance: 0.2", "1 or 4"),
    ("min_size: 10 variance: -0.1", "positive"),
    ("min_size: 10 step: 4 step_h: 2 step_w: 2", "not both"),
    ("min_size: 10 img_size: 300 img_h: 30 img_w: 30", "not both"),
    ("min_size: 10 width: 3", "OpenCV-only"),
])
def test_priorbox_bad_params(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "pb" '
                           f'prior_box_param {{ {params} }} }}', inputs={"f": (1, 3, 4, 4), "img": (1, 3, 32, 32)}))


# ---- DetectionOutput ------------------------------------------------------------------

def detection_ref(loc, conf, prior, num_classes, share_location=True, background=0, nms=0.3, top_k=-1,
                  eta=1.0, keep_top_k=-1, conf_threshold=-np.inf, code="CORNER", var_in_target=False):
    """SSD's DetectionOutput as plain loops over boxes (float64)."""
    num, P = loc.shape[0], prior.shape[2] // 4
    L = 1 if share_location else num_classes
    loc = loc.reshape(num, P, L, 4).astype(np.float64)
    conf = conf.reshape(num, P, num_classes).astype(np.float64)
    pb = prior[0, 0].reshape(P, 4).astype(np.float64)
    pv = np.ones((P, 4)) if var_in_target else prior[0, 1].reshape(P, 4).astype(np.float64)

    def decode(p, v, t):
        if code == "CORNER":
            return [p[k] + v[k] * t[k] for k in range(4)]
        pw, ph = p[2] - p[0], p[3] - p[1]
        if code == "CORNER_SIZE":
            return [p[0] + v[0] * t[0] * pw, p[1] + v[1] * t[1] * ph, p[2] + v[2] * t[2] * pw,
                    p[3] + v[3] * t[3] * ph]
        cx = v[0] * t[0] * pw + (p[0] + p[2]) / 2
        cy = v[1] * t[1] * ph + (p[1] + p[3]) / 2
        w, h = math.exp(v[2] * t[2]) * pw, math.exp(v[3] * t[3]) * ph
        return [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]

    def size(b):
        return 0.0 if b[2] < b[0] or b[3] < b[1] else (b[2] - b[0]) * (b[3] - b[1])

    def iou(a, b):
        if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
            return 0.0
        w, h = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
        if w <= 0 or h <= 0:
            return 0.0
        return w * h / (size(a) + size(b) - w * h)

    rows = []
    for i in range(num):
        kept = {}
        for c in range(num_classes):
            if c == background:
                continue
            boxes = [decode(pb[p], pv[p], loc[i, p, 0 if share_location else c]) for p in range(P)]
            cand = sorted((p for p in range(P) if conf[i, p, c] > conf_threshold), key=lambda p: -conf[i, p, c])
            if top_k > -1:
                cand = cand[:top_k]
            thr, keep = nms, []
            for p in cand:
                if all(iou(boxes[p], boxes[q]) <= thr for q in keep):
                    keep.append(p)
                    if eta < 1 and thr > 0.5:
                        thr *= eta
            kept[c] = [(conf[i, p, c], p, boxes[p]) for p in keep]
        if keep_top_k > -1 and sum(map(len, kept.values())) > keep_top_k:
            pool = sorted(((s, c, p, b) for c in sorted(kept) for s, p, b in kept[c]), key=lambda t: -t[0])
            kept = {}
            for s, c, p, b in pool[:keep_top_k]:
                kept.setdefault(c, []).append((s, p, b))
        for c in sorted(kept):
            rows += [[i, c, s] + list(b) for s, p, b in kept[c]]
    if not rows:
        rows = [[i] + [-1] * 6 for i in range(num)]
    return np.array(rows, np.float32).reshape(1, 1, -1, 7)


def detection_text(params, n, P, C, L):
    return net(f'layer {{ name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
               f'top: "det" detection_output_param {{ {params} }} }}',
               inputs={"loc": (n, P * L * 4), "conf": (n, P * C), "prior": (1, 2, P * 4)})


def random_detection_inputs(seed, n, P, C, L, grid=True):
    g = rng(seed)
    # priors on a coarse grid so that boxes overlap and NMS has work to do
    centers = g.uniform(0.2, 0.8, (P, 2)) if not grid else np.round(g.uniform(0.2, 0.8, (P, 2)) * 5) / 5
    wh = g.uniform(0.1, 0.4, (P, 2))
    pbox = np.concatenate([centers - wh / 2, centers + wh / 2], 1)
    var = np.tile([0.1, 0.1, 0.2, 0.2], (P, 1))
    prior = np.stack([pbox.reshape(-1), var.reshape(-1)]).reshape(1, 2, -1).astype(np.float32)
    loc = g.normal(0, 1, (n, P * L * 4)).astype(np.float32)
    logits = g.normal(0, 2, (n, P, C))
    conf = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).reshape(n, -1).astype(np.float32)
    return {"loc": loc, "conf": conf, "prior": prior}


@pytest.mark.parametrize("params", ["keep_top_k: 7 nms_param { nms_threshold: 0.45 top_k: 12 } "
                                    "background_label_id: -1 code_type: CENTER_SIZE confidence_threshold: 0.2",
                                    "nms_param { nms_threshold: 0.3 } confidence_threshold: 0.9999"])
def test_openvino_detection_output_extended_adds_each_rows_cell(params, tmp_path):
    # training_toolbox_caffe's DetectionOutputExtended: SSD's rows (class 1 only, whatever
    # background_label_id says) and then the prior's anchor, x and y on its (H, W, anchors) map
    n, h, w, a = 2, 3, 4, 2
    P = h * w * a
    text = net('layer { name: "det" type: "DetectionOutputExtended" bottom: "loc" bottom: "conf" bottom: "prior" '
               f'top: "det" detection_output_param {{ num_classes: 2 {params} }} }}',
               inputs={"loc": (n, h, w, 4 * a), "conf": (n, P * 2), "prior": (1, 2, P * 4)})
    model = load_from_text(text)
    feeds = random_detection_inputs(6, n, P, 2, 1)
    feeds["loc"] = feeds["loc"].reshape(n, h, w, 4 * a)
    kw = dict(keep_top_k=7, top_k=12, nms=0.45, code="CENTER_SIZE", conf_threshold=0.2) if "keep" in params \
        else dict(nms=0.3, conf_threshold=0.9999)
    base = detection_ref(feeds["loc"], feeds["conf"], feeds["prior"], 2, background=0, **kw)[0, 0]
    rows = []
    for row in base:
        if row[1] < 0:     # no detection: the image's id, then -1
            rows.append(list(row) + [-1, -1, -1])
            continue
        # the prior of the row: the one whose decoded box and score it carries
        conf = feeds["conf"].reshape(n, P, 2)[int(row[0]), :, 1]
        p = int(np.flatnonzero(np.isclose(conf, row[2], rtol=0, atol=1e-7))[0])
        rows.append(list(row) + [p % a, (p // a) % w, p // (a * w)])
    want = np.array(rows, np.float32).reshape(1, 1, -1, 10)
    assert any("background_label_id -1 is not read" in wn for wn in model.warnings) == ("background_label_id" in params)
    assert (want[0, 0, :, 1] >= 0).any() == ("keep_top_k" in params)    # detections, or none at all
    check_everywhere(model, feeds, {"det": want}, tmp_path, atol=1e-5, rtol=1e-5)


def test_detection_output_on_caffes_own_inputs_of_the_ssd_case():
    """DetectionOutput alone, fed the blobs fork_ssd_mini's net computed before it."""
    case = Case(FIXTURES / "fork_ssd_mini")
    ref = case.outputs
    feeds = {"loc": ref["mbox_loc"], "conf": ref["mbox_conf_flatten"], "prior": ref["mbox_priorbox"]}
    text = net('layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
               'top: "det" detection_output_param { num_classes: 3 share_location: true background_label_id: 0 '
               'nms_param { nms_threshold: 0.45 top_k: 100 } code_type: CENTER_SIZE keep_top_k: 20 '
               'confidence_threshold: 0.01 } }',
               inputs={k: v.shape for k, v in feeds.items()})
    model, got = run(text, feeds)
    assert model.blob_shapes["det"] == (1, 1, 40, 7)   # keep_top_k * N: the most rows it can write
    atol, rtol = case.tolerance
    assert_close(got["det"], ref["detection_out"], atol, rtol, "detection_out")
    kw = {"num_classes": 3, "nms": 0.45, "top_k": 100, "keep_top_k": 20, "conf_threshold": 0.01, "code": "CENTER_SIZE"}
    assert_close(detection_ref(feeds["loc"], feeds["conf"], feeds["prior"], **kw), ref["detection_out"],
                 atol, rtol, "numpy re-derivation vs the reference")


def test_detection_output_without_detections_gives_one_row_per_image():
    n, P, C = 3, 6, 4
    feeds = random_detection_inputs(0, n, P, C, 1)
    text = detection_text("num_classes: 4 confidence_threshold: 0.999 keep_top_k: 5 code_type: CENTER_SIZE",
                          n, P, C, 1)
    _, got = run(text, feeds)
    expect = np.full((1, 1, n, 7), -1, np.float32)
    expect[0, 0, :, 0] = np.arange(n)
    np.testing.assert_array_equal(got["det"], expect)


DETECTION_VARIANTS = [
    (("num_classes: 4 nms_param { nms_threshold: 0.3 top_k: 8 } keep_top_k: 10 code_type: CENTER_SIZE "
     "confidence_threshold: 0.05"),
     {"nms": 0.3, "top_k": 8, "keep_top_k": 10, "conf_threshold": 0.05, "code": "CENTER_SIZE"}),
    (("num_classes: 4 share_location: false background_label_id: 1 nms_param { nms_threshold: 0.5 } "
     "code_type: CENTER_SIZE confidence_threshold: 0.1"),
     {"share_location": False, "background": 1, "nms": 0.5, "conf_threshold": 0.1, "code": "CENTER_SIZE"}),
    ("num_classes: 4 nms_param { nms_threshold: 0.2 top_k: 20 } keep_top_k: 7 confidence_threshold: 0.02",
     {"nms": 0.2, "top_k": 20, "keep_top_k": 7, "conf_threshold": 0.02, "code": "CORNER"}),
    (("num_classes: 4 nms_param { nms_threshold: 0.4 } code_type: CORNER_SIZE variance_encoded_in_target: true "
     "background_label_id: -1 confidence_threshold: 0.2"),
     {"nms": 0.4, "code": "CORNER_SIZE", "var_in_target": True, "background": -1, "conf_threshold": 0.2}),
    ("num_classes: 4 nms_param { nms_threshold: 0.9 eta: 0.7 } code_type: CENTER_SIZE confidence_threshold: 0.05",
     {"nms": 0.9, "eta": 0.7, "code": "CENTER_SIZE", "conf_threshold": 0.05}),
    ("num_classes: 4 code_type: CENTER_SIZE", {"nms": 0.3, "code": "CENTER_SIZE"}),   # every default
    # top_k cuts candidates before NMS: 29 rows, where 30 candidates pass top_k and 113 rows come without it
    ("num_classes: 4 nms_param { nms_threshold: 0.45 top_k: 5 } code_type: CENTER_SIZE confidence_threshold: 0.01",
     {"nms": 0.45, "top_k": 5, "code": "CENTER_SIZE", "conf_threshold": 0.01}),
]


@pytest.mark.parametrize("params, kw", DETECTION_VARIANTS)
def test_detection_output_variants(params, kw):
    n, P, C = 2, 30, 4
    L = 1 if kw.get("share_location", True) else C
    feeds = random_detection_inputs(5, n, P, C, L)
    _, got = run(detection_text(params, n, P, C, L), feeds)
    ref = detection_ref(feeds["loc"], feeds["conf"], feeds["prior"], num_classes=C, **kw)
    assert got["det"].shape == ref.shape
    assert_close(got["det"], ref, 1e-5, 1e-5, "detections")


@pytest.mark.parametrize("params, msg", [
    ("share_location: true", "num_classes is required"),
    ("num_classes: 3 nms_param { eta: 1.5 }", "eta"),
    ("num_classes: 3 nms_param { nms_threshold: -0.1 }", "nms_threshold"),
    # OpenCV's pixel boxes (tests/test_layers_opencv_forks97.py) clip to an image bottom and know two codes
    ("num_classes: 3 normalized_bbox: false clip: true", "needs a 4-D 4th bottom"),
    ("num_classes: 3 normalized_bbox: false code_type: CORNER_SIZE", "has no CORNER_SIZE"),
])
def test_detection_output_bad_params(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(detection_text(params, 1, 4, 3, 1))


def test_detection_output_checks_bottom_sizes():
    text = net('layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
               'top: "det" detection_output_param { num_classes: 3 } }',
               inputs={"loc": (1, 16), "conf": (1, 10), "prior": (1, 2, 16)})
    with pytest.raises(LayerError, match="conf"):
        load_from_text(text)


# ---- Interp ---------------------------------------------------------------------------

def interp_ref(x, ho, wo, nearest=False):
    """Align-corners resize, re-derived in float64."""
    _n, _c, h, w = x.shape
    ys = np.arange(ho) * ((h - 1) / (ho - 1) if ho > 1 else 0.0)
    xs = np.arange(wo) * ((w - 1) / (wo - 1) if wo > 1 else 0.0)
    if nearest:
        return x[:, :, np.floor(ys + 0.5).astype(int)][:, :, :, np.floor(xs + 0.5).astype(int)]
    y0 = np.floor(ys).astype(int)
    x0 = np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    ly, lx = (ys - y0)[:, None], xs - x0
    xd = x.astype(np.float64)
    top = xd[:, :, y0][:, :, :, x0] * (1 - lx) + xd[:, :, y0][:, :, :, x1] * lx
    bot = xd[:, :, y1][:, :, :, x0] * (1 - lx) + xd[:, :, y1][:, :, :, x1] * lx
    return top * (1 - ly) + bot * ly


INTERP_VARIANTS = [
    # (interp_param, extra bottoms, crop (beg, end), output size)
    ("zoom_factor: 3", {}, (0, 0), (13, 19)),
    ("height: 4 width: 11", {}, (0, 0), (4, 11)),
    ("shrink_factor: 2", {}, (0, 0), (3, 4)),
    ("shrink_factor: 2 zoom_factor: 3", {}, (0, 0), (7, 10)),
    ("zoom_factor: 2 pad_beg: -1 pad_end: -1", {}, (1, 1), (5, 9)),
    ("height: 1 width: 1", {}, (0, 0), (1, 1)),
    ("height: 5 width: 7", {}, (0, 0), (5, 7)),               # same size: a copy
    ("", {"ref": (1, 1, 8, 3)}, (0, 0), (8, 3)),               # size of the second bottom
    ('height: 9 width: 6 interp_type: "nearest_neighbor"', {}, (0, 0), (9, 6)),
]


@pytest.mark.parametrize("params, extra, crop, out", INTERP_VARIANTS)
def test_interp_variants(params, extra, crop, out):
    x = rng(3).standard_normal((2, 3, 5, 7)).astype(np.float32)
    bottoms = 'bottom: "x"' + "".join(f' bottom: "{k}"' for k in extra)
    text = net(f'layer {{ name: "i" type: "Interp" {bottoms} top: "i" interp_param {{ {params} }} }}',
               inputs={"x": x.shape, **extra})
    feeds = {"x": x, **{k: np.zeros(s, np.float32) for k, s in extra.items()}}
    if "ref" in extra:
        feeds["ref"] = np.zeros((2,) + extra["ref"][1:], np.float32)
    model, got = run(text, feeds)
    assert model.blob_shapes["i"][2:] == out
    b, e = crop
    xc = x[:, :, b:x.shape[2] - e, b:x.shape[3] - e]
    ref = interp_ref(xc, *out, nearest="nearest" in params)
    assert_close(got["i"], ref, 1e-5, 1e-5, "interp")


YOLO_INTERP = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 6 dim: 10 } } }
layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "up" type: "Interp" bottom: "pool" top: "up" interp_param { zoom_factor: 2 } }
layer { name: "route" type: "Concat" bottom: "up" bottom: "data" top: "o" }
"""


def test_yolov3_conversions_interp_zoom_multiplies_where_only_that_fits(tmp_path):
    # Liudadadabao/YOLOv3_Visualizer's yolov3.prototxt: Interp zoom_factor 2 on 13 x 13 joined with 26 x 26
    model = load_from_text(YOLO_INTERP)
    assert model.blob_shapes["up"] == (1, 2, 6, 10)
    assert any("the Interp layers 'up' read as the Interp YOLOv3 conversions run with" in w for w in model.warnings)
    x = rng(43).standard_normal((1, 2, 6, 10)).astype(np.float32)
    pool = x.reshape(1, 2, 3, 2, 5, 2).max(axis=(3, 5))
    ref = np.concatenate([interp_ref(pool, 6, 10), x], axis=1)
    for backend, got in backend_outputs(model, {"data": x}, tmp_path).items():
        assert_close(got, ref, 1e-5, 1e-5, backend)
    # alone, DeepLab's size stays: 3 x 5 zoomed by 2 is 5 x 9
    alone = load_from_text(YOLO_INTERP.split('layer { name: "route"')[0])
    assert alone.blob_shapes["up"] == (1, 2, 5, 9) and not any("YOLOv3" in w for w in alone.warnings)
    # a join that the other reading does not fix either keeps DeepLab's error
    with pytest.raises(CaffeqError, match="bottoms must match except along axis 1"):
        load_from_text(YOLO_INTERP.replace("dim: 6 dim: 10", "dim: 7 dim: 10"))


@pytest.mark.parametrize("ref_shape", [(2, 1, 9, 4), (2, 5, 3, 13)])
def test_cf_caffe_interp_advance_takes_the_second_bottoms_size(ref_shape, tmp_path):
    # xw-hu/CF-Caffe's InterpAdvance: DeepLab's interp2 to bottom 1's height and width, no interp_param read
    x = rng(5).standard_normal((2, 3, 5, 7)).astype(np.float32)
    text = net('layer { name: "i" type: "InterpAdvance" bottom: "x" bottom: "ref" top: "i" '
               'interp_param { zoom_factor: 3 } }', inputs={"x": x.shape, "ref": ref_shape})
    model = load_from_text(text)
    assert model.blob_shapes["i"] == (2, 3) + ref_shape[2:]
    feeds = {"x": x, "ref": np.zeros(ref_shape, np.float32)}
    check_everywhere(model, feeds, {"i": interp_ref(x, *ref_shape[2:]).astype(np.float32)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_interp_zoom_keeps_the_input_on_its_grid():
    x = rng(4).standard_normal((1, 2, 4, 6)).astype(np.float32)
    _, got = run(net('layer { name: "i" type: "Interp" bottom: "x" top: "i" interp_param { zoom_factor: 4 } }',
                     inputs={"x": x.shape}), {"x": x})
    np.testing.assert_allclose(got["i"][:, :, ::4, ::4], x, rtol=0, atol=1e-6)


@pytest.mark.parametrize("params, msg", [
    ("zoom_factor: 2 pad_beg: 1", "<= 0"),
    ("zoom_factor: 0", "zoom_factor"),
    ("height: 3", "needs zoom_factor"),
    ('zoom_factor: 2 interp_type: "bicubic"', "interp_type"),
    ("height: 0 width: 4", "positive"),
])
def test_interp_bad_params(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "i" type: "Interp" bottom: "x" top: "i" interp_param {{ {params} }} }}',
                           inputs={"x": (1, 2, 5, 5)}))


# ---- ShuffleChannel / Upsample -----------------------------------------------------------

def test_shuffle_channel_moves_channel_i_g_j():
    x = rng(5).standard_normal((2, 12, 3, 4)).astype(np.float32)
    _, got = run(net('layer { name: "s" type: "ShuffleChannel" bottom: "x" top: "s" shuffle_channel_param '
                     '{ group: 4 } }', inputs={"x": x.shape}), {"x": x})
    ref = np.empty_like(x)
    for i in range(4):           # group
        for j in range(3):       # channel within the group
            ref[:, j * 4 + i] = x[:, i * 3 + j]
    np.testing.assert_array_equal(got["s"], ref)


def test_shuffle_channel_bad_group():
    with pytest.raises(LayerError, match="divisible"):
        load_from_text(net('layer { name: "s" type: "ShuffleChannel" bottom: "x" top: "s" shuffle_channel_param '
                           '{ group: 5 } }', inputs={"x": (1, 12, 2, 2)}))


def test_upsample_unpools_with_the_mask():
    g = rng(6)
    n, c, h, w = 2, 3, 3, 4
    x = g.standard_normal((n, c, h, w)).astype(np.float32)
    # a max-pooling mask: the argmax of each 2x2 window of a 6x8 map, as an index into that map
    dy, dx = g.integers(0, 2, (n, c, h, w)), g.integers(0, 2, (n, c, h, w))
    mask = ((2 * np.arange(h)[:, None] + dy) * 8 + 2 * np.arange(w)[None, :] + dx).astype(np.float32)
    text = net('layer { name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "u" upsample_param { scale: 2 } }',
               inputs={"x": x.shape, "m": x.shape})
    _model, got = run(text, {"x": x, "m": mask})
    ref = np.zeros((n, c, 6 * 8), np.float32)
    for i in range(n):
        for k in range(c):
            ref[i, k, mask[i, k].astype(int).ravel()] = x[i, k].ravel()
    np.testing.assert_array_equal(got["u"], ref.reshape(n, c, 6, 8))
    # explicit output size and pad_out
    for params, size in [("upsample_h: 7 upsample_w: 9", (7, 9)), ("scale: 2 pad_out_h: true", (5, 8))]:
        m = load_from_text(net(f'layer {{ name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "u" '
                               f'upsample_param {{ {params} }} }}', inputs={"x": x.shape, "m": x.shape}))
        assert m.blob_shapes["u"] == (n, c) + size


def test_upsample_one_bottom_is_nearest():
    x = rng(7).standard_normal((1, 2, 3, 4)).astype(np.float32)
    _, got = run(net('layer { name: "u" type: "Upsample" bottom: "x" top: "u" upsample_param { scale: 3 } }',
                     inputs={"x": x.shape}), {"x": x})
    np.testing.assert_array_equal(got["u"], x.repeat(3, axis=2).repeat(3, axis=3))


def test_cambricon_nearest_neighbour_upsample_to_a_fixed_size(tmp_path):
    """Cambricon/caffe's nearestneighbor_mode: one bottom copied to upsample_h x upsample_w, a whole
    multiple of its size (its MLU test: cpu_top[row * 2 + i][col * 2 + j] = bottom[row][col])."""
    from conftest import backend_outputs
    x = rng(8).standard_normal((2, 3, 3, 5)).astype(np.float32)
    text = net('layer { name: "u" type: "Upsample" bottom: "x" top: "u" upsample_param { nearestneighbor_mode: true '
               'upsample_h: 6 upsample_w: 15 } }', inputs={"x": x.shape})
    model = load_from_text(text)
    want = np.empty((2, 3, 6, 15), np.float32)
    for i in range(6):
        for j in range(15):
            want[:, :, i, j] = x[:, :, i // 2, j // 3]
    assert model.blob_shapes["u"] == (2, 3, 6, 15)
    for backend, got in backend_outputs(model, {"x": x}, tmp_path, "u").items():
        np.testing.assert_array_equal(got, want, err_msg=backend)
    with pytest.raises(LayerError, match="whole multiple"):
        load_from_text(text.replace("upsample_w: 15", "upsample_w: 7"))
    with pytest.raises(LayerError, match="needs both upsample_h and upsample_w"):
        load_from_text(text.replace("upsample_w: 15", ""))


def test_upsample_bad_params_and_mask():
    with pytest.raises(LayerError, match="scale_h == 2"):
        load_from_text(net('layer { name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "u" '
                           'upsample_param { scale: 3 pad_out_h: true } }',
                           inputs={"x": (1, 1, 2, 2), "m": (1, 1, 2, 2)}))
    with pytest.raises(LayerError, match="shaped like"):
        load_from_text(net('layer { name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "u" }',
                           inputs={"x": (1, 1, 2, 2), "m": (1, 1, 2, 3)}))
    m = load_from_text(net('layer { name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "u" }',
                           inputs={"x": (1, 1, 2, 2), "m": (1, 1, 2, 2)}))
    with pytest.raises(LayerError, match="out of range"):
        m.run({"x": np.ones((1, 1, 2, 2), np.float32), "m": np.full((1, 1, 2, 2), 16, np.float32)})


# ---- ROIPooling / PSROIPooling -------------------------------------------------------------

def roi_net(params, rois_shape, x_shape=(2, 1, 4, 6), kind="ROIPooling", field="roi_pooling_param"):
    return net(f'layer {{ name: "r" type: "{kind}" bottom: "x" bottom: "rois" top: "r" {field} {{ {params} }} }}',
               inputs={"x": x_shape, "rois": rois_shape})


def test_roi_pooling_hand_computed():
    x = np.arange(2 * 24, dtype=np.float32).reshape(2, 1, 4, 6)   # x[b, 0, h, w] = 24 b + 6 h + w
    rois = np.array([
        [0, 0, 0, 3, 3],       # 4x4 roi, 2x2 bins of 2x2
        [1, 1, 0, 3, 1],       # 3 wide (bins [0,2) and [1,3): overlapping), 2 high: bins [0,1), [1,2)
        [0, 10, 0, 12, 3],     # right of the map: every bin empty -> 0
        [0, 1.5, 0.5, 2.49, 0.49],   # C round: 1.5 -> 2, 0.5 -> 1, 2.49 -> 2, 0.49 -> 0 (height max(0-1+1, 1)=1)
    ], np.float32)
    _, got = run(roi_net("pooled_h: 2 pooled_w: 2 spatial_scale: 1", rois.shape), {"x": x, "rois": rois})
    v = lambda b, h, w: 24 * b + 6 * h + w
    expect = np.array([
        [[v(0, 1, 1), v(0, 1, 3)], [v(0, 3, 1), v(0, 3, 3)]],
        # roi x 1..3, y 0..1: w bins [1,3) and [2,4); h bins [0,1) and [1,2)
        [[v(1, 0, 2), v(1, 0, 3)], [v(1, 1, 2), v(1, 1, 3)]],
        [[0, 0], [0, 0]],
        # x 2..2 (1 wide, bins [2,3) both), y start 1, height 1: bins [1,2) and [1,2)
        [[v(0, 1, 2), v(0, 1, 2)], [v(0, 1, 2), v(0, 1, 2)]],
    ], np.float32)[:, None]
    np.testing.assert_array_equal(got["r"], expect)


def test_roi_pooling_spatial_scale_rounds_half_away_from_zero():
    x = np.arange(24, dtype=np.float32).reshape(1, 1, 4, 6)
    rois = np.array([[0, 3, 1, 9, 5]], np.float32)   # * 0.5 -> 1.5, 0.5, 4.5, 2.5 -> 2, 1, 5, 3
    _, got = run(roi_net("pooled_h: 1 pooled_w: 1 spatial_scale: 0.5", rois.shape, x.shape), {"x": x, "rois": rois})
    np.testing.assert_array_equal(got["r"].ravel(), [6 * 3 + 5])   # max over rows 1..3, cols 2..5


def test_roi_pooling_bad_params():
    with pytest.raises(LayerError, match="pooled_h"):
        load_from_text(roi_net("pooled_w: 2", (3, 5)))
    # Caffe's Reshape reads only the rois' count; four columns are refused when the layer runs
    narrow = load_from_text(roi_net("pooled_h: 2 pooled_w: 2", (3, 4)))
    with pytest.raises(LayerError, match=r"\(R, 5\)"):
        narrow.run({"x": np.zeros((2, 1, 4, 6), np.float32), "rois": np.zeros((3, 4), np.float32)})
    m = load_from_text(roi_net("pooled_h: 2 pooled_w: 2", (1, 5)))
    with pytest.raises(LayerError, match="batch index"):
        m.run({"x": np.zeros((2, 1, 4, 6), np.float32), "rois": np.array([[5, 0, 0, 1, 1]], np.float32)})


def ref_roi_pool(x, rois, ph, pw, scale, reduce):
    """Fast R-CNN's bins (C-rounded scaled corners, float32 bin sizes) of each roi, each bin reduced by
    `reduce` over its (C, h, w) cells; 0 for an empty bin."""
    f = np.float32
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), np.float32)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        corners = (int(np.sign(v * f(scale)) * np.floor(abs(float(v * f(scale))) + 0.5)) for v in roi[1:5])
        for i, j, hs, he, ws, we in fast_rcnn_bins(*corners, ph, pw, h, w):
            if he > hs and we > ws:
                out[r, :, i, j] = reduce(x[b, :, hs:he, ws:we])
    return out


def ref_roi_max_pool(x, rois, ph, pw, scale):
    """Fast R-CNN's ROIPoolForward: the max over each bin from -FLT_MAX (a bin of -inf values keeps it)."""
    return ref_roi_pool(x, rois, ph, pw, scale,
                        lambda cells: np.maximum(cells.max(axis=(1, 2)), -np.finfo(np.float32).max))


def test_roi_pooling_max_over_many_rois_matches_fast_rcnn(tmp_path):
    # every roi of an image pooled at once (a table of maxima over 2^a x 2^b windows): rois from one cell
    # to past the whole map, inside and outside it, on both images, with ties planted
    from conftest import model_py_outputs
    x_shape = (2, 3, 13, 17)
    g = rng(12)
    x = np.round(g.standard_normal(x_shape) * 4).astype(np.float32)   # many ties
    x[1, 2] = -np.inf
    corners = g.uniform(-20, 45, (80, 4)).astype(np.float32)
    rois = np.concatenate([g.integers(0, 2, (80, 1)).astype(np.float32),
                           np.minimum(corners[:, :2], corners[:, 2:]), np.maximum(corners[:, :2], corners[:, 2:])], 1)
    rois[:5] = [[0, 0, 0, 40, 30], [1, 3, 3, 3, 3], [0, 50, 50, 60, 60], [1, -30, -30, -2, -2], [0, 2.5, 1.5, 9.5, 7.5]]
    model = load_from_text(roi_net("pooled_h: 4 pooled_w: 3 spatial_scale: 0.5", rois.shape, x_shape))
    ref = ref_roi_max_pool(x, rois, 4, 3, 0.5)
    feeds = {"x": x, "rois": rois}
    np.testing.assert_array_equal(model.run(feeds)["r"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, feeds, tmp_path)["r"], ref)
    np.testing.assert_array_equal(onnx_outputs(model, feeds, tmp_path)["r"], ref)
    # the rois of one image only: its pooled bins are the top as they are
    one = rois.copy()
    one[:, 0] = 1
    np.testing.assert_array_equal(model.run({"x": x, "rois": one})["r"], ref_roi_max_pool(x, one, 4, 3, 0.5))


def test_roi_pooling_table_in_channel_groups_gives_the_same_maxima():
    # a map whose table of maxima would pass the budget is pooled a few channels at a time (the
    # kitti MS-CNN net's 512 x 72 x 240 maps); a small budget forces groups of 2 channels, and 1
    import torch

    from caffeq.layers.roi_pooling import fast_rcnn_bins, floor_log2, range_max_bins

    g = rng(9)
    x = np.round(g.standard_normal((1, 5, 11, 14)) * 3).astype(np.float32)
    x[0, 3, 2:6] = -np.inf
    corners = g.uniform(-5, 30, (30, 4)).astype(np.float32)
    rois = np.concatenate([np.zeros((30, 1), np.float32), np.minimum(corners[:, :2], corners[:, 2:]),
                           np.maximum(corners[:, :2], corners[:, 2:])], 1)
    ref = ref_roi_max_pool(x, rois, 3, 4, 0.5)
    bins = fast_rcnn_bins(torch.from_numpy(rois), 0.5, 3, 4, 11, 14)
    whole = range_max_bins(torch.from_numpy(x[0]), *bins)
    np.testing.assert_array_equal(whole.numpy(), ref)
    hs, he, ws, we = bins   # this map's table of 2^a x 2^b windows, per channel:
    levels = ((int(floor_log2((he - hs).clamp(min=1)).max()) + 1) * (int(floor_log2((we - ws).clamp(min=1)).max()) + 1)
              * 11 * 14)
    for budget in (2 * levels, levels + 1):
        grouped = range_max_bins(torch.from_numpy(x[0]), *bins, budget=budget)
        np.testing.assert_array_equal(grouped.numpy(), whole.numpy())
    assert range_max_bins(torch.from_numpy(x[0]), *bins, budget=levels - 1) is None   # one channel too big


def test_roi_pooling_with_a_gradient_wanted_pools_roi_by_roi_to_the_same_numbers():
    # the table of maxima is filled in place, which autograd cannot follow: a caller that wants the
    # gradient (finetune) gets the roi-by-roi path, with the same numbers and a gradient of one per bin
    import torch

    from caffeq.layers.roi_pooling import roi_max_pool

    g = rng(5)
    x = (np.round(g.standard_normal((1, 2, 9, 11)) * 3) + 0.5).astype(np.float32)   # ties, never 0
    x[0, 1, :4] = -np.inf
    rois = np.array([[0, 0, 0, 20, 16], [0, 4, 2, 9, 7], [0, 30, 30, 40, 40], [0, 1, 1, 5, 4]], np.float32)
    ref = ref_roi_max_pool(x, rois, 3, 2, 0.5)
    xt = torch.from_numpy(x).requires_grad_()
    pooled = roi_max_pool(xt, torch.from_numpy(rois), 3, 2, 0.5)
    np.testing.assert_array_equal(pooled.detach().numpy(), ref)
    pooled.sum().backward()
    # ties share a bin's gradient; an empty bin and a bin held at -FLT_MAX pass none
    counted = np.count_nonzero((ref != 0) & (ref > -np.finfo(np.float32).max))
    assert xt.grad.sum().item() == pytest.approx(counted)


def ref_roi_avg_pool(x, rois, ph, pw, scale):
    """wk910930/ccnn's ROIPoolForwardAve (GPU): the mean over each of Fast R-CNN's bins."""
    return ref_roi_pool(x, rois, ph, pw, scale,
                        lambda cells: cells.sum(axis=(1, 2), dtype=np.float64) / (cells.shape[1] * cells.shape[2]))


def test_roi_pooling_ave_of_ccnn_matches_its_kernel(tmp_path):
    from conftest import model_py_outputs

    x_shape = (2, 3, 7, 9)
    x = rng(4).standard_normal(x_shape).astype(np.float32)
    rois = np.array([[0, 1, 3, 13, 9], [1, 5, 1, 17, 13], [1, -4, -3, 6, 4], [0, 9, 7, 9, 7],
                     [1, 30, 20, 40, 33], [0, 3.5, 2.5, 11, 6]], np.float32)
    model = load_from_text(roi_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 pool: AVE", rois.shape, x_shape))
    ref = ref_roi_avg_pool(x, rois, 3, 2, 0.5)
    assert (ref == 0).any() and (ref != 0).any()    # empty bins and real ones
    feeds = {"x": x, "rois": rois}
    assert_close(model.run(feeds)["r"], ref, 1e-6, 1e-6, "torch")
    assert_close(model_py_outputs(model, feeds, tmp_path)["r"], ref, 1e-6, 1e-6, "model.py")
    for opset in (13, None):   # the same bins as 0/1 masks and two Einsums: the sums in another order
        assert_close(onnx_outputs(model, feeds, tmp_path, opset)["r"], ref, 1e-6, 1e-6, f"onnx opset {opset}")
    # MAX, the default, stays Fast R-CNN's
    maxed = load_from_text(roi_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 pool: MAX", rois.shape, x_shape))
    plain = load_from_text(roi_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5", rois.shape, x_shape))
    np.testing.assert_array_equal(maxed.run(feeds)["r"], plain.run(feeds)["r"])
    with pytest.raises(LayerError, match="cannot be set together"):
        load_from_text(roi_net("pooled_h: 3 pooled_w: 2 pool: AVE pad_ratio: 0.5", rois.shape, x_shape))


def test_psroi_pooling_hand_computed():
    g, dim = 2, 1
    x = np.zeros((1, dim * g * g, 4, 4), np.float32)
    for ch in range(4):
        x[0, ch] = np.arange(16).reshape(4, 4) + 100 * ch
    rois = np.array([[0, 0, 0, 3, 3]], np.float32)   # 4x4 at scale 1: bins of 2x2
    _, got = run(roi_net("spatial_scale: 1 output_dim: 1 group_size: 2", rois.shape, x.shape,
                         kind="PSROIPooling", field="psroi_pooling_param"), {"x": x, "rois": rois})
    # bin (ph, pw) averages channel ph*2+pw over its 2x2 block
    blocks = {(0, 0): [0, 1, 4, 5], (0, 1): [2, 3, 6, 7], (1, 0): [8, 9, 12, 13], (1, 1): [10, 11, 14, 15]}
    expect = np.array([[np.mean(blocks[(p, q)]) + 100 * (p * 2 + q) for q in range(2)] for p in range(2)])
    np.testing.assert_allclose(got["r"][0, 0], expect, rtol=1e-6)


def test_psroi_pooling_sizes_by_the_rois_count_as_r_fcns_reshape():
    # PPR-FCN's test nets declare (1, 4) rois and reshape them before each forward: R-FCN's Reshape
    # reads only their count; running with rows that are not 5 wide is refused then
    text = roi_net("spatial_scale: 1 output_dim: 1 group_size: 2", (3, 4), (1, 4, 4, 4),
                   kind="PSROIPooling", field="psroi_pooling_param")
    model = load_from_text(text)
    assert model.blob_shapes["r"] == (3, 1, 2, 2)
    with pytest.raises(CaffeqError, match=r"rois must be \(R, 5\)"):
        model.run({"x": np.zeros((1, 4, 4, 4), np.float32), "rois": np.zeros((3, 4), np.float32)})


def test_psroi_pooling_bad_channels():
    with pytest.raises(LayerError, match="channels"):
        load_from_text(roi_net("spatial_scale: 1 output_dim: 2 group_size: 2", (1, 5), (1, 4, 4, 4),
                               kind="PSROIPooling", field="psroi_pooling_param"))


# ---- gradients and CUDA ------------------------------------------------------------------------

def test_differentiable_layers_pass_gradients():
    x = rng(8).standard_normal((1, 4, 5, 5)).astype(np.float32)
    text = net('layer { name: "n" type: "Normalize" bottom: "x" top: "n" norm_param { across_spatial: false } }',
               'layer { name: "i" type: "Interp" bottom: "n" top: "i" interp_param { zoom_factor: 2 } }',
               'layer { name: "s" type: "ShuffleChannel" bottom: "i" top: "s" shuffle_channel_param { group: 2 } }',
               'layer { name: "p" type: "Permute" bottom: "s" top: "p" permute_param { order: 0 order: 2 } }',
               inputs={"x": x.shape})
    gm = load_from_text(text, random_weights=True).to_torch()
    xt = torch.from_numpy(x).requires_grad_(True)
    gm(xt).sum().backward()
    assert xt.grad is not None and torch.isfinite(xt.grad).all() and xt.grad.abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fork_layers_on_cuda_match_cpu():
    g = rng(12)
    n, P, C = 2, 30, 4
    det = random_detection_inputs(5, n, P, C, 1)
    feeds = {"x": g.standard_normal((2, 4, 6, 8)).astype(np.float32),
             "rois": np.array([[0, 1, 1, 13, 9], [1, 3, 1, 7, 11]], np.float32), **det}
    text = net(*(layer.replace('name: "o"', f'name: "o{i}"').replace('top: "o"', f'top: "o{i}"')
                 for i, (_, layer, _) in enumerate(ONNX_NETS)),
               'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
               'top: "det" detection_output_param { num_classes: 4 nms_param { nms_threshold: 0.45 top_k: 10 } '
               'keep_top_k: 12 code_type: CENTER_SIZE confidence_threshold: 0.01 } }',
               'layer { name: "ps" type: "PSROIPooling" bottom: "x" bottom: "rois" top: "ps" '
               'psroi_pooling_param { spatial_scale: 0.5 output_dim: 1 group_size: 2 } }',
               inputs={"x": (2, 4, 6, 8), "rois": (2, 5), "loc": (n, P * 4), "conf": (n, P * C),
                       "prior": (1, 2, P * 4)})
    model = load_from_text(text, random_weights=True)
    cpu = model.run(feeds, all_blobs=True)
    gpu = model.run(feeds, all_blobs=True, device="cuda")
    for k, v in cpu.items():
        assert_close(gpu[k], v, 1e-5, 1e-5, f"cuda {k}")


# ---- ONNX ------------------------------------------------------------------------------------

ONNX_NETS = [
    ("permute", 'layer { name: "o" type: "Permute" bottom: "x" top: "o" permute_param { order: 0 order: 3 } }', {}),
    ("normalize", ('layer { name: "o" type: "Normalize" bottom: "x" top: "o" norm_param { across_spatial: false '
                  'channel_shared: false } }'), {}),
    ("normalize_shared", 'layer { name: "o" type: "Normalize" bottom: "x" top: "o" }', {}),
    ("interp_crop", ('layer { name: "o" type: "Interp" bottom: "x" top: "o" interp_param { zoom_factor: 3 '
                    'pad_beg: -1 pad_end: -2 } }'), {}),
    ("interp_hw1", 'layer { name: "o" type: "Interp" bottom: "x" top: "o" interp_param { height: 1 width: 9 } }', {}),
    ("interp_nn", ('layer { name: "o" type: "Interp" bottom: "x" top: "o" interp_param { height: 11 width: 4 '
                  'interp_type: "nearest_neighbor" } }'), {}),
    ("shuffle", 'layer { name: "o" type: "ShuffleChannel" bottom: "x" top: "o" shuffle_channel_param { group: 2 } }',
     {}),
    ("upsample_nn", 'layer { name: "o" type: "Upsample" bottom: "x" top: "o" upsample_param { scale: 2 } }', {}),
    ("priorbox", ('layer { name: "o" type: "PriorBox" bottom: "x" bottom: "x" top: "o" prior_box_param { '
                 'min_size: 2 max_size: 4 aspect_ratio: 2 clip: true } }'), {}),
    ("roipool", ('layer { name: "o" type: "ROIPooling" bottom: "x" bottom: "rois" top: "o" roi_pooling_param { '
                'pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 } }'), {"rois": (4, 5)}),
]


@pytest.mark.parametrize("opset", [13, None])
@pytest.mark.parametrize("name, layer, extra", ONNX_NETS, ids=[n[0] for n in ONNX_NETS])
def test_onnx_matches_torch_at_another_batch(name, layer, extra, opset, tmp_path):
    shape = (2, 4, 6, 8)
    model = load_from_text(net(layer, inputs={"x": shape, **extra}), random_weights=True)
    node = next(n for n in model.layers if n.name == "o")
    if node.blobs:
        node.blobs = [rng(9).uniform(0.5, 2, b.shape).astype(np.float32) for b in node.blobs]
    g = rng(10)
    feeds = {"x": g.standard_normal((3,) + shape[1:]).astype(np.float32)}   # batch 3, not the prototxt's 2
    if "rois" in extra:
        # corners at .5 multiples of 1/scale so that rounding half away from zero matters
        feeds["rois"] = np.array([[0, 1, 1, 13, 9], [2, 3, 1, 7, 11], [1, 0, 0, 20, 20], [2, 5, 4, 5, 4]],
                                 np.float32)
    ours = model.run(feeds)["o"]
    theirs = onnx_outputs(model, feeds, tmp_path, opset)["o"]
    assert theirs.shape == ours.shape
    assert_close(theirs, ours, 1e-5, 1e-5, f"onnx {name}")


def test_onnx_upsample_with_mask(tmp_path):
    g = rng(11)
    x = g.standard_normal((3, 2, 3, 4)).astype(np.float32)
    mask = (g.permutation(6 * 8)[:12].reshape(1, 1, 3, 4) * np.ones((3, 2, 1, 1))).astype(np.float32)
    model = load_from_text(net('layer { name: "o" type: "Upsample" bottom: "x" bottom: "m" top: "o" }',
                               inputs={"x": (1, 2, 3, 4), "m": (1, 2, 3, 4)}))
    feeds = {"x": x, "m": mask}
    assert_close(onnx_outputs(model, feeds, tmp_path)["o"], model.run(feeds)["o"], 0, 0, "onnx unpool")


@pytest.mark.parametrize("params, kw", DETECTION_VARIANTS + [
    ("num_classes: 4 confidence_threshold: 0.999 keep_top_k: 5 code_type: CENTER_SIZE", {})],
    ids=[f"v{i}" for i in range(len(DETECTION_VARIANTS) + 1)])
def test_onnx_detection_output(params, kw, tmp_path):
    n, P, C = 2, 30, 4
    L = 1 if kw.get("share_location", True) else C
    model = load_from_text(detection_text(params, n, P, C, L))
    feeds = random_detection_inputs(5, 3, P, C, L)    # batch 3
    if kw.get("eta", 1) < 1:
        from caffeq.errors import ExportError
        pytest.importorskip("caffeq.backends.onnx_backend")
        with pytest.raises(ExportError, match="eta"):
            model.export_onnx(str(tmp_path / "m.onnx"), optimize=False)
        return
    theirs = onnx_outputs(model, feeds, tmp_path)["det"]
    ours = model.run(feeds)["det"]
    assert theirs.shape == ours.shape
    assert_close(theirs, ours, 1e-5, 1e-5, "onnx detections")


@pytest.mark.parametrize("opset", [13, None])
def test_onnx_ssd_case(opset, tmp_path):
    case = Case(FIXTURES / "fork_ssd_mini")
    got = onnx_outputs(case.load(), case.inputs, tmp_path, opset)
    atol, rtol = case.tolerance
    assert_close(got["detection_out"], case.outputs["detection_out"], atol, rtol, "onnx fork_ssd_mini")


def ref_psroi_pool(x, rois, dim, g, scale):
    """R-FCN's PSROIPoolingForward (psroi_pooling_layer.cu): corners C-rounded, times spatial_scale in
    float32 (the end + 1), sizes at least 0.1, floor / ceil bins clipped to the map, bin (i, j) of output
    channel o the mean of channel (o g + i) g + j over it, 0 for an empty bin."""
    f = np.float32
    _n, _c, h, w = x.shape
    out = np.zeros((len(rois), dim, g, g), np.float32)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        x1, y1, x2, y2 = (float(np.sign(v) * np.floor(abs(float(v)) + 0.5)) for v in roi[1:5])
        sw, sh = f(x1) * f(scale), f(y1) * f(scale)
        ew, eh = f(x2 + 1.0) * f(scale), f(y2 + 1.0) * f(scale)
        bw, bh = max(ew - sw, f(0.1)) / f(g), max(eh - sh, f(0.1)) / f(g)
        for i in range(g):
            hs = min(max(int(np.floor(f(i) * bh + sh)), 0), h)
            he = min(max(int(np.ceil(f(i + 1) * bh + sh)), 0), h)
            for j in range(g):
                ws = min(max(int(np.floor(f(j) * bw + sw)), 0), w)
                we = min(max(int(np.ceil(f(j + 1) * bw + sw)), 0), w)
                if he <= hs or we <= ws:
                    continue
                for o in range(dim):
                    block = x[b, (o * g + i) * g + j, hs:he, ws:we].astype(np.float64)
                    out[r, o, i, j] = block.sum() / ((he - hs) * (we - ws))
    return out


def test_psroi_pooling_matches_r_fcns_kernel_in_torch_onnx_and_model_py(tmp_path):
    dim, g = 2, 3
    x = rng(44).standard_normal((2, dim * g * g, 7, 10)).astype(np.float32)
    rois = np.array([[0, 2, 3, 17, 11],        # inside, bins of unequal cells
                     [1, 0.5, 1.5, 9.49, 6.5],  # C round of halves
                     [1, -6, -4, 5, 3],          # partly outside the map
                     [0, 40, 30, 50, 44],        # outside: every bin empty
                     [1, 7, 5, 7, 5]], np.float32)   # one pixel: sizes below the 0.1 floor
    model = load_from_text(roi_net(f"spatial_scale: 0.625 output_dim: {dim} group_size: {g}", rois.shape, x.shape,
                                   kind="PSROIPooling", field="psroi_pooling_param"))
    ref = ref_psroi_pool(x, rois, dim, g, 0.625)
    assert (ref == 0).all(axis=(1, 2, 3))[3] and (ref != 0).any()
    check_everywhere(model, {"x": x, "rois": rois}, {"r": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_jolibrains_sparse_inner_product_is_the_dense_inner_product(tmp_path):
    """sparse_inner_product_layer.cpp: x (M x K) times the (num_output, K) weights, plus the bias; its dense
    fallback is InnerProduct's forward, and the CSR path computes the same product."""
    x = rng(21).standard_normal((3, 7)).astype(np.float32)
    x[x < 0.5] = 0      # as sparse as a SparseData batch
    model = load_from_text(net('layer { name: "fc" type: "SparseInnerProduct" bottom: "x" top: "y" '
                               'inner_product_param { num_output: 4 } }', inputs={"x": x.shape}), random_weights=True)
    w, b = (np.asarray(v, np.float64) for v in node_of(model, "fc").blobs)
    assert w.shape == (4, 7)
    check_everywhere(model, {"x": x}, {"y": x @ w.T + b}, tmp_path, atol=1e-5, rtol=1e-5)
