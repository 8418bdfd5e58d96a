"""limuhit's GAN and image-compression Caffe (limuhit/Caffe_Gan 649f569, with the layers of limuhit/CCN
bf0b27b that its nets use).

- LayerParameter.net_id marks the sub-nets (a bitmask) a layer belongs to: the fork's pycaffe extras run or
  update one sub-net at a time; a plain forward runs every layer, as caffeq does.
- Switch (switch_layer.cpp; claimed where the layer sets net_id, the mark of this fork's nets): a copy of
  bottom 0, the only bottom a net selects until its pycaffe extras pick another; the top is bottom 0's shape.
- Dtow (CCN dtow_layer.cpp, dtow_param psize, method): MDTOW (the default) is depth-to-space,
  top (N, C / p^2, H p, W p) with top[n, c / p^2, h p + (c % p^2) / p, w p + c % p] = bottom[n, c, h, w]
  (torch's pixel_shuffle); MWTOD is its inverse (pixel_unshuffle).  Both read the bottom as 4-axis.  The
  zig-zag LDTOW / LWTOD orders are refused.
- WSplitData (Caffe_Gan wsplit_data_layer.{hpp,cpp,cu}, wsplit_param weight): one bottom to exactly two tops
  that share its data (ShareData in Reshape), each (N, C, H, W) by the legacy accessors; its forward computes
  nothing.  `weight` is backward only (read and unused here): the GPU backward gives the bottom top 0's
  gradient plus top 1's times weight |g0|_1 / |g1|_1; the CPU backward is empty.  Caffe_Gan's ImgResize
  (its nets' img_resize_param, declared in CCN's caffe.proto) has no source in either repository and stays
  unsupported.
- ConstScale (CCN const_scale_layer.cpp, const_scale_param scale [1], bias [0]): y = scale x, rounded,
  then + bias (two float32 roundings).
- Mask with imp_map_param (mask_layer.cpp; faceid.py's Mask is another fork's two-bottom layer): a one-channel
  importance map to channel_out channels of 1 where it is > 0.5, else 0, (N, channel_out, H, W).  Its one
  (1, 1, 1, 1) blob records the share of ones at each forward and is never read.
"""
import numpy as np
import torch.nn.functional as F

from .registry import (
    AT_LEAST,
    Layer,
    LayerError,
    claim_layers,
    legacy_depth_space_shape,
    legacy_nchw,
    need_blobs,
    register_layer,
)

MDTOW, MWTOD = 0, 1


@claim_layers("Switch", lambda lp: lp.HasField("net_id"))
class GanSwitch(Layer):
    def parse(self, lp):
        need_blobs(lp, "Switch", range(2, AT_LEAST), 1)
        return {}

    def infer(self, attrs, in_shapes):
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, *xs):
        return xs[0].clone()

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]}.clone()"


@register_layer("Dtow")
class Dtow(Layer):
    def parse(self, lp):
        need_blobs(lp, "Dtow", 1, 1)
        p = lp.dtow_param
        if p.method not in (MDTOW, MWTOD):
            raise LayerError("dtow_param.method LDTOW / LWTOD (the fork's zig-zag orders) is not supported")
        if p.psize < 1:
            raise LayerError(f"dtow_param.psize must be >= 1, got {p.psize}")
        return {"p": int(p.psize), "to_space": p.method == MDTOW}

    def infer(self, attrs, in_shapes):
        attrs["_legacy"] = list(legacy_nchw(in_shapes[0], "Dtow"))
        return [legacy_depth_space_shape(in_shapes[0], attrs["p"], attrs["to_space"], "dtow_param.psize")]

    def forward(self, attrs, params, x):
        x = x.reshape(attrs["_legacy"])
        return F.pixel_shuffle(x, attrs["p"]) if attrs["to_space"] else F.pixel_unshuffle(x, attrs["p"])

    def onnx(self, ctx, node):
        x = ctx.op("Reshape", [node.inputs[0], ctx.i64(node.attrs["_legacy"])], "x4", name=node.name)
        p = node.attrs["p"]
        if node.attrs["to_space"]:
            ctx.add_node("DepthToSpace", [x], [node.outputs[0]], blocksize=p, mode="CRD")
            return
        # ONNX's SpaceToDepth orders the channels (dy, dx, c); pixel_unshuffle's (c, dy, dx) through reshapes
        n, c, h, w = node.attrs["_legacy"]
        six = ctx.op("Reshape", [x, ctx.i64([n, c, h // p, p, w // p, p])], "six")
        moved = ctx.op("Transpose", [six], "moved", perm=[0, 1, 3, 5, 2, 4])
        ctx.add_node("Reshape", [moved, ctx.i64([n, c * p * p, h // p, w // p])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.uses("F")
        fn = "F.pixel_shuffle" if node.attrs["to_space"] else "F.pixel_unshuffle"
        return f"{fn}({emit.inputs[0]}.reshape({node.attrs['_legacy']}), {node.attrs['p']})"


@register_layer("WSplitData")
class WSplitData(Layer):
    def parse(self, lp):
        need_blobs(lp, "WSplitData", 1, 2)
        return {}

    def infer(self, attrs, in_shapes):
        attrs["_legacy"] = list(legacy_nchw(in_shapes[0], "WSplitData"))
        return [tuple(attrs["_legacy"])] * 2

    def forward(self, attrs, params, x):
        x = x.reshape(attrs["_legacy"])
        return x, x

    def onnx(self, ctx, node):
        x = ctx.op("Reshape", [node.inputs[0], ctx.i64(node.attrs["_legacy"])], "x4", name=node.name)
        for out in node.outputs:
            ctx.add_node("Identity", [x], [out])

    def pytorch_source(self, node, emit):
        return [f"{emit.inputs[0]}.reshape({node.attrs['_legacy']})"] * 2


def const_scale(x, scale: float, bias: float):
    """ConstScale: scale x rounded to float32, then + bias."""
    return x * scale + bias


@register_layer("ConstScale")
class ConstScale(Layer):
    def parse(self, lp):
        need_blobs(lp, "ConstScale", 1, 1)
        p = lp.const_scale_param
        return {"scale": float(np.float32(p.scale)), "bias": float(np.float32(p.bias))}

    def forward(self, attrs, params, x):
        return const_scale(x, attrs["scale"], attrs["bias"])

    def onnx(self, ctx, node):
        scaled = ctx.op("Mul", [node.inputs[0], ctx.f32(node.attrs["scale"])], "scaled", name=node.name)
        ctx.add_node("Add", [scaled, ctx.f32(node.attrs["bias"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(const_scale)}({emit.inputs[0]}, {emit.lit(a['scale'])}, {emit.lit(a['bias'])})"


@claim_layers("Mask", lambda lp: lp.HasField("imp_map_param"))
class ImportanceMask(Layer):
    blob_names = ("ones_share",)

    def parse(self, lp):
        need_blobs(lp, "Mask", 1, 1)
        c = int(lp.imp_map_param.channel_out)
        if c < 1:
            raise LayerError(f"imp_map_param.channel_out must be >= 1, got {c}")
        return {"channels": c}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "Mask")
        if c != 1:
            raise LayerError(f"Mask (imp_map_param) takes a one-channel map (the fork's check), got {c} channels")
        attrs["_legacy"] = [n, c, h, w]
        return [(n, attrs["channels"], h, w)]

    def param_shapes(self, attrs, in_shapes):
        return [(1, 1, 1, 1)]

    def init_params(self, attrs, shapes, rng):
        return [np.zeros((1, 1, 1, 1), np.float32)]

    def forward(self, attrs, params, x):
        x = x.reshape(attrs["_legacy"])
        return (x > 0.5).to(x.dtype).expand(-1, attrs["channels"], -1, -1).contiguous()

    def onnx(self, ctx, node):
        x = ctx.op("Reshape", [node.inputs[0], ctx.i64(node.attrs["_legacy"])], "x4", name=node.name)
        on = ctx.op("Cast", [ctx.op("Greater", [x, ctx.f32(0.5)], "above")], "on", to=1)
        ctx.add_node("Tile", [on, ctx.i64([1, node.attrs["channels"], 1, 1])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.module("torch.nn.Parameter(torch.zeros(1, 1, 1, 1), requires_grad=False)")
        emit.param("", 0, attr=m[len("self."):])
        x = f"{emit.inputs[0]}.reshape({node.attrs['_legacy']})"
        return f"({x} > 0.5).to({emit.inputs[0]}.dtype).expand(-1, {node.attrs['channels']}, -1, -1).contiguous()"
