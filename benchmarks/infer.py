"""Inference throughput: caffeq's torch module against OpenCV's cv2.dnn Caffe importer.

A ResNet-50-shaped Caffe model with random weights (written by caffeq) runs
at batch 1 and 8 on the CPU, side by side in one run, with:
  opencv        : cv2.dnn.readNetFromCaffe (opencv-python-headless < 5), the anchor
  caffeq        : model.to_torch() as built (one module per Caffe layer)
  caffeq-opt    : BatchNorm+Scale folded into convolutions, channels_last, inference_mode
  caffeq-compile: caffeq-opt under torch.compile with weight freezing (compiled before timing)
Prints images/s and the ratio to OpenCV.  Targets: caffeq's best >= 1.0x OpenCV
at batch 8 and >= 0.8x at batch 1.  With a GPU, also CUDA fp32 and fp16.

    python benchmarks/infer.py [--seconds S] [--threads N]
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def timeit(fn, seconds):
    fn()  # warm-up
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds and n >= 3:
            return dt / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    args = ap.parse_args()
    import torch

    import caffeq
    from models import resnet50_prototxt, write_model

    torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(prefix="caffeq-infer-")
    proto, weights = write_model(folder, "resnet50", resnet50_prototxt())
    try:
        import cv2
        cv2.setNumThreads(args.threads)
        cvnet = cv2.dnn.readNetFromCaffe(proto, weights)
    except (ImportError, AttributeError, Exception) as e:  # OpenCV 5 dropped the importer
        print(f"OpenCV anchor unavailable: {e}")
        cvnet = None
    model = caffeq.load(proto, weights)
    plain = model.to_torch()
    fast = model.to_torch(optimize=True)
    compiled = None if args.no_compile else model.to_torch(optimize=True, compile=True)
    rng = np.random.default_rng(0)
    print(f"ResNet-50-shaped Caffe model, CPU, {args.threads} threads, torch {torch.__version__}")
    print(f"{'batch':>6}{'contender':>16}{'images/s':>12}{'x opencv':>10}")
    for batch in [int(b) for b in args.batches.split(",")]:
        x = rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)
        rates = {}
        if cvnet is not None:
            def run_cv():
                cvnet.setInput(x)
                return cvnet.forward()
            rates["opencv"] = batch / timeit(run_cv, args.seconds)
        xt = torch.from_numpy(x)
        xcl = xt.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            rates["caffeq"] = batch / timeit(lambda: plain(xt), args.seconds)
            rates["caffeq-opt"] = batch / timeit(lambda: fast(xcl), args.seconds)
            if compiled is not None:
                compiled(xcl)  # compile outside the timing
                rates["caffeq-compile"] = batch / timeit(lambda: compiled(xcl), args.seconds)
        for name, r in rates.items():
            ratio = f"{r / rates['opencv']:.2f}" if "opencv" in rates else "-"
            print(f"{batch:6d}{name:>16}{r:12.1f}{ratio:>10}")
    if torch.cuda.is_available():
        for dtype in (torch.float32, torch.float16):
            m = model.to_torch(device="cuda", dtype=dtype, optimize=True)
            for batch in (1, 8, 64):
                x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype).contiguous(
                    memory_format=torch.channels_last)

                def run_gpu():
                    m(x)
                    torch.cuda.synchronize()
                with torch.inference_mode():
                    r = batch / timeit(run_gpu, args.seconds)
                print(f"{batch:6d}{'cuda ' + str(dtype).split('.')[-1]:>14}{r:12.1f}")
    for f in (proto, weights):
        os.unlink(f)
    os.rmdir(folder)


if __name__ == "__main__":
    main()
