"""Convert benchmark: caffemodel -> ONNX against reading the file once; ONNX runtime throughput.

1. Builds a VGG16-sized caffemodel (138 M parameters, ~553 MB) with caffeq's
   writer, then, each in a fresh process so that its peak RSS is its own:
     read once : the file read once in 1 MiB chunks (`cat > /dev/null`; the anchor)
     convert   : caffeq.load(prototxt, weights) + export_onnx (with the checker)
   and prints time and peak-RSS ratios.  Targets: convert <= 3x the read time,
   peak RSS above the interpreter's baseline <= 2.5x the file size.
2. Exports a ResNet-50-shaped model and reports the images/s of onnxruntime
   (CPU) beside the torch module's (as loaded, and after caffeq.transforms.optimize
   folds BatchNorm/Scale the way the ONNX export does) and, when cv2 is
   importable, OpenCV's dnn reading the same prototxt + caffemodel.  All in one
   run, same threads.

    python benchmarks/convert.py [--small] [--keep DIR] [--repeat N] [--threads N] [--json]

Not a test: it prints numbers (and met/MISSED against the targets).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

CHILD = r"""
import json, os, resource, sys, time
mode, proto, weights, out = sys.argv[1:5]


def peak_kb():
    # VmHWM is this process image's own peak; ru_maxrss would include the parent's at fork
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


if mode == "convert":
    import caffeq
    import onnx, onnx.checker, onnx.shape_inference  # imports are not conversion work
    from caffeq.backends.onnx_backend import export_onnx
base = peak_kb()
t0 = time.perf_counter()
if mode == "read":
    buf = bytearray(1 << 20)
    total = 0
    with open(weights, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            total += n
elif mode == "convert":
    model = caffeq.load(proto, weights)
    stats = export_onnx(model, out)
    total = stats["file_size"]
dt = time.perf_counter() - t0
peak = peak_kb()
print(json.dumps({"seconds": dt, "peak_kb": peak, "base_kb": base, "bytes": total}))
"""


def measure(mode, proto, weights, out, repeat):
    best = None
    for _ in range(repeat):
        res = subprocess.run([sys.executable, "-c", CHILD, mode, proto, weights, out],
                             capture_output=True, text=True, check=False)
        if res.returncode:
            sys.exit(f"{mode} failed:\n{res.stderr}")
        r = json.loads(res.stdout.strip().splitlines()[-1])
        if best is None or r["seconds"] < best["seconds"]:
            best = r
        if os.path.exists(out):
            os.unlink(out)
    return best


def warm(path):
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def convert_bench(folder, small, repeat):
    from models import vgg16_prototxt, write_model
    text = vgg16_prototxt()
    if small:
        text = text.replace("num_output: 4096", "num_output: 256")
    t0 = time.perf_counter()
    proto, weights = write_model(folder, "vgg16", text)
    write_s = time.perf_counter() - t0
    size = os.path.getsize(weights)
    out = os.path.join(folder, "vgg16.onnx")
    warm(weights)  # every contender reads from the page cache
    rows = {"read once": measure("read", proto, weights, out, repeat),
            "convert": measure("convert", proto, weights, out, repeat)}
    anchor = rows["read once"]["seconds"]
    print(f"VGG16-sized caffemodel: {size / 2**20:.0f} MiB (written in {write_s:.2f} s)")
    print(f"{'':12}{'time s':>10}{'x read':>10}{'peak RSS MiB':>15}{'above base':>12}{'x file':>10}")
    result = {"file_bytes": size, "rows": {}}
    for name, r in rows.items():
        extra = (r["peak_kb"] - r["base_kb"]) * 1024
        result["rows"][name] = {"seconds": r["seconds"], "time_ratio": r["seconds"] / anchor,
                                "peak_rss_mb": r["peak_kb"] / 1024,
                                "rss_above_baseline_mb": extra / 2**20, "rss_ratio": extra / size}
        print(f"{name:12}{r['seconds']:10.3f}{r['seconds'] / anchor:10.2f}{r['peak_kb'] / 1024:15.0f}"
              f"{extra / 2**20:12.1f}{extra / size:10.2f}")
    print("(peak RSS: VmHWM of the process; x file: peak above the baseline after imports / file size)")
    c = result["rows"]["convert"]
    print(f"targets: convert <= 3x read ({'met' if c['time_ratio'] <= 3 else 'MISSED'}), "
          f"peak RSS <= 2.5x file ({'met' if c['rss_ratio'] <= 2.5 else 'MISSED'})")
    return result


def _rates(runners, batch, rounds=3, seconds=1.5, warmup=3):
    """images/s of each runner: best of `rounds` timed slices, taken in turn so that a busy
    machine slows every contender alike."""
    for fn in runners.values():
        for _ in range(warmup):  # allocations, oneDNN primitive creation, arena growth
            fn()
    best = dict.fromkeys(runners, 0.0)
    for _ in range(rounds):
        for name, fn in runners.items():
            runs, t0 = 0, time.perf_counter()
            while runs < 2 or time.perf_counter() - t0 < seconds:
                fn()
                runs += 1
            best[name] = max(best[name], runs * batch / (time.perf_counter() - t0))
    return best


def throughput_bench(folder, small, threads, batch):
    import numpy as np
    import onnxruntime as ort
    import torch
    from models import resnet50_prototxt, write_model

    import caffeq
    from caffeq.backends.onnx_backend import export_onnx

    text = resnet50_prototxt(batch)
    if small:
        text = text.replace("224", "112")
        text = text.replace("kernel_size: 7 stride: 1", "kernel_size: 4 stride: 1")
    proto, weights = write_model(folder, "resnet50", text)
    model = caffeq.load(proto, weights)
    out = os.path.join(folder, "resnet50.onnx")
    stats = export_onnx(model, out)
    shape = model.inputs["data"]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    torch.set_num_threads(threads)
    module = model.to_torch()
    module.eval()
    xt = torch.from_numpy(x)

    def run_torch():
        with torch.inference_mode():
            module(xt)

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(out, so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name

    def run_ort():
        sess.run(None, {name: x})

    ref = module(xt).detach().numpy()
    got = sess.run(None, {name: x})[0]
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    from caffeq.transforms import optimize
    folded = optimize(model).to_torch()
    folded.eval()

    def run_folded():
        with torch.inference_mode():
            folded(xt)

    runners = {"onnxruntime": run_ort, "torch": run_torch, "torch, folded": run_folded}
    try:
        import cv2
        net = cv2.dnn.readNetFromCaffe(proto, weights)
        net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        cv2.setNumThreads(threads)

        def run_cv():
            net.setInput(x)
            net.forward()
        runners["opencv dnn"] = run_cv
    except ImportError:
        print("(cv2 not importable: OpenCV row skipped)")
    rows = _rates(runners, batch)
    print(f"ResNet-50-shaped model {list(shape)}, {threads} thread(s), ONNX nodes "
          f"{stats['nodes_before']} -> {stats['nodes_after']} after optimization, "
          f"onnxruntime vs torch max rel. diff {err:.1e}")
    print(f"{'':14}{'images/s':>10}{'x torch':>10}")
    for k, v in rows.items():
        print(f"{k:14}{v:10.1f}{v / rows['torch']:10.2f}")
    return {"images_per_s": rows, "rel_diff": err, "nodes_before": stats["nodes_before"],
            "nodes_after": stats["nodes_after"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="1/16-width VGG16 fcs and a 112x112 ResNet-50")
    ap.add_argument("--keep", metavar="DIR", help="write the models here and keep them")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--batch", type=int, default=1, help="ResNet-50 batch for the throughput part")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="caffeq-bench-")
    os.makedirs(folder, exist_ok=True)
    try:
        result = {"convert": convert_bench(folder, args.small, args.repeat)}
        if not args.skip_throughput:
            print()
            result["throughput"] = throughput_bench(folder, args.small, args.threads, args.batch)
        if args.json:
            print(json.dumps(result))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
