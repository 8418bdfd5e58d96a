"""Batch evaluation on datasets with Caffe's preprocessing: every target on the same batches, one pass.

    >>> import caffeq.evaluate as ev
    >>> r = ev.evaluate("train_val.prototxt", weights="model.caffemodel", targets=("fp32", "binary"))
    >>> r["results"]["fp32"]["top1"], r["results"]["binary"]["agreement_top1"]

What is read and how: a train_val/test net's TEST-phase Data or ImageData
layer gives the source, batch size, transform_param and label blob (`data=`
replaces the source); a deploy net takes `data=` plus the preprocessing
options.  Metrics are sums over images (counts, sums of differences), so a
run sharded over processes (torchrun) all-reduces them into exactly the
single-process numbers.
"""
import math
import os
import time

import numpy as np
import torch

from .backends.torch_backend import caffe_fp32
from .data import Collate, Normalizer, StridedSampler, worker_init
from .data.plan import as_input_layer, build_dataset, data_layer, phase_data_layer, plan_data, probe_items
from .errors import DataError
from .eval_metrics import (  # noqa: F401  (format_table: evaluate's result as a table, kept importable here)
    ABS,
    AGREE,
    COS,
    ELEMS,
    LABELED,
    NSLOTS,
    POS,
    TOP1,
    TOP5,
    N,
    Sums,
    add_batch,
    format_table,
    fraction,
)

MAX_LISTED_ERRORS = 1000


# ---- the nets --------------------------------------------------------------------------------

def _score_blob(model, label_blob, output=None):
    """The blob whose argmax is the prediction: what the Accuracy (or loss) layer reads, else the
    net's output."""
    blobs = model.blob_shapes
    if output is not None:
        if output not in blobs:
            raise DataError(f"--outputs '{output}': no such blob (blobs: {', '.join(list(blobs)[:12])}...)")
        return output
    for types in (("Accuracy",), ("SoftmaxWithLoss", "MultinomialLogisticLoss", "InfogainLoss",
                                  "SigmoidCrossEntropyLoss", "HingeLoss")):
        for node in model.graph.nodes:
            if node.type in types and len(node.bottoms) >= 2 and (label_blob is None or
                                                                   node.bottoms[1] == label_blob) \
                    and not (isinstance(node.attrs, dict) and node.attrs.get("unwritten")):
                # (an "unwritten" scorer, xiaolonw/caffe-3dnormal_joint_past's 3-bottom Accuracy, reads no label)
                return node.bottoms[0]
    training_only = _training_only_tensors(model)
    tensors = model.graph.tensors
    cands = [o for o in model.graph.outputs if o not in training_only and tensors[o].shape]
    if not cands:
        raise DataError(f"the net's outputs {model.outputs} hold no per-image scores; name the blob "
                        f"with --outputs")
    # prefer an output with several values per image (class scores) over a single value
    best = next((o for o in cands if math.prod(tensors[o].shape[1:]) > 1), cands[0])
    return tensors[best].blob


def _training_only_tensors(model):
    return {ssa for n in model.graph.nodes if n.spec.is_training_only for ssa in n.outputs}


def _metric_blobs(model, score):
    """Outputs of Accuracy/loss layers that are one number per batch: reported like `caffe test`."""
    training_only = _training_only_tensors(model)
    out = []
    for ssa in model.graph.outputs:
        t = model.graph.tensors[ssa]
        if ssa in training_only and t.blob != score and math.prod(t.shape) == 1:
            out.append(t.blob)
    return out


def _ignore_labels(model, label_blob):
    values = set()
    if label_blob is None:
        return values
    for node in model.graph.nodes:
        if label_blob in node.bottoms and isinstance(node.attrs, dict) and \
                node.attrs.get("ignore_label") is not None:
            values.add(int(node.attrs["ignore_label"]))
    return values


def _module(model, outputs, device, dtype=None, exact=False, compile=False):
    """The fx module with exactly `outputs` ({blob: tensor}), in eval mode.

    The optimized module (BatchNorm/Scale folded, identities removed, channels_last) unless
    exact=True or folding removed one of `outputs`; compile=True adds torch.compile (freezing).
    """
    gm = None
    if not exact:
        gm = model.to_torch(device=device, dtype=dtype, all_blobs=True, optimize=True)
        values = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if any(k not in values for k in outputs):
            gm = None      # a folded layer's blob is wanted: the exact module has it
    if gm is None:
        gm = model.to_torch(device=device, dtype=dtype, all_blobs=True)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    values = out_node.args[0]
    out_node.args = ({k: values[k] for k in outputs},)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.output_names = list(outputs)
    if not exact:
        # now that only `outputs` leave the module: in-place ReLU/SUM, packed CPU convolutions
        from .backends.torch_backend import prepack_convolutions, reuse_buffers
        reuse_buffers(gm)
        if not compile:
            prepack_convolutions(gm)
    gm.eval()
    if compile:
        return torch.compile(gm, options={"freezing": True})
    return gm


def model_size_bytes(model):
    """Bytes of the weights at their storage precision (shared blobs counted once)."""
    if hasattr(model, "size_bytes"):
        return model.size_bytes          # static int8: the file onnxruntime runs
    total = 0
    for node in model.graph.nodes:
        if not node.blobs:
            continue
        quant = node.quant
        for i, b in enumerate(node.blobs):
            if b is None or i in node.shared_from:
                continue
            total += quant[i].compact_nbytes() if i in quant else 4 * int(np.size(b))
    return total


def model_precision(model):
    """The precision a model's weights are stored at: "fp32", or what it was quantized to
    ("binary", "int8", "fp16"; "int8+binary" for a mix). Layers kept fp32 do not count."""
    done = sorted(set((model.quantization).values()))
    return "+".join(done) if done else "fp32"


def _labelled_targets(names, base):
    """Target names with the reference (names[0], "fp32") labelled by the model's real precision.

    A quantized model (a .caffeq file, caffeq.quantize's result) is its own reference: it cannot
    be quantized again, and asking for fp32 evaluates it as it is.
    """
    precision = model_precision(base)
    if precision == "fp32":
        return names
    others = [t for t in names[1:] if t != precision]
    if others:
        raise DataError(f"the model is already {precision} (quantized); it cannot also be evaluated as "
                        f"{', '.join(others)}: evaluate the fp32 prototxt and caffemodel for those")
    return [precision]


def _targets(targets):
    if isinstance(targets, str):
        targets = [t for t in targets.split(",")]
    names = []
    for t in targets:
        t = str(t).strip().lower()
        if t and t not in names:
            names.append(t)
    if not names:
        raise DataError("no targets to evaluate (e.g. fp32,fp16,binary)")
    from .quant import get_quantizer
    names = [get_quantizer(t).name for t in names]   # unknown names fail here, before any work
    names = list(dict.fromkeys(["fp32"] + names))     # fp32 runs first: the reference for agreement
    return names


# ---- distributed -------------------------------------------------------------------------------

class _Dist:
    def __init__(self, distributed, device):
        self.dist = None
        self.rank, self.world_size, self.created = 0, 1, False
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        import torch.distributed as dist
        if distributed is False:
            return
        if distributed is None and world <= 1 and not (dist.is_available() and dist.is_initialized()):
            return
        if not dist.is_available():
            raise DataError("torch.distributed is not available in this torch build")
        if not dist.is_initialized():
            try:
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            except ValueError as e:   # no torchrun environment (MASTER_ADDR, RANK, ...)
                raise DataError(f"distributed evaluation: {e}; start it with torchrun") from None
            self.created = True
        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()

    @property
    def active(self):
        return self.dist is not None and self.world_size > 1

    def _dev(self, device):
        return device if self.backend == "nccl" else torch.device("cpu")

    def _all_reduce(self, t, device, op):
        """t reduced over the ranks (op: a ReduceOp name); t itself when not distributed."""
        if not self.active:
            return t
        x = t.to(self._dev(device))
        self.dist.all_reduce(x, op=getattr(self.dist.ReduceOp, op))
        return x.to(t.device)

    def sum(self, t, device):
        return self._all_reduce(t, device, "SUM")

    def max(self, t, device):
        return self._all_reduce(t, device, "MAX")

    def gather(self, obj):
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        self.dist.all_gather_object(out, obj)
        return out

    def close(self):
        if self.created and self.dist is not None:
            self.dist.destroy_process_group()


def _device(device):
    from .backends.torch_backend import resolve_device
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        dev = torch.device("cuda", local % max(1, torch.cuda.device_count()))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


# ---- the evaluation ---------------------------------------------------------------------------

def evaluate(model, data=None, targets=("fp32",), *, weights=None, batch_size=None, device="auto",
             workers=0, limit=None, strict=False, transform=None, resize=None, channel_order=None,
             kind=None, output=None, keep=None, progress=False, distributed=None, phase="TEST",
             ignore_unknown=False, exact=False, compile=False, calibrate=None, calibrate_images=256,
             stages=(), level=0, input_shapes=None, defines=None):
    """Evaluate a model (path or caffeq.Model) on a dataset -> a dict (see `--json` of `caffeq eval`).

    targets: "fp32" and/or quantization targets ("fp16", "int8", "binary"); fp32 always runs
        first, as the reference for agreement.  keep: passed to caffeq.quantize.
    data: a source path (LMDB folder, ImageData list, image folder, .npy/.npz); default: the
        TEST-phase Data/ImageData layer's source.
    transform: {scale, mean_file, mean_value, crop_size, force_color, force_gray} overrides of
        transform_param; resize: (h, w) or "HxW"; channel_order: "BGR" (Caffe) or "RGB".
    workers: DataLoader worker processes; limit: evaluate only the first N items.
    strict: a corrupt or unreadable item raises DataError (otherwise it is counted and listed).
    distributed: None (automatic under torchrun), True or False.
    exact: run the layer-by-layer module in Caffe's order of operations instead of the optimized
        one (BatchNorm/Scale folded, channels_last; equal within 1e-5 relative).
    compile: torch.compile the modules with weight freezing (long evaluations).
    calibrate: with target "int8", a data source (or .npy/.npz of inputs) to calibrate activation
        scales on: int8 becomes static int8 (a QDQ ONNX run by onnxruntime's int8 kernels).
    stages, level, input_shapes, defines: how a prototxt path is read, as caffeq.load takes them.
    """
    started = time.perf_counter()
    names = _targets(targets)
    if calibrate is not None and "int8" not in names:
        raise DataError("--calibrate calibrates static int8; add int8 to the targets (--to ...,int8)")
    if limit is not None and int(limit) < 0:
        raise DataError(f"--limit must be >= 0, got {limit}")
    if workers is None or int(workers) < 0:
        raise DataError(f"--workers must be >= 0, got {workers}")
    opts = {"batch_size": batch_size, "transform": transform, "resize": resize,
            "channel_order": channel_order, "kind": kind}
    reading = {"phase": phase, "stages": tuple(stages), "level": level, "input_shapes": input_shapes,
               "defines": defines}
    base, plan, dataset = _prepare(model, data, weights, reading, ignore_unknown, limit, opts)
    names = _labelled_targets(names, base)
    dev = _device(device)
    dist_env = _Dist(distributed, dev)
    try:
        modes = {"exact": exact, "compile": compile, "calibrate": calibrate,
                 "calibrate_images": calibrate_images}
        return _evaluate(base, plan, dataset, names, dev, dist_env, workers=int(workers), strict=strict,
                         output=output, keep=keep, progress=progress, started=started, modes=modes)
    finally:
        dist_env.close()


def _prepare(model, data, weights, reading, ignore_unknown, limit, opts):
    """-> (Model, DataPlan, dataset).

    A train_val prototxt whose source is replaced (`data=`) is loaded with its data layer turned
    into an Input layer shaped like the new data, so that the old source need not exist.
    """
    from .model import Model, load, read_net
    if not isinstance(model, Model):
        path = os.fspath(model)
        if path.endswith(".caffeq") or data is None:
            model = load(path, weights, ignore_unknown=ignore_unknown, **reading)
        else:
            warnings = []
            net = read_net(path, ignore_unknown=ignore_unknown, warnings=warnings, defines=reading["defines"])
            base_dir = os.path.dirname(os.path.abspath(path))
            layer, lp = phase_data_layer(net, reading["phase"], path, base_dir)
            if layer is None:
                model = load(path, weights, net=net, **reading)
            else:
                plan = plan_data(layer, None, base_dir, data, prototxt=path, **opts)
                dataset = build_dataset(plan, limit)
                shape = probe_items(dataset, None, plan)
                dataset.close()
                n = plan.batch_size
                as_input_layer(lp, [(n,) + tuple(shape)] + [(n,)] * (len(layer.tops) - 1))
                model = load(path, weights, net=net, **reading)
                model.warnings[:0] = warnings
                return model, plan, dataset
    plan = plan_data(data_layer(model), model.inputs, model._base_dir(), data, prototxt=model.prototxt, **opts)
    dataset = build_dataset(plan, limit)
    probe_items(dataset, tuple(model.inputs[plan.data_blob][1:]), plan)
    dataset.close()
    return model, plan, dataset


class Runner:
    """Every target's module and running sums; `step` feeds one batch to all of them.

    The evaluation loop feeds it the DataLoader's batches; benchmarks/eval.py feeds it the same
    batches preloaded, to time the model side alone.
    """

    def __init__(self, base, plan, names, device, keep=None, output=None, has_labels=True, exact=False,
                 compile=False, calibrate=None, calibrate_images=256):
        from .quant import compute_dtype, quantize
        if plan.label_blob is not None and plan.label_blob not in base.inputs:
            plan.label_blob = None            # a data layer whose label top nothing reads
        if plan.label_blob is not None and not has_labels:
            raise DataError(f"{plan.source}: has no labels but the net's '{plan.label_blob}' blob needs them")
        self.base, self.plan, self.names, self.dev = base, plan, list(names), device
        self.has_labels = has_labels
        self.score = _score_blob(base, plan.label_blob, output)
        self.metric_names = _metric_blobs(base, self.score)
        self.expected = tuple(base.inputs[plan.data_blob][1:])
        blob_shape = base.blob_shapes.get(self.score)
        self.num_classes = int(blob_shape[1]) if blob_shape is not None and len(blob_shape) > 1 else None
        self.ignore = _ignore_labels(base, plan.label_blob)
        self.models, self.modules, self.notes = {}, {}, list(plan.notes)
        wanted = [self.score] + [m for m in self.metric_names if m != self.score]
        self.missing_metrics = {}      # target -> metric blobs it cannot compute
        for t in self.names:
            reference = t == self.names[0]    # the model as given (fp32, or its stored precision)
            if t == "int8" and calibrate is not None and not reference:
                from .quant.static_int8 import eval_module
                m, mod, missing, notes = eval_module(base, plan, wanted, calibrate, calibrate_images,
                                                     keep=keep)
                self.models[t], self.modules[t] = m, (mod, None)
                self.missing_metrics[t] = missing
                self.notes.extend(f"{t}: {n}" for n in notes)
                continue
            m = base if reference else quantize(base, t, keep=keep)
            if not reference and m.quant_report is not None:
                self.notes.extend(f"{t}: {n}" for n in m.quant_report.notes)
            self.models[t] = m
            dtype = compute_dtype(t if "+" not in t else "fp32", device)   # a mix computes in fp32
            self.modules[t] = (_module(m, wanted, device, dtype, exact=exact, compile=compile), dtype)
        t = plan.transformer
        self.normalizer = Normalizer(t.mean_for(_raw_shape(plan, self.expected)), t.scale)
        self.on_device = device.type == "cuda"
        self.accs = {t: Sums(device, self.metric_names) for t in self.names}
        self.warmed = set()      # targets whose module has run once (not timed)
        self.events = []
        self._ignore_dev = None

    def collate(self):
        """The DataLoader's collate_fn: on CPU the workers normalize, on CUDA the device does."""
        return Collate(self.expected, None if self.on_device else self.normalizer)

    def split_labels(self, x, labels, index):
        """Drop items whose label is outside the classes -> (x, labels, [(index, label)] dropped)."""
        if not self.has_labels or self.num_classes is None or not len(labels):
            return x, labels, []
        inside = (labels >= 0) & (labels < self.num_classes)
        if self.ignore:
            inside |= torch.isin(labels, torch.tensor(sorted(self.ignore), dtype=labels.dtype))
        if bool(inside.all()):
            return x, labels, []
        dropped = list(zip(index[~inside].tolist(), labels[~inside].tolist()))
        return x[inside], labels[inside], dropped

    def step(self, x, labels):
        """Run every target on one batch (raw or normalized, on any device) and add up its metrics."""
        n = int(x.shape[0])
        if not n:
            return
        dev = self.dev
        x = x.to(dev, non_blocking=True)
        x = self.normalizer.torch(x) if self.on_device else x.to(torch.float32)
        lab = labels.to(dev, non_blocking=True) if self.has_labels else None
        labeled = None
        if lab is not None:
            labeled = torch.ones_like(lab, dtype=torch.bool)
            if self.ignore:
                if self._ignore_dev is None:
                    self._ignore_dev = torch.tensor(sorted(self.ignore), device=dev, dtype=lab.dtype)
                labeled = ~torch.isin(lab, self._ignore_dev)
        feed_label = lab.to(torch.float32) if self.plan.label_blob is not None else None
        ref = None
        for t in self.names:
            gm, dtype = self.modules[t]
            acc = self.accs[t]
            xin = x if dtype is None else x.to(dtype)
            feed = [xin] if feed_label is None else _ordered_feed(gm, self.plan, xin, feed_label)
            if t not in self.warmed:
                gm(*feed)    # once, untimed: kernels are built and weights packed on the first call
                self.warmed.add(t)
            if self.on_device:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            out = gm(*feed)
            s = add_batch(acc, out, self.score, self.metric_names, lab, labeled, ref, n)
            if t == self.names[0]:
                ref = s
            if self.on_device:
                end.record()
                self.events.append((t, start, end))
            else:
                acc.seconds += time.perf_counter() - t0
        if self.on_device and len(self.events) > 256:
            _collect_events(self.events, self.accs)

    def sync(self):
        if self.on_device:
            torch.cuda.synchronize(self.dev)
            _collect_events(self.events, self.accs)


def _evaluate(base, plan, dataset, names, dev, dist_env, workers, strict, output, keep, progress, started,
              modes=None):
    if workers and getattr(dataset, "single_process", False):
        plan.notes.append(f"{dataset.kind} data is read in one process (--workers {workers} ignored)")
        workers = 0
    runner = Runner(base, plan, names, dev, keep=keep, output=output, has_labels=dataset.has_labels,
                    **(modes or {}))
    sampler = StridedSampler(len(dataset), dist_env.rank, dist_env.world_size)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=plan.batch_size, sampler=sampler, num_workers=workers,
        collate_fn=runner.collate(), pin_memory=runner.on_device,
        worker_init_fn=worker_init if workers else None, prefetch_factor=4 if workers else None)
    bad, bad_count, oor, oor_count = [], 0, [], 0
    from .progress import progress_bar
    # a bar on a terminal only (never tqdm's redraws in a log file)
    bar = progress_bar(len(sampler), "eval", unit="img", enabled=progress and dist_env.rank == 0)
    loop_start = time.perf_counter()
    try:
        with torch.inference_mode(), caffe_fp32(dev):
            for batch in loader:
                if batch["bad"]:
                    if strict:
                        raise DataError(f"{batch['bad'][0][1]} (--strict)")
                    bad_count += len(batch["bad"])
                    bad.extend(batch["bad"][:max(0, MAX_LISTED_ERRORS - len(bad))])
                x, labels, dropped = runner.split_labels(batch["data"], batch["label"], batch["index"])
                if dropped:
                    if strict:
                        raise DataError(f"item {dropped[0][0]}: label {dropped[0][1]} is outside the net's "
                                        f"{runner.num_classes} classes (--strict)")
                    oor_count += len(dropped)
                    oor.extend(dropped[:max(0, MAX_LISTED_ERRORS - len(oor))])
                runner.step(x, labels)
                bar.update(int(batch["index"].shape[0]) + len(batch["bad"]))
        runner.sync()
    finally:
        bar.close()
        dataset.close()   # this process's handle (workers hold their own); a later open must succeed
    wall = time.perf_counter() - loop_start
    result = _report(runner, dist_env, dataset, bad, bad_count, oor, oor_count, wall, started, workers)
    result["warnings"] = list(base.warnings)
    return result


def _raw_shape(plan, expected):
    """The pre-crop size the (TEST) crop is taken from: that of the mean file when there is one."""
    t = plan.transformer
    if t.mean is not None:
        return tuple(t.mean.shape)
    return tuple(expected)


def _ordered_feed(gm, plan, x, label):
    feed = []
    for name in gm.input_names:
        if name == plan.data_blob:
            feed.append(x)
        elif name == plan.label_blob:
            feed.append(label.reshape((-1,) + tuple(gm.input_shapes[name][1:])))
        else:
            raise DataError(f"the net's input '{name}' is neither the data nor the label blob; eval cannot "
                            f"feed it")
    return feed


def _collect_events(events, accs):
    if not events:
        return
    events[-1][2].synchronize()
    for t, start, end in events:
        accs[t].seconds += start.elapsed_time(end) / 1000.0
    events.clear()


def _report(runner, dist_env, dataset, bad, bad_count, oor, oor_count, wall, started, workers):
    base, plan, names, models, accs = runner.base, runner.plan, runner.names, runner.models, runner.accs
    metric_names, score, num_classes, dev = runner.metric_names, runner.score, runner.num_classes, runner.dev
    notes = runner.notes
    # one all-reduce for every sum, one for the maxima
    sums = torch.stack([accs[t].sums.double() for t in names]).cpu()
    maxes = torch.stack([accs[t].max_abs.double() for t in names]).cpu()
    secs = torch.tensor([accs[t].seconds for t in names] + [wall], dtype=torch.float64)
    counts = torch.tensor([bad_count, oor_count], dtype=torch.float64)
    sums = dist_env.sum(sums, dev)
    counts = dist_env.sum(counts, dev)
    maxes = dist_env.max(maxes, dev)
    secs = dist_env.max(secs, dev)   # the slowest shard sets the pace
    gathered = dist_env.gather((bad, oor))
    bad = sorted((b for g in gathered for b in g[0]), key=lambda b: b[0])[:MAX_LISTED_ERRORS]
    oor = sorted((o for g in gathered for o in g[1]), key=lambda o: o[0])[:MAX_LISTED_ERRORS]
    bad_count, oor_count = int(counts[0]), int(counts[1])
    wall = float(secs[-1])

    results = {}
    for k, t in enumerate(names):
        s = sums[k].tolist()
        n = int(s[N])
        r = {"images": n}
        if dataset.has_labels and num_classes is not None:
            r["top1"] = fraction(s[TOP1], s[LABELED])
            r["top5"] = fraction(s[TOP5], s[LABELED])
        if metric_names:
            missing = runner.missing_metrics.get(t, ())
            r["layers"] = {m: None if m in missing else fraction(s[NSLOTS + j], n)
                           for j, m in enumerate(metric_names)}
        if k > 0:      # agreement with the reference, names[0]
            r["agreement_top1"] = fraction(s[AGREE], s[POS])
            r["mean_abs_diff"] = fraction(s[ABS], s[ELEMS])
            r["max_abs_diff"] = float(maxes[k]) if n else None
            r["cosine"] = fraction(s[COS], n)
        r["images_per_s"] = n / float(secs[k]) if secs[k] > 0 else None
        r["model_seconds"] = float(secs[k])
        r["model_size_bytes"] = model_size_bytes(models[t])
        rep = models[t].quant_report
        if rep is not None:
            r["layers_quantized"] = len(rep.changed)
            r["layers_kept_fp32"] = len(rep.kept)
        results[t] = r
    total = int(sums[0][N]) if names else 0
    return {
        "model": base.prototxt,
        "weights": base.weights_path,
        "data": {"source": plan.source, "kind": plan.kind, "layer": plan.layer, "items": len(dataset), "batch_size": plan.batch_size, "data_blob": plan.data_blob,
                 "label_blob": plan.label_blob, "labels": dataset.has_labels,
                 "transform": plan.transformer.describe(), "resize": list(plan.resize) if plan.resize else None,
                 "channel_order": plan.channel_order, **({"image": plan.image} if plan.image else {})},
        "score_blob": score,
        "classes": num_classes,
        "targets": list(names),
        "results": results,
        "images": total,
        "errors": {"count": bad_count, "items": [{"index": int(i), "error": e} for i, e in bad]},
        "labels_out_of_range": {"count": oor_count,
                                "items": [{"index": int(i), "label": int(lab)} for i, lab in oor]},
        "device": str(dev),
        "workers": workers,
        "world_size": dist_env.world_size,
        "elapsed_s": wall,
        "images_per_s": total / wall if wall > 0 else None,
        "total_s": time.perf_counter() - started,
        "notes": notes,
    }


__all__ = [
    "evaluate",
    "format_table",
    "model_precision",
    "model_size_bytes",
]
