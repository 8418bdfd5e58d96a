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
- DNSConvolution and DNSInnerProduct (32l/Neural-Network-Model-Compressing 5e7d0e6, dynamic network
  surgery: dns_conv_layer.cu, dns_inner_product_layer.cpp; dns_*_param drive the TRAIN mask updates):
  blobs weight, bias, weight mask, bias mask; every forward uses weight x mask and bias x mask.  The
  fork's CPU convolution writes each image at the bottom's stride (wrong for N > 1); its GPU path, used
  here, does not.  Without a bias term the fork's forward reads a bias mask it lacks: refused.
- INQConvolution and INQInnerProduct (the same repository, incremental network quantization): the same
  four blobs; the TRAIN forward quantizes the weights once, in place, and the TEST forward is the plain
  layer on blobs 0 and 1 (the masks only steer training).
"""
import copy

import numpy as np

from .conv import Convolution, ConvolutionDepthwise, InnerProduct
from .registry import LayerError, register_layer


class _Masked:
    """What the masked layers add to their base layer's spec: mask blobs after the weights (and the bias),
    each multiplying the blob of the same place among the first ones (masks_bias: the bias has its own)."""

    #: whether the bias has a mask too (DNS) or only the weights (CConvolution)
    masks_bias = False
    #: whether the forward applies the masks (INQ's TEST forward does not)
    applies_masks = True

    def _masked(self, attrs):
        return 2 if self.masks_bias and attrs["bias_term"] else 1

    def blob_names_for(self, attrs):
        base = ("weight", "bias") if attrs["bias_term"] else ("weight",)
        return base + ("weight_mask", "bias_mask")[:self._masked(attrs)]

    def param_shapes(self, attrs, in_shapes):
        shapes = super().param_shapes(attrs, in_shapes)
        return shapes + shapes[:self._masked(attrs)]

    def init_params(self, attrs, shapes, rng):
        k = self._masked(attrs)
        blobs = super().init_params(attrs, shapes[:-k], rng)
        return blobs + [np.ones(s, np.float32) for s in shapes[-k:]]

    def used_blobs(self, attrs, blobs):
        """The weights (and bias) as the forward uses them, from the stored blobs."""
        k = self._masked(attrs)
        used = list(blobs[:-k])
        if self.applies_masks:
            for i, mask in enumerate(blobs[-k:]):
                used[i] = used[i] * mask
        return used

    def forward(self, attrs, params, *xs):
        return super().forward(attrs, self.used_blobs(attrs, list(params)), *xs)

    def masked_node(self, node):
        """A copy of node whose blobs are what the fork convolves with."""
        q = copy.copy(node)
        q.blobs = self.used_blobs(node.attrs, [np.asarray(b, np.float32) for b in node.blobs])
        q.quant, q.shared_from = {}, {}
        return q

    def onnx(self, ctx, node):
        return super().onnx(ctx, self.masked_node(node))

    def pytorch_source(self, node, emit):
        emit.note("the pruning forks' masked layers keep their weights already masked (weight x mask)")
        real = emit.node
        emit.node = self.masked_node(node)   # the state dict holds the masked weights
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


class _DynamicSurgery(_Masked):
    masks_bias = True

    def parse(self, lp):
        return dict(super().parse(lp), name=lp.name)

    def used_blobs(self, attrs, blobs):
        if not attrs["bias_term"]:
            raise LayerError(f"layer '{attrs['name']}' ({self.types[0]}) without a bias term cannot run: the "
                             f"fork's forward reads a bias mask it does not have (blobs_[2])")
        return super().used_blobs(attrs, blobs)


@register_layer("DNSConvolution")
class DNSConvolution(_DynamicSurgery, Convolution):
    pass


@register_layer("DNSInnerProduct")
class DNSInnerProduct(_DynamicSurgery, InnerProduct):
    pass


class _Incremental(_Masked):
    masks_bias = True
    applies_masks = False


@register_layer("INQConvolution")
class INQConvolution(_Incremental, Convolution):
    pass


@register_layer("INQInnerProduct")
class INQInnerProduct(_Incremental, InnerProduct):
    pass
