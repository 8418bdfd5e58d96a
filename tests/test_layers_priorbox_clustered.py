"""OpenVINO's PriorBoxClustered (caffeq/layers/ssd/priorbox_clustered.py), as the Model Optimizer reads
the Caffe layer and the Inference Engine computes it (ext_priorbox_clustered.cpp; the nGraph reference
prior_box_clustered.hpp for a single variance).

The reference is a float32 loop over cells and priors written here from that code; every case runs in
torch, onnxruntime and the generated model.py on feature maps and images whose sides all differ.
"""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

FEAT, IMG = (2, 4, 3, 5), (2, 3, 37, 61)   # N, C, H, W all different, and unlike each other


def clustered_ref(widths, heights, variance, feat, img, step=0.0, step_h=0.0, step_w=0.0, offset=0.5,
                  clip=False, img_h=0, img_w=0):
    f = np.float32
    lh, lw = feat[2], feat[3]
    ih, iw = img_h or img[2], img_w or img[3]
    sw, sh = f(step_w or step), f(step_h or step)
    if sw == 0 and sh == 0:
        sw, sh = f(iw) / f(lw), f(ih) / f(lh)
    coords, var = [], []
    for h in range(lh):
        for w in range(lw):
            cx, cy = (f(w) + f(offset)) * sw, (f(h) + f(offset)) * sh
            for bw, bh in zip(widths, heights):
                box = [(cx - f(bw) / f(2)) / f(iw), (cy - f(bh) / f(2)) / f(ih),
                       (cx + f(bw) / f(2)) / f(iw), (cy + f(bh) / f(2)) / f(ih)]
                coords += [min(max(v, f(0)), f(1)) if clip else v for v in box]
                var += list(variance) * (4 // len(variance))
    return np.array([coords, var], np.float32)[None]


def clustered_model(param):
    layer = (f'layer {{ name: "pb" type: "PriorBoxClustered" bottom: "feat" bottom: "img" top: "o" '
             f'prior_box_param {{ {param} }} }}')
    return load_from_text(net(layer, inputs={"feat": FEAT, "img": IMG}))


WH = "width: 9.4 width: 25.1 width: 143.0 height: 15.0 height: 39.6 height: 7.5"


@pytest.mark.parametrize("param, kw", [
    # face-detection-retail-0004's form: step, offset, 4 variances, clip false
    ("clip: false step: 16.0 offset: 0.5 variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2",
     {"variance": [0.1, 0.1, 0.2, 0.2], "step": 16.0}),
    ("step_h: 7.5 step_w: 13.0 offset: 0.25 variance: 0.2", {"variance": [0.2], "step_h": 7.5, "step_w": 13.0,
                                                             "offset": 0.25}),
    ("step: 10.0 step_w: 3.0 clip: true", {"variance": [0.1], "step": 10.0, "step_w": 3.0, "clip": True}),
    ("", {"variance": [0.1]}),                       # steps from the image / layer sizes, clip false
    ("img_h: 50 img_w: 90 clip: true", {"variance": [0.1], "img_h": 50, "img_w": 90, "clip": True}),
    ("img_w: 90", {"variance": [0.1], "img_w": 90}),  # each axis on its own
])
def test_prior_box_clustered(param, kw, tmp_path):
    model = clustered_model(f"{WH} {param}")
    ref = clustered_ref([9.4, 25.1, 143.0], [15.0, 39.6, 7.5], feat=FEAT, img=IMG, **kw)
    assert model.graph.shape("o") == (1, 2, 3 * 5 * 3 * 4)
    feeds = {"feat": rng(1).standard_normal(FEAT).astype(np.float32),
             "img": rng(2).standard_normal(IMG).astype(np.float32)}
    check_everywhere(model, feeds, {"o": ref}, tmp_path, 1e-7, 0, opsets=(None,))
    if not kw.get("clip"):
        assert ref.min() < 0 or ref.max() > 1   # the boxes leave the image: clip would matter


def test_prior_box_clustered_img_size_is_ignored_with_a_note():
    model = clustered_model(f"{WH} img_size: 300")
    assert any("img_size is ignored" in w for w in model.warnings)
    out = model.run({"feat": np.zeros(FEAT, np.float32), "img": np.zeros(IMG, np.float32)})["o"]
    np.testing.assert_array_equal(out, clustered_ref([9.4, 25.1, 143.0], [15.0, 39.6, 7.5], [0.1], FEAT, IMG))


@pytest.mark.parametrize("param, msg", [
    ("width: 3 height: 4 height: 5", "one height per width"),
    ("", "one height per width"),
    ("width: 3 height: 4 variance: 0.1 variance: 0.2", "1 or 4 values"),
])
def test_prior_box_clustered_bad(param, msg):
    with pytest.raises(CaffeqError, match=msg):
        clustered_model(param)
