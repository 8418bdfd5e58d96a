"""The ACT-detector's ACTDetectionOutput (vkalogeiton/caffe, branch act-detector a431461:
src/caffe/layers/ACT_detection_output_layer.cu and src/caffe/util/ACT_cuboid_util.cu / .cpp; its
action tubelet nets run on the GPU, whose forward is read).  SSD's DetectionOutput over tubes: each
prior predicts sequence_length boxes (loc holds 4 * sequence_length numbers per prior and location
class), every frame's box decoded against the same prior (CENTER_SIZE only, variances from the priors:
the fork implements nothing else); one score per tube and class.

- NMS per class as SSD's ApplyNMSFast, the overlap of two tubes being the mean of their frames'
  Jaccard overlaps (summed in float32 frame by frame, then divided by sequence_length).
- Rows [image, label, score, then xmin, ymin, xmax, ymax of each frame] shaped (1, 1, R, 3 + 4 L); per
  image by label, then score; keep_top_k over an image's classes; with none at all one [i, -1, ...]
  row per image.
- save_full (share_location only): every prior's tube instead, rows [image, its 4 L coordinates, its
  C class scores], (1, 1, N P, 1 + 4 L + C), without NMS or thresholds.

ONNX: save_full's rows export; the tube NMS does not (ONNX's NonMaxSuppression compares single boxes).
"""
import numpy as np
import torch

from ..registry import Layer, LayerError, need_blobs, register_layer
from .common import CENTER_SIZE, FLT_MAX
from .detection_output import decode_boxes
from .nms import box_sizes, jaccard_overlaps, nms_candidates


def tube_overlaps(tubes):
    """Mean over the frames of the Jaccard overlaps of tubes (K, L, 4) with each other -> (K, K): the
    frames' overlaps added in order in float32, then divided by L."""
    length = tubes.shape[1]
    total = torch.zeros(tubes.shape[0], tubes.shape[0], dtype=torch.float32)
    for j in range(length):
        frame = tubes[:, j]
        sizes = box_sizes(frame)
        total = total + jaccard_overlaps(frame, frame, sizes, sizes)
    return total / length


def tube_nms(tubes, scores, score_threshold: float, nms_threshold: float, eta: float, top_k: int):
    """ACTApplyNMSTubeFast for one class: tubes (P, L, 4), scores (P,) -> the kept indices, best first
    (SSD's ApplyNMSFast with tube_overlaps)."""
    f32 = torch.float32
    order = nms_candidates(scores, score_threshold, top_k)
    if order.numel() == 0:
        return []
    overlaps = tube_overlaps(tubes[order])
    thr = torch.tensor(nms_threshold, dtype=f32)
    picked = order.tolist()
    kept_rows = []
    for j in range(len(picked)):
        if all(bool(overlaps[j, k] <= thr) for k in kept_rows):
            kept_rows.append(j)
            if eta < 1 and thr > 0.5:
                thr = thr * torch.tensor(eta, dtype=f32)
    return [picked[j] for j in kept_rows]


def act_tubes(loc, prior, n_loc: int, length: int):
    """The decoded tubes (N, n_loc, P, L, 4) and the priors' count."""
    n_priors = prior.shape[-1] // 4
    pri = prior.reshape(-1, 2, n_priors * 4)[0]
    pbox, pvar = pri[0].reshape(n_priors, 4), pri[1].reshape(n_priors, 4)
    loc = loc.reshape(loc.shape[0], n_priors, n_loc, length, 4).permute(0, 2, 3, 1, 4)   # (N, n_loc, L, P, 4)
    return decode_boxes(loc, pbox, pvar, "CENTER_SIZE", False).transpose(2, 3), n_priors


def act_full_rows(loc, conf, prior, num_classes: int, length: int):
    """save_full: rows [image, every frame's box, the class scores] for each image and prior."""
    tubes, n_priors = act_tubes(loc, prior, 1, length)
    num = loc.shape[0]
    image = torch.arange(num, dtype=loc.dtype, device=loc.device)[:, None, None].expand(num, n_priors, 1)
    rows = torch.cat([image, tubes[:, 0].reshape(num, n_priors, 4 * length),
                      conf.reshape(num, n_priors, num_classes)], 2)
    return rows.reshape(1, 1, num * n_priors, -1)


def act_detections(loc, conf, prior, num_classes: int, share_location: bool, background: int, length: int,
                   nms_threshold: float, eta: float, top_k: int, keep_top_k: int, conf_threshold: float):
    """ACTDetectionOutput's rows (1, 1, R, 3 + 4 L), as the module docstring says."""
    num = loc.shape[0]
    n_loc = 1 if share_location else num_classes
    tubes, n_priors = act_tubes(loc, prior, n_loc, length)
    scores = conf.reshape(num, n_priors, num_classes)
    tubes_cpu, scores_cpu = tubes.detach().float().cpu(), scores.detach().float().cpu()
    picks = []
    for i in range(num):
        per_label = {}
        for c in range(num_classes):
            if c != background:
                per_label[c] = tube_nms(tubes_cpu[i, 0 if share_location else c], scores_cpu[i, :, c],
                                        conf_threshold, nms_threshold, eta, top_k)
        if keep_top_k > -1 and sum(len(v) for v in per_label.values()) > keep_top_k:
            pool = [(float(scores_cpu[i, idx, c]), c, idx) for c in sorted(per_label) for idx in per_label[c]]
            pool.sort(key=lambda t: -t[0])   # stable: ties stay in label order
            per_label = {}
            for _, c, idx in pool[:keep_top_k]:
                per_label.setdefault(c, []).append(idx)
        for c in sorted(per_label):
            picks.extend((i, c, idx) for idx in per_label[c])
    cols = 3 + 4 * length
    if not picks:
        out = torch.full((num, cols), -1.0, dtype=loc.dtype, device=loc.device)
        out[:, 0] = torch.arange(num, dtype=loc.dtype, device=loc.device)
        return out.reshape(1, 1, num, cols)
    img = torch.tensor([p[0] for p in picks], device=loc.device)
    lab = torch.tensor([p[1] for p in picks], device=loc.device)
    idx = torch.tensor([p[2] for p in picks], device=loc.device)
    tube = tubes[img, torch.zeros_like(lab) if share_location else lab, idx].reshape(-1, 4 * length)
    out = torch.cat([img.to(loc.dtype)[:, None], lab.to(loc.dtype)[:, None], scores[img, idx, lab][:, None], tube], 1)
    return out.reshape(1, 1, -1, cols)


@register_layer("ACTDetectionOutput")
class ACTDetectionOutput(Layer):
    data_dependent_shape = True   # the rows (save_full's are N x P)

    def parse(self, lp):
        need_blobs(lp, "ACTDetectionOutput", 3, 1, "loc, conf, priors")
        p, act = lp.detection_output_param, lp.act_detection_output_param
        if not act.HasField("sequence_length") or act.sequence_length < 1:
            raise LayerError("act_detection_output_param.sequence_length (>= 1) is required")
        if not p.HasField("num_classes") or p.num_classes < 1:
            raise LayerError("detection_output_param.num_classes (>= 1) is required")
        if p.code_type != CENTER_SIZE or p.variance_encoded_in_target:
            raise LayerError("ACTDetectionOutput decodes CENTER_SIZE with the priors' variances only (the fork's "
                             "other code types and variance_encoded_in_target are not implemented)")
        nms = p.nms_param
        if nms.nms_threshold < 0 or not 0 < nms.eta <= 1:
            raise LayerError(f"nms_param.nms_threshold must be >= 0 and eta in (0, 1], got {nms.nms_threshold} "
                             f"and {nms.eta}")
        if act.save_full and not p.share_location:
            raise LayerError("act_detection_output_param.save_full needs share_location (the fork's check)")
        return {"num_classes": int(p.num_classes), "share_location": bool(p.share_location),
                "background": int(p.background_label_id), "length": int(act.sequence_length),
                "nms_threshold": float(nms.nms_threshold), "eta": float(nms.eta),
                "top_k": int(nms.top_k) if nms.HasField("top_k") else -1, "keep_top_k": int(p.keep_top_k),
                "conf_threshold": float(p.confidence_threshold) if p.HasField("confidence_threshold") else -FLT_MAX,
                "save_full": bool(act.save_full)}

    def infer(self, attrs, in_shapes):
        loc, conf, prior = in_shapes
        if len(prior) != 3 or prior[1] != 2 or prior[2] % 4:
            raise LayerError(f"priors must be shaped (1, 2, 4 * num_priors), got {list(prior)}")
        n_priors, length, classes = prior[2] // 4, attrs["length"], attrs["num_classes"]
        n_loc = 1 if attrs["share_location"] else classes
        if len(loc) < 2 or int(np.prod(loc[1:])) != n_priors * n_loc * 4 * length:
            raise LayerError(f"loc {list(loc)} must hold {n_priors} priors x {n_loc} location classes x 4 x "
                             f"sequence_length {length} numbers per item")
        if len(conf) < 2 or conf[0] != loc[0] or int(np.prod(conf[1:])) != n_priors * classes:
            raise LayerError(f"conf {list(conf)} must hold {n_priors} priors x {classes} class scores per item")
        if attrs["save_full"]:
            return [(1, 1, loc[0] * n_priors, 1 + 4 * length + classes)]
        most = loc[0] * (attrs["keep_top_k"] if attrs["keep_top_k"] > -1 else n_priors * classes)
        return [(1, 1, max(most, loc[0]), 3 + 4 * length)]

    def _args(self, a):
        return (a["num_classes"], a["share_location"], a["background"], a["length"], a["nms_threshold"],
                a["eta"], a["top_k"], a["keep_top_k"], a["conf_threshold"])

    def forward(self, attrs, params, loc, conf, prior):
        if attrs["save_full"]:
            return act_full_rows(loc, conf, prior, attrs["num_classes"], attrs["length"])
        return act_detections(loc, conf, prior, *self._args(attrs))

    def onnx(self, ctx, node):
        a = node.attrs
        if not a["save_full"]:
            from ...errors import ExportError
            raise ExportError(f"layer '{node.name}' (ACTDetectionOutput): its NMS compares tubes by their frames' "
                              f"mean overlap, which ONNX's NonMaxSuppression cannot; save_full's rows export")
        loc, conf, prior = node.inputs
        length, classes = a["length"], a["num_classes"]
        n_priors = ctx.shape(prior)[2] // 4
        pri = ctx.op("Reshape", [ctx.op("Gather", [ctx.op("Reshape", [prior, ctx.i64([-1, 2, n_priors * 4])],
                                                          "priors_items", name=node.name), ctx.i64(0)],
                                        "priors_first", axis=0), ctx.i64([2, n_priors, 1, 4])], "priors")
        box = ctx.op("Gather", [pri, ctx.i64(0)], "prior_box", axis=0)       # (P, 1, 4)
        var = ctx.op("Gather", [pri, ctx.i64(1)], "prior_var", axis=0)
        offsets = ctx.op("Reshape", [loc, ctx.i64([0, n_priors, length, 4])], "offsets")
        coords = _onnx_decode(ctx, offsets, box, var)                        # (N, P, L, 4)
        loc_shape = ctx.op("Shape", [loc], "loc_shape")
        images = ctx.op("Gather", [loc_shape, ctx.i64(0)], "images", axis=0)
        column = ctx.op("Reshape", [ctx.op("Range", [ctx.i64(0), images, ctx.i64(1)], "image_index"),
                                    ctx.i64([-1, 1, 1])], "image_column")
        image = ctx.op("Expand", [ctx.op("Cast", [column], "image_float", to=1), ctx.op(
            "Concat", [ctx.op("Gather", [loc_shape, ctx.i64([0])], "images_1d", axis=0), ctx.i64([n_priors, 1])],
            "image_shape", axis=0)], "image")
        rows = ctx.op("Concat", [image, ctx.op("Reshape", [coords, ctx.i64([0, n_priors, 4 * length])], "flat"),
                                 ctx.op("Reshape", [conf, ctx.i64([0, n_priors, classes])], "scores")],
                      "rows", axis=2)
        ctx.add_node("Reshape", [rows, ctx.i64([1, 1, -1, 1 + 4 * length + classes])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(decode_boxes)
        emit.helper(act_tubes)
        if a["save_full"]:
            fn = emit.helper(act_full_rows)
            return f"{fn}({', '.join(emit.inputs)}, {a['num_classes']}, {a['length']})"
        emit.helper(box_sizes)
        emit.helper(jaccard_overlaps)
        emit.helper(nms_candidates)
        emit.helper(tube_overlaps)
        emit.helper(tube_nms)
        emit.note(f"{node.name} (ACTDetectionOutput): the number of rows depends on the data; its tube NMS "
                  f"runs eagerly on the CPU, so this layer does not trace or export to a static graph.")
        fn = emit.helper(act_detections)
        return f"{fn}({', '.join(emit.inputs)}, {', '.join(emit.lit(v) for v in self._args(a))})"


def _onnx_decode(ctx, offsets, box, var):
    """decode_boxes' CENTER_SIZE in ONNX: offsets (N, P, L, 4) against box, var (P, 1, 4)."""
    def part(t, i, hint):
        return ctx.op("Slice", [t, ctx.i64([i]), ctx.i64([i + 1]), ctx.i64([-1])], hint)
    x0, y0, x1, y1 = (part(box, i, f"p{i}") for i in range(4))
    pw, ph = ctx.op("Sub", [x1, x0], "pw"), ctx.op("Sub", [y1, y0], "ph")
    half = ctx.f32(2.0)
    pcx = ctx.op("Div", [ctx.op("Add", [x0, x1], "px"), half], "pcx")
    pcy = ctx.op("Div", [ctx.op("Add", [y0, y1], "py"), half], "pcy")
    v0, v1, v2, v3 = (part(var, i, f"v{i}") for i in range(4))
    t0, t1, t2, t3 = (part(offsets, i, f"t{i}") for i in range(4))
    cx = ctx.op("Add", [ctx.op("Mul", [ctx.op("Mul", [v0, t0], "vx"), pw], "dx"), pcx], "cx")
    cy = ctx.op("Add", [ctx.op("Mul", [ctx.op("Mul", [v1, t1], "vy"), ph], "dy"), pcy], "cy")
    w = ctx.op("Mul", [ctx.op("Exp", [ctx.op("Mul", [v2, t2], "vw")], "ew"), pw], "w")
    h = ctx.op("Mul", [ctx.op("Exp", [ctx.op("Mul", [v3, t3], "vh")], "eh"), ph], "h")
    hw, hh = ctx.op("Div", [w, half], "hw"), ctx.op("Div", [h, half], "hh")
    return ctx.op("Concat", [ctx.op("Sub", [cx, hw], "xmin"), ctx.op("Sub", [cy, hh], "ymin"),
                             ctx.op("Add", [cx, hw], "xmax"), ctx.op("Add", [cy, hh], "ymax")], "tube", axis=-1)
