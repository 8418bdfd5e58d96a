"""Layers whose forward is the identity and whose backward adds a regularization term.

- OutputDecay (yi94code/HRSOD 4788245, caffe-master/src/caffe/layers/output_decay_layer.cpp / .cu; the layer
  of wdzhao123/FRD's nets, whose own Caffe is not public): in place only; its Forward is empty, so the top
  is the bottom.  Backward adds output_decay * sign(x) (regularization_type "L1") or output_decay * x ("L2")
  to the gradient, as finetune does here.
"""
import torch

from .registry import Layer, LayerError, need_blobs, register_layer


class _DecayedGradient(torch.autograd.Function):
    """The identity whose gradient gains decay * sign(x) (l1) or decay * x."""

    @staticmethod
    def forward(ctx, x, decay, l1):
        ctx.save_for_backward(x)
        ctx.decay, ctx.l1 = decay, l1
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        term = torch.sign(x) if ctx.l1 else x
        return grad + ctx.decay * term, None, None


@register_layer("OutputDecay")
class OutputDecay(Layer):
    def parse(self, lp):
        need_blobs(lp, "OutputDecay", 1, 1)
        if lp.top[0] != lp.bottom[0]:
            raise LayerError(f"OutputDecay works in place only (top '{lp.top[0]}' must be its bottom "
                             f"'{lp.bottom[0]}'), as the fork checks")
        p = lp.output_decay_param
        kind = p.regularization_type
        if kind not in ("L1", "L2"):
            raise LayerError(f"output_decay_param.regularization_type must be \"L1\" or \"L2\", got {kind!r}")
        return {"l1": kind == "L1", "decay": float(p.output_decay)}

    def forward(self, attrs, params, x):
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        return _DecayedGradient.apply(x, attrs["decay"], attrs["l1"])

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return emit.inputs[0]   # model.py infers: the decay only reaches gradients
