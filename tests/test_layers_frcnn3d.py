"""superxuang/caffe_3d_faster_rcnn (3-D Faster R-CNN for CT volumes): Pooling3D with pooling_3d_param,
the 3-D ROIPooling (spatial_scale_xy / spatial_scale_z), Crop's center_align, and the layers read and
sized but not run (MHDRoiData's shapes, Proposal, ProposalTarget, BBoxOutput, RPNOutput).  References are
numpy loops written from the fork's pooling3d_layer.cpp and roi_pooling_layer.cpp / .cu, on
(N, C, L, H, W) shapes whose axes all differ."""

import numpy as np
import pytest
from c_reference import c_round
from conftest import bvlc_pool3d_ref, check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

# ---- Pooling3D ------------------------------------------------------------------------------

def pool_net(shape, params, method=None):
    extra = f" pooling_param {{ pool: {method} }}" if method else ""
    return net(f'layer {{ name: "p" type: "Pooling3D" bottom: "x" top: "p"{extra} pooling_3d_param {{ {params} }} }}',
               inputs={"x": shape})


@pytest.mark.parametrize("params, method, kernel, stride, pad", [
    ("pool: MAX kernel_l: 3 kernel_h: 3 kernel_w: 3 stride_l: 2 stride_h: 2 stride_w: 2", None,
     [3, 3, 3], [2, 2, 2], [0, 0, 0]),   # the nets' pool_1 / pool_2: ceil rounding
    ("kernel_l: 3 kernel_h: 2 kernel_w: 4 stride_l: 2 stride_h: 1 stride_w: 3", None, [3, 2, 4], [2, 1, 3], [0, 0, 0]),
    ("kernel_size: 2 stride: 2 pad: 1", None, [2, 2, 2], [2, 2, 2], [1, 1, 1]),   # the last window clipped
    ("kernel_size: 3 stride: 2 pad_l: 1 pad_h: 0 pad_w: 2", "AVE", [3, 3, 3], [2, 2, 2], [1, 0, 2]),
    ("kernel_l: 2 kernel_h: 3 kernel_w: 3 stride: 2 pad: 1", "AVE", [2, 3, 3], [2, 2, 2], [1, 1, 1]),
])
def test_pooling3d_windows(params, method, kernel, stride, pad, tmp_path):
    x = rng(1).standard_normal((2, 3, 7, 6, 9)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, params, method))
    ref = bvlc_pool3d_ref(x, kernel, stride, pad, method == "AVE")
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_pooling3d_global_pooling(tmp_path):
    x = rng(2).standard_normal((2, 3, 4, 5, 6)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, "global_pooling: true", "AVE"))
    check_everywhere(model, {"x": x}, {"p": x.astype(np.float64).mean(axis=(2, 3, 4), keepdims=True)}, tmp_path,
                     atol=1e-6, rtol=1e-6)


def test_pooling3d_pools_by_pooling_param_not_its_own_pool_field(tmp_path):
    """The fork's forward switches on pooling_param.pool (default MAX): pooling_3d_param { pool: AVE }
    alone still takes the max."""
    x = rng(3).standard_normal((1, 2, 5, 6, 7)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, "pool: AVE kernel_size: 2 stride: 2"))
    assert any("not read by the fork" in n for n in model.warnings)
    check_everywhere(model, {"x": x}, {"p": bvlc_pool3d_ref(x, [2] * 3, [2] * 3, [0] * 3, False)}, tmp_path)


@pytest.mark.parametrize("params, msg", [
    ("kernel_l: 3 kernel_h: 3 stride: 1", "kernel_size OR kernel_l, kernel_h and kernel_w"),
    ("kernel_size: 3 stride: 1 stride_l: 2 stride_h: 2 stride_w: 2", "stride OR stride_l"),
    ("kernel_size: 2 pad: 2", "must be below the kernel"),
    ("global_pooling: true kernel_size: 2", "with global_pooling the kernel size cannot be given"),
    ("stride: 2", "must be > 0"),
])
def test_pooling3d_bad_parameters(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(pool_net((1, 1, 4, 4, 4), params))


def test_pooling3d_stochastic_is_refused():
    with pytest.raises(LayerError, match="MAX and AVE only"):
        load_from_text(pool_net((1, 1, 4, 4, 4), "kernel_size: 2", "STOCHASTIC"))


# ---- ROIPooling (3-D) ---------------------------------------------------------------------------

def fork_roi_pool3d(x, rois, pooled, scale_xy, scale_z):
    """roi_pooling_layer.cu ROIPoolForward: rois [b, x1, y1, z1, x2, y2, z2]; corners x scale in float32,
    C-rounded; sides max(end - start + 1, 1); float32 bins floor(i * bin) .. ceil((i + 1) * bin) from the
    start, clipped; the max over each bin, 0 for an empty one."""
    f = np.float32
    pl, ph, pw = pooled
    n, c, length, h, w = x.shape
    out = np.zeros((len(rois), c, pl, ph, pw), np.float64)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        sx, sy, sz = (c_round(f(roi[i]) * f(s)) for i, s in ((1, scale_xy), (2, scale_xy), (3, scale_z)))
        ex, ey, ez = (c_round(f(roi[i]) * f(s)) for i, s in ((4, scale_xy), (5, scale_xy), (6, scale_z)))
        axes = []
        for start, end, p, size in ((sz, ez, pl, length), (sy, ey, ph, h), (sx, ex, pw, w)):
            side = max(int(end) - int(start) + 1, 1)
            bin_size = f(side) / f(p)
            axes.append([(min(max(int(np.floor(f(i) * bin_size)) + int(start), 0), size),
                          min(max(int(np.ceil(f(i + 1) * bin_size)) + int(start), 0), size)) for i in range(p)])
        for i, (l0, l1) in enumerate(axes[0]):
            for j, (h0, h1) in enumerate(axes[1]):
                for k, (w0, w1) in enumerate(axes[2]):
                    if l1 <= l0 or h1 <= h0 or w1 <= w0:
                        continue
                    out[r, :, i, j, k] = x[b, :, l0:l1, h0:h1, w0:w1].reshape(c, -1).max(axis=1)
    return out


ROIS = np.array([
    [0, 0, 0, 0, 8, 5, 4],          # the whole map (x along W = 9, y along H = 6, z along L = 5)
    [1, 2.4, 1.5, 0.5, 6.6, 4.5, 3.49],   # fractional corners: C's round, half away from zero
    [1, 5, 3, 2, 3, 1, 1],          # ends before starts: 1-cell sides
    [0, -6, -4, -3, 3, 2, 1],       # partly outside the map
    [0, 20, 20, 20, 30, 30, 30],    # entirely outside: every bin empty -> 0
], np.float32)


def roi3d_net(x_shape, rois_shape, params):
    return net(f'layer {{ name: "r" type: "ROIPooling" bottom: "x" bottom: "rois" top: "r" '
               f'roi_pooling_param {{ {params} }} }}', inputs={"x": x_shape, "rois": rois_shape})


@pytest.mark.parametrize("pooled, scale_xy, scale_z", [((2, 3, 4), 1.0, 1.0), ((3, 2, 2), 0.5, 0.75)])
def test_roi_pooling_3d(pooled, scale_xy, scale_z, tmp_path):
    x = rng(5).standard_normal((2, 3, 5, 6, 9)).astype(np.float32)
    pl, ph, pw = pooled
    model = load_from_text(roi3d_net(x.shape, ROIS.shape, f"pooled_l: {pl} pooled_h: {ph} pooled_w: {pw} "
                                                          f"spatial_scale_xy: {scale_xy} spatial_scale_z: {scale_z}"))
    assert model.blob_shapes["r"] == (len(ROIS), 3, pl, ph, pw)
    ref = fork_roi_pool3d(x, ROIS, pooled, scale_xy, scale_z)
    check_everywhere(model, {"x": x, "rois": ROIS}, {"r": ref}, tmp_path, opsets=())
    with pytest.raises(CaffeqError, match=r"layer 'r' \(ROIPooling\): ONNX has no 3-D ROI pooling"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_roi_pooling_3d_reads_the_forks_fields_and_refuses_other_forks():
    from caffeq.layers.frcnn3d import FRCNN3DRoiPooling
    model = load_from_text(roi3d_net((1, 2, 4, 4, 4), (3, 7), "pooled_l: 2 pooled_h: 2 pooled_w: 2 "
                                                             "spatial_scale_z: 0.5"))
    assert type(model.graph.nodes[-1].spec) is FRCNN3DRoiPooling
    with pytest.raises(LayerError, match="pad_ratio is another fork's field"):
        load_from_text(roi3d_net((1, 2, 4, 4, 4), (3, 7), "pooled_l: 2 pooled_h: 2 pooled_w: 2 "
                                                          "spatial_scale_xy: 0.5 pad_ratio: 0.1"))
    with pytest.raises(LayerError, match="pooled_l must be > 0"):
        load_from_text(roi3d_net((1, 2, 4, 4, 4), (3, 7), "pooled_h: 2 pooled_w: 2 spatial_scale_xy: 0.5"))
    model = load_from_text(roi3d_net((1, 2, 4, 4, 4), (3, 5), "pooled_l: 2 pooled_h: 2 pooled_w: 2 "
                                                             "spatial_scale_xy: 1"))
    with pytest.raises(CaffeqError, match=r"rois must be \(R, 7\)"):
        model.run({"x": np.zeros((1, 2, 4, 4, 4), np.float32), "rois": np.zeros((3, 5), np.float32)})


# ---- Crop center_align ------------------------------------------------------------------------

def test_crop_center_align(tmp_path):
    """crop_layer.cpp: with center_align each cropped axis starts at (bottom - reference) / 2."""
    x = rng(7).standard_normal((1, 2, 7, 9, 6)).astype(np.float32)
    ref = np.zeros((1, 3, 4, 4, 3), np.float32)
    model = load_from_text(net('layer { name: "c" type: "Crop" bottom: "x" bottom: "ref" top: "c" '
                               'crop_param { axis: 2 offset: 0 center_align: true } }',
                               inputs={"x": x.shape, "ref": ref.shape}))
    check_everywhere(model, {"x": x, "ref": ref}, {"c": x[:, :, 1:5, 2:6, 1:4]}, tmp_path)


# ---- read and sized, not run --------------------------------------------------------------------

ANCHORS = "anchor_size { width: 15 width: 30 height: 15 height: 30 height: 60 length: 15 }"   # 2 x 3 x 1 = 6


def test_proposal_3d_is_sized_and_refused(tmp_path):
    text = net(f'layer {{ name: "p" type: "Proposal" bottom: "prob" bottom: "deltas" bottom: "im_info" top: "rois" '
               f'proposal_param {{ {ANCHORS} feat_stride_xy: 16 feat_stride_z: 16 proposal_num: 20 }} }}',
               inputs={"prob": (2, 12, 3, 4, 5), "deltas": (2, 36, 3, 4, 5), "im_info": (2, 19)})
    model = load_from_text(text)
    assert model.blob_shapes["rois"] == (40, 7)
    with pytest.raises(CaffeqError, match=r"layer 'p' \(Proposal \(3-D\)\): .* random generator"):
        model.run({"prob": np.zeros((2, 12, 3, 4, 5), np.float32), "deltas": np.zeros((2, 36, 3, 4, 5), np.float32),
                   "im_info": np.zeros((2, 19), np.float32)})
    with pytest.raises(CaffeqError, match="random generator"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    bad = text.replace("(2, 36", "(2, 30").replace("dim: 36", "dim: 30")
    with pytest.raises(LayerError, match="6 anchors need 2 x 6 score and 6 x 6 delta channels"):
        load_from_text(bad)


@pytest.mark.parametrize("layer_type, field, bottoms", [
    ("BBoxOutput", "bbox_output_param { output_root_folder: 'out/' }", ("rois", "prob", "deltas", "im_info")),
    ("RPNOutput", f"rpn_output_param {{ {ANCHORS} roi_root_folder: 'out/' }}", ("prob", "deltas", "im_info")),
])
def test_file_writers_are_read_and_refused(layer_type, field, bottoms, tmp_path):
    shapes = {"rois": (20, 7), "prob": (20, 12), "deltas": (20, 72), "im_info": (1, 19)}
    text = net('layer { name: "keep" type: "ReLU" bottom: "im_info" top: "info2" }\n'
               f'layer {{ name: "w" type: "{layer_type}" ' + " ".join(f'bottom: "{b}"' for b in bottoms)
               + f" {field} }}", inputs={b: shapes[b] for b in bottoms})
    model = load_from_text(text)
    with pytest.raises(CaffeqError, match=rf"layer 'w' \({layer_type}\): writes each volume's boxes to text files"):
        model.run({b: np.zeros(shapes[b], np.float32) for b in bottoms})


def test_mhd_roi_data_takes_the_forks_setup_shapes():
    text = ('layer { name: "d" type: "MHDRoiData" top: "data" top: "im_info" top: "gt_boxes" '
            'mhd_data_param { source: "list.txt" contour_name_list { name: "liver" name: "spleen" } } '
            'include { phase: TRAIN } }\n'
            'layer { name: "p" type: "Pooling3D" bottom: "data" top: "p" '
            'pooling_3d_param { kernel_size: 3 stride: 2 } }')
    model = load_from_text(text, phase="TRAIN")
    assert model.blob_shapes["data"] == (1, 1, 64, 128, 128)
    assert model.blob_shapes["im_info"] == (1, 19)
    assert model.blob_shapes["p"] == (1, 1, 32, 64, 64)
