"""Which layers can take binary weights: per-layer sensitivity and the budget rule.

    >>> from caffeq.sensitivity import layer_sensitivity, choose_keep
    >>> table = layer_sensitivity("train_val.prototxt", weights="model.caffemodel")
    >>> [(r["layer"], r["drop"]) for r in table["layers"]]      # most sensitive first
    >>> choose_keep(table, budget=1.0)                           # layers to keep fp32

Each weighted layer is quantized alone (every other layer fp32) and the
model's top-1 on the data is compared with the fp32 model's; the drop is in
points of top-1 (percentage points).  Without labels the metric is top-1
agreement with the fp32 model, and the drop is 100 x (1 - agreement).  All
variants run on the same batches in one pass over the data (one torch
module, the weights swapped in and out), then, for the curve of accuracy
versus the number of quantized layers, a second pass quantizes the layers
cumulatively, least sensitive first.

The budget rule.  The drop of quantizing a set of layers is estimated as the
sum of their individual drops (negative drops count as 0).  choose_keep keeps
fp32 the fewest layers that bring that estimate within the budget: the most
sensitive first, which is optimal for a sum.
"""
import math
import os

import numpy as np
import torch

from .backends.torch_backend import resolve_device
from .data.plan import build_dataset, data_layer, phase_data_layer, plan_data
from .errors import CaffeqError, DataError
from .fs import atomic_path, format_count
from .model import Model, load, read_net
from .quant import default_kept_layers, get_quantizer, quantize
from .training.feeding import (
    Feeder,
    count_correct,
    load_phase,
    make_loader,
    module_with_outputs,
    probe_shape,
    score_blob,
)
from .training.ste import caffe_layers


class SensitivityError(CaffeqError):
    """A bad sensitivity request."""


TARGETS = ("binary", "int8")


# ---- the budget rule --------------------------------------------------------------------------

def _rows(table):
    """(name, drop) pairs from a sensitivity result, a list of rows or a {layer: drop} mapping."""
    if isinstance(table, dict) and "layers" in table and not isinstance(table["layers"], (int, float)):
        table = table["layers"]
    if isinstance(table, dict):
        items = list(table.items())
    else:
        items = []
        for r in table:
            if isinstance(r, dict):
                items.append((r["layer"], r["drop"]))
            else:
                name, drop = r
                items.append((name, drop))
    out = []
    for name, drop in items:
        d = float(drop)
        if math.isnan(d):
            raise SensitivityError(f"layer '{name}': its drop is not a number")
        out.append((str(name), d))
    return out


def check_budget(budget):
    """A budget in points of top-1 (a finite number >= 0), or SensitivityError."""
    try:
        b = float(budget)
    except (TypeError, ValueError):
        raise SensitivityError(f"--budget must be a number of top-1 points, got {budget!r}") from None
    if not math.isfinite(b) or b < 0:
        raise SensitivityError(f"--budget must be >= 0 points of top-1, got {budget!r}")
    return b


def estimated_drop(table, keep=()):
    """Estimated drop (points) when every layer of the table except `keep` is quantized."""
    keep = set(keep or ())
    return float(sum(max(d, 0.0) for name, d in _rows(table) if name not in keep))


def choose_keep(table, budget):
    """The fewest layers to keep fp32 so that the estimated drop is within `budget` points:
    the most sensitive first (ties: table order).  Returns their names, most sensitive first."""
    budget = check_budget(budget)
    rows = _rows(table)
    order = sorted(range(len(rows)), key=lambda k: (-rows[k][1], k))
    total = sum(max(d, 0.0) for _, d in rows)
    keep = []
    for k in order:
        if total <= budget + 1e-9:
            break
        name, d = rows[k]
        keep.append(name)
        total -= max(d, 0.0)
    return keep


# ---- measuring ---------------------------------------------------------------------------------

def _quantized_blobs(model, target):
    """{layer: {blob index: float32 array}} of every layer the target would change (keep none)."""
    q = quantize(model, target, keep="none")
    out = {}
    for node in q.graph.nodes:
        quant = node.quant
        if quant:
            out[node.name] = {i: np.asarray(node.blobs[i], np.float32) for i in quant}
    return out, q.quant_report


class _Swapper:
    """Swaps layers' weight tensors between fp32 and quantized values in one module."""

    def __init__(self, gm, qblobs, device):
        mods = caffe_layers(gm)
        self.slots = {}
        for name, blobs in qblobs.items():
            mod = mods.get(name)
            if mod is None:
                continue
            slots = []
            for i, arr in blobs.items():
                p = getattr(mod, mod.blob_attrs[i])
                q = torch.from_numpy(np.array(arr, np.float32)).to(device=device, dtype=p.dtype).reshape(p.shape)
                slots.append((p, p.detach().clone(), q))
            self.slots[name] = slots

    @property
    def layers(self):
        return list(self.slots)

    def set(self, quantized):
        """Quantize exactly the layers in `quantized`."""
        with torch.no_grad():
            for name, slots in self.slots.items():
                for p, fp, q in slots:
                    p.copy_(q if name in quantized else fp)


def measure_sensitivity(model, loader, feeder, score, target="binary", cumulative=True, progress=False,
                        has_labels=True):
    """The sensitivity table of `model` over `loader` (see layer_sensitivity)."""
    qblobs, _ = _quantized_blobs(model, target)
    if not qblobs:
        raise SensitivityError(f"no layer of the net has weights that --to {target} changes")
    dev = feeder.device
    gm = module_with_outputs(model, [score], dev).eval()
    swap = _Swapper(gm, qblobs, dev)
    layers = [n.name for n in model.graph.nodes if n.name in swap.slots]
    ends = set(default_kept_layers(model.graph))

    def one_pass(configs, desc):
        """configs: [(key, set of quantized layers)] -> ({key: correct}, labeled, {key: agree}, total)."""
        correct = {k: 0 for k, _ in configs}
        agree = {k: 0 for k, _ in configs}
        labeled = total = items = 0
        from .progress import progress_bar
        bar = progress_bar(len(loader), desc, unit="batch", enabled=progress, leave=False)  # terminal only
        with torch.no_grad():
            for batch in loader:
                inputs = feeder(batch)
                if inputs is None:
                    continue
                labels = batch["label"].to(dev) if has_labels else None
                swap.set(())
                ref = gm(*inputs)[score]
                ref_pred = ref.reshape(ref.shape[0], ref.shape[1], -1).argmax(1)
                if labels is not None:
                    c, n = count_correct(ref, labels)
                    correct["fp32"] = correct.get("fp32", 0) + c
                    labeled += n
                total += int(ref_pred.numel())
                items += int(ref.shape[0])
                for key, quantized in configs:
                    swap.set(quantized)
                    s = gm(*inputs)[score]
                    if labels is not None:
                        correct[key] += count_correct(s, labels)[0]
                    agree[key] += int((s.reshape(s.shape[0], s.shape[1], -1).argmax(1) == ref_pred).sum())
                bar.update(1)
        bar.close()
        swap.set(())
        return correct, labeled, agree, total, items

    singles = [(name, {name}) for name in layers]
    extra = [("__all__", set(layers)), ("__default__", set(layers) - ends)]
    correct, labeled, agree, total, items = one_pass(singles + extra, "sensitivity")
    if items == 0:
        raise DataError("sensitivity: no usable items in the data")
    use_top1 = has_labels and labeled > 0
    metric = "top1" if use_top1 else "agreement_top1"

    def value(key):
        if use_top1:
            return correct[key] / labeled
        return agree[key] / total if key != "fp32" else 1.0

    fp32 = value("fp32")
    nodes = {n.name: n for n in model.graph.nodes}
    rows = []
    for name in layers:
        v = value(name)
        node = nodes[name]
        params = int(sum(np.size(b) for i, b in enumerate(node.blobs or []) if i not in node.shared_from))
        rows.append({"layer": name, "type": node.type, "params": params, metric: v,
                     "agreement_top1": agree[name] / total if total else None,
                     "drop": round(100.0 * (fp32 - v), 6)})
    order = sorted(range(len(rows)), key=lambda k: (-rows[k]["drop"], k))
    rows = [rows[k] for k in order]
    result = {"target": target, "metric": metric, "fp32": fp32, "images": items,
              "layers": rows, "all": value("__all__"), "default": value("__default__"),
              "default_kept": [n for n in layers if n in ends], "model": getattr(model, "prototxt", None)}

    if cumulative:
        # least sensitive first: k quantized layers = all but the most sensitive len - k
        least_first = [r["layer"] for r in reversed(rows)]
        configs = [(f"__cum{k}__", set(least_first[:k])) for k in range(1, len(least_first) + 1)]
        c2, lab2, a2, t2, _ = one_pass(configs, "cumulative")
        curve = [{"quantized": 0, "layers": [], metric: fp32, "estimated": fp32}]
        est = fp32
        for k, (key, _) in enumerate(configs, start=1):
            v = c2[key] / lab2 if use_top1 else a2[key] / t2
            name = least_first[k - 1]
            d = next(r["drop"] for r in rows if r["layer"] == name)
            est = est - max(d, 0.0) / 100.0
            curve.append({"quantized": k, "layers": least_first[:k], metric: v, "estimated": est})
        result["cumulative"] = curve
    return result


def prepare_data(model, data=None, *, weights=None, batch_size=None, device="cpu", workers=0, limit=None,
                 transform=None, resize=None, channel_order=None, kind=None, phase="TEST"):
    """(Model with Input layers for its data layer, loader, feeder, score blob, DataPlan) for a
    model path or caffeq.Model and a data source (default: the TEST-phase data layer's)."""
    dev = resolve_device(device)
    if data is not None and not os.path.exists(os.fspath(data)):
        raise DataError(f"--data {data}: data source not found")
    opts = {"batch_size": batch_size, "transform": transform, "resize": resize,
            "channel_order": channel_order, "kind": kind}
    if isinstance(model, Model):
        plan = plan_data(data_layer(model), model.inputs, model._base_dir(), data, prototxt=model.prototxt,
                         **opts)
        dataset = build_dataset(plan, limit, defer_normalize=False)
        shape = probe_shape(dataset, plan.source)
        loaded = model
    else:
        path = os.fspath(model)
        if path.endswith(".caffeq"):
            loaded = load(path, phase=phase)
            return prepare_data(loaded, data, device=dev, workers=workers, limit=limit, **opts)
        if not os.path.exists(path):
            raise DataError(f"{path}: no such file")
        net = read_net(path)
        base_dir = os.path.dirname(os.path.abspath(path))
        info, _ = phase_data_layer(net, phase, path, base_dir)
        inputs = None
        if info is None:
            loaded = load(path, weights, phase=phase, net=net)
            inputs = loaded.inputs
        plan = plan_data(info, inputs, base_dir, data, prototxt=path, **opts)
        dataset = build_dataset(plan, limit, defer_normalize=False)
        shape = probe_shape(dataset, plan.source)
        if info is not None:
            loaded = load_phase(path, weights, net, phase, shape, plan.batch_size)
    if plan.data_blob not in loaded.inputs:
        raise DataError(f"the net has no input '{plan.data_blob}'")
    want = tuple(loaded.inputs[plan.data_blob][1:])
    if want != tuple(shape):
        raise DataError(f"{plan.source}: items are {'x'.join(map(str, shape))} after preprocessing but the "
                        f"net's input '{plan.data_blob}' takes {'x'.join(map(str, want))}; set --resize / "
                        f"--crop-size")
    if any(n.has_params and n.blobs is None for n in loaded.graph.nodes):
        raise DataError(f"{loaded.prototxt}: no weights loaded; pass --weights")
    dataset.close()
    label = plan.label_blob if plan.label_blob in loaded.inputs else None
    loader = make_loader(dataset, plan.batch_size, workers, dev, None, shape)
    score = score_blob(loaded, label)
    feeder = Feeder.for_model(loaded, plan.data_blob, label, dev)
    return loaded, loader, feeder, score, plan


def layer_sensitivity(model, data=None, target="binary", *, weights=None, batch_size=None, device="cpu",
                      workers=0, limit=None, transform=None, resize=None, channel_order=None, kind=None,
                      cumulative=True, progress=False):
    """Quantize one layer at a time and measure each one's drop -> a dict:

    {"target", "metric" ("top1" or "agreement_top1"), "fp32", "images",
     "layers": [{"layer", "type", "params", <metric>, "agreement_top1", "drop"}] most sensitive first
              (drop in points),
     "all": every layer quantized, "default": the first/last weighted layers kept,
     "cumulative": [{"quantized": k, "layers", <metric>, "estimated"}] (least sensitive first),
     "warnings": what loading the model said}
    """
    t = str(target).strip().lower()
    t = get_quantizer(t).name
    if t not in TARGETS:
        raise SensitivityError(f"--to {target}: sensitivity is measured for {', '.join(TARGETS)}")
    loaded, loader, feeder, score, plan = prepare_data(
        model, data, weights=weights, batch_size=batch_size, device=device, workers=workers, limit=limit,
        transform=transform, resize=resize, channel_order=channel_order, kind=kind)
    if any(loaded.quantization):
        raise SensitivityError("the model is already quantized; measure the fp32 model")
    result = measure_sensitivity(loaded, loader, feeder, score, t, cumulative=cumulative, progress=progress,
                                 has_labels=loader.dataset_has_labels)
    result["data"] = {"source": plan.source, "kind": plan.kind, "batch_size": plan.batch_size}
    result["model"] = loaded.prototxt
    result["name"] = loaded.name
    result["score_blob"] = score
    result["warnings"] = list(loaded.warnings)
    return result


def keep_for_budget(model, budget, data=None, target="binary", **kwargs):
    """(layers to keep fp32, sensitivity table) for a budget in points of top-1 (convert --budget)."""
    check_budget(budget)
    table = layer_sensitivity(model, data, target, cumulative=False, **kwargs)
    return choose_keep(table, budget), table


# ---- reporting -----------------------------------------------------------------------------------

def _pct(v):
    return "-" if v is None else f"{100 * v:.2f}%"


def format_table(result, budget=None):
    m = result["metric"]
    label = "top-1" if m == "top1" else "agree@1"
    rows = [["layer", "type", "params", label, "drop (points)"]]
    for r in result["layers"]:
        rows.append([r["layer"], r["type"], format_count(r["params"]), _pct(r[m]), f"{r['drop']:.2f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    kept = ", ".join(result.get("default_kept") or []) or "none"
    lines.append(f"fp32 {_pct(result['fp32'])}; every layer {result['target']}: {_pct(result['all'])}; "
                 f"first/last kept ({kept}): {_pct(result['default'])}")
    curve = result.get("cumulative")
    if curve:
        lines.append(f"{label} vs number of {result['target']} layers (least sensitive first; estimate = fp32 "
                     f"minus the sum of single-layer drops):")
        for c in curve:
            added = c["layers"][-1] if c["layers"] else "-"
            lines.append(f"  {c['quantized']:3d}  +{added:<20s} {_pct(c[m]):>8s}  (estimate {_pct(c['estimated'])})")
    if budget is not None:
        keep = choose_keep(result, budget)
        lines.append(f"budget {float(budget):g} points: keep fp32 {', '.join(keep) if keep else 'nothing'} "
                     f"(estimated drop {estimated_drop(result, keep):.2f} points)")
    return "\n".join(lines)


def plot_sensitivity(result, path, title=None):
    """A PNG: per-layer drop (bars, most sensitive on top) and accuracy versus the number of
    quantized layers (measured and estimated).  Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SensitivityError("--plot needs matplotlib (pip install matplotlib, or 'caffeq[plot]')") from None
    m = result["metric"]
    label = "top-1 (%)" if m == "top1" else "top-1 agreement with fp32 (%)"
    rows = result["layers"]
    curve = result.get("cumulative")
    ncols = 2 if curve else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, max(3.0, 0.35 * len(rows) + 1.5)), squeeze=False)
    ax = axes[0][0]
    names = [r["layer"] for r in rows][::-1]
    drops = [r["drop"] for r in rows][::-1]
    ax.barh(names, drops, color=["#c0392b" if d > 0 else "#7f8c8d" for d in drops])
    ax.set_xlabel(f"drop in {'top-1' if m == 'top1' else 'agreement'} (points), one layer {result['target']}")
    ax.set_title("per-layer sensitivity")
    ax.axvline(0, color="black", linewidth=0.8)
    lo, hi = min(drops + [0.0]), max(drops + [0.0])
    ax.set_xlim(lo - 0.05 * (hi - lo or 1), hi + 0.18 * (hi - lo or 1))   # room for the labels
    for y, d in enumerate(drops):
        ax.text(d, y, f" {d:.2f}", va="center", fontsize=8)
    if curve:
        ax2 = axes[0][1]
        ks = [c["quantized"] for c in curve]
        ax2.plot(ks, [100 * c[m] for c in curve], "o-", label="measured")
        ax2.plot(ks, [100 * c["estimated"] for c in curve], "s--", alpha=0.7, label="estimated (sum of drops)")
        ax2.axhline(100 * result["fp32"], color="gray", linestyle=":", label="fp32")
        ax2.set_xticks(ks)
        ax2.set_xticklabels([str(k) + ("\n+" + c["layers"][-1] if c["layers"] else "") for k, c in zip(ks, curve)],
                            fontsize=8)
        ax2.set_xlabel(f"layers {result['target']} (least sensitive first)")
        ax2.set_ylabel(label)
        ax2.set_title(f"{label.split(' (')[0]} vs number of {result['target']} layers")
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


__all__ = ["SensitivityError", "check_budget", "choose_keep", "estimated_drop", "format_table", "keep_for_budget",
           "layer_sensitivity", "measure_sensitivity", "plot_sensitivity", "prepare_data"]
