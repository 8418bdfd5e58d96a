"""Argument helpers shared by subcommands."""
import json
import os
import sys
from ..errors import CaffeqError
from ..fs import atomic_output, atomic_path, refuse_overwrite


def add_model_args(p, weights=True):
    p.add_argument("model", help="deploy/train_val .prototxt (or a .caffeq file)")
    if weights:
        p.add_argument("--weights", "-w", help=".caffemodel with the trained weights")
    p.add_argument("--phase", default="TEST", choices=["TEST", "TRAIN"], help="phase rules to apply")
    p.add_argument("--stage", action="append", default=[], metavar="NAME",
                   help="a NetState stage for include/exclude rules (repeatable)")
    p.add_argument("--level", type=int, default=0, help="the NetState level for min/max_level rules")
    p.add_argument("--batch", type=int, default=None, help="override the batch dimension of the inputs")
    p.add_argument("--ignore-unknown", action="store_true",
                   help="skip fields unknown to caffe.proto (with a warning) instead of failing")


def load_model(args, random_weights=False):
    from ..model import load
    if args.batch is not None and args.batch < 1:
        raise CaffeqError(f"--batch must be >= 1, got {args.batch}")
    model = load(args.model, getattr(args, "weights", None), phase=args.phase, batch=args.batch,
                 ignore_unknown=args.ignore_unknown, random_weights=random_weights,
                 stages=tuple(getattr(args, "stage", ())), level=getattr(args, "level", 0))
    for w in model.warnings:
        print(f"caffeq: warning: {w}", file=sys.stderr)
    return model


def write_json(path, obj):
    if path in (None, "-"):
        json.dump(obj, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    with atomic_output(path, "w") as f:
        json.dump(obj, f, indent=1)


# ---- model outputs and messages shared by convert and finetune ---------------------------

MODEL_FORMATS = (".onnx", ".caffemodel", ".caffeq")


def display_path(path):
    """`path` relative to the current folder when it lies below it (shorter messages), else as given."""
    try:
        r = os.path.relpath(path)
        return r if not r.startswith("..") else path
    except ValueError:   # another drive (Windows)
        return path


def format_bytes(n):
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


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
    """The format (extension) of the model file `-o out`; refuses unknown formats, folders and inputs."""
    ext = os.path.splitext(out)[1].lower()
    if ext not in MODEL_FORMATS:
        raise CaffeqError(f"-o {out}: unknown output format {ext or '(no extension)'}; "
                          f"use one of {', '.join(MODEL_FORMATS)}")
    if os.path.isdir(out):
        raise CaffeqError(f"-o {out}: is a folder")
    refuse_overwrite(out, protected)
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
    from ..io.writer import net_to_text, write_model_caffemodel
    proto = os.path.splitext(out)[0] + ".prototxt"
    refuse_overwrite(proto, protected, message=f"the prototxt written beside {out} would overwrite an input "
                                               f"file; choose another -o name")
    text = net_to_text(model.net)
    # both files appear together or not at all
    with atomic_path(out, inputs=protected) as tmp_model, atomic_path(proto, inputs=protected) as tmp_proto:
        write_model_caffemodel(model, tmp_model)
        with open(tmp_proto, "w") as f:
            f.write(text)
    return proto


def _write_caffeq(model, out, protected):
    from ..io.container import save_caffeq
    with atomic_path(out, inputs=protected) as tmp:
        save_caffeq(model, tmp)
