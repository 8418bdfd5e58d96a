"""PG-CNN's MultiROIPooling (mysee1989/PG-CNN f3faafd): crops around facial landmarks.

The reference follows multi_roi_pooling_layer.cu's MultiROIPoolForward element by element (its
start, offset and copy-length cases), in float32 where the fork computes in float, on an
asymmetric map with landmarks inside, across each edge and far outside."""
import numpy as np
import pytest
from c_reference import c_round
from conftest import model_py_outputs, net, rng

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def ref_crops(x, pts, ph, pw, scale):
    n, c, h, w = x.shape
    k = pts.shape[1]
    tops = [np.zeros((n, c, ph, pw), np.float32) for _ in range(k)]
    for t in range(k):
        for b in range(n):
            sw = int(c_round(F(pts[b, t, 0]) * F(scale) - F(pw // 2)))
            sh = int(c_round(F(pts[b, t, 1]) * F(scale) - F(ph // 2)))
            off_w, off_h = max(sw, 0), max(sh, 0)
            top_w, top_h = (0 if sw >= 0 else -sw), (0 if sh >= 0 else -sh)
            len_w = pw - abs(sw) if sw < 0 else (w - off_w if pw + off_w > w else pw)
            len_h = ph - abs(sh) if sh < 0 else (h - off_h if ph + off_h > h else ph)
            for i in range(len_h):
                for j in range(len_w):
                    tops[t][b, :, top_h + i, top_w + j] = x[b, :, off_h + i, off_w + j]
    return tops


LANDMARKS = np.array([[[10, 6], [1, 1], [33, 20], [-9, 30]],
                      [[17.5, 9.5], [30, 2], [0, 21], [100, -100]]], np.float32)   # (N, 4, 2) x, y


def crop_net(params="pooled_h: 3 pooled_w: 4 spatial_scale: 0.5 top_num: 4", tops=4, pts_shape=(2, 4, 2)):
    names = " ".join(f'top: "r{i}"' for i in range(tops))
    return net(f'layer {{ name: "crop" type: "MultiROIPooling" bottom: "x" bottom: "pts" {names} '
               f'multi_roi_pooling_param {{ {params} }} }}', inputs={"x": (2, 3, 11, 17), "pts": pts_shape})


def test_multi_roi_pooling_crops_around_each_landmark(tmp_path):
    x = rng(3).standard_normal((2, 3, 11, 17)).astype(np.float32)
    model = load_from_text(crop_net())
    refs = ref_crops(x, LANDMARKS, 3, 4, 0.5)
    assert all(r.any() for r in refs[:3]) and not refs[3].any()   # inside, across edges; all outside
    feeds = {"x": x, "pts": LANDMARKS}
    got = model.run(feeds)
    got_py = model_py_outputs(model, feeds, tmp_path)
    for i, ref in enumerate(refs):
        np.testing.assert_array_equal(got[f"r{i}"], ref)
        np.testing.assert_array_equal(got_py[f"r{i}"], ref)
    with pytest.raises(ExportError, match="data-dependent|landmark values"):
        model.export_onnx(str(tmp_path / "m.onnx"))


@pytest.mark.parametrize("params, tops, pts_shape, msg", [
    ("pooled_h: 3 pooled_w: 4 top_num: 4", 3, (2, 4, 2), "4 tops|takes"),
    ("pooled_h: 3 pooled_w: 4 top_num: 4", 4, (2, 8), r"\(N, top_num, 2\)"),
    ("pooled_h: 0 pooled_w: 4 top_num: 4", 4, (2, 4, 2), "must be > 0")])
def test_multi_roi_pooling_bad_input(params, tops, pts_shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(crop_net(params, tops, pts_shape))
