"""Writing an ONNX ModelProto as a stream: the small graph is serialized by protobuf, and each
initializer's bytes are written straight from the (memory-mapped) weights, so exporting a 550 MB
caffemodel holds no extra copy of the weights.  The check (`onnx.checker.check_model(full_check=True)`,
strict shape inference) runs on a small twin of the model whose initializers point, as ONNX external
data, at the bytes just written.
"""
import mmap
import os
import tempfile

import numpy as np

from ..errors import ExportError
from ..io.wire import len_field

EXTERNAL_MIN_BYTES = 1024      # smaller tensors (shape constants) stay in the .onnx file
INLINE_INDEX_MAX_BYTES = 1 << 24   # integer tables up to this size stay inline in the shape-inference twin
INTEGER_TYPES = (2, 3, 4, 5, 6, 7, 9, 12, 13)   # TensorProto UINT8, INT8, UINT16, INT16, INT32, INT64, BOOL, UINT32, UINT64
ALIGN = 4096                   # external data offsets, page aligned so runtimes can mmap them


class Initializer:
    __slots__ = ("array", "transpose")

    def __init__(self, array, transpose=False):
        self.array = array
        self.transpose = transpose

    def shape(self):
        s = tuple(self.array.shape)
        return s[::-1] if self.transpose else s

    def dtype(self):
        return self.array.dtype

    def nbytes(self):
        return int(self.array.nbytes)

    def data(self):
        """C-contiguous little-endian array (no copy for untransposed mmap views)."""
        a = self.array.T if self.transpose else self.array
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        return np.ascontiguousarray(a, dtype=dt)


# ---- building and writing the ModelProto ----------------------------------------------------

# Fields written by hand around the initializers' raw bytes (onnx.proto)
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _tensor_header(name, init):
    import onnx
    tp = onnx.TensorProto()
    tp.name = name
    tp.dims.extend(int(d) for d in init.shape())
    tp.data_type = onnx.helper.np_dtype_to_tensor_dtype(init.dtype())
    return tp


def _set_external(tp, location, offset, length):
    import onnx
    tp.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = tp.external_data.add()
        e.key, e.value = k, v


class Layout:
    """Where each initializer's bytes go: embedded in the .onnx file or in the data file."""

    def __init__(self, inits, external):
        self.external = external
        self.items = []   # (name, init, header TensorProto, external?, data offset or None)
        offset = 0
        for name, init in inits.items():
            tp = _tensor_header(name, init)
            ext = external and init.nbytes() >= EXTERNAL_MIN_BYTES
            off = None
            if ext:
                offset = -(-offset // ALIGN) * ALIGN
                off = offset
                offset += init.nbytes()
            self.items.append([name, init, tp, ext, off])


def graph_rest(g):
    return g.SerializeToString()


def _embedded_size(header_bytes, nbytes):
    return len(header_bytes) + len(len_field(_TENSOR_RAW_DATA, nbytes)) + nbytes


def write_model(path, model_rest, graph_rest, layout, data_path=None, data_location=None,
                 sources=None):
    """Stream the ModelProto to `path` (and external data to `data_path`).

    sources: an ArraySources that finds arrays which are views of a weights file, so
    their bytes are copied file to file by the kernel (no page faults, no RSS).
    Returns [(name, file written, absolute offset, length)] of every initializer's bytes.
    """
    where = []
    headers = []
    for name, init, tp, ext, off in layout.items:
        h = onnx_copy(tp)
        if ext:
            _set_external(h, data_location, off, init.nbytes())
            hb = h.SerializeToString()
            msg_len = len(hb)
        else:
            hb = h.SerializeToString()
            msg_len = _embedded_size(hb, init.nbytes())
        headers.append((hb, msg_len))
    graph_len = len(graph_rest) + sum(len(len_field(_GRAPH_INITIALIZER, m)) + m for _, m in headers)
    with _Out(path, sources) as f:
        f.write(model_rest)
        f.write(len_field(_MODEL_GRAPH, graph_len))
        f.write(graph_rest)
        for (name, init, tp, ext, off), (hb, msg_len) in zip(layout.items, headers):
            f.write(len_field(_GRAPH_INITIALIZER, msg_len))
            f.write(hb)
            if not ext:
                f.write(len_field(_TENSOR_RAW_DATA, init.nbytes()))
                where.append((name, path, f.pos, init.nbytes()))
                f.write_init(init)
    if data_path is not None:
        with _Out(data_path, sources) as f:
            for name, init, tp, ext, off in layout.items:
                if not ext:
                    continue
                if off > f.pos:
                    f.write(b"\0" * (off - f.pos))
                where.append((name, data_path, off, init.nbytes()))
                f.write_init(init)
    return where


class ArraySources:
    """Finds arrays that are untouched views of a weights file (the caffemodel's mmap)."""

    def __init__(self, paths):
        self.files = {}     # id(mmap) -> (fd, base address, size) or None
        self.paths = [p for p in paths if p and os.path.isfile(p)]
        self.fds = []

    def locate(self, arr):
        """(fd, offset) of arr's bytes in a weights file, or None."""
        if not (isinstance(arr, np.ndarray) and arr.flags.c_contiguous and arr.dtype == np.dtype("<f4")
                and arr.nbytes):
            return None
        b = arr
        while isinstance(b, np.ndarray):
            b = b.base
        mm = b.obj if isinstance(b, memoryview) else b
        if not isinstance(mm, mmap.mmap):
            return None
        key = id(mm)
        if key not in self.files:
            self.files[key] = self._match(mm)
        hit = self.files[key]
        if hit is None:
            return None
        fd, base, size = hit
        off = arr.__array_interface__["data"][0] - base
        if off < 0 or off + arr.nbytes > size:
            return None
        # the same bytes at both ends: the file is the one mapped, and unchanged
        n = min(64, arr.nbytes)
        raw = arr.reshape(-1).view(np.uint8)
        try:
            if os.pread(fd, n, off) != raw[:n].tobytes() or \
                    os.pread(fd, n, off + arr.nbytes - n) != raw[arr.nbytes - n:].tobytes():
                return None
        except OSError:
            return None
        return fd, off

    def _match(self, mm):
        try:
            base = np.frombuffer(mm, np.uint8, count=1).__array_interface__["data"][0]
        except (ValueError, TypeError):
            return None
        for p in self.paths:
            try:
                if os.path.getsize(p) != len(mm):
                    continue
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            self.fds.append(fd)
            return fd, base, len(mm)
        return None

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class _Out:
    """A raw output file that tracks its position and copies file ranges in the kernel."""

    def __init__(self, path, sources):
        self.path = path
        self.sources = sources
        self.pos = 0
        self.fd = None

    def __enter__(self):
        # no O_TRUNC: the file is a fresh, empty temporary, and a truncate makes ext4 flush
        # the whole file to disk on close (its auto_da_alloc heuristic)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, 0)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)

    def write(self, data):
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            done += os.write(self.fd, mv[done:done + (64 << 20)])
        self.pos += len(mv)

    def write_init(self, init):
        if not init.transpose and self.sources is not None and hasattr(os, "copy_file_range"):
            loc = self.sources.locate(init.array)
            if loc is not None:
                self._copy_range(loc[0], loc[1], init.nbytes())
                return
        data = init.data()
        if data.size:
            self.write(data.reshape(-1).view(np.uint8))

    def _copy_range(self, src, offset, count):
        done = 0
        try:
            while done < count:
                n = os.copy_file_range(src, self.fd, count - done, offset + done)
                if n <= 0:
                    break
                done += n
        except OSError:
            pass        # e.g. another filesystem on an old kernel: plain reads below
        self.pos += done
        os.lseek(self.fd, self.pos, os.SEEK_SET)
        while done < count:
            chunk = os.pread(src, min(count - done, 64 << 20), offset + done)
            if not chunk:
                raise OSError("weights file shrank while converting")
            self.write(chunk)
            done += len(chunk)


def onnx_copy(msg):
    new = type(msg)()
    new.CopyFrom(msg)
    return new


def twin(model_rest_proto, graph_proto, layout, where=None):
    """A small ModelProto equal to the written one, big initializers as external references.

    where: [(name, file, offset, length)] of the written bytes; None makes references to a
    file that does not exist (enough for shape inference, which never reads weights).
    """
    m = onnx_copy(model_rest_proto)
    m.graph.CopyFrom(graph_proto)
    loc = {w[0]: w for w in where} if where is not None else {}
    for name, init, tp, ext, off in layout.items:
        t = onnx_copy(tp)
        # integer constants (index tables that a Gather reads) stay inline: shape inference's data propagation
        # reads them and cannot read an external tensor
        index_table = tp.data_type in INTEGER_TYPES and init.nbytes() <= INLINE_INDEX_MAX_BYTES
        if (init.nbytes() >= EXTERNAL_MIN_BYTES or ext) and not index_table:
            if where is not None:
                _, fpath, offset, length = loc[name]
                _set_external(t, os.path.basename(fpath), offset, length)
            else:
                _set_external(t, "__caffeq_unwritten__", 0, init.nbytes())
        else:
            t.raw_data = init.data().tobytes()
        m.graph.initializer.append(t)
    return m


def infer_shapes(twin, strict):
    """ONNX shape inference on the twin -> (inferred ModelProto or None, notes)."""
    import onnx
    try:
        inferred = onnx.shape_inference.infer_shapes(twin, strict_mode=strict, data_prop=True)
    except Exception as e:  # noqa: BLE001 -- inference raises several kinds; one message
        if strict:
            text = str(e).strip()
            raise ExportError(f"ONNX shape inference rejects the exported graph: "
                              f"{text.splitlines()[-1] if text else type(e).__name__}") from None
        return None, []
    known = {vi.name: vi for vi in inferred.graph.value_info}
    known.update({vi.name: vi for vi in inferred.graph.output})
    graph_in = {vi.name for vi in twin.graph.input} | {t.name for t in twin.graph.initializer}
    missing, partial = [], []
    for node in twin.graph.node:
        for o in node.output:
            if not o or o in graph_in:
                continue
            vi = known.get(o)
            if vi is None or not vi.type.tensor_type.HasField("shape"):
                missing.append(o)
            elif any(not (d.HasField("dim_value") or d.HasField("dim_param"))
                     for d in vi.type.tensor_type.shape.dim):
                partial.append(o)
    notes = []
    if missing and strict:
        raise ExportError(f"ONNX shape inference leaves the shape of {len(missing)} tensor(s) "
                          f"unknown: {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}")
    if partial:
        notes.append(f"{len(partial)} tensor(s) have data-dependent dims: "
                     f"{', '.join(partial[:5])}{', ...' if len(partial) > 5 else ''}")
    return inferred, notes


def inferred_dims(vi):
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    out = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(int(d.dim_value) if d.HasField("dim_value") else
                   (d.dim_param if d.HasField("dim_param") else None))
    return out


def check_written(folder, twin):
    """onnx.checker.check_model(full_check=True) on the twin that points at the written bytes."""
    import onnx
    fd, tpath = tempfile.mkstemp(prefix=".caffeq-check-", suffix=".onnx", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(twin.SerializeToString())
        onnx.checker.check_model(tpath, full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"the ONNX checker rejects the exported model: {' '.join(str(e).split())}") from None
    except onnx.shape_inference.InferenceError as e:
        raise ExportError(f"ONNX shape inference rejects the exported model: {' '.join(str(e).split())}") \
            from None
    finally:
        try:
            os.unlink(tpath)
        except OSError:
            pass
