"""Yochengliu/MLIC-KD-WSD's WSDDN layers (caffeq/layers/wsddn.py) and its ROIPooling score_scale / score_bias
(caffeq/layers/roi_pooling.py); yhldhit/CWDAN's schema fields.

References are numpy loops written here from the fork's C++ (12e92b5, caffe-MLIC/src/caffe/layers:
wsd_roigen_layer.cpp, wsd_roigen_single_scale_layer.cpp, roi_pooling_layer.cpp), in float32 as the fork.
"""
from pathlib import Path

import numpy as np
import pytest
from c_reference import c_round
from conftest import check_everywhere, fast_rcnn_bins, net, rng

from caffeq.errors import CaffeqError
from caffeq.io.schema import caffe_pb2
from caffeq.model import load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
F = np.float32


def boxes(n, r, seed, w=60.0, h=40.0):
    """(n, 5r) rows of [x1, y1, x2, y2, score] boxes, corners with fractions, some negative."""
    g = rng(seed)
    x1 = g.uniform(-5, w * 0.7, (n, r))
    y1 = g.uniform(-5, h * 0.7, (n, r))
    x2 = x1 + g.uniform(0, w * 0.5, (n, r))
    y2 = y1 + g.uniform(0, h * 0.5, (n, r))
    score = g.uniform(0, 1, (n, r))
    return np.stack([x1, y1, x2, y2, score], 2).reshape(n, 5 * r).astype(F)


def ref_roigen(b, single=None, origin=None):
    """WsdRoigen(SingleScale)::Forward_cpu: top[6 (i R + j) + k] from bottom[C i + 5 j + k]."""
    n, c = b.shape[0], b.shape[1]
    r = c // 5
    flat = b.reshape(-1)
    top = np.zeros(n * r * 6, F)
    for i in range(n):
        for j in range(r):
            o = 6 * (i * r + j)
            top[o] = F(i)
            for k in range(4):
                v = flat[c * i + 5 * j + k]
                top[o + 1 + k] = v if single is None else np.floor(F(single) * v / F(origin))
            top[o + 5] = flat[c * i + 5 * j + 4]
    return top.reshape((n * r, 6) + b.shape[2:])


def roigen_net(kind, shape, params=""):
    return net(f'layer {{ name: "g" type: "{kind}" bottom: "b" top: "o" {params} }}', inputs={"b": shape})


@pytest.mark.parametrize("shape", [(2, 15), (3, 20, 1, 1)])
def test_wsd_roigen_matches_the_fork(shape, tmp_path):
    b = boxes(shape[0], shape[1] // 5, 1).reshape(shape)
    model = load_from_text(roigen_net("WsdRoigen", shape))
    check_everywhere(model, {"b": b}, {"o": ref_roigen(b)}, tmp_path)


@pytest.mark.parametrize("params, single, origin", [("", 224, 672),
                                                    ("roi_pooling_param { single_scale: 300 origin_scale: 457 }",
                                                     300, 457)])
def test_wsd_roigen_single_scale_matches_the_fork(params, single, origin, tmp_path):
    b = boxes(2, 7, 2, w=700, h=500).reshape(2, 35, 1, 1)
    model = load_from_text(roigen_net("WsdRoigenSingleScale", b.shape, params))
    ref = ref_roigen(b, single, origin)
    assert (ref[:, 1:5] != ref[:, 1:5].astype(np.int64)).sum() == 0   # whole numbers, as the fork floors
    check_everywhere(model, {"b": b}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("shape, msg", [((2, 7), "positive multiple of 5"), ((2, 10, 2, 3), "more than one value"),
                                        ((4,), "at least 2 axes")])
def test_wsd_roigen_refuses_bottoms_the_fork_cannot_lay_out(shape, msg):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(roigen_net("WsdRoigen", shape))


def test_wsd_roigen_single_scale_needs_a_positive_origin():
    with pytest.raises(CaffeqError, match="roi_pooling_param.origin_scale must be >= 1"):
        load_from_text(roigen_net("WsdRoigenSingleScale", (1, 10), "roi_pooling_param { origin_scale: 0 }"))


# ---- ROIPooling with score_scale / score_bias ---------------------------------------------------------------

def ref_scored_pool(x, rois, ph, pw, scale, score_scale, score_bias):
    """roi_pooling_layer.cpp Forward_cpu: Fast R-CNN's max per bin (0 when empty), times
    (score_scale x ebscore + score_bias) in float32."""
    n, c, h, w = x.shape
    out = np.zeros((rois.shape[0], c, ph, pw), F)
    for r, roi in enumerate(rois.reshape(rois.shape[0], 6)):
        b = int(roi[0])
        x1, y1, x2, y2 = (int(c_round(float(F(v) * F(scale)))) for v in roi[1:5])
        factor = F(score_scale) * F(roi[5]) + F(score_bias)
        for i, j, hs, he, ws, we in fast_rcnn_bins(x1, y1, x2, y2, ph, pw, h, w):
            for ch in range(c):
                best = F(0) if (he <= hs or we <= ws) else x[b, ch, hs:he, ws:we].max()
                out[r, ch, i, j] = factor * best
    return out


def scored_rois(seed):
    g = rng(seed)
    rows = []
    for k in range(7):
        x1, y1 = g.uniform(-4, 30), g.uniform(-4, 20)
        rows.append([k % 2, x1, y1, x1 + g.uniform(0, 25), y1 + g.uniform(0, 18), g.uniform(0, 1)])
    rows.append([1, 80, 10, 90, 20, 0.7])    # right of the map: every bin empty, 0 times the score
    return np.array(rows, F)


@pytest.mark.parametrize("score_scale, score_bias", [(1, 0), (0.5, 0.25), (-2, 1.5)])
def test_roi_pooling_scores_match_the_fork(score_scale, score_bias, tmp_path):
    x = rng(3).standard_normal((2, 3, 7, 9)).astype(F)
    rois = scored_rois(4).reshape(8, 6, 1, 1)
    params = f"pooled_h: 3 pooled_w: 2 spatial_scale: 0.25 score_scale: {score_scale} score_bias: {score_bias}"
    model = load_from_text(net(f'layer {{ name: "p" type: "ROIPooling" bottom: "x" bottom: "rois" top: "o" '
                               f'roi_pooling_param {{ {params} }} }}', inputs={"x": x.shape, "rois": rois.shape}))
    ref = ref_scored_pool(x, rois, 3, 2, 0.25, score_scale, score_bias)
    assert (ref[7] == 0).all() and not (ref[:7] == 0).all()
    check_everywhere(model, {"x": x, "rois": rois}, {"o": ref}, tmp_path)


def test_roi_pooling_without_score_fields_keeps_five_columns():
    model = load_from_text(net('layer { name: "p" type: "ROIPooling" bottom: "x" bottom: "rois" top: "o" '
                               'roi_pooling_param { pooled_h: 2 pooled_w: 2 } }', inputs={"x": (1, 2, 5, 6), "rois": (3, 5)}))
    assert "score" not in model.layers[-1].attrs


@pytest.mark.parametrize("params, rois, msg", [
    ("pooled_h: 2 pooled_w: 2 score_scale: 1", (3, 5), r"rois must be \(R, 6\)"),
    ("pooled_h: 2 pooled_w: 2 score_bias: 0 pad_ratio: 0.1", (3, 6), "cannot be set with pool AVE or pad_ratio"),
])
def test_roi_pooling_scores_refuse_bad_setups(params, rois, msg):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(net(f'layer {{ name: "p" type: "ROIPooling" bottom: "x" bottom: "rois" top: "o" '
                           f'roi_pooling_param {{ {params} }} }}', inputs={"x": (1, 2, 5, 6), "rois": rois}))


def test_wsddn_deploy_head_proposals_to_scored_pooling(tmp_path):
    """The deploy net's front: proposaldata (N, 5R, 1, 1) -> WsdRoigen -> ROIPooling with the scores."""
    x = rng(5).standard_normal((2, 4, 9, 7)).astype(F)
    props = boxes(2, 3, 6, w=100, h=120).reshape(2, 15, 1, 1)
    model = load_from_text(net(
        'layer { name: "roi" type: "WsdRoigen" bottom: "p" top: "roi" }',
        'layer { name: "pool" type: "ROIPooling" bottom: "x" bottom: "roi" top: "o" roi_pooling_param { '
        'pooled_h: 3 pooled_w: 3 spatial_scale: 0.0625 score_scale: 1 score_bias: 0 } }',
        inputs={"x": x.shape, "p": props.shape}))
    ref = ref_scored_pool(x, ref_roigen(props), 3, 3, 0.0625, 1, 0)
    check_everywhere(model, {"x": x, "p": props}, {"o": ref}, tmp_path)


# ---- HumanAttData ------------------------------------------------------------------------------------------

HUMAN_ATT = '''layer {{ name: "data" type: "HumanAttData" top: "data" top: "label_roi"
  transform_param {{ mirror: false {crop} mean_value: 103.52 mean_value: 116.28 mean_value: 123.675 }}
  human_att_data_param {{ source: "missing.txt" batch_size: 16 new_width: 672 new_height: 600 att_num: 80
                          bbox_num: 500 {extra} }} }}
layer {{ name: "slice" type: "Slice" bottom: "label_roi" top: "labels" top: "list_roi"
  slice_param {{ axis: 1 slice_point: 80 }} }}
layer {{ name: "roi" type: "WsdRoigen" bottom: "list_roi" top: "roi" }}'''


def test_human_att_data_shapes_its_tops_from_the_param():
    shapes = load_from_text(HUMAN_ATT.format(crop="", extra="")).blob_shapes
    assert shapes["data"] == (16, 3, 600, 672) and shapes["label_roi"] == (16, 80 + 5 * 500)
    assert shapes["list_roi"] == (16, 2500) and shapes["roi"] == (16 * 500, 6)
    shapes = load_from_text(HUMAN_ATT.format(crop="crop_size: 224", extra="is_color: false")).blob_shapes
    assert shapes["data"] == (16, 1, 224, 224)


def test_human_att_data_refuses_half_a_size_and_no_batch():
    with pytest.raises(CaffeqError, match="new_height and new_width must be set together"):
        load_from_text(HUMAN_ATT.format(crop="", extra="").replace("new_height: 600", ""))
    with pytest.raises(CaffeqError, match="human_att_data_param.batch_size must be >= 1"):
        load_from_text(HUMAN_ATT.format(crop="", extra="").replace("batch_size: 16", ""))


# ---- the schema: MLIC-KD-WSD and CWDAN fields --------------------------------------------------------------

def test_fork_fields_and_numbers():
    roi = caffe_pb2.ROIPoolingParameter.DESCRIPTOR.fields_by_name
    assert {k: roi[k].number for k in ("score_scale", "score_bias", "single_scale", "origin_scale")} == \
        {"score_scale": 50004, "score_bias": 30005, "single_scale": 8, "origin_scale": 9}
    p = caffe_pb2.ROIPoolingParameter()
    assert (p.score_scale, p.score_bias, p.single_scale, p.origin_scale, p.top_cls) == (1, 0, 224, 672, 10)
    lp = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert (lp["human_att_data_param"].number, lp["mmd_param"].number, lp["nsoft_param"].number,
            lp["specific_mmd_param"].number) == (120148, 100147, 130148, 110149)
    assert caffe_pb2.ImageDataParameter().class_num == 10


def test_cwdan_training_fields_are_read_and_ignored():
    text = '''layer { name: "data" type: "Input" top: "data" top: "label" top: "weight"
  input_param { shape { dim: 2 dim: 8 } shape { dim: 2 } shape { dim: 2 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 3 } }
layer { name: "mmd" type: "MMDLoss" bottom: "fc" bottom: "label" bottom: "weight" top: "fc"
  mmd_param { num_of_kernel: 10 mmd_lambda: 0.01 iter_of_epoch: 22 method_param { top_num: 5 i_lambda: 0.0 }
              method: "none" kernel_mul: 2.0 fix_gamma: false mmd_lr: 10.0 quad_weight: 0.0 } }
layer { name: "smmd" type: "SpecificMMDLoss" bottom: "fc" bottom: "label" top: "fc"
  mmd_param { num_of_kernel: 10 mmd_lock: 1 num_class: 10 entropy_thresh: 10.0 }
  specific_mmd_param { num_of_kernel: 5 mmd_lambda: 0.03 thresh: 10.0 method_param { top_num: 5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss"
  nsoft_param { trainfile: "t.txt" tmpfile: "u.txt" batch_size: 1123 num_of_source: 958 num_of_target: 1123
                target_lambda: 0.01 } }'''
    from google.protobuf import text_format
    netp = text_format.Parse(text, caffe_pb2.NetParameter())
    assert netp.layer[2].mmd_param.method_param.top_num == 5 and netp.layer[3].specific_mmd_param.thresh == 10
    assert netp.layer[4].nsoft_param.num_of_source == 958 and netp.layer[4].nsoft_param.wable
    assert load_from_text(text).blob_shapes["fc"] == (2, 3)


# ---- the corpus files --------------------------------------------------------------------------------------

def test_the_forks_files_read():
    deploy = load_from_text((REALWORLD / "Yochengliu__MLIC-KD-WSD__wsddn__wsddn_deploy.prototxt").read_text())
    s = deploy.blob_shapes
    assert s["roi"] == (500, 6, 1, 1) and s["roi_pooling"] == (500, 512, 7, 7)
    assert s["image_level_score"] == (1, 1, 80, 1)
    stage1 = load_from_text((REALWORLD / "Yochengliu__MLIC-KD-WSD__kd__train_stage1.prototxt").read_text())
    assert stage1.blob_shapes["data"] == (stage1.blob_shapes["data"][0], 3, 672, 672)
