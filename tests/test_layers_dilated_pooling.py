"""naibaf7/caffe's dilated Pooling (PoolingParameter.dilation, axis).  References are numpy loops written
from the fork's Reshape (pooling_layer.cpp: ceil((size + 2p - ((k-1)*d + 1)) / s) + 1, a last window
starting at or past size + p dropped on an axis whose own pad is > 0) and its GPU kernels
(pooling_layer.cu MaxPoolForwardSK / AvePoolForwardSK / MaxPoolForwardND, libdnn_pool.cpp): MAX over the
taps o*s - p + j*d inside the input from -FLT_MAX with a strict `>`; AVE adds the taps inside the input
and divides by the taps before size + p, counted per axis and multiplied."""
import itertools
import math

import numpy as np
import pytest
from conftest import check_everywhere, pool_net, repeated, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

FLT_MAX = float(np.finfo(np.float32).max)


def fork_out(n, k, s, p, d):
    out = math.ceil((n + 2 * p - ((k - 1) * d + 1)) / s) + 1
    if p > 0 and (out - 1) * s >= n + p:
        out -= 1
    return out


def fork_pool_ref(x, method, kernel, stride, pad, dilation):
    sizes = x.shape[2:]
    outs = [fork_out(*a) for a in zip(sizes, kernel, stride, pad, dilation)]
    y = np.zeros(x.shape[:2] + tuple(outs), np.float32)
    for n, c in itertools.product(range(x.shape[0]), range(x.shape[1])):
        plane = x[n, c]
        for index in itertools.product(*[range(o) for o in outs]):
            starts = [o * s - p for o, s, p in zip(index, stride, pad)]
            taps = [[a + j * d for j in range(k)] for a, k, d in zip(starts, kernel, dilation)]
            if method == "MAX":
                best = np.float32(-FLT_MAX)
                for cell in itertools.product(*taps):
                    if all(0 <= v < m for v, m in zip(cell, sizes)) and plane[cell] > best:
                        best = plane[cell]
                y[(n, c) + index] = best
            else:
                total, count = np.float32(0), 0
                for cell in itertools.product(*taps):
                    if all(v < m + p for v, m, p in zip(cell, sizes, pad)):
                        count += 1
                    if all(0 <= v < m for v, m in zip(cell, sizes)):
                        total = np.float32(total + plane[cell])
                y[(n, c) + index] = total / np.float32(count)
    return y


def params_text(method, kernel, stride, pad, dilation):
    return " ".join([f"pool: {method}", repeated("kernel_size", kernel), repeated("stride", stride),
                     repeated("pad", pad), repeated("dilation", dilation)])


CASES_2D = [
    ("MAX", (3, 2), (1, 1), (0, 0), (2, 3)),
    ("MAX", (3, 3), (2, 1), (1, 2), (2, 2)),
    ("MAX", (2, 3), (3, 2), (2, 0), (3, 2)),    # pad as wide as the kernel on H (the fork has no check)
    ("MAX", (3, 2), (2, 3), (0, 1), (3, 1)),    # W: per-axis pad rule; H: ceil keeps a window past the end
    ("AVE", (3, 2), (1, 1), (0, 0), (2, 3)),
    ("AVE", (3, 3), (2, 1), (1, 2), (2, 2)),
    ("AVE", (2, 3), (2, 2), (1, 3), (3, 2)),
    ("AVE", (3, 2), (3, 2), (2, 1), (2, 3)),    # overhang past size + pad is not counted
]


@pytest.mark.parametrize("method, kernel, stride, pad, dilation", CASES_2D)
def test_dilated_2d_pooling_against_the_loops(method, kernel, stride, pad, dilation, tmp_path):
    x = rng(1).standard_normal((2, 3, 11, 9)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, params_text(method, kernel, stride, pad, dilation)))
    ref = fork_pool_ref(x, method, kernel, stride, pad, dilation)
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, 1e-6, 1e-6)


def test_dilated_ave_pooling_in_torch_is_bit_exact():
    """The taps are added in the fork's row-major order, then divided once: the same float32 bits."""
    x = rng(2).standard_normal((2, 3, 11, 9)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, params_text("AVE", (3, 3), (2, 1), (1, 2), (2, 2))))
    got = model.run({"x": x})["p"]
    np.testing.assert_array_equal(got, fork_pool_ref(x, "AVE", (3, 3), (2, 1), (1, 2), (2, 2)))


@pytest.mark.parametrize("method, kernel, stride, pad, dilation", [
    ("MAX", (2, 3, 2), (1, 2, 1), (0, 1, 1), (2, 1, 3)),
    ("MAX", (1, 3, 3), (1, 3, 3), (0, 0, 0), (1, 1, 1)),   # the gunpowder nets' window, dilation 1
    ("AVE", (2, 2, 3), (2, 1, 2), (1, 0, 2), (2, 3, 2)),
])
def test_dilated_3d_pooling_against_the_loops(method, kernel, stride, pad, dilation, tmp_path):
    x = rng(3).standard_normal((1, 2, 6, 8, 7)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, params_text(method, kernel, stride, pad, dilation)))
    ref = fork_pool_ref(x, method, kernel, stride, pad, dilation)
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, 1e-6, 1e-6)


def test_one_dilation_value_applies_to_every_axis(tmp_path):
    x = rng(4).standard_normal((2, 2, 10, 7)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, "pool: MAX kernel_size: 2 stride: 1 dilation: 3"))
    check_everywhere(model, {"x": x}, {"p": fork_pool_ref(x, "MAX", (2, 2), (1, 1), (0, 0), (3, 3))},
                     tmp_path, 0, 0)


@pytest.mark.parametrize("kstride, dilation", [("kstride: 2", (2, 2, 2)), ("kstride: 1 kstride: 2 kstride: 3", (1, 2, 3))])
def test_naibaf7s_2015_kstride_is_the_dilation(kstride, dilation, tmp_path):
    # TuragaLab/PyGreentea's nets (naibaf7/caffe 677e8440): kstride, the dilation's first name
    x = rng(6).standard_normal((1, 2, 7, 8, 9)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, f"pool: MAX kernel_size: 2 stride: 2 pad: 0 {kstride}"))
    ref = fork_pool_ref(x, "MAX", (2, 2, 2), (2, 2, 2), (0, 0, 0), dilation)
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, 0, 0)


def test_kstride_and_dilation_together_are_refused():
    with pytest.raises(LayerError, match="dilation or its old name kstride"):
        load_from_text(pool_net((1, 2, 7, 8), "pool: MAX kernel_size: 2 dilation: 2 kstride: 2"))


def test_a_window_with_no_tap_inside_keeps_minus_flt_max(tmp_path):
    """Stride 3 over extent 6 with a span of 3: ceil keeps a third window whose taps lie past the end."""
    x = rng(5).standard_normal((1, 2, 6, 5)).astype(np.float32)
    x[:, :, :, :2] = -np.inf
    params = params_text("MAX", (2, 1), (4, 1), (0, 0), (2, 1))
    model = load_from_text(pool_net(x.shape, params))
    ref = fork_pool_ref(x, "MAX", (2, 1), (4, 1), (0, 0), (2, 1))
    assert ref.shape[2] == 2 and (ref[:, :, :, :2] == -FLT_MAX).all()
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, 0, 0)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_dilation_one_runs_the_plain_path(method, tmp_path):
    """dilation: 1 (the gunpowder and U-Net files) pools as Caffe's plain layer and exports plainly."""
    x = rng(6).standard_normal((2, 3, 9, 8)).astype(np.float32)
    plain = load_from_text(pool_net(x.shape, f"pool: {method} kernel_size: 3 stride: 2 pad: 1"))
    fork = load_from_text(pool_net(x.shape, f"pool: {method} kernel_size: 3 stride: 2 pad: 1 dilation: 1"))
    assert not fork.layers[-1].attrs["fork_path"]
    np.testing.assert_array_equal(fork.run({"x": x})["p"], plain.run({"x": x})["p"])
    ref = fork_pool_ref(x, method, (3, 3), (2, 2), (1, 1), (1, 1))
    check_everywhere(fork, {"x": x}, {"p": ref}, tmp_path, 1e-6, 1e-6)


def test_dilation_one_keeps_the_forks_per_axis_pad_rule(tmp_path):
    """H has no pad and stride 3 > kernel 1: BVLC drops its last window because W has a pad, the fork
    does not (an empty MAX window, -FLT_MAX)."""
    x = rng(7).standard_normal((1, 2, 8, 6)).astype(np.float32)
    params = params_text("MAX", (1, 3), (3, 2), (0, 1), (1, 1))
    fork = load_from_text(pool_net(x.shape, params))
    bvlc = load_from_text(pool_net(x.shape, "pool: MAX kernel_h: 1 kernel_w: 3 stride_h: 3 stride_w: 2 pad_h: 0 "
                                            "pad_w: 1"))
    ref = fork_pool_ref(x, "MAX", (1, 3), (3, 2), (0, 1), (1, 1))
    assert fork.blob_shapes["p"] == ref.shape == (1, 2, 4, 4)
    assert bvlc.blob_shapes["p"] == (1, 2, 3, 4)
    assert (ref[:, :, 3] == -FLT_MAX).all()
    check_everywhere(fork, {"x": x}, {"p": ref}, tmp_path, 0, 0)


def test_plain_pooling_is_unchanged():
    model = load_from_text(pool_net((1, 2, 8, 6), "pool: MAX kernel_size: 1 kernel_size: 3 stride: 3 stride: 2 "
                                                  "pad: 0 pad: 1"))
    assert model.blob_shapes["p"] == (1, 2, 3, 4)   # BVLC's rule: H drops its window past the end
    assert model.layers[-1].attrs["fork"] is None


def test_dilation_one_with_the_mask_top_runs():
    x = rng(8).standard_normal((1, 2, 6, 5)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, "pool: MAX kernel_size: 2 stride: 2 dilation: 1", tops=2))
    plain = load_from_text(pool_net(x.shape, "pool: MAX kernel_size: 2 stride: 2", tops=2))
    for top in ("p", "mask"):
        np.testing.assert_array_equal(model.run({"x": x})[top], plain.run({"x": x})[top])


@pytest.mark.parametrize("shape, params, message", [
    ((1, 2, 8, 8), "pool: MAX kernel_size: 2 dilation: 0", "dilation must be >= 1"),
    ((1, 2, 8, 8), "pool: MAX kernel_size: 2 dilation: 1 dilation: 2 dilation: 3", "given once or 2 times"),
    ((1, 2, 8, 8), "pool: STOCHASTIC kernel_size: 2 dilation: 2", "STOCHASTIC with a dilation"),
    ((1, 2, 8, 8), "pool: MAX kernel_size: 2 dilation: 2 round_mode: FLOOR", "always rounds up"),
    ((1, 2, 8, 8), "pool: AVE_EXC_PAD kernel_size: 2 dilation: 2", "synopsys-caffe"),
    ((1, 2, 8, 8), "pool: MAX kernel_size: 2 axis: 2", "only channels on axis 1"),
    ((1, 2, 5, 5), "pool: MAX kernel_size: 3 dilation: 3", "output would be empty"),
    ((1, 2, 5, 5), "pool: MAX global_pooling: true dilation: 2", "output would be empty"),
    ((1, 2, 6, 6), "pool: AVE kernel_size: 1 stride: 4 dilation: 2", "divides by zero"),
    ((1, 2, 6, 6), "pool: MAX kernel_size: 2 stride: 1 pad: 5 dilation: 1", "so wide"),
])
def test_bad_parameters_give_one_clear_line(shape, params, message):
    with pytest.raises(LayerError, match=message) as err:
        load_from_text(pool_net(shape, params))
    assert "\n" not in str(err.value)


def test_the_mask_top_with_a_dilation_is_refused():
    with pytest.raises(LayerError, match="argmax mask top") as err:
        load_from_text(pool_net((1, 2, 8, 8), "pool: MAX kernel_size: 2 dilation: 2", tops=2))
    assert "\n" not in str(err.value)
