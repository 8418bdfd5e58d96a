"""lzx1413/caffe DeformConvolution (efbff540: src/caffe/layers/deform_conv_layer.{cpp,cu},
include/caffe/layers/deform_conv_layer.hpp, src/caffe/util/deformable_im2col.cu; convolution_param.deform_group,
19 there, 110019 here, default 1).  Bottoms: data (N, C, H, W) and offsets; one top (N, num_output, Ho, Wo),
Ho and Wo as Convolution's; weights (num_output, C / group, kh, kw) and a bias as Convolution's.

The fork's deformable_im2col_gpu_kernel is MSRA's Deformable ConvNets v1 kernel, the one caffeq's
DeformableConvolution (deformable_conv.py) follows: the offsets of one image read as (deform_group, kh kw,
dy/dx, Ho Wo) from that image's start (image n at n times the offsets' per-image count), the channel's group
c // (C // deform_group), taps 0 outside 0 <= y < H, 0 <= x < W, inside clamped to H - 1 / W - 1 and
bilinear, the columns (C kh kw, Ho Wo) through Caffe's grouped GEMM, then the bias.  Its columns, GEMM, ONNX
and model.py are reused.  Differences from that spec:
- deform_group comes from convolution_param (default 1); the fork does not check the offsets' shape, so caffeq
  reads any offsets and refuses to run only where the kernel would read past an image's offsets (fewer than
  2 kh kw deform_group Ho Wo values per image, or another batch);
- a 1x1 kernel with stride 1 and pad 0 skips the deformable im2col (BaseConvolution's is_1x1_): a plain
  1x1 convolution, the offsets unread.
Forward_cpu is NOT_IMPLEMENTED: this is the GPU forward.  At efbff540 base_conv_layer.cpp lost the wiring of
the previous commits (deform_group_ and offset_dim_ are never set, and BVLC's "All inputs must have the same
shape" CHECK is back, which the fork's own lenet net fails): caffeq reads deform_group and the offsets' count as
56f8acb0 set them, with efbff540's forward (56f8acb0's deformable branch of forward_gpu_gemm fills the columns
but runs no GEMM: its top is only the bias, added again at each forward).
No commit runs the kernel as MSRA wrote it: deformable_im2col indexes its im_shape as (N, C, H, W), and the
fork passes conv_input_shape_, Caffe's (C, H, W): it would take H for the channels, W for the height and read
the width past that 3-int array.  caffeq computes what the kernel intends (C, H, W read right) and says so in a
reading note: these are not numbers the fork's build gives (the 1x1 case, which skips the kernel, is exact).
"""
import dataclasses
import math

from ..errors import ExportError
from .conv import check_groups
from .deformable_conv import _NEEDS, DeformableConv2d, DeformableConvolution, deformable_conv2d, deformable_out_hw
from .deformable_conv_onnx import onnx_deformable_conv
from .registry import LayerError, four_axes, need_blobs, positive_field, register_layer, spatial_params


def lzx_deform_conv(x, offset, weight, bias, stride: list[int], pad: list[int], dilation: list[int], group: int,
                    deform_group: int, plain: bool):
    """The fork's forward; `plain` (1x1, stride 1, pad 0) reads no offsets: zero offsets sample exactly."""
    if plain:
        offset = x.new_zeros(x.shape[0], 2 * deform_group, x.shape[2], x.shape[3])
    return deformable_conv2d(x, offset, weight, bias, stride, pad, dilation, group, deform_group)


@register_layer("DeformConvolution")
class DeformConvolution(DeformableConvolution):
    field = "convolution_param"

    def parse(self, lp):
        # convolution_param has no deformable_group: the fork's deform_group
        need_blobs(lp, "DeformConvolution", 2, 1, "data, offsets", in_place=False)
        p, f = lp.convolution_param, "convolution_param"
        if not p.HasField("num_output"):
            raise LayerError(f"{f}.num_output is required")
        if not (len(p.kernel_size) or p.HasField("kernel_h") or p.HasField("kernel_w")):
            raise LayerError(f"{f}.kernel_size is required")
        a = {
            "name": lp.name,
            "num_output": positive_field(p.num_output, f"{f}.num_output"),
            "bias_term": bool(p.bias_term),
            "group": positive_field(p.group, f"{f}.group"),
            "deformable_group": positive_field(p.deform_group, f"{f}.deform_group"),
            "axis": int(p.axis),
            "kernel": spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False),
            "stride": spatial_params(p, 2, "stride", 1, min_value=1, pair_required=False),
            "pad": spatial_params(p, 2, "pad", 0, min_value=0, pair_required=False),
            "dilation": spatial_params(p, 2, "dilation", 1, allow_hw=False, min_value=1),
        }
        a["plain"] = list(a["kernel"]) == [1, 1] and list(a["stride"]) == [1, 1] and list(a["pad"]) == [0, 0]
        if not a["plain"]:
            a["reading_notes"] = ["DeformConvolution computed as MSRA's v1 kernel intends: lzx1413's launcher "
                                  "passes Caffe's (C, H, W) input shape where the kernel reads (N, C, H, W), so no "
                                  "build of the fork gives these numbers"]
        return a

    def _check(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "DeformConvolution", "data bottom")
        if attrs["axis"] not in (1, -3):
            raise LayerError(f"convolution_param.axis must be 1: the fork's kernel reads (N, C, H, W), got "
                             f"{attrs['axis']}")
        check_groups(attrs, c)
        dg = attrs["deformable_group"]
        if c % dg:
            raise LayerError(f"input channels {c} not divisible by convolution_param.deform_group {dg}")
        return (n, c, h, w), deformable_out_hw(attrs, in_shapes[0])

    def infer(self, attrs, in_shapes):
        (n, _, _, _), (ho, wo) = self._check(attrs, in_shapes)
        return [(n, attrs["num_output"], ho, wo)]

    def cannot_run(self, attrs, in_shapes):
        (n, _, _, _), (ho, wo) = self._check(attrs, in_shapes)
        if attrs["plain"]:
            return None
        off = tuple(in_shapes[1])
        need = 2 * math.prod(attrs["kernel"]) * attrs["deformable_group"] * ho * wo
        have = math.prod(off[1:])
        if not off or off[0] != n:
            return f"the offsets {list(off)} need the data's batch {n}"
        if have < need:
            return (f"the fork's kernel reads 2 x {attrs['kernel'][0]} x {attrs['kernel'][1]} x deform_group "
                    f"{attrs['deformable_group']} x {ho} x {wo} = {need} offsets per image, past the {have} of "
                    f"the offsets {list(off)}")
        return None

    def forward(self, attrs, params, x, offset):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(t.shape) for t in (x, offset)], LayerError)
        bias = params[1] if attrs["bias_term"] else None
        return lzx_deform_conv(x, offset, params[0], bias, list(attrs["stride"]), list(attrs["pad"]),
                               list(attrs["dilation"]), attrs["group"], attrs["deformable_group"], attrs["plain"])

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(t) for t in node.inputs[:2]], ExportError)
        a = node.attrs
        if not a["plain"]:
            # the fork reads any offsets shape: only each image's first 2 kh kw deform_group Ho Wo values count
            ho, wo = ctx.shape(node.outputs[0])[2:]
            need = 2 * math.prod(a["kernel"]) * a["deformable_group"] * ho * wo
            flat = ctx.op("Flatten", [node.inputs[1]], "offsets_all", name=node.name, axis=1)
            read = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([need]), ctx.i64([1])], "offsets_used")
            onnx_deformable_conv(ctx, dataclasses.replace(node, inputs=[node.inputs[0], read]))
            return
        ins = [node.inputs[0], ctx.weight(node, 0)] + ([ctx.weight(node, 1)] if a["bias_term"] else [])
        ctx.add_node("Conv", ins, [node.outputs[0]], kernel_shape=[1, 1], group=a["group"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(0), emit.in_shape(1)], ExportError)
        if not a["plain"]:
            return super().pytorch_source(node, emit)
        m = emit.instance(DeformableConv2d, emit.in_shape(0)[1], a["num_output"], [1, 1], [1, 1], [0, 0],
                          list(a["dilation"]), a["group"], a["deformable_group"], a["bias_term"],
                          needs=_NEEDS)
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        x = emit.inputs[0]
        return f"{m}({x}, {x}.new_zeros({x}.shape[0], {2 * a['deformable_group']}, {x}.shape[2], {x}.shape[3]))"


__all__ = ["DeformConvolution", "lzx_deform_conv"]
