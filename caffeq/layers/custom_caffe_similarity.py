"""goodluckcwl/custom-caffe (aa5345b; Chen Weiliang's layers, src/caffe/proto/caffe.proto): two layers that pair the
batch's items, 2n with 2n + 1, as its src/caffe/test/*_layer.prototxt nets use them.  Neither has learnable blobs.

- MappingBySimilarity (src/caffe/layers/mapping_by_similarity_layer.cpp and .cu, the same formula on both devices;
  mapping_by_similarity_param.alpha, default 0, CHECKed to lie in [0, 1]): bottom 0 is (N, C, H, W) images,
  bottom 1 a (N / 2, 1, H, W) similarity map beta (Reshape CHECKs those sizes).  Per pair, pixel and channel,
      top[2n]     = (x1 + alpha (1 - beta) x2) / (1 + alpha - alpha beta)
      top[2n + 1] = (x2 + alpha (1 - beta) x1) / (1 + alpha - alpha beta)
  with x1 = bottom[2n], x2 = bottom[2n + 1], beta = bottom1[n] at that pixel.  The top is shaped like bottom 0;
  with an odd N nothing ever writes its last item, which keeps the zeros of a new blob, or, computed in place
  (top = bottom 0: both devices read each x1, x2 before writing there), the input's last item.
- PixelwiseSimilarity (src/caffe/layers/pixelwise_similarity_layer.cpp and .cu, the same rows and gemv on both;
  pixelwise_similarity_param.roi, which LayerSetUp requires set and > 0; N must be even): one bottom
  (N, C, H, W); for pair n, item 2n is the "image", item 2n + 1 the "kernel".  Top (N / 2, H W, 1, roi^2):
      top[n, y W + x, 0, i roi + j] = sum_c image[c, y - a + i, x - a + j] kernel[c, y, x]
  with a = ceil((roi - 1) / 2) and the image 0 outside H x W (the window spans y - a .. y + floor((roi - 1) / 2)).
  The fork calls it a cosine similarity but normalises nothing: a plain dot product along the channels.

Its InnerDistance is happynear's (caffeq/layers/happynear.py reads it).
"""
import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, four_axes, need_blobs, positive_field, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def map_by_similarity(x, beta, alpha: float, in_place: bool):
    """MappingBySimilarity: each pair's images mixed by alpha (1 - beta), over 1 + alpha - alpha beta; an odd
    batch's last item is never written: zeros, or the input's when computed in place."""
    n, c, h, w = x.shape
    pairs = n // 2
    both = x[:2 * pairs].reshape(pairs, 2, c, h, w)
    x1, x2 = both[:, 0], both[:, 1]
    mix = alpha * (1 - beta)
    denom = (1 + alpha) - alpha * beta
    out = torch.stack(((x1 + mix * x2) / denom, (x2 + mix * x1) / denom), 1).reshape(2 * pairs, c, h, w)
    if n % 2:   # the fork never writes an odd batch's last item
        out = torch.cat((out, x[2 * pairs:] if in_place else x.new_zeros((1, c, h, w))), 0)
    return out


def pixelwise_similarity(x, roi: int):
    """PixelwiseSimilarity: per pair, each kernel pixel's channel vector dotted with the image's roi x roi window."""
    n, c, h, w = x.shape
    image, kernel = x[0::2], x[1::2]
    before, after = roi // 2, (roi - 1) // 2
    padded = torch.nn.functional.pad(image, (before, after, before, after))
    scores = [(padded[:, :, i:i + h, j:j + w] * kernel).sum(1) for i in range(roi) for j in range(roi)]
    return torch.stack(scores, -1).reshape(n // 2, h * w, 1, roi * roi)


@register_layer("MappingBySimilarity")
class MappingBySimilarity(Layer):
    def parse(self, lp):
        need_blobs(lp, "MappingBySimilarity", 2, 1, "images, similarity map")
        alpha = float(lp.mapping_by_similarity_param.alpha)
        if not 0 <= alpha <= 1:
            raise LayerError(f"mapping_by_similarity_param.alpha must lie in [0, 1] (the fork's CHECK), got {alpha:g}")
        return {"alpha": alpha, "in_place": bool(lp.top[0] == lp.bottom[0])}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "MappingBySimilarity")
        sim = four_axes(in_shapes[1], "MappingBySimilarity", "similarity map (bottom 1)")
        if sim != (n // 2, 1, h, w):
            raise LayerError(f"MappingBySimilarity's similarity map (bottom 1) must be (N / 2, 1, H, W) = "
                             f"{[n // 2, 1, h, w]} for images {[n, c, h, w]}, got {list(sim)}")
        return [(n, c, h, w)]

    def forward(self, attrs, params, x, beta):
        return map_by_similarity(x, beta, attrs["alpha"], attrs.get("in_place", False))

    def onnx(self, ctx, node):
        x, beta = node.inputs
        n, c, h, w = ctx.shape(x)
        pairs = n // 2
        alpha = node.attrs["alpha"]
        even = x if not n % 2 else ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([2 * pairs]), ctx.i64([0])], "even")
        both = ctx.op("Reshape", [even, ctx.i64([pairs, 2, c, h, w])], "pairs")
        x1 = ctx.op("Gather", [both, ctx.i64(0)], "x1", axis=1)
        x2 = ctx.op("Gather", [both, ctx.i64(1)], "x2", axis=1)
        mix = ctx.op("Mul", [ctx.f32(alpha), ctx.op("Sub", [ctx.f32(1.0), beta], "one_minus_beta")], "mix")
        denom = ctx.op("Sub", [ctx.f32(1 + alpha), ctx.op("Mul", [ctx.f32(alpha), beta], "alpha_beta")], "denom")
        y1 = ctx.op("Div", [ctx.op("Add", [x1, ctx.op("Mul", [mix, x2], "mix2")], "sum1"), denom], "y1")
        y2 = ctx.op("Div", [ctx.op("Add", [x2, ctx.op("Mul", [mix, x1], "mix1")], "sum2"), denom], "y2")
        ones = [ctx.op("Unsqueeze", [y, ctx.i64([1])], f"{y}_1") for y in (y1, y2)]
        stacked = ctx.op("Concat", ones, "stacked", axis=1)
        if not n % 2:
            ctx.add_node("Reshape", [stacked, ctx.i64([n, c, h, w])], [node.outputs[0]], name=node.name)
            return
        flat = ctx.op("Reshape", [stacked, ctx.i64([2 * pairs, c, h, w])], "mapped")
        if node.attrs.get("in_place", False):
            last = ctx.op("Slice", [x, ctx.i64([n - 1]), ctx.i64([n]), ctx.i64([0])], "unwritten")
        else:
            last = ctx.const(np.zeros((1, c, h, w), np.float32), node.name + "_unwritten")
        ctx.add_node("Concat", [flat, last], [node.outputs[0]], name=node.name, axis=0)

    def pytorch_source(self, node, emit):
        return (f"{emit.helper(map_by_similarity)}({emit.inputs[0]}, {emit.inputs[1]}, "
                f"{emit.lit(node.attrs['alpha'])}, {node.attrs.get('in_place', False)})")


@register_layer("PixelwiseSimilarity")
class PixelwiseSimilarity(Layer):
    def parse(self, lp):
        need_blobs(lp, "PixelwiseSimilarity", 1, 1)
        p = lp.pixelwise_similarity_param
        if not p.HasField("roi"):
            raise LayerError("PixelwiseSimilarity needs pixelwise_similarity_param.roi (the fork CHECKs it is set)")
        return {"roi": positive_field(p.roi, "pixelwise_similarity_param.roi")}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "PixelwiseSimilarity")
        if n % 2:
            raise LayerError(f"PixelwiseSimilarity pairs items 2n and 2n + 1: the batch must be even, got {n}")
        return [(n // 2, h * w, 1, attrs["roi"] ** 2)]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        return n // 2 * h * w * attrs["roi"] ** 2 * c

    def forward(self, attrs, params, x):
        return pixelwise_similarity(x, attrs["roi"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        n, c, h, w = ctx.shape(x)
        roi = node.attrs["roi"]
        before, after = roi // 2, (roi - 1) // 2
        image = ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([n]), ctx.i64([0]), ctx.i64([2])], "image")
        kernel = ctx.op("Slice", [x, ctx.i64([1]), ctx.i64([n]), ctx.i64([0]), ctx.i64([2])], "kernel")
        padded = ctx.op("Pad", [image, ctx.i64([0, 0, before, before, 0, 0, after, after])], "padded")
        scores = []
        for i in range(roi):
            for j in range(roi):
                window = ctx.op("Slice", [padded, ctx.i64([i, j]), ctx.i64([i + h, j + w]), ctx.i64([2, 3])],
                                f"window{i}_{j}")
                product = ctx.op("Mul", [window, kernel], f"product{i}_{j}")
                scores.append(onnx_reduce(ctx, "ReduceSum", product, [1], True, ctx.tmp(f"{node.name}_score{i}_{j}")))
        stacked = ctx.op("Concat", scores, "scores", axis=1) if len(scores) > 1 else scores[0]
        last = ctx.op("Transpose", [stacked], "pixels_first", perm=[0, 2, 3, 1])
        ctx.add_node("Reshape", [last, ctx.i64([n // 2, h * w, 1, roi * roi])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(pixelwise_similarity)}({emit.inputs[0]}, {node.attrs['roi']})"
