"""maunzzz/caffe-crfgd (c0cbacb): PixelFeature and CrfFilterbankEd against references written from its C++
(pixel_feature_layer.cpp, crf_filterbank_ed.cpp, entropy_descent_layer.cpp), in float64; CrfEd and CrfGrad
read and sized, refused when run."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

# ---- PixelFeature ------------------------------------------------------------------------------


def ref_pixel_features(x, kind, pos_scale, color_scale, offset_h, offset_w):
    n, c, h, w = x.shape
    pos = np.zeros((n, 2, h, w), np.float64)
    pos[:, 0] = (np.arange(h) * pos_scale + offset_h)[:, None]
    pos[:, 1] = (np.arange(w) * pos_scale + offset_w)[None, :]
    colour = color_scale * x.astype(np.float64)
    return {"POSITION": pos, "RGB": colour, "POSITION_AND_RGB": np.concatenate([pos, colour], 1),
            "RGB_AND_POSITION": np.concatenate([colour, pos], 1)}[kind]


@pytest.mark.parametrize("kind", ["POSITION_AND_RGB", "RGB_AND_POSITION", "RGB", "POSITION"])
def test_pixel_features_match_bilateralnn(kind, tmp_path):
    x = rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32) * 50
    text = net(f'layer {{ name: "pf" type: "PixelFeature" bottom: "x" top: "f" pixel_feature_param {{ type: {kind} '
               f'pos_scale: 0.02 color_scale: 0.3 offset_h: 1.5 offset_w: -2 }} }}', inputs={"x": x.shape})
    model = load_from_text(text)
    ref = ref_pixel_features(x, kind, 0.02, 0.3, 1.5, -2.0)
    assert model.blob_shapes["f"] == ref.shape
    check_everywhere(model, {"x": x}, {"f": ref}, tmp_path, atol=1e-5, rtol=1e-6)


def test_pixel_features_refuse_the_random_types():
    with pytest.raises(LayerError, match="RANDOM_POSITION draws random positions"):
        load_from_text(net('layer { name: "pf" type: "PixelFeature" bottom: "x" top: "f" '
                           'pixel_feature_param { type: RANDOM_POSITION } }', inputs={"x": (1, 3, 4, 4)}))


# ---- CrfFilterbankEd ------------------------------------------------------------------------------


def ref_filterbank_ed(q, feats, unary_weight, blob, iterations, step_size_factor, log_eps):
    """crf_filterbank_ed.cpp's Forward in float64: the blob (C, C F, k, k) read as conv weights (C F, C, k, k)."""
    n, c, h, w = q.shape
    f, k = feats.shape[1], blob.shape[-1]
    bank = blob.astype(np.float64).reshape(c * f, c, k, k)
    pad = (k - 1) // 2
    unary = -unary_weight * np.log(q.astype(np.float64) + log_eps)
    x = q.astype(np.float64)
    for it in range(iterations):
        padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        response = np.zeros((n, c * f, h, w))
        for o in range(c * f):
            for i in range(c):
                for a in range(k):
                    for b in range(k):
                        response[:, o] += bank[o, i, a, b] * padded[:, i, a:a + h, b:b + w]
        pairwise = np.zeros((n, c, h, w))
        for cls in range(c):
            for j in range(f):
                pairwise[:, cls] += feats[:, j] * response[:, cls * f + j]
        t = math.sqrt(2 * math.log(c) / (it + 1)) / step_size_factor
        e = np.exp(-t * (pairwise + unary)) * x
        x = e / e.sum(1, keepdims=True)
    return x


def filterbank_net(shape_q, shape_f, params):
    return net(f'layer {{ name: "crf" type: "CrfFilterbankEd" bottom: "q" bottom: "feat" top: "out" '
               f'crffilterbanked_param {{ {params} }} }}', inputs={"q": shape_q, "feat": shape_f})


def test_crf_filterbank_ed_matches_the_fork(tmp_path):
    g = rng(2)
    q = g.uniform(0.05, 1, (2, 3, 5, 7)).astype(np.float32)
    q /= q.sum(1, keepdims=True)
    logits = g.standard_normal((2, 2, 5, 7))
    feats = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32)
    model = load_from_text(filterbank_net(q.shape, feats.shape, "num_iterations: 3.7 step_size_factor: 1.5 "
                                          "log_eps: 0.1 kernel_size: 3 init_filters: true"), random_weights=True)
    assert model.blob_shapes["out"] == (2, 3, 5, 7)
    node = model.graph.node("crf")
    assert [b.shape for b in node.blobs] == [(1, 1, 1, 1), (3, 6, 3, 3)]
    w_u = np.full((1, 1, 1, 1), 0.7, np.float32)
    blob = (g.standard_normal((3, 6, 3, 3)) * 0.5).astype(np.float32)
    node.blobs = [w_u, blob]
    model.clear_cache()
    ref = ref_filterbank_ed(q, feats, 0.7, blob, 3, 1.5, np.float32(0.1))   # num_iterations 3.7 -> 3
    assert np.allclose(ref.sum(1), 1) and not np.allclose(ref, q, atol=1e-2)
    check_everywhere(model, {"q": q, "feat": feats}, {"out": ref}, tmp_path, atol=2e-6, rtol=1e-5)
    # skip_pw_term: the unary term alone
    unary_only = load_from_text(filterbank_net(q.shape, feats.shape, "num_iterations: 2 kernel_size: 3 "
                                               "skip_pw_term: true"), random_weights=True)
    unary_only.graph.node("crf").blobs = [w_u, np.zeros_like(blob)]
    unary_only.clear_cache()
    ref = ref_filterbank_ed(q, feats, 0.7, np.zeros_like(blob), 2, 1.0, np.float32(0.1))
    check_everywhere(unary_only, {"q": q, "feat": feats}, {"out": ref}, tmp_path, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("params, shapes, msg", [
    ("kernel_size: 4", ((1, 3, 5, 5), (1, 2, 5, 5)), "must be odd"),
    ("kernel_size: 3", ((1, 3, 5, 5), (1, 2, 5, 4)), "same N, H, W"),
    ("num_iterations: 0.5", ((1, 3, 5, 5), (1, 2, 5, 5)), "num_iterations must be >= 1"),
])
def test_crf_filterbank_ed_checks(params, shapes, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(filterbank_net(*shapes, params))


# ---- CrfEd / CrfGrad and the data layer ----------------------------------------------------------


@pytest.mark.parametrize("kind, field", [("CrfEd", "crfed_param"), ("CrfGrad", "crfgrad_param")])
def test_lattice_crfs_are_sized_and_refused_when_run(kind, field, tmp_path):
    text = net(f'layer {{ name: "crf" type: "{kind}" bottom: "q" bottom: "feat" top: "out" top: "energy" '
               f'{field} {{ num_iterations: 4 kernel_size: 5 num_classes: 3 calculate_energy: true }} }}',
               inputs={"q": (2, 3, 6, 7), "feat": (2, 5, 6, 7)})
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["out"] == (2, 3, 6, 7) and model.blob_shapes["energy"] == (2, 1, 1, 4)
    # the permutohedral filter: 2^(d + 1) - 1 taps for d = 5 features
    assert [b.shape for b in model.graph.node("crf").blobs] == [(1, 1, 1, 1), (3, 3, 5, 5), (3, 3, 1, 63)]
    feeds = {"q": np.full((2, 3, 6, 7), 1 / 3, np.float32), "feat": np.zeros((2, 5, 6, 7), np.float32)}
    with pytest.raises(CaffeqError, match="permutohedral lattice .* not implemented"):
        model.run(feeds)
    with pytest.raises(ExportError, match="permutohedral lattice"):
        model.export_onnx(str(tmp_path / "crf.onnx"))
    with pytest.raises(LayerError, match="num_classes 4 but the probabilities have 3"):
        load_from_text(text.replace("num_classes: 3", "num_classes: 4"))


def test_crfgd_image_label_data_shapes_its_label_slice():
    text = '''layer { name: "data" type: "ImageLabelData" top: "data" top: "label"
  transform_param { mirror: false crop_size: 513 mean_value: 104.008 mean_value: 116.669 mean_value: 122.675 }
  image_label_data_param { image_list_path: "val.txt" label_list_path: "val_labels.txt" batch_size: 1
    shuffle: false padding: REFLECT pad_centre: false label_slice { dim: 257 dim: 257 stride: 2 stride: 2 } }
  include: { phase: TEST } }'''
    shapes = load_from_text(text).blob_shapes
    assert shapes["data"] == (1, 3, 513, 513) and shapes["label"] == (1, 1, 257, 257)
