"""`caffeq.load` and the Model object users hold."""
import os
import tempfile

import numpy as np

from .backends.onnx_backend import export_onnx
from .backends.pytorch_source import export_pytorch
from .backends.torch_backend import run_numpy, to_torch
from .errors import CaffeqError, ParseError, ShapeError
from .graph_weights import attach_weights, init_params, share_params
from .io.caffemodel import read_caffemodel
from .io.container import load_caffeq_parts
from .io.imports import expand_imports
from .io.prototxt import parse_prototxt_text, read_prototxt
from .io.templates import as_written, fill_unset_num_outputs, resolve_placeholders
from .io.upgrade import upgrade_net
from .ir import build_graph
from .layers import recase_types, spec_for
from .layers.fork_data import UNKNOWN_FORK_DATA
from .layers.registry import apply_net_rewrites


class Model:
    """A Caffe net as caffeq's graph IR, with its weights.

    Attributes: `graph` (caffeq.ir.Graph), `inputs` ({blob: shape}),
    `outputs` ([blob]), `layers` ([Node]), `params` ({layer: [arrays]}),
    `warnings` ([str]), `net` (the upgraded NetParameter).
    """

    def __init__(self, graph, net, prototxt=None, weights_path=None, warnings=None, phase="TEST",
                 input_shapes=None, output_names=None, stages=(), level=0, batch=None):
        self.graph = graph
        self.net = net
        self.prototxt = prototxt
        self.weights_path = weights_path
        self.warnings = list(warnings or [])
        self.phase = phase
        self.quantization = {}   # layer name -> quantizer name, filled by caffeq.quantize
        #: the caffeq.quant.QuantReport of the quantize() call that made this model, or None
        self.quant_report = None
        #: [(transform name, what it changed)] applied by caffeq.transforms, oldest first
        self.transforms = []
        #: layers folded into the layer before them ahead of fp16 rounding (listed in the report)
        self.folded_layers = []
        # what the user chose when loading; every rebuild of the graph (reshaped, transforms) keeps it
        self.input_shapes = dict(input_shapes or {})   # {blob: shape} for data tops and inputs
        self.output_names = list(output_names or [])   # chosen output blobs ([]: Caffe's own)
        self.stages, self.level = tuple(stages), int(level)  # the NetState the layers were chosen by
        self.batch = batch                               # the inputs' batch the user set, or None
        #: (options, weights fingerprint, module) of the last `run`, reused while both match; never copied
        self.run_cache = None
        #: the refusals of template placeholders a listing left without values (load(unknown_shapes_ok=True))
        self.unfilled_placeholders = []

    # -- what pycaffe users expect --------------------------------------------
    @property
    def name(self):
        return self.graph.name

    @property
    def inputs(self):
        return {self.graph.tensors[t].blob: self.graph.tensors[t].shape for t in self.graph.inputs}

    @property
    def outputs(self):
        return [self.graph.tensors[t].blob for t in self.graph.outputs]

    @property
    def layers(self):
        return self.graph.nodes

    @property
    def params(self):
        return {n.name: list(n.blobs) for n in self.graph.nodes if n.blobs}

    @property
    def blob_shapes(self):
        """Caffe blob name -> shape of its final version (like pycaffe's net.blobs)."""
        return {blob: self.graph.tensors[ssa].shape for blob, ssa in self.graph.final_versions().items()}

    def __repr__(self):
        return (f"<caffeq.Model {self.name!r}: {len(self.layers)} layers, inputs {self.inputs}, "
                f"outputs {self.outputs}>")

    # -- backends -----------------------------------------------------------------
    def to_torch(self, device="cpu", dtype=None, all_blobs=False, optimize=False, compile=False):
        """A torch.fx GraphModule computing the net (in eval mode; call .train() to train).

        optimize=True folds BatchNorm/Scale into convolutions, drops identities
        and uses channels_last (inference speed; outputs equal within tolerance,
        intermediate blobs of folded layers are no longer available).
        compile=True wraps it in torch.compile with weight freezing (inference
        only; the first call compiles, which takes tens of seconds on a CPU).
        """
        self.require_shapes()
        return to_torch(self, device=device, dtype=dtype, all_blobs=all_blobs, optimize=optimize,
                        compile=compile)

    def run(self, inputs, device="cpu", all_blobs=False, batch_size=None, dtype=None, exact=False,
            compile=False):
        """Run on numpy inputs ({blob: array} or one array) -> {blob: numpy array}.

        By default the optimized module runs (BatchNorm/Scale folded into the convolutions,
        identities removed, channels_last): the outputs equal Caffe's within 1e-5 relative, but
        the folded weights round differently.  exact=True (or all_blobs=True) runs the
        layer-by-layer module in Caffe's order of operations, the one the reference tests check.
        compile=True adds torch.compile with weight freezing (long runs; the first call compiles).
        The module is built once and reused by later calls with the same options; after changing
        weights in place, call `clear_cache()`.
        """
        self.require_shapes()
        return run_numpy(self, inputs, device=device, all_blobs=all_blobs, batch_size=batch_size,
                         dtype=dtype, exact=exact, compile=compile)

    def clear_cache(self):
        """Forget the torch module `run` keeps between calls."""
        self.run_cache = None

    def export_onnx(self, path, **kwargs):
        self.require_shapes()
        return export_onnx(self, path, **kwargs)

    def export_pytorch(self, out, **kwargs):
        """Write a standalone model.py + weights (see caffeq.backends.pytorch_source)."""
        self.require_shapes()
        return export_pytorch(self, out, **kwargs)

    def replace(self, graph=None, net=None):
        """A new Model with `graph` and `net` (default: this model's own) and every other field copied:
        the only way caffeq copies models, so that no field is dropped on the way."""
        m = Model(self.graph if graph is None else graph, self.net if net is None else net,
                  self.prototxt, self.weights_path, self.warnings, self.phase, self.input_shapes,
                  self.output_names, self.stages, self.level, self.batch)
        m.quantization = dict(self.quantization)
        m.quant_report = self.quant_report
        m.transforms = list(self.transforms)
        m.folded_layers = list(self.folded_layers)
        m.unfilled_placeholders = list(self.unfilled_placeholders)
        return m

    def reshaped(self, batch):
        """The same model with every input's batch dimension set to `batch`."""
        graph = build_graph(self.net, None, phase=self.phase, source=self.prototxt or "",
                            base_dir=self._base_dir(), **{**self.build_options(), "batch": batch})
        for new, old in zip(graph.nodes, self.graph.nodes):
            new.blobs = old.blobs
            new.quant = old.quant  # keep the compact form for writers (ONNX, .caffeq)
        m = self.replace(graph)
        m.batch = batch          # later rebuilds (transforms) keep it
        return m

    def require_shapes(self):
        """Refuse to run or export a net listed with unknown data shapes or template placeholders
        without values (load(unknown_shapes_ok=True))."""
        if self.unfilled_placeholders:
            raise ParseError(self.unfilled_placeholders[0])
        unknown = [self.graph.tensors[t].blob for t in self.graph.inputs if self.graph.tensors[t].shape is None]
        if unknown:
            raise ShapeError(f"{self.prototxt}: the shape of {', '.join(map(repr, unknown))} is unknown "
                             f"without the dataset; give it with --input-shape {unknown[0]}=N,C,H,W")

    def build_options(self):
        """The build_graph options the user chose (input shapes, outputs, NetState, batch), for rebuilding
        the graph."""
        return {"input_shapes": self.input_shapes, "outputs": self.output_names, "stages": self.stages,
                "level": self.level, "batch": self.batch}

    def _base_dir(self):
        return os.path.dirname(os.path.abspath(self.prototxt)) if self.prototxt else os.getcwd()


def reads_parameters(lp):
    """Whether caffeq has a spec that reads this layer's parameters (not the stand-in for an
    unknown fork data layer, which takes its shapes from --input-shape)."""
    spec = spec_for(lp)
    return spec is not None and spec is not UNKNOWN_FORK_DATA


def read_net(prototxt, ignore_unknown=False, warnings=None, phase="TEST", defines=None, placeholders=None):
    """Read a prototxt (or a caffemodel holding the net) and upgrade it to V2 like Caffe.

    phase: the net to be built; unknown fields that cannot matter for it are warnings.
    defines: {NAME: value} for template placeholders (`num_output: ${NUM_LABELS}`).  placeholders: a
    list that receives those left unfilled (io/templates.py), for the caller to fill from the net a
    caffemodel saved; without it an unfilled placeholder is an error."""
    warnings = [] if warnings is None else warnings
    path = os.fspath(prototxt)
    if not os.path.exists(path):
        raise ParseError(f"{path}: no such file")
    pending = []
    net = read_prototxt(path, ignore_unknown=ignore_unknown, warnings=warnings, phase=phase,
                        known_layer=reads_parameters, defines=defines, placeholders=pending)
    expand_imports(net, path, lambda text, where: parse_prototxt_text(
        text, path=where, ignore_unknown=ignore_unknown, warnings=warnings, phase=phase,
        known_layer=reads_parameters, defines=defines), warnings)
    notes = upgrade_net(net, source=path, keep_shapeless_inputs=True) + recase_types(net, source=path) + \
        apply_net_rewrites(net, source=path)
    warnings.extend(as_written(note, pending) for note in notes)
    if placeholders is None:
        resolve_placeholders(net, pending, path, warnings)
    else:
        placeholders.extend(pending)
    return net


def load(prototxt, weights=None, phase="TEST", stages=(), level=0, batch=None, ignore_unknown=False,
         random_weights=False, seed=0, net=None, input_shapes=None, outputs=None, unknown_shapes_ok=False,
         defines=None):
    """Load a Caffe model: prototxt (+ caffemodel) -> Model.

    phase: "TEST" (default, deploy and evaluation) or "TRAIN".
    batch: override the batch dimension of every input.
    input_shapes: {blob: (N, C, H, W)} for inputs and data-layer tops (a train_val net whose
        dataset is not at hand, a Python data layer).
    outputs: blob names to make the net's outputs (default: Caffe's, the blobs nothing reads).
    unknown_shapes_ok: list a net whose data shapes only a missing dataset could tell (shapes None);
        such a model cannot run or export until loaded with input_shapes.
    random_weights: fill weights the caffemodel does not supply (or all, without one).
    defines: {NAME: value} for the template placeholders of a prototxt that a script fills in
        (`num_output: ${NUM_LABELS}`); undefined ones come from the net saved in the caffemodel.
    A `.caffeq` file is accepted in place of the prototxt.
    net: an already read (and upgraded) NetParameter to use instead of reading `prototxt`, which
    still names the source and the folder relative paths start from.
    """
    path = os.fspath(prototxt)
    if path.endswith(".caffeq"):
        parts = load_caffeq_parts(path, phase=phase, batch=batch, input_shapes=input_shapes, outputs=outputs)
        model = Model(parts.graph, parts.net, path, path, parts.warnings, phase, parts.input_shapes,
                      parts.outputs, batch=batch)
        model.quantization = parts.quantization
        model.quant_report = parts.report
        return model
    warnings = []
    placeholders = []
    if net is None:
        net = read_net(path, ignore_unknown=ignore_unknown, warnings=warnings, phase=phase, defines=defines,
                       placeholders=placeholders)
    blobs = None
    weights_path = None
    if weights is not None:
        weights_path = os.fspath(weights)
        if not os.path.exists(weights_path):
            raise ParseError(f"{weights_path}: no such file")
        cm = read_caffemodel(weights_path)
        warnings.extend(cm.notes)
        upgrade_net(cm.net, source=weights_path, weights=cm.blobs)
        blobs = cm.blobs
    # a listing (unknown_shapes_ok) shows a template without its values, sizes unknown from them on
    unfilled = {} if unknown_shapes_ok else None
    resolve_placeholders(net, placeholders, path, warnings, None if blobs is None else cm.net, weights_path,
                         input_shapes, unfilled)
    fill_unset_num_outputs(net, blobs, path, warnings, weights_path, unfilled)
    graph = build_graph(net, None, phase=phase, stages=stages, level=level, batch=batch, source=path,
                        input_shapes=input_shapes, outputs=outputs, notes=warnings,
                        unknown_shapes_ok=unknown_shapes_ok,
                        unset_layers={name: why for name, (_, why) in (unfilled or {}).items()})
    if blobs is not None:
        names = {n.name for n in graph.nodes}
        # layers of the file that --outputs or the phase left out are not "extra" weights
        in_file = names | {lp.name for lp in net.layer}
        extra = [k for k, v in blobs.items() if k not in in_file and v]
        if extra:
            warnings.append(f"{weights_path}: {len(extra)} layer(s) in the weights are not in the net "
                            f"and were ignored: {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}")
        if random_weights:
            blobs = {k: v for k, v in blobs.items() if k in names}
            init_params(graph, seed)
            for n in graph.nodes:
                if n.name not in blobs:
                    blobs[n.name] = [np.asarray(b) for b in (n.blobs or [])]
        attach_weights(graph, blobs, path, weights_path, notes=warnings)
    elif random_weights:
        init_params(graph, seed)
    share_params(graph)
    model = Model(graph, net, path, weights_path, warnings, phase, input_shapes, outputs, stages, level, batch)
    model.unfilled_placeholders = list(dict.fromkeys(refusal for refusal, _ in (unfilled or {}).values()))
    return model


def load_from_text(text, weights=None, **kwargs):
    """Load from prototxt text (for tests and notebooks)."""
    with tempfile.NamedTemporaryFile("w", suffix=".prototxt", delete=False) as f:
        f.write(text)
        name = f.name
    try:
        return load(name, weights=weights, **kwargs)
    finally:
        os.unlink(name)


__all__ = ["CaffeqError", "Model", "load", "load_from_text", "read_net"]
