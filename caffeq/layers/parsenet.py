"""ParseNet's output layer (weiliu89/caffe, branch fcn, 36001c2, parse_output_layer.cpp).

ParseOutput: for each image and pixel, the label of the highest channel, the first one on a tie (the
fork starts from channel 0 and moves on only where a later channel is strictly greater), as a float
(N, 1, H, W); with a second top, the maximum too.  (Its ParseEvaluate scorer only scores the net and
is dropped with the other scorers.)
"""
import torch

from .registry import Layer, LayerError, need_blobs, register_layer


def parse_output(x):
    """(labels, maxima) of an (N, C, H, W) blob: the first channel holding each pixel's maximum."""
    best = x.max(dim=1, keepdim=True).values
    channels = torch.arange(x.shape[1], device=x.device).reshape(1, -1, 1, 1)
    first = torch.where(x == best, channels, x.shape[1]).min(dim=1, keepdim=True).values
    return first.to(x.dtype), best


@register_layer("ParseOutput")
class ParseOutput(Layer):
    def parse(self, lp):
        need_blobs(lp, "ParseOutput", 1, (1, 2))
        return {"tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"ParseOutput needs an (N, C, H, W) input, got {list(s)}")
        return [(s[0], 1, s[2], s[3])] * attrs["tops"]

    def forward(self, attrs, params, x):
        labels, maxima = parse_output(x)
        return (labels, maxima) if attrs["tops"] == 2 else labels

    def onnx(self, ctx, node):
        from .norm import onnx_reduce
        x = node.inputs[0]
        channels = int(ctx.shape(x)[1])
        best = onnx_reduce(ctx, "ReduceMax", x, [1], True)
        hit = ctx.op("Equal", [x, best], "is_max")
        index = ctx.const(torch.arange(channels, dtype=torch.float32).reshape(1, -1, 1, 1).numpy())
        candidates = ctx.op("Where", [hit, index, ctx.f32(float(channels))], "candidates")
        ctx.add_node("Identity", [onnx_reduce(ctx, "ReduceMin", candidates, [1], True)], [node.outputs[0]],
                     name=node.name)
        if len(node.outputs) == 2:
            ctx.add_node("Identity", [best], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        call = f"{emit.helper(parse_output)}({emit.inputs[0]})"
        if node.attrs["tops"] == 1:
            return f"{call}[0]"
        result = emit.tmp(node.name + "_out")
        emit.stmt(f"{result} = {call}")
        return [f"{result}[0]", f"{result}[1]"]
