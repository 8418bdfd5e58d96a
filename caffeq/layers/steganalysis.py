"""The JPEG steganalysis forks' layers: GuanshuoXu/caffe_deep_learning_for_steganalysis (2139f17, Xu's
J-XuNet) and its copy Ante-Su/RXGNet (bed7e46); the four layers' sources are the same in both
(src/caffe/layers/bn_conv_layer.cu, bdct_to_spatial_layer.cu, quant_trunc_abs_layer.cu,
relu_recover_layer.cu).  Their CPU forwards are NOT_IMPLEMENTED: the GPU kernels define them.

- BNConv (bn_conv_param decay [0.95], fix [false]): batch normalization with blobs scale, shift,
  moving mean, moving variance, each (1, C, 1, 1).  At TEST (or with fix) y = ((x - mean) /
  pow(var + 1e-10, 0.5)) x scale + shift; in training the batch's mean and biased variance, and the
  moving ones become decay x batch + (1 - decay) x moving.  That is yjxiong/caffe's BN (segmentation.py's
  TSN form) under another name and message.  Without weights caffeq starts at 1, 0, 0, 1 as for BN (the
  fork's variance 0 would scale by 1e5 until trained).
- BdctToSpatial (bdct_to_spatial_param quality [75]): a JPEG's quantized luminance DCT coefficients
  (N, 64, Hb, Wb), channel u x 8 + v (vertical, horizontal frequency), to the decompressed pixels
  (N, 1, 8 Hb, 8 Wb): each coefficient times the quality's fixed quantization table (75 or 95; the
  file's own table is not read), then the orthonormal 8 x 8 inverse DCT of each block, with no level
  shift, rounding or clipping.  quality is truncated to int.  Here the inverse DCT is a stride-8
  transposed convolution with the 64 basis blocks; the fork's butterfly adds in another order.
- QuantTruncAbs (quant_trunc_abs_param process [QUANTTRUNCABS], threshold [1], in place only): with
  round(t) = trunc(t) + (t - trunc(t) >= 0.5) on t = |x| and th = threshold:
  QUANTTRUNCABS min(round|x|, th); QUANT sign(x) round|x|; ABS |x|; TRUNC clamp(x, -th, th);
  QUANTTRUNC sign(x) min(round|x|, th); QUANTABS round|x|; TRUNCABS min(|x|, th) (sign(0) = +1).
- ReLURecover (relu_param negative_slope): ReLU that keeps its bottom for BNConv's backward; in place
  only (its Reshape never sizes a separate top).
- ImageDataSteganalysisJpegDct, their data layer (the cover and stego coefficient planes and the label),
  is a graph input like any fork's data layer: --input-shape data=N,64,Hb,Wb.

Three more steganalysis nets' forks:
- DctrQT (tansq/hybrid_deep_learning_framework_for_jpeg_steganalysis a88b4f2, dctrqt_caffe.patch):
  y = min(|round(x / quantization_step)|, threshold), std::round's halves away from zero on the float32
  quotient: QUANTTRUNCABS of x / quantization_step.  Not in place (the fork checks it).
- Trunc (yedmed/steganalysis_with_CNN_Yedroudj-Net 43ef244, caffe_version/trunc_layer.cpp and .cu): the
  truncated linear unit, y = x > T ? T : (x < -T ? -T : x) with T = trunc_param.scale (NaN passes).  The
  repository ships no caffe.proto; its caffemodel gives the field numbers, not the default of an unset
  scale (its paper's first truncation uses T = 3): such a layer is read and sized, and running it asks
  for the value.
- SplitByPhase (librauee/Steganalysis f784469, PhaseAwareNet_SRC/Caffe/split_by_phase_layer.cpp): the 8 x 8
  JPEG grid's phases of a 512 x 512 map as channels, out[n, c * 64 + p, h, w] = in[n, c, 8h + p // 8,
  8w + p % 8] (channel-major; the fork checks the 512 x 512 input).
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ExportError
from .learnable_dilation import Truncation
from .registry import FunctionLayer, Layer, LayerError, four_axes, need_blobs, register_layer
from .segmentation import BN, TSN

# the forks' fixed luminance quantization tables, index u x 8 + v (IJG's table scaled for QF 75 and 95)
JPEG_QUANT_TABLES = {
    75: [8, 6, 5, 8, 12, 20, 26, 31, 6, 6, 7, 10, 13, 29, 30, 28, 7, 7, 8, 12, 20, 29, 35, 28,
         7, 9, 11, 15, 26, 44, 40, 31, 9, 11, 19, 28, 34, 55, 52, 39, 12, 18, 28, 32, 41, 52, 57, 46,
         25, 32, 39, 44, 52, 61, 60, 51, 36, 46, 48, 49, 56, 50, 52, 50],
    95: [2, 1, 1, 2, 2, 4, 5, 6, 1, 1, 1, 2, 3, 6, 6, 6, 1, 1, 2, 2, 4, 6, 7, 6, 1, 2, 2, 3, 5, 9, 8, 6,
         2, 2, 4, 6, 7, 11, 10, 8, 2, 4, 6, 6, 8, 10, 11, 9, 5, 6, 8, 9, 10, 12, 12, 10,
         7, 9, 10, 10, 11, 10, 10, 10],
}


def idct_basis():
    """(64, 1, 8, 8) float32: channel u x 8 + v holds C(u) C(v) / 4 cos((2y+1) u pi / 16) cos((2x+1) v pi / 16)
    at (y, x), C(0) = 1 / sqrt 2, C(k) = 1."""
    k = np.arange(8)
    c = np.where(k == 0, 1 / math.sqrt(2), 1.0) / 2
    m = c[None, :] * np.cos((2 * k[:, None] + 1) * k[None, :] * math.pi / 16)   # [y, u]
    basis = np.einsum("yu,xv->uvyx", m, m)
    return basis.reshape(64, 1, 8, 8).astype(np.float32)


def bdct_to_spatial(x, table, basis):
    """BdctToSpatial: (N, 64, Hb, Wb) quantized coefficients -> (N, 1, 8 Hb, 8 Wb) pixels."""
    return F.conv_transpose2d(x * table.reshape(1, 64, 1, 1), basis, stride=8)


def quant_trunc_abs(x, process: str, threshold: float):
    """QuantTruncAbs's seven element-wise modes, by their enum names (see the module docstring)."""
    t = torch.where(x >= 0, x, -x)
    whole = torch.trunc(t)
    rounded = whole + (t - whole >= 0.5).to(x.dtype)
    sign = torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))
    if process in ("QUANTTRUNCABS", "QUANTTRUNC"):
        rounded = rounded.clamp(max=threshold)
    if process in ("QUANT", "QUANTTRUNC"):
        return sign * rounded
    if process in ("QUANTTRUNCABS", "QUANTABS"):
        return rounded
    if process == "TRUNC":
        return x.clamp(-threshold, threshold)
    if process == "ABS":
        return t
    return torch.where(t > threshold, torch.full_like(t, threshold), t)   # TRUNCABS: NaN stays


def _in_place_only(lp, what):
    need_blobs(lp, what, 1, 1)
    if lp.top[0] != lp.bottom[0]:
        raise LayerError(f"{what} works in place only (top '{lp.top[0]}' must be its bottom "
                         f"'{lp.bottom[0]}'), as the fork checks")


@register_layer("BNConv")
class BNConv(BN):
    def parse(self, lp):
        need_blobs(lp, "BNConv", 1, 1)
        p = lp.bn_conv_param
        if not 0 <= p.decay <= 1:
            raise LayerError(f"bn_conv_param.decay must be in [0, 1], got {p.decay}")
        return {"variant": TSN, "eps": 1e-10, "momentum": 1.0 - float(p.decay), "frozen": bool(p.fix)}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) != 4:
            raise LayerError(f"BNConv needs an (N, C, H, W) input, got {list(in_shapes[0])}")
        return super().infer(attrs, in_shapes)


@register_layer("BdctToSpatial")
class BdctToSpatial(FunctionLayer):
    def parse(self, lp):
        need_blobs(lp, "BdctToSpatial", 1, 1)
        quality = int(lp.bdct_to_spatial_param.quality)   # C++ float -> int
        if quality not in JPEG_QUANT_TABLES:
            raise LayerError(f"bdct_to_spatial_param.quality must be 75 or 95 (the fork's two tables), "
                             f"got {lp.bdct_to_spatial_param.quality}")
        return {"quality": quality}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4 or s[1] != 64:
            raise LayerError(f"BdctToSpatial takes the 64 DCT modes of each 8 x 8 block, (N, 64, Hb, Wb), got {list(s)}")
        return [(s[0], 1, 8 * s[2], 8 * s[3])]

    def _constants(self, attrs, like):
        table = torch.tensor(JPEG_QUANT_TABLES[attrs["quality"]], dtype=like.dtype, device=like.device)
        return table, torch.from_numpy(idct_basis()).to(like)

    def forward(self, attrs, params, x):
        return bdct_to_spatial(x, *self._constants(attrs, x))

    def onnx(self, ctx, node):
        table = np.array(JPEG_QUANT_TABLES[node.attrs["quality"]], np.float32).reshape(1, 64, 1, 1)
        scaled = ctx.op("Mul", [node.inputs[0], ctx.const(table)], "dequantized")
        ctx.add_node("ConvTranspose", [scaled, ctx.const(idct_basis())], [node.outputs[0]], strides=[8, 8],
                     kernel_shape=[8, 8])

    def pytorch_source(self, node, emit):
        emit.uses("F")
        fn = emit.helper(bdct_to_spatial)
        table = np.array(JPEG_QUANT_TABLES[node.attrs["quality"]], np.float32)
        m = emit.module("torch.nn.Module()")
        emit.init(f"{m}.register_buffer('table', torch.zeros(64))")
        emit.init(f"{m}.register_buffer('basis', torch.zeros(64, 1, 8, 8))")
        emit.buffer("table", table)
        emit.buffer("basis", idct_basis())
        return f"{fn}({emit.inputs[0]}, {m}.table, {m}.basis)"


@register_layer("QuantTruncAbs")
class QuantTruncAbs(FunctionLayer):
    def parse(self, lp):
        _in_place_only(lp, "QuantTruncAbs")
        p = lp.quant_trunc_abs_param
        threshold = int(p.threshold)
        if threshold >= 2 ** 31:   # the fork's (int) of the uint32
            threshold -= 2 ** 32
        return {"process": p.ProcessMethod.Name(p.process), "threshold": float(threshold)}

    def forward(self, attrs, params, x):
        return quant_trunc_abs(x, attrs["process"], attrs["threshold"])

    def onnx(self, ctx, node):
        onnx_quant_trunc_abs(ctx, node.inputs[0], node.outputs[0], node.attrs["process"], node.attrs["threshold"])

    def pytorch_source(self, node, emit):
        fn = emit.helper(quant_trunc_abs)
        return f"{fn}({emit.inputs[0]}, {node.attrs['process']!r}, {emit.lit(node.attrs['threshold'])})"


def onnx_quant_trunc_abs(ctx, x, out, process, threshold):
    """quant_trunc_abs in ONNX, from tensor x into tensor out."""
    th = ctx.f32(threshold)
    if process == "TRUNC":
        ctx.add_node("Clip", [x, ctx.f32(-threshold), th], [out])
        return
    positive = ctx.op("GreaterOrEqual", [x, ctx.f32(0.0)], "positive")
    t = ctx.op("Where", [positive, x, ctx.op("Neg", [x], "neg")], "abs")
    if process == "ABS":
        ctx.add_node("Identity", [t], [out])
        return
    if process == "TRUNCABS":
        ctx.add_node("Where", [ctx.op("Greater", [t, th], "over"), th, t], [out])
        return
    whole = ctx.op("Floor", [t], "whole")   # t >= 0: floor is the truncation
    up = ctx.op("Cast", [ctx.op("GreaterOrEqual", [ctx.op("Sub", [t, whole], "frac"), ctx.f32(0.5)], "half")],
                "up", to=1)
    rounded = ctx.op("Add", [whole, up], "rounded")
    if process in ("QUANTTRUNCABS", "QUANTTRUNC"):
        rounded = ctx.op("Min", [rounded, th], "capped")
    if process in ("QUANT", "QUANTTRUNC"):
        sign = ctx.op("Where", [positive, ctx.f32(1.0), ctx.f32(-1.0)], "sign")
        ctx.add_node("Mul", [sign, rounded], [out])
    else:
        ctx.add_node("Identity", [rounded], [out])


@register_layer("ReLURecover")
class ReLURecover(FunctionLayer):
    def parse(self, lp):
        _in_place_only(lp, "ReLURecover")
        return {"slope": float(lp.relu_param.negative_slope)}

    def forward(self, attrs, params, x):
        return F.leaky_relu(x, attrs["slope"]) if attrs["slope"] else torch.relu(x)

    def onnx(self, ctx, node):
        slope = node.attrs["slope"]
        if slope:
            ctx.add_node("LeakyRelu", [node.inputs[0]], [node.outputs[0]], alpha=slope)
        else:
            ctx.add_node("Relu", [node.inputs[0]], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        slope = node.attrs["slope"]
        emit.uses("F")
        return f"F.leaky_relu({emit.inputs[0]}, {emit.lit(slope)})" if slope else f"torch.relu({emit.inputs[0]})"


# ---- DctrQT, Trunc, SplitByPhase -------------------------------------------------------------------


def dctr_qt(x, step: float, threshold: float):
    """DctrQT: QUANTTRUNCABS of x / step (a tensor divisor: CUDA would multiply by a scalar's reciprocal)."""
    return quant_trunc_abs(x / torch.tensor(step, dtype=x.dtype, device=x.device), "QUANTTRUNCABS", threshold)


def split_by_phase(x):
    """(N, C, 8H, 8W) -> (N, C * 64, H, W): channel c * 64 + 8 i + j holds the pixels at rows 8h + i,
    columns 8w + j."""
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 8, 8, w // 8, 8).permute(0, 1, 3, 5, 2, 4).reshape(n, c * 64, h // 8, w // 8)


@register_layer("DctrQT")
class DctrQT(FunctionLayer):
    def parse(self, lp):
        need_blobs(lp, "DctrQT", 1, 1, in_place=False)
        p = lp.dctrqt_param
        step = float(np.float32(p.quantization_step))
        if step == 0 or math.isnan(step):
            raise LayerError(f"dctrqt_param.quantization_step must be a nonzero number, got {step}")
        return {"step": step, "threshold": float(np.float32(p.threshold))}

    def forward(self, attrs, params, x):
        return dctr_qt(x, attrs["step"], attrs["threshold"])

    def onnx(self, ctx, node):
        quotient = ctx.op("Div", [node.inputs[0], ctx.f32(node.attrs["step"])], "quotient", name=node.name)
        onnx_quant_trunc_abs(ctx, quotient, node.outputs[0], "QUANTTRUNCABS", node.attrs["threshold"])

    def pytorch_source(self, node, emit):
        emit.helper(quant_trunc_abs)
        a = node.attrs
        return f"{emit.helper(dctr_qt)}({emit.inputs[0]}, {emit.lit(a['step'])}, {emit.lit(a['threshold'])})"


@register_layer("Trunc")
class Trunc(Truncation):
    """Truncation's clamp to [-scale, scale] (see the module docstring)."""

    def parse(self, lp):
        need_blobs(lp, "Trunc", 1, 1)
        p = lp.trunc_param
        if not p.HasField("scale"):
            return {"name": lp.name, "min": None, "max": None}
        t = float(np.float32(p.scale))
        if not t >= 0:
            raise LayerError(f"trunc_param.scale must be >= 0, got {t}")
        return {"name": lp.name, "min": -t, "max": t}

    def cannot_run(self, attrs, in_shapes):
        if attrs["max"] is None:
            return ("trunc_param.scale is not set, and the fork's default is not public (the repository ships "
                    "no caffe.proto; its paper's first truncation uses 3): set it in the prototxt")
        return None

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)], LayerError)
        return super().forward(attrs, params, x)

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(node.inputs[0])], ExportError)
        return super().onnx(ctx, node)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError)
        return super().pytorch_source(node, emit)


@register_layer("SplitByPhase")
class SplitByPhase(Layer):
    def parse(self, lp):
        need_blobs(lp, "SplitByPhase", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "SplitByPhase")
        if (h, w) != (512, 512):
            raise LayerError(f"SplitByPhase takes 512 x 512 maps (the fork checks it), got {list(in_shapes[0])}")
        return [(n, c * 64, h // 8, w // 8)]

    def forward(self, attrs, params, x):
        return split_by_phase(x)

    def onnx(self, ctx, node):
        n, c, h, w = ctx.shape(node.inputs[0])
        grid = ctx.op("Reshape", [node.inputs[0], ctx.i64([n, c, h // 8, 8, w // 8, 8])], "grid", name=node.name)
        phases = ctx.op("Transpose", [grid], "phases", perm=[0, 1, 3, 5, 2, 4])
        ctx.add_node("Reshape", [phases, ctx.i64([n, c * 64, h // 8, w // 8])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(split_by_phase)}({emit.inputs[0]})"
