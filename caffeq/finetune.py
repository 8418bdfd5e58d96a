"""Recover the accuracy of binary-weight models: STE fine-tuning and BatchNorm re-estimation.

    >>> from caffeq.finetune import finetune
    >>> r = finetune("train_val.prototxt", "model.caffemodel", epochs=8)
    >>> r.model                          # a binary caffeq.Model (node.quant set): export, save, evaluate
    >>> r.best_epoch, r.best_metric, r.history

Signs of a float-trained model's weights are not a binary-weight network.
Two remedies, cheapest first:

BatchNorm re-estimation (`bn_only=True`).  Binarizing changes every
activation's mean and variance, so the stored statistics no longer match.
With the weights binarized, each BatchNorm layer's statistics are measured
again on training batches: one forward pass in which the BatchNorm layers
normalize by batch statistics (as in training; Dropout and the rest stay in
inference mode) while the exact mean and variance of every value reaching
the layer are accumulated in float64 (Chan's pairwise combination, so the
result equals the statistics of all those values at once).  They are written
in Caffe's layout: mean, variance (the biased, population variance: with
them the TEST-phase output reproduces the training-mode output of the same
data exactly) and factor 1, so Caffe and caffeq read them back unchanged.

Straight-through fine-tuning.  The forward pass uses W_b = alpha_c * sign(W)
per output channel c, with alpha_c = mean(|W_c|) and sign(0) = +1, recomputed
from the latent float weights W at every step (a torch parametrization, so
every forward sees the current latent weights).  The backward pass is the
exact derivative of alpha_c * sign(W) with the sign's derivative replaced by
the straight-through estimator 1[|w| <= 1] (BinaryConnect / XNOR-Net):

    dL/dw_i = alpha_c * g_i * 1[|w_i| <= 1]  +  (s_i / n_c) * sum_j g_j s_j

where g = dL/dW_b, s = sign(W) and n_c the elements of channel c (the second
term is alpha's own gradient).  After each step the latent weights of
binarized layers are clipped to [-1, 1], the STE window, so they cannot drift
where their sign no longer learns.  Caffe-trained weights lie mostly well
inside that window.  Other parameters (kept layers, biases, Scale, PReLU)
train in fp32; BatchNorm layers use batch statistics and update Caffe's
mean/variance/factor accumulators as Caffe's training does (also where the
prototxt sets use_global_stats: true: binary weights change the statistics).
Before each validation the statistics are re-estimated for the current
weights as above (`bn_reestimate`), because the running average mixes batches
seen under older weights.  The best epoch (validation top-1, or agreement
with the fp32 model for unlabeled data; epoch 0 is the binarized model before
any step) is kept, and its latent weights are quantized with
caffeq.quantize, so the result is a proper binary model.

Determinism: torch.manual_seed(seed), the data order drawn from a generator
seeded by (seed, epoch), and random crops/mirrors seeded per (seed, epoch,
item), so a run is reproducible on the same machine and torch build.

Ctrl-C (KeyboardInterrupt) during training stops it: the result holds the best epoch so far and
`interrupted` is True (the command line writes it, says so, and exits 130).

The pieces live in caffeq.training (ste, batchnorm, feeding); this module checks the request
(FinetuneConfig), prepares data and nets, and runs the steps (_Session).
"""

import copy
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace

import torch
from torch import nn

from .backends.torch_backend import resolve_device
from .data.plan import build_dataset, phase_data_layer, plan_data
from .errors import DataError
from .model import load, read_net
from .progress import tracked
from .quant import get_quantizer, quantize
from .sensitivity import choose_keep, estimated_drop, measure_sensitivity
from .training import FinetuneError
from .training.batchnorm import batchnorm_modules, force_batch_statistics, reestimate_batchnorm
from .training.feeding import (
    EpochSampler,
    EpochView,
    Feeder,
    load_output_model,
    load_phase,
    logits_blob,
    loss_tops,
    make_loader,
    module_with_outputs,
    predict,
    probe_shape,
    score_blob,
    train_transformer,
)
from .training.ste import (
    STE_CLIP,
    BinarizeWeight,
    SignSTE,
    binarize_module,
    binarize_ste,
    caffe_layers,
    channel_mean,
    clip_latent,
    copy_layer_state,
    sign_pm1,
    snapshot,
    with_trained_weights,
)

OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("cosine", "step", "constant")
DEFAULT_LR = {"adam": 1e-3, "sgd": 0.01}


# ---- the request ------------------------------------------------------------------------------

@dataclass
class FinetuneConfig:
    """Every option of finetune() with its default; `checked()` validates and normalizes them.

    data / val: training and validation sources (default: the prototxt's TRAIN- and TEST-phase
    Data/ImageData layers).  keep / only: as caffeq.quantize.  budget: points of top-1; the layers
    kept fp32 are chosen from a sensitivity analysis on the validation data (caffeq.sensitivity).
    iters: stop after this many steps in all (the schedule spans them).  bn_batches: training
    batches for each BatchNorm re-estimation.  limit / val_limit: use only the first N items.
    """
    target: str = "binary"
    data: str = None
    val: str = None
    keep: object = None
    only: object = None
    epochs: int = 8
    iters: int = None
    lr: float = None
    batch_size: int = None
    optimizer: str = "adam"
    schedule: str = "cosine"
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"
    workers: int = 0
    bn_only: bool = False
    bn_batches: int = 200
    bn_reestimate: bool = True
    budget: float = None
    limit: int = None
    val_limit: int = None
    transform: object = None
    resize: object = None
    channel_order: object = None
    shuffle: bool = True
    progress: bool = False

    def checked(self):
        """A copy with numbers parsed and checked, names lower-cased and the default lr filled in."""
        if get_quantizer(self.target).name != "binary":
            raise FinetuneError(f"--to {self.target}: fine-tuning supports binary weights only (--to binary)")
        optimizer = str(self.optimizer).lower()
        if optimizer not in OPTIMIZERS:
            raise FinetuneError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        schedule = str(self.schedule).lower()
        if schedule not in SCHEDULES:
            raise FinetuneError(f"--schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
        c = replace(self, optimizer=optimizer, schedule=schedule)
        c.epochs = _check_number(c.epochs, "--epochs", 0, integer=True)
        if c.iters is not None:
            c.iters = _check_number(c.iters, "--iters", 1, integer=True)
        c.lr = DEFAULT_LR[optimizer] if c.lr is None else _check_number(c.lr, "--lr", 0, allow_equal=False)
        c.momentum = _check_number(c.momentum, "--momentum", 0)
        c.weight_decay = _check_number(c.weight_decay, "--weight-decay", 0)
        c.seed = _check_number(c.seed, "--seed", 0, integer=True)
        c.bn_batches = _check_number(c.bn_batches, "--bn-batches", 1, integer=True)
        c.workers = _check_number(c.workers, "--workers", 0, integer=True)
        if c.batch_size is not None:
            c.batch_size = _check_number(c.batch_size, "--batch-size", 1, integer=True)
        if c.budget is not None:
            c.budget = _check_number(c.budget, "--budget", 0)
            if c.keep is not None or c.only is not None:
                raise FinetuneError("--budget chooses the layers kept fp32; drop --keep/--only")
        return c


def _check_number(value, flag, lo=None, integer=False, allow_equal=True):
    try:
        v = int(value) if integer else float(value)
    except (TypeError, ValueError):
        raise FinetuneError(f"{flag} must be {'an integer' if integer else 'a number'}, got {value!r}") from None
    if integer and float(value) != v:
        raise FinetuneError(f"{flag} must be an integer, got {value!r}")
    if not integer and not math.isfinite(v):
        raise FinetuneError(f"{flag} must be finite, got {value!r}")
    if lo is not None and (v < lo or (v == lo and not allow_equal)):
        raise FinetuneError(f"{flag} must be {'>=' if allow_equal else '>'} {lo}, got {value!r}")
    return v


def _check_files(path, weights, config):
    if path.endswith(".caffeq"):
        raise FinetuneError(f"{path}: fine-tuning starts from the fp32 prototxt and caffemodel, not a "
                            f".caffeq file")
    if not os.path.exists(path):
        raise FinetuneError(f"{path}: no such file")
    if weights is None:
        raise FinetuneError(f"{path}: pass the trained weights (--weights W.caffemodel); fine-tuning starts "
                            f"from them")
    for flag, src in (("--data", config.data), ("--val", config.val)):
        if src is not None and not os.path.exists(src):
            raise DataError(f"{flag} {src}: data source not found")


# ---- the result -------------------------------------------------------------------------------

@dataclass
class FinetuneResult:
    model: object                    # the binary caffeq.Model to write
    binarized: list                  # layers with binary weights
    kept: dict                       # layer -> why it stays fp32
    metric: str                      # "top1" or "agreement"
    fp32: float = None               # validation metric of the fp32 model
    post_training: float = None      # binarized, stored statistics, no fine-tuning
    bn_reestimated: float = None     # after BatchNorm re-estimation (epoch 0)
    best_epoch: int = None
    best_metric: float = None
    history: list = field(default_factory=list)
    seconds: float = 0.0
    notes: list = field(default_factory=list)
    data: dict = field(default_factory=dict)
    budget: dict = None
    interrupted: bool = False        # Ctrl-C stopped the training: `model` is the best epoch before it

    def to_dict(self):
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "model"}


def _plain(value):
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value


# ---- the steps --------------------------------------------------------------------------------

@dataclass
class _Data:
    """The data side of a run: the net as read, the train/val plans and datasets, the item shape."""
    net: object
    train_info: object
    test_info: object
    train_plan: object
    train_set: object
    item_shape: tuple
    val_plan: object = None
    val_set: object = None


def _prepare_data(path, config, notes):
    warnings = []
    net = read_net(path, warnings=warnings)
    notes.extend(warnings)
    base_dir = os.path.dirname(os.path.abspath(path))
    train_info, _ = phase_data_layer(net, "TRAIN", path, base_dir)
    test_info, _ = phase_data_layer(net, "TEST", path, base_dir)
    deploy_inputs = None
    if train_info is None and test_info is None:
        deploy_inputs = load(path, None, phase="TEST", net=copy.deepcopy(net)).inputs
    if train_info is None and config.data is None:
        raise DataError(f"{path}: no TRAIN-phase Data/ImageData layer; pass the training data (--data)")
    opts = {"transform": config.transform, "resize": config.resize, "channel_order": config.channel_order,
            "prototxt": path}
    train_plan = plan_data(train_info or test_info, deploy_inputs, base_dir, config.data,
                           batch_size=config.batch_size, **opts)
    train_plan.transformer = train_transformer(train_plan)
    train_set = build_dataset(train_plan, config.limit, defer_normalize=False, seed=config.seed)
    item_shape = probe_shape(train_set, train_plan.source)
    if not train_set.has_labels:
        raise DataError(f"{train_plan.source}: has no labels; fine-tuning needs labeled training data")
    data = _Data(net, train_info, test_info, train_plan, train_set, item_shape)
    if test_info is not None or config.val is not None:
        # a net whose only data layer is TRAIN's: its transform, without the randomness
        data.val_plan = plan_data(test_info or train_info, deploy_inputs, base_dir, config.val, batch_size=None,
                                  **opts)
        data.val_set = build_dataset(data.val_plan, config.val_limit, defer_normalize=False, seed=config.seed)
        vshape = probe_shape(data.val_set, data.val_plan.source)
        if vshape != item_shape:
            raise DataError(f"validation items are {'x'.join(map(str, vshape))} but training items "
                            f"{'x'.join(map(str, item_shape))} after preprocessing")
    else:
        notes.append("no validation data (--val): the last epoch is written")
    train_set.close()
    if data.val_set is not None:
        data.val_set.close()
    return data


def _prepare_nets(path, weights, data):
    """(the model trained, the TEST-phase model written), checked against the items' shape."""
    train_phase = "TRAIN" if data.train_info is not None or data.test_info is None else "TEST"
    plan = data.train_plan
    train_model = load_phase(path, weights, data.net, train_phase, data.item_shape, plan.batch_size)
    out_model = load_output_model(path, weights, data.net, data.item_shape,
                                  data.val_plan.batch_size if data.val_plan else 1)
    for m in (train_model, out_model):
        if plan.data_blob not in m.inputs:
            raise FinetuneError(f"the net has no input '{plan.data_blob}'")
        want = tuple(m.inputs[plan.data_blob][1:])
        if want != data.item_shape:
            raise DataError(f"{plan.source}: items are {'x'.join(map(str, data.item_shape))} after "
                            f"preprocessing but the net's input '{plan.data_blob}' takes "
                            f"{'x'.join(map(str, want))}; set --resize HxW / --crop-size")
    return train_model, out_model


class _Session:
    """One fine-tuning run after its data and nets are ready: the modules, loaders and the best
    epoch so far.  finetune() calls choose_layers, baselines, train (which Ctrl-C may cut short)
    and result, in that order."""

    def __init__(self, config, data, train_model, out_model, notes, started):
        self.config, self.data, self.notes, self.started = config, data, notes, started
        self.train_model, self.out_model = train_model, out_model
        self.dev = resolve_device(config.device)
        plan = data.train_plan
        self.label_blob = plan.label_blob if plan.label_blob in train_model.inputs else None
        self.losses = loss_tops(train_model)
        score = score_blob(train_model, self.label_blob)
        if self.losses and self.label_blob is None:
            raise FinetuneError("the net's loss layers read a label blob that is not a data layer top")
        self.ce_on = None
        if not self.losses:
            self.ce_on = logits_blob(train_model, score)
            notes.append(f"no loss layer in the net: cross-entropy on '{self.ce_on}'")
        self.outputs = [b for b, _ in self.losses] if self.losses else [self.ce_on]
        self.feed_train = Feeder.for_model(train_model, plan.data_blob, self.label_blob, self.dev)
        self.train_view = EpochView(data.train_set, config.seed)
        self.sampler = EpochSampler(len(self.train_view), config.seed, shuffle=config.shuffle)
        self.train_loader = make_loader(self.train_view, plan.batch_size, config.workers, self.dev, self.sampler,
                                        data.item_shape)
        self.steps_per_epoch = len(self.train_loader)
        self.val_gm = self.val_feed = self.val_loader = self.val_score = None
        if data.val_plan is not None:
            val_label = data.val_plan.label_blob if data.val_plan.label_blob in out_model.inputs else None
            self.val_score = score_blob(out_model, val_label)
            self.val_loader = make_loader(data.val_set, data.val_plan.batch_size, config.workers, self.dev, None,
                                          data.item_shape)
            self.val_feed = Feeder.for_model(out_model, data.val_plan.data_blob, val_label, self.dev)
        self.keep, self.only = config.keep, config.only
        self.budget_info = None
        self.binarized, self.kept = [], {}
        self.gm = self.binarized_mods = None
        self.metric, self.fp32_preds = "top1", None
        self.fp32_metric = self.post_metric = self.bn_metric = None
        self.bn_info = None
        self.history = []
        self.best_epoch = self.best_metric = self.best_state = None
        self.interrupted = False

    def say(self, msg):
        if self.config.progress:
            from tqdm import tqdm
            tqdm.write(msg, file=sys.stderr)

    # -- which layers: budget (sensitivity on the validation data), keep/only, or the defaults --
    def choose_layers(self):
        c = self.config
        if c.budget is not None:
            if self.val_loader is None:
                raise DataError("--budget measures each layer's sensitivity on validation data; pass --val")
            table = measure_sensitivity(self.out_model, self.val_loader, self.val_feed, self.val_score, "binary",
                                        cumulative=False, progress=c.progress,
                                        has_labels=self.val_loader.dataset_has_labels)
            keep = choose_keep(table, c.budget)
            self.budget_info = {"budget": c.budget, "keep": list(keep),
                                "estimated_drop": estimated_drop(table, keep), "metric": table["metric"],
                                "fp32": table["fp32"], "sensitivity": table["layers"]}
            self.say(f"budget {c.budget:g} points: keep fp32 {', '.join(keep) or 'nothing'} (estimated drop "
                     f"{self.budget_info['estimated_drop']:.2f} points)")
            self.keep = keep if keep else "none"
        probe = quantize(self.out_model, "binary", keep=self.keep, only=self.only)
        self.binarized = list(probe.quant_report.changed)
        self.kept = dict(probe.quant_report.kept)
        if self.budget_info is not None:
            self.kept = {k: f"budget {c.budget:g} points" for k in self.kept}
        if not self.binarized:
            raise FinetuneError("no layer would be binarized (every weighted layer is kept fp32); "
                                "use --keep none or name the layers with --only")
        self.gm = module_with_outputs(self.train_model, self.outputs, self.dev)
        frozen = force_batch_statistics(self.gm)
        if frozen:
            self.notes.append(f"BatchNorm layer(s) {', '.join(frozen)} set use_global_stats: true; fine-tuning "
                              f"re-estimates their statistics all the same")
        self.binarized_mods = binarize_module(self.gm, self.train_model, self.binarized)

    def bn_batches(self, epoch_key):
        """The first bn_batches training batches, in a fixed seeded order (not the training order)."""
        self.sampler.set_epoch(epoch_key)
        bar_total = min(self.config.bn_batches, len(self.train_loader))
        for k, batch in enumerate(tracked(self.train_loader, "BatchNorm statistics", total=bar_total,
                                          enabled=self.config.progress)):
            if k >= self.config.bn_batches:
                break
            yield batch

    def validate(self):
        """Validation metric of the binary model with the training module's current weights."""
        if self.val_loader is None:
            return None
        if self.val_gm is None:
            self.val_gm = module_with_outputs(self.out_model, [self.val_score], self.dev)
            force_batch_statistics(self.val_gm)
            binarize_module(self.val_gm, self.out_model, self.binarized)
        copy_layer_state(self.gm, self.val_gm)
        r = predict(self.val_gm, tracked(self.val_loader, "validation", enabled=self.config.progress), self.val_feed,
                    self.val_score, reference=self.fp32_preds)
        return r["top1"] if self.metric == "top1" else r["agreement"]

    # -- baselines: fp32, post-training binary, BatchNorm re-estimated (epoch 0) --
    def baselines(self):
        c = self.config
        if self.val_loader is not None:
            ref_gm = module_with_outputs(self.out_model, [self.val_score], self.dev)
            r = predict(ref_gm, tracked(self.val_loader, "validation (fp32)", enabled=c.progress), self.val_feed,
                        self.val_score)
            del ref_gm
            if r["top1"] is None:
                self.metric = "agreement"
                self.fp32_preds = r["predictions"]
                self.fp32_metric = 1.0
                self.notes.append("validation data without labels: the metric is top-1 agreement with the "
                                  "fp32 model")
            else:
                self.fp32_metric = r["top1"]
            self.post_metric = self.validate()
        self.say(f"fp32: {_fmt(self.fp32_metric, self.metric)}; binary ({len(self.binarized)} layer(s): "
                 f"{', '.join(self.binarized)}), post-training: {_fmt(self.post_metric, self.metric)}")
        if c.bn_only or c.bn_reestimate:
            self.bn_info = reestimate_batchnorm(self.gm, self.bn_batches(10 ** 6), self.feed_train)
        reestimated = bool(self.bn_info and self.bn_info["layers"])
        self.bn_metric = self.validate() if reestimated else self.post_metric
        if reestimated:
            self.say(f"BatchNorm re-estimated on {self.bn_info['items']} items ({self.bn_info['batches']} "
                     f"batches): {_fmt(self.bn_metric, self.metric)}")
        self.history.append({"epoch": 0, "loss": None, self.metric: self.bn_metric, "lr": None, "steps": 0,
                             "seconds": time.perf_counter() - self.started})
        self.best_epoch, self.best_metric = 0, self.bn_metric
        self.best_state = snapshot(self.gm)

    # -- training: epochs of straight-through steps, each validated --
    def total_steps(self):
        c = self.config
        return 0 if c.bn_only else (c.iters if c.iters is not None else c.epochs * self.steps_per_epoch)

    def optimizer(self):
        c = self.config
        params = [p for p in self.gm.parameters() if p.requires_grad]
        if c.optimizer == "adam":
            return torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay)
        return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)

    def train(self):
        total = self.total_steps()
        if total <= 0:
            return
        opt = self.optimizer()
        n_epochs = math.ceil(total / max(self.steps_per_epoch, 1))
        step = 0
        for epoch in range(1, n_epochs + 1):
            t0 = time.perf_counter()
            step, loss = self.train_epoch(opt, epoch, n_epochs, step, total)
            if self.config.bn_reestimate:
                reestimate_batchnorm(self.gm, self.bn_batches(10 ** 6 + epoch), self.feed_train)
            value = self.validate()
            row = {"epoch": epoch, "loss": loss, self.metric: value,
                   "lr": self.config.lr * _lr_factor(self.config.schedule, step, total), "steps": step,
                   "seconds": time.perf_counter() - self.started}
            self.history.append(row)
            better = value is None or self.best_metric is None or value > self.best_metric
            if better:
                self.best_epoch, self.best_metric = epoch, value
                self.best_state = snapshot(self.gm)
            self.say(f"epoch {epoch}/{n_epochs}: loss {row['loss']:.4f}, val {_fmt(value, self.metric)}"
                     f"{' (best)' if better and value is not None else ''}, {time.perf_counter() - t0:.1f}s")
            if step >= total:
                break

    def train_epoch(self, opt, epoch, n_epochs, step, total):
        """One pass over the training data (or what is left of `total` steps) -> (steps, mean loss)."""
        c = self.config
        self.gm.train()
        self.sampler.set_epoch(epoch)
        bar = None
        if c.progress:
            from tqdm import tqdm
            # disable=None: no bar when stderr is not a terminal (the per-epoch lines remain)
            bar = tqdm(total=min(self.steps_per_epoch, total - step), desc=f"epoch {epoch}/{n_epochs}",
                       unit="batch", file=sys.stderr, dynamic_ncols=True, leave=False, disable=None)
        loss_sum, seen, bad = 0.0, 0, 0
        try:
            for batch in self.train_loader:
                if step >= total:
                    break
                bad += len(batch["bad"])
                inputs = self.feed_train(batch)
                if inputs is None:
                    continue
                for group in opt.param_groups:
                    group["lr"] = c.lr * _lr_factor(c.schedule, step, total)
                loss = self.loss(self.gm(*inputs), batch)
                if not torch.isfinite(loss):
                    raise FinetuneError(f"epoch {epoch}, step {step + 1}: the loss is {float(loss)}; lower --lr")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                clip_latent(self.binarized_mods)
                step += 1
                n = int(inputs[0].shape[0])
                loss_sum += float(loss.detach()) * n
                seen += n
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_sum / max(seen, 1):.4f}")
        finally:
            if bar is not None:
                bar.close()
        if bad:
            self.notes.append(f"epoch {epoch}: {bad} unreadable training item(s) skipped")
        return step, loss_sum / max(seen, 1)

    def loss(self, out, batch):
        if self.losses:
            return sum(w * out[b].reshape(()) for b, w in self.losses)
        lab = batch["label"].to(self.dev)
        logits = out[self.ce_on]
        return nn.functional.cross_entropy(logits.reshape(logits.shape[0], logits.shape[1], -1),
                                           lab.reshape(lab.shape[0], -1))

    # -- the result: the best epoch's latent weights, quantized --
    def result(self):
        c, data = self.config, self.data
        self.gm.load_state_dict(self.best_state)
        final_fp32 = with_trained_weights(self.out_model, self.gm)
        qmodel = quantize(final_fp32, "binary", keep=self.keep, only=self.only)
        if sorted(qmodel.quant_report.changed) != sorted(self.binarized):
            raise FinetuneError("internal: the written model's binary layers differ from the trained ones")
        result = FinetuneResult(model=qmodel, binarized=self.binarized, kept=self.kept, metric=self.metric,
                                fp32=self.fp32_metric, post_training=self.post_metric,
                                bn_reestimated=self.bn_metric, best_epoch=self.best_epoch,
                                best_metric=self.best_metric, history=self.history,
                                seconds=time.perf_counter() - self.started, notes=self.notes,
                                budget=self.budget_info, interrupted=self.interrupted)
        result.data = {"train": data.train_plan.source, "train_items": len(self.train_view),
                       "batch_size": data.train_plan.batch_size,
                       "val": data.val_plan.source if data.val_plan else None,
                       "val_items": len(self.val_loader.dataset) if self.val_loader else 0,
                       "steps_per_epoch": self.steps_per_epoch, "optimizer": c.optimizer, "lr": c.lr,
                       "schedule": c.schedule, "seed": c.seed, "device": str(self.dev),
                       "bn_batches": c.bn_batches, "bn_items": self.bn_info["items"] if self.bn_info else 0}
        self.train_view.close()
        return result


def finetune(prototxt, weights=None, config=None, **options):
    """Fine-tune (or, with bn_only, only re-estimate BatchNorm) a binary-weight version of a Caffe
    model -> FinetuneResult (its `.model` is the binary caffeq.Model to write).

    Options are FinetuneConfig's fields (pass them as keywords, or a FinetuneConfig as `config`).
    Ctrl-C during training returns the best epoch so far, with `interrupted` set.
    """
    config = replace(config or FinetuneConfig(), **options).checked()
    started = time.perf_counter()
    path = os.fspath(prototxt)
    _check_files(path, weights, config)
    resolve_device(config.device)      # a bad device fails before any data is read
    torch.manual_seed(config.seed)
    notes = []
    data = _prepare_data(path, config, notes)
    train_model, out_model = _prepare_nets(path, weights, data)
    # what reading the weights said (layers whose parameters did not parse, weights of no layer)
    notes.extend(w for w in out_model.warnings if w not in notes)
    session = _Session(config, data, train_model, out_model, notes, started)
    session.choose_layers()
    session.baselines()
    try:
        session.train()
    except KeyboardInterrupt:
        session.interrupted = True
        done = len(session.history) - 1
        notes.append(f"interrupted after {done} complete epoch(s): the best epoch so far "
                     f"({session.best_epoch}) is the result")
    return session.result()


def _lr_factor(schedule, step, total):
    if schedule == "constant" or total <= 0:
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    # step: x0.1 at half and at three quarters of the run
    return 0.1 ** ((step >= total // 2) + (step >= (3 * total) // 4))


def _fmt(value, metric):
    if value is None:
        return "-"
    return f"{100 * value:.2f}%" + (" agreement" if metric == "agreement" else " top-1")


__all__ = ["STE_CLIP", "BinarizeWeight", "EpochSampler", "EpochView", "FinetuneConfig", "FinetuneError",
           "FinetuneResult", "SignSTE", "batchnorm_modules", "binarize_module", "binarize_ste", "caffe_layers",
           "channel_mean", "clip_latent", "finetune", "force_batch_statistics", "load_phase", "module_with_outputs",
           "predict", "reestimate_batchnorm", "sign_pm1"]
