"""Qi-Xian/DeVise's embedding layers (0f02964, caffe/src/caffe/layers/linear_transform_layer.cpp and
similarity_layer.cpp; the CPU and GPU forwards are the same gemms).

- LinearTransform (linear_transform_param num_output, axis [1], weight_filler; backprop and verbose only
  touch training and logging): InnerProduct without a bias, y = x W^T with W (num_output, K), K the
  bottom's count from axis on; top = the bottom's shape up to axis, then num_output.
- Similarity (similarity_param mode, never read): bottoms the features (M, ...) and the prototypes
  (N, ...) with the same channels; each prototype flattened to K = its count / N, each feature row read
  as K values; top (M, N) = features x prototypes^T.
"""
import math

from .registry import Layer, LayerError, canonical_axis, need_blobs, positive_field, register_layer


@register_layer("LinearTransform")
class LinearTransform(Layer):
    blob_names = ("weight",)
    weight_axes = {0: 0}

    def parse(self, lp):
        need_blobs(lp, "LinearTransform", 1, 1)
        p = lp.linear_transform_param
        return {"num_output": positive_field(p.num_output, "linear_transform_param.num_output"), "axis": int(p.axis)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        axis = canonical_axis(attrs["axis"], len(s), "linear_transform_param.axis")
        attrs["_axis"], attrs["_k"] = axis, math.prod(s[axis:])
        return [s[:axis] + (attrs["num_output"],)]

    def param_shapes(self, attrs, in_shapes):
        return [(attrs["num_output"], attrs["_k"])]

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(out_shapes[0]) * attrs["_k"]

    def forward(self, attrs, params, x):
        return x.flatten(attrs["_axis"]) @ params[0].t()

    def onnx(self, ctx, node):
        flat = ctx.op("Flatten", [node.inputs[0]], "flat", axis=node.attrs["_axis"])
        out = ctx.op("MatMul", [flat, ctx.weight(node, 0, transpose=True)], "xw")
        ctx.add_node("Reshape", [out, ctx.i64(list(ctx.shape(node.outputs[0])))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.module(f"nn.Linear({node.attrs['_k']}, {node.attrs['num_output']}, bias=False)")
        emit.param("weight", 0)
        return f"{m}({emit.inputs[0]}.flatten({node.attrs['_axis']})).reshape({tuple(emit.out_shape(0))!r})"


def prototype_similarity(features, prototypes):
    """DeVise's Similarity: each feature row against each flattened prototype."""
    n = prototypes.shape[0]
    return features.reshape(features.shape[0], -1) @ prototypes.reshape(n, -1).t()


@register_layer("Similarity")
class Similarity(Layer):
    bottoms, tops = 2, 1
    bottom_roles = "features, prototypes"

    def infer(self, attrs, in_shapes):
        x, p = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) < 2 or len(p) < 2 or x[1] != p[1]:
            raise LayerError(f"Similarity needs features and prototypes with the same channels (the fork's check), "
                             f"got {list(x)} and {list(p)}")
        if math.prod(x[1:]) != math.prod(p[1:]):
            raise LayerError(f"Similarity reads each feature as one prototype's {math.prod(p[1:])} values, "
                             f"got features {list(x)}")
        return [(x[0], p[0])]

    def forward(self, attrs, params, features, prototypes):
        return prototype_similarity(features, prototypes)

    def onnx(self, ctx, node):
        x, p = node.inputs
        n = ctx.shape(p)[0]
        fx = ctx.op("Flatten", [x], "fx", axis=1)
        fp = ctx.op("Transpose", [ctx.op("Reshape", [p, ctx.i64([n, -1])], "fp")], "fpt")
        ctx.add_node("MatMul", [fx, fp], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(prototype_similarity)}({emit.inputs[0]}, {emit.inputs[1]})"
