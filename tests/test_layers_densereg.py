"""DenseReg's CombineRegressionsLayer (both modules), natively.  The reference is the modules'
forward run as numpy on one image (their broadcasting works only for N = 1), float64 stored as
float32; torch, onnxruntime and the generated model.py must give it."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def module_forward(horizontal, vertical, horz_regress, vert_regress, human):
    """CombineRegressions(Human).py's forward, line for line, on numpy arrays."""
    horz_reg = np.zeros(horizontal.shape)
    vert_reg = np.zeros(horizontal.shape)
    num_dims = horz_regress.shape[1]
    for j in range(num_dims):
        if j > 0:
            horz_reg = horz_reg + horz_regress[:, j, :, :] * (horizontal == j)
            vert_reg = vert_reg + vert_regress[:, j, :, :] * (vertical == j)
    if human:
        horz_reg[horz_reg < 0] = 0
        vert_reg[vert_reg < 0] = 0
        horz_reg[horz_reg > 1] = 1
        vert_reg[vert_reg > 1] = 1
    else:
        horz_reg = ((horizontal + horz_reg) - 1) / (num_dims - 1)
        vert_reg = ((vertical + vert_reg) - 1) / (num_dims - 1)
        horz_reg[horz_reg < 0] = -1
        vert_reg[vert_reg < 0] = -1
    return horz_reg.astype(np.float32), vert_reg.astype(np.float32)


def text(module, n, d, h=5, w=7, residual_w=None):
    rw = w if residual_w is None else residual_w
    shapes = {"hi": (n, 1, h, w), "vi": (n, 1, h, w), "hr": (n, d, h, rw), "vr": (n, d, h, rw)}
    return net(f'layer {{ name: "combine" type: "Python" bottom: "hi" bottom: "vi" bottom: "hr" bottom: "vr" '
               f'top: "H_Out" top: "V_Out" python_param {{ module: "{module}" layer: "CombineRegressionsLayer" }} }}',
               inputs=shapes)


def feeds(seed, n, d, h=5, w=7):
    r = rng(seed)
    hi = r.integers(0, d, (n, 1, h, w)).astype(np.float32)
    hi[:, :, 0, :2] = 0     # background bins, whose faces' value is -1
    return {"hi": hi,
            "vi": r.integers(0, d, (n, 1, h, w)).astype(np.float32),
            "hr": (r.random((n, d, h, w)) * 1.6 - 0.3).astype(np.float32),
            "vr": (r.random((n, d, h, w)) * 1.6 - 0.3).astype(np.float32)}


@pytest.mark.parametrize("module, human", [("CombineRegressions", False), ("CombineRegressionsHuman", True)])
@pytest.mark.parametrize("d", [5, 26])
def test_combine_regressions_follows_the_module(module, human, d, tmp_path):
    x = feeds(d, 1, d)
    want_h, want_v = module_forward(x["hi"], x["vi"], x["hr"], x["vr"], human)
    if not human:
        assert (want_h == -1).any() and (want_h > 0).any()
    else:
        assert (want_h == 0).any() and (want_h == 1).any() and ((want_h > 0) & (want_h < 1)).any()
    model = load_from_text(text(module, 1, d))
    check_everywhere(model, x, {"H_Out": want_h, "V_Out": want_v}, tmp_path)


def test_every_image_of_a_batch_is_combined_alike():
    x = feeds(3, 2, 6)
    model = load_from_text(text("CombineRegressions", 2, 6))
    got = model.run(x)
    for i in range(2):
        one = {k: v[i:i + 1] for k, v in x.items()}
        want_h, want_v = module_forward(one["hi"], one["vi"], one["hr"], one["vr"], False)
        np.testing.assert_array_equal(got["H_Out"][i:i + 1], want_h)
        np.testing.assert_array_equal(got["V_Out"][i:i + 1], want_v)


def test_shapes_are_checked():
    with pytest.raises(LayerError, match="residuals must be"):
        load_from_text(text("CombineRegressionsHuman", 1, 4, residual_w=6))
