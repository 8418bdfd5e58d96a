"""dicecco1/fpga_caffe (7a19170), Caffe for Xilinx FPGAs through OpenCL: its nets keep their blobs in the HWCN
layout (H, W, C, N) and, between CPFPConversion layers, as 12-bit floats packed two per float slot.

- HWCN (hwcn_layer.cpp; hwcn_param.convert_to [true]): (N, C, H, W) -> (H, W, C, N), or back with
  convert_to: false; a 2-axis blob is transposed either way.  Every bottom is permuted with bottom 0's shape.
- Pad (pad_layer.cpp; its pad_param pad [true], pad_val [16], pad_to [0], axis [3], claimed from the
  synopsys Pad by those fields): one axis of a 4-axis blob made pad_to long (with pad_to 0, the next
  multiple of pad_val when padding, the previous axis's size when unpadding), the values kept as far as
  both blobs reach and zeros after them (the fork's top memory starts zeroed and is written only there).
- CPFPConversion (HalfConversion before a27cb34, its half_conversion_param the same convert_to), OCLCRHWCN
  (convolution, with a fused ReLU when cr_param.relu), OCLPoolingHWCN (MAX, stride 2 on the FPGA whatever the
  parameters say), OCLHWCNInnerProduct and XCLProgram (loads the FPGA binary; no blobs) are read and sized,
  not run: the OCL layers compute on the FPGA only, in its 12-bit arithmetic (products truncated, sums rounded
  in the kernel's order), and the fork's CPU mode does not run them; the converted blobs hold packed 16-bit
  codes, not floats.
Shapes as the fork's Reshape gives them: OCLCRHWCN (H', W', num_output, N) with Caffe's convolution sizes
(no dilation); OCLPoolingHWCN ceil((H + 2 pad - k) / stride) + 1 without BVLC's last-window correction;
OCLHWCNInnerProduct (num_output, N) from (H, W, C, N) or (K, N), its weights' columns in H, W, C order.
"""
import math

import torch

from .registry import (
    AT_LEAST,
    Layer,
    LayerError,
    ReadOnlyLayer,
    claim_layers,
    four_axes,
    need_blobs,
    positive_field,
    register_layer,
    spatial_params,
)

WHY_FPGA = ("fpga_caffe computes it on the FPGA only, in its 12-bit floating point (the fork's CPU mode does not "
            "run it): caffeq reads and sizes it but does not run it")
WHY_HALF = ("its top holds the fork's 14-bit chalf codes in float slots, which only the fork's FPGA layers read: "
            "caffeq reads and sizes it but does not run it")
WHY_CPFP = ("its top holds 12-bit codes packed two per float, which only the fork's FPGA layers read: caffeq "
            "reads and sizes it but does not run it")


def hwcn_permute(x, convert_to: bool):
    """HWCN: (N, C, H, W) -> (H, W, C, N) (convert_to) or back; a 2-axis blob transposed."""
    if x.dim() == 2:
        return x.t()
    return x.permute(2, 3, 1, 0) if convert_to else x.permute(3, 2, 0, 1)


def resize_axis(x, axis: int, size: int):
    """The first min(size, length) entries of `axis`, then zeros up to `size` (fpga_caffe's Pad)."""
    keep = x.narrow(axis, 0, min(size, x.shape[axis]))
    if size <= x.shape[axis]:
        return keep
    shape = list(x.shape)
    shape[axis] = size - x.shape[axis]
    return torch.cat([keep, x.new_zeros(shape)], dim=axis)


@register_layer("HWCN")
class HWCN(Layer):
    def parse(self, lp):
        need_blobs(lp, "HWCN", range(1, AT_LEAST), len(lp.bottom) or 1)
        return {"convert_to": bool(lp.hwcn_param.convert_to)}

    def infer(self, attrs, in_shapes):
        first = tuple(in_shapes[0])
        if len(first) not in (2, 4):
            raise LayerError(f"HWCN permutes 2- or 4-axis blobs (the fork's other ranks write past its shape), "
                             f"got {list(first)}")
        if any(tuple(s) != first for s in in_shapes):
            raise LayerError(f"HWCN permutes every bottom with bottom 0's shape; they differ: "
                             f"{[list(s) for s in in_shapes]}")
        if len(first) == 2:
            out = (first[1], first[0])
        elif attrs["convert_to"]:
            out = (first[2], first[3], first[1], first[0])
        else:
            out = (first[3], first[2], first[0], first[1])
        return [out] * len(in_shapes)

    def forward(self, attrs, params, *xs):
        outs = [hwcn_permute(x, attrs["convert_to"]) for x in xs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def onnx(self, ctx, node):
        for x, out in zip(node.inputs, node.outputs):
            rank = len(ctx.shape(x))
            perm = [1, 0] if rank == 2 else ([2, 3, 1, 0] if node.attrs["convert_to"] else [3, 2, 0, 1])
            ctx.add_node("Transpose", [x], [out], perm=perm)

    def pytorch_source(self, node, emit):
        fn = emit.helper(hwcn_permute)
        outs = [f"{fn}({x}, {node.attrs['convert_to']})" for x in emit.inputs]
        return outs[0] if len(outs) == 1 else outs


_FPGA_PAD_FIELDS = ("pad", "pad_val", "pad_to", "axis")


@claim_layers("Pad", lambda lp: any(lp.pad_param.HasField(f) for f in _FPGA_PAD_FIELDS))
class FpgaPad(Layer):
    def parse(self, lp):
        need_blobs(lp, "Pad (fpga_caffe)", range(1, AT_LEAST), len(lp.bottom) or 1)
        p = lp.pad_param
        if p.paddings:
            raise LayerError("pad_param mixes synopsys-caffe's paddings with fpga_caffe's pad / pad_val / pad_to / "
                             "axis")
        return {"pad": bool(p.pad), "pad_val": int(p.pad_val), "pad_to": int(p.pad_to), "axis": int(p.axis)}

    def size(self, attrs, shape):
        a = attrs
        axis, d = a["axis"], shape[a["axis"]]
        if a["pad_to"]:
            if a["pad"] and a["pad_to"] < d:
                raise LayerError(f"pad_param.pad_to {a['pad_to']} is below axis {axis}'s {d}: the fork would write "
                                 f"past its top")
            return a["pad_to"]
        if a["pad"]:
            positive_field(a["pad_val"], "pad_param.pad_val")
            return math.ceil(d / a["pad_val"]) * a["pad_val"]
        if axis == 0:
            raise LayerError("pad_param: unpadding axis 0 without pad_to reads the axis before it")
        return shape[axis - 1]

    def infer(self, attrs, in_shapes):
        s = four_axes(in_shapes[0], "Pad (fpga_caffe)")
        if not 0 <= attrs["axis"] <= 3:
            raise LayerError(f"pad_param.axis must be 0 to 3, got {attrs['axis']}")
        out = list(s)
        out[attrs["axis"]] = attrs["size"] = self.size(attrs, s)
        return [tuple(out)] * len(in_shapes)

    def forward(self, attrs, params, *xs):
        outs = [resize_axis(x, attrs["axis"], attrs["size"]) for x in xs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def onnx(self, ctx, node):
        a = node.attrs
        for x, out in zip(node.inputs, node.outputs):
            d = ctx.shape(x)[a["axis"]]
            keep = ctx.op("Slice", [x, ctx.i64([0]), ctx.i64([min(d, a["size"])]), ctx.i64([a["axis"]])], "keep",
                          name=node.name)
            pads = [0] * 8
            pads[4 + a["axis"]] = max(a["size"] - d, 0)
            ctx.add_node("Pad", [keep, ctx.i64(pads)], [out], mode="constant")

    def pytorch_source(self, node, emit):
        fn = emit.helper(resize_axis)
        outs = [f"{fn}({x}, {node.attrs['axis']}, {node.attrs['size']})" for x in emit.inputs]
        return outs[0] if len(outs) == 1 else outs


@register_layer("CPFPConversion")
class CPFPConversion(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "CPFPConversion", range(1, AT_LEAST), len(lp.bottom) or 1)
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        return [tuple(s) for s in in_shapes]

    def why_not_run(self, attrs):
        return WHY_CPFP


@register_layer("HalfConversion")
class HalfConversion(CPFPConversion):
    """CPFPConversion's name before the fork's commit a27cb34 ("half->cpfp renaming"): the same loops, its codes
    then a 14-bit chalf (1 sign, 6 exponent, 7 mantissa bits; include/fpga_caffe/half.hpp there)."""

    def parse(self, lp):
        need_blobs(lp, "HalfConversion", range(1, AT_LEAST), len(lp.bottom) or 1)
        return {"name": lp.name}

    def why_not_run(self, attrs):
        return WHY_HALF


def _hwcn_bottom(shape, what):
    if len(shape) != 4:
        raise LayerError(f"{what} reads an (H, W, C, N) blob, got {list(shape)}")
    return tuple(int(d) for d in shape)


@register_layer("OCLCRHWCN")
class OCLCRHWCN(ReadOnlyLayer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "OCLCRHWCN", 1, 1)
        p = lp.convolution_param
        if not p.HasField("num_output") or p.num_output < 1:
            raise LayerError("convolution_param.num_output must be >= 1")
        if not (p.kernel_size or p.HasField("kernel_h") or p.HasField("kernel_w")):
            raise LayerError("convolution_param.kernel_size is required")
        return {"name": lp.name, "num_output": int(p.num_output), "group": positive_field(p.group, "convolution_param.group"),
                "kernel": spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False),
                "stride": spatial_params(p, 2, "stride", 1, min_value=1, pair_required=False),
                "pad": spatial_params(p, 2, "pad", 0, min_value=0, pair_required=False)}

    def infer(self, attrs, in_shapes):
        h, w, c, n = _hwcn_bottom(in_shapes[0], "OCLCRHWCN")
        if c % attrs["group"] or attrs["num_output"] % attrs["group"]:
            raise LayerError(f"convolution_param.group {attrs['group']} must divide the {c} channels and the "
                             f"{attrs['num_output']} outputs")
        (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["pad"]
        oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        if oh < 1 or ow < 1:
            raise LayerError(f"output would be empty: input (H, W) ({h}, {w}), kernel ({kh}, {kw})")
        attrs["channels"] = c
        return [(oh, ow, attrs["num_output"], n)]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        o = attrs["num_output"]
        return [(o, attrs["channels"] // attrs["group"]) + tuple(attrs["kernel"]), (o,)]

    def why_not_run(self, attrs):
        return WHY_FPGA


@register_layer("OCLPoolingHWCN")
class OCLPoolingHWCN(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "OCLPoolingHWCN", 1, 1)
        p = lp.pooling_param
        if not (p.kernel_size or p.HasField("kernel_h")):
            raise LayerError("pooling_param.kernel_size (or kernel_h/kernel_w) is required")
        return {"name": lp.name, "kernel": spatial_params(p, 2, "kernel_size", None, min_value=1),
                "stride": spatial_params(p, 2, "stride", 1, min_value=1),
                "pad": spatial_params(p, 2, "pad", 0, min_value=0)}

    def infer(self, attrs, in_shapes):
        h, w, c, n = _hwcn_bottom(in_shapes[0], "OCLPoolingHWCN")
        (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["pad"]
        return [(math.ceil((h + 2 * ph - kh) / sh) + 1, math.ceil((w + 2 * pw - kw) / sw) + 1, c, n)]

    def why_not_run(self, attrs):
        return WHY_FPGA


@register_layer("OCLHWCNInnerProduct")
class OCLHWCNInnerProduct(ReadOnlyLayer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "OCLHWCNInnerProduct", 1, 1)
        p = lp.inner_product_param
        return {"name": lp.name, "num_output": positive_field(p.num_output, "inner_product_param.num_output"),
                "bias_term": bool(p.bias_term), "transpose": bool(p.transpose)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) == 4:
            attrs["inputs"], n = s[0] * s[1] * s[2], s[3]
        elif len(s) == 2:
            attrs["inputs"], n = s
        else:
            raise LayerError(f"OCLHWCNInnerProduct reads (H, W, C, N) or (K, N), got {list(s)}")
        return [(attrs["num_output"], n)]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        o, k = attrs["num_output"], attrs["inputs"]
        weight = (k, o) if attrs["transpose"] else (o, k)
        return [weight, (o,)] if attrs["bias_term"] else [weight]

    def why_not_run(self, attrs):
        return WHY_FPGA


@register_layer("XCLProgram")
class XCLProgram(Layer):
    """Loads the FPGA binary the OCL layers run; no bottoms, no tops, nothing to compute."""

    def parse(self, lp):
        need_blobs(lp, "XCLProgram", 0, 0)
        return {}

    def infer(self, attrs, in_shapes):
        return []

    def forward(self, attrs, params):
        return ()

    def onnx(self, ctx, node):
        return None

    def pytorch_source(self, node, emit):
        return []
