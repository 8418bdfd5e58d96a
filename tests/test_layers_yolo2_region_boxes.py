"""zhang-xin/caffe's two-top Region (region_layer.cpp, include/caffe/util/region_util.hpp at 0bfd32d)
against the fork's loops written out in numpy (entry_index, forward_softmax, get_region_boxes), in
torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def sigmoid(v):
    return f32(1) / (f32(1) + np.exp(-v))


def ref_region(x, num, side, coords, classes, softmax, thresh, biases):
    size = coords + classes + 1
    flat = x.reshape(x.shape[0], -1).astype(f32)
    out = flat.copy()
    hw = side * side

    def entry_index(b, location, entry):
        return b * hw * num * size + (location // hw) * hw * size + entry * hw + location % hw

    for b in range(x.shape[0]):
        for n in range(num):
            i0 = entry_index(b, n * hw, 0)
            out[b, i0 - b * hw * num * size:][:2 * hw] = sigmoid(flat[b, i0 - b * hw * num * size:][:2 * hw])
            io = entry_index(b, n * hw, coords) - b * hw * num * size
            out[b, io:io + hw] = sigmoid(flat[b, io:io + hw])
            if softmax:
                ic = entry_index(b, n * hw, coords + 1) - b * hw * num * size
                for loc in range(hw):
                    v = flat[b, ic + loc:ic + loc + classes * hw:hw]
                    e = np.exp(v - v.max())
                    out[b, ic + loc:ic + loc + classes * hw:hw] = e / e.sum(dtype=f32)
    data = out[0]
    box = np.zeros((num * hw, coords), f32)
    prob = np.zeros((num * hw, classes + 1), f32)
    for i in range(hw):
        row, col = i // side, i % side
        for n in range(num):
            index = n * hw + i
            scale = data[entry_index(0, index, coords)]
            bi = entry_index(0, index, 0)
            box[index, :4] = [(col + data[bi]) / f32(side), (row + data[bi + hw]) / f32(side),
                              np.exp(data[bi + 2 * hw]) * f32(biases[2 * n]) / f32(side),
                              np.exp(data[bi + 3 * hw]) * f32(biases[2 * n + 1]) / f32(side)]
            best = f32(0)
            for j in range(classes):
                p = scale * data[entry_index(0, index, coords + 1 + j)]
                prob[index, j] = p if p > f32(thresh) else 0
                best = max(best, p)
            prob[index, classes] = best if best > f32(thresh) else 0
    return box.reshape(num, side, side, coords), prob.reshape(num, side, side, classes + 1)


BIASES = [1.08, 1.19, 3.42, 4.41, 6.63, 11.38]


def region_net(n, num, side, coords, classes, softmax="true", thresh=0.2, biases=BIASES, names=("num_classes",
                                                                                               "threshold")):
    bias_text = " ".join(f"biases: {b}" for b in biases)
    layer = (f'layer {{ name: "region" type: "Region" bottom: "x" top: "box" top: "prob" '
             f'region_loss_param {{ side: {side} num: {num} coords: {coords} {names[0]}: {classes} '
             f'softmax: {softmax} {names[1]}: {thresh} {bias_text} }} }}')
    return net(layer, inputs={"x": (n, num * (coords + classes + 1), side, side)})


@pytest.mark.parametrize("n, num, side, coords, classes, softmax, thresh", [
    (1, 3, 4, 4, 5, "true", 0.2), (2, 2, 3, 4, 3, "false", 0.05), (1, 3, 5, 6, 2, "true", 0.3)])
def test_region_boxes_match_the_forks_loops(n, num, side, coords, classes, softmax, thresh, tmp_path):
    model = load_from_text(region_net(n, num, side, coords, classes, softmax, thresh))
    x = (np.random.default_rng(side * classes).standard_normal((n, num * (coords + classes + 1), side, side))
         * 2).astype(f32)
    box, prob = ref_region(x, num, side, coords, classes, softmax == "true", thresh, BIASES)
    assert model.blob_shapes["box"] == (num, side, side, coords)
    assert model.blob_shapes["prob"] == (num, side, side, classes + 1)
    assert (prob == 0).any() and (prob > 0).any()
    check_everywhere(model, {"x": x}, {"box": box, "prob": prob}, tmp_path, atol=1e-6, rtol=1e-5)


def test_mobilenet_yolo_field_names_read_the_same():
    # the numbers of num_classes / threshold carry MobileNet-YOLO's num_class / thresh
    a = load_from_text(region_net(1, 2, 3, 4, 3, names=("num_classes", "threshold")))
    b = load_from_text(region_net(1, 2, 3, 4, 3, names=("num_class", "thresh")))
    assert a.layers[1].attrs == b.layers[1].attrs


def test_region_boxes_checks(tmp_path):
    with pytest.raises(LayerError, match=r"side\^2 x num x \(coords \+ 1 \+ classes\) = 4\^2 x 2 x 8"):
        load_from_text(net('layer { name: "r" type: "Region" bottom: "x" top: "b" top: "p" region_loss_param { '
                           'side: 4 num: 2 num_classes: 3 } }', inputs={"x": (1, 16, 3, 3)}))
    short = load_from_text(region_net(1, 3, 2, 4, 2, biases=BIASES[:4]))
    x = np.zeros((1, 21, 2, 2), f32)
    with pytest.raises(LayerError, match=r"biases holds 4 values, the layer reads 2 x num = 6"):
        short.run({"x": x})
    with pytest.raises(ExportError, match=r"biases holds 4 values"):
        short.export_onnx(str(tmp_path / "r.onnx"))
