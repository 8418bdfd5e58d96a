"""The command line's shared options: one parser class and one definition per option.

Every command builds its options from the helpers below, so that an option means the same
thing, takes the same values and has the same default in every command:

- `CliParser` turns every argparse error into one `caffeq: error:` line (exit status 2), with a
  "did you mean" for a mistyped command, option or choice; options are never abbreviated
  (allow_abbrev=False: `--output` must not quietly mean `--outputs`);
- argument types (`positive_int`, `nonnegative_int`, `number`, `device`, `workers`) refuse bad
  values at parse time, before any work;
- `add_model_args`, `add_json_arg`, `add_device_arg`, `add_workers_arg`, `add_progress_arg`,
  `add_batch_size_arg` declare the options that several commands share.
"""
import argparse
import difflib
import os
import re
import sys

from ..errors import CaffeqError, DataError


class UsageError(CaffeqError):
    """A bad command line: unknown command or option, a missing or malformed value."""


def did_you_mean(word, choices):
    """'; did you mean X?' for the closest of `choices` to `word` (letter case aside), else ''."""
    choices = [str(c) for c in choices]
    by_lower = {c.lower(): c for c in reversed(choices)}
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]}?" if close else ""


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (raised as UsageError, printed by main)."""

    def __init__(self, *args, **kwargs):
        import inspect
        if "suggest_on_error" in inspect.signature(argparse.ArgumentParser.__init__).parameters:
            kwargs.setdefault("suggest_on_error", True)   # Python 3.14+: argparse's own suggestions
        # no abbreviations: an option is spelled out, so that one name never stands for another
        # (`eval --output` for `--outputs`, the score blob, where elsewhere it is the output file)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.siblings = {}    # the other commands' parsers, by name (build_parser fills it in)

    def error(self, message):
        message = " ".join(str(message).split())
        if "did you mean" not in message.lower() and "maybe you meant" not in message.lower():
            message += self._suggestion(message)
        where = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        raise UsageError(f"{where}{message} (see `{self.prog} --help`)")

    def _suggestion(self, message):
        m = _INVALID_CHOICE.search(message)
        if m:
            # ('a', 'b') or, in newer Pythons, (a, b)
            choices = [c.strip().strip("'\"") for c in m.group(2).split(",")]
            return did_you_mean(m.group(1), choices)
        if message.startswith("unrecognized arguments:"):
            options = [o for o, a in self._option_string_actions.items()
                       if o.startswith("--") and a.help != argparse.SUPPRESS]   # hidden ones only refuse
            for word in message.split(":", 1)[1].split():
                if word.startswith("--"):
                    hint = self._elsewhere(word.split("=", 1)[0]) or did_you_mean(word.split("=", 1)[0], options)
                    if hint:
                        return hint
        return ""

    def _elsewhere(self, option):
        """'; OPTION is an option of A, B, not of C' when other commands take it as spelled
        (a suggestion of this command's nearest option would change its meaning)."""
        owners = [name for name, p in self.siblings.items() if p is not self and option in p._option_string_actions]
        if not owners:
            return ""
        command = self.prog.split(" ", 1)[1] if " " in self.prog else self.prog
        return f"; {option} is an option of {', '.join(owners)}, not of {command}"


# ---- argument types (argparse calls them; ArgumentTypeError becomes one error line) ----------

def _integer(text):
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def number(text):
    """A finite float."""
    import math
    try:
        v = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return v


def _bounded(parse, low, strict, requirement, doc):
    """An argument type: parse(text), refused below `low` (or at it, when strict)."""
    def check(text):
        v = parse(text)
        if v < low or (strict and v == low):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return v
    check.__doc__ = doc
    return check


positive_int = _bounded(_integer, 1, False, "a positive integer",
                        "An integer >= 1 (counts: batch sizes, epochs, limits).")
nonnegative_int = _bounded(_integer, 0, False, "0 or more", "An integer >= 0.")
nonnegative_number = _bounded(number, 0, False, ">= 0", "A finite float >= 0.")
positive_number = _bounded(number, 0, True, "> 0", "A finite float > 0.")


def score_blob(text):
    """BLOB: the one blob whose values are the class scores (eval)."""
    name = str(text).strip()
    if not name or "," in name:
        raise argparse.ArgumentTypeError(f"expected one blob name (the class scores), got {text!r}")
    return name


def targets(text):
    """T1,T2,... -> [precision names] (fp32, fp16, int8, binary, their aliases, registered quantizers),
    with a did-you-mean for a typo."""
    from ..quant import available_targets, get_quantizer
    from ..quant.base import QuantizeError
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(available_targets())}")
    for t in names:
        try:
            get_quantizer(t)
        except QuantizeError:
            raise argparse.ArgumentTypeError(f"unknown target {t!r} (choose from {', '.join(available_targets())})"
                                             f"{did_you_mean(t.lower(), available_targets())}") from None
    return names


DEVICES = ("auto", "cpu", "cuda", "cuda:N")


def device(text):
    """cpu, cuda, cuda:N or auto (CUDA when available); CUDA asked for and absent is an error here."""
    value = str(text).strip().lower()
    m = re.fullmatch(r"cuda(?::(\d+))?", value)
    if value not in ("auto", "cpu") and not m:
        hint = "; did you mean cuda?" if value in ("gpu", "nvidia") or value.startswith("gpu:") else \
            did_you_mean(value, ("auto", "cpu", "cuda"))
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, cuda, cuda:N or auto{hint}")
    if m:
        import torch
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{value}: no CUDA device is available here "
                                             f"(use --device cpu, or auto to take CUDA when there is one)")
        if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{value}: this machine has {torch.cuda.device_count()} CUDA "
                                             f"device(s), numbered from 0")
    return value


def default_workers():
    """Data loading processes when --workers is not given: up to 4, leaving one CPU to the model."""
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def workers(text):
    """--workers: auto (the default, see default_workers) or a count >= 0."""
    if str(text).strip().lower() == "auto":
        return default_workers()
    try:
        return nonnegative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or a count of 0 or more, got {text!r}"
                                         f"{did_you_mean(str(text).strip(), ['auto'])}") from None


# ---- options shared by several commands --------------------------------------------------

def input_shape(text):
    """NAME=N,C,H,W (also NAME=NxCxHxW): the shape of one input or data-layer top."""
    name, sep, dims = text.partition("=")
    if not name.strip() or not sep or not dims.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=N,C,H,W, got {text!r}")
    separator = "," if "," in dims else "x"
    parts = [d.strip() for d in dims.split(separator)]
    try:
        shape = tuple(int(d) for d in parts)
    except ValueError:
        bad = next(d for d in parts if not d.lstrip("-").isdigit())
        raise argparse.ArgumentTypeError(f"{text!r}: dimension {bad!r} is not an integer "
                                         f"(expected NAME=N,C,H,W)") from None
    if any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"dimensions must be positive, got {text!r}")
    return name.strip(), shape


def definition(text):
    """NAME=VALUE: the value of a template placeholder ($NAME or ${NAME}) of the prototxt."""
    name, sep, value = text.partition("=")
    name, value = name.strip().removeprefix("${").removesuffix("}").removeprefix("$"), value.strip()
    if not sep or not name.isidentifier() or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a template placeholder's value), got {text!r}")
    return name, value


def blob_names(text):
    """NAME,NAME,...: Caffe blob names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected blob names separated by commas")
    return names


def add_weights_arg(p, what="trained weights"):
    p.add_argument("--weights", "-w", metavar="W.caffemodel",
                   help=f"{what} (default: the .caffemodel beside the prototxt with the same name, or the "
                        f"only one in its folder)")


def add_define_arg(p):
    p.add_argument("--define", type=definition, action="append", default=[], metavar="NAME=VALUE",
                   help="the value of a template placeholder ${NAME} or $NAME that a script fills in before "
                        "Caffe reads the file, such as DeepLab's NUM_LABELS (repeatable; without it the value "
                        "comes from the net saved in --weights)")


def add_model_args(p, weights=True, batch=True, outputs=True):
    """The model and how to read it: MODEL, --weights, --phase, --stage, --level, --batch,
    --input-shape, --outputs, --ignore-unknown, --define.

    Options that change how the net is read (its inputs, its outputs) belong here, so that every
    command takes them.
    """
    p.add_argument("model", help="deploy/train_val .prototxt (or a .caffeq file)")
    if weights:
        add_weights_arg(p)
    p.add_argument("--phase", default="TEST", choices=["TEST", "TRAIN"], help="phase rules to apply")
    p.add_argument("--stage", action="append", default=[], metavar="NAME",
                   help="a NetState stage for include/exclude rules (repeatable)")
    p.add_argument("--level", type=int, default=0, help="the NetState level for min/max_level rules")
    if batch:
        p.add_argument("--batch", type=positive_int, default=None, metavar="N",
                       help="set the batch dimension of the net's inputs to N")
    p.add_argument("--ignore-unknown", action="store_true",
                   help="skip fields unknown to caffe.proto (with a warning) instead of failing")
    p.add_argument("--input-shape", type=input_shape, action="append", default=[], metavar="NAME=N,C,H,W",
                   help="the shape of an input or data-layer top (repeatable): a train_val net then needs "
                        "no dataset, a Python data layer gets its shape")
    add_define_arg(p)
    if outputs:
        p.add_argument("--outputs", type=blob_names, default=None, metavar="NAME,...",
                       help="make these blobs the net's outputs (layers feeding none of them are dropped)")


MODEL_EXTS = (".prototxt", ".pbtxt", ".caffemodel", ".caffeq", ".onnx", ".npy", ".npz")


def json_output(text):
    """--json's file: refused when it names a model or array file (a model path taken by --json,
    or a swapped argument), which JSON would replace."""
    if os.path.splitext(str(text))[1].lower() in MODEL_EXTS:
        raise argparse.ArgumentTypeError(f"{text!r} names a model or array file, not a JSON report: put the model "
                                         f"before --json, write --json - for stdout, or name OUT.json")
    return text


def add_json_arg(p, what="the results"):
    """--json [OUT]: JSON on stdout without a file name (the report then goes to stderr), else to OUT."""
    p.add_argument("--json", type=json_output, nargs="?", const="-", default=None, metavar="OUT.json",
                   help=f"write {what} as JSON: to stdout without a file name (the text report then goes "
                        f"to stderr), else to OUT.json")


def add_device_arg(p, default="auto"):
    p.add_argument("--device", type=device, default=default, metavar="cpu|cuda|cuda:N|auto",
                   help=f"where to compute: cpu, cuda, cuda:N, or auto for CUDA when available "
                        f"(default {default})")


def add_workers_arg(p):
    p.add_argument("--workers", type=workers, default="auto", metavar="N|auto",
                   help=f"data loading processes (default auto: min(4, CPUs - 1), here "
                        f"{default_workers()})")


def add_progress_arg(p):
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are drawn on a terminal only)")


KEEP_HELP = ("layers kept fp32 when quantizing (--to fp16, int8 or binary): none, or NAME,... "
             "(default: binary keeps the first and last weighted layers, the others none)")


def add_keep_arg(p):
    """--keep: the same help and values in every command that quantizes (run, convert, eval)."""
    p.add_argument("--keep", metavar="none|NAME,...", default=None, help=KEEP_HELP)


def add_no_output_arg(p, writes):
    """-o/--output where a command writes no model file (eval, sensitivity, inspect): one error line
    that says how this command writes its results (`writes`), instead of a near option's meaning."""
    class Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string}: {parser.prog.split()[-1]} writes no model file; {writes}")
    p.add_argument("-o", "--output", nargs="?", action=Refuse, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_batch_size_arg(p, help="images per batch (default: the data layer's batch_size, else 64)"):
    p.add_argument("--batch-size", type=positive_int, default=None, metavar="N", help=help)


def mean_values(text):
    """--mean-value V[,V,...] -> [float, ...]."""
    try:
        values = [float(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected one number, or one per channel")
    return values


def channel_order(text):
    order = str(text).upper()
    if order not in ("BGR", "RGB"):
        raise argparse.ArgumentTypeError(f"BGR or RGB, got {text!r}")
    return order


def add_preprocess_args(p, title="preprocessing (override the data layer's transform_param)", decode=False):
    """How images become net inputs (eval, finetune, sensitivity, convert --calibrate): flags that
    replace the data layer's transform_param; decode adds --force-color/--force-gray."""
    g = p.add_argument_group(title)
    g.add_argument("--mean-file", metavar="MEAN.binaryproto", help="per-pixel mean (Caffe binaryproto)")
    g.add_argument("--mean-value", type=mean_values, metavar="V[,V,...]",
                   help="one mean, or one per channel (net order)")
    g.add_argument("--scale", type=number, default=None, metavar="S", help="multiply (pixel - mean) by this")
    g.add_argument("--crop-size", type=nonnegative_int, default=None, metavar="N",
                   help="square crop (centre at test, random in training)")
    g.add_argument("--resize", metavar="HxW", help="resize images first (OpenCV bilinear, as ImageData)")
    g.add_argument("--channel-order", type=channel_order, default=None, metavar="BGR|RGB",
                   help="colour order the net expects (Caffe: BGR, the default)")
    if decode:
        g.add_argument("--force-color", action="store_true", default=None, help="decode images in colour")
        g.add_argument("--force-gray", action="store_true", default=None, help="decode images in grey")
    return g


def transform_from_args(args):
    """(transform overrides, resize, channel order) from the flags of add_preprocess_args."""
    if args.mean_file is not None and not os.path.exists(args.mean_file):
        raise DataError(f"--mean-file {args.mean_file}: mean file not found")
    transform = {"mean_file": args.mean_file, "mean_value": args.mean_value, "scale": args.scale,
                 "crop_size": args.crop_size}
    for flag in ("force_color", "force_gray"):
        if hasattr(args, flag):
            transform[flag] = getattr(args, flag)
    return transform, args.resize, args.channel_order


PREPROCESS_FLAGS = ("mean_file", "mean_value", "scale", "crop_size", "resize", "channel_order")


def preprocess_options(args):
    """The flags of add_preprocess_args as the keyword arguments (transform, resize, channel_order)
    that the library's dataset readers take: sensitivity, convert --budget and --calibrate pass them so."""
    transform, resize, order = transform_from_args(args)
    return {"transform": transform, "resize": resize, "channel_order": order}


def preprocess_flags_given(args):
    """The preprocessing flags on the command line, spelled as typed (--mean-file, ...)."""
    return ["--" + f.replace("_", "-") for f in PREPROCESS_FLAGS if getattr(args, f, None) is not None]


def add_dataset_args(p, batch_help=None, decode=False):
    """The options every command that reads a dataset in batches shares (eval, finetune,
    sensitivity): batch size, device, loader workers, progress bars and the preprocessing flags."""
    if batch_help:
        add_batch_size_arg(p, help=batch_help)
    else:
        add_batch_size_arg(p)
    add_device_arg(p)
    add_workers_arg(p)
    add_progress_arg(p)
    add_preprocess_args(p, decode=decode)


def add_speed_args(p):
    """--exact and --compile: which torch module runs (run, eval)."""
    p.add_argument("--exact", action="store_true",
                   help="run layer by layer in Caffe's order of operations (default: the optimized module, "
                        "BatchNorm/Scale folded, channels_last; equal within 1e-5 relative)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile with weight freezing, for long runs (compiling takes a while)")


def plural(count, noun):
    """'1 worker', '0 workers', '4 workers'."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def progress_wanted(args):
    """Progress bars for this command: not --no-progress, and stderr is a terminal."""
    from ..progress import on_terminal
    return not getattr(args, "no_progress", False) and on_terminal()


def report_stream(args):
    """Where the text report goes: stderr when --json writes to stdout, else stdout."""
    return sys.stderr if getattr(args, "json", None) == "-" else sys.stdout


__all__ = [
    "CliParser",
    "UsageError",
    "add_batch_size_arg",
    "add_dataset_args",
    "add_device_arg",
    "add_json_arg",
    "add_keep_arg",
    "add_model_args",
    "add_no_output_arg",
    "add_preprocess_args",
    "add_progress_arg",
    "add_speed_args",
    "add_weights_arg",
    "add_workers_arg",
    "blob_names",
    "channel_order",
    "default_workers",
    "device",
    "did_you_mean",
    "input_shape",
    "mean_values",
    "nonnegative_int",
    "nonnegative_number",
    "number",
    "plural",
    "positive_int",
    "positive_number",
    "preprocess_flags_given",
    "preprocess_options",
    "progress_wanted",
    "report_stream",
    "score_blob",
    "targets",
    "transform_from_args",
    "workers",
]
