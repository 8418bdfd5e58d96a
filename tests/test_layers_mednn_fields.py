"""JiachenMao/MeDNN's ParamSpec fields (caffe/src/caffe/proto/caffe.proto: decay_proto = 9,
special_shape_decay_mult = 10): group-lasso regularisation for training, read and never used."""
from pathlib import Path

import pytest

from caffeq.errors import CaffeqError
from caffeq.io.schema import caffe_pb2
from caffeq.model import load, load_from_text, read_net

VGG16 = (Path(__file__).parent / "fixtures" / "realworld"
         / "JiachenMao__MeDNN__caffe__models__vgg__mjc_workstation__vgg16_group_lasso.prototxt")


def test_the_group_lasso_vgg16_reads_its_param_specs():
    net = read_net(str(VGG16))
    conv = next(lp for lp in net.layer if lp.name == "conv1_1")
    assert [p.special_shape_decay_mult for p in conv.param][:1] == [1.0]
    assert conv.param[0].kernel_shape_decay_mult == 1.0 and conv.param[0].breadth_decay_mult == 1.0
    model = load(str(VGG16))
    assert model.blob_shapes["fc8"][1] == 1000


def test_decay_proto_is_a_string_read_without_opening_it():
    text = ('input: "x" input_shape { dim: 1 dim: 2 dim: 3 dim: 3 }\n'
            'layer { name: "c" type: "Convolution" bottom: "x" top: "c" param { decay_proto: "missing.binaryproto" '
            'special_shape_decay_mult: 0.5 } convolution_param { num_output: 2 kernel_size: 1 } }')
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["c"] == (1, 2, 3, 3)


def test_a_mistyped_value_is_one_clear_error():
    text = ('input: "x" input_shape { dim: 1 dim: 2 dim: 3 dim: 3 }\n'
            'layer { name: "c" type: "Convolution" bottom: "x" top: "c" param { special_shape_decay_mult: "big" } '
            'convolution_param { num_output: 2 kernel_size: 1 } }')
    with pytest.raises(CaffeqError, match="special_shape_decay_mult"):
        load_from_text(text, random_weights=True)


def test_the_fields_keep_the_forks_numbers_types_and_defaults():
    # binary caffemodels carry the numbers, which the text-format tests above never see
    fields = caffe_pb2.ParamSpec.DESCRIPTOR.fields_by_name
    decay, special = fields["decay_proto"], fields["special_shape_decay_mult"]
    assert (decay.number, decay.type, decay.default_value) == (9, decay.TYPE_STRING, "")
    assert (special.number, special.type, special.default_value) == (10, special.TYPE_FLOAT, 0.0)
    spec = caffe_pb2.ParamSpec()
    spec.decay_proto, spec.special_shape_decay_mult = "w.binaryproto", 0.25
    # field 9, length-delimited (tag 0x4a); field 10, 32-bit float (tag 0x55)
    assert spec.SerializeToString() == b"\x4a\x0dw.binaryproto\x55\x00\x00\x80\x3e"
