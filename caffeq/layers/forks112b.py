"""Three forks' inference layers (corpus112b).

- BBTXTBB, BB3TXTBB: Gzzgz/master_thesis_code 6eca474 (a copy of libornovax/master_thesis_code), the deploy
  output decoders caffe/src/caffe/layers/bbtxt_bb_layer.cpp and bb3txt_bb_layer.cpp (NeuronLayers, CPU forward
  only; the GPU build runs it too); bbtxt_bb_param {ideal_size (float), downsampling (int32)}, both required
  (caffe/src/caffe/proto/caffe.proto, 149 there, 111149 here).  For each item and each coded channel c
  (BBTXTBB: 1-4, x at 1 and 3; BB3TXTBB: 1-7, x at 1, 3 and 5) at row i, column j:
      top = float(int(downsampling * (k + 0.5f))) + ideal_size * (x - 0.5f)
  with k = j for an x channel, i for a y one (the int() truncates a float product).  Channel 0 (the
  probability) and the channels past the coded ones are not written: the bottom's values where the layer
  works in place (every corpus net), zeros (the freshly allocated top) otherwise.
- EliwiseProduct: Lucas2012/simplified-SIM-structure-inference-machine 45998fd,
  caffe-master/src/caffe/layers/eliwise_product_layer.cpp (its "strategy 2", the one compiled): the bottom
  flattened from eliwise_product_param.axis (default 1) times ONE scalar weight (blob (1,)); with bias_term
  a bias blob that the forward never adds, of shape (0,): LayerSetUp builds it from `vector<int>
  bias_shape(1)`, one axis of size 0 (its filler's CHECK(count) then stops a net set up from scratch).  Top: bottom.shape[:axis] + (K,).  Not BSDH's ElewiseProduct
  (caffeq/layers/bsdh.py: one weight per value, top (N, K, 1, 1)).  Forward_gpu is commented out of the
  header (caffe-master/include/caffe/common_layers.hpp), so the CPU forward runs everywhere.
  eliwise_product_param is 141 there, 111141 here.
- FuseInnerProduct: PKU-ICST-MIPL/CCL_TMM2018 8c2b694, caffe-master/src/caffe/layers/fuse_inner_product_layer
  .cpp/.cu (Forward_cpu calls Forward_gpu): one bottom, two tops, each x W^T + b, BVLC InnerProduct's
  computation with inner_product_param (num_output, bias_term, axis); weights (num_output, K).  The fork
  reads neither transpose nor normalize: it always multiplies by the (num_output, K) matrix.
"""
import dataclasses

import numpy as np
import torch
from onnx import numpy_helper

from .conv import InnerProduct
from .registry import Layer, LayerError, canonical_axis, count, need_blobs, register_layer

# ---- torch (copied into model.py) ------------------------------------------------------------------


def bbtxt_decode(x, ideal: float, downsampling: float, x_channels: list[int], coded: int, keep: bool):
    """The fork's box decoder: channels 1 .. coded-1 of (N, C, H, W) to pixel coordinates; the others are
    the bottom's (keep: in place) or zeros."""
    h, w = x.shape[2], x.shape[3]
    cols = torch.trunc((torch.arange(w, dtype=x.dtype, device=x.device) + 0.5) * downsampling)
    rows = torch.trunc((torch.arange(h, dtype=x.dtype, device=x.device) + 0.5) * downsampling)
    parts = [x[:, :1] if keep else torch.zeros_like(x[:, :1])]
    for c in range(1, coded):
        offset = cols.reshape(1, 1, 1, w) if c in x_channels else rows.reshape(1, 1, h, 1)
        parts.append(offset + ideal * (x[:, c:c + 1] - 0.5))
    if x.shape[1] > coded:
        parts.append(x[:, coded:] if keep else torch.zeros_like(x[:, coded:]))
    return torch.cat(parts, 1)


def eliwise_product(x, weight, axis: int):
    """The bottom flattened from `axis`, times the scalar weight."""
    return x.flatten(axis) * weight.reshape(1)


# ---- BBTXTBB / BB3TXTBB ----------------------------------------------------------------------------

class _BoxDecoder(Layer):
    coded = 5
    x_channels = (1, 3)

    def parse(self, lp):
        kind = self.types[0]
        need_blobs(lp, kind, 1, 1)
        p = lp.bbtxt_bb_param
        for field in ("ideal_size", "downsampling"):
            if not p.HasField(field):
                raise LayerError(f"{kind} needs bbtxt_bb_param.{field} (the fork CHECKs it)")
        return {"ideal": float(np.float32(p.ideal_size)), "downsampling": int(p.downsampling),
                "keep": lp.top[0] == lp.bottom[0]}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        kind = self.types[0]
        if len(s) != 4:
            raise LayerError(f"{kind} needs a 4-axis bottom (N, C, H, W), got {list(s)}")
        if s[1] < self.coded:
            raise LayerError(f"{kind} decodes channels 1-{self.coded - 1} and needs at least {self.coded} "
                             f"channels, got {s[1]}")
        return [s]

    def _args(self, attrs):
        return (attrs["ideal"], float(attrs["downsampling"]), list(self.x_channels), self.coded, attrs["keep"])

    def forward(self, attrs, params, x):
        return bbtxt_decode(x, *self._args(attrs))

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        c, h, w = (int(d) for d in ctx.shape(x)[1:])
        f32 = np.float32
        cols = np.trunc((np.arange(w, dtype=f32) + f32(0.5)) * f32(a["downsampling"])).astype(f32)
        rows = np.trunc((np.arange(h, dtype=f32) + f32(0.5)) * f32(a["downsampling"])).astype(f32)
        grid = np.stack([np.broadcast_to(cols[None, :] if k in self.x_channels else rows[:, None], (h, w))
                         for k in range(1, self.coded)])[None].astype(f32)

        def channels(lo, hi, hint):
            return ctx.op("Slice", [x, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([1])], hint)

        coded = channels(1, self.coded, "coded")
        scaled = ctx.op("Mul", [ctx.f32(a["ideal"]), ctx.op("Sub", [coded, ctx.f32(0.5)], "centred")], "scaled")
        parts = [channels(0, 1, "head"), ctx.op("Add", [ctx.const(grid), scaled], "decoded")]
        if c > self.coded:
            parts.append(channels(self.coded, c, "tail"))
        if not a["keep"]:
            zero = numpy_helper.from_array(np.zeros(1, f32))
            for i in (0, 2)[:len(parts) - 1]:
                parts[i] = ctx.op("ConstantOfShape", [ctx.op("Shape", [parts[i]], "shape")], "zeros", value=zero)
        ctx.add_node("Concat", parts, [node.outputs[0]], name=node.name, axis=1)

    def pytorch_source(self, node, emit):
        args = self._args(node.attrs)
        return (f"{emit.helper(bbtxt_decode)}({emit.inputs[0]}, {emit.lit(args[0])}, {emit.lit(args[1])}, "
                f"{args[2]!r}, {args[3]}, {args[4]})")


@register_layer("BBTXTBB")
class BBTXTBB(_BoxDecoder):
    coded = 5
    x_channels = (1, 3)


@register_layer("BB3TXTBB")
class BB3TXTBB(_BoxDecoder):
    coded = 8
    x_channels = (1, 3, 5)


# ---- EliwiseProduct ----------------------------------------------------------------------------------

@register_layer("EliwiseProduct")
class EliwiseProduct(Layer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "EliwiseProduct", 1, 1)
        p = lp.eliwise_product_param
        return {"axis": int(p.axis), "bias_term": bool(p.bias_term)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        axis = canonical_axis(attrs["axis"], len(s), "eliwise_product_param.axis")
        attrs["_axis"] = axis
        return [s[:axis] + (count(s, axis),)]

    def param_shapes(self, attrs, in_shapes):
        return [(1,)] + ([(0,)] if attrs["bias_term"] else [])   # the fork's bias blob: one axis of size 0

    def init_params(self, attrs, shapes, rng):
        # one scalar weight: a random one, not the default zero of 1-axis blobs (the bias is never read)
        return [rng.standard_normal(1).astype(np.float32)] + [np.zeros(0, np.float32)] * (len(shapes) - 1)

    def forward(self, attrs, params, x):
        return eliwise_product(x, params[0], attrs["_axis"])

    def onnx(self, ctx, node):
        axis = node.attrs["_axis"]
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([0] * axis + [-1])], "flat")
        ctx.add_node("Mul", [flat, ctx.weight(node, 0)], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        weight = emit.module("nn.Parameter(torch.zeros(1))")
        emit.param("", 0)
        return f"{emit.helper(eliwise_product)}({emit.inputs[0]}, {weight}, {node.attrs['_axis']})"


# ---- FuseInnerProduct -----------------------------------------------------------------------------

@register_layer("FuseInnerProduct")
class FuseInnerProduct(InnerProduct):
    weight_axes = {0: 0}

    def parse(self, lp):
        need_blobs(lp, "FuseInnerProduct", 1, 2)
        attrs = super().parse(lp)
        ignored = [f for f in ("transpose", "normalize") if attrs[f]]
        if ignored:
            attrs["reading_notes"] = [f"FuseInnerProduct '{lp.name}': inner_product_param.{' and '.join(ignored)} "
                                      f"ignored (the fork's layer never reads it)"]
        attrs["transpose"] = attrs["normalize"] = False
        return attrs

    def infer(self, attrs, in_shapes):
        top = super().infer(attrs, in_shapes)[0]
        return [top, top]

    def forward(self, attrs, params, x):
        y = super().forward(attrs, params, x)
        return y, y.clone()

    def macs(self, attrs, in_shapes, out_shapes):
        return 2 * super().macs(attrs, in_shapes, out_shapes)

    def onnx(self, ctx, node):
        super().onnx(ctx, dataclasses.replace(node, outputs=node.outputs[:1], tops=node.tops[:1]))
        ctx.add_node("Identity", [node.outputs[0]], [node.outputs[1]], name=node.name + "_second")

    def pytorch_source(self, node, emit):
        y = super().pytorch_source(node, emit)
        return [y, f"{y}.clone()"]


__all__ = ["BB3TXTBB", "BBTXTBB", "EliwiseProduct", "FuseInnerProduct", "bbtxt_decode", "eliwise_product"]
