"""jialinwu17/caffe (29829d1; the Caffe a8039974/py-R-FCN-1's soft R-FCN nets were written for): SOFTROIPooling
(src/caffe/layers/softroi_pooling_layers.cpp and .cu, include/caffe/layers/softroi_pooling_layer.hpp; 2 bottoms,
1 top, no blobs; softroi_pooling_param output_dim M and mask_num K, both CHECKed > 0).

Data (N, M K, H, W), channel m K + k, and a soft mask (N, K, H, W) give a (N, M, K, 1) top, each bin the
mask-weighted mean of its channel:
    s[n, m, k]   = sum over (h, w) of mask[n, k, h, w]
    top[n, m, k] = (sum over (h, w) of data[n, m K + k, h, w] * mask[n, k, h, w]) / s[n, m, k]
summed row by row in float32.  Forward_gpu (SOFTROIPoolingForward) divides where s != 0 and leaves the plain
weighted sum (0 for an all-zero mask) elsewhere; Forward_cpu divides only where s > 0: the two differ only where a
mask sums below 0 (the nets' masks are softmax outputs, positive).  caffeq computes Forward_gpu's, as the fork's
users get it: the fork builds only with CUDA (softroi_pooling_layers.cpp leaves STUB_GPU commented out, so a
CPU_ONLY build cannot link the layer; its PSROIPooling has no Forward_cpu at all), and py-R-FCN's
tools/test_net.py runs these nets after caffe.set_mode_gpu().  The fork does not check the shapes (its Reshape takes the
top's N from the mask, the loops the data's): it reads the data as (N, M, K, H, W) and the mask at the data's
N, H and W, so caffeq requires exactly those shapes.  The rois are not read: the nets pool them beforehand.
"""
import torch

from .jialinwu_rfcn import MaskedRoiPooling
from .norm import onnx_reduce
from .registry import register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def soft_roi_pool(data, mask, groups: int, masks: int):
    """(N, M K, H, W) data and (N, K, H, W) masks -> (N, M, K, 1): each channel's mask-weighted mean, the plain
    weighted sum where the mask's sum is 0 (Forward_gpu)."""
    n, _, h, w = data.shape
    weights = mask.reshape(n, 1, masks, h * w)
    total = (data.reshape(n, groups, masks, h * w) * weights).sum(-1, keepdim=True)
    norm = weights.sum(-1, keepdim=True).expand(n, groups, masks, 1)
    return torch.where(norm != 0, total / norm, total)


@register_layer("SOFTROIPooling")
class SoftROIPooling(MaskedRoiPooling):
    def macs(self, attrs, in_shapes, out_shapes):
        return int(torch.Size(in_shapes[0]).numel())

    def forward(self, attrs, params, data, mask):
        return soft_roi_pool(data, mask, attrs["groups"], attrs["masks"])

    def onnx(self, ctx, node):
        data, mask = node.inputs
        n, _, h, w = ctx.shape(data)
        g, k = node.attrs["groups"], node.attrs["masks"]
        weights = ctx.op("Reshape", [mask, ctx.i64([n, 1, k, h * w])], "weights")
        grouped = ctx.op("Reshape", [data, ctx.i64([n, g, k, h * w])], "grouped")
        product = ctx.op("Mul", [grouped, weights], "weighted")
        total = onnx_reduce(ctx, "ReduceSum", product, [3], True, ctx.tmp(f"{node.name}_total"))
        norm = onnx_reduce(ctx, "ReduceSum", weights, [3], True, ctx.tmp(f"{node.name}_norm"))
        zero = ctx.op("Equal", [norm, ctx.f32(0.0)], "zero_sum")
        mean = ctx.op("Div", [total, norm], "mean")
        ctx.add_node("Where", [zero, total, mean], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(soft_roi_pool)}({emit.inputs[0]}, {emit.inputs[1]}, {a['groups']}, {a['masks']})"
