"""alanhuang1990/caffe-dev's SpecifiedSoftPlusConvolution (9e0ddc6 specified_softplus_conv_layer.cpp; V1
SPECIFIED_SOFT_PLUS_CONVOLUTION, specified_soft_plus_convolution_param 3003 there).

A Convolution (convolution_param; group 1 only) whose stored weights and bias are raw parameters: the forward
convolves with softplus(W) = float32(1 / beta) * log(1 + exp(beta W)) (no overflow guard), kernel [o][c] set
to 0 unless the rule file's entry [o][c] is 1, plus softplus(b) (never masked).  The rule file
(rule_file_path: num_output x channels integers, output by output) is not in the caffemodel; it is read as
the fork's Reshape reads it, fscanf("%d") until a call fails (caffeq/fs.py's read_text_numbers: white space
skipped, the longest base-10 integer: "1-1" is 1 then -1, "1.0" is 1 and then the reading ends; an integer past
32 bits is refused), and must hold num_output x channels of them (the fork's CHECK).  caffeq reads it where
it is found (next to the prototxt, then the current folder); without it the mask comes from the weights: the
fork zeroes a masked kernel's raw weights in memory and in every snapshot, so a kernel all of whose raw weights
are 0 is read as masked (with a note; a kept kernel of raw zeros, which the fork would turn into log(2) / beta,
is then the one case read wrong).
"""
import os

import numpy as np
import torch

from ..fs import read_text_numbers, resolve_source
from .conv import Convolution
from .registry import LayerError, register_layer
from .transformed_weights import TransformedConvolution

#: the largest rule file read (its integers are one per kernel)
MAX_RULE_BYTES = 64 << 20


def softplus_weights(w, beta: float):
    """scale by beta, exp, + 1, log, scale by float32(1 / beta), as the fork's caffe_cpu_scale chain."""
    return torch.log(torch.exp(w * np.float32(beta)) + 1.0) * float(np.float32(1.0 / np.float32(beta)))


def read_rules(path, outputs, channels):
    """The rule file as an (outputs, channels) bool mask of the kept kernels (entry == 1), its integers read
    as the fork's `while (fscanf(rule_fid, "%d", &temp_int) == 1)` loop reads them."""
    what = f"rule file {path}"
    values = read_text_numbers(path, "%d", MAX_RULE_BYTES, what, LayerError)
    if values is None:
        raise LayerError(f"{what}: no longer there")
    if len(values) != outputs * channels:
        raise LayerError(f"rule file {path} holds {len(values)} integers; the layer needs num_output x channels = "
                         f"{outputs} x {channels}")
    return np.array(values).reshape(outputs, channels) == 1


@register_layer("SpecifiedSoftPlusConvolution")
class SpecifiedSoftPlusConvolution(TransformedConvolution, Convolution):
    reads_files = True

    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs.get("orn") or attrs.get("first_conv") or attrs.get("edge_pads") is not None:
            raise LayerError("SpecifiedSoftPlusConvolution reads no other fork's convolution fields")
        p = lp.specified_soft_plus_convolution_param
        if not p.rule_file_path:
            raise LayerError("specified_soft_plus_convolution_param.rule_file_path is required")
        attrs.update(rule_file=str(p.rule_file_path), beta=float(np.float32(p.beta)))
        if not attrs["beta"] > 0:
            raise LayerError(f"specified_soft_plus_convolution_param.beta must be > 0 here, got {attrs['beta']} (caffeq's "
                             f"choice: the fork divides by it unchecked, and a negative beta negates the softplus)")
        return attrs

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes)
        if attrs["group"] != 1:
            raise LayerError("SpecifiedSoftPlusConvolution supports group 1 only, as the fork")
        path = resolve_source(attrs["rule_file"], attrs.get("base_dir"))
        attrs["_rules"] = read_rules(path, attrs["num_output"], in_shapes[0][1]) if os.path.isfile(path) else None
        if attrs["_rules"] is None:
            attrs["reading_notes"] = [f"rule file '{attrs['rule_file']}' not found: the kept kernels are those whose "
                                      f"raw weights are not all 0 (the fork zeroes the masked ones)"]
        return shapes

    def _mask(self, attrs, weight):
        if attrs.get("_rules") is not None:
            kept = torch.from_numpy(attrs["_rules"]).to(weight.device)
        else:
            kept = weight.reshape(weight.shape[0], weight.shape[1], -1).ne(0).any(2)
        return kept.reshape(weight.shape[0], weight.shape[1], 1, 1)

    def transform_blobs(self, attrs, weight, bias):
        w = torch.where(self._mask(attrs, weight), softplus_weights(weight, attrs["beta"]), torch.zeros_like(weight))
        return w, None if bias is None else softplus_weights(bias, attrs["beta"])

    def weight_transform_note(self, attrs):
        source = ("the rule file" if attrs.get("_rules") is not None
                  else "the stored weights (no rule file: a kernel of raw zeros is masked)")
        return (f"SpecifiedSoftPlusConvolution keeps softplus(W), masked by {source}, and softplus(b) (the fork "
                f"computes them from the raw blobs at every forward)")


__all__ = ["SpecifiedSoftPlusConvolution", "read_rules", "softplus_weights"]
