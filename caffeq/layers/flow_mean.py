"""FlowNet's Mean layer: the per-channel mean subtraction (and scaling to [0, 1]) that the FlowNet and
DispNet release nets apply to their two images inside the net.

- Mean (lmb-freiburg's flownet-release, as in liruoteng/FlowNet e9321cb src/caffe/layers/mean_layer.cpp;
  unchanged in lmb-freiburg/flownet2 476d400; mean_param: operation ADD | SUBTRACT (required), value
  (repeated), file, mean_scale [1], input_scale [1], output_scale [1]): as many tops as bottoms, each shaped
  like its bottom; top = output_scale (input_scale x + mean_scale m) in float, m = +-value[c % len(value)]
  (negated by SUBTRACT) for channel c, and the channels must be a multiple of the values.  With `file` the
  fork reads a BlobProto at every reshape and cycles it over each item's C H W values: caffeq sizes
  such a layer and refuses to run it (no released net uses it).
"""
import numpy as np
import torch

from .registry import AT_LEAST, Layer, LayerError, need_blobs, register_layer

_SUBTRACT = 4   # MeanParameter.SUBTRACT


def flow_net_mean(x, mean: list[float], input_scale: float, output_scale: float):
    """output_scale (input_scale x + mean[c % len(mean)]) per channel c of x (N, C, ...), in x's dtype;
    `mean` already holds mean_scale times the signed values (float32 products, as the fork's floats)."""
    c = x.shape[1]
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).repeat(c // len(mean))
    shape = [1, c] + [1] * (x.dim() - 2)
    return (x * input_scale + m.view(shape).to(x.dtype)) * output_scale


@register_layer("Mean")
class FlowNetMean(Layer):
    def parse(self, lp):
        need_blobs(lp, "Mean", range(1, AT_LEAST), len(lp.bottom) or 1)
        p = lp.mean_param
        if not p.HasField("operation"):
            raise LayerError("mean_param.operation (ADD or SUBTRACT) is required")
        if not p.value and not p.HasField("file"):
            raise LayerError("mean_param needs its values (value) or a mean blob (file)")
        sign = np.float32(-1.0 if p.operation == _SUBTRACT else 1.0)
        mean = [float(np.float32(p.mean_scale) * (sign * np.float32(v))) for v in p.value]
        return {"name": lp.name, "file": p.file if p.HasField("file") else None, "mean": mean,
                "input_scale": float(p.input_scale), "output_scale": float(p.output_scale)}

    def infer(self, attrs, in_shapes):
        for shape in in_shapes:
            if not 2 <= len(shape) <= 4:
                raise LayerError(f"the fork's Mean reads num, channels, height and width: bottom {list(shape)} "
                                 f"has {len(shape)} axes")
            if attrs["file"] is None and shape[1] % len(attrs["mean"]):
                raise LayerError(f"bottom channels {shape[1]} are not a multiple of the {len(attrs['mean'])} "
                                 f"mean_param values")
        return [tuple(s) for s in in_shapes]

    def _check_runs(self, attrs):
        if attrs["file"] is not None:
            raise LayerError(f"layer '{attrs['name']}' (Mean): the fork reads its mean blob from "
                             f"{attrs['file']!r} at every reshape; caffeq runs the value form only "
                             f"(give the means as mean_param.value)")

    def forward(self, attrs, params, *bottoms):
        self._check_runs(attrs)
        tops = [flow_net_mean(x, attrs["mean"], attrs["input_scale"], attrs["output_scale"]) for x in bottoms]
        return tops[0] if len(tops) == 1 else tuple(tops)

    def onnx(self, ctx, node):
        a = node.attrs
        self._check_runs(a)
        for i, (x, top) in enumerate(zip(node.inputs, node.outputs)):
            shape = ctx.shape(x)
            m = np.tile(np.array(a["mean"], np.float32), shape[1] // len(a["mean"]))
            m = m.reshape([1, shape[1]] + [1] * (len(shape) - 2))
            scaled = ctx.add_node("Mul", [x, ctx.f32(a["input_scale"])], ctx.tmp(f"{node.name}_in{i}"), name=node.name)
            shifted = ctx.add_node("Add", [scaled, ctx.const(m)], ctx.tmp(f"{node.name}_mean{i}"))
            ctx.add_node("Mul", [shifted, ctx.f32(a["output_scale"])], [top])

    def pytorch_source(self, node, emit):
        a = node.attrs
        self._check_runs(a)
        fn = emit.helper(flow_net_mean)
        calls = [f"{fn}({x}, {emit.lit(a['mean'])}, {emit.lit(a['input_scale'])}, {emit.lit(a['output_scale'])})"
                 for x in emit.inputs]
        return calls[0] if len(calls) == 1 else calls
