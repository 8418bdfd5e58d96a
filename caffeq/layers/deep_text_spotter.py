"""DeepTextSpotter's Region (MichalBusta/caffe, branch darknet, c3dce16 src/caffe/layers/region_layer.cpp; the
layer DeepTextSpotter's tiny.prototxt ends in): three tops (loss, boxes, trans) from one channel-last bottom
(N, H, W, B (coords + 1 + classes)); a second bottom (gt_boxes) is read only in training.

- trans (N, H, W, C): the bottom, with each anchor's objectness (entry `coords`) through the logistic and,
  with `softmax`, its class entries through a softmax (max subtracted); the rest stays raw.
- boxes (N, 1, 500, 15): per image, every cell (row-major) and anchor n with score = sigmoid(obj)^2 >= 0.01
  gives x = (col + sigmoid(tx) + offset_x[n]) / W, y = (row + sigmoid(ty) + offset_y[n]) / H,
  w = exp(tw) anchor_w[n] / sqrt(W^2 + H^2), h likewise (sizes over the grid's diagonal), the angle (entry 4,
  raw, when coords > 4), class probabilities sigmoid(obj) x class_j and the class the first largest of them
  (> 0).  Sorted by score, a box is flagged when any higher-scored box of its class (flagged or not: the
  fork's loop is not greedy) overlaps it with IoU >= nms_threshold (axis-aligned centre-size boxes); then the
  unflagged boxes by score, then the flagged ones.  Rows [x, y, w, h, angle, score, class, box index
  ((cell B + n)(coords + 1 + classes)), flag, 6 class probabilities], the first 500, zeros after.
- loss (1, 1, 1, 1): written only in training, 0 at test.
The 14 anchors are the fork's, hard-coded (there is no field for them); `expand_bias` makes 19 of the first 7
(5 with sub-cell offsets for a pair with a side under 0.5).  Without it the fork fills 7 zero offsets and
reads past them for anchors 7-13 (tiny.prototxt has 14): caffeq takes 0 there, as intended.  Ties in score
keep the cell order (the fork's std::sort leaves their order unspecified); class entries past `classes` are 0
(the fork leaves them unset) and so is the angle when coords is 4.

OnDiskData, the fork's data layer, shapes its tops from input_param as Input does (graph inputs).

ONNX: the candidates in TopK order (ties by index, as here), the flags from a Scan over them (box i flags the
later boxes of its class that it overlaps), the rows by a second TopK on (flag, rank).
"""
import numpy as np
import torch
from onnx import TensorProto, helper

from .common import Input
from .norm import onnx_reduce
from .registry import Layer, LayerError, claim_layers, need_blobs, register_layer, torch_sources

# MichalBusta/caffe region_layer.cpp LayerSetUp: anchor (w, h) pairs in grid cells
DTS_ANCHORS = [0.317539695732, 0.493652380857, 0.66545245494, 0.357112901109, 1.01046388351, 0.512909981333,
               1.3496335045, 0.322306706382, 1.58891134384, 0.581019084508, 1.20785566117, 1.02485042068,
               2.28320153664, 0.813839044484, 2.5279678299, 0.442826767368, 3.01451020961, 1.34187668082,
               3.79487918772, 0.78852430371, 4.7935325462, 3.01837445215, 6.1298771774, 1.41297354615,
               10.4140073713, 2.29083421664, 12.1392691662, 5.06897667207]
DTS_SUB_CELLS = [(0.75, 0.25), (0.25, 0.25), (0.5, 0.5), (0.75, 0.75), (0.75, 0.25)]
MAX_BOXES, ROW, CLASS_SLOTS = 500, 15, 6


def dts_anchor_table(expand_bias):
    """(anchors [w0, h0, w1, h1, ...], offsets [x0, y0, x1, y1, ...]) as the fork's LayerSetUp builds them."""
    if not expand_bias:
        return list(DTS_ANCHORS), [0.0] * len(DTS_ANCHORS)
    anchors, offsets = [], []
    for i in range(0, len(DTS_ANCHORS) // 2, 2):    # the fork's loop: the first 7 pairs
        w, h = np.float32(DTS_ANCHORS[i]), np.float32(DTS_ANCHORS[i + 1])
        cells = DTS_SUB_CELLS if w < 0.5 or h < 0.5 else [(0.0, 0.0)]
        for ox, oy in cells:
            anchors += [DTS_ANCHORS[i], DTS_ANCHORS[i + 1]]
            offsets += [ox, oy]
    return anchors, offsets


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------

def dts_logistic(v):
    """The fork's logistic_activate: 1 / (1 + exp(-x)) in double, stored as float."""
    return (1.0 / (1.0 + torch.exp(-v.double()))).float()


def dts_overlaps(x, y, w, h, i, j):
    """The fork's box_iou of boxes i (earlier) and j (later), index tensors of the same shape: centre-size
    boxes, the overlap 0 unless both sides are >= 0."""
    def side(c, s):
        left = torch.maximum(c[i] - s[i] / 2, c[j] - s[j] / 2)
        right = torch.minimum(c[i] + s[i] / 2, c[j] + s[j] / 2)
        return right - left
    ow, oh = side(x, w), side(y, h)
    inter = torch.where((ow < 0) | (oh < 0), torch.zeros_like(ow), ow * oh)
    return inter / (w[i] * h[i] + w[j] * h[j] - inter)


def dts_image_rows(t, obj, probs, coords: int, nms_threshold: float, anchors: list[float], offsets: list[float]):
    """One image's (500, 15) rows: t (H, W, B, size) the raw entries, obj (H, W, B) the logistic objectness,
    probs (H, W, B, classes) the class values (softmaxed or raw)."""
    f32, dev = torch.float32, t.device
    h, w, nb, size = t.shape
    norm = torch.sqrt(torch.tensor(float(w * w + h * h), dtype=f32, device=dev))
    aw, ah = (torch.tensor(anchors[k:2 * nb:2], dtype=f32, device=dev) for k in (0, 1))
    ox, oy = (torch.tensor(offsets[k:2 * nb:2], dtype=f32, device=dev) for k in (0, 1))
    cols = torch.arange(w, dtype=f32, device=dev).reshape(1, w, 1)
    rows = torch.arange(h, dtype=f32, device=dev).reshape(h, 1, 1)
    x = (cols + dts_logistic(t[..., 0]) + ox) / w
    y = (rows + dts_logistic(t[..., 1]) + oy) / h
    bw = torch.exp(t[..., 2]) * aw / norm
    bh = torch.exp(t[..., 3]) * ah / norm
    angle = t[..., 4] if coords > 4 else torch.zeros_like(x)
    score = obj * obj
    p = obj[..., None] * probs
    best, label = p.max(-1)
    label = torch.where(best > 0, label, torch.zeros_like(label))
    p = torch.cat([p, p.new_zeros(p.shape[:-1] + (6 - p.shape[-1],))], -1)     # classes <= 6 (parse)
    index = torch.arange(h * w * nb, dtype=f32, device=dev) * size
    columns = [v.reshape(-1) for v in (x, y, bw, bh, angle, score, label.to(f32))] + [index]
    table = torch.cat([torch.stack(columns, 1), p.reshape(-1, 6)], 1)              # (M, 14) without the flag
    table = table[score.reshape(-1) >= torch.tensor(0.01, dtype=f32)]
    table = table[torch.sort(table[:, 5], descending=True, stable=True)[1]]
    k = table.shape[0]
    flagged = torch.zeros(k, dtype=torch.bool, device=dev)
    bx, by, bwk, bhk, cls = table[:, 0], table[:, 1], table[:, 2], table[:, 3], table[:, 6]
    for start in range(0, k, 512):          # box i against every later box j, 512 rows i at a time
        i = torch.arange(start, min(start + 512, k), device=dev)[:, None]
        j = torch.arange(k, device=dev)[None, :]
        hit = (j > i) & (cls[i] == cls[j]) & (dts_overlaps(bx, by, bwk, bhk, i, j) >= nms_threshold)
        flagged |= hit.any(0)
    order = torch.sort(flagged.to(torch.int8), stable=True)[1]
    table = torch.cat([table[:, :8], flagged.to(f32)[:, None], table[:, 8:]], 1)[order][:500]
    return torch.cat([table, table.new_zeros((500 - table.shape[0], 15))], 0)


def dts_region(x, classes: int, coords: int, boxes: int, softmax: bool, nms_threshold: float,
               anchors: list[float], offsets: list[float]):
    """DeepTextSpotter's Region -> (loss (1, 1, 1, 1), boxes (N, 1, 500, 15), trans (N, H, W, C))."""
    n, h, w, c = x.shape
    t = x.reshape(n, h, w, boxes, coords + 1 + classes)
    obj = dts_logistic(t[..., coords])
    cls = t[..., coords + 1:]
    if softmax:
        e = torch.exp(cls - cls.amax(-1, keepdim=True))
        cls = e / e.sum(-1, keepdim=True)
    trans = torch.cat([t[..., :coords], obj[..., None], cls], -1).reshape(n, h, w, c)
    rows = torch.stack([dts_image_rows(t[b], obj[b], cls[b], coords, nms_threshold, anchors, offsets)
                        for b in range(n)])
    return x.new_zeros((1, 1, 1, 1)), rows[:, None], trans


TORCH_DTS_REGION = torch_sources(dts_logistic, dts_overlaps, dts_image_rows, dts_region)


# ---- ONNX -------------------------------------------------------------------------------

def _onnx_logistic(ctx, v):
    """dts_logistic in ONNX: 1 / (1 + exp(-x)) in double, cast to float."""
    op = ctx.op
    one = ctx.const(np.array(1.0, np.float64))
    e = op("Exp", [op("Neg", [op("Cast", [v], "d", to=TensorProto.DOUBLE)], "neg")], "e")
    return op("Cast", [op("Div", [one, op("Add", [one, e], "den")], "sig")], "sigf", to=TensorProto.FLOAT)


def _onnx_image_rows(ctx, node, t, obj, probs, hw):
    """One image's (1, 500, 15) rows from its (H, W, B, size) entries, (H, W, B) objectness and
    (H, W, B, classes) class values, as dts_image_rows."""
    a = node.attrs
    op, f32, i64 = ctx.op, ctx.f32, ctx.i64
    h, w = hw
    nb, classes, coords = a["boxes"], a["classes"], a["coords"]
    m = h * w * nb

    def entry(k):
        return op("Gather", [t, i64(k)], "entry", axis=3)

    anchors = np.array(a["anchors"][:2 * nb], np.float32).reshape(nb, 2)
    offsets = np.array(a["offsets"][:2 * nb], np.float32).reshape(nb, 2)
    norm = float(np.sqrt(np.float32(w * w + h * h), dtype=np.float32))
    cols = ctx.const(np.arange(w, dtype=np.float32).reshape(1, w, 1))
    rows = ctx.const(np.arange(h, dtype=np.float32).reshape(h, 1, 1))
    x = op("Div", [op("Add", [op("Add", [cols, _onnx_logistic(ctx, entry(0))], "cx"), ctx.const(offsets[:, 0])], "cxo"),
                   f32(float(w))], "x")
    y = op("Div", [op("Add", [op("Add", [rows, _onnx_logistic(ctx, entry(1))], "cy"), ctx.const(offsets[:, 1])], "cyo"),
                   f32(float(h))], "y")
    bw = op("Div", [op("Mul", [op("Exp", [entry(2)], "ew"), ctx.const(anchors[:, 0])], "aw"), f32(norm)], "w")
    bh = op("Div", [op("Mul", [op("Exp", [entry(3)], "eh"), ctx.const(anchors[:, 1])], "ah"), f32(norm)], "h")
    angle = entry(4) if coords > 4 else ctx.const(np.zeros((h, w, nb), np.float32))
    score = op("Mul", [obj, obj], "score")
    p = op("Mul", [op("Unsqueeze", [obj, i64([3])], "obj4"), probs], "p")
    best = onnx_reduce(ctx, "ReduceMax", p, [3], False)
    first_best = op("ArgMax", [p], "arg", axis=3, keepdims=0, select_last_index=0)
    label = op("Cast", [first_best], "argf", to=TensorProto.FLOAT)
    label = op("Where", [op("Greater", [best, f32(0.0)], "pos"), label, f32(0.0)], "label")
    if classes < CLASS_SLOTS:
        p = op("Pad", [p, i64([0, 0, 0, 0, 0, 0, 0, CLASS_SLOTS - classes])], "p6")
    flat = [op("Reshape", [v, i64([m, 1])], "col") for v in (x, y, bw, bh, angle, score, label)]
    index = ctx.const((np.arange(m, dtype=np.float32) * np.float32(coords + 1 + classes)).reshape(m, 1))
    table = op("Concat", flat + [index, op("Reshape", [p, i64([m, CLASS_SLOTS])], "p2")], "table", axis=1)
    valid = op("GreaterOrEqual", [flat[5], f32(float(np.float32(0.01)))], "valid")                  # (M, 1)
    key = op("Where", [valid, flat[5], f32(-1.0)], "key")
    _, order = ctx.add_node("TopK", [op("Reshape", [key, i64([m])], "key1"), i64([m])],
                            [ctx.tmp(f"{node.name}_sorted"), ctx.tmp(f"{node.name}_order")], axis=0, largest=1,
                            sorted=1)
    table = op("Gather", [table, order], "by_score", axis=0)
    valid = op("Reshape", [op("Gather", [valid, order], "v", axis=0), i64([m])], "valid_s")
    count = op("ReduceSum", [op("Cast", [valid], "vi", to=TensorProto.INT64), i64([0])], "count", keepdims=1)
    flags = _onnx_flags(ctx, node, table, valid, count, m)
    rank = ctx.const(np.arange(m, dtype=np.float32))
    flag_f = op("Cast", [flags], "flag", to=TensorProto.FLOAT)
    invalid = op("Cast", [op("Not", [valid], "invalid")], "invf", to=TensorProto.FLOAT)
    key2 = op("Add", [rank, op("Add", [op("Mul", [flag_f, f32(float(m + 1))], "kf"),
                                       op("Mul", [invalid, f32(float(2 * (m + 1)))], "ki")], "kfi")], "key2")
    take = min(m, MAX_BOXES)
    _, order2 = ctx.add_node("TopK", [key2, i64([take])], [ctx.tmp(f"{node.name}_k2"), ctx.tmp(f"{node.name}_o2")],
                             axis=0, largest=0, sorted=1)
    table = op("Concat", [op("Slice", [table, i64([0]), i64([8]), i64([1])], "head"),
                          op("Unsqueeze", [flag_f, i64([1])], "flag2"),
                          op("Slice", [table, i64([8]), i64([14]), i64([1])], "tail")], "table15", axis=1)
    picked = op("Gather", [table, order2], "picked", axis=0)
    keep = op("Unsqueeze", [op("Gather", [valid, order2], "keep", axis=0), i64([1])], "keep2")
    picked = op("Where", [keep, picked, f32(0.0)], "rows")
    if take < MAX_BOXES:
        picked = op("Pad", [picked, i64([0, 0, MAX_BOXES - take, 0])], "rows500")
    return op("Unsqueeze", [picked, i64([0])], "rows3")


def _onnx_flags(ctx, node, table, valid, count, m):
    """(M,) bool: the score-sorted candidates flagged by a higher-scored box of their class (a Scan over the
    count + 1 first candidates, the last a padding row that flags nothing: onnxruntime refuses a 0-step Scan)."""
    op = ctx.op
    padded = op("Pad", [table, ctx.i64([0, 0, 1, 0])], "padded")                     # (M + 1, 14)
    valid_p = op("Pad", [valid, ctx.i64([0, 1])], "valid_p")
    steps = op("Squeeze", [op("Add", [count, ctx.i64([1])], "steps"), ctx.i64([0])], "n")
    ids = op("Range", [ctx.i64(0), steps, ctx.i64(1)], "ids")
    positions = ctx.const(np.arange(m + 1, dtype=np.int64))
    body = []

    def b(op_type, inputs, hint, **kw):
        return ctx.body_op(body, op_type, inputs, hint, **kw)

    flags_in, it = ctx.tmp(f"{node.name}_flags_in"), ctx.tmp(f"{node.name}_it")
    col = {k: op("Gather", [padded, ctx.i64(k)], f"col{k}", axis=1) for k in (0, 1, 2, 3, 6)}   # outer scope
    mine = {k: b("Gather", [v, it], f"mine{k}", axis=0) for k, v in col.items()}
    two = ctx.body_const(body, np.float32(2.0), "two")

    def side(c, s):
        half, my_half = b("Div", [col[s], two], "half"), b("Div", [mine[s], two], "my_half")
        left = b("Max", [b("Sub", [mine[c], my_half], "l1"), b("Sub", [col[c], half], "l2")], "left")
        right = b("Min", [b("Add", [mine[c], my_half], "r1"), b("Add", [col[c], half], "r2")], "right")
        return b("Sub", [right, left], "side")
    ow, oh = side(0, 2), side(1, 3)
    zero = ctx.body_const(body, np.float32(0.0), "zero")
    apart = b("Or", [b("Less", [ow, zero], "wneg"), b("Less", [oh, zero], "hneg")], "apart")
    inter = b("Where", [apart, zero, b("Mul", [ow, oh], "area")], "inter")
    union = b("Sub", [b("Add", [b("Mul", [mine[2], mine[3]], "mya"), b("Mul", [col[2], col[3]], "a")], "sum"),
                      inter], "union")
    threshold = ctx.body_const(body, np.float32(node.attrs["nms_threshold"]), "thr")
    overlaps = b("GreaterOrEqual", [b("Div", [inter, union], "iou"), threshold],
                 "overlaps")
    hit = b("And", [b("And", [overlaps, b("Equal", [col[6], mine[6]], "same")], "same_hit"),
                    b("And", [b("Greater", [positions, it], "later"), valid_p], "later_valid")], "hit")
    hit = b("And", [hit, b("Gather", [valid_p, it], "i_valid", axis=0)], "hit_valid")
    flags_out = b("Or", [flags_in, hit], "flags_out")
    graph = helper.make_graph(body, f"{node.name}_flag_step",
                              [helper.make_tensor_value_info(flags_in, TensorProto.BOOL, [m + 1]),
                               helper.make_tensor_value_info(it, TensorProto.INT64, [])],
                              [helper.make_tensor_value_info(flags_out, TensorProto.BOOL, [m + 1])])
    flags0 = ctx.const(np.zeros(m + 1, bool))
    flags = ctx.add_node("Scan", [flags0, ids], [ctx.tmp(f"{node.name}_flags")], body=graph, num_scan_inputs=1)[0]
    return op("Slice", [flags, ctx.i64([0]), ctx.i64([m]), ctx.i64([0])], "flags_m")


def emit_dts_region(ctx, node):
    a = node.attrs
    x = node.inputs[0]
    n, h, w, c = ctx.shape(x)
    size = a["coords"] + 1 + a["classes"]
    op, i64 = ctx.op, ctx.i64
    t = op("Reshape", [x, i64([n, h, w, a["boxes"], size])], "t")
    obj = _onnx_logistic(ctx, op("Gather", [t, i64(a["coords"])], "obj_raw", axis=4))
    cls = op("Slice", [t, i64([a["coords"] + 1]), i64([size]), i64([4])], "cls")
    if a["softmax"]:
        top = onnx_reduce(ctx, "ReduceMax", cls, [4], True)
        e = op("Exp", [op("Sub", [cls, top], "shift")], "ce")
        cls = op("Div", [e, op("ReduceSum", [e, i64([4])], "csum", keepdims=1)], "soft")
    head = op("Slice", [t, i64([0]), i64([a["coords"]]), i64([4])], "head")
    ctx.add_node("Reshape", [op("Concat", [head, op("Unsqueeze", [obj, i64([4])], "obj5"), cls], "trans5", axis=4),
                             i64([n, h, w, c])], [node.outputs[2]])
    images = []
    for b in range(n):
        pick = i64(b)
        images.append(_onnx_image_rows(ctx, node, op("Gather", [t, pick], "ti", axis=0),
                                       op("Gather", [obj, pick], "oi", axis=0), op("Gather", [cls, pick], "pi", axis=0),
                                       (h, w)))
    ctx.add_node("Unsqueeze", [op("Concat", images, "images", axis=0), i64([1])], [node.outputs[1]])
    ctx.add_node("Identity", [ctx.const(np.zeros((1, 1, 1, 1), np.float32))], [node.outputs[0]], name=node.name)


# ---- the spec ---------------------------------------------------------------------------

@claim_layers("Region", lambda lp: lp.HasField("region_param") and len(lp.top) == 3)
class DeepTextSpotterRegion(Layer):
    """DeepTextSpotter's three-top Region (see the module docstring)."""

    def parse(self, lp):
        need_blobs(lp, "Region (DeepTextSpotter)", range(1, 3), 3, in_place=False)
        p = lp.region_param
        anchors, offsets = dts_anchor_table(p.expand_bias)
        boxes = len(anchors) // 2 if p.expand_bias else int(p.boxes_of_each_grid)
        a = {"classes": int(p.classes), "coords": int(p.coords), "boxes": boxes, "softmax": bool(p.softmax),
             "nms_threshold": float(np.float32(p.nms_threshold)), "anchors": anchors, "offsets": offsets}
        if not 1 <= a["classes"] <= CLASS_SLOTS:
            raise LayerError(f"region_param.classes must be 1 to {CLASS_SLOTS} (the fork keeps {CLASS_SLOTS} class "
                             f"probabilities per box), got {a['classes']}")
        if a["coords"] < 4:
            raise LayerError(f"region_param.coords must be >= 4 (x, y, w, h), got {a['coords']}")
        if not p.expand_bias and not 1 <= boxes <= len(DTS_ANCHORS) // 2:
            raise LayerError(f"region_param.boxes_of_each_grid must be 1 to {len(DTS_ANCHORS) // 2} (the fork's "
                             f"hard-coded anchors), got {boxes}")
        if not p.expand_bias and boxes > len(DTS_ANCHORS) // 4:
            a["reading_notes"] = [f"region_param.boxes_of_each_grid {boxes}: the fork fills 7 zero centre offsets and "
                                  f"reads past them for anchors 7 to {boxes - 1} (undefined memory); caffeq takes 0 "
                                  f"there, the offset the fork intends"]
        return a

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        size = attrs["coords"] + 1 + attrs["classes"]
        if len(s) != 4 or s[3] != attrs["boxes"] * size:
            raise LayerError(f"DeepTextSpotter's Region reads a channel-last (N, H, W, boxes_of_each_grid x "
                             f"(coords + 1 + classes) = {attrs['boxes']} x {size}) bottom, got {list(s)}")
        return [(1, 1, 1, 1), (s[0], 1, MAX_BOXES, ROW), s]

    def _args(self, attrs):
        return (attrs["classes"], attrs["coords"], attrs["boxes"], attrs["softmax"], attrs["nms_threshold"],
                attrs["anchors"], attrs["offsets"])

    def forward(self, attrs, params, x, *gt_boxes):
        return dts_region(x, *self._args(attrs))

    def onnx(self, ctx, node):
        emit_dts_region(ctx, node)

    def pytorch_source(self, node, emit):
        fn = emit.helper(TORCH_DTS_REGION)
        args = ", ".join(emit.lit(v, exact=True) if isinstance(v, (float, list)) else repr(v)
                         for v in self._args(node.attrs))
        return f"{fn}({emit.inputs[0]}, {args})"


@register_layer("OnDiskData")
class OnDiskData(Input):
    """The fork's OnDiskData (ondisk_data_layer.cpp), tiny.prototxt's data layer: its LayerSetUp shapes the tops
    (data, gt_boxes, gt_labels, line_boxes, line_labels) from input_param as Input does; DeepTextSpotter runs the
    net from conv1 on, so they are graph inputs."""
