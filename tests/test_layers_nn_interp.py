"""xh-liu/HydraPlus-Net's NNInterp (2b056d3 nninterp_layer.cpp Forward_cpu): output (r, c) reads row
min(int(r * scale_h), H - 1), scale_h the float32 H_in / H_out, element by element."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def nn_interp_ref(x, ho, wo):
    n, c, h, w = x.shape
    sh, sw = F(F(h) / F(ho)), F(F(w) / F(wo))
    out = np.zeros((n, c, ho, wo), F)
    for r in range(ho):
        for q in range(wo):
            out[:, :, r, q] = x[:, :, min(int(F(r) * sh), h - 1), min(int(F(q) * sw), w - 1)]
    return out


@pytest.mark.parametrize("param, size", [("height: 7 width: 11", (7, 11)), ("height: 2 width: 3", (2, 3)),
                                          ("zoom_factor: 3", (19, 16)), ("shrink_factor: 2", (4, 3))])
def test_nearest_resize(param, size, tmp_path):
    x = rng(1).standard_normal((2, 3, 7, 6)).astype(F)
    model = load_from_text(net(f'layer {{ name: "i" type: "NNInterp" bottom: "x" top: "o" nninterp_param {{ {param} }} }}',
                               inputs={"x": x.shape}))
    assert model.blob_shapes["o"][2:] == size
    check_everywhere(model, {"x": x}, {"o": nn_interp_ref(x, *size)}, tmp_path)


@pytest.mark.parametrize("param", ["height: 3", "zoom_factor: 2 height: 3 width: 3", "shrink_factor: 0"])
def test_refusals(param):
    with pytest.raises(LayerError, match="nninterp_param"):
        load_from_text(net(f'layer {{ name: "i" type: "NNInterp" bottom: "x" top: "o" nninterp_param {{ {param} }} }}',
                           inputs={"x": (1, 1, 4, 4)}))


def test_rows_follow_the_float32_scale(tmp_path):
    # 26 -> 22: row 11 reads int(11 * float32(26 / 22)) = int(12.999999) = 12, where float64 gives 13
    x = rng(2).standard_normal((2, 3, 26, 30)).astype(F)
    sh64 = [min(int(r * 26 / 22), 25) for r in range(22)]
    want = nn_interp_ref(x, 22, 22)
    assert not np.array_equal(want, x[:, :, sh64][:, :, :, [min(int(q * 30 / 22), 29) for q in range(22)]])
    model = load_from_text(net('layer { name: "i" type: "NNInterp" bottom: "x" top: "o" nninterp_param { height: 22 width: 22 } }',
                               inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)


@pytest.mark.parametrize("factor, shape, size", [(2, (7, 6), (14, 12)), (0.7, (10, 6), (7, 4)), (1.1, (2, 5), (2, 5)),
                                                 (0.1, (22, 30), (2, 3))])
def test_nart_scale_factor(factor, shape, size, tmp_path):
    # ModelTC/NART python/tests/model/test.prototxt: nninterp_param { scale_factor: 2 }.  NART sizes it as its
    # Upsample.infer_shape does, floor(float32(float32(s) * h)): 0.7 * 10 is 7.0000005 in float32, not 6.99999...
    # in float64; its nearest interp then reads rows by HydraPlus's rule (1.1 on 2 rows reads rows 0 and 1,
    # where floor(r / s) would read row 0 twice)
    x = rng(3).standard_normal((2, 3) + shape).astype(F)
    model = load_from_text(net(f'layer {{ name: "i" type: "NNInterp" bottom: "x" top: "o" '
                               f'nninterp_param {{ scale_factor: {factor} }} }}', inputs={"x": x.shape}))
    assert model.blob_shapes["o"][2:] == size
    check_everywhere(model, {"x": x}, {"o": nn_interp_ref(x, *size)}, tmp_path)


@pytest.mark.parametrize("param", ["scale_factor: 0", "scale_factor: -2", "scale_factor: 2 height: 3 width: 3",
                                   "scale_factor: 2 pad_beg: 1"])
def test_nart_refusals(param):
    with pytest.raises(LayerError, match="nninterp_param"):
        load_from_text(net(f'layer {{ name: "i" type: "NNInterp" bottom: "x" top: "o" nninterp_param {{ {param} }} }}',
                           inputs={"x": (1, 1, 4, 4)}))
