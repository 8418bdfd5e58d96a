"""shaoxiaohu/Face_Alignment_Two_Stage_Re-initialization ccd26fe: SubsamplePooling (subsample_pooling_layer.cpp)
and its PointTransformer (point_transformer_layer.cpp: interleaved landmarks, no epsilon, SIMILAR)."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def subsample_ref(x, out):
    """The fork's Forward_cpu loop: float32 bin sizes, floor / ceil bounds clipped, sum then divide."""
    n, c, h, w = x.shape
    bh, bw = F(h) / F(out), F(w) / F(out)       # output_W_ is set from output_h()
    top = np.zeros((n, c, out, out), F)
    for ph in range(out):
        for pw in range(out):
            hs, he = min(int(math.floor(F(ph) * bh)), h), min(int(math.ceil(F(ph + 1) * bh)), h)
            ws, we = min(int(math.floor(F(pw) * bw)), w), min(int(math.ceil(F(pw + 1) * bw)), w)
            acc = np.zeros((n, c), F)
            for r in range(hs, he):
                for s in range(ws, we):
                    acc = acc + x[:, :, r, s]
            top[:, :, ph, pw] = acc / F((he - hs) * (we - ws))
    return top


def subsample_net(shape, params):
    return net(f'layer {{ name: "p" type: "SubsamplePooling" bottom: "x" top: "p" '
               f'subsample_pooling_param {{ {params} }} }}', inputs={"x": shape})


@pytest.mark.parametrize("shape, params, out", [
    ((2, 3, 7, 10), "output_H: 3 output_W: 3", 3),     # overlapping bins on both axes
    ((2, 2, 9, 5), "output_H: 4 output_W: 2", 4),      # output_W ignored: 4 x 4
    ((1, 3, 5, 11), "output_H: 7", 7),                 # more bins than rows
    ((2, 1, 120, 90), "", 60),                         # the default 60
    ((2, 3, 14, 28), "output_H: 26", 26),              # float32 bounds unlike float64's; last row bin clipped
])
def test_subsample_pooling_matches_the_forks_loop(shape, params, out, tmp_path):
    model = load_from_text(subsample_net(shape, params))
    x = rng(1).standard_normal(shape).astype(F)
    want = subsample_ref(x, out)
    assert want.shape == (shape[0], shape[1], out, out)
    check_everywhere(model, {"x": x}, {"p": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_subsample_pooling_uses_float32_bin_bounds():
    from caffeq.layers.face_align_reinit import subsample_bins
    assert subsample_bins(7, 3) == [(0, 3), (2, 5), (4, 7)]
    assert subsample_bins(448, 60)[-1] == (440, 448)
    # float32(14 / 26) x 13 is 7.0000005 (float64: 7.0): ceil gives 8, so row bin 12 is [6, 8), not [6, 7)
    assert subsample_bins(14, 26)[12] == (6, 8)
    assert subsample_bins(28, 26)[12] == (12, 15)
    # float32(14 / 26) x 26 is 14.000001: ceil 15, clipped to the image's 14 (the divisor counts 1 row)
    assert subsample_bins(14, 26)[-1] == (13, 14)
    assert subsample_bins(7, 13)[-1] == (6, 7)


def test_subsample_pooling_refuses_a_zero_size():
    with pytest.raises(CaffeqError, match="output_H"):
        load_from_text(subsample_net((1, 1, 4, 4), "output_H: 0"))


def interleaved_ref(pts, theta, kind, inverse):
    """point_transformer_layer.cpp's Forward_cpu: pairs (x, y) in the first 2 (C // 2) values, float32."""
    n = pts.shape[0]
    flat = pts.reshape(n, -1)
    p = pts.shape[1] // 2
    t = theta.reshape(n, -1)
    out = np.zeros_like(flat)
    for i in range(n):
        a = [F(v) for v in t[i]]
        for k in range(p):
            x, y = F(flat[i, 2 * k]), F(flat[i, 2 * k + 1])
            if kind == "CROP" and inverse:
                nx, ny = x * a[2] + a[3], y * a[0] + a[1]
            elif kind == "CROP":
                nx, ny = (x - a[3]) / a[2], (y - a[1]) / a[0]
            elif kind == "AFFINE" and inverse:
                nx, ny = y * a[3] + x * a[4] + a[5], y * a[0] + x * a[1] + a[2]
            elif kind == "AFFINE":
                nx = (x * a[0] - y * a[3] - a[0] * a[5] + a[2] * a[3]) / (a[0] * a[4] - a[1] * a[3])
                ny = (x * a[1] - y * a[4] - a[1] * a[5] + a[2] * a[4]) / (a[1] * a[3] - a[0] * a[4])
            elif inverse:
                nx, ny = -y * a[1] + x * a[0] + a[3], y * a[0] + x * a[1] + a[2]
            else:
                nx = (x * a[0] + y * a[1] - a[0] * a[3] - a[2] * a[1]) / (a[0] * a[0] + a[1] * a[1])
                ny = (x * a[1] - y * a[0] - a[1] * a[3] + a[2] * a[0]) / (-a[1] * a[1] - a[0] * a[0])
            out[i, 2 * k], out[i, 2 * k + 1] = nx, ny
    return out.reshape(pts.shape)


def pt_net(pts_shape, theta_shape, params):
    return net(f'layer {{ name: "t" type: "PointTransformer" bottom: "pts" bottom: "theta" top: "t" '
               f'pt_param {{ {params} }} }}', inputs={"pts": pts_shape, "theta": theta_shape})


@pytest.mark.parametrize("kind", ["CROP", "AFFINE", "SIMILAR"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("pts_shape, theta_shape", [
    ((2, 10), (2, 6)),
    ((2, 7, 1, 2), (2, 7, 1, 1)),    # odd channels and extra values: only the first 2 (7 // 2) move
])
def test_point_transformer_interleaved(kind, inverse, pts_shape, theta_shape, tmp_path):
    model = load_from_text(pt_net(pts_shape, theta_shape,
                                  f"transform_type: {kind} inv_trans: {str(inverse).lower()}"))
    g = rng(5)
    pts = g.uniform(-1, 1, pts_shape).astype(F)
    theta = (g.uniform(0.5, 1.5, theta_shape) * g.choice([-1, 1], theta_shape)).astype(F)
    want = interleaved_ref(pts, theta, kind, inverse)
    assert model.run({"pts": pts, "theta": theta})["t"].shape == pts_shape
    check_everywhere(model, {"pts": pts, "theta": theta}, {"t": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_pdc_point_transformer_is_still_pdcs(tmp_path):
    # in_width / in_height mark ljn114514/PDC-ICCV2017's layer: x values then y values, top (N, 2P, 1, 1)
    model = load_from_text(pt_net((2, 6), (2, 4), "in_width: 8 in_height: 8 inv_trans: true"))
    pts = np.arange(12, dtype=F).reshape(2, 6)
    theta = np.array([[2, 1, 3, 5]] * 2, F)
    got = model.run({"pts": pts, "theta": theta})["t"]
    assert got.shape == (2, 6, 1, 1)
    assert np.array_equal(got[0].ravel(), [5, 8, 11, 7, 9, 11])


@pytest.mark.parametrize("params", ["transform_type: SIMILAR inv_trans: true", 'sampler_type: "bilinear"'])
def test_point_transformer_similar_or_sampler_type_is_this_forks(params, tmp_path):
    # PDC's PointTransformerParameter has neither SIMILAR nor sampler_type: this fork's layer, even with in_width
    model = load_from_text(pt_net((2, 6), (2, 4), f"in_width: 8 in_height: 8 {params}"))
    g = rng(7)
    pts, theta = g.uniform(-1, 1, (2, 6)).astype(F), g.uniform(0.5, 1.5, (2, 4)).astype(F)
    want = interleaved_ref(pts, theta, "SIMILAR" if "SIMILAR" in params else "CROP", "inv_trans" in params)
    check_everywhere(model, {"pts": pts, "theta": theta}, {"t": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_point_transformer_needs_enough_parameters():
    with pytest.raises(CaffeqError, match="AFFINE reads 6 parameters"):
        load_from_text(pt_net((1, 4), (1, 4), "transform_type: AFFINE"))
