"""Round 107b fork items: UrwLee/Experience's channels-last ConvolutionNHWC, ConvolutionDepthwiseNHWC and PoolingNHWC
(caffeq/layers/nhwc_layers.py) against numpy transcriptions of the fork's loops (im2col_nhwc_cpu + GEMM, the
depthwise GPU kernel, the pooling loops) in torch, onnxruntime and model.py; weights from a caffemodel in the fork's
(kh, kw, C_in, C_out) layout; and the round's corpus files."""
import numpy as np
import pytest
from conftest import REPO, check_everywhere, cli_process, net, ok, one_line_error, rng

from caffeq.errors import CaffeqError
from caffeq.io.schema import caffe_pb2
from caffeq.model import load_from_text

F32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"
NHWC_NET = CORPUS / "UrwLee__Experience__remodet_repository_LEE__test__testToNHWC__models__net_NHWC.prototxt"
FRCNN_NET = CORPUS / "makefile__frcnn__examples__FRCNN__fpn-res50__train_val_merged-dcn-ohem.proto.prototxt"


def conv_nhwc_ref(x, w, b, stride, pad, dilation):
    """base_conv_nhwc_layer.cpp: per image, im2col_nhwc_cpu's columns [H', W', kh, kw, C] (zero outside the map)
    times the weight [kh, kw, C, O], plus the bias; float64."""
    n, h, wd, c = x.shape
    kh, kw, _, o = w.shape
    oh = (h + 2 * pad[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
    ow = (wd + 2 * pad[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
    out = np.zeros((n, oh, ow, o))
    wmat = w.reshape(kh * kw * c, o).astype(np.float64)
    for img in range(n):
        col = np.zeros((oh, ow, kh, kw, c))
        for i in range(oh):
            for j in range(ow):
                for r in range(kh):
                    for q in range(kw):
                        y, xx = i * stride[0] - pad[0] + r * dilation[0], j * stride[1] - pad[1] + q * dilation[1]
                        if 0 <= y < h and 0 <= xx < wd:
                            col[i, j, r, q] = x[img, y, xx]
        out[img] = (col.reshape(oh * ow, -1) @ wmat).reshape(oh, ow, o)
        if b is not None:
            out[img] += b
    return out


def depthwise_nhwc_ref(x, w, b, stride, pad):
    """conv_dw_nhwc_layer.cu's DepthwiseConv2DNHWCWeightForward / BiasForward (weight [kh, kw, 1, C])."""
    n, h, wd, c = x.shape
    kh, kw = w.shape[:2]
    oh = (h + 2 * pad[0] - kh) // stride[0] + 1
    ow = (wd + 2 * pad[1] - kw) // stride[1] + 1
    out = np.zeros((n, oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            for r in range(kh):
                for q in range(kw):
                    y, xx = i * stride[0] - pad[0] + r, j * stride[1] - pad[1] + q
                    if 0 <= y < h and 0 <= xx < wd:
                        out[:, i, j, :] += x[:, y, xx, :] * w[r, q, 0, :]
    return out + (0 if b is None else b)


def pool_nhwc_ref(x, mode, kernel, stride, pad):
    """pooling_nhwc_layer.cpp's Reshape and Forward_cpu loops (MAX from -FLT_MAX over the in-map cells, AVE
    dividing by the window clipped to H + pad)."""
    n, h, wd, c = x.shape
    out = []
    for size, k, s, p in zip((h, wd), kernel, stride, pad):
        o = int(np.ceil((size + 2 * p - k) / s)) + 1
        if any(pad) and (o - 1) * s >= size + p:
            o -= 1
        out.append(o)
    y = np.zeros((n, out[0], out[1], c))
    for i in range(out[0]):
        for j in range(out[1]):
            hs, ws = i * stride[0] - pad[0], j * stride[1] - pad[1]
            if mode == "MAX":
                he, we = min(hs + kernel[0], h), min(ws + kernel[1], wd)
                cells = x[:, max(hs, 0):he, max(ws, 0):we, :].reshape(n, -1, c)
                y[:, i, j] = np.maximum(cells.max(axis=1), -np.finfo(F32).max)
            else:
                he, we = min(hs + kernel[0], h + pad[0]), min(ws + kernel[1], wd + pad[1])
                size = (he - hs) * (we - ws)
                cells = x[:, max(hs, 0):min(he, h), max(ws, 0):min(we, wd), :].astype(np.float64)
                y[:, i, j] = cells.sum(axis=(1, 2)) / size
    return y


def caffemodel(path, blobs_by_layer):
    """A caffemodel holding {layer name: [arrays]} with each blob's own shape."""
    model = caffe_pb2.NetParameter()
    for name, blobs in blobs_by_layer.items():
        layer = model.layer.add(name=name)
        for a in blobs:
            bp = layer.blobs.add()
            bp.shape.dim.extend(a.shape)
            bp.data.extend(a.astype(F32).ravel().tolist())
    path.write_bytes(model.SerializeToString())
    return path


def load_with_weights(text, tmp_path, blobs_by_layer):
    proto = tmp_path / "net.prototxt"
    proto.write_text(text)
    from caffeq.model import load
    return load(proto, weights=caffemodel(tmp_path / "net.caffemodel", blobs_by_layer))


# ---- ConvolutionNHWC ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("geometry, stride, pad, dilation", [
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0", (2, 1), (1, 0), (1, 1)),
    ("kernel_size: 3 stride: 2 pad: 2 dilation: 2", (2, 2), (2, 2), (2, 2)),
    ("kernel_size: 1", (1, 1), (0, 0), (1, 1)),   # the fork's is_1x1_ path: the input is the column buffer
])
def test_convolution_nhwc_matches_the_im2col_gemm(geometry, stride, pad, dilation, tmp_path):
    x = rng(1).standard_normal((2, 7, 10, 3)).astype(F32)
    kh, kw = (3, 2) if "kernel_h" in geometry else ((3, 3) if "kernel_size: 3" in geometry else (1, 1))
    w = rng(2).standard_normal((kh, kw, 3, 5)).astype(F32)
    b = rng(3).standard_normal(5).astype(F32)
    text = net(f'layer {{ name: "c" type: "ConvolutionNHWC" bottom: "x" top: "y" '
               f'convolution_param {{ num_output: 5 {geometry} }} }}', inputs={"x": x.shape})
    model = load_with_weights(text, tmp_path, {"c": [w, b]})
    ref = conv_nhwc_ref(x, w, b, stride, pad, dilation)
    assert model.graph.tensors["y"].shape == ref.shape
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_convolution_nhwc_two_bottoms_share_the_filters_without_bias(tmp_path):
    x1 = rng(4).standard_normal((1, 5, 6, 4)).astype(F32)
    x2 = rng(5).standard_normal((1, 5, 6, 4)).astype(F32)
    w = rng(6).standard_normal((2, 3, 4, 3)).astype(F32)
    text = net('layer { name: "c" type: "ConvolutionNHWC" bottom: "a" bottom: "b" top: "ya" top: "yb" '
               'convolution_param { num_output: 3 bias_term: false kernel_h: 2 kernel_w: 3 pad: 1 } }',
               inputs={"a": x1.shape, "b": x2.shape})
    model = load_with_weights(text, tmp_path, {"c": [w]})
    refs = {"ya": conv_nhwc_ref(x1, w, None, (1, 1), (1, 1), (1, 1)),
            "yb": conv_nhwc_ref(x2, w, None, (1, 1), (1, 1), (1, 1))}
    check_everywhere(model, {"a": x1, "b": x2}, refs, tmp_path, atol=1e-5, rtol=1e-5)


def test_convolution_nhwc_refuses_groups_and_a_caffemodel_in_nchw_layout(tmp_path):
    with pytest.raises(CaffeqError, match="group must be 1 in ConvolutionNHWC"):
        load_from_text(net('layer { name: "c" type: "ConvolutionNHWC" bottom: "x" top: "y" '
                           'convolution_param { num_output: 4 kernel_size: 1 group: 2 } }', inputs={"x": (1, 3, 3, 4)}))
    text = net('layer { name: "c" type: "ConvolutionNHWC" bottom: "x" top: "y" '
               'convolution_param { num_output: 5 kernel_size: 3 bias_term: false } }', inputs={"x": (1, 6, 6, 2)})
    with pytest.raises(CaffeqError, match=r"has shape \[5, 2, 3, 3\], the prototxt implies \[3, 3, 2, 5\]"):
        load_with_weights(text, tmp_path, {"c": [np.zeros((5, 2, 3, 3), F32)]})   # BVLC's (O, C, kh, kw)


# ---- ConvolutionDepthwiseNHWC -------------------------------------------------------------------------------

@pytest.mark.parametrize("geometry, stride, pad", [
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0", (2, 1), (1, 0)),
    ("kernel_size: 3 stride: 1 pad: 1 num_output: 6", (1, 1), (1, 1)),
])
def test_depthwise_nhwc_matches_the_gpu_kernel(geometry, stride, pad, tmp_path):
    x = rng(7).standard_normal((2, 9, 8, 6)).astype(F32)
    kh, kw = (3, 2) if "kernel_h" in geometry else (3, 3)
    w = rng(8).standard_normal((kh, kw, 1, 6)).astype(F32)
    b = rng(9).standard_normal(6).astype(F32)
    text = net(f'layer {{ name: "d" type: "ConvolutionDepthwiseNHWC" bottom: "x" top: "y" '
               f'convolution_param {{ {geometry} }} }}', inputs={"x": x.shape})
    model = load_with_weights(text, tmp_path, {"d": [w, b]})
    ref = depthwise_nhwc_ref(x, w, b, stride, pad)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("param, needle", [
    ("kernel_size: 3 pad: 1", "convolution_param.stride (or stride_h and stride_w) is required"),
    ("kernel_size: 3 stride: 1 pad: 1 num_output: 4", "num_output 4 must equal the bottom's channels 6"),
    ("kernel_size: 3 stride: 1 pad: 1 dilation: 2", "dilation must be 1"),
])
def test_depthwise_nhwc_bad_parameters(param, needle):
    with pytest.raises(CaffeqError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_from_text(net(f'layer {{ name: "d" type: "ConvolutionDepthwiseNHWC" bottom: "x" top: "y" '
                           f'convolution_param {{ {param} }} }}', inputs={"x": (1, 5, 5, 6)}), random_weights=True)


# ---- PoolingNHWC --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["MAX", "AVE"])
@pytest.mark.parametrize("geometry, kernel, stride, pad", [
    ("kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1)),      # ceil: 5 x 6, no window dropped
    ("kernel_size: 3 stride: 2 pad: 2", (3, 3), (2, 2), (2, 2)),      # ceil 6 x 7, the last row of windows
    #                                                                   starts in the padding: dropped, 5 x 7
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3", (3, 2), (2, 3), (0, 0)),   # ceil overhang
])
def test_pooling_nhwc_matches_the_fork_loops(mode, geometry, kernel, stride, pad, tmp_path):
    x = rng(10).standard_normal((2, 8, 11, 3)).astype(F32)
    text = net(f'layer {{ name: "p" type: "PoolingNHWC" bottom: "x" top: "y" '
               f'pooling_param {{ pool: {mode} {geometry} }} }}', inputs={"x": x.shape})
    model = load_from_text(text)
    ref = pool_nhwc_ref(x, mode, kernel, stride, pad)
    assert model.graph.tensors["y"].shape == ref.shape
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["MAX", "AVE"])
def test_pooling_nhwc_global(mode, tmp_path):
    x = rng(11).standard_normal((2, 5, 7, 4)).astype(F32)
    model = load_from_text(net(f'layer {{ name: "p" type: "PoolingNHWC" bottom: "x" top: "y" '
                               f'pooling_param {{ pool: {mode} global_pooling: true }} }}', inputs={"x": x.shape}))
    ref = pool_nhwc_ref(x, mode, (5, 7), (1, 1), (0, 0))
    assert ref.shape == (2, 1, 1, 4)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("geometry, kernel, stride, pad", [
    ("global_pooling: true", (5, 7), (1, 1), (0, 0)),
    ("kernel_size: 3 stride: 2", (3, 3), (2, 2), (0, 0)),
    ("kernel_h: 2 kernel_w: 3 stride: 2 pad: 1", (2, 3), (2, 2), (1, 1)),
])
def test_pooling_nhwc_max_of_minus_inf_windows_is_minus_flt_max(geometry, kernel, stride, pad, tmp_path):
    """Both fork forwards start each MAX window at -FLT_MAX, so a window of -inf gives -FLT_MAX (ONNX's MaxPool
    gave -inf before the review of round 107)."""
    x = rng(15).standard_normal((2, 5, 7, 3)).astype(F32)
    x[0, :, :, 1] = -np.inf
    x[1, :3, :4, 0] = -np.inf
    model = load_from_text(net(f'layer {{ name: "p" type: "PoolingNHWC" bottom: "x" top: "y" '
                               f'pooling_param {{ pool: MAX {geometry} }} }}', inputs={"x": x.shape}))
    ref = pool_nhwc_ref(x, "MAX", kernel, stride, pad)
    assert (ref[0, :, :, 1] == -np.finfo(F32).max).all()
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_pooling_nhwc_refuses_stochastic():
    with pytest.raises(CaffeqError, match="PoolingNHWC has MAX and AVE only"):
        load_from_text(net('layer { name: "p" type: "PoolingNHWC" bottom: "x" top: "y" '
                           'pooling_param { pool: STOCHASTIC kernel_size: 2 } }', inputs={"x": (1, 4, 4, 2)}))


# ---- the fork's own test net, and the corpus files ---------------------------------------------------------

def test_fork_test_net_conv_relu_pool_chain(tmp_path):
    """The layers as net_NHWC.prototxt chains them (conv, leaky ReLU 0.1, MAX pool 2/2), on an NHWC input."""
    x = rng(12).standard_normal((2, 9, 12, 3)).astype(F32)
    w = rng(13).standard_normal((3, 3, 3, 4)).astype(F32)
    b = rng(14).standard_normal(4).astype(F32)
    text = net('layer { name: "c" type: "ConvolutionNHWC" bottom: "x" top: "c" convolution_param { num_output: 4 '
               'pad: 1 kernel_size: 3 stride: 2 } }',
               'layer { name: "r" type: "ReLU" bottom: "c" top: "c" relu_param { negative_slope: 0.1 } }',
               'layer { name: "p" type: "PoolingNHWC" bottom: "c" top: "p" pooling_param { pool: MAX kernel_size: 2 '
               'stride: 2 pad: 0 } }', inputs={"x": x.shape})
    model = load_with_weights(text, tmp_path, {"c": [w, b]})
    c = conv_nhwc_ref(x, w, b, (2, 2), (1, 1), (1, 1))
    c = np.where(c > 0, c, 0.1 * c)
    check_everywhere(model, {"x": x}, {"p": pool_nhwc_ref(c, "MAX", (2, 2), (2, 2), (0, 0))}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_corpus_nhwc_net_reads():
    out = ok(cli_process("inspect", NHWC_NET))
    assert "pool5" in out and "1x7x7x512" in out


def test_corpus_frcnn_layer_level_fillers_stay_an_error():
    """makefile/frcnn 8d9b9eb's caffe.proto declares no weight_filler / bias_filler in LayerParameter: its own
    Caffe refuses the file at the same line."""
    one_line_error(cli_process("inspect", FRCNN_NET), "708:3", "weight_filler", "res3d_branch2b_offset")
