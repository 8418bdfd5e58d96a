"""huangdl007/pedestrian's HSROIPooling (caffeq/layers/hsroi_pooling.py) against a loop written here from its GPU
kernel HSROIPoolingForward (hsroi_pooling_layer.cu at 7fba98a), float32 scalars as its Dtype, in torch,
onnxruntime and model.py."""
import numpy as np
import pytest
from c_reference import c_round
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def ref_hs_roi_pool(x, rois, dim, scale):
    n, c, h, w = x.shape
    out = np.zeros((len(rois), dim, 1, 4), F)
    s = F(scale)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        x0, y0 = F(c_round(roi[1])) * s, F(c_round(roi[2])) * s
        x1, y1 = F(c_round(roi[3]) + 1.0) * s, F(c_round(roi[4]) + 1.0) * s
        rw, rh = max(F(x1 - x0), F(0.1)), max(F(y1 - y0), F(0.1))
        for ctop in range(dim):
            for ow in range(4):
                if ow == 0:      # the roi
                    hs, he, ws, we = y0, y1, x0, x1
                elif ow == 1:    # the head: the upper half, the middle half of the width
                    hs, he, ws, we = y0, F(y1 - rh / F(2)), F(x0 + rw / F(4)), F(x1 - rw / F(4))
                elif ow == 2:    # the left shoulder
                    hs, he, ws, we = F(y0 + rh / F(2)), y1, x0, F(x1 - rw / F(2))
                else:            # the right shoulder
                    hs, he, ws, we = F(y0 + rh / F(2)), y1, F(x0 + rw / F(2)), x1
                hs, he, ws, we = (int(v) for v in (hs, he, ws, we))      # the kernel's int: truncation
                hs, he = min(max(hs, 0), h), min(max(he, 0), h)
                ws, we = min(max(ws, 0), w), min(max(we, 0), w)
                if he <= hs or we <= ws:
                    continue
                total = F(0)
                for yy in range(hs, he):
                    for xx in range(ws, we):
                        total = F(total + x[b, ctop * 4 + ow, yy, xx])
                out[r, ctop, 0, ow] = total / F((he - hs) * (we - ws))
    return out


# inside the map, past its edges, a point, an inverted box, odd corners, one on the second image
ROIS = np.array([[0, 10, 12, 120, 200], [1, -30, -20, 60, 50], [1, 40, 30, 300, 250], [0, 77, 77, 77, 77],
                 [0, 90, 80, 20, 10], [1, 33.5, 18.4, 151.6, 99.5], [0, 0, 0, 255, 191]], F)


@pytest.mark.parametrize("dim, scale", [(2, 0.0625), (3, 0.125), (1, 0.03125)])
def test_hs_roi_pooling_matches_the_kernel_everywhere(dim, scale, tmp_path):
    shape = (2, 4 * dim, 13, 17)
    model = load_from_text(net('layer { name: "o" type: "HSROIPooling" bottom: "x" bottom: "rois" top: "o" '
                               f'hsroi_pooling_param {{ spatial_scale: {scale} output_dim: {dim} }} }}',
                               inputs={"x": shape, "rois": ROIS.shape}))
    assert model.blob_shapes["o"] == (len(ROIS), dim, 1, 4)
    x = rng(dim).standard_normal(shape).astype(F)
    ref = ref_hs_roi_pool(x, ROIS, dim, scale)
    assert not ref[4].any()    # the inverted box: every part empty, 0
    # the sums' order differs from the kernel's running sum: float32 rounding only
    check_everywhere(model, {"x": x, "rois": ROIS}, {"o": ref}, tmp_path, atol=1e-6, rtol=1e-5)


def test_the_worked_example_of_the_bins():
    # spatial_scale 1/16, roi [0, 0, 100, 200]: x1 = 6.3125, y1 = 12.5625 -> the roi h[0, 12) w[0, 6), the head
    # h[0, 6) w[1, 4), the shoulders h[6, 12) w[0, 3) and w[3, 6); a map of ones holding the cell's channel index
    x = np.broadcast_to(np.arange(4, dtype=F).reshape(1, 4, 1, 1), (1, 4, 20, 20)).copy()
    x[0, 1, :6, 1:4] += 10     # the head box only
    model = load_from_text(net('layer { name: "o" type: "HSROIPooling" bottom: "x" bottom: "rois" top: "o" '
                               'hsroi_pooling_param { spatial_scale: 0.0625 output_dim: 1 } }',
                               inputs={"x": x.shape, "rois": (1, 5)}))
    got = model.run({"x": x, "rois": np.array([[0, 0, 0, 100, 200]], F)})["o"]
    np.testing.assert_array_equal(got.reshape(-1), [0, 11, 2, 3])


def test_no_rois(tmp_path):
    model = load_from_text(net('layer { name: "o" type: "HSROIPooling" bottom: "x" bottom: "rois" top: "o" '
                               'hsroi_pooling_param { spatial_scale: 0.0625 output_dim: 2 } }',
                               inputs={"x": (1, 8, 5, 5), "rois": (0, 5)}))
    f = {"x": np.ones((1, 8, 5, 5), F), "rois": np.zeros((0, 5), F)}
    check_everywhere(model, f, {"o": np.zeros((0, 2, 1, 4), F)}, tmp_path)


def test_hs_roi_pooling_refuses_what_the_fork_checks():
    with pytest.raises(LayerError, match=r"output_dim x 4 = 8"):
        load_from_text(net('layer { name: "o" type: "HSROIPooling" bottom: "x" bottom: "rois" top: "o" '
                           'hsroi_pooling_param { spatial_scale: 0.0625 output_dim: 2 } }',
                           inputs={"x": (1, 6, 5, 5), "rois": (2, 5)}))
    with pytest.raises(LayerError, match="output_dim is required"):
        load_from_text(net('layer { name: "o" type: "HSROIPooling" bottom: "x" bottom: "rois" top: "o" '
                           'hsroi_pooling_param { spatial_scale: 0.0625 } }', inputs={"x": (1, 8, 5, 5), "rois": (2, 5)}))
