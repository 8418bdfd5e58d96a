"""M2PELU (Coldmooon/Code-for-MPELU) and Shakeout (kgl-prml/shakeout-for-caffe), as each fork computes it at TEST.

- M2PELU (Coldmooon/Code-for-MPELU 46d137a, caffe/include/layers/m2pelu_layer.hpp,
  caffe/src/caffe/layers/m2pelu_layer.cpp/.cu; m2pelu_param: alpha_filler, beta_filler, channel_shared):
  y = max(x, 0) + alpha_c * (exp(beta_c * min(x, 0)) - 1), with c the index on axis 1 ((i / count(2)) %
  channels), so x for x > 0 and alpha_c * (exp(beta_c * x) - 1) otherwise (the GPU kernel's form).  Two blobs,
  alpha then beta, each (C,), or 0-axis (one value for every channel) with channel_shared.  Unset fillers are
  constant 1 (alpha and beta).  The bottom needs 2 to 4 axes (the fork reads channels(), Blob's legacy
  accessor, which CHECK-fails past 4 axes).  In place is allowed (the fork copies the bottom first).  A
  filler other than constant, uniform or gaussian (the fork's "taylor", msra, xavier...) only sets where
  training starts: caffeq's random weights then take the fork's default, constant 1, with a note.
- The fork's "taylor" weight filler (caffe/include/filler.hpp TaylorFiller: gaussian, std
  sqrt(2 / n / (1 + alpha^2 beta^2)), FillerParameter alpha = 9, beta = 10) only initializes training; its
  fields are read and nothing at TEST depends on them.
- Shakeout (kgl-prml/shakeout-for-caffe 497518b, shakeout_layer.hpp, shakeout_layer.cpp/.cu; shakeout_param:
  dropout_ratio, shakeout_scale, tanh_smooth_scale, operate_layer_type): a NeuronLayer (one bottom, one top)
  that builds an inner layer from its own LayerParameter with the type set to operate_layer_type and
  shakeout_param cleared, and owns that layer's blobs (InnerProduct or Convolution: weight, bias).  At TRAIN it
  runs the inner layer twice (on the masked, rescaled input with the weights, and on
  shakeout_scale * (mask / (1 - ratio) - 1) * x with sign(weight) and zero bias) and adds the two; at TEST it
  runs the inner layer alone on its own blobs.  So at TEST, which caffeq computes (its fine-tuning too), a
  Shakeout layer is its operate_layer_type layer: same parameters, blobs, shapes, ONNX and model.py, its
  reading notes, and a bottom it trims in place (Ristretto's) written back, since the fork hands the inner
  Forward its own bottom vector.  The fork refuses operate_layer_type "Shakeout"; an unset or unknown type
  fails in Caffe's layer registry.
"""
import copy

import numpy as np
import torch
from torch import nn

from ..io.schema import caffe_pb2
from .registry import Layer, LayerError, need_blobs, register_layer, spec_for

# ---- M2PELU -------------------------------------------------------------------------------------

_INIT_FILLERS = ("constant", "uniform", "gaussian")
_M2PELU_DEFAULT = {"type": "constant", "value": 1.0}


def _m2pelu_filler(p, field, notes):
    """The filler caffeq's random weights use for one M2PELU blob (the fork's default when unset)."""
    if not p.HasField(field):
        return dict(_M2PELU_DEFAULT)
    f = getattr(p, field)
    if f.type not in _INIT_FILLERS:
        notes.append(f"m2pelu_param.{field} type '{f.type}' only sets where training starts; caffeq's random "
                     f"weights use the fork's default (constant 1) for it")
        return dict(_M2PELU_DEFAULT)
    return {"type": f.type, "value": float(f.value), "min": float(f.min), "max": float(f.max),
            "mean": float(f.mean), "std": float(f.std)}


def _fill(filler, shape, rng):
    if filler["type"] == "uniform":
        return rng.uniform(filler["min"], filler["max"], shape).astype(np.float32)
    if filler["type"] == "gaussian":
        return (filler["mean"] + filler["std"] * rng.standard_normal(shape)).astype(np.float32)
    return np.full(shape, filler["value"], np.float32)


def m2pelu(x, alpha, beta):
    """max(x, 0) + alpha * (exp(beta * min(x, 0)) - 1), alpha and beta per channel (axis 1) or 0-axis."""
    if alpha.dim() > 0:
        shape = [1, -1] + [1] * (x.dim() - 2)
        alpha, beta = alpha.reshape(shape), beta.reshape(shape)
    return x.clamp(min=0) + alpha * (torch.exp(beta * x.clamp(max=0)) - 1)


class M2PELUModule(nn.Module):
    """M2PELU with its alpha and beta blobs: (channels,) each, or 0-axis when shared."""

    def __init__(self, channels, shared):
        super().__init__()
        shape = () if shared else (channels,)
        self.alpha = nn.Parameter(torch.ones(shape))
        self.beta = nn.Parameter(torch.ones(shape))

    def forward(self, x):
        return m2pelu(x, self.alpha, self.beta)


@register_layer("M2PELU")
class M2PELU(Layer):
    blob_names = ("alpha", "beta")

    def parse(self, lp):
        need_blobs(lp, "M2PELU", 1, 1)
        p = lp.m2pelu_param
        notes = []
        attrs = {"channel_shared": bool(p.channel_shared),
                 "alpha_filler": _m2pelu_filler(p, "alpha_filler", notes),
                 "beta_filler": _m2pelu_filler(p, "beta_filler", notes)}
        if notes:
            attrs["reading_notes"] = notes
        return attrs

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) < 2:
            raise LayerError(f"M2PELU's bottom must have at least 2 axes, got shape {list(in_shapes[0])}")
        if len(in_shapes[0]) > 4:
            # m2pelu_layer.cpp reads bottom[0]->channels(), Blob's legacy accessor (CHECK_LE(num_axes(), 4))
            raise LayerError(f"M2PELU reads its bottom's channels() (Caffe's legacy accessor): at most 4 axes, "
                             f"got shape {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        return [()] * 2 if attrs["channel_shared"] else [(in_shapes[0][1],)] * 2

    def init_params(self, attrs, shapes, rng):
        return [_fill(attrs["alpha_filler"], shapes[0], rng), _fill(attrs["beta_filler"], shapes[1], rng)]

    def forward(self, attrs, params, x):
        return m2pelu(x, params[0], params[1])

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        alpha, beta = ctx.weight(node, 0), ctx.weight(node, 1)
        ndim = len(ctx.shape(x))
        if not node.attrs["channel_shared"] and ndim > 2:
            per_channel = ctx.const(np.array([-1] + [1] * (ndim - 2), np.int64))
            alpha = ctx.add_node("Reshape", [alpha, per_channel], [ctx.tmp(name + "_alpha")], name=name)[0]
            beta = ctx.add_node("Reshape", [beta, per_channel], [ctx.tmp(name + "_beta")])[0]
        zero = ctx.const(np.array(0.0, np.float32))
        pos = ctx.add_node("Max", [x, zero], [ctx.tmp(name + "_pos")])[0]
        neg = ctx.add_node("Min", [x, zero], [ctx.tmp(name + "_neg")])[0]
        scaled = ctx.add_node("Mul", [beta, neg], [ctx.tmp(name + "_scaled")])[0]
        e = ctx.add_node("Exp", [scaled], [ctx.tmp(name + "_exp")])[0]
        em1 = ctx.add_node("Sub", [e, ctx.const(np.array(1.0, np.float32))], [ctx.tmp(name + "_expm1")])[0]
        tail = ctx.add_node("Mul", [alpha, em1], [ctx.tmp(name + "_tail")])[0]
        ctx.add_node("Add", [pos, tail], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.instance(M2PELUModule, emit.in_shape(0)[1], node.attrs["channel_shared"], needs=[m2pelu])
        emit.param("alpha", 0)
        emit.param("beta", 1)
        return f"{m}({emit.inputs[0]})"


# ---- Shakeout -----------------------------------------------------------------------------------

# inner-spec properties a Shakeout node cannot pass on (its own class attributes say otherwise)
_INNER_REFUSED = ("is_data", "is_training_only", "uses_training_flag", "data_dependent_shape", "reads_bottom_values",
                  "shape_from_user", "makes_training_targets", "reads_files")


@register_layer("Shakeout")
class Shakeout(Layer):
    """The operate_layer_type layer of the same LayerParameter (shakeout_param cleared): the fork's TEST forward."""

    def parse(self, lp):
        need_blobs(lp, "Shakeout", 1, 1)
        p = lp.shakeout_param
        kind = p.operate_layer_type
        if not kind:
            raise LayerError("shakeout_param.operate_layer_type is required (the layer Shakeout runs, e.g. "
                             "\"InnerProduct\" or \"Convolution\")")
        if kind == "Shakeout":
            raise LayerError("shakeout_param.operate_layer_type must not be 'Shakeout'")
        inner_lp = caffe_pb2.LayerParameter()
        inner_lp.CopyFrom(lp)
        inner_lp.type = kind
        inner_lp.ClearField("shakeout_param")
        spec = spec_for(inner_lp)
        if spec is None:
            raise LayerError(f"shakeout_param.operate_layer_type '{kind}' is not a layer type caffeq knows")
        refused = [flag for flag in _INNER_REFUSED if getattr(spec, flag, False)]
        if refused:
            raise LayerError(f"shakeout_param.operate_layer_type '{kind}' is not supported inside Shakeout "
                             f"({refused[0]})")
        inner = spec.parse(inner_lp)
        attrs = {"operate_type": kind, "operate": inner, "operate_spec": spec}
        # the inner layer's notes, its type's own line included (ir reads reading_note off the Shakeout spec)
        notes = [*inner.pop("reading_notes", ()), *([spec.reading_note] if spec.reading_note else [])]
        if notes:
            attrs["reading_notes"] = notes
        return attrs

    @staticmethod
    def _inner(attrs):
        """The inner spec and its attrs; the graph's written_back (set on the Shakeout node) passed on."""
        inner = attrs["operate"]
        if "written_back" in attrs:
            inner = {**inner, "written_back": attrs["written_back"]}
        return attrs["operate_spec"], inner

    @classmethod
    def _inner_node(cls, node):
        q = copy.copy(node)
        q.type = node.attrs["operate_type"]
        q.spec, q.attrs = cls._inner(node.attrs)
        return q

    def bottoms_written_back(self, attrs):
        # the fork hands its own bottom vector to the inner Forward at TEST: a layer that trims its
        # bottom in place (Ristretto's) writes the Shakeout's bottom
        spec, inner = self._inner(attrs)
        return spec.bottoms_written_back(inner)

    def infer(self, attrs, in_shapes):
        spec, inner = self._inner(attrs)
        return spec.infer(inner, in_shapes)

    def param_shapes(self, attrs, in_shapes):
        spec, inner = self._inner(attrs)
        return spec.param_shapes(inner, in_shapes)

    def top_values(self, attrs, in_shapes):
        spec, inner = self._inner(attrs)
        return spec.top_values(inner, in_shapes)

    def init_params(self, attrs, shapes, rng):
        spec, inner = self._inner(attrs)
        return spec.init_params(inner, shapes, rng)

    def stored_blobs(self, attrs, arrays, notes):
        spec, inner = self._inner(attrs)
        return spec.stored_blobs(inner, arrays, notes)

    def blob_names_for(self, attrs):
        spec, inner = self._inner(attrs)
        return spec.blob_names_for(inner)

    def buffer_blobs_for(self, attrs):
        spec, inner = self._inner(attrs)
        return spec.buffer_blobs_for(inner)

    def weight_axes_for(self, attrs):
        spec, inner = self._inner(attrs)
        return spec.weight_axes_for(inner)

    def cannot_run(self, attrs, in_shapes):
        spec, inner = self._inner(attrs)
        return spec.cannot_run(inner, in_shapes)

    def macs(self, attrs, in_shapes, out_shapes):
        spec, inner = self._inner(attrs)
        return spec.macs(inner, in_shapes, out_shapes)

    def forward(self, attrs, params, x):
        spec, inner = self._inner(attrs)
        return spec.forward(inner, params, x)

    def onnx(self, ctx, node):
        return node.attrs["operate_spec"].onnx(ctx, self._inner_node(node))

    def pytorch_source(self, node, emit):
        inner = self._inner_node(node)
        real = emit.node
        emit.node = inner
        try:
            return node.attrs["operate_spec"].pytorch_source(inner, emit)
        finally:
            emit.node = real
