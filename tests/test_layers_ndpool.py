"""N-D Pooling of VisionLearningGroup/R-C3D's caffe3d: PoolingParameter with repeated kernel_size / stride /
pad (once, or once per spatial axis) on 5-axis (N, C, D, H, W) blobs.  References are numpy loops written
from caffe3d's pooling_layer.cpp: Reshape's per-axis ceil rule (a last window starting in the padding is
dropped only on an axis that has a pad) and the MAX / AVE windows of its forward (MAX over the cells
inside the input starting from -FLT_MAX; AVE divides by the window clipped to size + pad)."""
import itertools
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, pool_net, repeated, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

FLT_MAX = float(np.finfo(np.float32).max)


def pooled_axis(n, k, s, p, padded=None):
    """padded: R-C3D drops a last window starting in the padding on a padded axis (None); 3D-Caffe's
    PoolingND on every axis once any axis has a pad (True / False)."""
    out = math.ceil((n + 2 * p - k) / s) + 1
    if (p if padded is None else padded) and (out - 1) * s >= n + p:
        out -= 1
    return out


def pool_nd_ref(x, method, kernel, stride, pad, any_axis_rule=False):
    sizes = x.shape[2:]
    padded = any(pad) if any_axis_rule else None
    outs = [pooled_axis(n, k, s, p, padded) for n, k, s, p in zip(sizes, kernel, stride, pad)]
    y = np.zeros(x.shape[:2] + tuple(outs))
    xd = x.astype(np.float64)
    for index in itertools.product(*[range(o) for o in outs]):
        starts = [o * s - p for o, s, p in zip(index, stride, pad)]
        if method == "MAX":
            lo = [max(a, 0) for a in starts]
            hi = [min(a + k, n) for a, k, n in zip(starts, kernel, sizes)]
            best = np.full(x.shape[:2], -FLT_MAX)
            for cell in itertools.product(*[range(a, b) for a, b in zip(lo, hi)]):
                v = xd[(slice(None), slice(None)) + cell]
                best = np.where(v > best, v, best)
            y[(slice(None), slice(None)) + index] = best
        else:
            ends = [min(a + k, n + p) for a, k, n, p in zip(starts, kernel, sizes, pad)]
            divisor = math.prod(b - a for a, b in zip(starts, ends))
            lo = [max(a, 0) for a in starts]
            hi = [min(b, n) for b, n in zip(ends, sizes)]
            total = np.zeros(x.shape[:2])
            for cell in itertools.product(*[range(a, b) for a, b in zip(lo, hi)]):
                total += xd[(slice(None), slice(None)) + cell]
            y[(slice(None), slice(None)) + index] = total / divisor
    return y


def check_pooled(model, feeds, ref, tmp_path):
    """The top "p" in torch, onnxruntime (opset 13 and the default) and model.py."""
    check_everywhere(model, feeds, {"p": ref}, tmp_path, 1e-6, 1e-6)


@pytest.mark.parametrize("method, kernel, stride, pad", [
    ("MAX", (1, 2, 2), (1, 2, 2), (0, 0, 0)),    # R-C3D's pool1
    ("MAX", (2, 2, 2), (2, 2, 2), (0, 0, 0)),    # ceil: the odd extents keep a clipped last window
    ("MAX", (2, 3, 2), (1, 2, 3), (1, 1, 0)),
    # D: kernel 1 stride 2 without pad keeps a window past the input (-FLT_MAX); BVLC's 2-D rule
    # would drop it because another axis has a pad, R-C3D's per-axis rule does not
    ("MAX", (1, 3, 3), (2, 2, 2), (0, 1, 1)),
    ("AVE", (3, 2, 3), (2, 1, 2), (1, 0, 1)),
    ("AVE", (2, 2, 2), (2, 2, 2), (0, 0, 0)),
    ("AVE", (3, 3, 2), (2, 3, 1), (2, 1, 1)),    # a last window dropped on D (starts in the padding)
])
def test_nd_pooling_against_the_loops(method, kernel, stride, pad, tmp_path):
    x = rng(3).standard_normal((2, 3, 4, 7, 6)).astype(np.float32)
    params = " ".join([f"pool: {method}", repeated("kernel_size", kernel), repeated("stride", stride),
                       repeated("pad", pad)])
    model = load_from_text(pool_net(x.shape, params))
    ref = pool_nd_ref(x, method, kernel, stride, pad)
    assert model.blob_shapes["p"] == ref.shape
    check_pooled(model, {"x": x}, ref, tmp_path)


def test_nd_pooling_single_values_apply_to_every_axis(tmp_path):
    x = rng(4).standard_normal((1, 2, 5, 6, 9)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, "pool: AVE kernel_size: 3 stride: 2 pad: 1"))
    check_pooled(model, {"x": x}, pool_nd_ref(x, "AVE", (3, 3, 3), (2, 2, 2), (1, 1, 1)), tmp_path)


def test_nd_pooling_keeps_minus_flt_max_for_an_all_minus_inf_window(tmp_path):
    x = rng(5).standard_normal((1, 2, 4, 4, 4)).astype(np.float32)
    x[:, :, :2, :2, :2] = -np.inf
    model = load_from_text(pool_net(x.shape, "pool: MAX kernel_size: 2 stride: 2"))
    ref = pool_nd_ref(x, "MAX", (2, 2, 2), (2, 2, 2), (0, 0, 0))
    assert ref[0, 0, 0, 0, 0] == -FLT_MAX
    check_pooled(model, {"x": x}, ref, tmp_path)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_nd_global_pooling(method, tmp_path):
    x = rng(6).standard_normal((2, 3, 3, 5, 4)).astype(np.float32)
    model = load_from_text(pool_net(x.shape, f"pool: {method} global_pooling: true"))
    ref = pool_nd_ref(x, method, x.shape[2:], (1, 1, 1), (0, 0, 0))
    assert ref.shape == (2, 3, 1, 1, 1)
    check_pooled(model, {"x": x}, ref, tmp_path)


def test_two_d_pooling_reads_repeated_values_as_kernel_h_w():
    x = rng(7).standard_normal((2, 3, 9, 8)).astype(np.float32)
    hw = load_from_text(pool_net(x.shape, "pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 "
                                          "pad_w: 1")).run({"x": x})["p"]
    rep = load_from_text(pool_net(x.shape, "pool: AVE kernel_size: 3 kernel_size: 2 stride: 2 stride: 1 "
                                           "pad: 1 pad: 1")).run({"x": x})["p"]
    np.testing.assert_array_equal(hw, rep)


@pytest.mark.parametrize("shape, params, tops, msg", [
    ((1, 2, 4, 5, 6), "kernel_size: 2 kernel_size: 2", 1, "kernel_size must be given once or 3 times, got 2"),
    ((1, 2, 4, 5, 6), "kernel_h: 2 kernel_w: 2", 1, "kernel_h/kernel_w only work for 2-D data"),
    ((1, 2, 4, 5, 6), "pool: STOCHASTIC kernel_size: 2", 1, "N-D pooling .5-axis input. has MAX and AVE only"),
    ((1, 2, 4, 5, 6), "kernel_size: 2", 2, "the argmax mask top exists for 2-D pooling only"),
    ((1, 2, 4, 5, 6), "pool: AVE kernel_size: 1 stride: 3", 1, "the last AVE window of axis 3 starts past"),
    ((1, 2, 4, 5, 6), "kernel_size: 2 pad: 2", 1, "must be smaller than kernel"),
    ((1, 2, 5, 6), "kernel_size: 2 kernel_size: 2 kernel_size: 2", 1, "kernel_size must be given once or 2 times"),
    ((2, 5, 6), "kernel_size: 2", 1, "Pooling needs a 4-axis input"),
])
def test_nd_pooling_bad_params(shape, params, tops, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(pool_net(shape, params, tops))


def test_global_pooling_with_a_kernel_too_pools_the_whole_plane_with_a_note():
    # paddle-mobile's MobileNet deploy: `global_pooling: true kernel_size: 7`, which Caffe refuses and OpenCV reads
    x = rng(8).standard_normal((2, 3, 5, 6, 7)).astype(np.float32)
    for shape, kernel in (((2, 3, 9, 8), "kernel_size: 7"), (x.shape, "kernel_size: 2 kernel_size: 2 kernel_size: 2")):
        data = x if len(shape) == 5 else x.reshape(-1)[:np.prod(shape)].reshape(shape)
        model = load_from_text(pool_net(shape, f"pool: AVE global_pooling: true {kernel}"))
        out = model.run({"x": data})["p"]
        np.testing.assert_allclose(out, data.mean(axis=tuple(range(2, len(shape))), keepdims=True), rtol=1e-6, atol=1e-6)
        assert any("global_pooling with kernel_size too, which Caffe refuses" in w for w in model.warnings)


def test_r_c3d_thumos14_reads_up_to_its_proposals(tmp_path):
    # R-C3D's test net up to its temporal proposal layer (tests/test_layers_rc3d.py): C3D's 3-D convolutions and
    # five N-D poolings, (1, 3, 512, 112, 112) down to 64 x 1 x 1 anchors' positions
    from pathlib import Path
    text = (Path(__file__).parent / "fixtures" / "realworld" /
            "VisionLearningGroup__R-C3D__experiments__thumos14__test__test.prototxt").read_text()
    cut = tmp_path / "rc3d_trunk.prototxt"
    cut.write_text(text[:text.index("layer {\n  name: 'proposal'")])
    shapes = load_from_text(cut.read_text()).blob_shapes
    expect = {"data": (1, 3, 512, 112, 112)}
    size = [512, 112, 112]
    for name, k, s in [("pool1", (1, 2, 2), (1, 2, 2)), ("pool2", (2, 2, 2), (2, 2, 2)), ("pool3", (2, 2, 2), (2, 2, 2)),
                       ("pool4", (2, 2, 2), (2, 2, 2))]:
        size = [pooled_axis(n, kk, ss, 0) for n, kk, ss in zip(size, k, s)]
        expect[name] = tuple(shapes[name][:2]) + tuple(size)
    size = [pooled_axis(n, kk, ss, 0) for n, kk, ss in zip(size, (1, 7, 7), (1, 1, 1))]
    expect["rpn/output_pool"] = (1, 512) + tuple(size)
    for name, shape in expect.items():
        assert shapes[name] == shape, name
    assert shapes["pool4"] == (1, 512, 64, 7, 7) and shapes["rpn/output_pool"] == (1, 512, 64, 1, 1)


# ---- 3D-Caffe's PoolingND (pooling_nd_param) ------------------------------------------------------
# The reference is the same loops: 3D-Caffe's pooling_nd_layer.cpp pools 2 or 3 spatial axes with
# BVLC's windows, and its Reshape drops a last window starting in the padding on every axis once any
# axis has a pad (`if (pad_sum)`), as BVLC's 2-D pooling does.

def pooling_nd_net(shape, params):
    return net(f'layer {{ name: "p" type: "PoolingND" bottom: "x" top: "p" pooling_nd_param {{ {params} }} }}',
               inputs={"x": shape})


@pytest.mark.parametrize("method, kernel, stride, pad, unlike_r_c3d", [
    ("MAX", (2, 2, 2), (2, 2, 2), (0, 0, 0), False),    # the 3-D U-Nets' pools (ceil keeps clipped windows)
    ("AVE", (3, 2, 3), (2, 1, 2), (1, 0, 1), False),
    # D has no pad, but H has: D's last window (starting at 4 >= 4 + 0) is dropped as well
    ("MAX", (1, 3, 3), (2, 2, 2), (0, 1, 1), True),
])
def test_pooling_nd_against_the_loops(method, kernel, stride, pad, unlike_r_c3d, tmp_path):
    x = rng(8).standard_normal((2, 3, 4, 7, 6)).astype(np.float32)
    params = " ".join([f"pool: {method}", repeated("kernel_size", kernel), repeated("stride", stride),
                       repeated("pad", pad)])
    model = load_from_text(pooling_nd_net(x.shape, params))
    ref = pool_nd_ref(x, method, kernel, stride, pad, any_axis_rule=True)
    assert model.blob_shapes["p"] == ref.shape
    check_pooled(model, {"x": x}, ref, tmp_path)
    # the rule that tells it from R-C3D's N-D Pooling
    assert (ref.shape != pool_nd_ref(x, method, kernel, stride, pad).shape) == unlike_r_c3d


def test_pooling_nd_on_two_spatial_axes_is_caffes_pooling(tmp_path):
    x = rng(9).standard_normal((2, 3, 9, 8)).astype(np.float32)
    nd = load_from_text(pooling_nd_net(x.shape, "pool: AVE kernel_size: 3 kernel_size: 2 stride: 2 pad: 1"))
    ref = pool_nd_ref(x, "AVE", (3, 2), (2, 2), (1, 1), any_axis_rule=True)
    check_pooled(nd, {"x": x}, ref, tmp_path)
    plain = load_from_text(pool_net(x.shape, "pool: AVE kernel_h: 3 kernel_w: 2 stride: 2 pad: 1"))
    np.testing.assert_array_equal(nd.run({"x": x})["p"], plain.run({"x": x})["p"])


def test_pooling_nd_refuses_another_channel_axis():
    with pytest.raises(LayerError, match="pooling_nd_param.axis 2: only channels on axis 1"):
        load_from_text(pooling_nd_net((1, 2, 4, 5, 6), "kernel_size: 2 axis: 2"))


def test_unet3d_train_file_reads_with_its_pooling_nd(capsys):
    from pathlib import Path

    from caffeq.__main__ import main
    path = Path(__file__).parent / "fixtures" / "realworld" / "jackyko1991__unet3d-pytorch__train.prototxt"
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "d1a_pool    PoolingND" in out and "5x32x78x78x4" in out
