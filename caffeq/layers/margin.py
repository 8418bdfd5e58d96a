"""LargeMarginInnerProduct (wy1iu/LargeMargin_Softmax_Loss c3e9f20, largemargin_inner_product_layer.cpp)
as its TEST-phase copies use it.

Bottoms: x and label (num must match, LayerSetUp); tops: the scores (x's axes before `axis`, then
num_output) and lambda, shape (1,).  One blob, the weight (num_output, K), no bias.  Forward_cpu
always writes x . W^T first; types DOUBLE, TRIPLE and QUADRUPLE then rewrite each row's label
column with the angular margin mixed in by lambda, which needs the label: a training computation,
read and sized (the same tops) but refused to run or export here.  Type SINGLE (the default, and what the repository's TEST layers set) is x . W^T.

lambda = max(base * (1 + gamma * iter)^-power, lambda_min), where iter starts at `iteration` and
is incremented before every forward: the value of a net's first forward (iter = iteration + 1) is
given, as a constant.
"""
import numpy as np
import torch

from ..errors import ExportError
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
        # the other types read and size as SINGLE (the same tops); running them is refused (_refusal)
        margin = None if p.type == SINGLE else TYPE_NAMES.get(p.type, str(p.type))
        f32 = np.float32
        lam = f32(p.base) * np.power(f32(1) + f32(p.gamma) * f32(p.iteration + 1), -f32(p.power))
        return {"num_output": int(p.num_output), "bias_term": False, "axis": int(p.axis), "transpose": False,
                "lambda": float(max(f32(lam), f32(p.lambda_min))), "with_lambda": len(lp.top) == 2,
                "name": lp.name, "margin": margin}

    @staticmethod
    def _refusal(attrs):
        return (f"layer '{attrs['name']}' (LargeMarginInnerProduct): largemargin_inner_product_param.type "
                f"{attrs['margin']} mixes the label's angular margin into the scores (training); caffeq runs "
                f"type SINGLE (x . W^T), as the fork's TEST layers use it")

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
        if attrs["margin"]:
            raise LayerError(self._refusal(attrs))
        scores = super().forward(attrs, params, x)
        if not attrs["with_lambda"]:
            return scores
        return scores, torch.full((1,), attrs["lambda"], dtype=x.dtype, device=x.device)

    def onnx(self, ctx, node):
        if node.attrs["margin"]:
            raise ExportError(self._refusal(node.attrs))
        super().onnx(ctx, node)
        if node.attrs["with_lambda"]:
            ctx.add_node("Identity", [ctx.const(np.array([node.attrs["lambda"]], np.float32))], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        if node.attrs["margin"]:
            raise ExportError(self._refusal(node.attrs))
        scores = super().pytorch_source(node, emit)
        if not node.attrs["with_lambda"]:
            return scores
        return [scores, f"torch.full((1,), {emit.lit(node.attrs['lambda'])})"]
