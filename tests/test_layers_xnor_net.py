"""loswensiana/BWN-XNOR-caffe's BinActiv, SplitConcat and Statistic (2ccf4e7 ex_layers).  BinActiv's
reference is its CPU loop: sign(x), and K = the channel mean (x / C added in order) convolved with the
constant filler's window, times float32(1 / k^2); the window sums compare to 1e-6 (im2col's order)."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def binactiv_ref(x, k, pad, weight, bias):
    n, c, h, w = x.shape
    mean = np.zeros((n, 1, h, w), F)
    for ch in range(c):
        mean = (mean + (x[:, ch:ch + 1] / F(c)).astype(F)).astype(F)
    padded = np.pad(mean.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    out = np.zeros((n, 1, h, w))
    for y in range(h):
        for z in range(w):
            out[:, :, y, z] = weight * padded[:, :, y:y + k, z:z + k].sum((2, 3)) + bias
    return np.where(x >= 0, F(1), F(-1)), (out * F(1.0 / (k * k))).astype(F)


@pytest.mark.parametrize("k, pad, weight, bias", [(5, 2, 1.0, None), (3, 1, 0.5, 0.25)])
def test_binactiv_sign_and_k(k, pad, weight, bias, tmp_path):
    x = rng(1).standard_normal((2, 4, 6, 7)).astype(F)
    x[0, 0, 0, 0] = 0.0
    fillers = f"weight_filler {{ type: 'constant' value: {weight} }}"
    fillers += f" bias_filler {{ type: 'constant' value: {bias} }}" if bias is not None else " bias_term: false"
    model = load_from_text(net(f'layer {{ name: "b" type: "BinActiv" bottom: "x" top: "s" top: "k" convolution_param {{ '
                               f'num_output: 1 kernel_size: {k} pad: {pad} stride: 1 {fillers} }} }}',
                               inputs={"x": x.shape}))
    sign, kk = binactiv_ref(x, k, pad, weight, bias or 0.0)
    assert sign[0, 0, 0, 0] == 1
    check_everywhere(model, {"x": x}, {"s": sign, "k": kk}, tmp_path, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("param, msg", [("num_output: 2 kernel_size: 3 pad: 1", "num_output must be 1"),
                                        ("num_output: 1 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' }",
                                         "only a constant filler"),
                                        ("num_output: 1 kernel_size: 3 weight_filler { type: 'constant' }",
                                         "keeps the bottom's height")])
def test_binactiv_refusals(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "b" type: "BinActiv" bottom: "x" top: "s" top: "k" '
                           f'convolution_param {{ {param} }} }}', inputs={"x": (1, 2, 5, 5)}))


def test_split_concat_copies_along_the_axis(tmp_path):
    x = rng(2).standard_normal((2, 1, 3, 4)).astype(F)
    model = load_from_text(net('layer { name: "s" type: "SplitConcat" bottom: "x" top: "o" '
                               'convolution_param { num_output: 3 } }', inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": np.concatenate([x] * 3, 1)}, tmp_path)


def test_statistic_is_read_not_run():
    model = load_from_text(net('layer { name: "st" type: "Statistic" bottom: "x" top: "o" slice_param { axis: 100 } }',
                               inputs={"x": (1, 2, 3, 3)}))
    assert model.blob_shapes["o"] == (1, 1, 1, 1)
    with pytest.raises(LayerError, match="depends on how often the net ran"):
        model.run({"x": np.zeros((1, 2, 3, 3), F)})
