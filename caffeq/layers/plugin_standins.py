"""TensorRT plugin stand-ins: layers a TensorRT program replaces with its own plugins.

NVIDIA's TensorRT samples and the repositories built on them (MobileNet-SSD-TensorRT, the
TensorRT-Yolov3 models) keep a Caffe prototxt for TensorRT's Caffe parser in which every layer
TensorRT lacks is written as a bare `IPlugin` (SSD's Permute, Flatten, PriorBox, Normalize...) or
`Yolo` layer: no parameters at all. The program's plugin factory recognises each by its name and
builds it with values written in its own C++ (prior sizes, anchors, class counts).

The prototxt alone therefore cannot say what such a layer computes or how big its tops are.
caffeq lists the net (`inspect` shows every layer, with the shapes after a stand-in unknown) and
refuses, in one line, to run or export it.
"""
from .registry import LayerError, MissingInputShape, ReadOnlyLayer, claim_layers, need_blobs, register_layer

_WHY = ("a TensorRT plugin stand-in: what it computes and its parameters are written in the program "
        "that builds the TensorRT engine (its plugin factory), not in the prototxt")


@register_layer("IPlugin", "Yolo")
class TensorRTPluginStandIn(ReadOnlyLayer):
    def parse(self, lp):
        return {"name": lp.name, "kind": lp.type}

    def infer(self, attrs, in_shapes):
        # unknown shapes from here on: `inspect` lists the rest of the net, everything else refuses
        raise MissingInputShape(f"{self.why(attrs)}; the shapes of its tops and of what follows are unknown")

    def why(self, attrs):
        return f"it is {_WHY}"

    def why_not_run(self, attrs):
        return f"{self.why(attrs)}; caffeq can list the net but not run or export this layer or what follows it"


def _bare_detection_output(lp):
    # Caffe's DetectionOutput cannot load without num_classes; a bare one is TensorRT's NMS plugin
    return not lp.HasField("detection_output_param")


@claim_layers("DetectionOutput", _bare_detection_output)
class TensorRTDetectionOutput(TensorRTPluginStandIn):
    def why(self, attrs):
        return (f"it has no detection_output_param (which Caffe requires): it is TensorRT's detection plugin, "
                f"{_WHY.split(': ', 1)[1]}")


def _keep_count_detection_output(lp):
    # NVIDIA's TensorRT SSD sample and the repositories built on it give DetectionOutput a second top,
    # keep_count: TensorRT's NMS plugin (Caffe's DetectionOutput has exactly one top)
    return lp.HasField("detection_output_param") and len(lp.top) == 2


@claim_layers("DetectionOutput", _keep_count_detection_output)
class TensorRTKeepCountDetectionOutput(TensorRTPluginStandIn):
    """TensorRT's NMS plugin as its Caffe parser reads DetectionOutput with tops detection_out and
    keep_count: (N, 1, keep_top_k, 7) detections per image, padded, and (N, 1, 1, 1) counts."""

    def parse(self, lp):
        need_blobs(lp, "DetectionOutput", 3, 2, "loc, conf, priors")
        keep = int(lp.detection_output_param.keep_top_k)
        if keep < 1:
            raise LayerError("TensorRT's NMS plugin (tops detection_out and keep_count) needs "
                             "detection_output_param.keep_top_k > 0")
        return {"name": lp.name, "kind": "DetectionOutput", "keep": keep}

    def infer(self, attrs, in_shapes):
        n = in_shapes[0][0]
        return [(n, 1, attrs["keep"], 7), (n, 1, 1, 1)]

    def why(self, attrs):
        return ("its second top, keep_count, makes it TensorRT's NMS plugin (each image's detections padded to "
                "keep_top_k rows, and their count), which runs in a TensorRT engine, not in Caffe")
