"""Weights on the graph IR: a caffemodel's blobs attached by layer name (Caffe's
Net::CopyTrainedLayersFrom), blobs shared by ParamSpec name, and random weights for a net loaded
without any."""
import math
from collections import ChainMap

import numpy as np

from .errors import WeightsError


def legacy_shape_equals(legacy, expected):
    """Caffe's Blob::ShapeEquals for a blob given as num/channels/height/width."""
    if len(expected) > 4:
        return False
    padded = (1,) * (4 - len(expected)) + tuple(expected)
    return tuple(legacy) == padded


def _weights_layer_name(node, weights):
    """The weights-file layer that initialises this node: its own name, else (pose_action_caffe's
    copy_postfix_name, as its CopyTrainedLayersFrom) the postfix its longer name ends with; None."""
    if node.name in weights:
        return node.name
    postfix = node.param.copy_postfix_name if node.param is not None else ""
    if postfix and len(node.name) > len(postfix) and node.name.endswith(postfix) and postfix in weights:
        return postfix
    return None


def _split_merged_scales(graph, weights, wsrc, notes):
    """intel/caffe's MKL engines merge the Scale after a BatchNorm into it when the net loads, and the
    caffemodel it saves holds that: BatchNorm blobs [mean, variance, factor, gamma(, beta)] and a Scale
    layer without blobs (or none).  Read against the prototxt (BatchNorm, then Scale), gamma and beta go
    back to the Scale, which then computes what the merged layer did.  Returns the weights to attach
    (the mapping itself if untouched)."""
    readers = {}
    for node in graph.nodes:
        for t in node.inputs[:1]:
            readers.setdefault(t, []).append(node)
    moved = {}
    for node in graph.nodes:
        name = _weights_layer_name(node, weights)
        if node.type != "BatchNorm" or name is None or (node.attrs or {}).get("scale_bias"):
            continue
        blobs = weights[name]
        nexts = readers.get(node.outputs[0], [])
        if len(blobs) not in (4, 5) or len(nexts) != 1 or nexts[0].type != "Scale":
            continue
        scale = nexts[0]
        scale_name = _weights_layer_name(scale, weights)
        if (scale_name is not None and len(weights[scale_name])) or len(scale.inputs) != 1:
            continue
        if bool(scale.attrs.get("bias_term")) != (len(blobs) == 5):
            continue
        moved[name], moved[scale.name] = blobs[:3], blobs[3:]
        if notes is not None:
            notes.append(f"{wsrc}: layer '{node.name}' (BatchNorm) holds the scale{' and shift' if len(blobs) == 5 else ''} "
                         f"of Scale '{scale.name}', which the weights file lacks (Intel Caffe merges them when a net "
                         f"loads): given back to the Scale")
    return ChainMap(moved, weights) if moved else weights   # no copy of a large weights mapping


def attach_weights(graph, weights, source="", weights_source="", notes=None):
    """Copy weights into nodes by layer name, as Caffe's Net::CopyTrainedLayersFrom; notes receives a
    line for each layer whose blobs came in a fork's other layout (Layer.stored_blobs)."""
    wsrc = weights_source or source
    weights = _split_merged_scales(graph, weights, wsrc, notes)
    for node in graph.nodes:
        expected = node.expected_param_shapes
        source_name = _weights_layer_name(node, weights)
        if source_name is None:
            if expected:
                raise WeightsError(f"{wsrc}: layer '{node.name}' ({node.type}) needs "
                                   f"{len(expected)} weight blob(s) {[list(s) for s in expected]} "
                                   f"but the weights file has no layer of that name")
            continue
        blobs = weights[source_name]
        if node.spec is not None and node.attrs is not None:
            arrays = [b.array if hasattr(b, "array") else np.asarray(b) for b in blobs]
            said = []
            converted = node.spec.stored_blobs(node.attrs, arrays, said)
            if converted is not arrays:
                blobs = converted
            if notes is not None:
                notes.extend(f"{wsrc}: layer '{node.name}': {line}" for line in said)
        if expected is None and any(graph.tensors[t].shape is None for t in node.inputs):
            node.blobs = [b.array if hasattr(b, "array") else np.asarray(b) for b in blobs]
            continue   # shapes unknown (listed without its dataset): nothing to check against
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
            ok = legacy_shape_equals(arr.shape, shape) if legacy else tuple(arr.shape) == tuple(shape)
            if not ok and not node.param.strict_dim:
                ok = arr.size == math.prod(shape)   # DeepLab-Context's strict_dim: false (net.cpp)
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
