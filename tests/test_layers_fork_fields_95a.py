"""Five fork types / fields: Hwang64/caffe-mlkp's Prodpara (caffeq/layers/mlkp.py) against a loop written here
from prodpara_layer.cu's Forward_gpu; MagicSen/source_read's LabelMix (structured_feature.py, training-only) and
caffe_opencl's YoloDetectionOutput.ssd_format; SummerLife/caffe_mobilessd's QuantizationParameter bias fields;
WeitaoVan/L-GM-loss's HDF5DataParameter preprocessing."""
import math

import numpy as np
import pytest
from conftest import REPO, assert_close, backend_outputs, check_everywhere, cli_process, net, node_of, ok, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


# ---- Prodpara -------------------------------------------------------------------------------

def prodpara_ref(x, w, op):
    """Forward_gpu: a zero-filled (N, C, H, W) scratch; ACROSS_CHANNEL's gemm writes w[c] over image 0,
    ACROSS_FEATURE_MAP's the first H*W weights over image 0's channels, ACROSS_ALL reads the weight blob
    reshaped to the bottom (zero memory when it holds fewer values); top = scratch * x."""
    n, c, h, wd = x.shape
    flat = w.reshape(-1)
    scratch = np.zeros(x.shape, F32)
    if op == "ACROSS_CHANNEL":
        for ch in range(c):
            scratch[0, ch] = flat[ch]
    elif op == "ACROSS_FEATURE_MAP":
        if n * h * wd <= flat.size:
            for ch in range(c):
                scratch[0, ch] = flat[:h * wd].reshape(h, wd)
    elif n * c * h * wd <= flat.size:
        scratch = flat[:x.size].reshape(x.shape).copy()
    return (scratch * x).astype(F32)


def prodpara_layer(op, c, extra="", top="y"):
    return (f'layer {{ name: "p" type: "Prodpara" bottom: "x" top: "{top}" prodpara_param {{ num_output: {c} '
            f'operation: {op} {extra} }} }}')


@pytest.mark.parametrize("op, extra, shape, blob", [
    ("ACROSS_CHANNEL", "", (2, 3, 5, 7), (1, 3, 1, 1)),
    ("ACROSS_FEATURE_MAP", "max_height: 70 max_width: 110 feat_stride: 16", (1, 3, 5, 7), (1, 1, 5, 7)),
    ("ACROSS_FEATURE_MAP", "max_height: 100 max_width: 130 feat_stride: 16", (2, 3, 5, 7), (1, 1, 7, 9)),
    ("ACROSS_FEATURE_MAP", "max_height: 100 max_width: 130 feat_stride: 8", (2, 3, 5, 7), (1, 1, 13, 17)),
    ("ACROSS_ALL", "max_height: 65 max_width: 97 feat_stride: 16", (1, 3, 5, 7), (1, 3, 6, 8)),
])
def test_prodpara_matches_the_gpu_forward(op, extra, shape, blob, tmp_path):
    model = load_from_text(net(prodpara_layer(op, shape[1], extra), inputs={"x": shape}), random_weights=True)
    node = node_of(model, "p")
    assert tuple(node.blobs[0].shape) == blob
    node.blobs = [rng(1).standard_normal(blob).astype(F32)]
    model.clear_cache()
    x = rng(2).standard_normal(shape).astype(F32)
    ref = prodpara_ref(x, node.blobs[0], op)
    assert ref.any() == (math.prod(shape[:1] + shape[2:]) <= math.prod(blob) or op == "ACROSS_CHANNEL")
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("op, extra", [("ACROSS_FEATURE_MAP", "max_height: 16 max_width: 16"),
                                       ("ACROSS_ALL", "max_height: 16 max_width: 16")])
def test_prodpara_weight_too_small_for_the_batch_gives_zeros(op, extra, tmp_path):
    shape = (2, 3, 5, 7)   # the (1, ., 2, 2) weight holds fewer values than the reshape asks: new zero memory
    model = load_from_text(net(prodpara_layer(op, 3, extra), inputs={"x": shape}), random_weights=True)
    x = rng(3).standard_normal(shape).astype(F32)
    ref = prodpara_ref(x, node_of(model, "p").blobs[0], op)
    assert not ref.any()
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("op, extra, shape, said", [
    ("ACROSS_CHANNEL", "", (2, 3, 5, 7), ["image 0 only"]),
    ("ACROSS_CHANNEL", "", (1, 3, 5, 7), []),
    ("ACROSS_FEATURE_MAP", "max_height: 100 max_width: 130 feat_stride: 8", (2, 3, 5, 7),
     ["image 0 only", "later forwards"]),
    ("ACROSS_FEATURE_MAP", "max_height: 16 max_width: 16", (2, 3, 5, 7), ["new zeroed memory"]),
    ("ACROSS_ALL", "max_height: 65 max_width: 97", (1, 3, 5, 7), [])])
def test_prodpara_warns_what_the_batch_does(op, extra, shape, said):
    model = load_from_text(net(prodpara_layer(op, shape[1], extra), inputs={"x": shape}), random_weights=True)
    notes = [w for w in model.warnings if "Prodpara" in w]
    assert len(notes) == len(said) and all(any(s in w for w in notes) for s in said), notes


def test_prodpara_in_place_weight_takes_the_batch():
    model = load_from_text(net(prodpara_layer("ACROSS_CHANNEL", 3, top="x"), inputs={"x": (2, 3, 4, 5)}),
                           random_weights=True)
    assert tuple(node_of(model, "p").blobs[0].shape) == (2, 3, 1, 1)


@pytest.mark.parametrize("extra, c, message", [
    ("bias_term: true", 3, "bias_term is not supported"),
    ("", 4, "num_output 4 must equal the bottom's 3 channels")])
def test_prodpara_refusals(extra, c, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(net(prodpara_layer("ACROSS_CHANNEL", c, extra), inputs={"x": (1, 3, 4, 5)}))


# ---- LabelMix ---------------------------------------------------------------------------------

def test_label_mix_is_sized_and_training_only():
    layer = ('layer { name: "mixer" type: "LabelMix" bottom: "lab" bottom: "mix" top: "label" '
             'label_mix_param { mix_num: 13 } }')
    text = net(layer, 'layer { name: "r" type: "ReLU" bottom: "x" top: "y" }',
               inputs={"x": (1, 2, 3, 3), "lab": (1, 4, 5, 6), "mix": (1, 4, 1, 1)})
    model = load_from_text(text)
    node = node_of(model, "mixer")
    assert node.spec.is_training_only
    assert tuple(model.graph.tensors[node.outputs[0]].shape) == (1, 52, 5, 6)
    with pytest.raises(CaffeqError, match="mixture-type channels"):
        load_from_text(net(layer, inputs={"lab": (1, 4, 5, 6), "mix": (1, 3, 1, 1)}))


# ---- YoloDetectionOutput.ssd_format -----------------------------------------------------------

def yolo_layer(ssd, biases=(1, 1.5, 2, 2.5)):
    b = " ".join(f"biases: {v}" for v in biases)
    return ('layer { name: "det" type: "YoloDetectionOutput" bottom: "m" bottom: "img" top: "det" '
            f'yolo_detection_output_param {{ num_classes: 2 num_box: 2 confidence_threshold: 0.1 {b} '
            f'ssd_format: {ssd} }} }}')


def ssd_rows_ref(m, biases, k, nb, thr, nms, clip=True):
    """caffe_opencl's Forward_cpu / Forward_gpu (the same) for one image: swap rows (cell, box, entry),
    get_region_box, sigmoid objectness, class_index_and_score (max-shifted softmax, first best), keep
    confidence >= threshold, sort best first, ApplyNms with setNormalizedBBox (clipped to [0, 1]) and
    JaccardOverlap, drop IoU >= nms; ssd_format rows [0, label + 1, score, x -+ w / 2, y -+ h / 2]."""
    _, c, side, _ = m.shape
    per = (c + nb - 1) // nb
    sig = lambda v: F32(1) / (F32(1) + np.exp(-F32(v)))
    preds = []
    for j in range(side):
        for i in range(side):
            for n in range(nb):
                e = m[0, n * per:n * per + per, j, i].astype(F32)
                x = (F32(i) + sig(e[0])) / F32(side)
                y = (F32(j) + sig(e[1])) / F32(side)
                w = np.exp(e[2]) * F32(biases[2 * n]) / F32(side)
                h = np.exp(e[3]) * F32(biases[2 * n + 1]) / F32(side)
                cls = e[5:5 + k]
                ex = np.exp(cls - cls.max())
                p = ex / ex.sum(dtype=F32)
                conf = sig(e[4]) * p.max()
                if conf >= F32(thr):
                    preds.append((conf, int(np.argmax(p)), x, y, w, h))
    preds.sort(key=lambda r: -r[0])

    def corners(r):
        _, _, x, y, w, h = r
        lo_x, hi_x, lo_y, hi_y = x - w / F32(2), x + w / F32(2), y - h / F32(2), y + h / F32(2)
        if clip:
            lo_x, lo_y, hi_x, hi_y = max(lo_x, F32(0)), max(lo_y, F32(0)), min(hi_x, F32(1)), min(hi_y, F32(1))
        return lo_x, lo_y, hi_x, hi_y

    def iou(a, b):
        a, b = corners(a), corners(b)
        if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
            return F32(0)
        iw, ih = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
        if not (iw > 0 and ih > 0):
            return F32(0)
        inter = iw * ih
        sa, sb = (a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1])
        return inter / (sa + sb - inter)

    dropped = [False] * len(preds)
    for i in range(len(preds) - 1):
        if dropped[i]:
            continue
        for j in range(i + 1, len(preds)):
            if not dropped[j] and iou(preds[i], preds[j]) >= F32(nms):
                dropped[j] = True
    rows = [[0, lab + 1, conf, x - w / F32(2), y - h / F32(2), x + w / F32(2), y + h / F32(2)]
            for (conf, lab, x, y, w, h), d in zip(preds, dropped) if not d]
    return np.asarray(rows, F32).reshape(1, 1, -1, 7)


def test_ssd_format_matches_caffe_opencl(tmp_path):
    """Boxes larger than the image: NMS on the clipped boxes keeps fewer rows than eric612's unclipped IoU.
    The same rows in each backend (torch, onnxruntime, model.py), whatever bottom 1 (the image) holds."""
    biases = (3, 3.5, 4.5, 4)
    m = rng(4).standard_normal((1, 14, 5, 5)).astype(F32) * 2
    img = rng(5).standard_normal((1, 3, 40, 40)).astype(F32)
    want = ssd_rows_ref(m, biases, 2, 2, 0.1, 0.45)
    assert want.shape[2] != ssd_rows_ref(m, biases, 2, 2, 0.1, 0.45, clip=False).shape[2]
    model = load_from_text(net(yolo_layer("true", biases), inputs={"m": (1, 14, 5, 5), "img": (1, 3, 40, 40)}))
    assert any("ssd_format" in w for w in model.warnings)
    assert tuple(model.graph.tensors["det"].shape) == (1, 1, 50, 7)     # bottom 0's cells x boxes only
    got = backend_outputs(model, {"m": m, "img": img}, tmp_path / "ssd", "det")
    for backend, rows in got.items():
        assert_close(rows, want, 1e-6, 1e-6, backend)


def test_ssd_format_refusals():
    with pytest.raises(CaffeqError, match="ssd_format false"):
        load_from_text(net(yolo_layer("false"), inputs={"m": (1, 14, 5, 5), "img": (1, 3, 40, 40)}))
    with pytest.raises(CaffeqError, match="needs a square map"):
        load_from_text(net(yolo_layer("true"), inputs={"m": (1, 14, 5, 6), "img": (1, 3, 40, 40)}))
    model = load_from_text(net(yolo_layer("true"), inputs={"m": (2, 14, 5, 5), "img": (2, 3, 40, 40)}))
    with pytest.raises(CaffeqError, match="NMS per image"):
        model.run({"m": np.zeros((2, 14, 5, 5), F32), "img": np.zeros((2, 3, 40, 40), F32)})


# ---- QuantizationParameter bias fields (SummerLife/caffe_mobilessd) --------------------------

def test_mobilessd_bias_fields_are_read_with_a_note_and_change_nothing():
    def conv(extra):
        return ('layer { name: "c" type: "ConvolutionRistretto" bottom: "x" top: "y" convolution_param { '
                'num_output: 2 kernel_size: 3 } quantization_param { bw_layer_in: 8 bw_layer_out: 8 bw_params: 8 '
                f'fl_layer_in: 4 fl_layer_out: 3 fl_params: 7 {extra} }} }}')
    x = rng(6).standard_normal((2, 3, 5, 7)).astype(F32)
    base = load_from_text(net(conv(""), inputs={"x": (2, 3, 5, 7)}), random_weights=True)
    fork = load_from_text(net(conv("bw_bias_params: 16 fl_bias_params: 12"), inputs={"x": (2, 3, 5, 7)}),
                          random_weights=True)
    assert any("fl_bias_params" in w and "GPU forward" in w for w in fork.warnings)
    node_of(fork, "c").blobs = [np.array(b) for b in node_of(base, "c").blobs]
    fork.clear_cache()
    np.testing.assert_array_equal(fork.run({"x": x})["y"], base.run({"x": x})["y"])


# ---- HDF5DataParameter preprocessing (WeitaoVan/L-GM-loss) ------------------------------------

def lgm_hdf5_ref(data, crop, means, scale):
    """LoadHDF5FileData at TEST: the centre crop ((H - crop) / 2, (W - crop) / 2, integer division), each
    channel's mean_value added negated (caffe_add_scalar), then caffe_scal by scale (when scale != 1)."""
    n, c, h, w = data.shape
    ho, wo = (h - crop) // 2, (w - crop) // 2
    out = data[:, :, ho:ho + crop, wo:wo + crop].astype(F32).copy()
    for ch in range(c):
        out[:, ch] += -F32(means[ch if len(means) > 1 else 0])
    return out * F32(scale)


def test_lgm_hdf5_preprocessing_reaches_the_transform(tmp_path):
    h5py = pytest.importorskip("h5py")
    from caffeq.data.plan import build_dataset, data_layer, plan_data
    data = rng(7).uniform(0, 255, (4, 3, 9, 8)).astype(F32)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["data"] = data
        f["label"] = np.arange(4, dtype=F32)
    (tmp_path / "list.txt").write_text(str(tmp_path / "d.h5") + "\n")
    text = (f'layer {{ name: "data" type: "HDF5Data" top: "data" top: "label" hdf5_data_param {{ '
            f'source: "{tmp_path / "list.txt"}" batch_size: 2 mean_value: 100 mean_value: 128 mean_value: 90 '
            f'scale: 0.0078125 crop_size: 5 }} }}\n'
            'layer { name: "r" type: "ReLU" bottom: "data" top: "y" }')
    model = load_from_text(text)
    assert tuple(model.graph.tensors["data"].shape) == (2, 3, 5, 5)
    layer = data_layer(model)
    plan = plan_data(layer, None, str(tmp_path))
    t = plan.transformer
    assert (t.mean_value, t.scale, t.crop_size) == ([100.0, 128.0, 90.0], 0.0078125, 5)
    want = lgm_hdf5_ref(data, 5, [100, 128, 90], 0.0078125)
    dataset = build_dataset(plan, defer_normalize=False)
    for i in range(4):
        item = dataset[i]
        np.testing.assert_array_equal(item[1], want[i])
        assert item[2] == i


def test_plain_hdf5_data_has_no_transform(tmp_path):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["data"] = np.zeros((2, 3, 9, 8), F32)
    (tmp_path / "list.txt").write_text(str(tmp_path / "d.h5") + "\n")
    model = load_from_text(f'layer {{ name: "data" type: "HDF5Data" top: "data" hdf5_data_param {{ '
                           f'source: "{tmp_path / "list.txt"}" batch_size: 2 }} }}')
    assert "transform" not in node_of(model, "data").attrs
    assert tuple(model.graph.tensors["data"].shape) == (2, 3, 9, 8)


# ---- the corpus files -------------------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "Hwang64__caffe-mlkp__examples__mnist__lenet_train_test.prototxt",
    "MagicSen__source_read__StructuredFeature-master__protofiles__train_val.prototxt",
    "MagicSen__source_read__caffe_opencl__examples__yolo__yolo_test.prototxt",
    "SummerLife__caffe_mobilessd__examples__mnist__quantized.prototxt",
    "SummerLife__caffe_mobilessd__examples__mobilessd__quantized_bn.prototxt",
    "WeitaoVan__L-GM-loss__examples__cifar100__simple__trainval.prototxt"])
def test_corpus_files_read(name):
    path = CORPUS / name
    ok(cli_process("inspect", path))
