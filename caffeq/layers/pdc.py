"""ljn114514/PDC-ICCV2017's layers (4382331, caffe_PDC/src/caffe/layers/point_transformer_layer.cpp and
local_fully_connected_layer.cpp / .cu).

- PointTransformer (pt_param transform_type CROP | AFFINE, inv_trans [false]; in_/out_ width and height
  are read for its debug output only): bottoms landmarks (N, 2P, ...: the P x values, then the P y
  values) and the localisation parameters (N, >= 4 for CROP, >= 6 for AFFINE); top (N, 2P, 1, 1).
  CROP:   inv_trans x' = x p2 + p3, y' = y p0 + p1; else x' = (x - p3) / (p2 + 0.00001), y' likewise with
          p1, p0.
  AFFINE: inv_trans x' = y p3 + x p4 + p5, y' = y p0 + x p1 + p2; else the inverse of that map,
          x' = (x p0 - y p3 - p0 p5 + p2 p3) / (p0 p4 - p1 p3 + 0.00001) and
          y' = (x p1 - y p4 - p1 p5 + p2 p4) / (p1 p3 - p0 p4 + 0.00001).
  The products and sums are float; the 0.00001 is a double, so the denominators and the division are
  double, rounded to float on the store.
- LocalFullyConnected (inner_product_param num_output N, bias_term): a separate inner product per
  channel of a 4-axis bottom (M, C, H, W): top (M, C x N), top[m, c N + n] = sum over the channel's
  K = H x W values x[m, c, k] W[c K + k, n] + b[c N + n]; blobs W (C K, N) and b (C N).
"""
import math

import numpy as np
import torch

from .registry import Layer, LayerError, need_blobs, positive_field, register_layer

CROP, AFFINE = 0, 1


def transform_points(points, theta, affine: bool, inverse: bool):
    """PointTransformer: (N, 2P) landmarks through (N, >= 4 or 6) parameters -> (N, 2P)."""
    p = points.shape[1] // 2
    x, y = points[:, :p], points[:, p:2 * p]
    t = [theta[:, k:k + 1] for k in range(6 if affine else 4)]
    eps = torch.tensor(0.00001, dtype=torch.float64, device=points.device)

    def divide(num, den):   # float numerator over a double denominator, stored as float
        return (num.double() / (den.double() + eps)).to(points.dtype)
    if not affine and inverse:
        nx, ny = x * t[2] + t[3], y * t[0] + t[1]
    elif not affine:
        nx, ny = divide(x - t[3], t[2]), divide(y - t[1], t[0])
    elif inverse:
        nx, ny = y * t[3] + x * t[4] + t[5], y * t[0] + x * t[1] + t[2]
    else:
        nx = divide(x * t[0] - y * t[3] - t[0] * t[5] + t[2] * t[3], t[0] * t[4] - t[1] * t[3])
        ny = divide(x * t[1] - y * t[4] - t[1] * t[5] + t[2] * t[4], t[1] * t[3] - t[0] * t[4])
    return torch.cat([nx, ny], 1)


@register_layer("PointTransformer")
class PointTransformer(Layer):
    def parse(self, lp):
        need_blobs(lp, "PointTransformer", 2, 1, "landmarks, parameters")
        p = lp.pt_param
        if p.in_width < 1 or p.in_height < 1:   # the fork's CHECK_GTs
            raise LayerError(f"pt_param.in_width and in_height must be > 0, got {p.in_width} and {p.in_height}")
        return {"affine": p.transform_type == AFFINE, "inverse": bool(p.inv_trans)}

    def infer(self, attrs, in_shapes):
        pts, theta = tuple(in_shapes[0]), tuple(in_shapes[1])
        need = 6 if attrs["affine"] else 4
        if len(pts) < 2 or math.prod(pts[1:]) != pts[1] or pts[1] % 2 or pts[1] < 2:
            raise LayerError(f"PointTransformer takes landmarks (N, 2P) (x values, then y values), got {list(pts)}")
        if len(theta) < 2 or theta[0] != pts[0] or math.prod(theta[1:]) < need:
            raise LayerError(f"PointTransformer's {'AFFINE' if attrs['affine'] else 'CROP'} reads {need} parameters "
                             f"per image, got {list(theta)} for landmarks {list(pts)}")
        return [(pts[0], pts[1], 1, 1)]

    def forward(self, attrs, params, points, theta):
        n = points.shape[0]
        out = transform_points(points.reshape(n, -1), theta.reshape(n, -1), attrs["affine"], attrs["inverse"])
        return out.reshape(n, -1, 1, 1)

    def onnx(self, ctx, node):
        a = node.attrs
        pts, theta = node.inputs
        n, c = ctx.shape(pts)[:2]
        op = ctx.op
        flat = op("Reshape", [pts, ctx.i64([n, c])], "pts")
        params = op("Reshape", [theta, ctx.i64([n, -1])], "theta")
        x = op("Slice", [flat, ctx.i64([0]), ctx.i64([c // 2]), ctx.i64([1])], "x")
        y = op("Slice", [flat, ctx.i64([c // 2]), ctx.i64([c]), ctx.i64([1])], "y")
        t = [op("Slice", [params, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], f"t{k}")
             for k in range(6 if a["affine"] else 4)]

        def mul(u, v, hint):
            return op("Mul", [u, v], hint)

        def add(u, v, hint):
            return op("Add", [u, v], hint)

        def sub(u, v, hint):
            return op("Sub", [u, v], hint)

        def divide(num, den, hint):
            d = op("Add", [op("Cast", [den], hint + "_d64", to=11), ctx.const(np.float64(0.00001))],
                   hint + "_den")
            return op("Cast", [op("Div", [op("Cast", [num], hint + "_n64", to=11), d], hint + "_q")], hint, to=1)
        if not a["affine"] and a["inverse"]:
            nx, ny = add(mul(x, t[2], "xs"), t[3], "nx"), add(mul(y, t[0], "ys"), t[1], "ny")
        elif not a["affine"]:
            nx, ny = divide(sub(x, t[3], "xc"), t[2], "nx"), divide(sub(y, t[1], "yc"), t[0], "ny")
        elif a["inverse"]:
            nx = add(add(mul(y, t[3], "y3"), mul(x, t[4], "x4"), "s"), t[5], "nx")
            ny = add(add(mul(y, t[0], "y0"), mul(x, t[1], "x1"), "s"), t[2], "ny")
        else:
            nx = divide(add(sub(sub(mul(x, t[0], "a"), mul(y, t[3], "b"), "ab"), mul(t[0], t[5], "c"), "abc"),
                            mul(t[2], t[3], "d"), "num"), sub(mul(t[0], t[4], "e"), mul(t[1], t[3], "f"), "den"), "nx")
            ny = divide(add(sub(sub(mul(x, t[1], "a"), mul(y, t[4], "b"), "ab"), mul(t[1], t[5], "c"), "abc"),
                            mul(t[2], t[4], "d"), "num"), sub(mul(t[1], t[3], "e"), mul(t[0], t[4], "f"), "den"), "ny")
        both = op("Concat", [nx, ny], "xy", axis=1)
        ctx.add_node("Reshape", [both, ctx.i64([n, c, 1, 1])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(transform_points)
        x, t = emit.inputs
        a = node.attrs
        return (f"{fn}({x}.reshape({x}.shape[0], -1), {t}.reshape({t}.shape[0], -1), {a['affine']}, "
                f"{a['inverse']}).reshape({x}.shape[0], -1, 1, 1)")


def local_fully_connected(x, weight, bias):
    """LocalFullyConnected: channel c's H x W values through its own (K, N) block of weight (C K, N)."""
    m, c = x.shape[0], x.shape[1]
    out = torch.einsum("mck,ckn->mcn", x.reshape(m, c, -1), weight.reshape(c, -1, weight.shape[1]))
    out = out.reshape(m, -1)
    return out if bias is None else out + bias


@register_layer("LocalFullyConnected")
class LocalFullyConnected(Layer):
    weight_axes = {0: 1}

    def parse(self, lp):
        need_blobs(lp, "LocalFullyConnected", 1, 1)
        p = lp.inner_product_param
        return {"num_output": positive_field(p.num_output, "inner_product_param.num_output"),
                "bias_term": bool(p.bias_term)}

    def blob_names_for(self, attrs):
        return ("weight", "bias") if attrs["bias_term"] else ("weight",)

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"LocalFullyConnected takes a 4-axis bottom (the fork's check), got {list(s)}")
        return [(s[0], s[1] * attrs["num_output"])]

    def param_shapes(self, attrs, in_shapes):
        _, c, h, w = in_shapes[0]
        n = attrs["num_output"]
        return [(c * h * w, n)] + ([(c * n,)] if attrs["bias_term"] else [])

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(in_shapes[0]) * attrs["num_output"]

    def forward(self, attrs, params, x):
        return local_fully_connected(x, params[0], params[1] if attrs["bias_term"] else None)

    def onnx(self, ctx, node):
        m, c, h, w = ctx.shape(node.inputs[0])
        n = node.attrs["num_output"]
        xs = ctx.op("Transpose", [ctx.op("Reshape", [node.inputs[0], ctx.i64([m, c, h * w])], "x3")], "cmk",
                    perm=[1, 0, 2])
        ws = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([c, h * w, n])], "w3")
        out = ctx.op("Reshape", [ctx.op("Transpose", [ctx.op("MatMul", [xs, ws], "cmn")], "mcn", perm=[1, 0, 2]),
                                 ctx.i64([m, c * n])], "flat")
        if node.attrs["bias_term"]:
            ctx.add_node("Add", [out, ctx.weight(node, 1)], [node.outputs[0]])
        else:
            ctx.add_node("Identity", [out], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.blob_parameters(self.blob_names_for(node.attrs))
        bias = f"{m}['bias']" if node.attrs["bias_term"] else "None"
        return f"{emit.helper(local_fully_connected)}({emit.inputs[0]}, {m}['weight'], {bias})"
