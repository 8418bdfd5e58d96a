"""XmBrain/Quantizer (75dd74d): its quantization_param and the *Ristretto layers its generator writes.

The reference is a transcription of the fork's Trim2FixedPoint_cpu (base_ristretto_layer.cpp): saturate to
[-2^(bw-1), 2^(bw-1) - 1] (signed) or [0, 2^bw - 1] (unsigned, is_sign_data 0) steps of 2^-fl, divide by
the step, C round() (halves away from zero), times the step.  Weights and bias are rounded signed with
bw/fl_params, top 0 with bw/fl_layer_data; no layer rounds its bottoms.  Inputs and weights are on coarse
dyadic grids so every sum is exact and each backend must match bit for bit.
"""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.model import load_from_text


def trim_ref(x, bw, fl, signed=True):
    step = np.float32(2.0 ** -fl)
    top = np.float32(2.0 ** (bw - 1 if signed else bw))
    low, high = (-top * step if signed else np.float32(0)), (top - np.float32(1)) * step
    v = np.minimum(np.maximum(np.asarray(x, np.float32), low), high) / step
    return (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.float32) * step


def xq(bw_params=0, fl_params=0, bw_layer_data=8, fl_layer_data=3, is_sign_data=1):
    return (f"quantization_param {{ bw_params: {bw_params} fl_params: {fl_params} bw_layer_data: {bw_layer_data} "
            f"fl_layer_data: {fl_layer_data} is_sign_data: {is_sign_data} }}")


def grid(r, shape, scale=4, spread=40):
    return (r.integers(-spread, spread, shape) / scale).astype(np.float32)


@pytest.mark.parametrize("sign", [1, 0])
def test_convolution_rounds_weights_bias_and_top_0_only(sign, tmp_path):
    # conv_ristretto_layer.cpp: weights and bias (signed, params), the float convolution, top 0 (layer_data)
    shape = (2, 3, 6, 5)
    text = net('layer { name: "q" type: "ConvolutionRistretto" bottom: "x" top: "y" convolution_param { '
               'num_output: 4 kernel_h: 3 kernel_w: 2 pad_h: 1 } ' + xq(6, 3, 7, 2, sign) + ' }', inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    r = rng(71)
    x, w, b = grid(r, shape, 8), grid(r, (4, 3, 3, 2), 16, 30), grid(r, (4,), 16)
    node = node_of(model, "q")
    node.blobs = [w, b]
    model.clear_cache()
    y = conv_ref(x, trim_ref(w, 6, 3), trim_ref(b, 6, 3), (1, 1), (1, 0))
    check_everywhere(model, {"x": x}, {"y": trim_ref(y.astype(np.float32), 7, 2, bool(sign))}, tmp_path)


def test_inner_product_pooling_relu_and_deconvolution(tmp_path):
    r = rng(72)
    layers = [
        'layer { name: "ip" type: "InnerProductRistretto" bottom: "x" top: "ip" inner_product_param { num_output: 6 } '
        + xq(8, 4, 8, 2) + ' }',
        'layer { name: "relu" type: "ReLURistretto" bottom: "ip" top: "ip" relu_param { negative_slope: 0.3 } '
        + xq(0, 0, 8, 3) + ' }',
        'layer { name: "r" type: "Reshape" bottom: "ip" top: "m" reshape_param { shape { dim: 2 dim: 1 dim: 2 dim: 3 } } }',
        'layer { name: "pool" type: "PoolingRistretto" bottom: "m" top: "p" pooling_param { pool: AVE kernel_size: 2 '
        'stride: 1 } ' + xq(0, 0, 8, 1, 0) + ' }',
        # 75dd74d's DeconvolutionRistretto leaves its weights as they are (bw_params 0 would make them -1)
        'layer { name: "up" type: "DeconvolutionRistretto" bottom: "p" top: "o" convolution_param { num_output: 1 '
        'kernel_size: 2 stride: 2 bias_term: false } ' + xq(0, 0, 8, 2) + ' }',
    ]
    model = load_from_text(net(*layers, inputs={"x": (2, 5)}), random_weights=True)
    x = grid(r, (2, 5), 4)
    w, b = grid(r, (6, 5), 8, 20), grid(r, (6,), 8)
    wd = grid(r, (1, 1, 2, 2), 8, 12)
    node_of(model, "ip").blobs = [w, b]
    node_of(model, "up").blobs = [wd]
    model.clear_cache()
    ip = trim_ref(x.astype(np.float64) @ trim_ref(w, 8, 4).T + trim_ref(b, 8, 4), 8, 2)
    relu = trim_ref(np.where(ip > 0, ip, ip * np.float32(0.3)), 8, 3)
    m = relu.reshape(2, 1, 2, 3)
    pool = trim_ref((m[..., :-1, :-1] + m[..., :-1, 1:] + m[..., 1:, :-1] + m[..., 1:, 1:]) / 4, 8, 1, False)
    up = np.zeros((2, 1, 2, 4), np.float64)
    for i in range(1):
        for j in range(2):
            up[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2] = pool[:, :, i:i + 1, j:j + 1] * wd[0, 0]
    blobs = model.run({"x": x}, all_blobs=True)
    np.testing.assert_array_equal(blobs["ip"], relu)
    np.testing.assert_array_equal(blobs["p"], pool)
    check_everywhere(model, {"x": x}, {"o": trim_ref(up.astype(np.float32), 8, 2)}, tmp_path)


def test_data_ristretto_rounds_the_data_top_after_the_graph_input(tmp_path):
    text = ('layer { name: "d" type: "DataRistretto" top: "data" top: "label" include { phase: TEST } '
            'data_param { source: "db" batch_size: 2 } ' + xq(0, 0, 8, 5, 0) + ' }\n'
            'layer { name: "f" type: "Flatten" bottom: "data" top: "f" }')
    model = load_from_text(text, input_shapes={"data": (2, 1, 2, 3)})
    assert any("DataRistretto layer(s) 'd' (XmBrain/Quantizer) read as Data and an in-place DataRistrettoTrim" in w
               for w in model.warnings)
    x = grid(rng(73), (2, 1, 2, 3), 64, 600)
    feeds = {"data": x, "label": np.zeros((2,), np.float32)}
    check_everywhere(model, feeds, {"f": trim_ref(x, 8, 5, False).reshape(2, 6)}, tmp_path)


def test_lrn_ristretto_is_lrn_then_its_top_in_fixed_point():
    x = grid(rng(74), (1, 5, 3, 2), 4)
    lrn = 'lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 }'
    plain = load_from_text(net(f'layer {{ name: "n" type: "LRN" bottom: "x" top: "y" {lrn} }}', inputs={"x": x.shape}))
    model = load_from_text(net(f'layer {{ name: "n" type: "LRNRistretto" bottom: "x" top: "y" {lrn} {xq(0, 0, 8, 5)} }}',
                               inputs={"x": x.shape}))
    ref = trim_ref(plain.run({"x": x}, exact=True)["y"], 8, 5)
    np.testing.assert_array_equal(model.run({"x": x}, exact=True)["y"], ref)


def test_the_message_is_picked_by_its_fields():
    def picked(type_, q):
        lp = parse_prototxt_text(f'layer {{ name: "l" type: "{type_}" {q} }}').layer[0]
        return lp.HasField("xmbrain_quantization_param"), lp.HasField("quantization_param")
    assert picked("ConvolutionRistretto", xq(8, 4)) == (True, False)
    # bw_params / fl_params alone: Ristretto's, except on a type only XmBrain has
    assert picked("ConvolutionRistretto", "quantization_param { bw_params: 8 fl_params: 4 }") == (False, True)
    assert picked("PoolingRistretto", "quantization_param { bw_params: 0 fl_params: 0 }") == (True, False)
    assert picked("ConvolutionRistretto", "quantization_param { bw_layer_in: 8 }") == (False, True)


def test_words_past_the_forks_power_table_are_refused():
    with pytest.raises(CaffeqError, match=r"bw_layer_data 31 and fl_layer_data 3 \(unsigned\) reach past the fork's "
                                          r"table of powers of two"):
        load_from_text(net('layer { name: "r" type: "ReLURistretto" bottom: "x" top: "y" ' + xq(0, 0, 31, 3, 0) + ' }',
                           inputs={"x": (1, 2)}))
