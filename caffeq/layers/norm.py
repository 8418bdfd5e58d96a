"""Normalization layers: BatchNorm, LRN, MVN (BVLC Caffe semantics).

- BatchNorm has no affine part (a Scale layer follows it).  Its blobs are the
  running mean, variance and a moving-average factor s; the statistics used
  are blob / s, with s == 0 meaning 0.  NVCaffe's `scale_bias` adds scale and
  bias blobs (5 in all) and uses the mean/variance blobs as they are.  Xilinx's
  caffe-xilinx (Vitis-AI d02dcb6; its nets carry the same scale_filler /
  bias_filler) computes the same but stores [scale, bias, mean, variance] and
  an unused 1-element blob (or only the first four): read into NVCaffe's order.
- LRN ACROSS_CHANNELS: x * (k + alpha/n * sum of x^2 over n channels)^-beta.
  WITHIN_CHANNEL is Caffe's split/square/AVE-pool/power/product chain:
  x * (1 + alpha * mean of x^2 over an n x n window)^-beta (k is unused there,
  and the window average always divides by n*n, zero padding included).
- MVN adds eps to the standard deviation, not to the variance, and its top is
  Caffe's legacy 4-axis shape.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..io.schema import caffe_pb2
from .registry import Layer, LayerError, count, need_blobs, register_layer

# ---- ONNX helpers shared with misc.py ---------------------------------------------

def onnx_reduce(ctx, op, x, axes, keepdims, out=None):
    """A Reduce* node; axes moved from attribute to input in opset 13 (Sum) / 18 (the rest)."""
    out = out or ctx.tmp(f"{x}_{op.lower()}")
    axes = [int(a) for a in axes]
    if ctx.opset >= 18 or (op == "ReduceSum" and ctx.opset >= 13):
        ctx.add_node(op, [x, ctx.const(np.array(axes, np.int64))], [out], keepdims=int(keepdims))
    else:
        ctx.add_node(op, [x], [out], axes=axes, keepdims=int(keepdims))
    return out


def onnx_channel_vector(ctx, name, channels, rank, axis=1):
    """Reshape a (C,) tensor so it broadcasts along `axis` of a rank-`rank` tensor."""
    if rank - axis - 1 <= 0:
        return name
    out = ctx.tmp(f"{name}_bcast")
    shape = np.array([channels] + [1] * (rank - axis - 1), np.int64)
    ctx.add_node("Reshape", [name, ctx.const(shape)], [out])
    return out


# ---- BatchNorm ---------------------------------------------------------------------

def batchnorm_std(var, eps: float, eps_after_sqrt: bool = False):
    """BatchNorm's divisor: sqrt(var + eps) (Caffe), or sqrt(var) + eps (synopsys-caffe's
    add_eps_before_sqrt: false)."""
    if eps_after_sqrt:
        return torch.sqrt(var) + eps
    return torch.sqrt(var + eps)


class CaffeBatchNorm:
    """Mixed into nn.BatchNorm1d/2d/3d (CaffeBatchNorm1d/2d/3d): Caffe's (x - mean) / sqrt(var + eps)
    * weight + bias in that order (nn.BatchNorm folds it into x * a + b, which rounds differently).
    use_global_stats as Caffe's: None uses the stored statistics in eval mode and the batch's in
    train mode, True always the stored ones, False never. Running averages are PyTorch's (momentum).
    eps_after_sqrt: divide by sqrt(var) + eps instead (synopsys-caffe)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, use_global_stats=None,
                 eps_after_sqrt=False):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine)
        self.use_global_stats = use_global_stats
        self.eps_after_sqrt = eps_after_sqrt

    def forward(self, x):
        use_global = not self.training if self.use_global_stats is None else self.use_global_stats
        view = [1, -1] + [1] * (x.dim() - 2)
        mean, var = self.running_mean, self.running_var
        if use_global and mean is not None and var is not None:
            mean, var = mean.reshape(view), var.reshape(view)
        else:
            dims = [0] + list(range(2, x.dim()))
            mean = x.mean(dim=dims, keepdim=True)
            var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)  # biased, as Caffe normalizes
            if self.training:
                self.update_running_stats(mean, var, x.numel() // x.shape[1])
        y = (x - mean) / batchnorm_std(var, self.eps, self.eps_after_sqrt)
        if self.weight is not None:
            y = y * self.weight.reshape(view)
        if self.bias is not None:
            y = y + self.bias.reshape(view)
        return y

    def update_running_stats(self, mean, var, count: int):
        running_mean, running_var = self.running_mean, self.running_var
        if running_mean is None or running_var is None or self.momentum is None:
            return
        m = self.momentum
        with torch.no_grad():
            running_mean.mul_(1 - m).add_(mean.reshape(-1), alpha=m)
            running_var.mul_(1 - m).add_(var.reshape(-1) * (count / max(count - 1, 1)), alpha=m)
        batches = self.num_batches_tracked
        if batches is not None:
            batches.add_(1)


def emit_exact_batchnorm(emit):
    """Write CaffeBatchNorm and what it calls into model.py (BatchNorm and DenseBlock layers)."""
    for helper in (batchnorm_std, CaffeBatchNorm):
        emit.helper(helper)


class CaffeBatchNorm1d(CaffeBatchNorm, nn.BatchNorm1d):
    """nn.BatchNorm1d in Caffe's order (see CaffeBatchNorm)."""


class CaffeBatchNorm2d(CaffeBatchNorm, nn.BatchNorm2d):
    """nn.BatchNorm2d in Caffe's order (see CaffeBatchNorm)."""


class CaffeBatchNorm3d(CaffeBatchNorm, nn.BatchNorm3d):
    """nn.BatchNorm3d in Caffe's order (see CaffeBatchNorm)."""


_CAFFE_BATCHNORM = {1: CaffeBatchNorm1d, 2: CaffeBatchNorm2d, 3: CaffeBatchNorm3d}


def _torch_scale_after(node, emit, channels):
    """The Scale layer that only this BatchNorm feeds, with one factor per channel on axis 1
    (nn.BatchNorm's affine part), or None."""
    users = emit.consumers(node.outputs[0])
    if len(users) != 1 or emit.is_output(node.outputs[0]):
        return None
    sc = users[0]
    if sc.type != "Scale" or sc.attrs["two_bottoms"] or sc.attrs.get("_axis") != 1:
        return None
    if any(tuple(s) != (channels,) for s in sc.expected_param_shapes or [()]):
        return None
    if node.shared_from or sc.shared_from or any(node.param_names) or any(sc.param_names):
        return None
    return sc


# ctensmeyer/caffe 19fcdb2 (font and document nets) keeps BVLC's layer under the name BatchNorm2 (its own
# BatchNorm is another, five-blob layer); the forward differs only by powx(0.5) in place of sqrt
@register_layer("BatchNorm", "BatchNorm2")
class BatchNorm(Layer):
    blob_names = ("mean", "variance", "factor", "scale", "bias")
    buffer_blobs = (0, 1, 2)
    uses_training_flag = True

    def parse(self, lp):
        p = lp.batch_norm_param
        sknet = [f for f in ("frozen", "momentum") if p.HasField(f)]
        if sknet:   # declared for SKNet's CuDNNBatchNorm (cudnn_bn.py), which reads this message its own way
            raise LayerError(f"batch_norm_param.{sknet[0]} is SKNet's CuDNNBatchNorm field; BatchNorm reads "
                             f"use_global_stats and moving_average_fraction")
        if p.relu:   # intel/caffe: its MKL-DNN BatchNorm fuses a ReLU, its CAFFE engine does not
            raise LayerError("batch_norm_param.relu (Intel Caffe's ReLU fused into its MKL-DNN BatchNorm, ignored by "
                             "its CAFFE engine) is not supported: write a ReLU layer after the BatchNorm")
        eps = float(p.eps)
        if not eps >= 0:
            raise LayerError(f"batch_norm_param.eps must be >= 0, got {eps}")
        scale_bias = bool(p.scale_bias) or p.HasField("scale_filler") or p.HasField("bias_filler")
        if scale_bias:
            eps = max(eps, 1e-5)  # NVCaffe clamps eps from below
        # a layer's own `phase` overrides the net's (Caffe's Net::Init), and BatchNorm's default statistics
        # follow it: stored ones only at TEST (caffe_nd's PREDICT is not TEST either)
        layer_phase = caffe_pb2.Phase.Name(lp.phase) if lp.HasField("phase") else None
        notes = []
        if layer_phase not in (None, "TEST") and not (p.HasField("use_global_stats") and not scale_bias):
            notes.append(f"phase: {layer_phase} on the layer: Caffe normalizes by each batch's own statistics here "
                         f"even in a TEST net (BatchNorm's default follows the layer's phase); "
                         f"batch_norm_param {{ use_global_stats: true }} would use the stored ones")
        return {
            # None: Caffe's phase default (global stats at TEST); here torch's eval mode decides
            "use_global_stats": bool(p.use_global_stats) if p.HasField("use_global_stats") else None,
            "moving_average_fraction": float(p.moving_average_fraction),
            "eps": eps,
            "scale_bias": scale_bias,
            # synopsys-caffe: add_eps_before_sqrt: false divides by sqrt(var) + eps
            "eps_after_sqrt": not p.add_eps_before_sqrt,
            "layer_phase": layer_phase,
            "reading_notes": notes,
        }

    def stored_blobs(self, attrs, arrays, notes):
        """Xilinx's [scale, bias, mean, variance(, 1 value)] into NVCaffe's [mean, variance, factor, scale, bias]:
        NVCaffe keeps its 1-value blob third, Xilinx fifth or not at all."""
        if not attrs["scale_bias"] or len(arrays) not in (4, 5) or arrays[0].size == 1:
            return arrays
        if len(arrays) == 5 and (arrays[2].size == 1 or arrays[4].size != 1):
            return arrays
        if len(arrays) == 4 and any(a.size != arrays[0].size for a in arrays):
            return arrays
        notes.append(f"BatchNorm blobs stored as Xilinx's caffe-xilinx does ([scale, bias, mean, variance"
                     f"{', 1 value' if len(arrays) == 5 else ''}]): read in NVCaffe's order")
        gamma, beta, mean, var = (a.reshape(-1) for a in arrays[:4])
        return [mean, var, np.ones(1, np.float32), gamma, beta]

    def _channels(self, attrs, shape):
        if len(shape) == 0:
            raise LayerError("BatchNorm needs an input with at least one axis")
        attrs["channels"] = 1 if len(shape) == 1 else int(shape[1])
        return attrs["channels"]

    def infer(self, attrs, in_shapes):
        if len(in_shapes) != 1:
            raise LayerError(f"BatchNorm takes one bottom, got {len(in_shapes)}")
        self._channels(attrs, in_shapes[0])
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        c = self._channels(attrs, in_shapes[0])
        shapes = [(c,), (c,), (1,)]
        if attrs["scale_bias"]:
            shapes += [(c,), (c,)]
        return shapes

    def init_params(self, attrs, shapes, rng):
        c = shapes[0][0]
        blobs = [np.zeros(c, np.float32), np.ones(c, np.float32), np.ones(1, np.float32)]
        if attrs["scale_bias"]:
            blobs += [np.ones(c, np.float32), np.zeros(c, np.float32)]
        return blobs

    @staticmethod
    def stored_statistics(attrs):
        """True or False where the layer always normalizes by the stored (or the batch's) statistics, None
        where the phase it runs in decides (TEST: stored)."""
        phase = attrs.get("layer_phase")
        by_phase = None if phase is None else phase == "TEST"
        if attrs.get("scale_bias"):
            return by_phase  # NVCaffe: the phase alone decides
        g = attrs.get("use_global_stats")
        return by_phase if g is None else g

    def _uses_global(self, attrs, training):
        fixed = self.stored_statistics(attrs)
        return (not training) if fixed is None else fixed

    @staticmethod
    def global_stats(attrs, params):
        """(mean, variance) the layer uses with stored statistics."""
        if attrs["scale_bias"]:
            return params[0], params[1]  # NVCaffe ignores the factor blob
        s = params[2].reshape(())
        f = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
        return params[0] * f, params[1] * f

    def forward(self, attrs, params, x, training=False):
        c = attrs["channels"]
        bshape = (1, c) + (1,) * (x.dim() - 2) if x.dim() >= 2 else (-1,)
        if self._uses_global(attrs, training):
            mean, var = self.global_stats(attrs, params)
            mean, var = mean.reshape(bshape), var.reshape(bshape)
        else:
            dims = [d for d in range(x.dim()) if d != 1] if x.dim() >= 2 else [0]
            mean = x.mean(dim=dims, keepdim=True)
            var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)  # biased, as Caffe normalizes
            if training:
                self._update(attrs, params, x, mean, var)
        y = (x - mean) / batchnorm_std(var, attrs["eps"], attrs.get("eps_after_sqrt", False))
        if attrs["scale_bias"]:
            y = y * params[3].reshape(bshape) + params[4].reshape(bshape)
        return y

    @staticmethod
    def _update(attrs, params, x, mean, var):
        maf = attrs["moving_average_fraction"]
        c = attrs["channels"]
        with torch.no_grad():
            bm = mean.detach().reshape(-1).to(params[0].dtype)
            bv = var.detach().reshape(-1).to(params[1].dtype)
            if attrs["scale_bias"]:
                # NVCaffe: exponential moving average of the mean and of (variance + eps)
                params[0].mul_(maf).add_(bm, alpha=1 - maf)
                params[1].mul_(maf).add_(bv + attrs["eps"], alpha=1 - maf)
                return
            m = x.numel() // c
            correction = m / (m - 1) if m > 1 else 1.0  # Caffe stores the unbiased variance
            params[2].mul_(maf).add_(1.0)
            params[0].mul_(maf).add_(bm)
            params[1].mul_(maf).add_(bv, alpha=correction)

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        rank = len(ctx.shape(x))
        if not self._uses_global(a, False):
            # use_global_stats: false normalizes by the batch's own (biased) statistics at test too
            axes = [0] + list(range(2, rank))
            mean = onnx_reduce(ctx, "ReduceMean", x, axes, True)
            centred = ctx.tmp(node.name + "_centred")
            ctx.add_node("Sub", [x, mean], [centred], name=node.name)
            square = ctx.tmp(node.name + "_sq")
            ctx.add_node("Mul", [centred, centred], [square])
            var = onnx_reduce(ctx, "ReduceMean", square, axes, True)
            std = ctx.tmp(node.name + "_std")
            eps = ctx.const(np.array(a["eps"], np.float32))
            if a.get("eps_after_sqrt"):
                root = ctx.tmp(node.name + "_sqrt")
                ctx.add_node("Sqrt", [var], [root])
                ctx.add_node("Add", [root, eps], [std])
            else:
                var_eps = ctx.tmp(node.name + "_var_eps")
                ctx.add_node("Add", [var, eps], [var_eps])
                ctx.add_node("Sqrt", [var_eps], [std])
            ctx.add_node("Div", [centred, std], [out])
            return
        if a["scale_bias"]:
            mean = np.asarray(node.blobs[0], np.float32)
            var = np.asarray(node.blobs[1], np.float32)
        else:
            s = np.float32(np.asarray(node.blobs[2]).reshape(-1)[0])
            f = np.float32(0) if s == 0 else np.float32(1) / s
            mean = np.asarray(node.blobs[0], np.float32) * f
            var = np.asarray(node.blobs[1], np.float32) * f
        if a.get("eps_after_sqrt"):
            std = (np.sqrt(var) + np.float32(a["eps"])).astype(np.float32)
        else:
            std = np.sqrt(var + np.float32(a["eps"])).astype(np.float32)
        bshape = (a["channels"],) + (1,) * max(rank - 2, 0)
        centred = ctx.tmp(node.name + "_centred")
        ctx.add_node("Sub", [x, ctx.const(mean.reshape(bshape), node.name + "_mean")], [centred],
                     name=node.name)
        if not a["scale_bias"]:
            ctx.add_node("Div", [centred, ctx.const(std.reshape(bshape), node.name + "_std")], [out])
            return
        normed = ctx.tmp(node.name + "_normed")
        ctx.add_node("Div", [centred, ctx.const(std.reshape(bshape), node.name + "_std")], [normed])
        scaled = ctx.tmp(node.name + "_scaled")
        ctx.add_node("Mul", [normed, onnx_channel_vector(ctx, ctx.weight(node, 3), a["channels"], rank)],
                     [scaled])
        ctx.add_node("Add", [scaled, onnx_channel_vector(ctx, ctx.weight(node, 4), a["channels"], rank)],
                     [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        rank = len(emit.in_shape(0))
        if rank not in (2, 3, 4, 5):
            raise LayerError(f"a {rank}-axis input has no torch.nn.BatchNorm module")
        c = a["channels"]
        d = {2: 1, 3: 1, 4: 2, 5: 3}[rank]
        scale, weight, bias = None, None, None
        if a["scale_bias"]:  # NVCaffe: the blobs are the statistics and the affine part
            mean, var, weight, bias = emit.blob(0), emit.blob(1), emit.blob(3), emit.blob(4)
        else:
            # Caffe's blobs are sums scaled by the moving-average factor s: the statistics are
            # blob / s (0 when s is 0), the same float32 products forward computes
            s = np.float32(emit.blob(2).reshape(-1)[0])
            f = np.float32(0) if s == 0 else np.float32(1) / s
            mean, var = emit.blob(0) * f, emit.blob(1) * f
            scale = _torch_scale_after(node, emit, c)
            if scale is not None:
                weight = emit.blob(0, scale)
                bias = emit.blob(1, scale) if scale.attrs["bias_term"] else np.zeros(c, np.float32)
        use_global = self.stored_statistics(a)
        # plain nn.BatchNorm unless asked for Caffe's exact op order, or the layer normalizes with
        # batch statistics even in eval mode (use_global_stats: false)
        # and sqrt(var) + eps (synopsys-caffe), which nn.BatchNorm cannot express
        exact = emit.exact_batchnorm or use_global is False or a.get("eps_after_sqrt", False)
        args = [str(c)]
        if np.float32(a["eps"]) != np.float32(1e-5):
            args.append(f"eps={emit.lit(a['eps'])}")
        # torch's running average r = (1 - m) r + m batch is Caffe's in the long run with m = 1 - maf
        momentum = float(f"{1 - float(emit.lit(a['moving_average_fraction'])):.6g}")
        args.append(f"momentum={momentum!r}")
        if weight is None:
            args.append("affine=False")
        if exact:
            emit_exact_batchnorm(emit)      # model.py gets these very classes
            cls = emit.helper(_CAFFE_BATCHNORM[d])
            if use_global is not None:
                args.append(f"use_global_stats={use_global}")
            if a.get("eps_after_sqrt"):
                args.append("eps_after_sqrt=True")
        else:
            cls = f"nn.BatchNorm{d}d"
            if use_global:
                emit.note("The prototxt sets use_global_stats: true (Caffe then keeps the stored "
                          "statistics even while training); these nn.BatchNorm modules use batch "
                          "statistics in train mode, as PyTorch does. Call .eval() on them to freeze "
                          "them while fine-tuning.")
        m = emit.module(f"{cls}({', '.join(args)})",
                        comment=f"with {scale.name} (Scale) as its affine part" if scale else None)
        if weight is not None:
            emit.param("weight", weight, blob=3 if a["scale_bias"] else None)
            emit.param("bias", bias, blob=4 if a["scale_bias"] else None)
        emit.buffer("running_mean", mean, blob=0)
        emit.buffer("running_var", var, blob=1)
        emit.buffer("num_batches_tracked", np.array(0, np.int64))
        if scale is not None:
            emit.absorb(scale)
        if not exact:
            emit.note("BatchNorm (+ Scale) layers are nn.BatchNorm modules holding Caffe's statistics "
                      "divided by its moving-average factor. In eval mode they compute x * a + b, "
                      "Caffe's (x - mean) / sqrt(var + eps) * w + b up to float32 rounding (caffeq's "
                      "exact_batchnorm=True keeps Caffe's order).")
        emit.note("BatchNorm momentum is 1 - Caffe's moving_average_fraction, Caffe's averaging "
                  "(PyTorch's default is 0.1).")
        return f"{m}({emit.inputs[0]})"


# ---- LRN -----------------------------------------------------------------------------

ACROSS_CHANNELS, WITHIN_CHANNEL = 0, 1


def window_sum(x, dim: int, n: int):
    """Sum over a centred window of odd size n along dim, zero padded (n shifted adds:
    cheaper than torch's pooling kernels for LRN's small windows, and no size limits)."""
    pad = (n - 1) // 2
    if pad == 0:
        return x
    padded = F.pad(x, [0, 0] * (x.dim() - dim - 1) + [pad, pad])
    size = x.shape[dim]
    total = padded.narrow(dim, 0, size)
    for j in range(1, n):
        total = total + padded.narrow(dim, j, size)
    return total


def caffe_lrn(x, n: int, alpha: float, beta: float, k: float, within_channel: bool):
    """ACROSS_CHANNELS: x * (k + alpha/n * sum of x^2 over n channels centred on c, zeros beyond the
    edges)^-beta; WITHIN_CHANNEL: x * (1 + alpha * mean of x^2 over an n x n window)^-beta (Caffe's
    AVE pooling with pad (n-1)/2, stride 1: every window divides by n*n)."""
    sq = x * x
    if within_channel:
        total = window_sum(window_sum(sq, 2, n), 3, n)
        scale = 1.0 + alpha * (total / (n * n))
    else:
        scale = k + (alpha / n) * window_sum(sq, 1, n)
    return x * scale.pow(-beta)


class CaffeLRN(nn.Module):
    """Caffe's LRN (see caffe_lrn). nn.LocalResponseNorm divides by the power instead, which
    rounds differently."""

    def __init__(self, size, alpha=1.0, beta=0.75, k=1.0, within_channel=False):
        super().__init__()
        # Caffe's parameters are float32: keep exactly those values
        self.alpha, self.beta, self.k = (float(torch.tensor(v, dtype=torch.float32, device="cpu"))
                                         for v in (alpha, beta, k))
        self.size, self.within_channel = size, within_channel

    def forward(self, x):
        return caffe_lrn(x, self.size, self.alpha, self.beta, self.k, self.within_channel)


@register_layer("LRN")
class LRN(Layer):
    def parse(self, lp):
        p = lp.lrn_param
        size = int(p.local_size)
        if size < 1 or size % 2 != 1:
            raise LayerError(f"lrn_param.local_size must be odd and >= 1 (Caffe only supports odd sizes), "
                             f"got {size}")
        region = int(p.norm_region)
        if region not in (ACROSS_CHANNELS, WITHIN_CHANNEL):
            raise LayerError(f"unknown lrn_param.norm_region {region}")
        return {"size": size, "alpha": float(p.alpha), "beta": float(p.beta), "k": float(p.k),
                "region": region}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"LRN needs a 4-axis (num, channels, height, width) input, got {list(s)}")
        return [tuple(s)]

    def forward(self, attrs, params, x):
        return caffe_lrn(x, attrs["size"], attrs["alpha"], attrs["beta"], attrs["k"],
                         attrs["region"] == WITHIN_CHANNEL)

    def macs(self, attrs, in_shapes, out_shapes):
        n = attrs["size"]
        return count(in_shapes[0]) * (n if attrs["region"] == ACROSS_CHANNELS else n * n)

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        n = a["size"]
        if a["region"] == ACROSS_CHANNELS:
            # ONNX's LRN is Caffe's for odd sizes: window [c - (n-1)/2, c + (n-1)/2], alpha / n
            ctx.add_node("LRN", [x], [out], name=node.name, size=n, alpha=a["alpha"], beta=a["beta"],
                         bias=a["k"])
            return
        pad = (n - 1) // 2
        sq = ctx.tmp(node.name + "_sq")
        ctx.add_node("Mul", [x, x], [sq], name=node.name)
        avg = ctx.tmp(node.name + "_avg")
        ctx.add_node("AveragePool", [sq], [avg], kernel_shape=[n, n], strides=[1, 1], pads=[pad] * 4,
                     count_include_pad=1)
        scaled = ctx.tmp(node.name + "_scaled")
        ctx.add_node("Mul", [avg, ctx.const(np.array(a["alpha"], np.float32))], [scaled])
        shifted = ctx.tmp(node.name + "_shifted")
        ctx.add_node("Add", [scaled, ctx.const(np.array(1.0, np.float32))], [shifted])
        powered = ctx.tmp(node.name + "_pow")
        ctx.add_node("Pow", [shifted, ctx.const(np.array(-a["beta"], np.float32))], [powered])
        ctx.add_node("Mul", [x, powered], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [str(a["size"]), f"alpha={emit.lit(a['alpha'])}", f"beta={emit.lit(a['beta'])}"]
        if a["region"] == WITHIN_CHANNEL:
            args.append("within_channel=True")
        else:
            args.append(f"k={emit.lit(a['k'])}")
        emit.helper(window_sum)
        emit.helper(caffe_lrn)
        m = emit.module(f"{emit.helper(CaffeLRN)}({', '.join(args)})")
        return f"{m}({emit.inputs[0]})"


# ---- MVN -------------------------------------------------------------------------------

def legacy_shape(shape):
    """Caffe's num/channels/height/width view of a blob with at most 4 axes."""
    return tuple(shape) + (1,) * (4 - len(shape))


def caffe_mvn(x, across_channels: bool, normalize_variance: bool, eps: float):
    """Caffe's MVN on x viewed with Caffe's 4 axes (N, C, H, W): subtract the mean over H x W (and C
    when across_channels), then divide by the standard deviation + eps (eps on the deviation, not
    the variance)."""
    if x.dim() < 4:
        x = x.reshape(list(x.shape) + [1] * (4 - x.dim()))
    dims = [1, 2, 3] if across_channels else [2, 3]
    y = x - x.mean(dim=dims, keepdim=True)
    if normalize_variance:
        std = torch.sqrt((y * y).mean(dim=dims, keepdim=True))
        y = y / (std + eps)
    return y


class CaffeMVN(nn.Module):
    """Caffe's MVN (see caffe_mvn). The output has Caffe's 4 axes whatever the input's rank."""

    def __init__(self, normalize_variance=True, across_channels=False, eps=1e-9):
        super().__init__()
        self.normalize_variance, self.across_channels, self.eps = normalize_variance, across_channels, eps

    def forward(self, x):
        return caffe_mvn(x, self.across_channels, self.normalize_variance, self.eps)


@register_layer("MVN")
class MVN(Layer):
    def parse(self, lp):
        p = lp.mvn_param
        eps = float(p.eps)
        if not eps >= 0:
            raise LayerError(f"mvn_param.eps must be >= 0, got {eps}")
        return {"normalize_variance": bool(p.normalize_variance),
                "across_channels": bool(p.across_channels), "eps": eps}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if not 1 <= len(s) <= 4:
            raise LayerError(f"MVN works on blobs of 1 to 4 axes (Caffe's num/channels/height/width), "
                             f"got {list(s)}")
        # Caffe reshapes the top to (num, channels, height, width) whatever the bottom's rank
        return [legacy_shape(s)]

    def forward(self, attrs, params, x):
        return caffe_mvn(x, attrs["across_channels"], attrs["normalize_variance"], attrs["eps"])

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        shape = ctx.shape(x)
        if len(shape) < 4:
            x4 = ctx.tmp(node.name + "_4d")
            ctx.add_node("Reshape", [x, ctx.const(np.array((0,) + legacy_shape(shape)[1:], np.int64))], [x4])
            x = x4
        axes = [1, 2, 3] if a["across_channels"] else [2, 3]
        mean = onnx_reduce(ctx, "ReduceMean", x, axes, 1)
        target = out if not a["normalize_variance"] else ctx.tmp(node.name + "_centred")
        ctx.add_node("Sub", [x, mean], [target], name=node.name)
        if not a["normalize_variance"]:
            return
        sq = ctx.tmp(node.name + "_sq")
        ctx.add_node("Mul", [target, target], [sq])
        var = onnx_reduce(ctx, "ReduceMean", sq, axes, 1)
        std = ctx.tmp(node.name + "_std")
        ctx.add_node("Sqrt", [var], [std])
        den = ctx.tmp(node.name + "_den")
        ctx.add_node("Add", [std, ctx.const(np.array(a["eps"], np.float32))], [den])
        ctx.add_node("Div", [target, den], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [f"normalize_variance={a['normalize_variance']}", f"across_channels={a['across_channels']}",
                f"eps={emit.lit(a['eps'])}"]
        emit.helper(caffe_mvn)
        m = emit.module(f"{emit.helper(CaffeMVN)}({', '.join(args)})")
        return f"{m}({emit.inputs[0]})"


def mvn_from_axis(x, axis: int, normalize_variance: bool, eps: float):
    """antran89/my-very-deep-caffe's MVN_ND: Caffe's MVN over every axis from `axis` on, per index of
    the axes before it; the top keeps the bottom's shape."""
    dims = list(range(axis, x.dim()))
    if not dims:   # nothing to reduce: each value is its own mean
        return x - x
    y = x - x.mean(dim=dims, keepdim=True)
    if normalize_variance:
        y = y / (torch.sqrt((y * y).mean(dim=dims, keepdim=True)) + eps)
    return y


@register_layer("MVN_ND")
class MVNFromAxis(MVN):
    """antran89/my-very-deep-caffe 6993636 mvn_nd_layer.cpp (two-stream-fcan's attention nets): MVN from
    mvn_param.axis [2] to the last axis (across_channels is not read), top shaped as the bottom."""

    bottoms = tops = 1

    def parse(self, lp):
        need_blobs(lp, "MVN_ND", 1, 1)
        attrs = super().parse(lp)
        attrs["axis"] = int(lp.mvn_param.axis)
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if not 0 <= attrs["axis"] <= len(s):
            raise LayerError(f"mvn_param.axis {attrs['axis']} is outside a {len(s)}-axis bottom (the fork counts "
                             f"axes from 0 and takes no negative axis)")
        return [s]

    def forward(self, attrs, params, x):
        return mvn_from_axis(x, attrs["axis"], attrs["normalize_variance"], attrs["eps"])

    def onnx(self, ctx, node):
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        axes = list(range(a["axis"], len(ctx.shape(x))))
        if not axes:
            ctx.add_node("Sub", [x, x], [out], name=node.name)
            return
        mean = onnx_reduce(ctx, "ReduceMean", x, axes, 1)
        target = out if not a["normalize_variance"] else ctx.tmp(node.name + "_centred")
        ctx.add_node("Sub", [x, mean], [target], name=node.name)
        if not a["normalize_variance"]:
            return
        var = onnx_reduce(ctx, "ReduceMean", ctx.op("Mul", [target, target], "sq"), axes, 1)
        den = ctx.op("Add", [ctx.op("Sqrt", [var], "std"), ctx.const(np.array(a["eps"], np.float32))], "den")
        ctx.add_node("Div", [target, den], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return (f"{emit.helper(mvn_from_axis)}({emit.inputs[0]}, {a['axis']}, {a['normalize_variance']}, "
                f"{emit.lit(a['eps'])})")


__all__ = ["BatchNorm", "LRN", "MVN", "onnx_reduce", "legacy_shape"]
