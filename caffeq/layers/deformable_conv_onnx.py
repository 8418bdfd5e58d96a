"""ONNX for DeformableConvolution (deformable_conv.py has the fork's semantics).

From opset 19 the layer is one DeformConv: its offsets are laid out as the fork's, (N, offset_group,
kh, kw, dy/dx, Ho, Wo), but it samples zero-padded (a tap in (-1, 0) still reads part of row 0, one in
(H - 1, H) part of row H - 1).  The fork reads 0 outside [0, H) x [0, W) and clamps to H - 1 / W - 1
inside, so the offsets given to DeformConv are moved onto the clamped positions and its mask input is 1
where the fork samples, 0 where it reads 0.  Below opset 19 the same sampling is written out: the four
bilinear neighbours by GatherElements, then Caffe's grouped GEMM as a MatMul.
"""
import numpy as np

_FLOAT, _INT64 = 1, 7


def _base_taps(kernel, stride, pad, dilation, ho, wo):
    """The undeformed rows and columns, each (kh * kw, 1, Ho * Wo) float32 (deformable_conv.deformable_taps)."""
    kh, kw = kernel
    tap_row = np.repeat(np.arange(kh) * dilation[0], kw)
    tap_col = np.tile(np.arange(kw) * dilation[1], kh)
    out_row = np.repeat(np.arange(ho) * stride[0] - pad[0], wo)
    out_col = np.tile(np.arange(wo) * stride[1] - pad[1], ho)
    rows = (tap_row[:, None] + out_row[None, :]).astype(np.float32)
    cols = (tap_col[:, None] + out_col[None, :]).astype(np.float32)
    return rows[:, None, :], cols[:, None, :]


def onnx_deformable_conv(ctx, node):
    if len(node.inputs) == 3:
        onnx_modulated_deformable_conv(ctx, node)
        return
    a, name = node.attrs, node.name
    x, offset = node.inputs
    _, c, h, w = ctx.shape(x)
    cout, ho, wo = ctx.shape(node.outputs[0])[1:]
    kh, kw = a["kernel"]
    dg, taps, size = a["deformable_group"], kh * kw, ho * wo

    # each image's offsets from the start of its blob, as (N, group, tap, dy/dx, Ho * Wo)
    flat = ctx.op("Reshape", [offset, ctx.i64([0, -1])], "offsets_flat", name=name)
    if size != h * w:
        flat = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([dg * taps * 2 * size]), ctx.i64([1])], "offsets_read")
    off = ctx.op("Reshape", [flat, ctx.i64([0, dg, taps, 2, size])], "offsets")
    rows, cols = (ctx.const(t, f"{name}_{hint}") for t, hint in
                  zip(_base_taps(a["kernel"], a["stride"], a["pad"], a["dilation"], ho, wo), ("rows", "cols")))
    y = ctx.op("Add", [rows, ctx.op("Slice", [off, ctx.i64([0]), ctx.i64([1]), ctx.i64([3])], "dy")], "y")
    x_ = ctx.op("Add", [cols, ctx.op("Slice", [off, ctx.i64([1]), ctx.i64([2]), ctx.i64([3])], "dx")], "x")
    low = ctx.op("And", [ctx.op("GreaterOrEqual", [y, ctx.f32(0)], "y_low"),
                         ctx.op("GreaterOrEqual", [x_, ctx.f32(0)], "x_low")], "low")
    high = ctx.op("And", [ctx.op("Less", [y, ctx.f32(h)], "y_high"),
                          ctx.op("Less", [x_, ctx.f32(w)], "x_high")], "high")
    inside = ctx.op("And", [low, high], "inside")
    y = ctx.op("Where", [inside, ctx.op("Min", [y, ctx.f32(h - 1)], "y_clamped"), ctx.f32(0)], "y_read")
    x_ = ctx.op("Where", [inside, ctx.op("Min", [x_, ctx.f32(w - 1)], "x_clamped"), ctx.f32(0)], "x_read")
    keep = ctx.op("Cast", [inside], "keep", to=_FLOAT)
    bias = [ctx.weight(node, 1)] if a["bias_term"] else []
    if ctx.opset >= 19:
        moved = ctx.op("Concat", [ctx.op("Sub", [y, rows], "dy_read"), ctx.op("Sub", [x_, cols], "dx_read")], "moved",
                       axis=3)
        moved = ctx.op("Reshape", [moved, ctx.i64([0, dg * taps * 2, ho, wo])], "offsets_read")
        mask = ctx.op("Reshape", [keep, ctx.i64([0, dg * taps, ho, wo])], "mask")
        ctx.add_node("DeformConv", [x, ctx.weight(node, 0), moved, bias[0] if bias else "", mask],
                     [node.outputs[0]], kernel_shape=[kh, kw], strides=list(a["stride"]),
                     pads=list(a["pad"]) * 2, dilations=list(a["dilation"]), group=a["group"], offset_group=dg)
        return
    y0, x0 = ctx.op("Floor", [y], "y0"), ctx.op("Floor", [x_], "x0")
    ly, lx = ctx.op("Sub", [y, y0], "ly"), ctx.op("Sub", [x_, x0], "lx")
    hy, hx = ctx.op("Sub", [ctx.f32(1), ly], "hy"), ctx.op("Sub", [ctx.f32(1), lx], "hx")
    y1 = ctx.op("Min", [ctx.op("Add", [y0, ctx.f32(1)], "y0_1"), ctx.f32(h - 1)], "y1")
    x1 = ctx.op("Min", [ctx.op("Add", [x0, ctx.f32(1)], "x0_1"), ctx.f32(w - 1)], "x1")
    image = ctx.op("Reshape", [x, ctx.i64([0, dg, c // dg, h * w])], "image")
    terms = []
    for k, (row, col, wy, wx) in enumerate(((y0, x0, hy, hx), (y0, x1, hy, lx), (y1, x0, ly, hx), (y1, x1, ly, lx))):
        at = ctx.op("Add", [ctx.op("Mul", [ctx.op("Cast", [row], f"r{k}", to=_INT64), ctx.i64(w)], f"rw{k}"),
                            ctx.op("Cast", [col], f"c{k}", to=_INT64)], f"at{k}")
        at = ctx.op("Expand", [ctx.op("Reshape", [at, ctx.i64([0, dg, 1, taps * size])], f"at{k}_flat"),
                               ctx.i64([1, 1, c // dg, 1])], f"at{k}_all")
        weight = ctx.op("Mul", [ctx.op("Mul", [wy, wx], f"w{k}"), keep], f"w{k}_kept")
        weight = ctx.op("Reshape", [weight, ctx.i64([0, dg, 1, taps * size])], f"w{k}_flat")
        terms.append(ctx.op("Mul", [ctx.op("GatherElements", [image, at], f"v{k}", axis=3), weight], f"t{k}"))
    val = ctx.op("Add", [ctx.op("Add", [ctx.op("Add", terms[:2], "s2"), terms[2]], "s3"), terms[3]], "columns")
    g = a["group"]
    columns = ctx.op("Reshape", [val, ctx.i64([0, g, c // g * taps, size])], "columns_grouped")
    weights = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([g, cout // g, c // g * taps])], "weights")
    out = ctx.tmp(f"{name}_gemm_out") if bias else node.outputs[0]
    ctx.add_node("Reshape", [ctx.op("MatMul", [weights, columns], "gemm"), ctx.i64([0, cout, ho, wo])], [out])
    if bias:
        ctx.add_node("Add", [out, ctx.op("Reshape", [bias[0], ctx.i64([cout, 1, 1])], "bias")], [node.outputs[0]])


def onnx_modulated_deformable_conv(ctx, node):
    """ModulatedDeformableConvolution: DCNv2's sampling is DeformConv's own (zero padding, the mask a
    factor), so one DeformConv on the offsets and mask read as the fork reads them."""
    from ..errors import ExportError
    a, name = node.attrs, node.name
    if ctx.opset < 19:
        raise ExportError(f"layer '{name}' (ModulatedDeformableConvolution): ONNX has DeformConv from opset 19; "
                          f"export with opset 19 or later")
    x, offset, mask = node.inputs
    _, _, h, w = ctx.shape(x)
    ho, wo = ctx.shape(node.outputs[0])[2:]
    kh, kw = a["kernel"]
    dg, taps = a["deformable_group"], kh * kw
    planes = []
    for blob, per_tap, hint in ((offset, 2, "offsets"), (mask, 1, "mask")):
        flat = ctx.op("Reshape", [blob, ctx.i64([0, -1])], f"{hint}_flat", name=name)
        if ho * wo != h * w:   # each image's first planes of Ho x Wo, as the kernel reads them
            flat = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([dg * taps * per_tap * ho * wo]), ctx.i64([1])],
                          f"{hint}_read")
        planes.append(ctx.op("Reshape", [flat, ctx.i64([0, dg * taps * per_tap, ho, wo])], f"{hint}_planes"))
    bias = ctx.weight(node, 1) if a["bias_term"] else ""
    ctx.add_node("DeformConv", [x, ctx.weight(node, 0), planes[0], bias, planes[1]], [node.outputs[0]],
                 kernel_shape=[kh, kw], strides=list(a["stride"]), pads=list(a["pad"]) * 2,
                 dilations=list(a["dilation"]), group=a["group"], offset_group=dg)
