"""GuohongWu/caffe-windows (branch experiment, 6206125d): normalize_scale in convolution_param and
inner_product_param rescales each output filter to that L2 norm in Blob::Update only (training); the forward
is BVLC's with the stored weights.  The references convolve the stored weights with conftest's conv_ref."""
import numpy as np
from conftest import check_everywhere, conv_ref, net, node_of, rng

from caffeq.model import load_from_text

F = np.float32


def test_normalize_scale_convolution_uses_the_stored_weights(tmp_path):
    # from normnet_train_test.prototxt: bias_term false, normalize_scale 3.0; asymmetric geometry here
    text = net('layer { name: "conv" type: "Convolution" bottom: "x" top: "o" convolution_param { num_output: 4 '
               'bias_term: false kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 '
               'weight_filler { type: "msra" } normalize_scale: 3.0 } }', inputs={"x": (2, 3, 9, 6)})
    model = load_from_text(text, random_weights=True, seed=3)
    w = np.asarray(node_of(model, "conv").blobs[0])
    norms = np.sqrt((w.astype(np.float64) ** 2).reshape(4, -1).sum(1))
    assert not np.allclose(norms, 3.0)          # the stored weights are not renormalized at TEST
    x = rng(5).standard_normal((2, 3, 9, 6)).astype(F)
    want = conv_ref(x, w, None, (2, 1), (1, 0))
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-5, rtol=1e-5)
    assert any("normalize_scale 3" in n and "training update" in n for n in model.warnings)


def test_normalize_scale_inner_product_uses_the_stored_weights(tmp_path):
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "o" inner_product_param { num_output: 5 '
               'weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.25 } normalize_scale: 2.0 } }',
               inputs={"x": (2, 3, 3, 2)})
    model = load_from_text(text, random_weights=True, seed=4)
    ip = node_of(model, "ip")
    w, b = np.asarray(ip.blobs[0]).astype(np.float64), np.asarray(ip.blobs[1]).astype(np.float64)
    x = rng(6).standard_normal((2, 3, 3, 2)).astype(F)
    want = x.reshape(2, -1).astype(np.float64) @ w.T + b
    check_everywhere(model, {"x": x}, {"o": want.astype(F)}, tmp_path, atol=1e-5, rtol=1e-5)
    assert any("inner_product_param.normalize_scale 2" in n for n in model.warnings)


def test_normalize_scale_deconvolution_is_plain(tmp_path):
    text = net('layer { name: "up" type: "Deconvolution" bottom: "x" top: "o" convolution_param { num_output: 2 '
               'kernel_size: 2 stride: 2 bias_term: false normalize_scale: 1.0 } }', inputs={"x": (2, 3, 3, 5)})
    model = load_from_text(text, random_weights=True, seed=5)
    w = np.asarray(node_of(model, "up").blobs[0]).astype(np.float64)   # (C_in, C_out, 2, 2)
    x = rng(7).standard_normal((2, 3, 3, 5)).astype(F)
    want = np.zeros((2, 2, 6, 10))
    for i in range(3):
        for j in range(5):
            want[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2] += np.einsum("nc,cokl->nokl", x[:, :, i, j], w)
    check_everywhere(model, {"x": x}, {"o": want.astype(F)}, tmp_path, atol=1e-5, rtol=1e-5)
