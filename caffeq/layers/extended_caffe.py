"""xiamenwcy/extended-caffe (29c5454): SegNet's max-unpooling with the output size carried by a blob, as
xiamenwcy/IrisSegBenchmark's SegNet deploy files use it.

- Pooling with `pooling_param { output_size: true }` (src/caffe/proto/caffe.proto, PoolingParameter 16;
  include/caffe/layers/pooling_layer.hpp MaxTopBlobs, src/caffe/layers/pooling_layer.cpp Reshape and
  Forward_cpu): one more top, the last, of shape 1 x 1 x H x W (the bottom's height and width), its values
  set to 0.  MAX pooling then takes 1, 2 (values, size) or 3 tops (values, argmax mask, size); AVE and
  STOCHASTIC 1 or 2 (values, size).  The values and the mask are Caffe's own pooling (pooling.py).
  Without the flag a second top is the mask, as in BVLC.
- Upsample with three bottoms (src/caffe/layers/upsample_layer.cpp Reshape): SegNet's unpooling of
  bottom 0 by the mask bottom 1 (vision_forks.segnet_unpool), to the height and width of bottom 2
  (read as Blob::height() / width(), each > 1), whatever scale or upsample_h / upsample_w say; the
  upsample_param is still checked as SegNet's (scale > 1, pad_out only with scale 2).
"""
import dataclasses

import numpy as np
from onnx import numpy_helper

from ..io.schema import caffe_pb2
from .pooling import MAX, Pooling
from .registry import LayerError, claim_layers, legacy_nchw, need_blobs
from .vision_forks import Upsample


def _without_last(lp, field):
    """A copy of the LayerParameter lp without its last top / bottom (`field`)."""
    q = caffe_pb2.LayerParameter()
    q.CopyFrom(lp)
    del getattr(q, field)[-1]
    return q


@claim_layers("Pooling", lambda lp: lp.pooling_param.output_size)
class SizeTopPooling(Pooling):
    def parse(self, lp):
        most = 3 if lp.pooling_param.pool == MAX else 2
        if not 1 <= len(lp.top) <= most:
            raise LayerError(f"pooling_param.output_size: {'MAX' if most == 3 else 'AVE and STOCHASTIC'} pooling "
                             f"takes {'1 to 3 tops (values, argmax mask, size)' if most == 3 else '1 or 2 tops (values, size)'}"
                             f", got {len(lp.top)}")
        size_top = len(lp.top) > 1
        attrs = super().parse(_without_last(lp, "top") if size_top else lp)
        attrs["size_top"] = size_top
        return attrs

    def infer(self, attrs, in_shapes):
        if not attrs["size_top"]:
            return super().infer(attrs, in_shapes)
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"pooling_param.output_size: the size top needs a 4-axis input, got {list(s)}")
        return super().infer(attrs, in_shapes) + [(1, 1, int(s[2]), int(s[3]))]

    def forward(self, attrs, params, x):
        out = super().forward(attrs, params, x)
        if not attrs["size_top"]:
            return out
        size = x.new_zeros((1, 1, x.shape[2], x.shape[3]))
        return (*out, size) if isinstance(out, tuple) else (out, size)

    def onnx(self, ctx, node):
        if not node.attrs["size_top"]:
            super().onnx(ctx, node)
            return
        super().onnx(ctx, dataclasses.replace(node, outputs=node.outputs[:-1], tops=node.tops[:-1]))
        h, w = (int(d) for d in ctx.shape(node.inputs[0])[2:])
        ctx.add_node("ConstantOfShape", [ctx.const(np.array([1, 1, h, w], np.int64))], [node.outputs[-1]],
                     name=node.name + "_size", value=numpy_helper.from_array(np.zeros(1, np.float32)))

    def pytorch_source(self, node, emit):
        out = super().pytorch_source(node, emit)
        if not node.attrs["size_top"]:
            return out
        h, w = emit.in_shape(0)[2:]
        size = f"{emit.inputs[0]}.new_zeros((1, 1, {int(h)}, {int(w)}))"
        return [*out, size] if isinstance(out, list) else [out, size]


@claim_layers("Upsample", lambda lp: len(lp.bottom) == 3)
class SizeBottomUpsample(Upsample):
    def parse(self, lp):
        need_blobs(lp, "Upsample", 3, 1, roles="data, max-pooling mask, size reference")
        attrs = super().parse(_without_last(lp, "bottom"))
        attrs["bare"] = False   # a bare two-bottom Upsample may be Tiny-DSOD's; three bottoms are this fork's
        return attrs

    def infer(self, attrs, in_shapes):
        _, _, h, w = legacy_nchw(in_shapes[2], "Upsample's size bottom")
        if h <= 1 or w <= 1:
            raise LayerError(f"Upsample's size bottom {list(in_shapes[2])} must have height and width > 1")
        attrs["out"] = (int(h), int(w))
        return super().infer(attrs, in_shapes[:2])

    def forward(self, attrs, params, x, mask, size):
        return super().forward(attrs, params, x, mask)


__all__ = ["SizeBottomUpsample", "SizeTopPooling"]
