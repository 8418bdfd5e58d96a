"""Graph IR -> a standalone PyTorch `model.py` + weights + README (no caffeq needed to use it).

Each layer spec writes its own source through `pytorch_source(node, emit)`
(see `Emitter`): standard modules (nn.Conv2d, nn.MaxPool2d(ceil_mode=...),
nn.BatchNorm2d, ...) where they compute what caffeq's torch backend computes,
and small helper classes, defined once in the same file, where Caffe differs
(LRN, Scale, MVN, ...).  Specs use the same torch calls in the same order as
their `forward`, so the generated module's outputs equal `Model.run`'s bit for
bit.  One deliberate exception: with `exact_batchnorm=False` (the default) a
BatchNorm [+ Scale] is a plain nn.BatchNorm2d, which evaluates
x * (w / sqrt(var + eps)) + (b - mean * w / sqrt(var + eps)) instead of
Caffe's (x - mean) / sqrt(var + eps) * w + b: equal within float32 rounding,
not bit for bit; `exact_batchnorm=True` keeps Caffe's order in a subclass of
nn.BatchNorm2d.

The generated modules train (model.train(): BatchNorm batch statistics,
Dropout), and torch.export (with a dynamic batch) and torch.jit.script accept
them, except nets holding DetectionOutput, ROIPooling or PSROIPooling (Python
loops over data-dependent counts: eager only); LSTM/RNN export at a fixed
sequence length; a Parameter layer's blob keeps the shape the prototxt declares.

Every built-in type has PyTorch source; a registered layer without one makes
the export refuse (ExportError, nothing written), listing all such layers.
"""
import hashlib
import os
import re
import textwrap

import numpy as np

from ..errors import CaffeqError, ExportError
from ..fs import atomic_path, refuse_overwrite
from ..quant import get_quantizer, quantize
from .names import identifier
from .onnx_backend import _live_io
from .pytorch_emit import Emitter, class_name, doc_safe, lit, module_reserved, one_line, size_arg

WEIGHT_FORMATS = ("safetensors", "pt")
_RESERVED_LOCALS = {"self", "torch", "nn", "F", "os", "WEIGHTS", "load", "_"}


# ---- the exporter ----------------------------------------------------------------------

class _Generator:
    def __init__(self, model, exact_batchnorm=False, weights_file="weights.safetensors",
                 weights_format="safetensors", cls_name=None, source_note=""):
        self.model = model
        self.graph = model.graph
        self.exact_batchnorm = bool(exact_batchnorm)
        self.weights_file = weights_file
        self.weights_format = weights_format
        kept, inputs, outputs, dropped = _live_io(self.graph)
        self.kept, self.graph_inputs, self.graph_outputs, self.dropped = kept, inputs, outputs, dropped
        self.output_set = set(outputs)
        self.uses = {}
        for n in kept:
            for t in n.inputs:
                self.uses.setdefault(t, []).append(n)
        self.init_lines = []
        self.forward_lines = []
        self.helpers = {}
        self.imports = set()
        self.notes = []
        self.state = {}
        self.blob_keys = {}
        self.pending = []
        self.absorbed_now = []
        self.source_note = source_note
        self.cls_name = cls_name
        self._locals = set(_RESERVED_LOCALS)
        self._attrs = set()
        self._attr_reserved = module_reserved()

    # -- locals (one per SSA tensor; a blob's name is reused while its old value is dead) --
    def fresh_local(self, hint):
        return identifier(hint, self._locals)

    def _plan_locals(self):
        order = {n.name: k for k, n in enumerate(self.kept)}
        self.last_use = {}
        for n in self.kept:
            if not n.outputs:
                continue  # Silence: what only it reads is dead
            for t in n.inputs:
                self.last_use[t] = max(self.last_use.get(t, -1), order[n.name])
        for t in self.graph_outputs:
            self.last_use[t] = len(self.kept) + 1
        self.blob_base = {}
        self.var_of = {}
        self.var_holds = {}

    def _base(self, blob):
        if blob not in self.blob_base:
            self.blob_base[blob] = identifier(blob, self._locals)
        return self.blob_base[blob]

    def _assign_var(self, ssa, position, strict=False):
        """The local for a new tensor; `strict`: this node's bottoms stay readable (several
        statements write its tops)."""
        blob = self.graph.tensors[ssa].blob
        var = self._base(blob)
        held = self.var_holds.get(var, set())
        limit = position - 1 if strict else position
        if any(self.last_use.get(t, -1) > limit for t in held):
            var = self.fresh_local(blob)
            held = set()
        self.var_holds[var] = {ssa}
        self.var_of[ssa] = var
        return var

    def _alias(self, ssa, var):
        self.var_of[ssa] = var
        self.var_holds.setdefault(var, set()).add(ssa)

    # -- the walk ---------------------------------------------------------------------------
    def generate(self):
        self._plan_locals()
        emit = Emitter(self)
        params = []
        for t in self.graph_inputs:
            var = self._base(self.graph.tensors[t].blob)
            self._alias(t, var)
            params.append(var)
        refusals = []
        absorbed = {}
        for position, node in enumerate(self.kept):
            if node.name in absorbed:
                continue
            emit.node = node
            emit.attr = identifier(node.name, self._attrs, self._attr_reserved)
            emit.inputs = [self.var_of.get(t, "?") for t in node.inputs]
            self.pending = []
            self.absorbed_now = []
            n_init, n_state = len(self.init_lines), len(self.state)
            try:
                result = node.spec.pytorch_source(node, emit)
                if result is not None:
                    self._check_shared(node)
                    for other in self.absorbed_now:
                        self._check_shared(other)
            except (CaffeqError, NotImplementedError) as e:
                result = e
            except Exception as e:  # noqa: BLE001 (a bug in an emission: still list every refusal)
                result = ExportError(f"PyTorch emission failed: {type(e).__name__}: {e}")
            if result is None or isinstance(result, Exception):
                why = "no PyTorch source for this layer type" if result is None else _strip(node, result)
                refusals.append((node, why))
                del self.init_lines[n_init:]
                for k in list(self.state)[n_state:]:
                    del self.state[k]
                continue
            targets = node
            if self.absorbed_now:
                for other in self.absorbed_now:
                    absorbed[other.name] = node.name
                targets = self.absorbed_now[-1]
            self._emit_result(node, targets, result, position, emit)
        if refusals:
            types = {}
            for n, why in refusals:
                types.setdefault(n.type, []).append(n.name)
            detail = "; ".join(f"layer '{n.name}' ({n.type}): {why}" for n, why in refusals)
            err = ExportError(f"{self.model.prototxt or self.graph.name}: cannot write PyTorch source, "
                              f"{len(refusals)} layer(s) unsupported (types: {', '.join(sorted(types))}): "
                              f"{detail}")
            err.refused = [n.name for n, _ in refusals]
            err.unsupported_types = sorted(types)
            raise err
        if not self.graph_outputs:
            raise ExportError(f"{self.model.prototxt or self.graph.name}: the inference graph has no outputs")
        return params

    def _emit_result(self, node, targets, result, position, emit):
        outs = list(targets.outputs)
        comment = one_line(f"{node.name} ({node.type})" if targets is node else
                           f"{node.name} ({node.type}) + {targets.name} ({targets.type})")
        lines = list(self.pending)
        dead = {o for o in outs if o not in self.last_use}  # read by nothing (or only Silence)
        if isinstance(result, str):
            if len(dead) == len(outs):
                lines.append(result + ("  # top unused (silenced)" if outs else ""))
            else:
                names = ["_" if o in dead else self._assign_var(o, position) for o in outs]
                lines.append(f"{', '.join(names)} = {result}")
        else:
            exprs = list(result)
            if len(exprs) != len(outs):
                raise ExportError(f"internal: layer '{node.name}' emitted {len(exprs)} results for "
                                  f"{len(outs)} tops")
            for o, e in zip(outs, exprs):
                if o in dead:
                    if e not in self.var_holds:
                        lines.append(e + "  # top unused (silenced)")
                    continue
                if e in self.var_holds:
                    self._alias(o, e)  # the top is a bottom as it is (Split, one-input Concat)
                else:
                    lines.append(f"{self._assign_var(o, position, strict=len(exprs) > 1)} = {e}")
        if not lines:
            return
        own = f"self.{emit.attr}"
        mentions = any(own in ln for ln in lines)
        for i, line in enumerate(lines):
            if i == len(lines) - 1 and not mentions:
                line += f"  # {comment}"
            self.forward_lines.append(line)

    def _check_shared(self, node):
        for i, (owner, j) in (node.shared_from or {}).items():
            key = self.blob_keys.get((node.name, i))
            okey = self.blob_keys.get((owner, j))
            if key is None:
                continue
            if okey is None or self.state[key].size != self.state[okey].size \
                    or not np.array_equal(self.state[key].ravel(), self.state[okey].ravel()):
                raise ExportError(f"blob {i} is shared with layer '{owner}' (param name), in a form this "
                                  f"writer cannot tie")
            if self.state[key].shape != self.state[okey].shape:
                # Caffe's PERMISSIVE sharing of equal counts (a 1x1 convolution and an InnerProduct): torch
                # cannot make one Parameter of two shapes, so the copies hold the same values, untied
                self.init_lines.append(f"# self.{key} holds self.{okey}'s values reshaped: shared with "
                                       f"{one_line(owner)} (Caffe param name), not tied for training")
                continue
            # one Parameter object under both names, as Caffe shares the blob
            self.init_lines.append(f"self.{key} = self.{okey}  # shared with {one_line(owner)} (Caffe param name)")

    # -- the file ---------------------------------------------------------------------------
    def source(self, params):
        graph = self.graph
        helper_names = {n for k in self.helpers for n in k.split(",")} | {"WEIGHTS", "load", "os"}
        cls = self.cls_name or class_name(graph.name, taken=helper_names)
        if cls in helper_names:
            cls = class_name(cls + "Net", taken=helper_names)
        self.cls_name = cls
        out = []
        out.append(f'"""{doc_safe(self._module_doc(cls))}"""')
        body = []
        body.append(f"WEIGHTS = {lit(self.weights_file)}")
        for src in self.helpers.values():
            body.append("")
            body.append("")
            body.append(src)
        body.append("")
        body.append("")
        body.append(f"class {cls}(nn.Module):")
        body.append(textwrap.indent(f'"""{doc_safe(self._class_doc())}"""', "    "))
        body.append("")
        body.append("    def __init__(self):")
        body.append("        super().__init__()")
        for line in self.init_lines:
            body.append("        " + line)
        body.append("")
        body.append(f"    def forward(self, {', '.join(params)}):")
        for line in self.forward_lines:
            body.append("        " + line)
        outs = self.graph_outputs
        if len(outs) == 1:
            body.append(f"        return {self.var_of[outs[0]]}")
        else:
            items = ", ".join(f"{lit(graph.tensors[t].blob)}: {self.var_of[t]}" for t in outs)
            body.append(f"        return {{{items}}}")
        body.append("")
        body.append("")
        body.extend(self._loader(cls).splitlines())
        text = "\n".join(body)
        code = re.sub(r'"""[\s\S]*?"""', "", text)
        if re.search(r"\bmath\.", code):   # helpers copied from caffeq may use the math module
            out.append("import math")
        out.append("import os")
        out.append("")
        if re.search(r"\btorch\.", code) or self.weights_format == "pt":
            out.append("import torch")
        if "F" in self.imports or re.search(r"\bF\.", text):
            out.append("import torch.nn.functional as F")
        out.append("from torch import nn")
        out.append("")
        return "\n".join(out) + "\n" + text + "\n"

    def _loader(self, cls):
        path = "    path = weights or os.path.join(os.path.dirname(os.path.abspath(__file__)), WEIGHTS)"
        if self.weights_format == "safetensors":
            read = ["    from safetensors.torch import load_file  # needed only to read the weights", "",
                    path, "    state = load_file(path)"]
        else:
            read = [path, '    state = torch.load(path, map_location="cpu", weights_only=True)']
        return "\n".join([
            'def load(weights=None, device="cpu"):',
            f'    """{cls} in eval mode with the converted weights (default: WEIGHTS beside this file)."""',
            *read,
            f"    model = {cls}()",
            "    # tensors stored as float16 hold exact fp16 values; the model computes in float32",
            "    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})",
            "    return model.to(device).eval()"])

    def _module_doc(self, cls):
        name = self.graph.name or "net"
        lines = [f"{name}: a plain PyTorch port of a Caffe model ({EXPORT_MARK}).", ""]
        if self.source_note:
            lines.append(self.source_note)
        lines += ["Needs only torch (and safetensors to read the weights):" if self.weights_format ==
                  "safetensors" else "Needs only torch:", "",
                  "    from model import load", f"    net = load()  # {cls}, eval mode, weights from WEIGHTS",
                  "    out = net(x)"]
        return "\n".join(lines) + "\n"

    def _class_doc(self):
        g = self.graph
        lines = [f"Caffe net {g.name!r}, layer by layer (attributes named after the Caffe layers).", ""]
        lines.append("Inputs (float32, N = batch size):")
        for t in self.graph_inputs:
            s = g.tensors[t].shape
            shape = "(" + ", ".join(["N"] + [str(d) for d in s[1:]]) + ")" if s else "()"
            batch = f"; the prototxt declares N = {s[0]}" if s else ""
            lines.append(f"    {self.var_of[t]}: {shape}{batch}")
        lines.append("")
        lines.append("Preprocessing:")
        lines += ["    " + p for p in self._preprocessing()]
        lines.append("")
        lines.append("Outputs" + (" (a dict by Caffe blob name)" if len(self.graph_outputs) > 1 else "") +
                     ", shapes at the prototxt's batch size:")
        for t in self.graph_outputs:
            lines.append(f"    {g.tensors[t].blob}: {tuple(g.tensors[t].shape)}")
        if self.dropped:
            lines.append("")
            lines.append("Training-only layers left out: " +
                         ", ".join(f"{n.name} ({n.type})" for n in self.dropped) + ".")
        if self.notes:
            lines.append("")
            lines.append("Notes:")
            for note in self.notes:
                wrapped = textwrap.wrap(note, 92)
                lines.append("    - " + wrapped[0])
                lines += ["      " + w for w in wrapped[1:]]
        return "\n".join(lines) + "\n"

    def _preprocessing(self):
        data = [n for n in self.graph.nodes if n.spec.is_data and any(t in self.graph_inputs for t in n.outputs)]
        lines = []
        for n in data:
            desc = n.spec.preprocessing(n.attrs)
            tops = ", ".join(self.var_of[t] for t in n.outputs if t in self.graph_inputs)
            if desc:
                lines.append(f"{tops} (layer {n.name!r}, {n.type}): what Caffe does before the net:")
                lines += ["  " + d for d in desc]
            else:
                lines.append(f"{tops} (layer {n.name!r}, {n.type}): none declared in the prototxt; feed "
                             f"what the Caffe net was fed")
        return lines or ["none declared in the prototxt"]


def _strip(node, err):
    msg = str(err)
    for prefix in (f"layer '{node.name}' ({node.type})", f"layer '{node.name}'"):
        if msg.startswith(prefix):
            msg = msg[len(prefix):].lstrip(" :")
    return msg


# ---- public entry points --------------------------------------------------------------------

def generate_source(model, exact_batchnorm=False, weights_file="weights.safetensors",
                    weights_format="safetensors", cls_name=None, source_note=""):
    """(source text, state {key: numpy array}, info) for `model`; raises ExportError first."""
    missing = [n.name for n in model.graph.nodes if n.has_params and n.blobs is None]
    if missing:
        raise ExportError(f"{model.prototxt or model.name}: no weights for layer(s) "
                          f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}; pass the caffemodel")
    gen = _Generator(model, exact_batchnorm, weights_file, weights_format, cls_name, source_note)
    params = gen.generate()
    quant = model.quantization
    if quant:
        schemes = sorted(set(quant.values()))
        gen.notes.insert(0, _quant_note(schemes, quant))
    text = gen.source(params)
    info = {"class_name": gen.cls_name, "inputs": params,
            "outputs": [gen.graph.tensors[t].blob for t in gen.graph_outputs],
            "dropped": [n.name for n in gen.dropped], "notes": list(gen.notes),
            "layers": len(gen.kept)}
    return text, gen.state, info


def _quant_note(schemes, quant):
    names = ", ".join(sorted(quant))
    if schemes == ["binary"]:
        return (f"Binary weights (caffeq quantize 'binary'): layers {names} hold alpha * sign(W) "
                f"(alpha = mean |W| per output channel, sign(0) = +1), stored dequantized as float32. "
                f"Fine-tuning updates them as ordinary floats; to keep them binary, re-binarize after "
                f"each step (straight-through estimator).")
    if schemes == ["fp16"]:
        return ("fp16 weights (caffeq quantize 'fp16'): every float blob was rounded to float16 "
                "(BatchNorm folded first where possible); they are stored as float16 and cast to "
                "float32 when loaded, so the model computes in float32.")
    return (f"Quantized weights ({', '.join(schemes)}) in layers {names}: stored dequantized as float32.")


def _check_module(text, state, cls_name, path):
    """Compile the source and build the class on the meta device: keys and shapes must match."""
    import torch
    code = compile(text, path, "exec")
    ns = {"__name__": "caffeq_generated_model", "__file__": path}
    exec(code, ns)  # noqa: S102 (our own generated source, checked before anything is written)
    with torch.device("meta"):
        module = ns[cls_name]()
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    if want != have:
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        raise ExportError(f"internal: generated module and weights disagree: missing {missing[:5]}, "
                          f"unexpected {extra[:5]}, shapes {[(k, want[k], have[k]) for k in wrong[:5]]}")


def _storage(state, fp16):
    """Arrays as written: float16 where `fp16` and the value survives the round trip exactly."""
    out = {}
    for k, v in state.items():
        a = np.asarray(v, order="C")
        if a.dtype.kind == "f":
            a = a.astype(np.float32, copy=False)
            if fp16:
                h = a.astype(np.float16)
                if np.array_equal(h.astype(np.float32), a, equal_nan=True):
                    a = h
        out[k] = a
    return out


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export_pytorch(model, out, to=None, exact_batchnorm=False, weights_format="safetensors",
                   class_name=None, readme=True, inputs=(), keep=None, only=None):
    """Write `model` (a caffeq.Model) as a standalone PyTorch model.py + weights (+ README.md).

    out: a folder (created if missing; gets model.py, weights.safetensors, README.md)
         or a path ending in .py (weights beside it as <stem>.safetensors, no README).
    to:  None, "fp16" (weights stored as float16, cast to float32 when loaded), "binary" or
         "int8" (dequantized weights, float32) through caffeq.quantize(model, to, keep, only).
         A model quantized already (to=None) is written as it is.
    exact_batchnorm: BatchNorm keeps Caffe's op order (bit-identical to caffeq) instead of
         plain nn.BatchNorm2d (equal within float32 rounding).
    weights_format: "safetensors" or "pt" (a state_dict for torch.load(weights_only=True)).

    Raises ExportError (nothing written) listing every unsupported layer.
    Returns {"model_py", "weights", "readme", "class_name", "inputs", "outputs", "notes", ...}.
    """
    if weights_format not in WEIGHT_FORMATS:
        raise ExportError(f"weights format must be one of {', '.join(WEIGHT_FORMATS)}, got {weights_format!r}")
    out = os.fspath(out)
    source_model = model
    if to is not None:
        if get_quantizer(to).name != "fp32":
            model = quantize(model, to, keep=keep, only=only)
    schemes = sorted(set((model.quantization).values()))
    target = "+".join(schemes) if schemes else None
    ext = ".safetensors" if weights_format == "safetensors" else ".pt"
    is_file = out.endswith(".py")
    if is_file:
        folder = os.path.dirname(os.path.abspath(out))
        py_path = os.path.abspath(out)
        weights_path = os.path.join(folder, os.path.splitext(os.path.basename(out))[0] + ext)
        readme_path = None
        if os.path.isdir(py_path):
            raise ExportError(f"{out}: is a folder")
    else:
        folder = os.path.abspath(out)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ExportError(f"{out}: exists and is not a folder (name a .py file or a folder)")
        py_path = os.path.join(folder, "model.py")
        weights_path = os.path.join(folder, "weights" + ext)
        readme_path = os.path.join(folder, "README.md") if readme else None
    protected = [source_model.prototxt, source_model.weights_path] + [os.fspath(p) for p in inputs if p]
    for dst in (py_path, weights_path, readme_path):
        refuse_overwrite(dst, protected, ExportError)
    if not is_file:
        # a folder is ours to fill only where it is new or holds an earlier export: never replace
        # a user's own model.py, README.md or weights
        for dst in (py_path, weights_path, readme_path):
            if dst and os.path.exists(dst) and not _written_by_caffeq(dst, py_path):
                raise ExportError(f"{dst}: exists and was not written by caffeq; export into a new or empty "
                                  f"folder (nothing written)")
    if is_file and not os.path.isdir(folder):
        raise ExportError(f"{out}: folder {folder} does not exist")

    src_note = _source_note(source_model, target)
    text, state, info = generate_source(model, exact_batchnorm=exact_batchnorm,
                                        weights_file=os.path.basename(weights_path),
                                        weights_format=weights_format, cls_name=class_name,
                                        source_note=src_note)
    _check_module(text, state, info["class_name"], py_path)
    arrays = _storage(state, fp16=(target == "fp16"))

    # everything is known to work: write (each file atomically; the folder only now)
    os.makedirs(folder, exist_ok=True)
    with atomic_path(weights_path) as tmp:
        if weights_format == "safetensors":
            from safetensors.numpy import save_file
            save_file(arrays, tmp, metadata={"format": "pt", "source": "caffeq",
                                             "class": info["class_name"]})
        else:
            import torch
            torch.save({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}, tmp)
    with atomic_path(py_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    if readme_path:
        with atomic_path(readme_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(_readme(source_model, info, os.path.basename(weights_path), target, src_note))
    n_params = int(sum(a.size for k, a in arrays.items() if not k.endswith("num_batches_tracked")))
    info.update({"model_py": py_path, "weights": weights_path, "readme": readme_path,
                 "target": target or "fp32", "tensors": len(arrays), "parameters": n_params,
                 "weights_bytes": os.path.getsize(weights_path)})
    return info


EXPORT_MARK = "written by caffeq"     # in model.py's docstring and README.md


def _written_by_caffeq(path, py_path):
    """Whether `path` is a file of an earlier export: model.py and README.md carry EXPORT_MARK near
    their top, safetensors weights say so in their metadata, .pt weights count with their model.py."""
    if path.endswith((".py", ".md")):
        with open(path, "rb") as f:
            return EXPORT_MARK.encode() in f.read(8192)
    if path.endswith(".safetensors"):
        import json
        import struct
        with open(path, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if not 0 < size <= 1 << 24:      # a header, not a whole file, is read
                return False
            try:
                header = json.loads(f.read(size))
            except ValueError:
                return False
        return isinstance(header, dict) and (header.get("__metadata__") or {}).get("source") == "caffeq"
    return os.path.exists(py_path) and _written_by_caffeq(py_path, py_path)


def _source_note(model, target):
    parts = []
    if model.prototxt:
        parts.append(f"Converted from {os.path.basename(model.prototxt)}")
    if model.weights_path:
        parts.append(f"weights {os.path.basename(model.weights_path)}")
    text = ", ".join(parts) if parts else "Converted from a Caffe model"
    if target and target != "fp32":
        text += f"; weights quantized to {target}"
    return text + "."


def _readme(model, info, weights_name, target, src_note):
    cls = info["class_name"]
    lines = [f"# {cls}: PyTorch port of a Caffe model", "", src_note, ""]
    if model.prototxt and os.path.exists(model.prototxt):
        lines.append(f"- prototxt: `{os.path.basename(model.prototxt)}` "
                     f"(sha256 `{_sha256(model.prototxt)[:16]}...`)")
    if model.weights_path and os.path.exists(model.weights_path):
        lines.append(f"- caffemodel: `{os.path.basename(model.weights_path)}` "
                     f"({os.path.getsize(model.weights_path)} bytes)")
    lines.append(f"- {EXPORT_MARK}; `model.py` needs only PyTorch"
                 f"{' (and safetensors to read the weights)' if weights_name.endswith('.safetensors') else ''}")
    if target and target != "fp32":
        lines.append(f"- weights quantized to **{target}**; see the notes in `model.py`'s class docstring")
    lines += ["", "## Load", "", "```python", "import sys", "sys.path.insert(0, \"path/to/this/folder\")",
              "from model import load", "", f"net = load()  # {cls} in eval mode, weights from {weights_name}",
              "out = net(x)  # inputs: " + ", ".join(info["inputs"]), "```", "",
              (f"Inputs, the preprocessing the prototxt declares, and outputs "
               f"({', '.join(info['outputs'])}) are listed in the docstring of `{cls}`. Layers keep "
               f"their Caffe names and order, so `net.conv1` is Caffe's `conv1`. `net.train()` gives "
               f"Caffe's training behaviour (BatchNorm batch statistics, Dropout)."), ""]
    return "\n".join(lines)


__all__ = ["Emitter", "export_pytorch", "generate_source", "identifier", "lit", "size_arg"]
