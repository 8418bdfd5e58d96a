"""lippman1125/faceboxes_lqy's PriorBox: fixed_size / density / fixed_ratio (prior_box_layer.cpp
Forward_cpu at dac418b4).

The reference walks the fork's loops with its C++ types: cell (h, w), fixed_size (int for the square
box and the grid, float for the ratio boxes), shape, grid row, grid column; centres in float32 with
the grid shift added in double, corners in double clamped to [0, 1] and stored as float32, then
clip and the variances.  Checked in torch, onnxruntime and the generated model.py."""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, inputs_text

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def reference(lh, lw, ih, iw, sizes, densities, variance, ratios=(), fixed_ratios=(), step=(0.0, 0.0),
              offset=0.5, clip=False):
    """ratios: the fork's aspect_ratios_ (1 first); fixed_ratios: its fixed_ratios_."""
    sh, sw = (F32(step[0]), F32(step[1])) if step[0] else (F32(ih) / F32(lh), F32(iw) / F32(lw))
    coords = []

    def corners(cxt, cyt, bw, bh):
        out = []
        for v, lim in (((float(cxt) - float(bw) / 2.0) / iw, 0), ((float(cyt) - float(bh) / 2.0) / ih, 0),
                       ((float(cxt) + float(bw) / 2.0) / iw, 1), ((float(cyt) + float(bh) / 2.0) / ih, 1)):
            out.append(F32((v if v >= 0 else 0.0) if lim == 0 else (v if v <= 1 else 1.0)))
        return out

    for h in range(lh):
        for w in range(lw):
            cx = F32((F32(w) + F32(offset)) * sw)
            cy = F32((F32(h) + F32(offset)) * sh)
            for fs_f, dens in zip(sizes, densities):
                fs = int(F32(fs_f))
                d = int(dens)
                shift = int(F32(fs_f) / F32(d))
                shapes = []
                if fixed_ratios:
                    for ar in fixed_ratios:
                        r = np.sqrt(F32(ar))
                        shapes.append((F32(F32(fs_f) * r), F32(F32(fs_f) / r)))
                else:
                    shapes.append((F32(fs), F32(fs)))
                    for ar in ratios:
                        if abs(ar - 1.0) < 1e-6:
                            continue
                        r = np.sqrt(F32(ar))
                        shapes.append((F32(F32(fs_f) * r), F32(F32(fs_f) / r)))
                for bw, bh in shapes:
                    for r in range(d):
                        for c in range(d):
                            cxt = F32(float(F32(cx - F32(fs // 2))) + shift / 2.0 + c * shift)
                            cyt = F32(float(F32(cy - F32(fs // 2))) + shift / 2.0 + r * shift)
                            coords += corners(cxt, cyt, bw, bh)
    coords = np.array(coords, F32)
    if clip:
        coords = np.clip(coords, 0, 1)
    var = np.array(variance, F32)
    return np.stack([coords, np.tile(var, coords.size // var.size)]).reshape(1, 2, -1)


def net_text(params, feat=(1, 8, 3, 5), img=(1, 3, 96, 200)):
    return inputs_text(feat=feat, img=img) + (
        f'layer {{ name: "pb" type: "PriorBox" bottom: "feat" bottom: "img" top: "pb" '
        f'prior_box_param {{ {params} }} }}')


@pytest.mark.parametrize("params, kw", [
    # the real file's form: three sizes, density 4 / 2 / 1, an explicit step, 4 variances
    ("fixed_size: 32 fixed_size: 64 fixed_size: 128 density: 4 density: 2 density: 1 step: 32 "
     "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 offset: 0.5",
     {"sizes": [32, 64, 128], "densities": [4, 2, 1], "variance": [0.1, 0.1, 0.2, 0.2], "step": (32.0, 32.0)}),
    # odd and fractional sizes (int box and grid, float ratio boxes), aspect ratios with flip, the
    # step from the image / map sizes, another offset, clip, one variance
    ("fixed_size: 21 fixed_size: 13.5 density: 3 density: 2 aspect_ratio: 2 aspect_ratio: 2 flip: true "
     "clip: true offset: 0.3 variance: 0.2",
     {"sizes": [21, 13.5], "densities": [3, 2], "variance": [0.2], "ratios": [1.0, 2.0, float(F32(1 / F32(2)))],
      "offset": 0.3, "clip": True}),
    # one fixed_ratio (its boxes from the float size, ratio 1 included), img_h / img_w, step_h / step_w
    ("fixed_size: 24 fixed_size: 41 density: 2 density: 1 fixed_ratio: 0.6 img_h: 100 img_w: 150 "
     "step_h: 20 step_w: 31",
     {"sizes": [24, 41], "densities": [2, 1], "variance": [0.1], "fixed_ratios": [0.6], "step": (20.0, 31.0),
      "ih": 100, "iw": 150}),
    ("fixed_size: 30 density: 2 fixed_ratio: 1",
     {"sizes": [30], "densities": [2], "variance": [0.1], "fixed_ratios": [1.0]}),
])
def test_fixed_size_priors_follow_the_forks_loops(params, kw, tmp_path):
    model = load_from_text(net_text(params))
    ih, iw = kw.pop("ih", 96), kw.pop("iw", 200)
    want = reference(3, 5, ih, iw, **kw)
    assert model.blob_shapes["pb"] == want.shape
    feeds = {"feat": np.zeros((1, 8, 3, 5), F32), "img": np.zeros((1, 3, 96, 200), F32)}
    check_everywhere(model, feeds, {"pb": want}, tmp_path)


@pytest.mark.parametrize("params, msg", [
    ("fixed_size: 32 density: 2 fixed_ratio: 0.5 fixed_ratio: 2", "declares 7 priors per cell but writes 8"),
    ("fixed_size: 32 density: 2.5", "declares 6 priors per cell but writes 4"),
    ("fixed_size: 32 min_size: 16 density: 1", "write past its top"),
    ("fixed_size: 32 fixed_size: 64 density: 2", "one per fixed_size"),
    ("fixed_size: 32 density: 1 fixed_ratio: 0.5 aspect_ratio: 2", "not both"),
    ("min_size: 32 density: 2", "need fixed_size"),
    ("fixed_size: 32 density: 0.5", "at least 1"),
    ("fixed_size: -3 density: 1", "must be positive"),
    ("fixed_size: 32 density: 1 variance: 0.1 variance: 0.2", "1 or 4 values"),
])
def test_fixed_size_refusals(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net_text(params))


def test_faceboxes_lqy_deploy_reads():
    # the fork's FaceBoxes deploy at 1024 x 1024: 21 anchors per cell on the 32 x 32 map, one on
    # 16 x 16 and 8 x 8, matching the 21824 boxes its loc / conf heads predict
    path = Path(__file__).parent / "fixtures" / "realworld" / \
        "lippman1125__faceboxes_lqy__examples__faceboxes__faceboxes_deploy.prototxt"
    model = load_from_text(path.read_text())
    shapes = model.blob_shapes
    assert shapes["inception3_priorbox"] == (1, 2, 32 * 32 * 21 * 4)
    assert shapes["conv3_2_priorbox"] == (1, 2, 16 * 16 * 4)
    assert shapes["conv4_2_priorbox"] == (1, 2, 8 * 8 * 4)
    assert shapes["mbox_loc"] == (1, 21824 * 4)
    assert shapes["mbox_conf_reshape"] == (1, 21824, 2)
    node = next(n for n in model.layers if n.name == "inception3_priorbox")
    assert node.attrs["fixed_size"] and len(node.attrs["fixed_boxes"]) == 21
