"""shaoxiaohu/Face_Alignment_Two_Stage_Re-initialization's layers (CVPR 2017; ccd26fe, caffe/src/caffe/proto/
caffe.proto, caffe/src/caffe/layers/subsample_pooling_layer.cpp and point_transformer_layer.cpp).

- SubsamplePooling (subsample_pooling_param output_H [60], output_W [60]): an average over a grid of bins
  (4-axis bottom, top (N, C, output_H, output_H)).  The fork sets both output sizes from output_H and never
  reads output_W.  With the float bin sizes bh = float(H) / float(output_H) and bw likewise, bin (i, j)
  covers rows floor(float(i) bh) .. ceil(float(i + 1) bh) - 1 and columns floor(float(j) bw) ..
  ceil(float(j + 1) bw) - 1 (each end clipped to the image), all in float32: bins overlap where a bin
  size is not whole; the top is the bin's sum over its element count.  The fork has a CPU forward only (the
  GPU runs it through the default Forward_gpu).
- PointTransformer, this fork's version (claimed where pt_param has neither in_width nor in_height, which
  ljn114514/PDC-ICCV2017's layer requires (caffeq/layers/pdc.py), or sets SIMILAR or sampler_type, which
  only this fork declares): landmarks interleaved (x0, y0, x1, y1, ...) in the first 2 (C // 2) values of
  each item of bottom 0, the parameters p0.. the first values of each item of bottom 1; the top is shaped
  like bottom 0, its other values 0.  All float32, no epsilon:
  CROP     inv_trans x' = x p2 + p3, y' = y p0 + p1;  else x' = (x - p3) / p2, y' = (y - p1) / p0.
  AFFINE   inv_trans x' = y p3 + x p4 + p5, y' = y p0 + x p1 + p2;
           else x' = (x p0 - y p3 - p0 p5 + p2 p3) / (p0 p4 - p1 p3), y' = (x p1 - y p4 - p1 p5 + p2 p4) /
           (p1 p3 - p0 p4).
  SIMILAR  inv_trans x' = -y p1 + x p0 + p3, y' = y p0 + x p1 + p2;
           else x' = (x p0 + y p1 - p0 p3 - p2 p1) / (p0 p0 + p1 p1), y' = (x p1 - y p0 - p1 p3 + p2 p0) /
           (-p1 p1 - p0 p0).
  sampler_type is declared and never read.

The fork's SpatialTransformer (st_layer.cpp / .cu) is daerduoCarey's (caffeq/layers/spatial_transformer.py);
its CPU forward (whose CHECK the fork comments out) ignores st_param's fixed theta entries, which its nets
do not set.  Its FacialPointData (images and landmarks from a list file) and LocLoss (a training penalty on
theta) are read as a data layer and a loss.
"""
import math

import numpy as np
import torch

from .registry import Layer, LayerError, claim_layers, four_axes, need_blobs, positive_field, register_layer

CROP, AFFINE, SIMILAR = 0, 1, 2
_NEEDS = {CROP: 4, AFFINE: 6, SIMILAR: 4}
_NAMES = {CROP: "CROP", AFFINE: "AFFINE", SIMILAR: "SIMILAR"}


def subsample_bins(size, out):
    """The fork's bins along one axis: [(start, end)] from float32 bin sizes (floor / ceil, clipped)."""
    f = np.float32
    step = f(size) / f(out)
    bins = []
    for i in range(out):
        start = min(int(np.floor(f(i) * step)), size)
        end = min(int(np.ceil(f(i + 1) * step)), size)
        bins.append((start, end))
    return bins


def subsample_pool(x, hbins: list, wbins: list):
    """SubsamplePooling: each bin's sum over its element count, bins given as [(start, end)] per axis."""
    rows = torch.zeros(len(hbins), x.shape[2], dtype=x.dtype, device=x.device)
    for i, (s, e) in enumerate(hbins):
        rows[i, s:e] = 1
    cols = torch.zeros(x.shape[3], len(wbins), dtype=x.dtype, device=x.device)
    for j, (s, e) in enumerate(wbins):
        cols[s:e, j] = 1
    counts = torch.tensor([[float((he - hs) * (we - ws)) for ws, we in wbins] for hs, he in hbins],
                          dtype=x.dtype, device=x.device)
    return torch.matmul(torch.matmul(rows, x), cols) / counts


@register_layer("SubsamplePooling")
class SubsamplePooling(Layer):
    def parse(self, lp):
        need_blobs(lp, "SubsamplePooling", 1, 1)
        p = lp.subsample_pooling_param
        size = positive_field(p.output_H, "subsample_pooling_param.output_H")
        attrs = {"size": size}
        if p.output_W != p.output_H:
            attrs["reading_notes"] = [f"SubsamplePooling output_W {p.output_W} is not read: the fork sizes both "
                                      f"axes from output_H ({size})"]
        return attrs

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "SubsamplePooling")
        if h < 1 or w < 1:
            raise LayerError(f"SubsamplePooling needs a non-empty image, got {list(in_shapes[0])}")
        attrs["_hbins"] = subsample_bins(h, attrs["size"])
        attrs["_wbins"] = subsample_bins(w, attrs["size"])
        return [(n, c, attrs["size"], attrs["size"])]

    def _matrices(self, attrs, h, w):
        rows = np.zeros((len(attrs["_hbins"]), h), np.float32)
        for i, (s, e) in enumerate(attrs["_hbins"]):
            rows[i, s:e] = 1
        cols = np.zeros((w, len(attrs["_wbins"])), np.float32)
        for j, (s, e) in enumerate(attrs["_wbins"]):
            cols[s:e, j] = 1
        counts = np.array([[(he - hs) * (we - ws) for ws, we in attrs["_wbins"]] for hs, he in attrs["_hbins"]],
                          np.float32)
        return rows, cols, counts

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(in_shapes[0])

    def forward(self, attrs, params, x):
        return subsample_pool(x, attrs["_hbins"], attrs["_wbins"])

    def onnx(self, ctx, node):
        h, w = ctx.shape(node.inputs[0])[2:]
        rows, cols, counts = self._matrices(node.attrs, h, w)
        r = ctx.op("MatMul", [ctx.const(rows, "rows"), node.inputs[0]], "row_sums")
        s = ctx.op("MatMul", [r, ctx.const(cols, "cols")], "bin_sums")
        ctx.add_node("Div", [s, ctx.const(counts, "counts")], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(subsample_pool)}({emit.inputs[0]}, {a['_hbins']!r}, {a['_wbins']!r})"


def transform_points_interleaved(points, theta, p: int, kind: int, inverse: bool):
    """This fork's PointTransformer on flat items: points (N, K) with p (x, y) pairs in its first 2 p
    values, theta (N, >= 4 or 6) -> (N, K), the values after the pairs 0."""
    n, k = points.shape
    x, y = points[:, 0:2 * p:2], points[:, 1:2 * p:2]
    t = [theta[:, i:i + 1] for i in range(6 if kind == 1 else 4)]
    if kind == 0 and inverse:
        nx, ny = x * t[2] + t[3], y * t[0] + t[1]
    elif kind == 0:
        nx, ny = (x - t[3]) / t[2], (y - t[1]) / t[0]
    elif kind == 1 and inverse:
        nx, ny = y * t[3] + x * t[4] + t[5], y * t[0] + x * t[1] + t[2]
    elif kind == 1:
        nx = (x * t[0] - y * t[3] - t[0] * t[5] + t[2] * t[3]) / (t[0] * t[4] - t[1] * t[3])
        ny = (x * t[1] - y * t[4] - t[1] * t[5] + t[2] * t[4]) / (t[1] * t[3] - t[0] * t[4])
    elif inverse:
        nx, ny = -y * t[1] + x * t[0] + t[3], y * t[0] + x * t[1] + t[2]
    else:
        nx = (x * t[0] + y * t[1] - t[0] * t[3] - t[2] * t[1]) / (t[0] * t[0] + t[1] * t[1])
        ny = (x * t[1] - y * t[0] - t[1] * t[3] + t[2] * t[0]) / (-t[1] * t[1] - t[0] * t[0])
    pairs = torch.stack([nx, ny], 2).reshape(n, 2 * p)
    if 2 * p == k:
        return pairs
    return torch.cat([pairs, torch.zeros(n, k - 2 * p, dtype=points.dtype, device=points.device)], 1)


def _is_this_forks(lp):
    p = lp.pt_param
    return (not p.HasField("in_width") and not p.HasField("in_height")) or p.transform_type == SIMILAR \
        or p.HasField("sampler_type")


@claim_layers("PointTransformer", _is_this_forks)
class InterleavedPointTransformer(Layer):
    def parse(self, lp):
        need_blobs(lp, "PointTransformer", 2, 1, "landmarks, parameters")
        p = lp.pt_param
        return {"kind": int(p.transform_type), "inverse": bool(p.inv_trans)}

    def infer(self, attrs, in_shapes):
        pts, theta = tuple(in_shapes[0]), tuple(in_shapes[1])
        need = _NEEDS[attrs["kind"]]
        if len(pts) < 2 or pts[1] < 2:
            raise LayerError(f"PointTransformer takes landmarks (N, 2P, ...) as x, y pairs, got {list(pts)}")
        if len(theta) < 1 or theta[0] != pts[0] or math.prod(theta[1:]) < need:
            raise LayerError(f"PointTransformer's {_NAMES[attrs['kind']]} reads {need} parameters per image, "
                             f"got {list(theta)} for landmarks {list(pts)}")
        # the fork pairs the first 2 (C // 2) values of each item, C the landmarks' channels
        attrs["_pairs"] = pts[1] // 2
        return [pts]

    def forward(self, attrs, params, points, theta):
        n = points.shape[0]
        out = transform_points_interleaved(points.reshape(n, -1), theta.reshape(n, -1), attrs["_pairs"],
                                           attrs["kind"], attrs["inverse"])
        return out.reshape(points.shape)

    def onnx(self, ctx, node):
        a = node.attrs
        pts, theta = node.inputs
        shape = ctx.shape(pts)
        n, k = shape[0], math.prod(shape[1:])
        pairs = a["_pairs"]
        op = ctx.op
        flat = op("Reshape", [pts, ctx.i64([n, k])], "pts")
        xy = op("Reshape", [op("Slice", [flat, ctx.i64([0]), ctx.i64([2 * pairs]), ctx.i64([1])], "used"),
                            ctx.i64([n, pairs, 2])], "pairs")
        x = op("Reshape", [op("Slice", [xy, ctx.i64([0]), ctx.i64([1]), ctx.i64([2])], "x3"), ctx.i64([n, pairs])], "x")
        y = op("Reshape", [op("Slice", [xy, ctx.i64([1]), ctx.i64([2]), ctx.i64([2])], "y3"), ctx.i64([n, pairs])], "y")
        params = op("Reshape", [theta, ctx.i64([n, -1])], "theta")
        t = [op("Slice", [params, ctx.i64([i]), ctx.i64([i + 1]), ctx.i64([1])], f"t{i}")
             for i in range(_NEEDS[a["kind"]])]

        def mul(u, v):
            return op("Mul", [u, v], "mul")

        def add(u, v):
            return op("Add", [u, v], "add")

        def sub(u, v):
            return op("Sub", [u, v], "sub")

        def div(u, v):
            return op("Div", [u, v], "div")
        kind, inv = a["kind"], a["inverse"]
        if kind == CROP and inv:
            nx, ny = add(mul(x, t[2]), t[3]), add(mul(y, t[0]), t[1])
        elif kind == CROP:
            nx, ny = div(sub(x, t[3]), t[2]), div(sub(y, t[1]), t[0])
        elif kind == AFFINE and inv:
            nx = add(add(mul(y, t[3]), mul(x, t[4])), t[5])
            ny = add(add(mul(y, t[0]), mul(x, t[1])), t[2])
        elif kind == AFFINE:
            nx = div(add(sub(sub(mul(x, t[0]), mul(y, t[3])), mul(t[0], t[5])), mul(t[2], t[3])),
                     sub(mul(t[0], t[4]), mul(t[1], t[3])))
            ny = div(add(sub(sub(mul(x, t[1]), mul(y, t[4])), mul(t[1], t[5])), mul(t[2], t[4])),
                     sub(mul(t[1], t[3]), mul(t[0], t[4])))
        elif inv:
            nx = add(add(mul(op("Neg", [y], "neg_y"), t[1]), mul(x, t[0])), t[3])
            ny = add(add(mul(y, t[0]), mul(x, t[1])), t[2])
        else:
            nx = div(sub(sub(add(mul(x, t[0]), mul(y, t[1])), mul(t[0], t[3])), mul(t[2], t[1])),
                     add(mul(t[0], t[0]), mul(t[1], t[1])))
            ny = div(add(sub(sub(mul(x, t[1]), mul(y, t[0])), mul(t[1], t[3])), mul(t[2], t[0])),
                     sub(mul(op("Neg", [t[1]], "neg_p1"), t[1]), mul(t[0], t[0])))
        both = op("Reshape", [op("Concat", [op("Unsqueeze", [nx, ctx.i64([2])], "nx3"),
                                            op("Unsqueeze", [ny, ctx.i64([2])], "ny3")], "xy", axis=2),
                              ctx.i64([n, 2 * pairs])], "moved")
        if 2 * pairs < k:
            both = op("Concat", [both, ctx.const(np.zeros((n, k - 2 * pairs), np.float32), "rest")], "filled", axis=1)
        ctx.add_node("Reshape", [both, ctx.i64(list(shape))], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        fn = emit.helper(transform_points_interleaved)
        x, t = emit.inputs
        a = node.attrs
        return (f"{fn}({x}.reshape({x}.shape[0], -1), {t}.reshape({t}.shape[0], -1), {a['_pairs']}, {a['kind']}, "
                f"{a['inverse']}).reshape({x}.shape)")


__all__ = ["InterleavedPointTransformer", "SubsamplePooling"]
