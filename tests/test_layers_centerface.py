"""yuqj1991/caffe_train's BatchNormScale, CenternetDetectionOutput and CenterGridOutput
(caffeq/layers/centerface.py) against their forwards written here from the fork's C++ loops (c7247801:
batch_norm_scale_layer.cpp, detection_centernet_output_layer.cpp, CenterGridDetectionLayer.cpp and
center_bbox_util.cpp's get_topK, GetCenterGridObjectResult*, hard_nms), in float32 scalars as the fork,
on asymmetric maps, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def valid(v, high):
    """GET_VALID_VALUE(v, 0, high)."""
    low = v if v >= 0 else F(0)
    return low if low < high else F(high)


def hard_nms_ref(cands, thr):
    """cands: dicts with score, x1, y1, x2, y2, area (float32); the fork's sort and greedy loop."""
    cands = sorted(cands, key=lambda c: -c["score"])        # no ties in these tests
    picked = []
    for c in cands:
        keep = True
        for k in picked:
            iw = min(c["x2"], k["x2"]) - max(c["x1"], k["x1"]) + F(1)
            ih = min(c["y2"], k["y2"]) - max(c["y1"], k["y1"]) + F(1)
            iw, ih = (iw if iw > 0 else F(0)), (ih if ih > 0 else F(0))
            inter = F(iw * ih)
            iou = F(inter / F(F(c["area"] + k["area"]) - inter))
            keep = iou <= F(thr)
            if not keep:
                break
        if keep:
            picked.append(c)
    return picked


def rows_or_fallback(per_image, n, width):
    rows = [r for rows in per_image for r in rows]
    if not rows:
        out = np.full((n, width), -1, F)
        out[:, 0] = np.arange(n)
        return out.reshape(1, 1, n, width)
    return np.array(rows, F).reshape(1, 1, -1, width)


def centernet_ref(loc, heat, thr, nms, keep_top_k, has_lm):
    n, lc, h, w = loc.shape
    out = []
    for i in range(n):
        cands = []
        for c in range(heat.shape[1]):
            for y in range(h):
                for x in range(w):
                    s = heat[i, c, y, x]
                    if not (s > F(thr) and s < 1):
                        continue
                    cx, cy = F((F(x) + loc[i, 0, y, x]) * F(4)), F((F(y) + loc[i, 1, y, x]) * F(4))
                    bw, bh = F(np.exp(loc[i, 2, y, x]) * F(4)), F(np.exp(loc[i, 3, y, x]) * F(4))
                    d = {"score": s, "label": c + 1, "x1": valid(F(cx - F(bw / 2)), F(4 * w)),
                         "x2": valid(F(cx + F(bw / 2)), F(4 * w)), "y1": valid(F(cy - F(bh / 2)), F(4 * h)),
                         "y2": valid(F(cy + F(bh / 2)), F(4 * h)), "area": F(bw * bh), "marks": []}
                    if has_lm:
                        box_w, box_h = F(d["x2"] - d["x1"]), F(d["y2"] - d["y1"])
                        for k in range(10):
                            centre, size, bound = (cx, box_w, 4 * w) if k % 2 == 0 else (cy, box_h, 4 * h)
                            d["marks"].append(valid(F(F(centre + F(loc[i, 4 + k, y, x] * size)) * F(4)), F(bound)))
                    cands.append(d)
        kept = hard_nms_ref(cands, nms)
        if keep_top_k > 0:
            kept = kept[:keep_top_k]
        out.append([[i, d["label"], d["score"], d["x1"] / F(4 * w), d["y1"] / F(4 * h), d["x2"] / F(4 * w),
                     d["y2"] / F(4 * h), *d["marks"]] for d in kept])
    return rows_or_fallback(out, n, 17 if has_lm else 7)


def activated_ref(x, softmax, has_lm):
    x = x.copy()
    if not softmax:
        x[:, 4] = (1.0 / (1.0 + np.exp(-x[:, 4].astype(np.float64)))).astype(F)
        return x
    b = 14 if has_lm else 4
    m = np.maximum(x[:, b], x[:, b + 1])
    e0, e1 = np.exp(x[:, b] - m), np.exp(x[:, b + 1] - m)
    x[:, b], x[:, b + 1] = e0 / (e0 + e1), e1 / (e0 + e1)
    return x


def center_grid_ref(maps, anchors, softmax, has_lm, thr, nms, keep_top_k, net_w, net_h):
    maps = [activated_ref(x, softmax, has_lm) for x in maps]
    n = maps[0].shape[0]
    out = []
    for i in range(n):
        cands = []
        for x, anchor in zip(maps, anchors):
            h, w = x.shape[2:]
            dr = F(F(net_w) / F(w))
            div = dr if softmax else F(F(2) * dr)

            def corner(t, cell):
                return F((cell + 0.5 - float(F(F(t * F(anchor)) / div))) * float(dr))
            for y in range(h):
                for z in range(w):
                    t = x[i, :, y, z]
                    bx, by = F(dr * F(w)), F(dr * F(h))
                    x1, y1 = valid(corner(t[0], z), bx), valid(corner(t[1], y), by)
                    x2, y2 = valid(corner(t[2], z), bx), valid(corner(t[3], y), by)
                    if (x2 - x1) <= 0 or (y2 - y1) <= 0:
                        continue
                    s = t[15] if has_lm else t[5] if softmax else t[4]
                    if not s >= F(thr):
                        continue
                    marks = [valid(corner(t[4 + k], z), bx if k % 2 == 0 else by) for k in range(10)] if has_lm else []
                    cands.append({"score": s, "x1": x1, "y1": y1, "x2": x2, "y2": y2, "area": F((x2 - x1) * (y2 - y1)),
                                  "marks": marks})
        kept = hard_nms_ref(cands, nms)
        if keep_top_k > 0:
            kept = kept[:keep_top_k]
        out.append([[i, 1, d["score"], d["x1"] / F(net_w), d["y1"] / F(net_h), d["x2"] / F(net_w), d["y2"] / F(net_h),
                     *[m / F(net_w if k % 2 == 0 else net_h) for k, m in enumerate(d["marks"])]] for d in kept])
    return rows_or_fallback(out, n, 17 if has_lm else 7), maps


CENTERNET = ('layer {{ name: "det" type: "CenternetDetectionOutput" bottom: "loc" bottom: "heat" top: "o" '
             'detection_output_param {{ num_classes: {k} confidence_threshold: {thr} nms_thresh: {nms} '
             'keep_top_k: {top} has_lm: {lm} }} }}')


@pytest.mark.parametrize("has_lm, top, thr", [(False, -1, 0.5), (True, 1000, 0.6), (False, 3, 0.3)])
def test_centernet_detections(tmp_path, has_lm, top, thr):
    g = rng(31)
    n, k, h, w = 2, 2, 5, 7
    loc = g.standard_normal((n, 14 if has_lm else 4, h, w)).astype(F)
    loc[:, :2] = g.uniform(0, 1, (n, 2, h, w))
    loc[:, 2:4] = g.uniform(0.5, 2.5, (n, 2, h, w))    # boxes of 6 to 50 pixels: overlaps of every kind
    heat = g.uniform(0, 1, (n, k, h, w)).astype(F)
    heat[1, 0, 2, 3] = 1.0                                # a score of 1 is no candidate
    text = CENTERNET.format(k=k + 1, thr=thr, nms=0.3, top=top, lm=str(has_lm).lower())
    model = load_from_text(net(text, inputs={"loc": loc.shape, "heat": heat.shape}), random_weights=True)
    want = centernet_ref(loc, heat, thr, 0.3, top, has_lm)
    assert want.shape[2] > 4 and want.shape[2] < n * k * h * w    # NMS drops some, keeps several
    check_everywhere(model, {"loc": loc, "heat": heat}, {"o": want}, tmp_path, atol=2e-6, rtol=1e-6)


def test_centernet_without_detections_writes_one_row_per_image(tmp_path):
    loc = np.zeros((3, 4, 2, 3), F)
    heat = np.full((3, 1, 2, 3), 0.1, F)
    model = load_from_text(net(CENTERNET.format(k=2, thr=0.5, nms=0.3, top=-1, lm="false"),
                               inputs={"loc": loc.shape, "heat": heat.shape}), random_weights=True)
    want = centernet_ref(loc, heat, 0.5, 0.3, -1, False)
    assert want.tolist() == [[[[0, -1, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1, -1], [2, -1, -1, -1, -1, -1, -1]]]]
    check_everywhere(model, {"loc": loc, "heat": heat}, {"o": want}, tmp_path)


GRID = ('layer {{ name: "det" type: "CenterGridOutput" {bottoms} top: "o" detection_output_param {{ num_classes: {k} '
        '{anchors} confidence_threshold: {thr} nms_thresh: 0.3 keep_top_k: {top} class_type: {kind} has_lm: {lm} '
        'net_width: 40 net_height: 48 }} }}')


def grid_model(shapes, anchors, kind, has_lm, thr=0.3, top=-1, extra=""):
    names = [f"m{t}" for t in range(len(shapes))]
    text = GRID.format(bottoms=" ".join(f'bottom: "{b}"' for b in names), k=2 if kind == "SOFTMAX" else 1,
                       anchors=" ".join(f"bias_scale: {a}" for a in anchors), thr=thr, top=top, kind=kind,
                       lm=str(has_lm).lower())
    return load_from_text(net(text + extra, inputs=dict(zip(names, shapes))), random_weights=True), names


@pytest.mark.parametrize("kind, has_lm, top", [("SIGMOID", False, -1), ("SOFTMAX", False, 5), ("SOFTMAX", True, -1)])
def test_center_grid_detections(tmp_path, kind, has_lm, top):
    g = rng(32)
    c = 16 if has_lm else 6 if kind == "SOFTMAX" else 5
    shapes = [(2, c, 6, 9), (2, c, 3, 5), (2, c, 2, 3)]       # strides 40/9, 8, 40/3: not whole numbers
    anchors = [7, 15, 30]
    model, names = grid_model(shapes, anchors, kind, has_lm, top=top)
    maps = []
    for s in shapes:
        x = g.standard_normal(s).astype(F)
        x[:, 0:2] = g.uniform(0.1, 1.0, (s[0], 2) + s[2:])      # the fork's codes: corners around the cell
        x[:, 2:4] = -g.uniform(0.1, 1.0, (s[0], 2) + s[2:])
        maps.append(x)
    want, _ = center_grid_ref(maps, anchors, kind == "SOFTMAX", has_lm, 0.3, 0.3, top, 40, 48)
    assert want.shape[2] > 4
    check_everywhere(model, dict(zip(names, maps)), {"o": want}, tmp_path, atol=2e-6, rtol=1e-6)


def test_center_grid_writes_its_activations_back(tmp_path):
    """The fork activates the score channels in its bottoms: a later reader of one gets the probabilities."""
    g = rng(33)
    shapes = [(1, 6, 4, 5), (1, 6, 2, 3), (1, 6, 1, 2)]
    extra = '\nlayer { name: "after" type: "Power" bottom: "m0" top: "after" }'
    model, names = grid_model(shapes, [8, 16, 32], "SOFTMAX", False, extra=extra)
    maps = [g.standard_normal(s).astype(F) for s in shapes]
    want, activated = center_grid_ref(maps, [8, 16, 32], True, False, 0.3, 0.3, -1, 40, 48)
    check_everywhere(model, dict(zip(names, maps)), {"o": want, "after": activated[0]}, tmp_path, atol=2e-6, rtol=1e-6)


def test_center_grid_refusals():
    with pytest.raises(CaffeqError, match="bias_scale needs one anchor per bottom"):
        grid_model([(1, 5, 2, 2)] * 3, [8, 16], "SIGMOID", False)
    with pytest.raises(CaffeqError, match="has_lm needs class_type: SOFTMAX"):
        grid_model([(1, 5, 2, 2)] * 3, [8, 16, 32], "SIGMOID", True)
    with pytest.raises(CaffeqError, match="bottom 1 .*6 channels"):
        grid_model([(1, 6, 2, 2), (1, 5, 2, 2), (1, 6, 2, 2)], [8, 16, 32], "SOFTMAX", False)


BNS = 'layer {{ name: "bns" type: "BatchNormScale" bottom: "x" top: "{top}" batch_norm_param {{ eps: 0.001 }} }}'


@pytest.mark.parametrize("in_place", [True, False])
def test_batch_norm_scale(tmp_path, in_place):
    """In place the fork normalizes, scales and shifts; out of place its last step scales the bottom."""
    g = rng(34)
    shape = (2, 3, 4, 5)
    top = "x" if in_place else "o"
    text = net(BNS.format(top=top), inputs={"x": shape})
    if in_place:
        text += '\nlayer { name: "out" type: "Power" bottom: "x" top: "o" }'
    model = load_from_text(text, random_weights=True)
    assert any("gamma * x + beta" in w for w in model.warnings) != in_place
    mean, var = g.standard_normal(3).astype(F), g.uniform(0.5, 2, 3).astype(F)
    factor, gamma, beta = F(4.0), g.standard_normal(3).astype(F), g.standard_normal(3).astype(F)
    node_of(model, "bns").blobs = [mean, var, np.array([factor], F), gamma, beta]
    x = g.standard_normal(shape).astype(F)
    want = bns_ref(x, mean, var, factor, gamma, beta, 0.001, in_place)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-5, rtol=1e-5)


def bns_ref(x, mean, var, factor, gamma, beta, eps, in_place):
    """batch_norm_scale_layer.cpp at TEST, element by element in float32: s = 1 / factor (0 for 0), the
    centred value scaled by 1 / sqrt(s var + eps) (caffe_cpu_scale), then gamma * (that, or the untouched
    bottom out of place) + beta."""
    out = np.empty_like(x)
    s = F(0) if factor == 0 else F(F(1) / F(factor))
    for i in np.ndindex(x.shape):
        c = i[1] if x.ndim > 1 else 0
        if in_place:
            inv = F(F(1) / F(np.sqrt(F(F(var[c] * s) + F(eps)))))
            v = F(F(x[i] - F(mean[c] * s)) * inv)
        else:
            v = x[i]
        out[i] = F(F(gamma[c] * v) + beta[c])
    return out


@pytest.mark.parametrize("factor", [0.0, 3.0])
def test_batch_norm_scale_one_axis_and_factors(tmp_path, factor):
    """A 1-axis bottom is one channel; factor 0 zeroes the statistics; a factor like 3 makes 1 / factor inexact."""
    g = rng(35)
    model = load_from_text(net(BNS.format(top="x"), inputs={"x": (5,)}) +
                           '\nlayer { name: "out" type: "Power" bottom: "x" top: "o" }', random_weights=True)
    blobs = [g.standard_normal(1).astype(F), g.uniform(0.5, 2, 1).astype(F), np.array([factor], F),
             g.standard_normal(1).astype(F), g.standard_normal(1).astype(F)]
    node_of(model, "bns").blobs = blobs
    x = g.standard_normal(5).astype(F)
    want = bns_ref(x, blobs[0], blobs[1], factor, blobs[3], blobs[4], 0.001, True)
    assert model.run({"x": x})["o"].shape == (5,)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind, want", [("CenterGridOutput", "at least 3 bottoms"), ("HeatmapError", "at least 2 bottoms"),
                                        ("BeamSearch", "at least one bottom"), ("HWCN", "at least one bottom"),
                                        ("CPFPConversion", "at least one bottom")])
def test_open_ended_bottom_counts_are_one_short_line(kind, want):
    """A layer taking "N or more" bottoms words the count once (a range of every allowed count would list them)."""
    with pytest.raises(CaffeqError) as e:
        load_from_text(f'layer {{ name: "x" type: "{kind}" top: "o" }}')
    assert want in str(e.value) and len(str(e.value)) < 300
