"""Forks' bilinear sampling layers, computed as products with constant interpolation matrices.

HyperColumns (JiangQH/caffe a86cdfe, src/caffe/layers/hypercolumns_layer.cpp, as
JiangQH/Hypercolumns-Based-Surface-Normal-Recovery uses it): bottoms normal (N x K x H x W) and
feature maps f_1..f_B (N x C_b x h_b x w_b); tops hypercolumns (N*S x sum C_b x 1 x 1) and
normal_point (N*S x K).  At test (`is_train: false`) the sampled points of every image are the flat
indices 0, s, 2s, ... of the H x W grid, S = H*W / s, where s = `skip_ratio` lowered until it divides
H*W.  For a point (h, w) = (index / W, index % W) and map b, with scale = H / h_b (integer division)
and pad = (scale - 1) / 2: t_w = (w - pad) / scale, t_h likewise (float32); floor and ceil are
clamped at 0, a ceil past the map falls back to the floor, and the value is the bilinear mix of the
2 x 2 (or fewer) neighbours with weights t - floor.  normal_point copies the K values at the point.
The fork's CUDA kernel computes the same for square maps whose scale is an integer (it indexes
rows by H and the map's height); caffeq follows the CPU code.  `is_train: true` draws random valid
points (std::random_shuffle, seeded by the time): read and sized, not run.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..errors import ExportError
from .registry import Layer, LayerError, cached_constant, need_blobs, positive_field, register_layer

# ---- the interpolation matrices and the torch computation (model.py copies these) -----------


def hypercolumn_axis(out_size: int, in_size: int, scale: int):
    """HyperColumns' (out_size, in_size) interpolation matrix along one axis (float32 as the fork)."""
    pad = torch.tensor((scale - 1.0) / 2, dtype=torch.float32)
    pos = (torch.arange(out_size, dtype=torch.float32) - pad) / torch.tensor(float(scale))
    lo = torch.floor(pos).clamp(0, in_size - 1)  # (past the map only at points never sampled)
    hi = torch.ceil(pos).clamp_min(0)
    hi = torch.where(hi < in_size, hi, lo)
    delta = torch.where(lo == hi, torch.zeros_like(pos), pos - lo)
    m = torch.zeros(out_size, in_size)
    rows = torch.arange(out_size)
    m.index_put_((rows, lo.long()), 1 - delta, accumulate=True)
    m.index_put_((rows, hi.long()), delta, accumulate=True)
    return m


def hypercolumns_sample(normal, feats: list[torch.Tensor], mats: list[torch.Tensor], index):
    """(hypercolumns (N*S, sum C, 1, 1), normal_point (N*S, K)) from the maps and the (row, col)
    interpolation matrices mats[2b], mats[2b + 1] of map b, at the flat grid points `index`."""
    n, k = normal.shape[0], normal.shape[1]
    cols = []
    for b, f in enumerate(feats):
        full = torch.matmul(torch.matmul(mats[2 * b], f), mats[2 * b + 1].t())
        cols.append(full.reshape(n, f.shape[1], -1).index_select(2, index).permute(0, 2, 1))
    hyper = torch.cat(cols, 2)
    points = normal.reshape(n, k, -1).index_select(2, index).permute(0, 2, 1).reshape(-1, k)
    return hyper.reshape(-1, hyper.shape[2], 1, 1), points


class CaffeHyperColumns(nn.Module):
    """HyperColumns at test: forward(normal, *maps) -> (hypercolumns, normal_point)."""

    def __init__(self, height: int, width: int, sizes: list, skip: int):
        super().__init__()
        self.count = len(sizes)
        for b, (h, w) in enumerate(sizes):
            scale = height // h
            self.register_buffer(f"m{2 * b}", hypercolumn_axis(height, h, scale), persistent=False)
            self.register_buffer(f"m{2 * b + 1}", hypercolumn_axis(width, w, scale), persistent=False)
        self.register_buffer("index", torch.arange(0, height * width, skip), persistent=False)

    def forward(self, normal, *feats):
        mats = [getattr(self, f"m{i}") for i in range(2 * self.count)]
        return hypercolumns_sample(normal, list(feats), mats, self.index)


def _test_skip(skip, hw):
    while hw % skip:
        skip -= 1
    return skip


@register_layer("HyperColumns")
class HyperColumns(Layer):
    def parse(self, lp):
        need_blobs(lp, "HyperColumns", range(2, 1 << 20), 2, roles="normal, feature maps")
        p = lp.hypercolumns_param
        return {"is_train": bool(p.is_train), "sample_num": positive_field(p.sample_num, "hypercolumns_param.sample_num"),
                "skip_ratio": positive_field(p.skip_ratio, "hypercolumns_param.skip_ratio"), "name": lp.name}

    def _plan(self, attrs, in_shapes):
        normal = tuple(in_shapes[0])
        if len(normal) != 4:
            raise LayerError(f"bottom[0] (normal) must be N x K x H x W, got {list(normal)}")
        n, k, hh, ww = normal
        sizes = []
        skip = _test_skip(attrs["skip_ratio"], hh * ww)
        index = np.arange(0, hh * ww, skip)
        for b, s in enumerate(in_shapes[1:], 1):
            s = tuple(s)
            if len(s) != 4 or s[0] != n:
                raise LayerError(f"bottom[{b}] must be {n} x C x h x w, got {list(s)}")
            scale = hh // s[2]
            if scale == 0:
                raise LayerError(f"bottom[{b}] is taller ({s[2]}) than the normal map ({hh}): "
                                 f"the fork divides by H / h = 0")
            if not attrs["is_train"]:
                pad = np.float32((scale - 1.0) / 2)
                for in_size, pos in ((s[2], index // ww), (s[3], index % ww)):
                    far = (np.float32(pos.max()) - pad) / np.float32(scale)
                    if max(np.floor(far), 0) >= in_size:
                        raise LayerError(f"bottom[{b}] ({s[2]} x {s[3]}) is too small for scale {scale} "
                                         f"of the {hh} x {ww} normal map: the fork reads outside it")
            sizes.append((s[2], s[3]))
        samples = attrs["sample_num"] if attrs["is_train"] else len(index)
        channels = sum(int(s[1]) for s in in_shapes[1:])
        return n, k, hh, ww, sizes, skip, samples, channels

    def infer(self, attrs, in_shapes):
        n, k, _, _, _, _, samples, channels = self._plan(attrs, in_shapes)
        return [(n * samples, channels, 1, 1), (n * samples, k)]

    @staticmethod
    def cannot_run(attrs, in_shapes):
        if attrs["is_train"]:
            return ("is_train samples random valid points (std::random_shuffle seeded by the time); "
                    "set is_train: false to run it")
        return None

    def forward(self, attrs, params, normal, *feats):
        self.refuse_if_cannot_run(attrs["name"], attrs, [normal.shape] + [f.shape for f in feats], LayerError)
        hh, ww = normal.shape[2], normal.shape[3]
        mats = []
        for f in feats:
            scale = hh // f.shape[2]
            mats += [cached_constant(hypercolumn_axis, hh, f.shape[2], scale, device=f.device, dtype=f.dtype),
                     cached_constant(hypercolumn_axis, ww, f.shape[3], scale, device=f.device, dtype=f.dtype)]
        index = torch.arange(0, hh * ww, _test_skip(attrs["skip_ratio"], hh * ww), device=normal.device)
        return hypercolumns_sample(normal, list(feats), mats, index)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(i) for i in range(len(node.inputs))],
                                  ExportError)
        _, _, hh, ww = emit.in_shape(0)
        sizes = [tuple(emit.in_shape(i)[2:]) for i in range(1, len(node.inputs))]
        m = emit.instance(CaffeHyperColumns, hh, ww, sizes, _test_skip(node.attrs["skip_ratio"], hh * ww),
                          needs=[hypercolumn_axis, hypercolumns_sample])
        out = emit.tmp("hypercolumns")
        emit.stmt(f"{out} = {m}({', '.join(emit.inputs)})")
        return [f"{out}[0]", f"{out}[1]"]

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(i) for i in node.inputs], ExportError)
        name = node.name
        n, k, hh, ww, sizes, skip, _, channels = self._plan(node.attrs, [ctx.shape(i) for i in node.inputs])
        index = ctx.const(np.arange(0, hh * ww, skip, dtype=np.int64))
        cols = []
        for b, ((h, w), f) in enumerate(zip(sizes, node.inputs[1:])):
            scale = hh // h
            mh = ctx.const(hypercolumn_axis(hh, h, scale).numpy())
            mw = ctx.const(np.ascontiguousarray(hypercolumn_axis(ww, w, scale).numpy().T))
            rows = ctx.add_node("MatMul", [mh, f], ctx.tmp(f"{name}_rows{b}"), name=name)
            full = ctx.add_node("MatMul", [rows, mw], ctx.tmp(f"{name}_full{b}"))
            flat = ctx.add_node("Reshape", [full, ctx.const(np.array([0, ctx.shape(f)[1], -1], np.int64))],
                                ctx.tmp(f"{name}_flat{b}"))
            picked = ctx.add_node("Gather", [flat, index], ctx.tmp(f"{name}_picked{b}"), axis=2)
            cols.append(ctx.add_node("Transpose", [picked], ctx.tmp(f"{name}_cols{b}"), perm=[0, 2, 1]))
        cat = ctx.add_node("Concat", cols, ctx.tmp(f"{name}_cat"), axis=2) if len(cols) > 1 else cols[0]
        ctx.add_node("Reshape", [cat, ctx.const(np.array([-1, channels, 1, 1], np.int64))], [node.outputs[0]])
        flat = ctx.add_node("Reshape", [node.inputs[0], ctx.const(np.array([0, k, -1], np.int64))],
                            ctx.tmp(f"{name}_normal"))
        picked = ctx.add_node("Gather", [flat, index], ctx.tmp(f"{name}_normal_picked"), axis=2)
        tr = ctx.add_node("Transpose", [picked], ctx.tmp(f"{name}_normal_t"), perm=[0, 2, 1])
        ctx.add_node("Reshape", [tr, ctx.const(np.array([-1, k], np.int64))], [node.outputs[1]])


# ---- BilinearInterpolation (ctensmeyer/caffe 0ded1da, bilinear_layer.cpp / .cu) -------------
#
# Bottoms x (N x C x h x w) and a blob whose axes 2 and 3 give the output size H x W.  Per axis,
# in float32 as the fork: factor = (h - 1) / (H - 1), o = i * factor, lo = (int) o, hi = (int)(o + 1);
# rows lo and lo + 1 weigh hi - o and o - lo, columns lo and hi likewise (align-corners bilinear).
# The fork reads one row or column past the map with weight 0 at the last output; where float32
# rounding makes that weight ~1e-7 instead, it reads the next row of memory there, and caffeq
# reads the last row again.  H or W = 1 divides by zero in the fork: refused.

def align_corners_axis(out_size: int, in_size: int, second_at_hi: bool = False):
    """BilinearInterpolation's (out_size, in_size) matrix along one axis (float32 as the fork).  Rows
    read lo + 1 as the second neighbour; the width (second_at_hi) reads column hi = trunc(pos + 1)."""
    factor = torch.tensor(float(in_size - 1), dtype=torch.float32) / torch.tensor(float(out_size - 1))
    pos = torch.arange(out_size, dtype=torch.float32) * factor
    lo = torch.trunc(pos)
    hi = torch.trunc(pos + 1)
    second = hi if second_at_hi else lo + 1
    m = torch.zeros(out_size, in_size)
    rows = torch.arange(out_size)
    m.index_put_((rows, lo.long().clamp(0, in_size - 1)), hi - pos, accumulate=True)
    m.index_put_((rows, second.long().clamp(0, in_size - 1)), pos - lo, accumulate=True)
    return m


class CaffeBilinearInterpolation(nn.Module):
    """BilinearInterpolation from h x w to H x W: forward(x) = Mh x Mw^T."""

    def __init__(self, out_h: int, out_w: int, in_h: int, in_w: int):
        super().__init__()
        self.register_buffer("mh", align_corners_axis(out_h, in_h), persistent=False)
        self.register_buffer("mw", align_corners_axis(out_w, in_w, True), persistent=False)

    def forward(self, x):
        return torch.matmul(torch.matmul(self.mh, x), self.mw.t())


@register_layer("BilinearInterpolation")
class BilinearInterpolation(Layer):
    bottoms, tops, bottom_roles = 2, 1, "data, size reference"

    def infer(self, attrs, in_shapes):
        x, ref = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) != 4:
            raise LayerError(f"bottom[0] must be N x C x H x W, got {list(x)}")
        if len(ref) < 4:
            raise LayerError(f"bottom[1] gives the output size by its axes 2 and 3, got {list(ref)}")
        oh, ow = ref[2], ref[3]
        if oh < 2 or ow < 2:
            raise LayerError(f"output {oh} x {ow}: the fork divides by (size - 1); "
                             f"an output side of 1 is not computed")
        return [(x[0], x[1], oh, ow)]

    def forward(self, attrs, params, x, ref):
        mh = cached_constant(align_corners_axis, ref.shape[2], x.shape[2], device=x.device, dtype=x.dtype)
        mw = cached_constant(align_corners_axis, ref.shape[3], x.shape[3], True, device=x.device, dtype=x.dtype)
        return torch.matmul(torch.matmul(mh, x), mw.t())

    def pytorch_source(self, node, emit):
        _, _, oh, ow = emit.out_shape(0)
        _, _, ih, iw = emit.in_shape(0)
        m = emit.instance(CaffeBilinearInterpolation, oh, ow, ih, iw,
                          needs=[align_corners_axis])
        return f"{m}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        _, _, oh, ow = ctx.shape(node.outputs[0])
        _, _, ih, iw = ctx.shape(node.inputs[0])
        mh = ctx.const(align_corners_axis(oh, ih).numpy())
        mw = ctx.const(np.ascontiguousarray(align_corners_axis(ow, iw, True).numpy().T))
        rows = ctx.add_node("MatMul", [mh, node.inputs[0]], ctx.tmp(f"{node.name}_rows"), name=node.name)
        ctx.add_node("MatMul", [rows, mw], [node.outputs[0]])


# ---- PR (ctensmeyer/caffe precision_recall_layer.cpp): a test-phase metric --------------------

@register_layer("PR")
class PR(Layer):
    """Precision, recall, accuracy, true negative rate and F-measure of `prediction >= thresh`
    against integer labels (label != 0 is positive), `ignore_label` skipped: 5 scalar tops."""

    is_training_only = True

    def parse(self, lp):
        need_blobs(lp, "PR", 2, 5, roles="predictions, labels")
        p = lp.precision_recall_param
        return {"thresh": float(p.thresh), "ignore_label": int(p.ignore_label) if p.HasField("ignore_label") else None}

    def infer(self, attrs, in_shapes):
        a, b = (int(np.prod(s)) for s in in_shapes[:2])
        if a != b:
            raise LayerError(f"PR's two bottoms must have the same count, got {a} and {b}")
        return [()] * 5

    def forward(self, attrs, params, pred, labels):
        lab = labels.reshape(-1).to(torch.int64)    # static_cast<int>: truncation
        pos = pred.reshape(-1) >= attrs["thresh"]
        keep = torch.ones_like(pos) if attrs["ignore_label"] is None else lab != attrs["ignore_label"]
        real = lab != 0
        tp = (keep & pos & real).sum().to(pred.dtype)
        fp = (keep & pos & ~real).sum().to(pred.dtype)
        tn = (keep & ~pos & ~real).sum().to(pred.dtype)
        fn = (keep & ~pos & real).sum().to(pred.dtype)
        zero = torch.zeros((), dtype=pred.dtype, device=pred.device)
        precision = torch.where(tp + fp != 0, tp / (tp + fp), zero)
        recall = torch.where(tp + fn != 0, tp / (tp + fn), zero)
        accuracy = (tp + tn) / (tp + fp + tn + fn)   # 0 / 0 is NaN in the fork as well
        tnr = tn / (fp + tn)
        f = torch.where(precision + recall != 0, 2 * precision * recall / (precision + recall), zero)
        return precision, recall, accuracy, tnr, f
