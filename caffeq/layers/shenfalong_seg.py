"""shenfalong/styletransfer's own Caffe rewrite (cebf7e2), the five layer types its segmentation net
(matlab/prototxt/deploy_resnet_101_16x_v0.prototxt) adds to those of shenfalong_style.py.  The fork has only GPU
forwards (its .cpp files hold LayerSetUp / Reshape); ImageResize's "GPU" forward runs on the CPU through OpenCV.
shenfalong/SegModel (fac9bbd), whose net this is, has the same kernels as templates (ImageResize: see below).

- Shortcut (func/shortcut_layer.cpp, .cu): bottom 0 + bottom 1 (caffe_gpu_add, both of one shape); its
  shortcut_param (scale, dropout_ratio, groups) is not read.
- MultiConvolution (operator/multi_conv_layer.cpp, .cu): an im2col convolution of multi^2 x num_output outputs
  (kernel_size, pad, stride, filter_stride the dilation, group; bias_term [default = false]), whose output
  channel (i * multi + j) * num_output + c gives top channel c at (h * multi + i, w * multi + j): top
  (N, num_output, H' multi, W' multi).  Blobs weight (multi^2 num_output, C / group, k, k), bias
  (multi^2 num_output, 1, 1, 1).
- BoxFilter (activation/box_filter_layer.*, util/math_functions.cu box_filter_gpu): the sum over the
  (2r + 1)^2 window, clipped to the image (zeros outside), divided by min(2r + 1, H) x min(2r + 1, W)
  everywhere (not by the count inside the image); r = crf_param.radius truncated to an int.
- ImageResize (activation/image_resize_layer.cpp, .cu): OpenCV's INTER_AREA shrink of the 3-channel image by
  interp_param.interp_ratio (a float truncated to an int), as shenfalong/SegModel (fac9bbd, the same files), whose
  net (matlab/prototxt/deploy_resnet_101_16x_v0.prototxt, identical in this fork) and weights use it: the float
  image through cv::Mat::ptr<Dtype>, each r x r block summed in OpenCV's area-fast order (groups of four added to
  a running sum) times 1 / r^2; a ratio of 1 copies.  This fork's rewrite reads it through the untyped ptr()
  (uchar *): each value stored as a byte into a CV_32FC3 image and the result's bytes read back.  caffeq does not
  follow that: those float32s are NaN for pixel bytes 127 / 255 followed by one >= 128 (NaN-payload dependent
  sums), and values outside 0..255 are undefined float-to-uchar conversions.  H and W must be multiples of r
  (otherwise the fork's top index (c H / r + h) W / r + w leaves top values unwritten).
- GuidedCRF (operator/guided_crf_layer.*): bottom 0 the scores (N, M, H, W), bottom 1 a 3-channel guide of
  the same H x W.  var_I = box(I I^T) - box(I) box(I)^T per pixel; max_iter times: Q = softmax(U), a guided
  filter of Q by I (He et al.: a = (var_I + eps)^-1 cov(I, Q) by cofactors, b = box(Q) - a . box(I),
  q = box(a) . I + box(b)), U = unary + alpha * W q, with W the (1, 1, M, M) blob (the fork's default: ones off
  the diagonal).  As the kernels do: eps is added to var_I's diagonal in place, so iteration t uses
  var_I + (t + 1) eps; the softmax and W's gemm read the blob as (M, N H W) (item-major data read
  state-major: the intended reading for N = 1 only, the fork's numbers for every N).
"""
import math

import numpy as np
import torch

from .registry import Layer, LayerError, count, four_axes, need_blobs, positive_field, register_layer

# ---- Shortcut ---------------------------------------------------------------------------------------

@register_layer("Shortcut")
class Shortcut(Layer):
    bottoms, tops = 2, 1

    def infer(self, attrs, in_shapes):
        a, b = four_axes(in_shapes[0], "Shortcut"), four_axes(in_shapes[1], "Shortcut", "bottom 1")
        if a != b:
            raise LayerError(f"Shortcut needs two bottoms of one shape, got {list(a)} and {list(b)}")
        return [a]

    def forward(self, attrs, params, x, y):
        return x + y

    def onnx(self, ctx, node):
        ctx.add_node("Add", list(node.inputs[:2]), [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]} + {emit.inputs[1]}"


# ---- MultiConvolution -------------------------------------------------------------------------------

def multi_convolution(x, weight, bias, multi: int, num_output: int, stride: int, pad: int, dilation: int,
                      group: int):
    """The convolution's multi^2 x num_output channels spread into a multi-times larger map: channel
    (i * multi + j) * num_output + c lands at top channel c, row h * multi + i, column w * multi + j."""
    y = torch.nn.functional.conv2d(x, weight, bias, stride, pad, dilation, group)
    n, _, h, w = y.shape
    y = y.reshape(n, multi, multi, num_output, h, w).permute(0, 3, 4, 1, 5, 2)
    return y.reshape(n, num_output, h * multi, w * multi)


def _one(values, field):
    values = list(values)
    if len(values) > 1:
        raise LayerError(f"convolution_param.{field}: MultiConvolution takes one value, got {len(values)}")
    return int(values[0]) if values else None


@register_layer("MultiConvolution")
class MultiConvolution(Layer):
    weight_axes = {0: 0, 1: 0}

    def parse(self, lp):
        need_blobs(lp, "MultiConvolution", 1, 1)
        p = lp.convolution_param
        for field in ("kernel_h", "kernel_w", "pad_h", "pad_w", "stride_h", "stride_w"):
            if p.HasField(field):
                raise LayerError(f"convolution_param.{field}: MultiConvolution takes one kernel_size, pad and stride")
        kernel = _one(p.kernel_size, "kernel_size")
        if kernel is None:
            raise LayerError("convolution_param.kernel_size: MultiConvolution needs one")
        stride, pad = _one(p.stride, "stride"), _one(p.pad, "pad")
        return {"num_output": positive_field(p.num_output, "convolution_param.num_output"),
                "multi": positive_field(p.multi, "convolution_param.multi"),
                "kernel": positive_field(kernel, "convolution_param.kernel_size"),
                "stride": positive_field(1 if stride is None else stride, "convolution_param.stride"),
                "pad": 0 if pad is None else pad,
                "dilation": positive_field(p.filter_stride, "convolution_param.filter_stride"),
                "group": positive_field(p.group, "convolution_param.group"),
                # the fork's bias_term [default = false]
                "bias_term": p.bias_term if p.HasField("bias_term") else False}

    def blob_names_for(self, attrs):
        return ("weight", "bias") if attrs["bias_term"] else ("weight",)

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "MultiConvolution")
        a = attrs
        if c % a["group"] or a["num_output"] % a["group"]:
            raise LayerError(f"convolution_param.group {a['group']} must divide the {c} channels and num_output "
                             f"{a['num_output']}")
        k_eff = a["kernel"] + (a["kernel"] - 1) * (a["dilation"] - 1)
        ho, wo = ((s + 2 * a["pad"] - k_eff) // a["stride"] + 1 for s in (h, w))
        if ho < 1 or wo < 1:
            raise LayerError(f"MultiConvolution's {k_eff}x{k_eff} kernel (pad {a['pad']}) does not fit the "
                             f"{h}x{w} bottom")
        return [(n, a["num_output"], ho * a["multi"], wo * a["multi"])]

    def param_shapes(self, attrs, in_shapes):
        a = attrs
        outs = a["multi"] * a["multi"] * a["num_output"]
        shapes = [(outs, in_shapes[0][1] // a["group"], a["kernel"], a["kernel"])]
        return shapes + [(outs, 1, 1, 1)] if a["bias_term"] else shapes

    def init_params(self, attrs, shapes, rng):
        blobs = super().init_params(attrs, shapes[:1], rng)
        return blobs + [np.zeros(shapes[1], np.float32)] if len(shapes) > 1 else blobs

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * in_shapes[0][1] // attrs["group"] * attrs["kernel"] ** 2

    def _args(self, attrs):
        a = attrs
        return a["multi"], a["num_output"], a["stride"], a["pad"], a["dilation"], a["group"]

    def forward(self, attrs, params, x):
        bias = params[1].reshape(-1) if attrs["bias_term"] else None
        return multi_convolution(x, params[0], bias, *self._args(attrs))

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        ins = [node.inputs[0], ctx.weight(node, 0)]
        if a["bias_term"]:
            ins.append(ctx.const(np.asarray(node.blobs[1], np.float32).reshape(-1)))
        k, d, p, s, m = a["kernel"], a["dilation"], a["pad"], a["stride"], a["multi"]
        y = ctx.op("Conv", ins, name + "_conv", kernel_shape=[k, k], dilations=[d, d], pads=[p] * 4,
                   strides=[s, s], group=a["group"])
        n, o, ht, wt = ctx.shape(node.outputs[0])
        y = ctx.op("Reshape", [y, ctx.const(np.array([n, m, m, o, ht // m, wt // m], np.int64))], name + "_split")
        y = ctx.op("Transpose", [y], name + "_spread", perm=[0, 3, 4, 1, 5, 2])
        ctx.add_node("Reshape", [y, ctx.const(np.array([n, o, ht, wt], np.int64))], [node.outputs[0]], name=name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.blob_parameters(self.blob_names_for(a))
        bias = f"{m}['bias'].reshape(-1)" if a["bias_term"] else "None"
        args = ", ".join(str(v) for v in self._args(a))
        return f"{emit.helper(multi_convolution)}({emit.inputs[0]}, {m}['weight'], {bias}, {args})"


# ---- BoxFilter ---------------------------------------------------------------------------------------

def box_area(radius: int, h: int, w: int):
    """box_filter_gpu's divisor: min(2r + 1, H) x min(2r + 1, W)."""
    return min(2 * radius + 1, h) * min(2 * radius + 1, w)


def box_filter(x, radius: int):
    """The (2r + 1)^2 window sum, zeros outside the image, over min(2r + 1, H) min(2r + 1, W)."""
    k = 2 * radius + 1
    return torch.nn.functional.avg_pool2d(x, k, 1, radius, count_include_pad=True,
                        divisor_override=box_area(radius, x.shape[2], x.shape[3]))


def _radius(lp, what):
    r = lp.crf_param.radius
    if not math.isfinite(r) or not -1 < r < 2.0 ** 30:
        raise LayerError(f"crf_param.radius must be >= 0 and < 2^30 ({what} truncates it to an int), got {r:g}")
    return int(r)


def onnx_box_filter(ctx, x, shape, radius, hint, out):
    """AveragePool of the padded window (a sum over (2r + 1)^2), scaled to the fork's divisor."""
    k = 2 * radius + 1
    scale = k * k / box_area(radius, shape[2], shape[3])
    pool = dict(kernel_shape=[k, k], pads=[radius] * 4, strides=[1, 1], count_include_pad=1)
    if scale == 1:
        return ctx.add_node("AveragePool", [x], [out], name=hint, **pool)[0]
    pooled = ctx.op("AveragePool", [x], hint + "_pool", **pool)
    return ctx.add_node("Mul", [pooled, ctx.const(np.array(scale, np.float32))], [out], name=hint)[0]


@register_layer("BoxFilter")
class BoxFilter(Layer):
    def parse(self, lp):
        need_blobs(lp, "BoxFilter", 1, 1)
        return {"radius": _radius(lp, "BoxFilter")}

    def infer(self, attrs, in_shapes):
        return [four_axes(in_shapes[0], "BoxFilter")]

    def macs(self, attrs, in_shapes, out_shapes):
        return 4 * count(in_shapes[0])

    def forward(self, attrs, params, x):
        return box_filter(x, attrs["radius"])

    def onnx(self, ctx, node):
        onnx_box_filter(ctx, node.inputs[0], ctx.shape(node.inputs[0]), node.attrs["radius"], node.name,
                        node.outputs[0])

    def pytorch_source(self, node, emit):
        emit.helper(box_area)
        return f"{emit.helper(box_filter)}({emit.inputs[0]}, {node.attrs['radius']})"


# ---- ImageResize -------------------------------------------------------------------------------------

def area_shrink(x, r: int):
    """cv::resize INTER_AREA of a float image by the integer factor r (OpenCV's area-fast path): each r x r
    block summed in groups of four (((a + b) + c) + d) added to a running float sum, then times 1 / r^2."""
    if r == 1:
        return x.clone()                     # cv::resize copies an image of the same size
    n, c, h, w = x.shape
    blocks = x.reshape(n, c, h // r, r, w // r, r).permute(0, 1, 2, 4, 3, 5).reshape(n, c, h // r, w // r, r * r)
    area = r * r
    total = torch.zeros_like(blocks[..., 0])
    k = 0
    while k + 4 <= area:
        total = total + (((blocks[..., k] + blocks[..., k + 1]) + blocks[..., k + 2]) + blocks[..., k + 3])
        k += 4
    while k < area:
        total = total + blocks[..., k]
        k += 1
    return total * torch.tensor(1.0 / area, dtype=x.dtype, device=x.device)


@register_layer("ImageResize")
class ImageResize(Layer):
    onnx_refusal = ("ImageResize's OpenCV area sum order (groups of four, then times 1 / r^2) has no exact ONNX "
                    "emission yet")

    def parse(self, lp):
        need_blobs(lp, "ImageResize", 1, 1)
        ratio = lp.interp_param.interp_ratio
        if not math.isfinite(ratio) or not 1 <= ratio < 2.0 ** 31:
            raise LayerError(f"interp_param.interp_ratio must be >= 1 (the fork truncates it to an int), got {ratio:g}")
        return {"ratio": int(ratio)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "ImageResize")
        r = attrs["ratio"]
        if c != 3:
            raise LayerError(f"ImageResize converts 3 channels (an OpenCV CV_32FC3 image), got {c}")
        if h % r or w % r:
            # OpenCV's general area weights, and the fork's top index ((c H / r + h) W / r + w) leaves top values
            # unwritten (and writes others twice)
            raise LayerError(f"ImageResize: the {h}x{w} bottom is not a multiple of interp_ratio {r}: the fork's "
                             f"forward would leave top values unwritten")
        return [(n, c, h // r, w // r)]

    def forward(self, attrs, params, x):
        return area_shrink(x, attrs["ratio"])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(area_shrink)}({emit.inputs[0]}, {node.attrs['ratio']})"


# ---- GuidedCRF ---------------------------------------------------------------------------------------

def inverse_3x3(v):
    """The fork's inv_var_I_eps_kernel_3 cofactors over v (N, 3, 3, H, W), each over its determinant."""
    def e(i, j):
        return v[:, i, j]
    det = (e(0, 0) * (e(1, 1) * e(2, 2) - e(2, 1) * e(1, 2))
           - e(0, 1) * (e(1, 0) * e(2, 2) - e(2, 0) * e(1, 2))
           + e(0, 2) * (e(1, 0) * e(2, 1) - e(2, 0) * e(1, 1)))
    inv = 1 / det
    rows = [[e(1, 1) * e(2, 2) - e(2, 1) * e(1, 2), e(2, 0) * e(1, 2) - e(1, 0) * e(2, 2),
             e(1, 0) * e(2, 1) - e(2, 0) * e(1, 1)],
            [e(2, 1) * e(0, 2) - e(0, 1) * e(2, 2), e(0, 0) * e(2, 2) - e(2, 0) * e(0, 2),
             e(0, 1) * e(2, 0) - e(0, 0) * e(2, 1)],
            [e(0, 1) * e(1, 2) - e(1, 1) * e(0, 2), e(1, 0) * e(0, 2) - e(0, 0) * e(1, 2),
             e(0, 0) * e(1, 1) - e(0, 1) * e(1, 0)]]
    return torch.stack([torch.stack([inv * c for c in row], dim=1) for row in rows], dim=1)


def guided_filter(image, p, mean_image, var_eps, radius: int):
    """guided_filter_gpu: p (N, M, H, W) filtered with the 3-channel guide (a by cofactors, as the fork)."""
    n, m, h, w = p.shape
    mean_p = box_filter(p, radius)
    ip = p[:, :, None] * image[:, None]                                            # (N, M, 3, H, W)
    mean_ip = box_filter(ip.reshape(n, m * 3, h, w), radius).reshape(n, m, 3, h, w)
    cov = mean_ip - mean_image[:, None] * mean_p[:, :, None]
    inv = inverse_3x3(var_eps)
    a = torch.stack([cov[:, :, 0] * inv[:, None, i, 0] + cov[:, :, 1] * inv[:, None, i, 1]
                     + cov[:, :, 2] * inv[:, None, i, 2] for i in range(3)], dim=2)
    mean_a = box_filter(a.reshape(n, m * 3, h, w), radius).reshape(n, m, 3, h, w)
    b = mean_p - mean_image[:, None, 0] * a[:, :, 0] - mean_image[:, None, 1] * a[:, :, 1] \
        - mean_image[:, None, 2] * a[:, :, 2]
    mean_b = box_filter(b, radius)
    return (image[:, None, 0] * mean_a[:, :, 0] + image[:, None, 1] * mean_a[:, :, 1]
            + image[:, None, 2] * mean_a[:, :, 2] + mean_b)


def guided_crf(unary, image, compat, radius: int, max_iter: int, alpha: float, eps: float):
    """GuidedCRF's forward: max_iter mean-field steps, the softmax and compatibility gemm over the blob read
    as (M, N H W), eps added to var_I's diagonal once more each step (see the module docstring)."""
    n, m, h, w = unary.shape
    mean_image = box_filter(image, radius)
    ii = image[:, :, None] * image[:, None]                                       # [c2][c1] = I[c1] I[c2]
    var = box_filter(ii.reshape(n, 9, h, w), radius).reshape(n, 3, 3, h, w) - mean_image[:, :, None] * mean_image[:, None]
    diag = torch.eye(3, dtype=torch.bool, device=unary.device).reshape(1, 3, 3, 1, 1)
    weights = compat.reshape(m, m)
    state = unary
    for _ in range(max_iter):
        prob = torch.softmax(state.reshape(m, -1), dim=0).reshape(unary.shape)
        var = torch.where(diag, var + eps, var)
        filtered = guided_filter(image, prob, mean_image, var, radius)
        state = unary + alpha * (weights @ filtered.reshape(m, -1)).reshape(unary.shape)
    return state


@register_layer("GuidedCRF")
class GuidedCRF(Layer):
    blob_names = ("compatibility",)
    onnx_refusal = "GuidedCRF's per-pixel 3x3 cofactor inverse and mean-field loop have no ONNX emission yet"

    def parse(self, lp):
        need_blobs(lp, "GuidedCRF", 2, 1, "scores, guide image")
        p = lp.crf_param
        if p.max_iter < 0:
            raise LayerError(f"crf_param.max_iter must be >= 0, got {p.max_iter}")
        return {"radius": _radius(lp, "GuidedCRF"), "max_iter": int(p.max_iter), "alpha": float(p.alpha),
                "eps": float(p.eps)}

    def infer(self, attrs, in_shapes):
        s = four_axes(in_shapes[0], "GuidedCRF")
        g = four_axes(in_shapes[1], "GuidedCRF", "bottom 1 (guide)")
        if g[1] != 3:
            raise LayerError(f"GuidedCRF's guide (bottom 1) must have 3 channels (its kernels take 3), got {g[1]}")
        if (g[0], g[2], g[3]) != (s[0], s[2], s[3]):
            raise LayerError(f"GuidedCRF's guide {list(g)} must match the scores {list(s)} in num, height and width")
        return [s]

    def param_shapes(self, attrs, in_shapes):
        m = in_shapes[0][1]
        return [(1, 1, m, m)]

    def init_params(self, attrs, shapes, rng):
        m = shapes[0][2]
        return [(1 - np.eye(m, dtype=np.float32)).reshape(1, 1, m, m)]   # the fork's LayerSetUp

    def macs(self, attrs, in_shapes, out_shapes):
        n, m, h, w = in_shapes[0]
        return attrs["max_iter"] * n * h * w * (m * m + 60 * m)

    def forward(self, attrs, params, unary, image):
        a = attrs
        return guided_crf(unary, image, params[0], a["radius"], a["max_iter"], a["alpha"], a["eps"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.blob_parameters(self.blob_names)
        for fn in (box_area, box_filter, inverse_3x3, guided_filter):
            emit.helper(fn)
        return (f"{emit.helper(guided_crf)}({emit.inputs[0]}, {emit.inputs[1]}, {m}['compatibility'], "
                f"{a['radius']}, {a['max_iter']}, {emit.lit(a['alpha'])}, {emit.lit(a['eps'])})")
