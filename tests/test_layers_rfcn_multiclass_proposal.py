"""32l/rfcn_multiclass_split's Proposal (b52c261, caffe/src/caffe/layers/proposal_layer.cpp / .cu, util/nms.cu),
told by its 2-value im_info [img_H, img_W] (caffeq/layers/pva_proposal.py): its own anchors (unrounded ratio
sides, half sides 0.5 * (int)(side * scale / base_size - 1 + 0.5)), clipping to [0, img_W - 1] x [0, img_H - 1]
and min_size unscaled, as its GPU Forward.  The reference, from that C++ in float32: its anchors below, then
PVANet's test reference with those bounds (ref_proposal_bounds: the fork's decoding, sort_box and NMS are PVANet's)."""
import os

import numpy as np
import pytest
from conftest import REPO, check_everywhere
from test_layers_pva_proposal import ref_anchors, ref_proposal_bounds

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

f = np.float32
CORPUS = str(REPO / "tests" / "fixtures" / "realworld" / "32l__rfcn_multiclass_split__jobs__upper_face__pz_S_biger_net_pretrain__deploy.prototxt")


def fork_anchors(base, ratios, scales):
    centre = f(0.5) * (f(base) - f(1))
    out = []
    for r in ratios:
        rw = f(np.sqrt(f(base * base) / f(r)))
        rh = f(rw * f(r))
        for s in scales:
            # ROUND(ratio_w * scale * 1.0 / base_size - 1): the float product, then double arithmetic
            sw = f(0.5) * f(int(float(f(rw * f(s))) * 1.0 / base - 1.0 + 0.5))
            sh = f(0.5) * f(int(float(f(rh * f(s))) * 1.0 / base - 1.0 + 0.5))
            out.append([centre - sw, centre - sh, centre + sw, centre + sh])
    return np.array(out, f)


PARAM = ("feat_stride: 8 base_size: 8 min_size: 9 ratio: 1 ratio: 1.5 scale: 15 scale: 25 scale: 37 "
         "pre_nms_topn: 30 post_nms_topn: 12 nms_thresh: 0.6")
A, H, W = 6, 5, 7   # 2 ratios x 3 scales, a 5 x 7 map


def proposal_net(info_values, batch=1):
    return (f'layer {{ name: "p" type: "Input" top: "prob" input_param {{ shape {{ dim: {batch} dim: {2 * A} '
            f'dim: {H} dim: {W} }} }} }}\n'
            f'layer {{ name: "d" type: "Input" top: "deltas" input_param {{ shape {{ dim: {batch} dim: {4 * A} '
            f'dim: {H} dim: {W} }} }} }}\n'
            f'layer {{ name: "i" type: "Input" top: "im_info" input_param {{ shape {{ dim: 1 dim: {info_values} }} }} '
            f'}}\nlayer {{ name: "proposal" type: "Proposal" bottom: "prob" bottom: "deltas" bottom: "im_info" '
            f'top: "rois" top: "scores" proposal_param {{ {PARAM} }} }}')


def make_feeds(info, seed=2, batch=1):
    g = np.random.default_rng(seed)
    return {"prob": g.random((batch, 2 * A, H, W)).astype(f),
            "deltas": (g.standard_normal((batch, 4 * A, H, W)) * 0.5).astype(f), "im_info": np.array([info], f)}


def test_fork_anchors_from_its_generate_anchors():
    model = load_from_text(proposal_net(2))
    attrs = model.graph.node("proposal").attrs
    got = np.array(attrs["info2_anchors"], f)
    np.testing.assert_array_equal(got, fork_anchors(8, [1, 1.5], [15, 25, 37]))
    # ratio 1, scale 15: half side 0.5 * (int)(8 * 15 / 8 - 1 + 0.5) = 7 around 3.5
    assert got[0].tolist() == [-3.5, -3.5, 10.5, 10.5]
    # PVANet's anchors stay the layer's own for its 4-value im_info
    np.testing.assert_array_equal(np.array(attrs["anchors"], f), ref_anchors(8, [1, 1.5], [15, 25, 37]))


def test_two_value_im_info_runs_as_the_fork_everywhere(tmp_path):
    """[img_H, img_W] with H != W clips each side to its own bound; min_size 9 is compared unscaled (the
    size filter zeroes boxes, but fewer than would leave a tie at the pre-NMS cut)."""
    model = load_from_text(proposal_net(2))
    x = make_feeds([37.0, 51.0])
    rois, scores = ref_proposal_bounds(x["prob"], x["deltas"], 37.0, 51.0, f(9), f(9), 8,
                                       fork_anchors(8, [1, 1.5], [15, 25, 37]), 30, 12, 0.6)
    assert 0 < len(rois) <= 12 and (scores > 0).all()
    assert rois[:, 3].max() <= 50 and rois[:, 4].max() <= 36
    check_everywhere(model, x, {"rois": rois, "scores": scores}, tmp_path, atol=1e-4)


def test_min_size_is_not_scaled_by_a_missing_im_info_value():
    """A big min_size zeroes most boxes: exactly those the fork's unscaled bound zeroes (torch, ties in its
    sort order)."""
    text = proposal_net(2).replace("min_size: 9", "min_size: 21").replace("post_nms_topn: 12", "post_nms_topn: 30")
    text = text.replace("nms_thresh: 0.6", "nms_thresh: 0.99").replace("pre_nms_topn: 30", "pre_nms_topn: 300")
    model = load_from_text(text)
    x = make_feeds([44.0, 30.0], seed=5)
    rois, scores = ref_proposal_bounds(x["prob"], x["deltas"], 44.0, 30.0, f(21), f(21), 8,
                                       fork_anchors(8, [1, 1.5], [15, 25, 37]), 300, 30, 0.99)
    out = model.run(x)
    assert (scores == 0).any() and (scores > 0).any()
    np.testing.assert_allclose(out["rois"], rois, atol=1e-4, rtol=0)
    np.testing.assert_allclose(out["scores"], scores, atol=1e-6, rtol=0)


def test_four_value_im_info_keeps_pvanet(tmp_path):
    model = load_from_text(proposal_net(4))
    x = make_feeds([37.0, 51.0, 0.5, 1.5])
    rois, scores = ref_proposal_bounds(x["prob"], x["deltas"], 37.0, 51.0, f(f(9) * f(0.5)), f(f(9) * f(1.5)), 8,
                                       ref_anchors(8, [1, 1.5], [15, 25, 37]), 30, 12, 0.6)
    out = model.run(x)
    np.testing.assert_allclose(out["rois"], rois, atol=1e-4, rtol=0)
    np.testing.assert_allclose(out["scores"], scores, atol=1e-6, rtol=0)


def test_one_value_and_batches_are_refused():
    model = load_from_text(proposal_net(1))
    with pytest.raises(CaffeqError, match=r"im_info must hold .*\[height, width\]"):
        model.run(make_feeds([37.0]))
    with pytest.raises(CaffeqError, match="one image per batch"):
        load_from_text(proposal_net(2, batch=2))


@pytest.mark.skipif(not os.path.exists(CORPUS), reason="32l/rfcn_multiclass_split's deploy file is not here")
def test_the_forks_deploy_file_runs():
    model = load(CORPUS, random_weights=True)
    g = np.random.default_rng(0)
    out = model.run({"data": g.standard_normal((1, 3, 224, 224)).astype(f),
                     "im_info": np.array([[224.0, 160.0]], f)}, all_blobs=True)
    for name in ("person_upper_rois", "person_face_rois"):
        rois = out[name]
        assert rois.shape == (200, 5)
        assert (rois[:, 0] == 0).all() and (rois[:, 1:] >= 0).all()
        assert rois[:, 3].max() <= 159 and rois[:, 4].max() <= 223
