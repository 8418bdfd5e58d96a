"""haochen-rye/LSTD's SSLConvolution: its maintainer's answer (LSTD#2) is BVLC's Convolution, so the
reference is Caffe's im2col convolution (conftest.conv_ref) with the layer's own geometry (fc6's dilation
aside, as its nets: pad 1, and the ParamSpec's SSL decay fields that only training reads)."""
import numpy as np
from conftest import check_everywhere, conv_ref, net, rng

from caffeq.model import load_from_text


def test_ssl_convolution_is_caffes_convolution_and_says_so(tmp_path):
    x = rng(95).standard_normal((2, 3, 7, 6)).astype(np.float32)
    layer = ('layer { name: "conv4_1" type: "SSLConvolution" bottom: "x" top: "y" '
             'param { lr_mult: 1 decay_mult: 1 breadth_decay_mult: 1 kernel_shape_decay_mult: 1 } '
             'param { lr_mult: 2 decay_mult: 0 } convolution_param { num_output: 5 pad: 1 kernel_size: 3 stride: 2 } }')
    model = load_from_text(net(layer, inputs={"x": x.shape}), random_weights=True)
    assert any("read as BVLC's Convolution" in w and "LSTD#2" in w for w in model.warnings)
    w, b = (np.asarray(v, np.float32) for v in model.layers[-1].blobs)
    assert w.shape == (5, 3, 3, 3) and b.shape == (5,)
    check_everywhere(model, {"x": x}, {"y": conv_ref(x, w, b, (2, 2), (1, 1))}, tmp_path, atol=1e-5, rtol=1e-5)
