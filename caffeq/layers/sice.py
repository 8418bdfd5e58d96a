"""csjcai/SICE's per-pixel convolution (6760894, "Model 3/Layer/PixelConv_layer.{hpp,cpp,cu}"; its parameter
message in "Model 3/Readme.md"; the net "Model 3/Perpixel.prototxt", whose Dtow is limuhit/CCN's, caffe_gan.py).

PixelConv (bottoms: per-pixel kernels, data; one top, the data's (N, C, H, W), all read through the legacy
num/channels/height/width accessors): every pixel of every data channel is convolved with its own k x k kernel,
taken from bottom 0 at that pixel:

    top[n, c, y, x] = sum over (i, j) of K[n, c, i k + j, y, x] * data[n, c, y - p + i, x - p + j]

with zeros outside the image, the (i, j) in im2col's row-major order (summed in that order here; the fork sums
them in a GEMM with a row of ones).  k = int(sqrt(C0 / C)) (integer division: the channel ratio of bottom 0 to
bottom 1) and p = k / 2 (`pixelconvolution_param.is_pad`, default true).  K is bottom 0 read as one flat array
from its start, k^2 planes of H x W per (n, c) in turn, as the fork's forward walks its pointer: with
C0 = C k^2 that is bottom 0's channel c k^2 + i k + j of the same image.  The fork checks only that the two
bottoms share H and W.  Refused here with the reason (a LayerError): C0 < C (k = 0), an even k (its padded
im2col writes past the k^2 x H W column buffer), `is_pad: false` (pad_size is then never set), and a bottom 0
with fewer values than the N C k^2 planes the forward reads.  `is_bpk` / `is_bpd` gate the backward only.
The CPU and GPU forwards compute the same; both are what runs at TEST.  torch, ONNX, model.py.
"""
import math

import torch.nn.functional as F

from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer


def pixel_conv(kernels, x, k: int, pad: int):
    """Each pixel of x (N, C, H, W) convolved with its own k x k kernel: kernels read flat from the start,
    k^2 planes of H x W per (n, c); zeros outside the image, kernel taps summed in row-major order."""
    n, c, h, w = x.shape
    taps = kernels.reshape(-1)[: n * c * k * k * h * w].reshape(n * c, k * k, h, w)
    xp = F.pad(x.reshape(n * c, 1, h, w), (pad, pad, pad, pad))
    out = None
    for i in range(k):
        for j in range(k):
            term = taps[:, i * k + j:i * k + j + 1] * xp[:, :, i:i + h, j:j + w]
            out = term if out is None else out + term
    return out.reshape(n, c, h, w)


@register_layer("PixelConv")
class PixelConv(Layer):
    def parse(self, lp):
        need_blobs(lp, "PixelConv", 2, 1, "per-pixel kernels, data")
        p = lp.pixelconvolution_param
        if not p.is_pad:
            raise LayerError("pixelconvolution_param.is_pad: false is not supported: the fork then never sets "
                             "its pad_size (an uninitialized value)")
        return {}

    def infer(self, attrs, in_shapes):
        n0, c0, h0, w0 = legacy_nchw(in_shapes[0], "PixelConv")
        n, c, h, w = legacy_nchw(in_shapes[1], "PixelConv")
        if (h0, w0) != (h, w):
            raise LayerError(f"PixelConv's kernels and data must have the same height and width (the fork's "
                             f"check), got {h0} x {w0} and {h} x {w}")
        if c0 < c:
            raise LayerError(f"PixelConv's kernel bottom needs at least the data's {c} channels (k = "
                             f"sqrt({c0} / {c}) would be 0), got {c0}")
        k = math.isqrt(c0 // c)
        if k % 2 == 0:
            raise LayerError(f"PixelConv's kernel size k = sqrt({c0} / {c}) = {k} is even: the fork's padded "
                             f"im2col would write past its k^2 x H W column buffer")
        if n0 * c0 < n * c * k * k:
            raise LayerError(f"PixelConv reads {n * c * k * k} kernel planes ({n} x {c} x {k}^2) from a kernel "
                             f"bottom of {n0 * c0}")
        attrs.update(k=k, pad=k // 2, _legacy=[n, c, h, w])
        return [(n, c, h, w)]

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(out_shapes[0]) * attrs["k"] ** 2

    def forward(self, attrs, params, kernels, x):
        return pixel_conv(kernels, x.reshape(attrs["_legacy"]), attrs["k"], attrs["pad"])

    def onnx(self, ctx, node):
        a = node.attrs
        n, c, h, w = a["_legacy"]
        k, pad = a["k"], a["pad"]
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "flat", name=node.name)
        used = n * c * k * k * h * w
        if used < math.prod(ctx.shape(node.inputs[0])):
            flat = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([used]), ctx.i64([0])], "used")
        taps = ctx.op("Reshape", [flat, ctx.i64([n * c, k * k, h, w])], "taps")
        xp = ctx.op("Reshape", [node.inputs[1], ctx.i64([n * c, 1, h, w])], "planes")
        if pad:
            xp = ctx.op("Pad", [xp, ctx.i64([0, 0, pad, pad, 0, 0, pad, pad])], "padded")
        out = None
        for i in range(k):
            for j in range(k):
                t = i * k + j
                tap = ctx.op("Slice", [taps, ctx.i64([t]), ctx.i64([t + 1]), ctx.i64([1])], f"tap{t}")
                win = xp
                if k > 1:
                    win = ctx.op("Slice", [xp, ctx.i64([i, j]), ctx.i64([i + h, j + w]), ctx.i64([2, 3])],
                                 f"window{t}")
                term = ctx.op("Mul", [tap, win], f"term{t}")
                out = term if out is None else ctx.op("Add", [out, term], f"sum{t}")
        ctx.add_node("Reshape", [out, ctx.i64([n, c, h, w])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(pixel_conv)
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}.reshape({a['_legacy']}), {a['k']}, {a['pad']})"
