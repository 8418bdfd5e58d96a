"""Layer specs: importing this package registers every built-in Caffe type."""
from .registry import Layer, LayerError, get_spec, register_layer, require_specs, spec_for, supported_types

# Each module registers the specs of one layer family.
from . import (  # noqa: F401,E402
    act_forks,
    activation,
    c3d,
    common,
    conv,
    ctc,
    ctpn,
    data,
    denseblock,
    elementwise,
    face_norms,
    fork_data,
    fpn,
    happynear,
    frcnn,
    im2col,
    losses,
    margin,
    misc,
    norm,
    pooling,
    psanet,
    python_layers,
    rcnn,
    recurrent,
    roi_pooling,
    segmentation,
    sequence,
    shape_ops,
    ssd,
    v1_forks,
    video_data,
    vision_forks,
    yolo,
)

__all__ = ["Layer", "LayerError", "get_spec", "register_layer", "require_specs", "spec_for",
           "supported_types"]
