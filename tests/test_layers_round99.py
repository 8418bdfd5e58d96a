"""Round 99's fork layers against numpy references written here from the forks' C++:

- csjcai/RealSR's LapPyr (caffeq/layers/sice.py; "Layer/Laplacian Pyramid/LapPyr_Layer.cpp", whose Forward_cpu
  is the only forward): per-plane im2col + GEMM with the binomial 5 x 5 weights / 256 and / 64, the
  sub-sampling and zero-stuffing loops that address their buffers with rows of 2 W2 (2 W3) values;
- ypeiyu/PAMS-FCN's PSROIPooling `divide_type` (caffeq/layers/roi_pooling.py; psroi_pooling_layer.cu's
  PSROIPoolingForward, its Forward_cpu being NOT_IMPLEMENTED), in float32 scalars as the kernel's Dtype;
in torch, onnxruntime and the generated model.py.
"""
import math
from pathlib import Path

import numpy as np
import pytest
from c_reference import c_round
from conftest import REPO, check_everywhere, cli_process, net, ok, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
BINOMIAL = np.array([1, 4, 6, 4, 1], np.float64)


# ---- LapPyr --------------------------------------------------------------------------------------

def blur_ref(buf, h, w, divisor):
    """im2col (5 x 5, pad 2) of the h x w buffer times the weights tmp / divisor, summed over the 25 taps."""
    weights = (np.outer(BINOMIAL, BINOMIAL) / divisor).astype(F)
    img = buf.reshape(h, w)
    out = np.zeros((h, w), F)
    for y in range(h):
        for x in range(w):
            acc = 0.0
            for i in range(5):
                for j in range(5):
                    yy, xx = y - 2 + i, x - 2 + j
                    if 0 <= yy < h and 0 <= xx < w:
                        acc += float(weights[i, j]) * float(img[yy, xx])
            out[y, x] = acc
    return out.reshape(-1)


def down_ref(buf, h2, w2):
    """top[i * w2 + j] = temp[(i * 2) * (w2 * 2) + (j * 2)]"""
    out = np.zeros(h2 * w2, F)
    for i in range(h2):
        for j in range(w2):
            out[i * w2 + j] = buf[(2 * i) * (2 * w2) + 2 * j]
    return out


def up_ref(plane, h2, w2, h, w):
    """A fresh (zeroed) h x w buffer; temp_up[(2i)(2 w2) + 2j] = plane[i w2 + j], its three neighbours 0."""
    buf = np.zeros(h * w, F)
    for i in range(h2):
        for j in range(w2):
            buf[(2 * i) * (2 * w2) + 2 * j] = plane[i * w2 + j]
            buf[(2 * i) * (2 * w2) + 2 * j + 1] = 0
            buf[(2 * i + 1) * (2 * w2) + 2 * j] = 0
            buf[(2 * i + 1) * (2 * w2) + 2 * j + 1] = 0
    return buf


def lap_down_ref(x):
    n, c, h, w = x.shape
    h2, w2, h3, w3 = h // 2, w // 2, h // 4, w // 4
    t0, t1, t2 = np.zeros((n, c, h, w), F), np.zeros((n, c, h2, w2), F), np.zeros((n, c, h3, w3), F)
    for b in range(n):
        for ch in range(c):
            plane = x[b, ch].reshape(-1)
            mid = down_ref(blur_ref(plane, h, w, 256), h2, w2)
            low = down_ref(blur_ref(mid, h2, w2, 256), h3, w3)
            t0[b, ch] = (plane - blur_ref(up_ref(mid, h2, w2, h, w), h, w, 64)).reshape(h, w)
            t1[b, ch] = (mid - blur_ref(up_ref(low, h3, w3, h2, w2), h2, w2, 64)).reshape(h2, w2)
            t2[b, ch] = low.reshape(h3, w3)
    return t0, t1, t2


def lap_up_ref(b0, b1, b2):
    n, c, h, w = b0.shape
    (h2, w2), (h3, w3) = b1.shape[2:], b2.shape[2:]
    p1, p2 = b1.reshape(-1), b2.reshape(-1)    # walked plane by plane (offset(0, 1)) for n c planes
    out = np.zeros(b0.shape, F)
    for k in range(n * c):
        low = p2[k * h3 * w3:(k + 1) * h3 * w3]
        mid = p1[k * h2 * w2:(k + 1) * h2 * w2] + blur_ref(up_ref(low, h3, w3, h2, w2), h2, w2, 64)
        fine = b0.reshape(n * c, -1)[k] + blur_ref(up_ref(mid, h2, w2, h, w), h, w, 64)
        out.reshape(n * c, -1)[k] = fine
    return out


def lap_down_net(shape):
    return net('layer { name: "lp" type: "LapPyr" bottom: "x" top: "l0" top: "l1" top: "l2" }', inputs={"x": shape})


def lap_up_net(s0, s1, s2):
    return net('layer { name: "lp" type: "LapPyr" bottom: "b0" bottom: "b1" bottom: "b2" top: "y" '
               'laplacianpyramid_param { is_down: false } }', inputs={"b0": s0, "b1": s1, "b2": s2})


@pytest.mark.parametrize("shape", [(2, 3, 9, 11), (2, 1, 8, 12), (1, 2, 13, 6)])
def test_lappyr_decomposition(shape, tmp_path):
    """Odd sizes shear the fork's 2 W2-wide rows: the reference walks its buffers exactly as the C++ does."""
    x = rng(990).standard_normal(shape).astype(F)
    model = load_from_text(lap_down_net(shape), outputs=["l0", "l1", "l2"])
    n, c, h, w = shape
    assert [model.blob_shapes[t] for t in ("l0", "l1", "l2")] == [shape, (n, c, h // 2, w // 2),
                                                                   (n, c, h // 4, w // 4)]
    t0, t1, t2 = lap_down_ref(x)
    check_everywhere(model, {"x": x}, {"l0": t0, "l1": t1, "l2": t2}, tmp_path, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("s0, s1, s2", [
    ((2, 3, 9, 11), (2, 3, 4, 5), (2, 3, 2, 2)),
    ((2, 3, 12, 10), (1, 6, 5, 6), (3, 2, 3, 2)),   # levels read as flat planes: 6 of them, across images
    ((1, 1, 10, 7), (1, 2, 4, 4), (1, 1, 2, 1)),    # extra planes in bottom 1 are not read
])
def test_lappyr_reconstruction(s0, s1, s2, tmp_path):
    r = rng(991)
    b0, b1, b2 = (r.standard_normal(s).astype(F) for s in (s0, s1, s2))
    model = load_from_text(lap_up_net(s0, s1, s2))
    assert model.blob_shapes["y"] == s0
    check_everywhere(model, {"b0": b0, "b1": b1, "b2": b2}, {"y": lap_up_ref(b0, b1, b2)}, tmp_path,
                     atol=2e-5, rtol=1e-5)


def test_lappyr_round_trip():
    """The RealSR net's pair: the decomposition rebuilt by is_down: false gives the image back (to float
    rounding), odd sizes included, the fork's sheared addressing cancelling out."""
    x = rng(992).uniform(0, 1, (2, 1, 11, 14)).astype(F)
    text = net('layer { name: "d" type: "LapPyr" bottom: "x" top: "l0" top: "l1" top: "l2" }',
               'layer { name: "u" type: "LapPyr" bottom: "l0" bottom: "l1" bottom: "l2" top: "y" '
               'laplacianpyramid_param { is_down: false } }', inputs={"x": x.shape})
    np.testing.assert_allclose(load_from_text(text).run({"x": x})["y"], x, atol=1e-5)


@pytest.mark.parametrize("text, message", [
    (net('layer { name: "lp" type: "LapPyr" bottom: "x" top: "a" top: "b" }', inputs={"x": (1, 1, 8, 8)}),
     "LapPyr .is_down: true. .*3 tops"),
    (lap_down_net((1, 1, 3, 8)), r"at least 4 .*, got 3 x 8"),
    (lap_up_net((1, 1, 8, 8), (1, 1, 4, 4), (1, 1, 3, 3)), "a 3 x 3 level up-sampled fills 4 x 9 values"),
    (lap_up_net((2, 2, 8, 8), (1, 2, 4, 4), (2, 2, 2, 2)), "reads 4 planes .* from bottom 1, which holds 2"),
])
def test_lappyr_refusals(text, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(text)


# ---- PAMS-FCN's PSROIPooling divide_type -----------------------------------------------------------

# (height share, width offset share, width share, columns, rows) per part, from the kernel's switch
PAMS = {0: [(0.23, 0.15, 0.7, 3, 3), (0.3, None, None, 5, 4), (0.5, None, None, 5, 6), (0.7, None, None, 5, 8),
            (None, None, None, 5, 12)],
        1: [(0.23, 0.15, 0.7, 3, 2), (0.3, None, None, 4, 3), (0.5, None, None, 4, 5), (0.7, None, None, 4, 7),
            (None, None, None, 4, 10)]}
PART_START = {0: [0, 9, 29, 59, 99, 159], 1: [0, 6, 18, 38, 66, 106]}


def pams_ref(x, rois, dim, g, scale, divide_type):
    n_img, _c, h, w = x.shape
    scale = F(scale)
    out = np.zeros((len(rois), dim, 1, g), F)
    for index in range(out.size):
        pw = index % g                       # index_mod
        ctop = (index // g) % dim
        n = index // g // 1 // dim
        order = next(k for k in range(5) if PART_START[divide_type][k] <= pw < PART_START[divide_type][k + 1])
        roi = rois[n]
        b = int(roi[0])
        start_w, start_h = F(c_round(roi[1])) * scale, F(c_round(roi[2])) * scale
        end_w, end_h = F(c_round(roi[3]) + 1.0) * scale, F(c_round(roi[4]) + 1.0) * scale
        roi_w = end_w - start_w if end_w - start_w > 0.1 else F(0.1)
        roi_h = end_h - start_h if end_h - start_h > 0.1 else F(0.1)
        share_h, off_w, share_w, cols, rows = PAMS[divide_type][order]
        hstart = start_h
        hend = start_h + (roi_h * F(share_h) if share_h is not None else roi_h)
        if off_w is not None:        # the head
            wstart = start_w + roi_w * F(off_w)
            wend = start_w + roi_w * F(off_w) + roi_w * F(share_w)
        else:
            wstart, wend = start_w, start_w + roi_w
        inner = pw - PART_START[divide_type][order]
        bin_h = F(hend - hstart) / F(rows)
        bin_w = F(wend - wstart) / F(cols)
        i, j = inner // cols, inner % cols
        hs = min(max(math.floor(hstart + F(i) * bin_h), 0), h)
        he = min(max(math.ceil(hstart + F(i + 1) * bin_h), 0), h)
        ws = min(max(math.floor(wstart + F(j) * bin_w), 0), w)
        we = min(max(math.ceil(wstart + F(j + 1) * bin_w), 0), w)
        c = ctop * g + pw
        if he <= hs or we <= ws:
            continue
        total = F(0)
        for yy in range(hs, he):
            for xx in range(ws, we):
                total = F(total + x[b, c, yy, xx])
        out.reshape(-1)[index] = total / F((he - hs) * (we - ws))
    return out


def pams_net(xshape, rshape, dim, g, scale, divide_type):
    return net(f'layer {{ name: "ps" type: "PSROIPooling" bottom: "x" bottom: "rois" top: "y" psroi_pooling_param {{ '
               f'spatial_scale: {scale} divide_type: {divide_type} output_dim: {dim} group_size: {g} }} }}',
               inputs={"x": xshape, "rois": rshape})


def pams_rois():
    return np.array([[0, 3.4, 7.6, 60.2, 41.5],     # a roi on the map
                     [1, 10, 2, 30.5, 90],          # tall, past the bottom edge
                     [1, 44, 20, 44, 21],           # tiny: size 0.1 after scaling would be < 0.1
                     [0, -8, -5, 20, 30],           # starts off the map
                     [1, 0, 0, 67, 51]], F)         # the whole image


@pytest.mark.parametrize("divide_type, g, dim", [(0, 159, 2), (1, 106, 3), (0, 40, 2), (1, 7, 1)])
def test_pams_psroi_pooling(divide_type, g, dim, tmp_path):
    """The caltech nets' layouts (159 and 106 bins), and a group_size that keeps only the first parts' bins."""
    xshape, scale = (2, dim * g, 13, 17), 0.25
    x = rng(993).standard_normal(xshape).astype(F)
    rois = pams_rois()
    model = load_from_text(pams_net(xshape, rois.shape, dim, g, scale, divide_type))
    assert model.blob_shapes["y"] == (len(rois), dim, 1, g)
    check_everywhere(model, {"x": x, "rois": rois}, {"y": pams_ref(x, rois, dim, g, scale, divide_type)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_psroi_pooling_without_divide_type_is_rfcn():
    text = net('layer { name: "ps" type: "PSROIPooling" bottom: "x" bottom: "rois" top: "y" psroi_pooling_param { '
               'spatial_scale: 0.25 output_dim: 2 group_size: 3 } }', inputs={"x": (1, 18, 6, 7), "rois": (2, 5)})
    assert load_from_text(text).blob_shapes["y"] == (2, 2, 3, 3)


@pytest.mark.parametrize("xshape, dim, g, divide_type, message", [
    ((1, 4, 5, 5), 2, 2, 2, "divide_type must be 0 or 1"),
    ((1, 320, 5, 5), 2, 160, 0, "group_size 160 exceeds divide_type 0's 159"),
    ((1, 2 * 106 * 106, 5, 5), 2, 106, 1, "input has 22472 channels; .* output_dim 2 x group_size 106 = 212"),
])
def test_pams_refusals(xshape, dim, g, divide_type, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(pams_net(xshape, (2, 5), dim, g, 0.25, divide_type))


# ---- the corpus files ------------------------------------------------------------------------------

REALWORLD = str(REPO / "tests" / "fixtures" / "realworld")
CORPUS = [(REALWORLD + "/csjcai__RealSR__Test__LP-KPN.prototxt", ()),
          (REALWORLD + "/csjcai__RealSR__Train__LP-KPN.prototxt",
           ("--input-shape", "data=2,1,48,48", "--input-shape", "label=2,1,48,48")),
          (REALWORLD + ("/ypeiyu__PAMS-FCN__models__caltech__ResNet-50__pams_fcn_end2end__pams_fcn_ohem_test"
                        ".prototxt"), ()),
          (REALWORLD + ("/ypeiyu__PAMS-FCN__models__caltech__ResNet-50__pams_fcn_end2end__pams_fcn_ohem_train"
                        ".prototxt"), ())]


@pytest.mark.parametrize("path, extra", CORPUS, ids=lambda v: Path(v).name[:40] if isinstance(v, str) else "")
def test_corpus_files_read(path, extra):
    ok(cli_process("inspect", path, *extra))
