"""wanji/caffe-sl (81475a2; Caffe for similarity learning): its similarity layers and its triplet data layer.

- DotProductSimilarity (dotproduct_similarity_layer.cpp): two bottoms of the same num; top (N, 1, 1, 1) holds
  each sample's inner product of the two flattened samples (dim = count / num of bottom 0), no normalizing.
- EuclideanSimilarity (euclidean_similarity_layer.cpp): -0.5 ||a_i - b_i||^2, the samples' sizes checked equal.
- TripletImageData (triplet_image_data_layer.cpp): an ImageData list of (query, positive, negative) lines read
  into one blob of 3 x batch_size items, all queries, then all positives, then all negatives
  (3 batch_size, channels, new_height, new_width); a graph input here.
Its PairwiseRankingLoss and RankAccuracy only train and score, and are dropped from inference graphs.
"""
import math

from .data import transform_attrs
from .fork_data import ForkDataLayer, _channels, _crop_or
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def similarity_rows(a, b):
    """The two bottoms as (N, dim) rows, dim = count / num of the first (the fork's reading of both)."""
    n = a.shape[0]
    return a.reshape(n, -1), b.reshape(-1)[: a.numel()].reshape(n, -1)


def dot_product_similarity(a, b):
    fa, fb = similarity_rows(a, b)
    return (fa * fb).sum(1).reshape(-1, 1, 1, 1)


def euclidean_similarity(a, b):
    fa, fb = similarity_rows(a, b)
    return (-0.5 * ((fa - fb) ** 2).sum(1)).reshape(-1, 1, 1, 1)


class _Similarity(Layer):
    fn = None    # staticmethod(the torch function), copied into model.py with similarity_rows

    def parse(self, lp):
        need_blobs(lp, lp.type, 2, 1)
        return {}

    def infer(self, attrs, in_shapes):
        a, b = (tuple(s) for s in in_shapes)
        if not a or not b or a[0] != b[0]:
            raise LayerError(f"{type(self).__name__} needs two bottoms of the same num, got {list(a)} and {list(b)}")
        self.check_sizes(a, b)
        return [(a[0], 1, 1, 1)]

    def check_sizes(self, a, b):
        """DotProductSimilarity reads dim = count / num of both bottoms and checks nothing more."""
        if math.prod(b) < math.prod(a):
            raise LayerError(f"the second bottom {list(b)} holds fewer values than the first {list(a)} (the fork "
                             f"would read past it)")

    def onnx_flat(self, ctx, node):
        """The two bottoms as (N, dim) rows, dim = count / num of the first (the fork's reading of both)."""
        a, b = node.inputs
        n, dim = ctx.shape(a)[0], math.prod(ctx.shape(a)[1:])
        head = ctx.op("Slice", [ctx.op("Reshape", [b, ctx.i64([-1])], "bflat"), ctx.i64([0]), ctx.i64([n * dim])],
                      "bhead")
        return ctx.op("Reshape", [a, ctx.i64([n, dim])], "a"), ctx.op("Reshape", [head, ctx.i64([n, dim])], "b")

    def onnx_per_sample(self, ctx, node, terms, factor):
        """factor x each row's sum of the (N, dim) terms, as the (N, 1, 1, 1) top."""
        total = ctx.op("ReduceSum", [terms, ctx.i64([1])], "sum", keepdims=0)
        if factor != 1.0:
            total = ctx.op("Mul", [total, ctx.f32(factor)], "scaled")
        ctx.add_node("Reshape", [total, ctx.i64([-1, 1, 1, 1])], [node.outputs[0]], name=node.name)

    def forward(self, attrs, params, a, b):
        return self.fn(a, b)

    def pytorch_source(self, node, emit):
        emit.helper(similarity_rows)
        return f"{emit.helper(self.fn)}({', '.join(emit.inputs)})"


@register_layer("DotProductSimilarity")
class DotProductSimilarity(_Similarity):
    fn = staticmethod(dot_product_similarity)

    def onnx(self, ctx, node):
        fa, fb = self.onnx_flat(ctx, node)
        self.onnx_per_sample(ctx, node, ctx.op("Mul", [fa, fb], "prod"), 1.0)


@register_layer("EuclideanSimilarity")
class EuclideanSimilarity(_Similarity):
    fn = staticmethod(euclidean_similarity)

    def check_sizes(self, a, b):
        if math.prod(a[1:]) != math.prod(b[1:]):
            raise LayerError(f"EuclideanSimilarity needs samples of the same size, got {list(a)} and {list(b)}")

    def onnx(self, ctx, node):
        fa, fb = self.onnx_flat(ctx, node)
        diff = ctx.op("Sub", [fa, fb], "diff")
        self.onnx_per_sample(ctx, node, ctx.op("Mul", [diff, diff], "sq"), -0.5)


@register_layer("TripletImageData")
class TripletImageData(ForkDataLayer):
    """Queries, positives and negatives of batch_size lines in one (3 batch_size, C, H, W) blob."""

    def parse(self, lp):
        p = lp.image_data_param
        t = transform_attrs(lp)
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t, "source": p.source,
                "batch_size": 3 * positive_field(p.batch_size, "image_data_param.batch_size"),
                "channels": _channels(t, p.is_color), "hw": _crop_or(t, int(p.new_height), int(p.new_width))}

