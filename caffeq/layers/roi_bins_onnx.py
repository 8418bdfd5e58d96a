"""ONNX for ROI max poolings whose bins ONNX's MaxRoiPool cannot form: UberNet's every-second-cell and holed
regions (ubernet.py), LocNet's RegionPooling (region_pooling.py).  Fast R-CNN's bins become 0/1 masks along
each axis, a hole the union of two row x column pieces (the rows outside it with every column, the rows
inside it with the columns outside it), and the masked maxima come from a Scan over the rois: each step
reads its roi's image from the outer graph and takes the maximum over the columns, then over the rows."""
import numpy as np
from onnx import TensorProto, helper


def onnx_axis_bins(ctx, lo, hi, pooled, extent, step=1):
    """Fast R-CNN's bins of the inclusive cell ranges [lo, hi] ((R, 1) whole-valued float32) along an axis of
    `extent` cells, as fast_rcnn_bins computes them: the (R, pooled, extent) bool of the cells each bin
    visits (every `step`-th from the bin's start), and the clipped (R, pooled) starts and ends."""
    op, f32 = ctx.op, ctx.f32
    size = op("Max", [op("Add", [op("Sub", [hi, lo], "d"), f32(1.0)], "n"), f32(1.0)], "size")
    bin_size = op("Div", [size, f32(float(pooled))], "bin")
    k0 = ctx.const(np.arange(pooled, dtype=np.float32).reshape(1, pooled))
    k1 = ctx.const(np.arange(1, pooled + 1, dtype=np.float32).reshape(1, pooled))
    bounds = (f32(0.0), f32(float(extent)))
    start = op("Clip", [op("Add", [op("Floor", [op("Mul", [k0, bin_size], "k")], "f"), lo], "s"), *bounds], "bs")
    end = op("Clip", [op("Add", [op("Ceil", [op("Mul", [k1, bin_size], "k")], "c"), lo], "e"), *bounds], "be")
    start3, end3 = (op("Unsqueeze", [v, ctx.i64([2])], "b3") for v in (start, end))
    pos = ctx.const(np.arange(extent, dtype=np.float32).reshape(1, 1, extent))
    inside = op("And", [op("GreaterOrEqual", [pos, start3], "ge"), op("Less", [pos, end3], "lt")], "in")
    if step == 1:
        return inside, start, end
    offset = op("Sub", [pos, start3], "off")
    on_step = op("Equal", [op("Mul", [op("Floor", [op("Div", [offset, f32(float(step))], "q")], "fq"),
                                      f32(float(step))], "back"), offset], "on_step")
    return op("And", [inside, on_step], "visit"), start, end


def onnx_strictly_inside(ctx, lo, hi, extent):
    """(R, 1, extent) bool: the cells strictly between lo and hi ((R, 1) float32)."""
    pos = ctx.const(np.arange(extent, dtype=np.float32).reshape(1, 1, extent))
    lo3, hi3 = (ctx.op("Unsqueeze", [v, ctx.i64([2])], "h3") for v in (lo, hi))
    return ctx.op("And", [ctx.op("Greater", [pos, lo3], "gt"), ctx.op("Less", [pos, hi3], "lt")], "inhole")


def onnx_hole_pieces(ctx, rows, cols, in_rows, in_cols):
    """The bins' cells less a hole as two (rows, cols) mask pairs whose union they are."""
    op = ctx.op
    return [(op("And", [rows, op("Not", [in_rows], "out_rows")], "rows_out"), cols),
            (op("And", [rows, in_rows], "rows_in"), op("And", [cols, op("Not", [in_cols], "out_cols")], "cols_out"))]


def onnx_empty_bins(ctx, hs, he, ws, we):
    """(R, 1, ph, pw) bool: the bins with no cell (end <= start on either axis)."""
    op = ctx.op
    rows = op("LessOrEqual", [op("Unsqueeze", [he, ctx.i64([2])], "he"), op("Unsqueeze", [hs, ctx.i64([2])], "hs")],
              "eh")
    cols = op("LessOrEqual", [op("Unsqueeze", [we, ctx.i64([1])], "we"), op("Unsqueeze", [ws, ctx.i64([1])], "ws")],
              "ew")
    return op("Unsqueeze", [op("Or", [rows, cols], "empty"), ctx.i64([1])], "empty4")


def onnx_scan_bin_max(ctx, node, x, batch, pieces, ph, pw, floor):
    """(R, C, ph, pw): for roi r of image batch[r] ((R,) int64), the maximum of `floor` and of x's cells in the
    union of the pieces ((R, ph, H) row masks, (R, pw, W) column masks)."""
    _, c, h, w = ctx.shape(x)
    body, scan_inputs, body_inputs = [], [batch], []

    def b(op_type, inputs, hint, **kw):
        return ctx.body_op(body, op_type, inputs, hint, **kw)

    def const(hint, array):
        return ctx.body_const(body, array, hint)

    def reduce_max(v, axis, hint):
        if ctx.opset >= 18:
            return b("ReduceMax", [v, const(hint + "_axes", np.array([axis], np.int64))], hint, keepdims=0)
        return b("ReduceMax", [v], hint, axes=[axis], keepdims=0)
    index = ctx.tmp(f"{node.name}_index")
    body_inputs.append(helper.make_tensor_value_info(index, TensorProto.INT64, []))
    plane4 = b("Unsqueeze", [b("Gather", [x, index], "plane", axis=0), const("ax2", np.array([2], np.int64))],
               "plane4")                                                                     # (C, H, 1, W)
    neg = const("neg", np.array(-np.inf, np.float32))
    best = const("floor", np.array(floor, np.float32))
    for k, (rows_mask, cols_mask) in enumerate(pieces):
        mr, mc = ctx.tmp(f"{node.name}_mr{k}"), ctx.tmp(f"{node.name}_mc{k}")
        scan_inputs += [rows_mask, cols_mask]
        body_inputs += [helper.make_tensor_value_info(mr, TensorProto.BOOL, [ph, h]),
                        helper.make_tensor_value_info(mc, TensorProto.BOOL, [pw, w])]
        by_cols = reduce_max(b("Where", [mc, plane4, neg], f"wc{k}"), 3, f"cols{k}")                 # (C, H, pw)
        rows4 = b("Unsqueeze", [mr, const(f"ar{k}", np.array([0, 3], np.int64))], f"mr4_{k}")       # (1, ph, H, 1)
        cols4 = b("Unsqueeze", [by_cols, const(f"ac{k}", np.array([1], np.int64))], f"bc4_{k}")     # (C, 1, H, pw)
        best = b("Max", [best, reduce_max(b("Where", [rows4, cols4, neg], f"wr{k}"), 2, f"bins{k}")], f"best{k}")
    graph = helper.make_graph(body, f"{node.name}_roi_step", body_inputs,
                              [helper.make_tensor_value_info(best, TensorProto.FLOAT, [c, ph, pw])])
    return ctx.add_node("Scan", scan_inputs, [ctx.tmp(f"{node.name}_pooled")], body=graph,
                        num_scan_inputs=len(scan_inputs))[0]
