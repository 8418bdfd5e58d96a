"""vincentzhang/roi-fcn's ROIConvolution (its caffe-roi submodule, 481611c roi_conv_layer.cu and im2col_roi.cu):
a convolution computed only where the rois are.  Bottoms: the feature map (N, C, H, W) and rois (R, 5) =
[batch, x1, y1, x2, y2] in image pixels; tops: the convolution (BVLC's shape and blobs) and the rois on the
map, [(int) batch, round(x1 s), round(y1 s), round(x2 s), round(y2 s)] with s = roi_convolution_param
.spatial_scale and CUDA's round (half away from zero).

An output position (y, x) keeps its convolution value when the top-left tap of its window, (x stride - pad,
y stride - pad), lies inside some rounded roi (inclusive, whatever the roi's batch index); elsewhere it is the
bias alone.  A 1x1 kernel of stride 1 without pad skips the fork's masked im2col: a plain convolution.
This is the fork's GPU forward, the one its authors ran; its CPU forward masks each input tap by the rois grown
by kernel / 2 instead, writes the rounded rois into its bottom and leaves the second top unset (not reproduced).
convolution_param.is_roi only relaxes the bottoms' shape check.  2-D only.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .c_numerics import c_round, onnx_c_round
from .conv import Convolution, _onnx_conv, conv_edge_pads
from .registry import LayerError, register_layer, torch_sources


def roi_conv_rois(rois, spatial_scale: float):
    """The second top: each roi's batch index truncated, its corners times spatial_scale rounded half away from 0."""
    r = rois.reshape(-1, 5)
    return torch.cat([torch.trunc(r[:, :1]), c_round(r[:, 1:] * spatial_scale)], dim=1)


def roi_conv_keep(rounded, out_h: int, out_w: int, stride: list[int], pad: list[int]):
    """(out_h, out_w): whether each output window's top-left tap lies inside some rounded roi (inclusive)."""
    ys = torch.arange(out_h, device=rounded.device).to(rounded.dtype) * stride[0] - pad[0]
    xs = torch.arange(out_w, device=rounded.device).to(rounded.dtype) * stride[1] - pad[1]
    in_x = (rounded[:, 1:2] <= xs[None, :]) & (xs[None, :] <= rounded[:, 3:4])
    in_y = (rounded[:, 2:3] <= ys[None, :]) & (ys[None, :] <= rounded[:, 4:5])
    return (in_y[:, :, None] & in_x[:, None, :]).any(dim=0)


def roi_conv2d(x, rois, weight, bias, stride: list[int], pad: list[int], dilation: list[int], groups: int,
               spatial_scale: float, masked: bool):
    """ROIConvolution's two tops: the convolution, the bias alone where no roi holds the window, and the rois."""
    y = F.conv2d(x, weight, bias, stride, pad, dilation, groups)
    rounded = roi_conv_rois(rois, spatial_scale)
    if masked:
        keep = roi_conv_keep(rounded, y.shape[2], y.shape[3], stride, pad)
        alone = bias.reshape(1, -1, 1, 1) if bias is not None else torch.zeros((), dtype=y.dtype, device=y.device)
        y = torch.where(keep[None, None], y, alone.expand_as(y))
    return y, rounded


class ROIConv2d(nn.Module):
    """model.py's ROIConvolution: its weight and bias, roi_conv2d's forward."""

    def __init__(self, in_channels, out_channels, kernel, stride, pad, dilation, groups, bias, spatial_scale, masked):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_channels, in_channels // groups, *kernel))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.args = (list(stride), list(pad), list(dilation), groups, spatial_scale, masked)

    def forward(self, x, rois):
        return roi_conv2d(x, rois, self.weight, self.bias, *self.args)


TORCH_ROI_CONV = torch_sources(c_round, roi_conv_rois, roi_conv_keep, roi_conv2d, ROIConv2d)


@register_layer("ROIConvolution")
class ROIConvolution(Convolution):
    def parse(self, lp):
        if len(lp.bottom) != 2 or len(lp.top) != 2:
            raise LayerError(f"ROIConvolution takes 2 bottoms (features, rois) and gives 2 tops (the convolution, "
                             f"the rois on the map), got {len(lp.bottom)} and {len(lp.top)}")
        attrs = super().parse(lp)
        if attrs.get("first_conv") or attrs.get("orn"):
            raise LayerError("ROIConvolution is a plain convolution in the fork (no other fork's convolution options)")
        attrs["roi_scale"] = float(np.float32(lp.roi_convolution_param.spatial_scale))
        if not np.isfinite(attrs["roi_scale"]):
            raise LayerError(f"roi_convolution_param.spatial_scale must be finite, got {attrs['roi_scale']}")
        return attrs

    def infer(self, attrs, in_shapes):
        features, rois = in_shapes
        if len(features) != 4:
            raise LayerError(f"ROIConvolution's features must be (N, C, H, W), got {list(features)}")
        if len(rois) < 2 or rois[1] != 5 or any(d != 1 for d in rois[2:]):
            raise LayerError(f"ROIConvolution's rois must be (R, 5) = [batch, x1, y1, x2, y2], got {list(rois)}")
        top = super().infer(attrs, [features])[0]
        if attrs["_axis"] != 1 or len(attrs["kernel"]) != 2 or conv_edge_pads(attrs, features[-2:]) is not None:
            raise LayerError("ROIConvolution is a plain 2-D convolution over axis 1 in the fork")
        # the fork's is_1x1_ path skips the masked im2col
        attrs["masked"] = not (tuple(attrs["kernel"]) == (1, 1) and tuple(attrs["stride"]) == (1, 1)
                               and not any(attrs["pad"]))
        return [top, tuple(rois)]

    def param_shapes(self, attrs, in_shapes):
        return super().param_shapes(attrs, in_shapes[:1])

    def macs(self, attrs, in_shapes, out_shapes):
        return super().macs(attrs, in_shapes[:1], out_shapes[:1])

    def _args(self, a):
        return list(a["stride"]), list(a["pad"]), list(a["dilation"]), a["group"], a["roi_scale"], a["masked"]

    def forward(self, attrs, params, x, rois):
        y, rounded = roi_conv2d(x, rois, params[0], params[1] if attrs["bias_term"] else None, *self._args(attrs))
        return y, rounded.reshape(rois.shape)

    def onnx(self, ctx, node):
        a = node.attrs
        x, rois = node.inputs
        conv = ctx.tmp(f"{node.name}_conv") if a["masked"] else node.outputs[0]
        _onnx_conv(ctx, node, "Conv", inputs=[x], outputs=[conv])
        flat = ctx.op("Reshape", [rois, ctx.i64([-1, 5])], "rois")
        batch = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([1]), ctx.i64([1])], "batch")
        corners = ctx.op("Slice", [flat, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], "corners")
        scaled = ctx.op("Mul", [corners, ctx.const(np.array(a["roi_scale"], np.float32))], "scaled")
        rounded = onnx_c_round(ctx, scaled)
        # (R, 5) rows with the rois' trailing unit axes back: R stays the run's (a proposal layer decides it)
        extra = list(range(2, len(ctx.shape(rois))))
        rows = ctx.add_node("Concat", [ctx.trunc(batch, "batch_int"), rounded],
                            [ctx.tmp(f"{node.name}_rows") if extra else node.outputs[1]], axis=1)[0]
        if extra:
            ctx.add_node("Unsqueeze", [rows, ctx.i64(extra)], [node.outputs[1]])
        if not a["masked"]:
            return
        _, _, oh, ow = ctx.shape(node.outputs[0])
        ys = ctx.const((np.arange(oh) * a["stride"][0] - a["pad"][0]).astype(np.float32).reshape(1, oh))
        xs = ctx.const((np.arange(ow) * a["stride"][1] - a["pad"][1]).astype(np.float32).reshape(1, ow))

        def column(i):
            return ctx.op("Slice", [rounded, ctx.i64([i]), ctx.i64([i + 1]), ctx.i64([1])], f"corner{i}")

        def between(lo, values, hi, hint):
            return ctx.op("And", [ctx.op("LessOrEqual", [lo, values], hint + "_lo"),
                                  ctx.op("LessOrEqual", [values, hi], hint + "_hi")], hint)

        in_x = between(column(0), xs, column(2), "in_x")     # (R, W)
        in_y = between(column(1), ys, column(3), "in_y")     # (R, H)
        both = ctx.op("And", [ctx.op("Unsqueeze", [in_y, ctx.i64([2])], "in_y3"),
                              ctx.op("Unsqueeze", [in_x, ctx.i64([1])], "in_x3")], "inside")
        # any roi: the max over R of the 0/1 masks (an empty roi list keeps no position)
        counts = ctx.op("ReduceSum", [ctx.op("Cast", [both], "inside_f", to=1), ctx.i64([0])], "hits", keepdims=0)
        keep = ctx.op("Greater", [counts, ctx.const(np.array(0, np.float32))], "keep")
        alone = ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([1, -1, 1, 1])], "bias") if a["bias_term"] \
            else ctx.const(np.array(0, np.float32))
        ctx.add_node("Where", [keep, conv, alone], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(TORCH_ROI_CONV, emit.in_shape(0)[1], a["num_output"], list(a["kernel"]), *self._args(a)[:4],
                          a["bias_term"], a["roi_scale"], a["masked"])
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        both = emit.tmp(node.name + "_roi_conv")
        emit.stmt(f"{both} = {m}({emit.inputs[0]}, {emit.inputs[1]})")
        return [f"{both}[0]", f"{both}[1].reshape({emit.inputs[1]}.shape)"]


__all__ = ["ROIConvolution"]
