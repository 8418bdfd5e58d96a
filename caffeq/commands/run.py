"""`caffeq run`: run a model on inputs from .npy/.npz and save the outputs."""
import os

import numpy as np

from ..data.arrays import load_arrays
from ..errors import DataError
from .common import atomic_output, check_output, input_shapes_arg, keep_needs_a_target, layer_names_arg, load_model
from .options import add_batch_size_arg, add_device_arg, add_keep_arg, add_model_args, add_speed_args


def add_parser(sub):
    p = sub.add_parser("run", help="run a model on .npy/.npz inputs, write outputs to .npz",
                       description="Run the net with PyTorch. A .npy feeds the single input; a .npz "
                                   "feeds inputs by Caffe blob name. The output .npz holds the net "
                                   "outputs by blob name, or every blob with --all-blobs.")
    add_model_args(p)
    p.add_argument("--input", "-i", required=True, metavar="X.npy|X.npz", help="input array(s)")
    p.add_argument("--output", "-o", required=True, metavar="OUT.npz",
                   help="where to write the outputs: a .npz file (another extension is refused)")
    add_device_arg(p, default="cpu")
    add_batch_size_arg(p, help="run in chunks of this many items (default: all at once)")
    p.add_argument("--all-blobs", action="store_true",
                   help="save every blob (a blob rewritten in place: its final value, as Caffe shows it)")
    add_speed_args(p)
    p.add_argument("--to", default="fp32", choices=["fp32", "fp16", "int8", "binary"],
                   help="quantize weights first (fp16 computes in fp16 on CUDA, fp32 on CPU)")
    add_keep_arg(p)
    return p


def run(args):
    inputs_files = (args.model, args.input, getattr(args, "weights", None))
    if os.path.splitext(str(args.output))[1].lower() != ".npz" and not str(args.output).endswith(("/", os.sep)) \
            and not os.path.isdir(args.output):
        # numpy's savez writes a .npz archive whatever the name; the name says so
        raise DataError(f"-o {args.output}: run writes the outputs as a .npz archive; name it OUT.npz")
    check_output(args.output, "-o", inputs_files)   # before any work
    if not os.path.exists(args.input):
        raise DataError(f"{args.input}: no such file")
    if args.keep is not None and args.to == "fp32":
        keep_needs_a_target("--keep", "--to fp32 (the default) quantizes none")
    inputs = load_arrays(args.input)
    _check_batch(args, inputs)
    model = load_model(args, weights_required=True)
    if args.to != "fp32":
        from ..quant import quantize
        model = quantize(model, args.to, keep=layer_names_arg(args.keep, "--keep"))
    dtype = None
    if args.to == "fp16" and args.device != "cpu":
        import torch

        from ..backends.torch_backend import resolve_device
        if resolve_device(args.device).type == "cuda":
            dtype = torch.float16
    outputs = model.run(inputs, device=args.device, all_blobs=args.all_blobs, batch_size=args.batch_size,
                        dtype=dtype, exact=args.exact, compile=args.compile)
    with atomic_output(args.output, inputs=(args.model, args.input, args.weights)) as f:
        np.savez(f, **outputs)
    print(f"wrote {args.output}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in outputs.items()))
    return 0


def _check_batch(args, inputs):
    """--batch and --input-shape's batch must be what the input file holds (run takes its items)."""
    asked = dict(input_shapes_arg(args))
    # a .npy feeds the net's one input: the one --input-shape given is its shape
    arrays = inputs if isinstance(inputs, dict) else {next(iter(asked), None): inputs}
    for name, arr in arrays.items():
        want = args.batch if args.batch is not None else (asked.get(name) or (None,))[0]
        if want is not None and arr.ndim and arr.shape[0] != want:
            what = f"'{name}' in {args.input}" if isinstance(inputs, dict) else args.input
            raise DataError(f"{what} holds {arr.shape[0]} items but the batch asked for is {want} "
                            f"(--batch/--input-shape); run takes the items the file holds")
