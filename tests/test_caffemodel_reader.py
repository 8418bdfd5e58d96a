"""The zero-copy caffemodel reader on every blob encoding Caffe and its forks write.

The files are encoded here by hand (a few lines of wire format, independent of
caffeq's writer) and checked against protobuf's own parser where it can read them.
"""
import os
import struct

import numpy as np
import pytest
from conftest import FIXTURES, case_dirs

from caffeq.errors import ParseError
from caffeq.io.caffemodel import read_blobproto, read_caffemodel
from caffeq.io.schema import caffe_pb2


def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def field(number, wire, payload):
    key = varint((number << 3) | wire)
    if wire == 2:
        return key + varint(len(payload)) + payload
    return key + payload


def shape_msg(dims):
    return field(7, 2, field(1, 2, b"".join(varint(d) for d in dims)))


def layer(name, blobs, v1=False):
    # V2 LayerParameter: name 1, type 2, blobs 7; V1LayerParameter: name 4, type 5 (enum), blobs 6
    body = field(1, 2, name.encode()) + field(2, 2, b"InnerProduct") if not v1 else \
        field(4, 2, name.encode()) + field(5, 0, varint(14))
    for b in blobs:
        body += field(6 if v1 else 7, 2, b)
    return field(2 if v1 else 100, 2, body)


def test_packed_float_data_is_a_view_into_the_file(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    blob = shape_msg([3, 4]) + field(5, 2, w.tobytes())
    p = tmp_path / "m.caffemodel"
    p.write_bytes(field(1, 2, b"net") + layer("ip", [blob]))
    cm = read_caffemodel(p)
    arr = cm.blobs["ip"][0].array
    np.testing.assert_array_equal(arr, w)
    assert not arr.flags.owndata and not arr.flags.writeable  # a view of the mapped file
    assert cm.net.name == "net" and cm.net.layer[0].name == "ip" and len(cm.net.layer[0].blobs) == 0


def test_unpacked_float_and_double_data(tmp_path):
    w = np.array([1.5, -2.0, 0.25], np.float32)
    unpacked = b"".join(field(5, 5, struct.pack("<f", v)) for v in w)
    d = np.array([0.5, 3.0], np.float64)
    unpacked_d = b"".join(field(8, 1, struct.pack("<d", v)) for v in d)
    packed_d = field(8, 2, d.tobytes())
    p = tmp_path / "m.caffemodel"
    p.write_bytes(layer("a", [shape_msg([3]) + unpacked]) + layer("b", [unpacked_d + shape_msg([2])])
                  + layer("c", [shape_msg([2]) + packed_d]))
    cm = read_caffemodel(p)
    np.testing.assert_array_equal(cm.blobs["a"][0].array, w)
    np.testing.assert_array_equal(cm.blobs["b"][0].array, d.astype(np.float32))
    np.testing.assert_array_equal(cm.blobs["c"][0].array, d.astype(np.float32))
    ref = caffe_pb2.NetParameter.FromString(p.read_bytes())  # protobuf agrees
    np.testing.assert_array_equal(np.array(ref.layer[0].blobs[0].data, np.float32), w)


def test_nvcaffe_fp16_raw_data(tmp_path):
    w = np.array([[0.5, -1.25], [3.0, 1e-3]], np.float16)
    blob = shape_msg([2, 2]) + field(10, 0, varint(caffe_pb2.FLOAT16)) + field(12, 2, w.tobytes())
    p = tmp_path / "m.caffemodel"
    p.write_bytes(layer("ip", [blob]))
    np.testing.assert_array_equal(read_caffemodel(p).blobs["ip"][0].array, w.astype(np.float32))


def test_legacy_num_channels_height_width(tmp_path):
    w = np.arange(6, dtype=np.float32)
    blob = field(1, 0, varint(1)) + field(2, 0, varint(1)) + field(3, 0, varint(2)) + field(4, 0, varint(3)) \
        + field(5, 2, w.tobytes())
    p = tmp_path / "m.caffemodel"
    p.write_bytes(layer("ip", [blob], v1=True))
    b = read_caffemodel(p).blobs["ip"][0]
    assert b.legacy_shape and b.array.shape == (1, 1, 2, 3)


def test_zero_axis_blob_without_shape(tmp_path):
    p = tmp_path / "m.caffemodel"
    p.write_bytes(layer("s", [field(5, 2, np.float32(2.5).tobytes())]))
    arr = read_caffemodel(p).blobs["s"][0].array
    assert arr.shape == () and float(arr) == 2.5


@pytest.mark.parametrize("bad,needle", [
    (shape_msg([3, 4]) + field(5, 2, np.zeros(5, np.float32).tobytes()), "needs 12 values"),
    (shape_msg([3]) + field(5, 2, b"\0" * 7), "multiple of 4"),
    (shape_msg([1 << 40, 1 << 20]), "absurd"),
])
def test_inconsistent_blobs_are_clear_errors(tmp_path, bad, needle):
    p = tmp_path / "m.caffemodel"
    p.write_bytes(layer("ip", [bad]))
    with pytest.raises(ParseError, match=needle):
        read_caffemodel(p)


def test_file_over_2gb_sparse(tmp_path):
    """A >2 GB file (protobuf's limit) reads; the zeros are a sparse hole, so this costs no disk."""
    n = (2**31 + 2**20) // 4
    p = tmp_path / "big.caffemodel"
    head_layer = field(1, 2, b"big") + field(2, 2, b"InnerProduct")
    blob_head = shape_msg([n]) + varint((5 << 3) | 2) + varint(n * 4)
    tail = np.array([7.0, 8.0], np.float32)
    blob_tail = shape_msg([2]) + field(5, 2, tail.tobytes())
    blob2 = field(7, 2, blob_tail)
    blob_len = len(blob_head) + n * 4
    layer_body_len = len(head_layer) + len(varint((7 << 3) | 2)) + len(varint(blob_len)) + blob_len + len(blob2)
    with open(p, "wb") as f:
        f.write(varint((100 << 3) | 2) + varint(layer_body_len) + head_layer)
        f.write(varint((7 << 3) | 2) + varint(blob_len) + blob_head)
        f.seek(n * 4, os.SEEK_CUR)
        f.write(blob2)
    assert os.path.getsize(p) > 2**31
    cm = read_caffemodel(p)
    big, small = cm.blobs["big"]
    assert big.array.shape == (n,) and big.array[-1] == 0.0
    np.testing.assert_array_equal(small.array, tail)


@pytest.mark.parametrize("case", [p.name for p in case_dirs()])
def test_reader_equals_protobuf_on_every_reference_file(case):
    path = FIXTURES / case / "model.caffemodel"
    ref = caffe_pb2.NetParameter.FromString(path.read_bytes())
    cm = read_caffemodel(path)
    layers = list(ref.layer) or list(ref.layers)
    for lp in layers:
        name = lp.name or lp.layer.name
        blobs = list(lp.blobs) or list(getattr(lp, "layer", lp).blobs) if hasattr(lp, "layer") else list(lp.blobs)
        ours = cm.blobs.get(name, [])
        assert len(ours) == len(blobs)
        for b, o in zip(blobs, ours):
            ref_arr = np.array(b.double_data or b.data, np.float32)
            np.testing.assert_array_equal(o.array.ravel(), ref_arr)


def test_mean_binaryproto():
    mean = read_blobproto(FIXTURES / "digits_meanfile" / "mean.binaryproto")
    ref = caffe_pb2.BlobProto.FromString((FIXTURES / "digits_meanfile" / "mean.binaryproto").read_bytes())
    assert mean.size == len(ref.data)
    np.testing.assert_array_equal(mean.ravel(), np.array(ref.data, np.float32))


def test_blobproto_vector(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1.5, -2.5], np.float32)
    vec = caffe_pb2.BlobProtoVector()
    for arr in (a, b):
        blob = vec.blobs.add()
        blob.shape.dim.extend(arr.shape)
        blob.data.extend(arr.ravel().tolist())
    p = tmp_path / "v.binaryproto"
    p.write_bytes(vec.SerializeToString())
    from caffeq.io.caffemodel import read_blobproto_vector
    got = read_blobproto_vector(p)
    assert len(got) == 2
    np.testing.assert_array_equal(got[0], a)
    np.testing.assert_array_equal(got[1], b)


def test_truncated_mean_file_is_a_clear_error(tmp_path):
    raw = (FIXTURES / "digits_meanfile" / "mean.binaryproto").read_bytes()
    p = tmp_path / "m.binaryproto"
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ParseError, match="m.binaryproto"):
        read_blobproto(p)


@pytest.mark.parametrize("net_field, name_field, bottom_field", [(100, 1, 3), (2, 4, 2)])  # V2 layer, V1 layers
def test_text_fields_that_are_not_utf8_are_clear_errors(tmp_path, net_field, name_field, bottom_field):
    # a bottom name of invalid UTF-8 used to reach the legacy upgrade and fail there with a traceback
    from caffeq.io.wire import encode_key, encode_varint

    def string_field(number, raw):
        return encode_key(number, 2) + encode_varint(len(raw)) + raw
    layer = string_field(name_field, b"conv") + string_field(bottom_field, b"\xff\xfedata")
    path = tmp_path / "bad.caffemodel"
    path.write_bytes(string_field(net_field, layer))
    with pytest.raises(ParseError, match=r"bad.caffemodel: not a valid caffemodel: layers? #0: field 'bottom'.*not UTF-8"):
        read_caffemodel(path)


@pytest.mark.parametrize("v1", [False, True])
def test_a_forks_parameter_message_that_does_not_parse_keeps_the_layers_weights(tmp_path, v1):
    """caffe-3dnormal_joint_past's V1 DECODE stores decode_param (a path string) at 26, dummy_data_param here:
    the layer keeps its name, type, wiring and blobs, the parameters come from the prototxt, and a note says so."""
    import caffeq
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    bias = np.array([0.5, -1.0, 2.0], np.float32)
    blobs = [shape_msg(list(a.shape)) + field(5, 2, a.tobytes()) for a in (w, bias)]
    fork_param = field(26, 2, field(1, 2, b"codebook.txt"))   # its string read as a filler here: wire error
    raw = layer("ip", blobs, v1=v1)
    body_start = len(varint(((2 if v1 else 100) << 3) | 2)) + len(varint(len(raw)))   # the layer's payload
    body = raw[body_start:] + (fork_param if v1 else field(100, 2, b"\x07"))           # V2: transform_param
    model_file = tmp_path / "m.caffemodel"
    model_file.write_bytes(field(2 if v1 else 100, 2, body))
    with pytest.raises(Exception):   # the layer message alone is not protobuf-clean
        (caffe_pb2.V1LayerParameter if v1 else caffe_pb2.LayerParameter)().ParseFromString(body)
    cm = read_caffemodel(model_file)
    assert len(cm.notes) == 1 and "layer 'ip': its parameters do not parse" in cm.notes[0]
    np.testing.assert_array_equal(cm.blobs["ip"][0].array, w)
    text = ('input: "x" input_shape { dim: 2 dim: 2 }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 3 } }\n')
    proto = tmp_path / "m.prototxt"
    proto.write_text(text)
    model = caffeq.load(str(proto), str(model_file))
    assert any("its parameters do not parse" in w for w in model.warnings)
    x = np.array([[1.0, 2.0], [-3.0, 0.5]], np.float32)
    np.testing.assert_allclose(model.run(x)["y"], x @ w.T + bias, rtol=1e-6)


def test_a_v0_layer_whose_parameters_do_not_parse_stays_an_error(tmp_path):
    """A V0 layer keeps its name and type inside its parameter message (V1 field 1): there is no core to fall
    back on, so the file is refused in one line rather than its weights filed under an empty name."""
    v0 = field(1, 2, b"ip") + field(2, 2, b"innerproduct") + field(5, 2, b"\x07")   # weight_filler: not a message
    path = tmp_path / "v0.caffemodel"
    path.write_bytes(field(2, 2, field(1, 2, v0)))
    with pytest.raises(ParseError, match="v0.caffemodel: not a valid caffemodel"):
        read_caffemodel(path)
