"""`caffeq upgrade`: rewrite legacy (V0/V1, input_dim) nets and weights in the current format.

The counterpart of Caffe's upgrade_net_proto_text and upgrade_net_proto_binary:
the same upgrade rules (caffeq.io.upgrade), both files written atomically.
"""
import os
import sys

from ..errors import CaffeqError, ParseError
from ..fs import same_file
from .common import check_output, defines_arg
from .options import add_define_arg

TEXT_EXTS = (".prototxt", ".pbtxt", ".txt")
WEIGHTS_EXTS = (".caffemodel", ".binaryproto", ".caffeq", ".onnx")


def add_parser(sub):
    p = sub.add_parser(
        "upgrade", help="upgrade a legacy prototxt (and caffemodel) to the current Caffe format",
        description="Upgrade V0/V1 nets, input/input_dim headers, old data-layer transform "
                    "fields and old BatchNorm params the way Caffe's upgrade_net_proto_text / "
                    "upgrade_net_proto_binary do.")
    p.add_argument("prototxt", help="the legacy .prototxt")
    p.add_argument("--weights", "-w", help="the legacy .caffemodel to upgrade as well")
    p.add_argument("-o", "--output", required=True, help="where to write the upgraded .prototxt")
    p.add_argument("--weights-out", help="where to write the upgraded .caffemodel (with --weights)")
    p.add_argument("--ignore-unknown", action="store_true",
                   help="skip fields unknown to caffe.proto (with a warning) instead of failing")
    add_define_arg(p)
    return p


def run(args):
    from ..io.caffemodel import read_caffemodel
    from ..io.imports import expand_imports
    from ..io.prototxt import parse_prototxt_text, read_prototxt
    from ..io.upgrade import net_needs_upgrade, upgrade_net
    from ..io.writer import write_caffemodel, write_prototxt

    if args.weights and not args.weights_out:
        raise CaffeqError("--weights needs --weights-out: where to write the upgraded caffemodel")
    if args.weights_out and not args.weights:
        raise CaffeqError("--weights-out needs --weights: the caffemodel to upgrade")
    inputs = [args.prototxt] + ([args.weights] if args.weights else [])
    outputs = [args.output] + ([args.weights_out] if args.weights_out else [])
    for out in outputs:
        for src in inputs:
            if same_file(out, src):
                raise CaffeqError(f"{out}: refusing to overwrite an input file")
    if args.weights_out and same_file(args.output, args.weights_out):
        raise CaffeqError(f"{args.output}: -o and --weights-out name the same file")
    for src in inputs:
        if os.path.isdir(src):
            raise CaffeqError(f"{src}: is a folder; pass the {'.caffemodel' if src == args.weights else '.prototxt'}")
        if not os.path.isfile(src):
            raise CaffeqError(f"{src}: no such file")
    # -o is the net's text, --weights-out the binary weights: refuse the other's extension
    if os.path.splitext(args.output)[1].lower() in WEIGHTS_EXTS:
        raise CaffeqError(f"-o {args.output}: -o writes the upgraded prototxt (text); the caffemodel goes to "
                          f"--weights-out")
    if args.weights_out and os.path.splitext(args.weights_out)[1].lower() in TEXT_EXTS:
        raise CaffeqError(f"--weights-out {args.weights_out}: writes the binary caffemodel; the prototxt goes to -o")
    check_output(args.output, "-o", inputs)
    if args.weights_out:
        check_output(args.weights_out, "--weights-out", inputs)

    # Read and upgrade everything before writing anything, so a bad caffemodel leaves no half result
    warnings = []
    net = read_prototxt(args.prototxt, ignore_unknown=args.ignore_unknown, warnings=warnings,
                        defines=defines_arg(args))
    # a fork's IMPORT layers are inlined: the upgraded file stands alone
    expand_imports(net, args.prototxt, lambda text, where: parse_prototxt_text(
        text, path=where, ignore_unknown=args.ignore_unknown, warnings=warnings, defines=defines_arg(args)), warnings)
    if not net.layer and not net.layers and not net.input:
        raise ParseError(f"{args.prototxt}: the net has no layers (an empty or commented-out prototxt?)")
    for w in warnings:
        print(f"caffeq: warning: {w}", file=sys.stderr)
    text_needed = net_needs_upgrade(net)
    text_notes = upgrade_net(net, source=args.prototxt)
    cm = None
    if args.weights:
        cm = read_caffemodel(args.weights)
        for note in cm.notes:   # those layers are written with their core fields only
            print(f"caffeq: warning: {note}", file=sys.stderr)
        bin_needed = net_needs_upgrade(cm.net)
        bin_notes = upgrade_net(cm.net, source=args.weights, weights=cm.blobs)

    # relative data paths keep pointing at the same files from the new prototxt's folder
    write_prototxt(net, args.output, inputs=inputs,
                   source_dir=os.path.dirname(os.path.abspath(args.prototxt)))
    _report(args.prototxt, args.output, text_needed, text_notes, f"{len(net.layer)} layers")
    if cm is not None:
        write_caffemodel(cm.net, cm.blobs, args.weights_out, inputs=inputs)
        nblobs = sum(len(v) for v in cm.blobs.values())
        _report(args.weights, args.weights_out, bin_needed, bin_notes,
                f"{len(cm.net.layer)} layers, {nblobs} blobs")
    return 0


def _report(src, dst, needed, notes, what):
    print(f"{src}:")
    if not needed:
        print("  already in the current format; written unchanged")
    for note in notes:
        # notes that name the file already say where; indent them under it
        prefix = f"{src}: "
        print(f"  {note.removeprefix(prefix)}")
    print(f"  wrote {dst} ({what})")
