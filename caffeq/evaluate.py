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
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .data import (
    Collate,
    DataTransformer,
    Normalizer,
    Preprocess,
    StridedSampler,
    detect_kind,
    open_dataset,
    worker_init,
)
from .errors import DataError

TRANSFORM_KEYS = ("scale", "mean_file", "mean_value", "crop_size", "mirror", "force_color", "force_gray")
MAX_LISTED_ERRORS = 1000
PROBE_ITEMS = 16


# ---- what to read --------------------------------------------------------------------------------

@dataclass
class DataPlan:
    source: str
    kind: str
    batch_size: int
    transformer: DataTransformer
    data_blob: str
    label_blob: str = None
    layer: str = None               # the data layer it came from
    image: dict = field(default_factory=dict)   # root_folder, new_height, new_width, is_color
    resize: tuple = None
    channel_order: str = "BGR"
    roots: list = field(default_factory=list)   # where relative image paths are looked up
    notes: list = field(default_factory=list)


@dataclass
class LayerInfo:
    """A TEST-phase Data/ImageData layer: from a loaded graph node or straight from the prototxt."""
    type: str
    name: str
    tops: list
    attrs: dict


def data_layer(model):
    """The net's (TEST-phase) Data or ImageData layer as a LayerInfo, or None for a deploy net."""
    for node in model.graph.nodes:
        if node.spec.is_data and node.type in ("Data", "ImageData"):
            return LayerInfo(node.type, node.name, list(node.tops), node.attrs)
    return None


def phase_data_layer(net, phase, source, base_dir):
    """(LayerInfo, LayerParameter) of the net's Data/ImageData layer in `phase`, or (None, None).

    Its source is not opened.
    """
    from .ir import filter_layers
    from .layers import get_spec
    from .layers.registry import LayerError
    for lp in filter_layers(net, phase, source=source):
        if lp.type in ("Data", "ImageData"):
            try:
                attrs = get_spec(lp.type).parse(lp)
            except LayerError as e:
                raise LayerError(f"{source}: layer '{lp.name}' ({lp.type}): {e}") from None
            attrs["base_dir"] = base_dir
            return LayerInfo(lp.type, lp.name, list(lp.top), attrs), lp
    return None, None


def parse_resize(value):
    """'256x256', '256,256' or '256' -> (height, width)."""
    if value is None or isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    text = str(value).lower().replace(",", "x")
    try:
        parts = [int(p) for p in text.split("x")]
    except ValueError:
        raise DataError(f"--resize {value!r}: expected HEIGHTxWIDTH, e.g. 256x256") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or min(parts) < 1:
        raise DataError(f"--resize {value!r}: expected HEIGHTxWIDTH with positive sizes")
    return tuple(parts)


def plan_data(layer, inputs, base_dir, data=None, batch_size=None, transform=None, resize=None,
              channel_order=None, kind=None, prototxt=None):
    """Source, batch size, transform and blobs from the net's data layer (a LayerInfo, or None
    for a deploy net with `inputs` {blob: shape}) and the overrides."""
    from .layers.data import resolve_source
    transform = {k: v for k, v in (transform or {}).items() if v is not None}
    unknown = set(transform) - set(TRANSFORM_KEYS)
    if unknown:
        raise DataError(f"unknown transform option(s) {sorted(unknown)}; expected {list(TRANSFORM_KEYS)}")
    notes = []
    image = {}
    if layer is not None:
        attrs = layer.attrs
        t = dict(attrs["transform"])
        if t.get("mean_file"):
            t["mean_file"] = resolve_source(t["mean_file"], base_dir)
        data_blob = layer.tops[0]
        label_blob = layer.tops[1] if len(layer.tops) > 1 else None
        if data is None:
            source = resolve_source(attrs["source"], base_dir)
            if not os.path.exists(source):
                raise DataError(f"layer '{layer.name}' ({layer.type}): source '{attrs['source']}' not found "
                                f"(looked in {base_dir} and {os.getcwd()}); pass --data")
            roots = [base_dir, os.getcwd()]
        else:
            source = os.fspath(data)
            roots = [os.getcwd(), base_dir]
        layer_bs = attrs.get("batch_size") or None
        if layer.type == "ImageData":
            image = {"root_folder": attrs.get("root_folder", ""), "new_height": attrs.get("new_height", 0),
                     "new_width": attrs.get("new_width", 0), "is_color": attrs.get("is_color", True)}
            if attrs.get("shuffle"):
                notes.append(f"layer '{layer.name}': shuffle ignored (the evaluation reads in list order)")
        layer_name = layer.name
    else:
        if data is None:
            raise DataError(f"{prototxt or 'the model'}: a deploy net (no TEST-phase Data/ImageData "
                            f"layer); pass the data to evaluate (--data)")
        names = list(inputs)
        if len(names) != 1:
            raise DataError(f"the net has {len(names)} inputs {names}; eval feeds one image blob "
                            f"(use a net with one input, or a train_val net with a Data layer)")
        data_blob, label_blob, layer_bs, layer_name = names[0], None, None, None
        source = os.fspath(data)
        roots = [os.getcwd(), base_dir]
        t = {}
    # flags replace the layer's values; a mean of one kind replaces the other kind
    if "mean_file" in transform:
        t.pop("mean_value", None)
    if "mean_value" in transform:
        t.pop("mean_file", None)
    t.update(transform)
    if t.get("mirror"):
        notes.append("mirror ignored at TEST (Caffe would flip at random; the evaluation stays deterministic)")
    transformer = DataTransformer(scale=t.get("scale", 1.0), mean_file=t.get("mean_file"),
                                  mean_value=t.get("mean_value") or (), crop_size=t.get("crop_size", 0) or 0,
                                  mirror=t.get("mirror", False), force_color=t.get("force_color", False),
                                  force_gray=t.get("force_gray", False), phase="TEST")
    if layer is None and transformer.is_identity:
        notes.append("no mean or scale given: the net sees raw pixel values (see --mean-file, --mean-value, "
                     "--scale)")
    if not image:
        if t.get("force_color") or t.get("force_gray"):
            is_color = bool(t.get("force_color"))
        elif layer is not None:
            is_color = None      # a Data layer decodes images natively (DecodeDatumToCVMatNative)
        else:
            shape = inputs.get(data_blob)
            is_color = not (shape is not None and len(shape) > 1 and shape[1] == 1)
        image = {"is_color": is_color}
    kind = kind or detect_kind(source)
    bs = int(batch_size or layer_bs or 64)
    if bs < 1:
        raise DataError(f"--batch-size must be >= 1, got {bs}")
    return DataPlan(source=source, kind=kind, batch_size=bs, transformer=transformer, data_blob=data_blob,
                    label_blob=label_blob, layer=layer_name, image=image, resize=parse_resize(resize),
                    channel_order=(channel_order or "BGR").upper(), roots=roots, notes=notes)


def build_dataset(plan, limit=None, defer_normalize=True, seed=0):
    pre = Preprocess(plan.transformer, plan.channel_order, defer_normalize=defer_normalize, seed=seed)
    t = plan.transformer
    img = plan.image
    if plan.kind == "image_list":
        from .data import ImageListDataset
        nh, nw = img.get("new_height", 0), img.get("new_width", 0)
        if not (nh or nw) and plan.resize:
            nh, nw = plan.resize
        return ImageListDataset(plan.source, pre, root_folder=img.get("root_folder", ""), new_height=nh,
                                new_width=nw, is_color=img.get("is_color", True), roots=plan.roots,
                                limit=limit)
    return open_dataset(plan.source, plan.kind, pre, limit, is_color=img.get("is_color", True),
                        force_color=t.force_color, force_gray=t.force_gray, resize=plan.resize)


def as_input_layer(lp, shapes):
    """Turn a data layer into an Input layer with these top shapes (its name, tops and phase rules kept)."""
    include = [type(r)() for r in lp.include]
    for new, old in zip(include, lp.include):
        new.CopyFrom(old)
    name, tops = lp.name, list(lp.top)
    lp.Clear()
    lp.name, lp.type = name, "Input"
    lp.top.extend(tops)
    for r in include:
        lp.include.add().CopyFrom(r)
    for shape in shapes:
        lp.input_param.shape.add().dim.extend(int(d) for d in shape)


# ---- the nets --------------------------------------------------------------------------------

def _score_blob(model, label_blob, output=None):
    """The blob whose argmax is the prediction: what the Accuracy (or loss) layer reads, else the
    net's output."""
    blobs = model.blob_shapes
    if output is not None:
        if output not in blobs:
            raise DataError(f"--output '{output}': no such blob (blobs: {', '.join(list(blobs)[:12])}...)")
        return output
    for types in (("Accuracy",), ("SoftmaxWithLoss", "MultinomialLogisticLoss", "InfogainLoss",
                                  "SigmoidCrossEntropyLoss", "HingeLoss")):
        for node in model.graph.nodes:
            if node.type in types and len(node.bottoms) >= 2 and (label_blob is None or
                                                                   node.bottoms[1] == label_blob):
                return node.bottoms[0]
    training_only = _training_only_tensors(model)
    tensors = model.graph.tensors
    cands = [o for o in model.graph.outputs if o not in training_only and tensors[o].shape]
    if not cands:
        raise DataError(f"the net's outputs {model.outputs} hold no per-image scores; name the blob "
                        f"with --output")
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
        quant = getattr(node, "quant", None) or {}
        for i, b in enumerate(node.blobs):
            if b is None or i in node.shared_from:
                continue
            total += quant[i].compact_nbytes() if i in quant else 4 * int(np.size(b))
    return total


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


# ---- per-target accumulation -------------------------------------------------------------------

# slots of the float64 sum vector
N, LABELED, TOP1, TOP5, POS, AGREE, ABS, ELEMS, COS = range(9)
NSLOTS = 9


class _Acc:
    """Sums of one target's metrics, kept on the device (no sync per batch)."""

    def __init__(self, device, layer_names):
        self.sums = torch.zeros(NSLOTS + len(layer_names), dtype=torch.float64, device=device)
        self.max_abs = torch.zeros((), dtype=torch.float64, device=device)
        self.layer_names = list(layer_names)
        self.seconds = 0.0


def _flat_scores(s, n):
    """(n, C) for per-image scores; (n, C, P) when each image has P positions."""
    if s.dim() == 0:
        s = s.reshape(1, 1)
    s = s.reshape(n, s.shape[1] if s.dim() > 1 else 1, -1).float()
    return s


def _batch_stats(acc, out, score, metric_names, labels, labeled, ref, n):
    s = _flat_scores(out[score], n)
    c = s.shape[1]
    parts = torch.zeros(NSLOTS, dtype=torch.float64, device=s.device)
    parts[N] = n
    if labels is not None and s.shape[2] == 1:
        x = s[:, :, 0]
        lab = labels.clamp(0, max(c - 1, 0))
        true = x.gather(1, lab[:, None])
        # Caffe's AccuracyLayer: every class scoring >= the true one counts, the true one included
        better = (x >= true).sum(1) - 1
        ok = labeled & torch.isfinite(true[:, 0])
        parts[LABELED] = labeled.sum()
        parts[TOP1] = ((better < 1) & ok).sum()
        parts[TOP5] = ((better < 5) & ok).sum()
    if ref is not None:
        r = ref
        parts[POS] = s.shape[0] * s.shape[2]
        parts[AGREE] = (s.argmax(1) == r.argmax(1)).sum()
        d = (s.double() - r.double()).abs()
        parts[ABS] = d.sum()
        parts[ELEMS] = d.numel()
        if d.numel():
            acc.max_abs = torch.maximum(acc.max_abs, d.max())
        a, b = s.reshape(n, -1).double(), r.reshape(n, -1).double()
        parts[COS] = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-12).sum()
    # a target that cannot compute a metric layer (static int8 runs the inference graph) adds 0
    layer_vals = [out[m].double().reshape(()) * n if m in out else parts.new_zeros(()) for m in metric_names]
    acc.sums[:NSLOTS] += parts
    if layer_vals:
        acc.sums[NSLOTS:] += torch.stack(layer_vals)
    return s


# ---- the evaluation ---------------------------------------------------------------------------

def evaluate(model, data=None, targets=("fp32",), *, weights=None, batch_size=None, device="auto",
             workers=0, limit=None, strict=False, transform=None, resize=None, channel_order=None,
             kind=None, output=None, keep=None, progress=False, distributed=None, phase="TEST",
             ignore_unknown=False, exact=False, compile=False, calibrate=None, calibrate_images=256):
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
    base, plan, dataset = _prepare(model, data, weights, phase, ignore_unknown, limit, opts)
    dev = _device(device)
    dist_env = _Dist(distributed, dev)
    try:
        modes = {"exact": exact, "compile": compile, "calibrate": calibrate,
                 "calibrate_images": calibrate_images}
        return _evaluate(base, plan, dataset, names, dev, dist_env, workers=int(workers), strict=strict,
                         output=output, keep=keep, progress=progress, started=started, modes=modes)
    finally:
        dist_env.close()


def _prepare(model, data, weights, phase, ignore_unknown, limit, opts):
    """-> (Model, DataPlan, dataset).

    A train_val prototxt whose source is replaced (`data=`) is loaded with its data layer turned
    into an Input layer shaped like the new data, so that the old source need not exist.
    """
    from .model import Model, load, read_net
    if not isinstance(model, Model):
        path = os.fspath(model)
        if path.endswith(".caffeq") or data is None:
            model = load(path, weights, phase=phase, ignore_unknown=ignore_unknown)
        else:
            warnings = []
            net = read_net(path, ignore_unknown=ignore_unknown, warnings=warnings)
            base_dir = os.path.dirname(os.path.abspath(path))
            layer, lp = phase_data_layer(net, phase, path, base_dir)
            if layer is None:
                model = load(path, weights, phase=phase, net=net)
            else:
                plan = plan_data(layer, None, base_dir, data, prototxt=path, **opts)
                dataset = build_dataset(plan, limit)
                shape = _probe(dataset, None, plan)
                dataset.close()
                n = plan.batch_size
                as_input_layer(lp, [(n,) + tuple(shape)] + [(n,)] * (len(layer.tops) - 1))
                model = load(path, weights, phase=phase, net=net)
                model.warnings[:0] = warnings
                return model, plan, dataset
    plan = plan_data(data_layer(model), model.inputs, model._base_dir(), data, prototxt=model.prototxt, **opts)
    dataset = build_dataset(plan, limit)
    _probe(dataset, tuple(model.inputs[plan.data_blob][1:]), plan)
    dataset.close()
    return model, plan, dataset


def _probe(dataset, expected, plan):
    """The shape of the first readable item; fail early, with a hint, when it cannot fit the net."""
    first_err = None
    for i in range(min(len(dataset), PROBE_ITEMS)):
        _, img, _, err = dataset[i]
        if err is not None:
            first_err = first_err or err
            continue
        if expected is not None and tuple(img.shape) != tuple(expected):
            raise DataError(f"{plan.source}: items are {'x'.join(map(str, img.shape))} after preprocessing "
                            f"but the net's input '{plan.data_blob}' takes {'x'.join(map(str, expected))}; "
                            f"set --resize HxW / --crop-size (or the channel count: force_color/force_gray)")
        return tuple(img.shape)
    if first_err is not None:
        raise DataError(f"none of the first {min(len(dataset), PROBE_ITEMS)} items can be read; "
                        f"the first: {first_err}")
    if expected is None:
        raise DataError(f"{plan.source}: no items to evaluate")
    return tuple(expected)


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
            if t == "int8" and calibrate is not None:
                from .quant.static_int8 import eval_module
                m, mod, missing, notes = eval_module(base, plan, wanted, calibrate, calibrate_images,
                                                     keep=keep)
                self.models[t], self.modules[t] = m, (mod, None)
                self.missing_metrics[t] = missing
                self.notes.extend(f"{t}: {n}" for n in notes)
                continue
            m = base if t == "fp32" else quantize(base, t, keep=keep)
            if t != "fp32":
                rep = getattr(m, "quant_report", None)
                self.notes.extend(f"{t}: {n}" for n in getattr(rep, "notes", []) or [])
            self.models[t] = m
            dtype = compute_dtype(t, device)
            self.modules[t] = (_module(m, wanted, device, dtype, exact=exact, compile=compile), dtype)
        t = plan.transformer
        self.normalizer = Normalizer(t.mean_for(_raw_shape(plan, self.expected)), t.scale)
        self.on_device = device.type == "cuda"
        self.accs = {t: _Acc(device, self.metric_names) for t in self.names}
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
            if self.on_device:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            xin = x if dtype is None else x.to(dtype)
            feed = [xin] if feed_label is None else _ordered_feed(gm, self.plan, xin, feed_label)
            out = gm(*feed)
            s = _batch_stats(acc, out, self.score, self.metric_names, lab, labeled, ref, n)
            if t == "fp32":
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
    runner = Runner(base, plan, names, dev, keep=keep, output=output, has_labels=dataset.has_labels,
                    **(modes or {}))
    sampler = StridedSampler(len(dataset), dist_env.rank, dist_env.world_size)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=plan.batch_size, sampler=sampler, num_workers=workers,
        collate_fn=runner.collate(), pin_memory=runner.on_device,
        worker_init_fn=worker_init if workers else None, prefetch_factor=4 if workers else None)
    bad, bad_count, oor, oor_count = [], 0, [], 0
    bar = None
    if progress and dist_env.rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=len(sampler), unit="img", desc="eval", file=sys.stderr, dynamic_ncols=True,
                   smoothing=0.1)
    loop_start = time.perf_counter()
    try:
        with torch.inference_mode():
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
                if bar is not None:
                    bar.update(int(batch["index"].shape[0]) + len(batch["bad"]))
        runner.sync()
    finally:
        if bar is not None:
            bar.close()
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


def _frac(num, den):
    return float(num) / float(den) if den else None


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
            r["top1"] = _frac(s[TOP1], s[LABELED])
            r["top5"] = _frac(s[TOP5], s[LABELED])
        if metric_names:
            missing = runner.missing_metrics.get(t, ())
            r["layers"] = {m: None if m in missing else _frac(s[NSLOTS + j], n)
                           for j, m in enumerate(metric_names)}
        if t != "fp32":
            r["agreement_top1"] = _frac(s[AGREE], s[POS])
            r["mean_abs_diff"] = _frac(s[ABS], s[ELEMS])
            r["max_abs_diff"] = float(maxes[k]) if n else None
            r["cosine"] = _frac(s[COS], n)
        r["images_per_s"] = n / float(secs[k]) if secs[k] > 0 else None
        r["model_seconds"] = float(secs[k])
        r["model_size_bytes"] = model_size_bytes(models[t])
        rep = getattr(models[t], "quant_report", None)
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


def format_table(result):
    """The side-by-side table of targets (percentages for reading; the JSON keeps fractions)."""
    res = result["results"]
    names = list(res)
    layer_names = []
    for r in res.values():
        for m in (r.get("layers") or {}):
            if m not in layer_names:
                layer_names.append(m)
    cols = [("target", lambda t, r: t)]
    if any("top1" in r for r in res.values()):
        cols += [("top-1", lambda t, r: _pct(r.get("top1"))), ("top-5", lambda t, r: _pct(r.get("top5")))]
    for m in layer_names:
        cols.append((m, lambda t, r, m=m: _num((r.get("layers") or {}).get(m))))
    if len(names) > 1:
        cols += [("agree@1", lambda t, r: _pct(r.get("agreement_top1")) if t != "fp32" else "-"),
                 ("cosine", lambda t, r: _num(r.get("cosine"), 5) if t != "fp32" else "-"),
                 ("mean|d|", lambda t, r: _num(r.get("mean_abs_diff")) if t != "fp32" else "-"),
                 ("max|d|", lambda t, r: _num(r.get("max_abs_diff")) if t != "fp32" else "-")]
    cols += [("images/s", lambda t, r: f"{r['images_per_s']:.0f}" if r.get("images_per_s") else "-"),
             ("size", lambda t, r: _size(r.get("model_size_bytes")))]
    rows = [[c[0] for c in cols]] + [[c[1](t, res[t]) for c in cols] for t in names]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(v):
    return "-" if v is None else f"{100 * v:.2f}%"


def _num(v, digits=4):
    if v is None:
        return "-"
    return f"{v:.{digits}g}"


def _size(b):
    if b is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


__all__ = [
    "DataPlan",
    "build_dataset",
    "evaluate",
    "format_table",
    "model_size_bytes",
    "parse_resize",
    "plan_data",
]
