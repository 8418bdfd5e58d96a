"""Static int8: weights and activations in int8, with activation scales calibrated on data.

    >>> info = static_int8(model, "model.int8.onnx", calibration_inputs(model, "images/"))
    >>> info["method"], info["candidates"]["percentile"]["agreement_top1"]

Weights: symmetric int8 per output channel.  Activations: one uint8 scale and zero point per
tensor, from the calibration data by each of min-max, percentile (99.999%) and entropy (KL);
the method whose model agrees best with fp32 on the calibration data (top-1 agreement, then
relative error of the outputs) is written.  The file is a QDQ ONNX (QuantizeLinear /
DequantizeLinear around Conv, Gemm, Add, pooling, Concat) that onnxruntime fuses into
QLinearConv and friends, so the convolutions run on its int8 kernels.  Softmax and other
nonlinear heads keep float inputs.  `keep` / `only` choose the layers by the same rules as
`caffeq.quantize`: the layers kept stay float.

There is no torch int8 path: caffeq's torch module runs Caffe layers one by one, and torch's
int8 CPU kernels need modules rewritten by torch.ao.quantization; onnxruntime runs the file.
"""
import os
import shutil
import tempfile
import time

import numpy as np

from ..data.arrays import net_inputs
from .base import QuantizeError

METHODS = ("minmax", "percentile", "entropy")
DEFAULT_IMAGES = 256


# ---- calibration data ----------------------------------------------------------------------------

def calibration_inputs(model, source, images=DEFAULT_IMAGES, plan=None, transform=None, resize=None,
                       channel_order=None, notes=None):
    """{input blob: float32 array of up to `images` items} to calibrate on.

    source: an .npy/.npz of preprocessed inputs, or any data source `eval` reads (LMDB, image
    list, image folder), preprocessed by the net's data layer or the given transform options
    (or `plan`, an evaluation's DataPlan, whose preprocessing is reused).  notes: a list that
    receives remarks on the preprocessing (e.g. none given for a deploy net).
    """
    import dataclasses

    import torch

    from ..data import Collate, Normalizer, detect_kind
    from ..data.plan import build_dataset, data_layer, plan_data, probe_items
    from ..errors import DataError
    images = int(images)
    if images < 1:
        raise DataError(f"--calibrate-images must be >= 1, got {images}")
    source = os.fspath(source)
    if not os.path.exists(source):
        raise DataError(f"--calibrate {source}: no such file or folder")
    if source.endswith((".npy", ".npz")) and os.path.isfile(source):
        return {k: v[:images] for k, v in net_inputs(source, model).items()}
    if plan is None:
        plan = plan_data(data_layer(model), model.inputs, model._base_dir(), source, batch_size=32,
                         transform=transform, resize=resize, channel_order=channel_order,
                         prototxt=model.prototxt)
    else:
        plan = dataclasses.replace(plan, source=source, kind=detect_kind(source),
                                   roots=[os.getcwd(), model._base_dir()])
    if notes is not None:
        notes.extend(plan.notes)
    others = [n for n in model.inputs if n not in (plan.data_blob, plan.label_blob)]
    if plan.data_blob not in model.inputs or others:
        raise DataError(f"--calibrate {source}: the net's inputs {list(model.inputs)} are not one image blob "
                        f"(and a label); pass an .npz of inputs by blob name")
    dataset = build_dataset(plan, limit=images)
    expected = tuple(model.inputs[plan.data_blob][1:])
    probe_items(dataset, expected, plan)      # a size mismatch explained, as in eval
    t = plan.transformer
    mean_shape = tuple(t.mean.shape) if t.mean is not None else expected
    collate = Collate(expected, Normalizer(t.mean_for(mean_shape), t.scale))
    loader = torch.utils.data.DataLoader(dataset, batch_size=plan.batch_size, num_workers=0, collate_fn=collate)
    data, labels = [], []
    for batch in loader:
        data.append(batch["data"].numpy().astype(np.float32, copy=False))
        labels.append(batch["label"].numpy())
    dataset.close()
    if not data or not sum(len(d) for d in data):
        raise DataError(f"--calibrate {source}: no readable items")
    out = {plan.data_blob: np.concatenate(data)[:images]}
    if plan.label_blob is not None and plan.label_blob in model.inputs:
        lab = np.concatenate(labels)[:images].astype(np.float32)
        out[plan.label_blob] = lab.reshape((-1,) + tuple(model.inputs[plan.label_blob][1:]))
    return out


# ---- which layers stay float -----------------------------------------------------------------------

def float_layers(model, keep=None, only=None):
    """{layer: reason} of the weighted layers that stay float, by caffeq.quantize's keep/only rules
    (int8's default: none)."""
    from . import _check_names, _names, weighted_layers
    eligible = {n.name for n in weighted_layers(model.graph)}
    keep_names, only_names = _names(keep, "--keep"), _names(only, "--only")
    if keep_names and only_names is not None:
        raise QuantizeError("--keep and --only cannot be combined; name the layers to quantize with --only")
    if keep_names:
        _check_names(model.graph, keep_names, "--keep", eligible, "int8")
        return {n: "--keep" for n in keep_names}
    if only_names is not None:
        _check_names(model.graph, only_names, "--only", eligible, "int8")
        return {n.name: "not in --only" for n in model.graph.nodes if n.name in eligible and
                n.name not in only_names}
    return {}


def _onnx_nodes_of(path, layers):
    """ONNX node names emitted for the Caffe layers `layers` (the layer's name, or 'name/...')."""
    import onnx
    g = onnx.load(path, load_external_data=False).graph
    return [n.name for n in g.node if n.name in layers or n.name.split("/")[0] in layers]


# ---- measuring a candidate ---------------------------------------------------------------------------

def _outputs(path, arrays, names, batch=32, threads=None):
    from ..backends.onnx_qdq import session
    sess = session(path, threads=threads)
    feed_names = {i.name for i in sess.get_inputs()}
    n = next(iter(arrays.values())).shape[0]
    parts = {k: [] for k in names}
    seconds = 0.0
    for s in range(0, n, batch):
        feed = {k: np.ascontiguousarray(v[s:s + batch]) for k, v in arrays.items() if k in feed_names}
        t0 = time.perf_counter()
        out = sess.run(names, feed)
        seconds += time.perf_counter() - t0
        for k, v in zip(names, out):
            parts[k].append(np.asarray(v))
    return {k: np.concatenate(v) for k, v in parts.items()}, seconds


def agreement(ref, got):
    """{output: {"rel_error", "agreement_top1" (outputs with a class axis)}} of `got` against `ref`."""
    rows = {}
    for k, a in ref.items():
        a64, b64 = np.asarray(a, np.float64), np.asarray(got[k], np.float64)
        norm = float(np.linalg.norm(a64))
        row = {"rel_error": float(np.linalg.norm(b64 - a64) / norm) if norm else float(np.linalg.norm(b64))}
        if a64.ndim >= 2 and a64.shape[1] > 1:
            row["agreement_top1"] = float((a64.argmax(1) == b64.argmax(1)).mean())
        rows[k] = row
    return rows


def _score(rows):
    agree = [r["agreement_top1"] for r in rows.values() if "agreement_top1" in r]
    err = [r["rel_error"] for r in rows.values()]
    return (float(np.mean(agree)) if agree else 1.0, -float(np.mean(err)) if err else 0.0)


# ---- the conversion -------------------------------------------------------------------------------------

def static_int8(model, out_path, arrays, keep=None, only=None, methods=METHODS, opset=None, outputs=(),
                inputs=(), threads=None):
    """Write `model` as a static-int8 QDQ ONNX at out_path, calibrated on `arrays` ({input blob:
    preprocessed array}) -> a dict of what was done.

    Every method in `methods` is calibrated and measured against fp32 on the calibration data; the
    best is written.  outputs: more blobs to expose as graph outputs (e.g. evaluate's score blob).
    inputs: files out_path must not overwrite.
    """
    from ..backends.onnx_backend import export_onnx
    from ..backends.onnx_qdq import (
        add_outputs,
        calibrate_ranges,
        kernel_ops,
        require_onnxruntime,
        sums_to_adds,
        write_qdq,
    )
    from ..fs import atomic_path
    require_onnxruntime()
    methods = [m for m in methods]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise QuantizeError(f"calibration method(s) {bad or methods}: choose from {', '.join(METHODS)}")
    if any(n.has_params and n.blobs is None for n in model.graph.nodes):
        raise QuantizeError("static int8 needs the trained weights; load the model with its .caffemodel")
    if model.quantization:
        raise QuantizeError("the model is already quantized; calibrate the fp32 model")
    kept = float_layers(model, keep, only)
    n_items = next(iter(arrays.values())).shape[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="caffeq-int8-") as tmp:
        fp32 = os.path.join(tmp, "fp32.onnx")
        stats = export_onnx(model, fp32, opset=opset, batch="dynamic", optimize=True)
        add_outputs(fp32, outputs)
        sums_to_adds(fp32)
        import onnx
        names = [o.name for o in onnx.load(fp32, load_external_data=False).graph.output]
        feed = {k: v for k, v in arrays.items() if k in set(stats["inputs"])}
        if not feed:
            raise QuantizeError(f"the calibration data holds none of the ONNX inputs {stats['inputs']}")
        ref, fp32_s = _outputs(fp32, feed, names, threads=threads)
        exclude = _onnx_nodes_of(fp32, set(kept))
        candidates = {}
        best = None
        for method in methods:
            t0 = time.perf_counter()
            cache = os.path.join(tmp, f"{method}.json")
            qpath = os.path.join(tmp, f"{method}.onnx")
            try:
                calibrate_ranges(fp32, feed, method, cache)
                write_qdq(fp32, qpath, cache, method, exclude=exclude)
            except (AssertionError, ValueError, ArithmeticError) as e:
                # onnxruntime's tools reject some ranges (e.g. a histogram method on a constant
                # tensor): that method is out, the others still compete
                candidates[method] = {"error": f"{type(e).__name__}: {e}".strip()}
                continue
            got, int8_s = _outputs(qpath, feed, names, threads=threads)
            rows = agreement(ref, got)
            candidates[method] = {"outputs": rows, "agreement_top1": _score(rows)[0],
                                  "rel_error": -_score(rows)[1], "seconds": time.perf_counter() - t0,
                                  "speedup": fp32_s / int8_s if int8_s > 0 else None}
            if best is None or _score(rows) > _score(candidates[best]["outputs"]):
                best = method
        if best is None:
            errors = "; ".join(f"{m}: {c['error']}" for m, c in candidates.items())
            raise QuantizeError(f"static int8: no calibration method gave usable ranges ({errors})")
        chosen = os.path.join(tmp, f"{best}.onnx")
        probe = {k: v[:1] for k, v in feed.items()}
        ops = kernel_ops(chosen, probe)
        with atomic_path(out_path, inputs=[p for p in (model.prototxt, model.weights_path, *inputs) if p]) as tmp_out:
            shutil.copyfile(chosen, tmp_out)
    integer = sorted(n for n, op in ops.items() if op.startswith(("QLinear", "QGemm")) or op.endswith("Integer"))
    return {"path": os.fspath(out_path), "method": best, "candidates": candidates, "images": int(n_items),
            "kept_float": kept, "excluded_nodes": exclude, "integer_kernels": integer,
            "kernels": ops, "opset": stats["opset"], "outputs": names, "seconds": time.perf_counter() - started,
            "file_size": os.path.getsize(out_path)}


def format_summary(info):
    """Lines describing a static_int8 result for the command line."""
    lines = [(f"static int8: activations calibrated on {info['images']} item(s); method {info['method']} "
              f"chosen by top-1 agreement with fp32, then relative error:")]
    for m, c in info["candidates"].items():
        if "error" in c:
            lines.append(f"   {m:<10} failed: {c['error']}")
            continue
        mark = "*" if m == info["method"] else " "
        lines.append(f" {mark} {m:<10} agreement {100 * c['agreement_top1']:.2f}%, relative error "
                     f"{c['rel_error']:.4g}")
    convs = [n for n, op in info["kernels"].items() if op in ("QLinearConv", "ConvInteger")]
    lines.append(f"onnxruntime runs {len(info['integer_kernels'])} int8 kernel(s) ({len(convs)} convolutions as "
                 f"QLinearConv/ConvInteger)")
    if info["kept_float"]:
        lines.append(f"kept float: {', '.join(info['kept_float'])}")
    return lines


def eval_module(base, plan, wanted, calibrate, images=DEFAULT_IMAGES, keep=None):
    """For caffeq.evaluate: (model, module-like runner, metric blobs it lacks, notes) of the static
    int8 file calibrated on `calibrate` with the evaluation's preprocessing."""
    from ..backends.onnx_qdq import OrtModule
    arrays = calibration_inputs(base, calibrate, images, plan=plan)
    folder = tempfile.mkdtemp(prefix="caffeq-int8-eval-")
    path = os.path.join(folder, "int8.onnx")
    info = static_int8(base, path, arrays, keep=keep, outputs=wanted)
    module = OrtModule(path, list(base.inputs), base.inputs, wanted)
    shutil.rmtree(folder, ignore_errors=True)    # the session holds the model
    missing = [w for w in wanted if w not in module.output_names]
    model = _SizedModel(base, info)
    notes = [(f"static, activations calibrated on {info['images']} item(s) of {calibrate} ({info['method']}); "
              f"run by onnxruntime ({len(info['integer_kernels'])} int8 kernels)")]
    if missing:
        notes.append(f"no {', '.join(missing)} (training-only layers are not in the ONNX graph)")
    return model, module, missing, notes


class _SizedModel:
    """What the evaluation report reads of a target's model: its weights' size (int8 file)."""

    def __init__(self, base, info):
        self.graph = base.graph
        self.info = info
        self.quant_report = None
        self.static_int8 = info

    @property
    def size_bytes(self):
        return self.info["file_size"]


__all__ = ["METHODS", "agreement", "calibration_inputs", "eval_module", "float_layers", "format_summary",
           "static_int8"]
