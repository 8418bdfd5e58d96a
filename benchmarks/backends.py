"""The backends against each other: the default path, the ONNX export and model.py against the exact module.

For every .prototxt in a folder that caffeq loads with known input shapes (batch 1), this fills the weights at
random (`load(..., random_weights=True, batch=1)`), feeds uniform [0, 1) inputs, runs the exact layer-by-layer
module (`Model.run(..., exact=True)`) and compares every output of three other ways to run the same net with
it, relative to the largest exact value:

- `Model.run` (the default path: packed convolutions, folded BatchNorm, fused ReLUs);
- onnxruntime on the exported ONNX (`export_onnx`; the loss and accuracy outputs it leaves out are skipped);
- the standalone model.py (`export_pytorch`).

With --quantize fp16|int8|binary, the random weights are quantized first (`caffeq.quantize`) and every
backend is compared with the quantized model's exact module: the quantized ONNX and model.py must compute
what caffeq computes with the same quantized weights (a net the quantizer refuses counts as
caffeq-run).

Detection rows ([image, label, score, box...]) are compared as sets, as benchmarks/opencv_outputs.py does:
rows of equal scores come in either order, and so may change which boxes NMS keeps ("ties" when over 90%
of the rows on each side have a match; random weights give near-equal scores).  An ArgMax whose indices differ
only where the exact scores of the two picks are within the tolerance is "ties" too.  Identical files are run
once.  Each file runs in a child forked from a parent that imported torch and caffeq once; two at a time.

    python benchmarks/backends.py [FOLDER ...] [--json OUT.json] [--timeout 240] [--tolerance 1e-3]
           [--quantize fp16|int8|binary]

Prints one line per file (match, ties, DIFF with the backend, the output and the worst relative difference
or the error a backend raised, refused where a backend refuses the net in one clear line and the others
agree, or why it was not compared: caffeq-load (caffeq refuses the file, or its inputs need the dataset),
caffeq-run, crash, timeout), then the totals.  A DIFF is a lead: an ArgMax or a max pooling may pick
another of two values that differ by rounding alone.
"""
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
DEFAULT_FOLDER = os.path.join(HERE, "..", "tests", "fixtures", "realworld")

from opencv_outputs import compare  # noqa: E402  (this folder's script: the same comparison)
from per_file import load_and_run_exact, net_files, parse_options, report, run_forked, why  # noqa: E402


def _model_py_outputs(model, feeds, folder):
    """{blob: array} from the generated model.py, imported from `folder`."""
    import torch

    from caffeq.backends.pytorch_source import export_pytorch, identifier
    info = export_pytorch(model, folder)
    spec = importlib.util.spec_from_file_location("generated_model", str(Path(folder) / "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net = module.load()
    by_identifier = {identifier(b, set()): b for b in feeds}
    with torch.no_grad():
        out = net(*[torch.from_numpy(feeds[by_identifier.get(p, p)]) for p in info["inputs"]])
    if not isinstance(out, dict):
        out = {info["outputs"][0]: out}
    return {k: v.numpy() for k, v in out.items()}


def _onnx_outputs(model, feeds, path):
    import onnxruntime as ort
    model.export_onnx(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))


def _argmax_ties(model, feeds, outputs, tolerance):
    """Mark an ArgMax output (top_k 1, indices only) "ties" where every index that differs from the exact
    module's points at a score within `tolerance` (relative to the largest score) of the exact winner's: random
    weights leave near-equal scores (SegNet's within 1e-9 of each other), and rounding may pick either."""
    import numpy as np
    argmax = [o for o in outputs if "_got" in o and o.get("rel", 0.0) >= tolerance]
    if not argmax:
        return
    nodes = {model.graph.tensors[t].blob: n for n in model.graph.nodes for t in n.outputs}
    blobs = model.run(feeds, exact=True, all_blobs=True)
    for o in argmax:
        node = nodes[o["blob"]]
        if node.attrs.get("top_k") != 1 or node.attrs.get("out_max_val"):
            continue
        x = blobs[model.graph.tensors[node.inputs[0]].blob]
        got, ref = np.asarray(o["_got"]), blobs[o["blob"]]
        axis = node.attrs.get("_axis")
        if axis is None:   # Caffe's ArgMax without an axis: over each item's flattened values, top (N, 1, 1)
            x, got, ref = x.reshape(x.shape[0], -1), got.reshape(-1, 1), ref.reshape(-1, 1)
            axis = 1
        scores = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
        g = np.moveaxis(got, axis, -1).reshape(-1).astype(np.int64)
        r = np.moveaxis(ref, axis, -1).reshape(-1).astype(np.int64)
        if len(g) != len(scores) or len(r) != len(scores) or g.min() < 0 or g.max() >= scores.shape[1]:
            continue
        rows = np.nonzero(g != r)[0]
        gap = np.abs(scores[rows, g[rows]] - scores[rows, r[rows]])
        o["ties"] = bool(len(rows)) and bool((gap <= tolerance * max(float(np.abs(scores).max()), 1e-6)).all())
        o["differing_indices"] = int(len(rows))


def one_file(path, tolerance, scheme=None):
    """Compare one prototxt's backends (of its weights quantized to `scheme`, when given); never raises."""
    loaded = load_and_run_exact(path)
    if isinstance(loaded, dict):
        return loaded
    model, feeds, exact = loaded
    if scheme:
        import caffeq
        try:
            model = caffeq.quantize(model, scheme)
            exact = model.run(feeds, exact=True)
        except Exception as e:
            return {"status": "caffeq-run", "why": f"{scheme}: {why(e)}"}
    types = {model.graph.tensors[t].blob: n.type for n in model.graph.nodes for t in n.outputs}
    from caffeq.errors import CaffeqError
    outputs, failures, refusals = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        backends = (("default", lambda: model.run(feeds)),
                    ("onnx", lambda: _onnx_outputs(model, feeds, os.path.join(tmp, "model.onnx"))),
                    ("model.py", lambda: _model_py_outputs(model, feeds, os.path.join(tmp, "py"))))
        for backend, run in backends:
            try:
                got = run()
            except CaffeqError as e:   # a clean refusal (a layer ONNX cannot express, a net with no outputs)
                refusals.append({"backend": backend, "why": why(e)})
                continue
            except Exception as e:
                failures.append({"backend": backend, "why": why(e)})
                continue
            for blob, ref in exact.items():
                if blob in got:
                    entry = compare(blob, types.get(blob, ""), got[blob], ref, tolerance, zero_padded=False)
                    if entry["type"] == "ArgMax":
                        entry["_got"] = got[blob]   # for _argmax_ties, dropped before the result leaves
                    outputs.append({"backend": backend, **entry})
    _argmax_ties(model, feeds, outputs, tolerance)
    for o in outputs:
        o.pop("_got", None)
    differ = [o for o in outputs if "rel" not in o or (o["rel"] >= tolerance and not o.get("ties"))]
    status = ("DIFF" if differ or failures else "refused" if refusals
              else "ties" if any(o.get("ties") for o in outputs) else "match")
    return {"status": status, "outputs": outputs, "failures": failures, "refusals": refusals}


def _detail(result, tolerance):
    if result["status"] == "refused":
        return "; ".join(f"{f['backend']} refused: {f['why']}" for f in result["refusals"])
    if result["status"] not in ("DIFF", "ties"):
        return result.get("why", "")
    parts = [f"{f['backend']} failed: {f['why']}" for f in result.get("failures", [])]
    worst = {}
    for o in result.get("outputs", []):
        rel = o.get("rel", float("inf"))
        if (rel >= tolerance and not o.get("ties")) or result["status"] == "ties":
            key = o["backend"]
            if rel > worst.get(key, (-1.0, ""))[0]:
                worst[key] = (rel, o["blob"])
    parts += [f"{b} {blob} {rel:.3g}" for b, (rel, blob) in worst.items()]
    return "; ".join(parts)


def main(argv=None):
    args = parse_options(__doc__, DEFAULT_FOLDER, 240, argv,
                         extra=lambda ap: ap.add_argument(
                             "--quantize", choices=("fp16", "int8", "binary"),
                             help="quantize the random weights first: every backend against the quantized exact module"))
    import onnxruntime  # noqa: F401  imported once, forked per file
    import torch

    import caffeq.model  # noqa: F401
    torch.set_num_threads(1)

    results = run_forked(net_files(args.folders), one_file, (args.tolerance, args.quantize), args.timeout,
                         lambda result: _detail(result, args.tolerance))
    report(results, args.folders, args.json, "on every backend")
    return 0


if __name__ == "__main__":
    sys.exit(main())
