"""TensorRT's RPROI plugin (caffeq/layers/rproi.py).

The reference is a numpy re-derivation written here from TensorRT's kernels, in loops and float32:
generateAnchors_cpu (C-rounded sides, centre (base - 1) / 2), extractFgScores (channels A..2A-1),
bboxDeltas2Proposals_kernel (order (n, a, h, w), clipping, -inf for small boxes), nmsGpu (stable
descending sort, the best preNmsTop, greedy NMS with the +1 IoU, the output cleared to zeros) and
ROIPoolingForwardKernelAligned (roundf of the scaled corners, float bins, max from -FLT_MAX, empty 0).
"""
import numpy as np
import pytest
from c_reference import c_round
from conftest import check_everywhere, fast_rcnn_bins, net, repeated

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)


def ref_anchors(ratios, scales, base):
    """generateAnchors_cpu: [ctr x, ctr y, w, h] per ratio (outer) and scale (inner)."""
    rows = []
    for r in ratios:
        for s in scales:
            ws = f32(c_round(np.sqrt(f32(base * base) / f32(r))))
            hs = f32(c_round(ws * f32(r)))
            rows.append([f32(base - 1) / 2, f32(base - 1) / 2, ws * f32(s), hs * f32(s)])
    return np.array(rows, f32)


def ref_iou(a, b):
    left, right = max(a[0], b[0]), min(a[2], b[2])
    top, bottom = max(a[1], b[1]), min(a[3], b[3])
    w = max(f32(right - left + f32(1)), f32(0))
    h = max(f32(bottom - top + f32(1)), f32(0))
    inter = f32(w * h)
    sa = f32((a[2] - a[0] + f32(1)) * (a[3] - a[1] + f32(1)))
    sb = f32((b[2] - b[0] + f32(1)) * (b[3] - b[1] + f32(1)))
    return f32(inter / f32(sa + sb - inter))


def ref_rois(scores, deltas, im_info, p):
    n, _, height, width = scores.shape
    anchors = ref_anchors(p["ratios"], p["scales"], p["stride"])
    a = len(anchors)
    info = im_info.reshape(n, 3)
    out = np.zeros((n, 1, p["max_out"], 4), f32)
    for i in range(n):
        boxes, live = [], []
        for k in range(a):
            for y in range(height):
                for x in range(width):
                    cx0 = f32(anchors[k, 0] + f32(x * p["stride"]))
                    cy0 = f32(anchors[k, 1] + f32(y * p["stride"]))
                    aw, ah = anchors[k, 2], anchors[k, 3]
                    dx, dy, dw, dh = (deltas[i, 4 * k + j, y, x] for j in range(4))
                    cx, cy = f32(cx0 + f32(dx * aw)), f32(cy0 + f32(dy * ah))
                    bw, bh = f32(f32(np.exp(dw)) * aw), f32(f32(np.exp(dh)) * ah)
                    raw = [cx - bw / f32(2), cy - bh / f32(2), cx + bw / f32(2), cy + bh / f32(2)]
                    lim = [info[i, 1] - f32(1), info[i, 0] - f32(1)]
                    box = [f32(min(max(v, f32(0)), lim[j % 2])) for j, v in enumerate(raw)]
                    small = f32(p["min_size"]) * info[i, 2]
                    s = scores[i, a + k, y, x]
                    if box[2] - box[0] + f32(1) < small or box[3] - box[1] + f32(1) < small:
                        s = f32(-np.inf)
                    boxes.append(box)
                    live.append(s)
        order = sorted(range(len(live)), key=lambda j: -live[j])[:p["prenms"]]   # stable
        cand = [boxes[j] for j in order]
        kept = []
        for b in cand:
            if len(kept) == p["max_out"]:
                break
            if all(ref_iou(k, b) <= f32(p["iou"]) for k in kept):
                kept.append(b)
        out[i, 0, :len(kept)] = np.array(kept, f32).reshape(-1, 4)
    return out


def ref_pool(fmap, rois, ph, pw, scale):
    n, c, h, w = fmap.shape
    m = rois.shape[2]
    out = np.zeros((n * m, c, ph, pw), f32)
    for i in range(n):
        for r in range(m):
            x1, y1, x2, y2 = (int(c_round(f32(v * f32(scale)))) for v in rois[i, 0, r])
            for pi, pj, hs, he, ws, we in fast_rcnn_bins(x1, y1, x2, y2, ph, pw, h, w):
                region = fmap[i, :, hs:he, ws:we].reshape(c, -1)
                if region.shape[1]:
                    out[i * m + r, :, pi, pj] = np.maximum(region.max(axis=1), -FLT_MAX)
    return out


def rproi_net(n, c, h, w, p, info_shape=None, extra=""):
    a = len(p["ratios"]) * len(p["scales"])
    layer = ('layer { name: "rproi" type: "RPROI" bottom: "prob" bottom: "deltas" bottom: "fmap" '
             'bottom: "im_info" top: "rois" top: "pool5" region_proposal_param { '
             f'feature_stride: {p["stride"]} prenms_top: {p["prenms"]} nms_max_out: {p["max_out"]} '
             f'anchor_ratio_count: {len(p["ratios"])} anchor_scale_count: {len(p["scales"])} '
             f'iou_threshold: {p["iou"]} min_box_size: {p["min_size"]} '
             f'{repeated("anchor_ratio", p["ratios"])} {repeated("anchor_scale", p["scales"])} }} '
             f'roi_pooling_param {{ pooled_h: {p["ph"]} pooled_w: {p["pw"]} spatial_scale: {p["scale"]} {extra}}} }}')
    return net(layer, inputs={"prob": (n, 2 * a, h, w), "deltas": (n, 4 * a, h, w), "fmap": (n, c, h, w),
                              "im_info": info_shape or (n, 3)})


PARAMS = {"stride": 4, "prenms": 30, "max_out": 12, "ratios": [0.5, 2.0], "scales": [2.0], "iou": 0.5,
          "min_size": 4, "ph": 3, "pw": 2, "scale": 0.25}


def feeds(n, c, h, w, p, infos, seed=0, spread=0.5, info_shape=None):
    rng = np.random.default_rng(seed)
    a = len(p["ratios"]) * len(p["scales"])
    return {"prob": rng.random((n, 2 * a, h, w)).astype(f32),
            "deltas": (rng.standard_normal((n, 4 * a, h, w)) * spread).astype(f32),
            "fmap": rng.standard_normal((n, c, h, w)).astype(f32),
            "im_info": np.array(infos, f32).reshape(info_shape or (n, 3))}


def refs(x, p):
    rois = ref_rois(x["prob"], x["deltas"], x["im_info"], p)
    return {"rois": rois, "pool5": ref_pool(x["fmap"], rois, p["ph"], p["pw"], p["scale"])}


def test_anchors_as_tensorrt():
    from caffeq.layers.rproi import rproi_anchors
    got = rproi_anchors([0.5, 1.0, 2.0], [8.0, 16.0, 32.0], 16)
    np.testing.assert_array_equal(got, ref_anchors([0.5, 1.0, 2.0], [8.0, 16.0, 32.0], 16))
    assert got[0].tolist() == [7.5, 7.5, 184.0, 96.0]   # 23 x 12 sides, x 8


def test_rproi_two_images(tmp_path):
    n, c, h, w = 2, 3, 5, 7
    model = load_from_text(rproi_net(n, c, h, w, PARAMS))
    assert model.graph.shape("rois") == (2, 1, 12, 4)
    assert model.graph.shape("pool5") == (24, 3, 3, 2)
    x = feeds(n, c, h, w, PARAMS, [[20, 28, 1.0], [17, 25, 0.5]])
    ref = refs(x, PARAMS)
    assert ref["rois"].any(axis=-1).all()   # NMS stops at nms_max_out rows in both images
    check_everywhere(model, x, ref, tmp_path, atol=1e-4, rtol=1e-5)


def test_rproi_small_boxes_and_padding(tmp_path):
    """prenms_top above A x H x W reads them all; the small boxes (-inf) still pass NMS when there is
    room; every row after the kept ones is zero and pools cell (0, 0)."""
    p = {**PARAMS, "prenms": 500, "max_out": 60, "min_size": 9, "iou": 0.3, "ratios": [1.0], "scales": [1.5, 3.0],
         "ph": 2, "pw": 3, "scale": 0.5}
    n, c, h, w = 1, 4, 3, 6
    info_shape = (1, 1, 1, 3)
    model = load_from_text(rproi_net(n, c, h, w, p, info_shape=info_shape))
    x = feeds(n, c, h, w, p, [[12, 23, 1.0]], seed=3, info_shape=info_shape)
    ref = refs(x, p)
    assert (ref["rois"][0, 0, -1] == 0).all()
    check_everywhere(model, x, ref, tmp_path, atol=1e-4, rtol=1e-5)


def test_rproi_ties_keep_tensorrt_order(tmp_path):
    """Equal scores: the lower index of the (a, h, w) order first (py-faster-rcnn's is (h, w, a),
    higher first); no deltas, so the boxes are the anchors."""
    p = {**PARAMS, "prenms": 40, "max_out": 7, "iou": 0.1, "min_size": 1}
    n, c, h, w = 1, 2, 4, 5
    model = load_from_text(rproi_net(n, c, h, w, p))
    x = feeds(n, c, h, w, p, [[16, 20, 1.0]], seed=1)
    x["prob"][:] = 0.5
    x["deltas"][:] = 0
    ref = refs(x, p)
    first = ref["rois"][0, 0, 0]
    assert first.tolist() == [0.0, 0.0, 7.5, 4.5]   # anchor 0 (12 x 6) on cell (0, 0), clipped
    check_everywhere(model, x, ref, tmp_path, atol=1e-5)


@pytest.mark.parametrize("region, roi, msg", [
    ("feature_stride: 16 nms_max_out: 5 anchor_ratio: 1 anchor_scale: 1", "pooled_h: 2 pooled_w: 2",
     r"region_proposal_param.prenms_top must be >= 1"),
    ("feature_stride: 16 prenms_top: 70000 nms_max_out: 5 anchor_ratio: 1 anchor_scale: 1", "pooled_h: 2 pooled_w: 2",
     r"prenms_top must be below 65536"),
    ("feature_stride: 16 prenms_top: 10 nms_max_out: 5 anchor_ratio_count: 2 anchor_ratio: 1 anchor_scale: 1",
     "pooled_h: 2 pooled_w: 2", r"anchor_ratio_count is 2 but 1 anchor_ratio values"),
    ("feature_stride: 16 prenms_top: 10 nms_max_out: 5 anchor_ratio: 0 anchor_scale: 1", "pooled_h: 2 pooled_w: 2",
     r"anchor_ratio values must be positive"),
    ("feature_stride: 16 prenms_top: 10 nms_max_out: 5 anchor_ratio: 1 anchor_scale: 1", "pooled_h: 2",
     r"roi_pooling_param.pooled_h and pooled_w must be > 0"),
    ("feature_stride: 16 prenms_top: 10 nms_max_out: 5 anchor_ratio: 1 anchor_scale: 1",
     "pooled_h: 2 pooled_w: 2 pad_ratio: 0.1", r"pad_ratio is not a field of TensorRT's ROIPoolingParameter"),
])
def test_rproi_parameter_errors(region, roi, msg):
    text = net('layer { name: "r" type: "RPROI" bottom: "prob" bottom: "deltas" bottom: "fmap" bottom: "info" '
               f'top: "rois" top: "pool5" region_proposal_param {{ {region} }} roi_pooling_param {{ {roi} }} }}',
               inputs={"prob": (1, 2, 3, 4), "deltas": (1, 4, 3, 4), "fmap": (1, 2, 3, 4), "info": (1, 3)})
    with pytest.raises(LayerError, match=msg):
        load_from_text(text)


def test_rproi_shape_errors():
    p = PARAMS
    a = 2
    text = rproi_net(1, 3, 5, 7, p).replace(f"dim: {4 * a} dim: 5 dim: 7", f"dim: {4 * a} dim: 5 dim: 6")
    with pytest.raises(LayerError, match=r"rpn_bbox_pred must be \(1, 4 x 2 anchors, 5, 7\)"):
        load_from_text(text)
    with pytest.raises(LayerError, match=r"im_info must hold \[height, width, scale\] per image"):
        load_from_text(rproi_net(1, 3, 5, 7, p, info_shape=(1, 4)))


def test_extra_anchor_values_are_noted(tmp_path):
    """The plugin reads the first anchor_ratio_count ratios; the rest change nothing."""
    p = {**PARAMS, "ratios": [0.5]}
    text = rproi_net(1, 3, 5, 7, p).replace("anchor_ratio: 0.5", "anchor_ratio: 0.5 anchor_ratio: 2.0")
    model = load_from_text(text)
    assert any("reads the first anchor_ratio_count = 1" in note for note in model.warnings)
    x = feeds(1, 3, 5, 7, p, [[20, 28, 1.0]], seed=5)
    check_everywhere(model, x, refs(x, p), tmp_path, atol=1e-4, rtol=1e-5, opsets=())
