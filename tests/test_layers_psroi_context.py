"""PSROIContextPooling (alenaliu/PPR-FCN 1eba551, externals/ms_caffe): R-FCN's position-sensitive
average pooling over a union box, each bin kept only where it overlaps the object box.

The fork's CPU Forward is NOT_IMPLEMENTED; the reference below is a numpy loop written here from its
CUDA kernel (psroi_context_pooling_layer.cu, PSROIContextPoolingForward), in float32 scalars as the
kernel's Dtype.  The kernel reads the object box from the start of the third bottom for every union
roi (that pointer is never offset), so the reference does too.
"""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from c_reference import c_round
from conftest import assert_close, model_py_outputs, net, node_of, onnx_outputs, rng

import caffeq
from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.layers.roi_pooling import ps_roi_context_pool
from caffeq.model import load_from_text

F = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
FILE = REALWORLD / "alenaliu__PPR-FCN__models__sg_vrd__rel_pre_iccv__vrd__test_exp1.prototxt"


def ref_psroi_context(x, rois, obj_rois, dim, g, scale):
    _n, _c, h, w = x.shape
    scale = F(scale)
    obj = obj_rois.reshape(-1)   # the kernel's bottom_obj_rois: always its first five values
    o_ws = min(max(math.floor(F(c_round(obj[1])) * scale), 0), w)
    o_hs = min(max(math.floor(F(c_round(obj[2])) * scale), 0), h)
    o_we = min(max(math.ceil(F(c_round(obj[3]) + 1.0) * scale), 0), w)
    o_he = min(max(math.ceil(F(c_round(obj[4]) + 1.0) * scale), 0), h)
    out = np.zeros((len(rois), dim, g, g), F)
    for n, roi in enumerate(rois):
        b = int(roi[0])
        start_w, start_h = F(c_round(roi[1])) * scale, F(c_round(roi[2])) * scale
        end_w, end_h = F(c_round(roi[3]) + 1.0) * scale, F(c_round(roi[4]) + 1.0) * scale
        roi_w = end_w - start_w if end_w - start_w > 0.1 else F(0.1)
        roi_h = end_h - start_h if end_h - start_h > 0.1 else F(0.1)
        bin_h, bin_w = roi_h / F(g), roi_w / F(g)
        for ctop in range(dim):
            for ph in range(g):
                for pw in range(g):
                    hs = min(max(math.floor(F(ph) * bin_h + start_h), 0), h)
                    he = min(max(math.ceil(F(ph + 1) * bin_h + start_h), 0), h)
                    ws = min(max(math.floor(F(pw) * bin_w + start_w), 0), w)
                    we = min(max(math.ceil(F(pw + 1) * bin_w + start_w), 0), w)
                    if not (ws < o_we and we > o_ws and hs < o_he and he > o_hs):
                        continue   # outside the object box: 0
                    if he <= hs or we <= ws:
                        continue   # empty: 0
                    c = (ctop * g + ph) * g + pw
                    total = F(0)
                    for yy in range(hs, he):
                        for xx in range(ws, we):
                            total = F(total + x[b, c, yy, xx])
                    out[n, ctop, ph, pw] = total / F((he - hs) * (we - ws))
    return out


DIM, G = 2, 3
X_SHAPE = (2, DIM * G * G, 7, 11)   # N, C, H, W all different
# union rois in input pixels: inside, crossing the left/top and the right/bottom border, one pixel,
# outside the map, on the second image, fractional corners (C-rounded), a thin one
ROIS = np.array([[0, 2, 1, 13, 9], [1, -6, -3, 8, 6], [1, 9, 4, 30, 19], [0, 7, 7, 7, 7],
                 [1, 40, 30, 50, 44], [0, 3.5, 2.5, 17.49, 8.5], [1, 0, 5, 21, 5]], np.float32)
# object boxes (row 0 is the one the kernel reads; the other rows and its batch index do nothing)
OBJECTS = {
    "part": np.array([[1, 4, 2, 9, 6], [0, 0, 0, 0, 0]], np.float32),
    "whole": np.array([[0, -100, -100, 100, 100]], np.float32),
    "left_edge": np.array([[0, -20, -20, 1.5, 40]], np.float32),
    "past_border": np.array([[0, 30, 2, 60, 9], [0, 0, 0, 21, 13], [1, 2, 2, 3, 3]], np.float32),
    "fractional": np.array([[0, 6.5, 3.49, 12.5, 5.5]], np.float32),
}


def context_net(params, obj_shape, rois_shape=(len(ROIS), 5), x_shape=X_SHAPE, bottoms=("x", "rois", "obj"),
                tops=("o",)):
    layer = ('layer { name: "o" type: "PSROIContextPooling" '
             + " ".join(f'bottom: "{b}"' for b in bottoms) + " " + " ".join(f'top: "{t}"' for t in tops)
             + f" {params} }}")
    return net(layer, inputs={"x": x_shape, "rois": rois_shape, "obj": obj_shape})


def param(scale=0.5, dim=DIM, group=G):
    return f"psroi_context_pooling_param {{ spatial_scale: {scale} output_dim: {dim} group_size: {group} }}"


@pytest.mark.parametrize("scale", [0.5, 0.75, 1.0])
@pytest.mark.parametrize("obj", sorted(OBJECTS))
def test_psroi_context_pooling_matches_the_forks_kernel(obj, scale, tmp_path):
    objects = OBJECTS[obj]
    model = load_from_text(context_net(param(scale), objects.shape))
    assert model.blob_shapes["o"] == (len(ROIS), DIM, G, G)
    x = rng(3).standard_normal(X_SHAPE).astype(np.float32)
    feeds = {"x": x, "rois": ROIS, "obj": objects}
    ref = ref_psroi_context(x, ROIS, objects, DIM, G, scale)
    assert_close(model.run(feeds)["o"], ref, 1e-6, 1e-6, "torch")
    assert_close(model_py_outputs(model, feeds, tmp_path)["o"], ref, 1e-6, 1e-6, "model.py")
    for opset in (13, None):
        assert_close(onnx_outputs(model, feeds, tmp_path, opset)["o"], ref, 1e-6, 1e-6, f"onnx opset {opset}")
    if obj in ("part", "left_edge", "fractional"):   # some bins that read the map are cut off, others kept
        full = ref_psroi_context(x, ROIS, OBJECTS["whole"], DIM, G, scale)
        assert np.any((ref == 0) & (full != 0)) and np.any(ref != 0)
    if obj == "past_border" and scale == 0.5:   # the box starts past the map's right edge: nothing kept
        assert not np.count_nonzero(ref)


def test_psroi_context_pooling_with_the_whole_map_is_psroi_pooling(tmp_path):
    # an object box over the whole map keeps every bin: the same numbers as R-FCN's PSROIPooling, in a
    # net holding both (model.py writes their shared bin helper once)
    obj = OBJECTS["whole"]
    text = (context_net(param(0.75), obj.shape)
            + f'\nlayer {{ name: "p" type: "PSROIPooling" bottom: "x" bottom: "rois" top: "p" '
              f'psroi_pooling_param {{ spatial_scale: 0.75 output_dim: {DIM} group_size: {G} }} }}')
    model = load_from_text(text)
    feeds = {"x": rng(5).standard_normal(X_SHAPE).astype(np.float32), "rois": ROIS, "obj": obj}
    got = model.run(feeds)
    np.testing.assert_array_equal(got["o"], got["p"])
    exported = model_py_outputs(model, feeds, tmp_path)
    np.testing.assert_array_equal(exported["o"], got["o"])
    np.testing.assert_array_equal(exported["p"], got["p"])
    source = (tmp_path / "py" / "model.py").read_text()
    assert source.count("def ps_roi_bins(") == 1


def test_psroi_context_pooling_hand_computed():
    # one output channel, 2x2 groups; channel k holds the constant k + 1, so bin (i, j) reads 2i + j + 1
    x = np.stack([np.full((4, 6), k + 1.0, np.float32) for k in range(4)])[None]
    rois = np.array([[0, 0, 0, 3, 3]], np.float32)   # 4x4 at scale 1: bins [0, 2) and [2, 4) on each axis
    cases = [
        ([0, 0, 0, 3, 3], [[1, 2], [3, 4]]),   # the whole roi: every bin
        ([0, 0, 0, 1, 1], [[1, 0], [0, 0]]),   # x, y in [0, 2): only touches the other bins' edges
        ([0, 2, 0, 2, 3], [[0, 2], [0, 4]]),   # the right column
        ([0, 1, 1, 2, 2], [[1, 2], [3, 4]]),   # [1, 3) overlaps both halves
        ([0, 5, 0, 5, 3], [[0, 0], [0, 0]]),   # right of the roi
    ]
    model = load_from_text(context_net(param(1, 1, 2), (1, 5), rois_shape=(1, 5), x_shape=x.shape))
    for box, expect in cases:
        got = model.run({"x": x, "rois": rois, "obj": np.array([box], np.float32)})["o"]
        np.testing.assert_array_equal(got[0, 0], np.array(expect, np.float32), err_msg=str(box))


def test_psroi_context_pooling_reads_only_the_first_object_box():
    x = rng(7).standard_normal(X_SHAPE).astype(np.float32)
    first = OBJECTS["part"][:1]
    more = np.concatenate([first, np.array([[1, 0, 0, 30, 30], [0, 5, 5, 6, 6]], np.float32)])
    model = load_from_text(context_net(param(), (3, 5)))
    got = model.run({"x": x, "rois": ROIS, "obj": more})["o"]
    alone = load_from_text(context_net(param(), (1, 5))).run({"x": x, "rois": ROIS, "obj": first})["o"]
    np.testing.assert_array_equal(got, alone)


@pytest.mark.parametrize("params, kw, msg", [
    (f"psroi_context_pooling_param {{ output_dim: {DIM} group_size: {G} }}", {}, "spatial_scale is required"),
    (param(group=0), {}, "group_size must be > 0, got 2 and 0"),
    (param(dim=-1), {}, "output_dim and group_size must be > 0"),
    (param(dim=3), {}, r"input has 18 channels; output_dim 3 x group_size\^2 9 = 27 are needed"),
    (f"psroi_pooling_param {{ spatial_scale: 0.5 output_dim: {DIM} group_size: {G} }}", {},
     "psroi_context_pooling_param is missing: the layer sets psroi_pooling_param"),
    (param(), {"bottoms": ("x", "rois")}, r"takes 3 bottoms \(data, union rois, object rois\)"),
    (param(), {"tops": ("o", "o2")}, "and one top, got 3 and 2"),
    (param(), {"rois_shape": (7, 4)}, "rois must be"),
    (param(), {"obj_shape": (1, 4)}, r"object boxes \(third bottom\) must be \(R, 5\)"),
    (param(), {"obj_shape": (0, 5)}, r"object boxes \(third bottom\) are empty"),
])
def test_psroi_context_pooling_refuses_bad_params_and_shapes(params, kw, msg):
    kw = {"obj_shape": (1, 5), **kw}
    with pytest.raises(LayerError, match=msg) as e:
        load_from_text(context_net(params, **kw))
    assert "\n" not in str(e.value)


def test_psroi_context_pooling_bad_batch_index_and_empty_objects():
    model = load_from_text(context_net(param(), (1, 5), rois_shape=(1, 5)))
    with pytest.raises(LayerError, match="batch index 2 is outside the batch of 2"):
        model.run({"x": np.zeros(X_SHAPE, np.float32), "rois": np.array([[2, 0, 0, 1, 1]], np.float32),
                   "obj": np.zeros((1, 5), np.float32)})
    x = torch.zeros(X_SHAPE)
    with pytest.raises(ValueError, match="object boxes"):
        ps_roi_context_pool(x, torch.zeros((1, 5)), torch.zeros((0, 5)), DIM, G, 0.5)
    # no union rois: nothing to pool, whatever the object boxes
    assert ps_roi_context_pool(x, torch.zeros((0, 5)), torch.zeros((0, 5)), DIM, G, 0.5).shape == (0, DIM, G, G)


def test_ppr_fcn_test_exp1_reads_and_runs(tmp_path):
    # the real relation net: two branches of 1x1 convs, PSROIContextPooling over (union, subject) and
    # (union, object), then Concat / InnerProduct / Softmax; run on a smaller map with random weights
    model = caffeq.load(FILE)
    assert model.blob_shapes["psroipooled_sub_rois"] == (1, 70, 3, 3)
    assert model.blob_shapes["psroipooled_obj_rois"] == (1, 70, 3, 3)
    node = node_of(model, "psroipooled_sub_rois")
    assert node.attrs == {"scale": 0.0625, "dim": 70, "group": 3}
    small = caffeq.load(FILE, random_weights=True, input_shapes={"conv_new_1": (1, 1024, 9, 13)})
    g = rng(11)
    feeds = {"conv_new_1": g.standard_normal((1, 1024, 9, 13)).astype(np.float32),
             "union_boxes": np.array([[0, 17, 9, 190, 131]], np.float32),
             "sub_boxes": np.array([[0, 17, 40, 90, 131]], np.float32),
             "obj_boxes": np.array([[0, 120, 9, 190, 60]], np.float32)}
    got = small.run(feeds, all_blobs=True)
    for name, score, box in (("psroipooled_sub_rois", "rfcn_sub_rel", "sub_boxes"),
                             ("psroipooled_obj_rois", "rfcn_obj_rel", "obj_boxes")):
        ref = ref_psroi_context(got[score], feeds["union_boxes"], feeds[box], 70, 3, 0.0625)
        assert np.count_nonzero(ref) and np.count_nonzero(ref == 0)
        assert_close(got[name], ref, 1e-6, 1e-6, name)
    exported = model_py_outputs(small, feeds, tmp_path)
    for k, v in exported.items():
        assert_close(v, got[k], 1e-6, 1e-6, f"model.py {k}")


def test_psroi_context_pooling_param_keeps_the_forks_field_numbers():
    fields = caffe_pb2.PSROIContextPoolingParameter.DESCRIPTOR.fields_by_name
    assert {k: f.number for k, f in fields.items()} == {"spatial_scale": 1, "output_dim": 2, "group_size": 3}
    assert caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name["psroi_context_pooling_param"].number == 153
