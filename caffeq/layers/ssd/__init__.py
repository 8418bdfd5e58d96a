"""SSD's layers (weiliu89/caffe, `ssd` branch): Permute, Normalize, PriorBox, DetectionOutput,
with TextBoxes++'s additions (denser priors, quadrilateral and rotated-box outputs), OpenVINO's
PriorBoxClustered (priorbox_clustered), DRBox's rotatable PriorRBox (priorrbox) and the remodet fork's
normalized PriorBox, DetOut and DetectionOutput (remodet), and Huawei Ascend's SSDDetectionOutput (ascend,
read and sized).

Semantics follow SSD's own code; where OpenCV's importer (the oracle of the
fork_* reference cases) differs, SSD wins and the difference is noted in each
module: permute_normalize, priorbox, detection_output (+ its ONNX form in
detection_output_onnx), and nms (SSD's ApplyNMSFast).  Torch code that model.py
needs is ordinary module-level code there, copied with inspect.getsource.
"""
from . import (  # noqa: F401,E501  (registers the specs)
    act_detection_output,
    ascend,
    detection_output,
    permute_normalize,
    priorbox,
    priorbox_clustered,
    priorrbox,
    remodet,
)
from .detection_output import decode_boxes, decode_textboxes, max_detections  # noqa: F401
from .nms import ssd_nms  # noqa: F401
from .permute_normalize import full_order  # noqa: F401
from .priorbox import prior_box_tensor, prior_boxes, prior_sizes  # noqa: F401
