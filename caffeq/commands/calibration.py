"""`convert --to int8 --calibrate SRC`: the static-int8 options of convert and their run.

Kept apart from convert.py, which only adds these options and hands over when --calibrate is given.
"""
import argparse
import os
import sys

from ..errors import CaffeqError
from ..quant.static_int8 import METHODS
from .common import display_path, format_bytes, say_found
from .options import did_you_mean, positive_int, preprocess_options, report_stream


def calibration_methods(text):
    """--calibrate-method M[,M...] -> [method, ...], each one of METHODS (a typo gets a did-you-mean)."""
    methods = [m.strip().lower() for m in str(text).split(",") if m.strip()]
    if not methods:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(METHODS)}")
    for m in methods:
        if m not in METHODS:
            raise argparse.ArgumentTypeError(f"unknown calibration method {m!r} (choose from {', '.join(METHODS)})"
                                             f"{did_you_mean(m, METHODS)}")
    return list(dict.fromkeys(methods))


def add_arguments(p):
    g = p.add_argument_group("static int8 (--to int8 --calibrate SRC)")
    g.add_argument("--calibrate", metavar="SRC", default=None,
                   help="quantize activations too: per-tensor scales calibrated on SRC (LMDB, image list, "
                        "image folder, or an .npy/.npz of preprocessed inputs); writes a QDQ ONNX that "
                        "onnxruntime runs on int8 kernels")
    g.add_argument("--calibrate-images", type=positive_int, default=256, metavar="N",
                   help="items of SRC to calibrate on (default 256)")
    g.add_argument("--calibrate-method", type=calibration_methods, default="minmax,percentile,entropy",
                   metavar="M[,M...]",
                   help="activation range methods to try; the one agreeing best with fp32 on SRC is "
                        "written (default: all three)")


def run_static_int8(args, model, model_path, weights, lines, keep, only, found=None):
    """Calibrate, write the QDQ ONNX, print what was done (found: which weights were found, for stderr)."""
    from ..quant.static_int8 import calibration_inputs, format_summary, static_int8
    target = args.to or "fp32"
    if target != "int8":
        raise CaffeqError(f"--calibrate quantizes activations to int8; use it with --to int8 (not {target})")
    if model.quantization:
        raise CaffeqError(f"{model_path} is already quantized; calibrate the fp32 prototxt and caffemodel")
    out = args.output or f"{os.path.splitext(os.path.basename(model_path))[0]}.int8.onnx"
    if os.path.splitext(out)[1].lower() != ".onnx" or getattr(args, "format", None):
        raise CaffeqError(f"-o {out}: static int8 (--calibrate) writes a QDQ .onnx file")
    if args.budget is not None:
        raise CaffeqError("--budget does not apply to --calibrate; choose float layers with --keep/--only")
    if args.no_optimize or args.batch not in (None, "dynamic") or args.onnx_batch not in (None, "dynamic"):
        raise CaffeqError("--calibrate writes an optimized file with a dynamic batch; drop "
                          "--no-optimize/--batch/--onnx-batch")
    methods = list(args.calibrate_method)
    notes = []
    arrays = calibration_inputs(model, args.calibrate, args.calibrate_images, notes=notes,
                                **preprocess_options(args))
    for n in notes:
        print(f"caffeq: warning: --calibrate {args.calibrate}: {n}", file=sys.stderr)
    protected = [p for p in (model_path, weights, args.calibrate) if p]
    info = static_int8(model, out, arrays, keep=keep, only=only, methods=methods, opset=args.opset,
                       inputs=protected)
    lines.extend(format_summary(info))
    src = weights or model_path
    lines.append(f"wrote {display_path(out)} (static int8, QDQ ONNX opset {info['opset']})")
    lines.append(f"size: {display_path(src)} {format_bytes(os.path.getsize(src))} -> {display_path(out)} "
                 f"{format_bytes(info['file_size'])}")
    say_found(found)
    print("\n".join(lines), file=report_stream(args))
    if args.json:
        from .common import write_json
        write_json(args.json, {"model": model_path, "weights": weights, "target": "int8", "static": True,
                               "output": out, "format": "onnx", "written": [out], "static_int8": info})
    return 0
