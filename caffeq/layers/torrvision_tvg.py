"""torrvision/caffe-tvg (c37084e), the Oxford TVG fork behind "Bottom-up instance segmentation" (detections fed to
a mean-field CRF): two layers that read its detection blob, (1, D, 1, 6) rows of (label, x0, y0, x1, y1, score)
(include/caffe/detection.hpp, DetectionUtils::read_detections_from_blob: the five first values cast to int,
toward zero; the blob's num must be 1 and its count D * 6).

- BoxFeatures (src/caffe/layers/box_features_layer.cpp, its box_term_param is_background_det [false] and
  background_det_score [0.7311]): from a (1, C, H, W) unary, a (D + 1, C, H, W) top, zero but for row i + 1 of
  detection i inside its box, columns max(0, x0) to min(W - 1, x1) and rows max(0, y0) to min(H - 1, y1) both
  ends included, where it is the unary times exp(s) / (exp(s) + exp(1 - s)) of the detection's score s (in
  float, as written there; exp as glibc's expf rounds it, computed in double and rounded); row 0 is the unary
  times background_det_score with is_background_det, else zero.
  A unary batch other than 1 is refused (the fork stops: "Only a batch size of 1 is currently supported").
- ChannelSelect (src/caffe/layers/channel_select_layer.cpp): from an (N, C, H, W) stack, an (N, 1, H, W) top:
  row 0 is channel 0 of row 0, row i + 1 channel `label` of row i + 1 for each detection i, later rows zero.
  The fork's Blob::offset checks only label <= C (not label >= 0), so it reads the (i + 1) * C + label-th
  H x W plane of the blob: caffeq reads that plane where it lies in the blob and label <= C, and gives zeros
  where the fork would stop (label > C) or read outside the blob.  N must reach D + 1 (else the fork writes past
  its top).
The .cu forwards compute the same.  box_term_param's other fields (input dirs, is_no_rescore_baseline,
force_cpu) are the fork's BoxTerm layer's; BoxFeatures does not read them.
"""
import math

import torch

from .registry import (
    Layer,
    LayerError,
    need_blobs,
    register_layer,
)


def _detections(shape, what):
    """D of a detection blob, checked as read_detections_from_blob checks it."""
    s = tuple(int(d) for d in shape)
    if not 2 <= len(s) <= 4 or s[0] != 1 or math.prod(s) != 6 * s[1]:
        raise LayerError(f"{what}: bottom 1 (detections) must be (1, D, ...) holding D rows of 6 values "
                         f"(label, x0, y0, x1, y1, score), got {list(s)}")
    return s[1]


def _four_axes(shape, what, role):
    if len(shape) != 4:
        raise LayerError(f"{what}: bottom 0 ({role}) must have 4 axes (N, C, H, W), got {list(shape)}")
    return tuple(int(d) for d in shape)


def float_exp(ctx, x, hint):
    """expf of a float32 tensor as glibc gives it (correctly rounded): exp in double, rounded to float."""
    wide = ctx.op("Exp", [ctx.op("Cast", [x], f"{hint}_double", to=11)], f"{hint}_wide")
    return ctx.op("Cast", [wide], hint, to=1)


def box_features(unary, dets, background: float, has_background: bool):
    """caffe-tvg's BoxFeatures: row 0 the unary times `background` (zero without it), row i + 1 the unary times
    detection i's squashed score inside its integer box, zero outside."""
    h, w = unary.shape[2], unary.shape[3]
    rows = dets.reshape(-1, 6)
    box = torch.trunc(rows[:, 1:5])
    s = rows[:, 5]
    e = torch.exp(s.double()).float()
    score = e / (e + torch.exp((1 - s).double()).float())
    xs = torch.arange(w, dtype=unary.dtype, device=unary.device)
    ys = torch.arange(h, dtype=unary.dtype, device=unary.device)
    in_x = (xs[None, :] >= box[:, 0:1]) & (xs[None, :] <= box[:, 2:3])
    in_y = (ys[None, :] >= box[:, 1:2]) & (ys[None, :] <= box[:, 3:4])
    inside = (in_y[:, :, None] & in_x[:, None, :])[:, None]
    feats = torch.where(inside, unary * score[:, None, None, None], torch.zeros_like(unary))
    first = unary * background if has_background else torch.zeros_like(unary)
    return torch.cat([first, feats], 0)


def channel_select(unary, dets):
    """caffe-tvg's ChannelSelect: plane 0, then the ((i + 1) * C + label)-th H x W plane for detection i (zeros
    where that plane is outside the blob or label > C), then zeros up to N rows."""
    n, c, h, w = unary.shape
    planes = unary.reshape(n * c, h * w)
    label = torch.trunc(dets.reshape(-1, 6)[:, 0])
    k = label.shape[0]
    plane = torch.arange(1, k + 1, dtype=label.dtype, device=label.device) * c + label
    ok = (label <= c) & (plane >= 0) & (plane < n * c)
    picked = planes[torch.where(ok, plane, torch.zeros_like(plane)).long()]
    picked = torch.where(ok[:, None], picked, torch.zeros_like(picked))
    rest = planes.new_zeros((n - 1 - k, h * w))
    return torch.cat([planes[0:1], picked, rest], 0).reshape(n, 1, h, w)


@register_layer("BoxFeatures")
class BoxFeatures(Layer):
    def parse(self, lp):
        need_blobs(lp, "BoxFeatures", 2, 1, "unary, detections")
        p = lp.box_term_param
        return {"has_background": bool(p.is_background_det), "background": float(p.background_det_score)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = _four_axes(in_shapes[0], "BoxFeatures", "unary")
        d = _detections(in_shapes[1], "BoxFeatures")
        if n != 1:
            raise LayerError(f"BoxFeatures reads a unary batch of 1 only (the fork stops on others), got {n}")
        return [(d + 1, c, h, w)]

    def forward(self, attrs, params, unary, dets):
        return box_features(unary, dets, attrs["background"], attrs["has_background"])

    def onnx(self, ctx, node):
        a = node.attrs
        unary, dets = node.inputs
        _, _, h, w = ctx.shape(unary)
        d = _detections(ctx.shape(dets), "BoxFeatures")
        rows = ctx.op("Reshape", [dets, ctx.i64([d, 6])], "rows", name=node.name)

        def column(lo, hi, hint):
            return ctx.op("Slice", [rows, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([1])], hint)

        x0, y0, x1, y1 = (ctx.trunc(column(i, i + 1, n), n) for i, n in zip(range(1, 5), ("x0", "y0", "x1", "y1")))
        s = column(5, 6, "s")
        e = float_exp(ctx, s, "exp_s")
        score = ctx.op("Div", [e, ctx.op("Add", [e, float_exp(ctx, ctx.op("Sub", [ctx.f32(1.0), s], "one_minus_s"),
                                                              "exp_one_minus_s")], "sum")], "score")
        xs = ctx.f32([list(range(w))])
        ys = ctx.f32([list(range(h))])
        in_x = ctx.op("And", [ctx.op("GreaterOrEqual", [xs, x0], "x_lo"), ctx.op("LessOrEqual", [xs, x1], "x_hi")],
                      "in_x")
        in_y = ctx.op("And", [ctx.op("GreaterOrEqual", [ys, y0], "y_lo"), ctx.op("LessOrEqual", [ys, y1], "y_hi")],
                      "in_y")
        inside = ctx.op("And", [ctx.op("Unsqueeze", [in_y, ctx.i64([2])], "in_y3"),
                                ctx.op("Unsqueeze", [in_x, ctx.i64([1])], "in_x3")], "inside3")
        inside = ctx.op("Unsqueeze", [inside, ctx.i64([1])], "inside")
        scaled = ctx.op("Mul", [unary, ctx.op("Reshape", [score, ctx.i64([d, 1, 1, 1])], "score4")], "scaled")
        feats = ctx.op("Where", [inside, scaled, ctx.f32(0.0)], "feats")
        if a["has_background"]:
            first = ctx.op("Mul", [unary, ctx.f32(a["background"])], "background")
        else:
            first = ctx.filled(unary, 0.0, "background")
        ctx.add_node("Concat", [first, feats], [node.outputs[0]], axis=0)

    def pytorch_source(self, node, emit):
        fn = emit.helper(box_features)
        a = node.attrs
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {a['background']!r}, {a['has_background']})"


@register_layer("ChannelSelect")
class ChannelSelect(Layer):
    def parse(self, lp):
        need_blobs(lp, "ChannelSelect", 2, 1, "masks, detections")
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = _four_axes(in_shapes[0], "ChannelSelect", "masks")
        d = _detections(in_shapes[1], "ChannelSelect")
        if n < d + 1:
            raise LayerError(f"ChannelSelect: bottom 0 has {n} rows but {d} detections need {d + 1} (the fork "
                             f"would write past its top)")
        return [(n, 1, h, w)]

    def forward(self, attrs, params, unary, dets):
        return channel_select(unary, dets)

    def onnx(self, ctx, node):
        unary, dets = node.inputs
        n, c, h, w = ctx.shape(unary)
        d = _detections(ctx.shape(dets), "ChannelSelect")
        planes = ctx.op("Reshape", [unary, ctx.i64([n * c, h * w])], "planes", name=node.name)
        parts = [ctx.op("Slice", [planes, ctx.i64([0]), ctx.i64([1]), ctx.i64([0])], "plane0")]
        if d:
            parts.append(self._picked(ctx, planes, dets, n, c, d))
        if n - 1 - d:
            parts.append(ctx.const(torch.zeros(n - 1 - d, h * w).numpy(), f"{node.name}_rest"))
        flat = ctx.op("Concat", parts, "flat", axis=0)
        ctx.add_node("Reshape", [flat, ctx.i64([n, 1, h, w])], [node.outputs[0]])

    @staticmethod
    def _picked(ctx, planes, dets, n, c, d):
        """The D gathered planes (zeros where the fork stops or reads outside the blob)."""
        label = ctx.trunc(ctx.op("Slice", [ctx.op("Reshape", [dets, ctx.i64([d, 6])], "rows"), ctx.i64([0]),
                                           ctx.i64([1]), ctx.i64([1])], "label_col"), "label")
        plane = ctx.op("Add", [ctx.f32([[float((i + 1) * c)] for i in range(d)]), label], "plane")
        ok = ctx.op("And", [ctx.op("LessOrEqual", [label, ctx.f32(float(c))], "label_ok"),
                            ctx.op("And", [ctx.op("GreaterOrEqual", [plane, ctx.f32(0.0)], "plane_lo"),
                                           ctx.op("Less", [plane, ctx.f32(float(n * c))], "plane_hi")], "in_blob")],
                    "ok")
        index = ctx.op("Cast", [ctx.op("Where", [ok, plane, ctx.f32(0.0)], "safe_plane")], "index", to=7)
        index = ctx.op("Reshape", [index, ctx.i64([d])], "index1")
        return ctx.op("Where", [ok, ctx.op("Gather", [planes, index], "gathered", axis=0), ctx.f32(0.0)], "picked")

    def pytorch_source(self, node, emit):
        return f"{emit.helper(channel_select)}({emit.inputs[0]}, {emit.inputs[1]})"
