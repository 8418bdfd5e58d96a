"""OICR's GlobalSumPooling (ppengtang/oicr's caffe, the ppengtang/caffe-oicr submodule, read in ppengtang/oicr
d079d31: caffe/include/caffe/layers/global_sum_pooling_layer.hpp, caffe/src/caffe/layers/
global_sum_pooling_layer.cpp and .cu; no field in its caffe.proto, no blobs).

One bottom of 2 or more axes (its Reshape checks), one top shaped like it with axis 0 set to 1:
top[0, k] = sum over i of bottom[i, k], the sum over axis 0 (OICR sums the (R, C) class probabilities of
its R proposals into image scores).  The CPU loop and the GPU kernel (one thread per k) both add the rows
in order from 0, in float32, and so does caffeq: row by row in torch and model.py, and in ONNX as the last row
of a CumSum (onnxruntime's runs in the input's type, in order).  The same in TRAIN and TEST.

The rest of OICR's train nets: MulticlassCrossEntropyLoss and WeightedSoftmaxWithLoss are losses and its
Python OICRLayer reads the labels for them: caffeq drops all three at inference (training_layers.py).
"""
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources


def rows_summed_in_order(x):
    """x[0] + x[1] + ... over axis 0, one row at a time from 0 in x's type (the fork's loop), axis kept."""
    total = x.new_zeros((1,) + tuple(x.shape[1:]))
    for i in range(x.shape[0]):
        total = total + x[i:i + 1]
    return total


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
        return rows_summed_in_order(x)

    def onnx(self, ctx, node):
        running = ctx.op("CumSum", [node.inputs[0], ctx.i64([0])], "running")
        ctx.add_node("Slice", [running, ctx.i64([-1]), ctx.i64([2 ** 62]), ctx.i64([0])], [node.outputs[0]],
                     name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(torch_sources(rows_summed_in_order))}({emit.inputs[0]})"
