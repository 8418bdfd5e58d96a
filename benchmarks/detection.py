"""YOLOv3's detection output on the CPU: caffeq's forward against onnxruntime on the same exported graph, in one
run.

A one-layer net holding eric612/MobileNet-YOLO's Yolov3DetectionOutput at a 416 x 416 input by default (the
13 x 13, 26 x 26 and 52 x 52 maps of three anchors and 80 classes: 10647 boxes, one candidate per class above the
confidence threshold, then one class-agnostic greedy NMS) is run by Model.run() and by onnxruntime (its C++
NonMaxSuppression, the anchor) on its ONNX export, both fed the same random maps.  Random maps make many boxes
pass for many classes, the case a low threshold (mAP evaluation) gives on a real net.  Prints the milliseconds per
forward of each, their ratio (caffeq / onnxruntime; below 1 caffeq is faster), the rows each kept and how many
differ (near-tied scores, rounded differently by the two, may swap places).

    python benchmarks/detection.py [--side 416] [--classes 80] [--threshold 0.3] [--repeats 3] [--threads 2]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BIASES = [10, 14, 23, 27, 37, 58, 81, 82, 135, 169, 344, 319, 10, 13, 16, 30, 33, 23]
MASK = [6, 7, 8, 3, 4, 5, 0, 1, 2]
SCALES = [32, 16, 8]


def net_text(side, classes, threshold):
    maps = [side // s for s in SCALES]
    inputs = "".join(f'input: "x{i}" input_shape {{ dim: 1 dim: {3 * (5 + classes)} dim: {m} dim: {m} }}\n'
                     for i, m in enumerate(maps))
    fields = (" ".join(f"biases: {b}" for b in BIASES) + " " + " ".join(f"mask: {m}" for m in MASK)
              + " " + " ".join(f"anchors_scale: {s}" for s in SCALES))
    bottoms = " ".join(f'bottom: "x{i}"' for i in range(len(maps)))
    layer = (f'layer {{ name: "o" type: "Yolov3DetectionOutput" {bottoms} top: "o" yolov3_detection_output_param {{ '
             f'num_classes: {classes} num_box: 3 confidence_threshold: {threshold} nms_threshold: 0.45 '
             f'mask_group_num: 3 {fields} }} }}\n')
    return inputs + layer, maps


def timed(fn, repeats):
    out = fn()   # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=416, help="input side (a multiple of 32)")
    ap.add_argument("--classes", type=int, default=80)
    ap.add_argument("--threshold", type=float, default=0.3, help="confidence_threshold")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (0: their defaults)")
    args = ap.parse_args()

    import onnxruntime as ort
    import torch

    from caffeq.model import load_from_text
    if args.threads:
        torch.set_num_threads(args.threads)
    text, maps = net_text(args.side, args.classes, args.threshold)
    model = load_from_text(text)
    rng = np.random.default_rng(0)
    feeds = {f"x{i}": rng.standard_normal((1, 3 * (5 + args.classes), m, m)).astype(np.float32)
             for i, m in enumerate(maps)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.onnx")
        model.export_onnx(path)
        opts = ort.SessionOptions()
        if args.threads:
            opts.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        ours_ms, ours = timed(lambda: model.run(feeds)["o"], args.repeats)
        ort_ms, theirs = timed(lambda: sess.run(["o"], feeds)[0], args.repeats)
    # rows whose scores differ by float rounding only (the two compute the sigmoids their own way) may swap
    # places: count the rows that differ rather than ask for all to agree
    differ = (int(np.sum(np.abs(ours[0, 0] - theirs[0, 0]).max(axis=1) > 1e-5)) if ours.shape == theirs.shape
              else "all (row counts differ)")
    print(f"Yolov3DetectionOutput, {args.side} x {args.side}, {args.classes} classes, threshold {args.threshold}: "
          f"{sum(3 * m * m for m in maps)} boxes")
    print(f"  caffeq      {ours_ms:9.1f} ms  ({ours.shape[2]} rows)")
    print(f"  onnxruntime {ort_ms:9.1f} ms  ({theirs.shape[2]} rows)")
    print(f"  ratio caffeq / onnxruntime: {ours_ms / ort_ms:.2f}; rows that differ: {differ}")


if __name__ == "__main__":
    main()
