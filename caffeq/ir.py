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

import numpy as np

from .errors import CaffeqError, GraphError, ShapeError, WeightsError
from .io.schema import caffe_pb2
from .layers import get_spec, require_specs
from .layers.registry import LayerError

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


def _legacy_shape_equals(legacy, expected):
    """Caffe's Blob::ShapeEquals for a blob given as num/channels/height/width."""
    if len(expected) > 4:
        return False
    padded = (1,) * (4 - len(expected)) + tuple(expected)
    return tuple(legacy) == padded


def _check_shape(source, lp, blob, shape):
    if any(d < 0 for d in shape):
        raise ShapeError(f"{_where(source, lp)}: top '{blob}' would have negative dimension {list(shape)}")
    n = math.prod(shape)
    if n > MAX_BLOB_ELEMENTS:
        raise ShapeError(f"{_where(source, lp)}: top '{blob}' would have absurd shape {list(shape)} "
                         f"({n} elements)")


def build_graph(net, weights=None, phase="TEST", stages=(), level=0, batch=None, source="",
                base_dir=None):
    """NetParameter (V2, upgraded) + optional caffemodel blobs -> Graph with Caffe's shapes.

    weights: dict layer name -> list of BlobData (from read_caffemodel) or arrays.
    batch: replaces the first dimension of every graph input.
    """
    layers = filter_layers(net, phase, stages, level, source)
    require_specs(layers, source)
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
    names_seen = set()

    for lp in layers:
        spec = get_spec(lp.type)
        where = _where(source, lp)
        if lp.name in names_seen:
            raise GraphError(f"{where}: duplicate layer name")
        names_seen.add(lp.name)
        try:
            attrs = spec.parse(lp)
        except LayerError as e:
            raise LayerError(f"{where}: {e}") from None
        except CaffeqError:
            raise
        except Exception as e:  # a spec's own check on user input
            raise LayerError(f"{where}: bad parameters: {e}") from None
        if spec.is_data:
            attrs["base_dir"] = base_dir

        in_ids = []
        for b in lp.bottom:
            if b not in current:
                raise GraphError(f"{where}: bottom '{b}' is not produced by any earlier layer "
                                 f"(undefined blob, wrong order or a cycle)")
            in_ids.append(current[b])
        in_shapes = [shapes[i] for i in in_ids]
        try:
            out_shapes = spec.infer(attrs, in_shapes)
            if spec.is_data and batch is not None:
                out_shapes = [(batch,) + tuple(s[1:]) if len(s) else s for s in out_shapes]
            expected = spec.param_shapes(attrs, in_shapes)
        except LayerError as e:
            raise LayerError(f"{where}: {e}") from None
        except CaffeqError:
            raise
        except Exception as e:
            raise ShapeError(f"{where}: cannot infer shapes from bottoms "
                             f"{[list(s) for s in in_shapes]}: {type(e).__name__}: {e}") from None
        if len(out_shapes) != len(lp.top):
            raise GraphError(f"{where}: produces {len(out_shapes)} tops but the prototxt names "
                             f"{len(lp.top)}")

        out_ids = []
        for t, s in zip(lp.top, out_shapes):
            s = tuple(int(d) for d in s)
            _check_shape(source, lp, t, s)
            tid = len(temp_blob)
            temp_blob[tid] = t
            temp_producer[tid] = lp.name
            shapes[tid] = s
            versions.setdefault(t, []).append(tid)
            current[t] = tid
            out_ids.append(tid)
            if spec.is_data:
                graph_input_ids.append(tid)

        node = Node(name=lp.name, type=lp.type, spec=spec, param=lp, attrs=attrs,
                    bottoms=list(lp.bottom), tops=list(lp.top), inputs=in_ids, outputs=out_ids,
                    param_names=[p.name for p in lp.param],
                    expected_param_shapes=[tuple(int(d) for d in s) for s in expected]
                    if expected is not None else None)
        if expected:
            for s in node.expected_param_shapes:
                _check_shape(source, lp, "weights", s)
        nodes.append(node)

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
    final = {ids[-1] for ids in versions.values()}
    outputs = [names[tid] for tid in sorted(final) if names[tid] not in consumed]
    inputs = [names[tid] for tid in graph_input_ids]

    graph = Graph(name=net.name, nodes=nodes, tensors=tensors, inputs=inputs, outputs=outputs,
                  source=source)
    if weights is not None:
        attach_weights(graph, weights, source)
        share_params(graph)
    return graph


def attach_weights(graph, weights, source="", weights_source=""):
    """Copy weights into nodes by layer name, as Caffe's Net::CopyTrainedLayersFrom."""
    wsrc = weights_source or source
    for node in graph.nodes:
        expected = node.expected_param_shapes
        if node.name not in weights:
            if expected:
                raise WeightsError(f"{wsrc}: layer '{node.name}' ({node.type}) needs "
                                   f"{len(expected)} weight blob(s) {[list(s) for s in expected]} "
                                   f"but the weights file has no layer of that name")
            continue
        blobs = weights[node.name]
        if expected is None:
            expected = []
        if len(blobs) != len(expected):
            if not blobs and not expected:
                continue
            raise WeightsError(f"{wsrc}: layer '{node.name}' ({node.type}): the weights file has "
                               f"{len(blobs)} blob(s), the prototxt implies {len(expected)} "
                               f"{[list(s) for s in expected]}")
        arrays = []
        for i, (b, shape) in enumerate(zip(blobs, expected)):
            arr = b.array if hasattr(b, "array") else np.asarray(b)
            legacy = getattr(b, "legacy_shape", False)
            ok = _legacy_shape_equals(arr.shape, shape) if legacy else tuple(arr.shape) == tuple(shape)
            if not ok:
                raise WeightsError(f"{wsrc}: layer '{node.name}' ({node.type}) blob {i}: "
                                   f"the weights file has shape {list(arr.shape)}, "
                                   f"the prototxt implies {list(shape)}")
            arrays.append(arr.reshape(shape))
        node.blobs = arrays


def share_params(graph):
    """Layers that name a ParamSpec share that blob with its first owner (Caffe's param sharing)."""
    owners = {}
    for node in graph.nodes:
        for i, pname in enumerate(node.param_names):
            if not pname or not node.expected_param_shapes or i >= len(node.expected_param_shapes):
                continue
            if pname in owners:
                owner, j = owners[pname]
                if owner.expected_param_shapes[j] != node.expected_param_shapes[i] and \
                        math.prod(owner.expected_param_shapes[j]) != math.prod(node.expected_param_shapes[i]):
                    raise WeightsError(f"layer '{node.name}': shared parameter '{pname}' has shape "
                                       f"{list(node.expected_param_shapes[i])} but its owner "
                                       f"'{owner.name}' has {list(owner.expected_param_shapes[j])}")
                node.shared_from[i] = (owner.name, j)
                if owner.blobs is not None:
                    if node.blobs is None:
                        node.blobs = [None] * len(node.expected_param_shapes)
                    node.blobs[i] = owner.blobs[j].reshape(node.expected_param_shapes[i])
            else:
                owners[pname] = (node, i)


def init_params(graph, seed=0, overwrite=False):
    """Fill missing weights deterministically (for models loaded without a caffemodel).

    Weights ~ N(0, 1/fan_in), biases 0, BatchNorm mean 0 / variance 1 / factor 1.
    """
    rng = np.random.default_rng(seed)
    for node in graph.nodes:
        if not node.has_params or (node.blobs is not None and not overwrite):
            continue
        node.blobs = [np.asarray(a, np.float32)
                      for a in node.spec.init_params(node.attrs, node.expected_param_shapes, rng)]
