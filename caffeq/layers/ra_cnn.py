"""RA-CNN's AttentionCrop (ouceduxzk/Fine_Grained_Classification e19d04f, RA-CNN/caffe_racnn:
include/caffe/layers/attention_crop_layer.hpp, src/caffe/layers/attention_crop_layer.cpp and .cu; no field in
its caffe.proto, no blobs).

Bottoms: data (N, 3, S, S), mean-subtracted BGR, and a box (N, 3) = (a, b, c): the square's centre column a,
centre row b and half side c, in pixels.  Top: (N, 3, 224, 224).  The CPU and GPU forwards are the same code
(the GPU one runs the CPU loop and copies the result up), the same in TRAIN and TEST; per sample:

- the image goes back to 8 bits: pixel = (unsigned char)(x + mean[k]) with the header's float means
  (109.961, 127.21, 123.645); the float -> unsigned char conversion is out of range below 0 or from 256 on,
  and caffeq takes what gcc on x86-64 does there (truncation to an int, then its low 8 bits);
- c = max(c, 0.01 S) (compared in double); the window is columns int(max(a - c, 0)) .. int(min(a + c, S))
  and rows int(max(b - c, 0)) .. int(min(b + c, S)) (ends exclusive, float32 sums, int() truncating), as
  the cv::Rect it cuts;
- cv::resize(..., INTER_LINEAR) to 224 x 224 on the 8-bit image: OpenCV's own fixed-point bilinear path for
  8-bit images (resizeGeneric_ with HResizeLinear and the VResizeLinear<uchar, int, short> specialization,
  OpenCV 2.4 to 4.x without IPP): per output column fx = float((dx + 0.5) * (1 / (224 / w)) - 0.5), sx its
  floor, weights round(2048 (1 - fx')) and round(2048 fx') of the fraction fx' (0 and sx clamped to the
  first or last column at the edges); rows alike with the source rows clamped but not the weights; each row
  h = s0 a0 + s1 a1, then out = (((b0 (h0 >> 4)) >> 16) + ((b1 (h1 >> 4)) >> 16) + 2) >> 2;
- top = float(out) - mean[k].

S must equal the width (the fork's buffers are S x S and it steps through rows by S) and the data must
have 3 channels.  A window with no column or no row fails OpenCV's assertions in the fork: caffeq raises
there.  The fork's backward (a sigmoid-boxcar surrogate for the box gradient) is not needed here.
"""
import math

import torch

from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources

OUT_SIZE = 224
MEANS = (109.961, 127.21, 123.645)     # the header's Dtype means (float32 in a float net)


def racnn_attention_crop(x, box, out_size: int = 224, means=(109.961, 127.21, 123.645)):
    """RA-CNN's AttentionCrop forward: crop each sample's square box from the 8-bit image and resize it
    to out_size x out_size with OpenCV's fixed-point INTER_LINEAR (see caffeq/layers/ra_cnn.py)."""
    n, _, size, _ = x.shape
    mean = torch.tensor(means, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    wide = torch.trunc(x + mean).to(torch.int64)
    pix = torch.remainder(wide, 256)                                    # (unsigned char) as gcc x86-64
    box = box.reshape(n, -1)[:, :3].to(torch.float32)
    a, b, c = box[:, 0], box[:, 1], box[:, 2]
    floor_c = 0.01 * size
    c = torch.where(c.to(torch.float64) > floor_c, c, torch.full_like(c, floor_c))
    zero = torch.zeros_like(a)
    edge = torch.full_like(a, float(size))
    w_off = torch.where(a - c > 0, a - c, zero).trunc().to(torch.int64)
    h_off = torch.where(b - c > 0, b - c, zero).trunc().to(torch.int64)
    w_end = torch.where(a + c < size, a + c, edge).trunc().to(torch.int64)
    h_end = torch.where(b + c < size, b + c, edge).trunc().to(torch.int64)
    wc, hc = w_end - w_off, h_end - h_off
    if bool((wc < 1).any()) or bool((hc < 1).any()):
        raise ValueError("AttentionCrop: a box leaves no pixel of the image (OpenCV's resize asserts in the fork)")
    steps = torch.arange(out_size, dtype=torch.float64, device=x.device).view(1, -1) + 0.5

    def axis_table(extent):
        scale = 1.0 / (float(out_size) / extent.to(torch.float64).view(-1, 1))
        f = (steps * scale - 0.5).to(torch.float32)
        s = torch.floor(f)
        f = f - s
        return s.to(torch.int64), f

    sx, fx = axis_table(wc)
    last_x = (wc - 1).view(-1, 1)
    fx = torch.where((sx < 0) | (sx >= last_x), torch.zeros_like(fx), fx)
    sx = torch.minimum(torch.clamp(sx, min=0), last_x)
    a0 = torch.round((1.0 - fx) * 2048.0).to(torch.int64)
    a1 = torch.round(fx * 2048.0).to(torch.int64)
    col0 = w_off.view(-1, 1) + sx
    col1 = w_off.view(-1, 1) + torch.minimum(sx + 1, last_x)
    sy, fy = axis_table(hc)
    last_y = (hc - 1).view(-1, 1)
    b0 = torch.round((1.0 - fy) * 2048.0).to(torch.int64).view(n, 1, out_size, 1)
    b1 = torch.round(fy * 2048.0).to(torch.int64).view(n, 1, out_size, 1)
    row0 = h_off.view(-1, 1) + torch.clamp(torch.minimum(sy, last_y), min=0)
    row1 = h_off.view(-1, 1) + torch.clamp(torch.minimum(sy + 1, last_y), min=0)

    def horizontal(rows):
        picked = torch.gather(pix, 2, rows.view(n, 1, out_size, 1).expand(n, 3, out_size, size))
        left = torch.gather(picked, 3, col0.view(n, 1, 1, out_size).expand(n, 3, out_size, out_size))
        right = torch.gather(picked, 3, col1.view(n, 1, 1, out_size).expand(n, 3, out_size, out_size))
        return left * a0.view(n, 1, 1, out_size) + right * a1.view(n, 1, 1, out_size)

    h0, h1 = horizontal(row0), horizontal(row1)
    out = (((b0 * (h0 >> 4)) >> 16) + ((b1 * (h1 >> 4)) >> 16) + 2) >> 2
    return out.to(torch.float32) - mean


@register_layer("AttentionCrop")
class AttentionCrop(Layer):
    onnx_refusal = ("AttentionCrop cuts a box its bottom computes and resizes it with OpenCV's fixed-point "
                    "8-bit bilinear arithmetic; caffeq emits no ONNX form of it")

    def parse(self, lp):
        need_blobs(lp, "AttentionCrop", 2, 1, "data, box", in_place=False)
        return {}

    def infer(self, attrs, in_shapes):
        x, box = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) != 4 or x[1] != 3 or x[2] != x[3]:
            raise LayerError(f"AttentionCrop needs a square 3-channel image (N, 3, S, S) (the fork's 8-bit "
                             f"BGR buffer is S x S), got {list(x)}")
        if not box or box[0] != x[0] or math.prod(box[1:]) != 3:
            raise LayerError(f"AttentionCrop's box bottom must be (N, 3) = (centre column, centre row, half side) "
                             f"for the data's N = {x[0]}, got {list(box)}")
        return [(x[0], 3, OUT_SIZE, OUT_SIZE)]

    def forward(self, attrs, params, x, box):
        return racnn_attention_crop(x, box, OUT_SIZE, MEANS)

    def pytorch_source(self, node, emit):
        emit.helper(torch_sources(racnn_attention_crop))
        return f"racnn_attention_crop({emit.inputs[0]}, {emit.inputs[1]}, {OUT_SIZE}, {MEANS!r})"
