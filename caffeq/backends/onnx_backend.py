"""Graph IR -> ONNX, emitted layer by layer by the specs' `onnx(ctx, node)` (no tracing).

Names: Caffe blob names (the IR's SSA names) are the ONNX tensor names, layer
names are the node names of each layer's main op, graph inputs and outputs
keep Caffe's names.  Dim 0 is a symbolic "N" unless a fixed batch is asked.

Default opset: 21 (onnxruntime >= 1.20 runs it); any opset from 13 up works.

Here: the emission context (OnnxContext), the walk over the IR and export_onnx.  The file is
streamed by onnx_writer.py (no copy of the weights); constant folding and the dynamic-dimension
analysis are in onnx_shapes.py; compact quantized weights in onnx_weights.py.
"""
import os
from collections import Counter

import numpy as np

from ..errors import CaffeqError, ExportError
from ..fs import atomic_path, refuse_overwrite
from ..transforms import optimize as run_transforms
from ..version import __version__
from .names import unique_name
from .onnx_shapes import declared_dims, dynamic_dims, fold_layout_constants, input_symbols, output_dims, value_info
from .onnx_weights import emit_quantized_weight
from .onnx_writer import (
    ArraySources,
    Initializer,
    Layout,
    check_written,
    graph_rest,
    infer_shapes,
    inferred_dims,
    twin,
    write_model,
)

DEFAULT_OPSET = 21
MIN_OPSET = 13
# protobuf refuses messages of 2 GiB and more; keep a margin for the graph itself
_MAX_EMBEDDED = (1 << 31) - (64 << 20)


# ---- the emission context ---------------------------------------------------------

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


class _ShapesAdded:
    """OnnxContext.with_shapes: the context, with more static shapes."""

    def __init__(self, ctx, shapes):
        self._ctx, self._shapes = ctx, {k: tuple(v) for k, v in shapes.items()}

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def with_shapes(self, shapes):
        return _ShapesAdded(self._ctx, {**self._shapes, **shapes})

    def shape(self, name):
        return self._shapes[name] if name in self._shapes else self._ctx.shape(name)


class OnnxContext:
    """What a layer spec's `onnx(ctx, node)` emits into.  See the ONNX emission contract."""

    def __init__(self, graph, opset):
        self.graph = graph
        self.opset = int(opset)
        self.nodes = []                 # onnx NodeProto, in order
        self.initializers = {}          # name -> Initializer
        self.domains = {}               # custom domain -> version
        self.notes = []
        self.layer = None               # the Node being emitted
        self._names = set(graph.tensors)
        self._node_names = set()
        self._const_cache = {}
        self._weight_cache = {}
        self.live = None                # tensors the graph being written needs (emit_graph sets it)

    # -- shapes -------------------------------------------------------------------------
    def with_shapes(self, shapes):
        """This context, also knowing the static shapes of tensors a spec made itself ({name: shape}), for the
        parts (other specs' onnx) it hands them to."""
        return _ShapesAdded(self, shapes)

    def shape(self, name):
        """Caffe's static shape of an IR tensor (dim 0 is the prototxt's batch)."""
        t = self.graph.tensors.get(name)
        if t is not None:
            return tuple(t.shape)
        raise ExportError(f"{self._where()}: no static shape known for tensor '{name}'")

    def needed(self, name):
        """Whether the graph being written needs tensor `name` (a graph output, or read by a kept
        layer): a layer may leave out a top nothing reads."""
        return self.live is None or name in self.live

    # -- names --------------------------------------------------------------------------
    def _where(self):
        n = self.layer
        return f"layer '{n.name}' ({n.type})" if n is not None else "graph"

    def _unique(self, base, taken):
        return unique_name(base or "t", taken)

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

    def op(self, kind, inputs, hint, name=None, **attrs):
        """One `kind` node on `inputs` whose single output is a fresh tensor named
        "<layer>_<hint>" (made unique), <layer> being the name of the layer being emitted;
        returns that output's name.  `name` and `attrs` (including `domain`) go to add_node."""
        prefix = self.layer.name if self.layer is not None else "t"
        return self.add_node(kind, inputs, self.tmp(f"{prefix}_{hint}"), name=name, **attrs)

    def merge_axes(self, x, axis, hint="flat", name=None, shape=None):
        """IR tensor x with its axes from `axis` on merged into one; returns the new tensor.  From axis 1,
        ONNX's Flatten, which takes the size at run time (a batch a Permute moved into those axes); further on,
        a Reshape to their static size.  Never a Reshape to [0, ..., -1]: onnxruntime cannot infer the -1 beside
        a copied dim 0 of 0, the zero rois a proposal layer may give.  shape: x's static shape, for a tensor
        that is not the graph's (a spec's intermediate)."""
        shape = self.shape(x) if shape is None else shape
        if not 0 <= axis < len(shape):
            raise ExportError(f"{self._where()}: cannot merge the axes from {axis} of a {len(shape)}-axis tensor")
        if axis == 0:   # everything, dim 0 included
            return self.op("Reshape", [x, self.i64([-1])], hint, name=name)
        if axis == 1:
            return self.op("Flatten", [x], hint, name=name, axis=1)
        size = int(np.prod([int(d) for d in shape[axis:]], dtype=np.int64))
        return self.op("Reshape", [x, self.i64([0] * axis + [size])], hint, name=name)

    def trunc(self, x, hint="trunc", name=None):
        """x rounded toward zero, C's float-to-int conversion (ONNX has no Trunc): |x| floored with x's sign."""
        return self.op("Mul", [self.op("Sign", [x], "sign", name=name),
                               self.op("Floor", [self.op("Abs", [x], "abs")], "floor")], hint)

    def filled(self, like, value, hint="filled", name=None):
        """A float32 tensor shaped like `like` holding `value` everywhere (ConstantOfShape: no arithmetic on
        `like`, so its inf and NaN do not leak in)."""
        import onnx.numpy_helper
        shape = self.op("Shape", [like], f"{hint}_shape", name=name)
        return self.op("ConstantOfShape", [shape], hint,
                       value=onnx.numpy_helper.from_array(np.array([value], np.float32)))

    def top_k_later_first(self, values, k, hint):
        """TopK (largest, sorted) of the 1-D tensor `values` with equal values ranked higher index first, as a
        stable sort reversed (torch's sort(stable=True).flip(0), numpy's argsort()[::-1]) ranks them.  ONNX's
        TopK ranks the lower index first, so it runs over the values reversed and the positions are mapped
        back.  k: an int or a 1-element int64 tensor.  Returns (top values, their indexes)."""
        n = self.op("Shape", [values], f"{hint}_n")
        reversed_values = self.op("Slice", [values, self.i64([-1]), self.i64([-(2 ** 62)]), self.i64([0]),
                                            self.i64([-1])], f"{hint}_reversed")
        prefix = self.layer.name if self.layer is not None else "t"
        top, position = self.add_node("TopK", [reversed_values, self.i64([k]) if isinstance(k, int) else k],
                                      [self.tmp(f"{prefix}_{hint}_values"), self.tmp(f"{prefix}_{hint}_reversed_index")],
                                      axis=0, largest=1, sorted=1)
        return top, self.op("Sub", [self.op("Sub", [n, self.i64([1])], f"{hint}_last"), position], f"{hint}_index")

    def nms_threshold(self, t, drops_equal=False):
        """The float32 IoU threshold for NonMaxSuppression (which drops IoU > t and takes t in [0, 1]) that
        makes the layer's decisions: it drops IoU > t, or IoU >= t with drops_equal.  Above 1 nothing is
        dropped either way (1); a threshold that drops boxes that do not even overlap is refused."""
        t = np.float32(t)
        if np.isnan(t) or t > 1:       # no IoU compares above it (NaN: no comparison holds)
            return np.float32(1.0)
        if t < 0 or (drops_equal and t <= 0):
            raise ExportError(f"{self._where()}: NMS threshold {float(t)} drops every box after the best, "
                              f"overlapping or not; ONNX's NonMaxSuppression takes IoU thresholds in [0, 1]")
        return np.nextafter(t, np.float32(-np.inf)) if drops_equal else t

    def body_op(self, body, kind, inputs, hint, **attrs):
        """One `kind` node appended to `body`, the node list of a Scan or Loop subgraph, its single output a
        fresh tensor named "<layer>_<hint>"; returns that output's name."""
        import onnx
        out = self.tmp(f"{self.layer.name}_{hint}")
        body.append(onnx.helper.make_node(kind, inputs, [out], **attrs))
        return out

    def body_const(self, body, value, hint="const"):
        """A Constant node appended to `body` (a Scan or Loop subgraph's node list) holding `value`, a numpy
        array or scalar whose dtype is kept; returns its output's name."""
        import onnx.numpy_helper
        out = self.tmp(f"{self.layer.name}_{hint}")
        body.append(onnx.helper.make_node("Constant", [], [out],
                                          value=onnx.numpy_helper.from_array(np.asarray(value), f"{out}_value")))
        return out

    def i64(self, values):
        """A shared int64 constant holding `values` (a scalar or a nested list)."""
        return self.const(np.array(values, np.int64))

    def f32(self, value):
        """A shared float32 constant holding `value` (a scalar or a nested list)."""
        return self.const(np.array(value, np.float32))

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
        self.initializers[name] = Initializer(a)
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
        names = node.spec.blob_names_for(node.attrs)
        base = f"{node.name}.{names[index] if index < len(names) else f'blob{index}'}"
        if transpose and any(k[:2] == key[:2] for k in self._weight_cache):
            base += "_T"
        name = self._unique(base, self._names)
        self.initializers[name] = Initializer(arr, bool(transpose))
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


def values_shaped(graph):
    """The tensors whose shape may depend on values (made by, or computed from, a layer with a
    data-dependent top): an output dim that ONNX inference leaves unknown stays unnamed there."""
    varying = set()
    for n in graph.nodes:
        if n.spec.data_dependent_shape or any(t in varying for t in n.inputs):
            varying.update(n.outputs)
    return varying


def emit_graph(graph, opset):
    """Run every kept layer's emission -> (ctx, refusals, inputs, outputs, dropped)."""
    ctx = OnnxContext(graph, opset)
    kept, inputs, outputs, dropped = _live_io(graph)
    ctx.live = set(outputs).union(*(n.inputs for n in kept))
    refusals = []
    for node in kept:
        ctx.layer = node
        if not node.spec.has_onnx():
            refusals.append((node.name, node.type, node.spec.onnx_refusal or "no ONNX emission for this layer type"))
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
    for node in model.graph.nodes:
        for ssa in node.inputs:
            t = model.graph.tensors[ssa]
            if t.shape is not None and 0 in t.shape[1:]:
                # Caffe allows an empty blob (a Slice that leaves no channels); onnxruntime refuses such a
                # model when it loads it, so no file is written
                raise ExportError(f"{source}: layer '{node.name}' ({node.type}) reads the empty blob '{t.blob}' "
                                  f"({'x'.join(map(str, t.shape))}); ONNX runtimes do not run layers on empty blobs")
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
    syms = input_symbols(graph)
    dyn = dynamic_dims(emitted, graph, syms)
    in_dims = {t: declared_dims(graph.tensors[t].shape, dyn.get(t, {0: syms.get(graph.tensors[t].shape[0])}
                                                                 if graph.tensors[t].shape else {}),
                                 fixed is not None)
               for t in in_names}
    g = onnx.GraphProto()
    g.name = graph.name or "caffeq"
    g.node.extend(ctx.nodes)
    for t in in_names:
        g.input.append(value_info(t, in_dims[t]))
    for t in out_names:
        g.output.append(value_info(t, None))
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
    layout = Layout(ctx.initializers, external)

    # outputs: ONNX's inferred shapes, checked against Caffe's and the batch analysis
    inferred, inf_notes = infer_shapes(twin(m, g, layout), strict=check)
    notes.extend(inf_notes)
    out_vi = {vi.name: vi for vi in inferred.graph.output} if inferred is not None else {}
    varying = values_shaped(graph)
    out_dims = {t: output_dims(t, graph.tensors[t].shape, dyn.get(t, {}), fixed is not None,
                                inferred_dims(out_vi.get(t)), source, notes, set(syms.values()), t in varying)
                for t in out_names}
    del g.output[:]
    for t in out_names:
        g.output.append(value_info(t, out_dims[t]))
    if inferred is not None:
        g.value_info.extend(v for v in inferred.graph.value_info
                            if v.name not in ctx.initializers and v.name not in out_dims)
    rest_of_graph = graph_rest(g)
    model_rest = m.SerializeToString()
    embedded_est = len(model_rest) + len(rest_of_graph) + sum(
        16 + len(it[2].SerializeToString()) + (0 if it[3] else it[1].nbytes()) for it in layout.items)
    if embedded_est > _MAX_EMBEDDED:
        raise ExportError(f"{path}: the graph alone exceeds protobuf's 2 GB limit")

    data_path = target + ".data" if external else None
    if data_path:
        refuse_overwrite(data_path, protected, ExportError)
    folder = os.path.dirname(target)
    sources = ArraySources([model.weights_path])
    try:
        with atomic_path(target, inputs=protected) as tmp_main:
            if data_path:
                with atomic_path(data_path, inputs=protected) as tmp_data:
                    where = write_model(tmp_main, model_rest, rest_of_graph, layout, tmp_data,
                                         os.path.basename(data_path), sources)
                    if check:
                        check_written(folder, twin(m, g, layout, where))
            else:
                where = write_model(tmp_main, model_rest, rest_of_graph, layout, sources=sources)
                if check:
                    check_written(folder, twin(m, g, layout, where))
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
