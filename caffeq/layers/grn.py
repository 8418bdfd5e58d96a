"""ylongqi/FoodDist's GRN (caffe/src/caffe/layers/grn_layer.cpp, bbb1af0; no parameters, no blobs): each
sample's L2 normalization over the channels, y[n, c] = x[n, c] / sqrt(sum over c of x[n, c]^2), with no eps
(an all-zero sample gives NaN, as in the fork).  The fork requires height = width = 1 (its nets normalize an
(N, K) feature).  The same in TRAIN and TEST.  xiaolonw's Norm (face_norms.py) with eps 0.
"""
from .face_norms import _L2Norm, channel_l2_normalize
from .registry import LayerError, register_layer


@register_layer("GRN")
class GRN(_L2Norm):
    fn = staticmethod(channel_l2_normalize)
    eps = 0.0
    axes = [1]
    top_as_bottom = True

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2 or len(s) > 4 or any(d != 1 for d in s[2:]):
            raise LayerError(f"GRN normalizes (N, C) or (N, C, 1, 1) features (the fork checks height and width "
                             f"are 1), got {list(s)}")
        return super().infer(attrs, in_shapes)
