"""Inference throughput on the real open_nsfw net (ResNet-50-1by2), CPU, every runtime in one run.

Contenders, each fed the same preprocessed photos (numpy in, numpy out), at batch 1 and 8:
  opencv         cv2.dnn.readNetFromCaffe (opencv-python-headless < 5): the anchor
  caffeq-exact   Model.run(exact=True): the layer-by-layer module, Caffe's order of operations
  caffeq         Model.run(): the default, BatchNorm/Scale folded, identities removed, channels_last
  caffeq-compile Model.run(compile=True) (with --compile; compiled before timing)
  onnx-fp32      the exported ONNX in onnxruntime
  onnx-int8      static int8 (convert --to int8 --calibrate) in onnxruntime's int8 kernels
Prints images/s, the ratio to OpenCV and, for int8, the ratio to fp32 ONNX; then the top-1
agreement of every contender with caffeq-exact on the photos.  Targets: caffeq >= 1.5x OpenCV at
batch 1 and 8; onnx-int8 >= 1.8x onnx-fp32 at batch 8 with the same top-1 on the photos.

Model: yahoo/open_nsfw (https://github.com/yahoo/open_nsfw), nsfw_model/deploy.prototxt and
nsfw_model/resnet_50_1by2_nsfw.caffemodel (23 MB, not in this repository):

    git clone https://github.com/yahoo/open_nsfw
    python benchmarks/infer.py --prototxt open_nsfw/nsfw_model/deploy.prototxt \\
        --weights open_nsfw/nsfw_model/resnet_50_1by2_nsfw.caffemodel --photos PHOTO_DIR

Photos: any folder of real JPEG/PNG photos, e.g. OpenCV's samples/data (lena.jpg, messi5.jpg,
fruits.jpg, ...) or Caffe's examples/images.  Preprocessing is open_nsfw's: resize to 256x256,
centre crop 224, BGR minus (104, 117, 123).  The photos' centre crops are the agreement set; their
mirrored and corner crops calibrate int8, so no photo crop is both.

Each runtime runs alone in its own process with its own default thread pools: what a user gets.
--passive makes torch's OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE) and onnxruntime's
not spin, for a machine with more runnable threads than cores, where spinning waits stall the
runtime's own threads; it costs torch dearly at batch 1 (a sleeping thread takes tens of
microseconds to wake for each convolution).  OpenCV's own pool is left as it is.

Without --weights the real prototxt gets synthetic weights: random convolutions (N(0, 1/fan_in))
whose BatchNorm statistics are estimated on the photos, so activations have trained-like scales,
and a classifier bias that splits the photos between the classes.
Throughput does not depend on the weights' values; agreement on synthetic weights is weaker
evidence than on the real ones (the script says which it used).

    python benchmarks/infer.py --prototxt deploy.prototxt [--weights W] --photos DIR
                               [--threads 2] [--seconds 3] [--batches 1,8] [--compile]
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MEAN_BGR = np.array([104.0, 117.0, 123.0], np.float32)
ENVIRON = dict(os.environ)   # before cv2's import edits LD_LIBRARY_PATH: what the workers start with


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


# ---- photos ----------------------------------------------------------------------------------------

def read_photos(folder):
    import cv2
    names = sorted(f for f in os.listdir(folder) if f.lower().endswith((".jpg", ".jpeg", ".png")))
    photos = []
    for name in names:
        img = cv2.imread(os.path.join(folder, name), cv2.IMREAD_COLOR)
        if img is not None:
            photos.append((name, cv2.resize(img, (256, 256), interpolation=cv2.INTER_LINEAR)))
    if not photos:
        raise SystemExit(f"{folder}: no readable photos")
    return photos


def to_input(crop):
    return np.ascontiguousarray((crop.astype(np.float32) - MEAN_BGR).transpose(2, 0, 1))


def photo_sets(photos):
    """(centre crops: the agreement set, [mirrored centre + four corner crops]: calibration)."""
    centre = np.stack([to_input(img[16:240, 16:240]) for _, img in photos])
    calib = []
    for _, img in photos:
        calib.append(to_input(img[16:240, 16:240][:, ::-1]))
        for y, x in ((0, 0), (0, 32), (32, 0), (32, 32)):
            calib.append(to_input(img[y:y + 224, x:x + 224]))
    return centre, np.stack(calib)


# ---- synthetic weights -------------------------------------------------------------------------------

def synthetic_weights(prototxt, photos_batch, path):
    """Random weights for the real prototxt, with BatchNorm statistics estimated on the photos."""
    import torch

    import caffeq
    from caffeq.io.writer import write_model_caffemodel
    model = caffeq.load(prototxt, random_weights=True, seed=0)
    for node in model.graph.nodes:
        if node.type == "BatchNorm":
            # factor 0 and zero statistics: one training-mode step stores the batch's own statistics
            node.blobs = [np.zeros_like(b) for b in node.blobs]
            node.attrs = dict(node.attrs, use_global_stats=False)   # the prototxt says true
    gm = model.to_torch().train()
    with torch.no_grad():
        gm(torch.from_numpy(photos_batch))
    for mod in gm.modules():
        if getattr(mod, "caffe_type", None) == "BatchNorm":
            node = next(n for n in model.graph.nodes if n.name == mod.caffe_name)
            node.blobs = [t.detach().numpy().copy() for t in mod.blob_tensors()]
    # centre the classifier's logits on the photos (its bias minus their per-class median), so that
    # the photos spread over the classes instead of all falling in one: agreement is then a test
    for node in model.graph.nodes:
        if node.type == "BatchNorm":
            node.attrs = dict(node.attrs, use_global_stats=True)
    last = [n for n in model.graph.nodes if n.type == "InnerProduct"][-1]
    logits = model.run({"data": photos_batch}, all_blobs=True, exact=True)[last.tops[0]]
    last.blobs = [last.blobs[0], (last.blobs[1] - np.median(logits, axis=0)).astype(np.float32)]
    write_model_caffemodel(model, path)
    return path


# ---- the run ---------------------------------------------------------------------------------------------

CONTENDERS = ("opencv", "caffeq-exact", "caffeq", "onnx-fp32", "onnx-int8")


def contender(name, files, threads):
    """A function feeding one batch (numpy) to contender `name`, built in this process."""
    if name == "opencv":
        import cv2
        cv2.setNumThreads(threads)
        net = cv2.dnn.readNetFromCaffe(files["prototxt"], files["weights"])

        def run_cv(x):
            net.setInput(x)
            return net.forward()
        return run_cv
    if name.startswith("onnx"):
        from caffeq.backends.onnx_qdq import session
        sess = session(files["fp32" if name == "onnx-fp32" else "int8"], threads=threads,
                       spin=files.get("spin", True))
        in_name = sess.get_inputs()[0].name
        return lambda x: sess.run(None, {in_name: x})[0]
    import torch

    import caffeq
    torch.set_num_threads(threads)
    model = caffeq.load(files["prototxt"], files["weights"])
    out = model.outputs[0]
    options = {"caffeq-exact": {"exact": True}, "caffeq": {}, "caffeq-compile": {"compile": True}}[name]
    return lambda x: model.run({"data": x}, **options)[out]


def worker(args):
    """--worker NAME: time one contender alone in this process and print its images/s as JSON.

    Each runtime runs in its own process: OpenMP, OpenCV and onnxruntime thread pools spin while
    waiting for work, and two of them in one process on two cores stall each other."""
    import json
    files = json.loads(args.files)
    fn = contender(args.worker, files, args.threads)
    centre = np.load(files["photos"])
    reps = -(-args.batch // len(centre))
    x = np.ascontiguousarray(np.concatenate([centre] * reps)[:args.batch])
    print(json.dumps({"rate": args.batch / timeit(lambda: fn(x), args.seconds)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prototxt", help="open_nsfw's nsfw_model/deploy.prototxt")
    ap.add_argument("--weights", help="resnet_50_1by2_nsfw.caffemodel (default: synthetic, see above)")
    ap.add_argument("--photos", help="a folder of real photos")
    ap.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--compile", action="store_true", help="also time Model.run(compile=True)")
    ap.add_argument("--passive", action="store_true",
                    help="torch's OpenMP threads and onnxruntime's pools wait passively (default: each "
                         "runtime's own spinning pools; see above)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not args.prototxt or not args.photos:
        ap.error("--prototxt and --photos are required (see the download instructions above)")
    import json
    import subprocess

    import cv2
    import onnxruntime
    import torch

    import caffeq
    from caffeq.quant.static_int8 import format_summary, static_int8

    photos = read_photos(args.photos)
    centre, calib = photo_sets(photos)
    tmp = tempfile.mkdtemp(prefix="caffeq-infer-")
    weights = args.weights
    if weights is None:
        weights = synthetic_weights(args.prototxt, calib, os.path.join(tmp, "synthetic.caffemodel"))
    kind = "real" if args.weights else "synthetic (BatchNorm statistics from the photos)"
    files = {"prototxt": os.path.abspath(args.prototxt), "weights": os.path.abspath(weights),
             "fp32": os.path.join(tmp, "fp32.onnx"), "int8": os.path.join(tmp, "int8.onnx"),
             "photos": os.path.join(tmp, "photos.npy"), "spin": not args.passive}
    env = dict(ENVIRON)
    if args.passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    np.save(files["photos"], centre)
    model = caffeq.load(args.prototxt, weights)
    model.export_onnx(files["fp32"])
    t0 = time.perf_counter()
    info = static_int8(model, files["int8"], {"data": calib}, threads=args.threads)
    calib_s = time.perf_counter() - t0
    names = list(CONTENDERS) + (["caffeq-compile"] if args.compile else [])

    print(f"open_nsfw ResNet-50-1by2, {kind} weights; CPU, {args.threads} threads, each runtime in its own "
          f"process, {'passive' if args.passive else 'default (spinning)'} waits; torch {torch.__version__}, "
          f"onnxruntime {onnxruntime.__version__}, OpenCV {cv2.__version__}")
    print(f"static int8 calibrated in {calib_s:.0f} s; {len(centre)} photos for agreement")
    print("\n".join(format_summary(info)))
    print(f"{'batch':>6}{'contender':>16}{'images/s':>11}{'x opencv':>10}{'x onnx-fp32':>13}")
    rates = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        for name in names:
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, "--batch", str(batch),
                                  "--seconds", str(args.seconds), "--threads", str(args.threads),
                                  "--files", json.dumps(files)], capture_output=True, text=True, check=False,
                                 env=env)
            if res.returncode != 0:
                raise SystemExit(f"{name} at batch {batch} failed:\n{res.stderr}")
            rates[batch, name] = json.loads(res.stdout.strip().splitlines()[-1])["rate"]
        for name in names:
            r = rates[batch, name]
            vs_onnx = f"{r / rates[batch, 'onnx-fp32']:.2f}" if name.startswith("onnx") else ""
            print(f"{batch:6d}{name:>16}{r:11.1f}{r / rates[batch, 'opencv']:10.2f}{vs_onnx:>13}", flush=True)

    out = model.outputs[0]
    ref = np.concatenate([model.run({"data": centre[i:i + 8]}, exact=True)[out] for i in range(0, len(centre), 8)])
    ref = ref.reshape(len(centre), -1)
    top = ref.argmax(1)
    counts = {int(k): int(v) for k, v in zip(*np.unique(top, return_counts=True))}
    print(f"agreement with caffeq-exact on {len(centre)} photos, one at a time (its top-1 classes: {counts}):")
    for name in CONTENDERS:
        fn = contender(name, files, args.threads)
        got = np.concatenate([np.asarray(fn(np.ascontiguousarray(centre[i:i + 1]))).reshape(1, -1)
                              for i in range(len(centre))])
        same = got.argmax(1) == top
        note = ""
        if not same.all():
            # how close fp32 itself was to a tie on the photos that changed class
            top2 = np.sort(ref[~same], axis=1)[:, -2:]
            note = f"; fp32's top-2 probability gap on the others: {', '.join(f'{g:.3f}' for g in top2[:, 1] - top2[:, 0])}"
        print(f"  {name:<15} top-1 {int(same.sum())}/{len(centre)}, max |d prob| {np.abs(got - ref).max():.3g}{note}")
    for f in os.listdir(tmp):
        os.unlink(os.path.join(tmp, f))
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
