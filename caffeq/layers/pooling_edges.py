"""synopsys-caffe's Pooling geometry (foss-for-synopsys-dwc-arc-processors/synopsys-caffe 977ba36a,
pooling_layer.cpp Reshape and Forward_cpu):

- pad_l / pad_r / pad_t / pad_b: the output is BVLC's formula with pad_t + pad_b (pad_l + pad_r) in
  place of 2 * pad, ceil or floor by round_mode; then a last window starting at or beyond H + pad_t
  (W + pad_l) is dropped, on both axes once any side is nonzero.
- pad_type 1 (TensorFlow "SAME"): output ceil(H / stride); the padding along an axis is
  max(kernel - (stride if H % stride == 0 else H % stride), 0), half (rounded down) before.
- Window o starts at o * stride - before.  MAX reads the in-image part from -FLT_MAX with a strict `>`
  (Forward_cpu's caffe_set(-FLT_MAX) and pooling_layer.cu's maxval, as BVLC): a window with no cell, or
  with only -inf cells, keeps -FLT_MAX (the ONNX export adds a Max after its MaxPool for that); AVE divides
  the sum by the window clipped at H + after (padding counts); AVE_EXC_PAD (alias AVE_TF) divides by the
  in-image part only.  The fork has no STOCHASTIC here.

The torch functions and module below are copied into the standalone model.py too.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .pooling_nd import caffe_max_input
from .registry import torch_sources


def synopsys_pool_geometry(size: list[int], kernel: list[int], stride: list[int], edges: list[int],
                           same: bool, ceil: bool):
    """([out_h, out_w], [top, bottom, left, right]) for an input of `size` (h, w); `edges` are the
    fork's pad_t, pad_b, pad_l, pad_r (ignored when `same`)."""
    out = [0, 0]
    pads = [0, 0, 0, 0]
    for i in range(2):
        if same:
            out[i] = -(-size[i] // stride[i])
            rest = size[i] % stride[i]
            along = max(kernel[i] - (stride[i] if rest == 0 else rest), 0)
            pads[2 * i], pads[2 * i + 1] = along // 2, along - along // 2
        else:
            before, after = edges[2 * i], edges[2 * i + 1]
            span = size[i] + before + after - kernel[i]
            out[i] = -(-span // stride[i]) + 1 if ceil else span // stride[i] + 1
            any_pad = edges[0] != 0 or edges[1] != 0 or edges[2] != 0 or edges[3] != 0
            if any_pad and (out[i] - 1) * stride[i] >= size[i] + before:
                out[i] -= 1
            pads[2 * i], pads[2 * i + 1] = before, after
    return out, pads


def synopsys_pool_divisors(size: int, kernel: int, stride: int, before: int, after: int, out: int,
                           exclude_pad: bool):
    """The fork's AVE divisor per output along one axis: the window clipped at size + after, or
    (exclude_pad) its in-image part."""
    divisors: list[int] = []
    for o in range(out):
        start = o * stride - before
        end = min(start + kernel, size + after)
        if exclude_pad:
            end = min(end, size)
            start = max(start, 0)
        divisors.append(end - start)
    return divisors


def synopsys_pool2d(x, mode: str, kernel: list[int], stride: list[int], edges: list[int], same: bool,
                    ceil: bool):
    """synopsys-caffe's 2-D Pooling; mode "max", "ave" or "ave_exc_pad" (see synopsys_pool_geometry)."""
    size = [x.shape[2], x.shape[3]]
    out, pads = synopsys_pool_geometry(size, kernel, stride, edges, same, ceil)
    # pad the end so that the last window fits (a negative pad crops what no window reads)
    ends = [(out[i] - 1) * stride[i] + kernel[i] - size[i] - pads[2 * i] for i in range(2)]
    fpad = [pads[2], ends[1], pads[0], ends[0]]
    if mode == "max":
        y = F.max_pool2d(F.pad(caffe_max_input(x), fpad, value=float("-inf")), kernel, stride)
        # an all-padding window keeps the fork's initial -FLT_MAX (fp16: its lowest value)
        floor = -65504.0 if x.dtype == torch.float16 else -3.4028234663852886e38
        return y.clamp_min(floor)
    y = F.avg_pool2d(F.pad(x, fpad), kernel, stride, divisor_override=1)
    exclude = mode == "ave_exc_pad"
    dh = synopsys_pool_divisors(size[0], kernel[0], stride[0], pads[0], pads[1], out[0], exclude)
    dw = synopsys_pool_divisors(size[1], kernel[1], stride[1], pads[2], pads[3], out[1], exclude)
    area = torch.tensor(dh, dtype=x.dtype, device=x.device)[:, None] * \
        torch.tensor(dw, dtype=x.dtype, device=x.device)[None, :]
    return y / area


class SynopsysPool2d(nn.Module):
    """synopsys-caffe's Pooling with per-side or SAME padding, or AVE_EXC_PAD (see synopsys_pool2d)."""

    def __init__(self, mode: str, kernel: list[int], stride: list[int], edges: list[int], same: bool,
                 ceil: bool = True):
        super().__init__()
        self.mode, self.kernel, self.stride, self.edges, self.same, self.ceil = \
            mode, kernel, stride, edges, same, ceil

    def forward(self, x):
        return synopsys_pool2d(x, self.mode, self.kernel, self.stride, self.edges, self.same, self.ceil)

    def extra_repr(self):
        return (f"{self.mode}, kernel={self.kernel}, stride={self.stride}, edges={self.edges}, "
                f"same={self.same}, ceil={self.ceil}")


TORCH_SYNOPSYS_POOL_FUNCTIONS = torch_sources(synopsys_pool_geometry, synopsys_pool_divisors, caffe_max_input,
                                              synopsys_pool2d)
TORCH_SYNOPSYS_POOL_MODULE = torch_sources(SynopsysPool2d)
