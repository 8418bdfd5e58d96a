"""The JPEG steganalysis forks' layers (caffeq/layers/steganalysis.py): BNConv, BdctToSpatial, QuantTruncAbs
and ReLURecover, against references written here from the forks' GPU kernels (GuanshuoXu/
caffe_deep_learning_for_steganalysis 2139f17: bn_conv_layer.cu, bdct_to_spatial_layer.cu,
quant_trunc_abs_layer.cu, relu_recover_layer.cu), in torch, onnxruntime and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.layers.steganalysis import JPEG_QUANT_TABLES
from caffeq.model import load_from_text

F32 = np.float32
# the in-place layers act on a copy of the input (an identity Power), as in the forks' nets on a conv's top
COPY = 'layer { name: "copy" type: "Power" bottom: "x" top: "y" }\n'


def idct_block(d):
    """The orthonormal JPEG inverse DCT of one 8 x 8 block of coefficients d[u, v], by its formula."""
    c = [1 / math.sqrt(2)] + [1.0] * 7
    out = np.zeros((8, 8))
    for y in range(8):
        for x in range(8):
            out[y, x] = sum(c[u] * c[v] / 4 * d[u, v] * math.cos((2 * y + 1) * u * math.pi / 16)
                            * math.cos((2 * x + 1) * v * math.pi / 16) for u in range(8) for v in range(8))
    return out


@pytest.mark.parametrize("quality", [75, 95])
def test_bdct_to_spatial_dequantizes_and_inverts_each_block(quality, tmp_path):
    x = rng(quality).integers(-30, 30, (2, 64, 2, 3)).astype(F32)
    model = load_from_text(net(f'layer {{ name: "s" type: "BdctToSpatial" bottom: "x" top: "o" '
                               f'bdct_to_spatial_param {{ quality: {quality}.7 }} }}', inputs={"x": x.shape}))
    assert model.graph.tensors["o"].shape == (2, 1, 16, 24)
    q = np.array(JPEG_QUANT_TABLES[quality], np.float64).reshape(8, 8)   # quality 75.7 reads as 75 (C's int)
    ref = np.zeros((2, 1, 16, 24))
    for n in range(2):
        for bh in range(2):
            for bw in range(3):
                d = x[n, :, bh, bw].astype(np.float64).reshape(8, 8) * q   # channel u x 8 + v
                ref[n, 0, bh * 8:bh * 8 + 8, bw * 8:bw * 8 + 8] = idct_block(d)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("params, shape, msg", [
    ("quality: 85", (1, 64, 2, 2), "quality must be 75 or 95"),
    ("quality: 75", (1, 63, 2, 2), r"\(N, 64, Hb, Wb\), got \[1, 63, 2, 2\]"),
])
def test_bdct_to_spatial_refuses_what_the_fork_cannot_read(params, shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "s" type: "BdctToSpatial" bottom: "x" top: "o" '
                           f'bdct_to_spatial_param {{ {params} }} }}', inputs={"x": shape}))


def fork_quant_trunc_abs(a, process, th):
    """quant_trunc_abs_layer.cu, one element."""
    t = a if a >= 0 else -a
    whole = float(int(t))
    rounded = whole + 1 if t - whole >= 0.5 else whole
    sign = 1.0 if a >= 0 else -1.0
    return {"QUANTTRUNCABS": min(rounded, th), "QUANT": sign * rounded, "ABS": t, "TRUNC": min(max(a, -th), th),
            "QUANTTRUNC": sign * min(rounded, th), "QUANTABS": rounded, "TRUNCABS": min(t, th)}[process]


VALUES = np.array([0.49999997, 0.5, -0.5, 1.5, -2.5, 2.4999998, 7.6, -8.4, 9.0, -11.5, 0.0, 3.2, -0.2, 100.5,
                   -7.5, 8.0], F32).reshape(1, 2, 2, 4)


@pytest.mark.parametrize("process", ["QUANTTRUNCABS", "QUANT", "ABS", "TRUNC", "QUANTTRUNC", "QUANTABS", "TRUNCABS"])
def test_quant_trunc_abs_modes(process, tmp_path):
    model = load_from_text(net(COPY + f'layer {{ name: "q" type: "QuantTruncAbs" bottom: "y" top: "y" '
                               f'quant_trunc_abs_param {{ process: {process} threshold: 8 }} }}',
                               inputs={"x": VALUES.shape}))
    ref = np.array([fork_quant_trunc_abs(float(v), process, 8.0) for v in VALUES.reshape(-1)]).reshape(VALUES.shape)
    check_everywhere(model, {"x": VALUES}, {"y": ref}, tmp_path)


def test_in_place_only_layers_refuse_another_top():
    for layer in ('layer { name: "q" type: "QuantTruncAbs" bottom: "x" top: "y" }',
                  'layer { name: "q" type: "ReLURecover" bottom: "x" top: "y" }'):
        with pytest.raises(LayerError, match="works in place only .top 'y' must be its bottom 'x'"):
            load_from_text(net(layer, inputs={"x": (1, 2, 3, 4)}))


@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_relu_recover_is_relu(slope, tmp_path):
    x = rng(3).standard_normal((2, 3, 4, 5)).astype(F32)
    model = load_from_text(net(COPY + f'layer {{ name: "r" type: "ReLURecover" bottom: "y" top: "y" '
                               f'relu_param {{ negative_slope: {slope} }} }}', inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"y": np.where(x > 0, x, x * F32(slope))}, tmp_path)


def test_bn_conv_normalizes_with_its_stored_statistics(tmp_path):
    """bn_conv_layer.cu at TEST: ((x - mean) / pow(var + 1e-10, 0.5)) x scale + shift, blobs (1, C, 1, 1)."""
    x = rng(5).standard_normal((2, 3, 4, 5)).astype(F32)
    model = load_from_text(net(COPY + 'layer { name: "b" type: "BNConv" bottom: "y" top: "y" bn_conv_param { decay: 0.9 } }',
                               inputs={"x": x.shape}), random_weights=True)
    bn = node_of(model, "b")
    assert bn.attrs["momentum"] == pytest.approx(0.1) and [tuple(b.shape) for b in bn.blobs] == [(1, 3, 1, 1)] * 4
    r = rng(6)
    scale, shift, mean = (r.standard_normal((1, 3, 1, 1)).astype(F32) for _ in range(3))
    var = r.uniform(0.5, 2, (1, 3, 1, 1)).astype(F32)
    bn.blobs = [scale, shift, mean, var]
    ref = (x.astype(np.float64) - mean) / np.sqrt(var.astype(np.float64) + 1e-10) * scale + shift
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


# ---- DctrQT, Trunc, SplitByPhase (tansq's dctrqt_caffe.patch, yedmed's trunc_layer.cpp, librauee's
# split_by_phase_layer.cpp) ---------------------------------------------------------------------------

def dctrqt_ref(x, step, threshold):
    """The patch's Forward_cpu: caffe_div by q, std::round (halves away from zero), fabs, cap at T."""
    out = np.empty_like(x)
    for i, v in enumerate(x.reshape(-1)):
        y = abs(math.copysign(math.floor(abs(float(F32(v / F32(step)))) + 0.5), 1.0))
        out.reshape(-1)[i] = min(y, threshold)
    return out


@pytest.mark.parametrize("step", [1.0, 2.0, 4.0, 3.0, 0.7])
def test_dctrqt(tmp_path, step):
    """hybrid_deep_learning_framework's three DctrQT layers on one DCT conv: T 4, q 1, 2 and 4, and steps whose
    quotients are inexact, on values around the halves."""
    x = (rng(51).standard_normal((2, 25, 5, 6)) * 8).astype(F32)
    x.reshape(-1)[:6] = [0.5 * step, -0.5 * step, 1.5 * step, -2.5 * step, 3.49 * step, -99]   # halves, the cap
    around = np.array([k + 0.5 for k in range(-4, 4)], np.float64) * step
    x.reshape(-1)[6:6 + 3 * len(around)] = np.concatenate([np.nextafter(around.astype(F32), F32(-np.inf)),
                                                             around.astype(F32),
                                                             np.nextafter(around.astype(F32), F32(np.inf))])
    layer = f'layer {{ name: "q" type: "DctrQT" bottom: "x" top: "o" dctrqt_param {{ threshold: 4 quantization_step: {step} }} }}'
    model = load_from_text(net(layer, inputs={"x": x.shape}))
    want = dctrqt_ref(x, step, 4)
    if step in (1.0, 2.0, 4.0):
        assert want.reshape(-1)[:6].tolist() == [1, 1, 2, 3, 3, 4]
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)
    with pytest.raises(LayerError, match="in-place"):
        load_from_text(net('layer { name: "q" type: "DctrQT" bottom: "x" top: "x" }', inputs={"x": (1, 2)}))


def test_trunc(tmp_path):
    """Yedroudj-Net's truncations: clamp to [-T, T]; the first one sets no T, and the fork's default is unknown."""
    x = (rng(52).standard_normal((2, 30, 4, 5)) * 3).astype(F32)
    layers = ('layer { name: "t1" type: "Trunc" bottom: "x" top: "o" trunc_param { scale: 2.0 } }\n'
              'layer { name: "t2" type: "Trunc" bottom: "x" top: "unset" }')
    model = load_from_text(net(layers, inputs={"x": x.shape}), outputs=["o"])
    want = np.where(x > 2, F32(2), np.where(x < -2, F32(-2), x))
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)
    nan = x.copy()
    nan[0, 0, 0, 0] = np.nan          # both comparisons false: NaN passes
    assert np.isnan(model.run({"x": nan})["o"][0, 0, 0, 0])
    unset = load_from_text(net(layers, inputs={"x": x.shape}))
    assert unset.blob_shapes["unset"] == x.shape
    with pytest.raises(LayerError, match="trunc_param.scale is not set"):
        unset.run({"x": x})


def test_split_by_phase(tmp_path):
    """PhaseAwareNet: the 64 phases of the 8 x 8 grid as channels, channel-major, written from the fork's index
    arithmetic."""
    x = rng(53).standard_normal((1, 2, 512, 512)).astype(F32)
    model = load_from_text(net('layer { name: "s" type: "SplitByPhase" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    want = np.empty((1, 128, 64, 64), F32)
    for c in range(2):
        for p in range(64):
            want[0, c * 64 + p] = x[0, c, p // 8::8, p % 8::8]
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)
    with pytest.raises(LayerError, match="512 x 512"):
        load_from_text(net('layer { name: "s" type: "SplitByPhase" bottom: "x" top: "o" }', inputs={"x": (1, 1, 64, 64)}))
