"""What the per-file benchmark scripts (opencv_outputs.py, backends.py) share: the distinct net files of some
folders, and running one function on each file in a child forked from a parent that imported the heavy
modules once, two at a time, with a timeout, so that a file that crashes or hangs costs that file only."""
import argparse
import glob
import hashlib
import json
import multiprocessing as mp
import os
from concurrent.futures import ThreadPoolExecutor


def parse_options(doc, default_folder, timeout, argv=None, extra=None):
    """The options every per-file script takes: folders, --timeout, --tolerance, --json; `extra(parser)`
    adds a script's own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", default=[default_folder], help="folders of .prototxt files")
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds allowed per file")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="largest relative difference that matches")
    ap.add_argument("--json", metavar="OUT", help="write per-file results and totals as JSON")
    if extra:
        extra(ap)
    return ap.parse_args(argv)


def net_files(folders):
    """The distinct .prototxt files (by content) of the folders, in name order."""
    seen, files = set(), []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.prototxt"))):
            with open(path, "rb") as f:
                digest = hashlib.sha1(f.read()).hexdigest()
            if digest not in seen:
                seen.add(digest)
                files.append(path)
    return files


def why(e):
    """One line for an exception: its type and the first line that names an error (else its first line)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
    return f"{type(e).__name__}: {next((x for x in lines if 'error' in x), lines[0])[:200]}"


def load_and_run_exact(path):
    """(model, feeds, {blob: output}) of a net with random weights at batch 1 on uniform [0, 1) inputs (seed 1),
    run by the exact layer-by-layer module; or the result saying why not ({"status": "caffeq-load" or
    "caffeq-run", "why": ...})."""
    import numpy as np

    from caffeq.model import load
    try:
        model = load(path, random_weights=True, batch=1)
    except Exception as e:
        return {"status": "caffeq-load", "why": why(e)}
    if any(s is None for s in model.inputs.values()):
        return {"status": "caffeq-load", "why": "input shapes unknown without the dataset"}
    rng = np.random.default_rng(1)
    feeds = {k: rng.uniform(0, 1, s).astype(np.float32) for k, s in model.inputs.items()}
    try:
        return model, feeds, model.run(feeds, exact=True)
    except Exception as e:
        return {"status": "caffeq-run", "why": why(e)}


def _child(one_file, path, extra, conn):
    try:
        conn.send(one_file(path, *extra))
    except BaseException as e:   # a bug here must cost one file, not the run
        conn.send({"status": "crash", "why": repr(e)[:300]})


def run_forked(files, one_file, extra, timeout, describe, workers=2):
    """[{"file": path, **one_file(path, *extra)}] for each file, each in a forked child given `timeout`
    seconds ({"status": "timeout" / "crash", "why": ...} when it gives nothing); prints one line per file,
    `describe(result)` after its status and name."""
    ctx = mp.get_context("fork")

    def run(path):
        recv, send = ctx.Pipe(False)
        proc = ctx.Process(target=_child, args=(one_file, path, extra, send))
        proc.start()
        send.close()
        result = None
        try:
            if recv.poll(timeout):
                result = recv.recv()
        except (EOFError, OSError):   # the child died before sending (a library aborted)
            pass
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if result is None:
            result = {"status": "timeout" if proc.exitcode in (None, -9) else "crash", "why": f"exit {proc.exitcode}"}
        print(f"{result['status']:<11} {os.path.basename(path)[:90]}  {describe(result)}", flush=True)
        return {"file": path, **result}

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, files))


def report(results, folders, json_path, matched):
    """Print the totals line ("N match <matched>", ties, DIFF, the other statuses) and write the JSON."""
    totals = {}
    for r in results:
        totals[r["status"]] = totals.get(r["status"], 0) + 1
    compared = sum(totals.get(k, 0) for k in ("match", "ties", "DIFF"))
    print(f"compared {compared} of {len(results)} files: {totals.get('match', 0)} match {matched}, "
          f"{totals.get('ties', 0)} match up to tied scores (detections, ArgMax), {totals.get('DIFF', 0)} differ; "
          + ", ".join(f"{k} {v}" for k, v in sorted(totals.items()) if k not in ("match", "ties", "DIFF")))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"folders": folders, "totals": totals, "results": results}, f, indent=1)
