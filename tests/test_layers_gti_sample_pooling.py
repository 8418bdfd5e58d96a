"""GTI's sample pooling (jack16888/caffessd 55e1f12 pooling_layer.cu SamplePoolForward): pooling_param.sample
on MAX pooling takes each window's first element, its start clipped at 0."""
import numpy as np
import pytest
from conftest import check_everywhere, pool_net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def sample_pool_ref(x, kh, kw, sh, sw, ph, pw, ceil=True):
    """The fork's GPU kernel: top[n, c, i, j] = x[n, c, max(i sh - ph, 0), max(j sw - pw, 0)], over Caffe's
    pooled size (ceil by default, the last window starting inside the image plus its pad)."""
    n, c, h, w = x.shape

    def size(length, k, s, p):
        rounded = -(-(length + 2 * p - k) // s) if ceil else (length + 2 * p - k) // s
        out = rounded + 1
        if p and (out - 1) * s >= length + p:
            out -= 1
        return out

    oh, ow = size(h, kh, sh, ph), size(w, kw, sw, pw)
    top = np.empty((n, c, oh, ow), F)
    for i in range(oh):
        for j in range(ow):
            top[:, :, i, j] = x[:, :, max(i * sh - ph, 0), max(j * sw - pw, 0)]
    return top


@pytest.mark.parametrize("params, geometry", [
    ("kernel_size: 2 stride: 2", (2, 2, 2, 2, 0, 0)),
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 1", (3, 2, 2, 3, 1, 1)),
])
def test_sample_pooling_takes_each_windows_first_element(params, geometry, tmp_path):
    shape = (2, 3, 7, 10)
    model = load_from_text(pool_net(shape, f"pool: MAX {params} sample: true"))
    x = rng(3).standard_normal(shape).astype(F)
    want = sample_pool_ref(x, *geometry)
    assert model.run({"x": x})["p"].shape == want.shape
    check_everywhere(model, {"x": x}, {"p": want}, tmp_path)


def test_sample_flag_on_ave_pooling_is_plain_ave():
    # the fork reads the flag in its MAX branch only
    shape = (2, 3, 5, 6)
    x = rng(4).standard_normal(shape).astype(F)
    plain = load_from_text(pool_net(shape, "pool: AVE kernel_size: 2 stride: 2")).run({"x": x})["p"]
    flagged = load_from_text(pool_net(shape, "pool: AVE kernel_size: 2 stride: 2 sample: true")).run({"x": x})["p"]
    assert np.array_equal(flagged, plain)


def test_sample_pooling_refuses_a_mask_top():
    with pytest.raises(CaffeqError, match="sample"):
        load_from_text(pool_net((1, 1, 4, 4), "pool: MAX kernel_size: 2 stride: 2 sample: true", tops=2))
