"""NHZlX/Auto_pruning's masked layers (CConvolution, CConvolutionDepthwise, CInnerProduct): the fork convolves
with weight x mask, the mask a third (or second) blob; 32l/Neural-Network-Model-Compressing's DNSConvolution /
DNSInnerProduct (weight and bias masks, both applied) and INQConvolution / INQInnerProduct (the same blobs,
the TEST forward plain).  References are Caffe's convolution / inner product on the masked weights, in
torch, onnxruntime and model.py, and through a caffemodel holding the masks."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net

from caffeq.errors import CaffeqError
from caffeq.io.caffemodel import BlobData
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.writer import write_caffemodel
from caffeq.model import load, load_from_text

f32 = np.float32


def dyadic(r, shape, scale=16):
    """Small multiples of 1/scale: their sums are exact in float32 whatever the order."""
    return (r.integers(-24, 25, size=shape) / scale).astype(f32)


def masked_net(type_name, params, shape):
    text = net(f'layer {{ name: "q" type: "{type_name}" bottom: "x" top: "y" {params} }}', inputs={"x": shape})
    return text, load_from_text(text, random_weights=True)


@pytest.mark.parametrize("bias", [True, False])
def test_cconvolution_convolves_with_the_masked_weights(bias, tmp_path):
    shape = (2, 4, 7, 6)
    text, model = masked_net("CConvolution", "convolution_param { num_output: 6 kernel_size: 3 stride: 2 pad: 1 "
                                             f"group: 2 {'' if bias else 'bias_term: false'} }} "
                                             "cconvolution_param { upper_bound: 0.85 iter_stop: 30000 }", shape)
    node = model.graph.node("q")
    assert [b.shape for b in node.blobs] == [(6, 2, 3, 3)] + ([(6,)] if bias else []) + [(6, 2, 3, 3)]
    assert np.all(node.blobs[-1] == 1)          # random weights: the unpruned net
    r = np.random.default_rng(2)
    w, mask = dyadic(r, (6, 2, 3, 3)), (r.random((6, 2, 3, 3)) < 0.6).astype(f32)
    b = dyadic(r, (6,)) if bias else None
    node.blobs = [w] + ([b] if bias else []) + [mask]
    model.clear_cache()
    x = r.standard_normal(shape).astype(f32)
    ref = conv_ref(x, w * mask, b, (2, 2), (1, 1), 2).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_cinner_product_and_depthwise_read_their_mask_from_the_caffemodel(tmp_path):
    r = np.random.default_rng(4)
    text = net('layer { name: "dw" type: "CConvolutionDepthwise" bottom: "x" top: "d" convolution_param { '
               'num_output: 3 kernel_size: 3 group: 3 bias_term: false } }\n'
               'layer { name: "ip" type: "CInnerProduct" bottom: "d" top: "y" inner_product_param { num_output: 4 } '
               'cinner_product_param { upper_bound: 0.9 } }', inputs={"x": (2, 3, 5, 5)})
    w_dw, m_dw = dyadic(r, (3, 1, 3, 3)), (r.random((3, 1, 3, 3)) < 0.5).astype(f32)
    w_ip, b_ip, m_ip = dyadic(r, (4, 27)), dyadic(r, (4,)), (r.random((4, 27)) < 0.5).astype(f32)
    proto = tmp_path / "m.prototxt"
    proto.write_text(text)
    weights = tmp_path / "m.caffemodel"
    write_caffemodel(parse_prototxt_text(text), {"dw": [BlobData(w_dw), BlobData(m_dw)],
                                                 "ip": [BlobData(b) for b in (w_ip, b_ip, m_ip)]}, weights)
    model = load(str(proto), str(weights))
    x = r.standard_normal((2, 3, 5, 5)).astype(f32)
    d = conv_ref(x, w_dw * m_dw, None, (1, 1), (0, 0), 3)
    ref = (d.reshape(2, -1) @ (w_ip * m_ip).astype(np.float64).T + b_ip).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


@pytest.mark.parametrize("kind", ["DNS", "INQ"])
def test_dns_masks_weights_and_bias_and_inq_tests_plainly(kind, tmp_path):
    """dns_conv_layer.cu / dns_inner_product_layer.cpp: W x Wmask and b x bmask in every forward;
    inq_conv_layer.cpp at TEST: blobs 0 and 1 as they are.  Blobs [W, b, Wmask, bmask] from a caffemodel."""
    r = np.random.default_rng(6)
    text = net(f'layer {{ name: "c" type: "{kind}Convolution" bottom: "x" top: "c" convolution_param {{ '
               f'num_output: 4 kernel_size: 3 stride: 2 }} {kind.lower()}_convolution_param {{ '
               + ("gamma: 0.0000125 power: 1 c_rate: -0.7 iter_stop: 1000000" if kind == "DNS" else
                  "portion: 0.2 portion: 0.4 num_quantum_values: 7")
               + f' }} }}\nlayer {{ name: "ip" type: "{kind}InnerProduct" bottom: "c" top: "y" '
               'inner_product_param { num_output: 3 } }', inputs={"x": (2, 3, 7, 6)})
    proto = tmp_path / "m.prototxt"
    proto.write_text(text)
    wc, bc = dyadic(r, (4, 3, 3, 3)), dyadic(r, (4,))
    mwc, mbc = (r.random((4, 3, 3, 3)) < 0.6).astype(f32), (r.random(4) < 0.5).astype(f32)
    wi, bi = dyadic(r, (3, 24)), dyadic(r, (3,))
    mwi, mbi = (r.random((3, 24)) < 0.6).astype(f32), np.array([1, 0, 1], f32)
    weights = tmp_path / "m.caffemodel"
    write_caffemodel(parse_prototxt_text(text), {"c": [BlobData(b) for b in (wc, bc, mwc, mbc)],
                                                 "ip": [BlobData(b) for b in (wi, bi, mwi, mbi)]}, weights)
    model = load(str(proto), str(weights))
    assert model.graph.node("c").spec.blob_names_for(model.graph.node("c").attrs) == \
        ("weight", "bias", "weight_mask", "bias_mask")
    x = r.standard_normal((2, 3, 7, 6)).astype(f32)
    if kind == "INQ":
        mwc, mbc, mwi, mbi = (np.ones_like(m) for m in (mwc, mbc, mwi, mbi))
    c = conv_ref(x, wc * mwc, bc * mbc, (2, 2), (0, 0), 1)
    ref = (c.reshape(2, -1) @ (wi * mwi).astype(np.float64).T + bi * mbi).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_dns_without_a_bias_term_reads_and_refuses_to_run():
    _, model = masked_net("DNSConvolution", "convolution_param { num_output: 2 kernel_size: 1 bias_term: false }",
                          (1, 2, 3, 3))
    assert [b.shape for b in model.graph.node("q").blobs] == [(2, 2, 1, 1), (2, 2, 1, 1)]
    with pytest.raises(CaffeqError, match="layer 'q' .DNSConvolution. without a bias term cannot run"):
        model.run({"x": np.zeros((1, 2, 3, 3), f32)})
