"""Weight quantization: fp16, int8 and binary (sign x per-channel alpha).

    >>> qmodel = caffeq.quantize(model, "binary")            # first/last weighted layers stay fp32
    >>> qmodel = caffeq.quantize(model, "binary", keep="none")
    >>> print(qmodel.quant_report)

A quantized node keeps `node.blobs[i]` as the dequantized float32 array (so
torch and every backend run unchanged) and records `node.quant = {i:
QuantizedBlob}` for writers that store the compact form (ONNX, .caffeq).
"""
import copy

import numpy as np

from ..ir import Graph
from . import binary as _binary  # noqa: F401  (registers "binary")
from . import fp16 as _fp16  # noqa: F401  (registers "fp16")
from . import int8 as _int8  # noqa: F401  (registers "int8")
from .base import (
    QuantizedBlob,
    QuantizeError,
    Quantizer,
    available_targets,
    broadcast_scale,
    channel_matrix,
    from_channel_matrix,
    get_quantizer,
    register_quantizer,
)
from .fp16 import prepare_fp16
from .report import LayerRow, QuantReport, rel_l2

__all__ = [
    "QuantReport",
    "QuantizeError",
    "QuantizedBlob",
    "Quantizer",
    "available_targets",
    "broadcast_scale",
    "channel_matrix",
    "compute_dtype",
    "default_kept_layers",
    "from_channel_matrix",
    "get_quantizer",
    "quantize",
    "register_quantizer",
    "weighted_layers",
]


# ---- which layers ------------------------------------------------------------------

def quantizable_blobs(node, quantizer):
    """Blob indexes of `node` that `quantizer` would change, with (axis, groups) for each."""
    if not node.blobs or not node.has_params:
        return {}
    out = {}
    if quantizer.weights_only:
        for i, axis in sorted(weight_axes(node).items()):
            if i < len(node.blobs) and node.blobs[i] is not None:
                out[i] = (axis, _groups(node, i, axis))
    else:
        for i, b in enumerate(node.blobs):
            if b is not None and np.asarray(b).dtype.kind == "f":
                out[i] = (None, 1)
    return out


def weight_axes(node):
    """{blob index: output-channel axis} of the node's quantizable weights (its configuration's)."""
    return dict(node.spec.weight_axes_for(node.attrs))


def _groups(node, index, axis):
    """Output channels of a grouped Deconvolution span axis 1 of each group's rows."""
    g = int(node.attrs.get("group", 1) or 1) if isinstance(node.attrs, dict) else 1
    if node.type == "Deconvolution" and axis == 1 and g > 1:
        return g
    return 1


def weighted_layers(graph):
    """Nodes with weights a binary/int8 quantizer may change (weight_axes), in graph order."""
    return [n for n in graph.nodes if n.blobs and n.has_params and
            any(i < len(n.blobs) for i in weight_axes(n))]


def default_kept_layers(graph):
    """{layer: reason} for the weighted layers kept fp32 by default.

    First: weighted layers with no weighted layer upstream (they see the net's
    input directly or through weight-free layers).  Last: weighted layers with
    no weighted layer downstream.
    """
    weighted = {n.name for n in weighted_layers(graph)}
    if not weighted:
        return {}
    up = {}      # tensor -> has a weighted layer upstream (or is produced by one)
    first = []
    for n in graph.nodes:
        seen = any(up.get(t, False) for t in n.inputs)
        if n.name in weighted and not seen:
            first.append(n.name)
        for t in n.outputs:
            up[t] = seen or n.name in weighted
    down = {}
    last = []
    for n in reversed(graph.nodes):
        seen = any(down.get(t, False) for t in n.outputs)
        if n.name in weighted and not seen:
            last.append(n.name)
        for t in n.inputs:
            down[t] = down.get(t, False) or seen or n.name in weighted
    kept = {name: "first weighted layer" for name in first}
    for name in reversed(last):
        kept[name] = "first and last weighted layer" if name in kept else "last weighted layer"
    return {n.name: kept[n.name] for n in graph.nodes if n.name in kept}


def _names(value, flag):
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "none":
            return []
        value = [v for v in value.split(",")]
    names = [str(v).strip() for v in value]
    if any(not v for v in names):
        raise QuantizeError(f"{flag}: empty layer name in {','.join(names)!r}")
    return names


def _check_names(graph, names, flag, eligible, target):
    known = {n.name: n for n in graph.nodes}
    unknown = [v for v in names if v not in known]
    if unknown:
        raise QuantizeError(f"{flag}: no layer named {', '.join(repr(u) for u in unknown)} in the net; "
                            f"layers with weights: {', '.join(sorted(eligible)) or 'none'}")
    bad = [v for v in names if v not in eligible]
    if bad:
        raise QuantizeError(f"{flag}: layer(s) {', '.join(repr(b) + ' (' + known[b].type + ')' for b in bad)} "
                            f"have no weights that --to {target} changes")


# ---- the model copy ----------------------------------------------------------------

def copy_model(model):
    """A Model sharing nothing mutable with `model` (weights as read-only views of the originals)."""
    nodes = []
    for n in model.graph.nodes:
        c = copy.copy(n)
        if n.blobs is not None:
            c.blobs = [None if b is None else _readonly(b) for b in n.blobs]
        c.shared_from = dict(n.shared_from)
        c.quant = dict(n.quant)
        nodes.append(c)
    g = model.graph
    graph = Graph(name=g.name, nodes=nodes, tensors=dict(g.tensors), inputs=list(g.inputs),
                  outputs=list(g.outputs), source=g.source)
    return model.replace(graph, copy.deepcopy(model.net) if model.net is not None else None)


def _readonly(arr):
    v = np.asarray(arr).view()
    v.flags.writeable = False
    return v


# ---- quantize ----------------------------------------------------------------------

def quantize(model, target, keep=None, only=None, keep_reason="--keep"):
    """Quantize a model's weights -> a new Model (the original is untouched).

    target: "fp32" | "fp16" | "int8" | "binary" (or a Quantizer).
    keep:   None (binary: the first and last weighted layers stay fp32; others:
            nothing kept), "none" / [] (quantize every eligible layer), or
            layer names to keep fp32.
    only:   layer names to quantize (every other layer stays fp32).
    keep_reason: why the layers named in `keep` stay fp32, as the report shows it
            (convert --budget: "budget 1 points").
    The result carries `quant_report` (a QuantReport: print it or .to_dict()).
    """
    q = get_quantizer(target)
    if model.quantization:
        done = sorted(set(model.quantization.values()))
        raise QuantizeError(f"the model is already quantized ({', '.join(done)}); quantize the fp32 model")
    keep_names = _names(keep, "--keep")
    only_names = _names(only, "--only")
    if keep_names and only_names is not None:
        raise QuantizeError("--keep and --only cannot be combined; name the layers to quantize with --only")
    missing = [n.name for n in model.graph.nodes if n.has_params and n.blobs is None]
    if missing and q.name != "fp32":
        raise QuantizeError(f"no weights for layer(s) {', '.join(missing[:5])}; load the model with its "
                            f".caffemodel before quantizing")
    new = copy_model(model)
    report = QuantReport(q.name)
    if q.name == "fp16":
        report.notes.extend(prepare_fp16(new))

    graph = new.graph
    eligible = {n.name for n in graph.nodes if quantizable_blobs(n, q)}
    if keep_names:
        _check_names(graph, keep_names, "--keep", eligible, q.name)
    if only_names is not None:
        _check_names(graph, only_names, "--only", eligible, q.name)

    if q.name == "fp32":
        kept = {}
    elif only_names is not None:
        kept = {n: "not in --only" for n in (x.name for x in graph.nodes) if n in eligible and n not in only_names}
    elif keep_names is None:
        kept = default_kept_layers(graph) if q.default_keep_ends else {}
        kept = {k: v for k, v in kept.items() if k in eligible}
    else:
        kept = {n: keep_reason for n in keep_names}

    by_name = {n.name: n for n in graph.nodes}
    for node in graph.nodes:
        if not node.blobs:
            continue
        blobs = quantizable_blobs(node, q) if q.name != "fp32" else {}
        shapes = [None if b is None else tuple(np.shape(b)) for b in node.blobs]
        before = list(node.blobs)
        quant = {}
        reason = kept.get(node.name, "")
        for i, (axis, groups) in blobs.items():
            if i in node.shared_from:
                continue   # follows its owner, below
            if reason:
                continue
            qb = q.quantize(node.blobs[i], axis, groups)
            if qb is None:
                continue
            quant[i] = qb
            node.blobs[i] = _readonly(qb.dequantize())
        # shared parameters take their owner's (possibly quantized) blob
        for i, (owner, j) in node.shared_from.items():
            o = by_name.get(owner)
            if o is None or o.blobs is None or i >= len(node.blobs):
                continue
            node.blobs[i] = _readonly(np.asarray(o.blobs[j]).reshape(shapes[i]))
            oq = o.quant.get(j)
            if oq is not None:
                rq = oq.reshaped(shapes[i])
                if rq is not None:
                    quant[i] = rq
        if quant:
            node.quant = quant
            new.quantization[node.name] = q.name
        else:
            node.quant = {}
        own = [i for i in range(len(node.blobs)) if i not in node.shared_from and node.blobs[i] is not None]
        n_params = int(sum(np.size(node.blobs[i]) for i in own))
        bytes_before = 4 * n_params
        bytes_after = sum(quant[i].compact_nbytes() if i in quant else 4 * int(np.size(node.blobs[i]))
                          for i in own)
        changed = [i for i in own if i in quant]
        err = rel_l2([before[i] for i in changed], [node.blobs[i] for i in changed]) if changed else 0.0
        if changed:
            prec = q.name if len(changed) == len([i for i in own]) or q.weights_only else "mixed"
            report.changed.append(node.name)
        else:
            prec = "fp32"
        if reason and blobs:
            report.kept[node.name] = reason
        row = LayerRow(node.name, node.type, n_params, prec, bytes_before, bytes_after, err,
                       reason if (reason and blobs) else "",
                       [quant[i].scheme if i in quant else "fp32" for i in range(len(node.blobs))])
        report.layers.append(row)
    folded = new.folded_layers
    if folded:
        # layers folded away before rounding: listed, with their fp32 bytes gone
        orig = {n.name: n for n in model.graph.nodes}
        order = {n.name: k for k, n in enumerate(model.graph.nodes)}
        for name in folded:
            n = orig[name]
            size = int(sum(np.size(b) for i, b in enumerate(n.blobs or []) if i not in n.shared_from))
            report.layers.append(LayerRow(name, n.type, size, "folded", 4 * size, 0, 0.0))
        report.layers.sort(key=lambda r: order.get(r.name, len(order)))
    if q.name == "fp16":
        report.stats = q.stats.to_dict()
        if q.stats.clamped:
            report.notes.append(f"{q.stats.clamped} value(s) beyond +-65504 clamped to fp16's range")
        if q.stats.underflow:
            report.notes.append(f"{q.stats.underflow} nonzero value(s) underflowed to 0 in fp16")
    if q.name == "binary" and not report.changed and eligible:
        if keep_names is None:
            report.notes.append("every weighted layer was kept fp32 (the first and last weighted layers stay "
                                "fp32 by default); pass keep='none' (--keep none) to binarize them")
        elif keep_reason == "--keep":
            report.notes.append("every weighted layer was kept fp32: --keep names them all")
        else:
            report.notes.append(f"every weighted layer was kept fp32 ({keep_reason}): nothing was binarized")
    new.quant_report = report
    return new


def compute_dtype(target, device):
    """torch dtype to run a `target` model in on `device`: fp16 computes in fp16 on CUDA only."""
    import torch
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if get_quantizer(target).name == "fp16" and dev.type == "cuda":
        return torch.float16
    return None


