"""Quantizers (binary, int8, fp16), layer selection, the report, and agreement with independent numpy."""
import json
import math

import numpy as np
import pytest
from conftest import FIXTURES, Case, assert_close

import caffeq
from caffeq.io.caffemodel import read_caffemodel
from caffeq.model import load_from_text
from caffeq.quant import QuantizeError, default_kept_layers, get_quantizer, quantize
from caffeq.quant.binary import pack_signs, unpack_signs

# ---- exact values on tiny arrays --------------------------------------------------------------


def test_binary_alpha_per_channel_and_sign_of_zero():
    w = np.array([[1.0, -2.0, 0.0, 3.0],
                  [-1.0, -1.0, -1.0, -1.0],
                  [0.0, 0.0, 0.0, 0.0]], np.float32)
    qb = get_quantizer("binary").quantize(w, axis=0)
    assert qb.scheme == "binary" and qb.axis == 0
    np.testing.assert_array_equal(qb.scale, np.array([1.5, 1.0, 0.0], np.float32))
    np.testing.assert_array_equal(qb.codes, [[1, -1, 1, 1], [-1, -1, -1, -1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(qb.dequantize(), [[1.5, -1.5, 1.5, 1.5],
                                                    [-1, -1, -1, -1],
                                                    [0, 0, 0, 0]])
    assert qb.dequantize().dtype == np.float32


def test_binary_axis_1_is_transposed_inner_product():
    # K x N storage: output channel n is column n
    w = np.array([[2.0, -1.0],
                  [-4.0, 0.0],
                  [0.0, 5.0]], np.float32)
    qb = get_quantizer("binary").quantize(w, axis=1)
    np.testing.assert_array_equal(qb.scale, [2.0, 2.0])
    np.testing.assert_array_equal(qb.dequantize(), [[2, -2], [-2, 2], [2, 2]])


def test_binary_conv_axis_0_over_all_of_cin_kh_kw():
    w = np.arange(-8, 8, dtype=np.float32).reshape(2, 2, 2, 2)   # channel 0: -8..-1, channel 1: 0..7
    qb = get_quantizer("binary").quantize(w, axis=0)
    np.testing.assert_array_equal(qb.scale, [4.5, 3.5])
    expect = np.concatenate([-4.5 * np.ones(8), 3.5 * np.ones(8)]).reshape(2, 2, 2, 2)
    np.testing.assert_array_equal(qb.dequantize(), expect)


def test_binary_grouped_deconvolution_channels():
    # C_in = 4, C_out/group = 2, group = 2: output channel o = g*2 + j is rows [2g, 2g+1], column j
    w = np.array([[[[1.0]], [[10.0]]],
                  [[[-3.0]], [[-20.0]]],
                  [[[5.0]], [[0.0]]],
                  [[[-7.0]], [[-4.0]]]], np.float32)     # (4, 2, 1, 1)
    qb = get_quantizer("binary").quantize(w, axis=1, groups=2)
    # o0: rows 0,1 col 0 -> |1|,|-3| -> 2; o1: rows 0,1 col 1 -> 15; o2: rows 2,3 col 0 -> 6; o3: rows 2,3 col 1 -> 2
    np.testing.assert_array_equal(qb.scale, [2.0, 15.0, 6.0, 2.0])
    expect = np.array([[2, 15], [-2, -15], [6, 2], [-6, -2]], np.float32).reshape(4, 2, 1, 1)
    np.testing.assert_array_equal(qb.dequantize(), expect)
    # ungrouped axis 1 would mix the groups: a different answer
    assert not np.array_equal(get_quantizer("binary").quantize(w, axis=1).dequantize(), expect)


def test_int8_symmetric_per_channel():
    w = np.array([[127.0, -63.5, 0.4, 0.6],
                  [-2.54, 1.27, 0.0, 0.0],
                  [0.0, 0.0, 0.0, 0.0]], np.float32)
    qb = get_quantizer("int8").quantize(w, axis=0)
    np.testing.assert_allclose(qb.scale[:2], [1.0, 0.02], rtol=1e-7)
    np.testing.assert_array_equal(qb.codes[0], [127, -64, 0, 1])      # -63.5 rounds half to even
    np.testing.assert_array_equal(qb.codes[1], [-127, 64, 0, 0])
    np.testing.assert_array_equal(qb.codes[2], [0, 0, 0, 0])
    assert qb.codes.dtype == np.int8 and np.abs(qb.codes).max() <= 127
    np.testing.assert_array_equal(qb.dequantize()[2], 0)
    np.testing.assert_allclose(qb.dequantize()[0], [127, -64, 0, 1], rtol=0)


def test_fp16_clamps_and_counts():
    q = get_quantizer("fp16")
    qb = q.quantize(np.array([70000.0, -1e6, 1e-9, 1.0, 3e-6, 0.0], np.float32))
    assert qb.codes.dtype == np.float16
    np.testing.assert_array_equal(qb.dequantize()[:4], [65504.0, -65504.0, 0.0, 1.0])
    assert q.stats.clamped == 2
    assert q.stats.underflow == 1      # 1e-9 became 0; 0.0 stays 0 and is not counted
    assert q.stats.subnormal == 1      # 3e-6 is below fp16's smallest normal


def test_bit_packing_round_trip_and_order():
    codes = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, 1], np.int8)
    packed = pack_signs(codes)
    assert packed.dtype == np.uint8 and packed.size == 2
    assert packed[0] == 0b11111001 and packed[1] == 0b00000010   # element 8i+k is bit k of byte i
    np.testing.assert_array_equal(unpack_signs(packed, codes.shape), codes)


def test_unknown_target_is_a_clear_error():
    with pytest.raises(caffeq.CaffeqError, match="unknown quantization target 'int3'"):
        get_quantizer("int3")


# ---- each layer kind's axis, through a model ------------------------------------------------

LAYERS_NET = """name: "kinds"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 dim: 5 dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 group: 2 } }
layer { name: "up" type: "Deconvolution" bottom: "conv" top: "up"
        convolution_param { num_output: 4 kernel_size: 2 stride: 2 group: 2 } }
layer { name: "prelu" type: "PReLU" bottom: "up" top: "up" }
layer { name: "ipt" type: "InnerProduct" bottom: "up" top: "ipt"
        inner_product_param { num_output: 7 transpose: true } }
layer { name: "ip" type: "InnerProduct" bottom: "ipt" top: "ip" inner_product_param { num_output: 3 } }
"""


def _independent_binarize(node):
    """alpha * sign(W) per output channel, by plain loops over the layer's own layout."""
    w = np.asarray(node.blobs[0], np.float64)
    out = np.empty_like(w)
    if node.type == "Convolution":
        for o in range(w.shape[0]):
            a = np.abs(w[o]).mean()
            out[o] = np.where(w[o] >= 0, a, -a)
    elif node.type == "InnerProduct" and node.attrs["transpose"]:
        for o in range(w.shape[1]):
            a = np.abs(w[:, o]).mean()
            out[:, o] = np.where(w[:, o] >= 0, a, -a)
    elif node.type == "InnerProduct":
        for o in range(w.shape[0]):
            a = np.abs(w[o]).mean()
            out[o] = np.where(w[o] >= 0, a, -a)
    elif node.type == "Deconvolution":
        g = node.attrs["group"]
        cin, per = w.shape[0], w.shape[1]
        for o in range(node.attrs["num_output"]):
            gi, j = divmod(o, per)
            rows = slice(gi * cin // g, (gi + 1) * cin // g)
            a = np.abs(w[rows, j]).mean()
            out[rows, j] = np.where(w[rows, j] >= 0, a, -a)
    else:
        raise AssertionError(node.type)
    return out


def test_each_layer_kind_binarizes_along_its_output_channels():
    m = load_from_text(LAYERS_NET, random_weights=True, seed=3)
    q = quantize(m, "binary", keep="none")
    for name in ("conv", "up", "ipt", "ip"):
        orig, new = m.graph.node(name), q.graph.node(name)
        np.testing.assert_allclose(new.blobs[0], _independent_binarize(orig), rtol=1e-6, atol=0)
        assert new.quant[0].scheme == "binary"
        # biases stay fp32 and untouched
        if len(orig.blobs) > 1:
            np.testing.assert_array_equal(new.blobs[1], orig.blobs[1])
            assert 1 not in new.quant
    assert q.graph.node("up").quant[0].groups == 2
    assert q.graph.node("ipt").quant[0].axis == 1
    # PReLU slopes are not weights a quantizer touches
    np.testing.assert_array_equal(q.graph.node("prelu").blobs[0], m.graph.node("prelu").blobs[0])
    assert not getattr(q.graph.node("prelu"), "quant", None)


# ---- which layers -----------------------------------------------------------------------------

CHAIN = """name: "chain"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "pre" type: "Power" bottom: "data" top: "pre" power_param { scale: 0.5 } }
layer { name: "c1" type: "Convolution" bottom: "pre" top: "c1" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "c3" type: "Convolution" bottom: "c2" top: "c3" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "fc" type: "InnerProduct" bottom: "c3" top: "fc" inner_product_param { num_output: 5 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def _changed(q):
    return [n.name for n in q.graph.nodes if n.quant]


def test_default_keeps_first_and_last_weighted_layers():
    m = load_from_text(CHAIN, random_weights=True)
    assert default_kept_layers(m.graph) == {"c1": "first weighted layer", "fc": "last weighted layer"}
    q = quantize(m, "binary")
    assert _changed(q) == ["c2", "c3"]
    assert q.quant_report.changed == ["c2", "c3"]
    assert q.quant_report.kept == {"c1": "first weighted layer", "fc": "last weighted layer"}
    np.testing.assert_array_equal(q.graph.node("c1").blobs[0], m.graph.node("c1").blobs[0])


def test_keep_none_names_and_only():
    m = load_from_text(CHAIN, random_weights=True)
    assert _changed(quantize(m, "binary", keep="none")) == ["c1", "c2", "c3", "fc"]
    assert _changed(quantize(m, "binary", keep=[])) == ["c1", "c2", "c3", "fc"]
    assert _changed(quantize(m, "binary", keep=["c2", "fc"])) == ["c1", "c3"]
    assert _changed(quantize(m, "binary", keep="c2,fc")) == ["c1", "c3"]
    assert _changed(quantize(m, "binary", only=["fc"])) == ["fc"]
    # int8 quantizes every weighted layer by default
    assert _changed(quantize(m, "int8")) == ["c1", "c2", "c3", "fc"]


def test_parallel_first_layers_all_count_as_first():
    net = """name: "branches"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 6 dim: 6 } } }
layer { name: "a" type: "Convolution" bottom: "data" top: "a" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "b" type: "Convolution" bottom: "data" top: "b" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" top: "cat" }
layer { name: "mid" type: "Convolution" bottom: "cat" top: "mid" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "fc" type: "InnerProduct" bottom: "mid" top: "fc" inner_product_param { num_output: 3 } }
"""
    m = load_from_text(net, random_weights=True)
    assert set(default_kept_layers(m.graph)) == {"a", "b", "fc"}
    assert _changed(quantize(m, "binary")) == ["mid"]


def test_bad_layer_names_are_clear_errors():
    m = load_from_text(CHAIN, random_weights=True)
    with pytest.raises(QuantizeError, match="no layer named 'nope'"):
        quantize(m, "binary", keep=["nope"])
    with pytest.raises(QuantizeError, match=r"'r1' \(ReLU\) have no weights"):
        quantize(m, "binary", only=["r1"])
    with pytest.raises(QuantizeError, match="cannot be combined"):
        quantize(m, "binary", keep=["c1"], only=["c2"])
    q = quantize(m, "binary")
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize(q, "int8")


def test_original_model_untouched():
    m = load_from_text(CHAIN, random_weights=True)
    before = {k: [np.array(b) for b in v] for k, v in m.params.items()}
    for t in ("binary", "int8", "fp16"):
        quantize(m, t, keep="none")
    for k, v in m.params.items():
        for a, b in zip(v, before[k]):
            np.testing.assert_array_equal(a, b)
    assert not any(n.quant for n in m.graph.nodes)
    assert m.quantization == {}


def test_shared_parameters_follow_their_owner():
    net = """name: "shared"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 5 dim: 5 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1" param { name: "w" } param { name: "b" }
        convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2" param { name: "w" } param { name: "b" }
        convolution_param { num_output: 2 kernel_size: 1 } }
"""
    m = load_from_text(net, random_weights=True)
    q = quantize(m, "binary", keep="none")
    np.testing.assert_array_equal(q.graph.node("c2").blobs[0], q.graph.node("c1").blobs[0])
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 5)).astype(np.float32)
    w = q.graph.node("c1").blobs[0][:, :, 0, 0].astype(np.float64)
    b = q.graph.node("c1").blobs[1].astype(np.float64)
    y1 = np.einsum("oc,nchw->nohw", w, x) + b[None, :, None, None]
    y2 = np.einsum("oc,nchw->nohw", w, y1) + b[None, :, None, None]
    np.testing.assert_allclose(q.run(x)["c2"], y2, rtol=1e-5, atol=1e-6)


# ---- the report --------------------------------------------------------------------------------

def test_report_rows_totals_and_json():
    m = load_from_text(CHAIN, random_weights=True)
    q = quantize(m, "binary", keep="none")
    rep = q.quant_report
    rows = {r.name: r for r in rep.layers}
    c2 = rows["c2"]
    n_w, n_b = 4 * 4 * 3 * 3, 4
    assert c2.params == n_w + n_b and c2.precision == "binary" and c2.type == "Convolution"
    assert c2.bytes_before == 4 * (n_w + n_b)
    assert c2.bytes_after == math.ceil(n_w / 8) + 4 * 4 + 4 * n_b      # signs + alpha + fp32 bias
    w = m.graph.node("c2").blobs[0].astype(np.float64)
    wq = q.graph.node("c2").blobs[0].astype(np.float64)
    assert c2.rel_l2_error == pytest.approx(np.linalg.norm(wq - w) / np.linalg.norm(w), rel=1e-9)
    assert rep.bytes_before == sum(r.bytes_before for r in rep.layers)
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["target"] == "binary" and d["totals"]["bytes_after"] == rep.bytes_after
    assert {r["name"] for r in d["layers"]} == {"c1", "c2", "c3", "fc"}
    text = str(rep)
    assert "c2" in text and "binary" in text and "total" in text


def test_fp16_folds_batchnorm_first():
    case = Case(FIXTURES / "net_resnet_mini")
    m = case.load()
    q = quantize(m, "fp16")
    types = [n.type for n in q.graph.nodes]
    assert "BatchNorm" not in types and "Scale" not in types
    assert any("folded" in n for n in q.quant_report.notes)
    # the net text follows the graph, so reshaped models and writers see the folded layers
    assert [lp.name for lp in q.net.layer] == [n.name for n in q.graph.nodes]
    assert len(q.reshaped(1).graph.nodes) == len(q.graph.nodes)
    for n in q.graph.nodes:
        for i, b in enumerate(n.blobs or []):
            assert n.quant[i].scheme == "fp16"
            np.testing.assert_array_equal(b, b.astype(np.float16).astype(np.float32))


def test_fp16_lone_batchnorm_factor_divided_out():
    net = """name: "bn"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
layer { name: "bn" type: "BatchNorm" bottom: "data" top: "bn" }
"""
    m = load_from_text(net, random_weights=True)
    s = np.float32(999.98)
    mean = np.array([10.0, -20.0, 30.0], np.float32)
    var = np.array([40.0, 50.0, 70.0], np.float32)      # * 999.98 passes fp16's 65504
    m.graph.node("bn").blobs = [mean * s, var * s, np.array([s], np.float32)]
    q = quantize(m, "fp16")
    blobs = q.graph.node("bn").blobs
    assert blobs[2][0] == 1.0
    np.testing.assert_allclose(blobs[0], mean, rtol=1e-3)
    np.testing.assert_allclose(blobs[1], var, rtol=1e-3)
    assert q.quant_report.stats["clamped"] == 0
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(np.float32)
    ref = (x - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5)
    np.testing.assert_allclose(q.run(x)["bn"], ref, rtol=1e-3, atol=1e-3)


# ---- reference cases: torch with binary weights == independent numpy Caffe-like forward ---------

def _np_conv(x, w, b, stride, pad, dil, group):
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    ho = (h + 2 * pad[0] - (dil[0] * (kh - 1) + 1)) // stride[0] + 1
    wo = (wd + 2 * pad[1] - (dil[1] * (kw - 1) + 1)) // stride[1] + 1
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    out = np.zeros((n, o, ho, wo))
    og = o // group
    for g in range(group):
        xs = xp[:, g * cg:(g + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dil[0]:i * dil[0] + stride[0] * (ho - 1) + 1:stride[0],
                           j * dil[1]:j * dil[1] + stride[1] * (wo - 1) + 1:stride[1]]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, w[g * og:(g + 1) * og, :, i, j])
    if b is not None:
        out += b[None, :, None, None]
    return out


def _np_deconv(x, w, b, stride, pad, dil, group, num_output):
    n, cin, h, wd = x.shape
    _, per, kh, kw = w.shape
    hf = stride[0] * (h - 1) + dil[0] * (kh - 1) + 1
    wf = stride[1] * (wd - 1) + dil[1] * (kw - 1) + 1
    buf = np.zeros((n, num_output, hf, wf))
    cg = cin // group
    for g in range(group):
        xs = x[:, g * cg:(g + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                buf[:, g * per:(g + 1) * per, i * dil[0]:i * dil[0] + stride[0] * (h - 1) + 1:stride[0],
                    j * dil[1]:j * dil[1] + stride[1] * (wd - 1) + 1:stride[1]] += \
                    np.einsum("nchw,co->nohw", xs, w[g * cg:(g + 1) * cg, :, i, j])
    out = buf[:, :, pad[0]:hf - pad[0], pad[1]:wf - pad[1]]
    if b is not None:
        out = out + b[None, :, None, None]
    return out


def _np_maxpool(x, k, s):
    n, c, h, w = x.shape
    ho = -(-(h - k) // s) + 1
    wo = -(-(w - k) // s) + 1
    out = np.full((n, c, ho, wo), -np.inf)
    for i in range(ho):
        for j in range(wo):
            out[:, :, i, j] = x[:, :, i * s:min(i * s + k, h), j * s:min(j * s + k, w)].max(axis=(2, 3))
    return out


def _np_forward(lp_list, weights, inputs):
    """A Caffe-like forward for the layer types of the cases below, in float64."""
    blobs = {k: np.asarray(v, np.float64) for k, v in inputs.items()}
    for lp in lp_list:
        if lp.type == "Input":
            continue
        x = blobs[lp.bottom[0]]
        w = weights.get(lp.name)
        if lp.type in ("Convolution", "Deconvolution"):
            p = lp.convolution_param
            k = p.kernel_size[0]
            s = p.stride[0] if p.stride else 1
            pd = p.pad[0] if p.pad else 0
            d = p.dilation[0] if p.dilation else 1
            b = w[1] if p.bias_term else None
            if lp.type == "Convolution":
                y = _np_conv(x, w[0], b, (s, s), (pd, pd), (d, d), p.group)
            else:
                y = _np_deconv(x, w[0], b, (s, s), (pd, pd), (d, d), p.group, p.num_output)
            assert w[0].shape[-1] == k
        elif lp.type == "InnerProduct":
            p = lp.inner_product_param
            axis = p.axis % x.ndim
            flat = x.reshape(x.shape[:axis] + (-1,))
            y = flat @ (w[0] if p.transpose else w[0].T)
            if p.bias_term:
                y = y + w[1]
        elif lp.type == "Pooling":
            assert lp.pooling_param.pool == 0 and not lp.pooling_param.pad
            pp = lp.pooling_param   # kernel_size / stride are repeated (N-D pooling), one value here
            y = _np_maxpool(x, pp.kernel_size[0], pp.stride[0] if pp.stride else 1)
        elif lp.type == "ReLU":
            y = np.maximum(x, 0)
        elif lp.type == "Softmax":
            e = np.exp(x - x.max(axis=1, keepdims=True))
            y = e / e.sum(axis=1, keepdims=True)
        else:
            raise AssertionError(f"no numpy reference for {lp.type}")
        blobs[lp.top[0]] = y
    return blobs


def _binary_weights_numpy(lp_list, raw):
    """alpha * sign(W) for every Convolution/Deconvolution/InnerProduct weight, from the file."""
    out = {}
    for lp in lp_list:
        if not raw.get(lp.name):
            continue
        blobs = [np.asarray(b.array, np.float64) for b in raw[lp.name]]
        w = blobs[0]
        if lp.type == "InnerProduct":
            p = lp.inner_product_param
            w = w.reshape((-1, p.num_output) if p.transpose else (p.num_output, -1))
            if p.transpose:
                alpha = np.abs(w).mean(axis=0, keepdims=True)
            else:
                alpha = np.abs(w).mean(axis=1, keepdims=True)
            wb = np.where(w >= 0, 1.0, -1.0) * alpha
        elif lp.type == "Convolution":
            alpha = np.abs(w).reshape(w.shape[0], -1).mean(axis=1)
            wb = np.where(w >= 0, 1.0, -1.0) * alpha[:, None, None, None]
        elif lp.type == "Deconvolution":
            g = lp.convolution_param.group
            cin, per = w.shape[:2]
            wb = np.empty_like(w)
            for gi in range(g):
                rows = slice(gi * cin // g, (gi + 1) * cin // g)
                for j in range(per):
                    a = np.abs(w[rows, j]).mean()
                    wb[rows, j] = np.where(w[rows, j] >= 0, a, -a)
        else:
            out[lp.name] = blobs
            continue
        out[lp.name] = [wb.astype(np.float32).astype(np.float64)] + blobs[1:]
    return out


BINARY_CASES = ["conv_basic", "conv_group_dilation", "inner_product_4d", "inner_product_axis2_transpose",
                "deconv_basic", "deconv_group_nobias", "net_lenet"]


@pytest.mark.parametrize("name", BINARY_CASES)
def test_binary_torch_equals_numpy_caffe_forward(name):
    case = Case(FIXTURES / name)
    model = case.load()
    q = quantize(model, "binary", keep="none")
    assert q.quant_report.changed, "nothing binarized"
    ours = q.run(case.inputs)
    raw = read_caffemodel(case.weights).blobs
    lps = list(model.net.layer)
    ref = _np_forward(lps, _binary_weights_numpy(lps, raw), case.inputs)
    atol, rtol = case.tolerance
    for out in model.outputs:
        assert_close(ours[out], ref[out], atol, rtol, f"{name}:{out}")
    # and binarization did change the outputs (the test would be vacuous otherwise)
    fp32 = model.run(case.inputs)
    assert any(np.abs(fp32[o] - ours[o]).max() > 10 * (atol + rtol * np.abs(ref[o]).max())
               for o in model.outputs)


# ---- fp16 on the reference networks --------------------------------------------------------------

FP16_CASES = ["net_lenet", "net_resnet_mini", "net_mobilenet_block", "net_inception_block", "conv_basic",
              "deconv_group_nobias", "inner_product_axis2_transpose", "batchnorm_scale", "prelu_channel"]


@pytest.mark.parametrize("name", FP16_CASES)
def test_fp16_close_to_fp32_and_keeps_top1(name):
    case = Case(FIXTURES / name)
    model = case.load()
    q = quantize(model, "fp16")
    ref = model.run(case.inputs)
    ours = q.run(case.inputs)
    for out in model.outputs:
        a, b = ref[out].astype(np.float64), ours[out].astype(np.float64)
        assert np.linalg.norm(b - a) <= 1e-2 * np.linalg.norm(a), out
        if a.ndim >= 2 and a.shape[1] > 1:
            np.testing.assert_array_equal(np.argmax(b, axis=1), np.argmax(a, axis=1))


def test_fp16_keeps_digits_top1():
    from conftest import REPO
    d = REPO / "examples" / "digits"
    model = caffeq.load(d / "deploy.prototxt", d / "model.caffemodel")
    x = np.random.default_rng(0).uniform(-0.5, 0.5, (32, 1, 16, 16)).astype(np.float32)
    ref = model.run(x)["prob"]
    ours = quantize(model, "fp16").run(x)["prob"]
    assert np.linalg.norm(ours - ref) <= 1e-2 * np.linalg.norm(ref)
    np.testing.assert_array_equal(ours.argmax(1), ref.argmax(1))


def test_compute_dtype_fp16_only_on_cuda():
    import torch

    from caffeq.quant import compute_dtype
    assert compute_dtype("fp16", "cpu") is None
    assert compute_dtype("fp16", "cuda") is torch.float16
    assert compute_dtype("binary", "cuda") is None


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["net_lenet", "net_resnet_mini", "net_mobilenet_block"])
def test_fp16_computes_in_fp16_on_cuda(name):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from caffeq.quant import compute_dtype
    case = Case(FIXTURES / name)
    model = case.load()
    q = quantize(model, "fp16")
    dtype = compute_dtype("fp16", "cuda")
    gm = q.to_torch(device="cuda", dtype=dtype)
    assert all(p.dtype == torch.float16 for p in gm.parameters())
    ours = q.run(case.inputs, device="cuda", dtype=dtype)
    ref = model.run(case.inputs)
    for out in model.outputs:
        a, b = ref[out].astype(np.float64), ours[out].astype(np.float64)
        assert np.linalg.norm(b - a) <= 1e-2 * np.linalg.norm(a), out
        np.testing.assert_array_equal(np.argmax(b, axis=1), np.argmax(a, axis=1))
    # binary weights run on the GPU too, with the CPU's numbers
    qb = quantize(model, "binary", keep="none")
    g, c = qb.run(case.inputs, device="cuda"), qb.run(case.inputs)
    for out in model.outputs:
        assert_close(g[out], c[out], 1e-5, 1e-4, f"{name} binary on cuda")
