"""happynear/caffe-windows's PredictBox (98b1d7d, src/caffe/layers/predict_box_layer.cpp / .cu; the
MTCNN v2 nets of happynear/MTCNN_face_detection_alignment, whose demo runs Caffe on the GPU, so the CUDA
kernels are read).  Bottoms: scores (N, 2, H, W), optionally box regressions (N, 4, H, W) and a third
bottom: with 2 channels an NMS map, with 3 a stitch map (bias x, bias y, receptive field); any other
channel count is not read.  Top 0, dense boxes (N, 5, H, W): at each (h, w) where score[1] >
positive_thresh, score[1] < 1 + 1e-6 (in double) and, with an NMS map, score[1] > nms[1] - 1e-6 (in
double), or, with a stitch map, where its receptive field is not 0:

    x = (w * stride - bias_x) / 12 * rf,  y = (h * stride - bias_y) / 12 * rf,  width = height = rf,
    score = score[1]

rf being receptive_field (or the stitch map's), the biases 0 without a stitch map; the NMS kernel writes
x = w * stride and y = h * stride.  Then the regressions r: bbreg_exp moves x by r0 * rf and y by r1 * rf
and multiplies width and height by exp(r2), exp(r3); otherwise x moves by r1 * rf, y by r0 * rf, width
grows by (r3 - r1) * rf and height by (r2 - r0) * rf.  Elsewhere all five are 0.  The stitch kernel
reads plane 2n + c of the stitch map (the fork's index; the CPU forward reads 3n + c): for one image
both agree.

A second top lists the boxes: with one image and k > 0 kept positions, (1, k, 5) in the order x (then
y) of the positions whose stored score exceeds positive_thresh; otherwise (N, 1, 5) zeros.  A negative
positive_thresh is refused: the list would then count positions it does not hold (the fork writes past
it).  nvcc may fuse the regressions' multiply-adds and computes exp in its own way: those may differ in
the last bit.
"""
import numpy as np
import torch

from .registry import Layer, LayerError, four_axes, need_blobs, register_layer

DOUBLE = 11   # onnx.TensorProto.DOUBLE

PLAIN, NMS, STITCH = "plain", "nms", "stitch"


def map_mode(third_shape):
    """What the third bottom is, from its channels (LayerSetUp's test): an NMS map, a stitch map or unread."""
    if third_shape is None:
        return PLAIN
    return {2: NMS, 3: STITCH}.get(tuple(third_shape)[1], PLAIN)


def dense_boxes(scores, regressions: torch.Tensor | None, third: torch.Tensor | None, mode: str, stride: int,
                field: float, thresh: float, exp_form: bool):
    """PredictBox's top 0 (N, 5, H, W) and the mask of the kept positions (N, H, W)."""
    n, _, height, width = scores.shape
    p = scores[:, 1]
    keep = (p > thresh) & (p.double() < 1 + 1e-6)
    cols = (torch.arange(width, device=p.device) * stride).to(p.dtype).expand(n, height, width)
    rows = (torch.arange(height, device=p.device) * stride).to(p.dtype)[:, None].expand(n, height, width)
    rf = torch.full_like(p, field)
    if mode == "nms" and third is not None:
        keep = keep & (p.double() > third[:, 1].double() - 1e-6)
        x, y = cols, rows
    else:
        bias_x, bias_y = torch.zeros_like(p), torch.zeros_like(p)
        if mode == "stitch" and third is not None:
            planes = third.reshape(-1, height, width)
            at = torch.arange(n, device=p.device) * 2
            bias_x, bias_y, rf = planes[at], planes[at + 1], planes[at + 2]
            keep = keep & (rf != 0)
        x = (cols - bias_x) / 12.0 * rf
        y = (rows - bias_y) / 12.0 * rf
    size_w, size_h = rf, rf
    if regressions is not None:
        r0, r1, r2, r3 = regressions.unbind(1)
        if exp_form:
            x, y = x + r0 * rf, y + r1 * rf
            size_w, size_h = size_w * torch.exp(r2), size_h * torch.exp(r3)
        else:
            x, y = x + r1 * rf, y + r0 * rf
            size_w, size_h = size_w + (r3 - r1) * rf, size_h + (r2 - r0) * rf
    boxes = torch.stack([x, y, size_w, size_h, p], 1)
    return torch.where(keep[:, None], boxes, torch.zeros_like(boxes)), keep


def listed_boxes(boxes, keep, thresh: float):
    """PredictBox's second top: one image's boxes (1, k, 5), positions x-major, or (N, 1, 5) zeros."""
    n = boxes.shape[0]
    if n == 1 and bool(keep.any()):
        rows = boxes[0].permute(2, 1, 0).reshape(-1, 5)     # x outer, y inner, as the fork's loops
        return rows[rows[:, 4] > thresh][None]
    return boxes.new_zeros((n, 1, 5))


def predict_box(scores, regressions: torch.Tensor | None, third: torch.Tensor | None, mode: str, stride: int,
                field: float, thresh: float, exp_form: bool, listed: bool):
    """PredictBox's tops: [dense boxes] or [dense boxes, their list]."""
    boxes, keep = dense_boxes(scores, regressions, third, mode, stride, field, thresh, exp_form)
    return [boxes, listed_boxes(boxes, keep, thresh)] if listed else [boxes]


@register_layer("PredictBox")
class PredictBox(Layer):
    data_dependent_shape = True   # the list: (N, 1, 5) until a forward sizes it

    def parse(self, lp):
        need_blobs(lp, "PredictBox", (1, 2, 3), (1, 2), "scores, regressions, nms or stitch map")
        p = lp.predict_box_param
        thresh = float(np.float32(p.positive_thresh))
        if not thresh >= 0:
            raise LayerError(f"predict_box_param.positive_thresh must be >= 0, got {thresh}: below 0 the fork's "
                             f"box list counts fewer positions than it writes")
        notes = [f"predict_box_param.{f} is not read: the fork decides it from the bottom and top counts"
                 for f in ("nms", "output_vector") if p.HasField(f)]
        return {"stride": int(p.stride), "field": float(np.float32(p.receptive_field)), "thresh": thresh,
                "exp_form": bool(p.bbreg_exp), "bottom_count": len(lp.bottom), "listed": len(lp.top) == 2,
                "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "PredictBox", "scores (bottom 0)")
        if c != 2:
            raise LayerError(f"PredictBox's scores must have 2 channels, got {c}")
        if len(in_shapes) >= 2:
            r = four_axes(in_shapes[1], "PredictBox", "regressions (bottom 1)")
            if r != (n, 4, h, w):
                raise LayerError(f"PredictBox's regressions must be {[n, 4, h, w]}, got {list(r)}")
        if len(in_shapes) == 3:
            t = four_axes(in_shapes[2], "PredictBox", "nms or stitch map (bottom 2)")
            mode = map_mode(t)
            if mode != PLAIN and (t[0], t[2], t[3]) != (n, h, w):
                raise LayerError(f"PredictBox's {mode} map must be {[n, t[1], h, w]}, got {list(t)}")
        return [(n, 5, h, w)] + ([(n, 1, 5)] if attrs["listed"] else [])

    def macs(self, attrs, in_shapes, out_shapes):
        return 10 * in_shapes[0][0] * in_shapes[0][2] * in_shapes[0][3]

    def _args(self, attrs, third_shape):
        return (map_mode(third_shape), attrs["stride"], attrs["field"], attrs["thresh"], attrs["exp_form"])

    def forward(self, attrs, params, scores, regressions=None, third=None):
        args = self._args(attrs, None if third is None else third.shape)
        tops = predict_box(scores, regressions, third, *args, attrs["listed"])
        return tuple(tops) if len(tops) > 1 else tops[0]

    def pytorch_source(self, node, emit):
        emit.helper(dense_boxes)
        emit.helper(listed_boxes)
        fn = emit.helper(predict_box)
        ins = list(emit.inputs) + ["None"] * (3 - len(emit.inputs))
        third = emit.in_shape(2) if len(emit.inputs) == 3 else None
        args = ", ".join(emit.lit(v) for v in self._args(node.attrs, third) + (node.attrs["listed"],))
        out = emit.tmp("boxes")
        emit.stmt(f"{out} = {fn}({', '.join(ins)}, {args})")
        return [f"{out}[{i}]" for i in range(len(node.outputs))]

    def onnx(self, ctx, node):
        a = node.attrs
        scores, *rest = node.inputs
        regressions = rest[0] if rest else None
        third = rest[1] if len(rest) == 2 else None
        mode = map_mode(ctx.shape(third) if third else None)
        _, _, height, width = ctx.shape(scores)
        p = ctx.op("Gather", [scores, ctx.i64(1)], "score", name=node.name, axis=1)
        p_double = ctx.op("Cast", [p], "score_double", to=DOUBLE)
        keep = ctx.op("And", [ctx.op("Greater", [p, ctx.f32(a["thresh"])], "above"),
                              ctx.op("Less", [p_double, ctx.const(np.array(1 + 1e-6))], "below_one")], "keep")
        full = ctx.op("Shape", [p], "map_shape")
        cols = ctx.op("Expand", [ctx.f32((np.arange(width) * a["stride"]).astype(np.float32)), full], "cols")
        rows = ctx.op("Expand", [ctx.f32((np.arange(height) * a["stride"]).astype(np.float32)[:, None]), full],
                      "rows")
        rf = ctx.op("Expand", [ctx.f32(a["field"]), full], "field")
        if mode == NMS:
            suppressor = ctx.op("Cast", [ctx.op("Gather", [third, ctx.i64(1)], "nms_score", axis=1)], "nms_double",
                                to=DOUBLE)
            keep = ctx.op("And", [keep, ctx.op("Greater", [p_double, ctx.op(
                "Sub", [suppressor, ctx.const(np.array(1e-6))], "nms_floor")], "not_suppressed")], "keep_nms")
            x, y = cols, rows
        else:
            if mode == STITCH:
                planes = ctx.op("Reshape", [third, ctx.i64([-1, height, width])], "stitch_planes")
                images = ctx.op("Gather", [full, ctx.i64(0)], "images", axis=0)
                first = ctx.op("Mul", [ctx.op("Range", [ctx.i64(0), images, ctx.i64(1)], "image_index"),
                                       ctx.i64(2)], "stitch_first")
                bias_x, bias_y, rf = (ctx.op("Gather", [planes, ctx.op("Add", [first, ctx.i64(c)], f"plane{c}")],
                                             f"stitch{c}", axis=0) for c in range(3))
                keep = ctx.op("And", [keep, ctx.op("Not", [ctx.op("Equal", [rf, ctx.f32(0.0)], "no_field")],
                                                   "has_field")], "keep_stitch")
                cols = ctx.op("Sub", [cols, bias_x], "cols_shifted")
                rows = ctx.op("Sub", [rows, bias_y], "rows_shifted")
            x = ctx.op("Mul", [ctx.op("Div", [cols, ctx.f32(12.0)], "x_cells"), rf], "x")
            y = ctx.op("Mul", [ctx.op("Div", [rows, ctx.f32(12.0)], "y_cells"), rf], "y")
        size_w = size_h = rf
        if regressions is not None:
            r0, r1, r2, r3 = (ctx.op("Gather", [regressions, ctx.i64(c)], f"reg{c}", axis=1) for c in range(4))

            def moved(v, r, hint):
                return ctx.op("Add", [v, ctx.op("Mul", [r, rf], hint + "_step")], hint)
            if a["exp_form"]:
                x, y = moved(x, r0, "x_reg"), moved(y, r1, "y_reg")
                size_w = ctx.op("Mul", [size_w, ctx.op("Exp", [r2], "exp_w")], "w_reg")
                size_h = ctx.op("Mul", [size_h, ctx.op("Exp", [r3], "exp_h")], "h_reg")
            else:
                x, y = moved(x, r1, "x_reg"), moved(y, r0, "y_reg")
                size_w = moved(size_w, ctx.op("Sub", [r3, r1], "dw"), "w_reg")
                size_h = moved(size_h, ctx.op("Sub", [r2, r0], "dh"), "h_reg")
        parts = [ctx.op("Unsqueeze", [v, ctx.i64([1])], f"part{i}") for i, v in enumerate((x, y, size_w, size_h, p))]
        boxes = ctx.op("Concat", parts, "boxes", axis=1)
        kept = ctx.op("Unsqueeze", [keep, ctx.i64([1])], "keep_axis")
        dense = node.outputs[0] if ctx.needed(node.outputs[0]) or not a["listed"] else ctx.tmp(node.name + "_dense")
        ctx.add_node("Where", [kept, boxes, ctx.f32(0.0)], [dense])
        if a["listed"]:
            _onnx_box_list(ctx, dense, full, a["thresh"], node.outputs[1])


def _onnx_box_list(ctx, dense, full, thresh, out):
    """listed_boxes in ONNX: Compress over the first image's x-major positions, then (1, k, 5) where one
    image kept k > 0 boxes, else (N, 1, 5) zeros (a zero row appended, sliced and masked, expanded)."""
    first_image = ctx.op("Gather", [dense, ctx.i64(0)], "first_image", axis=0)
    positions = ctx.op("Reshape", [ctx.op("Transpose", [first_image], "x_major", perm=[2, 1, 0]),
                                   ctx.i64([-1, 5])], "positions")
    score = ctx.op("Gather", [positions, ctx.i64(4)], "listed_score", axis=1)
    listed = ctx.op("Compress", [positions, ctx.op("Greater", [score, ctx.f32(thresh)], "listed_keep")],
                    "listed", axis=0)
    images = ctx.op("Gather", [full, ctx.i64([0])], "image_count", axis=0)
    kept = ctx.op("Gather", [ctx.op("Shape", [listed], "listed_shape"), ctx.i64([0])], "kept_count", axis=0)
    one = ctx.i64([1])
    use = ctx.op("And", [ctx.op("Equal", [images, one], "one_image"),
                         ctx.op("Greater", [kept, ctx.i64([0])], "some_kept")], "use_list")
    lead = ctx.op("Where", [use, one, images], "lead")
    length = ctx.op("Where", [use, kept, one], "length")
    padded = ctx.op("Concat", [listed, ctx.f32(np.zeros((1, 5), np.float32))], "padded", axis=0)
    cut = ctx.op("Slice", [padded, ctx.i64([0]), length, ctx.i64([0])], "cut")
    masked = ctx.op("Where", [use, cut, ctx.f32(0.0)], "masked")
    shape = ctx.op("Concat", [lead, length, ctx.i64([5])], "list_shape", axis=0)
    ctx.add_node("Expand", [ctx.op("Unsqueeze", [masked, ctx.i64([0])], "one_list"), shape], [out])
