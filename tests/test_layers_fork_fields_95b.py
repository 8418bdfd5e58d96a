"""Four forks' types and fields: NetWarp's Warp `outliers` (raghudeep/netwarp_public 1b84e43 warp_layer.cpp/.cu),
virtual pooling's parameterless Interp (joechen24/virtual-pooling-caffe 86665f4 interp_layer.cpp/.cu), the
3-bottom Accuracy of xiaolonw/caffe-3dnormal_joint_past 4af389e (accuracy_layer.cpp) and caffe-spn's ROI
(Liusifei/caffe-spn a25d2af roi_layer.cu).  References follow the C++ loops one element at a time in numpy
float32."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, inspect_corpus_file, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


# ---- NetWarp's Warp --------------------------------------------------------------------------------

def netwarp_ref(image, flow, nearest):
    """warp_layer.cpp Forward_cpu: its "x" is the row (flow channel 1), its "y" the column (channel 0)."""
    n, c, h, w = image.shape
    top = np.zeros_like(image)
    for b in range(n):
        for y in range(h):
            for x in range(w):
                xr = F(F(y) + flow[b, 1, y, x])
                yc = F(F(x) + flow[b, 0, y, x])
                xf, yf = math.floor(xr), math.floor(yc)
                xcl, ycl = math.ceil(xr), math.ceil(yc)
                tx, ty = F(xr - F(xf)), F(yc - F(yf))
                if nearest:
                    if xr < 0:
                        tx, xf, xcl = xr, 0, 0
                    if xr >= h - 1:
                        tx, xf, xcl = F(xr - F(h)), h - 1, h - 1
                    if yc < 0:
                        ty, yf, ycl = yc, 0, 0
                    if yc >= w - 1:
                        ty, yf, ycl = F(yc - F(w)), w - 1, w - 1
                elif xr < 0 or xr > h - 1 or yc < 0 or yc > w - 1:
                    continue
                nx, ny = F(1 - tx), F(1 - ty)
                for ch in range(c):
                    i = image[b, ch]
                    t0 = F(F(nx * ny) * i[xf, yf])
                    t1 = F(F(tx * ny) * i[xcl, yf])
                    t2 = F(F(nx * ty) * i[xf, ycl])
                    t3 = F(F(tx * ty) * i[xcl, ycl])
                    top[b, ch, y, x] = F(F(F(t0 + t1) + t2) + t3)
    return top


def warp_net(outliers, shape=(2, 3, 5, 7)):
    n, _, h, w = shape
    field = f"warp_param {{ outliers: {outliers} }}" if outliers else ""
    return net(f'layer {{ name: "w" type: "Warp" bottom: "img" bottom: "flow" top: "o" {field} }}',
               inputs={"img": shape, "flow": (n, 2, h, w)})


def warp_feeds(shape=(2, 3, 5, 7)):
    n, _, h, w = shape
    image = rng(1).standard_normal(shape).astype(F)
    flow = rng(2).uniform(-3.0, 3.0, (n, 2, h, w)).astype(F)
    flow[0, :, 1, 2] = [1.0, -1.0]          # integer points: floor and ceil meet
    flow[1, :, 0, 0] = [-0.5, -2.25]        # above and left of the image
    flow[1, :, 4, 6] = [0.0, 0.0]           # the last pixel itself (h - 1, w - 1)
    flow[0, :, 4, 0] = [0.5, 0.75]          # below the last row
    return {"img": image, "flow": flow}


@pytest.mark.parametrize("outliers", ["NEAREST", "TRUNCATE"])
def test_netwarp_warp_samples_by_its_outlier_rule(outliers, tmp_path):
    feeds = warp_feeds()
    want = netwarp_ref(feeds["img"], feeds["flow"], outliers == "NEAREST")
    check_everywhere(load_from_text(warp_net(outliers)), feeds, {"o": want}, tmp_path)


def test_netwarp_nearest_reads_the_border_and_truncate_zeroes_it():
    feeds = warp_feeds()
    nearest = load_from_text(warp_net("NEAREST")).run(feeds)["o"]
    truncate = load_from_text(warp_net("TRUNCATE")).run(feeds)["o"]
    # flow (-0.5, -2.25) at (0, 0) of item 1 points above and left of the image
    assert np.all(truncate[1, :, 0, 0] == 0)
    np.testing.assert_allclose(nearest[1, :, 0, 0], feeds["img"][1, :, 0, 0], rtol=1e-6)
    # a Warp without outliers stays PWC-Net's (optical_flow.py): the same points as TRUNCATE
    pwc = load_from_text(warp_net(None)).run(feeds)["o"]
    np.testing.assert_allclose(pwc, truncate, rtol=1e-6, atol=1e-6)


def test_netwarp_warp_refusals():
    with pytest.raises(LayerError, match=r"flow \(N, 2, H, W\) of the image's N, H and W"):
        load_from_text(net('layer { name: "w" type: "Warp" bottom: "img" bottom: "flow" top: "o" '
                           'warp_param { outliers: NEAREST } }', inputs={"img": (1, 3, 5, 7), "flow": (1, 2, 5, 6)}))
    with pytest.raises(LayerError, match="cannot both be set"):
        load_from_text(net('layer { name: "w" type: "Warp" bottom: "img" bottom: "flow" top: "o" '
                           'warp_param { outliers: TRUNCATE absolute_coords: true } }',
                           inputs={"img": (1, 3, 5, 7), "flow": (1, 2, 5, 7)}))


def test_an_empty_warp_param_is_netwarps_and_none_stays_pwc_nets():
    # PWC-Net's and LiteFlowNet's files write no warp_param: an empty block can only be NetWarp's (TRUNCATE)
    feeds = warp_feeds()
    empty = load_from_text(warp_net(None).replace('top: "o"  }', 'top: "o" warp_param { } }'))
    assert type(node_of(empty, "w").spec).__name__ == "NetWarpWarp"
    np.testing.assert_array_equal(empty.run(feeds)["o"], netwarp_ref(feeds["img"], feeds["flow"], False))
    assert type(node_of(load_from_text(warp_net(None)), "w").spec).__name__ == "Warp"


# ---- virtual pooling's Interp --------------------------------------------------------------------

def virtual_interp_ref(x):
    """interp_layer.cpp InterpForward, one bottom element (i, j) at a time."""
    n, c, h, w = x.shape
    if h != 4:
        top = np.full((n, c, 2 * h, 2 * w), np.nan, F)
    else:
        top = np.full((n, c, 2 * h - 1, 2 * w - 1), np.nan, F)
    for b in range(n):
        for ch in range(c):
            t, v = top[b, ch], x[b, ch]
            for i in range(h):
                for j in range(w):
                    t[2 * i, 2 * j] = v[i, j]
                    if i != h - 1:
                        t[2 * i + 1, 2 * j] = F(F(v[i, j] + v[i + 1, j]) * F(0.5))
                    if j != w - 1:
                        t[2 * i, 2 * j + 1] = F(F(v[i, j] + v[i, j + 1]) * F(0.5))
                    if i != h - 1 and j != w - 1:
                        s = F(F(F(v[i, j] + v[i + 1, j]) + v[i + 1, j + 1]) + v[i, j + 1])
                        t[2 * i + 1, 2 * j + 1] = F(s * F(0.25))
                    if h == 4:
                        continue
                    if i == h - 1:
                        t[2 * h - 1, 2 * j] = v[h - 1, j]
                        if j != w - 1:
                            t[2 * h - 1, 2 * j + 1] = F(F(v[h - 1, j] + v[h - 1, j + 1]) * F(0.5))
                    if j == w - 1:
                        t[2 * i, 2 * w - 1] = v[i, w - 1]
                        if i != h - 1:
                            t[2 * i + 1, 2 * w - 1] = F(F(v[i, w - 1] + v[i + 1, w - 1]) * F(0.5))
                        else:
                            t[2 * i + 1, 2 * w - 1] = v[i, w - 1]
    assert not np.isnan(top).any()     # every top element written
    return top


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 2, 4, 6), (2, 2, 1, 3), (2, 1, 3, 1), (1, 2, 4, 1)])
def test_virtual_pooling_interp(shape, tmp_path):
    text = net('layer { name: "i" type: "Interp" bottom: "x" top: "o" }', inputs={"x": shape})
    x = rng(3).standard_normal(shape).astype(F)
    model = load_from_text(text)
    assert any("virtual-pooling-caffe" in w for w in model.warnings)
    check_everywhere(model, {"x": x}, {"o": virtual_interp_ref(x)}, tmp_path)


def test_interp_with_parameters_stays_deeplabs():
    zoom = load_from_text(net('layer { name: "i" type: "Interp" bottom: "x" top: "o" interp_param { zoom_factor: 2 } }',
                              inputs={"x": (1, 2, 5, 7)}))
    assert zoom.blob_shapes["o"] == (1, 2, 9, 13)
    with pytest.raises(LayerError, match="Interp needs zoom_factor"):
        load_from_text(net('layer { name: "i" type: "Interp" bottom: "x" top: "o" interp_param { pad_beg: 0 } }',
                           inputs={"x": (1, 2, 5, 7)}))
    with pytest.raises(LayerError, match="Interp needs a 4-axis bottom"):
        load_from_text(net('layer { name: "i" type: "Interp" bottom: "x" top: "o" }', inputs={"x": (1, 2, 5)}))


# ---- the 3-bottom Accuracy ----------------------------------------------------------------------

def test_three_bottom_accuracy_gives_its_unwritten_top():
    text = net('layer { name: "acc" type: "Accuracy" bottom: "p" bottom: "q" bottom: "label" top: "acc" }',
               inputs={"p": (4, 3, 2, 2), "q": (4, 3, 2, 2), "label": (4, 1, 1, 1)})
    model = load_from_text(text)
    assert model.blob_shapes["acc"] == (1, 2, 1, 1)
    assert any("caffe-3dnormal_joint_past" in w for w in model.warnings)
    feeds = {"p": rng(4).standard_normal((4, 3, 2, 2)).astype(F), "q": rng(5).standard_normal((4, 3, 2, 2)).astype(F),
             "label": np.ones((4, 1, 1, 1), F)}
    got = model.run(feeds)["acc"]
    assert got.shape == (1, 2, 1, 1) and np.all(got == 0)


def test_three_bottom_accuracy_is_no_score_source_for_eval():
    # its bottom 1 is the fork's probabilities, not a label: eval must not read the layer as scores + label
    from caffeq.errors import DataError
    from caffeq.evaluate import _score_blob
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "s" inner_product_param { num_output: 5 } }'
               'layer { name: "p" type: "Softmax" bottom: "s" top: "prob" }'
               'layer { name: "acc" type: "Accuracy" bottom: "s" bottom: "prob" bottom: "label" top: "acc" }',
               inputs={"x": (4, 3), "label": (4, 1, 1, 1)})
    model = load_from_text(text, random_weights=True)
    for label in ("label", None):
        with pytest.raises(DataError, match="hold no per-image scores; name the blob with --outputs"):
            _score_blob(model, label)


@pytest.mark.parametrize("label", [(6,), (6, 1, 1, 1), (2, 3)])
def test_lrcn_weighted_accuracy_is_refused_not_zeroed(label):
    # olivernina/lisa-caffe-public LRCN_model: scores, a label per item, weights; its weighted accuracy is not
    # computed here, and is not xiaolonw's zeros either
    scores = (6, 5) if label != (2, 3) else (2, 3, 5)
    text = net('layer { name: "acc" type: "Accuracy" bottom: "p" bottom: "label" bottom: "w" top: "acc" }',
               inputs={"p": scores, "label": label, "w": label})
    with pytest.raises(LayerError, match=r"lisa-caffe-public's \(LRCN\) accuracy weighted by the third bottom"):
        load_from_text(text)


# ---- caffe-spn's ROI ------------------------------------------------------------------------------

def spn_roi_ref(x, rois, ph, pw):
    """roi_layer.cu ROIForward: top[n, c, i, j] = the bottom read flat from the roi's one-based corner."""
    n, c, h, w = x.shape
    flat = x.reshape(-1)
    top = np.zeros((rois.shape[0], c, ph, pw), F)
    for r in range(rois.shape[0]):
        b, x1, y1 = (int(F(rois[r, k] - F(1))) for k in range(3))
        for ch in range(c):
            for i in range(ph):
                for j in range(pw):
                    top[r, ch, i, j] = flat[b * c * h * w + ch * h * w + (y1 + i) * w + (x1 + j)]
    return top


ROI_NET = ('layer {{ name: "r" type: "ROI" bottom: "x" bottom: "rois" top: "o" '
           'roi_param {{ pooled_h: {ph} pooled_w: {pw} }} }}')


def test_spn_roi_crops_each_window(tmp_path):
    x = rng(6).standard_normal((2, 3, 9, 11)).astype(F)
    rois = np.array([[1, 1, 1, 4, 3],         # the top-left corner (one-based)
                     [2, 5, 6, 8, 8],         # item 2; x2, y2 are not read
                     [1, 10, 2, 0, 0],        # past the right edge: continues on the next row
                     [2.7, 3.9, 1.2, 0, 0]],  # fractions: toward zero after less 1
                    F)
    model = load_from_text(net(ROI_NET.format(ph=3, pw=4), inputs={"x": x.shape, "rois": rois.shape}))
    assert model.blob_shapes["o"] == (4, 3, 3, 4)
    check_everywhere(model, {"x": x, "rois": rois}, {"o": spn_roi_ref(x, rois, 3, 4)}, tmp_path)


def test_spn_roi_refusals():
    with pytest.raises(LayerError, match=r"roi_param.pooled_h must be >= 1"):
        load_from_text(net(ROI_NET.format(ph=0, pw=4), inputs={"x": (1, 3, 9, 11), "rois": (2, 5)}))
    with pytest.raises(LayerError, match=r"rois must be \(R, 5\)"):
        load_from_text(net(ROI_NET.format(ph=3, pw=4), inputs={"x": (1, 3, 9, 11), "rois": (2, 6)}))
    model = load_from_text(net(ROI_NET.format(ph=3, pw=4), inputs={"x": (1, 3, 9, 11), "rois": (1, 5)}))
    with pytest.raises(CaffeqError, match=r"roi 0 .* reads outside the bottom \[1, 3, 9, 11\]"):
        model.run({"x": np.zeros((1, 3, 9, 11), F), "rois": np.array([[2, 1, 1, 4, 3]], F)})


# ---- the forks' own files -----------------------------------------------------------------------

CORPUS = REPO / "tests" / "fixtures" / "realworld"
FORK_FILES = [
    ("raghudeep__netwarp_public__models__pspnet101_cityscapes_conv5_4netwarp_deploy.prototxt", (),
     "data_1_down,flo_1_down -> data_1_down_warp  1x3x90x90"),
    ("joechen24__virtual-pooling-caffe__models__resnet__train_val_resnet50_conv1.prototxt",
     ("--input-shape", "data=25,3,224,224"), "conv1 -> lininterp/conv1               25x64x112x112"),
    ("joechen24__virtual-pooling-caffe__models__vgg16__train_val_lininterp_round3_afterAct.prototxt",
     ("--input-shape", "data=25,3,224,224"), "conv5_3 -> lininterp/conv5_3  25x512x14x14"),
    ("joechen24__virtual-pooling-caffe__models__vgg16__train_val_thinet_lininterp_round3.prototxt", (),
     "relu1_1 -> lininterp/conv1_1  50x32x224x224"),
    ("xiaolonw__caffe-3dnormal_joint_past__jointscript__loc_slide_window__seg_test_2fc_3dnormal_edge.prototxt", (),
     "outputs accuracy"),
    ("Liusifei__caffe-spn__caffe-dev__layer_test__roi_test.prototxt", (), "image,data_roi -> samples  4x3x128x128"),
]
# non-commercial licences: these files stay out of tests/fixtures
NOT_SHIPPED = {"Liusifei__caffe-spn__caffe-dev__layer_test__roi_test.prototxt": "Liusifei/caffe-spn is CC BY-NC-SA 4.0"}


def fork_file(name, args, row):
    why = NOT_SHIPPED.get(name)
    return pytest.param(name, args, row, id=name[:40],
                        marks=[pytest.mark.skip(reason=f"not shipped: licence ({why})")] if why else [])


@pytest.mark.parametrize("name, args, row", [fork_file(*f) for f in FORK_FILES])
def test_the_forks_files_read(name, args, row):
    out = inspect_corpus_file(CORPUS / name, *args)
    assert row in out, out
