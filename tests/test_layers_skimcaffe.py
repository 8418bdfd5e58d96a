"""IntelLabs/SkimCaffe's fused layers (src/caffe/layers/conv_relu_layer.cpp, conv_relu_pool_layer.cpp,
conv_relu_pool_lrn_layer.cpp, relu_pooling_layer.cpp, inner_product_relu_dropout_layer.cpp at 2f66b5a9),
each checked against the same net written with BVLC's separate layers (the same weights), and the
fork's fields (conv_mode, gemm_mode, spmdm_transpose_in / _out, connectivity_mode, the ParamSpec
group-lasso fields)."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

import caffeq
from caffeq.errors import CaffeqError
from caffeq.io.caffemodel import BlobData
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.writer import write_caffemodel
from caffeq.layers import LayerError
from caffeq.model import load_from_text

CONV = 'num_output: {n} kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_w: 1 {extra}'


def conv(name, typ, bottom, top, n=5, extra="", layer_extra=""):
    return (f'layer {{ name: "{name}" type: "{typ}" bottom: "{bottom}" top: "{top}" {layer_extra} '
            f'convolution_param {{ {CONV.format(n=n, extra=extra)} }} }}')


def relu(bottom, slope=0):
    return (f'layer {{ name: "r_{bottom}" type: "ReLU" bottom: "{bottom}" top: "{bottom}" '
            f'relu_param {{ negative_slope: {slope} }} }}')


def pool(bottom, top, params):
    return f'layer {{ name: "p_{bottom}" type: "Pooling" bottom: "{bottom}" top: "{top}" pooling_param {{ {params} }} }}'


LRN_PARAMS = "local_size: 3 alpha: 0.2 beta: 0.75 k: 1.5"


def lrn(bottom, top):
    return f'layer {{ name: "n_{bottom}" type: "LRN" bottom: "{bottom}" top: "{top}" lrn_param {{ {LRN_PARAMS} }} }}'


def same_weights(fused, plain, pairs):
    for f, p in pairs:
        node_of(plain, p).blobs = node_of(fused, f).blobs


def test_convolution_relu(tmp_path):
    x = rng(1).standard_normal((2, 3, 9, 7)).astype(np.float32)
    fused = load_from_text(net(conv("c", "ConvolutionReLU", "x", "y", extra="conv_mode: DIRECT_SCONV"),
                               inputs={"x": x.shape}), random_weights=True)
    plain = load_from_text(net(conv("c", "Convolution", "x", "y"), relu("y"), inputs={"x": x.shape}))
    same_weights(fused, plain, [("c", "c")])
    ref = plain.run({"x": x})["y"]
    assert (ref == 0).any() and (ref > 0).any()
    check_everywhere(fused, {"x": x}, {"y": ref}, tmp_path, 1e-5, 1e-5)


def test_convolution_relu_takes_one_top_per_bottom(tmp_path):
    x = rng(2).standard_normal((1, 3, 8, 5)).astype(np.float32)
    x2 = rng(3).standard_normal((1, 3, 8, 5)).astype(np.float32)
    text = ('layer { name: "c" type: "ConvolutionReLU" bottom: "x" bottom: "x2" top: "y" top: "y2" '
            f'convolution_param {{ {CONV.format(n=4, extra="")} }} }}')
    fused = load_from_text(net(text, inputs={"x": x.shape, "x2": x2.shape}), random_weights=True)
    plain = load_from_text(net(conv("c", "Convolution", "x", "y", n=4), relu("y"), inputs={"x": x.shape}))
    same_weights(fused, plain, [("c", "c")])
    refs = {"y": plain.run({"x": x})["y"], "y2": plain.run({"x": x2})["y"]}
    check_everywhere(fused, {"x": x, "x2": x2}, refs, tmp_path, 1e-5, 1e-5)


POOLS = ["kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1", "kernel_size: 3 stride: 2", "global_pooling: true"]


@pytest.mark.parametrize("params", POOLS)
def test_convolution_relu_pool(params, tmp_path):
    x = rng(4).standard_normal((2, 3, 12, 6)).astype(np.float32)
    fused_text = (f'layer {{ name: "c" type: "ConvolutionReLUPool" bottom: "x" top: "y" convolution_param {{ '
                  f'{CONV.format(n=5, extra="conv_mode: DIRECT_SCONV")} }} pooling_param {{ pool: MAX {params} }} }}')
    fused = load_from_text(net(fused_text, inputs={"x": x.shape}), random_weights=True)
    plain = load_from_text(net(conv("c", "Convolution", "x", "c"), relu("c"), pool("c", "y", params),
                               inputs={"x": x.shape}))
    same_weights(fused, plain, [("c", "c")])
    ref = plain.run({"x": x})["y"]
    assert fused.blob_shapes["y"] == ref.shape
    check_everywhere(fused, {"x": x}, {"y": ref}, tmp_path, 1e-5, 1e-5)


def fork_padded_pool(y, k, s, p):
    """conv_relu_pool_layer.cpp's loop: hstart = max(ph * stride - pad, 0), hend = min(hstart + kernel, H),
    the maximum started at 0; BVLC's pooled size."""
    n, c, h, w = y.shape
    outs = []
    for size, kk, ss, pp in zip((h, w), k, s, p):
        o = -(-(size + 2 * pp - kk) // ss) + 1
        outs.append(o - 1 if (o - 1) * ss >= size + pp else o)
    out = np.zeros((n, c, outs[0], outs[1]), np.float32)
    for i in range(outs[0]):
        h0 = max(i * s[0] - p[0], 0)
        for j in range(outs[1]):
            w0 = max(j * s[1] - p[1], 0)
            out[:, :, i, j] = np.maximum(y[:, :, h0:min(h0 + k[0], h), w0:min(w0 + k[1], w)].max(axis=(2, 3)), 0)
    return out


@pytest.mark.parametrize("lrn_too", [False, True])
def test_a_pool_pad_takes_the_forks_windows(lrn_too, tmp_path):
    x = rng(22).standard_normal((2, 3, 12, 9)).astype(np.float32)
    params = "kernel_h: 3 kernel_w: 4 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 2"
    typ = "ConvolutionReLUPoolLRN" if lrn_too else "ConvolutionReLUPool"
    extra = f"lrn_param {{ {LRN_PARAMS} }}" if lrn_too else ""
    fused = load_from_text(net(f'layer {{ name: "c" type: "{typ}" bottom: "x" top: "y" convolution_param {{ '
                               f'{CONV.format(n=8, extra="")} }} pooling_param {{ pool: MAX {params} }} {extra} }}',
                               inputs={"x": x.shape}), random_weights=True)
    plain = load_from_text(net(conv("c", "Convolution", "x", "c", n=8), inputs={"x": x.shape}))
    same_weights(fused, plain, [("c", "c")])
    ref = fork_padded_pool(plain.run({"x": x})["c"], (3, 4), (2, 3), (1, 2))
    bvlc = load_from_text(net(conv("c", "Convolution", "x", "c", n=8), relu("c"), pool("c", "y", params),
                              inputs={"x": x.shape}))
    same_weights(fused, bvlc, [("c", "c")])
    assert not np.allclose(ref, bvlc.run({"x": x})["y"])   # the windows differ from BVLC's
    if lrn_too:
        lrn_net = load_from_text(net(lrn("p", "y"), inputs={"p": ref.shape}))
        ref = lrn_net.run({"p": ref})["y"]
    assert fused.blob_shapes["y"] == ref.shape
    check_everywhere(fused, {"x": x}, {"y": ref}, tmp_path, 1e-5, 1e-5)


def conv_pool_lrn(shape, n=8, params="kernel_size: 3 stride: 2", mode=""):
    return net(f'layer {{ name: "c" type: "ConvolutionReLUPoolLRN" bottom: "x" top: "y" convolution_param {{ '
               f'{CONV.format(n=n, extra=mode)} }} pooling_param {{ pool: MAX {params} }} '
               f'lrn_param {{ {LRN_PARAMS} }} }}', inputs={"x": shape})


@pytest.mark.parametrize("params", POOLS[:2])
def test_convolution_relu_pool_lrn(params, tmp_path):
    x = rng(5).standard_normal((2, 3, 13, 7)).astype(np.float32)   # C x pooled H x pooled W: multiples of 8
    fused = load_from_text(conv_pool_lrn(x.shape, params=params), random_weights=True)
    plain = load_from_text(net(conv("c", "Convolution", "x", "c", n=8), relu("c"), pool("c", "p", params),
                               lrn("p", "y"), inputs={"x": x.shape}))
    same_weights(fused, plain, [("c", "c")])
    ref = plain.run({"x": x})["y"]
    assert fused.blob_shapes["y"] == ref.shape
    check_everywhere(fused, {"x": x}, {"y": ref}, tmp_path, 1e-5, 1e-5)


def test_the_alexnet_conv2_sparse_kernel_runs(tmp_path):
    x = rng(6).standard_normal((1, 4, 27, 27)).astype(np.float32)
    text = net('layer { name: "c" type: "ConvolutionReLUPoolLRN" bottom: "x" top: "y" convolution_param { '
               'num_output: 8 kernel_size: 5 pad: 2 group: 2 conv_mode: DIRECT_SCONV } '
               f'pooling_param {{ pool: MAX kernel_size: 3 stride: 2 }} lrn_param {{ {LRN_PARAMS} }} }}',
               inputs={"x": x.shape})
    fused = load_from_text(text, random_weights=True)
    plain = load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { '
                               'num_output: 8 kernel_size: 5 pad: 2 group: 2 } }', relu("c"),
                               pool("c", "p", "kernel_size: 3 stride: 2"), lrn("p", "y"), inputs={"x": x.shape}))
    same_weights(fused, plain, [("c", "c")])
    check_everywhere(fused, {"x": x}, {"y": plain.run({"x": x})["y"]}, tmp_path, 1e-5, 1e-5)


@pytest.mark.parametrize("n, mode, message", [
    (5, "", "leaves the last 4 of its 60 unwritten"),
    (8, "conv_mode: DIRECT_SCONV", "pools only inside its AlexNet conv2 kernel"),
])
def test_conv_pool_lrn_nets_the_fork_leaves_unwritten_are_read_not_run(n, mode, message, tmp_path):
    x = rng(7).standard_normal((1, 3, 13, 7)).astype(np.float32)
    model = load_from_text(conv_pool_lrn(x.shape, n=n, mode=mode), random_weights=True)
    assert model.blob_shapes["y"] == (1, n, 3, 4)
    with pytest.raises(CaffeqError, match=message):
        model.run({"x": x})
    with pytest.raises(CaffeqError, match=message):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_relu_pooling(tmp_path):
    params = "pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 0"
    x = rng(8).standard_normal((2, 3, 9, 11)).astype(np.float32)
    fused = load_from_text(net(f'layer {{ name: "p" type: "ReLUPooling" bottom: "x" top: "y" '
                               f'pooling_param {{ {params} }} }}', inputs={"x": x.shape}))
    plain = load_from_text(net(relu("x"), pool("x", "y", params), inputs={"x": x.shape}))
    ref = plain.run({"x": x})["y"]
    check_everywhere(fused, {"x": x}, {"y": ref}, tmp_path, 0, 0)


@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_inner_product_relu_dropout(slope, tmp_path):
    x = rng(9).standard_normal((3, 4, 2, 5)).astype(np.float32)
    ip = 'inner_product_param { num_output: 6 gemm_mode: SPMDM }'
    fused = load_from_text(net(f'layer {{ name: "f" type: "InnerProductReLUDropout" bottom: "x" top: "y" {ip} '
                               f'relu_param {{ negative_slope: {slope} }} dropout_param {{ dropout_ratio: 0.5 }} }}',
                               inputs={"x": x.shape}), random_weights=True)
    plain = load_from_text(net('layer { name: "f" type: "InnerProduct" bottom: "x" top: "y" '
                               'inner_product_param { num_output: 6 } }', relu("y", slope),
                               'layer { name: "d" type: "Dropout" bottom: "y" top: "y" }', inputs={"x": x.shape}))
    same_weights(fused, plain, [("f", "f")])
    node_of(fused, "f").blobs[1] = rng(10).standard_normal(6).astype(np.float32)
    ref = plain.run({"x": x})["y"]
    assert (ref < 0).any() == bool(slope)
    check_everywhere(fused, {"x": x}, {"y": ref}, tmp_path, 1e-5, 1e-5)


def spmdm_chain(shape, fc7=True):
    layers = ['layer { name: "fc6" type: "InnerProductReLUDropout" bottom: "x" top: "fc6" inner_product_param { '
              'num_output: 6 gemm_mode: SPMDM spmdm_transpose_out: false } }',
              'layer { name: "fc7" type: "InnerProduct" bottom: "fc6" top: "fc7" inner_product_param { '
              'num_output: 4 gemm_mode: SPMDM spmdm_transpose_in: false } }']
    return net(*layers[:1 + fc7], inputs={"x": shape})


def test_spmdm_transposed_memory_between_two_inner_products(tmp_path):
    x = rng(11).standard_normal((3, 2, 5)).astype(np.float32)
    model = load_from_text(spmdm_chain(x.shape), random_weights=True)
    w6, b6 = node_of(model, "fc6").blobs
    b6[:] = rng(12).standard_normal(6)
    w7, b7 = node_of(model, "fc7").blobs
    b7[:] = rng(13).standard_normal(4)
    # the fork: fc6 writes x W6^T's memory as 6 x 3, adds b6 over it read as 3 x 6, then the ReLU;
    # fc7 reads that memory as 6 x 3
    mem6 = np.maximum((x.reshape(3, -1) @ w6.T).T.reshape(3, 6) + b6, 0)
    fc7 = mem6.reshape(6, 3).T @ w7.T + b7
    check_everywhere(model, {"x": x}, {"fc7": fc7}, tmp_path, 1e-5, 1e-5)
    alone = load_from_text(spmdm_chain(x.shape, fc7=False))
    node_of(alone, "fc6").blobs = [w6, b6]
    check_everywhere(alone, {"x": x}, {"fc6": mem6}, tmp_path, 1e-5, 1e-5)


def test_spmdm_chain_without_a_bias_gives_the_plain_product(tmp_path):
    x = rng(14).standard_normal((3, 10)).astype(np.float32)
    model = load_from_text(spmdm_chain(x.shape), random_weights=True)
    w6, b6 = node_of(model, "fc6").blobs
    b6[:] = 0
    w7, b7 = node_of(model, "fc7").blobs
    ref = np.maximum(x @ w6.T, 0) @ w7.T + b7
    check_everywhere(model, {"x": x}, {"fc7": ref}, tmp_path, 1e-5, 1e-5)


def test_spmdm_transposes_with_an_axis_after_the_batch(tmp_path):
    x = rng(15).standard_normal((2, 3, 4, 5)).astype(np.float32)
    text = net('layer { name: "f" type: "InnerProductReLUDropout" bottom: "x" top: "y" inner_product_param { '
               'num_output: 6 axis: 2 gemm_mode: SPMDM spmdm_transpose_in: false spmdm_transpose_out: false } '
               'relu_param { negative_slope: 0.5 } }', inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    w, b = node_of(model, "f").blobs
    b[:] = rng(16).standard_normal(6)
    rows = x.reshape(20, 6).T   # the bottom's memory read as K x M (K = 20, M = 6), then M x K
    mem = (rows @ w.T).T.reshape(6, 6) + b
    ref = np.where(mem > 0, mem, mem * 0.5).reshape(2, 3, 6)
    assert model.blob_shapes["y"] == (2, 3, 6)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, 1e-5, 1e-5)


def test_weights_load_from_a_caffemodel_as_the_plain_layers_blobs(tmp_path):
    text = net(f'layer {{ name: "c" type: "ConvolutionReLUPool" bottom: "x" top: "c" convolution_param {{ '
               f'{CONV.format(n=4, extra="conv_mode: DIRECT_SCONV")} }} pooling_param {{ pool: MAX kernel_size: 2 '
               'stride: 2 } }',
               'layer { name: "f" type: "InnerProductReLUDropout" bottom: "c" top: "f" inner_product_param { '
               'num_output: 3 } }', inputs={"x": (1, 2, 9, 6)})
    wc, bc = rng(17).standard_normal((4, 2, 3, 2)).astype(np.float32), rng(18).standard_normal(4).astype(np.float32)
    wf, bf = rng(19).standard_normal((3, 32)).astype(np.float32), rng(20).standard_normal(3).astype(np.float32)
    (tmp_path / "n.prototxt").write_text(text)
    write_caffemodel(parse_prototxt_text(text), {"c": [BlobData(wc), BlobData(bc)], "f": [BlobData(wf), BlobData(bf)]},
                     tmp_path / "n.caffemodel")
    model = caffeq.load(tmp_path / "n.prototxt", tmp_path / "n.caffemodel")
    assert np.array_equal(node_of(model, "c").blobs[0], wc) and np.array_equal(node_of(model, "f").blobs[1], bf)
    x = rng(21).standard_normal((1, 2, 9, 6)).astype(np.float32)
    plain = load_from_text(net(conv("c", "Convolution", "x", "c", n=4), relu("c"), pool("c", "p", "kernel_size: 2 stride: 2"),
                               'layer { name: "f" type: "InnerProduct" bottom: "p" top: "f" inner_product_param { '
                               'num_output: 3 } }', relu("f"), inputs={"x": x.shape}))
    node_of(plain, "c").blobs, node_of(plain, "f").blobs = [wc, bc], [wf, bf]
    np.testing.assert_allclose(model.run({"x": x})["f"], plain.run({"x": x})["f"], rtol=1e-5, atol=1e-5)


def test_the_forks_fields_read():
    text = net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" connectivity_mode: DISCONNECTED_ELTWISE '
               'param { lr_mult: 1 breadth_decay_mult: 0.5 kernel_shape_decay_mult: 0.25 regularization_type: "L1" '
               'block_group_lasso { xdimen: 2 ydimen: 3 block_decay_mult: 0.5 } } '
               'convolution_param { num_output: 4 kernel_size: 3 conv_mode: LOWERED_CCNMM dump_parameter: true '
               'dump_activation: true parameter_sparsity_pattern_histogram: true } }',
               'layer { name: "f" type: "InnerProduct" bottom: "c" top: "f" inner_product_param { num_output: 3 '
               'gemm_mode: SPMDM spmdm_transpose_in: true dump_parameter: true dump_activation: true } }',
               inputs={"x": (1, 2, 6, 5)})
    model = load_from_text(text)
    c, f = node_of(model, "c").param, node_of(model, "f").param
    assert c.connectivity_mode == c.DISCONNECTED_ELTWISE
    assert c.param[0].regularization_type == "L1" and c.param[0].block_group_lasso[0].ydimen == 3
    assert c.param[0].breadth_decay_mult == 0.5 and c.param[0].kernel_shape_decay_mult == 0.25
    p = c.convolution_param
    assert p.conv_mode == p.LOWERED_CCNMM and p.dump_parameter and p.parameter_sparsity_pattern_histogram
    assert f.inner_product_param.gemm_mode == f.inner_product_param.SPMDM
    assert f.inner_product_param.spmdm_transpose_out   # default true
    assert type(node_of(model, "c").spec).__name__ == "Convolution"
    assert model.blob_shapes["f"] == (1, 3)


def test_the_fork_numbers_decode_from_a_binary_layer():
    from caffeq.io.schema import caffe_pb2
    lp = caffe_pb2.LayerParameter()
    # conv_mode 21 = DIRECT_SCONV (2), spmdm_transpose_out 9 = false, connectivity_mode 12 = 1
    lp.MergeFromString(bytes([0x60, 0x01]) + bytes([0xd2, 0x06, 0x03, 0xa8, 0x01, 0x02])
                       + bytes([0xaa, 0x07, 0x02, 0x48, 0x00]))
    assert lp.connectivity_mode == 1
    assert lp.convolution_param.conv_mode == 2
    assert lp.inner_product_param.HasField("spmdm_transpose_out") and not lp.inner_product_param.spmdm_transpose_out


CONV_ONLY = CONV.format(n=4, extra="")


@pytest.mark.parametrize("text, message", [
    (f'layer {{ name: "c" type: "ConvolutionReLU" bottom: "x" top: "y" relu_param {{ negative_slope: 0.1 }} '
     f'convolution_param {{ {CONV_ONLY} }} }}', "only supports negative_slope 0"),
    (f'layer {{ name: "c" type: "ConvolutionReLU" bottom: "x" top: "y" convolution_param {{ {CONV_ONLY} '
     f'conv_mode: DIRECT_DCONV }} }}', "plain Convolution only"),
    (f'layer {{ name: "c" type: "ConvolutionReLU" bottom: "x" top: "y" convolution_param {{ {CONV_ONLY} '
     f'conv_mode: DIRECT_SCONV bias_term: false }} }}', "needs bias_term"),
    (f'layer {{ name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param {{ {CONV_ONLY} '
     f'conv_mode: DIRECT_SCONV }} }}', "adds it once more"),
    ('layer { name: "f" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 '
     'gemm_mode: SPGEMM } }', "SPGEMM"),
    (f'layer {{ name: "c" type: "ConvolutionReLUPool" bottom: "x" top: "y" convolution_param {{ {CONV_ONLY} }} '
     'pooling_param { pool: AVE kernel_size: 2 } }', "MAX only"),
    (f'layer {{ name: "c" type: "ConvolutionReLUPoolLRN" bottom: "x" top: "y" convolution_param {{ {CONV_ONLY} }} '
     'pooling_param { pool: MAX kernel_size: 2 } lrn_param { norm_region: WITHIN_CHANNEL } }', "ACROSS_CHANNELS only"),
    ('layer { name: "p" type: "ReLUPooling" bottom: "x" top: "y" top: "m" pooling_param { pool: MAX kernel_size: 2 } }',
     "one bottom and one top"),
])
def test_what_the_fork_cannot_run_gives_one_clear_line(text, message):
    with pytest.raises(LayerError, match=message) as err:
        load_from_text(net(text, inputs={"x": (1, 3, 9, 7)}))
    assert "\n" not in str(err.value)
