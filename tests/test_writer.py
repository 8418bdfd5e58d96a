"""Writers: prototxt text, caffemodel (hand-built wire format) and binaryproto round trips."""
import os
import shutil

import numpy as np
import pytest
from conftest import FIXTURES, Case, case_dirs

import caffeq
from caffeq.errors import CaffeqError
from caffeq.io.caffemodel import BlobData, read_blobproto, read_caffemodel
from caffeq.io.prototxt import parse_prototxt_text, read_prototxt
from caffeq.io.schema import caffe_pb2
from caffeq.io.upgrade import upgrade_net
from caffeq.io.writer import (
    blobproto_bytes,
    net_to_text,
    write_blobproto,
    write_caffemodel,
    write_model_caffemodel,
    write_prototxt,
)


def bits(a):
    """Bit pattern of a float32 array (NaN payloads and -0.0 included)."""
    return np.ascontiguousarray(a, dtype="<f4").view("<u4")


def assert_same_blobs(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert len(a[name]) == len(b[name]), name
        for x, y in zip(a[name], b[name]):
            assert x.array.shape == y.array.shape, name
            np.testing.assert_array_equal(bits(x.array), bits(y.array))
            assert x.legacy_shape == y.legacy_shape


# -- prototxt ------------------------------------------------------------------------------

@pytest.mark.parametrize("case_dir", case_dirs(), ids=lambda p: p.name)
def test_prototxt_text_round_trip(case_dir, tmp_path):
    net = read_prototxt(case_dir / "model.prototxt")
    upgrade_net(net, str(case_dir))
    again = parse_prototxt_text(net_to_text(net))
    assert again == net
    out = tmp_path / "net.prototxt"
    write_prototxt(net, out)
    assert read_prototxt(out) == net
    assert os.listdir(tmp_path) == ["net.prototxt"]


def test_write_prototxt_creates_missing_folders_and_refuses_inputs(tmp_path):
    net = parse_prototxt_text('name: "n" layer { name: "a" type: "ReLU" bottom: "x" top: "x" }')
    write_prototxt(net, tmp_path / "new" / "sub" / "n.prototxt")     # one rule: missing folders are made
    assert read_prototxt(tmp_path / "new" / "sub" / "n.prototxt") == net
    shutil.rmtree(tmp_path / "new")
    src = tmp_path / "src.prototxt"
    src.write_text("name: 'old'")
    with pytest.raises(CaffeqError, match="refusing to overwrite"):
        write_prototxt(net, src, inputs=[src])
    assert src.read_text() == "name: 'old'"
    assert sorted(os.listdir(tmp_path)) == ["src.prototxt"]


# -- caffemodel ------------------------------------------------------------------------------

@pytest.mark.parametrize("case_dir", case_dirs(), ids=lambda p: p.name)
def test_caffemodel_round_trip_bit_identical(case_dir, tmp_path):
    src = case_dir / "model.caffemodel"
    cm = read_caffemodel(src)
    out = tmp_path / "m.caffemodel"
    write_caffemodel(cm.net, cm.blobs, out)
    back = read_caffemodel(out)
    assert back.net == cm.net
    assert_same_blobs(cm.blobs, back.blobs)
    # protobuf itself reads it, to the same message as the file Caffe wrote
    ours, caffes = caffe_pb2.NetParameter(), caffe_pb2.NetParameter()
    ours.ParseFromString(out.read_bytes())
    caffes.ParseFromString(src.read_bytes())
    assert ours == caffes


def test_protobuf_sees_shapes_and_data(tmp_path):
    net = parse_prototxt_text("""
      name: "tiny"
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 } } }
      layer { name: "fc" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 3 } }
      layer { name: "p" type: "PReLU" bottom: "y" top: "y" prelu_param { channel_shared: true } }
    """)
    w = np.arange(6, dtype=np.float32).reshape(3, 2) - 2.5
    b = np.array([np.nan, -0.0, np.inf], np.float32)
    blobs = {"fc": [w, b], "p": [np.array(0.25, np.float32)]}
    out = tmp_path / "t.caffemodel"
    write_caffemodel(net, blobs, out)
    full = caffe_pb2.NetParameter()
    full.ParseFromString(out.read_bytes())
    fc = full.layer[1]
    assert fc.name == "fc" and fc.inner_product_param.num_output == 3
    assert list(fc.blobs[0].shape.dim) == [3, 2]
    assert list(fc.blobs[0].data) == w.ravel().tolist()
    assert list(fc.blobs[1].shape.dim) == [3]
    # a scalar is written as Caffe's Blob::ToProto writes a 0-axis blob: no shape field
    assert not full.layer[2].blobs[0].HasField("shape") and list(full.layer[2].blobs[0].data) == [0.25]
    back = read_caffemodel(out)
    np.testing.assert_array_equal(bits(back.blobs["fc"][1].array), bits(b))
    assert back.blobs["p"][0].array.shape == ()
    assert back.blobs["in"] == []


def test_legacy_4d_shapes_are_kept(tmp_path):
    net = parse_prototxt_text('layer { name: "fc" type: "InnerProduct" bottom: "x" top: "y" '
                              'inner_product_param { num_output: 4 } }')
    w = np.random.default_rng(0).standard_normal((1, 1, 4, 5)).astype(np.float32)
    bias = np.ones((1, 1, 1, 4), np.float32)
    out = tmp_path / "legacy.caffemodel"
    write_caffemodel(net, {"fc": [BlobData(w, True), BlobData(bias, True)]}, out)
    full = caffe_pb2.NetParameter()
    full.ParseFromString(out.read_bytes())
    bp = full.layer[0].blobs[0]
    assert (bp.num, bp.channels, bp.height, bp.width) == (1, 1, 4, 5) and not bp.HasField("shape")
    back = read_caffemodel(out)
    assert back.blobs["fc"][0].legacy_shape and back.blobs["fc"][0].array.shape == (1, 1, 4, 5)
    np.testing.assert_array_equal(back.blobs["fc"][0].array, w)
    # and such a file loads: the 1x1x4x5 blob is the 4x5 InnerProduct weight
    proto = tmp_path / "legacy.prototxt"
    proto.write_text('input: "x" input_shape { dim: 2 dim: 5 } ' + net_to_text(net))
    model = caffeq.load(proto, out)
    np.testing.assert_array_equal(model.params["fc"][0], w.reshape(4, 5))


def test_v1_and_v0_nets_are_written_in_their_own_format(tmp_path):
    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((2, 3, 1, 1)).astype(np.float32)
    w0 = rng.standard_normal((4, 2, 1, 1)).astype(np.float32)
    v1 = parse_prototxt_text('layers { name: "c" type: CONVOLUTION bottom: "x" top: "y" '
                             'convolution_param { num_output: 2 kernel_size: 1 bias_term: false } }')
    v0 = parse_prototxt_text('layers { layer { name: "c0" type: "conv" num_output: 4 kernelsize: 1 '
                             'biasterm: false } bottom: "x" top: "y" }')
    for net, name, w in ((v1, "c", w1), (v0, "c0", w0)):
        out = tmp_path / f"{name}.caffemodel"
        write_caffemodel(net, {name: [w]}, out)
        full = caffe_pb2.NetParameter()
        full.ParseFromString(out.read_bytes())
        entry = full.layers[0]
        blobs = entry.layer.blobs if entry.HasField("layer") else entry.blobs
        assert len(blobs) == 1 and list(blobs[0].data) == w.ravel().tolist()
        back = read_caffemodel(out)
        np.testing.assert_array_equal(back.blobs[name][0].array, w)
        assert back.net == net


def test_blobs_inside_the_net_are_written_when_no_dict_is_given(tmp_path):
    net = parse_prototxt_text('layer { name: "s" type: "Scale" bottom: "x" top: "x" '
                              'blobs { shape { dim: 3 } data: 1 data: 2 data: 3 } }')
    out = tmp_path / "inline.caffemodel"
    write_caffemodel(net, None, out)
    back = read_caffemodel(out)
    np.testing.assert_array_equal(back.blobs["s"][0].array, [1, 2, 3])
    full = caffe_pb2.NetParameter()
    full.ParseFromString(out.read_bytes())
    assert full == net


def test_read_only_mmap_views_and_non_contiguous_arrays(tmp_path):
    cm = read_caffemodel(FIXTURES / "net_resnet_mini" / "model.caffemodel")
    name, blobs = next((k, v) for k, v in cm.blobs.items() if v and v[0].array.ndim == 4)
    assert not blobs[0].array.flags.writeable   # zero-copy view into the mapped file
    transposed = {name: [blobs[0].array.transpose(1, 0, 2, 3)] + [b.array for b in blobs[1:]]}
    out = tmp_path / "t.caffemodel"
    write_caffemodel(cm.net, transposed, out)
    back = read_caffemodel(out)
    np.testing.assert_array_equal(back.blobs[name][0].array, blobs[0].array.transpose(1, 0, 2, 3))


def test_model_weights_written_and_reloaded(tmp_path):
    case = Case(FIXTURES / "net_resnet_mini")
    model = case.load()
    # stand-in for quantization: node.blobs hold the (dequantized) floats to write
    for node in model.layers:
        if node.blobs:
            node.blobs = [np.round(b * 8) / 8 for b in node.blobs]
    out = tmp_path / "q.caffemodel"
    write_model_caffemodel(model, out)
    again = caffeq.load(case.prototxt, out)
    for name, arrays in model.params.items():
        for a, b in zip(arrays, again.params[name]):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(again.run(case.inputs)[model.outputs[0]],
                                  model.run(case.inputs)[model.outputs[0]])


def test_quantized_model_writes_dequantized_weights(tmp_path):
    if not hasattr(caffeq, "quantize"):
        pytest.skip("caffeq.quantize not built yet")
    case = Case(FIXTURES / "conv_basic")
    q = caffeq.quantize(case.load(), "int8", keep=[])
    out = tmp_path / "q.caffemodel"
    write_model_caffemodel(q, out)
    back = read_caffemodel(out)
    for node in q.layers:
        for i, arr in enumerate(node.blobs or []):
            np.testing.assert_array_equal(back.blobs[node.name][i].array, arr)


def test_large_blob_written_without_protobuf_lists(tmp_path):
    # ~64 MB: a protobuf repeated-float path would take seconds and GBs; this must not
    big = np.random.default_rng(2).standard_normal((4096, 4096)).astype(np.float32)
    net = parse_prototxt_text('layer { name: "fc" type: "InnerProduct" bottom: "x" top: "y" '
                              'inner_product_param { num_output: 4096 } }')
    out = tmp_path / "big.caffemodel"
    write_caffemodel(net, {"fc": [big]}, out)
    assert out.stat().st_size < big.nbytes + 64
    back = read_caffemodel(out)
    np.testing.assert_array_equal(bits(back.blobs["fc"][0].array), bits(big))


# -- binaryproto ------------------------------------------------------------------------------

def test_mean_file_round_trip(tmp_path):
    mean = read_blobproto(FIXTURES / "digits_meanfile" / "mean.binaryproto")
    for legacy in (False, True):
        out = tmp_path / f"mean{legacy}.binaryproto"
        write_blobproto(mean, out, legacy_shape=legacy)
        np.testing.assert_array_equal(bits(read_blobproto(out)), bits(mean))
        bp = caffe_pb2.BlobProto()
        bp.ParseFromString(out.read_bytes())
        assert np.array_equal(np.array(bp.data, np.float32).reshape(mean.shape), mean)
        if legacy and mean.ndim == 4:
            assert (bp.num, bp.channels, bp.height, bp.width) == mean.shape
        else:
            assert list(bp.shape.dim) == list(mean.shape)
    assert blobproto_bytes(mean) == (tmp_path / "meanFalse.binaryproto").read_bytes()


def test_write_blobproto_rejects_non_numeric(tmp_path):
    with pytest.raises(CaffeqError, match="cannot store dtype"):
        write_blobproto(np.array(["a"]), tmp_path / "x.binaryproto")
    assert not os.listdir(tmp_path)
