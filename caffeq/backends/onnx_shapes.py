"""The ONNX graph's constants and shapes: layout-only ops on weights folded into initializers, and
which input and output dimensions are dynamic (follow the batch) or static.
"""
import re
from collections import Counter

import numpy as np

from ..errors import ExportError
from .onnx_writer import Initializer

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


def _subgraph_reads(nodes):
    """Names that the bodies of Scan/Loop/If nodes read (outer-scope values included)."""
    names = set()
    for n in nodes:
        for a in n.attribute:
            graphs = [a.g] if a.HasField("g") else list(a.graphs)
            for g in graphs:
                names.update(i for sub in g.node for i in sub.input if i)
                names.update(_subgraph_reads(g.node))
    return names


def fold_layout_constants(ctx, keep=()):
    """Reshape/Unsqueeze/Transpose/... of initializers done now (the bytes are the same).

    Values a Scan body reads from the outer scope count as used: they are kept as they are."""
    keep = set(keep) | _subgraph_reads(ctx.nodes)
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
                and all(i in ctx.initializers and type(ctx.initializers[i]) is Initializer for i in ins):
            src = ins[0]
            try:
                arr = _eval_layout(n, [ctx.initializers[i].data() for i in ins])
            except Exception:  # noqa: BLE001 -- an odd constant: leave the node as it is
                arr = None
            if arr is not None and (uses[src] == 1 and src not in keep or arr.nbytes <= 65536):
                for i in ins:
                    uses[i] -= 1
                if uses[src] == 0 and src not in keep:
                    ctx.initializers[src] = Initializer(arr)   # the weight keeps its name
                    rename[out] = src
                    uses[src] = uses[out]
                else:
                    ctx.initializers[out] = Initializer(np.array(arr))
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

def input_symbols(graph):
    """dim 0 of each input -> its symbolic name: "N" for the first input's batch, else N_<input>."""
    syms = {}
    for t in graph.inputs:
        shape = graph.tensors[t].shape
        if shape and shape[0] not in syms:
            syms[shape[0]] = "N" if not syms else "N_" + re.sub(r"\W", "_", graph.tensors[t].blob)
    return syms


def dynamic_dims(model, graph, syms):
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


def value_info(name, dims, elem_type=1):
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


def declared_dims(shape, dyn, fixed):
    """Shape for an input/output declaration before ONNX inference weighs in."""
    return [int(d) if (fixed or i not in dyn) else dyn[i] for i, d in enumerate(shape)]


def output_dims(name, caffe, dyn, fixed, inferred, where, notes, symbols=(), values_shaped=False):
    """Reconcile Caffe's shape, the batch analysis and ONNX's inferred shape of one output
    (values_shaped: its shape may depend on values, so a dim inference leaves open stays open)."""
    caffe = [int(d) for d in caffe]
    if inferred is None:
        return declared_dims(caffe, dyn, fixed)
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
        elif values_shaped:
            dims.append(None)               # e.g. a count of kept boxes: Caffe's dim is its setup value
        else:
            dims.append(c)
    return dims
