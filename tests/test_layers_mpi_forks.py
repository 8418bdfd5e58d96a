"""The MPI forks' layers (caffeq/layers/mpi_forks.py): Lyp100208/Caffe_action's Gather, ConvolutionData,
InnerProductAll and BNData, lxx1991/caffe_mpi's BNData and 2-bottom Warping, against references written here
from their GPU kernels (gather_layer.cu, bn_data_layer.cu, warping_layer.cu), in torch, onnxruntime and
model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
COPY = 'layer { name: "copy" type: "Power" bottom: "x" top: "y" }\n'


def test_gather_with_one_process_copies_each_bottom(tmp_path):
    shapes = {"a": (2, 3, 4), "b": (2, 5)}
    model = load_from_text(net('layer { name: "g" type: "Gather" bottom: "a" bottom: "b" top: "ga" top: "gb" }',
                               inputs=shapes))
    r = rng(1)
    feeds = {k: r.standard_normal(s).astype(F32) for k, s in shapes.items()}
    check_everywhere(model, feeds, {"ga": feeds["a"], "gb": feeds["b"]}, tmp_path)
    with pytest.raises(LayerError, match="one top per bottom"):
        load_from_text(net('layer { name: "g" type: "Gather" bottom: "a" bottom: "b" top: "ga" }', inputs=shapes))


def test_convolution_data_and_inner_product_all_are_bvlcs(tmp_path):
    x = rng(2).standard_normal((2, 4, 7, 6)).astype(F32)
    model = load_from_text(net('layer { name: "c" type: "ConvolutionData" bottom: "x" top: "c" convolution_param { '
                               'num_output: 6 kernel_size: 3 stride: 2 pad: 1 group: 2 } }\n'
                               'layer { name: "ip" type: "InnerProductAll" bottom: "c" top: "y" '
                               'inner_product_param { num_output: 3 } }', inputs={"x": x.shape}), random_weights=True)
    w, b = (np.asarray(v) for v in node_of(model, "c").blobs)
    wi, bi = (np.asarray(v) for v in node_of(model, "ip").blobs)
    c = conv_ref(x, w, b, (2, 2), (1, 1), 2)
    check_everywhere(model, {"x": x}, {"y": c.reshape(2, -1) @ wi.T.astype(np.float64) + bi}, tmp_path,
                     atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params, eps", [
    ("scale_filler { type: 'constant' value: 1 } moving_average: true decay: 0.05", 1e-10),   # Lyp100208's
    ("slope_filler { type: 'constant' value: 1 } moving_average: true momentum: 0.95", 1e-5),  # lxx1991's
    ("moving_average: true var_eps: 0.001", 1e-3),
])
def test_bn_data_normalizes_with_the_stored_statistics(params, eps, tmp_path):
    """bn_data_layer.cu with moving_average: ((x - mean) / pow(var + eps, 0.5)) x scale + shift."""
    x = rng(3).standard_normal((2, 3, 4, 5)).astype(F32)
    model = load_from_text(net(COPY + f'layer {{ name: "b" type: "BNData" bottom: "y" top: "y" bn_param {{ {params} }} }}',
                               inputs={"x": x.shape}), random_weights=True)
    r = rng(4)
    scale, shift, mean = (r.standard_normal((1, 3, 1, 1)).astype(F32) for _ in range(3))
    var = r.uniform(0.5, 2, (1, 3, 1, 1)).astype(F32)
    node_of(model, "b").blobs = [scale, shift, mean, var]
    ref = (x.astype(np.float64) - mean) / np.sqrt(var.astype(np.float64) + eps) * scale + shift
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_bn_data_without_moving_average_is_refused():
    with pytest.raises(LayerError, match="batch's own statistics at TEST"):
        load_from_text(net('layer { name: "b" type: "BNData" bottom: "x" top: "y" bn_param { decay: 0.05 } }',
                           inputs={"x": (1, 2, 3, 3)}))


def fork_warping(image, flow):
    """warping_forward, one top element at a time, in float32."""
    n, c, h, w = image.shape
    out = np.zeros_like(image)

    def clamp(k, size):
        return 0 if k < 0 else (size - 1 if k >= size else k)
    for b in range(n):
        for y in range(h):
            for x in range(w):
                dh, dw = F32(flow[b, 1, y, x]), F32(flow[b, 0, y, x])
                th, tw = int(math.floor(F32(F32(y) + dh))), int(math.floor(F32(F32(x) + dw)))
                a0 = F32(1) - F32(F32(y - th) + dh)
                a1 = F32(1) - F32(F32(th + 1 - y) - dh)
                b0 = F32(1) - F32(F32(x - tw) + dw)
                b1 = F32(1) - F32(F32(tw + 1 - x) - dw)
                acc = np.zeros(c, F32)
                for yy, xx, wgt in ((th, tw, a0 * b0), (th + 1, tw, a1 * b0), (th, tw + 1, a0 * b1),
                                    (th + 1, tw + 1, a1 * b1)):
                    acc = acc + image[b, :, clamp(yy, h), clamp(xx, w)] * F32(wgt)
                out[b, :, y, x] = acc
    return out


def test_lxx_warping_samples_bilinearly_with_clamped_corners(tmp_path):
    r = rng(5)
    image = r.standard_normal((2, 3, 5, 7)).astype(F32)
    flow = (r.standard_normal((2, 2, 5, 7)) * 3).astype(F32)   # some points far outside: the border is read
    flow[0, :, 1, 2] = [0.25, -0.5]
    model = load_from_text(net('layer { name: "w" type: "Warping" bottom: "img" bottom: "flow" top: "o" }',
                               inputs={"img": image.shape, "flow": flow.shape}))
    assert node_of(model, "w").spec.__class__.__name__ == "ClampedWarping"
    check_everywhere(model, {"img": image, "flow": flow}, {"o": fork_warping(image, flow)}, tmp_path,
                     atol=1e-5, rtol=1e-5)
    with pytest.raises(LayerError, match="flow .N, 2, H, W."):
        load_from_text(net('layer { name: "w" type: "Warping" bottom: "img" bottom: "flow" top: "o" }',
                           inputs={"img": (1, 3, 5, 7), "flow": (1, 3, 5, 7)}))
