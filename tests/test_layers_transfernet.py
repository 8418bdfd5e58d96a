"""maga33/TransferNet's layers (aaa32d7 scale_layer.cpp, linear_sum_layer.cpp, filter_sum_layer.cu): the
references are the fork's loops in numpy float32, on asymmetric shapes."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def test_scale_factor_scales_each_bottom_without_blobs(tmp_path):
    text = net('layer { name: "s" type: "Scale" bottom: "x" bottom: "y" top: "a" top: "b" '
               'scale_param { scale_factor: 0.004 } }', inputs={"x": (2, 3, 4, 5), "y": (1, 6)})
    model = load_from_text(text)
    assert node_of(model, "s").expected_param_shapes is None
    x, y = rng(1).standard_normal((2, 3, 4, 5)).astype(F), rng(2).standard_normal((1, 6)).astype(F)
    # caffe_cpu_scale with the factor as a float
    check_everywhere(model, {"x": x, "y": y}, {"a": x * F(0.004), "b": y * F(0.004)}, tmp_path)


def test_bvlc_scale_keeps_its_blob():
    model = load_from_text(net('layer { name: "s" type: "Scale" bottom: "x" top: "a" }', inputs={"x": (2, 3, 4, 5)}),
                           random_weights=True)
    assert node_of(model, "s").expected_param_shapes == [(3,)]


def test_scale_factor_refuses_more_tops_than_bottoms():
    with pytest.raises(LayerError, match="one top per bottom"):
        load_from_text(net('layer { name: "s" type: "Scale" bottom: "x" top: "a" top: "b" '
                           'scale_param { scale_factor: 2 } }', inputs={"x": (1, 2)}))


def linear_sum_ref(x, w):
    n, c = x.shape[:2]
    xs, ws = x.reshape(n, c, -1), w.reshape(n, -1)
    out = np.zeros((n, c), F)
    for i in range(n):
        for ch in range(c):
            acc = F(0)
            for k in range(xs.shape[2]):
                acc = F(acc + xs[i, ch, k] * ws[i, k])
            out[i, ch] = acc
    return out


def filter_sum_ref(x, w):
    n, c, h, wd = x.shape
    ws = w.reshape(-1)
    out = np.zeros((n, 1, h, wd), F)
    for i in range(n):
        for y in range(h):
            for z in range(wd):
                acc = F(0)
                for ch in range(c):      # FilterSumForward's loop over the channels
                    acc = F(acc + x[i, ch, y, z] * ws[i * c + ch])
                out[i, 0, y, z] = acc
    return out


def test_attention_decoder_interface(tmp_path):
    """TransferNet's attention: LinearSum of the features with a (N, 1, H, W) map, then FilterSum of the
    features with those per-channel sums."""
    text = net('layer { name: "ls" type: "LinearSum" bottom: "feat" bottom: "att" top: "soft" }',
               'layer { name: "fs" type: "FilterSum" bottom: "feat" bottom: "soft" top: "map" }',
               inputs={"feat": (2, 3, 4, 5), "att": (2, 1, 4, 5)})
    model = load_from_text(text, outputs=["soft", "map"])
    assert model.blob_shapes["soft"] == (2, 3) and model.blob_shapes["map"] == (2, 1, 4, 5)
    feat = rng(3).standard_normal((2, 3, 4, 5)).astype(F)
    att = rng(4).uniform(0, 1, (2, 1, 4, 5)).astype(F)
    soft = linear_sum_ref(feat, att)
    check_everywhere(model, {"feat": feat, "att": att}, {"soft": soft, "map": filter_sum_ref(feat, soft)}, tmp_path,
                     atol=1e-6, rtol=1e-5)


def test_filter_sum_takes_four_axis_weights(tmp_path):
    text = net('layer { name: "fs" type: "FilterSum" bottom: "x" bottom: "w" top: "o" }',
               inputs={"x": (1, 4, 3, 2), "w": (1, 4, 1, 1)})
    x, w = rng(5).standard_normal((1, 4, 3, 2)).astype(F), rng(6).standard_normal((1, 4, 1, 1)).astype(F)
    check_everywhere(load_from_text(text), {"x": x, "w": w}, {"o": filter_sum_ref(x, w)}, tmp_path,
                     atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layer, shapes, msg", [
    ("LinearSum", {"x": (2, 3, 4, 5), "w": (2, 2, 4, 5)}, "must be x's shape"),
    ("LinearSum", {"x": (2, 3, 4, 5), "w": (2, 1, 5, 4)}, "must be x's shape"),
    ("FilterSum", {"x": (2, 3, 4, 5), "w": (2, 4)}, "one value per sample and channel"),
    ("FilterSum", {"x": (2, 3, 4, 5), "w": (2, 3, 2)}, "one value per sample and channel"),
])
def test_refuses_what_the_fork_checks_or_cannot_index(layer, shapes, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "l" type: "{layer}" bottom: "x" bottom: "w" top: "o" }}', inputs=shapes))


def test_transfernet_target_data_layer_reads_without_its_lists():
    text = ('layer { name: "data" type: "SelectSrcTgkSegBinary" top: "data" top: "seg-label" top: "cls-label" '
            'image_data_param { source: "coco.txt" target: "voc.txt" label_type: PIXEL batch_size: 2 } '
            'window_cls_data_param { label_dim: 20 } transform_param { crop_size: 32 } }\n'
            'layer { name: "c" type: "Convolution" bottom: "data" top: "o" convolution_param { num_output: 2 '
            'kernel_size: 3 } }')
    model = load_from_text(text, phase="TRAIN", random_weights=True)
    assert model.blob_shapes["data"] == (2, 3, 32, 32)
    assert model.blob_shapes["seg-label"] == (2, 1, 32, 32) and model.blob_shapes["cls-label"] == (2, 20, 1, 1)
