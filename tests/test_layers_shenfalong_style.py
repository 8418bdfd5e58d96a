"""shenfalong/styletransfer (cebf7e2) layers and prototxt dialect: numpy references written from the fork's
CUDA kernels (caffeq/layers/shenfalong_style.py), compared in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.schema import caffe_pb2
from caffeq.model import load_from_text

SHAPE = (2, 3, 5, 7)


def one(layer, shape=SHAPE, **kw):
    return load_from_text(net(layer, inputs={"x": shape}), **kw)


def test_instance_cudnn_batch_norm_normalises_each_item_alone(tmp_path):
    model = one('layer { name: "bn" type: "InstanceCuDNNBatchNorm" bottom: "x" top: "y" }', random_weights=True)
    node = model.graph.node("bn")
    scale, bias = node.blobs[0].reshape(-1), node.blobs[1].reshape(-1)
    node.blobs[2][:] = 5.0   # running statistics: written by the fork, never read
    node.blobs[3][:] = 9.0
    x = (rng(1).standard_normal(SHAPE) * 3 + 2).astype(np.float32)
    x[1] = rng(11).standard_normal(SHAPE[1:]) * 3e-3 + 2   # a variance near the 1e-5: eps shows
    want = np.zeros(SHAPE)
    for n in range(SHAPE[0]):
        for c in range(SHAPE[1]):
            v = x[n, c].astype(np.float64)
            var = ((v - v.mean()) ** 2).mean()   # cuDNN's biased batch variance
            want[n, c] = scale[c] * (v - v.mean()) / np.sqrt(var + 1e-5) + bias[c]
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path, atol=3e-5, rtol=1e-5)


def test_mean_variance_gives_means_then_deviations(tmp_path):
    model = one('layer { name: "mv" type: "MeanVariance" bottom: "x" top: "y" }')
    assert model.blob_shapes["y"] == (2, 6, 1, 1)
    x = (rng(2).standard_normal(SHAPE) * 3e-3 + 1).astype(np.float32)   # a small variance: the 1e-5 shows
    x[1] = rng(12).standard_normal(SHAPE[1:]) * 2 - 1
    flat = x.reshape(2, 3, -1).astype(np.float64)
    mean, square = flat.mean(2), (flat * flat).mean(2)
    want = np.concatenate([mean, np.sqrt(square - mean * mean + 1e-5)], 1).reshape(2, 6, 1, 1)
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path, atol=2e-5, rtol=1e-5)


def test_pad_image_mirrors_with_the_edge_repeated(tmp_path):
    model = one('layer { name: "p" type: "PadImage" bottom: "x" top: "y" convolution_param { pad: 3 } }')
    assert model.blob_shapes["y"] == (2, 3, 11, 13)
    x = rng(3).standard_normal(SHAPE).astype(np.float32)
    want = np.zeros((2, 3, 11, 13), np.float32)
    h, w, pad = 5, 7, 3
    for i in range(h + 2 * pad):       # pad_kernel's index arithmetic
        for j in range(w + 2 * pad):
            r, c = i, j
            r = pad - 1 - r if r < pad else (r - pad if r < pad + h else h - 1 - (r - (pad + h)))
            c = pad - 1 - c if c < pad else (c - pad if c < pad + w else w - 1 - (c - (pad + w)))
            want[:, :, i, j] = x[:, :, r, c]
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path)


def test_scale_bias_maps_tanh_output_to_bgr_pixels_minus_mean(tmp_path):
    shape = (2, 4, 3, 5)
    model = one('layer { name: "sb" type: "ScaleBias" bottom: "x" top: "y" }', shape)
    x = rng(4).uniform(-1, 1, shape).astype(np.float32)
    y = x * np.float32(127.5) + np.float32(127.5)
    means = np.array([104.008, 116.669, 122.675, 122.675]).reshape(1, 4, 1, 1)
    want = (y.astype(np.float64) - means).astype(np.float32)
    assert not np.array_equal(want, y - means.astype(np.float32))   # the double subtraction shows
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path, atol=0, rtol=0)


def test_de_concat_splits_channels(tmp_path):
    shape = (2, 6, 3, 5)
    model = one('layer { name: "d" type: "DeConcat" bottom: "x" top: "a" top: "b" top: "c" '
                'concat_param { channels: 1 channels: 3 channels: 2 } }', shape)
    x = rng(5).standard_normal(shape).astype(np.float32)
    check_everywhere(model, {"x": x}, {"a": x[:, :1], "b": x[:, 1:4], "c": x[:, 4:]}, tmp_path)


def conv_ref(x, w, b, stride, pad):
    n, c, h, wd = x.shape
    o, _, k, _ = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    y = np.zeros((n, o, ho, wo))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            y[:, :, i, j] = np.einsum("nckl,ockl->no", patch, w)
    return y + (0 if b is None else b.reshape(1, -1, 1, 1))


def deconv_ref(x, w, stride, pad):
    n, c, h, wd = x.shape
    _, o, k, _ = w.shape
    full = np.zeros((n, o, (h - 1) * stride + k, (wd - 1) * stride + k))
    for i in range(h):
        for j in range(wd):
            full[:, :, i * stride:i * stride + k, j * stride:j * stride + k] += \
                np.einsum("nc,cokl->nokl", x[:, :, i, j].astype(np.float64), w)
    return full[:, :, pad:full.shape[2] - pad, pad:full.shape[3] - pad]


STYLE_CONV = """input_blob { name: "x" num: 2 channels: 3 height: 5 width: 7 }
layer { name: "c" type: "CuDNNConvolution" bottom: "x" bottom_flow: -1 top: "y" top_flow: -1
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "f" type: "InnerProduct" bottom: "y" top: "z" inner_product_param { num_output: 2 } }
"""


def test_bias_default_off_only_in_the_forks_dialect():
    warnings = []
    parsed = parse_prototxt_text(STYLE_CONV, warnings=warnings)
    assert parsed.layer[0].convolution_param.HasField("bias_term") and not parsed.layer[0].convolution_param.bias_term
    assert not parsed.layer[1].inner_product_param.bias_term
    assert any("bias_term: false" in w for w in warnings)
    # strawberryfg's CuDNNConvolution / CuDNNDeconvolution on BVLC's caffe.proto: a bias unless it says otherwise
    for kind in ("CuDNNConvolution", "CuDNNDeconvolution"):
        bvlc = one('layer { name: "c" type: "%s" bottom: "x" top: "y" '
                   'convolution_param { num_output: 4 kernel_size: 3 } }' % kind, random_weights=True)
        assert len(bvlc.graph.node("c").blobs) == 2


def test_cudnn_convolution_bias_defaults_off_and_fork_bias_blob_loads(tmp_path):
    model = load_from_text(STYLE_CONV, random_weights=True)
    assert len(model.graph.node("c").blobs) == 1   # the fork's bias_term [default = false]
    x = rng(6).standard_normal(SHAPE).astype(np.float32)
    w = model.graph.node("c").blobs[0]
    y = conv_ref(x, w, None, 2, 1)
    z = y.reshape(2, -1) @ model.graph.node("f").blobs[0].T.astype(np.float64)
    check_everywhere(model, {"x": x}, {"z": z}, tmp_path, atol=2e-5, rtol=1e-5)
    spec = model.graph.node("c").spec
    with_bias = one('layer { name: "c" type: "CuDNNConvolution" bottom: "x" top: "y" '
                    'convolution_param { num_output: 4 kernel_size: 3 bias_term: true } }', random_weights=True)
    node = with_bias.graph.node("c")
    stored = spec.stored_blobs(node.attrs, [node.blobs[0], np.arange(4, dtype=np.float32).reshape(4, 1, 1, 1)], [])
    assert stored[1].shape == (4,)


def test_cudnn_deconvolution_matches_the_transposed_convolution(tmp_path):
    model = one('layer { name: "d" type: "CuDNNDeConvolution" bottom: "x" top: "y" '
                'convolution_param { num_output: 2 kernel_size: 4 stride: 2 pad: 1 bias_term: false } }',
                random_weights=True)
    assert model.blob_shapes["y"] == (2, 2, 10, 14)
    x = rng(7).standard_normal(SHAPE).astype(np.float32)
    w = model.graph.node("d").blobs[0]
    check_everywhere(model, {"x": x}, {"y": deconv_ref(x, w, 2, 1)}, tmp_path, atol=2e-5, rtol=1e-5)


FORK_NET = """
name: "style"
input_blob { name: "data" num: 2 channels: 3 height: 9 width: 6 }
layer { name: "pool" type: "Pooling" bottom: "data" bottom_flow: -1 top: "pool" top_flow: 0
  pooling_param { pool: "max" kernel_size: 2 stride: 2 }
  include { need_backward: false } }
"""


def test_fork_dialect_input_blob_string_pool_flows_and_include(tmp_path):
    warnings = []
    parsed = parse_prototxt_text(FORK_NET, warnings=warnings)
    assert list(parsed.input) == ["data"] and list(parsed.input_shape[0].dim) == [2, 3, 9, 6]
    p = parsed.layer[0].pooling_param
    assert p.pool == caffe_pb2.PoolingParameter.MAX and p.round_mode == caffe_pb2.PoolingParameter.FLOOR
    assert any("input_blob" in w for w in warnings) and any("bottom_flow" in w for w in warnings)
    assert any('pool: "max"' in w for w in warnings)
    model = load_from_text(FORK_NET)
    assert model.blob_shapes["pool"] == (2, 3, 4, 3)   # the fork's floor rounding (BVLC's ceil gives 5x3)
    x = rng(8).standard_normal((2, 3, 9, 6)).astype(np.float32)
    want = x[:, :, :8, :6].reshape(2, 3, 4, 2, 3, 2).max(axis=(3, 5))
    check_everywhere(model, {"data": x}, {"pool": want}, tmp_path)


def test_fork_ave_pool_reads_as_ave():
    text = FORK_NET.replace('"max"', '"ave"')
    assert parse_prototxt_text(text).layer[0].pooling_param.pool == caffe_pb2.PoolingParameter.AVE


def fork_ave_pool(x, k, s, pad):
    """The fork's AvePoolForward (pooling_layer.cu) with its Reshape's floor size: the in-image sum over the window
    divided by the window clipped at H + pad."""
    n, c, h, w = x.shape
    oh, ow = (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1
    y = np.zeros((n, c, oh, ow), np.float64)
    for i in range(oh):
        for j in range(ow):
            hs, ws = i * s - pad, j * s - pad
            he, we = min(hs + k, h + pad), min(ws + k, w + pad)
            size = (he - hs) * (we - ws)
            y[:, :, i, j] = x[:, :, max(hs, 0):min(he, h), max(ws, 0):min(we, w)].astype(np.float64).sum((2, 3)) / size
    return y


def test_fork_pooling_without_pool_averages_with_floor_rounding(tmp_path):
    """The fork's PoolingParameter: pool is a string with default "ave", and its Reshape always floors."""
    text = FORK_NET.replace('pool: "max" kernel_size: 2 stride: 2', "kernel_size: 3 stride: 2 pad: 1")
    warnings = []
    p = parse_prototxt_text(text, warnings=warnings).layer[0].pooling_param
    assert p.pool == caffe_pb2.PoolingParameter.AVE and p.round_mode == caffe_pb2.PoolingParameter.FLOOR
    assert any('pool: "ave"' in w for w in warnings) and any("floor rounding" in w for w in warnings)
    model = load_from_text(text)
    assert model.blob_shapes["pool"] == (2, 3, 5, 3)   # BVLC's MAX with ceil gives 5x4
    x = rng(9).standard_normal((2, 3, 9, 6)).astype(np.float32)
    check_everywhere(model, {"data": x}, {"pool": fork_ave_pool(x, 3, 2, 1)}, tmp_path, atol=1e-6, rtol=1e-6)


def test_pooling_defaults_stay_bvlcs_outside_the_dialect_and_given_fields_stay():
    bvlc = 'layer { name: "pool" type: "Pooling" bottom: "x" top: "pool" pooling_param { kernel_size: 3 stride: 2 } }'
    p = parse_prototxt_text(net(bvlc, inputs={"x": (2, 3, 9, 6)})).layer[1].pooling_param
    assert not p.HasField("pool") and p.pool == caffe_pb2.PoolingParameter.MAX
    assert p.round_mode == caffe_pb2.PoolingParameter.CEIL
    text = FORK_NET.replace('pool: "max"', "pool: MAX round_mode: CEIL")
    p = parse_prototxt_text(text).layer[0].pooling_param
    assert p.pool == caffe_pb2.PoolingParameter.MAX and p.round_mode == caffe_pb2.PoolingParameter.CEIL


def test_input_blob_beside_input_is_refused():
    with pytest.raises(CaffeqError, match="give the inputs one way"):
        parse_prototxt_text('input: "x"\n' + FORK_NET)


@pytest.mark.parametrize("layer, shape, msg", [
    ('layer { name: "d" type: "DeConcat" bottom: "x" top: "a" top: "b" concat_param { channels: 1 channels: 1 } }',
     SHAPE, "sum to 2, the bottom has 3 channels"),
    ('layer { name: "d" type: "DeConcat" bottom: "x" top: "a" concat_param { channels: 1 channels: 2 } }',
     SHAPE, "2 counts for 1 tops"),
    ('layer { name: "p" type: "PadImage" bottom: "x" top: "y" convolution_param { pad: 6 } }',
     SHAPE, "larger than the 5x7 image"),
])
def test_bad_parameters_are_one_line_errors(layer, shape, msg):
    with pytest.raises(CaffeqError, match=msg):
        one(layer, shape)


def style_normalize_ref(x):
    """normalize_layer.cu: compute_norm sums x^2 over the channels at each (n, h, w), adds BN_EPS 1e-5 and takes
    the root; forward_kernel divides every channel there by it.  Legacy num/channels/height/width."""
    legacy = x.reshape(x.shape + (1,) * (4 - x.ndim)).astype(np.float64)
    n, c, h, w = legacy.shape
    out = np.zeros_like(legacy)
    for i in range(n):
        for r in range(h):
            for s in range(w):
                total = sum(legacy[i, k, r, s] ** 2 for k in range(c))
                out[i, :, r, s] = legacy[i, :, r, s] / np.sqrt(total + 1e-5)
    return out.reshape(x.shape)


NORM_LAYER = 'layer { name: "n" type: "Normalize" bottom: "x" top: "y" norm_param { scale_value: %s } }'


@pytest.mark.parametrize("shape, scale_value", [(SHAPE, "1"), ((2, 5, 3, 1), "4"), ((2, 3), "1")])
def test_normalize_with_scale_value_is_the_forks_per_position_l2(tmp_path, shape, scale_value):
    model = one(NORM_LAYER % scale_value, shape, random_weights=True)
    assert not model.graph.node("n").blobs and model.blob_shapes["y"] == shape
    # small values: the fork's 1e-5 (not SSD's eps 1e-10, not scale_value) sets much of each norm
    x = (rng(8).standard_normal(shape) * 2e-3).astype(np.float32)
    x[0, :, ...] *= 1e3
    check_everywhere(model, {"x": x}, {"y": style_normalize_ref(x)}, tmp_path, atol=2e-6, rtol=1e-5)


def test_normalize_without_scale_value_stays_ssds(tmp_path):
    model = one('layer { name: "n" type: "Normalize" bottom: "x" top: "y" norm_param { across_spatial: false } }',
                random_weights=True)
    assert len(model.graph.node("n").blobs) == 1


@pytest.mark.parametrize("params, msg", [
    ("scale_value: 1 across_spatial: false", "scale_value .*and SSD's across_spatial"),
    ("scale_value: 1 scale_filler { value: 2 }", "keep one fork's fields"),
])
def test_normalize_scale_value_with_ssd_fields_is_refused(params, msg):
    with pytest.raises(CaffeqError, match=msg):
        one('layer { name: "n" type: "Normalize" bottom: "x" top: "y" norm_param { %s } }' % params)
