"""RA-CNN's AttentionCrop (caffeq/layers/ra_cnn.py) against attention_crop_layer.cpp's loop (ouceduxzk/
Fine_Grained_Classification e19d04f) written here with OpenCV's fixed-point 8-bit INTER_LINEAR resize, in torch
and model.py (ONNX is refused); the resize reference is checked against cv2.resize itself where OpenCV is installed."""
import math

import numpy as np
import pytest
from conftest import model_py_outputs, net

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
MEANS = [F(109.961), F(127.21), F(123.645)]
LAYER = 'layer { name: "crop" type: "AttentionCrop" bottom: "x" bottom: "box" top: "o" }'


def to_byte(v):
    """(unsigned char) of a float as gcc on x86-64 converts it: to an int (truncating), its low 8 bits."""
    return int(math.trunc(float(v))) % 256


def cv_linear_table(dst, src, clamp_weights):
    """OpenCV's per-output (source index, weight0, weight1) for INTER_LINEAR on 8-bit data."""
    scale = 1.0 / (dst / src)
    table = []
    for d in range(dst):
        f = F((d + 0.5) * scale - 0.5)
        s = math.floor(f)
        f = F(f - F(s))
        if clamp_weights and s < 0:
            f, s = F(0), 0
        if clamp_weights and s >= src - 1:
            f, s = F(0), src - 1
        w0 = int(np.rint(F(F(1) - f) * F(2048)))
        w1 = int(np.rint(f * F(2048)))
        table.append((s, w0, w1))
    return table


def cv_resize_u8(img, out):
    """cv::resize(img, (out, out), INTER_LINEAR) of an (h, w) 8-bit plane, OpenCV's integer steps."""
    h, w = img.shape
    xs, ys = cv_linear_table(out, w, True), cv_linear_table(out, h, False)

    def hrow(r):
        r = min(max(r, 0), h - 1)
        return [int(img[r, s]) * w0 + int(img[r, min(s + 1, w - 1)]) * w1 for s, w0, w1 in xs]

    res = np.empty((out, out), np.uint8)
    for dy, (sy, b0, b1) in enumerate(ys):
        r0, r1 = hrow(sy), hrow(sy + 1)
        res[dy] = [(((b0 * (p >> 4)) >> 16) + ((b1 * (q >> 4)) >> 16) + 2) >> 2 for p, q in zip(r0, r1)]
    return res


def attention_crop_ref(x, box):
    n, _, size, _ = x.shape
    out = np.empty((n, 3, 224, 224), F)
    for i in range(n):
        a, b, c = (F(v) for v in box[i])
        c = c if float(c) > 0.01 * size else F(0.01 * size)
        w_off = int(a - c) if a - c > 0 else 0
        h_off = int(b - c) if b - c > 0 else 0
        w_end = int(a + c) if a + c < size else size
        h_end = int(b + c) if b + c < size else size
        for k in range(3):
            img = np.array([[to_byte(F(x[i, k, r, col] + MEANS[k])) for col in range(size)] for r in range(size)],
                           np.uint8)
            crop = img[h_off:h_end, w_off:w_end]
            out[i, k] = cv_resize_u8(crop, 224).astype(F) - MEANS[k]
    return out


@pytest.mark.parametrize("src,out", [((37, 53), 224), ((224, 224), 224), ((448, 448), 224), ((5, 9), 224),
                                     ((300, 201), 224)])
def test_the_resize_reference_is_opencvs(src, out):
    cv2 = pytest.importorskip("cv2")
    img = np.random.default_rng(sum(src)).integers(0, 256, src + (3,), dtype=np.uint8)
    got = cv2.resize(img, (out, out), interpolation=cv2.INTER_LINEAR)
    for k in range(3):
        np.testing.assert_array_equal(cv_resize_u8(img[:, :, k], out), got[:, :, k])


def test_attention_crop_matches_the_forks_loop(tmp_path):
    size = 57                      # odd; the fork's buffers are square, so H = W
    model = load_from_text(net(LAYER, inputs={"x": (2, 3, size, size), "box": (2, 3)}))
    assert model.blob_shapes["o"] == (2, 3, 224, 224)
    g = np.random.default_rng(3)
    # mean-subtracted pixels, some beyond the 8-bit range after the mean is added back (they wrap)
    x = (g.random((2, 3, size, size)) * 300 - 140).astype(F)
    box = np.array([[20.3, 31.7, 11.2], [50.5, 4.25, 0.1]], F)   # second: clipped edges, c below 0.01 S
    want = attention_crop_ref(x, box)
    got = model.run({"x": x, "box": box})["o"]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(model_py_outputs(model, {"x": x, "box": box}, tmp_path)["o"], want)
    with pytest.raises(ExportError, match="AttentionCrop"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_attention_crop_downscales_a_whole_image():
    model = load_from_text(net(LAYER, inputs={"x": (1, 3, 251, 251), "box": (1, 3)}))
    x = (np.random.default_rng(5).random((1, 3, 251, 251)) * 255 - 120).astype(F)
    box = np.array([[125.5, 125.5, 400.0]], F)
    np.testing.assert_array_equal(model.run({"x": x, "box": box})["o"], attention_crop_ref(x, box))


def test_attention_crop_refuses_what_the_fork_cannot_read():
    with pytest.raises(LayerError, match=r"square 3-channel image"):
        load_from_text(net(LAYER, inputs={"x": (1, 3, 20, 21), "box": (1, 3)}))
    with pytest.raises(LayerError, match=r"box bottom must be \(N, 3\)"):
        load_from_text(net(LAYER, inputs={"x": (2, 3, 20, 20), "box": (2, 4)}))


def test_a_box_outside_the_image_is_an_error():
    model = load_from_text(net(LAYER, inputs={"x": (1, 3, 16, 16), "box": (1, 3)}))
    with pytest.raises(Exception, match="leaves no pixel"):
        model.run({"x": np.zeros((1, 3, 16, 16), F), "box": np.array([[40.0, 5.0, 3.0]], F)})
