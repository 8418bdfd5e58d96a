"""Real-world corpus check: how many public Caffe net definitions caffeq reads, against OpenCV.

For every .prototxt in a folder (default /work/corpus), this does what `caffeq inspect FILE` does
without weights (read the prototxt, upgrade it, build the graph with shape inference in the TEST
phase, summarize layers / parameters / MACs) by calling the library, and, as the anchor, asks
OpenCV's `cv2.dnn.readNetFromCaffe(FILE)` to read the same file.

caffeq runs in a forked child per file so that a hang or a crash costs one file, not the run;
OpenCV runs in a fresh interpreter per file (its importer aborts the process on some inputs).
Files whose text holds no `layer` (solvers, label maps) are skipped. OpenCV's reader skips fields
its caffe.proto does not know; --ignore-unknown makes caffeq do the same (to see the next obstacle).

    python benchmarks/corpus.py [FOLDER] [--timeout 60] [--json OUT.json] [--no-opencv] [--ignore-unknown]
           [-k SUBSTR]

Prints one line per file: `caffeq ok|<first error line>`, `opencv ok|<first error line>`,
then "caffeq reads X/N, OpenCV reads Y/N".
"""
import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# the real-world files shipped with the tests; point it at a larger collection of your own
DEFAULT_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "realworld")

# run by a fresh interpreter per file: OpenCV may abort() on a file it cannot read
OPENCV_CHILD = "import sys, cv2\ncv2.dnn.readNetFromCaffe(sys.argv[1])\n"


def first_line(text, limit=300):
    for line in str(text).strip().splitlines():
        if line.strip():
            return line.strip()[:limit]
    return "(no message)"


def is_net_definition(path):
    """Solvers and label maps share the extension; a net has at least one `layer`/`layers` block."""
    with open(path, "rb") as f:
        head = f.read()
    return b"layer" in head


class InspectRefused(Exception):
    """inspect refused the file with one clear error line and exit status 2."""


def caffeq_read(path, ignore_unknown=False):
    """Run `caffeq inspect FILE --json OUT` in this process, exactly as a user would (no weights
    beside a corpus file). Returns a small summary dict; raises CaffeqError-like failures."""
    import contextlib
    import io
    import json
    import tempfile

    from caffeq.__main__ import main as caffeq_main
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        argv = ["inspect", path, "--json", out] + (["--ignore-unknown"] if ignore_unknown else [])
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            rc = caffeq_main(argv)
        if rc != 0:
            errors = [ln for ln in stderr.getvalue().splitlines() if ln.startswith("caffeq: error: ")]
            # a clean refusal is exit 2 with one error line; anything else is counted as unclean
            raise (InspectRefused if rc == 2 and len(errors) == 1 else RuntimeError)(
                first_line((errors or [stderr.getvalue()])[0].replace("caffeq: error: ", "")))
        with open(out) as f:
            summary = json.load(f)
    return {"layers": summary["totals"]["layers"], "params": summary["totals"]["params"],
            "inputs": summary["inputs"], "warnings": summary["warnings"]}


def _caffeq_child(path, options, conn):
    try:
        result = {"ok": True, "summary": caffeq_read(path, **options)}
    except Exception as e:  # noqa: BLE001 -- every failure is data here: the parent groups them
        from caffeq.errors import CaffeqError
        kind = type(e).__name__
        clean = isinstance(e, (CaffeqError, InspectRefused))
        result = {"ok": False, "kind": kind, "clean": clean,
                  "error": first_line(str(e) if clean else f"{kind}: {e}"),
                  "message": str(e)[:4000]}
        if not clean:
            result["traceback"] = traceback.format_exc()[-3000:]
    conn.send(result)
    conn.close()


def run_caffeq(path, timeout, **options):
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_caffeq_child, args=(path, options, child))
    t0 = time.perf_counter()
    proc.start()
    child.close()
    result = None
    if parent.poll(timeout):
        try:
            result = parent.recv()
        except EOFError:
            result = None
    proc.join(1 if result is not None else 0)
    if proc.is_alive():
        proc.kill()
        proc.join()
        if result is None:
            result = {"ok": False, "kind": "Timeout", "clean": False, "error": f"timed out after {timeout}s"}
    if result is None:
        result = {"ok": False, "kind": "Crash", "clean": False,
                  "error": f"worker died with exit code {proc.exitcode}"}
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def run_opencv(path, timeout):
    t0 = time.perf_counter()
    try:
        # OpenCV echoes a file's bytes in its messages: not always UTF-8 (GBK comments)
        p = subprocess.run([sys.executable, "-c", OPENCV_CHILD, path], check=False, capture_output=True,
                           text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout}s", "seconds": timeout}
    dt = round(time.perf_counter() - t0, 3)
    if p.returncode == 0:
        return {"ok": True, "seconds": dt}
    err = p.stderr.strip()
    # cv2.error's text: the useful part is the line naming the reason, after the "error: (-2...)" header
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    reason = next((ln for ln in lines if "error:" in ln and "Traceback" not in ln), None)
    if reason is None:
        reason = lines[-1] if lines else f"exit code {p.returncode}"
    return {"ok": False, "error": reason[:300], "returncode": p.returncode, "seconds": dt}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default=DEFAULT_FOLDER, help="folder of .prototxt files")
    ap.add_argument("--timeout", type=float, default=60, help="seconds allowed per file and reader")
    ap.add_argument("--json", metavar="OUT", help="write per-file results and totals as JSON")
    ap.add_argument("--no-opencv", action="store_true", help="skip the OpenCV anchor")
    ap.add_argument("--ignore-unknown", action="store_true",
                    help="skip fields unknown to caffe.proto, as OpenCV's reader does (caffeq --ignore-unknown)")
    ap.add_argument("-k", metavar="SUBSTR", help="only files whose name contains SUBSTR")
    args = ap.parse_args(argv)

    if not os.path.isdir(args.folder):
        print(f"corpus.py: {args.folder}: not a folder", file=sys.stderr)
        return 2
    files = sorted(f for f in os.listdir(args.folder) if f.endswith(".prototxt"))
    if args.k:
        files = [f for f in files if args.k in f]
    files = [f for f in files if is_net_definition(os.path.join(args.folder, f))]
    have_cv2 = not args.no_opencv
    if have_cv2:
        probe = subprocess.run([sys.executable, "-c", "import cv2; print(cv2.__version__)"],
                               check=False, capture_output=True, text=True)
        have_cv2 = probe.returncode == 0
        cv_version = probe.stdout.strip() if have_cv2 else None
        if not have_cv2:
            print("corpus.py: cv2 cannot be imported; OpenCV column skipped", file=sys.stderr)
    # import the library once in the parent so each forked worker starts warm
    import caffeq.__main__  # noqa: F401

    results = []
    width = min(70, max((len(f) for f in files), default=10))
    for name in files:
        path = os.path.join(args.folder, name)
        cq = run_caffeq(path, args.timeout, ignore_unknown=args.ignore_unknown)
        cv = run_opencv(path, args.timeout) if have_cv2 else None
        results.append({"file": name, "caffeq": cq, "opencv": cv})
        cq_text = "ok" if cq["ok"] else cq["error"]
        line = f"{name[:width].ljust(width)}  caffeq {cq_text}"
        if cv is not None:
            line += f"  |  opencv {'ok' if cv['ok'] else cv['error']}"
        print(line, flush=True)

    n = len(results)
    cq_ok = sum(r["caffeq"]["ok"] for r in results)
    totals = {"files": n, "caffeq_ok": cq_ok, "ignore_unknown": args.ignore_unknown}
    summary_line = f"caffeq reads {cq_ok}/{n}"
    if have_cv2:
        cv_ok = sum(r["opencv"]["ok"] for r in results)
        both = sum(r["opencv"]["ok"] and r["caffeq"]["ok"] for r in results)
        cv_only = [r["file"] for r in results if r["opencv"]["ok"] and not r["caffeq"]["ok"]]
        totals.update(opencv_ok=cv_ok, both_ok=both, opencv_only=cv_only, opencv_version=cv_version)
        summary_line += f", OpenCV reads {cv_ok}/{n}"
    unclean = [r["file"] for r in results if not r["caffeq"]["ok"] and not r["caffeq"].get("clean")]
    totals["caffeq_unclean_failures"] = unclean
    print(summary_line)
    if have_cv2 and totals["opencv_only"]:
        print(f"read by OpenCV but not caffeq: {len(totals['opencv_only'])}")
    if unclean:
        print(f"caffeq failures that are not a CaffeqError (tracebacks, timeouts, crashes): {len(unclean)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"folder": os.path.abspath(args.folder), "totals": totals, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
