"""feichtenhofer/Detect-Track's BoxTransform (caffeq/layers/detect_track.py) against a loop written here from
box_transform_layer.cpp's Forward_cpu, in torch, onnxruntime and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def box_transform_ref(deltas, rois, means, stds, batch_inds):
    out = []
    deltas = deltas.reshape(deltas.shape[0], -1)
    for i in range(deltas.shape[0]):
        if batch_inds and rois[i, 0] not in batch_inds:
            continue
        px, py, pw, ph = (F32(v) for v in deltas[i, 4:8])
        if stds:
            px, py, pw, ph = (F32(F32(v) * F32(s)) + F32(m) for v, s, m in zip((px, py, pw, ph), stds, means))
        x1, y1 = rois[i, 1], rois[i, 2]
        w, h = F32(rois[i, 3] - x1 + F32(1)), F32(rois[i, 4] - y1 + F32(1))
        cx, cy = F32(float(x1) + 0.5 * float(w) - 1), F32(float(y1) + 0.5 * float(h) - 1)
        nx, ny = F32(px * w) + cx, F32(py * h) + cy
        nw, nh = F32(float(w) * math.exp(float(pw))), F32(float(h) * math.exp(float(ph)))
        out.append([0, nx - F32(0.5) * (nw - F32(1)), ny - F32(0.5) * (nh - F32(1)),
                    nx + F32(0.5) * (nw - F32(1)), ny + F32(0.5) * (nh - F32(1))])
    return np.array(out, F32).reshape(-1, 5, 1, 1)


def layer(param):
    return f'layer {{ name: "bt" type: "BoxTransform" bottom: "d" bottom: "rois" top: "boxes" {param} }}'


@pytest.mark.parametrize("param, means, stds", [
    ("", [], []),
    ("box_reg_param { bbox_mean: 0.1 bbox_mean: 0 bbox_mean: -0.2 bbox_mean: 0 bbox_std: 0.1 bbox_std: 0.1 "
     "bbox_std: 0.2 bbox_std: 0.2 }", [0.1, 0, -0.2, 0], [0.1, 0.1, 0.2, 0.2]),
])
def test_box_transform_decodes_class_ones_deltas(param, means, stds, tmp_path):
    r = rng(51)
    deltas = (r.standard_normal((6, 8, 1, 1)) * 0.3).astype(F32)
    x1y1 = r.uniform(0, 200, (6, 2))
    rois = np.concatenate([r.integers(0, 2, (6, 1)), x1y1, x1y1 + r.uniform(10, 120, (6, 2))], axis=1).astype(F32)
    model = load_from_text(net(layer(param), inputs={"d": deltas.shape, "rois": rois.shape}))
    ref = box_transform_ref(deltas, rois, means, stds, [])
    check_everywhere(model, {"d": deltas, "rois": rois}, {"boxes": ref}, tmp_path, atol=2e-4, rtol=1e-6)


def test_box_transform_batch_ind_keeps_the_listed_images_rows(tmp_path):
    r = rng(52)
    deltas = (r.standard_normal((5, 8)) * 0.2).astype(F32)
    rois = np.array([[0, 1, 2, 30, 40], [1, 5, 5, 50, 60], [0, 10, 0, 20, 90], [1, 0, 0, 9, 9], [0, 3, 4, 5, 6]], F32)
    model = load_from_text(net(layer("box_reg_param { batch_ind: 0 }"), inputs={"d": deltas.shape, "rois": rois.shape}))
    ref = box_transform_ref(deltas, rois, [], [], [0.0])
    assert ref.shape == (3, 5, 1, 1)
    np.testing.assert_allclose(model.run({"d": deltas, "rois": rois})["boxes"], ref, atol=2e-4, rtol=1e-6)
    np.testing.assert_allclose(model_py_outputs(model, {"d": deltas, "rois": rois}, tmp_path)["boxes"], ref,
                               atol=2e-4, rtol=1e-6)
    with pytest.raises(CaffeqError, match="batch_ind keeps a number of rows"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    with pytest.raises(LayerError, match="rois"):
        load_from_text(net(layer(""), inputs={"d": deltas.shape, "rois": (4, 5)}))
