"""`caffeq eval`: accuracy and agreement of fp32 and quantized targets on a dataset, side by side."""
import os
import sys

from ..errors import DataError
from .common import add_model_args, write_json


def add_parser(sub):
    p = sub.add_parser(
        "eval", help="evaluate fp32 and quantized targets on a dataset (LMDB, list, folder, arrays)",
        description="Evaluate the net on a dataset with Caffe's preprocessing. A train_val/test net's "
                    "TEST-phase Data or ImageData layer gives the source, batch size, transform_param and "
                    "labels; --data replaces the source. For a deploy net pass --data and the "
                    "preprocessing flags. Every target runs on the same batches in one pass. Under "
                    "`torchrun --nproc_per_node=N` the data is sharded and the numbers all-reduced.")
    add_model_args(p)
    p.add_argument("--data", metavar="SRC",
                   help="LMDB folder, ImageData list (path label per line), image folder (one subfolder "
                        "per class) or .npy/.npz")
    p.add_argument("--to", default="fp32", metavar="T1,T2",
                   help="targets, comma separated: fp32, fp16, int8, binary (fp32 always runs as the "
                        "reference)")
    p.add_argument("--keep", default=None, help="quantized targets: layers kept fp32 (none or NAME,...)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="images per batch (default: the data layer's batch_size, else 64)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (CUDA when available)")
    p.add_argument("--workers", type=int, default=None,
                   help="data loading processes (default: min(4, CPUs - 1))")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N items only")
    p.add_argument("--strict", action="store_true", help="fail on the first unreadable item or bad label")
    p.add_argument("--json", metavar="OUT.json", help="write the numbers as JSON ('-' for stdout)")
    p.add_argument("--output", metavar="BLOB", help="the blob holding the class scores (default: what the "
                                                     "Accuracy layer reads, else the net's output)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--exact", action="store_true",
                   help="run the layer-by-layer module in Caffe's order of operations (default: the "
                        "optimized one, BatchNorm/Scale folded, equal within 1e-5 relative)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile with weight freezing (long evaluations; compiling takes a while)")
    p.add_argument("--calibrate", metavar="SRC", default=None,
                   help="with --to int8: static int8 (activations too), scales calibrated on SRC (a data "
                        "source or .npy/.npz of inputs), run by onnxruntime's int8 kernels")
    p.add_argument("--calibrate-images", type=int, default=256, metavar="N",
                   help="images of --calibrate to use (default 256)")
    g = p.add_argument_group("preprocessing (override the data layer's transform_param)")
    g.add_argument("--mean-file", metavar="MEAN.binaryproto", help="per-pixel mean (Caffe binaryproto)")
    g.add_argument("--mean-value", metavar="V[,V,...]", help="one mean, or one per channel (net order)")
    g.add_argument("--scale", type=float, default=None, help="multiply (pixel - mean) by this")
    g.add_argument("--crop-size", type=int, default=None, help="centre crop (square)")
    g.add_argument("--resize", metavar="HxW", help="resize images first (OpenCV bilinear, as ImageData)")
    g.add_argument("--channel-order", choices=["BGR", "RGB", "bgr", "rgb"], default=None,
                   help="colour order the net expects (Caffe: BGR, the default)")
    g.add_argument("--force-color", action="store_true", default=None, help="decode images in colour")
    g.add_argument("--force-gray", action="store_true", default=None, help="decode images in grey")
    return p


def _mean_values(text):
    if text is None:
        return None
    try:
        return [float(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise DataError(f"--mean-value {text!r}: expected numbers separated by commas") from None


def default_workers():
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def run(args):
    from ..evaluate import evaluate, format_table
    if args.mean_file is not None and not os.path.exists(args.mean_file):
        raise DataError(f"{args.mean_file}: mean file not found")
    if args.data is not None and not os.path.exists(args.data):
        raise DataError(f"{args.data}: data source not found")
    transform = {"mean_file": args.mean_file, "mean_value": _mean_values(args.mean_value),
                 "scale": args.scale, "crop_size": args.crop_size, "force_color": args.force_color,
                 "force_gray": args.force_gray}
    keep = None if args.keep is None else ("none" if args.keep == "none" else args.keep.split(","))
    workers = default_workers() if args.workers is None else args.workers
    result = evaluate(args.model, data=args.data, weights=args.weights, phase=args.phase,
                      ignore_unknown=args.ignore_unknown, targets=args.to, batch_size=args.batch_size or args.batch, device=args.device,
                      workers=workers, limit=args.limit, strict=args.strict, transform=transform,
                      resize=args.resize, channel_order=args.channel_order, output=args.output, keep=keep,
                      progress=not args.no_progress, exact=args.exact, compile=args.compile,
                      calibrate=args.calibrate, calibrate_images=args.calibrate_images)
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return 0      # under torchrun, rank 0 reports
    for w in result["warnings"]:
        print(f"caffeq: warning: {w}", file=sys.stderr)
    out = sys.stderr if args.json == "-" else sys.stdout
    d = result["data"]
    head = (f"{result['images']} images from {d['source']} ({d['kind']}), batch {d['batch_size']}, "
            f"{result['device']}, {result['workers']} workers")
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
    if args.json:
        write_json(args.json, result)
    return 0
