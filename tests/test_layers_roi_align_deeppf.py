"""LittleCherry11/Deeppftracking's ROIAlign (caffeq/layers/roi_align_forks.py, fork DEEPPFTRACKING).

The reference is a numpy loop written here from the fork's GPU kernel (15c439c src/caffe/layers/
roi_align_layer.cu: ROIAlignForward and bilinear_interpolate), in float32 scalars as its Dtype: the roi's
sides are max(x2 - x1 + 1, 1) after spatial_scale, each bin averages g x g bilinear samples, g the layer's
sampling_ratio (which the fork's proto declares and its LayerSetUp forgets to copy; caffeq reads it).
"""
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, check_everywhere, model_py_outputs, net, onnx_outputs, rng
from test_layers_roi_align_forks import mask_rcnn_bilinear  # the kernel's bilinear_interpolate, the same

import caffeq
from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
X_SHAPE = (2, 3, 7, 11)   # N, C, H, W all different
# inside, crossing the top-left, crossing the bottom-right, one pixel, outside the map, fractional
# corners, the whole second image, an inverted roi (its sides forced to 1)
ROIS = np.array([[0, 2, 1, 13, 9], [1, -6, -3, 8, 6], [1, 9, 4, 30, 19], [0, 7, 7, 7, 7],
                 [1, 40, 30, 50, 44], [0, 3.5, 2.25, 17.75, 8.5], [1, 0, 0, 21, 13], [0, 9, 8, 4, 3]], F)


def ref_deeppf(x, rois, ph, pw, scale, grid):
    _n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    for r, roi in enumerate(rois):
        plane = x[int(roi[0])]
        sw, sh, ew, eh = (F(v) * F(scale) for v in roi[1:5])
        bin_h = max(eh - sh + F(1), F(1)) / F(ph)
        bin_w = max(ew - sw + F(1), F(1)) / F(pw)
        for i in range(ph):
            for j in range(pw):
                total = np.zeros(c, F)
                for iy in range(grid):
                    y = sh + F(i) * bin_h + F(iy + 0.5) * bin_h / F(grid)
                    for ix in range(grid):
                        xx = sw + F(j) * bin_w + F(ix + 0.5) * bin_w / F(grid)
                        total = total + mask_rcnn_bilinear(plane, h, w, y, xx)
                out[r, :, i, j] = total / F(grid * grid)
    return out


def align_net(params):
    return net(f'layer {{ name: "o" type: "ROIAlign" bottom: "x" bottom: "rois" top: "o" '
               f'roi_align_param {{ {params} }} }}', inputs={"x": X_SHAPE, "rois": (len(ROIS), 5)})


def feeds(seed):
    return {"x": rng(seed).standard_normal(X_SHAPE).astype(F), "rois": ROIS}


@pytest.mark.parametrize("ph, pw, scale, grid", [(3, 2, 0.5, 2), (2, 4, 1.0, 3), (4, 3, 0.25, 1)])
def test_matches_the_kernel_everywhere(ph, pw, scale, grid, tmp_path):
    model = load_from_text(align_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} sampling_ratio: {grid}"))
    assert model.blob_shapes["o"] == (len(ROIS), 3, ph, pw)
    assert any("only LittleCherry11/Deeppftracking's ROIAlign declares" in n for n in model.warnings)
    f = feeds(ph + grid)
    ref = ref_deeppf(f["x"], ROIS, ph, pw, scale, grid)
    # torch and model.py: the kernel's float32 operations in its order, equal to the bit
    assert_close(model.run(f)["o"], ref, 0.0, 0.0, "torch")
    assert_close(model_py_outputs(model, f, tmp_path)["o"], ref, 0.0, 0.0, "model.py")
    # ONNX RoiAlign gets the far corners as x2 * scale + 1, so a side is ((x2 s + 1) - x1 s) there against
    # the kernel's ((x2 s - x1 s) + 1): equal here, in general one float32 rounding apart
    check_everywhere(model, f, {"o": ref}, tmp_path, atol=1e-6, rtol=1e-6, opsets=(13, 16, None))
    assert np.count_nonzero(ref[4]) == 0 and np.count_nonzero(ref[1])   # past the map: 0; crossing it: not


def test_differs_from_py_mask_rcnn_by_the_plus_one():
    f = feeds(5)
    ours = load_from_text(align_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 sampling_ratio: 2")).run(f)["o"]
    mask = load_from_text(align_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 fork: PY_MASK_RCNN")).run(f)["o"]
    assert not np.allclose(ours, mask)
    explicit = load_from_text(align_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 fork: DEEPPFTRACKING"))
    # the fork's proto default is 2
    np.testing.assert_array_equal(explicit.run(f)["o"], ours)


def test_adaptive_grid_is_read_but_not_run(tmp_path):
    model = load_from_text(align_net("pooled_h: 2 pooled_w: 2 sampling_ratio: 0"))
    assert model.blob_shapes["o"] == (len(ROIS), 3, 2, 2)
    with pytest.raises(LayerError, match="sampling_ratio 0 is Detectron's adaptive grid"):
        model.run(feeds(0))
    with pytest.raises(ExportError, match="layer 'o' \\(ROIAlign\\): roi_align_param.sampling_ratio 0"):
        onnx_outputs(model, feeds(0), tmp_path)


def test_a_fractional_sampling_ratio_is_refused():
    with pytest.raises(LayerError, match="layer 'o' \\(ROIAlign\\): roi_align_param.sampling_ratio is an unsigned "
                                         "integer in LittleCherry11/Deeppftracking's ROIAlign, got 2.5"):
        load_from_text(align_net("pooled_h: 2 pooled_w: 2 sampling_ratio: 2.5"))


def test_another_fork_with_sampling_ratio_is_refused():
    with pytest.raises(LayerError, match="ROIAlign \\(PY_RFCN_PRIV\\) samples a fixed grid and never reads it"):
        load_from_text(align_net("pooled_h: 2 pooled_w: 2 sampling_ratio: 2 fork: PY_RFCN_PRIV"))


def test_vgg16_align_real_file(tmp_path):
    model = caffeq.load(REALWORLD / "LittleCherry11__Deeppftracking__examples__tracker__vgg16_align.prototxt")
    shapes = model.blob_shapes
    assert shapes["feature5"] == shapes["feature4"] == (3, 512, 7, 7) and shapes["feature3"] == (3, 256, 7, 7)
    node = next(n for n in model.layers if n.name == "roi_pool3")
    assert (node.attrs["grid"], node.attrs["scale"], node.attrs["ph"], node.attrs["pw"]) == (2, 0.25, 7, 7)
    notes = [n for n in model.warnings if "Deeppftracking" in n]
    assert len(notes) == 1 and "'roi_pool5', 'roi_pool4', 'roi_pool3' (ROIAlign)" in notes[0]


# ---- review r132: the kernel's rounding on any corners, its borders, the rois it refuses ----------------


def test_random_fractional_corners_round_as_the_kernel(tmp_path):
    # the side is (x2 s - x1 s) + 1 in float32, in that order: on arbitrary corners another order rounds
    # differently, which equal-to-the-bit torch and model.py would show
    r = rng(7)
    n_rois = 40
    near = r.uniform(-8, 50, (n_rois, 2))
    corners = np.concatenate([near, near + r.uniform(0, 30, (n_rois, 2))], axis=1).astype(F)
    rois = np.concatenate([r.integers(0, 2, (n_rois, 1)).astype(F), corners], axis=1)
    model = load_from_text(net('layer { name: "o" type: "ROIAlign" bottom: "x" bottom: "rois" top: "o" '
                               'roi_align_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.1875 sampling_ratio: 3 } }',
                               inputs={"x": X_SHAPE, "rois": rois.shape}))
    f = {"x": r.standard_normal(X_SHAPE).astype(F), "rois": rois}
    ref = ref_deeppf(f["x"], rois, 3, 2, 0.1875, 3)
    assert_close(model.run(f)["o"], ref, 0.0, 0.0, "torch")
    assert_close(model_py_outputs(model, f, tmp_path)["o"], ref, 0.0, 0.0, "model.py")
    # ONNX's sides are (x2 s + 1) - x1 s: one float32 rounding apart
    assert_close(onnx_outputs(model, f, tmp_path)["o"], ref, 1e-5, 1e-5, "onnx")


def test_samples_exactly_on_the_borders(tmp_path):
    # one sample per roi (pooled 1 x 1, grid 1) at x1 + (x2 - x1 + 1) / 2: exactly at y = H, x = W and
    # y = x = -1 the kernel still reads (clamped to the last / first cell); a quarter past, it gives 0
    x = rng(3).standard_normal(X_SHAPE).astype(F)
    h, w = X_SHAPE[2], X_SHAPE[3]
    rois = np.array([[1, w - 1, h - 1, w, h], [0, -2, -2, -1, -1], [1, w - 1, h - 1, w + 0.5, h + 0.5],
                     [0, -2.5, -2.5, -1, -1], [1, w - 1, -2, w, -1]], F)
    model = load_from_text(net('layer { name: "o" type: "ROIAlign" bottom: "x" bottom: "rois" top: "o" '
                               'roi_align_param { pooled_h: 1 pooled_w: 1 sampling_ratio: 1 } }',
                               inputs={"x": X_SHAPE, "rois": rois.shape}))
    ref = ref_deeppf(x, rois, 1, 1, 1.0, 1)
    np.testing.assert_array_equal(ref[:, :, 0, 0], np.stack([x[1, :, h - 1, w - 1], x[0, :, 0, 0],
                                                             np.zeros(3, F), np.zeros(3, F), x[1, :, 0, w - 1]]))
    check_everywhere(model, {"x": x, "rois": rois}, {"o": ref}, tmp_path, opsets=(13, 16))


def test_empty_and_out_of_batch_rois():
    model = load_from_text(align_net("pooled_h: 3 pooled_w: 2 sampling_ratio: 2"))
    x = feeds(0)["x"]
    assert model.run({"x": x, "rois": np.zeros((0, 5), F)})["o"].shape == (0, 3, 3, 2)
    # the kernel reads memory before or past the blob for these: refused, not guessed
    for batch in (-1, 2):
        with pytest.raises(LayerError, match=rf"layer .o. \(ROIAlign\): roi batch index {batch} is outside the batch of 2"):
            model.run({"x": x, "rois": np.array([[batch, 0, 0, 3, 3]], F)})


def test_adaptive_grid_has_no_model_py(tmp_path):
    model = load_from_text(align_net("pooled_h: 2 pooled_w: 2 sampling_ratio: 0"))
    with pytest.raises(ExportError, match="layer 'o' \\(ROIAlign\\): roi_align_param.sampling_ratio 0 is Detectron"):
        model_py_outputs(model, feeds(0), tmp_path)
