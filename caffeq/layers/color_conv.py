"""ColorConv (color_conv_layer.cpp / .cu as tinghuiz/appearance-flow b20a0dd carries it; richzhang's
caffe-colorization, whose colorization and split-brain nets read Lab from it): a colour space conversion of
(N, 3, H, W) images, 0..255 BGR as Caffe reads them.

RGB (BGR with its planes swapped) to XYZ: each value / 255 linearized (v / 12.92 up to 0.04045, else
((v + 0.055) / 1.055)^2.4), then the sRGB matrix.  XYZ to Lab: each of X, Y, Z over the fork's white point
(0.95074 -- the D65 0.95047 with two digits swapped -- 1, 1.08883), f(v) = v^(1/3) above 0.008867, else
(903.3 v + 16) / 116; L = 116 f(Y) - 16, a = 500 (f(X) - f(Y)), b = 200 (f(Y) - f(Z)).  All in float32,
nothing clamped.  The fork's CPU forward converts only the first image of a batch (a return inside its
loop); its GPU forward, the one a GPU build runs and caffeq follows, converts them all.  No blobs.
torch, ONNX, model.py.
"""
import numpy as np
import torch

from ..io.schema import caffe_pb2
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources

SPACES = caffe_pb2.ColorConvParameter
def srgb_to_xyz_matrix():
    return ((0.4124564, 0.3575761, 0.1804375), (0.2126729, 0.7151522, 0.0721750), (0.0193339, 0.1191920, 0.9503041))


def white_point():
    """The fork's "Reference white D65"."""
    return (0.95074, 1.0, 1.08883)


def rgb_to_xyz(r, g, b):
    """The linearized channels through the sRGB matrix, each sum left to right in float32."""
    def linear(v):
        v = v / 255.0
        return torch.where(v <= 0.04045, v / 12.92, torch.pow((v + 0.055) / 1.055, 2.4))

    lin = (linear(r), linear(g), linear(b))
    return tuple((row[0] * lin[0] + row[1] * lin[1]) + row[2] * lin[2] for row in srgb_to_xyz_matrix())


def xyz_to_lab(x, y, z):
    def f(v):
        return torch.where(v > 0.008867, torch.pow(v, 1.0 / 3), (903.3 * v + 16) / 116)

    white = white_point()
    fx, fy, fz = f(x / white[0]), f(y / white[1]), f(z / white[2])
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def color_conv(images, bgr: bool, lab: bool):
    """(N, 3, H, W) RGB or BGR images (0..255) as XYZ or Lab planes."""
    planes = images.unbind(1)
    r, g, b = (planes[2], planes[1], planes[0]) if bgr else planes
    out = rgb_to_xyz(r, g, b)
    return torch.stack(xyz_to_lab(*out) if lab else out, 1)


TORCH_COLOR_CONV = torch_sources(srgb_to_xyz_matrix, white_point, rgb_to_xyz, xyz_to_lab, color_conv)


@register_layer("ColorConv")
class ColorConv(Layer):
    def parse(self, lp):
        need_blobs(lp, "ColorConv", 1, 1)
        p = lp.color_conv_param
        if p.input not in (SPACES.BGR, SPACES.RGB) or p.output not in (SPACES.XYZ, SPACES.Lab):
            raise LayerError(f"ColorConv from {SPACES.ColorSpace.Name(p.input)} to {SPACES.ColorSpace.Name(p.output)}: "
                             f"caffeq converts BGR or RGB to XYZ or Lab (the conversions the colorization nets use)")
        return {"bgr": p.input == SPACES.BGR, "lab": p.output == SPACES.Lab}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "ColorConv")
        if c != 3:
            raise LayerError(f"ColorConv converts 3-channel images, got {list(in_shapes[0])}")
        return [(n, 3, h, w)]

    def forward(self, attrs, params, x):
        return color_conv(x, attrs["bgr"], attrs["lab"])

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_COLOR_CONV)
        return f"color_conv({emit.inputs[0]}, {node.attrs['bgr']}, {node.attrs['lab']})"

    def onnx(self, ctx, node):
        a = node.attrs

        def c(v):
            return ctx.f32(float(np.float32(v)))

        def plane(k):
            return ctx.op("Slice", [node.inputs[0], ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], f"plane{k}")

        def linear(v, hint):
            v = ctx.op("Div", [v, c(255.0)], hint)
            low = ctx.op("Div", [v, c(12.92)], hint + "_low")
            high = ctx.op("Pow", [ctx.op("Div", [ctx.op("Add", [v, c(0.055)], hint), c(1.055)], hint), c(2.4)],
                          hint + "_high")
            return ctx.op("Where", [ctx.op("LessOrEqual", [v, c(0.04045)], hint), low, high], hint + "_lin")

        rgb = [plane(2), plane(1), plane(0)] if a["bgr"] else [plane(0), plane(1), plane(2)]
        lin = [linear(v, f"lin{k}") for k, v in enumerate(rgb)]
        xyz = []
        for k, row in enumerate(srgb_to_xyz_matrix()):
            terms = [ctx.op("Mul", [c(w), lin[i]], f"xyz{k}_{i}") for i, w in enumerate(row)]
            xyz.append(ctx.op("Add", [ctx.op("Add", terms[:2], f"xyz{k}"), terms[2]], f"xyz{k}"))
        if a["lab"]:
            def f(v, hint):
                cube = ctx.op("Pow", [v, c(1.0 / 3)], hint + "_cube")
                lin_part = ctx.op("Div", [ctx.op("Add", [ctx.op("Mul", [c(903.3), v], hint), c(16.0)], hint),
                                          c(116.0)], hint + "_lin")
                return ctx.op("Where", [ctx.op("Greater", [v, c(0.008867)], hint), cube, lin_part], hint + "_f")

            fx, fy, fz = (f(ctx.op("Div", [v, c(white_point()[k])], f"w{k}"), f"f{k}") for k, v in enumerate(xyz))
            xyz = [ctx.op("Sub", [ctx.op("Mul", [c(116.0), fy], "l"), c(16.0)], "L"),
                   ctx.op("Mul", [c(500.0), ctx.op("Sub", [fx, fy], "a")], "a"),
                   ctx.op("Mul", [c(200.0), ctx.op("Sub", [fy, fz], "b")], "b")]
        ctx.add_node("Concat", xyz, [node.outputs[0]], name=node.name, axis=1)
