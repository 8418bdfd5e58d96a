"""NVIDIA DIGITS DetectNet's DetectNetTransformation (NVIDIA/caffe c94daa05) against references written
from the fork's code: the TEST-phase data top as Forward_gpu's kernels compute it (detectnet_transform_layer.cu:
channel_mean_subtraction, spatial_transformations, interpolate_xy / cubic_interpolation, get_value) and
the label top as CoverageGenerator::generate (util/detectnet_coverage_rectangular.cpp) after
transform_label_cpu's scaling, pixel by pixel and cell by cell; in torch, onnxruntime (the data top)
and the generated model.py; the parameter checks, the TRAIN-phase refusal and a small DIGITS-like
train_val net that reads without its datasets and runs at TEST."""
import math

import numpy as np
import pytest
from conftest import (
    assert_close,
    check_everywhere,
    cli_process,
    inputs_text,
    model_py_outputs,
    ok,
    one_line_error,
)

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
EPS = float(np.finfo(np.float32).eps)
RNG = np.random.default_rng(29)


# ---- references from the fork's code -----------------------------------------------------------

def ref_data(x, mean, out_w, out_h):
    """Forward_gpu at TEST: channel_mean_subtraction (mean / 255 in float, times 255 again), then
    spatial_transformations with crop offset 0, no rotation, no flip, scale = the image size."""
    n, c, h, w = x.shape
    tmp = x.astype(F32).copy()
    if mean is not None:
        means = mean * 3 if len(mean) == 1 else mean
        for ch in range(3):
            tmp[:, ch] -= F32(F32(F32(means[ch]) / F32(255)) * F32(255))

    def value(img, yy, xx):                  # get_value: replicate one pixel, then 0
        xx = 0 if xx == -1 else (w - 1 if xx == w else xx)
        yy = 0 if yy == -1 else (h - 1 if yy == h else yy)
        return float(img[yy, xx]) if 0 <= xx < w and 0 <= yy < h else 0.0

    def cubic(d, v1, v2, v3, v4):            # the kernel's literals are doubles
        d = float(d)
        return F32(v2 + d * (-2.0 * v1 - 3.0 * v2 + 6.0 * v3 - 1.0 * v4 + d * (
            3.0 * v1 - 6.0 * v2 + 3.0 * v3 + 0.0 * v4 + d * (-1.0 * v1 + 3.0 * v2 - 3.0 * v3 + 1.0 * v4))) / 6.0)

    out = np.zeros((n, c, out_h, out_w), F32)
    for b in range(n):
        for ch in range(c):
            img = tmp[b, ch]
            for dy in range(out_h):
                for dx in range(out_w):
                    px, py = F32(dx), F32(dy)
                    if w != out_w:
                        px = F32(px * F32(F32(w - 1) / F32(out_w - 1)))
                    if h != out_h:
                        py = F32(py * F32(F32(h - 1) / F32(out_h - 1)))

                    def along_x(row, px=px, img=img):
                        lo, hi = math.floor(px), math.ceil(px)
                        return cubic(F32(px - F32(lo)), value(img, row, lo - 1), value(img, row, lo),
                                     value(img, row, hi), value(img, row, hi + 1))
                    lo, hi = math.floor(py), math.ceil(py)
                    out[b, ch, dy, dx] = cubic(F32(py - F32(lo)), along_x(lo - 1), along_x(lo), along_x(hi),
                                               along_x(hi + 1))
    return out


def rect_and(a, b):
    """cv::Rect_<float> a & b: (0, 0, 0, 0) when empty."""
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    w = F32(min(F32(a[0] + a[2]), F32(b[0] + b[2])) - x1)
    h = F32(min(F32(a[1] + a[3]), F32(b[1] + b[3])) - y1)
    if w <= 0 or h <= 0:
        return (F32(0), F32(0), F32(0), F32(0))
    return (F32(x1), F32(y1), w, h)


def ref_label(blob, in_w, in_h, g):
    """transform_label_cpu at TEST (scale the boxes to image_size) and CoverageGenerator::generate."""
    stride, isx, isy = g["stride"], g["image_size_x"], g["image_size_y"]
    gw = int(np.rint(F32(isx) * F32(1.0 / stride)))    # Rect(Point2f, Size2f) rounds to int
    gh = int(np.rint(F32(isy) * F32(1.0 / stride)))
    classes = g.get("classes") or {1: 0}
    out = np.zeros((blob.shape[0], 8 + max(classes.values()) + 1, gh, gw), F32)
    f_stride, cell_area = F32(stride), F32(stride * stride)
    for i in range(blob.shape[0]):
        flat = blob[i].ravel().astype(F32)
        count = int(flat[0])
        assert int(flat[1]) == 16
        boxes = []
        for k in range(count):
            rec = flat[16 * (k + 1):16 * (k + 2)]
            x, y, w, h = (F32(v) for v in rec[:4])
            if (in_w, in_h) != (isx, isy):
                sx, sy = F32(F32(isx) / F32(in_w)), F32(F32(isy) / F32(in_h))
                x, y, w, h = F32(x * sx), F32(y * sy), F32(w * sx), F32(h * sy)
            if g.get("crop_bboxes", True):
                x, y, w, h = rect_and((x, y, w, h), (F32(0), F32(0), F32(isx), F32(isy)))
            if int(rec[5]) not in classes or F32(w * h) < EPS:
                continue
            boxes.append((x, y, w, h, int(rec[5])))
        for x, y, w, h, cls in boxes:
            cx, cy = F32(F32(x + F32(x + w)) * F32(0.5)), F32(F32(y + F32(y + h)) * F32(0.5))
            sw, sh = F32(w * F32(g.get("scale_cvg", 0.5))), F32(h * F32(g.get("scale_cvg", 0.5)))
            if g.get("gridbox_min"):
                sw, sh = min(w, max(F32(g["min_cvg_len"]), sw)), min(h, max(F32(g["min_cvg_len"]), sh))
            else:
                sw, sh = min(F32(g.get("max_cvg_len", 50)), sw), min(F32(g.get("max_cvg_len", 50)), sh)
            cov = (F32(cx - F32(sw * F32(0.5))), F32(cy - F32(sh * F32(0.5))))
            cov = cov + (F32(F32(cx + F32(sw * F32(0.5))) - cov[0]), F32(F32(cy + F32(sh * F32(0.5))) - cov[1]))
            norm = max(F32(0 if g.get("obj_norm") else 1), F32(cell_area / F32(cov[2] * cov[3])))
            x0, y0 = math.floor(F32(cov[0] / f_stride)), math.floor(F32(cov[1] / f_stride))
            x1 = math.ceil(F32(F32(cov[0] + cov[2]) / f_stride))
            y1 = math.ceil(F32(F32(cov[1] + cov[3]) / f_stride))
            for gy in range(max(y0, 0), min(y1, gh)):
                for gx in range(max(x0, 0), min(x1, gw)):
                    cell = (F32(F32(gx) * f_stride), F32(F32(gy) * f_stride), f_stride, f_stride)
                    inter = rect_and(cov, cell)
                    if F32(F32(inter[2] * inter[3]) / cell_area) <= EPS:
                        continue
                    v = out[i, :, gy, gx]
                    v[8:] = 0
                    v[8 + classes[cls]] = 1
                    v[1], v[2] = x - cell[0], y - cell[1]
                    v[3], v[4] = F32(x + w) - cell[0], F32(y + h) - cell[1]
                    v[5], v[6] = F32(1.0 / float(w)), F32(1.0 / float(h))
                    v[7] = norm
                    v[0] = 1
    return out


def label_blob(records, rows):
    """DIGITS' label blob (N, 1, rows, 16): a header row (count, 16) then one row per box
    (x, y, w, h, alpha, class, ...)."""
    blob = np.zeros((len(records), 1, rows, 16), F32)
    for i, boxes in enumerate(records):
        blob[i, 0, 0, :2] = (len(boxes), 16)
        for k, (x, y, w, h, cls) in enumerate(boxes):
            blob[i, 0, k + 1, :6] = (x, y, w, h, 0.3, cls)
            blob[i, 0, k + 1, 6:] = RNG.standard_normal(10)     # the fields the layer does not read
    return blob


def gt_text(g):
    fields = {k: v for k, v in g.items() if k != "classes"}
    text = " ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()
                    if k != "gridbox_min")
    if g.get("gridbox_min"):
        text += " gridbox_type: GRIDBOX_MIN"
    for src, dst in (g.get("classes") or {}).items():
        text += f" object_class {{ src: {src} dst: {dst} }}"
    return text


def transform_net(data_shape, label_shape, g, mean=(127,), extra=""):
    means = " ".join(f"mean_value: {m}" for m in mean)
    return ('name: "t"\n' + inputs_text(data=data_shape, label=label_shape)
            + f'layer {{ name: "val_transform" type: "DetectNetTransformation" bottom: "data" bottom: "label" '
              f'top: "d" top: "l" transform_param {{ {means} }} '
              f'detectnet_groundtruth_param {{ {gt_text(g)} }} {extra} }}')


BOXES = [[(0.5, 0.4, 4.2, 3.1, 1), (5.0, -1.0, 4.0, 3.0, 3), (2.0, 2.0, 1.0, 1.0, 7), (1.2, 2.5, 0.6, 0.8, 1)],
         [(6.5, 4.5, 3.0, 2.0, 3)]]
GT = {"stride": 2, "image_size_x": 9, "image_size_y": 4, "scale_cvg": 0.6, "gridbox_min": True,
      "min_cvg_len": 1, "obj_norm": True, "crop_bboxes": True, "classes": {1: 0, 3: 2}}


# ---- the data top ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, size, mean", [
    ((2, 3, 5, 7), (9, 4), (127,)),            # W up (7 -> 9), H down (5 -> 4)
    ((3, 3, 6, 4), (3, 8), (104, 117, 123.5)),  # W down, H up, one mean per channel
    ((2, 3, 4, 9), (9, 4), ()),                 # the image size already: no resize, no mean
    ((1, 3, 1, 5), (6, 3), (50,)),              # a one-row image: every row reads it
])
def test_detectnet_data_top_matches_the_gpu_kernels(shape, size, mean, tmp_path):
    g = dict(GT, image_size_x=size[0], image_size_y=size[1])
    x = RNG.uniform(0, 255, shape).astype(F32)
    model = load_from_text(transform_net(shape, (shape[0], 1, 5, 16), g, mean), outputs=["d"])
    ref = ref_data(x, list(mean) or None, *size)
    assert model.blob_shapes["d"] == (shape[0], 3, size[1], size[0])
    feeds = {"data": x, "label": label_blob([[]] * shape[0], 5)}
    check_everywhere(model, feeds, {"d": ref}, tmp_path, atol=1e-4)


def test_detectnet_same_size_is_the_mean_subtraction_exactly(tmp_path):
    x = RNG.uniform(0, 255, (2, 3, 4, 9)).astype(F32)
    model = load_from_text(transform_net(x.shape, (2, 1, 3, 16), GT, (104, 117, 123)), outputs=["d"])
    ref = x - np.array([104, 117, 123], F32).reshape(1, 3, 1, 1)
    check_everywhere(model, {"data": x, "label": label_blob([[], []], 3)}, {"d": ref}, tmp_path)


# ---- the label top --------------------------------------------------------------------------------

@pytest.mark.parametrize("g, shape", [
    (GT, (2, 3, 5, 7)),                                                         # boxes scaled 7x5 -> 9x4
    (dict(GT, gridbox_min=False, max_cvg_len=2, obj_norm=False, crop_bboxes=False), (2, 3, 5, 7)),
    ({"stride": 3, "image_size_x": 7, "image_size_y": 5, "scale_cvg": 0.9}, (2, 3, 5, 7)),   # same size
])
def test_detectnet_label_maps_match_the_coverage_generator(g, shape, tmp_path):
    blob = label_blob(BOXES, 6)
    model = load_from_text(transform_net(shape, blob.shape, g), outputs=["d", "l"])
    ref = ref_label(blob, shape[3], shape[2], g)
    assert model.blob_shapes["l"] == ref.shape
    assert ref[:, 0].sum() > 0
    x = RNG.uniform(0, 255, shape).astype(F32)
    ours = model.run({"data": x, "label": blob})
    np.testing.assert_array_equal(ours["l"], ref)
    got = model_py_outputs(model, {"data": x, "label": blob}, tmp_path)
    np.testing.assert_array_equal(got["l"], ref)
    assert_close(got["d"], ref_data(x, [127], g["image_size_x"], g["image_size_y"]), 1e-4, 0, "model.py d")


def test_detectnet_label_shape_and_default_class():
    """No object_class: class 1 -> coverage map 0 (the fork's KITTI default); the grid rounds
    image_size * float(1 / stride) to the nearest int (78 x 24 for DetectNet's 1248 x 384 over 16)."""
    g = {"stride": 16, "image_size_x": 1248, "image_size_y": 384}
    model = load_from_text(transform_net((2, 3, 384, 1248), (2, 1, 50, 16), g), outputs=["d", "l"])
    assert model.blob_shapes["l"] == (2, 9, 24, 78)
    model = load_from_text(transform_net((2, 3, 5, 7), (2, 1, 50, 16), dict(g, stride=2, image_size_x=9)),
                           outputs=["l"])
    assert model.blob_shapes["l"] == (2, 9, 192, 4)      # 9 * 0.5 = 4.5 rounds to even


def test_detectnet_onnx_refuses_only_a_used_label_map(tmp_path):
    model = load_from_text(transform_net((2, 3, 5, 7), (2, 1, 6, 16), GT), outputs=["d", "l"])
    with pytest.raises(ExportError, match="ground-truth maps 'l' are built box by box"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_detectnet_bad_label_header_is_one_line():
    blob = label_blob(BOXES, 6)
    blob[0, 0, 0, 1] = 15
    model = load_from_text(transform_net((2, 3, 5, 7), blob.shape, GT), outputs=["d", "l"])
    x = RNG.uniform(0, 255, (2, 3, 5, 7)).astype(F32)
    with pytest.raises(CaffeqError, match="bbox length 15, the fork reads 16"):
        model.run({"data": x, "label": blob})
    blob[0, 0, 0, :2] = (9, 16)
    with pytest.raises(CaffeqError, match="gives 9 boxes"):
        model.run({"data": x, "label": blob})


# ---- parameters -------------------------------------------------------------------------------

@pytest.mark.parametrize("g, mean, extra, message", [
    (dict(GT, stride=0), (127,), "", "stride must be >= 1"),
    (dict(GT, image_size_x=0), (127,), "", "image_size_x must be >= 1"),
    (dict(GT, stride=64), (127,), "", "label grid"),
    (dict(GT, scale_cvg=-1), (127,), "", "scale_cvg must be a number >= 0"),
    (GT, (1, 2), "", "give 1 or 3 values, got 2"),
    (GT, (127,), "detectnet_augmentation_param { scale_min: 0 scale_max: 0.8 }", "scale_min must be > 0"),
])
def test_detectnet_bad_parameters_are_one_line(g, mean, extra, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(transform_net((2, 3, 5, 7), (2, 1, 6, 16), g, mean, extra))


def test_detectnet_bad_shapes_are_one_line():
    with pytest.raises(LayerError, match="N x 3 x H x W"):
        load_from_text(transform_net((2, 1, 5, 7), (2, 1, 6, 16), GT))
    with pytest.raises(LayerError, match="num 3 differs from the data's 2"):
        load_from_text(transform_net((2, 3, 5, 7), (3, 1, 6, 16), GT))


def test_detectnet_defaults_are_the_forks():
    from caffeq.io.schema import caffe_pb2
    g, a = caffe_pb2.DetectNetGroundTruthParameter(), caffe_pb2.DetectNetAugmentationParameter()
    assert (g.stride, g.scale_cvg, g.gridbox_type, g.max_cvg_len, g.min_cvg_len, g.image_size_x,
            g.image_size_y, g.obj_norm, g.crop_bboxes) == (4, F32(0.5), 0, 50, 50, 1248, 384, False, True)
    assert (a.crop_prob, a.shift_x, a.scale_prob, a.scale_min, a.scale_max, a.flip_prob, a.rotation_prob,
            a.max_rotate_degree, a.hue_rotation_prob, a.hue_rotation, a.desaturation_prob,
            a.desaturation_max) == (1.0, 0, F32(0.33), F32(0.7), 1.0, F32(0.33), F32(0.33), 1.0, F32(0.33),
                                    15.0, F32(0.33), 0.5)
    field = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert (field["detectnet_groundtruth_param"].number, field["detectnet_augmentation_param"].number) == (6801, 6802)


def test_detectnet_train_phase_reads_but_refuses_to_run(tmp_path):
    text = transform_net((2, 3, 5, 7), (2, 1, 6, 16), GT, extra="include { phase: TRAIN }").replace(
        'name: "val_transform"', 'name: "train_transform"')
    model = load_from_text(text, phase="TRAIN", outputs=["d", "l"])
    assert model.blob_shapes["d"] == (2, 3, 4, 9)
    x = RNG.uniform(0, 255, (2, 3, 5, 7)).astype(F32)
    with pytest.raises(CaffeqError, match="'train_transform' .*TRAIN phase: random hue"):
        model.run({"data": x, "label": label_blob(BOXES, 6)})
    with pytest.raises(ExportError, match="TRAIN phase"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_detectnet_mean_file_is_sized_but_not_run():
    model = load_from_text(transform_net((2, 3, 5, 7), (2, 1, 6, 16), GT, ()).replace(
        "transform_param {  }", 'transform_param { mean_file: "mean.binaryproto" }'), outputs=["d"])
    assert model.blob_shapes["d"] == (2, 3, 4, 9)
    with pytest.raises(CaffeqError, match="mean_file 'mean.binaryproto'"):
        model.run({"data": np.zeros((2, 3, 5, 7), F32), "label": label_blob([[], []], 6)})


# ---- a DIGITS-like train_val net ---------------------------------------------------------------

def data_layers():
    text = ""
    for phase, prefix in (("TRAIN", "train"), ("TEST", "val")):
        for top in ("data", "label"):
            text += (f'layer {{ name: "{prefix}_{top}" type: "Data" top: "{top}" include {{ phase: {phase} }} '
                     f'data_param {{ batch_size: 2 backend: LMDB }} }}\n')
    return text


def detectnet_like_net():
    gt = gt_text(dict(GT, image_size_x=12, image_size_y=8, stride=4, classes={1: 0}))
    transform = ('layer {{ name: "{0}_transform" type: "DetectNetTransformation" bottom: "data" bottom: "label" '
                 'top: "transformed_data" top: "transformed_label" include {{ phase: {1} }} '
                 'transform_param {{ mean_value: 127 }} detectnet_groundtruth_param {{ GT }} {2} }}\n')
    conv = ('layer {{ name: "{0}" type: "Convolution" bottom: "{1}" top: "{2}" convolution_param {{ num_output: {3} '
            'kernel_size: {4} stride: {5} pad: {6} }} }}\n')
    python = ('layer {{ name: "{0}" type: "Python" {1} python_param {{ module: "caffe.layers.detectnet.{2}" '
              'layer: "{3}" param_str: "{4}" }} {5} }}\n')
    return ('name: "DetectNet-like"\n' + data_layers()
            + transform.format("train", "TRAIN", "detectnet_augmentation_param { crop_prob: 1 flip_prob: 0.5 }"
                               ).replace("GT", gt)
            + transform.format("val", "TEST", "").replace("GT", gt)
            + 'layer { name: "slice-label" type: "Slice" bottom: "transformed_label" top: "foreground-label" '
              'top: "bbox-label" top: "size-label" top: "obj-label" top: "coverage-label" '
              'slice_param { slice_dim: 1 slice_point: 1 slice_point: 5 slice_point: 7 slice_point: 8 } }\n'
            + 'layer { name: "coverage-block" type: "Concat" bottom: "foreground-label" bottom: "foreground-label" '
              'bottom: "foreground-label" bottom: "foreground-label" top: "coverage-block" concat_param { axis: 1 } }\n'
            + conv.format("conv1", "transformed_data", "conv1", 5, 3, 2, 1)
            + 'layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }\n'
            + conv.format("conv2", "conv1", "conv2", 6, 3, 2, 1)
            + conv.format("cvg/classifier", "conv2", "cvg/classifier", 1, 1, 1, 0)
            + 'layer { name: "coverage/sig" type: "Sigmoid" bottom: "cvg/classifier" top: "coverage" }\n'
            + conv.format("bbox/regressor", "conv2", "bboxes", 4, 1, 1, 0)
            + 'layer { name: "bboxes-masked" type: "Eltwise" bottom: "bboxes" bottom: "coverage-block" '
              'top: "bboxes-masked" eltwise_param { operation: PROD } }\n'
            + 'layer { name: "bbox_loss" type: "L1Loss" bottom: "bboxes-masked" bottom: "bbox-label" '
              'top: "loss_bbox" loss_weight: 2 include { phase: TRAIN } include { phase: TEST } }\n'
            + 'layer { name: "coverage_loss" type: "EuclideanLoss" bottom: "coverage" bottom: "coverage-label" '
              'top: "loss_coverage" }\n'
            + python.format("cluster", 'bottom: "coverage" bottom: "bboxes" top: "bbox-list"', "clustering",
                            "ClusterDetections", "12, 8, 4, 0.6, 3, 0.02, 2", "include { phase: TEST }")
            + python.format("cluster_gt", 'bottom: "coverage-label" bottom: "bbox-label" top: "bbox-list-label"',
                            "clustering", "ClusterGroundtruth", "12, 8, 4", "include { phase: TEST }")
            + python.format("score", 'bottom: "bbox-list-label" bottom: "bbox-list" top: "bbox-list-scored"',
                            "mean_ap", "ScoreDetections", "", "include { phase: TEST }")
            + python.format("mAP", 'bottom: "bbox-list-scored" top: "mAP" top: "precision" top: "recall"',
                            "mean_ap", "mAP", "12, 8, 4", "include { phase: TEST }"))


def test_detectnet_like_train_val_net_reads_without_its_datasets(tmp_path):
    path = tmp_path / "train_val.prototxt"
    path.write_text(detectnet_like_net())
    res = cli_process("inspect", str(path))
    ok(res)
    assert "val_transform" in res.stdout and "DetectNetTransformation" in res.stdout
    shapes = "--input-shape", "data=2,3,6,10", "--input-shape", "label=2,1,4,16"
    res = cli_process("inspect", str(path), *shapes)
    ok(res)
    assert "2x3x8x12" in res.stdout.replace(" ", "") or "(2, 3, 8, 12)" in res.stdout or "2,3,8,12" in res.stdout
    res = cli_process("inspect", str(path), "--phase", "TRAIN", *shapes)
    ok(res)


def test_detectnet_like_train_val_net_runs_at_test(tmp_path):
    from caffeq.model import load
    path = tmp_path / "train_val.prototxt"
    path.write_text(detectnet_like_net())
    model = load(str(path), input_shapes={"data": (2, 3, 6, 10), "label": (2, 1, 4, 16)}, random_weights=True,
                 outputs=["coverage", "bboxes", "loss_coverage"])
    x = RNG.uniform(0, 255, (2, 3, 6, 10)).astype(F32)
    blob = label_blob([[(1.0, 1.5, 4.0, 3.0, 1), (6.0, 0.5, 3.0, 4.0, 1)], [(2.0, 2.0, 5.0, 2.5, 1)]], 4)
    out = model.run({"data": x, "label": blob}, all_blobs=True)
    g = dict(GT, image_size_x=12, image_size_y=8, stride=4, classes={1: 0})
    assert_close(out["transformed_data"], ref_data(x, [127], 12, 8), 1e-4, 0, "transformed_data")
    np.testing.assert_array_equal(out["transformed_label"], ref_label(blob, 10, 6, g))
    assert out["coverage"].shape == (2, 1, 2, 3) and out["bboxes"].shape == (2, 4, 2, 3)
    cov_label = ref_label(blob, 10, 6, g)[:, 8:9]
    assert np.isclose(out["loss_coverage"], ((out["coverage"] - cov_label) ** 2).sum() / 2 / 2, rtol=1e-5)
    # the data path alone converts: the label maps are needed only by the losses
    model = load(str(path), input_shapes={"data": (2, 3, 6, 10), "label": (2, 1, 4, 16)}, random_weights=True,
                 outputs=["coverage", "bboxes"])
    model.export_onnx(str(tmp_path / "m.onnx"))


def test_detectnet_like_train_val_net_runs_from_the_cli(tmp_path):
    from caffeq.io.caffemodel import BlobData
    from caffeq.io.prototxt import parse_prototxt_text
    from caffeq.io.writer import write_caffemodel
    text = detectnet_like_net()
    path = tmp_path / "train_val.prototxt"
    path.write_text(text)
    shapes = {"conv1": [(5, 3, 3, 3), (5,)], "conv2": [(6, 5, 3, 3), (6,)], "cvg/classifier": [(1, 6, 1, 1), (1,)],
              "bbox/regressor": [(4, 6, 1, 1), (4,)]}
    blobs = {name: [BlobData((RNG.standard_normal(s) * 0.05).astype(F32)) for s in ss] for name, ss in shapes.items()}
    write_caffemodel(parse_prototxt_text(text), blobs, tmp_path / "w.caffemodel")
    x = RNG.uniform(0, 255, (2, 3, 6, 10)).astype(F32)
    blob = label_blob([[(1.0, 1.5, 4.0, 3.0, 1)], [(2.0, 2.0, 5.0, 2.5, 1)]], 4)
    np.savez(tmp_path / "in.npz", data=x, label=blob)
    common = ("-w", str(tmp_path / "w.caffemodel"), "--input-shape", "data=2,3,6,10", "--input-shape",
              "label=2,1,4,16", "-i", str(tmp_path / "in.npz"))
    ok(cli_process("run", str(path), *common, "--outputs", "coverage,bboxes,loss_coverage",
                   "-o", str(tmp_path / "out.npz")))
    with np.load(tmp_path / "out.npz") as out:
        assert out["coverage"].shape == (2, 1, 2, 3)
    res = cli_process("run", str(path), *common, "--phase", "TRAIN", "--outputs", "coverage",
                      "-o", str(tmp_path / "out2.npz"))
    one_line_error(res, "train_transform", "TRAIN phase")
