"""PSROIAlign (afantideng/R-FCN-PSROIAlign cd4b283): R-FCN's position-sensitive pooling with
sample_num x sample_num bilinear samples per bin.

The reference is a numpy loop written here from the fork's CUDA kernel (psroi_align_layer.cu
PSROIAlignForward and its bilinear_interpolate), in float32 scalars as the kernel's Dtype.
"""
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, model_py_outputs, net, onnx_outputs, rng

import caffeq
from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
FILE = REALWORLD / "afantideng__R-FCN-PSROIAlign__models__pascal_voc__1018b__test_agnostic.prototxt"


def bilinear(plane, h, w, y, x, previous):
    """The fork's bilinear_interpolate: out of the map it leaves `val` (the previous sample's) as it was."""
    if y < -0.5 or y > h - 0.5 or x < -0.5 or x > w - 0.5:
        return previous
    y, x = (max(y, F(0)), max(x, F(0)))
    y0, x0 = int(y), int(x)
    if x0 >= w - 1:
        x0 = x1 = w - 1
        x = F(x0)
    else:
        x1 = x0 + 1
    if y0 >= h - 1:
        y0 = y1 = h - 1
        y = F(y0)
    else:
        y1 = y0 + 1
    ly, lx = y - F(y0), x - F(x0)
    hy, hx = F(1) - ly, F(1) - lx
    w1, w2, w3, w4 = hy * hx, hy * lx, ly * hx, ly * lx
    return w1 * plane[y0, x0] + w2 * plane[y0, x1] + w3 * plane[y1, x0] + w4 * plane[y1, x1]


def ref_psroi_align(x, rois, dim, g, scale, samples):
    _n, _c, h, w = x.shape
    scale = F(scale)
    out = np.zeros((len(rois), dim, g, g), F)
    for n, roi in enumerate(rois):
        b = int(roi[0])
        start_w, start_h = F(roi[1]) * scale, F(roi[2]) * scale
        end_w, end_h = F(float(roi[3]) + 1.0) * scale, F(float(roi[4]) + 1.0) * scale
        roi_w, roi_h = max(end_w - start_w, F(0.1)), max(end_h - start_h, F(0.1))
        bin_h, bin_w = roi_h / F(g), roi_w / F(g)
        for ctop in range(dim):
            for ph in range(g):
                for pw in range(g):
                    hs = min(max(F(ph) * bin_h + start_h, F(0)), F(h - 1))
                    he = min(max(F(ph + 1) * bin_h + start_h, F(0)), F(h - 1))
                    ws = min(max(F(pw) * bin_w + start_w, F(0)), F(w - 1))
                    we = min(max(F(pw + 1) * bin_w + start_w, F(0)), F(w - 1))
                    empty = he <= hs or we <= ws
                    c = (ctop * g + ph) * g + pw
                    step_h, step_w = bin_h / F(samples + 1), bin_w / F(samples + 1)
                    val, total = F(0), F(0)
                    for i in range(1, samples + 1):
                        for j in range(1, samples + 1):
                            y, xx = hs + F(i) * step_h, ws + F(j) * step_w
                            if y >= he or xx >= we:
                                continue
                            val = bilinear(x[b, c], h, w, y, xx, val)
                            total = total + val
                    out[n, ctop, ph, pw] = 0 if empty else total / F(samples * samples)
    return out


DIM, G = 2, 3
X_SHAPE = (2, DIM * G * G, 7, 11)   # N, C, H, W all different
# rois in input pixels (spatial_scale 0.5): inside, crossing the left/top and the right/bottom border,
# one pixel (smaller than a bin), outside the map, on the second image, fractional corners
ROIS = np.array([[0, 2, 1, 13, 9], [1, -6, -3, 8, 6], [1, 9, 4, 30, 19], [0, 7, 7, 7, 7],
                 [1, 40, 30, 50, 44], [0, 3.5, 2.25, 17.75, 8.5]], np.float32)


def psroi_net(params, rois_shape=(6, 5), x_shape=X_SHAPE):
    return net(f'layer {{ name: "o" type: "PSROIAlign" bottom: "x" bottom: "rois" top: "o" '
               f'psroi_align_param {{ {params} }} }}', inputs={"x": x_shape, "rois": rois_shape})


def feeds(seed=0):
    return {"x": rng(seed).standard_normal(X_SHAPE).astype(np.float32), "rois": ROIS}


@pytest.mark.parametrize("samples, scale", [(1, 0.5), (2, 0.5), (3, 0.75), (None, 1.0)])
def test_psroi_align_matches_the_fork(samples, scale, tmp_path):
    extra = "" if samples is None else f"sample_num: {samples}"
    model = load_from_text(psroi_net(f"spatial_scale: {scale} output_dim: {DIM} group_size: {G} {extra}"))
    assert model.blob_shapes["o"] == (6, DIM, G, G)
    f = feeds(samples or 0)
    ref = ref_psroi_align(f["x"], ROIS, DIM, G, scale, samples or 2)   # sample_num defaults to 2
    # the same float32 operations in the same order: equal to the bit
    assert_close(model.run(f)["o"], ref, 0.0, 0.0, "torch")
    assert_close(model_py_outputs(model, f, tmp_path)["o"], ref, 0.0, 0.0, "model.py")
    # ONNX: the same samples as row and column weights, summed in another order
    for opset in (13, None):
        assert_close(onnx_outputs(model, f, tmp_path, opset)["o"], ref, 1e-6, 1e-6, f"onnx opset {opset}")
    if scale == 0.5:
        assert np.count_nonzero(ref[1]) and np.count_nonzero(ref[2])   # the border-crossing rois read the map
        assert np.count_nonzero(ref[4]) == 0   # the roi outside the map: every bin is empty


def test_psroi_align_position_sensitive_channels():
    # one output channel, 2x2 groups; channel k holds the constant k + 1: bin (i, j) reads channel 2i + j
    x = np.stack([np.full((5, 6), k + 1.0, np.float32) for k in range(4)])[None]
    model = load_from_text(psroi_net("spatial_scale: 1 output_dim: 1 group_size: 2 sample_num: 2",
                                     rois_shape=(1, 5), x_shape=x.shape))
    got = model.run({"x": x, "rois": np.array([[0, 0, 0, 3, 3]], np.float32)})["o"]
    # 4x4 roi: bins 2 wide, samples at 2/3 and 4/3 inside [start, start + 2) all taken
    np.testing.assert_allclose(got[0, 0], [[1, 2], [3, 4]], rtol=1e-6)
    # rows from 1.4 to 5 in bins of 1.8: the second bin [3.2, 5] is clamped to [3.2, 4], so of its samples
    # 3.8 and 4.4 only the first is taken; the sum is still divided by 4
    rois = np.array([[0, 0, 1.4, 3, 4]], np.float32)
    got = model.run({"x": x, "rois": rois})["o"]
    np.testing.assert_allclose(got, ref_psroi_align(x, rois, 1, 2, 1.0, 2), rtol=1e-6)
    np.testing.assert_allclose(got[0, 0], [[1, 2], [1.5, 2]], rtol=1e-6)


@pytest.mark.parametrize("params, kw, msg", [
    (f"output_dim: {DIM} group_size: {G}", {}, "spatial_scale is required"),
    (f"spatial_scale: 1 output_dim: {DIM} group_size: 0", {}, "group_size must be > 0"),
    (f"spatial_scale: 1 output_dim: {DIM} group_size: {G} sample_num: 0", {}, "sample_num must be > 0"),
    (f"spatial_scale: 1 output_dim: 3 group_size: {G}", {}, "channels"),
    (f"spatial_scale: 1 output_dim: {DIM} group_size: {G}", {"rois_shape": (6, 4)}, "rois must be"),
])
def test_psroi_align_refuses_bad_params_and_shapes(params, kw, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(psroi_net(params, **kw))


def test_psroi_align_bad_batch_index():
    model = load_from_text(psroi_net(f"spatial_scale: 1 output_dim: {DIM} group_size: {G}", rois_shape=(1, 5)))
    with pytest.raises(LayerError, match="batch index"):
        model.run({"x": np.zeros(X_SHAPE, np.float32), "rois": np.array([[2, 0, 0, 1, 1]], np.float32)})


def test_r_fcn_psroialign_test_agnostic_reads():
    model = caffeq.load(FILE)
    shapes = model.blob_shapes
    assert shapes["psroipooled_cls_rois"] == (300, 21, 7, 7)
    assert shapes["psroipooled_loc_rois"] == (300, 8, 7, 7)
    assert shapes["cls_score"] == (300, 21, 1, 1)
    node = next(n for n in model.layers if n.name == "psroipooled_cls_rois")
    assert node.attrs["samples"] == 1 and node.attrs["scale"] == 0.0625


def test_psroi_align_param_keeps_the_forks_field_numbers():
    fields = caffe_pb2.PSROIAlignParameter.DESCRIPTOR.fields_by_name
    assert {k: f.number for k, f in fields.items()} == {"spatial_scale": 1, "output_dim": 2, "group_size": 3,
                                                         "sample_num": 4}
    assert fields["sample_num"].default_value == 2
    assert caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name["psroi_align_param"].number == 90000
