"""jkokkin/UberNet's Caffe (caffeq/layers/ubernet.py): ROIPooling's `is_rich` and `bb_type`, against a loop
written here from the fork's GPU kernel (caffe-fast-rcnn/src/caffe/layers/roi_pooling_layer.cu at b33344d,
ROIPoolForward) in float32 scalars as its Dtype; and BVLC's dilation 0 on a 1 x 1 convolution, which
UberNet's ASPP template writes for its no-hole branch.  UberNet's test.prototxt (GPL-3.0) stays out of
tests/fixtures: the net-level test is a small net shaped like its detection head."""
import math

import numpy as np
import pytest
from c_reference import c_round
from conftest import backend_outputs, check_everywhere, conv_ref, net, onnx_outputs, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
FLT_MAX = F(3.4028234663852886e38)
X_SHAPE = (2, 3, 13, 17)
# inside the map, past its edges, a point, an inverted box, odd corners (halves and centres off the grid),
# a box on the second image wider than the map
ROIS = np.array([[0, 2, 1, 13, 9], [1, -6, -3, 8, 6], [1, 9, 4, 30, 19], [0, 7, 7, 7, 7],
                 [0, 9, 8, 3, 1], [0, 3, 2.5, 17, 11], [1, 0, 0, 33, 25], [1, -10, -9, 60, 40]], F)


def ref_regions(roi, bb_type):
    """ROIPoolForward's RoiManip and RoiInterior corners (float32) and whether the box has a hole."""
    x1, y1, x2, y2 = (F(v) for v in roi[1:5])
    cen_w, scl_w = F(x1 + x2) / F(2), F(x2 - x1) / F(2)
    cen_h, scl_h = F(y1 + y2) / F(2), F(y2 - y1) / F(2)
    manip, interior = [x1, y1, x2, y2], [x1, y1, x2, y2]
    scale_in = scale_out = F(1)
    has_hole = False
    if bb_type == 1:
        manip[2] = cen_w
    elif bb_type == 2:
        manip[0] = cen_w
    elif bb_type == 3:
        manip[3] = cen_h
    elif bb_type == 4:
        manip[1] = cen_h
    elif bb_type == 5:
        scale_out = F(0.5)
    elif bb_type in (6, 7, 8, 9):
        scale_out, scale_in = {6: (F(0.8), F(0.3)), 7: (F(1.0), F(0.5)), 8: (F(1.5), F(0.8)),
                               9: (F(1.8), F(1.0))}[bb_type]
        has_hole = True

    def scaled(s):
        return [cen_w - s * scl_w, cen_h - s * scl_h, cen_w + s * scl_w, cen_h + s * scl_h]
    if scale_out != F(1):
        manip = scaled(scale_out)
    if has_hole:
        interior = scaled(scale_in)
    return manip, interior, has_hole


def ref_ubernet_pool(x, rois, ph, pw, scale, bb_type=0, is_rich=0):
    """The kernel's loop: every (roi, channel, ph, pw) element."""
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    scale = F(scale)
    for r, roi in enumerate(rois):
        manip, interior, has_hole = ref_regions(roi, bb_type)
        hole = [int(c_round(F(v) * scale)) for v in interior]
        start_w, start_h, end_w, end_h = (int(c_round(F(v) * scale)) for v in manip)
        roi_w, roi_h = max(end_w - start_w + 1, 1), max(end_h - start_h + 1, 1)
        bin_h, bin_w = F(roi_h) / F(ph), F(roi_w) / F(pw)
        b = int(roi[0])
        step = 1 + int(bool(is_rich))
        for i in range(ph):
            for j in range(pw):
                hs = min(max(int(math.floor(F(i) * bin_h)) + start_h, 0), h)
                he = min(max(int(math.ceil(F(i + 1) * bin_h)) + start_h, 0), h)
                ws = min(max(int(math.floor(F(j) * bin_w)) + start_w, 0), w)
                we = min(max(int(math.ceil(F(j + 1) * bin_w)) + start_w, 0), w)
                empty = he <= hs or we <= ws
                for ch in range(c):
                    best = F(0) if empty else -FLT_MAX
                    for y in range(hs, he, step):
                        for z in range(ws, we, step):
                            if has_hole and hole[1] < y < hole[3] and hole[0] < z < hole[2]:
                                continue
                            if x[b, ch, y, z] > best:
                                best = x[b, ch, y, z]
                    out[r, ch, i, j] = best
    return out


def roi_net(params, rois=ROIS):
    return load_from_text(net('layer { name: "o" type: "ROIPooling" bottom: "x" bottom: "rois" top: "o" '
                              f'roi_pooling_param {{ {params} }} }}', inputs={"x": X_SHAPE, "rois": rois.shape}))


@pytest.mark.parametrize("ph, pw, scale, bb_type, is_rich", [
    (7, 7, 0.5, 0, 1),     # UberNet's detection head: bb_type 0, is_rich 1 (here on a small map)
    (3, 4, 1.0, 0, 1), (2, 5, 0.25, 1, 0), (4, 3, 0.5, 2, 1), (3, 3, 1.0, 3, 0), (2, 2, 0.5, 4, 1),
    (3, 2, 1.0, 5, 1), (4, 4, 1.0, 7, 0), (3, 5, 0.5, 7, 1), (5, 4, 1.0, 9, 0), (3, 3, 1.0, 12, 1),
])
def test_ubernet_roi_pooling_matches_the_kernel_everywhere(ph, pw, scale, bb_type, is_rich, tmp_path):
    model = roi_net(f"pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} bb_type: {bb_type} is_rich: {is_rich}")
    assert model.blob_shapes["o"] == (len(ROIS), 3, ph, pw)
    x = rng(ph * 10 + bb_type).standard_normal(X_SHAPE).astype(F)
    ref = ref_ubernet_pool(x, ROIS, ph, pw, scale, bb_type, is_rich)
    # maxima of the inputs: exact in torch, onnxruntime and model.py
    check_everywhere(model, {"x": x, "rois": ROIS}, {"o": ref}, tmp_path)


def test_the_holes_of_types_6_and_8_and_a_bin_inside_the_hole(tmp_path):
    # box corners whose 0.8 / 0.3 / 1.5 products round the same with or without an fma (dyadic half-sizes)
    rois = np.array([[0, 0, 0, 16, 12], [1, 2, 2, 10, 10], [0, 4, 0, 12, 8]], F)
    x = rng(6).standard_normal(X_SHAPE).astype(F)
    for bb_type in (6, 8):
        model = roi_net(f"pooled_h: 5 pooled_w: 5 spatial_scale: 1 bb_type: {bb_type}", rois)
        ref = ref_ubernet_pool(x, rois, 5, 5, 1.0, bb_type)
        if bb_type == 8:
            assert (ref == -FLT_MAX).any()   # the kernel's running maximum where the hole covers a whole bin
        check_everywhere(model, {"x": x, "rois": rois}, {"o": ref}, tmp_path)


def test_is_rich_differs_from_fast_rcnn_and_type_0_without_it_is_fast_rcnn(tmp_path):
    x = rng(3).standard_normal(X_SHAPE).astype(F)
    plain = load_from_text(net('layer { name: "o" type: "ROIPooling" bottom: "x" bottom: "rois" top: "o" '
                               'roi_pooling_param { pooled_h: 3 pooled_w: 3 spatial_scale: 1 } }',
                               inputs={"x": X_SHAPE, "rois": ROIS.shape})).run({"x": x, "rois": ROIS})["o"]
    rich = roi_net("pooled_h: 3 pooled_w: 3 spatial_scale: 1 is_rich: 1").run({"x": x, "rois": ROIS})["o"]
    assert not np.array_equal(plain, rich)
    np.testing.assert_array_equal(plain, ref_ubernet_pool(x, ROIS, 3, 3, 1.0))


@pytest.mark.parametrize("bb_type, as_type", [(1.9, 1), (-0.7, 0), (9.99, 9)])
def test_bb_type_is_truncated_to_the_layers_int(bb_type, as_type, tmp_path):
    x = rng(11).standard_normal(X_SHAPE).astype(F)
    model = roi_net(f"pooled_h: 3 pooled_w: 3 spatial_scale: 0.5 bb_type: {bb_type}")
    check_everywhere(model, {"x": x, "rois": ROIS}, {"o": ref_ubernet_pool(x, ROIS, 3, 3, 0.5, as_type)}, tmp_path)


def test_no_rois_and_rois_outside_the_batch(tmp_path):
    # an image without proposals: (0, C, ph, pw) everywhere (onnxruntime takes no 0-step Scan: a padding roi)
    model = load_from_text(net('layer { name: "o" type: "ROIPooling" bottom: "x" bottom: "rois" top: "o" '
                               'roi_pooling_param { pooled_h: 2 pooled_w: 3 is_rich: 1 bb_type: 7 } }',
                               inputs={"x": X_SHAPE, "rois": (0, 5)}))
    x = rng(12).standard_normal(X_SHAPE).astype(F)
    for backend, got in backend_outputs(model, {"x": x, "rois": np.zeros((0, 5), F)}, tmp_path).items():
        assert got.shape == (0, 3, 2, 3), backend
    # a batch index past the batch: torch refuses it; ONNX, which cannot refuse, gives 0 for that roi
    rois = np.array([[0, 1, 1, 9, 9], [2, 1, 1, 9, 9]], F)
    model = roi_net("pooled_h: 2 pooled_w: 2 is_rich: 1", rois)
    with pytest.raises(LayerError, match="batch index 2 is outside the batch of 2"):
        model.run({"x": x, "rois": rois})
    got = onnx_outputs(model, {"x": x, "rois": rois}, tmp_path)["o"]
    np.testing.assert_array_equal(got[0], ref_ubernet_pool(x, rois[:1], 2, 2, 1.0, 0, 1)[0])
    assert not got[1].any()


@pytest.mark.parametrize("params, message", [
    ("pooled_h: 2 pooled_w: 2 is_rich: 1 pad_ratio: 0.5", "come from different forks"),
    ("pooled_h: 2 pooled_w: 2 bb_type: 1 pool: AVE", "come from different forks"),
    ("pooled_h: 2 pooled_w: 2 bb_type: 1e12", "does not fit the fork's int"),
])
def test_ubernet_roi_pooling_refuses_mixed_forks(params, message):
    with pytest.raises(LayerError, match=message):
        roi_net(params)


def test_ubernet_like_head_reads_with_the_forks_fields(tmp_path):
    # the detection head of UberNet's test.prototxt: deletetop / deletebottom (its memory saving), a 1x1
    # convolution with dilation 0, ROIPooling with bb_type 0 and is_rich 1 on a stride-8 map
    text = net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" deletetop: true '
               'convolution_param { num_output: 4 kernel_size: 1 pad: 0 dilation: 0 stride: 1 } }',
               'layer { name: "p" type: "ROIPooling" bottom: "c" bottom: "rois" top: "p" deletebottom: true '
               'roi_pooling_param { pooled_w: 7 pooled_h: 7 spatial_scale: 0.125 bb_type: 0 is_rich: 1 } }',
               inputs={"x": (1, 3, 25, 25), "rois": (4, 5)})
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["p"] == (4, 4, 7, 7)
    rois = np.array([[0, 8, 8, 150, 100], [0, 0, 0, 199, 199], [0, 40, 60, 41, 61], [0, -20, 30, 90, 250]], F)
    x = rng(13).standard_normal((1, 3, 25, 25)).astype(F)
    got = backend_outputs(model, {"x": x, "rois": rois}, tmp_path, top="p")
    conv = model.run({"x": x, "rois": rois}, all_blobs=True)["c"]
    for backend, out in got.items():   # the convolution's own rounding aside, the kernel's pooling of it
        np.testing.assert_allclose(out, ref_ubernet_pool(conv, rois, 7, 7, 0.125, 0, 1), rtol=1e-5, atol=1e-5,
                                   err_msg=backend)


def test_dilation_0_on_a_1x1_convolution_is_dilation_1_and_refused_on_wider_kernels(tmp_path):
    # BVLC's base_conv_layer.cpp checks no dilation's value; a 1-wide kernel reads the same pixel at any
    # dilation (UberNet's ASPP template writes `dilation: 0` on its 1x1 branch)
    x = rng(5).standard_normal((1, 3, 6, 7)).astype(F)
    model = load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { '
                               'num_output: 2 kernel_size: 1 pad: 1 stride: 2 dilation: 0 } }', inputs={"x": x.shape}),
                           random_weights=True)
    w, b = (np.asarray(v, F) for v in next(n for n in model.layers if n.name == "c").blobs)
    check_everywhere(model, {"x": x}, {"c": conv_ref(x, w, b, (2, 2), (1, 1))}, tmp_path, atol=1e-6, rtol=1e-6)
    with pytest.raises(LayerError, match="dilation 0 with kernel_size"):
        load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { '
                           'num_output: 2 kernel_size: 3 dilation: 0 } }', inputs={"x": x.shape}))
