"""liuzechun/Bi-Real-net's Caffes (f58aa4d binary_conv_train_layer.cpp, threshold_layer.cpp,
leaky_clip_layer.cpp): references from the fork's loops in numpy, on asymmetric shapes."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.model import load_from_text

F = np.float32


def bireal_binarize(w):
    """binarizeCPUTo: A[o] += |w| / n over the channel's weights in order, then A[o] * sign(w), sign(0) = +1."""
    rows = w.reshape(w.shape[0], -1)
    out = np.empty_like(rows)
    for o, row in enumerate(rows):
        a = F(0)
        for v in row:
            a = F(a + F(abs(v) / F(row.size)))
        out[o] = np.where(row >= 0, a, -a)
    return out.reshape(w.shape)


def block(conv_type="BinaryConvolutionTrain", threshold=""):
    return ('layer { name: "thre" type: "Threshold" bottom: "x" top: "t" ' + threshold + '}\n'
            f'layer {{ name: "bconv" type: "{conv_type}" bottom: "t" top: "o" '
            'convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 } }')


def test_binary_block_signs_the_input_and_binarizes_the_weights(tmp_path):
    model = load_from_text(net(block(), inputs={"x": (2, 3, 5, 6)}), random_weights=True)
    assert any("Bi-Real-net" in w for w in model.warnings)
    conv = node_of(model, "bconv")
    w = rng(1).standard_normal((4, 3, 3, 3)).astype(F)
    w[0, 0, 0, 0] = 0                                       # sign(0) = +1
    b = rng(2).standard_normal(4).astype(F)
    conv.blobs[0], conv.blobs[1] = w, b
    x = rng(3).standard_normal((2, 3, 5, 6)).astype(F)
    x[0, 0, 0, :2] = 0                                      # at the threshold: -1
    signs = np.where(x > 0, F(1), F(-1))
    ref = conv_ref(signs, bireal_binarize(w), b, (2, 2), (1, 1)).astype(F)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_bireal_test_nets_binary_convolution_reads_the_channel_scale(tmp_path):
    # caffe-retrainBN-test registers the same layer as BinaryConvolution, without HWGQ's parameter; once a
    # Threshold feeds one, the net is theirs: every Threshold of it gives -1 (their Caffe's only Threshold)
    text = net(block("BinaryConvolution"), 'layer { name: "head" type: "Threshold" bottom: "o" top: "h" }',
               inputs={"x": (1, 2, 4, 4)})
    model = load_from_text(text, random_weights=True)
    assert node_of(model, "thre").attrs["below"] == -1 and node_of(model, "head").attrs["below"] == -1
    assert node_of(model, "bconv").attrs["use_alpha"] is True


@pytest.mark.parametrize("text", [
    'layer { name: "thre" type: "Threshold" bottom: "x" top: "t" }',
    block("BinaryConvolution").replace('convolution_param', 'binary_convolution_param { use_alpha: false } '
                                       'convolution_param'),
])
def test_other_nets_keep_bvlc_threshold(text, tmp_path):
    model = load_from_text(net(text, inputs={"x": (1, 2, 4, 4)}), random_weights=True)
    assert node_of(model, "thre").attrs["below"] == 0
    assert not any("Bi-Real-net" in w for w in model.warnings)


def test_threshold_below_value(tmp_path):
    model = load_from_text(net('layer { name: "thre" type: "Threshold" bottom: "x" top: "o" '
                               'threshold_param { threshold: 0.25 below_value: -0.5 } }', inputs={"x": (2, 3, 4)}))
    x = rng(4).standard_normal((2, 3, 4)).astype(F)
    x[0, 0, 0] = 0.25
    check_everywhere(model, {"x": x}, {"o": np.where(x > F(0.25), F(1), F(-0.5))}, tmp_path)


def test_leaky_clip(tmp_path):
    model = load_from_text(net('layer { name: "c" type: "lClip" bottom: "x" top: "o" relu_param { negative_slope: 0.1 } }',
                               inputs={"x": (2, 3, 5)}))
    x = (3 * rng(5).standard_normal((2, 3, 5))).astype(F)
    x[0, 0, :2] = [-1, 1]
    s = F(0.1)
    ref = np.where(x <= -1, F(-1) + s * (x + F(1)), np.where(x < 1, x, F(1) + s * (x - F(1)))).astype(F)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)
