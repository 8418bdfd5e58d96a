"""Inference-graph transforms on caffeq's IR (each returns a new Model, outputs unchanged).

- `fold_batchnorm`: BatchNorm [+ Scale] folded into the Convolution /
  Deconvolution / InnerProduct before it (fp64 arithmetic, Caffe's factor blob
  with 0 meaning 0); a BatchNorm [+ Scale] not after one becomes one Scale.
- `remove_identities`: Dropout (inference), Split and Silence dropped, with the
  layers that only fed a Silence (a Silence that hides one top of a live layer
  stays, or that top would become a net output).
- `merge_reshapes`: chains of Reshape/Flatten that keep axis 0 become one Reshape.
- `optimize`: all three.

The input Model is never modified: nodes are copied, and arrays that change
are new arrays.  The result's `net` lists the new layers and its graph is what
build_graph makes of them, so reshaped() and the writers see the same model.
A layer only moves a write of a blob earlier when no layer in between touches
that blob (Caffe's in-place chains and reused blob names stay exact).  These
transforms describe the graph in eval mode (BatchNorm with stored statistics,
Dropout off); train with the original model.
"""
import copy

import numpy as np

from .graph_weights import share_params
from .io.schema import caffe_pb2
from .ir import Graph, build_graph
from .layers import get_spec

_CONV_TYPES = ("Convolution", "ConvolutionDepthwise", "DepthwiseConvolution", "Deconvolution",
               "InnerProduct")


# ---- copying ------------------------------------------------------------------------------

def _copy_node(node):
    n = copy.copy(node)
    n.inputs = list(node.inputs)
    n.outputs = list(node.outputs)
    n.bottoms = list(node.bottoms)
    n.tops = list(node.tops)
    n.blobs = list(node.blobs) if node.blobs is not None else None
    n.shared_from = dict(node.shared_from or {})
    n.quant = dict(node.quant)
    return n


def _copy_graph(graph):
    tensors = {k: copy.copy(t) for k, t in graph.tensors.items()}
    return Graph(name=graph.name, nodes=[_copy_node(n) for n in graph.nodes], tensors=tensors,
                 inputs=list(graph.inputs), outputs=list(graph.outputs), source=graph.source)


def _shares_params(graph, node):
    """True when node's blobs are shared with another layer (param { name })."""
    if node.shared_from:
        return True
    names = {p for p in node.param_names if p}
    if not names:
        return False
    return any(n is not node and names & {p for p in n.param_names if p} for n in graph.nodes)


def _index(graph):
    return {id(n): i for i, n in enumerate(graph.nodes)}


def _blob_free_between(graph, blob, first, last, skip=()):
    """True when no layer strictly between `first` and `last` reads or writes `blob`
    (so a write of `blob` can move from `last` up to `first` without changing what anyone reads)."""
    pos = _index(graph)
    lo, hi = pos[id(first)], pos[id(last)]
    skip = {id(n) for n in skip}
    for n in graph.nodes[lo + 1:hi]:
        if id(n) not in skip and (blob in n.bottoms or blob in n.tops):
            return False
    return True


def _transformed(model, transform, **options):
    """(Model rebuilt from transform(copy of model's graph, **options), what transform returned)."""
    graph = _copy_graph(model.graph)
    count = transform(graph, **options)
    return _rebuild(model, graph), count


def _rebuild(model, graph):
    """A Model whose graph is what build_graph makes of the transformed layers.

    Its `net` lists exactly these layers (phase rules already applied), so reshaped(),
    writers and the SSA names all agree with the new graph; blobs and quant carry over.
    """
    net = type(model.net)()
    net.CopyFrom(model.net)
    for f in ("layer", "layers", "input", "input_dim", "input_shape"):
        net.ClearField(f)
    for n in graph.nodes:
        lp = net.layer.add()
        lp.CopyFrom(n.param)
        lp.ClearField("include")
        lp.ClearField("exclude")
        del lp.bottom[:]
        lp.bottom.extend(n.bottoms)
        del lp.top[:]
        lp.top.extend(n.tops)
    g = build_graph(net, None, phase=model.phase, source=model.prototxt or graph.source or "",
                    base_dir=model._base_dir(), **model.build_options())
    for new, old in zip(g.nodes, graph.nodes):
        new.blobs = list(old.blobs) if old.blobs is not None else None
        new.quant = old.quant
    if any(n.param_names for n in g.nodes):
        share_params(g)
    return model.replace(g, net)


# ---- BatchNorm / Scale folding ---------------------------------------------------------------

def _bn_affine(node):
    """(a, c) in fp64 with BatchNorm(x) == a * x + c per channel, or None if not foldable."""
    a = node.attrs
    if node.blobs is None or len(node.inputs) != 1 or len(node.outputs) != 1:
        return None
    if node.spec.stored_statistics(a) is False:
        return None  # batch statistics even at test time
    mean = np.asarray(node.blobs[0], np.float64).reshape(-1)
    var = np.asarray(node.blobs[1], np.float64).reshape(-1)
    if a.get("scale_bias"):
        f = 1.0  # NVCaffe uses the statistics as stored
    else:
        s = float(np.asarray(node.blobs[2], np.float64).reshape(-1)[0])
        f = 0.0 if s == 0 else 1.0 / s
    # Caffe divides by sqrt(var + eps) computed in float32; fp64 here differs by < 1 ulp
    if a.get("eps_after_sqrt"):  # synopsys-caffe's add_eps_before_sqrt: false
        inv = 1.0 / (np.sqrt(var * f) + float(a["eps"]))
    else:
        inv = 1.0 / np.sqrt(var * f + float(a["eps"]))
    scale, shift = inv, -mean * f * inv
    if a.get("scale_bias"):
        gamma = np.asarray(node.blobs[3], np.float64).reshape(-1)
        beta = np.asarray(node.blobs[4], np.float64).reshape(-1)
        scale, shift = scale * gamma, shift * gamma + beta
    return scale, shift


def _scale_affine(node, channels, rank):
    """(a, c) for a Scale layer with a per-channel learned factor on axis 1, else None."""
    a = node.attrs
    if node.blobs is None or a.get("two_bottoms") or len(node.inputs) != 1 or len(node.outputs) != 1:
        return None
    if rank < 2 or a.get("_axis") != 1:
        return None
    shapes = node.expected_param_shapes or []
    if not shapes or tuple(shapes[0]) != (channels,):
        return None
    gamma = np.asarray(node.blobs[0], np.float64).reshape(-1)
    if a.get("bias_term"):
        if a.get("_bias_axis", 1) != 1 or len(shapes) < 2 or tuple(shapes[1]) != (channels,):
            return None
        beta = np.asarray(node.blobs[1], np.float64).reshape(-1)
    else:
        beta = np.zeros(channels)
    return gamma, beta


def _affine_chain(graph, start_tensor, channels, rank, uses, outputs, allow_bn=True):
    """Follow BatchNorm then Scale from start_tensor -> (nodes, a, c)."""
    chain, a, c = [], np.ones(channels), np.zeros(channels)
    t = start_tensor
    seen_bn = seen_scale = False
    while True:
        cons = uses.get(t, [])
        if len(cons) != 1 or t in outputs:
            break
        nxt = cons[0]
        if nxt.type == "BatchNorm" and allow_bn and not seen_bn and not seen_scale and rank >= 2 \
                and nxt.attrs.get("channels") == channels:
            ac = _bn_affine(nxt)
            seen_bn = True
        elif nxt.type == "Scale" and not seen_scale:
            ac = _scale_affine(nxt, channels, rank)
            seen_scale = True
        else:
            break
        if ac is None:
            break
        a, c = ac[0] * a, ac[0] * c + ac[1]
        chain.append(nxt)
        t = nxt.outputs[0]
        if seen_scale:
            break
    return chain, a, c


def _conv_channels(node, graph):
    """Output channels of a foldable conv-like node, or None."""
    a = node.attrs
    if node.blobs is None or node.quant or len(node.inputs) != 1 or len(node.outputs) != 1:
        return None
    if _shares_params(graph, node):
        return None
    if a.get("_axis") != 1 or a.get("normalize"):   # happynear's unit rows would undo a fold
        return None
    out_shape = graph.tensors[node.outputs[0]].shape
    if node.type == "InnerProduct" and len(out_shape) != 2:
        return None
    return int(a["num_output"])


def _fold_into(node, a, c):
    """New weights (float32) of conv-like `node` followed by the per-channel affine a*y + c."""
    w = np.asarray(node.blobs[0], np.float64)
    bias = np.asarray(node.blobs[1], np.float64).reshape(-1) if node.attrs["bias_term"] \
        else np.zeros(len(a))
    if node.type == "Deconvolution":
        g = node.attrs["group"]
        cin, per = w.shape[0], w.shape[1]
        wg = w.reshape((g, cin // g, per) + w.shape[2:])
        wg = wg * a.reshape((g, 1, per) + (1,) * (w.ndim - 2))
        w2 = wg.reshape(w.shape)
    elif node.type == "InnerProduct" and node.attrs["transpose"]:
        w2 = w * a[None, :]
    else:
        w2 = w * a.reshape((-1,) + (1,) * (w.ndim - 1))
    b2 = a * bias + c
    return w2.astype(np.float32), b2.astype(np.float32)


def _with_bias(node):
    """Copy of a conv-like node's param/attrs with bias_term on."""
    lp = type(node.param)()
    lp.CopyFrom(node.param)
    field = lp.inner_product_param if node.type == "InnerProduct" else lp.convolution_param
    field.bias_term = True
    attrs = dict(node.attrs)
    attrs["bias_term"] = True
    if "param" in attrs and node.type != "InnerProduct":
        attrs["param"] = lp.convolution_param
    return lp, attrs


def _replace_chain(graph, first, chain, new_node):
    """Swap first + chain for new_node (which takes the chain's last output)."""
    last = chain[-1].outputs[0]
    drop = {id(n) for n in chain}
    gone = [first.outputs[0]] + [n.outputs[0] for n in chain[:-1]]
    graph.nodes = [new_node if n is first else n for n in graph.nodes if id(n) not in drop]
    for t in gone:
        if t != last:
            graph.tensors.pop(t, None)
    graph.tensors[last].producer = new_node.name


def fold_batchnorm(model):
    """BatchNorm [+ Scale] into the preceding conv/deconv/inner product; lone ones into one Scale."""
    m, folded = _transformed(model, _fold_batchnorm)
    m.transforms.append(("fold_batchnorm", folded))
    return m


def _fold_batchnorm(graph):
    outputs = set(graph.outputs)
    folded = 0
    changed = True
    while changed:
        changed = False
        uses = graph.consumers()
        for node in list(graph.nodes):
            if node.type not in _CONV_TYPES or node.attrs.get("orn") or node.attrs.get("fuse") \
                    or hasattr(node.spec, "used_blobs"):
                continue   # (RRD's rotating filters re-derive most channels from a few; naibaf7's fused ReLU; a
                # fork's spec whose forward derives its weights from more blobs, e.g. masks, keeps its own)
            channels = _conv_channels(node, graph)
            if channels is None:
                continue
            rank = len(graph.tensors[node.outputs[0]].shape)
            chain, a, c = _affine_chain(graph, node.outputs[0], channels, rank, uses, outputs)
            if not chain or not _blob_free_between(graph, chain[-1].tops[0], node, chain[-1], chain):
                continue
            w, b = _fold_into(node, a, c)
            new = _copy_node(node)
            new.param, new.attrs = _with_bias(node)
            del new.param.top[:]
            new.param.top.extend(chain[-1].tops)
            new.blobs = [w, b]
            new.expected_param_shapes = [tuple(w.shape), tuple(b.shape)]
            new.outputs = [chain[-1].outputs[0]]
            new.tops = [chain[-1].tops[0]]
            new.param_names = []
            _replace_chain(graph, node, chain, new)
            folded += len(chain)
            changed = True
            break
    # BatchNorm [+ Scale] elsewhere: one per-channel Scale
    scale_spec = get_spec("Scale")
    if scale_spec is not None:
        changed = True
        while changed:
            changed = False
            uses = graph.consumers()
            for node in list(graph.nodes):
                if node.type != "BatchNorm":
                    continue
                x = node.inputs[0] if node.inputs else None
                if x is None:
                    continue
                shape = graph.tensors[x].shape
                if len(shape) < 2:
                    continue
                channels = int(shape[1])
                ab = _bn_affine(node)
                if ab is None:
                    continue
                rest, a2, c2 = _affine_chain(graph, node.outputs[0], channels, len(shape), uses, outputs,
                                             allow_bn=False)
                if not rest or not _blob_free_between(graph, rest[-1].tops[0], node, rest[-1], rest):
                    continue  # (a lone BatchNorm is as small as a Scale already)
                chain = [node] + rest
                a, c = a2 * ab[0], a2 * ab[1] + c2
                new = _scale_node(scale_spec, node, chain, a, c, shape)
                if new is None:
                    continue
                graph.nodes = [new if n is node else n for n in graph.nodes
                               if id(n) not in {id(k) for k in chain[1:]}]
                for n in chain[:-1]:
                    graph.tensors.pop(n.outputs[0], None)
                graph.tensors[new.outputs[0]].producer = new.name
                folded += len(chain) - 1
                changed = True
                break
    return folded


def _scale_node(spec, bn, chain, a, c, in_shape):
    lp = caffe_pb2.LayerParameter()
    lp.name = bn.name
    lp.type = "Scale"
    lp.bottom.append(bn.bottoms[0])
    lp.top.append(chain[-1].tops[0])
    lp.scale_param.axis = 1
    lp.scale_param.num_axes = 1
    lp.scale_param.bias_term = True
    try:
        attrs = spec.parse(lp)
        spec.infer(attrs, [tuple(in_shape)])
        shapes = spec.param_shapes(attrs, [tuple(in_shape)])
    except Exception:  # noqa: BLE001 -- a Scale spec that cannot take it: keep the layers
        return None
    new = copy.copy(bn)
    new.type, new.spec, new.param, new.attrs = "Scale", spec, lp, attrs
    new.inputs = list(bn.inputs)
    new.outputs = [chain[-1].outputs[0]]
    new.bottoms, new.tops = list(bn.bottoms), [chain[-1].tops[0]]
    new.blobs = [a.astype(np.float32), c.astype(np.float32)]
    new.expected_param_shapes = [tuple(s) for s in shapes]
    new.param_names, new.shared_from = [], {}
    new.quant = {}
    return new


# ---- identities -----------------------------------------------------------------------------

_IDENTITY_TYPES = ("Dropout", "Split", "Silence")


def remove_identities(model):
    """Drop Dropout (as at inference), Split and Silence, rewiring their consumers."""
    m, removed = _checked(model, _remove_identities)
    m.transforms.append(("remove_identities", removed))
    return m


def _writes_between(graph, blob, first, last, skip=()):
    """True when a layer strictly between `first` and `last` (None: the end) writes `blob`."""
    pos = _index(graph)
    hi = pos[id(last)] if last is not None else len(graph.nodes)
    skip = {id(n) for n in skip}
    return any(id(n) not in skip and (blob in n.tops or blob in _written_blobs(n))
               for n in graph.nodes[pos[id(first)] + 1:hi])


def _written_blobs(node):
    """The bottoms a node writes back in place (Ristretto's trimmed inputs; see Layer.bottoms_written_back)."""
    return [node.bottoms[i] for i in node.attrs.get("written_back", ())]


def _rename_uses(graph, old, new):
    blob = graph.tensors[new].blob
    for n in graph.nodes:
        if old in n.inputs:
            n.bottoms = [blob if t == old else b for t, b in zip(n.inputs, n.bottoms)]
            n.inputs = [new if t == old else t for t in n.inputs]


def _prune_dead(graph, outputs):
    """Drop layers none of whose tops is read or is a net output (what a Silence hid)."""
    removed = 0
    changed = True
    while changed:
        changed = False
        used = {t for n in graph.nodes for t in n.inputs}
        for n in list(graph.nodes):
            if n.spec.is_data or not n.outputs:
                continue
            if not any(t in used or t in outputs for t in n.outputs):
                graph.nodes.remove(n)
                for t in n.outputs:
                    graph.tensors.pop(t, None)
                removed += 1
                changed = True
    return removed


def _remove_identities(graph, keep_silence=False):
    removed = 0
    outputs = set(graph.outputs)
    inputs = set(graph.inputs)
    silenced = False
    for node in list(graph.nodes):
        if node.type not in _IDENTITY_TYPES or node.attrs.get("test_scale", 1.0) != 1.0:
            continue   # (a scale_train: false Dropout scales at TEST)
        if node.type == "Silence":
            if not keep_silence:
                graph.nodes.remove(node)
                removed += 1
                silenced = True
            continue
        if len(node.inputs) != 1:
            continue
        src = node.inputs[0]
        uses = graph.consumers()
        # the source's producer may write one output's blob itself (plain Caffe names survive)
        inherit = None
        producer = next((n for n in graph.nodes if src in n.outputs), None)
        # (not a bottom the producer wrote back: Ristretto's trimmed input keeps its blob's name)
        if producer is not None and src in producer.outputs[:len(producer.tops)] and src not in inputs \
                and src not in outputs and len(uses.get(src, [])) == 1:
            o = ([o for o in node.outputs if o in outputs] or [node.outputs[-1]])[0]
            if _blob_free_between(graph, graph.tensors[o].blob, producer, node):
                inherit = o
        target = inherit or src
        tblob = graph.tensors[target].blob
        kept_outs = []
        for o in node.outputs:
            if o == inherit:
                continue
            readers = uses.get(o, [])
            # a net output keeps its own name through an Identity; so does an output whose
            # readers would see a later write of the source's blob
            if o in outputs or any(_writes_between(graph, tblob, node, r, (node,)) for r in readers):
                kept_outs.append(o)
                continue
            _rename_uses(graph, o, target)
            graph.tensors.pop(o, None)
        if inherit is not None:
            producer.outputs = [inherit if t == src else t for t in producer.outputs]
            producer.tops = [graph.tensors[t].blob for t in producer.outputs[:len(producer.tops)]]
            graph.tensors[inherit].producer = producer.name
            graph.tensors.pop(src, None)
            if kept_outs:
                node.inputs, node.bottoms = [inherit], [tblob]
        if kept_outs:
            node.outputs = kept_outs
            node.tops = [graph.tensors[t].blob for t in kept_outs]
            if node.type == "Split":
                node.attrs = dict(node.attrs, tops=len(kept_outs))
            continue
        graph.nodes.remove(node)
        removed += 1
    if silenced:
        removed += _prune_dead(graph, outputs)
    return removed


def _checked(model, transform):
    """Run a graph transform and rebuild; if the net's outputs moved (a Silence hid a top that
    feeds nothing else), run it again keeping the Silence layers."""
    m, count = _transformed(model, transform)
    if sorted(m.outputs) != sorted(model.outputs):
        m, count = _transformed(model, transform, keep_silence=True)
    return m, count


# ---- reshapes ---------------------------------------------------------------------------------

def _keeps_batch(node, in_shape):
    """True when a Reshape/Flatten leaves axis 0 untouched (so dim 0 may stay dynamic)."""
    ndim = len(in_shape)
    if ndim == 0:
        return False
    a = node.attrs
    if node.type == "Flatten":
        return a["axis"] % ndim >= 1
    if node.type == "Reshape":
        if a.get("pixelshuffler", 1) > 1:  # synopsys-caffe's depth-to-space reorders, never merged
            return False
        start = a["axis"] if a["axis"] >= 0 else ndim + a["axis"] + 1
        if start >= 1:
            return True
        return bool(a["dims"]) and a["dims"][0] == 0
    return False


def merge_reshapes(model):
    """Reshape/Flatten followed by Reshape/Flatten (sole consumer) -> one Reshape."""
    m, merged = _transformed(model, _merge_reshapes)
    m.transforms.append(("merge_reshapes", merged))
    return m


def _merge_reshapes(graph):
    spec = get_spec("Reshape")
    if spec is None:
        return 0
    merged = 0
    outputs = set(graph.outputs)
    changed = True
    while changed:
        changed = False
        uses = graph.consumers()
        for first in list(graph.nodes):
            if first.type not in ("Reshape", "Flatten") or len(first.outputs) != 1:
                continue
            mid = first.outputs[0]
            cons = uses.get(mid, [])
            if len(cons) != 1 or mid in outputs or cons[0].type not in ("Reshape", "Flatten"):
                continue
            second = cons[0]
            src = first.inputs[0]
            in_shape = tuple(graph.tensors[src].shape)
            final = tuple(graph.tensors[second.outputs[0]].shape)
            if not (_keeps_batch(first, in_shape) and _keeps_batch(second, graph.tensors[mid].shape)) \
                    or not final:
                continue
            lp = caffe_pb2.LayerParameter()
            lp.name, lp.type = second.name, "Reshape"
            lp.bottom.append(first.bottoms[0])
            lp.top.append(second.tops[0])
            lp.reshape_param.shape.dim.extend([0] + [int(d) for d in final[1:]])
            try:
                attrs = spec.parse(lp)
                if tuple(spec.infer(attrs, [in_shape])[0]) != final:
                    continue
            except Exception:  # noqa: BLE001, S112 -- not expressible as one Reshape: keep both
                continue
            if not _blob_free_between(graph, second.tops[0], first, second):
                continue
            new = copy.copy(second)
            new.type, new.spec, new.param, new.attrs = "Reshape", spec, lp, attrs
            new.inputs, new.outputs = [src], list(second.outputs)
            new.bottoms, new.tops = list(first.bottoms), list(second.tops)
            # at the first reshape's place: it reads the bottom's version the chain read
            graph.nodes = [new if n is first else n for n in graph.nodes if n is not second]
            graph.tensors.pop(mid, None)
            merged += 1
            changed = True
            break
    return merged


# ---- all of them ---------------------------------------------------------------------------------

def optimize(model, with_notes=False):
    """remove_identities, fold_batchnorm and merge_reshapes (identities first, so that a Split
    or Dropout does not hide a BatchNorm chain)."""
    before = len(model.layers)
    m, removed = _checked(model, _remove_identities)
    graph = _copy_graph(m.graph)
    folded = _fold_batchnorm(graph)
    merged = _merge_reshapes(graph)
    m = _rebuild(m, graph)
    m.transforms = list(model.transforms) + [
        ("optimize", {"fold_batchnorm": folded, "remove_identities": removed, "merge_reshapes": merged})]
    if not with_notes:
        return m
    notes = []
    if folded or removed or merged:
        parts = []
        if folded:
            parts.append(f"{folded} BatchNorm/Scale layer(s) folded")
        if removed:
            parts.append(f"{removed} Dropout/Split/Silence (and dead) layer(s) removed")
        if merged:
            parts.append(f"{merged} reshape(s) merged")
        notes.append(f"optimized: {', '.join(parts)} ({before} -> {len(m.layers)} layers)")
    return m, notes


__all__ = ["fold_batchnorm", "merge_reshapes", "optimize", "remove_identities"]
