"""DRBox's PriorRBox (prior_rbox_layer.cpp) against a loop written from the fork's Forward_cpu, in torch,
onnxruntime and model.py, on a non-square feature map and image."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def fork_prior_rbox(lh, lw, ih, iw, angles, widths, heights, regress_size, regress_angle, variance,
                    step=None, offset=0.5, clip=False):
    step_w, step_h = (f32(iw) / f32(lw), f32(ih) / f32(lh)) if step is None else (f32(step), f32(step))
    if not regress_angle:
        angles = [0.0]
    out = []
    for h in range(lh):
        for w in range(lw):
            cx, cy = (f32(w) + f32(offset)) * step_w, (f32(h) + f32(offset)) * step_h
            for a in angles:
                for j in range(len(widths)):
                    out += [cx / f32(iw), cy / f32(ih)]
                    if regress_size:
                        out += [widths[j], heights[j]]
                    if regress_angle:
                        out.append(a)
    data = np.array(out, f32)
    if clip:
        data = np.clip(data, 0, 1)
    var = np.array(variance * (data.size // len(variance)), f32)
    return np.stack([data, var])[None]


def rbox_net(params, feat=(1, 4, 3, 5), img=(1, 3, 24, 50)):
    return load_from_text(net(f'layer {{ name: "p" type: "PriorRBox" bottom: "f" bottom: "img" top: "p" '
                              f'prior_rbox_param {{ {params} }} }}', inputs={"f": feat, "img": img}))


def test_prior_rbox_writes_centres_sizes_and_angles_as_drbox_deploy_files(tmp_path):
    # DRBox's Airplane deploy: 12 angles, two sizes, five variances, regress_size and regress_angle
    angles = [0.0, 30.0, 60.0, 90.0]
    params = (" ".join(f"rotated_angles: {a}" for a in angles) + " prior_widths: 0.1667 prior_widths: 0.2357 "
              "prior_heights: 0.1667 prior_heights: 0.3 clip: false variance: 0.1 variance: 0.1 variance: 0.2 "
              "variance: 0.2 variance: 0.1 step: 8.0 offset: 0.5 regress_size: true regress_angle: true")
    model = rbox_net(params)
    ref = fork_prior_rbox(3, 5, 24, 50, angles, [f32(0.1667), f32(0.2357)], [f32(0.1667), f32(0.3)], True, True,
                          [0.1, 0.1, 0.2, 0.2, 0.1], step=8.0)
    assert model.blob_shapes["p"] == ref.shape == (1, 2, 3 * 5 * 4 * 2 * 5)
    feeds = {"f": np.zeros((1, 4, 3, 5), f32), "img": np.zeros((1, 3, 24, 50), f32)}
    check_everywhere(model, feeds, {"p": ref}, tmp_path)


@pytest.mark.parametrize("params, regress_size, regress_angle, clip", [
    ("prior_widths: 0.5 prior_heights: 0.25", False, False, False),          # centres only, steps from sizes
    ("prior_widths: 0.5 prior_heights: 0.25 regress_size: true clip: true", True, False, True),
    ("rotated_angles: -30 rotated_angles: 45 prior_widths: 0.5 prior_heights: 0.25 regress_angle: true "
     "clip: true", False, True, True),                                    # clip clamps the angles too
])
def test_prior_rbox_parameter_sets_and_clip(params, regress_size, regress_angle, clip, tmp_path):
    model = rbox_net(params + " variance: 0.1")
    angles = [-30.0, 45.0] if regress_angle else [0.0]
    ref = fork_prior_rbox(3, 5, 24, 50, angles, [f32(0.5)], [f32(0.25)], regress_size, regress_angle, [0.1],
                          clip=clip)
    feeds = {"f": np.zeros((1, 4, 3, 5), f32), "img": np.zeros((1, 3, 24, 50), f32)}
    check_everywhere(model, feeds, {"p": ref}, tmp_path)


@pytest.mark.parametrize("params, message", [
    ("prior_widths: 0.5 prior_widths: 0.6 prior_heights: 0.5", "2 prior_widths and 1 prior_heights"),
    ("prior_widths: 0.5 prior_widths: 0.6 prior_heights: 0.5 prior_heights: 0.6", "exactly one prior width"),
    ("prior_widths: 0.5 prior_heights: 0.5 variance: 0.1 variance: 0.2 variance: 0.3", "needs 1 or 2 values"),
    ("prior_widths: 0.5 prior_heights: 0.5 regress_angle: true", "gives no priors"),
    ("prior_widths: 0.5 prior_heights: 0.5 step: 8 step_h: 4 step_w: 4", "give step or step_h/step_w"),
])
def test_prior_rbox_refuses_what_the_fork_checks(params, message):
    with pytest.raises(LayerError, match=message):
        rbox_net(params)
