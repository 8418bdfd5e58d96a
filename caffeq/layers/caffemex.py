"""sciencefans/CaffeMex_v2's CenterProjection (9bab8d2, src/caffe/layers/center_projection_layer.cpp / .cu;
the COCO loss nets): an InnerProduct (center_projection_param num_output, bias_term, axis, transpose)
whose weight rows are meant to be unit vectors, times `scale`.  Its blobs and top are InnerProduct's.

caffeq reads it (shapes, parameters, conversion of the structure) but does not run it: no forward of
the fork computes a function of its inputs alone.  The GPU forward with more than one row normalizes
the weight rows in the blob itself (w / (|w| + 1e-6), again at every call, so the weights drift), then
multiplies by scale; with one row it multiplies by the weights as they stand, without scale.  The CPU
forward writes its result into its bottom and leaves the top unset.  (Its Normalize, the layer before it
in those nets, runs: happynear.py.)
"""
import numpy as np

from .registry import LayerError, ReadOnlyLayer, canonical_axis, need_blobs, register_layer

WHY = ("CenterProjection's forward depends on how often it ran (the fork normalizes its weight blob in place "
       "at every GPU call with more than one row, and skips the normalization and the scale with one row; its "
       "CPU forward writes into its bottom): caffeq reads it but does not run it")


@register_layer("CenterProjection")
class CenterProjection(ReadOnlyLayer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "CenterProjection", 1, 1)
        p = lp.center_projection_param
        if p.num_output < 1:
            raise LayerError("center_projection_param.num_output must be >= 1")
        return {"num_output": int(p.num_output), "bias_term": bool(p.bias_term), "axis": int(p.axis),
                "transpose": bool(p.transpose), "scale": float(np.float32(p.scale)), "name": lp.name}

    def _k(self, attrs, shape):
        axis = canonical_axis(attrs["axis"], len(shape), "center_projection_param.axis")
        return axis, int(np.prod(shape[axis:], dtype=np.int64))

    def infer(self, attrs, in_shapes):
        axis, _ = self._k(attrs, in_shapes[0])
        return [tuple(in_shapes[0][:axis]) + (attrs["num_output"],)]

    def param_shapes(self, attrs, in_shapes):
        _, k = self._k(attrs, in_shapes[0])
        n = attrs["num_output"]
        weight = (k, n) if attrs["transpose"] else (n, k)
        return [weight, (n,)] if attrs["bias_term"] else [weight]

    def macs(self, attrs, in_shapes, out_shapes):
        return int(np.prod(out_shapes[0], dtype=np.int64)) * self._k(attrs, in_shapes[0])[1]

    def why_not_run(self, attrs):
        return WHY
