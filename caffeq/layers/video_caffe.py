"""chuckcho/video-caffe's cuDNN N-D layers: NdConvolution and NdPooling (read at fc232b3e; the layers
last changed in 0e7e2259 (cudnn_ndconv_layer) and 74eec0f4 (cudnn_ndpooling_layer), both present since
the fork's first commit b531b6c4).  Both read their window from BlobShape fields, one dim per spatial
axis: kernel_shape (required, each > 0), stride_shape (default 1s) and pad_shape (default 0s), the two
last with exactly as many dims as kernel_shape.  They ignore BVLC's kernel_size / stride / pad, and
their only engine is cuDNN (engine: CAFFE is NOT_IMPLEMENTED there).

- NdConvolution (CudnnNdConvolutionLayer): cuDNN cross-correlation, no dilation; weight
  (num_output, C / group, *kernel_shape), bias (num_output) when bias_term; group splits input and
  output channels as BVLC's.  Each output extent is (n + 2 pad - k) / stride + 1 rounded down, and
  compute_output_shape leaves out every extent that is 1: a (N, C, 1, H, W) result has the top
  (N, num_output, H', W').  The values keep their order, so caffeq convolves and squeezes those axes.
  One top per bottom, the bottoms all of one shape.
- NdPooling (CudnnNdPoolingLayer): cuDNN MAX (CUDNN_POOLING_MAX) or AVE
  (CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING); STOCHASTIC is a fatal "Unknown pooling method".
  Each extent rounds up as BVLC's Pooling: ceil((n + 2 pad - k) / stride) + 1, one less where that
  axis has a pad and the last window would start at or past n + pad.  global_pooling takes the
  input's spatial extents as the kernel (kernel_shape must still be given).  Windows inside the
  padded input are cuDNN's (MAX over the input cells, AVE = sum / kernel volume); where ceil
  rounding lets the last window run past the padded input, MAX takes the cells inside the input
  (BVLC's reading, pooling_nd.py) and AVE is refused: the divisor cuDNN uses there is not known.
  caffeq runs it on 3 spatial axes (5-axis input), the shape video-caffe's nets use.
"""

import numpy as np

from .conv import Convolution, _onnx_conv, _torch_conv_source, check_groups
from .pooling import CEIL, pooled_size
from .pooling_nd import POOL_AVE, POOL_MAX, WindowPool3d, first_empty_axis
from .registry import LayerError, need_blobs, positive_field, register_layer

ENGINE_CAFFE = 1
_BVLC_WINDOW_FIELDS = ("kernel_size", "kernel_h", "kernel_w", "stride", "stride_h", "stride_w",
                       "pad", "pad_h", "pad_w", "dilation")


def read_nd_window(p, field, type_name):
    """(kernel, stride, pad, reading notes) from kernel_shape / stride_shape / pad_shape, checked as
    the fork's LayerSetUp checks them (CHECK_GT kernel > 0, the dim counts equal)."""
    if int(p.engine) == ENGINE_CAFFE:
        raise LayerError(f"{field}.engine: CAFFE is not implemented for the fork's {type_name} (cuDNN only)")
    if not p.HasField("kernel_shape"):
        raise LayerError(f"{field}.kernel_shape is required by {type_name} (it does not read kernel_size)")
    kernel = tuple(int(d) for d in p.kernel_shape.dim)
    if not kernel:
        raise LayerError(f"{field}.kernel_shape needs one dim per spatial axis, got none")
    if min(kernel) < 1:
        raise LayerError(f"{field}.kernel_shape dims must be > 0, got {list(kernel)}")
    values = {}
    for name, default, low in (("stride_shape", 1, 1), ("pad_shape", 0, 0)):
        if not p.HasField(name):
            values[name] = (default,) * len(kernel)
            continue
        dims = tuple(int(d) for d in getattr(p, name).dim)
        if len(dims) != len(kernel):
            raise LayerError(f"{field}.{name} has {len(dims)} dims, kernel_shape {len(kernel)} (the fork "
                             f"needs one per spatial axis in both)")
        if min(dims) < low:
            raise LayerError(f"{field}.{name} dims must be >= {low}, got {list(dims)}")
        values[name] = dims
    given = {f.name for f, _ in p.ListFields()}
    ignored = [name for name in _BVLC_WINDOW_FIELDS if name in given]
    notes = [f"{type_name} reads kernel_shape / stride_shape / pad_shape only; {field}."
             f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored as in the fork"] if ignored else []
    return kernel, values["stride_shape"], values["pad_shape"], notes


def _check_rank(shape, kernel, type_name):
    if len(shape) != len(kernel) + 2:
        raise LayerError(f"{type_name}: kernel_shape has {len(kernel)} dims but the input {list(shape)} has "
                         f"{len(shape) - 2} spatial axes")


# ---- NdConvolution --------------------------------------------------------------------------------

@register_layer("NdConvolution")
class NdConvolution(Convolution):
    """BVLC's Convolution on the fork's window (conv.py runs it), then the extents of 1 squeezed out."""

    def parse(self, lp):
        if not lp.bottom or len(lp.top) != len(lp.bottom):
            raise LayerError(f"NdConvolution takes one top per bottom, got {len(lp.bottom)} bottoms and "
                             f"{len(lp.top)} tops")
        p = lp.convolution_param
        if not p.num_output:
            raise LayerError("convolution_param.num_output must be > 0")
        positive_field(int(p.group), "convolution_param.group")
        kernel, stride, pad, notes = read_nd_window(p, "convolution_param", "NdConvolution")
        attrs = {"num_output": int(p.num_output), "bias_term": bool(p.bias_term), "group": int(p.group),
                 "axis": 1, "_axis": 1, "_ndim": len(kernel) + 2, "kernel": kernel, "stride": stride,
                 "pad": pad, "dilation": (1,) * len(kernel), "edge_pads": None, "depthwise": False,
                 "orn": None, "param": p, "reading_notes": notes}
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _check_rank(s, attrs["kernel"], "NdConvolution")
        for other in in_shapes[1:]:
            if tuple(other) != s:
                raise LayerError(f"NdConvolution's bottoms must all have one shape, got {list(s)} and {list(other)}")
        check_groups(attrs, s[1])
        out = [(n + 2 * p - k) // st + 1 if n + 2 * p >= k else 0
               for n, k, st, p in zip(s[2:], attrs["kernel"], attrs["stride"], attrs["pad"])]
        if min(out) < 1:
            raise LayerError(f"output would be empty: input {list(s)}, kernel_shape {list(attrs['kernel'])}, "
                             f"pad_shape {list(attrs['pad'])}")
        # compute_output_shape pushes only the extents > 1
        attrs["_squeeze"] = tuple(2 + i for i, d in enumerate(out) if d == 1)
        top = (s[0], attrs["num_output"]) + tuple(d for d in out if d > 1)
        return [top] * len(in_shapes)

    def forward(self, attrs, params, *xs):
        ys = super().forward(attrs, params, *xs)
        if not attrs["_squeeze"]:
            return ys
        if isinstance(ys, tuple):
            return tuple(y.squeeze(attrs["_squeeze"]) for y in ys)
        return ys.squeeze(attrs["_squeeze"])

    def onnx(self, ctx, node):
        squeeze = node.attrs["_squeeze"]
        if not squeeze:
            _onnx_conv(ctx, node, "Conv")
            return
        # BVLC's Conv into a full-rank temporary per top, then the fork's extents of 1 squeezed out
        full = [ctx.tmp(f"{y}_full") for y in node.outputs]
        _onnx_conv(ctx, node, "Conv", outputs=full)
        for conv_out, y in zip(full, node.outputs):
            ctx.add_node("Squeeze", [conv_out, ctx.const(np.array(squeeze, np.int64))], [y])

    def pytorch_source(self, node, emit):
        calls = _torch_conv_source(node, emit, transposed=False)
        squeeze = node.attrs["_squeeze"]
        if not squeeze:
            return calls
        if isinstance(calls, str):
            return f"{calls}.squeeze({squeeze})"
        return [f"{c}.squeeze({squeeze})" for c in calls]


# ---- NdPooling ------------------------------------------------------------------------------------

@register_layer("NdPooling")
class NdPooling(WindowPool3d):
    def parse(self, lp):
        need_blobs(lp, "NdPooling", 1, 1)
        p = lp.pooling_param
        method = int(p.pool)
        if method not in (POOL_MAX, POOL_AVE):
            raise LayerError("pooling_param.pool: the fork's NdPooling has MAX and AVE only (STOCHASTIC is an "
                             "unknown pooling method there)")
        kernel, stride, pad, notes = read_nd_window(p, "pooling_param", "NdPooling")
        return {"method": method, "global": bool(p.global_pooling), "kernel_shape": kernel,
                "stride": stride, "pad": pad, "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _check_rank(s, attrs["kernel_shape"], "NdPooling")
        if len(s) != 5:
            raise LayerError(f"caffeq runs NdPooling on 3 spatial axes (a 5-axis input) only, got {list(s)}")
        sizes = [int(n) for n in s[2:]]
        kernel = list(sizes) if attrs["global"] else list(attrs["kernel_shape"])
        stride, pad = list(attrs["stride"]), list(attrs["pad"])
        for axis, (k, p) in enumerate(zip(kernel, pad)):
            if p >= k:
                raise LayerError(f"pad {p} >= kernel {k} on axis {axis + 2}: windows entirely in the padding "
                                 f"are not reproduced")
        if any(n + 2 * p < k for n, k, p in zip(sizes, kernel, pad)):
            raise LayerError(f"output would be empty: input {list(s)}, kernel {kernel}, pad_shape {pad}")
        out = [pooled_size(n, k, st, p, CEIL) for n, k, st, p in zip(sizes, kernel, stride, pad)]
        axis = first_empty_axis(sizes, stride, pad, out)
        if axis is not None:
            raise LayerError(f"the last window of axis {axis + 2} starts past the input (stride {stride[axis]} > "
                             f"kernel {kernel[axis]}); cuDNN's result there is not reproduced")
        if attrs["method"] == POOL_AVE:
            for axis, (n, k, st, p, o) in enumerate(zip(sizes, kernel, stride, pad, out)):
                if (o - 1) * st - p + k > n + p:
                    raise LayerError(f"AVE: the last window of axis {axis + 2} runs past the padded input "
                                     f"(ceil rounding); cuDNN's divisor for it is not known, so it is not run")
        attrs["_kernel"], attrs["_out"] = kernel, out
        return [s[:2] + tuple(out)]
