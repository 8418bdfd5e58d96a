"""`caffeq sensitivity`: quantize one layer at a time and rank the layers by their accuracy drop."""
import argparse
import os
import sys

from ..errors import CaffeqError
from .common import check_output, resolve_weights, say_found
from .options import (
    add_dataset_args,
    add_json_arg,
    add_no_output_arg,
    add_weights_arg,
    positive_int,
    preprocess_options,
    progress_wanted,
    report_stream,
)

_DESCRIPTION = """\
Quantize one weighted layer at a time (every other layer fp32) and report each
layer's drop in top-1 against the fp32 model on a dataset, most sensitive
first (points of top-1; without labels, top-1 agreement with fp32).  Then the
layers are quantized cumulatively, least sensitive first, for the curve of
accuracy versus the number of quantized layers.

A train_val net's TEST-phase Data/ImageData layer gives the data and its
preprocessing; --data replaces the source.  --budget POINTS prints which
layers the budget rule keeps fp32 (the fewest, most sensitive first, that
bring the estimated drop, the sum of single-layer drops, within the budget):
the same rule as `finetune --budget` and `convert --budget`."""


def add_parser(sub):
    p = sub.add_parser("sensitivity", help="per-layer accuracy drop of binary (or int8) weights, sorted",
                       description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="train_val/deploy .prototxt")
    add_weights_arg(p, "trained weights")
    p.add_argument("--to", type=str.lower, choices=("binary", "int8"), default="binary", metavar="binary|int8", help="the precision tested (default binary)")
    p.add_argument("--data", metavar="SRC", help="LMDB, ImageData list, image folder or .npy/.npz "
                                                 "(default: the TEST-phase data layer's source)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="use the first N items only")
    p.add_argument("--budget", default=None, metavar="POINTS",
                   help="also print which layers this budget (points of top-1) keeps fp32")
    p.add_argument("--plot", metavar="OUT.png", help="bar chart of the drops and the cumulative curve "
                                                     "(needs matplotlib)")
    add_json_arg(p, "the table")
    add_no_output_arg(p, "it writes its results with --json FILE and the chart with --plot OUT.png")
    p.add_argument("--no-cumulative", action="store_true",
                   help="skip the second pass (accuracy vs number of quantized layers)")
    add_dataset_args(p)
    return p


def run(args):
    from ..sensitivity import (
        check_budget,
        format_table,
        layer_sensitivity,
        plot_sensitivity,
    )
    from .common import write_json
    weights, note = resolve_weights(args.model, args.weights)
    check_output(args.json, "--json", (args.model, weights, args.data))
    if args.budget is not None:
        check_budget(args.budget)
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            raise CaffeqError(f"--plot {args.plot}: the plot is written as PNG; name it *.png")
        check_output(args.plot, "--plot", (args.model, weights, args.data))
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CaffeqError("--plot needs matplotlib (pip install matplotlib)") from None
    say_found(note)
    result = layer_sensitivity(
        args.model, args.data, args.to, weights=weights, batch_size=args.batch_size,
        device=args.device, workers=args.workers, limit=args.limit, cumulative=not args.no_cumulative,
        progress=progress_wanted(args), **preprocess_options(args))
    for w in result["warnings"]:
        print(f"caffeq: warning: {w}", file=sys.stderr)
    out = report_stream(args)
    d = result["data"]
    print(f"sensitivity to {result['target']} weights: {result['images']} images from {d['source']}, "
          f"{'top-1' if result['metric'] == 'top1' else 'top-1 agreement with fp32'}", file=out)
    print(format_table(result, budget=args.budget), file=out)
    if args.plot:
        title = f"{result.get('name') or os.path.basename(args.model)}: {result['target']} weights"
        plot_sensitivity(result, args.plot, title=title)
        print(f"wrote {args.plot}", file=out)
    if args.json:
        if args.budget is not None:
            from ..sensitivity import choose_keep, estimated_drop
            keep = choose_keep(result, args.budget)
            result["budget"] = {"budget": float(args.budget), "keep": keep,
                                "estimated_drop": estimated_drop(result, keep)}
        write_json(args.json, result)
    return 0


__all__ = ["add_parser", "run"]
