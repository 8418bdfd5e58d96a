"""HAKE-Action's ROIPairPooling and cgangEE/ohem's ROIAlignHalf, ROIAlign and ProposalCluster
(caffeq/layers/hake_ohem.py).  The references are numpy loops written here from the forks' kernels in
float32 scalars (the kernels' Dtype):
- ROIPairPooling: DirtyHarryLYL/HAKE-Action 8122693 (Image-level-HAKE-Action) roipair_pooling_layer.cu
  ROIPairPoolForward (torch, ONNX and model.py);
- ROIAlignHalf / ROIAlign: cgangEE/ohem b7552ce roi_align_half_layer.cu (GetBottomRoisHalf, ROIPoolForward)
  and roi_align_layer.cu;
- ProposalCluster: proposal_cluster_layer.cpp generate_anchors; the rest is PVANet's Proposal, whose
  reference test_layers_pva_proposal.py holds.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from c_reference import c_round
from conftest import REPO, assert_close, check_everywhere, model_py_outputs, net, onnx_outputs, rng
from test_layers_pva_proposal import feeds as pva_feeds
from test_layers_pva_proposal import ref_proposal

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
FLT_MAX = F(3.4028234663852886e38)
CORPUS = REPO / "tests" / "fixtures" / "realworld"


# ---- references --------------------------------------------------------------------------------

def ref_roipair(x, rois1, rois2, ph, pw, scale):
    _n, c, h, w = x.shape
    out = np.zeros((len(rois1), c, ph, pw), F)
    for n in range(len(rois1)):
        a = [int(c_round(F(v) * F(scale))) for v in rois1[n][1:5]]
        b = [int(c_round(F(v) * F(scale))) for v in rois2[n][1:5]]
        sw, sh, ew, eh = min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])
        rw, rh = max(ew - sw + 1, 1), max(eh - sh + 1, 1)
        bh, bw = F(rh) / F(ph), F(rw) / F(pw)
        plane = x[int(rois1[n][0])]
        for i in range(ph):
            for j in range(pw):
                hs = min(max(int(np.floor(F(i) * bh)) + sh, 0), h)
                he = min(max(int(np.ceil(F(i + 1) * bh)) + sh, 0), h)
                ws = min(max(int(np.floor(F(j) * bw)) + sw, 0), w)
                we = min(max(int(np.ceil(F(j + 1) * bw)) + sw, 0), w)
                for ch in range(c):
                    best = F(0)
                    for yy in range(hs, he):
                        for xx in range(ws, we):
                            in1 = a[0] < xx < a[2] and a[1] < yy < a[3]
                            in2 = b[0] < xx < b[2] and b[1] < yy < b[3]
                            if plane[ch, yy, xx] > best and (in1 or in2):
                                best = plane[ch, yy, xx]
                    out[n, ch, i, j] = best
    return out


def ref_ohem_align(x, rois, ph, pw, scale, half):
    _n, c, height, width = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    for n, roi in enumerate(rois):
        roi = [F(v) for v in roi]
        if half:
            roi[4] = (roi[2] + roi[4]) / F(2)
        sw, sh, ew, eh = (v * F(scale) for v in roi[1:5])
        bh = max(eh - sh, F(1)) / F(ph)
        bw = max(ew - sw, F(1)) / F(pw)
        plane = x[int(roi[0])]
        for i in range(ph):
            for j in range(pw):
                hs = min(max(F(i) * bh + sh, F(0)), F(height))
                he = min(max(F(i + 1) * bh + sh, F(0)), F(height))
                ws = min(max(F(j) * bw + sw, F(0)), F(width))
                we = min(max(F(j + 1) * bw + sw, F(0)), F(width))
                empty = he <= hs or we <= ws
                best = np.full(c, F(0) if empty else -FLT_MAX, F)
                hh = hs
                while hh < he:
                    ww = ws
                    while ww < we:
                        if int(np.ceil(hh)) == height:
                            hh = F(height - 1)
                        if int(np.ceil(ww)) == width:
                            ww = F(width - 1)
                        h1, h2, w1, w2 = int(hh), int(np.ceil(hh)), int(ww), int(np.ceil(ww))
                        q11, q21 = plane[:, h1, w1], plane[:, h2, w1]
                        q12, q22 = plane[:, h1, w2], plane[:, h2, w2]
                        if h1 == h2:
                            val = q11 if w1 == w2 else q11 * (F(w2) - ww) + q12 * (ww - F(w1))
                        elif w1 == w2:
                            val = q11 * (F(h2) - hh) + q21 * (hh - F(h1))
                        else:
                            val = (q11 * (F(h2) - hh) * (F(w2) - ww) + q12 * (F(h2) - hh) * (ww - F(w1))
                                   + q21 * (hh - F(h1)) * (F(w2) - ww) + q22 * (hh - F(h1)) * (ww - F(w1)))
                        best = np.where(val > best, val, best)
                        ww = F(ww + F(1))
                    hh = F(hh + F(1))
                out[n, :, i, j] = best
    return out


def ref_cluster_anchors(base, sides):
    centre = F(0.5) * (F(base) - F(1))
    rows = []
    for j in range(len(sides) // 2):
        sw, sh = F(0.5) * (F(sides[2 * j]) - F(1)), F(0.5) * (F(sides[2 * j + 1]) - F(1))
        rows.append([centre - sw, centre - sh, centre + sw, centre + sh])
    return np.array(rows, F)


# ---- ROIPairPooling ----------------------------------------------------------------------------

X_SHAPE = (2, 3, 9, 13)
ROIS1 = np.array([[0, 2, 1, 20, 14], [1, 0, 0, 25, 17], [1, 10, 6, 12, 8], [0, -8, -4, 9, 5],
                  [1, 30, 20, 60, 40], [0, 5.5, 3.25, 17.75, 9.5]], F)
ROIS2 = np.array([[0, 12, 8, 26, 17], [1, 4, 3, 9, 6], [0, 1, 1, 3, 3], [1, 18, 2, 24, 12],
                  [0, 0, 0, 2, 2], [1, 0, 10, 8, 16]], F)


def pair_net(params, rois=len(ROIS1), shape=X_SHAPE):
    return net('layer { name: "o" type: "ROIPairPooling" bottom: "x" bottom: "r1" bottom: "r2" top: "o" '
               f'roipair_pooling_param {{ {params} }} }}', inputs={"x": shape, "r1": (rois, 5), "r2": (rois, 5)})


@pytest.mark.parametrize("ph, pw, scale", [(3, 2, 0.5), (2, 5, 1.0), (4, 3, 0.25)])
def test_roipair_pooling_matches_the_kernel(ph, pw, scale, tmp_path):
    model = load_from_text(pair_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale}"))
    assert model.blob_shapes["o"] == (len(ROIS1), 3, ph, pw)
    x = rng(ph).standard_normal(X_SHAPE).astype(F)
    f = {"x": x, "r1": ROIS1, "r2": ROIS2}
    ref = ref_roipair(x, ROIS1, ROIS2, ph, pw, scale)
    assert (ref > 0).any() and (ref == 0).any()
    check_everywhere(model, f, {"o": ref}, tmp_path)


def test_roipair_pooling_skips_the_rois_border_cells(tmp_path):
    # one roi, one bin covering the map: the only large values sit on roi1's border
    x = np.zeros((2, 3, 9, 13), F)
    x[1, :, 2, 3:8] = 5.0      # roi1's top row
    x[1, :, 4, 5] = 1.5        # strictly inside roi1
    r1 = np.array([[1, 3, 2, 7, 6]], F)
    r2 = np.array([[0, 9, 1, 11, 3]], F)
    model = load_from_text(pair_net("pooled_h: 1 pooled_w: 1", rois=1))
    ref = ref_roipair(x, r1, r2, 1, 1, 1.0)
    assert ref[0, 0, 0, 0] == F(1.5)
    check_everywhere(model, {"x": x, "r1": r1, "r2": r2}, {"o": ref}, tmp_path)


def test_roipair_pooling_rounds_the_float32_product(tmp_path):
    # spatial_scale 0.7 is 0.69999999 in float32: 5 x 0.7f and 15 x 0.7f round to 3.5 and 10.5 in float32 (C's
    # round: 4 and 11) but lie below them in double (3 and 10).  roi1's interior is then cells 5..10, not 4..9
    shape = (2, 3, 13, 15)
    x = np.zeros(shape, F)
    x[0, :, 4, 4] = 9.0        # inside only with the double product
    x[0, :, 10, 10] = 2.0      # inside only with the float32 product
    r1 = np.array([[0, 5, 5, 15, 15], [0, 5, 5, 15, 15]], F)
    r2 = np.array([[0, 0, 0, 1, 1], [1, 0, 0, 1, 1]], F)
    model = load_from_text(pair_net("pooled_h: 1 pooled_w: 1 spatial_scale: 0.7", rois=2, shape=shape))
    ref = ref_roipair(x, r1, r2, 1, 1, 0.7)
    assert (ref == F(2.0)).all()
    check_everywhere(model, {"x": x, "r1": r1, "r2": r2}, {"o": ref}, tmp_path)


def test_roipair_pooling_without_rois(tmp_path):
    model = load_from_text(pair_net("pooled_h: 2 pooled_w: 3", rois=0))
    empty = np.zeros((0, 5), F)
    x = rng(3).standard_normal(X_SHAPE).astype(F)
    check_everywhere(model, {"x": x, "r1": empty, "r2": empty}, {"o": np.zeros((0, 3, 2, 3), F)}, tmp_path)


@pytest.mark.parametrize("params, msg", [("pooled_h: 0 pooled_w: 2", "pooled_h and pooled_w must be > 0"),
                                         ("pooled_h: 2 pooled_w: 2 spatial_scale: inf", "finite")])
def test_roipair_pooling_bad_params(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(pair_net(params))


# ---- ROIAlignHalf and the ohem ROIAlign ---------------------------------------------------------

# the last row: (4.85 + 17.02) / 2 in float32 is 10.935, 4.85 + (17.02 - 4.85) / 2 is 10.934999
ROIS = np.array([[0, 2, 1, 13, 9], [1, -6, -3, 8, 6], [1, 9, 4, 30, 19], [0, 7, 7, 7, 7],
                 [1, 40, 30, 50, 44], [0, 3.5, 2.25, 17.75, 8.5], [1, 0, 0, 21, 13], [0, 4, 2, 9, 11],
                 [1, 1.3, 4.85, 12.7, 17.02]], F)
A_SHAPE = (2, 3, 7, 11)


def ohem_net(ph, pw, scale, half=True):
    kind = "ROIAlignHalf" if half else "ROIAlign"
    layer = (f'layer {{ name: "o" type: "{kind}" bottom: "x" bottom: "rois" top: "o" roi_pooling_param {{ '
             f'pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} }} }}')
    half_layer = ('layer { name: "h" type: "ROIAlignHalf" bottom: "x" bottom: "rois" top: "h" roi_pooling_param { '
                  'pooled_h: 1 pooled_w: 1 } }')
    return net(layer, *([] if half else [half_layer]), inputs={"x": A_SHAPE, "rois": (len(ROIS), 5)})


@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("ph, pw, scale", [(3, 2, 0.5), (2, 4, 1.0), (4, 3, 0.25)])
def test_ohem_roi_align_matches_the_kernel(half, ph, pw, scale, tmp_path):
    model = load_from_text(ohem_net(ph, pw, scale, half))
    assert model.blob_shapes["o"] == (len(ROIS), 3, ph, pw)
    x = rng(ph + 5).standard_normal(A_SHAPE).astype(F)
    f = {"x": x, "rois": ROIS}
    ref = ref_ohem_align(x, ROIS, ph, pw, scale, half)
    assert_close(model.run(f)["o"], ref, 0.0, 0.0, "torch")
    assert_close(model_py_outputs(model, f, tmp_path)["o"], ref, 0.0, 0.0, "model.py")
    with pytest.raises(ExportError, match="ROIAlign"):
        onnx_outputs(model, f, tmp_path)


def test_half_and_whole_differ_and_zhaoweicai_roi_align_is_kept():
    x = rng(1).standard_normal(A_SHAPE).astype(F)
    half = load_from_text(ohem_net(3, 2, 0.5, True)).run({"x": x, "rois": ROIS})["o"]
    whole = load_from_text(ohem_net(3, 2, 0.5, False)).run({"x": x, "rois": ROIS})["o"]
    assert not np.allclose(half, whole)
    # without the fork's ROIAlignHalf / ProposalCluster, roi_pooling_param's ROIAlign stays zhaoweicai's
    alone = load_from_text(net('layer { name: "o" type: "ROIAlign" bottom: "x" bottom: "rois" top: "o" '
                               'roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 } }',
                               inputs={"x": A_SHAPE, "rois": (len(ROIS), 5)}))
    assert alone.blob_shapes["o"] == (len(ROIS), 3, 4, 3)


def test_hand_marked_ohem_roi_align(tmp_path):
    # a net of the fork without ROIAlignHalf / ProposalCluster: the file marks its ROIAlign itself
    model = load_from_text(net('layer { name: "o" type: "ROIAlign" bottom: "x" bottom: "rois" top: "o" '
                               'roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 ohem_roi_align: true } }',
                               inputs={"x": A_SHAPE, "rois": (len(ROIS), 5)}))
    assert model.blob_shapes["o"] == (len(ROIS), 3, 3, 2)
    x = rng(4).standard_normal(A_SHAPE).astype(F)
    ref = ref_ohem_align(x, ROIS, 3, 2, 0.5, False)
    assert_close(model.run({"x": x, "rois": ROIS})["o"], ref, 0.0, 0.0, "torch")
    assert_close(model_py_outputs(model, {"x": x, "rois": ROIS}, tmp_path)["o"], ref, 0.0, 0.0, "model.py")


def test_roi_align_half_bad_params():
    with pytest.raises(LayerError, match="pooled_h and pooled_w must be > 0"):
        load_from_text(net('layer { name: "o" type: "ROIAlignHalf" bottom: "x" bottom: "rois" top: "o" '
                           'roi_pooling_param { pooled_h: 2 } }', inputs={"x": A_SHAPE, "rois": (3, 5)}))


# ---- ProposalCluster --------------------------------------------------------------------------

SIDES = [40.5, 23.25, 17.0, 61.75, 9.0, 9.0]
CLUSTER = ("feat_stride: 8 base_size: 15 min_size: 7 " + " ".join(f"scale: {v}" for v in SIDES)
           + " ratio: 3 pre_nms_topn: 40 post_nms_topn: 11 nms_thresh: 0.45")


def cluster_net(a, h, w, param, info=4):
    return net('layer { name: "proposal" type: "ProposalCluster" bottom: "prob" bottom: "deltas" '
               f'bottom: "im_info" top: "rois" top: "scores" proposal_param {{ {param} }} }}',
               inputs={"prob": (1, 2 * a, h, w), "deltas": (1, 4 * a, h, w), "im_info": (1, info)})


def test_proposal_cluster_anchors_and_proposals(tmp_path):
    a, h, w = 3, 3, 5
    model = load_from_text(cluster_net(a, h, w, CLUSTER, info=6))
    node = next(n for n in model.layers if n.name == "proposal")
    anchors = ref_cluster_anchors(15, SIDES)
    assert np.array_equal(np.array(node.attrs["anchors"], F), anchors)
    x = pva_feeds(a, h, w, [45.0, 70.0, 1.5, 0.75, 0.0, 0.0])
    rois, scores = ref_proposal(x["prob"], x["deltas"], x["im_info"], 8, anchors, 40, 11, 0.45, 7)
    assert 0 < len(rois) <= 11
    check_everywhere(model, x, {"rois": rois, "scores": scores}, tmp_path, atol=1e-4)


def test_proposal_cluster_odd_scale_count_and_bad_params():
    model = load_from_text(cluster_net(2, 3, 4, CLUSTER.replace("scale: 9.0 scale: 9.0", "scale: 9.0")))
    assert len(next(n for n in model.layers if n.name == "proposal").attrs["anchors"]) == 2
    with pytest.raises(LayerError, match="pairs"):
        load_from_text(cluster_net(1, 3, 4, "scale: 12"))


# ---- the corpus files -------------------------------------------------------------------------

@pytest.mark.parametrize("name, layer, shape", [
    # HAKE-Action's README allows non-commercial use only: the file stays out of tests/fixtures
    pytest.param("DirtyHarryLYL__HAKE-Action__models__Language-Models__deploy_language-model.prototxt",
                 "partroipair1_pool5", "ROIPairPooling",
                 marks=pytest.mark.skip(reason="not shipped: licence (HAKE-Action: non-commercial use only)")),
    ("cgangEE__ohem__models__full1_DRoiAlignX_UpperBody__test_inference.prototxt", "roi_pool5_half", "200x512x6x6"),
    ("cgangEE__ohem__models__kp_cluster__test_inference.prototxt", "roi_pool5", "200x512x6x6")])
def test_corpus_files_read(name, layer, shape):
    # the HAKE net has a Python layer (select_layer) that only `inspect` reads past
    out = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "cli.py"), "inspect", str(CORPUS / name)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(layer + " "))
    assert shape in line
