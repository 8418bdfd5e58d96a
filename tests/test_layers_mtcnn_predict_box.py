"""happynear/caffe-windows's PredictBox (98b1d7d predict_box_layer.cu, the GPU forward its MTCNN v2 demo
runs).  The reference loops over positions as the kernels and the list's loop do, float32 arithmetic,
the double comparisons in float64."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def predict_box_ref(scores, reg=None, third=None, stride=2, field=12, thresh=0.5, exp_form=True):
    n, _, h, w = scores.shape
    mode = {2: "nms", 3: "stitch"}.get(third.shape[1]) if third is not None else None
    dense = np.zeros((n, 5, h, w), F)
    for i in range(n):
        for y in range(h):
            for x in range(w):
                s = scores[i, 1, y, x]
                ok = s > F(thresh) and float(s) < 1 + 1e-6
                if mode == "nms":
                    ok = ok and float(s) > float(third[i, 1, y, x]) - 1e-6
                planes = third.reshape(-1, h, w) if mode == "stitch" else None
                if mode == "stitch":
                    ok = ok and planes[2 * i + 2, y, x] != 0
                if not ok:
                    continue
                rf = planes[2 * i + 2, y, x] if mode == "stitch" else F(field)
                if mode == "nms":
                    bx, by = F(x * stride), F(y * stride)
                else:
                    bias_x = planes[2 * i, y, x] if mode == "stitch" else F(0)
                    bias_y = planes[2 * i + 1, y, x] if mode == "stitch" else F(0)
                    bx = F(F(F(x * stride) - bias_x) / F(12)) * rf
                    by = F(F(F(y * stride) - bias_y) / F(12)) * rf
                bw = bh = rf
                if reg is not None:
                    r = reg[i, :, y, x]
                    if exp_form:
                        bx, by = F(bx + F(r[0] * rf)), F(by + F(r[1] * rf))
                        bw, bh = F(bw * np.exp(r[2])), F(bh * np.exp(r[3]))
                    else:
                        bx, by = F(bx + F(r[1] * rf)), F(by + F(r[0] * rf))
                        bw, bh = F(bw + F(F(r[3] - r[1]) * rf)), F(bh + F(F(r[2] - r[0]) * rf))
                dense[i, :, y, x] = [bx, by, bw, bh, s]
    rows = [dense[0, :, y, x] for x in range(w) for y in range(h) if dense[0, 4, y, x] > F(thresh)] if n == 1 else []
    listed = np.array(rows, F)[None] if rows else np.zeros((n, 1, 5), F)
    return dense, listed


def softmax_scores(seed, shape):
    z = rng(seed).standard_normal(shape).astype(F) * 2
    e = np.exp(z - z.max(1, keepdims=True))
    return (e / e.sum(1, keepdims=True)).astype(F)


def box_net(param, bottoms, shapes, tops=("bb", "list")):
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    top = " ".join(f'top: "{t}"' for t in tops)
    return load_from_text(net(f'layer {{ name: "box" type: "PredictBox" {bottom} {top} predict_box_param {{ {param} }} }}',
                              inputs=dict(zip(bottoms, shapes))))


@pytest.mark.parametrize("param, exp_form", [("positive_thresh: 0.6 stride: 2 receptive_field: 12 bbreg_exp: false", False),
                                              ("positive_thresh: 0.3 stride: 4 receptive_field: 24", True)])
def test_boxes_and_list_with_regressions(param, exp_form, tmp_path):
    # MTCNN v2's det1: scores and regressions, one image, an asymmetric map
    scores = softmax_scores(1, (1, 2, 5, 7))
    reg = (rng(2).standard_normal((1, 4, 5, 7)) * 0.3).astype(F)
    thresh, stride, field = (0.6, 2, 12) if not exp_form else (0.3, 4, 24)
    dense, listed = predict_box_ref(scores, reg, stride=stride, field=field, thresh=thresh, exp_form=exp_form)
    assert 1 < listed.shape[1] < 35
    model = box_net(param, ["s", "r"], [scores.shape, reg.shape])
    check_everywhere(model, {"s": scores, "r": reg}, {"bb": dense, "list": listed}, tmp_path, atol=2e-6, rtol=1e-6)


def test_nms_map_and_a_batch(tmp_path):
    # with a 2-channel third bottom the NMS kernel keeps a score not below the map's, boxes at w * stride;
    # two images: the list is (2, 1, 5) zeros
    scores = softmax_scores(3, (2, 2, 4, 6))
    nms = np.maximum(scores, softmax_scores(4, (2, 2, 4, 6)))
    nms[0, 1, 1, :3] = scores[0, 1, 1, :3]      # ties are kept
    reg = (rng(11).standard_normal((2, 4, 4, 6)) * 0.3).astype(F)
    dense, listed = predict_box_ref(scores, reg, nms, stride=3, field=12, thresh=0.2)
    assert dense[:, 4].astype(bool).sum() > 2 and not listed.any() and listed.shape == (2, 1, 5)
    model = box_net("positive_thresh: 0.2 stride: 3", ["s", "r", "n"], [scores.shape, reg.shape, nms.shape])
    check_everywhere(model, {"s": scores, "r": reg, "n": nms}, {"bb": dense, "list": listed}, tmp_path,
                     atol=2e-6, rtol=1e-6)


def test_stitch_map(tmp_path):
    # a 3-channel third bottom: per-position biases and receptive field, none kept where that field is 0
    scores = softmax_scores(5, (1, 2, 4, 5))
    reg = (rng(6).standard_normal((1, 4, 4, 5)) * 0.2).astype(F)
    stitch = np.stack([rng(7).uniform(0, 9, (4, 5)), rng(8).uniform(0, 9, (4, 5)),
                       rng(9).choice([0, 12, 17, 24], (4, 5))]).astype(F)[None]
    dense, listed = predict_box_ref(scores, reg, stitch, thresh=0.4, exp_form=False)
    assert listed.shape[1] > 1
    model = box_net("positive_thresh: 0.4 bbreg_exp: false", ["s", "r", "t"], [scores.shape, reg.shape, stitch.shape])
    check_everywhere(model, {"s": scores, "r": reg, "t": stitch}, {"bb": dense, "list": listed}, tmp_path,
                     atol=2e-6, rtol=1e-6)


def test_nothing_kept_and_dense_only(tmp_path):
    scores = softmax_scores(10, (1, 2, 3, 4)) * F(0.5)      # all below 0.9
    dense, listed = predict_box_ref(scores, thresh=0.9)
    assert not dense.any()
    check_everywhere(box_net("positive_thresh: 0.9", ["s"], [scores.shape]), {"s": scores},
                     {"bb": dense, "list": listed}, tmp_path)
    check_everywhere(box_net("positive_thresh: 0.1", ["s"], [scores.shape], tops=("bb",)), {"s": scores},
                     {"bb": predict_box_ref(scores, thresh=0.1)[0]}, tmp_path)


@pytest.mark.parametrize("param, shapes, msg", [
    ("positive_thresh: -0.1", [(1, 2, 3, 3)], "positive_thresh must be >= 0"),
    ("", [(1, 3, 3, 3)], "scores must have 2 channels"),
    ("", [(1, 2, 3, 3), (1, 4, 3, 2)], "regressions must be"),
])
def test_refusals(param, shapes, msg):
    with pytest.raises(LayerError, match=msg):
        box_net(param, ["s", "r"][:len(shapes)], shapes)
