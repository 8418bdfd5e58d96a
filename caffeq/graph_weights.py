"""Weights on the graph IR: a caffemodel's blobs attached by layer name (Caffe's
Net::CopyTrainedLayersFrom), blobs shared by ParamSpec name, and random weights for a net loaded
without any."""
import math

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


def attach_weights(graph, weights, source="", weights_source="", notes=None):
    """Copy weights into nodes by layer name, as Caffe's Net::CopyTrainedLayersFrom; notes receives a
    line for each layer whose blobs came in a fork's other layout (Layer.stored_blobs)."""
    wsrc = weights_source or source
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
