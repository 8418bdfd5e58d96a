"""yeLer/caffe-learning (2c14e88) lesson 05's MyNeuron: top = bottom ^ my_neuron_param.power (caffe_powx,
float32 pow), power 2 by default."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def my_neuron_net(param, shape):
    return net(f'layer {{ name: "myneuron" type: "MyNeuron" bottom: "x" top: "o" {param} }}', inputs={"x": shape})


@pytest.mark.parametrize("param, power", [
    ("my_neuron_param { power: 2 }", 2.0),   # the lesson's deploy.prototxt
    ("", 2.0),                               # the pdf's default
    ("my_neuron_param { power: 3 }", 3.0),
])
def test_my_neuron_raises_to_the_power(param, power, tmp_path):
    shape = (2, 3, 5, 4)
    model = load_from_text(my_neuron_net(param, shape))
    x = rng(1).standard_normal(shape).astype(F)
    want = np.power(x, F(power))
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_my_neuron_fractional_power_of_a_negative_is_nan(tmp_path):
    shape = (2, 1, 3, 5)
    model = load_from_text(my_neuron_net("my_neuron_param { power: 0.5 }", shape))
    x = rng(2).uniform(0.1, 4.0, shape).astype(F)
    x[0, 0, 1, 2] = -1.0     # pow(-1, 0.5) is NaN, as std::pow gives
    with np.errstate(invalid="ignore"):
        want = np.power(x, F(0.5))
    assert np.isnan(want[0, 0, 1, 2])
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)


def test_my_neuron_takes_one_bottom():
    text = net('layer { name: "myneuron" type: "MyNeuron" bottom: "x" bottom: "y" top: "o" }',
               inputs={"x": (1, 2), "y": (1, 2)})
    with pytest.raises(CaffeqError, match=r"layer 'myneuron' \(MyNeuron\): MyNeuron takes one bottom, got 2"):
        load_from_text(text)
