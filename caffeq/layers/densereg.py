"""DenseReg's Python layers (ralpguler/DenseReg CombineRegressions.py and CombineRegressionsHuman.py,
d28c89e), natively: quantized surface coordinates plus the regressed residual of their bin.

Bottoms (horizontal index, vertical index, horizontal residuals, vertical residuals): the indexes
are argmax maps (N, 1, H, W), the residuals (N, D, H, W).  For each of the two axes,
reg = sum over j = 1 .. D - 1 of residual[:, j] * (index == j) (bin 0, the background, adds nothing).
CombineRegressions (faces): top = (index + reg - 1) / (D - 1), and -1 where that is negative.
CombineRegressionsHuman: top = reg clipped to [0, 1].  Tops (N, 1, H, W), computed in float64 as
numpy does and stored as float32.  (The modules broadcast one image's residual against the index
map, so they run only with N = 1; every image is computed alike here.)
"""
import numpy as np
import torch

from .registry import Layer, LayerError, need_blobs, register_layer


def densereg_combine(index, residuals, human: bool):
    """One axis of CombineRegressions(Human): (N, 1, H, W) index, (N, D, H, W) residuals."""
    d = residuals.shape[1]
    bins = torch.arange(d, dtype=torch.float64, device=index.device).reshape(1, d, 1, 1)
    bins[:, 0] = -1.0   # bin 0 adds nothing
    picked = (index.to(torch.float64) == bins).to(torch.float64) * residuals.to(torch.float64)
    reg = picked.sum(dim=1, keepdim=True)
    if human:
        out = reg.clamp(0.0, 1.0)
    else:
        out = (index.to(torch.float64) + reg - 1.0) / (d - 1)
        out = torch.where(out < 0, torch.full_like(out, -1.0), out)
    return out.to(residuals.dtype)


class _CombineRegressions(Layer):
    human = False

    def parse(self, lp):
        need_blobs(lp, "DenseReg's CombineRegressionsLayer", 4, 2,
                   "horizontal index, vertical index, horizontal residuals, vertical residuals")
        return {}

    def infer(self, attrs, in_shapes):
        hi, vi, hr, vr = (tuple(s) for s in in_shapes)
        if len(hi) != 4 or hi[1] != 1 or vi != hi:
            raise LayerError(f"the index maps must be (N, 1, H, W) alike, got {list(hi)} and {list(vi)}")
        if len(hr) != 4 or hr != vr or (hr[0],) + hr[2:] != (hi[0],) + hi[2:] or hr[1] < 2:
            raise LayerError(f"the residuals must be (N, D >= 2, H, W) alike with the index maps' N, H, W, got "
                             f"{list(hr)} and {list(vr)}")
        return [hi, hi]

    def forward(self, attrs, params, hi, vi, hr, vr):
        return densereg_combine(hi, hr, self.human), densereg_combine(vi, vr, self.human)

    def onnx(self, ctx, node):
        for k, (index, residuals, out) in enumerate(((node.inputs[0], node.inputs[2], node.outputs[0]),
                                                      (node.inputs[1], node.inputs[3], node.outputs[1]))):
            self._emit_axis(ctx, f"{node.name}_{k}", index, residuals, out)

    def _emit_axis(self, ctx, name, index, residuals, out):
        d = ctx.shape(residuals)[1]

        def op(op_type, inputs, hint, **kw):
            return ctx.add_node(op_type, inputs, [ctx.tmp(f"{name}_{hint}")], **kw)[0]

        def f64(v):
            return ctx.const(np.array(v, np.float64))

        bins = np.arange(d, dtype=np.float64).reshape(1, d, 1, 1)
        bins[:, 0] = -1.0
        idx = op("Cast", [index], "idx", to=11)   # DOUBLE
        hit = op("Cast", [op("Equal", [idx, f64(bins)], "eq")], "hit", to=11)
        reg = op("ReduceSum", [op("Mul", [hit, op("Cast", [residuals], "res", to=11)], "picked"),
                               ctx.const(np.array([1], np.int64))], "reg", keepdims=1)
        if self.human:
            y = op("Min", [op("Max", [reg, f64(0.0)], "lo"), f64(1.0)], "clip")
        else:
            y = op("Div", [op("Sub", [op("Add", [idx, reg], "sum"), f64(1.0)], "less"), f64(float(d - 1))], "scaled")
            y = op("Where", [op("Less", [y, f64(0.0)], "neg"), f64(-1.0), y], "floor")
        ctx.add_node("Cast", [y], [out], to=1)

    def pytorch_source(self, node, emit):
        fn = emit.helper(densereg_combine)
        i = emit.inputs
        human = emit.lit(self.human)
        return [f"{fn}({i[0]}, {i[2]}, {human})", f"{fn}({i[1]}, {i[3]}, {human})"]


@register_layer("Python:CombineRegressions.CombineRegressionsLayer")
class CombineRegressions(_CombineRegressions):
    human = False


@register_layer("Python:CombineRegressionsHuman.CombineRegressionsLayer")
class CombineRegressionsHuman(_CombineRegressions):
    human = True
