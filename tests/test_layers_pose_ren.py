"""Pose-REN's GenerateROI (generate_roi_layer.cpp at xinghaochen/Pose-REN 7bb908f) and the Python layer
PyGenerateROILayer, against the C++ loop in float32, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def rois_ref(poses, joint, roi_h, roi_w, img_h, img_w, mul):
    out = np.zeros((poses.shape[0], 5), f32)
    flat = poses.reshape(poses.shape[0], -1)
    mul = f32(mul)
    for n in range(poses.shape[0]):
        u, v = flat[n, joint * 3], flat[n, joint * 3 + 1]
        x1 = f32(f32(f32(u + f32(1)) * f32(img_w)) / f32(2)) - f32(f32(roi_w) * mul) / f32(2)
        y1 = f32(f32(f32(v + f32(1)) * f32(img_h)) / f32(2)) - f32(f32(roi_h) * mul) / f32(2)
        x2 = f32(f32(f32(u + f32(1)) * f32(img_w)) / f32(2)) + f32(f32(roi_w) * mul) / f32(2)
        y2 = f32(f32(f32(v + f32(1)) * f32(img_h)) / f32(2)) + f32(f32(roi_h) * mul) / f32(2)
        if x1 < 0:
            x1, x2 = f32(0), f32(0) + f32(roi_w) * mul
        if x2 >= img_w - 1:
            x2 = f32(img_w - 1)
            x1 = x2 - f32(roi_w) * mul
        if y1 < 0:
            y1, y2 = f32(0), f32(0) + f32(roi_h) * mul
        if y2 >= img_h - 1:
            y2 = f32(img_h - 1)
            y1 = y2 - f32(roi_h) * mul
        out[n] = [n, x1, y1, x2, y2]
    return out


PARAMS = "joint_idx: 2 roi_h: 5 roi_w: 6 img_h: 80 img_w: 96 spatial_mul: 4"


@pytest.mark.parametrize("layer", [
    f'layer {{ name: "r" type: "GenerateROI" bottom: "pose" top: "rois" generate_roi_param {{ {PARAMS} }} }}',
    'layer { name: "r" type: "Python" bottom: "pose" top: "rois" python_param { module: '
    '"python_layers.py_generate_roi_layer" layer: "PyGenerateROILayer" param_str: "{\'img_w\': 96, \'roi_h\': 5, '
    '\'spatial_mul\': 4, \'roi_w\': 6, \'joint_idx\': 2, \'img_h\': 80}" } }'], ids=["cpp", "python"])
def test_generate_roi_boxes_one_joint_inside_the_image(layer, tmp_path):
    g = np.random.default_rng(18)
    poses = g.uniform(-1.3, 1.3, (7, 12)).astype(f32)       # 4 joints; boxes past every edge
    model = load_from_text(net(layer, inputs={"pose": poses.shape}))
    assert model.blob_shapes["rois"] == (7, 5)
    ref = rois_ref(poses, 2, 5, 6, 80, 96, 4.0)
    check_everywhere(model, {"pose": poses}, {"rois": ref}, tmp_path, atol=1e-5, rtol=1e-6)


def test_generate_roi_refusals():
    with pytest.raises(LayerError, match="joint_idx 4 is past the 4 joints"):
        load_from_text(net(f'layer {{ name: "r" type: "GenerateROI" bottom: "pose" top: "rois" generate_roi_param '
                           f'{{ {PARAMS.replace("joint_idx: 2", "joint_idx: 4")} }} }}', inputs={"pose": (2, 12)}))
    with pytest.raises(LayerError, match="PyGenerateROILayer needs img_h"):
        load_from_text(net('layer { name: "r" type: "Python" bottom: "pose" top: "rois" python_param { module: '
                           '"python_layers.py_generate_roi_layer" layer: "PyGenerateROILayer" param_str: '
                           '"{\'img_w\': 96, \'roi_h\': 5, \'spatial_mul\': 4, \'roi_w\': 6, \'joint_idx\': 2}" } }',
                           inputs={"pose": (2, 12)}))
