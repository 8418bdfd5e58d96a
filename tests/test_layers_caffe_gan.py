"""limuhit's Caffe_Gan / CCN layers (caffeq/layers/caffe_gan.py) against loops written here from dtow_layer.cpp,
const_scale_layer.cpp, switch_layer.cpp and mask_layer.cpp, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def dtow_ref(x, p, to_space):
    n, c, h, w = x.shape
    if to_space:     # top[n, c / p^2, h p + (c % p^2) / p, w p + (c % p^2) % p] = bottom[n, c, h, w]
        out = np.zeros((n, c // (p * p), h * p, w * p), F32)
        for ch in range(c):
            k = ch % (p * p)
            out[:, ch // (p * p), k // p::p, k % p::p] = x[:, ch]
        return out
    out = np.zeros((n, c * p * p, h // p, w // p), F32)   # top[n, c p^2 + (h % p) p + w % p, h / p, w / p]
    for y in range(h):
        for z in range(w):
            out[:, np.arange(c) * p * p + (y % p) * p + z % p, y // p, z // p] = x[:, :, y, z]
    return out


@pytest.mark.parametrize("method, p, shape", [("MDTOW", 2, (2, 12, 3, 5)), ("MWTOD", 3, (2, 2, 6, 9)),
                                              ("MDTOW", 4, (1, 32, 2, 3))])
def test_dtow_is_pixel_shuffle_and_its_inverse(method, p, shape, tmp_path):
    x = rng(41).standard_normal(shape).astype(F32)
    model = load_from_text(net(f'layer {{ name: "d" type: "Dtow" bottom: "x" top: "y" net_id: 1 dtow_param {{ '
                               f'psize: {p} method: {method} }} }}', inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"y": dtow_ref(x, p, method == "MDTOW")}, tmp_path)


@pytest.mark.parametrize("method, shape, message", [
    ("MDTOW", (1, 6, 3, 3), "psize 2 needs channels divisible by 4, got 6"),
    ("MWTOD", (1, 3, 4, 5), "psize 2 needs height and width divisible by 2, got 4 x 5")])
def test_dtow_refuses_sizes_its_block_does_not_divide(method, shape, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(f'layer {{ name: "d" type: "Dtow" bottom: "x" top: "y" dtow_param {{ psize: 2 '
                           f'method: {method} }} }}', inputs={"x": shape}))


def test_const_scale_switch_and_importance_mask(tmp_path):
    r = rng(42)
    a, b = r.uniform(0, 1, (2, 1, 4, 5)).astype(F32), r.uniform(0, 1, (2, 1, 4, 5)).astype(F32)
    text = net('layer { name: "inv" type: "ConstScale" bottom: "a" top: "inv" const_scale_param { scale: -1 bias: 1 } }',
               'layer { name: "sw" type: "Switch" bottom: "inv" bottom: "b" top: "sw" net_id: 2 }',
               'layer { name: "m" type: "Mask" bottom: "sw" top: "m" net_id: 1 imp_map_param { cmp_ratio: 0.7 '
               'weight: 0.1 channel_out: 3 } }', inputs={"a": a.shape, "b": b.shape})
    model = load_from_text(text, random_weights=True, outputs=["inv", "sw", "m"])
    inv = F32(1) - a            # (-1) a, then + 1
    mask = np.repeat((inv > F32(0.5)).astype(F32), 3, axis=1)
    assert model.blob_shapes["m"] == (2, 3, 4, 5)
    check_everywhere(model, {"a": a, "b": b}, {"inv": inv, "sw": inv, "m": mask}, tmp_path)
    with pytest.raises(LayerError, match="one-channel map"):
        load_from_text(net('layer { name: "m" type: "Mask" bottom: "a" top: "m" imp_map_param { channel_out: 3 } }',
                           inputs={"a": (1, 2, 3, 3)}))
