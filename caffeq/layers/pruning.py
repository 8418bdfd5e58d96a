"""Layers of pruning forks that keep a weight mask beside the weights.

- CConvolution, CConvolutionDepthwise and CInnerProduct (NHZlX/Auto_pruning 237d8ed,
  compress_conv_layer.cpp, compress_conv_dw_layer.cpp, compress_inner_product_layer.cpp;
  cconvolution_param / cinner_product_param: upper_bound, iter_stop, inter_iter, is_pruning and the
  mask fillers): Convolution / ConvolutionDepthwise / InnerProduct whose weights are multiplied by a
  mask blob of the weights' shape, appended after the weights and the bias.  The TRAIN forward
  re-draws the mask from time to time (the pruning schedule, which only training runs); every
  forward convolves with weight x mask, the bias unmasked.  The fork fills a new mask with
  weight_mask_filler (a constant 0 unless set); caffeq's random weights give a mask of ones, so a
  model without a caffemodel is the unpruned net.  ONNX and model.py hold the masked weights.
"""
import copy

import numpy as np

from .conv import Convolution, ConvolutionDepthwise, InnerProduct
from .registry import register_layer


def _masked_node(node):
    """A copy of node whose blobs are the masked weight and the bias (what the fork convolves with)."""
    q = copy.copy(node)
    w, mask = np.asarray(node.blobs[0], np.float32), np.asarray(node.blobs[-1], np.float32)
    q.blobs = [w * mask] + list(node.blobs[1:-1])
    q.quant, q.shared_from = {}, {}
    return q


class _Masked:
    """What the masked layers add to their base layer's spec: the mask blob, and weight x mask."""

    def blob_names_for(self, attrs):
        return ("weight", "bias", "weight_mask") if attrs["bias_term"] else ("weight", "weight_mask")

    def param_shapes(self, attrs, in_shapes):
        shapes = super().param_shapes(attrs, in_shapes)
        return shapes + [shapes[0]]

    def init_params(self, attrs, shapes, rng):
        blobs = super().init_params(attrs, shapes[:-1], rng)
        return blobs + [np.ones(shapes[-1], np.float32)]

    def forward(self, attrs, params, *xs):
        return super().forward(attrs, [params[0] * params[-1]] + list(params[1:-1]), *xs)

    def onnx(self, ctx, node):
        return super().onnx(ctx, _masked_node(node))

    def pytorch_source(self, node, emit):
        emit.note("the pruning forks' masked layers keep their weights already masked (weight x mask)")
        real = emit.node
        emit.node = _masked_node(node)   # the state dict holds the masked weights
        try:
            return super().pytorch_source(emit.node, emit)
        finally:
            emit.node = real


@register_layer("CConvolution")
class MaskedConvolution(_Masked, Convolution):
    pass


@register_layer("CConvolutionDepthwise")
class MaskedConvolutionDepthwise(_Masked, ConvolutionDepthwise):
    pass


@register_layer("CInnerProduct")
class MaskedInnerProduct(_Masked, InnerProduct):
    pass
