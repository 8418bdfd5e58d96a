"""Legacy format upgrade (caffeq.io.upgrade) by BVLC Caffe's rules, and `caffeq upgrade`."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, REPO, Case, assert_close
from google.protobuf import text_format

import caffeq
from caffeq.errors import ParseError
from caffeq.io.caffemodel import BlobData, read_caffemodel
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.schema import caffe_pb2
from caffeq.io.upgrade import net_needs_upgrade, upgrade_net
from caffeq.model import load_from_text

V1_CASE = Case(FIXTURES / "legacy_v1_layers")
HEADER_CASE = Case(FIXTURES / "legacy_input_dim_header")


def parse(text):
    return parse_prototxt_text(text)


def upgraded(text, source="test.prototxt"):
    net = parse(text)
    notes = upgrade_net(net, source=source)
    return net, notes


# -- the reference cases ---------------------------------------------------------------

def _without_phase(net):
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    for lp in out.layer:
        lp.ClearField("phase")
    return out


@pytest.mark.parametrize("case", [V1_CASE, HEADER_CASE], ids=lambda c: c.name)
def test_legacy_prototxt_upgrades_to_the_net_caffe_saved(case):
    # legacy_input_dim_header's caffemodel is Caffe's own Net::ToProto of the upgraded
    # net (only `phase: TEST` added per layer): our upgrade must produce the same layers.
    net, notes = upgraded(Path(case.prototxt).read_text(), case.prototxt)
    caffe_saved = read_caffemodel(HEADER_CASE.weights).net
    assert len(net.layers) == 0 and len(net.input) == 0 and len(net.input_dim) == 0
    assert _without_phase(caffe_saved) == net
    assert any("Input layer" in n for n in notes)


def test_v1_case_loads_like_its_v2_twin():
    v1 = V1_CASE.load()
    v2 = HEADER_CASE.load()
    assert [(n.name, n.type, n.bottoms, n.tops, n.inputs, n.outputs) for n in v1.layers] == \
           [(n.name, n.type, n.bottoms, n.tops, n.inputs, n.outputs) for n in v2.layers]
    assert v1.layers[0].type == "Input" and v1.layers[0].name == "input"
    assert v1.blob_shapes == v2.blob_shapes
    assert {k: tuple(v) for k, v in v1.blob_shapes.items()} == \
           {k: tuple(v) for k, v in V1_CASE.meta["blob_shapes"].items()}
    p1, p2 = v1.params, v2.params
    assert p1.keys() == p2.keys() == {"conv1", "conv2", "fc6", "fc8"}
    for name in p1:
        for a, b in zip(p1[name], p2[name]):
            assert a.shape == b.shape and np.array_equal(a, b)
    out1 = v1.run(V1_CASE.inputs)
    out2 = v2.run(HEADER_CASE.inputs)
    np.testing.assert_array_equal(out1["prob"], out2["prob"])
    atol, rtol = V1_CASE.tolerance
    assert_close(out1["prob"], V1_CASE.outputs["prob"], atol, rtol, "legacy_v1_layers/prob")


def test_v1_caffemodel_upgrade_keeps_weights_by_name():
    cm = read_caffemodel(V1_CASE.weights)
    before = {k: [b.array for b in v] for k, v in cm.blobs.items()}
    notes = upgrade_net(cm.net, source=V1_CASE.weights, weights=cm.blobs)
    assert [lp.name for lp in cm.net.layer][:3] == ["input", "conv1", "relu1"]
    assert cm.net.layer[1].type == "Convolution" and cm.net.layer[7].type == "InnerProduct"
    assert {k: [b.array for b in v] for k, v in cm.blobs.items()} == before
    assert notes and len(cm.net.layers) == 0


# -- V0 ----------------------------------------------------------------------------------

V0_TEXT = """
name: "v0net"
input: "data"
input_dim: 2 input_dim: 3 input_dim: 9 input_dim: 7
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers {
  layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 3 stride: 2 group: 1
          weight_filler { type: "gaussian" std: 0.01 } bias_filler { type: "constant" value: 0.1 }
          blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0 }
  bottom: "pad1" top: "conv1" }
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers { layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.0002 beta: 0.75 k: 2 }
         bottom: "conv1" top: "norm1" }
layers { layer { name: "pad2" type: "padding" pad: 1 } bottom: "norm1" top: "pad2" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 3 stride: 2 }
         bottom: "pad2" top: "pool1" }
layers { layer { name: "fc1" type: "innerproduct" num_output: 6 biasterm: false }
         bottom: "pool1" top: "fc1" }
layers { layer { name: "drop1" type: "dropout" dropout_ratio: 0.25 } bottom: "fc1" top: "fc1" }
layers { layer { name: "prob" type: "softmax" } bottom: "fc1" top: "prob" }
"""

# Written by hand from upgrade_proto.cpp's rules: padding folded into conv1/pool1,
# blobs_lr/weight_decay -> ParamSpec, V0 names -> V2 types, input_dim -> Input layer first.
V0_EXPECTED = """
name: "v0net"
layer { name: "input" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 3 dim: 9 dim: 7 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 4 pad: 2 kernel_size: 3 group: 1 stride: 2
                            weight_filler { type: "gaussian" std: 0.01 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
        lrn_param { local_size: 3 alpha: 0.0002 beta: 0.75 k: 2 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
        pooling_param { pool: AVE pad: 1 kernel_size: 3 stride: 2 } }
layer { name: "fc1" type: "InnerProduct" bottom: "pool1" top: "fc1"
        inner_product_param { num_output: 6 bias_term: false } }
layer { name: "drop1" type: "Dropout" bottom: "fc1" top: "fc1" dropout_param { dropout_ratio: 0.25 } }
layer { name: "prob" type: "Softmax" bottom: "fc1" top: "prob" }
"""


def test_v0_net_upgrades_to_expected_v2_layers():
    net, notes = upgraded(V0_TEXT)
    assert net == parse(V0_EXPECTED), text_format.MessageToString(net)
    joined = "\n".join(notes)
    assert "folded 2 V0 padding layer(s)" in joined
    assert "V0 layers to V1" in joined and "V1 'layers'" in joined


def _v0_weights(rng):
    return {"conv1": [rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                      rng.standard_normal(4).astype(np.float32)],
            "fc1": [rng.standard_normal((6, 48)).astype(np.float32)]}


def _legacy_blob(bp, arr):
    """Fill a BlobProto the way V0-era Caffe did: num/channels/height/width, 4-D padded with 1s."""
    shape = (1,) * (4 - arr.ndim) + arr.shape
    bp.num, bp.channels, bp.height, bp.width = shape
    bp.data.extend(arr.ravel().tolist())


def write_v0_caffemodel(path, weights):
    """A V0 caffemodel built with protobuf itself (independent of caffeq's writer)."""
    net = parse(V0_TEXT)
    net.ClearField("input_dim")  # old caffemodels name their inputs without shapes
    for entry in net.layers:
        for arr in weights.get(entry.layer.name, []):
            _legacy_blob(entry.layer.blobs.add(), arr)
    with open(path, "wb") as f:
        f.write(net.SerializeToString())


def _numpy_conv_relu(x, w, b, pad, stride):
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, _, h, wd = xp.shape
    k = w.shape[2]
    oh, ow = (h - k) // stride + 1, (wd - k) // stride + 1
    out = np.zeros((n, w.shape[0], oh, ow), np.float64)
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            out[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w) + b
    return np.maximum(out, 0)


def test_v0_net_with_v0_caffemodel_runs(tmp_path):
    rng = np.random.default_rng(3)
    weights = _v0_weights(rng)
    proto = tmp_path / "v0.prototxt"
    proto.write_text(V0_TEXT)
    model_file = tmp_path / "v0.caffemodel"
    write_v0_caffemodel(model_file, weights)

    model = caffeq.load(proto, model_file)
    assert [n.type for n in model.layers] == ["Input", "Convolution", "ReLU", "LRN", "Pooling",
                                              "InnerProduct", "Dropout", "Softmax"]
    # shapes by hand: conv pad 2 k3 s2 on 9x7 -> 6x5; AVE pool pad 1 k3 s2 (ceil) -> 4x3
    assert model.blob_shapes["conv1"] == (2, 4, 6, 5)
    assert model.blob_shapes["pool1"] == (2, 4, 4, 3)
    assert model.blob_shapes["prob"] == (2, 6)
    for name, arrays in weights.items():
        for got, ref in zip(model.params[name], arrays):
            np.testing.assert_array_equal(got, ref)

    x = rng.standard_normal((2, 3, 9, 7)).astype(np.float32)
    out = model.run(x, all_blobs=True)
    # the folded padding is in effect: conv1 (after the in-place ReLU) equals a numpy conv with pad 2
    ref = _numpy_conv_relu(x.astype(np.float64), weights["conv1"][0], weights["conv1"][1], 2, 2)
    assert_close(out["conv1"], ref, 1e-5, 1e-5, "v0/conv1")
    np.testing.assert_allclose(out["prob"].sum(1), 1.0, rtol=1e-6)

    # the same weights in the hand-written V2 net give the same outputs
    v2 = tmp_path / "v2.prototxt"
    v2.write_text(V0_EXPECTED)
    twin = caffeq.load(v2, random_weights=True)
    for node in twin.layers:
        if node.name in weights:
            node.blobs = [a.reshape(s) for a, s in zip(weights[node.name], node.expected_param_shapes)]
    np.testing.assert_array_equal(twin.run(x, exact=True)["prob"], out["prob"])   # both layer by layer


def test_v0_weights_rekeyed_and_padding_dropped():
    net = parse("""
      input: "data"
      layers { name: "outer" layer { name: "inner" type: "conv" num_output: 2 kernelsize: 1 }
               bottom: "pad" top: "c" }
      layers { layer { name: "pad" type: "padding" pad: 1 } bottom: "data" top: "pad" }
    """)
    # blob consumer comes before its producer here: Caffe dies on the unknown blob
    with pytest.raises(ParseError, match="reads blob 'pad'"):
        upgrade_net(net, source="m.caffemodel")

    net = parse("""
      input: "data"
      layers { layer { name: "pad" type: "padding" pad: 1 } bottom: "data" top: "pad" }
      layers { name: "outer" layer { name: "inner" type: "conv" num_output: 2 kernelsize: 1 }
               bottom: "pad" top: "c" }
    """)
    w = [BlobData(np.ones((2, 1, 1, 1), np.float32)), BlobData(np.zeros(2, np.float32))]
    weights = {"pad": [], "outer": w}
    upgrade_net(net, source="m.caffemodel", weights=weights)
    assert weights == {"inner": w}
    assert [lp.name for lp in net.layer] == ["inner"]
    assert list(net.layer[0].bottom) == ["data"]
    assert list(net.layer[0].convolution_param.pad) == [1]


def test_v0_errors_name_the_file():
    with pytest.raises(ParseError, match=r"old\.prototxt: layer 'x': unknown V0 layer type 'warp'"):
        upgraded('input: "d" layers { layer { name: "x" type: "warp" } bottom: "d" top: "y" }',
                 "old.prototxt")
    with pytest.raises(ParseError, match=r"old\.prototxt: padding layer 'p' feeds layer 'r'"):
        upgraded('input: "d" layers { layer { name: "p" type: "padding" pad: 1 } bottom: "d" top: "q" }'
                 'layers { layer { name: "r" type: "relu" } bottom: "q" top: "q" }', "old.prototxt")
    with pytest.raises(ParseError, match="reads blob 'nowhere'"):
        upgraded('layers { layer { name: "r" type: "relu" } bottom: "nowhere" top: "q" }')


def test_v0_field_meaningless_for_type_is_dropped_with_a_note():
    net, notes = upgraded('input: "d" input_dim: 1 input_dim: 1 input_dim: 1 input_dim: 1 '
                          'layers { layer { name: "r" type: "relu" num_output: 3 } bottom: "d" top: "d" }')
    assert net.layer[1].type == "ReLU" and not net.layer[1].HasField("convolution_param")
    assert any("layer 'r'" in n and "num_output" in n for n in notes)


def test_v0_data_layer_fields():
    net, _ = upgraded("""
      layers { layer { name: "d" type: "data" source: "train_db" batchsize: 64 scale: 0.5
                       meanfile: "m.binaryproto" cropsize: 20 mirror: true rand_skip: 3 }
               top: "data" top: "label" }
      layers { layer { name: "w" type: "window_data" source: "w.txt" det_fg_threshold: 0.6
                       det_crop_mode: "square" det_context_pad: 16 } top: "wd" top: "wl" }
      layers { layer { name: "c" type: "concat" concat_dim: 0 } bottom: "data" bottom: "wd" top: "c" }
    """)
    assert net == parse("""
      layer { name: "d" type: "Data" top: "data" top: "label"
              transform_param { scale: 0.5 mean_file: "m.binaryproto" crop_size: 20 mirror: true }
              data_param { source: "train_db" batch_size: 64 rand_skip: 3 } }
      layer { name: "w" type: "WindowData" top: "wd" top: "wl"
              window_data_param { source: "w.txt" fg_threshold: 0.6 crop_mode: "square"
                                  context_pad: 16 } }
      layer { name: "c" type: "Concat" bottom: "data" bottom: "wd" top: "c" concat_param { concat_dim: 0 } }
    """)


# -- V1 ----------------------------------------------------------------------------------

V1_TEXT = """
name: "v1net"
input: "img"
input_shape { dim: 2 dim: 3 dim: 8 dim: 8 }
input: "aux"
input_shape { dim: 2 dim: 5 }
layers { name: "data" type: DATA top: "d" top: "label" include { phase: TRAIN }
         data_param { source: "x_lmdb" batch_size: 4 scale: 0.00390625 mean_file: "mean.binaryproto"
                      crop_size: 6 mirror: true } }
layers { name: "images" type: IMAGE_DATA top: "i" top: "il" include { phase: TRAIN }
         image_data_param { source: "list.txt" scale: 2 } }
layers { name: "conv" type: CONVOLUTION bottom: "img" top: "conv"
         blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0 param: "cw" param: "cb"
         blob_share_mode: PERMISSIVE convolution_param { num_output: 2 kernel_size: 3 } }
layers { name: "conv_b" type: CONVOLUTION bottom: "img" top: "conv_b" param: "cw" param: "cb"
         convolution_param { num_output: 2 kernel_size: 3 } }
layers { name: "sum" type: ELTWISE bottom: "conv" bottom: "conv_b" top: "sum"
         eltwise_param { operation: SUM coeff: 1 coeff: -1 } }
layers { name: "flat" type: FLATTEN bottom: "sum" top: "flat" }
layers { name: "cat" type: CONCAT bottom: "flat" bottom: "aux" top: "cat" concat_param { axis: 1 } }
layers { name: "loss" type: SOFTMAX_LOSS bottom: "cat" bottom: "label" top: "loss" loss_weight: 0.5
         include { phase: TRAIN } }
layers { name: "thr" type: THRESHOLD bottom: "cat" top: "thr" threshold_param { threshold: 0.1 }
         exclude { phase: TRAIN } }
"""

V1_EXPECTED = """
name: "v1net"
layer { name: "input" type: "Input" top: "img" top: "aux"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 dim: 5 } } }
layer { name: "data" type: "Data" top: "d" top: "label" include { phase: TRAIN }
        transform_param { scale: 0.00390625 mean_file: "mean.binaryproto" crop_size: 6 mirror: true }
        data_param { source: "x_lmdb" batch_size: 4 } }
layer { name: "images" type: "ImageData" top: "i" top: "il" include { phase: TRAIN }
        transform_param { scale: 2 } image_data_param { source: "list.txt" } }
layer { name: "conv" type: "Convolution" bottom: "img" top: "conv"
        param { name: "cw" share_mode: PERMISSIVE lr_mult: 1 decay_mult: 1 }
        param { name: "cb" lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 2 kernel_size: 3 } }
layer { name: "conv_b" type: "Convolution" bottom: "img" top: "conv_b"
        param { name: "cw" } param { name: "cb" }
        convolution_param { num_output: 2 kernel_size: 3 } }
layer { name: "sum" type: "Eltwise" bottom: "conv" bottom: "conv_b" top: "sum"
        eltwise_param { operation: SUM coeff: 1 coeff: -1 } }
layer { name: "flat" type: "Flatten" bottom: "sum" top: "flat" }
layer { name: "cat" type: "Concat" bottom: "flat" bottom: "aux" top: "cat" concat_param { axis: 1 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "cat" bottom: "label" top: "loss" loss_weight: 0.5
        include { phase: TRAIN } }
layer { name: "thr" type: "Threshold" bottom: "cat" top: "thr" threshold_param { threshold: 0.1 }
        exclude { phase: TRAIN } }
"""


def test_v1_net_upgrades_to_expected_v2_layers():
    net, notes = upgraded(V1_TEXT)
    assert net == parse(V1_EXPECTED), text_format.MessageToString(net)
    joined = "\n".join(notes)
    assert "transform fields of 2 data layer(s)" in joined
    assert "img [2, 3, 8, 8]; aux [2, 5]" in joined


def test_v1_net_runs_with_shared_params(tmp_path):
    proto = tmp_path / "v1.prototxt"
    proto.write_text(V1_TEXT)
    model = caffeq.load(proto, random_weights=True)
    assert model.inputs == {"img": (2, 3, 8, 8), "aux": (2, 5)}
    rng = np.random.default_rng(0)
    img = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    aux = rng.standard_normal((2, 5)).astype(np.float32)
    out = model.run({"img": img, "aux": aux}, all_blobs=True)
    # conv and conv_b share both blobs (param "cw"/"cb"), so 1*conv - 1*conv_b is exactly 0
    assert np.abs(out["conv"]).max() > 0
    np.testing.assert_array_equal(out["flat"], np.zeros((2, 72), np.float32))
    np.testing.assert_array_equal(out["cat"][:, 72:], aux)
    np.testing.assert_array_equal(out["thr"], (out["cat"] > 0.1).astype(np.float32))


def test_several_inputs_with_input_dim_go_first():
    net, _ = upgraded("""
      input: "a" input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4
      input: "b" input_dim: 1 input_dim: 5 input_dim: 1 input_dim: 1
      layer { name: "c" type: "Concat" bottom: "a" bottom: "a" top: "c" }
    """)
    assert net == parse("""
      layer { name: "input" type: "Input" top: "a" top: "b"
              input_param { shape { dim: 1 dim: 2 dim: 3 dim: 4 } shape { dim: 1 dim: 5 dim: 1 dim: 1 } } }
      layer { name: "c" type: "Concat" bottom: "a" bottom: "a" top: "c" }
    """)


def test_input_header_errors():
    with pytest.raises(ParseError, match=r"h\.prototxt: 2 input\(s\) \['a', 'b'\] need 8 input_dim"):
        upgraded('input: "a" input: "b" input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4',
                 "h.prototxt")
    with pytest.raises(ParseError, match=r"h\.prototxt: 2 input\(s\).*1 input_shape"):
        upgraded('input: "a" input: "b" input_shape { dim: 1 }', "h.prototxt")


def test_shapeless_input_of_old_caffemodels_is_dropped():
    net, notes = upgraded('input: "data" layer { name: "r" type: "ReLU" bottom: "data" top: "r" }')
    assert len(net.input) == 0 and [lp.name for lp in net.layer] == ["r"]
    assert any("shapeless" in n for n in notes)


def test_shapeless_inputs_that_layers_read_take_the_input_shape():
    # OpenCV's GOTURN file (opencv_extra testdata/tracking/goturn.prototxt, as rohandubey/Object-Tracking-
    # OpenCV keeps it) names data1 and data2 with their input_dim lines commented out: Caffe drops the
    # header and then misses the blobs; caffeq reads them as inputs whose shapes the user gives
    from caffeq.errors import CaffeqError
    from caffeq.model import load_from_text
    text = ('input: "a"\ninput: "b"\ninput: "unused"\n'
            'layer { name: "s" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }')
    model = load_from_text(text, input_shapes={"a": (2, 3, 4, 5), "b": (2, 3, 4, 5)})
    assert model.inputs == {"a": (2, 3, 4, 5), "b": (2, 3, 4, 5)}
    assert any("input(s) ['a', 'b'] have no shape in the file" in w for w in model.warnings)
    a, b = (np.random.default_rng(i).standard_normal((2, 3, 4, 5)).astype(np.float32) for i in (1, 2))
    np.testing.assert_array_equal(model.run({"a": a, "b": b})["s"], a + b)
    with pytest.raises(CaffeqError, match=r"cannot tell the shape of top 'b' from the net alone \(the file gives "
                                          r"the input no shape\); give it with --input-shape b=N,C,H,W"):
        load_from_text(text, input_shapes={"a": (2, 3, 4, 5)})
    # an in-place layer reads the input before anything makes it
    in_place = text.replace('layer {', 'layer { name: "r" type: "ReLU" bottom: "a" top: "a" }\nlayer {', 1)
    model = load_from_text(in_place, input_shapes={"a": (2, 3, 4, 5), "b": (2, 3, 4, 5)})
    np.testing.assert_array_equal(model.run({"a": a, "b": b})["s"], np.maximum(a, 0) + b)


def test_an_input_layer_without_a_shape_takes_the_input_shape():
    # Caffe's InputLayer accepts no shape at all (pycaffe users reshape the blob): the user gives it
    from caffeq.model import load_from_text
    model = load_from_text('layer { name: "in" type: "Input" top: "x" }\n'
                           'layer { name: "r" type: "ReLU" bottom: "x" top: "y" }', input_shapes={"x": (1, 2, 3)})
    assert model.inputs == {"x": (1, 2, 3)} and model.blob_shapes["y"] == (1, 2, 3)


def test_c3d_v1_reads_five_input_dims_per_input():
    # facebook/C3D v1.0's Net::Init (chuckcho/C3D's conv3d_ucf101_deploy.prototxt): num, channels, length,
    # height, width
    net, notes = upgraded('input: "data" input_dim: 2 input_dim: 3 input_dim: 16 input_dim: 12 input_dim: 11 '
                          'layer { name: "r" type: "ReLU" bottom: "data" top: "r" }')
    assert list(net.layer[0].input_param.shape[0].dim) == [2, 3, 16, 12, 11]
    assert any("C3D v1.0's 5-axis inputs" in n for n in notes)
    with pytest.raises(ParseError, match=r"need 4 input_dim values \(4 per input\), got 6"):
        upgraded('input: "data" input_dim: 2 input_dim: 3 input_dim: 16 input_dim: 12 input_dim: 11 input_dim: 1')


def test_batchnorm_three_param_specs_pinned_to_zero():
    net, notes = upgraded("""
      layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
              param { name: "m" lr_mult: 1 decay_mult: 1 } param { lr_mult: 1 } param { lr_mult: 1 } }
      layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "y" param { lr_mult: 1 } }
    """)
    # BVLC master (a19357a) keeps the specs and their names, setting lr_mult = decay_mult = 0
    assert net == parse("""
      layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
              param { name: "m" lr_mult: 0 decay_mult: 0 } param { lr_mult: 0 decay_mult: 0 }
              param { lr_mult: 0 decay_mult: 0 } }
      layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "y" param { lr_mult: 1 } }
    """)
    assert any("BatchNorm" in n for n in notes)


def test_current_net_is_left_alone():
    text = (FIXTURES / "net_lenet" / "model.prototxt").read_text()
    net, notes = upgraded(text)
    assert not net_needs_upgrade(parse(text))
    assert net == parse(text) and notes == []


def test_v2_data_layer_with_deprecated_fields_gets_a_note():
    net, notes = upgraded('layer { name: "d" type: "Data" top: "x" data_param { source: "s" scale: 0.5 } }')
    assert net.layer[0].data_param.scale == 0.5 and not net.layer[0].HasField("transform_param")
    assert any("ignored by Caffe" in n and "scale" in n for n in notes)


def test_layer_and_v1_layers_together_read_in_file_order(tmp_path):
    # Caffe refuses the mix (UpgradeV1Net); files that mix them (KaijunGao's, abby621/tripletloss's)
    # mean their blocks in order: the V1 ones are upgraded where they stand, with a note
    text = ('layer { name: "a" type: "ReLU" bottom: "x" top: "x" }\n'
            'layers { name: "b" type: POWER bottom: "x" top: "x" power_param { scale: 2 } }\n'
            'layer { name: "c" type: "TanH" bottom: "x" top: "y" }\n'
            'layers { name: "d" type: DATA top: "z" data_param { source: "s" scale: 0.5 } }')
    warnings = []
    net = parse_prototxt_text(text, path="mixed.prototxt", warnings=warnings)
    assert [(lp.name, lp.type) for lp in net.layer] == [("a", "ReLU"), ("b", "Power"), ("c", "TanH"), ("d", "Data")]
    assert net.layer[1].power_param.scale == 2 and not len(net.layers)
    assert net.layer[3].transform_param.scale == 0.5   # V1's deprecated fields moved, as for a V1 net
    assert warnings == ["mixed.prototxt: mixes 'layer' blocks with 2 legacy V1 'layers' block(s), which Caffe "
                        "refuses to upgrade; read the V1 ones upgraded where they stand"]
    # V0 entries among 'layer' ones, and a mix not read from text (a binary net), stay refused
    v0 = 'layer { name: "a" type: "ReLU" bottom: "x" top: "x" } layers { layer { name: "b" type: "relu" } }'
    with pytest.raises(ParseError, match=r"mixed\.prototxt: defines both 'layer'"):
        upgraded(v0, "mixed.prototxt")
    binary = caffe_pb2.NetParameter()
    binary.layer.add(name="a", type="ReLU")
    binary.layers.add(name="b", type=caffe_pb2.V1LayerParameter.RELU)
    with pytest.raises(ParseError, match="defines both 'layer'"):
        upgrade_net(binary, source="net.caffemodel")
    p = tmp_path / "mixed.prototxt"
    p.write_text(v0)
    with pytest.raises(ParseError, match="mixed.prototxt"):
        caffeq.load(p)


# -- the CLI -------------------------------------------------------------------------------

def cli(*args):
    return subprocess.run([sys.executable, "cli.py", "upgrade", *map(str, args)], cwd=REPO,
                          check=False, capture_output=True, text=True, timeout=300)


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli_here(capsys, *args):
    """The same command in this process (each subprocess pays torch's import time)."""
    from caffeq.__main__ import main
    capsys.readouterr()
    rc = main(["upgrade", *map(str, args)])
    out = capsys.readouterr()
    return _Result(rc, out.out, out.err)


def assert_one_error_line(res, *fragments):
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("caffeq: error: "), res.stderr
    for frag in fragments:
        assert frag in lines[0], lines[0]


def test_cli_upgrades_v1_case_with_weights(tmp_path):
    out_proto, out_model = tmp_path / "new.prototxt", tmp_path / "new.caffemodel"
    res = cli(V1_CASE.prototxt, "--weights", V1_CASE.weights, "-o", out_proto,
              "--weights-out", out_model)
    assert res.returncode == 0, res.stderr
    assert "V1 'layers'" in res.stdout and str(out_proto) in res.stdout and str(out_model) in res.stdout
    new_net = parse(out_proto.read_text())
    assert len(new_net.layers) == 0 and new_net.layer[0].type == "Input"
    # protobuf reads the new binary: V2 layers carrying their blobs
    full = caffe_pb2.NetParameter()
    full.ParseFromString(out_model.read_bytes())
    assert len(full.layers) == 0 and full.layer[1].name == "conv1" and len(full.layer[1].blobs) == 2
    assert list(full.layer[1].blobs[0].shape.dim) == [12, 3, 5, 5]
    # and the upgraded pair gives Caffe's numbers
    model = caffeq.load(out_proto, out_model)
    atol, rtol = V1_CASE.tolerance
    got = model.run(V1_CASE.inputs, all_blobs=True)
    for blob, ref in V1_CASE.outputs.items():
        assert_close(got[blob], ref, atol, rtol, blob)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".caffeq-")]


def test_cli_upgrades_v0_pair(tmp_path, capsys):
    rng = np.random.default_rng(5)
    weights = _v0_weights(rng)
    (tmp_path / "old.prototxt").write_text(V0_TEXT)
    write_v0_caffemodel(tmp_path / "old.caffemodel", weights)
    res = cli_here(capsys, tmp_path / "old.prototxt", "-w", tmp_path / "old.caffemodel", "-o",
              tmp_path / "new.prototxt", "--weights-out", tmp_path / "new.caffemodel")
    assert res.returncode == 0, res.stderr
    assert parse((tmp_path / "new.prototxt").read_text()) == parse(V0_EXPECTED)
    cm = read_caffemodel(tmp_path / "new.caffemodel")
    assert [lp.name for lp in cm.net.layer] == ["conv1", "relu1", "norm1", "pool1", "fc1", "drop1", "prob"]
    assert {k for k, v in cm.blobs.items() if v} == {"conv1", "fc1"}
    # blobs keep their legacy num/channels/height/width form, as upgrade_net_proto_binary copies them
    assert all(b.legacy_shape for b in cm.blobs["fc1"])
    np.testing.assert_array_equal(cm.blobs["fc1"][0].array.reshape(6, 48), weights["fc1"][0])
    model = caffeq.load(tmp_path / "new.prototxt", tmp_path / "new.caffemodel")
    np.testing.assert_array_equal(model.params["conv1"][0], weights["conv1"][0])


def test_cli_current_file_is_copied_with_a_message(tmp_path, capsys):
    res = cli_here(capsys, FIXTURES / "net_lenet" / "model.prototxt", "-o", tmp_path / "same.prototxt")
    assert res.returncode == 0 and "already in the current format" in res.stdout
    assert parse((tmp_path / "same.prototxt").read_text()) == \
           parse((FIXTURES / "net_lenet" / "model.prototxt").read_text())


def test_cli_refuses_to_overwrite_an_input(tmp_path, capsys):
    src = tmp_path / "old.prototxt"
    src.write_text(Path(V1_CASE.prototxt).read_text())
    before = src.read_bytes()
    assert_one_error_line(cli(src, "-o", src), "refusing to overwrite an input")
    assert_one_error_line(cli_here(capsys, src, "-w", V1_CASE.weights, "-o", tmp_path / "n.prototxt",
                              "--weights-out", V1_CASE.weights), "refusing to overwrite")
    assert src.read_bytes() == before
    assert not (tmp_path / "n.prototxt").exists()


def test_cli_truncated_caffemodel_writes_nothing(tmp_path):
    data = Path(V1_CASE.weights).read_bytes()
    bad = tmp_path / "bad.caffemodel"
    bad.write_bytes(data[:len(data) // 2])
    res = cli(V1_CASE.prototxt, "-w", bad, "-o", tmp_path / "n.prototxt", "--weights-out",
              tmp_path / "n.caffemodel")
    assert_one_error_line(res, str(bad), "not a valid caffemodel")
    assert sorted(os.listdir(tmp_path)) == ["bad.caffemodel"]


def test_cli_bad_inputs(tmp_path, capsys):
    mixed = tmp_path / "mixed.prototxt"
    mixed.write_text('layer { name: "a" type: "ReLU" bottom: "x" top: "x" } '
                     'layers { layer { name: "b" type: "relu" } bottom: "x" top: "x" }')
    assert_one_error_line(cli(mixed, "-o", tmp_path / "n.prototxt"), str(mixed), "both 'layer'")
    assert_one_error_line(cli_here(capsys, V1_CASE.prototxt, "-w", V1_CASE.weights,
                                   "-o", tmp_path / "n.prototxt"), "--weights-out")
    assert_one_error_line(cli_here(capsys, tmp_path / "missing.prototxt", "-o", tmp_path / "n.prototxt"),
                          "missing.prototxt")
    # an output under a file (missing folders are created, as in every command)
    (tmp_path / "a_file").write_text("")
    assert_one_error_line(cli_here(capsys, V1_CASE.prototxt, "-o", tmp_path / "a_file" / "n.prototxt"),
                          "a_file")
    assert not (tmp_path / "n.prototxt").exists()


SPPNET_V0 = """
input: "data" input_dim: 2 input_dim: 3 input_dim: 19 input_dim: 17
layers { layer { name: "conv1" type: "conv" conv_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 }
                 blobs_lr: 1.0 } bottom: "data" top: "conv1" }
layers { layer { name: "norm1" type: "lrn"
                 lrn_param { local_size: 3 alpha: 0.00005 beta: 0.75 norm_region: WITHIN_CHANNEL } }
         bottom: "conv1" top: "norm1" }
layers { layer { name: "pool1" type: "pool" pool_param { kernel_size: 3 stride: 2 pool: MAX } }
         bottom: "norm1" top: "pool1" }
layers { layer { name: "pool2" type: "pool" pool_param { kernel_size: 5 stride: 4 pool: AVE } }
         bottom: "norm1" top: "pool2" }
layers { layer { name: "f1" type: "flatten" } bottom: "pool1" top: "f1" }
layers { layer { name: "f2" type: "flatten" } bottom: "pool2" top: "f2" }
layers { layer { name: "spm" type: "concat" concat_param { concat_dim: 1 } } bottom: "f1" bottom: "f2" top: "spm" }
layers { layer { name: "fc6" type: "inner_product" inner_product_param { num_output: 5 bias_term: false } }
         bottom: "spm" top: "fc6" }
layers { layer { name: "drop6" type: "dropout" dropout_param { dropout_ratio: 0.4 } } bottom: "fc6" top: "fc6" }
"""

SPPNET_V2 = """
input: "data" input_shape { dim: 2 dim: 3 dim: 19 dim: 17 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" param { lr_mult: 1 }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
        lrn_param { local_size: 3 alpha: 0.00005 beta: 0.75 norm_region: WITHIN_CHANNEL } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1" pooling_param { kernel_size: 3 stride: 2 pool: MAX } }
layer { name: "pool2" type: "Pooling" bottom: "norm1" top: "pool2" pooling_param { kernel_size: 5 stride: 4 pool: AVE } }
layer { name: "f1" type: "Flatten" bottom: "pool1" top: "f1" }
layer { name: "f2" type: "Flatten" bottom: "pool2" top: "f2" }
layer { name: "spm" type: "Concat" bottom: "f1" bottom: "f2" top: "spm" concat_param { concat_dim: 1 } }
layer { name: "fc6" type: "InnerProduct" bottom: "spm" top: "fc6" inner_product_param { num_output: 5 bias_term: false } }
layer { name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6" dropout_param { dropout_ratio: 0.4 } }
"""


def test_sppnet_v0_dialect_with_v1_parameter_messages():
    """ShaoqingRen/SPP_net's 2014 model-defs: V0 `layers { layer { ... } }` holding conv_param,
    lrn_param, pool_param, inner_product_param, dropout_param, concat_param, and the type spelled
    "inner_product": the same net as the V2 file written out by hand, numbers included."""
    v0 = load_from_text(SPPNET_V0, random_weights=True, seed=3)
    v2 = load_from_text(SPPNET_V2, random_weights=True, seed=3)
    assert [(n.name, n.type) for n in v0.layers] == [(n.name, n.type) for n in v2.layers]
    assert v0.blob_shapes == v2.blob_shapes
    for a, b in zip(v0.layers, v2.layers):
        assert a.attrs == b.attrs, a.name
    x = np.random.default_rng(0).standard_normal((2, 3, 19, 17)).astype(np.float32)
    np.testing.assert_array_equal(v0.run({"data": x}, exact=True)["fc6"], v2.run({"data": x}, exact=True)["fc6"])


V1_FORK_TYPES = """
name: "fork"
layers { name: "data" type: NUSWIDE_DATA top: "data" top: "label"
         data_param { source: "x" batch_size: 2 max_labels: 13 } transform_param { crop_size: 9 } }
layers { name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip" inner_product_param { num_output: 5 } }
layers { name: "pr" type: PRECISION_RECALL bottom: "ip" bottom: "label" top: "pr" }
layers { name: "loss" type: SOFTMAX_MULTILABEL_LOSS bottom: "ip" bottom: "label" top: "loss" }
layers { name: "ip2" type: INNER_PRODUCT bottom: "ip" top: "ip2" inner_product_param { num_output: 3 } }
"""


def test_a_forks_v1_enum_types_read_as_their_v2_names():
    # nudles/vldbj-code's caffe adds NUSWIDE_DATA, PRECISION_RECALL and SOFTMAX_MULTILABEL_LOSS to the
    # V1 enum: the text reader keeps each name, and the upgrade names the type as Caffe renamed its own
    warnings = []
    net = parse_prototxt_text(V1_FORK_TYPES.replace(" max_labels: 13", ""), path="f.prototxt", warnings=warnings)
    assert [v1.fork_type for v1 in net.layers] == ["NUSWIDE_DATA", "", "PRECISION_RECALL", "SOFTMAX_MULTILABEL_LOSS",
                                                    ""]
    assert sum("V1 layer type PRECISION_RECALL is not one of Caffe's" in w for w in warnings) == 1
    upgrade_net(net)
    assert [lp.type for lp in net.layer] == ["NuswideData", "InnerProduct", "PrecisionRecall",
                                            "SoftmaxMultilabelLoss", "InnerProduct"]
    # the fork's data layer is an input (crop_size gives its shape; its own max_labels is not read), the
    # metric and the loss only train
    model = load_from_text(V1_FORK_TYPES)
    assert model.blob_shapes["data"] == (2, 3, 9, 9) and model.blob_shapes["ip2"] == (2, 3)
    assert {n.type for n in model.graph.nodes} == {"NuswideData", "InnerProduct"}
    # a V2 type string in a V1 block (Caffe's parser refuses it) is a current-format layer under the
    # legacy name: read as one, in its place among the V1 ones, with notes
    warnings = []
    mixed = parse_prototxt_text(V1_FORK_TYPES.replace(" max_labels: 13", "").replace("INNER_PRODUCT", '"InnerProduct"', 1),
                                path="f.prototxt", warnings=warnings)
    assert [lp.name for lp in mixed.layer] == ["data", "ip", "pr", "loss", "ip2"] and not len(mixed.layers)
    assert mixed.layer[1].type == "InnerProduct" and mixed.layer[1].inner_product_param.num_output == 5
    assert any("1 'layers' block(s) hold a current-format layer" in w for w in warnings)


def test_a_v1_dense_crf_keeps_its_parameters():
    # DeepLab v1 files write DENSE_CRF with dense_crf_param inside a V1 layer (deeplab-public: field 48)
    text = """
input: "prob" input_shape { dim: 1 dim: 3 dim: 5 dim: 6 }
input: "dim" input_shape { dim: 1 dim: 1 dim: 1 dim: 2 }
input: "img" input_shape { dim: 1 dim: 3 dim: 5 dim: 6 }
layers { name: "crf" type: DENSE_CRF bottom: "prob" bottom: "dim" bottom: "img" top: "crf"
         dense_crf_param { max_iter: 10 pos_w: 3 pos_xy_std: 3 bi_w: 5 bi_xy_std: 50 bi_rgb_std: 10 } }
"""
    net = parse_prototxt_text(text)
    upgrade_net(net)
    assert net.layer[-1].type == "DenseCRF" and net.layer[-1].dense_crf_param.max_iter == 10
    assert list(net.layer[-1].dense_crf_param.bi_rgb_std) == [10]
    assert load_from_text(text, unknown_shapes_ok=True).blob_shapes["crf"] == (1, 3, 5, 6)
