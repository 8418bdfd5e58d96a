"""Engineering-Course/caffe_ssl's MaskCreate (b62e3de mask_create_layer.cpp Forward_cpu): the reference is its
per-pixel partial_sort of (value, class) pairs with std::greater, ties included."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def mask_ref(x):
    n, c, h, w = x.shape
    out = np.zeros((n, 1, h, w), F)
    for i in range(n):
        for y in range(h):
            for z in range(w):
                pairs = sorted(((x[i, k, y, z], k) for k in range(c)), reverse=True)   # std::greater on pairs
                out[i, 0, y, z] = pairs[0][1]
    return out


def test_best_class_with_ties_to_the_highest(tmp_path):
    x = rng(1).integers(0, 3, (2, 5, 3, 4)).astype(F)     # many equal maxima
    model = load_from_text(net('layer { name: "m" type: "MaskCreate" bottom: "x" top: "o" mask_create_param { num_cls: 5 } }',
                               inputs={"x": x.shape}))
    want = mask_ref(x)
    assert len(np.unique(want)) > 2
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)


def test_refuses_another_class_count():
    with pytest.raises(LayerError, match="has 4 channels, mask_create_param.num_cls 20"):
        load_from_text(net('layer { name: "m" type: "MaskCreate" bottom: "x" top: "o" }', inputs={"x": (1, 4, 2, 2)}))


def test_refuses_no_classes():
    with pytest.raises(LayerError, match="num_cls must be >= 1, got 0"):
        load_from_text(net('layer { name: "m" type: "MaskCreate" bottom: "x" top: "o" mask_create_param { num_cls: 0 } }',
                           inputs={"x": (1, 4, 2, 2)}))


# ---- PoseEvaluate, PoseCreate, HeatmapError: forwards written from pose_evaluate_layer.cpp, ------------
# pose_create_layer.cpp and heatmap_error_layer.cpp (caffe_ssl b62e3de)

TABLES = {9: {1: 0, 2: 0, 4: 0, 13: 0, 5: 1, 7: 1, 11: 1, 9: 2, 12: 2, 14: 3, 15: 4, 16: 5, 17: 6, 18: 7, 19: 8},
          3: {4: 0, 3: 1, 2: 2}, 2: {1: 0, 2: 1}}


def pose_evaluate_ref(x, joints):
    n, _, h, w = x.shape
    xs, ys = [[] for _ in range(joints)], [[] for _ in range(joints)]    # never cleared, as the fork's
    out = np.zeros((n, 1, 1, 2 * joints), np.float32)
    for i in range(n):
        for r in range(h):
            for c in range(w):
                j = TABLES[joints].get(int(x[i, 0, r, c]), -1)
                if j >= 0:
                    xs[j].append(c)
                    ys[j].append(r)
        for j in range(joints):
            if xs[j]:
                out[i, 0, 0, 2 * j] = int(sum(xs[j]) / len(xs[j]))
                out[i, 0, 0, 2 * j + 1] = int(sum(ys[j]) / len(ys[j]))
    return out


def pose_create_ref(centres, h, w):
    n, j = centres.shape[0], centres.shape[3] // 2
    out = np.zeros((n, j, h, w), np.float32)
    for i in range(n):
        for k in range(j):
            cx, cy = int(centres[i, 0, 0, 2 * k]), int(centres[i, 0, 0, 2 * k + 1])
            if cx == 0 and cy == 0:
                continue
            for yy in range(h):
                for xx in range(w):
                    g = np.float32((1 / (1.0 * math.sqrt(2 * math.pi))) *
                                   math.exp(-0.5 * ((yy - cy) ** 2 + (xx - cx) ** 2)))
                    out[i, k, yy, xx] = np.float32(4) * g
    return out


POSE = ('layer {{ name: "pose" type: "PoseEvaluate" bottom: "mask" top: "pose" pose_evaluate_param {{ num_joint: {j} }} }}\n'
        'layer {{ name: "heat" type: "PoseCreate" bottom: "pose" bottom: "mask" top: "heat" '
        'pose_create_param {{ num_joint: {j} }} }}\n'
        'layer {{ name: "err" type: "HeatmapError" bottom: "heat" bottom: "other" top: "err" '
        'heatmap_error_param {{ scale: 0.05 }} }}')


@pytest.mark.parametrize("joints", [9, 3, 2])
def test_pose_layers(tmp_path, joints):
    """A class map's joint centres (averaging the earlier images' pixels too, as the fork's lists do), their
    Gaussian heatmaps (a missing joint all zero) and the scaled squared distance to other heatmaps."""
    g = rng(41)
    shape = (3, 1, 7, 9)
    mask = g.integers(0, 21, shape).astype(np.float32)
    mask[0][mask[0] == 14] = 0            # image 0 without a left arm: (0, 0), an empty heatmap for 9 joints
    mask[1, 0, 2, 3] = 13.7               # class ids are truncated
    other = g.standard_normal((3, joints, 7, 9)).astype(np.float32)
    model = load_from_text(net(POSE.format(j=joints), inputs={"mask": shape, "other": other.shape}),
                           random_weights=True, outputs=["pose", "heat", "err"])
    pose = pose_evaluate_ref(mask, joints)
    heat = pose_create_ref(pose, 7, 9)
    d = (heat - other).reshape(3, -1).astype(np.float64)
    err = ((d * d).sum(axis=1) / 2 * np.float32(0.05)).reshape(3, 1, 1, 1).astype(np.float32)
    if joints == 9:
        assert (pose[0, 0, 0, 6:8] == 0).all() and (heat[0, 3] == 0).all()
    check_everywhere(model, {"mask": mask, "other": other}, {"pose": pose, "heat": heat, "err": err}, tmp_path,
                     atol=1e-5, rtol=1e-6)


def test_pose_evaluate_refuses_other_joint_counts():
    with pytest.raises(CaffeqError, match="num_joint must be 9, 3 or 2"):
        load_from_text(net(POSE.format(j=16), inputs={"mask": (1, 1, 4, 4), "other": (1, 16, 4, 4)}))


def test_heatmap_error_of_differently_shaped_bottoms(tmp_path):
    """caffe_sub over C x H x W values per image, whatever the shapes: (2, 1, 1, 4) against (2, 4, 1, 1)."""
    g = rng(42)
    a, b = g.standard_normal((2, 1, 1, 4)).astype(np.float32), g.standard_normal((2, 4, 1, 1)).astype(np.float32)
    layer = 'layer { name: "err" type: "HeatmapError" bottom: "a" bottom: "b" top: "e" heatmap_error_param { scale: 0.5 } }'
    model = load_from_text(net(layer, inputs={"a": a.shape, "b": b.shape}))
    d = (a.reshape(2, -1) - b.reshape(2, -1)).astype(np.float64)
    want = ((d * d).sum(axis=1) / 2 * 0.5).reshape(2, 1, 1, 1).astype(np.float32)
    check_everywhere(model, {"a": a, "b": b}, {"e": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_pose_create_of_a_nan_centre_is_empty(tmp_path):
    """int(NaN) is INT_MIN where the fork runs: a centre that far gives an all-zero map, not NaN."""
    centres = np.array([[[[np.nan, 1, 1.7, 2.2]]]], np.float32)
    layer = ('layer { name: "heat" type: "PoseCreate" bottom: "c" bottom: "like" top: "h" '
             'pose_create_param { num_joint: 2 } }')
    model = load_from_text(net(layer, inputs={"c": centres.shape, "like": (1, 1, 4, 5)}))
    want = pose_create_ref(np.array([[[[0, 0, 1.7, 2.2]]]], np.float32), 4, 5)
    got = model.run({"c": centres, "like": np.zeros((1, 1, 4, 5), np.float32)})["h"]
    assert (got[0, 0] == 0).all() and np.array_equal(got, want)
    check_everywhere(model, {"c": centres, "like": np.zeros((1, 1, 4, 5), np.float32)}, {"h": want}, tmp_path,
                     atol=1e-6, rtol=1e-6)
