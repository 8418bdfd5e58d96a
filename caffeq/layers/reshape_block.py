"""xiaolonw/caffe-3dnormal (7543256) ReshapeBlock: src/caffe/layers/reshape_block_layer.cpp (the .cu calls
the CPU code); reshape_block_param new_channel, new_height, new_width, new_patch_width, new_patch_height
(proto/caffe.proto, 110139 here).

The bottom is read through num/channels/height/width (N, C, H, W; a 2-axis fc top is (N, C, 1, 1)); the top
is (N, new_channel, new_height, new_width) with top[n, nc, h ph + nh, w pw + nw] = bottom[n, (nw ph + nh)
new_channel + nc, h, w] -- the patch's width index outermost ("because matlab").  This is the same spreading
as Arroosh's patch Reshape (reshape.py's spread_patches), reused here.  The fork CHECKs ph pw new_channel ==
C and C H W == the top's count; caffeq also needs new_height = H ph and new_width = W pw (otherwise the fork's
flat index writes patches across rows or overlapping, leaving other values at 0).

Predict (predict_layer.cpp), the nets' last layer, is left to caffeq's other readers: its Forward is empty.
"""
from .registry import LayerError, legacy_nchw, need_blobs, register_layer
from .reshape import _PATCH_FIELDS, PatchReshape


@register_layer("ReshapeBlock")
class ReshapeBlock(PatchReshape):
    types = ("ReshapeBlock",)

    def parse(self, lp):
        need_blobs(lp, "ReshapeBlock", 1, 1, in_place=False)
        p = lp.reshape_block_param
        values = {f: int(getattr(p, f)) for f in _PATCH_FIELDS}
        if min(values.values()) < 1:
            raise LayerError(f"reshape_block_param: new_channel, new_height, new_width, new_patch_width and "
                             f"new_patch_height must all be >= 1, got {list(values.values())}")
        return values

    def infer(self, attrs, in_shapes):
        legacy_nchw(in_shapes[0], "ReshapeBlock")
        try:
            return super().infer(attrs, in_shapes)
        except LayerError as e:
            raise LayerError(str(e).replace("reshape_param", "reshape_block_param")) from None


__all__ = ["ReshapeBlock"]
