"""GRN, as two forks define it (no blobs; the same in TRAIN and TEST):

- ylongqi/FoodDist (caffe/src/caffe/layers/grn_layer.cpp, bbb1af0; no parameters): each sample's L2
  normalization over the channels, y[n, c] = x[n, c] / sqrt(sum over c of x[n, c]^2), with no eps (an
  all-zero sample gives NaN, as in the fork).  The fork requires height = width = 1 (its nets normalize an
  (N, K) feature).  xiaolonw's Norm (face_norms.py) with eps 0.
- opencv/training_toolbox_caffe (789ff8dd, caffe/src/caffe/layers/grn_layer.cpp/.cu, Intel's; read when the
  layer carries `grn_param`): at each (n, h, w) of the legacy 4-axis blob, y = x / sqrt(sum over c of x^2
  + grn_param.bias) (bias [1e-7] added to the sum of squares before the root; the fork checks bias >= 0).
  `dummy_backward` only trains.  With bias 0 and a 1 x 1 map this is FoodDist's.
"""
import numpy as np
import torch

from .face_norms import _L2Norm
from .happynear import _reduce
from .registry import LayerError, register_layer


def channel_l2_normalize_bias_under_root(x, legacy_shape: list[int], eps: float):
    """x / sqrt(sum over channels of x^2 + eps) at each (n, h, w) of the 4-axis (legacy) blob."""
    x = x.reshape(legacy_shape)
    return x / torch.sqrt((x * x).sum(dim=1, keepdim=True) + eps)


@register_layer("GRN")
class GRN(_L2Norm):
    fn = staticmethod(channel_l2_normalize_bias_under_root)
    eps = 0.0
    axes = [1]
    top_as_bottom = True

    def parse(self, lp):
        attrs = super().parse(lp)
        attrs["grn_param"] = lp.HasField("grn_param")
        if attrs["grn_param"]:
            bias = float(lp.grn_param.bias)
            if not bias >= 0:
                raise LayerError(f"GRN grn_param.bias must be >= 0 (the fork checks it), got {bias}")
            attrs["eps"] = bias
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if attrs["grn_param"] and not 2 <= len(s) <= 4:
            raise LayerError(f"GRN reads num, channels, height and width: it needs 2 to 4 axes, got {list(s)}")
        if not attrs["grn_param"] and (len(s) < 2 or len(s) > 4 or any(d != 1 for d in s[2:])):
            raise LayerError(f"GRN normalizes (N, C) or (N, C, 1, 1) features (the fork checks height and width "
                             f"are 1), got {list(s)}")
        return super().infer(attrs, in_shapes)

    def onnx(self, ctx, node):
        name = node.name
        x = ctx.add_node("Reshape", [node.inputs[0], ctx.const(np.array(node.attrs["_legacy"], np.int64))],
                         [ctx.tmp(name + "_4d")], name=name)[0]
        squares = _reduce(ctx, "ReduceSumSquare", x, [1])
        eps = ctx.const(np.array(node.attrs["eps"], np.float32))
        root = ctx.op("Sqrt", [ctx.op("Add", [squares, eps], "sse")], "root")
        out = ctx.op("Div", [x, root], "4d_out")
        ctx.add_node("Reshape", [out, ctx.i64(list(ctx.shape(node.inputs[0])))], [node.outputs[0]])
