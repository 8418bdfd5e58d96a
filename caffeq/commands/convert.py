"""`caffeq convert`: quantize (fp16 / int8 / binary) and write ONNX, .caffemodel or .caffeq."""
import argparse
import os
import sys

import numpy as np

from ..data.arrays import net_inputs
from ..errors import CaffeqError
from .common import (
    check_output,
    display_path,
    find_weights,
    format_bytes,
    format_count,
    keep_needs_a_target,
    layer_names_arg,
    load_model,
    model_output_format,
    resolve_weights,
    say_found,
    write_model_file,
)
from .options import (
    add_json_arg,
    add_keep_arg,
    add_model_args,
    add_preprocess_args,
    add_progress_arg,
    did_you_mean,
    positive_int,
    preprocess_flags_given,
    preprocess_options,
    progress_wanted,
    report_stream,
)

TARGETS = ("fp32", "fp16", "int8", "binary")

_DESCRIPTION = """\
Quantize a Caffe model's weights and write it as ONNX, Caffe or caffeq's own
compact container; the format follows -o's extension (default:
<prototxt stem>.<to>.onnx in the current folder).

  binary  per output channel c: W_c = mean|W_c| * sign(W_c) (binary-weight
          networks, as in XNOR-Net); the first and last weighted layers stay
          fp32 unless --keep none.  Biases, BatchNorm, Scale, PReLU stay fp32.
  int8    weight-only, symmetric, per output channel (scale = max|W_c| / 127).
          With --calibrate SRC: static int8, activations too (per-tensor scales
          calibrated on SRC), a QDQ .onnx that onnxruntime runs on int8 kernels.
  fp16    every blob rounded to fp16, BatchNorm folded in fp32 first.  caffeq
          computes fp16 models in fp32 with fp16-rounded weights on CPU and in
          fp16 on CUDA.

Files: .onnx stores the weights at their precision (FLOAT16, INT8 +
DequantizeLinear, bit-packed signs); .caffemodel holds the dequantized float
weights (legacy Caffe runs them unchanged) with the prototxt written beside it;
.caffeq is caffeq's compact container (caffeq.load, run, inspect and convert
read it)."""


def add_parser(sub):
    p = sub.add_parser("convert", help="quantize to fp16/int8/binary; write .onnx, .caffemodel or .caffeq",
                       description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, batch=False)
    p.add_argument("--batch", type=_batch_value, default=None, metavar="N",
                   help="set the batch dimension of the net's inputs to N (as in every command); an "
                        "ONNX file then has the fixed batch N unless --onnx-batch dynamic")
    p.add_argument("--to", type=_target, default=None, metavar="|".join(TARGETS),
                   help="weight precision (default fp32; a .caffeq input keeps its own). fp16 computes "
                        "in fp32 with fp16-rounded weights on CPU and in fp16 on CUDA")
    p.add_argument("-o", "--output", metavar="OUT", default=None,
                   help="output file: .onnx, .caffemodel (+ .prototxt beside it) or .caffeq "
                        "(default <prototxt stem>.<to>.onnx in the current folder)")
    add_keep_arg(p)
    p.add_argument("--only", metavar="NAME,...", default=None, help="quantize only these layers")
    p.add_argument("--budget", default=None, metavar="POINTS",
                   help="binary/int8: keep fp32 the fewest layers (most sensitive first) whose estimated "
                        "top-1 drop on --data fits this many points (see `caffeq sensitivity`)")
    p.add_argument("--data", metavar="SRC", default=None,
                   help="--budget: the data to measure each layer's drop on (default: the TEST-phase "
                        "data layer's source)")
    p.add_argument("--opset", default=None, metavar="N", help="ONNX opset, 13 or newer (default 21)")
    p.add_argument("--onnx-batch", type=_onnx_batch, default=None, metavar="dynamic|N",
                   help="the ONNX file's batch dimension: dynamic (the default without --batch) or a "
                        "fixed size")
    p.add_argument("--no-optimize", action="store_true",
                   help="ONNX: keep BatchNorm/Scale, Dropout, Split and reshapes as they are")
    p.add_argument("--probe", metavar="X.npz",
                   help="inputs by blob name: run fp32 and the target, report each output's relative "
                        "error and top-1 agreement")
    add_json_arg(p, "what was done")
    add_progress_arg(p)     # --budget's sensitivity pass draws bars on a terminal, as `sensitivity` does
    p.add_argument("--format", choices=["pytorch"], default=None,
                   help="pytorch: a standalone model.py (plain torch.nn) + weights.safetensors + "
                        "README.md in the folder -o (default <prototxt stem>_pytorch/), or -o NAME.py "
                        "with NAME.safetensors beside it")
    p.add_argument("--exact-batchnorm", action="store_true",
                   help="pytorch: BatchNorm keeps Caffe's op order (bit-identical to caffeq) instead of "
                        "plain nn.BatchNorm2d (equal up to float32 rounding)")
    from .calibration import add_arguments as add_calibration_arguments
    add_calibration_arguments(p)
    add_preprocess_args(p, title="--calibrate SRC and --budget's --data: how the images become net inputs "
                                 "(default: the data layer's transform_param)")
    return p


# ---- inputs ------------------------------------------------------------------------

FILE_FORMATS = {"onnx": ".onnx", "caffemodel": ".caffemodel", "caffe": ".caffemodel", "caffeq": ".caffeq"}


def _target(text):
    """--to: a weight precision; a file format there gets a hint to -o / --format instead."""
    value = str(text).strip().lower()
    if value in TARGETS:
        return value
    if value in FILE_FORMATS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is a file format, not a weight precision ({', '.join(TARGETS)}); the format follows "
            f"-o's extension (.onnx, .caffemodel, .caffeq) or --format, e.g. -o model{FILE_FORMATS[value]}")
    if value in ("pytorch", "torch"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a file format, not a weight precision ({', '.join(TARGETS)}); for PyTorch source "
            f"pass --format pytorch")
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(TARGETS)})"
                                     f"{did_you_mean(value, TARGETS)}")


def _onnx_batch(text):
    """--onnx-batch: dynamic or a fixed batch size N >= 1."""
    value = str(text).strip().lower()
    if value == "dynamic":
        return value
    try:
        return positive_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected dynamic or a batch size of 1 or more, got {text!r}"
                                         f"{did_you_mean(value, ['dynamic'])}") from None

def _batch_value(text):
    """--batch N; `--batch dynamic` (convert's old spelling of the ONNX batch) still works."""
    if str(text).strip().lower() == "dynamic":
        return "dynamic"
    return positive_int(text)


def _parse_opset(value):
    # the range is checked by export_onnx: other formats only warn that --opset does not apply
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise CaffeqError(f"--opset must be an integer (13 or newer), got {value!r}") from None


def probe(fp32_model, quant_model, inputs):
    """Per output: relative L2 error of the target against fp32 and top-1 agreement."""
    ref = fp32_model.run(inputs)
    out = quant_model.run(inputs)
    rows = {}
    for name in ref:
        if name not in out:
            continue
        a = np.asarray(ref[name], np.float64)
        b = np.asarray(out[name], np.float64)
        norm = float(np.linalg.norm(a))
        row = {"shape": list(a.shape),
               "rel_error": float(np.linalg.norm(b - a) / norm) if norm else float(np.linalg.norm(b - a)),
               "max_abs_error": float(np.abs(b - a).max()) if a.size else 0.0}
        if a.ndim >= 2 and a.shape[1] > 1:
            agree = np.argmax(a, axis=1) == np.argmax(b, axis=1)
            row["top1_agreement"] = float(agree.mean())
            row["top1_agree"] = int(agree.sum())
            row["top1_total"] = int(agree.size)
        rows[name] = row
    return rows


def _refuse_ignored_options(args):
    """Options that would be silently ignored with the others given: one error, before any work."""
    if args.exact_batchnorm and getattr(args, "format", None) != "pytorch":
        raise CaffeqError("--exact-batchnorm is an option of --format pytorch (the BatchNorm of model.py); "
                          "add --format pytorch or drop it")
    flags = preprocess_flags_given(args)
    if flags and args.calibrate is None and args.budget is None:
        raise CaffeqError(f"{', '.join(flags)}: preprocessing applies to the images of --calibrate SRC or "
                          f"--budget's --data only; add one of them or drop {'it' if len(flags) == 1 else 'them'}")
    if args.data is not None and args.budget is None:
        raise CaffeqError(f"--data {args.data}: the data --budget measures on; add --budget POINTS or drop --data"
                          + (" (--calibrate SRC is the calibration data)" if args.calibrate is not None else ""))


def finetune_hint(model_path, weights, args):
    """A `finetune` command line for this model that runs as printed.

    finetune trains on a net with TRAIN-phase data: the prototxt itself when it has one, else a
    train_val prototxt beside it that has, else the deploy net with --data/--val placeholders."""
    net = model_path if _train_data_layer(model_path) else _train_val_beside(model_path)
    data = "" if net else " --data TRAIN_SRC --val VAL_SRC"
    parts = [f"python cli.py finetune {display_path(net or model_path)}"]
    if weights:
        parts.append(f"--weights {display_path(weights)}")
    parts.append("--to binary")
    for flag, value in (("--keep", args.keep), ("--only", args.only), ("--budget", args.budget)):
        if value is not None:
            parts.append(f"{flag} {value}")
    return " ".join(parts) + data


def _train_data_layer(prototxt):
    """Whether the prototxt has a TRAIN-phase Data/ImageData/HDF5Data layer whose source exists."""
    from ..data.plan import phase_data_layer
    from ..model import read_net
    try:
        net = read_net(prototxt, warnings=[])
        base_dir = os.path.dirname(os.path.abspath(prototxt))
        info, _ = phase_data_layer(net, "TRAIN", prototxt, base_dir)
    except CaffeqError:
        return False
    if info is None:
        return False
    source = info.attrs.get("source")
    return bool(source) and os.path.exists(os.path.join(base_dir, source))


def _train_val_beside(prototxt):
    """A train_val-style prototxt in the same folder with TRAIN-phase data, or None."""
    folder = os.path.dirname(os.path.abspath(prototxt))
    names = sorted(f for f in os.listdir(folder) if f.endswith(".prototxt") and "train" in f.lower()
                   and "solver" not in f.lower())
    # train_val / trainval first: they also have the TEST-phase data finetune validates on
    names.sort(key=lambda f: 0 if "val" in f.lower() or "test" in f.lower() else 1)
    for name in names:
        path = os.path.join(os.path.dirname(prototxt), name)
        if _train_data_layer(path):
            return path
    return None


# ---- the command ---------------------------------------------------------------------------

def run(args):
    from ..backends.onnx_backend import parse_batch
    from ..quant import get_quantizer, quantize

    model_path = args.model
    lines = []          # what it did, printed at the end (nothing printed before a failure)
    weights, note = resolve_weights(model_path, args.weights)
    args.weights = weights
    check_output(args.json, "--json", (model_path, weights, args.probe))
    _refuse_ignored_options(args)
    if args.batch == "dynamic":
        if args.onnx_batch is not None and str(args.onnx_batch).strip().lower() != "dynamic":
            raise CaffeqError(f"--batch dynamic and --onnx-batch {args.onnx_batch} both set the ONNX file's batch "
                              f"and disagree; pass one of them")
        print("caffeq: warning: convert --batch dynamic is now --onnx-batch dynamic (the default); "
              "--batch N sets the input batch, as in every command", file=sys.stderr)
        args.batch = None
        args.onnx_batch = args.onnx_batch or "dynamic"
    batch = parse_batch(args.onnx_batch if args.onnx_batch is not None else args.batch, "--onnx-batch")
    if args.batch is not None and args.onnx_batch is not None and batch not in (None, "dynamic") \
            and batch != args.batch:
        raise CaffeqError(f"--batch {args.batch} and --onnx-batch {args.onnx_batch} both set the ONNX file's "
                          f"batch and disagree; pass one of them")
    opset = _parse_opset(args.opset)
    keep = layer_names_arg(args.keep, "--keep")
    only = layer_names_arg(args.only, "--only")
    if keep not in (None, "none") and only is not None:
        raise CaffeqError("--keep and --only cannot be combined; name the layers to quantize with --only")

    # the input batch matters to the ONNX file only (the other formats hold the net as written):
    # the exporter applies it, to the model as the prototxt declares it
    model = load_model(argparse.Namespace(**{**vars(args), "batch": None}))
    if args.calibrate is not None:
        from .calibration import run_static_int8
        return run_static_int8(args, model, model_path, weights, lines, keep, only, found=note)

    stored = sorted(set(model.quantization.values()))
    target = args.to or (stored[0] if len(stored) == 1 else "fp32")
    get_quantizer(target)
    if target == "fp32" and (keep is not None or only is not None):
        keep_needs_a_target("--keep" if keep is not None else "--only",
                            "--to fp32 quantizes none" if args.to else "without --to the target is fp32 (none quantized)")
    # the output is checked before the (possibly long) budget analysis and quantization
    if getattr(args, "format", None) == "pytorch":
        out = _pytorch_output(args, model_path)
    else:
        out = args.output or f"{os.path.splitext(os.path.basename(model_path))[0]}.{target}.onnx"
        protected = [p for p in (model_path, weights, args.probe) if p]
        ext = model_output_format(out, protected)
        if ext != ".onnx":
            ignored = [f for f, v in (("--opset", args.opset), ("--batch", args.batch),
                                      ("--onnx-batch", args.onnx_batch),
                                      ("--no-optimize", args.no_optimize or None)) if v is not None]
            if ignored:
                verb = "applies" if len(ignored) == 1 else "apply"
                print(f"caffeq: warning: {', '.join(ignored)} only {verb} to .onnx output; ignored for {ext}",
                      file=sys.stderr)
    if stored:
        if target == "fp32":
            qmodel = _dequantized(model)
            qmodel.quant_report = None
            lines.append(f"{model_path}: {', '.join(stored)} weights written as float32")
        elif [target] == stored and keep is None and only is None:
            qmodel = model
            lines.append(f"{model_path}: already {target}; weights kept as stored")
        else:
            raise CaffeqError(f"{model_path} is already quantized ({', '.join(stored)}); convert the fp32 "
                              f"prototxt and caffemodel to --to {target}")
        fp32_model = None   # the float weights are not in the file
    else:
        keep_reason = "--keep"
        if args.budget is not None:
            from ..sensitivity import keep_for_budget
            if keep is not None or only is not None:
                raise CaffeqError("--budget chooses the layers kept fp32; drop --keep/--only")
            # the data read as `caffeq sensitivity` reads it: the same preprocessing flags
            kept, _ = keep_for_budget(model, args.budget, data=args.data, target=target,
                                      progress=progress_wanted(args), **preprocess_options(args))
            keep = kept or "none"
            keep_reason = f"budget {float(args.budget):g} points"
            lines.append(f"{keep_reason}: keep fp32 {', '.join(kept) or 'nothing'}")
        qmodel = quantize(model, target, keep=keep, only=only, keep_reason=keep_reason)
        fp32_model = model
    report = qmodel.quant_report
    if getattr(args, "format", None) == "pytorch":
        return _run_pytorch(args, model_path, weights, qmodel, target, report, lines, out, note)

    probe_inputs = net_inputs(args.probe, model) if args.probe else None

    written, onnx_stats = write_model_file(qmodel, out, protected, opset=opset, batch=batch,
                                           optimize=not args.no_optimize)

    probe_rows = None
    if probe_inputs is not None and fp32_model is not None:
        probe_rows = probe(fp32_model, qmodel, probe_inputs)

    # ---- what it did ----
    src_bytes = os.path.getsize(weights) if weights else os.path.getsize(model_path)
    out_bytes = sum(os.path.getsize(p) for p in written if p.endswith((".onnx", ".caffemodel", ".caffeq", ".data")))
    if report is not None:
        lines.append(report.summary())
        lines.append(report.format_table())
        for n in report.notes:
            lines.append(f"note: {n}")
    src_name = weights if weights else model_path
    lines.append(f"wrote {', '.join(display_path(p) for p in written)} ({target}, {ext[1:]})")
    sizes = (f"size: {display_path(src_name)} {format_bytes(src_bytes)} -> {display_path(out)} "
             f"{format_bytes(out_bytes)}")
    lines.append(f"{sizes} ({_size_change(src_bytes, out_bytes, ext, target)})")
    if report is not None and report.bytes_after and report.bytes_after != report.bytes_before:
        lines.append(f"weights: {format_bytes(report.bytes_before)} fp32 -> {format_bytes(report.bytes_after)} "
                     f"{target} ({report.ratio:.2f}x smaller)")
    if onnx_stats is not None:
        lines.append(f"ONNX opset {onnx_stats['opset']}, batch {onnx_stats['batch']}; nodes: "
                     f"{onnx_stats['nodes_before']} before optimization, {onnx_stats['nodes_after']} after"
                     + ("" if onnx_stats.get("optimized", True) else " (--no-optimize)"))
        for n in onnx_stats.get("notes", []):
            lines.append(f"note: {n}")
    if probe_inputs is not None and probe_rows is None:
        lines.append(f"probe: skipped, {display_path(model_path)} holds {', '.join(stored)} weights and no "
                     f"fp32 reference; probe the conversion from the fp32 prototxt and caffemodel")
    if probe_rows is not None:
        n_items = next(iter(probe_inputs.values())).shape[0] if probe_inputs else 0
        lines.append(f"probe ({display_path(args.probe)}, {n_items} item(s)), {target} against fp32:")
        for name, row in probe_rows.items():
            t = (f", top-1 agreement {row['top1_agree']}/{row['top1_total']} ({100 * row['top1_agreement']:.1f}%)"
                 if "top1_agreement" in row else "")
            lines.append(f"  {name}: relative error {row['rel_error']:.4g}{t}")
    if target == "binary" and not stored and report is not None and report.changed:
        lines.append(f"note: post-training binarization of a float-trained model changes its outputs a lot; "
                     f"recover accuracy with `{finetune_hint(model_path, weights, args)}`")
    say_found(note)      # on stderr, as in every command; after the work, so a failure prints one line
    print("\n".join(lines), file=report_stream(args))

    if args.json:
        from .common import write_json
        write_json(args.json, {
            "model": model_path, "weights": weights, "target": target, "output": out,
            "format": ext[1:], "written": written,
            "size_before": src_bytes, "size_after": out_bytes,
            "compression": (src_bytes / out_bytes) if out_bytes else None,
            "report": report.to_dict() if report is not None else None,
            "onnx": onnx_stats, "probe": probe_rows,
        })
    return 0


def _pytorch_output(args, model_path):
    """-o for --format pytorch: a folder (made if missing) or NAME.py (checked like any output)."""
    out = args.output or f"{os.path.splitext(os.path.basename(model_path))[0]}_pytorch"
    if os.path.splitext(out.rstrip("/" + os.sep))[1].lower() not in ("", ".py"):
        raise CaffeqError(f"-o {out}: --format pytorch writes a folder or a .py file")
    if out.lower().endswith(".py"):
        check_output(out, "-o", [model_path, args.weights], (".py",))
    elif os.path.exists(out) and not os.path.isdir(out):
        raise CaffeqError(f"-o {out}: is a file; --format pytorch writes a folder (or NAME.py)")
    return out


def _run_pytorch(args, model_path, weights, qmodel, target, report, lines, out, found):
    """--format pytorch: model.py + weights (+ README.md) through caffeq.backends.pytorch_source."""
    from ..backends.pytorch_source import export_pytorch
    ignored = [f for f, v in (("--opset", args.opset), ("--batch", args.batch), ("--onnx-batch", args.onnx_batch),
                              ("--no-optimize", args.no_optimize or None), ("--probe", args.probe)) if v]
    if ignored:
        print(f"caffeq: warning: {', '.join(ignored)} do not apply to --format pytorch; ignored",
              file=sys.stderr)
    protected = [p for p in (model_path, weights) if p]
    info = export_pytorch(qmodel, out, exact_batchnorm=args.exact_batchnorm, inputs=protected)
    if report is not None:
        lines.append(report.summary())
        for n in report.notes:
            lines.append(f"note: {n}")
    written = [info["model_py"], info["weights"]] + ([info["readme"]] if info["readme"] else [])
    lines.append(f"wrote {', '.join(display_path(p) for p in written)} (class {info['class_name']}, "
                 f"{target} weights, {format_count(info['parameters'])} values, {format_bytes(info['weights_bytes'])})")
    lines.append(f"inputs: {', '.join(info['inputs'])}; outputs: {', '.join(info['outputs'])}")
    for n in info["notes"]:
        lines.append(f"note: {n}")
    say_found(found)      # on stderr, as in every command; after the work, so a failure prints one line
    print("\n".join(lines), file=report_stream(args))
    if args.json:
        from .common import write_json
        write_json(args.json, {"model": model_path, "weights": weights, "target": target, "format": "pytorch",
                               "output": out, "written": written, "pytorch": info,
                               "report": report.to_dict() if report is not None else None})
    return 0


def _size_change(before, after, ext, target):
    """How the output's size compares with the input's, in words."""
    if not after:
        return "empty"
    ratio = before / after
    if 0.99 <= ratio <= 1.01:
        if ext == ".caffemodel" and target != "fp32":
            return "the same size: a .caffemodel holds float32 weights; .onnx or .caffeq store them compactly"
        return "about the same size"
    return f"{ratio:.2f}x smaller" if ratio > 1 else f"{1 / ratio:.2f}x larger"


def _dequantized(model):
    """A copy of a quantized model whose weights are plain float32 (compact forms dropped)."""
    from ..quant import copy_model
    m = copy_model(model)
    for n in m.graph.nodes:
        n.quant = {}
    m.quantization = {}
    return m


__all__ = ["add_parser", "find_weights", "probe", "run"]
