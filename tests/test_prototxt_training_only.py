"""Unknown fields that only matter for training are warnings; any other unknown field is an error."""
import pytest

from caffeq.errors import ParseError
from caffeq.io.prototxt import parse_prototxt_text, read_prototxt

DATA_TRAIN = """name: "n"
layer {
  name: "data"
  type: "Data"
  top: "data"
  top: "label"
  include { phase: TRAIN }
  data_param { source: "train_lmdb" batch_size: 4 backend: LMDB }
  fancy_sampler_param { jitter: 0.3 nested { deeper: 1 } }
}
"""

CONV = """layer {
  name: "conv"
  type: "Convolution"
  bottom: "data"
  top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 }
}
"""


def _parse(text, **kw):
    warnings = []
    net = parse_prototxt_text(text, path="t.prototxt", warnings=warnings, **kw)
    return net, warnings


def test_unknown_field_in_train_only_layer_is_a_warning():
    net, warnings = _parse(DATA_TRAIN + CONV)
    assert [lp.name for lp in net.layer] == ["data", "conv"]
    assert net.layer[0].data_param.batch_size == 4  # the rest of the layer still reads
    assert len(warnings) == 1  # the nested unknown fields are not reported again
    w = warnings[0]
    assert "t.prototxt:9:" in w and "'fancy_sampler_param'" in w and "'data'" in w
    assert "not in the TEST net" in w


def test_exclude_test_rule_counts_as_train_only():
    text = CONV.replace('type: "Convolution"', 'type: "Convolution"\n  exclude { phase: TEST }') \
        .replace("kernel_size: 3", "kernel_size: 3 dropconnect: 0.5")
    _, warnings = _parse(text)
    assert len(warnings) == 1 and "dropconnect" in warnings[0]


def test_exclude_rule_with_a_stage_is_not_enough():
    text = CONV.replace('type: "Convolution"', 'type: "Convolution"\n  exclude { phase: TEST stage: "x" }') \
        .replace("kernel_size: 3", "kernel_size: 3 dropconnect: 0.5")
    with pytest.raises(ParseError, match="dropconnect"):
        _parse(text)


def test_unknown_field_in_a_test_layer_is_still_an_error():
    text = DATA_TRAIN + CONV.replace("kernel_size: 3", "kernel_size: 3 kernal_pad: 1")
    with pytest.raises(ParseError) as err:
        _parse(text)
    msg = str(err.value)
    # file:line:column of the field, the field and the layer
    assert "t.prototxt:16:" in msg and "'kernal_pad'" in msg and "'conv'" in msg
    assert "--ignore-unknown" in msg


@pytest.mark.parametrize("empty", ["fork_param { }", "fork_param {\n  # nothing here\n  }", "fork_param < >",
                                   "fork_param: { }"])
def test_an_unknown_empty_message_sets_nothing_and_is_a_warning(empty):
    # a colorization deploy copy writes `batch_normalize_bbox_param{ }` in its BatchNorm layers
    net, warnings = _parse(CONV.replace("convolution_param", f"{empty}\n  convolution_param"))
    assert net.layer[0].convolution_param.num_output == 4
    assert len(warnings) == 1 and "'fork_param'" in warnings[0] and "an empty message" in warnings[0]


@pytest.mark.parametrize("filled", ["fork_param { x: 1 }", "fork_param { inner { } }", "fork_param: 3"])
def test_an_unknown_field_with_content_is_still_an_error(filled):
    with pytest.raises(ParseError, match="fork_param"):
        _parse(CONV.replace("convolution_param", f"{filled}\n  convolution_param"))


def test_transform_and_loss_params_are_training_only_at_test():
    text = """
layer {
  name: "data" type: "Data" top: "data" top: "label"
  transform_param { scale: 0.5 random_erase { prob: 0.5 } color_jitter: 0.1 }
  data_param { source: "val_lmdb" batch_size: 2 backend: LMDB }
}
layer {
  name: "loss" type: "SoftmaxWithLoss" bottom: "data" bottom: "label" top: "loss"
  loss_param { ignore_label: 255 focal_gamma: 2 }
  focal_loss_param { alpha: 0.25 }
}
layer {
  name: "loss2" type: "SoftmaxWithLoss" bottom: "data" bottom: "label" top: "loss2"
  loss_param { focal_gamma: 3 }
}
"""
    net, warnings = _parse(text)
    assert net.layer[0].transform_param.scale == 0.5
    assert net.layer[1].loss_param.ignore_label == 255
    joined = "\n".join(warnings)
    assert "'random_erase'" in joined and "'color_jitter'" in joined and "transform_param" in joined
    assert "'focal_loss_param'" in joined and "loss parameters" in joined
    focal = [w for w in warnings if "'focal_gamma'" in w]
    assert len(focal) == 1 and "(and 1 more)" in focal[0]  # one line per field name


def test_reading_the_train_net_keeps_training_fields_strict():
    text = """
layer {
  name: "data" type: "Data" top: "data"
  transform_param { color_jitter: 0.1 }
  data_param { source: "x" batch_size: 1 }
}
"""
    _parse(text)  # TEST: a warning
    with pytest.raises(ParseError, match="color_jitter"):
        _parse(text, phase="TRAIN")
    # and layers left out of the TRAIN net become the lenient ones
    _, warnings = _parse(text.replace('type: "Data"', 'type: "Data" include { phase: TEST }'),
                         phase="TRAIN")
    assert "not in the TRAIN net" in warnings[0]


def test_ignore_unknown_turns_every_unknown_field_into_a_warning():
    text = DATA_TRAIN + CONV.replace("kernel_size: 3", "kernel_size: 3 kernal_pad: 1")
    net, warnings = _parse(text, ignore_unknown=True)
    assert net.layer[1].convolution_param.kernel_size == [3]
    assert any("kernal_pad" in w for w in warnings)
    assert any("fancy_sampler_param" in w for w in warnings)


def test_v1_layers_with_train_rule():
    text = """
layers {
  name: "data" type: DATA top: "data"
  include { phase: TRAIN }
  data_param { source: "x" batch_size: 1 shuffle_pool: 64 }
}
"""
    net, warnings = _parse(text)
    assert net.layers[0].name == "data"
    assert len(warnings) == 1 and "shuffle_pool" in warnings[0] and "'data'" in warnings[0]


def test_top_level_unknown_field_is_an_error():
    with pytest.raises(ParseError, match="'debug_mode'"):
        _parse('name: "n"\ndebug_mode: true\n' + CONV)


def test_syntax_errors_after_an_unknown_field_still_fail(tmp_path):
    p = tmp_path / "bad.prototxt"
    p.write_text(DATA_TRAIN + CONV.replace("num_output: 4", "num_output: four"))
    with pytest.raises(ParseError, match="bad.prototxt:16:"):
        read_prototxt(p, warnings=[])


def test_bad_phase_is_refused():
    with pytest.raises(ParseError, match="phase"):
        parse_prototxt_text(CONV, phase="VAL")
