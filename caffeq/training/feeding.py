"""Feeding a caffeq torch module: the phase's model with its data layer as an input, datasets read
epoch after epoch, loaders, batches to positional inputs, the score blob and Caffe's accuracy rule."""
import copy
import os

import torch

from ..data import Collate, DataTransformer, worker_init
from ..data.plan import as_input_layer, phase_data_layer
from ..errors import DataError
from ..model import load
from . import FinetuneError


def load_phase(path, weights, net, phase, item_shape=None, batch=1):
    """The model of `net` in `phase`; its data layer (if any) becomes an Input layer shaped
    (batch,) + item_shape, so that the layer's own source need not exist.  `model.net` stays the
    original net (what writers save)."""
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


def load_output_model(path, weights, net, item_shape, batch):
    """The TEST-phase model that is written: loaded as `caffeq.load` would (so it evaluates and
    exports like any other), or, when its data layer's source is missing, with that layer as an
    Input layer."""
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
    t = plan.transformer
    return DataTransformer(scale=t.scale, mean_file=None, mean_value=t.mean_value, crop_size=t.crop_size,
                           mirror=t.mirror, force_color=t.force_color, force_gray=t.force_gray,
                           phase="TRAIN", mean=t.mean)


def probe_shape(dataset, source):
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


def make_loader(dataset, batch_size, workers, device, sampler=None, expected=None):
    on_cuda = torch.device(device).type == "cuda"
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, shuffle=False, num_workers=workers,
        collate_fn=Collate(expected, None), pin_memory=on_cuda,
        worker_init_fn=worker_init if workers else None, persistent_workers=bool(workers))
    inner = dataset.dataset if isinstance(dataset, EpochView) else dataset
    loader.dataset_has_labels = bool(getattr(inner, "has_labels", True))
    return loader
