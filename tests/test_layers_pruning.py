"""NHZlX/Auto_pruning's masked layers (CConvolution, CConvolutionDepthwise, CInnerProduct): the fork convolves
with weight x mask, the mask a third (or second) blob; references are Caffe's convolution / inner product
on the masked weights, in torch, onnxruntime and model.py, and through a caffemodel holding the mask."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net

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
