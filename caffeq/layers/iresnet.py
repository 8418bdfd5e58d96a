"""leonzfa/iResNet's layers (Liang et al., "Learning for Disparity Estimation through Feature
Constancy", CVPR 2018; the fork at 4e5b0b7), as its GPU code computes them.

- NegReLU (neg_relu_layer.cpp/.cu): y = min(x, 0) + negative_slope * max(x, 0), the slope read from
  relu_param; ALISCIFP's MinReLU with its slope in another field.
- RandomCrop (random_crop_layer.cu; random_crop_param target_height [128] / target_width [320]):
  a (N, 7, H, W) bottom (the fork checks the 7 channels: two images and the disparity) cut to
  (N, 7, target_height, target_width) at offsets (W - target_width) / 2 and (H - target_height) / 2,
  C++ integer division (towards zero); target pixels outside the bottom are 128, or NaN in the last
  channel (the disparity).  That is the fork's TEST forward; at TRAIN it draws the offsets at random
  (here the TEST ones: a crop for data augmentation), and its CPU forward writes nothing.
"""
import numpy as np
import torch
import torch.nn.functional as F

from .act_forks import MinReLU
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources

RANDOM_CROP_CHANNELS = 7      # random_crop_layer.cpp LayerSetUp: CHECK(bottom[0]->channels() == 7)
OUTSIDE_VALUE = 128.0         # the kernel's pad_value; the last channel gets a NaN instead


@register_layer("NegReLU")
class NegReLU(MinReLU):
    def parse(self, lp):
        need_blobs(lp, "NegReLU", 1, 1)
        return {"positive_slope": float(lp.relu_param.negative_slope)}


def _towards_zero_half(d):
    """C++'s int(d / 2) for an int d."""
    return -((-d) // 2) if d < 0 else d // 2


def crop_window(bottom_hw, target_hw):
    """(pads top, left, bottom, right; the window's start row and column in the padded image)."""
    (bh, bw), (th, tw) = bottom_hw, target_hw
    oh, ow = _towards_zero_half(bh - th), _towards_zero_half(bw - tw)
    top, left = max(0, -oh), max(0, -ow)
    bottom, right = max(0, oh + th - bh), max(0, ow + tw - bw)
    return (top, left, bottom, right), (oh + top, ow + left)


def center_crop_filled(x, th: int, tw: int, top: int, left: int, bottom: int, right: int, row: int, col: int):
    """iResNet's RandomCrop at TEST: pad with 128 (NaN in the last channel), then cut the window."""
    pads = (left, right, top, bottom)
    images = F.pad(x[:, :-1], pads, value=128.0)
    disparity = F.pad(x[:, -1:], pads, value=float("nan"))
    return torch.cat([images, disparity], dim=1)[:, :, row:row + th, col:col + tw]


@register_layer("RandomCrop")
class RandomCrop(Layer):
    def parse(self, lp):
        need_blobs(lp, "RandomCrop", 1, 1)
        p = lp.random_crop_param
        th, tw = int(p.target_height), int(p.target_width)
        if th < 1 or tw < 1:
            raise LayerError(f"random_crop_param: target_height and target_width must be positive, got {th}x{tw}")
        return {"target": (th, tw)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4 or s[1] != RANDOM_CROP_CHANNELS:
            raise LayerError(f"RandomCrop takes (N, {RANDOM_CROP_CHANNELS}, H, W) (the fork checks its 7 channels: "
                             f"two images and the disparity), got {list(s)}")
        return [(s[0], s[1]) + attrs["target"]]

    @staticmethod
    def _args(attrs, shape):
        pads, (row, col) = crop_window(tuple(shape[2:]), attrs["target"])
        return (*attrs["target"], *pads, row, col)

    def forward(self, attrs, params, x):
        return center_crop_filled(x, *self._args(attrs, x.shape))

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        shape = ctx.shape(x)
        th, tw, top, left, bottom, right, row, col = self._args(node.attrs, shape)
        pads = ctx.const(np.array([0, 0, top, left, 0, 0, bottom, right], np.int64))

        def part(start, end, value, tag):
            piece = ctx.add_node("Slice", [x, ctx.const(np.array([start], np.int64)),
                                           ctx.const(np.array([end], np.int64)), ctx.const(np.array([1], np.int64))],
                                 ctx.tmp(f"{name}_{tag}"))
            return ctx.add_node("Pad", [piece, pads, ctx.const(np.array(value, np.float32))],
                                ctx.tmp(f"{name}_{tag}_padded"), mode="constant")
        c = shape[1]
        whole = ctx.add_node("Concat", [part(0, c - 1, OUTSIDE_VALUE, "images"), part(c - 1, c, np.nan, "disparity")],
                             ctx.tmp(name + "_padded"), axis=1)
        ctx.add_node("Slice", [whole, ctx.const(np.array([row, col], np.int64)),
                               ctx.const(np.array([row + th, col + tw], np.int64)),
                               ctx.const(np.array([2, 3], np.int64))], [node.outputs[0]], name=name)

    def pytorch_source(self, node, emit):
        args = ", ".join(str(a) for a in self._args(node.attrs, emit.in_shape(0)))
        return f"{emit.helper(torch_sources(center_crop_filled))}({emit.inputs[0]}, {args})"
