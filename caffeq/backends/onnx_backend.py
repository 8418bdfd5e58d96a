"""Graph IR -> ONNX, emitted layer by layer by the specs' `onnx(ctx, node)` (no tracing).

Names: Caffe blob names (the IR's SSA names) are the ONNX tensor names, layer
names are the node names of each layer's main op, graph inputs and outputs
keep Caffe's names.  Dim 0 is a symbolic "N" unless a fixed batch is asked.

Default opset: 21 (onnxruntime >= 1.20 runs it); any opset from 13 up works.

The file is streamed: the small graph is serialized by protobuf, and each
initializer's bytes are written straight from the (memory-mapped) weights, so
exporting a 550 MB caffemodel holds no extra copy of the weights.  The check
(`onnx.checker.check_model(full_check=True)`, strict shape inference) runs on
a small twin of the model whose initializers point, as ONNX external data,
at the bytes just written.
"""
import mmap
import os
import re
import tempfile
from collections import Counter

import numpy as np

from ..errors import CaffeqError, ExportError
from ..fs import atomic_path, refuse_overwrite
from .onnx_weights import emit_quantized_weight
from ..io.wire import len_field
from ..transforms import optimize as run_transforms
from ..version import __version__

DEFAULT_OPSET = 21
MIN_OPSET = 13
# protobuf refuses messages of 2 GiB and more; keep a margin for the graph itself
_MAX_EMBEDDED = (1 << 31) - (64 << 20)
_EXTERNAL_MIN_BYTES = 1024      # smaller tensors (shape constants) stay in the .onnx file
_ALIGN = 4096                   # external data offsets, page aligned so runtimes can mmap them


# ---- the emission context ---------------------------------------------------------

class _Init:
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


def _attr_value(v):
    """Python/numpy attribute values -> what onnx.helper.make_attribute takes."""
    import onnx
    if isinstance(v, np.ndarray):
        return onnx.numpy_helper.from_array(v)
    if isinstance(v, (np.integer, np.bool_)):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_attr_value(x) for x in v]
    return v


class OnnxContext:
    """What a layer spec's `onnx(ctx, node)` emits into.  See the ONNX emission contract."""

    def __init__(self, graph, opset):
        self.graph = graph
        self.opset = int(opset)
        self.nodes = []                 # onnx NodeProto, in order
        self.initializers = {}          # name -> _Init
        self.domains = {}               # custom domain -> version
        self.notes = []
        self.layer = None               # the Node being emitted
        self._names = set(graph.tensors)
        self._node_names = set()
        self._const_cache = {}
        self._weight_cache = {}

    # -- shapes -------------------------------------------------------------------------
    def shape(self, name):
        """Caffe's static shape of an IR tensor (dim 0 is the prototxt's batch)."""
        t = self.graph.tensors.get(name)
        if t is not None:
            return tuple(t.shape)
        raise ExportError(f"{self._where()}: no static shape known for tensor '{name}'")

    # -- names --------------------------------------------------------------------------
    def _where(self):
        n = self.layer
        return f"layer '{n.name}' ({n.type})" if n is not None else "graph"

    def _unique(self, base, taken):
        base = base or "t"
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    def tmp(self, hint="t"):
        return self._unique(str(hint), self._names)

    # -- nodes --------------------------------------------------------------------------
    def add_node(self, op_type, inputs, outputs, name=None, domain="", **attrs):
        import onnx
        single = isinstance(outputs, str)
        outs = [outputs] if single else list(outputs)
        ins = [inputs] if isinstance(inputs, str) else list(inputs)
        if name is None:
            name = f"{self.layer.name}/{op_type}" if self.layer is not None else op_type
        name = self._unique(name, self._node_names)
        for o in outs:
            if o:
                self._names.add(o)
        clean = {k: _attr_value(v) for k, v in attrs.items() if v is not None}
        node = onnx.helper.make_node(op_type, ins, outs, name=name, domain=domain or None, **clean)
        if domain and domain not in self.domains:
            self.domains[domain] = 1
        self.nodes.append(node)
        return outs[0] if single else outs

    # -- constants and weights ------------------------------------------------------------
    def const(self, array, hint=None):
        """An initializer holding `array` (its dtype kept); small equal constants are shared."""
        a = np.asarray(array)
        if a.dtype == object:
            raise ExportError(f"{self._where()}: constant of dtype object")
        key = None
        if a.nbytes <= 4096:
            key = (a.dtype.str, a.shape, a.tobytes())
            hit = self._const_cache.get(key)
            if hit is not None:
                return hit
        if hint is None:
            hint = f"{self.layer.name}_const" if self.layer is not None else "const"
        name = self.tmp(hint)
        self.initializers[name] = _Init(a)
        if key is not None:
            self._const_cache[key] = name
        return name

    def weight(self, node, index, transpose=False):
        """Name of a float32 tensor holding node.blobs[index] (transposed when asked)."""
        key = (node.name, index, bool(transpose))
        hit = self._weight_cache.get(key)
        if hit is not None:
            return hit
        quant = node.quant
        if quant and index in quant:
            name = self._quantized_weight(node, index, transpose)
            if name is not None:
                self._weight_cache[key] = name
                return name
        shared = node.shared_from.get(index)
        if shared is not None:
            owner = self._node(shared[0])
            if owner is not None and owner.blobs is not None and owner.blobs[shared[1]] is not None \
                    and tuple(owner.blobs[shared[1]].shape) == tuple(node.blobs[index].shape):
                name = self.weight(owner, shared[1], transpose)
                self._weight_cache[key] = name
                return name
        if node.blobs is None or index >= len(node.blobs) or node.blobs[index] is None:
            raise ExportError(f"layer '{node.name}' ({node.type}): weight blob {index} is not loaded "
                              f"(pass the caffemodel)")
        arr = np.asarray(node.blobs[index])
        if arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        if transpose and arr.ndim != 2:
            raise ExportError(f"layer '{node.name}': cannot transpose a {arr.ndim}-axis blob")
        names = node.spec.blob_names
        base = f"{node.name}.{names[index] if index < len(names) else f'blob{index}'}"
        if transpose and any(k[:2] == key[:2] for k in self._weight_cache):
            base += "_T"
        name = self._unique(base, self._names)
        self.initializers[name] = _Init(arr, bool(transpose))
        self._weight_cache[key] = name
        return name

    def _quantized_weight(self, node, index, transpose):
        return emit_quantized_weight(self, node, index, transpose)

    def _node(self, name):
        for n in self.graph.nodes:
            if n.name == name:
                return n
        return None


# ---- walking the IR ------------------------------------------------------------------------

def _refusal(node, err):
    msg = str(err).strip() or type(err).__name__
    prefix = f"layer '{node.name}'"
    if msg.startswith(prefix):
        msg = msg[len(prefix):].lstrip(" :")
        if msg.startswith(f"({node.type})"):
            msg = msg[len(node.type) + 2:].lstrip(" :")
    return node.name, node.type, msg


def _live_io(graph):
    """(kept nodes, graph inputs, graph outputs, dropped training-only nodes) of the inference graph."""
    kept, dropped = [], []
    gone = set()     # tensors of dropped layers: whatever reads them goes too
    for n in graph.nodes:
        if n.spec.is_data:
            continue
        if n.spec.is_training_only or any(t in gone for t in n.inputs):
            dropped.append(n)
            gone.update(n.outputs)
        else:
            kept.append(n)
    kept_ids = {id(n) for n in kept}
    uses_kept, uses_dropped = set(), set()
    for n in graph.nodes:
        if n.spec.is_data:
            continue
        (uses_kept if id(n) in kept_ids else uses_dropped).update(n.inputs)
    produced_by_dropped = {o for n in dropped for o in n.outputs}
    outputs = [t for t in graph.outputs if t not in produced_by_dropped]
    if dropped:
        # tensors that only fed losses/accuracy (the scores) become the outputs
        for n in graph.nodes:
            if id(n) not in kept_ids:
                continue
            for o in n.outputs:
                if o in uses_dropped and o not in uses_kept and o not in outputs:
                    outputs.append(o)
    inputs = [t for t in graph.inputs
              if t in uses_kept or t in outputs or t not in uses_dropped]
    return kept, inputs, outputs, dropped


def emit_graph(graph, opset):
    """Run every kept layer's emission -> (ctx, refusals, inputs, outputs, dropped)."""
    ctx = OnnxContext(graph, opset)
    kept, inputs, outputs, dropped = _live_io(graph)
    refusals = []
    for node in kept:
        ctx.layer = node
        if not node.spec.has_onnx():
            refusals.append((node.name, node.type, "no ONNX emission for this layer type"))
            continue
        # a refused layer leaves partial nodes behind; the export stops before writing anyway
        try:
            node.spec.onnx(ctx, node)
        except (ExportError, CaffeqError, NotImplementedError) as e:
            refusals.append(_refusal(node, e))
        except Exception as e:  # noqa: BLE001 -- a bug in an emission: still list every refusal
            refusals.append((node.name, node.type, f"ONNX emission failed: {type(e).__name__}: {e}"))
    ctx.layer = None
    return ctx, refusals, inputs, outputs, dropped


def _refusal_error(source, refusals):
    parts = "; ".join(f"layer '{n}' ({t}): {m}" for n, t, m in refusals)
    err = ExportError(f"{source + ': ' if source else ''}cannot export to ONNX, "
                      f"{len(refusals)} layer(s) refused: {parts}")
    err.refused = [n for n, _, _ in refusals]
    return err


# ---- constant folding of layout-only ops on weights --------------------------------------------

_LAYOUT_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Identity")


def _eval_layout(node, arrays):
    import onnx
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    x = arrays[0]
    op = node.op_type
    if op == "Identity":
        return x
    if op == "Transpose":
        return np.transpose(x, attrs.get("perm") or None)
    if op == "Flatten":
        axis = attrs.get("axis", 1)
        axis = axis + x.ndim if axis < 0 else axis
        return x.reshape(int(np.prod(x.shape[:axis])), -1)
    if op == "Reshape":
        if len(arrays) < 2:
            return None
        dims = [int(d) for d in arrays[1].reshape(-1)]
        if not attrs.get("allowzero", 0):
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return x.reshape(dims)
    if op == "Unsqueeze":
        axes = [int(a) for a in arrays[1].reshape(-1)] if len(arrays) > 1 else attrs.get("axes")
        if axes is None:
            return None
        rank = x.ndim + len(axes)
        for a in sorted(a + rank if a < 0 else a for a in axes):
            x = np.expand_dims(x, a)
        return x
    if op == "Squeeze":
        axes = [int(a) for a in arrays[1].reshape(-1)] if len(arrays) > 1 and arrays[1] is not None \
            else attrs.get("axes")
        return np.squeeze(x, axis=tuple(a % x.ndim for a in axes) if axes else None)
    return None


def fold_layout_constants(ctx, keep=()):
    """Reshape/Unsqueeze/Transpose/... of initializers done now (the bytes are the same)."""
    keep = set(keep)
    uses = Counter(i for n in ctx.nodes for i in n.input if i)
    rename = {}
    nodes = []
    folded = 0
    for n in ctx.nodes:
        if any(i in rename for i in n.input):
            ins = [rename.get(i, i) for i in n.input]
            del n.input[:]
            n.input.extend(ins)
        ins = [i for i in n.input if i]
        out = n.output[0] if len(n.output) == 1 else None
        if n.op_type in _LAYOUT_OPS and not n.domain and ins and out and out not in keep \
                and all(i in ctx.initializers and type(ctx.initializers[i]) is _Init for i in ins):
            src = ins[0]
            try:
                arr = _eval_layout(n, [ctx.initializers[i].data() for i in ins])
            except Exception:  # noqa: BLE001 -- an odd constant: leave the node as it is
                arr = None
            if arr is not None and (uses[src] == 1 and src not in keep or arr.nbytes <= 65536):
                for i in ins:
                    uses[i] -= 1
                if uses[src] == 0 and src not in keep:
                    ctx.initializers[src] = _Init(arr)   # the weight keeps its name
                    rename[out] = src
                    uses[src] = uses[out]
                else:
                    ctx.initializers[out] = _Init(np.array(arr))
                folded += 1
                continue
        nodes.append(n)
    if folded:
        ctx.nodes[:] = nodes
        used = {i for n in ctx.nodes for i in n.input} | keep
        for name in [k for k in ctx.initializers if k not in used]:
            del ctx.initializers[name]
    return folded


# ---- shapes of inputs and outputs ----------------------------------------------------------

def _input_symbols(graph):
    """dim 0 of each input -> its symbolic name: "N" for the first input's batch, else N_<input>."""
    syms = {}
    for t in graph.inputs:
        shape = graph.tensors[t].shape
        if shape and shape[0] not in syms:
            syms[shape[0]] = "N" if not syms else "N_" + re.sub(r"\W", "_", graph.tensors[t].blob)
    return syms


def _dynamic_dims(model, graph, syms):
    """SSA name -> {axis: dim_param or None} for the dims that follow the inputs' batch."""
    if not syms:
        return {}
    probe = max(syms) + 1
    try:
        other = model.reshaped(probe).graph.tensors
    except Exception:  # noqa: BLE001 -- no probe graph: fall back to dim 0 = batch
        other = None
    dyn = {}
    for name, t in graph.tensors.items():
        s = tuple(t.shape)
        if other is None or name not in other:
            if s and s[0] in syms:
                dyn[name] = {0: syms[s[0]]}
            continue
        s2 = tuple(other[name].shape)
        if len(s2) != len(s):
            continue
        d = {}
        for i, (x, y) in enumerate(zip(s, s2)):
            if x == y:
                continue
            d[i] = None                  # follows the batch in some other way: left unnamed
            if y == probe and x in syms:
                d[i] = syms[x]
            else:
                for n, sym in syms.items():
                    if n and x % n == 0 and y == x // n * probe:
                        d[i] = f"{sym}*{x // n}"
                        break
        if d:
            dyn[name] = d
    return dyn


def _value_info(name, dims, elem_type=1):
    """dims: ints (fixed), strings (symbolic) or None (unknown)."""
    import onnx
    vi = onnx.ValueInfoProto()
    vi.name = name
    tt = vi.type.tensor_type
    tt.elem_type = elem_type
    if dims is None:
        return vi
    tt.shape.SetInParent()
    for d in dims:
        dim = tt.shape.dim.add()
        if isinstance(d, str):
            dim.dim_param = d
        elif d is not None:
            dim.dim_value = int(d)
    return vi


def _declared_dims(shape, dyn, fixed):
    """Shape for an input/output declaration before ONNX inference weighs in."""
    return [int(d) if (fixed or i not in dyn) else dyn[i] for i, d in enumerate(shape)]


def _output_dims(name, caffe, dyn, fixed, inferred, where, notes, symbols=()):
    """Reconcile Caffe's shape, the batch analysis and ONNX's inferred shape of one output."""
    caffe = [int(d) for d in caffe]
    if inferred is None:
        return _declared_dims(caffe, dyn, fixed)
    if len(inferred) != len(caffe):
        raise ExportError(f"{where}: output '{name}' has rank {len(inferred)} in the ONNX graph, "
                          f"Caffe's shape is {caffe}")
    dims = []
    for i, (c, inf) in enumerate(zip(caffe, inferred)):
        follows_batch = i in dyn
        if isinstance(inf, int):
            if inf != c:
                raise ExportError(f"{where}: output '{name}' has shape {inferred} in the ONNX graph, "
                                  f"Caffe's is {caffe}")
            if not fixed and follows_batch:
                # e.g. a sum with a Parameter blob: the graph itself only runs at this batch
                notes.append(f"output '{name}' has dim {i} fixed to {c} by the graph although it "
                             f"follows the batch in Caffe")
            dims.append(c)
        elif follows_batch:
            if fixed and inf is not None:
                dims.append(c)
            elif inf in symbols:
                dims.append(inf)            # the batch of an input, as inference tracked it
            else:
                dims.append(None)           # data-dependent (or beyond inference): unnamed
        else:
            dims.append(c)
    return dims


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


class _Layout:
    """Where each initializer's bytes go: embedded in the .onnx file or in the data file."""

    def __init__(self, inits, external):
        self.external = external
        self.items = []   # (name, init, header TensorProto, external?, data offset or None)
        offset = 0
        for name, init in inits.items():
            tp = _tensor_header(name, init)
            ext = external and init.nbytes() >= _EXTERNAL_MIN_BYTES
            off = None
            if ext:
                offset = -(-offset // _ALIGN) * _ALIGN
                off = offset
                offset += init.nbytes()
            self.items.append([name, init, tp, ext, off])


def _graph_rest(g):
    return g.SerializeToString()


def _embedded_size(header_bytes, nbytes):
    return len(header_bytes) + len(len_field(_TENSOR_RAW_DATA, nbytes)) + nbytes


def _write_model(path, model_rest, graph_rest, layout, data_path=None, data_location=None,
                 sources=None):
    """Stream the ModelProto to `path` (and external data to `data_path`).

    sources: an _ArraySources that finds arrays which are views of a weights file, so
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


class _ArraySources:
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


def _twin(model_rest_proto, graph_proto, layout, where=None):
    """A small ModelProto equal to the written one, big initializers as external references.

    where: [(name, file, offset, length)] of the written bytes; None makes references to a
    file that does not exist (enough for shape inference, which never reads weights).
    """
    m = onnx_copy(model_rest_proto)
    m.graph.CopyFrom(graph_proto)
    loc = {w[0]: w for w in where} if where is not None else {}
    for name, init, tp, ext, off in layout.items:
        t = onnx_copy(tp)
        if init.nbytes() >= _EXTERNAL_MIN_BYTES or ext:
            if where is not None:
                _, fpath, offset, length = loc[name]
                _set_external(t, os.path.basename(fpath), offset, length)
            else:
                _set_external(t, "__caffeq_unwritten__", 0, init.nbytes())
        else:
            t.raw_data = init.data().tobytes()
        m.graph.initializer.append(t)
    return m


def _infer_shapes(twin, strict):
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


def _inferred_dims(vi):
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    out = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(int(d.dim_value) if d.HasField("dim_value") else
                   (d.dim_param if d.HasField("dim_param") else None))
    return out


def _check_written(folder, twin):
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


# ---- the public entry point -------------------------------------------------------------------

def parse_batch(batch, name="batch"):
    """'dynamic' (or None, "N") -> None, else the fixed batch size; `name` is the option in messages."""
    if batch in (None, "dynamic", "N"):
        return None
    try:
        b = int(batch)
    except (TypeError, ValueError):
        raise ExportError(f"{name} must be 'dynamic' or a positive integer, got {batch!r}") from None
    if b < 1:
        raise ExportError(f"{name} must be >= 1, got {b}")
    return b


def _parse_opset(opset):
    import onnx
    if opset is None:
        return DEFAULT_OPSET
    try:
        v = int(opset)
    except (TypeError, ValueError):
        raise ExportError(f"opset must be an integer, got {opset!r}") from None
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= v <= newest:
        raise ExportError(f"opset {v} is not supported: use {MIN_OPSET} to {newest} "
                          f"(default {DEFAULT_OPSET})")
    return v


def _with_batch(model, batch):
    """The model with its inputs' dim 0 set to `batch` (node.quant carried over)."""
    if all(model.graph.tensors[t].shape and model.graph.tensors[t].shape[0] == batch
           for t in model.graph.inputs):
        return model
    return model.reshaped(batch)


def export_onnx(model, path, opset=None, batch="dynamic", optimize=True, check=True,
                external_data="auto", inputs=()):
    """Write `model` (a caffeq.Model) as an ONNX file; return statistics for printing.

    opset: 13 or newer (default 21).  batch: "dynamic" (dim 0 is "N") or an int.
    optimize: fold BatchNorm/Scale into convolutions, drop identities, merge reshapes.
    check: run onnx.checker.check_model(full_check=True) and strict shape inference.
    external_data: "auto" (only past 2 GB), True or False; the data file is `<path>.data`.
    inputs: more files the output must not overwrite (the model's own are always protected).

    Raises ExportError listing every layer ONNX cannot express, before writing anything.
    Returns {"path", "opset", "batch", "nodes_before", "nodes_after", "layers_before",
    "layers_after", "op_counts", "initializers", "file_size", "data_file", "inputs",
    "outputs", "dropped", "notes"}.
    """
    import onnx

    opset = _parse_opset(opset)
    fixed = parse_batch(batch)
    source = model.prototxt or model.name or ""
    path = os.fspath(path)
    protected = [model.prototxt, model.weights_path] + [os.fspath(p) for p in inputs if p]
    target = os.path.abspath(path)
    refuse_overwrite(path, protected, ExportError)
    if os.path.isdir(target):
        raise ExportError(f"{path}: is a folder")
    notes = []

    if fixed is not None:
        model = _with_batch(model, fixed)
    missing = [n.name for n in model.graph.nodes if n.has_params and n.blobs is None]
    if missing:
        raise ExportError(f"{source}: no weights for layer(s) {', '.join(missing[:5])}"
                          f"{', ...' if len(missing) > 5 else ''}; pass the caffemodel")
    # 1. every refusal at once, on the graph as the user wrote it
    ctx0, refusals, _, _, dropped = emit_graph(model.graph, opset)
    if refusals:
        raise _refusal_error(source, refusals)
    nodes_before = len(ctx0.nodes)
    layers_before = sum(1 for n in model.graph.nodes if not n.spec.is_data)
    del ctx0

    # 2. the optimized graph
    emitted = model
    if optimize:
        emitted, opt_notes = run_transforms(model, with_notes=True)
        notes.extend(opt_notes)
    ctx, refusals, in_names, out_names, dropped = emit_graph(emitted.graph, opset)
    if refusals:
        raise _refusal_error(source, refusals)
    graph = emitted.graph
    notes.extend(ctx.notes)
    if optimize:
        fold_layout_constants(ctx, keep=set(out_names) | set(in_names))
    data_layers = [n for n in graph.nodes if n.spec.is_data and n.type != "Input"]
    for n in data_layers:
        notes.append(f"data layer '{n.name}' ({n.type}) became graph input(s) "
                     f"{', '.join(t for t in n.outputs if t in in_names)}; its transform_param "
                     f"(mean, scale, crop) is not part of the graph: feed preprocessed blobs")
    if dropped:
        notes.append(f"dropped {len(dropped)} training-only layer(s): "
                     f"{', '.join(f'{n.name} ({n.type})' for n in dropped)}")
        gone = [t for t in graph.inputs if t not in in_names]
        if gone:
            notes.append(f"input(s) used only by them removed: {', '.join(gone)}")
    if not out_names:
        raise ExportError(f"{source}: the inference graph has no outputs")

    # 3. the ModelProto without its initializers' bytes
    syms = _input_symbols(graph)
    dyn = _dynamic_dims(emitted, graph, syms)
    in_dims = {t: _declared_dims(graph.tensors[t].shape, dyn.get(t, {0: syms.get(graph.tensors[t].shape[0])}
                                                                 if graph.tensors[t].shape else {}),
                                 fixed is not None)
               for t in in_names}
    g = onnx.GraphProto()
    g.name = graph.name or "caffeq"
    g.node.extend(ctx.nodes)
    for t in in_names:
        g.input.append(_value_info(t, in_dims[t]))
    for t in out_names:
        g.output.append(_value_info(t, None))
    m = onnx.ModelProto()
    m.ir_version = onnx.helper.find_min_ir_version_for(
        [onnx.helper.make_opsetid("", opset)] +
        [onnx.helper.make_opsetid(d, v) for d, v in ctx.domains.items()])
    m.producer_name = "caffeq"
    m.producer_version = __version__
    m.doc_string = f"converted from {os.path.basename(model.prototxt)}" if model.prototxt else ""
    op = m.opset_import.add()
    op.domain, op.version = "", opset
    for d, v in ctx.domains.items():
        op = m.opset_import.add()
        op.domain, op.version = d, v

    total = sum(i.nbytes() for i in ctx.initializers.values())
    if external_data == "auto":
        external = total + 16 * len(ctx.initializers) + (4 << 20) > _MAX_EMBEDDED
    else:
        external = bool(external_data)
    layout = _Layout(ctx.initializers, external)

    # outputs: ONNX's inferred shapes, checked against Caffe's and the batch analysis
    inferred, inf_notes = _infer_shapes(_twin(m, g, layout), strict=check)
    notes.extend(inf_notes)
    out_vi = {vi.name: vi for vi in inferred.graph.output} if inferred is not None else {}
    out_dims = {t: _output_dims(t, graph.tensors[t].shape, dyn.get(t, {}), fixed is not None,
                                _inferred_dims(out_vi.get(t)), source, notes, set(syms.values()))
                for t in out_names}
    del g.output[:]
    for t in out_names:
        g.output.append(_value_info(t, out_dims[t]))
    if inferred is not None:
        g.value_info.extend(v for v in inferred.graph.value_info
                            if v.name not in ctx.initializers and v.name not in out_dims)
    graph_rest = _graph_rest(g)
    model_rest = m.SerializeToString()
    embedded_est = len(model_rest) + len(graph_rest) + sum(
        16 + len(it[2].SerializeToString()) + (0 if it[3] else it[1].nbytes()) for it in layout.items)
    if embedded_est > _MAX_EMBEDDED:
        raise ExportError(f"{path}: the graph alone exceeds protobuf's 2 GB limit")

    data_path = target + ".data" if external else None
    if data_path:
        refuse_overwrite(data_path, protected, ExportError)
    folder = os.path.dirname(target)
    sources = _ArraySources([model.weights_path])
    try:
        with atomic_path(target, inputs=protected) as tmp_main:
            if data_path:
                with atomic_path(data_path, inputs=protected) as tmp_data:
                    where = _write_model(tmp_main, model_rest, graph_rest, layout, tmp_data,
                                         os.path.basename(data_path), sources)
                    if check:
                        _check_written(folder, _twin(m, g, layout, where))
            else:
                where = _write_model(tmp_main, model_rest, graph_rest, layout, sources=sources)
                if check:
                    _check_written(folder, _twin(m, g, layout, where))
    except OSError as e:
        raise ExportError(f"{path}: cannot write: {e.strerror or e}") from None
    except CaffeqError as e:
        if isinstance(e, ExportError):
            raise
        raise ExportError(str(e)) from None
    finally:
        sources.close()

    ops = Counter(n.op_type for n in ctx.nodes)
    stats = {
        "path": path,
        "opset": opset,
        "batch": fixed if fixed is not None else "dynamic",
        "nodes_before": nodes_before,
        "nodes_after": len(ctx.nodes),
        "layers_before": layers_before,
        "layers_after": sum(1 for n in graph.nodes if not n.spec.is_data),
        "optimized": bool(optimize),
        "op_counts": dict(sorted(ops.items())),
        "initializers": len(ctx.initializers),
        "weights_bytes": total,
        "file_size": os.path.getsize(target),
        "data_file": data_path,
        "inputs": {t: [d if d is not None else "?" for d in in_dims[t]] for t in in_names},
        "outputs": {t: [d if d is not None else "?" for d in out_dims[t]] for t in out_names},
        "dropped": [n.name for n in dropped],
        "refused": [],
        "notes": notes,
    }
    if data_path:
        stats["data_size"] = os.path.getsize(data_path)
    return stats


def format_stats(stats):
    """A few lines for the CLI's `convert`."""
    lines = [f"wrote {stats['path']} ({stats['file_size'] / 1e6:.1f} MB"
             + (f" + {stats['data_file']} {stats.get('data_size', 0) / 1e6:.1f} MB" if stats.get("data_file") else "")
             + f"), opset {stats['opset']}, batch {stats['batch']}"]
    lines.append(f"nodes: {stats['nodes_before']} before optimization, {stats['nodes_after']} after"
                 + ("" if stats["optimized"] else " (--no-optimize)"))
    lines.append("inputs: " + ", ".join(f"{k} {v}" for k, v in stats["inputs"].items()))
    lines.append("outputs: " + ", ".join(f"{k} {v}" for k, v in stats["outputs"].items()))
    for n in stats["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


__all__ = ["DEFAULT_OPSET", "MIN_OPSET", "OnnxContext", "emit_graph", "export_onnx", "format_stats",
           "parse_batch"]
