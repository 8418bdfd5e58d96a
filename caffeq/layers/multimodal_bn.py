"""mancinimassimiliano/caffe's MultiModalBatchNorm (caffe-0.15 branch, 44381ac; "Robust Place Categorization
with Deep Domain Generalization"): a BatchNorm of one latent domain whose output each sample's weight scales.
Bottoms: x (N, C, ...) and w, whose first N values weigh the samples (a soft domain probability).  Blobs:
the running mean (C,), the running variance (C,) (without eps) and an unused (1,).

With stored statistics (TEST, or use_global_stats): y = w[n] (x - mean[c]) / sqrt(var[c] + eps).  The nets sum
one such layer per domain (Eltwise SUM) and scale the sum once.  Training's w-weighted batch statistics (and
their clipping after 200 iterations) are not implemented: refused.
"""
import numpy as np
import torch
from torch import nn

from ..errors import ExportError
from .registry import Layer, LayerError, count, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def weighted_domain_norm(x, w, mean, variance, eps: float):
    """w[n] (x - mean) / sqrt(variance + eps), the statistics per channel (axis 1)."""
    view = (1, -1) + (1,) * (x.dim() - 2)
    weight = w.reshape(-1)[: x.shape[0]].reshape((-1,) + (1,) * (x.dim() - 1))
    return weight * ((x - mean.reshape(view)) / (variance.reshape(view) + eps).sqrt())


class WeightedDomainNorm(nn.Module):
    def __init__(self, channels: int, eps: float, use_global_stats=None):
        super().__init__()
        self.eps, self.use_global_stats = eps, use_global_stats
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("variance", torch.ones(channels))
        self.register_buffer("unused", torch.zeros(1))

    def forward(self, x, w):
        if self.training and self.use_global_stats is not True:
            raise RuntimeError("MultiModalBatchNorm's training statistics are not implemented; call .eval()")
        return weighted_domain_norm(x, w, self.mean, self.variance, self.eps)


@register_layer("MultiModalBatchNorm")
class MultiModalBatchNorm(Layer):
    blob_names = ("mean", "variance", "unused")
    buffer_blobs = (0, 1, 2)
    uses_training_flag = True

    def parse(self, lp):
        need_blobs(lp, lp.type, 2, 1, roles="x, sample weights")
        p = lp.multimodal_batch_norm_param
        if not p.eps > 0:
            raise LayerError(f"multimodal_batch_norm_param.eps must be > 0, got {p.eps}")
        return {"use_global_stats": bool(p.use_global_stats) if p.HasField("use_global_stats") else None,
                "eps": float(p.eps)}

    def infer(self, attrs, in_shapes):
        x, w = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) < 2:
            raise LayerError(f"MultiModalBatchNorm needs an (N, C, ...) bottom, got {list(x)}")
        if count(w) < x[0]:
            raise LayerError(f"MultiModalBatchNorm reads one weight per sample: {list(w)} holds fewer than {x[0]}")
        attrs["channels"] = int(x[1])
        return [x]

    def param_shapes(self, attrs, in_shapes):
        c = attrs["channels"]
        return [(c,), (c,), (1,)]

    def init_params(self, attrs, shapes, rng):
        c = shapes[0][0]
        return [np.zeros(c, np.float32), np.ones(c, np.float32), np.zeros(1, np.float32)]

    @staticmethod
    def refuse_batch_statistics(attrs, training, error=LayerError):
        stored = (not training) if attrs["use_global_stats"] is None else attrs["use_global_stats"]
        if not stored:
            raise error("MultiModalBatchNorm's training statistics (w-weighted batch means and variances, "
                        "clipped after 200 iterations) are not implemented; it runs with its stored ones")

    def forward(self, attrs, params, x, w, training=False):
        self.refuse_batch_statistics(attrs, training)
        return weighted_domain_norm(x, w, params[0], params[1], attrs["eps"])

    def onnx(self, ctx, node):
        self.refuse_batch_statistics(node.attrs, False, ExportError)
        x, w = node.inputs
        shape = ctx.shape(x)
        view = [1, node.attrs["channels"]] + [1] * (len(shape) - 2)
        mean = np.asarray(node.blobs[0], np.float32).reshape(view)
        std = np.sqrt(np.asarray(node.blobs[1], np.float32).reshape(view) + np.float32(node.attrs["eps"]))
        flat = ctx.op("Reshape", [w, ctx.i64([-1])], "w_flat")
        first = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([shape[0]]), ctx.i64([0])], "w_first")
        weight = ctx.op("Reshape", [first, ctx.i64([shape[0]] + [1] * (len(shape) - 1))], "w")
        centred = ctx.op("Sub", [x, ctx.const(mean, node.name + "_mean")], "centred")
        normed = ctx.op("Div", [centred, ctx.const(std.astype(np.float32), node.name + "_std")], "normed")
        ctx.add_node("Mul", [weight, normed], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        self.refuse_batch_statistics(node.attrs, False, ExportError)
        m = emit.instance(WeightedDomainNorm, node.attrs["channels"], node.attrs["eps"], node.attrs["use_global_stats"],
                          needs=(weighted_domain_norm,))
        for i, name in enumerate(self.blob_names):
            emit.param(name, i)
        return f"{m}({', '.join(emit.inputs)})"
