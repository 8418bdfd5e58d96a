"""BatchNorm statistics re-estimated exactly (float64, Chan et al.'s pairwise combination) on
training batches, written in Caffe's layout (mean, variance, factor 1)."""
import torch

from ..errors import DataError
from .ste import caffe_layers


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
