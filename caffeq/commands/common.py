"""What the commands share besides their options (see options.py): finding the weights, loading
the model, checking and writing output files, JSON, sizes and paths in messages.

Output rules, the same in every command:
- every output path is checked before any work: an existing folder, an input file or a parent
  that is a file is refused with one error line;
- missing folders on the way to an output are created (and removed again when the command fails);
- files are written to a temporary name and renamed at the end, so a failure leaves nothing.
"""
import glob
import json
import os
import sys

from ..errors import CaffeqError, ParseError, PhaseRuleError, WeightsError
from ..fs import atomic_output, atomic_path, format_bytes, format_count, refuse_overwrite  # noqa: F401  (commands use them)
from .options import add_model_args  # noqa: F401  (commands import it from here too)

# ---- weights beside the prototxt -------------------------------------------------------------


class AmbiguousWeights(CaffeqError):
    """Several .caffemodel files beside a prototxt and none of its name: which one is meant?"""


def find_weights(prototxt):
    """The .caffemodel beside `prototxt`: same stem, else the only one in the folder; None if none."""
    folder = os.path.dirname(os.path.abspath(prototxt))
    stem = os.path.splitext(os.path.basename(prototxt))[0]
    same = os.path.join(folder, stem + ".caffemodel")
    if os.path.isfile(same):
        return same
    found = sorted(f for f in glob.glob(os.path.join(glob.escape(folder), "*.caffemodel")) if os.path.isfile(f))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        names = ", ".join(os.path.basename(f) for f in found[:5]) + (", ..." if len(found) > 5 else "")
        raise AmbiguousWeights(f"{prototxt}: no --weights given and {len(found)} .caffemodel files beside it "
                               f"({names}); pass --weights FILE.caffemodel")
    return None


def resolve_weights(model_path, weights=None, required=True):
    """-> (weights path or None, a line saying which file was found, or None).

    A .caffeq file holds its weights. Otherwise --weights, else the .caffemodel beside the
    prototxt (find_weights). required=False (inspect): no weights is fine, shapes still print.
    """
    if not os.path.exists(model_path):
        raise CaffeqError(f"{model_path}: no such file")
    if os.path.isdir(model_path):
        raise CaffeqError(f"{model_path}: is a folder; pass the .prototxt")
    if model_path.lower().endswith(".caffemodel"):
        raise CaffeqError(f"{model_path}: a .caffemodel holds the weights, not the net; pass the .prototxt "
                          f"(and this file as --weights)")
    if model_path.endswith(".caffeq"):
        if weights:
            raise CaffeqError(f"{model_path}: a .caffeq file holds its weights; drop --weights")
        return None, None
    if weights is not None:
        if not os.path.isfile(weights):
            raise CaffeqError(f"{weights}: no such file" if not os.path.isdir(weights)
                              else f"--weights {weights}: is a folder; pass the .caffemodel")
        return weights, None
    try:
        found = find_weights(model_path)
    except AmbiguousWeights as e:
        if required:
            raise
        return None, f"note: {str(e).split('; pass')[0]}: listed without weights (--weights to choose one)"
    if found is None:
        if required:
            raise CaffeqError(f"{model_path}: no .caffemodel beside it (same name, or the only one in its "
                              f"folder); pass --weights FILE.caffemodel")
        return None, None
    return found, (f"weights: {display_path(found)} (found beside {os.path.basename(model_path)}; "
                   f"--weights to choose another)")


def say_found(note):
    if note:
        print(note, file=sys.stderr)


def input_shapes_arg(args):
    """{name: shape} from the repeatable --input-shape option."""
    return dict(getattr(args, "input_shape", None) or [])


def defines_arg(args):
    """{NAME: value} from the repeatable --define option."""
    return dict(getattr(args, "define", None) or [])


def load_model(args, random_weights=False, weights_required=False, unknown_shapes_ok=False):
    """Load args.model with the shared options (add_model_args); warnings printed once, on stderr.

    unknown_shapes_ok: for listing (inspect): data shapes that only a missing dataset could tell
    stay unknown, and a file whose net is whole only under another phase/stage is read so."""
    from ..model import load
    weights, note = resolve_weights(args.model, getattr(args, "weights", None),
                                    required=weights_required and not random_weights)
    args.weights = weights
    batch, shapes = getattr(args, "batch", None), input_shapes_arg(args)
    clash = {name: shape for name, shape in shapes.items() if batch is not None and shape[0] != batch}
    if clash:
        name, shape = next(iter(clash.items()))
        raise CaffeqError(f"--batch {batch} and --input-shape {name}={','.join(map(str, shape))} disagree on "
                          f"the batch; give one of them")

    def load_with(w):
        return load(args.model, w, phase=args.phase, batch=getattr(args, "batch", None),
                    ignore_unknown=args.ignore_unknown, random_weights=random_weights,
                    stages=tuple(getattr(args, "stage", ())), level=getattr(args, "level", 0),
                    input_shapes=input_shapes_arg(args), outputs=getattr(args, "outputs", None),
                    unknown_shapes_ok=unknown_shapes_ok, defines=defines_arg(args))
    try:
        for _ in range(_RULES_TO_ADOPT):
            try:
                model = load_with(weights)
                break
            except PhaseRuleError as e:
                if not unknown_shapes_ok or e.rule is None or not _adopt_rule(args, e.rule):
                    raise
                # a train.prototxt (data only at TRAIN) or a net whole only under a stage (LRCN's
                # "unfactored", then its data's "test-on-train"): list that one
                print(f"caffeq: note: {e}; showing the net as --phase {args.phase}"
                      + "".join(f" --stage {st}" for st in args.stage), file=sys.stderr)
        else:
            model = load_with(weights)
    except WeightsError as e:
        if not note or weights_required:
            raise
        # weights found, not given, and not needed (inspect): another net's caffemodel in the folder
        print(f"caffeq: warning: {e}; showing the net without weights", file=sys.stderr)
        args.weights = note = None
        model = load_with(None)
    check_not_empty(model, args.model)
    say_found(note)        # only once the net has read: an error stays the one line on stderr
    for w in model.warnings:
        print(f"caffeq: warning: {w}", file=sys.stderr)
    return model


_RULES_TO_ADOPT = 4   # phase/stage rules a listing follows before it gives the error


def _adopt_rule(args, rule):
    """Set args' phase and stages to those a NetStateRule asks for; False when nothing changes."""
    from ..io.schema import caffe_pb2
    phase = caffe_pb2.Phase.Name(rule.phase) if rule.HasField("phase") else args.phase
    stages = list(dict.fromkeys(list(args.stage) + list(rule.stage)))
    if phase == args.phase and stages == list(args.stage):
        return False
    args.phase, args.stage = phase, stages
    return True


def check_not_empty(model, path):
    if model.graph.nodes:
        return
    layers = list(model.net.layer) if model.net is not None else []
    if not layers:
        raise ParseError(f"{path}: the net has no layers (an empty or commented-out prototxt?)")
    from ..ir import filter_layers
    layers = filter_layers(model.net, model.phase, model.stages, model.level)
    if not layers:
        raise ParseError(f"{path}: no layer of the net is in its {model.phase} phase (their include/exclude "
                         f"rules); choose another with --phase/--stage")
    # every layer was dropped as training-only (losses and what feeds only them): say which, and the first
    # bottom no layer makes, the usual sign of a fragment meant to be appended to another net
    made, missing = set(model.net.input), None
    for lp in layers:
        missing = missing or next(((lp.name, b) for b in lp.bottom if b not in made), None)
        made.update(lp.top)
    names = ", ".join(f"'{lp.name}'" for lp in layers[:4]) + (f" (+{len(layers) - 4} more)" if len(layers) > 4 else "")
    hint = ""
    if missing:
        # the blob may be made in the other phase only (a TRAIN-only data layer): then that phase is the net
        other = "TRAIN" if model.phase == "TEST" else "TEST"
        maker = next((lp.name for lp in filter_layers(model.net, other, model.stages, model.level)
                      if missing[1] in lp.top), None)
        hint = (f"; layer '{missing[0]}' reads '{missing[1]}', which only layer '{maker}' makes, at {other}: "
                f"read the net with --phase {other}" if maker else
                f"; layer '{missing[0]}' reads '{missing[1]}', which no layer makes (a fragment of a larger net?)")
    raise ParseError(f"{path}: nothing is left to run at {model.phase}: every layer ({names}) only trains "
                     f"(losses and the layers that feed only them){hint}")


# ---- output paths -------------------------------------------------------------------------------

def check_output(path, flag="-o", inputs=(), exts=None):
    """Refuse an output path before any work: a folder, an input file, a parent that is a file.

    inputs: files this output must not replace; exts: allowed extensions (lower case, with dot).
    Missing folders are fine: they are created when the file is written.
    """
    if path in (None, "-"):
        return path
    path = os.fspath(path)
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise CaffeqError(f"{flag} {path}: is a folder; name a file")
    if exts is not None:
        ext = os.path.splitext(path)[1].lower()
        if ext not in exts:
            raise CaffeqError(f"{flag} {path}: unknown output format {ext or '(no extension)'}; "
                              f"use {' or '.join(exts)}")
    refuse_overwrite(path, inputs)
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CaffeqError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise CaffeqError(f"{flag} {path}: cannot write in {parent}")
    return path


def write_json(path, obj):
    """JSON to stdout (path None or '-') or atomically to a file, then `wrote FILE` on stdout (where
    the text report is then), as every command says what it wrote."""
    if path in (None, "-"):
        json.dump(obj, sys.stdout, indent=1)
        sys.stdout.write("\n")
        sys.stdout.flush()
        return
    with atomic_output(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    print(f"wrote {display_path(path)}")


# ---- model outputs and messages shared by convert and finetune ---------------------------

MODEL_FORMATS = (".onnx", ".caffemodel", ".caffeq")


def display_path(path):
    """`path` relative to the current folder when it lies below it (shorter messages), else as given."""
    try:
        r = os.path.relpath(path)
        return r if not r.startswith("..") else path
    except ValueError:   # another drive (Windows)
        return path


def keep_needs_a_target(flag, why):
    """The one error for --keep/--only where nothing is quantized (run, convert, eval): `why` says
    why nothing is, in the command's terms."""
    what = "the layers kept fp32" if flag == "--keep" else "the layers to quantize"
    raise CaffeqError(f"{flag} chooses {what} when quantizing, and {why}; add a quantized target "
                      f"(--to fp16, int8 or binary) or drop {flag}")


def layer_names_arg(value, flag, verb="quantize"):
    """A --keep/--only value -> None (not given), "none" or a list of layer names.

    verb: what the command does to the layers --only names (for the error message).
    """
    if value is None:
        return None
    if value.strip().lower() == "none":
        if flag == "--only":
            raise CaffeqError(f"--only none would {verb} nothing; name layers or drop --only")
        return "none"
    names = [v.strip() for v in value.split(",")]
    if any(not v for v in names):
        raise CaffeqError(f"{flag}: empty layer name in {value!r}")
    return names


def model_output_format(out, protected):
    """The format (extension) of the model file `-o out`, checked before any work (check_output);
    a .caffemodel's prototxt, written beside it, must not replace an input either."""
    check_output(out, "-o", protected, MODEL_FORMATS)
    ext = os.path.splitext(out)[1].lower()
    if ext == ".caffemodel":
        proto = os.path.splitext(out)[0] + ".prototxt"
        refuse_overwrite(proto, protected, message=f"the prototxt written beside {out} would overwrite an "
                                                   f"input file; choose another -o name")
    return ext


def write_model_file(model, out, protected, **onnx_options):
    """Write `model` in the format of out's extension -> (files written, ONNX export stats or None).

    protected: input files none of the outputs may replace; onnx_options go to export_onnx.
    """
    ext = os.path.splitext(out)[1].lower()
    written = [out]
    onnx_stats = None
    if ext == ".onnx":
        from ..backends.onnx_backend import export_onnx
        onnx_stats = export_onnx(model, out, inputs=protected, **onnx_options)
        if onnx_stats.get("data_file"):
            written.append(onnx_stats["data_file"])
    elif ext == ".caffemodel":
        written.append(_write_caffemodel(model, out, protected))
    else:
        _write_caffeq(model, out, protected)
    return written, onnx_stats


def _write_caffemodel(model, out, protected):
    """out (.caffemodel) and the prototxt beside it (same stem) -> the prototxt's path."""
    from ..io.writer import net_to_text, rebase_data_paths, write_model_caffemodel
    proto = os.path.splitext(out)[0] + ".prototxt"
    refuse_overwrite(proto, protected, message=f"the prototxt written beside {out} would overwrite an input "
                                               f"file; choose another -o name")
    # data sources and mean files relative to the new prototxt's folder, so that it reads from there
    net = rebase_data_paths(model.net, _model_dir(model), os.path.dirname(os.path.abspath(proto)))
    text = net_to_text(net)
    # both files appear together or not at all
    with atomic_path(out, inputs=protected) as tmp_model, atomic_path(proto, inputs=protected) as tmp_proto:
        write_model_caffemodel(model, tmp_model)
        with open(tmp_proto, "w") as f:
            f.write(text)
    return proto


def _model_dir(model):
    """The folder the model's relative data paths are resolved from (its prototxt's)."""
    from ..io.container import _model_data_dir
    return _model_data_dir(model)


def _write_caffeq(model, out, protected):
    from ..io.container import save_caffeq
    with atomic_path(out, inputs=protected) as tmp:
        save_caffeq(model, tmp)
