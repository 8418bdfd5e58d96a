"""`caffeq run`: run a model on inputs from .npy/.npz and save the outputs."""
import os
import sys

import numpy as np

from ..errors import DataError
from .common import add_model_args, atomic_output, load_model


def add_parser(sub):
    p = sub.add_parser("run", help="run a model on .npy/.npz inputs, write outputs to .npz",
                       description="Run the net with PyTorch. A .npy feeds the single input; a .npz "
                                   "feeds inputs by Caffe blob name. The output .npz holds the net "
                                   "outputs by blob name, or every blob with --all-blobs.")
    add_model_args(p)
    p.add_argument("--input", "-i", required=True, metavar="X.npy|X.npz", help="input array(s)")
    p.add_argument("--output", "-o", required=True, metavar="OUT.npz", help="where to write the outputs")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (CUDA when available)")
    p.add_argument("--batch-size", type=int, default=None, help="run in chunks of this many items")
    p.add_argument("--all-blobs", action="store_true",
                   help="save every blob (a blob rewritten in place: its final value, as Caffe shows it)")
    p.add_argument("--exact", action="store_true",
                   help="run layer by layer in Caffe's order of operations (default: BatchNorm/Scale "
                        "folded, channels_last; equal within 1e-5 relative). --all-blobs implies it")
    p.add_argument("--compile", action="store_true", help="torch.compile with weight freezing (large inputs)")
    p.add_argument("--to", default="fp32", choices=["fp32", "fp16", "int8", "binary"],
                   help="quantize weights first (fp16 computes in fp16 on CUDA, fp32 on CPU)")
    p.add_argument("--keep", default=None, help="with --to binary: layers kept fp32 (none or NAME,...)")
    return p


def read_inputs(path):
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a numpy .npy/.npz file: {e}") from None


def run(args):
    model = load_model(args)
    if args.to != "fp32":
        from ..quant import quantize
        keep = None if args.keep is None else ("none" if args.keep == "none" else args.keep.split(","))
        model = quantize(model, args.to, keep=keep)
    inputs = read_inputs(args.input)
    if args.batch_size is not None and args.batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {args.batch_size}")
    dtype = None
    if args.to == "fp16" and args.device != "cpu":
        import torch

        from ..backends.torch_backend import resolve_device
        if resolve_device(args.device).type == "cuda":
            dtype = torch.float16
    outputs = model.run(inputs, device=args.device, all_blobs=args.all_blobs, batch_size=args.batch_size,
                        dtype=dtype, exact=args.exact, compile=args.compile)
    with atomic_output(args.output, inputs=(args.model, args.input, getattr(args, "weights", None))) as f:
        np.savez(f, **outputs)
    print(f"wrote {args.output}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in outputs.items()),
          file=sys.stderr if args.output == "-" else sys.stdout)
    return 0
