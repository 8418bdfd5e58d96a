"""Engineering-Course/caffe_ssl's MaskCreate (b62e3de, src/caffe/layers/mask_create_layer.cpp, last changed in
af29973; the Caffe of Engineering-Course/LIP_SSL's human parsing nets; CPU only, so its GPU forward runs this
one): x (N, num_cls, H, W) -> (N, 1, H, W), each pixel's best class as a float, ties going to the highest
index (a partial_sort of (value, class) pairs with std::greater).  With NaN in a pixel the fork's
order is undefined, and torch and onnxruntime pick differently.
"""

from .registry import Layer, LayerError, four_axes, need_blobs, register_layer


def best_class_last_tie(x):
    """(N, 1, H, W): the channel of each pixel's maximum, the highest channel among equal maxima."""
    last = x.shape[1] - 1
    return (last - x.flip(1).argmax(1, keepdim=True)).to(x.dtype)


@register_layer("MaskCreate")
class MaskCreate(Layer):
    def parse(self, lp):
        need_blobs(lp, "MaskCreate", 1, 1)
        classes = int(lp.mask_create_param.num_cls)
        if classes < 1:
            raise LayerError(f"mask_create_param.num_cls must be >= 1, got {classes}")
        return {"classes": classes}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "MaskCreate")
        if c != attrs["classes"]:   # Reshape's CHECK
            raise LayerError(f"MaskCreate's bottom has {c} channels, mask_create_param.num_cls {attrs['classes']}")
        return [(n, 1, h, w)]

    def forward(self, attrs, params, x):
        return best_class_last_tie(x)

    def onnx(self, ctx, node):
        best = ctx.add_node("ArgMax", [node.inputs[0]], ctx.tmp(node.name + "_best"), name=node.name, axis=1,
                            keepdims=1, select_last_index=1)
        ctx.add_node("Cast", [best], [node.outputs[0]], to=1)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(best_class_last_tie)}({emit.inputs[0]})"
