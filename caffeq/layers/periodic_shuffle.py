"""Wangyupei/CED's PeriodicShuffle (the Crisp Edge Detection fork, a7ce091; Yi Li's
periodic_shuffle_layer.cpp/.cu): sub-pixel upsampling after a convolution.

periodic_shuffle_param { num_output [16], group_size [2] } (uint32 both).  A 4-axis bottom of
exactly num_output * group_size^2 channels gives (N, num_output, group_size * H, group_size * W).
Input channel k * num_output + c at (h, w), with k = dy * group_size + dx, goes to channel c at
(group_size * h + dy, group_size * w + dx): the sub-pixel offset is the outer part of the channel
index, the output channel the inner one.  That is ONNX DepthToSpace's DCR order, not torch's
pixel_shuffle (ONNX CRD), where the output channel is the outer part.

Caffe's checks: both fields > 0, a 4-axis bottom, channels == num_output * group_size^2.  The
layer writes its top while it reads the bottom, so it cannot run in place.
"""
from .registry import Layer, LayerError, need_blobs, register_layer


def periodic_shuffle(x, num_output: int, group_size: int):
    """CED's PeriodicShuffle: channel (dy * g + dx) * num_output + c of pixel (h, w) to channel c at
    (g * h + dy, g * w + dx)."""
    n, _, h, w = x.shape
    g = group_size
    y = x.reshape(n, g, g, num_output, h, w).permute(0, 3, 4, 1, 5, 2)
    return y.reshape(n, num_output, h * g, w * g)


def _field(p, name):
    value = int(getattr(p, name))
    if value < 1:
        raise LayerError(f"periodic_shuffle_param.{name} must be > 0, got {value}")
    return value


@register_layer("PeriodicShuffle")
class PeriodicShuffle(Layer):
    def parse(self, lp):
        need_blobs(lp, "PeriodicShuffle", 1, 1, in_place=False)
        p = lp.periodic_shuffle_param
        return {"num_output": _field(p, "num_output"), "group_size": _field(p, "group_size")}

    def infer(self, attrs, in_shapes):
        shape = tuple(int(d) for d in in_shapes[0])
        if len(shape) != 4:
            raise LayerError(f"periodic_shuffle_param needs a 4-axis bottom (N, C, H, W), got {list(shape)}")
        n, c, h, w = shape
        k, g = attrs["num_output"], attrs["group_size"]
        if c != k * g * g:
            raise LayerError(f"periodic_shuffle_param: the bottom's {c} channels are not num_output {k} x "
                             f"group_size {g}^2 = {k * g * g}")
        return [(n, k, h * g, w * g)]

    def forward(self, attrs, params, x):
        return periodic_shuffle(x, attrs["num_output"], attrs["group_size"])

    def onnx(self, ctx, node):
        # DCR: the block offsets are the outer part of the channel index, as in the fork's loop
        ctx.add_node("DepthToSpace", [node.inputs[0]], [node.outputs[0]], name=node.name,
                     blocksize=node.attrs["group_size"], mode="DCR")

    def pytorch_source(self, node, emit):
        fn = emit.helper(periodic_shuffle)
        a = node.attrs
        return f"{fn}({emit.inputs[0]}, {a['num_output']}, {a['group_size']})"
