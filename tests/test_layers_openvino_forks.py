"""Open Model Zoo's Caffe files as OpenVINO reads them.

- DetectionOutput with `normalized: false`, input_width, input_height (OpenVINO Model Optimizer's
  mo_caffe.proto, openvinotoolkit/openvino 6dc130d; no public Caffe declares them): the reference follows
  OpenVINO's src/core/reference/include/openvino/reference/detection_output.hpp: priors of 5 numbers (item,
  pixel corners) divided by input_width / input_height, SSD's CENTER_SIZE / CORNER decoding, caffeNMS per
  class, keep_top_k, in float32.
- Interp with zoom_factor alone: OpenVINO's Model Optimizer (ops/interp.py, front/InterpolateNormalizer.py)
  sizes it (h + pads) x zoom, interpolating linearly with align_corners (interp_ext.py).  caffeq reads it so
  where a join only fits that size, also through one-bottom layers that keep the size (OMZ's
  Interp -> Conv -> ReLU -> Eltwise); where PSPNet's h + (h - 1)(zoom - 1) fits, PSPNet's stays.
"""
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, rng
from ssd_reference import apply_keep_top_k, center_size_decode

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
CORPUS = str(REPO / "tests" / "fixtures" / "realworld" / "openvinotoolkit__open_model_zoo__models__intel__{0}__{0}.prototxt")


# ---- DetectionOutput, normalized: false -----------------------------------------------------------------

def decode(prior, var, t, code):
    x0, y0, x1, y1 = prior
    if code == "CORNER":
        return np.array([x0 + var[0] * t[0], y0 + var[1] * t[1], x1 + var[2] * t[2], y1 + var[3] * t[3]], F)
    return center_size_decode(prior, var, t)


def iou(a, b):
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return F(0)
    iw, ih = F(min(a[2], b[2]) - max(a[0], b[0])), F(min(a[3], b[3]) - max(a[1], b[1]))
    if iw <= 0 or ih <= 0:
        return F(0)
    inter = F(iw * ih)

    def size(x):
        return F(0) if x[2] < x[0] or x[3] < x[1] else F(F(x[2] - x[0]) * F(x[3] - x[1]))
    return F(inter / F(F(size(a) + size(b)) - inter))


def openvino_ref(loc, conf, prior, classes, share, width, height, vit, code, nms, top_k, keep_top_k):
    n = loc.shape[0]
    P = prior.shape[2] // 5
    flat = prior.reshape(prior.shape[0], -1)[0]
    boxes = flat[:5 * P].reshape(P, 5)[:, 1:] / np.array([width, height, width, height], F)
    var = np.ones((P, 4), F) if vit else flat[5 * P:9 * P].reshape(P, 4)
    n_loc = 1 if share else classes
    offsets = loc.reshape(n, P, n_loc, 4)
    scores = conf.reshape(n, P, classes)
    rows = []
    for i in range(n):
        dec = {c: np.array([decode(boxes[p], var[p], offsets[i, p, c], code) for p in range(P)])
               for c in range(n_loc)}
        kept = {}
        for c in range(1, classes):   # background 0
            s = scores[i, :, c]
            order = sorted(range(P), key=lambda p: -s[p])[:top_k]
            keep = []
            for p in order:
                b = dec[0 if share else c]
                if all(iou(b[p], b[k]) <= F(nms) for k in keep):
                    keep.append(p)
            kept[c] = keep
        kept = apply_keep_top_k(kept, scores[i], keep_top_k)
        for c in sorted(kept):
            rows += [[i, c, scores[i, p, c], *dec[0 if share else c][p]] for p in kept[c]]
    return np.array(rows, F)[None, None]


def pixel_inputs(n, P, classes, n_loc, vit, seed):
    g = rng(seed)
    x0, y0 = g.uniform(0, 600, P), g.uniform(0, 300, P)
    corners = np.stack([np.zeros(P), x0, y0, x0 + g.uniform(20, 300, P), y0 + g.uniform(20, 200, P)], 1)
    prior = corners.reshape(1, 1, -1).astype(F)
    if not vit:   # OpenVINO's variances: the 4P numbers after the 5P, in a second row
        second = np.zeros((1, 1, 5 * P), F)
        second[0, 0, :4 * P] = np.tile(F([0.1, 0.1, 0.2, 0.2]), P)
        prior = np.concatenate([prior, second], 1)
    loc = (g.standard_normal((n, P * n_loc * 4)) * 0.3).astype(F)
    z = g.standard_normal((n, P, classes)).astype(F) * 2
    conf = (np.exp(z) / np.exp(z).sum(2, keepdims=True)).astype(F).reshape(n, -1)
    return loc, conf, prior


def det_net(loc, conf, prior, param):
    return load_from_text(net('layer { name: "d" type: "DetectionOutput" bottom: "loc" bottom: "conf" '
                              f'bottom: "prior" top: "o" detection_output_param {{ {param} }} }}',
                              inputs={"loc": loc.shape, "conf": conf.shape, "prior": prior.shape}))


@pytest.mark.parametrize("share, vit, code", [(False, True, "CENTER_SIZE"), (True, False, "CENTER_SIZE"),
                                              (False, False, "CORNER")])
def test_pixel_priors_as_openvino_decodes_them(share, vit, code, tmp_path):
    classes, P = 3, 23
    loc, conf, prior = pixel_inputs(2, P, classes, 1 if share else classes, vit, seed=5)
    param = (f"num_classes: {classes} share_location: {str(share).lower()} background_label_id: 0 "
             f"input_width: 992 input_height: 544 normalized: false code_type: {code} "
             f"variance_encoded_in_target: {str(vit).lower()} keep_top_k: 9 "
             f"nms_param {{ nms_threshold: 0.4 top_k: 12 }}")
    ref = openvino_ref(loc, conf, prior, classes, share, 992, 544, vit, code, 0.4, 12, 9)
    check_everywhere(det_net(loc, conf, prior, param), {"loc": loc, "conf": conf, "prior": prior}, {"o": ref},
                     tmp_path, atol=1e-6)


@pytest.mark.parametrize("param, prior_shape, msg", [
    ("normalized: false input_height: 544", (1, 1, 20), "needs input_width and input_height > 0"),
    ("normalized: false input_width: 992 input_height: 544", (1, 1, 16), r"5 \* num_priors"),
])
def test_pixel_prior_refusals(param, prior_shape, msg):
    text = net('layer { name: "d" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
               f'top: "o" detection_output_param {{ num_classes: 2 variance_encoded_in_target: true {param} }} }}',
               inputs={"loc": (1, 16), "conf": (1, 8), "prior": prior_shape})
    with pytest.raises(LayerError, match=msg):
        load_from_text(text)


def test_pixel_priors_of_each_image_refused():
    # OpenVINO gives image i item i's priors where SSD (and caffeq) read the first item's
    text = net('layer { name: "d" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "o" '
               'detection_output_param { num_classes: 2 variance_encoded_in_target: true normalized: false '
               'input_width: 992 input_height: 544 } }',
               inputs={"loc": (2, 16), "conf": (2, 8), "prior": (2, 1, 20)})
    with pytest.raises(LayerError, match="each image its own priors"):
        load_from_text(text)


# ---- Interp sized h x zoom (OpenVINO's Model Optimizer) ---------------------------------------------------

def align_corners_resize(x, ho, wo):
    """OpenVINO's Interpolate, linear with align_corners: source = dst * (in - 1) / (out - 1)."""
    h, w = x.shape[2:]

    def axis(n_in, n_out):
        r = F(n_in - 1) / F(n_out - 1) if n_out > 1 else F(0)
        src = (np.arange(n_out, dtype=F) * r).astype(F)
        i0 = np.floor(src).astype(int)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, (src - i0).astype(F)
    y0, y1, ly = axis(h, ho)
    x0, x1, lx = axis(w, wo)
    top = (1 - lx) * x[:, :, y0][:, :, :, x0] + lx * x[:, :, y0][:, :, :, x1]
    bot = (1 - lx) * x[:, :, y1][:, :, :, x0] + lx * x[:, :, y1][:, :, :, x1]
    return ((1 - ly)[:, None] * top + ly[:, None] * bot).astype(F)


def zoom_join_net(shape, zoom):
    return net('layer { name: "pool" type: "Pooling" bottom: "x" top: "pool" pooling_param { pool: AVE '
               f'kernel_size: {zoom} stride: {zoom} }} }}',
               f'layer {{ name: "up" type: "Interp" bottom: "pool" top: "up" interp_param {{ zoom_factor: {zoom} }} }}',
               'layer { name: "relu" type: "ReLU" bottom: "up" top: "r" }',
               'layer { name: "o" type: "Eltwise" bottom: "x" bottom: "r" top: "o" }', inputs={"x": shape})


@pytest.mark.parametrize("shape, zoom", [((2, 3, 10, 14), 2), ((2, 2, 12, 20), 4)])
def test_zoom_through_relu_gives_h_times_zoom(shape, zoom, tmp_path):
    x = rng(3).standard_normal(shape).astype(F)
    model = load_from_text(zoom_join_net(shape, zoom))
    n, c, h, w = shape
    pooled = x.reshape(n, c, h // zoom, zoom, w // zoom, zoom).mean((3, 5)).astype(F)
    up = align_corners_resize(pooled, h, w)
    ref = (x + np.maximum(up, 0)).astype(F)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-6)


def test_pspnet_size_kept_where_the_join_fits_it():
    # 5x7 zoomed by 2 is 9x13 in PSPNet's Interp, which this join needs: nothing is rewritten
    text = net('layer { name: "up" type: "Interp" bottom: "s" top: "up" interp_param { zoom_factor: 2 } }',
               'layer { name: "relu" type: "ReLU" bottom: "up" top: "r" }',
               'layer { name: "o" type: "Eltwise" bottom: "x" bottom: "r" top: "o" }',
               inputs={"s": (2, 3, 5, 7), "x": (2, 3, 9, 13)})
    model = load_from_text(text)
    x, s = rng(1).standard_normal((2, 3, 9, 13)).astype(F), rng(2).standard_normal((2, 3, 5, 7)).astype(F)
    ref = x + np.maximum(align_corners_resize(s, 9, 13), 0)
    np.testing.assert_allclose(model.run({"x": x, "s": s})["o"], ref, atol=1e-6, rtol=0)


# ---- the Open Model Zoo files -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, shape", [("person-detection-retail-0002", "1x1x200x7"),
                                         ("road-segmentation-adas-0001", "1x4x512x896")])
def test_omz_corpus_files_read(name, shape):
    path = CORPUS.format(name)
    res = subprocess.run([sys.executable, "cli.py", "inspect", path], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    assert shape in res.stdout
