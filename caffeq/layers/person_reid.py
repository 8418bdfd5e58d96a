"""sanpingzhou/Person-Re-ID (129abad; its own Caffe): the P2S nets' PS layer (split_person_layer.cpp, CPU only,
no parameters), which cuts a person's (N, C, H, W) map into four horizontal stripes of full width.

Stripes 0-2 are rows i h4 .. (i + 1) h4 - 1 (h4 = H // 4): (N, C, h4, W).  Stripe 3 is (N, C, H - 3 h4, W), and
the fork writes it with the other stripes' plane stride h4 W: read flat, its value p is plane B = min(p // (h4 W),
N C - 1) of the input at offset r = p - B h4 W past row 3 h4 (r < (H - 3 h4) W), and 0 past that (memory
never written).  When H % 4 == 0 that is the plain fourth stripe; otherwise each plane's last row is lost
but the last plane's, and the blob's tail is 0: reproduced.  Its P2SLoss only trains.

zhunzhong07/caffe-reid (7468850; its Caffe): PairEuclidean (src/caffe/layers/pair_euclidean_layer.cpp and .cu,
include/caffe/layers/euclidean_layer.hpp; no parameters, no blobs), the verification branch of its
market1501 nets.  Bottom 0 (read through num/channels/height/width: at most 4 axes, 1 past the last) holds
two halves of N / 2 items each, A and B; top 0 is (A - B)^2 per element, a 4-axis (N / 2, C, H, W) blob.
With a second bottom (labels, one value per item: count == num == N) there is a second top (N / 2,),
1 where A's label equals B's, else 0.  Caffe CHECKs bottoms == tops and an even N.
"""
import math

import torch

from .registry import Layer, LayerError, cached_constant, four_axes, legacy_nchw, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def last_stripe_index(planes: int, height: int, width: int):
    """The fork's fourth stripe as flat indices into the input, -1 where it leaves memory unwritten."""
    rows = height // 4
    plane = rows * width
    p = torch.arange(planes * (height - 3 * rows) * width)
    b = torch.clamp(p // plane, max=planes - 1)
    r = p - b * plane
    src = b * (height * width) + 3 * rows * width + r
    return torch.where(r < (height - 3 * rows) * width, src, torch.full_like(src, -1))


def person_stripes(x, index):
    """Four stripes of x (N, C, H, W): three of H // 4 rows, then the fork's fourth from `index`."""
    n, c, h, w = x.shape
    rows = h // 4
    flat = x.reshape(-1)
    last = torch.where(index >= 0, flat[index.clamp(min=0)], torch.zeros((), dtype=x.dtype, device=x.device))
    return (x[:, :, :rows], x[:, :, rows:2 * rows], x[:, :, 2 * rows:3 * rows], last.reshape(n, c, h - 3 * rows, w))


def pair_squared_difference(x, item_shape: list[int]):
    """PairEuclidean's top 0: (A - B)^2 of x's first and second halves, shaped (N / 2, C, H, W)."""
    halves = x.reshape(2, -1)
    diff = halves[0] - halves[1]
    return (diff * diff).reshape([-1] + item_shape)


def pair_same_label(labels):
    """PairEuclidean's top 1: 1 where the first half's label equals the second half's, else 0 -> (N / 2,)."""
    halves = labels.reshape(2, -1)
    return (halves[0] == halves[1]).to(labels.dtype)


@register_layer("PS")
class PersonStripes(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 4)
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "PS")
        if h < 4:
            raise LayerError(f"PS cuts 4 stripes of H // 4 rows; a height of {h} leaves them empty")
        rows = h // 4
        return [(n, c, rows, w)] * 3 + [(n, c, h - 3 * rows, w)]

    def forward(self, attrs, params, x):
        n, c, h, w = x.shape
        return person_stripes(x, cached_constant(last_stripe_index, n * c, h, w, device=x.device, dtype=torch.long))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        n, c, h, w = ctx.shape(x)
        rows = h // 4
        index = last_stripe_index(n * c, h, w).numpy()
        for i, out in enumerate(node.outputs[:3]):
            ctx.add_node("Slice", [x, ctx.i64([i * rows]), ctx.i64([(i + 1) * rows]), ctx.i64([2])], [out],
                         name=f"{node.name}/stripe{i}")
        flat = ctx.op("Reshape", [x, ctx.i64([-1])], "flat")
        picked = ctx.op("Gather", [flat, ctx.i64(index.clip(min=0))], "picked", axis=0)
        written = ctx.const(index >= 0, node.name + "_written")   # a Where, as torch: 0 stays 0 beside inf / NaN
        kept = ctx.op("Where", [written, picked, ctx.f32(0.0)], "kept")
        ctx.add_node("Reshape", [kept, ctx.i64([n, c, h - 3 * rows, w])], [node.outputs[3]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(last_stripe_index)
        x = emit.inputs[0]
        return f"{emit.helper(person_stripes)}({x}, last_stripe_index({x}.shape[0] * {x}.shape[1], " \
               f"{x}.shape[2], {x}.shape[3]).to({x}.device))"


@register_layer("PairEuclidean")
class PairEuclidean(Layer):
    def parse(self, lp):
        need_blobs(lp, "PairEuclidean", (1, 2), (1, 2), "features[, labels]")
        if len(lp.bottom) != len(lp.top):
            raise LayerError(f"PairEuclidean needs as many tops as bottoms (Caffe CHECKs it), got {len(lp.bottom)} "
                             f"bottom(s) and {len(lp.top)} top(s)")
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "PairEuclidean")
        if n % 2:
            raise LayerError(f"PairEuclidean pairs the first half of the batch with the second: num must be even, got {n}")
        tops = [(n // 2, c, h, w)]
        if len(in_shapes) == 2:
            labels = in_shapes[1]
            if legacy_nchw(labels, "PairEuclidean labels (bottom 1)")[0] != n or math.prod(labels) != n:
                raise LayerError(f"PairEuclidean's labels (bottom 1) must hold one value per item ({n}), "
                                 f"got {list(labels)}")
            tops.append((n // 2,))
        return tops

    def forward(self, attrs, params, x, labels=None):
        out = pair_squared_difference(x, list(legacy_nchw(x.shape, "PairEuclidean")[1:]))
        return out if labels is None else (out, pair_same_label(labels))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        item = list(legacy_nchw(ctx.shape(x), "PairEuclidean")[1:])
        halves = ctx.op("Reshape", [x, ctx.i64([2, -1])], "halves")
        first = ctx.op("Gather", [halves, ctx.i64(0)], "a", axis=0)
        second = ctx.op("Gather", [halves, ctx.i64(1)], "b", axis=0)
        diff = ctx.op("Sub", [first, second], "diff")
        squared = ctx.op("Mul", [diff, diff], "squared")
        ctx.add_node("Reshape", [squared, ctx.i64([-1, *item])], [node.outputs[0]], name=node.name)
        if len(node.inputs) == 2:
            pairs = ctx.op("Reshape", [node.inputs[1], ctx.i64([2, -1])], "label_halves")
            same = ctx.op("Equal", [ctx.op("Gather", [pairs, ctx.i64(0)], "label_a", axis=0),
                                    ctx.op("Gather", [pairs, ctx.i64(1)], "label_b", axis=0)], "same")
            ctx.add_node("Cast", [same], [node.outputs[1]], name=node.name + "/same_label", to=1)

    def pytorch_source(self, node, emit):
        item = list(legacy_nchw(emit.in_shape(0), "PairEuclidean")[1:])
        out = f"{emit.helper(pair_squared_difference)}({emit.inputs[0]}, {item!r})"
        if len(emit.inputs) == 1:
            return out
        return [out, f"{emit.helper(pair_same_label)}({emit.inputs[1]})"]
