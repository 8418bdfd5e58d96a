"""remodet's DetOut and DetectionOutput in ONNX: remodet.py's RemodetDetOut unrolled over the images and
classes.  Per class the candidates are TopK's (ties: the lower index first, as the fork's stable sort), the
greedy keep decisions a Scan over them (each suppressed by an earlier kept one at IoU >= / > nms_threshold),
and with FastVote each kept box the score-weighted mean of the boxes that voted for it (MatMul: the sums in
another order than the fork's loop, to float32 rounding), written back for the next class as the fork does."""
import numpy as np
from onnx import TensorProto, helper


def _decode(ctx, a, loc, prior, var):
    """remodet_decode: (P, 4) boxes."""
    def col(x, k):
        return ctx.op("Gather", [x, ctx.i64(k)], "c", axis=1)
    if not a["center"]:
        return ctx.op("Add", [prior, ctx.op("Mul", [var, loc], "vl")], "corners")
    pw = ctx.op("Sub", [col(prior, 2), col(prior, 0)], "pw")
    ph = ctx.op("Sub", [col(prior, 3), col(prior, 1)], "ph")
    pcx = ctx.op("Div", [ctx.op("Add", [col(prior, 0), col(prior, 2)], "sx"), ctx.f32(2.0)], "pcx")
    pcy = ctx.op("Div", [ctx.op("Add", [col(prior, 1), col(prior, 3)], "sy"), ctx.f32(2.0)], "pcy")

    def product(k, size):   # DetOut l * size * v, SSD's (remodet DetectionOutput) v * l * size
        if a["detection_output"]:
            return ctx.op("Mul", [ctx.op("Mul", [col(var, k), col(loc, k)], "vl"), size], "vls")
        return ctx.op("Mul", [ctx.op("Mul", [col(loc, k), size], "ls"), col(var, k)], "lsv")

    def exp_size(k, size):
        lv = ctx.op("Mul", [col(var, k), col(loc, k)] if a["detection_output"] else [col(loc, k), col(var, k)], "lv")
        return ctx.op("Mul", [ctx.op("Exp", [lv], "e"), size], "size")
    cx = ctx.op("Cast", [ctx.op("Add", [product(0, pw), pcx], "cx")], "cxd", to=11)
    cy = ctx.op("Cast", [ctx.op("Add", [product(1, ph), pcy], "cy")], "cyd", to=11)
    hw = ctx.op("Div", [ctx.op("Cast", [exp_size(2, pw)], "wd", to=11), ctx.const(np.array(2.0))], "hw")
    hh = ctx.op("Div", [ctx.op("Cast", [exp_size(3, ph)], "hd", to=11), ctx.const(np.array(2.0))], "hh")
    corners = [ctx.op("Sub", [cx, hw], "x0"), ctx.op("Sub", [cy, hh], "y0"), ctx.op("Add", [cx, hw], "x1"),
               ctx.op("Add", [cy, hh], "y1")]
    return ctx.op("Cast", [ctx.op("Concat", [ctx.op("Unsqueeze", [v, ctx.i64([1])], "u") for v in corners],
                                  "box", axis=1)], "boxes", to=1)


def _overlaps(ctx, a, boxes):
    """remodet_overlaps of every candidate pair (K, K) (both readings are symmetric)."""
    def col(k):
        return ctx.op("Gather", [boxes, ctx.i64(k)], "b", axis=1)
    x0, y0, x1, y1 = (col(k) for k in range(4))

    def pair(v):
        return ctx.op("Unsqueeze", [v, ctx.i64([1])], "vi"), ctx.op("Unsqueeze", [v, ctx.i64([0])], "vj")
    (x0i, x0j), (y0i, y0j), (x1i, x1j), (y1i, y1j) = pair(x0), pair(y0), pair(x1), pair(y1)
    iw = ctx.op("Sub", [ctx.op("Min", [x1i, x1j], "mx"), ctx.op("Max", [x0i, x0j], "nx")], "iw")
    ih = ctx.op("Sub", [ctx.op("Min", [y1i, y1j], "my"), ctx.op("Max", [y0i, y0j], "ny")], "ih")
    zero = ctx.f32(0.0)
    inter = ctx.op("Mul", [ctx.op("Max", [iw, zero], "iwp"), ctx.op("Max", [ih, zero], "ihp")], "inter")
    wide, high = ctx.op("Sub", [x1, x0], "w"), ctx.op("Sub", [y1, y0], "h")
    area = ctx.op("Mul", [wide, high], "area")
    if a["detection_output"]:   # SSD's BBoxSize: 0 for an inverted box; IoU 0 unless the boxes meet
        inverted = ctx.op("Or", [ctx.op("Less", [wide, zero], "wn"), ctx.op("Less", [high, zero], "hn")], "inv")
        area = ctx.op("Where", [inverted, zero, area], "size")
    ai, aj = pair(area)
    iou = ctx.op("Div", [inter, ctx.op("Sub", [ctx.op("Add", [ai, aj], "areas"), inter], "union")], "iou_raw")
    if a["detection_output"]:
        return ctx.op("Where", [ctx.op("Greater", [inter, zero], "meet"), iou, zero], "iou")
    return ctx.op("Where", [ctx.op("Less", [iou, zero], "neg"), zero, iou], "iou")


def _greedy_keep(ctx, node, suppresses, count):
    """The kept candidates (K,) bool: candidate i stays unless an earlier kept one suppresses it (suppresses:
    (K, K) bool, row i the candidates that would suppress i).  A Scan over the candidates, padded by one that
    nothing suppresses (onnxruntime refuses a Scan of 0 steps)."""
    padded = ctx.op("Pad", [suppresses, ctx.i64([0, 0, 1, 1])], "sup_pad")
    steps = ctx.op("Add", [count, ctx.i64([1])], "steps")
    ids = ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [steps, ctx.i64([0])], "n"), ctx.i64(1)], "ids")
    body = []

    def b(op_type, inputs, hint, **kw):
        return ctx.body_op(body, op_type, inputs, hint, **kw)
    kept_in, it, row = (ctx.tmp(f"{node.name}_{h}") for h in ("kept_in", "it", "row"))
    suppressed = b("ReduceMax", [b("Cast", [b("And", [kept_in, row], "hits")], "hitsf", to=TensorProto.FLOAT)],
                   "suppressed", keepdims=0)
    stays = b("Equal", [suppressed, ctx.body_const(body, np.float32(0.0), "zero")], "stays")
    kept_out = b("Or", [kept_in, b("And", [b("Equal", [ids, it], "is_i"), stays], "keep_i")], "kept_out")
    graph = helper.make_graph(body, f"{node.name}_keep_step",
                              [helper.make_tensor_value_info(kept_in, TensorProto.BOOL, [None]),
                               helper.make_tensor_value_info(it, TensorProto.INT64, []),
                               helper.make_tensor_value_info(row, TensorProto.BOOL, [None])],
                              [helper.make_tensor_value_info(kept_out, TensorProto.BOOL, [None])])
    kept0 = ctx.op("ConstantOfShape", [steps], "kept0", value=np.array([False]))
    kept = ctx.add_node("Scan", [kept0, ids, padded], [ctx.tmp(f"{node.name}_kept")], body=graph,
                        num_scan_inputs=2)[0]
    return ctx.op("Slice", [kept, ctx.i64([0]), count, ctx.i64([0])], "kept_k")


def emit_remodet_detections(ctx, node):
    a = node.attrs
    loc, conf, prior = node.inputs[:3]
    n = ctx.shape(conf)[0]
    c = a["num_classes"]
    num_priors = ctx.shape(prior)[2] // 4
    width = a["width"]
    pr = ctx.op("Reshape", [prior, ctx.i64([2, num_priors, 4])], "priors")
    pbox = ctx.op("Gather", [pr, ctx.i64(0)], "pbox", axis=0)
    pvar = ctx.op("Gather", [pr, ctx.i64(1)], "pvar", axis=0)
    if a["variance_in_target"]:
        pvar = ctx.const(np.ones((num_priors, 4), np.float32))
    flat = ctx.op("Reshape", [loc, ctx.i64([-1])], "flat_loc")
    scores_all = ctx.op("Reshape", [conf, ctx.i64([n, num_priors, c])], "scores")
    top_k = min(a["top_k"], num_priors)
    tri = ctx.const(np.tril(np.ones((top_k, top_k), bool), -1))   # [i, k]: k before i
    rows = []
    for i in range(n):
        image_loc = ctx.op("Reshape", [ctx.op("Slice", [flat, ctx.i64([i * num_priors * 4]),
                                                        ctx.i64([(i + 1) * num_priors * 4]), ctx.i64([0])], "li"),
                                       ctx.i64([num_priors, 4])], "loc_i")
        boxes = _decode(ctx, a, image_loc, pbox, pvar)
        for j in ([1] if a["detection_output"] else range(1, c)):
            s = ctx.op("Gather", [ctx.op("Gather", [scores_all, ctx.i64(i)], "si", axis=0), ctx.i64(j)], "s", axis=1)
            above = ctx.op("Greater", [s, ctx.f32(a["conf_threshold"])], "above")
            count = ctx.op("Min", [ctx.op("ReduceSum", [ctx.op("Cast", [above], "af", to=7), ctx.i64([0])], "cnt",
                                          keepdims=1), ctx.i64([top_k])], "count")
            masked = ctx.op("Where", [above, s, ctx.f32(-np.inf)], "masked")
            best, order = ctx.add_node("TopK", [masked, ctx.i64([top_k])], [ctx.tmp("best"), ctx.tmp("order")],
                                       axis=0, largest=1, sorted=1)
            order = ctx.op("Slice", [order, ctx.i64([0]), count, ctx.i64([0])], "cand")
            cand_s = ctx.op("Slice", [best, ctx.i64([0]), count, ctx.i64([0])], "cand_s")
            cand_b = ctx.op("Gather", [boxes, order], "cand_b", axis=0)
            iou = _overlaps(ctx, a, cand_b)
            over = ctx.op("Greater" if a["nms"] == "Fast" else "GreaterOrEqual", [iou, ctx.f32(a["nms_threshold"])],
                          "over")
            tri_k = ctx.op("Slice", [ctx.op("Slice", [tri, ctx.i64([0]), count, ctx.i64([0])], "tri_r"), ctx.i64([0]),
                                     count, ctx.i64([1])], "tri_k")
            kept = _greedy_keep(ctx, node, ctx.op("And", [over, tri_k], "sup"), count)
            kept_idx = ctx.op("Compress", [order, kept], "kept_idx", axis=0)   # the kept priors, in NMS order
            if a["nms"] == "FastVote":   # votes [k, i]: kept k, i = k or an earlier-kept k overlapping i >= 0.75
                close = ctx.op("And", [ctx.op("GreaterOrEqual", [iou, ctx.f32(0.75)], "close"),
                                       ctx.op("Transpose", [tri_k], "before", perm=[1, 0])], "close_b")
                eye = ctx.op("Cast", [ctx.op("EyeLike", [ctx.op("Cast", [iou], "iouf", to=1)], "eye")], "eyeb", to=9)
                votes = ctx.op("And", [ctx.op("Or", [close, eye], "vote_any"),
                                       ctx.op("Unsqueeze", [kept, ctx.i64([1])], "kept_col")], "votes")
                weights = ctx.op("Mul", [ctx.op("Cast", [votes], "vf", to=1),
                                         ctx.op("Unsqueeze", [cand_s, ctx.i64([0])], "s_row")], "vw")
                total = ctx.op("ReduceSum", [weights, ctx.i64([1])], "total", keepdims=1)
                safe = ctx.op("Where", [ctx.op("Greater", [total, ctx.f32(0.0)], "some"), total, ctx.f32(1.0)], "safe")
                voted = ctx.op("MatMul", [ctx.op("Div", [weights, safe], "scale"), cand_b], "voted")
                boxes = ctx.op("ScatterND", [boxes, ctx.op("Unsqueeze", [kept_idx, ctx.i64([1])], "ki"),
                                             ctx.op("Compress", [voted, kept], "kept_v", axis=0)], "boxes_voted")
            box = ctx.op("Clip", [ctx.op("Gather", [boxes, kept_idx], "kb", axis=0), ctx.f32(0.0), ctx.f32(1.0)], "clip")
            score = ctx.op("Compress", [cand_s, kept], "ks", axis=0)
            if not a["detection_output"]:   # DetOut drops the boxes whose clipped area is below size_threshold
                def bc(k):
                    return ctx.op("Gather", [box, ctx.i64(k)], "bc", axis=1)
                area = ctx.op("Mul", [ctx.op("Sub", [bc(2), bc(0)], "bw"), ctx.op("Sub", [bc(3), bc(1)], "bh")], "ka")
                big = ctx.op("Not", [ctx.op("Less", [area, ctx.f32(a["size_threshold"])], "small")], "big")
                box, score, kept_idx = (ctx.op("Compress", [v, big], "sized", axis=0) for v in (box, score, kept_idx))
            label = 1 if a["detection_output"] else (a["target_labels"][j - 1] if a["target_labels"]
                                                     else j - 1 + a["alias_id"])
            ones = ctx.op("Unsqueeze", [ctx.op("Mul", [score, ctx.f32(0.0)], "zeros"), ctx.i64([1])], "zc")
            columns = [ctx.op("Add", [ones, ctx.f32(float(i))], "img"), ctx.op("Add", [ones, ctx.f32(float(label))], "lab"),
                       ctx.op("Unsqueeze", [score, ctx.i64([1])], "sc"), box]
            if width == 8:
                columns.append(ctx.op("Unsqueeze", [ctx.op("Cast", [kept_idx], "pid", to=1), ctx.i64([1])], "pidc"))
            rows.append(ctx.op("Concat", columns, "rows", axis=1))
    everything = rows[0] if len(rows) == 1 else ctx.op("Concat", rows, "all_rows", axis=0)
    count = ctx.op("Shape", [everything], "r", start=0, end=1)
    none = ctx.op("Cast", [ctx.op("Equal", [count, ctx.i64([0])], "none_b")], "none", to=7)
    padded = ctx.op("Concat", [everything, ctx.const(np.full((1, width), -1.0, np.float32))], "with_fallback", axis=0)
    picked = ctx.op("Slice", [padded, ctx.i64([0]), ctx.op("Add", [count, none], "end"), ctx.i64([0])], "picked")
    ctx.add_node("Reshape", [picked, ctx.i64([1, 1, -1, width])], [node.outputs[0]], name=node.name)

