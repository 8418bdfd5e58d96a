"""Ravi-Garg/Unsupervised_Depth_Estimation's Warping against its GPU kernel's formula
(warping_layer.cu WarpingForward at 6f75cb9), written out per pixel in float32, through torch,
onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import backend_outputs, check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def ref_warping(image, u, v):
    n, c, h, w = image.shape
    uf, vf = u.reshape(-1), v.reshape(-1)     # read by pixel index, whatever their channels
    out = np.zeros_like(image)
    for i in range(n):
        for r in range(h):
            for q in range(w):
                index = (i * h + r) * w + q
                xx, yy = f32(q) + uf[index], f32(r) + vf[index]
                x1 = 0 if np.isnan(xx) else int(np.floor(xx))
                y1 = 0 if np.isnan(yy) else int(np.floor(yy))
                y2 = 0 if np.isnan(yy) else int(f32(yy + f32(1)))     # C++: int y2 = yy + 1
                x2 = x1 + 1
                if x1 < 0 or x2 > w - 1 or y1 < 0 or y1 > h - 1 or y2 < 0 or y2 > h - 1:
                    continue
                img = image[i]
                a = f32(x2 - xx) * img[:, y1, x1] + f32(xx - x1) * img[:, y1, x2]
                b = f32(x2 - xx) * img[:, y2, x1] + f32(xx - x1) * img[:, y2, x2]
                out[i, :, r, q] = f32(y2 - yy) * a + f32(yy - y1) * b
    return out


def warping_net(n, c, h, w, flow_channels=1):
    layer = 'layer { name: "backwarp" type: "Warping" bottom: "im" bottom: "u" bottom: "v" top: "warped" }'
    return net(layer, inputs={"im": (n, c, h, w), "u": (n, flow_channels, h, w), "v": (n, flow_channels, h, w)})


def check(model, feeds, tmp_path):
    ref = ref_warping(feeds["im"], feeds["u"], feeds["v"])
    for backend, got in backend_outputs(model, feeds, tmp_path, top="warped").items():
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5, err_msg=backend)


@pytest.mark.parametrize("n, c, h, w", [(2, 3, 5, 7), (1, 1, 6, 4), (2, 2, 3, 9)])
def test_warping_matches_the_kernel(n, c, h, w, tmp_path):
    rng = np.random.default_rng(h * w)
    feeds = {"im": rng.standard_normal((n, c, h, w)).astype(f32),
             "u": (rng.standard_normal((n, 1, h, w)) * 2).astype(f32),
             "v": (rng.standard_normal((n, 1, h, w)) * 2).astype(f32)}
    feeds["u"][0, 0, 0, :2] = [0.0, -1.0]        # on the grid, and one left of it
    feeds["v"][0, 0, 1, :3] = [0.0, 1.0, -0.5]
    check(load_from_text(warping_net(n, c, h, w)), feeds, tmp_path)


def test_warping_edges_nan_and_truncated_far_row(tmp_path):
    n, c, h, w = 1, 2, 4, 5
    feeds = {"im": np.arange(n * c * h * w, dtype=f32).reshape(n, c, h, w) / 7,
             "u": np.zeros((n, 1, h, w), f32), "v": np.zeros((n, 1, h, w), f32)}
    feeds["u"][0, 0, 0, 0] = np.nan                 # index 0 and NaN weights: NaN
    feeds["v"][0, 0, 1, 1] = f32(1) - f32(2 ** -23)   # yy = 2 - 2^-23: y1 = 1, but yy + 1 rounds to 3
    feeds["v"][0, 0, 2, 2] = f32(-2.5)              # above the image: 0
    feeds["u"][0, 0, 3, 3] = f32(0.999)             # x2 past the last column: 0
    ref = ref_warping(feeds["im"], feeds["u"], feeds["v"])
    assert np.isnan(ref[0, :, 0, 0]).all() and (ref[0, :, 2, 2] == 0).all() and (ref[0, :, 3, 3] == 0).all()
    yy = f32(1) + feeds["v"][0, 0, 1, 1]
    floor_plus_one = (f32(2) - yy) * feeds["im"][0, :, 1, 1] + (yy - f32(1)) * feeds["im"][0, :, 2, 1]
    assert not np.allclose(ref[0, :, 1, 1], floor_plus_one)      # the kernel's y2 = 3 shows
    # the last column always reads 0: x2 = W lies outside
    assert (ref[0, :, :, w - 1] == 0).all()
    check(load_from_text(warping_net(n, c, h, w)), feeds, tmp_path)


def test_warping_reads_multichannel_flows_by_pixel_index(tmp_path):
    n, c, h, w = 2, 3, 4, 6
    rng = np.random.default_rng(9)
    feeds = {"im": rng.standard_normal((n, c, h, w)).astype(f32),
             "u": rng.standard_normal((n, 2, h, w)).astype(f32), "v": rng.standard_normal((n, 2, h, w)).astype(f32)}
    check(load_from_text(warping_net(n, c, h, w, flow_channels=2)), feeds, tmp_path)


def test_warping_checks_its_bottoms():
    with pytest.raises(LayerError, match=r"Warping's vertical flow must have the image's num, height and width"):
        load_from_text(net('layer { name: "b" type: "Warping" bottom: "im" bottom: "u" bottom: "v" top: "o" }',
                           inputs={"im": (1, 3, 4, 5), "u": (1, 1, 4, 5), "v": (1, 1, 4, 6)}))
    with pytest.raises(LayerError, match=r"Warping takes 3 bottoms"):
        load_from_text(net('layer { name: "b" type: "Warping" bottom: "im" top: "o" }', inputs={"im": (1, 3, 4, 5)}))
    # two bottoms are lxx1991/caffe_mpi's Warping (image, 2-channel flow; mpi_forks.py)
    with pytest.raises(LayerError, match=r"Warping \(lxx1991's\) takes an image .* and a flow \(N, 2, H, W\)"):
        load_from_text(net('layer { name: "b" type: "Warping" bottom: "im" bottom: "u" top: "o" }',
                           inputs={"im": (1, 3, 4, 5), "u": (1, 1, 4, 5)}))


# ---- Mirror (leonzfa/iResNet mirror_layer.cu MirrorForward) ------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7)])
def test_mirror_reverses_each_row(tmp_path, shape):
    """The kernel's index map, top (n c H + c H + h) W + (W - 1 - w) = bottom index of w, over the legacy
    num / channels / height / width (a 2-axis blob is (N, C, 1, 1): unchanged)."""
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    n, c, h, w = shape + (1,) * (4 - len(shape))
    flat, want = x.reshape(-1), np.empty(x.size, np.float32)
    for i in range(x.size):
        ww, hh, cc, nn = i % w, (i // w) % h, (i // w // h) % c, i // w // h // c
        want[(nn * c * h + cc * h + hh) * w + (w - 1 - ww)] = flat[i]
    model = load_from_text(net('layer { name: "m" type: "Mirror" bottom: "x" top: "y" }', inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"y": want.reshape(shape)}, tmp_path)
