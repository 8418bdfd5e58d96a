"""Zero-copy reader of binary .caffemodel / .binaryproto files.

protobuf's Python runtime turns a packed `repeated float data` into a Python
list (about 6x the read time and 3x the memory for a VGG16 file) and cannot
parse messages over 2 GB.  We walk the wire format ourselves over an mmap:
layer messages minus their blobs go through protobuf (they are tiny), while
each blob's packed `data` becomes a numpy view into the mapped file.
"""
import mmap
import os
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from ..errors import ParseError
from .schema import caffe_pb2
from .wire import FIXED32, FIXED64, LEN, VARINT, encode_key, encode_varint, len_field

# Field numbers (caffe.proto)
_NET_LAYER, _NET_LAYERS = 100, 2          # NetParameter.layer (V2), .layers (V1)
_LAYER_BLOBS = 7                          # LayerParameter.blobs
_V1_BLOBS, _V1_V0LAYER = 6, 1             # V1LayerParameter.blobs, .layer (V0)
_V0_BLOBS = 50                            # V0LayerParameter.blobs
_BLOBVEC_BLOBS = 1                        # BlobProtoVector.blobs
# BlobProto
_B_NUM, _B_CHANNELS, _B_HEIGHT, _B_WIDTH = 1, 2, 3, 4
_B_DATA, _B_SHAPE, _B_DOUBLE_DATA = 5, 7, 8
_B_RAW_TYPE, _B_RAW_DATA = 10, 12         # NVCaffe's typed raw storage
_RAW_DTYPES = {0: "<f8", 1: "<f4", 2: "<f2", 3: "<i4", 4: "<u4"}  # BlobProto.Type

MAX_BLOB_ELEMENTS = 1 << 34  # refuse absurd declared shapes before allocating

# What a layer is without its parameters (name, type, wiring, phase rules, param specs), kept where a fork's
# caffemodel numbers a parameter message as another one here and protobuf cannot parse the layer
_LAYER_CORE = {1, 2, 3, 4, 5, 6, 8, 9, 10, 11}                   # LayerParameter
_V1_LAYER_CORE = {2, 3, 4, 5, 7, 8, 32, 33, 35, 1001, 1002}      # V1LayerParameter


def _varint(buf, pos, end):
    result = shift = 0
    while True:
        if pos >= end:
            raise ParseError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ParseError("malformed varint")


def iter_fields(buf, start, end):
    """Yield (field_number, wire_type, value, value_start, value_end) for one message.

    For length-delimited fields value is None and [value_start, value_end) is
    the payload; for scalar fields value is the integer (or raw bits).
    """
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ParseError("field number 0")
        if wire == VARINT:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value, pos, pos
        elif wire == LEN:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise ParseError(f"field {number} runs past the end of the data (truncated file?)")
            yield number, wire, None, pos, pos + length
            pos += length
        elif wire == FIXED32:
            if pos + 4 > end:
                raise ParseError("truncated fixed32")
            yield number, wire, int.from_bytes(buf[pos:pos + 4], "little"), pos, pos + 4
            pos += 4
        elif wire == FIXED64:
            if pos + 8 > end:
                raise ParseError("truncated fixed64")
            yield number, wire, int.from_bytes(buf[pos:pos + 8], "little"), pos, pos + 8
            pos += 8
        else:
            raise ParseError(f"unsupported wire type {wire} for field {number}")


@dataclass
class BlobData:
    """One weight blob: the array plus whether its shape came from legacy num/channels/height/width."""
    array: np.ndarray
    legacy_shape: bool = False


def _read_field(buf, pos, end):
    """One field at pos -> (number, wire, value, value_start, value_end, next_pos)."""
    for item in iter_fields(buf, pos, end):
        number, wire, value, vs, ve = item
        return number, wire, value, vs, ve, ve
    raise ParseError("truncated field")


def parse_blob(buf, start, end, what="blob"):
    """Parse one BlobProto into a BlobData without copying packed data."""
    dims = None
    legacy = {}
    data = None
    raw_type = None
    raw = None
    pos = start
    while pos < end:
        number, wire, value, vs, ve, pos = _read_field(buf, pos, end)
        if number in (_B_NUM, _B_CHANNELS, _B_HEIGHT, _B_WIDTH) and wire == VARINT:
            legacy[number] = value
        elif number == _B_SHAPE and wire == LEN:
            dims = _parse_dims(buf, vs, ve)
        elif number == _B_DATA and wire == LEN:
            if (ve - vs) % 4:
                raise ParseError(f"{what}: packed float data of {ve - vs} bytes is not a multiple of 4")
            data = np.frombuffer(buf, dtype="<f4", count=(ve - vs) // 4, offset=vs)
        elif number == _B_DATA and wire == FIXED32:
            data, pos = _unpacked_run(buf, vs, end, (_B_DATA << 3) | FIXED32, "<f4")
        elif number == _B_DOUBLE_DATA and wire == LEN:
            if (ve - vs) % 8:
                raise ParseError(f"{what}: packed double data of {ve - vs} bytes is not a multiple of 8")
            data = np.frombuffer(buf, dtype="<f8", count=(ve - vs) // 8, offset=vs).astype(np.float32)
        elif number == _B_DOUBLE_DATA and wire == FIXED64:
            values, pos = _unpacked_run(buf, vs, end, (_B_DOUBLE_DATA << 3) | FIXED64, "<f8")
            data = values.astype(np.float32)
        elif number == _B_RAW_TYPE and wire == VARINT:
            raw_type = value
        elif number == _B_RAW_DATA and wire == LEN:
            raw = (vs, ve)
    return _make_blob(buf, data, dims, legacy, raw_type, raw, what)


def _parse_dims(buf, vs, ve):
    dims = []
    for number, wire, value, s, e in iter_fields(buf, vs, ve):
        if number != 1:
            continue
        if wire == LEN:  # packed
            p = s
            while p < e:
                d, p = _varint(buf, p, e)
                dims.append(d)
        elif wire == VARINT:
            dims.append(value)
    # int64 dims: negative values arrive as 10-byte two's complement varints
    return [d - (1 << 64) if d >= 1 << 63 else d for d in dims]


def _unpacked_run(buf, first_value, end, tag, dtype):
    """Gather a run of unpacked repeated fixed-width values (one tag per element).

    Old writers emit (tag, value) pairs; the records are equally spaced, so a
    strided numpy view collects them without a Python loop.  first_value is the
    offset of the first value (its one-byte tag precedes it).  Returns
    (array, position after the run).
    """
    itemsize = np.dtype(dtype).itemsize
    stride = 1 + itemsize
    first = first_value - 1
    max_count = (end - first) // stride
    tags = np.ndarray((max_count,), dtype=np.uint8, buffer=buf, offset=first, strides=(stride,))
    bad = np.flatnonzero(tags != tag)
    count = int(bad[0]) if bad.size else max_count
    values = np.ndarray((count,), dtype=dtype, buffer=buf, offset=first_value, strides=(stride,)).copy()
    return values, first + count * stride


def _make_blob(buf, data, dims, legacy, raw_type, raw, what):
    if raw is not None and data is None:
        dtype = _RAW_DTYPES.get(raw_type if raw_type is not None else 1)
        if dtype is None:
            raise ParseError(f"{what}: unknown raw_data_type {raw_type}")
        vs, ve = raw
        itemsize = np.dtype(dtype).itemsize
        if (ve - vs) % itemsize:
            raise ParseError(f"{what}: raw_data of {ve - vs} bytes does not hold whole {dtype} values")
        data = np.frombuffer(buf, dtype=dtype, count=(ve - vs) // itemsize, offset=vs).astype(np.float32)
    legacy_shape = False
    if dims is not None:
        shape = tuple(dims)
    elif legacy:
        shape = tuple(legacy.get(k, 1) for k in (_B_NUM, _B_CHANNELS, _B_HEIGHT, _B_WIDTH))
        legacy_shape = True
    else:
        # Caffe writes a 0-axis (scalar) blob with no shape field at all
        shape = () if data is not None and data.size == 1 else (0 if data is None else data.size,)
    if any(d < 0 for d in shape):
        raise ParseError(f"{what}: negative dimension in shape {list(shape)}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count > MAX_BLOB_ELEMENTS:
        raise ParseError(f"{what}: absurd shape {list(shape)}")
    if data is None:
        data = np.zeros(0, np.float32)
    if data.size != count:
        if data.size == 0:
            raise ParseError(f"{what}: shape {list(shape)} but no data")
        raise ParseError(f"{what}: shape {list(shape)} needs {count} values but the file holds {data.size}")
    return BlobData(data.reshape(shape), legacy_shape)


@dataclass
class CaffeModelFile:
    """A caffemodel: its NetParameter without blobs plus the blobs by layer name."""
    net: "caffe_pb2.NetParameter"
    blobs: dict = field(default_factory=dict)   # layer name -> [BlobData]
    path: str = ""
    notes: list = field(default_factory=list)   # layers whose parameters did not parse (their core kept)
    _mmap: object = None


def _strip_layer(buf, vs, ve, blob_field, nested=None, what="layer"):
    """Split a layer message into (bytes without blobs, [BlobData]).

    nested maps a field number to (blob field) for an embedded legacy layer
    (V1's `layer` holding a V0 message with its own blobs).
    """
    kept = bytearray()
    blobs = []
    last = vs
    for number, wire, value, s, e in iter_fields(buf, vs, ve):
        if wire != LEN or (number != blob_field and not (nested and number in nested)):
            continue
        # field key+length precede s; find where this field's key started
        key_start = _field_start(buf, last, s, number)
        kept += buf[last:key_start]
        if number == blob_field:
            blobs.append(parse_blob(buf, s, e, f"{what} blob {len(blobs)}"))
            last = e
        else:
            inner, inner_blobs = _strip_layer(buf, s, e, nested[number], None, what)
            kept += len_field(number, len(inner)) + inner
            blobs.extend(inner_blobs)
            last = e
    kept += buf[last:ve]
    return bytes(kept), blobs


def _field_start(buf, scan_from, payload_start, number):
    """Position of the key of the length-delimited field whose payload starts at payload_start."""
    pos = scan_from
    while True:
        key_pos = pos
        key, pos = _varint(buf, pos, payload_start)
        n, w = key >> 3, key & 7
        if w == VARINT:
            _, pos = _varint(buf, pos, payload_start)
        elif w == LEN:
            length, pos = _varint(buf, pos, payload_start)
            if pos == payload_start and n == number:
                return key_pos
            pos += length
        elif w == FIXED32:
            pos += 4
        elif w == FIXED64:
            pos += 8
        else:
            raise ParseError("malformed field")


def _open_map(path):
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ParseError(f"{path}: cannot read: {e.strerror or e}") from None


def _layer_name(name):
    # protobuf hands back bytes for a string field that is not valid UTF-8
    if not isinstance(name, str):
        raise ParseError(f"layer name {bytes(name)[:40]!r} is not UTF-8 text")
    return name


def _check_text(msg, what):
    """Every string field of a parsed message must be text: protobuf hands back bytes for one that
    is not valid UTF-8, and the legacy upgrade would fail on it later."""
    for fd, value in msg.ListFields():
        values = value if fd.is_repeated else [value]
        if fd.type == fd.TYPE_STRING:
            for v in values:
                if not isinstance(v, str):
                    raise ParseError(f"{what}: field '{fd.name}' holds {bytes(v)[:40]!r}, not UTF-8 text")
        elif fd.type == fd.TYPE_MESSAGE and fd.message_type.name != "BlobProto":
            for v in values:
                _check_text(v, what)


def read_caffemodel(path):
    """Read a binary NetParameter (.caffemodel) with zero-copy weight arrays."""
    path = os.fspath(path)
    buf = _open_map(path)
    if len(buf) == 0:
        raise ParseError(f"{path}: empty file, not a caffemodel")
    header = bytearray()
    layer_msgs = []  # bytes of V2 layers without blobs
    v1_msgs = []
    blobs_by_layer = {}
    notes = []
    try:
        for number, wire, value, s, e in iter_fields(buf, 0, len(buf)):
            if number == _NET_LAYER and wire == LEN:
                msg, blobs = _strip_layer(buf, s, e, _LAYER_BLOBS, what=f"layer #{len(layer_msgs)}")
                layer_msgs.append((msg, blobs))
            elif number == _NET_LAYERS and wire == LEN:
                msg, blobs = _strip_layer(buf, s, e, _V1_BLOBS, {_V1_V0LAYER: _V0_BLOBS},
                                          what=f"layers #{len(v1_msgs)}")
                v1_msgs.append((msg, blobs))
            else:
                header += _field_bytes(buf, number, wire, value, s, e)
        net = caffe_pb2.NetParameter()
        net.ParseFromString(bytes(header))
        for msg, blobs in layer_msgs:
            lp = net.layer.add()
            _parse_layer(lp, msg, _LAYER_CORE, notes)
            _check_text(lp, f"layer #{len(net.layer) - 1}")
            blobs_by_layer.setdefault(_layer_name(lp.name), blobs)
        for msg, blobs in v1_msgs:
            lp = net.layers.add()
            _parse_layer(lp, msg, _V1_LAYER_CORE, notes)
            _check_text(lp, f"layers #{len(net.layers) - 1}")
            name = lp.name or (lp.layer.name if lp.HasField("layer") else "")
            blobs_by_layer.setdefault(_layer_name(name), blobs)
    except ParseError as e:
        raise ParseError(f"{path}: not a valid caffemodel: {e}") from None
    except Exception as e:  # protobuf DecodeError and friends
        raise ParseError(f"{path}: not a valid caffemodel: {type(e).__name__}: {e}") from None
    return CaffeModelFile(net=net, blobs=blobs_by_layer, path=path, notes=[f"{path}: {n}" for n in notes], _mmap=buf)


def _field_bytes(buf, number, wire, value, s, e):
    """One field as it was on the wire (its key, then its value)."""
    key = encode_key(number, wire)
    if wire == LEN:
        return key + encode_varint(e - s) + buf[s:e]
    if wire == VARINT:
        return key + encode_varint(value)
    return key + buf[s:e]


def _parse_layer(lp, msg, core, notes):
    """Parse a layer message (blobs already out); where a fork's parameter message does not parse as the
    one of that number here, keep the layer's core fields and say so: the prototxt gives the parameters."""
    try:
        lp.ParseFromString(msg)
        return
    except DecodeError:
        fields = list(iter_fields(msg, 0, len(msg)))
        if core is _V1_LAYER_CORE and any(f[0] == _V1_V0LAYER for f in fields):
            raise   # a V0 layer keeps its name and type inside its parameters: nothing to fall back on
    kept = bytearray()
    for number, wire, value, s, e in fields:
        if number in core:
            kept += _field_bytes(msg, number, wire, value, s, e)
    lp.Clear()
    lp.ParseFromString(bytes(kept))   # a core field that does not parse either: not a caffemodel
    notes.append(f"layer '{lp.name}': its parameters do not parse with caffeq's caffe.proto (a "
                 f"fork numbering its fields otherwise, or damaged bytes); its weights are read, its parameters come from the prototxt")


def read_blobproto(path):
    """Read a .binaryproto file: a BlobProto (mean file) -> numpy array."""
    path = os.fspath(path)
    buf = _open_map(path)
    if len(buf) == 0:
        raise ParseError(f"{path}: empty file, not a BlobProto")
    try:
        blob = parse_blob(buf, 0, len(buf), what=path)
    except ParseError as e:
        msg = str(e)
        raise ParseError(msg if msg.startswith(path) else f"{path}: {msg}") from None
    if blob.array.size == 0:
        raise ParseError(f"{path}: holds no data; not a BlobProto")
    return blob.array


def read_blobproto_vector(path):
    """Read a BlobProtoVector file -> list of numpy arrays."""
    path = os.fspath(path)
    buf = _open_map(path)
    out = []
    try:
        for number, wire, value, s, e in iter_fields(buf, 0, len(buf)):
            if number == _BLOBVEC_BLOBS and wire == LEN:
                out.append(parse_blob(buf, s, e, f"{path} blob {len(out)}").array)
    except ParseError as e:
        raise ParseError(f"{path}: not a BlobProtoVector: {e}") from None
    return out
