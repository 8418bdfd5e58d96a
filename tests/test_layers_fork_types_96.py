"""Fork types of the 96th round: goodluckcwl/custom-caffe's MappingBySimilarity and PixelwiseSimilarity
(caffeq/layers/custom_caffe_similarity.py), sp9103/DeepHandPoseRecognizer's Leap data layers and EuclideanDist
(caffeq/layers/leap_hand.py), jialinwu17/caffe's SOFTROIPooling (caffeq/layers/jialinwu_softroi.py).  The
references below follow the forks' Forward_cpu loops, in float32."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, inspect_corpus_file, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


# ---- MappingBySimilarity --------------------------------------------------------------------------

def mapping_ref(x, sim, alpha, in_place=False):
    """mapping_by_similarity_layer.cpp Forward_cpu: pairs (2n, 2n + 1), beta = sim[n] per pixel; an odd batch's
    last item is never written (a new blob's zeros; in place, the input's)."""
    n, c, h, w = x.shape
    a = F(alpha)
    top = x.copy() if in_place else np.zeros_like(x)
    for i in range(n // 2):
        for ch in range(c):
            for y in range(h):
                for z in range(w):
                    beta = sim[i, 0, y, z]
                    x1, x2 = x[2 * i, ch, y, z], x[2 * i + 1, ch, y, z]
                    denom = F(1) + a - a * beta
                    top[2 * i, ch, y, z] = (x1 + a * (F(1) - beta) * x2) / denom
                    top[2 * i + 1, ch, y, z] = (x2 + a * (F(1) - beta) * x1) / denom
    return top


@pytest.mark.parametrize("shape, alpha", [((4, 3, 5, 7), 0.3), ((5, 2, 3, 6), 1.0), ((2, 1, 4, 3), 0.0)])
def test_mapping_by_similarity_mixes_each_pair(shape, alpha, tmp_path):
    n, c, h, w = shape
    text = net(f'layer {{ name: "m" type: "MappingBySimilarity" bottom: "x" bottom: "s" top: "o" '
               f'mapping_by_similarity_param {{ alpha: {alpha} }} }}', inputs={"x": shape, "s": (n // 2, 1, h, w)})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == shape
    x = rng(1).standard_normal(shape).astype(F)
    s = rng(2).uniform(0, 1, (n // 2, 1, h, w)).astype(F)
    want = mapping_ref(x, s, np.float32(alpha))
    if n % 2:
        assert not want[-1].any()
    check_everywhere(model, {"x": x, "s": s}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_mapping_by_similarity_in_place_keeps_an_odd_batchs_last_item(tmp_path):
    """top = bottom 0: both devices read x1, x2 before writing them, and the unwritten last item is the input's."""
    shape = (5, 2, 3, 4)
    text = net('layer { name: "m" type: "MappingBySimilarity" bottom: "x" bottom: "s" top: "x" '
               'mapping_by_similarity_param { alpha: 0.6 } }\n'
               'layer { name: "out" type: "Power" bottom: "x" top: "o" }', inputs={"x": shape, "s": (2, 1, 3, 4)})
    model = load_from_text(text)
    x = rng(9).standard_normal(shape).astype(F)
    s = rng(10).uniform(0, 1, (2, 1, 3, 4)).astype(F)
    want = mapping_ref(x, s, 0.6, in_place=True)
    np.testing.assert_array_equal(want[-1], x[-1])
    check_everywhere(model, {"x": x, "s": s}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_mapping_by_similarity_checks_alpha_and_the_map():
    bad = net('layer { name: "m" type: "MappingBySimilarity" bottom: "x" bottom: "s" top: "o" '
              'mapping_by_similarity_param { alpha: 1.5 } }', inputs={"x": (4, 2, 3, 5), "s": (2, 1, 3, 5)})
    with pytest.raises(LayerError, match=r"alpha must lie in \[0, 1\]"):
        load_from_text(bad)
    wrong = net('layer { name: "m" type: "MappingBySimilarity" bottom: "x" bottom: "s" top: "o" }',
                inputs={"x": (4, 2, 3, 5), "s": (4, 1, 3, 5)})
    with pytest.raises(LayerError, match=r"must be \(N / 2, 1, H, W\)"):
        load_from_text(wrong)


# ---- PixelwiseSimilarity --------------------------------------------------------------------------

def pixelwise_ref(x, roi):
    """pixelwise_similarity_layer.cpp: im_row (the image's window, 0 outside) times kernel_row, a gemv per pixel."""
    n, c, h, w = x.shape
    top = np.zeros((n // 2, h * w, 1, roi * roi), F)
    for i in range(n // 2):
        image, kernel = x[2 * i], x[2 * i + 1]
        for ky in range(h):
            for kx in range(w):
                y0, y1 = ky - math.ceil((roi - 1) / 2), ky + math.floor((roi - 1) / 2)
                x0, x1 = kx - math.ceil((roi - 1) / 2), kx + math.floor((roi - 1) / 2)
                rows = []
                for iy in range(y0, y1 + 1):
                    for ix in range(x0, x1 + 1):
                        inside = 0 <= iy < h and 0 <= ix < w
                        rows.append(image[:, iy, ix] if inside else np.zeros(c, F))
                top[i, ky * w + kx, 0] = np.stack(rows) @ kernel[:, ky, kx]
    return top


@pytest.mark.parametrize("shape, roi", [((2, 3, 5, 7), 3), ((4, 2, 6, 5), 4), ((2, 4, 3, 4), 1), ((2, 2, 3, 2), 6)])
def test_pixelwise_similarity_dots_each_window(shape, roi, tmp_path):
    text = net(f'layer {{ name: "p" type: "PixelwiseSimilarity" bottom: "x" top: "o" '
               f'pixelwise_similarity_param {{ roi: {roi} }} }}', inputs={"x": shape})
    model = load_from_text(text)
    n, c, h, w = shape
    assert model.blob_shapes["o"] == (n // 2, h * w, 1, roi * roi)
    x = rng(3).standard_normal(shape).astype(F)
    check_everywhere(model, {"x": x}, {"o": pixelwise_ref(x, roi)}, tmp_path, atol=1e-5, rtol=1e-6)


def test_pixelwise_similarity_needs_roi_and_an_even_batch():
    with pytest.raises(LayerError, match="needs pixelwise_similarity_param.roi"):
        load_from_text(net('layer { name: "p" type: "PixelwiseSimilarity" bottom: "x" top: "o" }',
                           inputs={"x": (2, 3, 4, 5)}))
    with pytest.raises(LayerError, match="batch must be even, got 3"):
        load_from_text(net('layer { name: "p" type: "PixelwiseSimilarity" bottom: "x" top: "o" '
                           'pixelwise_similarity_param { roi: 3 } }', inputs={"x": (3, 3, 4, 5)}))


# ---- SOFTROIPooling -------------------------------------------------------------------------------

def softroi_ref(data, mask, groups, masks):
    """softroi_pooling_layers.cu SOFTROIPoolingForward (what the fork's CUDA-only build runs): a thread per top
    cell (n, m, k) sums data times mask and the mask over (h, w) row by row, then divides where the sum != 0."""
    n, _, h, w = data.shape
    flat, mflat = data.reshape(-1), mask.reshape(-1)
    top = np.zeros(n * groups * masks, F)
    for index in range(top.size):
        k, m, item = index % masks, (index // masks) % groups, index // groups // masks
        total, norm = F(0), F(0)
        for y in range(h):
            for x in range(w):
                mask_index = item * masks * h * w + k * h * w + y * w + x
                data_index = item * masks * groups * h * w + (m * masks + k) * h * w + y * w + x
                norm += mflat[mask_index]
                total += flat[data_index] * mflat[mask_index]
        top[index] = total / norm if norm != 0 else total
    return top.reshape(n, groups, masks, 1)


def test_softroi_pooling_takes_the_mask_weighted_mean(tmp_path):
    groups, masks, shape = 2, 3, (3, 6, 5, 7)
    text = net('layer { name: "s" type: "SOFTROIPooling" bottom: "d" bottom: "m" top: "o" '
               f'softroi_pooling_param {{ output_dim: {groups} mask_num: {masks} }} }}',
               inputs={"d": shape, "m": (3, masks, 5, 7)})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (3, groups, masks, 1)
    data = rng(4).standard_normal(shape).astype(F)
    mask = rng(5).uniform(0, 1, (3, masks, 5, 7)).astype(F)
    mask[1, 2] = 0                                   # a zero sum: the plain (zero) sum stays
    mask[2, 0] = -rng(6).uniform(0, 1, (5, 7))       # a negative sum: Forward_gpu divides (Forward_cpu would not)
    want = softroi_ref(data, mask, groups, masks)
    np.testing.assert_array_equal(want[1, :, 2], 0)
    weighted = (data[2, 0::masks] * mask[2, 0]).sum((1, 2))
    np.testing.assert_allclose(want[2, :, 0, 0], weighted / mask[2, 0].sum(), rtol=1e-5)
    check_everywhere(model, {"d": data, "m": mask}, {"o": want}, tmp_path, atol=1e-5, rtol=1e-5)


def test_softroi_pooling_checks_the_channels():
    with pytest.raises(LayerError, match="output_dim 2 x mask_num 3 = 6 channels"):
        load_from_text(net('layer { name: "s" type: "SOFTROIPooling" bottom: "d" bottom: "m" top: "o" '
                           'softroi_pooling_param { output_dim: 2 mask_num: 3 } }',
                           inputs={"d": (1, 5, 4, 4), "m": (1, 3, 4, 4)}))
    with pytest.raises(LayerError, match="output_dim and mask_num, both > 0"):
        load_from_text(net('layer { name: "s" type: "SOFTROIPooling" bottom: "d" bottom: "m" top: "o" }',
                           inputs={"d": (1, 6, 4, 4), "m": (1, 3, 4, 4)}))


# ---- the Leap data layers and EuclideanDist ------------------------------------------------------------

def leap_layer(kind, channels=2):
    return (f'layer {{ name: "data" type: "{kind}" top: "img" top: "lab" data_load_param {{ batch_size: 3 '
            f'channels: {channels} height: 9 width: 7 data_path: "M:/HandData" }} }}\n')


@pytest.mark.parametrize("kind, img, lab", [("LeapPredata", (3, 2, 9, 7), (3, 60)), ("LeapData", (3, 2, 9, 7), (3,)),
                                            ("LeapPredataSingle", (3, 1, 9, 7), (3, 60)),
                                            ("LeapSingleData", (3, 1, 9, 7), (3,))])
def test_leap_data_layers_are_inputs_shaped_by_data_load_param(kind, img, lab):
    model = load_from_text(leap_layer(kind, img[1]))
    assert model.blob_shapes["img"] == img and model.blob_shapes["lab"] == lab
    assert set(model.inputs) == {"img", "lab"}


def test_leap_data_checks_its_channels_and_sizes():
    with pytest.raises(LayerError, match="channels must be 2, got 3"):
        load_from_text(leap_layer("LeapPredata", 3))
    with pytest.raises(LayerError, match=r"data_load_param.height must be >= 1"):
        load_from_text(leap_layer("LeapData").replace("height: 9 ", ""))


def test_euclidean_dist_is_a_metric_whose_top_is_zero():
    text = leap_layer("LeapPredata") + ('layer { name: "dist" type: "EuclideanDist" bottom: "lab" bottom: "lab2" '
                                        'top: "accuracy" }')
    text = net(text, inputs={"lab2": (3, 60)})
    model = load_from_text(text)
    assert model.blob_shapes["accuracy"] == ()
    assert any("prints each joint's mean distance" in w for w in model.warnings)
    feeds = {"lab": rng(7).standard_normal((3, 60)).astype(F), "lab2": rng(8).standard_normal((3, 60)).astype(F),
             "img": np.zeros((3, 2, 9, 7), F)}
    got = model.run(feeds)["accuracy"]
    assert got.shape == () and got == 0


def test_euclidean_dist_needs_60_values_an_item():
    with pytest.raises(LayerError, match="60"):
        load_from_text(net('layer { name: "dist" type: "EuclideanDist" bottom: "a" bottom: "b" top: "acc" }',
                           inputs={"a": (2, 30), "b": (2, 30)}))


# ---- the corpus files ------------------------------------------------------------------------------------

REALWORLD = REPO / "tests" / "fixtures" / "realworld"
CORPUS = [
    (REALWORLD / "goodluckcwl__custom-caffe__src__caffe__test__mapping_by_similarity_layer.prototxt", (),
     "data,sim1 -> mapping  8x63x16x16"),
    (REALWORLD / "goodluckcwl__custom-caffe__src__caffe__test__pixelwise_similarity_layer.prototxt", (),
     "data -> pixel    2x256x1x9"),
    (REALWORLD / ("sp9103__DeepHandPoseRecognizer__Caffe__windows__caffe__resnet_pretrain__resnet_pretrain_18"
                  ".prototxt"), (), "finger_calc,finger -> accuracy         scalar"),
    (REALWORLD / ("sp9103__DeepHandPoseRecognizer__Caffe__windows__caffe__resnet_classification__"
                  "resnet_classification_18.prototxt"), (), "-> Image,label                        10x2x240x240; 10"),
    (REALWORLD / ("a8039974__py-R-FCN-1__models__pascal_voc__ResNet-101__softmax_hard_rfcn_god__soft_rfcn_test"
                  ".pt.prototxt"), (), "roi_pool_cls,Sig_mask -> softroipooled_cls  1x21x25x1"),
    (REALWORLD / ("a8039974__py-R-FCN-1__models__pascal_voc__ResNet-50__deconv_softmax_rfcn__soft_rfcn_test"
                  ".pt.prototxt"), (), "rfcn_pool_cls,Sig_mask -> softroipooled_cls  1x21x25x1"),
]


@pytest.mark.parametrize("path, args, row", CORPUS, ids=[p.name[:48] for p, _, _ in CORPUS])
def test_the_forks_files_read(path, args, row):
    out = inspect_corpus_file(str(path), *args)
    assert row in out, out
