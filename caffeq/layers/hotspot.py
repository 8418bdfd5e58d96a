"""tiandunc/caffe-windows (6728348) Hotspot: src/caffe/layers/hotspot_layer.cpp, hotspot_layer.cu,
include/caffe/layers/hotspot_layer.hpp; hotspot_param (src/caffe/proto/caffe.proto: HotspotParameter
gaussian_std = 1 [1], output_height = 2 [0], output_width = 3 [0], data_height = 4, data_width = 5,
mean_removed = 6 [true]; 151 there, box_output_param here: 111151).

Bottom 0 holds P = C / 2 points (x, y) per sample (C, its legacy channels, must be even); the fork reads them
at flat offset n C + 2 i (+ 1), whatever the axes after C.  data_height and data_width must be set (> 0).
The top is (N, P, H, W): output_height x output_width, or, where their product is 0, bottom 1's (legacy)
height and width (then exactly 2 bottoms, the fork's CHECK).  Bottom 1's values are never read.
Per point, in the fork's types: px = float((double(float(x / data_width)) + 0.5 [0 without mean_removed]) * W),
py likewise with y, data_height, H; d2 = float((px - w)^2 + (py - h)^2);
g = float(0.5 / s / s / pi * exp(-0.5 d2 / s / s)) in double, s = gaussian_std; top = g where g > float(1e-4),
else 0.  gaussian_std 0 (an all-zero map in the fork) is refused.  CPU and GPU forwards compute the same.
"""
import math

import numpy as np
import torch

from .registry import AT_LEAST, Layer, LayerError, legacy_nchw, need_blobs, register_layer

F32 = np.float32
CV_PI = 3.1415926535897932384626433832795


def hotspot_maps(points, num_point: int, height: int, width: int, std: float, data_height: int,
                 data_width: int, offset: float):
    """The fork's Gaussian heat map per point: (N, num_point, height, width) float32."""
    n = points.shape[0]
    flat = points.reshape(-1)[:n * 2 * num_point].reshape(n, num_point, 2)
    px = ((flat[:, :, 0] / float(data_width)).double() + offset) * float(width)
    py = ((flat[:, :, 1] / float(data_height)).double() + offset) * float(height)
    px, py = px.float()[:, :, None, None], py.float()[:, :, None, None]
    gx = torch.arange(width, device=points.device, dtype=torch.float32).reshape(1, 1, 1, width)
    gy = torch.arange(height, device=points.device, dtype=torch.float32).reshape(1, 1, height, 1)
    d2 = (px - gx) * (px - gx) + (py - gy) * (py - gy)
    coef = 0.5 / std / std / 3.1415926535897932384626433832795
    g = (coef * torch.exp(d2.double() * -0.5 / std / std)).float()
    return torch.where(g > torch.tensor(1e-4, dtype=torch.float32, device=g.device), g, torch.zeros_like(g))


@register_layer("Hotspot")
class Hotspot(Layer):
    def parse(self, lp):
        need_blobs(lp, "Hotspot", range(1, AT_LEAST), 1, "points, size reference")
        p = lp.hotspot_param
        std = float(F32(p.gaussian_std))
        if std == 0 or not math.isfinite(std):
            raise LayerError(f"hotspot_param.gaussian_std must be finite and not 0 (the fork's map is all 0 or "
                             f"NaN otherwise), got {std}")
        if int(p.data_height) * int(p.data_width) <= 0:
            raise LayerError(f"hotspot_param.data_height and data_width must be set (> 0), got "
                             f"{p.data_height} and {p.data_width} (the fork's CHECK)")
        size = (int(p.output_height), int(p.output_width))
        if size[0] * size[1] == 0:
            if len(lp.bottom) != 2:
                raise LayerError(f"Hotspot without output_height and output_width takes its size from a second "
                                 f"bottom: exactly 2 bottoms (the fork's CHECK), got {len(lp.bottom)}")
            size = None
        return {"std": std, "size": size, "data_height": int(p.data_height), "data_width": int(p.data_width),
                "offset": 0.5 if p.mean_removed else 0.0}

    def infer(self, attrs, in_shapes):
        n, c = legacy_nchw(in_shapes[0], "Hotspot")[:2]
        if c % 2:
            raise LayerError(f"Hotspot's points bottom {list(in_shapes[0])} must have an even channel count (x, y "
                             f"per point; the fork's CHECK), got {c}")
        h, w = attrs["size"] or legacy_nchw(in_shapes[1], "Hotspot")[2:]
        attrs["out_size"] = (int(h), int(w))
        return [(n, c // 2, int(h), int(w))]

    def _args(self, attrs, in_shape):
        h, w = attrs["out_size"]
        return (legacy_nchw(in_shape, "Hotspot")[1] // 2, h, w, attrs["std"], attrs["data_height"],
                attrs["data_width"], attrs["offset"])

    def forward(self, attrs, params, points, *rest):
        return hotspot_maps(points, *self._args(attrs, tuple(points.shape)))

    def onnx(self, ctx, node):
        from onnx import TensorProto
        p, h, w, std, dh, dw, offset = self._args(node.attrs, ctx.shape(node.inputs[0]))
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "flat", name=node.name)
        batch = ctx.op("Slice", [ctx.op("Shape", [node.inputs[0]], "shape"), ctx.i64([0]), ctx.i64([1])], "batch")
        # the first N 2P values: sample n's points at n 2P, as the fork's flat offsets
        flat = ctx.op("Slice", [flat, ctx.i64([0]), ctx.op("Mul", [batch, ctx.i64([2 * p])], "used")], "used_points")
        pts = ctx.op("Reshape", [flat, ctx.i64([-1, p, 2])], "points")

        def coordinate(index, data_size, size, hint, shape):
            v = ctx.op("Gather", [pts, ctx.i64(index)], f"{hint}_raw", axis=2)
            v = ctx.op("Cast", [ctx.op("Div", [v, ctx.f32(F32(data_size))], f"{hint}_scaled")], f"{hint}_d",
                       to=TensorProto.DOUBLE)
            v = ctx.op("Mul", [ctx.op("Add", [v, ctx.const(np.float64(offset))], f"{hint}_shift"),
                               ctx.const(np.float64(size))], f"{hint}_pos")
            v = ctx.op("Cast", [v], f"{hint}_f", to=TensorProto.FLOAT)
            v = ctx.op("Reshape", [v, ctx.i64([-1, p, 1, 1])], f"{hint}_4d")
            grid = ctx.const(np.arange(size, dtype=np.float32).reshape(shape), f"{node.name}_{hint}_grid")
            d = ctx.op("Sub", [v, grid], f"{hint}_diff")
            return ctx.op("Mul", [d, d], f"{hint}_sq")

        d2 = ctx.op("Add", [coordinate(0, dw, w, "x", (1, 1, 1, w)), coordinate(1, dh, h, "y", (1, 1, h, 1))], "d2")
        e = ctx.op("Div", [ctx.op("Div", [ctx.op("Mul", [ctx.op("Cast", [d2], "d2_d", to=TensorProto.DOUBLE),
                                                         ctx.const(np.float64(-0.5))], "half"),
                                          ctx.const(np.float64(std))], "e1"), ctx.const(np.float64(std))], "e2")
        coef = 0.5 / std / std / CV_PI
        g = ctx.op("Cast", [ctx.op("Mul", [ctx.const(np.float64(coef)), ctx.op("Exp", [e], "exp")], "g_d")], "g",
                   to=TensorProto.FLOAT)
        ctx.add_node("Where", [ctx.op("Greater", [g, ctx.f32(F32(1e-4))], "kept"), g, ctx.f32(0.0)],
                     [node.outputs[0]])

    def pytorch_source(self, node, emit):
        p, h, w, std, dh, dw, offset = self._args(node.attrs, emit.in_shape(0))
        return (f"{emit.helper(hotspot_maps)}({emit.inputs[0]}, {p}, {h}, {w}, {emit.lit(std, exact=True)}, {dh}, "
                f"{dw}, {emit.lit(offset, exact=True)})")


__all__ = ["Hotspot", "hotspot_maps"]
