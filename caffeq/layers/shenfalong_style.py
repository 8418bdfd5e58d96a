"""shenfalong/styletransfer's own Caffe rewrite (cebf7e2; src/caffe/proto/caffe.proto, src/caffe/layers/), the
layers its style-transfer nets (python/prototxt/16|32/{hidden,param,predict}.prototxt) use that caffeq lacks.
Each is the fork's GPU forward (it has no CPU one), as its pycaffe runs it at test:

- CuDNNConvolution / CuDNNDeConvolution (operator/cudnn_conv_layer.cpp, cudnn_deconv_layer.*, conv_layer.cpp,
  deconv_layer.cpp): cuDNN cross-correlation (its transpose for DeConvolution) with a square kernel_size, pad,
  stride, group and filter_stride (the dilation); bias_term defaults to false in the fork's proto (applied by the
  reader to nets in the fork's dialect: input_blob or bottom_flow / top_flow).  Weights
  (O, C/group, k, k) (DeConvolution: (C, O/group, k, k)); the bias blob is (O, 1, 1, 1), read as (O,).
- InstanceCuDNNBatchNorm (operator/instance_cudnn_batch_norm_layer.*): cudnnBatchNormalizationForwardTraining on
  each item alone, at test too: per item and channel y = scale * (x - mean) / sqrt(var + 1e-5) + bias, mean and
  the biased var over H x W, eps CUDNN_BN_MIN_EPSILON (1e-5 in the cuDNN 7 headers the fork builds with).
  Blobs scale, bias, running mean, running var, each (1, C, 1, 1); the running ones are only written.
- MeanVariance (operator/mean_variance_layer.*): top (N, 2C, 1, 1): the channel means over H x W, then
  sqrt(E[x^2] - mean^2 + 1e-5) (BN_EPS), computed from the two means as the fork does.
- PadImage (func/pad_image_layer.*): pads H and W by convolution_param.pad on each side, mirroring with the
  edge row repeated (index -1 reads 0, -2 reads 1: numpy's "symmetric"); the fork reads past the image for a
  pad larger than it, which caffeq refuses.
- ScaleBias (activation/scale_bias_layer.cu, its `if (true)` branch): x * 127.5 + 127.5 minus the BGR mean
  104.008 / 116.669 / 122.675 (channel 0, 1, every other one), the last step in double as the fork's literals.
- DeConcat (func/de_concat_layer.*): splits the channels into tops of concat_param.channels each (their sum must
  be the bottom's channels).
- Normalize with `norm_param { scale_value }` (operator/normalize_layer.cpp, .cu): at each item and position,
  x / sqrt(sum over channels of x^2 + 1e-5) (BN_EPS in the .cu; scale_value and eps are not read by the forward,
  and the scale blob's setup is under #if 0: no blobs).  Blobs of 2 to 4 axes, through num/channels/height/width
  (1 axis: channels 1).  SSD's Normalize spec (ssd/permute_normalize.py) hands such a layer to STYLE_NORMALIZE.
The reader (io/prototxt.py) takes the fork's input_blob, its string `pool`, and ignores bottom_flow / top_flow.
"""
import numpy as np
import torch

from .conv import Convolution, Deconvolution
from .norm import onnx_reduce
from .registry import AT_LEAST, Layer, LayerError, count, legacy_nchw, need_blobs, register_layer

BN_EPS = 1e-5          # CUDNN_BN_MIN_EPSILON (instance_cudnn_batch_norm_layer.cu)
MEAN_VAR_EPS = 1e-5    # BN_EPS in mean_variance_layer.cu
NORMALIZE_EPS = 1e-5   # BN_EPS in normalize_layer.cu
BGR_MEAN = (104.008, 116.669, 122.675)


def _fork_conv_attrs(attrs, lp, kind):
    p = lp.convolution_param
    for field in ("kernel_h", "kernel_w", "pad_h", "pad_w", "stride_h", "stride_w"):
        if p.HasField(field):
            raise LayerError(f"convolution_param.{field}: {kind} takes one kernel_size, pad and stride")
    if len(p.kernel_size) != 1:
        raise LayerError(f"convolution_param.kernel_size: {kind} takes one value, got {len(p.kernel_size)}")
    # the fork's bias_term [default = false] is applied by the reader in the fork's dialect (input_blob / flows):
    # strawberryfg's CuDNNConvolution nets, on BVLC's caffe.proto, keep BVLC's default (a bias)
    return attrs


def _bias_as_vector(attrs, arrays, notes):
    """The fork's bias blob (O, 1, 1, 1) as (O,)."""
    if attrs["bias_term"] and len(arrays) == 2 and arrays[1].ndim == 4 and arrays[1].shape[1:] == (1, 1, 1):
        return [arrays[0], arrays[1].reshape(-1)]
    return arrays


@register_layer("CuDNNConvolution")
class StyleCuDNNConvolution(Convolution):
    def parse(self, lp):
        need_blobs(lp, "CuDNNConvolution", 1, 1)
        return _fork_conv_attrs(super().parse(lp), lp, "CuDNNConvolution")

    def stored_blobs(self, attrs, arrays, notes):
        return _bias_as_vector(attrs, arrays, notes)


@register_layer("CuDNNDeConvolution")
class StyleCuDNNDeConvolution(Deconvolution):
    def parse(self, lp):
        need_blobs(lp, "CuDNNDeConvolution", 1, 1)
        return _fork_conv_attrs(super().parse(lp), lp, "CuDNNDeConvolution")

    def stored_blobs(self, attrs, arrays, notes):
        return _bias_as_vector(attrs, arrays, notes)


def style_instance_norm(x, scale, bias, eps: float):
    """Per item and channel: scale * (x - mean) / sqrt(biased var + eps) + bias, over the spatial positions."""
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    centred = flat - flat.mean(dim=2, keepdim=True)
    var = (centred * centred).mean(dim=2, keepdim=True)
    normed = centred / torch.sqrt(var + eps)
    return (normed * scale.reshape(1, -1, 1) + bias.reshape(1, -1, 1)).reshape(x.shape)


class StyleInstanceNorm(torch.nn.Module):
    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        return style_instance_norm(x, self.scale, self.bias, self.eps)


@register_layer("InstanceCuDNNBatchNorm")
class InstanceCuDNNBatchNorm(Layer):
    blob_names = ("scale", "bias", "mean", "variance")
    buffer_blobs = (2, 3)
    bottoms = tops = 1

    def parse(self, lp):
        attrs = super().parse(lp)
        if len(lp.param) not in (0, 2):   # LOG(FATAL) "wrong lr_mult setting"
            raise LayerError(f"InstanceCuDNNBatchNorm takes 0 or 2 param specs, got {len(lp.param)}")
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"InstanceCuDNNBatchNorm needs a 4-D (N, C, H, W) bottom, got {list(s)}")
        return [s]

    def param_shapes(self, attrs, in_shapes):
        return [(1, in_shapes[0][1], 1, 1)] * 4

    def init_params(self, attrs, shapes, rng):
        c = shapes[0][1]
        return [rng.uniform(0.5, 1.5, (1, c, 1, 1)).astype(np.float32),
                rng.uniform(-0.5, 0.5, (1, c, 1, 1)).astype(np.float32),
                np.zeros((1, c, 1, 1), np.float32), np.ones((1, c, 1, 1), np.float32)]

    def macs(self, attrs, in_shapes, out_shapes):
        return 4 * count(in_shapes[0])

    def forward(self, attrs, params, x):
        return style_instance_norm(x, params[0], params[1], BN_EPS)

    def onnx(self, ctx, node):
        c = ctx.shape(node.inputs[0])[1]
        scale = ctx.const(np.asarray(node.blobs[0], np.float32).reshape(c))
        bias = ctx.const(np.asarray(node.blobs[1], np.float32).reshape(c))
        ctx.add_node("InstanceNormalization", [node.inputs[0], scale, bias], [node.outputs[0]], name=node.name,
                     epsilon=BN_EPS)

    def pytorch_source(self, node, emit):
        c = emit.in_shape(0)[1]
        m = emit.instance(StyleInstanceNorm, c, BN_EPS, needs=(style_instance_norm,))
        emit.param("scale", emit.blob(0).reshape(c), blob=0)
        emit.param("bias", emit.blob(1).reshape(c), blob=1)
        return f"{m}({emit.inputs[0]})"


def style_mean_variance(x, eps: float):
    """(N, 2C, 1, 1): the channel means, then sqrt(mean of squares - mean^2 + eps)."""
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    mean = flat.mean(dim=2)
    square = (flat * flat).mean(dim=2)
    std = torch.sqrt(square - mean * mean + eps)
    return torch.cat([mean, std], dim=1).reshape(x.shape[0], 2 * x.shape[1], 1, 1)


@register_layer("MeanVariance")
class MeanVariance(Layer):
    bottoms = tops = 1

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"MeanVariance needs a 4-D (N, C, H, W) bottom, got {list(s)}")
        return [(s[0], 2 * s[1], 1, 1)]

    def macs(self, attrs, in_shapes, out_shapes):
        return 2 * count(in_shapes[0])

    def forward(self, attrs, params, x):
        return style_mean_variance(x, MEAN_VAR_EPS)

    def onnx(self, ctx, node):
        name, x = node.name, node.inputs[0]
        mean = onnx_reduce(ctx, "ReduceMean", x, [2, 3], True, ctx.tmp(name + "_mean"))
        sq = ctx.add_node("Mul", [x, x], [ctx.tmp(name + "_sq")])[0]
        msq = onnx_reduce(ctx, "ReduceMean", sq, [2, 3], True, ctx.tmp(name + "_msq"))
        m2 = ctx.add_node("Mul", [mean, mean], [ctx.tmp(name + "_m2")])[0]
        var = ctx.add_node("Sub", [msq, m2], [ctx.tmp(name + "_var")])[0]
        var = ctx.add_node("Add", [var, ctx.const(np.array(MEAN_VAR_EPS, np.float32))], [ctx.tmp(name + "_vareps")])[0]
        std = ctx.add_node("Sqrt", [var], [ctx.tmp(name + "_std")])[0]
        ctx.add_node("Concat", [mean, std], [node.outputs[0]], name=name, axis=1)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(style_mean_variance)}({emit.inputs[0]}, {emit.lit(MEAN_VAR_EPS)})"


def symmetric_index(size: int, pad: int):
    """Source rows of a mirror pad that repeats the edge: -1 reads 0, size reads size - 1."""
    j = torch.arange(-pad, size + pad)
    return torch.where(j < 0, -1 - j, torch.where(j >= size, 2 * size - 1 - j, j))


def pad_image(x, pad: int):
    """PadImage: x mirrored by pad rows and columns on each side, the edge repeated."""
    rows = symmetric_index(x.shape[2], pad).to(x.device)
    cols = symmetric_index(x.shape[3], pad).to(x.device)
    return x.index_select(2, rows).index_select(3, cols)


@register_layer("PadImage")
class PadImage(Layer):
    bottoms = tops = 1

    def parse(self, lp):
        attrs = super().parse(lp)
        pads = list(lp.convolution_param.pad)
        if len(pads) > 1:
            raise LayerError(f"convolution_param.pad: PadImage takes one value, got {len(pads)}")
        return dict(attrs, pad=int(pads[0]) if pads else 0)

    def infer(self, attrs, in_shapes):
        s, p = tuple(in_shapes[0]), attrs["pad"]
        if len(s) != 4:
            raise LayerError(f"PadImage needs a 4-D (N, C, H, W) bottom, got {list(s)}")
        if p > s[2] or p > s[3]:
            raise LayerError(f"convolution_param.pad {p} is larger than the {s[2]}x{s[3]} image: the fork's "
                             f"mirror would read outside it")
        return [(s[0], s[1], s[2] + 2 * p, s[3] + 2 * p)]

    def forward(self, attrs, params, x):
        return pad_image(x, attrs["pad"])

    def onnx(self, ctx, node):
        _, _, h, w = ctx.shape(node.inputs[0])
        p = node.attrs["pad"]
        rows = ctx.const(symmetric_index(h, p).numpy().astype(np.int64))
        cols = ctx.const(symmetric_index(w, p).numpy().astype(np.int64))
        t = ctx.add_node("Gather", [node.inputs[0], rows], [ctx.tmp(node.name + "_rows")], axis=2)[0]
        ctx.add_node("Gather", [t, cols], [node.outputs[0]], name=node.name, axis=3)

    def pytorch_source(self, node, emit):
        emit.helper(symmetric_index)
        return f"{emit.helper(pad_image)}({emit.inputs[0]}, {node.attrs['pad']})"


def style_scale_bias(x, mean: list[float]):
    """x * 127.5 + 127.5 in float32, minus each channel's mean in double (channel 0, 1, then every other)."""
    y = x * 127.5 + 127.5
    means = torch.tensor([mean[min(c, 2)] for c in range(x.shape[1])], dtype=torch.float64, device=x.device)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    return (y.double() - means.reshape(shape)).to(x.dtype)


@register_layer("ScaleBias")
class ScaleBias(Layer):
    bottoms = tops = 1

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2:
            raise LayerError(f"ScaleBias needs a bottom with channels, got {list(s)}")
        return [s]

    def forward(self, attrs, params, x):
        return style_scale_bias(x, list(BGR_MEAN))

    def onnx(self, ctx, node):
        shape = ctx.shape(node.inputs[0])
        c = shape[1]
        half = ctx.const(np.array(127.5, np.float32))
        t = ctx.add_node("Mul", [node.inputs[0], half], [ctx.tmp(node.name + "_scaled")])[0]
        t = ctx.add_node("Add", [t, half], [ctx.tmp(node.name + "_shifted")])[0]
        # the kernel's `in[i] - 104.008`: a double subtraction, rounded once to float
        means = np.array([BGR_MEAN[min(k, 2)] for k in range(c)], np.float64).reshape([1, c] + [1] * (len(shape) - 2))
        t = ctx.add_node("Cast", [t], [ctx.tmp(node.name + "_double")], to=11)[0]
        t = ctx.add_node("Sub", [t, ctx.const(means)], [ctx.tmp(node.name + "_centred")])[0]
        ctx.add_node("Cast", [t], [node.outputs[0]], name=node.name, to=1)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(style_scale_bias)}({emit.inputs[0]}, {emit.lit(list(BGR_MEAN))})"


@register_layer("DeConcat")
class DeConcat(Layer):
    bottoms = 1

    def parse(self, lp):
        need_blobs(lp, "DeConcat", 1, range(1, AT_LEAST))
        channels = [int(c) for c in lp.concat_param.channels]
        if len(channels) != len(lp.top):
            raise LayerError(f"concat_param.channels gives {len(channels)} counts for {len(lp.top)} tops")
        if any(c < 1 for c in channels):
            raise LayerError(f"concat_param.channels must be positive, got {channels}")
        return {"channels": channels}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"DeConcat needs a 4-D (N, C, H, W) bottom, got {list(s)}")
        if sum(attrs["channels"]) != s[1]:
            raise LayerError(f"concat_param.channels sum to {sum(attrs['channels'])}, the bottom has {s[1]} channels")
        return [(s[0], c, s[2], s[3]) for c in attrs["channels"]]

    def forward(self, attrs, params, x):
        parts = torch.split(x, attrs["channels"], dim=1)
        return parts[0] if len(parts) == 1 else tuple(parts)

    def onnx(self, ctx, node):
        ctx.add_node("Split", [node.inputs[0], ctx.i64(node.attrs["channels"])], list(node.outputs), name=node.name,
                     axis=1)

    def pytorch_source(self, node, emit):
        parts = [f"torch.split({emit.inputs[0]}, {node.attrs['channels']}, dim=1)[{i}]"
                 for i in range(len(node.attrs["channels"]))]
        return parts[0] if len(parts) == 1 else parts



# ---- Normalize (norm_param.scale_value) --------------------------------------------------------------

def style_normalize(x, eps: float):
    """Each item and position divided by sqrt(its sum of squares over the channels + eps); channels 1 for 1 axis."""
    grid = x.reshape(x.shape[0], x.shape[1] if x.dim() > 1 else 1, -1)
    norm = torch.sqrt((grid * grid).sum(dim=1, keepdim=True) + eps)
    return (grid / norm).reshape(x.shape)


class StyleNormalize(Layer):
    """The fork's Normalize: SSD's Normalize spec delegates a layer whose norm_param sets scale_value here."""

    def parse(self, lp):
        need_blobs(lp, "Normalize (shenfalong/styletransfer)", 1, 1)
        p = lp.norm_param
        ssd = [f for f in ("across_spatial", "channel_shared", "scale_filler") if p.HasField(f)]
        if ssd:
            raise LayerError(f"norm_param sets scale_value (shenfalong/styletransfer's Normalize) and SSD's "
                             f"{', '.join(ssd)}; keep one fork's fields")
        notes = [f"Normalize norm_param.scale_value {p.scale_value:g}: read as shenfalong/styletransfer's Normalize, "
                 f"whose forward does not read it (no scale blob; x / sqrt(sum over channels of x^2 + 1e-5))"]
        if p.HasField("eps"):
            notes.append(f"Normalize norm_param.eps {p.eps:g}: unused by shenfalong/styletransfer's forward "
                         f"(it adds 1e-5)")
        return {"fork": "shenfalong", "reading_notes": notes}

    def blob_names_for(self, attrs):
        return ()

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        legacy_nchw(s, "Normalize (shenfalong/styletransfer)")
        if not s:
            raise LayerError("Normalize (shenfalong/styletransfer) needs a bottom with at least 1 axis, got []")
        return [s]

    def param_shapes(self, attrs, in_shapes):
        return None

    def macs(self, attrs, in_shapes, out_shapes):
        return 2 * count(in_shapes[0])

    def forward(self, attrs, params, x):
        return style_normalize(x, NORMALIZE_EPS)

    def onnx(self, ctx, node):
        name, x = node.name, node.inputs[0]
        shape = list(ctx.shape(x))
        grid_shape = [shape[0], shape[1] if len(shape) > 1 else 1, -1]
        grid = ctx.add_node("Reshape", [x, ctx.const(np.array(grid_shape, np.int64))], [ctx.tmp(name + "_grid")])[0]
        sq = ctx.add_node("Mul", [grid, grid], [ctx.tmp(name + "_sq")])[0]
        ss = onnx_reduce(ctx, "ReduceSum", sq, [1], True, ctx.tmp(name + "_ss"))
        sse = ctx.add_node("Add", [ss, ctx.const(np.array(NORMALIZE_EPS, np.float32))], [ctx.tmp(name + "_sse")])[0]
        norm = ctx.add_node("Sqrt", [sse], [ctx.tmp(name + "_norm")])[0]
        unit = ctx.add_node("Div", [grid, norm], [ctx.tmp(name + "_unit")])[0]
        ctx.add_node("Reshape", [unit, ctx.const(np.array(shape, np.int64))], [node.outputs[0]], name=name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(style_normalize)}({emit.inputs[0]}, {emit.lit(NORMALIZE_EPS)})"


STYLE_NORMALIZE = StyleNormalize()
