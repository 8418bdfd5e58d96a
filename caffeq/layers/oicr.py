"""OICR's GlobalSumPooling (ppengtang/oicr's caffe, the ppengtang/caffe-oicr submodule, read in ppengtang/oicr
d079d31: caffe/include/caffe/layers/global_sum_pooling_layer.hpp, caffe/src/caffe/layers/
global_sum_pooling_layer.cpp and .cu; no field in its caffe.proto, no blobs).

One bottom of 2 or more axes (its Reshape checks), one top shaped like it with axis 0 set to 1:
top[0, k] = sum over i of bottom[i, k], the sum over axis 0 (OICR sums the (R, C) class probabilities of
its R proposals into image scores).  The CPU loop and the GPU kernel (one thread per k) both add the rows
in order from 0; caffeq sums with torch / ReduceSum, which may add in another order (float32 rounding
only).  The same in TRAIN and TEST.

The rest of OICR's train nets: MulticlassCrossEntropyLoss and WeightedSoftmaxWithLoss are losses and its
Python OICRLayer reads the labels for them: caffeq drops all three at inference (training_layers.py).
"""
from .registry import Layer, LayerError, need_blobs, register_layer


@register_layer("GlobalSumPooling")
class GlobalSumPooling(Layer):
    def parse(self, lp):
        need_blobs(lp, "GlobalSumPooling", 1, 1, in_place=False)
        return {}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2:
            raise LayerError(f"GlobalSumPooling needs a bottom of 2 or more axes (the fork's check), got {list(s)}")
        return [(1,) + s[1:]]

    def forward(self, attrs, params, x):
        return x.sum(0, keepdim=True)

    def onnx(self, ctx, node):
        ctx.add_node("ReduceSum", [node.inputs[0], ctx.i64([0])], [node.outputs[0]], name=node.name, keepdims=1)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]}.sum(0, keepdim=True)"
