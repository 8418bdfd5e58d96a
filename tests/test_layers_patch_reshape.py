"""Arroosh/optical_flow_prediction's patch Reshape (caffeq/layers/reshape.py, PatchReshape) against the fork's
reshape_layer.cpp loop written here, on asymmetric shapes, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def ref_patch_reshape(x, channels, out_h, out_w, patch_w, patch_h):
    """ReshapeLayer::Forward_cpu (00ba80e): a zeroed top, then per image and input (h, w) a counter over
    `for nw < pw: for nh < ph: for nc < C'` writes top[n, nc, h*ph + nh, w*pw + nw] = bottom[n, cnt, h, w]."""
    n, _, h, w = x.shape
    top = np.zeros((n, channels, out_h, out_w), F)
    for i in range(n):
        for y in range(h):
            for z in range(w):
                cnt = 0
                for nw in range(patch_w):
                    for nh in range(patch_h):
                        for nc in range(channels):
                            top[i, nc, y * patch_h + nh, z * patch_w + nw] = x[i, cnt, y, z]
                            cnt += 1
    return top


def layer(c, h, w, pw, ph):
    return (f'layer {{ name: "r" type: "Reshape" bottom: "x" top: "y" reshape_param {{ new_channel: {c} '
            f'new_height: {h} new_width: {w} new_patch_width: {pw} new_patch_height: {ph} }} }}')


@pytest.mark.parametrize("bottom, c, pw, ph", [
    ((2, 24, 3, 2), 3, 4, 2),
    ((1, 16000, 1, 1), 40, 20, 20),   # the fork's optical-flow net: fc8 to a 40-class 20 x 20 map
    ((2, 30), 5, 3, 2),               # a 2-axis bottom: height and width 1 to the fork's accessors
])
def test_patch_reshape_is_the_forks_loop(bottom, c, pw, ph, tmp_path):
    h, w = (bottom + (1, 1))[2:4]
    x = rng(8).standard_normal(bottom).astype(F)
    model = load_from_text(net(layer(c, h * ph, w * pw, pw, ph), inputs={"x": bottom}))
    ref = ref_patch_reshape(x.reshape(bottom[0], bottom[1], h, w), c, h * ph, w * pw, pw, ph)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)
    # another batch than the one read: the exports copy it
    if bottom[0] == 2:
        from conftest import backend_outputs
        one = x[:1]
        for name, y in backend_outputs(model, {"x": one}, tmp_path, top="y").items():
            np.testing.assert_array_equal(y, ref[:1], err_msg=name)


@pytest.mark.parametrize("params, message", [
    ((4, 6, 8, 4, 2), r"new_patch_width x new_patch_height x new_channel = 32 must be the bottom's 24 channels"),
    ((3, 5, 8, 4, 2), r"new_height x new_width 5 x 8 must be the bottom's 3 x 2 times the patch"),
    ((3, 6, 8, 0, 2), r"must all be >= 1"),
])
def test_patch_reshape_refuses_what_the_fork_would_scatter_wrongly(params, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(net(layer(*params), inputs={"x": (2, 24, 3, 2)}))
