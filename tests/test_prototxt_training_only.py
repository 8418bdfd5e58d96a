"""Unknown fields that only matter for training are warnings; any other unknown field is an error."""
import numpy as np
import pytest

import caffeq
from caffeq.errors import ParseError, UnsupportedLayerError
from caffeq.io.prototxt import parse_prototxt_text, read_prototxt
from caffeq.model import load_from_text

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


def test_a_fork_value_of_a_known_enum_is_a_warning_where_only_training_reads_it():
    # dreadlord1984/SSD_windows_caffe's train files: `conf_loss_type: FocalLoss` (its own enum value)
    text = """
layer {
  name: "conf" type: "Convolution" bottom: "data" top: "conf"
  convolution_param { num_output: 4 kernel_size: 1 }
}
layer {
  name: "loss" type: "SoftmaxWithLoss" bottom: "conf" bottom: "label" top: "loss"
  loss_param { ignore_label: 255 normalization: POS_NUM }
}
"""
    net, warnings = _parse(text)
    assert net.layer[1].loss_param.ignore_label == 255   # the rest of the parameter still reads
    assert not net.layer[1].loss_param.HasField("normalization")
    assert len(warnings) == 1
    assert "t.prototxt:8:" in warnings[0] and "value POS_NUM of field 'normalization'" in warnings[0]
    assert "loss parameters only matter for training" in warnings[0]


def test_a_fork_value_of_an_enum_that_matters_is_an_error_naming_it():
    text = CONV.replace("kernel_size: 3", "kernel_size: 3 engine: CUDNN_FAST")
    with pytest.raises(ParseError, match=r"t.prototxt:6:\d+: 'engine: CUDNN_FAST' in layer 'conv': "
                                         r"enum caffe.ConvolutionParameter.Engine has no value named CUDNN_FAST"):
        _parse(text)
    with pytest.raises(ParseError, match="has no value named CUDNN_FAST"):   # strict for the TRAIN net too
        _parse(text, phase="TRAIN")


def test_a_fork_enum_value_given_as_its_number_is_unknown_like_a_fork_name():
    # vzhangmeng726/caffe-roc's TRAIN-only `eltwise_param { operation: 3 }` (a fork's op on two labels)
    label_op = """layer {
  name: "label2sim" type: "Eltwise" bottom: "label1" bottom: "label2" top: "sim"
  include { phase: TRAIN }
  eltwise_param { operation: 3 }
}
"""
    net, warnings = _parse(CONV + label_op)
    assert not net.layer[1].eltwise_param.HasField("operation")
    assert len(warnings) == 1 and "t.prototxt:11: ignored unknown value 3 of field 'operation'" in warnings[0]
    assert "not in the TEST net" in warnings[0]
    # in a layer that runs, the number is named in the error, as a fork's name would be
    with pytest.raises(ParseError, match=r"t.prototxt:6:\d+: 'pool: 7' in layer 'conv': enum "
                                         r"caffe.PoolingParameter.PoolMethod has no value with number 7"):
        _parse(CONV.replace("convolution_param { num_output: 4 kernel_size: 3 }", "pooling_param { pool: 7 }"))
    with pytest.raises(ParseError, match=r"has no value with number 0x7"):
        _parse(CONV.replace("convolution_param { num_output: 4 kernel_size: 3 }", "pooling_param { pool: 0x7 }"))
    net, _ = _parse(CONV.replace("kernel_size: 3", "kernel_size: 3 engine: 1"))   # a number the enum has
    assert net.layer[0].convolution_param.engine == 1


def test_reading_the_train_net_warns_of_augmentation_and_keeps_other_fields_strict():
    text = """
layer {
  name: "data" type: "Data" top: "data"
  transform_param { color_jitter: 0.1 }
  data_param { source: "x" batch_size: 1 }
}
"""
    _parse(text)  # TEST: a warning
    # TRAIN: a fork's augmentation knob is a warning that says caffeq does not apply it (its training
    # applies crop, mirror, mean and scale only); so is a fork's loss parameter (its fine-tuning uses
    # its own cross-entropy), DeepLab's V1 `softmaxloss_param` spelling included
    _, warnings = _parse(text, phase="TRAIN")
    assert "'color_jitter'" in warnings[0] and "does not apply" in warnings[0]
    loss = text.replace("transform_param { color_jitter: 0.1 }", "loss_param { focal_gamma: 2 }")
    _, warnings = _parse(loss, phase="TRAIN")
    assert "'focal_gamma'" in warnings[0] and "fine-tuning does not apply" in warnings[0]
    v1 = ('layers { name: "loss" type: SOFTMAX_LOSS bottom: "a" bottom: "b" '
          'softmaxloss_param { ignore_label: 255 } include { phase: TRAIN } }')
    for phase in ("TRAIN", "TEST"):
        _, warnings = _parse(v1, phase=phase)
        assert "'softmaxloss_param'" in warnings[0], warnings
    # a field of another layer stays strict in the train net
    with pytest.raises(ParseError, match="fancy"):
        _parse(text.replace("transform_param { color_jitter: 0.1 }", "fancy: 2"), phase="TRAIN")
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


# -- fork fields known to be training-only, by message and name -------------------------------------

FORK_FIELDS_NET = """name: "forks"
quantize: true
engine: "MKL2017"
eltwise_mem_sharing: true
default_forward_type: FLOAT16
global_grad_scale: 1000.
bn_stats_batch_size: 32
richness: 1000
layer {
  name: "data" type: "MemoryData" top: "data" top: "label" source_class: "com.yahoo.ml.caffe.ImageDataFrame"
  memory_data_param { source: "spark_rdd" batch_size: 2 channels: 3 height: 5 width: 7
                      share_in_parallel: false }
}
layer {
  name: "conv" type: "Convolution" bottom: "data" top: "conv" deletetop: true deletebottom: false
  engine: "MKL2017"
  forward_type: FLOAT16 backward_type: FLOAT16 forward_math: FLOAT
  param { lr_mult: 1 force_mult: 1 param_propagate_down: false breadth_decay_mult: 1 kernel_shape_decay_mult: 1 }
  convolution_param { num_output: 4 kernel_size: 3 }
  quantization_param { bw_layer_in: 8 scale_in: 1.5 scale_out: 2.5 scale_params: 3.0 scale_params: 4.0 }
}
layer {
  name: "frames" type: "Data" top: "frames" include { phase: TEST } engine: "CAFFE"
  transform_param { crop_size: 4 mean_value: 1 mean_value: 2 mean_value: 3 }
  data_param { source: "frames_lmdb" batch_size: 2 random: true }
}
"""


def test_known_fork_training_fields_are_warnings_with_their_reason():
    net, warnings = _parse(FORK_FIELDS_NET)
    assert net.layer[0].memory_data_param.height == 5 and net.layer[1].param[0].lr_mult == 1
    # the structured weight decays (SkimCaffe's and LSTD's ParamSpec) are declared: read, no warning
    assert (net.layer[1].param[0].breadth_decay_mult, net.layer[1].param[0].kernel_shape_decay_mult) == (1, 1)
    joined = "\n".join(warnings)
    for field, why in [("eltwise_mem_sharing", "NVCaffe's memory sharing"),
                       ("default_forward_type", "caffeq computes in float32"),
                       ("global_grad_scale", "gradient (loss) scaling"),
                       ("bn_stats_batch_size", "Intel Caffe"), ("richness", "cuDNN workspace"),
                       ("source", "CaffeOnSpark"), ("share_in_parallel", "CaffeOnSpark"),
                       ("force_mult", "training regulariser"), ("param_propagate_down", "GAN training"),
                       ("deletetop", "UberNet's memory saving"), ("deletebottom", "UberNet's memory saving"),
                       ("forward_type", "per-layer forward precision"), ("forward_math", "per-layer forward precision"),
                       ("backward_type", "per-layer backward pass precision"),
                       ("random", "darknet-style random resizing"),
                       ("engine", "Intel Caffe's choice of implementation"),
                       ("quantize", "caffe-jacinto's switch to its quantized inference"),
                       ("source_class", "CaffeOnSpark's data source class"),
                       ("scale_in", "Intel Caffe's int8 calibration scales"),
                       ("scale_params", "Intel Caffe's int8 calibration scales")]:
        line = [w for w in warnings if f"'{field}'" in w]
        assert len(line) == 1 + 2 * (field == "engine") and why in line[-1], (field, joined)
    # Intel's string "CAFFE" (yao-matrix/py-R-FCN) is not read as Cambricon's enum value CAFFE: left unset
    assert any("unknown value CAFFE of field 'engine' in layer 'frames'" in w for w in warnings)
    assert not net.layer[2].HasField("engine")
    # the net-wide engine (amirgholami/SqueezeNext's train_val files) as the layer's
    assert any("'engine'" in w and "Intel Caffe's engine for every layer" in w for w in warnings)


def test_known_fork_training_hyperparameters_stay_strict_for_the_train_net():
    with pytest.raises(ParseError, match="bn_stats_batch_size"):
        _parse(FORK_FIELDS_NET, phase="TRAIN")
    # memory and cuDNN knobs never matter for the numbers, nor NVCaffe's loss scale (it cancels in
    # caffeq's float32 training)
    train = FORK_FIELDS_NET.replace("bn_stats_batch_size: 32\n", "") \
        .replace(" force_mult: 1 param_propagate_down: false breadth_decay_mult: 1 kernel_shape_decay_mult: 1", "")
    _, warnings = _parse(train, phase="TRAIN")
    assert any("'eltwise_mem_sharing'" in w for w in warnings)
    assert any("'global_grad_scale'" in w and "caffeq trains in float32" in w for w in warnings)


def test_a_quoted_value_of_another_enum_stays_the_parsers_error():
    # only LayerParameter's engine is a string in a fork (Intel Caffe); convolution_param's is not
    with pytest.raises(ParseError, match="has no value named"):
        _parse(CONV.replace("kernel_size: 3", 'kernel_size: 3 engine: "MKL2017"'))


def test_a_known_name_in_another_message_is_still_an_error():
    # force_mult is only known in ParamSpec; new_dim-like names elsewhere are not excused
    text = CONV.replace("kernel_size: 3", "kernel_size: 3 force_mult: 1")
    with pytest.raises(ParseError, match="force_mult"):
        _parse(text)
    with pytest.raises(ParseError, match="richness"):
        _parse(CONV.replace("kernel_size: 3", "kernel_size: 3 richness: 1"))



def test_memory_logging_and_label_map_fields_of_forks_are_warnings():
    text = """name: "n"
mem_param { optimize_train: true optimize_test: true exclude_blob: "fc7" }
layer { name: "data" type: "ImageData" top: "data" top: "label"
  image_data_param { source: "list.txt" batch_size: 2 normalize: true } }
layer { name: "acc" type: "Accuracy" bottom: "data" bottom: "label" top: "acc"
  accuracy_param { top_k: 1 use_log: true } }
"""
    net, warnings = _parse(text)
    assert net.layer[1].accuracy_param.top_k == 1
    for field, why in [("mem_param", "yjxiong/caffe"), ("use_log", "Tongcheng/caffe"),
                       ("normalize", "caffe_dss")]:
        line = [w for w in warnings if f"'{field}'" in w]
        assert len(line) == 1 and why in line[0], (field, warnings)


def test_reading_order_and_label_switches_of_forks_are_warnings():
    # Tongcheng/DN_CaffeScript's random_order and Tyler-D/DeBlurNet's ImageData `label: false`
    text = """
layer { name: "d" type: "Data" top: "data" top: "label"
  data_param { source: "train_lmdb" batch_size: 64 backend: LMDB random_order: true } }
layer { name: "blurred" type: "ImageData" top: "blurred"
  image_data_param { source: "train.txt" batch_size: 48 new_height: 128 new_width: 128 label: false } }
"""
    net, warnings = _parse(text)
    assert net.layer[0].data_param.batch_size == 64 and net.layer[1].image_data_param.new_width == 128
    for field, why in [("random_order", "Tongcheng/caffe"), ("label", "DeBlurNet")]:
        line = [w for w in warnings if f"'{field}'" in w]
        assert len(line) == 1 and why in line[0], (field, warnings)


def test_nvcaffes_data_reading_fields_are_warnings():
    # NVIDIA/caffe's examples: threads and an in-memory cache change how records are read, not what
    text = """
layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "val_lmdb" batch_size: 2 backend: LMDB threads: 4 parser_threads: 2 cache: true shuffle: true } }
layer { name: "img" type: "ImageData" top: "img" top: "l2"
  image_data_param { source: "list.txt" batch_size: 2 threads: 4 cache: true dataset_share_per_node: 0.5 } }
"""
    net, warnings = _parse(text)
    assert net.layer[0].data_param.batch_size == 2 and net.layer[1].image_data_param.source == "list.txt"
    for field in ("threads", "parser_threads", "cache", "shuffle", "dataset_share_per_node"):
        assert any(f"'{field}'" in w and "NVCaffe's" in w for w in warnings), (field, warnings)
    # shuffling changes what a training run reads: strict for the TRAIN net
    with pytest.raises(ParseError, match="unknown field 'shuffle'"):
        _parse(text, phase="TRAIN")
    # NVCaffe's short_side resizes the images (their shape): not skipped
    with pytest.raises(ParseError, match="unknown field 'short_side'"):
        _parse(text.replace("threads: 4 cache: true dataset", "short_side: 256 dataset"))


def test_comments_that_are_not_utf8_are_skipped_like_caffe_does(tmp_path):
    good = 'name: "n"  # \u7f51\u7edc comment in GBK\n' + CONV
    (tmp_path / "gbk.prototxt").write_bytes(good.encode("gbk"))
    warnings = []
    net = read_prototxt(tmp_path / "gbk.prototxt", warnings=warnings)
    assert net.name == "n" and net.layer[0].convolution_param.num_output == 4
    assert any("not UTF-8" in w and "comments" in w for w in warnings)
    # outside a comment the bytes would change a name or a path: refused, naming the line
    (tmp_path / "bad.prototxt").write_bytes(('name: "n"\n' + CONV.replace('"conv"', '"\u7f51"', 1)).encode("gbk"))
    with pytest.raises(ParseError, match=r"bad.prototxt:3: not UTF-8 text .*outside a comment"):
        read_prototxt(tmp_path / "bad.prototxt")


def test_a_utf8_byte_order_mark_is_skipped_with_a_note(tmp_path):
    # Windows editors start files with EF BB BF; protobuf's tokenizer would stop on it
    (tmp_path / "bom.prototxt").write_bytes(b"\xef\xbb\xbf" + ('name: "n"\n' + CONV).encode("utf-8"))
    warnings = []
    net = read_prototxt(tmp_path / "bom.prototxt", warnings=warnings)
    assert net.name == "n" and net.layer[0].convolution_param.num_output == 4
    assert any("byte-order mark" in w for w in warnings)


def test_cpm_transform_param_is_data_augmentation():
    text = """layer { name: "data" type: "CPMData" top: "data" top: "label"
  data_param { source: "lmdb" batch_size: 10 backend: LMDB }
  cpm_transform_param { stride: 8 crop_size_x: 368 num_parts: 56 }
}"""
    _, warnings = _parse(text)
    assert "'cpm_transform_param'" in warnings[0] and "augmentation" in warnings[0]


def test_real_fork_files_read(tmp_path):
    """NVCaffe, Intel and CaffeOnSpark files (from corpus2, shipped as fixtures)."""
    import os
    corpus = os.path.join(os.path.dirname(__file__), "fixtures", "realworld")
    names = ["NVIDIA__caffe__models__resnet50__train_val_fp16.prototxt",
             "intel__caffe__models__intel_optimized_models__benchmark__googlenet_v3__train_val_dummydata.prototxt",
             "jay-mahadeokar__pynetbuilder__models__cifar10__resnet_110__test.prototxt"]
    for n in names:
        warnings = []
        net = read_prototxt(os.path.join(corpus, n), warnings=warnings)
        assert len(net.layer) > 10 and warnings


# -- solver files -----------------------------------------------------------------------------------

SOLVER = """test_iter: 1000
base_lr: 0.01
lr_policy: "step"
solver_mode: GPU
solver_type: SGD
fancy_fork_solver_knob: 3
net_param {
  name: "inline"
  layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
  layer {
    name: "data_train" type: "Data" top: "data" top: "label" include { phase: TRAIN }
    data_param { source: "x" batch_size: 4 } transform_param { color_jitter: 1 }
  }
  CONV
}
"""


def test_a_solver_with_net_param_gives_its_net_with_a_note():
    text = SOLVER.replace("CONV", CONV.replace("\n", "\n  "))
    net, warnings = _parse(text)
    assert net.name == "inline" and [lp.name for lp in net.layer] == ["data", "data_train", "conv"]
    joined = "\n".join(warnings)
    assert "a Caffe solver file; read the net in its net_param" in joined
    # a fork's unknown solver setting is training-only; unknown fields in the net keep the net's rules
    assert "'fancy_fork_solver_knob'" in joined and "solver setting" in joined
    assert "'color_jitter'" in joined and "t.prototxt:12" in joined and "'data_train'" in joined


def test_an_unknown_field_in_a_solvers_net_is_still_an_error():
    text = SOLVER.replace("CONV", CONV.replace("kernel_size: 3", "kernel_size: 3 kernal_pad: 1"))
    with pytest.raises(ParseError, match=r"t.prototxt:\d+:\d+: unknown field 'kernal_pad' in layer 'conv'"):
        _parse(text)


@pytest.mark.parametrize("field", ["net", "train_net", "test_net"])
def test_a_solver_naming_its_net_file_says_which_file_to_pass(field):
    text = f'{field}: "models/x/train_val.prototxt"\nbase_lr: 0.1\nmax_iter: 10\n'
    with pytest.raises(ParseError, match=rf"t.prototxt: this is a Caffe solver; its net is in another file "
                                         rf"\({field}: \"models/x/train_val.prototxt\""):
        _parse(text)


def test_a_solver_through_load(tmp_path):
    from caffeq import load
    path = tmp_path / "solver.prototxt"
    path.write_text(SOLVER.replace("CONV", CONV))
    model = load(path, random_weights=True)
    assert model.blob_shapes["conv"] == (1, 4, 6, 6)
    assert any("net_param" in w for w in model.warnings)


def test_a_solver_with_only_train_or_test_net_param_is_refused_clearly():
    text = 'base_lr: 0.1\ntest_net_param { name: "t" }\n'
    with pytest.raises(ParseError, match="solver with its nets in test_net_param; caffeq reads a solver's "
                                         "net from net_param only"):
        _parse(text)


def test_a_field_given_twice_is_read_as_protobufs_merge_with_a_note():
    # alexgkendall/caffe-segnet's examples/segnet/deploy.prototxt names the net twice; Caffe's text
    # parser refuses that, the file's meaning is plain: the later value wins, as protobuf's merge reads it
    text = """name: "segnet"
name: "segnet"
layer { name: "c" type: "Convolution" bottom: "data" top: "c"
  convolution_param { num_output: 4 kernel_size: 3 }
  convolution_param { num_output: 8 pad: 1 }
  pooling_param { pool: AVE }
  pooling_param { pool: MAX } }
"""
    net, warnings = _parse(text)
    conv = net.layer[0].convolution_param
    assert net.name == "segnet" and (conv.num_output, list(conv.kernel_size), list(conv.pad)) == (8, [3], [1])
    assert net.layer[0].pooling_param.pool == net.layer[0].pooling_param.MAX
    assert warnings == [
        "t.prototxt:2: NetParameter sets 'name' a second time to the same value (Caffe's parser refuses a field "
        "given twice)",
        "t.prototxt:5: LayerParameter sets 'convolution_param' a second time; the two blocks are merged, later "
        "fields winning (Caffe's parser refuses a field given twice)",
        "t.prototxt:5: ConvolutionParameter sets 'num_output' a second time (4, then 8); the later value is kept "
        "(Caffe's parser refuses a field given twice)",
        "t.prototxt:7: LayerParameter sets 'pooling_param' a second time; the two blocks are merged, later fields "
        "winning (Caffe's parser refuses a field given twice)",
        "t.prototxt:7: PoolingParameter sets 'pool' a second time (AVE, then MAX); the later value is kept "
        "(Caffe's parser refuses a field given twice)"]


def test_typographic_quotes_and_v1_type_names_read_with_notes(tmp_path):
    # abhisw/object_identification_caffe's train_test: “Face”, "norm1” and `type: DROPOUT` in layer blocks
    path = tmp_path / "q.prototxt"
    path.write_text('name: \u201cnet\u201d   # a \u201ccomment\u201d stays\n'
                    'layer { name: "drop1\u201d type: DROPOUT bottom: "x" top: "x" }\n'
                    'layer { name: "s" type: "Softmax" bottom: "x" top: "y" include { stage: "\u201cq\u201d" } }\n')
    warnings = []
    net = read_prototxt(path, warnings=warnings)
    assert net.name == "net" and (net.layer[0].name, net.layer[0].type) == ("drop1", "Dropout")
    assert list(net.layer[1].include[0].stage) == ["\u201cq\u201d"]   # inside a string: the string's own
    assert warnings == [
        f"{path}:1: typographic quotes (\u201c \u201d) read as plain ones (lines 1, 2); Caffe's parser "
        f"refuses them",
        f"{path}:2: the V1 layer type DROPOUT in a 'layer' block read as \"Dropout\" (Caffe's parser refuses it)"]


def test_a_saved_web_page_is_named_as_one(tmp_path):
    path = tmp_path / "deploy.prototxt"
    path.write_text("\n\n<!DOCTYPE html>\n<html lang=\"en\">\n")
    with pytest.raises(ParseError, match=r"deploy.prototxt: an HTML page, not a prototxt \(a web page saved in "
                                         r"place of the raw file\?\)$"):
        read_prototxt(path)


def test_current_format_layers_under_the_legacy_name_read_with_a_note():
    # ginobilinie/infantSeg: `layers { type: "BatchNorm" param { lr_mult: 0 } }` among `layer` blocks
    text = ('layer { name: "c" type: "ReLU" bottom: "x" top: "y" }\n'
            'layers { bottom: "y" top: "z" name: "bn"\n  type: "BatchNorm" param { lr_mult: 0 } }\n'
            'layers { name: "old" type: RELU bottom: "z" top: "z" }\n')
    warnings = []
    net = parse_prototxt_text(text, path="t.prototxt", warnings=warnings)
    assert [(lp.name, lp.type) for lp in net.layer] == [("c", "ReLU"), ("bn", "BatchNorm"), ("old", "ReLU")]
    assert net.layer[1].param[0].lr_mult == 0
    assert warnings == ["t.prototxt: mixes 'layer' blocks with 1 legacy V1 'layers' block(s), which Caffe refuses "
                        "to upgrade; read the V1 ones upgraded where they stand",
                        "t.prototxt: 1 'layers' block(s) hold a current-format layer (a quoted type string); "
                        "read as 'layer' blocks (Caffe's parser refuses them)"]



def test_v1_layers_blocks_with_quoted_types_read_as_v1_where_they_set_v1_fields():
    # qxcv/joint-regressor's l1-vggnet train_val: `layers { type: "Convolution" ... blobs_lr: 0 }`
    # beside `layer` blocks: blobs_lr is V1's own field, so the block is V1 with its type quoted
    text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 1 dim: 4 dim: 4 } } }\n'
            'layers { bottom: "x" top: "c" name: "c" type: "Convolution"\n'
            '  convolution_param { num_output: 2 kernel_size: 3 } blobs_lr: 0 blobs_lr: 2 weight_decay: 1 }\n'
            'layers { bottom: "c" top: "c" name: "r" type: "ReLU" }\n')
    warnings = []
    net = parse_prototxt_text(text, path="t.prototxt", warnings=warnings)
    assert [(lp.name, lp.type) for lp in net.layer] == [("in", "Input"), ("c", "Convolution"), ("r", "ReLU")]
    assert [p.lr_mult for p in net.layer[1].param] == [0, 2] and net.layer[1].param[0].decay_mult == 1
    assert any("1 V1 'layers' block(s) (blobs_lr, weight_decay) give their type as a quoted string" in w
               for w in warnings)
    assert any("1 'layers' block(s) hold a current-format layer" in w for w in warnings)
    assert load_from_text(text).blob_shapes["c"] == (1, 2, 2, 2)


RECASED = """
input: "x" input_shape { dim: 2 dim: 3 dim: 9 dim: 7 }
layer { name: "c" type: "{conv}" bottom: "x" top: "c" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "r1" type: "{relu}" bottom: "c" top: "c" relu_param {{ negative_slope: 0.1 }} }
layer { name: "p" type: "Pooling" bottom: "c" top: "p" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "r2" type: "{relu}" bottom: "p" top: "q" }
"""


def _recased(conv, relu):
    return RECASED.replace("{conv}", conv).replace("{relu}", relu).replace("{{", "{").replace("}}", "}")


def test_a_known_type_in_other_capitals_reads_as_that_type_with_a_note(tmp_path):
    # ydas/caffe-yolo's yolo.prototxt writes `type: "Relu"` 24 times; Caffe's registry is case-sensitive
    path = tmp_path / "yolo.prototxt"
    path.write_text(_recased("convolution", "Relu"))
    model = caffeq.load(path, random_weights=True, seed=5)
    same = load_from_text(_recased("Convolution", "ReLU"), random_weights=True, seed=5)
    assert [n.type for n in model.layers] == [n.type for n in same.layers] == \
        ["Input", "Convolution", "ReLU", "Pooling", "ReLU"]
    assert [w for w in model.warnings if "case-sensitive" in w] == [
        f"{path}: layer type 'convolution' read as Convolution (Caffe's layer registry is case-sensitive and "
        f"refuses it): 1 layer(s), 'c'",
        f"{path}: layer type 'Relu' read as ReLU (Caffe's layer registry is case-sensitive and refuses it): "
        f"2 layer(s), 'r1', 'r2'"]
    x = np.random.default_rng(1).standard_normal((2, 3, 9, 7)).astype(np.float32)
    got, want = model.run({"x": x}), same.run({"x": x})
    assert got["q"].shape == (2, 4, 4, 3)
    np.testing.assert_array_equal(got["q"], want["q"])
    assert model.layers[2].attrs == same.layers[2].attrs    # the leaky ReLU kept its slope


def test_a_type_two_known_types_differ_from_by_case_alone_stays_refused(tmp_path):
    # BVLC's LSTM and CTPN's Lstm: `lstm` could be either
    path = tmp_path / "n.prototxt"
    path.write_text('input: "x" input_shape { dim: 2 dim: 1 dim: 3 }\n'
                    'layer { name: "l" type: "lstm" bottom: "x" top: "y" }\n')
    with pytest.raises(UnsupportedLayerError, match=r"unsupported layer types: lstm \(layers 'l', did you mean"):
        caffeq.load(path, random_weights=True)


@pytest.mark.parametrize("written, meant", [("num_ouput", "num_output"), ("Num_Output", "num_output")])
def test_an_unknown_field_spelt_like_a_known_one_says_which(written, meant):
    text = f'layer {{ name: "c" type: "Convolution" convolution_param {{ {written}: 2 kernel_size: 3 }} }}'
    with pytest.raises(ParseError, match=rf"unknown field '{written}' in layer 'c' \(message caffe.ConvolutionParameter "
                                         rf"has no field '{written}'; did you mean '{meant}'\?\); pass --ignore-unknown"):
        parse_prototxt_text(text, path="t.prototxt")


def test_a_short_field_one_letter_off_says_which(tmp_path):
    # toUpperCase78/opencv-hpe's MPI pose net as stored: its first line lost the i of `input`
    path = tmp_path / "pose.prototxt"
    path.write_text('nput: "image"\ninput_dim: 1\ninput_dim: 3\ninput_dim: 8\ninput_dim: 8\n')
    with pytest.raises(ParseError, match=r"unknown field 'nput' \(message caffe.NetParameter has no field 'nput'; "
                                         r"did you mean 'input'\?\)"):
        caffeq.load(path, random_weights=True)


def test_an_unknown_field_far_from_every_known_one_names_none():
    # a hobby Caffe's inner_param: as near to interp_param as to inner_product_param, so neither is offered
    with pytest.raises(ParseError, match=r"has no field 'inner_param'\); pass --ignore-unknown"):
        parse_prototxt_text('layer { name: "ip" type: "InnerProduct" inner_param { num_output: 2 } }', path="t.prototxt")


REGION_SELECT = """
input: "data" input_shape { dim: 1 dim: 2 dim: 4 dim: 4 }
input: "label" input_shape { dim: 1 dim: 1 dim: 4 dim: 4 }
layer { name: "score" type: "Softmax" bottom: "data" top: "score" }
layer { name: "region_pos" type: "RegionSelect" bottom: "score" top: "regions" include { phase: TEST }
        regionselect_param { area_min: 3300 area_max: 30000 max_count: 32 } }
layer { name: "accuracy_iou" type: "AccuracyIOU" bottom: "regions" bottom: "label" top: "iou" include { phase: TEST }
        accuracy_iou_param { iou_threshold: 50 } }
"""


def test_a_test_only_layer_read_only_by_a_scorer_is_dropped_with_it():
    # XmBrain/Quantizer's ive_exp1: RegionSelect post-processes the scores for AccuracyIOU alone
    model = load_from_text(REGION_SELECT)
    assert [n.name for n in model.layers] == ["input", "score"]
    assert any("dropped 2 training-only layer(s) that inference does not use: region_pos (RegionSelect), "
               "accuracy_iou (AccuracyIOU)" in w for w in model.warnings)
    # one that the net's output comes from is not: it is refused as an unknown type
    with pytest.raises(UnsupportedLayerError, match="RegionSelect"):
        load_from_text(REGION_SELECT.split('layer { name: "accuracy_iou"')[0])


AUTOENCODER = """name: "ae"
layer { name: "data" type: "HDF5Data" top: "data" include { phase: TEST stage: "test-on-train" }
        hdf5_data_param { source: "list.txt" batch_size: 2 } }
layer { name: "enc" type: "InnerProduct" bottom: "data" top: "code" inner_product_param { num_output: 3 } }
layer { name: "dec" type: "InnerProduct" bottom: "code" top: "out" inner_product_param { num_output: 6 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "data" top: "l2" }
"""


def test_a_loss_reading_the_nets_own_input_is_not_a_kept_scorer():
    # yeungalan0/Minecraft_AI's autoencoders: the loss compares the decoding with the data, which exists only
    # under a stage; 'data' is the net's input (the encoder reads it), not a label a deploy file lacks: the
    # error names the rule (inspect then shows the net under it) instead of dropping every layer
    from caffeq.errors import PhaseRuleError
    with pytest.raises(PhaseRuleError, match="bottom 'data' is not produced .* stage: \"test-on-train\""):
        load_from_text(AUTOENCODER)
    model = load_from_text(AUTOENCODER, stages=("test-on-train",), input_shapes={"data": (2, 6)})
    assert model.blob_shapes["out"] == (2, 6)
    assert [n.name for n in model.graph.nodes][-1] == "loss"


def test_a_deploy_file_that_kept_its_fork_loss_and_accuracy_without_the_label():
    # both scorers read 'label', which the deploy file does not make: dropped, the net whole without them
    text = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }\n'
            'layer { name: "fc" type: "InnerProduct" bottom: "x" top: "fc" inner_product_param { num_output: 4 } }\n'
            'layer { name: "loss" type: "ForkMarginLoss" bottom: "fc" bottom: "label" top: "loss" }\n'
            'layer { name: "acc" type: "Accuracy" bottom: "fc" bottom: "label" top: "acc" }')
    model = load_from_text(text)
    assert model.outputs == ["fc"]


def test_cadstn_recurrent_freeze_is_a_training_setting():
    # weleen/CADSTN.caffe's hand_mix: `fix_parameters: true` on its LSTM (its Caffe is not public)
    lstm = """input: "x" input_shape { dim: 3 dim: 2 dim: 4 }
input: "cont" input_shape { dim: 3 dim: 2 }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
  recurrent_param { num_output: 5 fix_parameters: true } }
"""
    net, warnings = _parse(lstm)
    assert net.layer[0].recurrent_param.num_output == 5
    assert any("'fix_parameters'" in w and "CADSTN's freeze of the recurrent weights" in w for w in warnings)
    with pytest.raises(ParseError, match="fix_parameters"):
        _parse(lstm, phase="TRAIN")


AUGMENTED = """name: "aug"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 5 dim: 4 } shape { dim: 2 } } }
layer { name: "aug" type: "Python" bottom: "data" top: "data" python_param { module: "augdata" layer: "AugDataLayer" } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc" inner_product_param { num_output: 5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


def test_an_unknown_layer_transforming_the_batch_is_refused_not_dropped_with_the_net():
    # bdutta19/kaggle_statefarm's model_aug, choosehappy's *.deploy.w.aug: a Python augmentation layer on the data
    # feeds the whole net, which ends in a loss; dropping it as training-only left the data layer alone
    with pytest.raises(UnsupportedLayerError, match="layer 'aug' is a Python layer .module 'augdata'"):
        load_from_text(AUGMENTED)
    # ORION's CreateDeformation (no bottoms) feeding ApplyDeformation, which reads the batch: both refused
    orion = AUGMENTED.replace(
        'layer { name: "aug" type: "Python" bottom: "data" top: "data" python_param { module: "augdata" '
        'layer: "AugDataLayer" } }',
        'layer { name: "augment" type: "CreateDeformation" top: "def" include { phase: TEST } }\n'
        'layer { name: "apply" type: "ApplyDeformation" bottom: "data" bottom: "def" top: "data" }')
    with pytest.raises(UnsupportedLayerError, match="ApplyDeformation .layers 'apply'.*CreateDeformation"):
        load_from_text(orion)
    # CAFFE-DACH's HGAN: GANGate mixes the batch with the generator's output (here with the label too) for the
    # discriminator, whose branch only trains: dropped with that branch, the generator kept
    gan = AUGMENTED.replace(
        'layer { name: "aug" type: "Python" bottom: "data" top: "data" python_param { module: "augdata" '
        'layer: "AugDataLayer" } }',
        'layer { name: "gen" type: "Convolution" bottom: "data" top: "fake" convolution_param { num_output: 3 '
        'kernel_size: 1 } }\nlayer { name: "gate" type: "GANGate" bottom: "data" bottom: "fake" bottom: "label" '
        'top: "data_gated" }'
    ).replace('bottom: "data" top: "conv"', 'bottom: "data_gated" top: "conv"')
    model = load_from_text(gan)
    assert [n.name for n in model.layers] == ["data", "gen"]
    # a Python layer computing training targets from the label is still dropped (Faster R-CNN's AnchorTarget)
    targets = AUGMENTED.replace('bottom: "data" top: "data" python_param { module: "augdata"',
                                'bottom: "label" top: "target" python_param { module: "targets"').replace(
        'bottom: "fc" bottom: "label"', 'bottom: "fc" bottom: "target"')
    model = load_from_text(targets)
    assert model.blob_shapes["fc"] == (2, 5)
    # ParseNet's VOC nets read the label with a data layer of its own: that batch is a label, and the
    # evaluation layer of the fork that reads it is still dropped as a scorer
    parsenet = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 4 } } }\n'
                'layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 2 dim: 1 dim: 5 dim: 4 } } }\n'
                'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
                'convolution_param { num_output: 4 kernel_size: 1 } }\n'
                'layer { name: "evaluation" type: "ParseEvaluate" bottom: "conv" bottom: "label" top: "evaluation" }\n')
    model = load_from_text(parsenet)
    assert [n.name for n in model.layers] == ["data", "label", "conv"]


STAGED = """name: "staged"
layer { name: "train-data" type: "Data" top: "data" top: "label" include { stage: "train" }
        data_param { source: "train_lmdb" batch_size: 2 } }
layer { name: "val-data" type: "Data" top: "data" top: "label" include { stage: "val" }
        data_param { source: "val_lmdb" batch_size: 2 } }
layer { name: "aug" type: "Python" bottom: "data" bottom: "label" top: "data" top: "label" include { stage: "train" }
        python_param { module: "digits" layer: "Augment" } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 5 } }
"""


def test_the_stage_named_for_evaluation_is_proposed_before_training():
    # NVIDIA-AI-IOT/redtail's srelu-resnet-18: data only under stage "train" (with a Python augmentation layer)
    # or "val"; the error names "val", under which the net reads without the augmentation
    from caffeq.errors import PhaseRuleError
    with pytest.raises(PhaseRuleError, match="layer 'val-data' makes it, but only under include { stage: \"val\" }"):
        load_from_text(STAGED)
    model = load_from_text(STAGED, stages=("val",), input_shapes={"data": (2, 3, 4, 4)})
    assert model.blob_shapes["fc"] == (2, 5)


def test_a_net_that_would_lose_every_weighted_layer_names_the_unknown_layers_instead():
    # strawberryfg's 3dhuman training nets: the image comes from an unpublished GenUnifiedDataAndLabel that reads
    # blobs derived from the label by other unpublished layers; dropping those as training-only took all 299
    # convolutions with them and listed a net of its data layers alone
    text = ('layer { name: "data" type: "Input" top: "data" top: "label" '
            'input_param { shape { dim: 2 dim: 3 dim: 5 dim: 4 } shape { dim: 2 } } }\n'
            'layer { name: "gt" type: "Convert2D" bottom: "label" top: "gt" }\n'
            'layer { name: "gen" type: "GenUnifiedData" bottom: "data" bottom: "gt" top: "image" }\n'
            'layer { name: "conv" type: "Convolution" bottom: "image" top: "conv" '
            'convolution_param { num_output: 4 kernel_size: 3 } }\n'
            'layer { name: "loss" type: "EuclideanLoss" bottom: "conv" bottom: "gt" top: "loss" }\n')
    with pytest.raises(UnsupportedLayerError, match="Convert2D .layers 'gt'.*GenUnifiedData .layers 'gen'"):
        load_from_text(text)


def test_a_python_data_layers_top_that_the_net_computes_from_is_an_input():
    # doubledaibo/drnet: a Python data layer gives qa, qb, im, posdata and labels; the image branch on 'im' (its
    # third top) was taken for a computation on labels and dropped with its 56 layers.  A top that only an
    # unknown sampler and losses read stays a label (SubCNN's info_boxes), as does one named as a label
    text = ('layer { name: "data" type: "Python" top: "qa" top: "im" top: "boxes" top: "labels" '
            'python_param { module: "data_layer" layer: "DataLayer" } }\n'
            'layer { name: "conv" type: "Convolution" bottom: "im" top: "conv" '
            'convolution_param { num_output: 4 kernel_size: 3 } }\n'
            'layer { name: "fc_q" type: "InnerProduct" bottom: "qa" top: "fc_q" inner_product_param { num_output: 2 } }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "conv" bottom: "labels" top: "loss" }\n')
    shapes = {"qa": (2, 3), "im": (2, 3, 6, 5), "boxes": (2, 4), "labels": (2, 1, 4, 3)}
    model = load_from_text(text, input_shapes=shapes)
    assert {n.name for n in model.layers} >= {"conv", "fc_q"}
    assert model.blob_shapes["conv"] == (2, 4, 4, 3)
    sampler = text.replace('layer { name: "fc_q" type: "InnerProduct" bottom: "qa" top: "fc_q" '
                           'inner_product_param { num_output: 2 } }',
                           'layer { name: "roi" type: "ROIGenerating" bottom: "boxes" top: "rois" }\n'
                           'layer { name: "l2" type: "EuclideanLoss" bottom: "rois" bottom: "boxes" top: "l2" }')
    model = load_from_text(sampler, input_shapes=shapes)
    names = [n.name for n in model.layers]
    assert "conv" in names and "roi" not in names and "l2" not in names
