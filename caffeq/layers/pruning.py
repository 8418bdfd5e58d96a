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
- CConvolution and CInnerProduct in yiwenguo/Dynamic-Network-Surgery's layout (alex-tolstov/sparseconv 00211a5,
  liuwenran/modified-caffe 9ae921a; claimed by cconvolution_param / cinner_product_param gamma, power or
  c_rate, the DNS schedule): DNSConvolution's four blobs and forward (weight x mask, bias x mask).  The
  masks hold 0 and 1 (liuwenran's changing-threshold GPU forward first sets every mask value above 0 to 1,
  yiwenguo's multiplies the stored values; caffeq multiplies them too).
- InnerProduct with inner_product_param.prune_type (Tyler-D/caffe-rc5_ex eebc417, Dense-Sparse-Dense): the
  first forward, in any phase, zeroes in place the floor(prune_ratio x count) smallest |w| (ties to the
  lower index: caffe_cpu_prune_ratio's partial_sort of (|w|, index) pairs), and floor(prune_ratio x its own
  count) of the bias; with THRESHOLD (and a prune_ratio above 0, which its LayerSetUp requires to prune at
  all) the |w| and |b| below weight_threshold.  The pruned blobs are what every later forward reads, so caffeq
  runs the layer on them.  |w| is the float magnitude, as GCC 6 and later compile the fork's unqualified
  abs(); older C++ libraries would truncate it to an int.
- PQConvolution and PQInnerProduct (liuwenran/modified-caffe dynamic-prune-quantization, GPU only): blobs
  weight, bias, weight classes, bias classes (their shapes) and a config of 2048 values.  config[0] = 0: the
  plain layer.  Else a weight (bias) whose class c is below pq*_param.classnum is replaced by the class
  centre config[1 + (int)c]; the others stay.  Without a bias the fork's setup indexes blobs it lacks:
  refused.
- StaticDropoutInnerProduct (joelthchao/diverse-dropout; read and sized, not run): an InnerProduct (weight
  and bias blobs) whose connections a 0/1 mask read from dropout_file switches off.  The fork's source is
  not public and its mask files are not in the repository, so its forward cannot be checked.
"""
import copy
import math

import numpy as np
import torch

from ..io.schema import caffe_pb2
from .conv import Convolution, ConvolutionDepthwise, InnerProduct
from .registry import LayerError, ReadOnlyLayer, canonical_axis, claim_layers, count, register_layer


class _DerivedBlobs:
    """What these forks add to their base layer (Convolution, InnerProduct): the forward runs on a weight
    (and bias) derived from the stored blobs by used_blobs (torch tensors in, the base layer's blobs out);
    ONNX and model.py hold the derived values."""

    #: model.py's docstring line on what its weights are
    derived_note = "the pruning forks' layers keep their weights as the fork's forward derives them"

    def used_blobs(self, attrs, blobs):
        raise NotImplementedError

    def forward(self, attrs, params, *xs):
        return super().forward(attrs, self._derived(attrs, list(params)), *xs)

    def _derived(self, attrs, blobs):
        """used_blobs, computed once per set of stored blobs while inference runs (a Dense-Sparse-Dense fc6
        takes a second to prune); while training, every forward derives them anew."""
        if not torch.is_inference_mode_enabled():
            return self.used_blobs(attrs, blobs)
        # kept on the weight tensor itself (it lives as long as the module), keyed by the layer and the blobs'
        # storage and versions, so that a changed or moved blob derives anew
        key = (id(attrs),) + tuple((b.data_ptr(), b._version, tuple(b.shape), str(b.device)) for b in blobs)
        hit = getattr(blobs[0], "_caffeq_derived", None)
        if hit is None or hit[0] != key:
            hit = (key, self.used_blobs(attrs, blobs))
            blobs[0]._caffeq_derived = hit
        return hit[1]

    def derived_node(self, node):
        """A copy of node whose blobs are what the fork computes with."""
        q = copy.copy(node)
        stored = [torch.from_numpy(np.array(b, np.float32, copy=True)) for b in node.blobs]
        q.blobs = [b.numpy() for b in self.used_blobs(node.attrs, stored)]
        q.quant, q.shared_from = {}, {}
        return q

    def onnx(self, ctx, node):
        return super().onnx(ctx, self.derived_node(node))

    def pytorch_source(self, node, emit):
        emit.note(self.derived_note)
        real = emit.node
        emit.node = self.derived_node(node)   # the state dict holds the derived weights
        try:
            return super().pytorch_source(emit.node, emit)
        finally:
            emit.node = real


class _Masked(_DerivedBlobs):
    """Mask blobs after the weights (and the bias), each multiplying the blob of the same place among the
    first ones (masks_bias: the bias has its own)."""

    #: whether the bias has a mask too (DNS) or only the weights (CConvolution)
    masks_bias = False
    #: whether the forward applies the masks (INQ's TEST forward does not)
    applies_masks = True
    derived_note = "the pruning forks' masked layers keep their weights already masked (weight x mask)"

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


def _sets_dns_schedule(param):
    return any(param.HasField(f) for f in ("gamma", "power", "c_rate"))


@claim_layers("CConvolution", lambda lp: _sets_dns_schedule(lp.cconvolution_param))
class DNSLayoutConvolution(_DynamicSurgery, Convolution):
    pass


@claim_layers("CInnerProduct", lambda lp: _sets_dns_schedule(lp.cinner_product_param))
class DNSLayoutInnerProduct(_DynamicSurgery, InnerProduct):
    pass


# ---- Dense-Sparse-Dense (Tyler-D/caffe-rc5_ex) -------------------------------------------------------------

PRUNE_THRESHOLD = caffe_pb2.InnerProductParameter.THRESHOLD


def zero_smallest_magnitudes(x, ratio: float):
    """caffe_cpu_prune_ratio: the floor(ratio x n) smallest |x| (float arithmetic, as the fork's) set to 0,
    ties to the lower index; found with one selection instead of the fork's partial sort."""
    flat = x.reshape(-1)
    k = math.floor(float(np.float32(ratio) * np.float32(flat.numel())))
    if k < 1:
        return x
    size = flat.abs()
    kth = torch.kthvalue(size, k).values
    below = size < kth
    ties = size == kth
    need = k - int(below.sum())
    zero = below | (ties & (torch.cumsum(ties.to(torch.int64), 0) <= need))
    return torch.where(zero, torch.zeros_like(flat), flat).reshape(x.shape)


@claim_layers("InnerProduct", lambda lp: lp.inner_product_param.prune_type != 0)
class DensePrunedInnerProduct(_DerivedBlobs, InnerProduct):
    derived_note = "Dense-Sparse-Dense InnerProducts keep their weights as their first forward prunes them"

    def parse(self, lp):
        p = lp.inner_product_param
        if not 0 <= p.prune_ratio < 1:
            raise LayerError(f"inner_product_param.prune_ratio must be in [0, 1), got {p.prune_ratio:g} (the "
                             f"fork's CHECKs)")
        threshold = p.weight_threshold if p.HasField("weight_threshold") else -1.0
        return dict(super().parse(lp), prune_ratio=float(p.prune_ratio),
                    prune_threshold=float(threshold) if p.prune_type == PRUNE_THRESHOLD else None)

    def used_blobs(self, attrs, blobs):
        if attrs["prune_ratio"] == 0:   # LayerSetUp: pruned_ = (prune_ratio == 0), nothing to prune
            return blobs
        out = list(blobs)
        for i in range(2 if attrs["bias_term"] else 1):
            if attrs["prune_threshold"] is None:
                out[i] = zero_smallest_magnitudes(blobs[i], attrs["prune_ratio"])
            else:   # caffe_cpu_prune_thres: |x| < threshold, strictly
                out[i] = torch.where(blobs[i].abs() < attrs["prune_threshold"], torch.zeros_like(blobs[i]),
                                     blobs[i])
        return out


# ---- class-centre quantization (liuwenran/modified-caffe dynamic-prune-quantization) -------------------------

PQ_CONFIG_SIZE = 2048


def class_centres(values, classes, config, classnum: int):
    """assignValue of compress_*_layer.cu: values whose class is below classnum become config[1 + (int)class]."""
    quantized = classes < classnum
    index = torch.clamp(torch.trunc(classes), 0, classnum - 1).to(torch.int64)
    return torch.where(quantized, config.reshape(-1)[1:classnum + 1][index], values)


class _ClassQuantized(_DerivedBlobs):
    param_field = None
    derived_note = "PQConvolution / PQInnerProduct keep their weights with each quantized one's class centre"

    def parse(self, lp):
        attrs = dict(super().parse(lp), name=lp.name)
        classnum = int(getattr(lp, self.param_field).classnum)
        if not attrs["bias_term"]:
            raise LayerError(f"{self.types[0]} without a bias term: the fork's setup makes two blobs and then "
                             "fills a fifth (it cannot be set up)")
        if not 1 <= classnum <= PQ_CONFIG_SIZE - 2:   # the fork reads config[1 .. classnum + 1]
            raise LayerError(f"{self.param_field}.classnum must be in [1, {PQ_CONFIG_SIZE - 2}] (its centres are "
                             f"read from a config blob of {PQ_CONFIG_SIZE} values), got {classnum}")
        return dict(attrs, classnum=classnum)

    def blob_names_for(self, attrs):
        return ("weight", "bias", "weight_class", "bias_class", "config")

    def param_shapes(self, attrs, in_shapes):
        shapes = super().param_shapes(attrs, in_shapes)
        return shapes + shapes + [(PQ_CONFIG_SIZE,)]

    def init_params(self, attrs, shapes, rng):
        # the fork's setup: every value of class classnum (not quantized), the config zero (the plain layer)
        blobs = super().init_params(attrs, shapes[:2], rng)
        return blobs + [np.full(s, attrs["classnum"], np.float32) for s in shapes[2:4]] + \
            [np.zeros(shapes[4], np.float32)]

    def used_blobs(self, attrs, blobs):
        weight, bias, weight_class, bias_class, config = blobs
        if float(config.reshape(-1)[0]) == 0:
            return [weight, bias]
        n = attrs["classnum"]
        for classes in (weight_class, bias_class):
            if bool(((classes < n) & (classes <= -1)).any()):
                raise LayerError(f"layer '{attrs['name']}' ({self.types[0]}): a class below -1 indexes before the "
                                 f"config's centres (the fork reads out of bounds)")
        return [class_centres(weight, weight_class, config, n), class_centres(bias, bias_class, config, n)]


@register_layer("PQConvolution")
class PQConvolution(_ClassQuantized, Convolution):
    param_field = "pqconvolution_param"


@register_layer("PQInnerProduct")
class PQInnerProduct(_ClassQuantized, InnerProduct):
    param_field = "pqinner_product_param"


@register_layer("StaticDropoutInnerProduct")
class StaticDropoutInnerProduct(ReadOnlyLayer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        p = lp.static_dropout_inner_product_param
        if not p.HasField("num_output"):
            raise LayerError("static_dropout_inner_product_param.num_output is required")
        return {"name": lp.name, "num_output": int(p.num_output), "bias_term": bool(p.bias_term),
                "axis": int(p.axis), "dropout_file": p.dropout_file}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        attrs["_axis"] = canonical_axis(attrs["axis"], len(s), "static_dropout_inner_product_param.axis")
        return [s[:attrs["_axis"]] + (attrs["num_output"],)]

    def param_shapes(self, attrs, in_shapes):
        k, n = count(in_shapes[0], attrs["_axis"]), attrs["num_output"]
        return [(n, k), (n,)] if attrs["bias_term"] else [(n, k)]

    def why_not_run(self, attrs):
        mask = f" ({attrs['dropout_file']})" if attrs["dropout_file"] else ""
        return (f"joelthchao/diverse-dropout's InnerProduct with a connection mask read from a file{mask}: the "
                "fork's source is not public, so caffeq reads and sizes it but does not run it")
