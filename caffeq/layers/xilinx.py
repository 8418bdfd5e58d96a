"""Layers of Xilinx's (DeePhi's) Caffe for the DNNDK / Vitis AI quantizer: the nets its DECENT tool
takes and writes (YOLOv3 conversions for the DPU, e.g. rulai-hu/DNNDK-YOLOv3).

- DeephiResize (Xilinx caffe-xilinx deephi_resize_layer.cpp; deephi_resize_param: new_height and
  new_width, or scale_h and scale_w (each pair set together), resize_type BILINEAR (0, the default) |
  NEAREST): top (N, C, new_height, new_width), or (N, C, int(H scale_h), int(W scale_w)) in float32.
  Without the DPU emulation the fork copies each plane transposed into an OpenCV float Mat and calls
  cv::resize (INTER_LINEAR or INTER_NEAREST) to the transposed size, so its first (horizontal) pass
  runs along H: OpenCV's taps along each axis, the source coordinate (d + 0.5) / (out / in) - 0.5 in
  doubles rounded to float, clamped to the edges, H combined before W.
"""
import numpy as np
import torch

from .python_layers import TORCH_CV_NEAREST, cv_nearest_resize, onnx_cv_nearest
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources

_NEAREST = 1   # DeephiResizeParameter.NEAREST


def cv_linear_taps(n_in: int, n_out: int):
    """OpenCV's INTER_LINEAR taps for a float image along one axis: (first source index, second, the
    first's weight, the second's), n_out each; the coordinate in doubles, rounded to float as OpenCV's."""
    scale = 1.0 / (n_out / n_in)
    at = ((torch.arange(n_out, dtype=torch.float64) + 0.5) * scale - 0.5).to(torch.float32)
    first = torch.floor(at)
    frac = at - first
    zero = torch.zeros((), dtype=torch.float32)
    frac = torch.where((first < 0) | (first >= n_in - 1), zero, frac)
    first = first.clamp(0, n_in - 1).long()
    second = (first + 1).clamp(max=n_in - 1)
    return first, second, 1.0 - frac, frac


def cv_linear_axis(x, axis: int, n_out: int):
    """x interpolated along `axis` (2 or 3) to n_out by OpenCV's INTER_LINEAR taps."""
    first, second, w0, w1 = cv_linear_taps(x.shape[axis], n_out)
    shape = [1, 1, 1, 1]
    shape[axis] = n_out
    dev = x.device
    wa, wb = w0.view(shape).to(dev, x.dtype), w1.view(shape).to(dev, x.dtype)
    return x.index_select(axis, first.to(dev)) * wa + x.index_select(axis, second.to(dev)) * wb


def deephi_linear_resize(x, out_h: int, out_w: int):
    """The fork's cv::resize of each transposed plane: the horizontal pass (along H here) first."""
    return cv_linear_axis(cv_linear_axis(x, 2, out_h), 3, out_w)


# model.py gets these very functions
TORCH_CV_LINEAR = torch_sources(cv_linear_taps, cv_linear_axis, deephi_linear_resize)


@register_layer("DeephiResize")
class DeephiResize(Layer):
    def parse(self, lp):
        need_blobs(lp, "DeephiResize", 1, 1)
        p = lp.deephi_resize_param
        if p.HasField("new_height") != p.HasField("new_width"):
            raise LayerError("deephi_resize_param: new_height and new_width should be set at the same time")
        if p.HasField("scale_h") != p.HasField("scale_w"):
            raise LayerError("deephi_resize_param: scale_h and scale_w should be set at the same time")
        if p.HasField("new_height"):
            size = (int(p.new_height), int(p.new_width))
            scale = None
        else:
            size = None
            scale = (float(p.scale_h), float(p.scale_w))
        return {"size": size, "scale": scale, "nearest": p.resize_type == _NEAREST}

    @staticmethod
    def out_hw(attrs, h, w):
        if attrs["size"] is not None:
            return attrs["size"]
        sh, sw = attrs["scale"]
        # the fork's int height_ times its float scale, stored in an int
        return int(np.float32(h) * np.float32(sh)), int(np.float32(w) * np.float32(sw))

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"DeephiResize resizes (N, C, H, W) blobs, got {list(s)}")
        ho, wo = self.out_hw(attrs, s[2], s[3])
        if ho < 1 or wo < 1:
            raise LayerError(f"deephi_resize_param gives a {ho}x{wo} top for a {s[2]}x{s[3]} bottom")
        return [(s[0], s[1], ho, wo)]

    def forward(self, attrs, params, x):
        ho, wo = self.out_hw(attrs, x.shape[2], x.shape[3])
        if attrs["nearest"]:
            return cv_nearest_resize(x, ho, wo)
        return deephi_linear_resize(x, ho, wo)

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        _n, _c, h, w = ctx.shape(x)
        ho, wo = self.out_hw(node.attrs, h, w)
        if node.attrs["nearest"]:
            onnx_cv_nearest(ctx, node, x, h, w, ho, wo)
            return
        along_h = _onnx_linear_axis(ctx, x, 2, h, ho, ctx.tmp(f"{name}_rows"), name)
        _onnx_linear_axis(ctx, along_h, 3, w, wo, node.outputs[0], name)

    def pytorch_source(self, node, emit):
        ho, wo = self.out_hw(node.attrs, *emit.in_shape(0)[2:])
        if node.attrs["nearest"]:
            return f"{emit.helper(TORCH_CV_NEAREST)}({emit.inputs[0]}, {ho}, {wo})"
        return f"{emit.helper(TORCH_CV_LINEAR)}({emit.inputs[0]}, {ho}, {wo})"


def _onnx_linear_axis(ctx, x, axis, n_in, n_out, out, name):
    """Gather both taps along `axis` and mix them with OpenCV's weights; returns the output name."""
    first, second, w0, w1 = (t.numpy() for t in cv_linear_taps(n_in, n_out))
    shape = [1, 1, 1, 1]
    shape[axis] = n_out
    a = ctx.add_node("Gather", [x, ctx.const(np.array(first, np.int64))], [ctx.tmp(f"{name}_a{axis}")],
                     axis=axis)[0]
    b = ctx.add_node("Gather", [x, ctx.const(np.array(second, np.int64))], [ctx.tmp(f"{name}_b{axis}")],
                     axis=axis)[0]
    wa = ctx.add_node("Mul", [a, ctx.const(np.array(w0, np.float32).reshape(shape))], [ctx.tmp(f"{name}_wa{axis}")])[0]
    wb = ctx.add_node("Mul", [b, ctx.const(np.array(w1, np.float32).reshape(shape))], [ctx.tmp(f"{name}_wb{axis}")])[0]
    return ctx.add_node("Add", [wa, wb], [out])[0]
