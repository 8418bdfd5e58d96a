"""Warping of Ravi-Garg/Unsupervised_Depth_Estimation (Garg et al., "Unsupervised CNN for Single View
Depth Estimation", ECCV 2016; warping_layer.cu at 6f75cb9), which other stereo nets reuse
(JunhyeongBak/Caffe_Light_Field).  The fork has only a GPU forward; this is it.

Bottoms (image (N, C, H, W), horizontal flow u, vertical flow v), u and v of the image's N, H and W;
the kernel reads both flows by pixel index n H W + h W + w, i.e. the first N H W values of their
memory whatever their channel count.  Per pixel, in float32: xx = w + u, yy = h + v, x1 = floor(xx),
x2 = x1 + 1, y1 = floor(yy) but y2 = int(yy + 1) (truncated, as the kernel writes it: after float
rounding yy + 1 can reach the next integer while floor(yy) has not).  When x1, x2 lie in [0, W - 1] and
y1, y2 in [0, H - 1] every channel gets
    (y2 - yy) ((x2 - xx) I[y1, x1] + (xx - x1) I[y1, x2]) + (yy - y1) ((x2 - xx) I[y2, x1] + (xx - x1) I[y2, x2]),
else 0.  A NaN coordinate converts to index 0 (CUDA's float-to-int), its weights staying NaN.

Mirror (leonzfa/iResNet 4e5b0b7, src/caffe/layers/mirror_layer.cu; GPU only, its CPU forward NOT_IMPLEMENTED):
each row reversed, top[n, c, h, W - 1 - w] = bottom[n, c, h, w] over num / channels / height / width (a blob of
fewer axes padded with 1s, as Blob's legacy accessors read it).  iResNet's "mirror" stereo nets flip both
images, swap them, and flip the disparity back.
"""
import torch

from .optical_flow import pixels_at
from .registry import Layer, LayerError, four_axes, legacy_nchw, need_blobs, register_layer
from .warp_onnx import OnnxImageSampler


def flow_channel_by_pixel(flow, n: int, h: int, w: int):
    """The first N H W values of a flow's memory as (N, 1, H, W): how the kernel indexes it."""
    return flow.reshape(-1)[:n * h * w].reshape(n, 1, h, w)


def garg_warp(image, u, v):
    """Ravi-Garg's Warping forward (see the module docstring)."""
    n, c, h, w = image.shape
    u, v = flow_channel_by_pixel(u, n, h, w), flow_channel_by_pixel(v, n, h, w)
    gy, gx = torch.meshgrid(torch.arange(h, dtype=image.dtype, device=image.device),
                            torch.arange(w, dtype=image.dtype, device=image.device), indexing="ij")
    xx, yy = gx + u, gy + v
    x1, y1, y2 = xx.floor(), yy.floor(), (yy + 1).trunc()
    x1, y1, y2 = (torch.where(torch.isnan(t), torch.zeros_like(t), t) for t in (x1, y1, y2))
    x2 = x1 + 1
    inside = (x1 >= 0) & (x2 <= w - 1) & (y1 >= 0) & (y1 <= h - 1) & (y2 >= 0) & (y2 <= h - 1)
    x1, x2, y1, y2 = (torch.where(inside, t, torch.zeros_like(t)) for t in (x1, x2, y1, y2))
    rows, cols = (y1.long(), y2.long()), (x1.long(), x2.long())
    left, right = x2 - xx, xx - x1
    upper = left * pixels_at(image, rows[0], cols[0]) + right * pixels_at(image, rows[0], cols[1])
    lower = left * pixels_at(image, rows[1], cols[0]) + right * pixels_at(image, rows[1], cols[1])
    warped = (y2 - yy) * upper + (yy - y1) * lower
    return torch.where(inside, warped, torch.zeros_like(warped))


@register_layer("Warping")
class GargWarping(Layer):
    def parse(self, lp):
        need_blobs(lp, "Warping", 3, 1, "image, horizontal flow, vertical flow")
        return {}

    def infer(self, attrs, in_shapes):
        image = four_axes(in_shapes[0], "Warping", "image")
        for role, shape in (("horizontal flow", in_shapes[1]), ("vertical flow", in_shapes[2])):
            n, _c, h, w = legacy_nchw(shape, "Warping")
            if (n, h, w) != (image[0], image[2], image[3]):
                raise LayerError(f"Warping's {role} must have the image's num, height and width (the fork's "
                                 f"CHECKs): image {list(image)}, {role} {list(shape)}")
        return [image]

    def forward(self, attrs, params, image, u, v):
        return garg_warp(image, u, v)

    def onnx(self, ctx, node):
        image, u, v = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        n = ctx.shape(image)[0]

        def by_pixel(flow, hint):
            if list(ctx.shape(flow)) == [n, 1, s.h, s.w]:
                return flow
            flat = s.op("Reshape", [flow, s.i64([-1])], hint + "_flat")
            head = s.op("Slice", [flat, s.i64([0]), s.i64([n * s.h * s.w]), s.i64([0])], hint + "_head")
            return s.op("Reshape", [head, s.i64([n, 1, s.h, s.w])], hint + "_map")

        xx, yy = s.plus_pixel_grid(by_pixel(u, "u"), by_pixel(v, "v"))

        def index(t, hint):   # CUDA's float-to-int of NaN is 0
            return s.op("Where", [s.op("IsNaN", [t], hint + "_nan"), s.f32(0), t], hint)
        x1 = index(s.op("Floor", [xx], "x1_f"), "x1")
        y1 = index(s.op("Floor", [yy], "y1_f"), "y1")
        y2 = index(self._trunc(s, s.op("Add", [yy, s.f32(1)], "yy1")), "y2")
        x2 = s.op("Add", [x1, s.f32(1)], "x2")
        checks = [s.op("GreaterOrEqual", [x1, s.f32(0)], "c0"), s.op("LessOrEqual", [x2, s.f32(s.w - 1)], "c1"),
                  s.op("GreaterOrEqual", [y1, s.f32(0)], "c2"), s.op("LessOrEqual", [y1, s.f32(s.h - 1)], "c3"),
                  s.op("GreaterOrEqual", [y2, s.f32(0)], "c4"), s.op("LessOrEqual", [y2, s.f32(s.h - 1)], "c5")]
        inside = checks[0]
        for k, check in enumerate(checks[1:]):
            inside = s.op("And", [inside, check], f"in{k}")
        safe = [s.op("Where", [inside, t, s.f32(0)], f"{hint}_safe")
                for t, hint in ((x1, "x1"), (x2, "x2"), (y1, "y1"), (y2, "y2"))]
        left, right = s.op("Sub", [x2, xx], "left"), s.op("Sub", [xx, x1], "right")

        def row(y, hint):
            return s.op("Add", [s.op("Mul", [left, s.pixels(y, safe[0], hint + "_a")], hint + "_la"),
                                s.op("Mul", [right, s.pixels(y, safe[1], hint + "_b")], hint + "_rb")], hint)
        upper, lower = row(safe[2], "upper"), row(safe[3], "lower")
        warped = s.op("Add", [s.op("Mul", [s.op("Sub", [y2, yy], "wy2"), upper], "up"),
                              s.op("Mul", [s.op("Sub", [yy, y1], "wy1"), lower], "low")], "warped")
        ctx.add_node("Where", [inside, warped, s.f32(0)], [node.outputs[0]], name=node.name)

    @staticmethod
    def _trunc(s, t):
        """Rounding towards zero: floor for t >= 0, ceil below."""
        return s.op("Where", [s.op("Less", [t, s.f32(0)], "neg"), s.op("Ceil", [t], "ceil"),
                              s.op("Floor", [t], "floor")], "trunc")

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        emit.helper(flow_channel_by_pixel)
        return f"{emit.helper(garg_warp)}({', '.join(emit.inputs)})"


@register_layer("Mirror")
class Mirror(Layer):
    def parse(self, lp):
        need_blobs(lp, "Mirror", 1, 1, in_place=False)
        return {}

    def infer(self, attrs, in_shapes):
        legacy_nchw(in_shapes[0], "Mirror")
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x):
        return x.flip(-1) if x.dim() == 4 else x.reshape(legacy_nchw(x.shape, "Mirror")).flip(-1).reshape(x.shape)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        shape = ctx.shape(x)
        nchw = ctx.op("Reshape", [x, ctx.i64(list(legacy_nchw(shape, "Mirror")))], "nchw", name=node.name)
        flipped = ctx.op("Slice", [nchw, ctx.i64([-1]), ctx.i64([-(2 ** 63)]), ctx.i64([3]), ctx.i64([-1])], "flip")
        ctx.add_node("Reshape", [flipped, ctx.i64(list(shape))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        shape = emit.in_shape(0)
        x = emit.inputs[0]
        if len(shape) == 4:
            return f"{x}.flip(-1)"
        return f"{x}.reshape({tuple(legacy_nchw(shape, 'Mirror'))}).flip(-1).reshape({x}.shape)"
