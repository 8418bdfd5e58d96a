"""julimueller/tl_ssd's PriorBox with a grid of centre offsets (prior_box_layer.cpp Forward_cpu).

The reference follows the fork's loops: cell (h, w), offset_w, offset_h, min_size (int), ratio
(ratio 1 skipped), centres in float32, box sizes as SSD computes them, corners in double stored as
float32, then clip and the variances.  Checked in torch, onnxruntime and the generated model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, inputs_text

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def reference(lh, lw, ih, iw, min_sizes, ratios, offsets_w, offsets_h, variance, step=(0.0, 0.0), clip=False):
    sh, sw = (F32(step[0]), F32(step[1])) if step[0] else (F32(ih) / F32(lh), F32(iw) / F32(lw))
    coords = []
    for h in range(lh):
        for w in range(lw):
            for ox in offsets_w:
                for oy in offsets_h:
                    cx = F32((F32(w) + F32(ox)) * sw)
                    cy = F32((F32(h) + F32(oy)) * sh)
                    for mn in min_sizes:
                        m = int(mn)
                        for ar in ratios:
                            if abs(ar - 1.0) < 1e-6:
                                continue
                            r = math.sqrt(float(F32(ar)))
                            bw, bh = float(F32(m * r)), float(F32(m / r))
                            coords += [F32((float(cx) - bw / 2.0) / iw), F32((float(cy) - bh / 2.0) / ih),
                                       F32((float(cx) + bw / 2.0) / iw), F32((float(cy) + bh / 2.0) / ih)]
    coords = np.array(coords, F32)
    if clip:
        coords = np.clip(coords, 0, 1)
    var = np.array(variance, F32)
    return np.stack([coords, np.tile(var, coords.size // var.size)]).reshape(1, 2, -1)


def net_text(params, feat=(1, 8, 3, 5), img=(1, 3, 30, 70)):
    return inputs_text(feat=feat, img=img) + (
        f'layer {{ name: "pb" type: "PriorBox" bottom: "feat" bottom: "img" top: "pb" '
        f'prior_box_param {{ {params} }} }}')


@pytest.mark.parametrize("params, kw", [
    # the real file's form: one ratio, no flip, two offsets each way
    ("min_size: 7 min_size: 10.5 aspect_ratio: 0.3 flip: false clip: false variance: 0.1 "
     "offset_w: 0.25 offset_w: 0.75 offset_h: 0.5",
     {"min_sizes": [7, 10.5], "ratios": [0.3], "offsets_w": [0.25, 0.75], "offsets_h": [0.5], "variance": [0.1]}),
    # flip, 4 variances, explicit step, clip
    ("min_size: 12 aspect_ratio: 0.5 flip: true clip: true variance: 0.1 variance: 0.1 variance: 0.2 "
     "variance: 0.2 step: 9 offset_w: 0.0 offset_h: 0.3 offset_h: 1.0",
     {"min_sizes": [12], "ratios": [0.5, float(F32(1 / 0.5))], "offsets_w": [0.0], "offsets_h": [0.3, 1.0],
      "variance": [0.1, 0.1, 0.2, 0.2], "step": (9.0, 9.0), "clip": True}),
])
def test_offset_grid_priors_follow_the_forks_loops(params, kw, tmp_path):
    model = load_from_text(net_text(params))
    want = reference(3, 5, 30, 70, **kw)
    assert model.blob_shapes["pb"] == want.shape
    feeds = {"feat": np.zeros((1, 8, 3, 5), F32), "img": np.zeros((1, 3, 30, 70), F32)}
    check_everywhere(model, feeds, {"pb": want}, tmp_path)


@pytest.mark.parametrize("params, msg", [
    ("min_size: 7 aspect_ratio: 1 aspect_ratio: 0.3 offset_w: 0.5 offset_h: 0.5", "never writes it"),
    ("min_size: 7 offset_w: 0.5 offset_h: 0.5", "no implicit aspect ratio 1"),
    ("min_size: 7 aspect_ratio: 0.3 offset_w: 0.5", "needs both offset_w and offset_h"),
    ("min_size: 7 aspect_ratio: 0.3 offset_w: 1.5 offset_h: 0.5", "must lie in"),
    ("min_size: 7 aspect_ratio: 0.3 offset_w: 0.5 offset_h: 0.5 width: 3", "OpenCV-only"),
])
def test_offset_grid_refusals(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net_text(params))
