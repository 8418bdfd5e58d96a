"""The `.caffeq` container: the upgraded prototxt plus weights at their precision.

The file is a plain safetensors file (https://github.com/huggingface/safetensors),
written and read here without pickle and without the safetensors package:

    8 bytes    little-endian u64 N, the header length
    N bytes    UTF-8 JSON header, padded with spaces to a multiple of 8
    rest       the tensor bytes, back to back, little-endian, C order

The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the start of the data) and holds string metadata under
"__metadata__":

    format          "caffeq"
    format_version  "1" (readers refuse newer major versions)
    caffeq_version  the writer's version
    prototxt        the upgraded net (caffe.NetParameter text format, V2 layers,
                    no blobs)
    layout          JSON list, one entry per weight blob, in layer order:
                    {"layer", "index", "shape", "scheme", "axis", "groups",
                     "tensors": {role: tensor name}} or, for a blob shared with
                    an earlier layer (ParamSpec name), {"layer", "index",
                    "shape", "shared": [owner layer, owner index]}
    quantization    JSON {layer: target} (layers whose weights changed)
    report          JSON of the quantization report (caffeq.quant.QuantReport), or ""
    data_shapes     JSON {data layer: [top shapes]}: the shapes the data layers' tops take
                    when the file is read, so no dataset is needed where it is read
    outputs         JSON [blob]: the outputs chosen at load time ([]: Caffe's own)
    input_shapes    JSON {blob: shape}: the input shapes given at load time

The prototxt's relative data paths (sources, mean files) are rewritten relative to the
.caffeq file's folder when it is written; no absolute local path is stored. (Files written
by caffeq 0.1.0 before this also held "source_dir", the original prototxt's folder; readers
still use it when the paths do not resolve beside the file.)

Schemes and their tensors (names are "<layer>.<blob index>[.<role>]"):

    fp32    data   F32, the blob's shape
    fp16    data   F16, the blob's shape
    int8    codes  I8, the blob's shape; scale F32 (output channels,);
            w = codes * scale[channel]
    binary  signs  U8 (ceil(n / 8),): the blob's elements in C order, bit k of
            byte i is element 8i + k, 1 means +1 and 0 means -1;
            alpha F32 (output channels,); w = alpha[channel] * sign

"axis" is the output-channel axis; "groups" > 1 marks a grouped Deconvolution
(weights C_in x C_out/group x k...), whose output channel g * (C_out/group) + j
is the slices [rows of group g, column j].

Tensors are ordered by element size (4-byte first) so that every one starts at
an address aligned to its type; readers map the file and use zero-copy views.
Dequantizing on load runs the same code as quantizing did, so a round trip
gives bit-identical weights and outputs.
"""
import json
import mmap
import os
import struct
from typing import NamedTuple

import numpy as np

from ..errors import ParseError, WeightsError
from ..fs import atomic_path
from ..graph_weights import attach_weights, share_params
from ..ir import build_graph
from ..quant.base import QuantizedBlob, num_channels
from ..quant.binary import pack_signs, unpack_signs
from ..quant.report import QuantReport
from ..version import __version__
from .schema import caffe_pb2
from .writer import rebase_data_paths

FORMAT = "caffeq"
FORMAT_VERSION = 1
MAX_HEADER = 1 << 30

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
           "F64": np.dtype("<f8"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8")}
_CODES = {v.type: k for k, v in _DTYPES.items()}


# ---- the safetensors layer --------------------------------------------------------------

def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, array); metadata: {str: str}.  Writes `path` directly."""
    header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    order = sorted(range(len(tensors)), key=lambda k: -np.asarray(tensors[k][1]).dtype.itemsize)
    offset = 0
    arrays = []
    for k in order:
        name, arr = tensors[k]
        arr = np.asarray(arr)
        code = _CODES.get(arr.dtype.type)
        if code is None:
            raise TypeError(f"tensor {name}: dtype {arr.dtype} cannot be stored")
        if name in header:
            raise ValueError(f"duplicate tensor name {name}")
        n = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": code, "shape": [int(d) for d in arr.shape],
                        "data_offsets": [offset, offset + n]}
        arrays.append(arr)
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            a = np.ascontiguousarray(arr, dtype=_DTYPES[_CODES[arr.dtype.type]])
            f.write(memoryview(a.reshape(-1)).cast("B") if a.size else b"")


def read_safetensors(path):
    """-> (metadata dict, {name: read-only numpy view into the mapped file})."""
    size = os.path.getsize(path)
    if size < 8:
        raise ParseError(f"{path}: too short for a .caffeq file ({size} bytes)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, MAX_HEADER):
            raise ParseError(f"{path}: not a .caffeq (safetensors) file: header length {n} "
                             f"exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ParseError(f"{path}: not a .caffeq (safetensors) file: bad header ({e})") from None
        if not isinstance(header, dict):
            raise ParseError(f"{path}: not a .caffeq (safetensors) file: header is not an object")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else b""
    base = 8 + n
    data_len = size - base
    meta = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        try:
            dt = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ParseError(f"{path}: tensor {name!r}: unsupported or malformed entry {info!r}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_len or end - begin != count * dt.itemsize:
            raise ParseError(f"{path}: tensor {name!r}: offsets {begin}..{end} do not fit shape "
                             f"{list(shape)} {info['dtype']} in {data_len} data bytes (truncated file?)")
        arr = np.frombuffer(mm, dtype=dt, count=count, offset=base + begin) if count else np.empty(0, dt)
        tensors[name] = arr.reshape(shape)
    return meta, tensors


# ---- caffeq models -------------------------------------------------------------------------

def _net_text(net):
    from google.protobuf import text_format
    clean = type(net)()
    clean.CopyFrom(net)
    for lp in clean.layer:
        del lp.blobs[:]
    return text_format.MessageToString(clean)


def _blob_tensors(node, i, arr):
    """(layout entry, [(tensor name, array)]) for blob i of node."""
    key = f"{node.name}.{i}"
    entry = {"layer": node.name, "index": i, "shape": [int(d) for d in np.shape(arr)]}
    if i in node.shared_from:
        owner, j = node.shared_from[i]
        entry["shared"] = [owner, int(j)]
        return entry, []
    qb = node.quant.get(i)
    if qb is None:
        entry.update(scheme="fp32", axis=None, groups=1, tensors={"data": key})
        return entry, [(key, np.asarray(arr, np.float32))]
    entry.update(scheme=qb.scheme, axis=None if qb.axis is None else int(qb.axis), groups=int(qb.groups))
    if qb.scheme == "fp16":
        entry["tensors"] = {"data": key}
        return entry, [(key, np.asarray(qb.codes, np.float16))]
    if qb.scheme == "int8":
        entry["tensors"] = {"codes": key + ".codes", "scale": key + ".scale"}
        return entry, [(key + ".codes", np.asarray(qb.codes, np.int8)),
                       (key + ".scale", np.asarray(qb.scale, np.float32))]
    if qb.scheme == "binary":
        entry["tensors"] = {"signs": key + ".signs", "alpha": key + ".alpha"}
        return entry, [(key + ".signs", pack_signs(qb.codes)),
                       (key + ".alpha", np.asarray(qb.scale, np.float32))]
    raise WeightsError(f"layer '{node.name}' blob {i}: unknown quantization scheme {qb.scheme!r}")


def _model_data_dir(model):
    """The folder the model's relative data paths resolve from (its prototxt's, as the IR saw it)."""
    for node in model.graph.nodes:
        base = node.attrs.get("base_dir") if isinstance(node.attrs, dict) else None
        if base:
            return base
    prototxt = getattr(model, "prototxt", None)
    return os.path.dirname(os.path.abspath(prototxt)) if prototxt else os.getcwd()


def save_caffeq(model, path):
    """Write `model` (quantized or not) to a .caffeq file; atomic (temp file + rename)."""
    missing = [n.name for n in model.graph.nodes
               if n.has_params and (n.blobs is None or any(b is None for b in n.blobs))]
    if missing:
        raise WeightsError(f"{path}: no weights for layer(s) {', '.join(missing[:5])}; a .caffeq file "
                           f"holds trained weights")
    layout, tensors = [], []
    for node in model.graph.nodes:
        for i, arr in enumerate(node.blobs or []):
            if arr is None:
                continue
            entry, ts = _blob_tensors(node, i, arr)
            layout.append(entry)
            tensors.extend(ts)
    report = model.quant_report
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "caffeq_version": __version__,
        # data paths relative to the .caffeq file's folder (no local absolute path is stored)
        "prototxt": _net_text(rebase_data_paths(model.net, _model_data_dir(model),
                                                os.path.dirname(os.path.abspath(os.fspath(path))),
                                                portable=True)),
        "phase": str(getattr(model, "phase", "TEST")),
        "layout": json.dumps(layout, separators=(",", ":")),
        "quantization": json.dumps(dict(model.quantization)),
        "report": report.to_json() if report is not None else "",
        # the user's choices at load time, so the file rebuilds the same graph
        "outputs": json.dumps(list(model.output_names)),
        "input_shapes": json.dumps({k: list(v) for k, v in model.input_shapes.items()}),
        # the data layers' top shapes: the file still loads where their sources are not found
        "data_shapes": json.dumps({n.name: [_shape_list(model.graph.tensors[t].shape) for t in n.outputs]
                                   for n in model.graph.nodes if n.spec.is_data}),
    }
    path = os.fspath(path)
    with atomic_path(path) as tmp:
        write_safetensors(tmp, tensors, meta)
    return path


def _get(tensors, path, entry, role):
    name = (entry.get("tensors") or {}).get(role)
    if name not in tensors:
        raise ParseError(f"{path}: layer '{entry.get('layer')}' blob {entry.get('index')}: "
                         f"tensor {name!r} ({role}) missing from the file")
    return tensors[name]


def _decode(path, entry, tensors):
    """-> (float32 array, QuantizedBlob or None) for one layout entry."""
    shape = tuple(int(d) for d in entry["shape"])
    scheme = entry.get("scheme")
    where = f"{path}: layer '{entry.get('layer')}' blob {entry.get('index')}"

    def check(arr, want, what):
        if tuple(arr.shape) != tuple(want):
            raise ParseError(f"{where}: {what} has shape {list(arr.shape)}, expected {list(want)}")

    if scheme == "fp32":
        data = _get(tensors, path, entry, "data")
        check(data, shape, "data")
        return data.astype(np.float32, copy=False), None
    axis = entry.get("axis")
    groups = int(entry.get("groups") or 1)
    if scheme == "fp16":
        codes = _get(tensors, path, entry, "data")
        check(codes, shape, "data")
        qb = QuantizedBlob("fp16", None, None, codes, 1)
        return qb.dequantize(), qb
    if axis is not None and not 0 <= int(axis) < max(len(shape), 1):
        raise ParseError(f"{where}: axis {axis} out of range for shape {list(shape)}")
    channels = num_channels(shape, axis, groups)
    if scheme == "int8":
        codes = _get(tensors, path, entry, "codes")
        scale = _get(tensors, path, entry, "scale")
        check(codes, shape, "codes")
    elif scheme == "binary":
        signs = _get(tensors, path, entry, "signs")
        scale = _get(tensors, path, entry, "alpha")
        n = int(np.prod(shape, dtype=np.int64))
        check(signs, ((n + 7) // 8,), "signs")
        codes = unpack_signs(signs, shape)
    else:
        raise ParseError(f"{where}: unknown scheme {scheme!r}")
    check(scale, (channels,), "scale")
    qb = QuantizedBlob(scheme, axis, np.asarray(scale, np.float32), codes, groups)
    return qb.dequantize(), qb


def read_caffeq(path):
    """-> (metadata, NetParameter, {layer: [float32 arrays]}, {layer: {index: QuantizedBlob}})."""
    from google.protobuf import text_format

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ParseError(f"{path}: no such file")
    meta, tensors = read_safetensors(path)
    if meta.get("format") != FORMAT:
        raise ParseError(f"{path}: a safetensors file but not a .caffeq model (no format: caffeq in its "
                         f"metadata)")
    try:
        version = int(str(meta.get("format_version", "")).split(".")[0])
    except ValueError:
        raise ParseError(f"{path}: bad format_version {meta.get('format_version')!r}") from None
    if version > FORMAT_VERSION:
        raise ParseError(f"{path}: .caffeq format version {version} is newer than this caffeq reads "
                         f"({FORMAT_VERSION}); upgrade caffeq")
    net = caffe_pb2.NetParameter()
    try:
        text_format.Parse(meta.get("prototxt", ""), net)
        layout = json.loads(meta.get("layout", "[]"))
    except (text_format.ParseError, ValueError) as e:
        raise ParseError(f"{path}: corrupt metadata: {e}") from None
    blobs, quant = {}, {}
    shared = []
    for entry in layout:
        try:
            layer, idx = str(entry["layer"]), int(entry["index"])
            tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise ParseError(f"{path}: corrupt layout entry {entry!r}") from None
        lst = blobs.setdefault(layer, [])
        while len(lst) <= idx:
            lst.append(None)
        if "shared" in entry:
            shared.append((layer, idx, entry))
            continue
        arr, qb = _decode(path, entry, tensors)
        lst[idx] = arr
        if qb is not None:
            quant.setdefault(layer, {})[idx] = qb
    for layer, idx, entry in shared:
        owner, j = entry["shared"]
        src = blobs.get(owner, [])
        if j >= len(src) or src[j] is None:
            raise ParseError(f"{path}: layer '{layer}' blob {idx} shares '{owner}' blob {j}, which the "
                             f"file does not hold")
        blobs[layer][idx] = src[j].reshape(tuple(entry["shape"]))
    return meta, net, blobs, quant


class CaffeqParts(NamedTuple):
    graph: object
    net: object
    quantization: dict    # layer -> quantizer name
    report: object        # QuantReport or None
    warnings: list
    input_shapes: dict    # the load-time choices the file was saved with (or the caller's)
    outputs: list


def _shape_list(shape):
    return None if shape is None else list(shape)


def _data_base_dir(net, path, source_dir):
    """Where relative data sources resolve: beside the .caffeq file, else the original prototxt's folder."""
    here = os.path.dirname(os.path.abspath(path))
    sources = [lp.data_param.source or lp.image_data_param.source for lp in net.layer
               if lp.data_param.source or lp.image_data_param.source]
    if source_dir and os.path.isdir(source_dir) and not all(
            os.path.isabs(s) or os.path.exists(os.path.join(here, s)) for s in sources):
        return source_dir
    return here


def load_caffeq_parts(path, phase="TEST", batch=None, input_shapes=None, outputs=None):
    """A .caffeq file -> CaffeqParts: the graph with the stored (dequantized) weights and node.quant,
    and what caffeq.load needs to make the Model of it.  input_shapes / outputs: as caffeq.load
    (default: the choices stored in the file)."""
    path = os.fspath(path)
    meta, net, blobs, quant = read_caffeq(path)
    try:
        if outputs is None:
            outputs = [str(b) for b in json.loads(meta.get("outputs") or "[]")]
        stored = {str(k): tuple(int(d) for d in v)
                  for k, v in json.loads(meta.get("input_shapes") or "{}").items()}
        # the data layers' shapes at saving: the file loads where their sources are not found
        for layer, shapes in json.loads(meta.get("data_shapes") or "{}").items():
            tops = next((list(lp.top) for lp in net.layer if lp.name == layer), [])
            stored.update({t: tuple(int(d) for d in s) for t, s in zip(tops, shapes) if s is not None})
    except (ValueError, TypeError, AttributeError):
        raise ParseError(f"{path}: the stored outputs or input shapes are corrupt") from None
    input_shapes = {**stored, **(input_shapes or {})}
    graph = build_graph(net, None, phase=phase, batch=batch, source=path,
                        base_dir=_data_base_dir(net, path, meta.get("source_dir") or ""),
                        input_shapes=input_shapes, outputs=outputs)
    attach_weights(graph, {k: [b for b in v] for k, v in blobs.items()}, path, path)
    share_params(graph)
    for node in graph.nodes:
        q = quant.get(node.name)
        if q:
            node.quant = {i: (qb if tuple(qb.shape) == tuple(np.shape(node.blobs[i])) else qb.reshaped(
                np.shape(node.blobs[i]))) for i, qb in q.items()}
            node.quant = {i: qb for i, qb in node.quant.items() if qb is not None}
    try:
        quantization = dict(json.loads(meta.get("quantization") or "{}"))
    except ValueError:
        quantization = {}
    report, warnings = None, []
    rep = meta.get("report") or ""
    if rep:
        try:
            report = QuantReport.from_dict(json.loads(rep))
        except (ValueError, KeyError, TypeError):
            warnings.append(f"{path}: the stored quantization report could not be read")
    return CaffeqParts(graph, net, quantization, report, warnings, input_shapes, outputs)
