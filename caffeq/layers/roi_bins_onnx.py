"""ONNX for the ROI poolings whose bins ONNX's MaxRoiPool cannot form, in plain ops.

- Maxima (UberNet's every-second-cell and holed regions, ubernet.py; LocNet's RegionPooling,
  region_pooling.py; MNC's padding row and batch check, mnc.py): Fast R-CNN's bins become 0/1 masks along
  each axis, a hole the union of two row x column pieces (the rows outside it with every column, the rows
  inside it with the columns outside it), and the masked maxima come from a Scan over the rois: each step
  reads its roi's image from the outer graph and takes the maximum over the columns, then over the rows.
- Means (ccnn's ROIPooling AVE, R-FCN's PSROIPooling, PPR-FCN's PSROIContextPooling, roi_pooling.py;
  psroi_align.py): masks of every roi's bins at once and Einsums over the data with a one-hot of each
  roi's image.
"""
import numpy as np
from onnx import TensorProto, helper

from .c_numerics import onnx_c_round


def onnx_padded_rows(ctx, rois, width):
    """The (R + 1, width) roi rows with a zero row appended (onnxruntime refuses a Scan of 0 steps, as an image
    without proposals would make), and R as a (1,) int64 to cut the padding row off again."""
    rows = ctx.op("Reshape", [rois, ctx.i64([-1, width])], "rows")
    count = ctx.op("Slice", [ctx.op("Shape", [rows], "rows_shape"), ctx.i64([0]), ctx.i64([1])], "count")
    return ctx.op("Pad", [rows, ctx.i64([0, 0, 1, 0])], "padded_rows"), count


def onnx_batch_column(ctx, rows, n):
    """The rows' image indexes (column 0 truncated to int64, as C's (int)) and where they fall in the batch of
    n: (indexes clamped into it, (R,) bool inside).  An index outside gives 0 here where torch refuses."""
    batch = ctx.op("Cast", [ctx.op("Gather", [rows, ctx.i64(0)], "b", axis=1)], "batch", to=TensorProto.INT64)
    inside = ctx.op("And", [ctx.op("GreaterOrEqual", [batch, ctx.i64(0)], "b_lo"),
                            ctx.op("Less", [batch, ctx.i64(n)], "b_hi")], "b_in")
    return ctx.op("Where", [inside, batch, ctx.i64(0)], "batch_in"), inside


def onnx_finish_rois(ctx, node, pooled, count, *zero_where):
    """The Scan's (R + 1, C, ph, pw) maxima without the padding row, 0 where any (R + 1, ...) bool mask of
    zero_where holds (broadcast), as the node's top."""
    for mask in zero_where:
        pooled = ctx.op("Where", [mask, ctx.f32(0.0), pooled], "zeroed")
    ctx.add_node("Slice", [pooled, ctx.i64([0]), count, ctx.i64([0])], [node.outputs[0]], name=node.name)


def onnx_bilinear_reads(g, table, base, ys, xs, w):
    """Bilinear reads of every roi's (R, ph) rows and (R, pw) columns, each axis (taken, low, high, weight of high),
    from the (N H W, C) channels-last table at image offsets base (R, 1, 1): (taken (R, ph, pw, 1), value
    (R, ph, pw, C)), the four terms (1-ly)(1-lx) v00 + (1-ly) lx v01 + ly (1-lx) v10 + ly lx v11 in that order.
    g: an _OnnxGraph (affordance.py), whose op may append to a Scan body (MNC's ROIWarping, wk910930's
    ROIAlignPooling)."""
    (in_y, y0, y1, ly), (in_x, x0, x1, lx) = ys, xs
    ly, lx = g.op("Unsqueeze", ly, g.i64([2])), g.op("Unsqueeze", lx, g.i64([1]))   # (R, ph, 1), (R, 1, pw)
    hy, hx = g.op("Sub", g.f32(1.0), ly), g.op("Sub", g.f32(1.0), lx)
    val = None
    for wy, wx, rows, cols in ((hy, hx, y0, x0), (hy, lx, y0, x1), (ly, hx, y1, x0), (ly, lx, y1, x1)):
        index = g.op("Add", g.op("Add", base, g.op("Unsqueeze", g.op("Mul", rows, g.i64(w)), g.i64([2]))),
                     g.op("Unsqueeze", cols, g.i64([1])))   # (R, ph, pw)
        term = g.op("Mul", g.op("Unsqueeze", g.op("Mul", wy, wx), g.i64([3])), g.op("Gather", table, index, axis=0))
        val = term if val is None else g.op("Add", val, term)
    inside = g.op("And", g.op("Unsqueeze", in_y, g.i64([2])), g.op("Unsqueeze", in_x, g.i64([1])))
    return g.op("Unsqueeze", inside, g.i64([3])), val


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


def onnx_bin_mask(ctx, lo, hi, extent):
    """Integer-valued float (R, bins) bin bounds clipped to [0, extent], the (R, bins, extent) 0/1 mask of the
    cells each holds (lo <= cell < hi) and each bin's (R, bins) cell count."""
    bounds = (ctx.f32(0.0), ctx.f32(float(extent)))
    lo, hi = (ctx.op("Clip", [v, *bounds], "clip") for v in (lo, hi))
    cells = ctx.const(np.arange(extent, dtype=np.float32).reshape(1, 1, extent))
    inside = ctx.op("And", [ctx.op("GreaterOrEqual", [cells, ctx.op("Unsqueeze", [lo, ctx.i64([2])], "lo")], "ge"),
                            ctx.op("Less", [cells, ctx.op("Unsqueeze", [hi, ctx.i64([2])], "hi")], "lt")], "in")
    span = ctx.op("Max", [ctx.op("Sub", [hi, lo], "span"), ctx.f32(0.0)], "span")
    return lo, hi, ctx.op("Cast", [inside], "mask", to=1), span


def onnx_bin_areas(ctx, rows_span, cols_span):
    """(R, ph, pw) cell counts of the bins from the (R, ph) and (R, pw) spans."""
    return ctx.op("Mul", [ctx.op("Unsqueeze", [rows_span, ctx.i64([2])], "ah"),
                          ctx.op("Unsqueeze", [cols_span, ctx.i64([1])], "aw")], "area")


def onnx_roi_avg_pool(ctx, node, ph, pw, scale):
    """wk910930/ccnn's ROIPooling AVE in plain ONNX ops: Fast R-CNN's bins (cell_bins) for every roi at once,
    their 0/1 masks, the sums as two Einsums over the data with a one-hot of the rois' images, the mean,
    0 for an empty bin (roi_avg_pool's numbers to float rounding)."""
    f32, i64 = 1, 7
    x, rois = node.inputs
    _, _, h, w = ctx.shape(x)
    rows, count = onnx_padded_rows(ctx, rois, 5)     # a padding row: onnxruntime's Einsum takes no 0 rois
    batch = ctx.op("Cast", [ctx.op("Gather", [rows, ctx.i64(0)], "batch", axis=1)], "batch", to=i64)
    scaled = ctx.op("Mul", [ctx.op("Slice", [rows, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], "corners"),
                            ctx.f32(float(np.float32(scale)))], "scaled")
    corners = ctx.op("Cast", [onnx_c_round(ctx, scaled, in_double=True)], "cells", to=f32)        # (R, 4), whole
    masks, spans = [], []
    for col, pooled, extent in ((1, ph, h), (0, pw, w)):   # y then x
        first = ctx.op("Slice", [corners, ctx.i64([col]), ctx.i64([col + 1]), ctx.i64([1])], "first")     # (R, 1)
        last = ctx.op("Slice", [corners, ctx.i64([col + 2]), ctx.i64([col + 3]), ctx.i64([1])], "last")
        cells = ctx.op("Max", [ctx.op("Add", [ctx.op("Sub", [last, first], "cells"), ctx.f32(1.0)], "cells"),
                               ctx.f32(1.0)], "cells")
        bin_size = ctx.op("Div", [cells, ctx.f32(float(pooled))], "bin")
        k0 = ctx.const(np.arange(pooled, dtype=np.float32).reshape(1, pooled))
        k1 = ctx.const(np.arange(1, pooled + 1, dtype=np.float32).reshape(1, pooled))
        lo = ctx.op("Add", [ctx.op("Floor", [ctx.op("Mul", [k0, bin_size], "k")], "lo"), first], "lo")
        hi = ctx.op("Add", [ctx.op("Ceil", [ctx.op("Mul", [k1, bin_size], "k")], "hi"), first], "hi")
        _, _, mask, span = onnx_bin_mask(ctx, lo, hi, extent)
        masks.append(mask)
        spans.append(span)
    area = ctx.op("Unsqueeze", [onnx_bin_areas(ctx, *spans), ctx.i64([1])], "area")                # (R, 1, ph, pw)
    by_cols = ctx.op("Einsum", [x, masks[1]], "cols", equation="nchw,rqw->nrchq")
    sums = ctx.op("Einsum", [by_cols, onnx_image_onehot(ctx, x, batch), masks[0]], "sums",
                  equation="nrchq,rn,rph->rcpq")
    mean = ctx.op("Div", [sums, ctx.op("Max", [area, ctx.f32(1.0)], "divisor")], "mean")
    onnx_finish_rois(ctx, node, mean, count, ctx.op("LessOrEqual", [area, ctx.f32(0.0)], "unfilled"))


def onnx_ps_roi_pool(ctx, node, dim, g, scale, keep_object=False):
    """PSROIPooling in plain ONNX ops (ps_roi_means): ps_roi_bins for every roi at once (the corners rounded
    in double as C's round(), the rest float32), 0/1 row and column masks of the bins, and the sums as two
    Einsums over the (N, dim, g, g, H, W) view of the data, a one-hot of each roi's batch index picking its
    image (an index outside the batch gives 0 where caffeq's forward raises).  keep_object: PSROIContextPooling,
    the bins that do not overlap the first object box (the third input) give 0."""
    x, rois = node.inputs[:2]
    _, _, h, w = ctx.shape(x)
    f32, i64 = 1, 7
    rows, count = onnx_padded_rows(ctx, rois, 5)     # a padding row: onnxruntime's Einsum takes no 0 rois
    batch = ctx.op("Cast", [ctx.op("Gather", [rows, ctx.i64(0)], "batch", axis=1)], "batch", to=i64)
    corners = ctx.op("Slice", [rows, ctx.i64([1]), ctx.i64([5]), ctx.i64([1])], "corners")
    rounded = onnx_c_round(ctx, corners, in_double=True)
    first = ctx.op("Slice", [rounded, ctx.i64([0]), ctx.i64([2]), ctx.i64([1])], "first")
    last = ctx.op("Add", [ctx.op("Slice", [rounded, ctx.i64([2]), ctx.i64([4]), ctx.i64([1])], "last"),
                          ctx.const(np.array(1.0, np.float64))], "last")
    scale_c = ctx.f32(float(np.float32(scale)))
    start = ctx.op("Mul", [ctx.op("Cast", [first], "start", to=f32), scale_c], "start")      # (R, 2): x, y
    end = ctx.op("Mul", [ctx.op("Cast", [last], "end", to=f32), scale_c], "end")
    size = ctx.op("Max", [ctx.op("Sub", [end, start], "size"), ctx.f32(float(np.float32(0.1)))], "size")
    bin_size = ctx.op("Div", [size, ctx.f32(float(g))], "bin")
    k0 = ctx.const(np.arange(g, dtype=np.float32).reshape(1, g))
    k1 = ctx.const(np.arange(1, g + 1, dtype=np.float32).reshape(1, g))
    masks, spans, bins = [], [], []
    for axis, extent in ((1, h), (0, w)):   # y then x
        s_ = ctx.op("Slice", [start, ctx.i64([axis]), ctx.i64([axis + 1]), ctx.i64([1])], "s")   # (R, 1)
        b_ = ctx.op("Slice", [bin_size, ctx.i64([axis]), ctx.i64([axis + 1]), ctx.i64([1])], "b")
        lo = ctx.op("Floor", [ctx.op("Add", [ctx.op("Mul", [k0, b_], "k"), s_], "lo")], "lo")
        hi = ctx.op("Ceil", [ctx.op("Add", [ctx.op("Mul", [k1, b_], "k"), s_], "hi")], "hi")
        lo, hi, mask, span = onnx_bin_mask(ctx, lo, hi, extent)
        masks.append(mask)
        spans.append(span)
        bins.append((lo, hi))
    rows_mask, cols_mask = masks
    area = onnx_bin_areas(ctx, *spans)                                                           # (R, g, g)
    sums = onnx_ps_weighted_sums(ctx, x, batch, rows_mask, cols_mask, dim, g, h, w)
    area4 = ctx.op("Unsqueeze", [area, ctx.i64([1])], "area")
    mean = ctx.op("Div", [sums, ctx.op("Max", [area4, ctx.f32(1.0)], "divisor")], "mean")
    kept = ctx.op("Greater", [area4, ctx.f32(0.0)], "filled")
    if keep_object:
        kept = ctx.op("And", [kept, onnx_object_overlap(ctx, node.inputs[2], scale, h, w, bins)], "kept")
    onnx_finish_rois(ctx, node, ctx.op("Where", [kept, mean, ctx.f32(0.0)], "kept_mean"), count)


def onnx_ps_weighted_sums(ctx, x, batch, row_weights, col_weights, dim, g, h, w):
    """(R, dim, g, g): bin (p, q) of roi r summed over x's (dim, g, g, H, W) view of the roi's image, each
    cell weighted by row_weights[r, p, h] * col_weights[r, q, w] (float (R, g, H) and (R, g, W)): two
    Einsums, a one-hot of `batch` (the rois' int64 image indexes) picking the image."""
    planes = ctx.op("Reshape", [x, ctx.i64([0, dim, g, g, h, w])], "planes")
    by_cols = ctx.op("Einsum", [planes, col_weights], "cols", equation="nopqhw,rqw->nropqh")
    return ctx.op("Einsum", [by_cols, onnx_image_onehot(ctx, x, batch), row_weights], "sums",
                  equation="nropqh,rn,rph->ropq")


def onnx_image_onehot(ctx, x, batch):
    """(R, N) float: 1 where roi r's int64 batch index is image n of x (an index outside the batch: a row of 0)."""
    n = ctx.op("Squeeze", [ctx.op("Slice", [ctx.op("Shape", [x], "shape"), ctx.i64([0]), ctx.i64([1])], "n"),
                           ctx.i64([0])], "n")
    images = ctx.op("Range", [ctx.i64(0), n, ctx.i64(1)], "images")
    return ctx.op("Cast", [ctx.op("Equal", [ctx.op("Unsqueeze", [batch, ctx.i64([1])], "b"), images], "pick")],
                  "onehot", to=1)


def onnx_object_overlap(ctx, objects, scale, h, w, bins):
    """PSROIContextPooling's (R, 1, g, g) mask: bin (i, j) overlaps the first object box, whose corners are
    C-rounded (double), times spatial_scale in float32, floored (x1, y1) and ceiled (x2 + 1, y2 + 1), clipped
    to the map.  bins: the (lo, hi) float (R, g) bounds of the rows, then of the columns."""
    f32 = 1
    first = ctx.op("Slice", [ctx.op("Reshape", [objects, ctx.i64([-1, 5])], "objects"), ctx.i64([0, 1]),
                             ctx.i64([1, 5]), ctx.i64([0, 1])], "object")                      # (1, 4)
    rounded = onnx_c_round(ctx, first, in_double=True)
    plus = ctx.const(np.array([[0.0, 0.0, 1.0, 1.0]], np.float64))
    scaled = ctx.op("Mul", [ctx.op("Cast", [ctx.op("Add", [rounded, plus], "ends")], "object", to=f32),
                            ctx.f32(float(np.float32(scale)))], "scaled")
    low = ctx.op("Floor", [ctx.op("Slice", [scaled, ctx.i64([0]), ctx.i64([2]), ctx.i64([1])], "lo")], "lo")
    high = ctx.op("Ceil", [ctx.op("Slice", [scaled, ctx.i64([2]), ctx.i64([4]), ctx.i64([1])], "hi")], "hi")
    overlaps = []
    for axis, extent, (lo, hi) in ((1, h, bins[0]), (0, w, bins[1])):   # y then x
        bounds = (ctx.f32(0.0), ctx.f32(float(extent)))
        o0 = ctx.op("Clip", [ctx.op("Slice", [low, ctx.i64([axis]), ctx.i64([axis + 1]), ctx.i64([1])], "o0"),
                             *bounds], "o0")
        o1 = ctx.op("Clip", [ctx.op("Slice", [high, ctx.i64([axis]), ctx.i64([axis + 1]), ctx.i64([1])], "o1"),
                             *bounds], "o1")
        overlaps.append(ctx.op("And", [ctx.op("Less", [lo, o1], "before"), ctx.op("Greater", [hi, o0], "after")],
                               "overlap"))                                                   # (R, g)
    return ctx.op("Unsqueeze", [ctx.op("And", [ctx.op("Unsqueeze", [overlaps[0], ctx.i64([2])], "rows"),
                                               ctx.op("Unsqueeze", [overlaps[1], ctx.i64([1])], "cols")], "keep"),
                                ctx.i64([1])], "keep")
