"""ONNX for Apollo's perception layers (caffeq/layers/apollo.py): the same steps as the torch
functions there, in the same float32 (and, where the kernels use double, float64) order."""
import numpy as np

from .norm import onnx_reduce

# ---- DFMBPSROIAlign as ONNX ops: dfmb_psroi_align step for step, the samples gathered from the flat map --

def emit_dfmb_psroi_align(ctx, node):
    a = node.attrs
    name = node.name
    n, channels, height, width = ctx.shape(node.inputs[0])
    r = ctx.shape(node.inputs[1])[0]
    dim, ph_n, pw_n, spp = a["output_dim"], a["pooled_height"], a["pooled_width"], a["sample_per_part"]
    gh_n, gw_n = a["group_height"], a["group_width"]

    def trunc(v, hint):   # C's float-to-int conversion, kept as a float
        return ctx.op("Where", [ctx.op("Less", [v, ctx.f32(0.0)], hint + "_neg"), ctx.op("Ceil", [v], hint + "_up"),
                                ctx.op("Floor", [v], hint + "_down")], hint)

    rois = ctx.op("Reshape", [node.inputs[1], ctx.i64([r, -1])], "rois")
    col = [ctx.op("Reshape", [ctx.op("Gather", [rois, ctx.i64(k)], f"c{k}", axis=1), ctx.i64([r, 1, 1, 1])], f"roi{k}")
           for k in range(5)]
    b = trunc(col[0], "b")
    live = ctx.op("And", [ctx.op("GreaterOrEqual", [b, ctx.f32(0.0)], "b_ge0"),
                          ctx.op("Less", [b, ctx.f32(float(n))], "b_ltn")], "live")
    one, pad, hb, ha = ctx.f32(1.0), ctx.f32(a["pad_ratio"]), ctx.f32(a["heat_map_b"]), ctx.f32(a["heat_map_a"])
    pad_w = ctx.op("Mul", [ctx.op("Add", [ctx.op("Sub", [col[3], col[1]], "w0"), one], "w1"), pad], "pad_w")
    pad_h = ctx.op("Mul", [ctx.op("Add", [ctx.op("Sub", [col[4], col[2]], "h0"), one], "h1"), pad], "pad_h")
    start_w = ctx.op("Div", [ctx.op("Sub", [ctx.op("Sub", [col[1], pad_w], "sw0"), hb], "sw1"), ha], "start_w")
    start_h = ctx.op("Div", [ctx.op("Sub", [ctx.op("Sub", [col[2], pad_h], "sh0"), hb], "sh1"), ha], "start_h")
    end_w = ctx.op("Div", [ctx.op("Sub", [ctx.op("Add", [col[3], pad_w], "ew0"), hb], "ew1"), ha], "end_w")
    end_h = ctx.op("Div", [ctx.op("Sub", [ctx.op("Add", [col[4], pad_h], "eh0"), hb], "eh1"), ha], "end_h")
    roi_w = ctx.op("Max", [ctx.op("Sub", [end_w, start_w], "rw0"), ctx.f32(0.1)], "roi_w")
    roi_h = ctx.op("Max", [ctx.op("Sub", [end_h, start_h], "rh0"), ctx.f32(0.1)], "roi_h")
    bin_w = ctx.op("Div", [roi_w, ctx.f32(float(pw_n))], "bin_w")
    bin_h = ctx.op("Div", [roi_h, ctx.f32(float(ph_n))], "bin_h")
    sub_w = ctx.op("Div", [bin_w, ctx.f32(float(spp))], "sub_w")
    sub_h = ctx.op("Div", [bin_h, ctx.f32(float(spp))], "sub_h")
    ph = np.arange(ph_n, dtype=np.float32)
    pw = np.arange(pw_n, dtype=np.float32)
    hstart = ctx.op("Add", [ctx.op("Mul", [ctx.f32(ph.reshape(1, 1, ph_n, 1)), bin_h], "hs0"), start_h], "hs1")
    wstart = ctx.op("Add", [ctx.op("Mul", [ctx.f32(pw.reshape(1, 1, 1, pw_n)), bin_w], "ws0"), start_w], "ws1")
    if len(node.inputs) == 3:
        classes = ctx.shape(node.inputs[2])[1] // 2
        part_h = np.trunc(ph / np.float32(ph_n) * np.float32(a["part_height"])).astype(np.int64)
        part_w = np.trunc(pw / np.float32(pw_n) * np.float32(a["part_width"])).astype(np.int64)
        cls = np.arange(dim) // (dim // classes)
        at = lambda k: ((((cls * 2 + k)[:, None, None] * a["part_height"] + part_h[None, :, None])   # noqa: E731
                         * a["part_width"]) + part_w[None, None, :])
        t = ctx.op("Reshape", [ctx.op("Slice", [node.inputs[2], ctx.i64([0]), ctx.i64([r]), ctx.i64([0])], "t_r"),
                               ctx.i64([r, -1])], "t")
        std = ctx.f32(a["trans_std"])
        trans_x = ctx.op("Mul", [ctx.op("Gather", [t, ctx.i64(at(0))], "tx0", axis=1), std], "trans_x")
        trans_y = ctx.op("Mul", [ctx.op("Gather", [t, ctx.i64(at(1))], "ty0", axis=1), std], "trans_y")
        hstart = ctx.op("Add", [hstart, ctx.op("Mul", [trans_y, roi_h], "ty_r")], "hs2")
        wstart = ctx.op("Add", [wstart, ctx.op("Mul", [trans_x, roi_w], "tx_r")], "ws2")
    shape = ctx.i64([r, dim, ph_n, pw_n, 1, 1])
    hstart = ctx.op("Reshape",
                    [ctx.op("Expand", [trunc(hstart, "hst"), ctx.i64([r, dim, ph_n, pw_n])], "hse"), shape], "hstart")
    wstart = ctx.op("Reshape",
                    [ctx.op("Expand", [trunc(wstart, "wst"), ctx.i64([r, dim, ph_n, pw_n])], "wse"), shape], "wstart")
    off = np.arange(spp, dtype=np.float64) + 0.5
    as6 = ctx.i64([r, 1, 1, 1, 1, 1])
    dbl = lambda v, hint: ctx.op("Cast", [v], hint, to=11)   # noqa: E731  DOUBLE
    hs = ctx.op("Cast", [ctx.op("Add", [dbl(hstart, "hs_d"), ctx.op("Mul", [ctx.const(off.reshape(spp, 1)),
                                                               ctx.op("Reshape", [dbl(sub_h, "sh_d"), as6], "sh6")],
                                                         "hoff")], "hs_sum")], "hs", to=1)
    ws = ctx.op("Cast", [ctx.op("Add", [dbl(wstart, "ws_d"), ctx.op("Mul", [ctx.const(off.reshape(1, spp)),
                                                               ctx.op("Reshape", [dbl(sub_w, "sw_d"), as6], "sw6")],
                                                         "woff")], "ws_sum")], "ws", to=1)
    full = ctx.i64([r, dim, ph_n, pw_n, spp, spp])
    hs, ws = ctx.op("Expand", [hs, full], "hs_all"), ctx.op("Expand", [ws, full], "ws_all")
    outside = ctx.op("Or", [ctx.op("Or", [ctx.op("LessOrEqual", [ws, ctx.f32(-1.0)], "w_lo"),
                                          ctx.op("GreaterOrEqual", [ws, ctx.f32(float(width))], "w_hi")], "w_out"),
                            ctx.op("Or", [ctx.op("LessOrEqual", [hs, ctx.f32(-1.0)], "h_lo"),
                                          ctx.op("GreaterOrEqual", [hs, ctx.f32(float(height))], "h_hi")], "h_out")],
                     "outside")
    gh = np.clip(np.floor(ph * np.float32(gh_n) / np.float32(ph_n)).astype(np.int64), 0, gh_n - 1)
    gw = np.clip(np.floor(pw * np.float32(gw_n) / np.float32(pw_n)).astype(np.int64), 0, gw_n - 1)
    chan = (np.arange(dim)[:, None, None] * gh_n + gh[None, :, None]) * gw_n + gw[None, None, :]
    b_idx = ctx.op("Cast", [ctx.op("Clip", [b, ctx.f32(0.0), ctx.f32(float(n - 1))], "b_clip")], "b_i", to=7)
    base = ctx.op("Mul", [ctx.op("Add", [ctx.op("Mul", [b_idx, ctx.i64(channels)], "b_c"), ctx.i64(chan[None])], "bc"),
                          ctx.i64(height * width)], "base0")
    base = ctx.op("Reshape", [base, shape], "base")
    flat = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "flat")
    x1, y1 = ctx.op("Floor", [ws], "x1"), ctx.op("Floor", [hs], "y1")
    x2, y2 = ctx.op("Ceil", [ws], "x2"), ctx.op("Ceil", [hs], "y2")
    dx, dy = ctx.op("Sub", [ws, x1], "dx"), ctx.op("Sub", [hs, y1], "dy")
    zero = ctx.f32(0.0)

    def corner(xc, yc, hint):
        ok = ctx.op("And", [ctx.op("And", [ctx.op("GreaterOrEqual", [xc, zero], hint + "_x0"),
                                           ctx.op("Less", [xc, ctx.f32(float(width))], hint + "_xw")], hint + "_x"),
                            ctx.op("And", [ctx.op("GreaterOrEqual", [yc, zero], hint + "_y0"),
                                           ctx.op("Less", [yc, ctx.f32(float(height))], hint + "_yh")], hint + "_y")],
                    hint + "_ok")
        pos = ctx.op("Add", [ctx.op("Mul", [ctx.op("Clip", [yc, zero, ctx.f32(float(height - 1))], hint + "_yc"),
                                            ctx.f32(float(width))], hint + "_row"),
                             ctx.op("Clip", [xc, zero, ctx.f32(float(width - 1))], hint + "_xc")], hint + "_pos")
        idx = ctx.op("Add", [base, ctx.op("Cast", [pos], hint + "_posi", to=7)], hint + "_idx")
        return ctx.op("Where", [ok, ctx.op("Gather", [flat, idx], hint + "_v", axis=0), zero], hint)

    ux, uy = ctx.op("Sub", [one, dx], "ux"), ctx.op("Sub", [one, dy], "uy")
    terms = [ctx.op("Mul", [ctx.op("Mul", [wx, wy], f"w{k}"), corner(cx, cy, f"c{k}")], f"t{k}")
             for k, (wx, wy, cx, cy) in enumerate(((ux, uy, x1, y1), (ux, dy, x1, y2), (dx, uy, x2, y1),
                                                   (dx, dy, x2, y2)))]
    value = ctx.op("Add",
                   [ctx.op("Add", [ctx.op("Add", [terms[0], terms[1]], "s01"), terms[2]], "s012"), terms[3]], "value")
    value = ctx.op("Where", [outside, zero, value], "taken")
    total = onnx_reduce(ctx, "ReduceSum", value, [4, 5], False, ctx.tmp(name + "_total"))
    count = onnx_reduce(ctx, "ReduceSum", ctx.op("Cast", [ctx.op("Not", [outside], "inside")], "inside_f", to=1),
                        [4, 5], False, ctx.tmp(name + "_count"))
    mean = ctx.op("Div", [total, ctx.op("Max", [count, one], "count1")], "mean")
    mean = ctx.op("Where", [ctx.op("Equal", [count, zero], "none"), zero, mean], "pooled")
    ctx.add_node("Where", [live, mean, zero], [node.outputs[0]], name=name)


# ---- the proposals: filters as elementwise ops, TopK, NonMaxSuppression, rows padded with -1 ----------

FLT_MAX = float(np.finfo(np.float32).max)


class _Ops:
    """The context's node helpers as op(type, inputs, hint, **attrs) -> output name, op.i64 and op.f32
    (OnnxContext.op/i64/f32), with shorthands built on them."""

    def __init__(self, ctx, name):
        self.ctx, self.name, self.i64, self.f32 = ctx, name, ctx.i64, ctx.f32

    def __call__(self, op_type, inputs, hint, **kw):
        return self.ctx.op(op_type, inputs, hint, **kw)

    def col(self, x, k, hint):   # x[:, k]
        return self("Gather", [x, self.i64(k)], hint, axis=1)

    def trunc(self, v, hint):
        return self("Where", [self("Less", [v, self.f32(0.0)], hint + "_neg"), self("Ceil", [v], hint + "_up"),
                              self("Floor", [v], hint + "_down")], hint)


def _decode(op, x1, y1, w, h, deltas):
    """apollo_decode's corners from the box's x1, y1, sizes (broadcasting) and deltas (..., 4)."""
    half = op.f32(0.5)
    one = op.f32(1.0)
    cx = op("Add", [x1, op("Mul", [half, op("Sub", [w, one], "w1")], "hw")], "cx")
    cy = op("Add", [y1, op("Mul", [half, op("Sub", [h, one], "h1")], "hh")], "cy")
    d = [op("Gather", [deltas, op.i64(k)], f"d{k}", axis=-1) for k in range(4)]
    px = op("Add", [op("Mul", [d[0], w], "dxw"), cx], "px")
    py = op("Add", [op("Mul", [d[1], h], "dyh"), cy], "py")
    pw = op("Mul", [op("Exp", [d[2]], "ew"), w], "pw")
    ph = op("Mul", [op("Exp", [d[3]], "eh"), h], "ph")
    hw = op("Mul", [half, op("Sub", [pw, one], "pw1")], "phw")
    hh = op("Mul", [half, op("Sub", [ph, one], "ph1")], "phh")
    return [op("Sub", [px, hw], "bx1"), op("Sub", [py, hh], "by1"), op("Add", [px, hw], "bx2"),
            op("Add", [py, hh], "by2")]


def _clip(op, corners, height, width):
    """apollo_clip: v < 0 -> 0, v > size - 1 -> size - 1."""
    zero, one = op.f32(0.0), op.f32(1.0)
    top_x, top_y = op("Sub", [width, one], "top_x"), op("Sub", [height, one], "top_y")
    out = []
    for k, v in enumerate(corners):
        top = top_x if k % 2 == 0 else top_y
        out.append(op("Where", [op("Less", [v, zero], f"lo{k}"), zero,
                                op("Where", [op("Greater", [v, top], f"hi{k}"), top, v], f"cap{k}")], f"clip{k}"))
    return out


def _size_ok(op, corners, mode, min_h, min_w):
    one = op.f32(1.0)
    w = op("Add", [op("Sub", [corners[2], corners[0]], "sw0"), one], "sw")
    h = op("Add", [op("Sub", [corners[3], corners[1]], "sh0"), one], "sh")
    low, narrow = op("Less", [h, op.f32(min_h)], "low"), op("Less", [w, op.f32(min_w)], "narrow")
    return op("Not", [op("Or" if mode == 0 else "And", [low, narrow], "small")], "big_enough")


def _nms_rows(op, node, boxes, scores, extra, count, a):
    """The best max_candidate_n of `count` scored boxes (dropped ones score -inf), NMS (IoU > overlap_ratio
    with +1 pixel sizes: boxes given as [y1, x1, y2 + 1, x2 + 1]), the first top_n as rows
    [0, x1, y1, x2, y2 (, extra)], then -1 rows up to top_n, shaped (top_n, columns, 1, 1)."""
    ctx = op.ctx
    k = min(a["max_candidate_n"], count)
    vals, idx = ctx.add_node("TopK", [scores, op.i64([k])], [ctx.tmp(f"{op.name}_top"), ctx.tmp(f"{op.name}_idx")],
                             axis=0, largest=1, sorted=1)
    cand = op("Gather", [boxes, idx], "cand", axis=0)
    plus = op.f32(np.array([0, 0, 1, 1], np.float32))
    yx = op("Gather", [op("Add", [cand, plus], "cand1"), op.i64([1, 0, 3, 2])], "yx", axis=1)
    sel = op("NonMaxSuppression", [op("Unsqueeze", [yx, op.i64([0])], "nms_b"),
                                   op("Reshape", [vals, op.i64([1, 1, -1])], "nms_s"),
                                   op.i64([a["top_n"]]), op.f32([ctx.nms_threshold(a["overlap_ratio"])]), op.f32([-FLT_MAX])], "sel")
    picked = op("Gather", [sel, op.i64(2)], "picked", axis=1)
    parts = [op("Gather", [cand, picked], "chosen", axis=0)]
    if extra is not None:
        parts.append(op("Gather", [op("Gather", [extra, idx], "cand_x", axis=0), picked], "chosen_x", axis=0))
    cols = 5 + (0 if extra is None else ctx.shape(node.inputs[0])[1])
    from onnx import numpy_helper
    zeros = op("ConstantOfShape", [op("Concat", [op("Shape", [picked], "n"), op.i64([1])], "z_shape", axis=0)],
               "zeros", value=numpy_helper.from_array(np.zeros(1, np.float32)))
    rows = op("Concat", [zeros, *parts, ], "rows", axis=1)
    pad = op.ctx.const(np.full((a["top_n"], cols), -1, np.float32))
    padded = op("Slice", [op("Concat", [rows, pad], "padded", axis=0), op.i64([0]), op.i64([a["top_n"]]),
                          op.i64([0])], "first")
    ctx.add_node("Reshape", [padded, op.i64([a["top_n"], cols, 1, 1])], [node.outputs[0]], name=node.name)


def emit_rpn_proposal_ssd(ctx, node, anchors):
    """ApolloRPNProposalSSD for one image; anchors: the (H W A, 4) float32 array the module makes."""
    a = node.attrs
    op = _Ops(ctx, node.name)
    prob, deltas, info = node.inputs
    n_anchor = len(a["anchor_widths"])
    count = anchors.shape[0]
    one = np.float32(1)
    w = anchors[:, 2] - anchors[:, 0] + one
    h = anchors[:, 3] - anchors[:, 1] + one
    scores = op("Slice", [prob, op.i64([n_anchor]), op.i64([2 * n_anchor]), op.i64([1])], "fg")
    scores = op("Reshape", [op("Transpose", [scores], "fg_t", perm=[0, 2, 3, 1]), op.i64([-1])], "scores")
    d = op("Reshape", [op("Transpose", [deltas], "d_t", perm=[0, 2, 3, 1]), op.i64([-1, 4])], "deltas")
    d = op("Add", [op("Mul", [d, op.f32(a["bbox_std"])], "d_std"), op.f32(a["bbox_mean"])], "d_norm")
    corners = _decode(op, op.f32(anchors[:, 0]), op.f32(anchors[:, 1]), op.f32(w), op.f32(h), d)
    if a["refine"]:
        flat = op("Reshape", [info, op.i64([-1])], "info")
        height = op.trunc(op("Gather", [flat, op.i64(0)], "im_h0", axis=0), "im_h")
        width = op.trunc(op("Gather", [flat, op.i64(1)], "im_w0", axis=0), "im_w")
        corners = _clip(op, corners, height, width)
    keep = op("And", [op("Greater", [scores, op.f32(a["threshold_objectness"])], "objectness"),
                      _size_ok(op, corners, a["min_size_mode"], a["min_size_h"], a["min_size_w"])], "keep")
    live = op("Where", [keep, scores, op.f32(-np.inf)], "live")
    boxes = op("Concat", [op("Unsqueeze", [c, op.i64([1])], f"corner{k}") for k, c in enumerate(corners)], "boxes",
               axis=1)
    _nms_rows(op, node, boxes, live, None, count, a)


def emit_rcnn_proposal(ctx, node):
    """ApolloRCNNProposal for one image."""
    a = node.attrs
    op = _Ops(ctx, node.name)
    prob_in, bbox_in, rois_in, info = node.inputs
    r = ctx.shape(rois_in)[0]
    k = a["num_class"] + 1
    probs = op("Reshape", [prob_in, op.i64([r, k])], "probs")
    d = op("Reshape", [bbox_in, op.i64([r, k, 4])], "deltas")
    d = op("Add", [op("Mul", [d, op.f32(a["bbox_std"])], "d_std"), op.f32(a["bbox_mean"])], "d_norm")
    rois = op("Reshape", [rois_in, op.i64([r, 5])], "rois")
    c = [op("Unsqueeze", [op.col(rois, j, f"r{j}"), op.i64([1])], f"roi{j}") for j in range(5)]   # (R, 1)
    one = op.f32(1.0)
    w = op("Add", [op("Sub", [c[3], c[1]], "rw0"), one], "rw")
    h = op("Add", [op("Sub", [c[4], c[2]], "rh0"), one], "rh")
    corners = _decode(op, c[1], c[2], w, h, d)                                                     # (R, K) each
    if a["refine"]:
        flat = op("Reshape", [info, op.i64([-1])], "info")
        corners = _clip(op, corners, op("Gather", [flat, op.i64(0)], "im_h", axis=0),
                        op("Gather", [flat, op.i64(1)], "im_w", axis=0))
    # image 0's count of rois, read from the first rows
    first = op("Equal", [op.trunc(op.col(rois, 0, "b0"), "b"), op.f32(0.0)], "image0")
    n = op("ReduceSum", [op("Cast", [first, ], "image0_i", to=7), op.i64([0])], "n", keepdims=1)
    rows_ok = op("Less", [op.i64(np.arange(r)), n], "rows_ok")
    margin = op("Sub", [op("Slice", [probs, op.i64([1]), op.i64([k]), op.i64([1])], "fg"),
                        op.f32(a["thresholds"])], "margin")
    best = op("ReduceMax", [margin], "best", axes=[1], keepdims=0) if ctx.opset < 18 else \
        op("ReduceMax", [margin, op.i64([1])], "best", keepdims=0)
    cls = op("Add", [op("ArgMax", [margin], "cls0", axis=1, keepdims=1), op.i64(1)], "cls")       # (R, 1)
    bg = op.col(probs, 0, "bg")
    keep = op("And", [op("Not", [op("Less", [op("Sub", [one, bg], "fg_all"), op.f32(a["threshold_objectness"])],
                                        "weak")], "objectness"),
                      op("Not", [op("Less", [best, op.f32(0.0)], "below")], "passes")], "keep1")
    keep = op("And", [keep, rows_ok], "keep2")
    picked = [op("Squeeze", [op("GatherElements", [v, cls], f"pick{j}", axis=1), op.i64([1])], f"box{j}")
              for j, v in enumerate(corners)]
    score = op("Squeeze", [op("GatherElements", [probs, cls], "score1", axis=1), op.i64([1])], "score")
    keep = op("And", [keep, op("And", [op("Greater", [score, op.f32(0.0)], "positive"),
                                       _size_ok(op, picked, a["min_size_mode"], a["min_size_h"], a["min_size_w"])],
                               "kept_boxes")], "keep")
    live = op("Where", [keep, score, op.f32(-np.inf)], "live")
    boxes = op("Concat", [op("Unsqueeze", [v, op.i64([1])], f"b{j}") for j, v in enumerate(picked)], "boxes", axis=1)
    _nms_rows(op, node, boxes, live, probs if a["output_score"] else None, r, a)
