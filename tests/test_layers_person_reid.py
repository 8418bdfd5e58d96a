"""sanpingzhou/Person-Re-ID's PS layer (caffeq/layers/person_reid.py) against its split_person_layer.cpp loop,
written here as the fork writes it (the fourth stripe with the other stripes' plane stride), in torch,
onnxruntime and model.py; and its rectangular crop_size_h / crop_size_w."""
import numpy as np
import pytest
from conftest import check_everywhere, net, onnx_outputs, rng

from caffeq.errors import DataError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def stripes_ref(x):
    n, c, h, w = x.shape
    rows = h // 4
    last_rows = h - 3 * rows
    tops = [x[:, :, i * rows:(i + 1) * rows].copy() for i in range(3)]
    last = np.zeros(n * c * last_rows * w, F)
    for j in range(n):
        for k in range(c):
            for row in range(last_rows):
                for col in range(w):   # top_data + ((j * channels_) + k) * bin_h_ * bin_w_ + bin_w_ * l
                    last[((j * c) + k) * rows * w + w * row + col] = x[j, k, 3 * rows + row, col]
    return tops + [last.reshape(n, c, last_rows, w)]


@pytest.mark.parametrize("shape", [(2, 3, 8, 5), (2, 3, 25, 9), (1, 2, 7, 4)])
def test_person_stripes_follow_the_forks_loop(shape, tmp_path):
    text = net('layer { name: "personplit" type: "PS" bottom: "x" top: "lt" top: "rt" top: "lb" top: "rb" }',
               inputs={"x": shape})
    model = load_from_text(text)
    x = rng(5).standard_normal(shape).astype(F)
    want = dict(zip(("lt", "rt", "lb", "rb"), stripes_ref(x)))
    if shape[2] % 4:   # the fork's own stripe: rows shifted into the next plane, zeros at the end
        assert not np.array_equal(want["rb"], x[:, :, 3 * (shape[2] // 4):])
        assert want["rb"].reshape(-1)[-1] == 0
    else:
        np.testing.assert_array_equal(want["rb"], x[:, :, 3 * (shape[2] // 4):])
    for name, ref in want.items():
        assert model.blob_shapes[name] == ref.shape
    check_everywhere(model, {"x": x}, want, tmp_path)


def test_person_stripes_need_four_rows():
    with pytest.raises(LayerError, match="height of 3"):
        load_from_text(net('layer { name: "p" type: "PS" bottom: "x" top: "a" top: "b" top: "c" top: "d" }',
                           inputs={"x": (1, 1, 3, 4)}))


def test_rectangular_crop_sizes_the_data_and_eval_refuses_it(tmp_path):
    # the P2S nets: ImageData resized to 250 x 100, then a 230 x 80 crop (crop_size_h / crop_size_w)
    text = ('layer { name: "data" type: "ImageData" top: "data" top: "label" include { phase: TEST } '
            'transform_param { crop_size_h: 230 crop_size_w: 80 mean_value: 100 } image_data_param { '
            'source: "list.txt" batch_size: 4 new_height: 250 new_width: 100 } }\n'
            'layer { name: "p" type: "PS" bottom: "data" top: "a" top: "b" top: "c" top: "d" }')
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    model = load_from_text(text)
    assert model.blob_shapes["data"] == (4, 3, 230, 80)
    assert model.blob_shapes["d"] == (4, 3, 230 - 3 * 57, 80)
    (tmp_path / "list.txt").write_text("a.jpg 0\n")
    from caffeq.evaluate import evaluate
    with pytest.raises(DataError, match="crop_size_h / crop_size_w .* not applied by eval"):
        evaluate(str(path))


def test_person_stripes_unwritten_tail_stays_zero_beside_an_infinite_input(tmp_path):
    # the ONNX export picks the tail's values from the input's first element and keeps 0 where the fork writes
    # nothing: an inf there must not turn those zeros into NaN (inf * 0)
    shape = (2, 2, 7, 3)
    model = load_from_text(net('layer { name: "p" type: "PS" bottom: "x" top: "a" top: "b" top: "c" top: "d" }',
                               inputs={"x": shape}))
    x = rng(6).standard_normal(shape).astype(F)
    x[0, 0, 0, 0] = np.inf
    want = stripes_ref(x)[3]
    np.testing.assert_array_equal(model.run({"x": x})["d"], want)
    np.testing.assert_array_equal(onnx_outputs(model, {"x": x}, tmp_path)["d"], want)
