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


def load_with_caffemodel(tmp_path, text, blobs):
    """The net `text` loaded with a caffemodel holding `blobs` ({layer: [arrays]})."""
    proto, weights = tmp_path / "m.prototxt", tmp_path / "m.caffemodel"
    proto.write_text(text)
    write_caffemodel(parse_prototxt_text(text), {k: [BlobData(b) for b in v] for k, v in blobs.items()}, weights)
    return load(str(proto), str(weights))


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
    model = load_with_caffemodel(tmp_path, text, {"dw": [w_dw, m_dw], "ip": [w_ip, b_ip, m_ip]})
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
    wc, bc = dyadic(r, (4, 3, 3, 3)), dyadic(r, (4,))
    mwc, mbc = (r.random((4, 3, 3, 3)) < 0.6).astype(f32), (r.random(4) < 0.5).astype(f32)
    wi, bi = dyadic(r, (3, 24)), dyadic(r, (3,))
    mwi, mbi = (r.random((3, 24)) < 0.6).astype(f32), np.array([1, 0, 1], f32)
    model = load_with_caffemodel(tmp_path, text, {"c": [wc, bc, mwc, mbc], "ip": [wi, bi, mwi, mbi]})
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


def test_dynamic_network_surgerys_cconvolution_masks_the_bias_too(tmp_path):
    """alex-tolstov/sparseconv and liuwenran/modified-caffe (yiwenguo/Dynamic-Network-Surgery's layout,
    told by cconvolution_param's gamma / power / c_rate): four blobs [W, b, Wmask, bmask], each forward
    conv(x, W x Wmask) + b x bmask (compress_conv_layer.cu CCMaskApply), and the same for CInnerProduct."""
    r = np.random.default_rng(8)
    text = net('layer { name: "c" type: "CConvolution" bottom: "x" top: "c" convolution_param { num_output: 4 '
               'kernel_size: 3 stride: 2 } cconvolution_param { gamma: 0.0001 power: 1 c_rate: 4 iter_stop: 10000 '
               'weight_mask_filler { type: "constant" value: 1 } bias_mask_filler { type: "constant" value: 1 } } }\n'
               'layer { name: "ip" type: "CInnerProduct" bottom: "c" top: "y" inner_product_param { num_output: 3 } '
               'cinner_product_param { gamma: 0.0001 power: 1 c_rate: 0.3 } }', inputs={"x": (2, 3, 7, 6)})
    wc, bc = dyadic(r, (4, 3, 3, 3)), dyadic(r, (4,))
    mwc, mbc = (r.random((4, 3, 3, 3)) < 0.6).astype(f32), np.array([1, 0, 0, 1], f32)
    wi, bi = dyadic(r, (3, 24)), dyadic(r, (3,))
    mwi, mbi = (r.random((3, 24)) < 0.6).astype(f32), np.array([0, 1, 1], f32)
    model = load_with_caffemodel(tmp_path, text, {"c": [wc, bc, mwc, mbc], "ip": [wi, bi, mwi, mbi]})
    x = r.standard_normal((2, 3, 7, 6)).astype(f32)
    c = conv_ref(x, wc * mwc, bc * mbc, (2, 2), (0, 0), 1)
    ref = (c.reshape(2, -1) @ (wi * mwi).astype(np.float64).T + bi * mbi).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)
    # without the DNS schedule the layer stays NHZlX/Auto_pruning's (three blobs, the bias unmasked)
    _, plain = masked_net("CConvolution", "convolution_param { num_output: 2 kernel_size: 1 }", (1, 2, 3, 3))
    assert len(plain.graph.node("q").blobs) == 3


def prune_ratio_ref(values, ratio):
    """caffe_cpu_prune_ratio (Tyler-D/caffe-rc5_ex math_functions.cpp): pairs (|x|, i) partially sorted with
    std::less, the first floor(ratio * n) (float arithmetic) set to 0."""
    flat = values.reshape(-1).copy()
    k = int(np.floor(np.float32(ratio) * np.float32(flat.size)))
    order = sorted(range(flat.size), key=lambda i: (abs(float(flat[i])), i))
    flat[order[:k]] = 0
    return flat.reshape(values.shape)


def test_dense_sparse_dense_prunes_the_smallest_weights_and_biases(tmp_path):
    r = np.random.default_rng(10)
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 7 '
               'prune_type: RATIO prune_ratio: 0.3 } }', inputs={"x": (3, 2, 3, 2)})
    model = load_from_text(text, random_weights=True)
    node = model.graph.node("ip")
    w = dyadic(r, (7, 12), 8)                 # many ties in |w|: the lower index goes first
    b = np.array([0.5, -0.25, 0.25, 1, -1, 0.125, 2], f32)
    node.blobs = [w, b]
    model.clear_cache()
    pw, pb = prune_ratio_ref(w, 0.3), prune_ratio_ref(b, 0.3)
    assert (pw == 0).sum() >= 25 and (pb == 0).sum() >= 2      # floor(0.3 * 84) = 25, floor(0.3 * 7) = 2
    x = r.standard_normal((3, 2, 3, 2)).astype(f32)
    ref = (x.reshape(3, -1).astype(np.float64) @ pw.T.astype(np.float64) + pb).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)
    # THRESHOLD prunes |x| < weight_threshold, but only with a prune_ratio above 0 (LayerSetUp's fall-through)
    thres = load_from_text(text.replace("prune_type: RATIO prune_ratio: 0.3",
                                        "prune_type: THRESHOLD weight_threshold: 0.5 prune_ratio: 0.1"),
                           random_weights=True)
    thres.graph.node("ip").blobs = [w, b]
    thres.clear_cache()
    tw, tb = np.where(np.abs(w) < 0.5, 0, w), np.where(np.abs(b) < 0.5, 0, b)
    np.testing.assert_allclose(thres.run({"x": x})["y"], (x.reshape(3, -1) @ tw.T + tb).astype(f32), atol=2e-5)
    unpruned = load_from_text(text.replace("prune_type: RATIO prune_ratio: 0.3",
                                           "prune_type: THRESHOLD weight_threshold: 0.5"), random_weights=True)
    unpruned.graph.node("ip").blobs = [w, b]
    unpruned.clear_cache()
    np.testing.assert_allclose(unpruned.run({"x": x})["y"], (x.reshape(3, -1) @ w.T + b).astype(f32), atol=2e-5)
    with pytest.raises(CaffeqError, match=r"prune_ratio must be in \[0, 1\), got 1"):
        load_from_text(text.replace("prune_ratio: 0.3", "prune_ratio: 1"))


def test_prune_ratio_selection_matches_a_full_sort_on_large_blobs():
    import torch

    from caffeq.layers.pruning import zero_smallest_magnitudes
    r = np.random.default_rng(11)
    for shape, ratio in (((64, 1024), 0.3), ((10, 64), 0.3), ((5,), 0.5), ((33, 17), 0.97)):
        x = dyadic(r, shape, 4)               # |x| in a few values: long runs of ties
        got = zero_smallest_magnitudes(torch.from_numpy(x), ratio).numpy()
        np.testing.assert_array_equal(got, prune_ratio_ref(x, ratio))


def pq_ref(values, classes, config, classnum):
    """assignValue of liuwenran's compress_conv_layer.cu: class c < classnum -> config[1 + (int)c]."""
    out = values.copy().reshape(-1)
    for i, c in enumerate(classes.reshape(-1)):
        if c < classnum:
            out[i] = config[1 + int(c)]
    return out.reshape(values.shape)


@pytest.mark.parametrize("quantized", [True, False])
def test_pq_layers_replace_quantized_values_by_their_class_centre(quantized, tmp_path):
    r = np.random.default_rng(12)
    text = net('layer { name: "c" type: "PQConvolution" bottom: "x" top: "c" convolution_param { num_output: 4 '
               'kernel_size: 3 pad: 1 } pqconvolution_param { gamma: 0.0001 power: 1 c_rate: 4 iter_stop: 0 '
               'classnum: 16 zeroth: 0.1 qstage: 1 } }\n'
               'layer { name: "ip" type: "PQInnerProduct" bottom: "c" top: "y" inner_product_param { num_output: 3 } '
               'pqinner_product_param { gamma: 0.0001 } }', inputs={"x": (2, 3, 5, 4)})
    wc, bc = dyadic(r, (4, 3, 3, 3)), dyadic(r, (4,))
    wi, bi = dyadic(r, (3, 80)), dyadic(r, (3,))
    cls_wc = r.choice([0, 3, 5.7, 15, 16], size=wc.shape).astype(f32)     # 16: not quantized
    cls_bc = np.array([16, 2, 16, 15.5], f32)
    cls_wi = r.choice([1, 7.9, 8, 9], size=wi.shape).astype(f32)          # classnum 8 (the default) here
    cls_bi = np.array([0, 8, 4], f32)
    config_c, config_i = np.zeros(2048, f32), np.zeros(2048, f32)
    if quantized:
        config_c[0], config_c[1:17] = 1, dyadic(r, (16,))
        config_i[0], config_i[1:9] = 1, dyadic(r, (8,))
    model = load_with_caffemodel(tmp_path, text, {"c": [wc, bc, cls_wc, cls_bc, config_c],
                                                  "ip": [wi, bi, cls_wi, cls_bi, config_i]})
    if quantized:
        wc, bc = pq_ref(wc, cls_wc, config_c, 16), pq_ref(bc, cls_bc, config_c, 16)
        wi, bi = pq_ref(wi, cls_wi, config_i, 8), pq_ref(bi, cls_bi, config_i, 8)
    x = r.standard_normal((2, 3, 5, 4)).astype(f32)
    c = conv_ref(x, wc, bc, (1, 1), (1, 1), 1)
    ref = (c.reshape(2, -1) @ wi.astype(np.float64).T + bi).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_pq_layers_without_a_bias_and_random_weights():
    with pytest.raises(CaffeqError, match="PQInnerProduct without a bias term"):
        masked_net("PQInnerProduct", "inner_product_param { num_output: 2 bias_term: false }", (1, 4))
    _, model = masked_net("PQConvolution", "convolution_param { num_output: 2 kernel_size: 1 } "
                          "pqconvolution_param { classnum: 4 }", (1, 2, 3, 3))
    blobs = model.graph.node("q").blobs
    assert [b.shape for b in blobs] == [(2, 2, 1, 1), (2,), (2, 2, 1, 1), (2,), (2048,)]
    assert (blobs[2] == 4).all() and (blobs[4] == 0).all()     # the fork's setup: nothing quantized yet


def test_static_dropout_inner_product_is_read_and_sized_not_run(tmp_path):
    from caffeq.errors import ExportError
    _, model = masked_net("StaticDropoutInnerProduct", 'static_dropout_inner_product_param { num_output: 5 '
                          'dropout_file: "/home/chao/mask/fc6.txt" weight_filler { type: "gaussian" std: 0.005 } }',
                          (2, 3, 4, 4))
    assert model.blob_shapes["y"] == (2, 5)
    assert [b.shape for b in model.graph.node("q").blobs] == [(5, 48), (5,)]
    with pytest.raises(CaffeqError, match=r"diverse-dropout's InnerProduct with a connection mask read from a file "
                                          r"\(/home/chao/mask/fc6.txt\)"):
        model.run({"x": np.zeros((2, 3, 4, 4), f32)})
    with pytest.raises(ExportError, match="does not run it"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()
