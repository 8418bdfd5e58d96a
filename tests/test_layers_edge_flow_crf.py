"""Layers of edge_flow_crf_forks.py and RCF's AutoCrop (caffeq/io/coord_maps.py), each as its fork
computes it: RCF auto_crop_layer.cpp, happynear insanity_layer.cpp (TEST), DeepSkeleton
quantize_layer.cpp / rescale_layer.cpp, flownet2 flow_warp_layer.cpp.  CRF-RNN's MultiStageMeanfield is
tested in test_layers_crf_rnn.py, DeepLab's DenseCRF in test_layers_dense_crf.py.

References are float64 numpy loops written here from the forks' code; each running layer is checked
in torch, onnxruntime and the generated model.py.
"""
import math

import numpy as np
import pytest
from conftest import assert_close, check_everywhere, model_py_outputs, net, node_of, onnx_outputs, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text


def check_backends(model, feeds, tmp_path, refs, atol=1e-5, rtol=1e-5):
    """torch (the exact module), onnxruntime (default opset) and model.py against refs."""
    check_everywhere(model, feeds, refs, tmp_path, atol, rtol, opsets=(None,), exact=True)


# ---- AutoCrop ------------------------------------------------------------------------------

AUTOCROP_NET = """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 dilation: 2 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "up" type: "Deconvolution" bottom: "pool" top: "up"
  convolution_param { num_output: 2 kernel_h: 4 kernel_w: 6 stride: 2 } }
layer { name: "crop" type: "AutoCrop" bottom: "up" bottom: "data" top: "o" }
"""


def test_autocrop_offsets_follow_rcfs_dilated_coordinate_maps(tmp_path):
    # RCF's maps (bottom -> top): conv FilterMap(extent 5, s 1, p 1)^-1: x - 1; pool FilterMap(2, 2, 0)^-1:
    # (x - 1/2) / 2; deconv FilterMap(k 4|6, s 2, p 0): 2x + 3/2 | 2x + 5/2.  data -> up: h x + 0, w x + 1,
    # so the crop starts at (0, 1).  (Without the dilation the conv would be the identity: (1, 2).)
    x = rng(3).standard_normal((2, 3, 13, 11)).astype(np.float32)
    model = load_from_text(net(AUTOCROP_NET, inputs={"data": x.shape}), random_weights=True)
    crop = node_of(model, "crop")
    assert crop.type == "Crop" and list(crop.attrs["offsets"])[-2:] == [0, 1]
    assert model.graph.tensors["up"].shape[2:] == (14, 14)
    assert model.graph.tensors["o"].shape == (2, 2, 13, 11)
    up = model.run({"data": x}, all_blobs=True)["up"]
    check_backends(model, {"data": x}, tmp_path, {"o": up[:, :, 0:13, 1:12]})


def test_autocrop_refuses_a_scale_mismatch():
    text = net('layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" '
               'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n'
               'layer { name: "crop" type: "AutoCrop" bottom: "pool" bottom: "data" top: "o" }',
               inputs={"data": (1, 1, 8, 8)})
    with pytest.raises(CaffeqError, match="crop.*AutoCrop.*scale 1"):
        load_from_text(text)


def test_autocrop_refuses_disconnected_bottoms():
    text = net('layer { name: "crop" type: "AutoCrop" bottom: "a" bottom: "b" top: "o" }',
               inputs={"a": (1, 1, 8, 8), "b": (1, 1, 4, 4)})
    with pytest.raises(CaffeqError, match="share no earlier blob"):
        load_from_text(text)


# ---- Insanity ------------------------------------------------------------------------------

def insanity_ref(x, lb, ub):
    """insanity_layer.cpp at TEST: max(x, 0) + min(x, 0) / mean_slope, mean_slope kept in float."""
    mean_slope = float(np.float32((ub - lb) / (math.log(abs(ub)) - math.log(abs(lb)))))
    y = np.empty(x.shape)
    for i, v in np.ndenumerate(x.astype(np.float64)):
        y[i] = max(v, 0.0) + min(v, 0.0) / mean_slope
    return y


@pytest.mark.parametrize("params, lb, ub", [("insanity_param { lb: 3 ub: 5 }", 3.0, 5.0),
                                            ("", 5.0, 10.0)])        # the fork's defaults
def test_insanity_divides_by_the_logarithmic_mean(params, lb, ub, tmp_path):
    x = rng(4).standard_normal((3, 2, 5, 4)).astype(np.float32) * 3
    model = load_from_text(net(f'layer {{ name: "r" type: "Insanity" bottom: "x" top: "o" {params} }}',
                               inputs={"x": x.shape}))
    check_backends(model, {"x": x}, tmp_path, {"o": insanity_ref(x, lb, ub)})


def test_insanity_bad_bounds_name_its_field():
    with pytest.raises(LayerError, match="insanity_param.ub must be > insanity_param.lb"):
        load_from_text(net('layer { name: "r" type: "Insanity" bottom: "x" top: "o" '
                           'insanity_param { lb: 4 ub: 2 } }', inputs={"x": (1, 2, 3, 4)}))


# ---- Quantize and Rescale ------------------------------------------------------------------

def quantize_ref(x):
    y = np.zeros(x.shape)
    for i, v in np.ndenumerate(x):
        if v < 1 or v >= 200:
            y[i] = 0
        elif v < 12:
            y[i] = 1
        elif v < 36:
            y[i] = 2
        elif v < 80:
            y[i] = 3
        else:
            y[i] = 4
    return y


def rescale_ref(x, rf):
    scaled, inside = np.zeros(x.shape), np.zeros(x.shape)
    eps = float(np.float32(0.0001))
    for i, v in np.ndenumerate(x):
        if v >= rf or abs(v) <= eps:
            continue
        inside[i] = 1
        scaled[i] = 2 * float(v) / rf - 1
    return scaled, inside


def skeleton_scales(shape, seed):
    """Scales around every class edge, some negative, some tiny."""
    x = rng(seed).uniform(-20, 230, shape).astype(np.float32)
    edges = np.array([1, 12, 36, 80, 200, 14, 0.00005, -0.00005, 0, 13.999], np.float32)
    x.reshape(-1)[:edges.size] = edges
    return x


def test_quantize_maps_scales_to_classes(tmp_path):
    x = skeleton_scales((2, 1, 5, 7), 5)
    model = load_from_text(net('layer { name: "q" type: "Quantize" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    check_backends(model, {"x": x}, tmp_path, {"o": quantize_ref(x)}, atol=0, rtol=0)


@pytest.mark.parametrize("tops", [1, 2])
def test_rescale_projects_inside_the_receptive_field(tops, tmp_path):
    x = skeleton_scales((3, 2, 4, 6), 6)
    extra = ' top: "bin"' if tops == 2 else ""
    model = load_from_text(net(f'layer {{ name: "r" type: "Rescale" bottom: "x" top: "o"{extra} '
                               f'rescale_param {{ rf: 14 }} }}', inputs={"x": x.shape}))
    scaled, inside = rescale_ref(x, 14.0)
    refs = {"o": scaled, "bin": inside} if tops == 2 else {"o": scaled}
    check_backends(model, {"x": x}, tmp_path, refs)


def test_rescale_refuses_rf_zero():
    with pytest.raises(LayerError, match="rescale_param.rf"):
        load_from_text(net('layer { name: "r" type: "Rescale" bottom: "x" top: "o" rescale_param { rf: 0 } }',
                           inputs={"x": (1, 1, 2, 2)}))


# ---- FlowWarp ------------------------------------------------------------------------------

def flow_warp_ref(image, flow, fill):
    """flow_warp_layer.cpp Forward_cpu, in float32 as the fork computes the positions and weights."""
    n_, c_, h, w = image.shape
    out = np.empty(image.shape)
    for n in range(n_):
        for y in range(h):
            for x in range(w):
                x2 = np.float32(x) + flow[n, 0, y, x]
                y2 = np.float32(y) + flow[n, 1, y, x]
                if not (x2 >= 0 and y2 >= 0 and x2 < w and y2 < h):
                    out[n, :, y, x] = fill
                    continue
                left, top = int(x2), int(y2)
                right, bottom = min(left + 1, w - 1), min(top + 1, h - 1)
                alpha, beta = float(x2 - left), float(y2 - top)
                for c in range(c_):
                    out[n, c, y, x] = ((1 - alpha) * (1 - beta) * image[n, c, top, left]
                                       + alpha * (1 - beta) * image[n, c, top, right]
                                       + (1 - alpha) * beta * image[n, c, bottom, left]
                                       + alpha * beta * image[n, c, bottom, right])
    return out


def warp_inputs(seed):
    g = rng(seed)
    image = g.standard_normal((2, 3, 5, 7)).astype(np.float32)
    flow = g.uniform(-3, 3, (2, 2, 5, 7)).astype(np.float32)
    flow[0, 0, 0, :3] = [0.0, 6.0, 6.5]      # lands exactly on, or past, the last column
    flow[0, 1, 1, :2] = [3.0, 3.25]          # the last row: the bottom neighbour clamps to it
    flow[1, :, 2, 2] = [-2.0, -2.0]          # exactly the corner (0, 0)
    return image, flow


def test_flow_warp_samples_bilinearly_and_fills_zero_outside(tmp_path):
    image, flow = warp_inputs(7)
    model = load_from_text(net('layer { name: "w" type: "FlowWarp" bottom: "img" bottom: "flow" top: "o" }',
                               inputs={"img": image.shape, "flow": flow.shape}))
    ref = flow_warp_ref(image, flow, 0.0)
    assert 0 < np.count_nonzero(ref == 0) < ref.size   # some pixels leave the image
    check_backends(model, {"img": image, "flow": flow}, tmp_path, {"o": ref})


def test_flow_warp_nan_fill(tmp_path):
    image, flow = warp_inputs(8)
    model = load_from_text(net('layer { name: "w" type: "FlowWarp" bottom: "img" bottom: "flow" top: "o" '
                               'flow_warp_param { fill_value: NOT_A_NUMBER } }',
                               inputs={"img": image.shape, "flow": flow.shape}))
    ref = flow_warp_ref(image, flow, np.nan)
    assert np.isnan(ref).any() and not np.isnan(ref).all()
    outs = {"torch": model.run({"img": image, "flow": flow}, exact=True)["o"],
            "onnx": onnx_outputs(model, {"img": image, "flow": flow}, tmp_path)["o"],
            "model.py": model_py_outputs(model, {"img": image, "flow": flow}, tmp_path)["o"]}
    for backend, got in outs.items():
        assert np.array_equal(np.isnan(got), np.isnan(ref)), backend
        assert_close(np.nan_to_num(got), np.nan_to_num(ref), 1e-5, 1e-5, backend)


@pytest.mark.parametrize("flow_shape, msg", [((2, 3, 5, 7), "flow must be"), ((2, 2, 5, 6), "flow must be"),
                                             ((1, 2, 5, 7), "flow must be")])
def test_flow_warp_checks_the_flow_shape(flow_shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net('layer { name: "w" type: "FlowWarp" bottom: "img" bottom: "flow" top: "o" }',
                           inputs={"img": (2, 3, 5, 7), "flow": flow_shape}))
