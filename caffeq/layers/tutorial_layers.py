"""Layers written in Caffe tutorials.

yeLer/caffe-learning (2c14e88), lesson "1-learning/05making own layer": MyNeuron
(1define_layer/my_neuron_layer.cpp, .hpp, .cu), a NeuronLayer whose forward is caffe_powx:
top = bottom ^ power, elementwise (std::pow in float32), power read as float from
my_neuron_param.power.  The lesson's pdf (pdf/caffe05.pdf, page "3. caffe.proto") declares
`message MyNeuronParameter { optional float power = 1 [default = 2]; }` and the LayerParameter field as
number 150 (it names it my_square_param there, while the C++ and 2test_my_layer/deploy.prototxt use
my_neuron_param); 150 is SSD's prior_box_param here, so caffeq reads it as my_neuron_param = 93150.
"""
from .activation import Power, f32
from .registry import register_layer


@register_layer("MyNeuron")
class MyNeuron(Power):
    """x ^ power: caffeq's Power with scale 1 and shift 0 (power 0 gives 1 everywhere, as pow does)."""

    def parse_param(self, lp):
        power = f32(lp.my_neuron_param.power)
        attrs = {"power": power, "scale": 1.0, "shift": 0.0}
        if power == 0:
            attrs["constant"] = 1.0
        return attrs


__all__ = ["MyNeuron"]
