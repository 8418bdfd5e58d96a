"""jialinwu17/caffe's ResidualROIPooling and roi_pooling_param Resize (caffeq/layers/jialinwu_rfcn.py) against
loops written here from its residual_roi_pooling_layer.cu and resize_layer.cu kernels, in torch, onnxruntime
and model.py."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def residual_ref(data, mask, groups, masks):
    n, _, h, w = data.shape
    out = np.zeros((n, groups, masks, 1))
    for i in range(n):
        for m in range(groups):
            for k in range(masks):
                total = 0.0
                for y in range(h):
                    for x in range(w):
                        total += float(data[i, m * masks + k, y, x]) * (1.0 + float(mask[i, k, y, x]))
                out[i, m, k, 0] = total / h / w
    return out.astype(F)


def resize_ref(img, ph_out, pw_out):
    """resize_layer.cu's ROIPoolForward: the bin's corner (ph H / PH, pw W / PW), the row and column
    pairs clamped to [1, size - 1], blended with weights that may leave [0, 1] at the borders."""
    n, c, h, w = img.shape
    bin_h, bin_w = F(h) / F(ph_out), F(w) / F(pw_out)
    out = np.zeros((n, c, ph_out, pw_out))
    for ph in range(ph_out):
        y = F(ph * bin_h)
        hend = int(min(max(math.ceil(float(y) - 0.5), 1), h - 1))
        u = float(F(y - F(hend - 1) - F(0.5)))
        for pw in range(pw_out):
            x = F(pw * bin_w)
            wend = int(min(max(math.ceil(float(x) - 0.5), 1), w - 1))
            v = float(F(x - F(wend - 1) - F(0.5)))
            out[:, :, ph, pw] = ((1 - u) * (1 - v) * img[:, :, hend - 1, wend - 1] + (1 - u) * v * img[:, :, hend - 1, wend]
                                 + u * (1 - v) * img[:, :, hend, wend - 1] + u * v * img[:, :, hend, wend])
    return out.astype(F)


def test_residual_roi_pooling_averages_data_times_one_plus_mask(tmp_path):
    n, groups, masks, h, w = 2, 3, 4, 3, 5
    text = net('layer { name: "p" type: "ResidualROIPooling" bottom: "d" bottom: "m" top: "o" '
               f'softroi_pooling_param {{ output_dim: {groups} mask_num: {masks} }} }}',
               inputs={"d": (n, groups * masks, h, w), "m": (n, masks, h, w)})
    model = load_from_text(text)
    d = rng(1).standard_normal((n, groups * masks, h, w)).astype(F)
    m = rng(2).uniform(0, 1, (n, masks, h, w)).astype(F)
    assert model.blob_shapes["o"] == (n, groups, masks, 1)
    check_everywhere(model, {"d": d, "m": m}, {"o": residual_ref(d, m, groups, masks)}, tmp_path,
                     atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("params, mask, message", [
    ("output_dim: 3", (2, 4, 3, 5), "output_dim and mask_num, both > 0"),
    ("output_dim: 3 mask_num: 4", (2, 3, 3, 5), r"\(N, 4, H, W\) mask"),
    ("output_dim: 2 mask_num: 4", (2, 4, 3, 5), "4 = 8 channels"),
])
def test_residual_roi_pooling_refusals(params, mask, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net('layer { name: "p" type: "ResidualROIPooling" bottom: "d" bottom: "m" top: "o" '
                           f'softroi_pooling_param {{ {params} }} }}', inputs={"d": (2, 12, 3, 5), "m": mask}))


@pytest.mark.parametrize("shape, out", [((2, 3, 7, 10), (4, 6)), ((1, 2, 5, 4), (9, 7)), ((1, 1, 2, 3), (3, 3))])
def test_roi_pooling_param_resize_extrapolates_at_the_borders(shape, out, tmp_path):
    text = net('layer { name: "r" type: "Resize" bottom: "x" top: "o" '
               f'roi_pooling_param {{ pooled_h: {out[0]} pooled_w: {out[1]} spatial_scale: 0.0625 }} }}',
               inputs={"x": shape})
    model = load_from_text(text)
    x = rng(4).standard_normal(shape).astype(F)
    want = resize_ref(x, *out)
    # the first row is 1.5 I[0] - 0.5 I[1]: outside the two rows' range, as the fork's clamp makes it
    np.testing.assert_allclose(want[:, :, 0, 0], 1.5 * (1.5 * x[:, :, 0, 0] - 0.5 * x[:, :, 0, 1])
                               - 0.5 * (1.5 * x[:, :, 1, 0] - 0.5 * x[:, :, 1, 1]), rtol=1e-5, atol=1e-6)
    assert model.blob_shapes["o"] == shape[:2] + out
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_roi_pooling_param_resize_refuses_a_side_of_one():
    with pytest.raises(LayerError, match="read outside it"):
        load_from_text(net('layer { name: "r" type: "Resize" bottom: "x" top: "o" '
                           'roi_pooling_param { pooled_h: 3 pooled_w: 3 } }', inputs={"x": (1, 1, 1, 4)}))


SEED_POOL = ('layer { name: "wbc" type: "RegionPooling" bottom: "features" bottom: "seeds" bottom: "offsets" '
             'bottom: "weights" top: "wbc" region_pooling_param { num_features: 4 num_samples: 3 '
             'num_rfcn_regions: 5 num_regions: 2 } }')


def test_box_cls_regs_four_bottom_region_pooling_is_sized_not_run():
    # jialinwu17/box_cls_reg's train_aware.prototxt: top (M, num_regions, num_samples, num_features)
    from caffeq.errors import CaffeqError
    shapes = {"features": (1, 20, 6, 7), "seeds": (6, 2), "offsets": (6, 12), "weights": (6, 2, 3, 5)}
    model = load_from_text(net(SEED_POOL, inputs=shapes))
    assert model.blob_shapes["wbc"] == (6, 2, 3, 4)
    with pytest.raises(CaffeqError, match="box_cls_reg's seed-point pooling, a GPU-only training layer"):
        model.run({k: np.zeros(s, np.float32) for k, s in shapes.items()})
    with pytest.raises(LayerError, match="the features have 21 channels; num_features x num_rfcn_regions is 4 x 5"):
        load_from_text(net(SEED_POOL, inputs={**shapes, "features": (1, 21, 6, 7)}))
    with pytest.raises(LayerError, match="seed points \\(bottom 1\\) must be \\(M, 2\\), got \\[6\\]"):
        load_from_text(net(SEED_POOL, inputs={**shapes, "seeds": (6,)}))
