"""Writers: prototxt text, binary .caffemodel and .binaryproto (mean files).

write_caffemodel never builds protobuf `repeated float` lists (6x slower and
3x the memory on a VGG16-sized file): each layer message goes through
protobuf without its blobs, and the blobs are appended in wire format by
hand, with the float payload written straight from the array's buffer.
The result is an ordinary NetParameter that protobuf and Caffe parse, and
that caffeq.io.caffemodel.read_caffemodel maps back zero-copy.
"""
import os

import numpy as np
from google.protobuf import text_format

from ..errors import CaffeqError
from ..fs import atomic_output
from .schema import caffe_pb2
from .wire import VARINT, encode_key, encode_varint, len_field

# Field numbers (caffe.proto)
_NET_LAYERS, _NET_LAYER = 2, 100      # NetParameter.layers (V1), .layer (V2)
_LAYER_BLOBS = 7                      # LayerParameter.blobs
_V1_BLOBS, _V1_V0LAYER = 6, 1         # V1LayerParameter.blobs, .layer (V0)
_V0_BLOBS = 50                        # V0LayerParameter.blobs
_B_NUM, _B_CHANNELS, _B_HEIGHT, _B_WIDTH = 1, 2, 3, 4
_B_DATA, _B_SHAPE = 5, 7              # BlobProto.data (packed float), .shape
_SHAPE_DIM = 1                        # BlobShape.dim (packed int64)


# -- prototxt ----------------------------------------------------------------------

def net_to_text(net):
    """A NetParameter (or any message) as Caffe-style protobuf text."""
    return text_format.MessageToString(net)


# (message, field) of every path a data layer reads; Caffe resolves them from its working folder,
# caffeq from the prototxt's folder first
_DATA_PATH_FIELDS = (
    ("data_param", "source"), ("data_param", "mean_file"),
    ("image_data_param", "source"), ("image_data_param", "mean_file"), ("image_data_param", "root_folder"),
    ("hdf5_data_param", "source"),
    ("window_data_param", "source"), ("window_data_param", "mean_file"), ("window_data_param", "root_folder"),
    ("transform_param", "mean_file"),
)


def _rebased(value, from_dir, to_dir, portable):
    if not value or os.path.isabs(value):
        return value
    folder_form = value.endswith("/")   # a root_folder is prepended to file names as a string
    here = os.path.abspath(os.path.join(from_dir, value))
    if not os.path.exists(here) and os.path.exists(os.path.join(os.getcwd(), value)):
        here = os.path.abspath(os.path.join(os.getcwd(), value))
    try:
        common = os.path.commonpath([here, to_dir])
    except ValueError:                   # another drive (Windows)
        common = None
    if common is None or os.path.dirname(common) == common:
        # only the filesystem root in common: an absolute path, or the value as written when the
        # file must not hold local paths
        return value if portable else here
    new = os.path.relpath(here, to_dir).replace(os.sep, "/")
    return new + "/" if folder_form and not new.endswith("/") else new


def rebase_data_paths(net, from_dir, to_dir, portable=False):
    """A copy of `net` whose relative data paths (sources, mean files, root folders), written for a
    prototxt in `from_dir`, point at the same files from a prototxt in `to_dir`.

    Paths whose files share no folder with `to_dir` but the filesystem root become absolute, or,
    with portable=True (files that travel, like .caffeq), stay as written. `net` itself is
    returned when the folders are the same or nothing changes.
    """
    from_dir, to_dir = os.path.abspath(from_dir), os.path.abspath(to_dir)
    if from_dir == to_dir:
        return net
    out = None
    for i, lp in enumerate(net.layer):
        for msg, field in _DATA_PATH_FIELDS:
            if not lp.HasField(msg):
                continue
            value = getattr(getattr(lp, msg), field)
            new = _rebased(value, from_dir, to_dir, portable)
            if new != value:
                if out is None:
                    out = type(net)()
                    out.CopyFrom(net)
                setattr(getattr(out.layer[i], msg), field, new)
    return net if out is None else out


def write_prototxt(net, path, inputs=(), source_dir=None):
    """Write net as text to path atomically (temp file + rename). inputs: files it must not replace.

    source_dir: the folder the net's relative data paths were written for (its prototxt's); they
    are rewritten relative to path's folder.
    """
    if source_dir is not None:
        net = rebase_data_paths(net, source_dir, os.path.dirname(os.path.abspath(path)))
    text = net_to_text(net)
    with atomic_output(path, "w", inputs) as f:
        f.write(text)


# -- blobs -------------------------------------------------------------------------

def _blob_parts(blob, what):
    """BlobData / array -> (BlobProto bytes without data, data key+len bytes, float32 array).

    A blob read with legacy num/channels/height/width keeps that form (as
    Caffe's upgrade_net_proto_binary copies blobs untouched); others get `shape`.
    """
    legacy = bool(getattr(blob, "legacy_shape", False))
    arr = blob.array if hasattr(blob, "array") else blob
    if arr is None:
        raise CaffeqError(f"{what}: no data to write")
    arr = np.asarray(arr)
    if arr.dtype != np.dtype("<f4"):
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
                or arr.dtype == np.bool_):
            raise CaffeqError(f"{what}: cannot store dtype {arr.dtype} in a caffemodel")
        arr = arr.astype("<f4")
    shape = arr.shape
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)   # (it would also turn a 0-d array into 1-d)
    head = bytearray()
    if legacy and len(shape) == 4:
        for number, d in zip((_B_NUM, _B_CHANNELS, _B_HEIGHT, _B_WIDTH), shape):
            head += encode_key(number, VARINT) + encode_varint(int(d))
    elif shape:
        dims = b"".join(encode_varint(int(d)) for d in shape)
        shape_msg = len_field(_SHAPE_DIM, len(dims)) + dims
        head += len_field(_B_SHAPE, len(shape_msg)) + shape_msg
    # a 0-axis (scalar) blob has no shape field at all, as Caffe's Blob::ToProto writes it
    nbytes = arr.size * 4
    data_prefix = len_field(_B_DATA, nbytes) if nbytes else b""
    return bytes(head), data_prefix, arr


class _Chunks:
    """Pieces of a message to be written in order: bytes and float32 arrays."""

    def __init__(self):
        self.parts = []
        self.size = 0

    def add(self, piece):
        if isinstance(piece, np.ndarray):
            self.size += piece.nbytes
        else:
            self.size += len(piece)
        self.parts.append(piece)

    def extend(self, other):
        self.parts.extend(other.parts)
        self.size += other.size


def _blob_field(field_number, blob, what):
    head, data_prefix, arr = _blob_parts(blob, what)
    body_len = len(head) + len(data_prefix) + arr.nbytes
    out = _Chunks()
    out.add(len_field(field_number, body_len) + head + data_prefix)
    if arr.nbytes:
        out.add(arr)
    return out


def _message_with_blobs(msg, blobs, blob_field, what):
    """msg (its own `blobs` cleared) serialized, then each blob appended as a field."""
    out = _Chunks()
    out.add(msg.SerializeToString())
    for i, b in enumerate(blobs):
        out.extend(_blob_field(blob_field, b, f"{what} blob {i}"))
    return out


def _without_blobs(msg):
    if len(msg.blobs) == 0:
        return msg, []
    inline = [_blobproto_array(b) for b in msg.blobs]
    stripped = type(msg)()
    stripped.CopyFrom(msg)
    stripped.ClearField("blobs")
    return stripped, inline


def _blobproto_array(bp):
    """An inline caffe_pb2.BlobProto -> array (for nets that still carry their blobs)."""
    if len(bp.double_data) and not len(bp.data):
        data = np.asarray(bp.double_data, np.float64).astype(np.float32)
    else:
        data = np.asarray(bp.data, np.float32)
    if bp.HasField("shape"):
        return data.reshape(tuple(bp.shape.dim))
    if bp.length:   # facebook/C3D's 5-axis blob (Blob::FromProto: num, channels, length, height, width)
        return data.reshape(bp.num, bp.channels, bp.length, bp.height, bp.width)
    if any(bp.HasField(f) for f in ("num", "channels", "height", "width")):
        return data.reshape(bp.num, bp.channels, bp.height, bp.width)
    return data


def _layer_chunks(lp, blobs_by_layer, v1):
    """One V2 LayerParameter (v1=False) or V1/V0 entry (v1=True) as a NetParameter field."""
    what = f"layer '{lp.name}'"
    out = _Chunks()
    if v1 and lp.HasField("layer"):
        # V0: the blobs live in the nested V0 message; the outer entry has none of its own
        v0 = lp.layer
        name = lp.name or v0.name
        v0_bare, inline = _without_blobs(v0)
        blobs = blobs_by_layer.get(name, inline) if blobs_by_layer is not None else inline
        inner = _message_with_blobs(v0_bare, blobs, _V0_BLOBS, what)
        outer = caffe_pb2.V1LayerParameter()
        outer.CopyFrom(lp)
        outer.ClearField("layer")
        outer.ClearField("blobs")
        body = _Chunks()
        body.add(outer.SerializeToString())
        body.add(len_field(_V1_V0LAYER, inner.size))
        body.extend(inner)
        field = _NET_LAYERS
    else:
        bare, inline = _without_blobs(lp)
        blobs = blobs_by_layer.get(lp.name, inline) if blobs_by_layer is not None else inline
        body = _message_with_blobs(bare, blobs, _V1_BLOBS if v1 else _LAYER_BLOBS, what)
        field = _NET_LAYERS if v1 else _NET_LAYER
    out.add(len_field(field, body.size))
    out.extend(body)
    return out


def _write_chunks(f, chunks):
    for piece in chunks.parts:
        if isinstance(piece, np.ndarray):
            # the array's own buffer: no copy, works for read-only mmap views too
            f.write(memoryview(piece.reshape(-1)).cast("B"))
        else:
            f.write(piece)


def write_caffemodel(net, blobs_by_layer, path, inputs=()):
    """Write a binary NetParameter whose layers carry their blobs.

    net: caffe_pb2.NetParameter (V2 `layer`, or legacy `layers`); blobs_by_layer:
    {layer name: [BlobData or array]} (None: use the blobs inside net).  Layers
    missing from the dict keep the blobs the net itself holds (usually none).
    """
    header = caffe_pb2.NetParameter()   # every field but the layers (no copy of the big net)
    for fd, value in net.ListFields():
        if fd.name in ("layer", "layers"):
            continue
        if fd.is_repeated:
            getattr(header, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(header, fd.name).CopyFrom(value)
        else:
            setattr(header, fd.name, value)
    with atomic_output(path, "wb", inputs) as f:
        # NetParameter fields may come in any order; header first, then the layers
        f.write(header.SerializeToString())
        for entry in net.layers:
            _write_chunks(f, _layer_chunks(entry, blobs_by_layer, v1=True))
        for lp in net.layer:
            _write_chunks(f, _layer_chunks(lp, blobs_by_layer, v1=False))


def write_model_caffemodel(model, path, inputs=()):
    """Write a caffeq Model's net and weights (dequantized floats for quantized layers)."""
    blobs = {}
    for node in model.graph.nodes:
        if not node.blobs:
            continue
        if any(b is None for b in node.blobs):
            raise CaffeqError(f"layer '{node.name}' ({node.type}) has missing weight blobs; "
                              f"nothing to write for it")
        blobs.setdefault(node.name, [np.asarray(b, dtype=np.float32) for b in node.blobs])
    write_caffemodel(model.net, blobs, path, inputs)


def blobproto_bytes(array, legacy_shape=False):
    """A BlobProto message (bytes) holding array as packed floats."""
    head, data_prefix, arr = _blob_parts(_Legacy(array, legacy_shape), "blob")
    return head + data_prefix + arr.tobytes()


class _Legacy:
    def __init__(self, array, legacy_shape):
        self.array = array
        self.legacy_shape = legacy_shape


def write_blobproto(array, path, legacy_shape=False, inputs=()):
    """Write a .binaryproto (e.g. a mean file). legacy_shape: 4-D as num/channels/height/width."""
    head, data_prefix, arr = _blob_parts(_Legacy(array, legacy_shape), os.fspath(path))
    with atomic_output(path, "wb", inputs) as f:
        f.write(head + data_prefix)
        if arr.nbytes:
            f.write(memoryview(arr.reshape(-1)).cast("B"))


__all__ = ["blobproto_bytes", "net_to_text", "write_blobproto", "write_caffemodel",
           "write_model_caffemodel", "write_prototxt"]
