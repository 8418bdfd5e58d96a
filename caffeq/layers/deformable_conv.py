"""DeformableConvolution: Deformable ConvNets v1 as the Caffe ports in yyangmei/SAR_plane (cbb626f,
caffe/src/caffe/layers/deformable_conv_layer.{cpp,cu}, caffe/src/caffe/util/deformable_im2col.cu) and
xraydetec/Xdet (1119bbe, caffe-fpn/, the same kernel) implement it.  Bottoms: the data (N, C, H, W) and
the offsets; one top (N, num_output, Ho, Wo), Ho and Wo as Convolution's.

The fork's deformable_im2col_gpu_kernel, for output pixel (ho, wo), input channel c and tap (i, j):
- the channel's deformable group is g = c // (C // deformable_group);
- the offsets of one image are read as (deformable_group, kh * kw, 2, Ho, Wo) from the start of that
  image's offset blob: channel 2 (i kw + j) of the group is dy, the next one dx.  The fork checks that
  the blob is (N, 2 kh kw deformable_group, H, W), the data's height and width, not Ho x Wo: where those
  differ (a stride, a pad other than (k - 1) d / 2) the kernel reads the first Ho x Wo values of each
  channel plane and the following ones, as caffeq does too;
- the tap reads (y, x) = (ho * stride_h - pad_h + i * dilation_h + dy, wo * stride_w - pad_w +
  j * dilation_w + dx): 0 unless 0 <= y < H and 0 <= x < W; inside, y and x are clamped to H - 1 and
  W - 1 and the four neighbours are mixed bilinearly (floor(y), the next row clamped to H - 1).  Unlike
  zero-padded bilinear sampling (torchvision, ONNX), a tap in (-1, 0) reads 0 and one in (H - 1, H)
  reads row H - 1 whole;
- the columns (C kh kw, Ho Wo) then go through Caffe's grouped GEMM with the weights
  (num_output, C / group, kh, kw), plus the bias (num_output) when bias_term (default true).

deformable_group defaults to 4.  The fork never checks that it divides C (its kernel then reads offsets
of groups that do not exist): caffeq refuses it, and group checks as Convolution's.  Only 4-D data with
axis 1 runs (the kernel reads shape(1..3)); engine and force_nd_im2col change nothing (Xdet's layer
factory refuses engine CUDNN, SAR_plane's registration ignores it).  The offsets must have the data's
batch; the fork does not check it.  Both forks have an empty Forward_cpu: this is the GPU forward.

ModulatedDeformableConvolution (zhanglonghao1992/Deformable-ConvNets-v1-v2-caffe d90842e,
modulated_deformable_im2col.cu; modulated_deformable_convolution_param, deformable_group default 1):
Deformable ConvNets v2, a third bottom the modulation mask (N, kh kw deformable_group, H, W), read like
the offsets (planes of Ho x Wo from each image's start).  Its sampling is DCNv2's: a tap reads 0 unless
-1 < y < H and -1 < x < W, and each of the four bilinear neighbours counts only where it lies inside
the image (zero padding); the value is multiplied by the mask.  ONNX: DeformConv with the mask, from
opset 19 (refused below).

ONNX: from opset 19 one DeformConv (its offset layout is the fork's), with its mask input zeroing the
taps the fork leaves at 0 and the offsets moved so that taps in (H - 1, H) sample row H - 1; below 19
the same sampling written out with GatherElements (deformable_conv_onnx.py).
"""
import math

import torch
import torch.nn as nn

from ..errors import ExportError
from .conv import check_groups, conv_out_size
from .deformable_conv_onnx import onnx_deformable_conv
from .registry import Layer, LayerError, count, four_axes, need_blobs, positive_field, register_layer, spatial_params


def deformable_taps(kernel: list[int], stride: list[int], pad: list[int], dilation: list[int], ho: int, wo: int,
                    device: torch.device, dtype: torch.dtype):
    """The undeformed sampling rows and columns, each (kh * kw, Ho * Wo): tap (i, j) of output pixel
    (ho, wo) reads row ho * stride_h - pad_h + i * dilation_h, column wo * stride_w - pad_w + j * dilation_w."""
    kh, kw = kernel
    tap_row = (torch.arange(kh, device=device) * dilation[0]).repeat_interleave(kw)
    tap_col = (torch.arange(kw, device=device) * dilation[1]).repeat(kh)
    out_row = (torch.arange(ho, device=device) * stride[0] - pad[0]).repeat_interleave(wo)
    out_col = (torch.arange(wo, device=device) * stride[1] - pad[1]).repeat(ho)
    return ((tap_row[:, None] + out_row[None, :]).to(dtype),
            (tap_col[:, None] + out_col[None, :]).to(dtype))


def deformable_columns(x, offset, kernel: list[int], stride: list[int], pad: list[int], dilation: list[int],
                       deformable_group: int):
    """The fork's deformable_im2col for a batch: (N, C * kh * kw, Ho * Wo), rows ordered (c, i, j)."""
    n, c, h, w = x.shape
    kh, kw = kernel
    ho = (h + 2 * pad[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
    wo = (w + 2 * pad[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
    dg, taps, size = deformable_group, kh * kw, ho * wo
    # each image's offsets from the start of its blob, as (group, tap, dy/dx, Ho * Wo)
    off = offset.reshape(n, -1)[:, :dg * taps * 2 * size].reshape(n, dg, taps, 2, size)
    rows, cols = deformable_taps(kernel, stride, pad, dilation, ho, wo, x.device, x.dtype)
    y = rows + off[:, :, :, 0]
    x_ = cols + off[:, :, :, 1]
    inside = (y >= 0) & (y < h) & (x_ >= 0) & (x_ < w)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    y = torch.where(inside, y.clamp(max=h - 1), zero)
    x_ = torch.where(inside, x_.clamp(max=w - 1), zero)
    y0, x0 = y.floor(), x_.floor()
    ly, lx = y - y0, x_ - x0
    hy, hx = 1 - ly, 1 - lx
    y1, x1 = (y0 + 1).clamp(max=h - 1), (x0 + 1).clamp(max=w - 1)
    keep = inside.to(x.dtype)
    image = x.reshape(n, dg, c // dg, h * w)
    val = deformable_corner(image, y0, x0, hy * hx * keep, w) + deformable_corner(image, y0, x1, hy * lx * keep, w) \
        + deformable_corner(image, y1, x0, ly * hx * keep, w) + deformable_corner(image, y1, x1, ly * lx * keep, w)
    return val.reshape(n, c * taps, size), ho, wo


def modulated_columns(x, offset, mask, kernel: list[int], stride: list[int], pad: list[int], dilation: list[int],
                      deformable_group: int):
    """DCNv2's modulated_deformable_im2col for a batch: (N, C * kh * kw, Ho * Wo), rows ordered (c, i, j)."""
    n, c, h, w = x.shape
    kh, kw = kernel
    ho = (h + 2 * pad[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
    wo = (w + 2 * pad[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
    dg, taps, size = deformable_group, kh * kw, ho * wo
    off = offset.reshape(n, -1)[:, :dg * taps * 2 * size].reshape(n, dg, taps, 2, size)
    gain = mask.reshape(n, -1)[:, :dg * taps * size].reshape(n, dg, taps, size)
    rows, cols = deformable_taps(kernel, stride, pad, dilation, ho, wo, x.device, x.dtype)
    y = rows + off[:, :, :, 0]
    x_ = cols + off[:, :, :, 1]
    inside = (y > -1) & (y < h) & (x_ > -1) & (x_ < w)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    y = torch.where(inside, y, zero)
    x_ = torch.where(inside, x_, zero)
    y0, x0 = y.floor(), x_.floor()
    ly, lx = y - y0, x_ - x0
    hy, hx = 1 - ly, 1 - lx
    y1, x1 = y0 + 1, x0 + 1
    keep = inside.to(x.dtype) * gain
    image = x.reshape(n, dg, c // dg, h * w)
    val = zero
    for row, col, wt in ((y0, x0, hy * hx), (y0, x1, hy * lx), (y1, x0, ly * hx), (y1, x1, ly * lx)):
        there = ((row >= 0) & (row <= h - 1) & (col >= 0) & (col <= w - 1)).to(x.dtype)
        val = val + deformable_corner(image, row.clamp(0, h - 1), col.clamp(0, w - 1), wt * there * keep, w)
    return val.reshape(n, c * taps, size), ho, wo


def deformable_corner(image, row, col, weight, width: int):
    """weight x image at (row, col): image (N, G, C / G, H * W), the rest (N, G, taps, Ho * Wo)."""
    n, g, cg, _ = image.shape
    at = (row.long() * width + col.long()).reshape(n, g, 1, -1)
    return torch.gather(image, 3, at.expand(n, g, cg, at.shape[3])) * weight.reshape(n, g, 1, -1)


def deformable_conv2d(x, offset, weight, bias: torch.Tensor | None, stride: list[int], pad: list[int],
                      dilation: list[int], group: int, deformable_group: int, mask: torch.Tensor | None = None):
    """The fork's forward: deformable columns (modulated by `mask`: DCNv2's), Caffe's grouped GEMM with the
    weights, then the bias."""
    n = x.shape[0]
    cout, cin, kh, kw = weight.shape
    if mask is None:
        columns, ho, wo = deformable_columns(x, offset, [kh, kw], stride, pad, dilation, deformable_group)
    else:
        columns, ho, wo = modulated_columns(x, offset, mask, [kh, kw], stride, pad, dilation, deformable_group)
    columns = columns.reshape(n, group, cin * kh * kw, ho * wo)
    y = torch.matmul(weight.reshape(group, cout // group, cin * kh * kw), columns).reshape(n, cout, ho, wo)
    return y if bias is None else y + bias.reshape(1, cout, 1, 1)


class DeformableConv2d(nn.Module):
    """DeformableConvolution with its weights (num_output, C / group, kh, kw) and bias (num_output)."""

    def __init__(self, in_channels, out_channels, kernel, stride, pad, dilation, group, deformable_group,
                 bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_channels, in_channels // group, *kernel))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.stride, self.pad, self.dilation = list(stride), list(pad), list(dilation)
        self.group, self.deformable_group = group, deformable_group

    def forward(self, x, offset, mask: torch.Tensor | None = None):
        return deformable_conv2d(x, offset, self.weight, self.bias, self.stride, self.pad, self.dilation,
                                 self.group, self.deformable_group, mask)


_NEEDS = [deformable_taps, deformable_corner, deformable_columns, modulated_columns, deformable_conv2d]


def deformable_out_hw(attrs, in_shape):
    """(H_out, W_out) of a deformable convolution's window on an (N, C, H, W) input, Caffe's convolution
    arithmetic; an empty output is a one-line error."""
    out = tuple(conv_out_size(s, k, st, p, d) for s, k, st, p, d in
                zip(in_shape[2:4], attrs["kernel"], attrs["stride"], attrs["pad"], attrs["dilation"]))
    if min(out) <= 0:
        raise LayerError(f"output would be empty: input {list(in_shape)}, kernel {list(attrs['kernel'])}")
    return out


@register_layer("DeformableConvolution")
class DeformableConvolution(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: 0}

    field = "deformable_convolution_param"
    roles = "data, offsets"

    def parse(self, lp):
        need_blobs(lp, self.types[0], len(self.roles.split(", ")), 1, self.roles, in_place=False)
        p, f = getattr(lp, self.field), self.field
        if not p.HasField("num_output"):
            raise LayerError(f"{f}.num_output is required")
        if not (len(p.kernel_size) or p.HasField("kernel_h") or p.HasField("kernel_w")):
            raise LayerError(f"{f}.kernel_size is required")
        return {
            "name": lp.name,
            "num_output": positive_field(p.num_output, f"{f}.num_output"),
            "bias_term": bool(p.bias_term),
            "group": positive_field(p.group, f"{f}.group"),
            "deformable_group": self.deformable_group_of(p, f),
            "axis": int(p.axis),
            # the forks read these as BaseConvolutionLayer does, for two spatial axes
            "kernel": spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False),
            "stride": spatial_params(p, 2, "stride", 1, min_value=1, pair_required=False),
            "pad": spatial_params(p, 2, "pad", 0, min_value=0, pair_required=False),
            "dilation": spatial_params(p, 2, "dilation", 1, allow_hw=False, min_value=1),
        }

    def deformable_group_of(self, p, f):
        """The deformable group a fork reads from its parameter message (None: decided by the offsets)."""
        return positive_field(p.deformable_group, f"{f}.deformable_group")

    def _check(self, attrs, in_shapes):
        """The forks' LayerSetUp checks (and caffeq's where the kernel would read outside the blobs) ->
        (N, C, H, W), (Ho, Wo)."""
        what = self.types[0]
        n, c, h, w = four_axes(in_shapes[0], what, "data bottom")
        if attrs["axis"] not in (1, -3):
            raise LayerError(f"{self.field}.axis must be 1: the forks' kernel reads (N, C, H, W), got {attrs['axis']}")
        check_groups(attrs, c)
        dg = attrs["deformable_group"]
        if c % dg:
            raise LayerError(f"input channels {c} not divisible by deformable_group {dg}: the forks' kernel gives "
                             f"each deformable group C / deformable_group channels")
        kh, kw = attrs["kernel"]
        for i, (role, per_tap) in enumerate((("offsets", 2), ("mask", 1))[:len(in_shapes) - 1], start=1):
            bn, bc, bh, bw = four_axes(in_shapes[i], what, f"{role} bottom")
            if bc != per_tap * kh * kw * dg:
                factors = ("2 x " if per_tap == 2 else "", f"{'2 x ' if per_tap == 2 else ''}{kh} x {kw} x {dg}")
                raise LayerError(f"{role} (bottom {i}) need {factors[0]}kernel_h x kernel_w x deformable_group = "
                                 f"{factors[1]} = {per_tap * kh * kw * dg} channels, got {bc}")
            if (bh, bw) != (h, w):
                raise LayerError(f"{role} (bottom {i}) must have the data's height and width {h} x {w}, as the "
                                 f"forks check, got {bh} x {bw}")
            if bn != n:
                raise LayerError(f"{role} (bottom {i}) must have the data's batch {n}, got {bn}")
        return (n, c, h, w), deformable_out_hw(attrs, in_shapes[0])

    def infer(self, attrs, in_shapes):
        (n, _, h, w), (ho, wo) = self._check(attrs, in_shapes)
        if (ho, wo) != (h, w) and ho * wo <= h * w:
            planes = 2 * math.prod(attrs["kernel"]) * attrs["deformable_group"]
            attrs["reading_notes"] = [
                f"the output is {ho} x {wo} and the offsets {h} x {w}: as the fork's kernel, each image reads the "
                f"first {planes} x {ho} x {wo} values of its offsets, as {planes} planes of {ho} x {wo}"]
        return [(n, attrs["num_output"], ho, wo)]

    def cannot_run(self, attrs, in_shapes):
        (_, _, h, w), (ho, wo) = self._check(attrs, in_shapes)
        if ho * wo > h * w:
            return (f"the output ({ho} x {wo}) has more pixels than the offsets ({h} x {w}): the fork's kernel "
                    f"would read past each image's offsets")
        return None

    def param_shapes(self, attrs, in_shapes):
        c = four_axes(in_shapes[0], "DeformableConvolution", "data bottom")[1]
        shapes = [(attrs["num_output"], c // attrs["group"]) + tuple(attrs["kernel"])]
        if attrs["bias_term"]:
            shapes.append((attrs["num_output"],))
        return shapes

    def macs(self, attrs, in_shapes, out_shapes):
        n, c = in_shapes[0][:2]
        taps = math.prod(attrs["kernel"])
        pixels = count(out_shapes[0], 2)
        return count(out_shapes[0]) * taps * c // attrs["group"] + 4 * n * c * taps * pixels

    def forward(self, attrs, params, x, offset, mask=None):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(t.shape) for t in (x, offset)], LayerError)
        bias = params[1] if attrs["bias_term"] else None
        return deformable_conv2d(x, offset, params[0], bias, list(attrs["stride"]), list(attrs["pad"]),
                                 list(attrs["dilation"]), attrs["group"], attrs["deformable_group"], mask)

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(t) for t in node.inputs[:2]], ExportError)
        onnx_deformable_conv(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(0), emit.in_shape(1)], ExportError)
        m = emit.instance(DeformableConv2d, emit.in_shape(0)[1], a["num_output"], list(a["kernel"]),
                          list(a["stride"]), list(a["pad"]), list(a["dilation"]), a["group"],
                          a["deformable_group"], a["bias_term"], needs=_NEEDS)
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        return f"{m}({', '.join(emit.inputs)})"


@register_layer("ModulatedDeformableConvolution")
class ModulatedDeformableConvolution(DeformableConvolution):
    field = "modulated_deformable_convolution_param"
    roles = "data, offsets, mask"
