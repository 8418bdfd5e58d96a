"""kaveena/myopic-oracle's masked Convolution and InnerProduct (ecadb1a, caffe/src/caffe/proto/caffe.proto;
caffe/src/caffe/layers/base_conv_layer.cpp, conv_layer.cpp/.cu, cudnn_conv_layer.cu, deconv_layer.cpp,
inner_product_layer.cpp/.cu; caffe/src/caffe/net.cpp CopyTrainedLayersFrom).

- Convolution with convolution_mask_param.mask_term: blobs weight, bias, weight mask, bias mask (the masks of
  the weight's and the bias' shapes; without a bias term only the weight mask).  Every forward, CPU and cuDNN,
  convolves with weight x mask and adds bias x bias mask.
- InnerProduct with inner_product_param.mask_term (the switch is there, not in inner_product_mask_param):
  blobs weight, bias, weight mask; the forward uses weight x mask, the bias unmasked.
- Deconvolution with convolution_mask_param.mask_term: its setup (BaseConvolutionLayer's) makes the same masks,
  but its forwards read only the weight and the bias: the masks are kept and not applied.

A new mask is all ones (default_init, true by default) or drawn by mask_filler; the fork's setup fills
its masks before reading any weights file, so the filler's CHECKs (a Caffe filler's name, sparse, uniform's
min <= max) refuse the layer here too.  The fork's loader copies as many blobs as the weights file holds and
keeps the new ones beyond them, so a caffemodel of the unmasked net (the repository's original.caffemodel files)
loads with masks of ones: stored_blobs adds them, with a note.  Its convolution_quantize_param (bit masks of
the weights) and convolution_saliency_param (training-time saliencies) are not declared here.
"""
import math

import numpy as np

from ..errors import WeightsError
from .conv import Convolution, Deconvolution, InnerProduct
from .pruning import _Masked
from .registry import LayerError, claim_layers

# the filler types caffeq can draw a new mask with (caffe/include/caffe/filler.hpp's formulas)
_DRAWN = ("constant", "uniform", "gaussian", "xavier", "msra")
_FAN = {0: "FAN_IN", 1: "FAN_OUT", 2: "AVERAGE"}
# GetFiller's types (filler.hpp): any other name is a CHECK failure
_CAFFE_FILLERS = ("constant", "gaussian", "positive_unitball", "uniform", "xavier", "msra", "bilinear")


def _mask_init(p, field):
    """How a new mask is filled: default_init's ones, else the fields of mask_filler (Caffe's defaults
    where unset: a constant 0)."""
    if p.default_init:
        return {"type": "constant", "value": 1.0, "field": f"{field}.default_init"}
    f = p.mask_filler
    # the fork's setup fills every new mask before any weights file is read, so the filler's CHECKs always run
    if f.type not in _CAFFE_FILLERS:
        raise LayerError(f"{field}.mask_filler type '{f.type}' is not a Caffe filler (the fork's setup CHECKs it: "
                         f"{', '.join(_CAFFE_FILLERS)})")
    if f.sparse < -1 or (f.sparse != -1 and f.type != "gaussian"):
        raise LayerError(f"{field}.mask_filler.sparse {f.sparse}: Caffe's '{f.type}' filler CHECKs "
                         f"{'sparse >= -1' if f.type == 'gaussian' else 'sparse == -1 (no sparsity)'}")
    if f.type == "uniform" and f.min > f.max:   # caffe_rng_uniform's CHECK_LE(a, b)
        raise LayerError(f"{field}.mask_filler min {f.min:g} > max {f.max:g}: Caffe's uniform filler CHECKs min <= max")
    return {"type": f.type, "value": float(f.value), "min": float(f.min), "max": float(f.max),
            "mean": float(f.mean), "std": float(f.std), "sparse": int(f.sparse),
            "variance_norm": _FAN.get(int(f.variance_norm), "FAN_IN"), "field": f"{field}.mask_filler"}


def _fan(shape, variance_norm):
    """Caffe's fan of a blob for xavier / msra: count / num, count / channels, or their mean."""
    n = math.prod(shape)
    fan_in = n / shape[0]
    fan_out = n / (shape[1] if len(shape) > 1 else 1)
    return {"FAN_IN": fan_in, "FAN_OUT": fan_out, "AVERAGE": (fan_in + fan_out) / 2}[variance_norm]


def draw_mask(init, shape, rng, layer, error=LayerError):
    """A new mask of `shape` as the fork fills it (`init` from _mask_init)."""
    kind = init["type"]
    if kind not in _DRAWN or (kind == "gaussian" and init["sparse"] >= 0):
        what = "a sparse gaussian" if kind == "gaussian" else f"type '{kind}'"
        raise error(f"layer '{layer}': {init['field']} {what} cannot fill a new mask here (caffeq draws "
                    f"{', '.join(_DRAWN)}); give a caffemodel that holds the masks")
    if kind == "constant":
        return np.full(shape, init["value"], np.float32)
    if kind == "uniform":
        return rng.uniform(init["min"], init["max"], shape).astype(np.float32)
    if kind == "gaussian":
        return (init["mean"] + init["std"] * rng.standard_normal(shape)).astype(np.float32)
    fan = _fan(shape, init["variance_norm"])
    if kind == "xavier":
        bound = math.sqrt(3.0 / fan)
        return rng.uniform(-bound, bound, shape).astype(np.float32)
    return (math.sqrt(2.0 / fan) * rng.standard_normal(shape)).astype(np.float32)


class _MyopicMasked(_Masked):
    """_Masked with the fork's mask filling and its loader, which keeps new masks for blobs a weights file
    lacks.  mask_param: the LayerParameter field holding default_init and mask_filler."""

    mask_param = "convolution_mask_param"
    derived_note = "kaveena/myopic-oracle's masked layers keep their weights already masked (weight x mask)"

    def parse(self, lp):
        return dict(super().parse(lp), name=lp.name,
                    mask_init=_mask_init(getattr(lp, self.mask_param), self.mask_param))

    def init_params(self, attrs, shapes, rng):
        k = self._masked(attrs)
        # the base layer's random weight and bias (past _Masked, whose masks are ones), then the fork's masks
        blobs = super(_Masked, self).init_params(attrs, shapes[:-k], rng)
        return blobs + [draw_mask(attrs["mask_init"], s, rng, attrs["name"]) for s in shapes[-k:]]

    def stored_blobs(self, attrs, arrays, notes):
        arrays = super().stored_blobs(attrs, arrays, notes)
        base = 2 if attrs["bias_term"] else 1
        k = self._masked(attrs)
        if len(arrays) < base:
            return arrays   # too few for even the weights: the count check names it
        fill = attrs["mask_init"]
        how = "ones" if fill["field"].endswith("default_init") else f"drawn by {fill['field']}"
        rng = np.random.default_rng(0)
        out = list(arrays[:base + k])
        if len(arrays) > base + k:   # the fork's loader copies only the blobs the net has
            notes.append(f"blobs {base + k} to {len(arrays) - 1} of the weights file are not this net's: "
                         f"skipped, as the fork's loader skips them")
        if len(out) < base + k:
            notes.append(f"the weights file has {len(out) - base} of its {k} mask blob(s): the fork's loader keeps "
                         f"new ones for the rest ({how})")
        for i in range(k):
            if len(out) == base + i:
                out.append(draw_mask(fill, np.shape(out[i]), rng, attrs["name"], WeightsError))
            elif np.shape(out[base + i]) != np.shape(out[i]):   # the loader keeps the new mask then too
                notes.append(f"blob {base + i} (a mask) has shape {list(np.shape(out[base + i]))}, not its blob's "
                             f"{list(np.shape(out[i]))}: the fork's loader keeps its new one ({how})")
                out[base + i] = draw_mask(fill, np.shape(out[i]), rng, attrs["name"], WeightsError)
        return arrays if len(out) == len(arrays) and all(a is b for a, b in zip(out, arrays)) else out


@claim_layers("Convolution", lambda lp: lp.convolution_mask_param.mask_term)
class MyopicMaskedConvolution(_MyopicMasked, Convolution):
    masks_bias = True


@claim_layers("Deconvolution", lambda lp: lp.convolution_mask_param.mask_term)
class MyopicMaskedDeconvolution(_MyopicMasked, Deconvolution):
    masks_bias = True
    applies_masks = False
    derived_note = "kaveena/myopic-oracle's Deconvolution keeps its masks without applying them, as its forward"


@claim_layers("InnerProduct", lambda lp: lp.inner_product_param.mask_term)
class MyopicMaskedInnerProduct(_MyopicMasked, InnerProduct):
    mask_param = "inner_product_mask_param"
