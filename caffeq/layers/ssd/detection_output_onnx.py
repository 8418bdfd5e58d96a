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
    # inputs, n_priors: synopsys-caffe's per-level bottoms, already gathered (detection_levels.py)
    loc_in, conf_in, prior_in = (inputs or node.inputs)[:3]   # a 4th input (the images) is not read
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
    i64 = lambda v: ctx.const(np.array(v, np.int64))
    f32 = lambda v: ctx.const(np.array(v, np.float32))

    def op(op_type, inputs, hint, **kw):
        return ctx.add_node(op_type, inputs, [ctx.tmp(f"{name}_{hint}")], **kw)[0]

    def last(x, k, hint):   # x[..., k:k+1]
        return op("Slice", [x, i64([k]), i64([k + 1]), i64([-1])], hint)

    # priors: boxes and variances (P, 4), from the first item as SSD does
    pr = op("Slice", [prior_in, i64([0]), i64([1]), i64([0])], "prior0")
    pr = op("Reshape", [pr, i64([2, P, 4])], "prior")
    pbox = op("Gather", [pr, i64(0)], "pbox", axis=0)
    pvar = f32(np.ones((P, 4), np.float32)) if a["variance_in_target"] else op("Gather", [pr, i64(1)], "pvar",
                                                                                 axis=0)
    # loc (N, L, P, 4 + extra)
    layout = a.get("layout", "")
    W = 4 + {"": 0, "rbox": 5, "quad": 8}[layout]
    loc_all = op("Reshape", [loc_in, i64([0, P, L, W])], "loc")
    loc_all = op("Transpose", [loc_all], "loc_t", perm=[0, 2, 1, 3])
    loc = op("Slice", [loc_all, i64([0]), i64([4]), i64([-1])], "loc_box") if layout else loc_all
    code = a["code_type"]

    def decode(loc, pbox, pre=""):
        """SSD's DecodeBBox of loc against pbox; (the prior's x0, y0, x1, y1, w, h, cx, cy) too."""
        if code == CORNER:
            return op("Add", [pbox, op("Mul", [pvar, loc], pre + "vl")], pre + "dec"), None
        px0, py0, px1, py1 = (last(pbox, k, f"{pre}p{k}") for k in range(4))
        pw = op("Sub", [px1, px0], pre + "pw")
        ph = op("Sub", [py1, py0], pre + "ph")
        vl = op("Mul", [pvar, loc], pre + "vl")
        if code == CORNER_SIZE:
            size = op("Concat", [pw, ph, pw, ph], pre + "psize", axis=-1)
            return op("Add", [pbox, op("Mul", [vl, size], pre + "vls")], pre + "dec"), (px0, py0, px1, py1, pw, ph)
        half = f32(0.5)
        pcx = op("Mul", [op("Add", [px0, px1], pre + "pxs"), half], pre + "pcx")
        pcy = op("Mul", [op("Add", [py0, py1], pre + "pys"), half], pre + "pcy")
        cx = op("Add", [op("Mul", [last(vl, 0, pre + "v0"), pw], pre + "dx"), pcx], pre + "cx")
        cy = op("Add", [op("Mul", [last(vl, 1, pre + "v1"), ph], pre + "dy"), pcy], pre + "cy")
        hw = op("Mul", [op("Mul", [op("Exp", [last(vl, 2, pre + "v2")], pre + "ew"), pw], pre + "w"), half],
                pre + "hw")
        hh = op("Mul", [op("Mul", [op("Exp", [last(vl, 3, pre + "v3")], pre + "eh"), ph], pre + "h"), half],
                pre + "hh")
        dec = op("Concat", [op("Sub", [cx, hw], pre + "x0"), op("Sub", [cy, hh], pre + "y0"),
                            op("Add", [cx, hw], pre + "x1"), op("Add", [cy, hh], pre + "y1")], pre + "dec", axis=-1)
        return dec, (px0, py0, px1, py1, pw, ph, pcx, pcy)

    if arm == 2:   # RefineDet: each image's priors refined by its arm loc, (N, 1, P, 4)
        arm_loc = op("Reshape", [node.inputs[4], i64([0, 1, P, 4])], "arm_loc")
        pbox, _ = decode(arm_loc, pbox, "arm_")
    dec, parts = decode(loc, pbox)
    if a["clip"]:
        dec = op("Clip", [dec, f32(0.0), f32(1.0)], "clip")
    if layout:   # CENTER_SIZE only (checked at load), never with the arm bottoms
        px0, py0, px1, py1, pw, ph, pcx, pcy = parts
        ex = op("Slice", [loc_all, i64([4]), i64([W]), i64([-1])], "loc_extra")
        v0, v1, v3 = last(pvar, 0, "pv0"), last(pvar, 1, "pv1"), last(pvar, 3, "pv3")

        def moved(cols, var, size, base, hint):   # var * loc[..., cols] * size + base
            part = op("Gather", [ex, i64(cols)], hint + "_e", axis=-1)
            return op("Add", [op("Mul", [op("Mul", [var, part], hint + "_v"), size], hint + "_s"), base], hint)

        if layout == "quad":
            ax = op("Concat", [px0, px1, px1, px0], "qax", axis=-1)
            ay = op("Concat", [py0, py0, py1, py1], "qay", axis=-1)
            xs, ys = moved([0, 2, 4, 6], v0, pw, ax, "qx"), moved([1, 3, 5, 7], v1, ph, ay, "qy")
        else:
            xs, ys = moved([0, 2], v0, pw, pcx, "rx"), moved([1, 3], v1, ph, pcy, "ry")
        pairs = op("Concat", [op("Unsqueeze", [xs, i64([-1])], "xs_u"), op("Unsqueeze", [ys, i64([-1])], "ys_u")],
                   "pairs", axis=-1)
        extra = op("Reshape", [pairs, i64([0, 0, 0, -1])], "pairs_flat")
        if layout == "rbox":
            th = op("Mul", [op("Exp", [op("Mul", [v3, op("Slice", [ex, i64([4]), i64([5]), i64([-1])], "rt")],
                                          "rvt")], "rexp"), ph], "rh")
            extra = op("Concat", [extra, th], "rbox", axis=-1)
        dec = op("Concat", [dec, extra], "dec_all", axis=-1)
    # per class boxes (N, K, P, 4) and scores (N, K, P)
    conf = op("Reshape", [conf_in, i64([0, P, C])], "conf")
    if arm:   # RefineDet: anchors with arm conf[1] < objectness_score score (1, 0, 0, ...)
        arm_conf = op("Reshape", [node.inputs[3], i64([0, P, 2])], "arm_conf")
        empty = op("Less", [last(arm_conf, 1, "objectness"), f32(np.float32(a["objectness"]))], "empty")
        first = f32((np.arange(C) == 0).astype(np.float32))
        conf = op("Where", [empty, first, conf], "conf_os")
    conf = op("Transpose", [conf], "conf_t", perm=[0, 2, 1])
    scores = op("Gather", [conf, i64(cls)], "scores", axis=1) if K != C else conf
    if a["share_location"]:
        boxes = op("Expand", [dec, i64([1, K, 1, 1])], "boxes")
    else:
        boxes = op("Gather", [dec, i64(cls)], "boxes", axis=1) if K != C else dec
    # SSD's top_k candidates per class, best first
    vals, idx = ctx.add_node("TopK", [scores, i64([T])], [ctx.tmp(f"{name}_cand"), ctx.tmp(f"{name}_cand_idx")],
                             axis=2, largest=1, sorted=1)
    idx4 = op("Expand", [op("Unsqueeze", [idx, i64([3])], "idx_u"), i64([1, 1, 1, W])], "idx4")
    cboxes = op("GatherElements", [boxes, idx4], "cand_boxes", axis=2)          # (N, K, T, 4)
    nms_boxes = op("Slice", [cboxes, i64([0]), i64([4]), i64([-1])], "cand_box4") if layout else cboxes
    if code != CENTER_SIZE:
        # SSD gives a flipped box zero size (no overlap); collapse it so NMS agrees
        bx0, by0, bx1, by1 = (last(nms_boxes, k, f"b{k}") for k in range(4))
        flipped = op("Or", [op("Less", [bx1, bx0], "fx"), op("Less", [by1, by0], "fy")], "flip")
        nms_boxes = op("Concat", [bx0, by0, op("Where", [flipped, bx0, bx1], "cx1"),
                                  op("Where", [flipped, by0, by1], "cy1")], "nms_boxes", axis=-1)
    nb = op("Reshape", [nms_boxes, i64([-1, T, 4])], "nb")
    ns = op("Reshape", [vals, i64([-1, 1, T])], "ns")
    nms_in = [nb, ns, i64([T]), f32([a["nms_threshold"]])]
    if a["conf_threshold"] > -FLT_MAX:
        nms_in.append(f32([a["conf_threshold"]]))
    sel = ctx.add_node("NonMaxSuppression", nms_in, [ctx.tmp(f"{name}_sel")], name=name)[0]   # (S, 3)
    # mask of survivors (N*K, T) -> (N, K, T)
    sel_bt = op("Gather", [sel, i64([0, 2])], "sel_bt", axis=1)
    flat_vals = op("Reshape", [vals, i64([-1, T])], "flat_vals")
    zeros = op("ConstantOfShape", [op("Shape", [flat_vals], "fv_shape")], "zeros", value=_scalar_tensor(0.0))
    ones = op("ConstantOfShape", [op("Slice", [op("Shape", [sel], "sel_shape"), i64([0]), i64([1])], "n_sel")],
              "ones", value=_scalar_tensor(1.0))
    mask = op("ScatterND", [zeros, sel_bt, ones], "mask_flat")
    if a["keep_top_k"] > -1 and a["keep_top_k"] < K * T:
        # keep_top_k best survivors per image
        neg = f32(-FLT_MAX)
        live = op("Where", [op("Cast", [mask], "mask_b", to=9), flat_vals, neg], "live")
        live = op("Reshape", [live, i64([-1, K * T])], "live_img")
        _, kidx = ctx.add_node("TopK", [live, i64([a["keep_top_k"]])],
                               [ctx.tmp(f"{name}_keep"), ctx.tmp(f"{name}_keep_idx")], axis=1, largest=1, sorted=1)
        kz = op("ConstantOfShape", [op("Shape", [live], "live_shape")], "kzeros", value=_scalar_tensor(0.0))
        kones = op("ConstantOfShape", [op("Shape", [kidx], "kidx_shape")], "kones", value=_scalar_tensor(1.0))
        kmask = op("ScatterElements", [kz, kidx, kones], "kmask", axis=1)
        mask = op("Mul", [op("Reshape", [mask, i64([-1, K * T])], "mask_img"), kmask], "mask_kept")
    mask = op("Reshape", [mask, i64([-1, K, T])], "mask")
    rows_idx = op("Transpose", [op("NonZero", [mask], "nz")], "rows_idx", perm=[1, 0])     # (R, 3)
    score = op("Unsqueeze", [op("GatherND", [vals, rows_idx], "score"), i64([1])], "score_c")
    box = op("GatherND", [cboxes, rows_idx], "box")                                          # (R, 4)
    img = op("Cast", [op("Gather", [rows_idx, i64([0])], "img_i", axis=1)], "img", to=1)
    lab_i = op("Gather", [rows_idx, i64([1])], "lab_k", axis=1)
    lab = op("Cast", [op("Gather", [i64(cls), lab_i], "lab_i")], "lab", to=1)
    S = a.get("states", 0)   # tl_ssd: the row's prior's state scores after its score
    parts = [img, lab, score, box]
    if S:
        prior_of_row = op("GatherND", [idx, rows_idx], "row_prior")                              # (R,)
        img_prior = op("Concat", [op("Gather", [rows_idx, i64([0])], "row_img", axis=1),
                                  op("Unsqueeze", [prior_of_row, i64([1])], "row_prior_c")], "img_prior", axis=1)
        states = op("Reshape", [node.inputs[3], i64([0, P, S])], "states")
        parts.insert(3, op("GatherND", [states, img_prior], "row_states"))                       # (R, S)
    rows = op("Concat", parts, "rows", axis=1)                                                 # (R, 3 + S + W)
    # tl_ssd writes image i's id at 7 * i, whatever the row width
    emit_detection_top(ctx, op, rows, loc_in, node.outputs[0], W + 3 + S, id_stride=7 if S else 0)
