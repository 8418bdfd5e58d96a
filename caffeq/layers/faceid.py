"""WeitaoVan/faceID's Mask layer (888d874, mask_layer.cu; its CPU forward is LOG(FATAL), so the GPU
one is the layer): y[n, c] = x[n, c] * (scale * m[n, 0]) for a mask bottom m of one channel and the
data's height and width (its LayerSetUp checks both), mask_param.scale [1].  The top is shaped like
the data; no blobs.
"""
import numpy as np

from .registry import Layer, LayerError, need_blobs, register_layer


@register_layer("Mask")
class SpatialMask(Layer):
    def parse(self, lp):
        need_blobs(lp, "Mask", 2, 1, "data, mask")
        return {"scale": float(lp.mask_param.scale)}

    def infer(self, attrs, in_shapes):
        x, m = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) != 4 or len(m) != 4:
            raise LayerError(f"Mask needs 4-axis bottoms, got {list(x)} and {list(m)}")
        if m[1] != 1 or m[0] != x[0] or m[2:] != x[2:]:
            raise LayerError(f"the mask {list(m)} must have one channel and the data's num, height and width "
                             f"{[x[0], 1, x[2], x[3]]}")
        return [x]

    def forward(self, attrs, params, x, mask):
        # the kernel scales the mask first, then multiplies: float32 rounding as the fork's
        return x * (mask * attrs["scale"])

    def onnx(self, ctx, node):
        x, mask = node.inputs
        scaled = ctx.op("Mul", [mask, ctx.f32(np.float32(node.attrs["scale"]))], "scaled_mask")
        ctx.add_node("Mul", [x, scaled], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]} * ({emit.inputs[1]} * {emit.lit(node.attrs['scale'])})"
