"""IntelLabs/SkimCaffe (Intel's sparse-CNN Caffe, 2f66b5a9): its fused inference layers and the fields
that pick its sparse algorithms.  Read from the fork's src/caffe/layers/conv_relu_layer.cpp,
conv_relu_pool_layer.cpp, conv_relu_pool_lrn_layer.cpp, relu_pooling_layer.cpp,
inner_product_relu_dropout_layer.cpp, base_conv_layer.cpp, conv_layer.cpp, inner_product_layer.cpp,
util/math_functions_intel.cpp and src/caffe/proto/caffe.proto.

Knobs that choose an algorithm, not a result (read, and otherwise ignored):
- convolution_param.conv_mode: LOWERED_GEMM (im2col + GEMM), LOWERED_CCNMM (the same GEMM without the
  weight matrix's all-zero columns), DIRECT_SCONV (direct convolution over the nonzero weights, the bias
  added in the kernel), DIRECT_DCONV (libxsmm's dense direct convolution).  Skipping exact zeros changes
  no result.  Where a mode does change one, caffeq refuses: DIRECT_DCONV on a fused type (the fork stops:
  "only supported for unfused Convolution layer"), DIRECT_SCONV without a bias (the fork stops), and
  DIRECT_SCONV on a plain Convolution (the kernel adds the bias and ConvolutionLayer::Forward_cpu adds it
  once more: a doubled bias caffeq does not reproduce).
- inner_product_param.gemm_mode: GEMM or SPMDM (libxsmm's sparse weights times dense activations, the
  same product).  SPGEMM is refused (the fork stops: "not supported yet").  With SPMDM (and transpose
  false) spmdm_transpose_in: false reads the bottom's memory as K x M, and spmdm_transpose_out: false
  writes the product's memory as N x M, then adds the bias and the ReLU over that memory read as M x N:
  caffeq reproduces both.  The fork's chain fc6 (out: false) -> fc7 (in: false) gives the plain result
  at fc7 for one row (batch 1) or a zero fc6 bias; otherwise fc6's bias lands by position in the
  transposed memory, in the fork as here, and the fc6 blob holds that memory.
- convolution_param / inner_product_param dump_parameter, dump_activation,
  parameter_sparsity_pattern_histogram: write files or logs.  LayerParameter.connectivity_mode:
  zeroes weights at or under the solver's prune_threshold when weights are loaded (Blob::Disconnect);
  without a solver (testing, deploying) that threshold is 0, so only training sees it.  ParamSpec's
  breadth_decay_mult, kernel_shape_decay_mult, block_group_lasso, regularization_type: training only.

The fused types (each 2-D, one bottom's NCHW blob; blobs as Convolution's / InnerProduct's so that
caffemodels load):
- ConvolutionReLU: convolution_param's convolution (+ bias), then max(y, 0); one top per bottom as
  Convolution.  relu_param.negative_slope must be 0 (the fork stops otherwise).
- ConvolutionReLUPool: the convolution, then MAX pooling by pooling_param with each window's maximum
  started at 0 (which is the ReLU: max and the ReLU commute, and an empty window gives 0); BVLC's pooled
  size (ceil).  AVE / STOCHASTIC are NOT_IMPLEMENTED in the fork.  With a pool pad the fork starts a
  window cut by the top / left pad at row (column) 0 and keeps kernel rows (BVLC's keeps kernel - pad):
  reproduced.  A second top gets the argmax index written over top 0: refused.  One bottom (the fork writes
  every bottom's result into top 0).
- ConvolutionReLUPoolLRN: the same, then BVLC's ACROSS_CHANNELS LRN of lrn_param (k + alpha / n times
  the window's sum of squares, to -beta); WITHIN_CHANNEL is refused (the fork's forward asserts
  ACROSS).  The fork writes each image's top in runs of 8 values and leaves the last
  (C x pooled H x pooled W) mod 8 unwritten, and with DIRECT_SCONV its AVX2 / AVX-512 build pools only
  inside AlexNet's conv2 kernel (27 x 27 input, 5 x 5 kernel, pad 2, stride 1, then 3 x 3 / 2 MAX pooling),
  leaving the pooled blob unwritten otherwise: those nets are read and sized, not run.
- ReLUPooling: MAX pooling of BVLC's windows from 0 (ReLU, then Pooling); one top.
- InnerProductReLUDropout: InnerProduct, then max(y, 0) + negative_slope * min(y, 0).  No dropout at
  all: dropout_param is never read by its forward (TRAIN included).
Each composes caffeq's Convolution / Pooling / LRN / InnerProduct (forward, ONNX and model.py).
"""
import copy
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ExportError
from .activation import ReLU
from .conv import Convolution, InnerProduct, _onnx_conv, _torch_conv_source
from .norm import ACROSS_CHANNELS, LRN, caffe_lrn
from .pooling import AVE, MAX, STOCHASTIC, Pooling, caffe_pool, is_synopsys, window
from .registry import LayerError, claim_layers, count, need_blobs, register_layer

LOWERED_GEMM, LOWERED_CCNMM, DIRECT_SCONV, DIRECT_DCONV = 0, 1, 2, 3
GEMM, SPMDM, SPGEMM = 0, 1, 2


def _has(p, field):
    return field in p.DESCRIPTOR.fields_by_name


def _conv_mode(lp, fused):
    p = lp.convolution_param
    mode = int(p.conv_mode) if _has(p, "conv_mode") else LOWERED_GEMM
    if fused and mode == DIRECT_DCONV:
        raise LayerError(f"convolution_param.conv_mode DIRECT_DCONV: SkimCaffe runs it for a plain Convolution "
                         f"only (it stops on a {lp.type})")
    if mode == DIRECT_SCONV and not p.bias_term:
        raise LayerError("convolution_param.conv_mode DIRECT_SCONV needs bias_term (SkimCaffe stops: "
                         "\"DIRECT_SCONV only works with bias term\")")
    return mode


def _zero_slope(lp):
    if lp.relu_param.negative_slope != 0:
        raise LayerError(f"relu_param.negative_slope {lp.relu_param.negative_slope:g}: SkimCaffe's {lp.type} "
                         f"only supports negative_slope 0 (it stops otherwise)")


def _fused_pool(lp):
    """pooling_param as the fused conv / ReLU pools read it: MAX, BVLC's fields only, one top."""
    attrs = Pooling().parse(lp)
    if attrs["pool"] != MAX:
        raise LayerError(f"pooling_param.pool: SkimCaffe's {lp.type} pools MAX only (AVE and STOCHASTIC are "
                         f"NOT_IMPLEMENTED there)")
    if is_synopsys(attrs) or attrs.get("fork") is not None:
        raise LayerError(f"pooling_param: {lp.type} reads BVLC's pooling fields only")
    if attrs["mask"]:
        raise LayerError(f"{lp.type} with a second (argmax) top: SkimCaffe writes the argmax index over "
                         f"top 0; not reproduced")
    return attrs


def _node_like(node, **changes):
    """A copy of the graph node with other attrs / inputs / outputs / name, for a composed spec."""
    sub = copy.copy(node)
    for k, v in changes.items():
        setattr(sub, k, v)
    return sub


@contextmanager
def _emitting_on(emit, inputs, shapes, suffix=None):
    """Let a composed spec's pytorch_source see `inputs` (of `shapes`) and, with a suffix, its own
    attribute name."""
    saved = emit.inputs, emit.attr
    emit.inputs = list(inputs)
    if suffix:
        emit.attr = emit.extra_attr(suffix)
    emit.in_shape = lambda i=0: tuple(shapes[i])
    try:
        yield
    finally:
        emit.inputs, emit.attr = saved
        del emit.in_shape


def _local(emit, expr, hint):
    t = emit.tmp(hint)
    emit.stmt(f"{t} = {expr}")
    return t


def _four_axes(shape, what):
    if len(shape) != 4:
        raise LayerError(f"{what} is 2-D in SkimCaffe: it needs a 4-axis (N, C, H, W) bottom, got {list(shape)}")


# ---- the fused pools' own windows with a pad (torch: used by forward and copied into model.py) ------

def skim_padded_windows_max(x, kernel: list[int], stride: list[int], pad: list[int], out: list[int]):
    """SkimCaffe's fused MAX pooling from 0 (the ReLU) with a pad: output row i takes input rows
    [max(i * stride - pad, 0), that + kernel) cut at the input's end (its windows keep kernel rows
    where BVLC's lose the pad's), the same for columns; `out`: BVLC's pooled size."""
    y = F.max_pool2d(F.pad(F.relu(x), [0, kernel[1] - 1, 0, kernel[0] - 1]), kernel, 1)
    rows = (torch.arange(out[0], device=x.device) * stride[0] - pad[0]).clamp_min(0)
    cols = (torch.arange(out[1], device=x.device) * stride[1] - pad[1]).clamp_min(0)
    return y.index_select(2, rows).index_select(3, cols)


def _onnx_padded_windows_max(ctx, node, pool, x, shape, out):
    """skim_padded_windows_max in ONNX: Relu, Pad, a stride-1 MaxPool, a Gather per spatial axis."""
    k, s, p, size = window(pool, shape[2], shape[3])
    y = ctx.add_node("Relu", [x], [ctx.tmp(node.name + "_relu0")])[0]
    pads = ctx.const(np.array([0, 0, 0, 0, 0, 0, k[0] - 1, k[1] - 1], np.int64))
    y = ctx.add_node("Pad", [y, pads], [ctx.tmp(node.name + "_padded")])[0]
    y = ctx.add_node("MaxPool", [y], [ctx.tmp(node.name + "_max")], kernel_shape=list(k), strides=[1, 1])[0]
    rows = ctx.const(np.maximum(np.arange(size[0]) * s[0] - p[0], 0).astype(np.int64))
    cols = ctx.const(np.maximum(np.arange(size[1]) * s[1] - p[1], 0).astype(np.int64))
    y = ctx.add_node("Gather", [y, rows], [ctx.tmp(node.name + "_rows")], axis=2)[0]
    ctx.add_node("Gather", [y, cols], [out], axis=3)


# ---- fused convolutions --------------------------------------------------------------------------

@register_layer("ConvolutionReLU")
class ConvolutionReLU(Convolution):
    """Convolution, then max(y, 0) (conv_relu_layer.cpp)."""

    def parse(self, lp):
        _zero_slope(lp)
        mode = _conv_mode(lp, fused=True)
        attrs = super().parse(lp)
        if attrs.get("first_conv") or attrs.get("orn"):
            raise LayerError(f"{lp.type} reads BVLC's convolution fields only")
        attrs["conv_mode"] = mode
        return attrs

    def infer(self, attrs, in_shapes):
        for s in in_shapes:
            _four_axes(s, self.types[0])
        return super().infer(attrs, in_shapes)

    def forward(self, attrs, params, *xs):
        ys = super().forward(attrs, params, *xs)
        return F.relu(ys) if len(xs) == 1 else tuple(F.relu(y) for y in ys)

    def onnx(self, ctx, node):
        convs = [ctx.tmp(f"{node.name}_conv{i}") for i in range(len(node.outputs))]
        _onnx_conv(ctx, node, "Conv", outputs=convs)
        for y, out in zip(convs, node.outputs):
            ctx.add_node("Relu", [y], [out])

    def pytorch_source(self, node, emit):
        calls = _torch_conv_source(node, emit, transposed=False)
        emit.uses("F")
        if isinstance(calls, list):
            return [f"F.relu({c})" for c in calls]
        return f"F.relu({calls})"


class _ConvPool(Convolution):
    """Convolution, then MAX pooling from 0 (the ReLU), then (with_lrn) BVLC's ACROSS_CHANNELS LRN."""
    with_lrn = False

    def parse(self, lp):
        need_blobs(lp, lp.type, bottoms=1, tops=1)
        _zero_slope(lp)
        mode = _conv_mode(lp, fused=True)
        attrs = super().parse(lp)
        if attrs.get("first_conv") or attrs.get("orn"):
            raise LayerError(f"{lp.type} reads BVLC's convolution fields only")
        pool = _fused_pool(lp)
        # with a pad the fork's windows are its own (skim_padded_windows_max); without one BVLC's
        attrs.update(conv_mode=mode, pool=pool, name=lp.name, fork_windows=not pool["global"] and any(pool["pad"]))
        if self.with_lrn:
            lrn = LRN().parse(lp)
            if lrn["region"] != ACROSS_CHANNELS:
                raise LayerError(f"lrn_param.norm_region WITHIN_CHANNEL: SkimCaffe's {lp.type} computes "
                                 f"ACROSS_CHANNELS only")
            attrs["lrn"] = lrn
        return attrs

    def _conv_top(self, attrs, in_shapes):
        _four_axes(in_shapes[0], self.types[0])
        return super().infer(attrs, in_shapes)[0]

    def infer(self, attrs, in_shapes):
        return Pooling().infer(attrs["pool"], [self._conv_top(attrs, in_shapes)])

    def cannot_run(self, attrs, in_shapes):
        if not self.with_lrn:
            return None
        conv_top = self._conv_top(attrs, in_shapes)
        top = self.infer(attrs, in_shapes)[0]
        per_image = count(top, 1)
        if per_image % 8:
            return (f"SkimCaffe writes each image's top in runs of 8 values and leaves the last "
                    f"{per_image % 8} of its {per_image} unwritten")
        pool = attrs["pool"]
        alexnet_conv2 = (tuple(in_shapes[0][2:]) == (27, 27) and tuple(attrs["kernel"]) == (5, 5)
                         and tuple(attrs["pad"]) == (2, 2) and tuple(attrs["stride"]) == (1, 1)
                         and tuple(attrs["dilation"]) == (1, 1)
                         and not pool["global"] and tuple(pool["kernel"]) == (3, 3)
                         and tuple(pool["stride"]) == (2, 2) and tuple(conv_top[2:]) == (27, 27))
        if attrs["conv_mode"] == DIRECT_SCONV and not alexnet_conv2:
            return ("with conv_mode DIRECT_SCONV SkimCaffe's AVX2 / AVX-512 build pools only inside its AlexNet "
                    "conv2 kernel (27x27 input, 5x5 kernel, pad 2, stride 1, 3x3 / 2 MAX pooling) and leaves "
                    "the pooled blob unwritten for other shapes")
        return None

    def macs(self, attrs, in_shapes, out_shapes):
        return super().macs(attrs, in_shapes, [self._conv_top(attrs, in_shapes)])

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)])
        y = super().forward(attrs, params, x)
        if attrs["fork_windows"]:
            k, s, p, out = window(attrs["pool"], y.shape[2], y.shape[3])
            y = skim_padded_windows_max(y, list(k), list(s), list(p), list(out))
        else:
            y = F.relu(caffe_pool(y, attrs["pool"]))
        if self.with_lrn:
            a = attrs["lrn"]
            y = caffe_lrn(y, a["size"], a["alpha"], a["beta"], a["k"], False)
        return y

    def onnx(self, ctx, node):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(node.inputs[0])], ExportError, node.type)
        conv = ctx.tmp(node.name + "_conv")
        _onnx_conv(ctx, node, "Conv", outputs=[conv])
        conv_top = self._conv_top(a, [ctx.shape(node.inputs[0])])
        relu_out = ctx.tmp(node.name + "_relu") if self.with_lrn else node.outputs[0]
        if a["fork_windows"]:
            _onnx_padded_windows_max(ctx, node, a["pool"], conv, conv_top, relu_out)
        else:
            pooled = ctx.tmp(node.name + "_pool")
            Pooling().onnx(ctx.with_shapes({conv: conv_top}),
                           _node_like(node, name=node.name + "_pool", attrs=a["pool"], inputs=[conv], outputs=[pooled]))
            ctx.add_node("Relu", [pooled], [relu_out])
        if self.with_lrn:
            LRN().onnx(ctx, _node_like(node, name=node.name + "_lrn", attrs=a["lrn"], inputs=[relu_out],
                                       outputs=node.outputs[:1]))

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(0)], ExportError, node.type)
        conv_top = self._conv_top(a, [emit.in_shape(0)])
        conv = _local(emit, _torch_conv_source(node, emit, transposed=False), node.name + "_conv")
        emit.uses("F")
        if a["fork_windows"]:
            k, s, p, out = window(a["pool"], *conv_top[2:])
            y = f"{emit.helper(skim_padded_windows_max)}({conv}, {list(k)}, {list(s)}, {list(p)}, {list(out)})"
        else:
            with _emitting_on(emit, [conv], [conv_top], "pool"):
                pooled = Pooling().pytorch_source(_node_like(node, attrs=a["pool"], name=node.name + "_pool"), emit)
            y = f"F.relu({pooled})"
        if self.with_lrn:
            top = self.infer(a, [emit.in_shape(0)])[0]
            y = _local(emit, y, node.name + "_relu")
            with _emitting_on(emit, [y], [top], "lrn"):
                y = LRN().pytorch_source(_node_like(node, attrs=a["lrn"], name=node.name + "_lrn"), emit)
        return y


@register_layer("ConvolutionReLUPool")
class ConvolutionReLUPool(_ConvPool):
    """Convolution, ReLU, MAX pooling (conv_relu_pool_layer.cpp)."""


@register_layer("ConvolutionReLUPoolLRN")
class ConvolutionReLUPoolLRN(_ConvPool):
    """Convolution, ReLU, MAX pooling, ACROSS_CHANNELS LRN (conv_relu_pool_lrn_layer.cpp)."""
    with_lrn = True


@claim_layers("Convolution", lambda lp: _has(lp.convolution_param, "conv_mode")
              and lp.convolution_param.conv_mode == DIRECT_SCONV)
class SparseDirectConvolution(Convolution):
    """A plain Convolution with conv_mode DIRECT_SCONV: SkimCaffe adds its bias twice; refused."""

    def parse(self, lp):
        raise LayerError("convolution_param.conv_mode DIRECT_SCONV on a plain Convolution: SkimCaffe's sparse "
                         "kernel adds the bias and ConvolutionLayer::Forward_cpu adds it once more "
                         "(use ConvolutionReLU, or another conv_mode); the doubled bias is not reproduced")


# ---- ReLUPooling ---------------------------------------------------------------------------------

@register_layer("ReLUPooling")
class ReLUPooling(Pooling):
    """MAX pooling of BVLC's windows, each maximum started at 0 (relu_pooling_layer.cpp)."""

    def parse(self, lp):
        need_blobs(lp, lp.type, bottoms=1, tops=1)
        _zero_slope(lp)
        return _fused_pool(lp)

    def infer(self, attrs, in_shapes):
        _four_axes(in_shapes[0], self.types[0])
        return super().infer(attrs, in_shapes)

    def forward(self, attrs, params, x):
        return F.relu(super().forward(attrs, params, x))

    def onnx(self, ctx, node):
        pooled = ctx.tmp(node.name + "_pool")
        super().onnx(ctx, _node_like(node, outputs=[pooled]))
        ctx.add_node("Relu", [pooled], node.outputs[:1])

    def pytorch_source(self, node, emit):
        emit.uses("F")
        return f"F.relu({super().pytorch_source(node, emit)})"


# ---- the MKL layers: BVLC's under another name, where MKL computes the same ------------------------

@register_layer("MKLReLU")
class MKLReLU(ReLU):
    """mkl_relu_layer.cpp: MKL's ReLU with relu_param.negative_slope, BVLC's."""


@register_layer("MKLPooling")
class MKLPooling(Pooling):
    """mkl_pooling_layer.cpp: BVLC's pooled size and MAX; MKL's average excludes the padding (its
    dnnAlgorithmPoolingAvg), so AVE is BVLC's only without padding; STOCHASTIC is NOT_IMPLEMENTED."""

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)
        if attrs["pool"] == STOCHASTIC or is_synopsys(attrs):
            raise LayerError("MKLPooling pools MAX or AVE (the fork: STOCHASTIC is NOT_IMPLEMENTED)")
        if attrs["pool"] == AVE and any(attrs.get("pad", ())):
            raise LayerError("MKLPooling's average excludes the padding (MKL's dnnAlgorithmPoolingAvg), which "
                             "BVLC's AVE counts: padded AVE is not supported")
        return shapes


@register_layer("MKLLRN")
class MKLLRN(LRN):
    """mkl_lrn_layer.cpp: MKL's ACROSS_CHANNELS LRN (size, alpha, beta, k), BVLC's; WITHIN_CHANNEL is
    NOT_IMPLEMENTED in the fork."""

    def parse(self, lp):
        if lp.lrn_param.norm_region != ACROSS_CHANNELS:
            raise LayerError("MKLLRN normalizes ACROSS_CHANNELS only (the fork: WITHIN_CHANNEL is NOT_IMPLEMENTED)")
        return super().parse(lp)


@register_layer("MKLConvolution")
class MKLConvolution(Convolution):
    """mkl_conv_layer.cpp: MKL's grouped convolution with bias, BVLC's; its output size ignores dilation."""

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)   # the spatial fields are read with the input's axes
        if any(d != 1 for d in attrs.get("dilation", ())):
            raise LayerError("MKLConvolution sizes its output without the dilation (the fork ignores it): "
                             "dilation must be 1")
        return shapes


# ---- inner products ------------------------------------------------------------------------------

def _parse_gemm(lp):
    """(gemm_mode, reads the bottom transposed, writes the product transposed)."""
    p = lp.inner_product_param
    mode = int(p.gemm_mode) if _has(p, "gemm_mode") else GEMM
    if mode == SPGEMM:
        raise LayerError("inner_product_param.gemm_mode SPGEMM: SkimCaffe stops (\"SPGEMM mode is not supported "
                         "yet\")")
    if mode != SPMDM or p.transpose:   # the fork's SPMDM path is for the (N, K) weight only
        return mode, False, False
    return mode, not p.spmdm_transpose_in, not p.spmdm_transpose_out


class _SkimInnerProduct(InnerProduct):
    relu = True

    def parse(self, lp):
        need_blobs(lp, lp.type, bottoms=1, tops=1)
        attrs = super().parse(lp)
        attrs["gemm_mode"], attrs["in_t"], attrs["out_t"] = _parse_gemm(lp)
        if attrs["out_t"]:
            attrs["fuse"] = "spmdm_transpose_out"   # no BatchNorm / Scale folds into its permuted bias (transforms.py)
        attrs["negative_slope"] = float(np.float32(lp.relu_param.negative_slope)) if self.relu else None
        return attrs

    def _mk(self, attrs, shape):
        axis = attrs["_axis"]
        return count(shape, 0, axis), count(shape, axis)

    def forward(self, attrs, params, x):
        if attrs["in_t"]:   # the bottom's memory read as K x M
            m, k = self._mk(attrs, x.shape)
            x = x.reshape(k, m).t().reshape(x.shape)
        if attrs["out_t"]:   # the product's memory written N x M, the bias added over it read as M x N
            y = super().forward(dict(attrs, bias_term=False), params[:1], x)
            y = y.reshape(-1, attrs["num_output"]).t().reshape(y.shape)
            if attrs["bias_term"]:
                y = y + params[1]
        else:
            y = super().forward(attrs, params, x)
        if not self.relu:
            return y
        return F.leaky_relu(y, attrs["negative_slope"]) if attrs["negative_slope"] else F.relu(y)

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        shape = [int(v) for v in ctx.shape(x)]
        if a["in_t"]:
            _, k = self._mk(a, shape)
            flat = ctx.add_node("Reshape", [x, ctx.const(np.array([k, -1], np.int64))], [ctx.tmp(node.name + "_km")])[0]
            t = ctx.add_node("Transpose", [flat], [ctx.tmp(node.name + "_mk")], perm=[1, 0])[0]
            x = ctx.add_node("Reshape", [t, ctx.const(np.array([-1] + shape[1:], np.int64))], [ctx.tmp(node.name + "_in")])[0]
        ctx = ctx.with_shapes({x: shape})
        out = node.outputs[0]
        last = out if not self.relu else ctx.tmp(node.name + "_ip")
        if a["out_t"]:
            mm = ctx.tmp(node.name + "_mm")
            super().onnx(ctx, _node_like(node, attrs=dict(a, bias_term=False), inputs=[x], outputs=[mm]))
            top = list(ctx.shape(x)[:a["_axis"]]) + [a["num_output"]]
            n = a["num_output"]
            mat = ctx.add_node("Reshape", [mm, ctx.const(np.array([-1, n], np.int64))], [ctx.tmp(node.name + "_mn")])[0]
            t = ctx.add_node("Transpose", [mat], [ctx.tmp(node.name + "_nm")], perm=[1, 0])[0]
            y = last if not a["bias_term"] else ctx.tmp(node.name + "_top")
            ctx.add_node("Reshape", [t, ctx.const(np.array([-1] + [int(v) for v in top[1:]], np.int64))], [y])
            if a["bias_term"]:
                ctx.add_node("Add", [y, ctx.weight(node, 1)], [last])
        else:
            super().onnx(ctx, _node_like(node, inputs=[x], outputs=[last]))
        if self.relu:
            if a["negative_slope"]:
                ctx.add_node("LeakyRelu", [last], [out], alpha=a["negative_slope"])
            else:
                ctx.add_node("Relu", [last], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        shape = emit.in_shape(0)
        x = emit.inputs[0]
        if a["in_t"]:
            _, k = self._mk(a, shape)
            x = _local(emit, f"{x}.reshape({k}, -1).t().reshape({(-1,) + tuple(shape[1:])})", node.name + "_in")
        if a["out_t"]:
            with _emitting_on(emit, [x], [shape]):
                y = super().pytorch_source(_node_like(node, attrs=dict(a, bias_term=False)), emit)
            y = f"{y}.reshape(-1, {a['num_output']}).t().reshape({(-1,) + tuple(shape[1:a['_axis']]) + (a['num_output'],)})"
            if a["bias_term"]:
                b = emit.module(f"nn.Parameter(torch.zeros({a['num_output']}))", attr=emit.extra_attr("bias"))
                emit.param("", 1, attr=b[len("self."):])
                y = f"({y} + {b})"
        else:
            with _emitting_on(emit, [x], [shape]):
                y = super().pytorch_source(node, emit)
        if not self.relu:
            return y
        emit.uses("F")
        if a["negative_slope"]:
            return f"F.leaky_relu({y}, {emit.lit(a['negative_slope'])})"
        return f"F.relu({y})"


@register_layer("InnerProductReLUDropout")
class InnerProductReLUDropout(_SkimInnerProduct):
    """InnerProduct, then the leaky ReLU of relu_param; no dropout (inner_product_relu_dropout_layer.cpp)."""


@claim_layers("InnerProduct", lambda lp: _has(lp.inner_product_param, "gemm_mode")
              and lp.inner_product_param.gemm_mode != GEMM)
class SparseInnerProduct(_SkimInnerProduct):
    """A plain InnerProduct with gemm_mode SPMDM (its transposed memory) or SPGEMM (refused)."""
    relu = False
