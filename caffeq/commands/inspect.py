"""`caffeq inspect`: layers, shapes, parameters and multiply-accumulates of a model."""
import math
import os
import sys

from ..errors import ParseError
from ..layers.registry import Layer
from .common import check_output, format_bytes, format_count, load_model, write_json
from .options import add_json_arg, add_model_args, add_no_output_arg, report_stream


def add_parser(sub):
    p = sub.add_parser("inspect", help="show layers, shapes, parameter counts and MACs",
                       description="Print a table of the net: layer, type, bottoms -> tops, output "
                                   "shapes, parameters and multiply-accumulates, with totals.")
    add_model_args(p)
    add_json_arg(p, "the summary")
    add_no_output_arg(p, "it writes the summary with --json FILE (convert writes models)")
    p.add_argument("--onnx", metavar="MODEL.onnx", help="also count the nodes of an exported ONNX file")
    return p


def _shape_list(shape):
    return None if shape is None else list(shape)   # None: only the missing dataset could tell


def summarize(model):
    """The listing as a dict; shapes (and the parameters and MACs that need them) are None where the
    dataset a data layer reads was needed to know them."""
    g = model.graph
    layers, unknown = [], []
    total_params = total_macs = 0
    for node in g.nodes:
        in_shapes = [g.tensors[t].shape for t in node.inputs]
        out_shapes = [g.tensors[t].shape for t in node.outputs]
        known = all(s is not None for s in in_shapes + out_shapes)
        shapes = node.expected_param_shapes
        if shapes is None and not known and type(node.spec).param_shapes is not Layer.param_shapes:
            params = None           # its blobs' shapes follow the input's, which the dataset would tell
            unknown.append(node.name)
        else:
            params = sum(math.prod(s) for i, s in enumerate(shapes or []) if i not in node.shared_from)
        try:
            macs = int(node.spec.macs(node.attrs, in_shapes, out_shapes)) if known else 0
        except Exception:  # an estimate only; never fail the listing for it
            macs = 0
        total_params += params or 0
        total_macs += macs
        layers.append({
            "name": node.name, "type": node.type, "bottoms": list(node.bottoms), "tops": list(node.tops),
            "output_shapes": {g.tensors[t].blob: _shape_list(g.tensors[t].shape) for t in node.outputs},
            "params": params, "macs": macs,
            "weights_loaded": node.blobs is not None if node.has_params else None,
        })
    return {
        "name": g.name,
        "inputs": {k: _shape_list(v) for k, v in model.inputs.items()},
        "outputs": model.outputs,
        "layers": layers,
        "totals": {"layers": len(layers), "params": total_params, "macs": total_macs,
                   "param_bytes_fp32": 4 * total_params, "layers_with_unknown_params": unknown},
        "warnings": list(model.warnings),
        "quantization": dict(model.quantization),
        # template placeholders without values: the listing's shapes are unknown from their layers on
        "unfilled_placeholders": list(model.unfilled_placeholders),
    }


def onnx_node_counts(path):
    import onnx
    try:
        m = onnx.load(path, load_external_data=False)
    except Exception as e:
        raise ParseError(f"{path}: not an ONNX model ({type(e).__name__})") from None
    counts = {}
    for n in m.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return {"nodes": len(m.graph.node), "by_op": dict(sorted(counts.items())),
            "opset": max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=None)}


def _fmt_count(n):
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _fmt_shape(s):
    return "?" if s is None else ("x".join(map(str, s)) or "scalar")


def print_table(summary, out=sys.stdout):
    rows = [("layer", "type", "bottoms -> tops", "output shape", "params", "MACs")]
    for L in summary["layers"]:
        shapes = "; ".join(_fmt_shape(s) for s in L["output_shapes"].values())
        rows.append((L["name"], L["type"], f"{','.join(L['bottoms'])} -> {','.join(L['tops'])}",
                     shapes, "?" if L["params"] is None else (_fmt_count(L["params"]) if L["params"] else ""), _fmt_count(L["macs"]) if L["macs"] else ""))
    widths = [min(40, max(len(r[i]) for r in rows)) for i in range(len(rows[0]))]
    print(f"net '{summary['name']}': inputs "
          + ", ".join(f"{k} {_fmt_shape(v)}" for k, v in summary["inputs"].items())
          + f"; outputs {', '.join(summary['outputs'])}", file=out)
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)
    t = summary["totals"]
    # (the warnings are printed once, on stderr, when the model is loaded; the JSON keeps them)
    unknown = t["layers_with_unknown_params"]
    if unknown:
        names = ", ".join(unknown[:4]) + (", ..." if len(unknown) > 4 else "")
        if summary["unfilled_placeholders"]:
            print(f"total: {t['layers']} layers; parameters and multiply-accumulates unknown until the values a "
                  f"script or tool fills in are given: {names}; {summary['unfilled_placeholders'][0].split(': ', 1)[1]}",
                  file=out)
        else:
            print(f"total: {t['layers']} layers; parameters and multiply-accumulates unknown without the input "
                  f"shape, which neither the file nor a dataset here gives: {names}; pass --input-shape "
                  f"NAME=N,C,H,W", file=out)
        return
    print(f"total: {t['layers']} layers, {format_count(t['params'])} parameters "
          f"({format_bytes(t['param_bytes_fp32'])} as fp32), {format_count(t['macs'])} multiply-accumulates",
          file=out)


def run(args):
    check_output(args.json, "--json", (args.model, args.weights, args.onnx))   # before any work
    if args.onnx and not os.path.isfile(args.onnx):
        raise ParseError(f"--onnx {args.onnx}: no such file")
    model = load_model(args, unknown_shapes_ok=True)
    summary = summarize(model)
    if args.onnx:
        summary["onnx"] = onnx_node_counts(args.onnx)
    out = report_stream(args)      # stderr when the JSON goes to stdout
    print_table(summary, out)
    if args.onnx:
        o = summary["onnx"]
        print(f"onnx {args.onnx}: {o['nodes']} nodes (opset {o['opset']}): "
              + ", ".join(f"{k} {v}" for k, v in o["by_op"].items()), file=out)
    if args.json:
        write_json(args.json, summary)
    return 0
