"""caffeq's graph IR: nodes in Caffe's order, SSA-named tensors, Caffe's shapes.

A Caffe blob name may be written several times (in-place layers).  Each write
becomes a distinct tensor; the last version of a blob keeps the plain Caffe
name (so net outputs, outputs.npz and ONNX names are Caffe's), earlier ones are
named `blob@layer`.  A graph input that is later rewritten in place keeps the
plain name instead, and its later versions take the `@layer` suffix.
"""
import math
import os
from dataclasses import dataclass, field
from functools import partial

from .errors import CaffeqError, GraphError, PhaseRuleError, ShapeError
from .graph_weights import attach_weights, share_params
from .input_fit import fitting_input_hint
from .io.schema import caffe_pb2
from .layers import require_specs, spec_for
from .layers.common import Sink
from .layers.interp import _multiplying_zoom_interps, interp_zooms_multiply
from .layers.misc import replace_unit_axis_embeds
from .layers.pooling import darknet_kept_size_pools, is_darknet_kept_size_pool
from .layers.registry import (
    UNRUN_PYTHON,
    ForkReading,
    LayerError,
    MissingInputShape,
    python_variant_reason,
    unrun_python_reason,
)
from .training_layers import drop_training_only

MAX_BLOB_ELEMENTS = 1 << 33  # about 32 GB of float32: refuse before allocating


@dataclass
class Tensor:
    name: str              # SSA name, unique in the graph
    blob: str              # Caffe blob name
    shape: tuple = None
    producer: str = None   # node name, None for nothing (never for built graphs)


@dataclass
class Node:
    name: str
    type: str
    spec: object
    param: object                  # the (upgraded) caffe_pb2.LayerParameter
    attrs: dict
    bottoms: list                  # Caffe blob names
    tops: list
    inputs: list = field(default_factory=list)   # SSA tensor names
    outputs: list = field(default_factory=list)
    blobs: list = None             # numpy arrays in Caffe's order (None: no weights loaded)
    param_names: list = field(default_factory=list)  # ParamSpec names for sharing
    expected_param_shapes: list = None
    shared_from: dict = field(default_factory=dict)  # blob index -> (owner layer, owner blob index)
    # blob index -> caffeq.quant.QuantizedBlob: the compact form of a quantized blob, kept for the
    # writers (ONNX, .caffeq); node.blobs then holds its dequantized float32 values
    quant: dict = field(default_factory=dict)

    @property
    def has_params(self):
        return self.expected_param_shapes is not None and len(self.expected_param_shapes) > 0


@dataclass
class Graph:
    name: str
    nodes: list
    tensors: dict                   # SSA name -> Tensor
    inputs: list                    # SSA names of graph inputs (Input/data layer tops)
    outputs: list                   # SSA names of net outputs
    source: str = ""

    def node(self, name):
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def shape(self, ssa):
        return self.tensors[ssa].shape

    def final_versions(self):
        """Caffe blob name -> SSA name of its last version."""
        out = {}
        for n in self.nodes:
            for ssa in n.outputs:
                out[self.tensors[ssa].blob] = ssa
        return out

    def consumers(self):
        uses = {}
        for n in self.nodes:
            for ssa in n.inputs:
                uses.setdefault(ssa, []).append(n)
        return uses


# ---- phase / stage rules (Caffe's Net::FilterNet and StateMeetsRule) ------------

def _state_meets_rule(phase, level, stages, rule):
    if rule.HasField("phase") and rule.phase != phase:
        return False
    if rule.HasField("min_level") and level < rule.min_level:
        return False
    if rule.HasField("max_level") and level > rule.max_level:
        return False
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    if rule.mpi_rank and 0 not in rule.mpi_rank:   # steflee/mpi-caffe's ranks: caffeq is one process, rank 0
        return False
    return True


def filter_layers(net, phase="TEST", stages=(), level=0, source=""):
    """Layers that exist in the given phase, as Caffe decides."""
    phase_value = caffe_pb2.Phase.Value(phase.upper()) if isinstance(phase, str) else phase
    stages = set(stages) | set(net.state.stage)
    level = level or net.state.level
    kept = []
    for lp in net.layer:
        if lp.include and lp.exclude:
            raise GraphError(f"{source}: layer '{lp.name}': specify either include or exclude rules, not both")
        included = not lp.include
        for rule in lp.exclude:
            if _state_meets_rule(phase_value, level, stages, rule):
                included = False
        for rule in lp.include:
            if _state_meets_rule(phase_value, level, stages, rule):
                included = True
        if included:
            kept.append(lp)
    return kept


# ---- graph construction -------------------------------------------------------

def _where(source, lp):
    return f"{source + ': ' if source else ''}layer '{lp.name}' ({lp.type})"


def _check_shape(source, lp, blob, shape):
    if any(d < 0 for d in shape):
        raise ShapeError(f"{_where(source, lp)}: top '{blob}' would have negative dimension {list(shape)}")
    n = math.prod(shape)
    if n > MAX_BLOB_ELEMENTS:
        raise ShapeError(f"{_where(source, lp)}: top '{blob}' would have absurd shape {list(shape)} "
                         f"({n} elements)")


def build_graph(net, weights=None, phase="TEST", stages=(), level=0, batch=None, source="",
                base_dir=None, input_shapes=None, outputs=None, notes=None, unknown_shapes_ok=False,
                unset_layers=None):
    """NetParameter -> Graph (see _build_graph); a net whose shapes fit only a fork's reading of some
    layers (ForkReading) is built again from a copy that says so, with a note.  A net whose shapes
    do not fit the input size its file declares fails with the size that fits, if one does."""
    notes = [] if notes is None else notes
    options = dict(weights=weights, phase=phase, stages=stages, level=level, batch=batch, source=source,
                   base_dir=base_dir, outputs=outputs, unknown_shapes_ok=unknown_shapes_ok, unset_layers=unset_layers)
    try:
        return _build_with_fork_readings(net, notes, input_shapes=input_shapes, **options)
    except (LayerError, ShapeError) as e:
        if type(e) not in (LayerError, ShapeError):
            raise
        hint = fitting_input_hint(net, lambda shapes: _build_with_fork_readings(net, [], input_shapes=shapes,
                                                                                  **options), input_shapes)
        if not hint:
            raise
        raise type(e)(f"{e}{hint}") from None


def _build_with_fork_readings(net, notes, **options):
    first = len(notes)
    try:
        return _build_graph(net, notes=notes, **options)
    except ForkReading as e:
        del notes[first:]          # the second build says them again
        twin = type(net)()
        twin.CopyFrom(net)
        note = e.rewrite(twin)
        graph = _build_graph(twin, notes=notes, **options)
        source = options["source"]
        notes.append(f"{source}: {note}" if source else note)
        return graph


def _build_graph(net, weights=None, phase="TEST", stages=(), level=0, batch=None, source="",
                 base_dir=None, input_shapes=None, outputs=None, notes=None, unknown_shapes_ok=False,
                 unset_layers=None):
    """NetParameter (V2, upgraded) + optional caffemodel blobs -> Graph with Caffe's shapes.

    weights: dict layer name -> list of BlobData (from read_caffemodel) or arrays.
    batch: replaces the first dimension of every graph input.
    input_shapes: {blob: shape} for tops of data layers and inputs, used before anything the
        layer itself would infer (so a train_val net needs no dataset).
    outputs: Caffe blob names to make the net's outputs; layers that feed none of them are dropped.
    notes: a list that receives what was changed on the way (dropped training-only layers,
        renamed duplicate layers).
    unknown_shapes_ok: a data top whose shape only its missing dataset could tell gets shape None,
        and so does everything computed from it (for listing a net, never for running it).
    unset_layers: {layer name: why} of layers a listing leaves unsized (template placeholders without
        values); their tops and everything computed from them get shape None.
    """
    notes = [] if notes is None else notes
    input_shapes = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
    all_layers = filter_layers(net, phase, stages, level, source)
    layers = drop_training_only(all_layers, source, notes)
    layers = _user_inputs(net, layers, input_shapes, source, notes) + layers
    # inputs read only by dropped layers (labels) are not outputs; the scores a loss read are
    read_by_dropped = {b for lp in all_layers if lp not in layers for b in lp.bottom}
    unset = {}   # id(layer) -> why a listing leaves its tops unsized (by the layer: unnamed layers repeat '')
    if unknown_shapes_ok:
        unset = {id(lp): unset_layers[lp.name] for lp in layers if lp.name in (unset_layers or {})}
        # a listing reads past a Python layer it has no spec for: sizes unknown from it on (running refuses)
        unset.update({id(lp): unrun_python_reason(lp) for lp in layers
                      if lp.type == "Python" and spec_for(lp) is None})
    require_specs([lp for lp in layers if not (id(lp) in unset and lp.type == "Python")], source)
    if base_dir is None:
        base_dir = os.path.dirname(os.path.abspath(source)) if source else os.getcwd()

    nodes = []
    tensors = {}
    current = {}            # blob -> temp id of its current version
    versions = {}           # blob -> [temp ids]
    temp_blob = {}          # temp id -> blob
    temp_producer = {}      # temp id -> node name
    graph_input_ids = []
    shapes = {}             # temp id -> shape
    values = {}             # temp id -> its value where the shapes alone give it (Layer.top_values)
    names_seen = set()
    shapes_used = set()
    unsized = {}            # (type, why) -> names of layers whose tops only a dataset or plugin could size
    guessed_labels = {}     # temp id -> the data layer whose label top it is, shaped (N,) as in BVLC Caffe
    from_guessed = {}       # temp id -> the guessed top's temp id, for tops computed from one
    reading_notes = {}      # (type, text) -> (its line in notes, names of the layers it is about)
    renamed = []            # [its line in notes, the repeated names] once a name repeats

    for position, lp in enumerate(layers):
        spec = spec_for(lp) or UNRUN_PYTHON
        where = _where(source, lp)
        node_name = _unique_layer_name(lp.name, names_seen, source, notes, renamed)
        try:
            attrs = spec.parse(lp)
        except ForkReading as e:   # the whole net tells how to read this layer
            raise ForkReading(f"{where}: {e}", e.rewrite) from None
        except LayerError as e:
            if unknown_shapes_ok and lp.type == "Python" and id(lp) not in unset:
                # a fork's variant of a Python layer caffeq knows (another param_str): listed, never run
                unset[id(lp)] = python_variant_reason(lp, e)
                spec = UNRUN_PYTHON
                attrs = spec.parse(lp)
            elif id(lp) not in unset:
                raise LayerError(f"{where}: {e}") from None
            else:
                attrs = {}   # a placeholder in what the layer reads (its param_str): listed, never run
        except CaffeqError:
            raise
        except Exception as e:  # a spec's own check on user input
            raise LayerError(f"{where}: bad parameters: {e}") from None
        for text in [*attrs.pop("reading_notes", ()), *([spec.reading_note] if spec.reading_note else [])]:
            _add_reading_note(notes, reading_notes, source, lp, text)
        if spec.is_data or spec.reads_files:
            attrs["base_dir"] = base_dir
        if "phase" in attrs and attrs["phase"] is None:
            # a spec that reads the layer's phase (Caffe's Net gives every layer the net's own unless
            # the layer sets one): only the phase this graph is built for tells
            attrs["phase"] = phase.upper() if isinstance(phase, str) else caffe_pb2.Phase.Name(phase)

        in_ids = []
        for b in lp.bottom:
            if b not in current:
                dropped = [d for d in all_layers if b in d.top and d not in layers]
                if dropped:
                    raise GraphError(
                        f"{where}: bottom '{b}' comes from layer '{dropped[0].name}' ({dropped[0].type}), which "
                        f"was dropped because it computes only from training-only layers (sampled targets, "
                        f"losses): this is a training net; read the net's test or deploy prototxt")
                hint, rule = _excluded_producer_hint(net, b, layers, phase)
                raise PhaseRuleError(f"{where}: bottom '{b}' is not produced by any earlier layer {hint}", rule)
            in_ids.append(current[b])
        in_shapes = [shapes[i] for i in in_ids]
        if spec.reads_bottom_values:
            attrs["bottom_values"] = [values.get(i) for i in in_ids]
        given = {i: input_shapes[t] for i, t in enumerate(lp.top) if t in input_shapes} \
            if spec.is_data or spec.shape_from_user else {}
        shapes_used.update(lp.top[i] for i in given)
        if id(lp) in unset:
            out_shapes, expected = [None] * len(lp.top), None
            unsized.setdefault((lp.type, f"{unset[id(lp)]}; the shapes after it are unknown"),
                               []).append(lp.name)
        else:
            try:
                out_shapes, expected = _infer_node(spec, attrs, lp, in_shapes, given, batch, where,
                                                   unknown_shapes_ok, unsized)
            except ForkReading:
                raise
            except (LayerError, ShapeError) as e:
                label = next((i for i in in_ids if i in guessed_labels), None)
                derived = next((i for i in in_ids if i in from_guessed), None) if label is None else None
                if unknown_shapes_ok and lp.type == "Python":
                    # a fork's variant of a Python layer caffeq knows (other bottoms or tops): listed, never run
                    why = python_variant_reason(lp, str(e).removeprefix(f"{where}: "))
                elif label is None:
                    joins = lp.type in ("Concat", "Eltwise")
                    embeds = _unit_axis_embeds(in_ids, nodes, shapes) if joins else []
                    if embeds:
                        raise ForkReading(f"{e}; Embed {', '.join(repr(n) for n in embeds)} appends an axis to a "
                                          f"last axis of size 1, where bottom-up-attention's Embed replaces it",
                                          partial(replace_unit_axis_embeds, embeds)) from None
                    pool = _shrinking_pool(lp, in_ids, nodes) if joins else None
                    if pool is None:
                        zooms = _multiplying_zoom_interps(in_ids, nodes, shapes) if joins else []
                        if zooms:
                            raise ForkReading(f"{e}; Interp {', '.join(repr(n) for n in zooms)} gives h + (h - 1)"
                                              f"(z - 1) for zoom_factor z, where the join needs h x z",
                                              interp_zooms_multiply) from None
                        if derived is None:
                            raise
                        # a blob computed from a guessed top: the guess may be what fails here
                        label = from_guessed[derived]
                        why = _guessed_label_reason(temp_blob[label], guessed_labels[label], shapes[label],
                                                    temp_blob[derived])
                    else:
                        # the Caffe darknet2caffe's nets run in keeps that map's size: built again so, once
                        change = "larger" if any(pool.attrs["pad"]) else "smaller"
                        raise ForkReading(f"{e}; layer '{pool.name}' (Pooling, {pool.attrs['kernel'][0]}x"
                                          f"{pool.attrs['kernel'][1]}, stride 1, pad {pool.attrs['pad'][0]}) makes "
                                          f"its map one {change}, where darknet's maxpool of that size keeps it",
                                          darknet_kept_size_pools) from None
                else:
                    why = _guessed_label_reason(temp_blob[label], guessed_labels[label], shapes[label])
                if not unknown_shapes_ok:
                    raise LayerError(f"{e}; {why}") from None
                unsized.setdefault((lp.type, f"{why}; the shapes after it are unknown"), []).append(lp.name)
                out_shapes, expected = [None] * len(lp.top), None
        if len(out_shapes) != len(lp.top):
            raise GraphError(f"{where}: produces {len(out_shapes)} tops but the prototxt names "
                             f"{len(lp.top)}")
        # a reading only the bottoms' shapes decide (yolov5_caffe's Reorg) is noted by infer
        for text in attrs.pop("reading_notes", ()):
            _add_reading_note(notes, reading_notes, source, lp, text)

        out_ids = []
        for t, s in zip(lp.top, out_shapes):
            if s is not None:
                s = tuple(int(d) for d in s)
                _check_shape(source, lp, t, s)
            tid = len(temp_blob)
            temp_blob[tid] = t
            temp_producer[tid] = node_name
            shapes[tid] = s
            versions.setdefault(t, []).append(tid)
            current[t] = tid
            out_ids.append(tid)
            if spec.is_data:
                graph_input_ids.append(tid)
        if all(s is not None for s in in_shapes):
            values.update((out_ids[i], v) for i, v in spec.top_values(attrs, in_shapes).items())
        if spec.is_data and all(s is not None for s in out_shapes):
            guessed_labels.update((out_ids[i], lp) for i in spec.guessed_label_tops(attrs, given))
        else:
            # a shape that fails layers later may come from a guessed top, not from the net
            origin = next((i for i in in_ids if i in guessed_labels), None)
            if origin is None:
                origin = next((from_guessed[i] for i in in_ids if i in from_guessed), None)
            if origin is not None:
                from_guessed.update((t, origin) for t in out_ids)
        # bottoms the layer's forward overwrites in place (Ristretto's trimmed inputs): a new version
        # for the later layers that read them, as outputs after the tops
        written = _written_back(spec, attrs, lp, layers[position + 1:], outputs)
        for i in written:
            tid = len(temp_blob)
            temp_blob[tid] = lp.bottom[i]
            temp_producer[tid] = node_name
            shapes[tid] = in_shapes[i]
            versions.setdefault(lp.bottom[i], []).append(tid)
            current[lp.bottom[i]] = tid
            out_ids.append(tid)
            origin = in_ids[i] if in_ids[i] in guessed_labels else from_guessed.get(in_ids[i])
            if origin is not None:   # a trimmed guess is still a guess
                from_guessed[tid] = origin
        if written:
            attrs["written_back"] = written

        node = Node(name=node_name, type=lp.type, spec=spec, param=lp, attrs=attrs,
                    bottoms=list(lp.bottom), tops=list(lp.top), inputs=in_ids, outputs=out_ids,
                    param_names=[p.name for p in lp.param],
                    expected_param_shapes=[tuple(int(d) for d in s) for s in expected]
                    if expected is not None else None)
        if expected:
            for s in node.expected_param_shapes:
                _check_shape(source, lp, "weights", s)
        nodes.append(node)
    notes.extend(_unsized_notes(unsized, source))

    # SSA names
    input_set = set(graph_input_ids)
    names = {}
    taken = set(versions)
    for blob, ids in versions.items():
        if len(ids) == 1:
            names[ids[0]] = blob
            continue
        plain = ids[0] if ids[0] in input_set else ids[-1]
        for tid in ids:
            if tid == plain:
                names[tid] = blob
            else:
                cand = f"{blob}@{temp_producer[tid]}"
                k = 1
                while cand in taken:
                    k += 1
                    cand = f"{blob}@{temp_producer[tid]}.{k}"
                taken.add(cand)
                names[tid] = cand
    for tid, blob in temp_blob.items():
        tensors[names[tid]] = Tensor(names[tid], blob, shapes[tid], temp_producer[tid])
    consumed = set()
    for n in nodes:
        n.inputs = [names[i] for i in n.inputs]
        n.outputs = [names[i] for i in n.outputs]
        consumed.update(n.inputs)
    unused = sorted(set(input_shapes) - shapes_used)
    if unused:
        known = [temp_blob[tid] for tid in graph_input_ids]
        raise GraphError(f"{source + ': ' if source else ''}--input-shape names {', '.join(map(repr, unused))}, "
                         f"which no input or data layer produces (inputs: {', '.join(known) or 'none'})")
    final = {ids[-1] for ids in versions.values()}
    if outputs:
        chosen = []
        for blob in outputs:
            if blob not in versions:
                raise GraphError(f"{source + ': ' if source else ''}--outputs names '{blob}', which is not "
                                 f"a blob of this net{_did_you_mean(blob, versions)}")
            chosen.append(names[versions[blob][-1]])
        net_outputs = list(dict.fromkeys(chosen))
    else:
        net_outputs = [names[tid] for tid in sorted(final)
                       if names[tid] not in consumed
                       and not (tid in graph_input_ids and temp_blob[tid] in read_by_dropped)]
        if not net_outputs:
            # every top is read by a Silence or a writer (DeepLab's MatWrite, flownet2's FLOWriter) or
            # a dropped layer: Caffe's net then has no outputs; what they swallow is what the user wants
            net_outputs = list(dict.fromkeys(t for n in nodes if isinstance(n.spec, Sink)
                                             for t in n.inputs))
            if net_outputs:
                notes.append(f"{source + ': ' if source else ''}every top is consumed by Silence or a writer: "
                             f"the silenced blobs {', '.join(tensors[t].blob for t in net_outputs)} "
                             f"are the outputs (choose others with --outputs)")
    if outputs:
        nodes = _needed_nodes(nodes, net_outputs)
        for t in [t for t in tensors if t not in {o for n in nodes for o in n.outputs}]:
            del tensors[t]
    kept = {o for n in nodes for o in n.outputs}
    if outputs:   # only the inputs the chosen outputs need (a label next to the data is not)
        kept &= {t for n in nodes for t in n.inputs} | set(net_outputs)
    inputs = [names[tid] for tid in graph_input_ids if names[tid] in kept]

    graph = Graph(name=net.name, nodes=nodes, tensors=tensors, inputs=inputs, outputs=net_outputs,
                  source=source)
    if weights is not None:
        attach_weights(graph, weights, source, notes=notes)
        share_params(graph)
    return graph


def _written_back(spec, attrs, lp, later, outputs):
    """Indexes of the bottoms that lp's forward overwrites in place (spec.bottoms_written_back) and
    whose new values someone sees: a later layer reads the blob before another writes it, or
    --outputs names it.  A bottom that is also lp's top, or repeats an earlier bottom, needs none."""
    found = []
    for i in spec.bottoms_written_back(attrs):
        blob = lp.bottom[i]
        if blob in lp.top or blob in [lp.bottom[j] for j in found]:
            continue
        if blob in (outputs or ()) or _read_later(blob, later):
            found.append(i)
    return found


def _read_later(blob, later):
    for lp in later:
        if blob in lp.bottom:
            return True
        if blob in lp.top:
            return False
    return False


def _unique_layer_name(name, taken, source, notes, renamed):
    """Caffe allows two layers of one name (weights go to the first); later ones get a suffix.  The
    first repeat is one note; more make that note one line naming them (ECO's nets repeat fifty)."""
    unique, k = name, 1
    while unique in taken:
        k += 1
        unique = f"{name}#{k}"
    taken.add(unique)
    if unique == name:
        return unique
    prefix = f"{source}: " if source else ""
    if not renamed:
        notes.append(f"{prefix}two layers are named '{name}'; the later one is '{unique}' here, and weights of "
                     f"that name go to the first, as in Caffe")
        renamed.extend([len(notes) - 1, [name]])
        return unique
    line, names = renamed
    if name not in names:
        names.append(name)
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    if len(names) == 1:
        notes[line] = (f"{prefix}the layer name '{name}' repeats; the later layers of that name are '{name}#2', "
                       f"'{name}#3'... here, and weights of that name go to the first, as in Caffe")
    else:
        notes[line] = (f"{prefix}{len(names)} layer names repeat ({shown}); the later layers of a name are "
                       f"NAME#2, NAME#3... here, and weights of a name go to its first layer, as in Caffe")
    return unique


def _needed_nodes(nodes, outputs):
    """The nodes that compute `outputs` (SSA names), in order."""
    needed, kept = set(outputs), []
    for n in reversed(nodes):
        if any(o in needed for o in n.outputs):
            kept.append(n)
            needed.update(n.inputs)
    return kept[::-1]


def _did_you_mean(name, choices):
    import difflib
    close = difflib.get_close_matches(name, list(choices), n=3)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def _user_inputs(net, layers, input_shapes, source, notes):
    """Input layers for the blobs --input-shape names that a layer reads before any layer makes them (a
    template whose data layers were left out, a fragment): the user says what they are.  A blob that a
    layer of another phase or stage makes is left to the include rules (the error names them)."""
    elsewhere = {t for lp in net.layer for t in lp.top if t not in lp.bottom}   # in place: read, not made
    made, added = set(), []
    for lp in layers:
        for b in lp.bottom:
            if b in input_shapes and b not in made and b not in elsewhere:
                made.add(b)
                added.append(caffe_pb2.LayerParameter(name=b, type="Input", top=[b]))
                added[-1].input_param.shape.add().dim.extend(input_shapes[b])
        made.update(lp.top)
    if added:
        names = ", ".join(repr(lp.name) for lp in added)
        notes.append(f"{source + ': ' if source else ''}no layer makes {names} before a layer reads it: read as "
                     f"{'an input' if len(added) == 1 else 'inputs'} of the shape --input-shape gives")
    return added


def _excluded_producer_hint(net, blob, kept, phase):
    """(why a bottom is undefined, the include rule that would define it or None)."""
    phase_name = phase if isinstance(phase, str) else caffe_pb2.Phase.Name(phase)
    excluded = [lp for lp in net.layer if blob in lp.top and lp not in kept]
    # the layers meant for this phase (but another stage or level) say the most; of stages, an evaluation's
    # (redtail's "val") before a training one's, whose augmentation layers only train
    excluded.sort(key=lambda lp: (not any(r.HasField("phase") and caffe_pb2.Phase.Name(r.phase) == phase_name.upper()
                                          for r in lp.include),
                                  any(st.lower().startswith("train") for r in lp.include for st in r.stage)))
    if not excluded:
        return (f"(undefined blob, wrong order or a cycle; to feed it as an input, give its shape with "
                f"--input-shape {blob}=N,C,H,W)"), None
    lp = excluded[0]
    rules = "; ".join(str(r).replace("\n", " ").strip() for r in lp.include) or "its exclude rules"
    return (f"at {phase_name}: layer '{lp.name}' makes it, but only under include {{ {rules} }}; "
            f"choose that with --phase/--stage"), (lp.include[0] if lp.include else None)


def _shrinking_pool(lp, in_ids, nodes):
    """Darknet converters write darknet's size-2 stride-1 maxpool, which keeps the map's size, as a
    Caffe Pooling, which shrinks it by one in BVLC Caffe; the Concat or Eltwise that joins the
    branches then fails there as here.  The first such Pooling upstream of the layer's bottoms, or None."""
    by_output = {tid: n for n in nodes for tid in n.outputs}
    seen, todo = set(), list(in_ids)
    while todo:
        tid = todo.pop()
        node = by_output.get(tid)
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.type == "Pooling" and is_darknet_kept_size_pool(node.attrs):
            return node
        todo.extend(node.inputs)
    return None


def _unit_axis_embeds(in_ids, nodes, shapes):
    """Names of the Embed layers that make the given tensors (directly) from indexes whose last axis
    is 1 (an ArgMax's (R, 1)), read the BVLC way: bottom-up-attention's Embed gives (R, E) there."""
    by_output = {tid: n for n in nodes for tid in n.outputs}
    found = []
    for tid in in_ids:
        node = by_output.get(tid)
        if node is not None and node.type == "Embed" and not node.attrs["replace_unit_axis"]:
            shape = shapes.get(node.inputs[0])
            if shape and shape[-1] == 1 and node.name not in found:
                found.append(node.name)
    return found


def _infer_node(spec, attrs, lp, in_shapes, given, batch, where, unknown_shapes_ok, unsized):
    """(top shapes, learnable blob shapes) of one layer by Caffe's rules; None where unknown."""
    if any(s is None for s in in_shapes):
        return [None] * len(lp.top), None
    try:
        if given and len(given) == len(lp.top):
            out_shapes = [given[i] for i in range(len(lp.top))]
        else:
            out_shapes = spec.top_shapes(attrs, given) if given else None
            if out_shapes is None:
                out_shapes = spec.infer(attrs, in_shapes)
                out_shapes = [given.get(i, s) for i, s in enumerate(out_shapes)]
        if spec.is_data and batch is not None:
            out_shapes = [(batch,) + tuple(s[1:]) if len(s) else s for s in out_shapes]
        return out_shapes, spec.param_shapes(attrs, in_shapes)
    except MissingInputShape as e:
        if not unknown_shapes_ok:
            raise LayerError(f"{where}: {e}") from None
        unsized.setdefault((lp.type, str(e)), []).append(lp.name)
        return [given.get(i) for i in range(len(lp.top))], None
    except ForkReading as e:
        raise ForkReading(f"{where}: {e}", e.rewrite) from None
    except LayerError as e:
        raise LayerError(f"{where}: {e}") from None
    except CaffeqError:
        raise
    except Exception as e:
        if not lp.bottom:
            # a type that computes from its bottoms, given none: Caffe's bottom-count check refuses it
            raise LayerError(f"{where}: has no bottom; {lp.type} computes its top from its bottoms") from None
        raise ShapeError(f"{where}: cannot infer shapes from bottoms "
                         f"{[list(s) for s in in_shapes]}: {type(e).__name__}: {e}") from None


def _guessed_label_reason(top, data_layer, shape, through=None):
    """Why a layer that fails on a data layer's label (or a fork data layer's data), or on a blob computed
    from one (`through`, its bottom), may only need that top's real shape."""
    lead = f"bottom '{through}' is computed from '{top}', which" if through not in (None, top) else f"bottom '{top}'"
    if data_layer.top and top == data_layer.top[0]:
        return (f"{lead} is the data of '{data_layer.name}', a fork's data layer ({data_layer.type}) "
                f"that caffeq sizes as Caffe's Data layer, {list(shape)}; its own reader may give another shape: "
                f"give it with --input-shape {top}=N,C,H,W")
    return (f"{lead} is the label of data layer '{data_layer.name}' ({data_layer.type}), shaped "
            f"{list(shape)} as BVLC Caffe gives it; a fork's reader may give more (caffe-ocr's ImageData "
            f"reads every label of a line: N x labels x 1 x 1): give its shape with --input-shape {top}=...")


def _add_reading_note(notes, seen, source, lp, text):
    """A spec's note on how it reads a layer; the same note on more layers of the type becomes one line
    naming them (sixteen converted Broadcastmul layers give one line, not sixteen)."""
    key = (lp.type, text)
    if key not in seen:
        notes.append(f"{_where(source, lp)}: {text}")
        seen[key] = (len(notes) - 1, [lp.name])
        return
    line, names = seen[key]
    if lp.name in names:   # a repeated layer name (Caffe allows them) is named once
        return
    names.append(lp.name)
    notes[line] = next(_unsized_notes({key: names}, source))


def _unsized_notes(unsized, source):
    """One note per (type, reason) of the layers whose tops were left unsized (eighteen TensorRT
    stand-ins give one line, not eighteen)."""
    for (type_name, text), names in unsized.items():
        shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
        yield f"{source + ': ' if source else ''}layer{'s' if len(names) > 1 else ''} {shown} ({type_name}): {text}"
