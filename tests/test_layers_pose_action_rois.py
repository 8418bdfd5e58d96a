"""zimenglan-sysu-512/pose_action_caffe's action and zhu.face layers (caffeq/layers/pose_action_rois.py).

References are numpy loops written here from the fork's C++ (d397a23: cross_blobs_sum_layer.cpp,
extract_primary_layer.cpp, secondary_regions_op_scores_layer.cpp) on shapes whose N, C, H and W differ.
"""
import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text


def net(inputs, *layers):
    head = "".join(f'input: "{k}"\ninput_shape {{ {" ".join(f"dim: {d}" for d in s)} }}\n' for k, s in inputs.items())
    return 'name: "rois"\n' + head + "\n".join(layers)


def test_cross_blobs_sum(tmp_path):
    g = rng(1)
    xs = [g.standard_normal((2, 3, 4, 5)).astype(np.float32) for _ in range(3)]
    model = load_from_text(net({"a": (2, 3, 4, 5), "b": (2, 3, 4, 5), "c": (2, 3, 4, 5)},
                               'layer { name: "s" type: "CrossBlobsSum" bottom: "a" bottom: "b" bottom: "c" top: "o" }'))
    ref = np.zeros_like(xs[0])
    for x in xs:          # caffe_cpu_axpby(1, x, 1, top), bottom by bottom
        ref = ref + x
    check_everywhere(model, dict(zip("abc", xs)), {"o": ref}, tmp_path, atol=1e-6)


def test_cross_blobs_sum_needs_one_shape():
    with pytest.raises(CaffeqError, match="must share one shape"):
        load_from_text(net({"a": (2, 3, 4, 5), "b": (2, 3, 5, 4)},
                           'layer { name: "s" type: "CrossBlobsSum" bottom: "a" bottom: "b" top: "o" }'))


def ref_extract(x, ipb):
    n = x.shape[0]
    sub = x[0].size
    flat = x.reshape(-1)
    k = (n - ipb) // ipb          # top_sub_count2 / sub: secondary rows per image
    p, s, off = [], [], 0
    for _ in range(ipb):
        p.append(flat[off:off + sub])
        off += sub
        s.append(flat[off:off + k * sub])
        off += k * sub
    return (np.concatenate(p).reshape((ipb,) + x.shape[1:]),
            np.concatenate(s).reshape((n - ipb,) + x.shape[1:]))


def test_extract_primary(tmp_path):
    x = rng(2).standard_normal((8, 3, 2, 5)).astype(np.float32)
    model = load_from_text(net({"x": x.shape}, 'layer { name: "e" type: "ExtractPrimary" bottom: "x" '
                                                'top: "p" top: "s" extract_primary_param { ims_per_batch: 2 } }'))
    p, s = ref_extract(x, 2)
    check_everywhere(model, {"x": x}, {"p": p, "s": s}, tmp_path)


def test_extract_primary_without_secondary_rows_is_read_not_run():
    model = load_from_text(net({"x": (2, 3, 1, 1)}, 'layer { name: "e" type: "ExtractPrimary" bottom: "x" '
                                                     'top: "p" top: "s" extract_primary_param { ims_per_batch: 2 } }'))
    e = node_of(model, "e")
    assert model.graph.shape(e.outputs[1]) == (1, 3, 1, 1)
    with pytest.raises(CaffeqError, match="no secondary regions"):
        model.run({"x": np.zeros((2, 3, 1, 1), np.float32)})


@pytest.mark.parametrize("param", ["", "extract_primary_param { ims_per_batch: 0 }",
                                   "extract_primary_param { ims_per_batch: 3 }"])
def test_extract_primary_bad_params(param):
    with pytest.raises(CaffeqError, match="ims_per_batch"):
        load_from_text(net({"x": (8, 3, 1, 1)}, f'layer {{ name: "e" type: "ExtractPrimary" bottom: "x" '
                                                 f'top: "p" top: "s" {param} }}'))


def ref_op_scores(x, r, op):
    n = x.shape[0]
    sub = x[0].size
    flat = x.reshape(n, sub)
    top = np.zeros((n // r, sub), np.float32)
    rows, offs = np.full((n // r, sub), -1.0, np.float32), np.full((n // r, sub), -1.0, np.float32)
    for i in range(n // r):
        if op == 0:
            top[i] = np.float32(-3.4028235e38)
        for j in range(r):
            for s in range(sub):
                v = flat[i * r + j, s]
                if op == 0:
                    if v > top[i, s]:
                        top[i, s], rows[i, s], offs[i, s] = v, i * r + j, (i * r + j) * sub + s
                else:
                    top[i, s] += v
    if op == 2:
        top = top * (np.float32(1) / np.float32(r))
    shape = (n // r,) + x.shape[1:]
    return top.reshape(shape), rows.reshape(shape), offs.reshape(shape)


@pytest.mark.parametrize("op, name", [(0, "MAX"), (1, "SUM"), (2, "AVE")])
def test_secondary_regions_op_scores_from_param(tmp_path, op, name):
    x = rng(3).standard_normal((6, 4, 2, 3)).astype(np.float32)
    x[3, 1, 0, 2] = x[4, 1, 0, 2] = 7.0    # a tie: the first row wins
    tops = 'top: "o" top: "row" top: "at"' if op == 0 else 'top: "o"'
    model = load_from_text(net({"x": x.shape}, f'layer {{ name: "m" type: "SecondaryRegionsOpScores" bottom: "x" '
                                                f'{tops} secondary_regions_op_scores_param {{ n_secondary_regions: 4 '
                                                f'has_scene_branch: true op_scores: {name} }} }}'))
    o, row, at = ref_op_scores(x, 3, op)
    refs = {"o": o, "row": row, "at": at} if op == 0 else {"o": o}
    got_torch = model.run({"x": x})
    got_py = model_py_outputs(model, {"x": x}, tmp_path)
    for k, v in refs.items():
        np.testing.assert_allclose(got_torch[k], v, atol=1e-6)
        np.testing.assert_allclose(got_py[k], v, atol=1e-6)
    if op == 0:
        assert row[1, 1, 0, 2] == 3


def test_secondary_regions_op_scores_count_from_a_bottom(tmp_path):
    x = rng(4).standard_normal((6, 2, 1, 1)).astype(np.float32)
    cnt = np.full((2, 1, 1, 1), 3, np.float32)
    model = load_from_text(net({"x": x.shape, "n": cnt.shape},
                               'layer { name: "m" type: "SecondaryRegionsOpScores" bottom: "x" bottom: "n" top: "o" '
                               'secondary_regions_op_scores_param { op_scores: AVE } }'),
                           input_shapes={"o": (2, 2, 1, 1)})
    ref = ref_op_scores(x, 3, 2)[0]
    np.testing.assert_allclose(model.run({"x": x, "n": cnt})["o"], ref, atol=1e-6)
    np.testing.assert_allclose(model_py_outputs(model, {"x": x, "n": cnt}, tmp_path)["o"], ref, atol=1e-6)


def test_secondary_regions_op_scores_bad_params():
    with pytest.raises(CaffeqError, match="n_secondary_regions > 0"):
        load_from_text(net({"x": (6, 2, 1, 1)}, 'layer { name: "m" type: "SecondaryRegionsOpScores" bottom: "x" '
                                                 'top: "o" secondary_regions_op_scores_param { op_scores: SUM } }'))
    with pytest.raises(CaffeqError, match="do not split"):
        load_from_text(net({"x": (6, 2, 1, 1)}, 'layer { name: "m" type: "SecondaryRegionsOpScores" bottom: "x" '
                                                 'top: "o" secondary_regions_op_scores_param { n_secondary_regions: 4 } }'))


def test_zhu_face_crop_and_resize_are_sized_not_run():
    text = net({"a": (2, 3, 10, 14), "b": (2, 4, 5, 7), "c": (2, 4, 10, 14)},
               'layer { name: "crop" type: "CropPatchFromMaxFeaturePosition" bottom: "a" bottom: "b" bottom: "a" '
               'bottom: "c" top: "pa" top: "pc" crop_patch_from_max_feature_position_param { crop_factor: 0.35 '
               'match_channel: false match_channel: true } }',
               'layer { name: "rs" type: "ResizeWithMap" bottom: "a" bottom: "b" bottom: "c" top: "r" }')
    model = load_from_text(text)
    crop, rs = node_of(model, "crop"), node_of(model, "rs")
    assert [model.graph.shape(t) for t in crop.outputs] == [(2, 12, 3, 4), (2, 4, 3, 4)]
    assert model.graph.shape(rs.outputs[0]) == (2, 4, 5, 7)
    with pytest.raises(CaffeqError, match="GetMapBetweenFeatureMap"):
        model.run({k: np.zeros(s, np.float32) for k, s in (("a", (2, 3, 10, 14)), ("b", (2, 4, 5, 7)),
                                                           ("c", (2, 4, 10, 14)))})
    with pytest.raises(CaffeqError, match="the fork CHECKs it"):
        load_from_text(net({"a": (1, 1, 4, 4)}, 'layer { name: "crop" type: "CropPatchFromMaxFeaturePosition" '
                                                 'bottom: "a" bottom: "a" bottom: "a" top: "p" }'))
