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
"""
import copy
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .errors import CaffeqError, DataError
from .evaluate import as_input_layer, phase_data_layer
from .progress import tracked

OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("cosine", "step", "constant")
DEFAULT_LR = {"adam": 1e-3, "sgd": 0.01}
STE_CLIP = 1.0


class FinetuneError(CaffeqError):
    """A bad fine-tuning request (flags, data, model)."""


# ---- binary weights with a straight-through estimator ------------------------------------

def sign_pm1(w):
    """+1 where w >= 0 (zero included), -1 elsewhere, in w's dtype."""
    return torch.where(w >= 0, torch.ones_like(w), -torch.ones_like(w))


class SignSTE(torch.autograd.Function):
    """sign(w) forward (sign(0) = +1); backward passes the gradient where |w| <= clip."""

    @staticmethod
    def forward(ctx, w, clip):
        ctx.save_for_backward(w)
        ctx.clip = clip
        return sign_pm1(w)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * (w.abs() <= ctx.clip).to(grad.dtype), None


def channel_mean(x, axis, groups=1):
    """Mean of x over each output channel's elements, shaped to broadcast against x.

    axis: the output-channel axis (None: one channel for the whole tensor);
    groups > 1: a grouped Deconvolution layout (C_in x C_out/group x k...), whose
    output channel g * (C_out/group) + j is [rows of group g, column j].
    """
    if axis is None:
        return x.mean().reshape((1,) * x.dim())
    if groups > 1:
        cin, cpg = x.shape[0], x.shape[1]
        v = x.reshape(groups, cin // groups, cpg, -1)
        m = v.mean(dim=(1, 3), keepdim=True)
        return m.expand_as(v).reshape(x.shape)
    dims = tuple(d for d in range(x.dim()) if d != axis)
    return x.mean(dim=dims, keepdim=True)


def binarize_ste(w, axis=0, groups=1, clip=STE_CLIP):
    """alpha_c * sign(w) with alpha_c = mean|w_c|, differentiable through the STE (see the module
    docstring for the gradient)."""
    s = SignSTE.apply(w, clip)
    # |w| as w * sign(w): the same value, and d|w_i|/dw_i = s_i also at 0 (sign(0) = +1)
    alpha = channel_mean(w * sign_pm1(w).detach(), axis, groups)
    return alpha * s


class BinarizeWeight(nn.Module):
    """A torch parametrization: the module sees binarize_ste(latent weight) at every forward."""

    def __init__(self, axis=0, groups=1, clip=STE_CLIP):
        super().__init__()
        self.axis, self.groups, self.clip = axis, int(groups), float(clip)

    def forward(self, w):
        return binarize_ste(w, self.axis, self.groups, self.clip)

    def extra_repr(self):
        return f"axis={self.axis}, groups={self.groups}, clip={self.clip}"


def caffe_layers(gm):
    """{Caffe layer name: CaffeLayer submodule} of a caffeq torch module."""
    from .backends.torch_backend import CaffeLayer
    return {m.caffe_name: m for m in gm.modules() if isinstance(m, CaffeLayer)}


def binarize_module(gm, model, layers, clip=STE_CLIP):
    """Register BinarizeWeight on the weight blobs of `layers` in gm.

    Returns {layer: [(module, blob attribute)]}: the latent weight of each is
    `module.parametrizations[attr].original`.
    """
    from torch.nn.utils import parametrize

    from .quant import get_quantizer, quantizable_blobs
    q = get_quantizer("binary")
    mods = caffe_layers(gm)
    nodes = {n.name: n for n in model.graph.nodes}
    done = {}
    for name in layers:
        node, mod = nodes.get(name), mods.get(name)
        if node is None or mod is None:
            raise FinetuneError(f"layer '{name}' is not in the training net")
        for i, (axis, groups) in quantizable_blobs(node, q).items():
            attr = mod.blob_attrs[i]
            parametrize.register_parametrization(mod, attr, BinarizeWeight(axis, groups, clip))
            done.setdefault(name, []).append((mod, attr))
    return done


def latent_weights(binarized):
    """The latent (float) parameters behind binarized weights, each once."""
    seen, out = set(), []
    for pairs in binarized.values():
        for mod, attr in pairs:
            p = mod.parametrizations[attr].original
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def clip_latent(binarized, clip=STE_CLIP):
    with torch.no_grad():
        for p in latent_weights(binarized):
            p.clamp_(-clip, clip)


# ---- BatchNorm statistics ---------------------------------------------------------------

class _Moments:
    """Exact per-channel mean and M2 of everything added, in float64 (Chan et al.'s combination)."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, None, None

    def add(self, x):
        x = x.detach().double()
        if x.dim() >= 2:
            c = x.shape[1]
            dims = [d for d in range(x.dim()) if d != 1]
            bshape = (1, c) + (1,) * (x.dim() - 2)
        else:
            c, dims, bshape = 1, [0], (-1,)
        nb = x.numel() // max(c, 1)
        if nb == 0:
            return
        mb = x.mean(dim=dims)
        m2b = ((x - mb.reshape(bshape)) ** 2).sum(dim=dims)
        if self.n == 0:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        tot = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / tot)
        self.m2 = self.m2 + m2b + delta ** 2 * (self.n * nb / tot)
        self.n = tot

    @property
    def var(self):
        return self.m2 / self.n


def batchnorm_modules(gm):
    return {name: m for name, m in caffe_layers(gm).items() if m.caffe_type == "BatchNorm"}


def force_batch_statistics(gm):
    """Make every BatchNorm module use batch statistics in training mode (use_global_stats: true
    in the prototxt would freeze them).  Returns the names of the layers changed."""
    changed = []
    for name, mod in batchnorm_modules(gm).items():
        if mod.attrs.get("use_global_stats") and not mod.attrs.get("scale_bias"):
            changed.append(name)
        mod.attrs = dict(mod.attrs, use_global_stats=None)   # a copy: the graph node keeps its own
    return changed


def reestimate_batchnorm(gm, batches, feed=None):
    """Re-estimate every BatchNorm layer's statistics on `batches` (an iterable of module inputs,
    each a tuple, or of batch dicts turned into inputs by `feed(batch)`).

    BatchNorm layers run in training mode (batch statistics) and everything else in inference
    mode; the exact mean and (population) variance of the values reaching each layer over all
    batches are written to its blobs in Caffe's layout: mean, variance, factor 1.
    Returns {"layers": [names], "batches": n, "items": images seen}.
    """
    bns = batchnorm_modules(gm)
    if not bns:
        return {"layers": [], "batches": 0, "items": 0}
    for mod in bns.values():
        mod.attrs = dict(mod.attrs, use_global_stats=None)
    moments = {name: _Moments() for name in bns}
    hooks = [mod.register_forward_pre_hook(lambda m, inputs, name=name: moments[name].add(inputs[0]))
             for name, mod in bns.items()]
    was_training = gm.training
    gm.eval()
    for mod in bns.values():
        mod.train()
    n_batches = n_items = 0
    try:
        with torch.no_grad():
            for batch in batches:
                inputs = feed(batch) if feed is not None else batch
                if inputs is None:
                    continue
                gm(*inputs)
                n_batches += 1
                n_items += int(inputs[0].shape[0])
    finally:
        for h in hooks:
            h.remove()
        gm.train(was_training)
    if n_batches == 0:
        raise DataError("BatchNorm re-estimation: no usable training batches")
    with torch.no_grad():
        for name, mod in bns.items():
            m = moments[name]
            if m.n == 0:
                continue
            blobs = mod.blob_tensors()
            blobs[0].copy_(m.mean.to(blobs[0].dtype))
            blobs[1].copy_(m.var.to(blobs[1].dtype))
            if not mod.attrs.get("scale_bias"):
                blobs[2].fill_(1.0)
    return {"layers": list(bns), "batches": n_batches, "items": n_items}


# ---- data ----------------------------------------------------------------------------------

def load_phase(path, weights, net, phase, item_shape=None, batch=1):
    """The model of `net` in `phase`; its data layer (if any) becomes an Input layer shaped
    (batch,) + item_shape, so that the layer's own source need not exist.  `model.net` stays the
    original net (what writers save)."""
    from .model import load
    work = copy.deepcopy(net)
    base_dir = os.path.dirname(os.path.abspath(path))
    info, lp = phase_data_layer(work, phase, path, base_dir)
    if info is not None:
        if item_shape is None:
            raise FinetuneError(f"{path}: layer '{info.name}' needs data to take its shape from")
        shapes = [(batch,) + tuple(item_shape)] + [(batch,)] * (len(info.tops) - 1)
        as_input_layer(lp, shapes)
    model = load(path, weights, phase=phase, net=work)
    model.net = net
    return model


def _load_output_model(path, weights, net, item_shape, batch):
    """The TEST-phase model that is written: loaded as `caffeq.load` would (so it evaluates and
    exports like any other), or, when its data layer's source is missing, with that layer as an
    Input layer."""
    from .model import load
    try:
        return load(path, weights, phase="TEST", net=copy.deepcopy(net))
    except DataError:
        return load_phase(path, weights, net, "TEST", item_shape, batch)


class EpochView(torch.utils.data.Dataset):
    """A dataset read epoch after epoch: key = epoch * len + index, and the random crops/mirrors of
    epoch e are seeded by (seed, e) (item seeds are mixed in by caffeq.data.Preprocess)."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, int(seed)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, i = divmod(int(key), len(self.dataset))
        pre = self.dataset.preprocess
        if pre is not None:
            pre.seed = (self.seed * 1000003 + epoch) % (1 << 31)
        return self.dataset[i]

    def close(self):
        self.dataset.close()


class EpochSampler(torch.utils.data.Sampler):
    """A seeded permutation per epoch (or the data's own order), yielding EpochView keys."""

    def __init__(self, n, seed, shuffle=True):
        self.n, self.seed, self.shuffle, self.epoch = int(n), int(seed), bool(shuffle), 0

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = range(self.n)
        base = self.epoch * self.n
        return iter(base + i for i in order)

    def __len__(self):
        return self.n


def train_transformer(plan):
    """The plan's transform as Caffe applies it at TRAIN (random crop and mirror)."""
    from .data import DataTransformer
    t = plan.transformer
    return DataTransformer(scale=t.scale, mean_file=None, mean_value=t.mean_value, crop_size=t.crop_size,
                           mirror=t.mirror, force_color=t.force_color, force_gray=t.force_gray,
                           phase="TRAIN", mean=t.mean)


def _probe_shape(dataset, source):
    for i in range(min(len(dataset), 16)):
        _, img, _, err = dataset[i]
        if err is None:
            return tuple(img.shape)
    if len(dataset) == 0:
        raise DataError(f"{source}: no items")
    raise DataError(f"{source}: none of the first items can be read: {dataset[0][3]}")


# ---- the nets as torch modules ------------------------------------------------------------

def module_with_outputs(model, outputs, device):
    """The model's torch module returning {blob: tensor} for exactly `outputs`."""
    gm = model.to_torch(device=device, all_blobs=True)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    values = out_node.args[0]
    missing = [o for o in outputs if o not in values]
    if missing:
        raise FinetuneError(f"no blob {missing[0]!r} in the net")
    out_node.args = ({k: values[k] for k in outputs},)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.output_names = list(outputs)
    return gm


def loss_tops(model):
    """[(blob, weight)] of the net's loss layers (nonzero loss_weight)."""
    out = []
    for node in model.graph.nodes:
        lw = node.attrs.get("loss_weight") if isinstance(node.attrs, dict) else None
        if node.spec.is_training_only and lw:
            for top, w in zip(node.tops, lw):
                if w:
                    out.append((top, float(w)))
    return out


def score_blob(model, label_blob=None):
    """The blob whose argmax is the prediction: what an Accuracy or softmax loss layer reads,
    else the net's single output with per-image scores."""
    for types in (("Accuracy",), ("SoftmaxWithLoss",)):
        for node in model.graph.nodes:
            if node.type in types and len(node.bottoms) >= 2 and (label_blob is None or
                                                                   node.bottoms[1] == label_blob):
                return node.bottoms[0]
    outs = [o for o in model.graph.outputs if len(model.graph.tensors[o].shape or ()) >= 2]
    if len(outs) != 1:
        raise FinetuneError(f"cannot tell which output holds the class scores ({', '.join(model.outputs)}); "
                            f"use a train_val net with an Accuracy or SoftmaxWithLoss layer")
    return model.graph.tensors[outs[0]].blob


def logits_blob(model, blob):
    """The input of a Softmax producing `blob` (cross-entropy wants logits), else blob itself."""
    for node in model.graph.nodes:
        if node.type == "Softmax" and blob in node.tops and len(node.bottoms) == 1:
            return node.bottoms[0]
    return blob


class Feeder:
    """Batch dicts (caffeq.data.Collate) -> a module's positional inputs on the device."""

    def __init__(self, input_names, input_shapes, data_blob, label_blob, device):
        self.names = list(input_names)
        self.shapes = dict(input_shapes)
        self.data_blob, self.label_blob, self.device = data_blob, label_blob, device
        extra = [n for n in self.names if n not in (data_blob, label_blob)]
        if extra:
            raise FinetuneError(f"the net's input '{extra[0]}' is neither the data nor the label blob; "
                                f"cannot feed it")
        if data_blob not in self.names:
            raise FinetuneError(f"the net has no input '{data_blob}'")

    @classmethod
    def for_model(cls, model, data_blob, label_blob, device):
        return cls([model.graph.tensors[t].blob for t in model.graph.inputs], model.inputs, data_blob,
                   label_blob, device)

    def __call__(self, batch):
        x = batch["data"]
        if x.shape[0] == 0:
            return None
        x = x.to(self.device, torch.float32, non_blocking=True)
        feed = []
        for name in self.names:
            if name == self.data_blob:
                feed.append(x)
            else:
                lab = batch["label"].to(self.device, non_blocking=True).to(torch.float32)
                feed.append(lab.reshape((-1,) + tuple(self.shapes[name][1:])))
        return tuple(feed)


def count_correct(scores, labels):
    """(correct count, labeled count) by Caffe's AccuracyLayer rule (ties count against)."""
    s = scores.reshape(scores.shape[0], scores.shape[1], -1).float()
    lab = labels.reshape(labels.shape[0], -1).long()
    if lab.shape[1] != s.shape[2]:
        raise FinetuneError(f"{lab.shape[1]} label(s) per item for scores of shape {list(scores.shape)}")
    valid = (lab >= 0) & (lab < s.shape[1])
    safe = torch.where(valid, lab, torch.zeros_like(lab))
    true = s.gather(1, safe[:, None, :])
    better = (s >= true).sum(1) - 1
    return int(((better < 1) & valid).sum()), int(valid.sum())


def predict(gm, loader, feeder, score, reference=None):
    """One pass in inference mode -> {"top1", "agreement", "predictions"} (top1 None without labels,
    agreement None without reference predictions)."""
    gm.eval()
    correct = labeled = agree = total = 0
    preds = []
    with torch.no_grad():
        for batch in loader:
            inputs = feeder(batch)
            if inputs is None:
                continue
            s = gm(*inputs)[score]
            p = s.reshape(s.shape[0], s.shape[1], -1).argmax(1).cpu()
            preds.append(p)
            if loader.dataset_has_labels:
                c, n = count_correct(s, batch["label"].to(s.device))
                correct += c
                labeled += n
            if reference is not None:
                ref = reference[len(preds) - 1]
                agree += int((p == ref).sum())
                total += int(p.numel())
    return {"top1": correct / labeled if labeled else None,
            "agreement": agree / total if total else None,
            "predictions": preds}


def _loader(dataset, batch_size, workers, device, sampler=None, expected=None):
    from .data import Collate, worker_init
    on_cuda = torch.device(device).type == "cuda"
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, shuffle=False, num_workers=workers,
        collate_fn=Collate(expected, None), pin_memory=on_cuda,
        worker_init_fn=worker_init if workers else None, persistent_workers=bool(workers))
    inner = dataset.dataset if isinstance(dataset, EpochView) else dataset
    loader.dataset_has_labels = bool(getattr(inner, "has_labels", True))
    return loader


# ---- the run ---------------------------------------------------------------------------------

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

    def to_dict(self):
        return {"binarized": list(self.binarized), "kept": dict(self.kept), "metric": self.metric,
                "fp32": self.fp32, "post_training": self.post_training, "bn_reestimated": self.bn_reestimated,
                "best_epoch": self.best_epoch, "best_metric": self.best_metric, "history": list(self.history),
                "seconds": self.seconds, "notes": list(self.notes), "data": dict(self.data),
                "budget": self.budget}


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


def _lr_factor(schedule, step, total):
    if schedule == "constant" or total <= 0:
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    # step: x0.1 at half and at three quarters of the run
    return 0.1 ** ((step >= total // 2) + (step >= (3 * total) // 4))


def _say(progress, msg):
    if progress:
        from tqdm import tqdm
        tqdm.write(msg, file=sys.stderr)


def finetune(prototxt, weights=None, *, target="binary", data=None, val=None, keep=None, only=None,
             epochs=8, iters=None, lr=None, batch_size=None, optimizer="adam", schedule="cosine",
             momentum=0.9, weight_decay=0.0, seed=0, device="cpu", workers=0, bn_only=False,
             bn_batches=200, bn_reestimate=True, budget=None, limit=None, val_limit=None,
             transform=None, resize=None, channel_order=None, shuffle=True, progress=False):
    """Fine-tune (or, with bn_only, only re-estimate BatchNorm) a binary-weight version of a Caffe
    model -> FinetuneResult (its `.model` is the binary caffeq.Model to write).

    data / val: training and validation sources (default: the prototxt's TRAIN- and TEST-phase
    Data/ImageData layers).  keep / only: as caffeq.quantize.  budget: points of top-1; the layers
    kept fp32 are chosen from a sensitivity analysis on the validation data (caffeq.sensitivity).
    iters: stop after this many steps in all (the schedule spans them).  bn_batches: training
    batches for each BatchNorm re-estimation.  limit / val_limit: use only the first N items.
    """
    from .backends.torch_backend import resolve_device
    from .evaluate import build_dataset, plan_data
    from .model import read_net
    from .quant import get_quantizer, quantize
    started = time.perf_counter()

    # ---- the request ----
    if get_quantizer(target).name != "binary":
        raise FinetuneError(f"--to {target}: fine-tuning supports binary weights only (--to binary)")
    optimizer = str(optimizer).lower()
    if optimizer not in OPTIMIZERS:
        raise FinetuneError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    schedule = str(schedule).lower()
    if schedule not in SCHEDULES:
        raise FinetuneError(f"--schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    epochs = _check_number(epochs, "--epochs", 0, integer=True)
    if iters is not None:
        iters = _check_number(iters, "--iters", 1, integer=True)
    lr = DEFAULT_LR[optimizer] if lr is None else _check_number(lr, "--lr", 0, allow_equal=False)
    momentum = _check_number(momentum, "--momentum", 0)
    weight_decay = _check_number(weight_decay, "--weight-decay", 0)
    seed = _check_number(seed, "--seed", 0, integer=True)
    bn_batches = _check_number(bn_batches, "--bn-batches", 1, integer=True)
    workers = _check_number(workers, "--workers", 0, integer=True)
    if batch_size is not None:
        batch_size = _check_number(batch_size, "--batch-size", 1, integer=True)
    if budget is not None:
        budget = _check_number(budget, "--budget", 0)
        if keep is not None or only is not None:
            raise FinetuneError("--budget chooses the layers kept fp32; drop --keep/--only")
    path = os.fspath(prototxt)
    if path.endswith(".caffeq"):
        raise FinetuneError(f"{path}: fine-tuning starts from the fp32 prototxt and caffemodel, not a "
                            f".caffeq file")
    if not os.path.exists(path):
        raise FinetuneError(f"{path}: no such file")
    if weights is None:
        raise FinetuneError(f"{path}: pass the trained weights (--weights W.caffemodel); fine-tuning starts "
                            f"from them")
    for flag, src in (("--data", data), ("--val", val)):
        if src is not None and not os.path.exists(src):
            raise DataError(f"{flag} {src}: data source not found")
    dev = resolve_device(device)
    torch.manual_seed(seed)
    notes = []

    # ---- data ----
    warnings = []
    net = read_net(path, warnings=warnings)
    notes.extend(warnings)
    base_dir = os.path.dirname(os.path.abspath(path))
    train_info, _ = phase_data_layer(net, "TRAIN", path, base_dir)
    test_info, _ = phase_data_layer(net, "TEST", path, base_dir)
    deploy_inputs = None
    if train_info is None and test_info is None:
        from .model import load
        deploy = load(path, None, phase="TEST", net=copy.deepcopy(net))
        deploy_inputs = deploy.inputs
    if train_info is None and data is None:
        raise DataError(f"{path}: no TRAIN-phase Data/ImageData layer; pass the training data (--data)")
    opts = {"transform": transform, "resize": resize, "channel_order": channel_order, "prototxt": path}
    train_plan = plan_data(train_info or test_info, deploy_inputs, base_dir, data, batch_size=batch_size, **opts)
    train_plan.transformer = train_transformer(train_plan)
    train_set = build_dataset(train_plan, limit, defer_normalize=False, seed=seed)
    item_shape = _probe_shape(train_set, train_plan.source)
    if not train_set.has_labels:
        raise DataError(f"{train_plan.source}: has no labels; fine-tuning needs labeled training data")
    val_plan = val_set = None
    if test_info is not None or val is not None:
        # a net whose only data layer is TRAIN's: its transform, without the randomness
        val_plan = plan_data(test_info or train_info, deploy_inputs, base_dir, val, batch_size=None, **opts)
        val_set = build_dataset(val_plan, val_limit, defer_normalize=False, seed=seed)
        vshape = _probe_shape(val_set, val_plan.source)
        if vshape != item_shape:
            raise DataError(f"validation items are {'x'.join(map(str, vshape))} but training items "
                            f"{'x'.join(map(str, item_shape))} after preprocessing")
    else:
        notes.append("no validation data (--val): the last epoch is written")
    train_set.close()
    if val_set is not None:
        val_set.close()

    # ---- the nets ----
    train_phase = "TRAIN" if train_info is not None or test_info is None else "TEST"
    train_model = load_phase(path, weights, net, train_phase, item_shape, train_plan.batch_size)
    out_model = _load_output_model(path, weights, net, item_shape, val_plan.batch_size if val_plan else 1)
    for m in (train_model, out_model):
        if train_plan.data_blob not in m.inputs:
            raise FinetuneError(f"the net has no input '{train_plan.data_blob}'")
        want = tuple(m.inputs[train_plan.data_blob][1:])
        if want != item_shape:
            raise DataError(f"{train_plan.source}: items are {'x'.join(map(str, item_shape))} after "
                            f"preprocessing but the net's input '{train_plan.data_blob}' takes "
                            f"{'x'.join(map(str, want))}; set --resize HxW / --crop-size")

    # ---- modules and loaders ----
    label_blob = train_plan.label_blob if train_plan.label_blob in train_model.inputs else None
    losses = loss_tops(train_model)
    score = score_blob(train_model, label_blob)
    if losses and label_blob is None:
        raise FinetuneError("the net's loss layers read a label blob that is not a data layer top")
    ce_on = None
    if not losses:
        ce_on = logits_blob(train_model, score)
        notes.append(f"no loss layer in the net: cross-entropy on '{ce_on}'")
    outputs = [b for b, _ in losses] if losses else [ce_on]
    feed_train = Feeder.for_model(train_model, train_plan.data_blob, label_blob, dev)
    train_view = EpochView(train_set, seed)
    sampler = EpochSampler(len(train_view), seed, shuffle=shuffle)
    expected = item_shape
    train_loader = _loader(train_view, train_plan.batch_size, workers, dev, sampler, expected)
    steps_per_epoch = len(train_loader)

    val_gm = val_feed = val_loader = val_label = val_score = None
    if val_plan is not None:
        val_label = val_plan.label_blob if val_plan.label_blob in out_model.inputs else None
        val_score = score_blob(out_model, val_label)
        val_loader = _loader(val_set, val_plan.batch_size, workers, dev, None, expected)
        val_feed = Feeder.for_model(out_model, val_plan.data_blob, val_label, dev)

    # which layers: budget (sensitivity on the validation data), keep/only, or the defaults
    budget_info = None
    if budget is not None:
        if val_loader is None:
            raise DataError("--budget measures each layer's sensitivity on validation data; pass --val")
        from .sensitivity import choose_keep, estimated_drop, measure_sensitivity
        table = measure_sensitivity(out_model, val_loader, val_feed, val_score, "binary", cumulative=False,
                                    progress=progress, has_labels=val_loader.dataset_has_labels)
        keep = choose_keep(table, budget)
        budget_info = {"budget": budget, "keep": list(keep), "estimated_drop": estimated_drop(table, keep),
                       "metric": table["metric"], "fp32": table["fp32"], "sensitivity": table["layers"]}
        _say(progress, f"budget {budget:g} points: keep fp32 {', '.join(keep) or 'nothing'} (estimated drop "
                       f"{budget_info['estimated_drop']:.2f} points)")
        keep = keep if keep else "none"
    probe = quantize(out_model, "binary", keep=keep, only=only)
    binarized = list(probe.quant_report.changed)
    kept = dict(probe.quant_report.kept)
    if budget_info is not None:
        kept = {k: f"budget {budget:g} points" for k in kept}
    if not binarized:
        raise FinetuneError("no layer would be binarized (every weighted layer is kept fp32); "
                            "use --keep none or name the layers with --only")

    gm = module_with_outputs(train_model, outputs, dev)
    frozen = force_batch_statistics(gm)
    if frozen:
        notes.append(f"BatchNorm layer(s) {', '.join(frozen)} set use_global_stats: true; fine-tuning "
                     f"re-estimates their statistics all the same")
    binarized_mods = binarize_module(gm, train_model, binarized)

    def bn_batches_iter(epoch_key):
        """The first bn_batches training batches, in a fixed seeded order (not the training order)."""
        sampler.set_epoch(epoch_key)
        bar_total = min(bn_batches, len(train_loader))
        for k, batch in enumerate(tracked(train_loader, "BatchNorm statistics", total=bar_total,
                                          enabled=progress)):
            if k >= bn_batches:
                break
            yield batch

    def validate(module_model, state_from=None):
        """Validation metric of the binary model with the training module's current weights."""
        nonlocal val_gm
        if val_loader is None:
            return None
        if val_gm is None:
            val_gm = module_with_outputs(module_model, [val_score], dev)
            force_batch_statistics(val_gm)
            binarize_module(val_gm, module_model, binarized)
        if state_from is not None:
            _copy_layer_state(state_from, val_gm)
        r = predict(val_gm, tracked(val_loader, "validation", enabled=progress), val_feed, val_score,
                    reference=fp32_preds)
        return r["top1"] if metric == "top1" else r["agreement"]

    # ---- baselines: fp32, post-training binary, BatchNorm re-estimated ----
    fp32_preds = None
    metric = "top1"
    fp32_metric = post_metric = None
    if val_loader is not None:
        ref_gm = module_with_outputs(out_model, [val_score], dev)
        r = predict(ref_gm, tracked(val_loader, "validation (fp32)", enabled=progress), val_feed, val_score)
        del ref_gm
        if r["top1"] is None:
            metric = "agreement"
            fp32_preds = r["predictions"]
            fp32_metric = 1.0
            notes.append("validation data without labels: the metric is top-1 agreement with the fp32 model")
        else:
            fp32_metric = r["top1"]
        post_metric = validate(out_model, state_from=gm)
    _say(progress, f"fp32: {_fmt(fp32_metric, metric)}; binary ({len(binarized)} layer(s): "
                   f"{', '.join(binarized)}), post-training: {_fmt(post_metric, metric)}")

    history = []
    bn_info = None
    if bn_only or bn_reestimate:
        bn_info = reestimate_batchnorm(gm, bn_batches_iter(10 ** 6), feed_train)
    bn_metric = validate(out_model, state_from=gm) if bn_info and bn_info["layers"] else post_metric
    if bn_info and bn_info["layers"]:
        _say(progress, f"BatchNorm re-estimated on {bn_info['items']} items ({bn_info['batches']} batches): "
                       f"{_fmt(bn_metric, metric)}")
    history.append({"epoch": 0, "loss": None, metric: bn_metric, "lr": None, "steps": 0,
                    "seconds": time.perf_counter() - started})
    best_epoch, best_metric = 0, bn_metric
    best_state = _snapshot(gm)

    # ---- training ----
    total = 0 if bn_only else (iters if iters is not None else epochs * steps_per_epoch)
    if not bn_only and total > 0:
        params = [p for p in gm.parameters() if p.requires_grad]
        if optimizer == "adam":
            opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        n_epochs = math.ceil(total / max(steps_per_epoch, 1))
        step = 0
        for epoch in range(1, n_epochs + 1):
            gm.train()
            sampler.set_epoch(epoch)
            bar = None
            if progress:
                from tqdm import tqdm
                # disable=None: no bar when stderr is not a terminal (the per-epoch lines remain)
                bar = tqdm(total=min(steps_per_epoch, total - step), desc=f"epoch {epoch}/{n_epochs}",
                           unit="batch", file=sys.stderr, dynamic_ncols=True, leave=False, disable=None)
            loss_sum, seen, bad = 0.0, 0, 0
            t0 = time.perf_counter()
            for batch in train_loader:
                if step >= total:
                    break
                bad += len(batch["bad"])
                inputs = feed_train(batch)
                if inputs is None:
                    continue
                for group in opt.param_groups:
                    group["lr"] = lr * _lr_factor(schedule, step, total)
                out = gm(*inputs)
                if losses:
                    loss = sum(w * out[b].reshape(()) for b, w in losses)
                else:
                    lab = batch["label"].to(dev)
                    loss = nn.functional.cross_entropy(out[ce_on].reshape(out[ce_on].shape[0], out[ce_on].shape[1], -1),
                                                       lab.reshape(lab.shape[0], -1))
                if not torch.isfinite(loss):
                    raise FinetuneError(f"epoch {epoch}, step {step + 1}: the loss is {float(loss)}; "
                                        f"lower --lr")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                clip_latent(binarized_mods)
                step += 1
                n = int(inputs[0].shape[0])
                loss_sum += float(loss.detach()) * n
                seen += n
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_sum / max(seen, 1):.4f}")
            if bar is not None:
                bar.close()
            if bad:
                notes.append(f"epoch {epoch}: {bad} unreadable training item(s) skipped")
            if bn_reestimate:
                reestimate_batchnorm(gm, bn_batches_iter(10 ** 6 + epoch), feed_train)
            value = validate(out_model, state_from=gm)
            row = {"epoch": epoch, "loss": loss_sum / max(seen, 1), metric: value,
                   "lr": lr * _lr_factor(schedule, step, total), "steps": step,
                   "seconds": time.perf_counter() - started}
            history.append(row)
            better = value is None or best_metric is None or value > best_metric
            if better:
                best_epoch, best_metric = epoch, value
                best_state = _snapshot(gm)
            _say(progress, f"epoch {epoch}/{n_epochs}: loss {row['loss']:.4f}, val {_fmt(value, metric)}"
                           f"{' (best)' if better and value is not None else ''}, "
                           f"{time.perf_counter() - t0:.1f}s")
            if step >= total:
                break

    # ---- the result: the best epoch's latent weights, quantized ----
    gm.load_state_dict(best_state)
    final_fp32 = _with_trained_weights(out_model, gm)
    qmodel = quantize(final_fp32, "binary", keep=keep, only=only)
    if sorted(qmodel.quant_report.changed) != sorted(binarized):
        raise FinetuneError("internal: the written model's binary layers differ from the trained ones")
    result = FinetuneResult(model=qmodel, binarized=binarized, kept=kept, metric=metric, fp32=fp32_metric,
                            post_training=post_metric, bn_reestimated=bn_metric, best_epoch=best_epoch,
                            best_metric=best_metric, history=history,
                            seconds=time.perf_counter() - started, notes=notes, budget=budget_info)
    result.data = {"train": train_plan.source, "train_items": len(train_view), "batch_size": train_plan.batch_size,
                   "val": val_plan.source if val_plan else None,
                   "val_items": len(val_loader.dataset) if val_loader else 0,
                   "steps_per_epoch": steps_per_epoch, "optimizer": optimizer, "lr": lr, "schedule": schedule,
                   "seed": seed, "device": str(dev), "bn_batches": bn_batches,
                   "bn_items": bn_info["items"] if bn_info else 0}
    train_view.close()
    return result


def _fmt(value, metric):
    if value is None:
        return "-"
    return f"{100 * value:.2f}%" + (" agreement" if metric == "agreement" else " top-1")


def _snapshot(gm):
    return {k: v.detach().clone() for k, v in gm.state_dict().items()}


def _layer_values(gm):
    """{layer: [tensor per blob]}: latent weights for binarized blobs, the values otherwise."""
    out = {}
    for name, mod in caffe_layers(gm).items():
        vals = []
        for attr in mod.blob_attrs:
            pz = getattr(mod, "parametrizations", None)
            if pz is not None and attr in pz:
                vals.append(pz[attr].original)
            else:
                vals.append(getattr(mod, attr))
        out[name] = vals
    return out


def _copy_layer_state(src_gm, dst_gm):
    """Copy every layer's blobs (latent weights included) from one module to another."""
    src = _layer_values(src_gm)
    dst = _layer_values(dst_gm)
    with torch.no_grad():
        for name, vals in dst.items():
            for d, s in zip(vals, src.get(name, [])):
                if d is not s and tuple(d.shape) == tuple(s.shape):
                    d.copy_(s)


def _with_trained_weights(model, gm):
    """A copy of `model` whose blobs are the module's (latent weights, trained biases, BatchNorm
    statistics), for the layers the module has."""
    from .quant import copy_model
    new = copy_model(model)
    values = _layer_values(gm)
    for node in new.graph.nodes:
        vals = values.get(node.name)
        if vals is None or not node.blobs:
            continue
        blobs = list(node.blobs)
        for i, v in enumerate(vals):
            if i < len(blobs) and i not in node.shared_from and blobs[i] is not None:
                arr = v.detach().cpu().numpy().astype(np.float32).reshape(np.shape(blobs[i]))
                blobs[i] = arr
        node.blobs = blobs
    return new


__all__ = ["BinarizeWeight", "EpochSampler", "FinetuneError", "FinetuneResult", "SignSTE", "batchnorm_modules",
           "binarize_module", "binarize_ste", "channel_mean", "clip_latent", "finetune", "force_batch_statistics",
           "load_phase", "module_with_outputs", "phase_data_layer", "predict", "reestimate_batchnorm", "sign_pm1"]
