"""Huawei Ascend's ATC converter (CANN): SSDDetectionOutput, the SSD post-processing operator its guide has users
append to an SSD prototxt (ssddetectionoutput_param = 232; SSDDetectionOutputParameter fields 1-10 with the
defaults of Ascend/parser's caffe.proto), read and sized, not run.

- bottoms: box offsets (N, priors x 4, ...), class scores (N, priors x num_classes, ...) and the priors
  (1 or N, 2 or 1, priors x 4), as SSD's DetectionOutput reads them.  The operator requires share_location,
  eta 1, top_k > 0, keep_top_k in [1, 1024] or -1, num_classes in [1, 1024], a background label below it (or
  -1), iou_threshold in (0, 1], code_type 1 to 3 and confidence_threshold in [0, 1].
- tops: each image's box count, int32 (N, 8) with the count in column 0; its boxes, (N, R, 8) rows of image
  id, label, score, xmin, ymin, xmax, ymax and one unset value, R = keep_top_k rounded up to a multiple of
  128 (1024 for -1); the rows past the count are unset.
The chip computes in float16 and clips the boxes to [0, 1] before its NMS, so SSD's DetectionOutput is not its
forward.  A file that writes these settings in SSD's detection_output_param (BestDAHU/Atlas200DK's) gives values
ATC never reads: its parser skips the fields its DetectionOutputParameter lacks (iou_threshold, eta) and the
operator reads only ssddetectionoutput_param, whose defaults then apply; a note says so.
"""
import math

from ..registry import LayerError, ReadOnlyLayer, register_layer

ROW_BLOCK, MAX_ROWS = 128, 1024


@register_layer("SSDDetectionOutput")
class SSDDetectionOutput(ReadOnlyLayer):
    bottoms, tops = 3, 2
    bottom_roles = "loc, conf, priors"

    def parse(self, lp):
        p = lp.ssddetectionoutput_param
        if not p.share_location:
            raise LayerError("ssddetectionoutput_param.share_location must be true (the operator's limit)")
        if p.eta != 1:
            raise LayerError(f"ssddetectionoutput_param.eta must be 1 (the operator's limit), got {p.eta:g}")
        if p.top_k < 1:
            raise LayerError(f"ssddetectionoutput_param.top_k must be > 0, got {p.top_k}")
        if not (1 <= p.keep_top_k <= MAX_ROWS or p.keep_top_k == -1):
            raise LayerError(f"ssddetectionoutput_param.keep_top_k must be in [1, {MAX_ROWS}] or -1, got {p.keep_top_k}")
        limits = (("num_classes", p.num_classes, 1 <= p.num_classes <= 1024, "[1, 1024]"),
                  ("background_label_id", p.background_label_id, -1 <= p.background_label_id < p.num_classes,
                   f"[-1, num_classes - 1 = {p.num_classes - 1}]"),
                  ("iou_threshold", p.iou_threshold, 0 < p.iou_threshold <= 1, "(0, 1]"),
                  ("code_type", p.code_type, 1 <= p.code_type <= 3, "1 (CORNER), 2 (CENTER_SIZE) or 3 (CORNER_SIZE)"),
                  ("confidence_threshold", p.confidence_threshold, 0 <= p.confidence_threshold <= 1, "[0, 1]"))
        for field, value, ok, allowed in limits:
            if not ok:
                raise LayerError(f"ssddetectionoutput_param.{field} must be {allowed} (the operator's limit), "
                                 f"got {value:g}")
        notes = []
        if lp.HasField("detection_output_param") and not lp.HasField("ssddetectionoutput_param"):
            notes.append("its settings are in detection_output_param, which Ascend's converter does not read for "
                         "SSDDetectionOutput (it reads ssddetectionoutput_param): its defaults apply there, and "
                         "here (keep_top_k -1: 1024 rows)")
        return {"name": lp.name, "num_classes": int(p.num_classes), "classes_given": p.HasField("num_classes"),
                "keep_top_k": int(p.keep_top_k), "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        loc, conf, prior = (tuple(s) for s in in_shapes)
        if len(prior) < 3 or prior[1] not in (1, 2) or prior[2] % 4:
            raise LayerError(f"priors must be shaped (1 or N, 2 or 1, 4 x priors), got {list(prior)}")
        n, priors = loc[0] if loc else 0, prior[2] // 4
        if len(loc) < 2 or math.prod(loc[1:]) != 4 * priors:
            raise LayerError(f"loc {list(loc)} does not hold {priors} priors x 4 offsets (one box per prior: "
                             f"share_location)")
        if len(conf) < 2 or conf[0] != n:
            raise LayerError(f"conf {list(conf)} must have loc's batch {n}")
        if attrs["classes_given"] and math.prod(conf[1:]) != priors * attrs["num_classes"]:
            raise LayerError(f"conf {list(conf)} does not hold {priors} priors x {attrs['num_classes']} class scores")
        if prior[0] not in (1, n):
            raise LayerError(f"priors {list(prior)} must be given once or per image (batch {n})")
        keep = attrs["keep_top_k"]
        rows = MAX_ROWS if keep == -1 else -(-keep // ROW_BLOCK) * ROW_BLOCK
        return [(n, 8), (n, rows, 8)]

    def why_not_run(self, attrs):
        return ("Huawei Ascend's SSD post-processing operator (float16 on the NPU, boxes clipped before its NMS, "
                "its own output layout): caffeq reads and sizes it but does not run it")


__all__ = ["SSDDetectionOutput"]
