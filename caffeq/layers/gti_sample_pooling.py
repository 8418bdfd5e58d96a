"""Gyrfalcon (GTI) MDK's sample pooling, as jack16888/caffessd 55e1f12 carries it (pooling_param.sample = 14
in src/caffe/proto/caffe.proto; SamplePoolForward in src/caffe/layers/pooling_layer.cu; its MobileNet
deploy files set `sample: true` on their 2 x 2, stride 2 MAX pools).

- Pooling with pool MAX and sample true: each output takes one element of the bottom, at row
  max(ph x stride_h - pad_h, 0) and column max(pw x stride_w - pad_w, 0), the first element of the window
  (clipped at the top and left edges); nothing is compared.  The output size is Caffe's pooling size (the
  round_mode rule and the last-window clip), as for MAX.  The fork's CPU forward writes only the mask and
  leaves the values at -FLT_MAX; caffeq computes the GPU forward, the one the MDK's nets ran.  AVE and
  STOCHASTIC pooling ignore the flag.  The argmax mask top (hstart x W + wstart) is refused.
"""
from .pooling import MAX, Pooling, window
from .registry import LayerError, claim_layers


def _sampled_rows(out, stride, pad):
    return [max(i * stride - pad, 0) for i in range(out)]


@claim_layers("Pooling", lambda lp: lp.pooling_param.sample and lp.pooling_param.pool == MAX)
class SamplePooling(Pooling):
    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs.get("mask"):
            raise LayerError("pooling_param.sample: the argmax mask top of GTI's sample pooling is not supported")
        if attrs.get("fork") is not None or attrs.get("edge") is not None or attrs.get("negate"):
            raise LayerError("pooling_param.sample: only Caffe's own MAX pooling geometry (kernel, stride, pad, "
                             "round_mode, global_pooling) is read with GTI's sample pooling")
        attrs["sample"] = True
        return attrs

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) != 4:
            raise LayerError(f"pooling_param.sample: GTI's sample pooling needs a 4-axis input, got {list(in_shapes[0])}")
        tops = super().infer(attrs, in_shapes)
        _, s, p, out = window(attrs, in_shapes[0][2], in_shapes[0][3])
        attrs["_rows"] = _sampled_rows(out[0], s[0], p[0])
        attrs["_cols"] = _sampled_rows(out[1], s[1], p[1])
        return tops

    def forward(self, attrs, params, x):
        return x[:, :, attrs["_rows"]][:, :, :, attrs["_cols"]]

    def macs(self, attrs, in_shapes, out_shapes):
        return 0

    def onnx(self, ctx, node):
        a = node.attrs
        rows = ctx.op("Gather", [node.inputs[0], ctx.i64(a["_rows"])], "sampled_rows", axis=2)
        ctx.add_node("Gather", [rows, ctx.i64(a["_cols"])], [node.outputs[0]], name=node.name, axis=3)

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.inputs[0]}[:, :, {a['_rows']}][:, :, :, {a['_cols']}]"


__all__ = ["SamplePooling"]
