"""Cambricon/caffe (commit eadcc46d): the first conv's preprocessing (convolution_param mean_value,
std, scale) and the Yolov3Detection layer, plus the MLU int8 fields the CambriconECO files carry.

References are numpy loops written here from the fork's C++ (conv_layer.cpp Forward_cpu,
base_conv_layer.cpp SetMean, yolov3_detection_layer.cpp): its flat buffers and index formulas, in
float32.  Both run in torch and the generated model.py; the convolution also in onnxruntime, while
Yolov3Detection's ONNX export is refused.
"""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, net, rng

import caffeq
from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


# ---- first conv ----------------------------------------------------------------------------------

def first_conv_ref(x, w, b, mean, mul, stride, pad):
    """conv_layer.cpp Forward_cpu under USE_MLU: every bottom value j -= mean[(j / (H W)) % C], then
    *= std (or scale); then Caffe's convolution (loops, float64 sums rounded to float32)."""
    n, c, h, wd = x.shape
    flat = x.reshape(-1).copy()
    m = np.array(mean[:c] if mean else [0.0] * c, F32)
    for j in range(flat.size):
        flat[j] = F32(flat[j] - m[(j // (h * wd)) % c])
        if mul is not None:
            flat[j] = F32(flat[j] * F32(mul))
    xp = np.pad(flat.reshape(x.shape).astype(np.float64), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    o, _, kh, kw = w.shape
    oh = (h + 2 * pad[0] - kh) // stride[0] + 1
    ow = (wd + 2 * pad[1] - kw) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride[0]:i * stride[0] + kh, j * stride[1]:j * stride[1] + kw]
            out[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w.astype(np.float64))
    if b is not None:
        out += b.reshape(1, o, 1, 1)
    return out.astype(F32)


def conv_model(extra, shape, bias=True, more=""):
    text = net(f'layer {{ name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param {{ num_output: 4 '
               f'kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 '
               f'bias_term: {"true" if bias else "false"} {extra} }} {more} }}', inputs={"x": shape})
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "c")
    if bias:
        node.blobs = [node.blobs[0], rng(5).standard_normal(node.blobs[1].shape).astype(F32)]
    return model, node


@pytest.mark.parametrize("extra, mean, mul", [
    # a fourth mean is never read (one per input channel)
    ("mean_value: 104 mean_value: 117 mean_value: 123.5 mean_value: 9 std: 0.017", [104, 117, 123.5, 9], 0.017),
    ("mean_value: 0 mean_value: 0 mean_value: 0 std: 0.00392157", [0, 0, 0], 0.00392157),
    ("std: 0.5", [], 0.5),                                   # mean 0
    ("mean_value: 1 mean_value: -2 mean_value: 3", [1, -2, 3], None),
    ("mean_value: 1 mean_value: 2 mean_value: 3 scale: 0.25", [1, 2, 3], 0.25),   # scale: std's other name
])
def test_first_conv_preprocessing(extra, mean, mul, tmp_path):
    x = (rng(1).standard_normal((2, 3, 7, 9)) * 60 + 100).astype(F32)
    model, node = conv_model(extra, x.shape)
    ref = first_conv_ref(x, node.blobs[0], node.blobs[1], mean, mul, (2, 1), (1, 0))
    assert model.blob_shapes["c"] == ref.shape == (2, 4, 4, 8)
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path, atol=2e-4, rtol=1e-5)


def test_first_conv_of_an_rgb0_image_rearranges_the_bgr_filters(tmp_path):
    # MLUYUVtoRGB's (N, 4, H, W) RGB0 image into a caffemodel's 3-channel BGR filters: ArrangeWeightRGB makes
    # them [W2, W1, W0, 0]; mean_value(i) meets RGB0 channel i as given (the fourth, read past the field,
    # only meets zero weights)
    x = (rng(3).standard_normal((2, 4, 7, 9)) * 60 + 100).astype(F32)
    x[:, 3] = 0
    model, node = conv_model("mean_value: 123 mean_value: 117 mean_value: 104 std: 0.5", x.shape)
    w, b = node.blobs
    assert w.shape == (4, 3, 3, 2)
    w4 = np.concatenate([w[:, 2:3], w[:, 1:2], w[:, 0:1], np.zeros_like(w[:, :1])], axis=1)
    ref = first_conv_ref(x, w4, b, [123, 117, 104, 0], 0.5, (2, 1), (1, 0))
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path, atol=2e-4, rtol=1e-5)


def test_first_conv_std_wins_over_scale_and_int8_fields_are_read(tmp_path):
    x = rng(2).standard_normal((1, 3, 5, 4)).astype(F32)
    mlu = ('bottom_mlu_dtype { type: DT_INT8 position: -6 scale: 1.98 } '
           'blobs_dtype { type: DT_INT8 position: -6 scale: 0.99 } top_mlu_dtype: DT_FLOAT16 engine: MLU')
    model, node = conv_model("mean_value: 1 mean_value: 2 mean_value: 3 std: 2 scale: 8 input_format: RGBA "
                             "engine: MLU sparse_mode: false", x.shape, bias=False, more=mlu)
    ref = first_conv_ref(x, node.blobs[0], None, [1, 2, 3], 2.0, (2, 1), (1, 0))
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path, atol=1e-5, rtol=1e-5)
    assert any("multiplies by std" in w for w in model.warnings), model.warnings
    assert any("input_format RGBA" in w for w in model.warnings), model.warnings


@pytest.mark.parametrize("extra, message", [
    ("mean_value: 1 mean_value: 2 std: 0.5", "mean_value has 2 values for 3 input channels"),
    ('mean_file: "mean.binaryproto"', "mean_file"),
    ("same_mode: true", "same_mode"),
])
def test_first_conv_refusals(extra, message):
    with pytest.raises(LayerError, match=message):
        conv_model(extra, (1, 3, 6, 6))


def test_deconvolution_ignores_the_first_conv_fields():
    # Cambricon's Deconvolution reads mean_value / std in SetMean but its forward never applies them
    text = net('layer { name: "d" type: "Deconvolution" bottom: "x" top: "d" convolution_param { num_output: 2 '
               'kernel_size: 2 stride: 2 bias_term: false mean_value: 5 std: 3 } }', inputs={"x": (1, 3, 2, 3)})
    model = load_from_text(text, random_weights=True)
    x = rng(3).standard_normal((1, 3, 2, 3)).astype(F32)
    w = next(n for n in model.layers if n.name == "d").blobs[0]
    out = model.run({"x": x})["d"]
    ref = np.einsum("nchw,cokl->nohkwl", x.astype(np.float64), w.astype(np.float64)).reshape(1, 2, 4, 6)
    np.testing.assert_allclose(out, ref, atol=1e-5)


# ---- Yolov3Detection -----------------------------------------------------------------------------

def _sig(v):
    return F32(F32(1) / (F32(1) + F32(np.exp(-v))))


def yolov3_detection_ref(xs, biases, k_cls, num_box, im_w, im_h, conf, nms):
    """yolov3_detection_layer.cpp Forward_cpu as loops: transpose, decode in place, concatenate,
    conf_filter (image 0's objectness), per-class sort (stable) + NMS, rows from entry 64."""
    n = xs[0].shape[0]
    attrs = 5 + k_cls
    decoded = []
    for i, x in enumerate(xs):
        _, c, h, w = x.shape
        hw = h * w
        stride = int(im_w / np.sqrt(hw))
        buf = x.reshape(n, c, hw).astype(F32)
        per_image = []
        for b in range(n):
            t = buf[b].T.reshape(-1).copy()          # (hw, c) flat: 255*169 -> 169*255
            rows = t.reshape(hw * 3, attrs)
            offs = []
            for kk in range(hw):
                for _ in range(3):
                    offs += [kk % w, kk // w]
            ti = 0
            for r in range(rows.shape[0]):
                rows[r, 0] = _sig(rows[r, 0])
                rows[r, 1] = _sig(rows[r, 1])
                rows[r, 0] = F32(stride * F32(rows[r, 0] + F32(offs[2 * r])))
                rows[r, 1] = F32(stride * F32(rows[r, 1] + F32(offs[2 * r + 1])))
                rows[r, 2] = F32(F32(np.exp(rows[r, 2])) * F32(biases[6 * i + ti % 6]))
                ti += 1
                rows[r, 3] = F32(F32(np.exp(rows[r, 3])) * F32(biases[6 * i + ti % 6]))
                ti += 1
                for e in range(4, attrs):
                    rows[r, e] = _sig(rows[r, e])
            per_image.append(rows)
        decoded.append(per_image)
    allrows = [np.concatenate([decoded[i][b] for i in range(len(xs))]) for b in range(n)]
    total = n * (7 * num_box + 64)
    top = np.full(total, -1, F32)
    box_size = 0
    for b in range(n):
        dets = []
        for r, row in enumerate(allrows[b]):
            if row[4] <= F32(conf):
                continue
            d = [F32(row[0] - row[2] / F32(2)), F32(row[1] - row[3] / F32(2)),
                 F32(row[0] + row[2] / F32(2)), F32(row[1] + row[3] / F32(2)), row[4]]
            obj = allrows[0][r][4]                  # bot_data[i + 4]: image 0's
            for j in range(k_cls):
                p = F32(obj * row[5 + j])
                d.append(p if p > F32(conf) else F32(0))
            dets.append(d)
        for k in range(k_cls):
            dets = sorted(dets, key=lambda v: -v[5 + k])
            for a in range(len(dets)):
                if dets[a][5 + k] == 0:
                    continue
                for c in range(a + 1, len(dets)):
                    p, q = dets[a], dets[c]
                    ix1, iy1 = max(p[0], q[0]), max(p[1], q[1])
                    ix2, iy2 = min(p[2], q[2]), min(p[3], q[3])
                    iw, ih = F32(ix2 - ix1 + F32(1)), F32(iy2 - iy1 + F32(1))
                    inter = F32(iw * ih) if (iw > 0 and ih > 0) else F32(0)
                    a1 = F32(F32(p[2] - p[0] + F32(1)) * F32(p[3] - p[1] + F32(1)))
                    a2 = F32(F32(q[2] - q[0] + F32(1)) * F32(q[3] - q[1] + F32(1)))
                    if F32(inter / F32(F32(a1 + a2) - inter)) > F32(nms):
                        dets[c][5 + k] = F32(0)
        for d in dets:
            for j in range(k_cls):
                if d[5 + j] > F32(conf) and 64 + box_size * 7 + 7 <= total:
                    top[64 + box_size * 7:64 + box_size * 7 + 7] = [
                        b, j, d[5 + j], d[0] / F32(im_w), d[1] / F32(im_h), d[2] / F32(im_w), d[3] / F32(im_h)]
                    box_size += 1
    top[0] = box_size
    return top.reshape(1, total, 1, 1)


BIASES = [30, 20, 44, 50, 70, 36, 12, 18, 24, 14, 20, 30, 5, 7, 9, 6, 8, 11]


def yolo_text(shapes, k_cls, params):
    names = [f"b{i}" for i in range(3)]
    layer = ('layer { name: "yolo" type: "Yolov3Detection" ' + " ".join(f'bottom: "{b}"' for b in names)
             + f' top: "o" yolov3_param {{ num_classes: {k_cls} {params} biases: {BIASES} }} }}')
    return net(layer, inputs=dict(zip(names, shapes)))


@pytest.mark.parametrize("num_box, conf, nms", [(60, 0.5, 0.3), (4, 0.4, 0.45)])  # 4: more rows than fit
def test_yolov3_detection(num_box, conf, nms, tmp_path):
    k_cls = 2
    shapes = [(2, 21, 3, 4), (2, 21, 5, 2), (2, 21, 4, 6)]
    r = rng(7)
    xs = [(r.standard_normal(s) * 1.5).astype(F32) for s in shapes]
    params = f"num_box: {num_box} confidence_threshold: {conf} nms_threshold: {nms} im_w: 64 im_h: 48"
    model = load_from_text(yolo_text(shapes, k_cls, params))
    ref = yolov3_detection_ref(xs, BIASES, k_cls, num_box, 64, 48, F32(conf), F32(nms))
    assert model.blob_shapes["o"] == ref.shape == (1, 2 * (7 * num_box + 64), 1, 1)
    assert ref[0, 0, 0, 0] >= 3                       # there are rows, and NMS dropped some
    feeds = {f"b{i}": x for i, x in enumerate(xs)}
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=())
    with pytest.raises(ExportError, match="Yolov3Detection"):
        model.export_onnx(str(tmp_path / "y.onnx"))


def test_yolov3_detection_nms_suppresses():
    # the same net without NMS (threshold 1: IoU never exceeds it) writes more rows
    shapes = [(1, 21, 3, 4), (1, 21, 5, 2), (1, 21, 4, 6)]
    xs = {f"b{i}": (rng(8).standard_normal(s) * 1.5).astype(F32) for i, s in enumerate(shapes)}
    counts = []
    for nms in (0.3, 1.0):
        m = load_from_text(yolo_text(shapes, 2, f"num_box: 80 im_w: 64 im_h: 48 nms_threshold: {nms}"))
        counts.append(m.run(xs)["o"][0, 0, 0, 0])
    assert counts[0] < counts[1]


@pytest.mark.parametrize("params, shapes, message", [
    ("anchor_num: 2", None, "only 3 is supported"),
    ("", [(1, 20, 3, 3), (1, 21, 3, 3), (1, 21, 3, 3)], "channels 20 must be"),
    ("", [(1, 21, 3, 3), (2, 21, 3, 3), (1, 21, 3, 3)], "disagree on the batch"),
    ("im_w: 2", None, "stride 0"),
])
def test_yolov3_detection_refusals(params, shapes, message):
    shapes = shapes or [(1, 21, 3, 3)] * 3
    with pytest.raises(LayerError, match=message):
        load_from_text(yolo_text(shapes, 2, params))


def test_yolov3_detection_needs_18_biases():
    text = net('layer { name: "y" type: "Yolov3Detection" bottom: "a" bottom: "b" bottom: "c" top: "o" '
               'yolov3_param { num_classes: 2 biases: [1, 2, 3] } }', inputs={k: (1, 21, 2, 2) for k in "abc"})
    with pytest.raises(LayerError, match="biases has 3 values"):
        load_from_text(text)


# ---- the CambriconECO/Caffe_Yolov3_Inference files -------------------------------------------------

@pytest.mark.parametrize("name", [
    "CambriconECO__Caffe_Yolov3_Inference__online__yolov3_int8.prototxt",
    "CambriconECO__Caffe_Yolov3_Inference__quantize__yolov3.prototxt",
])
def test_cambricon_yolov3_files_read(name):
    model = caffeq.load(REALWORLD / name)
    assert model.blob_shapes["yolo_1"] == (1, 7 * 1024 + 64, 1, 1)
    first = next(n for n in model.layers if n.name == "layer1-conv")
    if "int8" in name:
        assert first.attrs["first_conv"] == {"mean": [0.0, 0.0, 0.0], "mul": pytest.approx(0.00392157)}
    else:
        assert "first_conv" not in first.attrs


def test_model_py_matches_on_a_tiny_first_conv_net(tmp_path):
    # the helper's source runs standalone (model.py) with several bottoms through one first conv
    text = net('layer { name: "c" type: "Convolution" bottom: "x" bottom: "y" top: "c" top: "d" '
               'convolution_param { num_output: 2 kernel_size: 1 mean_value: 1 mean_value: 2 std: 3 } }',
               inputs={"x": (1, 2, 2, 3), "y": (1, 2, 2, 3)})
    model = load_from_text(text, random_weights=True)
    feeds = {"x": rng(4).standard_normal((1, 2, 2, 3)).astype(F32),
             "y": rng(5).standard_normal((1, 2, 2, 3)).astype(F32)}
    ours = model.run(feeds, exact=True)     # the layer-by-layer module (the default one is channels_last)
    got = model_py_outputs(model, feeds, tmp_path)
    for k in ("c", "d"):
        np.testing.assert_array_equal(got[k], ours[k])


# ---- the MLU-only layers of CNStream's nets (read and sized; they refuse to run) ---------------------

def test_mlu_only_layers_are_read_sized_and_refused():
    from caffeq.errors import CaffeqError
    from caffeq.model import load_from_text
    text = ('input: "yuv" input_shape { dim: 1 dim: 1 dim: 18 dim: 8 }\n'
            'layer { name: "rgb" type: "MLUYUVtoRGB" bottom: "yuv" top: "rgb" }\n'
            'input: "loc" input_shape { dim: 1 dim: 16 dim: 3 dim: 2 }\n'
            'input: "conf" input_shape { dim: 1 dim: 12 dim: 3 dim: 2 }\n'
            'input: "feat" input_shape { dim: 1 dim: 5 dim: 3 dim: 2 }\n'
            'layer { name: "det" type: "SsdDetection" bottom: "loc" bottom: "conf" bottom: "feat" bottom: "rgb" '
            'top: "det" detection_output_param { num_classes: 3 keep_top_k: 7 nms_param { nms_threshold: 0.45 } } '
            'priorbox_params { min_size: 4 aspect_ratio: 2 } }\n')
    model = load_from_text(text)
    assert model.blob_shapes["rgb"] == (1, 4, 12, 8) and model.blob_shapes["det"] == (1, 7, 1, 6)
    with pytest.raises(CaffeqError, match="computes it only on the MLU"):
        model.run({k: np.zeros(s, np.float32) for k, s in model.inputs.items()})
    with pytest.raises(CaffeqError, match="one priorbox_params per level"):
        load_from_text(text.replace("priorbox_params { min_size: 4 aspect_ratio: 2 } ", ""))
