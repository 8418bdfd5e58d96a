"""YOLO fork layers: Reorg, Region, YoloDetectionOutput, Yolov3DetectionOutput.

References are numpy re-derivations written here as loops from the forks' C++
(eric612/MobileNet-YOLO, lwplw/caffe_yolov2): the forks' flat buffers and index formulas,
float32 where the fork stores float32.  OpenCV's darknet importer is a second opinion on Reorg.
Every layer runs in torch, in onnxruntime (the exported ONNX) and in the generated model.py.
"""
import itertools

import numpy as np
import pytest
import torch
from conftest import assert_close, backend_outputs, net, onnx_outputs, rng

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def reorg_ref(x, stride, reverse):
    """darknet's reorg_cpu(x, w, h, c, batch, stride, forward=reverse, out) on the bottom's sizes."""
    n, c, h, w = x.shape
    flat = x.reshape(-1)
    out = np.full(flat.size, np.nan, np.float32)
    out_c = c // (stride * stride)
    for b in range(n):
        for k in range(c):
            for j in range(h):
                for i in range(w):
                    in_index = i + w * (j + h * (k + c * b))
                    c2 = k % out_c
                    offset = k // out_c
                    w2 = i * stride + offset % stride
                    h2 = j * stride + offset // stride
                    out_index = w2 + w * stride * (h2 + h * stride * (c2 + out_c * b))
                    if reverse:
                        out[out_index] = flat[in_index]
                    else:
                        out[in_index] = flat[out_index]
    if reverse:
        return out.reshape(n, out_c, h * stride, w * stride)
    return out.reshape(n, c * stride * stride, h // stride, w // stride)


def _logistic(v):
    return F32(1.0 / (1.0 + np.exp(-np.float64(v))))


def _softmax_inplace(buf, start, n):
    """The forks' softmax: largest first, exp(x - largest) summed in float32, then divided."""
    largest = -np.inf
    for i in range(n):
        largest = max(largest, buf[start + i])
    total = F32(0)
    for i in range(n):
        e = F32(np.exp(np.float64(buf[start + i] - largest)))
        total = F32(total + e)
        buf[start + i] = e
    for i in range(n):
        buf[start + i] = F32(buf[start + i] / total)


def region_ref(x, classes, coords, boxes, softmax):
    """lwplw/caffe_yolov2's Region Forward_cpu: flatten (channel-last), logistic at entry 4, softmax
    from entry 5."""
    n, c, h, w = x.shape
    size = coords + classes + 1
    area, channel = w * h, boxes * size
    src = x.reshape(-1)
    top = np.empty_like(src)
    for b in range(n):
        for ch in range(channel):
            for i in range(area):
                top[b * channel * area + i * channel + ch] = src[b * channel * area + ch * area + i]
    for b in range(n):
        for i in range(h * w * boxes):
            index = size * i + b * h * w * c
            top[index + 4] = _logistic(top[index + 4])
    if softmax:
        for b in range(n):
            for i in range(h * w * boxes):
                _softmax_inplace(top, size * i + b * h * w * c + 5, classes)
    return top.reshape(n, c, h, w)


class Pred:
    def __init__(self, x, y, w, h, cls, conf):
        self.x, self.y, self.w, self.h, self.cls, self.conf = x, y, w, h, cls, conf


def _overlap(x1, w1, x2, w2):
    l1, l2 = F32(x1 - w1 / F32(2)), F32(x2 - w2 / F32(2))
    r1, r2 = F32(x1 + w1 / F32(2)), F32(x2 + w2 / F32(2))
    return F32(min(r1, r2) - max(l1, l2))


def box_iou(a, b):
    """The forks' box_iou on centre/size boxes, in float32."""
    w = _overlap(a.x, a.w, b.x, b.w)
    h = _overlap(a.y, a.h, b.y, b.h)
    inter = F32(0) if (w < 0 or h < 0) else F32(w * h)
    union = F32(F32(F32(a.w * a.h) + F32(b.w * b.h)) - inter)
    with np.errstate(invalid="ignore", divide="ignore"):
        return F32(inter / union)


def rows_ref(preds, num_images, nms_threshold):
    """Sort by confidence (best first; the test inputs have no ties), ApplyNms, the output rows."""
    preds = sorted(preds, key=lambda p: -p.conf)
    dropped = set()
    for i in range(len(preds) - 1):
        if i in dropped:
            continue
        for j in range(i + 1, len(preds)):
            if j not in dropped and box_iou(preds[i], preds[j]) >= F32(nms_threshold):
                dropped.add(j)
    kept = [p for i, p in enumerate(preds) if i not in dropped]
    if not kept:
        out = np.full((num_images, 7), -1, np.float32)
        out[:, 0] = np.arange(num_images)
        return out.reshape(1, 1, -1, 7)
    rows = [[0, p.cls + 1, p.conf, F32(p.x - p.w / 2), F32(p.y - p.h / 2), F32(p.x + p.w / 2),
             F32(p.y + p.h / 2)] for p in kept]
    return np.array(rows, np.float32).reshape(1, 1, -1, 7)


def yolo_v2_preds(x, biases, num_box, num_classes, threshold):
    """YoloDetectionOutput's predictions of one bottom: swap to (N, H*W, box, C/box), then per
    image, row j, column i (both < side = width) and box n."""
    n, c, h, w = x.shape
    per = c // num_box
    swap = np.empty(x.size, np.float32)
    index = 0
    for b in range(n):
        for hh in range(h):
            for ww in range(w):
                for ch in range(c):
                    swap[index] = x[b, ch, hh, ww]
                    index += 1
    side = w
    out = []
    for b in range(n):
        for j in range(side):
            for i in range(side):
                for k in range(num_box):
                    idx = b * h * w * c + (j * side + i) * c + k * per
                    px = F32(F32(i + _logistic(swap[idx])) / F32(side))
                    py = F32(F32(j + _logistic(swap[idx + 1])) / F32(side))
                    pw = F32(F32(F32(np.exp(np.float64(swap[idx + 2]))) * F32(biases[2 * k])) / F32(side))
                    ph = F32(F32(F32(np.exp(np.float64(swap[idx + 3]))) * F32(biases[2 * k + 1])) / F32(side))
                    obj = _logistic(swap[idx + 4])
                    probs = swap.copy()
                    _softmax_inplace(probs, idx + 5, num_classes)
                    best, cls = probs[idx + 5], 0
                    for q in range(num_classes):
                        if probs[idx + 5 + q] > best:
                            best, cls = probs[idx + 5 + q], q
                    conf = F32(obj * best)
                    if conf >= F32(threshold):
                        out.append(Pred(px, py, pw, ph, cls, conf))
    return out


def yolo_v3_preds(bottoms, biases, mask, anchors_scale, num_box, num_classes, threshold):
    """Yolov3DetectionOutput's Forward_cpu predictions over all bottoms."""
    out = []
    mask_offset = 0
    groups = len(mask) // len(bottoms)
    ln = 5 + num_classes
    for t, x in enumerate(bottoms):
        n, c, h, w = x.shape
        stride = w * h
        data = x.reshape(-1)
        nw, nh = w * anchors_scale[t], h * anchors_scale[t]
        for b in range(n):
            for s in range(stride):
                for k in range(num_box):
                    index = k * ln * stride + s + b * c * stride
                    sig = [_logistic(data[index + q * stride]) for q in range(ln)]
                    y2, x2 = s // w, s % w
                    obj = sig[4]
                    anchor = mask[k + mask_offset]
                    for q in range(num_classes):
                        score = F32(sig[5 + q] * obj)
                        if score > F32(threshold):
                            px = F32(F32(x2 + sig[0]) / F32(w))
                            py = F32(F32(y2 + sig[1]) / F32(h))
                            pw = F32(F32(F32(np.exp(np.float64(data[index + 2 * stride]))) * F32(biases[2 * anchor]))
                                     / F32(nw))
                            ph = F32(F32(F32(np.exp(np.float64(data[index + 3 * stride])))
                                         * F32(biases[2 * anchor + 1])) / F32(nh))
                            out.append(Pred(px, py, pw, ph, q, score))
        mask_offset += groups
    return out


def nms_margins(preds, nms_threshold):
    """Smallest |IoU - threshold| over all pairs and smallest gap between distinct scores: the
    test inputs keep every decision away from a float tie."""
    iou_gap = min((abs(float(box_iou(a, b)) - nms_threshold) for i, a in enumerate(preds)
                   for b in preds[i + 1:]), default=1.0)
    confs = sorted(float(p.conf) for p in preds)
    score_gap = min((b - a for a, b in itertools.pairwise(confs)), default=1.0)
    return iou_gap, score_gap


# ---- running a net: torch, onnxruntime, model.py ---------------------------------------------

def all_backends(text, feeds, tmp_path, top="o"):
    """{backend: the top} from torch, onnxruntime and model.py."""
    model = load_from_text(text)
    return model, backend_outputs(model, feeds, tmp_path, top)


# ---- Reorg ------------------------------------------------------------------------------------

REORG_CASES = [((2, 8, 4, 6), 2, False), ((3, 18, 6, 9), 3, False), ((2, 12, 3, 5), 2, True),
               ((1, 27, 2, 3), 3, True)]


def reorg_text(shape, stride, reverse):
    return net(f'layer {{ name: "o" type: "Reorg" bottom: "x" top: "o" reorg_param {{ stride: {stride} '
               f'reverse: {str(reverse).lower()} }} }}', inputs={"x": (1,) + shape[1:]})


@pytest.mark.parametrize("shape, stride, reverse", REORG_CASES)
def test_reorg_follows_darknets_loop_in_every_backend(shape, stride, reverse, tmp_path):
    x = rng(1).standard_normal(shape).astype(np.float32)     # batch differs from the prototxt's 1
    model, got = all_backends(reorg_text(shape, stride, reverse), {"x": x}, tmp_path)
    want = reorg_ref(x, stride, reverse)
    _, c, h, w = shape
    expect = (c // stride ** 2, h * stride, w * stride) if reverse else (c * stride ** 2, h // stride, w // stride)
    assert model.blob_shapes["o"] == (1,) + expect
    for backend, v in got.items():
        assert v.shape == want.shape, backend
        np.testing.assert_array_equal(v, want, err_msg=backend)


def test_reorg_agrees_with_opencvs_darknet_reorg(tmp_path):
    """OpenCV's ReorgLayer (through its darknet importer) as a second opinion on the odd order."""
    cv2 = pytest.importorskip("cv2")
    (tmp_path / "r.cfg").write_text("[net]\nbatch=1\nwidth=6\nheight=4\nchannels=8\n\n[reorg]\nstride=2\n")
    x = rng(2).standard_normal((1, 8, 4, 6)).astype(np.float32)
    cv_net = cv2.dnn.readNetFromDarknet(str(tmp_path / "r.cfg"))
    cv_net.setInput(x)
    theirs = cv_net.forward()
    ours = load_from_text(reorg_text(x.shape, 2, False)).run({"x": x})["o"]
    np.testing.assert_array_equal(ours, theirs)
    # and it is not a plain space-to-depth
    assert not np.array_equal(ours, torch.nn.functional.pixel_unshuffle(torch.from_numpy(x), 2).numpy())


@pytest.mark.parametrize("params, shape, msg", [
    ("stride: 0", (1, 8, 4, 4), "stride must be >= 1"),
    # (channels that do not divide by stride^2 without reverse: yolov5_caffe's Reorg, test_layers_caffe_plus.py)
    ("stride: 2", (1, 8, 5, 4), "height 5"),
    ("stride: 2 reverse: true", (1, 6, 4, 4), "divide by stride"), ("stride: 2", (1, 8, 4), "4-axis")])
def test_reorg_bad_params(params, shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "o" type: "Reorg" bottom: "x" top: "o" reorg_param {{ {params} }} }}',
                           inputs={"x": shape}))


def test_reorg_without_stride_takes_caffe_yolo9000s_default_of_2(tmp_path):
    """choasup/caffe-yolo9000 declares `stride = 1 [default = 2]`; its test nets leave it out."""
    x = rng(4).standard_normal((1, 8, 4, 6)).astype(np.float32)
    model = load_from_text(net('layer { name: "o" type: "Reorg" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    np.testing.assert_array_equal(model.run({"x": x})["o"], reorg_ref(x, 2, False))
    assert any("sets no stride: 2" in n for n in model.warnings), model.warnings


def test_reorg_refuses_in_place():
    with pytest.raises(LayerError, match="in-place"):
        load_from_text(net('layer { name: "o" type: "Reorg" bottom: "x" top: "x" reorg_param { stride: 2 } }',
                           inputs={"x": (1, 8, 4, 4)}))


# ---- Region -----------------------------------------------------------------------------------

@pytest.mark.parametrize("classes, coords, boxes, softmax", [(3, 4, 2, True), (2, 5, 3, True), (3, 4, 2, False)])
def test_region_follows_the_forks_loops_in_every_backend(classes, coords, boxes, softmax, tmp_path):
    c = boxes * (coords + 1 + classes)
    x = (rng(3).standard_normal((2, c, 3, 5)) * 3).astype(np.float32)
    text = net(f'layer {{ name: "o" type: "Region" bottom: "x" top: "o" region_param {{ classes: {classes} '
               f'coords: {coords} boxes_of_each_grid: {boxes} softmax: {str(softmax).lower()} }} }}',
               inputs={"x": (1, c, 3, 5)})
    model, got = all_backends(text, {"x": x}, tmp_path)
    want = region_ref(x, classes, coords, boxes, softmax)
    assert model.blob_shapes["o"] == (1, c, 3, 5)
    for backend, v in got.items():
        assert_close(v, want, 1e-6, 1e-6, f"region {backend}")


@pytest.mark.parametrize("params, shape, msg", [
    ("classes: 3 coords: 4 boxes_of_each_grid: 2", (1, 15, 3, 3), "channels 15"),
    ("classes: 3 coords: 3 boxes_of_each_grid: 2", (1, 14, 3, 3), "coords must be >= 4"),
    ("classes: 3 boxes_of_each_grid: 0", (1, 16, 3, 3), "boxes_of_each_grid must be >= 1"),
    ("classes: 0", (1, 25, 3, 3), "classes must be >= 1")])
def test_region_bad_params(params, shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "o" type: "Region" bottom: "x" top: "o" region_param {{ {params} }} }}',
                           inputs={"x": shape}))


# ---- Region as darknet2caffe writes it: darknet's forward_region_layer --------------------------

def _darknet_softmax(src, dst, start, n, stride):
    """darknet's softmax(): over n values `stride` apart, largest subtracted, float32 sums."""
    largest = max(src[start + i * stride] for i in range(n))
    exps = [F32(np.exp(np.float64(src[start + i * stride] - largest))) for i in range(n)]
    total = F32(0)
    for e in exps:
        total = F32(total + e)
    for i, e in enumerate(exps):
        dst[start + i * stride] = F32(e / total)


def darknet_region_ref(x, classes, coords, num, softmax, background):
    """darknet's forward_region_layer (CPU) with its entry_index(), activate_array() and
    softmax_cpu() loops on the flat buffers."""
    batch, c, h, w = x.shape
    src = x.reshape(-1).copy()
    out = src.copy()
    outputs = c * h * w

    def entry_index(b, location, entry):
        return b * outputs + (location // (w * h)) * w * h * (coords + classes + 1) + entry * w * h + location % (w * h)

    for b in range(batch):
        for n in range(num):
            index = entry_index(b, n * w * h, 0)
            out[index:index + 2 * w * h] = [_logistic(v) for v in out[index:index + 2 * w * h]]
            index = entry_index(b, n * w * h, coords)
            if not background:
                out[index:index + w * h] = [_logistic(v) for v in out[index:index + w * h]]
            index = entry_index(b, n * w * h, coords + 1)
            if not softmax:
                out[index:index + classes * w * h] = [_logistic(v) for v in out[index:index + classes * w * h]]
    if softmax:
        index = entry_index(0, 0, coords + (0 if background else 1))
        for b in range(batch * num):           # softmax_cpu(input + index, classes + background, ...)
            for g in range(w * h):
                _darknet_softmax(src, out, index + b * (outputs // num) + g, classes + int(background), w * h)
    return out.reshape(x.shape)


def darknet_region_text(classes, coords, num, softmax, background, shape, extra=""):
    soft = "" if softmax is None else f"softmax: {int(softmax)} "
    return net(f'layer {{ name: "o" type: "Region" bottom: "x" top: "o" region_param {{ '
               f'anchors: "1.08,1.19,  3.42,4.41,  6.63,11.38" classes: {classes} coords: {coords} num: {num} '
               f'{soft}background: {int(background)} jitter: .2 rescore: 1 object_scale: 5 thresh: .6 '
               f'nms_thresh: 0.3 box_thresh: 0.24 {extra}}} }}', inputs={"x": shape})


@pytest.mark.parametrize("classes, coords, num, softmax, background", [
    (3, 4, 2, True, False), (2, 5, 3, False, False), (3, 4, 2, True, True), (2, 4, 1, False, True)])
def test_darknet2caffe_region_follows_darknets_loops_in_every_backend(classes, coords, num, softmax, background,
                                                                      tmp_path):
    c = num * (coords + 1 + classes)
    x = (rng(13).standard_normal((2, c, 3, 5)) * 3).astype(np.float32)
    model, got = all_backends(darknet_region_text(classes, coords, num, softmax, background, (1, c, 3, 5)),
                              {"x": x}, tmp_path)
    want = darknet_region_ref(x, classes, coords, num, softmax, background)
    assert model.blob_shapes["o"] == (1, c, 3, 5)
    assert model.graph.nodes[-1].attrs["anchors"] == [1.08, 1.19, 3.42, 4.41, 6.63, 11.38]
    for backend, v in got.items():
        assert_close(v, want, 1e-6, 1e-6, f"darknet region {backend}")
    # not the caffe_yolov2 reading of the same channels
    assert not np.allclose(want, region_ref(x, classes, coords, num, softmax), atol=1e-3)


def test_darknet2caffe_region_agrees_with_opencvs_darknet_region(tmp_path):
    """OpenCV's RegionLayer (through its darknet importer) decodes boxes from the same activations:
    x = (col + out[x]) / W, w = exp(out[w]) * anchor / W, class columns = objectness * probability."""
    cv2 = pytest.importorskip("cv2")
    anchors, classes, num, h, w = [1.0, 2.0, 3.0, 1.5], 3, 2, 3, 5
    c = num * (5 + classes)
    (tmp_path / "r.cfg").write_text(f"[net]\nbatch=1\nwidth={w}\nheight={h}\nchannels={c}\n\n[region]\n"
                                    f"anchors = 1.0,2.0, 3.0,1.5\nclasses={classes}\ncoords=4\nnum={num}\n"
                                    f"softmax=1\nthresh=0\n")
    x = rng(14).standard_normal((1, c, h, w)).astype(np.float32)
    cv_net = cv2.dnn.readNetFromDarknet(str(tmp_path / "r.cfg"))
    cv_net.setInput(x)
    theirs = cv_net.forward()
    text = net('layer { name: "o" type: "Region" bottom: "x" top: "o" region_param { anchors: "1.0,2.0, 3.0,1.5" '
               f'classes: {classes} num: {num} softmax: 1 }} }}', inputs={"x": x.shape})
    o = load_from_text(text).run({"x": x})["o"].reshape(num, 5 + classes, h, w)
    rows = []
    for i in range(h):
        for j in range(w):
            for a in range(num):
                e = o[a, :, i, j]
                rows.append([(j + e[0]) / w, (i + e[1]) / h, np.exp(e[2]) * anchors[2 * a] / w,
                             np.exp(e[3]) * anchors[2 * a + 1] / h, e[4], *(e[4] * e[5:])])
    ours = np.array(rows, np.float32)
    np.testing.assert_allclose(ours[:, :5], theirs[:, :5], rtol=1e-5, atol=1e-6)
    kept = theirs[:, 5:] > 0      # OpenCV zeroes class scores under its own threshold
    assert kept.mean() > 0.5
    np.testing.assert_allclose(ours[:, 5:][kept], theirs[:, 5:][kept], rtol=1e-5, atol=1e-6)


def test_darknet2caffe_region_notes_what_it_assumes():
    notes = load_from_text(darknet_region_text(3, 4, 2, None, False, (1, 16, 3, 3))).warnings
    assert any("sets no softmax" in n and "logistic" in n for n in notes), notes
    assert any("holds 6 numbers for num: 2" in n for n in notes), notes


@pytest.mark.parametrize("params, shape, msg", [
    ('anchors: "1,2, x,4" num: 2 classes: 3', (1, 16, 3, 3), "'x' is not a number"),
    ("num: 2 classes: 3", (1, 15, 3, 3), "channels 15 must be num x"),
    ("num: 2 classes: 3 boxes_of_each_grid: 2", (1, 16, 3, 3), "both boxes_of_each_grid"),
    ("num: 2 classes: 3 coords: 1", (1, 10, 3, 3), "coords must be >= 2")])
def test_darknet2caffe_region_bad_params(params, shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "o" type: "Region" bottom: "x" top: "o" region_param {{ {params} }} }}',
                           inputs={"x": shape}))


# ---- YoloDetectionOutput ------------------------------------------------------------------------

V2_BIASES = [1.1, 1.3, 2.4, 1.9]


def v2_text(n, sides, threshold, nms=0.45, k=3, nb=2, extra=""):
    names = [f"x{i}" for i in range(len(sides))]
    biases = " ".join(f"biases: {b}" for b in V2_BIASES)
    layer = (f'layer {{ name: "o" type: "YoloDetectionOutput" {" ".join(f"bottom: {chr(34)}{b}{chr(34)}" for b in names)} '
             f'top: "o" yolo_detection_output_param {{ num_classes: {k} num_box: {nb} coords: 4 '
             f'confidence_threshold: {threshold} nms_threshold: {nms} {biases} {extra} }} }}')
    return net(layer, inputs={b: (n, nb * (5 + k), s, s) for b, s in zip(names, sides)})


def v2_inputs(seed, n, sides, k=3, nb=2):
    g = rng(seed)
    return {f"x{i}": g.standard_normal((n, nb * (5 + k), s, s)).astype(np.float32) for i, s in enumerate(sides)}


@pytest.mark.parametrize("sides", [(4, 2), (5,)])
def test_yolo_v2_detections_in_every_backend(sides, tmp_path):
    threshold, nms = 0.2, 0.45
    feeds = v2_inputs(4, 3, sides)     # batch 3; the prototxt says 2
    preds = [p for i in range(len(sides)) for p in yolo_v2_preds(feeds[f"x{i}"], V2_BIASES, 2, 3, threshold)]
    iou_gap, score_gap = nms_margins(preds, nms)
    assert iou_gap > 1e-4 and score_gap > 1e-6, "inputs too close to a tie for a well-posed test"
    want = rows_ref(preds, 3, nms)
    assert 5 < want.shape[2] < len(preds)      # the threshold keeps some, NMS drops some
    assert (want[0, 0, :, 0] == 0).all()        # the fork writes image 0 on every row
    model, got = all_backends(v2_text(2, sides, threshold, nms), feeds, tmp_path)
    assert model.blob_shapes["o"] == (1, 1, 2 * 2 * sum(s * s for s in sides), 7)   # the most rows it can write
    for backend, v in got.items():
        assert v.shape == want.shape, backend
        assert_close(v, want, 1e-6, 1e-6, f"yolo v2 {backend}")


def test_yolo_v2_without_detections_gives_one_row_per_image(tmp_path):
    feeds = v2_inputs(5, 3, (3,))
    want = np.full((1, 1, 3, 7), -1, np.float32)
    want[0, 0, :, 0] = np.arange(3)
    np.testing.assert_array_equal(rows_ref(yolo_v2_preds(feeds["x0"], V2_BIASES, 2, 3, 0.99), 3, 0.45), want)
    _, got = all_backends(v2_text(2, (3,), 0.99), feeds, tmp_path)
    for backend, v in got.items():
        np.testing.assert_array_equal(v, want, err_msg=backend)


@pytest.mark.parametrize("num_box, msg", [(3, "biases has 4 values"), (0, "num_box must be >= 1")])
def test_yolo_v2_bad_params(num_box, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(v2_text(1, (3,), 0.5, nb=num_box))


def test_yolo_v2_refuses_non_square_maps_and_wrong_channels():
    layer = ('layer { name: "o" type: "YoloDetectionOutput" bottom: "x" top: "o" yolo_detection_output_param { '
             'num_classes: 3 num_box: 2 biases: 1 biases: 1 biases: 2 biases: 2 } }')
    with pytest.raises(LayerError, match="square"):
        load_from_text(net(layer, inputs={"x": (1, 16, 3, 4)}))
    with pytest.raises(LayerError, match="channels 14"):
        load_from_text(net(layer, inputs={"x": (1, 14, 3, 3)}))
    with pytest.raises(LayerError, match="num_classes is required"):
        load_from_text(net(layer.replace("num_classes: 3 ", ""), inputs={"x": (1, 16, 3, 3)}))


# ---- Yolov3DetectionOutput ------------------------------------------------------------------------

V3_BIASES = [10, 14, 23, 27, 37, 58, 81, 82, 135, 169, 344, 319]
V3_MASK = [3, 4, 5, 0, 1, 2]
V3_SCALES = [32, 16]


def v3_text(n, maps, threshold, nms=0.45, k=2, nb=3, extra=""):
    names = [f"x{i}" for i in range(len(maps))]
    fields = (" ".join(f"biases: {b}" for b in V3_BIASES) + " " + " ".join(f"mask: {m}" for m in V3_MASK) + " "
              + " ".join(f"anchors_scale: {s}" for s in V3_SCALES))
    layer = (f'layer {{ name: "o" type: "Yolov3DetectionOutput" {" ".join(f"bottom: {chr(34)}{b}{chr(34)}" for b in names)} '
             f'top: "o" yolov3_detection_output_param {{ num_classes: {k} num_box: {nb} '
             f'confidence_threshold: {threshold} nms_threshold: {nms} mask_group_num: {len(maps)} {fields} {extra} }} }}')
    return net(layer, inputs={b: (n, nb * (5 + k)) + hw for b, hw in zip(names, maps)})


def v3_inputs(seed, n, maps, k=2, nb=3):
    g = rng(seed)
    return {f"x{i}": g.standard_normal((n, nb * (5 + k)) + hw).astype(np.float32) for i, hw in enumerate(maps)}


def test_yolo_v3_detections_in_every_backend(tmp_path):
    maps, threshold, nms = ((3, 4), (6, 8)), 0.5, 0.45
    feeds = v3_inputs(6, 3, maps)
    preds = yolo_v3_preds([feeds["x0"], feeds["x1"]], V3_BIASES, V3_MASK, V3_SCALES, 3, 2, threshold)
    iou_gap, score_gap = nms_margins(preds, nms)
    assert iou_gap > 1e-4 and score_gap > 1e-6, "inputs too close to a tie for a well-posed test"
    want = rows_ref(preds, 3, nms)
    assert 5 < want.shape[2] < len(preds)
    model, got = all_backends(v3_text(2, maps, threshold, nms), feeds, tmp_path)
    assert model.blob_shapes["o"] == (1, 1, 2 * 3 * 2 * (12 + 48), 7)
    for backend, v in got.items():
        assert v.shape == want.shape, backend
        assert_close(v, want, 1e-6, 1e-6, f"yolo v3 {backend}")


@pytest.mark.parametrize("nms", [0.45, 1.5])
def test_yolo_v3_box_passing_for_many_classes(nms, tmp_path):
    # with many classes and a low threshold each box passes for several classes: the NMS loop then
    # runs over each box's best candidate only (its copies share its fate), unless a box's IoU with
    # itself stays below the threshold (1.5: nothing is ever dropped, every copy is a row)
    maps, threshold, k = ((2, 3), (4, 6)), 0.05, 4
    feeds = v3_inputs(15, 2, maps, k=k)
    preds = yolo_v3_preds([feeds["x0"], feeds["x1"]], V3_BIASES, V3_MASK, V3_SCALES, 3, k, threshold)
    iou_gap, score_gap = nms_margins(preds, nms)
    assert iou_gap > 1e-4 and score_gap > 1e-6, "inputs too close to a tie for a well-posed test"
    want = rows_ref(preds, 2, nms)
    boxes = {(float(p.x), float(p.y)) for p in preds}
    assert len(preds) > 3 * len(boxes)   # most boxes pass for several classes
    assert want.shape[2] == (len(preds) if nms > 1 else len(set(map(tuple, want[0, 0, :, 3:]))))
    _, got = all_backends(v3_text(2, maps, threshold, nms, k=k), feeds, tmp_path)
    for backend, v in got.items():
        assert v.shape == want.shape, backend
        assert_close(v, want, 1e-6, 1e-6, f"yolo v3 many classes {backend}")


def test_yolo_v3_threshold_that_drops_disjoint_boxes_is_refused_in_onnx(tmp_path):
    # IoU >= 0 holds for boxes that do not even overlap: only the best box is kept, which ONNX's
    # NonMaxSuppression (thresholds in [0, 1], drops IoU > t) cannot say
    maps = ((3, 4), (6, 8))
    feeds = v3_inputs(6, 1, maps)
    model = load_from_text(v3_text(1, maps, 0.5, 0.0))
    assert model.run(feeds)["o"].shape[2] == 1
    with pytest.raises(ExportError, match="layer 'o' .*NMS threshold 0.0 drops every box after the best"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()


def test_yolo_v3_without_detections_gives_one_row_per_image(tmp_path):
    maps = ((2, 3),)
    feeds = v3_inputs(7, 2, maps)
    text = v3_text(2, maps, 0.999)
    want = np.full((1, 1, 2, 7), -1, np.float32)
    want[0, 0, :, 0] = np.arange(2)
    _, got = all_backends(text, feeds, tmp_path)
    for backend, v in got.items():
        np.testing.assert_array_equal(v, want, err_msg=backend)


@pytest.mark.parametrize("change, msg", [
    (("num_classes: 2", "num_classes: 2 gaussian_box: true"), "gaussian_box"),
    (("num_box: 3", "num_box: 4"), "mask has 6 entries"),
    (("mask_group_num: 2", "mask_group_num: 3"), "mask_group_num 3 must equal the number of bottoms"),
    (("anchors_scale: 16", ""), "anchors_scale needs one positive value per bottom"),
    (("biases: 344 biases: 319", ""), "biases has 10 values"),
])
def test_yolo_v3_bad_params(change, msg):
    text = v3_text(1, ((3, 4), (6, 8)), 0.5)
    assert change[0] in text
    with pytest.raises(LayerError, match=msg):
        load_from_text(text.replace(change[0], change[1]))


def test_yolo_v3_checks_channels():
    with pytest.raises(LayerError, match="channels 20"):
        load_from_text(v3_text(1, ((3, 4), (6, 8)), 0.5).replace("dim: 21 dim: 3", "dim: 20 dim: 3"))


def test_yolo_v3_reads_the_first_channels_of_a_wider_bottom(tmp_path):
    # eric612/Yolo-Model-Zoo's Pelee test net feeds a 125-channel map where 3 x 25 are read: the fork's
    # forward indexes box n at channel n * (5 + k) of each item and checks no channel count
    maps, threshold, nms = ((3, 4), (6, 8)), 0.5, 0.45
    feeds = v3_inputs(6, 2, maps)
    wide = dict(feeds, x1=np.concatenate([feeds["x1"], rng(9).standard_normal((2, 9, 6, 8)).astype(np.float32)], 1))
    want = rows_ref(yolo_v3_preds([feeds["x0"], feeds["x1"]], V3_BIASES, V3_MASK, V3_SCALES, 3, 2, threshold), 3, nms)
    text = v3_text(2, maps, threshold, nms).replace("dim: 21 dim: 6", "dim: 30 dim: 6")
    model, got = all_backends(text, wide, tmp_path)
    assert any("reads the first 3 x 7 of a bottom's 30 channels" in w for w in model.warnings)
    for backend, v in got.items():
        assert v.shape == want.shape, backend
        assert_close(v, want, 1e-6, 1e-6, f"yolo v3 wide {backend}")


# ---- all four together: ONNX's oldest opset, gradients, CUDA ---------------------------------------

def yolo_net():
    """Reorg -> Region, and both detection layers, in one net."""
    v2 = v2_text(2, (4,), 0.2).split("\n")[-1].replace('bottom: "x0"', 'bottom: "m"')
    v3 = v3_text(2, ((3, 4), (6, 8)), 0.5).split("\n")[-1].replace('name: "o"', 'name: "o3"').replace(
        'top: "o"', 'top: "o3"')
    return net('layer { name: "r" type: "Reorg" bottom: "a" top: "r" reorg_param { stride: 2 } }',
               'layer { name: "g" type: "Region" bottom: "r" top: "g" region_param { classes: 3 coords: 4 '
               'boxes_of_each_grid: 2 softmax: true } }', v2, v3,
               inputs={"a": (2, 4, 8, 12), "m": (2, 16, 4, 4), "x0": (2, 21, 3, 4), "x1": (2, 21, 6, 8)})


def yolo_feeds(seed, n):
    g = rng(seed)
    return {"a": g.standard_normal((n, 4, 8, 12)).astype(np.float32), **v2_inputs(seed, n, (4,)),
            **{k.replace("x0", "m"): v for k, v in v2_inputs(seed, n, (4,)).items()},
            **v3_inputs(seed + 1, n, ((3, 4), (6, 8)))}


def test_onnx_at_opset_13(tmp_path):
    model = load_from_text(yolo_net())
    feeds = yolo_feeds(10, 3)
    ours = model.run(feeds)
    theirs = onnx_outputs(model, feeds, tmp_path, opset=13)
    for top in ("g", "o", "o3"):
        assert theirs[top].shape == ours[top].shape, top
        assert_close(theirs[top], ours[top], 1e-6, 1e-6, f"opset 13 {top}")


def test_reorg_and_region_pass_gradients():
    model = load_from_text(net('layer { name: "r" type: "Reorg" bottom: "a" top: "r" reorg_param { stride: 2 } }',
                               'layer { name: "g" type: "Region" bottom: "r" top: "g" region_param { classes: 3 '
                               'coords: 4 boxes_of_each_grid: 2 softmax: true } }', inputs={"a": (2, 4, 8, 12)}))
    a = torch.from_numpy(rng(11).standard_normal((2, 4, 8, 12)).astype(np.float32)).requires_grad_(True)
    (model.to_torch()(a) ** 2).sum().backward()
    assert a.grad is not None and torch.isfinite(a.grad).all() and (a.grad != 0).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_yolo_layers_on_cuda_match_cpu():
    model = load_from_text(yolo_net())
    feeds = yolo_feeds(12, 2)
    cpu = model.run(feeds, all_blobs=True)
    gpu = model.run(feeds, all_blobs=True, device="cuda")
    for k, v in cpu.items():
        assert gpu[k].shape == v.shape, k
        assert_close(gpu[k], v, 1e-5, 1e-5, f"cuda {k}")


# ---- yolov3-tiny's size-2 stride-1 maxpool, as the darknet converters' Caffe pools it ------------
# ChenYingpeng/darknet2caffe's pooling_layer.cpp: one more output per axis when kernel - stride is
# odd, the window clipped at the bottom/right edge; read so only when BVLC's shapes do not fit

TINY = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 6 dim: 10 } } }
layer { name: "pool1" type: "Pooling" bottom: "data" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "pool2" type: "Pooling" bottom: "pool1" top: "pool2"
        pooling_param { pool: MAX kernel_size: 2 stride: 1 pad: 0 } }
layer { name: "up" type: "Upsample" bottom: "pool2" top: "up" upsample_param { scale: 2 } }
layer { name: "route" type: "Concat" bottom: "up" bottom: "data" top: "o" }
"""


def darknet_kept_size_pool_ref(x, k):
    """The fork's MAX loop for stride 1: out[ph, pw] = max of x[ph:ph + k, pw:pw + k] clipped at the
    edge, one output more per axis than BVLC's H - k + 1."""
    n, c, h, w = x.shape
    out = np.full((n, c, h - k + 2, w - k + 2), -np.finfo(F32).max, F32)
    for ph in range(h - k + 2):
        for pw in range(w - k + 2):
            out[:, :, ph, pw] = x[:, :, ph:min(ph + k, h), pw:min(pw + k, w)].max(axis=(2, 3))
    return out


def test_darknet_stride_one_maxpool_keeps_the_map_size_where_only_that_fits(tmp_path):
    model = load_from_text(TINY)
    assert model.blob_shapes["pool2"] == (1, 2, 3, 5)
    assert any("'pool2' (stride 1, even kernel) keep their map's size" in w for w in model.warnings)
    x = rng(40).standard_normal((1, 2, 6, 10)).astype(F32)
    pool1 = x.reshape(1, 2, 3, 2, 5, 2).max(axis=(3, 5))
    up = darknet_kept_size_pool_ref(pool1, 2).repeat(2, axis=2).repeat(2, axis=3)
    ref = np.concatenate([up, x], axis=1)
    for backend, got in backend_outputs(model, {"data": x}, tmp_path).items():
        assert_close(got, ref, 0, 0, backend)
    # where BVLC's shapes fit, BVLC's pooling stays (a lone stride-1 pool shrinks the map by one)
    alone = load_from_text(TINY.split('layer { name: "up"')[0])
    assert alone.blob_shapes["pool2"] == (1, 2, 2, 4) and not any("keep their map" in w for w in alone.warnings)
    # hdchenjian/MXNet2Caffe's yolov3-tiny writes darknet's padding 1 as pad 1, which BVLC pads on both
    # sides (one larger): read the same way where only that fits
    padded = load_from_text(TINY.replace("stride: 1 pad: 0", "stride: 1 pad_h: 1 pad_w: 1"))
    assert padded.blob_shapes["pool2"] == (1, 2, 3, 5)
    for backend, got in backend_outputs(padded, {"data": x}, tmp_path).items():
        assert_close(got, ref, 0, 0, backend)
    padded_alone = load_from_text(TINY.replace("stride: 1 pad: 0", "stride: 1 pad: 1").split('layer { name: "up"')[0])
    assert padded_alone.blob_shapes["pool2"] == (1, 2, 4, 6)


# ---- Upsample as Huawei Ascend's ATC extension and darknet's [upsample] write it --------------------

def _upsample_net(param):
    return net(f'layer {{ name: "up" type: "Upsample" bottom: "data" top: "o" upsample_param {{ {param} }} }}',
               inputs={"data": (1, 3, 4, 5)})


@pytest.mark.parametrize("param, factors, value_scale", [
    ("scale: 1 stride: 2", (2, 2), 1),           # xiaoyuetang/caffe-yolov3's files
    ("stride: 3 scale: 2", (3, 3), 2),           # darknet multiplies the values by scale
    ("stride_h: 2 stride_w: 3", (2, 3), 1),
    ("stride_w: 1", (2, 1), 1)])                 # Ascend's defaults: 2 for the other
def test_darknet_stride_upsample_repeats_by_stride_and_multiplies_by_scale(param, factors, value_scale, tmp_path):
    model = load_from_text(_upsample_net(param))
    x = rng(41).standard_normal((1, 3, 4, 5)).astype(F32)
    ref = x.repeat(factors[0], axis=2).repeat(factors[1], axis=3) * F32(value_scale)
    for backend, got in backend_outputs(model, {"data": x}, tmp_path).items():
        assert_close(got, ref, 0, 0, backend)


@pytest.mark.parametrize("param, message", [
    ("stride: 2 stride_h: 2", "give stride, or stride_h and stride_w, not both forms"),
    ("stride: 0", "stride must be >= 1"),
    ("stride: 2 scale_h: 2 scale_w: 2", "stride (darknet's form) takes only scale")])
def test_darknet_stride_upsample_refuses_mixed_forms(param, message):
    with pytest.raises(LayerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_from_text(_upsample_net(param))
