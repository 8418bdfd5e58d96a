"""Deep Image Retrieval's custom_layers NormalizeLayer and AggregateLayer (caffeq/layers/deep_retrieval.py)
against the module's numpy forward written here, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def py_layer(name, layer, bottom, top, param_str="{}"):
    return (f'layer {{ name: "{name}" type: "Python" bottom: "{bottom}" top: "{top}" python_param {{ '
            f"module: 'custom_layers' layer: '{layer}' param_str: \"{param_str}\" }} }}")


def normalize_ref(x):   # bottom / expand_dims(eps + sqrt((bottom ** 2).sum(axis=1)), axis=1), in float32
    return x / np.expand_dims(F(1e-8) + np.sqrt((x ** 2).sum(axis=1)), axis=1)


@pytest.mark.parametrize("shape", [(5, 8, 1, 1), (4, 6)])
def test_rmac_head_normalizes_and_sums_the_regions(shape, tmp_path):
    # deploy_resnet101_normpython: the pooled regions L2-normalized, summed into one descriptor, normalized again
    text = net(py_layer("n1", "NormalizeLayer", "x", "xn"), py_layer("rmac", "AggregateLayer", "xn", "s"),
               py_layer("n2", "NormalizeLayer", "s", "o"), inputs={"x": shape})
    model = load_from_text(text)
    x = rng(9).standard_normal(shape).astype(F)
    want = normalize_ref(normalize_ref(x).sum(axis=0, keepdims=True))
    assert model.blob_shapes["o"] == (1,) + shape[1:]
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_aggregate_per_image_with_num_rois(tmp_path):
    # the copies that batch images: each image's num_rois consecutive region rows summed
    text = net(py_layer("rmac", "AggregateLayer", "x", "o", "{'batch_size': 2, 'num_rois': 3}"), inputs={"x": (6, 4)})
    model = load_from_text(text)
    x = rng(10).standard_normal((6, 4)).astype(F)
    check_everywhere(model, {"x": x}, {"o": np.stack([x[:3].sum(0), x[3:].sum(0)])}, tmp_path, atol=1e-6, rtol=1e-6)
    with pytest.raises(LayerError, match="batch_size 3 x num_rois 3"):
        load_from_text(net(py_layer("rmac", "AggregateLayer", "x", "o", "{'batch_size': 3, 'num_rois': 3}"),
                           inputs={"x": (6, 4)}))
    with pytest.raises(LayerError, match="whole number of images"):
        load_from_text(net(py_layer("rmac", "AggregateLayer", "x", "o", "{'num_rois': 4}"), inputs={"x": (6, 4)}))
