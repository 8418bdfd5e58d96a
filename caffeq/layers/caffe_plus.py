"""jnulzl/caffe_plus's Upsample (f408dae upsample_layer.cpp), which ONNX-to-Caffe converters
(Wulingtian/yolov5_onnx2caffe) write for an ONNX Resize, and the Reorg of Wulingtian/yolov5_caffe
(9c13b6d, built on caffe_plus) that the same converter writes for YOLOv5's Focus.  An Upsample whose upsample_param sets one
of this fork's fields (height, width, height_scale, width_scale, mode) is read as this one; SegNet's
and the YOLO forks' set none of them.

The output size is, first match: bottom 1's height and width (two bottoms); height x width when
both are set (each >= 2); the input's times height_scale x width_scale when both are set (each >= 2).
The fork refuses anything else.  mode (default BILINEAR):
- NEAREST: output (h, w) reads input (h * H / out_h, w * W / out_w), integer division.
- BILINEAR: align-corners source coordinates (H - 1) / (out_h - 1) * h in float32, truncated to the
  upper-left tap, float32 weights: the same arithmetic as DeepLab's Interp (interp.interp_resize).

yolov5_caffe's Reorg (reorg_layer.cu reorg_kernel; reverse is not read by it) is a plain
space-to-depth in channel-major order: top[n, c s^2 + dy s + dx, y, x] = bottom[n, c, y s + dy, x s + dx].
(Its CPU reorg_cpu ignores the batch and reads other rows; caffeq follows the GPU kernel.)  The Reorg
spec (yolo.py) reads a layer this way where darknet's reorg cannot run: channels that do not divide
by stride^2, as the 3 of an image under Focus.
"""
import numpy as np
import torch

from ..io.schema import caffe_pb2
from .interp import TORCH_INTERP, interp_resize
from .registry import Layer, LayerError, claim_layers, count, need_blobs, torch_sources
from .vision_forks import _resize, _sizes_const

_FIELDS = ("height", "width", "height_scale", "width_scale", "mode")
_NEAREST = caffe_pb2.UpsampleParameter.NEAREST


def nearest_rows(n_in: int, n_out: int, device: torch.device):
    """The input row (or column) each output one reads: i * n_in / n_out, integer division."""
    return torch.arange(n_out, device=device) * n_in // n_out


def caffe_plus_nearest(x, out_h: int, out_w: int):
    return x.index_select(2, nearest_rows(x.shape[2], out_h, x.device)) \
        .index_select(3, nearest_rows(x.shape[3], out_w, x.device))


TORCH_NEAREST = torch_sources(nearest_rows, caffe_plus_nearest)


def space_to_depth_crd(x, stride: int):
    """yolov5_caffe's Reorg: channel c * s^2 + dy * s + dx of the top holds (c, y s + dy, x s + dx)."""
    n, c, h, w = x.shape
    s = stride
    y = x.reshape(n, c, h // s, s, w // s, s).permute(0, 1, 3, 5, 2, 4)
    return y.reshape(n, c * s * s, h // s, w // s)


def onnx_space_to_depth_crd(ctx, name, x, out, stride, shape=None):
    """space_to_depth_crd as ONNX ops; `shape` is x's (N, C, H, W) where x is not an IR tensor."""
    n, c, h, w = shape or ctx.shape(x)
    s = stride
    blocks = ctx.add_node("Reshape", [x, ctx.const(np.array([0, c, h // s, s, w // s, s], np.int64))],
                          [ctx.tmp(name + "_blocks")], name=name)[0]
    moved = ctx.add_node("Transpose", [blocks], [ctx.tmp(name + "_moved")], perm=[0, 1, 3, 5, 2, 4])[0]
    ctx.add_node("Reshape", [moved, ctx.const(np.array([0, c * s * s, h // s, w // s], np.int64))], [out])


def _is_caffe_plus(lp):
    return any(lp.upsample_param.HasField(f) for f in _FIELDS)


@claim_layers("Upsample", _is_caffe_plus)
class CaffePlusUpsample(Layer):
    def parse(self, lp):
        need_blobs(lp, "Upsample", (1, 2), roles="data, size reference")
        p = lp.upsample_param
        a = {"nearest": p.mode == _NEAREST, "size": None, "scale": None}
        if len(lp.bottom) == 2:
            return a
        if p.HasField("height") and p.HasField("width"):
            a["size"] = (int(p.height), int(p.width))
            if min(a["size"]) < 2:
                raise LayerError(f"upsample_param.height and width must be >= 2, got {list(a['size'])}")
        elif p.HasField("height_scale") and p.HasField("width_scale"):
            a["scale"] = (int(p.height_scale), int(p.width_scale))
            if min(a["scale"]) < 2:
                raise LayerError(f"upsample_param.height_scale and width_scale must be >= 2, got {list(a['scale'])}")
        else:
            raise LayerError("caffe_plus's Upsample takes two bottoms, or upsample_param height and width, "
                             "or height_scale and width_scale")
        return a

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4 or (len(in_shapes) == 2 and len(in_shapes[1]) != 4):
            raise LayerError(f"Upsample needs 4-axis bottoms, got {[list(x) for x in in_shapes]}")
        if len(in_shapes) == 2:
            out = tuple(in_shapes[1][2:])
        elif attrs["size"] is not None:
            out = attrs["size"]
        else:
            out = (s[2] * attrs["scale"][0], s[3] * attrs["scale"][1])
        attrs["_out"] = [int(d) for d in out]
        return [(s[0], s[1]) + tuple(attrs["_out"])]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * (1 if attrs["nearest"] else 4)

    def forward(self, attrs, params, x, ref=None):
        ho, wo = attrs["_out"]
        if attrs["nearest"]:
            return caffe_plus_nearest(x, ho, wo)
        return interp_resize(x, ho, wo)

    def onnx(self, ctx, node):
        ho, wo = node.attrs["_out"]
        x = node.inputs[0]
        if node.attrs["nearest"]:
            rows = ctx.const(np.arange(ho, dtype=np.int64) * ctx.shape(x)[2] // ho)
            cols = ctx.const(np.arange(wo, dtype=np.int64) * ctx.shape(x)[3] // wo)
            picked = ctx.add_node("Gather", [x, rows], [ctx.tmp(node.name + "_rows")], name=node.name, axis=2)[0]
            ctx.add_node("Gather", [picked, cols], [node.outputs[0]], axis=3)
        else:
            _resize(ctx, x, node.outputs[0], _sizes_const(ctx, x, [ho, wo], node.name), node.name,
                    mode="linear", coordinate_transformation_mode="align_corners")

    def pytorch_source(self, node, emit):
        ho, wo = node.attrs["_out"]
        if node.attrs["nearest"]:
            return f"{emit.helper(TORCH_NEAREST)}({emit.inputs[0]}, {ho}, {wo})"
        emit.helper(TORCH_INTERP)   # defines interp_resize
        return f"interp_resize({emit.inputs[0]}, {ho}, {wo})"
