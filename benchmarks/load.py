"""Load benchmark: caffeq's zero-copy caffemodel reader against reading the file once.

Builds a VGG16-sized caffemodel (138 M parameters, ~553 MB) with caffeq's own
writer, then, each in a fresh process so peak RSS is its own:
  read once     : one Python read of the whole file (the anchor)
  caffeq load   : caffeq.load(prototxt, weights) and touching every weight page
                  (sums every array, so all weights really were available)
  protobuf      : protobuf's parser + np.array(blob.data) per blob (for scale)
and prints time and peak-RSS ratios.  Targets: load <= 1.5x the read time,
peak RSS above the interpreter's baseline <= 1.2x the file size.

    python benchmarks/load.py [--small] [--keep DIR] [--skip-protobuf]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

CHILD = r"""
import json, sys, time
mode, proto, weights = sys.argv[1:4]
import numpy as np
import caffeq
from caffeq.io.schema import caffe_pb2

def status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])

# reset the peak-RSS mark after the imports (Linux: clear_refs 5), so the peak is the load's own
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status_kb("VmRSS")
t0 = time.perf_counter()
if mode == "read":
    with open(weights, "rb") as f:
        data = f.read()
    total = len(data)
elif mode == "caffeq":
    model = caffeq.load(proto, weights)
    total = 0.0
    for blobs in model.params.values():
        for a in blobs:
            total += float(np.add.reduce(a, axis=None, dtype=np.float64))
elif mode == "protobuf":
    net = caffe_pb2.NetParameter()
    with open(weights, "rb") as f:
        net.ParseFromString(f.read())
    arrays = [np.array(b.data, np.float32) for l in net.layer for b in l.blobs]
    total = sum(a.size for a in arrays)
dt = time.perf_counter() - t0
peak = status_kb("VmHWM")
print(json.dumps({"seconds": dt, "peak_kb": peak, "base_kb": base}))
"""


def measure(mode, proto, weights, repeat):
    best = None
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", CHILD, mode, proto, weights], capture_output=True,
                             text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if best is None or r["seconds"] < best["seconds"]:
            best = r
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a 1/16-width VGG16 for a quick run")
    ap.add_argument("--keep", metavar="DIR", help="write the model here and keep it")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-protobuf", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from models import vgg16_prototxt, write_model

    folder = args.keep or tempfile.mkdtemp(prefix="caffeq-bench-")
    os.makedirs(folder, exist_ok=True)
    text = vgg16_prototxt()
    if args.small:
        text = text.replace("num_output: 4096", "num_output: 256")
    t0 = time.perf_counter()
    proto, weights = write_model(folder, "vgg16", text)
    write_s = time.perf_counter() - t0
    size = os.path.getsize(weights)
    # warm the page cache so every contender reads from memory
    with open(weights, "rb") as f:
        while f.read(1 << 24):
            pass
    rows = {"read": measure("read", proto, weights, args.repeat),
            "caffeq": measure("caffeq", proto, weights, args.repeat)}
    if not args.skip_protobuf:
        rows["protobuf"] = measure("protobuf", proto, weights, 1)
    anchor = rows["read"]["seconds"]
    result = {"file_bytes": size, "write_seconds": write_s, "rows": {}}
    print(f"VGG16-sized caffemodel: {size / 2**20:.0f} MiB (written by caffeq in {write_s:.2f} s)")
    print(f"{'':12}{'time s':>10}{'x read':>10}{'peak RSS MiB':>15}{'x file':>10}")
    for name, r in rows.items():
        extra_mb = (r["peak_kb"] - r["base_kb"]) / 1024
        result["rows"][name] = {"seconds": r["seconds"], "time_ratio": r["seconds"] / anchor,
                                "rss_above_baseline_mb": extra_mb, "rss_ratio": extra_mb * 2**20 / size}
        print(f"{name:12}{r['seconds']:10.3f}{r['seconds'] / anchor:10.2f}{extra_mb:15.0f}"
              f"{extra_mb * 2**20 / size:10.2f}")
    c = result["rows"]["caffeq"]
    print(f"targets: load <= 1.5x read ({'met' if c['time_ratio'] <= 1.5 else 'MISSED'}), "
          f"peak RSS <= 1.2x file ({'met' if c['rss_ratio'] <= 1.2 else 'MISSED'})")
    if args.json:
        print(json.dumps(result))
    if not args.keep:
        for f in (proto, weights):
            os.unlink(f)
        os.rmdir(folder)


if __name__ == "__main__":
    main()
