"""ColorConv (caffeq/layers/color_conv.py) against the spec's worked values (a float32 transcription of
appearance-flow's color_conv_layer) and a float64 loop written here from its converters, in torch,
onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text


def lab_ref(bgr):
    """Converter<RGB, XYZ> then Converter<XYZ, Lab> of one (B, G, R) pixel, in float64."""
    def linear(v):
        v = v / 255.0
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(float(v)) for v in bgr[::-1])
    x = 0.4124564 * r + 0.3575761 * g + 0.1804375 * b
    y = 0.2126729 * r + 0.7151522 * g + 0.0721750 * b
    z = 0.0193339 * r + 0.1191920 * g + 0.9503041 * b

    def f(v):
        return v ** (1.0 / 3) if v > 0.008867 else (903.3 * v + 16) / 116

    fx, fy, fz = f(x / 0.95074), f(y / 1.0), f(z / 1.08883)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


LAYER = ('layer {{ name: "img_lab" type: "ColorConv" bottom: "img" top: "img_lab" propagate_down: false '
         'color_conv_param {{ input: {src} output: {dst} }} }}')


def test_the_worked_values_white_point_and_all():
    pixels = np.array([[255, 255, 255], [0, 0, 255], [50, 100, 150], [0, 0, 0], [1, 1, 1]], np.float32)
    img = pixels.T.reshape(1, 3, 1, 5)
    model = load_from_text(net(LAYER.format(src=0, dst=3), inputs={"img": img.shape}))
    got = model.run({"img": img})["img_lab"][0, :, 0].T
    spec = [(100.0, -0.04733, 0.0), (53.24079, 80.05664, 67.20319), (46.75092, 15.08597, 35.91047),
            (0, 0, 0), (0.274176, -0.000335, 0.0)]
    np.testing.assert_allclose(got, spec, atol=2e-4)      # white's a is -0.047: the fork's 0.95074


def test_color_conv_matches_the_converters_on_every_image(tmp_path):
    img = rng(60).uniform(0, 255, (3, 3, 4, 5)).astype(np.float32)
    img[1, :, 0, 0] = [2, 3, 1]           # the linear segments of both steps
    model = load_from_text(net(LAYER.format(src=0, dst=3), inputs={"img": img.shape}))
    ref = np.empty(img.shape)
    for n in range(3):                     # every image, as the fork's GPU forward converts them
        for h in range(4):
            for w in range(5):
                ref[n, :, h, w] = lab_ref(img[n, :, h, w])
    check_everywhere(model, {"img": img}, {"img_lab": ref}, tmp_path, atol=5e-4, rtol=1e-5)


def test_rgb_input_and_xyz_output(tmp_path):
    img = rng(61).uniform(0, 255, (1, 3, 2, 3)).astype(np.float32)
    lab_model = load_from_text(net(LAYER.format(src=1, dst=3), inputs={"img": img.shape}))
    got = lab_model.run({"img": img})["img_lab"]
    np.testing.assert_allclose(got[0, :, 1, 2], lab_ref(img[0, ::-1, 1, 2]), atol=5e-4)
    xyz_model = load_from_text(net(LAYER.format(src=0, dst=2), inputs={"img": img.shape}))
    y = xyz_model.run({"img": img})["img_lab"]
    assert y.shape == (1, 3, 2, 3) and 0 <= y.min() and y.max() < 1.1


def test_other_conversions_and_channel_counts_are_refused():
    with pytest.raises(CaffeqError, match="converts BGR or RGB to XYZ or Lab"):
        load_from_text(net(LAYER.format(src=3, dst=0), inputs={"img": (1, 3, 2, 2)}))
    with pytest.raises(CaffeqError, match="3-channel images"):
        load_from_text(net(LAYER.format(src=0, dst=3), inputs={"img": (1, 4, 2, 2)}))
