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
    a, name = node.attrs, node.name
    x, offset = node.inputs
    _, c, h, w = ctx.shape(x)
    cout, ho, wo = ctx.shape(node.outputs[0])[1:]
    kh, kw = a["kernel"]
    dg, taps, size = a["deformable_group"], kh * kw, ho * wo

    def op(kind, inputs, hint, **kw):
        return ctx.add_node(kind, inputs, ctx.tmp(f"{name}_{hint}"), **kw)

    def i64(values):
        return ctx.const(np.array(values, np.int64))

    def f32(value):
        return ctx.const(np.array(value, np.float32))

    # each image's offsets from the start of its blob, as (N, group, tap, dy/dx, Ho * Wo)
    flat = op("Reshape", [offset, i64([0, -1])], "offsets_flat", name=name)
    if size != h * w:
        flat = op("Slice", [flat, i64([0]), i64([dg * taps * 2 * size]), i64([1])], "offsets_read")
    off = op("Reshape", [flat, i64([0, dg, taps, 2, size])], "offsets")
    rows, cols = (ctx.const(t, f"{name}_{hint}") for t, hint in
                  zip(_base_taps(a["kernel"], a["stride"], a["pad"], a["dilation"], ho, wo), ("rows", "cols")))
    y = op("Add", [rows, op("Slice", [off, i64([0]), i64([1]), i64([3])], "dy")], "y")
    x_ = op("Add", [cols, op("Slice", [off, i64([1]), i64([2]), i64([3])], "dx")], "x")
    low = op("And", [op("GreaterOrEqual", [y, f32(0)], "y_low"), op("GreaterOrEqual", [x_, f32(0)], "x_low")],
             "low")
    high = op("And", [op("Less", [y, f32(h)], "y_high"), op("Less", [x_, f32(w)], "x_high")], "high")
    inside = op("And", [low, high], "inside")
    y = op("Where", [inside, op("Min", [y, f32(h - 1)], "y_clamped"), f32(0)], "y_read")
    x_ = op("Where", [inside, op("Min", [x_, f32(w - 1)], "x_clamped"), f32(0)], "x_read")
    keep = op("Cast", [inside], "keep", to=_FLOAT)
    bias = [ctx.weight(node, 1)] if a["bias_term"] else []
    if ctx.opset >= 19:
        moved = op("Concat", [op("Sub", [y, rows], "dy_read"), op("Sub", [x_, cols], "dx_read")], "moved", axis=3)
        moved = op("Reshape", [moved, i64([0, dg * taps * 2, ho, wo])], "offsets_read")
        mask = op("Reshape", [keep, i64([0, dg * taps, ho, wo])], "mask")
        ctx.add_node("DeformConv", [x, ctx.weight(node, 0), moved, bias[0] if bias else "", mask],
                     [node.outputs[0]], kernel_shape=[kh, kw], strides=list(a["stride"]),
                     pads=list(a["pad"]) * 2, dilations=list(a["dilation"]), group=a["group"], offset_group=dg)
        return
    y0, x0 = op("Floor", [y], "y0"), op("Floor", [x_], "x0")
    ly, lx = op("Sub", [y, y0], "ly"), op("Sub", [x_, x0], "lx")
    hy, hx = op("Sub", [f32(1), ly], "hy"), op("Sub", [f32(1), lx], "hx")
    y1 = op("Min", [op("Add", [y0, f32(1)], "y0_1"), f32(h - 1)], "y1")
    x1 = op("Min", [op("Add", [x0, f32(1)], "x0_1"), f32(w - 1)], "x1")
    image = op("Reshape", [x, i64([0, dg, c // dg, h * w])], "image")
    terms = []
    for k, (row, col, wy, wx) in enumerate(((y0, x0, hy, hx), (y0, x1, hy, lx), (y1, x0, ly, hx), (y1, x1, ly, lx))):
        at = op("Add", [op("Mul", [op("Cast", [row], f"r{k}", to=_INT64), i64(w)], f"rw{k}"),
                        op("Cast", [col], f"c{k}", to=_INT64)], f"at{k}")
        at = op("Expand", [op("Reshape", [at, i64([0, dg, 1, taps * size])], f"at{k}_flat"), i64([1, 1, c // dg, 1])],
                f"at{k}_all")
        weight = op("Mul", [op("Mul", [wy, wx], f"w{k}"), keep], f"w{k}_kept")
        weight = op("Reshape", [weight, i64([0, dg, 1, taps * size])], f"w{k}_flat")
        terms.append(op("Mul", [op("GatherElements", [image, at], f"v{k}", axis=3), weight], f"t{k}"))
    val = op("Add", [op("Add", [op("Add", terms[:2], "s2"), terms[2]], "s3"), terms[3]], "columns")
    g = a["group"]
    columns = op("Reshape", [val, i64([0, g, c // g * taps, size])], "columns_grouped")
    weights = op("Reshape", [ctx.weight(node, 0), i64([g, cout // g, c // g * taps])], "weights")
    out = ctx.tmp(f"{name}_gemm_out") if bias else node.outputs[0]
    ctx.add_node("Reshape", [op("MatMul", [weights, columns], "gemm"), i64([0, cout, ho, wo])], [out])
    if bias:
        ctx.add_node("Add", [out, op("Reshape", [bias[0], i64([cout, 1, 1])], "bias")], [node.outputs[0]])
