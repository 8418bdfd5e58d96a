"""DeepLab v2 fork layers (Kinpzz/deeplab-v2 d90d609): SpatialProduct and the VisualSaliency and BinaryPngWrite writers.

The reference is spatial_product_layer.cpp's loop (caffe_mul of each channel by the one-channel map),
written here in numpy on asymmetric shapes."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def ref_spatial_product(x, m):
    out = np.empty_like(x)
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            out[n, c] = x[n, c] * m[n, 0]
    return out


def test_spatial_product_weights_every_channel_by_the_map(tmp_path):
    shapes = {"x": (2, 3, 5, 7), "m": (2, 1, 5, 7)}
    model = load_from_text(net('layer { name: "p" type: "SpatialProduct" bottom: "x" bottom: "m" top: "o" }\n'
                               'layer { name: "show" type: "VisualSaliency" bottom: "m" '
                               'visual_saliency_param { save_dir: "/tmp/v/" visual_num: 1 visual_interval: 25 } }',
                               inputs=shapes))
    x = rng(1).standard_normal(shapes["x"]).astype(np.float32)
    m = rng(2).random(shapes["m"]).astype(np.float32)
    assert model.outputs == ["o"]   # the writer adds no output
    check_everywhere(model, {"x": x, "m": m}, {"o": ref_spatial_product(x, m)}, tmp_path)


@pytest.mark.parametrize("m_shape, msg", [((2, 2, 5, 7), "one channel"), ((2, 1, 5, 6), "num, height and width"),
                                          ((2, 1, 35), "4-axis map")])
def test_spatial_product_refuses_a_map_of_another_shape(m_shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net('layer { name: "p" type: "SpatialProduct" bottom: "x" bottom: "m" top: "o" }',
                           inputs={"x": (2, 3, 5, 7), "m": m_shape}))


def test_binary_png_writer_keeps_its_bottom_as_the_output(tmp_path):
    # the carvana test nets: the mask written as PNGs by a layer without tops, the mask still the net's output
    shapes = {"x": (1, 2, 3, 4), "m": (1, 1, 3, 4)}
    model = load_from_text(net('layer { name: "p" type: "SpatialProduct" bottom: "x" bottom: "m" top: "o" }\n'
                               'layer { name: "png" type: "BinaryPngWrite" bottom: "o" binary_png_write_param { '
                               'prefix: "masks/" source: "list/test_id.txt" strip: 0 period: 1 } include: { phase: TEST } }',
                               inputs=shapes))
    x = rng(3).standard_normal(shapes["x"]).astype(np.float32)
    m = rng(4).random(shapes["m"]).astype(np.float32)
    assert model.outputs == ["o"]
    check_everywhere(model, {"x": x, "m": m}, {"o": ref_spatial_product(x, m)}, tmp_path)
