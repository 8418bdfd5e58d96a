"""dongyp13/Stochastic-Quantization's BWN and TWN layers (fa384c1 conv_layer_binary.cu, conv_layer_ternary.cu,
util/lowbit_functions.cu).  The references follow the kernels: BWN sign(w) * (sum |w| / K) per row; TWN's
delta = 0.7 / N * sum |w - mean|, +-1 beyond it, times the row's mean |w| there; the sums in float64,
the fork's cuBLAS order unknown (compared to 1e-6)."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def bwn_ref(w):
    rows = w.reshape(w.shape[0], -1).astype(np.float64)
    alpha = F(np.abs(rows).sum(1) / rows.shape[1])
    return (np.where(rows >= 0, 1, -1) * alpha[:, None]).astype(F).reshape(w.shape)


def twn_ref(w):
    rows = w.reshape(w.shape[0], -1).astype(np.float64)
    n = rows.size
    delta = 0.7 / n * np.abs(rows - rows.sum() / n).sum()
    code = np.where(rows > delta, 1.0, np.where(rows < -delta, -1.0, 0.0))
    beyond = code != 0
    kept = beyond.sum(1)
    alpha = np.where(kept > 0, np.where(beyond, np.abs(rows), 0).sum(1) / np.maximum(kept, 1), 0)
    return (code * alpha[:, None]).astype(F).reshape(w.shape)


@pytest.mark.parametrize("kind, param, ref", [("BinaryConvolution", "sq: true ratio: 100", bwn_ref),
                                              ("TernaryConvolution", "", twn_ref)])
def test_convolutions_quantize_their_weights(kind, param, ref, tmp_path):
    x = rng(1).standard_normal((2, 3, 6, 5)).astype(F)
    model = load_from_text(net(f'layer {{ name: "c" type: "{kind}" bottom: "x" top: "o" convolution_param {{ '
                               f'num_output: 4 kernel_size: 3 pad: 1 {param} }} }}', inputs={"x": x.shape}),
                           random_weights=True)
    w, b = model.layers[-1].blobs
    want = conv_ref(x, ref(w), b, (1, 1), (1, 1)).astype(F)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, ref", [("BinaryInnerProduct", bwn_ref), ("TernaryInnerProduct", twn_ref)])
def test_inner_products_quantize_their_weights(kind, ref, tmp_path):
    x = rng(2).standard_normal((3, 2, 2, 3)).astype(F)
    model = load_from_text(net(f'layer {{ name: "f" type: "{kind}" bottom: "x" top: "o" inner_product_param {{ '
                               f'num_output: 5 sq: false ratio: 100 }} }}', inputs={"x": x.shape}),
                           random_weights=True)
    w, b = model.layers[-1].blobs
    want = (x.reshape(3, -1).astype(np.float64) @ ref(w).astype(np.float64).T + b).astype(F)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, rtol=1e-5, atol=1e-5)


def test_random_stochastic_quantization_is_read_not_run(tmp_path):
    model = load_from_text(net('layer { name: "c" type: "TernaryConvolution" bottom: "x" top: "o" convolution_param { '
                               'num_output: 2 kernel_size: 1 sq: true ratio: 50 } }', inputs={"x": (1, 2, 3, 3)}),
                           random_weights=True)
    assert model.blob_shapes["o"] == (1, 2, 3, 3)
    with pytest.raises(CaffeqError, match="ratio 50 < 100 keeps a random share"):
        model.run({"x": np.zeros((1, 2, 3, 3), F)})
