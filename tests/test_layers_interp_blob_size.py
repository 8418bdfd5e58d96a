"""Interp's `use_blob_size` (soeaver/py-RFCN-priv 8fcc58b caffe-priv/src/caffe/proto/caffe.proto, field 7 there,
10007 here; caffe-priv/src/caffe/layers/interp_layer.cpp fec9ec1 and caffe-priv/src/caffe/util/interp.cpp).

The reference is written here from the fork's C++: Reshape takes bottom 1's height and width before any other size
field, bottom 0 is cropped by pad_beg / pad_end (offset -pad_beg on both axes), and caffe_cpu_interp2 resizes it
with float32 ratios (in - 1) / (out - 1), truncated source indexes and float32 weights (a plain copy when the sizes
agree).
"""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text


def fork_interp2(x, ho, wo):
    """caffe_cpu_interp2 (not packed) of x (N, C, h, w), already cropped, to ho x wo, in float32 as the fork."""
    x = x.astype(np.float32)
    _n, _c, h, w = x.shape
    if (h, w) == (ho, wo):
        return x.copy()
    f = np.float32
    rh = f(h - 1) / f(ho - 1) if ho > 1 else f(0)
    rw = f(w - 1) / f(wo - 1) if wo > 1 else f(0)
    out = np.empty(x.shape[:2] + (ho, wo), np.float32)
    for i in range(ho):
        hr = f(rh * f(i))
        h0 = int(hr)
        hp = 1 if h0 < h - 1 else 0
        l1h = f(hr - f(h0))
        l0h = f(1) - l1h
        for j in range(wo):
            wr = f(rw * f(j))
            w0 = int(wr)
            wp = 1 if w0 < w - 1 else 0
            l1w = f(wr - f(w0))
            l0w = f(1) - l1w
            top = l0w * x[:, :, h0, w0] + l1w * x[:, :, h0, w0 + wp]
            bot = l0w * x[:, :, h0 + hp, w0] + l1w * x[:, :, h0 + hp, w0 + wp]
            out[:, :, i, j] = l0h * top + l1h * bot
    return out


def interp_net(params, x_shape, ref_shape, bottoms=("x", "ref")):
    tops = "".join(f' bottom: "{b}"' for b in bottoms)
    inputs = {"x": x_shape, "ref": ref_shape} if "ref" in bottoms else {"x": x_shape}
    return net(f'layer {{ name: "i" type: "Interp"{tops} top: "i" interp_param {{ {params} }} }}', inputs=inputs)


CASES = [
    # (interp_param besides use_blob_size, bottom 1's shape, crop (pad_beg, pad_end))
    ("", (2, 4, 11, 14), (0, 0)),                                   # up, H != W, another channel count
    ("zoom_factor: 3", (2, 1, 9, 4), (0, 0)),                       # zoom would give 13 x 19: bottom 1 wins
    ("shrink_factor: 2", (2, 3, 3, 13), (0, 0)),                    # shrink would give 3 x 4
    ("height: 6 width: 5", (2, 2, 4, 10), (0, 0)),                  # height/width would give 6 x 5
    ("shrink_factor: 2 zoom_factor: 3", (2, 3, 17, 8), (0, 0)),
    ("pad_beg: -1 pad_end: -2", (2, 3, 7, 9), (1, 2)),              # cropped 2 x 4 first, then resized
    ("pad_beg: -1", (2, 5, 2, 5), (1, 0)),                          # cropped rows 1-4, columns 1-6
    ("pad_end: -1", (2, 1, 4, 6), (0, 1)),                          # cropped to bottom 1's size: a copy
]


@pytest.mark.parametrize("params, ref_shape, crop", CASES)
def test_use_blob_size_takes_bottom_1s_height_and_width_first(params, ref_shape, crop, tmp_path):
    x = rng(11).standard_normal((2, 3, 5, 7)).astype(np.float32)
    model = load_from_text(interp_net(f"use_blob_size: true {params}", x.shape, ref_shape))
    assert model.blob_shapes["i"] == (2, 3) + ref_shape[2:]
    b, e = crop
    ref = fork_interp2(x[:, :, b:x.shape[2] - e, b:x.shape[3] - e], *ref_shape[2:])
    feeds = {"x": x, "ref": rng(12).standard_normal(ref_shape).astype(np.float32)}
    check_everywhere(model, feeds, {"i": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_without_use_blob_size_the_other_fields_still_win_over_a_second_bottom(tmp_path):
    # caffeq's two-bottom Interp unchanged: bottom 1 sizes the output only when no other field does
    x = rng(13).standard_normal((2, 3, 5, 7)).astype(np.float32)
    model = load_from_text(interp_net("zoom_factor: 3", x.shape, (2, 1, 9, 4)))
    assert model.blob_shapes["i"] == (2, 3, 13, 19)
    feeds = {"x": x, "ref": np.zeros((2, 1, 9, 4), np.float32)}
    check_everywhere(model, feeds, {"i": fork_interp2(x, 13, 19)}, tmp_path, atol=1e-5, rtol=1e-5)
    plain = load_from_text(interp_net("use_blob_size: false", x.shape, (2, 1, 9, 4)))
    assert plain.blob_shapes["i"] == (2, 3, 9, 4)


FPN = """
layer { name: "lat" type: "Convolution" bottom: "c4" top: "lat" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "up" type: "Interp" bottom: "p5" bottom: "c4" top: "up" interp_param { use_blob_size: true } }
layer { name: "sum" type: "Eltwise" bottom: "lat" bottom: "up" top: "o" }
"""


def test_fpn_top_down_join_as_in_soeavers_faster_rcnn_fpn(tmp_path):
    # soeaver/caffe-model det/faster_rcnn/models/coco/inception-v4/faster_coco_inception-v4-merge-aligned-fpn:
    # p5 (19 x 32) resized to the lateral map's odd size (38 x 63) and added
    c4 = rng(14).standard_normal((2, 6, 9, 15)).astype(np.float32)
    p5 = rng(15).standard_normal((2, 4, 5, 8)).astype(np.float32)
    model = load_from_text(net(FPN, inputs={"c4": c4.shape, "p5": p5.shape}), random_weights=True)
    assert model.blob_shapes["o"] == (2, 4, 9, 15)
    w, bias = (np.asarray(p, np.float64) for p in model.params["lat"])
    lat = np.einsum("oc,nchw->nohw", w.reshape(4, 6), c4.astype(np.float64)) + bias[None, :, None, None]
    ref = (lat + fork_interp2(p5, 9, 15)).astype(np.float32)
    check_everywhere(model, {"c4": c4, "p5": p5}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_use_blob_size_with_one_bottom_is_one_line_error():
    with pytest.raises(CaffeqError, match="interp_param.use_blob_size needs a second bottom") as e:
        load_from_text(interp_net("use_blob_size: true", (1, 2, 5, 7), None, bottoms=("x",)))
    assert "\n" not in str(e.value)


def test_use_blob_size_still_refuses_padding():
    with pytest.raises(CaffeqError, match="pad_beg/pad_end must be <= 0") as e:
        load_from_text(interp_net("use_blob_size: true pad_end: 1", (1, 2, 5, 7), (1, 1, 3, 3)))
    assert "\n" not in str(e.value)
