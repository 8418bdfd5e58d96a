"""SidHard/digits-multi-detect (371385e), DIGITS' DetectNet made multi-class: `object_class: n` (a uint32 count in
its caffe.proto, NVCaffe's ClassMapping here) maps source classes 1..n to coverage maps 0..n-1 (its
CoverageGenerator::assignLabels), and its Python 2 clustering.py gives ClusterDetections one top of
(classes, N, 50, 5).  Checked against references written from the fork's code, in torch and model.py; NVCaffe's
form keeps reading as before; the real file reads with inspect."""
import json
import math
import re

import numpy as np
import pytest
from conftest import inputs_text, model_py_outputs
from test_layers_detectnet import BOXES, GT, label_blob, ref_label, transform_net
from test_layers_detectnet_clustering import c_int, cell_proposals, objects_grid, ref_group, ref_round

from caffeq.__main__ import main
from caffeq.errors import CaffeqError, ExportError
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.schema import caffe_pb2
from caffeq.model import load_from_text

F32 = np.float32
REAL = "tests/fixtures/realworld/SidHard__digits-multi-detect__detectnet_0.5.prototxt"


def count_net(shape, label_shape, g, count_text):
    """transform_net with the fork's `object_class: n` in place of NVCaffe's mappings."""
    text = transform_net(shape, label_shape, dict(g, classes=None))
    return text.replace("detectnet_groundtruth_param { ", f"detectnet_groundtruth_param {{ {count_text} ")


# ---- object_class as a number ----------------------------------------------------------------------

def test_the_number_form_reads_into_object_class_count_and_the_mapping_form_as_before():
    net = parse_prototxt_text(count_net((1, 3, 4, 9), (1, 1, 3, 16), GT, "object_class: 3"))
    p = net.layer[2].detectnet_groundtruth_param
    assert p.object_class_count == 3 and len(p.object_class) == 0
    net = parse_prototxt_text(transform_net((1, 3, 4, 9), (1, 1, 3, 16), GT))
    p = net.layer[2].detectnet_groundtruth_param
    assert not p.HasField("object_class_count")
    assert [(m.src, m.dst) for m in p.object_class] == [(1, 0), (3, 2)]


@pytest.mark.parametrize("count, classes", [
    (3, {1: 0, 2: 1, 3: 2}),
    (2, {1: 0, 2: 1}),       # the class-3 boxes are dropped
    (0, {1: 0}),             # no class: the fork's KITTI default, as NVCaffe's
])
def test_the_count_maps_classes_one_to_n_to_maps_zero_to_n_minus_one(count, classes, tmp_path):
    shape = (2, 3, 5, 7)
    blob = label_blob(BOXES, 6)
    model = load_from_text(count_net(shape, blob.shape, GT, f"object_class: {count}"), outputs=["d", "l"])
    ref = ref_label(blob, shape[3], shape[2], dict(GT, classes=classes))
    assert model.blob_shapes["l"] == ref.shape == (2, 8 + max(count, 1), 2, 4)
    assert ref[:, 0].sum() > 0
    x = np.random.default_rng(3).uniform(0, 255, shape).astype(F32)
    np.testing.assert_array_equal(model.run({"data": x, "label": blob})["l"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, {"data": x, "label": blob}, tmp_path)["l"], ref)


def test_a_binary_layer_of_the_fork_reads_its_count():
    """The fork writes object_class as varint 13, which protobuf keeps as an unknown field here."""
    text = count_net((1, 3, 4, 9), (1, 1, 3, 16), GT, "")
    net = parse_prototxt_text(text)
    raw = net.layer[2].detectnet_groundtruth_param.SerializeToString() + bytes([13 << 3, 4])
    net.layer[2].detectnet_groundtruth_param.ParseFromString(raw)
    from caffeq.layers.detectnet import _ground_truth
    assert _ground_truth(net.layer[2])["classes"] == {1: 0, 2: 1, 3: 2, 4: 3}


def test_both_forms_in_one_layer_are_one_line():
    text = transform_net((1, 3, 4, 9), (1, 1, 3, 16), GT).replace("object_class {", "object_class: 2 object_class {", 1)
    with pytest.raises(CaffeqError, match=r"val_transform.*detectnet_groundtruth_param\.object_class: give src / dst "
                                          r"mappings \(NVCaffe\) or one class count"):
        load_from_text(text)


@pytest.mark.parametrize("count", [65537, 4294967295])
def test_an_absurd_class_count_is_refused_before_the_map_is_built(count):
    text = count_net((1, 3, 4, 9), (1, 1, 3, 16), GT, f"object_class: {count}")
    with pytest.raises(CaffeqError, match=rf"object_class: {count} classes is absurd"):
        load_from_text(text)


# ---- the fork's ClusterDetections ------------------------------------------------------------------

def ref_fork_cluster(coverage, boxes, size_x, size_y, stride, cvg_thr, rect_thr, eps, min_height):
    """The fork's cluster() for one class (N, 1, H, W), as Python 2 runs it: int division, the coverage's
    first min(grid_y, grid_x) rows (every column), the corners given to groupRectangles as x, y, w, h."""
    grid_x, grid_y = size_x // stride, size_y // stride
    cell_w, cell_h = size_x // grid_x, size_y // grid_y
    out = np.zeros((coverage.shape[0], 50, 5))
    for i in range(coverage.shape[0]):
        cvg = coverage[i][0][0:grid_y][0:grid_x]
        ys, xs = np.where(cvg >= F32(cvg_thr))
        proposed = cell_proposals(boxes[i], ys, xs, cell_w, cell_h)
        if not proposed.any():
            continue
        rects = [[ref_round(v) for v in row] for row in proposed.tolist()]
        rows = [[r[0], r[1], r[2], r[3], math.log(w)] for r, w in zip(*ref_group(rects, rect_thr, eps))
                if c_int(r[3] - r[1]) >= min_height]
        rows = np.asarray(rows, dtype=np.float16)
        if rows.shape[0]:
            out[i, :rows.shape[0], :rows.shape[1]] = rows
    return out.astype(F32)


def cluster_net(n, classes, cov_hw, box_hw, param_str):
    return inputs_text(coverage=(n, classes) + cov_hw, bboxes=(n, 4) + box_hw) + f"""
layer {{ name: "cluster" type: "Python" bottom: "coverage" bottom: "bboxes" top: "bbox-list"
  python_param {{ module: "caffe.layers.detectnet.clustering" layer: "ClusterDetections"
                 param_str: "{param_str}" }} }}"""


# (image size x, y, stride), coverage map (H, W), box map (H, W), threshold, rect threshold, eps, min height
CASES = [
    ((50, 30, 8), (3, 6), (3, 6), 0.6, 1, 0.3, 10),    # cells 50 // 6 = 8 and 10 wide, not 8.33
    ((24, 64, 8), (8, 5), (8, 6), 0.6, 2, 0.4, 0),      # grid 3 x 8: the first 3 rows, all 5 columns read
    ((48, 32, 8), (4, 6), (4, 6), 0.6, 0, 0.2, 10),     # rect threshold 0: every box kept, weight 1
]


@pytest.mark.parametrize("size, cov_hw, box_hw, cvg, rect, eps, min_h", CASES)
def test_fork_cluster_detections_matches_its_module(size, cov_hw, box_hw, cvg, rect, eps, min_h, tmp_path):
    rng = np.random.default_rng(sum(size) + rect)
    sx, sy, stride = size
    coverage, boxes = objects_grid(rng, 2, 3, *cov_hw, sx // (sx // stride), sy // (sy // stride))
    if box_hw != cov_hw:
        wide = rng.uniform(-5, 5, (2, 4) + box_hw).astype(F32)
        wide[:, :, :cov_hw[0], :cov_hw[1]] = boxes
        boxes = wide
    model = load_from_text(cluster_net(2, 3, cov_hw, box_hw, f"{sx}, {sy}, {stride}, {cvg}, {rect}, {eps}, {min_h}, 3"))
    assert model.blob_shapes["bbox-list"] == (3, 2, 50, 5)
    ref = np.stack([ref_fork_cluster(coverage[:, c:c + 1], boxes, sx, sy, stride, cvg, rect, eps, min_h)
                    for c in range(3)])
    assert (ref[:, :, :, 4] > 0).any() or rect == 0      # groups of several boxes form
    feeds = {"coverage": coverage, "bboxes": boxes}
    np.testing.assert_array_equal(model.run(feeds)["bbox-list"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, feeds, tmp_path)["bbox-list"], ref)
    with pytest.raises(ExportError, match="groupRectangles.*--outputs"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_nvcaffes_forms_keep_their_own_spec():
    """One top per class, or one top for one class: NVCaffe's module, (N, 50, 5) per top."""
    text = cluster_net(2, 2, (4, 6), (4, 6), "48,32,8,0.6,1,0.2,10,2").replace(
        'top: "bbox-list"', 'top: "list0" top: "list1"')
    model = load_from_text(text)
    assert model.blob_shapes["list0"] == model.blob_shapes["list1"] == (2, 50, 5)
    model = load_from_text(cluster_net(2, 1, (4, 6), (4, 6), "48,32,8,0.6,1,0.2,10"))
    assert model.blob_shapes["bbox-list"] == (2, 50, 5)


@pytest.mark.parametrize("classes, param_str, message", [
    (2, "48,32,8,0.6,1,0.2,10,3", "the coverage needs 3 channel(s)"),
    (3, "48,32,0,0.6,1,0.2,10,3", "stride"),
])
def test_fork_cluster_bad_inputs_are_one_line(classes, param_str, message):
    with pytest.raises(CaffeqError, match="cluster.*" + re.escape(message)):
        load_from_text(cluster_net(1, classes, (4, 6), (4, 6), param_str))


# ---- the real file -----------------------------------------------------------------------------------

def layer_shapes(tmp_path, capsys, *args):
    out = tmp_path / "summary.json"
    assert main(["inspect", REAL, "--json", str(out), *args]) == 0, capsys.readouterr().err
    return {lay["name"]: list(lay["output_shapes"].values()) for lay in json.loads(out.read_text())["layers"]}


def test_real_file_deploy_reads_with_three_classes_in_one_top(tmp_path, capsys):
    shapes = layer_shapes(tmp_path, capsys, "--input-shape", "data=1,3,256,1096")
    assert shapes["coverage/sig"] == [[1, 3, 16, 68]]
    assert shapes["cluster"] == [[3, 1, 50, 5]]
    assert "SidHard/digits-multi-detect's Python 2 clustering.py" in capsys.readouterr().err


def test_real_file_val_stage_sizes_three_coverage_maps(tmp_path, capsys):
    shapes = layer_shapes(tmp_path, capsys, "--stage", "val", "--input-shape", "data=2,3,256,1096",
                          "--input-shape", "label=2,1,51,16")
    assert shapes["val_transform"] == [[2, 3, 256, 1096], [2, 11, 16, 68]]    # 8 + object_class: 3
    assert shapes["slice-label"][-1] == [2, 3, 16, 68]
    net = parse_prototxt_text(open(REAL).read())
    assert {lp.detectnet_groundtruth_param.object_class_count for lp in net.layer
            if lp.type == "DetectNetTransformation"} == {3}
    assert caffe_pb2.DetectNetGroundTruthParameter().object_class_count == 0


# ---- edges the module's code fixes (mutation review r137) -------------------------------------------

def test_object_class_mappings_in_angle_brackets_and_lists_read_as_before():
    base = count_net((1, 3, 4, 9), (1, 1, 3, 16), GT, "")
    for written in ("object_class < src: 1 dst: 0 > object_class < src: 3 dst: 2 >",
                    "object_class: [ { src: 1 dst: 0 }, { src: 3 dst: 2 } ]"):
        p = parse_prototxt_text(base.replace("detectnet_groundtruth_param { ",
                                             f"detectnet_groundtruth_param {{ {written} ")).layer[2]
        p = p.detectnet_groundtruth_param
        assert [(m.src, m.dst) for m in p.object_class] == [(1, 0), (3, 2)], written
        assert not p.HasField("object_class_count")


def test_a_binary_layer_that_writes_the_count_twice_keeps_the_last():
    """protobuf's rule for a singular field given twice, as the fork's parser reads its own binary."""
    net = parse_prototxt_text(count_net((1, 3, 4, 9), (1, 1, 3, 16), GT, ""))
    p = net.layer[2].detectnet_groundtruth_param
    p.ParseFromString(p.SerializeToString() + bytes([13 << 3, 5, 13 << 3, 2]))
    from caffeq.layers.detectnet import _ground_truth
    assert _ground_truth(net.layer[2])["classes"] == {1: 0, 2: 1}


def run_cluster(coverage, boxes, param_str):
    model = load_from_text(cluster_net(coverage.shape[0], coverage.shape[1], coverage.shape[2:], boxes.shape[2:],
                                       param_str))
    return model.run({"coverage": coverage, "bboxes": boxes})["bbox-list"]


def test_fork_cluster_threshold_in_float32_and_min_height_as_y2_minus_y1():
    """Coverage exactly float32(0.7) (below 0.7) passes the module's float32 comparison; two groups of two
    equal boxes, heights y2 - y1 = 10 (kept at min_height 10) and 9 (dropped although y2 = 29)."""
    coverage = np.zeros((2, 2, 4, 6), F32)
    boxes = np.zeros((2, 4, 4, 6), F32)
    for x, y, box in ((1, 0, (2, 3, 12, 13)), (2, 0, (-6, 3, 4, 13)), (1, 2, (2, 4, 12, 13)), (2, 2, (-6, 4, 4, 13))):
        coverage[0, 1, y, x] = F32(0.7)
        boxes[0, :, y, x] = box      # cell (x, y) adds (8x, 8y): rects (10, 3, 20, 13) and (10, 20, 20, 29)
    out = run_cluster(coverage, boxes, "48, 32, 8, 0.7, 1, 0.2, 10, 2")
    ref = np.stack([ref_fork_cluster(coverage[:, c:c + 1], boxes, 48, 32, 8, 0.7, 1, 0.2, 10) for c in range(2)])
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(out[1, 0, :2], np.asarray([[10, 3, 20, 13, np.float16(math.log(2))], [0] * 5], F32))
    assert not out[0].any() and not out[1, 1].any()


def test_fork_cluster_all_zero_corners_give_no_rows():
    """Cells whose corners are all 0 propose nothing (the module's `if not propose_boxes.any()`), even where
    groupRectangles would keep their group."""
    coverage = np.zeros((1, 2, 4, 6), F32)
    boxes = np.zeros((1, 4, 4, 6), F32)
    coverage[0, 0, 0, :2] = 1
    boxes[0, :, 0, 1] = (-8, 0, -8, 0)
    assert not run_cluster(coverage, boxes, "48, 32, 8, 0.5, 1, 0.2, 0, 2").any()


def test_fork_cluster_fifty_groups_fill_the_rows_and_fifty_one_fail():
    coverage = np.zeros((1, 2, 6, 10), F32)
    boxes = np.tile(np.asarray([0, 0, 8, 8], F32)[:, None, None], (1, 1, 6, 10))
    coverage[0, 1].flat[:50] = 1
    out = run_cluster(coverage, boxes, "80, 48, 8, 0.5, 0, 0.2, 8, 2")
    assert (out[1, 0, :, 2] > 0).all() and not out[0].any()
    coverage[0, 1].flat[50] = 1
    with pytest.raises(CaffeqError, match=r"layer 'cluster': ClusterDetections: image 0 gives 51 boxes, more than "
                                          r"the module's 50 rows"):
        run_cluster(coverage, boxes, "80, 48, 8, 0.5, 0, 0.2, 8, 2")


def test_fork_cluster_shapes_at_the_edges():
    """A one-cell grid (stride = the image's height) reads; boxes need only the rows the module reads."""
    model = load_from_text(cluster_net(2, 3, (4, 6), (4, 6), "48, 32, 32, 0.6, 1, 0.2, 10, 3"))
    assert model.blob_shapes["bbox-list"] == (3, 2, 50, 5)
    model = load_from_text(cluster_net(1, 3, (8, 5), (3, 5), "24, 64, 8, 0.6, 1, 0.2, 10, 3"))   # 3 rows read
    assert model.blob_shapes["bbox-list"] == (3, 1, 50, 5)
    with pytest.raises(CaffeqError, match=r"cluster.*first 3 rows.*got boxes \[1, 4, 2, 5\]"):
        load_from_text(cluster_net(1, 3, (8, 5), (2, 5), "24, 64, 8, 0.6, 1, 0.2, 10, 3"))
    text = cluster_net(2, 3, (4, 6), (4, 6), "48,32,8,0.6,1,0.2,10,3").replace("dim: 2 dim: 4 dim: 4", "dim: 1 dim: 4 dim: 4")
    with pytest.raises(CaffeqError, match=r"cluster.*for each of its 2 images, got boxes \[1, 4, 4, 6\]"):
        load_from_text(text)


@pytest.mark.parametrize("param_str, message", [
    ("48,32,8,0.6,1,0.2,10,0", "num_classes 0 gives no class"),
    ("48,32,8,0.6,1,0.2,10,-2", "num_classes -2 gives no class"),
    ("48,32,8,0.6,1.5,0.2,10,3", "wrong type"),     # the module's int('1.5') fails
])
def test_fork_cluster_bad_param_str(param_str, message):
    with pytest.raises(CaffeqError, match="cluster.*" + re.escape(message)):
        load_from_text(cluster_net(1, 3, (4, 6), (4, 6), param_str))
