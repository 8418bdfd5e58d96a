"""ducksoup/autodial's Dial (AutoDIAL, domain alignment layers; src/caffe/layers/dial_layer.cpp, cee9cea):
a BatchNorm whose batch holds source images then target images, split at dial_param.slice_point (-1 or
unset: half the setup batch).  Blobs: alpha (1,), the moving sums of the means and of the variances
(2, C), row 0 the source's and row 1 the target's, and the moving-average factor (1,).

With stored statistics (TEST, or use_global_stats) it is BatchNorm with one row: test_stats (TARGET by
default) picks it, mean = sum / factor (0 when the factor is 0), y = (x - mean) / sqrt(variance + eps).

With the batch's statistics, alpha clipped to [0.5, 1] (the fork clips the blob itself) mixes the two
domains: with m_s, m_t the per-channel means of the source and target samples,
  mean_s = alpha m_s + (1 - alpha) m_t,  mean_t = alpha m_t + (1 - alpha) m_s,
  var_s = alpha E_src[(x - mean_s)^2] + (1 - alpha) E_tgt[(x - mean_s)^2]   (var_t likewise, the
  weights swapped), and the source samples are normalized by (mean_s, var_s), the target ones by
(mean_t, var_t).  Training adds the mixed statistics to the moving sums as Caffe's BatchNorm does
(sums times moving_average_fraction plus the batch's, its variance times m / (m - 1)).
"""
import numpy as np
import torch
from torch import nn

from .norm import onnx_reduce
from .registry import Layer, LayerError, need_blobs, register_layer

SOURCE, TARGET = 0, 1


def dial_stored(x, mean_sum, var_sum, factor, row: int, eps: float):
    """Dial with its stored statistics: row `row` of the (2, C) sums over the factor."""
    s = factor.reshape(())
    f = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    view = [1, -1] + [1] * (x.dim() - 2)
    mean = (mean_sum[row] * f).reshape(view)
    var = (var_sum[row] * f).reshape(view)
    return (x - mean) / torch.sqrt(var + eps)


def dial_batch(x, alpha, split: int, eps: float):
    """Dial with the batch's statistics, source samples [0, split), target [split, N):
    (y, the mixed means (2, C), the mixed variances (2, C))."""
    axes = [0] + list(range(2, x.dim()))
    a = alpha.reshape(()).clamp(0.5, 1.0)
    src, tgt = x[:split], x[split:]
    m_s, m_t = src.mean(axes, keepdim=True), tgt.mean(axes, keepdim=True)
    mean_s = a * m_s + (1 - a) * m_t
    mean_t = a * m_t + (1 - a) * m_s
    var_s = a * ((src - mean_s) ** 2).mean(axes, keepdim=True) + (1 - a) * ((tgt - mean_s) ** 2).mean(axes, keepdim=True)
    var_t = (1 - a) * ((src - mean_t) ** 2).mean(axes, keepdim=True) + a * ((tgt - mean_t) ** 2).mean(axes, keepdim=True)
    y = torch.cat([(src - mean_s) / torch.sqrt(var_s + eps), (tgt - mean_t) / torch.sqrt(var_t + eps)], 0)
    return y, torch.stack([mean_s.reshape(-1), mean_t.reshape(-1)]), torch.stack([var_s.reshape(-1), var_t.reshape(-1)])


def dial(x, alpha, mean_sum, var_sum, factor, stored: bool, update: bool, split: int, row: int, eps: float,
         moving_average_fraction: float):
    """Dial's top: stored statistics or the batch's; `update` adds the batch's to the moving sums."""
    flat = x.dim() == 1                  # one axis: one channel
    x = x.reshape(-1, 1) if flat else x
    if stored:
        y = dial_stored(x, mean_sum, var_sum, factor, row, eps)
    else:
        y, mean, var = dial_batch(x, alpha, split, eps)
        if update:
            m = x.numel() // x.shape[1]
            with torch.no_grad():
                factor.mul_(moving_average_fraction).add_(1.0)
                mean_sum.mul_(moving_average_fraction).add_(mean.detach())
                var_sum.mul_(moving_average_fraction).add_(var.detach(), alpha=m / (m - 1) if m > 1 else 1.0)
    return y.reshape(-1) if flat else y


class DialNorm(nn.Module):
    """Dial as a module: the stored statistics in eval mode (or use_global_stats True), the batch's
    while training (use_global_stats None) or always (False); training updates the moving sums."""

    def __init__(self, channels: int, split: int, row: int, eps: float, moving_average_fraction: float,
                 use_global_stats: bool | None = None):
        super().__init__()
        self.split, self.row, self.eps, self.maf = split, row, eps, moving_average_fraction
        self.use_global_stats = use_global_stats
        self.alpha = nn.Parameter(torch.ones(1))
        self.register_buffer("mean_sum", torch.zeros(2, channels))
        self.register_buffer("var_sum", torch.zeros(2, channels))
        self.register_buffer("factor", torch.zeros(1))

    def forward(self, x):
        stored = (not self.training) if self.use_global_stats is None else self.use_global_stats
        return dial(x, self.alpha, self.mean_sum, self.var_sum, self.factor, stored, self.training, self.split,
                    self.row, self.eps, self.maf)


@register_layer("Dial")
class Dial(Layer):
    blob_names = ("alpha", "mean_sum", "variance_sum", "factor")
    buffer_blobs = (1, 2, 3)
    uses_training_flag = True

    def parse(self, lp):
        need_blobs(lp, "Dial", 1, 1)
        p = lp.dial_param
        if not p.eps > 0:
            raise LayerError(f"dial_param.eps must be > 0, got {p.eps}")
        alpha = float(p.weight_filler.value) if p.weight_filler.type == "constant" else 1.0
        return {"use_global_stats": bool(p.use_global_stats) if p.HasField("use_global_stats") else None,
                "moving_average_fraction": float(p.moving_average_fraction), "eps": float(p.eps),
                "slice_point": int(p.slice_point), "row": int(p.test_stats), "alpha_init": alpha}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if not s:
            raise LayerError("Dial needs a bottom with at least one axis")
        attrs["channels"] = 1 if len(s) == 1 else int(s[1])
        split = s[0] // 2 if attrs["slice_point"] == -1 else attrs["slice_point"]
        if attrs["use_global_stats"] is False and not 0 < split < s[0]:
            # the fork averages over split and N - split samples: an empty domain divides by zero
            raise LayerError(f"Dial with the batch's statistics needs source and target samples: slice_point "
                             f"{split} for a batch of {s[0]}")
        attrs["split"] = split
        return [s]

    def param_shapes(self, attrs, in_shapes):
        c = attrs["channels"]
        return [(1,), (2, c), (2, c), (1,)]

    def init_params(self, attrs, shapes, rng):
        c = shapes[1][1]
        # statistics of mean 0 and variance 1 (the fork starts from all-zero sums, which give x / sqrt(eps))
        return [np.full(1, attrs["alpha_init"], np.float32), np.zeros((2, c), np.float32),
                np.ones((2, c), np.float32), np.ones(1, np.float32)]

    def _stored(self, attrs, training):
        g = attrs["use_global_stats"]
        return (not training) if g is None else g

    def forward(self, attrs, params, x, training=False):
        return dial(x, params[0], params[1], params[2], params[3], self._stored(attrs, training), training,
                    attrs["split"], attrs["row"], attrs["eps"], attrs["moving_average_fraction"])

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        shape = [int(d) for d in ctx.shape(x)]
        if len(shape) == 1:
            x = ctx.op("Reshape", [x, ctx.i64([-1, 1])], "2d", name=node.name)
        rank = max(len(shape), 2)
        view = [1, a["channels"]] + [1] * (rank - 2)
        eps = ctx.f32(a["eps"])
        y = out if len(shape) > 1 else ctx.tmp(node.name + "_y2d")
        if self._stored(a, False):
            s = np.float32(np.asarray(node.blobs[3]).reshape(-1)[0])
            f = np.float32(0) if s == 0 else np.float32(1) / s
            mean = (np.asarray(node.blobs[1], np.float32)[a["row"]] * f).reshape(view)
            std = np.sqrt((np.asarray(node.blobs[2], np.float32)[a["row"]] * f).reshape(view) + np.float32(a["eps"]))
            centred = ctx.op("Sub", [x, ctx.const(mean.astype(np.float32), node.name + "_mean")], "centred",
                             name=node.name)
            ctx.add_node("Div", [centred, ctx.const(std.astype(np.float32), node.name + "_std")], [y])
        else:
            self._onnx_batch(ctx, node, x, y, rank, eps)
        if len(shape) == 1:
            ctx.add_node("Reshape", [y, ctx.i64([-1])], [out])

    @staticmethod
    def _onnx_batch(ctx, node, x, out, rank, eps):
        axes = [0] + list(range(2, rank))
        split = node.attrs["split"]
        src = ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([split]), ctx.i64([0])], "src", name=node.name)
        tgt = ctx.op("Slice", [x, ctx.i64([split]), ctx.i64([np.iinfo(np.int64).max]), ctx.i64([0])], "tgt")
        a = ctx.op("Clip", [ctx.weight(node, 0), ctx.f32(0.5), ctx.f32(1.0)], "alpha")
        rest = ctx.op("Sub", [ctx.f32(1.0), a], "one_minus_alpha")

        def mix(p, q, wp, wq, hint):
            return ctx.op("Add", [ctx.op("Mul", [wp, p], hint + "_p"), ctx.op("Mul", [wq, q], hint + "_q")], hint)

        def mean_square(v, m, hint):
            d = ctx.op("Sub", [v, m], hint + "_d")
            return onnx_reduce(ctx, "ReduceMean", ctx.op("Mul", [d, d], hint + "_sq"), axes, True)

        m_s, m_t = (onnx_reduce(ctx, "ReduceMean", v, axes, True) for v in (src, tgt))
        mean_s, mean_t = mix(m_s, m_t, a, rest, "mean_s"), mix(m_t, m_s, a, rest, "mean_t")
        var_s = mix(mean_square(src, mean_s, "ss"), mean_square(tgt, mean_s, "ts"), a, rest, "var_s")
        var_t = mix(mean_square(src, mean_t, "st"), mean_square(tgt, mean_t, "tt"), rest, a, "var_t")
        parts = []
        for v, m, var, hint in ((src, mean_s, var_s, "y_s"), (tgt, mean_t, var_t, "y_t")):
            std = ctx.op("Sqrt", [ctx.op("Add", [var, eps], hint + "_var_eps")], hint + "_std")
            parts.append(ctx.op("Div", [ctx.op("Sub", [v, m], hint + "_centred"), std], hint))
        ctx.add_node("Concat", parts, [out], axis=0)

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(DialNorm, a["channels"], a["split"], a["row"], a["eps"], a["moving_average_fraction"],
                          a["use_global_stats"], needs=(dial_stored, dial_batch, dial))
        for i, name in enumerate(("alpha", "mean_sum", "var_sum", "factor")):
            emit.param(name, i)
        return f"{m}({emit.inputs[0]})"
