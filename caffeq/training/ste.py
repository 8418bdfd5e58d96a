"""Binary weights with a straight-through estimator (see caffeq.finetune for the gradient), and the
state of the torch modules they train: latent weights, snapshots, copies back into a Model."""
import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from ..backends.torch_backend import CaffeLayer
from ..quant import copy_model, get_quantizer, quantizable_blobs
from . import FinetuneError

STE_CLIP = 1.0


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
    return {m.caffe_name: m for m in gm.modules() if isinstance(m, CaffeLayer)}


def binarize_module(gm, model, layers, clip=STE_CLIP):
    """Register BinarizeWeight on the weight blobs of `layers` in gm.

    Returns {layer: [(module, blob attribute)]}: the latent weight of each is
    `module.parametrizations[attr].original`.
    """
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


def snapshot(gm):
    return {k: v.detach().clone() for k, v in gm.state_dict().items()}


def layer_values(gm):
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


def copy_layer_state(src_gm, dst_gm):
    """Copy every layer's blobs (latent weights included) from one module to another."""
    src = layer_values(src_gm)
    dst = layer_values(dst_gm)
    with torch.no_grad():
        for name, vals in dst.items():
            for d, s in zip(vals, src.get(name, [])):
                if d is not s and tuple(d.shape) == tuple(s.shape):
                    d.copy_(s)


def with_trained_weights(model, gm):
    """A copy of `model` whose blobs are the module's (latent weights, trained biases, BatchNorm
    statistics), for the layers the module has."""
    new = copy_model(model)
    values = layer_values(gm)
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
