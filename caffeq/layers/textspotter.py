"""Layers of tonghe90/textspotter's Caffe fork (He et al., "An end-to-end TextSpotter with explicit alignment
and attention"): HEAD aa36bbc, caffe/src/caffe/proto/caffe.proto, and the earlier tree b552331 for the
example net caffe/examples/text_detect/e2e_best.pt.

- ReverseAxis (caffe/src/caffe/layers/reverse_axis_layer.cpp/.cu; reverse_axis_param.axis [0], >= 0 and
  below the bottom's axis count): the bottom with its slices along `axis` in reverse order (index i goes to
  n - 1 - i); not in place.
- PointBilinear (point_bilinear_layer.cpp, CPU only; point_bilinear_param.ratio [0.25], > 0): bottoms a feature
  map (N, C, H, W), points (P, 2, ...) read as P pairs (x, y) from the blob's first 2P values, and optionally
  P image indexes (truncated to int); top (P, C, 1, 1).  Each point samples channel c of its image at
  (h, w) = (y ratio, x ratio) in float32: h and w below 0 become 0, h_low = int(h), and where h_low >= H - 1
  both rows are H - 1 and h = H - 1 (likewise w); weights (1 - lh)(1 - lw), (1 - lh) lw, lh (1 - lw), lh lw
  on (low, low), (low, high), (high, low), (high, high), added in that order.
- AttLstm (attention_lstm_layer.cpp, an unrolled RecurrentLayer; recurrent_param.num_output D): bottoms x
  (T, N, C, E) and cont (T, N); tops h (T, N, D) and the attention weights (T, N, E, 1).  Its blobs are
  the unrolled net's in first-use order: W_s (D, D), b_s (D), W_f_ej (D, C), b_f_ej (D), W_att_ej1 (1, D),
  W_xc_input (4D, C), b_c_input (4D), W_hc (4D, D), then W_att_ej2 ... W_att_ejT (1, D) (one per step).
  Read and sized, not run (see why_not_run).
- AffineTransformer (b552331 at_layer.cpp, GPU forward at_layer.cu; at_param output_h [8], output_w, theta,
  cont { shift scale }): bottoms U (S, C, H, W), theta (S, P, 6, ...) and, without output_w, widths (S, P);
  tops V (S P, C, output_h, W') and one (T, S P) per cont, T = W' divided by scale and plus shift in turn.
  W' is output_w or the largest of output_h and the widths (values: the shape is data-dependent).  Sized,
  not run.
- StandardCTC (b552331 standard_ctc_layer.cpp: warp-ctc loss at TRAIN, (T, N) greedy paths at TEST) and
  AccuracyText (accuracy_text_layer.cpp: sequence and edit-distance accuracy against a dictionary file):
  training and evaluation layers, sized and dropped from inference graphs.
- BatchNormData, ScaleData, InnerProductData: named in e2e_best.pt and in b552331's sequence_layers.hpp but
  with no source in the repository; sized as BVLC's BatchNorm, Scale and InnerProduct (the fork's
  ConvolutionData is Convolution), not run.
"""
import numpy as np
import torch

from ..io.schema import caffe_pb2
from .conv import InnerProduct
from .elementwise import Scale
from .norm import BatchNorm
from .registry import Layer, LayerError, MissingInputShape, ReadOnlyLayer, need_blobs, positive_field, register_layer
from .sequence import Reverse

_FORK = "tonghe90/textspotter"


@register_layer("ReverseAxis")
class ReverseAxis(Reverse):
    param_field = "reverse_axis_param"
    top_count = 1


def point_bilinear(feature, points, ids, ratio: float):
    """textspotter's PointBilinear: one bilinear sample of every channel per point (x, y), at (y, x) * ratio."""
    n, c, h, w = feature.shape
    p = points.reshape(-1)[: 2 * (points.shape[0])].reshape(-1, 2)
    r = torch.tensor(ratio, dtype=feature.dtype)
    x = torch.clamp(p[:, 0] * r, min=0.0)
    y = torch.clamp(p[:, 1] * r, min=0.0)
    x = torch.minimum(x, torch.tensor(float(w - 1), dtype=feature.dtype))
    y = torch.minimum(y, torch.tensor(float(h - 1), dtype=feature.dtype))
    x0, y0 = torch.floor(x), torch.floor(y)
    lw, lh = x - x0, y - y0
    hw, hh = 1.0 - lw, 1.0 - lh
    xl = x0.long()
    yl = y0.long()
    xh = torch.clamp(xl + 1, max=w - 1)
    yh = torch.clamp(yl + 1, max=h - 1)
    if ids is None:
        base = torch.zeros_like(xl)
    else:
        base = ids.reshape(-1)[: p.shape[0]].long() * (h * w)
    rows = feature.permute(0, 2, 3, 1).reshape(n * h * w, c)
    v1 = rows[base + yl * w + xl]
    v2 = rows[base + yl * w + xh]
    v3 = rows[base + yh * w + xl]
    v4 = rows[base + yh * w + xh]
    w1, w2, w3, w4 = (hh * hw)[:, None], (hh * lw)[:, None], (lh * hw)[:, None], (lh * lw)[:, None]
    out = w1 * v1 + w2 * v2 + w3 * v3 + w4 * v4
    return out.reshape(p.shape[0], c, 1, 1)


@register_layer("PointBilinear")
class PointBilinear(Layer):

    def parse(self, lp):
        need_blobs(lp, "PointBilinear", (2, 3), 1, "feature, points, image indexes")
        ratio = float(torch.tensor(lp.point_bilinear_param.ratio, dtype=torch.float32))
        if not ratio > 0:
            raise LayerError(f"point_bilinear_param.ratio must be > 0, got {ratio}")
        return {"ratio": ratio}

    def infer(self, attrs, in_shapes):
        f, pts = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(f) != 4:
            raise LayerError(f"PointBilinear reads a (N, C, H, W) feature map, got {list(f)}")
        if len(pts) < 2 or pts[1] != 2:
            raise LayerError(f"PointBilinear's points must be (P, 2, 1, 1), got {list(pts)}")
        if len(in_shapes) == 3:
            ids = in_shapes[2]
            if int(torch.tensor(ids).prod()) < pts[0]:
                raise LayerError(f"PointBilinear needs one image index per point ({pts[0]}), got {list(ids)}")
        return [(pts[0], f[1], 1, 1)]

    def forward(self, attrs, params, feature, points, ids=None):
        return point_bilinear(feature, points, ids, attrs["ratio"])

    def pytorch_source(self, node, emit):
        fn = emit.helper(point_bilinear)
        ids = emit.inputs[2] if len(emit.inputs) == 3 else "None"
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {ids}, {node.attrs['ratio']!r})"

    def onnx(self, ctx, node):
        f_shape = ctx.shape(node.inputs[0])
        p_shape = ctx.shape(node.inputs[1])
        n, c, h, w = (int(d) for d in f_shape)
        npts = int(p_shape[0])

        def op(kind, ins, hint, **kw):
            return ctx.op(kind, ins, hint, **kw)

        flat = op("Reshape", [node.inputs[1], ctx.i64([-1])], "pts_flat")
        pairs = op("Reshape", [op("Slice", [flat, ctx.i64([0]), ctx.i64([2 * npts]), ctx.i64([0])], "pts_used"),
                               ctx.i64([npts, 2])], "pairs")
        px = op("Gather", [pairs, ctx.i64(0)], "px", axis=1)
        py = op("Gather", [pairs, ctx.i64(1)], "py", axis=1)
        ratio = ctx.f32(np.float32(node.attrs["ratio"]))
        zero = ctx.f32(0.0)

        def coord(v, size, hint):
            v = op("Mul", [v, ratio], f"{hint}_scaled")
            v = op("Max", [v, zero], f"{hint}_pos")
            v = op("Min", [v, ctx.f32(float(size - 1))], f"{hint}_in")
            lo = op("Floor", [v], f"{hint}_floor")
            frac = op("Sub", [v, lo], f"{hint}_frac")
            lo_i = op("Cast", [lo], f"{hint}_low", to=7)
            hi_i = op("Min", [op("Add", [lo_i, ctx.i64(1)], f"{hint}_up"), ctx.i64(size - 1)], f"{hint}_high")
            return frac, op("Sub", [ctx.f32(1.0), frac], f"{hint}_rest"), lo_i, hi_i

        lw, hw, xl, xh = coord(px, w, "x")
        lh, hh, yl, yh = coord(py, h, "y")
        if len(node.inputs) == 3:
            ids = op("Slice", [op("Reshape", [node.inputs[2], ctx.i64([-1])], "ids_flat"), ctx.i64([0]),
                               ctx.i64([npts]), ctx.i64([0])], "ids_used")
            base = op("Mul", [op("Cast", [ctx.trunc(ids)], "ids_int", to=7), ctx.i64(h * w)], "base")
        else:
            base = ctx.i64(0)
        rows = op("Reshape", [op("Transpose", [node.inputs[0]], "nhwc", perm=[0, 2, 3, 1]), ctx.i64([n * h * w, c])],
                  "rows")

        def gather(yi, xi, hint):
            idx = op("Add", [op("Add", [base, op("Mul", [yi, ctx.i64(w)], f"{hint}_row")], f"{hint}_rb"), xi],
                     f"{hint}_idx")
            return op("Gather", [rows, idx], hint, axis=0)

        def weight(a, b, hint):
            return op("Unsqueeze", [op("Mul", [a, b], hint), ctx.i64([1])], f"{hint}_col")

        terms = [op("Mul", [weight(hh, hw, "w1"), gather(yl, xl, "v1")], "t1"),
                 op("Mul", [weight(hh, lw, "w2"), gather(yl, xh, "v2")], "t2"),
                 op("Mul", [weight(lh, hw, "w3"), gather(yh, xl, "v3")], "t3"),
                 op("Mul", [weight(lh, lw, "w4"), gather(yh, xh, "v4")], "t4")]
        acc = op("Add", [terms[0], terms[1]], "s12")
        acc = op("Add", [acc, terms[2]], "s123")
        acc = op("Add", [acc, terms[3]], "sum")
        ctx.add_node("Reshape", [acc, ctx.i64([npts, c, 1, 1])], [node.outputs[0]], name=node.name)


@register_layer("AttLstm")
class AttLstm(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "AttLstm", 2, 2, "x, cont")
        d = positive_field(lp.recurrent_param.num_output, "recurrent_param.num_output")
        return {"name": lp.name, "num_output": int(d)}

    def _dims(self, in_shapes):
        x, cont = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) != 4:
            raise LayerError(f"AttLstm's x must be (T, N, C, E) (time, stream, channel, encoder step), got {list(x)}")
        if cont != x[:2]:
            raise LayerError(f"AttLstm's cont must be (T, N) = {list(x[:2])}, got {list(cont)}")
        return x

    def infer(self, attrs, in_shapes):
        t, n, _, e = self._dims(in_shapes)
        return [(t, n, attrs["num_output"]), (t, n, e, 1)]

    def param_shapes(self, attrs, in_shapes):
        t, _, c, _ = self._dims(in_shapes)
        d = attrs["num_output"]
        first = [(d, d), (d,), (d, c), (d,), (1, d), (4 * d, c), (4 * d,), (4 * d, d)]
        return first + [(1, d)] * (t - 1)

    def why_not_run(self, attrs):
        return (f"{_FORK}'s attention LSTM (an unrolled net of Transpose, Bias, Softmax, Sum and LSTMUnit steps) is "
                f"read and sized, but caffeq does not run it")


@register_layer("AffineTransformer")
class AffineTransformer(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "AffineTransformer", (2, 3), None, "U, theta, widths")
        p = lp.at_param
        out_h = int(p.output_h)
        positive_field(out_h, "at_param.output_h")
        out_w = int(p.output_w) if p.HasField("output_w") else None
        if out_w is None and len(lp.bottom) != 3:
            raise LayerError("AffineTransformer without at_param.output_w takes the widths as a third bottom")
        if len(p.cont) != len(lp.top) - 1:
            raise LayerError(f"AffineTransformer needs one at_param.cont per top after the first: "
                             f"{len(lp.top) - 1} top(s), {len(p.cont)} cont")
        conts = []
        for k, cp in enumerate(p.cont):
            if len(cp.scale) != len(cp.shift) or not cp.scale:
                raise LayerError(f"at_param.cont[{k}] needs as many scale as shift values, at least one")
            if any(s == 0 for s in cp.scale):
                raise LayerError(f"at_param.cont[{k}].scale must not be 0")
            conts.append(list(zip((int(s) for s in cp.scale), (int(s) for s in cp.shift))))
        if p.theta and len(p.theta) != 6:
            raise LayerError(f"at_param.theta takes 6 values, got {len(p.theta)}")
        return {"name": lp.name, "out_h": out_h, "out_w": out_w, "conts": conts}

    def infer(self, attrs, in_shapes):
        u, theta = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(u) != 4:
            raise LayerError(f"AffineTransformer's U must be (S, C, H, W), got {list(u)}")
        if len(theta) < 3 or theta[2] != 6 or theta[0] != u[0]:
            raise LayerError(f"AffineTransformer's theta must be (S, P, 6) with S = {u[0]}, got {list(theta)}")
        if attrs["out_w"] is None:
            raise MissingInputShape("AffineTransformer without at_param.output_w is as wide as the largest value of "
                                    "its widths bottom: its tops' shapes depend on the data")
        nn = theta[0] * theta[1]
        tops = [(nn, u[1], attrs["out_h"], attrs["out_w"])]
        for ops in attrs["conts"]:
            length = attrs["out_w"]
            for scale, shift in ops:
                length = int(length / scale) + shift   # C++ int division, toward zero
            tops.append((length, nn))
        return tops

    def why_not_run(self, attrs):
        return f"{_FORK}'s AffineTransformer (GPU-only forward, at_layer.cu) is read and sized, but caffeq does not run it"


class _TrainingOnly(ReadOnlyLayer):
    is_training_only = True

    def parse(self, lp):
        return {"name": lp.name, "tops": len(lp.top), "bottoms": len(lp.bottom)}


@register_layer("StandardCTC")
class StandardCTC(_TrainingOnly):
    def parse(self, lp):
        need_blobs(lp, "StandardCTC", (1, 2, 3, 4), (1, 2, 3), "cont, probabilities, labels, mask")
        train = any(r.HasField("phase") and r.phase == caffe_pb2.TRAIN for r in lp.include)
        return dict(_TrainingOnly.parse(self, lp), train=train)

    def infer(self, attrs, in_shapes):
        # the fork's Reshape: T and N from bottom 0; a (1,) loss at TRAIN, (T, N) paths per top at TEST
        first = tuple(in_shapes[0])
        if len(first) < 2:
            raise LayerError(f"StandardCTC's first bottom must be (T, N, ...), got {list(first)}")
        if attrs["train"]:
            return [(1,)]
        return [first[:2]] * attrs["tops"]

    def why_not_run(self, attrs):
        return f"{_FORK}'s StandardCTC (warp-ctc loss, greedy path decoder) is a training/evaluation layer"


@register_layer("AccuracyText")
class AccuracyText(_TrainingOnly):
    def parse(self, lp):
        need_blobs(lp, "AccuracyText", (3, 4), (1, 2), "paths, cont, labels, mask")
        return super().parse(lp)

    def infer(self, attrs, in_shapes):
        return [(1,)] * attrs["tops"]

    def why_not_run(self, attrs):
        return f"{_FORK}'s AccuracyText scores decoded text against a dictionary file: an evaluation layer"


class _Unpublished(ReadOnlyLayer):
    """A type textspotter's e2e_best.pt names whose source the repository does not hold: sized as `base`."""

    base = None

    def parse(self, lp):
        attrs = self.base().parse(lp)
        return dict(attrs, name=lp.name, kind=self.types[0])

    def infer(self, attrs, in_shapes):
        return self.base().infer(attrs, in_shapes)

    def param_shapes(self, attrs, in_shapes):
        return self.base().param_shapes(attrs, in_shapes)

    def why_not_run(self, attrs):
        return (f"{_FORK}'s source for this type is not in the repository; sized as BVLC's "
                f"{self.base.types[0]}, not run")


@register_layer("BatchNormData")
class BatchNormData(_Unpublished):
    base = BatchNorm


@register_layer("ScaleData")
class ScaleData(_Unpublished):
    base = Scale


@register_layer("InnerProductData")
class InnerProductData(_Unpublished):
    base = InnerProduct
