"""wk910930/caffe-fast-rcnn's ROIAlignPooling (4e6b382 roi_align_pooling_layer.cu ROIAlignPoolForward): the
reference is the kernel's loop, one output element at a time in numpy float32 (separate roundings)."""
import numpy as np
import pytest
from conftest import backend_outputs, check_everywhere, net, onnx_outputs, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
FLT_MAX = F(3.4028234663852886e38)


def bilinear(plane, h, w):
    height, width = plane.shape
    h, w = (F(0) if h < F(0.5) else h), (F(0) if w < F(0.5) else w)
    h_low, w_low = int(h), int(w)
    if h_low >= height - 1:
        h_high = h_low = height - 1
        h = F(h_low)
    else:
        h_high = h_low + 1
    if w_low >= width - 1:
        w_high = w_low = width - 1
        w = F(w_low)
    else:
        w_high = w_low + 1
    lh, lw = F(h - F(h_low)), F(w - F(w_low))
    hh, hw = F(F(1) - lh), F(F(1) - lw)
    w1, w2, w3, w4 = F(hh * hw), F(hh * lw), F(lh * hw), F(lh * lw)
    return F(F(F(F(w1 * plane[h_low, w_low]) + F(w2 * plane[h_low, w_high])) + F(w3 * plane[h_high, w_low]))
             + F(w4 * plane[h_high, w_high]))


def ref(x, rois, ph, pw, scale, samples):
    n, c, height, width = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    scale = F(scale)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        sw, sh, ew, eh = (F(v * scale) for v in roi[1:])
        rw, rh = max(F(F(ew - sw) + F(1)), F(1)), max(F(F(eh - sh) + F(1)), F(1))
        bh, bw = F(rh / F(ph)), F(rw / F(pw))
        for ch in range(c):
            for i in range(ph):
                for j in range(pw):
                    hs = min(max(F(F(F(i) * bh) + sh), F(0)), F(height))
                    he = min(max(F(F(F(i + 1) * bh) + sh), F(0)), F(height))
                    ws = min(max(F(F(F(j) * bw) + sw), F(0)), F(width))
                    we = min(max(F(F(F(j + 1) * bw) + sw), F(0)), F(width))
                    empty = he <= hs or we <= ws
                    best, updated = (F(0) if empty else -FLT_MAX), False
                    step_h, step_w = F(bh / F(samples + 1)), F(bw / F(samples + 1))
                    for a in range(1, samples + 1):
                        for k in range(1, samples + 1):
                            yh, xw = F(hs + F(F(a) * step_h)), F(ws + F(F(k) * step_w))
                            if yh < F(-0.5) or yh >= he or xw < F(-0.5) or xw >= we:
                                continue
                            val = bilinear(x[b, ch], yh, xw)
                            if val > best:
                                best = val
                            updated = True
                    out[r, ch, i, j] = best if updated else F(0)
    return out


X_SHAPE = (2, 3, 9, 11)
# inside, past the map (clamped bins), a tiny roi (one bin over many), fractional corners, below 0.5
ROIS = np.array([[0, 2, 1, 13, 9], [1, 30, 20, 60, 44], [1, 5, 5, 5, 5], [0, 3.5, 2.25, 17.75, 8.5],
                 [1, -3, -4, 40, 36], [0, 0, 0, 1.5, 0.5]], F)


def align_net(params, rois_shape=(len(ROIS), 5)):
    return net(f'layer {{ name: "o" type: "ROIAlignPooling" bottom: "x" bottom: "rois" top: "o" '
               f'roi_align_pooling_param {{ {params} }} }}', inputs={"x": X_SHAPE, "rois": rois_shape})


@pytest.mark.parametrize("ph, pw, scale, samples", [(3, 2, 0.25, 2), (2, 4, 0.5, 1), (4, 3, 0.25, 3)])
def test_matches_the_kernel(ph, pw, scale, samples, tmp_path):
    model = load_from_text(align_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} sample_num: {samples}"))
    assert model.blob_shapes["o"] == (len(ROIS), 3, ph, pw)
    x = rng(ph).standard_normal(X_SHAPE).astype(F)
    want = ref(x, ROIS, ph, pw, scale, samples)
    assert np.count_nonzero(want) > want.size // 2
    # the kernel's float32 operations in its order: torch, onnxruntime and model.py equal to the bit
    check_everywhere(model, {"x": x, "rois": ROIS}, {"o": want}, tmp_path)


def test_no_rois_and_an_image_outside_the_batch(tmp_path):
    model = load_from_text(align_net("pooled_h: 2 pooled_w: 2 spatial_scale: 0.5 sample_num: 2", rois_shape=(0, 5)))
    x = rng(3).standard_normal(X_SHAPE).astype(F)
    for backend, got in backend_outputs(model, {"x": x, "rois": np.zeros((0, 5), F)}, tmp_path).items():
        assert got.shape == (0, 3, 2, 2), backend
    rois = np.array([[0, 2, 1, 13, 9], [5, 2, 1, 13, 9]], F)
    model = load_from_text(align_net("pooled_h: 2 pooled_w: 2 spatial_scale: 0.5 sample_num: 2", rois_shape=(2, 5)))
    got = onnx_outputs(model, {"x": x, "rois": rois}, tmp_path)["o"]     # torch refuses the second roi
    np.testing.assert_array_equal(got[0], ref(x, rois[:1], 2, 2, 0.5, 2)[0])
    assert not got[1].any()


@pytest.mark.parametrize("params, rois_shape, msg", [
    ("pooled_w: 2", (3, 5), "pooled_h and pooled_w must be > 0"),
    ("pooled_h: 2 pooled_w: 2", (3, 4), r"rois must be \(R, 5\) or \(R, 5, 1, 1\)"),
    ("pooled_h: 2 pooled_w: 2", (3, 5, 2), r"rois must be \(R, 5\) or \(R, 5, 1, 1\)"),
])
def test_refuses_what_its_setup_checks(params, rois_shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(align_net(params, rois_shape))


def test_a_roi_outside_the_batch_is_one_clear_error():
    model = load_from_text(align_net("pooled_h: 2 pooled_w: 2", (1, 5)))
    with pytest.raises(LayerError, match="batch index 2 is outside the batch of 2"):
        model.run({"x": np.zeros(X_SHAPE, F), "rois": np.array([[2, 0, 0, 4, 4]], F)})
