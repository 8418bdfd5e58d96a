"""TransformedWeights: the Convolution / InnerProduct forks whose forward first rewrites the weight blob
(binarized, quantized to fixed point) before their base layer's forward, and TransformedConvolution /
TransformedInnerProduct, their base layer's ONNX and model.py emission on the rewritten weights (split from
conv.py; the forks' own modules, e.g. hwgq.py, qnn.py, xilinx.py, subclass them)."""
import copy

import numpy as np
import torch

from .conv import InnerProduct, _onnx_conv, _torch_conv_source


class TransformedWeights:
    """A mixin for Convolution / InnerProduct forks whose forward first rewrites the weight blob (blob 0) from
    the stored floats into a copy (binarized, quantized to fixed point): forward applies weight_transform, and
    ONNX and model.py hold the transformed weights, computed once at export (the forks compute the same
    values from the same blobs at every forward).  Subclasses give source_layer(node, emit), their base's
    model.py emission, and may give weight_transform_note(attrs), a line for model.py's docstring."""

    def weight_transform(self, attrs, weight):
        """The weights as the forward uses them (a torch tensor), or None where they stay as stored."""
        return None

    def bias_transform(self, attrs, bias, weight):
        """The bias (blob 1) as the forward uses it, or None where it stays as stored; weight is the stored
        blob 0."""
        return None

    def weight_transform_note(self, attrs):
        return None

    def transform_blobs(self, attrs, weight, bias):
        """(weight, bias) as the forward uses them, None for one that stays as stored (bias None: no bias
        blob).  Forks whose weights and bias are quantized together override this."""
        new_bias = self.bias_transform(attrs, bias, weight) if bias is not None else None
        return self.weight_transform(attrs, weight), new_bias

    def used_blobs(self, attrs, blobs):
        """The blob list the base layer's forward reads, as this fork's forward uses it (torch tensors, None
        for a missing one): blob 0 and 1 through transform_blobs, the rest as stored.  Forks that store the
        blobs in another layout override this."""
        weight, bias = self.transform_blobs(attrs, blobs[0], blobs[1] if len(blobs) > 1 else None)
        used = [blobs[0] if weight is None else weight] + list(blobs[1:])
        if bias is not None:
            used[1] = bias
        return used

    def forward(self, attrs, params, *xs):
        return super().forward(attrs, self.used_blobs(attrs, params), *xs)

    def transformed_node(self, node):
        """A copy of node whose blobs are the weights as the forward uses them (no compact or shared form,
        so that the writers store exactly those values)."""
        q = copy.copy(node)
        if node.blobs is not None:
            q.blobs = [None if b is None else np.array(b, dtype=np.float32, copy=True) for b in node.blobs]
            if q.blobs and q.blobs[0] is not None:
                used = self.used_blobs(node.attrs, [None if b is None else torch.from_numpy(b) for b in q.blobs])
                q.blobs = [None if t is None else t.numpy() for t in used]
        q.quant, q.shared_from = {}, {}
        return q

    def pytorch_source(self, node, emit):
        note = self.weight_transform_note(node.attrs)
        if note:
            emit.note(note)
        real = emit.node
        emit.node = self.transformed_node(node)   # the state dict holds the transformed weights
        try:
            return self.source_layer(node, emit)
        finally:
            emit.node = real


class TransformedConvolution(TransformedWeights):
    """TransformedWeights over Convolution: ONNX's Conv and model.py's convolution on the transformed blobs."""

    def onnx(self, ctx, node):
        _onnx_conv(ctx, self.transformed_node(node), "Conv")

    def source_layer(self, node, emit):
        return _torch_conv_source(node, emit, transposed=False)


class TransformedInnerProduct(TransformedWeights):
    """TransformedWeights over InnerProduct: InnerProduct's ONNX and model.py on the transformed blobs."""

    def onnx(self, ctx, node):
        InnerProduct.onnx(self, ctx, self.transformed_node(node))

    def source_layer(self, node, emit):
        return InnerProduct.pytorch_source(self, node, emit)
