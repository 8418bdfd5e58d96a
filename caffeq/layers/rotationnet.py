"""kanezaki/caffe-rotationnet (909ebdb; RotationNet's nets): MY_SOFTMAX (V1 files; MySoftmax here), a softmax
over each run of my_softmax_param.stride consecutive channels (one run per candidate viewpoint), at every
spatial position; the top is the bottom's shape.  The channels must be a multiple of stride (the fork
reads past its buffer otherwise).  ImageDataParameter.num_rotation only groups an object's views when the
list is shuffled.
"""
from .registry import Layer, LayerError, need_blobs, register_layer
from .softmax import emit_softmax

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def grouped_softmax(x, stride: int):
    """Softmax over each run of `stride` channels (axis 1)."""
    n, c = x.shape[:2]
    runs = x.reshape((n, c // stride, stride) + tuple(x.shape[2:]))
    return runs.softmax(2).reshape(x.shape)


@register_layer("MySoftmax")
class GroupedSoftmax(Layer):
    def parse(self, lp):
        need_blobs(lp, "MySoftmax", 1, 1)
        stride = int(lp.my_softmax_param.stride)
        if stride < 1:
            raise LayerError("MySoftmax needs my_softmax_param.stride >= 1 (the fork has no default)")
        return {"stride": stride}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2 or s[1] % attrs["stride"]:
            raise LayerError(f"MySoftmax's channels must be a multiple of stride {attrs['stride']} (the fork reads "
                             f"past its buffer otherwise), got {list(s)}")
        return [s]

    def forward(self, attrs, params, x):
        return grouped_softmax(x, attrs["stride"])

    def onnx(self, ctx, node):
        x, out = node.inputs[0], node.outputs[0]
        shape = list(ctx.shape(x))
        k = node.attrs["stride"]
        runs = ctx.op("Reshape", [x, ctx.i64([shape[0], shape[1] // k, k] + shape[2:])], "runs")
        soft = emit_softmax(ctx, runs, ctx.tmp(f"{node.name}_soft"), 2, len(shape) + 1, name=node.name)
        ctx.add_node("Reshape", [soft, ctx.i64(shape)], [out])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(grouped_softmax)}({emit.inputs[0]}, {node.attrs['stride']})"
