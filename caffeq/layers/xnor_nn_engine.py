"""mistler/xnor_nn's XNOR_NN convolution engine (9adc1e5: external/caffe/src/caffe/layer_factory.cpp,
src/caffe/layers/xnor_nn_conv_layer.cpp; the library's src/bcast_binarize_data.cpp, bcast_binarize_weights.cpp,
bcast_calculate_k.cpp and default/bcast_convolution_default.cpp, the path the layer asks for, and
src/reference_*.cpp, which the library takes where num_output is not a multiple of its filter block).

`convolution_param { engine: XNOR_NN }` makes the fork's layer factory build XnorNNConvolutionLayer, whose
Forward_cpu (the fork has no GPU forward: it builds CPU_ONLY) runs XNOR-Net's binary convolution:

    top[n, o, y, x] = alpha[o] * K[n, y, x] * sum over the window's taps inside the bottom and over c of
                      sign(bottom) * sign(w)

- sign(v): the bcast path packs the floats' sign bits, -1 where the bit is set (-0 included), else +1
  (kohuthonza_xnor.py's copysign rule, reused here); the reference path takes v >= 0 ? +1 : -1 (-0 gives +1,
  NaN -1).  bcast needs num_output to be a multiple of its filter block, vector bits / 32 at least (4 with
  SSE or NEON, 8 with AVX, 16 with AVX-512), so on those CPUs a num_output that is not a multiple of 4 takes
  the reference path: caffeq uses its rule there and the sign bit otherwise (the bcast path wherever num_output is
  a multiple of 16; a multiple of 4 or 8 depends on the CPU, and the two rules differ at -0 and NaN only).
- alpha[o] is filter o's mean |w|; K is the window mean of A = the channel mean of |bottom|, a tap in the
  padding adding 0 to a sum still divided by kernel_h * kernel_w.
- Taps in the padding add nothing to the sum of signs: a zero-padded convolution of sign(bottom).
- The bias blob (bias_term, default true) is made and kept, but the forward never adds it.

The library takes one 2-D kernel, stride and pad per axis from Caffe's parameters: no group (it reads C x kh x
kw weights per filter), no dilation (Caffe sizes the top with it, the library does not), and it counts its
output rows with pad_w (common_convolution.cpp: getOH(ih, kh, sh, pw)), writing another layout than Caffe's
top wherever that count differs.  caffeq reads and sizes those layers as Caffe does and refuses to run them.
ONNX and model.py hold alpha * sign(w) as the weights and a zero bias.
"""
import numpy as np
import torch
import torch.nn.functional as F

from .conv import Convolution, _conv_nd, _onnx_conv, _torch_conv_source, conv_out_size
from .kohuthonza_xnor import kohuthonza_alpha, kohuthonza_binarize, kohuthonza_signum, onnx_signum
from .norm import onnx_reduce
from .registry import LayerError, claim_layers
from .transformed_weights import TransformedConvolution


def _xnor_nn_engine(lp):
    p = lp.convolution_param
    return "XNOR_NN" in p.Engine.keys() and p.engine == p.XNOR_NN


def xnor_nn_factors(channels: int, kernel: tuple[int, int]):
    """The library's float32 factors: 1 / C for A, (1 / kh) / kw for K."""
    one = np.float32(1.0)
    return float(one / np.float32(channels)), float(one / np.float32(kernel[0]) / np.float32(kernel[1]))


def xnor_nn_reference_path(num_output: int) -> bool:
    """Whether the library always takes its reference path: num_output not a multiple of 4."""
    return num_output % 4 != 0


def xnor_nn_reference_sign(x):
    """The reference path's sign: x >= 0 ? 1 : -1 (-0 gives +1, NaN -1)."""
    one = x.new_ones(())
    return torch.where(x >= 0, one, -one)


def _onnx_reference_sign(ctx, x, out):
    negative = ctx.op("Or", [ctx.op("Less", [x, ctx.f32(0.0)], "below"), ctx.op("IsNaN", [x], "nan")], "negative")
    ctx.add_node("Where", [negative, ctx.f32(-1.0), ctx.f32(1.0)], out)


def xnor_nn_k(x, kernel: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int],
              channel_factor: float, window_factor: float):
    """XNOR-Net's K, (N, 1, OH, OW): each window's mean of the channel mean of |x| (padding counts as 0)."""
    a = (x.abs() * channel_factor).sum(1, keepdim=True)
    box = x.new_full((1, 1) + tuple(kernel), window_factor)
    return F.conv2d(a, box, stride=stride, padding=pad)


@claim_layers("Convolution", _xnor_nn_engine)
class XnorNNConvolution(TransformedConvolution, Convolution):
    types = ("Convolution",)

    def parse(self, lp):
        attrs = super().parse(lp)
        for key, what in (("first_conv", "Cambricon's first-conv mean_value / std / scale"),
                          ("orn", "RRD's active rotating filters")):
            if attrs.get(key):
                raise LayerError(f"convolution_param.engine XNOR_NN with {what}: mistler/xnor_nn's layer reads "
                                 f"BVLC's convolution fields only")
        attrs["name"] = lp.name
        if attrs["bias_term"]:
            attrs["reading_notes"] = attrs.get("reading_notes", []) + [
                "convolution_param.engine XNOR_NN: mistler/xnor_nn's binary convolution keeps the bias blob but "
                "never adds it"]
        return attrs

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)
        if attrs.get("edge_pads") is not None:
            raise LayerError("convolution_param.engine XNOR_NN with pad_type / pad_l/r/t/b (synopsys-caffe's "
                             "fields): mistler/xnor_nn's layer pads symmetrically only")
        return shapes

    def cannot_run(self, attrs, in_shapes):
        if attrs["_axis"] != 1 or len(attrs["kernel"]) != 2:
            return ("convolution_param.engine XNOR_NN: mistler/xnor_nn's library convolves (N, C, H, W) bottoms "
                    "over axis 1 only")
        if attrs["group"] != 1:
            return (f"convolution_param.group {attrs['group']} with engine XNOR_NN: mistler/xnor_nn's library reads "
                    f"C x kh x kw weights per filter, more than a grouped weight blob holds")
        if any(d != 1 for d in attrs["dilation"]):
            return (f"convolution_param.dilation {list(attrs['dilation'])} with engine XNOR_NN: mistler/xnor_nn's "
                    f"library ignores dilation, which Caffe's top shape uses")
        h = in_shapes[0][2]
        (kh, _), (sh, _), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["pad"]
        if conv_out_size(h, kh, sh, pw, 1) != conv_out_size(h, kh, sh, ph, 1):
            return (f"convolution_param pad_h {ph} / pad_w {pw} with engine XNOR_NN: mistler/xnor_nn's library "
                    f"counts {conv_out_size(h, kh, sh, pw, 1)} output rows with pad_w where Caffe's top has "
                    f"{conv_out_size(h, kh, sh, ph, 1)}, and writes them in another layout")
        return None

    def weight_transform(self, attrs, weight):
        if xnor_nn_reference_path(attrs["num_output"]):
            return xnor_nn_reference_sign(weight) * kohuthonza_alpha(weight).reshape((-1,) + (1,) * (weight.dim() - 1))
        return kohuthonza_binarize(weight, True)

    def _sign(self, attrs):
        return xnor_nn_reference_sign if xnor_nn_reference_path(attrs["num_output"]) else kohuthonza_signum

    def bias_transform(self, attrs, bias, weight):
        return torch.zeros_like(bias)

    def weight_transform_note(self, attrs):
        return ("an XNOR_NN Convolution (mistler/xnor_nn) exports each filter's mean |w| times sign(w) as its "
                "weights and a zero bias (the fork never adds its bias blob)")

    def _k_args(self, attrs, channels):
        return (tuple(attrs["kernel"]), tuple(attrs["stride"]), tuple(attrs["pad"]),
                *xnor_nn_factors(channels, attrs["kernel"]))

    def forward(self, attrs, params, *xs):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape) for x in xs], LayerError)
        weight = self.used_blobs(attrs, params)[0]
        ys = [_conv_nd(self._sign(attrs)(x), attrs, weight, None, False) * xnor_nn_k(x, *self._k_args(attrs, x.shape[1]))
              for x in xs]
        return ys[0] if len(ys) == 1 else tuple(ys)

    def onnx(self, ctx, node):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(x) for x in node.inputs])
        signs, convs = [], []
        for i, x in enumerate(node.inputs):
            signs.append(ctx.tmp(f"{node.name}_sign{i}"))
            if xnor_nn_reference_path(a["num_output"]):
                _onnx_reference_sign(ctx, x, signs[-1])
            else:
                onnx_signum(ctx, x, signs[-1])
            convs.append(ctx.tmp(f"{node.name}_count{i}"))
        _onnx_conv(ctx, self.transformed_node(node), "Conv", signs, convs)
        for x, conv, y in zip(node.inputs, convs, node.outputs):
            kernel, stride, pad, channel_factor, window_factor = self._k_args(a, ctx.shape(x)[1])
            shares = ctx.op("Mul", [ctx.op("Abs", [x], "abs"), ctx.f32(channel_factor)], "shares")
            mean = onnx_reduce(ctx, "ReduceSum", shares, [1], True, ctx.tmp(f"{node.name}_a"))
            k = ctx.op("Conv", [mean, ctx.f32(np.full((1, 1) + kernel, window_factor, np.float32))], "k",
                       kernel_shape=list(kernel), strides=list(stride), pads=list(pad) * 2)
            ctx.add_node("Mul", [conv, k], [y])

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(i) for i in range(len(emit.inputs))])
        return super().pytorch_source(node, emit)

    def source_layer(self, node, emit):
        sign, k = emit.helper(self._sign(node.attrs)), emit.helper(xnor_nn_k)
        emit.uses("F")
        convs = _torch_conv_source(node, emit, False, inputs=[f"{sign}({x})" for x in emit.inputs])
        convs = [convs] if isinstance(convs, str) else convs
        ys = []
        for i, (x, conv) in enumerate(zip(emit.inputs, convs)):
            args = ", ".join(emit.lit(v) for v in self._k_args(node.attrs, emit.in_shape(i)[1]))
            ys.append(f"{conv} * {k}({x}, {args})")
        return ys[0] if len(ys) == 1 else ys


__all__ = ["XnorNNConvolution", "xnor_nn_k"]
