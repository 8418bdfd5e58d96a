"""Gordo et al.'s Deep Image Retrieval (DIR, R-MAC) Python layers, module custom_layers (deep-retrieval's
deploy_resnet101*.prototxt and the projects that copy its custom_layers.py):

- NormalizeLayer: x / (1e-8 + sqrt(sum over axis 1 of x^2)), each sample's L2 normalization with its eps
  added after the root (numpy float32), for bottoms of at most 4 axes.
- AggregateLayer: the sum of the region descriptors over axis 0, one (1, ...) row; the copies that give
  param_str num_rois (and batch_size) sum each image's num_rois consecutive rows instead.
"""
from .face_norms import _L2Norm, channel_l2_normalize
from .norm import onnx_reduce
from .param_str import param_str_positive_int, parse_param_str
from .registry import Layer, LayerError, count, need_blobs, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def dir_aggregate(x, images: int):
    """The sum of each image's rows (x holds `images` equal runs of rows along axis 0)."""
    return x.reshape((images, -1) + tuple(x.shape[1:])).sum(1)


@register_layer("Python:custom_layers.NormalizeLayer")
class DIRNormalize(_L2Norm):
    """xiaolonw's Norm (face_norms.py) with the module's eps 1e-8, the top shaped as the bottom."""

    fn = staticmethod(channel_l2_normalize)
    eps = 1e-8
    axes = [1]
    top_as_bottom = True

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) < 2:   # the module sums axis 1
            raise LayerError(f"NormalizeLayer normalizes axis 1 of an (N, C, ...) bottom, got {list(in_shapes[0])}")
        return super().infer(attrs, in_shapes)


@register_layer("Python:custom_layers.AggregateLayer")
class DIRAggregate(Layer):
    def parse(self, lp):
        need_blobs(lp, "custom_layers.AggregateLayer", 1, 1)
        params = parse_param_str(lp.python_param.param_str)
        rois, batch = (param_str_positive_int(params, k) if k in params else None for k in ("num_rois", "batch_size"))
        return {"num_rois": rois, "batch_size": batch}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        rois = attrs["num_rois"]
        if not s or (rois is not None and s[0] % rois):
            raise LayerError(f"AggregateLayer sums num_rois {rois} rows per image; the bottom {list(s)} does not "
                             "hold a whole number of images")
        images = 1 if rois is None else s[0] // rois
        if attrs["batch_size"] is not None and rois is not None and attrs["batch_size"] != images:
            raise LayerError(f"AggregateLayer: batch_size {attrs['batch_size']} x num_rois {rois} != the "
                             f"{s[0]} regions of the bottom (the module's assert)")
        if count(s) == 0:
            raise LayerError(f"AggregateLayer's bottom {list(s)} is empty")
        attrs["images"] = images
        return [(images,) + s[1:]]

    def forward(self, attrs, params, x):
        return dir_aggregate(x, attrs["images"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        shape = list(ctx.shape(x))
        runs = ctx.op("Reshape", [x, ctx.i64([node.attrs["images"], -1] + shape[1:])], "runs")
        onnx_reduce(ctx, "ReduceSum", runs, [1], False, out=node.outputs[0])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(dir_aggregate)}({emit.inputs[0]}, {node.attrs['images']})"
