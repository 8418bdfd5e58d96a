"""Kernel-attention convolutions: StarStyleSky/caffe's AttentionConvolution and CrossConvolution (25d56c5,
src/caffe/layers/{attention_conv,cross_conv}_layer.{cpp,cu}, include/caffe/layers/{attention_conv,
cross_conv}_layer.hpp) and jialinwu17/segawareatt's AttentionConvolution, DynamicSampleConvolution and its
Python kernel_all_bias_layer.KernelBiasLayer (e4ef958, caffe/src/caffe/layers/{attention_conv,
dynamic_sample_conv}_layer.{cpp,cu}, caffe/python/kernel_all_bias_layer.py; object_kernel_convolution_param
in caffe/src/caffe/proto/caffe.proto).  aharley/segaware (dc45b8a) has none of these.

AttentionConvolution: the two forks' attention_conv_layer files are identical, so one spec.  Bottoms x
(N, C, H, W) and the attention a; blobs weight (O, C / group, kh, kw) and, with bias_term, bias (O); top
(N, O, H', W') with Convolution's output size.  For each image n, x's im2col columns (C kh kw, H' W') are
multiplied element by element by a's values n K H W ... n K H W + K H' W' - 1 (K = C / group x kh x kw, a
read flat, whatever its shape), and the weight (O, K) times the first K rows gives the top, plus the bias.  With group > 1 only the
first C / group channels take part, and every output reads them (the fork's gemm ignores group).  The fork
multiplies K x H x W attention values into the K x H' x W' columns: caffeq needs H' W' = H W.  GPU forward
(Forward_gpu); the CPU forward skips im2col for a 1x1, stride 1, pad 0 kernel and then reads a column buffer
never written: caffeq computes the GPU's columns there too.

CrossConvolution: GPU only (its Forward_cpu is NOT_IMPLEMENTED).  Bottoms x (N, C, H, W) and per-image
filters f; each image n is convolved (convolution_param's kernel, stride, pad, dilation, group) with the
first O x C / group x kh x kw values of f's image n, read as (O, C / group, kh, kw); no bias.  The blobs
that BaseConvolutionLayer makes (weight (O, C / group, kh, kw), bias (O)) are kept but never read.

DynamicSampleConvolution: GPU only.  Bottoms x (N, C, H, W), across (per image H x W x O x C values) and
within (per image H x W x O x k x k values), both read flat from each image's start; top (N, H, W, s s O)
(object_kernel_convolution_param num_output O, kernel_size k, dilation d, samples s, kernel_stride t; pad
and stride are not read).  For output pixel (h, w), sample (u, v) and output o:
  sum over c, i, j of (within[h, w, o, i, j] + (i, j at the kernel's centre (k-1)/2 ? across[h, w, o, c] : 0))
  x x[c, h + (u - s/2) t + d (i - k/2), w + (v - s/2) t + d (j - k/2)], 0 off the map.
The kernel indexes with H and W while the top is sized H + 2 ((k-1)/2) - d (k-1) rows (and columns): caffeq
needs both equal (an odd kernel with dilation 1, or a 1x1 kernel).

Python:kernel_all_bias_layer.KernelBiasLayer: top = bottom + div (param_str 'div', default 1.0), float32,
4-D bottoms.  The fork reshapes the top to the bottom's first four axes: another rank fails there, except in
place on a 5-D blob (the res_att nets' across weights), where the blob is cut to its first four axes and only
their values get div; caffeq refuses any bottom but 4-D.  StarStyleSky's nets name the same module and class
but the fork does not publish it: segawareatt's copy is the one read (the only published module of that name;
a8039974/py-R-FCN-1's kernel_bias_layer.KernelBiasLayer, another module, writes a fixed centre-tap matrix).
"""
import torch
import torch.nn.functional as F

from .conv import conv_out_size
from .param_str import parse_param_str
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer, spatial_params

STAR = "StarStyleSky/caffe 25d56c5"
SEGAWAREATT = "jialinwu17/segawareatt e4ef958"


def conv_geometry(p):
    """kernel, stride, pad, dilation ([h, w] each) of a convolution_param, as BaseConvolutionLayer reads them."""
    return (list(spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False)),
            list(spatial_params(p, 2, "stride", 1, min_value=1, pair_required=False)),
            list(spatial_params(p, 2, "pad", 0, min_value=0, pair_required=False)),
            list(spatial_params(p, 2, "dilation", 1, allow_hw=False, min_value=1)))


def nchw(shape, what, role):
    if len(shape) != 4:
        raise LayerError(f"{what} runs on 2-D maps: its {role} must be (N, C, H, W), got {list(shape)}")
    return tuple(int(d) for d in shape)


def flat_per_image(t, n: int, size: int):
    """t's first `size` values of each of its first n images, read flat from each image's start: (n, size)."""
    return t.reshape(t.shape[0], -1)[:n, :size]


def attention_conv(x, att, weight, bias, kernel: list[int], stride: list[int], pad: list[int],
                   dilation: list[int], out_hw: list[int]):
    """AttentionConvolution: x's im2col columns times the attention, then the weights (O, K)."""
    n = x.shape[0]
    o, cg = weight.shape[0], weight.shape[1]
    k = cg * kernel[0] * kernel[1]
    cols = F.unfold(x[:, :cg], kernel, dilation=dilation, padding=pad, stride=stride)      # (N, K, H'W')
    cols = cols * att.reshape(-1)[:n * k * cols.shape[2]].reshape(n, k, cols.shape[2])   # read flat
    y = torch.matmul(weight.reshape(o, k), cols)
    if bias is not None:
        y = y + bias.reshape(1, o, 1)
    return y.reshape(n, o, out_hw[0], out_hw[1])


def cross_conv(x, filters, out_channels: int, kernel: list[int], stride: list[int], pad: list[int],
               dilation: list[int], group: int):
    """CrossConvolution: image n convolved with its own filters (no bias)."""
    n, c, h, w = x.shape
    size = out_channels * (c // group) * kernel[0] * kernel[1]
    wt = flat_per_image(filters, n, size).reshape(n * out_channels, c // group, kernel[0], kernel[1])
    y = F.conv2d(x.reshape(1, n * c, h, w), wt, None, stride, pad, dilation, n * group)
    return y.reshape(n, out_channels, y.shape[2], y.shape[3])


def shifted(x, dy: int, dx: int):
    """x (N, C, H, W) read at (h + dy, w + dx), 0 off the map."""
    h, w = x.shape[2], x.shape[3]
    p = max(abs(dy), abs(dx))
    xp = F.pad(x, (p, p, p, p))
    return xp[:, :, p + dy:p + dy + h, p + dx:p + dx + w]


def sample_offsets(samples: int, kernel_stride: int, kernel: int, dilation: int):
    """[(sample index, its offset)] and [(tap index, its offset)] along one axis."""
    return ([(u, (u - samples // 2) * kernel_stride) for u in range(samples)],
            [(i, dilation * (i - kernel // 2)) for i in range(kernel)])


def dynamic_sample_conv(x, across, within, out_channels: int, kernel: int, dilation: int, samples: int,
                        kernel_stride: int):
    """DynamicSampleConvolution: (N, H, W, samples x samples x O)."""
    n, c, h, w = x.shape
    o, kk = out_channels, kernel * kernel
    a = flat_per_image(across, n, h * w * o * c).reshape(n, h, w, o, c)
    b = flat_per_image(within, n, h * w * o * kk).reshape(n, h, w, o, kk)
    centre = (kernel - 1) // 2
    total = x.sum(1, keepdim=True)                        # the within weights are the same for every channel
    sample, tap = sample_offsets(samples, kernel_stride, kernel, dilation)
    outs = []
    for _, sy in sample:
        for _, sx in sample:
            taps = torch.cat([shifted(total, sy + ty, sx + tx) for _, ty in tap for _, tx in tap], 1)
            mid = shifted(x, sy + dilation * (centre - kernel // 2), sx + dilation * (centre - kernel // 2))
            outs.append(torch.einsum("nhwot,nthw->nhwo", b, taps) + torch.einsum("nhwoc,nchw->nhwo", a, mid))
    return torch.stack(outs, 3).reshape(n, h, w, samples * samples * o)


def onnx_shifted(ctx, x, h, w, dy, dx, hint):
    p = max(abs(dy), abs(dx))
    xp = ctx.op("Pad", [x, ctx.i64([0, 0, p, p, 0, 0, p, p])], f"{hint}_pad") if p else x
    return ctx.op("Slice", [xp, ctx.i64([p + dy, p + dx]), ctx.i64([p + dy + h, p + dx + w]), ctx.i64([2, 3])], hint)


def onnx_flat_per_image(ctx, t, n, size, shape, hint):
    flat = ctx.op("Reshape", [t, ctx.i64([ctx.shape(t)[0], -1])], f"{hint}_flat")
    part = ctx.op("Slice", [flat, ctx.i64([0, 0]), ctx.i64([n, size]), ctx.i64([0, 1])], f"{hint}_part")
    return ctx.op("Reshape", [part, ctx.i64(list(shape))], hint)


def _filters_fit(shape, n, size, what, role):
    if shape[0] < n or int(torch.tensor(shape[1:]).prod()) < size:
        raise LayerError(f"{what}'s {role} bottom {list(shape)} must hold at least {size} values per image for "
                         f"each of the {n} images (the fork reads each image's first {size} values)")


def read_two_bottom_conv(lp, kind):
    """convolution_param of AttentionConvolution / CrossConvolution (both channels on axis 1): output count,
    group, bias_term and the window."""
    p = lp.convolution_param
    if p.axis != 1:
        raise LayerError(f"{kind} runs with channels on axis 1, got convolution_param.axis {p.axis}")
    kernel, stride, pad, dilation = conv_geometry(p)
    return {"num_output": positive_field(p.num_output, "convolution_param.num_output"),
            "group": positive_field(p.group, "convolution_param.group"), "bias_term": bool(p.bias_term),
            "kernel": kernel, "stride": stride, "pad": pad, "dilation": dilation}


@register_layer("AttentionConvolution")
class AttentionConvolution(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: 0}
    reading_note = (f"AttentionConvolution ({STAR}, {SEGAWAREATT}): the GPU forward; the fork's CPU forward "
                    "reads an unwritten column buffer for a 1x1, stride 1, pad 0 kernel")

    def parse(self, lp):
        need_blobs(lp, "AttentionConvolution", 2, 1, roles="data, attention", in_place=False)
        return read_two_bottom_conv(lp, "AttentionConvolution")

    def infer(self, attrs, in_shapes):
        n, c, h, w = nchw(in_shapes[0], "AttentionConvolution", "data")
        if c // attrs["group"] < 1:
            raise LayerError(f"AttentionConvolution: convolution_param.group {attrs['group']} exceeds the {c} channels")
        out = [conv_out_size((h, w)[a], attrs["kernel"][a], attrs["stride"][a], attrs["pad"][a],
                             attrs["dilation"][a]) for a in range(2)]
        if min(out) < 1 or out[0] * out[1] != h * w:
            raise LayerError(f"AttentionConvolution needs an output of as many pixels as its {h}x{w} input (the "
                             f"fork multiplies K x H x W attention values into its K x H' x W' columns), got "
                             f"{out[0]}x{out[1]}")
        k = c // attrs["group"] * attrs["kernel"][0] * attrs["kernel"][1]
        a = in_shapes[1]
        if int(torch.tensor(a).prod()) < n * k * h * w:
            raise LayerError(f"AttentionConvolution's attention bottom {list(a)} must hold {n} x {k} x {h} x {w} "
                             "values (C / group x kh x kw per pixel, per image)")
        attrs["_out"] = out
        return [(n, attrs["num_output"], out[0], out[1])]

    def param_shapes(self, attrs, in_shapes):
        c = in_shapes[0][1]
        weight = (attrs["num_output"], c // attrs["group"], *attrs["kernel"])
        return [weight, (attrs["num_output"],)] if attrs["bias_term"] else [weight]

    def _args(self, a):
        return a["kernel"], a["stride"], a["pad"], a["dilation"], a["_out"]

    def forward(self, attrs, params, x, att):
        return attention_conv(x, att, params[0], params[1] if attrs["bias_term"] else None, *self._args(attrs))

    def onnx(self, ctx, node):
        a = node.attrs
        x, att = node.inputs
        n, _, h, w = ctx.shape(x)
        o, cg, (kh, kw) = a["num_output"], ctx.shape(x)[1] // a["group"], a["kernel"]
        (sh, sw), (ph, pw), (dh, dw), (oh, ow) = a["stride"], a["pad"], a["dilation"], a["_out"]
        k = cg * kh * kw
        first = ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([cg]), ctx.i64([1])], "channels", name=node.name)
        xp = ctx.op("Pad", [first, ctx.i64([0, 0, ph, pw, 0, 0, ph, pw])], "padded")
        views = [ctx.op("Unsqueeze", [ctx.op("Slice", [xp, ctx.i64([i * dh, j * dw]),
                                                       ctx.i64([i * dh + sh * (oh - 1) + 1, j * dw + sw * (ow - 1) + 1]),
                                                       ctx.i64([2, 3]), ctx.i64([sh, sw])], f"win{i}_{j}"),
                                      ctx.i64([2])], f"tap{i}_{j}")
                 for i in range(kh) for j in range(kw)]
        cols = views[0] if len(views) == 1 else ctx.op("Concat", views, "taps", axis=2)
        cols = ctx.op("Reshape", [cols, ctx.i64([n, k, oh, ow])], "cols")
        flat = ctx.op("Reshape", [att, ctx.i64([-1])], "attention_flat")
        part = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([n * k * oh * ow]), ctx.i64([0])], "attention_part")
        weights = ctx.op("Reshape", [part, ctx.i64([n, k, oh, ow])], "attention")
        cols = ctx.op("Mul", [cols, weights], "attended")
        wt = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([o, k, 1, 1])], "w1x1")
        ins = [cols, wt] + ([ctx.weight(node, 1)] if a["bias_term"] else [])
        ctx.add_node("Conv", ins, [node.outputs[0]], kernel_shape=[1, 1])

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.blob_parameters(("weight", "bias")[:1 + a["bias_term"]])
        bias = f"{m}['bias']" if a["bias_term"] else "None"
        args = ", ".join(repr(v) for v in self._args(a))
        return f"{emit.helper(attention_conv)}({emit.inputs[0]}, {emit.inputs[1]}, {m}['weight'], {bias}, {args})"


@register_layer("CrossConvolution")
class CrossConvolution(Layer):
    blob_names = ("weight", "bias")
    reading_note = (f"CrossConvolution ({STAR}) has only a GPU forward: each image convolved with its own "
                    "filters from the second bottom, no bias; the layer's own blobs are never read")

    def parse(self, lp):
        need_blobs(lp, "CrossConvolution", 2, 1, roles="data, filters", in_place=False)
        return read_two_bottom_conv(lp, "CrossConvolution")

    def infer(self, attrs, in_shapes):
        n, c, h, w = nchw(in_shapes[0], "CrossConvolution", "data")
        g, o = attrs["group"], attrs["num_output"]
        if c % g or o % g:
            raise LayerError(f"CrossConvolution: convolution_param.group {g} must divide the {c} channels and "
                             f"num_output {o}")
        out = [conv_out_size((h, w)[a], attrs["kernel"][a], attrs["stride"][a], attrs["pad"][a],
                             attrs["dilation"][a]) for a in range(2)]
        if min(out) < 1:
            raise LayerError(f"CrossConvolution's kernel does not fit the {h}x{w} map")
        _filters_fit(in_shapes[1], n, o * (c // g) * attrs["kernel"][0] * attrs["kernel"][1], "CrossConvolution",
                     "filters")
        return [(n, o, out[0], out[1])]

    def param_shapes(self, attrs, in_shapes):
        weight = (attrs["num_output"], in_shapes[0][1] // attrs["group"], *attrs["kernel"])
        return [weight, (attrs["num_output"],)] if attrs["bias_term"] else [weight]

    def _args(self, a):
        return a["num_output"], a["kernel"], a["stride"], a["pad"], a["dilation"], a["group"]

    def forward(self, attrs, params, x, filters):
        return cross_conv(x, filters, *self._args(attrs))

    def onnx(self, ctx, node):
        a = node.attrs
        x, f = node.inputs
        n, c, h, w = ctx.shape(x)
        o, g, (kh, kw) = a["num_output"], a["group"], a["kernel"]
        wt = onnx_flat_per_image(ctx, f, n, o * (c // g) * kh * kw, (n * o, c // g, kh, kw), "filters")
        xs = ctx.op("Reshape", [x, ctx.i64([1, n * c, h, w])], "images", name=node.name)
        y = ctx.op("Conv", [xs, wt], "conv", group=n * g, kernel_shape=[kh, kw], strides=a["stride"],
                   pads=[a["pad"][0], a["pad"][1], a["pad"][0], a["pad"][1]], dilations=a["dilation"])
        ctx.add_node("Reshape", [y, ctx.i64(list(ctx.shape(node.outputs[0])))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.uses("F")
        emit.helper(flat_per_image)
        args = ", ".join(repr(v) for v in self._args(node.attrs))
        return f"{emit.helper(cross_conv)}({emit.inputs[0]}, {emit.inputs[1]}, {args})"


@register_layer("DynamicSampleConvolution")
class DynamicSampleConvolution(Layer):
    reading_note = (f"DynamicSampleConvolution ({SEGAWAREATT}) has only a GPU forward; "
                    "object_kernel_convolution_param's pad, stride and lr_mul are not read at inference")

    def parse(self, lp):
        need_blobs(lp, "DynamicSampleConvolution", 3, 1, roles="data, across weights, within weights",
                   in_place=False)
        p = lp.object_kernel_convolution_param
        if p.axis != 1:
            raise LayerError("DynamicSampleConvolution runs with channels on axis 1, got "
                             f"object_kernel_convolution_param.axis {p.axis}")
        if p.dilation < 0:
            raise LayerError(f"object_kernel_convolution_param.dilation must be >= 0, got {p.dilation}")
        return {"num_output": positive_field(p.num_output, "object_kernel_convolution_param.num_output"),
                "kernel": positive_field(p.kernel_size, "object_kernel_convolution_param.kernel_size"),
                "dilation": int(p.dilation),
                "samples": positive_field(p.samples, "object_kernel_convolution_param.samples"),
                "kernel_stride": int(p.kernel_stride)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = nchw(in_shapes[0], "DynamicSampleConvolution", "data")
        k, d, o = attrs["kernel"], attrs["dilation"], attrs["num_output"]
        grow = 2 * ((k - 1) // 2) - d * (k - 1)
        if grow:
            raise LayerError(f"DynamicSampleConvolution: kernel_size {k} with dilation {d} sizes the top "
                             f"{h + grow}x{w + grow} while the fork's kernels index the {h}x{w} input; caffeq "
                             "needs them equal (an odd kernel_size with dilation 1, or kernel_size 1)")
        _filters_fit(in_shapes[1], n, h * w * o * c, "DynamicSampleConvolution", "across weights")
        _filters_fit(in_shapes[2], n, h * w * o * k * k, "DynamicSampleConvolution", "within weights")
        return [(n, h, w, attrs["samples"] ** 2 * o)]

    def _args(self, a):
        return a["num_output"], a["kernel"], a["dilation"], a["samples"], a["kernel_stride"]

    def forward(self, attrs, params, x, across, within):
        return dynamic_sample_conv(x, across, within, *self._args(attrs))

    def onnx(self, ctx, node):
        a = node.attrs
        x, across, within = node.inputs
        n, c, h, w = ctx.shape(x)
        o, k, d, s, t = self._args(a)
        ac = onnx_flat_per_image(ctx, across, n, h * w * o * c, (n, h, w, o, c), "across")
        wi = onnx_flat_per_image(ctx, within, n, h * w * o * k * k, (n, h, w, o, k * k), "within")
        total = ctx.op("ReduceSum", [x, ctx.i64([1])], "total", keepdims=1) if ctx.opset >= 13 else \
            ctx.op("ReduceSum", [x], "total", axes=[1], keepdims=1)
        sample, tap = sample_offsets(s, t, k, d)
        mid_shift = d * ((k - 1) // 2 - k // 2)
        outs = []
        for u, sy in sample:
            for v, sx in sample:
                taps = [onnx_shifted(ctx, total, h, w, sy + ty, sx + tx, f"s{u}_{v}_t{i}_{j}")
                        for i, ty in tap for j, tx in tap]
                taps = taps[0] if len(taps) == 1 else ctx.op("Concat", taps, f"s{u}_{v}_taps", axis=1)
                mid = onnx_shifted(ctx, x, h, w, sy + mid_shift, sx + mid_shift, f"s{u}_{v}_mid")
                y = ctx.op("Add", [ctx.op("Einsum", [wi, taps], f"s{u}_{v}_within", equation="nhwot,nthw->nhwo"),
                                   ctx.op("Einsum", [ac, mid], f"s{u}_{v}_across", equation="nhwoc,nchw->nhwo")],
                           f"s{u}_{v}")
                outs.append(ctx.op("Unsqueeze", [y, ctx.i64([3])], f"s{u}_{v}_u"))
        y = outs[0] if len(outs) == 1 else ctx.op("Concat", outs, "samples", axis=3)
        ctx.add_node("Reshape", [y, ctx.i64([n, h, w, s * s * o])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.uses("F")
        for helper in (flat_per_image, shifted, sample_offsets):
            emit.helper(helper)
        args = ", ".join(repr(v) for v in self._args(node.attrs))
        return f"{emit.helper(dynamic_sample_conv)}({', '.join(emit.inputs)}, {args})"


@register_layer("Python:kernel_all_bias_layer.KernelBiasLayer")
class KernelAllBias(Layer):
    reading_note = (f"Python kernel_all_bias_layer.KernelBiasLayer read as {SEGAWAREATT}'s "
                    "caffe/python/kernel_all_bias_layer.py: top = bottom + div")

    def parse(self, lp):
        need_blobs(lp, "Python kernel_all_bias_layer.KernelBiasLayer", 1, 1)
        params = parse_param_str(lp.python_param.param_str)
        div = params.get("div", 1.0)
        if isinstance(div, bool) or not isinstance(div, (int, float)):
            raise LayerError(f"kernel_all_bias_layer.KernelBiasLayer: param_str 'div' must be a number, got {div!r}")
        return {"div": float(torch.tensor(float(div), dtype=torch.float32))}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) != 4:
            raise LayerError("kernel_all_bias_layer.KernelBiasLayer needs a 4-D bottom (the fork reshapes its top to "
                             f"the bottom's first four axes), got {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x):
        return x + attrs["div"]

    def onnx(self, ctx, node):
        ctx.add_node("Add", [node.inputs[0], ctx.f32(node.attrs["div"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"({emit.inputs[0]} + {node.attrs['div']!r})"


__all__ = ["AttentionConvolution", "CrossConvolution", "DynamicSampleConvolution", "KernelAllBias"]
