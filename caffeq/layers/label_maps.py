"""Label-map layers of CesarCadena/caffe-segnet (my-master db4618d, src/caffe/layers/
eltwise_scalar_comparison_layer.cpp and remap_labels_layer.cpp; CPU only):

- EltwiseScalarComparison: 1 where the value equals one of eltwise_scalarcomparison_param.value, else 0.
- RemapLabels: remap_labels_param.newlabel[j] where the value equals oldlabel[j] (the last matching j wins),
  else 0 (unlisted labels become 0).
Both compare in float32, exactly.  Both loops set the top to 0 before they compare the bottom: written in
place (top = bottom) they compare 0 with the labels, so every element becomes the map of 0, as here.
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


def remap_in_place(x, old: list[float], new: list[float]):
    """The layers written in place: each element compared after the fork zeroed it, the map of 0."""
    return remap_values(torch.zeros_like(x), old, new)


class _LabelMap(Layer):
    def parse_pairs(self, lp, old, new):
        return {"old": old, "new": new, "in_place": lp.top[0] == lp.bottom[0]}

    def forward(self, attrs, params, x):
        fn = remap_in_place if attrs["in_place"] else remap_values
        return fn(x, attrs["old"], attrs["new"])

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        zeros = ctx.filled(x, 0.0, "zeros", name=node.name)
        compared = zeros if a["in_place"] else x
        out = zeros
        for o, n in zip(a["old"], a["new"]):
            out = ctx.op("Where", [ctx.op("Equal", [compared, ctx.f32(o)], "match"), ctx.f32(n), out], "mapped")
        ctx.add_node("Identity", [out], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(remap_values)
        if a["in_place"]:
            fn = emit.helper(remap_in_place)
        return f"{fn}({emit.inputs[0]}, {a['old']!r}, {a['new']!r})"



def _f32(values):
    return [float(np.float32(v)) for v in values]


@register_layer("EltwiseScalarComparison")
class EltwiseScalarComparison(_LabelMap):
    def parse(self, lp):
        need_blobs(lp, "EltwiseScalarComparison", 1, 1)
        values = _f32(lp.eltwise_scalarcomparison_param.value)
        return self.parse_pairs(lp, values, [1.0] * len(values))


@register_layer("RemapLabels")
class RemapLabels(_LabelMap):
    def parse(self, lp):
        need_blobs(lp, "RemapLabels", 1, 1)
        p = lp.remap_labels_param
        if len(p.newlabel) < len(p.oldlabel):
            raise LayerError(f"remap_labels_param has {len(p.oldlabel)} oldlabel but {len(p.newlabel)} newlabel "
                             f"values (the fork reads one newlabel per oldlabel)")
        return self.parse_pairs(lp, _f32(p.oldlabel), _f32(p.newlabel[:len(p.oldlabel)]))
