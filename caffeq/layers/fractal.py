"""FractalNet's join and the freeze-drop-path sum (iPhysicist/CNNDesignPatterns' nets).

- FractalJoin (gustavla/fractalnet 7d07da6, caffe/src/caffe/layers/fractal_join_layer.cpp/.cu): two or more
  bottoms of one shape; at TEST their mean, computed as the fork does: m = float(1 / n), top = 0, then
  top += m * bottom i in bottom order (saxpy).  Training drops whole bottoms with drop_path_ratio (none,
  one for every bottom, or one per bottom: another count is refused, in every phase) and averages the rest.
- FreezeDropPath (iPhysicist/CNNDesignPatterns 7fd82ef, freeze_drop_path.cpp/.cu): two or more bottoms of
  one shape; at TEST their plain sum in bottom order.  Training sums only the first branches up to one it
  draws (freeze_drop_path_param).
The top keeps the bottoms' shape; neither has blobs.
"""
import numpy as np
import torch

from .registry import AT_LEAST, Layer, LayerError, need_blobs, register_layer


def scaled_sum(xs: list[torch.Tensor], m: float):
    """0 + m * x0 + m * x1 + ... in order (m = 1: the plain sum)."""
    y = xs[0] * m
    for x in xs[1:]:
        y = y + x * m
    return y


class _Join(Layer):
    def bottoms_alike(self, in_shapes):
        first = tuple(in_shapes[0])
        for s in in_shapes[1:]:
            if tuple(s) != first:
                raise LayerError(f"{self.types[0]} needs bottoms of one shape (the fork's check), got "
                                 f"{[list(x) for x in in_shapes]}")
        return [first]

    def infer(self, attrs, in_shapes):
        return self.bottoms_alike(in_shapes)

    def forward(self, attrs, params, *xs):
        return scaled_sum(list(xs), attrs["m"])

    def onnx(self, ctx, node):
        m = ctx.const(np.array(node.attrs["m"], np.float32))
        terms = [x if node.attrs["m"] == 1.0 else ctx.op("Mul", [x, m], "term") for x in node.inputs]
        y = terms[0]
        for i, t in enumerate(terms[1:], 1):
            y = ctx.add_node("Add", [y, t], [node.outputs[0] if i == len(terms) - 1 else ctx.tmp("partial")])[0]

    def pytorch_source(self, node, emit):
        return f"{emit.helper(scaled_sum)}([{', '.join(emit.inputs)}], {emit.lit(node.attrs['m'])})"


@register_layer("FractalJoin")
class FractalJoin(_Join):
    def parse(self, lp):
        need_blobs(lp, "FractalJoin", range(2, AT_LEAST), 1)
        ratios = list(lp.fractal_join_param.drop_path_ratio)
        if len(ratios) not in (0, 1, len(lp.bottom)):
            raise LayerError(f"fractal_join_param gives {len(ratios)} drop_path_ratio for {len(lp.bottom)} bottoms; "
                             f"give none, one, or one per bottom (the fork's check)")
        return {"m": float(np.float32(1.0 / len(lp.bottom)))}


@register_layer("FreezeDropPath")
class FreezeDropPath(_Join):
    def parse(self, lp):
        need_blobs(lp, "FreezeDropPath", range(2, AT_LEAST), 1)
        return {"m": 1.0}
