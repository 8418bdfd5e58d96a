"""SSD's Permute and Normalize.

- Permute accepts a partial `order` and appends the unlisted axes in order.
- Normalize divides by sqrt(sum x^2 + eps) (over C*H*W, or over C per pixel)
  and multiplies by a learned scale: one value (a 0-axis blob) when
  channel_shared, else one per channel.  A norm_param that sets scale_value is
  shenfalong/styletransfer's Normalize (shenfalong_style.py's STYLE_NORMALIZE, no blobs).
"""

import numpy as np
import torch
from torch import nn

from ..happynear import HAPPYNEAR_NORMALIZE, normalize_fork
from ..registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from ..shenfalong_style import STYLE_NORMALIZE


def _reduce_sum_square(ctx, x, axes, out, keepdims=1):
    """ReduceSumSquare with axes as attribute (opset < 18) or input (>= 18)."""
    if ctx.opset >= 18:
        ctx.add_node("ReduceSumSquare", [x, ctx.const(np.array(axes, np.int64))], [out], keepdims=keepdims)
    else:
        ctx.add_node("ReduceSumSquare", [x], [out], axes=list(axes), keepdims=keepdims)
    return out


# ---- Permute ------------------------------------------------------------------

def full_order(order, ndim):
    """SSD's order: the listed axes, then the unlisted ones in their natural order."""
    for o in order:
        if o >= ndim:
            raise LayerError(f"permute_param.order {o} is out of range for a {ndim}-axis input")
    return tuple(order) + tuple(i for i in range(ndim) if i not in order)


@register_layer("Permute")
class Permute(Layer):
    def parse(self, lp):
        need_blobs(lp, "Permute", 1)
        order = [int(o) for o in lp.permute_param.order]
        if len(set(order)) != len(order):
            raise LayerError(f"permute_param.order {order} has duplicate axes")
        return {"order": tuple(order)}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        perm = full_order(attrs["order"], len(s))
        return [tuple(s[p] for p in perm)]

    def forward(self, attrs, params, x):
        perm = full_order(attrs["order"], x.dim())
        return x.permute(perm)

    def onnx(self, ctx, node):
        perm = full_order(node.attrs["order"], len(ctx.shape(node.inputs[0])))
        ctx.add_node("Transpose", [node.inputs[0]], [node.outputs[0]], name=node.name, perm=list(perm))

    def pytorch_source(self, node, emit):
        perm = full_order(node.attrs["order"], len(emit.in_shape(0)))
        x = emit.inputs[0]
        return [x] if perm == tuple(range(len(perm))) else f"{x}.permute({list(perm)})"


# ---- Normalize ------------------------------------------------------------------

def ssd_normalize(x, weight, across_spatial: bool, channel_shared: bool, eps: float):
    """SSD's Normalize: x / sqrt(sum of x^2 + eps) * weight; the sum runs over C (per pixel) or over
    C, H, W (across_spatial); weight is one value (channel_shared) or one per channel."""
    dims = list(range(1, x.dim())) if across_spatial else [1]
    norm = torch.sqrt((x * x).sum(dim=dims, keepdim=True) + eps)
    y = x / norm
    if channel_shared:
        return y * weight.reshape(())
    return y * weight.reshape([1, -1] + [1] * (x.dim() - 2))


class Normalize(nn.Module):
    """SSD's Normalize layer (ssd_normalize) with its learned scale."""

    def __init__(self, channels, across_spatial=False, channel_shared=False, eps=1e-10):
        super().__init__()
        self.across_spatial, self.channel_shared, self.eps = across_spatial, channel_shared, eps
        self.weight = nn.Parameter(torch.ones(() if channel_shared else (channels,)))

    def forward(self, x):
        return ssd_normalize(x, self.weight, self.across_spatial, self.channel_shared, self.eps)


# model.py gets the same code that forward runs
TORCH_NORMALIZE = torch_sources(ssd_normalize, Normalize)


def _fork_spec(attrs):
    """The spec of a Normalize read as another fork's (happynear's, shenfalong/styletransfer's), else None."""
    return {"happynear": HAPPYNEAR_NORMALIZE, "shenfalong": STYLE_NORMALIZE}.get(attrs.get("fork"))


@register_layer("Normalize")
class NormalizeLayer(Layer):
    """SSD's Normalize (norm_param); a layer with happynear's normalize_param (no blobs) is handed
    to happynear.py's spec, and one with neither message is read as its net's fork (normalize_fork)."""
    blob_names = ("scale",)

    def parse(self, lp):
        if normalize_fork(lp) == "happynear":
            return HAPPYNEAR_NORMALIZE.parse(lp)
        if lp.norm_param.HasField("scale_value"):
            return STYLE_NORMALIZE.parse(lp)
        need_blobs(lp, "Normalize", 1)
        p = lp.norm_param
        attrs = {"across_spatial": bool(p.across_spatial), "channel_shared": bool(p.channel_shared),
                 "eps": float(p.eps), "fill": 1.0}
        if p.HasField("scale_filler"):
            f = p.scale_filler
            if f.type != "constant":
                raise LayerError(f"norm_param.scale_filler type '{f.type}': only 'constant' is supported "
                                 f"for filling a missing scale blob")
            attrs["fill"] = float(f.value)
        if attrs["eps"] < 0:
            raise LayerError(f"norm_param.eps must be >= 0, got {attrs['eps']}")
        return attrs

    def blob_names_for(self, attrs):
        return () if _fork_spec(attrs) else self.blob_names

    def infer(self, attrs, in_shapes):
        if _fork_spec(attrs):
            return _fork_spec(attrs).infer(attrs, in_shapes)
        s = in_shapes[0]
        # SSD reads num/channels/height/width, which exist for 2 to 4 axes only
        if not 2 <= len(s) <= 4:
            raise LayerError(f"Normalize needs a 2- to 4-axis input, got {list(s)}")
        return [tuple(s)]

    def param_shapes(self, attrs, in_shapes):
        if _fork_spec(attrs):
            return None
        # channel_shared: SSD makes a 0-axis blob (one value, no shape)
        return [()] if attrs["channel_shared"] else [(in_shapes[0][1],)]

    def init_params(self, attrs, shapes, rng):
        return [np.full(shapes[0], attrs["fill"], np.float32)]

    def forward(self, attrs, params, x):
        if _fork_spec(attrs):
            return _fork_spec(attrs).forward(attrs, params, x)
        return ssd_normalize(x, params[0], attrs["across_spatial"], attrs["channel_shared"], attrs["eps"])

    def macs(self, attrs, in_shapes, out_shapes):
        return _fork_spec(attrs).macs(attrs, in_shapes, out_shapes) if _fork_spec(attrs) else 0

    def onnx(self, ctx, node):
        if _fork_spec(node.attrs):
            return _fork_spec(node.attrs).onnx(ctx, node)
        a = node.attrs
        x, out = node.inputs[0], node.outputs[0]
        rank = len(ctx.shape(x))
        axes = list(range(1, rank)) if a["across_spatial"] else [1]
        ss = _reduce_sum_square(ctx, x, axes, ctx.tmp(node.name + "_ss"))
        eps = ctx.const(np.array(a["eps"], np.float32), node.name + "_eps")
        sse = ctx.add_node("Add", [ss, eps], [ctx.tmp(node.name + "_sse")])[0]
        norm = ctx.add_node("Sqrt", [sse], [ctx.tmp(node.name + "_norm")])[0]
        y = ctx.add_node("Div", [x, norm], [ctx.tmp(node.name + "_unit")], name=node.name)[0]
        scale = ctx.weight(node, 0)
        if not a["channel_shared"] and rank > 2:
            shaped = ctx.tmp(node.name + "_scale_c11")
            ctx.add_node("Reshape", [scale, ctx.const(np.array([-1] + [1] * (rank - 2), np.int64))], [shaped])
            scale = shaped
        ctx.add_node("Mul", [y, scale], [out])

    def pytorch_source(self, node, emit):
        if _fork_spec(node.attrs):
            return _fork_spec(node.attrs).pytorch_source(node, emit)
        a = node.attrs
        args = [str(emit.in_shape(0)[1])]
        if a["across_spatial"]:
            args.append("across_spatial=True")
        if a["channel_shared"]:
            args.append("channel_shared=True")
        args.append(f"eps={emit.lit(a['eps'])}")
        m = emit.module(f"{emit.helper(TORCH_NORMALIZE)}({', '.join(args)})")
        emit.param("weight", 0)
        return f"{m}({emit.inputs[0]})"
