"""dosovits/caffe-fr-chairs's CropSimple: the reference is the DoCrop kernel's index arithmetic written as a
loop (x + (W - w) / 2, y + (H - h) / 2 in integers), compared in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def crop_ref(x, h, w):
    n, c, height, width = x.shape
    out = np.empty((n, c, h, w), x.dtype)
    for y in range(h):
        for z in range(w):
            out[:, :, y, z] = x[:, :, y + (height - h) // 2, z + (width - w) // 2]
    return out


@pytest.mark.parametrize("shape, h, w", [((2, 3, 9, 8), 5, 4), ((1, 2, 7, 7), 7, 2), ((1, 1, 6, 5), 1, 5)])
def test_crop_simple(shape, h, w, tmp_path):
    model = load_from_text(net(f'layer {{ name: "c" type: "CropSimple" bottom: "x" top: "y" '
                               f'crop_param {{ crop_height: {h} crop_width: {w} }} }}', inputs={"x": shape}))
    x = rng(81).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"y": crop_ref(x, h, w)}, tmp_path)


@pytest.mark.parametrize("params, message", [("crop_height: 3", "needs crop_param.crop_width"),
                                             ("crop_height: 3 crop_width: 9", "must be 1 to the bottom's")])
def test_bad_sizes(params, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(f'layer {{ name: "c" type: "CropSimple" bottom: "x" top: "y" crop_param {{ {params} }} }}',
                           inputs={"x": (1, 1, 4, 4)}))
