"""DetectionOutput as standard ONNX ops, giving SSD's (and TextBoxes++'s) rows in SSD's order."""
import numpy as np

from ...errors import ExportError
from .common import CENTER_SIZE, CORNER, CORNER_SIZE, FLT_MAX, emit_detection_top
from .common import scalar_tensor as _scalar_tensor


def emit_detection_output(ctx, node, inputs=None, n_priors=None):
    """DetectionOutput from standard ops, giving SSD's rows in SSD's order.

    Per class, TopK keeps SSD's top_k best candidates (ties: lower prior first, as
    SSD's stable sort), NonMaxSuppression runs on them (ORT keeps score > threshold
    and suppresses IoU > threshold, as SSD), keep_top_k is a TopK over each image's
    survivors, and NonZero over the (image, class, rank) mask lists the rows in
    SSD's order.  With no detection the graph returns SSD's one [i, -1, ...] row
    per image.  Only eta < 1 (adaptive NMS) has no ONNX form.  TextBoxes++'s
    quadrilaterals / rotated boxes ride along with their boxes as extra columns.  RefineDet's
    arm conf replaces the scores of empty anchors by (1, 0, ...) with a Where, and its arm loc
    is decoded against the priors first (boxes (N, 1, P, 4)), loc then against those.
    """
    a = node.attrs
    if a["eta"] < 1:
        raise ExportError(f"layer '{node.name}' (DetectionOutput): nms_param.eta {a['eta']} < 1 "
                          f"(adaptive NMS) has no ONNX form")
    # inputs, n_priors: synopsys-caffe's per-level bottoms, already gathered (detection_levels.py), or
    # chris-512/caffe-refinedet's combined bottoms, already split (loc, conf, priors, arm conf, arm loc)
    ins = list(inputs or node.inputs)
    loc_in, conf_in, prior_in = ins[:3]   # a 4th input (the images) is not read
    arm = a.get("arm", 0)                          # RefineDet: arm conf, then arm loc
    P = ctx.shape(prior_in)[-1] // 4 if n_priors is None else n_priors
    C = a["num_classes"]
    L = 1 if a["share_location"] else C
    cls = [c for c in range(C) if c != a["background"]]
    K = len(cls)
    if K == 0:
        raise ExportError(f"layer '{node.name}' (DetectionOutput): no class besides the background")
    T = P if a["top_k"] < 0 else min(a["top_k"], P)
    name = node.name
    pixel = a.get("opencv_pixel", False)   # OpenCV's normalized_bbox: false (detection_output.py)

    def last(x, k, hint):   # x[..., k:k+1]
        return ctx.op("Slice", [x, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([-1])], hint)

    # priors: boxes and variances (P, 4), from the first item as SSD does
    pr = ctx.op("Slice", [prior_in, ctx.i64([0]), ctx.i64([1]), ctx.i64([0])], "prior0")
    # OpenCV's pixel priors have no variance row with variance_encoded_in_target
    pr = ctx.op("Reshape", [pr, ctx.i64([1 if pixel and a["variance_in_target"] else 2, P, 4])], "prior")
    pbox = ctx.op("Gather", [pr, ctx.i64(0)], "pbox", axis=0)
    pvar = ctx.f32(np.ones((P, 4), np.float32)) if a["variance_in_target"] else ctx.op("Gather",
                                                                                       [pr, ctx.i64(1)], "pvar", axis=0)
    # loc (N, L, P, 4 + extra)
    layout = a.get("layout", "")
    W = 4 + {"": 0, "rbox": 5, "quad": 8}[layout]
    loc_all = ctx.op("Reshape", [loc_in, ctx.i64([0, P, L, W])], "loc")
    loc_all = ctx.op("Transpose", [loc_all], "loc_t", perm=[0, 2, 1, 3])
    loc = ctx.op("Slice", [loc_all, ctx.i64([0]), ctx.i64([4]), ctx.i64([-1])], "loc_box") if layout else loc_all
    code = a["code_type"]

    def decode(loc, pbox, pre=""):
        """SSD's DecodeBBox of loc against pbox; (the prior's x0, y0, x1, y1, w, h, cx, cy) too."""
        if code == CORNER:
            return ctx.op("Add", [pbox, ctx.op("Mul", [pvar, loc], pre + "vl")], pre + "dec"), None
        px0, py0, px1, py1 = (last(pbox, k, f"{pre}p{k}") for k in range(4))
        pw = ctx.op("Sub", [px1, px0], pre + "pw")
        ph = ctx.op("Sub", [py1, py0], pre + "ph")
        vl = ctx.op("Mul", [pvar, loc], pre + "vl")
        if code == CORNER_SIZE:
            size = ctx.op("Concat", [pw, ph, pw, ph], pre + "psize", axis=-1)
            return ctx.op("Add",
                          [pbox, ctx.op("Mul", [vl, size], pre + "vls")], pre + "dec"), (px0, py0, px1, py1, pw, ph)
        half = ctx.f32(0.5)
        if pixel:   # OpenCV's pixel sizes (+ 1) and centre xmin + width / 2
            pw = ctx.op("Add", [pw, ctx.f32(1.0)], pre + "pw1")
            ph = ctx.op("Add", [ph, ctx.f32(1.0)], pre + "ph1")
            pcx = ctx.op("Add", [px0, ctx.op("Mul", [pw, half], pre + "hpw")], pre + "pcx")
            pcy = ctx.op("Add", [py0, ctx.op("Mul", [ph, half], pre + "hph")], pre + "pcy")
        else:
            pcx = ctx.op("Mul", [ctx.op("Add", [px0, px1], pre + "pxs"), half], pre + "pcx")
            pcy = ctx.op("Mul", [ctx.op("Add", [py0, py1], pre + "pys"), half], pre + "pcy")
        cx = ctx.op("Add", [ctx.op("Mul", [last(vl, 0, pre + "v0"), pw], pre + "dx"), pcx], pre + "cx")
        cy = ctx.op("Add", [ctx.op("Mul", [last(vl, 1, pre + "v1"), ph], pre + "dy"), pcy], pre + "cy")
        hw = ctx.op("Mul", [ctx.op("Mul", [ctx.op("Exp", [last(vl, 2, pre + "v2")], pre + "ew"), pw], pre + "w"), half],
                    pre + "hw")
        hh = ctx.op("Mul", [ctx.op("Mul", [ctx.op("Exp", [last(vl, 3, pre + "v3")], pre + "eh"), ph], pre + "h"), half],
                    pre + "hh")
        dec = ctx.op("Concat",
                     [ctx.op("Sub", [cx, hw], pre + "x0"), ctx.op("Sub", [cy, hh], pre + "y0"),
                      ctx.op("Add", [cx, hw], pre + "x1"), ctx.op("Add", [cy, hh], pre + "y1")], pre + "dec", axis=-1)
        return dec, (px0, py0, px1, py1, pw, ph, pcx, pcy)

    if arm == 2:   # RefineDet: each image's priors refined by its arm loc, (N, 1, P, 4)
        arm_loc = ctx.op("Reshape", [ins[4], ctx.i64([0, 1, P, 4])], "arm_loc")
        pbox, _ = decode(arm_loc, pbox, "arm_")
    dec, parts = decode(loc, pbox)
    if a["clip"] and pixel:   # OpenCV: [0, W - 1] x [0, H - 1] of the 4th input
        ih, iw = ctx.shape(ins[3])[2:4]
        hi = ctx.f32(np.array([iw - 1, ih - 1, iw - 1, ih - 1], np.float32))
        dec = ctx.op("Max", [ctx.op("Min", [dec, hi], "clip_hi"), ctx.f32(0.0)], "clip")
    elif a["clip"]:
        dec = ctx.op("Clip", [dec, ctx.f32(0.0), ctx.f32(1.0)], "clip")
    if layout:   # CENTER_SIZE only (checked at load), never with the arm bottoms
        px0, py0, px1, py1, pw, ph, pcx, pcy = parts
        ex = ctx.op("Slice", [loc_all, ctx.i64([4]), ctx.i64([W]), ctx.i64([-1])], "loc_extra")
        v0, v1, v3 = last(pvar, 0, "pv0"), last(pvar, 1, "pv1"), last(pvar, 3, "pv3")

        def moved(cols, var, size, base, hint):   # var * loc[..., cols] * size + base
            part = ctx.op("Gather", [ex, ctx.i64(cols)], hint + "_e", axis=-1)
            return ctx.op("Add",
                          [ctx.op("Mul", [ctx.op("Mul", [var, part], hint + "_v"), size], hint + "_s"), base], hint)

        if layout == "quad":
            ax = ctx.op("Concat", [px0, px1, px1, px0], "qax", axis=-1)
            ay = ctx.op("Concat", [py0, py0, py1, py1], "qay", axis=-1)
            xs, ys = moved([0, 2, 4, 6], v0, pw, ax, "qx"), moved([1, 3, 5, 7], v1, ph, ay, "qy")
        else:
            xs, ys = moved([0, 2], v0, pw, pcx, "rx"), moved([1, 3], v1, ph, pcy, "ry")
        pairs = ctx.op("Concat", [ctx.op("Unsqueeze", [xs, ctx.i64([-1])], "xs_u"),
                                  ctx.op("Unsqueeze", [ys, ctx.i64([-1])], "ys_u")], "pairs", axis=-1)
        extra = ctx.op("Reshape", [pairs, ctx.i64([0, 0, 0, -1])], "pairs_flat")
        if layout == "rbox":
            th = ctx.op("Mul", [ctx.op("Exp", [ctx.op("Mul", [v3, ctx.op("Slice", [ex, ctx.i64([4]), ctx.i64([5]),
                                                                                   ctx.i64([-1])], "rt")], "rvt")],
                                       "rexp"), ph], "rh")
            extra = ctx.op("Concat", [extra, th], "rbox", axis=-1)
        dec = ctx.op("Concat", [dec, extra], "dec_all", axis=-1)
    # per class boxes (N, K, P, 4) and scores (N, K, P)
    conf = ctx.op("Reshape", [conf_in, ctx.i64([0, P, C])], "conf")
    if arm:   # RefineDet: anchors with arm conf[1] < objectness_score score (1, 0, 0, ...)
        arm_conf = ctx.op("Reshape", [ins[3], ctx.i64([0, P, 2])], "arm_conf")
        empty = ctx.op("Less", [last(arm_conf, 1, "objectness"), ctx.f32(np.float32(a["objectness"]))], "empty")
        first = ctx.f32((np.arange(C) == 0).astype(np.float32))
        conf = ctx.op("Where", [empty, first, conf], "conf_os")
    conf = ctx.op("Transpose", [conf], "conf_t", perm=[0, 2, 1])
    scores = ctx.op("Gather", [conf, ctx.i64(cls)], "scores", axis=1) if K != C else conf
    if a["share_location"]:
        boxes = ctx.op("Expand", [dec, ctx.i64([1, K, 1, 1])], "boxes")
    else:
        boxes = ctx.op("Gather", [dec, ctx.i64(cls)], "boxes", axis=1) if K != C else dec
    # SSD's top_k candidates per class, best first
    vals, idx = ctx.add_node("TopK", [scores, ctx.i64([T])], [ctx.tmp(f"{name}_cand"), ctx.tmp(f"{name}_cand_idx")],
                             axis=2, largest=1, sorted=1)
    idx4 = ctx.op("Expand", [ctx.op("Unsqueeze", [idx, ctx.i64([3])], "idx_u"), ctx.i64([1, 1, 1, W])], "idx4")
    cboxes = ctx.op("GatherElements", [boxes, idx4], "cand_boxes", axis=2)          # (N, K, T, 4)
    nms_boxes = ctx.op("Slice", [cboxes, ctx.i64([0]), ctx.i64([4]), ctx.i64([-1])], "cand_box4") if layout else cboxes
    if code != CENTER_SIZE or pixel:
        # SSD gives a flipped box zero size (no overlap); collapse it so NMS agrees.  OpenCV's pixel
        # boxes: xmax and ymax + 1 first (pixel_nms_boxes)
        bx0, by0, bx1, by1 = (last(nms_boxes, k, f"b{k}") for k in range(4))
        flipped = ctx.op("Or", [ctx.op("Less", [bx1, bx0], "fx"), ctx.op("Less", [by1, by0], "fy")], "flip")
        if pixel:
            bx1, by1 = (ctx.op("Add", [b, ctx.f32(1.0)], f"b{k}p") for k, b in ((2, bx1), (3, by1)))
        nms_boxes = ctx.op("Concat", [bx0, by0, ctx.op("Where", [flipped, bx0, bx1], "cx1"),
                                      ctx.op("Where", [flipped, by0, by1], "cy1")], "nms_boxes", axis=-1)
    nb = ctx.op("Reshape", [nms_boxes, ctx.i64([-1, T, 4])], "nb")
    ns = ctx.op("Reshape", [vals, ctx.i64([-1, 1, T])], "ns")
    nms_in = [nb, ns, ctx.i64([T]), ctx.f32([ctx.nms_threshold(a["nms_threshold"])])]
    if a["conf_threshold"] > -FLT_MAX:
        nms_in.append(ctx.f32([a["conf_threshold"]]))
    sel = ctx.add_node("NonMaxSuppression", nms_in, [ctx.tmp(f"{name}_sel")], name=name)[0]   # (S, 3)
    # mask of survivors (N*K, T) -> (N, K, T)
    sel_bt = ctx.op("Gather", [sel, ctx.i64([0, 2])], "sel_bt", axis=1)
    flat_vals = ctx.op("Reshape", [vals, ctx.i64([-1, T])], "flat_vals")
    zeros = ctx.op("ConstantOfShape", [ctx.op("Shape", [flat_vals], "fv_shape")], "zeros", value=_scalar_tensor(0.0))
    ones = ctx.op("ConstantOfShape", [ctx.op("Slice", [ctx.op("Shape", [sel], "sel_shape"), ctx.i64([0]), ctx.i64([1])],
                                             "n_sel")], "ones", value=_scalar_tensor(1.0))
    mask = ctx.op("ScatterND", [zeros, sel_bt, ones], "mask_flat")
    if a["keep_top_k"] > -1 and a["keep_top_k"] < K * T:
        # keep_top_k best survivors per image
        neg = ctx.f32(-FLT_MAX)
        live = ctx.op("Where", [ctx.op("Cast", [mask], "mask_b", to=9), flat_vals, neg], "live")
        live = ctx.op("Reshape", [live, ctx.i64([-1, K * T])], "live_img")
        _, kidx = ctx.add_node("TopK", [live, ctx.i64([a["keep_top_k"]])],
                               [ctx.tmp(f"{name}_keep"), ctx.tmp(f"{name}_keep_idx")], axis=1, largest=1, sorted=1)
        kz = ctx.op("ConstantOfShape", [ctx.op("Shape", [live], "live_shape")], "kzeros", value=_scalar_tensor(0.0))
        kones = ctx.op("ConstantOfShape", [ctx.op("Shape", [kidx], "kidx_shape")], "kones", value=_scalar_tensor(1.0))
        kmask = ctx.op("ScatterElements", [kz, kidx, kones], "kmask", axis=1)
        mask = ctx.op("Mul", [ctx.op("Reshape", [mask, ctx.i64([-1, K * T])], "mask_img"), kmask], "mask_kept")
    mask = ctx.op("Reshape", [mask, ctx.i64([-1, K, T])], "mask")
    rows_idx = ctx.op("Transpose", [ctx.op("NonZero", [mask], "nz")], "rows_idx", perm=[1, 0])     # (R, 3)
    score = ctx.op("Unsqueeze", [ctx.op("GatherND", [vals, rows_idx], "score"), ctx.i64([1])], "score_c")
    box = ctx.op("GatherND", [cboxes, rows_idx], "box")                                          # (R, 4)
    img = ctx.op("Cast", [ctx.op("Gather", [rows_idx, ctx.i64([0])], "img_i", axis=1)], "img", to=1)
    lab_i = ctx.op("Gather", [rows_idx, ctx.i64([1])], "lab_k", axis=1)
    lab = ctx.op("Cast", [ctx.op("Gather", [ctx.i64(cls), lab_i], "lab_i")], "lab", to=1)
    S = a.get("states", 0)   # tl_ssd: the row's prior's state scores after its score
    parts = [img, lab, score, box]
    if S:
        prior_of_row = ctx.op("GatherND", [idx, rows_idx], "row_prior")                              # (R,)
        img_prior = ctx.op("Concat",
                           [ctx.op("Gather", [rows_idx, ctx.i64([0])], "row_img", axis=1),
                            ctx.op("Unsqueeze", [prior_of_row, ctx.i64([1])], "row_prior_c")], "img_prior", axis=1)
        states = ctx.op("Reshape", [node.inputs[3], ctx.i64([0, P, S])], "states")
        parts.insert(3, ctx.op("GatherND", [states, img_prior], "row_states"))                       # (R, S)
    cells = a.get("cells")   # OpenVINO's DetectionOutputExtended: the row's prior's anchor, x and y
    if cells:
        prior = ctx.op("GatherND", [idx, rows_idx], "row_prior_cell")                                  # (R,)
        width, anchors = cells
        per_cell = ctx.op("Div", [prior, ctx.i64(anchors)], "row_cell")
        coords = [ctx.op("Mod", [prior, ctx.i64(anchors)], "row_anchor"), ctx.op("Mod", [per_cell, ctx.i64(width)], "row_x"),
                  ctx.op("Div", [per_cell, ctx.i64(width)], "row_y")]
        parts += [ctx.op("Cast", [ctx.op("Unsqueeze", [c, ctx.i64([1])], f"cell{k}_c")], f"cell{k}", to=1)
                  for k, c in enumerate(coords)]
    rows = ctx.op("Concat", parts, "rows", axis=1)                                                 # (R, 3 + S + W)
    # tl_ssd writes image i's id at 7 * i, whatever the row width
    emit_detection_top(ctx, ctx.op, rows, loc_in, node.outputs[0], W + 3 + S + (3 if cells else 0),
                       id_stride=7 if S else 0)
