"""Label-map layers of CesarCadena/caffe-segnet (my-master db4618d, src/caffe/layers/
eltwise_scalar_comparison_layer.cpp and remap_labels_layer.cpp; CPU only):

- EltwiseScalarComparison: 1 where the value equals one of eltwise_scalarcomparison_param.value, else 0.
- RemapLabels: remap_labels_param.newlabel[j] where the value equals oldlabel[j] (the last matching j wins),
  else 0 (unlisted labels become 0).
Both compare in float32, exactly.
"""
import numpy as np
import torch

from .registry import Layer, LayerError, need_blobs, register_layer


def remap_values(x, old: list[float], new: list[float]):
    """new[j] where x == old[j] (later pairs win), 0 elsewhere; EltwiseScalarComparison is new = 1s."""
    out = torch.zeros_like(x)
    for o, n in zip(old, new):
        out = torch.where(x == o, torch.full_like(x, n), out)
    return out


class _LabelMap(Layer):
    def forward(self, attrs, params, x):
        return remap_values(x, attrs["old"], attrs["new"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        out = ctx.op("Mul", [x, ctx.f32(0.0)], "zeros", name=node.name)
        for o, n in zip(node.attrs["old"], node.attrs["new"]):
            out = ctx.op("Where", [ctx.op("Equal", [x, ctx.f32(o)], "match"), ctx.f32(n), out], "mapped")
        ctx.add_node("Identity", [out], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(remap_values)}({emit.inputs[0]}, {a['old']!r}, {a['new']!r})"


def _f32(values):
    return [float(np.float32(v)) for v in values]


@register_layer("EltwiseScalarComparison")
class EltwiseScalarComparison(_LabelMap):
    def parse(self, lp):
        need_blobs(lp, "EltwiseScalarComparison", 1, 1)
        values = _f32(lp.eltwise_scalarcomparison_param.value)
        return {"old": values, "new": [1.0] * len(values)}


@register_layer("RemapLabels")
class RemapLabels(_LabelMap):
    def parse(self, lp):
        need_blobs(lp, "RemapLabels", 1, 1)
        p = lp.remap_labels_param
        if len(p.newlabel) < len(p.oldlabel):
            raise LayerError(f"remap_labels_param has {len(p.oldlabel)} oldlabel but {len(p.newlabel)} newlabel "
                             f"values (the fork reads one newlabel per oldlabel)")
        return {"old": _f32(p.oldlabel), "new": _f32(p.newlabel[:len(p.oldlabel)])}
