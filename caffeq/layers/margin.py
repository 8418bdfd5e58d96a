"""LargeMarginInnerProduct (wy1iu/LargeMargin_Softmax_Loss c3e9f20, largemargin_inner_product_layer.cpp)
as its TEST-phase copies use it.

Bottoms: x and label (num must match, LayerSetUp); tops: the scores (x's axes before `axis`, then
num_output) and lambda, shape (1,).  One blob, the weight (num_output, K), no bias.  Forward_cpu
always writes x . W^T first; types DOUBLE, TRIPLE and QUADRUPLE then rewrite each row's label
column with the angular margin mixed in by lambda, which needs the label: a training computation,
refused here.  Type SINGLE (the default, and what the repository's TEST layers set) is x . W^T.

lambda = max(base * (1 + gamma * iter)^-power, lambda_min), where iter starts at `iteration` and
is incremented before every forward: the value of a net's first forward (iter = iteration + 1) is
given, as a constant.
"""
import numpy as np
import torch

from .conv import InnerProduct
from .registry import LayerError, count, need_blobs, register_layer

SINGLE = 0
TYPE_NAMES = {0: "SINGLE", 1: "DOUBLE", 2: "TRIPLE", 3: "QUADRUPLE"}


@register_layer("LargeMarginInnerProduct")
class LargeMarginInnerProduct(InnerProduct):
    blob_names = ("weight",)

    def parse(self, lp):
        need_blobs(lp, "LargeMarginInnerProduct", 2, (1, 2), roles="x, label")
        p = lp.largemargin_inner_product_param
        if not p.HasField("num_output"):
            raise LayerError("largemargin_inner_product_param.num_output is required")
        if p.type != SINGLE:
            raise LayerError(f"largemargin_inner_product_param.type {TYPE_NAMES.get(p.type, p.type)} mixes the "
                             f"label's angular margin into the scores (training); caffeq runs type SINGLE "
                             f"(x . W^T), as the fork's TEST layers use it")
        f32 = np.float32
        lam = f32(p.base) * np.power(f32(1) + f32(p.gamma) * f32(p.iteration + 1), -f32(p.power))
        return {"num_output": int(p.num_output), "bias_term": False, "axis": int(p.axis), "transpose": False,
                "lambda": float(max(f32(lam), f32(p.lambda_min))), "with_lambda": len(lp.top) == 2}

    def infer(self, attrs, in_shapes):
        x, label = in_shapes
        if not x or not label or x[0] != label[0]:
            raise LayerError(f"the label's num must match x's: x {list(x)}, label {list(label)}")
        tops = super().infer(attrs, [x])
        self._k(attrs, x)
        return tops + [(1,)] if attrs["with_lambda"] else tops

    def param_shapes(self, attrs, in_shapes):
        return [(attrs["num_output"], count(in_shapes[0], self._axis(attrs, in_shapes[0])))]

    def _axis(self, attrs, shape):
        self._k(attrs, shape)
        return attrs["_axis"]

    def forward(self, attrs, params, x, label):
        scores = super().forward(attrs, params, x)
        if not attrs["with_lambda"]:
            return scores
        return scores, torch.full((1,), attrs["lambda"], dtype=x.dtype, device=x.device)

    def onnx(self, ctx, node):
        super().onnx(ctx, node)
        if node.attrs["with_lambda"]:
            ctx.add_node("Identity", [ctx.const(np.array([node.attrs["lambda"]], np.float32))], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        scores = super().pytorch_source(node, emit)
        if not node.attrs["with_lambda"]:
            return scores
        return [scores, f"torch.full((1,), {emit.lit(node.attrs['lambda'])})"]
