"""loswensiana/BWN-XNOR-caffe's XNOR-Net layers (2ccf4e7, src/caffe/ex_layers: binactiv_layer.cpp / .cu,
split_concat_layer.cpp, statistics_layer.cpp).

- BinActiv (convolution_param: kernel_size, pad, stride, num_output 1, a constant weight_filler): top 0 is
  sign(x) (x >= 0 counts as +1); top 1 is XNOR-Net's K, (N, 1, H, W): the channel mean (each x / C added in
  channel order, float32), convolved with an inner Convolution whose weights come from the weight_filler
  every time the net is built (they are not the layer's blobs), times float32(1 / kernel_size^2).  Only a
  constant filler gives the same weights every time: others are refused.  The fork scales by
  kernel_size(0)^2, so kernel_h / kernel_w are refused too.
- SplitConcat (convolution_param.num_output R, concat_param.axis): R copies of the bottom concatenated
  along the axis.
- Statistic: the share of values below 1e-8, written only at iterations where a counter modulo
  slice_param.axis is 1 (the top keeps its old value otherwise): read, not run.
"""
import numpy as np
import torch
import torch.nn.functional as F

from .norm import onnx_reduce
from .registry import Layer, LayerError, ReadOnlyLayer, canonical_axis, need_blobs, register_layer


def xnor_activation(x, kernel: int, stride: int, pad: int, weight: float, bias: float):
    """BinActiv's (sign(x), K)."""
    channels = x.shape[1]
    mean = torch.zeros_like(x[:, :1])
    for c in range(channels):   # the fork's loop: sumA += x / C, channel by channel
        mean = mean + x[:, c:c + 1] / channels
    sign = torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))
    ones = torch.full((1, 1, kernel, kernel), weight, dtype=x.dtype, device=x.device)
    k = F.conv2d(mean, ones, stride=stride, padding=pad) + bias
    return sign, k * (1.0 / (kernel * kernel))


@register_layer("BinActiv")
class BinActiv(Layer):
    def parse(self, lp):
        need_blobs(lp, "BinActiv", 1, 2)
        p = lp.convolution_param
        if p.num_output != 1:
            raise LayerError(f"BinActiv's convolution_param.num_output must be 1 (its K top has one channel), "
                             f"got {p.num_output}")
        if len(p.kernel_size) != 1 or p.HasField("kernel_h") or p.HasField("kernel_w"):
            raise LayerError("BinActiv reads one convolution_param.kernel_size (it scales K by kernel_size(0)^2)")
        if len(p.pad) > 1 or len(p.stride) > 1 or p.HasField("pad_h") or p.HasField("stride_h") or p.group > 1 \
                or len(p.dilation) > 0:
            raise LayerError("BinActiv supports one pad and one stride, no group or dilation")
        fillers = [("weight_filler", p.weight_filler)] + ([("bias_filler", p.bias_filler)] if p.bias_term else [])
        for name, f in fillers:
            if f.type != "constant":
                raise LayerError(f"BinActiv's inner convolution draws its {name} ({f.type}) every time the net is "
                                 f"built (they are not saved): only a constant filler is reproducible")
        return {"kernel": int(p.kernel_size[0]), "pad": int(p.pad[0]) if len(p.pad) else 0,
                "stride": int(p.stride[0]) if len(p.stride) else 1, "weight": float(np.float32(p.weight_filler.value)),
                "bias": float(np.float32(p.bias_filler.value)) if p.bias_term else 0.0}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"BinActiv needs an (N, C, H, W) bottom, got {list(s)}")
        k, st, pd = attrs["kernel"], attrs["stride"], attrs["pad"]
        out = tuple((d + 2 * pd - k) // st + 1 for d in s[2:])
        if out != s[2:]:
            raise LayerError(f"BinActiv's inner convolution gives {list(out)} from {list(s[2:])}: the fork checks K "
                             f"keeps the bottom's height and width")
        return [s, (s[0], 1) + s[2:]]

    def _args(self, a):
        return (a["kernel"], a["stride"], a["pad"], a["weight"], a["bias"])

    def forward(self, attrs, params, x):
        return xnor_activation(x, *self._args(attrs))

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        channels = ctx.shape(x)[1]
        ctx.add_node("Where", [ctx.op("GreaterOrEqual", [x, ctx.f32(0.0)], "nonnegative", name=node.name),
                               ctx.f32(1.0), ctx.f32(-1.0)], [node.outputs[0]])
        mean = onnx_reduce(ctx, "ReduceSum", ctx.op("Div", [x, ctx.f32(float(channels))], "shares"), [1], True,
                           ctx.tmp(node.name + "_mean"))
        k = a["kernel"]
        conv = ctx.op("Conv", [mean, ctx.f32(np.full((1, 1, k, k), a["weight"], np.float32))], "window",
                      kernel_shape=[k, k], strides=[a["stride"]] * 2, pads=[a["pad"]] * 4)
        biased = ctx.op("Add", [conv, ctx.f32(a["bias"])], "biased")
        ctx.add_node("Mul", [biased, ctx.f32(1.0 / (k * k))], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        out = emit.tmp("binactiv")
        args = ", ".join(emit.lit(v) for v in self._args(node.attrs))
        emit.stmt(f"{out} = {emit.helper(xnor_activation)}({emit.inputs[0]}, {args})")
        return [f"{out}[0]", f"{out}[1]"]


@register_layer("SplitConcat")
class SplitConcat(Layer):
    def parse(self, lp):
        need_blobs(lp, "SplitConcat", 1, 1)
        copies = int(lp.convolution_param.num_output)
        if copies < 1:
            raise LayerError("SplitConcat's convolution_param.num_output (the copies) must be >= 1")
        return {"copies": copies, "axis": int(lp.concat_param.axis)}

    def infer(self, attrs, in_shapes):
        s = list(in_shapes[0])
        axis = canonical_axis(attrs["axis"], len(s), "concat_param.axis")
        s[axis] *= attrs["copies"]
        return [tuple(s)]

    def _axis(self, attrs, rank):
        return canonical_axis(attrs["axis"], rank, "concat_param.axis")

    def forward(self, attrs, params, x):
        return torch.cat([x] * attrs["copies"], self._axis(attrs, x.dim()))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        ctx.add_node("Concat", [x] * node.attrs["copies"], [node.outputs[0]], name=node.name,
                     axis=self._axis(node.attrs, len(ctx.shape(x))))

    def pytorch_source(self, node, emit):
        x = emit.inputs[0]
        return f"torch.cat([{x}] * {node.attrs['copies']}, {self._axis(node.attrs, len(emit.in_shape(0)))})"


@register_layer("Statistic")
class Statistic(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "Statistic", 1, 1)
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        return [(1, 1, 1, 1)]

    def why_not_run(self, attrs):
        return ("Statistic writes its top only at iterations where its counter modulo slice_param.axis is 1 (a "
                "monitoring layer whose value depends on how often the net ran): read, not run")
