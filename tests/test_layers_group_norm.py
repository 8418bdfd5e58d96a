"""blankWorld/GroupNorm-caffe's GroupNorm (3a27dca group_norm_layer.cu), against a numpy loop written
from its Forward_gpu: per item and group, the mean (gemv), the squared deviations' mean, + eps, sqrt,
divide; in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def group_norm_ref(x, groups, eps):
    n, c = x.shape[0], x.shape[1]
    y = np.zeros(x.shape, np.float64)
    per = c // groups
    for i in range(n):
        for g in range(groups):
            block = x[i, g * per:(g + 1) * per].astype(np.float64)
            mean = block.mean()
            var = ((block - mean) ** 2).mean()
            y[i, g * per:(g + 1) * per] = (block - mean) / np.sqrt(var + np.float32(eps))
    return y


@pytest.mark.parametrize("shape, param, groups, eps", [
    ((2, 6, 4, 5), "group_num: 3", 3, 1e-5),
    ((2, 8, 3, 2, 5), "group_num: 2 eps: 0.1", 2, 0.1),    # N-D, and an eps large enough to show
    ((3, 32, 2, 3), "", 32, 1e-5),                         # the default of 32 groups: one channel each
])
def test_group_norm_matches_the_forks_kernel(shape, param, groups, eps, tmp_path):
    x = (rng(1).standard_normal(shape) * 3 + 1).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "gn" type: "GroupNorm" bottom: "x" top: "y" group_norm_param {{ {param} }} }}',
                               inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"y": group_norm_ref(x, groups, eps)}, tmp_path, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("param, shape, msg", [
    ("group_num: 4", (1, 6, 3, 3), "must divide the 6 channels"),
    ("group_num: 0", (1, 6, 3, 3), "group_num must be >= 1"),
    ("group_num: 2", (6,), "needs \\(N, C, ...\\)"),
])
def test_group_norm_refuses_what_the_fork_cannot_split(param, shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "gn" type: "GroupNorm" bottom: "x" top: "y" group_norm_param {{ {param} }} }}',
                           inputs={"x": shape}))
