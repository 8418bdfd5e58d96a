"""ylongqi/FoodDist's GRN (caffe/src/caffe/layers/grn_layer.cpp, bbb1af0; no parameters, no blobs): each
sample's L2 normalization over the channels, y[n, c] = x[n, c] / sqrt(sum over c of x[n, c]^2), with no eps
(an all-zero sample gives NaN, as in the fork).  The fork requires height = width = 1 (its nets normalize an
(N, K) feature).  The same in TRAIN and TEST.
"""
from .norm import onnx_reduce
from .registry import Layer, LayerError, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def channel_l2_normalize(x):
    """x over the L2 norm of each sample's channels (axis 1)."""
    return x / (x * x).sum(1, keepdim=True).sqrt()


@register_layer("GRN")
class GRN(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2 or len(s) > 4 or any(d != 1 for d in s[2:]):
            raise LayerError(f"GRN normalizes (N, C) or (N, C, 1, 1) features (the fork checks height and width "
                             f"are 1), got {list(s)}")
        return [s]

    def forward(self, attrs, params, x):
        return channel_l2_normalize(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        norm = ctx.op("Sqrt", [onnx_reduce(ctx, "ReduceSumSquare", x, [1], True)], "norm")
        ctx.add_node("Div", [x, norm], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(channel_l2_normalize)}({emit.inputs[0]})"
