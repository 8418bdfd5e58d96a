"""Second opinion on the outputs: caffeq against OpenCV's forward on real-world net definitions.

For every .prototxt in a folder that caffeq loads with known input shapes, this fills the weights at
random (`load(..., random_weights=True, batch=1)`), writes them as a caffemodel with caffeq's own
writer, feeds the same uniform [0, 1) inputs to caffeq's exact layer-by-layer module and to OpenCV 4's
`cv2.dnn.readNetFromCaffe(prototxt, caffemodel)` (its own CPU backend, layer fusion off), and compares
every output both produce, relative to the largest OpenCV value.  Detection rows ([image, label, score,
box...], 7 columns or more) are compared as sets: OpenCV pads with zero rows where Caffe writes one row
of -1, and rows of equal scores come in either order, which in NMS may keep other boxes and change the
count ("ties" when over 90% of the rows on each side have a match, counts that differ only with more
than 20 rows a side; random weights give near-equal scores).  Identical files are run once.

Each file runs in a child forked from a parent that imported torch, OpenCV and caffeq once (OpenCV may
abort on a file); two at a time.

    python benchmarks/opencv_outputs.py [FOLDER ...] [--json OUT.json] [--timeout 120] [--tolerance 1e-3]

Prints one line per file (match, ties, DIFF with the worst relative difference, or why it was not
compared: caffeq-load, caffeq-run, cv-read, cv-run, not-compared (no output is a layer's first top, the only
ones OpenCV names), crash, timeout), then the totals.  A DIFF is a
lead, not a verdict: OpenCV departs from Caffe in places (README, "Second opinion").
"""
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
DEFAULT_FOLDER = os.path.join(HERE, "..", "tests", "fixtures", "realworld")

from per_file import load_and_run_exact, net_files, parse_options, report, run_forked, why  # noqa: E402  (this folder's helper)


def _detections(q, c, zero_padded):
    """(ours, theirs) rows of an [image, label, score, box...] output (7 columns, or more where a fork adds
    quadrilaterals), "none" rows (label -1) dropped, and theirs' padding rows of zeros where zero_padded
    (OpenCV's)."""
    import numpy as np
    width = q.shape[-1]
    q, c = q.reshape(-1, width), c.reshape(-1, width)
    return q[q[:, 1] >= 0], c[np.any(c != 0, axis=1)] if zero_padded else c[c[:, 1] >= 0]


def _detection_rows(layer_type):
    """Whether a layer type writes [image, label, score, box...] rows (CenterGridOutput's add landmarks)."""
    return "Detection" in layer_type or layer_type == "CenterGridOutput"


def _nearest(rows, others, scale):
    """For each row, the distance to the nearest of `others`: the largest column difference over `scale`
    (in blocks, so that 20000 rows a side stay within memory)."""
    import numpy as np
    out = np.empty(len(rows))
    for i in range(0, len(rows), 256):
        out[i:i + 256] = (np.abs(rows[i:i + 256, None, :] - others[None]) / scale).max(-1).min(1)
    return out


def compare(blob, layer_type, ours, theirs, tolerance, zero_padded=True):
    """{blob, type, rel or the two shapes, tie flag} for one output; zero_padded: theirs pads detections
    with rows of zeros, as OpenCV does (else with caffeq's one row of -1)."""
    import numpy as np
    q, c = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    detections = bool(_detection_rows(layer_type) and q.ndim and c.ndim)
    if detections and q.shape[-1] >= 7 and c.shape[-1] == q.shape[-1]:
        q, c = _detections(q, c, zero_padded)
        # counts that differ are compared as sets only with more than 20 rows a side: a tied box kept in
        # another order suppresses other boxes in NMS, so ties can change the count too
        if 0 < len(q) <= 20000 and 0 < len(c) <= 20000 and (len(q) == len(c) or min(len(q), len(c)) > 20):
            scale = np.maximum(np.abs(c).max(0), 1e-6)   # per column: labels, scores and boxes apart
            ours_near, theirs_near = _nearest(q, c, scale), _nearest(c, q, scale)   # each side's rows against the other's
            rel = float(max(ours_near.max(), theirs_near.max())) if len(q) == len(c) else float("inf")
            tie = (rel >= tolerance and float((ours_near < tolerance).mean()) > 0.9
                   and float((theirs_near < tolerance).mean()) > 0.9)
            rows = {"rows": len(q)} if len(q) == len(c) else {"rows": len(q), "other_rows": len(c)}
            return {"blob": blob, "type": layer_type, "rel": rel, **rows, "ties": tie}
    if q.size != c.size or (detections and q.shape[-1] != c.shape[-1]):
        return {"blob": blob, "type": layer_type, "shape": list(q.shape), "opencv_shape": list(c.shape)}
    q, c = q.reshape(-1), c.reshape(-1)
    if not q.size:
        return {"blob": blob, "type": layer_type, "rel": 0.0}
    if not np.array_equal(np.isnan(q), np.isnan(c)) or not np.array_equal(q[np.isinf(q)], c[np.isinf(q)]):
        return {"blob": blob, "type": layer_type, "rel": float("inf")}
    finite = np.isfinite(q) & np.isfinite(c)
    if not finite.any():
        return {"blob": blob, "type": layer_type, "rel": 0.0}
    rel = float(np.abs(q[finite] - c[finite]).max() / max(float(np.abs(c[finite]).max()), 1e-6))
    return {"blob": blob, "type": layer_type, "rel": rel}


def one_file(path, tolerance):
    """Compare one prototxt; never raises."""
    import cv2

    from caffeq.io.writer import write_model_caffemodel
    loaded = load_and_run_exact(path)
    if isinstance(loaded, dict):
        return loaded
    model, feeds, ours = loaded
    producer = {}
    for node in model.graph.nodes:
        for i, t in enumerate(node.outputs):
            producer[model.graph.tensors[t].blob] = (node.name, i, node.type)
    # OpenCV names a layer's first output by the layer's name
    wanted = [(b,) + producer[b] for b in model.outputs if b in producer and producer[b][1] == 0]
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "random.caffemodel")
        try:
            write_model_caffemodel(model, weights)
            net = cv2.dnn.readNetFromCaffe(path, weights)
        except Exception as e:
            return {"status": "cv-read", "why": why(e)}
        net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        net.enableFusion(False)
        try:
            for name, value in feeds.items():
                net.setInput(value, name)
            theirs = net.forward([layer for _, layer, _, _ in wanted]) if wanted else []
        except Exception as e:
            return {"status": "cv-run", "why": why(e)}
    outputs = [compare(b, t, ours[b], c, tolerance) for (b, _, _, t), c in zip(wanted, theirs)]
    if not outputs:   # OpenCV names only a layer's first top
        return {"status": "not-compared", "why": f"no output is a layer's first top: {model.outputs[:3]}"}
    differ = [o for o in outputs if "rel" not in o or (o["rel"] >= tolerance and not o.get("ties"))]
    status = "DIFF" if differ else "ties" if any(o.get("ties") for o in outputs) else "match"
    return {"status": status, "outputs": outputs}


def main(argv=None):
    args = parse_options(__doc__, DEFAULT_FOLDER, 120, argv)
    import cv2  # noqa: F401  imported once, forked per file
    import torch

    import caffeq.model  # noqa: F401
    torch.set_num_threads(1)
    cv2.setNumThreads(1)

    def describe(result):
        worst = max((o.get("rel", float("inf")) for o in result.get("outputs", [])), default=0.0)
        return f"{worst:.3g}" if result["status"] in ("DIFF", "ties") else result.get("why", "")

    results = run_forked(net_files(args.folders), one_file, (args.tolerance,), args.timeout, describe)
    report(results, args.folders, args.json, "OpenCV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
