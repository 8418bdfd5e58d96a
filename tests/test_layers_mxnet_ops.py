"""Layers MXNet-to-Caffe converters write: Broadcastmul, MXNet's broadcast_mul (the squeeze-excitation
product), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


@pytest.mark.parametrize("type_name", ["Broadcastmul", "BroadcastMul"])
def test_broadcast_mul_scales_each_channel_as_an_se_block(type_name, tmp_path):
    # the converter's SE block: a Reshape of the sigmoid's (N, C) to (N, C, 1, 1), then the product
    layers = ('layer { name: "r" type: "Reshape" bottom: "s" top: "r" reshape_param { shape { dim: -1 dim: 3 '
              'dim: 1 dim: 1 } } }',
              f'layer {{ name: "m" type: "{type_name}" bottom: "x" bottom: "r" top: "y" }}')
    model = load_from_text(net(*layers, inputs={"x": (2, 3, 4, 5), "s": (2, 3)}))
    g = np.random.default_rng(5)
    x, s = g.standard_normal((2, 3, 4, 5)).astype(f32), g.random((2, 3)).astype(f32)
    ref = np.empty_like(x)
    for n in range(2):
        for c in range(3):                       # each plane times its sample's channel factor
            ref[n, c] = x[n, c] * s[n, c]
    assert model.blob_shapes["y"] == (2, 3, 4, 5)
    check_everywhere(model, {"x": x, "s": s}, {"y": ref}, tmp_path)
    stub = [w for w in model.warnings if "stub that copies bottom 0" in w]
    assert len(stub) == (type_name == "Broadcastmul")


def test_broadcast_mul_notes_many_layers_in_one_line():
    layers = [f'layer {{ name: "m{i}" type: "Broadcastmul" bottom: "x" bottom: "s" top: "y{i}" }}' for i in range(5)]
    model = load_from_text(net(*layers, inputs={"x": (1, 3, 4, 5), "s": (1, 3, 1, 1)}))
    stub = [w for w in model.warnings if "stub that copies bottom 0" in w]
    assert len(stub) == 1 and "layers 'm0', 'm1', 'm2' (+2 more) (Broadcastmul)" in stub[0]


@pytest.mark.parametrize("factors", [(1, 4, 1, 1), (2, 3, 2, 1), (1, 1, 3, 4, 5)])
def test_broadcast_mul_refuses_factors_that_do_not_broadcast_to_the_data(factors):
    with pytest.raises(LayerError, match="does not broadcast to bottom 0"):
        load_from_text(net('layer { name: "m" type: "Broadcastmul" bottom: "x" bottom: "s" top: "y" }',
                           inputs={"x": (1, 3, 4, 5), "s": factors}))
