"""The detection layers of sophgo/caffe (e188c0e; the Caffe of CVITEK's and Sophgo's TPU compilers, whose
model zoo, cvitek-mlir/models, writes them after its YOLO and RetinaFace nets): read, sized, not run.

- YoloDetection (yolo_detection_layer.cpp): one bottom per YOLO scale, three boxes per cell; top
  (N, 1, keep_topk, 6), rows (x, y, w, h, class, score).
- RetinaFaceDetection (retinaface_detection_layer.cpp): nine bottoms (class scores, boxes and landmarks
  at strides 8, 16 and 32); top (N, 1, keep_topk, 15).

Both forwards lower their keep_topk_ member to the number of detections an image gave and never raise
it again, and leave the rows past it as the blob held them.  What a forward writes therefore depends on
the images the layer saw before: no output can be called the fork's, so caffeq sizes the layers (a
net can be run or exported up to their bottoms with --outputs) and refuses to run them.
"""
from .registry import LayerError, ReadOnlyLayer, need_blobs, register_layer

_WHY = ("sophgo/caffe's {kind} lowers its keep_topk to the detections of each image it sees and leaves the "
        "rows past them as they were, so what it writes depends on the images before; run or export the net "
        "up to its bottoms ({bottoms}) with --outputs")


class _SophgoDetection(ReadOnlyLayer):
    field = columns = None

    def parse(self, lp):
        p = getattr(lp, self.field)
        if p.keep_topk < 1:
            raise LayerError(f"{self.field}.keep_topk must be >= 1 (the top's rows), got {p.keep_topk}")
        return {"keep_topk": int(p.keep_topk), "name": lp.name, "bottoms": list(lp.bottom)}

    def infer(self, attrs, in_shapes):
        return [(int(in_shapes[0][0]), 1, attrs["keep_topk"], self.columns)]

    def why_not_run(self, attrs):
        return _WHY.format(kind=self.types[0], bottoms=", ".join(attrs["bottoms"]))


@register_layer("YoloDetection")
class YoloDetection(_SophgoDetection):
    field, columns = "yolo_detection_param", 6

    def parse(self, lp):
        need_blobs(lp, "YoloDetection", (1, 2, 3), 1)   # its anchors: three scales (two for tiny)
        p = lp.yolo_detection_param
        if p.tiny and len(lp.bottom) > 2 and not p.anchors:
            raise LayerError(f"YoloDetection with tiny has anchors for 2 scales, got {len(lp.bottom)} bottoms")
        return super().parse(lp)


@register_layer("RetinaFaceDetection")
class RetinaFaceDetection(_SophgoDetection):
    field, columns = "retinaface_detection_param", 15

    def parse(self, lp):
        need_blobs(lp, "RetinaFaceDetection", 9, 1, " (scores, boxes and landmarks at strides 8, 16, 32)")
        return super().parse(lp)
