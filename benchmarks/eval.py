"""Eval throughput: end to end (worker processes read, decode and transform) against the model alone.

An LMDB of JPEG-encoded Datum records (256x256 colour, as convert_imageset
-encoded writes them) feeds a ResNet-50-shaped Caffe model (random weights)
with Caffe's TEST preprocessing (centre crop 224, mean_value, scale):

  model-only : caffeq.evaluate.Runner.step on the same batches, preloaded on the device
  end-to-end : caffeq.evaluate.evaluate with --workers processes (LMDB -> decode -> crop ->
               pinned batch -> device -> mean/scale -> model -> metrics)

and prints images/s and their ratio.  Target: end-to-end >= 0.9x model-only (the data
pipeline is never the bottleneck), on CPU, and on CUDA when a GPU is available.

    python benchmarks/eval.py [--device cpu|cuda|all] [--images N] [--workers W] [--batch-size B]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

TRANSFORM = {"crop_size": 224, "mean_value": [104.0, 117.0, 123.0], "scale": 0.017}


def write_jpeg_lmdb(path, n, size=256, seed=0):
    """n encoded Datum records: smooth colour images with noise (JPEG, like real photos' sizes)."""
    import cv2
    import lmdb

    from caffeq.io.schema import caffe_pb2
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    base = []
    for k in range(16):   # a few distinct images, re-noised per record
        a, b, c = rng.uniform(0, 6, 3)
        img = np.stack([np.sin(a * xx + b * yy), np.cos(b * xx - c * yy), np.sin(c * xx * yy + a)], -1)
        base.append((img * 100 + 128).astype(np.float32))
    env = lmdb.open(path, map_size=max(1 << 28, n * 64 * 1024))
    with env.begin(write=True) as txn:
        for i in range(n):
            img = np.clip(base[i % 16] + rng.normal(0, 8, (size, size, 3)), 0, 255).astype(np.uint8)
            _, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
            d = caffe_pb2.Datum()
            d.data, d.encoded, d.label = buf.tobytes(), True, int(rng.integers(0, 1000))
            txn.put(f"{i:08d}".encode(), d.SerializeToString())
    env.close()


def model_only(proto, weights, data, device, batch_size, workers, n):
    """images/s of the model side alone, on the batches the evaluation would see."""
    import torch

    import caffeq
    from caffeq.backends.torch_backend import resolve_device
    from caffeq.data import worker_init
    from caffeq.data.plan import build_dataset, plan_data
    from caffeq.evaluate import Runner
    dev = resolve_device(device)
    model = caffeq.load(proto, weights)
    plan = plan_data(None, model.inputs, os.getcwd(), data, batch_size=batch_size, transform=TRANSFORM)
    dataset = build_dataset(plan, limit=n)
    runner = Runner(model, plan, ["fp32"], dev, has_labels=dataset.has_labels)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                         collate_fn=runner.collate(), worker_init_fn=worker_init)
    batches = [(b["data"].to(dev), b["label"].to(dev)) for b in loader]
    with torch.inference_mode():
        runner.step(*batches[0])      # warm-up (cuDNN autotuning, allocator)
        runner.sync()
        t0 = time.perf_counter()
        for x, labels in batches:
            runner.step(x, labels)
        runner.sync()
        dt = time.perf_counter() - t0
    return sum(int(x.shape[0]) for x, _ in batches) / dt


def end_to_end(proto, weights, data, device, batch_size, workers, n):
    from caffeq.evaluate import evaluate
    kw = {"weights": weights, "data": data, "transform": TRANSFORM, "batch_size": batch_size,
          "device": device, "workers": workers}
    evaluate(proto, limit=2 * batch_size, **kw)          # warm-up in this process (cuDNN, allocator)
    r = evaluate(proto, limit=n, **kw)
    return r["images"] / r["elapsed_s"], r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="all", choices=["cpu", "cuda", "all"])
    ap.add_argument("--images", type=int, default=None, help="images per run (default: 256 CPU, 8192 CUDA)")
    ap.add_argument("--workers", type=int, default=None, help="loader processes (default: min(8, CPUs - 1))")
    ap.add_argument("--batch-size", type=int, default=None, help="default: 32 CPU, 128 CUDA")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    import torch
    from models import resnet50_prototxt, write_model
    if args.threads:
        torch.set_num_threads(args.threads)
    workers = args.workers if args.workers is not None else max(1, min(8, (os.cpu_count() or 2) - 1))
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        print("no CUDA device: CPU only")
        devices.remove("cuda")
    folder = tempfile.mkdtemp(prefix="caffeq-evalbench-")
    try:
        proto, weights = write_model(folder, "resnet50", resnet50_prototxt())
        sizes = {d: args.images or (8192 if d == "cuda" else 256) for d in devices}
        db = os.path.join(folder, "val_lmdb")
        t0 = time.perf_counter()
        write_jpeg_lmdb(db, max(sizes.values()))
        print(f"ResNet-50-shaped model, {max(sizes.values())} JPEG datums 256x256 written in "
              f"{time.perf_counter() - t0:.1f}s; {workers} workers, torch {torch.__version__}, "
              f"{torch.get_num_threads()} CPU threads, {os.cpu_count()} CPUs")
        print(f"{'device':>7}{'batch':>7}{'images':>8}{'model-only/s':>14}{'end-to-end/s':>14}{'ratio':>8}")
        worst = None
        for dev in devices:
            bs = args.batch_size or (128 if dev == "cuda" else 32)
            n = sizes[dev]
            mo = model_only(proto, weights, db, dev, bs, workers, n)
            e2e, r = end_to_end(proto, weights, db, dev, bs, workers, n)
            ratio = e2e / mo
            worst = ratio if worst is None else min(worst, ratio)
            print(f"{dev:>7}{bs:7d}{r['images']:8d}{mo:14.1f}{e2e:14.1f}{ratio:8.2f}")
        if worst is not None:
            print(f"{'PASS' if worst >= 0.9 else 'BELOW TARGET'}: end-to-end / model-only >= 0.9 "
                  f"(worst {worst:.2f})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
