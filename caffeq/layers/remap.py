"""tinghuiz/appearance-flow's Remap (b20a0dd, caffe/src/caffe/layers/remap_layer.cpp; no GPU code, so its
GPU forward runs this CPU one): bottoms the image (N, C, H0, W0) and coordinates (N, 2, H1, W1), channel 0
the column x and channel 1 the row y, in pixels; the top (N, C, H1, W1) samples the image bilinearly at
each (x, y), from (floor x, floor y) and the next column and row, a neighbour outside the image counting
0 (LiteFlowNet's coordinate Warp, optical_flow.coords_warp; the fork adds the four products in another
order, which moves only the last bit).

Transformation (the same fork, transformation_layer.cpp / .cu, last changed in 8f46193): a data augmentation
layer inside the net, one top per bottom.  Without mirror or a crop smaller than the image, its random
affine map is the identity (a uniform draw over an empty range) and each bilinear read lands on its pixel,
so top = transform_param.scale * (bottom - mean_value[c]), the values cycled over the channels.  Its
mirror, rotation (rotate), zoom (min_scale / max_scale other than 1) and crop position are random at every
forward, also at test: refused.
"""
import numpy as np
import torch

from .optical_flow import coords_warp, pixels_at
from .registry import AT_LEAST, Layer, LayerError, four_axes, need_blobs, register_layer
from .warp_onnx import OnnxImageSampler


@register_layer("Remap")
class Remap(Layer):
    def parse(self, lp):
        need_blobs(lp, "Remap", 2, 1, "image, coordinates")
        return {}

    def infer(self, attrs, in_shapes):
        image = four_axes(in_shapes[0], "Remap", "image (bottom 0)")
        coords = four_axes(in_shapes[1], "Remap", "coordinates (bottom 1)")
        if coords[0] != image[0] or coords[1] != 2:   # Reshape's CHECKs
            raise LayerError(f"Remap's coordinates {list(coords)} must be (N, 2, H, W) with the image's N = {image[0]}")
        return [(image[0], image[1], coords[2], coords[3])]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = out_shapes[0]
        return n * c * h * w * 4

    def forward(self, attrs, params, image, coords):
        return coords_warp(image, coords)

    def onnx(self, ctx, node):
        image, coords = node.inputs
        size = tuple(ctx.shape(coords)[2:])
        s = OnnxImageSampler(ctx, node.name, image)
        x, y = s.channel(coords, 0, "x", name=node.name), s.channel(coords, 1, "y")
        s.coords_warp(x, y, node.outputs[0], size)

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        return f"{emit.helper(coords_warp)}({emit.inputs[0]}, {emit.inputs[1]})"


def mean_scaled(x: torch.Tensor, mean: list[float], scale: float):
    """scale * (x - mean[c]) over axis -3, one mean value per channel (none: no subtraction)."""
    if len(mean) == 0:
        return x * scale
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).reshape(-1, 1, 1)
    return (x - m) * scale


@register_layer("Transformation")
class Transformation(Layer):
    def parse(self, lp):
        need_blobs(lp, "Transformation", range(1, AT_LEAST))
        if len(lp.top) != len(lp.bottom):
            raise LayerError(f"Transformation makes one top per bottom, got {len(lp.bottom)} and {len(lp.top)}")
        t = lp.transform_param
        for field in ("mean_file", "force_color", "force_gray"):   # LayerSetUp's CHECKs
            if t.HasField(field):
                raise LayerError(f"Transformation does not support transform_param.{field} (its fork's check)")
        random = [f for f, on in (("mirror", t.mirror), ("rotate", t.rotate),
                                  ("min_scale", t.min_scale != 1), ("max_scale", t.max_scale != 1)) if on]
        if random:
            raise LayerError(f"Transformation's transform_param.{random[0]} makes it flip, rotate or zoom at random at "
                             f"every forward, test included: caffeq does not run random layers")
        return {"scale": float(np.float32(t.scale)), "mean": [float(np.float32(v)) for v in t.mean_value],
                "crop": int(t.crop_size)}

    def infer(self, attrs, in_shapes):
        first = tuple(in_shapes[0])
        for s in in_shapes:
            s = tuple(s)
            if len(s) < 3 or len(s) != len(first) or s[2:] != first[2:]:
                raise LayerError(f"Transformation's bottoms must be images of one size (3 axes or more), got "
                                 f"{[list(x) for x in in_shapes]}")
            mean = attrs["mean"]
            if len(mean) > 1 and len(mean) < s[-3]:
                raise LayerError(f"transform_param has {len(mean)} mean values for {s[-3]} channels")
        crop = attrs["crop"]
        if crop and (crop, crop) != first[-2:]:
            raise LayerError(f"Transformation's crop_size {crop} under a {first[-2]}x{first[-1]} image picks a "
                             f"random position at every forward, test included: caffeq does not run random layers")
        return [tuple(s) for s in in_shapes]

    def _means(self, attrs, channels):
        mean = attrs["mean"]
        return [mean[j % len(mean)] for j in range(channels)] if mean else []

    def forward(self, attrs, params, *xs):
        out = [mean_scaled(x, self._means(attrs, x.shape[-3]), attrs["scale"]) for x in xs]
        return out[0] if len(out) == 1 else out

    def onnx(self, ctx, node):
        for x, top in zip(node.inputs, node.outputs):
            means = self._means(node.attrs, ctx.shape(x)[-3])
            centred = ctx.add_node("Sub", [x, ctx.const(np.array(means, np.float32).reshape(-1, 1, 1))],
                                   ctx.tmp(node.name + "_centred"), name=node.name) if means else x
            ctx.add_node("Mul", [centred, ctx.f32(node.attrs["scale"])], [top])

    def pytorch_source(self, node, emit):
        fn = emit.helper(mean_scaled)
        out = [f"{fn}({x}, {emit.lit(self._means(node.attrs, emit.in_shape(i)[-3]))}, {emit.lit(node.attrs['scale'])})"
               for i, x in enumerate(emit.inputs)]
        return out[0] if len(out) == 1 else out
