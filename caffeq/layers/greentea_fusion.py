"""naibaf7/caffe's (the OpenCL "greentea" Caffe) fused layers, as its tools/inference-optimize/model_fuse.py
writes them (models/inference_optimize/AlexNet-merged-1.prototxt): a Convolution that applies the ReLU
(and the Eltwise SUM) that followed it, and an LRN that applies the MAX Pooling that followed it.

- ConvolutionParameter.fuse_type (fields at 2996015; the kernels of conv_layer_spatial.cl at 5d46ed4a):
  FUSED_CONV_RELU: y = conv(x), then y > 0 ? y : y * relu_param.negative_slope.
  FUSED_CONV_ELTWISE_RELU: two bottoms; y = conv(bottom 0) + bottom 1, then the same ReLU.  The fork
  takes the layer's eltwise_param.operation (SUM only) and no coefficients in convolution_param's.
  Only the fork's Intel spatial engine (2-D, the engine the fused files are written for) applies them;
  its other engines ignore fuse_type.  FUSED_CONV_MAX_POOLING_RELU is declared but no engine applies it,
  so it is refused.
- LRNParameter.fuse_type FUSED_POOL_MAX (8770e67a .. 1a87e51a, lrn_layer.cpp / lrn_layer.cu / lrn.cl):
  an ACROSS_CHANNELS LRN, then MAX pooling with pooling_param's kernel_size and stride (first values,
  square, no pad, ceil rounding: BVLC's windows).  The fork checks kernel < 6, stride < 4 and
  kernel = stride + 1, and shapes its top (N, C, pooled W, pooled H) over data laid out (pooled H,
  pooled W): for H != W caffeq gives that same blob.  Later commits dropped the fusion (the LRN then
  ignores fuse_type and the net's shapes no longer fit its weights); caffeq reads the files as the
  fusing fork ran them.
"""
import numpy as np
import torch
import torch.nn.functional as F

from .activation import f32, scalar
from .conv import Convolution, _conv_nd, _conv_top_shapes, _onnx_conv, _torch_conv_source, conv_out_size
from .norm import ACROSS_CHANNELS, LRN, CaffeLRN, caffe_lrn, window_sum
from .registry import LayerError, claim_layers, count, need_blobs

UNFUSED, FUSED_CONV_MAX_POOLING_RELU, FUSED_CONV_RELU, FUSED_CONV_ELTWISE_RELU = 0, 1, 2, 3
FUSED_POOL_MAX = 1
ELTWISE_SUM = 1


def _fused_conv(lp):
    p = lp.convolution_param
    return "fuse_type" in p.DESCRIPTOR.fields_by_name and p.fuse_type != UNFUSED


def _fused_lrn(lp):
    p = lp.lrn_param
    return "fuse_type" in p.DESCRIPTOR.fields_by_name and p.fuse_type != UNFUSED


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------

def fused_relu(y, negative_slope: float):
    """The fused kernels' y > 0 ? y : y * negative_slope."""
    return torch.where(y > 0, y, y * negative_slope)


def lrn_pool_max(y, kernel: int, stride: int):
    """The fused LRN's MAX pooling: square windows from 0, ceil rounding (kernel = stride + 1 keeps no
    empty window), -FLT_MAX where no cell exceeds it; the top is laid out (pooled H, pooled W) and
    shaped (pooled W, pooled H) as the fork's Reshape writes it."""
    z = F.max_pool2d(y, kernel, stride, ceil_mode=True)
    z = z.clamp_min(-65504.0 if y.dtype == torch.float16 else -3.4028234663852886e38)
    return z.reshape(z.shape[0], z.shape[1], z.shape[3], z.shape[2])


@claim_layers("Convolution", _fused_conv)
class FusedConvolution(Convolution):
    """naibaf7/caffe's Convolution with fuse_type FUSED_CONV_RELU or FUSED_CONV_ELTWISE_RELU."""

    def parse(self, lp):
        p = lp.convolution_param
        fuse = int(p.fuse_type)
        if fuse not in (FUSED_CONV_RELU, FUSED_CONV_ELTWISE_RELU):
            name = p.FuseType.Name(fuse) if fuse in p.FuseType.values() else str(fuse)
            raise LayerError(f"convolution_param.fuse_type {name}: naibaf7/caffe declares it but none of its "
                             f"engines applies it")
        eltwise = fuse == FUSED_CONV_ELTWISE_RELU
        need_blobs(lp, "a Convolution fused with Eltwise" if eltwise else "a Convolution fused with ReLU",
                   bottoms=2 if eltwise else 1, tops=1, roles="data, summand" if eltwise else "")
        r = p.relu_param
        if r.relu6 or r.maximum > 0 or r.minimum != 0:
            raise LayerError("convolution_param.relu_param: the fused ReLU reads negative_slope only "
                             "(relu6 / maximum / minimum are synopsys-caffe's)")
        if eltwise:
            if len(p.eltwise_param.coeff):
                raise LayerError("convolution_param.eltwise_param.coeff: the fused Eltwise takes no coefficients")
            if lp.eltwise_param.operation != ELTWISE_SUM:
                raise LayerError("eltwise_param.operation: the fused Eltwise is a SUM")
        attrs = super().parse(lp)
        if attrs.get("first_conv") or attrs.get("orn"):
            raise LayerError("convolution_param.fuse_type does not go with another fork's convolution fields")
        attrs.update(fuse=fuse, negative_slope=f32(r.negative_slope))
        return attrs

    def infer(self, attrs, in_shapes):
        x = in_shapes[0]
        if len(x) != 4:
            raise LayerError(f"the fused convolution (the fork's spatial engine) is 2-D: it needs a 4-axis "
                             f"input, got {list(x)}")
        top = _conv_top_shapes(attrs, in_shapes[:1], conv_out_size)[0]
        if attrs["fuse"] == FUSED_CONV_ELTWISE_RELU and tuple(in_shapes[1]) != tuple(top):
            raise LayerError(f"the fused Eltwise adds bottom 1 of shape {list(in_shapes[1])} to the convolution's "
                             f"{list(top)}: they must match")
        return [top]

    def param_shapes(self, attrs, in_shapes):
        return super().param_shapes(attrs, in_shapes[:1])

    def forward(self, attrs, params, x, *summand):
        y = _conv_nd(x, attrs, params[0], params[1] if attrs["bias_term"] else None, False)
        if summand:
            y = y + summand[0]
        return fused_relu(y, attrs["negative_slope"])

    def macs(self, attrs, in_shapes, out_shapes):
        return super().macs(attrs, in_shapes[:1], out_shapes)

    def onnx(self, ctx, node):
        a = node.attrs
        y = ctx.tmp(node.name + "_conv")
        _onnx_conv(ctx, node, "Conv", inputs=node.inputs[:1], outputs=[y])
        if a["fuse"] == FUSED_CONV_ELTWISE_RELU:
            y = ctx.add_node("Add", [y, node.inputs[1]], [ctx.tmp(node.name + "_sum")])[0]
        if a["negative_slope"] == 0:
            ctx.add_node("Relu", [y], [node.outputs[0]])
        else:
            neg = ctx.add_node("Mul", [y, scalar(ctx, a["negative_slope"])], [ctx.tmp(node.name + "_neg")])[0]
            positive = ctx.add_node("Greater", [y, scalar(ctx, 0.0)], [ctx.tmp(node.name + "_positive")])[0]
            ctx.add_node("Where", [positive, y, neg], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        y = _torch_conv_source(node, emit, transposed=False, inputs=emit.inputs[:1])
        if a["fuse"] == FUSED_CONV_ELTWISE_RELU:
            y = f"({y} + {emit.inputs[1]})"
        return f"{emit.helper(fused_relu)}({y}, {emit.lit(a['negative_slope'])})"


@claim_layers("LRN", _fused_lrn)
class FusedLRN(LRN):
    """naibaf7/caffe's LRN with fuse_type FUSED_POOL_MAX: ACROSS_CHANNELS LRN, then MAX pooling."""

    def parse(self, lp):
        attrs = super().parse(lp)
        p = lp.lrn_param
        if p.fuse_type != FUSED_POOL_MAX:
            raise LayerError(f"lrn_param.fuse_type {p.fuse_type}: naibaf7/caffe knows FUSED_POOL_MAX (1) only")
        if attrs["region"] != ACROSS_CHANNELS:
            raise LayerError("lrn_param.fuse_type FUSED_POOL_MAX needs norm_region ACROSS_CHANNELS")
        pool = p.pooling_param
        if pool.pool != 0:
            raise LayerError("lrn_param.pooling_param.pool: the fused pooling is MAX")
        if not len(pool.kernel_size) or not len(pool.stride):
            raise LayerError("lrn_param.pooling_param: the fused pooling reads kernel_size and stride (both required)")
        if len(pool.dilation):
            raise LayerError("lrn_param.pooling_param.dilation: the fused pooling takes none")
        k, s = int(pool.kernel_size[0]), int(pool.stride[0])
        if not (k < 6 and 1 <= s < 4 and k - s == 1):
            raise LayerError(f"lrn_param.pooling_param: the fused pooling needs kernel_size < 6, stride < 4 and "
                             f"kernel_size = stride + 1, got kernel_size {k}, stride {s}")
        attrs.update(pool_kernel=k, pool_stride=s)
        return attrs

    def infer(self, attrs, in_shapes):
        n, c, h, w = super().infer(attrs, in_shapes)[0]
        k, s = attrs["pool_kernel"], attrs["pool_stride"]
        if min(h, w) < k:
            raise LayerError(f"the fused {k}x{k} pooling needs an input of at least {k}x{k}, got {h}x{w}")
        ph, pw = (-(-(v - k) // s) + 1 for v in (h, w))
        return [(n, c, pw, ph)]

    def forward(self, attrs, params, x):
        y = caffe_lrn(x, attrs["size"], attrs["alpha"], attrs["beta"], attrs["k"], False)
        return lrn_pool_max(y, attrs["pool_kernel"], attrs["pool_stride"])

    def macs(self, attrs, in_shapes, out_shapes):
        return super().macs(attrs, in_shapes, in_shapes) + count(out_shapes[0]) * attrs["pool_kernel"] ** 2

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        h, w = (int(v) for v in ctx.shape(x)[2:])
        k, s = a["pool_kernel"], a["pool_stride"]
        y = ctx.tmp(node.name + "_lrn")
        ctx.add_node("LRN", [x], [y], name=node.name, size=a["size"], alpha=a["alpha"], beta=a["beta"], bias=a["k"])
        ph, pw = (-(-(v - k) // s) + 1 for v in (h, w))
        ends = [(o - 1) * s + k - v for o, v in ((ph, h), (pw, w))]   # < k: the ceil windows reach no further
        z = ctx.add_node("MaxPool", [y], [ctx.tmp(node.name + "_pool")], kernel_shape=[k, k], strides=[s, s],
                         pads=[0, 0] + ends)[0]
        if h == w:
            ctx.add_node("Max", [z, scalar(ctx, -3.4028234663852886e38)], [node.outputs[0]])
            return
        z = ctx.add_node("Max", [z, scalar(ctx, -3.4028234663852886e38)], [ctx.tmp(node.name + "_floor")])[0]
        shape = ctx.const(np.array([0, 0, pw, ph], np.int64), node.name + "_shape")
        ctx.add_node("Reshape", [z, shape], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [str(a["size"]), f"alpha={emit.lit(a['alpha'])}", f"beta={emit.lit(a['beta'])}", f"k={emit.lit(a['k'])}"]
        emit.helper(window_sum)
        emit.helper(caffe_lrn)
        m = emit.module(f"{emit.helper(CaffeLRN)}({', '.join(args)})")
        return f"{emit.helper(lrn_pool_max)}({m}({emit.inputs[0]}), {a['pool_kernel']}, {a['pool_stride']})"
