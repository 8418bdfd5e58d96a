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

LapPyr (csjcai/RealSR f8c724a, "Layer/Laplacian Pyramid/LapPyr_Layer.{hpp,cpp}", its parameter message in
"Layer/Laplacian Pyramid/readme.md"; the nets Test/LP-KPN.prototxt and Train/LP-KPN.prototxt, whose PixelConv
("Layer/KPL", the same source as SICE's) and Dtow ("Layer/Shuffle", limuhit/CCN's) are read as above).  Only a
Forward_cpu exists (its Forward_gpu is commented out, so Caffe's GPU mode runs the CPU code).  Every (n, c)
plane is handled alone, through the legacy accessors; B256 and B64 are 5 x 5 correlations with zero padding 2 of
the binomial [1 4 6 4 1]^T [1 4 6 4 1] / 256 and / 64.  H2 = H / 2, W2 = W / 2, H3 = H / 4, W3 = W / 4
(integer division).  The fork's two resampling steps address their buffers with rows of 2 W2 (2 W3) elements:
- down(t, h', w'): the t buffer read flat, its first 2 h' x 2 w' values taken as a 2 h' x 2 w' image, every
  second row and column from 0 (an odd width thus shears the rows, as in the fork);
- up(t, h, w): a zeroed h x w buffer whose first 4 h' w' values hold t spread over a 2 h' x 2 w' image
  (t at even rows and columns, 0 elsewhere), read back as h x w (the tail stays 0: fresh buffers at a fixed
  input shape).
`laplacianpyramid_param.is_down` (default true): one bottom x to three tops,
    top1 = down(B256 x, H2, W2) ... then top2 = down(B256 top1', H3, W3)
    top0 = x - B64 up(top1', H, W),   top1 = top1' - B64 up(top2, H2, W2),
tops (N, C, H, W), (N, C, H2, W2), (N, C, H3, W3).  is_down: false: bottoms (b0, b1, b2) to one top (b0's
shape), t = b1 + B64 up(b2, H2, W2) and top = b0 + B64 up(t, H, W), with (H2, W2) and (H3, W3) those of b1 and
b2, whose planes are read flat in turn (N C of them).  Refused (LayerError): other blob counts, a height or width
below 4 (an empty third level), up-sampled values past a buffer (4 H3 W3 > H2 W2 or 4 H2 W2 > H W) and bottoms
with fewer than N C planes.  Its Backward_cpu is NOT_IMPLEMENTED.  torch, ONNX, model.py.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer, torch_sources


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


# ---- LapPyr (csjcai/RealSR) --------------------------------------------------------------------


def lap_blur(planes, divisor: float):
    """(M, h, w) planes correlated with the 5 x 5 binomial [1 4 6 4 1]^T [1 4 6 4 1] / divisor, zero padding 2."""
    row = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0], dtype=planes.dtype, device=planes.device)
    kernel = (row[:, None] * row[None, :] / divisor).reshape(1, 1, 5, 5)
    return F.conv2d(planes[:, None], kernel, padding=2)[:, 0]


def lap_down(planes, h2: int, w2: int):
    """(M, h, w) -> (M, h2, w2): the buffer read flat with rows of 2 w2 values, even rows and columns."""
    m = planes.shape[0]
    first = planes.reshape(m, -1)[:, : 4 * h2 * w2]
    return first.reshape(m, 2 * h2, 2 * w2)[:, ::2, ::2]


def lap_up(planes, h: int, w: int):
    """(M, h2, w2) -> (M, h, w): the planes at the even rows and columns of a 2 h2 x 2 w2 image of zeros,
    written flat at the start of a zeroed h x w buffer."""
    m, h2, w2 = planes.shape
    cols = torch.stack([planes, torch.zeros_like(planes)], dim=3)            # (M, h2, w2, 2)
    image = torch.stack([cols, torch.zeros_like(cols)], dim=2)               # (M, h2, 2, w2, 2)
    flat = F.pad(image.reshape(m, 4 * h2 * w2), (0, h * w - 4 * h2 * w2))
    return flat.reshape(m, h, w)


def lap_pyramid(x, n: int, c: int, h: int, w: int):
    """csjcai/RealSR's LapPyr decomposition of x (n, c, h, w) -> the three levels, finest first."""
    h2, w2, h3, w3 = h // 2, w // 2, h // 4, w // 4
    planes = x.reshape(n * c, h, w)
    mid = lap_down(lap_blur(planes, 256.0), h2, w2)
    low = lap_down(lap_blur(mid, 256.0), h3, w3)
    fine = planes - lap_blur(lap_up(mid, h, w), 64.0)
    mid = mid - lap_blur(lap_up(low, h2, w2), 64.0)
    return fine.reshape(n, c, h, w), mid.reshape(n, c, h2, w2), low.reshape(n, c, h3, w3)


def lap_collapse(b0, b1, b2, n: int, c: int, sizes: list):
    """csjcai/RealSR's LapPyr reconstruction (is_down: false): b1 + B64 up(b2), then b0 + B64 up of that;
    sizes: the (h, w) of the three levels; b1 and b2 read as their first n c planes."""
    (h, w), (h2, w2), (h3, w3) = sizes
    low = b2.reshape(-1)[: n * c * h3 * w3].reshape(n * c, h3, w3)
    mid = b1.reshape(-1)[: n * c * h2 * w2].reshape(n * c, h2, w2) + lap_blur(lap_up(low, h2, w2), 64.0)
    out = b0.reshape(n * c, h, w) + lap_blur(lap_up(mid, h, w), 64.0)
    return out.reshape(n, c, h, w)


TORCH_LAP_PYR = torch_sources(lap_blur, lap_down, lap_up, lap_pyramid)
TORCH_LAP_COLLAPSE = torch_sources(lap_blur, lap_up, lap_collapse)


@register_layer("LapPyr")
class LapPyr(Layer):
    def parse(self, lp):
        down = lp.laplacianpyramid_param.is_down
        if down:
            need_blobs(lp, "LapPyr (is_down: true)", 1, 3, "data")
        else:
            need_blobs(lp, "LapPyr (is_down: false)", 3, 1, "finest, middle, coarsest level")
        return {"down": bool(down)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "LapPyr")
        if attrs["down"]:
            if h < 4 or w < 4:
                raise LayerError(f"LapPyr's decomposition needs a height and width of at least 4 (its third level "
                                 f"is H / 4 x W / 4), got {h} x {w}")
            attrs.update(_legacy=[n, c, h, w])
            return [(n, c, h, w), (n, c, h // 2, w // 2), (n, c, h // 4, w // 4)]
        sizes = [(h, w)]
        for k in (1, 2):
            nk, ck, hk, wk = legacy_nchw(in_shapes[k], "LapPyr")
            if nk * ck < n * c:
                raise LayerError(f"LapPyr (is_down: false) reads {n * c} planes ({n} x {c}, bottom 0's) from bottom "
                                 f"{k}, which holds {nk * ck}")
            sizes.append((hk, wk))
        for (hb, wb), (hs, ws) in zip(sizes, sizes[1:]):
            if 4 * hs * ws > hb * wb:
                raise LayerError(f"LapPyr (is_down: false): a {hs} x {ws} level up-sampled fills 4 x {hs * ws} values "
                                 f"of the fork's {hb} x {wb} buffer, past its end")
        attrs.update(_legacy=[n, c, h, w], sizes=[list(s) for s in sizes])
        return [(n, c, h, w)]

    def macs(self, attrs, in_shapes, out_shapes):
        return sum(math.prod(s) for s in out_shapes) * 25 * (3 if attrs["down"] else 2)

    def forward(self, attrs, params, *xs):
        n, c, h, w = attrs["_legacy"]
        if attrs["down"]:
            return list(lap_pyramid(xs[0], n, c, h, w))
        return lap_collapse(*xs[:3], n, c, attrs["sizes"])

    def onnx(self, ctx, node):
        a = node.attrs
        n, c, h, w = a["_legacy"]
        m = n * c
        i64, op = ctx.i64, ctx.op

        def blur(planes, divisor):   # (M, 1, h, w)
            row = np.array([1.0, 4.0, 6.0, 4.0, 1.0], np.float32)
            kernel = (row[:, None] * row[None, :] / np.float32(divisor)).astype(np.float32).reshape(1, 1, 5, 5)
            return op("Conv", [planes, ctx.const(kernel)], f"blur{int(divisor)}", kernel_shape=[5, 5],
                      pads=[2, 2, 2, 2])

        def down(planes, h2, w2):
            first = op("Slice", [op("Reshape", [planes, i64([m, -1])], "flat"), i64([0]), i64([4 * h2 * w2]),
                                 i64([1])], "first")
            image = op("Reshape", [first, i64([m, 1, 2 * h2, 2 * w2])], "image")
            return op("Slice", [image, i64([0, 0]), i64([2 * h2, 2 * w2]), i64([2, 3]), i64([2, 2])], "down")

        def up(planes, h2, w2, hb, wb):
            spread = op("Pad", [op("Reshape", [planes, i64([m, h2, 1, w2, 1])], "cells"),
                                i64([0, 0, 0, 0, 0, 0, 0, 1, 0, 1])], "spread")
            flat = op("Pad", [op("Reshape", [spread, i64([m, 4 * h2 * w2])], "spread_flat"),
                              i64([0, 0, 0, hb * wb - 4 * h2 * w2])], "buffer")
            return op("Reshape", [flat, i64([m, 1, hb, wb])], "up")

        def planes_of(x, count, hk, wk):
            flat = op("Reshape", [x, i64([-1])], "values")
            flat = op("Slice", [flat, i64([0]), i64([count * hk * wk]), i64([0])], "used")
            return op("Reshape", [flat, i64([count, 1, hk, wk])], "planes")

        if a["down"]:
            h2, w2, h3, w3 = h // 2, w // 2, h // 4, w // 4
            planes = op("Reshape", [node.inputs[0], i64([m, 1, h, w])], "planes")
            mid = down(blur(planes, 256), h2, w2)
            low = down(blur(mid, 256), h3, w3)
            fine = op("Sub", [planes, blur(up(mid, h2, w2, h, w), 64)], "fine")
            mid2 = op("Sub", [mid, blur(up(low, h3, w3, h2, w2), 64)], "mid")
            for out, v, (hk, wk) in zip(node.outputs, (fine, mid2, low), ((h, w), (h2, w2), (h3, w3))):
                ctx.add_node("Reshape", [v, i64([n, c, hk, wk])], [out])
            return
        (_, _), (h2, w2), (h3, w3) = a["sizes"]
        low = planes_of(node.inputs[2], m, h3, w3)
        mid = op("Add", [planes_of(node.inputs[1], m, h2, w2), blur(up(low, h3, w3, h2, w2), 64)], "mid")
        b0 = op("Reshape", [node.inputs[0], i64([m, 1, h, w])], "finest")
        out = op("Add", [b0, blur(up(mid, h2, w2, h, w), 64)], "out")
        ctx.add_node("Reshape", [out, i64([n, c, h, w])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        n, c, h, w = node.attrs["_legacy"]
        if node.attrs["down"]:
            fn = emit.helper(TORCH_LAP_PYR)
            levels = emit.tmp("levels")
            emit.stmt(f"{levels} = {fn}({emit.inputs[0]}, {n}, {c}, {h}, {w})")
            return [f"{levels}[{k}]" for k in range(3)]
        fn = emit.helper(TORCH_LAP_COLLAPSE)
        return f"{fn}({', '.join(emit.inputs[:3])}, {n}, {c}, {node.attrs['sizes']})"
