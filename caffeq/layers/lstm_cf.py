"""LSTM-CF's layers (icemansina/LSTM-CF 25ba20b, the Caffe inside the repository, ECCV 2016 RGB-D scene
labeling; Winstonxu123/LSTM-CF's copy has the same layer sources): its nets run BVLC's LSTM down the
columns of a feature map, fed by these.

- Mask (mask_layer.cpp; mask_param width, height, masktype, direction): no bottom; a constant
  [height, width] blob of 0 and 1, the LSTM's continuation input.  The fork zero-fills the blob, then
      VERTICAL TOP2BOTTOM    row 0 is 0, the rows after it 1;
      VERTICAL BOTTOM2TOP    rows 0 .. height-2 are 1, then the row at offset(1) is zeroed: row 1,
                             not the last row (the last row keeps its zero fill);
      HORIZONTAL LEFT2RIGHT  column 0 is 0 in every row, the others 1;
      HORIZONTAL RIGHT2LEFT  columns 1 .. width-1 are 1, then column width-1 is 0 (column 0 is never
                             written: 0);
      any other pairing      nothing is written: all 0.
  WeitaoVan/faceID's Mask (faceid.py) takes two bottoms and `scale`: this one claims the Masks without
  bottoms or with width / height.
- Transpose (transpose_layer.cpp; transpose_param transposetype, shape): the top is shaped as `shape`
  says (its count must be the bottom's), and per image n of the bottom's num() (C = channels(),
  S = height() x width(), Caffe's legacy accessors)
      CONVTOLSTM  top[n][s * C + c] = bottom[n][c * S + s]   ((C, H, W) maps to (H x W, C) rows);
      LSTMTOCONV  top[n][c * S + s] = bottom[n][s * C + c]   (the inverse, C and S from the bottom).
  For num() > 1 the fork's GPU kernel (cublas geam from top->offset(n * S)) writes past the top's end;
  caffeq follows the CPU code.  caffe_ocr's Transpose (sequence.py, transpose_param.dim) keeps
  the other Transposes.
- ConvolutionDeeplab (conv_deeplab_layer.cpp, convolution_deeplab_param): DeepLab v1's convolution with
  holes, i.e. Convolution with dilation = hole (hole_h, hole_w), its bias stored as [1, 1, 1, num_output].
"""
import numpy as np
import torch
from torch import nn

from ..io.schema import caffe_pb2
from .conv import Convolution, parse_conv
from .registry import Layer, LayerError, claim_layers, legacy_nchw, need_blobs, register_layer, torch_sources
from .transformed_weights import TransformedConvolution

_MASK = caffe_pb2.MaskParameter
_TRANSPOSE = caffe_pb2.TransposeParameter


def lstm_cf_mask(height: int, width: int, masktype: int, direction: int):
    """LSTM-CF's Mask: the (height, width) continuation pattern its forward writes into a zeroed blob."""
    m = torch.zeros(height, width)
    if masktype == 0 and direction == 2:      # VERTICAL, TOP2BOTTOM
        m[1:] = 1.0
    elif masktype == 0 and direction == 3:    # VERTICAL, BOTTOM2TOP: ones over rows 0 .. h-2, then row 1 zeroed
        m[:height - 1] = 1.0
        m[1:2] = 0.0
    elif masktype == 1 and direction == 0:    # HORIZONTAL, LEFT2RIGHT
        m[:, 1:] = 1.0
    elif masktype == 1 and direction == 1:    # HORIZONTAL, RIGHT2LEFT: column 0 never written
        m[:, 1:] = 1.0
        m[:, width - 1] = 0.0
    return m


class LstmCfMaskModule(nn.Module):
    """The Mask's constant blob, kept as a buffer so that it follows the module's device."""

    def __init__(self, height: int, width: int, masktype: int, direction: int):
        super().__init__()
        self.register_buffer("mask", lstm_cf_mask(height, width, masktype, direction), persistent=False)

    def forward(self):
        return self.mask


def _is_lstm_cf_mask(lp):
    p = lp.mask_param
    return not len(lp.bottom) or p.HasField("width") or p.HasField("height")


@claim_layers("Mask", _is_lstm_cf_mask)
class LstmCfMask(Layer):
    def parse(self, lp):
        need_blobs(lp, "Mask (LSTM-CF's, mask_param width / height)", 0, 1)
        p = lp.mask_param
        for field in ("width", "height"):
            if not p.HasField(field):
                raise LayerError(f"mask_param.{field} is required (LSTM-CF's Mask)")
            if getattr(p, field) < 1:
                raise LayerError(f"mask_param.{field} must be >= 1, got {getattr(p, field)}")
        if p.masktype == _MASK.VERTICAL and p.direction == _MASK.BOTTOM2TOP and p.height == 1:
            raise LayerError("mask_param: height 1 with BOTTOM2TOP makes the fork zero the row after the blob's end "
                             "(out of bounds); give height >= 2")
        if p.HasField("scale"):
            raise LayerError("mask_param.scale is faceID's Mask (two bottoms); LSTM-CF's Mask has no bottom")
        return {"height": int(p.height), "width": int(p.width), "masktype": int(p.masktype),
                "direction": int(p.direction)}

    def infer(self, attrs, in_shapes):
        return [(attrs["height"], attrs["width"])]

    def _args(self, attrs):
        return attrs["height"], attrs["width"], attrs["masktype"], attrs["direction"]

    def forward(self, attrs, params):
        return lstm_cf_mask(*self._args(attrs))

    def onnx(self, ctx, node):
        mask = lstm_cf_mask(*self._args(node.attrs)).numpy()
        ctx.add_node("Identity", [ctx.const(mask, node.name + "_mask")], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_MASK)
        args = ", ".join(str(v) for v in self._args(node.attrs))
        return f"{emit.module(f'{emit.helper(TORCH_MASK_MODULE)}({args})')}()"


TORCH_MASK = torch_sources(lstm_cf_mask)
TORCH_MASK_MODULE = torch_sources(LstmCfMaskModule)


def lstm_cf_transpose(x, to_rows: bool, top_shape: list[int]):
    """LSTM-CF's Transpose of each image's (C, S) values: to (S, C) rows (CONVTOLSTM, C and S from x's
    legacy channels / height x width) or back (LSTMTOCONV), then shaped as the layer's `shape`."""
    n = x.shape[0] if x.dim() > 0 else 1
    c = x.shape[1] if x.dim() > 1 else 1
    s = x.numel() // max(n * c, 1)
    grid = x.reshape(n, c, s) if to_rows else x.reshape(n, s, c)
    return grid.transpose(1, 2).reshape(top_shape)


def _is_lstm_cf_transpose(lp):
    p = lp.transpose_param
    return p.HasField("transposetype") or p.HasField("shape")


@claim_layers("Transpose", _is_lstm_cf_transpose)
class LstmCfTranspose(Layer):
    def parse(self, lp):
        need_blobs(lp, "Transpose (LSTM-CF's, transpose_param transposetype / shape)", 1, 1, in_place=False)
        p = lp.transpose_param
        if len(p.dim):
            raise LayerError("transpose_param: dim (caffe_ocr's Transpose) does not combine with LSTM-CF's "
                             "transposetype / shape")
        if not p.HasField("transposetype"):
            raise LayerError("transpose_param.transposetype is required (LSTM-CF's Transpose: CONVTOLSTM or "
                             "LSTMTOCONV)")
        if not p.HasField("shape"):
            raise LayerError("transpose_param.shape is required (LSTM-CF's Transpose shapes its top as it says)")
        shape = [int(d) for d in p.shape.dim]
        if any(d < 0 for d in shape):
            raise LayerError(f"transpose_param.shape {shape} has a negative dim")
        return {"to_rows": p.transposetype == _TRANSPOSE.CONVTOLSTM, "shape": shape}

    def infer(self, attrs, in_shapes):
        bottom = tuple(in_shapes[0])
        legacy_nchw(bottom, "LSTM-CF's Transpose")   # the fork reads num/channels/height/width
        top = tuple(attrs["shape"])
        if int(np.prod(top)) != int(np.prod(bottom)):
            raise LayerError(f"transpose_param.shape {list(top)} holds {int(np.prod(top))} values, the bottom "
                             f"{list(bottom)} {int(np.prod(bottom))} (the fork's CHECK_EQ of the counts)")
        if bottom and bottom[0] > 1:
            attrs["reading_notes"] = [f"LSTM-CF's Transpose of {bottom[0]} images: the fork's CPU code, which "
                                      "caffeq follows (its GPU kernel writes later images past the top's end)"]
        return [top]

    def forward(self, attrs, params, x):
        return lstm_cf_transpose(x, attrs["to_rows"], attrs["shape"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        shape = ctx.shape(x)
        n = shape[0] if len(shape) > 0 else 1
        c = shape[1] if len(shape) > 1 else 1
        s = int(np.prod(shape)) // max(n * c, 1)
        grid = [n, c, s] if node.attrs["to_rows"] else [n, s, c]
        flat = ctx.op("Reshape", [x, ctx.i64(grid)], "grid", name=node.name)
        turned = ctx.op("Transpose", [flat], "turned", perm=[0, 2, 1])
        ctx.add_node("Reshape", [turned, ctx.i64(node.attrs["shape"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(TORCH_TRANSPOSE)}({emit.inputs[0]}, {a['to_rows']}, {emit.lit(a['shape'])})"


TORCH_TRANSPOSE = torch_sources(lstm_cf_transpose)


@register_layer("ConvolutionDeeplab")
class ConvolutionDeeplab(TransformedConvolution, Convolution):
    def parse(self, lp):
        if not lp.HasField("convolution_deeplab_param"):
            raise LayerError("ConvolutionDeeplab reads convolution_deeplab_param, which is missing")
        as_conv = caffe_pb2.LayerParameter()
        as_conv.CopyFrom(lp)
        as_conv.convolution_param.CopyFrom(lp.convolution_deeplab_param)
        return parse_conv(as_conv)

    def param_shapes(self, attrs, in_shapes):
        shapes = super().param_shapes(attrs, in_shapes)
        if attrs["bias_term"]:
            shapes[1] = (1, 1, 1, attrs["num_output"])   # the fork's bias blob
        return shapes

    def bias_transform(self, attrs, bias, weight):
        return bias.reshape(-1)


__all__ = ["ConvolutionDeeplab", "LstmCfMask", "LstmCfTranspose", "lstm_cf_mask", "lstm_cf_transpose"]
