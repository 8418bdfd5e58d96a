"""abhimanyudubey's SymmetricDropout (caffeq/layers/symmetric_dropout.py): its TEST forward copies the bottom
(symmetric_dropout_layer.cpp / .cu at 44eaf65), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


@pytest.mark.parametrize("param", ["", "symmetric_dropout_param { dropout_ratio: 0.7 }"])
def test_symmetric_dropout_copies_at_test(param, tmp_path):
    model = load_from_text(net('layer { name: "fc" type: "InnerProduct" bottom: "x" top: "f" '
                               'inner_product_param { num_output: 5 } }',
                               f'layer {{ name: "drop" type: "SymmetricDropout" bottom: "f" top: "f" {param} }}',
                               'layer { name: "out" type: "TanH" bottom: "f" top: "o" }',
                               inputs={"x": (2, 3, 3, 5)}), random_weights=True)
    x = rng(2).standard_normal((2, 3, 3, 5)).astype(F)
    w, b = (np.asarray(v, np.float64) for v in model.params["fc"])
    ref = np.tanh(x.reshape(2, -1).astype(np.float64) @ w.T + b).astype(F)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_symmetric_dropout_refuses_a_ratio_outside_0_1():
    with pytest.raises(LayerError, match=r"symmetric_dropout_param.dropout_ratio must be in \[0, 1\]"):
        load_from_text(net('layer { name: "drop" type: "SymmetricDropout" bottom: "x" top: "x" '
                           'symmetric_dropout_param { dropout_ratio: 1.5 } }', inputs={"x": (2, 4)}))
