"""The layer registry: one spec per Caffe type, holding everything the pipeline needs of it.

A spec subclasses `Layer` and is registered under one or more Caffe type
strings with `@register_layer("Type")`.  It declares, in one place:

- `parse(lp)`: read its parameters from the LayerParameter into a plain dict
  (defaults as in caffe.proto; `LayerError` for bad values);
- `infer(attrs, in_shapes)`: Caffe's shape inference -> list of top shapes;
- `param_shapes(attrs, in_shapes)`: the shapes of its learnable blobs, in
  Caffe's order (None when the layer has none);
- `forward(attrs, params, *inputs)`: the torch implementation;
- `onnx(ctx, node)`: the ONNX emission (optional);
- `pytorch_source(node, emit)`: source for a standalone PyTorch model.py (optional);
- `weight_axes`: blob index -> output-channel axis, for quantizers;
- `init_params`, `preprocessing`, `macs`, `data_dependent_shape` and the flags below: optional,
  each declared on `Layer` with its default.

Users register their own layers the same way (see README).

Python layers.  caffeq never imports or runs code named by a model file.  A
`Python` layer whose python_param names a well-known module and class gets a
native spec instead (as OpenCV does): a spec registered under
"Python:<module>.<layer>", e.g. `@register_layer("Python:rpn.proposal_layer.ProposalLayer")`,
is what such a layer resolves to.  Any other Python layer without bottoms is a
data layer whose top shapes must come from the user (`--input-shape
NAME=N,C,H,W`): it resolves to the "PythonData" spec.  Any other Python layer
is refused with a clear error.  `spec_for(lp)` does this lookup for every layer.
"""
import functools
import inspect
import math

import numpy as np
import torch

from ..errors import CaffeqError, ExportError, UnsupportedLayerError

_REGISTRY = {}
_CLAIMS = []     # (type name, looks_like(lp), spec): see claim_layers


class LayerError(CaffeqError):
    """A bad parameter value; the graph builder adds the file and layer name."""


class ForkReading(LayerError):
    """The net's shapes fit only a fork's reading of some of its layers, one no field marks (TextBoxes'
    PriorBox always doubles its priors).  `rewrite(net)` marks them on a copy of the NetParameter
    and returns a note; the graph builder then builds from that copy, once."""

    def __init__(self, message, rewrite):
        super().__init__(message)
        self.rewrite = rewrite


class MissingInputShape(LayerError):
    """A data top whose shape only its (missing) dataset or the user (`--input-shape`) can tell."""


def needs_input_shape(attrs, top, why, lacking="without its dataset"):
    """The error for a data top whose shape nothing but the user can tell."""
    return MissingInputShape(f"cannot tell the shape of top '{top}' {lacking} ({why}); "
                             f"give it with --input-shape {top}=N,C,H,W (Python: input_shapes={{'{top}': (N, C, H, W)}})")


class Layer:
    """Base class of layer specs.  Override what the layer needs."""

    #: Caffe type strings this spec is registered under (set by register_layer)
    types = ()
    #: names of the blobs, in Caffe's order (used for module attributes and reports)
    blob_names = ()
    #: indexes of blobs that are statistics, not trained by gradient (BatchNorm)
    buffer_blobs = ()
    #: blob index -> output-channel axis (or a callable attrs -> axis); quantizers use it
    weight_axes = {}
    #: True for data layers that turn into graph inputs
    is_data = False
    #: False for a fork's type that other spellings must not become (recase_types): DRML's
    #: MultilabelImageData is not happynear's MultiLabelImageData, which stays an unknown fork data layer
    recase_other_spellings = True
    #: True for specs that read a file the layer names (attrs["base_dir"] then holds the prototxt's folder)
    reads_files = False
    #: True for layers that exist only for training (losses, accuracy): dropped on export
    is_training_only = False
    #: True when the tops after the first are training targets, as a data layer's labels are
    #: (Faster R-CNN's ProposalTargetLayer): layers that train only on them are dropped
    makes_training_targets = False
    #: True for a generator whose every top is a label (strawberryfg's GenRandIndex): in a net that has one,
    #: the known layers that read only labels, and whose tops nothing kept reads, are dropped with the losses
    gives_ground_truth = False
    #: True for a data layer that reads its bottoms only to load its batch (strawberryfg's
    #: GenUnifiedDataAndLabel reads sample indexes): at inference it is a graph input without them
    bottoms_ignored_at_inference = False
    #: True when forward needs torch's train/eval mode: it is then called as
    #: forward(attrs, params, *inputs, training=bool) (Dropout, BatchNorm)
    uses_training_flag = False
    #: True when the top's shape depends on the values, not only the shapes, of the bottoms
    #: (Filter, DetectionOutput): infer gives a bound, and runs check the real shape instead
    data_dependent_shape = False
    #: True when a top's size comes from the bottoms' values only (pose_action_caffe's masks sized
    #: by aux_info): `--input-shape TOP=...` (input_shapes) may give it, as for a data layer's top
    shape_from_user = False
    #: True when infer needs values that other layers' top_values give: attrs["bottom_values"] then holds
    #: one per bottom (None where unknown) before infer runs
    reads_bottom_values = False
    #: for a layer ONNX cannot express: why, in one line (the export refuses with it)
    onnx_refusal = None
    #: Caffe's bottom and top counts for the default parse (a count, allowed counts or a range; None:
    #: unchecked) and the bottoms' roles for its message, e.g. "data, rois"
    bottoms = None
    tops = None
    bottom_roles = ""
    #: a line reported whenever a layer of this type is read: how caffeq reads a fork's layer that its
    #: source leaves open (a forward it has only on one device, a layer read as another)
    reading_note = None

    def parse(self, lp):
        """The layer's parameters from its caffe_pb2.LayerParameter -> a plain dict (attrs).

        A "reading_notes" entry (a list of lines) is taken out of attrs and reported with the net's
        other notes: what the reading had to assume (a default a converter left out).  Default: no
        parameters, the `bottoms` / `tops` counts checked."""
        if self.bottoms is not None or self.tops is not None:
            need_blobs(lp, self.types[0], self.bottoms, self.tops, self.bottom_roles)
        return {}

    def infer(self, attrs, in_shapes):
        """Top shapes from bottom shapes.  Default: one top shaped like the first bottom."""
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        """Shapes of the learnable blobs in Caffe's order, or None for a layer without any."""
        return

    def top_values(self, attrs, in_shapes):
        """{top index: value} of tops whose values the bottoms' shapes alone decide, for the layers that
        read them at setup (DSCLRCN's SRNNFormat passes a map's height in a scalar top).  Default: none."""
        return {}

    def forward(self, attrs, params, *inputs):
        raise NotImplementedError(f"{self.types[0]} has no torch implementation")

    def onnx(self, ctx, node):
        raise ExportError(f"layer '{node.name}' ({node.type}): "
                          f"{self.onnx_refusal or 'no ONNX emission for this layer type'}")

    def has_onnx(self):
        return type(self).onnx is not Layer.onnx

    def pytorch_source(self, node, emit):
        """Python source for this layer in a standalone PyTorch model.py (optional).

        `emit` (caffeq.backends.pytorch_emit.Emitter) declares modules, helper
        classes and weights; return the call expression for the top (a list of
        expressions, one per top, for several), or None: not supported.
        """

    def macs(self, attrs, in_shapes, out_shapes):
        """Multiply-accumulates per forward pass (0 for cheap layers)."""
        return 0

    def bottoms_written_back(self, attrs):
        """Indexes of the bottoms whose blobs the layer's Caffe forward overwrites in place (Ristretto's
        layers trim their inputs to fixed point in the bottom blob itself).  Where a later layer reads
        such a blob (or --outputs names it), the graph gives this node one more output per bottom,
        after its tops: that blob's new version.  attrs["written_back"] then lists those indexes, and
        forward, onnx and pytorch_source give the written bottoms after the tops.  Default: none."""
        return ()

    def cannot_run(self, attrs, in_shapes):
        """Why a layer that Caffe loads (and caffeq reads) cannot run here, or None: a fork's own
        Python module, a map the layer cannot index.  forward, onnx and pytorch_source call
        refuse_if_cannot_run with the shapes they see."""
        return None

    def refuse_if_cannot_run(self, name, attrs, in_shapes, error=CaffeqError, layer_type=None):
        """Raise `error` naming the layer as the exporters word it ("layer 'NAME' (TYPE): why")."""
        why = self.cannot_run(attrs, in_shapes)
        if why:
            raise error(f"layer '{name}' ({layer_type or self.types[0]}): {why}")

    def init_params(self, attrs, shapes, rng):
        """Weights for a model loaded without a caffemodel (random_weights=True): arrays of `shapes`.

        Default: blobs of 2 or more axes ~ N(0, 1/fan_in) drawn from the numpy Generator `rng`,
        1-axis blobs (biases) 0.  Override where those would be meaningless (BatchNorm statistics).
        """
        blobs = []
        for shape in shapes:
            if len(shape) >= 2:
                fan_in = max(1, math.prod(shape[1:]))
                blobs.append((rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32))
            else:
                blobs.append(np.zeros(shape, np.float32))
        return blobs

    def top_shapes(self, attrs, given):
        """Data layers: every top's shape from the shapes the user gave for some of them
        ({top index: shape}, `--input-shape`), or None to infer them as usual."""
        return None

    def guessed_label_tops(self, attrs, given):
        """Data layers: indexes of the tops shaped as BVLC Caffe's labels, (N,), because nothing
        else tells their shape (a fork's reader may give more: the graph builder says so when a
        layer needs another shape)."""
        return ()

    def preprocessing(self, attrs):
        """Data layers: lines saying what Caffe does to the data before the net sees it (the
        model.py export's README lists them). [] when nothing is declared."""
        return []

    def weight_axis(self, attrs, index):
        axis = self.weight_axes_for(attrs).get(index)
        return axis(attrs) if callable(axis) else axis

    def blob_names_for(self, attrs):
        """Blob names for this configuration (override when optional blobs shift the order)."""
        return self.blob_names

    def stored_blobs(self, attrs, arrays, notes):
        """A weights file's blobs (numpy arrays) in the order this spec keeps them: a fork that stores the
        same values in another layout is converted here (append a note when doing so).  Default: as stored."""
        return arrays

    def buffer_blobs_for(self, attrs):
        """Indexes of the statistics blobs for this configuration (override when they move)."""
        return self.buffer_blobs

    def weight_axes_for(self, attrs):
        """{blob index: output-channel axis} for this configuration (quantizers use it)."""
        return {i: (a(attrs) if callable(a) else a) for i, a in self.weight_axes.items()}


class ReadOnlyLayer(Layer):
    """A layer caffeq reads, checks and sizes but does not run (a training sampler, a filter it does
    not implement): `why_not_run(attrs)` says why; parse must keep attrs["name"] (and may set
    attrs["kind"], the type as the message names it)."""

    def why_not_run(self, attrs):
        """Why caffeq cannot run or export this layer: the message's clause after the layer's name."""
        raise NotImplementedError

    def refusal(self, attrs):
        kind = attrs.get("kind") or self.types[0].removeprefix("Python:")
        return f"layer '{attrs['name']}' ({kind}): {self.why_not_run(attrs)}"

    def forward(self, attrs, params, *bottoms):
        raise LayerError(self.refusal(attrs))

    def onnx(self, ctx, node):
        raise ExportError(self.refusal(node.attrs))

    def pytorch_source(self, node, emit):
        raise ExportError(self.refusal(node.attrs))


class IdentityLayer(Layer):
    """A layer whose forward (in the phase caffeq runs) copies its one bottom to its one top: torch returns
    the bottom, ONNX writes an Identity, model.py passes the bottom on."""

    def forward(self, attrs, params, x):
        return x

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return emit.inputs[0]


class FunctionLayer(Layer):
    """A layer with one bottom, one top and no parameters, computed by the module-level torch
    function `fn` (set as `fn = staticmethod(that_function)`), which model.py copies."""

    fn = None
    bottoms = tops = 1

    def forward(self, attrs, params, x):
        return self.fn(x)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(self.fn)}({emit.inputs[0]})"


def torch_sources(*objects):
    """The source text of functions and classes, for a spec's model.py helper: the export runs the
    very code that `forward` runs, so the two stay bit-identical."""
    return "\n\n\n".join(inspect.getsource(o) for o in objects)


@functools.lru_cache(maxsize=64)
def cached_constant(build, *args, device=None, dtype=None):
    """build(*args) on `device` in `dtype`, made once per (build, args, device, dtype): the constant
    matrices a spec's forward would otherwise rebuild on every call (model.py keeps them as an
    nn.Module's buffers instead).  Callers only read it.  It is made outside inference mode, so that
    one first made under torch.inference_mode() still serves a later run that records gradients."""
    with torch.inference_mode(False):
        return build(*args).to(device=device, dtype=dtype)


def register_layer(*type_names, override=False):
    """Class decorator: register a Layer subclass under Caffe type names.

    >>> @register_layer("MyScale")
    ... class MyScale(Layer):
    ...     def forward(self, attrs, params, x):
    ...         return x * 2
    """
    if not type_names:
        raise TypeError("register_layer needs at least one Caffe type name")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Layer)):
            raise TypeError("register_layer decorates subclasses of caffeq.Layer")
        spec = cls()
        cls.types = tuple(type_names)
        for name in type_names:
            if name in _REGISTRY and not override and type(_REGISTRY[name]) is not cls:
                raise ValueError(f"layer type {name!r} is already registered "
                                 f"by {type(_REGISTRY[name]).__name__}; pass override=True")
            _REGISTRY[name] = spec
        return cls

    return deco


def claim_layers(type_name, looks_like):
    """Class decorator: this spec reads the `type_name` layers for which looks_like(lp) is true,
    before the type's own spec (a fork's or a tool's layer that reuses a Caffe type name, or a
    Python layer's "Python:<module>.<layer>" key that another project's module reuses)."""
    def deco(cls):
        if "types" not in cls.__dict__:
            cls.types = (type_name,)
        _CLAIMS.append((type_name, looks_like, cls()))
        return cls

    return deco


def get_spec(type_name):
    return _REGISTRY.get(type_name)


def python_layer_key(lp):
    """The registry key of a Python layer's native spec: "Python:<module>.<layer>"."""
    return f"Python:{lp.python_param.module}.{lp.python_param.layer}"


def _names_a_data_layer(lp):
    """A fork's data layer by its look: a type ending or starting with "Data" (tpfister/caffe-heatmap's
    DataHeatmap), or naming Data and setting a data parameter message (RegNet's DenseRegisterDataXY
    with dense_image_data_param) or a transform_param (ginobilinie's V1 MULTI_TASK_DATA_LABEL, whose
    multi_task_data_label_param caffeq does not declare), or making the tops "data" and "label" (aaalgo's
    PicPac)."""
    if lp.type.endswith("Data") or lp.type.startswith("Data") or list(lp.top)[:2] == ["data", "label"]:
        return True
    return "Data" in lp.type and any(f.name.endswith("data_param") or f.name == "transform_param"
                                     for f, _ in lp.ListFields())


def _claimed(key, lp):
    """The spec that claims this layer of registry key `key` (claim_layers), or None."""
    return next((s for t, looks_like, s in _CLAIMS if t == key and looks_like(lp)), None)


def spec_for(lp):
    """The spec of a LayerParameter, or None.  Python layers resolve by module and class
    (see the module docstring); every other layer by its type.  A claim (claim_layers) comes first,
    for a Python layer under its "Python:<module>.<layer>" key (R-C3D's rpn.proposal_layer)."""
    if lp.type != "Python":
        spec = _claimed(lp.type, lp) or _REGISTRY.get(lp.type)
        if spec is None and not len(lp.bottom) and _names_a_data_layer(lp):
            from .fork_data import (
                UNKNOWN_FORK_DATA,  # a fork's data layer: a graph input
            )
            spec = UNKNOWN_FORK_DATA
        return spec
    key = python_layer_key(lp)
    spec = _claimed(key, lp) or _REGISTRY.get(key)
    if spec is None and not len(lp.bottom):
        spec = _REGISTRY.get("PythonData")
    return spec


def supported_types():
    return sorted(_REGISTRY)


def recase_types(net, source=""):
    """Give each layer whose type is a known type in other capitals (ydas/caffe-yolo's
    `type: "Relu"`) the known spelling; one note per type.  Caffe's registry refuses these, but
    the file's meaning is plain where no other known type differs by case alone (not `lstm`:
    BVLC's LSTM and CTPN's Lstm)."""
    by_case = {}
    for known in _REGISTRY:
        by_case.setdefault(known.lower(), []).append(known)
    renamed = {}
    for lp in list(net.layer):
        if lp.type == "Python" or lp.type in _REGISTRY:
            continue
        match = by_case.get(lp.type.lower(), [])
        if len(match) == 1 and not match[0].startswith("Python") and _REGISTRY[match[0]].recase_other_spellings:
            renamed.setdefault((lp.type, match[0]), []).append(lp.name)
            lp.type = match[0]
    return [f"{source + ': ' if source else ''}layer type '{wrong}' read as {known} (Caffe's layer registry "
            f"is case-sensitive and refuses it): {len(names)} layer(s), {', '.join(map(repr, names[:3]))}"
            f"{', ...' if len(names) > 3 else ''}" for (wrong, known), names in renamed.items()]


#: fork readings of a whole net (net_rewrite), applied in order after the upgrade
_NET_REWRITES = []


def net_rewrite(fn):
    """Register fn(net, source) -> [notes]: a fork's layers rewritten into others before the graph is built
    (XmBrain's DataRistretto split into Data and its rounding); read_net applies each after the upgrade."""
    _NET_REWRITES.append(fn)
    return fn


def apply_net_rewrites(net, source=""):
    return [note for fn in _NET_REWRITES for note in fn(net, source)]


def unrun_python_reason(lp):
    """Why a listing leaves a Python layer without a spec unsized: the line require_specs would raise, shorter."""
    return (f"a Python layer (module '{lp.python_param.module or '?'}', class '{lp.python_param.layer or '?'}') "
            f"whose code caffeq never imports or runs")


def python_variant_reason(lp, error):
    """Why a listing leaves unsized a Python layer whose module and class caffeq knows, in a form its spec refuses."""
    return (f"a Python layer (module '{lp.python_param.module}', class '{lp.python_param.layer}') in a form caffeq's "
            f"spec of it does not read ({error}); caffeq never imports or runs its code")


class UnrunPythonLayer(ReadOnlyLayer):
    """A listing's stand-in for a Python layer caffeq has no spec for: read, never sized or run."""

    def parse(self, lp):
        return {"name": lp.name, "kind": "Python", "module": lp.python_param.module, "layer": lp.python_param.layer}

    def why_not_run(self, attrs):
        return (f"a Python layer (module '{attrs.get('module') or '?'}', class '{attrs.get('layer') or '?'}'); caffeq "
                f"never imports or runs code named by a model file")


UNRUN_PYTHON = UnrunPythonLayer()


def require_specs(layer_params, source=""):
    """Check every layer type has a spec; list all unknown types at once."""
    missing = {}
    for lp in layer_params:
        if lp.type == "Python" and spec_for(lp) is None:
            mod = lp.python_param.module or "?"
            layer = lp.python_param.layer or "?"
            raise UnsupportedLayerError(
                f"{source + ': ' if source else ''}layer '{lp.name}' is a Python layer "
                f"(module '{mod}', class '{layer}'); caffeq never imports or runs code named by a "
                f"model file. Write the layer as a caffeq.register_layer spec under the type name "
                f"'Python:{mod}.{layer}' (or a type of its own, used in the prototxt)")
        if not lp.type:
            raise UnsupportedLayerError(f"{source + ': ' if source else ''}layer '{lp.name}' has no type "
                                        f"(Caffe refuses it too: every layer needs type: \"...\")")
        if spec_for(lp) is None:
            missing.setdefault(lp.type, []).append(lp.name)
    if missing:
        import difflib
        known = supported_types()

        by_lower = {}
        for k in known:
            by_lower.setdefault(k.lower(), k)

        def close(t):   # "did you mean": a typo, in any capitalization, of a known type (Relux -> ReLU)
            hit = difflib.get_close_matches(t.lower(), list(by_lower), n=1, cutoff=0.75)
            return f", did you mean {by_lower[hit[0]]}?" if hit else ""

        parts = ", ".join(f"{t} (layers {', '.join(repr(n) for n in names[:3])}"
                          f"{', ...' if len(names) > 3 else ''}{close(t)})" for t, names in sorted(missing.items()))
        raise UnsupportedLayerError(
            f"{source + ': ' if source else ''}unsupported layer types: {parts}. "
            f"caffeq knows {len(supported_types())} types (the README's table; caffeq.supported_types()); "
            f"add one with caffeq.register_layer")


# ---- helpers shared by specs -------------------------------------------------

def _count_words(allowed, blob):
    """'one bottom', '2 bottoms', '1 or 2 bottoms', 'at least 2 bottoms' for an allowed count."""
    if isinstance(allowed, int):
        return f"one {blob}" if allowed == 1 else f"{allowed} {blob}s"
    if isinstance(allowed, range) and allowed.stop >= AT_LEAST:
        return f"at least {_count_words(allowed.start, blob)}"
    counts = [str(n) for n in allowed]
    return f"{', '.join(counts[:-1])} or {counts[-1]} {blob}s" if len(counts) > 1 else f"{counts[0]} {blob}s"


def _count_ok(n, allowed):
    return allowed is None or (n == allowed if isinstance(allowed, int) else n in allowed)


def need_blobs(lp, what, bottoms=None, tops=None, roles="", in_place=True):
    """Caffe's Exact/Min/MaxNumBottomBlobs and top checks, as one LayerError line.

    `bottoms` and `tops` are a count, a collection of allowed counts, or `range(low, AT_LEAST)`
    for "low or more"; None accepts any. `roles` names the bottoms, e.g. "data, rois".
    in_place=False refuses top == bottom, for layers whose Caffe code cannot compute in place."""
    if not in_place and lp.top and lp.bottom and lp.top[0] == lp.bottom[0]:
        raise LayerError(f"{what} does not allow in-place computation (top == bottom '{lp.top[0]}')")
    if _count_ok(len(lp.bottom), bottoms) and _count_ok(len(lp.top), tops):
        return
    roles = f" ({roles})" if roles else ""
    if tops is None:
        raise LayerError(f"{what} takes {_count_words(bottoms, 'bottom')}{roles}, got {len(lp.bottom)}")
    raise LayerError(f"{what} takes {_count_words(bottoms, 'bottom')}{roles} and {_count_words(tops, 'top')}, "
                     f"got {len(lp.bottom)} and {len(lp.top)}")


def four_axes(shape, what, role="bottom"):
    """An (N, C, H, W) shape as ints, or a LayerError naming the layer and the blob's role."""
    if len(shape) != 4:
        raise LayerError(f"{what} needs a 4-axis {role} (N, C, H, W), got {list(shape)}")
    return tuple(int(d) for d in shape)


def legacy_nchw(shape, what):
    """(num, channels, height, width) as Caffe's legacy accessors (Blob::LegacyShape) read a blob of
    at most 4 axes: 1 past its last axis.  Forks that size or run a layer through num()/channels()/
    height()/width() share this reading (happynear's, the pose/action forks')."""
    if len(shape) > 4:
        raise LayerError(f"{what} reads num/channels/height/width, which need at most 4 axes, got {list(shape)}")
    return tuple(shape) + (1,) * (4 - len(shape))


def legacy_depth_space_shape(shape, r, to_space, what):
    """The top of a fork's depth <-> space rearrangement of block r read through the legacy accessors:
    N x C/r^2 x rH x rW (to_space) or N x Cr^2 x H/r x W/r; a LayerError naming `what` when the sizes
    do not divide (caffe-gan's Dtow, Xilinx's GSTiling; `what` names the block field)."""
    n, c, h, w = legacy_nchw(shape, what)
    if to_space:
        if c % (r * r):
            raise LayerError(f"{what} {r} needs channels divisible by {r * r}, got {c}")
        return (n, c // (r * r), h * r, w * r)
    if h % r or w % r:
        raise LayerError(f"{what} {r} needs height and width divisible by {r}, got {h} x {w}")
    return (n, c * r * r, h // r, w // r)


#: need_blobs(lp, what, range(2, AT_LEAST)): two bottoms or more
AT_LEAST = 1 << 20


def positive_field(value, field):
    """value as an int; a LayerError naming the prototxt field when it is below 1."""
    if value < 1:
        raise LayerError(f"{field} must be >= 1, got {value}")
    return int(value)


def canonical_axis(axis, ndim, layer_field="axis"):
    if not -ndim <= axis < ndim:
        raise LayerError(f"{layer_field} {axis} out of range for a {ndim}-axis blob")
    return axis % ndim


def count(shape, start=0, end=None):
    return math.prod(shape[start:end])


def spatial_params(param, ndim, name, default, allow_hw=True, min_value=None, pair_required=True):
    """Read Caffe's kernel/stride/pad/dilation forms: scalar, repeated, or _h/_w.

    Returns a tuple with one value per spatial axis, as Caffe's
    BaseConvolutionLayer::LayerSetUp does.  pair_required: _h and _w must come together, as
    Pooling checks; Convolution takes the unset one as 0 (a valid pad, a refused kernel or stride).
    """
    stem = "kernel" if name == "kernel_size" else name
    h_field, w_field = f"{stem}_h", f"{stem}_w"
    if allow_hw and (param.HasField(h_field) or param.HasField(w_field)):
        plain = getattr(param, name)
        if (param.HasField(name) if isinstance(plain, int) else len(plain)):
            # Caffe: "either kernel_size or kernel_h/w should be specified; not both" (likewise pad, stride)
            raise LayerError(f"give either {name} or {h_field}/{w_field}, not both")
        if ndim != 2:
            raise LayerError(f"{h_field}/{w_field} only work for 2-D data")
        if pair_required and not (param.HasField(h_field) and param.HasField(w_field)):
            raise LayerError(f"both {h_field} and {w_field} are required")
        values = (getattr(param, h_field), getattr(param, w_field))
        if min_value is not None and min(values) < min_value:
            unset = h_field if values[0] < min_value else w_field
            raise LayerError(f"{unset} must be >= {min_value}, got {getattr(param, unset)}"
                             f"{'' if param.HasField(unset) else ' (not set)'}")
    else:
        value = getattr(param, name)
        if isinstance(value, int):  # PoolingParameter declares these as scalars, not repeated
            rep = [value] if param.HasField(name) else []
        else:
            rep = list(value)
        if len(rep) == 0:
            values = (default,) * ndim
        elif len(rep) == 1:
            values = (rep[0],) * ndim
        elif len(rep) == ndim:
            values = tuple(rep)
        else:
            raise LayerError(f"{name} must be given once or {ndim} times, got {len(rep)}")
    if min_value is not None and any(v < min_value for v in values):
        raise LayerError(f"{name} must be >= {min_value}, got {list(values)}")
    return tuple(int(v) for v in values)
