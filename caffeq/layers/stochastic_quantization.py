"""dongyp13/Stochastic-Quantization (fa384c1, caffe/src/caffe/layers/conv_layer_binary.cu,
conv_layer_ternary.cu, the inner-product twins, util/lowbit_functions.cu; its nets train and test on the
GPU): binary (BWN) and ternary (TWN) weights computed from the float blob at every forward.

- BinaryConvolution / BinaryInnerProduct carrying convolution_param / inner_product_param `sq` or
  `ratio` (this fork's fields; hwgq.py hands them here): each output row as sign(w) (w >= 0 counts as +)
  times alpha = float32(sum |w| of the row) / row length.
- TernaryConvolution / TernaryInnerProduct: N = all the weights, mean = sum(w) / N, delta = 0.7 / N *
  sum |w - mean|; each weight +1 above delta, -1 below -delta, else 0, times its row's mean |w| over the
  weights beyond delta (0 when none).
- `sq: true` with `ratio` below 100 keeps a random share of rows in float at every forward (a roulette
  over rand()): refused.  The float sums are cuBLAS's (asum, gemv) in the fork: their order of additions
  is not reproduced, so the last bits may differ.
"""
import torch

from .conv import Convolution, InnerProduct
from .registry import LayerError, register_layer
from .transformed_weights import TransformedConvolution, TransformedInnerProduct, TransformedWeights


def bwn_weights(w):
    """Each output row as sign(w) times its mean |w| (a float32 sum divided by the row length)."""
    rows = w.reshape(w.shape[0], -1)
    code = torch.where(rows >= 0, torch.ones_like(rows), -torch.ones_like(rows))
    return (code * (rows.abs().sum(1, keepdim=True) / rows.shape[1])).reshape(w.shape)


def twn_weights(w):
    """TWN's ternary weights: +-1 beyond delta = 0.7 mean |w - mean(w)|, times the row's mean |w| there."""
    rows = w.reshape(w.shape[0], -1)
    count = rows.numel()
    mean = (rows.sum(1) * (1.0 / count)).sum()
    delta = ((rows - mean) * (0.7 / count)).abs().sum()
    beyond = (rows > delta) | (rows < -delta)
    code = torch.where(rows > delta, torch.ones_like(rows), torch.where(rows < -delta, -torch.ones_like(rows),
                                                                          torch.zeros_like(rows)))
    kept = beyond.to(rows.dtype).sum(1, keepdim=True)
    total = torch.where(beyond, rows.abs(), torch.zeros_like(rows)).sum(1, keepdim=True)
    alpha = torch.where(kept > 0, total / kept.clamp(min=1), torch.zeros_like(kept))
    return (code * alpha).reshape(w.shape)


def read_sq(lp, param_field, attrs):
    """attrs for this fork's layers; the random stochastic quantization is read, its run refused."""
    p = getattr(lp, param_field)
    attrs["sq_fork"] = True
    if p.sq and p.ratio < 100:
        attrs["sq_random"] = (f"layer '{lp.name}': {param_field}.sq with ratio {p.ratio:g} < 100 keeps a random share "
                              f"of the output channels in float at every forward (Stochastic-Quantization's "
                              f"roulette); caffeq does not draw it")
    return attrs


def refuse_random_sq(attrs):
    if attrs.get("sq_random"):
        raise LayerError(attrs["sq_random"])


def is_sq_fork(lp, param_field):
    p = getattr(lp, param_field)
    return p.HasField("sq") or p.HasField("ratio")


class _LowBit(TransformedWeights):
    transform = None   # bwn_weights or twn_weights

    def weight_transform(self, attrs, weight):
        refuse_random_sq(attrs)
        return type(self).transform(weight)

    def weight_transform_note(self, attrs):
        return (f"{self.types[0]} keeps its weights already quantized (the fork quantizes a copy of the float "
                f"blob at every forward, to the same values)")


@register_layer("TernaryConvolution")
class TernaryConvolution(_LowBit, TransformedConvolution, Convolution):
    transform = staticmethod(twn_weights)

    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs.get("orn") or attrs.get("first_conv"):
            raise LayerError("TernaryConvolution reads no other fork's convolution fields")
        return read_sq(lp, "convolution_param", attrs)


@register_layer("TernaryInnerProduct")
class TernaryInnerProduct(_LowBit, TransformedInnerProduct, InnerProduct):
    transform = staticmethod(twn_weights)

    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs.get("normalize") or attrs["transpose"]:
            raise LayerError("TernaryInnerProduct reads no inner_product_param.normalize or transpose")
        return read_sq(lp, "inner_product_param", attrs)
