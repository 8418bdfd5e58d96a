"""ROI layers of the two-stage detectors on the CPU: caffeq's forward against onnxruntime on the same
exported graph, in one run.

For each layer (R-FCN's PSROIPooling, R-FCN-PSROIAlign's PSROIAlign, zhaoweicai's Cascade R-CNN ROIAlign,
Fast R-CNN's ROIPooling), a one-layer net at R-FCN's ResNet-50 test sizes by default (a 1 x 1029 x 38 x 50
map: 21 classes x 7 x 7 position-sensitive channels at stride 16 of a 600 x 800 image, 300 rois) is run
by Model.run() and by onnxruntime on its ONNX export, both fed the same random map and rois.  Prints the
milliseconds per forward of each, the ratio (caffeq / onnxruntime; below 1 caffeq is faster) and the
largest difference between the two.  Weights are not involved: these layers have none.

    python benchmarks/roi.py [--rois 300] [--repeats 5] [--threads 2]
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

LAYERS = {
    "PSROIPooling": ('psroi_pooling_param { spatial_scale: 0.0625 output_dim: 21 group_size: 7 }', 21 * 49),
    "PSROIAlign": ('psroi_align_param { spatial_scale: 0.0625 output_dim: 21 group_size: 7 sample_num: 2 }', 21 * 49),
    "ROIAlign": ('roi_pooling_param { pooled_h: 7 pooled_w: 7 spatial_scale: 0.0625 }', 256),
    "ROIPooling": ('roi_pooling_param { pooled_h: 7 pooled_w: 7 spatial_scale: 0.0625 }', 512),
}


def net_text(kind, param, channels, rois, h, w):
    return (f'input: "x" input_shape {{ dim: 1 dim: {channels} dim: {h} dim: {w} }}\n'
            f'input: "rois" input_shape {{ dim: {rois} dim: 5 }}\n'
            f'layer {{ name: "r" type: "{kind}" bottom: "x" bottom: "rois" top: "r" {param} }}\n')


def timed(fn, repeats):
    fn()   # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rois", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (0: their defaults)")
    args = ap.parse_args(argv)
    import onnxruntime as ort
    import torch

    from caffeq.model import load_from_text
    if args.threads:
        torch.set_num_threads(args.threads)
    h, w = 38, 50
    rng = np.random.default_rng(0)
    boxes = np.zeros((args.rois, 5), np.float32)
    boxes[:, 1:3] = rng.uniform(0, 700, (args.rois, 2))
    boxes[:, 3:5] = boxes[:, 1:3] + rng.uniform(16, 400, (args.rois, 2))
    print(f"{'layer':14s} {'caffeq ms':>10s} {'onnxruntime ms':>15s} {'ratio':>7s} {'max diff':>10s}")
    for kind, (param, channels) in LAYERS.items():
        model = load_from_text(net_text(kind, param, channels, args.rois, h, w))
        x = rng.standard_normal((1, channels, h, w)).astype(np.float32)
        feeds = {"x": x, "rois": boxes}
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "roi.onnx")
            model.export_onnx(path)
            options = ort.SessionOptions()
            if args.threads:
                options.intra_op_num_threads = args.threads
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            ours = model.run(feeds)["r"]
            theirs = session.run(None, feeds)[0]
            t_ours = timed(lambda: model.run(feeds), args.repeats)
            t_ort = timed(lambda: session.run(None, feeds), args.repeats)
        diff = float(np.abs(ours - theirs).max())
        print(f"{kind:14s} {t_ours:10.1f} {t_ort:15.1f} {t_ours / t_ort:7.2f} {diff:10.2e}")


if __name__ == "__main__":
    main()
