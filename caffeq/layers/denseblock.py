"""DenseBlock: a whole DenseNet dense block in one layer (senlinuc/caffe_ocr, after Tongcheng Li's
memory-efficient DenseNet fork, github.com/Tongcheng/caffe).

Semantics are those of the fork's GPU code (`src/caffe/layers/DenseBlock_layer.cu`), the path its
users trained and ran (caffe_ocr's README lists no CPU timing for its DenseNets: the CPU code is a
naive reference "not to be used in production"):

- The stack starts as the bottom (N, C0, H, W); C0 is the bottom's channel count (caffe_ocr reads
  `bottom[0]->channels()`; `initChannel` is ignored).  Transition i (C_i = C0 + i * growthRate
  channels in) computes
      h = ReLU(BN_i(stack)),  [use_BC: h = ReLU(BN'_i(conv1x1_i(h)))],  new = conv3x3_i(h)
  and appends `new` (growthRate channels) after the stack's channels.  The top is the final stack:
  C0 + numTransition * growthRate channels, H and W unchanged.
- BN is cuDNN's spatial batch normalization with the stored statistics at TEST:
  scale * (x - mean) / sqrt(var + 1e-5) + bias (CUDNN_BN_MIN_EPSILON is 1e-5 in the cuDNN 6 and
  7 headers the fork ships).  The mean/variance blobs hold the statistics themselves: training
  updates them as stat = maf * batch + (1 - maf) * stat (maf = moving_average_fraction, 0.1), the
  variance from cuDNN's unbiased batch estimate.  The last blob (a Caffe-BN-style factor) is
  never used on the GPU; only the CPU test path divides by it.
- The convolutions are cuDNN CUDNN_CONVOLUTION (not Caffe's CROSS_CORRELATION): a true
  convolution, the 3x3 kernel rotated by 180 degrees; pad 1, stride 1, no bias, hard-coded.
  The prototxt's filter_H/filter_W, pad_h/pad_w and strides are read by the fork and ignored.
- Dropout (use_dropout) acts on each new feature map while training only (cuDNN dropout, scaled
  by 1 / (1 - dropout_amount)).

Blobs, in the order the fork's LayerSetUp creates them (T = numTransition):
  [0, T) filters (growthRate, C_i, 3, 3) [use_BC: (growthRate, 4 growthRate, 3, 3)];
  [T, 2T) BN scales, [2T, 3T) BN biases, [3T, 4T) means, [4T, 5T) variances, each (1, C_i, 1, 1);
  use_BC only: [5T, 6T) 1x1 filters (4 growthRate, C_i, 1, 1), then [6T, 10T) the bottleneck BN's
  scales, biases, means, variances (1, 4 growthRate, 1, 1);
  last: the factor, shape (1,).
The fork adds its own `param` specs and stops (CHECK "Nope") when the prototxt gives any.

ONNX: per transition Sub/Div/Mul/Add (BN), Relu, Conv (the kernel flipped), Concat.
model.py: CaffeDenseBlock, made of nn.BatchNorm2d (CaffeBatchNorm2d with exact_batchnorm) and
nn.Conv2d modules holding the flipped kernels.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .norm import CaffeBatchNorm2d, emit_exact_batchnorm
from .registry import Layer, LayerError, positive_field, register_layer

EPS = 1e-5  # CUDNN_BN_MIN_EPSILON, the epsilon every BN of the block uses


# ---- torch -----------------------------------------------------------------------------------

def dense_batchnorm(x, scale, bias, mean, var, eps: float, training: bool, momentum: float):
    """cuDNN's spatial batch normalization as DenseBlock uses it; parameters shaped (1, C, 1, 1).
    Stored statistics unless training; training normalizes by the batch's (biased) statistics and
    moves the stored ones: stat = momentum * batch + (1 - momentum) * stat, unbiased variance."""
    if training:
        batch_mean = x.mean(dim=(0, 2, 3), keepdim=True)
        batch_var = ((x - batch_mean) ** 2).mean(dim=(0, 2, 3), keepdim=True)
        m = x.numel() // x.shape[1]
        with torch.no_grad():
            mean.mul_(1 - momentum).add_(batch_mean.detach().to(mean.dtype), alpha=momentum)
            unbiased = batch_var.detach().to(var.dtype) * (m / max(m - 1, 1))
            var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        mean, var = batch_mean, batch_var
    # the op order of CaffeBatchNorm, so that model.py's exact_batchnorm modules agree bit for bit
    return (x - mean) / torch.sqrt(var + eps) * scale + bias


def dense_block(x, params: list[torch.Tensor], num_transition: int, use_bc: bool, dropout: float,
                training: bool, momentum: float):
    """The whole block over the fork's blob list (see the module docstring for its layout)."""
    t = num_transition
    for i in range(t):
        h = torch.relu(dense_batchnorm(x, params[t + i], params[2 * t + i], params[3 * t + i],
                                       params[4 * t + i], EPS, training, momentum))
        if use_bc:
            h = F.conv2d(h, params[5 * t + i])   # 1x1: convolution and correlation agree
            h = torch.relu(dense_batchnorm(h, params[6 * t + i], params[7 * t + i], params[8 * t + i],
                                           params[9 * t + i], EPS, training, momentum))
        # CUDNN_CONVOLUTION: a true convolution, i.e. correlation with the kernel rotated 180 degrees
        new = F.conv2d(h, params[i].flip([2, 3]), padding=1)
        if training and dropout > 0:
            new = F.dropout(new, dropout, training=True)
        x = torch.cat([x, new], 1)
    return x


# ---- the module model.py gets -------------------------------------------------------------------

class DenseTransition(nn.Module):
    """One transition of caffe_ocr's DenseBlock: BN, ReLU, [1x1 conv, BN, ReLU], 3x3 conv, dropout.
    `conv` holds the fork's kernel rotated by 180 degrees (the fork convolves, nn.Conv2d correlates)."""

    def __init__(self, in_channels, growth_rate, use_bc=False, dropout=0.0, momentum=0.1, eps=1e-5,
                 norm=nn.BatchNorm2d):
        super().__init__()
        self.norm = norm(in_channels, eps=eps, momentum=momentum)
        self.relu = nn.ReLU()
        width = in_channels
        bottleneck = []
        if use_bc:
            width = 4 * growth_rate
            bottleneck = [nn.Conv2d(in_channels, width, 1, bias=False), norm(width, eps=eps, momentum=momentum),
                          nn.ReLU()]
        self.bottleneck = nn.Sequential(*bottleneck)
        self.conv = nn.Conv2d(width, growth_rate, 3, padding=1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.conv(self.bottleneck(self.relu(self.norm(x)))))


class CaffeDenseBlock(nn.Module):
    """caffe_ocr's DenseBlock layer: each transition's output is appended to the channels so far."""

    def __init__(self, in_channels, num_transition, growth_rate, use_bc=False, dropout=0.0, momentum=0.1,
                 eps=1e-5, norm=nn.BatchNorm2d):
        super().__init__()
        self.transitions = nn.ModuleList(
            DenseTransition(in_channels + i * growth_rate, growth_rate, use_bc, dropout, momentum, eps, norm)
            for i in range(num_transition))

    def forward(self, x):
        for transition in self.transitions:
            x = torch.cat([x, transition(x)], 1)
        return x


# ---- the spec ----------------------------------------------------------------------------------

@register_layer("DenseBlock")
class DenseBlock(Layer):
    uses_training_flag = True

    def parse(self, lp):
        if len(lp.param):
            raise LayerError("DenseBlock takes no `param { }` entries: the fork's LayerSetUp adds its own "
                             "and stops (CHECK failed: Nope) when the prototxt gives any")
        p = lp.denseblock_param
        attrs = {"num_transition": int(p.numTransition), "growth_rate": int(p.growthRate),
                 "use_bc": bool(p.use_BC), "use_dropout": bool(p.use_dropout),
                 "dropout_amount": float(p.dropout_amount),
                 "moving_average_fraction": float(p.moving_average_fraction)}
        positive_field(attrs["num_transition"], "denseblock_param.numTransition")
        positive_field(attrs["growth_rate"], "denseblock_param.growthRate")
        if attrs["use_dropout"] and not 0 <= attrs["dropout_amount"] < 1:
            raise LayerError(f"denseblock_param.dropout_amount must be in [0, 1) with use_dropout, "
                             f"got {attrs['dropout_amount']}")
        if not 0 <= attrs["moving_average_fraction"] <= 1:
            raise LayerError(f"denseblock_param.moving_average_fraction must be in [0, 1], "
                             f"got {attrs['moving_average_fraction']}")
        attrs["dropout"] = attrs["dropout_amount"] if attrs["use_dropout"] else 0.0
        return attrs

    # -- shapes and blobs ----------------------------------------------------------------------
    @staticmethod
    def _in_channels(attrs, in_shapes):
        if len(in_shapes) != 1:
            raise LayerError(f"DenseBlock takes one bottom, got {len(in_shapes)}")
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"DenseBlock needs a 4-axis (num, channels, height, width) bottom, got {list(s)}")
        attrs["in_channels"] = int(s[1])
        return attrs["in_channels"]

    def infer(self, attrs, in_shapes):
        c = self._in_channels(attrs, in_shapes)
        n, _, h, w = in_shapes[0]
        return [(n, c + attrs["num_transition"] * attrs["growth_rate"], h, w)]

    def param_shapes(self, attrs, in_shapes):
        c0 = self._in_channels(attrs, in_shapes)
        t, g = attrs["num_transition"], attrs["growth_rate"]
        widths = [c0 + i * g for i in range(t)]
        conv_in = [4 * g] * t if attrs["use_bc"] else widths
        shapes = [(g, c, 3, 3) for c in conv_in]
        for _ in range(4):   # scales, biases, means, variances
            shapes += [(1, c, 1, 1) for c in widths]
        if attrs["use_bc"]:
            shapes += [(4 * g, c, 1, 1) for c in widths]
            shapes += [(1, 4 * g, 1, 1)] * (4 * t)
        return shapes + [(1,)]

    def blob_names_for(self, attrs):
        t = attrs["num_transition"]
        kinds = ["filter", "scale", "bias", "mean", "variance"]
        if attrs["use_bc"]:
            kinds += ["bc_filter", "bc_scale", "bc_bias", "bc_mean", "bc_variance"]
        return tuple(f"{k}{i}" for k in kinds for i in range(t)) + ("factor",)

    def buffer_blobs_for(self, attrs):
        t = attrs["num_transition"]
        stats = list(range(3 * t, 5 * t))
        if attrs["use_bc"]:
            stats += range(8 * t, 10 * t)
        return tuple(stats) + (len(self.blob_names_for(attrs)) - 1,)

    def weight_axes_for(self, attrs):
        t = attrs["num_transition"]
        axes = {i: 0 for i in range(t)}
        if attrs["use_bc"]:
            axes.update({5 * t + i: 0 for i in range(t)})
        return axes

    def init_params(self, attrs, shapes, rng):
        """Filters ~ N(0, 1/fan_in); BN scale 1, bias 0, mean 0, variance 1, factor 0 (LayerSetUp's)."""
        t = attrs["num_transition"]
        groups = 10 if attrs["use_bc"] else 5
        fill = {1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0, 6: 1.0, 7: 0.0, 8: 0.0, 9: 1.0}
        blobs = []
        for k, shape in enumerate(shapes):
            group = k // t if k < groups * t else None
            if group in (0, 5):
                blobs.append((rng.standard_normal(shape) / math.sqrt(math.prod(shape[1:]))).astype(np.float32))
            else:
                blobs.append(np.full(shape, fill.get(group, 0.0), np.float32))
        return blobs

    def macs(self, attrs, in_shapes, out_shapes):
        n, c0, h, w = in_shapes[0]
        g = attrs["growth_rate"]
        total = 0
        for i in range(attrs["num_transition"]):
            c = c0 + i * g
            total += (c * 4 * g + 4 * g * g * 9) if attrs["use_bc"] else c * g * 9
        return n * h * w * total

    # -- torch ---------------------------------------------------------------------------------
    def forward(self, attrs, params, x, training=False):
        return dense_block(x, params, attrs["num_transition"], attrs["use_bc"], attrs["dropout"], training,
                           attrs["moving_average_fraction"])

    # -- ONNX ------------------------------------------------------------------------------------
    def onnx(self, ctx, node):
        a = node.attrs
        t = a["num_transition"]
        stack = node.inputs[0]
        for i in range(t):
            tag = f"{node.name}_t{i}"
            h = _onnx_batchnorm(ctx, node, stack, [t + i, 2 * t + i, 3 * t + i, 4 * t + i], tag)
            h = ctx.add_node("Relu", [h], ctx.tmp(tag + "_relu"))
            if a["use_bc"]:
                h = ctx.add_node("Conv", [h, ctx.weight(node, 5 * t + i)], ctx.tmp(tag + "_bc_conv"),
                                 kernel_shape=[1, 1])
                h = _onnx_batchnorm(ctx, node, h, [6 * t + i, 7 * t + i, 8 * t + i, 9 * t + i], tag + "_bc")
                h = ctx.add_node("Relu", [h], ctx.tmp(tag + "_bc_relu"))
            new = ctx.add_node("Conv", [h, _onnx_flipped_kernel(ctx, node, i)], ctx.tmp(tag + "_conv"),
                               kernel_shape=[3, 3], pads=[1, 1, 1, 1])
            out = node.outputs[0] if i == t - 1 else ctx.tmp(tag + "_stack")
            stack = ctx.add_node("Concat", [stack, new], out, axis=1)

    # -- model.py --------------------------------------------------------------------------------
    def pytorch_source(self, node, emit):
        a = node.attrs
        t = a["num_transition"]
        exact = emit.exact_batchnorm
        args = [str(a["in_channels"]), str(t), str(a["growth_rate"])]
        if a["use_bc"]:
            args.append("use_bc=True")
        if a["dropout"]:
            args.append(f"dropout={emit.lit(a['dropout'])}")
        args.append(f"momentum={emit.lit(a['moving_average_fraction'])}")
        if exact:   # model.py gets these very classes
            emit_exact_batchnorm(emit)
            args.append(f"norm={emit.helper(CaffeBatchNorm2d)}")
        emit.helper(DenseTransition)
        m = emit.module(f"{emit.helper(CaffeDenseBlock)}({', '.join(args)})")

        def norm(prefix, first):
            for name, k in (("weight", 0), ("bias", 1), ("running_mean", 2), ("running_var", 3)):
                emit.param(f"{prefix}.{name}", emit.blob(first + k * t).reshape(-1), blob=first + k * t)
            emit.buffer(f"{prefix}.num_batches_tracked", np.array(0, np.int64))

        for i in range(t):
            prefix = f"transitions.{i}"
            norm(f"{prefix}.norm", t + i)
            if a["use_bc"]:
                emit.param(f"{prefix}.bottleneck.0.weight", 5 * t + i)
                norm(f"{prefix}.bottleneck.1", 6 * t + i)
            emit.param(f"{prefix}.conv.weight", np.ascontiguousarray(emit.blob(i)[:, :, ::-1, ::-1]), blob=i)
        emit.note("DenseBlock layers (caffe_ocr) are CaffeDenseBlock modules. The fork convolves with "
                  "cuDNN's CUDNN_CONVOLUTION mode, so their nn.Conv2d weights are the caffemodel's "
                  "kernels rotated by 180 degrees; BatchNorm momentum is the fork's "
                  "moving_average_fraction.")
        return f"{m}({emit.inputs[0]})"


def _onnx_batchnorm(ctx, node, x, blobs, tag):
    """scale * (x - mean) / sqrt(var + eps) + bias with the (1, C, 1, 1) blobs broadcast, in
    dense_batchnorm's order; sqrt(var + eps) is a constant subgraph onnxruntime folds."""
    scale, bias, mean, var = (ctx.weight(node, k) for k in blobs)
    var_eps = ctx.add_node("Add", [var, ctx.const(np.array(EPS, np.float32))], ctx.tmp(tag + "_var_eps"))
    std = ctx.add_node("Sqrt", [var_eps], ctx.tmp(tag + "_std"))
    centred = ctx.add_node("Sub", [x, mean], ctx.tmp(tag + "_centred"))
    normed = ctx.add_node("Div", [centred, std], ctx.tmp(tag + "_normed"))
    scaled = ctx.add_node("Mul", [normed, scale], ctx.tmp(tag + "_scaled"))
    return ctx.add_node("Add", [scaled, bias], ctx.tmp(tag + "_bn"))


def _onnx_flipped_kernel(ctx, node, index):
    """The 3x3 kernel rotated by 180 degrees: a flipped initializer, or a reversing Slice over a
    quantized weight's dequantized form."""
    if not (node.quant and index in node.quant) and not node.shared_from.get(index):
        w = np.asarray(node.blobs[index], np.float32)[:, :, ::-1, ::-1]
        return ctx.const(np.ascontiguousarray(w), f"{node.name}.filter{index}_rotated")
    end = np.iinfo(np.int64).min
    return ctx.add_node("Slice", [ctx.weight(node, index), ctx.const(np.array([-1, -1], np.int64)),
                                  ctx.const(np.array([end, end], np.int64)), ctx.const(np.array([2, 3], np.int64)),
                                  ctx.const(np.array([-1, -1], np.int64))],
                        ctx.tmp(f"{node.name}_filter{index}_rotated"))


__all__ = ["CaffeDenseBlock", "DenseBlock", "DenseTransition", "dense_batchnorm", "dense_block"]
