"""DetectNet's ClusterDetections (NVIDIA/caffe 0.17.3 python/caffe/layers/detectnet/clustering.py), run
natively: checked against a plain reading of the module written here (gridbox_to_boxes, vote_boxes and
OpenCV's groupRectangles as cascadedetect.cpp writes it, one rect at a time), in torch and model.py, on
asymmetric grids, two classes and two images; the grouping also against cv2.groupRectangles itself."""
import math

import numpy as np
import pytest
import torch
from conftest import model_py_outputs

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers.detectnet_clustering import cv_round, double_to_half, group_rectangles
from caffeq.model import load_from_text

F32 = np.float32
INT_MIN = -2 ** 31


def c_int(v):
    """A Python int as C's int32 arithmetic leaves it."""
    return (v + 2 ** 31) % 2 ** 32 - 2 ** 31


def ref_round(v):
    """cvRound of one float: half to even; NaN or outside int32 gives INT_MIN."""
    if math.isnan(v):
        return INT_MIN
    r = round(v)   # Python rounds half to even
    return r if -2 ** 31 <= r < 2 ** 31 else INT_MIN


def ref_group(rects, threshold, eps):
    """cascadedetect.cpp's groupRectangles, rect by rect: partition() by SimilarRects, the float32 means,
    then the filter of groups inside bigger groups."""
    n = len(rects)
    if threshold <= 0 or n == 0:
        return [list(r) for r in rects], [1] * n

    def similar(a, b):
        delta = eps * c_int(min(a[2], b[2]) + min(a[3], b[3])) * 0.5

        def edge(u, v):
            d = c_int(u - v)
            return (d if d == INT_MIN else abs(d)) <= delta
        return (edge(a[0], b[0]) and edge(a[1], b[1]) and edge(c_int(a[0] + a[2]), c_int(b[0] + b[2]))
                and edge(c_int(a[1] + a[3]), c_int(b[1] + b[3])))

    parent = list(range(n))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i
    for i in range(n):
        for j in range(n):
            if i != j and similar(rects[i], rects[j]):
                parent[root(j)] = root(i)
    numbers, labels = {}, []
    for i in range(n):   # classes numbered in order of first appearance
        labels.append(numbers.setdefault(root(i), len(numbers)))
    k = len(numbers)
    sums, counts = [[0, 0, 0, 0] for _ in range(k)], [0] * k
    for r, c in zip(rects, labels):
        sums[c] = [c_int(s + v) for s, v in zip(sums[c], r)]
        counts[c] += 1
    means = []
    for s, c in zip(sums, counts):
        scale = F32(1) / F32(c)
        means.append([ref_round(float(F32(v) * scale)) for v in s])
    kept, weights = [], []
    for i in range(k):
        r1, n1 = means[i], counts[i]
        if n1 <= threshold:
            continue
        inside = False
        for j in range(k):
            r2, n2 = means[j], counts[j]
            if j == i or n2 <= threshold:
                continue
            dx, dy = ref_round(r2[2] * eps), ref_round(r2[3] * eps)
            if (r1[0] >= c_int(r2[0] - dx) and r1[1] >= c_int(r2[1] - dy)
                    and c_int(r1[0] + r1[2]) <= c_int(r2[0] + r2[2] + dx)
                    and c_int(r1[1] + r1[3]) <= c_int(r2[1] + r2[3] + dy) and (n2 > max(3, n1) or n1 < 3)):
                inside = True
                break
        if not inside:
            kept.append(r1)
            weights.append(n1)
    return kept, weights


def cell_proposals(b, ys, xs, cell_w, cell_h):
    """clustering.py's proposals: the box corners of the covered cells (ys, xs), moved to each cell's place."""
    x1 = np.asarray([b[0][y][x] for y, x in zip(ys, xs)]) + xs * cell_w
    y1 = np.asarray([b[1][y][x] for y, x in zip(ys, xs)]) + ys * cell_h
    x2 = np.asarray([b[2][y][x] for y, x in zip(ys, xs)]) + xs * cell_w
    y2 = np.asarray([b[3][y][x] for y, x in zip(ys, xs)]) + ys * cell_h
    return np.transpose(np.vstack((x1, y1, x2, y2)))


def ref_cluster(coverage, boxes, size_x, size_y, stride, cvg_thr, rect_thr, eps, min_height):
    """clustering.py's cluster() for one class's coverage (N, 1, H, W)."""
    grid_x, grid_y = int(size_x / stride), int(size_y / stride)
    cell_w, cell_h = size_x / grid_x, size_y / grid_y
    out = np.zeros((coverage.shape[0], 50, 5))
    for i in range(coverage.shape[0]):
        ys, xs = np.where(coverage[i, 0, :grid_y, :grid_x] >= F32(cvg_thr))
        proposed = cell_proposals(boxes[i], ys, xs, cell_w, cell_h)
        if not proposed.any():
            continue
        rects = [[ref_round(e[0]), ref_round(e[1]), ref_round(e[2] - e[0]), ref_round(e[3] - e[1])]
                 for e in proposed.tolist()]
        rows = []
        for r, w in zip(*ref_group(rects, rect_thr, eps)):
            if r[3] >= min_height:
                rows.append([r[0], r[1], c_int(r[0] + r[2]), c_int(r[1] + r[3]), math.log(w)])
        with np.errstate(over="ignore"):   # the huge-box case overflows float16, as the module does
            rows = np.asarray(rows, dtype=np.float16)
        if rows.shape[0]:
            out[i, :rows.shape[0], :rows.shape[1]] = rows
    return out.astype(F32)


def objects_grid(rng, n, classes, h, w, cell_w, cell_h, objects=3):
    """Coverage and boxes as a trained DetectNet gives them: cells near an object cover it and regress its
    corners (relative to the cell) with noise in steps of 0.5, so ties of cvRound show; other cells
    score low with random boxes."""
    coverage = rng.uniform(0, 0.5, (n, classes, h, w)).astype(F32)
    boxes = rng.uniform(-20, 20, (n, 4, h, w)).astype(F32)
    for i in range(n):
        for c in range(classes):
            for _ in range(objects):
                oy, ox = int(rng.integers(0, h)), int(rng.integers(0, w))
                x1, y1 = ox * cell_w + rng.uniform(-4, 4), oy * cell_h + rng.uniform(-4, 4)
                bw, bh = rng.uniform(10, 40), rng.uniform(15, 50)
                for y in range(max(0, oy - 1), min(h, oy + 2)):
                    for x in range(max(0, ox - 1), min(w, ox + 2)):
                        coverage[i, c, y, x] = rng.uniform(0.6, 1.0)
                        noise = rng.integers(-3, 4, 4) * 0.5
                        boxes[i, :, y, x] = [x1 - x * cell_w + noise[0], y1 - y * cell_h + noise[1],
                                             x1 + bw - x * cell_w + noise[2], y1 + bh - y * cell_h + noise[3]]
    return coverage, boxes


def cluster_net(n, classes, cov_hw, box_c, box_hw, param_str):
    tops = " ".join(f'top: "list{c}"' for c in range(classes))
    return f"""
layer {{ name: "in" type: "Input" top: "coverage" top: "bboxes"
  input_param {{ shape {{ dim: {n} dim: {classes} dim: {cov_hw[0]} dim: {cov_hw[1]} }}
                shape {{ dim: {n} dim: {box_c} dim: {box_hw[0]} dim: {box_hw[1]} }} }} }}
layer {{ name: "cluster" type: "Python" bottom: "coverage" bottom: "bboxes" {tops}
  python_param {{ module: "caffe.layers.detectnet.clustering" layer: "ClusterDetections"
                 param_str: "{param_str}" }} }}
"""


# (image size x, y, stride), coverage and box map sizes (the grid may be smaller than the map), settings
CASES = [
    ((48, 32, 8), (4, 6), (4, 6), 0.6, 1, 0.2, 10),
    ((60, 40, 8), (6, 8), (7, 9), 0.6, 2, 0.3, 22),    # 5 x 7 grid of a 6 x 8 map: the module slices it
    ((50, 30, 8), (3, 6), (3, 6), 0.55, 1, 0.5, 0),    # 50 / 6 cells: a non-integer cell width
    ((48, 32, 8), (4, 6), (4, 6), 0.6, 0, 0.2, 10),    # threshold 0: every box kept, weight 1
]


@pytest.mark.parametrize("size, cov_hw, box_hw, cvg, rect, eps, min_h", CASES)
def test_cluster_detections_matches_the_module(size, cov_hw, box_hw, cvg, rect, eps, min_h, tmp_path):
    rng = np.random.default_rng(sum(size) + rect)
    sx, sy, stride = size
    gx, gy = int(sx / stride), int(sy / stride)
    coverage, boxes = objects_grid(rng, 2, 2, *cov_hw, sx / gx, sy / gy)
    boxes = np.concatenate([boxes, np.zeros((2, 4) + tuple(cov_hw), F32)], axis=1)   # bbox per class: 8 channels
    if box_hw != cov_hw:
        wide = rng.uniform(-5, 5, (2, 8) + tuple(box_hw)).astype(F32)
        wide[:, :, :cov_hw[0], :cov_hw[1]] = boxes
        boxes = wide
    param_str = f"{sx},{sy},{stride},{cvg},{rect},{eps},{min_h},2"
    model = load_from_text(cluster_net(2, 2, cov_hw, 8, box_hw, param_str))
    feeds = {"coverage": coverage, "bboxes": boxes}
    refs = {f"list{c}": ref_cluster(coverage[:, c:c + 1], boxes, sx, sy, stride, cvg, rect, eps, min_h)
            for c in range(2)}
    assert all((r[:, :, 4] > 0).any() for r in refs.values()) or rect == 0   # groups of several boxes form
    ours = model.run(feeds)
    from_py = model_py_outputs(model, feeds, tmp_path)
    for k, ref in refs.items():
        np.testing.assert_array_equal(ours[k], ref, err_msg=f"torch {k}")
        np.testing.assert_array_equal(from_py[k], ref, err_msg=f"model.py {k}")
    with pytest.raises(ExportError, match="groupRectangles.*--outputs"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_cluster_detections_edge_cases_match_the_module():
    # no cell over the threshold: no rows
    coverage = np.full((1, 1, 3, 4), 0.9, F32)
    zero = np.zeros((1, 4, 3, 4), F32)
    from caffeq.layers.detectnet_clustering import detectnet_cluster
    settings = (32, 24, 8, 0.6, 1, 0.2, 0)
    got = detectnet_cluster(torch.from_numpy(coverage * 0), torch.from_numpy(zero + 3), *settings)
    assert not got.any()
    # cell offsets alone: every cell's box is its own corner, none alike at eps 0.2, so none survives
    got = detectnet_cluster(torch.from_numpy(coverage), torch.from_numpy(zero), *settings)
    ref = ref_cluster(coverage, zero, *settings)
    np.testing.assert_array_equal(got.numpy(), ref)
    # ... and with threshold 0 every such box is kept (weight 1): the module tests the boxes with their
    # cell offsets, which are not all 0, not the regressed values
    kept = (32, 24, 8, 0.6, 0, 0.2, 0)
    got = detectnet_cluster(torch.from_numpy(coverage), torch.from_numpy(zero), *kept)
    np.testing.assert_array_equal(got.numpy(), ref_cluster(coverage, zero, *kept))
    assert np.count_nonzero(got.numpy()[0, :, :4].any(axis=1)) == 11   # 12 cells, the one at (0, 0) all 0
    # NaN and huge boxes: cvRound gives INT_MIN, and the int sums wrap as in C
    boxes = np.full((1, 4, 3, 4), 5.0, F32)
    boxes[0, :, 1, 1] = np.nan
    boxes[0, 2, 0, 0] = 3e9
    for threshold in (0, 1):
        s = (32, 24, 8, 0.6, threshold, 0.2, -10 ** 10)
        np.testing.assert_array_equal(detectnet_cluster(torch.from_numpy(coverage), torch.from_numpy(boxes), *s)
                                      .numpy(), ref_cluster(coverage, boxes, *s))


def test_group_rectangles_matches_the_plain_reading():
    rng = np.random.default_rng(7)
    for _ in range(300):
        k = int(rng.integers(0, 30))
        centers = rng.integers(0, 50, (max(1, k // 4), 2))
        xy = centers[rng.integers(0, len(centers), k)] + rng.integers(-3, 4, (k, 2))
        wh = rng.integers(-2, 30, (k, 2))
        rects = np.concatenate([xy, wh], 1).astype(np.int64)
        threshold, eps = int(rng.integers(0, 4)), float(rng.choice([0.02, 0.2, 0.5, 1.0]))
        kept, weights = group_rectangles(torch.from_numpy(rects), threshold, eps)
        ref_kept, ref_weights = ref_group(rects.tolist(), threshold, eps)
        assert kept.tolist() == ref_kept and weights.tolist() == ref_weights


def test_group_rectangles_matches_opencv():
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(11)
    for _ in range(300):
        k = int(rng.integers(1, 40))
        centers = rng.integers(0, 60, (max(1, k // 5), 2))
        xy = centers[rng.integers(0, len(centers), k)] + rng.integers(-3, 4, (k, 2))
        rects = np.concatenate([xy, rng.integers(1, 30, (k, 2))], 1).astype(np.int64)
        threshold, eps = int(rng.integers(0, 4)), float(rng.choice([0.02, 0.1, 0.2, 0.5]))
        cv_kept, cv_weights = cv2.groupRectangles(rects.tolist(), threshold, eps)
        kept, weights = group_rectangles(torch.from_numpy(rects), threshold, eps)
        assert kept.tolist() == np.asarray(cv_kept).reshape(-1, 4).tolist()
        assert weights.tolist() == np.asarray(cv_weights).reshape(-1).tolist()


def test_roundings_are_opencvs_and_numpys():
    v = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 2 ** 31 - 0.5, -2 ** 31 - 0.6, float("nan"), 7.49999])
    assert cv_round(v).tolist() == [0, 2, 2, 0, -2, INT_MIN, INT_MIN, INT_MIN, 7]
    # float64 -> float16 once, as numpy casts (torch alone goes through float32 and rounds twice)
    x = torch.log(torch.arange(1, 140000, dtype=torch.float64))
    np.testing.assert_array_equal(double_to_half(x).numpy(), x.numpy().astype(np.float16))
    assert (x.to(torch.float16).numpy() != x.numpy().astype(np.float16)).any()   # why double_to_half exists


def test_more_than_fifty_groups_fail_as_the_module_does():
    rng = np.random.default_rng(3)
    coverage = np.full((1, 1, 16, 16), 0.9, F32)
    # 256 well separated boxes in pairs of cells: 128 groups of two
    boxes = np.zeros((1, 4, 16, 16), F32)
    for y in range(16):
        for x in range(16):
            boxes[0, :, y, x] = [0, 0, 2 + rng.uniform(0, 0.1), 2]
    model = load_from_text(cluster_net(1, 1, (16, 16), 4, (16, 16), "128,128,8,0.5,0,0.2,0"))
    with pytest.raises(CaffeqError, match="layer 'cluster'.*256 boxes, more than the module's 50"):
        model.run({"coverage": coverage, "bboxes": boxes})


@pytest.mark.parametrize("param_str, shapes, message", [
    ("48,32,8,0.6,1,0.2", ((4, 6), 4, (4, 6)), "takes 'img_size_x"),
    ("48,32,8,0.6,one,0.2,10", ((4, 6), 4, (4, 6)), "wrong type"),
    ("48,32,40,0.6,1,0.2,10", ((4, 6), 4, (4, 6)), "leaves no grid cell"),
    ("48,32,0,0.6,1,0.2,10", ((4, 6), 4, (4, 6)), "stride"),
    ("48,32,8,0.6,1,0.2,10,2", ((4, 6), 4, (4, 6)), "one top per class"),
    ("48,32,8,0.6,1,0.2,10", ((4, 6), 3, (4, 6)), "box channels 0-3"),
    ("48,32,8,0.6,1,0.2,10", ((4, 6), 4, (3, 6)), "4x6 grid"),
])
def test_cluster_detections_bad_settings_are_one_line(param_str, shapes, message):
    cov_hw, box_c, box_hw = shapes
    with pytest.raises(CaffeqError, match=message):
        load_from_text(cluster_net(1, 1, cov_hw, box_c, box_hw, param_str))


def test_later_param_str_values_are_ignored_as_the_module_does():
    model = load_from_text(cluster_net(1, 1, (4, 6), 4, (4, 6), "48,32,8,0.6,1,0.2,10,1,40"))
    assert model.blob_shapes["list0"] == (1, 50, 5)
    assert any("NVCaffe 0.17.3" in w for w in model.warnings)
