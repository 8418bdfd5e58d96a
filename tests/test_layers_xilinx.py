"""Xilinx's (DeePhi's) Caffe: DeephiResize in torch, onnxruntime and model.py against the fork's own forward,
which runs OpenCV's cv::resize on every plane, transposed."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

cv2 = pytest.importorskip("cv2")
f32 = np.float32


def fork_resize(x, out_h, out_w, nearest):
    """deephi_resize_layer.cpp's CPU path: each plane copied into a Mat as its transpose (rows W, cols H),
    cv::resize to Size(out_h, out_w) (cols out_h, rows out_w), read back transposed."""
    mode = cv2.INTER_NEAREST if nearest else cv2.INTER_LINEAR
    out = np.empty(x.shape[:2] + (out_h, out_w), f32)
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            out[n, c] = cv2.resize(np.ascontiguousarray(x[n, c].T), (out_h, out_w), interpolation=mode).T
    return out


def resize_net(params, shape):
    return load_from_text(net(f'layer {{ name: "r" type: "DeephiResize" bottom: "x" top: "y" '
                              f'deephi_resize_param {{ {params} }} }}', inputs={"x": shape}))


@pytest.mark.parametrize("params, shape, out", [
    ("scale_h: 2 scale_w: 2", (2, 3, 5, 7), (10, 14)),                  # DNNDK-YOLOv3's upsample layers
    ("scale_h: 1.5 scale_w: 3", (1, 2, 5, 4), (7, 12)),                 # int(5 * 1.5): truncated
    ("new_height: 4 new_width: 9", (1, 2, 7, 6), (4, 9)),               # down along H, up along W
    ("scale_h: 2 scale_w: 2 resize_type: NEAREST", (1, 3, 5, 6), (10, 12)),
    ("new_height: 3 new_width: 11 resize_type: NEAREST", (2, 2, 7, 4), (3, 11)),
])
def test_deephi_resize_matches_the_forks_transposed_cv_resize(params, shape, out, tmp_path):
    model = resize_net(params, shape)
    assert model.blob_shapes["y"] == shape[:2] + out
    x = np.random.default_rng(7).standard_normal(shape).astype(f32)
    ref = fork_resize(x, *out, nearest="NEAREST" in params)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6)


@pytest.mark.parametrize("params, message", [
    ("new_height: 4", "new_height and new_width should be set at the same time"),
    ("scale_w: 2", "scale_h and scale_w should be set at the same time"),
    ("scale_h: 0.1 scale_w: 0.1", "gives a 0x0 top for a 5x7 bottom"),
])
def test_deephi_resize_refuses_what_the_fork_refuses(params, message):
    with pytest.raises(LayerError, match=message):
        resize_net(params, (1, 2, 5, 7))
