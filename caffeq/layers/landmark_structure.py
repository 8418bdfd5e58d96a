"""JiajianZeng/ContextWithStructure's landmark layers (2508ceb, src/caffe/layers/average_point_layer.cu,
facial_landmark_performance_layer.cu, patch_semantic_layer.cu; their CPU forwards are NOT_IMPLEMENTED).

- AveragePoint (average_point_param num_landmark L [5]): the bottom holds L (x, y) pairs per image
  (count per image 2L, the fork's check); top (N, 2, 1, 1) = the mean x and the mean y, summed landmark
  by landmark in float and divided by L.  Its Reshape also reshapes the bottom blob to (N, L, 2, 1) for
  the layers after it; caffeq keeps the bottom's shape (every consumer in these nets reads it by count).
- FacialLandmarkPerformance (an evaluation metric) and PatchSemantic (the partial derivatives only
  PerceptualLoss reads) only train or score the net: caffeq/training_layers.py drops them from inference
  graphs, with the losses.
"""
import math

from .registry import Layer, LayerError, need_blobs, positive_field, register_layer


def _landmarks(shape, count, what, role):
    if len(shape) < 2 or math.prod(shape[1:]) != 2 * count:
        raise LayerError(f"{what}'s {role} must hold {count} (x, y) pairs per image (num_landmark {count}), "
                         f"got {list(shape)}")


def average_point(x, landmarks: int):
    """AveragePoint: (N, 2 L) landmarks -> the (N, 2, 1, 1) mean x and mean y."""
    pairs = x.reshape(x.shape[0], landmarks, 2)
    return (pairs.sum(1) / landmarks).reshape(x.shape[0], 2, 1, 1)


@register_layer("AveragePoint")
class AveragePoint(Layer):
    def parse(self, lp):
        need_blobs(lp, "AveragePoint", 1, 1)
        return {"landmarks": positive_field(lp.average_point_param.num_landmark, "average_point_param.num_landmark")}

    def infer(self, attrs, in_shapes):
        _landmarks(tuple(in_shapes[0]), attrs["landmarks"], "AveragePoint", "bottom")
        return [(in_shapes[0][0], 2, 1, 1)]

    def forward(self, attrs, params, x):
        return average_point(x, attrs["landmarks"])

    def onnx(self, ctx, node):
        n = ctx.shape(node.inputs[0])[0]
        pairs = ctx.op("Reshape", [node.inputs[0], ctx.i64([n, node.attrs["landmarks"], 2])], "pairs")
        total = ctx.op("ReduceSum", [pairs, ctx.i64([1])], "sum", keepdims=0)
        mean = ctx.op("Div", [total, ctx.f32(float(node.attrs["landmarks"]))], "mean")
        ctx.add_node("Reshape", [mean, ctx.i64([n, 2, 1, 1])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(average_point)}({emit.inputs[0]}, {node.attrs['landmarks']})"
