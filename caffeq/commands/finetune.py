"""`caffeq finetune`: recover a binary-weight model's accuracy (STE fine-tuning, BatchNorm re-estimation)."""
import argparse
import os
import sys

from ..errors import CaffeqError
from ..finetune import OPTIMIZERS, SCHEDULES, FinetuneConfig
from .common import (
    check_output,
    display_path,
    format_bytes,
    layer_names_arg,
    model_output_format,
    resolve_weights,
    write_model_file,
)
from .options import (
    add_dataset_args,
    add_json_arg,
    add_weights_arg,
    nonnegative_int,
    nonnegative_number,
    positive_int,
    positive_number,
    report_stream,
    transform_from_args,
)

_DESCRIPTION = """\
Fine-tune a float-trained Caffe model into a binary-weight model (weights
alpha_c * sign(W) per output channel, as `convert --to binary` writes them).

The forward pass uses binary weights recomputed from latent float weights at
every step; the backward pass is the straight-through estimator (the sign's
gradient passes where |w| <= 1, plus alpha's own gradient), and the latent
weights of binarized layers are clipped to [-1, 1] after each step.  Other
parameters train in fp32.  BatchNorm layers use batch statistics in
training and update Caffe's mean/variance/factor blobs; before each
validation their statistics are re-estimated on --bn-batches training
batches for the current weights.  The best epoch (validation top-1; epoch 0
is the binarized model before any step) is quantized and written.

Data: a train_val net's TRAIN-phase Data/ImageData layer (its
transform_param with random crop and mirror, as Caffe does in TRAIN) and its
TEST-phase layer are the defaults for --data and --val.  A deploy net needs
--data (and --val for validation) plus the preprocessing flags.  Loss: the
net's own loss layers (weighted by loss_weight), else cross-entropy on the
output (on the input of a final Softmax).

--bn-only skips training: binarize, re-estimate BatchNorm statistics, write.
--budget POINTS chooses the layers kept fp32 from a per-layer sensitivity
analysis on the validation data (see `caffeq sensitivity`).

Reproducible: --seed sets torch.manual_seed, the data order and the random
crops/mirrors."""


def add_parser(sub):
    p = sub.add_parser("finetune", help="fine-tune a binary-weight model to recover its accuracy",
                       description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="train_val (or deploy) .prototxt of the float model")
    add_weights_arg(p, "trained float weights")
    p.add_argument("--to", default="binary", metavar="binary", help="target precision (binary)")
    p.add_argument("-o", "--output", metavar="OUT", default=None,
                   help="output: .onnx, .caffemodel (+ .prototxt beside it) or .caffeq "
                        "(default <prototxt stem>.binary.finetuned.onnx in the current folder)")
    p.add_argument("--data", metavar="TRAIN_SRC", help="training data (default: the TRAIN-phase data layer's)")
    p.add_argument("--val", metavar="VAL_SRC", help="validation data (default: the TEST-phase data layer's)")
    p.add_argument("--epochs", type=nonnegative_int, default=None, metavar="N",
                   help="passes over the training data (default 8)")
    p.add_argument("--iters", type=positive_int, default=None, metavar="N",
                   help="stop after N steps in all (overrides --epochs)")
    p.add_argument("--lr", type=positive_number, default=None, metavar="X", help="learning rate (default: adam 1e-3, sgd 0.01)")
    p.add_argument("--optimizer", type=str.lower, choices=OPTIMIZERS, default="adam", metavar="adam|sgd", help="adam (default) or sgd with momentum")
    p.add_argument("--schedule", type=str.lower, choices=SCHEDULES, default="cosine", metavar="cosine|step|constant",
                   help="learning-rate schedule over all steps: cosine (default), step (x0.1 at 50%% and "
                        "75%%) or constant")
    p.add_argument("--momentum", type=nonnegative_number, default=0.9, metavar="M", help="SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=nonnegative_number, default=0.0, metavar="W",
                   help="weight decay (default 0: decay pulls latent weights to 0, where signs flip)")
    p.add_argument("--seed", type=nonnegative_int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--keep", metavar="none|NAME,...", default=None,
                   help="layers kept fp32 (default: the first and last weighted layers; 'none' binarizes all)")
    p.add_argument("--only", metavar="NAME,...", default=None, help="binarize only these layers")
    p.add_argument("--budget", default=None, metavar="POINTS",
                   help="keep fp32 the fewest layers (most sensitive first) whose estimated top-1 drop "
                        "fits this many points, from a sensitivity analysis on the validation data")
    p.add_argument("--bn-only", action="store_true",
                   help="no training: binarize and re-estimate BatchNorm statistics only")
    p.add_argument("--bn-batches", type=positive_int, default=200, metavar="N",
                   help="training batches for each BatchNorm re-estimation (default 200, or all)")
    p.add_argument("--no-bn-reestimate", action="store_true",
                   help="keep the running BatchNorm statistics of training (Caffe's moving averages, "
                        "starting from the float model's) instead of re-estimating them")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="train on the first N items only")
    p.add_argument("--val-limit", type=positive_int, default=None, metavar="N",
                   help="validate on the first N items only")
    p.add_argument("--no-shuffle", action="store_true", help="read the training data in its own order")
    add_json_arg(p, "the history and results")
    add_dataset_args(p, batch_help="training batch size (default: the data layer's, else 64)")
    return p


def _pct(v):
    return "-" if v is None else f"{100 * v:.2f}%"


def run(args):
    from ..finetune import finetune
    from .common import write_json

    path = args.model
    if path.endswith(".caffeq") and os.path.exists(path):
        raise CaffeqError(f"{path}: fine-tuning starts from the fp32 prototxt and caffemodel, not a .caffeq file")
    if str(args.to).strip().lower() not in ("binary", "bin", "bwn"):
        raise CaffeqError(f"--to {args.to}: fine-tuning supports binary weights only (--to binary)")
    weights, found = resolve_weights(path, args.weights)
    keep = layer_names_arg(args.keep, "--keep", verb="binarize")
    only = layer_names_arg(args.only, "--only", verb="binarize")
    if keep not in (None, "none") and only is not None:
        raise CaffeqError("--keep and --only cannot be combined; name the layers to binarize with --only")
    if args.budget is not None and (keep is not None or only is not None):
        raise CaffeqError("--budget chooses the layers kept fp32; drop --keep/--only")
    if args.bn_only:
        training = [flag for flag, value in (("--no-bn-reestimate", args.no_bn_reestimate),
                                             ("--epochs", args.epochs), ("--iters", args.iters),
                                             ("--lr", args.lr)) if value not in (None, False)]
        if training:
            raise CaffeqError(f"--bn-only trains nothing and only re-estimates BatchNorm; drop "
                              f"{', '.join(training)}")

    # the outputs are checked before any training
    out = args.output or f"{os.path.splitext(os.path.basename(path))[0]}.binary.finetuned.onnx"
    protected = [p for p in (path, weights, args.data, args.val) if p]
    ext = model_output_format(out, protected)
    check_output(args.json, "--json", protected + [out])

    transform, resize, order = transform_from_args(args)
    if found:
        print(found, file=sys.stderr)
    # per-epoch lines are printed unless --no-progress; bars only on a terminal
    result = finetune(
        path, weights, target="binary", data=args.data, val=args.val, keep=keep, only=only,
        epochs=FinetuneConfig.epochs if args.epochs is None else args.epochs, iters=args.iters, lr=args.lr, batch_size=args.batch_size,
        optimizer=args.optimizer, schedule=args.schedule, momentum=args.momentum,
        weight_decay=args.weight_decay, seed=args.seed, device=args.device,
        workers=args.workers, bn_only=args.bn_only,
        bn_batches=args.bn_batches, bn_reestimate=not args.no_bn_reestimate, budget=args.budget,
        limit=args.limit, val_limit=args.val_limit,
        transform=transform, resize=resize, channel_order=order, shuffle=not args.no_shuffle,
        progress=not args.no_progress)

    written, _ = write_model_file(result.model, out, protected)

    stream = report_stream(args)
    lines = []
    kept = ", ".join(f"{k} ({v})" for k, v in result.kept.items()) or "none"
    lines.append(f"binary layers: {', '.join(result.binarized)}; kept fp32: {kept}")
    if result.budget:
        b = result.budget
        lines.append(f"budget {b['budget']:g} points: kept fp32 {', '.join(b['keep']) or 'nothing'} "
                     f"(estimated post-training drop {b['estimated_drop']:.2f} points)")
    what = "top-1" if result.metric == "top1" else "top-1 agreement with fp32"
    d = result.data
    if result.best_metric is not None:
        parts = [f"fp32 {_pct(result.fp32)}", f"binary post-training {_pct(result.post_training)}"]
        if d.get("bn_items"):
            parts.append(f"BatchNorm re-estimated {_pct(result.bn_reestimated)}")
        if not args.bn_only:
            epochs = len(result.history) - 1
            parts.append(f"fine-tuned {_pct(result.best_metric)} (best epoch {result.best_epoch} of {epochs})")
        lines.append(f"validation {what} on {d['val_items']} items: " + ", ".join(parts))
    else:
        lines.append("no validation data: the last epoch was written")
    for n in result.notes:
        lines.append(f"note: {n}")
    size = sum(os.path.getsize(p) for p in written if os.path.exists(p) and not p.endswith(".prototxt"))
    lines.append(f"wrote {', '.join(display_path(p) for p in written)} (binary, {ext[1:]}, {format_bytes(size)})")
    if args.bn_only:
        lines.append(f"time: {result.seconds:.1f} s ({d['device']}, BatchNorm statistics from {d['bn_items']} "
                     f"training items)")
    else:
        lines.append(f"time: {result.seconds:.1f} s ({d['device']}, {d['train_items']} training items, batch "
                     f"{d['batch_size']}, {d['optimizer']} lr {d['lr']:g} {d['schedule']}, seed {d['seed']})")
    print("\n".join(lines), file=stream)
    if args.json:
        obj = result.to_dict()
        obj.update({"model": path, "weights": weights, "output": out, "written": written})
        write_json(args.json, obj)
    if result.interrupted:
        print(f"caffeq: interrupted: wrote the best epoch so far (epoch {result.best_epoch}) to "
              f"{display_path(out)}", file=sys.stderr)
        return 130
    return 0


__all__ = ["add_parser", "run"]
