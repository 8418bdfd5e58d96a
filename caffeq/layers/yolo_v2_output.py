"""gklz1982/caffe-yolov2's DetectionOutput (detection_output_layer.cpp, util/bbox_util.hpp, ebb2702),
the YOLO v2 detector its copies (Ewenwan/caffe-yolov2, ...) put under SSD's type name.

One bottom (1, num_box * (5 + ...), side, side) and detection_output_param num_classes, side [13],
num_box [5], confidence_threshold [0.01], nms_threshold [0.45] and biases (a width and a height per
box).  The fork reads the map channel-last, cell (row j, column i) and box n in that order:
x = (i + sigmoid) / side, y = (j + sigmoid) / side, w = exp * bias_w / side, h = exp * bias_h / side,
objectness sigmoid(entry 4), the class the first maximum of a softmax over entries 5 .. 5 +
num_classes - 1; confidence = objectness * that probability, kept when >= confidence_threshold.
Unlike MobileNet-YOLO's YoloDetectionOutput the candidates are NOT sorted: its NMS walks them in
cell order and drops a later box whose IoU with a kept one is >= nms_threshold, the IoU taken on
boxes clipped to [0, 1] (a box whose clipped corners cross has size 0).  Rows: [0, class (from 0),
confidence, x, y, w, h] (centre and size, unclipped), (1, 1, R, 7); with none, one row
[0, -1, ...].  The fork checks N == 1 and indexes cells by `side`, so the map must be side x side.

ONNX: the candidates as YoloDetectionOutput decodes them, NonMaxSuppression on the clipped corners
with scores -index (so it walks them in cell order; the next float32 below nms_threshold, since it
drops IoU > t and the fork IoU >= t), the survivors gathered back in that order.

BirdeeChen/caffe_yolo_v2 (6a1e658, BSD-2-Clause) is the same layer with the class count named
`classes` (required) and its own ApplyNms (util/bbox_util.hpp), chosen here by `classes`:
walking the candidates in cell order, box i (not yet dropped) meets each later box j not yet
dropped; when their clipped IoU is >= nms_threshold, the one with the lower objectness (not the
confidence) drops, i on a tie.  i's objectness is then -1, so once dropped it drops no more
boxes.  A box is kept when its objectness ends > 0.  Decoding, rows and the empty row are
gklz1982's.  ONNX: that walk as a Scan over the candidates on the pairwise IoU >= t and
objectness comparisons (i drops the overlapping j it beats before the first one that beats it).
"""

import numpy as np
import torch

from ..errors import ExportError
from .registry import Layer, LayerError, claim_layers, torch_sources
from .yolo_detection import emit_rows_or_fallback, emit_yolo_candidates, yolo_v2_candidates


def yolo_v2_cell_order_rows(x, biases: list[float], num_box: int, num_classes: int, threshold: float,
                            nms_threshold: float, duel: bool = False):
    """gklz1982's DetectionOutput on a (1, C, side, side) map -> rows (1, 1, R, 7); duel:
    BirdeeChen's NMS (of two overlapping boxes the lower objectness drops)."""
    bx, by, bw, bh, label, score, keep = yolo_v2_candidates(x, biases, num_box, num_classes, threshold)
    n, c, h, w = x.shape
    obj = torch.sigmoid(x.reshape(n, num_box, c // num_box, h, w)[:, :, 4].permute(0, 2, 3, 1)).reshape(-1)
    bx, by, bw, bh, label, score, obj = (t[keep] for t in (bx, by, bw, bh, label, score, obj))
    left, right = (bx - bw / 2).clamp_min(0), (bx + bw / 2).clamp_max(1)
    top, bottom = (by - bh / 2).clamp_min(0), (by + bh / 2).clamp_max(1)
    valid = (right >= left) & (bottom >= top)
    size = torch.where(valid, (right - left) * (bottom - top), torch.zeros_like(bx))
    k = score.numel()
    alive = torch.ones(k, dtype=torch.bool, device=x.device)
    for i in range(k - 1):   # the last box meets no later one
        if not bool(alive[i]):
            continue
        rest = slice(i + 1, k)
        apart = (left[rest] > right[i]) | (right[rest] < left[i]) | (top[rest] > bottom[i]) | (bottom[rest] < top[i])
        iw = torch.minimum(right[i], right[rest]) - torch.maximum(left[i], left[rest])
        ih = torch.minimum(bottom[i], bottom[rest]) - torch.maximum(top[i], top[rest])
        overlaps = ~apart & (iw > 0) & (ih > 0)
        inter = torch.where(overlaps, iw * ih, torch.zeros_like(iw))
        iou = torch.where(overlaps, inter / (size[i] + size[rest] - inter), torch.zeros_like(iw))
        if not duel:
            alive[rest] &= ~(iou >= nms_threshold)
            continue
        met = alive[rest] & (iou >= nms_threshold)
        beats = obj[i] > obj[rest]
        loses = met & ~beats
        # i drops the boxes it beats up to the first one that beats it, and then itself
        alive[rest] &= ~(met & beats & (torch.cumsum(loses.to(torch.int64), 0) == 0))
        if bool(loses.any()):
            alive[i] = False
    if duel:
        alive &= obj > 0
    if not bool(alive.any()):
        out = torch.full((1, 7), -1.0, device=x.device, dtype=x.dtype)
        out[0, 0] = 0
        return out.reshape(1, 1, 1, 7)
    rows = torch.stack([torch.zeros_like(score), label.to(x.dtype), score, bx, by, bw, bh], dim=1)[alive]
    return rows.reshape(1, 1, -1, 7)


TORCH_YOLO_V2_CELL_ORDER = torch_sources(yolo_v2_cell_order_rows)


def claims(lp):
    """The fork's form: one bottom (SSD's needs loc, conf and priors)."""
    return len(lp.bottom) == 1


def _duel(attrs):
    """BirdeeChen's NMS (objectness duels) rather than gklz1982's (cell order)."""
    return attrs.get("nms") == "objectness"


def emit_onnx(ctx, node):
    a = node.attrs
    name = node.name

    decode = {"num_box": a["num_box"], "num_classes": a["num_classes"], "biases": a["biases"],
              "confidence_threshold": a["conf_threshold"]}
    if _duel(a):
        return _onnx_duel(ctx, node, emit_yolo_candidates(ctx, node, decode, False, with_obj=True))
    bx, by, bw, bh, lab, score = emit_yolo_candidates(ctx, node, decode, False)
    half_w, half_h = ctx.op("Mul", [bw, ctx.f32(0.5)], "half_w"), ctx.op("Mul", [bh, ctx.f32(0.5)], "half_h")
    corners = [ctx.op("Max", [ctx.op("Sub", [by, half_h], "y0r"), ctx.f32(0.0)], "y0"),
               ctx.op("Max", [ctx.op("Sub", [bx, half_w], "x0r"), ctx.f32(0.0)], "x0"),
               ctx.op("Min", [ctx.op("Add", [by, half_h], "y1r"), ctx.f32(1.0)], "y1"),
               ctx.op("Min", [ctx.op("Add", [bx, half_w], "x1r"), ctx.f32(1.0)], "x1")]
    boxes = ctx.op("Unsqueeze",
                   [ctx.op("Concat", [ctx.op("Unsqueeze", [v, ctx.i64([1])], f"c{k}") for k, v in enumerate(corners)],
                           "corners", axis=1), ctx.i64([0])], "boxes")                                    # (1, K, 4)
    order = ctx.op("Neg",
                   [ctx.op("Cast", [ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [ctx.op("Shape", [score], "k_shape"),
                                                                                    ctx.i64([0])], "k"), ctx.i64(1)],
                                           "ids")], "ids_f", to=1)], "order")
    scores = ctx.op("Reshape", [order, ctx.i64([1, 1, -1])], "scores")
    thr = ctx.nms_threshold(a["nms_threshold"], drops_equal=True)
    sel = ctx.add_node("NonMaxSuppression", [boxes, scores, ctx.i64([2 ** 31 - 1]), ctx.f32([thr])],
                       [ctx.tmp(f"{name}_sel")], name=name, center_point_box=0)[0]
    idx = ctx.op("Squeeze",
                 [ctx.op("Slice", [sel, ctx.i64([2]), ctx.i64([3]), ctx.i64([1])], "sel_box"), ctx.i64([1])], "idx")
    g = [ctx.op("Gather", [v, idx], f"g{k}", axis=0) for k, v in enumerate((bx, by, bw, bh, lab, score))]
    columns = [ctx.op("Mul", [g[5], ctx.f32(0.0)], "zero"),
               ctx.op("Cast", [g[4]], "label", to=1), g[5], g[0], g[1], g[2], g[3]]
    emit_rows_or_fallback(ctx, node, ctx.op, columns)


def _onnx_duel(ctx, node, candidates):
    """BirdeeChen's ApplyNms: pairwise IoU >= t (on clipped corners) and objectness comparisons, then a
    Scan over the candidates in cell order carrying which are alive."""
    from onnx import TensorProto, helper
    a = node.attrs
    bx, by, bw, bh, lab, score, obj = candidates
    half_w, half_h = ctx.op("Mul", [bw, ctx.f32(0.5)], "half_w"), ctx.op("Mul", [bh, ctx.f32(0.5)], "half_h")
    x0 = ctx.op("Max", [ctx.op("Sub", [bx, half_w], "x0r"), ctx.f32(0.0)], "x0")
    y0 = ctx.op("Max", [ctx.op("Sub", [by, half_h], "y0r"), ctx.f32(0.0)], "y0")
    x1 = ctx.op("Min", [ctx.op("Add", [bx, half_w], "x1r"), ctx.f32(1.0)], "x1")
    y1 = ctx.op("Min", [ctx.op("Add", [by, half_h], "y1r"), ctx.f32(1.0)], "y1")
    valid = ctx.op("And",
                   [ctx.op("GreaterOrEqual", [x1, x0], "w_ok"), ctx.op("GreaterOrEqual", [y1, y0], "h_ok")], "valid")
    size = ctx.op("Where", [valid, ctx.op("Mul", [ctx.op("Sub", [x1, x0], "cw"), ctx.op("Sub", [y1, y0], "ch")],
                                          "area"), ctx.f32(0.0)], "size")

    def pair(v, hint):   # box i along axis 0, box j along axis 1
        return ctx.op("Unsqueeze", [v, ctx.i64([1])], f"{hint}_i"), ctx.op("Unsqueeze", [v, ctx.i64([0])], f"{hint}_j")

    (x0i, x0j), (y0i, y0j), (x1i, x1j), (y1i, y1j) = (pair(v, h) for v, h in
                                                      ((x0, "x0"), (y0, "y0"), (x1, "x1"), (y1, "y1")))
    apart = ctx.op("Or", [ctx.op("Or", [ctx.op("Greater", [x0j, x1i], "a0"), ctx.op("Less", [x1j, x0i], "a1")], "ax"),
                          ctx.op("Or", [ctx.op("Greater", [y0j, y1i], "a2"), ctx.op("Less", [y1j, y0i], "a3")], "ay")],
                   "apart")
    iw = ctx.op("Sub", [ctx.op("Min", [x1i, x1j], "ix1"), ctx.op("Max", [x0i, x0j], "ix0")], "iw")
    ih = ctx.op("Sub", [ctx.op("Min", [y1i, y1j], "iy1"), ctx.op("Max", [y0i, y0j], "iy0")], "ih")
    meets = ctx.op("And", [ctx.op("Not", [apart], "near"),
                           ctx.op("And", [ctx.op("Greater", [iw, ctx.f32(0.0)], "iw_pos"),
                                          ctx.op("Greater", [ih, ctx.f32(0.0)], "ih_pos")], "pos")], "meets")
    inter = ctx.op("Mul", [iw, ih], "inter")
    si, sj = pair(size, "size")
    union = ctx.op("Sub", [ctx.op("Add", [si, sj], "sizes"), inter], "union")
    iou = ctx.op("Where", [meets, ctx.op("Div", [inter, union], "iou_raw"), ctx.f32(0.0)], "iou")
    k1 = ctx.op("Shape", [score], "k_shape")
    ids = ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [k1, ctx.i64([0])], "k"), ctx.i64(1)], "ids")
    idi, idj = pair(ids, "ids")
    hit = ctx.op("And", [ctx.op("GreaterOrEqual", [iou, ctx.f32(np.float32(a["nms_threshold"]))], "overlap"),
                         ctx.op("Less", [idi, idj], "later")], "hit")                              # (K, K)
    oi, oj = pair(obj, "obj")
    beats = ctx.op("Greater", [oi, oj], "beats")                                                  # (K, K)
    # onnxruntime's Scan refuses 0 steps: one more box that meets none, dropped after the walk
    hit, beats = (ctx.op("Pad", [v, ctx.i64([0, 0, 1, 1])], f"{v}_pad") for v in (hit, beats))     # (K+1, K+1)
    k_pad = ctx.op("Add", [k1, ctx.i64([1])], "k_pad")
    ids = ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [k_pad, ctx.i64([0])], "k_pad_s"), ctx.i64(1)], "ids_pad")

    body = []

    def b(op_type, inputs, hint, **kw):
        return ctx.body_op(body, op_type, inputs, hint, **kw)

    alive_in, it, row_hit, row_beats = (ctx.tmp(f"{node.name}_{h}") for h in ("alive_in", "it", "row_hit",
                                                                                 "row_beats"))
    zero = ctx.body_const(body, np.float32(0.0), "zero")
    met = b("And", [b("And", [row_hit, alive_in], "met_alive"), b("Gather", [alive_in, it], "i_alive", axis=0)],
            "met")
    loses = b("Cast", [b("And", [met, b("Not", [row_beats], "not_beats")], "loses_b")], "loses", to=TensorProto.FLOAT)
    before = b("Equal", [b("CumSum", [loses, ctx.body_const(body, np.int64(0), "axis0")], "lost_so_far"), zero], "before")
    drops = b("And", [b("And", [met, row_beats], "beaten"), before], "drops")
    i_drops = b("And", [b("Equal", [ids, it], "is_i"),
                        b("Greater", [b("ReduceSum", [loses], "lost", keepdims=0), zero], "i_lost")], "i_drops")
    alive_out = b("And", [alive_in, b("Not", [b("Or", [drops, i_drops], "gone")], "stays")], "alive_out")
    graph = helper.make_graph(
        body, f"{node.name}_nms_step",
        [helper.make_tensor_value_info(alive_in, TensorProto.BOOL, [None]),
         helper.make_tensor_value_info(it, TensorProto.INT64, []),
         helper.make_tensor_value_info(row_hit, TensorProto.BOOL, [None]),
         helper.make_tensor_value_info(row_beats, TensorProto.BOOL, [None])],
        [helper.make_tensor_value_info(alive_out, TensorProto.BOOL, [None])])
    alive0 = ctx.op("ConstantOfShape", [k_pad], "alive0", value=np.array([True]))
    # a Scan (not a Loop: ONNX infers no shape for a Loop's carried values) over box i and its rows
    alive = ctx.add_node("Scan", [alive0, ids, hit, beats], [ctx.tmp(f"{node.name}_alive")], name=node.name,
                         body=graph, num_scan_inputs=3)[0]
    alive = ctx.op("Slice", [alive, ctx.i64([0]), k1, ctx.i64([0])], "alive_k")
    keep = ctx.op("And", [alive, ctx.op("Greater", [obj, ctx.f32(0.0)], "obj_pos")], "kept")
    g = [ctx.op("Compress", [v, keep], f"g{i}", axis=0) for i, v in enumerate((bx, by, bw, bh, lab, score))]
    columns = [ctx.op("Mul", [g[5], ctx.f32(0.0)], "zero"),
               ctx.op("Cast", [g[4]], "label", to=1), g[5], g[0], g[1], g[2], g[3]]
    emit_rows_or_fallback(ctx, node, ctx.op, columns)


def emit_pytorch_source(node, emit):
    a = node.attrs
    emit.helper(yolo_v2_candidates)
    fn = emit.helper(TORCH_YOLO_V2_CELL_ORDER)
    emit.note(f"{node.name} (DetectionOutput, caffe-yolov2): the number of rows depends on the data; "
              f"NMS runs eagerly, so this layer does not trace.")
    return (f"{fn}({emit.inputs[0]}, {emit.lit(a['biases'], exact=True)}, {a['num_box']}, {a['num_classes']}, "
            f"{emit.lit(a['conf_threshold'], exact=True)}, {emit.lit(a['nms_threshold'], exact=True)}, "
            f"{emit.lit(_duel(a))})")


@claim_layers("DetectionOutput", claims)
class YoloV2DetectionOutput(Layer):
    """caffe-yolov2's one-bottom DetectionOutput (see the module doc): claims the type's one-bottom layers."""

    #: the row count is known only after a run; infer gives the most rows
    data_dependent_shape = True

    def parse(self, lp):
        p = lp.detection_output_param
        if len(lp.top) != 1:
            raise LayerError(f"caffe-yolov2's DetectionOutput gives one top, got {len(lp.top)}")
        duel = p.HasField("classes")     # BirdeeChen/caffe_yolo_v2's name for the class count, and its NMS
        if duel and p.HasField("num_classes"):
            raise LayerError("detection_output_param sets both num_classes (gklz1982/caffe-yolov2) and classes "
                             "(BirdeeChen/caffe_yolo_v2); the layer is one fork's or the other's")
        classes = int(p.classes if duel else p.num_classes)
        if not (duel or p.HasField("num_classes")) or classes < 1:
            raise LayerError("detection_output_param.num_classes (BirdeeChen/caffe_yolo_v2: classes) is required "
                             "(>= 1)")
        num_box, side = int(p.num_box), int(p.side)
        if num_box < 1 or side < 1:
            raise LayerError(f"detection_output_param.num_box and side must be >= 1, got {num_box} and {side}")
        biases = [float(v) for v in p.biases]
        ssd_fields = [f for f in ("nms_param", "code_type", "share_location", "keep_top_k") if p.HasField(f)]
        if not biases and ssd_fields:
            raise LayerError(f"SSD's DetectionOutput (it sets {', '.join(ssd_fields)}) takes 3 bottoms (loc, conf, "
                             f"priors), got {len(lp.bottom)}; with one bottom it would be caffe-yolov2's, which needs "
                             "detection_output_param.biases")
        if len(biases) < 2 * num_box:
            raise LayerError(f"detection_output_param.biases has {len(biases)} values; {num_box} boxes need "
                             f"{2 * num_box} (a width and a height each)")
        threshold = float(p.confidence_threshold) if p.HasField("confidence_threshold") else 0.01
        return {"name": lp.name, "num_classes": classes, "num_box": num_box,
                "side": side, "biases": biases[:2 * num_box], "conf_threshold": threshold,
                "nms_threshold": float(p.nms_threshold), "nms": "objectness" if duel else "cell_order"}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"caffe-yolov2's DetectionOutput needs a 4-axis map, got {list(s)}")
        if s[1] % attrs["num_box"] or s[1] // attrs["num_box"] < 5 + attrs["num_classes"]:
            raise LayerError(f"channels {s[1]} must be num_box {attrs['num_box']} x at least 5 + num_classes "
                             f"{attrs['num_classes']}")
        return [(1, 1, attrs["side"] * attrs["side"] * attrs["num_box"], 7)]

    def cannot_run(self, attrs, in_shapes):
        """Caffe reads such a net (Reshape checks nothing of the map) and fails or reads garbage in forward."""
        shape, side = tuple(in_shapes[0]), attrs["side"]
        if shape[0] != 1:
            return (f"caffe-yolov2's form: the fork takes one image (its CHECK_EQ(num, 1)), got a batch of "
                    f"{shape[0]}")
        if tuple(shape[2:]) != (side, side):
            return (f"caffe-yolov2's form: the fork indexes cells by side {side}, but the map is "
                    f"{shape[2]}x{shape[3]}")
        return None

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape])
        return yolo_v2_cell_order_rows(x, attrs["biases"], attrs["num_box"], attrs["num_classes"],
                                       attrs["conf_threshold"], attrs["nms_threshold"], _duel(attrs))

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(node.inputs[0])], ExportError, node.type)
        emit_onnx(ctx, node)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError, node.type)
        return emit_pytorch_source(node, emit)
