"""JiajianZeng/caffe-face-attributes (c5c16d1, grid_pooling_layer.cpp/.cu; its ZF part-attention nets):
GRIDPooling, Fast R-CNN's max pooling with the whole map as the roi.

Rows are cut into pooled_h bins of float32 size H / pooled_h: bin p covers rows floor(p * size) up to
ceil((p + 1) * size), clipped to the map, so bins overlap where H is not a multiple of pooled_h (8 rows
into 6: [0,2) [1,3) [2,4) [4,6) [5,7) [6,8)); columns likewise.  Each output is its bin's maximum.  The
top is (N, C, pooled_h, pooled_w); TRAIN and TEST compute the same; no blobs.  The fork's caffemodels
hold the parameters at 8266713, multi_roi_pooling_param here, whose fields 1 and 2 are the same.
ONNX: MaxRoiPool over the N x C planes with the whole map as a constant roi (onnxruntime forms Fast
R-CNN's float32 bins).
"""
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources
from .roi_pooling import TORCH_ROI_COMMON, TORCH_ROI_POOLING, cell_bins, max_over_bins


def grid_max_pool(x, ph: int, pw: int):
    """(N, C, ph, pw): each bin's maximum, the bins of a roi that is the whole H x W map."""
    n, c, h, w = x.shape
    pooled = max_over_bins(x.reshape(n * c, h, w), *cell_bins(0, 0, w - 1, h - 1, ph, pw, h, w))
    return pooled.reshape(n, c, ph, pw)


TORCH_GRID_POOLING = torch_sources(grid_max_pool)


@register_layer("GRIDPooling")
class GRIDPooling(Layer):
    def parse(self, lp):
        need_blobs(lp, "GRIDPooling", 1, 1)
        # the fork's binary files put the parameters at multi_roi_pooling_param's number
        field = "grid_pooling_param" if lp.HasField("grid_pooling_param") else "multi_roi_pooling_param"
        p = getattr(lp, field)
        if p.pooled_h <= 0 or p.pooled_w <= 0:
            raise LayerError(f"{field}.pooled_h and pooled_w must be > 0, got {p.pooled_h} x {p.pooled_w}")
        return {"ph": int(p.pooled_h), "pw": int(p.pooled_w)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "GRIDPooling")
        if h < 1 or w < 1:
            raise LayerError(f"GRIDPooling needs a map of at least 1 x 1, got {list(in_shapes[0])}")
        return [(n, c, attrs["ph"], attrs["pw"])]

    def forward(self, attrs, params, x):
        return grid_max_pool(x, attrs["ph"], attrs["pw"])

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ROI_COMMON)
        emit.helper(TORCH_ROI_POOLING)
        fn = emit.helper(TORCH_GRID_POOLING)
        return f"{fn}({emit.inputs[0]}, {node.attrs['ph']}, {node.attrs['pw']})"

    def onnx(self, ctx, node):
        import numpy as np
        _, c, h, w = ctx.shape(node.inputs[0])
        planes = ctx.op("Reshape", [node.inputs[0], ctx.i64([1, -1, h, w])], node.name + "_planes")
        roi = ctx.const(np.array([[0, 0, 0, w - 1, h - 1]], np.float32))
        pooled = ctx.op("MaxRoiPool", [planes, roi], node.name + "_pooled", pooled_shape=[node.attrs["ph"],
                        node.attrs["pw"]], spatial_scale=1.0)
        ctx.add_node("Reshape", [pooled, ctx.i64([-1, c, node.attrs["ph"], node.attrs["pw"]])], [node.outputs[0]],
                     name=node.name)
