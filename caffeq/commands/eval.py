"""`caffeq eval`: accuracy and agreement of fp32 and quantized targets on a dataset, side by side."""
import os
import sys

from ..errors import DataError
from .common import (
    check_output,
    defines_arg,
    display_path,
    input_shapes_arg,
    keep_needs_a_target,
    layer_names_arg,
    resolve_weights,
    say_found,
    write_json,
)
from .options import (
    add_dataset_args,
    add_json_arg,
    add_keep_arg,
    add_model_args,
    add_no_output_arg,
    add_speed_args,
    default_workers,  # noqa: F401  (kept importable from here)
    plural,
    positive_int,
    progress_wanted,
    report_stream,
    score_blob,
    targets,
    transform_from_args,
)


def add_parser(sub):
    p = sub.add_parser(
        "eval", help="evaluate fp32 and quantized targets on a dataset (LMDB, list, folder, arrays)",
        description="Evaluate the net on a dataset with Caffe's preprocessing. A train_val/test net's "
                    "TEST-phase Data or ImageData layer gives the source, batch size, transform_param and "
                    "labels; --data replaces the source. For a deploy net pass --data and the "
                    "preprocessing flags. Every target runs on the same batches in one pass. Under "
                    "`torchrun --nproc_per_node=N` the data is sharded and the numbers all-reduced.")
    add_model_args(p, outputs=False)
    p.add_argument("--data", metavar="SRC",
                   help="LMDB folder, ImageData list (path label per line), image folder (one subfolder "
                        "per class) or .npy/.npz")
    p.add_argument("--to", type=targets, default="fp32", metavar="T1,T2",
                   help="targets, comma separated: fp32, fp16, int8, binary (fp32 always runs as the "
                        "reference; a quantized .caffeq file runs as stored, in place of fp32)")
    add_keep_arg(p)
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="evaluate the first N items only")
    p.add_argument("--strict", action="store_true", help="fail on the first unreadable item or bad label")
    add_json_arg(p, "the numbers")
    # --outputs as in every command: the output that counts here is the one holding the scores
    p.add_argument("--outputs", type=score_blob, metavar="BLOB",
                   help="the blob holding the class scores (default: what the Accuracy layer reads, else "
                        "the net's output)")
    # -o/--output is the output file elsewhere; eval writes none (and never reads it as --outputs)
    add_no_output_arg(p, "it writes its results with --json FILE (--outputs BLOB names the class-score blob)")
    add_speed_args(p)
    p.add_argument("--calibrate", metavar="SRC", default=None,
                   help="with --to int8: static int8 (activations too), scales calibrated on SRC (a data "
                        "source or .npy/.npz of inputs), run by onnxruntime's int8 kernels")
    p.add_argument("--calibrate-images", type=positive_int, default=256, metavar="N",
                   help="images of --calibrate to use (default 256)")
    add_dataset_args(p, decode=True)
    return p


def run(args):
    from ..evaluate import evaluate, format_table
    # everything a typo can break is checked before the evaluation
    check_output(args.json, "--json", (args.model, args.weights, args.data))
    if args.data is not None and not os.path.exists(args.data):
        raise DataError(f"{args.data}: data source not found")
    weights, note = resolve_weights(args.model, args.weights)
    if args.keep is not None and all(t == "fp32" for t in args.to):
        keep_needs_a_target("--keep", "--to fp32 quantizes none")
    say_found(note)
    transform, resize, order = transform_from_args(args)
    result = evaluate(args.model, data=args.data, weights=weights, phase=args.phase,
                      ignore_unknown=args.ignore_unknown, targets=args.to, batch_size=args.batch_size or args.batch,
                      device=args.device, workers=args.workers, limit=args.limit, strict=args.strict,
                      transform=transform, resize=resize, channel_order=order,
                      output=args.outputs, keep=layer_names_arg(args.keep, "--keep"),
                      progress=progress_wanted(args), exact=args.exact, compile=args.compile,
                      calibrate=args.calibrate, calibrate_images=args.calibrate_images,
                      stages=args.stage, level=args.level, input_shapes=input_shapes_arg(args),
                      defines=defines_arg(args))
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return 0      # under torchrun, rank 0 reports
    for w in result["warnings"]:
        print(f"caffeq: warning: {w}", file=sys.stderr)
    out = report_stream(args)
    d = result["data"]
    head = (f"{result['images']} images from {d['source']} ({d['kind']}), batch {d['batch_size']}, "
            f"{result['device']}, {plural(result['workers'], 'worker')}")
    if result["world_size"] > 1:
        head += f", {result['world_size']} processes"
    if result["images_per_s"]:
        head += f", {result['images_per_s']:.0f} images/s end to end"
    print(head, file=out)
    print(format_table(result), file=out)
    err = result["errors"]
    if err["count"]:
        print(f"{err['count']} item(s) could not be used:", file=out)
        for e in err["items"][:10]:
            print(f"  {e['error']}", file=out)
        if err["count"] > 10:
            print(f"  ... ({err['count'] - 10} more{'; all in --json' if args.json else ''})", file=out)
    oor = result["labels_out_of_range"]
    if oor["count"]:
        shown = ", ".join(f"item {o['index']} label {o['label']}" for o in oor["items"][:5])
        print(f"{oor['count']} item(s) with labels outside the net's {result['classes']} classes were "
              f"skipped: {shown}{', ...' if oor['count'] > 5 else ''}", file=out)
    for n in result["notes"]:
        print(f"note: {n}", file=out)
    if "fp32" not in result["targets"]:
        # a quantized .caffeq file: its stored precision stands where fp32 was asked for
        stored = result["targets"][0]
        print(f"note: {display_path(args.model)} holds {stored} weights and no fp32 reference: evaluated as "
              f"stored, in place of fp32 (evaluate the fp32 prototxt and caffemodel for an fp32 row)", file=out)
    if args.json:
        write_json(args.json, result)
    return 0
