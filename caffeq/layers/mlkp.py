"""Prodpara, the "location-aware" product of Hwang64/caffe-mlkp (3f2e5fd: src/caffe/layers/prodpara_layer.cpp
and .cu, include/caffe/layers/prodpara_layer.hpp, ProdparaParameter in src/caffe/proto/caffe.proto).

One top shaped as bottom 0 (N, C, H, W); prodpara_param.num_output must equal C (the fork's CHECK_EQ).  One
blob, the weight, shaped at setup (top.num() is 1 there unless the layer runs in place, when it is N; call
it m): ACROSS_CHANNEL (m, C, 1, 1); ACROSS_FEATURE_MAP (m, 1, max_height / feat_stride + 1,
max_width / feat_stride + 1) in integer division; ACROSS_ALL (m, C, ceil(max_height / feat_stride) + 1,
ceil(max_width / feat_stride) + 1).  A bias blob (C,) follows when bias_term.

What the fork's GPU forward computes (the same in TRAIN and TEST), w being the weight blob's values in order:

- ACROSS_CHANNEL: a gemm writes w[c] over one image's C x H x W buffer, in a scratch blob of N images that
  Caffe zero-fills: top[0, c] = w[c] * x[0, c] and top[n >= 1] = 0 * x[n] (0, or NaN where x is not finite).
- ACROSS_FEATURE_MAP: the weight blob is reshaped to (N, 1, H, W).  When N * H * W exceeds what it holds,
  Caffe gives it new, zeroed memory (and keeps it: the trained weights are gone), so top = 0 * x; else
  the gemm spreads its first H * W values over the channels of image 0: top[0, c, h, w] = w[h * W + w] *
  x[0, c, h, w], top[n >= 1] = 0 * x[n].
- ACROSS_ALL: the weight blob is reshaped to (N, C, H, W): top = 0 * x when N * C * H * W exceeds it, else
  top = w[:N * C * H * W] (in order, as (N, C, H, W)) * x.
- After ACROSS_FEATURE_MAP / ACROSS_ALL, the blob is reshaped to (N, ., weight height, weight width): with
  N > 1 (not in place) that is more than it holds, so every later forward sees zeroed weights.  caffeq
  computes one (the first) forward; a batch > 1 and a weight blob too small are reported as warnings.

The fork's CPU forward differs (ACROSS_FEATURE_MAP writes only the first weight-count values of each channel
of image 0, ACROSS_ALL aborts, and every operation reads a bias blob that does not exist without bias_term);
caffeq follows the GPU one.  bias_term is refused: both forwards then overwrite the top with bias + x over the
whole top, reading the (C,)-sized bias blob far past its end.  weight_filler / bias_filler only train.
torch, ONNX, model.py.
"""
import math

import numpy as np
import torch

from ..io.schema import caffe_pb2
from .registry import Layer, LayerError, four_axes, need_blobs, positive_field, register_layer, torch_sources

OPS = {caffe_pb2.ProdparaParameter.ACROSS_CHANNEL: "ACROSS_CHANNEL",
       caffe_pb2.ProdparaParameter.ACROSS_FEATURE_MAP: "ACROSS_FEATURE_MAP",
       caffe_pb2.ProdparaParameter.ACROSS_ALL: "ACROSS_ALL"}


def prodpara_multiplier(weight, shape: list[int], operation: str):
    """What the fork's GPU forward multiplies the bottom by, of the bottom's (N, C, H, W) `shape`, from the
    weight blob (any shape: its values in order)."""
    n, c, h, w = shape
    flat = weight.reshape(-1)
    if operation == "ACROSS_ALL":
        if n * c * h * w > flat.numel():
            return weight.new_zeros(shape)
        return flat[:n * c * h * w].reshape(shape)
    if operation == "ACROSS_FEATURE_MAP":
        if n * h * w > flat.numel():
            return weight.new_zeros(shape)
        plane = flat[:h * w].reshape(1, 1, h, w).expand(1, c, h, w)
    else:
        plane = flat[:c].reshape(1, c, 1, 1).expand(1, c, h, w)
    return torch.cat([plane, weight.new_zeros((n - 1, c, h, w))]) if n > 1 else plane


def prodpara(x, weight, operation: str):
    """Prodpara's top: the multiplier times the bottom, elementwise."""
    return prodpara_multiplier(weight, list(x.shape), operation) * x


TORCH_PRODPARA = torch_sources(prodpara_multiplier, prodpara)


def prodpara_notes(attrs, shape, weight_count):
    """Warnings for what the fork's GPU forward makes of a bottom shaped (N, C, H, W) with a weight blob of
    weight_count values."""
    n, c, h, w = shape
    op = attrs["operation"]
    need = {"ACROSS_ALL": n * c * h * w, "ACROSS_FEATURE_MAP": n * h * w}.get(op, 0)
    if need > weight_count:
        return [f"Prodpara {op}: the fork reshapes its {weight_count}-value weight blob to {need} values, which "
                f"gives it new zeroed memory: the top is 0 * bottom (caffeq computes the same)"]
    notes = []
    if n > 1 and op != "ACROSS_ALL":
        notes.append(f"Prodpara {op} at batch {n}: the fork's forward scales image 0 only; images 1 to {n - 1} "
                     f"become 0 * bottom (caffeq computes the same; run a batch of 1 for every image's result)")
    if n > 1 and op != "ACROSS_CHANNEL" and not attrs["in_place"]:
        notes.append(f"Prodpara {op} at batch {n}: after each forward the fork reshapes its weight blob to a "
                     f"batch of {n}, more than it holds, so its later forwards see zeroed weights (caffeq "
                     f"computes the first forward)")
    return notes


@register_layer("Prodpara")
class Prodpara(Layer):
    blob_names = ("weight",)

    def parse(self, lp):
        need_blobs(lp, "Prodpara", range(1, 1 << 20), 1)
        p = lp.prodpara_param
        if p.bias_term:
            raise LayerError("prodpara_param.bias_term is not supported: the fork's forward then writes bias + "
                             "bottom over the whole top, reading its (C,) bias blob past its end")
        op = OPS.get(p.operation)
        if op is None:
            raise LayerError(f"prodpara_param.operation {p.operation} is not one of {sorted(OPS.values())}")
        attrs = {"operation": op, "num_output": int(p.num_output),
                 "in_place": lp.top[0] == lp.bottom[0], "bottoms": len(lp.bottom)}
        if op != "ACROSS_CHANNEL":
            stride = positive_field(p.feat_stride, "prodpara_param.feat_stride")
            if op == "ACROSS_FEATURE_MAP":   # the fork divides two ints here
                attrs["weight_hw"] = (p.max_height // stride + 1, p.max_width // stride + 1)
            else:
                attrs["weight_hw"] = (math.ceil(np.float32(p.max_height) / np.float32(stride)) + 1,
                                      math.ceil(np.float32(p.max_width) / np.float32(stride)) + 1)
        return attrs

    def infer(self, attrs, in_shapes):
        shape = four_axes(in_shapes[0], "Prodpara")
        if any(tuple(s) != tuple(in_shapes[0]) for s in in_shapes[1:]):
            raise LayerError(f"Prodpara needs every bottom shaped as the first, got {[list(s) for s in in_shapes]}")
        if attrs["num_output"] != shape[1]:
            raise LayerError(f"prodpara_param.num_output {attrs['num_output']} must equal the bottom's "
                             f"{shape[1]} channels (the fork checks it)")
        attrs["reading_notes"] = prodpara_notes(attrs, shape, math.prod(self.param_shapes(attrs, in_shapes)[0]))
        return [shape]

    def param_shapes(self, attrs, in_shapes):
        n, c = in_shapes[0][:2]
        m = n if attrs["in_place"] else 1
        if attrs["operation"] == "ACROSS_CHANNEL":
            return [(m, c, 1, 1)]
        planes = 1 if attrs["operation"] == "ACROSS_FEATURE_MAP" else c
        return [(m, planes) + tuple(attrs["weight_hw"])]

    def forward(self, attrs, params, x, *others):
        return prodpara(x, params[0], attrs["operation"])

    def pytorch_source(self, node, emit):
        weight = emit.module(f"nn.Parameter(torch.zeros({list(node.expected_param_shapes[0])}))")
        emit.param("", 0)
        return f"{emit.helper(TORCH_PRODPARA)}({emit.inputs[0]}, {weight}, {node.attrs['operation']!r})"

    def onnx(self, ctx, node):
        n, c, h, w = ctx.shape(node.inputs[0])
        op = node.attrs["operation"]
        weight_count = math.prod(node.expected_param_shapes[0])
        need = {"ACROSS_ALL": n * c * h * w, "ACROSS_FEATURE_MAP": n * h * w}.get(op, 0)
        if need > weight_count:
            mult = ctx.const(np.zeros((n, c, h, w), np.float32), node.name + "_zeros")
        else:
            take, view = {"ACROSS_ALL": (need, [n, c, h, w]), "ACROSS_FEATURE_MAP": (h * w, [1, 1, h, w]),
                          "ACROSS_CHANNEL": (c, [1, c, 1, 1])}[op]
            flat = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([-1])], "flat")
            used = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([take]), ctx.i64([0])], "used")
            mult = ctx.op("Reshape", [used, ctx.i64(view)], "view")
            if op != "ACROSS_ALL":   # image 0 only: the other images' scratch stays zero
                first = np.zeros((n, 1, 1, 1), np.float32)
                first[0] = 1
                mult = ctx.op("Mul", [mult, ctx.const(first, node.name + "_first")], "mult")
        ctx.add_node("Mul", [mult, node.inputs[0]], [node.outputs[0]], name=node.name)
